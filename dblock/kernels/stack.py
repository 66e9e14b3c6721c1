"""`TritonStages`: the optimized executor's stage seam (`dblock.optimized.stages.TorchStages`) with Triton
kernels. `EpochConfig.use_triton` swaps the whole stack for this one.

Letter legend: B requests, L padded rows, S keys (cache + new), H hidden, N heads, G kv heads, D head dim,
F fresh rows, E experts, K experts per row, T valid rows of the call.

Stages and what runs where:
  route     route_triton   (support-restricted group-limited top-K of the fresh rows)
  experts   grouped_mlp_triton (align -> gate_up -> down -> moe_sum)
  attend    projections, QK-norm and RoPE in torch (`attn.project_qkv`), then attention_triton on the call's tile
            schedule (built once per call from the StepInputs), then the output projection in torch
  lm_head   lm_head_triton (final RMSNorm + LM head of the live rows only)
  compact / scatter   the fresh rows in and out of the compact buffer (compact_triton, scatter_triton)
The decoded-output cache merge stays in the executor (its rows live in one cache tensor per block plan);
`merge_triton` does it in one pass where the cached rows sit in one buffer.

This file knows the model only through duck typing (attn.project_qkv / attn.wo, model.norm / model.lm_head) and
imports neither `dblock.reference` nor `dblock.optimized`.
"""
from __future__ import annotations

import math

import torch

from dblock.kernels import FLOATS
from dblock.kernels.attention import TileSchedule, attention_triton, pick_tile, tile_schedule
from dblock.kernels.compact import compact_triton, scatter_triton
from dblock.kernels.grouped_mlp import grouped_mlp_triton
from dblock.kernels.lm_head import lm_head_triton
from dblock.kernels.route import route_args, route_triton


def layout_of(items) -> tuple[list, list, list]:
    """(cache lengths, segment lengths, visibility matrices) of a batch of StepInputs."""
    cache_lens = [it.cache.length if it.cache is not None else 0 for it in items]
    seg_lens = [[len(s) for s in it.segments] for it in items]
    vis = [it.visibility.to(torch.bool).cpu() for it in items]
    return cache_lens, seg_lens, vis


def schedule_for(items, dtype: torch.dtype, tile: int | None = None) -> TileSchedule:
    """The call's tile schedule; tile = the block size when every length is a multiple of it (see pick_tile)."""
    cache_lens, seg_lens, vis = layout_of(items)
    if tile is None:
        lengths = cache_lens + [n for s in seg_lens for n in s] + [max(cache_lens), max(sum(s) for s in seg_lens)]
        tile = pick_tile(lengths, dtype)
    return tile_schedule(cache_lens, seg_lens, vis, tile)


class TritonStages:
    """Same four methods as TorchStages (plus compact/scatter), Triton kernels underneath."""

    name = "triton"

    def __init__(self, config, tile: int | None = None):
        self.config = config
        self.rargs = route_args(config)
        self.tile = tile                  # None: per call, from the layout (pick_tile)
        self._sched_key = None            # the layout the cached schedule was built for
        self._sched = None
        self.last_schedule_counts: dict = {}
        self.device = None                # where the model computes (learnt from attend / experts)

    @staticmethod
    def _check_dtype(t: torch.Tensor, what: str) -> None:
        if t.dtype not in FLOATS:
            raise ValueError(f"--use-triton: the kernels compute {what} in fp32/bf16/fp16, the model is {t.dtype} "
                             "(run fp64 checks without --use-triton)")

    def route(self, logits_FE, bias_E, cfg, allowed_FE):
        """Support-restricted routing of the fresh rows -> ids (F, K) int64 (-1 = no expert), weights (F, K) fp32."""
        # the executor keeps router logits and supports on the host; the kernel runs where the model runs and the
        # result goes back where the logits came from
        dev = self.device or logits_FE.device
        bias = bias_E.to(dev, torch.float32).contiguous() if bias_E is not None else None
        ids, w = route_triton(logits_FE.to(dev, torch.float32), bias, allowed_FE.to(dev), **self.rargs)
        return ids.to(logits_FE.device), w.to(logits_FE.device)

    def experts(self, x_FH, ids_FK, w_FK, w_gate_EIH, w_up_EIH, w_down_EHI, activation: str = "silu"):
        """Grouped SwiGLU (GeGLU with activation="gelu_tanh") over the fresh worklist, weighted and summed over
        slots -> (F, H). Gate and up weights that already share one H-contiguous layout (the two halves of a fused
        gate_up tensor) are passed as they are."""
        self._check_dtype(x_FH, "the experts")
        self.device = x_FH.device
        dev = x_FH.device
        if not (w_gate_EIH.stride(-1) == 1 and w_gate_EIH.stride() == w_up_EIH.stride()):
            w_gate_EIH, w_up_EIH = w_gate_EIH.contiguous(), w_up_EIH.contiguous()
        return grouped_mlp_triton(x_FH.contiguous(), ids_FK.to(dev).contiguous(),
                                  w_FK.to(dev, torch.float32).contiguous(), w_gate_EIH, w_up_EIH,
                                  w_down_EHI.contiguous(), activation=activation)

    def compact(self, x_TH, idx_F):
        """Rows idx_F of x_TH -> (F, H)."""
        return compact_triton(x_TH, idx_F.to(x_TH.device).contiguous())

    def scatter(self, y_FH, idx_F, T):
        """Fresh rows back into T rows, other rows zero -> (T, H)."""
        return scatter_triton(y_FH.contiguous(), idx_F.to(y_FH.device).contiguous(), T)

    def schedule(self, items, dtype, device) -> TileSchedule:
        """The call's tile schedule (the same for every layer: built on the first, reused while the layout is)."""
        cache_lens, seg_lens, vis = layout_of(items)
        key = (tuple(cache_lens), tuple(map(tuple, seg_lens)), tuple(tuple(v.flatten().tolist()) for v in vis),
               dtype, str(device))
        if key != self._sched_key:
            self._sched = schedule_for(items, dtype, self.tile).to(device)
            self._sched_key = key
            self.last_schedule_counts = self._sched.counts()
        return self._sched

    def attend(self, attn, xn_BLH, positions_BL, mask_BLS, past_k, past_v, items):
        """Attention of every row over [committed cache ; in-flight segments] -> (B, L, H)."""
        self._check_dtype(xn_BLH, "attention")
        self.device = xn_BLH.device
        B, L, _ = xn_BLH.shape
        q, k, v = attn.project_qkv(xn_BLH, positions_BL)                 # (B, N, L, D), (B, G, L, D) x2
        sched = self.schedule(items, q.dtype, q.device)
        y = attention_triton(q, k, v, past_k, past_v, mask_BLS, sched, 1.0 / math.sqrt(attn.head_dim))
        return attn.wo(y.reshape(B, L, attn.n_head * attn.head_dim))    # (B, L, N*D) -> (B, L, H)

    def lm_head(self, model, hidden_LH, live_L):
        """Logits (fp32) of the live rows only; decoded rows are never read."""
        self._check_dtype(hidden_LH, "the LM head")
        idx = live_L.to(hidden_LH.device).nonzero(as_tuple=True)[0]
        return lm_head_triton(hidden_LH, idx, model.norm.weight.detach(), model.lm_head.weight.detach(),
                              model.norm.eps)


__all__ = ["TritonStages", "schedule_for", "layout_of"]
