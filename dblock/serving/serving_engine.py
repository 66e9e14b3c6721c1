"""The endpoints' shared path to the engine (`OpenAIServing`, as vLLM's serving_engine.py; the base of
`serving_completion.py`, `serving_chat.py` and `serving_tokenization.py`): read a body within the limits, answer a
failure (counted in the metrics), a request's sampling and stop fields as `SamplingParams` and text stops, and
`generate`: submit prompts to the engine and answer as server-sent events or one body (`streaming.py`).

Sampling (`OpenAIServing.sampling_of`): each request's temperature / top_p / top_k / stop / stop_token_ids /
min_tokens / ignore_eos become its own `SamplingParams` over the server's defaults (absent temperature: greedy,
dblock's default, unless `dblock serve --temperature T`), so one batch mixes greedy and sampled requests and a seeded
request gets the same tokens alone or batched (docs/algorithms.md §2.4). `n` choices are n engine requests with
seeds seed, seed + 1, ...; choice index = prompt * n + j. Stop strings are tokenized for the engine and matched on
the text (`streaming._TextStops`): the text ends before the first one, as OpenAI; while streaming, text that could
begin a stop string is held back until it cannot.

Threads: the engine runs in its own thread (the only one touching the model); a handler submits its request with a
listener that records the request's metrics and hands each engine event to the event loop
(`loop.call_soon_threadsafe`), where the handler awaits a per-request asyncio queue. A client that disconnects
cancels its requests: the slot is free at the next pass boundary.
"""
from __future__ import annotations

import asyncio

from fastapi.responses import StreamingResponse

from dblock.errors import ConfigError
from dblock.serving.engine import Rejected
from dblock.serving.protocol_base import APIError, Limits
from dblock.serving.protocol_prompt import encode_text
from dblock.serving.protocol_sampling import MAX_SEED
from dblock.serving.receiving import REQUEST_TIMEOUT, _read_body
from dblock.serving.responses import _error
from dblock.serving.streaming import _collect, _stream, _TextStops


class OpenAIServing:
    """What the endpoints share, over one engine: its `metrics`, the server's `limits`, the model folder's
    `tokenizer` (None: prompts must be token ids and `text` is ""), the served `model_name`, the model's
    `control_ids` (which text may not produce), `request_timeout` (seconds to receive a body) and `poll_s` (how often
    a non-streaming handler checks that its client is still there)."""

    def __init__(self, engine, *, metrics, limits: Limits, tokenizer=None, model_name: str = "dblock",
                 control_ids=(), request_timeout: float = REQUEST_TIMEOUT, poll_s: float = 0.25):
        self.engine, self.metrics, self.limits, self.tokenizer = engine, metrics, limits, tokenizer
        self.model_name, self.control_ids = model_name, control_ids
        self.request_timeout, self.poll_s = request_timeout, poll_s

    async def read_body(self, request):
        return await _read_body(request, self.limits.max_body_bytes, self.request_timeout)

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def fail(self, endpoint: str, e: APIError):
        self.metrics.count_http(endpoint, e.status)
        return _error(e)

    def sampling_of(self, req):
        """The request's sampling and stop fields over the server's defaults (`engine.dec`, the `dblock serve`
        decoding flags): (`SamplingParams`, `_TextStops`), or APIError naming the field. OpenAI -> dblock:
        temperature -> SamplingParams.temperature (absent: the server's default, greedy 0 unless --temperature was
        given; OpenAI's default of 1 is not assumed), top_p, top_k (-1 -> 0 = off), stop_token_ids, min_tokens,
        ignore_eos; `stop` strings are tokenized (decoding ends at the first one) and matched on the text, which
        ends before the first stop string (OpenAI). A stop string the tokenizer cannot encode is matched on the
        text only. Without request `stop`, the server's own stop sequences (--stop) are matched as their text."""
        base = self.engine.dec.sampling_params()
        kw = {}
        if req.temperature is not None:
            kw["temperature"] = float(req.temperature)
        if req.top_p is not None:
            kw["top_p"] = float(req.top_p)
        if req.top_k is not None:
            kw["top_k"] = max(int(req.top_k), 0)
        if req.stop_token_ids is not None:
            kw["stop_token_ids"] = tuple(req.stop_token_ids)
        if req.min_tokens is not None:
            kw["min_tokens"] = int(req.min_tokens)
        if req.ignore_eos is not None:
            kw["ignore_eos"] = bool(req.ignore_eos)
        strings = req.stop_strings
        if req.stop is not None:
            if strings and self.tokenizer is None:
                raise APIError(400, "stop: this model folder has no tokenizer.json, so stop strings cannot be "
                               "matched: send stop_token_ids", "stop", "no_tokenizer")
            seqs = []
            for i, text in enumerate(strings):
                try:
                    seqs.append(tuple(encode_text(self.tokenizer, text, "stop", False, add_special_tokens=False)))
                except APIError:                            # cannot be encoded: the text match still applies
                    pass
            kw["stop"] = tuple(seqs)
        else:
            strings = [t for t in (self.decode(q) for q in base.stop) if t]
        try:
            sampling = base.replace(**kw)
        except ConfigError as e:
            msg = str(e)
            param = next((k for k in kw if msg.startswith(k)), None)
            raise APIError(400, f"{param}: {msg}" if param else msg, param, "invalid_value") from None
        return sampling, _TextStops(self.decode, strings, sampling)

    async def generate(self, request, endpoint: str, fmt, prompts: list, max_tokens, seed, stream: bool,
                       include_usage: bool, sampling=None, stops=None, n: int = 1):
        """Submit every prompt n times (sample j with seed + j; choice index prompt * n + j) and answer: a
        `StreamingResponse` of server-sent events (`_stream`) or one JSON body (`_collect`), in `fmt`'s shape."""
        engine, limits, metrics, fail = self.engine, self.limits, self.metrics, self.fail
        stops = stops or _TextStops(self.decode)
        seeds = None
        if n > 1:
            s0 = engine.dec.seed if seed is None else seed
            if s0 + n - 1 > MAX_SEED:
                return fail(endpoint, APIError(400, f"seed: the {n} choices get seeds {s0}..{s0 + n - 1}, beyond "
                                               f"2^63-1; give a seed <= {MAX_SEED - n + 1}", "seed", "invalid_value"))
            if len(prompts) * n > limits.max_prompts:
                return fail(endpoint, APIError(400, f"n: {len(prompts)} prompts x n={n} = {len(prompts) * n} choices; "
                                               f"at most {limits.max_prompts}", "n", "limit_exceeded"))
            seeds = [s0 + j for _ in prompts for j in range(n)]
            prompts = [p for p in prompts for _ in range(n)]
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def listener(kind, r, data):                       # engine thread -> metrics, event loop
            metrics.on_event(kind, r, data)
            try:
                loop.call_soon_threadsafe(q.put_nowait, (kind, r, data))
            except RuntimeError:                            # loop closed: nobody is listening any more
                pass

        try:
            reqs = engine.submit_many(prompts, max_tokens, seed, listener, tag=fmt.id, sampling=sampling, seeds=seeds)
        except Rejected as e:
            return fail(endpoint, APIError(e.status, e.message, e.param, e.code))
        index = {r.id: i for i, r in enumerate(reqs)}
        metrics.count_http(endpoint, 200)
        if stream:
            return StreamingResponse(_stream(engine, reqs, index, q, fmt, include_usage, stops),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(engine, request, reqs, index, q, fmt, stops, self.poll_s)
