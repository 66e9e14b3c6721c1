"""SimPy serving model: continuous batching at pass granularity, timed by the roofline pass cost.

Requests arrive (Poisson at `rate`, or at given times from a trace), wait in a FIFO queue, and are admitted while
fewer than `batch_cap` are running. One engine process loops over iterations: every running request advances one
denoising pass of its current block in a single batched forward, whose time is `cost.pass_cost` of the batch's
shape — mean cache length, the live and fresh shares of the in-flight rows on this iteration (from each request's
own block: its per-position accept passes, see `liveness.per_pass`), and the prefill/append rows folded in. When a
request's block has run its passes, the block commits and emits its tokens:

    equivalent inter-token latency of a commit = (commit time − block start) / tokens committed

dblock's equivalent ITL (`itl`, docs/counters.md: what `dblock serve` reports, one sample per commit, the first
block from its first pass). The sources this model is checked against each define an ITL of their own, and all
three are reported beside it (`ITL_DEFINITIONS`), each as that source computes it from the stream of commits:

    per-token ITL (`itl_token`, SGLang's bench_serving): the gap between two commits spread over the tokens of the
        later one, one sample per token; the first commit is the TTFT, not an ITL
    per-block ITL (`itl_block`, vLLM's bench serve): the gap between two commits, one sample per commit after the
        first
    Epoch ITL (`itl_epoch`, the Epoch paper's "equivalent ITL"): a block's latency, commit − the block's first pass,
        one sample per commit, the first block included. Its figures (55–60 ms for Epoch, 100–110 ms for SGLang at
        16–26 req/s on one 8×H100 node) agree with the costs fitted on the other published measurements only read
        this way (SIMULATOR.md, "The GPU cost model against published measurements")

TTFT = first commit − arrival (queueing, prefill and the whole first block). Outputs: throughput (tokens/s), TTFT
and the four ITLs' P50/P95/P99 over the measured window, and OOM (the memory of the largest batch against HBM).

`max_rate_for_slo` bisects the highest Poisson rate whose P95 ITL holds an SLO; `best_batch_cap` tries caps.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import simpy

from dblock.config import ModelConfig
from dblock.simulator import cost
from dblock.simulator.dists import Dist
from dblock.simulator.hardware import Hardware
from dblock.simulator.liveness import per_pass
from dblock.simulator.positions import ParametricProfile, PositionModel, Profile, simulate_chain

#: the ITL definitions a prediction can be held to (`--itl-definition`): name -> what it is
ITL_DEFINITIONS = {
    "epoch": "the Epoch paper's equivalent ITL, read as a block's latency: commit − the block's first pass, one "
             "sample per block",
    "dblock": "dblock's equivalent ITL (docs/counters.md): (commit − block start) / tokens committed, one sample per "
              "block",
    "token": "SGLang bench_serving's per-token ITL: the gap between two commits spread over the tokens committed, one "
             "sample per token",
    "block": "vLLM bench serve's per-block ITL: the gap between two commits, one sample per commit after the first",
}


@dataclass
class ServeConfig:
    cfg: ModelConfig
    hw: Hardware
    par: cost.Parallel = field(default_factory=cost.Parallel)
    cal: cost.Calibration = field(default_factory=cost.Calibration)
    path: str = "dense"                    # dense | epoch (docs/algorithms.md §4)
    schedule: str = "native"               # native | oba
    profile: Profile | None = None         # Native blocks (passes, accept passes); None: ParametricProfile(C)
    delta: float = 0.5                     # OBA warm-up saving per step (positions.PositionModel)
    prompt: Dist | str = "const:256"       # prompt lengths (tokens)
    tokens: Dist | str = "const:256"       # generated tokens per request (Y)
    batch_cap: int = 256
    m_c: int = 5                           # LSP refresh period
    support_frac: float = 0.16             # Expert Atlas support of one block / E (4K of 256 ≈ 0.125, plus repairs)
    max_context: int = 4096
    rate: float = 10.0                     # Poisson arrivals, requests/s
    arrivals: Sequence[float] | None = None  # trace-driven arrival times (s); overrides rate
    requests: int = 300
    warmup_frac: float = 0.2               # commits of the first 20% of requests are not measured
    seed: int = 0

    def __post_init__(self):
        self.prompt = Dist.parse(self.prompt)
        self.tokens = Dist.parse(self.tokens)
        if self.path not in cost.PATHS:
            raise ValueError(f"path={self.path!r}: allowed {', '.join(cost.PATHS)}")
        if self.schedule not in ("native", "oba"):
            raise ValueError(f"schedule={self.schedule!r}: allowed native, oba")
        if self.batch_cap < 1:
            raise ValueError(f"batch_cap={self.batch_cap}: must be >= 1")
        if self.arrivals is None and self.rate <= 0:
            raise ValueError(f"rate={self.rate}: must be positive")
        if self.requests < 1:
            raise ValueError(f"requests={self.requests}: must be >= 1")
        if self.profile is None:
            self.profile = ParametricProfile(C=self.cfg.block_size)


@dataclass
class ServeResult:
    throughput: float                       # committed tokens / s over the measured window
    itl: dict                               # p50, p95, p99 (s): dblock's equivalent ITL (docs/counters.md)
    ttft: dict
    oom: bool
    peak_batch: int
    memory: dict
    finished: int
    iterations: int
    mean_pass_s: float
    completion_rate: float = float("nan")   # measured requests finished per second (arrival of the first → last)
    stable: bool = True                     # the engine keeps up: completion rate >= 90% of the arrival rate
    config: dict = field(default_factory=dict)
    itl_token: dict = field(default_factory=dict)   # per-token ITL (SGLang's bench_serving)
    itl_block: dict = field(default_factory=dict)   # per-block ITL (vLLM's bench serve)
    itl_epoch: dict = field(default_factory=dict)   # the Epoch paper's equivalent ITL, read as a block's latency

    def itl_of(self, definition: str) -> dict:
        """The ITL percentiles of one definition (`ITL_DEFINITIONS`)."""
        return {"dblock": self.itl, "token": self.itl_token, "block": self.itl_block, "epoch": self.itl_epoch}[
            definition]

    def as_dict(self) -> dict:
        return dict(vars(self))


def _pcts(x: Sequence[float]) -> dict:
    if len(x) == 0:
        return dict(p50=float("nan"), p95=float("nan"), p99=float("nan"), mean=float("nan"))
    a = np.asarray(x)
    return dict(p50=float(np.percentile(a, 50)), p95=float(np.percentile(a, 95)), p99=float(np.percentile(a, 99)),
                mean=float(a.mean()))


class _Req:
    __slots__ = ("i", "arrival", "prompt", "Y", "blocks", "lives", "freshes", "k", "j", "block_start",
                 "first_commit", "cache", "measured")

    def __init__(self, i, arrival, prompt, Y, blocks, m_c, measured):
        self.i, self.arrival, self.prompt, self.Y = i, arrival, prompt, Y
        self.blocks = blocks
        self.lives, self.freshes = [], []
        for b in blocks:
            lv, fr = per_pass(b.accept, m_c, n=int(math.ceil(b.passes - 1e-9)))
            self.lives.append(lv)
            self.freshes.append(fr)
        self.k, self.j = 0, 0
        self.block_start = None
        self.first_commit = None
        self.cache = prompt
        self.measured = measured


def simulate_serving(sc: ServeConfig, progress: bool = False) -> ServeResult:
    rng = np.random.default_rng(sc.seed)
    C = sc.profile.C
    model = PositionModel(sc.profile, delta=sc.delta)
    n = sc.requests if sc.arrivals is None else len(sc.arrivals)
    if sc.arrivals is None:
        times = np.cumsum(rng.exponential(1.0 / sc.rate, n))
    else:
        times = np.asarray(sorted(sc.arrivals), dtype=float)
    prompts = [max(1, int(round(sc.prompt.sample(rng)))) for _ in range(n)]
    ys = [max(1, int(round(sc.tokens.sample(rng)))) for _ in range(n)]
    n_measured_from = int(sc.warmup_frac * n)

    env = simpy.Environment()
    queue: deque = deque()
    arrived = simpy.Store(env)
    running: list[_Req] = []
    itl, ttft, itl_token, itl_block, itl_epoch = [], [], [], [], []
    tokens_measured = 0
    t_first_measured = [None]
    t_last = [0.0]
    stats = dict(iterations=0, pass_s=0.0, peak=0, finished=0)
    finishes: list = []
    pending_rows = [0]   # append rows of blocks committed on the previous iteration
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n, desc=f"serve {sc.path} @ {sc.rate:g} req/s", unit="req")

    def source():
        for i in range(n):
            yield env.timeout(max(0.0, times[i] - env.now))
            K = math.ceil(ys[i] / C)
            blocks = simulate_chain(model, sc.schedule, K, np.random.default_rng([sc.seed, 7, i]))
            queue.append(_Req(i, env.now, prompts[i], ys[i], blocks, sc.m_c, i >= n_measured_from))
            if len(arrived.items) == 0:
                arrived.put(True)

    def engine():
        nonlocal tokens_measured
        while stats["finished"] < n:
            if not running and not queue:
                yield arrived.get()
                continue
            prefill_rows = 0
            while queue and len(running) < sc.batch_cap:
                r = queue.popleft()
                prefill_rows += r.prompt
                running.append(r)
            while len(arrived.items):
                arrived.items.pop()
            stats["peak"] = max(stats["peak"], len(running))
            B = len(running)
            live = float(np.mean([r.lives[r.k][r.j] for r in running]))
            fresh = float(np.mean([r.freshes[r.k][r.j] for r in running]))
            cache_len = float(np.mean([r.cache for r in running]))
            s_frac = 1.0 - (1.0 - sc.support_frac) ** B     # union of the batch's per-block supports
            shape = cost.PassShape(batch=B, layout="native" if sc.schedule == "native" else "oba", block=C,
                                   cache_len=cache_len, path=sc.path, live_frac=live, fresh_frac=fresh,
                                   support_frac=min(1.0, s_frac), extra_rows=prefill_rows + pending_rows[0])
            dt = cost.pass_cost(sc.cfg, shape, sc.hw, sc.par, sc.cal).total
            pending_rows[0] = 0
            for r in running:
                if r.j == 0 and r.block_start is None:
                    r.block_start = env.now
            yield env.timeout(dt)
            stats["iterations"] += 1
            stats["pass_s"] += dt
            done = []
            for r in running:
                r.j += 1
                if r.j >= len(r.lives[r.k]):
                    K = len(r.blocks)
                    tok = C if r.k < K - 1 else r.Y - C * (K - 1)
                    if r.measured:
                        gap = env.now - r.block_start
                        itl.append(gap / tok)
                        itl_epoch.append(gap)
                        if r.first_commit is not None:      # a gap between two commits (the first is the TTFT)
                            itl_block.append(gap)
                            itl_token.extend([gap / tok] * tok)
                        tokens_measured += tok
                        if t_first_measured[0] is None:
                            t_first_measured[0] = r.block_start
                        t_last[0] = env.now
                    if r.first_commit is None:
                        r.first_commit = env.now
                        if r.measured:
                            ttft.append(env.now - r.arrival)
                    r.cache += C
                    r.k += 1
                    r.j = 0
                    r.block_start = env.now
                    if r.k >= K:
                        done.append(r)
                    else:
                        pending_rows[0] += C    # the committed block's append pass rides the next iteration
            for r in done:
                running.remove(r)
                stats["finished"] += 1
                if r.measured:
                    finishes.append((r.arrival, env.now))
                if bar is not None:
                    bar.update(1)

    env.process(source())
    env.process(engine())
    env.run()
    if bar is not None:
        bar.close()
    span = (t_last[0] - t_first_measured[0]) if t_first_measured[0] is not None else 0.0
    peak_shape = cost.PassShape(batch=max(1, stats["peak"]), block=C, cache_len=float(np.mean(prompts)) + 0.5 * float(
        np.mean(ys)), path=sc.path, live_frac=0.6, fresh_frac=1.0,
        layout="native" if sc.schedule == "native" else "oba")
    mem = cost.memory(sc.cfg, peak_shape, sc.hw, sc.par, sc.max_context)
    if len(finishes) >= 2:
        first_arrival = min(a for a, _ in finishes)
        completion = len(finishes) / max(1e-12, max(f for _, f in finishes) - first_arrival)
        offered = len(finishes) / max(1e-12, max(a for a, _ in finishes) - first_arrival)
        stable = completion >= 0.9 * offered
    else:
        completion, stable = float("nan"), True
    return ServeResult(throughput=tokens_measured / span if span > 0 else float("nan"), itl=_pcts(itl),
                       ttft=_pcts(ttft), oom=mem.oom, peak_batch=stats["peak"], memory=mem.as_dict(),
                       finished=stats["finished"], iterations=stats["iterations"],
                       mean_pass_s=stats["pass_s"] / max(1, stats["iterations"]), completion_rate=completion,
                       stable=stable, itl_token=_pcts(itl_token), itl_block=_pcts(itl_block),
                       itl_epoch=_pcts(itl_epoch),
                       config=dict(path=sc.path, schedule=sc.schedule, rate=sc.rate, batch_cap=sc.batch_cap,
                                   prompt=str(sc.prompt), tokens=str(sc.tokens), requests=n, seed=sc.seed))


def rate_sweep(sc: ServeConfig, rates: Sequence[float], progress: bool = False) -> list[ServeResult]:
    out = []
    it = rates
    if progress:
        from tqdm import tqdm
        it = tqdm(rates, desc=f"sweep {sc.path}", unit="rate")
    for lam in it:
        out.append(simulate_serving(replace(sc, rate=float(lam))))
    return out


def max_rate_for_slo(sc: ServeConfig, slo_p95_itl: float, rate_lo: float = 0.5, rate_hi: float = 64.0,
                     iters: int = 8, itl: str = "dblock") -> tuple[float, ServeResult | None]:
    """The highest Poisson rate (req/s) in [rate_lo, rate_hi] whose P95 ITL (of definition `itl`,
    `ITL_DEFINITIONS`) <= slo (bisection; same seed).

    A rate counts only if the engine also keeps up with it (`ServeResult.stable`): with a batch cap the ITL stays
    bounded at any load — the excess waits in the queue and shows in TTFT — so the SLO alone is not enough.
    Returns (0, None) when even rate_lo misses, or when the model runs out of memory at its peak batch.
    """
    def ok(lam: float) -> tuple[bool, ServeResult]:
        res = simulate_serving(replace(sc, rate=lam))
        return (res.itl_of(itl)["p95"] <= slo_p95_itl and not res.oom and res.stable), res

    good, res_lo = ok(rate_lo)
    if not good:
        return 0.0, None
    good_hi, res_hi = ok(rate_hi)
    if good_hi:
        return rate_hi, res_hi
    lo, hi, best = rate_lo, rate_hi, res_lo
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        g, r = ok(mid)
        if g:
            lo, best = mid, r
        else:
            hi = mid
    return lo, best


def best_batch_cap(sc: ServeConfig, slo_p95_itl: float, caps: Sequence[int] = (16, 32, 64, 128, 256, 512),
                   progress: bool = False, **kw) -> dict:
    """Try each batch cap; return the one that holds the SLO at the highest rate, with the whole table."""
    table = []
    it = caps
    if progress:
        from tqdm import tqdm
        it = tqdm(caps, desc="search batch cap", unit="cap")
    for cap in it:
        rate, res = max_rate_for_slo(replace(sc, batch_cap=int(cap)), slo_p95_itl, **kw)
        table.append(dict(batch_cap=int(cap), max_rate=rate,
                          p95_itl=None if res is None else res.itl_of(kw.get("itl", "dblock"))["p95"],
                          oom=None if res is None else res.oom))
    best = max(table, key=lambda r: r["max_rate"])
    return dict(best=best, table=table, slo_p95_itl=slo_p95_itl)
