"""The differential conformance cases: requests sent both to a real vLLM of the tier and to
``lora-opt emulate`` started with the same flags, and how an answer is reduced to what must match.

Each case is one row (:class:`Case`); :func:`observe` sends it and :func:`shape` reduces the answer
to the parts a client can rely on: the status, the error envelope (nested or flat), the error's
``type``, ``param`` and -- where vLLM's text is fixed -- ``message``; for a success, the object
names, choices, finish reasons and usage (deterministic only with ``ignore_eos``: the tier's
random model may draw its EOS); for a stream, the SSE framing (chunk objects, the role chunk, the
finish chunk, the usage chunk, ``[DONE]``).  Token-id prompts are drawn inside the tier's 4,096-token
vocabulary; ``MAX_MODEL_LEN`` is the shared server's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_MODEL_LEN = 512
VOCAB = 4096
BASE = "tiny-llama"


def ids(n: int, start: int = 10) -> list[int]:
    """``n`` token ids inside the vocabulary."""
    return [start + (k % 4000) for k in range(n)]


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: object = None
    """A JSON-able body, or ``bytes`` sent as they are."""
    method: str = "POST"
    headers: dict = field(default_factory=dict)
    message: bool = True
    """Compare the error message text too (vLLM's text is fixed for this request)."""
    exact_usage: bool = True
    """Compare completion_tokens and finish reasons (only with ignore_eos or a length stop)."""


def C(id_, body, **kw):
    return Case(id_, "/v1/completions", body, **kw)


def CH(id_, body, **kw):
    return Case(id_, "/v1/chat/completions", body, **kw)


MSG = [{"role": "user", "content": "adapter rank slot batch token"}]
P3 = ids(3)

CASES: list[Case] = [
    # ---- completions that succeed -------------------------------------------------------------
    C("ok_ids", {"model": BASE, "prompt": P3, "max_tokens": 5, "ignore_eos": True}),
    C("ok_text", {"model": BASE, "prompt": "adapter rank slot batch", "max_tokens": 4, "ignore_eos": True}),
    C("ok_lora", {"model": "r8-a", "prompt": P3, "max_tokens": 3, "ignore_eos": True}),
    C("ok_model_omitted", {"prompt": P3, "max_tokens": 2, "ignore_eos": True}),
    C("ok_model_empty", {"model": "", "prompt": P3, "max_tokens": 2, "ignore_eos": True}),
    C("ok_default_max_tokens", {"model": BASE, "prompt": P3, "ignore_eos": True}),
    C("ok_max_tokens_null", {"model": BASE, "prompt": P3, "max_tokens": None, "ignore_eos": True}),
    C("ok_max_tokens_float_integral", {"model": BASE, "prompt": P3, "max_tokens": 2.0, "ignore_eos": True}),
    C("clamp_prompt_plus_max_tokens", {"model": BASE, "prompt": ids(500), "max_tokens": 100, "ignore_eos": True}),
    C("clamp_without_ignore_eos", {"model": BASE, "prompt": ids(505), "max_tokens": 512}, exact_usage=False),
    C("ok_max_tokens_eq_max_model_len", {"model": BASE, "prompt": P3, "max_tokens": MAX_MODEL_LEN, "ignore_eos": True}),
    C("ok_prompt_one_below_max", {"model": BASE, "prompt": ids(MAX_MODEL_LEN - 1), "max_tokens": 5,
                                  "ignore_eos": True}),
    C("ok_stream_as_string_true", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "stream": "true"}),
    C("ok_ignore_eos_as_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": "yes"}),
    C("ok_unknown_field", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "foo": {"bar": 1}}),
    C("ok_best_of", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "best_of": 2}),
    C("ok_temperature_zero", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "temperature": 0}),
    C("ok_temperature_two", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "temperature": 2}),
    C("ok_top_p_one", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "top_p": 1}),
    C("ok_top_k_minus_one", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "top_k": -1}),
    C("ok_seed", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "seed": 42}),
    C("ok_seed_minus_one", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "seed": -1}),
    C("ok_stop_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "stop": "zzzz"},
      exact_usage=False),
    C("ok_stop_list", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "stop": ["zz", "yy"]},
      exact_usage=False),
    C("ok_min_tokens_eq_max", {"model": BASE, "prompt": P3, "max_tokens": 3, "min_tokens": 3}),
    C("ok_n_2", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "n": 2}),
    C("ok_prompt_list_of_lists", {"model": BASE, "prompt": [P3, ids(4)], "max_tokens": 2, "ignore_eos": True}),
    C("ok_prompt_list_of_strings", {"model": BASE, "prompt": ["adapter rank", "slot"], "max_tokens": 2,
                                    "ignore_eos": True}),
    C("ok_prompt_single_list", {"model": BASE, "prompt": [P3], "max_tokens": 2, "ignore_eos": True}),
    C("ok_logprobs", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "logprobs": 2}),
    C("ok_echo", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "echo": True}),
    C("ok_user_and_request_id", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "user": "u1",
                                 "request_id": "abc"}),
    C("ok_presence_penalty", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True,
                              "presence_penalty": 1.5, "frequency_penalty": -1, "repetition_penalty": 1.2}),
    # ---- streams -------------------------------------------------------------------------------
    C("stream_plain", {"model": BASE, "prompt": P3, "max_tokens": 4, "ignore_eos": True, "stream": True}),
    C("stream_usage", {"model": "r16-a", "prompt": P3, "max_tokens": 4, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}),
    C("stream_usage_false", {"model": BASE, "prompt": P3, "max_tokens": 3, "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": False}}),
    C("stream_clamped", {"model": BASE, "prompt": ids(508), "max_tokens": 50, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}}),
    # ---- length rules --------------------------------------------------------------------------
    C("prompt_too_long", {"model": BASE, "prompt": ids(600), "max_tokens": 5}),
    C("prompt_eq_max_model_len", {"model": BASE, "prompt": ids(MAX_MODEL_LEN), "max_tokens": 5}),
    C("max_tokens_over_max_model_len", {"model": BASE, "prompt": P3, "max_tokens": 1000}),
    C("max_tokens_zero", {"model": BASE, "prompt": P3, "max_tokens": 0}),
    C("max_tokens_negative", {"model": BASE, "prompt": P3, "max_tokens": -1}),
    C("max_tokens_string", {"model": BASE, "prompt": P3, "max_tokens": "ten"}),
    C("max_tokens_fraction", {"model": BASE, "prompt": P3, "max_tokens": 2.5}),
    C("max_tokens_bool", {"model": BASE, "prompt": P3, "max_tokens": True}),
    C("min_tokens_over_max_tokens", {"model": BASE, "prompt": P3, "max_tokens": 2, "min_tokens": 3}),
    C("min_tokens_negative", {"model": BASE, "prompt": P3, "max_tokens": 2, "min_tokens": -1}),
    C("min_tokens_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "min_tokens": "x"}),
    # ---- prompts -------------------------------------------------------------------------------
    C("token_out_of_vocabulary", {"model": BASE, "prompt": [1, 2, VOCAB + 100], "max_tokens": 2}),
    C("token_at_vocab_size", {"model": BASE, "prompt": [1, VOCAB], "max_tokens": 2}),
    C("token_negative", {"model": BASE, "prompt": [1, -5, 3], "max_tokens": 2}),
    C("token_float", {"model": BASE, "prompt": [1, 2.5], "max_tokens": 2}),
    C("prompt_empty_string", {"model": BASE, "prompt": "", "max_tokens": 2}),
    C("prompt_empty_list", {"model": BASE, "prompt": [], "max_tokens": 2}),
    C("prompt_list_with_empty_list", {"model": BASE, "prompt": [[]], "max_tokens": 2}),
    C("prompt_missing", {"model": BASE, "max_tokens": 2}),
    C("prompt_null", {"model": BASE, "prompt": None, "max_tokens": 2}),
    C("prompt_number", {"model": BASE, "prompt": 5, "max_tokens": 2}),
    C("prompt_object", {"model": BASE, "prompt": {"text": "x"}, "max_tokens": 2}),
    C("prompt_mixed_list", {"model": BASE, "prompt": ["a", 1], "max_tokens": 2}),
    C("prompt_oov_in_batch", {"model": BASE, "prompt": [P3, [VOCAB + 1]], "max_tokens": 2}),
    # ---- sampling parameters -------------------------------------------------------------------
    C("temperature_negative", {"model": BASE, "prompt": P3, "max_tokens": 2, "temperature": -0.5}),
    C("temperature_over_two", {"model": BASE, "prompt": P3, "max_tokens": 2, "temperature": 2.5}),
    C("temperature_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "temperature": "hot"}),
    C("top_p_over_one", {"model": BASE, "prompt": P3, "max_tokens": 2, "top_p": 1.5}),
    C("top_p_zero", {"model": BASE, "prompt": P3, "max_tokens": 2, "top_p": 0}),
    C("top_k_below_minus_one", {"model": BASE, "prompt": P3, "max_tokens": 2, "top_k": -2}),
    C("top_k_fraction", {"model": BASE, "prompt": P3, "max_tokens": 2, "top_k": 1.5}),
    C("min_p_over_one", {"model": BASE, "prompt": P3, "max_tokens": 2, "min_p": 1.5}),
    C("presence_penalty_out_of_range", {"model": BASE, "prompt": P3, "max_tokens": 2, "presence_penalty": 3}),
    C("frequency_penalty_out_of_range", {"model": BASE, "prompt": P3, "max_tokens": 2, "frequency_penalty": -2.5}),
    C("repetition_penalty_zero", {"model": BASE, "prompt": P3, "max_tokens": 2, "repetition_penalty": 0}),
    C("n_zero", {"model": BASE, "prompt": P3, "max_tokens": 2, "n": 0}),
    C("n_negative", {"model": BASE, "prompt": P3, "max_tokens": 2, "n": -1}),
    C("n_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "n": "two"}),
    C("n_2_greedy", {"model": BASE, "prompt": P3, "max_tokens": 2, "n": 2, "temperature": 0}),
    C("logprobs_negative", {"model": BASE, "prompt": P3, "max_tokens": 2, "logprobs": -2}),
    C("logprobs_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "logprobs": "x"}),
    C("logprobs_too_many", {"model": BASE, "prompt": P3, "max_tokens": 2, "logprobs": 100}),
    C("prompt_logprobs_with_stream", {"model": BASE, "prompt": P3, "max_tokens": 2, "prompt_logprobs": 1,
                                      "stream": True}),
    C("stop_empty_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "stop": [""]}),
    C("stop_number", {"model": BASE, "prompt": P3, "max_tokens": 2, "stop": 5}),
    C("seed_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "seed": "x"}),
    C("seed_too_large", {"model": BASE, "prompt": P3, "max_tokens": 2, "seed": 2 ** 64}),
    C("echo_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "echo": "maybe"}),
    C("stream_not_bool", {"model": BASE, "prompt": P3, "max_tokens": 2, "stream": "sometimes"}),
    C("stream_options_without_stream", {"model": BASE, "prompt": P3, "max_tokens": 2,
                                        "stream_options": {"include_usage": True}}),
    C("stream_options_with_stream_false", {"model": BASE, "prompt": P3, "max_tokens": 2, "stream": False,
                                           "stream_options": {"include_usage": True}}),
    C("stream_options_not_object", {"model": BASE, "prompt": P3, "max_tokens": 2, "stream": True,
                                    "stream_options": 5}),
    C("beam_search_stream", {"model": BASE, "prompt": P3, "max_tokens": 2, "stream": True,
                             "use_beam_search": True}),
    C("stop_token_ids_strings", {"model": BASE, "prompt": P3, "max_tokens": 2, "stop_token_ids": ["a"]}),
    C("ignore_eos_not_bool", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": "perhaps"}),
    C("model_not_string", {"model": 5, "prompt": P3, "max_tokens": 2}),
    C("priority_nonzero", {"model": BASE, "prompt": P3, "max_tokens": 2, "priority": 1}),
    C("n_too_large", {"model": BASE, "prompt": P3, "max_tokens": 2, "n": 20000}),
    C("n_null", {"model": BASE, "prompt": P3, "max_tokens": 2, "n": None}),
    C("logprobs_minus_one", {"model": BASE, "prompt": P3, "max_tokens": 2, "logprobs": -1}),
    C("prompt_logprobs_too_many", {"model": BASE, "prompt": P3, "max_tokens": 2, "prompt_logprobs": 30}),
    C("echo_max_tokens_zero", {"model": BASE, "prompt": P3, "max_tokens": 0, "echo": True}, exact_usage=False),
    C("suffix", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "suffix": "x"}),
    C("stop_too_many", {"model": BASE, "prompt": P3, "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]}),
    C("stream_include_usage_not_bool", {"model": BASE, "prompt": P3, "max_tokens": 2, "stream": True,
                                        "stream_options": {"include_usage": "maybe"}}),
    C("seed_fraction", {"model": BASE, "prompt": P3, "max_tokens": 2, "seed": 1.5}),
    C("ok_top_k_zero", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "top_k": 0}),
    C("ok_stream_null", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "stream": None}),
    C("temperature_nan", b'{"model": "tiny-llama", "prompt": [10, 11], "max_tokens": 2, "temperature": NaN}'),
    C("max_tokens_huge", {"model": BASE, "prompt": P3, "max_tokens": 2 ** 70}),
    C("text_prompt_too_many_chars", {"model": BASE, "prompt": "token " * 1000, "max_tokens": 2}),
    C("text_prompt_too_many_tokens", {"model": BASE, "prompt": "token " * 600, "max_tokens": 2}),
    C("prompt_list_with_empty_string", {"model": BASE, "prompt": ["", "adapter"], "max_tokens": 2}),
    C("allowed_token_ids_oov", {"model": BASE, "prompt": P3, "max_tokens": 2, "allowed_token_ids": [5, VOCAB + 3]}),
    C("allowed_token_ids_empty", {"model": BASE, "prompt": P3, "max_tokens": 2, "allowed_token_ids": []}),
    C("logit_bias_oov", {"model": BASE, "prompt": P3, "max_tokens": 2, "logit_bias": {str(VOCAB + 9): 1.0}}),
    C("logit_bias_bad_key", {"model": BASE, "prompt": P3, "max_tokens": 2, "logit_bias": {"abc": 1.0}}),
    C("logit_bias_bad_value", {"model": BASE, "prompt": P3, "max_tokens": 2, "logit_bias": {"5": "high"}}),
    C("stop_token_ids_oov", {"model": BASE, "prompt": P3, "max_tokens": 2, "stop_token_ids": [VOCAB + 1]}),
    C("bad_words_empty", {"model": BASE, "prompt": P3, "max_tokens": 2, "bad_words": [""]}),
    C("truncate_prompt_tokens", {"model": BASE, "prompt": ids(600), "max_tokens": 2, "ignore_eos": True,
                                 "truncate_prompt_tokens": 100}),
    C("truncate_prompt_tokens_minus_one", {"model": BASE, "prompt": ids(600), "max_tokens": 5, "ignore_eos": True,
                                           "truncate_prompt_tokens": -1}),
    C("truncate_prompt_tokens_too_big", {"model": BASE, "prompt": P3, "max_tokens": 2, "truncate_prompt_tokens": 1000}),
    Case("request_id_header", "/v1/completions", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True},
         headers={"x-request-id": "my-req-7"}),
    C("cache_salt_empty", {"model": BASE, "prompt": P3, "max_tokens": 2, "cache_salt": ""}),
    C("stream_n_2", {"model": BASE, "prompt": P3, "max_tokens": 3, "ignore_eos": True, "n": 2, "stream": True,
                     "stream_options": {"include_usage": True}}),
    C("ok_logprobs_zero", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "logprobs": 0}),
    C("ok_top_k_float_integral", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "top_k": 1.0}),
    C("ok_stop_null", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True, "stop": None}),
    C("ok_max_tokens_one", {"model": BASE, "prompt": P3, "max_tokens": 1}),
    C("ok_last_token_of_vocabulary", {"model": BASE, "prompt": [VOCAB - 1], "max_tokens": 2, "ignore_eos": True}),
    C("min_tokens_without_ignore_eos", {"model": BASE, "prompt": P3, "max_tokens": 4, "min_tokens": 2},
      exact_usage=False),
    C("prompt_embeds_only", {"model": BASE, "prompt_embeds": "AAAA", "max_tokens": 2}),
    C("response_format_json_schema_missing", {"model": BASE, "prompt": P3, "max_tokens": 2,
                                              "response_format": {"type": "json_schema"}}),
    C("structured_outputs_two_kinds", {"model": BASE, "prompt": P3, "max_tokens": 2,
                                       "structured_outputs": {"regex": "a+", "choice": ["a", "b"]}}),
    C("stream_interval_zero", {"model": BASE, "prompt": P3, "max_tokens": 2, "stream": True, "stream_interval": 0}),
    C("truncation_side_bad", {"model": BASE, "prompt": P3, "max_tokens": 2, "truncation_side": "middle"}),
    C("mm_payload_bad", {"model": BASE, "prompt": P3, "max_tokens": 2, "mm_payload": "all"}),
    C("priority_not_int", {"model": BASE, "prompt": P3, "max_tokens": 2, "priority": "high"}),
    C("add_special_tokens_not_bool", {"model": BASE, "prompt": "adapter", "max_tokens": 2,
                                      "add_special_tokens": "maybe"}),
    C("request_id_not_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "request_id": 5}),
    # ---- the body ------------------------------------------------------------------------------
    C("unknown_model", {"model": "nope", "prompt": P3, "max_tokens": 2}),
    C("invalid_json", b'{"model": "tiny-llama", "prompt": '),
    C("empty_body", b""),
    C("body_is_list", b"[1, 2]"),
    C("body_is_string", b'"hello"'),
    C("deeply_nested_json", b'{"model": "tiny-llama", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    C("nested_json_moderate", b'{"model": "tiny-llama", "prompt": "x", "foo": ' + b"[" * 500 + b"]" * 500 + b"}"),
    Case("content_type_text", "/v1/completions", b'{"model": "tiny-llama", "prompt": "x"}',
         headers={"content-type": "text/plain"}),
    Case("content_type_missing", "/v1/completions", b'{"model": "tiny-llama", "prompt": "x"}',
         headers={"content-type": ""}),
    Case("content_type_json_charset", "/v1/completions",
         json.dumps({"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True}).encode(),
         headers={"content-type": "application/json; charset=utf-8"}),
    Case("get_completions", "/v1/completions", method="GET"),
    Case("unknown_route", "/v1/nothing", {"x": 1}),
    # ---- chat ----------------------------------------------------------------------------------
    CH("chat_ok", {"model": BASE, "messages": MSG, "max_tokens": 4, "ignore_eos": True}),
    CH("chat_ok_lora", {"model": "r32-b", "messages": MSG, "max_completion_tokens": 3, "ignore_eos": True}),
    CH("chat_two_messages", {"model": BASE, "messages": [{"role": "system", "content": "be brief"}, *MSG],
                             "max_tokens": 2, "ignore_eos": True}),
    CH("chat_content_parts", {"model": BASE, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "adapter rank"}]}], "max_tokens": 2, "ignore_eos": True}),
    CH("chat_default_max_tokens", {"model": BASE, "messages": MSG, "ignore_eos": True}),
    CH("chat_stream_usage", {"model": BASE, "messages": MSG, "max_tokens": 3, "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}}),
    CH("chat_stream", {"model": "r8-b", "messages": MSG, "max_tokens": 3, "ignore_eos": True, "stream": True}),
    CH("chat_clamped", {"model": BASE, "messages": [{"role": "user", "content": "token " * 480}],
                        "max_tokens": 200, "ignore_eos": True}),
    CH("chat_prompt_too_long", {"model": BASE, "messages": [{"role": "user", "content": "token " * 700}],
                                "max_tokens": 2}),
    CH("chat_max_tokens_over", {"model": BASE, "messages": MSG, "max_tokens": 1000}),
    CH("chat_max_completion_tokens_over", {"model": BASE, "messages": MSG, "max_completion_tokens": 1000}),
    CH("chat_messages_missing", {"model": BASE, "max_tokens": 2}),
    CH("chat_messages_empty", {"model": BASE, "messages": [], "max_tokens": 2}),
    CH("chat_messages_not_list", {"model": BASE, "messages": "hi", "max_tokens": 2}),
    # vLLM validates a message against each of its 11 message types (OpenAI's and its own) and lists
    # every failure; the emulator reports the first of them (same type, param and first line)
    CH("chat_role_missing", {"model": BASE, "messages": [{"content": "hi"}], "max_tokens": 2}, message=False),
    CH("chat_role_unknown", {"model": BASE, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}),
    CH("chat_content_number", {"model": BASE, "messages": [{"role": "user", "content": 5}], "max_tokens": 2},
       message=False),
    CH("chat_temperature_negative", {"model": BASE, "messages": MSG, "max_tokens": 2, "temperature": -1}),
    CH("chat_top_p_over_one", {"model": BASE, "messages": MSG, "max_tokens": 2, "top_p": 2}),
    CH("chat_stream_options_without_stream", {"model": BASE, "messages": MSG, "max_tokens": 2,
                                              "stream_options": {"include_usage": True}}),
    CH("chat_unknown_model", {"model": "nope", "messages": MSG, "max_tokens": 2}),
    CH("chat_n_zero", {"model": BASE, "messages": MSG, "max_tokens": 2, "n": 0}),
    CH("chat_logprobs_without_top", {"model": BASE, "messages": MSG, "max_tokens": 2, "logprobs": True,
                                     "top_logprobs": 2, "ignore_eos": True}),
    CH("chat_top_logprobs_without_logprobs", {"model": BASE, "messages": MSG, "max_tokens": 2, "top_logprobs": 2}),
    CH("chat_min_tokens_over", {"model": BASE, "messages": MSG, "max_tokens": 2, "min_tokens": 5}),
    CH("chat_max_completion_tokens_zero", {"model": BASE, "messages": MSG, "max_completion_tokens": 0}),
    CH("chat_max_tokens_negative", {"model": BASE, "messages": MSG, "max_tokens": -3}),
    CH("chat_top_logprobs_too_many", {"model": BASE, "messages": MSG, "max_tokens": 2, "logprobs": True,
                                      "top_logprobs": 30}),
    CH("chat_logprobs_not_bool", {"model": BASE, "messages": MSG, "max_tokens": 2, "logprobs": "x"}),
    CH("chat_continue_and_generation_prompt", {"model": BASE, "messages": MSG, "max_tokens": 2,
                                               "continue_final_message": True, "add_generation_prompt": True}),
    CH("chat_n_2", {"model": BASE, "messages": MSG, "max_tokens": 2, "n": 2, "ignore_eos": True}),
    CH("chat_stream_n_2", {"model": BASE, "messages": MSG, "max_tokens": 2, "n": 2, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}}),
    CH("chat_prompt_field_instead", {"model": BASE, "prompt": "hi", "max_tokens": 2}),
    CH("chat_temperature_string", {"model": BASE, "messages": MSG, "max_tokens": 2, "temperature": "warm"}),
    CH("chat_message_without_content", {"model": BASE, "messages": [{"role": "user"}], "max_tokens": 2,
                                        "ignore_eos": True}),
    CH("chat_message_not_object", {"model": BASE, "messages": ["hi"], "max_tokens": 2}, message=False),
    CH("chat_max_tokens_and_max_completion_tokens", {"model": BASE, "messages": MSG, "max_tokens": 2,
                                                     "max_completion_tokens": 3, "ignore_eos": True}),
    CH("chat_stop_empty", {"model": BASE, "messages": MSG, "max_tokens": 2, "stop": [""]}),
    CH("chat_seed_string", {"model": BASE, "messages": MSG, "max_tokens": 2, "seed": "x"}),
    CH("chat_echo", {"model": BASE, "messages": MSG, "max_tokens": 2, "echo": True, "ignore_eos": True}),
    CH("chat_invalid_json", b'{"model": "tiny-llama", "messages": [}'),
    CH("chat_body_is_list", b'[{"role": "user", "content": "hi"}]'),
    CH("chat_top_logprobs_negative", {"model": BASE, "messages": MSG, "max_tokens": 2, "logprobs": True,
                                      "top_logprobs": -3}),
    # ---- other routes --------------------------------------------------------------------------
    Case("models", "/v1/models", method="GET"),
    Case("version", "/version", method="GET"),
    Case("health", "/health", method="GET"),
    Case("ping_get", "/ping", method="GET"),
    Case("ping_post", "/ping", {}),
    Case("server_load", "/load", method="GET"),
    Case("health_post", "/health", {}),
    Case("models_post", "/v1/models", {}),
    Case("completions_trailing_slash", "/v1/completions/", {"model": BASE, "prompt": P3, "max_tokens": 2}),
    Case("tokenize_chat_no_generation_prompt", "/tokenize", {"model": BASE, "messages": MSG,
                                                            "add_generation_prompt": False}),
    Case("tokenize_empty_prompt", "/tokenize", {"model": BASE, "prompt": ""}),
    C("max_tokens_numeric_string", {"model": BASE, "prompt": P3, "max_tokens": "3", "ignore_eos": True}),
    C("temperature_numeric_string", {"model": BASE, "prompt": P3, "max_tokens": 2, "ignore_eos": True,
                                     "temperature": "0.5"}),
    C("too_many_prompts", {"model": BASE, "prompt": ["a"] * 1025, "max_tokens": 1}),
    Case("tokenize_text", "/tokenize", {"model": BASE, "prompt": "adapter rank slot batch"}),
    Case("tokenize_no_special", "/tokenize", {"model": BASE, "prompt": "adapter rank", "add_special_tokens": False}),
    Case("tokenize_chat", "/tokenize", {"model": BASE, "messages": MSG}),
    Case("tokenize_token_strs", "/tokenize", {"model": BASE, "prompt": "adapter rank", "return_token_strs": True}),
    Case("tokenize_unknown_model", "/tokenize", {"model": "nope", "prompt": "x"}),
    Case("tokenize_missing_prompt", "/tokenize", {"model": BASE}),
    Case("tokenize_prompt_number", "/tokenize", {"model": BASE, "prompt": 5}),
    Case("tokenize_lora_model", "/tokenize", {"model": "r8-a", "prompt": "adapter rank"}),
    Case("detokenize_negative", "/detokenize", {"model": BASE, "tokens": [-1]}),
    Case("detokenize", "/detokenize", {"model": BASE, "tokens": [100, 200, 300]}),
    Case("detokenize_oov", "/detokenize", {"model": BASE, "tokens": [VOCAB + 7]}),
]


# ---- runtime LoRA (un)loading: run in this order (each row may depend on the one before) ----------
def lora_cases(tier: dict) -> list[Case]:
    a = tier["adapters"]
    rank32 = a["r32-a"]["path"]
    return [
        Case("load_missing_path", "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": "/nonexistent/ghost"}),
        Case("load_duplicate_name", "/v1/load_lora_adapter", {"lora_name": "r8-a", "lora_path": a["r8-a"]["path"]}),
        Case("load_base_name", "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": a["r8-a"]["path"]}),
        Case("load_no_path", "/v1/load_lora_adapter", {"lora_name": "x1"}),
        Case("load_no_name", "/v1/load_lora_adapter", {"lora_path": rank32}),
        Case("load_empty_name", "/v1/load_lora_adapter", {"lora_name": "", "lora_path": rank32}),
        Case("load_path_not_string", "/v1/load_lora_adapter", {"lora_name": "x2", "lora_path": 5}),
        Case("load_inplace_existing", "/v1/load_lora_adapter", {"lora_name": "r8-b", "lora_path": a["r8-b"]["path"],
                                                                 "load_inplace": True}),
        Case("load_new", "/v1/load_lora_adapter", {"lora_name": "extra-32", "lora_path": rank32}),
        Case("models_after_load", "/v1/models", method="GET"),
        Case("use_loaded", "/v1/completions", {"model": "extra-32", "prompt": P3, "max_tokens": 2, "ignore_eos": True}),
        Case("load_new_again", "/v1/load_lora_adapter", {"lora_name": "extra-32", "lora_path": rank32}),
        Case("unload_new", "/v1/unload_lora_adapter", {"lora_name": "extra-32"}),
        Case("use_unloaded", "/v1/completions", {"model": "extra-32", "prompt": P3, "max_tokens": 2}),
        Case("unload_unknown", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}),
        Case("unload_no_name", "/v1/unload_lora_adapter", {}),
        Case("unload_invalid_json", "/v1/unload_lora_adapter", b"{"),
        Case("models_after_unload", "/v1/models", method="GET"),
    ]


def oversized_rank_case(path: str) -> Case:
    """A runtime load of an adapter whose rank is above ``--max-lora-rank`` (vLLM 0.32: 500, a defect)."""
    return Case("load_rank_above_max", "/v1/load_lora_adapter", {"lora_name": "too-big", "lora_path": path})


# ---- sending and reducing ------------------------------------------------------------------------
def observe(client, base_url: str, case: Case) -> dict:
    """Send ``case``; the raw answer: status, headers' content type, body text."""
    headers = {"content-type": "application/json"}
    headers.update(case.headers)
    headers = {k: v for k, v in headers.items() if v != ""}
    if case.method == "GET":
        r = client.get(base_url + case.path)
    else:
        content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
        r = client.post(base_url + case.path, content=content, headers=headers)
    return {"status": r.status_code, "content_type": r.headers.get("content-type", ""), "text": r.text}


def _sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"an SSE event is not a data: line: {block[:80]!r}"
        payload = block[len("data: "):]
        events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return events


def _stream_shape(case: Case, text: str, chat: bool) -> dict:
    """Per choice, its chunks in order (``role``, ``tokens`` -- consecutive token chunks as one --,
    ``finish``); then what follows the last choice chunk (``usage``, ``DONE``): choices interleave
    as the engine steps them, so only each choice's own order is compared."""
    events = _sse_events(text)
    per_choice: dict[int, list] = {}
    tail, finish, usage = [], {}, None
    for e in events:
        if e == "[DONE]":
            tail.append("DONE")
            continue
        if "error" in e:
            tail.append("error")
            continue
        if not e["choices"]:
            tail.append("usage" if e.get("usage") else "empty")
            usage = {k: e["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} \
                if e.get("usage") else None
            continue
        assert not tail, f"a choice chunk after {tail}"
        ch = e["choices"][0]
        kinds = per_choice.setdefault(ch["index"], [])
        if chat and ch.get("delta", {}).get("role"):
            kinds.append("role")
        elif ch.get("finish_reason"):
            kinds.append("finish")
            finish[ch["index"]] = ch["finish_reason"]
        elif not kinds or kinds[-1] != "tokens":
            kinds.append("tokens")
    objects = sorted({e["object"] for e in events if isinstance(e, dict) and "object" in e})
    out = {"choices": [per_choice[k] for k in sorted(per_choice)], "tail": tail, "objects": objects}
    if case.exact_usage:
        out["finish"] = [finish.get(k) for k in sorted(per_choice)]
        out["usage"] = usage
    elif usage is not None:
        out["usage_prompt_tokens"] = usage["prompt_tokens"]
    return out


def shape(case: Case, raw: dict) -> dict:
    """What must match between real vLLM and the emulator for ``case``."""
    status, text = raw["status"], raw["text"]
    out: dict = {"status": status}
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if status >= 400:
        if isinstance(body, dict) and "error" in body and isinstance(body["error"], dict):
            err = body["error"]
            out.update(envelope="nested", type=err.get("type"), param=err.get("param"), code=err.get("code"))
        elif isinstance(body, dict) and body.get("object") == "error":
            err = body
            out.update(envelope="flat", type=err.get("type"), param=err.get("param"), code=err.get("code"))
        else:
            out.update(envelope="other", body=body if body is not None else text[:200])
            return out
        if case.message:
            out["message"] = err.get("message")
        return out
    path = case.path
    if path in ("/v1/completions", "/v1/chat/completions"):
        chat = path.endswith("chat/completions")
        if raw["content_type"].startswith("text/event-stream"):
            out["stream"] = _stream_shape(case, text, chat)
            return out
        out["object"] = body["object"]
        out["model"] = body["model"]
        out["choices"] = len(body["choices"])
        out["prompt_tokens"] = body["usage"]["prompt_tokens"]
        if case.exact_usage:
            out["completion_tokens"] = body["usage"]["completion_tokens"]
            out["finish"] = [c["finish_reason"] for c in body["choices"]]
        out["id_prefix"] = body["id"].split("-")[0]
        if "x-request-id" in case.headers:
            out["id"] = body["id"]
        return out
    if path == "/v1/models":
        out["cards"] = [{k: m.get(k) for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")}
                        for m in body["data"]]
        out["card_fields"] = sorted(body["data"][0])
        return out
    if path == "/version":
        out["version"] = ".".join(body["version"].split("+")[0].split(".")[:2])
        return out
    if path == "/tokenize":
        out.update({k: body.get(k) for k in ("count", "max_model_len", "tokens", "token_strs")})
        return out
    if path == "/detokenize":
        out["prompt"] = body.get("prompt")
        return out
    out["text"] = text
    return out
