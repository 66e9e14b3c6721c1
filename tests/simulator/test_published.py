"""The GPU cost model against published measurements (dblock/simulator/published.py, gpufit.py, dblock/cli/simulator_published.py):
the data file and its schema, the fit (re-run here and compared with the stored values), the predictions'
mechanics, and `simulate calibrate|validate --published`."""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from dblock.errors import ConfigError
from dblock.cli import simulator as cli
from dblock.simulator import cost, gpufit, hardware, published


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="dblock")
    cli.add_parser(parser.add_subparsers(dest="command"))
    rc = cli.main(parser.parse_args(argv))
    return rc, capsys.readouterr().out


@pytest.fixture(scope="module")
def data():
    return published.load()


@pytest.fixture(scope="module")
def refit(data):
    return gpufit.fit(data.points)


# ---- the data ---------------------------------------------------------------------------------------------------

def test_the_project_file_names_a_source_and_a_role_for_every_point(data):
    ids = [p.id for p in data.points]
    assert len(ids) == len(set(ids))
    roles = {p.role for p in data.points}
    assert roles == {"calibration", "held_out"}
    for p in data.points:
        assert len(p.source) > 20, p.id
        assert p.hardware in hardware.PROFILES
    # the published points the shared calibration set names are all calibration points here
    cal = {p.id for p in data.points if p.role == "calibration"}
    assert {"O1", "O2", "O3", "M2a", "M2b", "C1-tpot", "C1-ttft", "X1", "G2", "E1-moe1", "E1-moe32", "E3-512",
            "E6"} == cal


def _write(tmp_path, points, name="pts.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"points": points}))
    return str(path)


POINT = dict(id="U1", model="llada2-mini", hardware="h100", gpus=1, dtype="bf16", software="my engine",
             decoding=dict(schedule="native", block=32, tpf=3.0), workload=dict(batch=1),
             metric="pass_ms", value=5.0, source="our cluster")


@pytest.mark.parametrize("change, fragment", [
    (dict(colour="red"), "points[0] (id 'U1').colour"),
    (dict(hardware="tpu"), "unknown hardware 'tpu'"),
    (dict(value=-1.0), "value must be positive"),
    (dict(value=[3.0, 2.0]), "low > high"),
    (dict(tp=4), "tp=4 exceeds gpus=1"),
    (dict(metric="joules"), "points[0] (id 'U1').metric"),
    (dict(decoding=dict(tpf=-2)), "tpf must be a positive"),
])
def test_a_bad_point_is_one_error_naming_it(tmp_path, change, fragment):
    path = _write(tmp_path, [{**POINT, **change}])
    with pytest.raises(ConfigError) as e:
        published.load(path)
    assert fragment in str(e.value) and path in str(e.value)


def test_duplicate_ids_and_bad_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="duplicate point id 'U1'"):
        published.load(_write(tmp_path, [POINT, POINT]))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        published.load(str(bad))
    with pytest.raises(ConfigError, match="No such file"):
        published.load(str(tmp_path / "missing.json"))


# ---- the fit ----------------------------------------------------------------------------------------------------

def test_the_stored_fit_is_the_fit_of_the_calibration_points(data, refit):
    params, rec = gpufit.load_fit()
    assert set(params.values) == set(refit.params.values)
    for k, v in refit.params.values.items():
        assert params.values[k] == pytest.approx(v, rel=1e-6), k
    assert rec["calibration"] == [p.id for p in data.points if p.role == "calibration"]
    # every fitted value names the points that determine it (or says none does)
    assert set(rec["determined_by"]) == set(gpufit.PARAMS)


def test_held_out_points_do_not_move_the_fit(data, refit):
    moved = [p.model_copy(update={"value": p.low_high[0] * 7.0}) if p.role == "held_out" else p
             for p in data.points]
    again = gpufit.fit(moved)
    for k, v in refit.params.values.items():
        assert again.params.values[k] == pytest.approx(v, rel=1e-9), k


def test_the_fit_meets_its_targets_and_names_its_misses(data):
    rs = gpufit.rows(data, gpufit.stored(), gpufit.load_fit()[1]["calibration_points"])
    s = gpufit.summary(rs)
    assert s["fit"]["n"] == 13 and s["fit"]["median_abs_error"] <= 0.15
    assert s["held_out"]["median_abs_error"] <= 0.25
    # the one held-out figure beyond 2x is the Epoch paper's 76.4 ms forward (SIMULATOR.md: not reconcilable)
    assert set(s["held_out"]["beyond_2x"]) <= {"E1-t1"}
    # points the model cannot predict are listed with the reason, not dropped
    reasons = {r["id"]: r.get("not_predicted") for r in rs if r["predicted"] is None}
    assert "llama.cpp" in reasons["L1"] and "tokens per forward" in reasons["I1"]
    assert len(rs) == len(data.points)


# ---- predictions --------------------------------------------------------------------------------------------------

def _point(**kw):
    d = dict(POINT)
    d.update(kw)
    return published.Point.model_validate(d)


def test_error_against_a_value_and_a_range():
    p = _point(value=10.0)
    assert gpufit.error(12.0, p) == pytest.approx(0.2)
    r = _point(value=[10.0, 20.0])
    assert gpufit.error(15.0, r) == 0.0
    assert gpufit.error(5.0, r) == pytest.approx(-0.5)
    assert gpufit.error(30.0, r) == pytest.approx(0.5)


def test_request_metrics_follow_their_formulas():
    prm = gpufit.stored()
    cal = prm.cal("engine")
    cfg, hw = cost.llada2_mini(), hardware.get("b200")
    prompt, y, tpf = 320.0, 640.0, 4.0
    base = dict(hardware="b200", software="vllm", decoding=dict(schedule="native", block=32, tpf=tpf),
                workload=dict(batch=1, prompt_tokens=prompt, output_tokens=y))
    t = cost.pass_cost(cfg, cost.PassShape(batch=1, block=32, cache_len=prompt + y / 2), hw, cost.Parallel(1, 1, 1),
                       cal).total
    prefill = cost.pass_cost(cfg, cost.PassShape(batch=0, block=32, extra_rows=int(prompt)), hw,
                             cost.Parallel(1, 1, 1), cal).total
    n, K = 32 / tpf, y / 32
    ttft = prefill + n * t
    decode = (K - 1) * (n + 1) * t
    pred = {m: gpufit.predict(_point(metric=m, **base), prm).value for m in
            ("pass_ms", "ttft_ms", "tpot_ms", "request_ms", "tps_per_request", "canvas_ms")}
    assert pred["pass_ms"] == pytest.approx(1e3 * t)
    assert pred["ttft_ms"] == pytest.approx(1e3 * ttft)
    assert pred["tpot_ms"] == pytest.approx(1e3 * decode / (y - 1))
    assert pred["request_ms"] == pytest.approx(1e3 * (ttft + decode))
    assert pred["tps_per_request"] == pytest.approx(y / (ttft + decode))
    assert pred["canvas_ms"] == pytest.approx(1e3 * n * t)
    # SGLang prefills in block-sized chunks: a longer TTFT than one prefill pass over the prompt
    sg = gpufit.predict(_point(metric="ttft_ms", **{**base, "software": "SGLang"}), prm)
    assert sg.value > pred["ttft_ms"] and any("chunks" in a for a in sg.assumptions)


def test_ratios_and_what_cannot_be_predicted():
    prm = gpufit.stored()
    assert gpufit.predict(_point(metric="r"), prm).value == pytest.approx(1.0)
    oba = gpufit.predict(_point(metric="r", decoding=dict(schedule="oba", block=32, tpf=3.0)), prm).value
    assert oba > 1.0
    fb = gpufit.predict(_point(metric="r", decoding=dict(schedule="flowblock", block=32, paired_share=0.25)),
                        prm).value
    assert fb == pytest.approx(0.75 + 0.25 * oba)
    no_tpf = gpufit.predict(_point(model="llada-moe-7b", metric="tpot_ms", decoding=dict(schedule="native"),
                                   workload=dict(batch=1, prompt_tokens=10, output_tokens=100)), prm)
    assert no_tpf.value is None and "tokens per forward" in no_tpf.reason
    q4 = gpufit.predict(_point(dtype="q4"), prm)
    assert q4.value is None and "q4" in q4.reason
    fp8_on_a100 = gpufit.predict(_point(hardware="a100", dtype="fp8"), prm)
    assert fp8_on_a100.value is None and "fp8" in fp8_on_a100.reason


def test_assumptions_are_named_where_the_source_is_silent(data):
    prm = gpufit.stored()
    x1 = next(p for p in data.points if p.id == "X1")
    pr = gpufit.predict(x1, prm)
    assert any("TPF 2.55" in a for a in pr.assumptions) and any("GSM8K prompt" in a for a in pr.assumptions)


# ---- the commands -------------------------------------------------------------------------------------------------

def test_validate_published_table_and_json(capsys, data):
    rc, out = run(["simulate", "validate", "--published"], capsys)
    assert rc == 0
    assert "fit rows: median |error|" in out and "held-out rows" in out and "not predicted: L1, I1" in out
    rc, out = run(["simulate", "validate", "--published", "--json"], capsys)
    d = json.loads(out)
    assert len(d["rows"]) == len(data.points)
    for r in d["rows"]:
        assert {"id", "metric", "published", "predicted", "error", "role"} <= set(r)
        if r["predicted"] is not None and r["error"] is not None:
            lo, hi = (r["published"] if isinstance(r["published"], list) else [r["published"]] * 2)
            ref = lo if r["predicted"] < lo else (hi if r["predicted"] > hi else None)
            assert r["error"] == (0.0 if ref is None else pytest.approx(r["predicted"] / ref - 1))
    roles = {r["id"]: r["role"] for r in d["rows"]}
    assert roles["C1-tpot"] == "fit" and roles["S2-tpot"] == "held-out"


def test_a_users_file_is_predicted_with_the_project_fit(tmp_path, capsys):
    path = _write(tmp_path, [POINT, {**POINT, "id": "U2", "model": "llada-moe-7b", "decoding": {}}])
    rc, out = run(["simulate", "validate", "--published", path, "--json"], capsys)
    rows = {r["id"]: r for r in json.loads(out)["rows"]}
    assert rows["U1"]["predicted"] > 0 and rows["U1"]["role"] == "held-out"
    assert rows["U2"]["predicted"] is not None          # a pass needs no TPF


def test_calibrate_published_writes_a_fit_validate_reads(tmp_path, capsys, refit):
    out_fit = tmp_path / "fit.json"
    rc, out = run(["simulate", "calibrate", "--published", "--out", str(out_fit)], capsys)
    assert rc == 0 and "determined by" in out and "held (no calibration point determines them)" in out
    stored = json.loads(out_fit.read_text())
    for k, v in refit.params.values.items():
        assert stored["values"][k] == pytest.approx(v, rel=1e-9)
    rc, out = run(["simulate", "validate", "--published", "--fit", str(out_fit)], capsys)
    assert rc == 0 and str(out_fit) in out


@pytest.mark.parametrize("argv, fragment", [
    (["simulate", "validate", "--fit", "x.json"], "--fit: only with --published"),
    (["simulate", "validate", "--published", "--n", "8"], "--n does not apply"),
    (["simulate", "calibrate", "--published", "--cpu"], "--cpu does not apply"),
    (["simulate", "validate", "--published", "--fit", "/nonexistent/fit.json"], "--fit /nonexistent/fit.json"),
])
def test_flags_that_do_not_apply_are_refused(capsys, argv, fragment):
    with pytest.raises(ValueError) as e:
        run(argv, capsys)
    assert fragment in str(e.value)


# ---- the cost model's new terms -------------------------------------------------------------------------------------

def test_fixed_costs_and_tp_sharded_experts():
    cfg, hw = cost.llada2_mini(), hardware.get("h100")
    shape = cost.PassShape(batch=4, cache_len=300)
    base = cost.pass_cost(cfg, shape, hw, cost.Parallel(8, 8, 8))
    L = cfg.num_hidden_layers
    with_layer = cost.pass_cost(cfg, shape, hw, cost.Parallel(8, 8, 8), cost.Calibration(layer_s=1e-4, pass_s=2e-3))
    assert with_layer.total - base.total == pytest.approx(L * 1e-4 + 2e-3)
    # a per-all-to-all floor replaces the table's latency on every dispatch and combine
    a2a = cost.pass_cost(cfg, shape, hw, cost.Parallel(8, 8, 8), cost.Calibration(a2a_s=hw.eff.a2a_latency_s + 1e-5))
    assert a2a.total - base.total == pytest.approx(2 * len(cfg.moe_layers) * 1e-5)
    # ep = 1: every expert is sharded TP ways (weights and expert FLOPs split, an all-reduce combines)
    assert cost.weight_bytes(cfg, cost.Parallel(4, 1, 1)) < cost.weight_bytes(cfg, cost.Parallel(1, 1, 1)) / 3
    one = cost.pass_cost(cfg, shape, hw, cost.Parallel(1, 1, 1)).parts["moe_experts"]
    four = cost.pass_cost(cfg, shape, hw, cost.Parallel(4, 1, 1)).parts["moe_experts"]
    assert four < one / 3
    # efficiency terms: a slower stream or GEMM never makes a pass faster
    slow = cost.pass_cost(cfg, shape, hw, cost.Parallel(8, 8, 8), cost.Calibration(stream_scale=0.5))
    assert slow.total > base.total
    with pytest.raises(ValueError, match="layer_s=-1"):
        cost.Calibration(layer_s=-1)


def test_a_calibration_point_the_model_cannot_predict_is_named_not_fitted(data):
    odd = published.Point.model_validate({**POINT, "id": "Q1", "dtype": "q4", "role": "calibration"})
    res = gpufit.fit(list(data.points) + [odd])
    assert "Q1" in res.excluded and "q4" in res.excluded["Q1"] and "Q1" not in res.ids
    assert any("Q1 not fitted on" in line for line in gpufit.fit_lines(res))
