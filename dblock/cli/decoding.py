"""`dblock compare-schedules`: Native(C), Native(2C), FlowBlock, Dense Mask, OBA and its ablations side by side."""
from __future__ import annotations

import json
import os

from dblock.cli_args import (MAX_BATCH, MAX_PROBLEMS, FlagRule, add_decode_args, add_executor_args, add_flag_rules,
                             add_model_args, add_special_tokens_arg, int_arg, resolve_max_new_tokens, seeds_arg)
from dblock.decode_flags import check_fits, check_seed_span, decode_config, schedule_from_args
from dblock.model_flags import load_model, make_forward, model_config
from dblock.out_paths import check_out_dir
from dblock.prompts import encode_texts, load_tokenizer


def add_parser(sub) -> None:
    p = sub.add_parser("compare-schedules", help="every schedule on the same prompts and seeds (OBA paper tables)",
                       description=__doc__)
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="file: one prompt per line (text, or a JSON list of token ids)")
    add_special_tokens_arg(p)
    src.add_argument("--task", help="graded task name (e.g. arith): its held-out prompts, graded")
    p.add_argument("--n", type=int_arg(1, MAX_PROBLEMS), default=20,
                   help="with --task: number of held-out problems (default 20)")
    p.add_argument("--seeds", type=seeds_arg, default="0",
                   help="seed offsets, comma-separated (paper: 0,10000,20000); case i under offset s gets seed s+i")
    p.add_argument("--schedules", default=None,
                   help="comma-separated subset (default: native,native2c,flowblock,dense_mask,oba and the five "
                        "ablations)")
    p.add_argument("--batch-size", type=int_arg(1, MAX_BATCH), default=1,
                   help="requests per forward (default 1, as the paper measures r; in a larger batch r is the "
                        "schedule's pass over Native's on the same rows, timed beside every call, and β the "
                        "batch-composition factor: docs/counters.md)")
    p.add_argument("--trace-dir", default=None, help="write one JSON-lines trace per schedule here")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also write the break-even map and TPF/TPS bars relative to Native to this PNG "
                        "(needs matplotlib and native among --schedules)")
    p.add_argument("--progress", action="store_true", help="show progress bars")
    add_decode_args(p)
    add_executor_args(p)
    p.set_defaults(_run=run, max_new_tokens=None)     # None: the task's own length (code: 64), else 128
    add_flag_rules(p, FlagRule(("--schedule", "--seed"), "to one decoding run; compare-schedules runs every schedule "
                               "of --schedules, case i under seed offset s with seed s + i (--seeds)",
                               lambda a, c: False),
                   FlagRule("--n", "with --task (--prompts decodes every prompt of its file)",
                            lambda a, c: a.task is not None),
                   FlagRule("--allow-special-tokens", "with --prompts (the text of a task's prompts is never "
                            "special)", lambda a, c: a.prompts is not None))


def _prompts(args, folder, cfg):
    """(labelled prompts, grader or None) from --task or --prompts; nothing is loaded but tokenizer.json."""
    tok = load_tokenizer(folder)
    if args.task:
        from dblock.cli.tasks import task_from_name
        from dblock.tasks.evaluate import TokenizerAdapter, encode_task_prompts, prompts_and_grader
        if tok is None:
            raise ValueError(f"--task needs a tokenizer.json in {folder}")
        task = task_from_name(args.task)
        examples = task.examples("test", args.n)
        encode_task_prompts(TokenizerAdapter(tok), examples, args.task, args.model)      # named refusal first
        prompts, grader = prompts_and_grader(task, TokenizerAdapter(tok), examples)
        return [(f"--task {args.task} (test problem {i})", p) for i, p in enumerate(prompts)], grader
    path = args.prompts
    if os.path.isdir(path):
        raise IsADirectoryError(f"--prompts {path}: is a folder; give a file with one prompt per line")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prompts {path}: no such file")
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts {path}: not UTF-8 text (byte {e.start})") from None
    for i, line in enumerate(lines, 1):
        label = f"--prompts {path} line {i}"
        if not line.strip():
            continue
        if line.lstrip().startswith("["):
            try:
                ids = json.loads(line)
            except (ValueError, RecursionError):
                ids = None
            if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and not isinstance(x, bool)
                                                               for x in ids):
                raise ValueError(f"{label}: not a JSON list of token ids, e.g. [5, 6, 7]")
            prompts.append((label, ids))
        else:
            if tok is None:
                raise ValueError(f"{label}: a text prompt needs tokenizer.json in {folder}")
            prompts.append((label, encode_texts(tok, [line], cfg, [label], args.allow_special_tokens)[0]))
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return prompts, None


def run(args) -> int:
    from dblock.profiling.compare import DEFAULT_SCHEDULES, compare_schedules, format_table

    from dblock.decoding.schedules import schedule_spec

    if args.trace_dir is not None:
        check_out_dir(args.trace_dir, "--trace-dir")
    # refused from config.json and tokenizer.json before the weights are read
    folder, cfg = model_config(args)
    if args.task:
        from dblock.cli.tasks import task_from_name
        resolve_max_new_tokens(args, task_from_name(args.task))
    resolve_max_new_tokens(args)
    seeds = args.seeds if isinstance(args.seeds, list) else seeds_arg(args.seeds)
    if args.schedules is None:
        names = list(DEFAULT_SCHEDULES)
    else:
        names = [s.strip() for s in args.schedules.split(",")]
        if not any(names):
            raise ValueError(f"--schedules {args.schedules!r}: names no schedule; give a comma-separated subset of "
                             f"{','.join(DEFAULT_SCHEDULES)} (or leave --schedules out for all of them)")
    if args.plot and "native" not in names:
        raise ValueError(f"--plot {args.plot}: the plot is relative to Native: add native to --schedules")
    dec = decode_config(args, cfg.family, tokenizer=folder)
    schedule_from_args(args)
    labelled, grader = _prompts(args, folder, cfg)
    for name in names:
        try:
            spec = schedule_spec(name, args.window, args.gate)
        except ValueError as e:
            raise ValueError(f"--schedules {args.schedules}: {e}") from None
        check_fits(cfg, dec, spec, labelled)
    for s in seeds:
        check_seed_span(s, len(labelled), "--seeds")
    prompts = [p for _, p in labelled]
    model = load_model(args)
    fwd = make_forward(model, args)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    rows = compare_schedules(fwd, prompts, dec, names, seeds, args.batch_size, args.window, args.gate,
                             args.trace_dir, grader, args.progress)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(format_table(rows))
    if args.plot:
        from dblock.profiling.compare import plot
        plot(rows, args.plot)
    return 0
