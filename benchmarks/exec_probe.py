"""How fast a model shape learns the exec task (or one of its simpler grammars): a short training run that prints,
every few steps, the accuracy of each printed line's values on held-out programs -- the probe to run before
committing hours of CPU to a recipe (docs/models.md, "The exec task").

The run is `train-tiny`'s own step (batch, noise, loss, optimizer, expert-bias update: `dblock.tasks.train*`) on
`ExecTask(sizes=ExecSizes(grammar=...))`, with the loop length capped by a schedule (`--cap 0:1,300:2`: one
iteration from step 0, two from step 300; `--cap 0:0:copy,1000:1:full` starts on the copy grammar). The evaluation
is a cloze: for each line of a held-out answer, that line and everything after it are masked and the lines before it
are visible (masking only the line itself leaks its value through its neighbours: in a counter, the line after
gives the step away), and the argmax at each of its values is compared with the reference -- per line (`line0` is the copied initial state, `line1` the first iteration, ...) and overall. Chance
is 0.1.

    .venv/bin/python benchmarks/exec_probe.py --grammar copy --steps 400              # a bare copy: learns
    .venv/bin/python benchmarks/exec_probe.py --grammar full --cap 0:1,300:2 --steps 900

`--inspect RUN` trains nothing: it prints, as JSON, the cloze per line and per variable and the rule test
(`rule_test`: is line 5 right when every line before it but the last is scrambled, and does it follow a changed k?
The rule needs only the line before; an extrapolation of the lines needs more) of a train-tiny run's checkpoint:

    .venv/bin/python benchmarks/exec_probe.py --inspect runs/exec-acc --eval-n 24

Nothing is saved; one thread; no timing claim (the seconds printed are wall time).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_cap(text: str, grammar: str) -> list:
    """'0:1,300:2' -> [(0, 1, grammar), (300, 2, grammar)] (step, loop cap, grammar), sorted by step; an item
    STEP:CAP:GRAMMAR switches the grammar too ('0:0:copy,1000:1:full')."""
    out = []
    for item in text.split(","):
        step, cap, *g = item.split(":")
        out.append((int(step), int(cap), g[0] if g else grammar))
    return sorted(out)


def stage_at(schedule: list, step: int) -> tuple:
    """(loop cap, grammar) of `step`."""
    stage = schedule[0][1:]
    for s, c, g in schedule:
        if step >= s:
            stage = (c, g)
    return stage


def _padded(tok, prompt: str, answer: str, C: int) -> tuple:
    """(prompt + answer + <eos> as ids, padded with <eos> to whole blocks of C; the prompt's length)."""
    p = tok.encode(prompt)
    x0 = torch.tensor(p + tok.encode(answer) + [tok.eos_id])
    L = -(-len(x0) // C) * C
    return torch.cat([x0, torch.full((L - len(x0),), tok.eos_id)]), len(p)


def cloze(model, tok, task, n: int, ar: bool, by_column: bool = False, block: int | None = None) -> dict:
    """Value accuracy per answer line on `n` held-out programs (see the module docstring); `by_column` adds
    `line1a`, `line1b`, ...: per variable. `block`: the BD3 block of the view (default the model's; `ar`: 1)."""
    from dblock.tasks.bd3 import bd3_mask
    from dblock.tasks.train_model import set_fused_attention
    model.eval()
    set_fused_attention(model, False)
    hits = collections.defaultdict(lambda: [0, 0])
    C = model.config.block_size
    with torch.no_grad():
        for e in task.examples("test", n):
            x0, pos = _padded(tok, e.prompt, e.answer, C)
            L = len(x0)
            rows, where = [], []
            for k, line in enumerate(e.answer.split("\n")[:-1]):
                vals = [pos + 2 * j for j in range(len(line.split()))]
                xt = x0.clone()
                xt[pos:] = tok.mask_id          # this line and every later one: no neighbour gives it away
                rows.append(torch.cat([xt, x0]))
                where.append((k, vals))
                pos += len(line) + 1
            X = torch.stack(rows)
            B = X.shape[0]
            mask = bd3_mask(L, 1 if ar else (block or C))[None].expand(B, 2 * L, 2 * L)
            h, _ = model(X, torch.arange(L).repeat(2)[None].expand(B, 2 * L), mask)
            for b, (k, vals) in enumerate(where):
                pred = model.logits(h[b, vals]).argmax(-1)
                for j, v in enumerate(vals):
                    ok = int(pred[j] == x0[v])
                    for key in (f"line{min(k, 3)}", "all") + ((f"line{min(k, 3)}{'abc'[j]}",) if by_column else ()):
                        hits[key][0] += ok
                        hits[key][1] += 1
    model.train()
    set_fused_attention(model, True)
    return {k: round(x / y, 3) for k, (x, y) in sorted(hits.items())}


def _forward_at(model, tok, prompt: str, answer_lines: list, pos_line: int, block: int | None = None) -> list:
    """argmax at the values of line `pos_line`, with that line and every later one masked and the lines before it
    as given (which may differ from the program's own); `block`: the BD3 block of the view (default the model's)."""
    from dblock.tasks.bd3 import bd3_mask
    C = model.config.block_size
    x0, n_prompt = _padded(tok, prompt, "".join(ln + "\n" for ln in answer_lines), C)
    L = len(x0)
    pos = n_prompt + sum(len(ln) + 1 for ln in answer_lines[:pos_line])
    xt = x0.clone()
    xt[pos:] = tok.mask_id
    h, _ = model(torch.cat([xt, x0])[None], torch.arange(L).repeat(2)[None], bd3_mask(L, block or C)[None])
    n_vals = len(answer_lines[pos_line].split())
    return [tok.decode([int(t)]) for t in model.logits(h[0, [pos + 2 * j for j in range(n_vals)]]).argmax(-1)]


def rule_test(model, tok, task, n: int, line: int = 5, seed: int = 0, block: int | None = None) -> dict:
    """Does the model apply the program's rule or extrapolate the lines before? Value accuracy at answer line `line`
    (its own and every later line masked) on `n` held-out programs with at least line + 1 lines: `intact` (the
    program's own earlier lines), `history_scrambled` (every earlier line but the one just before replaced by random
    digits: the rule needs only that one, an extrapolation needs more), and for grammars with the step argument k
    `k_changed` (the call's k replaced, the earlier lines kept: the rule's answer is one iteration from the line
    before with the new k, an extrapolation of the lines gives the old one)."""
    import random
    import re

    from dblock.tasks.exec_task import _LOOP_LEN, WITH_K, run
    from dblock.tasks.train_model import set_fused_attention
    model.eval()
    set_fused_attention(model, False)
    rng = random.Random(seed)
    hits = collections.defaultdict(lambda: [0, 0])
    exs = [e for e in task.examples("test", 4 * n) if e.answer.count("\n") > line][:n]
    with torch.no_grad():
        for e in exs:
            lines = e.answer.split("\n")[:-1]
            cases = {"intact": (e.prompt, lines, lines)}
            scr = [" ".join(str(rng.randint(0, 9)) for _ in ln.split()) for ln in lines[:line - 1]]
            cases["history_scrambled"] = (e.prompt, scr + lines[line - 1:], lines)
            call = re.search(r"^f\((\d(?:,\d)*)\)$", e.prompt, re.M)
            if task.sizes_.grammar in WITH_K and call:
                # the call's k changed, the program's own earlier lines kept: the rule's next line is one iteration
                # from the line before with the new k; an extrapolation of the history gives the old one
                k = str(int(call[1].split(",")[-1]) % 9 + 1)
                prog = e.prompt[:call.start()] + f"f({','.join(call[1].split(',')[:-1] + [k])})" + \
                    e.prompt[call.end():]
                step = e.prompt[:call.start()] + f"f({','.join(lines[line - 1].split() + [k])})" + \
                    e.prompt[call.end():]
                nxt = run(_LOOP_LEN.sub("range(1)", step)).split("\n")[1]
                cases["k_changed"] = (prog, lines, lines[:line] + [nxt])
            for name, (prog, given, want) in cases.items():
                got = _forward_at(model, tok, prog, given[:line] + want[line:line + 1], line, block)
                for g, w in zip(got, want[line].split()):
                    hits[name][0] += int(g == w)
                    hits[name][1] += 1
    return {k: round(x / y, 3) for k, (x, y) in hits.items()} | {"programs": len(exs), "line": line}


def inspect(run_dir: str, n: int) -> dict:
    """The cloze (per line and variable) and the rule test of a train-tiny run's latest checkpoint, in the BD3 view
    the run trains at its step (`--block-warmup`: block 1 is next-token prediction)."""
    import dataclasses

    from dblock.tasks import get_task
    from dblock.tasks.exec_task import exec_tokenizer
    from dblock.tasks.train import make_optimizer
    from dblock.tasks.train_config import TrainConfig, is_exec_task
    from dblock.tasks.train_data import block_size_at
    from dblock.tasks.train_model import build_model
    from dblock.tasks.train_state import read, state_path
    st = read(state_path(run_dir))
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in st.config.items() if k in fields})
    if not is_exec_task(cfg.task):
        raise SystemExit(f"exec_probe.py: error: --inspect {run_dir}: a run of task {cfg.task!r}, not exec")
    tok = exec_tokenizer()
    model = build_model(cfg, tok)
    st.restore(model, make_optimizer(model, cfg))
    task = get_task(cfg.task)
    block = block_size_at(cfg, st.step)
    return {"run": run_dir, "task": cfg.task, "step": st.step, "block": block,
            "cloze": cloze(model, tok, task, n, False, True, block), "rule_test": rule_test(model, tok, task, n, block=block)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grammar", default="full", help="full | arith | counter | copy (dblock/tasks/exec_task.py GRAMMARS)")
    ap.add_argument("--vars", default="2,3", help="numbers of variables drawn (default 2,3)")
    ap.add_argument("--list", type=float, default=0.35, help="probability of the list L (default 0.35)")
    ap.add_argument("--cap", default="0:1",
                    help="loop-length cap schedule STEP:CAP[:GRAMMAR],... (default 0:1, in --grammar)")
    ap.add_argument("--size", default="code", help="train-tiny size (default code)")
    ap.add_argument("--init", default="", help="start from a bundled code model (e.g. code-masked)")
    ap.add_argument("--objective", choices=("diffusion", "ar"), default="diffusion",
                    help="diffusion: train-tiny's BD3 loss at block 32; ar: block 1, unweighted cross-entropy")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--every", type=int, default=100, help="evaluate every this many steps")
    ap.add_argument("--eval-n", type=int, default=32, help="held-out programs per evaluation")
    ap.add_argument("--inspect", default=None, metavar="RUN",
                    help="no training: the cloze per line and variable and the rule test (`rule_test`) of a "
                         "train-tiny run's latest checkpoint (RUN/train_state.st), as JSON")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.inspect:
        import json
        print(json.dumps(inspect(a.inspect, a.eval_n)))
        return 0

    import torch.nn.functional as F
    from dblock.tasks.bd3 import bd3_mask
    from dblock.tasks.exec_task import ExecSizes, ExecTask, exec_tokenizer
    from dblock.tasks.train import lr_at, make_optimizer
    from dblock.tasks.train_config import TrainConfig
    from dblock.tasks.train_data import add_noise, batch_for_step
    from dblock.tasks.train_loss import diffusion_loss, expert_loads, update_expert_bias
    from dblock.tasks.train_model import build_model, init_from_model

    schedule = parse_cap(a.cap, a.grammar)
    bases = {g: ExecTask(sizes=ExecSizes(tuple(int(x) for x in a.vars.split(",")), a.list, None, g))
             for g in {g for _, _, g in schedule}}
    cfg = TrainConfig(size=a.size, task="exec", block_size=32, batch_size=a.batch, fused_attention=True,
                      out=os.devnull, lr=a.lr, warmup=100, steps=a.steps)
    tok = exec_tokenizer()
    model = build_model(cfg, tok)
    if a.init:
        init_from_model(model, a.init, tok)
    opt = make_optimizer(model, cfg)
    print(f"{sum(p.numel() for p in model.parameters())} parameters; grammar {a.grammar}, cap {a.cap}, "
          f"objective {a.objective}, lr {a.lr}, batch {a.batch}" + (f", init {a.init}" if a.init else ""), flush=True)
    t0, losses = time.time(), []
    for step in range(a.steps):
        cap, grammar = stage_at(schedule, step)
        task = bases[grammar].capped(cap)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, a.steps)
        x0, prompt = batch_for_step(task, tok, cfg, step)
        xt, masked, p = add_noise(x0, prompt, model.config.mask_token_id, cfg.eps,
                                  torch.Generator().manual_seed(step))
        taps: dict = {}
        if a.objective == "ar":
            B, L = x0.shape
            h, _ = model(torch.cat([xt, x0], 1), torch.arange(L).repeat(2)[None].expand(B, 2 * L),
                         bd3_mask(L, 1)[None].expand(B, 2 * L, 2 * L), taps=taps)
            loss = F.cross_entropy(model.logits(h[:, :L][masked]), x0[masked])
        else:
            loss, _ = diffusion_loss(model, x0, xt, masked, p, prompt, taps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_expert_bias(model, expert_loads(model, taps), cfg.bias_update)
        losses.append(float(loss.detach()))
        if (step + 1) % a.every == 0:
            acc = cloze(model, tok, task, a.eval_n, a.objective == "ar")
            print(f"step {step + 1}  {time.time() - t0:.0f} s  loss {sum(losses[-a.every:]) / a.every:.3f}  "
                  f"{grammar} cap {cap}  value accuracy {acc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
