"""What the emulator reads from a model directory, as ``vllm serve MODEL`` does: the vocabulary size
and context length (``config.json``), the tokenizer (``tokenizer.json``, through the ``tokenizers``
package) and the chat template (``tokenizer_config.json`` or ``chat_template.jinja``, rendered with
``jinja2``) -- both the optional ``[tokenizer]`` extra.  Without them it counts text as before:
``ceil(characters / 4)`` tokens (at least 1), and a chat request as its messages' tokens + 4 each + 3
for the reply.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path

from lora_opt.errors import InputError
from twin.parsing import read_json_file

CHARS_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_REPLY = 3


def text_tokens(text: str) -> int:
    """The 4-characters rule (no tokenizer)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def message_text(content) -> str:
    """A message's content as the chat template sees it: a string, or its text parts joined by
    newlines (vLLM's rendering of content-part lists for string-content templates)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return ""


@dataclass
class ModelFiles:
    """A model directory's tokenizer and limits (``None`` fields: not known)."""

    path: str
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    tokenizer: object = None
    """A ``tokenizers.Tokenizer`` (None: the 4-characters rule)."""
    chat_template: object = None
    """A compiled ``jinja2`` template (None: the per-message rule)."""
    special: dict | None = None
    _max_chars: int | None = None

    @classmethod
    def load(cls, path: str) -> "ModelFiles":
        d = Path(path)
        if not d.is_dir():
            raise InputError(f"--model: not a directory: {path} (the model directory vllm serve is given)")
        out = cls(str(d))
        cfg = _read_json(d / "config.json")
        if cfg:
            out.vocab_size = _positive(cfg.get("vocab_size"))
            out.max_position_embeddings = _positive(cfg.get("max_position_embeddings"))
        tok_cfg = _read_json(d / "tokenizer_config.json") or {}
        out.special = {k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token")}
        tokenizers = optional_module("tokenizers")
        if (d / "tokenizer.json").is_file() and tokenizers is not None:
            try:
                out.tokenizer = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
            except Exception as exc:       # a tokenizer file this tokenizers release cannot read
                raise InputError(f"--model: cannot read {d / 'tokenizer.json'}: {exc}") from None
        template = tok_cfg.get("chat_template")
        if not isinstance(template, str) and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()     # transformers >= 4.43 saves it beside
        sandbox = optional_module("jinja2.sandbox")
        if isinstance(template, str) and sandbox is not None:
            # transformers' apply_chat_template environment (vLLM renders with it)
            env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            out.chat_template = env.from_string(template)
        return out

    # ---- counting -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """The token ids of ``text`` (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def count_text(self, text: str, add_special_tokens: bool = True) -> int:
        ids = self.encode(text, add_special_tokens)
        return text_tokens(text) if ids is None else len(ids)

    def render_chat(self, messages: list, add_generation_prompt: bool = True) -> str | None:
        """The chat template applied to ``messages`` (None without template or tokenizer)."""
        if self.chat_template is None or self.tokenizer is None:
            return None
        msgs = [{**m, "content": message_text(m.get("content"))} for m in messages]
        return self.chat_template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         **(self.special or {}))

    def chat_ids(self, messages: list, add_generation_prompt: bool = True) -> list[int] | None:
        text = self.render_chat(messages, add_generation_prompt)
        return None if text is None else self.encode(text, add_special_tokens=False)

    def count_chat(self, messages: list) -> int:
        ids = self.chat_ids(messages)
        if ids is not None:
            return len(ids)
        texts = [message_text(m.get("content")) for m in messages]
        return CHAT_TOKENS_REPLY + sum(CHAT_TOKENS_PER_MESSAGE + (text_tokens(t) if t else 0) for t in texts)

    @property
    def max_chars_per_token(self) -> int:
        """The longest token's characters (vLLM bounds a text prompt's length by it before tokenizing)."""
        if self._max_chars is None:
            vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
            self._max_chars = max((len(t) for t in vocab), default=CHARS_PER_TOKEN)
        return self._max_chars

    def token_strs(self, ids: list[int]) -> list[str] | None:
        if self.tokenizer is None:
            return None
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.tokenizer.get_vocab_size()])


def optional_module(name: str):
    """``name`` imported, or None when not installed: ``tokenizers`` and ``jinja2`` are the optional
    ``[tokenizer]`` extra (pyproject.toml), not dependencies of lora-opt -- without them text is
    counted 4 characters a token."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def no_model_files() -> ModelFiles:
    """No model directory: the 4-characters rule, no vocabulary check beyond the profile's."""
    return ModelFiles(path="")


def _read_json(p: Path) -> dict | None:
    try:
        d = read_json_file(p, "model file", InputError, allow_nan=True)
    except InputError:
        return None
    return d if isinstance(d, dict) else None


def _positive(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _token_text(v) -> str:
    if isinstance(v, dict):                     # AddedToken form
        return str(v.get("content", ""))
    return v if isinstance(v, str) else ""
