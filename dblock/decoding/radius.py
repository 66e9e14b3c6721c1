"""A block's decision radius for this pass, from the logits of its live rows alone (docs/algorithms.md §4.7).

The schedule knows what a block's next step will decide (its rule, τ, LLaDA2.0's quota of this pass, fixed-k's k,
whether this is the commit-all pass); the executor knows only logits. `DecisionSpec` carries the first to the
second on the `Segment` (`Segment.decision`), as data; `block_radius` turns a spec and the row quantities of
`dblock.decoding.margins.row_stats` into the block's exact decision radius: min over its live rows of Γ*
(`threshold_margin_rows` / `fixed_k_margin_rows`, docs/algorithms.md §5). Any logits within that ∞-norm distance of
the given ones (strictly) take the same decision — the same commit set and the same committed tokens — so an
executor whose logits ẑ are known to lie within δ of the exact ones z may keep ẑ whenever the radius *at ẑ* exceeds δ
(the radius is symmetric: z is a perturbation of ẑ of norm ≤ δ), and must recompute otherwise. That is the
Epoch executor's margin-gated exact refresh (`EpochConfig.margin_refresh`).

Kinds:
  threshold   §2.1 with the block's quota of this pass (`quota`) and the commit-all pass (`commit_all`)
  fixed-k     §2.2: the k most confident rows (`k`), or every row on the last pass
  none        the step decides nothing from these logits (a masked warm-up block that does not accept): radius ∞
  opaque      no closed-form radius (sampled decoding, the MASK policies other than "exclude", uniform-state
              rules): radius 0, so a gate always recomputes (fails closed)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from dblock.decoding.samplers import last_pass, transfer_schedule

KINDS = ("threshold", "fixed-k", "none", "opaque")


@dataclass(frozen=True)
class DecisionSpec:
    """What one pass of a block's step rule decides from its live rows' logits (see the module docstring)."""

    kind: str = "opaque"
    tau: float = 0.95
    inclusive: bool = False
    quota: Optional[int] = None          # threshold: LLaDA2.0's quota of this pass (None: plain fallback of one)
    k: int = 0                           # fixed-k: rows committed this pass
    commit_all: bool = False             # the block's last pass: every live row commits
    banned: tuple = ()                   # ids at -inf on the rows `banned_rows` marks (min_tokens, §2.6)
    banned_rows: Optional[torch.Tensor] = None    # (n_live,) bool, live rows in row order; None: none

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"DecisionSpec kind={self.kind!r}: allowed {', '.join(KINDS)}")


def masked_spec(rule, st, warmup: bool, accept: bool) -> DecisionSpec:
    """The spec of `MaskedRule.step(st, ...)` on the logits about to be computed (st before the pass), mirroring
    `samplers.masked_step` and the warm-up clock of `MaskedRule.step`."""
    d = rule.dec
    if warmup and not accept:
        return DecisionSpec("none")
    if not rule.sampling.greedy or d.mask_policy != "exclude":
        return DecisionSpec("opaque")
    passes = st.passes
    if warmup:
        passes = min(passes, rule.last - 2)
    s = passes                                              # this pass's 0-based step
    final = passes + 1 >= last_pass(d.rule, d.max_steps, d.n_steps, d.threshold_steps)
    rows = None
    if rule.banned and st.suppress is not None:
        rows = st.suppress[st.live]
        if not bool(rows.any()):
            rows = None
    common = dict(commit_all=final, banned=tuple(rule.banned) if rows is not None else (), banned_rows=rows)
    if d.rule == "threshold":
        quota = None
        if d.threshold_steps:
            sched = st.schedule if st.schedule is not None else transfer_schedule(st.tokens.shape[0],
                                                                                  d.threshold_steps)
            quota = sched[s] if s < len(sched) else 0
        return DecisionSpec("threshold", tau=d.threshold, inclusive=d.threshold_inclusive, quota=quota, **common)
    if d.rule == "fixed-k":
        n = int(st.live.sum())
        sched = st.schedule if st.schedule is not None else transfer_schedule(n, d.n_steps)
        k = sched[s] if s < len(sched) else n
        return DecisionSpec("fixed-k", k=k, **common)
    return DecisionSpec("opaque")


def decision_rows(logits: torch.Tensor, mask_id: Optional[int], spec: Optional[DecisionSpec]) -> torch.Tensor:
    """The rows' decision logits as the rule sees them (float32 or wider): MASK and the spec's banned ids at −inf."""
    z = logits.detach().to(torch.float64 if logits.dtype == torch.float64 else torch.float32, copy=True)
    if spec is not None and spec.banned and spec.banned_rows is not None:
        r = spec.banned_rows.to(z.device).nonzero(as_tuple=True)[0]
        z[r[:, None], torch.as_tensor(spec.banned, dtype=torch.long, device=z.device)[None, :]] = -math.inf
    if mask_id is not None:
        z[:, mask_id] = -math.inf
    return z


def block_radius(spec: Optional[DecisionSpec], stats) -> float:
    """min Γ* over the block's live rows under `spec`, from `margins.row_stats` of its decision logits; ∞ when the
    step decides nothing, 0 when no closed form applies (`spec` None or opaque)."""
    from dblock.decoding.margins import fixed_k_margin_rows, threshold_margin_rows
    tok, gap, logp, logit = stats
    if spec is None or spec.kind == "opaque":
        return 0.0
    if spec.kind == "none" or gap.numel() == 0:
        return math.inf
    if spec.kind == "threshold":
        m = threshold_margin_rows(tok, gap, logp, logit, tau=spec.tau, commit_all=spec.commit_all,
                                  inclusive=spec.inclusive, quota=spec.quota)
    else:
        m = fixed_k_margin_rows(tok, gap, logp, logit, k=gap.numel() if spec.commit_all else spec.k)
    return float(m.gamma_exact.min())
