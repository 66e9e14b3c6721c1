"""Grouped SwiGLU: grouped_mlp_triton (fp32, interpreter) vs the fp64 per-expert loop, the executor's torch stage
and the F.grouped_mm baseline; edge shapes; invalid slots and idle experts load no weights."""
import pytest
import torch

from dblock.kernels.grouped_mlp import grouped_mlp_grouped_mm, grouped_mlp_torch, grouped_mlp_triton
from dblock.optimized.freshlane import grouped_swiglu_torch
from tests.conftest import tol


def make(F, K, E, H, I, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(F, H, generator=g)
    if kind == "distinct":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(F)]) if F else \
            torch.zeros(0, K, dtype=torch.long)
    elif kind == "invalid":                                          # some slots have no expert (-1)
        ids = torch.randint(-1, E, (F, K), generator=g)
    elif kind == "one_hot":
        ids = torch.full((F, K), 1, dtype=torch.long)
    elif kind == "empty_expert":                                     # expert 0 never chosen
        ids = torch.randint(1, E, (F, K), generator=g)
    w = torch.rand(F, K, generator=g)
    wg = torch.randn(E, I, H, generator=g) / H ** 0.5
    wu = torch.randn(E, I, H, generator=g) / H ** 0.5
    wd = torch.randn(E, H, I, generator=g) / I ** 0.5
    return x, ids, w, wg, wu, wd


def f64(*ts):
    return [t.double() if t.is_floating_point() else t for t in ts]


@pytest.mark.parametrize("kind", ["distinct", "invalid", "one_hot", "empty_expert"])
@pytest.mark.parametrize("F,K,E,H,I", [(1, 1, 4, 16, 16), (37, 3, 8, 40, 24), (20, 4, 16, 64, 32)])
def test_matches_fp64_reference(kind, F, K, E, H, I):
    args = make(F, K, E, H, I, kind, seed=F + K + E)
    y = grouped_mlp_triton(*args)
    ref = grouped_mlp_torch(*f64(*args))
    assert y.shape == (F, H) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, **tol(torch.float32))
    torch.testing.assert_close(grouped_swiglu_torch(*f64(*args)), ref, **tol(torch.float64))
    torch.testing.assert_close(grouped_mlp_grouped_mm(*args).double(), ref, **tol(torch.float32))  # no fp64


def test_zero_rows_and_all_invalid():
    x, ids, w, wg, wu, wd = make(0, 2, 4, 16, 16, "distinct", 0)
    assert grouped_mlp_triton(x, ids, w, wg, wu, wd).shape == (0, 16)
    x, ids, w, wg, wu, wd = make(5, 2, 4, 16, 16, "distinct", 0)
    ids = torch.full_like(ids, -1)
    assert (grouped_mlp_triton(x, ids, w, wg, wu, wd) == 0).all()


@pytest.mark.parametrize("exact_grid", [True, False])
def test_idle_experts_and_invalid_slots_load_no_weights(exact_grid):
    """NaN weights for every expert no valid slot uses: any load of them (even times zero) would show up."""
    x, ids, w, wg, wu, wd = make(13, 3, 8, 32, 16, "invalid", 5)
    ids[ids >= 5] = -1                                               # experts 5..7 idle; many -1 slots
    used = set(ids[ids >= 0].tolist())
    for e in range(8):
        if e not in used:
            wg[e], wu[e], wd[e] = float("nan"), float("nan"), float("nan")
    w[ids < 0] = float("nan")                                        # weights of invalid slots never read either
    y = grouped_mlp_triton(x, ids, w, wg, wu, wd, exact_grid=exact_grid)   # static grid: surplus blocks return
    assert torch.isfinite(y).all()
    ref = grouped_mlp_torch(*f64(x, ids, w.nan_to_num(0.0), wg.nan_to_num(0.0), wu.nan_to_num(0.0),
                                 wd.nan_to_num(0.0)))
    torch.testing.assert_close(y.double(), ref, **tol(torch.float32))


def test_block_sizes_do_not_change_the_result():
    args = make(29, 2, 4, 48, 40, "invalid", 9)
    ref = grouped_mlp_torch(*f64(*args))
    for bm, bn, bk in [(16, 16, 16), (32, 16, 32), (16, 64, 16)]:
        y = grouped_mlp_triton(*args, block_m=bm, block_n=bn, block_k=bk)
        torch.testing.assert_close(y.double(), ref, **tol(torch.float32))


def test_launcher_asserts_layout():
    x, ids, w, wg, wu, wd = make(4, 2, 4, 16, 16, "distinct", 0)
    with pytest.raises(AssertionError, match="w_gate_EIH: dtype"):
        grouped_mlp_triton(x, ids, w, wg.double(), wu, wd)
    with pytest.raises(AssertionError, match="w_down_EHI: must be contiguous"):
        grouped_mlp_triton(x, ids, w, wg, wu, wd.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(AssertionError, match="do not match"):
        grouped_mlp_triton(x, ids[:3], w[:3], wg, wu, wd)


@pytest.mark.parametrize("kind", ["distinct", "invalid"])
@pytest.mark.parametrize("F,K,E,H,I", [(1, 1, 4, 16, 16), (37, 3, 8, 40, 24)])
def test_geglu_from_fused_gate_up_views_matches_fp64_reference(kind, F, K, E, H, I):
    """DiffusionGemma's experts: the tanh GELU, the gate and up halves of one (E, 2I, H) tensor passed as views;
    against the fp64 per-expert loop and the executor's own torch stage (`grouped_geglu_torch`)."""
    from dblock.optimized.freshlane import grouped_geglu_torch
    x, ids, w, wg, wu, wd = make(F, K, E, H, I, kind, seed=F + K)
    gu = torch.cat([wg, wu], dim=1)                                  # (E, 2I, H), as the checkpoint stores it
    y = grouped_mlp_triton(x, ids, w, gu[:, :I], gu[:, I:], wd, activation="gelu_tanh")
    ref = grouped_mlp_torch(*f64(x, ids, w, wg, wu, wd), activation="gelu_tanh")
    torch.testing.assert_close(y.double(), ref, **tol(torch.float32))
    torch.testing.assert_close(grouped_geglu_torch(*f64(x, ids, w, gu, wd)), ref, **tol(torch.float64))
    silu = grouped_mlp_torch(*f64(x, ids, w, wg, wu, wd))            # the activation really switched
    assert not torch.allclose(silu, ref)


def test_bad_activation_and_mismatched_gate_up_layouts_are_refused():
    x, ids, w, wg, wu, wd = make(5, 2, 4, 16, 8, "distinct", 0)
    with pytest.raises(ValueError, match="activation='relu'"):
        grouped_mlp_triton(x, ids, w, wg, wu, wd, activation="relu")
    gu = torch.cat([wg, wu], dim=1)
    with pytest.raises(ValueError, match="share one layout"):
        grouped_mlp_triton(x, ids, w, gu[:, :8], wu, wd)             # a view beside a contiguous tensor
