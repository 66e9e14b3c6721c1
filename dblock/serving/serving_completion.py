"""`/v1/completions` (`OpenAIServingCompletion`): the body validated and its prompts tokenized
(`protocol_completion.parse_completion`), its sampling fields applied, every prompt submitted n times; and the
completions response format (`_CompletionFormat`): one `text_completion`, or streamed as chunks of the same shape,
one per committed block (its text and token ids, plus a `dblock` object with the block's index, tokens, passes and
server-side block time), then a chunk with `finish_reason` and the request's counters, an optional usage chunk and
`data: [DONE]`. With `n` > 1 (or several prompts) every chunk names its choice by `index`."""
from __future__ import annotations

import time
import uuid

from dblock.serving.protocol_base import APIError, UsageInfo
from dblock.serving.protocol_completion import CompletionChoice, CompletionResponse, parse_completion
from dblock.serving.serving_engine import OpenAIServing
from dblock.serving.streaming import _block_info, _request_info


class _CompletionFormat:
    """The completions response shape, which `streaming._stream` and `_collect` fill in: the chunks that open a
    stream (`opening`), one per committed block (`block`), held-back text (`text`), the end of a choice (`final`), the
    usage chunk (`usage`), and the non-streaming body (`response`)."""

    def __init__(self, id_: str, model: str):
        self.id, self.model, self.created = id_, model, int(time.time())

    def _chunk(self, choices, **kw) -> dict:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  **kw).model_dump()

    def opening(self, n: int) -> list:
        return []

    def block(self, i: int, text: str, ids: list, data: dict) -> dict:
        return self._chunk([CompletionChoice(index=i, text=text, token_ids=ids)], dblock=_block_info(data))

    def text(self, i: int, text: str) -> dict:
        """Text held back while it could start a stop string, sent once the output is final."""
        return self._chunk([CompletionChoice(index=i, text=text, token_ids=[])])

    def final(self, i: int, r, data: dict) -> dict:
        return self._chunk([CompletionChoice(index=i, text="", token_ids=[], finish_reason=data["finish_reason"])],
                           dblock={"request": _request_info(r, data)})

    def usage(self, usage: UsageInfo) -> dict:
        return self._chunk([], usage=usage)

    def response(self, results: list, usage: UsageInfo, infos: list) -> dict:
        return self._chunk([CompletionChoice(index=i, text=text, token_ids=ids, finish_reason=fr)
                            for i, text, ids, fr in results], usage=usage, dblock={"requests": infos})


class OpenAIServingCompletion(OpenAIServing):
    """POST /v1/completions."""

    async def create_completion(self, request):
        ep = "/v1/completions"
        try:
            body = await self.read_body(request)
            creq = parse_completion(body, self.limits, self.tokenizer, (self.model_name,), self.control_ids)
            sampling, stops = self.sampling_of(creq)
        except APIError as e:
            return self.fail(ep, e)
        fmt = _CompletionFormat("cmpl-" + uuid.uuid4().hex[:24], self.model_name)
        return await self.generate(request, ep, fmt, creq.prompts, creq.max_tokens, creq.seed, bool(creq.stream),
                                   creq.include_usage, sampling, stops, creq.n or 1)
