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

The MoE region of one layer (`EpochExecutor._moe`) is a pipeline of named steps over one `LayerCall`:
  fresh rows      `_fresh_rows`      the block plans' fresh sets F_i
  dense path      `_all_fresh`       (calls where every block chose dense) every row computed, nothing served,
                                     nothing restricted; in a mixed call the dense blocks' rows join the compacted
                                     rows, serve nothing, build no support and route with every expert
  cache checks    `_check_cache`     every row a plan wants served passes `_cache_checks`, else its block goes fully
                                     fresh for this layer (fail closed, `_fall_back`); one vectorised check per
                                     layer, the per-block naming only when something failed
  compact         `_compact`         the fresh rows of the whole batch into one (F, H) buffer
  due             `_supports_due`    the blocks whose Expert Atlas support is (re)built this pass
  router          `_router_logits`   router logits of the fresh rows (a building block's rows are all among them)
  route           `_route`           the model's rule restricted to each row's `_routing_support` (every expert
                                     for a block that builds this pass)
  supports        `_build_supports`  Expert Atlas (re)builds S_l for the due blocks from the rows just routed
                                     (docs/algorithms.md §4.2); the support restricts their routing from the next pass
  path counters   `_count_paths`
  experts         `_run_experts`     FreshLane (docs/algorithms.md §4.4): the dispatcher hands the rows to the
                                     stages' `experts`, which group the (row, expert) pairs by expert with one sort,
                                     run the expert MLPs over contiguous slices and combine the weighted outputs per
                                     row with one index_add (in torch `freshlane.grouped_swiglu_torch`; the Triton
                                     stack's grouped_mlp_triton); with expert parallelism dispatch and combine cross
                                     ranks
  shared expert   `_add_shared`      the shared expert on the fresh rows, added to their routed output
  scatter         `_scatter`         fresh outputs back among the T rows
  serve           `_serve_cached`    stable decoded rows from the decoded-output cache (docs/algorithms.md §4.3)
  write           `_write_cache`     the fresh `_rows_to_write` into the cache (one scatter of values and stamps)
  output          `_layer_output`    back to the padded layout, the layer's statistics record
After the last layer, per segment: `_head_rows` (its live rows) -> `_segment_logits` (the LM head for them).
Statistics cost no host synchronisation in the hot path: per-layer records keep tensors and are read once, when
`last_pass_stats()` / `stats()` / `age_hist` are asked for.

The stage seam (`TorchStages`: route / experts / attend / lm_head / compact / scatter) is where the Triton stack
swaps in. The production executor carries no test instrumentation and does not import the equivalence suite: the
suite's audit records and its deliberate faults subclass these steps from outside (`dblock.equivalence.audit`,
`dblock.equivalence.faults`).

Configurations (docs/algorithms.md §4.5): epoch (all on), full_compute (all experts, M_C = 1: exact), no_atlas,
no_lsp, and dense (the reference executor itself). Faults fail closed: any cache doubt makes the layer fully fresh,
an atlas failure makes the layer use all experts, both counted.

Letter legend: B requests, L padded rows per request, T valid rows of the call, F fresh rows, E experts,
K experts per token, H hidden, N rows of one block, P block plans of the call, C rows a plan wants served from the
cache (candidates), S rows served from the cache, G rows of the blocks building a support, J candidates per row
(K + m), O the other (non-fresh) rows, W rows whose cache entries are written, X any subset of rows, V vocabulary.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dblock.forward import Forward, StepInput
from dblock.optimized.atlas import build_supports, candidates, choose, route_restricted, router_scores
from dblock.optimized.freshlane import CommStats, LocalDispatcher, grouped_swiglu_torch, moe_buffer_bytes
from dblock.optimized.liveness import EMPTY, CacheArena, PassPlan, plan_passes
from dblock.optimized.plan import BlockPlan, EpochConfig, PathModel
from dblock.reference.executor import KVCache, LladaReference, build_layout, stack_past


class TorchStages:
    """The swappable stages of the optimized path, in torch (the stage seam, docs/architecture.md).
    `dblock.kernels.stack.TritonStages` implements the same methods with Triton kernels; `use_triton` picks it for
    the whole stack."""

    name = "torch"

    def __init__(self, grouped_mm: bool = False):
        self.grouped_mm = grouped_mm             # EpochConfig.grouped_mm: the grouped GEMM opt-in

    def route(self, logits_FE, bias_E, cfg, allowed_FE):
        """Support-restricted routing of the fresh rows -> ids (F, K) (-1 = no expert), weights (F, K) fp32."""
        return route_restricted(logits_FE, bias_E, cfg, allowed_FE)

    def route_all(self, logits_FE, bias_E, cfg):
        """The model's own routing rule, every expert eligible: the reference router's ids and weights bit for bit
        (`atlas.route_restricted` without a support: group scores by a max/min tournament, tested with ties)."""
        return route_restricted(logits_FE, bias_E, cfg)

    def experts(self, x_FH, ids_FK, w_FK, w_gate_EIH, w_up_EIH, w_down_EHI):
        """Grouped SwiGLU over the fresh worklist, weighted and summed over slots -> (F, H). By default the loop over
        the non-empty experts (the reference's per-row arithmetic, as `experts_exact`: a block's routed outputs do
        not depend on which other rows share the worklist or on the block's path); `grouped_mm` opts into the
        grouped GEMM (faster on large shapes, may differ from the reference in the last bit)."""
        return grouped_swiglu_torch(x_FH, ids_FK, w_FK, w_gate_EIH, w_up_EIH, w_down_EHI, grouped_mm=self.grouped_mm)

    def experts_exact(self, x_FH, ids_FK, w_FK, w_gate_EIH, w_up_EIH, w_down_EHI):
        """The same grouping with the reference's own per-expert GEMMs: its routed output bit for bit (the dense
        path)."""
        return grouped_swiglu_torch(x_FH, ids_FK, w_FK, w_gate_EIH, w_up_EIH, w_down_EHI, grouped_mm=False)

    def attend(self, attn, xn_BLH, positions_BL, mask_BLS, past_k, past_v, items):
        """Attention of every row over [committed cache ; in-flight segments] -> (B, L, H)."""
        return attn(xn_BLH, positions_BL, mask_BLS, past_k, past_v)[0]

    def lm_head(self, model, hidden_LH, live_L):
        """Logits of the live rows only (decoded rows feed no decision)."""
        return model.logits(hidden_LH[live_L])

    def compact(self, x_TH, idx_F):
        """The fresh rows, in index order -> (F, H)."""
        return x_TH.index_select(0, idx_F)

    def scatter(self, y_FH, idx_F, T):
        """Fresh rows back to their places among T rows, other rows zero -> (T, H)."""
        return y_FH.new_zeros(T, y_FH.shape[1]).index_copy_(0, idx_F, y_FH)


class _PlanRows:
    """The T-indices of each plan's rows (contiguous: plan p owns [start_p, start_p + n_p)), made on demand."""

    def __init__(self, starts: list, lens: list):
        self.starts, self.lens = starts, lens

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, p: int) -> torch.Tensor:
        return torch.arange(self.starts[p], self.starts[p] + self.lens[p])

    def __iter__(self):
        return (self[p] for p in range(len(self)))


@dataclass
class Rows:
    """Where every valid row of a call lives, and its block plan (all (T,) tensors, on the host)."""

    flat: torch.Tensor          # index into the (B*L) padded rows
    plan: torch.Tensor          # index into `plans`
    row: torch.Tensor           # row inside its block's segment
    token: torch.Tensor
    decoded: torch.Tensor
    fresh: torch.Tensor         # block-level fresh set F_i
    plans: list                 # BlockPlan per plan index
    plan_rows: Any              # plan_rows[p]: (n_p,) T-indices of plan p's rows, in row order
    slot: torch.Tensor          # the row's cache slot in the arena (plan base + row)
    passes: torch.Tensor        # its plan's pass index
    version: torch.Tensor       # its plan's version
    newly: torch.Tensor         # newly decoded on this pass (N_i)
    hot: torch.Tensor           # its plan is on a hot pass (not cold / refresh / fallback)
    stamp: Optional[torch.Tensor] = None   # (T, 3): (pass, token, version), what a cache write stamps
    padded: bool = True         # the call has padding rows (else flat is the identity)
    batch: int = 1              # requests in the call
    n_fresh: int = 0            # block-level fresh rows of the call
    path: str = "epoch"         # the call's path: dense when every block took it, else epoch (`_pass_path`)
    dense: Optional[torch.Tensor] = None   # (T,) bool: rows of blocks on the dense path this pass (`_block_dense`)
    dense_P: list = field(default_factory=list)   # per plan: its block takes the dense path this pass

    @property
    def T(self) -> int:
        return self.plan.numel()


@dataclass
class LayerCall:
    """One MoE layer of one denoising call on its way through the steps of `EpochExecutor._moe`.

    Row indices index the call's T valid rows. Masks and indices stay on the host (liveness bookkeeping); x, logits
    and outputs live with the model. Each step fills the fields it names; later fields are None until then.
    """

    li: int                                       # layer index
    moe: Any                                      # the layer's MoE module (router, experts, shared expert)
    R: Rows
    xn_BLH: torch.Tensor                          # the normed MoE input, padded layout
    x_TH: torch.Tensor                            # its valid rows
    fresh_T: torch.Tensor                         # bool: rows through the experts (F_i, widened by fallbacks)
    dense: bool = False                           # the call takes the dense path
    paths: Counter = field(default_factory=Counter)   # this layer's path counters, over blocks
    idx_S: Optional[torch.Tensor] = None          # rows served from the cache (_check_cache)
    age_S: Optional[torch.Tensor] = None          # their cache ages
    build: list = field(default_factory=list)     # plan indices whose support is (re)built now
    idx_F: Optional[torch.Tensor] = None          # fresh rows, in order (_compact)
    x_FH: Optional[torch.Tensor] = None
    logits_FE: Optional[torch.Tensor] = None      # router logits of the fresh rows (_router_logits)
    routed_rows: int = 0                          # router-logit rows computed (the fresh rows)
    ids_FK: Optional[torch.Tensor] = None         # routed experts of the fresh rows (-1 = none) (_route)
    w_FK: Optional[torch.Tensor] = None           # their routing weights
    open_F: Optional[torch.Tensor] = None         # fresh rows the per-token fail-closed routed with every expert
    y_FH: Optional[torch.Tensor] = None           # MoE output of the fresh rows (_run_experts, _add_shared)
    comm: Any = None                              # what the dispatcher moved (CommStats / EPStats)
    y_TH: Optional[torch.Tensor] = None           # MoE output of every row (_scatter, _serve_cached)

    @property
    def T(self) -> int:
        return self.x_TH.shape[0]


_EMPTY_IDX = torch.zeros(0, dtype=torch.long)


class EpochExecutor(Forward):
    name = "epoch"

    def __init__(self, model, cfg: EpochConfig | None = None, dispatcher=None):
        if model.config.family not in ("llada2_moe", "llada_moe"):
            raise ValueError(f"the epoch executor runs the LLaDA families; {model.config.family} has no decoded "
                             "positions before commit (uniform-state), use --executor reference")
        self.model, self.config = model, model.config
        self.ecfg = cfg or EpochConfig()
        self.ap = self.ecfg.atlas_params.resolved(self.config.num_experts, self.config.num_experts_per_tok)
        self.reference = LladaReference(model)
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
        self.stages = TorchStages(grouped_mm=self.ecfg.grouped_mm)
        if self.ecfg.use_triton:
            from dblock.kernels.stack import TritonStages
            self.stages = TritonStages(self.config)

    @property
    def device(self):
        return self.model.embed.weight.device

    # ---- Forward protocol ---------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return self.reference.new_cache()

    def append(self, items: list[StepInput]) -> None:
        self.reference.append(items)

    def end_block(self, request, block) -> None:
        self._drop(self.plans.pop((request, block), None))

    def end_request(self, request) -> None:
        for key in [k for k in self.plans if k[0] == request]:
            self._drop(self.plans.pop(key))

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
        return {"paths": dict(self.totals), "pass_paths": dict(self.pass_paths),
                "cache_age_hist": dict(sorted(self.age_hist.items())), "open_plans": len(self.plans),
                "atlas_hot": dict(self.atlas_hot)}

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
            self.arena = CacheArena(self.config.moe_layers, H, dtype, self.device)
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
                    path="dense" if dense_P and all(dense_P) else "epoch")

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

    # ---- the MoE region: a pipeline of named steps over one LayerCall ---------------------------------------
    def _moe(self, li: int, moe, xn_BLH: torch.Tensor, R: Rows) -> torch.Tensor:
        """Routed experts (fresh rows) + cached outputs (stable decoded rows) + shared expert -> (B, L, H)."""
        B, L, H = xn_BLH.shape
        x_TH = xn_BLH.reshape(B * L, H)
        if R.padded:
            x_TH = x_TH.index_select(0, R.flat.to(x_TH.device))
        c = LayerCall(li, moe, R, xn_BLH, x_TH, fresh_T=None, dense=R.path == "dense")
        c.fresh_T = self._fresh_rows(c)
        if c.dense:                                          # every block chose dense
            self._all_fresh(c)
        else:
            self._check_cache(c)
            self._compact(c)
        c.build = self._supports_due(c)
        self._router_logits(c)
        self._route(c)
        self._build_supports(c)
        self._count_paths(c)
        self._run_experts(c)
        self._add_shared(c)
        self._scatter(c)
        self._serve_cached(c)
        self._write_cache(c)
        return self._layer_output(c)

    def _fresh_rows(self, c: LayerCall) -> torch.Tensor:
        """(T,) bool: the rows the block plans send through the experts (F_i of every block)."""
        return c.R.fresh.clone()

    def _all_fresh(self, c: LayerCall) -> None:
        """The dense path: every row through the experts, none served, no support used (a due block still builds
        its support, `_supports_due`)."""
        c.idx_F = torch.arange(c.T)
        c.x_FH = c.x_TH
        c.idx_S, c.age_S = _EMPTY_IDX, _EMPTY_IDX

    def _cache_checks(self, li: int, R: Rows, idx_C, slot_C, age_C) -> dict:
        """{reason: (C,) bool failing rows} for the rows a plan wants served, in the order the reasons are named."""
        st_C3 = self.arena.stamps[li].index_select(0, slot_C)              # (written, token, version)
        return {"miss": st_C3[:, 0] == EMPTY, "version": st_C3[:, 2] != R.version[idx_C],
                "token": st_C3[:, 1] != R.token[idx_C], "age": (age_C < 1) | (age_C >= self.ecfg.refresh)}

    def _check_cache(self, c: LayerCall) -> None:
        """Cache checks of every row a plan wants served, vectorised over the batch; any doubt about a block makes
        this layer of that block fully fresh (fail closed). Sets idx_S / age_S: the rows served and their ages."""
        R = c.R
        idx_C = (~(c.fresh_T | R.dense)).nonzero(as_tuple=True)[0]          # dense blocks serve nothing
        if idx_C.numel() == 0:
            c.idx_S, c.age_S = idx_C, idx_C
            return
        slot_C = R.slot[idx_C]
        age_C = R.passes[idx_C] - self.arena.written[c.li].index_select(0, slot_C)
        checks = list(self._cache_checks(c.li, R, idx_C, slot_C, age_C).items())
        bad_C = None
        for _, fail_C in checks:
            bad_C = fail_C.clone() if bad_C is None else bad_C.logical_or_(fail_C)
        if bad_C is None or not bool(bad_C.any()):                          # the common case: serve them all
            c.idx_S, c.age_S = idx_C, age_C
            return
        bad_C = torch.zeros(idx_C.numel(), dtype=torch.bool)
        for why, fail_C in checks:
            fail_C = fail_C & ~bad_C                         # name the first failing check per row
            for p in R.plan[idx_C][fail_C].unique().tolist():
                self._fall_back(c, p, why)
            bad_C |= fail_C
        keep_C = ~c.fresh_T[idx_C]                           # rows of blocks that did not fall back
        c.idx_S, c.age_S = idx_C[keep_C], age_C[keep_C]

    def _fall_back(self, c: LayerCall, p: int, why: str) -> None:
        """Plan p's rows all go fresh at this layer, counted with the reason."""
        c.fresh_T[c.R.plan_rows[p]] = True
        c.R.plans[p].layer(c.li).paths["fallback"] += 1
        self.totals[f"fallback:{why}"] += 1
        c.paths["fallback"] += 1

    def _supports_due(self, c: LayerCall) -> list:
        """Plans whose support is (re)built this pass. A build reads the router scores of every row of the block,
        so it happens only where all of them are fresh at this layer anyway (cold, refresh and fallback passes, or
        a layer that fell back): on the cold pass, after a fallback, on the first such pass of a block that has no
        support yet (it was on the dense path before), and on the first such pass at least `update_every` passes
        after the last build. Hot passes never build (no extra router rows). A block on the dense path this pass
        (every all-fresh pass is, when the cost model finds nothing to skip) still builds when due: it routes with
        every expert now and with the support from its next epoch pass."""
        if not self.ecfg.atlas or self.ap.B >= self.config.num_experts:
            return []                   # B >= E: the initial support is every expert, nothing to build
        due, R, every = [], c.R, self.ap.update_every
        all_fresh_P = None                  # per plan: every row fresh at this layer (made when first needed)
        for p, plan in enumerate(R.plans):
            if R.dense_P[p] and not self.ecfg.lsp:
                continue                # without LSP every pass is all-fresh, so dense: a support would never be used
            lp = plan.layer(c.li)
            if not (lp.built_at < 0 or plan.path in ("cold", "fallback") or plan.passes - lp.built_at >= every):
                continue
            if plan.path == "hot" and not c.dense and not R.dense_P[p]:
                if all_fresh_P is None:
                    all_fresh_P = (torch.bincount(R.plan[c.fresh_T], minlength=len(R.plans)) ==
                                   torch.tensor(R.plan_rows.lens)).tolist()
                if not all_fresh_P[p]:
                    continue            # some rows are served: wait for the block's next all-fresh pass
            due.append(p)
        return due

    def _compact(self, c: LayerCall) -> None:
        """The fresh rows of the whole batch and every row of the dense blocks, compacted into one (F, H) buffer (the
        rows themselves when every row is fresh)."""
        c.idx_F = (c.fresh_T | c.R.dense).nonzero(as_tuple=True)[0]
        if c.idx_F.numel() == c.T:
            c.x_FH = c.x_TH
        else:
            c.x_FH = self.stages.compact(c.x_TH, c.idx_F.to(c.x_TH.device))

    def _router_logits(self, c: LayerCall) -> None:
        """Router logits of the fresh rows (a building block's rows are among them)."""
        c.logits_FE = c.moe.router_logits(c.x_FH)
        c.routed_rows = c.x_FH.shape[0]

    def _build_supports(self, c: LayerCall) -> None:
        """Expert Atlas: the candidates of every building block's rows in one call (their router logits are among the
        fresh rows': a block builds only when all its rows are fresh, `_supports_due`; and `_route` has just routed
        them with every expert, so their first K candidates are the ids it chose), then one batched greedy build
        (`atlas.build_supports`: each block's support is the one it would get alone). The new support restricts the
        block's routing from its next pass."""
        if not c.build:
            return
        R = c.R
        build_P = torch.zeros(len(R.plans), dtype=torch.bool)
        build_P[c.build] = True
        # the building rows' places among the fresh rows, in row order (= block order: c.build ascends)
        pos_G = build_P[R.plan.index_select(0, c.idx_F)].nonzero(as_tuple=True)[0]
        logits_GE = c.logits_FE.index_select(0, pos_G.to(c.logits_FE.device))
        top_GK = c.ids_FK.index_select(0, pos_G.to(c.ids_FK.device))
        w_GJ, id_GJ, mass_G = (t.cpu() for t in candidates(logits_GE, c.moe.expert_bias, self.config, self.ap.m,
                                                            top_GK))
        lens = [R.plan_rows.lens[p] for p in c.build]
        results = build_supports(w_GJ, id_GJ, mass_G, lens, self.config.num_experts, self.ap)
        sizes = torch.stack([res.support for res in results]).sum(1).tolist()
        for p, res, size in zip(c.build, results, sizes):
            self._set_support(c.li, R.plans[p], res, size)

    def _set_support(self, li: int, plan: BlockPlan, res, size: int) -> None:
        """Keep a build's support of `size` experts (a support of every expert is kept as None: the plain router); a
        failed build fails closed to all experts (counted)."""
        lp = plan.layer(li)
        lp.built_at, lp.support_ok, lp.under = plan.passes, res.success, res.under
        full = size >= self.config.num_experts
        lp.support = res.support if res.success and not full else None
        lp.support_size = size if lp.support is not None else None
        if not res.success:
            self.totals["fallback:atlas"] += 1
            lp.paths["fallback:atlas"] += 1
        lp.paths["support_build"] += 1

    def _count_paths(self, c: LayerCall) -> None:
        """One path counter per layer per block per pass (hot passes split into hot-update / hot-skip; every block
        on the dense path this pass counts `dense`)."""
        build = set(c.build)
        for p, plan in enumerate(c.R.plans):
            path = "dense" if c.dense or c.R.dense_P[p] else plan.path
            if path == "hot":
                path = "hot-update" if p in build else "hot-skip"
            plan.layer(c.li).paths[path] += 1
            c.paths[path] += 1

    def _routing_support(self, li: int, plan: BlockPlan) -> Optional[torch.Tensor]:
        """(E,) bool: the experts a row of `plan` may be routed to at layer li; None = every expert."""
        return plan.layer(li).support

    def _allowed(self, li: int, R: Rows, idx_X: torch.Tensor, device, plain=()) -> Optional[torch.Tensor]:
        """(X, E) bool: each row's routing support (its block's S_l; every expert for a dense block and for the
        blocks in `plain`); None when no block restricts it. Routing within every expert is the plain router bit
        for bit (tests/optimized)."""
        sups = [None if R.dense_P[p] or p in plain else self._routing_support(li, plan)
                for p, plan in enumerate(R.plans)]
        if all(sup is None for sup in sups):
            return None
        every = torch.ones(self.config.num_experts, dtype=torch.bool)
        S_PE = torch.stack([every if sup is None else sup for sup in sups])
        return S_PE[R.plan[idx_X]].to(device)

    def _route_rows(self, moe, logits_XE: torch.Tensor, allowed_XE: Optional[torch.Tensor]):
        """The model's rule, restricted when `allowed_XE` is given, else the plain router."""
        if allowed_XE is None:
            route_all = getattr(self.stages, "route_all", None)
            if route_all is not None:
                return route_all(logits_XE, moe.expert_bias, self.config)
            allowed_XE = torch.ones(logits_XE.shape, dtype=torch.bool, device=logits_XE.device)
        return self.stages.route(logits_XE, moe.expert_bias, self.config, allowed_XE)

    def _route(self, c: LayerCall) -> None:
        """The model's routing rule on the fresh rows, restricted to their block's support -> ids_FK, w_FK. A block
        that builds its support this pass (all its rows fresh) routes with every expert, as on the dense path: its
        first K candidates are then the ids chosen here. The plain router when no block of the call restricts it."""
        allowed_FE = None if c.dense else self._allowed(c.li, c.R, c.idx_F, c.x_TH.device, plain=set(c.build))
        c.ids_FK, c.w_FK = self._route_rows(c.moe, c.logits_FE, allowed_FE)
        if allowed_FE is not None:
            c.ids_FK, c.w_FK = self._cover_fresh(c, allowed_FE, c.ids_FK, c.w_FK)

    def _cover_fresh(self, c: LayerCall, allowed_FE: torch.Tensor, ids_FK: torch.Tensor, w_FK: torch.Tensor):
        """Per-token fail-closed on hot passes (docs/algorithms.md §4.2): a fresh row whose support-restricted
        choice keeps less than α of its own dense top-K routing mass (at this pass's scores) is routed again with
        every expert. A support is built from the rows of an all-fresh pass; a row decoded since (its token no
        longer MASK) can want experts the build never saw, and a restriction applied before group scoring can also
        deselect a group that holds one of its top-K. Counted in `stats()["atlas_hot"]`: rows routed within a
        support, those opened, and the (layer, block) calls whose opened rows stay within the quota (1 − q)·N."""
        restricted_F = ~allowed_FE.all(1)
        if not bool(restricted_F.any()):
            return ids_FK, w_FK
        w, b = router_scores(c.logits_FE, c.moe.expert_bias, self.config)
        I = choose(b, self.config, finite=True).indices              # the dense top-K choice, as `candidates`
        W = w.gather(1, I)
        kept = (I.unsqueeze(2) == ids_FK.unsqueeze(1)).any(2)         # dense choices the restricted choice kept
        under_F = restricted_F & ((W * kept.to(W.dtype)).sum(-1) < self.ap.alpha * W.sum(-1) - 1e-9)
        n_under = int(under_F.sum())
        plan_F = c.R.plan[c.idx_F.cpu()]
        P = len(c.R.plans)
        rows_P = torch.bincount(plan_F[restricted_F.cpu()], minlength=P)
        under_P = torch.bincount(plan_F[under_F.cpu()], minlength=P)
        n_P = torch.tensor(c.R.plan_rows.lens, dtype=torch.float64)
        calls = rows_P > 0
        h = self.atlas_hot
        for p in calls.nonzero(as_tuple=True)[0].tolist():        # the support each restricted block routed within
            lp = c.R.plans[p].layer(c.li)
            h["support_sum"] += lp.support_size if lp.support_size is not None else int(lp.support.sum())
        h["rows"] += int(restricted_F.sum())
        h["under"] += n_under
        h["calls"] += int(calls.sum())
        h["calls_within_quota"] += int((calls & (under_P.double() <= (1 - self.ap.q) * n_P)).sum())
        c.open_F = under_F
        if n_under and self.ecfg.atlas_repair:
            self._repair_supports(c, under_F, plan_F, I)
        if n_under:
            ids_U, w_U = self._route_rows(c.moe, c.logits_FE[under_F], None)
            ids_FK, w_FK = ids_FK.clone(), w_FK.clone()
            ids_FK[under_F], w_FK[under_F] = ids_U.to(ids_FK.dtype), w_U.to(w_FK.dtype)
        return ids_FK, w_FK

    def _repair_supports(self, c: LayerCall, under_F: torch.Tensor, plan_F: torch.Tensor, I_FK: torch.Tensor):
        """Hot repair: the dense top-K experts of the rows just opened join their block's support S_l, so that the
        block's later hot passes cover them (a support only grows between builds; the next build starts over)."""
        E = self.config.num_experts
        for p in plan_F[under_F.cpu()].unique().tolist():
            lp = c.R.plans[p].layer(c.li)
            if lp.support is None:
                continue
            add = torch.zeros(E, dtype=torch.bool)
            add[I_FK[under_F & (plan_F == p).to(under_F.device)].flatten().cpu()] = True
            lp.support = lp.support | add
            n0 = lp.support_size if lp.support_size is not None else int(lp.support.sum())
            lp.support_size = int(lp.support.sum())
            self.atlas_hot["repaired_experts"] += lp.support_size - n0

    def routes_plain(self, c: LayerCall, p: int) -> bool:
        """Whether plan p's fresh rows were routed with every expert in this call (`_route`): the call or the block
        took the dense path, or the block builds its support this pass."""
        return c.dense or bool(c.R.dense_P[p]) or p in c.build

    def _run_experts(self, c: LayerCall) -> None:
        """FreshLane over the short worklist: the dispatcher groups the (row, expert) pairs by expert, runs the
        expert MLPs (the stages' `experts`; on the dense path their `experts_exact` where they have one: the
        reference's arithmetic) and combines the weighted partial sums -> y_FH, comm."""
        moe = c.moe
        extra = self._all_rows(c) if getattr(self.dispatcher, "wants_all_rows", False) else {}   # ep.EPDispatcher
        run = (getattr(self.stages, "experts_exact", None) if c.dense else None) or self.stages.experts

        def experts(x_XH, ids_XK, w_XK):
            return run(x_XH, ids_XK, w_XK, moe.w_gate, moe.w_up, moe.w_down)
        c.y_FH, c.comm = self.dispatcher.run(c.x_FH, c.ids_FK, c.w_FK, experts, **extra)

    def _all_rows(self, c: LayerCall) -> dict:
        """Every valid row of the call routed within its block's support, for a dispatcher that owns rows by
        position in the full shard and runs or counts the dense dispatch (`dblock.optimized.ep`). Fresh rows keep
        the routing computed above (bit for bit); the other rows' router logits are computed here."""
        T = c.T
        ids_FK, w_FK = c.ids_FK, c.w_FK
        if c.idx_F.numel() == T:
            return {"x_all": c.x_TH, "ids_all": ids_FK, "w_all": w_FK, "idx_fresh": c.idx_F}
        rest_T = torch.ones(T, dtype=torch.bool)
        rest_T[c.idx_F] = False
        idx_O = rest_T.nonzero(as_tuple=True)[0]
        dev = c.x_TH.device
        ids_TK = torch.full((T, ids_FK.shape[1]), -1, dtype=ids_FK.dtype, device=ids_FK.device)
        w_TK = torch.zeros((T, w_FK.shape[1]), dtype=w_FK.dtype, device=w_FK.device)
        ids_TK[c.idx_F], w_TK[c.idx_F] = ids_FK, w_FK
        logits_OE = c.moe.router_logits(c.x_TH[idx_O.to(dev)])
        ids_OK, w_OK = self._route_rows(c.moe, logits_OE, self._allowed(c.li, c.R, idx_O, dev))
        ids_TK[idx_O], w_TK[idx_O] = ids_OK.to(ids_TK.device), w_OK.to(w_TK.device)
        return {"x_all": c.x_TH, "ids_all": ids_TK, "w_all": w_TK, "idx_fresh": c.idx_F}

    def _add_shared(self, c: LayerCall) -> None:
        """The shared expert on the fresh rows, added to their routed output: the MoE block's output of a fresh row,
        what the cache keeps for it (a stable row's shared expert is served from the cache with its routed
        experts, under the same age bound)."""
        y_FH = c.y_FH.to(c.x_FH.dtype)                  # the dispatcher's own buffer (or a cast copy)
        if c.moe.shared is not None:
            y_FH.add_(c.moe.shared(c.x_FH))
        c.y_FH = y_FH

    def _scatter(self, c: LayerCall) -> None:
        """The fresh rows' outputs back to their places among the T rows (others zero) -> y_TH."""
        y_FH = c.y_FH.to(c.x_TH.dtype)
        if c.idx_F.numel() == c.T:                           # every row fresh: already in row order
            c.y_TH = y_FH
        else:
            c.y_TH = self.stages.scatter(y_FH, c.idx_F.to(y_FH.device), c.T)

    def _serve_cached(self, c: LayerCall) -> None:
        """Stable decoded rows take their cached MoE output (routed + shared experts); their ages go to the age
        histogram (folded when read)."""
        if c.idx_S.numel():
            dev = c.y_TH.device
            c.y_TH.index_copy_(0, c.idx_S.to(dev), self.arena.values[c.li].index_select(0, c.R.slot[c.idx_S].to(dev)))
            self._ages.append(c.age_S)

    def _rows_to_write(self, c: LayerCall) -> torch.Tensor:
        """(T,) bool: fresh decoded rows (live rows are never cached: they feed a decision every pass)."""
        return c.fresh_T & c.R.decoded

    def _write_cache(self, c: LayerCall) -> None:
        """Write the MoE outputs (routed + shared) of `_rows_to_write`, stamped with pass, token and plan version
        (one scatter of values and one of stamps)."""
        idx_W = self._rows_to_write(c).nonzero(as_tuple=True)[0]
        if idx_W.numel():
            R = c.R
            self.arena.write(c.li, R.slot[idx_W], c.y_TH.index_select(0, idx_W.to(c.y_TH.device)), R.stamp[idx_W])

    def _layer_output(self, c: LayerCall) -> torch.Tensor:
        """The MoE output back in the padded (B, L, H) layout; the layer's statistics record."""
        B, L, H = c.xn_BLH.shape
        y_TH = c.y_TH                                   # in the model's dtype since `_add_shared`
        if c.R.padded:
            out = torch.zeros(B * L, H, dtype=c.xn_BLH.dtype, device=c.xn_BLH.device)
            out.index_copy_(0, c.R.flat.to(out.device), y_TH)
        else:
            out = y_TH
        self._layer_recs.append(self._layer_record(c))
        self._comm.add(c.comm)
        return out.view(B, L, H)

    def _layer_record(self, c: LayerCall) -> tuple:
        """What `_stats_of` needs, kept without reading any tensor back (no host synchronisation per layer)."""
        E = self.config.num_experts
        sizes = [E if lp.support is None else (lp.support_size or int(lp.support.sum()))
                 for lp in (plan.layer(c.li) for plan in c.R.plans)]
        return (c.li, "dense" if c.dense else "epoch", c.idx_F.numel(), c.idx_S.numel(), c.T, c.routed_rows,
                dict(c.paths), sum(sizes) / max(1, len(sizes)), c.ids_FK)

    def _stats_of(self, rec: tuple) -> dict:
        """The per-layer record of `last_pass_stats()["layers"]` (docs/counters.md)."""
        li, path, F, S, T, routed, paths, support, ids_FK = rec
        used = ids_FK[ids_FK >= 0]
        return {"layer": li, "path": path, "fresh": F, "cached": S, "support": support, "paths": paths,
                "pairs": int(used.numel()), "routed_rows": routed, "rows": T,
                "experts_used": int(used.unique().numel())}

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
        past = stack_past(items, self.config.num_hidden_layers, mask.shape[2] - L)
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
        self._end_pass(R, t0, c0, moe_s, moe_cpu_s)
        return out

    def _end_pass(self, R: Rows, t0: float, c0: float, moe_s: float, moe_cpu_s: float) -> None:
        """The executor's running totals now; the pass's statistics (`last_pass_stats`) when first read."""
        recs, comm = self._layer_recs, self._comm
        for rec in recs:
            self.totals.update(rec[6])
        self.pass_paths[R.path] += 1
        timing = {"moe_s": moe_s, "moe_cpu_s": moe_cpu_s, "executor_s": time.perf_counter() - t0,
                  "executor_cpu_s": time.thread_time() - c0}
        cfg = self.config
        elem = self.model.embed.weight.element_size()

        def build() -> dict:
            layers = [self._stats_of(r) for r in recs]
            n_moe = max(1, len(layers))
            bufs = [moe_buffer_bytes(s["fresh"], s["pairs"], cfg.hidden_size, cfg.moe_intermediate_size, elem,
                                     max(4, elem)) for s in layers]
            return {**timing, "path": R.path, "fresh_frac": R.n_fresh / max(1, R.T),
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
                 atlas_c=None, path=None, path_model=None, atlas_repair=None) -> EpochConfig:
    """The EpochConfig of a named configuration with the command line's knobs (None = default, see `AtlasParams`;
    `path`: auto | epoch | dense, `path_model`: a measured `PathModel` for auto; `atlas_repair`: the hot repair of
    `_repair_supports`, on by default)."""
    cfg = EpochConfig.named(config, refresh=refresh, alpha=atlas_alpha, q=atlas_q, update_every=update_every,
                            m=atlas_m, B=atlas_B, beta=atlas_beta, c=atlas_c, path=path, path_model=path_model)
    cfg.use_triton = use_triton
    if atlas_repair is not None:
        cfg.atlas_repair = bool(atlas_repair)
    return cfg


def epoch_forward(model, config: str = "epoch", refresh=None, atlas_alpha=None, atlas_q=None, update_every=None,
                  use_triton: bool = False, dispatcher=None, atlas_m=None, atlas_B=None, atlas_beta=None,
                  atlas_c=None, path=None, path_model=None, atlas_repair=None) -> Forward:
    """The optimized executor in one of its configurations over `model`'s weights (`dense` = the reference).

    Atlas knobs (None = default, see `AtlasParams`): alpha coverage floor, q covered-token quota, m extra
    candidates, B initial support size, beta mixing weight, c experts added per repair round, update_every.
    Pass path (docs/algorithms.md §4.1): `path` auto (default: the cost rule of `PathModel`), epoch or dense;
    `path_model` a measured `PathModel` (else the cost model's).
    The equivalence suite's audited executor, with or without deliberate faults, takes the same knobs:
    `dblock.equivalence.audit.audited_epoch_forward`."""
    if config == "dense":
        if use_triton:
            raise ValueError("--use-triton applies to the epoch configurations, not dense")
        from dblock.decoding.generate import reference_forward
        return reference_forward(model)
    cfg = epoch_config(config, refresh=refresh, atlas_alpha=atlas_alpha, atlas_q=atlas_q, update_every=update_every,
                       use_triton=use_triton, atlas_m=atlas_m, atlas_B=atlas_B, atlas_beta=atlas_beta,
                       atlas_c=atlas_c, path=path, path_model=path_model, atlas_repair=atlas_repair)
    return EpochExecutor(model, cfg, dispatcher=dispatcher)
