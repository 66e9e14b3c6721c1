"""The diffusion_gemma (uniform-state, self-conditioning) objective of `dblock train-tiny` -> `tiny-uniform`.

Layout (the `after_prompt` layout of `dblock.decoding.schedules`): canvases of C positions start right after the
prompt. One example = prompt + answer + <eos>, then <eos> up to the batch's number of canvases (trained like any
answer token, so the model learns to emit <eos>); rows of different prompt lengths are right-padded with invalid
positions that nobody sees.

One training step, everything in one set of shared weights, exactly the computation decoding runs:
  encoder  one causal pass over the clean row (sliding layers: q - k < W), as the prefill + per-canvas append passes
           compute the cache. Its final hidden states give the causal LM loss on the answer tokens (weight 1.0,
           the DiffusionGemma SFT recipe's encoder AR loss). Its K/V are the decoder's cache; gradients flow through.
  noise    per example t ~ U(1e-3, 1 - 1e-3) (stratified over the batch); every canvas token is replaced with
           probability t by a uniform draw from the whole vocabulary (the sampler's noise).
  decoder  all canvases of a row in one pass: a canvas row sees the encoder K/V of positions before its canvas
           start s (sliding layers: s - k < W, the window anchored at the canvas start as the reference executor
           does) and its own canvas (full). Self-conditioning, two passes: pass 1 without gradient and with a zero
           signal; for each example with probability 0.5 its logits feed pass 2 as the signal (else zeros); only
           pass 2 is trained.
  loss     per example mean over canvas tokens of CE(pass-2 logits, x0) (w(t) = 1, "base-sft"), averaged over the
           batch, + the encoder's causal LM loss, + `aux_coef` x the Switch load-balancing loss
           E * sum_e f_e P_e per layer (f_e: share of the top-K assignments, P_e: mean router probability) -- the
           Gemma router has no expert bias, so the aux loss is the balancing mechanism here.
  noisy context (`noisy_context` p > 0, off by default): with probability p an example's canvas j is partly noised
           in the encoder input, so canvas j + 1 learns to denoise behind a still-noisy predecessor, as One Block
           Ahead's warm-up canvas does (see `uniform_loss`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from dblock.tasks import CharTokenizer

GEMMA_SIZES = {
    # 4 layers: 3 sliding (window 32 = 2 canvases, shorter than prompt + answer) + 1 full; 8 experts top-2
    "base": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 global_head_dim=64, num_global_key_value_heads=1, intermediate_size=256, moe_intermediate_size=64,
                 num_experts=8, top_k_experts=2, sliding_window=32,
                 layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "small": dict(hidden_size=160, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                  global_head_dim=80, num_global_key_value_heads=1, intermediate_size=320, moe_intermediate_size=80,
                  num_experts=8, top_k_experts=2, sliding_window=32,
                  layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention", "full_attention"]),
    "micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  global_head_dim=16, num_global_key_value_heads=1, intermediate_size=64, moe_intermediate_size=16,
                  num_experts=8, top_k_experts=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"]),
    # the bundled code-uniform model: DiffusionGemma's routed MoE in every layer (32 experts top-4) beside the
    # parallel dense MLP, sliding (window 128) and full attention layers, the 2048-token code vocabulary
    "code": dict(hidden_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 global_head_dim=64, num_global_key_value_heads=1, intermediate_size=256, moe_intermediate_size=96,
                 num_experts=32, top_k_experts=4, sliding_window=128,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                              "full_attention"]),
    "code-micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, global_head_dim=16, num_global_key_value_heads=1, intermediate_size=64,
                       moe_intermediate_size=8, num_experts=16, top_k_experts=4, sliding_window=32,
                       layer_types=["sliding_attention", "full_attention"]),
}
# code-uniform's first three layers (two sliding, one full): fewer dependency-chain hops per forward
GEMMA_SIZES["code-3"] = dict(GEMMA_SIZES["code"], num_hidden_layers=3, layer_types=GEMMA_SIZES["code"]["layer_types"][:3])
SC_PROB = 0.5        # self-conditioning: probability that an example's pass 2 gets pass 1's logits
AUX_COEF = 0.01      # Switch load-balancing loss weight
T_EPS = 1e-3         # t ~ U(T_EPS, 1 - T_EPS)


def gemma_config(size: str = "base", block_size: int = 16, tokenizer=None):
    from dblock.gemma_config import GemmaConfig, TINY_VISION, default_rope_parameters
    if size not in GEMMA_SIZES:
        raise ValueError(f"--size {size!r}: allowed {', '.join(GEMMA_SIZES)}")
    tok = tokenizer or CharTokenizer()
    return GemmaConfig(vocab_size=tok.vocab_size, **GEMMA_SIZES[size], rope_parameters=default_rope_parameters(),
                       canvas_length=block_size, eos_token_ids=(tok.eos_id,), pad_token_id=tok.pad_id,
                       bos_token_id=tok.bos_id, image_token_id=None, max_position_embeddings=4096,
                       vision_config=dict(TINY_VISION)).validate("train-tiny diffusion_gemma config")


def init_gemma_weights(model, seed: int, std: float = 0.02) -> None:
    """N(0, std) matrices and embedding (tied LM head), output projections scaled by 1/sqrt(2 n_layers), norms and
    router scales 1, layer scalars 1. A tiny random vision tower rides along (never used) so transformers can load
    the folder."""
    from dblock.reference.gemma_tiny import tiny_vision_weights
    g = torch.Generator().manual_seed(seed)
    n = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                p.fill_(1.0)
                continue
            s = std / math.sqrt(2 * n) if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else std
            p.copy_(torch.randn(p.shape, generator=g) * s)
        model.vision_weights = tiny_vision_weights(model.config, g)


def build_gemma(cfg, tok=None):
    from dblock.reference.gemma import GemmaModel
    model = GemmaModel(gemma_config(cfg.size, cfg.block_size, tok))
    init_gemma_weights(model, cfg.seed)
    return model


# ---------------------------------------------------------------------------------------------------------------
# data and masks
# ---------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def heldout_loss(model, examples: list, tok, draws: int = 4, seed: int = 0, gen_tokens: int = 64) -> list:
    """Per-example held-out loss per token of a diffusion_gemma model on the examples' references: the mean over
    `draws` noise draws of `uniform_loss`'s canvas cross-entropy (uniform replacement noise at a random level, the
    two-pass self-conditioning; its training objective without the AR and balance terms) on [prompt ; the first
    `gen_tokens` reference tokens]. Deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    was = model.training
    model.eval()
    try:
        for e in examples:
            p = tok.encode(e.prompt)
            r = tok.encode(e.answer)[:gen_tokens]
            C = model.config.canvas_length
            r = r[:len(r) // C * C] or r
            tot = 0.0
            for _ in range(draws):
                _, info = uniform_loss(model, [(p + r, len(p))], gen, {})
                tot += info["ce"]
            out.append(tot / draws)
    finally:
        model.train(was)
    return out


def uniform_rows(rows: list, C: int, eos_id: int, pad_id: int):
    """[(ids of prompt + answer + <eos>, prompt length)] -> the batch tensors of the after-prompt layout.

    Returns x (B, Lf) clean tokens, valid (B, Lf), P (B,) prompt lengths, n_canvas: every row holds its prompt then
    n_canvas * C answer positions (answer + <eos> + <eos> padding), then invalid padding up to Lf."""
    n_canvas = max(-(-(len(ids) - P) // C) for ids, P in rows)
    La = n_canvas * C
    Lf = max(P for _, P in rows) + La
    B = len(rows)
    x = torch.full((B, Lf), pad_id, dtype=torch.long)
    valid = torch.zeros(B, Lf, dtype=torch.bool)
    P = torch.tensor([p for _, p in rows])
    for b, (ids, p) in enumerate(rows):
        x[b, :p + La] = eos_id
        x[b, :len(ids)] = torch.tensor(ids)
        valid[b, :p + La] = True
    return x, valid, P, n_canvas


def encoder_masks(valid: torch.Tensor, window: int) -> dict:
    """Causal masks (B, Lf, Lf) per layer type over a clean row; invalid rows see only themselves."""
    B, L = valid.shape
    pos = torch.arange(L)
    causal = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]                   # (B, L, L)
    eye = torch.eye(L, dtype=torch.bool)[None]
    full = causal | (eye & ~valid[:, :, None])
    sliding = (causal & ((pos[:, None] - pos[None, :]) < window)[None]) | (eye & ~valid[:, :, None])
    return {"full_attention": full, "sliding_attention": sliding}


def decoder_masks(valid: torch.Tensor, P: torch.Tensor, n_canvas: int, C: int, window: int) -> dict:
    """Masks (B, La, Lf + La) per layer type: canvas row q (canvas c, start s = P + cC) sees encoder keys k < s
    (sliding: s - k < W) and the rows of its own canvas."""
    B, Lf = valid.shape
    La = n_canvas * C
    c = torch.arange(La) // C                                                            # (La,)
    start = P[:, None] + c[None, :] * C                                                  # (B, La)
    kpos = torch.arange(Lf)
    cache = valid[:, None, :] & (kpos[None, None, :] < start[:, :, None])               # (B, La, Lf)
    new = (c[:, None] == c[None, :])[None].expand(B, La, La)                             # (B, La, La)
    slide = cache & (start[:, :, None] - kpos[None, None, :] < window)
    return {"full_attention": torch.cat([cache, new], -1), "sliding_attention": torch.cat([slide, new], -1)}


def gather_answer(x: torch.Tensor, P: torch.Tensor, La: int) -> torch.Tensor:
    """(B, Lf) -> (B, La): the canvas region [P_b, P_b + La) of each row."""
    idx = P[:, None] + torch.arange(La)[None]
    return x.gather(1, idx)


# ---------------------------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------------------------

def _router_hooks(model, store: list):
    hooks = []
    for layer in model.layers:
        hooks.append(layer.router.register_forward_hook(lambda mod, inp, out: store.append((mod, inp[0], out[0]))))
    return hooks


def switch_aux(records: list, n_experts: int, weights: Optional[list] = None) -> torch.Tensor:
    """Switch-Transformer balance loss, mean over router calls: E * sum_e f_e * P_e (f: top-K assignment share,
    P: mean router probability, recomputed from the router input with gradient)."""
    total = 0.0
    for i, (router, h, ids) in enumerate(records):
        x = router.norm(h) * router.scale * router.root
        probs = torch.softmax(router.proj(x), dim=-1, dtype=torch.float32)               # (T, E)
        w = weights[i] if weights is not None else None
        if w is not None:
            probs, ids = probs[w], ids[w]
        f = torch.bincount(ids.reshape(-1), minlength=n_experts).float() / ids.numel()
        total = total + n_experts * (f * probs.mean(0)).sum()
    return total / max(1, len(records))


def noisy_context_draw(gen: torch.Generator, P: torch.Tensor, n_canvas: int, C: int, V: int, prob: float, Lf: int):
    """Which examples see a noisy predecessor canvas, which one, and its noise (see `uniform_loss`).

    Returns (noise (B, Lf) bool: encoder-input positions replaced, draws (B, Lf) the replacement tokens, j (B,) the
    noisy canvas or -1). An example is picked with probability `prob` when it has two canvases or more; its canvas j
    is uniform in [0, n_canvas - 2] and each of its positions is replaced by a uniform token with probability
    s ~ U(0, 1) (a partly denoised canvas, as the current block is while the warm-up block works)."""
    B = P.shape[0]
    pick = torch.rand(B, generator=gen) < prob
    j = torch.randint(0, max(1, n_canvas - 1), (B,), generator=gen)
    level = torch.rand(B, generator=gen)
    draws = torch.randint(0, V, (B, Lf), generator=gen)
    u = torch.rand(B, Lf, generator=gen)
    pick &= n_canvas >= 2
    pos = torch.arange(Lf)[None]
    start = P + j * C
    noise = pick[:, None] & (pos >= start[:, None]) & (pos < (start + C)[:, None]) & (u < level[:, None])
    return noise, draws, torch.where(pick, j, torch.full_like(j, -1))


def uniform_loss(model, rows: list, gen: torch.Generator, taps: dict, noisy_context: float = 0.0):
    """One step's loss (see the module docstring). `rows`: [(ids, prompt length)]. Fills taps["topk_ids"].

    `noisy_context` p > 0 trains One Block Ahead's warm-up view (docs/algorithms.md: the warm-up block sees the
    current block while it is still noisy): with probability p an example's canvas j (of two or more) is partly
    replaced by uniform noise in the ENCODER input (`noisy_context_draw`), so canvas j + 1 is denoised behind a noisy
    predecessor. The example's loss then keeps only what that context does not corrupt: the AR targets before canvas
    j's first noisy input, the canvases <= j + 1 (later canvases would see a noisy block two back, which decoding
    never shows). p = 0 draws nothing more, so it is bit-identical to the plain loss."""

    cfg = model.config
    C, V, W = cfg.canvas_length, cfg.vocab_size, cfg.sliding_window
    x, valid, P, n_canvas = uniform_rows(rows, C, cfg.eos_token_id, cfg.pad_token_id)
    B, Lf = x.shape
    La = n_canvas * C
    positions = torch.arange(Lf)[None].expand(B, Lf)
    x_enc, j_noisy = x, None

    records: list = []
    hooks = _router_hooks(model, records)
    try:
        if noisy_context > 0:
            noise, draws, j_noisy = noisy_context_draw(gen, P, n_canvas, C, V, noisy_context, Lf)
            x_enc = torch.where(noise & valid, draws, x)
        # encoder: causal pass over the clean row (canvas j partly noisy for noisy-context examples) -> cache K/V
        # and the AR loss
        enc_hidden, kv = model._stack(model.embed(x_enc), positions, encoder_masks(valid, W), None, decoder=False,
                                      taps=None)
        n_enc = len(records)
        logits_enc = model.logits(enc_hidden[:, :-1])                                     # (B, Lf-1, V)
        tgt = x[:, 1:]
        pos_t = torch.arange(1, Lf)[None]
        ar_mask = valid[:, 1:] & (pos_t >= P[:, None])                                    # answer-region targets
        if j_noisy is not None:                     # targets whose causal input holds no noise
            first = torch.where(j_noisy >= 0, P + j_noisy * C + 1, torch.full_like(P, Lf + 1))
            ar_mask &= pos_t < first[:, None]
        ar = F.cross_entropy(logits_enc[ar_mask], tgt[ar_mask])

        # noise
        x0a = gather_answer(x, P, La)                                                     # (B, La)
        u = torch.rand((), generator=gen)
        t = T_EPS + (1 - 2 * T_EPS) * ((u + torch.arange(B, dtype=torch.float32)) / B)
        t = t[torch.randperm(B, generator=gen)]
        replace = torch.rand(B, La, generator=gen) < t[:, None]
        xt = torch.where(replace, torch.randint(0, V, (B, La), generator=gen), x0a)
        sc_on = torch.rand(B, generator=gen) < SC_PROB
        pos_a = P[:, None] + torch.arange(La)[None]                                       # (B, La)
        masks = decoder_masks(valid, P, n_canvas, C, W)

        # decoder pass 1: no gradient, zero self-conditioning
        with torch.no_grad():
            past_d = [(k.detach(), v.detach()) for k, v in kv]
            logits1 = model.logits(model.decode(xt, pos_a, masks, past_d, None))          # (B, La, V)
        del records[n_enc:]
        soft = model.soft_embed(logits1.reshape(B * La, V)).view(B, La, -1)               # (B, La, H)
        soft = soft * sc_on[:, None, None].to(soft.dtype)
        # decoder pass 2: trained
        hidden = model.decode(xt, pos_a, masks, kv, soft, taps=taps)
        logits2 = model.logits(hidden)                                                    # (B, La, V)
        ce = F.cross_entropy(logits2.reshape(-1, V), x0a.reshape(-1), reduction="none").view(B, La)
        if j_noisy is None:
            diff = ce.mean(1).mean()
        else:                                       # noisy-context examples: canvases <= j + 1 only
            keep = (j_noisy[:, None] < 0) | (torch.arange(La)[None] // C <= j_noisy[:, None] + 1)
            diff = ((ce * keep).sum(1) / keep.sum(1)).mean()
        aux = switch_aux(records, cfg.num_experts,
                         [valid.reshape(-1)] * n_enc + [None] * (len(records) - n_enc))
    finally:
        for h in hooks:
            h.remove()
    loss = diff + ar + AUX_COEF * aux
    with torch.no_grad():
        acc = (logits2.argmax(-1) == x0a)[replace].float().mean() if replace.any() else torch.tensor(0.0)
    return loss, {"ce": diff.item(), "acc": acc.item(), "ar": ar.item(), "aux": aux.item(), "L": Lf}
