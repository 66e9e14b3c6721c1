"""The Epoch executor (docs/algorithms.md §4): a batched Forward over the reference model's own weight tensors (no copy).

Contract: cache stable block structure; recompute every value that feeds a live decode decision.

Per denoising call, for every in-flight block of every request (a *block plan* each):
  * liveness: D_i from the segment's decoded rows; fresh set F_i (all rows on cold / refresh / fallback passes,
    else every row but the stable decoded ones);
  * per MoE layer: shared expert, attention, norms and residuals on all rows; the routed experts only on the fresh
    rows of the whole batch, compacted into one buffer, routed with the model's rule restricted to the block's
    expert support S_l, run through FreshLane; stable decoded rows take their cached routed output;
  * the LM head only for live rows (the Forward protocol returns nothing else).
Prefill and append passes write exact K/V for committed tokens, so they run the dense path.

The MoE region of one layer (`EpochExecutor._moe`) is a pipeline of named steps over one `LayerCall`:
  fresh rows      `_fresh_rows`      the block plans' fresh sets F_i
  cache checks    `_check_cache`     every row a plan wants served passes `_cache_checks`, else its block goes fully
                                     fresh for this layer (fail closed, `_fall_back`)
  supports        `_router_logits`, `_build_supports`   router logits of the rows that need them; Expert Atlas
                                     (re)builds S_l for the blocks that are due (docs/algorithms.md §4.2)
  path counters   `_count_paths`
  compact         `_compact`         the fresh rows of the whole batch into one (F, H) buffer
  route           `_route`           the model's rule restricted to each row's `_routing_support`
  experts         `_run_experts`     FreshLane (docs/algorithms.md §4.4): the dispatcher hands the rows to the
                                     stages' `experts`, which group the (row, expert) pairs by expert, run each
                                     expert's MLP and combine the weighted outputs per row (in torch
                                     `freshlane.expert_groups` -> `swiglu` -> index_add; the Triton stack's
                                     grouped_mlp_triton); with expert parallelism dispatch and combine cross ranks
  scatter         `_scatter`         fresh outputs back among the T rows
  serve           `_serve_cached`    stable decoded rows from the decoded-output cache (docs/algorithms.md §4.3)
  write           `_write_cache`     the fresh `_rows_to_write` into the cache
  output          `_layer_output`    + shared expert, back to the padded layout, per-layer statistics
After the last layer, per segment: `_head_rows` (its live rows) -> `_segment_logits` (the LM head for them).
The stage seam (`TorchStages`: route / experts / attend / lm_head / compact / scatter) is where the Triton stack
swaps in. The production executor carries no test instrumentation and does not import the equivalence suite: the
suite's audit records and its deliberate faults subclass these steps from outside (`dblock.equivalence.audit`,
`dblock.equivalence.faults`).

Configurations (docs/algorithms.md §4.5): epoch (all on), full_compute (all experts, M_C = 1: exact), no_atlas,
no_lsp, and dense (the reference executor itself). Faults fail closed: any cache doubt makes the layer fully fresh,
an atlas failure makes the layer use all experts, both counted.

Letter legend: B requests, L padded rows per request, T valid rows of the call, F fresh rows, E experts,
K experts per token, H hidden, N rows of one block, P block plans of the call, C rows a plan wants served from the
cache (candidates), S rows served from the cache, Q rows whose router logits are computed, G rows of the blocks
building a support, J candidates per row (K + m), O the other (non-fresh) rows, W rows whose cache entries are
written, X any subset of rows.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dblock.forward import Forward, StepInput
from dblock.optimized.atlas import build_support, candidates, route_restricted
from dblock.optimized.freshlane import CommStats, LocalDispatcher, grouped_swiglu_torch
from dblock.optimized.liveness import EMPTY, CacheArena
from dblock.optimized.plan import BlockPlan, EpochConfig
from dblock.reference.executor import KVCache, LladaReference, build_layout, stack_past


class TorchStages:
    """The swappable stages of the optimized path, in torch (the stage seam, docs/architecture.md).
    `dblock.kernels.stack.TritonStages` implements the same methods with Triton kernels; `use_triton` picks it for
    the whole stack."""

    name = "torch"

    def route(self, logits_FE, bias_E, cfg, allowed_FE):
        """Support-restricted routing of the fresh rows -> ids (F, K) (-1 = no expert), weights (F, K) fp32."""
        return route_restricted(logits_FE, bias_E, cfg, allowed_FE)

    def experts(self, x_FH, ids_FK, w_FK, w_gate_EIH, w_up_EIH, w_down_EHI):
        """Grouped SwiGLU over the fresh worklist, weighted and summed over slots -> (F, H)."""
        return grouped_swiglu_torch(x_FH, ids_FK, w_FK, w_gate_EIH, w_up_EIH, w_down_EHI)

    def attend(self, attn, xn_BLH, positions_BL, mask_BLS, past_k, past_v, items):
        """Attention of every row over [committed cache ; in-flight segments] -> (B, L, H)."""
        return attn(xn_BLH, positions_BL, mask_BLS, past_k, past_v)[0]

    def lm_head(self, model, hidden_LH, live_L):
        """Logits of the live rows only (decoded rows feed no decision)."""
        return model.logits(hidden_LH[live_L])

    def compact(self, x_TH, idx_F):
        """The fresh rows, in index order -> (F, H)."""
        return x_TH[idx_F]

    def scatter(self, y_FH, idx_F, T):
        """Fresh rows back to their places among T rows, other rows zero -> (T, H)."""
        y_TH = y_FH.new_zeros(T, y_FH.shape[1])
        y_TH[idx_F] = y_FH
        return y_TH


@dataclass
class Rows:
    """Where every valid row of a call lives, and its block plan (all (T,) tensors)."""

    flat: torch.Tensor          # index into the (B*L) padded rows
    plan: torch.Tensor          # index into `plans`
    row: torch.Tensor           # row inside its block's segment
    token: torch.Tensor
    decoded: torch.Tensor
    fresh: torch.Tensor         # block-level fresh set F_i
    plans: list                 # BlockPlan per plan index
    plan_rows: list             # (n_p,) T-indices of each plan's rows, in row order
    slot: torch.Tensor          # the row's cache slot in the arena (plan base + row)
    passes: torch.Tensor        # its plan's pass index
    version: torch.Tensor       # its plan's version
    newly: torch.Tensor         # newly decoded on this pass (N_i)
    hot: torch.Tensor           # its plan is on a hot pass (not cold / refresh / fallback)


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
    paths: Counter = field(default_factory=Counter)   # this layer's path counters, over blocks
    idx_S: Optional[torch.Tensor] = None          # rows served from the cache (_check_cache)
    age_S: Optional[torch.Tensor] = None          # their cache ages
    build: list = field(default_factory=list)     # plan indices whose support is (re)built now
    idx_Q: Optional[torch.Tensor] = None          # rows whose router logits were computed (_router_logits)
    need_T: Optional[torch.Tensor] = None         # the same, as a mask
    logits_TE: Optional[torch.Tensor] = None      # router logits (zero where not computed)
    idx_F: Optional[torch.Tensor] = None          # fresh rows, in order (_compact)
    x_FH: Optional[torch.Tensor] = None
    ids_FK: Optional[torch.Tensor] = None         # routed experts of the fresh rows (-1 = none) (_route)
    w_FK: Optional[torch.Tensor] = None           # their routing weights
    y_FH: Optional[torch.Tensor] = None           # routed-expert output of the fresh rows (_run_experts)
    comm: Any = None                              # what the dispatcher moved (CommStats / EPStats)
    y_TH: Optional[torch.Tensor] = None           # routed-expert output of every row (_scatter, _serve_cached)

    @property
    def T(self) -> int:
        return self.x_TH.shape[0]


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
        self.age_hist = Counter()                # cache ages at read
        self._last: dict = {}
        self._pass = 0                           # denoising calls so far
        self.stages = TorchStages()
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

    def stats(self) -> dict:
        return {"paths": dict(self.totals), "cache_age_hist": dict(sorted(self.age_hist.items())),
                "open_plans": len(self.plans)}

    def last_pass_stats(self) -> dict:
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

    def _plan_pass(self, plan: BlockPlan, decoded_N: torch.Tensor) -> str:
        """The block's path this pass (cold / hot / refresh / fallback) and its fresh set, from its decoded rows."""
        return plan.liveness.plan_pass(decoded_N, plan.passes, self.ecfg.refresh, self.ecfg.lsp)

    def _plan_rows(self, items: list[StepInput], L: int, H: int, dtype) -> Rows:
        """Plan every segment's pass and lay its rows out in the call's T valid rows."""
        if self.arena is None:
            self.arena = CacheArena(self.config.moe_layers, H, dtype, self.device)
        flat, plan_ix, row_ix, tok, dec = [], [], [], [], []
        plans, plan_rows = [], []
        T = 0
        for b, it in enumerate(items):
            off = 0
            for s in it.segments:
                n = len(s)
                plan = self._block_plan(it.request, s.block, n)
                plan.path = self._plan_pass(plan, s.decoded.cpu())
                if plan.path == "fallback":
                    plan.invalidate()
                    self.totals[f"fallback:{plan.liveness.reason}"] += 1
                p = len(plans)
                plans.append(plan)
                plan_rows.append(torch.arange(T, T + n))
                flat.append(b * L + off + torch.arange(n))
                plan_ix.append(torch.full((n,), p))
                row_ix.append(torch.arange(n))
                tok.append(s.tokens.cpu())
                dec.append(s.decoded.cpu())
                off += n
                T += n
        plan_T = torch.cat(plan_ix)
        row_T = torch.cat(row_ix)
        per_plan = lambda f: torch.tensor([f(pl) for pl in plans], dtype=torch.long)[plan_T]  # noqa: E731
        return Rows(torch.cat(flat), plan_T, row_T, torch.cat(tok), torch.cat(dec),
                    torch.cat([pl.liveness.fresh for pl in plans]), plans, plan_rows,
                    slot=per_plan(lambda pl: pl.base) + row_T, passes=per_plan(lambda pl: pl.passes),
                    version=per_plan(lambda pl: pl.version), newly=torch.cat([pl.liveness.newly for pl in plans]),
                    hot=per_plan(lambda pl: pl.path == "hot").bool())

    # ---- the MoE region: a pipeline of named steps over one LayerCall ---------------------------------------
    def _moe(self, li: int, moe, xn_BLH: torch.Tensor, R: Rows) -> torch.Tensor:
        """Routed experts (fresh rows) + cached outputs (stable decoded rows) + shared expert -> (B, L, H)."""
        B, L, H = xn_BLH.shape
        x_TH = xn_BLH.reshape(B * L, H)[R.flat]
        c = LayerCall(li, moe, R, xn_BLH, x_TH, fresh_T=None)
        c.fresh_T = self._fresh_rows(c)
        self._check_cache(c)
        c.build = self._supports_due(c)
        self._router_logits(c)
        self._build_supports(c)
        self._count_paths(c)
        self._compact(c)
        self._route(c)
        self._run_experts(c)
        self._scatter(c)
        self._serve_cached(c)
        self._write_cache(c)
        return self._layer_output(c)

    def _fresh_rows(self, c: LayerCall) -> torch.Tensor:
        """(T,) bool: the rows the block plans send through the experts (F_i of every block)."""
        return c.R.fresh.clone()

    def _cache_checks(self, li: int, R: Rows, idx_C, slot_C, age_C) -> dict:
        """{reason: (C,) bool failing rows} for the rows a plan wants served, in the order the reasons are named."""
        A = self.arena
        return {"miss": A.written[li][slot_C] == EMPTY, "version": A.version[li][slot_C] != R.version[idx_C],
                "token": A.token[li][slot_C] != R.token[idx_C], "age": (age_C < 1) | (age_C >= self.ecfg.refresh)}

    def _check_cache(self, c: LayerCall) -> None:
        """Cache checks of every row a plan wants served, vectorised over the batch; any doubt about a block makes
        this layer of that block fully fresh (fail closed). Sets idx_S / age_S: the rows served and their ages."""
        R = c.R
        idx_C = (~c.fresh_T).nonzero(as_tuple=True)[0]
        slot_C = R.slot[idx_C]
        age_C = R.passes[idx_C] - self.arena.written[c.li][slot_C]
        bad_C = torch.zeros(idx_C.numel(), dtype=torch.bool)
        for why, fail_C in self._cache_checks(c.li, R, idx_C, slot_C, age_C).items():
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
        """Plans whose support is (re)built this pass: cold / fallback passes, and every `update_every` passes."""
        if not self.ecfg.atlas or self.ap.B >= self.config.num_experts:
            return []                   # B >= E: the initial support is every expert, nothing to build
        due = []
        for p, plan in enumerate(c.R.plans):
            lp = plan.layer(c.li)
            if (lp.support is None and lp.built_at < 0) or plan.path in ("cold", "fallback") or \
                    plan.passes - lp.built_at >= self.ap.update_every:
                due.append(p)
        return due

    def _router_logits(self, c: LayerCall) -> None:
        """Router logits of the fresh rows and of every row of a block building its support (others stay zero)."""
        c.need_T = c.fresh_T.clone()
        for p in c.build:
            c.need_T[c.R.plan_rows[p]] = True
        dtype = torch.promote_types(c.x_TH.dtype, torch.float32)
        c.logits_TE = torch.zeros(c.T, self.config.num_experts, dtype=dtype, device=c.x_TH.device)
        c.idx_Q = c.need_T.nonzero(as_tuple=True)[0]
        if c.idx_Q.numel():
            c.logits_TE[c.idx_Q] = c.moe.router_logits(c.x_TH[c.idx_Q])

    def _build_supports(self, c: LayerCall) -> None:
        """Expert Atlas: the candidates of every building block's rows in one call, then one greedy build each."""
        if not c.build:
            return
        R = c.R
        rows_G = torch.cat([R.plan_rows[p] for p in c.build])
        w_GJ, id_GJ, mass_G = (t.cpu() for t in candidates(c.logits_TE[rows_G.to(c.x_TH.device)],
                                                            c.moe.expert_bias, self.config, self.ap.m))
        a = 0
        for p in c.build:
            b = a + R.plan_rows[p].numel()
            res = build_support(w_GJ[a:b], id_GJ[a:b], mass_G[a:b], self.config.num_experts, self.ap)
            self._set_support(c.li, R.plans[p], res)
            a = b

    def _set_support(self, li: int, plan: BlockPlan, res) -> None:
        """Keep a build's support; a failed build fails closed to all experts (counted)."""
        lp = plan.layer(li)
        lp.built_at, lp.support_ok, lp.under = plan.passes, res.success, res.under
        lp.support = res.support if res.success else None
        if not res.success:
            self.totals["fallback:atlas"] += 1
            lp.paths["fallback:atlas"] += 1
        lp.paths["support_build"] += 1

    def _count_paths(self, c: LayerCall) -> None:
        """One path counter per layer per block per pass (hot passes split into hot-update / hot-skip)."""
        for p, plan in enumerate(c.R.plans):
            path = plan.path
            if path == "hot":
                path = "hot-update" if p in c.build else "hot-skip"
            plan.layer(c.li).paths[path] += 1
            c.paths[path] += 1

    def _compact(self, c: LayerCall) -> None:
        """The fresh rows of the whole batch, compacted into one (F, H) buffer."""
        c.idx_F = c.fresh_T.nonzero(as_tuple=True)[0]
        c.x_FH = self.stages.compact(c.x_TH, c.idx_F)

    def _routing_support(self, li: int, plan: BlockPlan) -> Optional[torch.Tensor]:
        """(E,) bool: the experts a row of `plan` may be routed to at layer li; None = every expert."""
        return plan.layer(li).support

    def _allowed(self, li: int, R: Rows, idx_X: torch.Tensor, device) -> torch.Tensor:
        """(X, E) bool: each row's routing support (its block's S_l, or every expert)."""
        sups = [self._routing_support(li, plan) for plan in R.plans]
        E = self.config.num_experts
        if all(sup is None for sup in sups):
            return torch.ones(idx_X.numel(), E, dtype=torch.bool, device=device)
        every = torch.ones(E, dtype=torch.bool)
        S_PE = torch.stack([every if sup is None else sup for sup in sups])
        return S_PE[R.plan[idx_X]].to(device)

    def _route(self, c: LayerCall) -> None:
        """The model's routing rule on the fresh rows, restricted to their block's support -> ids_FK, w_FK."""
        allowed_FE = self._allowed(c.li, c.R, c.idx_F, c.x_TH.device)
        c.ids_FK, c.w_FK = self.stages.route(c.logits_TE[c.idx_F], c.moe.expert_bias, self.config, allowed_FE)

    def _run_experts(self, c: LayerCall) -> None:
        """FreshLane over the short worklist: the dispatcher groups the (row, expert) pairs by expert, runs the
        expert MLPs (the stages' `experts`) and combines the weighted partial sums -> y_FH, comm."""
        moe = c.moe
        extra = self._all_rows(c) if getattr(self.dispatcher, "wants_all_rows", False) else {}   # ep.EPDispatcher

        def experts(x_XH, ids_XK, w_XK):
            return self.stages.experts(x_XH, ids_XK, w_XK, moe.w_gate, moe.w_up, moe.w_down)
        c.y_FH, c.comm = self.dispatcher.run(c.x_FH, c.ids_FK, c.w_FK, experts, **extra)

    def _all_rows(self, c: LayerCall) -> dict:
        """Every valid row of the call routed within its block's support, for a dispatcher that owns rows by
        position in the full shard and runs or counts the dense dispatch (`dblock.optimized.ep`). Fresh rows keep
        the routing computed above (bit for bit); the other rows' router logits are computed here."""
        T, E = c.logits_TE.shape
        ids_FK, w_FK = c.ids_FK, c.w_FK
        rest_T = torch.ones(T, dtype=torch.bool)
        rest_T[c.idx_F] = False
        idx_O = rest_T.nonzero(as_tuple=True)[0]
        ids_TK = torch.full((T, ids_FK.shape[1]), -1, dtype=ids_FK.dtype, device=ids_FK.device)
        w_TK = torch.zeros((T, w_FK.shape[1]), dtype=w_FK.dtype, device=w_FK.device)
        ids_TK[c.idx_F], w_TK[c.idx_F] = ids_FK, w_FK
        if idx_O.numel():
            miss = idx_O[~c.need_T[idx_O]]
            logits_TE = c.logits_TE.clone()
            if miss.numel():
                logits_TE[miss] = c.moe.router_logits(c.x_TH[miss])
            allowed_OE = self._allowed(c.li, c.R, idx_O, c.x_TH.device)
            ids_OK, w_OK = self.stages.route(logits_TE[idx_O], c.moe.expert_bias, self.config, allowed_OE)
            ids_TK[idx_O], w_TK[idx_O] = ids_OK.to(ids_TK.device), w_OK.to(w_TK.device)
        return {"x_all": c.x_TH, "ids_all": ids_TK, "w_all": w_TK, "idx_fresh": c.idx_F}

    def _scatter(self, c: LayerCall) -> None:
        """The fresh rows' outputs back to their places among the T rows (others zero) -> y_TH."""
        c.y_TH = self.stages.scatter(c.y_FH.to(c.x_TH.dtype), c.idx_F, c.T)

    def _serve_cached(self, c: LayerCall) -> None:
        """Stable decoded rows take their cached routed output; their ages go to the age histogram."""
        c.y_TH[c.idx_S] = self.arena.values[c.li][c.R.slot[c.idx_S]]
        if c.idx_S.numel():
            self.age_hist.update(dict(zip(*[t.tolist() for t in c.age_S.unique(return_counts=True)])))

    def _rows_to_write(self, c: LayerCall) -> torch.Tensor:
        """(T,) bool: fresh decoded rows (live rows are never cached: they feed a decision every pass)."""
        return c.fresh_T & c.R.decoded

    def _write_cache(self, c: LayerCall) -> None:
        """Write the routed outputs of `_rows_to_write`, stamped with pass, token and plan version."""
        idx_W = self._rows_to_write(c).nonzero(as_tuple=True)[0]
        if idx_W.numel():
            A, R, li = self.arena, c.R, c.li
            slot_W = R.slot[idx_W]
            A.values[li][slot_W] = c.y_TH[idx_W]
            A.written[li][slot_W], A.token[li][slot_W], A.version[li][slot_W] = \
                R.passes[idx_W], R.token[idx_W], R.version[idx_W]

    def _layer_output(self, c: LayerCall) -> torch.Tensor:
        """Routed + shared expert back in the padded (B, L, H) layout; the layer's statistics."""
        B, L, H = c.xn_BLH.shape
        y_TH = c.y_TH
        if c.moe.shared is not None:
            y_TH = y_TH + c.moe.shared(c.x_TH)
        out = torch.zeros(B * L, H, dtype=c.xn_BLH.dtype, device=c.xn_BLH.device)
        out[c.R.flat] = y_TH
        self._layer_stats.append(self._stats_of(c))
        self._comm.add(c.comm)
        return out.view(B, L, H)

    def _stats_of(self, c: LayerCall) -> dict:
        """The per-layer record of `last_pass_stats()["layers"]` (docs/counters.md)."""
        E = self.config.num_experts
        sizes = [E if sup is None else int(sup.sum()) for sup in (plan.layer(c.li).support for plan in c.R.plans)]
        used = c.ids_FK[c.ids_FK >= 0]
        return {"layer": c.li, "fresh": int(c.idx_F.numel()), "cached": int(c.idx_S.numel()),
                "support": sum(sizes) / max(1, len(sizes)), "paths": dict(c.paths), "pairs": int(used.numel()),
                "routed_rows": int(c.idx_Q.numel()), "rows": c.T, "experts_used": int(used.unique().numel())}

    # ---- the LM head --------------------------------------------------------------------------------------
    def _head_rows(self, s, device) -> torch.Tensor:
        """(N,) bool: the segment's rows the LM head runs for — its live rows."""
        return s.live.to(device)

    def _segment_logits(self, it: StepInput, s, hidden_NH: torch.Tensor, rows_N: torch.Tensor) -> torch.Tensor:
        """Logits of the segment's `rows_N`."""
        return self.stages.lm_head(self.model, hidden_NH, rows_N)

    # ---- the denoising call -------------------------------------------------------------------------------
    @torch.no_grad()
    def denoise(self, items: list[StepInput]) -> list[list[torch.Tensor]]:
        t0 = time.perf_counter()
        model = self.model
        tokens, positions, mask, valid, lens, cache_lens = build_layout(items, self.device)
        B, L = tokens.shape
        past = stack_past(items, self.config.num_hidden_layers, mask.shape[2] - L)
        R = self._plan_rows(items, L, self.config.hidden_size, model.embed.weight.dtype)
        # a dispatcher may keep richer per-pass stats (ep.EPStats: per rank, FreshLane and dense)
        new_stats = getattr(self.dispatcher, "new_stats", CommStats)
        self._layer_stats, self._comm, moe_s = [], new_stats(), 0.0
        x = model.embed(tokens)                                              # (B, L, H)
        for li, layer in enumerate(model.layers):
            pk, pv = past[li] if past is not None else (None, None)
            a = self.stages.attend(layer.attn, layer.attn_norm(x), positions, mask, pk, pv, items)
            h = x + a
            if not layer.is_moe:
                x = h + layer.mlp(layer.mlp_norm(h))
                continue
            tm = time.perf_counter()
            x = h + self._moe(li, layer.mlp, layer.mlp_norm(h), R)
            moe_s += time.perf_counter() - tm
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
        self._end_pass(t0, moe_s)
        return out

    def _end_pass(self, t0: float, moe_s: float) -> None:
        """The pass's statistics (`last_pass_stats`) and the executor's running totals."""
        n_moe = max(1, len(self._layer_stats))
        self._last = {
            "moe_s": moe_s, "executor_s": time.perf_counter() - t0,
            "fresh": sum(s["fresh"] for s in self._layer_stats) / n_moe,
            "layers": self._layer_stats,
            "comm": self._comm.as_dict() if hasattr(self._comm, "as_dict") else
                    {"dispatch_rows": self._comm.dispatch_rows, "dispatch_bytes": self._comm.dispatch_bytes,
                     "combine_bytes": self._comm.combine_bytes, "messages": self._comm.messages},
        }
        for s in self._layer_stats:
            self.totals.update(s["paths"])
        self._pass += 1


def epoch_config(config: str = "epoch", refresh=None, atlas_alpha=None, atlas_q=None, update_every=None,
                 use_triton: bool = False, atlas_m=None, atlas_B=None, atlas_beta=None,
                 atlas_c=None) -> EpochConfig:
    """The EpochConfig of a named configuration with the command line's knobs (None = default, see `AtlasParams`)."""
    cfg = EpochConfig.named(config, refresh=refresh, alpha=atlas_alpha, q=atlas_q, update_every=update_every,
                            m=atlas_m, B=atlas_B, beta=atlas_beta, c=atlas_c)
    cfg.use_triton = use_triton
    return cfg


def epoch_forward(model, config: str = "epoch", refresh=None, atlas_alpha=None, atlas_q=None, update_every=None,
                  use_triton: bool = False, dispatcher=None, atlas_m=None, atlas_B=None, atlas_beta=None,
                  atlas_c=None) -> Forward:
    """The optimized executor in one of its configurations over `model`'s weights (`dense` = the reference).

    Atlas knobs (None = default, see `AtlasParams`): alpha coverage floor, q covered-token quota, m extra
    candidates, B initial support size, beta mixing weight, c experts added per repair round, update_every.
    The equivalence suite's audited executor, with or without deliberate faults, takes the same knobs:
    `dblock.equivalence.audit.audited_epoch_forward`."""
    if config == "dense":
        if use_triton:
            raise ValueError("--use-triton applies to the epoch configurations, not dense")
        from dblock.decoding.generate import reference_forward
        return reference_forward(model)
    cfg = epoch_config(config, refresh=refresh, atlas_alpha=atlas_alpha, atlas_q=atlas_q, update_every=update_every,
                       use_triton=use_triton, atlas_m=atlas_m, atlas_B=atlas_B, atlas_beta=atlas_beta,
                       atlas_c=atlas_c)
    return EpochExecutor(model, cfg, dispatcher=dispatcher)
