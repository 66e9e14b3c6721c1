"""benchmarks/epoch_cpu.py: bad output paths and cells are refused before any decoding (a full run takes 40 minutes),
and a smoke run writes its JSON rows and the BENCHMARKS section. No timing is asserted."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "epoch_cpu.py")


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_bad_output_paths_and_cells_are_refused_up_front(tmp_path):
    for args, needle in ((["--json", str(tmp_path / "no" / "x.json")], "does not exist"),
                         (["--write-benchmarks", str(tmp_path)], "is a folder"),
                         (["--cells", "foo:fixed-k:32"], "model in mini-scaled, tiny-masked"),
                         (["--cells", "mini-scaled:greedy:32"], "rule threshold or fixed-k"),
                         (["--repeats", "0"], "must be >= 1"),
                         (["--cells", "mini-scaled:threshold:4,exec-masked:threshold:32", "--exec-masked",
                           str(tmp_path / "none")], "the exec-masked cells: model")):
        res = _run(*args, timeout=60)
        assert res.returncode != 0 and needle in res.stderr, (args, res.stderr)
        assert "## mini-scaled" not in res.stdout          # nothing ran
    assert os.listdir(tmp_path) == []


def test_smoke_run_writes_rows_and_section(tmp_path):
    out, md = tmp_path / "rows.json", tmp_path / "B.md"
    md.write_text("# Benchmarks\n\n## Other section\n\nkept\n")
    res = _run("--cells", "tiny-masked:threshold:4", "--repeats", "1", "--calibration-repeats", "1",
               "--max-new-tokens", "16", "--json", str(out), "--write-benchmarks", str(md))
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads(out.read_text())
    rows = meta["rows"]
    assert meta["allocator"] == "steady" and "malloc held steady" in meta["machine"]
    assert {r["config"] for r in rows} == {"dense", "full_compute", "epoch", "no_atlas", "no_lsp"}
    for r in rows:
        assert {"model", "rule", "batch", "config", "TPS", "moe_share", "fresh_frac", "sys_ms_per_pass",
                "minflt_per_pass"} <= set(r)
        if r["config"] == "epoch":
            assert {"bound", "fraction_of_bound"} <= set(r)
    text = md.read_text()
    assert "## Other section\n\nkept" in text and "## Epoch executor vs the dense reference on CPU" in text
    assert "System time and minor page faults per pass" in text
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []     # no temporary file left
