"""LM head of the live rows only (docs/algorithms.md §4.3: decoded rows feed no decision, so their logits are never computed).

Letter legend: L rows of a segment, R live rows, H hidden, V vocab.

    logits[r] = (RMSNorm(h[live_idx[r]]) * norm_weight) @ W^T      in fp32, (R, V)

One program per (R-tile, V-tile): the live rows are gathered in the load (no compacted copy of the hidden states),
a first sweep over H takes each row's mean square, a second multiplies the normalised row (times the norm weight)
into the LM-head tile. The reference rounds the normalised row to the model dtype before the weight multiply
(`RMSNorm` then `nn.Linear`); the kernel does the same on 16-bit GPU runs (operands go to `tl.dot` in the model
dtype) and keeps fp32 otherwise.

Worked example (L = 4, live = [0, 1, 1, 0]): live_idx = [1, 2]; the result has 2 rows, h[1]'s then h[2]'s.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F_

from dblock.kernels import FLOATS, INTERPRET, check, check_runnable, f32_mode, next_pow2, triton, tl


def lm_head_torch(hidden_LH: torch.Tensor, live_idx_R: torch.Tensor, norm_weight_H: torch.Tensor,
                  weight_VH: torch.Tensor, eps: float) -> torch.Tensor:
    """Golden model (in the inputs' dtype promoted to fp32; fp64 stays fp64) -> (R, V)."""
    acc = torch.promote_types(hidden_LH.dtype, torch.float32)
    x = hidden_LH[live_idx_R.long()].to(acc)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return F_.linear(x * norm_weight_H.to(acc), weight_VH.to(acc))


if triton is not None:
    @triton.jit
    def lm_head_kernel(h_ptr, idx_ptr, nw_ptr, w_ptr, out_ptr, R, H, V, eps, stride_h, stride_w, stride_o,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = r < R
        row = tl.load(idx_ptr + r, mask=rmask, other=0).to(tl.int64)       # gather in the load
        ss = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(h_ptr + row[:, None] * stride_h + offs_k[None, :],
                        mask=rmask[:, None] & (offs_k < H)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        inv = 1.0 / tl.sqrt(ss / H + eps)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < V
        w_rows = offs_n.to(tl.int64) * stride_w                            # V * H may pass 2^31
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < H
            x = tl.load(h_ptr + row[:, None] * stride_h + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0)
            nw = tl.load(nw_ptr + offs_k, mask=kmask, other=0.0)
            wt = tl.load(w_ptr + w_rows[None, :] + offs_k[:, None], mask=kmask[:, None] & nmask[None, :],
                         other=0.0)                                         # (BLOCK_K, BLOCK_N) = W^T
            if F32:
                xn = x.to(tl.float32) * inv[:, None] * nw.to(tl.float32)[None, :]
                acc = tl.dot(xn, wt.to(tl.float32), acc, input_precision="ieee")
            else:
                xn = (x.to(tl.float32) * inv[:, None]).to(x.dtype) * nw[None, :]     # RMSNorm's rounding
                acc = tl.dot(xn.to(wt.dtype), wt, acc)
        tl.store(out_ptr + r[:, None].to(tl.int64) * stride_o + offs_n[None, :], acc,
                 mask=rmask[:, None] & nmask[None, :])


def lm_head_triton(hidden_LH: torch.Tensor, live_idx_R: torch.Tensor, norm_weight_H: torch.Tensor,
                   weight_VH: torch.Tensor, eps: float) -> torch.Tensor:
    """Launcher: hidden (L, H) rows with stride(1) == 1, live_idx (R,) int, norm weight (H,), LM head (V, H)
    contiguous, one float dtype. -> fp32 logits (R, V)."""
    check(hidden_LH, "hidden_LH", FLOATS, ndim=2)
    check(live_idx_R, "live_idx_R", (torch.int32, torch.int64), ndim=1, contiguous=True)
    check(norm_weight_H, "norm_weight_H", hidden_LH.dtype, ndim=1, contiguous=True)
    check(weight_VH, "weight_VH", hidden_LH.dtype, ndim=2, contiguous=True)
    H = hidden_LH.shape[1]
    V = weight_VH.shape[0]
    assert weight_VH.shape[1] == H and norm_weight_H.shape[0] == H, \
        f"LM head {tuple(weight_VH.shape)} / norm {tuple(norm_weight_H.shape)} vs hidden {H}"
    R = live_idx_R.shape[0]
    out = torch.empty(R, V, dtype=torch.float32, device=hidden_LH.device)
    if R == 0:
        return out
    check_runnable(hidden_LH.device)
    big = 4 if INTERPRET else 1             # the interpreter pays per op, not per element: fewer, larger tiles
    BM = min(32 * big, max(16, next_pow2(R)))
    BN = min(128 * big, max(16, next_pow2(V)))
    BK = min(64 * big, max(16, next_pow2(H)))
    lm_head_kernel[(triton.cdiv(R, BM), triton.cdiv(V, BN))](
        hidden_LH, live_idx_R, norm_weight_H, weight_VH, out, R, H, V, float(eps), hidden_LH.stride(0),
        weight_VH.stride(0), out.stride(0), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, F32=f32_mode(hidden_LH.dtype))
    return out
