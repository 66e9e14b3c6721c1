"""Request and response bodies of the OpenAI-compatible server, as pydantic models; every 4xx names its field.

Requests are validated strictly (no "8" for 8, no true for 1). Every field a request may carry is listed below: a
field this server does not honour is refused by name with a 400 (`logit_bias`, the legacy `functions` /
`function_call`, ... : `NOT_HONOURED`, each with its reason; any other unknown field: "not a field this server
accepts", with the accepted ones), never silently ignored. A failed validation is a 400 whose message starts with the offending parameter
(`max_tokens: must be an integer >= 1, got 0`, `stream_options.include_usage: ...`, `messages[0].role: ...`).

`/v1/completions` (`CompletionRequest`)
  prompt        string (encoded by the model folder's tokenizer.json), a list of token ids, or a list of either
                (several prompts = several independent requests in one call, one choice each; at most `max_prompts`)
  max_tokens    integer >= 1 (default: the server's --max-new-tokens), at most `max_tokens_limit`
  seed          integer in [0, 2^63) or null (default: the server's --seed); maps to the request's noise seed
  stream        bool: server-sent events, one per committed block, then a final chunk and `data: [DONE]`
  stream_options {"include_usage": bool}
  model         optional; when given it must name the served model (else 404)
  add_special_tokens  bool (default true), as vLLM
  allow_special_tokens  bool (default false; a dblock extension): see "Special tokens" below
  n             integer >= 1 (default 1), at most `max_prompts`: n choices per prompt, sample j with seed + j
                (choice index prompt * n + j)
  best_of       only 1;  echo only false;  logprobs only null/0;  suffix only null
`/v1/chat/completions` (`ChatCompletionRequest`)
  messages      non-empty list of {"role", "content": string | [{"type": "text", "text"}] | null, ...}; rendered
                by the chat template (`chat.py`) with the generation prompt
  max_completion_tokens | max_tokens, seed, stream, stream_options, model, n, stop: as above
  add_generation_prompt (default true), continue_final_message (default false), chat_template_kwargs (object),
  add_special_tokens (default false), allow_special_tokens (default false); logprobs only false, top_logprobs
  only null/0, tools only null/[], tool_choice only null/"none"/"auto", response_format only null/{"type":
  "text"}; a per-request chat_template is refused (start the server with --chat-template)
Sampling and stop fields of both (numbers must be finite: NaN and Infinity are refused), applied per request as a
`dblock.decoding.params.SamplingParams` (docs/algorithms.md §2.4, §2.6; the mapping is in `server.py`); an absent
field takes the server's default (`dblock serve` decoding flags: greedy, no stops, unless set there):
  temperature   0 (greedy argmax, dblock's default; OpenAI's default of 1 is not assumed) or a number in
                [1e-4, 1e4]: masked models sample from softmax(z / T) after top_k and top_p
  top_p         number in (0, 1];  top_k  integer: -1 or 0 = off, or >= 1
                (DiffusionGemma samples with its own entropy-bound schedule: temperature/top_p/top_k other than
                0/1/off get 400 naming the field)
  stop          string or list of at most `MAX_STOPS` non-empty strings: the returned text ends before the first
                one (excluded, as OpenAI); also tokenized, so decoding stops there
  stop_token_ids  list of token ids that end generation like EOS (vLLM's)
  min_tokens    integer >= 0 (at most max_tokens): no stop before that many tokens;  ignore_eos  bool
  presence_penalty / frequency_penalty: only 0 or null (the server applies no penalties); user (string):
                metadata, accepted (it changes nothing, as OpenAI's).
`/tokenize` (`TokenizeRequest`): {"prompt": string, "add_special_tokens": bool (default true)} or {"messages",
  "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "add_special_tokens" (default false)};
  `return_token_strs`, `allow_special_tokens`. `/detokenize` (`DetokenizeRequest`): {"tokens": [int, ...]}.

Special tokens: text never becomes a control token (EOS, mask, pad, BOS, ... : the tokenizer's special added tokens
and the model config's control ids) from its literal spelling unless the request says `"allow_special_tokens":
true`. A text prompt is encoded by `dblock.tasks.tokenizer.encode_prompt`, which encodes `<eos>` in the text as the
ordinary characters (the `tokenizers` library's `encode_special_tokens`, Hugging Face's `split_special_tokens`), so a
prompt cannot end its own completion; a character the vocabulary lacks is a 400 naming the parameter, the character
and its position. Token-id prompts are taken as given. Chat messages: see `server.py` (the template's own control
tokens stay real; message text holding a special token's spelling is refused).

Bodies are JSON of at most `MAX_JSON_DEPTH` levels of nested arrays and objects (`check_json_depth`, a scan of the
raw bytes before parsing: 400 "request body nests deeper than ..." instead of a parser recursion).

Errors are OpenAI-shaped (`ErrorResponse`): {"error": {"message", "type", "param", "code"}} with status 400
(invalid), 401 (authentication), 404 (unknown model or path), 405 (wrong method), 413 (body too large), 422
(validation of a framework-parsed parameter), 429 (busy), 503 (shutting down).
"""
from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_serializer)
from pydantic_core import PydanticCustomError

MAX_SEED = 2 ** 63 - 1
#: most stop strings / stop token ids in one request, and the longest stop string (characters)
MAX_STOPS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256

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

# error types raised by the validators below; their text is the message (pydantic's own types get the field's
# description instead)
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
# requests
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

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v != 1:
            raise _fail("unsupported_value", f"only best_of = 1 is supported, got {v}")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise _fail("unsupported_value", "echo is not supported, got true")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v:
            raise _fail("unsupported_value", f"logprobs are not supported, got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v is not None:
            raise _fail("unsupported_value", f"suffix is not supported, got {_short(v)}")
        return v

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


class ChatMessage(BaseModel):
    """One message; fields beyond role and content (name, tool_calls, ...) reach the template unchanged."""
    model_config = ConfigDict(strict=True, extra="allow")

    role: str = _f(..., "must be a string such as \"system\", \"user\" or \"assistant\"", min_length=1)
    content: Any = _f(None, "must be a string, a list of text parts, or null")

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        """Text parts are joined with newlines (vLLM's "string" content format); other kinds are refused."""
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise _fail("invalid_value", f"must be a string, a list of text parts, or null, got {_short(v)}")
        texts = []
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(kind, str) and kind != "text":
                raise _fail("unsupported_value", f"only text parts are supported, got a {kind!r} part")
            else:
                raise _fail("invalid_value", f"a part must be {{\"type\": \"text\", \"text\": string}}, got "
                            + _short(part))
        return "\n".join(texts)

    def for_template(self) -> dict:
        d = {k: v for k, v in self.model_dump().items() if v is not None or k == "content"}
        return d


class _ChatRender(_Body):
    """What renders `messages` into a prompt (shared by chat completions and /tokenize)."""

    messages: list[ChatMessage] = _f(..., "must be a non-empty list of {\"role\", \"content\"} objects", min_length=1)
    add_generation_prompt: Optional[bool] = _f(True, "must be true or false")
    continue_final_message: Optional[bool] = _f(False, "must be true or false")
    chat_template_kwargs: Optional[dict[str, Any]] = _f(None, "must be an object")
    chat_template: Optional[str] = _f(None, "must be a string")
    add_special_tokens: Optional[bool] = _f(False, "must be true or false")
    allow_special_tokens: Optional[bool] = _f(False, "must be true or false")

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v):
        if v is not None:
            raise _fail("unsupported_value", "per-request chat templates are not accepted: the server renders with "
                        "its model's template (dblock serve --chat-template)")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, v, info: ValidationInfo):
        if v and info.data.get("add_generation_prompt"):
            raise _fail("invalid_value", "continue_final_message and add_generation_prompt cannot both be true; "
                        "send add_generation_prompt: false")
        return v

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


class ChatCompletionRequest(_ChatRender, _Sampling):
    max_tokens: Optional[int] = _f(None, "must be an integer >= 1", ge=1)
    max_completion_tokens: Optional[int] = _f(None, "must be an integer >= 1", ge=1)
    logprobs: Optional[bool] = _f(None, "must be true or false")
    top_logprobs: Optional[int] = _f(None, "must be an integer >= 0", ge=0)
    tools: Optional[list] = _f(None, "must be a list")
    tool_choice: Any = _f(None, "must be \"none\" or \"auto\"")
    response_format: Optional[dict] = _f(None, "must be an object")

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, v, info: ValidationInfo):
        return cls._check_max(v, info)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v:
            raise _fail("unsupported_value", "logprobs are not supported, got true")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        if v:
            raise _fail("unsupported_value", f"logprobs are not supported, got {v}")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v:
            raise _fail("unsupported_value", "tool calling is not supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise _fail("unsupported_value", f"tool calling is not supported, got {_short(v)}")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        if v is not None and v.get("type", "text") != "text":
            raise _fail("unsupported_value", f"only {{\"type\": \"text\"}} is supported, got {_short(v)}")
        return v

    @property
    def budget(self) -> Optional[int]:
        """max_completion_tokens (OpenAI's current name) when given, else max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""

    model: Optional[str] = _f(None, "must be a string")
    prompt: Optional[str] = _f(None, "must be a string")
    messages: Optional[list[ChatMessage]] = _f(None, "must be a non-empty list of {\"role\", \"content\"} objects",
                                               min_length=1, validate_default=True)
    add_special_tokens: Optional[bool] = _f(None, "must be true or false")
    add_generation_prompt: Optional[bool] = _f(True, "must be true or false")
    continue_final_message: Optional[bool] = _f(False, "must be true or false")
    chat_template_kwargs: Optional[dict[str, Any]] = _f(None, "must be an object")
    return_token_strs: Optional[bool] = _f(False, "must be true or false")
    allow_special_tokens: Optional[bool] = _f(False, "must be true or false")

    @field_validator("messages")
    @classmethod
    def _one_of(cls, v, info: ValidationInfo):
        has_prompt = info.data.get("prompt") is not None
        if (v is None) == (not has_prompt):
            raise _fail("missing_field" if v is None else "invalid_value",
                        "give exactly one of prompt (a string) and messages (a list)", "prompt")
        return v

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages or []]

    @property
    def special_tokens(self) -> bool:
        """vLLM's defaults: true for a prompt, false for messages (the template writes them)."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(_Body):
    model: Optional[str] = _f(None, "must be a string")
    tokens: list[int] = _f(..., "must be a list of token ids (integers)")


# ---------------------------------------------------------------------------------------------------------------
# responses
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


class ChatMessageOut(_Out):
    role: str = "assistant"
    content: str


class ChatCompletionChoice(_Out):
    index: int
    message: ChatMessageOut
    token_ids: list[int]
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Out):
    _omit_if_none: ClassVar[tuple] = ('dblock',)
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    dblock: Optional[dict] = None


class DeltaMessage(_Out):
    _omit_if_none: ClassVar[tuple] = ('role', 'content')
    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(_Out):
    _omit_if_none: ClassVar[tuple] = ('token_ids',)
    index: int
    delta: DeltaMessage
    token_ids: Optional[list[int]] = None
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionStreamResponse(_Out):
    _omit_if_none: ClassVar[tuple] = ('usage', 'dblock')
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None
    dblock: Optional[dict] = None


class ModelCard(_Out):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "dblock"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Out):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(_Out):
    _omit_if_none: ClassVar[tuple] = ('token_strs',)
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(_Out):
    prompt: str


class VersionResponse(_Out):
    version: str


# ---------------------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------------------

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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


OPT_IN = '"allow_special_tokens": true'


def encode(x: Any, param: str, limits: Limits, tokenizer, add_special_tokens: bool = True,
           allow_special: bool = False, control_ids=()) -> list:
    """A prompt (text, or token ids) -> token ids within the prompt limit, or `APIError` naming `param`.

    Text goes through `dblock.tasks.tokenizer.encode_prompt`: with `allow_special` False (the default) the spelling
    of a special token is ordinary text and no control token (a special added token, or one of `control_ids`) can
    come out; a character outside the vocabulary is a 400 naming it."""
    if isinstance(x, str):
        if tokenizer is None:
            raise APIError(400, f"{param}: this model folder has no tokenizer.json: send token ids (a list of "
                           "integers)", param, "no_tokenizer")
        if len(x) == 0:
            raise APIError(400, f"{param}: empty string", param, "invalid_value")
        if len(x) > 16 * limits.max_prompt_tokens:     # bound the tokenizer's work before counting tokens
            raise APIError(400, f"{param}: {len(x)} characters; at most {limits.max_prompt_tokens} tokens are "
                           "accepted (--max-prompt-tokens)", param, "limit_exceeded")
        ids = encode_text(tokenizer, x, param, allow_special, add_special_tokens=bool(add_special_tokens),
                          control_ids=control_ids)
    else:
        ids = list(x)
    if len(ids) == 0:
        raise APIError(400, f"{param}: empty: give at least one token", param, "invalid_value")
    if len(ids) > limits.max_prompt_tokens:
        raise APIError(400, f"{param}: {len(ids)} tokens exceeds this server's limit of {limits.max_prompt_tokens} "
                       "(--max-prompt-tokens)", param, "limit_exceeded")
    return ids


def encode_text(tokenizer, text: str, param: str, allow_special: bool, *, add_special_tokens: bool = True,
                control_ids=(), name: Optional[str] = None) -> list:
    """`encode_prompt` with its `PromptError` as a 400 naming `param` ("{param}: cannot be tokenized: ..."); `name`
    (default `param`) is how the text is named inside the message."""
    from dblock.tasks.tokenizer import PromptError, encode_prompt
    name = name or param
    try:
        return encode_prompt(tokenizer, text, bool(allow_special), add_special_tokens=add_special_tokens,
                             control_ids=control_ids, name=name, opt_in=OPT_IN)
    except PromptError as e:
        msg = str(e)
        detail = msg[len(name) + 2:] if msg.startswith(name + ": ") else msg
        where = "" if name == param else f"{name}: "
        raise APIError(400, f"{param}: cannot be tokenized: {where}{detail}", param, "invalid_value") from None
    except Exception as e:                              # a tokenizer failure on odd text: still the request's 400
        detail = (str(e).splitlines() or [""])[0][:200]
        raise APIError(400, f"{param}: cannot be tokenized ({type(e).__name__}: {detail})", param,
                       "invalid_value") from None
