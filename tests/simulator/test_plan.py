"""`dblock simulate plan` (dblock/simulator/plan.py, dblock/cli/simulator_plan.py) and `--liveness-from` (liveness.trace_profile):
properties of the search (monotone in rate and in the SLO; a plan re-simulated by `simulate serve` at its settings
meets the SLO), the table, the JSON, the infeasible and out-of-memory answers, bad input."""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dblock.cli import simulator as cli
from dblock.simulator import cost, hardware, plan
from dblock.simulator.liveness import LivenessProfile, per_pass, trace_profile
from dblock.simulator.positions import ParametricProfile
from tests.fuzz.harness import check_contract, run_cli

# a small search: one hardware kind, 8 GPUs per replica, Epoch only, short answers
SMALL = ["--model", "llada2-mini", "--hardware", "h200", "--gpus-per-replica", "8", "--executors", "epoch",
         "--prompt", "const:256", "--tokens", "lognormal:128,0.5", "--requests", "60"]
PROFILE = ParametricProfile(C=32, passes="gamma:10,0.3")


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="dblock")
    cli.add_parser(parser.add_subparsers(dest="command"))
    rc = cli.main(parser.parse_args(argv))
    return rc, capsys.readouterr().out


def inputs(rate: float, slo_itl=None, slo_ttft=None, verify=False, gpus=(1, 8)) -> plan.Inputs:
    return plan.Inputs(cfg=cost.llada2_mini(), model="llada2-mini", hardware={"h200": hardware.get("h200")},
                       prices=dict(plan.PRICES), rate=rate, prompt="const:256", tokens="lognormal:128,0.5",
                       slo_itl=slo_itl, slo_ttft=slo_ttft, profile=PROFILE, gpus=gpus, executors=("epoch",),
                       top=2, requests=60, verify=verify)


def fewest_gpus(res: plan.Result) -> float:
    return min((c["gpus"] for c in res.candidates), default=math.inf)


@settings(max_examples=4, deadline=None)
@given(st.floats(1.0, 60.0), st.floats(1.05, 4.0))
def test_a_higher_rate_never_needs_fewer_gpus(rate, factor):
    lo = plan.search(inputs(rate, slo_itl=0.08, slo_ttft=2.0))
    hi = plan.search(inputs(rate * factor, slo_itl=0.08, slo_ttft=2.0))
    assert fewest_gpus(hi) >= fewest_gpus(lo)
    assert math.isfinite(fewest_gpus(lo))


@settings(max_examples=4, deadline=None)
@given(st.floats(0.03, 0.2), st.floats(1.0, 3.0))
def test_a_looser_slo_never_costs_more(slo_itl, looser):
    tight = plan.search(inputs(20.0, slo_itl=slo_itl, slo_ttft=3.0))
    loose = plan.search(inputs(20.0, slo_itl=slo_itl * looser, slo_ttft=3.0 * looser))
    cost_tight = min((c["cost_per_mtok"] for c in tight.candidates), default=math.inf)
    cost_loose = min((c["cost_per_mtok"] for c in loose.candidates), default=math.inf)
    assert cost_loose <= cost_tight


@settings(max_examples=2, deadline=None)
@given(st.floats(5.0, 40.0), st.floats(0.06, 0.12))
def test_a_plan_resimulated_by_simulate_serve_meets_the_slo(rate, slo_itl):
    res = plan.search(inputs(rate, slo_itl=slo_itl, slo_ttft=2.5, verify=True, gpus=(8,)))
    assert res.plans, res.binding
    p = res.plans[0]
    argv = ["simulate", "serve", "--json", "--model", "llada2-mini", "--hardware", p["hardware"], "--tp", str(p["tp"]),
            "--ep", str(p["ep"]), "--sp", str(p["sp"]), "--path", p["executor"], "--schedule", p["schedule"],
            "--batch-cap", str(p["batch_cap"]), "--rates", repr(rate / p["replicas"]), "--prompt", "const:256",
            "--tokens", "lognormal:128,0.5", "--passes", "gamma:10,0.3", "--requests", "60", "--calibration", "none"]
    parser = argparse.ArgumentParser(prog="dblock")
    cli.add_parser(parser.add_subparsers(dest="command"))
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(parser.parse_args(argv)) == 0
    curve = json.loads(buf.getvalue())["curves"][p["executor"]][0]
    assert curve["itl_epoch"]["p95"] <= slo_itl
    assert curve["ttft"]["p95"] <= 2.5
    assert curve["itl_epoch"]["p95"] == pytest.approx(p["p95_itl_s"], rel=1e-9)


def test_table_json_and_plot(tmp_path, capsys):
    png = tmp_path / "pareto.png"
    rc, out = run(["simulate", "plan", *SMALL, "--rate", "10", "--slo-itl", "0.15", "--slo-ttft", "2", "--top", "2",
                   "--plot", str(png)], capsys)
    assert rc == 0
    assert "TPxEPxSP" in out and "$/Mtok" in out
    rows = [ln for ln in out.splitlines() if ln.strip().startswith("1 h200")]
    assert rows, out
    assert "cheapest:" in out and "H200s" in out and "band comes mostly from the" in out
    assert png.stat().st_size > 1000
    rc, out = run(["simulate", "plan", *SMALL, "--rate", "10", "--slo-itl", "0.15", "--slo-ttft", "2", "--top", "2",
                   "--json", "--price", "h200=4"], capsys)
    d = json.loads(out)
    assert d["plans"]
    y_mean = d["workload"]["native_y_mean"]
    for p in d["plans"]:
        for k in ("hardware", "gpus", "tp", "ep", "replicas", "batch_cap", "executor", "schedule", "cost_per_mtok",
                  "p95_itl_s", "p95_ttft_s"):
            assert k in p
        assert p["gpus"] == p["replicas"] * p["gpus_per_replica"] == p["replicas"] * max(p["tp"], p["ep"], p["sp"])
        assert p["cost_per_mtok"] == pytest.approx(p["gpus"] * 4.0 / (10 * y_mean * 3600) * 1e6)
        assert p["p95_itl_s"] <= 0.15 and p["p95_ttft_s"] <= 2 and p["verified"]
        b = p["band"]
        assert b["gpus"][0] <= p["gpus"] <= b["gpus"][1]
        assert b["dominant"] in b["by_input"]


def test_infeasible_names_the_binding_limit(capsys):
    rc, out = run(["simulate", "plan", *SMALL, "--rate", "10", "--slo-itl", "0.001"], capsys)
    assert rc == 1
    assert "no plan meets the SLOs" in out and "P95 ITL" in out and "floor" in out


def test_out_of_memory_says_why(capsys):
    rc, out = run(["simulate", "plan", "--model", "llada2-flash", "--hardware", "h100", "--gpus-per-replica", "1,2",
                   "--rate", "5", "--slo-itl", "0.1", "--json"], capsys)
    assert rc == 1
    d = json.loads(out)
    assert d["plans"] == [] and "memory binds" in d["binding"]
    assert d["dropped"] and all(x["reason"].startswith("OOM: weights") and "GB per GPU" in x["reason"]
                                for x in d["dropped"])
    rc, out = run(["simulate", "plan", "--model", "llada2-flash", "--hardware", "h200", "--gpus-per-replica", "2,4",
                   "--executors", "epoch", "--rate", "5", "--slo-itl", "0.3", "--requests", "40", "--top", "1"], capsys)
    assert "out of memory, for example:" in out and "h200 x2" in out and "OOM: weights" in out


@pytest.mark.parametrize("argv,fragments", [
    (["--price", "h200=abc"], ["--price", "KIND=USD"]),
    (["--price", "b200=3"], ["--price", "b200"]),
    (["--hardware", "tpu"], ["--hardware", "tpu", "h100"]),
    (["--slo-itl", "-1"], ["--slo-itl"]),
    (["--liveness-from", "/nonexistent/trace.jsonl"], ["--liveness-from", "no such file"]),
    (["--executors", "fast"], ["--executors", "dense, epoch"]),
    (["--operator-profile", "/nonexistent/profile.json", "--slo-itl", "0.2"], ["--operator-profile", "no such file"]),
    (["--trace", "/nonexistent/arrivals.txt"], ["--trace", "/nonexistent/arrivals.txt"]),
])
def test_bad_input_is_one_clear_error(tmp_path, argv, fragments):
    base = ["simulate", "plan", "--model", "llada2-mini", "--hardware", "h200", "--rate", "5"]
    if argv[0] == "--hardware":
        base = base[:4] + base[6:]
    if argv[0] == "--operator-profile":     # a profiled plan takes no --model, --hardware or --rate
        base = base[:2]
    o = run_cli(base + argv, tmp_path)
    assert check_contract(o) == "refused", o.err
    for f in fragments:
        assert f in o.err, o.err


def test_rate_or_trace_is_required(tmp_path):
    o = run_cli(["simulate", "plan", "--hardware", "h200", "--slo-itl", "0.1"], tmp_path)
    assert check_contract(o) == "refused" and "--rate" in o.err


def test_trace_arrivals_and_lengths_set_the_load(tmp_path, capsys):
    trace = tmp_path / "engine.jsonl"
    reqs = [dict(event="request", request=i, arrival_s=0.25 * i, prompt_len=200 + i, Y=96) for i in range(41)]
    trace.write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    rc, out = run(["simulate", "plan", *SMALL, "--trace", str(trace), "--slo-itl", "0.2", "--json"], capsys)
    d = json.loads(out)["workload"]
    assert d["rate"] == pytest.approx(40 / 10.0)                  # 41 arrivals over 10 s
    assert d["native_y_mean"] == pytest.approx(96) and 200 <= d["native_prompt_mean"] <= 240
    assert d["tokens"].startswith("empirical:")


def test_per_pass_matches_its_definition():
    rng = np.random.default_rng(0)
    for _ in range(30):
        C, m_c = int(rng.integers(1, 40)), int(rng.integers(1, 7))
        acc = rng.integers(-1, 12, C)
        n = int(max(1, acc.max()))
        live, fresh = per_pass(acc, m_c)
        for j in range(1, n + 1):   # docs: D_j = {0 <= accept < j}, new_j = |accept == j - 1|
            dec = sum(1 for a in acc if 0 <= a < j)
            new = sum(1 for a in acc if a == j - 1) if j > 1 else 0
            exp_fresh = C if (j == 1 or (j - 1) % m_c == 0) else C - dec + new
            assert live[j - 1] * C == pytest.approx(C - dec) and fresh[j - 1] * C == pytest.approx(exp_fresh)


def test_liveness_from_a_trace_file_and_the_bundled_one(tmp_path):
    blocks = [dict(event="block", request=i, block=0, size=4, passes=p, tokens=4, accept_pass=a, kept=[True] * 4)
              for i, (p, a) in enumerate([(3, [1, 2, 3, 3]), (2, [1, 1, 2, 2]), (4, [2, 3, 4, 1])])]
    path = tmp_path / "native.jsonl"
    path.write_text("\n".join(json.dumps(b) for b in [dict(event="run", schedule="native")] + blocks) + "\n")
    prof = trace_profile(str(path))
    assert prof.C == 4 and prof.nbar == pytest.approx(3.0)
    assert trace_profile(str(tmp_path)).nbar == pytest.approx(3.0)        # a --trace-dir folder
    oba = tmp_path / "oba.jsonl"
    oba.write_text(json.dumps(dict(event="run", schedule="oba")) + "\n")
    with pytest.raises(ValueError, match="Native run"):
        trace_profile(str(oba))
    bundled = trace_profile("code-masked")
    lp = LivenessProfile.from_profile(bundled)
    assert bundled.C == 32 and 1 < bundled.nbar < 32 and 0 < lp.live < lp.fresh <= 1


def test_simulate_pass_reads_liveness_from_a_trace(capsys):
    rc, out = run(["simulate", "pass", "--json", "--batch", "512", "--liveness-from", "code-masked"], capsys)
    trace = json.loads(out)
    rc2, out2 = run(["simulate", "pass", "--json", "--batch", "512"], capsys)
    uniform = json.loads(out2)
    assert rc == rc2 == 0
    lt = LivenessProfile.from_profile(trace_profile("code-masked"))
    assert trace["liveness"]["fresh"] == pytest.approx(lt.fresh) and uniform["liveness"]["source"] == "uniform"
    assert trace["rows"][0]["dense_s"] == pytest.approx(uniform["rows"][0]["dense_s"])   # dense reads no liveness
    assert trace["rows"][0]["epoch_s"] != pytest.approx(uniform["rows"][0]["epoch_s"])


def test_simulate_serve_draws_its_blocks_from_the_trace(capsys):
    argv = ["simulate", "serve", "--json", "--rates", "8", "--requests", "40", "--path", "dense"]
    rc, out = run(argv + ["--liveness-from", "code-masked"], capsys)
    rc2, out2 = run(argv, capsys)
    trace, uniform = json.loads(out)["curves"]["dense"][0], json.loads(out2)["curves"]["dense"][0]
    assert rc == rc2 == 0
    # the trace's blocks live ~6.9 passes instead of ~10: every commit comes sooner
    assert trace["itl"]["p50"] < uniform["itl"]["p50"]


def test_models_carry_their_published_sizes():
    for name, total, active in (("llada2-flash", 100e9, 6.1e9), ("diffusion-gemma", 26e9, 4e9)):
        c = cost.param_counts(cost.get_model(name))
        assert c["total"] == pytest.approx(total, rel=0.05) and c["active"] == pytest.approx(active, rel=0.15)


def test_operator_profile_plan_is_the_highest_rate_that_holds_its_slo(tmp_path, tiny_dirs, capsys):
    """`simulate plan --operator-profile P --liveness-from TRACE`: one replica on the machine a profile measured. The
    plan's rate, re-served by the same batched model, holds the objective; 1.5x that rate does not; the JSON carries
    the plan's keys."""
    import time

    import dblock
    from dblock.cli import main
    from dblock.simulator import plan_profiled as pp
    from dblock.simulator.profile import ProfiledCost
    from dblock.profiling.profiler import Profiler
    folder = tiny_dirs["llada2_moe"]
    prof = Profiler(dblock.load(folder), name="tiny", repeats=2, max_rows_blocks=2, max_requests=2,
                    context_blocks=2, min_sample_s=0.0, timer=time.thread_time).run(("reference",))
    prof_path = str(tmp_path / "tiny.json")
    prof.save(prof_path)
    trace = str(tmp_path / "native.jsonl")
    ids = [["--prompt-ids", ",".join(str(5 + (i * 7 + j) % 40) for j in range(3 + i % 4))] for i in range(6)]
    assert main(["generate", "--model", folder, "--max-new-tokens", "24", "--trace", trace,
                 *[a for p in ids for a in p]]) == 0
    capsys.readouterr()
    argv = ["simulate", "plan", "--operator-profile", prof_path, "--liveness-from", trace, "--executors", "dense",
            "--caps", "2,4", "--requests", "24"]
    # an objective this machine can hold: 4x the ITL of one request alone
    from dblock.simulator import batch
    from dblock.simulator.calibrate import Run
    run_ = Run.load(trace)
    by = {}
    for b in run_.blocks:
        by.setdefault(str(b["request"]), []).append(b)
    wl = batch.Workload.from_runs([r["prompt_len"] for r in run_.requests], 24,
                                  [by[str(r["request"])] for r in run_.requests], run_.block_size)
    cost_ = ProfiledCost(prof, "reference", "median", 1.0)
    alone = pp.serve(wl, cost_, 1e-3, 1, 24)["itl_p95"]
    slo = 4 * alone
    rc, out = run(argv + ["--slo-itl", f"{slo:.6f}", "--json"], capsys)
    res = json.loads(out)
    assert rc == 0 and res["plans"], res
    p = res["plans"][0]
    for k in ("hardware", "gpus", "tp", "ep", "replicas", "batch_cap", "executor", "schedule", "p95_itl_s", "rate"):
        assert k in p
    assert p["executor"] == "reference" and p["batch_cap"] in (2, 4) and p["p95_itl_s"] <= slo
    y_mean = float(np.mean([r.Y for r in wl.requests]))
    again = pp.serve(wl, cost_, p["rate"], p["batch_cap"], 24)
    assert pp._meets(again, p["rate"], y_mean, slo, None)
    assert not pp._meets(pp.serve(wl, cost_, 1.5 * p["rate"], p["batch_cap"], 24), 1.5 * p["rate"], y_mean, slo,
                         None)
    # --rate-margin m: the same SLO edge, the plan at edge / (1 + m), its figures simulated there
    rc, out = run(argv + ["--slo-itl", f"{slo:.6f}", "--json", "--rate-margin", "0.25"], capsys)
    m = json.loads(out)["plans"][0]
    assert rc == 0 and m["slo_edge_rate"] == pytest.approx(p["rate"]) and p["rate_margin"] == 0
    assert m["rate"] == pytest.approx(p["rate"] / 1.25) and m["rate_margin"] == 0.25
    at = pp.serve(wl, cost_, m["rate"], m["batch_cap"], 24)
    assert m["p95_itl_s"] == pytest.approx(at["itl_p95"]) and m["p95_itl_s"] <= slo
    with pytest.raises(ValueError, match="--slo-itl or --slo-ttft"):
        run(argv, capsys)
