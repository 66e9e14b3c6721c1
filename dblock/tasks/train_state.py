"""The training state of a `dblock train-tiny` run, `RUN/train_state.st`: saved and resumed without pickle.

A run folder may come from anyone, so its state file is data, never code. It is one safetensors file (the format
whose loader only reads tensors: no pickle, no object constructors); named `.st`, not `.safetensors`, so that a
weight loader that globs a model folder for `*.safetensors` never takes it for a shard of the exported model.

  tensors    model.<name>                 the model's state_dict (the expert bias included)
             optimizer.<index>.<key>      AdamW's per-parameter state (step, exp_avg, exp_avg_sq), by the index the
                                          optimizer gives the parameter
             loads                        the EMA of the expert loads (float64, MoE layers x experts)
             torch_rng                    `torch.get_rng_state()`
  metadata   {"dblock_train_state": JSON} FORMAT, step, total_steps, elapsed_s, config (the TrainConfig), history,
                                          evals, the optimizer's param_groups

Tensors are stored bit for bit, so a resumed run equals the uninterrupted one (tests/tasks/test_train*.py).

Loading is validated like a config, before anything is allocated from it: the metadata's JSON against a schema
(types, finite numbers, ranges: `StoredState`, the config as `TrainConfig`'s fields with the command line's bounds);
then, with the model and optimizer built from that config, every tensor's name, dtype and shape against theirs
(read from the safetensors header; a tensor is read only once its place is known). Every problem is one
`InputFileError` naming the file. A state file of the earlier format (`train_state.pt`, a torch pickle) is refused
by name without being opened: unpickling it could run code.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch

from dblock.errors import InputFileError

STATE_FILE = "train_state.st"
OLD_STATE_FILE = "train_state.pt"          # dblock's earlier pickle format: refused, never opened
FORMAT = "dblock-train-state/1"
META_KEY = "dblock_train_state"

#: the command line's bounds (dblock/cli/tasks.py), applied to a stored config
_INT_BOUNDS = dict(block_size=(1, 4096), batch_size=(1, 65536), steps=(1, 10_000_000), warmup=(0, 10_000_000),
                   save_every=(1, 10_000_000), threads=(1, 1024), curriculum_steps=(0, 10_000_000),
                   curriculum_start=(1, 64), eval_every=(0, 10_000_000), eval_n=(1, 100_000),
                   vocab_size=(261, 65536), window=(1, 65536), seed=(0, 2 ** 63 - 1), calibrate_steps=(1, 1_000_000),
                   length_chunk=(1, 1_000_000), log_every=(1, 10_000_000))
_FLOAT_BOUNDS = dict(lr=(0.0, 10.0), min_lr_frac=(0.0, 1.0), bias_update=(0.0, 1e3), noisy_context=(0.0, 1.0), suffix_mask=(0.0, 1.0),
                     minutes=(0.0, 100_000.0), weight_decay=(0.0, 10.0), grad_clip=(0.0, 1e6), eps=(0.0, 1.0))
MAX_TOTAL_STEPS = 10 ** 9


# ---------------------------------------------------------------------------------------------------------------
# the metadata's schema
# ---------------------------------------------------------------------------------------------------------------

_MODELS: dict = {}


def _models() -> dict:
    """The pydantic models of the metadata (built on first use)."""
    if _MODELS:
        return _MODELS
    from typing import Annotated, Literal, Union, get_args, get_origin, get_type_hints

    from pydantic import BaseModel, ConfigDict, Field, create_model

    from dblock.tasks.train_config import LLADA2_SIZES, TrainConfig
    from dblock.tasks.train_uniform import GEMMA_SIZES

    strict = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    hints = get_type_hints(TrainConfig)
    spec = {}
    for f in fields(TrainConfig):
        t = hints[f.name]
        optional = get_origin(t) is Union and type(None) in get_args(t)
        base = next((a for a in get_args(t) if a is not type(None)), t) if optional else t
        if base is tuple:
            base = tuple[Annotated[int, Field(ge=1, le=4096)], Annotated[int, Field(ge=1, le=4096)]]
        elif f.name in _INT_BOUNDS:
            lo, hi = _INT_BOUNDS[f.name]
            base = Annotated[int, Field(ge=lo, le=hi)]
        elif f.name in _FLOAT_BOUNDS:
            lo, hi = _FLOAT_BOUNDS[f.name]
            base = Annotated[float, Field(ge=lo, le=hi)]
        elif f.name == "family":
            base = Literal["llada2_moe", "diffusion_gemma"]
        elif f.name == "size":
            base = Literal[tuple(sorted(set(LLADA2_SIZES) | set(GEMMA_SIZES)))]
        elif f.name == "save_dtype":
            base = Literal["bfloat16", "float16"]
        elif base is str:
            base = Annotated[str, Field(max_length=4096)]
        spec[f.name] = ((Optional[base] if optional else base), f.default)
    Config = create_model("StoredTrainConfig", __config__=strict, **spec)

    Num = Union[Annotated[int, Field(strict=True)], Annotated[float, Field(strict=True, allow_inf_nan=True)], None]

    class Record(BaseModel):                     # one history line: numbers (a diverged loss may be NaN)
        model_config = ConfigDict(strict=True, extra="allow")
        step: Annotated[int, Field(ge=0, le=MAX_TOTAL_STEPS)]
        loss: Num = None

    class Eval(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        step: Annotated[int, Field(ge=0, le=MAX_TOTAL_STEPS)]

    class Group(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        params: list[Annotated[int, Field(ge=0, le=1 << 24)]]

    class StoredState(BaseModel):
        model_config = strict
        format: Literal[FORMAT]
        step: Annotated[int, Field(ge=0, le=MAX_TOTAL_STEPS)]
        total_steps: Optional[Annotated[int, Field(ge=1, le=MAX_TOTAL_STEPS)]] = None
        elapsed_s: Annotated[float, Field(ge=0.0, le=1e9)]
        config: Config
        history: Annotated[list[Record], Field(max_length=10_000_000)]
        evals: Annotated[list[Eval], Field(max_length=1_000_000)]
        param_groups: Annotated[list[Group], Field(min_length=1, max_length=64)]

    _MODELS.update(StoredState=StoredState)
    return _MODELS


@dataclass
class TrainState:
    """A state file's metadata, validated; `restore` loads its tensors into a model and optimizer built from
    `config`."""

    path: str
    config: dict
    step: int
    total_steps: Optional[int]
    elapsed_s: float
    history: list
    evals: list
    param_groups: list

    def restore(self, model, opt) -> torch.Tensor:
        """Load the model's and the optimizer's tensors and the RNG state; returns the expert loads' EMA. Every
        tensor is checked against the place it goes (name, dtype, shape) before it is read."""
        return _restore(self, model, opt)


# ---------------------------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------------------------

def save(path: str, model, opt, cfg, step: int, total: Optional[int], elapsed: float, history: list,
         loads_acc: torch.Tensor, evals: Optional[list] = None) -> None:
    """Write the state to `path` all or nothing: serialised in memory, written to `path`.tmp, renamed over `path`;
    on any failure (a full disk) the .tmp is removed and `path` keeps the previous state (a WriteError naming it)."""
    from safetensors.torch import save as st_save

    from dblock.errors import write_failure
    tensors = {f"model.{k}": v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for idx, st in sd["state"].items():
        for key, v in st.items():
            if not torch.is_tensor(v):
                raise TypeError(f"optimizer state {idx}.{key}: {type(v).__name__}, not a tensor")
            tensors[f"optimizer.{idx}.{key}"] = v.detach().to("cpu").contiguous().clone()
    tensors["loads"] = loads_acc.detach().to("cpu").contiguous().clone()
    tensors["torch_rng"] = torch.get_rng_state().clone()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    meta = {"format": FORMAT, "step": int(step), "total_steps": total, "elapsed_s": float(elapsed),
            "config": asdict(cfg), "history": history, "evals": evals or [], "param_groups": groups}
    data = st_save(tensors, metadata={META_KEY: json.dumps(meta)})
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise write_failure(path, e) from None
        raise


# ---------------------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------------------

def state_path(run_dir: str) -> str:
    """RUN/train_state.st; a run folder holding only the earlier pickle format is refused by name (never opened)."""
    path = os.path.join(run_dir, STATE_FILE)
    old = os.path.join(run_dir, OLD_STATE_FILE)
    if not os.path.isfile(path) and os.path.lexists(old):
        raise InputFileError(f"--resume: {old}: a training state in dblock's earlier format, a torch pickle (loading "
                             f"one can run code), so it is not opened; this dblock resumes from {STATE_FILE} only "
                             "(safetensors + JSON): start the run again")
    return path


def _open(path: str):
    from safetensors import safe_open
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors' errors (SafetensorError, OSError) are one line naming the file
        raise InputFileError(f"--resume: {path}: not a readable train state ({_reason(e)})") from None


def _reason(e: BaseException) -> str:
    return ((str(e).splitlines() or [""])[0][:160] or type(e).__name__)


def read(path: str) -> TrainState:
    """The metadata of the state file `path`, validated (no tensor is read)."""
    from pydantic import ValidationError

    from dblock.input_files import parse_json, validation_message
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--resume: no checkpoint {path}")
    with _open(path) as f:
        meta = f.metadata() or {}
    if META_KEY not in meta:
        raise InputFileError(f"--resume: {path}: a safetensors file without dblock's training metadata (not written "
                             "by `dblock train-tiny`)")
    raw = parse_json(meta[META_KEY], f"--resume: {path}: metadata")
    try:
        s = _models()["StoredState"].model_validate(raw)
    except ValidationError as e:
        raise InputFileError(f"--resume: {path}: {validation_message(e)}") from None
    cfg = s.config.model_dump()
    if s.total_steps is not None and s.step > s.total_steps:
        raise InputFileError(f"--resume: {path}: step {s.step} beyond total_steps {s.total_steps}")
    return TrainState(path, cfg, s.step, s.total_steps, s.elapsed_s, [r.model_dump() for r in s.history],
                      [e.model_dump() for e in s.evals], [g.model_dump() for g in s.param_groups])


def run_family(run_dir: str) -> str:
    """The family of the run in `run_dir` (its state's metadata), for `--resume` without --family."""
    path = state_path(run_dir)
    if not os.path.isfile(path):
        raise ValueError(f"--resume: {path} does not exist (nothing to resume; give --family to start a run)")
    return read(path).config["family"]


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _restore(state: TrainState, model, opt) -> torch.Tensor:
    path = state.path
    expected = {f"model.{k}": (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    fresh = opt.state_dict()
    groups = _param_groups(state, fresh, path)
    rng = torch.get_rng_state()
    slots = {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if any(g.get("amsgrad") for g in groups) else set())
    with _open(path) as f:
        names = set(f.keys())

        def check(name, dtype, shape):
            sl = f.get_slice(name)
            got = (_DTYPES.get(sl.get_dtype()), tuple(sl.get_shape()))
            if got != (dtype, tuple(shape)):
                raise InputFileError(f"--resume: {path}: tensor {name} is {sl.get_dtype()} {list(got[1])}; this run's "
                                     f"needs {str(dtype).replace('torch.', '')} {list(shape)} (a state of another "
                                     "model?)")

        missing = sorted(set(expected) - names)
        if missing:
            raise InputFileError(f"--resume: {path}: no tensor {missing[0]} (a state of another model?)")
        opt_state: dict = {}
        for name in sorted(names - set(expected)):
            if name in ("loads", "torch_rng"):
                continue
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "optimizer" or not parts[1].isdigit() or int(parts[1]) >= len(params):
                raise InputFileError(f"--resume: {path}: unexpected tensor {name!r}")
            idx, key = int(parts[1]), parts[2]
            p = params[idx]
            if key == "step":
                dt = _DTYPES.get(f.get_slice(name).get_dtype())
                check(name, dt if dt in (torch.float32, torch.float64) else torch.float32, ())
            elif key in slots:
                check(name, p.dtype, p.shape)
            else:
                raise InputFileError(f"--resume: {path}: unexpected optimizer state {name!r}")
            opt_state.setdefault(idx, {})[key] = None
        for idx, st in opt_state.items():
            if set(st) != slots | {"step"}:
                raise InputFileError(f"--resume: {path}: optimizer state of parameter {idx} has "
                                     f"{', '.join(sorted(st))}; AdamW keeps {', '.join(sorted(slots | {'step'}))}")
        for name, (dtype, shape) in expected.items():
            check(name, dtype, shape)
        check("loads", torch.float64, (len(model.config.moe_layers), model.config.num_experts))
        check("torch_rng", torch.uint8, tuple(rng.shape))
        # every place known and checked: read
        model.load_state_dict({k[len("model."):]: f.get_tensor(k) for k in expected})
        for idx, st in opt_state.items():
            for key in st:     # copies: the optimizer keeps them, and the file's mapping must not outlive it
                st[key] = f.get_tensor(f"optimizer.{idx}.{key}").clone()
            step = st.get("step")
            if step is not None and not (math.isfinite(float(step)) and 0 <= float(step) <= MAX_TOTAL_STEPS):
                raise InputFileError(f"--resume: {path}: optimizer.{idx}.step is {float(step)}, not a step count")
        loads = f.get_tensor("loads").clone()
        torch_rng = f.get_tensor("torch_rng").clone()
    opt.load_state_dict({"state": opt_state, "param_groups": groups})
    try:
        torch.set_rng_state(torch_rng)
    except RuntimeError as e:
        raise InputFileError(f"--resume: {path}: torch_rng is not a generator state ({_reason(e)})") from None
    return loads


def _param_groups(state: TrainState, fresh: dict, path: str) -> list:
    """The optimizer's param_groups as stored, over the groups the optimizer built from the same config: the same
    parameters in each, every hyperparameter of the same type (tuples stored as JSON lists come back as tuples)."""
    groups = fresh["param_groups"]
    if len(state.param_groups) != len(groups):
        raise InputFileError(f"--resume: {path}: {len(state.param_groups)} optimizer parameter groups; this run has "
                             f"{len(groups)}")
    out = []
    for i, (saved, g) in enumerate(zip(state.param_groups, groups)):
        if saved["params"] != g["params"]:
            raise InputFileError(f"--resume: {path}: optimizer parameter group {i} holds other parameters than this "
                                 "run's")
        new = dict(g)
        for k, v in g.items():
            if k == "params" or k not in saved:
                continue
            s = saved[k]
            if isinstance(v, tuple):
                s = tuple(s) if isinstance(s, list) else s
            ok = (type(s) is type(v) or (isinstance(v, float) and type(s) is int) or (v is None and s is None)) and \
                not (isinstance(s, float) and not math.isfinite(s)) and \
                not (isinstance(s, tuple) and not all(isinstance(x, (int, float)) and math.isfinite(x) for x in s))
            if not ok:
                raise InputFileError(f"--resume: {path}: optimizer parameter group {i}: {k} = {str(s)[:40]!r}, "
                                     f"expected {type(v).__name__}")
            new[k] = float(s) if isinstance(v, float) else s
        out.append(new)
    return out


def contents(path: str) -> dict:
    """Everything in a state file, for inspection and tests: the validated metadata's fields plus `model` (the
    state_dict), `optimizer` ({index: {key: tensor}}), `loads` and `torch_rng`. Reading tensors from a
    safetensors file runs nothing; nothing is checked against a model."""
    from safetensors.torch import load
    st = read(path)
    try:
        with open(path, "rb") as f:
            t = load(f.read())          # from bytes: nothing stays mapped to the file
    except Exception as e:  # noqa: BLE001
        raise InputFileError(f"{path}: not a readable train state ({_reason(e)})") from None
    opt: dict = {}
    for k, v in t.items():
        if k.startswith("optimizer."):
            _, idx, key = k.split(".", 2)
            opt.setdefault(int(idx), {})[key] = v
    return {**{k: getattr(st, k) for k in ("config", "step", "total_steps", "elapsed_s", "history", "evals",
                                           "param_groups")},
            "model": {k[len("model."):]: v for k, v in t.items() if k.startswith("model.")}, "optimizer": opt,
            "loads": t.get("loads"), "torch_rng": t.get("torch_rng")}
