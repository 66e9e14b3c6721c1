"""Random tiny LLaDA models (`llada2_moe`, `llada_moe`) for tests and smoke runs (`dblock make-tiny`).

The weights are random, so decoding produces nothing meaningful; what is exercised is the loading path, the
routing, the masks and the schedules. Initialisation is wider than a trained model's at the LM head so that some
positions clear the 0.95 threshold and blocks finish in fewer passes than positions.
"""
from __future__ import annotations

import torch

from dblock.config import ModelConfig
from dblock.reference.llada import LladaModel

# Small shapes that still have every structural feature: GQA, partial RoPE, QK-norm, dense first layer,
# group-limited routing with an expert bias, a shared expert.
TINY_LLADA2 = dict(
    family="llada2_moe", model_type="llada2_moe", vocab_size=96, hidden_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
    num_experts=16, num_experts_per_tok=4, num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, score_function="sigmoid", use_expert_bias=True, norm_topk_prob=True,
    partial_rotary_factor=0.5, rope_theta=600000.0, use_qk_norm=True, rms_norm_eps=1e-6,
    mask_token_id=95, eos_token_id=94, pad_token_id=94, block_size=8, max_position_embeddings=4096,
)
TINY_LLADA_MOE = dict(
    family="llada_moe", model_type="llada", vocab_size=96, hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=0, moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=2, num_shared_experts=0, first_k_dense_replace=0, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, score_function="softmax", use_expert_bias=False, norm_topk_prob=False,
    partial_rotary_factor=1.0, rope_theta=50000.0, use_qk_norm=True, rms_norm_eps=1e-5,
    mask_token_id=95, eos_token_id=94, pad_token_id=94, block_size=8, max_position_embeddings=4096,
)
TINY = {"llada2_moe": TINY_LLADA2, "llada_moe": TINY_LLADA_MOE}


def tiny_config(family: str, **overrides) -> ModelConfig:
    """TINY_LLADA2 / TINY_LLADA_MOE with `overrides` on the ModelConfig fields, validated."""
    return ModelConfig(**{**TINY[family], **overrides}).validate(f"tiny {family} config")


def init_llada(model, seed: int, std: float = 0.02, head_std: float = 3.0) -> None:
    """Deterministic random init (normal std for matrices, ones for norms, small random expert bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.startswith("lm_head"):
                p.copy_(head_std * torch.randn(p.shape, generator=g))
            elif name == "embed.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def make_tiny_llada(family: str, seed: int = 0, dtype=torch.float32, **overrides) -> LladaModel:
    """A random tiny LLaDA model of `family` (its TINY preset with `overrides` on the ModelConfig fields)."""
    model = LladaModel(tiny_config(family, **overrides))
    init_llada(model, seed)
    return model.to(dtype).eval()
