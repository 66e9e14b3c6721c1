"""The SimPy decoding model reproduces the closed forms, and fit_alpha recovers α from its counters."""
import numpy as np
import pytest

from dblock.simulator import oba
from dblock.simulator.decoding import simulate_decoding
from dblock.simulator.dists import Dist
from dblock.simulator.positions import ParametricProfile, PositionModel


def _profile(nbar, C=32):
    # cv 0.2 keeps n̄ − α n_k above one pass, so the max(1, ·) clip does not bend the linear recurrence
    return ParametricProfile(C=C, passes=f"gamma:{nbar},0.2", shape=1.5)


@pytest.mark.parametrize("nbar,alpha,tokens", [
    (8.0, 0.54, "gamma:384,0.3"),        # ~12 blocks of 32, spread
    (20.0, 0.25, "uniform:200,640"),     # 7..20 blocks
    (14.0, 0.40, "lognormal:320,0.5"),   # long tail
], ids=["nbar8-a.54-gamma", "nbar20-a.25-uniform", "nbar14-a.40-lognormal"])
def test_fit_alpha_recovers_known_alpha(nbar, alpha, tokens):
    prof = _profile(nbar)
    model = PositionModel(prof, delta=alpha, noise_sd=0.2)       # saving per warm-up step α with noise
    res = simulate_decoding(model, "oba", tokens, responses=150, seed=1)
    fitted = oba.fit_alpha(res.F, res.K, res.R, prof.nbar)
    assert fitted == pytest.approx(alpha, abs=0.02)
    # and naive ᾱ understates it, by about what Eq. (6) predicts for these response lengths
    naive = oba.naive_alpha(prof.nbar, res.F, res.K)
    assert naive < fitted
    assert naive == pytest.approx(oba.expected_naive_alpha(alpha, res.K / res.R), abs=0.03)


def test_simpy_mean_matches_fixed_point_and_transient():
    nbar, alpha = 12.0, 0.5
    prof = _profile(nbar)
    res = simulate_decoding(PositionModel(prof, delta=alpha, noise_sd=0.2), "oba", "const:640", responses=250,
                            seed=3)
    means = res.mean_passes_by_index(20)
    closed = oba.transient(prof.nbar, alpha, np.arange(1, 21))
    # blocks 8..20 sit at the fixed point: within 2%
    late = np.mean(means[7:])
    assert late == pytest.approx(oba.fixed_point(prof.nbar, alpha), rel=0.02)
    # the transient of the first blocks: n_1 = n̄, n_2 = n̄(1 − α), n_3 = n̄(1 − α + α²)
    assert means[:3] == pytest.approx(closed[:3], rel=0.05)
    assert means[1] < means[2]  # the oscillation around n*


def test_tps_ratio_near_fixed_point_for_long_responses():
    nbar, alpha, r = 12.0, 0.5, 1.26
    prof = _profile(nbar)
    kw = dict(responses=80, seed=5, r=r, t_pass=1e-3)
    nat = simulate_decoding(PositionModel(prof, delta=alpha), "native", "const:1600", **kw)
    ob = simulate_decoding(PositionModel(prof, delta=alpha), "oba", "const:1600", **kw)
    # 50 blocks per response: the first block's transient is a ~1% effect
    assert ob.tps / nat.tps == pytest.approx(oba.tps_ratio(alpha, r), rel=0.03)
    # T_den ratio is r exactly: every OBA pass is paired
    assert ob.t_den / nat.t_den == pytest.approx(r, rel=1e-9)
    # Native draws n̄ passes per block
    assert nat.F / nat.K == pytest.approx(prof.nbar, rel=0.03)


def test_counters_and_tpf():
    prof = _profile(10.0)
    res = simulate_decoding(PositionModel(prof, delta=0.3), "native", "const:100", responses=10, seed=0)
    for r in res.requests:
        assert r.K == 4                     # ceil(100 / 32)
        assert r.Q == r.F + r.K             # 1 prefill + K − 1 appends + F
        assert r.Y == 100
    assert res.tpf == pytest.approx(res.Y / (res.K + res.F))


def test_flowblock_sits_between_native_and_oba():
    prof = _profile(12.0)
    kw = dict(responses=80, seed=2)
    f = {s: simulate_decoding(PositionModel(prof, delta=0.5), s, "const:480", gamma=0.6, **kw).F
         for s in ("native", "flowblock", "oba")}
    assert f["oba"] < f["flowblock"] < f["native"]


def test_errors():
    prof = _profile(10.0)
    with pytest.raises(ValueError, match="schedule='dense'"):
        simulate_decoding(PositionModel(prof), "dense", "const:64", responses=2)
    with pytest.raises(ValueError, match="unknown kind 'normal'"):
        Dist.parse("normal:3,1")
    with pytest.raises(ValueError, match="responses=0"):
        simulate_decoding(PositionModel(prof), "oba", "const:64", responses=0)
