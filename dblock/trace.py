"""JSON-lines traces: what every executor and schedule can write, and what the simulator calibrates from.

One JSON object per line, with an ``event`` key. The schema (all keys always present unless marked optional):

``{"event": "run", ...}`` — first line: ``model`` (name/path), ``family``, ``executor``, ``schedule``,
    ``decode`` (DecodeConfig as a dict), ``model_config`` (the HF-style dict), ``machine`` (platform string),
    ``torch`` (version), ``time`` (unix seconds).

``{"event": "pass", ...}`` — one per executor call:
    ``kind``        "prefill" | "append" | "denoise"
    ``requests``    request ids in the batch
    ``batch``       number of requests
    ``rows``        positions run through the layers (all segments, all requests)
    ``live``        rows whose logits feed a decision (the LM head rows)
    ``decoded``     rows already committed inside an in-flight block (0 for prefill/append)
    ``cache_len``   per request, committed-prefix length read from the KV cache
    ``segments``    per request, list of [block_index, role, n_rows] with role "current" | "warmup" | "inflight"
                    | "prefix" (recomputed committed blocks on the no-cache path)
    ``wall_s``      wall time of the call (seconds)
    optional: ``moe_s`` (seconds in MoE layers), ``fresh`` (rows through routed experts, summed over MoE layers
    divided by their number), ``layers`` (per-layer dicts written by the optimized executor: ``layer``, ``path``,
    ``fresh``, ``cached``, ``support``, ``fallback``), ``comm`` (FreshLane bytes/messages per rank).

``{"event": "block", ...}`` — one per committed block: ``request``, ``block``, ``size`` (C), ``passes`` (n_k:
    denoising passes spent as the current block), ``warmup_steps`` (passes taken before promotion),
    ``tokens`` (valid tokens committed, up to and including the first EOS), ``first_pass_accepted`` and
    ``first_pass_kept`` (positions accepted on the first pass as current block, and of those still holding that
    token at commit), ``eos`` (bool).

``{"event": "request", ...}`` — one per finished request: ``request``, ``prompt_len``, ``Y``, ``K``, ``F``, ``Q``,
    ``den_s`` (denoising wall time), ``wall_s``.

Readers must ignore unknown keys, so writers may add fields.
"""
from __future__ import annotations

import json
import platform
import time
from typing import IO, Iterable, Iterator


class TraceWriter:
    """Append events to a JSON-lines file (or any text stream). `None` path = a no-op writer."""

    def __init__(self, path_or_stream: str | IO | None):
        self._own = isinstance(path_or_stream, str)
        self._f = open(path_or_stream, "w") if self._own else path_or_stream

    @property
    def enabled(self) -> bool:
        return self._f is not None

    def write(self, event: str, **fields) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps({"event": event, **fields}, default=_jsonable) + "\n")

    def run_header(self, **fields) -> None:
        import torch
        self.write("run", machine=platform.platform(), processor=platform.processor() or platform.machine(),
                   torch=torch.__version__, time=time.time(), **fields)

    def close(self) -> None:
        if self._own and self._f is not None:
            self._f.close()
        self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


NULL_TRACE = TraceWriter(None)


def _jsonable(o):
    try:
        import torch
        if isinstance(o, torch.Tensor):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)


def read_trace(path: str) -> Iterator[dict]:
    """Yield the events of a JSON-lines trace; a malformed line is an error naming its line number."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON object ({e})") from None
            if not isinstance(ev, dict) or "event" not in ev:
                raise ValueError(f"{path}:{i}: trace line without an 'event' key")
            yield ev


def events(trace: Iterable[dict], kind: str) -> list[dict]:
    return [e for e in trace if e.get("event") == kind]
