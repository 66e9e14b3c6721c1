"""Shadow (teacher-forced) comparison of an optimized executor against the dense reference (docs/algorithms.md §5).

Diverged trajectories prove nothing, so `ShadowForward` is a Forward that, at every call, runs the optimized
executor and then the reference on *exactly the same* StepInputs — same tokens, positions, masks, self-conditioning
— and returns the **optimized** logits to the schedule. The trajectory is the optimized one; every difference
measured on it is a difference of forward math on identical inputs, attributable per pass, per layer, per position.
Each side keeps its own KV cache of the same committed prefix (`append` goes to both; appends are exact on both
sides), held together in a `ShadowCache`.

Per denoising call and per segment with live rows it records:
  * ‖ẑ − z‖∞ per live row (MASK column excluded), the margins Γ (sufficient) and Γ* (exact) from the reference logits
    under the rule and the block's actual state (commit-all pass, fixed-k's k, the fallback);
  * decisions: both logits are fed to the block's own step rule on *copies* of its sampler state (the real rule
    code), and the resulting commit sets and tokens compared (entropy-bound: `margins.entropy_bound_check` under
    a copy of the block's generator);
  * per MoE layer max |Δ| of the routed-expert output (optimized tap after the cache merge vs the reference tap),
    split into rows served from the decoded-output cache and fresh rows;
  * the invariants of `invariants.py` on this pass's audit records, with absolute positions, plus the checks only
    the wrapper can make: one logits row per live row (lm-head), no block plan left after a block commits
    (block-boundary), and |U_l| recomputed from the layer's MoE input on every successful support build (coverage);
  * staleness: cosine of each served cache entry against the fresh reference output, by age; and (with
    `staleness_ages`) the cosine between a row's fresh routed output now and k passes ago, for stable decoded rows
    vs live rows (the paper's argument for M_C = 5).

When the optimized executor breaks the protocol (a live row without logits), the violation is recorded and the
reference logits are substituted for that segment so the run can go on and report everything else.

Letter legend: B requests, L padded rows per request, H hidden, V vocab, n live rows of a segment, N rows of a block.
"""
from __future__ import annotations

import copy
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from dblock.equivalence import invariants as inv
from dblock.decoding.margins import (delta_inf, entropy_bound_check, fixed_k_margin, masked64,
                                        threshold_margin)
from dblock.forward import Forward, StepInput
from dblock.decoding.samplers import last_pass, transfer_schedule


@dataclass
class ShadowCache:
    """The two executors' KV-cache handles of one request."""

    opt: Any
    ref: Any

    @property
    def length(self) -> int:               # schedules and traces read `cache.length`
        return getattr(self.ref, "length", 0)


@dataclass
class Context:
    """What the shadow needs from the schedule to replay a block's decision: its rule and sampler state."""

    rule: Any                 # MaskedRule or UniformRule
    state: Any                # MaskedBlock or UniformBlock (before this pass; never mutated by the shadow)
    gen: Any = None           # the block's noise generator (uniform-state)
    warmup: bool = False
    accept: bool = True
    start: int = 0            # absolute position of the block's first row (segments may hold more than the block)


class Stat:
    """Running max / count / sum for |Δ| summaries."""

    __slots__ = ("n", "max", "sum")

    def __init__(self):
        self.n, self.max, self.sum = 0, 0.0, 0.0

    def add(self, t: torch.Tensor) -> None:
        if t.numel():
            self.n += t.numel()
            self.max = max(self.max, float(t.max()))
            self.sum += float(t.sum())

    def as_dict(self) -> dict:
        return {"n": self.n, "max_abs": self.max, "mean_abs": self.sum / self.n if self.n else 0.0}


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine in fp64; NaN where either row is (numerically) zero."""
    a, b = a.double(), b.double()
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    c = (a * b).sum(-1) / (na * nb).clamp(min=1e-300)
    return torch.where((na > 1e-12) & (nb > 1e-12), c, torch.full_like(c, math.nan))


class ShadowForward(Forward):
    """Teacher-forced comparison: schedules drive this Forward; it drives both executors (see module docstring)."""

    name = "shadow"

    def __init__(self, optimized: Forward, reference: Forward, context: Optional[Callable] = None,
                 staleness_ages: int = 0, label: str = "main"):
        self.opt, self.ref = optimized, reference
        self.config = reference.config
        self.context = context                    # (request, block) -> Context | None
        self.staleness_ages = staleness_ages      # history depth for the lagged-cosine curve (0 = off)
        self.label = label
        cfg = self.config
        self.mask_id = cfg.mask_token_id if cfg.family != "diffusion_gemma" else None
        self.moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        self.model = getattr(optimized, "model", None)
        self.pass_index = 0
        self.block_pass: dict = defaultdict(int)   # (request, block) -> passes the block has taken (schedule side)
        self.rows: list = []                       # one dict per (pass, segment with live rows)
        self.violations: list = []
        self.routed = {li: {"all": Stat(), "cached": Stat(), "fresh": Stat(), "live": Stat()}
                       for li in self.moe_layers}
        self.logits = Stat()
        self.served_cos = defaultdict(list)        # age -> cosines of served entries vs fresh reference
        self.lagged_cos = defaultdict(list)        # (kind, k) -> cosines (kind: decoded | live)
        self.lagged_layer = defaultdict(list)      # (kind, k, layer) -> cosines
        self._hist: dict = {}                      # (request, block) -> deque of (block_pass, tokens, live, [Y])
        self.coverage_checks: list = []            # independent |U_l| recomputations
        self.age_hist = defaultdict(int)
        self.substituted = 0

    # ---- Forward protocol -------------------------------------------------------------------------------------
    def new_cache(self) -> ShadowCache:
        return ShadowCache(self.opt.new_cache(), self.ref.new_cache())

    @staticmethod
    def _split(items: list[StepInput]):
        def side(it, k):
            c = it.cache
            return replace(it, cache=getattr(c, k) if isinstance(c, ShadowCache) else c)
        return [side(it, "opt") for it in items], [side(it, "ref") for it in items]

    def append(self, items: list[StepInput]) -> None:
        a, b = self._split(items)
        self.opt.append(a)
        self.ref.append(b)

    def end_block(self, request, block) -> None:
        self.opt.end_block(request, block)
        self.ref.end_block(request, block)
        plans = getattr(self.opt, "plans", None)
        if plans is not None and (request, block) in plans:
            self.violations.append(inv.Violation(
                "block-boundary", f"request {request} block {block}: the executor still holds the block plan "
                                  "(supports, decoded-output caches) after the block committed",
                {"request": request, "block": block, "pass": self.pass_index}))
        self.block_pass.pop((request, block), None)
        self._hist.pop((request, block), None)

    def end_request(self, request) -> None:
        self.opt.end_request(request)
        self.ref.end_request(request)
        plans = getattr(self.opt, "plans", None)
        left = [k for k in (plans or {}) if k[0] == request]
        if left:
            self.violations.append(inv.Violation(
                "block-boundary", f"request {request}: {len(left)} block plan(s) left after the request ended "
                                  f"(blocks {sorted(k[1] for k in left)})", {"request": request}))
        for k in [k for k in self.block_pass if k[0] == request]:
            self.block_pass.pop(k, None)
            self._hist.pop(k, None)

    def stats(self) -> dict:
        return self.opt.stats()

    def last_pass_stats(self) -> dict:
        return self.opt.last_pass_stats() if hasattr(self.opt, "last_pass_stats") else {}

    # ---- the shadowed denoising call --------------------------------------------------------------------------
    @torch.no_grad()
    def denoise(self, items: list[StepInput]) -> list[list[torch.Tensor]]:
        opt_items, ref_items = self._split(items)
        audit = getattr(self.opt, "audit", None)
        heads = getattr(self.opt, "audit_heads", None)
        a0 = len(audit) if audit is not None else 0
        h0 = len(heads) if heads is not None else 0
        taps_opt: dict = {}
        has_taps = hasattr(self.opt, "taps")
        if has_taps:
            self.opt.taps = taps_opt
        try:
            out = self.opt.denoise(opt_items)
        finally:
            if has_taps:
                self.opt.taps = None
        taps_ref: dict = {}
        ref_out = self.ref.denoise(ref_items, taps=taps_ref)

        # where every segment lives in the padded (B, L) layout, and its schedule-side pass count
        seg_at = {}
        for b, it in enumerate(items):
            off = 0
            for si, s in enumerate(it.segments):
                key = (it.request, s.block)
                seg_at[key] = (b, off, s, self.block_pass[key])
                off += len(s)
        new_audit = audit[a0:] if audit is not None else []
        new_heads = heads[h0:] if heads is not None else []

        # invariants on this pass's audit records, with positions and the block's own pass count
        served_at = defaultdict(dict)            # layer -> {(b, flat row): age}
        path_of = {}
        for rec in new_audit:
            key = (rec["request"], rec["block"])
            loc = seg_at.get(key)
            positions = loc[2].positions.tolist() if loc is not None else None
            self.violations += inv.check_record(rec, loc[3] if loc is not None else None, positions)
            path_of.setdefault(key, rec["path"])
            if loc is not None:
                for r, a in zip(rec["served_rows"], rec["served_ages"]):
                    served_at[rec["layer"]][(loc[0], loc[1] + r)] = a
            for a in rec["served_ages"]:
                self.age_hist[a] += 1
            if rec.get("built_at") == rec["plan_pass"] and rec["support_ok"] and rec["support"] is not None \
                    and loc is not None:
                self._recheck_coverage(rec, taps_opt, loc)
        for rec in new_heads:
            loc = seg_at.get((rec["request"], rec["block"]))
            self.violations += inv.check_head(rec, loc[2].positions.tolist() if loc is not None else None)

        # logits, margins, decisions per segment
        for b, it in enumerate(items):
            for si, s in enumerate(it.segments):
                n_live = int(s.live.sum())
                if n_live == 0:
                    continue
                z_ref = ref_out[b][si]
                z_opt = out[b][si]
                if z_opt.shape != z_ref.shape:
                    live_pos = s.positions[s.live].tolist()
                    if not new_heads:   # the executor has no LM-head audit: the shape is all we know
                        self.violations.append(inv.Violation(
                            "lm-head", f"request {it.request} block {s.block} pass {self.pass_index}: "
                                       f"{z_opt.shape[0]} logits rows returned for {n_live} live rows "
                                       f"(positions {live_pos})",
                            {"request": it.request, "block": s.block, "pass": self.pass_index}))
                    out[b][si] = z_ref            # keep the run going on the reference's logits
                    self.substituted += 1
                    continue
                self._compare_segment(it, s, z_opt, z_ref, path_of.get((it.request, s.block)))

        self._compare_routed(items, taps_opt, taps_ref, served_at, seg_at)
        for key in seg_at:
            self.block_pass[key] += 1
        self.pass_index += 1
        return out

    # ---- pieces -----------------------------------------------------------------------------------------------
    def _compare_segment(self, it: StepInput, s, z_opt, z_ref, path) -> None:
        live_idx = s.live.nonzero(as_tuple=True)[0]
        key = (it.request, s.block)
        d = delta_inf(z_opt, z_ref, self.mask_id)
        self.logits.add(d)
        rec = {"pass": self.pass_index, "request": it.request, "block": s.block, "role": s.role,
               "block_pass": self.block_pass[key], "path": path, "rows": live_idx.tolist(),
               "positions": s.positions[live_idx].tolist(), "delta": d.tolist()}
        ctx = self.context(it.request, s.block) if self.context is not None else None
        if ctx is not None and getattr(ctx.rule, "uniform", False):
            chk = entropy_bound_check(ctx.rule, ctx.state, z_ref, z_opt, ctx.gen, ctx.warmup, ctx.accept)
            n = live_idx.numel()
            rec.update(kind="entropy-bound", decision=True, gamma=[math.nan] * n, gamma_exact=[math.nan] * n,
                       agree=[chk["agree"]] * n, argmax_agree=[chk["same_argmax"]] * n, fallback=False, check=chk)
        else:
            zr, zo = masked64(z_ref, self.mask_id), masked64(z_opt, self.mask_id)
            argmax_agree = (zr.argmax(-1) == zo.argmax(-1)).tolist()
            if ctx is None:
                # no schedule context: judge with the plain threshold rule (τ = 0.95), no commit-all pass
                m = threshold_margin(z_ref, self.mask_id)
                mo = threshold_margin(z_opt, self.mask_id)
                agree = ((m.commit == mo.commit) & (~m.commit | (m.tokens == mo.tokens))).tolist()
                decision, kind = True, "threshold (no context)"
            else:
                after_ref = self._masked_after(ctx, z_ref)
                after_opt = self._masked_after(ctx, z_opt)
                brow = s.positions[live_idx].cpu() - ctx.start       # the live rows as rows of the block
                agree = (after_ref.tokens[brow] == after_opt.tokens[brow]).tolist()
                decision = ctx.accept
                dec = ctx.rule.dec
                kind = dec.rule
                if dec.rule == "threshold":
                    S = dec.threshold_steps
                    quota = None
                    if S:                                    # LLaDA2.0's quota of this pass (samplers.masked_step)
                        sched = transfer_schedule(ctx.state.tokens.shape[0], S)
                        quota = sched[ctx.state.passes] if ctx.state.passes < len(sched) else 0
                    m = threshold_margin(z_ref, self.mask_id, dec.threshold,
                                         commit_all=after_ref.passes >= last_pass("threshold", dec.max_steps, 0, S),
                                         inclusive=dec.threshold_inclusive, quota=quota)
                else:
                    k = int((after_ref.tokens[brow] != self.mask_id).sum()) if ctx.accept else 0
                    m = fixed_k_margin(z_ref, self.mask_id, k)
            rec.update(kind=kind, decision=decision, gamma=m.gamma.tolist(), gamma_exact=m.gamma_exact.tolist(),
                       agree=agree, argmax_agree=argmax_agree, fallback=m.fallback,
                       commit=m.commit.tolist())
        self.rows.append(rec)

    @staticmethod
    def _masked_after(ctx: Context, z):
        """The block's state after the real rule stepped a copy of it with logits z."""
        st = copy.deepcopy(ctx.state)
        ctx.rule.step(st, z, ctx.gen, warmup=ctx.warmup, accept=ctx.accept)
        return st

    def _compare_routed(self, items, taps_opt, taps_ref, served_at, seg_at) -> None:
        ro, rr = taps_opt.get("routed"), taps_ref.get("routed")
        if not ro or not rr or len(ro) != len(rr):
            return
        B = len(items)
        L = rr[0].shape[1]
        valid = torch.zeros(B, L, dtype=torch.bool)
        live = torch.zeros(B, L, dtype=torch.bool)
        for key, (b, off, s, _) in seg_at.items():
            valid[b, off:off + len(s)] = True
            live[b, off:off + len(s)] = s.live.cpu()
        for j, li in enumerate(self.moe_layers[:len(rr)]):
            yo, yr = ro[j].detach().cpu(), rr[j].detach().cpu()
            d = (yo.double() - yr.double()).abs().amax(-1)                   # (B, L)
            cached = torch.zeros(B, L, dtype=torch.bool)
            srv = served_at.get(li, {})
            for (b, r), age in srv.items():
                cached[b, r] = True
            st = self.routed[li]
            st["all"].add(d[valid])
            st["cached"].add(d[valid & cached])
            st["fresh"].add(d[valid & ~cached])
            st["live"].add(d[valid & live])
            if srv:
                idx = torch.tensor(list(srv.keys()))
                ages = list(srv.values())
                c = _cos(yo[idx[:, 0], idx[:, 1]], yr[idx[:, 0], idx[:, 1]])
                for a, v in zip(ages, c.tolist()):
                    if not math.isnan(v):
                        self.served_cos[a].append(v)
        if self.staleness_ages:
            self._lagged(seg_at, rr)

    def _lagged(self, seg_at, rr) -> None:
        """Cosine between a row's fresh (reference) routed output now and k passes ago, per kind of row."""
        for key, (b, off, s, bp) in seg_at.items():
            if s.role == "prefix":
                continue
            Y = [rr[j][b, off:off + len(s)].detach().double().cpu() for j in range(len(rr))]
            tokens, live = s.tokens.cpu().clone(), s.live.cpu().clone()
            hist = self._hist.setdefault(key, deque(maxlen=self.staleness_ages))
            for (bp_old, tok_old, live_old, Y_old) in hist:
                k = bp - bp_old
                if not 1 <= k <= self.staleness_ages:
                    continue
                stable = ~live_old & ~live & (tok_old == tokens)
                for kind, rows in (("decoded", stable), ("live", live)):
                    if not rows.any():
                        continue
                    for j, li in enumerate(self.moe_layers[:len(rr)]):
                        c = _cos(Y[j][rows], Y_old[j][rows])
                        c = c[~torch.isnan(c)].tolist()
                        self.lagged_cos[(kind, k)] += c
                        self.lagged_layer[(kind, k, li)] += c
            hist.append((bp, tokens, live, Y))

    def _recheck_coverage(self, rec, taps_opt, loc) -> None:
        """Recompute |U_l| of a successful build from the layer's MoE input (independent of the executor's count)."""
        from dblock.optimized.atlas import candidates, coverage
        moe_in = taps_opt.get("moe_in")
        if not moe_in or self.model is None:
            return
        j = self.moe_layers.index(rec["layer"])
        b, off, s, _ = loc
        x = moe_in[j][b, off:off + len(s)]
        moe_of = getattr(self.opt, "moe_of", None)             # DiffusionGemma: the layer's MoE branch view
        moe = moe_of(rec["layer"]) if moe_of is not None else self.model.layers[rec["layer"]].mlp
        ap = self.opt.ap
        W, I, R = candidates(moe.router_logits(x), moe.expert_bias, self.config, ap.m)
        support = torch.zeros(self.config.num_experts, dtype=torch.bool)
        support[rec["support"]] = True
        _, U = coverage(W.double(), I, R.double(), support, ap.alpha)
        under = int(U.sum())
        allowed = (1.0 - ap.q) * len(s)
        self.coverage_checks.append({"request": rec["request"], "block": rec["block"], "pass": rec["pass"],
                                     "layer": rec["layer"], "N": len(s), "under": under, "under_reported":
                                     rec["under"], "allowed": allowed, "support": len(rec["support"])})
        if under > allowed + 1e-9:
            self.violations.append(inv.Violation(
                "coverage", f"request {rec['request']} block {rec['block']} pass {rec['pass']} layer {rec['layer']}: "
                            f"support of {len(rec['support'])} experts reported as a success, but {under} of "
                            f"{len(s)} tokens are under-covered (recomputed; allowed (1-q)N = {allowed:g})",
                {"request": rec["request"], "block": rec["block"], "pass": rec["pass"], "layer": rec["layer"],
                 "under": under, "allowed": allowed}))


# ---------------------------------------------------------------------------------------------------------------
# driving a shadow run through the real schedules
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class ShadowRun:
    shadow: ShadowForward
    tokens: list                      # per request: the optimized trajectory's output tokens
    counters: list
    runs: list = field(default_factory=list, repr=False)


def shadow_generate(shadow: ShadowForward, prompts, dec, schedule="native", batch_size: Optional[int] = None,
                    seeds=None) -> ShadowRun:
    """Decode `prompts` with the schedule driving `shadow` (so the trajectory is the optimized executor's) and give
    the shadow the per-block sampler context it needs to replay decisions."""
    from dblock.decoding.generate import as_requests
    from dblock.decoding.schedules import RequestRun, drive, schedule_spec

    dec = dec.validate()
    spec = schedule if not isinstance(schedule, str) else schedule_spec(schedule)
    reqs = as_requests(prompts, dec.max_new_tokens, dec.seed, seeds)
    runs = [RequestRun(r, shadow, spec, dec) for r in reqs]
    by_id = {r.req.id: r for r in runs}

    def context(request, block):
        run = by_id.get(request)
        if run is None:
            return None
        for i, f in enumerate(run.inflight):
            if f.index == block:
                warm = i > 0
                return Context(run.rule, f.state, f.gen, warm, run.spec.warmup_accept or not warm, f.start)
        return None

    shadow.context = context
    step = batch_size or len(runs)
    with torch.no_grad():
        for i in range(0, len(runs), step):
            drive(runs[i:i + step], shadow)
    return ShadowRun(shadow, [r.output_tokens() for r in runs], [r.counters for r in runs], runs)
