"""Answers from engine events, shared by completions and chat (each supplies its response format, `fmt`): server-sent
events as blocks commit (`_stream`: one chunk per committed block, then a final chunk per choice, an optional usage
chunk and `data: [DONE]`), or one JSON body once every request is done (`_collect`); both apply the text side of
the request's stops (`_TextStops`: OpenAI's semantics, and while streaming text that could begin a stop string is
held back until it cannot) and cancel the requests of a client that went away."""
from __future__ import annotations

import asyncio
import json
from typing import Optional

from dblock.serving.protocol_base import APIError, UsageInfo
from dblock.serving.responses import _json_response


class _TextStops:
    """The text side of a request's stops, OpenAI's semantics (as vLLM): the returned text ends *before* the first
    stop string (excluded); the text of a stop token id that ended the output is not shown (its id stays in
    `token_ids`); `token_ids` end with the token that completes the stop string. Streaming holds back the end of
    the text while it could still be the start of a stop string (`held`)."""

    def __init__(self, decode, strings=(), sampling=None):
        self.decode, self.strings = decode, [s for s in strings if s]
        self.stop_ids = set(sampling.stop_token_ids) if sampling is not None else set()
        self.min_tokens = sampling.min_tokens if sampling is not None else 0

    def visible(self, ids: list) -> str:
        if ids and ids[-1] in self.stop_ids and len(ids) > self.min_tokens:
            ids = ids[:-1]                                  # the output ends at this stop id (docs/algorithms.md §2.6)
        return self.decode(ids)

    def find(self, text: str) -> Optional[int]:
        """Index of the earliest stop string in `text`, or None."""
        hits = [k for k in (text.find(s) for s in self.strings) if k >= 0]
        return min(hits) if hits else None

    def held(self, text: str) -> int:
        """Characters at the end of `text` that could begin a stop string (not sent yet while streaming)."""
        best = 0
        for s in self.strings:
            for m in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:m]):
                    best = m
                    break
        return best

    def cut(self, ids: list) -> tuple:
        """(text, token ids, stopped by a stop string) of a whole output."""
        text = self.visible(ids)
        k = self.find(text) if self.strings else None
        if k is None:
            return text, list(ids), False
        lo, hi = 1, len(ids)                                # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if self.find(self.visible(ids[:mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        return text[:k], list(ids[:lo]), True


def _usage(reqs, outputs: Optional[dict] = None) -> UsageInfo:
    """Token counts; `outputs` (request id -> the token ids returned) when the text layer cut them at a stop."""
    p = sum(len(r.prompt) for r in reqs)
    c = sum(len(outputs[r.id]) if outputs and r.id in outputs else len(r.output_tokens) for r in reqs)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _request_info(r, data: dict) -> dict:
    c = data.get("counters", {})
    return {"Y": c.get("Y"), "K": c.get("K"), "F": c.get("F"), "Q": c.get("Q"), "TPF": c.get("TPF"),
            "ttft_s": data.get("ttft_s"), "e2e_s": data.get("e2e_s"), "queue_s": data.get("queue_s"),
            "blocks": [{k: b[k] for k in ("block", "tokens", "passes", "block_time_s")} for b in r.commits]}


def _block_info(data: dict) -> dict:
    return {"block": data["index"], "tokens": data["tokens"], "passes": data["passes"],
            "block_time_s": data["block_time_s"], "itl_s": data["itl_s"]}


async def _collect(engine, request, reqs, index, q, fmt, stops, poll_s):
    results: dict = {}
    try:
        while len(results) < len(reqs):
            try:
                kind, r, data = await asyncio.wait_for(q.get(), timeout=poll_s)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return _json_response(499, APIError(499, "client disconnected", None, "cancelled").body())
                continue
            if kind in ("done", "error", "cancelled"):
                results[r.id] = (kind, data)
    finally:
        for r in reqs:
            if r.id not in results:
                engine.cancel(r)
    errors = [(k, d) for k, d in results.values() if k != "done"]
    if errors:
        kind, d = errors[0]
        status = d.get("status", 500) if kind == "error" else 499
        return _json_response(status, APIError(status, d.get("message", kind), None,
                                               "executor_error" if status == 500 else kind).body())
    out, infos, outputs = [], [], {}
    for r in reqs:
        kind, d = results[r.id]
        text, ids, cut = stops.cut(d["ids"])
        outputs[r.id] = ids
        out.append((index[r.id], text, ids, "stop" if cut else d["finish_reason"]))
        infos.append(_request_info(r, d))
    return _json_response(200, fmt.response(out, _usage(reqs, outputs), infos))


def _sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))) + "\n\n"


async def _stream(engine, reqs, index, q, fmt, include_usage, stops):
    """SSE chunks as blocks commit. Cancellation (client gone) lands in `finally`, which cancels the requests.
    Text that could begin a stop string is held back until it cannot (`_TextStops`); after a stop string the
    request's further blocks send nothing."""
    done: set = set()
    ids_so_far = {r.id: [] for r in reqs}
    text_so_far = {r.id: "" for r in reqs}
    sent_ids = {r.id: [] for r in reqs}
    cut_at: dict = {}                                       # request id -> True once its text reached a stop string

    def advance(rid, text):
        prev = text_so_far[rid]
        text_so_far[rid] = text
        return text[len(prev):] if text.startswith(prev) else text

    try:
        for chunk in fmt.opening(len(reqs)):
            yield _sse(chunk)
        while len(done) < len(reqs):
            kind, r, data = await q.get()
            i = index[r.id]
            if kind == "block":
                if r.id in cut_at:
                    continue
                ids_so_far[r.id] += data["ids"]
                text, ids, cut = stops.cut(ids_so_far[r.id])
                if cut:
                    cut_at[r.id] = True
                else:
                    text = text[:len(text) - stops.held(text)]
                new_ids = ids[len(sent_ids[r.id]):]
                sent_ids[r.id] = ids
                yield _sse(fmt.block(i, advance(r.id, text), new_ids, data))
            elif kind == "done":
                done.add(r.id)
                cut = r.id in cut_at
                if not cut:
                    text, ids, cut = stops.cut(data["ids"])
                    sent_ids[r.id] = ids
                    rest = advance(r.id, text)
                    if rest:
                        yield _sse(fmt.text(i, rest))
                yield _sse(fmt.final(i, r, {**data, "finish_reason": "stop"} if cut else data))
            else:                                           # executor error or cancelled
                done.add(r.id)
                status = data.get("status", 499)
                yield _sse(APIError(status, data.get("message", kind), None,
                                    "executor_error" if kind == "error" else kind).body())
        if include_usage:
            yield _sse(fmt.usage(_usage(reqs, sent_ids)))
        yield _sse("[DONE]")
    finally:
        for r in reqs:
            if r.id not in done:
                engine.cancel(r)
