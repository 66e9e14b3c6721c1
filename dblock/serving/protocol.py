"""The OpenAI `/v1/completions` request schema, validated by hand so every 4xx names the offending field.

Accepted body (JSON object; unknown keys are ignored, as OpenAI-compatible servers do):

  prompt        string (encoded by the model folder's tokenizer.json), a list of token ids, or a list of either
                (several prompts = several independent requests in one call, one choice each; at most `max_prompts`)
  max_tokens    integer >= 1 (default: the server's --max-new-tokens), at most `max_tokens_limit`
  seed          integer in [0, 2^63) or null (default: the server's --seed); maps to the request's noise seed
  stream        bool: server-sent events, one per committed block, then a final chunk and `data: [DONE]`
  stream_options {"include_usage": bool}
  model         optional; when given it must name the served model (else 404)
  n, best_of    only 1;  echo only false;  logprobs only null/0;  suffix only null;  stop only null or []
  temperature, top_p, presence_penalty, frequency_penalty, user: accepted and ignored (decoding follows the
                server's step rule, e.g. the greedy threshold rule of docs/algorithms.md §2.1)

Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}} with status 400 (invalid), 401
(authentication), 404 (unknown model or path), 413 (body too large), 429 (busy), 503 (shutting down).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

MAX_SEED = 2 ** 63 - 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              413: "invalid_request_error", 429: "rate_limit_error",
                              503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    max_body_bytes: int = 1 << 20          # 1 MiB
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 1024
    max_prompts: int = 16

    def validate(self) -> "Limits":
        for k, v in vars(self).items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k}={v!r}: must be an integer >= 1")
        return self


@dataclass
class CompletionRequest:
    prompts: list                   # list of token-id lists
    max_tokens: Optional[int]
    seed: Optional[int]
    stream: bool
    include_usage: bool
    model: Optional[str]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param, code)


def _short(x: Any) -> str:
    s = json.dumps(x) if not isinstance(x, str) else repr(x)
    return s if len(s) <= 40 else s[:37] + "..."


def parse_completion(body: bytes, limits: Limits, tokenizer=None, model_names: tuple = ()) -> CompletionRequest:
    """Validate a `/v1/completions` body; raise `APIError` naming the field on any problem."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"request body: not valid JSON ({e})", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body: expected a JSON object", None, "invalid_json")

    model = data.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _bad("model", f"must be a string, got {_short(model)}")
        if model_names and model not in model_names:
            raise APIError(404, f"model: {model!r} is not served here (serving {', '.join(map(repr, model_names))})",
                           "model", "model_not_found")

    if "prompt" not in data or data["prompt"] is None:
        raise _bad("prompt", "required (a string or a list of token ids)", "missing_field")
    prompts = _prompts(data["prompt"], limits, tokenizer)

    max_tokens = data.get("max_tokens")
    if max_tokens is not None:
        if not _is_int(max_tokens) or max_tokens < 1:
            raise _bad("max_tokens", f"must be an integer >= 1, got {_short(max_tokens)}")
        if max_tokens > limits.max_tokens_limit:
            raise _bad("max_tokens", f"{max_tokens} exceeds this server's limit of {limits.max_tokens_limit} "
                       "(--max-tokens-limit)", "limit_exceeded")
    seed = data.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise _bad("seed", f"must be an integer in [0, 2^63), got {_short(seed)}")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", f"must be true or false, got {_short(stream)}")
    include_usage = False
    so = data.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("stream_options", f"must be an object, got {_short(so)}")
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise _bad("stream_options.include_usage", f"must be true or false, got {_short(iu)}")
        include_usage = iu
    for key, ok, what in (("n", lambda v: v == 1, "only n = 1 is supported"),
                          ("best_of", lambda v: v == 1, "only best_of = 1 is supported"),
                          ("echo", lambda v: v is False, "echo is not supported"),
                          ("logprobs", lambda v: v == 0 and not isinstance(v, bool), "logprobs are not supported"),
                          ("suffix", lambda v: False, "suffix is not supported"),
                          ("stop", lambda v: v == [], "stop sequences are not supported (blocks end at EOS or "
                                                      "max_tokens)")):
        if data.get(key) is not None and not ok(data[key]):
            raise _bad(key, f"{what}, got {_short(data[key])}", "unsupported_value")
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = data.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise _bad(key, f"must be a number, got {_short(v)}")
    return CompletionRequest(prompts, max_tokens, seed, stream, include_usage, model)


def _prompts(p: Any, limits: Limits, tokenizer) -> list:
    if isinstance(p, str):
        return [_one(p, "prompt", limits, tokenizer)]
    if not isinstance(p, list) or len(p) == 0:
        raise _bad("prompt", f"must be a string, a list of token ids, or a non-empty list of those; got {_short(p)}")
    if all(_is_int(t) for t in p):
        return [_one(p, "prompt", limits, tokenizer)]
    if all(isinstance(x, (str, list)) for x in p):
        if len(p) > limits.max_prompts:
            raise _bad("prompt", f"{len(p)} prompts in one request; at most {limits.max_prompts}", "limit_exceeded")
        return [_one(x, f"prompt[{i}]", limits, tokenizer) for i, x in enumerate(p)]
    bad = next(x for x in p if not _is_int(x))
    raise _bad("prompt", f"a token-id list must hold integers only, found {_short(bad)}")


def _one(x: Any, param: str, limits: Limits, tokenizer) -> list:
    if isinstance(x, str):
        if tokenizer is None:
            raise _bad(param, "this model folder has no tokenizer.json: send token ids (a list of integers)",
                       "no_tokenizer")
        if len(x) == 0:
            raise _bad(param, "empty string")
        if len(x) > 16 * limits.max_prompt_tokens:     # bound the tokenizer's work before counting tokens
            raise _bad(param, f"{len(x)} characters; at most {limits.max_prompt_tokens} tokens are accepted "
                       "(--max-prompt-tokens)", "limit_exceeded")
        try:
            ids = list(tokenizer.encode(x).ids)
        except Exception as e:
            raise _bad(param, f"cannot be tokenized ({type(e).__name__}: {e})") from None
    elif isinstance(x, list):
        if not all(_is_int(t) for t in x):
            bad = next(t for t in x if not _is_int(t))
            raise _bad(param, f"a token-id list must hold integers only, found {_short(bad)}")
        ids = list(x)
    else:
        raise _bad(param, f"must be a string or a list of token ids, got {_short(x)}")
    if len(ids) == 0:
        raise _bad(param, "empty: give at least one token")
    if len(ids) > limits.max_prompt_tokens:
        raise _bad(param, f"{len(ids)} tokens exceeds this server's limit of {limits.max_prompt_tokens} "
                   "(--max-prompt-tokens)", "limit_exceeded")
    return ids
