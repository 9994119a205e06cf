"""Generated blocks of the README: the text between a begin marker (an HTML comment whose start is
fixed, e.g. ``<!-- bench:twin:begin``, and whose rest says which script writes it) and an end marker
(``<!-- bench:twin:end -->``).  Scripts rewrite a block whole, so what it shows cannot drift from the
data it was made from; the bench tables (``speed_tables``) and the Results section
(``experiments/results_section.py``) are such blocks.
"""
from __future__ import annotations

import re

from lora_opt.errors import InputError


def count_blocks(text: str, begin_prefix: str, end: str) -> int:
    """How many blocks ``begin_prefix ... -->`` ... ``end`` the text holds."""
    return len(_pattern(begin_prefix, end).findall(text))


def replace_block(text: str, begin_prefix: str, end: str, block: str) -> str:
    """``text`` with its one block (markers included) replaced by ``block`` (which brings its own
    markers); InputError naming the markers when the text has no such block, or more than one."""
    pattern = _pattern(begin_prefix, end)
    found = pattern.findall(text)
    if len(found) != 1:
        raise InputError(f"README: expected one block {begin_prefix} ... --> ... {end}, found {len(found)}")
    return pattern.sub(lambda _: block, text)


def _pattern(begin_prefix: str, end: str) -> re.Pattern:
    return re.compile(re.escape(begin_prefix) + r"[^\n]*-->\n.*?" + re.escape(end), re.S)
