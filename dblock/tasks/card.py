"""Model cards of the bundled tiny models: `MODEL_CARD.md` (for people) and `card.json` (for code and tests).

    dblock model-card --model DIR --train-summary RUN/train_summary.json --task arith-small --n 200

evaluates DIR on the held-out split (`dblock.tasks.evaluate.evaluate`, reference executor, the family's default
decoding) and writes both files into DIR. Every number in the card is computed here from the training summary
and the evaluation; nothing is typed by hand. `card.json["eval_command"]` is the command that reproduces the
accuracy line, and `tests/tasks/test_model_cards.py` re-runs it on the bundled models and compares.

`task_of(folder)` reads the task a bundled model was trained on, so `dblock eval`, the demo and the benchmarks
default to it.
"""
from __future__ import annotations

import json
import os
import platform
import re
from typing import Callable, Optional

import torch

CARD_JSON = "card.json"
CARD_MD = "MODEL_CARD.md"


def read_card(folder: str) -> Optional[dict]:
    path = os.path.join(folder, CARD_JSON)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def task_of(model: str, default: str = "arith") -> str:
    """The task a (bundled) model was trained on, from its card; `default` when it has none."""
    from dblock.weights import WeightsError, resolve_model_path
    try:
        folder = resolve_model_path(model)
    except WeightsError:            # not a folder nor a bundled name: the command reports that when it loads
        return default
    return (read_card(folder) or {}).get("task", default)


def _public_command(reproduce: str, name: str) -> str:
    """The training command with the run's private output folder replaced by a placeholder."""
    return re.sub(r"--out \S+", f"--out runs/{name}", reproduce)


def build_card(name: str, summary: dict, result: dict, n: int) -> dict:
    cfg = summary["config"]
    final = summary.get("final", {})
    hist = summary.get("history", [])
    curve = [{k: h[k] for k in ("step", "loss", "acc") if k in h} for h in hist[:: max(1, len(hist) // 10)]]
    if hist and (not curve or curve[-1].get("step") != hist[-1].get("step")):
        curve.append({k: hist[-1][k] for k in ("step", "loss", "acc") if k in hist[-1]})
    return {
        "name": name,
        "family": cfg["family"],
        "size": cfg["size"],
        "params": summary["params"],
        "task": cfg["task"],
        "block_size": cfg["block_size"],
        "train_command": _public_command(summary["reproduce"], name),
        "train_steps": summary["steps_done"],
        "train_wall_min": round(summary["wall_s"] / 60.0, 1),
        "train_threads": cfg.get("threads", 1),
        "train_final": final,
        "train_curve": curve,
        "expert_balance": summary.get("expert_balance_ema"),
        "eval_command": f"dblock eval --model {name} --task {cfg['task']} --n {n}",
        "eval": {k: result[k] for k in ("n", "split", "schedule", "decode", "accuracy", "accuracy_by_kind", "Y", "K",
                                        "F", "TPF", "passes_per_block_mean", "passes_per_block_mean_by_kind",
                                        "passes_per_block_hist", "blocks_per_answer_mean", "eos_rate")
                 if k in result},
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}, torch {torch.__version__}",
    }


def render_markdown(card: dict) -> str:
    e = card["eval"]
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in e["accuracy_by_kind"].items())
    pk = ", ".join(f"{k} {v:.2f}" for k, v in e.get("passes_per_block_mean_by_kind", {}).items())
    hist = " ".join(f"{k}:{v}" for k, v in e["passes_per_block_hist"].items())
    curve = "\n".join(f"| {c.get('step')} | {c.get('loss')} | {c.get('acc')} |" for c in card["train_curve"])
    fam = {"llada2_moe": "masked block diffusion (LLaDA2.0 architecture: MoE with shared expert, sigmoid routing "
                         "with expert bias, group-limited top-k), trained with the BD3-LM block-causal objective",
           "diffusion_gemma": "uniform-state block diffusion with self-conditioning (DiffusionGemma architecture: "
                              "causal encoder + canvas decoder sharing weights, softmax router, sliding and full "
                              "attention layers)"}.get(card["family"], card["family"])
    return f"""# {card['name']}

A tiny {card['family']} model bundled with dblock: {fam}.
{card['params']:,} parameters, size `{card['size']}`, block size {card['block_size']}, character tokenizer
(vocabulary 32). It exists so that decoding dynamics (confidence rising, blocks finishing early, routing with
structure) are real when Epoch and One Block Ahead are measured on a CPU. It is not a language model.

## Data

`{card['task']}` from `dblock.tasks` (synthetic, generated from a seed, no download): half of the problems are
addition of two numbers (`add`), half are string reversal (`rev`); the answer ends with `<eos>`. Train and test
splits are disjoint by hash of the problem.

## Training

    {card['train_command']}

{card['train_steps']} optimizer steps in {card['train_wall_min']} minutes on {card['machine']}
({card['train_threads']} torch thread). The same command on the same torch build and thread count gives
bit-identical weights. Final training batch: {json.dumps(card['train_final'])}.

| step | loss | token accuracy (noised positions) |
|---|---|---|
{curve}

## Evaluation (held-out split, reference executor, the family's default decoding)

    {card['eval_command']}

- accuracy **{e['accuracy']:.3f}** over {e['n']} problems ({kinds})
- tokens Y={e['Y']}, blocks K={e['K']}, passes F={e['F']}, TPF={e['TPF']:.3f}, EOS rate {e['eos_rate']:.3f}
- passes per block: mean {e['passes_per_block_mean']:.2f} ({pk}); blocks per answer {e['blocks_per_answer_mean']:.2f}
- passes-per-block histogram (passes:blocks): {hist}

{_weak_note(e)}`card.json` holds these numbers; `tests/tasks/test_model_cards.py` re-runs the evaluation command and checks them.
"""


def _weak_note(e: dict) -> str:
    weak = [k for k, v in e["accuracy_by_kind"].items() if v < 0.5]
    if not weak:
        return ""
    return (f"The model is weak on {', '.join(weak)} (accuracy below 0.5) after its CPU training budget. Those "
            "problems still exercise the executors the same way: the equivalence suite and the schedule comparisons "
            "compare decoded tokens, whatever their truth, and they are the long, hesitant blocks (more passes per "
            "block) that early finishing and warm-up blocks are about.\n\n")


def write_card(folder: str, card: dict) -> None:
    """Write card.json and MODEL_CARD.md atomically (temp files, then rename)."""
    for fname, text in ((CARD_JSON, json.dumps(card, indent=1) + "\n"), (CARD_MD, render_markdown(card))):
        tmp = os.path.join(folder, f".{fname}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(folder, fname))


def make_card(model: str, summary_path: str, task: Optional[str], n: int, run_eval: Callable[[str], dict],
              name: Optional[str] = None) -> dict:
    """Evaluate `model` with `run_eval("dblock eval ...")` (the CLI's in-process runner) and write its card."""
    from dblock.weights import resolve_model_path

    folder = resolve_model_path(model)
    if not os.path.isfile(summary_path):
        raise FileNotFoundError(f"--train-summary {summary_path}: no such file (train-tiny writes "
                                "OUT/train_summary.json)")
    with open(summary_path) as f:
        summary = json.load(f)
    for key in ("config", "params", "reproduce", "steps_done", "wall_s"):
        if key not in summary:
            raise ValueError(f"{summary_path}: missing key {key!r}; is this a train-tiny summary?")
    task = task or summary["config"]["task"]
    if task != summary["config"]["task"]:
        raise ValueError(f"--task {task}: the model was trained on {summary['config']['task']!r}")
    name = name or os.path.basename(os.path.normpath(folder))
    cmd = f"dblock eval --model {folder} --task {task} --n {n}"
    r = run_eval(cmd)
    card = build_card(name, summary, r, n)
    write_card(folder, card)
    return card
