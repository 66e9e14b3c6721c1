"""The LLaDA2.0 (`llada2_moe`) and LLaDA-MoE (`llada_moe`) transformers, all of it in this one file.

Readable dense reference: no Triton, no torch.distributed, no caching tricks beyond the exact prefix KV cache.
Math follows the HF remote code of both families (see docs/models.md):

  h = x + Attn(RMSNorm(x));  x = h + FFN(RMSNorm(h))       pre-norm block, final RMSNorm, separate lm_head
  Attn: fused QKV (llada2) or q/k/v (llada_moe) -> per-head RMSNorm of q and k -> partial NeoX RoPE -> GQA softmax
  FFN:  SwiGLU dense MLP in the first `first_k_dense_replace` layers, MoE after (routed experts + shared expert)
  Router llada2_moe: sigmoid scores s; choice b = s + expert_bias; group-limited top-K of b; weights = s at the
         chosen experts, renormalised to 1, x routed_scaling_factor.
  Router llada_moe:  softmax over all experts; top-K; the probabilities are the weights (no renorm, no scaling).

Internal parameter names are family-neutral (experts stacked as (E, I, H) tensors so the optimized executor can run
grouped kernels over the very same tensors); `dblock.weights` maps them to and from the HF names.

Letter legend for shapes: B batch, L query rows, S key rows (cache + new), H hidden, N heads, G kv heads,
D head dim, E experts, K experts per token, I expert width, V vocab, T flattened tokens.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dblock.config import ModelConfig


def up32(dtype: torch.dtype) -> torch.dtype:
    """The precision numerically sensitive steps run in: fp32, or fp64 when the model itself is fp64 (references)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) computed in fp32 (fp64 for fp64 models), cast back, times weight (HF LLaDA /
    Llama convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(up32(dtype))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


_BIASES: list = []                           # [(mask, its version, dtype, bias)]: the last two additive masks made


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a boolean attention mask (B, L, S): 0 where a key is seen, -inf where not. Adding it to
    the scores is masking them bit for bit (s + 0 = s, s + -inf = -inf) and costs a tenth of a masked_fill
    broadcast over the heads. The layers of a call share their mask tensor (DiffusionGemma: one per layer type), so
    the last two made are kept, held by reference and matched by identity (never by id) and by the tensor's version
    counter (a mask changed in place is made again)."""
    global _BIASES
    for m, v, d, bias in _BIASES:
        if m is mask and v == mask._version and d == dtype:
            return bias
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    _BIASES = [(mask, mask._version, dtype, bias)] + _BIASES[:1]
    return bias


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for absolute positions (any shape P) -> (*P, rotary_dim), NeoX layout (halves repeated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                                / rotary_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq        # (*P, rotary_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)                          # (*P, rotary_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x (B, N, L, D) with NeoX rotate_half; the rest pass through."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None], sin[:, None]                            # (B, 1, L, rd) broadcast over heads
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # one fused projection for both families: rows = Q heads, then K heads, then V heads (LLaDA2 layout)
        self.wqkv = nn.Linear(cfg.hidden_size, (self.n_head + 2 * self.n_kv) * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        # training only (`dblock.tasks.train_model.set_fused_attention`): the same attention through torch's fused
        # scaled_dot_product_attention, faster with autograd; decoding always takes the explicit path below
        self.fused = False

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x (B, L, H), positions (B, L) -> q (B, N, L, D), k and v (B, G, L, D), normed and rotated."""
        B, L, _ = x.shape
        qkv = self.wqkv(x)
        q, k, v = qkv.split([self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], -1)
        q = q.view(B, L, self.n_head, self.head_dim).transpose(1, 2)  # (B, N, L, D)
        k = k.view(B, L, self.n_kv, self.head_dim).transpose(1, 2)    # (B, G, L, D)
        v = v.view(B, L, self.n_kv, self.head_dim).transpose(1, 2)    # (B, G, L, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, positions, mask, past_k=None, past_v=None):
        """x (B, L, H); mask (B, L, S) bool over keys [past ; new]; past_k/v (B, G, Lc, D) or None.

        Returns the attention output (B, L, H) and this call's new k, v (B, G, L, D) for the caller to cache.
        """
        B, L, _ = x.shape
        q, k, v = self.project_qkv(x, positions)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)     # (B, G, S, D)
        vals = v if past_v is None else torch.cat([past_v, v], dim=2)     # (B, G, S, D)
        if self.fused:
            y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask[:, None], enable_gqa=True)
            return self.wo(y.transpose(1, 2).reshape(B, L, self.n_head * self.head_dim)), k, v
        # GQA without copying K and V per query head: query head n reads kv head n // rep, so the rep query heads
        # of one kv head are stacked as rep*L rows against its keys (each score the same dot product of D terms)
        G, rep, D, S = self.n_kv, self.n_head // self.n_kv, self.head_dim, keys.shape[2]
        att = (q.reshape(B, G, rep * L, D) @ keys.transpose(-2, -1)).to(up32(q.dtype))  # (B, G, rep*L, S) fp32
        att = att.view(B, G, rep, L, S).div_(math.sqrt(D)).add_(attention_bias(mask, att.dtype)[:, None, None])
        att = torch.softmax(att, dim=-1).to(vals.dtype)
        y = att.view(B, G, rep * L, S) @ vals                              # (B, G, rep*L, D)
        y = y.view(B, self.n_head, L, D).transpose(1, 2).reshape(B, L, self.n_head * D)  # (B, L, N*D)
        return self.wo(y), k, v


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def route_llada2(router_logits: torch.Tensor, expert_bias: torch.Tensor, cfg: ModelConfig):
    """LLaDA2 gate: (T, E) fp32 logits -> ids (T, K) int64, weights (T, K) fp32.

    The expert bias shifts the *choice* only; the weights come from the unbiased sigmoid scores. Groups are ranked
    by the sum of their two best choice scores; experts outside the kept groups cannot be chosen (-inf).
    """
    T, E = router_logits.shape
    s = torch.sigmoid(router_logits)                                       # (T, E)
    b = s + expert_bias if expert_bias is not None else s                  # choice scores
    if cfg.n_group > 1:
        grouped = b.view(T, cfg.n_group, E // cfg.n_group)                 # (T, n_group, E/n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)               # (T, n_group)
        keep = group_score.topk(cfg.topk_group, dim=-1).indices            # (T, topk_group)
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(T, E)
        b = b.masked_fill(~expert_mask, float("-inf"))
    ids = b.topk(cfg.num_experts_per_tok, dim=-1).indices                  # (T, K)
    w = s.gather(1, ids)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


def route_llada_moe(router_logits: torch.Tensor, expert_bias: Optional[torch.Tensor], cfg: ModelConfig):
    """LLaDA-MoE gate: softmax over all experts, top-K; the (biased, if a bias exists) probabilities are the weights."""
    p = torch.softmax(router_logits, dim=-1)                               # (T, E)
    if expert_bias is not None:
        p = p + expert_bias
    w, ids = p.topk(cfg.num_experts_per_tok, dim=-1)                       # (T, K)
    return ids, w


def expert_rows(ids_TK: torch.Tensor, n_experts: int, k_major: bool) -> tuple:
    """(token, slot, counts): the (t, k) entries of `ids_TK` grouped by expert in ascending id order -- `tok[i]`,
    `slot[i]` the i-th entry, `counts[e]` how many chose expert e (a list, for `Tensor.split`). Within an expert the
    entries keep (t, k) order, or (k, t) order with `k_major` (transformers' DiffusionGemma loop)."""
    T, K = ids_TK.shape
    flat = (ids_TK.T if k_major else ids_TK).reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    if k_major:
        return order % T, order // T, counts
    return order // K, order % K, counts


class MoE(nn.Module):
    """Routed experts (stacked weights) + optional shared expert, with the family's router."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.cfg = cfg
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, I, H))
        self.w_up = nn.Parameter(torch.empty(E, I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        # the bias is a buffer in fp32, as the HF checkpoints store it
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32) if cfg.use_expert_bias else None)
        n_sh = cfg.num_shared_experts
        self.shared = DenseMLP(H, I * n_sh) if n_sh else None

    def router_logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        acc = up32(x_TH.dtype)                                              # fp32 as both HF gates (fp64 refs: fp64)
        return F.linear(x_TH.to(acc), self.gate.weight.to(acc))             # (T, E)

    def route(self, x_TH: torch.Tensor):
        logits = self.router_logits(x_TH)
        if self.cfg.score_function == "sigmoid":
            return route_llada2(logits, self.expert_bias, self.cfg)
        return route_llada_moe(logits, self.expert_bias, self.cfg)


    def routed(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """Sum over k of w[t,k] * Expert[ids[t,k]](x[t]): one pass per expert over the tokens that chose it, experts
        in ascending id order, each expert's rows in (t, k) order. One stable sort finds every expert's rows (the
        same rows in the same order as scanning `ids == e` per expert, so the sums round alike), and the weights are
        unbound once: backward then stacks the experts' gradients instead of adding a zero-filled (E, I, H) tensor
        per expert and weight (a training step 1.18x faster: BENCHMARKS.md, "Training: one sort finds every expert's
        rows")."""
        acc = up32(x_TH.dtype)
        out = torch.zeros(x_TH.shape, dtype=acc, device=x_TH.device)
        tok, slot, counts = expert_rows(ids_TK, self.cfg.num_experts, k_major=False)
        w_gate, w_up, w_down = self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0)
        parts = zip(x_TH[tok].split(counts), w_TK[tok, slot, None].split(counts), tok.split(counts))
        for e, (x_e, w_e, tok_e) in enumerate(parts):
            if tok_e.numel():
                y = F.linear(F.silu(F.linear(x_e, w_gate[e])) * F.linear(x_e, w_up[e]), w_down[e])
                out.index_add_(0, tok_e, y.to(acc) * w_e)
        return out.to(x_TH.dtype)

    def forward(self, x: torch.Tensor, taps: Optional[dict] = None) -> torch.Tensor:
        shape = x.shape
        x_TH = x.reshape(-1, shape[-1])                                     # (T, H)
        ids, w = self.route(x_TH)
        y = self.routed(x_TH, ids, w)
        if taps is not None:
            taps.setdefault("routed", []).append(y.view(shape))
            taps.setdefault("topk_ids", []).append(ids.view(*shape[:-1], -1))
        if self.shared is not None:
            y = y + self.shared(x_TH)
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoE(cfg) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, mask, past_k=None, past_v=None, taps=None):
        a, k, v = self.attn(self.attn_norm(x), positions, mask, past_k, past_v)
        h = x + a
        m = self.mlp(self.mlp_norm(h), taps) if self.is_moe else self.mlp(self.mlp_norm(h))
        return h + m, k, v


class LladaModel(nn.Module):
    """Both LLaDA families. `forward` maps tokens to final hidden states; `logits` applies norm + lm_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens, positions, mask, past=None, taps=None):
        """tokens, positions (B, L); mask (B, L, Lc + L) bool; past: per layer (k, v) each (B, G, Lc, D) or None.

        Returns final hidden states (B, L, H) (before the final norm) and per layer this call's (k, v).
        """
        x = self.embed(tokens)                                              # (B, L, H)
        new_kv = []
        for i, layer in enumerate(self.layers):
            pk, pv = past[i] if past is not None else (None, None)
            x, k, v = layer(x, positions, mask, pk, pv, taps)
            new_kv.append((k, v))
        return x, new_kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, returned in fp32 (decisions are made in fp32; fp64 models keep fp64)."""
        z = self.lm_head(self.norm(hidden))
        return z.to(up32(z.dtype))
