"""FreshLane (docs/algorithms.md §4.4): only fresh (token, expert) pairs move through the MoE region.

compact -> route -> dispatch -> grouped expert MLP -> combine -> scatter/merge. The compact layout never leaves
this region: the caller hands in the fresh rows' normed hidden states (F, H) and gets their routed-expert outputs
(F, H) back, and scatters them into the full shard itself.

Wire layout (the dispatcher contract; `dblock.optimized.ep` implements it with torch.distributed): one row per
(fresh token, destination rank) carrying the hidden state, with the token's K expert ids made rank-local (-1 for
experts on other ranks) and its K routing weights. The receiving rank runs its experts on the rows, applies the
routing weights, and sums over its own slots; `combine` returns one partial sum per (token, rank) and the owner
adds them up (DeepEP's convention: combine itself is an unweighted sum). With one rank this is the identity.

Letter legend: F fresh rows, K experts per token, P (row, slot) pairs, E experts, H hidden, I expert width,
X rows of one expert.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F_


def sort_by_expert(ids_FK: torch.Tensor):
    """Valid (row, slot) pairs grouped by expert, stable within an expert.

    Returns row_P, slot_P (int64), counts_E (int64, per expert id 0..E-1 up to the max id present).
    Example: ids = [[2, 0], [0, -1], [2, 1], [1, 0]] (4 rows, K = 2, -1 = no expert)
      pairs in expert order: expert 0 <- (0,1) (1,0) (3,1); expert 1 <- (2,1) (3,0); expert 2 <- (0,0) (2,0)
      row_P = [0, 1, 3, 2, 3, 0, 2], slot_P = [1, 0, 1, 1, 0, 0, 0], counts = [3, 2, 2]
    """
    F, K = ids_FK.shape
    flat = ids_FK.reshape(-1)
    valid = (flat >= 0).nonzero(as_tuple=True)[0]
    order = torch.sort(flat[valid], stable=True).indices
    pair = valid[order]
    counts = torch.bincount(flat[valid]) if valid.numel() else torch.zeros(0, dtype=torch.long)
    return pair // K, pair % K, counts


def expert_groups(ids_FK: torch.Tensor):
    """Group by expert: (e, rows_X, slots_X) for every expert e with rows, in expert order (`sort_by_expert`)."""
    row_P, slot_P, counts_E = sort_by_expert(ids_FK)
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        if n == 0:
            continue
        yield e, row_P[start:start + n], slot_P[start:start + n]
        start += n


def swiglu(x_XH: torch.Tensor, w_gate_IH, w_up_IH, w_down_HI) -> torch.Tensor:
    """One expert's MLP: down(silu(gate x) · up x) -> (X, H)."""
    return F_.linear(F_.silu(F_.linear(x_XH, w_gate_IH)) * F_.linear(x_XH, w_up_IH), w_down_HI)


def grouped_swiglu_torch(x_FH: torch.Tensor, ids_FK: torch.Tensor, w_FK: torch.Tensor, w_gate_EIH, w_up_EIH,
                         w_down_EHI) -> torch.Tensor:
    """Σ_k w[f,k] · down_e(silu(gate_e x_f) · up_e x_f), e = ids[f,k]; slots with id -1 contribute nothing.

    Group the (row, slot) pairs by expert, run each expert's MLP once over its rows (invalid slots load no
    weights), combine: add the weighted outputs into their rows. Accumulates in fp32 (fp64 for fp64 inputs),
    returns x's dtype.
    """
    acc = torch.promote_types(x_FH.dtype, torch.float32)                 # fp32, or fp64 for fp64 references
    out_FH = torch.zeros(x_FH.shape, dtype=acc, device=x_FH.device)
    if x_FH.shape[0] == 0:
        return out_FH.to(x_FH.dtype)
    for e, rows_X, slots_X in expert_groups(ids_FK):
        y_XH = swiglu(x_FH[rows_X], w_gate_EIH[e], w_up_EIH[e], w_down_EHI[e])
        out_FH.index_add_(0, rows_X, y_XH.to(acc) * w_FK[rows_X, slots_X, None])
    return out_FH.to(x_FH.dtype)


@dataclass
class CommStats:
    """Bytes and messages the MoE region would move (or moved, with torch.distributed) in one call."""

    dispatch_rows: int = 0
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    messages: int = 0
    per_rank: list = field(default_factory=list)

    def add(self, other: "CommStats") -> None:
        self.dispatch_rows += other.dispatch_rows
        self.dispatch_bytes += other.dispatch_bytes
        self.combine_bytes += other.combine_bytes
        self.messages += other.messages


class LocalDispatcher:
    """World size 1: dispatch and combine are the identity; experts are all local."""

    world_size = 1
    rank = 0

    def __init__(self, num_experts: int):
        self.local_experts = range(num_experts)

    def run(self, x_FH, ids_FK, w_FK, experts) -> tuple[torch.Tensor, CommStats]:
        """Routed-expert output of the fresh rows (F, H) and what a wire would have carried."""
        y = experts(x_FH, ids_FK, w_FK)
        nb = x_FH.shape[0] * x_FH.shape[1] * x_FH.element_size()
        # one row per token and destination rank; with one rank: one row per fresh token, each way
        return y, CommStats(dispatch_rows=x_FH.shape[0], dispatch_bytes=nb + ids_FK.numel() * 8 + w_FK.numel() * 4,
                            combine_bytes=nb, messages=0)
