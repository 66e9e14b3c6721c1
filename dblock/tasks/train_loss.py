"""The llada2_moe training objective of `dblock train-tiny`: LLaDA's SFT loss under the BD3-LM mask
(`diffusion_loss`), with One Block Ahead's warm-up view for the noisy-context option (`noisy_context_mask`), and
DeepSeek-V3's aux-loss-free expert load balancing (`expert_loads`, `update_expert_bias`, `balance_stats`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dblock.tasks.bd3 import bd3_mask


def noisy_context_mask(L: int, C: int, warm: torch.Tensor) -> torch.Tensor:
    """(B, 2L, 2L) BD3 masks where, in example b, the noisy block `warm[b]` (>= 1; -1: none) gets One Block Ahead's
    warm-up view: it sees the NOISY block warm[b] - 1 (its x_t rows, which see only the clean blocks before them, as
    the current block does) instead of the clean one, as the warm-up block sees the still-masked current block
    (docs/algorithms.md, One Block Ahead). Every other block keeps the plain BD3 view."""
    base = bd3_mask(L, C)
    B = warm.shape[0]
    if not bool((warm >= 1).any()):
        return base[None].expand(B, 2 * L, 2 * L)
    idx = torch.arange(2 * L)
    half, blk = idx // L, (idx % L) // C
    row_warm = (half[None, :] == 0) & (blk[None, :] == warm[:, None])                    # (B, 2L) query rows
    prev = blk[None, :] == blk[:, None] - 1                                              # (2L, 2L)
    swap_in = prev & (half[None, :] == 0)                                                # keys: noisy prev block
    swap_out = prev & (half[None, :] == 1)                                               # keys: clean prev block
    warm_view = (base & ~swap_out) | swap_in
    return torch.where(row_warm[:, :, None], warm_view[None], base[None])


def _prompt_blocks(prompt: torch.Tensor, C: int) -> int:
    """How many leading blocks of C are prompt in every example of the batch (prompt: (B, L) bool)."""
    first_answer = torch.where(prompt.all(1), prompt.shape[1], (~prompt).int().argmax(1))
    return int(first_answer.min()) // C


def diffusion_loss(model, x0, xt, masked, p, prompt, taps=None, warm=None, block_size=None, trim=True):
    """LLaDA SFT loss with the BD3 mask: mean over examples of sum_masked CE/p / answer-region length.
    `warm` (B,) long: per example the block trained with the warm-up view (`noisy_context_mask`), -1 none.
    `block_size`: the BD3 block of this step (default the model's; see `block_size_at`). `trim`: leave out the noisy
    copies of the blocks that are all prompt (the same loss and gradient; False runs the whole [x_t ; x_0])."""
    B, L = x0.shape
    C = block_size or model.config.block_size
    # The noisy copy of a block that is prompt in every example is attended only by itself and carries no loss:
    # leaving it out of the forward changes no output row (the prompt-heavy exec batches run a quarter fewer rows).
    # Only the expert-load taps differ: they no longer count those duplicate prompt rows.
    d = _prompt_blocks(prompt, C) * C if trim and warm is None else 0
    tokens = torch.cat([xt[:, d:], x0], dim=1)                            # (B, 2L - d)
    positions = torch.cat([torch.arange(d, L), torch.arange(L)])[None].expand(B, 2 * L - d)
    if warm is None:
        mask = bd3_mask(L, C)[d:, d:][None].expand(B, 2 * L - d, 2 * L - d)
    else:
        mask = noisy_context_mask(L, C, warm)
    hidden, _ = model(tokens, positions, mask, taps=taps)
    rows = hidden[:, :L - d][masked[:, d:]]                               # (M, H) masked noisy rows
    logits = model.logits(rows)                                           # (M, V) fp32
    ce = F.cross_entropy(logits, x0[masked], reduction="none")            # (M,)
    ex = masked.nonzero(as_tuple=True)[0]                                 # example of each masked row
    w = 1.0 / (p[ex] * (~prompt).sum(1).clamp(min=1)[ex].float())         # 1/p / answer-region length
    loss = (ce * w).sum() / B
    with torch.no_grad():
        acc = (logits.argmax(-1) == x0[masked]).float().mean() if ce.numel() else torch.tensor(0.0)
        raw = ce.mean() if ce.numel() else torch.tensor(0.0)
    return loss, {"ce": float(raw), "acc": float(acc), "masked": int(masked.sum())}


# ---------------------------------------------------------------------------------------------------------------
# expert load balancing
# ---------------------------------------------------------------------------------------------------------------

def expert_loads(model, taps: dict) -> torch.Tensor:
    """(n_moe_layers, E) int64 counts of (token, expert) assignments of the last forward."""
    E = model.config.num_experts
    return torch.stack([torch.bincount(ids.reshape(-1), minlength=E) for ids in taps.get("topk_ids", [])])


def update_expert_bias(model, loads: torch.Tensor, u: float) -> None:
    """DeepSeek-V3 aux-loss-free update: bias_e += u * sign(mean load - load_e), per MoE layer."""
    if u <= 0:
        return
    moes = [layer.mlp for layer in model.layers if layer.is_moe]
    with torch.no_grad():
        for moe, load in zip(moes, loads):
            load = load.float()
            moe.expert_bias += u * torch.sign(load.mean() - load)


def balance_stats(loads: torch.Tensor) -> dict:
    """Per MoE layer: max/mean load and coefficient of variation, from (n_layers, E) counts."""
    loads = loads.double()
    mean = loads.mean(1, keepdim=True).clamp(min=1e-12)
    frac = loads / loads.sum(1, keepdim=True).clamp(min=1e-12)
    return {"max_over_mean": [round(float(x), 3) for x in (loads.max(1).values / mean[:, 0])],
            "min_over_mean": [round(float(x), 3) for x in (loads.min(1).values / mean[:, 0])],
            "cv": [round(float(x), 3) for x in (loads.std(1) / mean[:, 0])],
            "fraction": [[round(float(v), 4) for v in row] for row in frac]}
