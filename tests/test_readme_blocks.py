"""The README's generated blocks: found by their markers' fixed starts, replaced whole, never doubled."""
import pytest

from lora_opt.errors import InputError
from generated_blocks import count_blocks, replace_block


def test_a_block_is_found_by_its_begin_prefix_whatever_the_rest_of_the_comment_says():
    text = "a\n<!-- r:begin (written by an older script) -->\nold\n<!-- r:end -->\nb\n"
    new = "<!-- r:begin (written by x.py) -->\nnew\n<!-- r:end -->"
    assert count_blocks(text, "<!-- r:begin", "<!-- r:end -->") == 1
    out = replace_block(text, "<!-- r:begin", "<!-- r:end -->", new)
    assert out == "a\n" + new + "\nb\n"
    assert replace_block(out, "<!-- r:begin", "<!-- r:end -->", new) == out


@pytest.mark.parametrize("text", ["no block\n", "<!-- r:begin x -->\n1\n<!-- r:end -->\n<!-- r:begin y -->\n2\n<!-- r:end -->\n"])
def test_no_block_or_two_blocks_is_an_input_error_naming_the_markers(text):
    with pytest.raises(InputError, match="r:begin"):
        replace_block(text, "<!-- r:begin", "<!-- r:end -->", "x")
