"""Triton kernels of the optimized executor: one op per file, each with a `@triton.jit` kernel, a `*_triton`
launcher that asserts dtype, contiguity and strides, and a `*_torch` golden model.

    route.py        support-restricted group-limited top-K routing of the fresh rows
    compact.py      compact fresh rows; scatter them back and merge cached stable rows
    align.py        (row, slot) pairs sorted by expert, padded to BLOCK_M (vLLM moe_align_block_size layout)
    grouped_mlp.py  grouped SwiGLU expert MLP: gather in the load, routing weight, scatter in the store
    attention.py    attention over [prefix cache ; in-flight blocks] on a per-request tile schedule
    lm_head.py      final RMSNorm + LM head of the live rows only (gathered in the load)
    stack.py        `TritonStages`: the executor's stage seam (route, experts, attend, lm_head, compact, scatter)

Interpreter or compiler: importing this package changes nothing in the process (no environment variable, no
module reload). Triton decides interpreter vs compiler when `@triton.jit` decorates a function (triton 3.9:
`knobs.runtime.interpret`, read from the environment variable TRITON_INTERPRET at that moment), and triton.language
decorates its own standard library (tl.max, tl.sum, tl.cumsum, ...) when triton is first imported, which torch may do
on its own (e.g. `torch._dynamo` -> `torch._inductor` when a model is built under a device context, as `dblock.load`
does). So the mode is the caller's choice, made once, before triton is imported:

  * on a machine without CUDA the kernels run only through the interpreter (numpy, slow, for checking): set
    TRITON_INTERPRET=1 before starting Python (`TRITON_INTERPRET=1 python ...`). The `dblock` command does it for
    `--use-triton` when no CUDA device is visible and the variable is unset (`dblock.model_flags.prepare_triton`);
    the tests set it in tests/conftest.py.
  * with CUDA the kernels are compiled unless TRITON_INTERPRET=1 was set.

`INTERPRET` is the mode the kernel modules were decorated in. A process that set the variable after triton was
imported has the kernels and triton.language's standard library in different modes; `check_runnable` refuses to
launch then (`MODE_ERROR` says why) instead of failing inside a kernel.

Interpreter traps (triton 3.9):
  * bf16 arithmetic, `tl.sum` and `tl.dot` on bf16 are wrong (triton-lang/triton#11584) and the fp32->bf16 cast at
    store truncates instead of rounding. Every kernel loads, upcasts to fp32 where it computes (`F32` constexpr:
    always under the interpreter and for fp32 inputs, with IEEE dots), and casts only at the store. On a GPU 16-bit
    operands go to `tl.dot` as they are (products of bf16 numbers are exact in fp32, accumulation is fp32).
  * triton.language's own @jit functions are fixed at triton's import: TRITON_INTERPRET must be set before triton
    is imported, not just before this package (see `MODE_ERROR`).
  * a scalar built from a loop variable (`t >= n`) is rejected as a load mask ("mask has unsupported dtype"):
    broadcast it to a vector first.
  * the interpreter pays per operation (~0.1-0.3 ms each), not per element, and re-patches triton.language on
    every call of a nested @jit function: kernels inline their helpers, and launchers pick larger tiles and exact
    grids (no surplus programs) under the interpreter. The interpreter also has no minimum `tl.dot` size, unlike
    a GPU (K >= 16 for 16-bit operands): `attention.pick_tile` keeps that floor for compiled runs.
  * tracebacks point at shifted lines (the interpreter re-parses kernel sources).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:                                       # pragma: no cover - triton is an extra
    triton = None
    tl = None
    HAVE_TRITON = False


def interpret_mode() -> bool:
    """True when `@triton.jit` functions created now run through the interpreter."""
    if not HAVE_TRITON:
        return False
    return bool(triton.knobs.runtime.interpret)


def _stdlib_interpreted() -> bool:
    """True when triton.language's own @jit functions were created in interpreter mode (at triton's import)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.standard.max, InterpretedFunction)


INTERPRET = interpret_mode()        # the mode of every kernel in this package (fixed at import)

#: why the kernels cannot launch in this process, or None (TRITON_INTERPRET changed after triton was imported)
MODE_ERROR = None
if HAVE_TRITON and INTERPRET and not _stdlib_interpreted():
    MODE_ERROR = ("TRITON_INTERPRET=1 was set after triton was imported: triton.language's own functions are "
                  "compiled, the kernels interpreted; set TRITON_INTERPRET=1 before starting Python")
elif HAVE_TRITON and not INTERPRET and _stdlib_interpreted():
    MODE_ERROR = ("TRITON_INTERPRET was unset after triton was imported with it: triton.language's own functions "
                  "are interpreted, the kernels compiled; set or unset TRITON_INTERPRET before starting Python")

#: dtypes the launchers accept (fp64 is not a Triton compute type here: kernels compute in fp32)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check(t: torch.Tensor, name: str, dtypes=None, ndim: int | None = None, contiguous: bool = False,
          last_stride_one: bool = True, device=None) -> None:
    """Launcher-side layout assertions (nano-vllm style): one clear message per violated assumption."""
    assert isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}"
    if dtypes is not None:
        dtypes = dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)
        assert t.dtype in dtypes, f"{name}: dtype {t.dtype}, expected one of {tuple(dtypes)}"
    if ndim is not None:
        assert t.dim() == ndim, f"{name}: {t.dim()}-d tensor of shape {tuple(t.shape)}, expected {ndim}-d"
    if contiguous:
        assert t.is_contiguous(), f"{name}: must be contiguous (strides {t.stride()}, shape {tuple(t.shape)})"
    if last_stride_one and t.dim() and t.shape[-1] > 1:
        assert t.stride(-1) == 1, f"{name}: last dim must have stride 1 (strides {t.stride()})"
    if device is not None:
        assert t.device == device, f"{name}: on {t.device}, expected {device}"


def check_runnable(device: torch.device) -> None:
    """The kernels can launch on tensors of `device` in this process's mode (clear error instead of a crash)."""
    if MODE_ERROR is not None:
        raise RuntimeError(MODE_ERROR)
    if INTERPRET:
        if device.type != "cpu":
            raise RuntimeError(f"the Triton kernels were set up for the interpreter (CPU tensors); got {device}")
    elif device.type != "cuda":
        raise RuntimeError(f"the Triton kernels are compiled for CUDA; got tensors on {device} "
                           "(set TRITON_INTERPRET=1 before starting Python to check on CPU)")


def f32_mode(dtype: torch.dtype) -> bool:
    """Compute in fp32 inside the kernel (interpreter: always; GPU: for fp32 inputs, with IEEE dots)."""
    return INTERPRET or dtype == torch.float32


def tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
