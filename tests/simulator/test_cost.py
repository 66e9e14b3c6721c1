"""Roofline pass cost, memory, hardware profiles, and the Epoch paper checks."""
import json

import pytest

from dblock.simulator import cost, hardware, papers
from dblock.simulator.hardware import Efficiency, Hardware

CFG = cost.llada2_mini()


def _compute_only_hw():
    # infinite bandwidth, no latencies: every component is its FLOPs / (peak · eff)
    return Hardware("flops-only", 1e12, None, None, 1e30, 1e12, 0.0,
                    Efficiency(gemm=1.0, stream=1.0, gemm_knee_rows=1, launch_s=0, a2a_latency_s=0,
                               allreduce_latency_s=0, a2a_busbw=1e30, allreduce_busbw=1e30))


def test_model_card_parameter_counts():
    # LLaDA2.0-mini is "16B-A1.4B"; LLaDA-MoE-7B-A1B: 7B total, ~1B active without embeddings
    p = cost.param_counts(CFG)
    assert p["total"] == pytest.approx(16e9, rel=0.03)
    assert p["active"] == pytest.approx(1.4e9, rel=0.05)
    q = cost.param_counts(cost.llada_moe_7b())
    assert q["total"] == pytest.approx(7e9, rel=0.06)
    assert q["active_non_embedding"] == pytest.approx(1e9, rel=0.1)
    assert cost.weight_bytes(CFG) == pytest.approx(2 * p["total"], rel=0.01)


def test_attention_core_flops_by_layout():
    hw = _compute_only_hw()
    C, L = 32, 100
    D, nH, layers = CFG.head_dim, CFG.num_attention_heads, CFG.num_hidden_layers
    expect = {"native": C * (L + C), "oba": C * (L + C) + C * (L + 2 * C), "dense_mask": 2 * C * (L + 2 * C)}
    for lay, qk in expect.items():
        c = cost.pass_cost(CFG, cost.PassShape(batch=3, layout=lay, block=C, cache_len=L), hw)
        assert c.parts["attn_core"] == pytest.approx(layers * 4 * D * nH * 3 * qk / 1e12, rel=1e-9)


def test_r_ordering_when_attention_dominates():
    # long cache, compute-bound: the paired layout skips a quarter of the 2C x 2C tiles, so r_oba < r_dense_mask
    hw = hardware.get("h100")
    r_oba = cost.r_of(CFG, "oba", hw, cache_len=16000, batch=64)
    r_dm = cost.r_of(CFG, "dense_mask", hw, cache_len=16000, batch=64)
    assert 1.0 < r_oba < r_dm
    assert cost.r_of(CFG, "native2c", hw, cache_len=16000, batch=64) == pytest.approx(r_dm)


def test_epoch_degenerates_to_dense_plus_its_extras():
    hw = hardware.get("h100")
    par = cost.Parallel(8, 8, 8)
    d = cost.pass_cost(CFG, cost.PassShape(batch=64), hw, par)
    e = cost.pass_cost(CFG, cost.PassShape(batch=64, path="epoch"), hw, par)   # everything fresh and live
    extras = e.parts["moe_epoch_extra"]
    assert e.total == pytest.approx(d.total + extras, rel=1e-9)
    # fewer fresh rows never cost more
    e2 = cost.pass_cost(CFG, cost.PassShape(batch=64, path="epoch", fresh_frac=0.5, live_frac=0.5), hw, par)
    assert e2.total < e.total


def test_expert_rows_knee():
    # a touched expert pays at least `knee` rows: at one row the padded rows are touched · knee
    hw = hardware.get("h100")
    c = cost.pass_cost(CFG, cost.PassShape(batch=1, block=1), hw)
    assert c.pairs == CFG.num_experts_per_tok
    assert c.padded_rows == pytest.approx(c.pairs * hw.eff.gemm_knee_rows, rel=0.01)


def test_memory_and_oom():
    hw = hardware.get("h100")
    par = cost.Parallel(8, 8, 8)
    m1 = cost.memory(CFG, cost.PassShape(batch=1), hw, par)
    m2 = cost.memory(CFG, cost.PassShape(batch=512), hw, par)
    assert m1.weights == m2.weights == pytest.approx(cost.weight_bytes(CFG, par))
    assert m2.kv_cache == pytest.approx(512 * m1.kv_cache)
    assert m2.total > m1.total and not m1.oom
    tiny = Hardware("tiny", 1e12, None, None, 1e12, 5e9, 0.0)
    assert cost.memory(CFG, cost.PassShape(batch=64), tiny, par).oom


def test_shape_errors():
    with pytest.raises(ValueError, match="layout='wide'"):
        cost.PassShape(layout="wide")
    with pytest.raises(ValueError, match="fresh_frac=1.5"):
        cost.PassShape(fresh_frac=1.5)
    with pytest.raises(ValueError, match="tp=0"):
        cost.Parallel(tp=0)


def test_hardware_profiles():
    for name, hw in hardware.PROFILES.items():
        assert hw.bf16_flops > 0 and hw.hbm_bw > 0 and hw.hbm_bytes > 0 and hw.source
        if hw.fp8_flops:
            assert hw.fp8_flops == pytest.approx(2 * hw.bf16_flops, rel=0.01)   # FP8 tensor rate = 2x BF16
    # datasheet values (H100 SXM5: 989.4 TFLOPS BF16 dense, 3.35 TB/s, 80 GB; H200: 4.8 TB/s, 141 GB)
    assert hardware.get("h100").bf16_flops == pytest.approx(989.4e12)
    assert hardware.get("H200").hbm_bytes == pytest.approx(141e9)
    with pytest.raises(ValueError, match="no fp8"):
        hardware.get("a100").flops("fp8")
    with pytest.raises(ValueError, match="unknown"):
        hardware.get("tpu")


def test_cpu_profile_measurement(tmp_path):
    # measures here; asserts only that a usable profile is written and read back (never a speed)
    path = str(tmp_path / "cpu.json")
    hw = hardware.calibrate_cpu(matmul_n=64, stream_mb=1, repeats=2, path=path)
    back = hardware.get(path)
    assert back == hw
    assert json.load(open(path))["eff"]["gemm"] == 1.0


def test_fig2_calibration_fits_the_paper():
    # two terms fitted on three numbers of Epoch's Figure 2: it must land close to all three
    fit = papers.fig2_calibration()["fit"]
    assert fit["t_batch1"] == pytest.approx(76.4e-3, rel=0.02)
    assert fit["moe_share_batch1"] == pytest.approx(0.60, abs=0.04)
    assert fit["moe_share_batch32"] == pytest.approx(0.77, abs=0.04)


def _published():
    from dblock.simulator import gpufit
    return gpufit.calibration("engine")


def test_epoch_speedup_prediction_at_batch_128():
    # the published fit (nothing fitted on this figure); the paper: 1.1-1.3x at batch 128 (±10% allowed)
    rows = {r["batch"]: r for r in papers.epoch_batch_trend(_published(), (128, 256, 512))}
    assert 1.1 * 0.9 <= rows[128]["speedup"] <= 1.3 * 1.1
    # the speedup grows with batch, as in the paper
    assert rows[128]["speedup"] < rows[256]["speedup"] < rows[512]["speedup"]


@pytest.mark.xfail(strict=True, reason="known miss (SIMULATOR.md, 'Epoch at scale'): 1.17x predicted where the paper "
                   "reports 1.6-1.7x at batch 256 for LLaDA2.0-mini")
def test_epoch_speedup_prediction_at_batch_256():
    (row,) = papers.epoch_batch_trend(_published(), (256,))
    assert 1.6 * 0.9 <= row["speedup"] <= 1.7 * 1.1


@pytest.mark.xfail(strict=True, reason="known miss (SIMULATOR.md, 'Epoch at scale'): the model saturates near "
                   "1/fresh share of the MoE path (1.23x) where the paper reports 1.8-1.9x at batch 512 for "
                   "LLaDA2.0-mini")
def test_epoch_speedup_prediction_at_batch_512():
    (row,) = papers.epoch_batch_trend(_published(), (512,))
    assert row["speedup"] >= 1.8 * 0.9


@pytest.mark.xfail(strict=True, reason="known miss (SIMULATOR.md): the memory model does not reach the dense "
                   "path's OOM at batch 512 on 80 GB")
def test_dense_oom_at_512():
    (row,) = papers.epoch_batch_trend(_published(), (512,))
    assert row["dense_oom"] and not row["epoch_oom"]


@pytest.mark.parametrize("rate", [16.0, 26.0])
def test_the_epoch_papers_online_setting(rate):
    # the paper: Epoch's P95 equivalent ITL (a block's latency) stays at 55-60 ms from 16 to 26 req/s on one 8xH100
    # node; the published fit (on which only the 26 req/s figure was a calibration point, analytically) within 25%
    from dblock.simulator.serving import ServeConfig, simulate_serving
    sc = ServeConfig(CFG, hardware.get("h100"), cost.Parallel(8, 8, 8), _published(), path="epoch",
                     profile=papers.LLADA2_PROFILE, prompt="const:256", tokens="lognormal:256,0.5", batch_cap=256,
                     requests=600, rate=rate)
    p95 = simulate_serving(sc).itl_epoch["p95"]
    assert 0.055 * 0.75 <= p95 <= 0.060 * 1.25
