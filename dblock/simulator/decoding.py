"""SimPy model of block-diffusion decoding under Native, OBA and FlowBlock for a population of requests.

The unit of work is a denoising pass. Each request is a SimPy process that, block by block, holds the device for
one pass at a time; a pass costs `t_pass` (Native, C positions) or `r · t_pass` when it carries a warm-up block
(OBA: every pass; FlowBlock: the passes after the current block's readiness gate γ). Each response also pays one
prefill pass and K − 1 cache-append passes (counted in Q and wall time, not in denoising time, as in Eq. 2).

Block dynamics come from `positions.PositionModel`: Native passes per block from a distribution or a calibrated
profile, and a warm-up step saving δ passes (with optional noise) of the next block. With a constant discount, no
clipping and keep-all promotion this is exactly the recurrence of Eq. (3) with α = δ, so the simulated means must
reproduce the closed forms of `oba` — the tests check that, and that `fit_alpha` recovers α from the counters.

The simulator can write a JSON-lines trace (`dblock.trace` schema: run / pass / block / request events, with the
per-position ``accept_pass`` and ``kept`` lists), used to test `calibrate` before real executor traces exist.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import simpy

from dblock.simulator import oba
from dblock.simulator.dists import Dist
from dblock.simulator.positions import PositionModel, Promoted, gate_pass, simulate_chain
from dblock.trace import TraceWriter


@dataclass
class RequestResult:
    request: int
    Y: int               # valid tokens generated
    K: int               # blocks
    F: int               # denoising passes
    Q: int               # serving passes: 1 prefill + (K − 1) appends + F
    den_s: float         # denoising device time
    wall_s: float        # finish − start (includes prefill, appends and waiting for the device)
    passes_per_block: list = field(default_factory=list)


@dataclass
class DecodeResult:
    schedule: str
    requests: list[RequestResult]
    nbar: float                      # the profile's Native passes per block

    @property
    def Y(self) -> int:
        return sum(r.Y for r in self.requests)

    @property
    def K(self) -> int:
        return sum(r.K for r in self.requests)

    @property
    def F(self) -> int:
        return sum(r.F for r in self.requests)

    @property
    def Q(self) -> int:
        return sum(r.Q for r in self.requests)

    @property
    def R(self) -> int:
        return len(self.requests)

    @property
    def den_s(self) -> float:
        return sum(r.den_s for r in self.requests)

    @property
    def tpf(self) -> float:
        return oba.tpf(self.Y, self.K, self.F)

    @property
    def tps(self) -> float:
        return self.Y / self.den_s

    @property
    def t_den(self) -> float:
        return self.den_s / self.F

    def mean_passes_by_index(self, max_k: int) -> np.ndarray:
        """Mean n_k over the responses that have a k-th block (k = 1..max_k); NaN where none has."""
        out = np.full(max_k, np.nan)
        for k in range(max_k):
            vals = [r.passes_per_block[k] for r in self.requests if len(r.passes_per_block) > k]
            if vals:
                out[k] = float(np.mean(vals))
        return out

    def summary(self) -> dict:
        return dict(schedule=self.schedule, R=self.R, Y=self.Y, K=self.K, F=self.F, Q=self.Q, tpf=self.tpf,
                    tps=self.tps, t_den=self.t_den, n=self.F / self.K, nbar=self.nbar)


def _pass_time(t_pass: float, r: float, paired: bool) -> float:
    return t_pass * (r if paired else 1.0)


def simulate_decoding(model: PositionModel, schedule: str, tokens: Dist | str | Sequence[int], responses: int = 200,
                      *, t_pass: float = 7.08e-3, r: float = 1.26, gamma: float = 0.9, t_prefill: float | None = None,
                      t_append: float | None = None, prompt_len: int = 128, concurrency: int = 1, seed: int = 0,
                      trace: TraceWriter | None = None, progress: bool = False,
                      timer: Callable[[dict], float] | None = None) -> DecodeResult:
    """Decode `responses` requests on one device at batch 1 (requests queue for the device, FIFO).

    tokens: response lengths Y (a Dist, its text form, or explicit list); K = ceil(Y / C) blocks, the last one
    partially filled. t_pass: seconds per Native(C) denoising pass (default: the paper's 7.08 ms); r: cost ratio of
    a paired pass. t_prefill/t_append default to one Native pass. `concurrency` lets several requests interleave
    their passes on the device (still one pass at a time: no batching gain is modelled here; see serving.py).
    `timer(pass_event_fields) -> seconds`, when given, times every pass instead (e.g. a cost model × a scale, to
    write synthetic traces whose wall times a calibration must recover).
    """
    if schedule not in ("native", "oba", "flowblock"):
        raise ValueError(f"schedule={schedule!r}: allowed native, oba, flowblock")
    if responses <= 0:
        raise ValueError(f"responses={responses}: must be positive")
    if t_pass <= 0 or r <= 0:
        raise ValueError(f"t_pass={t_pass}, r={r}: must be positive")
    C = model.profile.C
    rng = np.random.default_rng(seed)
    if isinstance(tokens, (str, Dist)):
        tdist = Dist.parse(tokens)
        ys = [max(1, int(round(tdist.sample(rng)))) for _ in range(responses)]
    else:
        ys = [int(y) for y in tokens][:responses]
        if any(y <= 0 for y in ys):
            raise ValueError("tokens: every response length must be positive")
    t_prefill = t_pass if t_prefill is None else t_prefill
    t_append = t_pass if t_append is None else t_append

    _last_seconds = [0.0]
    env = simpy.Environment()
    device = simpy.Resource(env, capacity=1)
    results: list[RequestResult | None] = [None] * len(ys)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(ys), desc=f"simulate {schedule}", unit="req")

    def run_pass(kind: str, req: int, rows: int, seconds: float, extra: dict):
        if timer is not None:
            seconds = float(timer(dict(kind=kind, batch=1, rows=rows, **extra)))
        _last_seconds[0] = seconds
        with device.request() as slot:
            yield slot
            yield env.timeout(seconds)
        if trace is not None:
            trace.write("pass", kind=kind, requests=[req], batch=1, rows=rows, wall_s=seconds, **extra)

    def request(i: int, Y: int):
        start = env.now
        K = math.ceil(Y / C)
        chain_rng = np.random.default_rng([seed, 1, i])
        # the chain (passes and positions per block) is drawn up front; SimPy then times it pass by pass
        chain: list[Promoted] = simulate_chain(model, schedule, K, chain_rng, gamma=gamma)
        den = 0.0
        cache = prompt_len
        yield from run_pass("prefill", i, prompt_len, t_prefill,
                            dict(live=0, decoded=0, cache_len=[0], segments=[[[-1, "prefix", prompt_len]]]))
        F = 0
        for k, blk in enumerate(chain):
            n = int(math.ceil(blk.passes - 1e-9))
            gate = gate_pass(blk, gamma) if schedule == "flowblock" else 0
            for j in range(1, n + 1):
                paired = schedule == "oba" or (schedule == "flowblock" and j > gate)
                dt = _pass_time(t_pass, r, paired)
                live = int(np.sum((blk.accept < 0) | (blk.accept >= j)))
                segs = [[k, "current", C]] + ([[k + 1, "warmup", C]] if paired else [])
                yield from run_pass("denoise", i, C * (2 if paired else 1), dt,
                                    dict(live=live + (C if paired else 0), decoded=C - live, cache_len=[cache],
                                         segments=[segs]))
                den += dt if timer is None else _last_seconds[0]
                F += 1
            tok = C if k < K - 1 else Y - C * (K - 1)
            if trace is not None:
                acc = blk.accept
                trace.write("block", request=i, block=k, size=C, passes=n, warmup_steps=blk.warmup_steps,
                            tokens=tok, first_pass_accepted=int(np.sum((acc >= 0) & (acc <= 1))),
                            first_pass_kept=int(np.sum((acc >= 0) & (acc <= 1) & blk.kept)), eos=k == K - 1,
                            accept_pass=acc.tolist(), kept=blk.kept.tolist())
            cache += C
            if k < K - 1:
                yield from run_pass("append", i, C, t_append,
                                    dict(live=0, decoded=0, cache_len=[cache - C], segments=[[[k, "current", C]]]))
        res = RequestResult(i, Y, K, F, F + K, den, env.now - start,
                            [int(math.ceil(b.passes - 1e-9)) for b in chain])
        results[i] = res
        if trace is not None:
            trace.write("request", request=i, prompt_len=prompt_len, Y=Y, K=K, F=F, Q=F + K, den_s=den,
                        wall_s=res.wall_s)
        if bar is not None:
            bar.update(1)

    def source():
        # `concurrency` requests in flight; the next starts when one finishes (closed loop, as a benchmark runs)
        pending = list(enumerate(ys))
        running = []
        while pending or running:
            while pending and len(running) < concurrency:
                i, Y = pending.pop(0)
                running.append(env.process(request(i, Y)))
            done = yield env.any_of(running)
            running = [p for p in running if p not in done]

    if trace is not None:
        trace.write("run", model="simulator", family="synthetic", executor="simulator", schedule=schedule,
                    decode=dict(block_size=C, gamma=gamma), model_config={}, machine="simulator", torch="",
                    time=0.0, simulator=dict(delta=model.delta, discount=model.discount, policy=model.policy,
                                             noise_sd=model.noise_sd, t_pass=t_pass, r=r, seed=seed))
    env.process(source())
    env.run()
    if bar is not None:
        bar.close()
    return DecodeResult(schedule, [r_ for r_ in results if r_ is not None], model.profile.nbar)
