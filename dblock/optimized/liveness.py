"""Liveness-Shard Parallelism (docs/algorithms.md §4.3): fresh sets and the per-layer decoded-output cache.

The cache holds the **routed-expert output only** (not the shared expert, not the layer output, not hidden states)
of decoded rows, keyed by (block plan, layer, row) and stamped with the plan's version, the pass it was written at
and the token the row held. A stable decoded row (decoded on this pass and the previous one) is served from the
cache; every other row is fresh. Every `refresh` passes all rows go fresh, so a served entry has age (passes since
it was written) in 1..refresh-1, i.e. 0 <= age <= M_C - 1. Anything unexpected — a missing entry, a version or
token mismatch, a shape change, a decoded row turning live again, an entry of age >= M_C — makes the layer (or
block) fully fresh: never a stale read. With a drift bound ε (`EpochConfig.lsp_drift`) the arena also keeps each
entry's MoE input, and a row whose input has moved by more than ε of its norm since the write is computed fresh
(`MoeSteps._drift_gate`).

Letter legend: N rows of one block, H hidden.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


EMPTY = -(2 ** 62)  # `written` of an entry that was never written


class CacheArena:
    """The decoded-output caches of every open block plan, one slab per MoE layer.

    A plan owns a contiguous range of slots [base, base + N) (one per row of its block, the same range in every
    layer), so a whole batch's cache reads and writes are single gathers and scatters through a per-row slot index
    instead of a loop over blocks. Per slot: the routed-expert output (on the model's device) and, on the host, the
    pass it was written at (EMPTY = never), the token the row held and the plan version at write.

    The three stamps of a slot sit in one row of `stamps[li]` (written, token, version), so a batch's checks read
    them with one gather and a write stores them with one scatter; `written`, `token` and `version` are views of its
    columns (writing through them writes the arena).

    Example: plans A (N = 3) and B (N = 2) get bases 0 and 3; row 1 of B reads slot 4 of every layer's slab.
    Freeing A leaves [0, 3) free; a plan of N = 2 reuses slots 0..1 (first fit), with their stamps reset to EMPTY.
    """

    def __init__(self, layers, H: int, dtype, device, capacity: int = 256, keep_inputs: bool = False):
        self.layers, self.H, self.dtype, self.device = list(layers), H, dtype, device
        self.capacity = 0
        self.values, self.stamps = {}, {}
        self.inputs = {} if keep_inputs else None    # per layer (capacity, H): the MoE input each entry was computed at
        self.written, self.token, self.version = {}, {}, {}    # column views of `stamps`
        self.free_ranges: list = []                 # [(base, n)] sorted by base
        self._grow(capacity)

    def _grow(self, new_cap: int) -> None:
        old = self.capacity
        for li in self.layers:
            v = torch.zeros(new_cap, self.H, dtype=self.dtype, device=self.device)
            st = torch.empty(new_cap, 3, dtype=torch.long)
            st[:, 0], st[:, 1:] = EMPTY, -1
            if old:
                v[:old], st[:old] = self.values[li], self.stamps[li]
            self.values[li], self.stamps[li] = v, st
            if self.inputs is not None:
                x = torch.zeros(new_cap, self.H, dtype=self.dtype, device=self.device)
                if old:
                    x[:old] = self.inputs[li]
                self.inputs[li] = x
            self.written[li], self.token[li], self.version[li] = st[:, 0], st[:, 1], st[:, 2]
        self.free_ranges.append((old, new_cap - old))
        self._merge_free()
        self.capacity = new_cap

    def write(self, li: int, slot_W: torch.Tensor, values_WH: torch.Tensor, stamps_W3: torch.Tensor,
              inputs_WH: Optional[torch.Tensor] = None) -> None:
        """Entries of layer li at `slot_W`: routed outputs and their (pass written, token, version) stamps; with
        `keep_inputs`, the MoE inputs they were computed at (`inputs_WH`, required then)."""
        if self.inputs is not None and inputs_WH is None:
            raise ValueError("CacheArena(keep_inputs=True).write: the entries' MoE inputs (inputs_WH) are required")
        self.values[li].index_copy_(0, slot_W.to(self.device), values_WH.to(self.dtype))
        self.stamps[li].index_copy_(0, slot_W, stamps_W3)
        if self.inputs is not None:
            self.inputs[li].index_copy_(0, slot_W.to(self.device), inputs_WH.to(self.dtype))

    def _merge_free(self) -> None:
        out = []
        for b, n in sorted(self.free_ranges):
            if out and out[-1][0] + out[-1][1] == b:
                out[-1] = (out[-1][0], out[-1][1] + n)
            elif n > 0:
                out.append((b, n))
        self.free_ranges = out

    def alloc(self, n: int) -> int:
        """First-fit range of n slots (growing the slabs when none fits); its stamps start EMPTY."""
        for i, (b, m) in enumerate(self.free_ranges):
            if m >= n:
                self.free_ranges[i] = (b + n, m - n)
                self._merge_free()
                for li in self.layers:
                    self.written[li][b:b + n] = EMPTY
                return b
        self._grow(max(2 * self.capacity, self.capacity + n))
        return self.alloc(n)

    def free(self, base: int, n: int) -> None:
        self.free_ranges.append((base, n))
        self._merge_free()

    def view(self, li: int, base: int, n: int):
        """One plan's entries of one layer (tensor views: writing through them writes the arena)."""
        sl = slice(base, base + n)
        return _CacheView(self.values[li][sl], self.written[li][sl], self.token[li][sl], self.version[li][sl])


@dataclass
class _CacheView:
    values: torch.Tensor        # (N, H)
    written: torch.Tensor       # (N,)
    token: torch.Tensor         # (N,)
    version: torch.Tensor       # (N,)


@dataclass
class Liveness:
    """Per-block liveness bookkeeping: D_{i-1}, the refresh clock, and the fresh set of the current pass (views
    into the call's concatenated rows after `plan_passes`)."""

    N: int
    prev_decoded: Optional[torch.Tensor] = None   # D_{i-1}: (N,) bool, None before the first pass
    last_refresh: int = -10 ** 9                  # pass index of the last all-fresh pass
    fresh: Optional[torch.Tensor] = None          # F_i for this pass: (N,) bool
    stable: Optional[torch.Tensor] = None         # Z_i
    newly: Optional[torch.Tensor] = None          # N_i
    reason: str = ""                              # why this pass is all-fresh ("cold", "refresh", "reversal"...)
    history: list = field(default_factory=list)

    def plan_pass(self, decoded: torch.Tensor, pass_index: int, refresh: int, lsp: bool) -> str:
        """Decide F_i from D_i (docs/algorithms.md §4.3) for this block alone. Returns the block-level path:
        cold | refresh | hot | fallback."""
        return plan_passes([self], decoded, [decoded.numel()], [pass_index], refresh, lsp).paths[0]


@dataclass
class PassPlan:
    """The liveness of one call: every block's path and the call's (T,) masks, blocks' rows concatenated."""

    paths: list                 # per block: cold | refresh | hot | fallback
    fresh: torch.Tensor         # F_i of every block
    stable: torch.Tensor        # Z_i
    newly: torch.Tensor         # N_i


def plan_passes(states: list, decoded_T: torch.Tensor, lens: list, pass_index: list, refresh: int,
                lsp: bool) -> PassPlan:
    """One pass of every block of a call at once (docs/algorithms.md §4.3): `decoded_T` holds the blocks' decoded
    masks concatenated in `states` order (block p has lens[p] rows and is at pass pass_index[p]).

    Path per block, in this order: no previous pass -> cold; size changed -> fallback (shape); a decoded row turned
    live -> fallback (reversal); LSP off or pass - last all-fresh pass >= M_C (`refresh`) -> refresh; else hot.
    Vectorised over the call's rows: one concatenation of the previous decoded masks, one reduction for the
    reversals; the per-block work left is the path decision on host integers. Each state's `fresh`, `stable`,
    `newly` and `prev_decoded` become views of the call's (T,) masks, which are returned with the paths.

    Example: two blocks of 2 rows, prev = [[0, 1], None], decoded = [1, 1 | 0, 1] at pass 3 (M_C = 5, last
    refresh 0): block 0 hot (stable {1}, newly {0}, fresh {0}); block 1 cold (all fresh, newly {1}).
    """
    P = len(states)
    decoded_T = decoded_T.to(torch.bool, copy=True)              # owned: the states keep views of it
    prevs, shape_ok = [], []
    for st, n in zip(states, lens):
        ok = st.prev_decoded is not None and st.prev_decoded.numel() == n
        shape_ok.append(ok)
        prevs.append(st.prev_decoded if ok else torch.zeros(n, dtype=torch.bool))
    prev_T = torch.cat(prevs) if P > 1 else prevs[0]
    rev_T = prev_T & ~decoded_T                                   # decoded -> live: not a masked-diffusion step
    reversed_ = [False] * P
    if bool(rev_T.any()):
        plan_T = torch.repeat_interleave(torch.arange(P), torch.tensor(lens))
        reversed_ = (torch.zeros(P, dtype=torch.long).index_add_(0, plan_T, rev_T.long()) > 0).tolist()
    paths, all_fresh = [], []
    for p, st in enumerate(states):
        if st.prev_decoded is None:
            path, st.reason = "cold", "cold"
        elif not shape_ok[p]:
            path, st.reason = "fallback", "shape"
        elif reversed_[p]:
            path, st.reason = "fallback", "reversal"
        elif not lsp or pass_index[p] - st.last_refresh >= refresh:
            path, st.reason = "refresh", "refresh"
        else:
            path, st.reason = "hot", ""
        if path != "hot":
            st.last_refresh = pass_index[p]
        paths.append(path)
        all_fresh.append(path != "hot")
    stable_T = decoded_T & prev_T
    newly_T = decoded_T & ~prev_T
    if all(all_fresh):
        fresh_T = torch.ones_like(decoded_T)
    elif not any(all_fresh):
        fresh_T = ~stable_T
    else:
        fresh_T = torch.repeat_interleave(torch.tensor(all_fresh), torch.tensor(lens)) | ~stable_T
    splits = [t.split(lens) if P > 1 else (t,) for t in (decoded_T, fresh_T, stable_T, newly_T)]
    for st, d, f, z, nw in zip(states, *splits):
        st.prev_decoded, st.fresh, st.stable, st.newly = d, f, z, nw
    return PassPlan(paths, fresh_T, stable_T, newly_T)
