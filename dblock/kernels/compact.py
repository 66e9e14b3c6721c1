"""Compact / scatter of fresh rows and the merge of cached stable rows (docs/algorithms.md §4.3-4.4: `B = Compact(H, F_i)`,
`Y[F_i] = Y_F`, `Y[¬F_i] = C_l[¬F_i]`).

Letter legend: T rows of the full shard, F fresh rows, C rows of the decoded-output cache, H hidden.

Both directions are one gather-form kernel, `merge_rows_kernel`: every output row reads one source row, so the
output needs no zero fill and no two programs write the same row.

    compact:  x_F[f] = x_T[idx_F[f]]
    merge:    y_T[t] = y_F[fresh_pos_T[t]]       if fresh_pos_T[t] >= 0    (fresh rows, from the experts)
                     = cache_C[cache_pos_T[t]]   elif cache_pos_T[t] >= 0  (stable decoded rows, from the cache)
                     = 0                         otherwise                 (rows that are neither: padding)
    scatter:  merge without a cache; fresh_pos_T = inverse of idx_F (`positions_of`).

Worked example (T = 4 rows, H = 1):
    x_T = [[10], [11], [12], [13]], idx_F = [1, 3]            -> compact: x_F = [[11], [13]]
    y_F = [[.1], [.3]]; fresh_pos_T = [-1, 0, -1, 1]; cache_C = [[7], [8]]; cache_pos_T = [1, -1, -1, -1]
                                                              -> merge:   y_T = [[8], [.1], [0], [.3]]
"""
from __future__ import annotations

import torch

from dblock.kernels import FLOATS, check, check_runnable, next_pow2, triton, tl


# ---------------------------------------------------------------------------------------------------------------
# golden models
# ---------------------------------------------------------------------------------------------------------------

def positions_of(idx_F: torch.Tensor, T: int) -> torch.Tensor:
    """(T,) int32: f where idx_F[f] = t, -1 elsewhere (the compact buffer <-> full shard index map)."""
    pos = torch.full((T,), -1, dtype=torch.int32, device=idx_F.device)
    pos[idx_F.long()] = torch.arange(idx_F.numel(), dtype=torch.int32, device=idx_F.device)
    return pos


def compact_torch(x_TH: torch.Tensor, idx_F: torch.Tensor) -> torch.Tensor:
    return x_TH[idx_F.long()]


def scatter_torch(y_FH: torch.Tensor, idx_F: torch.Tensor, T: int) -> torch.Tensor:
    out = torch.zeros(T, y_FH.shape[1], dtype=y_FH.dtype, device=y_FH.device)
    out[idx_F.long()] = y_FH
    return out


def merge_torch(y_FH: torch.Tensor, fresh_pos_T: torch.Tensor, cache_CH=None, cache_pos_T=None) -> torch.Tensor:
    T, H = fresh_pos_T.shape[0], y_FH.shape[1]
    out = torch.zeros(T, H, dtype=y_FH.dtype, device=y_FH.device)
    if cache_CH is not None:
        c = cache_pos_T >= 0
        out[c] = cache_CH[cache_pos_T[c].long()].to(y_FH.dtype)
    f = fresh_pos_T >= 0
    out[f] = y_FH[fresh_pos_T[f].long()]
    return out


# ---------------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def merge_rows_kernel(a_ptr, ia_ptr, b_ptr, ib_ptr, out_ptr, R, H, stride_a, stride_b, stride_o,
                          HAS_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[r] = a[ia[r]] if ia[r] >= 0 else (b[ib[r]] if HAS_B and ib[r] >= 0 else 0)."""
        pid_r = tl.program_id(0)
        pid_h = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < R
        cmask = cols < H
        ia = tl.load(ia_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        use_a = ia >= 0
        v = tl.load(a_ptr + ia[:, None] * stride_a + cols[None, :], mask=use_a[:, None] & cmask[None, :], other=0.0)
        v = v.to(out_ptr.dtype.element_ty)
        if HAS_B:
            ib = tl.load(ib_ptr + rows, mask=rmask, other=-1).to(tl.int64)
            use_b = (ib >= 0) & (~use_a)
            vb = tl.load(b_ptr + ib[:, None] * stride_b + cols[None, :], mask=use_b[:, None] & cmask[None, :],
                         other=0.0)
            v = tl.where(use_b[:, None], vb.to(out_ptr.dtype.element_ty), v)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], v,
                 mask=rmask[:, None] & cmask[None, :])


def _launch(a, ia, b, ib, R):
    out = torch.empty(R, a.shape[1], dtype=a.dtype, device=a.device)
    if R == 0:
        return out
    check_runnable(a.device)
    H = a.shape[1]
    BR = min(32, next_pow2(R))
    BH = min(256, next_pow2(H))
    merge_rows_kernel[(triton.cdiv(R, BR), triton.cdiv(H, BH))](
        a, ia, b if b is not None else a, ib if ib is not None else ia, out, R, H, a.stride(0),
        b.stride(0) if b is not None else 0, out.stride(0), HAS_B=b is not None, BLOCK_R=BR, BLOCK_H=BH)
    return out


def compact_triton(x_TH: torch.Tensor, idx_F: torch.Tensor) -> torch.Tensor:
    """Launcher: x (T, H) rows with stride(1) == 1, idx (F,) int32/int64 in [0, T). -> (F, H) contiguous."""
    check(x_TH, "x_TH", FLOATS, ndim=2)
    check(idx_F, "idx_F", (torch.int32, torch.int64), ndim=1, contiguous=True)
    return _launch(x_TH, idx_F, None, None, idx_F.shape[0])


def merge_triton(y_FH: torch.Tensor, fresh_pos_T: torch.Tensor, cache_CH=None, cache_pos_T=None) -> torch.Tensor:
    """Launcher: y (F, H), fresh_pos (T,) int32 (-1: not fresh), optional cache (C, H) of y's dtype and
    cache_pos (T,) int32 (-1: not served). -> (T, H) contiguous in y's dtype."""
    check(y_FH, "y_FH", FLOATS, ndim=2)
    check(fresh_pos_T, "fresh_pos_T", (torch.int32, torch.int64), ndim=1, contiguous=True)
    if cache_CH is not None:
        check(cache_CH, "cache_CH", y_FH.dtype, ndim=2)
        check(cache_pos_T, "cache_pos_T", (torch.int32, torch.int64), ndim=1, contiguous=True)
        assert cache_CH.shape[1] == y_FH.shape[1] and cache_pos_T.shape == fresh_pos_T.shape, \
            f"cache {tuple(cache_CH.shape)} / cache_pos {tuple(cache_pos_T.shape)} vs y {tuple(y_FH.shape)}"
    return _launch(y_FH, fresh_pos_T, cache_CH, cache_pos_T, fresh_pos_T.shape[0])


def scatter_triton(y_FH: torch.Tensor, idx_F: torch.Tensor, T: int) -> torch.Tensor:
    """Fresh rows back into T rows (others zero): merge with the inverse index map and no cache."""
    return merge_triton(y_FH, positions_of(idx_F, T))
