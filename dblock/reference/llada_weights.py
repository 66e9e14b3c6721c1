"""LLaDA HF names <-> LladaModel parameters: one table per family, written once.

Each `Row` names an HF tensor (a template over layer {i} and expert {j}), the LladaModel tensor it fills and its
shape. `slots(cfg)` expands the family's rows into {hf_key: Slot}, which `dblock.weights` reads three ways: the keys
and shapes a folder must hold, where each tensor goes as it is streamed in, and what `save` writes. Two layouts:

  llada2_moe  fused attention.query_key_value, attention.dense, query/key_layernorm, mlp.gate.expert_bias,
              a shared expert (mlp.shared_experts), dense SwiGLU in the first `first_k_dense_replace` layers
  llada_moe   self_attn.q_proj / k_proj / v_proj (rows Q, K, V of dblock's fused wqkv), o_proj, q_norm / k_norm,
              mlp.expert_bias, every layer MoE

Routed experts are one HF tensor per expert j and one stacked (E, ...) tensor in LladaModel. Config only: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from dblock.config import ModelConfig
from dblock.reference.slots import Slot


def _always(cfg: ModelConfig) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """One line of a family's table: an HF tensor name (pattern), the LladaModel tensor it fills, its shape."""

    hf: str                                    # HF name; {i} layer index, {j} expert index
    param: str                                 # LladaModel state_dict name; {i} layer index
    shape: Callable[[ModelConfig], tuple]      # shape of one HF tensor
    layers: str = "none"                       # none (model level) | all | dense | moe: the layers holding it
    when: Callable[[ModelConfig], bool] = _always
    expert: bool = False                       # one HF tensor per expert j, stacked on dim 0 of `param`
    rows: Optional[Callable[[ModelConfig], slice]] = None  # the HF tensor is these rows of `param` (q/k/v of wqkv)
    fp32: bool = False                         # stored and used in fp32 (the expert bias)


# ---- shapes (letters: V vocab, H hidden, D head dim, Nq = heads * D, Nkv = kv heads * D, E experts, I expert
# width, Id dense width, Is shared-expert width) ---------------------------------------------------------------------
def _nq(c): return c.num_attention_heads * c.head_dim
def _nkv(c): return c.num_key_value_heads * c.head_dim
def _VH(c): return (c.vocab_size, c.hidden_size)
def _H(c): return (c.hidden_size,)
def _D(c): return (c.head_dim,)
def _qkv(c): return (_nq(c) + 2 * _nkv(c), c.hidden_size)
def _q(c): return (_nq(c), c.hidden_size)
def _kv(c): return (_nkv(c), c.hidden_size)
def _o(c): return (c.hidden_size, _nq(c))
def _IdH(c): return (c.intermediate_size, c.hidden_size)
def _HId(c): return (c.hidden_size, c.intermediate_size)
def _EH(c): return (c.num_experts, c.hidden_size)
def _E(c): return (c.num_experts,)
def _IH(c): return (c.moe_intermediate_size, c.hidden_size)
def _HI(c): return (c.hidden_size, c.moe_intermediate_size)
def _IsH(c): return (c.moe_intermediate_size * c.num_shared_experts, c.hidden_size)
def _HIs(c): return (c.hidden_size, c.moe_intermediate_size * c.num_shared_experts)


def _q_rows(c): return slice(0, _nq(c))
def _k_rows(c): return slice(_nq(c), _nq(c) + _nkv(c))
def _v_rows(c): return slice(_nq(c) + _nkv(c), _nq(c) + 2 * _nkv(c))


def _qk_norm(c): return c.use_qk_norm
def _expert_bias(c): return c.use_expert_bias
def _shared(c): return c.num_shared_experts > 0


L, M = "model.layers.{i}.", "layers.{i}."   # HF and LladaModel prefixes of layer i

_COMMON = [
    Row("model.norm.weight", "norm.weight", _H),
    Row("lm_head.weight", "lm_head.weight", _VH),
    Row(L + "input_layernorm.weight", M + "attn_norm.weight", _H, "all"),
    Row(L + "post_attention_layernorm.weight", M + "mlp_norm.weight", _H, "all"),
]
_DENSE_MLP = [Row(L + f"mlp.{w}_proj.weight", M + f"mlp.{w}.weight", shape, "dense")
              for w, shape in (("gate", _IdH), ("up", _IdH), ("down", _HId))]
_EXPERTS = [Row(L + "mlp.gate.weight", M + "mlp.gate.weight", _EH, "moe")] + [
    Row(L + f"mlp.experts.{{j}}.{w}_proj.weight", M + f"mlp.w_{w}", shape, "moe", expert=True)
    for w, shape in (("gate", _IH), ("up", _IH), ("down", _HI))]

ROWS = {
    "llada2_moe": [
        Row("model.word_embeddings.weight", "embed.weight", _VH), *_COMMON,
        Row(L + "attention.query_key_value.weight", M + "attn.wqkv.weight", _qkv, "all"),
        Row(L + "attention.query_layernorm.weight", M + "attn.q_norm.weight", _D, "all", _qk_norm),
        Row(L + "attention.key_layernorm.weight", M + "attn.k_norm.weight", _D, "all", _qk_norm),
        Row(L + "attention.dense.weight", M + "attn.wo.weight", _o, "all"),
        *_DENSE_MLP, *_EXPERTS,
        Row(L + "mlp.gate.expert_bias", M + "mlp.expert_bias", _E, "moe", _expert_bias, fp32=True),
        *[Row(L + f"mlp.shared_experts.{w}_proj.weight", M + f"mlp.shared.{w}.weight", shape, "moe", _shared)
          for w, shape in (("gate", _IsH), ("up", _IsH), ("down", _HIs))],
    ],
    "llada_moe": [
        Row("model.embed_tokens.weight", "embed.weight", _VH), *_COMMON,
        Row(L + "self_attn.q_proj.weight", M + "attn.wqkv.weight", _q, "all", rows=_q_rows),
        Row(L + "self_attn.k_proj.weight", M + "attn.wqkv.weight", _kv, "all", rows=_k_rows),
        Row(L + "self_attn.v_proj.weight", M + "attn.wqkv.weight", _kv, "all", rows=_v_rows),
        Row(L + "self_attn.q_norm.weight", M + "attn.q_norm.weight", _D, "all", _qk_norm),
        Row(L + "self_attn.k_norm.weight", M + "attn.k_norm.weight", _D, "all", _qk_norm),
        Row(L + "self_attn.o_proj.weight", M + "attn.wo.weight", _o, "all"),
        *_DENSE_MLP, *_EXPERTS,
        Row(L + "mlp.expert_bias", M + "mlp.expert_bias", _E, "moe", _expert_bias, fp32=True),
    ],
}


def _layers(row: Row, cfg: ModelConfig) -> list:
    """The layer indices holding this row's tensor ([None] for a model-level row)."""
    every = range(cfg.num_hidden_layers)
    return {"none": [None], "all": list(every), "dense": [i for i in every if not cfg.is_moe_layer(i)],
            "moe": [i for i in every if cfg.is_moe_layer(i)]}[row.layers]


def _expand(row: Row, cfg: ModelConfig, i) -> dict:
    """One row at layer i -> {hf_key: Slot} (one slot per expert for expert rows)."""
    param, shape = row.param.format(i=i), tuple(row.shape(cfg))
    if row.expert:
        return {row.hf.format(i=i, j=j): Slot(shape, param, j, row.fp32) for j in range(cfg.num_experts)}
    index = row.rows(cfg) if row.rows is not None else None
    return {row.hf.format(i=i): Slot(shape, param, index, row.fp32)}


def slots(cfg: ModelConfig) -> dict:
    """{hf_key: Slot} of every tensor a checkpoint of this config holds."""
    out = {}
    for row in ROWS[cfg.family]:
        if row.when(cfg):
            for i in _layers(row, cfg):
                out.update(_expand(row, cfg, i))
    return out
