"""route_triton vs route_torch (fp64) vs the executor's torch stage (atlas.route_restricted) vs the dense routers.

sglang-style: fp32 `torch.rand`-like inputs (ties improbable), ids compared as sorted sets per row, weights
compared after sorting per row.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dblock.kernels.route import route_args, route_torch, route_triton
from dblock.optimized.atlas import route_restricted
from dblock.reference.llada import route_llada2, route_llada_moe
from dblock.tiny import tiny_config
from tests.conftest import tol


def same_routing(ids_a, w_a, ids_b, w_b, dtype=torch.float32):
    """Ids exact as sorted sets per row; weights within tolerance in the same (sorted-id) order."""
    assert ids_a.shape == ids_b.shape
    sa, oa = ids_a.sort(dim=1)
    sb, ob = ids_b.sort(dim=1)
    assert torch.equal(sa, sb), f"ids differ:\n{ids_a}\n{ids_b}"
    torch.testing.assert_close(w_a.gather(1, oa).double(), w_b.gather(1, ob).double(), **tol(dtype))


def inputs(F, E, density, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(F, E, generator=g) * 2
    b = 0.1 * torch.randn(E, generator=g) if bias else None
    allowed = torch.rand(F, E, generator=g) < density
    return logits, b, allowed


def test_docstring_example():
    # s = sigmoid(logits) = [.9, .1, .8, .7]; expert 0 outside the support
    s = torch.tensor([[.9, .1, .8, .7]])
    logits = torch.log(s / (1 - s))
    allowed = torch.tensor([[False, True, True, True]])
    kw = dict(top_k=2, sigmoid=True, n_group=2, topk_group=1, renormalize=True, scale=1.0)
    ids, w = route_triton(logits, None, allowed, **kw)
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(w, torch.tensor([[.8 / 1.5, .7 / 1.5]]), **tol(torch.float32))
    same_routing(ids, w, *route_torch(logits.double(), None, allowed, **kw))


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
@pytest.mark.parametrize("F", [0, 1, 33])
def test_all_allowed_is_the_dense_router(family, F):
    cfg = tiny_config(family)
    logits, bias, _ = inputs(F, cfg.num_experts, 1.0, seed=F, bias=family == "llada2_moe")
    allowed = torch.ones(F, cfg.num_experts, dtype=torch.bool)
    ids, w = route_triton(logits, bias, allowed, **route_args(cfg))
    assert ids.shape == (F, cfg.num_experts_per_tok) and ids.dtype == torch.int64 and w.dtype == torch.float32
    dense = route_llada2 if family == "llada2_moe" else route_llada_moe
    same_routing(ids, w, *dense(logits, bias, cfg))


# (E, K, n_group, topk_group, sigmoid, density): group-limited and flat rules; sparse supports leave groups with
# 0 or 1 eligible experts and rows with fewer than K eligible experts (-1 slots)
CASES = [
    (16, 4, 4, 2, True, 0.5), (16, 4, 4, 2, True, 0.15), (16, 4, 4, 2, True, 0.0), (12, 3, 3, 2, True, 0.3),
    (8, 2, 1, 1, True, 0.4), (8, 2, 1, 1, False, 0.4), (20, 6, 4, 3, True, 0.35), (16, 1, 4, 1, True, 0.6),
]


@pytest.mark.parametrize("E,K,G,TG,sig,density", CASES)
@pytest.mark.parametrize("F", [1, 37])
def test_restricted_matches_golden_and_executor_stage(E, K, G, TG, sig, density, F):
    logits, bias, allowed = inputs(F, E, density, seed=E * 100 + F)
    kw = dict(top_k=K, sigmoid=sig, n_group=G, topk_group=TG, renormalize=True, scale=2.5)
    ids, w = route_triton(logits, bias, allowed, **kw)
    same_routing(ids, w, *route_torch(logits.double(), bias.double(), allowed, **kw))
    cfg = tiny_config("llada2_moe" if sig else "llada_moe", num_experts=E, num_experts_per_tok=K, n_group=G,
                      topk_group=TG, routed_scaling_factor=2.5)
    same_routing(ids, w, *route_restricted(logits, bias, cfg, allowed))
    # invariants: chosen experts are allowed; -1 slots carry weight 0 and only when a row runs out of experts
    chosen = ids >= 0
    assert allowed.gather(1, ids.clamp(min=0))[chosen].all()
    assert (w[~chosen] == 0).all()
    assert (chosen.sum(1) >= torch.clamp(allowed.sum(1), max=1)).all()    # an allowed expert -> a choice
    if density == 0.0:
        assert (ids == -1).all() and (w == 0).all()


@settings(max_examples=20)
@given(seed=st.integers(0, 10_000), F=st.integers(1, 9), density=st.floats(0.05, 1.0))
def test_property_chosen_groups_are_top_groups(seed, F, density):
    E, K, G, TG = 16, 4, 4, 2
    logits, bias, allowed = inputs(F, E, density, seed)
    ids, w = route_triton(logits, bias, allowed, top_k=K, sigmoid=True, n_group=G, topk_group=TG, scale=1.0)
    same_routing(ids, w, *route_torch(logits.double(), bias.double(), allowed, top_k=K, sigmoid=True, n_group=G,
                                      topk_group=TG, scale=1.0))
    b = (torch.sigmoid(logits.double()) + bias.double()).masked_fill(~allowed, float("-inf")).view(F, G, E // G)
    top2 = b.topk(2, dim=-1).values
    gs = torch.where(torch.isfinite(top2), top2, 0.0).sum(-1).masked_fill(~torch.isfinite(top2).any(-1), -1e9)
    for f in range(F):
        groups = {int(e) // (E // G) for e in ids[f] if e >= 0}
        assert len(groups) <= TG
        cutoff = gs[f].topk(TG).values[-1]
        assert all(gs[f, g] >= cutoff for g in groups)
        valid_w = w[f][ids[f] >= 0]
        if valid_w.numel():
            torch.testing.assert_close(valid_w.sum().double(), torch.tensor(1.0, dtype=torch.float64), atol=1e-5,
                                       rtol=0)


def test_launcher_asserts_layout():
    logits, bias, allowed = inputs(4, 8, 0.5, 0)
    with pytest.raises(AssertionError, match="logits_FE: dtype"):
        route_triton(logits.double(), bias, allowed, top_k=2)
    with pytest.raises(AssertionError, match="allowed_FE: shape"):
        route_triton(logits, bias, allowed[:, :4], top_k=2)
    with pytest.raises(AssertionError, match="last dim must have stride 1"):
        route_triton(logits.t().contiguous().t(), bias, allowed, top_k=2)
