"""Invariants of the optimized executor (docs/algorithms.md §4.3, §5), checked on its audit records.

The audited Epoch executor (`audit.AuditedEpochExecutor`) appends one record per (pass, block, layer) to
`executor.audit` (served rows and their ages, newly decoded and decoded rows, the support and whether its build
succeeded, the count of routed (row, expert) pairs outside the support) and one per (pass, block) to
`executor.audit_heads` (the live rows and the rows the LM head ran for). Every check here is a pure function of those records (plus, where the
shadow comparison has it, the block's own pass count and the rows' absolute positions), so the same code judges a
real run, a hand-driven state machine and a deliberately broken executor.

Invariant names (stable: they appear in `dblock verify` output and exit reasons):

  staleness          every served cache entry has 0 <= age <= M_C - 1
  newly-decoded      a newly decoded row (decoded now, live on the previous pass) is never served from the cache
  served-live        a live row is never served from the cache (live rows always feed a decision)
  block-boundary     nothing crosses a block: an entry is never older than its block plan, a plan never outlives its
                     block's commit (checked by the shadow at `end_block`), and a plan's pass clock never runs ahead
                     of the block's own
  coverage           a support build that reports success has |U_l| <= (1 - q) N (the shadow also recomputes |U_l|
                     independently from the layer's MoE input)
  fail-closed        a failed support build leaves the layer on all experts
  support-routing    routing never picks an expert outside the layer's support (except a hot-pass row whose own
                     coverage fell below alpha: the per-token fail-closed routes it with every expert, counted
                     in the record's `opened`)
  lm-head            the LM head runs for every live row (the executor returns exactly one logits row per live row)
  drift              under LSP's drift bound ε (`EpochConfig.lsp_drift`) every served row's MoE input moved by at most
                     ε of its norm since its entry was written (the record carries each served row's drift)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

INVARIANTS = ("staleness", "newly-decoded", "served-live", "block-boundary", "coverage", "fail-closed",
              "support-routing", "lm-head", "drift")


@dataclass
class Violation:
    invariant: str
    message: str
    where: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"invariant": self.invariant, "message": self.message, **self.where}


def _where(rec: dict, **extra) -> dict:
    w = {"request": rec.get("request"), "block": rec.get("block"), "pass": rec.get("pass"),
         "plan_pass": rec.get("plan_pass"), "layer": rec.get("layer")}
    w.update(extra)
    return w


def _at(rec: dict, row: int, positions: Optional[list]) -> str:
    pos = f" (position {positions[row]})" if positions is not None and row < len(positions) else ""
    return (f"request {rec.get('request')} block {rec.get('block')} pass {rec.get('pass')} "
            f"(block pass {rec.get('plan_pass')}) layer {rec.get('layer')} row {row}{pos}")


def check_record(rec: dict, block_pass: Optional[int] = None, positions: Optional[list] = None) -> list:
    """Violations in one (pass, block, layer) audit record.

    `block_pass`: how many passes the block had taken before this one (from the schedule's side; None = unknown).
    `positions`: absolute positions of the block's rows (for messages).
    """
    out = []
    M = rec["refresh"]
    served = rec["served_rows"]
    ages = rec["served_ages"]
    newly = set(rec["newly_decoded"])
    decoded = set(rec["decoded"])
    pos = lambda r: None if positions is None or r >= len(positions) else int(positions[r])  # noqa: E731
    for r, a in zip(served, ages):
        if not 0 <= a <= M - 1:
            out.append(Violation("staleness", f"{_at(rec, r, positions)}: served a cache entry of age {a} "
                                              f"(allowed 0..M_C-1 = 0..{M - 1})", _where(rec, row=r, position=pos(r),
                                                                                         age=a)))
        if a > rec["plan_pass"]:
            out.append(Violation("block-boundary", f"{_at(rec, r, positions)}: served an entry of age {a} older than "
                                                   f"its block plan ({rec['plan_pass']} passes): it crossed a block",
                                 _where(rec, row=r, position=pos(r), age=a)))
        if r in newly:
            out.append(Violation("newly-decoded", f"{_at(rec, r, positions)}: newly decoded row served from the "
                                                  f"cache (entry of age {a}); it must be fresh once first",
                                 _where(rec, row=r, position=pos(r), age=a)))
        elif r not in decoded:
            out.append(Violation("served-live", f"{_at(rec, r, positions)}: live row served from the cache",
                                 _where(rec, row=r, position=pos(r), age=a)))
    eps = rec.get("lsp_drift")
    if eps is not None and served:
        drift = rec.get("served_drift")
        if drift is None:
            out.append(Violation("drift", f"request {rec['request']} block {rec['block']} pass {rec['pass']} layer "
                                          f"{rec['layer']}: {len(served)} rows served under the drift bound "
                                          f"ε = {eps:g} without a drift check", _where(rec, served=len(served))))
        else:
            for r, d in zip(served, drift):
                if not d <= eps:
                    out.append(Violation("drift", f"{_at(rec, r, positions)}: served an entry whose MoE input "
                                                  f"moved by {d:.3g} of its norm (bound ε = {eps:g})",
                                         _where(rec, row=r, position=pos(r), drift=d)))
    if block_pass is not None and rec["plan_pass"] > block_pass:
        out.append(Violation("block-boundary", f"request {rec['request']} block {rec['block']} pass {rec['pass']} "
                                               f"layer {rec['layer']}: the block plan is at pass {rec['plan_pass']} "
                                               f"but the block has taken only {block_pass}: a plan survived its "
                                               "block", _where(rec, block_pass=block_pass)))
    if rec["routed_outside_support"]:
        out.append(Violation("support-routing", f"request {rec['request']} block {rec['block']} pass {rec['pass']} "
                                                f"layer {rec['layer']}: {rec['routed_outside_support']} routed "
                                                f"(row, expert) pairs outside the support S_l "
                                                f"(|S_l| = {len(rec['support'] or [])})",
                             _where(rec, pairs=rec["routed_outside_support"])))
    built_now = rec.get("built_at", None) == rec["plan_pass"]
    if built_now or rec.get("built_at") is None:
        if rec["support_ok"]:
            allowed = (1.0 - rec.get("q", 0.95)) * rec["N"]
            if rec["under"] > allowed + 1e-9:
                out.append(Violation("coverage", f"request {rec['request']} block {rec['block']} pass {rec['pass']} "
                                                 f"layer {rec['layer']}: support build reported success with "
                                                 f"|U_l| = {rec['under']} > (1-q)N = {allowed:g}",
                                     _where(rec, under=rec["under"], allowed=allowed)))
        elif rec["support"] is not None:
            out.append(Violation("fail-closed", f"request {rec['request']} block {rec['block']} pass {rec['pass']} "
                                                f"layer {rec['layer']}: support build failed (|U_l| = "
                                                f"{rec['under']}) but the layer still routes within "
                                                f"{len(rec['support'])} experts", _where(rec)))
    return out


def check_head(rec: dict, positions: Optional[list] = None) -> list:
    """Violations in one (pass, block) LM-head record: every live row must get its LM head."""
    missing = sorted(set(rec["live"]) - set(rec["head_rows"]))
    out = []
    for r in missing:
        pos = f" (position {positions[r]})" if positions is not None and r < len(positions) else ""
        out.append(Violation("lm-head", f"request {rec['request']} block {rec['block']} pass {rec['pass']} row "
                                        f"{r}{pos}: live row without its LM head (its logits feed a decision)",
                             {"request": rec["request"], "block": rec["block"], "pass": rec["pass"], "row": r,
                              "position": None if positions is None or r >= len(positions) else int(positions[r])}))
    return out


def check_executor(executor) -> list:
    """All audit-record violations of an audited executor (`audit.AuditedEpochExecutor`; no block-pass or position
    context)."""
    out = []
    for rec in getattr(executor, "audit", None) or []:
        out += check_record(rec)
    for rec in getattr(executor, "audit_heads", None) or []:
        out += check_head(rec)
    return out


def summarize(violations: list, limit: Optional[int] = None) -> dict:
    """{invariant: {"ok", "count", "first"}} for every known invariant (ok ones included: the report says which
    were checked)."""
    counts = Counter(v.invariant for v in violations)
    first = {}
    for v in violations:
        first.setdefault(v.invariant, v.message)
    return {name: {"ok": counts[name] == 0, "count": counts[name], "first": first.get(name)}
            for name in INVARIANTS + tuple(sorted(set(counts) - set(INVARIANTS)))}
