"""Kernel tests run on CPU tensors through the Triton interpreter, in fp32 (the interpreter is wrong for bf16).

TRITON_INTERPRET=1 is set for the whole test process in tests/conftest.py, before triton can be imported (see
dblock/kernels/__init__.py). The compiled bf16 checks run in a subprocess without it (`test_gpu_bench.py`,
`benchmarks/gpu.py`).
"""
try:
    import dblock.kernels as K
    # Not runnable here: no triton, or TRITON_INTERPRET was overridden for this process. A mode mismatch
    # (K.MODE_ERROR) is not skipped: the tests fail with its message.
    collect_ignore_glob = [] if (K.HAVE_TRITON and K.INTERPRET) else ["test_*.py"]
except ImportError:
    collect_ignore_glob = ["test_*.py"]
