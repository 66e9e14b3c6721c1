"""SimPy model of batched decoding and serving at iteration granularity, priced call by call.

It mirrors the driver every executor shares (`dblock/decoding/schedules.py`, `step_once`): each *iteration* makes
one batched append call for every running request that needs one (the prompt's full blocks on the first iteration,
the block committed on the previous one) and then one batched denoising call over every running request. A call is
priced from its shape (`profile.CallShape`: requests, padded rows, padded context, segments, live rows of every
segment, fresh share) by a cost model — a measured operator profile (`ProfiledCost`) or the roofline
(`RooflineCost`) — and the schedule's host work per iteration (`driver`). Two admission policies:

    closed batch (`simulate_batch`)   the requests in chunks of `batch_size`, each chunk driven to completion, as
                                      `dblock.decoding.generate.generate(batch_size=...)` does
    serving (`simulate_serving`)      arrivals (Poisson or given times); FIFO admission at every iteration while
                                      fewer than `batch_cap` run, as `dblock/serving/engine.py` does

Workload: requests with a prompt length, a generation budget and their Native block chain — per block its passes,
the pass at which each denoised row was decoded (`accept`), the prompt rows it holds and the valid tokens it commits
(`Workload.from_runs` replays a measured Native run exactly; `Workload.sample` draws from distributions and a
Native profile). Schedules (docs/algorithms.md §3, llada2_moe block grid):

    native           one block in flight
    native_nocache   one block, the committed prefix recomputed every pass as block-causal segments; no appends
    oba              current ‖ warm-up on every pass while a successor block fits the budget. On masked models the
                     warm-up block decodes nothing, so every block runs its Native passes (α = 0); with `alpha` > 0
                     (uniform-state) a promoted block that received w warm-up steps runs max(1, ⌈n − α·w⌉) passes
                     (Eq. 3 with the one-pass floor)
    flowblock        the successor starts after the first pass on which the current block's readiness reaches γ

Epoch's fresh rows per plan and pass follow `liveness.per_pass` with the plan's own clock (a promoted block's plan
was made on its first warm-up pass): all rows on the cold pass and every M_C-th pass, else live + newly decoded.

Outputs (`SimResult`): counters Y K F Q, T_den, TPS, TPF, wall TPS, the decomposition of the TPS ratio
(`decompose`: n̄/n, ρ, r on the same rows, batch-composition factor β), the serving summary (throughput,
ITL/TTFT percentiles) — the same `serving_summary` the measurement uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import simpy

from dblock.simulator.profile import QUANTILES, CallShape

SCHEDULES = ("native", "native_nocache", "oba", "flowblock")


@dataclass
class Block:
    """One block of one request as Native decoding ran it."""

    passes: int
    accept: tuple            # per denoised row: the pass (1-based, as current block) that decoded it; 0 = before
    tokens: int              # valid tokens committed
    fixed: int = 0           # prompt rows sharing the block (the grid's first block)


@dataclass
class Req:
    prompt_len: int
    max_new_tokens: int
    blocks: list

    @property
    def Y(self) -> int:
        return sum(b.tokens for b in self.blocks)


@dataclass
class Workload:
    requests: list
    C: int

    def __len__(self) -> int:
        return len(self.requests)

    @staticmethod
    def from_runs(prompt_lens: Sequence[int], max_new_tokens: int | Sequence[int], blocks: Sequence[Sequence[dict]],
                  C: int) -> "Workload":
        """Replay measured Native requests: per request its prompt length and its block dicts (`BlockStats`
        fields or trace `block` events: passes, accept_pass, tokens, size)."""
        reqs = []
        mnt = [max_new_tokens] * len(prompt_lens) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        for P, m, bl in zip(prompt_lens, mnt, blocks):
            out = []
            for i, b in enumerate(bl):
                acc = tuple(int(a) for a in (b.get("accept_pass") or ()))
                fixed = max(0, int(b.get("size", C)) - len(acc)) if acc else (P % C if i == 0 else 0)
                out.append(Block(max(1, int(b["passes"])), acc, int(b["tokens"]), fixed))
            reqs.append(Req(int(P), int(m), out))
        return Workload(reqs, C)

    @staticmethod
    def sample(n: int, prompt, tokens, profile, C: int, max_new_tokens: int | None = None,
               seed: int = 0) -> "Workload":
        """n requests: prompt and answer lengths from distributions (dists.Dist or its text), every block's passes
        and accept passes drawn from a Native profile (positions.ParametricProfile / EmpiricalProfile)."""
        from dblock.simulator.dists import Dist
        from dblock.simulator.positions import PositionModel
        rng = np.random.default_rng(seed)
        pd, td = Dist.parse(prompt), Dist.parse(tokens)
        native = PositionModel(profile, delta=0.0)
        reqs = []
        for _ in range(n):
            P = max(1, int(round(pd.sample(rng))))
            Y = max(1, int(round(td.sample(rng))))
            first = P // C
            last = (P + Y - 1) // C
            blocks = []
            for b in range(first, last + 1):
                fixed = P - b * C if b == first else 0
                den = C - fixed
                s = native.promote(profile.sample(rng), 0.0, 0, rng)     # a Native block, integer passes
                n = max(1, int(math.ceil(s.passes - 1e-9)))
                acc = np.where(np.asarray(s.accept) < 0, n, np.asarray(s.accept)).astype(int)
                if acc.size != den:                   # a profile of C rows read on a block holding prompt rows
                    acc = rng.choice(acc, den, replace=acc.size < den) if acc.size else np.full(den, n)
                tok = min(P + Y, (b + 1) * C) - max(P, b * C)
                blocks.append(Block(n, tuple(int(a) for a in acc), tok, fixed))
            reqs.append(Req(P, max_new_tokens or Y, blocks))
        return Workload(reqs, C)


@dataclass
class Schedule:
    name: str = "native"
    masked: bool = True            # masked diffusion: a waiting block decodes nothing (docs/algorithms.md §3)
    alpha: float = 0.0             # uniform-state: passes saved per warm-up step (Eq. 3)
    gamma: float = 0.5             # FlowBlock readiness gate
    m_c: int = 5                   # Epoch refresh period M_C

    def __post_init__(self):
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule={self.name!r}: allowed {', '.join(SCHEDULES)}")

    @property
    def multiblock(self) -> bool:
        return self.name in ("oba", "flowblock")


class _Run:
    """One request's schedule state (the simulator's RequestRun)."""

    __slots__ = ("i", "req", "C", "sched", "first", "last_budget", "k", "j", "warm", "passes", "cache", "pending",
                 "finished", "F", "K", "Y", "arrival", "admit", "first_pass", "commits", "finish", "plan_offset")

    def __init__(self, i: int, req: Req, C: int, sched: Schedule, arrival: float = 0.0):
        self.i, self.req, self.C, self.sched = i, req, C, sched
        self.first = req.prompt_len // C
        self.last_budget = (req.prompt_len + req.max_new_tokens - 1) // C
        self.k, self.j = 0, 0
        self.warm = 0                  # warm-up steps the successor of block k has taken
        self.passes = [b.passes for b in req.blocks]
        self.plan_offset = [0] * len(req.blocks)
        self.cache = 0
        self.pending: list = []        # rows of the append segments due next iteration
        nocache = sched.name == "native_nocache"
        if not nocache and self.first > 0:
            self.pending = [C] * self.first          # prefill: the prompt's full blocks
        self.finished = False
        self.F = self.K = self.Y = 0
        self.arrival, self.admit, self.first_pass, self.finish = arrival, None, None, None
        self.commits: list = []

    # -- what the next denoising pass carries
    def _has_successor(self) -> bool:
        return self.first + self.k + 1 <= self.last_budget

    def _readiness_before(self, j: int) -> float:
        b = self.req.blocks[self.k]
        acc = b.accept
        if not acc:
            return 1.0
        return sum(1 for a in acc if 0 <= a < j) / len(acc)

    def paired(self) -> bool:
        """Does this pass carry a second block (OBA warm-up, FlowBlock in-flight)?"""
        s = self.sched
        if not s.multiblock or not self._has_successor():
            return False
        if s.name == "oba":
            return True
        j = self.j + 1                                 # the pass about to run
        return self.warm > 0 or self._readiness_before(j) >= s.gamma

    def live_current(self) -> int:
        b = self.req.blocks[self.k]
        j = self.j + 1
        if not b.accept:
            return self.C - b.fixed
        return sum(1 for a in b.accept if a >= j or a < 0)

    def fresh_current(self) -> int:
        b = self.req.blocks[self.k]
        j = self.j + 1
        p = self.plan_offset[self.k] + j               # the plan's own pass count
        if p == 1 or (p - 1) % self.sched.m_c == 0 or not b.accept:
            return self.C
        live = sum(1 for a in b.accept if a >= j or a < 0)
        new = sum(1 for a in b.accept if a == j - 1) if j > 1 else 0
        return live + new

    def denoise_rows(self) -> tuple:
        """(rows, live per segment, fresh rows, segments) of this request's next denoising pass."""
        C = self.C
        if self.sched.name == "native_nocache":
            prefix = self.first + self.k                  # committed blocks recomputed (grid: prompt blocks too)
            return (prefix + 1) * C, [self.live_current()], prefix * C + self.fresh_current(), prefix + 1
        rows, live, fresh, segs = C, [self.live_current()], self.fresh_current(), 1
        if self.paired():
            rows += C
            live.append(C)             # a waiting block: every row live (masked: nothing decoded; uniform: all)
            fresh += C
            segs += 1
        return rows, live, fresh, segs

    def context_keys(self) -> int:
        return 0 if self.sched.name == "native_nocache" else self.cache

    # -- one pass done
    def step(self, t: float) -> Optional[int]:
        """Advance one denoising pass; returns the tokens committed at `t` (None: no commit)."""
        if self.first_pass is None:
            self.first_pass = t
        paired = self.paired()
        self.F += 1
        self.j += 1
        if paired:
            self.warm += 1
        if self.j < self.passes[self.k]:
            return None
        # commit block k
        b = self.req.blocks[self.k]
        self.K += 1
        self.Y += b.tokens
        self.commits.append((t, b.tokens))
        if self.k == len(self.req.blocks) - 1:
            self.finished = True
            self.finish = t
            return b.tokens
        if self.sched.name != "native_nocache":
            self.pending.append(self.C)
        nxt = self.k + 1
        if self.sched.multiblock and self.warm:
            self.plan_offset[nxt] = self.warm
            if not self.sched.masked and self.sched.alpha > 0:
                n = self.passes[nxt]
                self.passes[nxt] = max(1, int(math.ceil(n - self.sched.alpha * self.warm - 1e-9)))
        self.k, self.j, self.warm = nxt, 0, 0
        return b.tokens

    def after_append(self) -> None:
        self.cache += sum(self.pending)
        self.pending = []

    @property
    def Q(self) -> int:
        return self.F if self.sched.name == "native_nocache" else self.F + self.K


@dataclass
class CallLog:
    """Running sums over the simulated calls."""

    den_s: float = 0.0
    den_base_s: float = 0.0        # the same denoising calls with each request's extra blocks removed (r's base)
    den_calls: int = 0
    app_s: float = 0.0
    app_calls: int = 0
    driver_s: float = 0.0
    requests_per_call: list = field(default_factory=list)
    rows_per_call: list = field(default_factory=list)


class _Engine:
    def __init__(self, cost, C: int, base_cost=None):
        self.cost, self.C = cost, C
        self.base_cost = base_cost if base_cost is not None else cost
        self.log = CallLog()

    def _base_call(self, running: list, per: list) -> CallShape:
        """The baseline's pass on the same requests: Native layout (the current block only, committed prefix
        cached), priced with `base_cost` (the reference executor)."""
        C = self.C
        keys = [(r.first + r.k) * C if r.sched.name == "native_nocache" else r.cache for r in running]
        return CallShape("denoise", len(running), C, max(keys) + C, 1, tuple(p[1][0] for p in per), C * len(running),
                         1.0)

    def iteration(self, running: list) -> float:
        """Price one iteration over `running` (_Run) and return its seconds (appends, denoising, host work)."""
        cost, log = self.cost, self.log
        t = 0.0
        app = [r for r in running if r.pending]
        if app:
            rows = [sum(r.pending) for r in app]
            L = max(rows)
            shape = CallShape("append", len(app), L, max(r.cache for r in app) + L, max(len(r.pending) for r in app))
            dt = cost.call(shape)
            log.app_s += dt
            log.app_calls += 1
            t += dt
            for r in app:
                r.after_append()
        per = [r.denoise_rows() for r in running]
        rows = [p[0] for p in per]
        L = max(rows)
        ctx = max(r.context_keys() for r in running) + L
        valid = sum(rows)
        fresh = sum(p[2] for p in per)
        shape = CallShape("denoise", len(running), L, ctx, max(p[3] for p in per),
                          tuple(x for p in per for x in p[1]), valid, min(1.0, fresh / max(1, valid)))
        dt = cost.call(shape)
        base = self._base_call(running, per)
        log.den_base_s += dt if (base == shape and self.base_cost is cost) else self.base_cost.call(base)
        log.den_s += dt
        log.den_calls += 1
        log.requests_per_call.append(len(running))
        log.rows_per_call.append(valid)
        t += dt
        drv = cost.driver(len(running))
        log.driver_s += drv
        return t + drv


@dataclass
class SimResult:
    schedule: str
    executor: str
    Y: int
    K: int
    F: int
    Q: int
    R: int
    log: CallLog
    wall_s: float
    runs: list = field(default_factory=list, repr=False)

    @property
    def t_den(self) -> float:
        return self.log.den_s / self.log.den_calls if self.log.den_calls else float("nan")

    @property
    def tps(self) -> float:
        return self.Y / self.log.den_s if self.log.den_s else float("nan")

    @property
    def tpf(self) -> float:
        return self.Y / self.Q if self.Q else float("nan")

    @property
    def wall_tps(self) -> float:
        return self.Y / self.wall_s if self.wall_s else float("nan")

    @property
    def n(self) -> float:
        return self.F / self.K if self.K else float("nan")

    def summary(self) -> dict:
        lg = self.log
        return dict(schedule=self.schedule, executor=self.executor, Y=self.Y, K=self.K, F=self.F, Q=self.Q, R=self.R,
                    TPF=self.tpf, TPS=self.tps, T_den_ms=1e3 * self.t_den, wall_TPS=self.wall_tps, n=self.n,
                    den_s=lg.den_s, den_base_s=lg.den_base_s, denoise_calls=lg.den_calls, append_calls=lg.app_calls,
                    requests_per_call=float(np.mean(lg.requests_per_call)) if lg.requests_per_call else 0.0,
                    rows_per_call=float(np.mean(lg.rows_per_call)) if lg.rows_per_call else 0.0)


def _result(sched: Schedule, cost, runs: list, eng: _Engine, wall: float) -> SimResult:
    return SimResult(sched.name, getattr(cost, "executor", "?"), sum(r.Y for r in runs), sum(r.K for r in runs),
                     sum(r.F for r in runs), sum(r.Q for r in runs), len(runs), eng.log, wall, runs)


def simulate_batch(workload: Workload, schedule: Schedule | str, cost, batch_size: Optional[int] = None,
                   base_cost=None) -> SimResult:
    """Decode every request of `workload` in chunks of `batch_size` (None: all at once), each chunk to completion.
    `base_cost` prices the baseline's pass on the same rows (default `cost`; give the reference executor's to
    compare an executor)."""
    sched = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
    runs = [_Run(i, r, workload.C, sched) for i, r in enumerate(workload.requests)]
    eng = _Engine(cost, workload.C, base_cost)
    env = simpy.Environment()
    step = batch_size or max(1, len(runs))

    def engine():
        for c0 in range(0, len(runs), step):
            chunk = runs[c0:c0 + step]
            for r in chunk:
                r.admit = env.now
            while True:
                running = [r for r in chunk if not r.finished]
                if not running:
                    break
                dt = eng.iteration(running)
                t_start = env.now
                yield env.timeout(dt)
                for r in running:
                    if r.first_pass is None:
                        r.first_pass = t_start
                    r.step(env.now)

    env.process(engine())
    env.run()
    return _result(sched, cost, runs, eng, env.now)


def simulate_serving(workload: Workload, schedule: Schedule | str, cost, arrivals: Sequence[float],
                     batch_cap: int = 16) -> SimResult:
    """Requests arrive at `arrivals` (seconds; request i is workload request i mod its size), wait FIFO, and are
    admitted at iteration boundaries while fewer than `batch_cap` run (dblock/serving/engine.py)."""
    sched = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
    if batch_cap < 1:
        raise ValueError(f"batch_cap={batch_cap}: must be >= 1")
    times = sorted(float(a) for a in arrivals)
    n = len(times)
    reqs = workload.requests
    runs = [_Run(i, reqs[i % len(reqs)], workload.C, sched, times[i]) for i in range(n)]
    eng = _Engine(cost, workload.C)
    env = simpy.Environment()
    queue: list = []
    wake = [env.event()]
    done = [0]

    def source():
        for r in runs:
            yield env.timeout(max(0.0, r.arrival - env.now))
            queue.append(r)
            if not wake[0].triggered:
                wake[0].succeed()

    def engine():
        running: list = []
        while done[0] < n:
            admitted = 0
            while queue and len(running) < batch_cap:
                r = queue.pop(0)
                r.admit = env.now
                running.append(r)
                admitted += 1
            if not running:
                wake[0] = env.event()
                yield wake[0]
                continue
            if admitted and hasattr(cost, "admit"):   # the engine builds the admitted requests' state first
                yield env.timeout(cost.admit(admitted))
            t_start = env.now
            dt = eng.iteration(running)
            yield env.timeout(dt)
            for r in running:
                if r.first_pass is None:
                    r.first_pass = t_start
                r.step(env.now)
            for r in [r for r in running if r.finished]:
                running.remove(r)
                done[0] += 1

    env.process(source())
    env.process(engine())
    env.run()
    return _result(sched, cost, runs, eng, env.now)


def with_interval(fn, cost, *args, **kw) -> dict:
    """Run `fn(..., cost=...)` at the profile's lo / median / hi quantiles: {q: result}."""
    return {q: fn(*args, cost=cost.with_q(q), **kw) for q in QUANTILES}


# ---- serving summary (shared with the measurement) ------------------------------------------------------------

def serving_summary(records: Sequence[dict]) -> dict:
    """Throughput, ITL and TTFT percentiles from per-request records {arrival, first_pass, commits: [(t, tokens)],
    finish}, as `dblock/serving/engine.py` defines them: equivalent ITL of a commit = (commit − the previous commit of
    the request, or its first pass) / tokens; TTFT = first commit − arrival; throughput = tokens / (last finish −
    first arrival)."""
    itl, ttft, tokens = [], [], 0
    first_arrival, last_finish = math.inf, -math.inf
    for r in records:
        prev = r["first_pass"]
        for t, tok in r["commits"]:
            if tok > 0:
                itl.append((t - prev) / tok)
            prev = t
            tokens += tok
        if r["commits"]:
            ttft.append(r["commits"][0][0] - r["arrival"])
        first_arrival = min(first_arrival, r["arrival"])
        if r.get("finish") is not None:
            last_finish = max(last_finish, r["finish"])
    span = last_finish - first_arrival

    def pct(x, q):
        return float(np.percentile(x, q)) if len(x) else float("nan")
    return dict(throughput=tokens / span if span > 0 else float("nan"), tokens=tokens, requests=len(records),
                itl_p50=pct(itl, 50), itl_p95=pct(itl, 95), itl_p99=pct(itl, 99), ttft_p50=pct(ttft, 50),
                ttft_p95=pct(ttft, 95), span_s=span)


def records_of(res: SimResult) -> list:
    return [dict(arrival=r.arrival, first_pass=r.first_pass, commits=list(r.commits), finish=r.finish)
            for r in res.runs]


# ---- the TPS ratio, decomposed --------------------------------------------------------------------------------

def decompose(base: dict, other: dict) -> dict:
    """TPS(other)/TPS(base) = (n̄/n)·ρ/(r·β) (docs/counters.md), from two runs' counters and times.

    Each dict: Y, K, F, den_s (denoising time) and den_base_s (the baseline's pass timed on the same calls' requests:
    the reference executor, Native layout, current block only). n̄/n = (F_b/K_b)/(F_o/K_o), ρ = (Y_o/K_o)/(Y_b/K_b),
    r = den_s/den_base_s of `other` (its pass over the baseline's pass on the same rows), β = (den_base_s_o/F_o) /
    (den_s_b/F_b) (the baseline pass's cost per request at other's batch composition over at base's own). The
    product reproduces the measured ratio exactly.

    Without a baseline timing on the same rows (`den_base_s` missing or None) but with both runs batching the same
    requests alike (equal `requests_per_call` sequences), β = 1 by definition and r = the ratio of per-request-pass
    times."""
    nbar_n = (base["F"] / base["K"]) / (other["F"] / other["K"])
    rho = (other["Y"] / other["K"]) / (base["Y"] / base["K"])
    if other.get("den_base_s") is None:
        same = (other.get("requests_per_call") is not None
                and list(other["requests_per_call"]) == list(base.get("requests_per_call") or []))
        if not same:
            raise ValueError("decompose: no baseline timing on the same rows and the batch compositions differ")
        r = (other["den_s"] / other["F"]) / (base["den_s"] / base["F"])
        beta = 1.0
    else:
        r = other["den_s"] / other["den_base_s"]
        beta = (other["den_base_s"] / other["F"]) / (base["den_s"] / base["F"])
    return dict(nbar_over_n=nbar_n, rho=rho, r=r, beta=beta, tps_ratio=nbar_n * rho / (r * beta))


# ---- a whole prediction: every (executor, schedule) on one workload, with intervals -----------------------------

def predict(workload: Workload, profile, executors: Sequence[str] = ("reference",),
            schedules: Sequence[Schedule | str] = ("native",), batch_size: Optional[int] = None,
            arrivals: Optional[Sequence[float]] = None, batch_cap: int = 16, scale: float = 1.0) -> list:
    """Rows of TPS, T_den, TPF, n, α (Eq. 6 on the simulated counters), the TPS ratio over the reference executor's
    Native run with its factors (n̄/n, ρ, r, β), and under `arrivals` the serving summary — each value at the
    profile's median with [lo, hi] from its quartiles. `profile`: a `profile.Profile`."""
    from dblock.simulator import oba
    from dblock.simulator.profile import ProfiledCost
    out = []
    scheds = [s if isinstance(s, Schedule) else Schedule(s) for s in schedules]
    runs = {}
    for q in QUANTILES:
        ref = ProfiledCost(profile, "reference", q, scale)
        for ex in executors:
            cost = ProfiledCost(profile, ex, q, scale)
            for s in scheds:
                if arrivals is not None:
                    runs[(ex, s.name, q)] = simulate_serving(workload, s, cost, arrivals, batch_cap)
                else:
                    runs[(ex, s.name, q)] = simulate_batch(workload, s, cost, batch_size, base_cost=ref)
        if ("reference", "native", q) not in runs:
            runs[("reference", "native", q)] = (simulate_serving(workload, "native", ref, arrivals, batch_cap)
                                                if arrivals is not None else
                                                simulate_batch(workload, "native", ref, batch_size))

    def band(f):
        v = {q: f(q) for q in QUANTILES}
        return dict(value=v["median"], interval=[min(v.values()), max(v.values())])
    for ex in executors:
        for s in scheds:
            def get(q, ex=ex, s=s):
                return runs[(ex, s.name, q)]
            med = get("median")
            base = runs[("reference", "native", "median")]
            try:
                alpha = oba.fit_alpha(med.F, med.K, med.R, base.F / base.K) if s.multiblock else None
            except ValueError:
                alpha = None
            parts = decompose(base.summary(), med.summary()) if arrivals is None else None
            row = dict(executor=ex, schedule=s.name, masked=s.masked, alpha_input=s.alpha,
                       TPS=band(lambda q: get(q).tps), T_den_s=band(lambda q: get(q).t_den), TPF=med.tpf, n=med.n,
                       alpha=alpha, requests_per_call=float(np.mean(med.log.requests_per_call)),
                       tps_ratio=band(lambda q: get(q).tps / runs[("reference", "native", q)].tps),
                       parts=parts)
            if arrivals is not None:
                sums = {q: serving_summary(records_of(get(q))) for q in QUANTILES}
                for k in ("throughput", "itl_p50", "itl_p95", "ttft_p95"):
                    row[k] = band(lambda q, k=k: sums[q][k])
            out.append(row)
    return out
