"""Support-restricted routing of a compact batch of fresh rows (docs/algorithms.md §4.2, the model's own rule restricted to S_l).

Letter legend: F fresh rows, E experts, K experts per row, G expert groups, GS = E / G experts per group.

Rule, per row (LLaDA2 `sigmoid`; LLaDA-MoE `softmax`):
  1. weight scores s = sigmoid(logits) (or softmax over all E experts); choice scores b = s + bias (bias: choice
     only for sigmoid; for softmax the biased probabilities are both weights and choice, as the HF gate does).
  2. experts outside the row's support get b = -inf BEFORE group scoring.
  3. sigmoid with G > 1: a group scores the sum of its two best finite b (one finite: that b; none: -inf, never
     chosen); the topk_group best groups are kept (ties: lowest group index), experts elsewhere get -inf.
  4. top-K of b (ties: lowest expert index); a slot that finds only -inf gets id -1 and weight 0.
  5. weights = s at the chosen experts; sigmoid: renormalised over the row's valid slots (norm_topk_prob, K > 1)
     and scaled by routed_scaling_factor; softmax: left as probabilities.
Slots come out in descending choice order (torch.topk's order); compare ids as sets per row all the same.

Worked example (E = 4, G = 2, topk_group = 1, K = 2, no bias, sigmoid already applied: s = b):
    s = [[.9, .1, .8, .7]], allowed = [[0, 1, 1, 1]]  ->  b = [[-inf, .1, .8, .7]]
    group scores: g0 = {-inf, .1} -> .1 (one finite score), g1 = {.8, .7} -> 1.5  ->  keep g1
    top-2 in g1: ids [[2, 3]], s = [.8, .7] -> renormalised [[.533, .467]] x routed_scaling_factor
"""
from __future__ import annotations

import torch

from dblock.kernels import INTERPRET, check, check_runnable, next_pow2, triton, tl

NEG = float("-inf")


# ---------------------------------------------------------------------------------------------------------------
# golden model
# ---------------------------------------------------------------------------------------------------------------

def route_torch(logits_FE: torch.Tensor, bias_E, allowed_FE: torch.Tensor, top_k: int, sigmoid: bool = True,
                n_group: int = 1, topk_group: int = 1, renormalize: bool = True, scale: float = 1.0):
    """The rule above in torch (any float dtype; fp64 for references). -> ids (F, K) int64, weights (F, K)."""
    x = logits_FE.to(torch.promote_types(logits_FE.dtype, torch.float32))
    F, E = x.shape
    if sigmoid:
        s = torch.sigmoid(x)
        b = s + bias_E.to(x.dtype) if bias_E is not None else s
    else:
        s = torch.softmax(x, dim=-1)
        if bias_E is not None:
            s = s + bias_E.to(x.dtype)
        b = s
    b = b.masked_fill(~allowed_FE.bool(), NEG)
    if sigmoid and n_group > 1:
        g = b.view(F, n_group, E // n_group)                                 # (F, G, GS)
        top2 = g.topk(min(2, E // n_group), dim=-1).values                  # (F, G, 2)
        finite = torch.isfinite(top2)
        gscore = torch.where(finite, top2, torch.zeros_like(top2)).sum(-1)  # (F, G)
        gscore = torch.where(finite.any(-1), gscore, torch.full_like(gscore, NEG))
        keep = gscore.topk(topk_group, dim=-1).indices                      # (F, topk_group)
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
        b = b.masked_fill(~gmask[:, :, None].expand_as(g).reshape(F, E), NEG)
    top_b, ids = b.topk(top_k, dim=-1)                                      # (F, K)
    valid = torch.isfinite(top_b)
    w = torch.where(valid, s.gather(1, ids), torch.zeros_like(top_b))
    if sigmoid:
        if renormalize and top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * scale
    return torch.where(valid, ids, torch.full_like(ids, -1)), w


# ---------------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def route_kernel(logits_ptr, bias_ptr, allowed_ptr, ids_ptr, w_ptr, F, stride_lf, stride_af, scale,
                     E: tl.constexpr, K: tl.constexpr, N_GROUP: tl.constexpr, GS: tl.constexpr,
                     TOPK_GROUP: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                     BLOCK_F: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
        """One program per BLOCK_F rows; a row's E scores live in one (BLOCK_F, BLOCK_E) tile."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_F + tl.arange(0, BLOCK_F)                        # (BLOCK_F,)
        cols = tl.arange(0, BLOCK_E)                                        # (BLOCK_E,)
        rmask = rows < F
        cmask = cols < E
        m2 = rmask[:, None] & cmask[None, :]
        x = tl.load(logits_ptr + rows[:, None] * stride_lf + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        ok = tl.load(allowed_ptr + rows[:, None] * stride_af + cols[None, :], mask=m2, other=0) != 0
        if SIGMOID:
            s = tl.sigmoid(x)
        else:
            xm = tl.where(cmask[None, :], x, float("-inf"))
            ex = tl.exp(xm - tl.max(xm, axis=1)[:, None])
            s = ex / tl.sum(ex, axis=1)[:, None]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            b = s + bias[None, :]
            if not SIGMOID:
                s = b                                                       # softmax: biased probs are weights
        else:
            b = s
        b = tl.where(ok & cmask[None, :], b, float("-inf"))                 # restrict BEFORE group scoring
        if SIGMOID and N_GROUP > 1:
            gcols = tl.arange(0, BLOCK_G)
            gs = tl.full((BLOCK_F, BLOCK_G), float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                in_g = (cols // GS == g) & cmask                            # (BLOCK_E,)
                v = tl.where(in_g[None, :], b, float("-inf"))
                m1 = tl.max(v, axis=1)
                i1 = tl.min(tl.where((v == m1[:, None]) & in_g[None, :], cols[None, :], BLOCK_E), axis=1)
                m2 = tl.max(tl.where(cols[None, :] == i1[:, None], float("-inf"), v), axis=1)
                has1 = m1 > float("-inf")
                has2 = m2 > float("-inf")
                score = tl.where(has2, m1 + m2, tl.where(has1, m1, float("-inf")))
                gs = tl.where(gcols[None, :] == g, score[:, None], gs)
            kept = (rows[:, None] < 0) & (gcols[None, :] < 0)                 # (BLOCK_F, BLOCK_G) all False
            for t in tl.static_range(TOPK_GROUP):
                avail = (~kept) & (gcols[None, :] < N_GROUP)
                cand = tl.where(avail, gs, float("-inf"))
                best = tl.max(cand, axis=1)
                pick = tl.min(tl.where(avail & (cand == best[:, None]), gcols[None, :], BLOCK_G), axis=1)
                kept = kept | (gcols[None, :] == pick[:, None])
            keep_e = (rows[:, None] < 0) & (cols[None, :] < 0)               # (BLOCK_F, BLOCK_E) all False
            for g in tl.static_range(N_GROUP):
                kept_g = tl.max(tl.where(gcols[None, :] == g, kept.to(tl.int32), 0), axis=1) > 0   # (BLOCK_F,)
                keep_e = keep_e | (kept_g[:, None] & (cols // GS == g)[None, :])
            b = tl.where(keep_e, b, float("-inf"))
        kcols = tl.arange(0, BLOCK_K)
        w_acc = tl.zeros((BLOCK_F, BLOCK_K), tl.float32)
        id_acc = tl.full((BLOCK_F, BLOCK_K), -1, tl.int32)
        for k in tl.static_range(K):
            best = tl.max(b, axis=1)
            idx = tl.min(tl.where((b == best[:, None]) & cmask[None, :], cols[None, :], BLOCK_E), axis=1)
            valid = best > float("-inf")
            wk = tl.sum(tl.where(cols[None, :] == idx[:, None], s, 0.0), axis=1)
            w_acc = tl.where(kcols[None, :] == k, tl.where(valid, wk, 0.0)[:, None], w_acc)
            id_acc = tl.where(kcols[None, :] == k, tl.where(valid, idx, -1)[:, None], id_acc)
            b = tl.where(cols[None, :] == idx[:, None], float("-inf"), b)
        if SIGMOID:
            if RENORM and K > 1:
                w_acc = w_acc / (tl.sum(w_acc, axis=1)[:, None] + 1e-20)
            w_acc = w_acc * scale
        out = rows[:, None] * K + kcols[None, :]
        omask = rmask[:, None] & (kcols[None, :] < K)
        tl.store(ids_ptr + out, id_acc.to(tl.int64), mask=omask)
        tl.store(w_ptr + out, w_acc, mask=omask)


def route_triton(logits_FE: torch.Tensor, bias_E, allowed_FE: torch.Tensor, top_k: int, sigmoid: bool = True,
                 n_group: int = 1, topk_group: int = 1, renormalize: bool = True, scale: float = 1.0,
                 block_f: int | None = None):
    """Launcher of `route_kernel`: logits (F, E) fp32, bias (E,) fp32 or None, allowed (F, E) bool.

    -> ids (F, K) int64 (-1 = no expert), weights (F, K) fp32.
    """
    check(logits_FE, "logits_FE", torch.float32, ndim=2)
    F, E = logits_FE.shape
    check(allowed_FE, "allowed_FE", (torch.bool, torch.uint8, torch.int8), ndim=2)
    assert allowed_FE.shape == (F, E), f"allowed_FE: shape {tuple(allowed_FE.shape)} != logits {(F, E)}"
    if bias_E is not None:
        check(bias_E, "bias_E", torch.float32, ndim=1, contiguous=True)
        assert bias_E.shape[0] == E, f"bias_E: {bias_E.shape[0]} experts, logits have {E}"
    assert 1 <= top_k <= E, f"top_k={top_k}: must be in 1..{E}"
    if sigmoid and n_group > 1:
        assert E % n_group == 0 and 1 <= topk_group <= n_group, f"E={E}, n_group={n_group}, topk_group={topk_group}"
    ids = torch.empty(F, top_k, dtype=torch.int64, device=logits_FE.device)
    w = torch.empty(F, top_k, dtype=torch.float32, device=logits_FE.device)
    if F == 0:
        return ids, w
    check_runnable(logits_FE.device)
    allowed_u8 = allowed_FE.view(torch.uint8) if allowed_FE.dtype == torch.bool else allowed_FE
    BLOCK_E = next_pow2(E)
    cap = 16384 if INTERPRET else 4096      # elements per tile; the interpreter pays per op, so one program
    BLOCK_F = block_f or max(1, min(next_pow2(F), cap // BLOCK_E, 256 if INTERPRET else 32))
    grid = (triton.cdiv(F, BLOCK_F),)
    route_kernel[grid](logits_FE, bias_E if bias_E is not None else logits_FE, allowed_u8, ids, w, F,
                       logits_FE.stride(0), allowed_u8.stride(0), float(scale),
                       E=E, K=top_k, N_GROUP=n_group if sigmoid else 1,
                       GS=E // n_group if sigmoid and n_group > 1 else E, TOPK_GROUP=topk_group,
                       HAS_BIAS=bias_E is not None, SIGMOID=sigmoid, RENORM=renormalize,
                       BLOCK_F=BLOCK_F, BLOCK_E=BLOCK_E, BLOCK_G=next_pow2(max(n_group, 1)),
                       BLOCK_K=next_pow2(top_k))
    return ids, w


def route_args(cfg) -> dict:
    """Keyword arguments of route_* for a ModelConfig (family rule)."""
    sig = cfg.score_function == "sigmoid"
    return dict(top_k=cfg.num_experts_per_tok, sigmoid=sig, n_group=cfg.n_group if sig else 1,
                topk_group=cfg.topk_group if sig else 1,
                renormalize=bool(getattr(cfg, "norm_topk_prob", False)),   # DiffusionGemma: none (it renormalises itself)
                scale=float(cfg.routed_scaling_factor) if sig else 1.0)
