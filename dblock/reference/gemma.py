"""DiffusionGemma (`diffusion_gemma`): the text model, its reference executor and its weight I/O, in one file.

Readable dense reference, math identical to transformers 5.23 `models/diffusion_gemma/modeling_diffusion_gemma.py`
(see docs/models.md). One set of layer weights serves two stacks:

  encoder  causal Gemma-4 stack. Runs over the prompt (prefill), then over each committed canvas (one append pass
           per block), and *writes* each layer's K/V into the request's cache. Its hidden states are never used.
  decoder  the same layers over the canvas being denoised. Keys are [cache ; canvas]; the canvas attends to all of
           itself (no causal mask) and the decoder never writes the cache. Its input embedding is mixed with a
           self-conditioning signal made from the previous denoising step's (processed) logits.

One layer (both stacks):
  h   = x + post_attn_norm(Attn(in_norm(x)))
  out = h + post_ff_norm( post_ff_norm_1(MLP(pre_ff_norm(h))) + post_ff_norm_2(MoE(pre_ff_norm_2(h), route(h))) )
  out = out * layer_scalar
  Attn: q/k per-head RMSNorm (with scale) -> RoPE; v per-head RMSNorm without scale; attention scale 1.0 (the norms
        replace 1/sqrt(D)). Two layer types with their own head_dim, kv heads and RoPE:
          sliding_attention  window of `sliding_window` positions, its own v_proj, default RoPE (theta 1e4)
          full_attention     global_head_dim, num_global_key_value_heads, no v_proj: V is the raw K projection
                             (before k_norm / RoPE), "proportional" partial RoPE (theta 1e6, 25% of the dims)
  MLP:  gelu_tanh(gate(x)) * up(x) -> down, the dense branch running in parallel with the experts
  route(h): RMSNorm_noscale(h) * scale * H^-1/2 -> proj -> softmax (fp32) -> top-K -> renormalise to 1
            -> x per_expert_scale[expert]. Note: routed from h itself (the residual), experts fed pre_ff_norm_2(h).
  MoE:  fused experts gate_up_proj (E, 2I, H), down_proj (E, H, I); gelu_tanh(gate) * up.
Embedding x sqrt(H) (rounded to the weight dtype, as transformers does); final RMSNorm; LM head tied to the embedding
(unless tie_word_embeddings=False); logits = cap * tanh(z / cap) in fp32 (cap = final_logit_softcapping, 30).

Self-conditioning (decoder only): soft = softmax(prev_logits) @ E * sqrt(H) (zeros on a block's first step);
x_in = post_norm_noscale(embed(canvas) + down(gelu_tanh(gate(pre_norm(soft))) * up(pre_norm(soft)))).

Sliding windows (transformers' DynamicSlidingWindowLayer + its masks, in absolute positions). A sliding layer's cache
keeps only the last `sliding_window - 1` positions. Encoder query q sees key k iff k <= q and q - k < W. The
transformers decoder applies no window mask of its own: the canvas sees whatever the sliding cache holds (the last
W-1 positions) plus the whole canvas. Written as a rule on positions: a decoder query of a segment starting at s sees
key k iff s - k < W. Decision where transformers is silent (several segments in one denoising pass, for OBA /
FlowBlock): every segment anchors its window at its own first position, so a warm-up block sees exactly the keys
it will see once it is current (the W-1 positions before its start), and in-flight segments follow `visibility`.

Not implemented, refused with clear errors: image inputs (the image placeholder id in a prompt, pixel_values),
bidirectional encoders (use_bidirectional_attention="all"), RoPE types other than default / proportional.
transformers stores one `layer_scalar` per stack (they are buffers, not tied): both are kept and used.

Letter legend for shapes: B batch, L query rows, S key rows (cache + new), H hidden, N heads, G kv heads,
D head dim, E experts, K experts per token, I expert width, V vocab, T flattened tokens.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dblock.config import ConfigError
from dblock.forward import Forward, StepInput

SLIDING, FULL = "sliding_attention", "full_attention"


def default_rope_parameters() -> dict:
    """transformers' defaults: sliding layers plain RoPE (theta 1e4), full layers proportional RoPE on 25% of the
    dims (theta 1e6)."""
    return {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------

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

    def is_moe_layer(self, i: int) -> bool:
        return True

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.is_sliding(i) else self.global_head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.num_key_value_heads if self.is_sliding(i) else self.num_global_key_value_heads

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self, source: str = "config") -> "GemmaConfig":
        def bad(key, value, allowed):
            return ConfigError(f"{source}: unsupported {key}={value!r} (allowed: {allowed})")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "global_head_dim", "num_global_key_value_heads", "intermediate_size",
                    "moe_intermediate_size", "num_experts", "top_k_experts", "canvas_length", "sliding_window"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(key, v, "a positive integer")
        if self.sliding_window < 2:
            raise bad("sliding_window", self.sliding_window, ">= 2 (the cache keeps sliding_window - 1 positions)")
        for key in ("num_key_value_heads", "num_global_key_value_heads"):
            if self.num_attention_heads % getattr(self, key):
                raise bad(key, getattr(self, key), f"a divisor of num_attention_heads={self.num_attention_heads}")
        for key in ("head_dim", "global_head_dim"):
            if getattr(self, key) % 2:
                raise bad(key, getattr(self, key), "an even number (RoPE rotates halves)")
        if self.top_k_experts > self.num_experts:
            raise bad("top_k_experts", self.top_k_experts, f"<= num_experts={self.num_experts}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", self.layer_types, f"a list of num_hidden_layers={self.num_hidden_layers} entries")
        for t in self.layer_types:
            if t not in (SLIDING, FULL):
                raise bad("layer_types", t, f"{SLIDING}, {FULL}")
        if self.hidden_activation not in ("gelu_pytorch_tanh",):
            raise bad("hidden_activation", self.hidden_activation, "gelu_pytorch_tanh")
        if not isinstance(self.final_logit_softcapping, (int, float)) or self.final_logit_softcapping <= 0:
            raise bad("final_logit_softcapping", self.final_logit_softcapping, "a positive number")
        for t in set(self.layer_types):
            rope_inv_freq(self, t)  # raises ConfigError on unsupported RoPE parameters
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
        if d.get("model_type") != "diffusion_gemma":
            raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not 'diffusion_gemma'")
        tc = d.get("text_config")
        if not isinstance(tc, dict):
            raise ConfigError(f"{source}: missing key 'text_config' (an object, as transformers saves it)")
        src = f"{source} text_config"

        def req(k):
            if tc.get(k) is None:
                raise ConfigError(f"{src}: missing key {k!r}")
            return tc[k]

        def unsupported(key, value, allowed):
            return ConfigError(f"{src}: unsupported {key}={value!r} (allowed: {allowed})")

        n_layers = req("num_hidden_layers")
        layer_types = tc.get("layer_types")
        if layer_types is None:  # transformers' default pattern: every 6th layer is full
            layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
        layer_types = list(layer_types)
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
        g_head, g_kv = tc.get("global_head_dim", 512), tc.get("num_global_key_value_heads") or kv
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
                for a in over:
                    if a not in ("head_dim", "num_key_value_heads"):
                        raise unsupported(f"per_layer_config[{key}].{a}", over[a], "head_dim, num_key_value_heads")
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
            try:
                with open(gen_path) as f:
                    g = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{gen_path}: not valid JSON ({e})") from None
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
            sliding_window=tc.get("sliding_window", 512),
            rope_parameters=tc.get("rope_parameters") or default_rope_parameters(),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)), final_logit_softcapping=float(soft),
            canvas_length=256 if d.get("canvas_length") is None else d["canvas_length"],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), eos_token_ids=eos_ids,
            pad_token_id=int(pad), bos_token_id=tc.get("bos_token_id"),
            image_token_id=d.get("image_token_id", 258_880), boi_token_id=d.get("boi_token_id"),
            eoi_token_id=d.get("eoi_token_id"), max_position_embeddings=tc.get("max_position_embeddings", 131_072),
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
            "image_token_id": self.image_token_id, "boi_token_id": self.boi_token_id,
            "eoi_token_id": self.eoi_token_id, "initializer_range": 0.02, "text_config": text,
            "vision_config": self.vision_config if self.vision_config is not None else dict(TINY_VISION),
        }


# ---------------------------------------------------------------------------------------------------------------
# Modules, in dependency order
# ---------------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-1/2 in fp32, times weight (in fp32; no 1+w offset), cast back. `with_scale=False`:
    no weight (the v-norm, the router norm and the self-conditioning post-norm)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 for fp64 references)
        # torch.pow(., -0.5), not rsqrt: transformers' choice, kept for bitwise agreement
        y = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.to(x32.dtype)
        return y.type_as(x)


def rope_inv_freq(cfg: GemmaConfig, layer_type: str) -> torch.Tensor:
    """Inverse frequencies (D/2,) fp32 of one layer type; D = that type's head dim.

    default:       theta^(-2i/D), i < D/2 (transformers would fail on partial_rotary_factor != 1: refused).
    proportional:  the first floor(p*D/2) pairs rotate with theta^(-2i/D) -- the exponent's denominator is the
                   full D, not the rotated width -- and the remaining pairs get frequency 0 (cos 1, sin 0: they
                   pass through). Divided by `factor` (default 1).
    """
    params = (cfg.rope_parameters or {}).get(layer_type)
    where = f"rope_parameters[{layer_type!r}]"
    if not isinstance(params, dict):
        raise ConfigError(f"text_config: missing {where}")
    kind = params.get("rope_type", "default")
    theta = params.get("rope_theta", 10_000.0)
    D = cfg.head_dim if layer_type == SLIDING else cfg.global_head_dim
    p = params.get("partial_rotary_factor", 1.0)
    if kind == "default":
        if p not in (None, 1.0, 1):
            raise ConfigError(f"text_config: unsupported {where}.partial_rotary_factor={p!r} with rope_type "
                              "default (allowed: 1.0; use rope_type proportional)")
        return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    if kind == "proportional":
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"text_config: unsupported {where}.partial_rotary_factor={p!r} (allowed: [0, 1])")
        angles = int(p * D // 2)
        inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float) / D))
        inv = torch.cat([inv, torch.zeros(D // 2 - angles, dtype=torch.float32)])
        return inv / params.get("factor", 1.0)
    raise ConfigError(f"text_config: unsupported {where}.rope_type={kind!r} (allowed: default, proportional)")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions (B, L) -> cos, sin (B, L, D): the D/2 angles repeated for both halves (rotate_half layout)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)   # (B, L, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                  # (B, L, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, N, D) rotated over all D dims (zero-frequency pairs pass through); cos/sin (B, L, D)."""
    cos, sin = cos[:, :, None], sin[:, :, None]                              # (B, L, 1, D) broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """One layer's attention. Sliding layers: own v_proj. Full layers: V = the K projection (before k_norm/RoPE)."""

    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        self.sliding = cfg.is_sliding(layer)
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.layer_kv_heads(layer), \
            cfg.layer_head_dim(layer)
        H, D = cfg.hidden_size, self.head_dim
        self.q_proj = nn.Linear(H, self.n_head * D, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=False) if self.sliding else None
        self.o_proj = nn.Linear(self.n_head * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(D, cfg.rms_norm_eps, with_scale=False)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (B, L, H) -> k, v (B, G, L, D): k normed and rotated, v normed (no scale)."""
        B, L, _ = x.shape
        k_raw = self.k_proj(x).view(B, L, self.n_kv, self.head_dim)                     # (B, L, G, D)
        v_raw = self.v_proj(x).view(B, L, self.n_kv, self.head_dim) if self.v_proj is not None else k_raw
        k = apply_rope(self.k_norm(k_raw), cos, sin).transpose(1, 2)                     # (B, G, L, D)
        v = self.v_norm(v_raw).transpose(1, 2)                                           # (B, G, L, D)
        return k, v

    def forward(self, x, cos, sin, mask, past_k=None, past_v=None):
        """x (B, L, H); mask (B, L, S) bool over keys [past ; new]; past_k/v (B, G, Lc, D) or None.

        Returns the output (B, L, H) and this call's k, v (B, G, L, D) (the encoder caches them, the decoder not).
        """
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_head, self.head_dim)                      # (B, L, N, D)
        q = apply_rope(self.q_norm(q), cos, sin).transpose(1, 2)                         # (B, N, L, D)
        k, v = self.project_kv(x, cos, sin)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)                    # (B, G, S, D)
        vals = v if past_v is None else torch.cat([past_v, v], dim=2)                    # (B, G, S, D)
        rep = self.n_head // self.n_kv
        keys = keys.repeat_interleave(rep, dim=1)                                        # (B, N, S, D)
        vals = vals.repeat_interleave(rep, dim=1)                                        # (B, N, S, D)
        att = q @ keys.transpose(-2, -1)                     # (B, N, L, S); scale 1.0: q/k norms set the scale
        att = att.masked_fill(~mask[:, None], float("-inf"))
        att = torch.softmax(att, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        y = (att @ vals).transpose(1, 2).reshape(B, L, self.n_head * self.head_dim)      # (B, L, N*D)
        return self.o_proj(y), k, v


class DenseMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)): the dense branch running beside the experts in every layer."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Router(nn.Module):
    """Scaled RMSNorm -> projection -> softmax (fp32) -> top-K -> renormalise -> x per-expert scale."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        H = cfg.hidden_size
        self.k = cfg.top_k_experts
        self.root = H ** -0.5
        self.norm = RMSNorm(H, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(H, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(H))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, h_TH: torch.Tensor):
        """h (T, H) -> ids (T, K) int64, weights (T, K) fp32 (renormalised, then per-expert scaled)."""
        x = self.norm(h_TH) * self.scale * self.root
        probs = torch.softmax(self.proj(x), dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))  # (T, E)
        w, ids = torch.topk(probs, k=self.k, dim=-1)                                    # (T, K)
        w = w / w.sum(dim=-1, keepdim=True)
        return ids, w * self.per_expert_scale[ids]


class Experts(nn.Module):
    """Fused expert weights as transformers stores them: gate_up_proj (E, 2I, H) = [gate ; up], down_proj (E, H, I)."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)                   # (T_e, I) each
        return F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])       # (T_e, H)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """Sum over k of w[t,k] * Expert[ids[t,k]](x[t]). Experts in ascending id order, rows ordered (k, t) --
        transformers' loop order, so fp32 sums round the same way."""
        out = torch.zeros_like(x_TH)
        for e in ids_TK.unique().tolist():
            slot, tok = torch.where(ids_TK.T == e)                                       # (K, T) order: k, then t
            y = self.expert(e, x_TH[tok]) * w_TK[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class Layer(nn.Module):
    """One DiffusionGemma layer, shared by the encoder and the decoder (only `layer_scalar` is stored per stack)."""

    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.mlp = DenseMLP(H, cfg.intermediate_size)
        self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
        self.router = Router(cfg)
        self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.experts = Experts(cfg)
        self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        # transformers saves a layer_scalar buffer for each stack (they are not tied); both are kept and used
        self.register_buffer("layer_scalar", torch.ones(1))       # decoder
        self.register_buffer("enc_layer_scalar", torch.ones(1))   # encoder

    def moe(self, h: torch.Tensor, taps: Optional[dict] = None) -> torch.Tensor:
        """The expert branch: routed from h itself, experts fed pre_feedforward_layernorm_2(h). (B, L, H)."""
        h_TH = h.reshape(-1, h.shape[-1])                                                # (T, H)
        ids, w = self.router(h_TH)
        y = self.experts(self.pre_feedforward_layernorm_2(h_TH), ids, w)
        if taps is not None:
            taps.setdefault("routed", []).append(y.view(h.shape))
            taps.setdefault("topk_ids", []).append(ids.view(*h.shape[:-1], -1))
        return y.view(h.shape)                                                           # (B, L, H)

    def forward(self, x, cos, sin, mask, past_k=None, past_v=None, decoder=True, taps=None):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        h = x + self.post_attention_layernorm(a)
        m1 = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        m2 = self.post_feedforward_layernorm_2(self.moe(h, taps))
        out = h + self.post_feedforward_layernorm(m1 + m2)
        return out * (self.layer_scalar if decoder else self.enc_layer_scalar), k, v


class SelfConditioning(nn.Module):
    """x_in = post_norm_noscale(embed(canvas) + MLP(pre_norm(soft))), soft = softmax(prev logits) @ E * sqrt(H)."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.pre_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps, with_scale=False)

    def forward(self, inputs_embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        """inputs_embeds, soft (B, L, H) -> decoder input (B, L, H)."""
        s = self.pre_norm(soft)
        signal = self.down_proj(F.gelu(self.gate_proj(s), approximate="tanh") * self.up_proj(s))
        return self.post_norm(inputs_embeds + signal)


class GemmaModel(nn.Module):
    """DiffusionGemma's text model: `encode` writes K/V, `decode` returns final hidden states (before the final
    norm), `logits` applies norm + LM head + soft-capping in fp32."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # RoPE inverse frequencies per layer type: fixed by the config, so a plain dict (not weights, not buffers)
        with torch.device("cpu"):  # real values even when the model is built on the meta device
            self.inv_freq = {t: rope_inv_freq(cfg, t) for t in sorted(set(cfg.layer_types))}
        self.vision_weights: dict = {}   # HF vision-tower tensors carried through save/load, never used

    @property
    def embed_scale(self) -> torch.Tensor:
        """sqrt(H) rounded to the weight dtype (transformers: a buffer cast with the model; 55.5 for H=3072 in bf16)."""
        return torch.tensor(self.config.hidden_size ** 0.5).to(self.embed_tokens.weight.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) * self.embed_scale                              # (B, L, H)

    def soft_embed(self, sc_logits: torch.Tensor) -> torch.Tensor:
        """Self-conditioning soft embedding of previous-step logits (n, V) -> (n, H): softmax in fp32, cast, @ E."""
        dtype = self.embed_tokens.weight.dtype
        p = torch.softmax(sc_logits.to(dtype), dim=-1, dtype=torch.float32).to(dtype)
        return (p @ self.embed_tokens.weight) * self.embed_scale

    def rope(self, positions: torch.Tensor, dtype) -> dict:
        return {t: rope_cos_sin(positions, f, dtype) for t, f in self.inv_freq.items()}

    def _stack(self, x, positions, masks, past, decoder, taps):
        rope = self.rope(positions, x.dtype)
        new_kv = []
        for i, layer in enumerate(self.layers):
            t = self.config.layer_types[i]
            pk, pv = past[i] if past is not None else (None, None)
            x, k, v = layer(x, *rope[t], masks[t], pk, pv, decoder=decoder, taps=taps)
            new_kv.append((k, v))
        return x, new_kv

    def encode(self, tokens, positions, masks: dict, past=None, pixel_values=None):
        """Causal encoder. tokens, positions (B, L); masks: layer type -> (B, L, S) bool; past: per layer (k, v)
        (B, G, Lc, D) or None. Returns per layer this call's (k, v) (B, G, L, D) for the caller to cache."""
        if pixel_values is not None:
            raise ValueError("diffusion_gemma: image inputs (pixel_values) are not supported by dblock; "
                             "give text-only prompts")
        _, new_kv = self._stack(self.embed(tokens), positions, masks, past, decoder=False, taps=None)
        return new_kv

    def decode(self, tokens, positions, masks: dict, past=None, soft: Optional[torch.Tensor] = None, taps=None):
        """Decoder over the canvas rows. soft: (B, L, H) self-conditioning soft embeddings (None = zeros, a block's
        first step). Returns hidden states (B, L, H) before the final norm."""
        e = self.embed(tokens)
        x = self.self_conditioning(e, soft if soft is not None else torch.zeros_like(e))
        x, _ = self._stack(x, positions, masks, past, decoder=True, taps=taps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head (tied: the embedding), fp32 soft-capping cap * tanh(z / cap)."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        z = F.linear(self.norm(hidden), w).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(z / cap) * cap


# ---------------------------------------------------------------------------------------------------------------
# The reference executor
# ---------------------------------------------------------------------------------------------------------------

class GemmaCache:
    """Committed prefix of one request. Per layer k, v (G, n, D) and their absolute positions (n,). Full layers keep
    every position; sliding layers keep the last `sliding_window - 1` (transformers' DynamicSlidingWindowLayer),
    which is exactly what any later query can see."""

    def __init__(self, cfg: GemmaConfig):
        self.cfg = cfg
        n = cfg.num_hidden_layers
        self.k: list = [None] * n
        self.v: list = [None] * n
        self.pos: list = [None] * n
        self.length = 0            # positions committed (prompt + appended blocks)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=1)
            v = torch.cat([self.v[layer], v], dim=1)
            pos = torch.cat([self.pos[layer], pos])
        if self.cfg.is_sliding(layer):
            drop = max(0, pos.shape[0] - (self.cfg.sliding_window - 1))
            k, v, pos = k[:, drop:], v[:, drop:], pos[drop:]
        self.k[layer], self.v[layer], self.pos[layer] = k, v, pos

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


@dataclass
class GemmaBatch:
    """A padded batch of StepInputs. Rows of request b: [its segments' rows ; padding]."""

    tokens: torch.Tensor       # (B, L) int64
    positions: torch.Tensor    # (B, L) int64 absolute positions
    anchor: torch.Tensor       # (B, L) int64: where each row's sliding window is measured from
    new_vis: torch.Tensor      # (B, L, L) bool: row q may see new row r (segments, causality; padding sees itself)
    lens: list                 # rows per request


def build_batch(items: list[StepInput], device, encoder: bool) -> GemmaBatch:
    """Encoder (append): causal inside the run (r visible iff pos r <= pos q and visibility allows), anchor = the
    query's own position. Decoder (denoise): `visibility` between segments, full inside a segment, anchor = the
    first position of the query's segment (see the module docstring)."""
    B = len(items)
    lens = [sum(len(s) for s in it.segments) for it in items]
    L = max(lens)
    tokens = torch.zeros(B, L, dtype=torch.long, device=device)
    positions = torch.zeros(B, L, dtype=torch.long, device=device)
    anchor = torch.zeros(B, L, dtype=torch.long, device=device)
    new_vis = torch.zeros(B, L, L, dtype=torch.bool, device=device)
    for b, it in enumerate(items):
        n = lens[b]
        seg_id = torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(it.segments)])
        pos = torch.cat([s.positions for s in it.segments]).to(torch.long)
        tokens[b, :n] = torch.cat([s.tokens for s in it.segments]).to(device)
        positions[b, :n] = pos.to(device)
        vis = it.visibility.to(torch.bool)[seg_id[:, None], seg_id[None, :]]             # (n, n)
        if encoder:
            vis = vis & (pos[None, :] <= pos[:, None])
            anchor[b, :n] = pos.to(device)
        else:
            starts = torch.stack([s.positions.min() if len(s) else torch.tensor(0) for s in it.segments])
            anchor[b, :n] = starts[seg_id].to(device)
        new_vis[b, :n, :n] = vis.to(device)
        pad = torch.arange(n, L, device=device)
        new_vis[b, pad, pad] = True                     # padded rows see only themselves (no NaN), change nothing
    return GemmaBatch(tokens, positions, anchor, new_vis, lens)


def stack_past(items: list[StepInput], layer: int, ref: torch.Tensor):
    """One layer's caches, zero-padded: k, v (B, G, Sc, D), key positions (B, Sc), key valid (B, Sc)."""
    n = [0 if it.cache is None or it.cache.k[layer] is None else it.cache.k[layer].shape[1] for it in items]
    Sc = max(n)
    B = len(items)
    kpos = torch.zeros(B, Sc, dtype=torch.long, device=ref.device)
    kvalid = torch.zeros(B, Sc, dtype=torch.bool, device=ref.device)
    if Sc == 0:
        return None, None, kpos, kvalid
    ks, vs = [], []
    for b, it in enumerate(items):
        if n[b] == 0:
            k0 = next(i.cache.k[layer] for i in items if i.cache is not None and i.cache.k[layer] is not None)
            k = v = k0.new_zeros(k0.shape[0], 0, k0.shape[2])
        else:
            k, v = it.cache.k[layer], it.cache.v[layer]
            kpos[b, :n[b]] = it.cache.pos[layer].to(ref.device)
            kvalid[b, :n[b]] = True
        ks.append(F.pad(k, (0, 0, 0, Sc - n[b])))
        vs.append(F.pad(v, (0, 0, 0, Sc - n[b])))
    return torch.stack(ks), torch.stack(vs), kpos, kvalid


def layer_mask(batch: GemmaBatch, kpos, kvalid, sliding: bool, window: int) -> torch.Tensor:
    """(B, L, Sc + L) bool over keys [cache ; new rows] for one layer type.

    Worked example, W = 3, one request whose cache holds positions 0..4 (full layers: 0..4; sliding layers keep
    the last W-1 = 2: 3, 4).
      encoder, appending 5..8 (anchor = own position, causal):
        full     q5: 0..5          q8: 0..8
        sliding  q5: 3, 4, 5       q8: 6, 7, 8          (q - k < 3)
      decoder, segments current 5..6 and warm-up 7..8, visibility [[1, 0], [1, 1]] (anchor = segment start):
        full     q5, q6: 0..4, 5, 6      q7, q8: 0..4, 5..8
        sliding  q5, q6: 3, 4, 5, 6      q7, q8: 5..8   (7 - 4 = 3: position 4 is out of the warm-up's window)
    """
    cache = kvalid[:, None, :].expand(-1, batch.tokens.shape[1], -1)                     # (B, L, Sc)
    new = batch.new_vis                                                                   # (B, L, L)
    if sliding:
        cache = cache & (batch.anchor[:, :, None] - kpos[:, None, :] < window)
        new = new & (batch.anchor[:, :, None] - batch.positions[:, None, :] < window)
    return torch.cat([cache, new], dim=-1)


class GemmaReference(Forward):
    """Dense reference executor over a GemmaModel: `append` runs the causal encoder and writes the caches,
    `denoise` runs the decoder over the in-flight segments and returns fp32 soft-capped logits of live rows.

    Batching: requests are padded to the longest query run and, per layer, to the longest cache; the masks keep
    every request's rows apart, so a request's logits do not depend on what else is in the call.
    """

    name = "reference"

    def __init__(self, model: GemmaModel):
        self.model = model
        self.config = model.config

    @property
    def device(self):
        return self.model.embed_tokens.weight.device

    def new_cache(self) -> GemmaCache:
        return GemmaCache(self.config)

    def _check_prompts(self, items: list[StepInput]) -> None:
        """Refuse image placeholders in a prompt (the first append to an empty cache), before any compute.
        Canvases and committed blocks may hold any id: the model can sample the placeholder, and transformers
        then embeds it as a plain token, as we do."""
        img = self.config.image_token_id
        for it in items:
            if img is None or it.cache is None or it.cache.length > 0:
                continue
            for s in it.segments:
                if bool((s.tokens == img).any()):
                    raise ValueError(f"request {it.request!r}: prompt token {img} is DiffusionGemma's image "
                                     "placeholder; image inputs are not supported by dblock (text-only prompts)")

    def _masks_and_past(self, items, batch: GemmaBatch):
        cfg = self.config
        ref = self.model.embed_tokens.weight
        past, masks = [], {}
        for i in range(cfg.num_hidden_layers):
            k, v, kpos, kvalid = stack_past(items, i, ref)
            past.append((k, v))
            t = cfg.layer_types[i]
            if t not in masks:  # every layer of a type holds the same positions
                masks[t] = layer_mask(batch, kpos, kvalid, t == SLIDING, cfg.sliding_window)
        return past, masks

    @torch.no_grad()
    def append(self, items: list[StepInput]) -> None:
        self._check_prompts(items)
        batch = build_batch(items, self.device, encoder=True)
        past, masks = self._masks_and_past(items, batch)
        new_kv = self.model.encode(batch.tokens, batch.positions, masks, past)
        for b, it in enumerate(items):
            n = batch.lens[b]
            pos = batch.positions[b, :n]
            for layer, (k, v) in enumerate(new_kv):
                it.cache.append(layer, k[b, :, :n], v[b, :, :n], pos)
            it.cache.length += n

    @torch.no_grad()
    def hidden(self, items: list[StepInput], taps=None):
        """Decoder final hidden states (B, L, H) (before the final norm) and the row counts."""
        batch = build_batch(items, self.device, encoder=False)
        past, masks = self._masks_and_past(items, batch)
        m = self.model
        soft = torch.zeros(*batch.tokens.shape, self.config.hidden_size, dtype=m.embed_tokens.weight.dtype,
                           device=self.device)                                           # (B, L, H)
        for b, it in enumerate(items):
            off = 0
            for s in it.segments:
                if s.sc_enabled and s.sc_logits is not None:
                    soft[b, off:off + len(s)] = m.soft_embed(s.sc_logits.to(self.device))
                off += len(s)
        return m.decode(batch.tokens, batch.positions, masks, past, soft, taps), batch.lens

    @torch.no_grad()
    def denoise(self, items: list[StepInput], taps=None) -> list[list[torch.Tensor]]:
        hidden, _ = self.hidden(items, taps)
        out = []
        for b, it in enumerate(items):
            per_seg, off = [], 0
            for s in it.segments:
                rows = hidden[b, off:off + len(s)][s.live.to(hidden.device)]
                per_seg.append(self.model.logits(rows))
                off += len(s)
            out.append(per_seg)
        return out


# ---------------------------------------------------------------------------------------------------------------
# Weights: HF names <-> GemmaModel, the tiny random checkpoint
# ---------------------------------------------------------------------------------------------------------------

DEC = "model.decoder."
ENC = "model.encoder.language_model."
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")

# Per-layer parameter names shared by both stacks (HF name == our module path inside `layers.{i}`)
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2")


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


def _vision_shapes(cfg: GemmaConfig) -> dict:
    """Vision-tower keys of the folder this config came from, as optional keys with their stored shapes."""
    src = cfg.source
    if not src:
        return {}
    from safetensors import safe_open

    from dblock.weights import WeightsError, _shard_files
    folder = os.path.dirname(src)
    try:
        key_file = _shard_files(folder)
    except WeightsError:
        return {}  # read_tensors reports the folder's problem itself
    out = {}
    for k, f in key_file.items():
        if k.startswith(VISION_PREFIXES):
            with safe_open(f, "pt") as h:
                out[k + "?"] = tuple(h.get_slice(k).get_shape())
    return out


def gemma_expected(cfg: GemmaConfig) -> dict:
    """{hf_key: shape}: decoder weights (the shared set), both stacks' layer_scalar, lm_head / the encoder's own
    copies when tie_word_embeddings=False, and (optional) the folder's vision-tower tensors."""
    H, V, Id = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    shapes = {DEC + "embed_tokens.weight": (V, H), DEC + "norm.weight": (H,),
              DEC + "self_conditioning.pre_norm.weight": (H,),
              DEC + "self_conditioning.gate_proj.weight": (Id, H), DEC + "self_conditioning.up_proj.weight": (Id, H),
              DEC + "self_conditioning.down_proj.weight": (H, Id)}
    for i in range(cfg.num_hidden_layers):
        for name, shape in _layer_shapes(cfg, i).items():
            shapes[f"{DEC}layers.{i}.{name}"] = shape
            if not cfg.tie_word_embeddings:
                shapes[f"{ENC}layers.{i}.{name}"] = shape
        shapes[f"{DEC}layers.{i}.layer_scalar"] = (1,)
        shapes[f"{ENC}layers.{i}.layer_scalar"] = (1,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
        shapes[ENC + "embed_tokens.weight"] = (V, H)
        shapes[ENC + "norm.weight"] = (H,)   # the encoder's final norm: its output feeds nothing in generation
    shapes.update(_vision_shapes(cfg))
    return shapes


_SC_NAMES = ("self_conditioning.pre_norm.weight", "self_conditioning.gate_proj.weight",
             "self_conditioning.up_proj.weight", "self_conditioning.down_proj.weight")


def gemma_build(cfg: GemmaConfig, t: dict) -> GemmaModel:
    """HF tensors -> GemmaModel. With tie_word_embeddings=False transformers keeps separate encoder weights; dblock
    runs one shared set, so they must equal the decoder's (else a WeightsError naming the first differing key)."""
    from dblock.weights import WeightsError

    src = os.path.dirname(cfg.source) if cfg.source else "model folder"
    with torch.device("meta"):
        model = GemmaModel(cfg)
    sd = {"embed_tokens.weight": t[DEC + "embed_tokens.weight"], "norm.weight": t[DEC + "norm.weight"]}
    for name in _SC_NAMES:
        sd[name] = t[DEC + name]
    for i in range(cfg.num_hidden_layers):
        for name in _layer_shapes(cfg, i):
            sd[f"layers.{i}.{name}"] = t[f"{DEC}layers.{i}.{name}"]
            if not cfg.tie_word_embeddings:
                enc = t[f"{ENC}layers.{i}.{name}"]
                if not torch.equal(enc, sd[f"layers.{i}.{name}"]):
                    raise WeightsError(f"{src}: key {ENC + f'layers.{i}.' + name!r} differs from the decoder's "
                                       f"{DEC}layers.{i}.{name}: dblock runs one weight set for the encoder and "
                                       "the decoder (tie_word_embeddings=False with different stacks is unsupported)")
        sd[f"layers.{i}.layer_scalar"] = t[f"{DEC}layers.{i}.layer_scalar"]
        sd[f"layers.{i}.enc_layer_scalar"] = t[f"{ENC}layers.{i}.layer_scalar"]
    if not cfg.tie_word_embeddings:
        if not torch.equal(t[ENC + "embed_tokens.weight"], sd["embed_tokens.weight"]):
            raise WeightsError(f"{src}: key {ENC + 'embed_tokens.weight'!r} differs from the decoder's embedding: "
                               "dblock runs one weight set for the encoder and the decoder")
        sd["lm_head.weight"] = t["lm_head.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    model.vision_weights = {k: v for k, v in t.items() if k.startswith(VISION_PREFIXES)}
    return model.eval()


def gemma_export(model: GemmaModel) -> dict:
    """GemmaModel -> HF tensors, as transformers' save_pretrained writes them (tied ones once)."""
    cfg = model.config
    sd = model.state_dict()
    out = {DEC + "embed_tokens.weight": sd["embed_tokens.weight"], DEC + "norm.weight": sd["norm.weight"]}
    for name in _SC_NAMES:
        out[DEC + name] = sd[name]
    for i in range(cfg.num_hidden_layers):
        for name in _layer_shapes(cfg, i):
            out[f"{DEC}layers.{i}.{name}"] = sd[f"layers.{i}.{name}"]
            if not cfg.tie_word_embeddings:
                out[f"{ENC}layers.{i}.{name}"] = sd[f"layers.{i}.{name}"].clone()
        out[f"{DEC}layers.{i}.layer_scalar"] = sd[f"layers.{i}.layer_scalar"]
        out[f"{ENC}layers.{i}.layer_scalar"] = sd[f"layers.{i}.enc_layer_scalar"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
        out[ENC + "embed_tokens.weight"] = sd["embed_tokens.weight"].clone()
        out[ENC + "norm.weight"] = sd["norm.weight"].clone()
    out.update(model.vision_weights)
    return out


def _register() -> None:
    from dblock.weights import FAMILY_IO, FamilyIO
    FAMILY_IO["diffusion_gemma"] = FamilyIO(gemma_expected, gemma_build, gemma_export)


_register()

# A vision tower small enough to ride along in tiny checkpoints, so transformers loads them with no missing key.
TINY_VISION = dict(
    model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=8, patch_size=2, position_embedding_size=8, pooling_kernel_size=3,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
    initializer_range=0.02, max_position_embeddings=131072, standardize=False, use_clipped_linears=False,
    rope_parameters={"rope_theta": 100.0, "rope_type": "axial"},
)


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


def save_gemma(model: GemmaModel, out: str) -> str:
    """Write config.json + model.safetensors (+ generation_config.json naming EOS / pad, so transformers'
    `generate` stops and pads as dblock does) -- a folder `DiffusionGemmaForBlockDiffusion.from_pretrained` loads."""
    from dblock.weights import save
    cfg = model.config
    gen = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
           "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids),
           "transformers_version": "5.23.0"}
    save(model, out, extra_files={"generation_config.json": json.dumps(gen, indent=2)})
    return out
