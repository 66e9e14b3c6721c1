"""Model configuration.

`ModelConfig` is the subset of a Hugging Face `config.json` that the executors need, read for the two LLaDA
families (`llada2_moe` = LLaDA2.0-mini/flash, `llada_moe` = LLaDA-MoE-7B-A1B; its repo says `llada`, some copies
`lladamoe`). DiffusionGemma has its own nested config (`GemmaConfig`, in `dblock.gemma_config`), read
through the same `load_config` entry point. Config only: reading a config imports neither torch nor a model (the
families themselves are declared in dblock/families.py).

Every value the executors do not implement is refused with a `ConfigError` naming the key and the allowed values;
nothing is silently defaulted except the documented LLaDA token ids and block size, which real LLaDA configs do
not carry (they are `generate` arguments upstream). All families share one validation layer (dblock/validate.py):
each key is typed, finite and in range (`LLADA2_KEYS`, `LLADA_MOE_KEYS`, `LLADA_FIELDS` here), and the model's
size is bounded before anything is built from it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dblock import validate
from dblock.errors import ConfigError
from dblock.gemma_config import GemmaConfig
from dblock.validate import (BOOL, BOOL_OPT, EPS_OPT, FRACTION, FRACTION_OPT, IDS_OPT, NONNEG, NONNEG_OPT,
                             OBJECT_OPT, POS, POS_OPT, POSITIVE_REAL, POSITIVE_REAL_OPT, STR, Field)

# Token ids shared by LLaDA-MoE and LLaDA2.0 (vocab 157184). Upstream they are `generate` defaults, not config keys.
LLADA_VOCAB = 157184
LLADA_MASK_ID = 156895
LLADA_EOS_ID = 156892

# config.json `model_type` -> family
_MODEL_TYPE_TO_FAMILY = {
    "llada2_moe": "llada2_moe",
    "llada": "llada_moe",
    "lladamoe": "llada_moe",
    "llada_moe": "llada_moe",
    "diffusion_gemma": "diffusion_gemma",
}

# What each ModelConfig field may hold (`validate()` checks them first; dblock/validate.py has the rules).
LLADA_FIELDS = {
    "vocab_size": POS, "hidden_size": POS, "num_hidden_layers": POS, "num_attention_heads": POS,
    "num_key_value_heads": POS, "head_dim": POS, "intermediate_size": NONNEG, "moe_intermediate_size": POS,
    "num_experts": POS, "num_experts_per_tok": POS, "num_shared_experts": NONNEG, "first_k_dense_replace": NONNEG,
    "n_group": POS, "topk_group": POS, "routed_scaling_factor": POSITIVE_REAL, "score_function": STR,
    "use_expert_bias": BOOL, "norm_topk_prob": BOOL, "partial_rotary_factor": FRACTION,
    "rope_theta": POSITIVE_REAL, "use_qk_norm": BOOL, "rms_norm_eps": Field("float", lo=0, hi=1, lo_open=True),
    "mask_token_id": NONNEG, "eos_token_id": NONNEG, "pad_token_id": NONNEG, "block_size": POS,
    "max_position_embeddings": POS, "tie_word_embeddings": BOOL, "model_type": STR,
}

# What the LLaDA config.json keys may hold, as the files spell them (checked before anything is read from them).
# null means the documented default for every optional key.
LLADA_KEYS = {
    "vocab_size": POS, "hidden_size": POS, "num_hidden_layers": POS, "num_attention_heads": POS,
    "num_key_value_heads": POS_OPT, "head_dim": POS_OPT, "max_position_embeddings": POS_OPT, "block_size": POS_OPT,
    "rope_theta": POSITIVE_REAL_OPT, "rms_norm_eps": EPS_OPT, "partial_rotary_factor": FRACTION_OPT,
    "mask_token_id": IDS_OPT, "eos_token_id": IDS_OPT, "pad_token_id": IDS_OPT,
    "num_experts": POS, "num_experts_per_tok": POS,
    "tie_word_embeddings": BOOL_OPT, "use_qkv_bias": BOOL_OPT, "use_bias": BOOL_OPT, "attention_bias": BOOL_OPT,
    "moe_router_enable_expert_bias": BOOL_OPT, "use_qk_norm": BOOL_OPT, "rope_scaling": OBJECT_OPT,
}
LLADA2_KEYS = {
    **LLADA_KEYS, "intermediate_size": POS, "moe_intermediate_size": POS, "num_shared_experts": NONNEG_OPT,
    "first_k_dense_replace": NONNEG_OPT, "n_group": POS_OPT, "topk_group": POS_OPT,
    "routed_scaling_factor": POSITIVE_REAL_OPT, "norm_topk_prob": BOOL_OPT,
}
LLADA_MOE_KEYS = {
    **LLADA_KEYS, "expert_intermediate_size": POS_OPT, "moe_intermediate_size": POS_OPT,
    "dense_intermediate_size": NONNEG_OPT, "shared_expert_intermediate_size": NONNEG_OPT, "qk_layernorm": BOOL_OPT,
}


@dataclass
class ModelConfig:
    """One LLaDA-family model. Field names follow the HF config keys of LLaDA2.0 where they exist."""

    family: str                      # "llada2_moe" or "llada_moe" (DiffusionGemma: GemmaConfig)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int         # GQA: each KV head serves num_attention_heads // num_key_value_heads queries
    head_dim: int
    intermediate_size: int           # dense SwiGLU layers (the first `first_k_dense_replace`)
    moe_intermediate_size: int       # one routed expert
    num_experts: int
    num_experts_per_tok: int         # K of the router's top-K
    num_shared_experts: int = 0      # shared expert width = num_shared_experts * moe_intermediate_size, added unweighted
    first_k_dense_replace: int = 0   # layers [0, first_k_dense_replace) are dense, the rest MoE
    n_group: int = 1                 # group-limited routing: experts split into n_group groups ...
    topk_group: int = 1              # ... of which the topk_group best (sum of their top-2 choice scores) are eligible
    routed_scaling_factor: float = 1.0
    score_function: str = "sigmoid"  # "sigmoid" (LLaDA2: + expert bias for choice, renorm, scale) or "softmax" (LLaDA-MoE)
    use_expert_bias: bool = False    # llada2_moe: bias used for choice only; llada_moe: added to probs (HF semantics)
    norm_topk_prob: bool = True      # renormalise the K chosen weights to sum 1 (then x routed_scaling_factor)
    partial_rotary_factor: float = 1.0  # RoPE on the first rotary_dim = head_dim * factor dims (NeoX rotate_half)
    rope_theta: float = 10000.0
    use_qk_norm: bool = True         # per-head RMSNorm of q and k, before RoPE
    rms_norm_eps: float = 1e-6
    mask_token_id: int = LLADA_MASK_ID
    eos_token_id: int = LLADA_EOS_ID
    pad_token_id: int = LLADA_EOS_ID
    block_size: int = 32             # diffusion block C (not an HF key; dblock's `block_size` key or --block-size)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    model_type: str = ""             # as written in config.json
    extra: dict = field(default_factory=dict, repr=False)  # the raw json, for `dblock info`

    # ---- derived quantities -------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def sizes(self) -> dict:
        """The values `dblock.validate.llada_params` / `llada_tensors` count from (closed form, no loop)."""
        keys = validate.LLADA_SIZE_KEYS + ("first_k_dense_replace", "use_qk_norm", "use_expert_bias", "family")
        return {k: getattr(self, k) for k in keys}

    def param_count(self) -> int:
        """Parameters of the model, in closed form (equal to the sum over `dblock.reference.llada_weights.slots`)."""
        return validate.llada_params(self.sizes())

    def validate(self, source: str = "config") -> "ModelConfig":
        def bad(key: str, value: Any, allowed: str) -> ConfigError:
            return ConfigError(f"{source}: unsupported {key}={value!r} (allowed: {allowed})")

        if self.family not in ("llada2_moe", "llada_moe"):
            raise bad("family", self.family, "llada2_moe, llada_moe")
        validate.check_fields(self, LLADA_FIELDS, source)   # typed, finite, in range
        # before anything that could scale with the sizes
        validate.check_plausible(source, self.sizes(), validate.llada_params, validate.llada_tensors,
                                 validate.LLADA_SIZE_KEYS)
        if self.hidden_size % self.num_attention_heads:
            raise bad("num_attention_heads", self.num_attention_heads,
                      f"a divisor of hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", self.num_key_value_heads,
                      f"a divisor of num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.num_experts:
            raise bad("num_experts_per_tok", self.num_experts_per_tok, f"<= num_experts={self.num_experts}")
        if self.score_function not in ("sigmoid", "softmax"):
            raise bad("score_function", self.score_function, "sigmoid, softmax")
        if self.num_experts % self.n_group:
            raise bad("n_group", self.n_group, f"a divisor of num_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise bad("topk_group", self.topk_group, f"1..n_group={self.n_group}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise bad("n_group", self.n_group, "groups of at least 2 experts (group score = sum of the top 2)")
        if self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
            raise bad("topk_group", self.topk_group, "enough kept groups to hold num_experts_per_tok experts")
        exact = self.head_dim * self.partial_rotary_factor
        if not 0.0 < self.partial_rotary_factor <= 1.0 or abs(exact - round(exact)) > 1e-9 or self.rotary_dim % 2:
            raise bad("partial_rotary_factor", self.partial_rotary_factor, "(0, 1] giving an even rotary_dim")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise bad("first_k_dense_replace", self.first_k_dense_replace, f"0..{self.num_hidden_layers}")
        if self.first_k_dense_replace > 0 and self.intermediate_size <= 0:
            raise bad("intermediate_size", self.intermediate_size, "a positive integer when dense layers exist")
        if self.block_size > self.max_position_embeddings:
            raise bad("block_size", self.block_size, f"<= max_position_embeddings={self.max_position_embeddings}")
        for key in ("mask_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, key)
            if not 0 <= v < self.vocab_size:
                raise bad(key, v, f"0..vocab_size-1={self.vocab_size - 1}")
        if self.mask_token_id == self.eos_token_id:
            raise bad("mask_token_id", self.mask_token_id, "different from eos_token_id")
        return self

    def to_hf_dict(self) -> dict:
        """The config.json that `save` writes: HF keys of the family plus dblock's token ids and block size."""
        if self.family == "llada2_moe":
            d = {
                "model_type": "llada2_moe",
                "architectures": ["LLaDA2MoeModelLM"],
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
                "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "num_shared_experts": self.num_shared_experts, "first_k_dense_replace": self.first_k_dense_replace,
                "n_group": self.n_group, "topk_group": self.topk_group,
                "routed_scaling_factor": self.routed_scaling_factor, "score_function": self.score_function,
                "moe_router_enable_expert_bias": self.use_expert_bias, "norm_topk_prob": self.norm_topk_prob,
                "partial_rotary_factor": self.partial_rotary_factor, "rope_theta": self.rope_theta,
                "use_qk_norm": self.use_qk_norm, "use_qkv_bias": False, "use_bias": False,
                "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": False,
            }
        else:
            d = {
                "model_type": "llada",
                "architectures": ["LLaDAMoEModelLM"],
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "expert_intermediate_size": self.moe_intermediate_size, "num_experts": self.num_experts,
                # one 0/1 entry per layer (1 = MoE), as the official config writes it: its model class indexes it
                "num_experts_per_tok": self.num_experts_per_tok, "moe_layer_freq": [1] * self.num_hidden_layers,
                "shared_expert_intermediate_size": None, "partial_rotary_factor": self.partial_rotary_factor,
                "rope_theta": self.rope_theta, "qk_layernorm": self.use_qk_norm,
                "moe_router_enable_expert_bias": self.use_expert_bias,
                "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": False,
            }
        d.update(mask_token_id=self.mask_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                 block_size=self.block_size)
        return d


def _require(d: dict, key: str, source: str):
    if key not in d:
        raise ConfigError(f"{source}: missing key {key!r}")
    return d[key]


def _token_ids(d: dict, source: str) -> dict:
    """mask/eos/pad ids: from the file when present, else LLaDA's fixed ids (only valid for the 157184 vocab)."""
    out = {}
    vocab = d.get("vocab_size")
    defaults = {"mask_token_id": LLADA_MASK_ID, "eos_token_id": LLADA_EOS_ID, "pad_token_id": None}
    for key, default in defaults.items():
        v = d.get(key)
        if isinstance(v, list):  # HF allows a list of eos ids; the first is the one we emit and stop on
            v = v[0] if v else None   # (types and ranges: checked by LLADA_KEYS before)
        if v is None and key == "pad_token_id":
            v = out.get("eos_token_id")
        if v is None:
            if vocab != LLADA_VOCAB:
                raise ConfigError(f"{source}: no {key} and vocab_size={vocab} is not LLaDA's {LLADA_VOCAB}: "
                                  f"add {key} to config.json")
            v = default
        out[key] = int(v)
    return out


def llada_config_from_dict(d: dict, source: str = "config.json") -> ModelConfig:
    """A LLaDA config.json's dict -> validated ModelConfig. Every key is checked against the family's table
    (`LLADA2_KEYS` / `LLADA_MOE_KEYS`: type, finite, range) before it is used; null means the default."""
    validate.require_object(d, source)
    model_type = d.get("model_type")
    family = _MODEL_TYPE_TO_FAMILY.get(model_type) if isinstance(model_type, str) else None
    if family not in ("llada2_moe", "llada_moe"):
        raise ConfigError(f"{source}: unknown model_type {model_type!r} "
                          f"(allowed: {', '.join(sorted(_MODEL_TYPE_TO_FAMILY))})")
    validate.check_keys(d, LLADA2_KEYS if family == "llada2_moe" else LLADA_MOE_KEYS, source)
    req = lambda k: _require(d, k, source)  # noqa: E731
    opt = lambda k, default: validate.opt(d, k, default)  # noqa: E731
    hidden, heads = req("hidden_size"), req("num_attention_heads")
    if d.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{source}: unsupported num_attention_heads={heads!r} (allowed: a divisor of "
                          f"hidden_size={hidden} when head_dim is not given)")
    common = dict(
        vocab_size=req("vocab_size"), hidden_size=hidden, num_hidden_layers=req("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=opt("num_key_value_heads", heads),
        head_dim=opt("head_dim", hidden // heads),
        rope_theta=float(opt("rope_theta", 10000.0)), rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
        partial_rotary_factor=float(opt("partial_rotary_factor", 1.0)),
        max_position_embeddings=opt("max_position_embeddings", 32768),
        block_size=opt("block_size", 32), model_type=model_type, extra=dict(d),
        **_token_ids(d, source),
    )
    if d.get("tie_word_embeddings", False):
        raise ConfigError(f"{source}: unsupported tie_word_embeddings=True (allowed: False; both LLaDA families "
                          "ship a separate lm_head.weight)")
    for key in ("use_qkv_bias", "use_bias", "attention_bias"):
        if d.get(key, False):
            raise ConfigError(f"{source}: unsupported {key}=True (allowed: False)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: unsupported hidden_act={act!r} (allowed: silu)")
    rope_scaling = d.get("rope_scaling")
    if rope_scaling not in (None, {}) and (rope_scaling or {}).get("type", rope_scaling.get("rope_type")) not in (
            None, "default"):
        raise ConfigError(f"{source}: unsupported rope_scaling={rope_scaling!r} (allowed: null)")

    if family == "llada2_moe":
        score = opt("score_function", "sigmoid")
        if score != "sigmoid":
            # the HF LLaDA2 gate ignores this key and always uses sigmoid; refuse a value we would silently ignore
            raise ConfigError(f"{source}: unsupported score_function={score!r} (allowed: sigmoid for llada2_moe)")
        cfg = ModelConfig(
            family=family, intermediate_size=req("intermediate_size"),
            moe_intermediate_size=req("moe_intermediate_size"), num_experts=req("num_experts"),
            num_experts_per_tok=req("num_experts_per_tok"), num_shared_experts=opt("num_shared_experts", 0),
            first_k_dense_replace=opt("first_k_dense_replace", 0), n_group=opt("n_group", 1),
            topk_group=opt("topk_group", 1),
            routed_scaling_factor=float(opt("routed_scaling_factor", 1.0)), score_function="sigmoid",
            use_expert_bias=opt("moe_router_enable_expert_bias", True),
            # HF LLaDA2MoeGate always renormalises when top_k > 1, whatever norm_topk_prob says
            norm_topk_prob=True, use_qk_norm=opt("use_qk_norm", True), **common)
    else:
        # moe_layer_freq: the int 1 (older copies) or the official list, one 0/1 entry per layer (1 = MoE); null: 1
        freq, layers = d.get("moe_layer_freq"), d.get("num_hidden_layers")
        freq = 1 if freq is None else freq
        if isinstance(freq, list) and (len(freq) != layers or any(type(f) is not int or f not in (0, 1)
                                                                   for f in freq)):
            raise ConfigError(f"{source}: malformed moe_layer_freq={freq!r} (allowed: 1, or a list of "
                              f"num_hidden_layers={layers} entries, each 0 or 1)")
        if not (freq == 1 and type(freq) is int or isinstance(freq, list) and all(freq)):
            raise ConfigError(f"{source}: unsupported moe_layer_freq={freq!r} (allowed: 1 or a list of 1s, every "
                              "layer MoE)")
        if d.get("shared_expert_intermediate_size"):
            raise ConfigError(f"{source}: unsupported shared_expert_intermediate_size="
                              f"{d['shared_expert_intermediate_size']!r} (allowed: null for llada_moe)")
        moe_inter = opt("expert_intermediate_size", d.get("moe_intermediate_size"))
        if moe_inter is None:
            raise ConfigError(f"{source}: missing key 'expert_intermediate_size'")
        cfg = ModelConfig(
            family=family, intermediate_size=opt("dense_intermediate_size", 0),
            moe_intermediate_size=moe_inter, num_experts=req("num_experts"),
            num_experts_per_tok=req("num_experts_per_tok"), num_shared_experts=0, first_k_dense_replace=0,
            n_group=1, topk_group=1, routed_scaling_factor=1.0, score_function="softmax",
            use_expert_bias=opt("moe_router_enable_expert_bias", False), norm_topk_prob=False,
            use_qk_norm=opt("qk_layernorm", opt("use_qk_norm", True)), **common)
    return cfg.validate(source)


def read_json(path: str) -> Any:
    """The parsed JSON of `path` (any JSON value: callers that need an object check it, naming the file)."""
    return validate.read_json(path)


def family_of(d: dict, source: str = "config.json") -> str:
    validate.require_object(d, source)
    mt = d.get("model_type")
    fam = _MODEL_TYPE_TO_FAMILY.get(mt) if isinstance(mt, str) else None
    if fam is None:
        raise ConfigError(f"{source}: unknown model_type {mt!r} (allowed: {', '.join(sorted(_MODEL_TYPE_TO_FAMILY))})")
    return fam


# family -> its config.json reader, (dict, source) -> validated config
CONFIG_READERS = {
    "llada2_moe": llada_config_from_dict,
    "llada_moe": llada_config_from_dict,
    "diffusion_gemma": GemmaConfig.from_hf_dict,
}


def load_config(folder_or_file: str):
    """Read a model folder's config.json into ModelConfig (LLaDA families) or GemmaConfig (DiffusionGemma)."""
    path = folder_or_file
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    d = read_json(path)
    return CONFIG_READERS[family_of(d, path)](d, path)
