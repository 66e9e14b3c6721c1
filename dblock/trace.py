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


#: bounds of what a trace may say (dblock.cli_args: MAX_STEPS passes per block, MAX_TOKENS tokens); a block's
#: per-position lists are at most MAX_BLOCK long
MAX_PASSES = 4096
MAX_TOKENS = 1 << 24
MAX_BLOCK = 1 << 16
_SCHEMAS: dict = {}


def _schemas() -> dict:
    """The pydantic models of the events readers use, by kind (built on first use: pydantic is not imported at
    startup). Unknown keys are kept (writers may add fields); the keys readers rely on are typed, finite and
    bounded, so that a trace never drives an allocation or a loop beyond what dblock itself could have written."""
    if _SCHEMAS:
        return _SCHEMAS
    from typing import Annotated, Any, Literal, Optional, Union

    from pydantic import BaseModel, ConfigDict, Field

    def Int(lo=0, hi=MAX_TOKENS):
        return Annotated[int, Field(strict=True, ge=lo, le=hi)]
    Secs = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=1e9)]
    Id = Union[Annotated[int, Field(strict=True)], str, list]

    class Event(BaseModel):
        model_config = ConfigDict(extra="allow")

    class Decode(BaseModel):
        model_config = ConfigDict(extra="allow")
        max_new_tokens: Optional[Int(1)] = None
        block_size: Optional[Int(1, MAX_BLOCK)] = None

    class RunEvent(Event):
        event: Literal["run"]
        model: Optional[str] = None
        family: Optional[str] = None
        executor: Optional[str] = None
        schedule: Optional[str] = None
        decode: Optional[Decode] = None
        gate: Optional[Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=1.0)]] = None

    class PassEvent(Event):
        event: Literal["pass"]
        kind: Optional[Literal["prefill", "append", "denoise"]] = None
        batch: Optional[Int(0, 1 << 20)] = None
        rows: Optional[Int()] = None
        live: Optional[Int()] = None
        decoded: Optional[Int()] = None
        cache_len: Optional[list[Int()]] = None
        segments: Optional[list[list[tuple[Int(-1), str, Int()]]]] = None
        wall_s: Optional[Secs] = None
        moe_s: Optional[Secs] = None
        fresh: Optional[Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0, le=MAX_TOKENS)]] = None

    class BlockEvent(Event):
        event: Literal["block"]
        request: Id = 0
        block: Int(-1) = 0
        size: Optional[Int(1, MAX_BLOCK)] = None
        passes: Int(0, MAX_PASSES)
        tokens: Int(0, MAX_BLOCK) = 0
        warmup_steps: Optional[Int(0, MAX_PASSES)] = None
        accept_pass: Optional[Annotated[list[Int(-1, MAX_PASSES)], Field(max_length=MAX_BLOCK)]] = None
        kept: Optional[Annotated[list[Annotated[bool, Field(strict=True)]], Field(max_length=MAX_BLOCK)]] = None

    class RequestEvent(Event):
        event: Literal["request"]
        request: Id = 0
        prompt_len: Optional[Int()] = None
        Y: Int() = 0
        K: Int() = 0
        F: Int(0, MAX_TOKENS * MAX_PASSES) = 0
        Q: Optional[Int(0, MAX_TOKENS * MAX_PASSES)] = None
        den_s: Optional[Secs] = None
        wall_s: Optional[Secs] = None
        arrival_s: Optional[Secs] = None

    _SCHEMAS.update({"run": RunEvent, "pass": PassEvent, "block": BlockEvent, "request": RequestEvent})
    return _SCHEMAS


def check_event(ev, source: str) -> dict:
    """A trace event as readers use it: a JSON object with an `event` key; a `run`, `pass`, `block` or `request`
    event checked against its schema (`_schemas`): an InputFileError naming `source` (file and line), the key and
    the value otherwise. Request ids written as lists (compare-schedules' (offset, case)) become tuples."""
    from dblock.errors import InputFileError
    from dblock.input_files import validation_message
    if not isinstance(ev, dict) or "event" not in ev:
        raise InputFileError(f"{source}: not a trace event (a JSON object with an 'event' key)")
    model = _schemas().get(ev["event"]) if isinstance(ev["event"], str) else None
    if model is None:
        return ev
    from pydantic import ValidationError
    try:
        model.model_validate(ev)
    except ValidationError as e:
        raise InputFileError(f"{source}: {ev['event']} event: {validation_message(e)}") from None
    if isinstance(ev.get("request"), list):
        ev = {**ev, "request": tuple(ev["request"])}
    acc, kept = ev.get("accept_pass"), ev.get("kept")
    if acc is not None and kept is not None and len(acc) != len(kept):
        raise InputFileError(f"{source}: block event: kept has {len(kept)} entries for {len(acc)} accept_pass "
                             "entries")
    if acc is not None and ev.get("size") is not None and len(acc) > ev["size"]:
        raise InputFileError(f"{source}: block event: {len(acc)} accept_pass entries in a block of size "
                             f"{ev['size']}")
    return ev


def read_trace(path: str, flag: str | None = None) -> Iterator[dict]:
    """Yield the events of a JSON-lines trace, each checked (`check_event`); a line that is not UTF-8, not JSON or
    not a valid event is an InputFileError naming `flag`, the file and the line."""
    from dblock.input_files import read_jsonl, where
    for i, ev in read_jsonl(path, flag):
        yield check_event(ev, f"{where(path, flag)}:{i}")


def events(trace: Iterable[dict], kind: str) -> list[dict]:
    return [e for e in trace if e.get("event") == kind]
