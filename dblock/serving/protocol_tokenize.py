"""vLLM's `/tokenize` and `/detokenize` bodies: `TokenizeRequest` (a prompt, or messages rendered with the chat
template), `TokenizeResponse`, `DetokenizeRequest`, `DetokenizeResponse`."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import ValidationInfo, field_validator

from dblock.serving.protocol_base import _Body, _Out, _f, _fail
from dblock.serving.protocol_chat import ChatMessage


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


class TokenizeResponse(_Out):
    _omit_if_none: ClassVar[tuple] = ('token_strs',)
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(_Out):
    prompt: str
