"""DiffusionGemma (`diffusion_gemma`): the text model, its modules and the per-request KV cache.

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

Its config is `dblock.gemma_config`, its executor `dblock.reference.gemma_executor`, its weight names
`dblock.reference.gemma_weights`.

Not implemented, refused with clear errors: image inputs (the image placeholder id in a prompt, pixel_values),
bidirectional encoders (use_bidirectional_attention="all"), RoPE types other than default / proportional.
transformers stores one `layer_scalar` per stack (they are buffers, not tied): both are kept and used.

Letter legend for shapes: B batch, L query rows, S key rows (cache + new), H hidden, N heads, G kv heads,
D head dim, E experts, K experts per token, I expert width, V vocab, T flattened tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dblock.gemma_config import SLIDING, GemmaConfig, rope_spec
from dblock.reference.llada import attention_bias, expert_rows


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
    kind, theta, p, factor = rope_spec(cfg, layer_type)   # validated: default or proportional
    D = cfg.head_dim if layer_type == SLIDING else cfg.global_head_dim
    if kind == "default":
        return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    angles = int(p * D // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float) / D))
    inv = torch.cat([inv, torch.zeros(D // 2 - angles, dtype=torch.float32)])
    return inv / factor


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
        # training only (`dblock.tasks.train_model.set_fused_attention`): the same attention through torch's fused
        # scaled_dot_product_attention; decoding always takes the explicit path below
        self.fused = False

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
        if self.fused:
            y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask[:, None], scale=1.0, enable_gqa=True)
            return self.o_proj(y.transpose(1, 2).reshape(B, L, self.n_head * self.head_dim)), k, v
        # GQA without copying K and V per query head: query head n reads kv head n // rep, so the rep query heads
        # of one kv head are stacked as rep*L rows against its keys (each score the same dot product of D terms)
        G, rep, D, S = self.n_kv, self.n_head // self.n_kv, self.head_dim, keys.shape[2]
        att = q.reshape(B, G, rep * L, D) @ keys.transpose(-2, -1)   # (B, G, rep*L, S); scale 1.0: q/k norms set it
        att = att.view(B, G, rep, L, S).add_(attention_bias(mask, att.dtype)[:, None, None])
        att = torch.softmax(att, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        y = att.view(B, G, rep * L, S) @ vals                                            # (B, G, rep*L, D)
        y = y.view(B, self.n_head, L, D).transpose(1, 2).reshape(B, L, self.n_head * D)  # (B, L, N*D)
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

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """Sum over k of w[t,k] * Expert[ids[t,k]](x[t]). Experts in ascending id order, rows ordered (k, t) --
        transformers' loop order, so fp32 sums round the same way."""
        out = torch.zeros_like(x_TH)
        tok, slot, counts = expert_rows(ids_TK, self.gate_up_proj.shape[0], k_major=True)   # k, then t
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)   # (see llada.MoE.routed: one sort)
        parts = zip(x_TH[tok].split(counts), w_TK[tok, slot, None].split(counts), tok.split(counts))
        for e, (x_e, w_e, tok_e) in enumerate(parts):
            if tok_e.numel():
                gate, up = F.linear(x_e, gate_up[e]).chunk(2, dim=-1)                  # (T_e, I) each
                y = F.linear(F.gelu(gate, approximate="tanh") * up, down[e]) * w_e
                out.index_add_(0, tok_e, y.to(out.dtype))
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
