"""The OpenAI/vLLM request and response shapes the emulator speaks, and its length rules.

Prompt length: a prompt of token ids has their count; a text prompt has ``ceil(characters / 4)``
tokens (at least 1; no tokenizer is loaded); a chat request has, per message, its content's tokens
by the same rule + 4 (role and separators), + 3 for the assistant's turn.

Output length: ``max_tokens`` (``max_completion_tokens`` for chat; default 16 for completions and
``max_model_len - prompt`` for chat, as vLLM) with ``ignore_eos``; otherwise the request stops at
an EOS drawn from the scenario's length model, clamped to ``[max(1, min_tokens), max_tokens]``
(``finish_reason`` "stop" when it ends before ``max_tokens``, else "length").  The text is filler:
one word per token.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

CHARS_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_REPLY = 3
COMPLETION_DEFAULT_MAX_TOKENS = 16
FILLER = ("the", "twin", "of", "a", "vLLM", "engine", "serving", "many", "LoRA", "adapters", "emulates",
          "this", "stream", "token", "by", "token")


class APIError(Exception):
    """An error answered with vLLM's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_

    def body(self) -> dict:
        # vLLM 0.33's ErrorResponse (the launch commands' version): the OpenAI envelope with the HTTP
        # status as an int code (vLLM <= 0.8 answered the flat {"object": "error", ...} form)
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.status}}


def bad(message: str) -> APIError:
    return APIError(400, message)


@dataclass
class ParsedRequest:
    model: str
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool
    min_tokens: int
    stream: bool
    include_usage: bool
    chat: bool


def _int_field(body: dict, name: str, default, minimum: int):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"[{{'type': 'int_type', 'loc': ('body', '{name}'), 'msg': 'Input should be a valid integer', "
                  f"'input': {v!r}}}]")
    if v < minimum:
        raise bad(f"{name} must be at least {minimum}, got {v}.")
    return v


def _bool_field(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"[{{'type': 'bool_type', 'loc': ('body', '{name}'), 'msg': 'Input should be a valid boolean', "
                  f"'input': {v!r}}}]")
    return v


def text_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _prompt_tokens(prompt) -> int:
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return _prompt_tokens(prompt[0])
        if all(isinstance(p, (str, list)) for p in prompt):
            raise bad("the emulator serves one prompt per request (send a batch as separate requests)")
    raise bad("[{'type': 'value_error', 'loc': ('body', 'prompt'), 'msg': 'prompt must be a string, a list of "
              "token ids or a list with one of them'}]")


def _chat_tokens(messages) -> int:
    if not isinstance(messages, list) or not messages:
        raise bad("[{'type': 'list_type', 'loc': ('body', 'messages'), 'msg': 'Input should be a valid list'}]")
    n = CHAT_TOKENS_REPLY
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("[{'type': 'value_error', 'loc': ('body', 'messages'), 'msg': 'each message needs a role'}]")
        content = m.get("content") or ""
        if isinstance(content, list):        # content parts: their text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise bad("[{'type': 'string_type', 'loc': ('body', 'messages', 'content'), "
                      "'msg': 'Input should be a valid string'}]")
        n += (text_tokens(content) if content else 0) + CHAT_TOKENS_PER_MESSAGE
    return n


def parse_request(body, chat: bool, max_model_len: int) -> ParsedRequest:
    """Validate a completions / chat completions body (vLLM's 400 messages)."""
    if not isinstance(body, dict):
        raise bad("[{'type': 'model_attributes_type', 'loc': ('body',), 'msg': 'Input should be a valid "
                  "dictionary or object to extract fields from'}]")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("[{'type': 'string_type', 'loc': ('body', 'model'), 'msg': 'Input should be a valid string'}]")
    if chat:
        prompt = _chat_tokens(body.get("messages"))
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _int_field({"max_tokens": mt}, "max_tokens", None, 1)
    else:
        if "prompt" not in body:
            raise bad("[{'type': 'missing', 'loc': ('body', 'prompt'), 'msg': 'Field required'}]")
        prompt = _prompt_tokens(body["prompt"])
        max_tokens = _int_field(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, 1)
    if _int_field(body, "n", 1, 1) != 1:
        raise bad("the emulator serves n = 1")
    if max_tokens is None:
        max_tokens = max_model_len - prompt
    if prompt + max_tokens > max_model_len or max_tokens < 1:
        where = "messages" if chat else "prompt"
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                  f"{prompt + max_tokens} tokens ({prompt} in the {where}, {max_tokens} in the completion). "
                  "Please reduce the length of the messages or completion.")
    min_tokens = _int_field(body, "min_tokens", 0, 0)
    if min_tokens > max_tokens:
        raise bad(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    opts = body.get("stream_options") or {}
    return ParsedRequest(model=model or "", prompt_tokens=prompt, max_tokens=max_tokens,
                         ignore_eos=_bool_field(body, "ignore_eos", False),
                         min_tokens=min_tokens, stream=_bool_field(body, "stream", False),
                         include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")), chat=chat)


def filler(start: int, n: int) -> str:
    return "".join(" " + FILLER[i % len(FILLER)] for i in range(start, start + n))


class Formatter:
    """Response bodies and SSE chunks of one request (byte templates: the per-token cost is one
    string concatenation)."""

    def __init__(self, p: ParsedRequest, model: str):
        self.p, self.model = p, model
        self.chat = p.chat
        self.id = ("chatcmpl-" if p.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        obj = "chat.completion.chunk" if p.chat else "text_completion"
        head = f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},"model":{json.dumps(model)},'
        if p.chat:
            self._pre = head + '"choices":[{"index":0,"delta":{"content":'
            self._post = '},"logprobs":null,"finish_reason":null}]}\n\n'
            self._post_end = '},"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n'
        else:
            self._pre = head + '"choices":[{"index":0,"text":'
            self._post = ',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            self._post_end = ',"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n'
        self._head = head

    def first_chunk(self) -> bytes:
        """Chat streams open with the assistant's role (vLLM)."""
        if not self.chat:
            return b""
        return (self._head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                '"logprobs":null,"finish_reason":null}]}\n\n').encode()

    def chunks(self, start: int, stop: int, finish_reason: str | None) -> bytes:
        """SSE chunks of tokens ``start .. stop - 1`` (the last one with ``finish_reason``)."""
        out = []
        for i in range(start, stop):
            word = '" ' + FILLER[i % len(FILLER)] + '"'
            end = (self._post_end % finish_reason) if (finish_reason and i == stop - 1) else self._post
            out.append(self._pre + word + end)
        return "".join(out).encode()

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.p.prompt_tokens, "total_tokens": self.p.prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens, "prompt_tokens_details": None}

    def tail(self, completion_tokens: int) -> bytes:
        """The usage chunk (when asked for) and ``[DONE]``."""
        out = ""
        if self.p.include_usage:
            out = self._head + '"choices":[],"usage":' + json.dumps(self.usage(completion_tokens)) + "}\n\n"
        return (out + "data: [DONE]\n\n").encode()

    def full(self, completion_tokens: int, finish_reason: str) -> dict:
        text = filler(0, completion_tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(completion_tokens)}
