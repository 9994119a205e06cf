"""The OpenAI/vLLM request and response shapes the emulator speaks: vLLM's request validation, in
vLLM's order and with its messages, and its length rules.

The order a request is checked in (vLLM 0.32's, read in its source and measured on the CPU build):

1. the content type (``application/json`` only) and the JSON body (FastAPI's errors);
2. vLLM's "before" model validators, last defined first as pydantic runs them (``stream_options``
   without ``stream``, an empty prompt, ``logprobs`` / ``prompt_logprobs`` / ``top_logprobs``);
3. the fields' types: a pydantic model with vLLM's types for the fields clients send, so that a
   type error gets pydantic's own message, formatted by vLLM's handler (``type: "Bad Request"``,
   ``param: "body.<field>"``; ``N validation errors:\\n  {...}``);
4. the model name (404), then rendering: ``max_tokens`` over ``max_model_len``, the prompt's length
   and its token ids against the vocabulary;
5. ``max_tokens`` clamped to ``max_model_len - prompt`` (0.8.5: refused), then vLLM's
   ``SamplingParams`` checks (``temperature``, ``top_p``, ``n``, ``min_tokens`` ...) and the engine's
   (``logprobs`` at most 20).

Prompt length: token ids count as themselves; text goes through the model's tokenizer when the
emulator has one (``--model``, ``lora_opt.emulate.model_files``), else ``ceil(characters / 4)``.

Output length: ``max_tokens`` (``max_completion_tokens`` for chat; default 16 for completions and
``max_model_len - prompt`` for chat, as vLLM) with ``ignore_eos``; otherwise the request stops at
an EOS drawn from the scenario's length model, clamped to ``[max(1, min_tokens), max_tokens]``
(``finish_reason`` "stop" when it ends before ``max_tokens``, else "length").  The text is filler:
one word per token.  ``n`` choices and a list of prompts are served as one engine request per
choice, as vLLM does.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field, ValidationError

from lora_opt.emulate.model_files import ModelFiles, no_model_files
from lora_opt.emulate.request_validation import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    INT64_MAX,
    MAX_LOGPROBS,
    MAX_N_SEQUENCES,
    SAMPLING_EPS,
    ChatFields,
    CompletionFields,
    OpenModel,
    VLLMValidationError,
    bad,
    chat_before_checks,
    check_messages,
    completion_before_checks,
    from_vllm_error,
    pydantic_errors,
    read_json_body,
    validate_fields,
    validation_failure,
)
from lora_opt.emulate.vllm_versions import VERSIONS, VllmBehaviour
from twin.flags import DEFAULT_VLLM_VERSION

FILLER = ("the", "twin", "of", "a", "vLLM", "engine", "serving", "many", "LoRA", "adapters", "emulates",
          "this", "stream", "token", "by", "token")


# ---- the parsed request ----------------------------------------------------------------------------
@dataclass
class ApiContext:
    """What an instance's request checks need: the imitated version, the length limit, the
    vocabulary and tokenizer."""

    behaviour: VllmBehaviour = field(default_factory=lambda: VERSIONS[DEFAULT_VLLM_VERSION])
    max_model_len: int = 4096
    vocab_size: int | None = None
    files: ModelFiles = field(default_factory=no_model_files)


@dataclass
class Prompt:
    tokens: int
    max_tokens: int
    """``max_tokens`` served (clamped to the context where vLLM clamps)."""
    text: str = ""
    """The prompt's text (echo)."""


@dataclass
class ParsedRequest:
    model: str
    prompts: list[Prompt]
    n: int
    ignore_eos: bool
    min_tokens: int
    stream: bool
    include_usage: bool
    chat: bool
    echo: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(p.tokens for p in self.prompts)

    @property
    def max_tokens(self) -> int:
        return self.prompts[0].max_tokens


def parse_request(raw: bytes, content_type: str, chat: bool, ctx: ApiContext, check_model=None) -> ParsedRequest:
    """A completions / chat completions request checked as vLLM checks it (see the module's
    docstring); raises :class:`APIError` (or :class:`DetailError`).  ``check_model(name)`` raises
    the 404 of an unknown model."""
    b = ctx.behaviour
    body = read_json_body(raw, content_type, b)
    if isinstance(body, dict):
        try:
            (chat_before_checks if chat else completion_before_checks)(body)
        except VLLMValidationError as exc:
            raise from_vllm_error(exc) from None
        except TypeError:           # a comparison on a value of another type: pydantic reports the field below
            pass
        if not chat and body.get("max_tokens") is None and "max_tokens" in body:
            body = {**body, "max_tokens": COMPLETION_DEFAULT_MAX_TOKENS}     # vLLM: explicit null -> 16
    req = validate_fields(ChatFields if chat else CompletionFields, body, b)
    if chat:
        check_messages(req.messages, b)
    if req.stream and req.use_beam_search:
        raise bad("Streaming is not currently supported with beam search")
    if check_model is not None:
        check_model(req.model)
    if chat:
        if not req.messages:
            raise bad("Cannot apply chat template to an empty conversation. Provide at least one message.")
        asked, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                        else (req.max_tokens, "max_tokens"))
    else:
        asked, param = req.max_tokens, "max_tokens"
    if b.clamps_max_tokens and asked and asked > ctx.max_model_len:
        raise from_vllm_error(VLLMValidationError(
            f"{param}={asked} cannot be greater than max_model_len={ctx.max_model_len}. Please request fewer "
            "output tokens.", parameter=param, value=asked))
    trunc = req.truncate_prompt_tokens
    if trunc is not None and trunc > ctx.max_model_len:
        raise from_vllm_error(VLLMValidationError(
            f"truncate_prompt_tokens={trunc} cannot be greater than max_model_len = {ctx.max_model_len}. Please "
            "request a smaller truncation size.", parameter="truncate_prompt_tokens", value=trunc))
    if not chat and req.suffix is not None:
        raise bad("suffix is only supported for models with FIM completion rendering" if isinstance(req.prompt, str)
                  else "suffix requires text prompt input for FIM completion rendering", "suffix")
    if not chat and req.echo and asked == 0:
        asked = 1                           # vLLM: echo without generation samples one token
    prompts = _chat_prompt(req, ctx) if chat else _completion_prompts(req, ctx)
    out = []
    for tokens, text in prompts:
        if trunc is not None:               # the tokenizer's truncation (-1: the context less one)
            tokens = min(tokens, ctx.max_model_len - 1 if trunc < 0 else trunc)
        if not b.clamps_max_tokens:          # vLLM 0.8.5: one check of prompt + max_tokens, refused (no clamp)
            _refuse_over_length(tokens, asked, ctx.max_model_len)
        if tokens > ctx.max_model_len:       # rendering's check (before the clamp)
            raise from_vllm_error(VLLMValidationError(
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, your prompt contains "
                f"{'at least ' if tokens == ctx.max_model_len + 1 else ''}{tokens} input tokens, which exceeds this "
                "limit even without any output tokens. Please reduce the length of the input prompt.",
                parameter="input_tokens", value=tokens))
        room = ctx.max_model_len - tokens
        out.append(Prompt(tokens, room if asked is None else min(room, asked), text))
    for p in out:
        _verify_sampling(req, p.max_tokens)
    _verify_engine(req, chat, ctx)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return ParsedRequest(model=req.model or "", prompts=out, n=req.n if req.n is not None else 1,
                         ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, stream=bool(req.stream),
                         include_usage=include_usage, chat=chat, echo=bool(req.echo))


def _refuse_over_length(tokens: int, asked: int | None, max_model_len: int) -> None:
    """vLLM 0.8.5's length check (``serving_engine._validate_input``): prompt + max_tokens over the
    context is refused, not clamped."""
    if asked is None and tokens >= max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested {tokens} "
                  "tokens in the messages, Please reduce the length of the messages.")
    if asked is not None and tokens + asked > max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                  f"{tokens + asked} tokens ({tokens} in the messages, {asked} in the completion). Please reduce "
                  "the length of the messages or completion.")


def _count_capped(ctx: ApiContext, text: str, add_special_tokens: bool, truncating: bool = False) -> int:
    """Tokens of a text prompt; past the limit, ``max_model_len + 1`` (vLLM tokenizes with truncation
    there, so its message says "at least").  A text longer than any ``max_model_len`` tokens can be
    (characters: the longest token's x ``max_model_len``) is refused before tokenizing, as vLLM does."""
    most = ctx.max_model_len * ctx.files.max_chars_per_token if ctx.files.tokenizer is not None else None
    if most is not None and not truncating and len(text) > most:
        raise from_vllm_error(VLLMValidationError(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, your prompt contains "
            f"{len(text)} characters (more than {most} characters, which is the upper bound for "
            f"{ctx.max_model_len} input tokens). Please reduce the length of the input prompt.",
            parameter="input_text", value=len(text)))
    if not text:
        return 0
    return min(ctx.files.count_text(text, add_special_tokens), ctx.max_model_len + 1)


def _completion_prompts(req: CompletionFields, ctx: ApiContext) -> list[tuple[int, str]]:
    if req.prompt_embeds:                   # vLLM serves them only with --enable-prompt-embeds (not emulated)
        raise from_vllm_error(VLLMValidationError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.",
                                                  parameter="prompt_embeds"))
    p = req.prompt
    truncating = req.truncate_prompt_tokens is not None
    if isinstance(p, str):
        return [(_count_capped(ctx, p, req.add_special_tokens, truncating), p)]
    if not p:
        raise bad("You must pass at least one prompt")
    items = [p] if all(isinstance(t, int) for t in p) else list(p)
    out = []
    for item in items:
        if isinstance(item, str):
            n = _count_capped(ctx, item, req.add_special_tokens, truncating)
            if n == 0:
                raise bad("The decoder prompt cannot be empty")
            out.append((n, item))
            continue
        if not item:
            raise bad("The decoder prompt cannot be empty")
        _check_vocabulary(item, ctx)
        out.append((len(item), ""))
    return out


def _check_vocabulary(ids: list[int], ctx: ApiContext) -> None:
    if ctx.vocab_size is None:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise bad(f"Token id {lo} is out of vocabulary")
    if hi > ctx.vocab_size - 1:
        raise bad(f"Token id {hi} is out of vocabulary")


def _chat_prompt(req: ChatFields, ctx: ApiContext) -> list[tuple[int, str]]:
    text = ctx.files.render_chat(req.messages, req.add_generation_prompt)
    if text is not None:
        return [(_count_capped(ctx, text, req.add_special_tokens, req.truncate_prompt_tokens is not None), "")]
    return [(min(ctx.files.count_chat(req.messages), ctx.max_model_len + 1), "")]


def _verify_sampling(req, max_tokens: int) -> None:
    """vLLM's ``SamplingParams._verify_args`` on the request's values (vLLM's defaults for the unset)."""
    def value(name, default):
        v = getattr(req, name, None)
        return default if v is None else v
    if req.logit_bias:
        invalid = []
        for token in req.logit_bias:
            try:
                int(token)
            except ValueError:
                invalid.append(token)
        if invalid:
            raise from_vllm_error(VLLMValidationError(
                f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}",
                parameter="logit_bias", value=invalid))
    n = value("n", 1)
    presence, frequency = float(value("presence_penalty", 0.0)), float(value("frequency_penalty", 0.0))
    repetition, temperature = float(value("repetition_penalty", 1.0)), float(value("temperature", 1.0))
    top_p, top_k, min_p = float(value("top_p", 1.0)), value("top_k", 0), float(value("min_p", 0.0))
    if n < 1:
        raise bad(f"n must be at least 1, got {n}.")
    if n > MAX_N_SEQUENCES:
        raise bad(f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set the "
                  "VLLM_MAX_N_SEQUENCES environment variable.")
    checks = [
        (not -2.0 <= presence <= 2.0, f"presence_penalty must be in [-2, 2], got {presence}.", None, None),
        (not -2.0 <= frequency <= 2.0, f"frequency_penalty must be in [-2, 2], got {frequency}.", None, None),
        (not math.isfinite(repetition), f"repetition_penalty must be a finite number, got {repetition}.", None, None),
        (repetition <= 0.0, f"repetition_penalty must be greater than zero, got {repetition}.", None, None),
        (not math.isfinite(temperature), f"temperature must be a finite number, got {temperature}.", "temperature",
         temperature),
        (temperature < 0.0, f"temperature must be non-negative, got {temperature}.", "temperature", temperature),
        (temperature > 2.0, f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature),
        (not 0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p),
        (top_k < -1, f"top_k must be 0 (disable), or at least 1, got {top_k}.", None, None),
        (not 0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}.", None, None),
        (max_tokens < 1, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens),
        (req.min_tokens < 0, f"min_tokens must be greater than or equal to 0, got {req.min_tokens}.", None, None),
        (req.min_tokens > max_tokens,
         f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {req.min_tokens}.", None, None),
    ]
    for failed, message, param, v in checks:
        if failed:
            raise from_vllm_error(VLLMValidationError(message, parameter=param, value=v))
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(not s for s in stop):
        raise bad("stop cannot contain an empty string.")
    if any(not w for w in req.bad_words):
        raise bad(f"bad_words cannot contain an empty string. Got bad_words={list(dict.fromkeys(req.bad_words))}")
    if temperature < SAMPLING_EPS and n > 1:
        raise bad(f"n must be 1 when using greedy sampling, got {n}.")


def _verify_engine(req, chat: bool, ctx: ApiContext) -> None:
    """The engine's checks of a request it is handed (``SamplingParams.verify``): ``logprobs`` and
    ``prompt_logprobs`` at most ``max_logprobs`` (-1: the vocabulary), token ids in ``logit_bias``,
    ``stop_token_ids`` and ``allowed_token_ids`` inside the vocabulary."""
    vocab = ctx.vocab_size
    num = (req.top_logprobs if req.logprobs else None) if chat else req.logprobs
    for name, asked in (("logprobs", num), ("prompt_logprobs", req.prompt_logprobs)):
        if asked == -1 and vocab is not None:
            asked = vocab
        if asked and asked > MAX_LOGPROBS:
            what = "sample" if name == "logprobs" else "prompt"
            raise from_vllm_error(VLLMValidationError(
                f"Requested {what} logprobs of {asked}, which is greater than max allowed: {MAX_LOGPROBS}",
                parameter=name, value=asked))
    if vocab is None:
        return
    for name, ids in (("logit_bias", [int(t) for t in (req.logit_bias or {})]),
                      ("stop_token_ids", list(dict.fromkeys(req.stop_token_ids or [])))):
        invalid = [t for t in ids if t < 0 or t >= vocab]
        if invalid:
            raise from_vllm_error(VLLMValidationError(
                f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. Vocabulary size: {vocab}",
                parameter=name, value=invalid))
    allowed = req.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise from_vllm_error(VLLMValidationError("allowed_token_ids is not None and empty!",
                                                      parameter="allowed_token_ids", value=allowed))
        invalid = [t for t in allowed if t < 0 or t >= vocab]
        if invalid:
            raise from_vllm_error(VLLMValidationError("allowed_token_ids contains out-of-vocab token id!",
                                                      parameter="allowed_token_ids", value=invalid))


# ---- runtime LoRA (un)loading ------------------------------------------------------------------------
class LoadLoRA(OpenModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRA(OpenModel):
    lora_name: str
    lora_int_id: int | None = None


_PATH_UNDER_SYSTEM_DIRS = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")


def sanitize_message(message: str) -> str:
    """vLLM's ``sanitize_message``: file paths under system folders become ``<path>``."""
    return _FILE_PATH.sub("<path>", _PATH_UNDER_SYSTEM_DIRS.sub("<path>", message)).strip()


# ---- /tokenize and /detokenize --------------------------------------------------------------------
class TokenizeText(OpenModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(OpenModel):
    model: str | None = None
    messages: list[Any]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class Detokenize(OpenModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


def parse_tokenize(raw: bytes, content_type: str, ctx: ApiContext, check_model=None) -> dict:
    """``POST /tokenize`` (a text prompt or chat messages): vLLM's response, ``count``,
    ``max_model_len``, ``tokens``, ``token_strs``.  Without a tokenizer, ids are placeholders (one per
    4 characters) within the vocabulary."""
    b = ctx.behaviour
    body = read_json_body(raw, content_type, b)
    errors = []
    for model in (TokenizeText, TokenizeChat):      # vLLM's union of the two: the first that validates
        try:
            req = model.model_validate(body, from_attributes=True)
            break
        except ValidationError as exc:
            errors += pydantic_errors(exc)
    else:
        raise validation_failure(errors, b)
    chat = isinstance(req, TokenizeChat)
    if check_model is not None:
        check_model(req.model)
    files = ctx.files
    if chat:
        check_messages(req.messages, b)
        ids = files.chat_ids(req.messages, req.add_generation_prompt)
        n = files.count_chat(req.messages) if ids is None else len(ids)
    else:
        ids = files.encode(req.prompt, req.add_special_tokens)
        n = files.count_text(req.prompt, req.add_special_tokens) if ids is None else len(ids)
    if ids is None:
        top = max(2, ctx.vocab_size or 32000)
        ids = [1 + (k * 7919) % (top - 1) for k in range(n)]
    strs = (files.token_strs(ids) or [str(i) for i in ids]) if req.return_token_strs else None
    return {"count": n, "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def parse_detokenize(raw: bytes, content_type: str, ctx: ApiContext, check_model=None) -> dict:
    req = validate_fields(Detokenize, read_json_body(raw, content_type, ctx.behaviour), ctx.behaviour)
    if check_model is not None:
        check_model(req.model)
    return {"prompt": ctx.files.decode(req.tokens) if ctx.files.tokenizer is not None else filler(0, len(req.tokens))}


# ---- responses ------------------------------------------------------------------------------------
def filler(start: int, n: int) -> str:
    return "".join(" " + FILLER[i % len(FILLER)] for i in range(start, start + n))


def request_id(header: str | None, behaviour: VllmBehaviour) -> str:
    """vLLM's response id body: the ``X-Request-Id`` header, else random hex (16 digits; 32 in 0.8.5)."""
    return header if header else uuid.uuid4().hex[:behaviour.request_id_hex]


class Formatter:
    """Response bodies and SSE chunks of one request's choices (vLLM 0.32's fields; byte templates:
    the per-token cost is one string concatenation)."""

    def __init__(self, p: ParsedRequest, model: str, rid: str, behaviour: VllmBehaviour):
        self.p, self.model, self.behaviour = p, model, behaviour
        self.chat = p.chat
        self.id = ("chatcmpl-" if p.chat else "cmpl-") + rid
        self.created = int(time.time())
        self.fingerprint = f"vllm-{behaviour.version}-{uuid.uuid5(uuid.NAMESPACE_DNS, model).hex[:8]}"
        obj = "chat.completion.chunk" if p.chat else "text_completion"
        self._head = (f'data: {{"id":"{self.id}","object":"{obj}","created":{self.created},'
                      f'"model":{json.dumps(model)},')

    def first_chunk(self, index: int) -> bytes:
        """Chat streams open with the assistant's role, one chunk per choice (vLLM)."""
        if not self.chat:
            return b""
        return (self._head + f'"choices":[{{"index":{index},"delta":{{"role":"assistant","content":""}},'
                '"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n').encode()

    def chunks(self, index: int, start: int, stop: int, finish_reason: str | None) -> bytes:
        """SSE chunks of choice ``index``'s tokens ``start .. stop - 1`` (the last one with ``finish_reason``)."""
        out = []
        if self.chat:
            pre = self._head + f'"choices":[{{"index":{index},"delta":{{"content":'
            post = '},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
            post_end = '},"logprobs":null,"finish_reason":"%s","stop_reason":null,"token_ids":null}]}\n\n'
        else:
            pre = self._head + f'"choices":[{{"index":{index},"text":'
            post = (',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
                    '"token_ids":null}]}\n\n')
            post_end = (',"logprobs":null,"finish_reason":"%s","stop_reason":null,"prompt_token_ids":null,'
                        '"token_ids":null}]}\n\n')
        if not self.p.include_usage:         # the finish chunk carries the fingerprint when no usage chunk follows
            post_end = post_end[:-len("}\n\n")] + f',"system_fingerprint":"{self.fingerprint}"}}\n\n'
        for i in range(start, stop):
            word = '" ' + FILLER[i % len(FILLER)] + '"'
            end = (post_end % finish_reason) if (finish_reason and i == stop - 1) else post
            out.append(pre + word + end)
        return "".join(out).encode()

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.p.prompt_tokens, "total_tokens": self.p.prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens}

    def tail(self, completion_tokens: int) -> bytes:
        """The usage chunk (when asked for) and ``[DONE]``."""
        out = ""
        if self.p.include_usage:
            usage = json.dumps(self.usage(completion_tokens), separators=(",", ":"))
            out = self._head + f'"choices":[],"usage":{usage},"system_fingerprint":"{self.fingerprint}"}}\n\n'
        return (out + "data: [DONE]\n\n").encode()

    def full(self, choices: list[tuple[int, str, str]]) -> dict:
        """The non-streamed body: ``choices`` = (tokens, finish_reason, echo text) per choice."""
        out, total = [], 0
        for index, (n, finish_reason, echo) in enumerate(choices):
            total += n
            text = echo + filler(0, n)
            if self.chat:
                out.append({"index": index, "message": {"role": "assistant", "content": text, "refusal": None,
                                                        "annotations": None, "audio": None, "function_call": None,
                                                        "reasoning": None},
                            "logprobs": None, "finish_reason": finish_reason, "stop_reason": None, "token_ids": None,
                            "routed_experts": None})
            else:
                out.append({"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
                            "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                            "routed_experts": None})
        usage = {**self.usage(total), "prompt_tokens_details": None, "completion_tokens_details": None}
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "service_tier": None,
                "system_fingerprint": self.fingerprint, "usage": usage}
        if self.chat:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return body
