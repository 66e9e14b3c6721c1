"""Epoch's quality-latency figure on a trained model: task accuracy against thread-CPU time per pass, for the dense
reference, full_compute, Epoch at M_C = 1, 2, 3, 5, 8, and the two ablations (without the Expert Atlas: no_atlas;
without LSP: no_lsp), the same held-out requests decoded by each in one run (docs/algorithms.md §4; the figure the
Epoch paper draws for its models).

Every configuration decodes the same prompts with the model card's decoding, interleaved within each repeat so that
machine noise hits them alike; the path profile is measured on the cell first (as `benchmarks/epoch_cpu.py`).
Per configuration: thread-CPU ms per pass and TPS (medians of the repeats), passes, the fresh-row fraction f,
accuracy (the task's whole-answer exact, with a 95% bootstrap CI over requests) and its paired 95% CI against
dense, and the share of requests whose whole output equals the dense run's. The outputs are deterministic (greedy
decoding), so accuracy and identity come from the first repeat; the repeats only steady the clocks.

    .venv/bin/python benchmarks/epoch_quality.py --model exec-masked --batch 64 --repeats 3 \\
        --png benchmarks/figures/epoch_quality_exec-masked.png --write-benchmarks

Ratios within one run on one machine; never used by tests.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.epoch_cpu import (_dec, _write_atomic, calibrate, parse_config, parse_configs,  # noqa: E402
                                  run_config, steady_allocator, write_section)
from dblock.errors import ConfigError  # noqa: E402
from dblock.out_paths import check_out_file  # noqa: E402

CONFIGS = "dense,full_compute,epoch#1,epoch#2,epoch#3,epoch,epoch#8,no_atlas,no_lsp"
SECTION_PREFIX = "## Epoch's quality-latency figure on"


def label(config: str) -> str:
    """`epoch#3` -> `epoch M_C=3`; `epoch` -> `epoch M_C=5` (its default)."""
    name = config.partition("#")[0]
    if name == "epoch":
        return f"epoch M_C={config.partition('#')[2] or 5}"
    return {"no_atlas": "no Atlas (M_C=5)", "no_lsp": "no LSP"}.get(name, name)


def measure(model, batch: int, configs: list, repeats: int, calibration_repeats: int = 3) -> list:
    from dblock.tasks import answer_text
    from dblock.tasks.code import bootstrap_ci, paired_bootstrap_ci
    from dblock.tasks.evaluate import held_out_prompts
    task, tok, exs, prompts = held_out_prompts(model, batch)     # of the task the model was trained on (its card)
    dec = _dec(model, getattr(task, "max_new_tokens", 128), "threshold")
    profiles = calibrate(model, prompts, dec, calibration_repeats)
    runs = {c: [] for c in configs}
    for _ in range(repeats):
        for c in configs:                 # interleaved
            runs[c].append(run_config(c, model, prompts, dec, path_model=profiles.get(parse_config(c)[0])))
    dense = runs["dense"][0]
    exact = {c: [float(task.grade(e.prompt, answer_text(t, tok))) for e, t in zip(exs, runs[c][0]["tokens"])]
             for c in configs}
    rows = []
    for c in configs:
        rs = runs[c]
        rows.append({"config": c, "label": label(c),
                     "cpu_ms_per_pass": 1e3 * statistics.median(r["cpu_per_pass"] for r in rs),
                     "wall_ms_per_pass": 1e3 * statistics.median(r["wall_per_pass"] for r in rs),
                     "TPS": statistics.median(r["TPS"] for r in rs), "passes": rs[0]["passes"],
                     "fresh_frac": rs[0]["fresh_frac"], "dense_calls": rs[0]["dense_calls"],
                     "accuracy": sum(exact[c]) / batch, "accuracy_ci": bootstrap_ci(exact[c]),
                     "accuracy_delta_ci": paired_bootstrap_ci(exact[c], exact["dense"]),
                     "identical": sum(a == b for a, b in zip(rs[0]["tokens"], dense["tokens"])) / batch,
                     "repeats": len(rs)})
    d = rows[configs.index("dense")]
    for r in rows:
        r["speedup"] = r["TPS"] / d["TPS"]
    return rows


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        lo, hi = r["accuracy_ci"]
        marker = {"dense": "s", "full_compute": "D"}.get(r["config"], "o" if r["config"].startswith("epoch")
                                                         else "^")
        ax.errorbar(r["cpu_ms_per_pass"], r["accuracy"], yerr=[[r["accuracy"] - lo], [hi - r["accuracy"]]],
                    fmt=marker, capsize=3, label=r["label"])
    ep = sorted((r for r in rows if r["config"].startswith("epoch")), key=lambda r: r["cpu_ms_per_pass"])
    ax.plot([r["cpu_ms_per_pass"] for r in ep], [r["accuracy"] for r in ep], "-", color="grey", alpha=0.5)
    ax.set_xlabel("thread-CPU ms per pass (median)")
    ax.set_ylabel("accuracy (whole answer exact, 95% CI)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def markdown(rows: list, meta: dict) -> str:
    out = [f"{SECTION_PREFIX} `{meta['model']}`", "",
           f"Command: `{meta['command']}` ({meta['minutes']:.1f} min). Machine: {meta['machine']}. Batch "
           f"{meta['batch']} held-out requests of the model's card task, its card decoding; {meta['repeats']} "
           "interleaved repeats, medians of thread-CPU time per pass (`time.thread_time`, the primary clock). "
           "Accuracy is the whole answer exact with its 95% bootstrap CI over requests; Δ CI is the paired 95% CI of "
           "the accuracy difference to dense on the same requests; identical is the share of requests whose whole "
           "output equals the dense run's.", ""]
    if meta.get("png"):
        out += [f"![accuracy against CPU time per pass]({meta['png']})", ""]
    out += ["| config | CPU ms/pass | TPS vs dense | passes | fresh rows f | dense calls | accuracy [95% CI] | "
            "Δ vs dense [paired CI] | identical |", "|---" * 9 + "|"]
    for r in rows:
        lo, hi = r["accuracy_ci"]
        dlo, dhi = r["accuracy_delta_ci"]
        out.append(f"| {r['label']} | {r['cpu_ms_per_pass']:.1f} | {r['speedup']:.2f}x | {r['passes']} | "
                   f"{100 * r['fresh_frac']:.0f}% | {100 * r['dense_calls']:.0f}% | {r['accuracy']:.3f} "
                   f"[{lo:.3f}, {hi:.3f}] | {dlo:+.3f}..{dhi:+.3f} | {100 * r['identical']:.0f}% |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="exec-masked",
                    help="a trained model with a task on its card: a bundled name or a folder (default exec-masked)")
    ap.add_argument("--batch", type=int, default=64, help="held-out requests, decoded together (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    ap.add_argument("--calibration-repeats", type=int, default=3, help="short runs per path-profile measurement")
    ap.add_argument("--configs", default=CONFIGS, help=f"configurations (default {CONFIGS})")
    ap.add_argument("--png", default=None, help="write the figure here")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--write-benchmarks", nargs="?", const=os.path.join(ROOT, "BENCHMARKS.md"), default=None,
                    metavar="PATH", help="replace this model's section in BENCHMARKS.md (or PATH)")
    a = ap.parse_args()
    try:
        for path, flag in ((a.png, "--png"), (a.json, "--json"), (a.write_benchmarks, "--write-benchmarks")):
            if path:
                check_out_file(path, flag)
        if min(a.batch, a.repeats, a.calibration_repeats) < 1:
            raise ConfigError(f"--batch {a.batch} / --repeats {a.repeats} / --calibration-repeats "
                              f"{a.calibration_repeats}: must be >= 1")
        configs = parse_configs(a.configs)
    except ConfigError as e:
        raise SystemExit(f"epoch_quality.py: error: {e}") from None
    torch.set_num_threads(1)
    alloc = steady_allocator()
    import dblock
    from dblock.errors import WeightsError
    from dblock.tasks.card import task_of
    try:
        model = dblock.load(a.model)
    except (WeightsError, ConfigError) as e:
        raise SystemExit(f"epoch_quality.py: error: --model {a.model}: {e}") from None
    if task_of(model.source, default="") == "":
        raise SystemExit(f"epoch_quality.py: error: --model {a.model}: its folder has no card.json naming its task "
                         "(`dblock model-card` writes one)")
    machine = f"`{platform.platform()}`, {os.cpu_count()} cores, torch {torch.__version__}, one torch thread, {alloc}"
    t0 = time.perf_counter()
    rows = measure(model, a.batch, configs, a.repeats, a.calibration_repeats)
    print(f"{'config':>18} {'cpu ms/p':>9} {'vs dense':>8} {'passes':>6} {'f':>5} {'acc':>6} {'ident':>6}")
    for r in rows:
        print(f"{r['label']:>18} {r['cpu_ms_per_pass']:>9.2f} {r['speedup']:>8.2f} {r['passes']:>6} "
              f"{r['fresh_frac']:>5.2f} {r['accuracy']:>6.3f} {r['identical']:>6.2f}", flush=True)
    md_dir = os.path.dirname(os.path.abspath(a.write_benchmarks or os.path.join(ROOT, "BENCHMARKS.md")))
    png_rel = os.path.relpath(os.path.abspath(a.png), md_dir) if a.png else None
    meta = {"model": a.model, "batch": a.batch, "repeats": a.repeats, "machine": machine,
            "minutes": (time.perf_counter() - t0) / 60, "png": png_rel,
            "command": ".venv/bin/python benchmarks/epoch_quality.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])}
    if a.png:
        plot(rows, a.png, f"{a.model}: accuracy vs CPU time per pass, batch {a.batch} ({platform.machine()})")
    if a.json:
        _write_atomic(a.json, json.dumps({**meta, "rows": rows}, indent=1))
    if a.write_benchmarks:
        write_section(a.write_benchmarks, markdown(rows, meta), f"{SECTION_PREFIX} `{a.model}`")
        print(f"wrote the section of {a.write_benchmarks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
