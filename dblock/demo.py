"""`make demo` / `dblock demo`: the main job.

On the bundled trained models it answers held-out problems of each model's task (from its card.json: `arith-long` for
tiny-masked, `code` for code-uniform, its `exec` grammar for exec-masked) under every executor and schedule that
applies and prints one compact table: model × executor × schedule → accuracy (code: also token accuracy), TPF, TPS,
passes per block, and the TPS ratio over the reference dense Native row of the same model, **predicted and measured
side by side**:

* measured: every row decodes the same problems `repeats` times, interleaved with the other rows of its model, timed
  in thread-CPU time (`dblock/profiling/measure.py`); the TPS ratio is the median of the per-repeat ratios and its
  noise band their min..max. The verdict is "pays" / "does not pay" only when the whole band is on one side of 1,
  else "within noise" — so it never contradicts the measurement beside it.
* predicted (docs/counters.md, "TPS ratio"): TPS ratio = (n̄/n)·ρ/(r·β), with r the schedule's (or executor's)
  pass over the baseline's pass on the same rows and β the batch-composition factor. On llada2_moe models every
  factor comes from the simulator (`dblock/simulator/batch.py`) priced by the operator profile of this machine
  (`dblock simulate profile`; measured once, about 40 s, when none is cached) on the counters of the Native run;
  on masked models α = 0 by construction (a waiting block decodes nothing, docs/algorithms.md §3). Where a factor
  cannot be predicted (DiffusionGemma: no δ for α, no operator profile), the measured value is used and
  `prediction_note` says which.

While no trained model is bundled, it decodes with a random tiny checkpoint and says so.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from dblock.weights_path import CHECKPOINTS_DIR

# (model, executor, epoch config, schedule, extra decode options, batch). `batch` is the regime a row is measured
# in: None decodes all the model's problems as one batch, 1 decodes them one request at a time (the latency regime
# One Block Ahead is for). Each (model, batch) group is measured, predicted and compared on its own, against its own
# reference Native row, which every group has (tests/simulator/test_demo_prediction.py).
PLAN = [
    ("tiny-masked", "reference", None, "native", {}, None),
    ("tiny-masked", "reference", None, "native", {"no_cache": True}, None),
    ("tiny-masked", "epoch", "epoch", "native", {}, None),
    ("tiny-masked", "reference", None, "oba", {}, None),
    ("tiny-masked", "epoch", "epoch", "oba", {}, None),
    ("code-uniform", "reference", None, "native", {}, 1),
    ("code-uniform", "reference", None, "oba", {}, 1),
    ("code-uniform", "reference", None, "flowblock", {}, 1),
    ("code-uniform", "reference", None, "native", {}, None),
    ("code-uniform", "reference", None, "oba", {}, None),
    ("exec-masked", "reference", None, "native", {}, None),
    ("exec-masked", "epoch", "epoch", "native", {}, None),
]
#: held-out problems per model, or per (model, batch) group where a group decodes fewer (its first ones)
N_PROBLEMS = {"tiny-masked": 32, "code-uniform": 16, ("code-uniform", 1): 8, "exec-masked": 32}
REPEATS = 3


def _bundled() -> list:
    if not os.path.isdir(CHECKPOINTS_DIR):
        return []
    return sorted(d for d in os.listdir(CHECKPOINTS_DIR)
                  if os.path.isfile(os.path.join(CHECKPOINTS_DIR, d, "config.json")))


def _random_demo(n, as_json) -> int:
    import dblock
    from dblock.decoding.params import DecodeConfig
    from dblock.tiny import make_tiny

    print("dblock demo: no trained model is bundled; decoding with a RANDOM tiny llada2_moe checkpoint "
          "(its text is meaningless; this shows the pipeline and the counters).")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_tiny("llada2_moe", d, seed=0)
        model = dblock.load(d)
        prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]][: n or 2]
        for no_cache in (False, True):
            s = dblock.generate(model, prompts, DecodeConfig(max_new_tokens=32, no_cache=no_cache)).summary()
            rows.append({"model": "random-tiny", "executor": "reference",
                         "schedule": "native" + (" no-cache" if no_cache else ""), "TPF": s["TPF"], "TPS": s["TPS"]})
    print(json.dumps(rows, indent=2) if as_json else "\n".join(str(r) for r in rows))
    return 0


def _problems(name: str, batch: int | None, n: int | None) -> int:
    """How many held-out problems the (model, batch) group decodes: `n` (`--n`), else `N_PROBLEMS[(name, batch)]`,
    else `N_PROBLEMS[name]` (16 for a model it does not name)."""
    return n or N_PROBLEMS.get((name, batch), N_PROBLEMS.get(name, 16))


def _label(schedule: str, extra: dict) -> str:
    return schedule + (" no-cache" if extra.get("no_cache") else "")


def _sim_schedule(schedule: str, extra: dict) -> str:
    return "native_nocache" if extra.get("no_cache") else schedule


def run_demo(n=None, as_json=False, repeats: int = REPEATS, profile: str | None = None) -> int:
    bundled = _bundled()
    if not bundled:
        return _random_demo(n, as_json)
    import dblock
    from dblock.decoding.params import DecodeConfig
    from dblock.decoding.generate import reference_forward
    from dblock.optimized.executor import epoch_forward
    from dblock.profiling import measure
    from dblock.tasks import get_task
    from dblock.tasks.card import decoding_of, task_of
    from dblock.tasks.evaluate import TokenizerAdapter, prompts_and_grader

    from tqdm import tqdm

    t0 = time.perf_counter()
    rows = []
    names = [m for m in dict.fromkeys(p[0] for p in PLAN) if m in bundled]
    # one step per decoding run; on stderr, shown on a terminal (or with DBLOCK_PROGRESS=1), never in --json output
    from dblock.cli_args import show_progress
    show = show_progress()
    bar = tqdm(total=repeats * sum(p[0] in names for p in PLAN), desc="demo", unit="run", file=sys.stderr,
               disable=not show, leave=False)
    for name in names:
        bar.set_postfix_str(name)
        model = dblock.load(name)
        family = model.config.family
        tok = TokenizerAdapter.from_folder(model.source)
        task = get_task(task_of(name))   # what the model was trained on (its card.json)
        sizes = {bs: _problems(name, bs, n) for m, *_, bs in PLAN if m == name}
        probs = task.examples("test", max(sizes.values()))         # each group decodes the first k of these
        all_prompts, grader = prompts_and_grader(task, tok, probs)   # code: a dict of quality metrics per request
        max_new = getattr(task, "max_new_tokens", 128)      # the code task: 64 (two blocks)
        fwds = {}
        jobs, specs = {}, {}
        for mname, executor, econf, schedule, extra, bs in PLAN:
            if mname != name:
                continue
            k = sizes[bs]
            prompts = all_prompts[:k]
            bs = bs or k                        # the row's batch: None = every problem at once
            key = (executor, _label(schedule, extra), bs)
            if executor not in fwds:
                fwds[executor] = reference_forward(model) if executor == "reference" else epoch_forward(model, econf)
            card_dec = decoding_of(name)     # the card's default: LLaDA2.0's S (masked) or N steps (uniform-state)
            dec = DecodeConfig(max_new_tokens=max_new, rule="entropy-bound" if family == "diffusion_gemma" else
                               "threshold", **{**card_dec, **extra})
            # the baseline's pass on the same rows is timed only where the batch compositions differ (a uniform-state
            # schedule changes passes per block); elsewhere both runs batch the same requests alike and β = 1
            shadow = "strip" if schedule in ("oba", "flowblock") and family == "diffusion_gemma" else None
            jobs[key] = (lambda f=fwds[executor], d=dec, s=schedule, sh=shadow, b=bs, ps=prompts:
                         measure.decode_run(f, ps, d, s, b, shadow=sh, seeds=[0] * len(ps)))
            specs[key] = (executor, econf, schedule, extra, bs, k)
        runs = measure.repeated(jobs, repeats, progress=bar)
        for key, rs in runs.items():
            executor, econf, schedule, extra, bs, k = specs[key]
            base_key = ("reference", "native", bs)
            med = measure.median_run(rs)
            graded = [grader(p, ids) for p, ids in zip(all_prompts[:k], rs[0]["tokens"])]
            ok = [g["correct"] if isinstance(g, dict) else g for g in graded]
            # the code task's whole-answer token accuracy (next line exact is all-or-nothing); None on other tasks
            tok_acc = (sum(g["answer_token_accuracy"] for g in graded) / k
                       if graded and isinstance(graded[0], dict) else None)
            same = (sum(a == b for a, b in zip(rs[0]["tokens"], runs[base_key][0]["tokens"])) / k
                    if base_key in runs else 1.0)
            ratios = measure.paired_ratios(rs, runs[base_key]) if base_key in runs else [1.0]
            mid, lo, hi = measure.noise_band(ratios)
            rows.append({"model": name, "family": family, "executor": executor + (f":{econf}" if econf else ""),
                         "schedule": _label(schedule, extra), "sim_schedule": _sim_schedule(schedule, extra),
                         "batch": bs, "n": k, "repeats": repeats, "accuracy": sum(ok) / len(ok), "token_accuracy": tok_acc,
                         "identical": same,
                         "TPF": med["Y"] / med["Q"],
                         "TPS": med["TPS"], "T_den_ms": med["T_den_ms"], "passes_per_block": med["F"] / med["K"],
                         "Y": med["Y"], "F": med["F"], "K": med["K"], "Q": med["Q"], "R": med["R"],
                         "den_s": med["den_s"], "den_base_s": med["den_base_s"],
                         "measured_tps_ratio": mid, "measured_band": [lo, hi], "speedup": mid,
                         "_run": med, "_runs": rs})
        for bs in dict.fromkeys(x["batch"] for x in rows if x["model"] == name):
            _predict(name, model, rows, profile, as_json, batch_size=bs)
        del model, fwds
    bar.close()
    for x in rows:
        for k in ("_run", "_runs", "sim_schedule"):
            x.pop(k, None)
    if as_json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    _print(rows, bundled, repeats, time.perf_counter() - t0)
    return 0


def _predict(name: str, model, rows: list, profile: str | None, quiet: bool, batch_size: int | None = None) -> None:
    """Fill predicted_tps_ratio, its interval, inputs and note on every row of `name` measured at `batch_size` (None:
    the rows without a batch; see the module docstring)."""
    import numpy as np

    from dblock.simulator import batch, oba
    mine = [x for x in rows if x["model"] == name and x.get("batch") == batch_size]
    base = next((x for x in mine if x["executor"] == "reference" and x["schedule"] == "native"), None)
    if base is None:
        return
    prof = (_profile_for(name, model, profile, quiet, max_requests=base["n"])
            if model.config.family == "llada2_moe" else None)
    wl, scale = None, 1.0
    if prof is not None:
        from dblock.profiling.profiler import drift
        scale = drift(prof, model)["factor"]      # the machine's speed now against at profiling (anchors)
        b = base["_run"]
        wl = batch.Workload.from_runs(b["prompt_lens"], b.get("max_new_tokens", 128), b["blocks"],
                                      model.config.block_size)
    for x in mine:
        nbar, n = base["F"] / base["K"], x["F"] / x["K"]
        rho = (x["Y"] / x["K"]) / (base["Y"] / base["K"])
        per_repeat = []
        for rb, rx in zip(base["_runs"], x["_runs"]):
            try:
                per_repeat.append(batch.decompose(dict(rb, den_base_s=rb["den_s"]), rx))
            except ValueError:           # compositions differ and no baseline timing on the same rows
                per_repeat = []
                break
        meas = {k: float(np.median([d[k] for d in per_repeat])) for k in ("nbar_over_n", "rho", "r", "beta",
                                                                          "tps_ratio")} if per_repeat else None
        x["measured_parts"] = None if meas is None else {k: meas[k] for k in ("nbar_over_n", "rho", "r", "beta")}
        alpha = None
        multi = x["schedule"] in ("oba", "flowblock")
        if multi:
            try:
                per_k = [len(bl) for bl in (x.get("_run") or {}).get("blocks") or []] or None
                alpha, x["alpha_method"] = oba.fit_alpha_counters(x["F"], x["K"], x["R"], nbar, per_k)
            except ValueError:
                alpha = None
        x["alpha"] = alpha
        if x is base:
            x.update(predicted_tps_ratio=1.0, predicted_interval=[1.0, 1.0], prediction_inputs={},
                     prediction_note="the baseline", verdict="baseline", prediction_agrees=True)
            continue
        if prof is not None:
            from dblock.simulator.profile import QUANTILES, ProfiledCost
            ex = "epoch" if x["executor"].startswith("epoch") else "reference"
            pred = {}
            for q in QUANTILES:
                ref = ProfiledCost(prof, "reference", q, scale)
                bs = batch_size if batch_size and batch_size < base["n"] else None
                sb = batch.simulate_batch(wl, "native", ref, bs)
                so = batch.simulate_batch(wl, batch.Schedule(x["sim_schedule"]), ProfiledCost(prof, ex, q, scale),
                                          bs, base_cost=ref)
                pred[q] = (so.tps / sb.tps, batch.decompose(sb.summary(), so.summary()))
            mid, parts = pred["median"]
            x["predicted_tps_ratio"] = mid
            x["predicted_interval"] = [min(v[0] for v in pred.values()), max(v[0] for v in pred.values())]
            x["prediction_inputs"] = {
                "alpha": {"value": 0.0 if multi else None,
                          "source": "predicted: masked model, the waiting block decodes nothing" if multi else "-"},
                "nbar_over_n": {"value": parts["nbar_over_n"], "source": "simulated from the Native counters"},
                "rho": {"value": parts["rho"], "source": "simulated"},
                "r": {"value": parts["r"], "source": "predicted: operator profile, same rows"},
                "beta": {"value": parts["beta"], "source": "predicted: operator profile, batch composition"}}
            what = ("α = 0 (masked: the waiting block decodes nothing), so every block runs its Native passes"
                    if multi else "a single-block row: n = n̄")
            x["prediction_note"] = (f"{what}; r and β predicted from the operator profile of "
                                    f"{prof.meta.get('machine', '?')} (drift x{scale:.2f}) on the Native run's "
                                    f"counters; finite-length run, {_regime(x)}")
        else:
            if multi and alpha is not None:
                if x["alpha_method"] == "Eq. 5":      # short responses, α near 1: the exact transient (Eq. 5)
                    nbar_n = nbar * x["K"] / oba.expected_passes_exact(nbar, alpha, per_k)
                    phi = nbar_n / (1 + alpha)
                else:
                    phi = oba.transient_factor(alpha, x["K"], x["R"])
                    nbar_n = (1 + alpha) * phi
                a_src = (f"measured ({x['alpha_method']} on this run's counters): the demo's few requests cannot "
                         "calibrate δ; `dblock simulate validate` predicts this α held out (δ from the other schedule)")
            else:
                nbar_n, phi = nbar / n, 1.0
                a_src = "measured n̄/n (α has no single root on these counters)" if multi else "-"
            if per_repeat:
                vals = [oba.tps_ratio_identity(nbar_n, rho, d["r"], d["beta"]) for d in per_repeat]
                r, beta = meas["r"], meas["beta"]
            else:                        # no same-rows timing: r·β from the per-request-pass times (β not split)
                r, beta = (x["den_s"] / x["F"]) / (base["den_s"] / base["F"]), 1.0
                vals = [oba.tps_ratio_identity(nbar_n, rho, r, beta)]
            x["predicted_tps_ratio"] = float(np.median(vals))
            x["predicted_interval"] = [float(min(vals)), float(max(vals))]
            x["prediction_inputs"] = {
                "alpha": {"value": alpha, "source": a_src},
                "transient": {"value": phi, "source": "finite-length factor φ = (n̄/n)/(1+α): Eq. 6's "
                              "1/(1 + (R/K)·α/(1+α)), or Eq. 5's exact sum where α was fitted by Eq. 5"},
                "rho": {"value": rho, "source": "measured"},
                "r": {"value": r, "source": "measured: the baseline's pass timed on the same rows"},
                "beta": {"value": beta, "source": "measured: baseline pass cost per request at this composition"}}
            x["prediction_note"] = (f"measured inputs for {model.config.family}: α (too few requests here to calibrate "
                                    "δ; `dblock simulate validate` predicts it held out) and r, β on the same rows "
                                    "(no operator profile for this family); finite-length run "
                                    f"(transient factor φ), {_regime(x)}")
        if model.config.family == "diffusion_gemma" and x["schedule"] == "oba" and alpha is not None:
            from dblock.simulator.papers import oba_gb300_verdict      # the paper's setting, with the α measured here
            x["gb300"] = oba_gb300_verdict(alpha)
        lo, hi = x["measured_band"]
        x["verdict"] = _verdict(lo, hi)
        p = x["predicted_tps_ratio"]
        x["prediction_agrees"] = x["verdict"] == "within noise" or (p > 1) == (x["measured_tps_ratio"] > 1)


def _why_not(x: dict, rows: list = ()) -> str | None:
    """For a multi-block row of a uniform-state model measured at a batch above 1 that does not pay: why, from its
    own α and r (OBA pays when 1 + α > r·β, docs/counters.md); None for any other row."""
    b = x.get("batch") or x["R"]
    if x.get("family") != "diffusion_gemma" or x["schedule"] not in ("oba", "flowblock") or x.get("verdict") != \
            "does not pay" or b <= 1:
        return None
    ins = x.get("prediction_inputs", {})
    a, r, beta = (ins.get(k, {}).get("value") for k in ("alpha", "r", "beta"))
    if not all(isinstance(v, (int, float)) for v in (a, r, beta)):
        return None
    one = None
    for y in rows:                              # the same model and schedule measured at batch 1
        if (y["model"], y["schedule"], y.get("batch")) == (x["model"], x["schedule"], 1):
            yi = y.get("prediction_inputs", {})
            if all(isinstance(yi.get(k, {}).get("value"), (int, float)) for k in ("r", "beta")):
                one = yi["r"]["value"] * yi["beta"]["value"]
    return (f"why {x['model']} {x['schedule']} does not pay at batch {b}: on this CPU a pass "
            f"of {b} requests grows with its rows, so the pass with the warm-up block costs "
            f"r·β = {r * beta:.2f} of Native's while it saves 1 + α = {1 + a:.2f} of the passes" + (
                f"; at batch 1 the same schedule's wider pass costs r·β = {one:.2f} of Native's (its row above)"
                if one is not None else ""))


def _regime(x: dict) -> str:
    """How a row's requests were batched, in words."""
    b, n = x.get("batch") or x["R"], x["R"]
    return (f"all {n} requests in one batch" if b >= n else "one request at a time (batch 1)" if b == 1 else
            f"{n} requests at most {b} at a time")


def _verdict(lo: float, hi: float) -> str:
    from dblock.profiling.measure import verdict
    return verdict(lo, hi)


def _profile_for(name: str, model, path: str | None, quiet: bool, max_requests: int | None = None):
    """The operator profile of `name` on this machine: `path`, else the cached default (`dblock simulate profile`),
    else the demo's own quick one, else a quick one measured now up to `max_requests` requests (the demo's batch).
    The demo's quick profile has its own file (`NAME-demo-...json`), so `simulate validate` never prices larger
    batches with it."""
    from dblock.simulator.profile import Profile, default_path
    from dblock.profiling.profiler import Profiler, code_fingerprint, machine_tag
    p = path or default_path(name, machine_tag())
    why = "no operator profile of {name} on this machine yet"
    candidates = [p] if path else [p, default_path(f"{name}-demo", machine_tag())]
    for c in candidates:
        if not os.path.isfile(c):
            continue
        try:
            prof = Profile.load(c)
            if prof.has("epoch_moe") and prof.meta.get("anchor"):
                if prof.meta.get("code") == code_fingerprint():
                    return prof
                why = "the operator profile of {name} was measured on other executor code (it would price that code)"
        except ValueError:
            pass
    out = candidates[-1]
    print(f"demo: {why.format(name=name)}: measuring a quick one (about 40 s; "
          f"`dblock simulate profile --model {name}` measures the full one) -> {out}", file=sys.stderr)
    from dblock.profiling.profiler import QUICK
    knobs = dict(QUICK, repeats=2)             # the demo's own: two repeats (its rows repeat three times anyway)
    if max_requests:
        knobs["max_requests"] = max(1, min(QUICK["max_requests"], max_requests))
    prof = Profiler(model, name=name, **knobs).run(("reference", "epoch"))
    prof.meta["quick"] = True
    prof.save(out)
    return prof


def _print(rows: list, bundled: list, repeats: int, seconds: float) -> None:
    from dblock.tasks.card import task_of
    tasks = ", ".join(dict.fromkeys(task_of(b) for b in bundled))
    print(f"dblock demo: held-out {tasks} problems on the bundled models ({', '.join(bundled)})\n")
    hdr = (f"{'model':<13} {'executor':<12} {'schedule':<16} {'batch':>5} {'acc':>5} {'tok':>5} {'same':>5} {'TPF':>5} "
           f"{'TPS':>8} "
           f"{'pass/blk':>8}  "
           f"{'TPS ratio: predicted':>21}  {'measured [band]':>20}  verdict")
    print(hdr)
    print("-" * len(hdr))
    for x in rows:
        p = x.get("predicted_tps_ratio")
        lo, hi = x["measured_band"]
        pred = f"{p:.2f}" if p is not None else "-"
        agree = "" if x.get("prediction_agrees", True) else "  (prediction disagrees)"
        ta = "-" if x.get("token_accuracy") is None else f"{x['token_accuracy']:.3f}"
        print(f"{x['model']:<13} {x['executor']:<12} {x['schedule']:<16} {x.get('batch') or x.get('n', '-'):>5} "
              f"{x['accuracy']:>5.2f} {ta:>5} "
              f"{x['identical']:>5.2f} "
              f"{x['TPF']:>5.2f} "
              f"{x['TPS']:>8.0f} {x['passes_per_block']:>8.2f}  {pred:>21}  "
              f"{x['measured_tps_ratio']:>6.2f} [{lo:.2f}..{hi:.2f}]  {x.get('verdict', '-')}{agree}")
    notes = [x for x in rows if x.get("prediction_note") and x.get("verdict") != "baseline"]
    if notes:
        print("\nHow each ratio is predicted: TPS ratio = (n̄/n)·ρ/(r·β) (docs/counters.md); r = the row's pass over "
              "the baseline's pass on the same rows, β = batch composition")
        for x in notes:
            ins = x.get("prediction_inputs", {})
            parts = ", ".join(f"{k} {v['value']:.3f}" for k, v in ins.items()
                              if isinstance(v.get("value"), (int, float)))
            print(f"  {x['model']} {x['executor']} {x['schedule']} batch {x.get('batch') or x.get('n', '-')}: "
                  f"{parts}. {x['prediction_note']}")
    for x in rows:
        why = _why_not(x, rows)
        if why:
            print(f"\n{why}")
    gb = [x for x in rows if x.get("gb300")]
    for x in [x for x in gb if x.get("batch") == 1] or gb[:1]:     # the paper's setting is batch 1
        g = x.get("gb300")
        if g:
            say = lambda ok: "pays" if ok else "does not pay"
            print(f"\n{x['model']} OBA in the One Block Ahead paper's setting (DiffusionGemma, one GB300, batch 1) with "
                  f"the α measured here ({g['alpha']:.2f}): r from the simulator's DiffusionGemma pass "
                  f"{g['r']:.2f} (Figure 2 calibration; {g['r_roofline']:.2f} as a pure roofline; the paper measured "
                  f"{g['r_paper']:.2f}) -> (1+α)/r = {g['tps_ratio']:.2f}, {say(g['pays'])} "
                  f"({g['tps_ratio_roofline']:.2f}, {say(g['pays_roofline'])} on the roofline r); on this CPU: "
                  f"{x.get('verdict', '-')}")
    for x in rows:
        if x["schedule"] in ("oba", "flowblock") and x.get("family") == "llada2_moe":
            print(f"\nnote: on masked models ({x['model']}) OBA and FlowBlock keep Native's answers: masked diffusion "
                  "cannot revise a revealed token, so the waiting block decodes nothing before promotion (the One "
                  "Block Ahead paper's No Accept; docs/algorithms.md §3). α = 0, and the wider pass costs r > 1.")
            break
    if any(task_of(b) == "code" for b in bundled):
        print("\nacc: the task's accuracy (code: the next line exact; exec: the whole printed answer exact); tok: "
              "the code task's token accuracy over the whole answer (64 generated tokens against the file's own, "
              "position by position); same: requests "
              "whose whole output equals the reference Native row's (a uniform-state OBA or FlowBlock run draws its "
              "noise from one generator per block, "
              "Native from one per request: their outputs are the same in distribution, not token for token, so "
              "compare acc and tok there)")
    print(f"\n({seconds:.0f} s; TPS = tokens per second of denoising thread-CPU time on this machine, median of "
          f"{repeats} interleaved repeats; ratios over the reference dense Native row of the same model; band = "
          "min..max of the per-repeat ratios)")
