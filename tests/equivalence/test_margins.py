"""The decision margin (docs/algorithms.md §5): perturbations inside Γ never change a decision, and the exact margin Γ* is tight."""
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from dblock.decoding.margins import (delta_inf, entropy_bound_check, fixed_k_decision64, fixed_k_margin,
                                        same_decision, threshold_decision64, threshold_margin)
from dblock.decoding.samplers import threshold_rule

INSIDE = 1 - 1e-6        # strictly inside, with room for fp64 rounding of z + δ
OUTSIDE = 1 + 1e-6


@st.composite
def blocks(draw, max_rows=6):
    """(logits (n, V) fp64, mask_id): random logits, sometimes with ties and near-threshold confidences."""
    n = draw(st.integers(1, max_rows))
    V = draw(st.integers(3, 9))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    scale = draw(st.sampled_from([0.5, 2.0, 6.0, 12.0]))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=g, dtype=torch.float64) * scale
    if draw(st.booleans()):          # a sharp row (confidence near 1) and a duplicated row (exact ties)
        z[0, int(torch.randint(0, V - 1, (1,), generator=g))] += 3 * scale
        if n > 1 and draw(st.booleans()):
            z[n - 1] = z[0]
    return z, V - 1


def decide(z, mask_id, rule, tau, commit_all, k):
    if rule == "threshold":
        return threshold_decision64(z, mask_id, tau, commit_all)
    if rule == "threshold-quota":                    # LLaDA2.0's steps: at least k a pass
        return threshold_decision64(z, mask_id, tau, commit_all, quota=k)
    return fixed_k_decision64(z, mask_id, k)


def margin(z, mask_id, rule, tau, commit_all, k):
    if rule == "threshold":
        return threshold_margin(z, mask_id, tau, commit_all)
    if rule == "threshold-quota":
        return threshold_margin(z, mask_id, tau, commit_all, quota=k)
    return fixed_k_margin(z, mask_id, k)


def perturb_inside(z, radius, seed, mask_id):
    """Random δ with |δ_ij| < radius_i (MASK column untouched; infinite radii capped)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.clamp(radius, max=50.0)[:, None] * INSIDE
    d = (2 * torch.rand(z.shape, generator=g, dtype=torch.float64) - 1) * r
    # push some entries to the corners of the box, where the worst case lives
    corner = torch.rand(z.shape, generator=g) < 0.5
    d = torch.where(corner, torch.sign(d) * r, d)
    d[:, mask_id] = 0.0
    return z + d


rules = st.sampled_from(["threshold", "threshold-quota", "fixed-k"])
taus = st.sampled_from([0.95, 0.7, 0.3])


@given(blocks(), rules, taus, st.booleans(), st.integers(0, 6), st.integers(0, 2 ** 31 - 1),
       st.sampled_from(["gamma", "gamma_exact"]))
def test_perturbation_inside_margin_never_changes_the_decision(blk, rule, tau, commit_all, k, seed, which):
    z, mask_id = blk
    m = margin(z, mask_id, rule, tau, commit_all, k)
    radius = getattr(m, which)
    tok, com = decide(z, mask_id, rule, tau, commit_all, k)
    assert torch.equal(com, m.commit)
    for s in range(3):
        zp = perturb_inside(z, radius, seed + s, mask_id)
        assert bool((delta_inf(zp, z, mask_id) < torch.clamp(radius, max=50.0)).all() or not radius.numel())
        tok2, com2 = decide(zp, mask_id, rule, tau, commit_all, k)
        assert same_decision(tok, com, tok2, com2).all(), (which, m, z, zp)


def adversaries(z, mask_id, eps):
    """Every elementary worst-case perturbation of ∞-norm eps: swap a row's top two, push a row's confidence down
    or up, and race two rows (one down, one up)."""
    n, V = z.shape
    real = torch.ones(V, dtype=torch.bool)
    real[mask_id] = False
    zm = z.clone()
    zm[:, mask_id] = -math.inf
    top2 = zm.topk(2, dim=-1).indices

    def down(i):
        d = torch.zeros(V, dtype=torch.float64)
        d[real] = eps
        d[top2[i, 0]] = -eps
        return d

    out = []
    for i in range(n):
        sw = torch.zeros_like(z)
        sw[i, top2[i, 0]], sw[i, top2[i, 1]] = -eps, eps
        out += [sw]
        dn, up = torch.zeros_like(z), torch.zeros_like(z)
        dn[i], up[i] = down(i), -down(i)
        out += [dn, up]
        for j in range(n):
            if j != i:
                race = torch.zeros_like(z)
                race[i], race[j] = down(i), -down(j)
                out.append(race)
    return [z + d for d in out]


@given(blocks(max_rows=4), rules, taus, st.booleans(), st.integers(0, 4))
def test_exact_margin_is_tight(blk, rule, tau, commit_all, k):
    """A perturbation just outside min Γ* can change the decision (found among the elementary adversaries)."""
    z, mask_id = blk
    m = margin(z, mask_id, rule, tau, commit_all, k)
    r = float(m.gamma_exact.min())
    if not math.isfinite(r):
        return            # nothing can change the decision (e.g. one row with one real token)
    eps = r * OUTSIDE + 1e-9
    tok, com = decide(z, mask_id, rule, tau, commit_all, k)
    changed = False
    for zp in adversaries(z, mask_id, eps):
        tok2, com2 = decide(zp, mask_id, rule, tau, commit_all, k)
        if not same_decision(tok, com, tok2, com2).all():
            changed = True
            break
    assert changed, (m, z)


@given(blocks(), taus, st.booleans())
def test_spec_margin_never_exceeds_the_exact_radius(blk, tau, commit_all):
    z, mask_id = blk
    m = threshold_margin(z, mask_id, tau, commit_all)
    assert float(m.gamma.min()) <= float(m.gamma_exact.min()) + 1e-12
    assert (m.slack <= m.slack_exact + 1e-12).all()


@given(blocks(max_rows=4), taus)
def test_spec_margin_is_tight_where_the_top_gap_binds(blk, tau):
    """Γ = a on a committed row: swapping its top two by just more than a changes the decision."""
    z, mask_id = blk
    m = threshold_margin(z, mask_id, tau)
    tok, com = threshold_decision64(z, mask_id, tau)
    for i in range(z.shape[0]):
        if com[i] and m.top_gap[i] <= m.gamma[i] and math.isfinite(float(m.top_gap[i])):
            eps = float(m.top_gap[i]) * OUTSIDE + 1e-9
            zm = z.clone()
            zm[:, mask_id] = -math.inf
            t1, t2 = zm[i].topk(2).indices
            zp = z.clone()
            zp[i, t1] -= eps
            zp[i, t2] += eps
            tok2, com2 = threshold_decision64(zp, mask_id, tau)
            assert not same_decision(tok, com, tok2, com2).all()


def test_spec_half_gap_fallback_margin_is_not_sufficient():
    """docs/algorithms.md §5 writes the fallback term as half the log-confidence gap; two rows move toward each other by up to 4ε
    (2ε each when the confidences are small), so a perturbation inside that half gap can swap the fallback's
    winner. This module uses a quarter."""
    V = 1001                                                 # a flat distribution: log p moves by almost 2ε
    mask_id = V - 1
    z = torch.zeros(2, V, dtype=torch.float64)
    z[0, 0], z[1, 0] = 1.0, 0.9                              # no row clears 0.95; row 0 wins the fallback
    m = threshold_margin(z, mask_id, 0.95)
    assert m.fallback and m.commit.tolist() == [True, False]
    real = z[:, :mask_id]
    logp = real.max(-1).values - torch.logsumexp(real, -1)
    half = float(logp[0] - logp[1]) / 2
    eps = 0.9 * half                                         # inside the sufficient margin's half gap...
    zp = z.clone()
    zp[0, :mask_id] += eps
    zp[0, 0] -= 2 * eps                                      # row 0: -eps on its top token, +eps elsewhere
    zp[1, :mask_id] -= eps
    zp[1, 0] += 2 * eps                                      # row 1: the opposite
    assert float(delta_inf(zp, z, mask_id).max()) <= eps + 1e-12
    tok, com = threshold_decision64(z, mask_id)
    tok2, com2 = threshold_decision64(zp, mask_id)
    assert not same_decision(tok, com, tok2, com2).all()     # ...and the decision changed
    assert eps >= m.cross and eps >= float(m.gamma.min())    # the quarter-gap margin does not claim otherwise


def test_fp64_replica_matches_the_fp32_rule_on_clear_margins():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        z = torch.randn(5, 12, generator=g, dtype=torch.float64) * 4
        m = threshold_margin(z, 11)
        if float(m.gamma_exact.min()) < 1e-3:
            continue
        tok, com = threshold_decision64(z, 11)
        d = threshold_rule(z.float(), 11)
        assert same_decision(tok, com, d.tokens, d.commit).all()


def test_commit_all_and_single_row():
    z = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    m = threshold_margin(z, 2)                               # one row: it commits whatever its confidence
    assert m.commit.tolist() == [True] and float(m.gamma_exact[0]) == 0.5
    m = threshold_margin(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]], dtype=torch.float64), 2, commit_all=True)
    assert m.commit.all() and torch.allclose(m.gamma_exact, torch.tensor([0.5, 1.5], dtype=torch.float64))


# ---- entropy-bound rule: the decision check under shared randomness ------------------------------------------------

def test_entropy_bound_check_shares_randomness_and_detects_changes():
    from dblock.decoding.entropy_bound import UniformRule
    from dblock.decoding.params import DecodeConfig

    class Cfg:
        vocab_size, eos_token_id, pad_token_id = 16, 1, 0

    rule = UniformRule(Cfg(), DecodeConfig(rule="entropy-bound", steps=8))
    gen = torch.Generator().manual_seed(3)
    st_ = rule.new_block(torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.bool), gen)
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, 16, generator=g) * 4
    z[:3, 2] += 40                                            # three confident positions get accepted
    before = gen.get_state().clone()
    same = entropy_bound_check(rule, st_, z, z.clone(), gen)
    assert same["agree"] and torch.equal(gen.get_state(), before)   # nothing consumed from the real stream
    tiny = entropy_bound_check(rule, st_, z, z + 1e-7, gen)
    assert tiny["same_argmax"]
    flipped = z.clone()
    flipped[0, 2] -= 80                                       # position 0 changes its argmax and its entropy
    chk = entropy_bound_check(rule, st_, z, flipped, gen)
    assert not chk["agree"] and chk["argmax_diff"] >= 1


def test_threshold_comparison_follows_threshold_inclusive():
    """At conf = τ exactly (row 0: two equal real logits, conf = 0.5 = τ) the strict rule (the default, as LLaDA2.0)
    leaves the row, the inclusive one commits it; the margin is 0 on that row either way."""
    z = torch.tensor([[0.0, 0.0, 5.0], [1.0, 0.0, 5.0]], dtype=torch.float64)   # column 2 is MASK
    tok, com = threshold_decision64(z, 2, tau=0.5)
    assert com.tolist() == [False, True] and tok.tolist() == [0, 0]
    tok, com = threshold_decision64(z, 2, tau=0.5, inclusive=True)
    assert com.tolist() == [True, True]
    m = threshold_margin(z, 2, tau=0.5)
    assert m.commit.tolist() == [False, True] and float(m.slack_exact[0]) == 0.0
    m = threshold_margin(z, 2, tau=0.5, inclusive=True)
    assert m.commit.tolist() == [True, True] and float(m.gamma_exact[0]) == 0.0


def test_tau_one_is_a_valid_threshold():
    """τ = 1 is allowed by DecodeConfig: strictly, no row ever clears it (the fallback decides), and its margin is the
    fallback's, never a math domain error."""
    z = torch.tensor([[4.0, 1.0, 0.0], [0.0, 3.0, 0.5]], dtype=torch.float64)
    m = threshold_margin(z, 2, tau=1.0)
    assert m.fallback and int(m.commit.sum()) == 1 and bool(torch.isfinite(m.gamma_exact).all())


def test_the_quota_replica_is_the_rule():
    """threshold_decision64(quota=k) commits what samplers.threshold_commit does with LLaDA2.0's quota."""
    from dblock.decoding.samplers import threshold_commit
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        z = torch.randn(5, 6, generator=g, dtype=torch.float64) * 3
        k = int(torch.randint(0, 6, (1,), generator=g))
        conf = torch.softmax(z[:, :5], -1).max(-1).values
        _, com = threshold_decision64(z, 5, 0.7, quota=k)
        assert torch.equal(com, threshold_commit(conf, 0.7, quota=k)), (z, k)
