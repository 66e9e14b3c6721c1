"""Compact / scatter / merge: exact gathers, the round trip, cache precedence, zero fresh rows."""
import pytest
import torch

from dblock.kernels.compact import (compact_torch, compact_triton, merge_torch, merge_triton, positions_of,
                                    scatter_torch, scatter_triton)


def test_docstring_example():
    x = torch.tensor([[10.], [11.], [12.], [13.]])
    assert compact_triton(x, torch.tensor([1, 3])).tolist() == [[11.], [13.]]
    y = torch.tensor([[.1], [.3]])
    fresh_pos = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    cache, cache_pos = torch.tensor([[7.], [8.]]), torch.tensor([1, -1, -1, -1], dtype=torch.int32)
    assert torch.equal(merge_triton(y, fresh_pos, cache, cache_pos), torch.tensor([[8.], [.1], [0.], [.3]]))
    assert torch.equal(positions_of(torch.tensor([1, 3]), 4), fresh_pos)


@pytest.mark.parametrize("T,H,F", [(1, 16, 1), (37, 40, 11), (64, 130, 64), (9, 8, 0)])
def test_compact_scatter_round_trip(T, H, F):
    g = torch.Generator().manual_seed(T + H + F)
    x = torch.randn(T, H, generator=g)
    idx = torch.randperm(T, generator=g)[:F].sort().values
    xf = compact_triton(x, idx)
    assert torch.equal(xf, compact_torch(x, idx)) and xf.shape == (F, H)
    back = scatter_triton(xf, idx, T)
    assert torch.equal(back, scatter_torch(xf, idx, T))
    assert torch.equal(back[idx], x[idx])                            # identity on fresh rows
    rest = torch.ones(T, dtype=torch.bool)
    rest[idx] = False
    assert (back[rest] == 0).all()                                   # other rows untouched (zero)


def test_compact_reads_strided_rows():
    x = torch.randn(6, 2, 20)[:, 1]                                  # rows with stride 40, last dim stride 1
    idx = torch.tensor([5, 0, 2])
    assert torch.equal(compact_triton(x, idx), x[idx])


@pytest.mark.parametrize("T,H,F,C", [(12, 24, 5, 4), (1, 16, 0, 1), (40, 64, 0, 0), (30, 33, 30, 0)])
def test_merge_fresh_and_cached_rows(T, H, F, C):
    g = torch.Generator().manual_seed(T * 3 + F)
    perm = torch.randperm(T, generator=g)
    fresh_rows, cached_rows = perm[:F], perm[F:F + C]
    y = torch.randn(F, H, generator=g)
    cache = torch.randn(max(C, 1) + 2, H, generator=g)
    fresh_pos = positions_of(fresh_rows, T)
    cache_pos = torch.full((T,), -1, dtype=torch.int32)
    cache_pos[cached_rows] = torch.randperm(cache.shape[0], generator=g)[:C].to(torch.int32)
    cache_pos[fresh_rows[:1]] = 0                                    # a fresh row wins over a cache entry
    got = merge_triton(y, fresh_pos, cache, cache_pos)
    assert torch.equal(got, merge_torch(y, fresh_pos, cache, cache_pos))
    assert torch.equal(got[fresh_rows], y) and torch.equal(got[cached_rows], cache[cache_pos[cached_rows].long()])


def test_launcher_asserts_layout():
    x = torch.randn(4, 8)
    with pytest.raises(AssertionError, match="stride 1"):
        compact_triton(x.t(), torch.tensor([0]))
    with pytest.raises(AssertionError, match="dtype"):
        compact_triton(x.double(), torch.tensor([0]))
    with pytest.raises(AssertionError, match="cache_CH: dtype"):
        merge_triton(x, torch.tensor([0, -1], dtype=torch.int32), x.double(), torch.tensor([-1, 0]))
