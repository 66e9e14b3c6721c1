"""Calibrate the simulator from executor traces (JSON lines, `dblock.trace` schema) and check its predictions.

From a set of traces (each one run: one schedule, one executor, one batch setting):

* **Liveness / Native profile** — the per-position ``accept_pass`` and ``kept`` lists of a Native run's block
  events give an `EmpiricalProfile` (positions.py) and a `LivenessProfile` (live and fresh shares by pass).
* **n̄, α, r** — n̄ = F/K of the Native run; α of another schedule by Eq. (6) on its (F, K, R), the naive ᾱ beside
  it; r = T_den(schedule) / T_den(Native) with T_den = Σ den_s / Σ F of the request events (or, without request
  events, the mean wall time of the denoise pass events).
* **δ** — the warm-up rate that reproduces the fitted α of one schedule in the position model (to predict others).
* **CPU cost scale** — every denoise pass event is replayed through `cost.pass_cost` (shape from the event's
  batch, rows, live rows, cache lengths, segments) on a hardware profile; a non-negative least-squares fit of
  measured = scale · predicted + overhead gives `Calibration(scale, overhead_s)` (overhead per sub-block).

`predict_run` then predicts a held-out run (another batch size or schedule) from the calibration alone — its pass
times from the cost model on its own pass shapes, its passes per block from the position model — and reports
predicted vs measured T_den, n = F/K, α and the TPS ratio to Native.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
from scipy.optimize import nnls

from dblock.config import ModelConfig, llada_config_from_dict
from dblock.simulator import cost, oba
from dblock.simulator.hardware import Hardware
from dblock.simulator.liveness import LivenessProfile
from dblock.simulator.positions import EmpiricalProfile, PositionModel, calibrate_delta, predict_alpha
from dblock.trace import read_trace

SCHEDULE_ALIASES = {"native": "native", "oba": "oba", "keep_all": "oba", "flowblock": "flowblock"}


def canonical_schedule(name: str) -> str:
    """The position model's name of a trace's schedule: FlowBlock's window suffix dropped (`flowblock2` ->
    `flowblock`), the aliases above applied."""
    s = str(name).lower()
    if s.startswith("flowblock"):
        return "flowblock"
    return SCHEDULE_ALIASES.get(s, s)


@dataclass
class Run:
    """One trace file, summarised."""

    path: str
    header: dict
    passes: list[dict]
    blocks: list[dict]
    requests: list[dict]

    @staticmethod
    def load(path_or_events: str | Iterable[dict], path: str = "<events>", flag: str | None = None) -> "Run":
        """A trace file (every event checked: `dblock.trace.read_trace`, errors naming `flag` and the file) or a
        list of events already in memory."""
        evs = list(read_trace(path_or_events, flag)) if isinstance(path_or_events, str) else list(path_or_events)
        if isinstance(path_or_events, str):
            path = path_or_events
        header = next((e for e in evs if e["event"] == "run"), {})
        return Run(path, header, [e for e in evs if e["event"] == "pass"], [e for e in evs if e["event"] == "block"],
                   [e for e in evs if e["event"] == "request"])

    @property
    def schedule(self) -> str:
        s = str(self.header.get("schedule", "native")).lower()
        return s.split("(")[0].strip()

    @property
    def executor(self) -> str:
        return str(self.header.get("executor", ""))

    @property
    def block_size(self) -> int:
        d = self.header.get("decode") or {}
        if d.get("block_size"):
            return int(d["block_size"])
        if self.blocks:
            return int(self.blocks[0].get("size", 32))
        return 32

    def counters(self) -> dict:
        """Σ Y, K, F and R from request events (block events as a fallback), and T_den."""
        if self.requests:
            Y = sum(r["Y"] for r in self.requests)
            K = sum(r["K"] for r in self.requests)
            F = sum(r["F"] for r in self.requests)
            R = len(self.requests)
            den = sum(r.get("den_s", 0.0) for r in self.requests)
        else:
            Y = sum(b.get("tokens", 0) for b in self.blocks)
            K = len(self.blocks)
            F = sum(b["passes"] for b in self.blocks)
            R = len({b["request"] for b in self.blocks})
            den = 0.0
        if den <= 0:
            # batched runs: a pass's time is shared by its requests, so use the pass events directly
            den_passes = [p for p in self.passes if p.get("kind") == "denoise"]
            t_den = float(np.mean([p["wall_s"] for p in den_passes])) if den_passes else float("nan")
        else:
            t_den = den / F if F else float("nan")
        if not K or not R:
            raise ValueError(f"{self.path}: no request or block events to count")
        return dict(Y=Y, K=K, F=F, R=R, t_den=t_den, n=F / K, tokens_per_block=Y / K,
                    blocks_per_response=[r["K"] for r in self.requests] if self.requests else None)

    def model_config(self) -> ModelConfig | None:
        d = self.header.get("model_config")
        if not d:
            return None
        try:
            return llada_config_from_dict(d, f"{self.path} (run header)")
        except ValueError:
            return None


def pass_shape(ev: dict, path: str = "dense") -> cost.PassShape:
    """The cost-model shape of a trace pass event (denoise passes)."""
    batch = max(1, int(ev.get("batch", 1)))
    segs = ev.get("segments") or []
    layout, block, prefix = "native", None, 0
    paired = 0
    for req in segs:
        roles = [s[1] for s in req]
        if "warmup" in roles or roles.count("inflight") + roles.count("current") > 1:
            paired += 1
        for s in req:
            if s[1] == "current" and block is None:
                block = int(s[2])
            if s[1] == "prefix":
                prefix += int(s[2])
    rows = int(ev.get("rows", 0))
    if block is None:
        block = max(1, rows // batch)
    if paired * 2 > max(1, len(segs)):
        layout = "oba"
    cache = ev.get("cache_len") or [0]
    live = ev.get("live", rows)
    fresh = ev.get("fresh")
    executor_path = "epoch" if (path == "epoch" or fresh is not None) else "dense"
    inflight = batch * block * (2 if layout == "oba" else 1)
    return cost.PassShape(batch=batch, layout=layout, block=block, cache_len=float(np.mean(cache)),
                          path=executor_path, live_frac=min(1.0, live / max(1, inflight)),
                          fresh_frac=1.0 if fresh is None else min(1.0, float(fresh) / max(1, rows)),
                          no_cache=prefix > 0)


@dataclass
class CostFit:
    cal: cost.Calibration
    n_passes: int
    median_abs_rel_err: float
    r2: float

    #: the fitted factors (at most two, always named): the rest of `Calibration` is held at its default
    FITTED = ("scale", "overhead_s")

    def as_dict(self) -> dict:
        return dict(scale=self.cal.scale, overhead_s=self.cal.overhead_s, n_passes=self.n_passes,
                    median_abs_rel_err=self.median_abs_rel_err, r2=self.r2, fitted=list(self.FITTED),
                    held=dict(moe_row_s=self.cal.moe_row_s))


def fit_cost(runs: list[Run], cfg: ModelConfig, hw: Hardware, par: cost.Parallel = cost.Parallel()) -> CostFit:
    """measured_wall = scale · roofline(shape) + overhead_s · 2L, non-negative least squares over denoise passes."""
    X, y = [], []
    for run in runs:
        for ev in run.passes:
            if ev.get("kind") != "denoise" or ev.get("wall_s") is None:
                continue
            pred = cost.pass_cost(cfg, pass_shape(ev), hw, par).total
            X.append([pred, 2 * cfg.num_hidden_layers])
            y.append(float(ev["wall_s"]))
    if len(y) < 2:
        raise ValueError("fit_cost: fewer than two denoise pass events with wall_s")
    A, b = np.asarray(X), np.asarray(y)
    coef, _ = nnls(A, b)
    pred = A @ coef
    rel = np.abs(pred - b) / np.maximum(b, 1e-12)
    ss = float(np.sum((b - b.mean()) ** 2))
    r2 = 1.0 - float(np.sum((b - pred) ** 2)) / ss if ss > 0 else 1.0
    # pass_cost returns scale · (roofline + overhead_s · 2L), so the fitted per-sub-block overhead is coef1/scale
    scale = float(coef[0]) if coef[0] > 0 else 1.0
    return CostFit(cost.Calibration(overhead_s=float(coef[1]) / scale, scale=scale), len(y), float(np.median(rel)), r2)


@dataclass
class Calibrated:
    """Everything a held-out prediction needs."""

    nbar: float
    profile: EmpiricalProfile | None
    liveness: LivenessProfile | None
    cost_fit: CostFit | None
    cfg: ModelConfig | None
    hw: Hardware | None
    native_t_den: float
    native_tokens_per_block: float
    alphas: dict = field(default_factory=dict)     # schedule -> dict(alpha, naive, r, ...)
    delta: float | None = None
    delta_from: str | None = None
    gamma: float = 0.5
    delta_note: str | None = None                  # why δ could not be calibrated (then α is not predicted)

    def as_dict(self) -> dict:
        return dict(nbar=self.nbar, native_t_den=self.native_t_den, liveness=None if self.liveness is None else
                    self.liveness.as_dict(), cost_fit=None if self.cost_fit is None else self.cost_fit.as_dict(),
                    alphas=self.alphas, delta=self.delta, delta_from=self.delta_from, gamma=self.gamma,
                    delta_note=self.delta_note)


def calibrate(runs: list[Run], hw: Hardware | None = None, cfg: ModelConfig | None = None,
              delta_from: str | None = "oba", gamma: float | None = None, m_c: int = 5) -> Calibrated:
    """Fit n̄, the Native profile and liveness, α and r of every other schedule, δ (on `delta_from`) and the cost
    scale (when `hw` and a model config — given or in the run headers — are at hand). `gamma`, FlowBlock's
    readiness gate: None = the gate a FlowBlock trace's header records, else the decoder's default
    (`dblock.decoding.schedules.FLOWBLOCK_GATE`): the simulated gate must be the one the runs used."""
    if gamma is None:
        from dblock.decoding.schedules import FLOWBLOCK_GATE
        gamma = next((float(r.header["gate"]) for r in runs if r.header.get("gate") is not None), FLOWBLOCK_GATE)
    natives = [r for r in runs if SCHEDULE_ALIASES.get(r.schedule) == "native"]
    if not natives:
        raise ValueError("calibrate: no Native run among the traces (n̄ and the profile come from Native runs)")
    nat = natives[0]
    c0 = nat.counters()
    nbar = c0["n"]
    blocks = [b for r in natives for b in r.blocks]
    try:
        profile = EmpiricalProfile.from_block_events(blocks)
        liveness = LivenessProfile.from_accepts([np.asarray(b["accept_pass"]) for b in blocks
                                                 if b.get("accept_pass") is not None], m_c)
    except ValueError:
        profile, liveness = None, None
    cfg = cfg or next((r.model_config() for r in runs if r.model_config() is not None), None)
    cost_fit = fit_cost(runs, cfg, hw) if (hw is not None and cfg is not None) else None
    alphas = {}
    for run in runs:
        sched = SCHEDULE_ALIASES.get(run.schedule, run.schedule)
        if sched == "native":
            continue
        c = run.counters()
        try:
            a = oba.fit_alpha_counters(c["F"], c["K"], c["R"], nbar, c["blocks_per_response"])[0]
        except ValueError:
            a = float("nan")
        batched = any(int(p.get("batch", 1)) > 1 for r_ in (run, nat) for p in r_.passes
                      if p.get("kind") == "denoise")
        alphas[run.schedule] = dict(alpha=a, naive=oba.naive_alpha(nbar, c["F"], c["K"]),
                                    r=c["t_den"] / c0["t_den"],
                                    # docs/counters.md: r is the pass over Native's on the same rows; a T_den ratio
                                    # is that only at batch 1 (in a batch it mixes r with the composition, β)
                                    r_kind="T_den ratio of batched runs: r·(call composition), not r" if batched
                                    else "T_den ratio at batch 1 = r", n=c["n"], F=c["F"], K=c["K"], R=c["R"],
                                    rho=c["tokens_per_block"] / c0["tokens_per_block"],
                                    K_eq4=oba.blocks_from_tokens(c["Y"], run.block_size, c["R"]))
    cal = Calibrated(nbar, profile, liveness, cost_fit, cfg, hw, c0["t_den"], c0["tokens_per_block"], alphas,
                     gamma=gamma)
    if delta_from and profile is not None:
        src = next((r for r in runs if canonical_schedule(r.schedule) == canonical_schedule(delta_from)
                    and canonical_schedule(r.schedule) != "native"), None)
        if src is not None and not math.isnan(alphas[src.schedule]["alpha"]):
            a = alphas[src.schedule]
            sched = canonical_schedule(src.schedule)
            kdist = src.counters()["blocks_per_response"] or [max(1, round(a["K"] / a["R"]))]
            cal.delta_from = src.schedule
            try:
                cal.delta = calibrate_delta(profile, sched, a["alpha"], list(kdist), responses=len(kdist),
                                            gamma=gamma)
            except ValueError as e:
                # e.g. a measured α < 0 (warm-up steps hurt): the position model's δ >= 0 cannot reproduce it.
                # The cost fit and the Native predictions stand; α of other schedules is then not predicted.
                cal.delta_note = f"δ not calibrated on {src.schedule}: {e}"
    return cal


def predict_run(cal: Calibrated, run: Run) -> dict:
    """Predict a held-out run from `cal` and compare with what it measured.

    Predicted T_den: the calibrated cost model on the run's own denoise pass shapes (needs the cost fit);
    predicted n: the position model with δ (for Native: n̄); predicted TPS ratio to Native:
    (n̄ / n_pred) · ρ / r_pred with r_pred = T_den,pred / T_den(Native) measured at calibration.
    """
    c = run.counters()
    sched = canonical_schedule(run.schedule)
    out: dict = dict(path=run.path, schedule=run.schedule, measured=dict(t_den=c["t_den"], n=c["n"]))
    if cal.cost_fit is not None and cal.cfg is not None and cal.hw is not None:
        times = [cost.pass_cost(cal.cfg, pass_shape(ev), cal.hw, cost.Parallel(), cal.cost_fit.cal).total
                 for ev in run.passes if ev.get("kind") == "denoise"]
        t_pred = float(np.mean(times)) if times else float("nan")
    else:
        t_pred = float("nan")
    bracket = None
    masked = str(run.header.get("family", "")) in ("llada2_moe", "llada_moe")
    if sched == "native":
        n_pred, a_pred = cal.nbar, 0.0
    elif masked:
        # masked diffusion: a waiting block decodes nothing before promotion (docs/algorithms.md §3), so every
        # multi-block schedule runs Native's passes: α = 0 by construction, whatever δ says
        n_pred, a_pred = cal.nbar, 0.0
        out["note"] = "masked model: the waiting block decodes nothing, α = 0 by construction"
    elif cal.delta is None or cal.profile is None:
        n_pred, a_pred = float("nan"), float("nan")
        out["note"] = cal.delta_note or "no δ calibrated (no --delta-from run): α not predicted"
    elif sched in ("oba", "flowblock", "keep_tokens"):
        ks = list(c["blocks_per_response"] or [max(1, round(c["K"] / c["R"]))])
        if sched == "keep_tokens":
            # tokens only: the position model's two rules for what a promoted token saves bracket the answer
            preds = [predict_alpha(PositionModel(cal.profile, delta=cal.delta, integer=False, policy="keep_tokens",
                                                 token_rule=rule), "oba", ks, responses=len(ks), gamma=0.0)
                     for rule in ("max", "count")]
            bracket = sorted(p.alpha for p in preds)
            pr = preds[1]
        else:
            pr = predict_alpha(PositionModel(cal.profile, delta=cal.delta, integer=False), sched, ks,
                               responses=len(ks), gamma=cal.gamma)
        n_pred, a_pred = pr.F / pr.K, pr.alpha
    else:
        n_pred, a_pred = float("nan"), float("nan")
        out["note"] = f"{run.schedule}: the position model has no rule for this schedule (oba, flowblock, keep_tokens)"
    rho = c["tokens_per_block"] / cal.native_tokens_per_block
    r_meas = c["t_den"] / cal.native_t_den
    r_pred = t_pred / cal.native_t_den
    tps_meas = oba.tps_ratio_identity(cal.nbar / c["n"], rho, r_meas)
    tps_pred = oba.tps_ratio_identity(cal.nbar / n_pred, rho, r_pred)
    try:
        a_meas = (oba.fit_alpha_counters(c["F"], c["K"], c["R"], cal.nbar, c["blocks_per_response"])[0]
                  if sched != "native" else 0.0)
    except ValueError:
        a_meas = float("nan")

    def err(p, m):
        return (p - m) / m if m else float("nan")

    out["predicted"] = dict(t_den=t_pred, n=n_pred, alpha=a_pred, r=r_pred, tps_ratio=tps_pred)
    if bracket is not None:
        out["predicted"]["alpha_bracket"] = bracket
    out["measured"].update(alpha=a_meas, r=r_meas, tps_ratio=tps_meas)
    out["rel_error"] = dict(t_den=err(t_pred, c["t_den"]), n=err(n_pred, c["n"]), tps_ratio=err(tps_pred, tps_meas))
    return out
