"""Step rules for masked diffusion (docs/algorithms.md §2.1, §2.2): pure functions over the logits of a block's live positions.

Both rules exclude the MASK id from the prediction: its logit is set to -inf before the argmax *and* before the
softmax that gives the confidence, so `conf` is the probability of the predicted token among real tokens.
(LLaDA's own decoders never predict MASK in practice; excluding it makes that a guarantee. docs/algorithms.md §5's decision
margin is computed on the same masked logits.)

The uniform-state entropy-bound rule (§2.3) lives with DiffusionGemma in `dblock.decoding.entropy_bound`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepDecision:
    """What a step rule decided for the live rows it was given (all tensors (n_live,), row order kept)."""

    tokens: torch.Tensor   # int64 predicted token per live row (argmax over real tokens)
    commit: torch.Tensor   # bool: commit this row now
    conf: torch.Tensor     # fp32 probability of the predicted token


def predict(logits: torch.Tensor, mask_id: int):
    """(n, V) logits -> argmax token (n,) and its softmax probability (n,), MASK excluded, in fp32."""
    z = logits.float().clone()
    z[:, mask_id] = float("-inf")
    p = torch.softmax(z, dim=-1)
    conf, tok = p.max(dim=-1)
    return tok, conf


def threshold_rule(logits: torch.Tensor, mask_id: int, tau: float = 0.95, commit_all: bool = False) -> StepDecision:
    """docs/algorithms.md §2.1. Commit every live row with conf >= tau; if none clears tau, the single most confident one
    (ties -> the lowest row). `commit_all` (the block reached max_steps) commits every row by argmax."""
    tok, conf = predict(logits, mask_id)
    n = tok.shape[0]
    if commit_all:
        commit = torch.ones(n, dtype=torch.bool)
    else:
        commit = conf >= tau
        if n and not commit.any():
            commit = torch.zeros(n, dtype=torch.bool)
            commit[int(torch.argmax(conf))] = True  # torch.argmax returns the first maximal index
    return StepDecision(tok, commit, conf)


def transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """LLaDA `get_num_transfer_tokens`: split n_masked tokens over `steps` passes, remainder to the first ones."""
    base, rem = divmod(n_masked, steps)
    return [base + (1 if s < rem else 0) for s in range(steps)]


def fixed_k_rule(logits: torch.Tensor, mask_id: int, k: int) -> StepDecision:
    """docs/algorithms.md §2.2 (LLaDA `generate.py`, low-confidence remasking): commit the k most confident live rows
    (stable order: ties -> lower row)."""
    tok, conf = predict(logits, mask_id)
    n = tok.shape[0]
    k = min(max(k, 0), n)
    order = torch.sort(conf, descending=True, stable=True).indices
    commit = torch.zeros(n, dtype=torch.bool)
    commit[order[:k]] = True
    return StepDecision(tok, commit, conf)


@dataclass
class MaskedBlock:
    """Sampler state of one masked-diffusion block: tokens (MASK where live), and the rule's clock.

    `fixed` marks positions that were never denoised (the prompt tail sharing the first block on the LLaDA2 grid).
    """

    tokens: torch.Tensor          # (C,) int64
    fixed: torch.Tensor           # (C,) bool
    mask_id: int
    passes: int = 0               # passes this block has taken (as current or warm-up)
    schedule: list | None = None  # fixed-k: tokens per pass
    first_commit_pass: torch.Tensor | None = None  # (C,) int: pass (1-based) at which each row was decoded; 0 fixed

    def __post_init__(self):
        if self.first_commit_pass is None:
            self.first_commit_pass = torch.where(self.fixed, 0, -1).to(torch.long)

    @property
    def live(self) -> torch.Tensor:
        return self.tokens == self.mask_id

    @property
    def decoded(self) -> torch.Tensor:
        return ~self.live

    @property
    def done(self) -> bool:
        return not bool(self.live.any())

    def readiness(self) -> float:
        """Fraction of the block's denoisable positions decoded so far (FlowBlock's gate)."""
        den = int((~self.fixed).sum())
        return 1.0 if den == 0 else float(((~self.fixed) & self.decoded).sum()) / den


def masked_step(block: MaskedBlock, logits: torch.Tensor, rule: str, tau: float, max_steps: int, steps: int,
                accept: bool = True) -> StepDecision:
    """Advance a masked block by one pass given the logits of its live rows (in row order). Mutates `block`.

    threshold: docs/algorithms.md §2.1, the pass that reaches `max_steps` commits everything left.
    fixed-k:   docs/algorithms.md §2.2, `steps` passes, the block's masked count split evenly (remainder first).
    `accept=False` (OBA no_accept ablation) runs the rule but commits nothing.
    """
    live_idx = block.live.nonzero(as_tuple=True)[0]
    block.passes += 1
    if rule == "threshold":
        d = threshold_rule(logits, block.mask_id, tau, commit_all=block.passes >= max_steps)
    elif rule == "fixed-k":
        if block.schedule is None:
            block.schedule = transfer_schedule(int(live_idx.numel()), steps)
        s = block.passes - 1
        k = block.schedule[s] if s < len(block.schedule) else int(live_idx.numel())
        if block.passes >= steps:
            k = int(live_idx.numel())
        d = fixed_k_rule(logits, block.mask_id, k)
    else:
        raise ValueError(f"rule={rule!r}: masked diffusion allows threshold, fixed-k")
    if accept:
        rows = live_idx[d.commit]
        block.tokens[rows] = d.tokens[d.commit]
        block.first_commit_pass[rows] = block.passes
    return d
