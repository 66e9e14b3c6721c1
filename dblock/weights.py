"""Local Hugging Face folders <-> models: `load` a folder into its family's reference model, `export` a model
under its family's HF names. Never touches the network.

A model is named by a bundled checkpoint's name, a folder, or a Hugging Face id (`org/name[@revision]`) already in
the local Hugging Face cache (`dblock.weights_path.resolve_model_path`); nothing is ever downloaded.

A model folder holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Everything is validated before any tensor is used (`dblock.weights_read`):
unknown model_type, unsupported config value, missing or unexpected key, wrong shape, unreadable or truncated
file, NaN/Inf in a weight -> one `WeightsError` naming the file and key.

Each family maps its HF names onto its model once (`Family.slots`, dblock/families.py): that map gives the keys a
folder must hold, where each tensor goes on load and what `save` writes (`dblock.weights_write`, all or nothing).
Loading streams: each tensor goes straight to its place in the model (a routed expert into its row of one
preallocated (E, ...) stack), so the peak is about the model plus the tensor being read.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from dblock.config import load_config
from dblock.errors import WeightsError
from dblock.families import FAMILIES
from dblock.weights_path import resolve_model_path
from dblock.weights_read import _dtype, config_dtype, expected, stream_tensors


@contextlib.contextmanager
def _no_init():
    """Build a model skeleton without running the modules' random initialisers: their values are replaced by the
    checkpoint anyway, and on the meta device they dispatch through torch's reference ops, whose first use imports
    torch._dynamo (seconds of start-up). transformers' `no_init_weights` does the same."""
    import torch.nn.init as init
    names = [n for n in ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                         "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                         "sparse_") if hasattr(init, n)]
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


class _Assembly:
    """A model's state dict as its HF tensors stream in. A whole tensor is kept as read; experts and fused rows are
    copied into one tensor per parameter, allocated when its first piece arrives; a copy (`Slot.copy`) is compared
    with its parameter once both are in, and dropped."""

    def __init__(self, slots: dict, targets: dict):
        self.slots, self.targets = slots, targets     # {hf_key: Slot}; {param: meta tensor} (shapes)
        self.sd: dict = {}                            # param -> tensor
        self.waiting: dict = {}                       # copies read before their parameter: hf_key -> tensor
        self.bad: set = set()                         # copies that differ from their parameter

    def put(self, key: str, t: torch.Tensor) -> None:
        s = self.slots[key]
        if s.fp32:
            t = t.float()
        if s.copy:
            if s.differs is not None:                 # an unchecked copy feeds nothing: dropped
                self.waiting[key] = t
        elif s.index is None:
            self.sd[s.param] = t
        else:
            if s.param not in self.sd:
                self.sd[s.param] = torch.empty(self.targets[s.param].shape, dtype=t.dtype, device=t.device)
            self.sd[s.param][s.index] = t
        if self.waiting:
            self._compare_waiting()

    def _compare_waiting(self) -> None:
        for key in [k for k in self.waiting if self.slots[k].param in self.sd]:
            if not torch.equal(self.waiting.pop(key), self.sd[self.slots[key].param]):
                self.bad.add(key)

    def state_dict(self, src: str) -> dict:
        """Every parameter, once all tensors are in; a WeightsError naming the first copy (table order) that
        differs from its parameter."""
        self._compare_waiting()
        for key, s in self.slots.items():
            if key in self.bad:
                raise WeightsError(f"{src}: key {key!r} {s.differs}")
        return self.sd


def load(path_or_name: str, dtype=None, device=None, progress: Optional[bool] = None) -> torch.nn.Module:
    """Load a local HF folder, a bundled model name or a Hugging Face id already in the local cache (see
    `resolve_model_path`) into the family's reference model, validated first.

    dtype: None takes config.json's `torch_dtype` (or `dtype`) when it names one -- as transformers'
    `torch_dtype="auto"` does; a checkpoint stored in bfloat16 whose config says float32 (the bundled code models) is
    computed in float32 -- and otherwise keeps the stored dtype; "float32"/"bfloat16"/"float64" or a torch dtype
    converts (expert_bias stays fp32). device: where the weights go ("cpu", "cuda"). progress: a bar per shard file on stderr (None:
    only for a large or sharded checkpoint on a terminal; see `stream_tensors`).
    """
    folder = resolve_model_path(path_or_name)
    cfg = load_config(folder)
    if dtype is None:
        dtype = config_dtype(folder)
    fam = FAMILIES[cfg.family]
    slots = fam.slots(cfg)
    with torch.device("meta"), _no_init():
        model = fam.model_class(cfg)
    parts, carried = _Assembly(slots, model.state_dict()), {}
    keep32 = frozenset(k for k, s in slots.items() if s.fp32)
    for key, t in stream_tensors(folder, expected(cfg), _dtype(dtype), device, keep32, progress):
        if key in slots:
            parts.put(key, t)
        else:
            carried[key] = t
    src = os.path.dirname(os.path.join(folder, "config.json"))
    model.load_state_dict(parts.state_dict(src), strict=True, assign=True)
    if fam.carry:
        model.vision_weights = carried
    model.source = folder
    return model.eval()


def export(model: torch.nn.Module) -> dict:
    """model -> {hf_key: tensor} under the family's HF names (copies cloned, carried tensors as they are)."""
    fam = FAMILIES[model.config.family]
    sd = model.state_dict()
    out = {}
    for key, s in fam.slots(model.config).items():
        t = sd[s.param] if s.index is None else sd[s.param][s.index]
        t = t.float() if s.fp32 else t
        out[key] = t.clone() if s.copy else t
    if fam.carry:
        out.update(model.vision_weights)
    return out
