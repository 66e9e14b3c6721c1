"""Closed forms of One Block Ahead against the paper's own numbers and against independent computations."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from dblock.simulator import oba

# The paper's rows (One Block Ahead, Sections 4.2-4.3): name, alpha, r, measured TPS change over Native(256).
# Typed in from the paper text, independently of oba.PAPER_ROWS.
PAPER = [
    ("OBA", 0.54, 1.26, +0.163),
    ("Drop Time", 0.41, 1.26, +0.077),
    ("Keep Signal", 0.32, 1.26, +0.011),
    ("No Accept", 0.32, 1.26, +0.012),
    ("Keep Tokens", 0.25, 1.26, -0.028),
    ("Keep Tokens (r=1.27)", 0.25, 1.27, -0.028),   # "the six paired-layout policies have r between 1.26 and 1.27"
    ("No Signal", 0.02, 1.26, -0.199),
    ("Dense Mask", 0.38, 1.70, -0.209),
    ("FlowBlock W=2", 0.09, 1.03, +0.045),
    ("Native C=512", 0.0, 1.84, -0.414),
]


def test_paper_fixed_point_predictions():
    # "The fixed-point prediction (1+α)/r at the averaged α and r of Table 2, 1.22 and 0.81"
    assert round(oba.tps_ratio(0.54, 1.26), 2) == 1.22
    assert round(oba.tps_ratio(0.38, 1.70), 2) == 0.81


@pytest.mark.parametrize("name,alpha,r,change", PAPER, ids=[p[0] for p in PAPER])
def test_paper_break_even_verdicts(name, alpha, r, change):
    # break-even alpha > r - 1 must agree with the sign of the measured TPS change, on every row
    assert oba.pays(alpha, r) == (change > 0)
    assert oba.break_even(r) == pytest.approx(r - 1)


def test_paper_dense_mask_break_even_value():
    # "so break-even would require α > 0.70"
    assert oba.break_even(1.70) == pytest.approx(0.70)


def test_paper_tps_identity():
    # Appendix D: (n̄/n)(ρ/r) "gives 1.17 for OBA" with n̄/n = 1 + ᾱ = 1.47 and ρ = 1 (same block size)
    assert round(oba.tps_ratio_identity(1.47, 1.0, 1.26), 2) == 1.17


def test_paper_tpf_ratio_falls_short_of_one_plus_naive_alpha():
    # "the TPF ratio ... 1.43 ... falls short of 1+ᾱ = 1.47": (n̄+1)/(n+1) < n̄/n for every n < n̄
    for nbar in (8.0, 13.0, 20.0):
        n = nbar / 1.47
        assert oba.tpf_ratio_identity(nbar, n) < 1.47
    # and the paper's TPF values give 22.25/15.64 = 1.42
    assert round(22.25 / 15.64, 2) == 1.42


@settings(derandomize=True, max_examples=40, deadline=None)
@given(nbar=st.floats(1.0, 60.0), alpha=st.floats(0.0, 0.95), k=st.integers(1, 30))
def test_transient_follows_the_recurrence(nbar, alpha, k):
    # iterate Eq. (3) directly: n_1 = n̄, n_{k+1} = n̄ − α n_k
    n = nbar
    for _ in range(k - 1):
        n = nbar - alpha * n
    assert oba.transient(nbar, alpha, k) == pytest.approx(n, rel=1e-9, abs=1e-9)
    # geometric approach: |n_k − n*| = α^{k−1} |n̄ − n*|
    ns = oba.fixed_point(nbar, alpha)
    assert abs(n - ns) == pytest.approx(alpha ** (k - 1) * abs(nbar - ns), rel=1e-6, abs=1e-9)


@settings(derandomize=True, max_examples=30, deadline=None)
@given(nbar=st.floats(2.0, 40.0), alpha=st.floats(-0.45, 0.95), blocks=st.floats(2.5, 50.0))
def test_fit_alpha_inverts_eq6(nbar, alpha, blocks):
    R = 100.0
    K = blocks * R
    F = oba.expected_passes(nbar, alpha, K, R)
    assert oba.fit_alpha(F, K, R, nbar) == pytest.approx(alpha, abs=1e-6)


def test_fit_alpha_errors():
    with pytest.raises(ValueError, match="no single root"):
        oba.fit_alpha(F=10.0 * 100, K=100, R=100, nbar=10.0)     # one-block responses: α unidentifiable
    with pytest.raises(ValueError, match="no single root"):
        oba.fit_alpha(F=1.0, K=1000, R=10, nbar=10.0)            # far fewer passes than any α allows
    with pytest.raises(ValueError, match="K=5"):
        oba.fit_alpha(F=100, K=5, R=10, nbar=10.0)
    with pytest.raises(ValueError, match="alpha=1.2"):
        oba.fixed_point(10, 1.2)


def test_exact_fit_removes_the_short_response_bias():
    # Appendix D: neglecting (−α)^{K_i} biases the fit on responses of few blocks
    nbar, alpha = 12.0, 0.54
    Ks = [3] * 50 + [2] * 50
    F = oba.expected_passes_exact(nbar, alpha, Ks)
    exact = oba.fit_alpha_exact(F, Ks, nbar)
    approx = oba.fit_alpha(F, sum(Ks), len(Ks), nbar)
    assert exact == pytest.approx(alpha, abs=1e-6)
    assert abs(approx - alpha) > 0.01   # a bias the size of the ±0.02 recovery budget
    # the exact sum equals the direct sum of the transient
    direct = sum(sum(oba.transient(nbar, alpha, k) for k in range(1, K + 1)) for K in Ks)
    assert F == pytest.approx(direct, rel=1e-12)


def test_counters_fit_keeps_eq5_where_eq6_has_no_root():
    """Two-block responses with α near 1: the second block costs n̄(1 − α), below every value Eq. 6 reaches, so
    Eq. 6 has no root; the counters' fit falls back to Eq. 5 on the per-response blocks and recovers α."""
    nbar, alpha, Ks = 44.0, 0.9, [2] * 8 + [3] * 2
    F = oba.expected_passes_exact(nbar, alpha, Ks)
    with pytest.raises(ValueError, match="no single root"):
        oba.fit_alpha(F, sum(Ks), len(Ks), nbar)
    a, method = oba.fit_alpha_counters(F, sum(Ks), len(Ks), nbar, Ks)
    assert method == "Eq. 5" and a == pytest.approx(alpha, abs=1e-6)
    with pytest.raises(ValueError, match="no single root"):     # without the per-response counts: the Eq. 6 error
        oba.fit_alpha_counters(F, sum(Ks), len(Ks), nbar)
    # where Eq. 6 has its root, it is the answer (the paper's estimator)
    F6 = oba.expected_passes(12.0, 0.54, 300, 100)
    a6, m6 = oba.fit_alpha_counters(F6, 300, 100, 12.0, [3] * 100)
    assert m6 == "Eq. 6" and a6 == pytest.approx(0.54, abs=1e-6)


@settings(derandomize=True, max_examples=25, deadline=None)
@given(alpha=st.floats(0.05, 0.9), blocks=st.floats(1.5, 40.0))
def test_naive_alpha_understates(alpha, blocks):
    nbar, R = 12.0, 200.0
    K = blocks * R
    F = oba.expected_passes(nbar, alpha, K, R)
    naive = oba.naive_alpha(nbar, F, K)
    assert naive < alpha
    assert naive == pytest.approx(oba.expected_naive_alpha(alpha, blocks), rel=1e-9)


def test_naive_alpha_tends_to_alpha_for_long_responses():
    assert oba.expected_naive_alpha(0.54, 1e6) == pytest.approx(0.54, abs=1e-5)


def test_eq4_counts_the_last_block_as_half():
    # responses of K_i blocks whose last block holds 1..C tokens uniformly: E[Y] = (K−1)C + (C+1)/2
    C = 256
    Ks = list(range(1, 21))
    Y = sum((K - 1) * C + (C + 1) / 2 for K in Ks)
    est = oba.blocks_from_tokens(Y, C, len(Ks))
    assert est == pytest.approx(sum(Ks), rel=0.002)


def test_tpf_tps_definitions():
    # Eq. (2) on a toy: 100 tokens, 4 blocks, 20 passes of 10 ms
    assert oba.tpf(100, 4, 20) == pytest.approx(100 / 24)
    assert oba.tps(100, 20, 0.01) == pytest.approx(500.0)


def test_bad_r():
    with pytest.raises(ValueError, match="r=0"):
        oba.tps_ratio(0.5, 0)
    assert math.isclose(oba.tps_ratio(0.0, 1.0), 1.0)
