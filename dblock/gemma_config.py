"""DiffusionGemma's config (`diffusion_gemma`): HF `config.json` <-> `GemmaConfig`. Config only: no torch, no model.

Read through `dblock.config.load_config` like the LLaDA configs. The model itself is `dblock.reference.gemma`
(docs/models.md). Validated by the layer all families share (dblock/validate.py): the keys of `GEMMA_TEXT_KEYS`,
`GEMMA_TOP_KEYS`, `ROPE_KEYS` and the fields of `GEMMA_FIELDS` typed, finite and in range, the model's size bounded
before the default `layer_types` list (one entry per layer) is built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from dblock import validate
from dblock.errors import ConfigError
from dblock.validate import (BOOL, BOOL_OPT, EPS_OPT, ID_OPT, IDS_OPT, LIST_OPT, NONNEG, OBJECT_OPT, POS, POS_OPT,
                             POSITIVE_REAL, POSITIVE_REAL_OPT, PROB_OPT, STR, Field)

SLIDING, FULL = "sliding_attention", "full_attention"

# A vision tower small enough to ride along in tiny checkpoints, so transformers loads them with no missing key.
# Also the `vision_config` written for a config that has none.
#: the released DiffusionGemma's image placeholder id; written for models whose vocabulary has none
NO_IMAGE_TOKEN_ID = 258_880

TINY_VISION = dict(
    model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, patch_size=2, position_embedding_size=8, pooling_kernel_size=3,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
    initializer_range=0.02, max_position_embeddings=131072, standardize=False, use_clipped_linears=False,
    rope_parameters={"rope_theta": 100.0, "rope_type": "axial"},
)


def default_rope_parameters() -> dict:
    """transformers' defaults: sliding layers plain RoPE (theta 1e4), full layers proportional RoPE on 25% of the
    dims (theta 1e6)."""
    return {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


# What each `rope_parameters[layer type]` entry may hold (null: the default).
ROPE_KEYS = {"rope_type": Field("str", null=True), "rope_theta": POSITIVE_REAL_OPT,
             "partial_rotary_factor": PROB_OPT, "factor": POSITIVE_REAL_OPT}


def rope_spec(cfg: "GemmaConfig", layer_type: str, source: str = "text_config") -> tuple:
    """(rope_type, theta, partial_rotary_factor, factor) of one layer type; ConfigError on what dblock does not
    implement. `dblock.reference.gemma.rope_inv_freq` turns it into frequencies."""
    params = (cfg.rope_parameters or {}).get(layer_type)
    where = f"rope_parameters[{layer_type!r}]"
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: missing {where}")
    validate.check_keys(params, ROPE_KEYS, source, prefix=where + ".")
    kind = validate.opt(params, "rope_type", "default")
    p = validate.opt(params, "partial_rotary_factor", 1.0)
    if kind == "default":
        if p not in (None, 1.0, 1):
            raise ConfigError(f"{source}: unsupported {where}.partial_rotary_factor={p!r} with rope_type "
                              "default (allowed: 1.0; use rope_type proportional)")
    elif kind == "proportional":
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"{source}: unsupported {where}.partial_rotary_factor={p!r} (allowed: [0, 1])")
    else:
        raise ConfigError(f"{source}: unsupported {where}.rope_type={kind!r} (allowed: default, proportional)")
    return kind, float(validate.opt(params, "rope_theta", 10_000.0)), float(p), float(validate.opt(params, "factor",
                                                                                                      1.0))


# What each GemmaConfig field may hold (`validate()` checks them; dblock/validate.py has the rules).
GEMMA_FIELDS = {
    "vocab_size": POS, "hidden_size": POS, "num_hidden_layers": POS, "num_attention_heads": POS,
    "num_key_value_heads": POS, "head_dim": POS, "global_head_dim": POS, "num_global_key_value_heads": POS,
    "intermediate_size": POS, "moe_intermediate_size": POS, "num_experts": POS, "top_k_experts": POS,
    "layer_types": Field("list"), "sliding_window": POS, "rope_parameters": Field("object"),
    "rms_norm_eps": Field("float", lo=0, hi=1, lo_open=True), "final_logit_softcapping": POSITIVE_REAL,
    "canvas_length": POS, "tie_word_embeddings": BOOL, "eos_token_ids": Field("ids", lo=0), "pad_token_id": NONNEG,
    "bos_token_id": ID_OPT, "image_token_id": ID_OPT, "boi_token_id": ID_OPT, "eoi_token_id": ID_OPT,
    "max_position_embeddings": POS, "hidden_activation": STR, "vision_config": OBJECT_OPT, "model_type": STR,
}

# What the config.json keys may hold, as transformers writes them (checked before anything is read from them). Keys
# that have their own "missing" / "unsupported" message (required sizes, eos_token_id, final_logit_softcapping)
# pass null through to it.
GEMMA_TEXT_KEYS = {
    "vocab_size": POS_OPT, "hidden_size": POS_OPT, "num_hidden_layers": POS_OPT, "num_attention_heads": POS_OPT,
    "num_key_value_heads": POS_OPT, "head_dim": POS_OPT, "intermediate_size": POS_OPT,
    "moe_intermediate_size": POS_OPT, "num_experts": POS_OPT, "top_k_experts": POS_OPT,
    "global_head_dim": POS_OPT, "num_global_key_value_heads": POS_OPT, "sliding_window": POS_OPT,
    "max_position_embeddings": POS_OPT, "rms_norm_eps": EPS_OPT, "final_logit_softcapping": POSITIVE_REAL_OPT,
    "layer_types": LIST_OPT, "rope_parameters": OBJECT_OPT, "per_layer_config": OBJECT_OPT,
    "eos_token_id": IDS_OPT, "pad_token_id": ID_OPT, "bos_token_id": ID_OPT, "attention_bias": BOOL_OPT,
    "enable_moe_block": BOOL_OPT,
}
GEMMA_TOP_KEYS = {
    "canvas_length": POS_OPT, "tie_word_embeddings": BOOL_OPT, "image_token_id": ID_OPT, "boi_token_id": ID_OPT,
    "eoi_token_id": ID_OPT, "vision_config": OBJECT_OPT,
}


def _default_full_layers(n_layers: int) -> int:
    """Full-attention layers of transformers' default pattern (every 6th, and the last), in closed form."""
    return n_layers // 6 + (1 if n_layers % 6 else 0)


@dataclass
class GemmaConfig:
    """The text model of one DiffusionGemma checkpoint (HF `text_config` + the top-level `canvas_length`).

    Field names follow transformers' `DiffusionGemmaTextConfig` where they exist; the full-attention overrides that
    transformers keeps in `per_layer_config` are flattened into `global_head_dim` / `num_global_key_value_heads`.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int              # query heads, every layer
    num_key_value_heads: int              # kv heads of sliding layers
    head_dim: int                         # head dim of sliding layers
    global_head_dim: int                  # head dim of full layers
    num_global_key_value_heads: int       # kv heads of full layers (V = K projection there)
    intermediate_size: int                # the parallel dense MLP, and the self-conditioning MLP
    moe_intermediate_size: int            # one expert
    num_experts: int
    top_k_experts: int                    # K of the router's top-K
    layer_types: list                     # per layer "sliding_attention" | "full_attention" (last one is full)
    sliding_window: int = 512             # W: a sliding query sees positions q-W+1..q
    rope_parameters: dict = field(default_factory=lambda: default_rope_parameters())  # per layer type
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0  # logits = cap * tanh(z / cap); a class constant in transformers
    canvas_length: int = 256              # the diffusion block C
    tie_word_embeddings: bool = True      # top-level key: False unties lm_head AND the encoder from the decoder
    eos_token_ids: tuple = (1,)           # all EOS ids (transformers stops on any); the first is `eos_token_id`
    pad_token_id: int = 0                 # written after the first EOS of a canvas
    bos_token_id: Optional[int] = 2
    image_token_id: Optional[int] = None  # image placeholder id: refused (no vision tower here)
    boi_token_id: Optional[int] = None
    eoi_token_id: Optional[int] = None
    max_position_embeddings: int = 131_072
    hidden_activation: str = "gelu_pytorch_tanh"
    vision_config: Optional[dict] = None  # kept verbatim for re-export; never used
    family: str = "diffusion_gemma"
    model_type: str = "diffusion_gemma"
    mask_token_id: Optional[int] = None   # uniform-state diffusion has no MASK token
    extra: dict = field(default_factory=dict, repr=False, compare=False)  # the raw config.json (`dblock info`)
    source: str = field(default="", repr=False, compare=False)  # the config.json read (its folder may hold
                                                                 # vision tensors)

    # ---- names other parts of dblock use (the LLaDA ModelConfig vocabulary) ----------------------------------
    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def block_size(self) -> int:
        return self.canvas_length

    @property
    def top_k(self) -> int:
        return self.top_k_experts

    @property
    def num_experts_per_tok(self) -> int:
        return self.top_k_experts

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def moe_layers(self) -> list:
        return list(range(self.num_hidden_layers))   # every layer has the MoE branch

    # the routing rule in the vocabulary of `dblock.optimized.atlas` (softmax over every expert, one group, top-K;
    # the renormalisation and the per-expert scale are applied by `dblock.optimized.gemma_epoch.GemmaMoe`)
    score_function = "softmax"
    n_group = 1
    topk_group = 1

    def is_moe_layer(self, i: int) -> bool:
        return True

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.is_sliding(i) else self.global_head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.num_key_value_heads if self.is_sliding(i) else self.num_global_key_value_heads

    # ---- validation -------------------------------------------------------------------------------------------
    def sizes(self) -> dict:
        """The values `dblock.validate.gemma_params` / `gemma_tensors` count from (closed form)."""
        s = {k: getattr(self, k) for k in validate.GEMMA_SIZE_KEYS + ("tie_word_embeddings",)}
        s["n_full"] = sum(1 for t in self.layer_types if t == FULL)
        return s

    def param_count(self) -> int:
        """Parameters the model holds, in closed form (`dblock.reference.gemma_weights.slots` less the encoder's
        copies; no vision tower)."""
        return validate.gemma_params(self.sizes())

    def validate(self, source: str = "config") -> "GemmaConfig":
        def bad(key, value, allowed):
            return ConfigError(f"{source}: unsupported {key}={validate.short_repr(value, 200)} (allowed: {allowed})")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "global_head_dim", "num_global_key_value_heads", "intermediate_size",
                    "moe_intermediate_size", "num_experts", "top_k_experts", "canvas_length", "sliding_window"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(key, v, "a positive integer")
        if not isinstance(self.final_logit_softcapping, (int, float)) or self.final_logit_softcapping <= 0:
            raise bad("final_logit_softcapping", self.final_logit_softcapping, "a positive number")
        validate.check_fields(self, GEMMA_FIELDS, source)   # typed, finite, in range
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", self.layer_types, f"a list of num_hidden_layers={self.num_hidden_layers} entries")
        # before anything that could scale with the sizes
        validate.check_plausible(source, self.sizes(), validate.gemma_params, validate.gemma_tensors,
                                 validate.GEMMA_SIZE_KEYS)
        if self.sliding_window < 2:
            raise bad("sliding_window", self.sliding_window, ">= 2 (the cache keeps sliding_window - 1 positions)")
        if self.hidden_size % self.num_attention_heads:
            raise bad("num_attention_heads", self.num_attention_heads, f"a divisor of hidden_size={self.hidden_size}")
        for key in ("num_key_value_heads", "num_global_key_value_heads"):
            if self.num_attention_heads % getattr(self, key):
                raise bad(key, getattr(self, key), f"a divisor of num_attention_heads={self.num_attention_heads}")
        for key in ("head_dim", "global_head_dim"):
            if getattr(self, key) % 2:
                raise bad(key, getattr(self, key), "an even number (RoPE rotates halves)")
        if self.top_k_experts > self.num_experts:
            raise bad("top_k_experts", self.top_k_experts, f"<= num_experts={self.num_experts}")
        if self.canvas_length > self.max_position_embeddings:
            raise bad("canvas_length", self.canvas_length,
                      f"<= max_position_embeddings={self.max_position_embeddings}")
        for t in self.layer_types:
            if t not in (SLIDING, FULL):
                raise bad("layer_types", t, f"{SLIDING}, {FULL}")
        if self.hidden_activation not in ("gelu_pytorch_tanh",):
            raise bad("hidden_activation", self.hidden_activation, "gelu_pytorch_tanh")
        for t in (SLIDING, FULL):
            if t in self.layer_types:
                rope_spec(self, t, source)  # raises ConfigError on unsupported RoPE parameters
        for key in ("pad_token_id", "bos_token_id", "image_token_id"):
            v = getattr(self, key)
            if v is not None and not 0 <= v < self.vocab_size:
                raise bad(key, v, f"0..vocab_size-1={self.vocab_size - 1}")
        if not self.eos_token_ids:
            raise bad("eos_token_id", None, "at least one EOS id")
        for v in self.eos_token_ids:
            if not isinstance(v, int) or not 0 <= v < self.vocab_size:
                raise bad("eos_token_id", v, f"ids in 0..vocab_size-1={self.vocab_size - 1}")
        return self

    # ---- HF config.json <-> GemmaConfig ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "GemmaConfig":
        """Read a `DiffusionGemmaConfig` exactly as transformers 5.23 saves it (nested `text_config`).

        Mirrors transformers' own defaults and conversions: `layer_types` defaults to 5 sliding : 1 full and the last
        layer is forced to full attention; full layers take their head_dim / kv heads from `per_layer_config`
        (what `save_pretrained` writes) or else from `global_head_dim` (512) / `num_global_key_value_heads`.
        EOS / pad: from a `generation_config.json` beside the file when it names them (what transformers' `generate`
        uses), else from `text_config`. Everything dblock does not implement is a ConfigError naming the key.
        """
        validate.require_object(d, source)
        if d.get("model_type") != "diffusion_gemma":
            raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not 'diffusion_gemma'")
        tc = d.get("text_config")
        if not isinstance(tc, dict):
            raise ConfigError(f"{source}: missing key 'text_config' (an object, as transformers saves it)")
        src = f"{source} text_config"
        validate.check_keys(d, GEMMA_TOP_KEYS, source)
        validate.check_keys(tc, GEMMA_TEXT_KEYS, src)   # types and ranges, before any value is used

        def req(k):
            if tc.get(k) is None:
                raise ConfigError(f"{src}: missing key {k!r}")
            return tc[k]

        def unsupported(key, value, allowed):
            return ConfigError(f"{src}: unsupported {key}={validate.short_repr(value, 200)} (allowed: {allowed})")

        n_layers = req("num_hidden_layers")
        layer_types = tc.get("layer_types")
        if layer_types is None:  # transformers' default pattern: every 6th layer is full
            # the list has n_layers entries: bound the model first (full layers counted with the smallest head
            # dims, a lower bound whatever per_layer_config says; validate() checks the exact count)
            sizes = {k: req(k) for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                         "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts")}
            sizes.update(num_hidden_layers=n_layers, global_head_dim=1, num_global_key_value_heads=1,
                         n_full=_default_full_layers(n_layers),
                         tie_word_embeddings=validate.opt(d, "tie_word_embeddings", True))
            validate.check_plausible(src, sizes, validate.gemma_params, validate.gemma_tensors,
                                     validate.GEMMA_SIZE_KEYS)
            layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
        layer_types = list(layer_types)
        if len(layer_types) != n_layers:
            raise unsupported("layer_types", layer_types, f"a list of num_hidden_layers={n_layers} entries")
        if layer_types and layer_types[-1] != FULL:  # transformers forces this (with a warning); so do we
            layer_types[-1] = FULL
        if tc.get("use_bidirectional_attention") not in (None, "vision"):
            raise unsupported("use_bidirectional_attention", tc["use_bidirectional_attention"],
                              "null, vision (text tokens stay causal in the encoder)")
        if tc.get("attention_bias", False):
            raise unsupported("attention_bias", True, "false")
        for k in ("enable_moe_block",):
            if k in tc and not tc[k]:
                raise unsupported(k, tc[k], "true (DiffusionGemma always runs the MoE branch)")

        # full-layer overrides: `per_layer_config` as saved, else the constructor kwargs
        head_dim, kv = req("head_dim"), req("num_key_value_heads")
        g_head, g_kv = validate.opt(tc, "global_head_dim", 512), validate.opt(tc, "num_global_key_value_heads", kv)
        plc = tc.get("per_layer_config")
        if plc is not None:
            g_head, g_kv = head_dim, kv   # layers absent from per_layer_config use the global values
            seen = {}
            for key, over in plc.items():
                try:
                    i = int(key)
                except (TypeError, ValueError):
                    raise unsupported("per_layer_config key", key, "layer indices") from None
                if not 0 <= i < n_layers:
                    raise unsupported("per_layer_config key", key, f"0..{n_layers - 1}")
                if not isinstance(over, dict):
                    raise unsupported(f"per_layer_config[{key}]", over, "an object of head_dim, num_key_value_heads")
                for a in over:
                    if a not in ("head_dim", "num_key_value_heads"):
                        raise unsupported(f"per_layer_config[{key}].{a}", over[a], "head_dim, num_key_value_heads")
                validate.check_keys(over, {"head_dim": POS, "num_key_value_heads": POS}, src,
                                    prefix=f"per_layer_config[{key}].")
                if layer_types[i] == SLIDING:
                    raise unsupported(f"per_layer_config[{key}]", over, "overrides on full_attention layers only")
                seen[i] = (over.get("head_dim", head_dim), over.get("num_key_value_heads", kv))
            full = [i for i, t in enumerate(layer_types) if t == FULL]
            vals = {seen.get(i, (head_dim, kv)) for i in full}
            if len(vals) > 1:
                raise unsupported("per_layer_config", plc, "the same head_dim / kv heads on every full layer")
            if vals:
                g_head, g_kv = vals.pop()
        eos = tc.get("eos_token_id", 1)
        pad = tc.get("pad_token_id", 0)
        gen_path = os.path.join(os.path.dirname(source), "generation_config.json") if source else ""
        if gen_path and os.path.isfile(gen_path):
            g = validate.require_object(validate.read_json(gen_path), gen_path, "generation settings")
            validate.check_keys(g, {"eos_token_id": IDS_OPT, "pad_token_id": ID_OPT}, gen_path)
            eos = g["eos_token_id"] if g.get("eos_token_id") is not None else eos
            pad = g["pad_token_id"] if g.get("pad_token_id") is not None else pad
        if eos is None:
            raise ConfigError(f"{src}: eos_token_id is null; dblock needs an EOS id to stop and pad")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        if pad is None:
            pad = eos_ids[0]
        soft = tc.get("final_logit_softcapping", 30.0)
        if soft is None:
            raise unsupported("final_logit_softcapping", None, "a positive number (transformers divides by it)")
        cfg = cls(
            vocab_size=req("vocab_size"), hidden_size=req("hidden_size"), num_hidden_layers=n_layers,
            num_attention_heads=req("num_attention_heads"), num_key_value_heads=kv, head_dim=head_dim,
            global_head_dim=g_head, num_global_key_value_heads=g_kv, intermediate_size=req("intermediate_size"),
            moe_intermediate_size=req("moe_intermediate_size"), num_experts=req("num_experts"),
            top_k_experts=req("top_k_experts"), layer_types=layer_types,
            sliding_window=validate.opt(tc, "sliding_window", 512),
            rope_parameters=tc.get("rope_parameters") or default_rope_parameters(),
            rms_norm_eps=float(validate.opt(tc, "rms_norm_eps", 1e-6)), final_logit_softcapping=float(soft),
            canvas_length=validate.opt(d, "canvas_length", 256),
            tie_word_embeddings=validate.opt(d, "tie_word_embeddings", True), eos_token_ids=eos_ids,
            pad_token_id=int(pad), bos_token_id=tc.get("bos_token_id"),
            image_token_id=d.get("image_token_id", NO_IMAGE_TOKEN_ID), boi_token_id=d.get("boi_token_id"),
            eoi_token_id=d.get("eoi_token_id"),
            max_position_embeddings=validate.opt(tc, "max_position_embeddings", 131_072),
            hidden_activation=tc.get("hidden_activation", "gelu_pytorch_tanh"), vision_config=d.get("vision_config"),
            extra=dict(d), source=source)
        if cfg.image_token_id is not None and not 0 <= cfg.image_token_id < cfg.vocab_size:
            cfg.image_token_id = None  # an id outside the text vocab can never appear in a prompt
        return cfg.validate(src)

    def to_hf_dict(self) -> dict:
        """The config.json transformers writes for this model (nested text_config, per_layer_config)."""
        # full layers' overrides, written as transformers does: only the values that differ from the globals
        over = {}
        if self.global_head_dim != self.head_dim:
            over["head_dim"] = self.global_head_dim
        if self.num_global_key_value_heads != self.num_key_value_heads:
            over["num_key_value_heads"] = self.num_global_key_value_heads
        plc = {str(i): dict(over) for i, t in enumerate(self.layer_types) if t == FULL and over}
        text = {
            "model_type": "diffusion_gemma_text", "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_activation": self.hidden_activation,
            "max_position_embeddings": self.max_position_embeddings, "initializer_range": 0.02,
            "rms_norm_eps": self.rms_norm_eps, "pad_token_id": self.pad_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
            "bos_token_id": self.bos_token_id, "tie_word_embeddings": True, "rope_parameters": self.rope_parameters,
            "attention_bias": False, "attention_dropout": 0.0, "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types), "use_bidirectional_attention": None,
            "num_experts": self.num_experts, "top_k_experts": self.top_k_experts,
            "moe_intermediate_size": self.moe_intermediate_size, "per_layer_config": plc,
        }
        if self.final_logit_softcapping != 30.0:
            text["final_logit_softcapping"] = self.final_logit_softcapping
        return {
            "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
            "canvas_length": self.canvas_length, "tie_word_embeddings": self.tie_word_embeddings,
            # transformers' generate compares the prompt with image_token_id and fails on null: a model without
            # image tokens in its vocabulary writes the released model's id, outside it (read back as None)
            "image_token_id": self.image_token_id if self.image_token_id is not None else NO_IMAGE_TOKEN_ID,
            "boi_token_id": self.boi_token_id,
            "eoi_token_id": self.eoi_token_id, "initializer_range": 0.02, "text_config": text,
            "vision_config": self.vision_config if self.vision_config is not None else dict(TINY_VISION),
        }

