"""Attention over [prefix cache ; in-flight segments]: the tile schedule derived from StepInputs equals
FlexAttention's `create_block_mask` for the same (dense) mask, and the kernel matches an fp64 dense softmax."""
import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dblock.forward import Segment, StepInput, block_causal, dense
from dblock.kernels.attention import (attention_torch, attention_triton, pick_tile, tile_schedule,
                                      tile_schedule_torch)
from dblock.kernels.stack import schedule_for
from dblock.reference.executor import build_layout
from tests.conftest import tol

C = 8                      # block size of these layouts
OBA = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)


def items_of(spec):
    """spec: per request (cache length, segment lengths, visibility) -> StepInputs as the schedules build them."""
    items = []
    for b, (lc, segs, vis) in enumerate(spec):
        ss, start = [], lc
        for i, n in enumerate(segs):
            ss.append(Segment(block=i, tokens=torch.zeros(n, dtype=torch.long),
                              positions=torch.arange(start, start + n), live=torch.ones(n, dtype=torch.bool),
                              decoded=torch.zeros(n, dtype=torch.bool)))
            start += n
        items.append(StepInput(b, ss, vis, SimpleNamespace(length=lc) if lc else None))
    return items


LAYOUTS = {
    "native_cache": [(2 * C, [C], dense(1))],
    "native_first_block": [(0, [C], dense(1))],
    "oba_paired": [(C, [C, C], OBA)],
    "oba_dense_mask": [(C, [C, C], dense(2))],
    "flowblock_w3": [(2 * C, [C, C, C], block_causal(3))],
    "no_cache_prefix": [(0, [C, C, C, C], block_causal(4))],
    "llada_moe_fullseq": [(0, [13], dense(1))],                                     # partial tiles
    "mixed_batch": [(2 * C, [C, C], OBA), (0, [C], dense(1)), (C, [C, C, C], block_causal(3))],
    "ragged_cache": [(5, [C], dense(1)), (3, [C, C], OBA)],                         # tiles straddle cache|new
    "fullseq_and_block": [(0, [11], dense(1)), (C, [C], dense(1))],
    "one_token": [(0, [1], dense(1))],
}


def mask_of(items):
    return build_layout(items, "cpu")[2]                             # (B, L, Lc + L) bool, the executor's mask


def flex_schedule(mask, tile):
    B, L, S = mask.shape
    bm = create_block_mask(lambda b, h, q, kv: mask[b, q, kv], B, 1, L, S, device="cpu", BLOCK_SIZE=tile)
    return bm


def same_schedule(ours, flex):
    """Counts exact; the first `count` indices of every (b, q-tile) equal as sets."""
    for n_a, i_a, n_b, i_b in ((ours.kv_num_blocks, ours.kv_indices, flex.kv_num_blocks, flex.kv_indices),
                               (ours.full_kv_num_blocks, ours.full_kv_indices, flex.full_kv_num_blocks,
                                flex.full_kv_indices)):
        assert torch.equal(n_a, n_b.to(n_a.dtype)), f"counts\n{n_a}\n{n_b}"
        B, H, NQ = n_a.shape
        for b in range(B):
            for q in range(NQ):
                n = int(n_a[b, 0, q])
                assert sorted(i_a[b, 0, q, :n].tolist()) == sorted(i_b[b, 0, q, :n].tolist())


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("tile", [None, 2 * C])
def test_schedule_equals_flex_block_mask(name, tile):
    items = items_of(LAYOUTS[name])
    mask = mask_of(items)
    ours = schedule_for(items, torch.float32, tile)                 # from the StepInputs, not the mask
    same_schedule(ours, flex_schedule(mask, ours.tile))
    gold = tile_schedule_torch(mask, ours.tile)
    for a, b in zip((ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks, ours.full_kv_indices),
                    (gold.kv_num_blocks, gold.kv_indices, gold.full_kv_num_blocks, gold.full_kv_indices)):
        assert torch.equal(a, b)


def test_block_tile_has_no_partial_tiles_and_skips_masked_ones():
    for name in ("native_cache", "oba_paired", "flowblock_w3", "no_cache_prefix"):
        s = schedule_for(items_of(LAYOUTS[name]), torch.float32)
        assert s.tile == C and s.counts()["partial"] == 0, name
    assert schedule_for(items_of(LAYOUTS["oba_paired"]), torch.float32).counts() == \
        {"full": 2 + 3, "partial": 0, "skipped": 1}                  # current skips the warm-up tile
    s = schedule_for(items_of(LAYOUTS["no_cache_prefix"]), torch.float32)
    assert s.counts() == {"full": 10, "partial": 0, "skipped": 6}     # block-causal: 4*5/2 of 16
    assert schedule_for(items_of(LAYOUTS["llada_moe_fullseq"]), torch.float32).counts()["partial"] > 0


def test_docstring_example():
    s = tile_schedule([2, 0], [[2, 2], [2]], [OBA, dense(1)], tile=2)
    assert s.full_kv_num_blocks.tolist() == [[[2, 3]], [[1, 0]]]
    assert s.kv_num_blocks.tolist() == [[[0, 0]], [[0, 1]]]
    assert s.full_kv_indices[0, 0, 1].tolist() == [0, 1, 2] and s.kv_indices[1, 0, 1, 0] == 2


def qkv(B, N, G, L, Lc, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, L, D, generator=g)
    k = torch.randn(B, L, G, D, generator=g).transpose(1, 2)        # strided like project_qkv's views
    v = torch.randn(B, L, G, D, generator=g).transpose(1, 2)
    pk = torch.randn(B, G, Lc, D, generator=g) if Lc else None
    pv = torch.randn(B, G, Lc, D, generator=g) if Lc else None
    return q, k, v, pk, pv


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("N,G,D", [(4, 2, 16), (2, 2, 12)])
def test_kernel_matches_fp64_reference(name, N, G, D):
    items = items_of(LAYOUTS[name])
    mask = mask_of(items)
    B, L, S = mask.shape
    q, k, v, pk, pv = qkv(B, N, G, L, S - L, D, seed=len(name) + N)
    sched = schedule_for(items, torch.float32)
    out = attention_triton(q, k, v, pk, pv, mask, sched, 1 / math.sqrt(D))
    ref = attention_torch(*[t.double() if t is not None else None for t in (q, k, v, pk, pv)], mask,
                          1 / math.sqrt(D))
    assert out.shape == (B, L, N, D)
    torch.testing.assert_close(out.double(), ref, **tol(torch.float32))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_kernel_matches_flex_attention_on_paired_layout():
    items = items_of(LAYOUTS["mixed_batch"])
    mask = mask_of(items)
    B, L, S = mask.shape
    q, k, v, pk, pv = qkv(B, 4, 2, L, S - L, 16, seed=3)
    sched = schedule_for(items, torch.float32)
    out = attention_triton(q, k, v, pk, pv, mask, sched, 0.25)
    keys, vals = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
    fx = flex_attention(q, keys, vals, block_mask=flex_schedule(mask, sched.tile), scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, fx.transpose(1, 2), **tol(torch.float32))


def test_pick_tile():
    assert pick_tile([16, 32, 0, 48], torch.float32) == 16
    assert pick_tile([64, 128], torch.float32) == 64
    assert pick_tile([13, 8], torch.float32) == 8                    # floor: partial tiles do the masking
    assert pick_tile([8, 8], torch.bfloat16) in (8, 16)              # 16 for compiled bf16 dots


def test_launcher_asserts_layout():
    items = items_of(LAYOUTS["native_cache"])
    mask = mask_of(items)
    q, k, v, pk, pv = qkv(1, 4, 2, C, 2 * C, 16, 0)
    sched = schedule_for(items, torch.float32)
    with pytest.raises(AssertionError, match="mask"):
        attention_triton(q, k, v, pk, pv, mask[:, :, 1:], sched, 0.25)
    with pytest.raises(AssertionError, match="stride 1"):
        attention_triton(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, pk, pv, mask, sched, 0.25)
    with pytest.raises(AssertionError, match="schedule"):
        attention_triton(q, k, v, pk, pv, mask, tile_schedule([2 * C, 0], [[C], [C]], [dense(1)] * 2, C), 0.25)
