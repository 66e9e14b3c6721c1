"""The sampling and stop fields completions and chat completions share (`_Sampling`: model, seed, stream,
stream_options, n, stop, stop_token_ids, temperature, top_p, top_k, min_tokens, ignore_eos, penalties, user), with
their bounds."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationInfo, field_validator

from dblock.serving.protocol_base import Limits, _Body, _context, _f, _fail, _short

MAX_SEED = 2 ** 63 - 1
#: most stop strings / stop token ids in one request, and the longest stop string (characters)
MAX_STOPS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256


class StreamOptions(_Body):
    include_usage: Optional[bool] = _f(False, "must be true or false")


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = _f(None, "must be a string")
    seed: Optional[int] = _f(None, "must be an integer in [0, 2^63)", ge=0, le=MAX_SEED)
    stream: Optional[bool] = _f(False, "must be true or false")
    stream_options: Optional[StreamOptions] = _f(None, "must be an object")
    n: Optional[int] = _f(None, "must be an integer >= 1", ge=1)
    stop: Any = _f(None, "must be a string or a list of strings")
    stop_token_ids: Optional[list[int]] = _f(None, "must be a list of token ids (integers >= 0)")
    temperature: Optional[float] = _f(None, "must be a finite number >= 0", ge=0, allow_inf_nan=False)
    top_p: Optional[float] = _f(None, "must be a finite number in (0, 1]", gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = _f(None, "must be an integer: -1 or 0 (no top-k) or >= 1", ge=-1)
    min_tokens: Optional[int] = _f(None, "must be an integer >= 0", ge=0)
    ignore_eos: Optional[bool] = _f(None, "must be true or false")
    presence_penalty: Optional[float] = _f(None, "must be a finite number in [-2, 2]", ge=-2, le=2,
                                           allow_inf_nan=False)
    frequency_penalty: Optional[float] = _f(None, "must be a finite number in [-2, 2]", ge=-2, le=2,
                                            allow_inf_nan=False)
    user: Optional[str] = _f(None, "must be a string")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v, info: ValidationInfo):
        if v:
            raise _fail("unsupported_value", f"{info.field_name} is not applied by this server; only 0 (or null) is "
                        f"accepted, got {v!r}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v, info: ValidationInfo):
        limits = _context(info).get("limits") or Limits()
        if v is not None and v > limits.max_prompts:
            raise _fail("limit_exceeded", f"{v} choices in one request; at most {limits.max_prompts}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return v
        if not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
            raise _fail("invalid_value", f"must be a string or a list of strings, got {_short(v)}")
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOPS:
            raise _fail("limit_exceeded", f"{len(stops)} stop strings; at most {MAX_STOPS}")
        for s in stops:
            if s == "":
                raise _fail("invalid_value", "a stop string must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise _fail("limit_exceeded", f"a stop string of {len(s)} characters; at most {MAX_STOP_CHARS}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v):
        if v is None:
            return v
        if len(v) > MAX_STOP_TOKEN_IDS:
            raise _fail("limit_exceeded", f"{len(v)} stop token ids; at most {MAX_STOP_TOKEN_IDS}")
        bad = next((t for t in v if t < 0), None)
        if bad is not None:
            raise _fail("invalid_value", f"token id {bad} is negative; give token ids >= 0")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        from dblock.decoding.params import MAX_TEMPERATURE, MIN_TEMPERATURE
        if v is not None and v != 0 and not MIN_TEMPERATURE <= v <= MAX_TEMPERATURE:
            raise _fail("invalid_value", f"must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                        f"{MAX_TEMPERATURE:g}], got {v!r}")
        return v

    @property
    def stop_strings(self) -> list:
        """`stop` as a list of strings ([] when absent)."""
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @staticmethod
    def _check_max(v, info: ValidationInfo):
        limits = _context(info).get("limits")
        if v is not None and limits is not None and v > limits.max_tokens_limit:
            raise _fail("limit_exceeded", f"{v} exceeds this server's limit of {limits.max_tokens_limit} "
                                          "(--max-tokens-limit)")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
