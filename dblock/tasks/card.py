"""Model cards of the bundled tiny models: `MODEL_CARD.md` (for people) and `card.json` (for code and tests).

    dblock model-card --model DIR --train-summary RUN/train_summary.json [--train-summary RUN2/...] --n 200 \
        [--also-schedule oba]

evaluates DIR on the held-out split (`dblock.tasks.evaluate.evaluate`, reference executor, the family's default
decoding; with `--also-schedule S` once more under schedule S) and writes both files into DIR, plus
`loss_curve.png` (training loss over every stage's steps, and the held-out accuracy measured during training).
A recipe of several stages (a later one started with `train-tiny --init-from` the earlier one's folder) gives one
`--train-summary` per stage, in order. Every number in the card is computed here from the training summaries and
the evaluations; nothing is typed by hand. `card.json["eval_command"]` is the command that reproduces the
accuracy line, and `tests/tasks/test_model_cards.py` re-runs it on the bundled models and compares.

`task_of(folder)` reads the task a bundled model was trained on, so `dblock eval`, the demo and the benchmarks
default to it.
"""
from __future__ import annotations

import json
import os
import platform
import re
from typing import Optional

import torch

CARD_JSON = "card.json"
SUBSET_N = 24          # the regression subset: the first test problems, per-request results kept in the card
CARD_MD = "MODEL_CARD.md"


def _read_json(path: str):
    """The JSON in `path`, None when there is no such file; invalid JSON is a ValueError naming the file."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def read_card(folder: str) -> Optional[dict]:
    return _read_json(os.path.join(folder, CARD_JSON))


def _folder_of(model) -> Optional[str]:
    """The folder of a model folder or bundled name, None when `model` is neither (the command reports that when it
    loads)."""
    from dblock.errors import WeightsError
    from dblock.weights_path import resolve_model_path
    try:
        return resolve_model_path(model)
    except WeightsError:
        return None


def _card_of(model) -> dict:
    """The card of a (bundled) model, {} when it has none or `model` is not a folder nor a bundled name."""
    folder = _folder_of(model)
    return (read_card(folder) or {}) if folder else {}


def task_of(model: str, default: str = "arith") -> str:
    """The task a model was trained on: its card's, else the `train-tiny` run's (`train_summary.json` beside the
    weights, as a run folder or its export holds it); `default` when it has neither. A summary that is not what
    train-tiny writes is one ValueError naming the file and the key."""
    card = _card_of(model)
    if "task" in card:
        return card["task"]
    return _summary_task(model) or default


def _summary_task(model) -> Optional[str]:
    folder = _folder_of(model)
    path = os.path.join(folder, "train_summary.json") if folder else None
    summary = _read_json(path) if path else None
    if summary is None:
        return None
    task = summary.get("config", {}).get("task") if isinstance(summary, dict) and isinstance(
        summary.get("config"), dict) else None
    if not isinstance(task, str) or not task:
        raise ValueError(f"{path}: config.task must be a task name (a non-empty string), got {task!r}")
    return task


def decoding_of(model) -> dict:
    """The decoding defaults a model's card sets (`card.json["decoding"]`, e.g. `{"threshold_steps": 8}`), {} when
    it sets none or `model` is not a folder or bundled name. The commands apply them where no flag overrides."""
    return {} if model is None else dict(_card_of(model).get("decoding") or {})


def _public_command(reproduce: str, name: str) -> str:
    """The training command with the run's private output folder replaced by a placeholder."""
    return re.sub(r"--out \S+", f"--out runs/{name}", reproduce)


def _stage(summary: dict, name: str) -> dict:
    return {"command": _public_command(summary["reproduce"], name), "steps": summary["steps_done"],
            "wall_min": round(summary["wall_s"] / 60.0, 1),
            "init_from": summary["config"].get("init_from"), "task": summary["config"]["task"],
            "final_eval": ({"n": summary["config"].get("eval_n"), **summary["evals"][-1]}
                           if summary.get("evals") else None)}


def build_card(name: str, summary, result: dict, n: int, extra: Optional[dict] = None,
               eval_task: Optional[str] = None) -> dict:
    """The card's numbers. `summary`: the training summary, or the list of a recipe's stage summaries in order
    (the last stage made the weights); `extra`: {schedule: (eval command, its result)} of further evaluations;
    `eval_task`: the evaluated task (default: the last stage's), the card's `task` -- what `task_of` and the demo
    use."""
    stages = summary if isinstance(summary, list) else [summary]
    last = stages[-1]
    cfg = dict(last["config"])
    train_task = cfg["task"]
    cfg["task"] = eval_task or train_task
    final = last.get("final", {})
    hist = last.get("history", [])
    curve = [{k: h[k] for k in ("step", "loss", "acc") if k in h} for h in hist[:: max(1, len(hist) // 10)]]
    if hist and (not curve or curve[-1].get("step") != hist[-1].get("step")):
        curve.append({k: hist[-1][k] for k in ("step", "loss", "acc") if k in hist[-1]})
    stage_names = [f"{name}-stage{i + 1}" for i in range(len(stages) - 1)] + [name]
    keys = ("n", "split", "schedule", "decode", "accuracy", "accuracy_by_kind", "Y", "K", "F", "TPF",
            "passes_per_block_mean", "passes_per_block_mean_by_kind", "passes_per_block_hist",
            "blocks_per_answer_mean", "eos_rate", "accuracy_by_grade", "metrics")
    card = {
        "name": name,
        "family": cfg["family"],
        "size": cfg["size"],
        "params": last["params"],
        "task": cfg["task"],
        "train_task": train_task,
        "task_description": _describe_task(cfg),
        "block_size": cfg["block_size"],
        "train_command": _public_command(last["reproduce"], name),
        "train_steps": last["steps_done"],
        "train_wall_min": round(sum(st["wall_s"] for st in stages) / 60.0, 1),
        "train_stages": [_stage(st, nm) for st, nm in zip(stages, stage_names)],
        "train_threads": cfg.get("threads", 1),
        "train_final": final,
        "train_curve": curve,
        "expert_balance": last.get("expert_balance_ema"),
        "eval_command": f"dblock eval --model {name} --task {cfg['task']} --n {n}",
        "eval": {k: result[k] for k in keys if k in result},
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}, torch {torch.__version__}",
        "train_config": {k: cfg.get(k) for k in ("window", "batch_size", "lr", "fused_attention", "save_dtype",
                                                 "noisy_context", "suffix_mask") if k in cfg},
    }
    for i, st in enumerate(card["train_stages"][1:], 1):        # a later stage starts from the earlier one's folder
        st["command"] = re.sub(r"--init-from \S+", f"--init-from runs/{stage_names[i - 1]}", st["command"])
    card["train_command"] = card["train_stages"][-1]["command"]
    if extra:
        card["eval_schedules"] = {sched: {"command": cmd, **{k: r[k] for k in keys if k in r}}
                                  for sched, (cmd, r) in extra.items()}
    return card


def _describe_task(cfg: dict) -> dict:
    from dblock.tasks import get_task
    kw = {k: tuple(cfg[k]) for k in ("add_digits", "rev_len", "div_digits") if cfg.get(k)}
    return get_task(cfg["task"], **kw).describe()


def plot_curve(stages: list, path: str) -> None:
    """loss_curve.png: the training loss of every stage over cumulative steps (log scale) and the held-out accuracy
    measured during training (`--eval-every`), stage boundaries marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    ax2 = ax.twinx()
    off = 0
    for i, st in enumerate(stages):
        h = st.get("history", [])
        ax.plot([off + x["step"] for x in h], [x["loss"] for x in h], color="tab:blue", lw=0.8,
                label="training loss" if i == 0 else None)
        ev = st.get("evals") or []
        ax2.plot([off + x["step"] for x in ev], [x["accuracy"] for x in ev], "o-", color="tab:red", ms=3,
                 label="held-out accuracy (the stage's task)" if i == 0 else None)
        off += st["steps_done"]
        if i < len(stages) - 1:
            ax.axvline(off, color="grey", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step (all stages)")
    ax.set_ylabel("loss")
    ax2.set_ylabel("accuracy")
    ax2.set_ylim(0, 1)
    fig.legend(loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout()
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def _is_code(card: dict) -> bool:
    return card["task"].partition(":")[0] == "code"


def _is_exec(card: dict) -> bool:
    return card["task"].partition(":")[0] == "exec"


def _exec_data_text(card: dict) -> str:
    d = card.get("task_description") or {}
    its = d.get("iterations", {})
    if d.get("body"):
        return _one_program_text(card, d, its)
    return ("Generated from a seed, no download: the `exec` task (`dblock/tasks/exec_task.py`), \"what does this "
            "program print?\". A prompt is a short Python program of the generator's own grammar: "
            f"{' or '.join(str(v) for v in d.get('variables', []))} variables set from literals, an optional list of "
            "ten digits, a `print` of the state, then a `for` loop of "
            + ", ".join(f"{a}..{b} iterations ({k} variables)" for k, (a, b) in its.items())
            + " whose body updates each variable once (`(x+y)%10`, `(x-y)%10`, `(x*y)%10`, `x//k`, `x%k`, `L[x]`, "
            "or `if x>y:` / `else:` between two of them) and prints the state. The answer is what the program "
            "prints (found by running it in-process), one line per state, every value a digit: each line depends on "
            "the line before, so the values form dependency chains as long as the loop. Programs whose trace repeats "
            f"a state within its first {d.get('distinct_states', '?')} lines are redrawn. Character tokenizer "
            f"(vocabulary {card.get('vocab_size', '?')}; `transformers.AutoTokenizer` loads `tokenizer.json`). "
            f"Split: {d.get('split', '?')}. " + _exec_metrics_text(card))


def _exec_metrics_text(card: dict) -> str:
    """The Metrics sentence of an exec card's Data paragraph."""
    return ("Metrics: the whole answer exact (the task's accuracy), the share of printed values right (position by "
            "position) and the model's held-out loss per token "
            + ("(its canvas cross-entropy under uniform noise)" if card.get("family") == "diffusion_gemma" else
               "(its masked-diffusion training loss on the reference answer, an upper bound on the NLL)")
            + "; 95% bootstrap CIs over problems")


def _one_program_text(card: dict, d: dict, its: dict) -> str:
    """The Data paragraph of an exec grammar of one loop body (`exec_task.ONE_PROGRAM`, or `WITH_SET`: the same
    body, each program with its own list L)."""
    (k, (lo, hi)), = its.items()
    call = "f(" + ",".join("abcd"[:int(k)]) + ")" if str(k) in "1234" else "f(...)"
    many = d.get("calls", 1) > 1
    body = "; ".join(f"`{ln}`" for ln in d["body"])
    listed = d.get("set_size")
    split = (f"Split: {d.get('split', '?')}." if listed else
             f"Split: {d.get('split', '?')}: as the programs differ only in their call" + ("s" if many else "")
             + " and loop length, the held-out problems are those " + ("whose every call starts from one " if many
             else "") + f"of {d.get('held_out_starts', '?')} of the {d.get('starts', 1000):,} initial states, never a training "
             "program's start (a held-out state can still occur inside a training trace, since every trace walks "
             "through other states); the evaluation draws distinct programs.")
    return ("Generated from a seed, no download: the `exec` task (`dblock/tasks/exec_task.py`), \"what does this "
            f"program print?\", grammar `{d.get('grammar')}`: every prompt is "
            + (f"a list `L` of {listed} distinct digits drawn per program and " if listed else "")
            + f"one fixed function of {k} variables -- "
            f"`print` the state, then a `for` loop whose body is {body}, printing the state after each iteration -- "
            + (f"called {d['calls']} times, each call with its own {k} digits (`{call}`, distinct initial states), "
               f"and a loop of {lo}..{hi} iterations. The answer is what it prints (found by running it in-process): "
               f"{d['calls']} traces one after another, each independent of the one before it, one line per state, "
               "every value a digit. " if many else
               f"called with {k} digits (`{call}`) and a loop of {lo}..{hi} iterations. The answer is what it "
               "prints (found by running it in-process), one line per state, every value a digit. ")
            + f"{d.get('structure', '')} "
            "Programs whose trace "
            f"repeats a state within its first {d.get('distinct_states', '?')} lines are redrawn. Character tokenizer "
            f"(vocabulary {card.get('vocab_size', '?')}; `transformers.AutoTokenizer` loads `tokenizer.json`). "
            + split + " " + _exec_metrics_text(card))


def _exec_eval_lines(e: dict) -> str:
    m = e.get("metrics", {})

    def metric(k, label):
        if k not in m:
            return ""
        x = m[k]
        return f"- {label} **{x['mean']:.3f}** (95% CI {x['ci'][0]:.3f}..{x['ci'][1]:.3f}, {x['n']} problems)\n"
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in e["accuracy_by_kind"].items())
    hist = " ".join(f"{k}:{v}" for k, v in e["passes_per_block_hist"].items())
    grades = "; ".join(f"{k} " + " ".join(f"{g}:{r}/{n}" for g, (r, n) in by.items())
                       for k, by in e.get("accuracy_by_grade", {}).items())
    return (metric("answer_exact", "whole answer exact") + f"  (by kind: {kinds}; right/problems by loop length: "
            f"{grades})\n"
            + metric("value_accuracy", "printed values right")
            + metric("loss_per_token", "held-out loss per token (nats)")
            + f"- tokens Y={e['Y']}, blocks K={e['K']}, passes F={e['F']}, tokens per forward TPF={e['TPF']:.3f}\n"
            f"- passes per block: mean **{e['passes_per_block_mean']:.2f}**; blocks per answer "
            f"{e['blocks_per_answer_mean']:.2f}\n"
            f"- passes-per-block histogram (passes:blocks): {hist}")


def _render_exec(card: dict, fam: str, curve: str, png: str) -> str:
    e = card["eval"]
    dec = e["decode"]
    rule = (f"threshold τ = {dec['threshold']} with no step cap" if dec["rule"] == "threshold" and
            not dec.get("threshold_steps") else dec["rule"] + (f", N = {dec['steps']} steps per block"
                                                              if dec.get("steps") else ""))
    return f"""# {card['name']}

A small {card['family']} model bundled with dblock: {fam}, trained to execute short Python programs.
{card['params']:,} parameters, size `{card['size']}`, block size {card['block_size']}, character tokenizer
(vocabulary {card.get('vocab_size', '?')}). It exists so that Epoch's and One Block Ahead's claims are measured on a
model that does its task: it is sure of each printed value once the values it depends on are decoded, and the
answers' dependency chains make a block live many passes -- what can be computed now is committed now, the rest
waits, as LLaDA2.0 decodes GSM8K.

## Data

{_exec_data_text(card)}.

## Training

{_training_text(card)}
{png}
| step (last stage) | loss | token accuracy (noised positions) |
|---|---|---|
{curve}

## Evaluation (held-out split, reference executor, the card's default decoding: block {card['block_size']}, {rule}, \
{dec['max_new_tokens']} new tokens)

    {card['eval_command']}

{_exec_eval_lines(e)}

{_schedules_text(card)}{_schedules_table(card)}{_atlas_text(card)}`card.json` holds these numbers; `tests/tasks/test_model_cards.py` re-runs the evaluation commands and checks them.
"""


def _code_data_text(card: dict) -> str:
    from dblock.tasks.code import CONTEXT_CHARS, TOKEN_N
    from dblock.tasks.code_corpus import SYMPY_VERSION, TEST_FRACTION, corpus_files
    n_train, n_test = len(corpus_files("train")), len(corpus_files("test"))
    cfg = card.get("train_config", {})
    return (f"The Python sources of sympy {SYMPY_VERSION}, the package torch installs (read where pip put it at run "
            f"time; nothing is downloaded or copied; BSD licence), split by file: a file is held out iff SHA-256 of "
            f"its path falls in the lowest {TEST_FRACTION} of the hash range ({n_train} train files, {n_test} "
            "held-out; `dblock/tasks/code_corpus.py`). Tokenizer: a byte-level BPE trained on the train split with "
            f"the `tokenizers` library, vocabulary {card.get('vocab_size', '?')}, `<pad> <eos> <bos> <mask>` first "
            "(`tokenizer.json`; `transformers.AutoTokenizer` loads the folder). Training examples are windows of "
            f"{cfg.get('window', '?')} tokens starting at line starts of train files (files drawn by length; "
            f"`<eos>` after a file's end), {_code_objective_text(card)}."
            "\n\nEvaluation: the `code` task (`dblock/tasks/code.py`), held-out completion problems cut at a "
            "line end of a held-out file -- after a function's signature and docstring (`body`) or after the header "
            f"of a compound statement (`block`), the two kinds alternating -- with up to {CONTEXT_CHARS} characters "
            "of whole preceding lines as the prompt and the file's continuation as the reference. Metrics: the next "
            f"line exact (the task's accuracy), token accuracy over the first {TOKEN_N} generated tokens, and the "
            "model's held-out loss per token (" + (
                "its canvas cross-entropy on the reference continuation under uniform noise at a random level"
                if card.get("family") == "diffusion_gemma" else
                "its masked-diffusion training loss on the reference continuation, an upper bound on the NLL") +
            "); 95% bootstrap CIs over problems")


def _code_objective_text(card: dict) -> str:
    """How a code model's windows are trained, by family (docs/models.md, "The bundled code models")."""
    if card.get("family") == "diffusion_gemma":
        p = card.get("train_config", {}).get("noisy_context")
        noisy = (f"; with probability {p} an example's predecessor canvas is partly re-noised in the encoder input, "
                 "so the next canvas learns to denoise behind a still-noisy block, the view of One Block Ahead's "
                 "warm-up block" if p else "")
        window = card.get("train_config", {}).get("window")
        half = window // 2 if window else "L/2"         # `train_data.code_rows_for_step`: P uniform in [1, L/2]
        return (f"each window cut at a prompt length P uniform in [1, {half}] and trained as whole canvases after P: "
                "every canvas token replaced by a uniform vocabulary draw with probability t ~ U(0, 1), the decoder "
                "predicting the clean canvas from the encoder's clean prefix, with self-conditioning" + noisy)
    return ("every block noised and predicted from the clean blocks before it, the rows of one block before a random "
            "prompt end kept clean (the block that holds a prompt's tail at decoding time)")


def _task_text(card: dict) -> str:
    d = card.get("task_description")
    if not d:
        return f"`{card['task']}` from `dblock.tasks`"
    total = sum(d["mix"].values())
    kinds = ", ".join(f"`{k}` {100 * w / total:.0f}% (sizes {d['sizes'][k][0]}..{d['sizes'][k][1]})"
                      for k, w in d["mix"].items() if w > 0)
    trained = card.get("train_task", card["task"])
    mix = (f". The last training stage drew its problems from `{trained}`: the same problems and split, other kind "
           "weights" if trained != card["task"] else "")
    return (f"`{card['task']}` from `dblock.tasks` (answer style `{d['style']}`, see `dblock/tasks/arith.py`): "
            f"{kinds}{mix}. Split: {d['split']}")


def _training_text(card: dict) -> str:
    stages = card.get("train_stages") or [{"command": card["train_command"], "steps": card["train_steps"],
                                           "wall_min": card["train_wall_min"]}]
    if len(stages) == 1:
        head = f"    {stages[0]['command']}\n\n{stages[0]['steps']} optimizer steps in {stages[0]['wall_min']} minutes"
    else:
        lines = []
        for i, st in enumerate(stages, 1):
            ev = st.get("final_eval")
            acc = (f"; held-out accuracy at its end {ev['accuracy']:.2f} on {ev.get('n', '?')} problems of its task "
                   f"`{st.get('task', card['task'])}`" if ev else "")
            lines.append(f"Stage {i}: {st['steps']} steps, {st['wall_min']} minutes{acc}\n\n    {st['command']}")
        head = "\n\n".join(lines) + f"\n\n{sum(st['steps'] for st in stages)} optimizer steps in " \
                                     f"{card['train_wall_min']} minutes in all"
    notes = "".join(f"\n\n{note}" for note in card.get("notes", []))
    return (f"{head} on {card['machine']} ({card['train_threads']} torch thread). The same commands on the same "
            f"torch build and thread count give bit-identical weights{', except as noted below' if notes else ''}. "
            "Final training batch: "
            f"{json.dumps(card['train_final'])}.{notes}")


def _eval_lines(e: dict) -> str:
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in e["accuracy_by_kind"].items())
    pk = ", ".join(f"{k} {v:.2f}" for k, v in e.get("passes_per_block_mean_by_kind", {}).items())
    hist = " ".join(f"{k}:{v}" for k, v in e["passes_per_block_hist"].items())
    grades = "; ".join(f"{k} " + " ".join(f"{g}:{r}/{n}" for g, (r, n) in by.items())
                       for k, by in e.get("accuracy_by_grade", {}).items())
    grade_line = f"\n- right/problems by kind and length (digits:right/n): {grades}" if grades else ""
    return f"""- accuracy **{e['accuracy']:.3f}** over {e['n']} problems ({kinds}){grade_line}
- tokens Y={e['Y']}, blocks K={e['K']}, passes F={e['F']}, tokens per forward TPF={e['TPF']:.3f}, EOS rate \
{e['eos_rate']:.3f}
- passes per block: mean {e['passes_per_block_mean']:.2f} ({pk}); blocks per answer {e['blocks_per_answer_mean']:.2f}
- passes-per-block histogram (passes:blocks): {hist}"""


def _code_eval_lines(e: dict) -> str:
    m = e.get("metrics", {})

    def metric(k, label, fmt="{:.3f}"):
        if k not in m:
            return ""
        x = m[k]
        return (f"- {label} **{fmt.format(x['mean'])}** (95% CI {fmt.format(x['ci'][0])}..{fmt.format(x['ci'][1])}, "
                f"{x['n']} problems)\n")
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in e["accuracy_by_kind"].items())
    hist = " ".join(f"{k}:{v}" for k, v in e["passes_per_block_hist"].items())
    return (metric("next_line_exact", "next line exact") + f"  (by kind: {kinds})\n"
            + metric("token_accuracy", "token accuracy, first 32 tokens")
            + metric("loss_per_token", "held-out loss per token (nats)")
            + f"- tokens Y={e['Y']}, blocks K={e['K']}, passes F={e['F']}, tokens per forward TPF={e['TPF']:.3f}\n"
            f"- passes per block: mean **{e['passes_per_block_mean']:.2f}**; blocks per answer "
            f"{e['blocks_per_answer_mean']:.2f}\n"
            f"- passes-per-block histogram (passes:blocks): {hist}")


def _atlas_text(card: dict) -> str:
    a = card.get("atlas")
    if not a:
        return ""
    E = a["experts"]
    per = "; ".join(f"layer {ly['layer']}: {ly['support_mean']:.1f} [{ly['support_min']}, {ly['support_max']}]"
                    for ly in a["layers"] if ly["support_mean"] is not None)
    same, reqs = a["identical_outputs"]
    if not a["builds"]:
        return f"""## Expert Atlas (Epoch executor, the card's subset)

    {a['command']}

- no support builds: the start set B = {a['B']} holds every one of the E = {E} experts, so the Atlas is inert on this
  model; decision agreement with the reference shadow {100 * a['decision_agreement']:.2f}%; identical outputs end to
  end {same}/{reqs}

"""
    return f"""## Expert Atlas (Epoch executor, the card's subset)

    {a['command']}

- support builds {a['builds']}, coverage quota met on **{100 * a['quota_met']:.1f}%** of them; mean support
  **{a['support_mean']:.1f} of E = {E} experts** ({100 * a['support_mean'] / E:.0f}%; start set B = {a['B']}), per layer
  mean [min, max]: {per}
- rows routed outside their support: {a['routed_outside_support']}; decision agreement with the reference shadow
  {100 * a['decision_agreement']:.2f}%; identical outputs end to end {same}/{reqs}
{_hot_text(a)}
"""


def _hot_text(a: dict) -> str:
    h = a.get("hot") or {}
    if not h.get("rows"):
        return ""
    return (f"- hot passes: {h['rows']} fresh rows routed within a support; {h['under']} "
            f"(**{100 * h['under'] / h['rows']:.1f}%**) kept less than α of their own top-K mass and were routed "
            f"with every expert (per-token fail-closed, docs/algorithms.md §4.2); the quota (1 − q)·N held on "
            f"**{100 * h['calls_within_quota'] / max(h['calls'], 1):.1f}%** of {h['calls']} (layer, block) hot "
            f"calls; the support those calls routed within: mean **{h.get('support_sum', 0) / max(h['calls'], 1):.1f}"
            f"** of E = {a['experts']} (the hot repair added {h.get('repaired_experts', 0)} experts)\n")


def _schedules_text(card: dict) -> str:
    out, base = [], card["eval"]
    for sched, e in (card.get("eval_schedules") or {}).items():
        gain = e["TPF"] / base["TPF"] - 1.0
        out.append(f"""### Schedule `{sched}`

    {e['command']}

{_eval_lines(e)}
- against the default schedule above: TPF {100 * gain:+.1f}%, accuracy {100 * (e['accuracy'] - base['accuracy']):+.1f} \
points
""")
    return "\n".join(out) + ("\n" if out else "")


def render_markdown(card: dict) -> str:
    e = card["eval"]
    curve = "\n".join(f"| {c.get('step')} | {c.get('loss')} | {c.get('acc')} |" for c in card["train_curve"])
    fam = {"llada2_moe": "masked block diffusion (LLaDA2.0 architecture: MoE with shared expert, sigmoid routing "
                         "with expert bias, group-limited top-k), trained with the BD3-LM block-causal objective",
           "diffusion_gemma": "uniform-state block diffusion with self-conditioning (DiffusionGemma architecture: "
                              "causal encoder + canvas decoder sharing weights, softmax router, sliding and full "
                              "attention layers)"}.get(card["family"], card["family"])
    png = "\n![training loss and held-out accuracy](loss_curve.png)\n" if card.get("train_stages") else ""
    if _is_code(card):
        return _render_code(card, fam, curve, png)
    if _is_exec(card):
        return _render_exec(card, fam, curve, png)
    return f"""# {card['name']}

A tiny {card['family']} model bundled with dblock: {fam}.
{card['params']:,} parameters, size `{card['size']}`, block size {card['block_size']}, character tokenizer
(vocabulary 32). It exists so that decoding dynamics (confidence rising, blocks living several passes, routing with
structure) are real when Epoch and One Block Ahead are measured on a CPU. It is not a language model.

## Data

{_task_text(card)}. Generated from a seed, no download; every answer ends with `<eos>`.

## Training

{_training_text(card)}
{png}
| step (last stage) | loss | token accuracy (noised positions) |
|---|---|---|
{curve}

## Evaluation (held-out split, reference executor, the family's default decoding)

    {card['eval_command']}

{_eval_lines(e)}

{_schedules_text(card)}{_weak_note(e)}`card.json` holds these numbers; `tests/tasks/test_model_cards.py` re-runs the evaluation commands and checks them.
"""


def _render_code(card: dict, fam: str, curve: str, png: str) -> str:
    e = card["eval"]
    return f"""# {card['name']}

A small {card['family']} model bundled with dblock: {fam}, trained on Python source.
{card['params']:,} parameters, size `{card['size']}`, block size {card['block_size']}, byte-level BPE tokenizer
(vocabulary {card.get('vocab_size', '?')}). It exists so that Epoch's and One Block Ahead's claims are measured on a
model whose blocks live many passes, as a real diffusion LM's do on code: some positions are certain early (syntax,
indentation, closing brackets), others are not (names, literals). It completes Python; it is not a useful coding
assistant.

## Data

{_code_data_text(card)}.

## Training

{_training_text(card)}
{png}
| step (last stage) | loss | token accuracy (noised positions) |
|---|---|---|
{curve}

## Evaluation (held-out split, reference executor, the card's default decoding: block {card['block_size']}, \
{e['decode']['rule']}{f" τ = {e['decode']['threshold']}" if e['decode']['rule'] == 'threshold' else ''}\
{f", LLaDA2.0's steps S = {e['decode']['threshold_steps']}" if e['decode'].get('threshold_steps') else ''}\
{f", N = {e['decode']['steps']} steps per block" if e['decode'].get('steps') else ''}, \
{e['decode']['max_new_tokens']} new tokens)

    {card['eval_command']}

{_code_eval_lines(e)}

{_alone_text(card)}{_schedules_text(card)}{_schedules_table(card)}{_atlas_text(card)}`card.json` holds these numbers; `tests/tasks/test_model_cards.py` re-runs the evaluation commands and checks them.
"""


def _alone_text(card: dict) -> str:
    """The threshold rule alone beside the card's default (LLaDA2.0's steps S over it), and why S is the default."""
    a = card.get("eval_threshold_alone")
    if not a:
        return ""
    S, d = card["decoding"]["threshold_steps"], card["eval"]
    C = card["block_size"]
    m, ma = d.get("metrics", {}), a.get("metrics", {})

    def q(mm, k):
        x = mm.get(k)
        return f"{x['mean']:.3f} [{x['ci'][0]:.3f}, {x['ci'][1]:.3f}]" if x else "-"
    overlap = all(k in m and k in ma and m[k]["ci"][0] <= ma[k]["ci"][1] and ma[k]["ci"][0] <= m[k]["ci"][1]
                  for k in ("token_accuracy", "next_line_exact"))
    return (f"**Why S = {S}.** `card.json[\"decoding\"]` sets LLaDA2.0's steps S = {S} over τ: each pass commits the "
            f"positions above τ and at least {C // S} of the block (the most confident), so a block lives at most "
            f"{S} passes. Every dblock command applies it to this model unless a flag says otherwise "
            f"(`--threshold-steps 0`: τ alone). The reason is this model's confidence: trained for a few CPU hours, "
            f"it rarely puts 0.95 on a token, and with τ alone a block lives "
            f"{a['passes_per_block_mean']:.1f} passes (TPF {a['TPF']:.2f}) against "
            f"{d['passes_per_block_mean']:.1f} (TPF {d['TPF']:.2f}) with S = {S}, "
            f"{'at the same quality within the CIs' if overlap else 'and the quality differs beyond the CIs'} "
            f"(token accuracy {q(ma, 'token_accuracy')} alone, {q(m, 'token_accuracy')} with S; next line exact "
            f"{q(ma, 'next_line_exact')} and {q(m, 'next_line_exact')}):\n\n    {a['command']}\n\n")


def _weak_note(e: dict) -> str:
    weak = [k for k, v in e["accuracy_by_kind"].items() if v < 0.5]
    if not weak:
        return ""
    return (f"The model is weak on {', '.join(weak)} (accuracy below 0.5) after its CPU training budget. Those "
            "problems still exercise the executors the same way: the equivalence suite and the schedule comparisons "
            "compare decoded tokens, whatever their truth, and they are the long, hesitant blocks (more passes per "
            "block) that early finishing and warm-up blocks are about.\n\n")


def _schedules_table(card: dict) -> str:
    sc = card.get("schedules")
    if not sc:
        return ""

    def f(v, fmt="{:.2f}"):
        if v is None:
            return "-"
        if isinstance(v, (list, tuple)):
            return f"{fmt.format(v[0])}..{fmt.format(v[1])}"
        return fmt.format(v)
    answer = any(r.get("answer_token_accuracy") is not None for r in sc["rows"])
    lines = ["| schedule | TPF | TPF vs Native (95% CI) | r | α (95% CI) | α − (r − 1) | next line exact | token accuracy "
             "| Δ token accuracy vs Native (95% CI) |" + (" whole-answer token accuracy | Δ vs Native (95% CI) |"
                                                         if answer else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if answer else "")]
    for r in sc["rows"]:
        lines.append(f"| {r['schedule']} | {f(r['TPF'])} | {f(r['TPF_ratio'])} ({f(r['TPF_ratio_ci'])}) | {f(r['r'])} "
                     f"| {f(r['alpha'])} ({f(r['alpha_ci'])}) | {f(r['margin'])} | {f(r['accuracy'], '{:.3f}')} "
                     f"| {f(r['token_accuracy'], '{:.3f}')} | {f(r.get('token_accuracy_delta_ci'), '{:+.3f}')} |" +
                     (f" {f(r.get('answer_token_accuracy'), '{:.3f}')} | "
                      f"{f(r.get('answer_token_accuracy_delta_ci'), '{:+.3f}')} |" if answer else ""))
    return f"""## Schedules (compare-schedules: the same problems and seeds for every schedule)

    {sc['command']}

{chr(10).join(lines)}

α: passes saved per warm-up step, fitted by Eq. 6 of docs/algorithms.md §6.1 on the counters (Eq. 5, which keeps the
(−α)^K terms, where Eq. 6 has no root), with a paired
bootstrap CI over requests; r: a schedule's pass over Native's on the same rows on this CPU (thread time).
{_seeds_note(card)}
"""


def _seeds_note(card: dict) -> str:
    """Why the table's Native row and the evaluation above can differ on a sampling model: other noise draws."""
    if card.get("family") != "diffusion_gemma":
        return ""
    return ("The table decodes problem i with seed i (compare-schedules' protocol), the evaluation above every "
            "problem with seed 0: on this uniform-state model those are other noise draws, so the two Native results "
            "can differ by more than the evaluation's CI, which resamples problems, not draws. Compare schedules "
            "within the table, where every schedule decodes the same (problem, seed) requests.\n")
