"""The audited Epoch executor: the production `EpochExecutor` with the equivalence suite's taps installed from outside.

`AuditedEpochExecutor` overrides two named steps of the executor (`_layer_output` in dblock/optimized/moe_steps.py,
`_segment_logits` in dblock/optimized/executor.py) and records, after each, what the checks of `invariants.py`
and the shadow comparison (`shadow.py`) read; the production executor carries none of it:

  _layer_output      `audit`: one record per (pass, block, MoE layer) — the block's path, fresh rows, rows served
                     from the decoded-output cache and their ages, newly decoded and decoded rows, the support and
                     its build (success, |U_l|, when), the routed (row, expert) pairs outside the support (none for a
                     block that took the dense path or builds its support this pass: it routes its rows with every
                     expert, the plain router's result exactly; `EpochExecutor.routes_plain`), the block's path this pass (`pass_path`: epoch | dense); and, while
                     `taps` is a dict (the shadow sets it per call), per MoE layer "routed" (every row's MoE output
                     after the cache merge minus the shared expert of its current input, (B, L, H): the reference's
                     routed tap plus exactly the MoE output's difference, since the cache serves routed and shared
                     output together) and "moe_in" (the normed MoE input, (B, L, H))
  _segment_logits    `audit_heads`: one record per (pass, block) — its live rows and the rows the LM head ran for

Deliberate faults for the checker's self-check (`dblock verify --inject-fault`) are further overrides of other
named steps (`faults.py`); `instrumented_executor` composes them with or without the audit. Recording and faults
change no token, counter or trace of the executor they wrap (tests/equivalence/test_audit_hooks.py).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from dblock.optimized.executor import EpochExecutor, epoch_class, epoch_config
from dblock.optimized.plan import EpochConfig
from dblock.optimized.rows import LayerCall, Rows


class AuditedEpochExecutor(EpochExecutor):
    """`EpochExecutor` that also keeps `audit` and `audit_heads` records and fills `taps` when it is a dict."""

    def __init__(self, model, cfg: EpochConfig | None = None, dispatcher=None):
        super().__init__(model, cfg, dispatcher=dispatcher)
        self.audit: list = []          # per (pass, block, layer) records
        self.audit_heads: list = []    # per (pass, block) rows the LM head ran for
        self.taps = None               # a dict -> per MoE layer "routed", "moe_in" (set by the shadow per call)

    # ---- recorded steps -----------------------------------------------------------------------------------
    def _layer_output(self, c: LayerCall) -> torch.Tensor:
        self._audit_layer(c)
        if self.taps is not None:
            self._tap_layer(c)
        return super()._layer_output(c)

    def _segment_logits(self, it, s, hidden_NH, rows_N):
        self.audit_heads.append({"pass": self._pass, "request": it.request, "block": s.block,
                                 "live": s.live.nonzero(as_tuple=True)[0].tolist(),
                                 "head_rows": rows_N.nonzero(as_tuple=True)[0].tolist()})
        return super()._segment_logits(it, s, hidden_NH, rows_N)

    # ---- records ------------------------------------------------------------------------------------------
    def _audit_layer(self, c: LayerCall) -> None:
        R: Rows = c.R
        li = c.li
        served = {}
        for p in R.plan[c.idx_S].unique().tolist():
            m = R.plan[c.idx_S] == p
            served[p] = (c.idx_S[m], c.age_S[m], None if c.drift_S is None else c.drift_S[m])
        for p, plan in enumerate(R.plans):
            rows_T = R.plan_rows[p]
            in_plan = R.plan[c.idx_F] == p
            lp = plan.layer(li)
            sup = lp.support
            opened = c.open_F[in_plan] if c.open_F is not None else torch.zeros(int(in_plan.sum()), dtype=torch.bool)
            chosen = c.ids_FK[in_plan][~opened]          # rows the per-token fail-closed opened may leave S_l
            dense = c.dense or R.dense_P[p]              # the block took the dense path
            plain = self.routes_plain(c, p)              # routed with every expert (dense, or building its support)
            outside = 0 if sup is None or plain else int((~sup[chosen.clamp(min=0)] & (chosen >= 0)).sum())
            srv = served.get(p)
            self.audit.append({
                "pass": self._pass, "request": plan.request, "block": plan.block, "plan_pass": plan.passes,
                "layer": li, "path": plan.path, "pass_path": "dense" if dense else "epoch", "N": plan.N,
                "fresh": int(c.fresh_T[rows_T].sum()),
                "served_rows": [] if srv is None else R.row[srv[0]].tolist(),
                "served_ages": [] if srv is None else srv[1].tolist(),
                "served_drift": None if srv is None or srv[2] is None else srv[2].tolist(),
                "lsp_drift": self.ecfg.lsp_drift,
                "newly_decoded": plan.liveness.newly.nonzero(as_tuple=True)[0].tolist(),
                "decoded": R.decoded[rows_T].nonzero(as_tuple=True)[0].tolist(),
                "support": None if sup is None else sup.nonzero(as_tuple=True)[0].tolist(),
                "support_ok": lp.support_ok, "under": lp.under,
                "routed_outside_support": outside, "refresh": self.ecfg.refresh,
                "opened": int(opened.sum()),
                "built_at": lp.built_at, "alpha": self.ap.alpha, "q": self.ap.q,
            })

    def _tap_layer(self, c: LayerCall) -> None:
        B, L, H = c.xn_BLH.shape
        full = torch.zeros(B * L, H, dtype=c.xn_BLH.dtype, device=c.xn_BLH.device)
        y_TH = c.y_TH if c.moe.shared is None else c.y_TH - c.moe.shared(c.x_TH)
        full[c.R.flat] = y_TH.to(full.dtype)
        self.taps.setdefault("routed", []).append(full.view(B, L, H))
        self.taps.setdefault("moe_in", []).append(c.xn_BLH)


@functools.lru_cache(maxsize=None)
def audited_class(base: type) -> type:
    """`base` (an Epoch executor class, `epoch_class`) with the audit's recorded steps in front of it:
    `AuditedEpochExecutor` itself for `EpochExecutor`, one class per other family's executor (the DiffusionGemma
    executor: `AuditedGemmaEpochExecutor`)."""
    if base is EpochExecutor:
        return AuditedEpochExecutor
    return type(f"Audited{base.__name__}", (AuditedEpochExecutor, base), {})


def instrumented_executor(model, cfg: EpochConfig, dispatcher=None, audit: bool = True,
                          faults: Sequence[str] = ()) -> EpochExecutor:
    """The model family's Epoch executor with the audit records (`audit`) and the named deliberate faults
    installed."""
    from dblock.equivalence.faults import with_faults
    base = epoch_class(model)
    return with_faults(audited_class(base) if audit else base, faults)(model, cfg, dispatcher=dispatcher)


def audited_epoch_forward(model, config: str = "epoch", faults: Sequence[str] = (), dispatcher=None,
                          **knobs) -> EpochExecutor:
    """`epoch_forward(model, config, **knobs)` audited, with `faults` injected (config must not be dense)."""
    if config == "dense":
        raise ValueError("the audited executor is the epoch executor; dense is the reference itself")
    return instrumented_executor(model, epoch_config(config, **knobs), dispatcher=dispatcher, faults=faults)
