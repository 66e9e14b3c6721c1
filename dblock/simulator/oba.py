"""Closed forms of One Block Ahead (OBA): the pass recurrence, its fixed point, break-even and the alpha fit.

Everything here is a plain function of numbers (no SimPy, no traces). Equation numbers are those of the One Block
Ahead paper ; docs/algorithms.md §6 writes its equations out.

Symbols (per benchmark or population of requests):

    n̄      mean denoising passes per block under Native(C)                         (passes)
    alpha   current-block passes saved per pass the predecessor spends as current     (dimensionless, 0 <= α < 1)
    n_k     passes block k spends as the current block under a concurrent schedule   (passes)
    r       the schedule's pass over Native(C)'s pass on the same rows (= T_den ratio at batch 1)  (dimensionless)
    Y, K, F, R   generated tokens, blocks, denoising passes, responses (sums over requests)
    C       block size (positions)

Recurrence (Eq. 3):      n_{k+1} = n̄ − α n_k,  n_1 = n̄
Fixed point:             n* = n̄ / (1 + α)
Transient:               n_k = n* (1 − (−α)^k)           (so n_1 = n*(1+α) = n̄; |n_k − n*| = α^{k−1} |n̄ − n*|)
Throughput at n*:        TPS ratio = (1 + α) / r;         break-even: α > r − 1
Eq. 2:                   TPF = ΣY / Σ(K + F),  TPS = ΣY / (F · T_den)
Eq. 4:                   K ≈ Y/C + R/2                    (the partial last block counted as half)
Eq. 5 (per response of K_i blocks):  Σ_k n_k = n* [K_i + α (1 − (−α)^{K_i}) / (1 + α)]
Eq. 6 (summed, (−α)^{K_i} neglected): F = n̄/(1+α) · (K + R α/(1+α)),  solved for α on [−1/2, 1)
Naive:                   ᾱ = n̄/n − 1 with n = F/K (understates α: every first block pays n̄)
Identities (Appendix D): TPS ratio = (n̄/n)·ρ/(r·β), TPF ratio = ρ (n̄ + 1)/(n + 1), ρ = ratio of tokens per block,
                         β = batch-composition factor (1 at batch 1); n̄/n = (1 + α)·φ, φ = transient_factor.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from scipy.optimize import brentq

ALPHA_LO = -0.5   # Appendix D: Eq. 6 is solved on [−1/2, 1)
ALPHA_HI = 1.0


def fixed_point(nbar: float, alpha: float) -> float:
    """n* = n̄ / (1 + α): the passes per block the recurrence of Eq. (3) settles to (passes)."""
    _check_alpha(alpha)
    return nbar / (1.0 + alpha)


def transient(nbar: float, alpha: float, k: int | np.ndarray) -> float | np.ndarray:
    """Expected passes of the k-th block (1-based) of a response: n_k = n*(1 − (−α)^k), Eq. (3) unrolled.

    n_1 = n̄ (the first block has no predecessor), n_2 = n̄(1 − α), ... oscillating towards n* geometrically.
    """
    _check_alpha(alpha)
    k = np.asarray(k)
    if np.any(k < 1):
        raise ValueError(f"block index k={k}: must be >= 1 (1-based)")
    out = fixed_point(nbar, alpha) * (1.0 - (-alpha) ** k)
    return float(out) if out.ndim == 0 else out


def tps_ratio(alpha: float, r: float) -> float:
    """Throughput of a schedule over Native(C) at the fixed point: (1 + α) / r (Section 3.3).

    Passes per block fall by 1 + α, each pass costs r times as much.
    """
    if r <= 0:
        raise ValueError(f"r={r}: the pass-cost ratio must be positive")
    return (1.0 + alpha) / r


def break_even(r: float) -> float:
    """The α above which a schedule of pass-cost ratio r raises throughput: α > r − 1 (Section 3.3)."""
    if r <= 0:
        raise ValueError(f"r={r}: the pass-cost ratio must be positive")
    return r - 1.0


def pays(alpha: float, r: float) -> bool:
    """The break-even verdict: does the schedule raise TPS at its fixed point (α > r − 1)?"""
    return alpha > break_even(r)


def tpf(Y: float, K: float, F: float) -> float:
    """Eq. (2): tokens per forward, ΣY / ΣQ with Q = F + K (1 prefill + K−1 appends + F denoising passes)."""
    return Y / (K + F)


def tps(Y: float, F: float, t_den: float) -> float:
    """Eq. (2): decode tokens per second, ΣY / (F · T_den), T_den in seconds per denoising pass."""
    return Y / (F * t_den)


def blocks_from_tokens(Y: float, C: int, R: float) -> float:
    """Eq. (4): K ≈ Y/C + R/2 — blocks from generated tokens, the partially filled last block counted as half."""
    if C <= 0:
        raise ValueError(f"C={C}: block size must be positive")
    return Y / C + R / 2.0


def expected_passes(nbar: float, alpha: float, K: float, R: float) -> float:
    """Right-hand side of Eq. (6): F = n̄/(1+α) · (K + R α/(1+α)), the (−α)^{K_i} terms neglected."""
    return nbar / (1.0 + alpha) * (K + R * alpha / (1.0 + alpha))


def expected_passes_exact(nbar: float, alpha: float, blocks_per_response: Sequence[int]) -> float:
    """Eq. (5) summed without approximation: Σ_i n* [K_i + α(1 − (−α)^{K_i})/(1 + α)].

    This is the exact expectation of F under the recurrence; Eq. (6) drops the (−α)^{K_i} term, which biases the
    fit on responses of few blocks (Appendix D).
    """
    Ki = np.asarray(blocks_per_response, dtype=float)
    ns = nbar / (1.0 + alpha)
    return float(np.sum(ns * (Ki + alpha * (1.0 - (-alpha) ** Ki) / (1.0 + alpha))))


def _exact_on_grid(nbar: float, alphas: np.ndarray, blocks_per_response) -> np.ndarray:
    """`expected_passes_exact` at every α of `alphas` at once (responses grouped by their block count)."""
    ks, counts = np.unique(np.asarray(blocks_per_response, dtype=float), return_counts=True)
    a = np.asarray(alphas, dtype=float)[:, None]
    terms = ks[None, :] + a * (1.0 - (-a) ** ks[None, :]) / (1.0 + a)
    return nbar / (1.0 + a[:, 0]) * (terms @ counts.astype(float))


def _solve_single_root(f, what: str, f_grid=None) -> float:
    """The single root of f on [−1/2, 1): a grid scan for sign changes, then Brent's method in each bracket.
    `f_grid(alphas)`: f at many α in one call (vectorised), else f is called at each grid point."""
    hi = ALPHA_HI - 1e-9
    grid = np.linspace(ALPHA_LO, hi, 3001)
    vals = np.asarray(f_grid(grid), dtype=float) if f_grid is not None else np.array([f(a) for a in grid])
    zero = vals[:-1] == 0.0
    change = ~zero & (vals[:-1] * vals[1:] < 0)
    roots: list[float] = []
    for i in np.nonzero(zero | change)[0]:
        roots.append(float(grid[i]) if zero[i] else float(brentq(f, grid[i], grid[i + 1], xtol=1e-12)))
    if vals[-1] == 0.0:
        roots.append(float(grid[-1]))
    if len(roots) != 1:
        found = ", ".join(f"{x:.4f}" for x in roots) or "none"
        raise ValueError(f"{what}: no single root on [-1/2, 1) (roots: {found})")
    return roots[0]


def fit_alpha(F: float, K: float, R: float, nbar: float) -> float:
    """Fit α from aggregate counters by solving Eq. (6) on [−1/2, 1) with scipy's Brent root finder.

    F: denoising passes, K: blocks (measured, or Eq. 4), R: responses, n̄: Native(C) passes per block, all summed
    over the same requests. Raises ValueError when Eq. (6) has no root or several roots there (e.g. K == R:
    one-block responses carry no information about α).
    """
    for name, v in (("F", F), ("K", K), ("R", R), ("nbar", nbar)):
        if not v > 0:
            raise ValueError(f"fit_alpha: {name}={v} must be positive")
    if K < R:
        raise ValueError(f"fit_alpha: K={K} blocks < R={R} responses (every response has at least one block)")
    if K == R:
        # Eq. (6) becomes F = n̄R(1+2α)/(1+α)², tangent to F = n̄R at α = 0: one-block responses carry no α
        raise ValueError(f"fit_alpha(F={F}, K={K}, R={R}, nbar={nbar}): no single root on [-1/2, 1) "
                         "(every response has one block, so no block was ever promoted)")
    return _solve_single_root(lambda a: expected_passes(nbar, a, K, R) - F,
                              f"fit_alpha(F={F}, K={K}, R={R}, nbar={nbar})",
                              f_grid=lambda g: expected_passes(nbar, g, K, R) - F)


def fit_alpha_exact(F: float, blocks_per_response: Sequence[int], nbar: float) -> float:
    """Fit α keeping the (−α)^{K_i} terms of Eq. (5) (needs per-response block counts, which traces have)."""
    Ki = np.asarray(blocks_per_response)
    if Ki.size == 0 or np.any(Ki < 1):
        raise ValueError("fit_alpha_exact: blocks_per_response must be a non-empty list of counts >= 1")
    return _solve_single_root(lambda a: expected_passes_exact(nbar, a, Ki) - F,
                              f"fit_alpha_exact(F={F}, R={Ki.size}, nbar={nbar})",
                              f_grid=lambda g: _exact_on_grid(nbar, g, Ki) - F)


def fit_alpha_counters(F: float, K: float, R: float, nbar: float,
                       blocks_per_response: Optional[Sequence[int]] = None) -> tuple:
    """(α, method): Eq. (6) on the aggregate counters; when Eq. (6) has no single root on [−1/2, 1) and the
    per-response block counts are known, Eq. (5) exactly (`fit_alpha_exact`), method "Eq. 5".

    Eq. (6) drops the (−α)^{K_i} terms. On responses of two or three blocks with α near 1 those terms are large: the
    second block of a response costs n̄(1 − α), far below Eq. (6)'s n̄/(1 + α), so the passes measured fall under
    every value Eq. (6) can reach and it has no root at all. Eq. (5) keeps the terms and still fits. Raises the
    Eq. (6) ValueError when there is nothing else to try, or Eq. (5)'s own when it fails too."""
    try:
        return fit_alpha(F, K, R, nbar), "Eq. 6"
    except ValueError:
        if blocks_per_response is None or K == R:
            raise
    return fit_alpha_exact(F, blocks_per_response, nbar), "Eq. 5"


def naive_alpha(nbar: float, F: float, K: float) -> float:
    """ᾱ = n̄/n − 1 with n = F/K the mean passes over all blocks (Appendix D).

    It understates α because every first block pays n̄ and gains nothing from promotion.
    """
    return nbar / (F / K) - 1.0


def expected_naive_alpha(alpha: float, blocks_per_response: float) -> float:
    """What ᾱ converges to under Eq. (6) when responses average K/R blocks: (1+α)/(1 + (R/K) α/(1+α)) − 1.

    Below α for every α > 0 and K/R < ∞, tending to α as responses get long — the understatement in closed form.
    """
    x = 1.0 / blocks_per_response
    return (1.0 + alpha) / (1.0 + x * alpha / (1.0 + alpha)) - 1.0


def tps_ratio_identity(nbar_over_n: float, rho: float, r: float, beta: float = 1.0) -> float:
    """TPS(schedule)/TPS(Native) = (n̄/n)·ρ/(r·β) (Appendix D, with the batch-composition factor; docs/counters.md).

    n̄/n: ratio of passes per block, ρ: ratio of tokens per block Y/K, r: the schedule's pass over the baseline's pass
    on the same rows, β: the baseline pass's cost per request at the schedule's batch composition over at the
    baseline's own (1 at batch 1, or whenever both runs batch the same requests alike). At batch 1 r is the ratio of
    T_den and β = 1, the paper's form (n̄/n)(ρ/r).
    """
    if r <= 0 or beta <= 0:
        raise ValueError(f"r={r}, beta={beta}: must be positive")
    return nbar_over_n * rho / (r * beta)


def transient_factor(alpha: float, K: float, R: float) -> float:
    """φ = 1/(1 + (R/K)·α/(1+α)): n̄/n = (1 + α)·φ under Eq. (6). The first block of each response gains nothing
    from promotion, so a finite-length run sits below the fixed point's 1 + α; φ → 1 as K/R → ∞."""
    if K <= 0 or R <= 0:
        raise ValueError(f"K={K}, R={R}: must be positive")
    return 1.0 / (1.0 + (R / K) * alpha / (1.0 + alpha))


def tpf_ratio_identity(nbar: float, n: float, rho: float = 1.0) -> float:
    """TPF(schedule)/TPF(Native) = ρ (n̄ + 1)/(n + 1): per block n denoising passes plus one prefill or append pass."""
    return rho * (nbar + 1.0) / (n + 1.0)


def _check_alpha(alpha: float) -> None:
    if not (ALPHA_LO <= alpha < ALPHA_HI):
        raise ValueError(f"alpha={alpha}: must lie in [-1/2, 1) for the recurrence to contract")


# The paper's own rows (One Block Ahead, DiffusionGemma on one GB300, batch 1, means over 10 benchmarks), from its
# text: Tables 1–3 were lost in extraction, so each value below is quoted from a sentence of Sections 4.2–4.3.
# tps_change is the measured TPS change over Native(C=256); alpha None = not a warm-up schedule (α = 0 there).
PAPER_ROWS = [
    # name,          alpha, r,    tps_change, source sentence
    ("OBA (Keep All)", 0.54, 1.26, +0.163, "TPS by 16.3% ... each denoising pass costs 1.26x"),
    ("Drop Time",      0.41, 1.26, +0.077, "adding the signal raises alpha to 0.41 and TPS by 7.7%"),
    ("Keep Signal",    0.32, 1.26, +0.011, "Keep Signal reaches alpha=0.32 ... +1.1%"),
    ("No Accept",      0.32, 1.26, +0.012, "No Accept and Keep Signal both reach alpha=0.32 ... +1.2%"),
    ("Keep Tokens",    0.25, 1.26, -0.028, "alpha=0.25, below the break-even r-1=0.26 ... -2.8%"),
    ("No Signal",      0.02, 1.26, -0.199, "No Signal lowers alpha to 0.02 ... -19.9%"),
    ("Dense Mask",     0.38, 1.70, -0.209, "alpha=0.38 ... costs 1.70x ... falls 20.9% below"),
    ("FlowBlock (W=2)", 0.09, 1.03, +0.045, "r to 1.03 ... alpha to 0.09 ... TPS by 4.5%"),
    ("Native (C=512)", 0.0, 1.84, -0.414, "costs roughly 1.84x ... 41.4% below Native (C=256)"),
]
