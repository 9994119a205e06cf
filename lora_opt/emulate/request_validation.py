"""vLLM's request validation as the emulator applies it: the error types and vLLM's error bodies,
the request models with vLLM 0.32's field types for the fields clients send (so a type error gets
pydantic's own message, formatted as vLLM's handler formats it), and vLLM's "before" validators.
:mod:`lora_opt.emulate.protocol` runs them in vLLM's order (its docstring lists it) and renders
the responses.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lora_opt.emulate.vllm_versions import VllmBehaviour

COMPLETION_DEFAULT_MAX_TOKENS = 16
#: vLLM's defaults (vllm/envs.py; ModelConfig.max_logprobs)
MAX_STOP_STRINGS = 4
MAX_COMPLETION_PROMPTS = 1024
MAX_N_SEQUENCES = 16384
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
SAMPLING_EPS = 1e-5
#: vLLM's validation handler: at most this many errors listed, inputs and entries cut at these lengths
_MAX_REPORTED_ERRORS, _MAX_ERROR_INPUT_CHARS, _MAX_ERROR_CHARS = 10, 200, 1000
#: pydantic-core's schema-kind names that vLLM's handler drops from an error's location
_INTERNAL_LOC_MARKERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
    "complex", "none", "nonetype"})
MEDIA_TYPE_ERROR = "Unsupported Media Type: Only 'application/json' is allowed"


# ---- errors --------------------------------------------------------------------------------------
class VLLMValidationError(ValueError):
    """vLLM's own validation error: its text carries `` (parameter=P, value=V)`` when set, and its
    ``parameter`` becomes the answer's ``param``."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
        super().__init__(message)
        self.parameter, self.value = parameter, value

    def __str__(self):
        extras = ([f"parameter={self.parameter}"] if self.parameter is not None else []) + \
                 ([f"value={self.value}"] if self.value is not None else [])
        base = super().__str__()
        return f"{base} ({', '.join(extras)})" if extras else base


class APIError(Exception):
    """An error answered with vLLM's error JSON: nested ``{"error": {...}}``, or with ``nested=False``
    vLLM 0.8.5's flat form (which had no ``param`` and no ``(parameter=..., value=...)`` suffix:
    ``plain``, the message without it)."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None,
                 plain: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.plain = message if plain is None else plain

    def body(self, nested: bool = True) -> dict:
        if nested:
            return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}
        return {"object": "error", "message": self.plain, "type": self.type, "param": None, "code": self.status}


class DetailError(Exception):
    """FastAPI's own answer (``{"detail": ...}``), not vLLM's envelope: a body its JSON parser gives
    up on (nested past Python's recursion limit) -- vLLM answers it the same way."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


def from_vllm_error(exc: VLLMValidationError) -> APIError:
    return APIError(400, str(exc), "BadRequestError", exc.parameter, plain=exc.args[0])


def _summarize_input(value) -> str:
    if isinstance(value, str):
        return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_ERROR_INPUT_CHARS else value
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except ValueError:                          # an int past Python's digit limit
        return f"<{type(value).__name__}>"
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_INPUT_CHARS else text


def _internal_loc(segment: str) -> bool:
    return any(c in segment for c in "[]{}()") or segment.lower() in _INTERNAL_LOC_MARKERS


def clean_loc(loc: tuple) -> str:
    """A pydantic error location as vLLM's ``param``: dotted, pydantic's internal markers dropped."""
    parts = [str(p) for p in loc if not _internal_loc(str(p))]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def validation_failure(errors: list, behaviour: VllmBehaviour) -> APIError:
    """A request-validation failure (FastAPI's ``RequestValidationError``) as vLLM's handler answers
    it: ``N validation error(s):`` and one line per error (at most 10, inputs summarized), ``param``
    the first error's location; vLLM 0.8.5: ``str`` of the errors, no ``param``."""
    if not behaviour.validation_param:
        return APIError(400, str(errors), behaviour.validation_type, None)
    param = None
    for err in errors:
        ctx_err = err.get("ctx", {}).get("error") if isinstance(err, dict) else None
        if isinstance(ctx_err, VLLMValidationError):
            param = ctx_err.parameter
            break
    if param is None and errors and isinstance(errors[0], dict) and errors[0].get("loc"):
        param = clean_loc(tuple(errors[0]["loc"]))
    lines = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        if isinstance(err, dict):
            err = dict(err)
            if "input" in err:
                err["input"] = _summarize_input(err["input"])
            if isinstance(err.get("loc"), (tuple, list)):
                err["loc"] = clean_loc(tuple(err["loc"]))
        text = str(err)
        lines.append(text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text)
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if len(errors) > len(lines):
        message += f"  ...and {len(errors) - len(lines)} more {label}\n"
    return APIError(400, message.rstrip(), behaviour.validation_type, param)


def pydantic_errors(exc: ValidationError) -> list[dict]:
    """pydantic's errors located in the body, as FastAPI reports them (no ``url``)."""
    return [{**{k: v for k, v in e.items() if k != "url"}, "loc": ("body", *e["loc"])}
            for e in exc.errors(include_url=False)]


def read_json_body(raw: bytes, content_type: str, behaviour: VllmBehaviour):
    """The JSON body of a POST, checked as FastAPI + vLLM's ``validate_json_request`` do."""
    media = content_type.split(";", 1)[0].strip().lower()
    json_like = media == "application/json" or media.endswith("+json")
    body = None
    if json_like and raw:
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise validation_failure([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], behaviour) from None
        except (ValueError, RecursionError):         # undecodable bytes, nesting past the parser's depth
            raise DetailError(400, "There was an error parsing the body") from None
    if media != "application/json":
        raise validation_failure([MEDIA_TYPE_ERROR], behaviour)
    if body is None:
        raise validation_failure([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}],
                                 behaviour)
    return body


def validate_fields(model: type[BaseModel], body, behaviour: VllmBehaviour) -> BaseModel:
    try:
        # from_attributes: FastAPI validates bodies so (a non-object gets "model_attributes_type")
        return model.model_validate(body, from_attributes=True)
    except ValidationError as exc:
        raise validation_failure(pydantic_errors(exc), behaviour) from None
    except VLLMValidationError as exc:
        raise from_vllm_error(exc) from None


# ---- the request models: vLLM 0.32's field types for the fields clients send ---------------------
class OpenModel(BaseModel):
    model_config = ConfigDict(extra="allow")           # OpenAI's API allows extra fields (vLLM ignores them)


StopParam = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None


class StreamOptions(OpenModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(OpenModel):
    """The sampling and extra fields completions and chat share (vLLM's types and defaults)."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopParam = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None


class CompletionFields(_Sampling):
    prompt: (list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | str | list[str]
             | None) = None
    echo: bool | None = False
    logprobs: int | None = None
    prompt_embeds: bytes | list[bytes] | None = None
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    n: int = 1
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatFields(_Sampling):
    messages: list[Any]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


# vLLM's "before" validators, in the order pydantic runs them (the last defined first)
def _check_cache_salt(data: dict) -> None:
    salt = data.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise VLLMValidationError("Parameter 'cache_salt' must be a non-empty string if provided.",
                                  parameter="cache_salt")
    if len(salt) > 128 or any(c in "@/\\\x00" for c in salt):
        raise VLLMValidationError("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                                  "'@', '/', '\\\\', or NUL.", parameter="cache_salt")


def _check_structured_outputs(data: dict) -> None:
    so = data.get("structured_outputs")
    if isinstance(so, dict) and sum(so.get(k) is not None for k in ("json", "regex", "choice")) > 1:
        raise VLLMValidationError("You can only use one kind of constraints for structured outputs ('json', 'regex' "
                                  "or 'choice').", parameter="structured_outputs")


def _check_response_format(data: dict) -> None:
    rf = data.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and rf.get("json_schema") is None:
        raise VLLMValidationError("When response_format type is 'json_schema', the 'json_schema' field must be "
                                  "provided.", parameter="response_format")


def _check_stream_options(data: dict) -> None:
    if data.get("stream_options") and not data.get("stream"):
        raise VLLMValidationError("Stream options can only be defined when `stream=True`.",
                                  parameter="stream_options")


def _check_prompt_logprobs(data: dict) -> None:
    if (p := data.get("prompt_logprobs")) is not None:
        if data.get("stream") and (p > 0 or p == -1):
            raise VLLMValidationError("`prompt_logprobs` are not available when `stream=True`.",
                                      parameter="prompt_logprobs")
        if p < 0 and p != -1:
            raise VLLMValidationError("`prompt_logprobs` must be a positive value or -1.",
                                      parameter="prompt_logprobs", value=p)


def _numeric_fields(data: dict, names) -> None:
    for name in names:
        v = data.get(name)
        if v is not None and not isinstance(v, (int, float)):
            raise VLLMValidationError(f"`{name}` must be an integer.", parameter=name, value=v)


def completion_before_checks(data: dict) -> None:
    prompt = data.get("prompt")
    if (isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt)
            and len(prompt) > MAX_COMPLETION_PROMPTS):
        raise VLLMValidationError(
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_COMPLETION_PROMPTS}. "
            "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.", parameter="prompt")
    embeds = data.get("prompt_embeds")
    if (prompt is None or prompt == "") and (embeds is None or (isinstance(embeds, list) and not embeds)):
        raise VLLMValidationError("Either prompt or prompt_embeds must be provided and non-empty.",
                                  parameter="prompt")
    _check_stream_options(data)
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        raise VLLMValidationError("`logprob_token_ids` is not supported with beam search.",
                                  parameter="logprob_token_ids")
    if data.get("use_beam_search") and data.get("echo") and data.get("logprobs") is not None:
        raise VLLMValidationError("`echo` with `logprobs` is not supported with beam search because beam search "
                                  "does not compute prompt logprobs.", parameter="echo")
    if data.get("logprob_token_ids") and data.get("echo") and data.get("max_tokens") == 0:
        raise VLLMValidationError("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
                                  "no output tokens are generated.", parameter="logprob_token_ids")
    if data.get("logprob_token_ids") and data.get("logprobs") is None:
        raise VLLMValidationError("when using `logprob_token_ids`, `logprobs` must be set.",
                                  parameter="logprob_token_ids")
    _numeric_fields(data, ("prompt_logprobs", "logprobs"))
    _check_prompt_logprobs(data)
    if (lp := data.get("logprobs")) is not None and lp < 0 and lp != -1:
        raise VLLMValidationError("`logprobs` must be a positive value or -1.", parameter="logprobs", value=lp)
    _check_structured_outputs(data)
    _check_response_format(data)
    _check_cache_salt(data)


def chat_before_checks(data: dict) -> None:
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise VLLMValidationError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    _check_structured_outputs(data)
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        raise VLLMValidationError("`logprob_token_ids` is not supported with beam search.",
                                  parameter="logprob_token_ids")
    if data.get("logprob_token_ids") and not data.get("logprobs"):
        raise VLLMValidationError("when using `logprob_token_ids`, `logprobs` must be set to true.",
                                  parameter="logprob_token_ids")
    _numeric_fields(data, ("prompt_logprobs", "top_logprobs"))
    _check_prompt_logprobs(data)
    if (top := data.get("top_logprobs")) is not None:
        if top < 0 and top != -1:
            raise VLLMValidationError("`top_logprobs` must be a positive value or -1.", parameter="top_logprobs",
                                      value=top)
        if (top == -1 or top > 0) and not data.get("logprobs"):
            raise VLLMValidationError("when using `top_logprobs`, `logprobs` must be set to true.",
                                      parameter="top_logprobs")
    _check_stream_options(data)
    _check_response_format(data)
    _check_cache_salt(data)


#: the first of OpenAI's message types vLLM's union tries (the location its errors start with)
_FIRST_MESSAGE_TYPE = "ChatCompletionDeveloperMessageParam"


def check_messages(messages: list, behaviour: VllmBehaviour) -> None:
    """Each message: an object with a string ``role`` and a string / content-part list / null
    ``content`` (vLLM accepts any role; its union of OpenAI's message types reports more errors
    than the emulator does: their first one is the same)."""
    for i, m in enumerate(messages):
        where = ("body", "messages", i, _FIRST_MESSAGE_TYPE)
        if not isinstance(m, dict):
            raise validation_failure([{"type": "dict_type", "loc": where, "msg": "Input should be a valid dictionary",
                                       "input": m}], behaviour)
        if "role" not in m:
            raise validation_failure([{"type": "missing", "loc": (*where, "role"), "msg": "Field required",
                                       "input": m}], behaviour)
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise validation_failure([{"type": "string_type", "loc": (*where, "content"),
                                       "msg": "Input should be a valid string", "input": content}], behaviour)
