"""The stage seam of the Epoch executor (docs/architecture.md, "Swappable MoE stages"): `TorchStages`, the swappable
stages of the optimized path in torch (route, experts, attend, lm_head, compact, scatter).
`dblock.kernels.stack.TritonStages` implements the same methods with Triton kernels; `EpochConfig.use_triton` picks
it for the whole stack.
"""
from __future__ import annotations

from dblock.optimized.atlas import route_restricted
from dblock.optimized.freshlane import grouped_swiglu_torch


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
