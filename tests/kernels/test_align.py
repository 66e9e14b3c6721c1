"""align_triton vs align_torch (vLLM's test_moe_align_block_size checks): counts, expert_ids and the sentinel
exact, sorted ids per expert as multisets, plus the layout invariants and determinism."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dblock.kernels.align import align_sizes, align_torch, align_triton


def check_layout(ids_FK, E, BM, sorted_ids, expert_ids, npost):
    """Invariants of the layout, independent of any implementation."""
    flat = ids_FK.reshape(-1)
    P = flat.numel()
    PP, MB = align_sizes(P, E, BM)
    assert sorted_ids.shape == (PP,) and expert_ids.shape == (MB,) and npost.shape == (1,)
    assert sorted_ids.dtype == expert_ids.dtype == npost.dtype == torch.int32
    n = int(npost)
    counts = torch.bincount(flat[flat >= 0], minlength=E)
    assert n == int(((counts + BM - 1) // BM * BM).sum()) and n % BM == 0
    assert (sorted_ids[n:] == P).all()                               # tail: sentinel only
    assert (expert_ids[n // BM:] == -1).all() and (expert_ids[: n // BM] >= 0).all()
    assert (expert_ids[: n // BM].diff() >= 0).all()                 # experts in order
    real = sorted_ids[:n][sorted_ids[:n] < P].long()
    assert torch.equal(real.sort().values, (flat >= 0).nonzero(as_tuple=True)[0])   # every valid pair once
    for m in range(n // BM):                                         # each M-block belongs to its expert
        rows = sorted_ids[m * BM:(m + 1) * BM]
        rows = rows[rows < P].long()
        assert rows.numel() > 0 and (flat[rows] == expert_ids[m]).all()


def same_layout(a, b, P, BM, E):
    """vLLM's comparison: npost and expert_ids exact, sorted ids compared per expert as multisets."""
    assert torch.equal(a[2], b[2]) and torch.equal(a[1], b[1])
    for e in range(E):
        rows = []
        for s, ex in (a[:2], b[:2]):
            r = torch.cat([s[m * BM:(m + 1) * BM] for m in (ex == e).nonzero(as_tuple=True)[0].tolist()] +
                          [torch.zeros(0, dtype=torch.int32)])
            rows.append(r[r < P].sort().values)
        assert torch.equal(*rows), f"expert {e}"


def test_docstring_example():
    ids = torch.tensor([[2, 0], [0, -1], [2, 0], [3, 0]])
    for f in (align_torch, align_triton):
        s, e, n = f(ids, 4, 4)
        assert s.tolist() == [1, 2, 5, 7, 0, 4, 8, 8, 6, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]
        assert e.tolist() == [0, 2, 3, -1, -1] and n.tolist() == [12]


def sweep_ids(kind, F, K, E, g):
    if kind == "random":
        return torch.randint(-1, E, (F, K), generator=g)
    if kind == "one_hot":                                            # every pair on one expert
        return torch.full((F, K), E - 1, dtype=torch.long)
    if kind == "empty_experts":                                      # only the even experts are used
        return 2 * torch.randint(0, E // 2, (F, K), generator=g)
    if kind == "all_invalid":
        return torch.full((F, K), -1, dtype=torch.long)
    if kind == "distinct":                                           # a row's K experts are distinct (routing)
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(F)]) if F else \
            torch.zeros(0, K, dtype=torch.long)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "one_hot", "empty_experts", "all_invalid", "distinct"])
@pytest.mark.parametrize("F,K,E,BM", [(1, 1, 4, 4), (1, 4, 16, 16), (37, 3, 8, 16), (100, 4, 16, 16),
                                      (0, 2, 4, 16), (33, 2, 6, 8)])
def test_matches_golden(kind, F, K, E, BM):
    g = torch.Generator().manual_seed(F * 7 + K)
    ids = sweep_ids(kind, F, K, E, g)
    ref = align_torch(ids, E, BM)
    got = align_triton(ids, E, BM, chunk=16)                         # several chunks at these sizes
    check_layout(ids, E, BM, *got)
    same_layout(got, ref, ids.numel(), BM, E)
    assert all(torch.equal(x, y) for x, y in zip(got, ref))          # the Triton path is a stable sort too


def test_deterministic_and_chunk_independent():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(-1, 8, (50, 4), generator=g)
    runs = [align_triton(ids, 8, 16, chunk=c) for c in (16, 16, 32, 64, 256)]
    for r in runs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(r, runs[0]))


@settings(max_examples=15)
@given(F=st.integers(0, 40), K=st.integers(1, 4), E=st.integers(1, 12), bm_log=st.integers(0, 4),
       seed=st.integers(0, 1000))
def test_property_layout(F, K, E, bm_log, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E, (F, K), generator=g)
    got = align_triton(ids, E, 2 ** bm_log, chunk=16)
    check_layout(ids, E, 2 ** bm_log, *got)
    assert all(torch.equal(x, y) for x, y in zip(got, align_torch(ids, E, 2 ** bm_log)))


def test_launcher_asserts_layout():
    ids = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(AssertionError, match="power of two"):
        align_triton(ids, 4, 12)
    with pytest.raises(AssertionError, match="contiguous"):
        align_triton(ids.t(), 4, 16)
    with pytest.raises(AssertionError, match="dtype"):
        align_triton(ids.float(), 4, 16)
