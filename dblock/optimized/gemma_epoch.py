"""The Epoch executor for DiffusionGemma (`diffusion_gemma`, docs/algorithms.md §4): `GemmaEpochExecutor`, the
LLaDA executor's planning, MoE steps and statistics (`dblock.optimized.executor.EpochExecutor`,
`dblock.optimized.moe_steps.MoeSteps`) over the DiffusionGemma decoder (`dblock.reference.gemma`).

One denoising call (the decoder over every in-flight canvas of every request, one batch):
  * the batch layout, per-layer-type masks and self-conditioning as the reference (`gemma_executor.GemmaReference`),
    the stacked committed caches, masks and RoPE tables kept between calls while nothing changed (`_layout`), the
    self-conditioning soft embeddings of all segments in one call (`_soft`);
  * per layer: attention through the stage seam (`GemmaStages.attend`: one fused attention call over
    [cache ; canvas]), the dense MLP branch on every row, and the MoE branch through the Epoch steps (`_moe`): router
    logits from the residual h (`GemmaMoe.router_logits`), the family's rule (softmax, top-K, renormalise,
    × per-expert scale: `GemmaMoe.weights`) restricted to the block's Expert Atlas support when it has one, and
    FreshLane's grouped experts for the whole batch (`GemmaStages.experts`: one sort of the (row, expert) pairs and
    one grouped GEMM per projection per layer), fed pre_feedforward_layernorm_2(h);
  * the LM head (final norm, tied head, soft-cap) for the live rows of each segment.
Prefill and append passes (the causal encoder, which writes the K/V cache) run through the same stages with every
expert eligible (`append`).

LSP is off for this family (docs/algorithms.md §4): uniform-state decoding re-noises every position a pass does not
accept and reports no decoded row before commit (`Segment.decoded` is all False), so there is no stable row whose
MoE output could be served; every row is fresh on every pass. What remains of the Epoch executor is the grouped
experts over the whole batch and the Expert Atlas: the support is built from the canvas rows' router scores on an
all-fresh pass and rebuilt on the block clock every `update_every` passes (`MoeSteps._supports_due`); in between a
block's rows route within it, a row whose restricted choice keeps less than α of its dense top-K mass is routed
with every expert (`MoeSteps._cover_fresh`). Where the Atlas cannot restrict anything (off, or its initial support
B already covers every expert) a block takes the dense path: every expert eligible, the reference's routing bit
for bit.

Numerics. `full_compute` routes exactly as the reference; the grouped GEMM and the fused attention may round
differently from the reference's per-expert loop and explicit softmax in the last bits (fp32: logits within the
fp32 row of tests/conftest.py's tolerance table, tokens identical up to the batch-composition caveat of
docs/algorithms.md §2.3; fp64: torch has no grouped GEMM for it, the per-expert loop runs, tokens identical).

The Triton stack (`EpochConfig.use_triton`, `gemma_stages.GemmaTritonStages`): the routing kernel (softmax rule),
the grouped expert kernel with the tanh GELU and the compaction kernels; attention (sliding windows), the norms and
the soft-capped LM head stay in torch, which the kernels do not implement. Expert parallelism: the
dispatcher contract is the LLaDA executor's (`freshlane.LocalDispatcher`, `ep_dispatch.EPDispatcher`): the experts'
inputs are the normed rows (`_run_experts`); tokens and logits at two gloo ranks equal world size 1.

Letter legend as dblock/optimized/executor.py: B requests, L padded rows, T valid rows, F fresh rows, E experts,
K experts per row, H hidden, V vocabulary.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from dblock.forward import Forward, StepInput
from dblock.optimized.executor import EPOCH_CLASSES, EpochExecutor
from dblock.optimized.freshlane import CommStats
from dblock.optimized.plan import EpochConfig
from dblock.optimized.rows import LayerCall
from dblock.optimized.gemma_stages import GemmaStages
from dblock.reference.executor import PastStack
from dblock.gemma_config import SLIDING
from dblock.reference.gemma_executor import (GemmaBatch, GemmaReference, append_to_caches, build_batch, layer_mask,
                                             stack_past)


class GemmaMoe:
    """The MoE branch of one DiffusionGemma layer as the Epoch steps see it: routed from the residual h itself (the
    router's own scaled RMSNorm, softmax over every expert in fp32, top-K, renormalise, × per-expert scale), the
    experts fed pre_feedforward_layernorm_2(h); no shared expert (the dense MLP branch runs beside it on every row,
    outside the MoE steps), no expert bias. Views of the layer's own weights, no copy."""

    shared = None
    expert_bias = None

    def __init__(self, layer):
        self.layer = layer
        self.router = layer.router
        self.w_gate_up = layer.experts.gate_up_proj          # (E, 2I, H) = [gate ; up], as stored
        self.w_down = layer.experts.down_proj                # (E, H, I)

    def router_logits(self, h_FH: torch.Tensor) -> torch.Tensor:
        """(F, E) router logits in fp32 (fp64 for fp64 models): the reference `Router`'s softmax input."""
        r = self.router
        x = GemmaStages.norm(r.norm, h_FH) * r.scale * r.root
        return r.proj(x).to(torch.promote_types(x.dtype, torch.float32))

    def expert_input(self, h_XH: torch.Tensor) -> torch.Tensor:
        return GemmaStages.norm(self.layer.pre_feedforward_layernorm_2, h_XH)

    def weights(self, ids_FK: torch.Tensor, p_FK: torch.Tensor) -> torch.Tensor:
        """The routing weights from the chosen experts' softmax probabilities (slots with id -1 carry 0):
        renormalised over the row's chosen experts, then × the per-expert scale, as the reference `Router`."""
        w = p_FK / p_FK.sum(dim=-1, keepdim=True)
        return w * self.router.per_expert_scale[ids_FK.clamp(min=0)]


class GemmaEpochExecutor(EpochExecutor):
    """The Epoch executor over a `GemmaModel` (module docstring). Same configurations, statistics, audit and fault
    hooks as `EpochExecutor`; LSP is forced off (`lsp_requested` keeps what the configuration asked for)."""

    families = ("diffusion_gemma",)

    def __init__(self, model, cfg: EpochConfig | None = None, dispatcher=None):
        cfg = cfg or EpochConfig()
        if cfg.margin_refresh is not None:
            raise ValueError("margin_refresh: the margin-gated exact refresh needs a closed-form decision margin "
                             f"(masked diffusion); {', '.join(self.families)} decides by the entropy-bound rule")
        if cfg.lsp_drift is not None:
            raise ValueError("lsp_drift: LSP's drift bound applies to served cache rows, and LSP is off on "
                             f"{', '.join(self.families)} (no row keeps a decoded token, docs/algorithms.md §4.6)")
        self.lsp_requested = cfg.lsp
        super().__init__(model, replace(cfg, lsp=False), dispatcher=dispatcher)
        self.moes = [GemmaMoe(layer) for layer in model.layers]
        self._stacks = PastStack()               # the stacked past, kept across the passes of a block
        self._past: list = []                    # per layer (k, v, key positions, key valid)
        self._lay = None                         # (positions, masks, rope, batch) of the last one-segment call

    def _make_reference(self, model) -> Forward:
        return GemmaReference(model)

    def _make_stages(self):
        if self.ecfg.use_triton:
            from dblock.optimized.gemma_stages import GemmaTritonStages
            return GemmaTritonStages(self.config)
        return GemmaStages(grouped_mm=True)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def moe_of(self, li: int) -> GemmaMoe:
        """Layer li's MoE branch as the steps see it (the equivalence suite recomputes coverage through it)."""
        return self.moes[li]

    def stats(self) -> dict:
        return {**super().stats(), "lsp": False, "lsp_requested": self.lsp_requested}

    # ---- the path and the MoE steps this family changes ---------------------------------------------------
    def _block_dense(self, n: int, n_fresh: int) -> bool:
        """Every row is fresh on every pass (no LSP), so skipping rows never pays; the epoch path pays only for the
        Atlas' routing restriction: dense where the Atlas is off or inert (B >= E), unless a configuration pins a
        path."""
        if self.ecfg.path != "auto":
            return self.ecfg.path == "dense"
        return not (self.ecfg.atlas and self.ap.B < self.config.num_experts)

    def _route_rows(self, moe, logits_XE: torch.Tensor, allowed_XE):
        """The softmax top-K of the shared rule (`MoeSteps._route_rows`), then the family's renormalisation and
        per-expert scale (`GemmaMoe.weights`)."""
        ids, p = super()._route_rows(moe, logits_XE, allowed_XE)
        return ids, moe.weights(ids, p)

    def _write_cache(self, c: LayerCall) -> None:
        """Nothing to write: without LSP no entry is ever served (and the rule reports no decoded row)."""

    def _run_experts(self, c: LayerCall) -> None:
        """FreshLane over the call's rows: the experts' input is pre_feedforward_layernorm_2 of the residual rows
        the router saw; one grouped GEMM per projection for the whole batch (`GemmaStages.experts`)."""
        moe = c.moe
        x_FH = moe.expert_input(c.x_FH)
        extra = self._all_rows(c) if getattr(self.dispatcher, "wants_all_rows", False) else {}
        if extra:
            extra["x_all"] = x_FH if extra["x_all"] is c.x_FH else moe.expert_input(extra["x_all"])
        run = self.stages.experts

        def experts(x_XH, ids_XK, w_XK):
            return run(x_XH, ids_XK, w_XK, moe.w_gate_up, moe.w_down)
        c.y_FH, c.comm = self.dispatcher.run(x_FH, c.ids_FK, c.w_FK, experts, **extra)

    # ---- the denoising call -------------------------------------------------------------------------------
    def _stack_past(self, items: list[StepInput]) -> bool:
        """Per layer the committed caches stacked for the batch (k, v, key positions, key valid), kept while the same
        caches at the same lengths come back (no append happened, `PastStack`). -> whether they were kept."""
        ref = self.embed_weight
        self._past = self._stacks.get(items, lambda: [stack_past(items, i, ref)
                                                      for i in range(self.config.num_hidden_layers)])
        return self._stacks.kept

    def _layout(self, items: list[StepInput]):
        """The decoder call's batch (`gemma_executor.build_batch(items, encoder=False)`), the stacked caches, per
        layer type the mask over [cache ; canvas] (`gemma_executor.layer_mask`) and the RoPE tables. The common
        call (every request one segment of one length, seeing itself: a Native batch) stacks its tokens and
        positions in two ops, and keeps masks and RoPE tables from the previous call when the caches and the
        positions are the same (the passes of one block) -> (batch, past, masks, rope)."""
        kept = self._stack_past(items)
        segs = [it.segments[0] for it in items]
        n = len(segs[0])
        fast = n > 0 and all(len(it.segments) == 1 and len(it.segments[0]) == n and bool(it.visibility[0, 0])
                             for it in items)
        if not fast:
            self._lay = None
            batch = build_batch(items, self.device, encoder=False)
        else:
            dev = self.device
            positions = torch.stack([s.positions for s in segs]).to(dev, torch.long)
            tokens = torch.stack([s.tokens for s in segs]).to(dev)
            lay = self._lay
            if kept and lay is not None and lay[0].shape == positions.shape and torch.equal(lay[0], positions):
                batch = GemmaBatch(tokens, positions, lay[3].anchor, lay[3].new_vis, lay[3].lens)
                return batch, [(k, v) for k, v, _, _ in self._past], lay[1], lay[2]
            batch = GemmaBatch(tokens, positions, positions.amin(1, keepdim=True).expand(-1, n).contiguous(),
                               torch.ones(len(items), n, n, dtype=torch.bool, device=dev), [n] * len(items))
        cfg, masks = self.config, {}
        for i, t in enumerate(cfg.layer_types):
            if t not in masks:
                _, _, kpos, kvalid = self._past[i]
                masks[t] = layer_mask(batch, kpos, kvalid, t == SLIDING, cfg.sliding_window)
        rope = self.stages.rope_tables(self.model, batch.positions, self.embed_weight.dtype)
        if fast:
            self._lay = (batch.positions, masks, rope, batch)
        return batch, [(k, v) for k, v, _, _ in self._past], masks, rope

    def _soft(self, items: list[StepInput], e_BLH: torch.Tensor) -> torch.Tensor:
        """(B, L, H) self-conditioning soft embeddings: every segment's previous-step logits in one call (zeros for
        a block's first step and where self-conditioning is off)."""
        soft = torch.zeros_like(e_BLH)
        rows, logits, L = [], [], e_BLH.shape[1]
        for b, it in enumerate(items):
            off = 0
            for s in it.segments:
                if s.sc_enabled and s.sc_logits is not None:
                    rows.extend(range(b * L + off, b * L + off + len(s)))
                    logits.append(s.sc_logits)
                off += len(s)
        if logits:
            sc = self.model.soft_embed(torch.cat(logits).to(self.device))
            soft.view(-1, soft.shape[-1]).index_copy_(0, torch.tensor(rows, device=self.device), sc.to(soft.dtype))
        return soft

    def _layer_out(self, layer, h, m1, y, scalar):
        """h + post_ff_norm(post_ff_norm_1(MLP) + post_ff_norm_2(MoE)), times the stack's layer scalar."""
        st = self.stages
        return (h + st.norm(layer.post_feedforward_layernorm, m1 + st.norm(layer.post_feedforward_layernorm_2, y))) \
            * scalar

    # ---- prefill and append: the causal encoder --------------------------------------------------------------
    @torch.no_grad()
    def append(self, items: list[StepInput]) -> None:
        """The encoder over the committed rows (prompt prefill, one append per committed block), writing each
        layer's K/V into the request's cache as the reference does (`GemmaReference.append`), through the same
        stages as the decoder: every row through the MoE with every expert eligible (the plain rule: committed
        tokens' K/V must be the model's own), grouped experts for the whole batch, fused attention."""
        ref, m, cfg, st = self.reference, self.model, self.config, self.stages
        ref._check_prompts(items)
        batch = build_batch(items, self.device, encoder=True)
        past, masks = ref._masks_and_past(items, batch)
        x = m.embed(batch.tokens)                                                         # (B, L, H)
        rope = st.rope_tables(m, batch.positions, x.dtype)
        new_kv = []
        for li, layer in enumerate(m.layers):
            pk, pv = past[li]
            t = cfg.layer_types[li]
            a, k, v = st.attend(layer.self_attn, st.norm(layer.input_layernorm, x), *rope[t], masks[t], pk, pv)
            new_kv.append((k, v))
            h = x + st.norm(layer.post_attention_layernorm, a)
            m1 = st.norm(layer.post_feedforward_layernorm_1, layer.mlp(st.norm(layer.pre_feedforward_layernorm, h)))
            moe = self.moes[li]
            h_TH = h.reshape(-1, h.shape[-1])
            ids, w = self._route_rows(moe, moe.router_logits(h_TH), None)
            y = st.experts(moe.expert_input(h_TH), ids, w, moe.w_gate_up, moe.w_down).view(h.shape)
            x = self._layer_out(layer, h, m1, y, layer.enc_layer_scalar)
        append_to_caches(items, batch, new_kv)

    def _heads(self, items: list[StepInput], x_BLH: torch.Tensor, R) -> list[list[torch.Tensor]]:
        """Per segment the logits of its `_head_rows` (its live rows): one LM head call for the live rows of the
        whole call (`GemmaStages.lm_head_rows`), handed to each segment through `_segment_logits`. The rows are
        picked with one mask over the call's valid rows (`Rows.flat`: segment order), not per segment."""
        dev = x_BLH.device
        rows = [self._head_rows(s, dev) for it in items for s in it.segments]
        x_TH = x_BLH.reshape(-1, x_BLH.shape[-1])
        if R.padded:
            x_TH = x_TH.index_select(0, R.flat.to(dev))
        live_T = torch.cat(rows)
        counts = [len(r) for r in rows]
        n_live = torch.stack([r.sum() for r in rows]).tolist() if not bool(live_T.all()) else counts
        logits = self.stages.lm_head_rows(self.model, x_TH if n_live is counts else x_TH[live_T]).split(n_live)
        out, i = [], 0
        for it in items:
            per_seg = []
            for s in it.segments:
                per_seg.append(self._segment_logits(it, s, logits[i], rows[i]))
                i += 1
            out.append(per_seg)
        return out

    def _segment_logits(self, it: StepInput, s, logits_XV: torch.Tensor, rows_N: torch.Tensor) -> torch.Tensor:
        """The segment's share of the call's LM head (`_heads`): the logits of its `rows_N`."""
        return logits_XV

    @torch.no_grad()
    def denoise(self, items: list[StepInput]) -> list[list[torch.Tensor]]:
        t0, c0 = time.perf_counter(), time.thread_time()
        m, cfg = self.model, self.config
        batch, past, masks, rope = self._layout(items)
        B, L = batch.tokens.shape
        R = self._plan_rows(items, L, cfg.hidden_size, self.embed_weight.dtype)
        R.path = self._pass_path(R)
        new_stats = getattr(self.dispatcher, "new_stats", CommStats)
        self._layer_recs, self._comm = [], new_stats()
        moe_s = moe_cpu_s = 0.0
        st = self.stages
        e = m.embed(batch.tokens)                                                         # (B, L, H)
        x = st.self_conditioning(m.self_conditioning, e, self._soft(items, e))
        for li, layer in enumerate(m.layers):
            t = cfg.layer_types[li]
            pk, pv = past[li]
            a = st.attend(layer.self_attn, st.norm(layer.input_layernorm, x), *rope[t], masks[t], pk, pv)[0]
            h = x + st.norm(layer.post_attention_layernorm, a)
            m1 = st.norm(layer.post_feedforward_layernorm_1, layer.mlp(st.norm(layer.pre_feedforward_layernorm, h)))
            tm, tc = time.perf_counter(), time.thread_time()
            y = self._moe(li, self.moes[li], h, R)                                        # routed experts (B, L, H)
            moe_s += time.perf_counter() - tm
            moe_cpu_s += time.thread_time() - tc
            x = self._layer_out(layer, h, m1, y, layer.layer_scalar)
        out = self._heads(items, x, R)
        for plan in R.plans:
            plan.passes += 1
        self._end_pass(R, t0, c0, moe_s, moe_cpu_s)
        return out


EPOCH_CLASSES["diffusion_gemma"] = GemmaEpochExecutor
