"""benchmarks/margin_gate.py on a bundled model of its card task: the error and radius distributions and the gate's
re-run shares are printed (any task, the arithmetic ones included); a bad model is one error. No timing."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "margin_gate.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_margin_gate_on_an_arith_model():
    res = _run("--model", "tiny-masked", "--task", "arith-long", "--n", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert out.startswith("tiny-masked, arith-long n=2, epoch:")
    assert re.search(r"block radius min Γ\* p10/p50/p90: [\d.e+-]+ / [\d.e+-]+ / [\d.e+-]+", out)
    shares = [float(x) for x in re.findall(r"re-runs +([\d.]+)% of the approximate", out)]
    assert len(shares) >= 3 and shares == sorted(shares)       # a larger bound re-runs at least as much


def test_a_missing_model_is_one_error(tmp_path):
    res = _run("--model", str(tmp_path / "none"), "--task", "arith-long", "--n", "2")
    assert res.returncode != 0 and "no such model folder" in res.stderr and "Traceback" not in res.stderr
