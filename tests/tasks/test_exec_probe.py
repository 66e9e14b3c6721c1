"""benchmarks/exec_probe.py --inspect: the per-line, per-variable cloze and the rule test (does a model apply the
program's rule or extrapolate the lines before?) on a train-tiny run's checkpoint; a run of another task is refused
in one line. No timing."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = os.path.join(ROOT, "benchmarks", "exec_probe.py")


def _train(out, task):
    from dblock.tasks.train import train
    from dblock.tasks.train_config import TrainConfig
    train(TrainConfig(family="llada2_moe", out=str(out), size="code-micro", task=task, steps=2, batch_size=2,
                      block_size=32, warmup=1, progress=False), log=lambda *a: None)


def _probe(*args):
    return subprocess.run([sys.executable, PROBE, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_inspect_reports_cloze_by_variable_and_the_rule_test(tmp_path):
    _train(tmp_path / "run", "exec:grammar=acc,vars=2")
    res = _probe("--inspect", str(tmp_path / "run"), "--eval-n", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["task"] == "exec:grammar=acc,vars=2" and out["step"] == 2
    assert {"line0", "line0a", "line0b", "line1a", "line1b", "all"} <= set(out["cloze"])
    rt = out["rule_test"]
    assert {"intact", "history_scrambled", "k_changed"} <= set(rt) and rt["programs"] == 3 and rt["line"] == 5
    assert all(0.0 <= rt[k] <= 1.0 for k in ("intact", "history_scrambled", "k_changed"))


def test_inspect_refuses_a_run_of_another_task(tmp_path):
    _train(tmp_path / "run", "arith")
    res = _probe("--inspect", str(tmp_path / "run"))
    assert res.returncode != 0 and "not exec" in res.stderr and "Traceback" not in res.stderr
