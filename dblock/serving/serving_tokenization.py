"""vLLM's `/tokenize` and `/detokenize` (`OpenAIServingTokenization`): a prompt (or messages, rendered as chat
renders them) -> {"tokens", "count", "max_model_len"} (`"return_token_strs"`: the tokens' strings too); token ids ->
{"prompt"} (special tokens kept). Both need the model folder's tokenizer.json (400 otherwise)."""
from __future__ import annotations

import asyncio

from dblock.serving.protocol_base import APIError, parse
from dblock.serving.protocol_prompt import encode
from dblock.serving.protocol_tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from dblock.serving.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """POST /tokenize and /detokenize. `render`: messages -> prompt ids (`OpenAIServingChat.render`);
    `max_model_len`: the model's positions (0 when unknown)."""

    def __init__(self, engine, *, render, max_model_len: int, **kw):
        super().__init__(engine, **kw)
        self.render, self.max_model_len = render, max_model_len

    async def tokenize(self, request):
        ep = "/tokenize"
        tokenizer, limits = self.tokenizer, self.limits
        try:
            body = await self.read_body(request)
            req = parse(TokenizeRequest, body, limits, (self.model_name,))
            if req.messages is not None:
                ids = await asyncio.to_thread(self.render, req, req.special_tokens)
            else:
                ids = encode(req.prompt, "prompt", limits, tokenizer, req.special_tokens,
                             allow_special=bool(req.allow_special_tokens), control_ids=self.control_ids)
        except APIError as e:
            return self.fail(ep, e)
        strs = [tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs and tokenizer else None
        self.metrics.count_http(ep, 200)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    async def detokenize(self, request):
        ep = "/detokenize"
        tokenizer = self.tokenizer
        try:
            body = await self.read_body(request)
            req = parse(DetokenizeRequest, body, self.limits, (self.model_name,))
            if tokenizer is None:
                raise APIError(400, "tokens: this model folder has no tokenizer.json, so ids cannot be decoded",
                               "tokens", "no_tokenizer")
            V = tokenizer.get_vocab_size(with_added_tokens=True)
            bad = next((t for t in req.tokens if not 0 <= t < V), None)
            if bad is not None:
                raise APIError(400, f"tokens: token id {bad} outside the vocabulary 0..{V - 1}", "tokens",
                               "invalid_value")
        except APIError as e:
            return self.fail(ep, e)
        self.metrics.count_http(ep, 200)
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False)).model_dump()
