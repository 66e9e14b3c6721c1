"""Deliberate faults for checking the checker (`dblock verify --inject-fault`, docs/algorithms.md §5).

Each fault is a mixin that overrides one or more named steps of `dblock.optimized.executor.EpochExecutor`;
`with_faults(base, faults)` puts the requested mixins in front of an executor class (the audited one, in the suite).
The production executor knows nothing of them. Every fault must be caught by the invariant named in
`report.FAULTS`:

  stale-cache            `_plan_passes`: the refresh clock never fires, so entries age past M_C;
                         `_cache_checks`: served without checking                              -> staleness
  cache-newly-decoded    `_fresh_rows`: newly decoded rows on hot passes are served from the entry written while they
                         were still live; `_rows_to_write`: live rows are cached too;
                         `_cache_checks`: served without checking                              -> newly-decoded
  route-outside-support  `__init__`: tiny supports (B = K) so that an outside exists;
                         `_routing_support`: routing ignores the support                       -> support-routing
  skip-live-logits       `_head_rows`: the first live row of a segment gets no LM head         -> lm-head
  drift-unchecked        `_drift_gate`: the drift is measured but never enforced, so rows whose
                         MoE input moved past ε are served (needs `--lsp-drift`)               -> drift
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from dblock.equivalence.report import FAULTS
from dblock.optimized.liveness import EMPTY, plan_passes


class StaleCache:
    """The refresh clock never fires and reads are not checked: cache entries age past M_C."""

    def _plan_passes(self, plans, decoded_T, lens):
        return plan_passes([pl.liveness for pl in plans], decoded_T, lens, [pl.passes for pl in plans], 1 << 30,
                           self.ecfg.lsp)

    def _cache_checks(self, li, R, idx_C, slot_C, age_C):
        return {}


class CacheNewlyDecoded:
    """Newly decoded rows are served from the entry written while they were live (live rows are cached too)."""

    def _fresh_rows(self, c):
        fresh_T = super()._fresh_rows(c)
        written = self.arena.written[c.li]
        fresh_T[c.R.newly & c.R.hot & (written[c.R.slot] != EMPTY)] = False
        return fresh_T

    def _cache_checks(self, li, R, idx_C, slot_C, age_C):
        return {}

    def _rows_to_write(self, c):
        return c.fresh_T.clone()


class RouteOutsideSupport:
    """Routing ignores the block's support (made tiny, B = K, so that an outside exists)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ap = replace(self.ap, B=min(self.ap.B, self.config.num_experts_per_tok))

    def _routing_support(self, li, plan):
        return None


class SkipLiveLogits:
    """The LM head skips the first live row of every segment that has one."""

    def _head_rows(self, s, device):
        live = super()._head_rows(s, device)
        if live.any():
            live = live.clone()
            live[live.nonzero()[0, 0]] = False
        return live


class DriftUnchecked:
    """LSP's drift bound is measured (the record carries every served row's drift) but not enforced: a row whose
    MoE input moved past ε is served anyway."""

    def _drift_gate(self, c):
        if self.ecfg.lsp_drift is not None and c.idx_S.numel():
            c.drift_S = self._served_drift(c)               # recorded for the audit, every row still served


INJECTORS = {
    "stale-cache": StaleCache,
    "cache-newly-decoded": CacheNewlyDecoded,
    "route-outside-support": RouteOutsideSupport,
    "skip-live-logits": SkipLiveLogits,
    "drift-unchecked": DriftUnchecked,
}
assert set(INJECTORS) == set(FAULTS), "every fault the report knows must have an injector"


def with_faults(base: type, faults: Sequence[str]) -> type:
    """`base` with the named faults' step overrides in front of it (`base` itself when there are none)."""
    faults = list(dict.fromkeys(faults))
    for f in faults:
        if f not in INJECTORS:
            raise ValueError(f"fault {f!r}: allowed {', '.join(sorted(INJECTORS))}")
    if not faults:
        return base
    mixins = tuple(INJECTORS[f] for f in sorted(faults))
    return type(f"Faulty{base.__name__}", mixins + (base,), {"faults": frozenset(faults)})
