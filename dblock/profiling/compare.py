"""`dblock compare-schedules`: every schedule on the same prompts and seeds, in the shape of the One Block Ahead
paper's Tables 1–2.

Per schedule: TPF = ΣY/ΣQ; TPS = ΣY / denoising thread-CPU time; T_den = mean thread-CPU time of a denoising call
(both on the schedule's own calls: the baseline pass timed beside a call for r below is not counted); r = the
schedule's pass over Native(C)'s pass on the same rows (docs/counters.md), from thread-CPU time: at batch 1 it is
T_den_cpu / T_den_cpu(Native C), as the paper measures it; at a larger --batch-size a multi-block schedule's calls are
also timed with each request's extra blocks removed (`dblock.profiling.measure.TimedForward`, shadow "strip"), r is
the ratio of the two, and β = the baseline pass's cost per request at this schedule's batch composition over at
Native's (1 at batch 1); n = F/K passes per block; naive ᾱ = n̄/n − 1 with n̄ the Native(C) passes per block; fitted α
from Eq. 6 (`dblock.simulator.oba.fit_alpha`, single root on [−1/2, 1)); the break-even verdict α > r − 1 (the fixed
point; `TPS_ratio_identity` = (n̄/n)·ρ/(r·β) is the finite-length run's own); the first-pass statistic of the paper's
Figure 2 (share of a block's positions accepted on its first pass as current block, and kept until commit);
accuracy when a grader is given.

Uncertainty: every schedule decodes the same (prompt, seed) requests, so the TPF ratio and α are compared *paired*:
a bootstrap over requests (resampling the same request indices for the schedule and for Native) gives 95%
intervals `TPF_ratio_ci` and `alpha_ci`. Passes per block vary a lot between problems (an addition block can take
ten times the passes of a reversal block), so without the pairing a difference of a few percent in TPF is noise.

Reading the table: a schedule pays in throughput when α − (r − 1) > 0. TPF counts passes only, so it rises with
every warm-up step that carries progress; TPS also pays for the wider pass (r), measured here in thread-CPU time,
which on a small model at batch 1 is mostly per-call overhead (r near 1, ±15% between runs); `dblock simulate pass`
predicts r on GPUs. The verdict is the fixed point's (long responses); on responses of a few blocks the first block
of each gains nothing, which `TPS_ratio_identity` (n̄/n measured) includes.

`plot` draws the rows: the break-even map (each schedule at (r, α) against the line α = r − 1) beside TPF and TPS
relative to Native.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from dblock.decoding.schedules import Request, schedule_spec
from dblock.trace import TraceWriter

DEFAULT_SCHEDULES = ("native", "native2c", "flowblock", "dense_mask", "oba",
                     "drop_time", "keep_signal", "keep_tokens", "no_accept", "no_signal")
MULTIBLOCK = {"oba", "dense_mask", "flowblock", "drop_time", "keep_signal", "keep_tokens", "no_accept", "no_signal"}


def _requests(prompts: Sequence, dec: DecodeConfig, seeds: Sequence[int]) -> list:
    """Every prompt under every seed offset; case i under offset s gets seed s + i (the paper's protocol)."""
    return [Request(prompt=list(p), max_new_tokens=dec.max_new_tokens, seed=s + i, id=(s, i))
            for s in seeds for i, p in enumerate(prompts)]


def run_schedule(fwd, prompts, dec, name: str, seeds, batch_size: Optional[int] = 1, window=None, gate=None,
                 trace: Optional[str] = None, grader=None, progress: bool = False) -> dict:
    spec = schedule_spec(name, window, gate)
    reqs = _requests(prompts, dec, seeds)
    timed = None
    if batch_size != 1 and name in MULTIBLOCK:
        from dblock.profiling.measure import TimedForward   # r on the same rows: the baseline's pass timed beside
        timed = TimedForward(fwd, shadow="strip", record=False)
    with TraceWriter(trace) as tr:
        if tr.enabled:
            tr.run_header(family=fwd.config.family, executor=fwd.name, schedule=spec.name, decode=vars(dec),
                          gate=spec.gate if spec.name.startswith("flowblock") else None)
        res = generate(timed or fwd, reqs, dec, spec, trace=tr, progress=progress, batch_size=batch_size)
    s = res.summary()
    blocks = [b for c in res.counters for b in c.blocks]
    positions = sum(b.size for b in blocks)
    # TPS and T_den on the schedule's own denoising calls in thread-CPU time: where the baseline's pass is timed
    # beside each call (`timed`), generate's clocks include it, so they are taken from `timed` (its own calls only)
    den_cpu = timed.den_s if timed else res.times.den_cpu_s
    calls = s["denoise_calls"]
    row = {"schedule": spec.name, "Y": s["Y"], "K": s["K"], "F": s["F"], "Q": s["Q"], "R": len(reqs),
           "TPF": s["TPF"], "TPS": s["Y"] / den_cpu if den_cpu else 0.0,
           "T_den_ms": 1e3 * den_cpu / calls if calls else 0.0,
           "wall_TPS": None if timed else s["wall_TPS"],      # generate's wall clock also ran the baseline pass
           "n": s["F"] / s["K"] if s["K"] else math.nan, "tokens_per_block": s["Y"] / s["K"] if s["K"] else 0.0,
           "first_pass_accepted": sum(b.first_pass_accepted for b in blocks) / positions if positions else 0.0,
           "first_pass_kept": sum(b.first_pass_kept for b in blocks) / positions if positions else 0.0,
           "blocks_per_response": s["K"] / len(reqs), "den_calls": s["denoise_calls"], "batch_size": batch_size,
           "den_cpu_s": den_cpu,
           "den_base_cpu_s": timed.den_base_s if timed else None,
           "per_request": {k: [getattr(c, k) for c in res.counters] for k in ("Y", "Q", "F", "K")}}
    if grader is not None:
        graded = [grader(r.prompt, toks) for r, toks in zip(reqs, res.tokens)]
        if graded and isinstance(graded[0], dict):      # the code task: {"correct", "token_accuracy"} per request
            from dblock.tasks.code import bootstrap_ci
            ok = [bool(g["correct"]) for g in graded]
            ta = [float(g["token_accuracy"]) for g in graded]
            row.update(token_accuracy=sum(ta) / len(ta), token_accuracy_ci=bootstrap_ci(ta),
                       accuracy_ci=bootstrap_ci([float(x) for x in ok]),
                       per_request_quality={"correct": ok, "token_accuracy": ta})
            if "answer_token_accuracy" in graded[0]:     # the whole answer: the blocks a warm-up block prepared
                aa = [float(g["answer_token_accuracy"]) for g in graded]
                row.update(answer_token_accuracy=sum(aa) / len(aa), answer_token_accuracy_ci=bootstrap_ci(aa))
                row["per_request_quality"]["answer_token_accuracy"] = aa
        else:
            ok = graded
        row["accuracy"] = sum(ok) / len(ok)
    return row


def paired_bootstrap(row: dict, base: dict, n_boot: int = 1000, seed: int = 0, alpha_fit: bool = True,
                     alpha_method: str = "Eq. 6") -> dict:
    """95% percentile intervals of TPF(row)/TPF(base) and of the fitted α, resampling requests (paired: the same
    indices for both rows, which decoded the same prompts under the same seeds). Every resample fits α by the
    point estimate's own `alpha_method` ("Eq. 6" on the summed counters, or "Eq. 5" on the per-response blocks)."""
    import numpy as np

    from dblock.simulator.oba import fit_alpha, fit_alpha_exact
    a, b = row.get("per_request"), base.get("per_request")
    if not a or not b or len(a["Y"]) != len(b["Y"]) or len(a["Y"]) < 2:
        return {}
    A = {k: np.asarray(v, dtype=float) for k, v in a.items()}
    B = {k: np.asarray(v, dtype=float) for k, v in b.items()}
    n = len(A["Y"])
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    ya, qa, yb, qb = (M[k][idx].sum(1) for M, k in ((A, "Y"), (A, "Q"), (B, "Y"), (B, "Q")))
    ok = (qa > 0) & (qb > 0) & (yb > 0)
    ratio = (ya[ok] / qa[ok]) / (yb[ok] / qb[ok])
    out = {"TPF_ratio_ci": [float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))]} if ratio.size else {}
    if alpha_fit:
        fa, ka, fb, kb = (M[k][idx].sum(1) for M, k in ((A, "F"), (A, "K"), (B, "F"), (B, "K")))
        alphas = []
        for i in range(n_boot):
            try:
                alphas.append(fit_alpha_exact(fa[i], A["K"][idx[i]].astype(int), fb[i] / kb[i])
                              if alpha_method == "Eq. 5" else fit_alpha(fa[i], ka[i], n, fb[i] / kb[i]))
            except ValueError:
                pass
        if len(alphas) >= n_boot // 2:     # otherwise the fit is undefined on too many resamples to quote
            out["alpha_ci"] = [float(np.percentile(alphas, 2.5)), float(np.percentile(alphas, 97.5))]
    return out


def derive(rows: list, n_boot: int = 1000) -> list:
    """Add r, naive ᾱ, fitted α, the verdict and paired 95% intervals against the Native(C) row."""
    from dblock.simulator.oba import fit_alpha, fit_alpha_counters, naive_alpha

    base = next((r for r in rows if r["schedule"] == "native"), None)
    for r in rows:
        r.update(r=None, beta=None, alpha_naive=None, alpha=None, margin=None, verdict=None, alpha_note=None,
                 alpha_method=None)
        if base is None or not base["T_den_ms"]:
            continue
        r["r"], r["beta"] = _r_beta(r, base)
        r["TPF_ratio"] = r["TPF"] / base["TPF"] if base["TPF"] else None
        r["TPS_ratio"] = r["TPS"] / base["TPS"] if base["TPS"] else None
        nbar = base["F"] / base["K"]
        if r["beta"] is not None and all(x.get(k) for x in (r, base) for k in ("Y", "K", "F")):
            from dblock.simulator.oba import tps_ratio_identity
            rho = (r["Y"] / r["K"]) / (base["Y"] / base["K"])
            r["TPS_ratio_identity"] = tps_ratio_identity(nbar / (r["F"] / r["K"]), rho, r["r"], r["beta"])
        multi = r["schedule"] != "native2c"
        if multi and r is not base:
            r["alpha_naive"] = naive_alpha(nbar, r["F"], r["K"])
            per_k = (r.get("per_request") or {}).get("K")
            try:
                r["alpha"], r["alpha_method"] = fit_alpha_counters(r["F"], r["K"], r["R"], nbar, per_k)
            except ValueError as e:
                r["alpha_note"] = str(e)
        if r is not base and n_boot:
            r.update(paired_bootstrap(r, base, n_boot, alpha_fit=multi,
                                      alpha_method=r.get("alpha_method") or "Eq. 6"))
            qa, qb = r.get("per_request_quality"), base.get("per_request_quality")
            if qa and qb and len(qa["token_accuracy"]) == len(qb["token_accuracy"]):
                from dblock.tasks.code import paired_bootstrap_ci
                r["token_accuracy_delta_ci"] = paired_bootstrap_ci(qa["token_accuracy"], qb["token_accuracy"])
                if "answer_token_accuracy" in qa and "answer_token_accuracy" in qb:
                    r["answer_token_accuracy_delta_ci"] = paired_bootstrap_ci(qa["answer_token_accuracy"],
                                                                              qb["answer_token_accuracy"])
                r["accuracy_delta_ci"] = paired_bootstrap_ci([float(x) for x in qa["correct"]],
                                                             [float(x) for x in qb["correct"]])
        if r["schedule"] == "native2c":   # a wider block: alpha (passes saved per warm-up step) does not apply
            r["verdict"] = "pays" if r["TPS_ratio"] and r["TPS_ratio"] > 1 else "does not pay"
            continue
        if r is base:
            r["alpha_naive"] = naive_alpha(nbar, r["F"], r["K"])
            try:
                r["alpha"] = fit_alpha(r["F"], r["K"], r["R"], nbar)
            except ValueError as e:
                r["alpha_note"] = str(e)
        a = r["alpha"] if r["alpha"] is not None else r["alpha_naive"]
        r["margin"] = a - (r["r"] - 1)
        if r["schedule"] != "native":
            r["verdict"] = "pays" if r["margin"] > 0 else "does not pay"
    return rows


def _r_beta(row: dict, base: dict) -> tuple:
    """(r, β) of a row against the Native(C) row (docs/counters.md), on thread-CPU time when the rows carry it.

    With the baseline's pass timed on the same rows (`den_base_cpu_s`): r = den/den_base, β = (den_base/F) /
    (den_native/F_native). At batch 1 every call carries one request in both runs: β = 1 and r = T_den ratio. Otherwise
    (a single-block schedule batched by more than one) r is the per-request-pass time ratio and β is not separated
    (None)."""
    cpu = row.get("den_cpu_s") and base.get("den_cpu_s")
    if row.get("den_base_cpu_s"):
        r = row["den_cpu_s"] / row["den_base_cpu_s"]
        return r, (row["den_base_cpu_s"] / row["F"]) / (base["den_cpu_s"] / base["F"])
    if cpu and row.get("den_calls") and base.get("den_calls"):
        t_row, t_base = row["den_cpu_s"] / row["den_calls"], base["den_cpu_s"] / base["den_calls"]
    else:
        t_row, t_base = row["T_den_ms"], base["T_den_ms"]
    if row.get("batch_size", 1) == 1:
        return t_row / t_base, 1.0
    per_pass = (row["den_cpu_s"] / row["F"]) / (base["den_cpu_s"] / base["F"]) if cpu else t_row / t_base
    return per_pass, None


def compare_schedules(fwd, prompts: Sequence, dec: DecodeConfig, schedules: Sequence[str] = DEFAULT_SCHEDULES,
                      seeds: Sequence[int] = (0,), batch_size: Optional[int] = 1, window=None, gate=None,
                      trace_dir: Optional[str] = None, grader=None, progress: bool = False) -> list:
    """Run every schedule; llada_moe (no block-causal structure) runs only the single-block ones."""
    import os
    rows = []
    for name in schedules:
        if fwd.config.family == "llada_moe" and name in MULTIBLOCK:
            continue
        trace = os.path.join(trace_dir, f"{name}.jsonl") if trace_dir else None
        rows.append(run_schedule(fwd, prompts, dec, name, seeds, batch_size, window, gate, trace, grader, progress))
    return derive(rows)


COLUMNS = [("schedule", "{:<12}"), ("TPF", "{:>6.2f}"), ("TPF_ratio_ci", "{:>13}"), ("TPS", "{:>8.1f}"), ("T_den_ms", "{:>8.2f}"),
           ("r", "{:>5.2f}"), ("beta", "{:>5.2f}"), ("n", "{:>6.2f}"), ("alpha_naive", "{:>6.2f}"), ("alpha", "{:>6.2f}"),
           ("alpha_ci", "{:>13}"), ("margin", "{:>7.2f}"), ("verdict", "{:>13}"), ("first_pass_accepted", "{:>6.2f}"),
           ("accuracy", "{:>6.3f}"), ("token_accuracy", "{:>6.3f}"), ("token_accuracy_delta_ci", "{:>13}"),
           ("answer_token_accuracy", "{:>6.3f}"), ("answer_token_accuracy_delta_ci", "{:>13}")]
HEADERS = {"schedule": "schedule", "TPF": "TPF", "TPF_ratio_ci": "TPF× 95% CI", "alpha_ci": "α 95% CI", "TPS": "TPS", "T_den_ms": "T_den ms", "r": "r", "beta": "β", "n": "n/blk",
           "alpha_naive": "ᾱ", "alpha": "α", "margin": "α-(r-1)", "verdict": "verdict",
           "first_pass_accepted": "1st-acc", "accuracy": "acc", "token_accuracy": "tok-acc",
           "token_accuracy_delta_ci": "Δtok 95% CI", "answer_token_accuracy": "ans-tok",
           "answer_token_accuracy_delta_ci": "Δans 95% CI"}


def format_table(rows: list) -> str:
    cols = [(k, f) for k, f in COLUMNS if any(r.get(k) is not None for r in rows)]
    widths = [max(len(HEADERS[k]), len(f.format(0.0 if "f}" in f else "x"))) for k, f in cols]
    lines = ["  ".join(HEADERS[k].rjust(w) if k != "schedule" else HEADERS[k].ljust(w)
                       for (k, _), w in zip(cols, widths))]
    for r in rows:
        cells = []
        for (k, f), w in zip(cols, widths):
            v = r.get(k)
            if isinstance(v, (list, tuple)):
                v = f"{v[0]:.2f}..{v[1]:.2f}"
            cells.append(("-".rjust(w) if k != "schedule" else "-".ljust(w)) if v is None else f.format(v).rjust(w)
                         if k != "schedule" else f.format(v).ljust(w))
        lines.append("  ".join(cells))
    exact = [r["schedule"] for r in rows if r.get("alpha_method") == "Eq. 5"]
    if exact:
        lines.append(f"α of {', '.join(exact)}: Eq. 5 kept exactly (Eq. 6 has no root on [-1/2, 1) on these short "
                     "responses)")
    return "\n".join(lines)


def plot(rows: list, path: Optional[str] = None):
    """The rows of `compare_schedules` (after `derive`) as one figure, written to `path` (PNG, or any format
    matplotlib knows from the suffix) when given; returns the matplotlib Figure.

    Left, the break-even map: each schedule at (r, α), α the fitted value (the naive ᾱ where the fit is undefined,
    as for the verdict), its 95% interval as an error bar, over the line α = r − 1 with the region where the schedule
    pays shaded; Native is the hollow reference point; Native(2C) has no α and appears only on the right. Right, TPF
    and TPS of every schedule over Native's (the TPF bar with its paired 95% interval). Needs the native schedule
    among the rows (everything is relative to it) and matplotlib (the `plots` extra); no backend is selected or
    changed (dblock/simulator/plots.py)."""
    from dblock.errors import ConfigError
    from dblock.simulator import plots
    if not any(r.get("schedule") == "native" and r.get("r") is not None for r in rows):
        raise ConfigError("plot: the break-even map and the bars are relative to Native: include native in "
                          "--schedules (and let it run: it needs a measured denoising time)")
    points, bars = [], []
    for r in rows:
        a = r.get("alpha") if r.get("alpha") is not None else r.get("alpha_naive")
        if r.get("r") is not None and a is not None:
            points.append(dict(name=r["schedule"], r=r["r"], alpha=a, alpha_ci=r.get("alpha_ci"),
                               reference=r["schedule"] == "native"))
        if r["schedule"] != "native":
            bars.append(dict(name=r["schedule"], tpf=r.get("TPF_ratio"), tps=r.get("TPS_ratio"),
                             tpf_ci=r.get("TPF_ratio_ci")))
    try:
        fig = plots._figure(figsize=(12, 4.8))
    except ImportError:
        raise ConfigError("plot: needs matplotlib (pip install 'dblock[plots]')") from None
    ax_map, ax_bars = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[1, 1.2]))
    plots.draw_break_even(ax_map, points)
    plots.draw_ratio_bars(ax_bars, bars)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
