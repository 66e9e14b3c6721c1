"""`/v1/chat/completions` bodies: `ChatMessage`, what renders messages through the chat template (`_ChatRender`,
shared with /tokenize), `ChatCompletionRequest`, and the responses: `ChatCompletionResponse`, and the
`chat.completion.chunk`s of a stream (`ChatCompletionStreamResponse`, `DeltaMessage`)."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from dblock.serving.protocol_base import UsageInfo, _Body, _Out, _f, _fail, _short, unsupported
from dblock.serving.protocol_sampling import _Sampling


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

    _logprobs = unsupported("logprobs", "logprobs are not supported, got true")
    _top_logprobs = unsupported("top_logprobs", lambda v: f"logprobs are not supported, got {v}")
    _tools = unsupported("tools", "tool calling is not supported")
    _tool_choice = unsupported("tool_choice", lambda v: f"tool calling is not supported, got {_short(v)}",
                               refused=lambda v: v not in (None, "none", "auto"))
    _response_format = unsupported(
        "response_format", lambda v: f"only {{\"type\": \"text\"}} is supported, got {_short(v)}",
        refused=lambda v: v is not None and v.get("type", "text") != "text")

    @property
    def budget(self) -> Optional[int]:
        """max_completion_tokens (OpenAI's current name) when given, else max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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
