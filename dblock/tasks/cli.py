"""`dblock train-tiny` and `dblock eval` (the tasks room's commands; `dblock.cli` imports this module).

    dblock train-tiny --family llada2_moe --out DIR --minutes 45 --seed 0      # or --steps S; --resume continues
    dblock eval --model tiny-masked --n 200 --json             # held-out accuracy + counters (task from card.json)
    dblock model-card --model DIR --train-summary RUN/train_summary.json --n 200   # MODEL_CARD.md + card.json
"""
from __future__ import annotations

import argparse
import json

from dblock.cli import add_decode_args, add_executor_args, add_model_args, decode_config, load_model, make_forward


def _pair(s: str) -> tuple:
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give MIN,MAX, e.g. 1,4") from None
    return lo, hi


def _seeds(s: str) -> list:
    try:
        out = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give comma-separated integers, e.g. 0,1,2") from None
    if not out:
        raise argparse.ArgumentTypeError("empty seed list")
    return out


def add_task_args(p, default="arith"):
    p.add_argument("--task", default=default,
                   help="task name: arith, arith-add, arith-rev, arith-small, or a mix 'arith:add=W,rev=W'"
                        + (" (default: the task in the model's card.json, else arith)" if default is None else
                           f" (default {default})"))
    p.add_argument("--add-digits", type=_pair, default=None, help="add operand lengths MIN,MAX (default: the task's)")
    p.add_argument("--rev-len", type=_pair, default=None, help="rev string lengths MIN,MAX (default: the task's)")


def make_task_from_args(args):
    from dblock.tasks import get_task
    if args.task is None:
        from dblock.tasks.card import task_of
        args.task = task_of(args.model)
    kw = {}
    if args.add_digits:
        kw["add_digits"] = args.add_digits
    if args.rev_len:
        kw["rev_len"] = args.rev_len
    return get_task(args.task, **kw)


def add_parser(subparsers):
    from dblock.tasks.train import LLADA2_SIZES, TrainConfig

    d = TrainConfig()
    t = subparsers.add_parser("train-tiny", help="train a tiny model on CPU with its family's real objective",
                              description="Train a tiny block-diffusion MoE model on the synthetic task (masked "
                                          "diffusion + BD3-LM block-causal training for llada2_moe). Writes "
                                          "DIR/train_state.pt checkpoints and, at the end, the HF folder DIR.")
    t.add_argument("--family", required=True, choices=["llada2_moe", "diffusion_gemma"], help="model family")
    t.add_argument("--out", required=True, help="output folder (checkpoints + final HF model folder)")
    t.add_argument("--minutes", type=float, default=None,
                   help="wall budget: the total number of steps is fixed from the speed of the first steps")
    t.add_argument("--steps", type=int, default=None, help="total optimizer steps (reproducible; overrides --minutes)")
    t.add_argument("--seed", type=int, default=d.seed, help="seed of weights, data order and noise (default 0)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt with its stored settings")
    t.add_argument("--size", default=d.size, choices=sorted(LLADA2_SIZES), help=f"model size (default {d.size})")
    add_task_args(t)
    t.add_argument("--block-size", type=int, default=d.block_size, help=f"block size C (default {d.block_size})")
    t.add_argument("--batch-size", type=int, default=d.batch_size, help=f"examples per step (default {d.batch_size})")
    t.add_argument("--lr", type=float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    t.add_argument("--warmup", type=int, default=d.warmup, help=f"linear warmup steps (default {d.warmup})")
    t.add_argument("--bias-update", type=float, default=d.bias_update,
                   help=f"aux-loss-free expert-bias step u (default {d.bias_update}; 0 disables)")
    t.add_argument("--save-every", type=int, default=d.save_every, help=f"checkpoint period in steps "
                                                                         f"(default {d.save_every})")
    t.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps in total, with a checkpoint and no export (resume later)")
    t.add_argument("--threads", type=int, default=d.threads, help=f"torch CPU threads (default {d.threads})")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print the run summary as JSON")

    e = subparsers.add_parser("eval", help="held-out task accuracy and decoding counters of a model",
                              description="Decode the task's test-split problems and report exact-answer accuracy, "
                                          "TPF, TPS, wall time and the passes-per-block histogram.")
    add_model_args(e)
    add_task_args(e, default=None)
    e.add_argument("--n", type=int, default=200, help="problems (the first N of the split; default 200)")
    e.add_argument("--split", default="test", choices=["test", "train"], help="task split (default test)")
    e.add_argument("--seeds", type=_seeds, default=None,
                   help="comma-separated decoding seeds, one run each (default: --seed)")
    e.add_argument("--batch-size", type=int, default=None, help="requests per forward (default: all)")
    e.add_argument("--examples", type=int, default=0, help="also show this many (prompt, output) pairs")
    e.add_argument("--progress", action="store_true", help="show a progress bar (on by default when --n > 50)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    add_decode_args(e)
    add_executor_args(e)

    c = subparsers.add_parser("model-card", help="evaluate a trained tiny model and write its MODEL_CARD.md + card.json",
                              description="Evaluate DIR with `dblock eval` defaults and write MODEL_CARD.md and "
                                          "card.json into DIR, from the training summary and the evaluation.")
    c.add_argument("--model", required=True, help="model folder (or bundled name)")
    c.add_argument("--train-summary", required=True, help="the run's train_summary.json (written by train-tiny)")
    c.add_argument("--task", default=None, help="evaluation task (default: the training task; must match it)")
    c.add_argument("--n", type=int, default=200, help="held-out problems (default 200)")
    c.add_argument("--name", default=None, help="name used in the card (default: the folder's name)")


def _train(args) -> int:
    from dblock.tasks.train import TrainConfig, train

    if args.steps is None and args.minutes is None and not args.resume:
        raise ValueError("give --steps S or --minutes N")
    make_task_from_args(args)  # validate the task before any compute
    cfg = TrainConfig(family=args.family, out=args.out, size=args.size, task=args.task,
                      add_digits=args.add_digits, rev_len=args.rev_len, block_size=args.block_size, seed=args.seed,
                      steps=args.steps, minutes=args.minutes if args.steps is None else None,
                      batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, bias_update=args.bias_update,
                      save_every=args.save_every, threads=args.threads, progress=not args.no_progress)
    summary = train(cfg, resume=args.resume, stop_after=args.stop_after)
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


def _eval(args) -> int:
    from dblock.decoding.schedules import schedule_spec
    from dblock.tasks.evaluate import evaluate, format_report

    task = make_task_from_args(args)
    if args.n <= 0:
        raise ValueError(f"--n {args.n}: must be a positive integer")
    model = load_model(args)
    dec = decode_config(args, model.config.family)
    spec = schedule_spec(args.schedule, args.window, args.gate)
    fwd = make_forward(model, args)
    from dblock.tasks.evaluate import TokenizerAdapter
    tok = TokenizerAdapter.from_folder(model.source)
    r = evaluate(fwd, task, n=args.n, dec=dec, schedule=spec, batch_size=args.batch_size, seeds=args.seeds,
                 tokenizer=tok, split=args.split, progress=args.progress or args.n > 50, examples=args.examples)
    r["model"] = args.model
    if args.json:
        print(json.dumps(r))
    else:
        print(format_report(r))
    return 0


def _card(args) -> int:
    from dblock.tasks.card import make_card
    if args.n <= 0:
        raise ValueError(f"--n {args.n}: must be a positive integer")
    card = make_card(args.model, args.train_summary, args.task, args.n, args.name)
    print(f"model-card: {card['name']}: accuracy {card['eval']['accuracy']:.3f} on {card['task']} "
          f"(n={args.n}); wrote MODEL_CARD.md and card.json")
    return 0


def main(args) -> int:
    if args.command == "train-tiny":
        return _train(args)
    if args.command == "model-card":
        return _card(args)
    if args.command == "eval":
        return _eval(args)
    raise ValueError(f"unknown command {args.command!r}")
