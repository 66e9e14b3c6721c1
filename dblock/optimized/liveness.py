"""Liveness-Shard Parallelism (SPEC §4.3): fresh sets and the per-layer decoded-output cache.

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


@dataclass
class LayerCache:
    """Decoded-output cache of one (block, MoE layer)."""

    values: torch.Tensor        # (N, H) routed-expert outputs
    written: torch.Tensor       # (N,) int64 pass index at write, EMPTY = never written
    token: torch.Tensor         # (N,) int64 token the row held when written
    version: torch.Tensor       # (N,) int64 plan version at write

    @classmethod
    def empty(cls, N: int, H: int, dtype, device) -> "LayerCache":
        return cls(torch.zeros(N, H, dtype=dtype, device=device), torch.full((N,), EMPTY, dtype=torch.long),
                   torch.full((N,), -1, dtype=torch.long), torch.full((N,), -1, dtype=torch.long))

    def write(self, rows: torch.Tensor, values: torch.Tensor, pass_index: int, tokens: torch.Tensor,
              version: int) -> None:
        self.values[rows] = values.to(self.values.dtype)
        self.written[rows] = pass_index
        self.token[rows] = tokens
        self.version[rows] = version

    def servable(self, rows: torch.Tensor, pass_index: int, tokens: torch.Tensor, version: int, refresh: int):
        """(ok, reason, ages): can every row in `rows` be served now? Fails closed on any doubt."""
        if rows.numel() == 0:
            return True, "", torch.zeros(0, dtype=torch.long)
        w = self.written[rows]
        if (w == EMPTY).any():
            return False, "miss", None
        if (self.version[rows] != version).any():
            return False, "version", None
        if (self.token[rows] != tokens).any():
            return False, "token", None
        ages = pass_index - w
        if (ages < 1).any() or (ages >= refresh).any():
            return False, "age", None
        return True, "", ages


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
        """Decide F_i from D_i (SPEC §4.3). Returns the block-level path: cold | refresh | hot | fallback."""
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
