"""`simulate validate` end to end with synthetic executors whose cost is a known function of the call's shape (a
fake clock that only the executor calls advance): the measurement then equals that function, the prediction prices
the same function, and every reference row must come out with ≈ 0 error. No timing is asserted."""
import pytest

from dblock.profiling import measure, validate
from dblock.simulator.profile import ProfiledCost
from tests.simulator.test_profile import synthetic_profile


@pytest.fixture(scope="module")
def report():
    import dblock
    from dblock.decoding.generate import reference_forward
    from dblock.optimized.executor import epoch_forward
    m = dblock.load("tiny-masked")
    prof = synthetic_profile()
    clock = measure.FakeClock()

    def forward(ex):
        real = reference_forward(m) if ex == "reference" else epoch_forward(m, "epoch")
        return measure.SyntheticForward(real, ProfiledCost(prof, ex).call, clock)
    plan = validate.Plan(n=6, repeats=1, batches=(1, 3), ratio_batch=3, rates=(20.0, 200.0), serve_requests=10,
                         batch_cap=4, epoch=True)
    return validate.run(plan, prof, model=m, forward=forward, timer=clock)


def test_reference_rows_are_exact_with_a_known_cost(report):
    rows = [r for r in report.rows if not r.name.startswith("epoch")]
    assert len(report.rows) >= 12
    for r in rows:
        assert r.error == pytest.approx(0.0, abs=1e-9), (r.name, r.quantity, r.predicted, r.measured)
    assert {r.quantity for r in report.rows} >= {"T_den", "TPS ratio", "throughput", "P95 ITL"}


def test_epoch_rows_follow_the_fresh_rows(report):
    # the Epoch executor's own fresh rows (plans, fallbacks) against the model's liveness replay: close, not exact
    for r in report.rows:
        if r.name.startswith("epoch"):
            assert abs(r.error) < 0.1, (r.name, r.error)


def test_report_shapes(report):
    d = report.as_dict()
    assert d["median_abs_error"] < 0.05 and len(d["rows"]) == len(report.rows)
    assert "counters of one Native" in d["meta"]["inputs"]
    text = report.table()
    assert "median |error|" in text and "T_den" in text


def test_noise_band_and_verdict():
    # the demo's verdict: one side of 1 only when the whole band is
    assert measure.verdict(*measure.noise_band([1.10, 1.12, 1.08])[1:]) == "pays"
    assert measure.verdict(*measure.noise_band([0.8, 0.85, 0.9])[1:]) == "does not pay"
    assert measure.verdict(*measure.noise_band([0.97, 1.04, 1.01])[1:]) == "within noise"
    for ratios in ([1.02, 1.5, 1.3], [0.5, 0.99, 0.7], [0.995, 1.0, 1.004], [1.2], [0.9]):
        med, lo, hi = measure.noise_band(ratios)
        v = measure.verdict(lo, hi)
        assert lo <= med <= hi
        if v != "within noise":                       # outside the band the verdict is the sign of measured − 1
            assert (v == "pays") == (med > 1)


def test_repeated_interleaves_and_advances_the_progress_bar():
    """`measure.repeated` (the demo's and validate's loop): job order interleaved per round, one bar step per run."""
    order = []

    class Bar:
        n = 0

        def update(self, k):
            self.n += k

    bar = Bar()
    out = measure.repeated({"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 2}, 3,
                           progress=bar)
    assert order == ["a", "b"] * 3 and out == {"a": [1, 1, 1], "b": [2, 2, 2]} and bar.n == 6


def test_alpha_rows_predict_each_schedule_from_the_other():
    """The α rows on a uniform-state model: OBA and FlowBlock each predicted with δ calibrated on the other,
    against the α fitted on the held-out run's own counters; absolute errors, kept out of the median."""
    import dblock
    m = dblock.load("tiny-uniform")
    plan = validate.Plan(alpha_model="tiny-uniform", alpha_n=12, alpha_batch=6, max_new_tokens=32)
    rows = validate.alpha_rows(plan, model=m)
    assert [r.name.split()[1] for r in rows] == ["flowblock", "oba"]
    for r, src in zip(rows, ("oba", "flowblock")):
        assert r.quantity == "α" and r.absolute
        if r.predicted == r.predicted:                  # predicted: δ came from the other schedule
            assert f"from {src}" in r.note and r.error == pytest.approx(r.predicted - r.measured)
        else:                                           # a δ the other schedule's α cannot give (e.g. α < 0 on a
            assert r.note.startswith(f"δ not calibrated on {src}")     # small sample) is said, not guessed

    rel = validate.Row("x", "T_den", "ms", 1.1, 1.0, 1.2, 1.0)
    rep = validate.Report([rel, *rows])
    assert rep.median_abs_error == pytest.approx(0.1)
    finite = [abs(r.error) for r in rows if r.error == r.error]
    if finite:
        assert rep.max_alpha_error == max(finite)
    else:
        assert rep.max_alpha_error != rep.max_alpha_error      # nan: no α was predicted
    assert rep.as_dict()["rows"][1]["error_kind"] == "absolute"


def test_table_marks_rows_it_did_not_predict():
    """An α row whose δ could not be calibrated reads '-' (not 'nan'), and the summary says how many α rows were
    predicted instead of printing a NaN maximum."""
    nan = float("nan")
    rel = validate.Row("reference native, batch 1", "T_den", "ms", 0.004, 0.0038, 0.0042, 0.005)
    none = validate.Row("m oba α, batch 16", "α", "", nan, nan, nan, -0.1, note="δ not calibrated", absolute=True)
    some = validate.Row("m flowblock α, batch 16", "α", "", 0.05, 0.03, 0.06, 0.01, note="δ 0.2", absolute=True)
    text = validate.Report([rel, none]).table()
    assert "nan" not in text and "none of the 1 predicted" in text
    line = next(x for x in text.splitlines() if x.startswith("m oba"))
    assert line[40:].split()[1:3] == ["-", "-"]     # after the name and quantity: predicted, interval
    text = validate.Report([rel, none, some]).table()
    assert "largest |error| 0.040 over 1 of 2 rows" in text and "nan" not in text
