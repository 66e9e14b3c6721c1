"""Block lifecycles over the Forward protocol: Native, Native(2C), One Block Ahead (+ ablations, Dense Mask), FlowBlock.

A schedule is a per-request state machine (`RequestRun`) that, at every iteration of the driver, says which call it
needs next — an *append* (prompt prefill, or the append pass of a committed block) or a *denoise* pass over its
in-flight blocks — and consumes the result. The driver (`drive`) batches all requests' calls into one executor call
per kind per iteration, so requests at different blocks and passes share forwards, and a request's tokens never
depend on what else is in flight. The serving engine drives the same `RequestRun`s one pass at a time.

Layouts (docs/algorithms.md §1, §3):
  grid         llada2_moe. Blocks on the absolute grid [bC, (b+1)C); the prompt's tail shares the first generated
               block (those rows are fixed, never re-decoded). Prefill = the prompt's full blocks, block-causal.
               KV path: one append pass per committed block. No-cache path: every pass recomputes the committed
               prefix as block-causal segments (the "dInfer without cache" baseline), nothing is appended.
  fullseq      llada_moe. One bidirectional segment [prompt ; every generated position] recomputed every pass;
               blocks start right after the prompt; commits happen only inside the current block.
  after_prompt diffusion_gemma. Blocks start right after the prompt; prefill and appends run the causal encoder.

In-flight blocks (index 0 = current): Native keeps one; OBA keeps a warm-up block beside the current one from the
current block's first pass; FlowBlock(W) keeps up to W, starting the next block when the newest one's readiness
reaches the gate. The current block commits when its own stop rule says so; blocks commit in order; the warm-up
block is then promoted and keeps what the schedule's `keep` set says (docs/algorithms.md §3).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dblock.decoding.params import DecodeConfig, SamplingParams
from dblock.forward import Forward, Segment, StepInput, block_causal
from dblock.decoding.samplers import MaskedBlock, block_seed, last_pass, masked_step
from dblock.decoding.stopping import Stopper, banned_ids
from dblock.trace import NULL_TRACE, TraceWriter

SCHEDULES = ("native", "native2c", "oba", "dense_mask", "flowblock",
             "drop_time", "keep_signal", "keep_tokens", "no_accept", "no_signal")
OBA_ABLATIONS = {
    # name: (kept at promotion, warm-up accepts positions, warm-up gets self-conditioning)
    "keep_all": ({"x", "z", "t"}, True, True),
    "drop_time": ({"x", "z"}, True, True),
    "keep_signal": ({"z"}, True, True),
    "keep_tokens": ({"x"}, True, True),
    "no_accept": ({"x", "z", "t"}, False, True),
    "no_signal": ({"x", "z", "t"}, True, False),
}


@dataclass
class ScheduleSpec:
    """How blocks are kept in flight. Build with `schedule_spec(name)`."""

    name: str = "native"
    window: int = 1                   # max blocks in flight
    gate: Optional[float] = None      # FlowBlock readiness gate; None = start the next block at once (OBA)
    dense_mask: bool = False          # in-flight blocks see each other (Dense Mask) instead of block-causal
    keep: frozenset = frozenset({"x", "z", "t"})  # sampler state a waiting block keeps when it becomes current
    warmup_accept: bool = True
    warmup_signal: bool = True
    width: int = 1                    # block size multiplier (Native(2C): 2)
    rng: str = "request"              # "request": one noise stream per request (HF-compatible Native);
                                      # "block": one per (request, block), so warm-up never shifts current draws


FLOWBLOCK_GATE = 0.5
"""Default FlowBlock readiness gate γ. Readiness of a block = fraction of its positions decoded (masked diffusion)
or accepted on its latest pass (uniform-state). 0.5: the next block starts once half of its predecessor is settled."""


def schedule_spec(name: str, window: Optional[int] = None, gate: Optional[float] = None) -> ScheduleSpec:
    if name == "native":
        return ScheduleSpec("native")
    if name == "native2c":
        return ScheduleSpec("native2c", width=2)
    if name in ("oba", "keep_all"):
        return ScheduleSpec("oba", window=2, rng="block")
    if name == "dense_mask":
        return ScheduleSpec("dense_mask", window=2, dense_mask=True, rng="block")
    if name in OBA_ABLATIONS:
        keep, acc, sig = OBA_ABLATIONS[name]
        return ScheduleSpec(name, window=2, keep=frozenset(keep), warmup_accept=acc, warmup_signal=sig, rng="block")
    if name == "flowblock":
        w = window or 2
        if not 2 <= w <= 4:
            raise ValueError(f"flowblock window={w}: allowed 2..4")
        g = FLOWBLOCK_GATE if gate is None else gate
        if not 0.0 <= g <= 1.0:
            raise ValueError(f"flowblock gate={g}: allowed [0, 1]")
        return ScheduleSpec(f"flowblock{w}", window=w, gate=g, rng="block")
    raise ValueError(f"schedule={name!r}: allowed {', '.join(SCHEDULES)}")


@dataclass
class Request:
    """One prompt to decode. `sampling`: this request's own sampler and stop conditions (docs/algorithms.md §2.4,
    §2.6); None = the batch's (`DecodeConfig.sampling_params()`). `seed` seeds its noise streams (§3)."""

    prompt: list
    max_new_tokens: int = 128
    seed: int = 0
    id: Any = None
    sampling: Optional[SamplingParams] = None


@dataclass
class BlockStats:
    block: int
    size: int
    passes: int                 # n_k: denoising passes as the current block
    warmup_steps: int           # passes taken before it became current
    tokens: int                 # valid tokens committed (up to and including the first stop, within max_new_tokens)
    first_pass_accepted: int    # rows accepted by the end of its first pass as current block
    first_pass_kept: int        # of those, rows whose token then is the committed one
    eos: bool = False           # the request stopped in this block (EOS, stop id or stop sequence)
    accept_pass: list = field(default_factory=list)
    kept: list = field(default_factory=list)


@dataclass
class Counters:
    """docs/counters.md counters of one request (or summed over many: see `sum_counters`)."""

    Y: int = 0                  # valid generated tokens, up to and including the first stop (EOS, stop id/sequence)
    K: int = 0                  # committed blocks
    F: int = 0                  # denoising passes (a paired / multi-block pass counts once)
    Q: int = 0                  # serving passes: F + K on cache layouts (1 prefill + K-1 appends), F on recompute
    prompt_len: int = 0
    blocks: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"Y": self.Y, "K": self.K, "F": self.F, "Q": self.Q, "prompt_len": self.prompt_len,
                "TPF": self.Y / self.Q if self.Q else 0.0,
                "passes_per_block": [b.passes for b in self.blocks],
                "warmup_steps": [b.warmup_steps for b in self.blocks]}


# ---------------------------------------------------------------------------------------------------------------
# Family step rules: what a block's sampler state is and how one pass advances it
# ---------------------------------------------------------------------------------------------------------------

class MaskedRule:
    """Masked diffusion (LLaDA families): threshold or fixed-k (docs/algorithms.md §2.1, §2.2), greedy or sampled
    (§2.4) with the request's `SamplingParams`. A sampled pass draws from the block's stateless per-pass stream,
    seeded from the block's generator (`gen.initial_seed()`)."""

    uniform = False

    def __init__(self, cfg, dec: DecodeConfig, sampling: Optional[SamplingParams] = None):
        self.mask_id, self.dec = cfg.mask_token_id, dec
        self.sampling = sampling if sampling is not None else dec.sampling_params()
        eos = getattr(cfg, "eos_token_ids", None) or (cfg.eos_token_id,)
        self.banned = banned_ids(eos, self.sampling) if self.sampling.min_tokens else ()
        self.last = last_pass(dec.rule, dec.max_steps, dec.n_steps, dec.threshold_steps)

    def new_block(self, init_tokens: torch.Tensor, fixed: torch.Tensor, gen) -> MaskedBlock:
        t = init_tokens.clone()
        t[~fixed] = self.mask_id
        seed = int(gen.initial_seed()) if gen is not None else 0
        return MaskedBlock(t, fixed.clone(), self.mask_id, seed=seed)

    def view(self, st: MaskedBlock):
        """(tokens, live, decoded, sc_logits) for a Segment."""
        return st.tokens, st.live, st.decoded, None

    def step(self, st: MaskedBlock, logits: torch.Tensor, gen, warmup: bool, accept: bool = True) -> None:
        d = self.dec
        if warmup and not accept:
            # a waiting block on a masked model decodes nothing (RequestRun.warmup_accept): it has no tokens, clock
            # or draws to advance, so it is promoted exactly as a fresh block (docs/algorithms.md §3)
            return
        if warmup:  # the warm-up clock holds at its last step: it never forces the commit-all pass
            st.passes = min(st.passes, self.last - 2)
        masked_step(st, logits, d.rule, d.threshold, d.max_steps, d.n_steps, accept=accept,
                    inclusive=d.threshold_inclusive, quota_steps=d.threshold_steps, mask_policy=d.mask_policy,
                    sampling=self.sampling, banned=self.banned)

    def decision_spec(self, st: MaskedBlock, warmup: bool, accept: bool = True):
        """What `step(st, logits, ...)` will decide from the logits of this pass, as data an executor can gate on
        (`dblock.decoding.radius`, docs/algorithms.md §4.7)."""
        from dblock.decoding.radius import masked_spec
        return masked_spec(self, st, warmup, accept)

    def done(self, st: MaskedBlock) -> bool:
        return st.done

    def final_tokens(self, st: MaskedBlock) -> torch.Tensor:
        return st.tokens

    def readiness(self, st: MaskedBlock) -> float:
        return st.readiness()

    def promote(self, st: MaskedBlock, keep: frozenset) -> MaskedBlock:
        # masked diffusion cannot revise a decoded token: tokens are always kept; "t" is the pass clock
        if "t" not in keep:
            st.passes = 0
            st.schedule = None
        return st

    def block_stats(self, st: MaskedBlock, warmup_steps: int) -> dict:
        fcp = st.first_commit_pass.clone()
        denoised = ~st.fixed
        rel = torch.where(fcp > warmup_steps, fcp - warmup_steps, torch.zeros_like(fcp))
        rel[st.fixed] = 0
        first = int((denoised & (rel <= 1)).sum())
        return dict(accept_pass=rel[denoised].tolist(), kept=[True] * int(denoised.sum()),
                    first_pass_accepted=first, first_pass_kept=first)


def make_rule(cfg, dec: DecodeConfig, sampling: Optional[SamplingParams] = None):
    if cfg.family == "diffusion_gemma":
        from dblock.decoding.entropy_bound import UniformRule
        return UniformRule(cfg, dec, sampling)
    if dec.rule == "entropy-bound":
        raise ValueError(f"rule=entropy-bound is for uniform-state models; {cfg.family} allows threshold, fixed-k")
    return MaskedRule(cfg, dec, sampling)


# ---------------------------------------------------------------------------------------------------------------
# One request's lifecycle
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class InFlight:
    index: int                  # block index (grid index on the llada2 grid; ordinal otherwise)
    start: int                  # absolute position of its first row
    state: Any                  # the rule's sampler state
    gen: Any                    # its noise generator
    passes_current: int = 0
    warmup_steps: int = 0


_block_seed = block_seed   # docs/algorithms.md §3 (kept under its old name)


class RequestRun:
    """The schedule state of one request. Drive with `pending()`, `append_input()/after_append()`,
    `denoise_input()/after_denoise(logits)` until `finished`."""

    def __init__(self, req: Request, forward: Forward, spec: ScheduleSpec, dec: DecodeConfig, rule=None):
        cfg = forward.config
        self.req, self.fwd, self.spec, self.dec, self.cfg = req, forward, spec, dec, cfg
        self.sampling = req.sampling if req.sampling is not None else dec.sampling_params()
        uniform = cfg.family == "diffusion_gemma"
        self.sampling.check_request(cfg.vocab_size, req.max_new_tokens, uniform, cfg.family)
        if uniform and dec.mask_policy != "exclude":
            raise ValueError(f"mask_policy={dec.mask_policy!r}: {cfg.family} is uniform-state and has no MASK id")
        self.rule = rule or make_rule(cfg, dec, self.sampling)
        # masked diffusion cannot revise a revealed token, so a block waiting behind the current one (OBA's warm-up
        # block and its ablations, FlowBlock's later blocks) commits nothing before promotion: the One Block Ahead
        # paper's No Accept behaviour (docs/algorithms.md §3). Uniform-state blocks follow the schedule's own flag.
        self.warmup_accept = spec.warmup_accept and self.rule.uniform
        self.C = (dec.block_size or cfg.block_size) * spec.width
        self.prompt = torch.as_tensor(list(req.prompt), dtype=torch.long)
        self.P = int(self.prompt.numel())
        if self.P == 0:
            raise ValueError("empty prompt: give at least one token")
        vocab = cfg.vocab_size
        if int(self.prompt.min()) < 0 or int(self.prompt.max()) >= vocab:
            bad = next(int(t) for t in self.prompt if not 0 <= int(t) < vocab)
            raise ValueError(f"prompt token id {bad} outside the vocabulary 0..{vocab - 1}")
        self.layout = {"llada2_moe": "grid", "llada_moe": "fullseq", "diffusion_gemma": "after_prompt"}[cfg.family]
        if self.layout == "fullseq" and spec.window > 1:
            raise ValueError(f"schedule {spec.name}: llada_moe decodes one bidirectional full sequence with no "
                             "block-causal structure to pair; OBA, Dense Mask and FlowBlock need llada2_moe or "
                             "diffusion_gemma")
        if dec.no_cache and self.layout != "grid":
            raise ValueError(f"--no-cache applies to llada2_moe's block-causal grid ({cfg.family}: "
                             + ("every pass already recomputes the sequence)" if self.layout == "fullseq"
                                else "the encoder/decoder split always caches the prefix)"))
        self.recompute = dec.no_cache or self.layout == "fullseq"
        self._eos_ids = set(getattr(cfg, "eos_token_ids", None) or (cfg.eos_token_id,))
        self.stopper = Stopper(self._eos_ids, self.sampling)
        self.end = self.P + req.max_new_tokens                 # generation region [P, end)
        if self.layout == "grid":
            self.first_block = self.P // self.C
            self.last_block = (self.end - 1) // self.C
        else:
            self.first_block = 0
            self.last_block = (req.max_new_tokens - 1) // self.C
        self.counters = Counters(prompt_len=self.P)
        self.committed = self.prompt.clone() if self.layout != "grid" else self.prompt[: self.first_block * self.C]
        self.generated: list = []                              # committed generated token ids (before truncation)
        self.inflight: list[InFlight] = []
        self.cache = None if self.recompute else forward.new_cache()
        # uniform-state Native: one stream per request (transformers' draws); masked blocks always get their own
        # per-(request, block) generator (docs/algorithms.md §2.4)
        self._gen_request = (torch.Generator().manual_seed(int(req.seed))
                             if spec.rng == "request" and self.rule.uniform else None)
        self._next_block = self.first_block
        self._pending_append: Optional[list[Segment]] = None
        self.finished = False
        self.eos_hit = False                                   # finished by a stop: EOS, a stop id or sequence
        # prefill: the prompt's committed part goes through the append path once
        if not self.recompute:
            segs = self._prefill_segments()
            if segs:
                self._pending_append = segs
        self._fill_window()

    # ---- block bookkeeping --------------------------------------------------------------------------------
    def _start(self, b: int) -> int:
        return b * self.C if self.layout == "grid" else self.P + (b - self.first_block) * self.C

    def _gen_for(self, b: int):
        if self._gen_request is not None:
            return self._gen_request
        return torch.Generator().manual_seed(block_seed(self.req.seed, b))

    def _new_block(self, b: int) -> InFlight:
        start = self._start(b)
        init = torch.zeros(self.C, dtype=torch.long)
        fixed = torch.zeros(self.C, dtype=torch.bool)
        if self.layout == "grid":  # the prompt tail shares the first generated block
            n_prompt = max(0, min(self.P - start, self.C))
            init[:n_prompt] = self.prompt[start:start + n_prompt]
            fixed[:n_prompt] = True
        gen = self._gen_for(b)
        state = self.rule.new_block(init, fixed, gen)
        if self.sampling.min_tokens:  # rows before min_tokens: EOS and stop ids suppressed (docs/algorithms.md §2.6)
            g = torch.arange(start, start + self.C) - self.P
            state.suppress = (g >= 0) & (g < self.sampling.min_tokens)
        return InFlight(b, start, state, gen)

    def _fill_window(self) -> None:
        """Start blocks while the window has room and the start policy allows."""
        while (len(self.inflight) < self.spec.window and self._next_block <= self.last_block):
            if self.inflight and self.spec.gate is not None:
                if self.rule.readiness(self.inflight[-1].state) < self.spec.gate:
                    break
            self.inflight.append(self._new_block(self._next_block))
            self._next_block += 1

    def _prefill_segments(self) -> list[Segment]:
        if self.layout == "grid":
            n_full = self.first_block
            return [self._fixed_segment(self.prompt[b * self.C:(b + 1) * self.C], b * self.C, b, "prefix")
                    for b in range(n_full)]
        return [self._fixed_segment(self.prompt, 0, -1, "prefix")]

    @staticmethod
    def _fixed_segment(tokens, start, block, role) -> Segment:
        n = tokens.numel()
        return Segment(block=block, tokens=tokens, positions=torch.arange(start, start + n),
                       live=torch.zeros(n, dtype=torch.bool), decoded=torch.ones(n, dtype=torch.bool), role=role)

    # ---- what the driver asks -----------------------------------------------------------------------------
    def pending(self) -> Optional[str]:
        if self.finished:
            return None
        return "append" if self._pending_append is not None else "denoise"

    def append_input(self) -> StepInput:
        segs = self._pending_append
        return StepInput(self.req.id, segs, block_causal(len(segs)), self.cache, meta={"kind": "append"})

    def after_append(self) -> None:
        self._pending_append = None

    def denoise_input(self) -> StepInput:
        segs, roles = [], []
        for i, f in enumerate(self.inflight):
            tokens, live, decoded, sc = self.rule.view(f.state)
            role = "current" if i == 0 else ("warmup" if self.spec.gate is None else "inflight")
            warm = i > 0
            sc_on = not (warm and not self.spec.warmup_signal)
            spec_of = getattr(self.rule, "decision_spec", None)
            decision = spec_of(f.state, warm, self.warmup_accept or not warm) if spec_of is not None else None
            segs.append(Segment(block=f.index, tokens=tokens, positions=torch.arange(f.start, f.start + self.C),
                                live=live, decoded=decoded, role=role, sc_logits=sc if sc_on else None,
                                sc_enabled=sc_on, decision=decision))
        vis = torch.ones(len(segs), len(segs), dtype=torch.bool) if self.spec.dense_mask else block_causal(len(segs))
        if self.layout == "fullseq":
            return self._fullseq_input(segs[0])
        if self.recompute:  # no-cache grid: the committed prefix rides along as block-causal segments
            prefix = [self._fixed_segment(self.committed[b * self.C:(b + 1) * self.C], b * self.C, b, "prefix")
                      for b in range(self.committed.numel() // self.C)]
            n = len(prefix) + len(segs)
            full = block_causal(n)
            full[len(prefix):, len(prefix):] = vis
            segs, vis = prefix + segs, full
        return StepInput(self.req.id, segs, vis, self.cache, pass_index=self.inflight[0].passes_current,
                         meta={"schedule": self.spec.name})

    def _fullseq_input(self, cur: Segment) -> StepInput:
        """llada_moe: [prompt ; committed ; current ; MASK ...] as one bidirectional segment."""
        total = self.P + (self.last_block - self.first_block + 1) * self.C
        tokens = torch.full((total,), self.cfg.mask_token_id, dtype=torch.long)
        tokens[: self.committed.numel()] = self.committed
        s = cur.positions[0].item()
        tokens[s:s + self.C] = cur.tokens
        live = torch.zeros(total, dtype=torch.bool)
        live[s:s + self.C] = cur.live
        decoded = torch.zeros(total, dtype=torch.bool)
        decoded[: self.committed.numel()] = True
        decoded[s:s + self.C] = cur.decoded
        seg = Segment(block=cur.block, tokens=tokens, positions=torch.arange(total), live=live, decoded=decoded,
                      role="current", decision=cur.decision)
        return StepInput(self.req.id, [seg], torch.ones(1, 1, dtype=torch.bool), None,
                         pass_index=self.inflight[0].passes_current, meta={"schedule": self.spec.name})

    def after_denoise(self, logits: list[torch.Tensor]) -> None:
        """Consume the live-row logits of every in-flight block (prefix segments return none)."""
        per_block = logits[-len(self.inflight):] if self.layout != "fullseq" else logits
        self.counters.F += 1
        for i, (f, lg) in enumerate(zip(self.inflight, per_block)):
            warm = i > 0
            accept = self.warmup_accept or not warm
            self.rule.step(f.state, lg, f.gen, warmup=warm, accept=accept)
            if warm:
                f.warmup_steps += 1
            else:
                f.passes_current += 1
        # commit in order; a promoted block that is already complete (masked diffusion: every row decoded during
        # warm-up) commits at once, without a pass of its own
        while not self.finished and self.inflight and self.rule.done(self.inflight[0].state):
            self._commit(self.inflight[0])
        if not self.finished:
            self._fill_window()

    # ---- commit -------------------------------------------------------------------------------------------
    def _commit(self, f: InFlight) -> None:
        tokens = self.rule.final_tokens(f.state)
        self.inflight.pop(0)
        self.fwd.end_block(self.req.id, f.index)
        # generated rows of this block (the grid's first block also holds prompt rows)
        lo = max(self.P - f.start, 0)
        gen_rows = tokens[lo:].tolist()
        budget = self.req.max_new_tokens - len(self.generated)
        stats = self.rule.block_stats(f.state, f.warmup_steps)
        valid = self.stopper.feed(gen_rows[:budget])      # up to and including the first stop (§2.6)
        eos = self.stopper.stopped
        self.generated.extend(gen_rows)
        self.counters.K += 1
        self.counters.Y += valid
        self.counters.blocks.append(BlockStats(
            block=f.index, size=self.C, passes=f.passes_current, warmup_steps=f.warmup_steps, tokens=valid,
            first_pass_accepted=stats["first_pass_accepted"], first_pass_kept=stats["first_pass_kept"], eos=eos,
            accept_pass=stats["accept_pass"], kept=stats["kept"]))
        self.committed = torch.cat([self.committed, tokens])
        last = eos or f.index >= self.last_block or len(self.generated) >= self.req.max_new_tokens
        if last:
            self.eos_hit = eos
            for w in self.inflight:  # the final block drops its warm-up block(s)
                self.fwd.end_block(self.req.id, w.index)
            self.inflight = []
            self.finished = True
            self.fwd.end_request(self.req.id)
            self.counters.Q = self.counters.F + (0 if self.recompute else self.counters.K)
            return
        if self.inflight:  # the next block becomes current keeping what the schedule says
            self.inflight[0].state = self.rule.promote(self.inflight[0].state, self.spec.keep)
        if not self.recompute:
            seg = self._fixed_segment(tokens, f.start, f.index, "prefix")
            self._pending_append = (self._pending_append or []) + [seg]

    # ---- results ------------------------------------------------------------------------------------------
    def output_tokens(self) -> list:
        """Generated ids up to and including the first stop (EOS, a stop id, a stop sequence; docs/algorithms.md
        §2.6), at most max_new_tokens."""
        return list(self.stopper.out)

    @property
    def stop_reason(self):
        """None (not stopped: running, or the budget ran out), else the stopping token id (EOS or a stop id) or the
        stop sequence (a tuple of ids)."""
        return self.stopper.reason

    @property
    def finish_reason(self) -> Optional[str]:
        """None while running; "stop" (EOS, stop id, stop sequence) or "length" (budget, last block) once finished."""
        if not self.finished:
            return None
        return "stop" if self.stopper.stopped else "length"


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class RunTimes:
    den_s: float = 0.0          # wall time inside denoise calls
    app_s: float = 0.0          # wall time inside prefill/append calls
    wall_s: float = 0.0         # whole run, host overhead included
    den_calls: int = 0
    app_calls: int = 0
    den_cpu_s: float = 0.0      # CPU time of this thread inside denoise calls: on a shared machine it excludes
                                # time spent waiting for a core (with one torch thread it is the work done)


def _trace_pass(trace: TraceWriter, kind: str, items: list[StepInput], wall: float, fwd: Forward) -> None:
    if not trace.enabled:
        return
    rows = sum(len(s) for it in items for s in it.segments)
    live = sum(int(s.live.sum()) for it in items for s in it.segments)
    dec = sum(int(s.decoded.sum()) for it in items for s in it.segments if s.role != "prefix")
    extra = fwd.last_pass_stats() if hasattr(fwd, "last_pass_stats") else {}
    trace.write("pass", kind=kind, requests=[it.request for it in items], batch=len(items), rows=rows,
                live=live if kind == "denoise" else 0, decoded=dec if kind == "denoise" else 0,
                cache_len=[it.cache.length if it.cache is not None else 0 for it in items],
                segments=[[[s.block, s.role, len(s)] for s in it.segments] for it in items], wall_s=wall, **extra)


def step_once(runs: list[RequestRun], fwd: Forward, times: RunTimes, trace: TraceWriter = NULL_TRACE) -> None:
    """One iteration: every request that needs an append gets it (one batched call), then every request that
    needs a denoising pass gets it (one batched call)."""
    app = [r for r in runs if r.pending() == "append"]
    if app:
        items = [r.append_input() for r in app]
        t0 = time.perf_counter()
        fwd.append(items)
        dt = time.perf_counter() - t0
        times.app_s += dt
        times.app_calls += 1
        _trace_pass(trace, "append", items, dt, fwd)
        for r in app:
            r.after_append()
    den = [r for r in runs if r.pending() == "denoise"]
    if den:
        items = [r.denoise_input() for r in den]
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fwd.denoise(items)
        dt = time.perf_counter() - t0
        times.den_cpu_s += time.thread_time() - c0
        times.den_s += dt
        times.den_calls += 1
        _trace_pass(trace, "denoise", items, dt, fwd)
        for r, lg in zip(den, out):
            r.after_denoise(lg)


def drive(runs: list[RequestRun], fwd: Forward, trace: TraceWriter = NULL_TRACE, progress=None) -> RunTimes:
    """Run every request to completion, batching their calls."""
    times = RunTimes()
    t0 = time.perf_counter()
    while any(not r.finished for r in runs):
        before = sum(r.counters.K for r in runs)
        step_once([r for r in runs if not r.finished], fwd, times, trace)
        if progress is not None:
            progress.update(sum(r.counters.K for r in runs) - before)
    times.wall_s = time.perf_counter() - t0
    for r in runs:
        _trace_request(trace, r)
    return times


def _trace_request(trace: TraceWriter, r: RequestRun) -> None:
    if not trace.enabled:
        return
    for b in r.counters.blocks:
        trace.write("block", request=r.req.id, **vars(b))
    c = r.counters
    trace.write("request", request=r.req.id, prompt_len=c.prompt_len, Y=c.Y, K=c.K, F=c.F, Q=c.Q)
