"""The model a command runs and how: `--model`, `--device`, `--dtype` and the executor flags, parsed into the model's
config (read from config.json alone, before the weights), the loaded model, and the Forward that runs it.

`--device` is checked against this torch before anything is read (`check_device`); `--use-triton` on a machine
without CUDA puts Triton in interpreter mode at the start of the process (`prepare_triton`). Imports nothing heavy:
torch, the weights and the executors are imported inside the functions, when a command runs.
"""
from __future__ import annotations

import os
import sys

from dblock.cli_args import _show
from dblock.ranks import is_rank0, under_torchrun


def check_device(device: str) -> str:
    """`--device` as given, after checking this torch can use it: cpu, cuda or cuda:N."""
    import torch
    from dblock.errors import ConfigError
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"--device {_show(device)!r}: not a device; give cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return device
    if d.type != "cuda":
        raise ConfigError(f"--device {_show(device)}: allowed cpu, cuda, cuda:N")
    if torch.version.cuda is None:
        raise ConfigError(f"--device {device}: CUDA is not available in this torch build (torch {torch.__version__} "
                          "is CPU-only); use --device cpu or install a CUDA build of torch")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is visible (torch {torch.__version__}, CUDA "
                          f"{torch.version.cuda}; check the driver and CUDA_VISIBLE_DEVICES); use --device cpu")
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:
        raise ConfigError(f"--device {device}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    return device


def model_config(args):
    """(folder, config) of `--model`, read from config.json alone (no weights), after checking `--device`."""
    from dblock.config import load_config
    from dblock.weights_path import resolve_model_path
    from dblock.errors import ConfigError
    if not str(args.model or "").strip():
        raise ConfigError("--model: empty; give a model folder or a bundled name (tiny-masked, tiny-uniform)")
    if getattr(args, "device", None) is not None:
        check_device(args.device)
    folder = resolve_model_path(args.model)
    return folder, load_config(folder)


def load_model(args):
    import dblock
    check_device(args.device)
    dtype = args.dtype or ("float32" if args.device == "cpu" else None)
    device = args.device
    if device == "cuda" and "LOCAL_RANK" in os.environ:      # torchrun: one GPU per process
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    progress = True if getattr(args, "progress", False) else None     # None: a bar on a terminal for big loads
    if not is_rank0():
        progress = False
    return dblock.load(args.model, dtype=dtype, device=device, progress=progress)


def make_forward(model, args):
    """The executor chosen on the command line, over the loaded model's weights."""
    from dblock.decoding.generate import reference_forward
    ep = getattr(args, "ep", None)
    if ep is not None and (getattr(args, "executor", "reference") == "reference" or args.epoch_config == "dense"):
        raise ValueError(f"--ep {ep}: expert parallelism runs the epoch executor; add --executor epoch (and an "
                         "--epoch-config other than dense)")
    if getattr(args, "executor", "reference") == "reference":
        return reference_forward(model)
    from dblock.optimized.executor import epoch_forward
    dispatcher = None
    if (ep is not None or under_torchrun()) and args.epoch_config != "dense":
        from dblock.optimized.ep import dispatcher_from_cli
        dispatcher = dispatcher_from_cli(model, ep, args.ep_dispatch, str(next(model.parameters()).device))
    return epoch_forward(model, args.epoch_config, refresh=args.refresh, atlas_alpha=args.atlas_alpha,
                         atlas_q=args.atlas_q, update_every=args.update_every, use_triton=args.use_triton,
                         dispatcher=dispatcher, atlas_m=args.atlas_m, atlas_B=args.atlas_B,
                         atlas_beta=args.atlas_beta, atlas_c=args.atlas_c, path=args.epoch_path,
                         path_model=_path_model(args.path_profile),
                         margin_refresh=getattr(args, "margin_refresh", None),
                         lsp_drift=getattr(args, "lsp_drift", None))


def _path_model(path):
    """--path-profile FILE -> PathModel (a missing or malformed file is one error naming it)."""
    if path is None:
        return None
    from dblock.optimized.plan import PathModel
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--path-profile {path}: no such file")
    from dblock.errors import InputFileError
    try:
        return PathModel.load(path)
    except InputFileError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--path-profile {path}: {e}") from None


def prepare_triton(args) -> None:
    """`--use-triton` on a machine without CUDA: put Triton in interpreter mode before anything imports triton.

    Triton fixes interpreter vs compiled mode when `@triton.jit` decorates a function, and torch may import triton
    on its own once a model is built, so the mode has to be chosen at the start of the process (see
    `dblock.kernels`). This sets TRITON_INTERPRET=1 only when the user did not set the variable, triton is not
    imported yet and no CUDA device is visible; otherwise it leaves the process as it is.
    """
    if not getattr(args, "use_triton", False) or "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
