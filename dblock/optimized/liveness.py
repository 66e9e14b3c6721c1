"""Liveness-Shard Parallelism (docs/algorithms.md §4.3): fresh sets and the per-layer decoded-output cache.

The cache holds the **routed-expert output only** (not the shared expert, not the layer output, not hidden states)
of decoded rows, keyed by (block plan, layer, row) and stamped with the plan's version, the pass it was written at
and the token the row held. A stable decoded row (decoded on this pass and the previous one) is served from the
cache; every other row is fresh. Every `refresh` passes all rows go fresh, so a served entry has age (passes since
it was written) in 1..refresh-1, i.e. 0 <= age <= M_C - 1. Anything unexpected — a missing entry, a version or
token mismatch, a shape change, a decoded row turning live again, an entry of age >= M_C — makes the layer (or
block) fully fresh: never a stale read.

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

    Example: plans A (N = 3) and B (N = 2) get bases 0 and 3; row 1 of B reads slot 4 of every layer's slab.
    Freeing A leaves [0, 3) free; a plan of N = 2 reuses slots 0..1 (first fit), with their stamps reset to EMPTY.
    """

    def __init__(self, layers, H: int, dtype, device, capacity: int = 256):
        self.layers, self.H, self.dtype, self.device = list(layers), H, dtype, device
        self.capacity = 0
        self.values, self.written, self.token, self.version = {}, {}, {}, {}
        self.free_ranges: list = []                 # [(base, n)] sorted by base
        self._grow(capacity)

    def _grow(self, new_cap: int) -> None:
        old = self.capacity
        for li in self.layers:
            v = torch.zeros(new_cap, self.H, dtype=self.dtype, device=self.device)
            w = torch.full((new_cap,), EMPTY, dtype=torch.long)
            t = torch.full((new_cap,), -1, dtype=torch.long)
            r = torch.full((new_cap,), -1, dtype=torch.long)
            if old:
                v[:old], w[:old], t[:old], r[:old] = (self.values[li], self.written[li], self.token[li],
                                                      self.version[li])
            self.values[li], self.written[li], self.token[li], self.version[li] = v, w, t, r
        self.free_ranges.append((old, new_cap - old))
        self._merge_free()
        self.capacity = new_cap

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
    """Per-block liveness bookkeeping: D_{i-1}, the refresh clock, and the fresh set of the current pass."""

    N: int
    prev_decoded: Optional[torch.Tensor] = None   # D_{i-1}: (N,) bool, None before the first pass
    last_refresh: int = -10 ** 9                  # pass index of the last all-fresh pass
    fresh: Optional[torch.Tensor] = None          # F_i for this pass: (N,) bool
    stable: Optional[torch.Tensor] = None         # Z_i
    newly: Optional[torch.Tensor] = None          # N_i
    reason: str = ""                              # why this pass is all-fresh ("cold", "refresh", "reversal"...)
    history: list = field(default_factory=list)

    def plan_pass(self, decoded: torch.Tensor, pass_index: int, refresh: int, lsp: bool) -> str:
        """Decide F_i from D_i (docs/algorithms.md §4.3). Returns the block-level path: cold | refresh | hot | fallback."""
        if self.prev_decoded is None:
            path, all_fresh = "cold", True
        elif decoded.shape != self.prev_decoded.shape:
            path, all_fresh = "fallback", True
            self.reason = "shape"
        elif (self.prev_decoded & ~decoded).any():      # decoded -> live: not a masked-diffusion transition
            path, all_fresh = "fallback", True
            self.reason = "reversal"
        elif not lsp or pass_index - self.last_refresh >= refresh:
            path, all_fresh = "refresh", True
        else:
            path, all_fresh = "hot", False
        prev = self.prev_decoded if (self.prev_decoded is not None and self.prev_decoded.shape == decoded.shape) \
            else torch.zeros_like(decoded)
        self.stable = decoded & prev
        self.newly = decoded & ~prev
        self.fresh = torch.ones_like(decoded) if all_fresh else ~self.stable
        if all_fresh:
            self.last_refresh = pass_index
        self.prev_decoded = decoded.clone()
        return path
