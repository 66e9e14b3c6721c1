"""Position-level model of a block's denoising: predict α of a schedule from Native runs only.

A Native block of n passes is described per position i by its *first-accept pass* a_i ∈ {1..n} (−1: never accepted
before commit) and whether that first-accepted token is the committed one (``kept``), exactly the optional
``accept_pass`` / ``kept`` lists of a trace's block events. Its *settle time* is s_i = a_i when kept, else n (a
revised position settles only when the block does). Under masked diffusion every acceptance is kept and n = max a_i.

Warm-up. A block that is the warm-up block while its predecessor is current advances a clock c (in Native passes):
each warm-up step adds δ·g, δ < 1 because the step conditions on an uncommitted predecessor, with

    g = 1                                   discount="constant"   (every warm-up step is worth the same)
    g = readiness of the predecessor         discount="readiness"  (a step that sees a more settled predecessor
        (fraction of its positions accepted                            is worth more; δ is then the worth of a step
        on the passes before this step)                                over a fully settled predecessor)

Promotion (the predecessor commits) with the whole sampler state kept (OBA, FlowBlock; policy="keep_all"):

    n' = max(1, n − c)        passes as the current block;   a'_i = max(0, ⌈a_i − c⌉)  (0 = accepted at promotion)

With the tokens kept but the clock reset (Keep Tokens on a uniform-state model; policy="keep_tokens"): the positions
settled by c, a fraction φ, are retained and the rest restart. Two rules bracket it:

    token_rule="count":  n' = max(1, n (1 − φ))     passes scale with the positions still to settle (upper bound)
    token_rule="max":    n' = max(1, max_{i not retained} s_i)  the unsettled positions restart their own clocks
                                                                (lower bound on the saving)

(On masked diffusion the tokens are the whole state, so Keep Tokens is OBA there; use keep_all.)

α of a schedule = (current-block passes saved per warm-up step) × (warm-up steps per predecessor pass): every pass
under OBA, only the passes after the readiness gate γ under FlowBlock. `predict_alpha` simulates chains of blocks
drawn from the Native profile, sums F and K and fits α with Eq. (6), exactly as the fit is done on real counters;
`calibrate_delta` finds the δ that reproduces a measured α on one schedule, to predict the others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from scipy.optimize import brentq

from dblock.simulator import oba
from dblock.simulator.dists import Dist, stochastic_round

SCHEDULES = ("native", "oba", "flowblock")
POLICIES = ("keep_all", "keep_tokens")
DISCOUNTS = ("constant", "readiness")


@dataclass
class NativeBlock:
    """One block decoded alone: `need` passes (continuous; n = round(need) for integer runs) and per position
    the first-accept time (continuous, in passes; np.inf = never accepted before commit) and `kept`."""

    need: float
    first: np.ndarray          # (C,) first-accept time in passes, 1 <= first <= need, or inf
    kept: np.ndarray           # (C,) bool

    @property
    def size(self) -> int:
        return int(self.first.size)

    @property
    def settle(self) -> np.ndarray:
        """s_i: first-accept time when kept, else the block's end (a revised position settles at commit)."""
        return np.where(self.kept & np.isfinite(self.first), self.first, self.need)

    def readiness_after(self, j: float, shift: float = 0.0) -> float:
        """Fraction of positions accepted after j passes as current, the clock already advanced by `shift`."""
        return float(np.mean(self.first - shift <= j))


class Profile:
    """Where Native blocks come from: `sample(rng) -> NativeBlock`, plus the Native mean passes n̄."""

    C: int

    def sample(self, rng: np.random.Generator) -> NativeBlock:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def nbar(self) -> float:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class ParametricProfile(Profile):
    """Synthetic Native blocks: passes ~ `passes` (a Dist, continuous), settle fractions u_i ~ Beta(shape, 1)
    (P(u <= x) = x^shape: shape > 1 = few positions early), the last position exactly at the block's end;
    each first acceptance is kept with probability `kept_frac` (1 for masked diffusion)."""

    C: int = 32
    passes: Dist = field(default_factory=lambda: Dist("gamma", (12.0, 0.3)))
    shape: float = 1.0
    kept_frac: float = 1.0

    def __post_init__(self):
        self.passes = Dist.parse(self.passes)
        if self.C <= 0:
            raise ValueError(f"C={self.C}: block size must be positive")
        if self.shape <= 0:
            raise ValueError(f"shape={self.shape}: must be positive")
        if not 0.0 <= self.kept_frac <= 1.0:
            raise ValueError(f"kept_frac={self.kept_frac}: must lie in [0, 1]")

    def sample(self, rng: np.random.Generator) -> NativeBlock:
        need = max(1.0, float(self.passes.sample(rng)))
        u = rng.random(self.C) ** (1.0 / self.shape)
        u[np.argmax(u)] = 1.0                       # the block ends when its last position is accepted
        first = np.maximum(1.0, u * need)          # nothing is accepted before the first pass
        kept = rng.random(self.C) < self.kept_frac
        kept[np.argmax(u)] = True
        return NativeBlock(need, first, kept)

    @property
    def nbar(self) -> float:
        # E[max(1, passes)]: the clip matters only when passes can fall below one
        if self.passes.kind == "const":
            return max(1.0, self.passes.mean)
        rng = np.random.default_rng(12345)
        return float(np.mean(np.maximum(1.0, self.passes.sample(rng, 200_000))))

    @staticmethod
    def matching(C: int, nbar: float, first_pass_frac: float, kept_frac: float = 1.0, cv: float = 0.3
                 ) -> "ParametricProfile":
        """A profile with mean passes n̄ and `first_pass_frac` of positions accepted on the first pass
        (shape from (1/n̄)^shape = first_pass_frac), e.g. the paper's Figure 2: 5.4% for Native DiffusionGemma."""
        if not 0.0 < first_pass_frac < 1.0:
            raise ValueError(f"first_pass_frac={first_pass_frac}: must lie in (0, 1)")
        shape = math.log(first_pass_frac) / math.log(1.0 / nbar) if nbar > 1 else 1.0
        return ParametricProfile(C=C, passes=Dist("gamma", (nbar, cv)), shape=shape, kept_frac=kept_frac)


@dataclass
class EmpiricalProfile(Profile):
    """Native blocks resampled from traces (block events with ``accept_pass`` and ``kept``)."""

    blocks: list[NativeBlock]
    C: int = 0

    def __post_init__(self):
        if not self.blocks:
            raise ValueError("EmpiricalProfile: no Native blocks with per-position accept_pass lists")
        self.C = self.C or self.blocks[0].size

    def sample(self, rng: np.random.Generator) -> NativeBlock:
        return self.blocks[int(rng.integers(len(self.blocks)))]

    @property
    def nbar(self) -> float:
        return float(np.mean([b.need for b in self.blocks]))

    @staticmethod
    def from_block_events(blocks: Iterable[dict]) -> "EmpiricalProfile":
        """Build from trace block events of a Native run: ``passes``, ``accept_pass`` (1-based pass of first
        acceptance; 0 = accepted at promotion, impossible under Native; −1 = never accepted before commit) and
        ``kept``. Events without ``accept_pass`` are skipped; prompt-tail positions should be excluded by the
        writer (they are never decoded)."""
        out, C = [], 0
        for ev in blocks:
            acc = ev.get("accept_pass")
            C = max(C, int(ev.get("size") or 0), len(acc or ()))  # the block size, not a prompt-tail block's rows
            if acc is None:
                continue
            n = float(ev["passes"])
            a = np.asarray(acc, dtype=float)
            if a.size == 0 or n < 1:
                continue
            first = np.where(a < 0, np.inf, np.maximum(a, 1.0))
            kept = np.asarray(ev.get("kept", [True] * a.size), dtype=bool)
            if kept.size != a.size:
                raise ValueError(f"block event {ev.get('request')}/{ev.get('block')}: kept has {kept.size} "
                                 f"entries for {a.size} accept_pass entries")
            out.append(NativeBlock(n, first, kept))
        return EmpiricalProfile(out, C)


@dataclass
class Promoted:
    """A block as it becomes current: passes it needs, per-position accept passes (0 = at promotion), kept."""

    passes: int
    accept: np.ndarray     # (C,) int: 0 accepted at promotion, 1..passes, −1 never before commit
    kept: np.ndarray       # (C,) bool
    need: float            # the continuous need (for expectations)
    warmup_steps: int


@dataclass
class PositionModel:
    """The block dynamics: Native blocks from `profile`, warm-up at rate δ, a promotion policy.

    `noise_sd` adds N(0, noise_sd²) to each warm-up step's saving (mean unchanged), for the "saving per step α with
    noise" of the SimPy model. `integer=False` keeps passes continuous (expectations without rounding noise).
    """

    profile: Profile
    delta: float = 0.5
    discount: str = "constant"
    policy: str = "keep_all"
    token_rule: str = "count"
    noise_sd: float = 0.0
    integer: bool = True

    def __post_init__(self):
        if self.discount not in DISCOUNTS:
            raise ValueError(f"discount={self.discount!r}: allowed {', '.join(DISCOUNTS)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: allowed {', '.join(POLICIES)}")
        if self.token_rule not in ("count", "max"):
            raise ValueError(f"token_rule={self.token_rule!r}: allowed count, max")
        if self.delta < 0:
            raise ValueError(f"delta={self.delta}: must be >= 0")

    def step_gain(self, predecessor: Promoted | None, pred_pass: int, rng: np.random.Generator) -> float:
        """Clock advance of one warm-up step taken on the predecessor's pass `pred_pass` (1-based)."""
        g = 1.0
        if self.discount == "readiness" and predecessor is not None:
            acc = predecessor.accept
            # what the warm-up block sees on this pass: the predecessor after pred_pass − 1 passes
            g = float(np.mean((acc >= 0) & (acc <= pred_pass - 1)))
        gain = self.delta * g
        if self.noise_sd > 0:
            gain += self.noise_sd * rng.standard_normal()
        return gain

    def promote(self, block: NativeBlock, clock: float, warmup_steps: int, rng: np.random.Generator) -> Promoted:
        """The block becomes current after its warm-up advanced it by `clock` Native passes."""
        if self.policy == "keep_all" or clock == 0.0:
            need = max(1.0, block.need - clock)
            first = block.first - clock
            retained = np.zeros(block.size, dtype=bool)
        else:  # keep_tokens: settled positions stay, the clock restarts
            retained = block.settle <= clock
            if self.token_rule == "count":
                need = max(1.0, block.need * (1.0 - float(np.mean(retained))))
            else:
                rest = block.settle[~retained]
                need = max(1.0, float(rest.max()) if rest.size else 1.0)
            first = np.where(retained, 0.0, block.first)
        n = stochastic_round(need, rng) if self.integer else need
        n_int = max(1, int(math.ceil(n - 1e-9)))
        acc = np.where(np.isfinite(first), np.clip(np.ceil(first - 1e-9), 0, n_int), -1).astype(int)
        acc[retained] = 0
        return Promoted(passes=n, accept=acc, kept=block.kept.copy(), need=need,
                        warmup_steps=warmup_steps)


def gate_pass(block: Promoted, gamma: float) -> int:
    """FlowBlock: the number of passes the current block takes before its readiness (fraction of positions
    accepted) reaches γ; warm-up steps of the next block start on the following pass."""
    if gamma <= 0:
        return 0
    acc = block.accept
    n = int(math.ceil(block.passes))
    for j in range(0, n + 1):
        if np.mean((acc >= 0) & (acc <= j)) >= gamma:
            return j
    return n


def simulate_chain(model: PositionModel, schedule: str, n_blocks: int, rng: np.random.Generator,
                   gamma: float = 0.9) -> list[Promoted]:
    """Decode one response of `n_blocks` blocks: block k+1 warms up while block k is current.

    Under "oba" every pass of block k is a warm-up step of block k+1; under "flowblock" only the passes after block
    k reaches readiness γ; under "native" none. The last block drops its warm-up block. Blocks are drawn from one
    stream and rounding/noise from another, so two schedules run with the same `rng` seed see the same blocks.
    With continuous passes (model.integer False) a fractional last pass counts as that fraction of a step.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: allowed {', '.join(SCHEDULES)}")
    block_rng = np.random.default_rng(int(rng.integers(2**62)))
    noise_rng = np.random.default_rng(int(rng.integers(2**62)))
    out: list[Promoted] = []
    nxt = model.profile.sample(block_rng)
    clock, steps = 0.0, 0
    for k in range(n_blocks):
        cur = model.promote(nxt, clock, steps, noise_rng)
        out.append(cur)
        if k == n_blocks - 1:
            break
        nxt = model.profile.sample(block_rng)
        clock, steps = 0.0, 0
        if schedule != "native":
            start = gate_pass(cur, gamma) if schedule == "flowblock" else 0
            n_full = int(math.floor(cur.passes + 1e-9))
            frac = cur.passes - n_full
            for j in range(start + 1, n_full + 1):
                clock += model.step_gain(cur, j, noise_rng)
                steps += 1
            if frac > 1e-9 and n_full + 1 > start:
                clock += frac * model.step_gain(cur, n_full + 1, noise_rng)
                steps += 1
            clock = max(0.0, clock)
    return out


def paired_passes(block: Promoted, schedule: str, gamma: float) -> float:
    """Passes of this block, as current, that carry a warm-up block: all under OBA, those after the gate under
    FlowBlock (the last block too: a decoder does not know a block is the last before it commits)."""
    if schedule == "oba":
        return float(block.passes)
    if schedule == "flowblock":
        return float(block.passes) - min(float(block.passes), gate_pass(block, gamma))
    return 0.0


@dataclass
class AlphaPrediction:
    schedule: str
    alpha: float             # fitted with Eq. (6) on the simulated counters, as on real runs
    alpha_product: float     # δ-saving per warm-up step × warm-up steps per predecessor pass (the product)
    saved_per_step: float
    steps_per_pred_pass: float
    paired_frac: float       # share of denoising passes that carry a warm-up block
    nbar: float
    F: float
    K: int
    R: int

    def as_dict(self) -> dict:
        return dict(vars(self))


def predict_alpha(model: PositionModel, schedule: str, blocks_per_response: Dist | Sequence[int] | str = "const:8",
                  responses: int = 400, gamma: float = 0.9, seed: int = 0) -> AlphaPrediction:
    """Predict α of `schedule` from the Native profile: simulate `responses` chains and fit Eq. (6).

    Common random numbers (one seed) make the prediction a smooth function of δ, which `calibrate_delta` needs.
    """
    rng = np.random.default_rng(seed)
    if isinstance(blocks_per_response, (str, Dist)):
        kdist = Dist.parse(blocks_per_response)
        ks = [max(1, int(round(kdist.sample(rng)))) for _ in range(responses)]
    else:
        ks = [int(k) for k in blocks_per_response]
    F = F_native = 0.0
    saved, steps, pred_passes, paired = 0.0, 0, 0.0, 0.0
    for i, K in enumerate(ks):
        chain = simulate_chain(model, schedule, K, np.random.default_rng([seed, i]), gamma=gamma)
        native = simulate_chain(model, "native", K, np.random.default_rng([seed, i]), gamma=gamma)
        for k, (b, nb) in enumerate(zip(chain, native)):
            F += b.passes
            F_native += nb.passes
            paired += paired_passes(b, schedule, gamma)
            if k > 0:
                saved += nb.need - b.need
                steps += b.warmup_steps
                pred_passes += chain[k - 1].passes
    K_tot, R = sum(ks), len(ks)
    # n̄ from the Native run of the very same blocks (common random numbers): no sampling noise in the fit
    nbar = F_native / K_tot
    try:
        alpha = oba.fit_alpha_counters(F, K_tot, R, nbar, list(ks))[0]
    except ValueError:
        alpha = float("nan")
    sps = saved / steps if steps else 0.0
    spp = steps / pred_passes if pred_passes else 0.0
    return AlphaPrediction(schedule, alpha, sps * spp, sps, spp, paired / F if F else 0.0, nbar, F, K_tot, R)


def calibrate_delta(profile: Profile, schedule: str, alpha_measured: float, blocks_per_response="const:8",
                    responses: int = 300, gamma: float = 0.9, discount: str = "constant", policy: str = "keep_all",
                    seed: int = 0, delta_max: float = 4.0) -> float:
    """The δ at which the predicted α of `schedule` equals `alpha_measured` (Brent on [0, delta_max]).

    Passes are kept continuous here so the predicted α is a continuous, increasing function of δ.
    """
    def f(d: float) -> float:
        m = PositionModel(profile, delta=d, discount=discount, policy=policy, integer=False)
        return predict_alpha(m, schedule, blocks_per_response, responses, gamma, seed).alpha - alpha_measured

    # scan for a bracket: past some δ the implied α leaves [−1/2, 1) and Eq. (6) has no root (NaN)
    prev_d, prev_v = 0.0, f(0.0)
    if prev_v > 0:
        raise ValueError(f"calibrate_delta: alpha={alpha_measured} is below what delta = 0 gives on this profile "
                         f"({prev_v + alpha_measured:.3f})")
    for d in np.linspace(0.0, delta_max, 17)[1:]:
        v = f(float(d))
        if math.isnan(v) or v >= 0:
            if math.isnan(v):   # refine towards the last finite point
                lo_, hi_ = prev_d, float(d)
                for _ in range(20):
                    mid = (lo_ + hi_) / 2
                    vm = f(mid)
                    if math.isnan(vm):
                        hi_ = mid
                    elif vm >= 0:
                        return float(brentq(f, prev_d, mid, xtol=1e-4))
                    else:
                        lo_, prev_d = mid, mid
                break
            return float(brentq(f, prev_d, float(d), xtol=1e-4))
        prev_d, prev_v = float(d), v
    raise ValueError(f"calibrate_delta: alpha={alpha_measured} is above what delta in [0, {delta_max}] gives on "
                     "this profile")


def gamma_for_paired_fraction(model: PositionModel, target: float, blocks_per_response="const:8",
                              responses: int = 200, seed: int = 0) -> float:
    """The FlowBlock gate γ whose predicted share of paired passes equals `target` (e.g. the paper's 7.8%)."""
    def f(g: float) -> float:
        return predict_alpha(model, "flowblock", blocks_per_response, responses, g, seed).paired_frac - target

    lo, hi = f(0.0), f(1.0)
    if not (hi <= 0 <= lo):
        raise ValueError(f"gamma_for_paired_fraction: {target} is outside [{hi + target:.3f}, {lo + target:.3f}]")
    return float(brentq(f, 0.0, 1.0, xtol=1e-4))
