"""The block plan (docs/algorithms.md §4.1): the block clock's state of one in-flight block of one request.

Built on the block's first pass (cold path), destroyed when the block commits, never reused. It holds identifiers,
maps and the decoded-output caches of LSP — never live hidden states, router logits or logits.

Paths, counted per MoE layer: cold (first pass: build supports), hot-update (rebuild S_l from the current pass's
scores every `update_every` passes), hot-skip (reuse S_l), refresh (all rows fresh every M_C passes), fallback
(fail closed: all experts and/or all rows fresh for that layer, with the reason).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dblock.optimized.atlas import AtlasParams
from dblock.optimized.liveness import Liveness

CONFIGS = ("epoch", "full_compute", "no_atlas", "no_lsp", "dense")


@dataclass
class EpochConfig:
    """Which relaxations are on (docs/algorithms.md §4.5) and their knobs."""

    name: str = "epoch"
    atlas: bool = True               # restrict routing to a per-block expert support
    lsp: bool = True                 # serve stable decoded rows' routed outputs from the bounded-age cache
    refresh: int = 5                 # M_C: every M_C passes all rows go fresh (age bound M_C - 1)
    atlas_params: AtlasParams = field(default_factory=AtlasParams)
    use_triton: bool = False

    @classmethod
    def named(cls, name: str, refresh: Optional[int] = None, **atlas_kw) -> "EpochConfig":
        atlas_kw = {k: v for k, v in atlas_kw.items() if v is not None}
        ap = AtlasParams(**atlas_kw)
        M = 5 if refresh is None else refresh
        if M < 1:
            raise ValueError(f"refresh={M}: M_C must be >= 1")
        if not 0.0 < ap.alpha <= 1.0 or not 0.0 <= ap.q <= 1.0:
            raise ValueError(f"atlas alpha={ap.alpha}, q={ap.q}: allowed alpha in (0, 1], q in [0, 1]")
        for k in ("m", "B", "c"):
            v = getattr(ap, k)
            if v is not None and v < (1 if k == "B" else 0):
                raise ValueError(f"atlas {k}={v}: must be >= {1 if k == 'B' else 0}")
        if ap.beta < 0:
            raise ValueError(f"atlas beta={ap.beta}: must be >= 0")
        if ap.update_every < 1:
            raise ValueError(f"update_every={ap.update_every}: must be >= 1")
        table = {
            "epoch": dict(atlas=True, lsp=True, refresh=M),
            "full_compute": dict(atlas=False, lsp=False, refresh=1),
            "no_atlas": dict(atlas=False, lsp=True, refresh=M),
            "no_lsp": dict(atlas=True, lsp=False, refresh=1),
        }
        if name not in table:
            raise ValueError(f"epoch config {name!r}: allowed {', '.join(CONFIGS)}")
        return cls(name=name, atlas_params=ap, **table[name])


@dataclass
class LayerPlan:
    support: Optional[torch.Tensor] = None    # (E,) bool; None = all experts
    built_at: int = -1                        # pass index of the last (re)build
    support_ok: bool = True                   # last build reached |U| <= (1-q) N
    under: int = 0                            # |U_l| at the last build
    paths: Counter = field(default_factory=Counter)


@dataclass
class BlockPlan:
    request: Any
    block: int
    N: int                                    # rows of the block's segment
    n_layers: int
    version: int = 0                          # bumped whenever caches are invalidated
    passes: int = 0                           # passes this plan has served (pass index of the next pass)
    liveness: Liveness = None
    layers: dict = field(default_factory=dict)
    path: str = "cold"                        # block-level path of the current pass
    base: Optional[int] = None                # first cache slot of the block's rows in the executor's CacheArena

    def __post_init__(self):
        if self.liveness is None:
            self.liveness = Liveness(self.N)

    def layer(self, i: int) -> LayerPlan:
        if i not in self.layers:
            self.layers[i] = LayerPlan()
        return self.layers[i]

    def invalidate(self) -> None:
        self.version += 1

    def counters(self) -> dict:
        total = Counter()
        for lp in self.layers.values():
            total.update(lp.paths)
        return dict(total)
