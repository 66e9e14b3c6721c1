"""The data types of one Epoch denoising call: `Rows` (where every valid row of the call lives, and its block
plan) and `LayerCall` (one MoE layer of the call on its way through the steps of `dblock.optimized.moe_steps`).

Letter legend (as in dblock/optimized/executor.py): T valid rows of the call, F fresh rows, S rows served from the
cache, K experts per token, H hidden, B requests, L padded rows per request.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


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
    approx: Optional[torch.Tensor] = None  # (P,) bool, with the margin gate on: the plan's pass served a cached row
                                           # or routed within a restricted support at some layer (`_note_approx`)

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
    drift_S: Optional[torch.Tensor] = None        # their relative MoE-input drift (_drift_gate; None when it is off)
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
