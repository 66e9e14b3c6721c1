"""Capacity planning on a machine described by its operator profile (`simulate plan --operator-profile`): the
planner of `plan.py` with the profile as the hardware, one replica (this machine), and the batched SimPy model of
the shared driver (`batch.simulate_serving`, every call priced by `profile.ProfiledCost`) in place of the roofline.

For each executor (reference = dense, epoch) and batch cap it bisects the highest Poisson rate whose simulated
P95 ITL and P95 TTFT hold the objectives (and whose throughput keeps up with the offered load: at least 90% of
λ·Ȳ); the plan is the (executor, cap) that holds them at the highest rate — with one replica the cost of the
machine is fixed, so the highest rate is the cheapest per token. Its figures carry the band of the profile's
repeat quartiles (lo/hi tables: the machine's own noise, the unmeasured input here).

`rate_margin` m > 0 plans at that highest rate (the SLO edge) divided by 1 + m, with the plan's figures simulated
there: the edge is where the queue's knee meets the TTFT objective, and a few percent of throughput the profile does
not price (the serving process's work outside the executor calls) moves a knee-edge plan across the objective.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dblock.simulator import batch
from dblock.simulator.profile import QUANTILES, ProfiledCost

CAPS = (4, 8, 16, 32)


def arrivals(rate: float, n: int, seed: int = 0) -> list:
    rng = np.random.default_rng([seed, 31])
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


def serve(workload: batch.Workload, cost: ProfiledCost, rate: float, cap: int, n: int, seed: int = 0,
          arr: Sequence[float] | None = None) -> dict:
    """One simulated serving run: the `batch.serving_summary` dict."""
    a = list(arr) if arr is not None else arrivals(rate, n, seed)
    res = batch.simulate_serving(workload, "native", cost, a, cap)
    return batch.serving_summary(batch.records_of(res))


def _meets(s: dict, rate: float, y_mean: float, slo_itl, slo_ttft) -> bool:
    keeps_up = s["throughput"] >= 0.9 * rate * y_mean
    return (keeps_up and (slo_itl is None or s["itl_p95"] <= slo_itl)
            and (slo_ttft is None or s["ttft_p95"] <= slo_ttft))


def max_rate(workload, cost, cap: int, slo_itl, slo_ttft, n: int = 96, seed: int = 0, iters: int = 8
             ) -> tuple[float, dict | None]:
    """The highest rate (req/s) holding the objectives at this cap: doubling then geometric bisection."""
    y_mean = float(np.mean([r.Y for r in workload.requests]))
    lo, s_lo = 0.0, None
    hi = 0.25
    for _ in range(12):
        s = serve(workload, cost, hi, cap, n, seed)
        if not _meets(s, hi, y_mean, slo_itl, slo_ttft):
            break
        lo, s_lo, hi = hi, s, hi * 2
    else:
        return lo, s_lo
    if lo == 0.0:
        lo = hi / 16
        s = serve(workload, cost, lo, cap, n, seed)
        if not _meets(s, lo, y_mean, slo_itl, slo_ttft):
            return 0.0, None
        s_lo = s
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        s = serve(workload, cost, mid, cap, n, seed)
        if _meets(s, mid, y_mean, slo_itl, slo_ttft):
            lo, s_lo = mid, s
        else:
            hi = mid
    return lo, s_lo


def plan_profiled(profile, workload: batch.Workload, slo_itl: float | None, slo_ttft: float | None,
                  caps: Sequence[int] = CAPS, executors: Sequence[str] = ("reference", "epoch"), n: int = 96,
                  seed: int = 0, scale: float = 1.0, progress=None, rate_margin: float = 0.0) -> dict:
    """The plan (module docstring): {"plans": [best first], "table": every (executor, cap)}."""
    if not rate_margin >= 0:
        raise ValueError(f"rate_margin={rate_margin}: must be >= 0")
    table = []
    for ex in executors:
        cost = ProfiledCost(profile, ex, "median", scale)
        for cap in caps:
            rate, s = max_rate(workload, cost, cap, slo_itl, slo_ttft, n, seed)
            table.append(dict(executor=ex, batch_cap=int(cap), max_rate=rate, summary=s))
            if progress:
                progress(f"{ex} cap {cap}: {rate:.3f} req/s")
    ok = [t for t in table if t["max_rate"] > 0]
    ok.sort(key=lambda t: (-t["max_rate"], t["batch_cap"]))
    plans = []
    y_mean = float(np.mean([r.Y for r in workload.requests]))
    for t in ok:
        rate = t["max_rate"] / (1.0 + rate_margin)
        bands = {}
        for q in QUANTILES:
            s = serve(workload, ProfiledCost(profile, t["executor"], q, scale), rate, t["batch_cap"], n, seed)
            for k in ("itl_p95", "ttft_p95", "throughput"):
                bands.setdefault(k, []).append(s[k])
        s = t["summary"] if not rate_margin else serve(workload, ProfiledCost(profile, t["executor"], "median", scale),
                                                        rate, t["batch_cap"], n, seed)
        plans.append(dict(hardware="cpu (operator profile)", gpus=1, tp=1, ep=1, replicas=1, batch_cap=t["batch_cap"],
                          executor=t["executor"], schedule="native", rate=rate, slo_edge_rate=t["max_rate"],
                          rate_margin=rate_margin,
                          p95_itl_s=s["itl_p95"], p95_ttft_s=s["ttft_p95"], throughput_tok_s=s["throughput"],
                          tokens_per_request=y_mean,
                          band={k: [float(min(v)), float(max(v))] for k, v in bands.items()}))
    return dict(plans=plans, table=[{k: v for k, v in t.items() if k != "summary"} for t in table],
                slo_itl=slo_itl, slo_ttft=slo_ttft, requests=n)
