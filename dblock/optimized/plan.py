"""The block plan (docs/algorithms.md §4.1): the block clock's state of one in-flight block of one request.

Built on the block's first pass (cold path), destroyed when the block commits, never reused. It holds identifiers,
maps and the decoded-output caches of LSP — never live hidden states, router logits or logits.

Paths, counted per MoE layer: cold (first pass: build supports), hot-update (rebuild S_l from the current pass's
scores every `update_every` passes), hot-skip (reuse S_l), refresh (all rows fresh every M_C passes), fallback
(fail closed: all experts and/or all rows fresh for that layer, with the reason), dense (the block took the dense
path this pass, `PathModel`).

`PathModel` is the per-block, per-pass choice between the epoch path and the dense path (docs/algorithms.md §4.1):
the epoch path pays iff m·(1 − f) > o, with f the block's own fresh-row fraction, m the share of a dense pass that scales
with the rows the routed experts compute and o the epoch path's fixed overhead share — both from the roofline pass
cost of `dblock.simulator.cost` (`PathModel.from_cost`) or from a profile measured on the machine
(`benchmarks/epoch_cpu.py` measures one; `PathModel.load`).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dblock.optimized.atlas import AtlasParams
from dblock.optimized.liveness import Liveness

CONFIGS = ("epoch", "full_compute", "no_atlas", "no_lsp", "dense")
PASS_PATHS = ("auto", "epoch", "dense")


@dataclass(frozen=True)
class PathModel:
    """When the epoch path pays for a block's pass (docs/algorithms.md §4.1).

    With f the block's fresh-row fraction (rows through the routed experts / rows), a pass costs, as shares of a
    dense pass,  dense: 1;  epoch: 1 + o − m·(1 − f).  So the epoch path pays iff  m·(1 − f) > o, i.e. iff f is
    below the break-even fraction f* = 1 − o/m; at f = 1 (nothing to skip) it never pays.

      m   `moe_share`       the part of a dense pass that scales with the rows the routed experts compute (expert
                            GEMMs, dispatch and combine, their per-row overheads)
      o   `overhead_share`  what the epoch path adds at f = 1 (compaction, cache checks, merge and writes,
                            restricted routing), as a share of the dense pass
    """

    moe_share: float
    overhead_share: float
    source: str = ""

    def epoch_pays(self, fresh_frac: float) -> bool:
        return self.moe_share * (1.0 - fresh_frac) > self.overhead_share

    @property
    def break_even(self) -> float:
        """f*: the epoch path pays for fresh fractions below it (0 when it never pays)."""
        return max(0.0, 1.0 - self.overhead_share / self.moe_share) if self.moe_share > 0 else 0.0

    def as_dict(self) -> dict:
        return {"moe_share": self.moe_share, "overhead_share": self.overhead_share, "source": self.source,
                "break_even": self.break_even}

    @classmethod
    def from_dict(cls, d: dict) -> "PathModel":
        try:
            m, o = float(d["moe_share"]), float(d["overhead_share"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"path model {str(d)[:60]!r}: needs numbers moe_share and overhead_share") from None
        if not (0.0 <= m <= 1.0 and 0.0 <= o < math.inf):
            raise ValueError(f"path model moe_share={m}, overhead_share={o}: need 0 <= m <= 1 and o >= 0")
        return cls(m, o, str(d.get("source", "")))

    @classmethod
    def load(cls, path: str) -> "PathModel":
        """A measured per-machine profile: a JSON object with `moe_share` and `overhead_share`."""
        from dblock.input_files import read_json
        return cls.from_dict(read_json(path, "--path-profile"))

    @classmethod
    def from_cost(cls, cfg, batch: int, rows_per_request: int, hardware="h100") -> "PathModel":
        """m and o from the roofline pass cost (`dblock.simulator.cost.pass_cost`, docs/algorithms.md §6.2) of a
        Native pass of `batch` requests × `rows_per_request` rows on `hardware` (a profile name or a `Hardware`):

            o = (T_epoch(f = 1) − T_dense) / T_dense        T_epoch(f = 1): every row fresh, the epoch extras paid
            m = (T_epoch(f = 1) − T_epoch(f = 0)) / T_dense  the part that goes away when no row is fresh

        (LM head on every row on both sides: the live-rows head is exact and runs on both paths). The cost model
        is linear in the fresh rows except where expert tiles pad below the GEMM knee; m is its chord."""
        from dblock.simulator import cost
        from dblock.simulator import hardware as hwmod
        hw = hwmod.get(hardware) if isinstance(hardware, str) else hardware
        shape = cost.PassShape(batch=max(1, batch), layout="native", block=max(1, rows_per_request))
        dense = cost.pass_cost(cfg, shape, hw).total
        e1 = cost.pass_cost(cfg, cost.with_(shape, path="epoch", fresh_frac=1.0), hw).total
        e0 = cost.pass_cost(cfg, cost.with_(shape, path="epoch", fresh_frac=0.0), hw).total
        if dense <= 0:
            return cls(0.0, 0.0, f"cost model ({hw.name}): empty pass")
        return cls(max(0.0, (e1 - e0) / dense), max(0.0, (e1 - dense) / dense),
                   f"cost model ({hw.name}, batch {batch} x {rows_per_request} rows)")


@dataclass
class EpochConfig:
    """Which relaxations are on (docs/algorithms.md §4.5) and their knobs."""

    name: str = "epoch"
    atlas: bool = True               # restrict routing to a per-block expert support
    atlas_repair: bool = True        # hot repair: opened rows' top-K experts join their block's support
    lsp: bool = True                 # serve stable decoded rows' routed outputs from the bounded-age cache
    refresh: int = 5                 # M_C: every M_C passes all rows go fresh (age bound M_C - 1)
    atlas_params: AtlasParams = field(default_factory=AtlasParams)
    use_triton: bool = False
    path: str = "auto"               # per block and pass: auto (PathModel) | epoch (always) | dense (always)
    path_model: Optional[PathModel] = None   # None: PathModel.from_cost on `path_hardware`, per block row count
    path_hardware: str = "h100"      # the cost model's hardware profile when no measured path_model is given
    path_batch: int = 32             # the cost model's nominal batch (never the call's: a block's path must not
                                     # depend on what else is in its call)
    grouped_mm: bool = False         # routed experts through F.grouped_mm: faster on large shapes, may differ from
                                     # the reference (and from the dense path) in the last bit; off: the per-expert
                                     # loop, the reference's arithmetic on every path (batch invariant)
    margin_refresh: Optional[float] = None   # δ of the margin-gated exact refresh (docs/algorithms.md §4.7): a
                                     # request whose pass was approximate is recomputed exactly (full_compute) when
                                     # its blocks' decision radius at the Epoch logits is <= δ; None: off;
                                     # 0: never (the gate only counts); inf: every approximate pass
    lsp_drift: Optional[float] = None    # ε of LSP's drift bound (docs/algorithms.md §4.3): a stable decoded row is
                                     # served only when its MoE input moved by <= ε of its norm since its entry
                                     # was written, else computed fresh; None: off (the age bound M_C alone)

    @classmethod
    def named(cls, name: str, refresh: Optional[int] = None, path: Optional[str] = None,
              path_model: Optional[PathModel] = None, margin_refresh: Optional[float] = None,
              lsp_drift: Optional[float] = None, **atlas_kw) -> "EpochConfig":
        path = "auto" if path is None else path
        margin_refresh = _bound("margin_refresh", margin_refresh, "the logit bound δ must be >= 0 (inf: refresh "
                                "every approximate pass)")
        lsp_drift = _bound("lsp_drift", lsp_drift, "the drift bound ε must be >= 0 (0: serve only rows whose MoE "
                           "input did not move; inf: the age bound alone)")
        if path not in PASS_PATHS:
            raise ValueError(f"path={path!r}: allowed {', '.join(PASS_PATHS)}")
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
        return cls(name=name, atlas_params=ap, path=path, path_model=path_model, margin_refresh=margin_refresh,
                   lsp_drift=lsp_drift, **table[name])


def _bound(name: str, value, rule: str) -> Optional[float]:
    """An optional non-negative bound (inf allowed) as a float; None stays None (off)."""
    if value is None:
        return None
    if not float(value) >= 0.0:
        raise ValueError(f"{name}={value}: {rule}, or None for off")
    return float(value)


@dataclass
class LayerPlan:
    support: Optional[torch.Tensor] = None    # (E,) bool; None = all experts
    support_size: Optional[int] = None        # its number of experts (None = all)
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
