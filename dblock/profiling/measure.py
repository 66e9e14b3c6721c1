"""Measurements the predictions are checked against: CPU-timed executor calls, r and β on the same rows, repeated
interleaved runs, and the serving engine on a CPU-time clock (the model side of the simulator, like profiler.py).

Every time here is the calling thread's CPU time (`time.thread_time`), which excludes time spent waiting for a core
on a shared machine; `timer=` swaps it (tests pass a fake clock that only the synthetic executor advances).

`TimedForward` wraps an executor: it times every call, records its `CallShape` (the shape the cost model prices),
and — given a `shadow` — also times, for every denoising call, the baseline's pass on the same rows:

    shadow="strip"      the same executor type (a second instance, so an Epoch executor's plans stay its own) on
                        the same requests with each request's extra blocks (OBA's warm-up, FlowBlock's in-flight)
                        removed: r of a schedule (docs/counters.md)
    shadow=<Forward>    another executor on the very same requests: r of an executor (e.g. Epoch over dense)

`serve_cpu_clock` drives the real serving engine (`dblock/serving/engine.py`) synchronously on a virtual clock that
advances by the CPU time of every iteration and jumps over idle gaps to the next arrival: a serving run whose ITL
and throughput are measured in engine-thread CPU time, free of the preemption noise of a shared machine.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from dblock.forward import Forward, StepInput
from dblock.simulator.profile import CallShape

EXTRA_ROLES = ("warmup", "inflight")


def call_shape(kind: str, items: Sequence[StepInput], fresh_rows: Optional[float] = None) -> CallShape:
    """The `CallShape` of a batched call as the reference executor lays it out (padded rows and context)."""
    rows = [sum(len(s) for s in it.segments) for it in items]
    L = max(rows) if rows else 1
    cache = max((it.cache.length if it.cache is not None else 0) for it in items) if items else 0
    live = tuple(int(s.live.sum()) for it in items for s in it.segments if s.role != "prefix") \
        if kind == "denoise" else ()
    valid = sum(rows)
    frac = 1.0 if fresh_rows is None else min(1.0, float(fresh_rows) / max(1, valid))
    return CallShape(kind, max(1, len(items)), max(1, L), cache + L, max(len(it.segments) for it in items),
                     live, valid, frac)


def strip_extra(items: Sequence[StepInput]) -> list:
    """The same requests with every segment of an extra in-flight block removed (visibility restricted)."""
    out = []
    for it in items:
        keep = [i for i, s in enumerate(it.segments) if s.role not in EXTRA_ROLES]
        if len(keep) == len(it.segments):
            out.append(it)
            continue
        vis = it.visibility[keep][:, keep]
        out.append(StepInput(it.request, [it.segments[i] for i in keep], vis, it.cache, it.pass_index, it.meta))
    return out


class TimedForward(Forward):
    """See the module docstring."""

    def __init__(self, fwd: Forward, timer: Callable[[], float] = time.thread_time, shadow: Any = None,
                 record: bool = True):
        self.fwd, self.timer, self.record = fwd, timer, record
        self.config, self.name = fwd.config, fwd.name
        self.shadow_mode = None
        self.shadow = None
        if shadow == "strip":
            self.shadow_mode, self.shadow = "strip", _same_kind(fwd)
        elif shadow is not None:
            self.shadow_mode, self.shadow = "executor", shadow
        self.reset()

    def reset(self) -> None:
        self.den_s = self.den_base_s = self.app_s = 0.0
        self.den_calls = self.app_calls = 0
        self.calls: list = []          # (CallShape, seconds)

    # -- Forward protocol
    def new_cache(self):
        return self.fwd.new_cache()

    def append(self, items):
        shape = call_shape("append", items) if self.record else None    # before the call: it grows the caches
        t0 = self.timer()
        self.fwd.append(items)
        dt = self.timer() - t0
        self.app_s += dt
        self.app_calls += 1
        if self.record:
            self.calls.append((shape, dt))

    def denoise(self, items):
        t0 = self.timer()
        out = self.fwd.denoise(items)
        dt = self.timer() - t0
        self.den_s += dt
        self.den_calls += 1
        fresh = None
        st = self.fwd.last_pass_stats() if hasattr(self.fwd, "last_pass_stats") else None
        if isinstance(st, dict) and st.get("fresh") is not None:
            fresh = st["fresh"]
        if self.record:
            self.calls.append((call_shape("denoise", items, fresh), dt))
        if self.shadow_mode == "strip":
            base = strip_extra(items)
            if base is items or all(b is a for a, b in zip(items, base)):
                self.den_base_s += dt
            else:
                t0 = self.timer()
                self.shadow.denoise(base)
                self.den_base_s += self.timer() - t0
        elif self.shadow_mode == "executor":
            t0 = self.timer()
            self.shadow.denoise(items)
            self.den_base_s += self.timer() - t0
        return out

    def end_block(self, request, block):
        self.fwd.end_block(request, block)
        if self.shadow is not None:
            self.shadow.end_block(request, block)

    def end_request(self, request):
        self.fwd.end_request(request)
        if self.shadow is not None:
            self.shadow.end_request(request)

    def stats(self):
        return self.fwd.stats()

    def last_pass_stats(self):
        return self.fwd.last_pass_stats() if hasattr(self.fwd, "last_pass_stats") else {}


def _same_kind(fwd: Forward) -> Forward:
    """A second executor of the same kind over the same weights (its own plans and caches)."""
    if fwd.name == "epoch":
        from dblock.optimized.executor import epoch_class
        return epoch_class(fwd.model)(fwd.model, fwd.ecfg)      # the family's class (DiffusionGemma has its own)
    return fwd            # the reference executors keep no per-block state: the same instance serves


class SyntheticForward(Forward):
    """A real executor (for the tokens) whose *cost* is a known function of the call's shape: every call advances
    `clock` by `cost_fn(CallShape)` seconds and nothing else advances it. With `timer=clock`, `TimedForward`
    measures exactly `cost_fn`, so a prediction priced with the same function must match (validate's self-check)."""

    def __init__(self, fwd: Forward, cost_fn: Callable[[CallShape], float], clock: "FakeClock"):
        self.fwd, self.cost_fn, self.clock = fwd, cost_fn, clock
        self.config, self.name = fwd.config, fwd.name

    def new_cache(self):
        return self.fwd.new_cache()

    def append(self, items):
        shape = call_shape("append", items)
        self.fwd.append(items)
        self.clock.advance(self.cost_fn(shape))

    def denoise(self, items):
        out = self.fwd.denoise(items)
        st = self.fwd.last_pass_stats() if hasattr(self.fwd, "last_pass_stats") else {}
        self.clock.advance(self.cost_fn(call_shape("denoise", items, (st or {}).get("fresh"))))
        return out

    def end_block(self, request, block):
        self.fwd.end_block(request, block)

    def end_request(self, request):
        self.fwd.end_request(request)

    def last_pass_stats(self):
        return self.fwd.last_pass_stats() if hasattr(self.fwd, "last_pass_stats") else {}


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += float(dt)


# ---- decoding runs -------------------------------------------------------------------------------------------

def decode_run(fwd: Forward, prompts: Sequence, dec, schedule: str = "native", batch_size: Optional[int] = None,
               shadow: Any = None, timer: Callable[[], float] = time.thread_time, seeds=None) -> dict:
    """Decode `prompts` with `fwd` under `schedule`, CPU-timing every executor call. Returns the counters, the
    denoising time (`den_s`), the baseline's time on the same rows (`den_base_s`, with a shadow), the calls, the
    per-request block chains and the tokens."""
    from dblock.decoding.generate import generate
    tf = TimedForward(fwd, timer=timer, shadow=shadow)
    t0 = timer()
    res = generate(tf, prompts, dec, schedule, seeds=seeds, batch_size=batch_size)
    wall = timer() - t0
    s = res.summary()
    out = dict(schedule=schedule, executor=fwd.name, batch_size=batch_size or len(prompts), Y=s["Y"], K=s["K"],
               F=s["F"], Q=s["Q"], R=len(res.counters), den_s=tf.den_s,
               den_base_s=tf.den_base_s if tf.shadow_mode else None, den_calls=tf.den_calls,
               requests_per_call=[c.requests for c, _ in tf.calls if c.kind == "denoise"],
               app_s=tf.app_s, app_calls=tf.app_calls, wall_s=wall, calls=tf.calls,
               prompt_lens=[c.prompt_len for c in res.counters], max_new_tokens=dec.max_new_tokens,
               blocks=[[vars(b) for b in c.blocks] for c in res.counters], tokens=res.tokens)
    out["TPS"] = out["Y"] / out["den_s"] if out["den_s"] else float("nan")
    out["T_den_ms"] = 1e3 * out["den_s"] / out["den_calls"] if out["den_calls"] else float("nan")
    return out


def repeated(jobs: dict, repeats: int, between: Optional[Callable[[], object]] = None, progress=None) -> dict:
    """Run every job (name -> zero-argument callable returning a `decode_run` dict) `repeats` times, interleaved
    (job 1, job 2, ..., job 1, job 2, ...) so slow drift of the machine hits every job alike: {name: [runs]}.
    `between()` runs before every round (e.g. re-timing the profile's drift anchors); `progress`, a tqdm bar (or
    None), advances once per run."""
    out = {k: [] for k in jobs}
    for _ in range(repeats):
        if between is not None:
            between()
        for k, fn in jobs.items():
            out[k].append(fn())
            if progress is not None:
                progress.update(1)
    return out


def median_run(runs: Sequence[dict]) -> dict:
    """One run's counters with the median of every time over the repeats."""
    m = dict(runs[0])
    for k in ("den_s", "den_base_s", "app_s", "wall_s"):
        if m.get(k) is not None:
            m[k] = float(np.median([r[k] for r in runs]))
    m["TPS"] = m["Y"] / m["den_s"] if m["den_s"] else float("nan")
    m["T_den_ms"] = 1e3 * m["den_s"] / m["den_calls"] if m["den_calls"] else float("nan")
    return m


def paired_ratios(a: Sequence[dict], b: Sequence[dict], key: str = "TPS") -> list:
    """Per repeat, a[i][key] / b[i][key] (the repeats were interleaved, so pairs share the machine's state)."""
    return [x[key] / y[key] for x, y in zip(a, b) if y[key]]


def noise_band(ratios: Sequence[float]) -> tuple:
    """(median, low, high) of repeated ratios: the band is the min..max over repeats (at least ±1% wide)."""
    v = np.asarray(ratios, dtype=float)
    med = float(np.median(v))
    lo, hi = float(v.min()), float(v.max())
    return med, min(lo, med * 0.99), max(hi, med * 1.01)


def verdict(lo: float, hi: float) -> str:
    """"pays" when the whole band is above 1, "does not pay" when below, else "within noise"."""
    if lo > 1.0:
        return "pays"
    if hi < 1.0:
        return "does not pay"
    return "within noise"


# ---- serving on a CPU-time clock -----------------------------------------------------------------------------

class VirtualClock:
    """Engine-thread CPU time since start, plus the idle gaps jumped over to the next arrival."""

    def __init__(self, timer: Callable[[], float] = time.thread_time):
        self.timer = timer
        self.t0 = timer()
        self.offset = 0.0

    def __call__(self) -> float:
        return self.timer() - self.t0 + self.offset

    def jump_to(self, t: float) -> None:
        now = self()
        if t > now:
            self.offset += t - now


def serve_cpu_clock(fwd: Forward, prompts: Sequence[Sequence[int]], arrivals: Sequence[float], dec,
                    schedule: str = "native", batch_cap: int = 16, timer: Callable[[], float] = time.thread_time,
                    clock: Optional[VirtualClock] = None) -> list:
    """Serve `prompts[i % len(prompts)]` arriving at `arrivals[i]` (seconds) with the real engine, driven in this
    thread on a virtual clock (see the module docstring). Returns per-request records for `batch.serving_summary`."""
    from dblock.serving.engine import Engine, EngineConfig
    clock = clock or VirtualClock(timer)
    eng = Engine(fwd, schedule, dec, EngineConfig(batch_cap=batch_cap, kv_budget_tokens=1 << 30, max_queue=1 << 20),
                 clock=clock)
    times = sorted(float(a) for a in arrivals)
    reqs, i = [], 0
    while True:
        now = clock()
        while i < len(times) and times[i] <= now:
            r = eng.submit(list(prompts[i % len(prompts)]), dec.max_new_tokens, dec.seed + i)
            r.t_arrival = times[i] + 0.0
            reqs.append(r)
            i += 1
        busy = eng.step()
        if not busy:
            if i >= len(times):
                if all(r.status in ("finished", "failed", "cancelled") for r in reqs):
                    break
                continue
            clock.jump_to(times[i])
    return [dict(arrival=r.t_arrival, first_pass=r.t_first_pass, commits=[(c["t"], c["tokens"]) for c in r.commits],
                 finish=r.t_finish) for r in reqs if r.status == "finished"]
