"""FreshLane's vectorised grouping (one sort per worklist) and the chunked grouped SwiGLU against plain per-expert
loops, on random worklists: empty experts, one row, every pair on one expert, repeated ids (ties in the sort), empty
slots (-1), chunk boundaries, the grouped-GEMM and the loop paths."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dblock.optimized import freshlane as fl
from dblock.tiny import make_tiny_model
from tests.conftest import tol


@st.composite
def worklist(draw):
    """ids (F, K) with distinct experts per row (as a router gives), some slots -1, in one of several shapes."""
    E = draw(st.integers(1, 12))
    K = draw(st.integers(1, min(4, E)))
    Fr = draw(st.integers(1, 20))
    kind = draw(st.sampled_from(["random", "one-expert", "one-row", "empty-slots", "few-experts"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    if kind == "one-row":
        Fr = 1
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(Fr)])
    if kind == "one-expert":                     # every row's first slot on the same expert, the rest empty
        ids[:, 0] = draw(st.integers(0, E - 1))
        ids[:, 1:] = -1
    elif kind == "empty-slots":
        ids[torch.rand(Fr, K, generator=g) < 0.4] = -1
    elif kind == "few-experts":                  # many ties: every row draws from the first two experts
        ids = torch.stack([torch.randperm(min(E, 2), generator=g)[:1].repeat(K) for _ in range(Fr)])
        ids[:, 1:] = -1
    return ids, E


def loop_groups(ids, E):
    """The plain grouping: for every expert, its (row, slot) pairs in row order."""
    out = []
    for e in range(E):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        out.append((rows.tolist(), slots.tolist()))
    return out


@given(worklist())
def test_expert_layout_equals_a_per_expert_loop(case):
    ids, E = case
    lay = fl.expert_layout(ids, E)
    want = loop_groups(ids, E)
    assert lay.counts == [len(r) for r, _ in want] and lay.counts_E.tolist() == lay.counts
    a = 0
    for e, (rows, slots) in enumerate(want):
        n = len(rows)
        assert lay.row_P[a:a + n].tolist() == rows and lay.slot_P[a:a + n].tolist() == slots, e
        assert (lay.order_P[a:a + n] == lay.row_P[a:a + n] * ids.shape[1] + lay.slot_P[a:a + n]).all()
        a += n
    assert a == lay.P == int((ids >= 0).sum())                       # empty slots are cut off
    got = [(e, r.tolist(), s.tolist()) for e, r, s in fl.expert_groups(ids, E)]
    assert got == [(e, r, s) for e, (r, s) in enumerate(want) if r]   # only the non-empty experts


def test_expert_chunks_cover_every_pair_once():
    for counts, budget in [([3, 0, 2, 4], 5), ([0, 0, 0], 2), ([7], 1), ([1] * 10, 3), ([5, 5], 100)]:
        chunks = list(fl.expert_chunks(counts, budget))
        assert [c[0] for c in chunks] == sorted(c[0] for c in chunks)
        assert sum(c[3] - c[2] for c in chunks) == sum(counts)
        for e0, e1, p0, p1 in chunks:
            assert p1 - p0 == sum(counts[e0:e1]) > 0
            assert p1 - p0 <= budget or e1 - e0 == 1                 # one expert may exceed the budget alone
    assert list(fl.expert_chunks([3, 0, 2, 4], 5)) == [(0, 3, 0, 5), (3, 4, 5, 9)]


def swiglu_loop(x, ids, w, wg, wu, wd):
    """Σ_k w[f,k] · expert_{ids[f,k]}(x_f), one expert at a time in ascending order (the reference's `MoE.routed`)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=acc)
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = F.linear(F.silu(F.linear(x[tok], wg[e])) * F.linear(x[tok], wu[e]), wd[e])
        out.index_add_(0, tok, y.to(acc) * w[tok, slot, None])
    return out.to(x.dtype)


@pytest.mark.parametrize("grouped_mm", [True, False])
@given(worklist(), st.sampled_from([1 << 10, 1 << 14, fl.CHUNK_BYTES]))
def test_grouped_swiglu_equals_the_per_expert_loop(grouped_mm, case, chunk_bytes):
    """fp32 with H and I multiples of 4 (the grouped GEMM's stride rule), whatever the chunking (small chunk_bytes
    cut the worklist into one-expert chunks): the loop path is the reference loop bit for bit, the grouped GEMM
    agrees to fp32 rounding (its kernel may differ from `linear`'s for tiny shapes)."""
    if grouped_mm and fl.GROUPED_MM is None:
        pytest.skip("this torch has no grouped_mm for CPU tensors")
    ids, E = case
    Fr, K = ids.shape
    H, I = 8, 12
    g = torch.Generator().manual_seed(Fr * 31 + E)
    x = torch.randn(Fr, H, generator=g)
    w = torch.rand(Fr, K, generator=g)
    wg, wu, wd = (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
                  torch.randn(E, H, I, generator=g))
    got = fl.grouped_swiglu_torch(x, ids, w, wg, wu, wd, chunk_bytes=chunk_bytes, grouped_mm=grouped_mm)
    want = swiglu_loop(x, ids, w, wg, wu, wd)
    if grouped_mm:
        torch.testing.assert_close(got, want, **tol(torch.float32))
    else:
        assert torch.equal(got, want)
    empty = (ids < 0).all(1)
    assert (got[empty] == 0).all()


@given(worklist())
def test_grouped_swiglu_fp64_odd_widths(case):
    """fp64 and widths the grouped GEMM does not take: the loop over non-empty experts, to fp64 rounding."""
    ids, E = case
    Fr, K = ids.shape
    g = torch.Generator().manual_seed(Fr + 7 * E)
    x = torch.randn(Fr, 5, generator=g, dtype=torch.float64)
    w = torch.rand(Fr, K, generator=g, dtype=torch.float64)
    wg, wu, wd = (torch.randn(E, 6, 5, generator=g, dtype=torch.float64),
                  torch.randn(E, 6, 5, generator=g, dtype=torch.float64),
                  torch.randn(E, 5, 6, generator=g, dtype=torch.float64))
    torch.testing.assert_close(fl.grouped_swiglu_torch(x, ids, w, wg, wu, wd), swiglu_loop(x, ids, w, wg, wu, wd),
                               **tol(torch.float64))


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_grouped_swiglu_is_the_reference_moe_bit_for_bit(family, rows):
    """On a model's own experts and router, the loop path is the reference `MoE.routed` exactly (what the dense path
    runs: full_compute promises the reference's logits); the grouped GEMM agrees to fp32 rounding."""
    m = make_tiny_model(family, seed=2)
    moe = next(layer.mlp for layer in m.layers if layer.is_moe)
    x = torch.randn(rows, m.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        ids, w = moe.route(x)
        ref = moe.routed(x, ids, w)
        assert torch.equal(fl.grouped_swiglu_torch(x, ids, w, moe.w_gate, moe.w_up, moe.w_down, grouped_mm=False), ref)
        torch.testing.assert_close(fl.grouped_swiglu_torch(x, ids, w, moe.w_gate, moe.w_up, moe.w_down), ref,
                                   **tol(torch.float32))


def test_moe_buffer_bytes_grow_with_rows_and_stay_bounded_in_pairs():
    H, I = 256, 128
    small, big = fl.moe_buffer_bytes(10, 80, H, I, 4), fl.moe_buffer_bytes(1000, 8000, H, I, 4)
    assert 0 < small < big
    cap = fl.chunk_pairs(H, I, 4)
    assert fl.moe_buffer_bytes(1000, 10 * cap, H, I, 4) - fl.moe_buffer_bytes(1000, 2 * cap, H, I, 4) == 8 * cap * 12
    assert fl.moe_buffer_bytes(0, 0, H, I, 4) == 0
