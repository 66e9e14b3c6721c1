"""The model families dblock runs, each declared once (docs/models.md).

A `Family` names everything that differs between families: how its config.json is read, its model and its readable
reference executor, how its Hugging Face tensor names map onto the model (`slots`, which `dblock.weights` reads for
the expected keys, loading and saving) and its random tiny model. Other modules look a family up here instead of
branching on its name.

  llada2_moe       LLaDA2.0-mini / flash: masked diffusion, sigmoid group-limited routing, a shared expert
  llada_moe        LLaDA-MoE-7B-A1B: masked diffusion, softmax routing
  diffusion_gemma  DiffusionGemma: uniform-state diffusion, encoder and decoder over one weight set

Reading a config needs no model: `dblock.config.load_config` dispatches on its own config-only table
(`CONFIG_READERS`), which `read_config` below points into.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from dblock.config import CONFIG_READERS, ModelConfig
from dblock.forward import Forward
from dblock.reference import gemma_tiny, gemma_weights, llada_tiny, llada_weights
from dblock.reference.executor import LladaReference
from dblock.reference.gemma import GemmaModel
from dblock.gemma_config import GemmaConfig
from dblock.reference.gemma_executor import GemmaReference
from dblock.reference.llada import LladaModel


def _no_files(cfg) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    name: str
    config_class: type                      # ModelConfig | GemmaConfig
    read_config: Callable                   # (config.json dict, source) -> validated config
    model_class: type                       # the nn.Module holding the weights
    executor_class: type                    # the readable dense Forward over that model
    slots: Callable                         # config -> {hf_key: Slot}: expected keys, load and save
    tiny_config: Callable                   # (**overrides) -> the tiny preset's config
    make_tiny: Callable                     # (seed, dtype, **overrides) -> a random tiny model
    carry: tuple = ()                       # HF key prefixes kept verbatim in `model.vision_weights`, never used
    hf_files: Callable = _no_files          # config -> {file name: text} beside the weights, for transformers


def _llada(name: str) -> Family:
    return Family(name, ModelConfig, CONFIG_READERS[name], LladaModel, LladaReference, llada_weights.slots,
                  tiny_config=partial(llada_tiny.tiny_config, name),
                  make_tiny=partial(llada_tiny.make_tiny_llada, name))


FAMILIES = {f.name: f for f in (
    _llada("llada2_moe"),
    _llada("llada_moe"),
    Family("diffusion_gemma", GemmaConfig, CONFIG_READERS["diffusion_gemma"], GemmaModel, GemmaReference,
           gemma_weights.slots, tiny_config=gemma_tiny.tiny_gemma_config, make_tiny=gemma_tiny.make_tiny_gemma,
           carry=gemma_weights.CARRY, hf_files=gemma_weights.hf_files),
)}


def family(name: str) -> Family:
    """The family called `name` (a ValueError naming the allowed ones otherwise)."""
    if name not in FAMILIES:
        raise ValueError(f"family={name!r}: allowed {', '.join(FAMILIES)}")
    return FAMILIES[name]


def reference_forward(model) -> Forward:
    """The readable dense executor for a loaded model of any family."""
    return FAMILIES[model.config.family].executor_class(model)
