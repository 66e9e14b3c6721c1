"""Random tiny checkpoints in the real HF formats, for tests and smoke runs (`dblock make-tiny`).

The weights are random, so decoding produces nothing meaningful; what is exercised is the loading path, the
routing, the masks and the schedules. Each family declares its tiny preset and initialisation (dblock/families.py;
`dblock.reference.llada_tiny`, `dblock.reference.gemma_tiny`); this module builds and saves them.
"""
from __future__ import annotations

import torch

from dblock import families
from dblock.weights_write import check_out_dir, save


def tiny_config(family: str, **overrides):
    """The tiny preset's config of a family, with `overrides` on its fields."""
    return families.family(family).tiny_config(**overrides)


def make_tiny_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A random tiny model of a family, deterministic in `seed`."""
    return families.family(family).make_tiny(seed=seed, dtype=dtype, **overrides)


def hf_files(model) -> dict:
    """The files transformers reads beside the weights ({name: text}; DiffusionGemma: generation_config.json)."""
    return families.family(model.config.family).hf_files(model.config)


def save_for_transformers(model, out: str, overwrite: bool = False) -> str:
    """`save` plus the files transformers reads beside the weights (DiffusionGemma: generation_config.json naming
    EOS / pad, so its `generate` stops and pads as dblock does): a folder `from_pretrained` loads. Returns `out`.
    All or nothing, like `save`: `out` must be missing or empty unless `overwrite=True` (the whole folder is then
    replaced)."""
    save(model, out, extra_files=hf_files(model), overwrite=overwrite)
    return out


def make_tiny(family: str, out: str, seed: int = 0, overwrite: bool = False, **overrides) -> str:
    """Write a random tiny checkpoint of `family` to `out` (config.json + model.safetensors). Returns `out`.
    `out` must be missing or empty (checked before the model is built) unless `overwrite=True`, which replaces the
    whole folder; a failure leaves `out` as it was."""
    check_out_dir(out, overwrite)
    return save_for_transformers(make_tiny_model(family, seed, **overrides), out, overwrite=overwrite)
