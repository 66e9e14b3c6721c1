"""`dblock simulate validate`: predictions against measurements on this machine, held out from what was fitted.

What the predictions may use (the inputs): the operator profile (`dblock simulate profile`: microbenchmarks of
single operators and of synthetic calls, no decoding run) scaled by the machine's drift since it was measured (its
anchor microbenchmarks re-timed around every round of measurements, `profiler.drift`; the rows of absolute times
bring each measurement to the median drift from its own round's, see `run`), and the *counters* of one Native run of the reference
executor (per request its prompt length and its blocks' passes and accept passes: `batch.Workload.from_runs`). No
decoding time of any run is an input. Everything timed below is then held out: other batch sizes, other
schedules, the Epoch executor, the serving engine at two arrival rates.

Measured: thread-CPU time (`measure.TimedForward`), every configuration `repeats` times interleaved, medians;
ratios are medians of per-repeat ratios. Serving runs the real engine on a CPU-time clock
(`measure.serve_cpu_clock`). Predicted: the SimPy model (`batch.simulate_batch` / `simulate_serving`) priced by the
profile, with an interval from the profile's repeat spread (quartiles).

Rows: T_den (reference at batch 1, 8, 32; Epoch at 8, 32), TPS ratio between schedules (OBA, FlowBlock and
Native without cache over Native; OBA on Epoch), TPS at batch 32 over batch 1 (batch composition alone), Epoch over
dense TPS (batch 8, 32), serving throughput and P95 ITL (two rates). Error = (predicted − measured) / measured.
And α of a held-out schedule on a uniform-state model (`alpha_rows`: OBA and FlowBlock on code-uniform, each
predicted by the position model with δ calibrated on the other; error = predicted − measured).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from dblock.simulator import batch
from dblock.profiling import measure
from dblock.simulator.profile import QUANTILES, Profile, ProfiledCost


def task_max_new(plan, task) -> int:
    """The generation length of a plan's runs: its own, else the task's (the code task: 64), else 128."""
    return plan.max_new_tokens or getattr(task, "max_new_tokens", None) or 128


def plan_task(plan, model: str) -> str:
    """The task a plan's prompts come from: its own, else the model's card task."""
    from dblock.tasks.card import task_of
    return plan.task or task_of(model)


@dataclass
class Plan:
    """What `validate` runs (defaults: the bundled tiny-masked model, about 40 s on 2 busy cores)."""

    model: str = "tiny-masked"
    task: str = ""                    # "" = the model's card task
    n: int = 32                       # problems per run
    max_new_tokens: Optional[int] = None   # None: the task's own length (code: 64), else 128
    repeats: int = 3
    batches: tuple = (1, 8, 32)
    ratio_batch: int = 8
    rates: tuple = (10.0, 40.0)       # serving arrival rates, requests per CPU-second
    serve_requests: int = 64
    batch_cap: int = 16
    epoch: bool = True
    drift: bool = True                # re-time the profile's anchors and scale it by the machine's drift
    seed: int = 0
    alpha_model: Optional[str] = "code-uniform"   # uniform-state model whose α is predicted (None: no α rows)
    alpha_n: int = 256                # problems per α run (the fitted α's 95% interval is ~±0.1 at 256)
    alpha_batch: int = 16


@dataclass
class Row:
    name: str
    quantity: str
    unit: str
    predicted: float
    lo: float
    hi: float
    measured: float
    spread: float = float("nan")      # measured: (max − min)/median over repeats
    note: str = ""
    absolute: bool = False            # error = predicted − measured (α: a relative error of a value near 0 says
                                      # nothing); such rows stay out of the median |relative error|

    @property
    def error(self) -> float:
        if self.absolute:
            return self.predicted - self.measured
        return (self.predicted - self.measured) / self.measured if self.measured else float("nan")

    def as_dict(self) -> dict:
        return dict(name=self.name, quantity=self.quantity, unit=self.unit, predicted=self.predicted,
                    interval=[self.lo, self.hi], measured=self.measured, error=self.error,
                    error_kind="absolute" if self.absolute else "relative", measured_spread=self.spread,
                    note=self.note)


@dataclass
class Report:
    rows: list
    meta: dict = field(default_factory=dict)

    @property
    def median_abs_error(self) -> float:
        """Median |relative error| over the rows with a relative error."""
        e = [abs(r.error) for r in self.rows if not r.absolute and math.isfinite(r.error)]
        return float(np.median(e)) if e else float("nan")

    @property
    def max_alpha_error(self) -> float:
        """Largest |predicted − measured| over the α rows (NaN when there are none)."""
        e = [abs(r.error) for r in self.rows if r.absolute and math.isfinite(r.error)]
        return float(max(e)) if e else float("nan")

    def as_dict(self) -> dict:
        return dict(meta=self.meta, rows=[r.as_dict() for r in self.rows], median_abs_error=self.median_abs_error,
                    max_abs_alpha_error=self.max_alpha_error)

    def table(self) -> str:
        hdr = (f"{'row':<40} {'quantity':<12} {'predicted':>10} {'interval':>19} {'measured':>10} {'spread':>7} "
               f"{'error':>8}")
        lines = [hdr, "-" * len(hdr)]
        for r in self.rows:
            scale = 1e3 if r.unit == "ms" else 1.0
            fmt = "{:.3f}" if r.unit in ("", "x") else "{:.2f}"
            num = lambda x: fmt.format(x * scale) if math.isfinite(x) else "-"      # noqa: E731  (not predicted)
            iv = f"{num(r.lo)}..{num(r.hi)}" if math.isfinite(r.lo) or math.isfinite(r.hi) else "-"
            err = "-" if not math.isfinite(r.error) else (f"{r.error:+.3f}" if r.absolute else f"{100 * r.error:+.1f}%")
            lines.append(f"{r.name:<40} {r.quantity:<12} {num(r.predicted):>10} {iv:>19} {num(r.measured):>10} "
                         + (f"{100 * r.spread:>6.0f}%" if math.isfinite(r.spread) else f"{'-':>7}")
                         + f" {err:>8}" + (f"  [{r.note}]" if r.note else ""))
        rel = [r for r in self.rows if not r.absolute]
        lines.append(f"median |error| over {len(rel)} rows: {100 * self.median_abs_error:.1f}% (spread: the "
                     "measurement's own (max − min)/median over its repeats)")
        alpha = [r for r in self.rows if r.absolute]
        if alpha:
            n = sum(math.isfinite(r.error) for r in alpha)
            lines.append("α rows: error = predicted − measured (absolute); " +
                         (f"largest |error| {self.max_alpha_error:.3f} over {n} of {len(alpha)} rows" if n else
                          f"none of the {len(alpha)} predicted: δ could not be calibrated on the other schedule "
                          "(see the notes; the interval, where shown, is the prediction from an end of the source "
                          "α's 95% interval that δ can reproduce)"))
        return "\n".join(lines)


def _spread(v: Sequence[float]) -> float:
    v = [x for x in v if x is not None and math.isfinite(x)]
    return (max(v) - min(v)) / float(np.median(v)) if len(v) > 1 and np.median(v) else float("nan")


def _interval(vals: dict) -> tuple:
    lo, mid, hi = (vals[q] for q in QUANTILES)
    return mid, min(lo, mid, hi), max(lo, mid, hi)


def poisson_arrivals(rate: float, n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


def size_factor(sample: dict, size: float) -> float:
    """A drift sample's factor for calls of `size` requests: its whole-call anchors (`call_1`, `call_8`,
    `call_32`) interpolated in log(size) — contention on a shared machine depends on the call's size — else its
    median factor."""
    calls = sorted((int(k.split("_")[1]), v) for k, v in (sample.get("anchors") or {}).items()
                   if k.startswith("call_") and v and math.isfinite(v))
    if not calls:
        return float(sample.get("factor", 1.0))
    xs = np.log([c for c, _ in calls])
    return float(np.interp(math.log(max(size, 1)), xs, [v for _, v in calls]))


def bracket(samples: list, i: int, size: float) -> float:
    """The drift of the round between samples i and i + 1 (their mean; sample i alone when it is the last)."""
    if not samples:
        return 1.0
    i = min(i, len(samples) - 1)
    vals = [size_factor(samples[i], size)] + ([size_factor(samples[i + 1], size)] if i + 1 < len(samples) else [])
    return float(np.mean(vals))


def run(plan: Plan, profile: Profile, model=None, forward: Optional[Callable[[str], object]] = None,
        timer: Callable[[], float] = time.thread_time, progress: Optional[Callable[[str], None]] = None,
        drift_fn: Optional[Callable[[], dict]] = None) -> Report:
    """Measure and predict every row of `plan`. `forward(executor)` makes an executor ("reference" or "epoch")
    for `model` (default: the real ones); tests pass synthetic executors and a fake `timer`. `drift_fn()` re-times
    the machine's drift (default: `profiler.drift` on the profile's anchors; not measured with synthetic executors
    unless given): a dict with `factor` and the per-anchor ratios `anchors`.

    Drift: one sample before every round of measurements and one after the last, so every round lies between two.
    The predictions are scaled by the median factor (ratios divide it out); a row that predicts an absolute time
    (T_den, serving throughput and P95 ITL) compares with its measurements each brought to that median from its
    own round's drift (`bracket`: the mean of the samples around the round, of the whole-call anchor of the call's
    size, `size_factor`)."""
    import dblock
    from dblock.decoding.params import DecodeConfig
    from dblock.tasks import get_task
    from dblock.tasks.evaluate import TokenizerAdapter

    say = progress or (lambda s: None)
    t_start = time.perf_counter()
    forward_given = forward is not None
    m = model if model is not None else dblock.load(plan.model)
    if m.config.family != "llada2_moe":
        raise ValueError(f"validate: {m.config.family} is not covered by the operator profile (llada2_moe is)")
    if forward is None:
        from dblock.decoding.generate import reference_forward

        def forward(ex):
            if ex == "reference":
                return reference_forward(m)
            from dblock.optimized.executor import epoch_forward
            return epoch_forward(m, "epoch")
    tok = TokenizerAdapter.from_folder(m.source)
    task = get_task(plan_task(plan, plan.model))
    prompts = [tok.encode(e.prompt) for e in task.examples("test", plan.n)]
    C = m.config.block_size
    max_new = task_max_new(plan, task)
    from dblock.tasks.card import decoding_of
    card_dec = decoding_of(getattr(m, "source", None) or plan.model)      # code-masked: LLaDA2.0's steps S
    dec = DecodeConfig(max_new_tokens=max_new, seed=plan.seed, **card_dec)
    dec_nc = DecodeConfig(max_new_tokens=max_new, seed=plan.seed, no_cache=True, **card_dec)
    fw = {"reference": forward("reference")}
    if plan.epoch:
        fw["epoch"] = forward("epoch")

    # ---- inputs: the counters of one Native run (its times are not used) ---------------------------------
    say("calibration run (counters only)")
    nat = measure.decode_run(fw["reference"], prompts, dec, "native", batch_size=plan.ratio_batch, timer=timer)
    wl = batch.Workload.from_runs(nat["prompt_lens"], max_new, nat["blocks"], C)
    samples: list = []

    def sample_drift():
        # the machine's speed against at profiling, re-timed around every round of measurements: a shared
        # machine's speed moves by ±20% within minutes, in CPU time too (profiler.drift)
        if drift_fn is not None:
            samples.append(drift_fn())
        elif plan.drift and not forward_given:
            from dblock.profiling.profiler import drift as measure_drift
            samples.append(measure_drift(profile, m, timer=timer))
    cost: dict = {}

    def sim(ex, sched, bs):
        return {q: batch.simulate_batch(wl, sched, cost[ex].with_q(q), bs) for q in QUANTILES}

    # ---- measurements, interleaved ---------------------------------------------------------------------------
    B = plan.ratio_batch
    jobs = {}
    for bs in plan.batches:
        jobs[("reference", "native", bs)] = (lambda bs=bs: measure.decode_run(fw["reference"], prompts, dec, "native",
                                                                             bs, timer=timer))
    jobs[("reference", "oba", B)] = lambda: measure.decode_run(fw["reference"], prompts, dec, "oba", B, timer=timer)
    jobs[("reference", "flowblock", B)] = lambda: measure.decode_run(fw["reference"], prompts, dec, "flowblock", B,
                                                                      timer=timer)
    jobs[("reference", "native_nocache", B)] = lambda: measure.decode_run(fw["reference"], prompts, dec_nc, "native",
                                                                           B, timer=timer)
    if plan.epoch:
        for bs in sorted({B, max(plan.batches)}):
            jobs[("epoch", "native", bs)] = (lambda bs=bs: measure.decode_run(fw["epoch"], prompts, dec, "native", bs,
                                                                             timer=timer))
        jobs[("epoch", "oba", B)] = lambda: measure.decode_run(fw["epoch"], prompts, dec, "oba", B, timer=timer)
    say(f"{len(jobs)} decoding configurations x {plan.repeats} repeats")
    runs = measure.repeated(jobs, plan.repeats, between=sample_drift)
    decode_samples = len(samples)         # round r of the decoding runs lies between samples r and r + 1
    serve_recs = {}
    for rate in plan.rates:
        arr = poisson_arrivals(rate, plan.serve_requests, plan.seed + int(rate))
        say(f"serving at {rate:g} req/CPU-s")
        recs = []
        for _ in range(max(1, plan.repeats - 1)):
            sample_drift()
            recs.append((len(samples) - 1, measure.serve_cpu_clock(fw["reference"], prompts, arr, dec, "native",
                                                                   plan.batch_cap, timer=timer)))
        serve_recs[rate] = (arr, recs)
    sample_drift()                        # the last round's closing sample
    drifts = [float(x.get("factor", 1.0)) for x in samples]
    factor = float(np.median(drifts)) if drifts else 1.0
    drift = dict(factor=factor, samples=drifts, note="median over the samples of (anchor time now / at profiling); "
                 "absolute rows: each measurement brought to it from its own round's drift" if drifts
                 else "not measured")

    def normalized(vals: list, rounds: list, size: float, inverse: bool = False) -> list:
        """Measurements brought to the median drift from their rounds' own (times scale with the drift; a
        throughput, `inverse`, against it)."""
        if not samples:
            return list(vals)
        out = []
        for v, r in zip(vals, rounds):
            k = factor / bracket(samples, r, size)
            out.append(v / k if inverse else v * k)
        return out
    cost.update({ex: ProfiledCost(profile, ex, scale=factor) for ex in fw})
    rows: list = []

    # T_den
    for ex, bs in [("reference", b) for b in plan.batches] + ([("epoch", b) for b in sorted({B, max(plan.batches)})]
                                                              if plan.epoch else []):
        p = sim(ex, "native", bs)
        mid, lo, hi = _interval({q: p[q].t_den for q in QUANTILES})
        reps = runs[(ex, "native", bs)]
        t_den = normalized([r["den_s"] / r["den_calls"] for r in reps], list(range(len(reps))), bs)
        rows.append(Row(f"{ex} native, batch {bs}", "T_den", "ms", mid, lo, hi, float(np.median(t_den)),
                        _spread(t_den)))

    def ratio_row(name, a, b, quantity="TPS ratio", note=""):
        pa, pb = sim(*a), sim(*b)
        mid, lo, hi = _interval({q: pa[q].tps / pb[q].tps for q in QUANTILES})
        rs = measure.paired_ratios(runs[a], runs[b])
        rows.append(Row(name, quantity, "x", mid, lo, hi, float(np.median(rs)), _spread(rs), note))

    ratio_row(f"reference OBA / Native, batch {B}", ("reference", "oba", B), ("reference", "native", B),
              note="masked: α = 0 by construction")
    ratio_row(f"reference FlowBlock / Native, batch {B}", ("reference", "flowblock", B), ("reference", "native", B))
    ratio_row(f"reference no-cache / cache, batch {B}", ("reference", "native_nocache", B),
              ("reference", "native", B))
    if plan.epoch:
        ratio_row(f"epoch OBA / Native, batch {B}", ("epoch", "oba", B), ("epoch", "native", B))
    hi_b, lo_b = max(plan.batches), min(plan.batches)
    ratio_row(f"reference batch {hi_b} / batch {lo_b}", ("reference", "native", hi_b), ("reference", "native", lo_b),
              quantity="TPS ratio", note="batch composition alone")
    if plan.epoch:
        for bs in sorted({B, max(plan.batches)}):
            ratio_row(f"epoch / dense, batch {bs}", ("epoch", "native", bs), ("reference", "native", bs),
                      quantity="TPS ratio", note="executors, same requests")

    # ---- serving -------------------------------------------------------------------------------------------------
    for rate in plan.rates:
        arr, recs = serve_recs[rate]
        rounds = [i for i, _ in recs]
        sums = [batch.serving_summary(r) for _, r in recs]
        pred = {q: batch.serving_summary(batch.records_of(batch.simulate_serving(
            wl, "native", cost["reference"].with_q(q), arr, plan.batch_cap))) for q in QUANTILES}
        for key, label, unit in (("throughput", "throughput", "tok/s"), ("itl_p95", "P95 ITL", "ms")):
            mid, lo, hi = _interval({q: pred[q][key] for q in QUANTILES})
            vals = normalized([s[key] for s in sums], rounds, plan.batch_cap, inverse=key == "throughput")
            rows.append(Row(f"serving reference, {rate:g} req/s", label, unit, mid, lo, hi, float(np.median(vals)),
                            _spread(vals), f"batch cap {plan.batch_cap}, {plan.serve_requests} requests"))
    if plan.alpha_model and not forward_given:
        rows += alpha_rows(plan, progress=say)
    meta = dict(model=plan.model, task=plan_task(plan, plan.model), n=plan.n, repeats=plan.repeats, profile=profile.meta, drift=drift,
                inputs="operator profile + counters of one Native reference run (no decoding times)",
                timer="thread CPU time", seconds=time.perf_counter() - t_start)
    return Report(rows, meta)


def alpha_rows(plan: Plan, model=None, progress: Optional[Callable[[str], None]] = None) -> list:
    """α of a held-out schedule predicted from a Native run and the *other* schedule, against the α fitted on its
    own counters (Eq. 6; Eq. 5 where Eq. 6 has no root, `oba.fit_alpha_counters`), for a uniform-state model (on masked models α = 0 by construction).

    Three decoding runs of `plan.alpha_model` (Native, OBA, FlowBlock) write their traces in memory; for each of OBA
    and FlowBlock held out, δ is calibrated on the other one (`calibrate.calibrate`: the position model on Native's
    per-position accept passes) and the held-out α predicted (`calibrate.predict_run`). The interval propagates
    the calibration input's uncertainty: δ recalibrated at the ends of the source α's 95% bootstrap interval
    (requests resampled). Error = predicted − measured."""
    import io
    import json

    import dblock
    from dblock.profiling.compare import paired_bootstrap, run_schedule
    from dblock.decoding.params import DecodeConfig
    from dblock.decoding.generate import reference_forward
    from dblock.simulator import calibrate as cal_mod
    from dblock.simulator.oba import fit_alpha_counters
    from dblock.tasks import get_task
    from dblock.tasks.evaluate import TokenizerAdapter

    say = progress or (lambda s: None)
    m = model if model is not None else dblock.load(plan.alpha_model)
    tok = TokenizerAdapter.from_folder(m.source)
    task = get_task(plan_task(plan, plan.alpha_model))
    prompts = [tok.encode(e.prompt) for e in task.examples("test", plan.alpha_n)]
    from dblock.tasks.card import decoding_of
    dec = DecodeConfig(max_new_tokens=task_max_new(plan, task),
                       rule="entropy-bound" if m.config.family == "diffusion_gemma" else "threshold",
                       **decoding_of(getattr(m, "source", None) or plan.alpha_model))
    fwd = reference_forward(m)
    runs, rows_of = {}, {}
    for name in ("native", "oba", "flowblock"):
        say(f"α runs: {plan.alpha_model} {name} ({plan.alpha_n} problems, batch {plan.alpha_batch})")
        buf = io.StringIO()
        rows_of[name] = run_schedule(fwd, prompts, dec, name, [plan.seed], plan.alpha_batch, trace=buf)
        runs[name] = cal_mod.Run.load([json.loads(line) for line in buf.getvalue().splitlines() if line])
    ci_of = {}                  # each fitted α's 95% interval (requests resampled), by the point estimate's equation
    nat = rows_of["native"]
    for name in ("oba", "flowblock"):
        row = rows_of[name]
        try:
            method = fit_alpha_counters(row["F"], row["K"], row["R"], nat["F"] / nat["K"], row["per_request"]["K"])[1]
        except ValueError:
            method = "Eq. 6"
        ci_of[name] = paired_bootstrap(row, nat, alpha_method=method).get("alpha_ci") or []
    out = []
    for held, src in (("flowblock", "oba"), ("oba", "flowblock")):
        cal = cal_mod.calibrate([runs["native"], runs[src]], delta_from=src)
        pr = cal_mod.predict_run(cal, runs[held])
        a_pred, a_meas = pr["predicted"]["alpha"], pr["measured"]["alpha"]
        ends, ks = [], runs[src].counters()["blocks_per_response"]
        for a_src in ci_of[src]:
            try:
                d = cal_mod.calibrate_delta(cal.profile, cal_mod.canonical_schedule(src), float(a_src), ks,
                                            responses=len(ks), gamma=cal.gamma)
            except ValueError:          # an end of the interval that no δ >= 0 reproduces
                continue
            ends.append(cal_mod.predict_run(dataclasses.replace(cal, delta=d), runs[held])["predicted"]["alpha"])
        held_ci = ci_of[held]
        vals = [v for v in [a_pred, *ends] if v is not None and math.isfinite(v)]
        lo, hi = (min(vals), max(vals)) if vals else (float("nan"), float("nan"))
        note = (f"δ {cal.delta:.3f} from {src} α {cal.alphas[runs[src].schedule]['alpha']:.3f}"
                if cal.delta is not None else
                (cal.delta_note or f"δ not calibrated on {src}: no α fitted from its run"))
        if held_ci:
            note += f"; measured α 95% CI {held_ci[0]:.3f}..{held_ci[1]:.3f} ({plan.alpha_n} requests)"
        out.append(Row(f"{plan.alpha_model} {held} α, batch {plan.alpha_batch}", "α", "",
                       float(a_pred) if a_pred is not None else float("nan"), lo, hi, float(a_meas), note=note,
                       absolute=True))
    return out
