"""A random tiny DiffusionGemma for tests and smoke runs (`dblock make-tiny --family diffusion_gemma`).

`TINY_GEMMA` has every structural feature at toy size; `init_gemma` is a deterministic random init whose logits are
peaked enough for the entropy-bound rule to accept several positions per pass. A tiny vision tower
(`TINY_VISION`) rides along so transformers loads the folders with no missing key.
"""
from __future__ import annotations

import torch

from dblock.reference.gemma import GemmaModel
from dblock.gemma_config import FULL, SLIDING, TINY_VISION, GemmaConfig


def tiny_vision_weights(cfg: GemmaConfig, g: torch.Generator) -> dict:
    """Random tensors for TINY_VISION under transformers' names (Gemma-4 vision tower + its projection)."""
    v = TINY_VISION
    Hv, Iv, D, Nh, Nk = v["hidden_size"], v["intermediate_size"], v["head_dim"], v["num_attention_heads"], \
        v["num_key_value_heads"]
    shapes = {"model.encoder.embed_vision.embedding_projection.weight": (cfg.hidden_size, Hv),
              "model.encoder.vision_tower.patch_embedder.input_proj.weight": (Hv, 3 * v["patch_size"] ** 2),
              "model.encoder.vision_tower.patch_embedder.position_embedding_table":
                  (2, v["position_embedding_size"], Hv)}
    for i in range(v["num_hidden_layers"]):
        p = f"model.encoder.vision_tower.encoder.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            shapes[p + n + ".weight"] = (Hv,)
        shapes.update({p + "mlp.gate_proj.linear.weight": (Iv, Hv), p + "mlp.up_proj.linear.weight": (Iv, Hv),
                       p + "mlp.down_proj.linear.weight": (Hv, Iv), p + "self_attn.q_norm.weight": (D,),
                       p + "self_attn.k_norm.weight": (D,), p + "self_attn.q_proj.linear.weight": (Nh * D, Hv),
                       p + "self_attn.k_proj.linear.weight": (Nk * D, Hv),
                       p + "self_attn.v_proj.linear.weight": (Nk * D, Hv),
                       p + "self_attn.o_proj.linear.weight": (Hv, Nh * D)})
    return {k: 0.02 * torch.randn(s, generator=g) for k, s in sorted(shapes.items())}


TINY_GEMMA = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    global_head_dim=32, num_global_key_value_heads=1, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
    top_k_experts=2, layer_types=[SLIDING, SLIDING, FULL], sliding_window=8, canvas_length=16,
    eos_token_ids=(1,), pad_token_id=0, bos_token_id=2, image_token_id=255, boi_token_id=253, eoi_token_id=254,
    max_position_embeddings=4096,
)
"""Every structural feature at toy size: sliding + full layers with different head dims and kv heads (GQA, V = K
on the full layer), a sliding window shorter than prompt + canvas, proportional partial RoPE, 8 experts top-2."""


def tiny_gemma_config(**overrides) -> GemmaConfig:
    d = {**TINY_GEMMA, "vision_config": dict(TINY_VISION), **overrides}
    if "eos_token_id" in d:
        e = d.pop("eos_token_id")
        d["eos_token_ids"] = tuple(e) if isinstance(e, (list, tuple)) else (e,)
    return GemmaConfig(**d).validate("tiny diffusion_gemma config")


def init_gemma(model: GemmaModel, seed: int, embed_std: float = 1.0, branch_scale: float = 0.6) -> None:
    """Deterministic random init. Matrices ~ N(0, 1/fan_in); norm weights and router scales ~ 1 + N(0, 0.1^2),
    except the two norms that close a layer's residual branches (post_attention_layernorm,
    post_feedforward_layernorm), which are also multiplied by `branch_scale` -- Gemma's sandwich norms make those
    weights the branches' only gain. Layer scalars 1. A unit-variance embedding (it is also the LM head) with damped
    branches keeps the logits peaked and partly tied to the canvas, so the entropy bound accepts several positions
    per pass and blocks can settle, while the prompt still moves the predictions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or name.endswith("router.scale") or name.endswith("per_expert_scale"):
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
                if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                    w = w * branch_scale
                p.copy_(w)
            elif name == "embed_tokens.weight":
                p.copy_(embed_std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        model.vision_weights = tiny_vision_weights(model.config, g)


def make_tiny_gemma(seed: int = 0, dtype=torch.float32, embed_std: float = 1.0, branch_scale: float = 0.6,
                    **overrides) -> GemmaModel:
    """A random tiny DiffusionGemma (TINY_GEMMA with `overrides` on the GemmaConfig fields)."""
    model = GemmaModel(tiny_gemma_config(**overrides))
    init_gemma(model, seed, embed_std, branch_scale)
    return model.to(dtype).eval()
