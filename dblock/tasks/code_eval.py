"""Quality metrics of the `code` task beyond the per-request grade: token accuracy, the held-out loss, CIs.

`summarize(records)` turns the per-request metrics that `dblock.tasks.evaluate` collects into means with 95%
bootstrap CIs over requests (`dblock.tasks.code.bootstrap_ci`). `heldout_loss(model, examples, tok)` is the model's
training objective on the held-out references, per token:

    llada2_moe  the BD3-LM masked-diffusion loss (an upper bound on the negative log-likelihood, the ELBO): for each
                example [prompt ; the first `gen_tokens` reference tokens (GEN_TOKENS = 64 for the code task; the
                exec task passes its answer budget)] on the block grid, `draws` noise levels
                t_d = (d + u) / draws (u per example, stratified), each reference token masked with probability
                p = t_d; the loss is sum over masked reference tokens of CE / p, divided by the number of reference
                tokens, averaged over the draws. Prompt rows stay clean (as at decoding time); one forward over
                [x_t ; x_0] with the BD3 mask of `dblock.tasks.bd3.bd3_mask` per draw.
    diffusion_gemma  the canvas cross-entropy of its training objective (uniform replacement noise, two-pass
                self-conditioning), averaged over the draws (`dblock.tasks.train_uniform.heldout_loss`).

Deterministic: the noise comes from a generator seeded with `seed`. The loss does not depend on the decoder (it is
the same for both executors); it tells two checkpoints apart.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dblock.tasks.code import bootstrap_ci

GEN_TOKENS = 64          # the code task's generation length (two 32-token blocks) and the loss's reference span
LOSS_DRAWS = 4


def summarize(records: list) -> dict:
    """{metric: {"mean", "ci": [lo, hi], "n"}} over requests, for the metrics present: the code task's
    next_line_exact and token_accuracy, the exec task's answer_exact and value_accuracy, and loss_per_token."""
    out = {}
    for key in ("next_line_exact", "token_accuracy", "answer_exact", "value_accuracy", "loss_per_token"):
        vals = [float(r[key]) for r in records if r.get(key) is not None]
        if vals:
            out[key] = {"mean": sum(vals) / len(vals), "ci": bootstrap_ci(vals), "n": len(vals)}
    return out


@torch.no_grad()
def heldout_loss(model, examples: list, tok, draws: int = LOSS_DRAWS, seed: int = 0, batch: int = 16,
                 gen_tokens: int = GEN_TOKENS) -> list:
    """Per-example held-out loss per token (nats) of a llada2_moe model on the examples' references (see the module
    docstring)."""
    from dblock.tasks.bd3 import bd3_mask
    cfg = model.config
    if cfg.family == "diffusion_gemma":
        from dblock.tasks import train_uniform
        return train_uniform.heldout_loss(model, examples, tok, draws=draws, seed=seed, gen_tokens=gen_tokens)
    if cfg.family != "llada2_moe":
        raise ValueError(f"heldout_loss: family {cfg.family} (llada2_moe, diffusion_gemma)")
    C, mask_id, pad = cfg.block_size, cfg.mask_token_id, cfg.eos_token_id
    rows = []
    for e in examples:
        p = tok.encode(e.prompt)
        r = tok.encode(e.answer)[:gen_tokens]
        rows.append((p, r))
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(len(rows), generator=gen)
    out = [0.0] * len(rows)
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(rows), batch):
            chunk = rows[s:s + batch]
            L = -(-max(len(p) + len(r) for p, r in chunk) // C) * C
            B = len(chunk)
            x0 = torch.full((B, L), pad, dtype=torch.long)
            scored = torch.zeros(B, L, dtype=torch.bool)
            for b, (p, r) in enumerate(chunk):
                x0[b, :len(p)] = torch.tensor(p)
                x0[b, len(p):len(p) + len(r)] = torch.tensor(r)
                scored[b, len(p):len(p) + len(r)] = True
            n_ref = scored.sum(1).clamp(min=1).double()
            positions = torch.arange(L).repeat(2)[None].expand(B, 2 * L)
            mask = bd3_mask(L, C)[None].expand(B, 2 * L, 2 * L)
            acc = torch.zeros(B, dtype=torch.float64)
            for d in range(draws):
                t = ((d + u[s:s + B]) / draws).clamp(1e-3, 1.0)                       # (B,)
                masked = (torch.rand(B, L, generator=gen) < t[:, None]) & scored
                xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
                hidden, _ = model(torch.cat([xt, x0], 1), positions, mask)
                logits = model.logits(hidden[:, :L][masked])
                ce = F.cross_entropy(logits.float(), x0[masked], reduction="none").double()
                ex = masked.nonzero(as_tuple=True)[0]
                acc.index_add_(0, ex, ce / t[ex].double())
            for b in range(B):
                out[s + b] = float(acc[b] / n_ref[b] / draws)
    finally:
        model.train(was_training)
    return out
