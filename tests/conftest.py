"""Shared test fixtures and the one tolerance table (docs/architecture.md, "Conventions")."""
import os

# Triton runs in interpreter mode in the test process (CPU tensors, fp32; see dblock/kernels/__init__.py). Triton fixes
# the mode when it is imported (torch may import it on its own when a model is built), so the variable is set here,
# before anything else is imported. Children inherit it; the compiled GPU checks start theirs without it
# (tests/kernels/test_gpu_bench.py, benchmarks/gpu.py).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis: reproducible in CI, small budgets (the combinatorial parts are covered by many small cases).
settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None)
settings.load_profile("ci")

# One tolerance table. References run in fp64 where exactness is claimed.
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),   # fp64 references
    torch.float32: dict(atol=1e-5, rtol=1e-5),     # fp32 paths (CPU, Triton interpreter)
    torch.bfloat16: dict(atol=2e-2, rtol=0.0),     # bf16 on GPU (vLLM's MoE tolerance)
    torch.float16: dict(atol=1e-2, rtol=0.0),      # fp16 attention
}


def tol(dtype):
    return TOL[dtype]


def logits_tol(dtype, ref):
    """Tolerance for logits: the table's, with atol scaled by the logits' magnitude (shape effects in fp32 move
    large logits by a few ulps of their own size)."""
    t = dict(TOL[dtype])
    t["atol"] = t["atol"] * max(1.0, float(ref.abs().max()))
    return t


def pytest_configure(config):
    # One intra-op thread: the tests are many small ops, and on a busy 2-core machine a second thread makes ops
    # such as index_add_ orders of magnitude slower (spin-waiting on a core someone else holds).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Random tiny checkpoints of the LLaDA families, written once per session through the real save path."""
    from dblock.tiny import make_tiny
    root = tmp_path_factory.mktemp("tiny")
    return {fam: make_tiny(fam, str(root / fam), seed=0) for fam in ("llada2_moe", "llada_moe")}
