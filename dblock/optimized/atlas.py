"""Expert Atlas (docs/algorithms.md §4.2): a per-(block, layer) expert support S_l built from routing mass, and the model's own
routing rule restricted to it.

Only the *set* of eligible experts is cached on the block clock; ids, order and weights of every fresh token's
experts are recomputed every pass from its current hidden state.

Letter legend: N rows of one block, T rows of a batch, E experts, K experts per token, J = K + m candidates.

Candidates. For each row the J = K + m best experts by the router's choice score: the first K are exactly the
dense router's choice (group-limited for LLaDA2), the next m the best remaining experts by choice score in any
group (the experts a token could move to when its hidden state drifts). W[t, j] is the score the router would use
as a weight (the unbiased sigmoid for LLaDA2, the softmax probability for LLaDA-MoE), I[t, j] the expert id.
R_t = Σ_{j<K} W[t, j] is the dense top-K mass; the target is r_t = α R_t.

Worked example (N = 2 rows, E = 4, K = 1, m = 1, α = 0.9, q = 1.0, B = 1, c = 1):
    I = [[0, 1], [2, 0]],  W = [[.6, .3], [.5, .4]]  ->  R = [.6, .5], r = [.54, .45]
    popularity p = [.6+.4, .3, .5, 0] -> S = {0};  C = [.6, .4];  U = {row 1}
    G_2 = min(.5, .45-.4) = .05, H_2 = 1 (.4+.5 >= .45); G_1 = 0 (row 1 has no edge to 1) -> add expert 2
    S = {0, 2}: C = [.6, .9], U = {} -> success
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

NEG = float("-inf")


@dataclass
class AtlasParams:
    """Support construction knobs (docs/algorithms.md §4.2 suggested defaults)."""

    m: int | None = None        # extra candidates per token beyond K (default K)
    alpha: float = 0.9          # coverage floor: a token is covered when C_t >= alpha * R_t
    q: float = 0.95             # success when at most (1 - q) * N tokens are under-covered
    B: int | None = None        # initial support: the B most popular experts (default min(E, 4K))
    beta: float = 1.0           # score_e = H_e + beta * G_e
    c: int | None = None        # experts added per repair round (default K)
    update_every: int = 4       # hot-update: rebuild S_l from the current pass's scores every this many passes

    def resolved(self, E: int, K: int) -> "AtlasParams":
        # suggested min(E, 4K) (docs/algorithms.md §4.2). With few experts (the bundled tiny-masked: E = 16, K = 4) this is every
        # expert and the support is inert; a smaller B (--atlas-B) starts from a real subset, and the repair rounds
        # add what coverage needs -- BENCHMARKS.md measures what that costs in decision agreement.
        B = min(E, 4 * K) if self.B is None else min(E, self.B)
        return AtlasParams(m=K if self.m is None else self.m, alpha=self.alpha, q=self.q, B=B, beta=self.beta,
                           c=K if self.c is None else self.c, update_every=self.update_every)


# ---------------------------------------------------------------------------------------------------------------
# scores, candidates and the group rule
# ---------------------------------------------------------------------------------------------------------------

def router_scores(logits_TE: torch.Tensor, bias_E, cfg):
    """-> (weight scores W_TE, choice scores b_TE) in fp32 for the family's router."""
    if cfg.score_function == "sigmoid":
        s = torch.sigmoid(logits_TE)
        return s, (s + bias_E if bias_E is not None else s)
    p = torch.softmax(logits_TE, dim=-1)
    if bias_E is not None:
        p = p + bias_E
    return p, p


# Below this many choice scores in a call (rows x experts) one `topk(2)` per group is cheaper than the tournament
# (a fixed ~20 us of elementwise calls); above it the tournament wins, 3-6x at 1,000 rows of 64 experts (measured on
# the 2-core CPU of BENCHMARKS.md; both give the same two numbers, so the choice never changes a result).
TOURNAMENT_MIN_SCORES = 8192


def _top2(x_TGX: torch.Tensor):
    """(hi, lo) (T, G): the largest and second-largest entry of each group (-inf where a group has fewer than two
    entries above -inf), by a tournament of elementwise max/min over the group members -- the same two numbers
    `topk(2)` returns, in a few elementwise calls instead of T·G small sorts (the CPU's topk over 8 entries costs
    ~50 ns a group). Groups whose size is not a power of two are padded with -inf."""
    T, G, X = x_TGX.shape
    h = x_TGX.permute(2, 0, 1)                                       # (X, T, G): halves are plain slices
    P2 = 1 << max(X - 1, 0).bit_length()
    if P2 != X:
        h = torch.cat([h, h.new_full((P2 - X, T, G), NEG)])
    if P2 == 1:
        return h[0], h.new_full((T, G), NEG)
    k = P2 // 2
    hi, lo = torch.maximum(h[:k], h[k:]), torch.minimum(h[:k], h[k:])
    while k > 1:                        # merge halves: top-2 of A ∪ B = (max(a1, b1), max(min(a1, b1), a2, b2))
        k //= 2
        h0, h1, l0, l1 = hi[:k], hi[k:], lo[:k], lo[k:]
        hi, lo = torch.maximum(h0, h1), torch.maximum(torch.minimum(h0, h1), torch.maximum(l0, l1))
    return hi[0], lo[0]


def group_scores(choice_TE: torch.Tensor, cfg, finite: bool = False) -> torch.Tensor:
    """(T, G) group scores of the group-limited rule: the sum of a group's two best *finite* choice scores (one
    finite score: that score; none: -inf, never kept). On finite scores (`finite`: the caller knows there is no
    -inf) exactly the reference's `topk(2).values.sum(-1)`: the same two numbers added. `_top2`'s tournament on
    calls of at least TOURNAMENT_MIN_SCORES scores, one `topk(2)` per group below."""
    T, E = choice_TE.shape
    g = choice_TE.view(T, cfg.n_group, E // cfg.n_group)
    if T * E >= TOURNAMENT_MIN_SCORES or g.shape[-1] < 2:
        hi, lo = _top2(g)
    else:
        v = g.topk(2, dim=-1).values
        hi, lo = v[..., 0], v[..., 1]
    return hi + lo if finite else torch.where(lo > NEG, hi + lo, hi)


def _group_filter(choice_TE: torch.Tensor, cfg, finite: bool = False) -> torch.Tensor:
    """The choice scores with every expert outside the `topk_group` best groups set to -inf: the reference's
    masked scores value for value (a kept expert's score + 0.0, a dropped one's + -inf)."""
    T, E = choice_TE.shape
    keep = group_scores(choice_TE, cfg, finite).topk(cfg.topk_group, dim=-1).indices   # (T, topk_group)
    drop_TG = choice_TE.new_full((T, cfg.n_group), NEG).scatter_(1, keep, 0.0)
    return (choice_TE.view(T, cfg.n_group, E // cfg.n_group) + drop_TG[:, :, None]).view(T, E)


def group_mask(choice_TE: torch.Tensor, cfg) -> torch.Tensor:
    """(T, E) bool: the experts a row may choose under the group rule (in its `topk_group` best groups, a group
    scored as in `group_scores`) and not already at -inf."""
    if cfg.score_function != "sigmoid" or cfg.n_group <= 1:
        return choice_TE > NEG
    return _group_filter(choice_TE, cfg) > NEG


def choose(choice_TE: torch.Tensor, cfg, finite: bool = False):
    """The router's choice over choice scores that may hold -inf (experts outside a support; `finite`: they do
    not) -> (top-K choice scores, ids), each (T, K), best first; -inf marks a slot with no eligible expert."""
    if cfg.score_function == "sigmoid" and cfg.n_group > 1:
        choice_TE = _group_filter(choice_TE, cfg, finite)
    return choice_TE.topk(cfg.num_experts_per_tok, dim=-1)


def _largest(x_TE: torch.Tensor, n: int) -> torch.Tensor:
    """(T, n) ids of the n largest entries of each row, in no particular order (a row's result depends on that row
    only). On the host numpy's `argpartition` (a selection, no sort): 2.6x faster than `topk` for 8 of 64 experts
    at 450 rows on the CPU of BENCHMARKS.md, where `topk` costs 0.57 us a row above ~300 rows (below ~100 rows the
    two are within a few microseconds); elsewhere `topk`."""
    if x_TE.device.type == "cpu" and x_TE.dtype in (torch.float32, torch.float64) and 0 < n < x_TE.shape[1]:
        return torch.from_numpy(np.argpartition(-x_TE.detach().numpy(), n - 1, axis=1)[:, :n])
    return x_TE.topk(n, dim=-1, sorted=False).indices


def candidates(logits_TE: torch.Tensor, bias_E, cfg, m: int, top_TK: Optional[torch.Tensor] = None):
    """(W_TJ, I_TJ, R_T): the dense top-K (group rule applied, best first) then the m next best by choice score
    (as a set: in no particular order).

    `top_TK`: the router's choice for these rows when the caller already has it (the executor on a build pass,
    whose building rows were just routed with every expert): the ids `choose` would return, so the group rule and
    the final top-K are not computed twice."""
    w, b = router_scores(logits_TE, bias_E, cfg)
    K, E = cfg.num_experts_per_tok, w.shape[1]
    top = choose(b, cfg, finite=True).indices if top_TK is None else top_TK   # the router's own choice
    J = min(E, K + m)
    rest = _largest(b.scatter(1, top, NEG), J - K) if J > K else top[:, :0]
    I = torch.cat([top, rest], dim=1)                                # (T, J)
    W = w.gather(1, I)                                               # (T, J)
    return W, I, W[:, :K].sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# support construction
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class SupportResult:
    support: torch.Tensor       # (E,) bool
    success: bool               # |U| <= (1 - q) N reached
    under: int                  # |U| at the end
    rounds: int


def _top(x_PE: np.ndarray, k: int):
    """(values, indices) of the k largest entries of each row, ties to the lower expert id (a stable sort: the
    same support on every machine and for every batch)."""
    i = np.argsort(-x_PE, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(x_PE, i, axis=1), i


def build_support(W: torch.Tensor, I: torch.Tensor, R: torch.Tensor, E: int, p: AtlasParams) -> SupportResult:
    """docs/algorithms.md §4.2 greedy construction over one block's candidate graph (W, I: (N, J); R: (N,)):
    `build_supports` with a single block."""
    return build_supports(W, I, R, [W.shape[0]], E, p)[0]


def build_supports(W: torch.Tensor, I: torch.Tensor, R: torch.Tensor, lens, E: int, p: AtlasParams) -> list:
    """docs/algorithms.md §4.2 greedy construction for several blocks at once -> one SupportResult per block.

    W, I: (G, J) and R: (G,) are the blocks' candidate rows concatenated, `lens` the blocks' row counts in order.
    Each block's result is the one it gets alone: every quantity is per row or summed over its own block's rows
    (a `bincount` adds a bin's entries in row order, whatever else is in the call), and a block stops changing once
    it succeeds or fails. The planner runs on the host (the block clock) in fp64 numpy on the candidate edges
    themselves: edge (t, j) joins row t to expert I[t, j] with mass W[t, j] and falls in the bin
    (block of t) * E + I[t, j], so popularity, G_e and H_e are one weighted `bincount` each over the G·J edges (a
    row's J candidates are distinct experts) -- never a (G, E) array. Ties (in the initial popularity and in a
    round's scores) go to the lower expert id."""
    lens = np.asarray([int(n) for n in lens], dtype=np.int64)
    P = len(lens)
    W_GJ = W.detach().to("cpu", torch.float64).numpy()
    I_GJ = I.detach().cpu().numpy().astype(np.int64, copy=False)
    target_G = p.alpha * R.detach().to("cpu", torch.float64).numpy()       # r_t
    seg_G = np.repeat(np.arange(P), lens)
    key_GJ = seg_G[:, None] * E + I_GJ                                # the (block, expert) bin of each edge
    PE = P * E
    pop_PE = np.bincount(key_GJ.ravel(), W_GJ.ravel(), minlength=PE).reshape(P, E)
    S_PE = np.zeros((P, E), dtype=bool)
    np.put_along_axis(S_PE, _top(pop_PE, min(p.B, E))[1], True, axis=1)
    allowed_under = (1.0 - p.q) * lens + 1e-9
    ok_P, done_P = np.zeros(P, dtype=bool), np.zeros(P, dtype=bool)
    under_P, rounds_P = np.zeros(P, dtype=np.int64), np.zeros(P, dtype=np.int64)
    rounds = 0

    def finish(b_P: np.ndarray, n_under: np.ndarray, ok: bool) -> None:
        ok_P[b_P] = ok
        under_P[b_P], rounds_P[b_P] = n_under[b_P], rounds
        done_P[b_P] = True

    while True:
        cover_G = np.where(S_PE.ravel()[key_GJ], W_GJ, 0.0).sum(1)     # C_t
        U_G = cover_G < target_G - 1e-12
        n_under = np.bincount(seg_G[U_G], minlength=P)
        finish(~done_P & (n_under <= allowed_under), n_under, True)
        if p.c <= 0:                                                  # no repair allowed: fail closed
            finish(~done_P, n_under, False)
        rep_P = ~done_P
        if not rep_P.any():
            break
        u_G = U_G & rep_P[seg_G]                                       # under-covered rows of repairing blocks
        W_UJ, key_UJ = W_GJ[u_G], key_GJ[u_G]
        cover_U, target_U = cover_G[u_G, None], target_G[u_G, None]
        # G_e = Σ_{t∈U} min(W[t,j], r_t - C_t) over the edges (t, j) to e; H_e = Σ_{t∈U} 1[C_t + W[t,j] >= r_t]
        G_PE = np.bincount(key_UJ.ravel(), np.minimum(W_UJ, np.maximum(target_U - cover_U, 0.0)).ravel(),
                           minlength=PE)
        hit_UJ = (cover_U + W_UJ >= target_U - 1e-12) & (W_UJ > 0)
        H_PE = np.bincount(key_UJ[hit_UJ], minlength=PE)
        score_PE = (H_PE + p.beta * G_PE).reshape(P, E)
        score_PE[S_PE | (score_PE <= 0) | done_P[:, None]] = NEG
        top_v, top_i = _top(score_PE, min(p.c, E))
        ok_PC = np.isfinite(top_v)
        finish(rep_P & ~ok_PC.any(1), n_under, False)                 # no expert can help: fail closed
        np.put_along_axis(S_PE, top_i, S_PE[np.arange(P)[:, None], top_i] | ok_PC, axis=1)
        rounds += 1
    sup_PE = torch.from_numpy(S_PE)
    return [SupportResult(sup_PE[b], bool(ok_P[b]), int(under_P[b]), int(rounds_P[b])) for b in range(P)]


def coverage(W: torch.Tensor, I: torch.Tensor, R: torch.Tensor, support: torch.Tensor, alpha: float):
    """(C_t, under-covered mask U) of a support (for invariants and reports)."""
    C = (W * support[I].to(W.dtype)).sum(-1)
    return C, C < alpha * R - 1e-9


# ---------------------------------------------------------------------------------------------------------------
# routing restricted to a support
# ---------------------------------------------------------------------------------------------------------------

def route_restricted(logits_TE: torch.Tensor, bias_E, cfg, allowed_TE: Optional[torch.Tensor] = None):
    """The model's routing rule with experts outside `allowed_TE` given -inf choice scores *before* group scoring.

    Returns ids (T, K) int64 and weights (T, K) fp32. A slot that finds no eligible expert (a row whose kept
    groups hold fewer than K allowed experts) gets id -1 and weight 0; the remaining weights are renormalised as
    the model would (LLaDA2) or left as probabilities (LLaDA-MoE). `allowed_TE=None` (or every expert allowed) is
    exactly the dense router, ids and weights bit for bit (tested against `dblock.reference.llada.route_*`): the
    same choice scores reach the same final `topk`; only the group scores may come from `_top2`'s tournament
    (`group_scores`: on large calls) instead of a `topk(2)` per group.
    """
    w, b = router_scores(logits_TE, bias_E, cfg)
    if allowed_TE is not None:
        b = b.masked_fill(~allowed_TE, NEG)
    top_b, ids = choose(b, cfg, finite=allowed_TE is None)
    wk = w.gather(1, ids)
    if allowed_TE is not None:
        valid = top_b > NEG
        wk = torch.where(valid, wk, torch.zeros_like(wk))
    if cfg.score_function == "sigmoid":
        K = cfg.num_experts_per_tok
        if cfg.norm_topk_prob and K > 1:
            wk = wk / (wk.sum(-1, keepdim=True) + 1e-20)
        wk = wk * cfg.routed_scaling_factor
    if allowed_TE is None:
        return ids, wk
    return torch.where(valid, ids, torch.full_like(ids, -1)), wk
