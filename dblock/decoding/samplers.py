"""Step rules for masked diffusion (docs/algorithms.md §2.1, §2.2, §2.4, §2.5): pure functions over the logits of a
block's live positions, plus the masked block's sampler state.

One pass of a masked block (`masked_step`):

  z      = decision logits: fp32, or fp64 when the model computes in fp64 (§2); EOS and the stop ids at -inf on
           rows before `min_tokens` (§2.6); the MASK id at -inf under mask_policy "exclude" (§2.5)
  x̂, c   = greedy: argmax z, softmax(z)[x̂]; sampled (T > 0, §2.4): z / T -> top-k -> top-p -> probs,
           x̂ drawn by inverse CDF from one uniform per row, c = probs[x̂] (LLaDA2.0's confidence)
  commit = the rule on c: threshold (§2.1, optionally with LLaDA2.0's steps quota) or fixed-k (§2.2), among the
           eligible rows (mask_policy "ineligible": rows with x̂ = MASK are not); ties -> the lowest position
  write  = committed rows take x̂; a committed x̂ = MASK (mask_policy "official") leaves the row live, as upstream

The uniform-state entropy-bound rule (§2.3) lives with DiffusionGemma in `dblock.decoding.entropy_bound`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dblock.decoding.params import MASK_POLICIES, SamplingParams

_M64 = (1 << 64) - 1


@dataclass
class StepDecision:
    """What a step rule decided for the live rows it was given (all tensors (n_live,), row order kept)."""

    tokens: torch.Tensor   # int64 predicted (or sampled) token per live row
    commit: torch.Tensor   # bool: commit this row now
    conf: torch.Tensor     # confidence of the predicted token (fp32; fp64 for fp64 logits)
    eligible: Optional[torch.Tensor] = None  # bool: rows the rule could commit (mask_policy "ineligible")


# ---------------------------------------------------------------------------------------------------------------
# decision logits, prediction, sampling
# ---------------------------------------------------------------------------------------------------------------

def decision_dtype(dtype: torch.dtype) -> torch.dtype:
    """Decisions run in fp32, or in fp64 when the logits are fp64 (distinct fp64 confidences stay distinct)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def decision_logits(logits: torch.Tensor, mask_id: int, mask_policy: str = "exclude",
                    banned: tuple = (), banned_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(n, V) logits -> a fresh (n, V) tensor in the decision dtype, with the MASK column at -inf under "exclude"
    and the `banned` ids at -inf on the rows flagged by `banned_rows` (min_tokens)."""
    z = logits.detach().to(decision_dtype(logits.dtype), copy=True)
    if banned and banned_rows is not None and bool(banned_rows.any()):
        rows = banned_rows.to(z.device).nonzero(as_tuple=True)[0]
        cols = torch.as_tensor(banned, dtype=torch.long, device=z.device)
        z[rows[:, None], cols[None, :]] = float("-inf")
    if mask_policy == "exclude":
        z[:, mask_id] = float("-inf")
    elif mask_policy not in MASK_POLICIES:
        raise ValueError(f"mask_policy={mask_policy!r}: allowed {', '.join(MASK_POLICIES)}")
    return z


def greedy(z: torch.Tensor):
    """(n, V) decision logits -> argmax token (ties -> the lowest id) and its softmax probability."""
    p = torch.softmax(z, dim=-1)
    conf, tok = p.max(dim=-1)
    return tok, conf


def predict(logits: torch.Tensor, mask_id: int, mask_policy: str = "exclude"):
    """(n, V) logits -> greedy token (n,) and its softmax probability (n,), in the decision dtype. MASK excluded
    unless `mask_policy` says otherwise."""
    return greedy(decision_logits(logits, mask_id, mask_policy))


def filter_top_k(z: torch.Tensor, k: int) -> torch.Tensor:
    """Keep each row's k largest logits (every logit tied with the k-th stays), the rest -> -inf. 0 = off."""
    if k <= 0 or k >= z.shape[-1]:
        return z
    kth = torch.topk(z, k, dim=-1).values[..., -1:]
    return z.masked_fill(z < kth, float("-inf"))


def filter_top_p(z: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter (LLaDA2.0 / transformers): keep the smallest prefix of tokens sorted by probability
    (descending; ties by id, a stable sort) whose mass reaches p; the most likely token always stays. 1 = off."""
    if p >= 1.0:
        return z
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(torch.softmax(sorted_z, dim=-1), dim=-1)
    drop = cum > p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    mask = torch.zeros_like(drop).scatter(-1, order, drop)
    return z.masked_fill(mask, float("-inf"))


def sampling_probs(z: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """docs/algorithms.md §2.4: softmax(top_p(top_k(z / T))) in the decision dtype."""
    return torch.softmax(filter_top_p(filter_top_k(z / temperature, top_k), top_p), dim=-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One categorical draw per row from uniforms u in [0, 1): the first token whose cumulative probability
    (fp64) exceeds u · total. A token of probability 0 is never drawn."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    x = u.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]
    tok = torch.searchsorted(cdf, x[:, None].contiguous(), right=True).squeeze(-1)
    return tok.clamp_max(probs.shape[-1] - 1)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def draw_seed(block_seed: int, draw: int) -> int:
    """The seed of draw number `draw` (0, 1, ...) of a block whose generator was seeded with `block_seed`."""
    return _splitmix64((_splitmix64(int(block_seed) & _M64) + int(draw)) & _M64) >> 1


def pass_uniforms(block_seed: int, draw: int, size: int) -> torch.Tensor:
    """(size,) fp64 uniforms in [0, 1) for one sampled pass of one block: one per block row, from a CPU generator
    seeded by (block seed, draw). Stateless: the same (block, draw) always gives the same numbers, whatever else is
    in the batch, on every device, and a replay of the step (the equivalence shadow) draws the same."""
    g = torch.Generator().manual_seed(draw_seed(block_seed, draw))
    return torch.rand(size, generator=g, dtype=torch.float64)


def block_seed(seed: int, block: int) -> int:
    """The generator seed of block `block` of a request seeded with `seed` (docs/algorithms.md §3): what `RequestRun`
    seeds a per-(request, block) noise stream with."""
    return (int(seed) * 1_000_003 + 7919 * (block + 1)) % (2 ** 63 - 1)


def block_uniforms(seed: int, block: int, draw: int, size: int) -> torch.Tensor:
    """`pass_uniforms` of block `block` of a request seeded with `seed` (what `RequestRun` gives its blocks)."""
    return pass_uniforms(block_seed(seed, block), draw, size)


def sample(z: torch.Tensor, sampling: Optional[SamplingParams], u: Optional[torch.Tensor] = None):
    """(n, V) decision logits -> (tokens, conf). Greedy when `sampling` is None or its temperature is 0 (top-k and
    top-p cannot change an argmax); otherwise a draw from `sampling_probs` with uniforms `u` (n,), and the
    confidence is the drawn token's probability under that distribution (LLaDA2.0)."""
    if sampling is None or sampling.greedy:
        return greedy(z)
    probs = sampling_probs(z, sampling.temperature, sampling.top_k, sampling.top_p)
    tok = inverse_cdf(probs, u)
    return tok, probs.gather(-1, tok[:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------
# commit rules
# ---------------------------------------------------------------------------------------------------------------

def _most_confident(conf: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """bool (n,): the k most confident eligible rows (stable: ties -> the lower row)."""
    n = conf.shape[0]
    k = min(max(k, 0), int(eligible.sum()))
    commit = torch.zeros(n, dtype=torch.bool, device=conf.device)
    if k:
        order = torch.sort(conf.masked_fill(~eligible, float("-inf")), descending=True, stable=True).indices
        commit[order[:k]] = True
    return commit


def _clears(conf: torch.Tensor, tau: float, inclusive: bool) -> torch.Tensor:
    """conf > tau (upstream) or conf >= tau; tau is rounded to conf's dtype (fp32, or fp64)."""
    t = torch.tensor(tau, dtype=conf.dtype, device=conf.device)
    return conf >= t if inclusive else conf > t


def threshold_commit(conf: torch.Tensor, tau: float, inclusive: bool = False, eligible: Optional[torch.Tensor] = None,
                     quota: Optional[int] = None) -> torch.Tensor:
    """docs/algorithms.md §2.1 on confidences: the eligible rows above tau; without a quota, if none, the single most
    confident eligible row (ties -> the lowest); with a quota q (LLaDA2.0 `steps`), the max(#above, q) most
    confident eligible rows (q capped at the eligible count)."""
    if eligible is None:
        eligible = torch.ones_like(conf, dtype=torch.bool)
    above = eligible & _clears(conf, tau, inclusive)
    if quota is not None:
        return above if int(above.sum()) >= quota else _most_confident(conf, eligible, quota)
    if not bool(above.any()) and bool(eligible.any()):
        return _most_confident(conf, eligible, 1)
    return above


def threshold_rule(logits: torch.Tensor, mask_id: int, tau: float = 0.95, commit_all: bool = False,
                   inclusive: bool = False, mask_policy: str = "exclude", quota: Optional[int] = None,
                   sampling: Optional[SamplingParams] = None, u: Optional[torch.Tensor] = None) -> StepDecision:
    """docs/algorithms.md §2.1. Commit every live row with conf > tau (conf >= tau when `inclusive`); if none clears
    tau, the single most confident one (ties -> the lowest row); with `quota`, at least that many (LLaDA2.0).
    `commit_all` (the block's last pass) commits every row."""
    z = decision_logits(logits, mask_id, mask_policy)
    tok, conf = sample(z, sampling, u)
    eligible = _eligible(tok, mask_id, mask_policy)
    if commit_all:
        return StepDecision(_real_tokens(tok, z, mask_id), torch.ones_like(eligible), conf, eligible)
    return StepDecision(tok, threshold_commit(conf, tau, inclusive, eligible, quota), conf, eligible)


def transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """LLaDA `get_num_transfer_tokens`: split n_masked tokens over `steps` passes, remainder to the first ones."""
    base, rem = divmod(n_masked, steps)
    return [base + (1 if s < rem else 0) for s in range(steps)]


def fixed_k_rule(logits: torch.Tensor, mask_id: int, k: int, mask_policy: str = "exclude",
                 sampling: Optional[SamplingParams] = None, u: Optional[torch.Tensor] = None) -> StepDecision:
    """docs/algorithms.md §2.2 (LLaDA `generate.py`, low-confidence remasking): commit the k most confident live rows
    (stable order: ties -> lower row)."""
    z = decision_logits(logits, mask_id, mask_policy)
    tok, conf = sample(z, sampling, u)
    eligible = _eligible(tok, mask_id, mask_policy)
    return StepDecision(tok, _most_confident(conf, eligible, k), conf, eligible)


def _eligible(tok: torch.Tensor, mask_id: int, mask_policy: str) -> torch.Tensor:
    if mask_policy == "ineligible":
        return tok != mask_id
    return torch.ones_like(tok, dtype=torch.bool)


def _real_tokens(tok: torch.Tensor, z: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The block's last pass commits real tokens: a row predicting MASK takes its best real token instead."""
    is_mask = tok == mask_id
    if not bool(is_mask.any()):
        return tok
    zz = z[is_mask].clone()
    zz[:, mask_id] = float("-inf")
    out = tok.clone()
    out[is_mask] = zz.argmax(dim=-1)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the masked block and one pass over it
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class MaskedBlock:
    """Sampler state of one masked-diffusion block: tokens (MASK where live), and the rule's clock.

    `fixed` marks positions that were never denoised (the prompt tail sharing the first block on the LLaDA2 grid).
    `seed` is the block's noise seed and `draws` counts its sampled passes (docs/algorithms.md §2.4); `suppress`
    marks rows before `min_tokens` (docs/algorithms.md §2.6).
    """

    tokens: torch.Tensor          # (C,) int64
    fixed: torch.Tensor           # (C,) bool
    mask_id: int
    passes: int = 0               # passes this block has taken (as current or warm-up)
    schedule: list | None = None  # fixed-k: tokens per pass; threshold with a quota: the quota per pass
    first_commit_pass: torch.Tensor | None = None  # (C,) int: pass (1-based) at which each row was decoded; 0 fixed
    seed: int = 0                 # the block's noise seed (sampled passes only)
    draws: int = 0                # sampled passes so far; never reset (a promotion keeps drawing fresh numbers)
    suppress: torch.Tensor | None = None  # (C,) bool: EOS / stop ids banned on these rows (min_tokens)

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


def last_pass(rule: str, max_steps: int, steps: int, quota_steps: Optional[int] = None) -> int:
    """The pass at which a block commits everything left: threshold max_steps (or the quota's S when smaller),
    fixed-k S."""
    if rule == "threshold":
        return min(max_steps, quota_steps) if quota_steps else max_steps
    return steps


def masked_step(block: MaskedBlock, logits: torch.Tensor, rule: str, tau: float, max_steps: int, steps: int,
                accept: bool = True, *, inclusive: bool = False, quota_steps: Optional[int] = None,
                mask_policy: str = "exclude", sampling: Optional[SamplingParams] = None,
                banned: tuple = ()) -> StepDecision:
    """Advance a masked block by one pass given the logits of its live rows (in row order). Mutates `block`.

    threshold: docs/algorithms.md §2.1, the pass that reaches `max_steps` commits everything left; `quota_steps`
               (LLaDA2.0 `steps`): each pass commits at least k_s, the block size split over quota_steps passes.
    fixed-k:   docs/algorithms.md §2.2, `steps` passes, the block's masked count split evenly (remainder first).
    `sampling` with a temperature > 0 samples the tokens (§2.4), from the block's stateless per-pass stream.
    `banned` ids are suppressed on the rows `block.suppress` marks (min_tokens, §2.6).
    `accept=False` (OBA no_accept ablation) runs the rule but commits nothing.
    """
    live_idx = block.live.nonzero(as_tuple=True)[0]
    n = int(live_idx.numel())
    block.passes += 1
    final = block.passes >= last_pass(rule, max_steps, steps, quota_steps)
    rows = block.suppress[live_idx] if block.suppress is not None else None
    z = decision_logits(logits, block.mask_id, mask_policy, banned, rows)
    u = None
    if sampling is not None and not sampling.greedy:
        u = pass_uniforms(block.seed, block.draws, block.tokens.shape[0])[live_idx]
        block.draws += 1
    tok, conf = sample(z, sampling, u)
    eligible = _eligible(tok, block.mask_id, mask_policy)
    s = block.passes - 1
    if rule == "threshold":
        quota = None
        if quota_steps:
            if block.schedule is None:  # LLaDA2.0: the block length split over `steps`, capped at the live count
                block.schedule = transfer_schedule(block.tokens.shape[0], quota_steps)
            quota = block.schedule[s] if s < len(block.schedule) else 0
        commit = torch.ones(n, dtype=torch.bool) if final else \
            threshold_commit(conf, tau, inclusive, eligible, quota)
    elif rule == "fixed-k":
        if block.schedule is None:
            block.schedule = transfer_schedule(n, steps)
        k = block.schedule[s] if s < len(block.schedule) else n
        commit = torch.ones(n, dtype=torch.bool) if final else _most_confident(conf, eligible, k)
    else:
        raise ValueError(f"rule={rule!r}: masked diffusion allows threshold, fixed-k")
    commit = commit.to(tok.device)
    if final:
        tok = _real_tokens(tok, z, block.mask_id)
    d = StepDecision(tok, commit, conf, eligible)
    if accept:
        write = (commit & (tok != block.mask_id)).cpu()  # a committed MASK (mask_policy "official") stays live
        rows_w = live_idx[write]
        block.tokens[rows_w] = tok.cpu()[write]
        block.first_commit_pass[rows_w] = block.passes
    return d
