"""Kernel tests run on CPU tensors through the Triton interpreter, in fp32 (the interpreter is wrong for bf16).

TRITON_INTERPRET must be set before any `@triton.jit` decoration (see dblock/kernels/__init__.py), so it is set
here, at collection, before the kernel modules are imported. On a CUDA machine this puts the whole pytest process
in interpreter mode for Triton (children inherit the variable); the compiled bf16 checks run in a subprocess
without it (`test_gpu_bench.py`, `benchmarks/gpu.py`).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

try:
    import dblock.kernels as K
    # Not runnable here: no triton, or dblock.kernels was imported compiled earlier in this process (CUDA machine).
    collect_ignore_glob = [] if (K.HAVE_TRITON and K.INTERPRET) else ["test_*.py"]
except ImportError:
    collect_ignore_glob = ["test_*.py"]
