"""The Epoch executor (docs/algorithms.md §4): a batched Forward over the reference model's own weight tensors (no copy).

Contract: cache stable block structure; recompute every value that feeds a live decode decision.

Per denoising call, for every in-flight block of every request (a *block plan* each):
  * liveness: D_i from the segment's decoded rows; fresh set F_i (all rows on cold / refresh / fallback passes,
    else every row but the stable decoded ones), planned for the whole call at once (`liveness.plan_passes`);
  * each block's path (`_block_dense`, docs/algorithms.md §4.1), from its own fresh fraction f only (never the
    batch's): the epoch path when the cost model says skipping its stable rows pays (m·(1 − f) > o,
    `plan.PathModel` at a nominal batch), else the dense path — every row of the block through the experts with
    every expert eligible, nothing served, which still writes the cache entries an epoch pass would write, so the
    cache stays coherent. A call whose blocks all chose dense runs the literal dense path (`_all_fresh`);
    otherwise the dense blocks ride inside the epoch path (`Rows.dense`). Both run the same per-row expert
    arithmetic (`EpochConfig.grouped_mm` off), so a request's tokens do not depend on its batch;
  * per layer: attention, norms and residuals on all rows; the MoE block (routed and shared experts) only on the
    fresh rows of the whole batch, compacted into one buffer, routed with the model's rule restricted to the block's
    expert support S_l (the plain rule when no block of the call has a restricted support), run through FreshLane;
    stable decoded rows take their cached MoE output (routed + shared);
  * the LM head only for live rows (the Forward protocol returns nothing else).
Prefill and append passes write exact K/V for committed tokens, so they run the dense path.

The MoE region of one layer (`EpochExecutor._moe`) is a pipeline of named steps over one `LayerCall`, inherited
from `dblock.optimized.moe_steps.MoeSteps` (the step table is there); the call's rows and the layer's state are the
data types of `dblock.optimized.rows`.
After the last layer, per segment: `_head_rows` (its live rows) -> `_segment_logits` (the LM head for them).
Statistics cost no host synchronisation in the hot path: per-layer records keep tensors and are read once, when
`last_pass_stats()` / `stats()` / `age_hist` are asked for.

The stage seam (`dblock.optimized.stages.TorchStages`: route / experts / attend / lm_head / compact / scatter) is
where the Triton stack swaps in. The production executor carries no test instrumentation and does not import the
equivalence suite's checks: the suite's audit records and its deliberate faults subclass these steps from outside
(`dblock.equivalence.audit`, `dblock.equivalence.faults`); the margin gate borrows only the suite's pure margin
functions (`dblock.decoding.margins.row_stats`, and the per-block radii through `dblock.decoding.radius`),
and only when it is on.

Configurations (docs/algorithms.md §4.5): epoch (all on), full_compute (all experts, M_C = 1: exact), no_atlas,
no_lsp, and dense (the reference executor itself). Faults fail closed: any cache doubt makes the layer fully fresh,
an atlas failure makes the layer use all experts, both counted. With `EpochConfig.margin_refresh` = δ (off by
default), a request whose pass was approximate and whose block decision radius at the Epoch logits is ≤ δ is re-run
through a full_compute executor before its logits are returned (`_margin_gate`, docs/algorithms.md §4.7). With
`EpochConfig.lsp_drift` = ε (off by default), a stable decoded row is served from the cache only while its MoE input
stays within ε of the input its entry was computed at (relative L2), else it is computed fresh (`_drift_gate`).

Letter legend: B requests, L padded rows per request, T valid rows of the call, F fresh rows, E experts,
K experts per token, H hidden, N rows of one block, P block plans of the call, C rows a plan wants served from the
cache (candidates), S rows served from the cache, G rows of the blocks building a support, J candidates per row
(K + m), O the other (non-fresh) rows, W rows whose cache entries are written, X any subset of rows, V vocabulary.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import torch

from dblock.forward import Forward, StepInput
from dblock.optimized.freshlane import CommStats, LocalDispatcher, moe_buffer_bytes
from dblock.optimized.liveness import CacheArena, PassPlan, plan_passes
from dblock.optimized.moe_steps import MoeSteps
from dblock.optimized.plan import BlockPlan, EpochConfig, PathModel
from dblock.optimized.rows import Rows, _PlanRows
from dblock.optimized.stages import TorchStages
from dblock.reference.executor import KVCache, LladaReference, build_layout, stack_past

#: the margin gate's counters (`stats()["margin_refresh"]`): denoising calls, requests in them, requests whose pass
#: was approximate, those the gate computed a radius for, requests re-run exactly, their rows, calls with a re-run
GATE_COUNTERS = ("passes", "requests", "approx", "gated", "refreshed", "rows_refreshed", "calls_refreshed")


class EpochExecutor(MoeSteps, Forward):
    name = "epoch"
    families = ("llada2_moe", "llada_moe")       # DiffusionGemma: `dblock.optimized.gemma_epoch` (`epoch_class`)

    def __init__(self, model, cfg: EpochConfig | None = None, dispatcher=None):
        if model.config.family not in self.families:
            raise ValueError(f"{type(self).__name__} runs {', '.join(self.families)}, not {model.config.family}: "
                             "build the epoch executor with `epoch_forward` (it picks the family's class)")
        self.model, self.config = model, model.config
        self.ecfg = cfg or EpochConfig()
        self.ap = self.ecfg.atlas_params.resolved(self.config.num_experts, self.config.num_experts_per_tok)
        self.reference = self._make_reference(model)
        self.dispatcher = dispatcher or LocalDispatcher(self.config.num_experts)
        self.plans: dict = {}
        self.arena = None                        # CacheArena, made on the first denoising call (dtype, device)
        self.totals = Counter()                  # paths and fallbacks over the executor's life
        self.pass_paths = Counter()              # calls per path (epoch / dense, docs/algorithms.md §4.1)
        self.atlas_hot = Counter()               # per-token fail-closed on hot passes (`_cover_fresh`)
        self._age_hist = Counter()               # cache ages at read (folded from _ages when read)
        self._ages: list = []                    # age tensors of reads not yet folded into the histogram
        self._last: Any = {}                     # the last pass's statistics (built when first read)
        self._pass = 0                           # denoising calls so far
        self._path_models: dict = {}             # block rows -> PathModel from the cost model (nominal batch)
        self.gate = Counter()                    # the margin-gated exact refresh (`_margin_gate`), when on
        self.drift = Counter()                   # LSP's drift bound (`_drift_gate`): rows checked, rows recomputed
        self._exact = None                       # its full_compute executor (made on the first refresh)
        self.stages = self._make_stages()

    def _make_reference(self, model) -> Forward:
        """The family's reference executor: prefill and append passes (exact K/V) run through it."""
        return LladaReference(model)

    def _make_stages(self):
        if self.ecfg.use_triton:
            from dblock.kernels.stack import TritonStages
            return TritonStages(self.config)
        return TorchStages(grouped_mm=self.ecfg.grouped_mm)

    @property
    def embed_weight(self) -> torch.Tensor:
        """The input embedding's weight (its dtype and device are the model's)."""
        return self.model.embed.weight

    @property
    def device(self):
        return self.embed_weight.device

    # ---- Forward protocol ---------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return self.reference.new_cache()

    def append(self, items: list[StepInput]) -> None:
        self.reference.append(items)

    def end_block(self, request, block) -> None:
        self._drop(self.plans.pop((request, block), None))
        if self._exact is not None:
            self._exact.end_block(request, block)

    def end_request(self, request) -> None:
        for key in [k for k in self.plans if k[0] == request]:
            self._drop(self.plans.pop(key))
        if self._exact is not None:
            self._exact.end_request(request)

    def _drop(self, plan) -> None:
        if plan is not None and plan.base is not None and self.arena is not None:
            self.arena.free(plan.base, plan.N)
            plan.base = None

    def plan_cache(self, plan, li: int):
        """A plan's decoded-output cache entries at MoE layer `li` (views into the arena; tests and reports)."""
        return self.arena.view(li, plan.base, plan.N)

    @property
    def age_hist(self) -> Counter:
        """Cache ages at read over the executor's life ({age: reads})."""
        if self._ages:
            ages = torch.cat(self._ages)
            self._ages = []
            vals, counts = ages.unique(return_counts=True)
            self._age_hist.update(dict(zip(vals.tolist(), counts.tolist())))
        return self._age_hist

    def stats(self) -> dict:
        out = {"paths": dict(self.totals), "pass_paths": dict(self.pass_paths),
               "cache_age_hist": dict(sorted(self.age_hist.items())), "open_plans": len(self.plans),
               "atlas_hot": dict(self.atlas_hot)}
        if self.ecfg.margin_refresh is not None:
            out["margin_refresh"] = {"bound": self.ecfg.margin_refresh, **{k: self.gate[k] for k in GATE_COUNTERS}}
        if self.ecfg.lsp_drift is not None:
            out["lsp_drift"] = {"bound": self.ecfg.lsp_drift, "checked": self.drift["checked"],
                                "recomputed": self.drift["recomputed"]}
        return out

    def last_pass_stats(self) -> dict:
        if callable(self._last):
            self._last = self._last()
        return self._last

    # ---- planning (the block clock) -----------------------------------------------------------------------
    def _block_plan(self, request, block: int, n: int) -> BlockPlan:
        """The block's plan, made on its first pass (cold) with n cache slots; a changed shape starts over."""
        key = (request, block)
        plan = self.plans.get(key)
        if plan is None or plan.N != n:
            if plan is not None:                 # the block's shape changed: nothing of it survives
                self.totals["fallback:shape"] += 1
                self._drop(plan)
            plan = BlockPlan(request, block, n, self.config.num_hidden_layers)
            plan.base = self.arena.alloc(n)
            self.plans[key] = plan
        return plan

    def _plan_passes(self, plans: list, decoded_T: torch.Tensor, lens: list) -> PassPlan:
        """Every block's path this pass (cold / hot / refresh / fallback) and the call's fresh set, from the decoded
        rows of all blocks at once (`liveness.plan_passes`)."""
        return plan_passes([pl.liveness for pl in plans], decoded_T, lens, [pl.passes for pl in plans],
                           self.ecfg.refresh, self.ecfg.lsp)

    def _plan_rows(self, items: list[StepInput], L: int, H: int, dtype) -> Rows:
        """Plan every segment's pass and lay its rows out in the call's T valid rows (a few batched tensor ops,
        whatever the number of blocks)."""
        if self.arena is None:
            self.arena = CacheArena(self.config.moe_layers, H, dtype, self.device,
                                    keep_inputs=self.ecfg.lsp_drift is not None)
        plans, lens, flat0, toks, decs = [], [], [], [], []
        for b, it in enumerate(items):
            off = 0
            for s in it.segments:
                n = len(s)
                plans.append(self._block_plan(it.request, s.block, n))
                lens.append(n)
                flat0.append(b * L + off)
                toks.append(s.tokens)
                decs.append(s.decoded)
                off += n
        P, T = len(plans), sum(lens)
        token_T = torch.cat(toks).cpu()
        pp = self._plan_passes(plans, torch.cat(decs).cpu(), lens)
        starts, t = [], 0
        for plan, path, n in zip(plans, pp.paths, lens):
            plan.path = path
            if path == "fallback":
                plan.invalidate()
                self.totals[f"fallback:{plan.liveness.reason}"] += 1
            starts.append(t)
            t += n
        fresh_P = [int(f.sum()) for f in pp.fresh.split(lens)] if P > 1 else [int(pp.fresh.sum())]
        approx = torch.zeros(P, dtype=torch.bool) if self.ecfg.margin_refresh is not None else None
        dense_P = [self._block_dense(n, f) for n, f in zip(lens, fresh_P)]
        per_plan = torch.tensor([[s0, f0, pl.base, pl.passes, pl.version, pl.path == "hot"]
                                 for s0, f0, pl in zip(starts, flat0, plans)], dtype=torch.long)   # (P, 6)
        plan_T = torch.repeat_interleave(torch.arange(P), torch.tensor(lens)) if P > 1 else \
            torch.zeros(T, dtype=torch.long)
        g_T6 = per_plan[plan_T]
        row_T = torch.arange(T) - g_T6[:, 0]
        passes_T, version_T = g_T6[:, 3], g_T6[:, 4]
        return Rows(flat=g_T6[:, 1] + row_T, plan=plan_T, row=row_T, token=token_T,
                    decoded=pp.stable | pp.newly, fresh=pp.fresh, plans=plans, plan_rows=_PlanRows(starts, lens),
                    slot=g_T6[:, 2] + row_T, passes=passes_T, version=version_T, newly=pp.newly,
                    hot=g_T6[:, 5].bool(), stamp=torch.stack([passes_T, token_T, version_T], 1),
                    padded=T != len(items) * L, batch=len(items), n_fresh=sum(fresh_P),
                    dense=torch.tensor(dense_P, dtype=torch.bool)[plan_T], dense_P=dense_P,
                    path="dense" if dense_P and all(dense_P) else "epoch", approx=approx)

    def _path_model(self, n: int) -> PathModel:
        """The configuration's measured `path_model`, else the cost model's for a block of n rows at the nominal
        batch `EpochConfig.path_batch` (cached per n): never the call's batch shape, so a block's path does not
        depend on what else is in its call."""
        if self.ecfg.path_model is not None:
            return self.ecfg.path_model
        pm = self._path_models.get(n)
        if pm is None:
            pm = self._path_models[n] = PathModel.from_cost(self.config, self.ecfg.path_batch, max(1, n),
                                                            self.ecfg.path_hardware)
        return pm

    def _block_dense(self, n: int, n_fresh: int) -> bool:
        """A block's path this pass (docs/algorithms.md §4.1), from its own rows only: dense unless skipping its
        stable rows pays, m·(1 − f_b) > o with f_b = n_fresh / n (`PathModel`); a configuration may pin either."""
        if self.ecfg.path != "auto":
            return self.ecfg.path == "dense"
        return not self._path_model(n).epoch_pays(n_fresh / max(1, n))

    def _pass_path(self, R: Rows) -> str:
        """The call's path: `dense` (the literal dense path, no epoch bookkeeping) when every block chose it, else
        `epoch` (blocks that chose dense handled inside it, `Rows.dense`)."""
        return R.path

    # ---- the LM head --------------------------------------------------------------------------------------
    def _head_rows(self, s, device) -> torch.Tensor:
        """(N,) bool: the segment's rows the LM head runs for — its live rows."""
        return s.live.to(device)

    def _segment_logits(self, it: StepInput, s, hidden_NH: torch.Tensor, rows_N: torch.Tensor) -> torch.Tensor:
        """Logits of the segment's `rows_N`. One LM head call per segment, as the reference makes them: a batched
        call would change the GEMM's row count and with it the logits' last bits, and full_compute promises the
        reference's logits, not only its tokens."""
        return self.stages.lm_head(self.model, hidden_NH, rows_N)

    # ---- the denoising call -------------------------------------------------------------------------------
    @torch.no_grad()
    def denoise(self, items: list[StepInput]) -> list[list[torch.Tensor]]:
        t0, c0 = time.perf_counter(), time.thread_time()
        model = self.model
        tokens, positions, mask, valid, lens, cache_lens = build_layout(items, self.device)
        B, L = tokens.shape
        n, Lc = self.config.num_hidden_layers, mask.shape[2] - L
        # the committed caches stacked once per block, not once per pass (one kept stacking with the reference's
        # append passes: an append changes the lengths, so the next call stacks again)
        past = self.reference.past_stack.get(items, lambda: stack_past(items, n, Lc))
        R = self._plan_rows(items, L, self.config.hidden_size, model.embed.weight.dtype)
        R.path = self._pass_path(R)
        # a dispatcher may keep richer per-pass stats (ep.EPStats: per rank, FreshLane and dense)
        new_stats = getattr(self.dispatcher, "new_stats", CommStats)
        self._layer_recs, self._comm = [], new_stats()
        moe_s = moe_cpu_s = 0.0
        x = model.embed(tokens)                                              # (B, L, H)
        for li, layer in enumerate(model.layers):
            pk, pv = past[li] if past is not None else (None, None)
            a = self.stages.attend(layer.attn, layer.attn_norm(x), positions, mask, pk, pv, items)
            h = x + a
            if not layer.is_moe:
                x = h + layer.mlp(layer.mlp_norm(h))
                continue
            xn = layer.mlp_norm(h)
            tm, tc = time.perf_counter(), time.thread_time()      # the MoE block alone, as the reference's module
            y = self._moe(li, layer.mlp, xn, R)
            moe_s += time.perf_counter() - tm
            moe_cpu_s += time.thread_time() - tc
            x = h + y
        out = []
        for b, it in enumerate(items):
            per_seg, off = [], 0
            for s in it.segments:
                rows_N = self._head_rows(s, x.device)
                per_seg.append(self._segment_logits(it, s, x[b, off:off + len(s)], rows_N))
                off += len(s)
            out.append(per_seg)
        for plan in R.plans:
            plan.passes += 1
        refreshed = self._margin_gate(items, out, R) if R.approx is not None else 0
        self._end_pass(R, t0, c0, moe_s, moe_cpu_s, refreshed)
        return out

    # ---- the margin-gated exact refresh (docs/algorithms.md §4.7) ------------------------------------------
    def _margin_gate(self, items: list[StepInput], out: list, R: Rows) -> int:
        """Recompute exactly the requests whose decision this pass is not safely inside what the approximation can
        have moved their logits by; `out` is updated in place -> the number of requests refreshed.

        A request is *approximate* when one of its blocks served a cached row or routed within a restricted support
        at some layer (`_note_approx`); the others computed what full_compute computes and are kept. For an
        approximate request, each segment with live rows gets its decision radius r at the Epoch logits under its
        own rule (`Segment.decision`, `dblock.decoding.radius.block_radius`: min Γ* over its live rows; 0 when the
        rule has no closed-form margin or the segment returned the wrong number of rows; ∞ when it decides
        nothing). With δ = `EpochConfig.margin_refresh`, a bound on ‖ẑ − z‖∞ over the live rows of an approximate
        pass: keep ẑ when every segment has r > δ (then the exact logits z take the same decision), else re-run
        the request's whole call through the full_compute executor (every row fresh, every expert eligible: the
        reference's logits) and return those. δ = 0 never refreshes; δ = ∞ refreshes every approximate request."""
        from dblock.decoding.radius import block_radius, decision_rows
        from dblock.decoding.margins import row_stats
        delta = self.ecfg.margin_refresh
        g = self.gate
        approx_P = R.approx.tolist()
        approx_B, p = [], 0
        for it in items:
            n = len(it.segments)
            approx_B.append(any(approx_P[p:p + n]))
            p += n
        g["requests"] += len(items)
        g["approx"] += sum(approx_B)
        g["passes"] += 1
        if delta <= 0 or not any(approx_B):
            return 0
        mask_id = getattr(self.config, "mask_token_id", None)
        segs, zs = [], []
        radius_B = {b: math.inf for b in range(len(items)) if approx_B[b]}
        for b in radius_B:
            for si, s in enumerate(items[b].segments):
                n_live = int(s.live.sum())
                if n_live == 0:
                    continue
                z = out[b][si]
                if z.shape[0] != n_live:                 # the protocol broken: fail closed
                    radius_B[b] = 0.0
                    continue
                segs.append((b, s, n_live))
                zs.append(decision_rows(z, mask_id, s.decision))
        if zs and not math.isinf(delta):
            stats = row_stats(torch.cat(zs))
            parts = [t.split([n for _, _, n in segs]) for t in stats]
            for j, (b, s, _) in enumerate(segs):
                radius_B[b] = min(radius_B[b], block_radius(s.decision, tuple(t[j] for t in parts)))
        refresh = [b for b, r in radius_B.items() if r <= delta]
        g["gated"] += len(radius_B)
        if not refresh:
            return 0
        exact = self._exact_executor()
        for b, z in zip(refresh, exact.denoise([items[b] for b in refresh])):
            out[b] = z
        g["refreshed"] += len(refresh)
        g["rows_refreshed"] += sum(len(s) for b in refresh for s in items[b].segments)
        g["calls_refreshed"] += 1
        return len(refresh)

    def _exact_executor(self) -> "EpochExecutor":
        """The full_compute executor the margin gate re-runs requests through: the plain class (never an audited
        or faulted subclass), every block on the dense path, the per-expert loop — the reference's logits."""
        if self._exact is None:
            cfg = EpochConfig.named("full_compute", path="dense")
            cfg.use_triton = self.ecfg.use_triton
            self._exact = EpochExecutor(self.model, cfg)
        return self._exact

    def _end_pass(self, R: Rows, t0: float, c0: float, moe_s: float, moe_cpu_s: float, refreshed: int = 0) -> None:
        """The executor's running totals now; the pass's statistics (`last_pass_stats`) when first read."""
        recs, comm = self._layer_recs, self._comm
        for rec in recs:
            self.totals.update(rec[6])
        self.pass_paths[R.path] += 1
        timing = {"moe_s": moe_s, "moe_cpu_s": moe_cpu_s, "executor_s": time.perf_counter() - t0,
                  "executor_cpu_s": time.thread_time() - c0}
        cfg = self.config
        elem = self.embed_weight.element_size()

        def build() -> dict:
            layers = [self._stats_of(r) for r in recs]
            n_moe = max(1, len(layers))
            bufs = [moe_buffer_bytes(s["fresh"], s["pairs"], cfg.hidden_size, cfg.moe_intermediate_size, elem,
                                     max(4, elem)) for s in layers]
            return {**timing, "path": R.path, "fresh_frac": R.n_fresh / max(1, R.T), "refreshed": refreshed,
                    "dense_blocks": sum(R.dense_P), "blocks": len(R.dense_P),
                    "fresh": sum(s["fresh"] for s in layers) / n_moe, "moe_buffer_bytes": max(bufs, default=0),
                    "layers": layers,
                    "comm": comm.as_dict() if hasattr(comm, "as_dict") else
                    {"dispatch_rows": comm.dispatch_rows, "dispatch_bytes": comm.dispatch_bytes,
                     "combine_bytes": comm.combine_bytes, "messages": comm.messages}}
        self._last = build
        self._pass += 1


def epoch_config(config: str = "epoch", refresh=None, atlas_alpha=None, atlas_q=None, update_every=None,
                 use_triton: bool = False, atlas_m=None, atlas_B=None, atlas_beta=None,
                 atlas_c=None, path=None, path_model=None, atlas_repair=None, margin_refresh=None,
                 lsp_drift=None) -> EpochConfig:
    """The EpochConfig of a named configuration with the command line's knobs (None = default, see `AtlasParams`;
    `path`: auto | epoch | dense, `path_model`: a measured `PathModel` for auto; `atlas_repair`: the hot repair of
    `_repair_supports`, on by default; `margin_refresh`: δ of the margin-gated exact refresh, None = off;
    `lsp_drift`: ε of LSP's drift bound, None = off)."""
    cfg = EpochConfig.named(config, refresh=refresh, alpha=atlas_alpha, q=atlas_q, update_every=update_every,
                            m=atlas_m, B=atlas_B, beta=atlas_beta, c=atlas_c, path=path, path_model=path_model,
                            margin_refresh=margin_refresh, lsp_drift=lsp_drift)
    cfg.use_triton = use_triton
    if atlas_repair is not None:
        cfg.atlas_repair = bool(atlas_repair)
    return cfg


def epoch_forward(model, config: str = "epoch", refresh=None, atlas_alpha=None, atlas_q=None, update_every=None,
                  use_triton: bool = False, dispatcher=None, atlas_m=None, atlas_B=None, atlas_beta=None,
                  atlas_c=None, path=None, path_model=None, atlas_repair=None, margin_refresh=None,
                  lsp_drift=None) -> Forward:
    """The optimized executor in one of its configurations over `model`'s weights (`dense` = the reference).

    Atlas knobs (None = default, see `AtlasParams`): alpha coverage floor, q covered-token quota, m extra
    candidates, B initial support size, beta mixing weight, c experts added per repair round, update_every.
    Pass path (docs/algorithms.md §4.1): `path` auto (default: the cost rule of `PathModel`), epoch or dense;
    `path_model` a measured `PathModel` (else the cost model's). `margin_refresh` δ: the margin-gated exact refresh
    (docs/algorithms.md §4.7), None = off. `lsp_drift` ε: LSP's drift bound (docs/algorithms.md §4.3), None = off.
    The equivalence suite's audited executor, with or without deliberate faults, takes the same knobs:
    `dblock.equivalence.audit.audited_epoch_forward`."""
    if config == "dense":
        if use_triton:
            raise ValueError("--use-triton applies to the epoch configurations, not dense")
        from dblock.decoding.generate import reference_forward
        return reference_forward(model)
    cfg = epoch_config(config, refresh=refresh, atlas_alpha=atlas_alpha, atlas_q=atlas_q, update_every=update_every,
                       use_triton=use_triton, atlas_m=atlas_m, atlas_B=atlas_B, atlas_beta=atlas_beta,
                       atlas_c=atlas_c, path=path, path_model=path_model, atlas_repair=atlas_repair,
                       margin_refresh=margin_refresh, lsp_drift=lsp_drift)
    return epoch_class(model)(model, cfg, dispatcher=dispatcher)


#: family -> its Epoch executor class. The DiffusionGemma executor subclasses `EpochExecutor` in its own module
#: (`dblock.optimized.gemma_epoch`), which adds itself here; the package's `__init__` imports it, so the table is
#: complete whenever this module is importable.
EPOCH_CLASSES: dict = {"llada2_moe": EpochExecutor, "llada_moe": EpochExecutor}


def epoch_class(model) -> type:
    """The Epoch executor class of `model`'s family (`EPOCH_CLASSES`)."""
    fam = model.config.family
    if fam not in EPOCH_CLASSES:
        raise ValueError(f"the epoch executor has no class for family {fam!r} (it runs {', '.join(EPOCH_CLASSES)})")
    return EPOCH_CLASSES[fam]
