"""SimPy serving model: closed-form checks at light load and saturation, SLO search, OOM."""
import math

import pytest

from dblock.simulator import cost
from dblock.simulator.hardware import Efficiency, Hardware
from dblock.simulator.positions import ParametricProfile
from dblock.simulator.serving import ServeConfig, max_rate_for_slo, simulate_serving

CFG = cost.llada2_mini()
# a device on which a pass costs exactly its calibrated overhead: 2L sub-blocks x OVERHEAD seconds
FAST = Hardware("instant", 1e30, None, None, 1e30, 1e15, 0.0,
                Efficiency(gemm=1.0, stream=1.0, gemm_knee_rows=1, launch_s=0, a2a_latency_s=0,
                           allreduce_latency_s=0, a2a_busbw=1e30, allreduce_busbw=1e30))
OVERHEAD = 1e-3
T_PASS = 2 * CFG.num_hidden_layers * OVERHEAD
N_PASSES = 10


def _sc(**kw):
    base = dict(cfg=CFG, hw=FAST, cal=cost.Calibration(overhead_s=OVERHEAD),
                profile=ParametricProfile(C=32, passes=f"const:{N_PASSES}"), prompt="const:64", tokens="const:128",
                requests=60, seed=0)
    base.update(kw)
    return ServeConfig(**base)


def test_light_load_itl_is_passes_times_pass_time_over_block():
    # one request at a time: every block takes N_PASSES passes of T_PASS and commits 32 tokens
    res = simulate_serving(_sc(arrivals=[10.0 * i for i in range(12)], warmup_frac=0.0))
    expect = N_PASSES * T_PASS / 32
    assert res.itl["p50"] == pytest.approx(expect, rel=1e-9)
    assert res.itl["p99"] == pytest.approx(expect, rel=1e-9)
    # TTFT at light load: no queueing, the prefill rides the first pass, so the first block's time
    assert res.ttft["p50"] == pytest.approx(N_PASSES * T_PASS, rel=1e-9)
    assert res.peak_batch == 1


def test_saturated_throughput_follows_the_batch_cap():
    # far above capacity the batch sits at the cap: throughput = cap · 32 tokens / (N_PASSES · T_PASS)
    cap = 8
    res = simulate_serving(_sc(rate=1000.0, batch_cap=cap, requests=120))
    assert res.peak_batch == cap
    assert res.throughput == pytest.approx(cap * 32 / (N_PASSES * T_PASS), rel=0.05)
    assert res.itl["p50"] == pytest.approx(N_PASSES * T_PASS / 32, rel=1e-6)   # ITL flat: the pass time is flat


def test_each_sources_itl_definition_in_closed_form():
    # answers of 40 tokens: a 32-token block then an 8-token one, one request at a time, every block N_PASSES passes.
    # dblock's equivalent ITL: block time / its tokens, per block; the Epoch reading: the block time, per block (the
    # first included); vLLM's per-block: the gaps after the first commit only (the second block's); SGLang's
    # per-token: each such gap over its 8 tokens, one sample per token
    res = simulate_serving(_sc(arrivals=[10.0 * i for i in range(8)], warmup_frac=0.0, tokens="const:40"))
    block = N_PASSES * T_PASS
    assert sorted([res.itl["p50"], res.itl["p99"]]) == pytest.approx([(block / 32 + block / 8) / 2, block / 8],
                                                                      rel=1e-2)
    assert res.itl_epoch["p50"] == pytest.approx(block, rel=1e-9) and res.itl_epoch["p99"] == pytest.approx(block)
    assert res.itl_block["p50"] == pytest.approx(block, rel=1e-9)
    assert res.itl_token["p50"] == pytest.approx(block / 8, rel=1e-9)
    assert res.itl_of("epoch") is res.itl_epoch and res.itl_of("dblock") is res.itl


def test_p95_itl_grows_with_rate_on_a_real_device():
    from dblock.simulator import hardware
    sc = dict(hw=hardware.get("h100"), par=cost.Parallel(8, 8, 8), cal=cost.Calibration(overhead_s=1e-3,
              moe_row_s=3e-6), requests=80)
    p95 = [simulate_serving(_sc(rate=lam, **sc)).itl["p95"] for lam in (0.5, 5.0, 50.0)]
    assert p95[0] < p95[1] < p95[2]


def test_slo_search_brackets_the_rate():
    from dblock.simulator import hardware
    sc = _sc(hw=hardware.get("h100"), par=cost.Parallel(8, 8, 8), cal=cost.Calibration(overhead_s=1e-3,
             moe_row_s=3e-6), requests=60)
    lo_itl = simulate_serving(sc.__class__(**{**sc.__dict__, "rate": 0.5})).itl["p95"]
    slo = lo_itl * 1.5
    rate, res = max_rate_for_slo(sc, slo, rate_lo=0.5, rate_hi=64.0, iters=6)
    assert 0.5 <= rate < 64.0
    assert res.itl["p95"] <= slo and res.stable
    above = simulate_serving(sc.__class__(**{**sc.__dict__, "rate": rate * 1.6}))
    assert above.itl["p95"] > slo or not above.stable


def test_oom_and_trace_arrivals():
    tiny = Hardware("tiny", 1e30, None, None, 1e30, 1e9, 0.0, FAST.eff)
    res = simulate_serving(_sc(hw=tiny, rate=100.0))
    assert res.oom
    res = simulate_serving(_sc(arrivals=[0.0, 0.0, 0.1, 5.0], requests=4, warmup_frac=0.0))
    assert res.finished == 4 and res.peak_batch == 3


def test_stability_flag():
    # far above capacity the queue grows: completions cannot keep up with arrivals
    assert not simulate_serving(_sc(rate=1000.0, batch_cap=4, requests=80)).stable
    assert simulate_serving(_sc(rate=0.5, requests=30)).stable


def test_config_errors():
    with pytest.raises(ValueError, match="batch_cap=0"):
        _sc(batch_cap=0)
    with pytest.raises(ValueError, match="path='fast'"):
        _sc(path="fast")
    assert not math.isnan(simulate_serving(_sc(rate=1.0, requests=5)).itl["p50"])
