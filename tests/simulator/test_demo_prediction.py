"""The demo's prediction beside its measurement (dblock/demo.py): never null, its inputs named, and a verdict that
follows the measured noise band — the sign of measured − 1 whenever the band is on one side of 1."""
from types import SimpleNamespace

import pytest

from dblock import demo


def run(Y, K, F, den_s, den_base_s=None, calls=(4, 4, 2)):
    return dict(Y=Y, K=K, F=F, Q=F + K, R=4, den_s=den_s, den_base_s=den_base_s, requests_per_call=list(calls),
                den_calls=len(calls))


def row(schedule, runs, band_of):
    from dblock.profiling import measure
    base = runs[0]
    ratios = measure.paired_ratios([dict(r, TPS=r["Y"] / r["den_s"]) for r in runs],
                                   [dict(b, TPS=b["Y"] / b["den_s"]) for b in band_of])
    mid, lo, hi = measure.noise_band(ratios)
    return dict(model="m", family="diffusion_gemma", executor="reference", schedule=schedule, sim_schedule=schedule,
                R=4, Y=base["Y"], K=base["K"], F=base["F"], den_s=base["den_s"], den_base_s=base["den_base_s"],
                measured_tps_ratio=mid, measured_band=[lo, hi], _runs=runs)


@pytest.mark.parametrize("slow", [0.7, 1.0, 1.6])
def test_prediction_is_never_null_and_the_verdict_follows_the_band(slow):
    nat = [run(100, 10, 60, 1.0 + 0.01 * i) for i in range(3)]
    # OBA on a uniform-state model: fewer passes, a wider pass timed beside on the same rows
    oba = [run(100, 10, 45, slow * (0.9 + 0.01 * i), den_base_s=slow * (0.9 + 0.01 * i) / 1.3, calls=(4, 2))
           for i in range(3)]
    rows = [row("native", nat, nat), row("oba", oba, nat)]
    model = SimpleNamespace(config=SimpleNamespace(family="diffusion_gemma", block_size=16))
    demo._predict("m", model, rows, None, True)
    base, x = rows
    assert base["verdict"] == "baseline" and base["predicted_tps_ratio"] == 1.0
    assert x["predicted_tps_ratio"] is not None and "δ" in x["prediction_note"]
    assert x["prediction_inputs"]["alpha"]["source"].startswith("measured")
    assert x["prediction_inputs"]["r"]["source"].startswith("measured")
    # with every input measured the identity reproduces the measurement
    assert x["predicted_tps_ratio"] == pytest.approx(x["measured_tps_ratio"], rel=1e-9)
    lo, hi = x["measured_band"]
    if x["verdict"] != "within noise":
        assert (x["verdict"] == "pays") == (x["measured_tps_ratio"] > 1) and not lo <= 1 <= hi
    else:
        assert lo <= 1 <= hi
    assert x["prediction_agrees"]
    # beside this CPU's verdict, the paper's GB300 setting with the α measured here (r from the simulator)
    from dblock.simulator import oba as oba_model, papers
    g = x["gb300"]
    assert g["alpha"] == x["prediction_inputs"]["alpha"]["value"] and g["r"] > 1 and g["r_roofline"] > 1
    assert g["pays"] == (g["alpha"] > g["r"] - 1) and g["tps_ratio"] == pytest.approx(oba_model.tps_ratio(
        g["alpha"], g["r"]))
    assert papers.oba_gb300_verdict(g["r"] - 1 + 0.01)["pays"] and not papers.oba_gb300_verdict(g["r"] - 1.01)["pays"]


def test_the_demo_remeasures_a_profile_of_other_executor_code(tmp_path, monkeypatch):
    """A cached profile prices the code it was measured on: the demo keeps it when the executors' source is the
    same (the code fingerprint in its meta) and measures a new one when it is not."""
    import numpy as np

    from dblock.profiling import profiler
    from dblock.simulator.fingerprint import code_fingerprint
    from dblock.simulator.profile import OpTable, Profile
    path = str(tmp_path / "p.json")
    t = OpTable.from_samples("epoch_moe", ["rows"], [[1, 2]], np.ones((2, 1)), [True])
    Profile(dict(anchor={"x": 1.0}, code=code_fingerprint()), {"epoch_moe": t}).save(path)
    measured = []

    class Stub:
        def __init__(self, *a, **k):
            pass

        def run(self, *a):
            measured.append(1)
            return Profile(dict(anchor={"x": 1.0}, code=code_fingerprint()), {"epoch_moe": t})
    monkeypatch.setattr(profiler, "Profiler", Stub)
    assert demo._profile_for("m", None, path, True).meta["code"] == code_fingerprint() and not measured
    Profile(dict(anchor={"x": 1.0}, code="0" * 16), {"epoch_moe": t}).save(path)
    demo._profile_for("m", None, path, True)
    assert measured == [1] and Profile.load(path).meta["code"] == code_fingerprint()


def test_the_demos_quick_profile_has_its_own_file_and_the_demos_batch(tmp_path, monkeypatch):
    """Without a full profile the demo measures a quick one up to its own batch and keeps it in NAME-demo-*.json,
    where `simulate validate` (which reads the default file) never finds it; a full profile is preferred."""
    import numpy as np

    from dblock.simulator import profile as profile_mod
    from dblock.profiling import profiler
    from dblock.simulator.fingerprint import code_fingerprint
    from dblock.simulator.profile import OpTable, Profile
    monkeypatch.setattr(profile_mod, "PROFILE_DIR", str(tmp_path))
    t = OpTable.from_samples("epoch_moe", ["rows"], [[1, 2]], np.ones((2, 1)), [True])
    seen = []

    class Stub:
        def __init__(self, *a, **k):
            seen.append(k)

        def run(self, *a):
            return Profile(dict(anchor={"x": 1.0}, code=code_fingerprint()), {"epoch_moe": t})
    monkeypatch.setattr(profiler, "Profiler", Stub)
    demo._profile_for("m", None, None, True, max_requests=16)
    assert seen[-1]["max_requests"] == 16
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("m-demo-")
    demo._profile_for("m", None, None, True, max_requests=16)
    assert len(seen) == 1                                     # the demo's own quick profile is reused
    full = profile_mod.default_path("m", profiler.machine_tag())
    Profile(dict(anchor={"x": 2.0}, code=code_fingerprint()), {"epoch_moe": t}).save(full)
    assert demo._profile_for("m", None, None, True).meta["anchor"] == {"x": 2.0} and len(seen) == 1


def test_the_oba_row_prints_the_gb300_verdict_beside_this_cpus(capsys):
    nat = [run(100, 10, 60, 1.0 + 0.01 * i) for i in range(3)]
    oba = [run(100, 10, 45, 0.9 + 0.01 * i, den_base_s=(0.9 + 0.01 * i) / 1.3, calls=(4, 2)) for i in range(3)]
    rows = [row("native", nat, nat), row("oba", oba, nat)]
    demo._predict("m", SimpleNamespace(config=SimpleNamespace(family="diffusion_gemma", block_size=16)), rows, None,
                  True)
    for x in rows:
        x.update(accuracy=0.5, identical=1.0, TPF=1.0, TPS=10.0, passes_per_block=4.0)
    rows[1]["token_accuracy"] = 0.25                  # a code row's second quality metric; '-' where the task has none
    demo._print(rows, ["tiny-uniform"], 3, 1.0)
    out = capsys.readouterr().out
    table = {s.split()[2]: s.split() for s in out.splitlines() if s.startswith("m ")}
    assert table["oba"][5] == "0.250" and table["native"][5] == "-"
    g = rows[1]["gb300"]
    line = next(s for s in out.splitlines() if "GB300" in s)
    assert f"{g['r']:.2f}" in line and f"{g['tps_ratio']:.2f}" in line and f"on this CPU: {rows[1]['verdict']}" in line
    assert ("does not pay" in line.split("->")[1].split(",")[1]) != g["pays"]


def test_every_demo_group_has_its_own_baseline_and_a_batch_1_row_says_so():
    """Each (model, batch) group of the demo's plan is compared against its own reference Native row; a row at
    batch 1 decodes its requests one at a time (the regime One Block Ahead is for)."""
    groups = {}
    for name, executor, econf, schedule, extra, bs in demo.PLAN:
        groups.setdefault((name, bs), []).append((executor, schedule, extra))
    for g, rs in groups.items():
        assert ("reference", "native", {}) in rs, g
    for name, *_, bs in demo.PLAN:                  # a group decodes its own number of problems; --n sets them all
        assert demo._problems(name, bs, None) >= 1 and demo._problems(name, bs, 3) == 3
    assert demo._problems("m", 1, None) == 16
    x = dict(R=16, batch=1)
    assert demo._regime(x) == "one request at a time (batch 1)"
    assert demo._regime(dict(R=16, batch=16)) == "all 16 requests in one batch"
    assert demo._regime(dict(R=16, batch=4)) == "16 requests at most 4 at a time"


def test_a_batch_16_oba_row_that_does_not_pay_says_why_from_its_own_numbers():
    def r(batch, verdict, rb):
        return dict(model="m", family="diffusion_gemma", schedule="oba", batch=batch, R=16, verdict=verdict,
                    prediction_inputs={"alpha": {"value": 0.4}, "r": {"value": rb}, "beta": {"value": 1.0}})
    one, big = r(1, "pays", 1.1), r(16, "does not pay", 1.8)
    why = demo._why_not(big, [one, big])
    assert "batch 16" in why and "r·β = 1.80" in why and "1 + α = 1.40" in why and "r·β = 1.10" in why
    assert demo._why_not(one, [one, big]) is None
    assert demo._why_not(dict(big, verdict="within noise"), [big]) is None
