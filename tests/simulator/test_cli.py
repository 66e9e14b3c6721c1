"""`dblock simulate ...` through its own parser (the lead wires add_parser into dblock/cli.py)."""
import argparse
import json

import pytest

from dblock.cli import simulator as cli


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="dblock")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    rc = cli.main(args)
    return rc, capsys.readouterr().out


def test_every_flag_has_help():
    parser = argparse.ArgumentParser(prog="dblock")
    sub = parser.add_subparsers(dest="command")
    sim = cli.add_parser(sub)
    subs = next(a for a in sim._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in subs.choices.items():
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"simulate {name} {action.option_strings} has no help"


def test_oba_paper_json(capsys):
    rc, out = run(["simulate", "oba", "--paper", "--json"], capsys)
    assert rc == 0
    rows = json.loads(out)["rows"]
    assert all(r["verdict_agrees"] for r in rows)
    oba_row = next(r for r in rows if r["schedule"].startswith("OBA"))
    assert round(oba_row["predicted_tps_ratio"], 2) == 1.22


def test_oba_plot_and_text(tmp_path, capsys):
    png = tmp_path / "rec.png"
    rc, out = run(["simulate", "oba", "--nbar", "12", "--alpha", "0.5", "--plot", str(png)], capsys)
    assert rc == 0 and png.stat().st_size > 0
    assert "n* = n̄/(1+α) = 8.000" in out


def test_alpha_from_counters_with_eq4(capsys):
    # counters built from Eq. (6) at α = 0.3 (K from Eq. 4 with Y = 9.5 blocks' worth per response)
    from dblock.simulator import oba
    R, C, nbar = 100, 256, 10.0
    Y = R * 9.5 * C
    K = oba.blocks_from_tokens(Y, C, R)
    F = oba.expected_passes(nbar, 0.3, K, R)
    rc, out = run(["simulate", "alpha", "--F", str(F), "--Y", str(Y), "--R", str(R), "--nbar", str(nbar), "--json"],
                  capsys)
    assert json.loads(out)["alpha"] == pytest.approx(0.3, abs=1e-6)


def test_pass_command(capsys):
    rc, out = run(["simulate", "pass", "--batch", "1,64", "--calibration", "none", "--json"], capsys)
    data = json.loads(out)
    assert [r["batch"] for r in data["rows"]] == [1, 64]
    assert set(data["r_batch1"]) == {"oba", "dense_mask", "native2c"}


def test_serve_command_small(capsys):
    rc, out = run(["simulate", "serve", "--rates", "2", "--requests", "20", "--path", "epoch", "--json"], capsys)
    curves = json.loads(out)["curves"]
    assert list(curves) == ["epoch"] and curves["epoch"][0]["p95_itl"] > 0


def test_errors_are_value_errors(capsys):
    with pytest.raises(ValueError, match="--calibration 'fast'"):
        run(["simulate", "pass", "--calibration", "fast"], capsys)
    with pytest.raises(ValueError, match="give trace files"):
        run(["simulate", "calibrate"], capsys)
    with pytest.raises(ValueError, match="--F"):
        run(["simulate", "alpha", "--nbar", "3"], capsys)
    with pytest.raises(ValueError, match="hardware 'tpu'"):
        run(["simulate", "pass", "--hardware", "tpu"], capsys)
    with pytest.raises(ValueError, match="--slo=-1"):
        run(["simulate", "search", "--slo", "-1"], capsys)
    with pytest.raises(ValueError, match="--alpha -0.3 with --simulate 5"):     # the position model needs δ >= 0
        run(["simulate", "oba", "--alpha=-0.3", "--simulate", "5"], capsys)


def test_predict_command_with_a_profile(tmp_path, capsys):
    from tests.simulator.test_profile import synthetic_profile
    path = str(tmp_path / "p.json")
    synthetic_profile(spread=0.1).save(path)
    rc, out = run(["simulate", "predict", "--profile", path, "--requests", "8", "--batch-size", "4", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and [(r["executor"], r["schedule"]) for r in data["rows"]] == [
        ("reference", "native"), ("reference", "oba"), ("epoch", "native"), ("epoch", "oba")]
    nat, oba = data["rows"][:2]
    assert nat["tps_ratio"]["value"] == pytest.approx(1.0) and oba["alpha"] == pytest.approx(0.0, abs=1e-9)
    lo, hi = oba["TPS"]["interval"]
    assert lo <= oba["TPS"]["value"] <= hi and oba["parts"]["beta"] == pytest.approx(1.0)
    rc, out = run(["simulate", "predict", "--profile", path, "--requests", "8", "--rate", "50", "--schedules",
                   "native", "--executors", "reference"], capsys)
    assert "P95 ITL" in out and "serving at 50 req/s" in out


def test_profile_and_validate_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="--profile"):
        run(["simulate", "validate", "--profile", str(tmp_path / "missing.json")], capsys)
    with pytest.raises(ValueError, match="no such file"):
        run(["simulate", "predict", "--profile", str(tmp_path / "missing.json")], capsys)
    # the α rows need a uniform-state model; refused before anything is measured or written
    with pytest.raises(ValueError, match="--alpha-model tiny-masked: a llada2_moe model"):
        run(["simulate", "validate", "--alpha-model", "tiny-masked"], capsys)
    with pytest.raises(ValueError, match="--alpha-only with --no-alpha"):
        run(["simulate", "validate", "--alpha-only", "--no-alpha"], capsys)
    with pytest.raises(ValueError, match="--executors"):
        run(["simulate", "profile", "--model", "tiny-masked", "--executors", "epoch", "--out",
             str(tmp_path / "x.json")], capsys)


def test_validate_alpha_only_prints_the_two_alpha_rows(capsys):
    """`simulate validate --alpha-only`: the α rows alone (no profile, no timing rows), OBA and FlowBlock held out."""
    rc, out = run(["simulate", "validate", "--alpha-only", "--alpha-model", "tiny-uniform", "--alpha-n", "8",
                   "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and [r["name"].split()[1] for r in d["rows"]] == ["flowblock", "oba"]
    assert all(r["quantity"] == "α" for r in d["rows"]) and d["meta"]["alpha_n"] == 8


def test_progress_bars_only_on_a_terminal_or_when_asked(monkeypatch):
    """A captured stderr (not a terminal) gets no progress bars, so a failing command leaves one error line there;
    DBLOCK_PROGRESS=1 / 0 forces them on / off; --json never draws them."""
    import io
    import sys
    from types import SimpleNamespace

    from dblock.cli_args import show_progress

    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.delenv("DBLOCK_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not show_progress(SimpleNamespace(json=False))
    monkeypatch.setattr(sys, "stderr", Tty())
    assert show_progress(SimpleNamespace(json=False)) and not show_progress(SimpleNamespace(json=True))
    monkeypatch.setenv("DBLOCK_PROGRESS", "0")
    assert not show_progress(SimpleNamespace(json=False))
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setenv("DBLOCK_PROGRESS", "1")
    assert show_progress(SimpleNamespace(json=False))
