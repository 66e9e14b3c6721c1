"""What every request and response body of the server shares: the OpenAI error shape (`APIError`, `ErrorResponse`),
the server's `Limits`, the strict request base (`_Body`: unknown fields refused by name, `NOT_HONOURED` with its
reasons), a pydantic validation failure as one 400 naming its field (`api_error`), the response base (`_Out`),
`UsageInfo`, the JSON depth scan of the raw body, and `parse` (body -> model).

The bodies themselves live per endpoint (`protocol_sampling.py`, `protocol_completion.py`, `protocol_chat.py`,
`protocol_tokenize.py`, `protocol_models.py`); `protocol.py` re-exports them all and documents every field.
"""
from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_serializer
from pydantic_core import PydanticCustomError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
               503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


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


# ---------------------------------------------------------------------------------------------------------------
# validation errors -> one APIError naming the field
# ---------------------------------------------------------------------------------------------------------------

# error types raised by the request bodies' validators (`_fail`); their text is the message (pydantic's own
# types get the field's description instead)
_OWN = {"invalid_value", "unsupported_value", "limit_exceeded", "missing_field"}


def _fail(code: str, message: str, param: Optional[str] = None) -> PydanticCustomError:
    ctx = {"m": message} if param is None else {"m": message, "param": param}
    return PydanticCustomError(code, "{m}", ctx)          # the text travels in ctx: braces in it stay literal


def _short(x: Any) -> str:
    try:
        s = json.dumps(x) if not isinstance(x, str) else repr(x)
    except (TypeError, ValueError):
        s = repr(x)
    return s if len(s) <= 40 else s[:37] + "..."


def _param(loc) -> Optional[str]:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (("." if out else "") + str(part))
    return out or None


def _inner_model(annotation) -> Optional[type]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        m = _inner_model(arg)
        if m is not None:
            return m
    return None


def _fields_at(cls, loc) -> list:
    """The field names of the (nested) model at `loc` (list indices skipped)."""
    for part in loc:
        if isinstance(part, int):
            continue
        f = cls.model_fields.get(part) if cls is not None else None
        cls = _inner_model(f.annotation) if f is not None else None
    return list(cls.model_fields) if cls is not None else []


def _description(cls, loc) -> Optional[str]:
    desc = None
    for part in loc:
        if isinstance(part, int):
            continue
        f = cls.model_fields.get(part) if cls is not None else None
        if f is None:
            break
        desc, cls = f.description, _inner_model(f.annotation)
    return desc


def api_error(e: ValidationError, cls) -> APIError:
    """The first error of a pydantic validation as a 400 naming its field."""
    err = e.errors(include_url=False)[0]
    kind, loc, ctx = err["type"], tuple(err.get("loc", ())), err.get("ctx") or {}
    if kind == "json_invalid":
        return APIError(400, f"request body: not valid JSON ({ctx.get('error', err['msg'])})", None, "invalid_json")
    if not loc:
        return APIError(400, "request body: expected a JSON object", None, "invalid_json")
    param = ctx.get("param") or _param(loc)
    if kind == "extra_forbidden":
        why = NOT_HONOURED.get(str(loc[-1]))
        if why is None:
            known = sorted(_fields_at(cls, loc[:-1]))
            why = ("not a field this server accepts (it would be ignored); accepted here: " + ", ".join(known)
                   if known else "not a field this server accepts")
        if not _param(loc):                    # an empty key: no name to give as the parameter
            return APIError(400, f"request body: field {str(loc[-1])!r}: {why}", None, "unsupported_field")
        return APIError(400, f"{param}: {why}", param, "unsupported_field")
    if kind in _OWN:
        return APIError(400, f"{param}: {ctx.get('m', err['msg'])}", param, kind)
    desc = _description(cls, loc) or err["msg"][:1].lower() + err["msg"][1:]
    if kind == "missing":
        return APIError(400, f"{param}: required; {desc}", param, "missing_field")
    return APIError(400, f"{param}: {desc}, got {_short(err.get('input'))}", param, "invalid_value")


def _context(info: ValidationInfo) -> dict:
    return info.context if isinstance(info.context, dict) else {}


# ---------------------------------------------------------------------------------------------------------------
# requests: the strict base
# ---------------------------------------------------------------------------------------------------------------

class _Body(BaseModel):
    # a field the server does not know is refused by name (a client that sends it would believe it took effect)
    model_config = ConfigDict(strict=True, extra="forbid")


#: fields OpenAI (or vLLM) define that this server does not honour: refused with a reason (any other unknown field is
#: refused as unknown)
NOT_HONOURED = {
    "logit_bias": "logit_bias is not supported: this server applies no per-token logit offsets",
    "functions": "the legacy function calling (functions / function_call) is not supported",
    "function_call": "the legacy function calling (functions / function_call) is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "logprobs": "logprobs are not supported",
    "top_logprobs": "logprobs are not supported",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "service_tier": "service tiers are not supported",
    "store": "stored completions are not supported", "metadata": "stored completions (metadata) are not supported",
    "reasoning_effort": "reasoning effort is not supported", "web_search_options": "web search is not supported",
    "repetition_penalty": "repetition_penalty is not supported", "min_p": "min_p is not supported",
    "length_penalty": "length_penalty is not supported", "guided_json": "guided decoding is not supported",
    "guided_regex": "guided decoding is not supported", "guided_choice": "guided decoding is not supported",
    "guided_grammar": "guided decoding is not supported", "structured_outputs": "guided decoding is not supported",
}


def _f(default, description: str, **kw):
    return Field(default, description=description, **kw)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def unsupported(field: str, message: Union[str, Callable[[Any], str]], refused: Callable[[Any], bool] = bool):
    """The validator of a field that asks for something this server does not do (logprobs, echo, tools, ...): a
    value `refused` holds for (by default any truthy value) is an `unsupported_value` error with `message` (or
    `message(value)`); any other value passes unchanged. Assign it in the body's class, one name per field."""
    def check(cls, v):
        if refused(v):
            raise _fail("unsupported_value", message(v) if callable(message) else message)
        return v
    check.__name__ = f"_{field}"
    return field_validator(field)(classmethod(check))


# ---------------------------------------------------------------------------------------------------------------
# responses: the base, errors, usage
# ---------------------------------------------------------------------------------------------------------------

class _Out(BaseModel):
    """A response body; the fields named in `_omit_if_none` are left out while None (OpenAI omits them)."""
    _omit_if_none: ClassVar[tuple] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        d = handler(self)
        for k in self._omit_if_none:
            if k in d and d[k] is None:
                del d[k]
        return d


class ErrorInfo(_Out):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Out):
    error: ErrorInfo


class UsageInfo(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# ---------------------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------------------

#: most levels of arrays and objects inside each other in a request body (the largest legitimate body, a chat
#: message with a few nested extra fields, needs well under 10)
MAX_JSON_DEPTH = 64

# one JSON string, or an unterminated one running to the end (possessive: linear time, no backtracking)
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+\\?+(?:"|\Z)', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKETS = bytes.maketrans(b"{}", b"[]")


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `body` nests arrays/objects deeper than `limit` levels, judged from its raw bytes without parsing it.

    Linear time in C loops: strings are cut out, the brackets kept (`{}` as `[]`), then every innermost `[]` pair
    is deleted, one pass per level, at most `limit` + 1 passes. Opening brackets left unmatched count as levels
    (only malformed JSON has them; it is refused either way)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    s = _JSON_STRING.sub(b"", body).translate(_BRACKETS, _NOT_BRACKETS)
    passes = 0
    while passes <= limit:
        t = s.replace(b"[]", b"")
        if t == s:
            break
        s, passes = t, passes + 1
    return passes + s.count(b"[") > limit


def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    if json_depth_exceeds(body, limit):
        raise APIError(400, f"request body nests deeper than {limit} levels of arrays and objects; no request "
                       "needs that many", None, "invalid_json")


def parse(cls, body: bytes, limits: Limits, model_names: tuple = ()):
    """Validate a JSON body into `cls`; raise `APIError` (400 naming the field, 404 for another model)."""
    check_json_depth(body)
    try:
        req = cls.model_validate_json(body, context={"limits": limits})
    except ValidationError as e:
        raise api_error(e, cls) from None
    model = getattr(req, "model", None)
    if model is not None and model_names and model not in model_names:
        raise APIError(404, f"model: {model!r} is not served here (serving {', '.join(map(repr, model_names))})",
                       "model", "model_not_found")
    return req
