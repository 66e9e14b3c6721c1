"""Calibration from traces: synthetic traces written by the SimPy decoding model (known generating values), and
real traces written by the reference executor (`compare-schedules --trace-dir`)."""
import pytest

from dblock.simulator import calibrate, cost, oba
from dblock.simulator.decoding import simulate_decoding
from dblock.simulator.hardware import Efficiency, Hardware
from dblock.simulator.positions import ParametricProfile, PositionModel
from dblock.trace import TraceWriter

CFG = cost.llada2_mini()
# a made-up CPU-like device (not measured: tests never depend on this machine's speed)
HW = Hardware("toy-cpu", 2e11, None, None, 2e10, 64e9, 0.0,
              Efficiency(gemm=1.0, stream=1.0, gemm_knee_rows=1, launch_s=0, a2a_latency_s=0, allreduce_latency_s=0,
                         a2a_busbw=2e10, allreduce_busbw=2e10))
SCALE, OVERHEAD = 3.0, 2e-4       # the "true" machine: 3x slower than the roofline, 0.2 ms per sub-block
DELTA = 0.45
PROF = ParametricProfile(C=32, passes="gamma:12,0.2", shape=1.5)


def _timer(ev):
    if ev["kind"] != "denoise":
        return 1e-3
    shape = calibrate.pass_shape(ev)
    return SCALE * cost.pass_cost(CFG, shape, HW).total + OVERHEAD * 2 * CFG.num_hidden_layers


def _trace(tmp_path, schedule, gamma=0.9, seed=0, tokens="gamma:320,0.3"):
    path = str(tmp_path / f"{schedule}.jsonl")
    with TraceWriter(path) as tw:
        simulate_decoding(PositionModel(PROF, delta=DELTA), schedule, tokens, responses=40, gamma=gamma,
                          seed=seed, trace=tw, timer=_timer, prompt_len=64)
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    return {s: _trace(d, s, gamma=0.5) for s in ("native", "oba", "flowblock")}


@pytest.fixture(scope="module")
def cal(traces):
    runs = [calibrate.Run.load(traces["native"]), calibrate.Run.load(traces["oba"])]
    return calibrate.calibrate(runs, hw=HW, cfg=CFG, delta_from="oba", gamma=0.5)


def test_calibrate_recovers_the_generating_values(cal):
    assert cal.nbar == pytest.approx(PROF.nbar, rel=0.05)
    assert cal.alphas["oba"]["alpha"] == pytest.approx(DELTA, abs=0.03)
    assert cal.alphas["oba"]["naive"] < cal.alphas["oba"]["alpha"]
    # the cost fit finds the machine's scale and per-sub-block overhead
    assert cal.cost_fit.cal.scale == pytest.approx(SCALE, rel=0.02)
    # Calibration's overhead is applied before the scale (pass_cost = scale · (roofline + overhead · 2L))
    assert cal.cost_fit.cal.overhead_s * cal.cost_fit.cal.scale == pytest.approx(OVERHEAD, rel=0.05)
    shape = cost.PassShape(batch=4, block=16, cache_len=100.0)
    assert cost.pass_cost(CFG, shape, HW, cost.Parallel(), cal.cost_fit.cal).total == pytest.approx(
        SCALE * cost.pass_cost(CFG, shape, HW).total + OVERHEAD * 2 * CFG.num_hidden_layers, rel=0.05)
    assert cal.delta == pytest.approx(DELTA, abs=0.05)
    # liveness from the per-position lists: the live share over a block's passes lies strictly inside (0, 1)
    assert 0.0 < cal.liveness.live < 1.0 and cal.liveness.live <= cal.liveness.fresh <= 1.0


def test_predict_held_out_flowblock(traces, cal):
    pred = calibrate.predict_run(cal, calibrate.Run.load(traces["flowblock"]))
    assert abs(pred["rel_error"]["tps_ratio"]) <= 0.10            # the target on TPS ratios
    assert abs(pred["rel_error"]["t_den"]) <= 0.05
    assert pred["predicted"]["alpha"] < cal.alphas["oba"]["alpha"]


def test_trace_counters_match_the_schema(traces):
    run = calibrate.Run.load(traces["oba"])
    c = run.counters()
    assert c["R"] == 40 and c["K"] == sum(r["K"] for r in run.requests)
    for r in run.requests:
        assert r["Q"] == r["F"] + r["K"]
    b = run.blocks[0]
    assert len(b["accept_pass"]) == len(b["kept"]) == b["size"] == 32
    assert run.schedule == "oba"
    # a paired OBA pass event is read back as the paired layout
    ev = next(p for p in run.passes if p["kind"] == "denoise")
    assert calibrate.pass_shape(ev).layout == "oba"
    assert oba.blocks_from_tokens(c["Y"], 32, c["R"]) == pytest.approx(c["K"], rel=0.05)


def test_calibrate_needs_a_native_run(traces):
    with pytest.raises(ValueError, match="no Native run"):
        calibrate.calibrate([calibrate.Run.load(traces["oba"])])


def test_bad_trace_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"event": "run"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        calibrate.Run.load(str(p))


def test_delta_that_cannot_be_calibrated_is_reported_not_fatal(traces, monkeypatch):
    def refuse(*a, **k):
        raise ValueError("calibrate_delta: alpha=-0.05 is below what delta = 0 gives on this profile (0.000)")
    monkeypatch.setattr(calibrate, "calibrate_delta", refuse)
    runs = [calibrate.Run.load(traces["native"]), calibrate.Run.load(traces["oba"])]
    cal = calibrate.calibrate(runs, hw=HW, cfg=CFG, delta_from="oba", gamma=0.5)
    assert cal.delta is None and "below what delta = 0 gives" in cal.delta_note
    assert cal.cost_fit is not None                      # the cost fit and the Native predictions stand
    pred = calibrate.predict_run(cal, calibrate.Run.load(traces["flowblock"]))
    assert pred["predicted"]["alpha"] != pred["predicted"]["alpha"] and "below what delta" in pred["note"]
    assert "delta_note" in cal.as_dict()


def test_real_executor_traces(tmp_path):
    """Traces written by the reference executor calibrate, and the held-out schedules are named as the executor
    names them (flowblock2), with Keep Tokens as a bracket and unsupported ablations marked, not guessed."""
    from dblock.profiling.compare import compare_schedules
    from dblock.decoding.generate import reference_forward
    from dblock.decoding.params import DecodeConfig
    from dblock.tiny import make_tiny_model
    fwd = reference_forward(make_tiny_model("llada2_moe", seed=3))
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    compare_schedules(fwd, prompts, DecodeConfig(max_new_tokens=48, rule="fixed-k", steps=8),
                      ["native", "oba", "flowblock", "keep_tokens", "no_accept"], trace_dir=str(tmp_path))
    runs = {s: calibrate.Run.load(str(tmp_path / f"{s}.jsonl")) for s in ("native", "oba", "flowblock",
                                                                          "keep_tokens", "no_accept")}
    assert runs["flowblock"].schedule == "flowblock2"
    cal = calibrate.calibrate([runs["native"], runs["oba"]], delta_from="oba", gamma=0.5)
    assert cal.nbar == pytest.approx(runs["native"].counters()["n"])
    preds = {s: calibrate.predict_run(cal, runs[s]) for s in ("flowblock", "keep_tokens", "no_accept")}
    # a masked model's waiting block decodes nothing (docs/algorithms.md §3): every multi-block schedule runs
    # Native's passes, and the prediction says so instead of running the position model
    for s in ("flowblock", "keep_tokens", "no_accept"):
        assert preds[s]["predicted"]["n"] == pytest.approx(cal.nbar) and preds[s]["predicted"]["alpha"] == 0.0
        assert "masked model" in preds[s]["note"]
        assert preds[s]["measured"]["n"] == pytest.approx(cal.nbar)


def test_delta_source_named_without_its_window_and_the_gate_from_the_trace(traces):
    """`delta_from="flowblock"` finds a trace the executor named `flowblock2`, and the simulated readiness gate is
    the one that trace's header records (not a default that differs from the decoder's)."""
    fb = calibrate.Run.load(traces["flowblock"])
    fb.header = dict(fb.header, schedule="flowblock2", gate=0.5)
    cal = calibrate.calibrate([calibrate.Run.load(traces["native"]), fb], delta_from="flowblock")
    assert cal.delta_from == "flowblock2" and cal.gamma == 0.5
    assert cal.delta is not None and cal.delta == pytest.approx(DELTA, abs=0.1)
    fb.header["gate"] = 0.8
    assert calibrate.calibrate([calibrate.Run.load(traces["native"]), fb], delta_from="flowblock").gamma == 0.8
    assert calibrate.canonical_schedule("FlowBlock3") == "flowblock"
    assert calibrate.canonical_schedule("keep_all") == "oba"
