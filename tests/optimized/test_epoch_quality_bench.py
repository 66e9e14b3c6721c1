"""benchmarks/epoch_quality.py (the quality-latency figure): bad configurations and paths are refused before any
decoding; a smoke run on tiny-masked writes the rows, the PNG and the BENCHMARKS section, and LSP's age bound M_C of
`epoch#M` takes effect (M_C = 1 refreshes every row on every pass). No timing is asserted."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "epoch_quality.py")


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_bad_configs_and_paths_are_refused_up_front(tmp_path):
    for args, needle in ((["--configs", "dense,epoch#0"], "--configs 'epoch#0'"),
                         (["--configs", "dense,full_compute#3"], "--configs 'full_compute#3'"),
                         (["--configs", "epoch"], "dense must be among them"),
                         (["--png", str(tmp_path / "no" / "f.png")], "does not exist"),
                         (["--batch", "0"], "must be >= 1")):
        res = _run(*args, "--model", "tiny-masked", timeout=60)
        assert res.returncode != 0 and needle in res.stderr, (args, res.stderr)
    res = _run("--model", str(tmp_path / "nothing"), timeout=60)
    assert res.returncode != 0 and "--model" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert os.listdir(tmp_path) == []


def test_smoke_run_writes_rows_figure_and_section(tmp_path):
    out, md, png = tmp_path / "rows.json", tmp_path / "B.md", tmp_path / "fig.png"
    md.write_text("# Benchmarks\n\n## Other section\n\nkept\n")
    res = _run("--model", "tiny-masked", "--batch", "4", "--repeats", "1", "--calibration-repeats", "1", "--configs", "dense,epoch#1,epoch,no_lsp",
               "--json", str(out), "--png", str(png), "--write-benchmarks", str(md))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "epoch#1", "epoch", "no_lsp"}
    assert rows["epoch#1"]["label"] == "epoch M_C=1" and rows["epoch"]["label"] == "epoch M_C=5"
    assert rows["epoch#1"]["fresh_frac"] == 1.0 > rows["epoch"]["fresh_frac"]      # M_C = 1: nothing served cached
    for r in rows.values():
        lo, hi = r["accuracy_ci"]
        assert lo <= r["accuracy"] <= hi and 0 <= r["identical"] <= 1 and r["passes"] > 0
    assert rows["dense"]["identical"] == 1.0 and rows["dense"]["accuracy_delta_ci"] == [0.0, 0.0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "## Other section\n\nkept" in text and "## Epoch's quality-latency figure on `tiny-masked`" in text
    assert "(fig.png)" in text and "| epoch M_C=1 |" in text
    assert [p for p in os.listdir(tmp_path) if p.startswith(".") or p.endswith(".tmp.png")] == []
