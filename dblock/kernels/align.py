"""Align: the (row, slot) pairs of a routed batch grouped by expert and padded to BLOCK_M (vLLM's
`moe_align_block_size` layout), so that every M-block of the grouped MLP belongs to exactly one expert.

Letter legend: F rows, K slots per row, P = F*K flat pairs (pair p = f*K + k), E experts, BM = BLOCK_M,
PP = P + E*(BM-1) (the longest padded length), MB = ceil(PP / BM) M-blocks, NC chunks of the count stage.

Layout (int32):
  sorted_ids_PP   flat pair indices grouped by expert, each expert's run padded up to a multiple of BM with the
                  sentinel P; within an expert pairs keep flat order (a stable sort); the tail past
                  num_post_padded is all sentinel.
  expert_ids_MB   the expert of each M-block; -1 for blocks at or past num_post_padded (nothing to do).
  num_post_padded (1,): total padded length (a multiple of BM).
Slots with id -1 (no expert, or an expert on another rank) are left out: they load no weights.

Worked example (F = 4 rows, K = 2, E = 4, BLOCK_M = 4; expert 1 empty, row 1 slot 1 has no expert):
    ids_FK = [[2, 0], [0, -1], [2, 0], [3, 0]]   flat: [2, 0, 0, -1, 2, 0, 3, 0]   P = 8 (sentinel)
    expert 0 <- pairs 1, 2, 5, 7;  expert 1 <- none;  expert 2 <- pairs 0, 4;  expert 3 <- pair 6
    sorted_ids      = [1, 2, 5, 7,  0, 4, 8, 8,  6, 8, 8, 8,  8, 8, 8, 8,  8, 8, 8, 8]   (PP = 8 + 4*3 = 20)
    expert_ids      = [0, 2, 3, -1, -1]                                                   (MB = 5)
    num_post_padded = [12]

Triton path (after sglang's, no atomics, deterministic): (1) one program per chunk of pairs counts its experts
into row c+1 of an (NC+1, E) matrix; (2) one program turns the matrix into per-chunk exclusive prefixes (column
cumsum), pads the totals to BM, writes the expert offsets, num_post_padded and expert_ids; (3) one program per
chunk places each pair at offset[e] + prefix[c, e] + its rank among the chunk's pairs of expert e.
"""
from __future__ import annotations

import torch

from dblock.kernels import check, check_runnable, next_pow2, triton, tl


def align_sizes(P: int, E: int, block_m: int) -> tuple[int, int]:
    """(PP, MB): length of sorted_ids and number of M-blocks for P pairs."""
    PP = P + E * (block_m - 1)
    return PP, -(-PP // block_m)


# ---------------------------------------------------------------------------------------------------------------
# golden model
# ---------------------------------------------------------------------------------------------------------------

def align_torch(ids_FK: torch.Tensor, num_experts: int, block_m: int):
    """The layout above in torch: -> sorted_ids (PP,), expert_ids (MB,), num_post_padded (1,), all int32."""
    dev = ids_FK.device
    flat = ids_FK.reshape(-1).long()
    P = flat.numel()
    PP, MB = align_sizes(P, num_experts, block_m)
    sorted_ids = torch.full((PP,), P, dtype=torch.int32, device=dev)
    expert_ids = torch.full((MB,), -1, dtype=torch.int32, device=dev)
    valid = (flat >= 0).nonzero(as_tuple=True)[0]
    order = valid[torch.sort(flat[valid], stable=True).indices]            # pairs in expert order, stable
    counts = torch.bincount(flat[valid], minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded                               # (E,) exclusive
    rank = torch.arange(order.numel(), device=dev) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    sorted_ids[starts.repeat_interleave(counts) + rank] = order.to(torch.int32)
    blocks = padded // block_m
    expert_ids[: int(blocks.sum())] = torch.arange(num_experts, device=dev).repeat_interleave(blocks).to(torch.int32)
    return sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def align_count_kernel(ids_ptr, cnt_ptr, P, E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
        """Stage 1: experts of chunk c counted into row c + 1 of cnt (NC+1, E)."""
        c = tl.program_id(0)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        cols = tl.arange(0, BLOCK_E)
        onehot = (e[:, None] == cols[None, :]).to(tl.int32)                  # (CHUNK, BLOCK_E); -1 matches none
        tl.store(cnt_ptr + (c + 1) * E + cols, tl.sum(onehot, axis=0), mask=cols < E)

    @triton.jit
    def align_offsets_kernel(cnt_ptr, offsets_ptr, expert_ids_ptr, npost_ptr, NC, MB, E: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
        """Stage 2 (one program): column cumsum of cnt -> per-chunk exclusive prefixes; padded expert offsets
        (E+1), num_post_padded, expert_ids of every M-block."""
        cols = tl.arange(0, BLOCK_E)
        cmask = cols < E
        carry = tl.zeros((BLOCK_E,), tl.int32)
        for r0 in range(0, NC + 1, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            m = (r[:, None] <= NC) & cmask[None, :]
            v = tl.load(cnt_ptr + r[:, None] * E + cols[None, :], mask=m, other=0)
            cs = tl.cumsum(v, axis=0) + carry[None, :]                      # row 0 is 0: row c = sum of chunks < c
            tl.store(cnt_ptr + r[:, None] * E + cols[None, :], cs, mask=m)
            carry = carry + tl.sum(v, axis=0)
        padded = (carry + BLOCK_M - 1) // BLOCK_M * BLOCK_M                 # (BLOCK_E,), 0 past E
        ends = tl.cumsum(padded, axis=0)                                    # inclusive
        tl.store(offsets_ptr + cols, ends - padded, mask=cmask)
        total = tl.sum(padded, axis=0)
        tl.store(offsets_ptr + E, total)
        tl.store(npost_ptr, total)
        for m0 in range(0, MB, BLOCK_R):
            mb = m0 + tl.arange(0, BLOCK_R)
            start = mb * BLOCK_M
            before = ((ends[None, :] <= start[:, None]) & cmask[None, :]).to(tl.int32)   # experts ending before
            eid = tl.sum(before, axis=1)
            tl.store(expert_ids_ptr + mb, tl.where(start < total, eid, -1), mask=mb < MB)

    @triton.jit
    def align_scatter_kernel(ids_ptr, cnt_ptr, offsets_ptr, sorted_ptr, P, E: tl.constexpr, CHUNK: tl.constexpr,
                             BLOCK_E: tl.constexpr):
        """Stage 3: pair i of chunk c goes to offsets[e] + prefix[c, e] + rank of i among the chunk's e-pairs."""
        c = tl.program_id(0)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        valid = e >= 0
        cols = tl.arange(0, BLOCK_E)
        onehot = (e[:, None] == cols[None, :]).to(tl.int32)                  # (CHUNK, BLOCK_E)
        rank = tl.sum(tl.where(onehot != 0, tl.cumsum(onehot, axis=0) - 1, 0), axis=1)
        es = tl.where(valid, e, 0)
        base = tl.load(offsets_ptr + es, mask=valid, other=0) + tl.load(cnt_ptr + c * E + es, mask=valid, other=0)
        tl.store(sorted_ptr + base + rank, offs.to(tl.int32), mask=valid)


def align_triton(ids_FK: torch.Tensor, num_experts: int, block_m: int, chunk: int | None = None):
    """Launcher: ids (F, K) int64/int32 contiguous, -1 = no expert. -> sorted_ids, expert_ids, num_post_padded."""
    check(ids_FK, "ids_FK", (torch.int64, torch.int32), ndim=2, contiguous=True)
    assert block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m={block_m}: a power of two"
    E = num_experts
    dev = ids_FK.device
    P = ids_FK.numel()
    PP, MB = align_sizes(P, E, block_m)
    assert PP < 2 ** 31, f"{PP} padded pairs do not fit int32"
    sorted_ids = torch.full((PP,), P, dtype=torch.int32, device=dev)
    expert_ids = torch.empty((MB,), dtype=torch.int32, device=dev)
    npost = torch.empty((1,), dtype=torch.int32, device=dev)
    BLOCK_E = next_pow2(E)
    CHUNK = chunk or max(16, min(next_pow2(max(P, 1)), 8192 // BLOCK_E, 256))
    NC = triton.cdiv(P, CHUNK)
    cnt = torch.zeros((NC + 1, E), dtype=torch.int32, device=dev)
    offsets = torch.empty((E + 1,), dtype=torch.int32, device=dev)
    check_runnable(dev)
    if NC:
        align_count_kernel[(NC,)](ids_FK, cnt, P, E=E, CHUNK=CHUNK, BLOCK_E=BLOCK_E)
    align_offsets_kernel[(1,)](cnt, offsets, expert_ids, npost, NC, MB, E=E, BLOCK_M=block_m, BLOCK_E=BLOCK_E,
                               BLOCK_R=16)
    if NC:
        align_scatter_kernel[(NC,)](ids_FK, cnt, offsets, sorted_ids, P, E=E, CHUNK=CHUNK, BLOCK_E=BLOCK_E)
    return sorted_ids, expert_ids, npost
