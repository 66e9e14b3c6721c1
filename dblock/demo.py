"""`make demo` / `dblock demo`: the main job.

On the bundled trained models it answers held-out problems of the `arith-small` task under every executor and schedule
that exists and prints one compact table: model × executor × schedule → accuracy, TPF, TPS, passes per block,
speedup (TPS) over the reference dense Native run of the same model, then One Block Ahead's numbers: the fitted α,
the measured r, the cost model's predicted TPS ratio (1 + α)/r beside the measured one, and the break-even verdict.

While no trained model is bundled, it decodes with a random tiny checkpoint and says so.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

from dblock.weights import CHECKPOINTS_DIR

# (model, executor, epoch config, schedule, extra decode options)
PLAN = [
    ("tiny-masked", "reference", None, "native", {}),
    ("tiny-masked", "reference", None, "native", {"no_cache": True}),
    ("tiny-masked", "epoch", "epoch", "native", {}),
    ("tiny-masked", "reference", None, "oba", {}),
    ("tiny-masked", "epoch", "epoch", "oba", {}),
    ("tiny-uniform", "reference", None, "native", {}),
    ("tiny-uniform", "reference", None, "oba", {}),
    ("tiny-uniform", "reference", None, "flowblock", {}),
]
N_PROBLEMS = {"tiny-masked": 32, "tiny-uniform": 16}


def _bundled() -> list:
    if not os.path.isdir(CHECKPOINTS_DIR):
        return []
    return sorted(d for d in os.listdir(CHECKPOINTS_DIR)
                  if os.path.isfile(os.path.join(CHECKPOINTS_DIR, d, "config.json")))


def _random_demo(n, as_json) -> int:
    import dblock
    from dblock.config import DecodeConfig
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


def run_demo(n=None, as_json=False) -> int:
    bundled = _bundled()
    if not bundled:
        return _random_demo(n, as_json)
    import dblock
    from dblock.config import DecodeConfig
    from dblock.optimized.executor import epoch_forward
    from dblock.decoding.generate import reference_forward
    from dblock.tasks import get_task
    from dblock.tasks.evaluate import TokenizerAdapter, evaluate

    t0 = time.perf_counter()
    task = get_task("arith-small")   # what the bundled models are trained on (see their card.json)
    models, rows = {}, []
    for name, executor, econf, schedule, extra in PLAN:
        if name not in bundled:
            continue
        if name not in models:
            models[name] = dblock.load(name)
        model = models[name]
        family = model.config.family
        dec = DecodeConfig(max_new_tokens=128, rule="entropy-bound" if family == "diffusion_gemma" else "threshold",
                           **extra)
        fwd = reference_forward(model) if executor == "reference" else epoch_forward(model, econf)
        k = n or N_PROBLEMS.get(name, 16)
        r = evaluate(fwd, task, n=k, dec=dec, schedule=schedule, tokenizer=TokenizerAdapter.from_folder(model.source),
                     seeds=[0])
        label = schedule + (" no-cache" if extra.get("no_cache") else "")
        rows.append({"model": name, "executor": executor + (f":{econf}" if econf else ""), "schedule": label,
                     "n": k, "accuracy": r["accuracy"], "TPF": r["TPF"], "TPS": r["TPS"],
                     "T_den_ms": r["T_den_ms"], "passes_per_block": r["passes_per_block_mean"],
                     "F": r["F"], "K": r["K"], "R": k})
    for name in models:
        base = next((x for x in rows if x["model"] == name and x["executor"] == "reference"
                     and x["schedule"] == "native"), None)
        for x in rows:
            if x["model"] == name and base:
                x["speedup"] = x["TPS"] / base["TPS"] if base["TPS"] else None
    oba = _oba_summary(rows)
    if as_json:
        print(json.dumps({"rows": rows, "oba": oba}, indent=2))
        return 0
    print(f"dblock demo: held-out arith-small problems on the bundled models ({', '.join(bundled)})\n")
    hdr = f"{'model':<13} {'executor':<16} {'schedule':<16} {'acc':>5} {'TPF':>6} {'TPS':>8} {'pass/blk':>8} {'speedup':>7}"
    print(hdr)
    print("-" * len(hdr))
    for x in rows:
        print(f"{x['model']:<13} {x['executor']:<16} {x['schedule']:<16} {x['accuracy']:>5.2f} {x['TPF']:>6.2f} "
              f"{x['TPS']:>8.1f} {x['passes_per_block']:>8.2f} {x.get('speedup') or 0:>6.2f}x")
    if oba:
        print("\nOne Block Ahead (cost model vs measurement; α from Eq. 6, r = T_den(OBA)/T_den(Native)):")
        for o in oba:
            a = "-" if o["alpha"] is None else f"{o['alpha']:.2f}"
            pred = "-" if o["predicted_tps_ratio"] is None else f"{o['predicted_tps_ratio']:.2f}"
            print(f"  {o['model']:<13} {o['executor']:<16} α {a}  r {o['r']:.2f}  predicted TPS ratio (1+α)/r "
                  f"{pred}  measured {o['measured_tps_ratio']:.2f}  -> {o['verdict']}")
    for x in rows:     # a schedule that changes answers is a finding, not a speedup: say so under the table
        base = _native_row(rows, x["model"], "reference")
        if base and x["schedule"] == "oba" and x["accuracy"] < base["accuracy"] - 0.1:
            print(f"\nnote: {x['model']} {x['schedule']} ({x['executor']}) answers {x['accuracy']:.2f} vs "
                  f"{base['accuracy']:.2f} under Native: its warm-up half reads a partly masked current block, a "
                  "context the model's block-causal training never showed it, and the tokens it accepts there are "
                  "kept (BENCHMARKS.md, 'Multi-block schedules').")
            break
    print(f"\n({time.perf_counter() - t0:.0f} s; TPS = tokens per second of denoising wall time on this CPU; "
          "speedup = TPS over the reference dense Native row of the same model)")
    return 0


def _native_row(rows, model: str, executor: str):
    """The Native-schedule row of `model` under `executor` (the baseline of every ratio), or None."""
    return next((b for b in rows if b["model"] == model and b["executor"] == executor and b["schedule"] == "native"),
                None)


def _oba_summary(rows) -> list:
    from dblock.simulator.oba import fit_alpha, tps_ratio
    out = []
    for x in rows:
        if x["schedule"] != "oba":
            continue
        base = _native_row(rows, x["model"], x["executor"])
        if base is None or not base["T_den_ms"]:
            continue
        nbar = base["F"] / base["K"]
        try:
            alpha = fit_alpha(x["F"], x["K"], x["R"], nbar)
        except ValueError:
            alpha = None
        r = x["T_den_ms"] / base["T_den_ms"]
        out.append({"model": x["model"], "executor": x["executor"], "alpha": alpha, "r": r,
                    "predicted_tps_ratio": tps_ratio(alpha, r) if alpha is not None and 0 <= alpha < 1 else None,
                    "measured_tps_ratio": x["TPS"] / base["TPS"] if base["TPS"] else 0.0,
                    "verdict": "pays" if alpha is not None and alpha > r - 1 else "does not pay"})
    return out
