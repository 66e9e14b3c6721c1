"""DiffusionGemma HF names <-> GemmaModel parameters, as transformers 5.23 `save_pretrained` writes them.

`slots(cfg)` is the one map {hf_key: Slot} that `dblock.weights` reads for the expected keys, for loading and for
saving. The decoder stack holds the weights; the two stacks' `layer_scalar` buffers are kept apart. With
tie_word_embeddings=False transformers also writes an `lm_head` and the encoder's own copies of the layers: dblock
runs one weight set for both stacks, so on load those copies must equal the decoder's. Vision-tower tensors (keys
under `CARRY`) ride along verbatim on load and save and are never used. Config only: no torch.
"""
from __future__ import annotations

import json

from dblock.gemma_config import GemmaConfig
from dblock.reference.slots import Slot

DEC = "model.decoder."
ENC = "model.encoder.language_model."
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
CARRY = VISION_PREFIXES   # HF keys kept verbatim in `model.vision_weights`, any shape

# Per-layer parameter names shared by both stacks (HF name == our module path inside `layers.{i}`)
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2")
_ONE_SET = "dblock runs one weight set for the encoder and the decoder"


def _layer_shapes(cfg: GemmaConfig, i: int) -> dict:
    """{name inside layers.{i}: shape} for the weights both stacks share (HF names)."""
    H, N, D, G = cfg.hidden_size, cfg.num_attention_heads, cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
    E, I, Id = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    s = {f"{n}.weight": (H,) for n in _LAYER_NORMS}
    s.update({"self_attn.q_proj.weight": (N * D, H), "self_attn.k_proj.weight": (G * D, H),
              "self_attn.o_proj.weight": (H, N * D), "self_attn.q_norm.weight": (D,),
              "self_attn.k_norm.weight": (D,), "mlp.gate_proj.weight": (Id, H), "mlp.up_proj.weight": (Id, H),
              "mlp.down_proj.weight": (H, Id), "router.proj.weight": (E, H), "router.scale": (H,),
              "router.per_expert_scale": (E,), "experts.gate_up_proj": (E, 2 * I, H),
              "experts.down_proj": (E, H, I)})
    if cfg.is_sliding(i):
        s["self_attn.v_proj.weight"] = (G * D, H)
    return s


def _self_conditioning_shapes(cfg: GemmaConfig) -> dict:
    H, Id = cfg.hidden_size, cfg.intermediate_size
    return {"self_conditioning.pre_norm.weight": (H,), "self_conditioning.gate_proj.weight": (Id, H),
            "self_conditioning.up_proj.weight": (Id, H), "self_conditioning.down_proj.weight": (H, Id)}


def slots(cfg: GemmaConfig) -> dict:
    """{hf_key: Slot}: decoder weights (the shared set), both stacks' layer_scalar, and with
    tie_word_embeddings=False the lm_head plus the encoder's copies (checked equal to the decoder's on load)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    tied = cfg.tie_word_embeddings
    out = {DEC + "embed_tokens.weight": Slot((V, H), "embed_tokens.weight"),
           DEC + "norm.weight": Slot((H,), "norm.weight")}
    out.update({DEC + name: Slot(shape, name) for name, shape in _self_conditioning_shapes(cfg).items()})
    for i in range(cfg.num_hidden_layers):
        for name, shape in _layer_shapes(cfg, i).items():
            p = f"layers.{i}.{name}"
            out[DEC + p] = Slot(shape, p)
            if not tied:
                out[ENC + p] = Slot(shape, p, copy=True, differs=f"differs from the decoder's {DEC}{p}: {_ONE_SET} "
                                    "(tie_word_embeddings=False with different stacks is unsupported)")
        out[f"{DEC}layers.{i}.layer_scalar"] = Slot((1,), f"layers.{i}.layer_scalar")
        out[f"{ENC}layers.{i}.layer_scalar"] = Slot((1,), f"layers.{i}.enc_layer_scalar")
    if not tied:
        out["lm_head.weight"] = Slot((V, H), "lm_head.weight")
        out[ENC + "embed_tokens.weight"] = Slot((V, H), "embed_tokens.weight", copy=True,
                                                differs=f"differs from the decoder's embedding: {_ONE_SET}")
        # the encoder's final norm: its output feeds nothing in generation, so it is not checked
        out[ENC + "norm.weight"] = Slot((H,), "norm.weight", copy=True)
    return out


def hf_files(cfg: GemmaConfig) -> dict:
    """Files beside the weights for transformers: generation_config.json naming EOS / pad, so its `generate` stops
    and pads as dblock does."""
    gen = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
           "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
           "transformers_version": "5.23.0"}
    return {"generation_config.json": json.dumps(gen, indent=2)}
