"""The entropy-bound step rule of uniform-state diffusion (docs/algorithms.md §2.3): DiffusionGemma's sampler, as a block rule.

Identical to transformers 5.23 `generation_diffusion_gemma.py` (EntropyBoundSampler, LinearTemperatureSchedule-
LogitsProcessor, StableAndConfidentStoppingCriteria, `_denoising_step`, `_finalize_canvas`) for one canvas:

  init      x = randint(0, V, (C,))                                     <- RNG draw 1 (per block)
  for n = N .. 1 (n = steps remaining):
    logits  = decoder(x, self-conditioning z)                          (fp32, soft-capped)
    T       = t_min + (t_max - t_min) * n / N                          (fp32, computed as transformers does)
    proc    = logits / T;  probs = softmax(proc) (fp32)
    prop    = multinomial(probs)                                        <- RNG draw 2 (per step)
    argmax  = argmax(proc);  H = entropy(proc)
    accept  = the longest prefix of positions sorted by H ascending with cumsum(H) - H_current <= b
    x       = where(accept, prop, randint(0, V, (C,)))                  <- RNG draw 3 (per step)
    stop    = argmax equals each of the last `stability` argmax canvases and mean(H) < e_stop
    z       = proc                                                      (the next step's self-conditioning input)
  commit    the last argmax canvas; tokens after its first EOS become pad

The block's sampler state is the explicit value `UniformBlock` = (x, z, t, σ) so schedules can promote parts of it
(docs/algorithms.md §3): x tokens, z self-conditioning logits, t steps remaining, σ stop bookkeeping (argmax history, stopped).
Every draw comes from the generator passed in (`gen`, a CPU torch.Generator; logits from any device are moved to the
CPU to sample, so a seed gives the same draws on every device). Native passes one generator per request seeded with
the request's seed, which reproduces `torch.manual_seed(seed)` + transformers' `generate` at batch 1 token for
token when transformers runs on the CPU (on CUDA it draws from the CUDA generator, a different stream).

Decisions where transformers is silent (written here, used by OBA / FlowBlock later):
  * warm-up (`step(..., warmup=True)`): the clock never runs out -- after the step n = max(n - 1, 1), so the step at
    n = 1 repeats until promotion -- and a warm-up block never stops: σ (the argmax history) is updated, but the
    stop test is not applied until the block is current.
  * `accept=False` (OBA no_accept ablation): no position is accepted, every position is re-noised; all three draws
    still happen (the stream stays aligned) and z still propagates.
  * promotion keeps what `keep` says and always resets σ: "x" dropped -> fresh uniform noise from the block's own
    generator; "z" dropped -> None (zeros); "t" dropped -> n = N. Acceptance history survives only with "x".
  * t_max == t_min (constant temperature) is allowed; transformers' config validation refuses it.
  * stop conditions (docs/algorithms.md §2.6): on rows before `min_tokens` the EOS and stop ids get logit -inf
    before the temperature (like a transformers logits processor; z carries the -inf); with `ignore_eos` the
    committed canvas is the raw argmax canvas (no pad after EOS). The masked families' token sampler (temperature,
    top-k, top-p; §2.4) does not apply: the entropy-bound rule samples with its own temperature schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from dblock.decoding.params import DecodeConfig, SamplingParams
from dblock.decoding.stopping import banned_ids


# ---------------------------------------------------------------------------------------------------------------
# Pure pieces (each one line-for-line with transformers)
# ---------------------------------------------------------------------------------------------------------------

def temperature(n: int, n_total: int, t_max: float, t_min: float) -> torch.Tensor:
    """T = t_min + (t_max - t_min) * n / N as a 0-dim fp32 tensor. transformers feeds `cur_step` as an int32 tensor,
    so n / N is a float32 division; computing it the same way keeps the processed logits bit-identical."""
    return t_min + ((t_max - t_min) * (torch.tensor(n, dtype=torch.int32) / n_total))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) entropy of softmax(logits), as torch.distributions.Categorical computes it (its argument
    check skipped: it is a third of the call, and a NaN in the logits is refused by the multinomial draw of the same
    step anyway)."""
    return torch.distributions.Categorical(logits=logits, validate_args=False).entropy()


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """(C,) entropies -> (C,) bool: the longest prefix of positions sorted by entropy (ascending) whose
    `cumsum(H) - H_current <= bound` (an upper bound on the accepted tokens' joint mutual information).

    The first (lowest-entropy) position is always accepted (0 <= bound). Worked example, bound 0.1:
      H = [0.30, 0.01, 0.05, 0.02] -> sorted 0.01, 0.02, 0.05, 0.30; cumsum - H = 0, 0.01, 0.03, 0.08
      -> all four accepted; with H[0] = 0.90: sorted ..., 0.90 -> 0.08 <= 0.1 still accepted (the test uses the
      sum of the *others*); bound 0.05 -> 0, 0.01, 0.03 accepted, 0.08 refused.
    """
    sorted_h, order = torch.sort(entropy, dim=-1, descending=False)
    ok = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound
    return torch.scatter(torch.zeros_like(ok), -1, order, ok)


def stable_and_confident(history: Optional[torch.Tensor], argmax: torch.Tensor, entropy: torch.Tensor,
                         stability: int, confidence: float):
    """transformers' StableAndConfidentStoppingCriteria for one canvas.

    history: (stability, C) previous argmax canvases (None = not started: filled with -1, never equal).
    Returns (stop: bool, new history). stability 0: always stable.
    """
    if stability == 0:
        stable = True
    else:
        if history is None:
            history = torch.full((stability, argmax.shape[-1]), -1, dtype=argmax.dtype)
        stable = bool((history == argmax[None]).all())
        history = torch.roll(history, shifts=-1, dims=0)
        history[-1] = argmax
    confident = bool(entropy.mean(-1) < confidence)
    return stable and confident, history


def pad_after_eos(tokens: torch.Tensor, eos_ids, pad_id: int) -> torch.Tensor:
    """transformers' `_finalize_canvas`: tokens after the first EOS (any of `eos_ids`) become pad; EOS stays."""
    is_eos = torch.isin(tokens, torch.as_tensor(list(eos_ids), dtype=tokens.dtype))
    c = is_eos.cumsum(-1)
    after = (c > 0) & ~((c == 1) & is_eos)
    return torch.where(after, torch.full_like(tokens, pad_id), tokens)


def transformers_tpf(generated: list, passes: int, pad_token_id: Optional[int]) -> float:
    """transformers' `_compute_tokens_per_forward` for one request: tokens of every committed canvas (whole
    canvases, after pad replacement) that are not `pad_token_id`, over its denoising passes. It differs from
    our TPF = Y / (F + K) (docs/counters.md): no append / prefill passes in the denominator, and no max_new_tokens truncation or
    stop at EOS in the numerator (an EOS counts; a genuinely generated pad id does not)."""
    n = len(generated) if pad_token_id is None else sum(1 for t in generated if t != pad_token_id)
    return n / passes if passes else 0.0


def transformers_tpf_of(result) -> list:
    """Per request transformers' TPF from a `GenerateResult` (its runs hold the committed canvases and F)."""
    return [transformers_tpf(r.generated, r.counters.F, r.cfg.pad_token_id) for r in result.runs]


# ---------------------------------------------------------------------------------------------------------------
# The block's sampler state and the rule the schedules drive
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class UniformBlock:
    """Sampler state (x, z, t, σ) of one uniform-state block, plus bookkeeping for readiness and statistics."""

    x: torch.Tensor                          # (C,) int64 current canvas (every position holds a real token)
    z: Optional[torch.Tensor]                # (C, V) fp32 previous step's processed logits; None = zeros (start)
    t: int                                   # steps remaining n; a current block is out of time at 0
    history: Optional[torch.Tensor] = None   # σ: (stability, C) previous argmax canvases (None = fresh)
    stopped: bool = False                    # σ: the stop rule fired on a current pass
    gen: Optional[torch.Generator] = field(default=None, repr=False)  # the block's noise stream (promotion)
    argmax: Optional[torch.Tensor] = None    # (C,) latest argmax canvas: what commits
    accepted: Optional[torch.Tensor] = None  # (C,) bool accepted on the latest pass
    passes: int = 0                          # passes taken (warm-up + current)
    current_passes: int = 0                  # passes taken as the current block
    held_since: Optional[torch.Tensor] = None  # (C,) int: pass (1-based, counting all passes) since which the
                                             # position has been accepted with the same token; 0 = not accepted
    first_accepted: Optional[torch.Tensor] = None  # (C,) bool accepted on its first pass as current block
    first_tokens: Optional[torch.Tensor] = None    # (C,) x right after that pass
    suppress: Optional[torch.Tensor] = None        # (C,) bool: EOS / stop ids banned on these rows (min_tokens)


class UniformRule:
    """Entropy-bound rule (docs/algorithms.md §2.3) with the block interface of `schedules.MaskedRule`."""

    uniform = True

    def __init__(self, cfg, dec: DecodeConfig, sampling: Optional[SamplingParams] = None):
        if dec.rule != "entropy-bound":
            raise ValueError(f"rule={dec.rule!r}: {cfg.family} is a uniform-state model and decodes with "
                             "rule=entropy-bound")
        self.vocab = cfg.vocab_size
        self.eos_ids = tuple(getattr(cfg, "eos_token_ids", (cfg.eos_token_id,)))
        self.pad_id = cfg.pad_token_id
        self.N = dec.n_steps
        self.bound = dec.entropy_bound
        self.t_max, self.t_min = dec.temperature
        self.stability, self.confidence = dec.stability, dec.confidence
        self.sampling = sampling if sampling is not None else dec.sampling_params()
        if not self.sampling.default_sampler:
            raise ValueError(f"temperature={self.sampling.temperature}, top_p={self.sampling.top_p}, "
                             f"top_k={self.sampling.top_k}: the masked families' sampler; {cfg.family} samples with "
                             "the entropy-bound rule's temperature schedule (DecodeConfig.temperature)")
        self.banned = banned_ids(self.eos_ids, self.sampling) if self.sampling.min_tokens else ()
        self.ignore_eos = self.sampling.ignore_eos

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def new_block(self, init_tokens: torch.Tensor, fixed: torch.Tensor, gen) -> UniformBlock:
        """Uniform noise canvas (one randint draw). `init_tokens` only gives the size: blocks start after the
        prompt, nothing is fixed."""
        if bool(fixed.any()):
            raise ValueError("uniform-state blocks have no fixed positions (blocks start right after the prompt)")
        C = init_tokens.shape[0]
        x = torch.randint(0, self.vocab, (C,), generator=gen)
        return UniformBlock(x=x, z=None, t=self.N, gen=gen, argmax=x.clone(),
                            accepted=torch.zeros(C, dtype=torch.bool), held_since=torch.zeros(C, dtype=torch.long))

    def view(self, st: UniformBlock):
        """(tokens, live, decoded, sc_logits) for a Segment: every row feeds a decision, none is decoded."""
        C = st.x.shape[0]
        return st.x, torch.ones(C, dtype=torch.bool), torch.zeros(C, dtype=torch.bool), st.z

    def step(self, st: UniformBlock, logits: torch.Tensor, gen, warmup: bool, accept: bool = True) -> None:
        """One denoising pass given the block's (C, V) fp32 logits. Mutates `st`."""
        n = max(st.t, 1)
        logits = logits.detach().float().cpu()   # sampling always runs on the CPU generator `gen`
        if self.banned and st.suppress is not None and bool(st.suppress.any()):   # min_tokens (§2.6)
            logits = logits.clone()
            rows = st.suppress.nonzero(as_tuple=True)[0]
            logits[rows[:, None], torch.as_tensor(self.banned)[None, :]] = float("-inf")
        proc = logits / temperature(n, self.N, self.t_max, self.t_min)                  # (C, V)
        probs = torch.softmax(proc, dim=-1, dtype=torch.float32)
        proposal = torch.multinomial(probs, num_samples=1, generator=gen).squeeze(-1)    # (C,)
        argmax = torch.argmax(proc, dim=-1)                                              # (C,)
        H = token_entropy(proc)                                                          # (C,)
        mask = entropy_bound_accept(H, self.bound)
        if not accept:
            mask = torch.zeros_like(mask)
        kept = torch.where(mask, proposal, st.x)
        noise = torch.randint(0, self.vocab, kept.shape, generator=gen)
        new_x = torch.where(~mask, noise, kept)
        stop, st.history = stable_and_confident(st.history, argmax, H, self.stability, self.confidence)

        st.passes += 1
        same = st.accepted & mask & (new_x == st.x)
        st.held_since = torch.where(mask, torch.where(same, st.held_since, st.passes), 0)
        st.x, st.z, st.argmax, st.accepted = new_x, proc, argmax, mask
        if warmup:
            st.t = max(n - 1, 1)
        else:
            st.t = n - 1
            st.current_passes += 1
            st.stopped = st.stopped or stop
            if st.current_passes == 1:
                st.first_accepted, st.first_tokens = mask.clone(), new_x.clone()

    def done(self, st: UniformBlock) -> bool:
        return st.current_passes > 0 and (st.stopped or st.t <= 0)

    def final_tokens(self, st: UniformBlock) -> torch.Tensor:
        """The argmax canvas, pad after its first EOS (what transformers appends to the sequence); the raw argmax
        canvas under ignore_eos."""
        if self.ignore_eos:
            return st.argmax
        return pad_after_eos(st.argmax, self.eos_ids, self.pad_id)

    def readiness(self, st: UniformBlock) -> float:
        """Fraction of positions accepted on the latest pass (0 before any pass)."""
        return float(st.accepted.float().mean()) if st.passes else 0.0

    def promote(self, st: UniformBlock, keep) -> UniformBlock:
        """The waiting block becomes current: keep x / z / t as `keep` says; σ always restarts."""
        C = st.x.shape[0]
        if "x" not in keep:
            st.x = torch.randint(0, self.vocab, (C,), generator=st.gen)
            st.accepted = torch.zeros(C, dtype=torch.bool)
            st.held_since = torch.zeros(C, dtype=torch.long)
        if "z" not in keep:
            st.z = None
        if "t" not in keep:
            st.t = self.N
        st.history, st.stopped = None, False
        return st

    def block_stats(self, st: UniformBlock, warmup_steps: int) -> dict:
        """Per-position acceptance statistics at commit (the paper's Figure 2).

        accept_pass[i]: the pass as current block (1-based) since which position i has been accepted with the
          same token until commit; 0 if that run began during warm-up and held through promotion; -1 if the
          position was not accepted on the final pass (its committed token comes from the argmax alone).
        kept[i]: that held token equals the committed token (False where accept_pass is -1).
        first_pass_accepted: positions accepted on the block's first pass as current block (warm-up included
          before it); first_pass_kept: of those, positions whose token right after that pass is the committed one.
        """
        final = self.final_tokens(st)
        since = st.held_since
        rel = torch.where(since > warmup_steps, since - warmup_steps, torch.zeros_like(since))
        rel = torch.where(since > 0, rel, torch.full_like(since, -1))
        kept = (rel >= 0) & (st.x == final)
        if st.first_accepted is None:
            fa, fk = 0, 0
        else:
            fa = int(st.first_accepted.sum())
            fk = int((st.first_accepted & (st.first_tokens == final)).sum())
        return dict(accept_pass=rel.tolist(), kept=kept.tolist(), first_pass_accepted=fa, first_pass_kept=fk)
