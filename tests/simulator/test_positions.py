"""Position-level model: α of a schedule from a Native profile and a warm-up rate δ."""
import numpy as np
import pytest

from dblock.simulator.positions import (EmpiricalProfile, NativeBlock, ParametricProfile, PositionModel,
                                        calibrate_delta, gate_pass, predict_alpha)

PROF = ParametricProfile(C=32, passes="gamma:12,0.2", shape=1.5)


def test_constant_discount_keep_all_gives_alpha_equal_delta():
    # keep-all promotion with a constant δ is Eq. (3) with α = δ when the max(1, ·) clip never binds
    m = PositionModel(PROF, delta=0.4, integer=False)
    p = predict_alpha(m, "oba", "const:10", responses=150)
    assert p.alpha == pytest.approx(0.4, abs=0.015)
    assert p.alpha_product == pytest.approx(p.alpha, abs=0.02)   # α = saving per step × steps per pass
    assert p.paired_frac == 1.0


def test_flowblock_gate_limits():
    m = PositionModel(PROF, delta=0.4, integer=False)
    oba_ = predict_alpha(m, "oba", "const:8", responses=80)
    fb0 = predict_alpha(m, "flowblock", "const:8", responses=80, gamma=0.0)    # no gate: OBA
    fb1 = predict_alpha(m, "flowblock", "const:8", responses=80, gamma=1.0)    # gate at the last pass
    fbm = predict_alpha(m, "flowblock", "const:8", responses=80, gamma=0.7)
    assert fb0.alpha == pytest.approx(oba_.alpha, abs=1e-9)
    assert abs(fb1.alpha) < 0.02 and fb1.paired_frac < 0.01
    assert fb1.alpha < fbm.alpha < oba_.alpha
    # the product: FlowBlock's α = saving per warm-up step × warm-up steps per predecessor pass
    assert fbm.alpha == pytest.approx(fbm.saved_per_step * fbm.steps_per_pred_pass, abs=0.02)


def test_calibrate_delta_round_trip():
    m = PositionModel(PROF, delta=0.6, discount="readiness", integer=False)
    target = predict_alpha(m, "oba", "const:8", responses=60).alpha
    d = calibrate_delta(PROF, "oba", target, "const:8", responses=60, discount="readiness")
    assert d == pytest.approx(0.6, abs=0.01)


def test_keep_tokens_rules_bracket_and_stay_below_keep_all():
    kw = dict(responses=80)
    a_all = predict_alpha(PositionModel(PROF, delta=0.5, integer=False), "oba", "const:8", **kw).alpha
    a_cnt = predict_alpha(PositionModel(PROF, delta=0.5, policy="keep_tokens", token_rule="count", integer=False),
                          "oba", "const:8", **kw).alpha
    a_max = predict_alpha(PositionModel(PROF, delta=0.5, policy="keep_tokens", token_rule="max", integer=False),
                          "oba", "const:8", **kw).alpha
    assert a_max <= a_cnt <= a_all


def test_readiness_discount_is_below_constant():
    # a readiness-weighted step is worth δ·(fraction settled) <= δ
    c = predict_alpha(PositionModel(PROF, delta=0.5, integer=False), "oba", "const:8", responses=60).alpha
    r = predict_alpha(PositionModel(PROF, delta=0.5, discount="readiness", integer=False), "oba", "const:8",
                      responses=60).alpha
    assert r < c


def test_promote_accept_passes():
    blk = NativeBlock(need=6.0, first=np.array([1.0, 2.0, 4.0, 6.0]), kept=np.array([True, True, False, True]))
    m = PositionModel(PROF, delta=1.0, integer=False)
    p = m.promote(blk, clock=2.0, warmup_steps=2, rng=np.random.default_rng(0))
    assert p.passes == pytest.approx(4.0)
    assert p.accept.tolist() == [0, 0, 2, 4]        # positions settled during warm-up are accepted at promotion
    assert gate_pass(p, 0.5) == 0 and gate_pass(p, 0.75) == 2 and gate_pass(p, 1.0) == 4


def test_empirical_profile_from_block_events():
    evs = [dict(request=0, block=0, passes=3, accept_pass=[1, 3, -1, 2], kept=[True, True, False, True]),
           dict(request=0, block=1, passes=2, accept_pass=[1, 2, 2, 1]),
           dict(request=0, block=2, passes=4)]                       # no per-position lists: skipped
    prof = EmpiricalProfile.from_block_events(evs)
    assert len(prof.blocks) == 2 and prof.C == 4
    assert prof.nbar == pytest.approx(2.5)
    assert np.isinf(prof.blocks[0].first[2])
    assert prof.blocks[0].settle.tolist() == [1.0, 3.0, 3.0, 2.0]    # never accepted: settles at the end
    with pytest.raises(ValueError, match="kept has 2 entries"):
        EmpiricalProfile.from_block_events([dict(request=1, block=0, passes=2, accept_pass=[1, 2, 2], kept=[1, 1])])
    with pytest.raises(ValueError, match="no Native blocks"):
        EmpiricalProfile.from_block_events([dict(passes=2)])


def test_matching_profile_first_pass_fraction():
    prof = ParametricProfile.matching(256, 13.0, 0.054)
    rng = np.random.default_rng(0)
    fr = np.mean([np.mean(prof.sample(rng).first <= 1.0) for _ in range(300)])
    assert fr == pytest.approx(0.054, abs=0.015)     # the paper's Figure 2 Native first-pass acceptance


def test_model_errors():
    with pytest.raises(ValueError, match="discount='x'"):
        PositionModel(PROF, discount="x")
    with pytest.raises(ValueError, match="policy='y'"):
        PositionModel(PROF, policy="y")
    with pytest.raises(ValueError, match="schedule='z'"):
        predict_alpha(PositionModel(PROF), "z", "const:2", responses=2)
