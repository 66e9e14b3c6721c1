"""The stage seam of the Epoch executor for DiffusionGemma (`dblock.optimized.gemma_epoch`): `GemmaStages`, the
`dblock.optimized.stages.TorchStages` methods in the family's shapes, over the reference model's own weights.

  route / route_all  inherited: the softmax top-K of `atlas.route_restricted` (the executor renormalises and scales)
  experts            the GeGLU experts from their fused (E, 2I, H) gate_up weights over the whole worklist: one sort
                     of the (row, expert) pairs and one grouped GEMM per projection (`freshlane.grouped_geglu_torch`;
                     the reference's per-expert loop where torch has no grouped GEMM for the dtype, e.g. float64)
  attend             q/k/v projections, their RMSNorms and RoPE, then one fused scaled-dot-product attention call
                     over [cache ; canvas] with the layer type's mask (scale 1.0: the norms set it)
  lm_head_rows       final norm, tied (or own) head and soft-cap for the live rows of the whole call at once
  norm               every RMSNorm as one `torch.nn.functional.rms_norm` call in fp32 (fp64 for fp64 models)
                     instead of the reference's explicit ops (`gemma.RMSNorm`)
  self_conditioning  the decoder input x_in = post_norm(embed + MLP(pre_norm(soft))) with the fused norms
  compact / scatter  inherited

The fused norm, the fused attention and the grouped GEMM round differently from the reference's explicit ops in
the last bits (fp32: within the fp32 row of the tolerance table in tests/conftest.py; fp64: far below any
decision), which is why `full_compute` on this family promises the reference's tokens, not its logits' bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dblock.optimized.freshlane import grouped_geglu_torch
from dblock.optimized.stages import TorchStages


def rope(x_BLND: torch.Tensor, cos_BL1D: torch.Tensor, sin_BL1D: torch.Tensor) -> torch.Tensor:
    """`gemma.apply_rope` with cos/sin already broadcast over heads (B, L, 1, D) (`GemmaStages.rope_tables`)."""
    half = x_BLND.shape[-1] // 2
    return torch.addcmul(x_BLND * cos_BL1D, torch.cat([-x_BLND[..., half:], x_BLND[..., :half]], dim=-1),
                         sin_BL1D)


class GemmaStages(TorchStages):
    """The stage seam for DiffusionGemma (module docstring)."""

    name = "torch-gemma"

    def __init__(self, grouped_mm: bool = True):
        super().__init__(grouped_mm=grouped_mm)

    @staticmethod
    def norm(mod, x: torch.Tensor) -> torch.Tensor:
        """`gemma.RMSNorm` `mod` applied to x as one `torch.nn.functional.rms_norm` call (x · rsqrt(mean(x²) + eps)
        · w, decomposed in C++ rather than op by op from Python): computed in fp32 (fp64 for fp64 models), cast
        back."""
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, (x.shape[-1],), mod.weight, mod.eps)
        dt = torch.promote_types(x.dtype, torch.float32)
        w = None if mod.weight is None else mod.weight.to(dt)
        return F.rms_norm(x.to(dt), (x.shape[-1],), w, mod.eps).to(x.dtype)

    def experts(self, x_FH, ids_FK, w_FK, w_gate_up_EJH, w_down_EHI):
        return grouped_geglu_torch(x_FH, ids_FK, w_FK, w_gate_up_EJH, w_down_EHI, grouped_mm=self.grouped_mm)

    def experts_exact(self, x_FH, ids_FK, w_FK, w_gate_up_EJH, w_down_EHI):
        """The reference's own per-expert GEMMs over the same grouping."""
        return grouped_geglu_torch(x_FH, ids_FK, w_FK, w_gate_up_EJH, w_down_EHI, grouped_mm=False)

    def attend(self, attn, x_BLH, cos, sin, mask_BLS, past_k, past_v):
        """The reference `Attention` (sliding: own v_proj; full: V = the raw K projection) with fused norms and one
        fused attention call over [cache ; new rows] -> the output (B, L, H) and the new rows' k, v (B, G, L, D)
        (the encoder caches them, the decoder not)."""
        B, L, _ = x_BLH.shape
        N, G, D = attn.n_head, attn.n_kv, attn.head_dim
        q = self.norm(attn.q_norm, attn.q_proj(x_BLH).view(B, L, N, D))
        k_raw = attn.k_proj(x_BLH).view(B, L, G, D)
        v_raw = attn.v_proj(x_BLH).view(B, L, G, D) if attn.v_proj is not None else k_raw
        qk = rope(torch.cat([q, self.norm(attn.k_norm, k_raw)], dim=2), cos, sin)   # q and k rotated at once
        q, k = qk[:, :, :N].transpose(1, 2), qk[:, :, N:].transpose(1, 2)             # (B, N|G, L, D)
        v = self.norm(attn.v_norm, v_raw).transpose(1, 2)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        vals = v if past_v is None else torch.cat([past_v, v], dim=2)
        y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask_BLS[:, None], scale=1.0,
                                           enable_gqa=N != G)
        return attn.o_proj(y.transpose(1, 2).reshape(B, L, N * D)), k, v

    @staticmethod
    def rope_tables(model, positions_BL: torch.Tensor, dtype) -> dict:
        """Per layer type (cos, sin) (B, L, 1, D) for `rope`, once per call."""
        return {t: (c[:, :, None], s[:, :, None]) for t, (c, s) in model.rope(positions_BL, dtype).items()}

    def self_conditioning(self, sc, e_BLH: torch.Tensor, soft_BLH: torch.Tensor) -> torch.Tensor:
        """`gemma.SelfConditioning` `sc` with fused norms."""
        s = self.norm(sc.pre_norm, soft_BLH)
        signal = sc.down_proj(F.gelu(sc.gate_proj(s), approximate="tanh") * sc.up_proj(s))
        return self.norm(sc.post_norm, e_BLH + signal)

    def lm_head_rows(self, model, hidden_XH: torch.Tensor) -> torch.Tensor:
        """`GemmaModel.logits` of the given rows (every live row of the call in one GEMM) -> (X, V) fp32."""
        w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        z = F.linear(self.norm(model.norm, hidden_XH), w).float()
        cap = model.config.final_logit_softcapping
        return z.div_(cap).tanh_().mul_(cap)            # z is this call's own GEMM output: soft-capped in place


class GemmaTritonStages(GemmaStages):
    """`--use-triton` on DiffusionGemma: the Triton kernels where they implement this family's arithmetic, the torch
    stages of `GemmaStages` elsewhere.

      route / route_all  `kernels.route` with the softmax rule (no groups, no renormalisation: the executor
                         renormalises and scales, `GemmaMoe.weights`), every expert eligible for route_all
      experts            `kernels.grouped_mlp` with the tanh GELU (GeGLU), the fused (E, 2I, H) gate_up weights
                         passed as their two (E, I, H) halves (views, no copy)
      compact / scatter  `kernels.compact`
      attend, norms, self-conditioning, LM head: torch — the attention kernel has no sliding window and the
                         LM-head kernel neither this family's norm nor its logit soft-cap
    """

    name = "triton-gemma"
    route_all = None                     # `MoeSteps._route_rows` then routes with every expert through `route`

    def __init__(self, config):
        super().__init__(grouped_mm=False)
        from dblock.kernels.stack import TritonStages
        self.triton = TritonStages(config)

    def route(self, logits_FE, bias_E, cfg, allowed_FE):
        return self.triton.route(logits_FE, bias_E, cfg, allowed_FE)

    def experts(self, x_FH, ids_FK, w_FK, w_gate_up_EJH, w_down_EHI):
        I = w_down_EHI.shape[2]
        gu = w_gate_up_EJH.contiguous()
        return self.triton.experts(x_FH, ids_FK, w_FK, gu[:, :I], gu[:, I:], w_down_EHI, activation="gelu_tanh")

    experts_exact = experts

    def compact(self, x_TH, idx_F):
        return self.triton.compact(x_TH, idx_F)

    def scatter(self, y_FH, idx_F, T):
        return self.triton.scatter(y_FH, idx_F, T)
