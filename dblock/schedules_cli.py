"""`dblock compare-schedules`: Native(C), Native(2C), FlowBlock, Dense Mask, OBA and its ablations side by side."""
from __future__ import annotations

import json
import os

from dblock.cli_args import (add_decode_args, add_executor_args, add_model_args, decode_config, load_model,
                             load_tokenizer, make_forward)


def add_parser(sub) -> None:
    p = sub.add_parser("compare-schedules", help="every schedule on the same prompts and seeds (OBA paper tables)",
                       description=__doc__)
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="file: one prompt per line (text, or a JSON list of token ids)")
    src.add_argument("--task", help="graded task name (e.g. arith): its held-out prompts, graded")
    p.add_argument("--n", type=int, default=20, help="with --task: number of held-out problems (default 20)")
    p.add_argument("--seeds", default="0", help="seed offsets, comma-separated (paper: 0,10000,20000)")
    p.add_argument("--schedules", default=None,
                   help="comma-separated subset (default: native,native2c,flowblock,dense_mask,oba and the five "
                        "ablations)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="requests per forward (default 1: r is a batch-1 measurement, as in the paper)")
    p.add_argument("--trace-dir", default=None, help="write one JSON-lines trace per schedule here")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--progress", action="store_true", help="show progress bars")
    add_decode_args(p)
    add_executor_args(p)
    p.set_defaults(_run=run)


def _prompts(args, model):
    tok = load_tokenizer(model)
    if args.task:
        from dblock.tasks import answer_text, get_task
        from dblock.tasks.evaluate import TokenizerAdapter
        if tok is None:
            raise ValueError(f"--task needs a tokenizer.json in {model.source}")
        task = get_task(args.task)
        exs = task.examples("test", args.n)
        adapter = TokenizerAdapter(tok)
        prompts = [adapter.encode(e.prompt) for e in exs]
        by_ids = {tuple(p): e.prompt for p, e in zip(prompts, exs)}

        def grader(ids, out):
            return task.grade(by_ids[tuple(ids)], answer_text(out, adapter))
        return prompts, grader
    if not os.path.isfile(args.prompts):
        raise FileNotFoundError(f"--prompts {args.prompts}: no such file")
    prompts = []
    with open(args.prompts) as f:
        for i, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("["):
                try:
                    prompts.append([int(x) for x in json.loads(line)])
                except (ValueError, TypeError):
                    raise ValueError(f"{args.prompts}:{i}: not a JSON list of token ids") from None
            else:
                if tok is None:
                    raise ValueError(f"{args.prompts}:{i}: a text prompt needs tokenizer.json in {model.source}")
                prompts.append(tok.encode(line).ids)
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: no prompts in the file")
    return prompts, None


def run(args) -> int:
    from dblock.compare import DEFAULT_SCHEDULES, compare_schedules, format_table

    model = load_model(args)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds {args.seeds!r}: give comma-separated integers") from None
    names = [s.strip() for s in args.schedules.split(",")] if args.schedules else list(DEFAULT_SCHEDULES)
    prompts, grader = _prompts(args, model)
    dec = decode_config(args, model.config.family)
    fwd = make_forward(model, args)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    rows = compare_schedules(fwd, prompts, dec, names, seeds, args.batch_size, args.window, args.gate,
                             args.trace_dir, grader, args.progress)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(format_table(rows))
    return 0
