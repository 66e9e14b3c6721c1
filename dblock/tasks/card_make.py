"""Making a model card: `dblock model-card` runs the evaluations (each a `dblock ...` command line in a fresh
interpreter, `run_command`), gathers their numbers (`schedules_summary`, `atlas_summary`) and writes card.json,
MODEL_CARD.md and loss_curve.png into the model folder (`make_card`, `write_card`). What the card says and how it is
rendered is `dblock.tasks.card`."""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

from dblock.tasks.card import CARD_JSON, CARD_MD, SUBSET_N, build_card, plot_curve, render_markdown


def run_command(cmd: str) -> dict:
    """Run a `dblock ...` command line with --json in a fresh interpreter (exactly what the shell would run, one
    torch thread) and return its JSON; a failure is a RuntimeError with the command's last error line."""
    import shlex
    import subprocess
    import sys

    argv = shlex.split(cmd)
    if argv[0] != "dblock":
        raise ValueError(f"{cmd!r}: not a dblock command")
    p = subprocess.run([sys.executable, "-m", "dblock", "--threads", "1"] + argv[1:] + ["--json"],
                       capture_output=True, text=True)
    if p.returncode not in (0, 1):      # verify exits 1 when a check fails: its report still comes back
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{cmd}: exit {p.returncode}: {last}")
    out = p.stdout.strip()
    try:
        return json.loads(out)
    except json.JSONDecodeError:       # progress lines before a one-line JSON object
        return json.loads(out.splitlines()[-1])


SCHEDULE_KEYS = ("schedule", "TPF", "TPF_ratio", "TPF_ratio_ci", "TPS_ratio", "r", "beta", "n", "alpha", "alpha_ci",
                 "margin", "verdict", "accuracy", "accuracy_ci", "accuracy_delta_ci", "token_accuracy",
                 "token_accuracy_ci", "token_accuracy_delta_ci", "answer_token_accuracy", "answer_token_accuracy_ci",
                 "answer_token_accuracy_delta_ci", "R")


def schedules_summary(rows: list, command: str) -> dict:
    """The card's schedule table from `dblock compare-schedules --json` rows."""
    return {"command": command, "rows": [{k: r.get(k) for k in SCHEDULE_KEYS} for r in rows]}


def atlas_summary(rep: dict, command: str) -> dict:
    """The Expert Atlas numbers of a `dblock verify` report for the card: support sizes of the successful builds
    (each restricts routing on its block's hot passes until the next build), the share of builds that met the
    coverage quota, decision agreement and identical end-to-end outputs."""
    cov = rep["main"]["coverage"]
    layers = cov.get("layers", [])
    builds = sum(ly["builds"] for ly in layers)
    ok = sum(ly["success"] for ly in layers)
    sup = sum(ly["support_mean"] * ly["success"] for ly in layers if ly["support_mean"] is not None)
    e2e = rep.get("e2e") or {}
    return {"command": command, "experts": cov.get("experts"), "B": cov.get("B"), "builds": builds,
            "quota_met": ok / builds if builds else None, "support_mean": sup / ok if ok else None,
            "layers": [{k: ly[k] for k in ("layer", "builds", "success", "support_mean", "support_min",
                                           "support_max")} for ly in layers],
            "routed_outside_support": cov.get("routed_outside_support"),
            "decision_agreement": rep["main"]["decisions"]["agreement"], "hot": cov.get("hot") or {},
            "identical_outputs": [e2e.get("identical"), e2e.get("requests")]}


def write_card(folder: str, card: dict) -> None:
    """Write card.json and MODEL_CARD.md atomically (temp files, then rename)."""
    for fname, text in ((CARD_JSON, json.dumps(card, indent=1) + "\n"), (CARD_MD, render_markdown(card))):
        tmp = os.path.join(folder, f".{fname}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(folder, fname))


def make_card(model: str, summary_paths, task: Optional[str], n: int, run_eval: Callable[[str], dict],
              name: Optional[str] = None, also_schedules=(), notes=(), schedules_n: int = 0,
              schedules_batch: int = 16, threshold_steps: Optional[int] = None,
              steps: Optional[int] = None) -> dict:
    """Evaluate `model` with `run_eval("dblock eval ...")` (the CLI's in-process runner) and write its card and
    loss_curve.png. `summary_paths`: one train_summary.json, or one per stage of the recipe in order."""
    from dblock.tasks import base_task
    from dblock.weights_path import resolve_model_path

    folder = resolve_model_path(model)
    paths = [summary_paths] if isinstance(summary_paths, str) else list(summary_paths)
    summaries = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--train-summary {path}: no such file (train-tiny writes "
                                    "OUT/train_summary.json)")
        from dblock.input_files import read_json
        summary = read_json(path, "--train-summary")
        for key in ("config", "params", "reproduce", "steps_done", "wall_s"):
            if not isinstance(summary, dict) or key not in summary:
                raise ValueError(f"--train-summary {path}: missing key {key!r}; is this a train-tiny summary?")
        if not isinstance(summary["config"], dict) or not all(isinstance(summary["config"].get(k), str)
                                                              for k in ("family", "size", "task")):
            raise ValueError(f"--train-summary {path}: config lacks family, size or task")
        summaries.append(summary)
    last = summaries[-1]["config"]
    for path, sm in zip(paths[:-1], summaries[:-1]):
        if sm["config"]["family"] != last["family"] or sm["config"]["size"] != last["size"]:
            raise ValueError(f"--train-summary {path}: family/size {sm['config']['family']}/{sm['config']['size']}, "
                             f"the last stage's are {last['family']}/{last['size']}")
    task = task or last["task"]
    if base_task(task) != base_task(last["task"]):
        raise ValueError(f"--task {task}: the model was trained on {last['task']!r} (a card evaluates the training "
                         f"task or the same task with other kind weights, e.g. {base_task(last['task'])!r})")
    name = name or os.path.basename(os.path.normpath(folder))
    uniform = last["family"] == "diffusion_gemma"
    if threshold_steps and uniform or steps and not uniform:
        raise ValueError(f"--threshold-steps sets a masked model's default, --steps a uniform-state model's; "
                         f"{name} is {last['family']}")
    # the card's decoding, spelled out on the private commands (card.json, which carries it, is written last)
    dflag = ((f" --steps {steps}" if steps else "") if uniform else
             f" --threshold-steps {threshold_steps}" if threshold_steps else " --threshold-steps 0")
    r = run_eval(f"dblock eval --model {folder} --task {task} --n {n}{dflag}")
    extra = {}
    for sched in also_schedules:
        public = f"dblock eval --model {name} --task {task} --n {n} --schedule {sched}"
        extra[sched] = (public, run_eval(f"dblock eval --model {folder} --task {task} --n {n} --schedule {sched}"
                                         f"{dflag}"))
    card = build_card(name, summaries, r, n, extra, eval_task=task)
    if steps:
        card["decoding"] = {"steps": steps}
    if threshold_steps:
        card["decoding"] = {"threshold_steps": threshold_steps}
        alone = run_eval(f"dblock eval --model {folder} --task {task} --n {n} --threshold-steps 0")
        card["eval_threshold_alone"] = {"command": f"dblock eval --model {name} --task {task} --n {n} "
                                                   "--threshold-steps 0",
                                        **{k: alone[k] for k in ("TPF", "passes_per_block_mean", "metrics",
                                                                 "accuracy") if k in alone}}
    from dblock.config import load_config
    card["vocab_size"] = load_config(folder).vocab_size     # DiffusionGemma keeps it in text_config
    sub = run_eval(f"dblock eval --model {folder} --task {task} --n {SUBSET_N}{dflag}")
    card["subset"] = {"command": f"dblock eval --model {name} --task {task} --n {SUBSET_N}", "n": SUBSET_N,
                      "accuracy": sub["accuracy"], "correct": [bool(q["correct"]) for q in sub["requests"]]}
    if "metrics" in sub:     # code / exec: per-request token (value) accuracy and passes, and the means
        key = "value_accuracy" if base_task(task) == "exec" else "token_accuracy"
        card["subset"][key] = [q[key] for q in sub["requests"]]
        card["subset"]["passes"] = [q["passes"] for q in sub["requests"]]
        card["subset"]["metrics"] = sub["metrics"]
    if schedules_n:
        cmd = (f"dblock compare-schedules --model {{}} --task {task} --n {schedules_n} --batch-size "
               f"{schedules_batch}")
        card["schedules"] = schedules_summary(run_command(cmd.format(folder) + dflag), cmd.format(name))
    if base_task(task) in ("code", "exec") and last["family"] == "llada2_moe":
        cmd = f"dblock verify --model {{}} --task {task} --n {SUBSET_N} --no-probe"
        card["atlas"] = atlas_summary(run_command(cmd.format(folder) + dflag), cmd.format(name))
    if notes:
        card["notes"] = list(notes)
    plot_curve(summaries, os.path.join(folder, "loss_curve.png"))
    write_card(folder, card)
    return card
