"""Capacity planning: the cheapest deployment that meets a latency objective (`dblock simulate plan`).

A *candidate* is one replica shape — hardware kind, GPUs per replica g, TP/EP/SP degrees with max(tp, ep, sp) = g,
executor path (dense, Epoch) and schedule (Native; OBA on uniform-state models) — served by r identical replicas
behind a load balancer that splits the Poisson arrivals evenly (each replica sees rate λ/r). Its cost is r·g·price
per hour; cost per million output tokens = r·g·price / (λ·Ȳ·3600) · 10⁶ (Ȳ: mean answer length).

1. Workload statistics (`work_stats`): requests drawn from the prompt and answer distributions, each block's passes
   from the Native decode profile (`positions`; `--liveness-from` puts a trace's blocks in place of the uniform
   assumption), the schedule applied (`positions.simulate_chain`). Kept: mean passes per request, the P95 over
   block commits of passes / tokens committed (an equivalent ITL in units of one iteration), the P95 of the first
   block's passes (TTFT in iterations), the pass-averaged live and fresh shares (`liveness.per_pass`).
2. Analytic steady state (`Evaluator.steady`): at per-replica rate λ_r the mean running batch B and the iteration
   time t solve B = λ_r · passes · t (Little's law) with t = `cost.pass_cost` of that batch (mean cache length,
   live/fresh shares, the prefill and append rows λ_r·t·(P̄ + Ȳ) folded in). No fixed point: the replica cannot
   keep up. The tails see the batch one P95 swing above its mean, B⁺ = B + 1.645·√B (Poisson occupancy): predicted
   P95 ITL = t(B⁺) · P95(passes/tokens), P95 TTFT = t(B⁺) · (P95(first-block passes) + 1).
3. Per replica shape: the weights alone must fit (else dropped: OOM, with the bytes); the batch caps whose peak
   memory (`cost.memory`, KV reserved per request: P95 of prompt + answer) fits; the highest rate holding the SLOs
   (bisection on the analytic prediction) and the rate at which the mean batch fills the largest cap
   that fits (its P95 swing B + 1.645·√B within the cap). r = ⌈λ / that rate⌉; the cap chosen is the smallest
   that fits the replica's load.
4. The cheapest shapes (one per hardware, g, executor, schedule) are re-simulated with the SimPy serving model
   (`serving.simulate_serving`) at their settings; a plan is kept only when the simulation meets the SLOs too (one
   more replica is tried when it does not). The table shows the simulated P95s.
5. Bands (`band`): every kept plan is re-planned analytically with each unmeasured input moved to the ends of its
   range — hardware efficiency factors, the decode profile (passes per block and liveness), α (OBA only) — and
   the range of GPUs, cost and P95s is reported with the input that moves the cost most.

When no candidate meets the SLOs, `Result.binding` says which limit binds: the latency floor of a single request
(ITL or TTFT at a vanishing rate, on the fastest shape), memory (every shape OOM), or the GPU budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from dblock.config import ModelConfig
from dblock.simulator import cost, hardware
from dblock.simulator.dists import Dist
from dblock.simulator.hardware import Hardware
from dblock.simulator.liveness import per_pass
from dblock.simulator.positions import ParametricProfile, PositionModel, Profile, simulate_chain

#: placeholder prices, US$ per GPU-hour (rough on-demand cloud list prices; override with --price KIND=USD)
PRICES = hardware.PRICES     # placeholder US$ per GPU-hour (--price overrides)
GPUS_PER_REPLICA = (1, 2, 4, 8)
CAPS = (16, 32, 64, 128, 256, 512)
SUPPORT_BLOCK = 0.16   # Expert Atlas support of one block / E (serving.ServeConfig's default)
ALPHA_OBA = 0.54       # One Block Ahead paper, DiffusionGemma: passes saved per warm-up step
ALPHA_LOW = 0.38       # the same paper's Dense Mask α: the lower end of the α band
EXECUTORS = ("dense", "epoch")


@dataclass
class WorkStats:
    passes_mean: float       # denoising passes per request (all its blocks)
    ratio_q95: float         # P95 over commits of passes / tokens committed
    first_q95: float         # P95 of the first block's passes
    prompt_mean: float
    y_mean: float
    ctx_q95: float           # P95 of prompt + answer (KV reserved per running request)
    live: float
    fresh: float
    block_q95: float = float("nan")   # P95 over commits of a block's passes (the block latency in iterations)

    @property
    def cache_len(self) -> float:
        return self.prompt_mean + 0.5 * self.y_mean


_STATS: dict = {}


def work_stats(C: int, profile: Profile, schedule: str, alpha: float, prompt, tokens, n: int = 300,
               seed: int = 0, m_c: int = 5) -> WorkStats:
    """Monte Carlo of the workload under a schedule (see the module docstring, step 1); cached per inputs."""
    key = (C, id(profile), schedule, alpha if schedule == "oba" else 0.0, str(prompt), str(tokens), n, seed, m_c)
    if key not in _STATS:
        if len(_STATS) > 64:
            _STATS.clear()
        _STATS[key] = (_work_stats(C, profile, schedule, alpha, prompt, tokens, n, seed, m_c), profile)
    return _STATS[key][0]


def _work_stats(C, profile, schedule, alpha, prompt, tokens, n, seed, m_c) -> WorkStats:
    rng = np.random.default_rng([seed, 31])
    pd, td = Dist.parse(prompt), Dist.parse(tokens)
    model = PositionModel(profile, delta=alpha if schedule == "oba" else 0.0)
    ratios, firsts, totals, ps, ys, lives, freshes, blocks_n = [], [], [], [], [], [], [], []
    for i in range(n):
        P = max(1, int(round(pd.sample(rng))))
        Y = max(1, int(round(td.sample(rng))))
        K = math.ceil(Y / C)
        blocks = simulate_chain(model, schedule, K, np.random.default_rng([seed, 7, i]))
        tot = 0
        for k, b in enumerate(blocks):
            npass = int(math.ceil(b.passes - 1e-9))
            tok = C if k < K - 1 else Y - C * (K - 1)
            ratios.append(npass / tok)
            blocks_n.append(npass)
            tot += npass
            lv, fr = per_pass(b.accept, m_c, n=npass)
            lives.extend(lv)
            freshes.extend(fr)
        firsts.append(int(math.ceil(blocks[0].passes - 1e-9)))
        totals.append(tot)
        ps.append(P)
        ys.append(Y)
    ctx = np.asarray(ps) + np.asarray(ys)
    return WorkStats(float(np.mean(totals)), float(np.percentile(ratios, 95)), float(np.percentile(firsts, 95)),
                     float(np.mean(ps)), float(np.mean(ys)), float(np.percentile(ctx, 95)), float(np.mean(lives)),
                     float(np.mean(freshes)), float(np.percentile(blocks_n, 95)))


@dataclass(frozen=True)
class Shape:
    """One replica shape."""

    hardware: str
    gpus: int
    tp: int
    ep: int
    sp: int
    executor: str
    schedule: str

    @property
    def par(self) -> cost.Parallel:
        return cost.Parallel(self.tp, self.ep, self.sp)


def parallel_shapes(g: int, cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(tp, ep, sp) in powers of two up to g with max = g; TP at most the attention heads, EP at most E."""
    pw = [1 << i for i in range(int(math.log2(g)) + 1)]
    return [(t, e, s) for t in pw for e in pw for s in pw if max(t, e, s) == g
            and t <= cfg.num_attention_heads and e <= cfg.num_experts]


def high_batch(B: float) -> float:
    """The running batch one P95 swing above its mean B (Poisson: B + 1.645·√B)."""
    return B + 1.645 * math.sqrt(B)


def batch_for_cap(cap: int) -> float:
    """The largest mean batch whose P95 swing stays within the cap: B + 1.645·√B = cap."""
    return (math.sqrt(0.8225 ** 2 + cap) - 0.8225) ** 2


class Evaluator:
    """The analytic model of one replica shape on one hardware (module docstring, steps 2 and 3)."""

    def __init__(self, cfg: ModelConfig, hw: Hardware, shape: Shape, cal: cost.Calibration, ws: WorkStats,
                 itl: str = "epoch"):
        self.cfg, self.hw, self.shape, self.cal, self.ws, self.itl = cfg, hw, shape, cal, ws, itl
        self.par = shape.par
        self.layout = "oba" if shape.schedule == "oba" else "native"

    def pass_s(self, B: float, extra: float) -> float:
        ws = self.ws
        sh = cost.PassShape(batch=B, layout=self.layout, block=self.cfg.block_size, cache_len=ws.cache_len,
                            path=self.shape.executor, live_frac=ws.live, fresh_frac=ws.fresh,
                            support_frac=min(1.0, 1.0 - (1.0 - SUPPORT_BLOCK) ** max(1.0, B)), extra_rows=extra)
        return cost.pass_cost(self.cfg, sh, self.hw, self.par, self.cal).total

    def steady(self, lam: float, b_max: float = 1e5) -> tuple[float, float] | None:
        """(iteration s, mean batch) at per-replica rate lam, or None when the replica cannot keep up."""
        ws = self.ws
        rows = ws.prompt_mean + ws.y_mean

        def g(t):                      # f(t) - t, f = the iteration time of the batch that t implies
            B = max(1.0, lam * ws.passes_mean * t)
            return None if B > b_max else self.pass_s(B, lam * t * rows) - t
        t0 = self.pass_s(1.0, 0.0)
        g0 = g(t0)
        if g0 is None:
            return None
        t1 = t0 + g0
        for _ in range(40):            # secant from below: g is convex in t (costs rise faster past the knees)
            g1 = g(t1)
            if g1 is None:
                return None
            if abs(g1) <= 1e-5 * t1:
                return t1, max(1.0, lam * ws.passes_mean * t1)
            slope = (g1 - g0) / (t1 - t0) if t1 != t0 else -1.0
            if slope >= 0 and g1 > 0:
                return None            # f outgrows t: no fixed point, the replica cannot keep up
            t2 = t1 - g1 / slope
            if not t2 > 0:
                return None
            t0, g0, t1 = t1, g1, t2
        return None

    def predict(self, lam: float) -> dict | None:
        s = self.steady(lam)
        if s is None:
            return None
        t, B = s
        # the running batch fluctuates (Poisson-like about its mean): the tails see a batch one P95 swing above it
        t_hi = self.pass_s(high_batch(B), lam * t * (self.ws.prompt_mean + self.ws.y_mean))
        # a block's latency in iterations: its passes (epoch, block); per token: passes / tokens (dblock, token)
        per = self.ws.block_q95 if self.itl in ("epoch", "block") else self.ws.ratio_q95
        return dict(iteration_s=t, batch=B, p95_itl_s=t_hi * per, p95_ttft_s=t_hi * (self.ws.first_q95 + 1))

    def memory(self, cap: int) -> cost.Memory:
        ws = self.ws
        sh = cost.PassShape(batch=cap, layout=self.layout, block=self.cfg.block_size, cache_len=ws.cache_len,
                            path=self.shape.executor, live_frac=ws.live, fresh_frac=ws.fresh)
        return cost.memory(self.cfg, sh, self.hw, self.par, max_context=int(math.ceil(ws.ctx_q95)))

    def rate_at_batch(self, B: float) -> float:
        """The per-replica rate whose steady mean batch is B."""
        ws = self.ws
        t = self.pass_s(B, 0.0)
        lam = B / (ws.passes_mean * t)
        for _ in range(6):
            t = self.pass_s(B, lam * t * (ws.prompt_mean + ws.y_mean))
            lam = B / (ws.passes_mean * t)
        return lam

    def rate_for_slo(self, slo_itl: float | None, slo_ttft: float | None, hi: float) -> float:
        """The highest per-replica rate (<= hi) whose analytic P95s hold the SLOs; 0 when none does."""
        def ok(lam):
            p = self.predict(lam)
            return p is not None and (slo_itl is None or p["p95_itl_s"] <= slo_itl) and \
                (slo_ttft is None or p["p95_ttft_s"] <= slo_ttft)
        if ok(hi):
            return hi
        lo = hi * 1e-4
        if not ok(lo):
            return 0.0
        for _ in range(12):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo


@dataclass
class Inputs:
    cfg: ModelConfig
    model: str
    hardware: dict                      # key -> Hardware
    prices: dict                        # key -> US$ per GPU-hour
    rate: float
    prompt: str = "lognormal:1024,0.5"
    tokens: str = "lognormal:512,0.5"
    slo_itl: float | None = None
    slo_ttft: float | None = None
    profile: Profile | None = None      # Native decode profile (None: uniform, `papers.default_passes`)
    uniform_state: bool = False
    alpha: float = ALPHA_OBA
    cal: cost.Calibration = field(default_factory=cost.Calibration)
    cal_name: str = "pure roofline"     # where `cal` comes from, for the table
    itl: str = "epoch"                  # the ITL definition the SLO holds (serving.ITL_DEFINITIONS)
    gpus: tuple = GPUS_PER_REPLICA
    caps: tuple = CAPS
    executors: tuple = EXECUTORS
    max_gpus: int = 1024
    top: int = 5
    requests: int = 200
    verify: bool = True
    arrivals: list | None = None
    seed: int = 0
    frontier: bool = False              # also price every shape at 1.5x..4x its replicas (the Pareto plot)

    def __post_init__(self):
        if self.profile is None:
            from dblock.simulator.papers import default_passes
            self.profile = ParametricProfile(C=self.cfg.block_size, passes=default_passes(self.model))

    @property
    def schedules(self) -> tuple:
        return ("native", "oba") if self.uniform_state else ("native",)


@dataclass
class Result:
    plans: list
    candidates: list          # every analytic candidate that fits (for the Pareto plot)
    dropped: list             # (shape, reason) of what does not fit
    binding: str | None       # why nothing meets the SLOs, when nothing does
    searched: int
    simulated: int
    stats: dict
    points: list = field(default_factory=list)   # (hardware, cost_per_mtok, p95_itl_s) for the Pareto plot

    def as_dict(self) -> dict:
        return dict(plans=self.plans, binding=self.binding, searched=self.searched, simulated=self.simulated,
                    dropped=[dict(**vars(s), reason=r) for s, r in self.dropped[:50]], dropped_total=len(self.dropped),
                    workload=self.stats)


def _plan_shape(inp: Inputs, ev: Evaluator, lam_hi: float) -> tuple[dict | None, str | None]:
    """Replicas, cap and analytic prediction of one shape, or (None, reason)."""
    sh = ev.shape
    w = cost.weight_bytes(inp.cfg, sh.par)
    usable = ev.hw.hbm_bytes * 0.9
    if w > usable:
        return None, f"OOM: weights {w / 1e9:.1f} GB per GPU > {usable / 1e9:.1f} GB usable"
    caps = [c for c in inp.caps if not ev.memory(c).oom]
    if not caps:
        m = ev.memory(min(inp.caps))
        return None, (f"OOM: at batch cap {min(inp.caps)} {m.total / 1e9:.1f} GB per GPU > {usable / 1e9:.1f} GB "
                      f"usable (KV {m.kv_cache / 1e9:.1f}, logits {m.logits / 1e9:.1f})")
    lam_cap = ev.rate_at_batch(batch_for_cap(max(caps)))
    lam_slo = ev.rate_for_slo(inp.slo_itl, inp.slo_ttft, min(lam_hi, lam_cap))
    if lam_slo <= 0:
        p = ev.predict(1e-6 * lam_hi)
        return None, ("latency floor: a lone request's P95 ITL " f"{p['p95_itl_s'] * 1e3:.1f} ms, TTFT "
                      f"{p['p95_ttft_s']:.2f} s" if p else "cannot keep up at any rate")
    lam_r = min(lam_slo, lam_cap)
    r = max(1, math.ceil(inp.rate / lam_r * (1 + 1e-9)))
    if r * sh.gpus > inp.max_gpus:
        return None, f"GPU budget: needs {r} replicas x {sh.gpus} GPUs > --max-gpus {inp.max_gpus}"
    return _at_replicas(inp, ev, r, caps, lam_r), None


def _at_replicas(inp: Inputs, ev: Evaluator, r: int, caps: list, lam_r: float) -> dict | None:
    sh = ev.shape
    lam = inp.rate / r
    p = ev.predict(lam)
    if p is None:
        return None
    cap = next((c for c in sorted(caps) if p["batch"] <= batch_for_cap(c)), max(caps))
    price = inp.prices[sh.hardware]
    per_hour = r * sh.gpus * price
    tok_h = inp.rate * ev.ws.y_mean * 3600.0
    head = dict(rate=r * lam_r / inp.rate - 1.0)
    if inp.slo_itl:
        head["itl"] = 1.0 - p["p95_itl_s"] / inp.slo_itl
    if inp.slo_ttft:
        head["ttft"] = 1.0 - p["p95_ttft_s"] / inp.slo_ttft
    return dict(hardware=sh.hardware, gpus=r * sh.gpus, gpus_per_replica=sh.gpus, tp=sh.tp, ep=sh.ep, sp=sh.sp,
                replicas=r, batch_cap=cap, executor=sh.executor, schedule=sh.schedule, cost_per_hour=per_hour,
                cost_per_mtok=per_hour / tok_h * 1e6, analytic=p, max_rate_per_replica=lam_r,
                p95_itl_s=p["p95_itl_s"], p95_ttft_s=p["p95_ttft_s"], headroom=head, verified=False)


def search(inp: Inputs, progress: bool = False) -> Result:
    """Every candidate analytically, the cheapest re-simulated (module docstring)."""
    C = inp.cfg.block_size
    wss = {s: work_stats(C, inp.profile, s, inp.alpha, inp.prompt, inp.tokens, seed=inp.seed) for s in inp.schedules}
    shapes = [Shape(hk, g, t, e, s, ex, sc) for hk in inp.hardware for g in inp.gpus
              for (t, e, s) in parallel_shapes(g, inp.cfg) for ex in inp.executors for sc in inp.schedules]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(shapes), desc="plan: analytic search", unit="shape", leave=False)
    cands, dropped, evs = [], [], {}
    lam_hi = max(1.0, inp.rate) * 1e3
    for sh in shapes:
        ev = Evaluator(inp.cfg, inp.hardware[sh.hardware], sh, inp.cal, wss[sh.schedule], inp.itl)
        plan, why = _plan_shape(inp, ev, lam_hi)
        if plan is None:
            dropped.append((sh, why))
        else:
            cands.append(plan)
            evs[id(plan)] = ev
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    stats = dict(model=inp.model, rate=inp.rate, prompt=inp.prompt, tokens=inp.tokens, slo_itl=inp.slo_itl,
                 slo_ttft=inp.slo_ttft, block=C, decode_profile=getattr(inp.profile, "source", "uniform"),
                 **{f"{s}_{k}": v for s, w in wss.items() for k, v in vars(w).items()})
    if not cands:
        return Result([], [], dropped, _binding(dropped, inp), len(shapes), 0, stats)
    # one per (hardware, GPUs per replica, executor, schedule): the cheapest, then the most rate headroom
    best: dict = {}
    for c in cands:
        k = (c["hardware"], c["gpus_per_replica"], c["executor"], c["schedule"])
        if k not in best or (c["cost_per_mtok"], -c["headroom"]["rate"]) < (best[k]["cost_per_mtok"],
                                                                            -best[k]["headroom"]["rate"]):
            best[k] = c
    ranked = sorted(best.values(), key=lambda c: (c["cost_per_mtok"], -c["headroom"]["rate"]))
    plans, simulated = [], 0
    vbar = None
    if progress and inp.verify:
        from tqdm import tqdm
        vbar = tqdm(total=inp.top, desc="plan: simulate the cheapest", unit="plan", leave=False)
    for c in ranked:
        if len(plans) >= inp.top:
            break
        ev = evs[id(c)]
        if inp.verify:
            cc = c
            for attempt in (0, 1):
                if simulated >= 3 * inp.top + 2:
                    break
                simulated += 1
                sim = simulate(inp, ev, cc)
                if sim["meets"]:
                    cc.update(verified=True, simulated=sim, p95_itl_s=sim["p95_itl_s"], p95_ttft_s=sim["p95_ttft_s"])
                    if inp.slo_itl:
                        cc["headroom"]["itl"] = 1.0 - sim["p95_itl_s"] / inp.slo_itl
                    if inp.slo_ttft:
                        cc["headroom"]["ttft"] = 1.0 - sim["p95_ttft_s"] / inp.slo_ttft
                    plans.append(cc)
                    if vbar is not None:
                        vbar.update(1)
                    break
                if attempt == 1:
                    break
                # the simulation missed: plan again against the SLOs tightened by the simulated/analytic ratio
                a = cc["analytic"]
                tight = replace(inp, slo_itl=inp.slo_itl and inp.slo_itl * min(1.0, a["p95_itl_s"] / sim["p95_itl_s"]),
                                slo_ttft=inp.slo_ttft and inp.slo_ttft * min(1.0, a["p95_ttft_s"] / sim["p95_ttft_s"]))
                cc, _ = _plan_shape(tight, ev, lam_hi)
                if cc is None:
                    break
                cc = _at_replicas(inp, ev, cc["replicas"], [x for x in inp.caps if not ev.memory(x).oom],
                                  cc["max_rate_per_replica"])
                if cc is None:
                    break
        else:
            plans.append(c)
    if vbar is not None:
        vbar.close()
    plans.sort(key=lambda p: (p["cost_per_mtok"], -p["headroom"]["rate"]))
    points = []
    if inp.frontier:   # more replicas buy latency: every shape at 1x..4x its replicas, analytic
        for c in cands:
            ev = evs[id(c)]
            for mult in (1.0, 1.5, 2.0, 3.0, 4.0):
                r = math.ceil(c["replicas"] * mult)
                p = ev.predict(inp.rate / r)
                if p is not None:
                    points.append(dict(hardware=c["hardware"], p95_itl_s=p["p95_itl_s"],
                                       cost_per_mtok=c["cost_per_mtok"] * r / c["replicas"]))
    for p in plans:
        p["band"] = band(inp, evs.get(id(p)) or _ev_of(inp, p, wss), p)
    binding = None if plans else "no cheap candidate held the SLOs in simulation (analytic and simulated disagree)"
    return Result(plans, cands, dropped, binding, len(shapes), simulated, stats, points)


def _ev_of(inp: Inputs, p: dict, wss: dict) -> Evaluator:
    sh = Shape(p["hardware"], p["gpus_per_replica"], p["tp"], p["ep"], p["sp"], p["executor"], p["schedule"])
    return Evaluator(inp.cfg, inp.hardware[sh.hardware], sh, inp.cal, wss[sh.schedule], inp.itl)


def _binding(dropped: list, inp: Inputs) -> str:
    """Which limit binds when nothing is feasible."""
    kinds: dict = {}
    for _, why in dropped:
        kinds.setdefault(why.split(":")[0], []).append(why)
    if "latency floor" in kinds:
        # the best floor over the shapes that fit in memory
        floors = kinds["latency floor"]
        slo = []
        if inp.slo_itl is not None:
            best = min(float(w.split("ITL ")[1].split(" ms")[0]) for w in floors)
            if best > inp.slo_itl * 1e3:
                slo.append(f"P95 ITL: the fastest shape's single-request floor is {best:.1f} ms > --slo-itl "
                           f"{inp.slo_itl * 1e3:g} ms")
        if inp.slo_ttft is not None:
            best = min(float(w.split("TTFT ")[1].split(" s")[0]) for w in floors)
            if best > inp.slo_ttft:
                slo.append(f"P95 TTFT: the fastest shape's single-request floor is {best:.2f} s > --slo-ttft "
                           f"{inp.slo_ttft:g} s")
        if slo:
            return "the latency SLO binds — " + "; ".join(slo)
        return "the SLOs bind jointly: no shape meets both at once"
    if "GPU budget" in kinds:
        return f"the GPU budget binds (--max-gpus {inp.max_gpus}): " + kinds["GPU budget"][0].split(": ", 1)[1]
    if "OOM" in kinds:
        return "memory binds: every shape runs out of memory (" + kinds["OOM"][0] + ")"
    return "; ".join(sorted({w for _, w in dropped}))[:300]


def simulate(inp: Inputs, ev: Evaluator, plan: dict) -> dict:
    """Re-simulate one replica of a plan with the SimPy serving model at its settings."""
    from dblock.simulator.serving import simulate_serving
    sc = serve_config(inp, ev, plan)
    res = simulate_serving(sc)
    itl, ttft = res.itl_of(inp.itl)["p95"], res.ttft["p95"]
    # a TTFT objective sees the queue; without one the engine must keep up (or never fill its cap)
    keeps_up = inp.slo_ttft is not None or res.stable or res.peak_batch < plan["batch_cap"]
    meets = (not res.oom and keeps_up and (inp.slo_itl is None or itl <= inp.slo_itl)
             and (inp.slo_ttft is None or ttft <= inp.slo_ttft))
    return dict(p95_itl_s=itl, p95_ttft_s=ttft, throughput_tok_s=res.throughput, peak_batch=res.peak_batch,
                oom=res.oom, stable=res.stable, meets=bool(meets), requests=sc.requests,
                p95_itl_by_definition={d: res.itl_of(d).get("p95") for d in ("epoch", "dblock", "token", "block")})


def serve_config(inp: Inputs, ev: Evaluator, plan: dict):
    """The `serving.ServeConfig` of one replica of a plan (what `simulate serve` runs at its settings)."""
    from dblock.simulator.serving import ServeConfig
    arrivals = None
    if inp.arrivals is not None:   # replica i of r takes every r-th arrival
        arrivals = list(inp.arrivals[::plan["replicas"]])
    return ServeConfig(inp.cfg, ev.hw, ev.par, inp.cal, path=plan["executor"], schedule=plan["schedule"],
                       profile=inp.profile, delta=inp.alpha, prompt=inp.prompt, tokens=inp.tokens,
                       batch_cap=plan["batch_cap"], rate=inp.rate / plan["replicas"], arrivals=arrivals,
                       requests=inp.requests, max_context=int(math.ceil(ev.ws.ctx_q95)), seed=inp.seed)


def _efficiency(hw: Hardware, worse: bool) -> Hardware:
    e = hw.eff
    if worse:
        return hw.with_efficiency(gemm=e.gemm * 0.8, stream=e.stream * 0.85, a2a_busbw=e.a2a_busbw * 0.7,
                                  allreduce_busbw=e.allreduce_busbw * 0.7, a2a_latency_s=e.a2a_latency_s * 1.5,
                                  allreduce_latency_s=e.allreduce_latency_s * 1.5, launch_s=e.launch_s * 1.5)
    return hw.with_efficiency(gemm=min(0.95, e.gemm * 1.15), stream=min(0.97, e.stream * 1.08),
                              a2a_busbw=e.a2a_busbw * 1.3, allreduce_busbw=e.allreduce_busbw * 1.3,
                              a2a_latency_s=e.a2a_latency_s * 0.7, allreduce_latency_s=e.allreduce_latency_s * 0.7,
                              launch_s=e.launch_s * 0.7)


_VARIANTS: dict = {}


def _profile_variants(inp: Inputs) -> list:
    """The decode profile's ends: n̄ x0.8 and x1.2 (same liveness shape), and the other liveness source."""
    C = inp.cfg.block_size
    prof = inp.profile
    key = (id(prof), C)
    if key not in _VARIANTS:
        _VARIANTS[key] = (_make_variants(prof, C), prof)
    return _VARIANTS[key][0]


def _make_variants(prof, C: int) -> list:
    nbar = prof.nbar
    out = [ParametricProfile(C=C, passes=f"gamma:{0.8 * nbar:.3f},0.3"),
           ParametricProfile(C=C, passes=f"gamma:{1.2 * nbar:.3f},0.3")]
    if isinstance(prof, ParametricProfile):
        try:
            from dblock.simulator.liveness import trace_profile
            tp = trace_profile("code-masked")
            if tp.C == C:
                out.append(tp)
        except ValueError:  # pragma: no cover - the bundled file ships with the package
            pass
    else:
        out.append(ParametricProfile(C=C, passes=f"gamma:{nbar:.3f},0.3"))
    return out


def band(inp: Inputs, ev: Evaluator, plan: dict) -> dict:
    """Re-plan one shape with each unmeasured input at the ends of its range (module docstring, step 5)."""
    sh = ev.shape
    variants: dict = {"efficiency": [], "decode profile": []}
    for worse in (True, False):
        variants["efficiency"].append((replace(inp, hardware={**inp.hardware, sh.hardware: _efficiency(ev.hw, worse)}),
                                       None))
    for prof in _profile_variants(inp):
        variants["decode profile"].append((replace(inp, profile=prof), prof))
    if sh.schedule == "oba":
        variants["alpha"] = [(replace(inp, alpha=ALPHA_LOW), None)]
    scale_itl = plan["p95_itl_s"] / plan["analytic"]["p95_itl_s"]
    scale_ttft = plan["p95_ttft_s"] / plan["analytic"]["p95_ttft_s"]
    by_input, lo_hi = {}, dict(gpus=[plan["gpus"]] * 2, cost_per_mtok=[plan["cost_per_mtok"]] * 2,
                              p95_itl_s=[plan["p95_itl_s"]] * 2, p95_ttft_s=[plan["p95_ttft_s"]] * 2)
    for name, vs in variants.items():
        g, c, it, tt = [plan["gpus"]], [plan["cost_per_mtok"]], [plan["p95_itl_s"]], [plan["p95_ttft_s"]]
        for vin, prof in vs:
            ws = ev.ws if prof is None and vin.alpha == inp.alpha else work_stats(
                inp.cfg.block_size, vin.profile, sh.schedule, vin.alpha, inp.prompt, inp.tokens, seed=inp.seed)
            e2 = Evaluator(inp.cfg, vin.hardware[sh.hardware], sh, inp.cal, ws, inp.itl)
            p2, _ = _plan_shape(vin, e2, max(1.0, inp.rate) * 1e3)
            if p2 is None:
                g.append(math.inf)
                c.append(math.inf)
            else:
                g.append(p2["gpus"])
                c.append(p2["cost_per_mtok"])
            same = e2.predict(inp.rate / plan["replicas"])   # the plan as chosen, under this input
            it.append(math.inf if same is None else same["p95_itl_s"] * scale_itl)
            tt.append(math.inf if same is None else same["p95_ttft_s"] * scale_ttft)
        by_input[name] = dict(gpus=[min(g), max(g)], cost_per_mtok=[min(c), max(c)], p95_itl_s=[min(it), max(it)],
                              p95_ttft_s=[min(tt), max(tt)])
        for k, v in by_input[name].items():
            lo_hi[k] = [min(lo_hi[k][0], v[0]), max(lo_hi[k][1], v[1])]

    def width(d):
        lo, hi = d["cost_per_mtok"]
        return (hi / lo if lo > 0 else math.inf, d["p95_itl_s"][1] / max(1e-12, d["p95_itl_s"][0]))
    dominant = max(by_input, key=lambda k: width(by_input[k]))
    return dict(**lo_hi, dominant=dominant, by_input=by_input)
