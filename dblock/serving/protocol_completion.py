"""`/v1/completions` bodies: `CompletionRequest` (prompt, max_tokens, the completions-only fields, and the shared
sampling fields), `parse_completion` (validate, then tokenize the prompts), `CompletionResponse` and its choices
(also the shape of each streamed chunk)."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import PrivateAttr, ValidationInfo, field_validator

from dblock.serving.protocol_base import (Limits, UsageInfo, _Out, _context, _f, _fail, _is_int, _short, parse,
                                          unsupported)
from dblock.serving.protocol_prompt import encode
from dblock.serving.protocol_sampling import _Sampling


class CompletionRequest(_Sampling):
    prompt: Any = _f(None, "a string or a list of token ids", validate_default=True)
    max_tokens: Optional[int] = _f(None, "must be an integer >= 1", ge=1)
    best_of: Optional[int] = _f(None, "must be an integer >= 1", ge=1)
    echo: Optional[bool] = _f(None, "must be true or false")
    logprobs: Optional[int] = _f(None, "must be an integer >= 0", ge=0)
    suffix: Optional[str] = _f(None, "must be a string")
    add_special_tokens: Optional[bool] = _f(True, "must be true or false")
    allow_special_tokens: Optional[bool] = _f(False, "must be true or false")
    _prompt_ids: list = PrivateAttr(default_factory=list)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v, info: ValidationInfo):
        return cls._check_max(v, info)

    _best_of = unsupported("best_of", lambda v: f"only best_of = 1 is supported, got {v}",
                           refused=lambda v: v is not None and v != 1)
    _echo = unsupported("echo", "echo is not supported, got true")
    _logprobs = unsupported("logprobs", lambda v: f"logprobs are not supported, got {v}")
    _suffix = unsupported("suffix", lambda v: f"suffix is not supported, got {_short(v)}",
                          refused=lambda v: v is not None)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, p, info: ValidationInfo):
        limits = _context(info).get("limits") or Limits()
        if p is None:
            raise _fail("missing_field", "required (a string or a list of token ids)")
        if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
            return p
        if not isinstance(p, list) or len(p) == 0:
            raise _fail("invalid_value", "must be a string, a list of token ids, or a non-empty list of those; got "
                        + _short(p))
        if all(isinstance(x, (str, list)) for x in p):
            if len(p) > limits.max_prompts:
                raise _fail("limit_exceeded", f"{len(p)} prompts in one request; at most {limits.max_prompts}")
            for i, x in enumerate(p):
                if isinstance(x, list) and not all(_is_int(t) for t in x):
                    bad = next(t for t in x if not _is_int(t))
                    raise _fail("invalid_value", f"a token-id list must hold integers only, found {_short(bad)}",
                                f"prompt[{i}]")
            return p
        bad = next(x for x in p if not _is_int(x))
        raise _fail("invalid_value", f"a token-id list must hold integers only, found {_short(bad)}")

    @property
    def prompts(self) -> list:
        """Token-id lists, one per prompt (set by `parse_completion`)."""
        return self._prompt_ids


class CompletionChoice(_Out):
    index: int
    text: str
    token_ids: list[int]                          # vLLM's return_token_ids
    logprobs: None = None
    finish_reason: Optional[str] = None


class CompletionResponse(_Out):
    _omit_if_none: ClassVar[tuple] = ('usage', 'dblock')
    """A completion, and (with the same shape, `"object": "text_completion"`, as OpenAI) each streamed chunk."""
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    dblock: Optional[dict] = None    # per-block / per-request decoding counters


def parse_completion(body: bytes, limits: Limits, tokenizer=None, model_names: tuple = (),
                     control_ids=()) -> CompletionRequest:
    """Validate a `/v1/completions` body and tokenize its prompts (`.prompts`); raise `APIError` naming the field.
    `control_ids`: the model's control token ids, which text prompts may not produce (unless allowed)."""
    req = parse(CompletionRequest, body, limits, model_names)
    p = req.prompt
    kw = dict(add_special_tokens=req.add_special_tokens, allow_special=bool(req.allow_special_tokens),
              control_ids=control_ids)
    if isinstance(p, str) or all(_is_int(t) for t in p):
        req._prompt_ids = [encode(p, "prompt", limits, tokenizer, **kw)]
    else:
        req._prompt_ids = [encode(x, f"prompt[{i}]", limits, tokenizer, **kw) for i, x in enumerate(p)]
    return req
