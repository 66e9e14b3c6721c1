"""`/v1/chat/completions` (`OpenAIServingChat`): `messages` rendered by the model's chat template (`chat.py`, in the
killable workers of `render_worker.py`, off the event loop) and tokenized (`render`, also /tokenize's), then generated
as completions are; and the chat response format (`_ChatFormat`): one `chat.completion`, or streamed as
`chat.completion.chunk`s: `delta.role` first, `delta.content` per committed block, an empty delta with
`finish_reason`, usage, `data: [DONE]`. A model without a template (and no --chat-template), or without a
tokenizer.json, answers 400.

Special tokens: message strings (and `chat_template_kwargs` strings) holding a special token's spelling are refused
unless the request says `"allow_special_tokens": true` (`chat.find_special_text`); the template's own control tokens
stay real.
"""
from __future__ import annotations

import asyncio
import uuid

from dblock.serving.chat import ChatTemplateError, find_special_text, special_text_pattern
from dblock.serving.protocol_base import APIError, UsageInfo, parse
from dblock.serving.protocol_chat import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                                          ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatMessageOut,
                                          DeltaMessage)
from dblock.serving.protocol_prompt import encode, encode_text
from dblock.serving.serving_completion import _CompletionFormat
from dblock.serving.serving_engine import OpenAIServing
from dblock.serving.streaming import _block_info, _request_info


def _special_spellings(tokenizer) -> list:
    """The text of the tokenizer's special added tokens (what `tokenizers` turns into control tokens)."""
    try:
        return [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    except AttributeError:                                  # not a tokenizers.Tokenizer
        return []


class _ChatFormat(_CompletionFormat):
    """The chat response shape: `chat.completion`, streamed as `chat.completion.chunk`s (see `_CompletionFormat`)."""

    def _chunk(self, choices, **kw) -> dict:
        return ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                            **kw).model_dump()

    def opening(self, n: int) -> list:
        return [self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(n)]

    def block(self, i: int, text: str, ids: list, data: dict) -> dict:
        return self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=text), token_ids=ids)],
                           dblock=_block_info(data))

    def text(self, i: int, text: str) -> dict:
        return self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=text))])

    def final(self, i: int, r, data: dict) -> dict:
        return self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(),
                                                       finish_reason=data["finish_reason"])],
                           dblock={"request": _request_info(r, data)})

    def response(self, results: list, usage: UsageInfo, infos: list) -> dict:
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage, dblock={"requests": infos},
            choices=[ChatCompletionChoice(index=i, message=ChatMessageOut(content=text), token_ids=ids,
                                          finish_reason=fr) for i, text, ids, fr in results]).model_dump()

class OpenAIServingChat(OpenAIServing):
    """POST /v1/chat/completions, over the server's chat template (None: chat answers 400) and its `renderer`
    (`render_worker.BoundedRenderer`, started and closed by the app)."""

    def __init__(self, engine, *, chat_template=None, renderer=None, **kw):
        super().__init__(engine, **kw)
        self.chat_template, self.renderer = chat_template, renderer
        self.special_re = (special_text_pattern(_special_spellings(self.tokenizer)) if self.tokenizer is not None
                           else None)

    def render(self, req, add_special_tokens: bool) -> list:
        """`messages` through the chat template and the tokenizer -> prompt ids (or APIError naming `messages`).

        Message strings (and `chat_template_kwargs` strings) holding a special token's spelling are refused unless
        `allow_special_tokens`; the rendered text is then tokenized with special tokens recognised, so the ones the
        template writes are real control tokens (see `chat.py`)."""
        chat_template, tokenizer, limits, renderer = self.chat_template, self.tokenizer, self.limits, self.renderer
        special_re = self.special_re
        if chat_template is None:
            raise APIError(400, "messages: this model has no chat template (neither chat_template.jinja nor a "
                           "chat_template in tokenizer_config.json in its folder): start the server with "
                           "--chat-template PATH_OR_STRING, or send a prompt to /v1/completions", "messages",
                           "no_chat_template")
        if tokenizer is None:
            raise APIError(400, "messages: this model folder has no tokenizer.json, so messages cannot be encoded: "
                           "send token ids to /v1/completions", "messages", "no_tokenizer")
        messages = req.template_messages()
        allow = bool(req.allow_special_tokens)
        if not allow and special_re is not None:
            hit = find_special_text(messages, special_re, "messages") or \
                find_special_text(req.chat_template_kwargs or {}, special_re, "chat_template_kwargs")
            if hit is not None:
                where, pos, spelled = hit
                raise APIError(400, f"{where}: the text {spelled!r} at position {pos} is the spelling of a special "
                               "token; message text cannot produce control tokens (send \"allow_special_tokens\": "
                               "true to opt in)", where, "special_token_in_text")
        try:
            text = renderer.render(messages, bool(req.add_generation_prompt), bool(req.continue_final_message),
                                   req.chat_template_kwargs)
        except ChatTemplateError as e:
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages",
                           "chat_template_error") from None
        if not text:
            empty = next((i for i, m in enumerate(messages) if not m.get("content")), None)
            if empty is not None:
                raise APIError(400, f"messages[{empty}].content: missing or empty, and the chat template rendered "
                               "nothing from the messages (an empty prompt)", f"messages[{empty}].content",
                               "missing_field")
            roles = ", ".join(sorted({str(m.get("role")) for m in messages}))
            raise APIError(400, f"messages: the chat template rendered nothing from these messages (roles: {roles}; "
                           "an empty prompt -- this model's template may drop system messages: add a user "
                           "message)", "messages", "empty_prompt")
        try:
            return encode(text, "messages", limits, tokenizer, add_special_tokens, allow_special=True)
        except APIError as e:
            if e.code != "invalid_value" or not text:
                raise
            for i, m in enumerate(messages):             # name the message whose text cannot be tokenized
                for key, v in m.items():
                    if isinstance(v, str) and v and v in text:       # (what the template actually wrote)
                        encode_text(tokenizer, v, "messages", allow, add_special_tokens=False,
                                    name=f"messages[{i}].{key}")
            raise

    async def create_chat_completion(self, request):
        ep = "/v1/chat/completions"
        try:
            body = await self.read_body(request)
            creq = parse(ChatCompletionRequest, body, self.limits, (self.model_name,))
            ids = await asyncio.to_thread(self.render, creq, bool(creq.add_special_tokens))   # off the event loop
            sampling, stops = self.sampling_of(creq)
        except APIError as e:
            return self.fail(ep, e)
        fmt = _ChatFormat("chatcmpl-" + uuid.uuid4().hex[:24], self.model_name)
        return await self.generate(request, ep, fmt, [ids], creq.budget, creq.seed, bool(creq.stream),
                                   creq.include_usage, sampling, stops, creq.n or 1)
