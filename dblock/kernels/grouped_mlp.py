"""Grouped gated expert MLP over a routed worklist (FreshLane's expert stage, docs/algorithms.md §4.4): SwiGLU (the LLaDA
families) or GeGLU with the tanh GELU (DiffusionGemma, `activation="gelu_tanh"`).

Letter legend: F rows, H hidden, E experts, I expert width, K slots per row, P = F*K flat pairs
(pair p = f*K + k), BM = BLOCK_M rows of one M-block, MB M-blocks (see align.py for the layout).

    y[f] = Σ_k w[f,k] · down_e(act(gate_e x_f) · up_e x_f),   e = ids[f,k];  slots with e = -1 contribute nothing
    act = silu, or gelu_tanh(x) = x · σ(2u), u = √(2/π)(x + 0.044715 x³)  (= 0.5x(1 + tanh u))

Three kernels over the `align` layout (vLLM fused_moe's structure):
  gate_up   one program per (M-block, I-tile): the M-block's expert e; A rows gathered in the load from x by
            pair // K (no permuted copy of the activations); h = act(x Wg_e^T) * (x Wu_e^T) stored by pair into
            h_PI (pair order, x's dtype).
  down      one program per (M-block, H-tile): h rows gathered by pair, h Wd_e^T times the routing weight
            w[pair], stored by pair into o_PH (fp32): the scatter happens in the store.
  moe_sum   one program per row tile: y[f] = Σ over valid slots of o[f*K + k] (deterministic, no atomics).
Padding rows (the sentinel P) load nothing and store nothing; M-blocks past num_post_padded (expert -1) return
before loading a weight; rows of invalid slots in h_PI/o_PH are never written and never read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F_

from dblock.kernels import FLOATS, INTERPRET, check, check_runnable, f32_mode, next_pow2, triton, tl
from dblock.kernels.align import align_triton


# ---------------------------------------------------------------------------------------------------------------
# golden model
# ---------------------------------------------------------------------------------------------------------------

ACTIVATIONS = ("silu", "gelu_tanh")


def _act(x: torch.Tensor, activation: str) -> torch.Tensor:
    return F_.silu(x) if activation == "silu" else F_.gelu(x, approximate="tanh")


def grouped_mlp_torch(x_FH: torch.Tensor, ids_FK: torch.Tensor, w_FK: torch.Tensor, w_gate_EIH: torch.Tensor,
                      w_up_EIH: torch.Tensor, w_down_EHI: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Per-expert loop (one pass per expert that has rows); accumulates in fp32 (fp64 for fp64), returns x's dtype."""
    acc = torch.promote_types(x_FH.dtype, torch.float32)
    out = torch.zeros(x_FH.shape, dtype=acc, device=x_FH.device)
    for e in ids_FK[ids_FK >= 0].unique().tolist():
        rows, slots = (ids_FK == e).nonzero(as_tuple=True)
        xe = x_FH[rows]
        ye = F_.linear(_act(F_.linear(xe, w_gate_EIH[e]), activation) * F_.linear(xe, w_up_EIH[e]), w_down_EHI[e])
        out.index_add_(0, rows, ye.to(acc) * w_FK[rows, slots, None].to(acc))
    return out.to(x_FH.dtype)


def grouped_mlp_grouped_mm(x_FH, ids_FK, w_FK, w_gate_EIH, w_up_EIH, w_down_EHI) -> torch.Tensor:
    """The torch baseline the GPU benchmark times: permuted copy + `F.grouped_mm` (torchtitan's production path)."""
    F, K = ids_FK.shape
    E = w_gate_EIH.shape[0]
    flat = ids_FK.reshape(-1)
    valid = (flat >= 0).nonzero(as_tuple=True)[0]
    order = valid[torch.sort(flat[valid], stable=True).indices]
    counts = torch.bincount(flat[order], minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x_FH[order // K]                                                   # (P', H) permuted copy
    g = F_.grouped_mm(xs, w_gate_EIH.transpose(1, 2), offs=offs)
    u = F_.grouped_mm(xs, w_up_EIH.transpose(1, 2), offs=offs)
    y = F_.grouped_mm(F_.silu(g) * u, w_down_EHI.transpose(1, 2), offs=offs)   # (P', H)
    acc = torch.promote_types(x_FH.dtype, torch.float32)
    out = torch.zeros(x_FH.shape, dtype=acc, device=x_FH.device)
    out.index_add_(0, order // K, y.to(acc) * w_FK.reshape(-1)[order, None].to(acc))
    return out.to(x_FH.dtype)


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def gate_up_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, sorted_ptr, expert_ptr, npost_ptr, P, H, I,
                       stride_xf, stride_we, stride_wi, stride_hp,
                       K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       F32: tl.constexpr, GELU: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        if e < 0:                                                           # expert elsewhere: load no weights
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < P
        row = (pair // K).to(tl.int64)                                      # gather in the load
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < I
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < H
            a = tl.load(x_ptr + row[:, None] * stride_xf + offs_k[None, :], mask=valid[:, None] & kmask[None, :],
                        other=0.0)                                          # (BLOCK_M, BLOCK_K)
            wmask = kmask[:, None] & nmask[None, :]
            w_off = e * stride_we + offs_n[None, :] * stride_wi + offs_k[:, None]      # (BLOCK_K, BLOCK_N) = W^T
            bg = tl.load(wg_ptr + w_off, mask=wmask, other=0.0)
            bu = tl.load(wu_ptr + w_off, mask=wmask, other=0.0)
            if F32:                                                         # interpreter / fp32: IEEE fp32 dots
                a = a.to(tl.float32)
                acc_g = tl.dot(a, bg.to(tl.float32), acc_g, input_precision="ieee")
                acc_u = tl.dot(a, bu.to(tl.float32), acc_u, input_precision="ieee")
            else:                                                           # 16-bit operands, fp32 accumulation
                acc_g = tl.dot(a, bg, acc_g)
                acc_u = tl.dot(a, bu, acc_u)
        if GELU:                                    # tanh GELU as x·σ(2u): 0.5x(1 + tanh u) = x·σ(2u)
            u = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            h = acc_g * tl.sigmoid(2.0 * u) * acc_u
        else:                                       # SiLU
            h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + pair[:, None].to(tl.int64) * stride_hp + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])

    @triton.jit
    def down_kernel(h_ptr, wd_ptr, rw_ptr, o_ptr, sorted_ptr, expert_ptr, npost_ptr, P, H, I,
                    stride_hp, stride_we, stride_wh, stride_op,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        if e < 0:
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < P
        pair64 = pair.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                    # over H
        nmask = offs_n < H
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < I
            a = tl.load(h_ptr + pair64[:, None] * stride_hp + offs_k[None, :], mask=valid[:, None] & kmask[None, :],
                        other=0.0)
            b = tl.load(wd_ptr + e * stride_we + offs_n[None, :] * stride_wh + offs_k[:, None],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)    # (BLOCK_K, BLOCK_N) = Wd^T
            if F32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        rw = tl.load(rw_ptr + pair64, mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]                                             # routing weight in fp32
        tl.store(o_ptr + pair64[:, None] * stride_op + offs_n[None, :], acc,
                 mask=valid[:, None] & nmask[None, :])                      # scatter in the store

    @triton.jit
    def moe_sum_kernel(o_ptr, ids_ptr, y_ptr, F, H, stride_op, stride_yf, K: tl.constexpr,
                       BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr):
        pid_f = tl.program_id(0)
        pid_h = tl.program_id(1)
        rows = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        rmask = rows < F
        cmask = cols < H
        acc = tl.zeros((BLOCK_F, BLOCK_H), tl.float32)
        for k in tl.static_range(K):
            e = tl.load(ids_ptr + rows * K + k, mask=rmask, other=-1)
            ok = (e >= 0) & rmask
            pair = (rows * K + k).to(tl.int64)
            acc += tl.load(o_ptr + pair[:, None] * stride_op + cols[None, :], mask=ok[:, None] & cmask[None, :],
                           other=0.0)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_yf + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def pick_block_m(P: int, E: int) -> int:
    """16 rows per M-block for short worklists (vLLM's choice at small M), 64 when experts see many pairs."""
    return 16 if P <= 32 * E else 64


def grouped_mlp_triton(x_FH: torch.Tensor, ids_FK: torch.Tensor, w_FK: torch.Tensor, w_gate_EIH: torch.Tensor,
                       w_up_EIH: torch.Tensor, w_down_EHI: torch.Tensor, block_m: int | None = None,
                       block_n: int | None = None, block_k: int | None = None,
                       exact_grid: bool | None = None, activation: str = "silu") -> torch.Tensor:
    """Launcher: x (F, H), ids (F, K) int64 (-1 = none), w (F, K) fp32, weights (E, I, H), (E, I, H), (E, H, I),
    x and weights of one float dtype; the down weights contiguous, the gate and up weights contiguous along H with
    one shared layout (so the two halves of a fused (E, 2I, H) gate_up tensor can be passed as views).
    `activation`: silu (SwiGLU) or gelu_tanh (GeGLU). -> (F, H) in x's dtype.

    exact_grid: launch num_post_padded / BM M-blocks (reads the count on the host) instead of the static upper
    bound MB whose surplus programs return at once. Default: on under the interpreter (a host read is free there
    and every program costs milliseconds), off on a GPU (no device sync)."""
    check(x_FH, "x_FH", FLOATS, ndim=2)
    F, H = x_FH.shape
    check(ids_FK, "ids_FK", (torch.int64, torch.int32), ndim=2, contiguous=True)
    check(w_FK, "w_FK", torch.float32, ndim=2, contiguous=True)
    K = ids_FK.shape[1]
    assert ids_FK.shape[0] == F and w_FK.shape == ids_FK.shape, \
        f"ids {tuple(ids_FK.shape)} / weights {tuple(w_FK.shape)} do not match {F} rows"
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: allowed {', '.join(ACTIVATIONS)}")
    check(w_down_EHI, "w_down_EHI", x_FH.dtype, ndim=3, contiguous=True)
    for name, t in (("w_gate_EIH", w_gate_EIH), ("w_up_EIH", w_up_EIH)):
        check(t, name, x_FH.dtype, ndim=3)
        if t.stride(2) != 1 or t.stride() != w_gate_EIH.stride():
            raise ValueError(f"{name}: strides {t.stride()} (gate {w_gate_EIH.stride()}): the gate and up weights "
                             "must be contiguous along H and share one layout")
    E, I, H2 = w_gate_EIH.shape
    assert H2 == H and w_up_EIH.shape == (E, I, H) and w_down_EHI.shape == (E, H, I), \
        f"expert weights {tuple(w_gate_EIH.shape)}, {tuple(w_up_EIH.shape)}, {tuple(w_down_EHI.shape)} vs H={H}"
    y = torch.empty(F, H, dtype=x_FH.dtype, device=x_FH.device)
    if F == 0:
        return y
    check_runnable(x_FH.device)
    P = F * K
    BM = block_m or pick_block_m(P, E)
    sorted_ids, expert_ids, npost = align_triton(ids_FK, E, BM)
    MB = expert_ids.shape[0]
    if INTERPRET if exact_grid is None else exact_grid:
        MB = int(npost[0]) // BM
        if MB == 0:
            return y.zero_()
    F32 = f32_mode(x_FH.dtype)
    h_PI = torch.empty(P, I, dtype=x_FH.dtype, device=x_FH.device)        # by pair; invalid rows never touched
    o_PH = torch.empty(P, H, dtype=torch.float32, device=x_FH.device)
    cap = 256 if INTERPRET else 64          # the interpreter pays per op, not per element: fewer, larger tiles
    BN_I = block_n or min(cap, max(16, next_pow2(I)))
    BN_H = block_n or min(cap, max(16, next_pow2(H)))
    BK_H = block_k or min(cap, max(16, next_pow2(H)))
    BK_I = block_k or min(cap, max(16, next_pow2(I)))
    gate_up_kernel[(MB, triton.cdiv(I, BN_I))](
        x_FH, w_gate_EIH, w_up_EIH, h_PI, sorted_ids, expert_ids, npost, P, H, I,
        x_FH.stride(0), w_gate_EIH.stride(0), w_gate_EIH.stride(1), h_PI.stride(0),
        K=K, BLOCK_M=BM, BLOCK_N=BN_I, BLOCK_K=BK_H, F32=F32, GELU=activation == "gelu_tanh")
    down_kernel[(MB, triton.cdiv(H, BN_H))](
        h_PI, w_down_EHI, w_FK, o_PH, sorted_ids, expert_ids, npost, P, H, I,
        h_PI.stride(0), w_down_EHI.stride(0), w_down_EHI.stride(1), o_PH.stride(0),
        BLOCK_M=BM, BLOCK_N=BN_H, BLOCK_K=BK_I, F32=F32)
    BF = min(32, next_pow2(F))
    BH = min(128, next_pow2(H))
    moe_sum_kernel[(triton.cdiv(F, BF), triton.cdiv(H, BH))](o_PH, ids_FK, y, F, H, o_PH.stride(0), y.stride(0),
                                                              K=K, BLOCK_F=BF, BLOCK_H=BH)
    return y
