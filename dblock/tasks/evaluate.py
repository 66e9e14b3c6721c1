"""Held-out evaluation of a model on a graded task (`dblock eval`, the demo and the benchmarks call `evaluate`).

Prompts are the task's test-split prompt texts encoded by the model folder's `tokenizer.json` through the
`tokenizers` library (the same path as a real checkpoint); answers are cut at the first EOS and graded exactly.
Counters follow docs/counters.md (from `GenerateResult.summary()`), plus the per-block statistics a schedule study
needs: the passes-per-block histogram, blocks per answer, tokens per block.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any, Optional, Sequence

from dblock.decoding.params import DecodeConfig


class TokenizerAdapter:
    """A `tokenizers.Tokenizer` (from a model folder's tokenizer.json) with the small API `answer_text` needs:
    `encode(text) -> ids`, `decode(ids, skip_special)`, `eos_id`."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        eos = hf_tokenizer.token_to_id("<eos>")
        if eos is None:
            raise ValueError("tokenizer.json has no <eos> token")
        self.eos_id = eos

    @classmethod
    def from_folder(cls, folder: str) -> "TokenizerAdapter":
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: the model folder has no tokenizer.json (needed to encode task prompts)")
        from dblock.tasks.tokenizer import read_tokenizer
        return cls(read_tokenizer(path))

    def encode(self, text: str, name: str = "text") -> list:
        """Token ids of `text`; a character the tokenizer cannot encode (a vocabulary without an unknown token:
        `tokenizers` raises a bare Exception) is one PromptError naming it and its position (`name`: the text's
        label)."""
        try:
            return self.hf.encode(text).ids
        except Exception as e:  # noqa: BLE001 - tokenizers' WordLevel error is a plain Exception
            from dblock.tasks.tokenizer import _unencodable
            raise _unencodable(text, lambda c: self.hf.encode(c).ids, (), name, {}, True, "",
                               (str(e).splitlines() or [type(e).__name__])[0]) from None

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def encode_task_prompts(adapter: "TokenizerAdapter", examples, task_name: str, model: str,
                        split: str = "test") -> list:
    """The examples' prompts as token ids; a prompt the model's tokenizer cannot spell is one TaskError naming the
    task, the model, the problem and the character (the model was not made for this task's text)."""
    from dblock.errors import PromptError, TaskError
    out = []
    for i, e in enumerate(examples):
        try:
            out.append(adapter.encode(e.prompt, name=f"{split} problem {i}"))
        except PromptError as err:
            raise TaskError(f"--task {task_name}: the tokenizer of --model {model} cannot encode the task's prompts: "
                            f"{err}") from None
    return out


def held_out_prompts(model, n: int, task_name: Optional[str] = None) -> tuple:
    """(task, tokenizer adapter, examples, prompt ids) of the first `n` held-out problems of `task_name` -- by default
    the task the model was trained on (its card) -- encoded by the model's own tokenizer: what the benchmarks decode."""
    from dblock.tasks import get_task
    from dblock.tasks.card import task_of
    name = task_name or task_of(model.source)
    tok = TokenizerAdapter.from_folder(model.source)
    task = get_task(name)
    exs = task.examples("test", n)
    return task, tok, exs, encode_task_prompts(tok, exs, name, model.source)


def prompts_and_grader(task, adapter: "TokenizerAdapter", examples) -> tuple:
    """(token-id prompts, grader) for held-out `examples` of `task`: `grader(prompt_ids, output_ids)` is what
    `compare_schedules` takes -- True/False on an arithmetic task; on the code task {"correct": next line exact,
    "token_accuracy": ...} (the output cut at its first EOS)."""
    from dblock.tasks import answer_text
    prompts = [adapter.encode(e.prompt) for e in examples]
    by_ids = {tuple(p): e for p, e in zip(prompts, examples)}

    def grader(ids, out):
        e = by_ids[tuple(ids)]
        text = answer_text(out, adapter)
        if getattr(task, "style", None) != "code":
            return task.grade(e.prompt, text)
        cut = [int(t) for t in out]
        cut = cut[:cut.index(adapter.eos_id)] if adapter.eos_id in cut else cut
        sc = task.score(e, text, cut, adapter.encode(e.answer))
        return {"correct": sc["next_line_exact"], "token_accuracy": sc["token_accuracy"],
                "answer_token_accuracy": sc["answer_token_accuracy"]}
    return prompts, grader


def _as_tokenizer(tokenizer: Any, model_or_forward: Any):
    if tokenizer is None:
        model = getattr(model_or_forward, "model", model_or_forward)
        source = getattr(model, "source", None)
        if not source:
            raise ValueError("evaluate: give a tokenizer (the model was not loaded from a folder)")
        return TokenizerAdapter.from_folder(source)
    if hasattr(tokenizer, "eos_id"):
        return tokenizer
    return TokenizerAdapter(tokenizer)   # a bare tokenizers.Tokenizer


def histogram(values) -> dict:
    """{value: count} sorted by value, keys as ints (JSON turns them into strings)."""
    return {int(k): int(v) for k, v in sorted(Counter(values).items())}


def evaluate(model_or_forward: Any, task, n: int = 200, dec: Optional[DecodeConfig] = None,
             schedule: Any = "native", batch_size: Optional[int] = None, seeds: Optional[Sequence[int]] = None,
             tokenizer: Any = None, split: str = "test", start: int = 0, progress: bool = False,
             examples: int = 0, loss: bool = True) -> dict:
    """Decode the first `n` problems of `split` and grade them.

    `model_or_forward`: a loaded model (reference executor) or any Forward (e.g. the Epoch executor).
    `task`: an `ArithTask` or a `get_task` name.
    `seeds`: one decoding run per seed (uniform-state sampling draws noise; masked threshold decoding is greedy and
    gives the same tokens for every seed); accuracy and counters are reported per seed and pooled.
    `examples`: how many (prompt, output, correct) triples to include for inspection.
    Returns a JSON-ready dict: accuracy, per-kind accuracy, counters of docs/counters.md (Y K F Q TPF TPS wall_TPS T_den_ms
    wall_s), passes-per-block histogram and mean, blocks and tokens per answer, EOS rate, and `requests`: one record
    per decoded request (per seed) — index in the split, seed, prompt, generated token ids, answer text, expected
    answer, correct, denoising passes F — so two executors' outputs can be compared token for token (`dblock eval
    --json`).

    The `code` task (`dblock/tasks/code.py`) grades the next line (`accuracy` = next-line exact match) and adds per
    request `next_line_exact`, `token_accuracy` and (with `loss`, once per problem) `loss_per_token`, and `metrics`:
    their means with 95% bootstrap CIs over requests (`dblock.tasks.code_eval.summarize`). The `exec` task
    (`dblock/tasks/exec_task.py`) grades the whole answer and adds `answer_exact`, `value_accuracy` and the loss the
    same way.
    """
    from dblock.decoding.generate import generate
    from dblock.tasks import answer_text

    if n <= 0:
        raise ValueError(f"--n {n}: must be a positive integer")
    if batch_size is not None and batch_size <= 0:
        raise ValueError(f"--batch-size {batch_size}: must be a positive integer")
    if isinstance(task, str):
        from dblock.tasks import get_task
        task = get_task(task)
    dec = (dec or DecodeConfig()).validate()
    tok = _as_tokenizer(tokenizer, model_or_forward)
    probs = task.examples(split, n, start=start)
    prompts = [tok.encode(e.prompt) for e in probs]
    is_code = getattr(task, "style", None) == "code"
    scored = getattr(task, "style", None) in ("code", "exec")     # per-request metrics, CIs and the held-out loss
    ref_ids = [tok.encode(e.answer) for e in probs] if scored else None
    seeds = list(seeds) if seeds else [dec.seed]
    per_seed, all_passes, all_blocks, all_Y, kinds_ok, kinds_passes = [], [], [], [], {}, {}
    grade_ok: dict = {}
    first_block_passes = []
    shown, requests = [], []
    sums = {k: 0.0 for k in ("Y", "K", "F", "Q", "den_s", "den_calls", "wall_s")}
    eos_count = 0
    for seed in seeds:
        res = generate(model_or_forward, prompts, dec.replace(seed=seed), schedule, progress=progress,
                       seeds=[seed] * len(prompts), batch_size=batch_size)
        s = res.summary()
        correct = 0
        for i, (e, ids, c) in enumerate(zip(probs, res.tokens, res.counters)):
            text = answer_text(ids, tok)
            ok = task.grade(e.prompt, text, example=e) if scored else task.grade(e.prompt, text)
            requests.append({"index": start + i, "seed": seed, "prompt": e.prompt, "tokens": [int(t) for t in ids],
                             "text": text, "expected": e.answer, "correct": bool(ok), "passes": int(c.F)})
            if scored:
                cut = [int(t) for t in ids]
                cut = cut[:cut.index(tok.eos_id)] if tok.eos_id in cut else cut
                requests[-1].update(task.score(e, text, cut, ref_ids[i]))
            correct += ok
            kinds_ok.setdefault(e.kind, []).append(ok)
            grade_ok.setdefault(e.kind, {}).setdefault(e.digits, []).append(ok)
            all_passes += [b.passes for b in c.blocks]
            kinds_passes.setdefault(e.kind, []).extend(b.passes for b in c.blocks)
            first_block_passes.append(c.blocks[0].passes if c.blocks else 0)
            all_blocks.append(c.K)
            all_Y.append(c.Y)
            eos_count += bool(ids) and ids[-1] == tok.eos_id
            if len(shown) < examples:
                shown.append({"prompt": e.prompt, "output": text, "expected": e.answer,
                              "correct": bool(ok), "passes_per_block": [b.passes for b in c.blocks]})
        per_seed.append({"seed": seed, "accuracy": correct / len(probs), "TPF": s["TPF"], "TPS": s["TPS"],
                         "wall_s": s["wall_s"]})
        for k in ("Y", "K", "F", "Q", "wall_s"):
            sums[k] += s[k]
        sums["den_s"] += res.times.den_s
        sums["den_calls"] += res.times.den_calls
    runs = len(seeds) * len(probs)
    Y, K, F, Q = (int(sums[k]) for k in ("Y", "K", "F", "Q"))
    name = getattr(task, "name", str(task))
    executor = getattr(model_or_forward, "name", "reference")
    sched = schedule if isinstance(schedule, str) else getattr(schedule, "name", str(schedule))
    out = {
        "task": name, "split": split, "n": len(probs), "seeds": seeds, "executor": executor, "schedule": sched,
        "decode": {"rule": dec.rule, "threshold": dec.threshold, "block_size": dec.block_size,
                   "max_new_tokens": dec.max_new_tokens, "max_steps": dec.max_steps, "no_cache": dec.no_cache,
                   "threshold_steps": dec.threshold_steps, "steps": dec.steps},
        "accuracy": sum(p["accuracy"] for p in per_seed) / len(per_seed),
        "accuracy_by_kind": {k: sum(v) / len(v) for k, v in sorted(kinds_ok.items())},
        # by kind and difficulty grade (Example.digits: the longest operand's length): {kind: {grade: [right, n]}}
        "accuracy_by_grade": {k: {str(g): [sum(v), len(v)] for g, v in sorted(by.items())}
                              for k, by in sorted(grade_ok.items())},
        "per_seed": per_seed,
        "Y": Y, "K": K, "F": F, "Q": Q,
        "TPF": Y / Q if Q else 0.0,
        "TPS": Y / sums["den_s"] if sums["den_s"] else 0.0,
        "wall_TPS": Y / sums["wall_s"] if sums["wall_s"] else 0.0,
        "T_den_ms": 1e3 * sums["den_s"] / sums["den_calls"] if sums["den_calls"] else 0.0,
        "wall_s": sums["wall_s"],
        "passes_per_block_mean": F / K if K else 0.0,
        "passes_per_block_hist": histogram(all_passes),
        "passes_per_block_mean_by_kind": {k: sum(v) / len(v) for k, v in sorted(kinds_passes.items()) if v},
        "first_block_passes_mean": sum(first_block_passes) / runs,
        "blocks_per_answer_mean": K / runs,
        "blocks_per_answer_hist": histogram(all_blocks),
        "tokens_per_answer_mean": Y / runs,
        "eos_rate": eos_count / runs,
        "requests": requests,
    }
    if scored:
        if loss:
            from dblock.tasks.code_eval import heldout_loss
            model = getattr(model_or_forward, "model", model_or_forward)
            per = heldout_loss(model, probs, tok, gen_tokens=getattr(task, "max_new_tokens", 64))
            for q in requests:
                q["loss_per_token"] = per[q["index"] - start]
        from dblock.tasks.code_eval import summarize
        out["metrics"] = summarize(requests)
    if examples:
        out["examples"] = shown
    return out


def format_report(r: dict) -> str:
    """Human-readable lines for `dblock eval` without --json."""
    lines = [f"{r['task']} ({r['split']}, n={r['n']}, seeds={r['seeds']}) executor={r['executor']} "
             f"schedule={r['schedule']} rule={r['decode']['rule']} tau={r['decode']['threshold']}",
             f"accuracy {r['accuracy']:.3f}  " + "  ".join(f"{k} {v:.3f}" for k, v in r["accuracy_by_kind"].items()),
             f"Y={r['Y']} K={r['K']} F={r['F']} Q={r['Q']} TPF={r['TPF']:.3f} T_den={r['T_den_ms']:.2f}ms "
             f"TPS={r['TPS']:.1f} wall_TPS={r['wall_TPS']:.1f} wall={r['wall_s']:.1f}s",
             f"passes/block mean {r['passes_per_block_mean']:.2f} (first block {r['first_block_passes_mean']:.2f}; "
             + ", ".join(f"{k} {v:.2f}" for k, v in r["passes_per_block_mean_by_kind"].items()) + "); "
             f"blocks/answer {r['blocks_per_answer_mean']:.2f}; tokens/answer {r['tokens_per_answer_mean']:.1f}; "
             f"EOS rate {r['eos_rate']:.3f}",
             "passes/block histogram: " + " ".join(f"{k}:{v}" for k, v in r["passes_per_block_hist"].items())]
    if r.get("accuracy_by_grade"):
        lines.insert(2, "right/n by length: " + "; ".join(
            f"{k} " + " ".join(f"{g}:{a}/{b}" for g, (a, b) in by.items()) for k, by in r["accuracy_by_grade"].items()))
    for k, m in (r.get("metrics") or {}).items():
        lines.append(f"{k} {m['mean']:.4f} (95% CI {m['ci'][0]:.4f}..{m['ci'][1]:.4f}, n={m['n']})")
    for e in r.get("examples", []):
        mark = "ok " if e["correct"] else "BAD"
        lines.append(f"  [{mark}] {e['prompt']} {e['output']}  passes/block {e['passes_per_block']}")
    return "\n".join(lines)
