"""benchmarks/gpu.py: its CPU part (every check at tiny shapes through the interpreter) runs here; the bf16 GPU run is
marked `gpu` and runs the script in a fresh process (compiled kernels) where a CUDA device exists."""
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_check_passes_every_row(capsys):
    assert main(["--cpu-check"]) == 0
    out = capsys.readouterr().out
    for op in ("route", "align", "grouped_mlp", "compact", "merge", "attention native", "attention oba", "lm_head",
               "MoE layer", "denoise pass"):
        assert f"| {op}" in out, op
    assert "| NO |" not in out and "ERROR" not in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_benchmark_runs_and_checks_pass():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # compiled kernels in the child
    res = subprocess.run([sys.executable, "benchmarks/gpu.py", "--skip", "executor"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
