"""Decision margins (docs/algorithms.md §5): how far may optimized logits ẑ move from the dense logits z before a decode decision
can change?

Everything is computed on the *masked* logits the step rules use: the MASK id is excluded from the argmax and from
the softmax (`dblock.decoding.samplers.predict`), so ‖ẑ − z‖∞ is taken over real tokens only. Margins are fp64.

Threshold rule (docs/algorithms.md §2.1: commit at p₁ > τ, or p₁ >= τ with `DecodeConfig.threshold_inclusive`), per
live row i with p = softmax(z_i) over real tokens, x̂ = argmax, p₁ = p[x̂]:

  top gap        a   = (z₁ − z₂) / 2              an ∞-norm perturbation ε moves z₁ − z₂ by at most 2ε
  slack          s   = |log p₁ − log τ| / 2        log p₁ = z₁ − logsumexp(z) moves by at most 2ε
  exact slack    s*  = |logit p₁ − logit τ| / 2    logit p₁ = z₁ − logsumexp(z_{j≠1}) moves by at most 2ε, and
                                                  exactly 2ε for δ = (−ε on x̂, +ε elsewhere): the tight bound
  fallback       c   = (log p⁽¹⁾ − log p⁽²⁾) / 4   when no row clears τ the most confident row commits; two rows'
                                                  log-confidences move by up to 2ε *each*, so their gap by 4ε
  exact fallback c*  = (logit p⁽¹⁾ − logit p⁽²⁾) / 4   (p⁽¹⁾ ≥ p⁽²⁾ the two largest confidences of the block)

  Γ  = min(a, s)          (and min(·, c) on every row of a pass the fallback decides)      -- docs/algorithms.md §5's margin
  Γ* = the exact decision radius, split over rows case by case (`threshold_margin`): an uncommitted row's token
       is not a decision (it stays MASK), the fallback can rescue a row that drops below τ, and the fallback's
       winner rising above τ changes nothing; a commit-all pass only has the a terms.

min Γ ≤ min Γ* over every block (s ≤ s*: 1 − p₁ ≤ 1 − τ when p₁ ≥ τ and the reverse when not). Both are
*sufficient*: ‖ẑᵢ − zᵢ‖∞ < Γᵢ for every live row of a block ⇒ same tokens and same commit set (the hypothesis is
block-wide: the cross-position terms couple rows). Γ* is also *tight*: min over the block of Γ* is the smallest
∞-norm perturbation that can change the decision, so one just above it can (the constructions are in
`tests/equivalence/test_margins.py`). docs/algorithms.md §5 writes the fallback term as *half* the log-confidence gap; that is not
sufficient (two rows move toward each other by up to 4ε; the tests hold a counterexample), so this module uses a
quarter, and the exact version in logit space.

Fixed-k rule (docs/algorithms.md §2.2): the k most confident rows commit; margin = min(a on committed rows, (logit p⁽ᵏ⁾ − logit
p⁽ᵏ⁺¹⁾)/4) — the same argument as the fallback (k = 1 is the fallback).

Entropy-bound rule (docs/algorithms.md §2.3) has no closed-form margin (the proposal is a multinomial draw); its analogue is a
decision check under shared randomness: `entropy_bound_check` steps copies of the block with both logits and the
same generator state and compares the accepted set, the accepted tokens and the argmax canvas.

Decisions are made by the schedules in fp32; the margins are exact statements about real arithmetic. A row whose Γ
is below fp32 resolution (a confidence within ~1e-7 of τ) can flip on rounding alone; such rows are margin
violations for every executor and are reported as such.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional

import torch

NEG = float("-inf")


def tau32(tau: float) -> float:
    """The threshold as the rules compare it: `conf > tau` (or `>=`) with conf fp32 rounds tau to fp32."""
    return float(torch.tensor(tau, dtype=torch.float32))


def masked64(logits: torch.Tensor, mask_id: Optional[int]) -> torch.Tensor:
    """(n, V) -> fp64 copy with the MASK column at -inf (MASK never predicted, never in the softmax)."""
    z = logits.detach().to(torch.float64).cpu().clone()
    if mask_id is not None:
        z[:, mask_id] = NEG
    return z


def delta_inf(z_opt: torch.Tensor, z_ref: torch.Tensor, mask_id: Optional[int]) -> torch.Tensor:
    """(n,) ‖ẑ − z‖∞ over real tokens (the MASK column excluded), fp64."""
    d = (z_opt.detach().double().cpu() - z_ref.detach().double().cpu()).abs()
    if mask_id is not None:
        d[:, mask_id] = 0.0
    return d.max(dim=-1).values if d.shape[0] else torch.zeros(0, dtype=torch.float64)


@dataclass
class Margin:
    """Per live row of one block and one pass (all (n,) fp64 unless noted)."""

    gamma: torch.Tensor          # Γ: docs/algorithms.md §5 sufficient margin
    gamma_exact: torch.Tensor    # Γ*: exact (tight) decision radius
    top_gap: torch.Tensor        # a
    slack: torch.Tensor          # s (log space) — +inf where irrelevant (commit-all / fixed-k)
    slack_exact: torch.Tensor    # s* (logit space)
    commit: torch.Tensor         # (n,) bool: the decision under z (what Γ protects)
    tokens: torch.Tensor         # (n,) int64 argmax under z
    fallback: bool = False       # the at-least-one fallback decided this pass
    cross: float = math.inf      # c: quarter gap of the two largest log-confidences (fallback / fixed-k)
    cross_exact: float = math.inf  # c*


def _conf(z: torch.Tensor):
    """fp64 masked logits (n, V) -> tokens, z₁ − z₂ gap, log p₁, logit p₁."""
    n = z.shape[0]
    if z.shape[1] >= 2:
        top2, idx = z.topk(2, dim=-1)
        gap = top2[:, 0] - top2[:, 1]
    else:
        top2, idx = z.topk(1, dim=-1)
        gap = torch.full((n,), math.inf, dtype=torch.float64)
    gap = torch.where(torch.isfinite(gap), gap, torch.full_like(gap, math.inf))
    lse = torch.logsumexp(z, dim=-1)
    logp = top2[:, 0] - lse
    others = z.clone()
    others.scatter_(1, idx[:, :1], NEG)
    logit = top2[:, 0] - torch.logsumexp(others, dim=-1)      # z₁ − lse(z_{j≠1}) = logit p₁ (+inf if V = 1)
    return idx[:, 0], gap, logp, logit


def threshold_margin(logits: torch.Tensor, mask_id: Optional[int], tau: float = 0.95,
                     commit_all: bool = False, inclusive: bool = False, quota: Optional[int] = None) -> Margin:
    """Margins of one block's live rows under the threshold rule (see the module docstring). A row clears τ when
    conf > τ, or conf >= τ with `inclusive` (`DecodeConfig.threshold_inclusive`, docs/algorithms.md §2.1); the two
    differ only at conf = τ exactly, where the margin is 0 either way.

    Γ* per row, with C the rows that clear τ and n the live rows (each case is sufficient row by row, and its
    minimum over the block is the exact radius):
      commit-all pass      a
      |C| >= 2             committed rows min(a, s*), the others s*
      |C| = 1 (row c)      R = max(s*_c, c*_c) with c*_c = (logit p_c − max_{j≠c} logit p_j)/4: row c min(a, R),
                           the others min(s*, R) — c may drop below τ and still win the fallback
      |C| = 0 (fallback w) row w min(a, c*), the others min(s*, c*) — w rising above τ changes nothing
      n = 1                a (the one row always commits)
    """
    return threshold_margin_rows(*_conf(masked64(logits, mask_id)), tau=tau, commit_all=commit_all,
                                 inclusive=inclusive, quota=quota)


def row_stats(z: torch.Tensor):
    """Decision logits (n, V) with the MASK column (and any banned id) at -inf, in any float dtype -> the per-row
    quantities every margin of this module is made of: (tokens, z₁ − z₂ gap, log p₁, logit p₁), each (n,), in z's
    dtype. `threshold_margin_rows` / `fixed_k_margin_rows` turn them into a block's margins; the Epoch executor's
    margin-gated refresh computes them for a whole call at once (docs/algorithms.md §4.7)."""
    return _conf(z)


def threshold_margin_rows(tok, gap, logp, logit, tau: float = 0.95, commit_all: bool = False,
                          inclusive: bool = False, quota: Optional[int] = None) -> Margin:
    """`threshold_margin` from the row quantities of `row_stats` (cast to fp64 here)."""
    gap, logp, logit = gap.double(), logp.double(), logit.double()
    n = gap.shape[0]
    a = gap / 2
    if commit_all:
        inf = torch.full((n,), math.inf, dtype=torch.float64)
        return Margin(a.clone(), a.clone(), a, inf, inf.clone(), torch.ones(n, dtype=torch.bool), tok)
    t = tau32(tau)
    lt = math.log(t)
    ltg = lt - math.log1p(-t) if t < 1.0 else math.inf   # log-odds of τ; τ = 1: no finite logit reaches it
    s = (logp - lt).abs() / 2
    s_exact = (logit - ltg).abs() / 2
    commit = logp >= lt if inclusive else logp > lt          # conf >= / > tau (in exact arithmetic)
    if quota is not None and n >= 1:
        return _quota_margin(commit, tok, a, s, s_exact, logp, logit, min(max(quota, 0), n))
    fallback = bool(n) and not bool(commit.any())
    gamma = torch.minimum(a, s)
    cross = cross_exact = math.inf
    if n == 1:                                               # the one row commits either way: only its token
        commit = torch.ones(1, dtype=torch.bool)
        gamma_exact = a.clone()
    elif int(commit.sum()) >= 2:
        gamma_exact = torch.where(commit, torch.minimum(a, s_exact), s_exact)
    elif int(commit.sum()) == 1:
        c = int(commit.nonzero()[0, 0])
        others = logit.clone()
        others[c] = -math.inf
        R = max(float(s_exact[c]), float(logit[c] - others.max()) / 4)
        gamma_exact = s_exact.clamp(max=R)
        gamma_exact[c] = min(float(a[c]), R)
    else:
        w = int(torch.argmax(logp))                          # first maximal index: the rule's tie-break
        commit = torch.zeros(n, dtype=torch.bool)
        commit[w] = True
        lp2 = logp.topk(2).values
        lg2 = logit.topk(2).values
        cross = float(lp2[0] - lp2[1]) / 4
        cross_exact = float(lg2[0] - lg2[1]) / 4
        gamma = gamma.clamp(max=cross)
        gamma_exact = s_exact.clamp(max=cross_exact)
        gamma_exact[w] = min(float(a[w]), cross_exact)
    return Margin(gamma, gamma_exact, a, s, s_exact, commit, tok, fallback, cross, cross_exact)


def _quota_margin(clears, tok, a, s, s_exact, logp, logit, k: int) -> Margin:
    """The threshold rule with LLaDA2.0's quota k (commit the rows above τ, or the k most confident when fewer clear
    τ), n >= 1 rows. A sufficient radius per case (docs/algorithms.md §5):
      |C| > k   τ decides: committed rows min(a, s*), the others s* (no crossing, so |C| stays above k)
      |C| = k   C is the top k: committed min(a, x*), the others min(s*, x*) -- x* = (logit p₍ₖ₎ − logit p₍ₖ₊₁₎)/4
                keeps the top-k set; a row outside it rising above τ would add a commit
      |C| < k   the quota decides: committed min(a, x*), the others x* (a row rising above τ passes the k-th)
    k = 0 commits nothing below τ: every row s*."""
    n = clears.numel()
    nC = int(clears.sum())
    inf = math.inf
    if nC > k or k == 0:
        commit = clears.clone()
        return Margin(torch.where(commit, torch.minimum(a, s), s), torch.where(commit, torch.minimum(a, s_exact),
                      s_exact), a, s, s_exact, commit, tok, False, inf, inf)
    order = torch.sort(logp, descending=True, stable=True).indices
    commit = torch.zeros(n, dtype=torch.bool)
    commit[order[:k]] = True
    cross = cross_exact = inf
    if k < n:
        cross = float(logp[order[k - 1]] - logp[order[k]]) / 4
        cross_exact = float(logit[order[k - 1]] - logit[order[k]]) / 4
    others, others_exact = torch.full_like(a, cross), torch.full_like(a, cross_exact)
    if nC == k:
        others, others_exact = others.clamp(max=s), others_exact.clamp(max=s_exact)
    gamma = torch.where(commit, a.clamp(max=cross), others)
    gamma_exact = torch.where(commit, a.clamp(max=cross_exact), others_exact)
    return Margin(gamma, gamma_exact, a, s, s_exact, commit, tok, nC < k, cross, cross_exact)


def fixed_k_margin(logits: torch.Tensor, mask_id: Optional[int], k: int) -> Margin:
    """Margins under the fixed-k rule: the k most confident rows commit (stable order, ties -> lower row)."""
    return fixed_k_margin_rows(*_conf(masked64(logits, mask_id)), k=k)


def fixed_k_margin_rows(tok, gap, logp, logit, k: int) -> Margin:
    """`fixed_k_margin` from the row quantities of `row_stats` (cast to fp64 here)."""
    gap, logp, logit = gap.double(), logp.double(), logit.double()
    n = gap.shape[0]
    a = gap / 2
    k = min(max(k, 0), n)
    order = torch.sort(logp, descending=True, stable=True).indices
    commit = torch.zeros(n, dtype=torch.bool)
    commit[order[:k]] = True
    inf = torch.full((n,), math.inf, dtype=torch.float64)
    cross = cross_exact = math.inf
    if 0 < k < n:
        cross = float(logp[order[k - 1]] - logp[order[k]]) / 4
        cross_exact = float(logit[order[k - 1]] - logit[order[k]]) / 4
    gamma = a.clamp(max=cross)                                   # sufficient form: a on every row, like min(a, s)
    gamma_exact = torch.where(commit, a, inf).clamp(max=cross_exact)
    return Margin(gamma, gamma_exact, a, inf, inf.clone(), commit, tok, False, cross, cross_exact)


# ---------------------------------------------------------------------------------------------------------------
# exact-arithmetic replicas of the rules (for the property tests of the margin theorem) and decision comparison
# ---------------------------------------------------------------------------------------------------------------

def threshold_decision64(logits: torch.Tensor, mask_id: Optional[int], tau: float = 0.95, commit_all: bool = False,
                         inclusive: bool = False, quota: Optional[int] = None):
    """docs/algorithms.md §2.1 in fp64 (same tie-breaks as `samplers.threshold_rule`): -> (tokens, commit). Commits
    at conf > τ, or conf >= τ with `inclusive`."""
    z = masked64(logits, mask_id)
    n = z.shape[0]
    logp = z.max(dim=-1).values - torch.logsumexp(z, dim=-1)
    tok = torch.argmax(z, dim=-1)
    if commit_all:
        return tok, torch.ones(n, dtype=torch.bool)
    lt = math.log(tau32(tau))
    commit = logp >= lt if inclusive else logp > lt
    if quota is not None:                                    # LLaDA2.0: at least `quota` (samplers.threshold_commit)
        if int(commit.sum()) < quota:
            order = torch.sort(logp, descending=True, stable=True).indices
            commit = torch.zeros(n, dtype=torch.bool)
            commit[order[:min(quota, n)]] = True
        return tok, commit
    if n and not commit.any():
        commit = torch.zeros(n, dtype=torch.bool)
        commit[int(torch.argmax(logp))] = True
    return tok, commit


def fixed_k_decision64(logits: torch.Tensor, mask_id: Optional[int], k: int):
    z = masked64(logits, mask_id)
    n = z.shape[0]
    logp = z.max(dim=-1).values - torch.logsumexp(z, dim=-1)
    order = torch.sort(logp, descending=True, stable=True).indices
    commit = torch.zeros(n, dtype=torch.bool)
    commit[order[:min(max(k, 0), n)]] = True
    return torch.argmax(z, dim=-1), commit


def same_decision(tok_a, commit_a, tok_b, commit_b) -> torch.Tensor:
    """(n,) bool per row: same commit flag, and the same token where it commits (an uncommitted row's argmax is not
    a decision: it stays MASK)."""
    return (commit_a == commit_b) & (~commit_a | (tok_a == tok_b))


# ---------------------------------------------------------------------------------------------------------------
# entropy-bound rule: decision check under shared randomness
# ---------------------------------------------------------------------------------------------------------------

def entropy_bound_check(rule, state, logits_ref: torch.Tensor, logits_opt: torch.Tensor, gen: torch.Generator,
                        warmup: bool = False, accept: bool = True) -> dict:
    """Step two copies of a uniform-state block (`gemma_sampler.UniformBlock`) with the reference and the optimized
    logits, each from a copy of the same generator state, and compare what the step decided.

    Returns {same_accepted, same_argmax, same_tokens, accepted_diff, argmax_diff, tokens_diff, agree}: `agree` is
    the decision agreement (same accepted set, same accepted tokens, same argmax canvas — the canvas that commits).
    Re-noised positions draw the same noise by construction; they are not decisions.
    """
    out = []
    for z in (logits_ref, logits_opt):
        gens = {id(getattr(state, "gen", None)): getattr(state, "gen", None)} if getattr(state, "gen", None) else {}
        st = copy.deepcopy(state, gens)           # the block's own generator is shared, not copied (unused here)
        g = torch.Generator(device=gen.device)
        g.set_state(gen.get_state())
        rule.step(st, z, g, warmup=warmup, accept=accept)
        out.append(st)
    a, b = out
    acc_diff = int((a.accepted != b.accepted).sum())
    arg_diff = int((a.argmax != b.argmax).sum())
    both = a.accepted & b.accepted
    tok_diff = int(((a.x != b.x) & both).sum())
    return {"same_accepted": acc_diff == 0, "same_argmax": arg_diff == 0, "same_tokens": tok_diff == 0,
            "accepted_diff": acc_diff, "argmax_diff": arg_diff, "tokens_diff": tok_diff,
            "agree": acc_diff == 0 and arg_diff == 0 and tok_diff == 0}
