"""Both routers against hand-worked examples, and their properties."""
import math

import torch
from hypothesis import given, settings, strategies as st

from dblock.reference.llada import route_llada2, route_llada_moe
from dblock.tiny import tiny_config


def logit(p):
    return math.log(p / (1 - p))


def test_llada2_hand_worked():
    # E=8 in 4 groups of 2, keep 2 groups, K=2, scale 2.5.
    cfg = tiny_config("llada2_moe", num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5)
    s = [0.9, 0.1, 0.8, 0.7, 0.2, 0.3, 0.6, 0.95]
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0.5, -0.5])
    # choice b = s + bias = [.9 .1 | .8 .7 | .2 .3 | 1.1 .45]; group scores (top-2 sums) 1.0 1.5 0.5 1.55
    # -> keep groups 3 and 1 -> eligible {2, 3, 6, 7}; top-2 of b there: expert 6 (1.1), expert 2 (0.8).
    # Expert 0 (b .9) is outside the kept groups; expert 7 has the best s (.95) but the bias drops it.
    ids, w = route_llada2(torch.tensor([[logit(p) for p in s]]), bias, cfg)
    assert sorted(ids[0].tolist()) == [2, 6]
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    # weights from the unbiased s: 0.6 and 0.8, renormalised to 1, times 2.5
    assert math.isclose(got[6], 2.5 * 0.6 / 1.4, rel_tol=1e-6)
    assert math.isclose(got[2], 2.5 * 0.8 / 1.4, rel_tol=1e-6)


def test_llada_moe_hand_worked():
    cfg = tiny_config("llada_moe", num_experts=4, num_experts_per_tok=2)
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    ids, w = route_llada_moe(logits, None, cfg)
    assert ids[0].tolist() == [1, 3]
    assert torch.allclose(w[0], torch.tensor([0.4, 0.3]))  # softmax probabilities, not renormalised, not scaled


routing_case = st.tuples(st.integers(1, 6), st.sampled_from([(8, 4, 2, 2), (16, 4, 2, 4), (16, 8, 3, 4),
                                                               (12, 3, 1, 3), (8, 1, 1, 3)]),
                         st.integers(0, 10_000))


@given(routing_case)
def test_llada2_properties(case):
    T, (E, n_group, topk_group, K), seed = case
    cfg = tiny_config("llada2_moe", num_experts=E, num_experts_per_tok=K, n_group=n_group, topk_group=topk_group,
                      routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3
    ids, w = route_llada2(logits, bias, cfg)
    s = torch.sigmoid(logits)
    b = s + bias
    per = E // n_group
    for t in range(T):
        chosen = ids[t].tolist()
        assert len(set(chosen)) == K
        # chosen experts lie in the kept groups (the topk_group groups by top-2 choice-score sums)
        gs = b[t].view(n_group, per).topk(min(2, per), -1).values.sum(-1)
        kept = set(gs.topk(topk_group).indices.tolist()) if n_group > 1 else {0}
        assert {e // per for e in chosen} <= kept
        # and are the top-K by choice score among the eligible experts
        eligible = [e for e in range(E) if e // per in kept]
        best = sorted(eligible, key=lambda e: -b[t, e].item())[:K]
        assert sorted(chosen) == sorted(best)
    # weights: unbiased scores renormalised, summing to the scaling factor
    assert torch.allclose(w.sum(-1), torch.full((T,), 2.5), atol=1e-5)
    assert torch.allclose(w / w.sum(-1, keepdim=True), s.gather(1, ids) / s.gather(1, ids).sum(-1, keepdim=True))


@given(st.integers(1, 6), st.integers(0, 10_000))
def test_bias_affects_choice_only(T, seed):
    cfg = tiny_config("llada2_moe", num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                      routed_scaling_factor=1.0)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, 8, generator=g)
    ids0, w0 = route_llada2(logits, torch.zeros(8), cfg)
    # a bias that does not change the ranking leaves ids and weights unchanged
    ids1, w1 = route_llada2(logits, torch.full((8,), 0.7), cfg)
    assert torch.equal(ids0, ids1) and torch.allclose(w0, w1)
    # a bias that forces expert 5 in changes the choice, and its weight is its *unbiased* score, renormalised
    big = torch.zeros(8)
    big[5] = 10.0
    ids2, w2 = route_llada2(logits, big, cfg)
    assert (ids2 == 5).any(-1).all()
    s = torch.sigmoid(logits)
    assert torch.allclose(w2, s.gather(1, ids2) / s.gather(1, ids2).sum(-1, keepdim=True))


@given(st.integers(1, 6), st.integers(0, 10_000))
def test_softmax_router_not_renormalised(T, seed):
    cfg = tiny_config("llada_moe", num_experts=8, num_experts_per_tok=2)
    logits = torch.randn(T, 8, generator=torch.Generator().manual_seed(seed))
    ids, w = route_llada_moe(logits, None, cfg)
    p = torch.softmax(logits, -1)
    assert torch.equal(w, p.gather(1, ids))
    assert (w.sum(-1) < 1).all()
    assert torch.equal(ids, p.topk(2, -1).indices)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 9), st.integers(0, 2 ** 31 - 1))
def test_expert_rows_are_the_per_expert_scan_in_its_order(T, K, E, seed):
    """`expert_rows` (one stable sort) gives each expert the entries a per-expert scan finds, in the scan's order:
    (t, k) as `(ids == e).nonzero()`, or (k, t) as transformers' DiffusionGemma loop (`where(ids.T == e)`) -- so the
    MoE sums round as before."""
    from dblock.reference.llada import expert_rows
    ids = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(seed))
    for k_major in (False, True):
        tok, slot, counts = expert_rows(ids, E, k_major)
        assert len(counts) == E and sum(counts) == T * K
        for e, (t_e, s_e) in enumerate(zip(tok.split(counts), slot.split(counts))):
            if k_major:
                s_ref, t_ref = torch.where(ids.T == e)
            else:
                t_ref, s_ref = (ids == e).nonzero(as_tuple=True)
            assert torch.equal(t_e, t_ref) and torch.equal(s_e, s_ref), (e, k_major)
