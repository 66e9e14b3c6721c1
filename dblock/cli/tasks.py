"""`dblock train-tiny`, `dblock eval` and `dblock model-card` (the tasks room's commands; `dblock.cli` calls
`add_parser`, each subcommand runs its `set_defaults(_run=...)` function).

    dblock train-tiny --family llada2_moe --out DIR --minutes 45 --seed 0      # or --steps S; --resume continues
    dblock eval --model tiny-masked --n 200 --json             # held-out accuracy + counters (task from card.json)
    dblock model-card --model DIR --train-summary RUN/train_summary.json --n 200   # MODEL_CARD.md + card.json
"""
from __future__ import annotations

import argparse
import json
import os

from dblock.cli_args import (MAX_PROBLEMS, ArgumentParser, FlagRule, ValueRefused, add_batch_size_arg,
                             add_decode_args, add_executor_args, add_flag_rules, add_model_args, check_flag_rules,
                             float_arg, int_arg, resolve_max_new_tokens, seed_arg, seeds_arg)
from dblock.decode_flags import check_fits, decode_config, schedule_from_args
from dblock.model_flags import load_model, make_forward, model_config
from dblock.out_paths import check_out_dir
from dblock.prompts import load_tokenizer

#: task size ranges (--add-digits, --rev-len): an answer has to fit the tiny models' blocks and positions
MAX_TASK_LEN = 64

# `train-tiny` defaults: `dblock.tasks.train.TrainConfig`'s, spelled out here so that building the parser imports no
# torch (tests/cli/test_fast_help.py checks they match).
TRAIN_DEFAULTS = dict(seed=0, size="base", block_size=16, batch_size=32, lr=2e-3, warmup=100, bias_update=1e-3,
                      save_every=200, threads=1, min_lr_frac=0.05, curriculum_steps=0, curriculum_start=2,
                      noisy_context=0.0, suffix_mask=0.0, eval_every=0, eval_n=64, vocab_size=2048, window=288,
                      fused_attention=False)
LLADA2_SIZE_NAMES = ("base", "code", "code-3", "code-micro", "exec", "micro", "small")   # sorted(LLADA2_SIZES | GEMMA_SIZES)


def _pair(s: str) -> tuple:
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        raise ValueRefused(s, "give MIN,MAX, e.g. 1,4") from None
    if not 1 <= lo <= hi <= MAX_TASK_LEN:
        raise ValueRefused(s, f"give MIN,MAX with 1 <= MIN <= MAX <= {MAX_TASK_LEN}")
    return lo, hi


_seeds = seeds_arg     # comma-separated seeds, each in [0, 2**63-1]


def add_task_args(p, default="arith"):
    p.add_argument("--task", default=default,
                   help="task name: arith, arith-add, arith-rev, arith-small, arith-long (long additions with "
                        "carries, short division, reversal), or a mix 'arith:add=W,rev=W' / "
                        "'arith-long:add=W,div=W,rev=W'"
                        + (" (default: the task in the model's card.json, else arith)" if default is None else
                           f" (default {default})"))
    p.add_argument("--add-digits", type=_pair, default=None, help="add operand lengths MIN,MAX (default: the task's)")
    p.add_argument("--rev-len", type=_pair, default=None, help="rev string lengths MIN,MAX (default: the task's)")
    p.add_argument("--div-digits", type=_pair, default=None,
                   help="arith-long: dividend lengths MIN,MAX of the div kind (default: the task's)")


def task_from_name(name: str, **kw):
    """`get_task(name, **kw)`, probed with one example, so that a bad name or mix (unknown sub-task, NaN or
    infinite weights) is one `TaskError` naming --task before any model is read."""
    from dblock.errors import TaskError
    from dblock.tasks import get_task
    try:
        task = get_task(name, **kw)
        task.examples("test", 1)
    except TaskError:
        raise
    except (ValueError, TypeError, OverflowError) as e:
        raise TaskError(f"--task {str(name)[:60]}: {e}") from None
    kinds = task.sizes() if hasattr(task, "sizes") else {}
    for key, flag, kind in (("add_digits", "--add-digits", "add"), ("rev_len", "--rev-len", "rev"),
                            ("div_digits", "--div-digits", "div")):
        if key in kw and kind not in kinds:       # the size of a kind the task never draws would do nothing
            raise TaskError(f"{flag}: task {str(name)[:60]} has no {kind} problems (its kinds: "
                            f"{', '.join(kinds) or 'none'}); leave {flag} out")
    return task


def make_task_from_args(args):
    if args.task is None:
        from dblock.tasks.card import task_of
        args.task = task_of(args.model)
    kw = {}
    if args.add_digits:
        kw["add_digits"] = args.add_digits
    if args.rev_len:
        kw["rev_len"] = args.rev_len
    if getattr(args, "div_digits", None):
        kw["div_digits"] = args.div_digits
    return task_from_name(args.task, **kw)


def add_parser(subparsers):
    d = argparse.Namespace(**TRAIN_DEFAULTS)
    t = subparsers.add_parser("train-tiny", help="train a tiny model on CPU with its family's real objective",
                              description="Train a tiny block-diffusion MoE model on the synthetic task (masked "
                                          "diffusion + BD3-LM block-causal training for llada2_moe). Writes "
                                          "DIR/train_state.st checkpoints and, at the end, the HF folder DIR.")
    t.add_argument("--family", choices=["llada2_moe", "diffusion_gemma"],
                   help="model family (required; with --resume: the run's own)")
    t.add_argument("--out", required=True, help="output folder (checkpoints + final HF model folder)")
    t.add_argument("--minutes", type=float_arg(0.0, 100_000.0, lo_open=True), default=None,
                   help="wall budget: the total number of steps is fixed from the speed of the first steps")
    t.add_argument("--steps", type=int_arg(1, 10_000_000), default=None,
                   help="total optimizer steps (reproducible; overrides --minutes)")
    t.add_argument("--seed", type=seed_arg, default=d.seed, help="seed of weights, data order and noise (default 0)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state.st with its stored settings")
    t.add_argument("--overwrite", action="store_true",
                   help="replace --out as a whole at the end of the run when it holds something (default: refuse a "
                        "non-empty folder)")
    t.add_argument("--size", default=d.size, choices=list(LLADA2_SIZE_NAMES), help=f"model size (default {d.size})")
    add_task_args(t)
    t.add_argument("--block-size", type=int_arg(1, 4096), default=d.block_size,
                   help=f"block size C (default {d.block_size})")
    t.add_argument("--batch-size", type=int_arg(1, 65536), default=d.batch_size,
                   help=f"examples per step (default {d.batch_size})")
    t.add_argument("--lr", type=float_arg(0.0, 10.0, lo_open=True), default=d.lr,
                   help=f"peak AdamW learning rate (default {d.lr})")
    t.add_argument("--warmup", type=int_arg(0, 10_000_000), default=d.warmup,
                   help=f"linear warmup steps (default {d.warmup})")
    t.add_argument("--bias-update", type=float_arg(0.0), default=d.bias_update,
                   help=f"aux-loss-free expert-bias step u (default {d.bias_update}; 0 disables)")
    t.add_argument("--save-every", type=int_arg(1, 10_000_000), default=d.save_every,
                   help=f"checkpoint period in steps (default {d.save_every})")
    t.add_argument("--stop-after", type=int_arg(1, 10_000_000), default=None,
                   help="stop after this many steps in total, with a checkpoint and no export (resume later)")
    t.add_argument("--threads", type=int_arg(1, 1024), default=d.threads,
                   help=f"torch CPU threads (default {d.threads})")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--min-lr-frac", type=float_arg(0.0, 1.0), default=d.min_lr_frac,
                   help=f"cosine schedule ends at lr x this (default {d.min_lr_frac})")
    t.add_argument("--curriculum-steps", type=int_arg(0, 10_000_000), default=d.curriculum_steps,
                   help="over this many first steps the task's size maximum grows from --curriculum-start "
                        f"(default {d.curriculum_steps}: the full task from step 0)")
    t.add_argument("--curriculum-start", type=int_arg(1, 64), default=d.curriculum_start,
                   help=f"size maximum at step 0 of the curriculum (default {d.curriculum_start})")
    t.add_argument("--noisy-context", type=float_arg(0.0, 1.0), default=d.noisy_context,
                   help="probability per example that a block is trained behind a still-noisy predecessor (One "
                        f"Block Ahead's warm-up block; default {d.noisy_context})")
    t.add_argument("--suffix-mask", type=float_arg(0.0, 1.0), default=d.suffix_mask,
                   help="llada2_moe: probability per example that the noise masks a suffix of the answer (from a "
                        "uniform cut on) instead of random positions: the state of a block decoding a dependency "
                        f"chain left to right (default {d.suffix_mask})")
    t.add_argument("--init-from", default=None, metavar="MODEL",
                   help="start from this model's weights (a folder or bundled name of the same family and --size) "
                        "instead of the seeded init: the second stage of a recipe (default: from scratch)")
    t.add_argument("--init-first-layers", action="store_true",
                   help="with --init-from: a --size with fewer layers than that model takes its first layers (and "
                        "its embedding, final norm and head) -- a shallower model started from a deeper one")
    t.add_argument("--eval-every", type=int_arg(0, 10_000_000), default=d.eval_every,
                   help=f"held-out accuracy every N steps, stored in the summary (default {d.eval_every}: off)")
    t.add_argument("--eval-n", type=int_arg(1, 100_000), default=d.eval_n,
                   help=f"test problems per in-training evaluation (default {d.eval_n})")
    t.add_argument("--vocab-size", type=int_arg(261, 65536), default=d.vocab_size,
                   help=f"--task code: vocabulary of the byte-level BPE built from the corpus (default {d.vocab_size})")
    t.add_argument("--tokenizer", default=None, metavar="FOLDER",
                   help="--task code: use FOLDER/tokenizer.json instead of building one (default: the --init-from "
                        "model's, else built)")
    t.add_argument("--window", type=int_arg(1, 65536), default=d.window,
                   help=f"--task code: tokens per training window, a multiple of --block-size (default {d.window})")
    t.add_argument("--block-warmup", default=None, metavar="BLOCK:STEPS,...",
                   help="llada2_moe: train the first steps with smaller BD3 blocks, e.g. 1:500,4:300 (block 1 is "
                        "next-token prediction; LLaDA2.0's block-size warm-up), then --block-size (default: none)")
    t.add_argument("--fused-attention", action="store_true",
                   help="train with torch's fused scaled_dot_product_attention (faster; the same function)")
    t.add_argument("--save-dtype", default=None, choices=["bfloat16", "float16"],
                   help="store the exported weights in this dtype (config.json records float32 as the dtype to "
                        "compute in; default: as trained). With --resume of a finished run: export again")
    t.add_argument("--json", action="store_true", help="print the run summary as JSON")
    t.set_defaults(_run=_train)
    add_flag_rules(t, *TRAIN_RULES)

    e = subparsers.add_parser("eval", help="held-out task accuracy and decoding counters of a model",
                              description="Decode the task's test-split problems and report exact-answer accuracy, "
                                          "TPF, TPS, wall time and the passes-per-block histogram.")
    add_model_args(e)
    add_task_args(e, default=None)
    e.add_argument("--n", type=int_arg(1, MAX_PROBLEMS), default=200,
                   help="problems (the first N of the split; default 200)")
    e.add_argument("--split", default="test", choices=["test", "train"], help="task split (default test)")
    e.add_argument("--seeds", type=_seeds, default=None,
                   help="comma-separated decoding seeds, one run each (default: --seed)")
    add_batch_size_arg(e)
    e.add_argument("--examples", type=int_arg(0, MAX_PROBLEMS), default=0,
                   help="also show this many (prompt, output) pairs")
    e.add_argument("--progress", action="store_true", help="show a progress bar (on by default when --n > 50)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    add_decode_args(e)
    add_executor_args(e)
    e.set_defaults(_run=_eval, max_new_tokens=None)     # None: the task's own length (code: 64), else 128
    add_flag_rules(e, FlagRule("--seed", "without --seeds (each run takes its seed from --seeds)",
                               lambda a, c: a.seeds is None))

    c = subparsers.add_parser("model-card", help="evaluate a trained tiny model and write its MODEL_CARD.md + card.json",
                              description="Evaluate DIR with `dblock eval` defaults and write MODEL_CARD.md and "
                                          "card.json into DIR, from the training summary and the evaluation.")
    c.add_argument("--model", required=True, help="model folder (or bundled name)")
    c.add_argument("--train-summary", required=True, action="append",
                   help="the run's train_summary.json (written by train-tiny); a recipe of several stages gives one "
                        "per stage, in order")
    c.add_argument("--task", default=None, help="evaluation task (default: the training task; must match it)")
    c.add_argument("--n", type=int_arg(1, MAX_PROBLEMS), default=200, help="held-out problems (default 200)")
    c.add_argument("--name", default=None, help="name used in the card (default: the folder's name)")
    c.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="a paragraph for the card's Training section (e.g. how a stage deviates from its command)")
    c.add_argument("--also-schedule", action="append", default=[], metavar="SCHEDULE",
                   help="evaluate once more under this schedule (e.g. oba) and record it beside the default one")
    c.add_argument("--schedules-n", type=int_arg(0, MAX_PROBLEMS), default=0, metavar="N",
                   help="also run `dblock compare-schedules` (every schedule) on N problems and record its table "
                        "(default 0: no)")
    c.add_argument("--schedules-batch", type=int_arg(1, 4096), default=16,
                   help="the compare-schedules batch size (default 16)")
    c.add_argument("--threshold-steps", type=int_arg(1, 4096), default=None, metavar="S",
                   help="the model's default decoding: the threshold rule with LLaDA2.0's steps S (card.json "
                        "`decoding`, which every command then applies to this model); the card also records the "
                        "threshold rule alone beside it")
    c.add_argument("--steps", type=int_arg(1, 4096), default=None, metavar="N",
                   help="a uniform-state model's default decoding: the entropy-bound rule with N steps per block "
                        "(card.json `decoding`, which every command then applies to this model where no --steps "
                        "is given)")
    c.set_defaults(_run=_card)
    add_flag_rules(c, FlagRule("--schedules-batch", "with --schedules-n N > 0 (the compare-schedules run it sizes)",
                               lambda a, ctx: a.schedules_n > 0))


def _code_task(name) -> bool:
    from dblock.tasks.train_config import is_code_task
    return is_code_task(name or "")


#: what a resumed run takes from its train state instead of the command line (`dblock.tasks.train`): all but
#: --out, --family (which must match), --stop-after, --save-dtype, --threads, --no-progress and --json
RUN_SETTINGS = ("--minutes", "--steps", "--seed", "--size", "--task", "--add-digits", "--rev-len", "--div-digits",
                "--block-size", "--batch-size", "--lr", "--warmup", "--bias-update", "--save-every", "--min-lr-frac",
                "--curriculum-steps", "--curriculum-start", "--noisy-context", "--suffix-mask", "--init-from", "--init-first-layers", "--eval-every",
                "--eval-n", "--vocab-size", "--tokenizer", "--window", "--block-warmup", "--fused-attention",
                "--overwrite")
TRAIN_RULES = (
    FlagRule(RUN_SETTINGS, "to a new run: --resume continues with the settings stored in the run's train state",
             lambda a, c: not a.resume),
    FlagRule("--minutes", "without --steps (--steps fixes the run's length; --minutes turns a time budget into one)",
             lambda a, c: a.steps is None),
    FlagRule(("--vocab-size", "--tokenizer", "--window"), "with --task code (the arithmetic tasks use the character "
             "tokenizer, one problem per row)", lambda a, c: _code_task(a.task)),
    FlagRule("--suffix-mask", "to --family llada2_moe (it shapes the masked-diffusion noise; DiffusionGemma's is "
             "uniform-state)", lambda a, c: a.family == "llada2_moe"),
    FlagRule(("--bias-update", "--block-warmup"), "to --family llada2_moe (DiffusionGemma's router has no expert bias "
             "and its objective no BD3 blocks)", lambda a, c: a.family == "llada2_moe"),
    FlagRule("--init-first-layers", "with --init-from MODEL", lambda a, c: bool(a.init_from)),
    FlagRule("--curriculum-start", "with --curriculum-steps N > 0", lambda a, c: a.curriculum_steps > 0),
    FlagRule("--eval-n", "with --eval-every N > 0", lambda a, c: a.eval_every > 0),
)


def _run_family(out: str) -> str:
    """The family of the run in OUT (its train state's metadata, `dblock.tasks.train_state`), for `--resume` without
    --family."""
    from dblock.tasks.train_state import run_family
    return run_family(out)


def _train(args) -> int:
    from dblock.tasks.train import train
    from dblock.tasks.train_config import TrainConfig

    if args.steps is None and args.minutes is None and not args.resume:
        raise ValueError("give --steps S or --minutes N")
    check_out_dir(args.out, "--out")
    if args.family is None:
        if not args.resume:
            raise ValueError("give --family llada2_moe or diffusion_gemma")
        args.family = _run_family(args.out)
    make_task_from_args(args)  # validate the task before any compute
    if args.init_from and not args.resume:
        from dblock.weights_path import resolve_model_path
        resolve_model_path(args.init_from)    # a missing model is an error before any folder is made
    cfg = TrainConfig(family=args.family, out=args.out, size=args.size, task=args.task,
                      add_digits=args.add_digits, rev_len=args.rev_len, block_size=args.block_size, seed=args.seed,
                      steps=args.steps, minutes=args.minutes if args.steps is None else None,
                      batch_size=args.batch_size, lr=args.lr, warmup=args.warmup, bias_update=args.bias_update,
                      save_every=args.save_every, threads=args.threads, progress=not args.no_progress,
                      div_digits=args.div_digits, min_lr_frac=args.min_lr_frac,
                      curriculum_steps=args.curriculum_steps, curriculum_start=args.curriculum_start,
                      noisy_context=args.noisy_context, suffix_mask=args.suffix_mask, eval_every=args.eval_every, eval_n=args.eval_n,
                      init_from=args.init_from, init_first_layers=args.init_first_layers, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                      window=args.window, fused_attention=args.fused_attention, save_dtype=args.save_dtype,
                      block_warmup=args.block_warmup)
    summary = train(cfg, resume=args.resume, stop_after=args.stop_after, overwrite=args.overwrite)
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


def _eval(args) -> int:
    from dblock.tasks.evaluate import TokenizerAdapter, encode_task_prompts, evaluate, format_report

    task = make_task_from_args(args)
    resolve_max_new_tokens(args, task)
    # refused from config.json and tokenizer.json before the weights are read
    folder, cfg = model_config(args)
    dec = decode_config(args, cfg.family, tokenizer=folder)
    spec = schedule_from_args(args)
    hf = load_tokenizer(folder)
    if hf is None:
        raise FileNotFoundError(f"{folder}/tokenizer.json: the model folder has no tokenizer.json (needed to encode "
                                "task prompts)")
    tok = TokenizerAdapter(hf)
    problems = task.examples(args.split, args.n)
    encoded = encode_task_prompts(tok, problems, args.task, args.model, args.split)
    check_fits(cfg, dec, spec, [(f"--task {args.task} ({args.split} problem {i})", ids)
                                for i, ids in enumerate(encoded)])
    model = load_model(args)
    fwd = make_forward(model, args)
    r = evaluate(fwd, task, n=args.n, dec=dec, schedule=spec, batch_size=args.batch_size, seeds=args.seeds,
                 tokenizer=tok, split=args.split, progress=args.progress or args.n > 50, examples=args.examples)
    r["model"] = args.model
    if args.json:
        print(json.dumps(r))
    else:
        print(format_report(r))
    return 0


def _card(args) -> int:
    from dblock.tasks.card_make import make_card
    for path in args.train_summary:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--train-summary {path}: no such file")
    card = make_card(args.model, args.train_summary, args.task, args.n, run_eval_command, args.name,
                     also_schedules=args.also_schedule, notes=args.note, schedules_n=args.schedules_n,
                     schedules_batch=args.schedules_batch, threshold_steps=args.threshold_steps,
                     steps=args.steps)
    print(f"model-card: {card['name']}: accuracy {card['eval']['accuracy']:.3f} on {card['task']} "
          f"(n={args.n}); wrote MODEL_CARD.md and card.json")
    return 0


def run_eval_command(cmd: str) -> dict:
    """Run a `dblock eval ...` command line in-process (exactly what the shell would run) and return its JSON."""
    import contextlib
    import io
    import shlex

    argv = shlex.split(cmd)
    if argv[:2] != ["dblock", "eval"]:
        raise ValueError(f"{cmd!r}: not a `dblock eval` command")
    ap = ArgumentParser(prog="dblock")
    add_parser(ap.add_subparsers(dest="command"))
    args = ap.parse_args(argv[1:] + ["--json"])
    check_flag_rules(args)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        args._run(args)
    return json.loads(buf.getvalue().strip().splitlines()[-1])
