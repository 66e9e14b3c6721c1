"""The MoE region of one layer of the Epoch executor (docs/algorithms.md §4): `MoeSteps`, the named steps that
`EpochExecutor._moe` runs over one `LayerCall` (`dblock.optimized.executor.EpochExecutor` inherits them; the
equivalence suite's audit records and deliberate faults override them from outside):
  fresh rows      `_fresh_rows`      the block plans' fresh sets F_i
  dense path      `_all_fresh`       (calls where every block chose dense) every row computed, nothing served,
                                     nothing restricted; in a mixed call the dense blocks' rows join the compacted
                                     rows, serve nothing, build no support and route with every expert
  cache checks    `_check_cache`     every row a plan wants served passes `_cache_checks`, else its block goes fully
                                     fresh for this layer (fail closed, `_fall_back`); one vectorised check per
                                     layer, the per-block naming only when something failed
  drift           `_drift_gate`      (with `EpochConfig.lsp_drift` = ε) a row that passed the cache checks but whose
                                     MoE input moved by more than ε of its norm since its entry was written is
                                     computed fresh instead (docs/algorithms.md §4.3)
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
  output          `_layer_output`    back to the padded layout, the layer's statistics record (`_layer_record`:
                                     tensors kept, read only when the statistics are asked for)

Every step reads and writes the executor's state (`self.ecfg`, `self.ap`, `self.arena`, `self.stages`,
`self.dispatcher`, the counters); the mixin has no state of its own.

Letter legend: B requests, L padded rows per request, T valid rows of the call, F fresh rows, E experts,
K experts per token, H hidden, N rows of one block, P block plans of the call, C rows a plan wants served from the
cache (candidates), S rows served from the cache, G rows of the blocks building a support, J candidates per row
(K + m), O the other (non-fresh) rows, W rows whose cache entries are written, X any subset of rows, V vocabulary.
"""
from __future__ import annotations

from typing import Optional

import torch

from dblock.optimized.atlas import build_supports, candidates, choose, router_scores
from dblock.optimized.liveness import EMPTY
from dblock.optimized.plan import BlockPlan
from dblock.optimized.rows import LayerCall, Rows

_EMPTY_IDX = torch.zeros(0, dtype=torch.long)


class MoeSteps:
    """The MoE region's steps (the table above), mixed into `EpochExecutor`."""

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
            self._drift_gate(c)
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
        self._note_approx(c)
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

    def _drift_gate(self, c: LayerCall) -> None:
        """LSP's drift bound ε (`EpochConfig.lsp_drift`, docs/algorithms.md §4.3): of the rows that passed the cache
        checks, serve only those whose MoE input x moved by at most ε of the input x_w their entry was computed at,
        ‖x − x_w‖₂ ≤ ε·‖x_w‖₂; the others join the fresh rows (computed, their entries rewritten). Per row, not per
        block: nothing is in doubt about the cache, the row has only moved too far. Sets drift_S (the served rows'
        relative drift, for the audit)."""
        eps = self.ecfg.lsp_drift
        if eps is None or c.idx_S.numel() == 0:
            return
        rel = self._served_drift(c)
        moved = ~(rel <= eps)                                # a NaN drift is not within the bound
        self.drift["checked"] += c.idx_S.numel()
        if bool(moved.any()):
            self.drift["recomputed"] += int(moved.sum())
            c.fresh_T[c.idx_S[moved]] = True
            keep = ~moved
            c.idx_S, c.age_S, rel = c.idx_S[keep], c.age_S[keep], rel[keep]
        c.drift_S = rel

    def _served_drift(self, c: LayerCall) -> torch.Tensor:
        """(S,) the relative drift ‖x − x_w‖₂ / ‖x_w‖₂ of the rows `idx_S` would serve, on the host."""
        dev = c.x_TH.device
        x_w = self.arena.inputs[c.li].index_select(0, c.R.slot[c.idx_S].to(dev))
        x = c.x_TH.index_select(0, c.idx_S.to(dev)).to(x_w.dtype)
        return ((x - x_w).norm(dim=1) / x_w.norm(dim=1).clamp_min(torch.finfo(x_w.dtype).tiny)).cpu()

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
        under = under_F.cpu()
        ids_UK = I_FK[under_F].cpu()
        add_PE = torch.zeros(len(c.R.plans), self.config.num_experts, dtype=torch.bool)
        add_PE[plan_F[under].repeat_interleave(ids_UK.shape[1]), ids_UK.flatten()] = True
        for p in add_PE.any(1).nonzero(as_tuple=True)[0].tolist():
            lp = c.R.plans[p].layer(c.li)
            if lp.support is None:
                continue
            n0 = lp.support_size if lp.support_size is not None else int(lp.support.sum())
            lp.support = lp.support | add_PE[p]
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

    def _note_approx(self, c: LayerCall) -> None:
        """With the margin gate on (`EpochConfig.margin_refresh`): mark the blocks whose MoE output at this layer is
        not the exact one — a row served from the cache, or fresh rows routed within a restricted support (a dense
        or building block routes with every expert). A block never marked at any layer computed what full_compute
        computes: its logits need no refresh (docs/algorithms.md §4.7)."""
        R = c.R
        if R.approx is None or c.dense:
            return
        if c.idx_S.numel():
            R.approx |= torch.bincount(R.plan[c.idx_S], minlength=len(R.plans)) > 0
        for p, plan in enumerate(R.plans):
            if not R.approx[p] and self._routing_support(c.li, plan) is not None and not self.routes_plain(c, p):
                R.approx[p] = True

    def _rows_to_write(self, c: LayerCall) -> torch.Tensor:
        """(T,) bool: fresh decoded rows (live rows are never cached: they feed a decision every pass)."""
        return c.fresh_T & c.R.decoded

    def _write_cache(self, c: LayerCall) -> None:
        """Write the MoE outputs (routed + shared) of `_rows_to_write`, stamped with pass, token and plan version
        (one scatter of values and one of stamps)."""
        idx_W = self._rows_to_write(c).nonzero(as_tuple=True)[0]
        if idx_W.numel():
            R = c.R
            dev = c.y_TH.device
            x_W = c.x_TH.index_select(0, idx_W.to(dev)) if self.arena.inputs is not None else None
            self.arena.write(c.li, R.slot[idx_W], c.y_TH.index_select(0, idx_W.to(dev)), R.stamp[idx_W], x_W)

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
