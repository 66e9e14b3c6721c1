"""Attention of a batched denoising call over [prefix cache ; in-flight segments], on a tile schedule that skips
masked tiles.

Letter legend: B requests, N query heads, G kv heads (GQA: head n reads kv head n // (N/G)), L padded query rows
(new rows), Lc padded cache rows, S = Lc + L keys, D head dim, TL tile (rows = keys per tile), NQ = ceil(L/TL)
query tiles, NK = ceil(S/TL) key tiles.

Layout (`dblock.reference.executor.build_layout`): keys are [cache padded to Lc ; new rows padded to L]. Query
row q of request b (q < n_b, its valid rows) sees cache key j iff j < Lc_b and new key r iff
visibility[seg(q), seg(r)]; a padded row (q >= n_b) sees only itself (so it stays finite).

Tile schedule. Per request, derived from the StepInput description alone (cache length, segment lengths,
visibility), never from the dense mask: with the segments as intervals, the number of visible (query, key) pairs
in tile (i, j) is  O_q[i] @ V @ O_k[j]  (O: interval overlaps with the tile; V: visibility plus a cache column)
plus the padded rows' diagonal. A tile is *full* when all TL*TL pairs are visible, *partial* when some are,
*skipped* otherwise. The fields and their meaning are FlexAttention's `BlockMask` (with H = 1, the mask is the
same for every head): kv_num_blocks / kv_indices list the partial tiles of each (b, query tile), full_kv_num_blocks
/ full_kv_indices the full ones (ascending; entries past the count are 0). `tests/kernels` checks them against
`create_block_mask(mask_mod, B, 1, L, S, BLOCK_SIZE=TL)` for the same mask. Like Flex, a tile that reaches past L
or S is never full.

Partial tiles. With TL = the block size C (or a power-of-two divisor of it, see pick_tile), a Native / OBA /
FlowBlock call with a KV cache has no partial tile (the cache and every segment are whole blocks), except the
diagonal tiles of padded rows when requests carry different numbers of segments. Where lengths are not multiples
of TL (llada_moe's single full-sequence segment, a block size below the minimum tile, ragged caches), partial
tiles take their element mask from the dense mask `mask_BLS` (read only for partial tiles, one byte per pair):
one kernel, no torch fallback.

Worked example (TL = 2; request 0: cache 2, segments [current 2, warm-up 2], visibility [[1, 0], [1, 1]];
request 1: no cache, one segment of 2 rows; so Lc = 2, L = 4, S = 6, NQ = 2, NK = 3):
    request 0: q-tile 0 (current) -> full [0, 1]        q-tile 1 (warm-up) -> full [0, 1, 2]
    request 1: q-tile 0 -> full [1] (cache tile 0 is request 0's only: skipped)
               q-tile 1 (padded rows 2, 3: each sees only itself) -> partial [2]
    full_kv_num_blocks = [[[2, 3]], [[1, 0]]]   kv_num_blocks = [[[0, 0]], [[0, 1]]]

Kernel: one program per (query tile, request x kv head), the query heads sharing the kv head stacked as rows
(GQA packing: each key tile is loaded once for all of them); online softmax in fp32 over the full tiles (no mask)
and then the partial ones (element mask, and p = 0 where masked so a row with no visible key in a tile adds
nothing); rows that see nothing at all (none exist in practice) come out 0, never NaN. Cache keys are read from
past_k/v and new keys from k/v directly (no concatenated copy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import torch

from dblock.kernels import FLOATS, INTERPRET, check, check_runnable, f32_mode, next_pow2, triton, tl


@dataclass
class TileSchedule:
    """FlexAttention-style block mask of one call (int32, H = 1)."""

    tile: int
    kv_num_blocks: torch.Tensor        # (B, 1, NQ)      partial tiles per query tile
    kv_indices: torch.Tensor           # (B, 1, NQ, NK)  their key-tile indices, ascending
    full_kv_num_blocks: torch.Tensor   # (B, 1, NQ)
    full_kv_indices: torch.Tensor      # (B, 1, NQ, NK)

    def to(self, device) -> "TileSchedule":
        return TileSchedule(self.tile, *(t.to(device) for t in (self.kv_num_blocks, self.kv_indices,
                                                                  self.full_kv_num_blocks, self.full_kv_indices)))

    def counts(self) -> dict:
        """Tiles computed with and without masks, and skipped (for traces and the benchmark)."""
        B, _, NQ, NK = self.kv_indices.shape
        part, full = int(self.kv_num_blocks.sum()), int(self.full_kv_num_blocks.sum())
        return {"full": full, "partial": part, "skipped": B * NQ * NK - full - part}


def _pack(full_QK: torch.Tensor, partial_QK: torch.Tensor):
    """(..., NQ, NK) bool -> counts (..., NQ) and ascending indices (..., NQ, NK), 0 past the count."""
    def one(m):
        n = m.sum(-1).to(torch.int32)
        idx = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        keep = torch.arange(m.shape[-1]) < n[..., None]
        return n, torch.where(keep, idx, torch.zeros_like(idx))
    return one(partial_QK) + one(full_QK)


def _overlap(lo_X: torch.Tensor, hi_X: torch.Tensor, lo_Y: torch.Tensor, hi_Y: torch.Tensor) -> torch.Tensor:
    """|[lo_x, hi_x) ∩ [lo_y, hi_y)| for every pair -> (X, Y) int64."""
    return (torch.minimum(hi_X[:, None], hi_Y[None, :]) - torch.maximum(lo_X[:, None], lo_Y[None, :])).clamp(min=0)


def tile_schedule(cache_lens: list, seg_lens: list, visibility: list, tile: int) -> TileSchedule:
    """The schedule from the StepInput description: per request its cache length, segment lengths and (S, S)
    visibility. Padded sizes Lc = max cache length, L = max rows, as build_layout pads them."""
    B = len(cache_lens)
    lens = [sum(s) for s in seg_lens]
    Lc, L = max(cache_lens), max(lens)
    S = Lc + L
    NQ, NK = -(-L // tile), -(-S // tile)
    q_lo = torch.arange(NQ, dtype=torch.int64) * tile
    k_lo = torch.arange(NK, dtype=torch.int64) * tile
    q_hi, k_hi = q_lo + tile, k_lo + tile
    full = torch.zeros(B, 1, NQ, NK, dtype=torch.bool)
    partial = torch.zeros(B, 1, NQ, NK, dtype=torch.bool)
    for b in range(B):
        n = torch.tensor(seg_lens[b], dtype=torch.int64)
        s_hi = torch.cumsum(n, 0)
        s_lo = s_hi - n
        vis = torch.as_tensor(visibility[b]).to(torch.int64)
        Oq = _overlap(q_lo, q_hi, s_lo, s_hi)                             # (NQ, nS)
        Ok = _overlap(k_lo, k_hi, Lc + s_lo, Lc + s_hi)                   # (NK, nS)
        Oc = _overlap(k_lo, k_hi, torch.zeros(1, dtype=torch.int64),
                      torch.tensor([cache_lens[b]], dtype=torch.int64))   # (NK, 1)
        count = Oq @ vis @ Ok.T + Oq.sum(1, keepdim=True) @ Oc.T          # (NQ, NK) visible pairs
        # padded rows q in [n_b, L) see key Lc + q only: |q-tile ∩ [n_b, L) ∩ (k-tile - Lc)|
        pad_lo, pad_hi = torch.maximum(q_lo, torch.tensor(lens[b])), torch.minimum(q_hi, torch.tensor(L))
        count += _overlap(pad_lo, pad_hi, k_lo - Lc, k_hi - Lc) * (pad_hi > pad_lo)[:, None]
        full[b, 0] = count == tile * tile
        partial[b, 0] = (count > 0) & (count < tile * tile)
    kvn, kvi, fkvn, fkvi = _pack(full, partial)
    return TileSchedule(tile, kvn, kvi, fkvn, fkvi)


def tile_schedule_torch(mask_BLS: torch.Tensor, tile: int) -> TileSchedule:
    """Golden model: the same schedule read off the dense mask (padded with False to whole tiles, as Flex does)."""
    B, L, S = mask_BLS.shape
    NQ, NK = -(-L // tile), -(-S // tile)
    m = torch.zeros(B, NQ * tile, NK * tile, dtype=torch.int64)
    m[:, :L, :S] = mask_BLS.cpu().to(torch.int64)
    count = m.view(B, NQ, tile, NK, tile).sum((2, 4))[:, None]            # (B, 1, NQ, NK)
    kvn, kvi, fkvn, fkvi = _pack(count == tile * tile, (count > 0) & (count < tile * tile))
    return TileSchedule(tile, kvn, kvi, fkvn, fkvi)


def pick_tile(lengths: list, dtype: torch.dtype) -> int:
    """The largest power of two dividing every length (cache, segments, padded sizes), up to a cap: the block size C
    for block layouts, or a divisor of it (still no partial tile). Cap 64 under the interpreter (fewer programs),
    32 compiled, 16 compiled in fp32 (the GQA-packed query block REP * tile stays within registers). Floor 8 under the interpreter and
    for fp32, 16 for 16-bit `tl.dot` on a GPU (its K >= 16); below the floor partial tiles do the masking."""
    g = reduce(math.gcd, [int(x) for x in lengths if x], 0)
    t = 64 if INTERPRET else (16 if dtype == torch.float32 else 32)      # fp32 IEEE dots need more registers
    while t > 1 and g % t:
        t //= 2
    floor = 8 if (INTERPRET or dtype == torch.float32) else 16
    return max(t, floor)


# ---------------------------------------------------------------------------------------------------------------
# golden model
# ---------------------------------------------------------------------------------------------------------------

def attention_torch(q_BNLD, k_BGLD, v_BGLD, past_k_BGCD, past_v_BGCD, mask_BLS, scale: float) -> torch.Tensor:
    """Dense masked softmax (fp32, or fp64 for fp64 inputs) -> (B, L, N, D) in q's dtype."""
    acc = torch.promote_types(q_BNLD.dtype, torch.float32)
    keys = k_BGLD if past_k_BGCD is None else torch.cat([past_k_BGCD, k_BGLD], dim=2)   # (B, G, S, D)
    vals = v_BGLD if past_v_BGCD is None else torch.cat([past_v_BGCD, v_BGLD], dim=2)
    rep = q_BNLD.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(rep, dim=1).to(acc)                    # (B, N, S, D)
    vals = vals.repeat_interleave(rep, dim=1).to(acc)
    att = (q_BNLD.to(acc) @ keys.transpose(-2, -1)) * scale              # (B, N, L, S)
    att = att.masked_fill(~mask_BLS[:, None], float("-inf")).softmax(-1)
    return (att @ vals).transpose(1, 2).to(q_BNLD.dtype)                 # (B, L, N, D)


# ---------------------------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def attention_kernel(q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, mask_ptr, o_ptr, kvn_ptr, kvi_ptr, fkvn_ptr, fkvi_ptr,
                         L, Lc, D, scale, NQ, NK,
                         sq_b, sq_n, sq_l, sk_b, sk_g, sk_l, sv_b, sv_g, sv_l,
                         spk_b, spk_g, spk_l, spv_b, spv_g, spv_l, sm_b, sm_l, so_b, so_l, so_n,
                         G: tl.constexpr, REP: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_D: tl.constexpr, CACHE_ALIGNED: tl.constexpr, F32: tl.constexpr):
        """One program per (query tile, request x kv head): the REP query heads that share the kv head are stacked
        into BLOCK_M = REP * TILE rows (row r: head g*REP + r // TILE, query row r % TILE), so every key tile is
        loaded once for all of them. Full tiles first, then partial ones, in one loop."""
        qt = tl.program_id(0)
        bg = tl.program_id(1)
        b = (bg // G).to(tl.int64)
        g = bg % G
        r = tl.arange(0, BLOCK_M)
        n = g * REP + r // TILE                                          # (BLOCK_M,) query head of each row
        offs_q = qt * TILE + r % TILE                                    # (BLOCK_M,) query row
        qmask = (offs_q < L) & (r < REP * TILE)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + b * sq_b + n[:, None] * sq_n + offs_q[:, None] * sq_l + d[None, :],
                    mask=qmask[:, None] & dmask[None, :], other=0.0)
        if F32:
            q = q.to(tl.float32)
        kb_ptr = k_ptr + b * sk_b + g * sk_g
        vb_ptr = v_ptr + b * sv_b + g * sv_g
        pkb_ptr = pk_ptr + b * spk_b + g * spk_g
        pvb_ptr = pv_ptr + b * spv_b + g * spv_g
        mrow_ptr = mask_ptr + b * sm_b + offs_q[:, None] * sm_l          # (BLOCK_M, 1) mask row pointers
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        sched = b * NQ + qt
        n_full = tl.load(fkvn_ptr + sched)
        n_all = n_full + tl.load(kvn_ptr + sched)
        for t in range(n_all):
            partial = t >= n_full
            j = tl.load(tl.where(partial, kvi_ptr + sched * NK + t - n_full, fkvi_ptr + sched * NK + t))
            kpos = j * TILE + tl.arange(0, TILE)                         # padded key positions
            new_r = kpos - Lc
            in_new = (kpos >= Lc) & (new_r < L)
            if CACHE_ALIGNED:                                            # a tile is all cache or all new rows
                if j * TILE < Lc:
                    kT = tl.load(pkb_ptr + kpos[None, :] * spk_l + d[:, None], mask=dmask[:, None], other=0.0)
                    v = tl.load(pvb_ptr + kpos[:, None] * spv_l + d[None, :], mask=dmask[None, :], other=0.0)
                else:
                    kT = tl.load(kb_ptr + new_r[None, :] * sk_l + d[:, None],
                                 mask=in_new[None, :] & dmask[:, None], other=0.0)
                    v = tl.load(vb_ptr + new_r[:, None] * sv_l + d[None, :],
                                mask=in_new[:, None] & dmask[None, :], other=0.0)
            else:                                                        # a tile may straddle cache | new rows
                in_cache = kpos < Lc
                kT = tl.load(pkb_ptr + kpos[None, :] * spk_l + d[:, None], mask=in_cache[None, :] & dmask[:, None],
                             other=0.0) + \
                    tl.load(kb_ptr + new_r[None, :] * sk_l + d[:, None], mask=in_new[None, :] & dmask[:, None],
                            other=0.0)
                v = tl.load(pvb_ptr + kpos[:, None] * spv_l + d[None, :], mask=in_cache[:, None] & dmask[None, :],
                            other=0.0) + \
                    tl.load(vb_ptr + new_r[:, None] * sv_l + d[None, :], mask=in_new[:, None] & dmask[None, :],
                            other=0.0)
            if F32:
                s = tl.dot(q, kT.to(tl.float32), input_precision="ieee") * scale
            else:
                s = tl.dot(q, kT) * scale                                # (BLOCK_M, TILE) fp32
            # element mask of a partial tile (full tiles load nothing: the load is predicated off)
            part_K = (kpos * 0 + t) >= n_full                            # (TILE,): `partial` as a vector
            vis = tl.load(mrow_ptr + kpos[None, :], mask=part_K[None, :] & qmask[:, None] & (kpos < Lc + L)[None, :],
                          other=0) != 0
            vis = vis | (~part_K[None, :])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # no (-inf) - (-inf)
            alpha = tl.exp(m_i - m_safe)
            p = tl.where(vis, tl.exp(s - m_safe[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if F32:
                acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + b * so_b + offs_q[:, None] * so_l + n[:, None] * so_n + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=qmask[:, None] & dmask[None, :])


def attention_triton(q_BNLD: torch.Tensor, k_BGLD: torch.Tensor, v_BGLD: torch.Tensor, past_k_BGCD, past_v_BGCD,
                     mask_BLS: torch.Tensor, sched: TileSchedule, scale: float) -> torch.Tensor:
    """Launcher. q (B, N, L, D); k, v (B, G, L, D); past_k/v (B, G, Lc, D) or None; mask (B, L, Lc + L) bool (read
    for partial tiles only); all of one float dtype with stride 1 on D. -> (B, L, N, D) contiguous, q's dtype."""
    check(q_BNLD, "q_BNLD", FLOATS, ndim=4)
    B, N, L, D = q_BNLD.shape
    check(k_BGLD, "k_BGLD", q_BNLD.dtype, ndim=4)
    check(v_BGLD, "v_BGLD", q_BNLD.dtype, ndim=4)
    G = k_BGLD.shape[1]
    assert k_BGLD.shape == (B, G, L, D) and v_BGLD.shape == (B, G, L, D) and N % G == 0, \
        f"q {tuple(q_BNLD.shape)}, k {tuple(k_BGLD.shape)}, v {tuple(v_BGLD.shape)}"
    if past_k_BGCD is None:
        Lc = 0
        past_k_BGCD, past_v_BGCD = k_BGLD, v_BGLD                        # never read (Lc = 0)
    else:
        check(past_k_BGCD, "past_k", q_BNLD.dtype, ndim=4)
        check(past_v_BGCD, "past_v", q_BNLD.dtype, ndim=4)
        Lc = past_k_BGCD.shape[2]
        assert past_k_BGCD.shape == (B, G, Lc, D) and past_v_BGCD.shape == (B, G, Lc, D), \
            f"past_k {tuple(past_k_BGCD.shape)}, past_v {tuple(past_v_BGCD.shape)} vs {(B, G, '*', D)}"
    check(mask_BLS, "mask_BLS", torch.bool, ndim=3)
    assert mask_BLS.shape == (B, L, Lc + L), f"mask {tuple(mask_BLS.shape)} != {(B, L, Lc + L)}"
    TL = sched.tile
    NQ, NK = -(-L // TL), -(-(Lc + L) // TL)
    assert sched.kv_indices.shape == (B, 1, NQ, NK), f"schedule {tuple(sched.kv_indices.shape)} vs {(B, 1, NQ, NK)}"
    for t in (sched.kv_num_blocks, sched.kv_indices, sched.full_kv_num_blocks, sched.full_kv_indices):
        check(t, "schedule", torch.int32, contiguous=True, device=q_BNLD.device)
    out = torch.empty(B, L, N, D, dtype=q_BNLD.dtype, device=q_BNLD.device)
    if B * L == 0:
        return out
    check_runnable(q_BNLD.device)
    m = mask_BLS.view(torch.uint8)
    BLOCK_M, BLOCK_D = next_pow2(N // G * TL), max(16, next_pow2(D))
    attention_kernel[(NQ, B * G)](
        q_BNLD, k_BGLD, v_BGLD, past_k_BGCD, past_v_BGCD, m, out,
        sched.kv_num_blocks, sched.kv_indices, sched.full_kv_num_blocks, sched.full_kv_indices,
        L, Lc, D, float(scale), NQ, NK,
        q_BNLD.stride(0), q_BNLD.stride(1), q_BNLD.stride(2),
        k_BGLD.stride(0), k_BGLD.stride(1), k_BGLD.stride(2),
        v_BGLD.stride(0), v_BGLD.stride(1), v_BGLD.stride(2),
        past_k_BGCD.stride(0), past_k_BGCD.stride(1), past_k_BGCD.stride(2),
        past_v_BGCD.stride(0), past_v_BGCD.stride(1), past_v_BGCD.stride(2),
        m.stride(0), m.stride(1), out.stride(0), out.stride(1), out.stride(2),
        G=G, REP=N // G, TILE=TL, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, CACHE_ALIGNED=Lc % TL == 0,
        F32=f32_mode(q_BNLD.dtype), num_warps=8 if BLOCK_M * BLOCK_D >= 128 * 128 else 4)
    return out
