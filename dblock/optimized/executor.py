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

Configurations (docs/algorithms.md §4.5): epoch (all on), full_compute (all experts, M_C = 1: exact), no_atlas, no_lsp, and
dense (the reference executor itself). Faults fail closed: any cache doubt makes the layer fully fresh, an atlas
failure makes the layer use all experts, both counted.

Letter legend: B requests, L padded rows per request, T valid rows of the call, F fresh rows, E experts,
K experts per token, H hidden, N rows of one block.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace

import torch

from dblock.forward import Forward, StepInput
from dblock.optimized.atlas import build_support, candidates, route_restricted
from dblock.optimized.freshlane import CommStats, LocalDispatcher, grouped_swiglu_torch
from dblock.optimized.liveness import EMPTY, CacheArena
from dblock.optimized.plan import BlockPlan, EpochConfig
from dblock.reference.executor import KVCache, LladaReference, build_layout, stack_past


class TorchStages:
    """The swappable stages of the optimized path, in torch (DESIGN "seams"). `dblock.kernels.stack.TritonStages`
    implements the same methods with Triton kernels; `use_triton` picks it for the whole stack."""

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


class EpochExecutor(Forward):
    name = "epoch"

    def __init__(self, model, cfg: EpochConfig | None = None, dispatcher=None, audit: bool = False):
        if model.config.family not in ("llada2_moe", "llada_moe"):
            raise ValueError(f"the epoch executor runs the LLaDA families; {model.config.family} has no decoded "
                             "positions before commit (uniform-state), use --executor reference")
        self.model, self.config = model, model.config
        self.ecfg = cfg or EpochConfig()
        self.ap = self.ecfg.atlas_params.resolved(self.config.num_experts, self.config.num_experts_per_tok)
        if "route-outside-support" in self.ecfg.inject:  # fault: tiny supports (B = K) so an outside exists
            self.ap = replace(self.ap, B=min(self.ap.B, self.config.num_experts_per_tok))
        self.reference = LladaReference(model)
        self.dispatcher = dispatcher or LocalDispatcher(self.config.num_experts)
        self.plans: dict = {}
        self.arena = None                        # CacheArena, made on the first denoising call (dtype, device)
        self.audit = [] if audit else None       # per (pass, block, layer) records for the equivalence suite
        self.audit_heads = [] if audit else None  # per (pass, block) rows the LM head ran for (equivalence suite)
        self.taps = None                         # equivalence suite: a dict -> per MoE layer "routed", "moe_in"
        self.totals = Counter()                  # paths and fallbacks over the executor's life
        self.age_hist = Counter()                # cache ages at read
        self._last: dict = {}
        self._pass = 0
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

    # ---- planning -----------------------------------------------------------------------------------------
    def _plan_rows(self, items: list[StepInput], L: int, H: int, dtype) -> Rows:
        if self.arena is None:
            self.arena = CacheArena(self.config.moe_layers, H, dtype, self.device)
        flat, plan_ix, row_ix, tok, dec = [], [], [], [], []
        plans, plan_rows = [], []
        T = 0
        refresh = self.ecfg.refresh
        if "stale-cache" in self.ecfg.inject:    # fault: the refresh clock never fires, entries age past M_C
            refresh = 1 << 30
        for b, it in enumerate(items):
            off = 0
            for s in it.segments:
                n = len(s)
                key = (it.request, s.block)
                plan = self.plans.get(key)
                if plan is None or plan.N != n:
                    if plan is not None:                 # the block's shape changed: nothing of it survives
                        self.totals["fallback:shape"] += 1
                        self._drop(plan)
                    plan = BlockPlan(it.request, s.block, n, self.config.num_hidden_layers)
                    plan.base = self.arena.alloc(n)
                    self.plans[key] = plan
                plan.path = plan.liveness.plan_pass(s.decoded.cpu(), plan.passes, refresh, self.ecfg.lsp)
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

    # ---- the MoE region -----------------------------------------------------------------------------------
    def _moe(self, li: int, moe, xn: torch.Tensor, R: Rows) -> torch.Tensor:
        B, L, H = xn.shape
        xn_T = xn.reshape(B * L, H)[R.flat]                                  # (T, H)
        T = xn_T.shape[0]
        E = self.config.num_experts
        fresh = R.fresh.clone()
        layer_paths = Counter()
        A = self.arena
        written = A.written[li]
        if "cache-newly-decoded" in self.ecfg.inject:  # fault: serve newly decoded rows from the entry written
            fresh[R.newly & R.hot & (written[R.slot] != EMPTY)] = False   # while they were still live
        # 1) cache checks for every row a plan wants to serve, vectorised over the batch; any doubt about a block
        #    makes this layer of that block fully fresh (fail closed)
        idx_S = (~fresh).nonzero(as_tuple=True)[0]
        slots = R.slot[idx_S]
        w_S = written[slots]
        ages = R.passes[idx_S] - w_S
        checks = {"miss": w_S == EMPTY, "version": A.version[li][slots] != R.version[idx_S],
                  "token": A.token[li][slots] != R.token[idx_S], "age": (ages < 1) | (ages >= self.ecfg.refresh)}
        if self.ecfg.inject & {"cache-newly-decoded", "stale-cache"}:   # faults: serve without checking
            checks = {}
        bad = torch.zeros(idx_S.numel(), dtype=torch.bool)
        for why, c in checks.items():
            c = c & ~bad                                     # name the first failing check per row
            for p in R.plan[idx_S][c].unique().tolist():
                fresh[R.plan_rows[p]] = True
                R.plans[p].layer(li).paths["fallback"] += 1
                self.totals[f"fallback:{why}"] += 1
                layer_paths["fallback"] += 1
            bad |= c
        keep = ~fresh[idx_S]                                 # rows of blocks that did not fall back
        idx_served, ages_served = idx_S[keep], ages[keep]
        # 2) expert supports: (re)build on cold / fallback / update passes from this pass's router scores
        build = []
        if self.ecfg.atlas and self.ap.B < E:   # B >= E: the initial support is every expert, nothing to build
            for p, plan in enumerate(R.plans):
                lp = plan.layer(li)
                due = (lp.support is None and lp.built_at < 0) or plan.path in ("cold", "fallback") or \
                    plan.passes - lp.built_at >= self.ap.update_every
                if due:
                    build.append(p)
        need = fresh.clone()
        for p in build:
            need[R.plan_rows[p]] = True
        dev = xn.device          # activations live with the model; liveness bookkeeping stays on the host
        logits_T = torch.zeros(T, E, dtype=torch.promote_types(xn.dtype, torch.float32), device=dev)
        idx_need = need.nonzero(as_tuple=True)[0]
        if idx_need.numel():
            logits_T[idx_need] = moe.router_logits(xn_T[idx_need])
        bias = moe.expert_bias
        if build:   # candidates of every building block's rows in one call, then one greedy build per block
            rows_B = torch.cat([R.plan_rows[p] for p in build])
            W_B, I_B, R_B = (t.cpu() for t in candidates(logits_T[rows_B.to(dev)], bias, self.config, self.ap.m))
            starts = [0]
            for p in build:
                starts.append(starts[-1] + R.plan_rows[p].numel())
        for j, p in enumerate(build):
            plan = R.plans[p]
            lp = plan.layer(li)
            a, b = starts[j], starts[j + 1]
            res = build_support(W_B[a:b], I_B[a:b], R_B[a:b], E, self.ap)
            lp.built_at, lp.support_ok, lp.under = plan.passes, res.success, res.under
            lp.support = res.support if res.success else None               # fail closed: all experts
            if not res.success:
                self.totals["fallback:atlas"] += 1
                lp.paths["fallback:atlas"] += 1
            lp.paths["support_build"] += 1
        # 3) path counters (one per layer per block per pass)
        for p, plan in enumerate(R.plans):
            lp = plan.layer(li)
            if plan.path == "hot":
                path = "hot-update" if p in build else "hot-skip"
            else:
                path = plan.path
            lp.paths[path] += 1
            layer_paths[path] += 1
        # 4) compact the fresh rows of the whole batch and route them within their block's support
        idx_F = fresh.nonzero(as_tuple=True)[0]                              # (F,)
        x_F = self.stages.compact(xn_T, idx_F)                               # (F, H)
        sups = [plan.layer(li).support for plan in R.plans]
        support_sizes = [E if sup is None else int(sup.sum()) for sup in sups]
        if all(sup is None for sup in sups) or "route-outside-support" in self.ecfg.inject:
            allowed = torch.ones(idx_F.numel(), E, dtype=torch.bool, device=dev)
        else:
            every = torch.ones(E, dtype=torch.bool)
            S_PE = torch.stack([every if sup is None else sup for sup in sups])        # (P, E)
            allowed = S_PE[R.plan[idx_F]].to(dev)                                     # (F, E)
        ids, w = self.stages.route(logits_T[idx_F], bias, self.config, allowed)
        # 5) FreshLane: experts over the short worklist
        extra = {}
        if getattr(self.dispatcher, "wants_all_rows", False):     # ep.EPDispatcher
            extra = self._route_all_rows(li, moe, xn_T, logits_T, need, idx_F, ids, w, R)
        y_F, comm = self.dispatcher.run(
            x_F, ids, w, lambda x, i, wt: self.stages.experts(x, i, wt, moe.w_gate, moe.w_up, moe.w_down), **extra)
        # 6) merge: fresh rows from the experts, stable decoded rows from the cache; write decoded fresh rows
        y_T = self.stages.scatter(y_F.to(xn.dtype), idx_F, T)
        y_T[idx_served] = A.values[li][R.slot[idx_served]]
        served = int(idx_served.numel())
        if served:
            self.age_hist.update(dict(zip(*[t.tolist() for t in ages_served.unique(return_counts=True)])))
        wr = fresh & R.decoded
        if "cache-newly-decoded" in self.ecfg.inject:   # deliberately wrong: also cache live rows
            wr = fresh.clone()
        idx_W = wr.nonzero(as_tuple=True)[0]
        if idx_W.numel():
            sl = R.slot[idx_W]
            A.values[li][sl] = y_T[idx_W]
            written[sl], A.token[li][sl], A.version[li][sl] = R.passes[idx_W], R.token[idx_W], R.version[idx_W]
        if self.audit is not None:
            self._audit(li, R, fresh, idx_served, ages_served, idx_F, ids)
        if self.taps is not None:  # equivalence suite: routed output per row, after merge, before the shared expert
            full = torch.zeros(B * L, H, dtype=xn.dtype, device=dev)
            full[R.flat] = y_T
            self.taps.setdefault("routed", []).append(full.view(B, L, H))
            self.taps.setdefault("moe_in", []).append(xn)
        if moe.shared is not None:
            y_T = y_T + moe.shared(xn_T)
        out = torch.zeros(B * L, H, dtype=xn.dtype, device=dev)
        out[R.flat] = y_T
        self._layer_stats.append({"layer": li, "fresh": int(idx_F.numel()), "cached": served,
                                  "support": sum(support_sizes) / max(1, len(support_sizes)),
                                  "paths": dict(layer_paths), "pairs": int((ids >= 0).sum()),
                                  "routed_rows": int(idx_need.numel()), "rows": T,
                                  "experts_used": int(ids[ids >= 0].unique().numel())})
        self._comm.add(comm)
        return out.view(B, L, H)

    def _route_all_rows(self, li, moe, xn_T, logits_T, need, idx_F, ids_F, w_F, R: Rows) -> dict:
        """Every valid row of the call routed within its block's support, for a dispatcher that owns rows by
        position in the full shard and runs or counts the dense dispatch (`dblock.optimized.ep`). Fresh rows keep
        the routing computed above (bit for bit); the other rows' router logits are computed here."""
        T, E = logits_T.shape
        rest = torch.ones(T, dtype=torch.bool)
        rest[idx_F] = False
        idx_S = rest.nonzero(as_tuple=True)[0]
        ids_T = torch.full((T, ids_F.shape[1]), -1, dtype=ids_F.dtype, device=ids_F.device)
        w_T = torch.zeros((T, w_F.shape[1]), dtype=w_F.dtype, device=w_F.device)
        ids_T[idx_F], w_T[idx_F] = ids_F, w_F
        if idx_S.numel():
            miss = idx_S[~need[idx_S]]
            lg = logits_T.clone()
            if miss.numel():
                lg[miss] = moe.router_logits(xn_T[miss])
            allowed = torch.ones(idx_S.numel(), E, dtype=torch.bool, device=xn_T.device)
            for p, plan in enumerate(R.plans):
                sup = plan.layer(li).support
                if sup is not None and "route-outside-support" not in self.ecfg.inject:
                    allowed[(R.plan[idx_S] == p).to(allowed.device)] = sup.to(allowed.device)
            ids_S, w_S = self.stages.route(lg[idx_S], moe.expert_bias, self.config, allowed)
            ids_T[idx_S], w_T[idx_S] = ids_S.to(ids_T.device), w_S.to(w_T.device)
        return {"x_all": xn_T, "ids_all": ids_T, "w_all": w_T, "idx_fresh": idx_F}

    def _audit(self, li, R: Rows, fresh, idx_served, ages_served, idx_F, ids) -> None:
        served = {}
        for p in R.plan[idx_served].unique().tolist():
            m = R.plan[idx_served] == p
            served[p] = (idx_served[m], ages_served[m])
        for p, plan in enumerate(R.plans):
            rows_T = R.plan_rows[p]
            in_plan = R.plan[idx_F] == p
            sup = plan.layer(li).support
            chosen = ids[in_plan]
            outside = 0 if sup is None else int((~sup[chosen.clamp(min=0)] & (chosen >= 0)).sum())
            srv = served.get(p)
            self.audit.append({
                "pass": self._pass, "request": plan.request, "block": plan.block, "plan_pass": plan.passes,
                "layer": li, "path": plan.path, "N": plan.N,
                "fresh": int(fresh[rows_T].sum()),
                "served_rows": [] if srv is None else R.row[srv[0]].tolist(),
                "served_ages": [] if srv is None else srv[1].tolist(),
                "newly_decoded": plan.liveness.newly.nonzero(as_tuple=True)[0].tolist(),
                "decoded": R.decoded[rows_T].nonzero(as_tuple=True)[0].tolist(),
                "support": None if sup is None else sup.nonzero(as_tuple=True)[0].tolist(),
                "support_ok": plan.layer(li).support_ok, "under": plan.layer(li).under,
                "routed_outside_support": outside, "refresh": self.ecfg.refresh,
                "built_at": plan.layer(li).built_at, "alpha": self.ap.alpha, "q": self.ap.q,
            })

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
        skip = "skip-live-logits" in self.ecfg.inject
        for b, it in enumerate(items):
            per_seg, off = [], 0
            for s in it.segments:
                live = s.live.to(x.device)
                if skip and live.any():      # deliberately wrong: drop the first live row's LM head
                    live = live.clone()
                    live[live.nonzero()[0, 0]] = False
                if self.audit_heads is not None:
                    self.audit_heads.append({"pass": self._pass, "request": it.request, "block": s.block,
                                             "live": s.live.nonzero(as_tuple=True)[0].tolist(),
                                             "head_rows": live.nonzero(as_tuple=True)[0].tolist()})
                per_seg.append(self.stages.lm_head(model, x[b, off:off + len(s)], live))
                off += len(s)
            out.append(per_seg)
        for plan in R.plans:
            plan.passes += 1
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
        return out


def epoch_forward(model, config: str = "epoch", refresh=None, atlas_alpha=None, atlas_q=None, update_every=None,
                  use_triton: bool = False, dispatcher=None, audit: bool = False, inject=(), atlas_m=None,
                  atlas_B=None, atlas_beta=None, atlas_c=None) -> Forward:
    """The optimized executor in one of its configurations over `model`'s weights (`dense` = the reference).

    Atlas knobs (None = default, see `AtlasParams`): alpha coverage floor, q covered-token quota, m extra
    candidates, B initial support size, beta mixing weight, c experts added per repair round, update_every."""
    if config == "dense":
        if use_triton:
            raise ValueError("--use-triton applies to the epoch configurations, not dense")
        from dblock.decoding.generate import reference_forward
        return reference_forward(model)
    cfg = EpochConfig.named(config, refresh=refresh, alpha=atlas_alpha, q=atlas_q, update_every=update_every,
                            m=atlas_m, B=atlas_B, beta=atlas_beta, c=atlas_c)
    cfg.use_triton = use_triton
    cfg.inject = frozenset(inject)
    return EpochExecutor(model, cfg, dispatcher=dispatcher, audit=audit)
