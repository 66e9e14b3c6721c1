"""`dblock verify`: differential testing of the optimized executor against the reference (the equivalence room's
command; `dblock.cli` calls `add_parser`, the subcommand runs `_verify` through `set_defaults(_run=...)`).

    dblock verify --model tiny-masked --task arith --n 20                      # report, exit 0 when all holds
    dblock verify --model tiny-masked --task arith --n 20 --json > report.json
    dblock verify --model M --prompts prompts.txt --schedule oba --epoch-config no_atlas
    dblock verify --model tiny-masked --task arith --inject-fault stale-cache  # self-check: must exit 1, naming it
    dblock verify --model tiny-masked --task arith --staleness-curve --plot staleness.png
    dblock verify --model tiny-masked --task arith --check all --world-sizes 1,2,4

Exit status: 0 all invariants hold and decisions agree within --max-disagreement; 1 an invariant broke (named), too
many decision disagreements, or a degenerate check failed; 3 an injected fault was NOT caught (the self-check
failed); 2 usage or loading errors. Details in `dblock.equivalence.report`.
"""
from __future__ import annotations

import json
import os
import sys

from dblock.cli_args import (MAX_PROBLEMS, FlagRule, ValueRefused, add_batch_size_arg, add_decode_args,
                             add_executor_args, add_flag_rules, add_model_args, add_special_tokens_arg, float_arg,
                             int_arg, resolve_max_new_tokens)
from dblock.decode_flags import check_fits, decode_config, schedule_from_args
from dblock.model_flags import _path_model, load_model, model_config
from dblock.out_paths import check_out_file
from dblock.prompts import encode_texts, load_tokenizer

CHECKS = ("full-compute", "paired-block", "world-size")


def _world_sizes(s: str) -> list:
    try:
        out = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueRefused(s, "give comma-separated integers, e.g. 1,2,4") from None
    if not out or any(not 1 <= w <= 64 for w in out):
        raise ValueRefused(s, "world sizes must lie in [1, 64]")
    return out


def add_parser(subparsers):
    from dblock.equivalence.report import APPROX_MAX_DISAGREEMENT, FAULTS
    p = subparsers.add_parser(
        "verify", help="differential test of the optimized executor against the reference (exit 1 on violations)",
        description="Teacher-forced shadow comparison of the optimized (Epoch) executor against the dense "
                    "reference on the same inputs at every pass: logits and routed-output differences per layer, "
                    "decision margins and agreement, every margin violation, cache ages, Expert Atlas coverage, "
                    "invariants (staleness, coverage, support-only routing, block-boundary clearing, "
                    "newly-decoded-never-served, LM head for every live row), end-to-end token agreement and "
                    "accuracy. Exit status 0 when everything holds, 1 when an invariant breaks or decisions "
                    "disagree beyond --max-disagreement, 3 when an injected fault goes uncaught.")
    add_model_args(p)
    src = p.add_argument_group("workload (give --task or --prompts)")
    src.add_argument("--task", default=None, help="graded task for prompts and accuracy, e.g. arith")
    src.add_argument("--n", type=int_arg(1, MAX_PROBLEMS), default=20, help="task problems to decode (default 20)")
    src.add_argument("--split", default="test", choices=["test", "train"], help="task split (default test)")
    src.add_argument("--prompts", default=None,
                     help="file with one prompt per line: text (needs the model's tokenizer.json) or comma-separated "
                          "token ids; or a JSON list of strings / id lists")
    add_special_tokens_arg(p)
    add_decode_args(p)
    add_executor_args(p)
    p.set_defaults(executor="epoch", _run=_verify, max_new_tokens=None)   # None: the task's length, else 128
    v = p.add_argument_group("verification")
    v.add_argument("--json", action="store_true", help="print the whole report as one JSON object")
    v.add_argument("--out", default=None, help="also write the JSON report to this file")
    v.add_argument("--max-disagreement", type=float_arg(0.0, 1.0), default=None,
                   help="largest tolerated share of live-row decisions that differ from the reference on the same "
                        f"inputs (default 0 for full_compute/dense, {APPROX_MAX_DISAGREEMENT} for the approximate "
                        "configurations epoch/no_atlas/no_lsp)")
    v.add_argument("--inject-fault", action="append", default=[], choices=sorted(FAULTS),
                   help="self-check of the checker: run a deliberately broken executor (repeatable); verify must "
                        "exit 1 naming the violation (" + ", ".join(f"{k} -> {w}" for k, w in FAULTS.items()) + ")")
    v.add_argument("--staleness-curve", action="store_true",
                   help="cosine of cached vs fresh routed-expert outputs by age, decoded vs live rows: table + PNG")
    v.add_argument("--max-age", type=int_arg(1, 1024), default=8, help="staleness curve: largest age k (default 8)")
    v.add_argument("--plot", default="staleness_curve.png",
                   help="staleness curve PNG path (default staleness_curve.png)")
    v.add_argument("--check", action="append", default=[], choices=CHECKS + ("all",),
                   help="degenerate exactness checks (repeatable): full-compute (= reference tokens), paired-block "
                        "(OBA current block = the block alone, fp64), world-size (expert parallelism W vs 1)")
    v.add_argument("--world-sizes", type=_world_sizes, default=[1, 2, 4],
                   help="world-size check: gloo world sizes (default 1,2,4)")
    v.add_argument("--no-probe", action="store_true",
                   help="skip the liveness probe (fixed-k, one position per pass, exercises cache ages up to M_C-1)")
    v.add_argument("--no-e2e", action="store_true", help="skip the separate end-to-end reference run")
    add_batch_size_arg(v)
    v.add_argument("--limit", type=int_arg(0, 1_000_000), default=20,
                   help="text output: list at most this many items per kind")
    add_flag_rules(p, FlagRule(("--n", "--split"), "with --task (--prompts decodes every prompt of its file)",
                               lambda a, c: a.task is not None),
                   FlagRule("--allow-special-tokens", "with --prompts (the text of a task's prompts is never "
                            "special)", lambda a, c: a.prompts is not None),
                   FlagRule(("--max-age", "--plot"), "with --staleness-curve", lambda a, c: a.staleness_curve),
                   FlagRule("--world-sizes", "with --check world-size (or --check all)",
                            lambda a, c: bool({"world-size", "all"} & set(a.check))),
                   FlagRule("--limit", "to the text report (--json prints everything)", lambda a, c: not a.json))


def read_prompt_items(path: str) -> list:
    """(label, item) per prompt of a file: JSON (a list of strings or id lists) or one prompt per line; an item is
    a list of ids or a text (comma-separated digits are ids). Every problem names the file and the line or item."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"--prompts {path}: is a folder; give a file with one prompt per line")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prompts {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts {path}: not UTF-8 text (byte {e.start})") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"--prompts {path}: not valid JSON ({str(e)[:80]})") from None
        if not isinstance(items, list):
            raise ValueError(f"--prompts {path}: a JSON file must hold a list of prompts")
        labelled = [(f"--prompts {path} item {i + 1}", it) for i, it in enumerate(items)]
    else:
        labelled = [(f"--prompts {path} line {i + 1}", line) for i, line in enumerate(text.splitlines())
                    if line.strip()]
    out = []
    for label, it in labelled:
        if isinstance(it, list):
            if not it or not all(isinstance(x, int) and not isinstance(x, bool) for x in it):
                raise ValueError(f"{label}: a list of token ids must hold one or more integers")
            out.append((label, list(it)))
        elif isinstance(it, str) and it.replace(",", "").replace(" ", "").isdigit():
            out.append((label, [int(x) for x in it.replace(" ", "").split(",") if x]))
        elif isinstance(it, str):
            out.append((label, it))
        else:
            raise ValueError(f"{label}: neither text nor a list of token ids")
    if not out:
        raise ValueError(f"--prompts {path}: no prompts")
    return out


def read_prompts(path: str, tok, cfg=None, allow_special: bool = False) -> list:
    """Prompts from a file (see `read_prompt_items`) as token ids. Text goes through `tok`: a `tokenizers.Tokenizer`
    (or `CharTokenizer`) with `dblock.prompts.encode_texts` (special-token text stays plain text unless
    `allow_special`), any other object through its own `encode(text) -> ids`; None refuses text prompts."""
    out = []
    for label, it in read_prompt_items(path):
        if isinstance(it, str):
            if tok is None:
                raise ValueError(f"{label}: text prompt but the model has no tokenizer.json; give comma-separated "
                                 "token ids")
            if hasattr(tok, "to_str") or hasattr(tok, "hf") or hasattr(tok, "token_to_id"):
                it = encode_texts(tok, [it], cfg, [label], allow_special)[0]
            else:                                   # a caller's own encoder: encode(text) -> ids
                it = list(tok.encode(it))
        out.append(it)
    return out


def _verify(args) -> int:
    from dblock.equivalence.report import format_report
    from dblock.equivalence.verify import run_verify

    if (args.task is None) == (args.prompts is None):
        raise ValueError("give exactly one of --task T (with --n N) or --prompts FILE")
    if args.out is not None:
        check_out_file(args.out, "--out")
    if args.staleness_curve:
        check_out_file(args.plot, "--plot")
    # refused from config.json and tokenizer.json before the weights are read
    folder, cfg = model_config(args)
    if args.task is not None:
        from dblock.cli.tasks import task_from_name
        resolve_max_new_tokens(args, task_from_name(args.task))
    resolve_max_new_tokens(args)
    dec = decode_config(args, cfg.family, tokenizer=folder)
    spec = schedule_from_args(args)
    task = examples = tok = None
    hf = load_tokenizer(folder)
    if args.task is not None:
        from dblock.cli.tasks import task_from_name
        from dblock.tasks.evaluate import TokenizerAdapter, encode_task_prompts
        task = task_from_name(args.task)
        if hf is None:
            raise FileNotFoundError(f"{folder}/tokenizer.json: the model folder has no tokenizer.json (needed to "
                                    "encode task prompts)")
        tok = TokenizerAdapter(hf)
        examples = task.examples(args.split, args.n)
        prompts = encode_task_prompts(tok, examples, args.task, args.model, args.split)
        labels = [f"--task {args.task} ({args.split} problem {i})" for i in range(len(prompts))]
    else:
        items = read_prompt_items(args.prompts)
        labels = [label for label, _ in items]
        prompts = read_prompts(args.prompts, hf, cfg, args.allow_special_tokens)
    check_fits(cfg, dec, spec, list(zip(labels, prompts)))
    model = load_model(args)
    checks = list(CHECKS) if "all" in args.check else list(dict.fromkeys(args.check))
    epoch_kw = dict(refresh=args.refresh, atlas_alpha=args.atlas_alpha, atlas_q=args.atlas_q,
                    update_every=args.update_every, use_triton=args.use_triton, atlas_m=args.atlas_m,
                    atlas_B=args.atlas_B, atlas_beta=args.atlas_beta, atlas_c=args.atlas_c, path=args.epoch_path,
                    margin_refresh=args.margin_refresh, lsp_drift=args.lsp_drift,
                    path_model=_path_model(args.path_profile))
    if getattr(args, "ep", None) is not None:
        from dblock.optimized.ep import dispatcher_from_cli
        epoch_kw["dispatcher"] = dispatcher_from_cli(model, args.ep, args.ep_dispatch, args.device)
    quiet = args.json
    rep = run_verify(model, prompts, dec, spec, executor=args.executor, config=args.epoch_config, epoch_kw=epoch_kw,
                     faults=args.inject_fault, probe=not args.no_probe, e2e=not args.no_e2e, task=task,
                     task_examples=examples, tokenizer=tok,
                     staleness_ages=args.max_age if args.staleness_curve else 0,
                     plot_path=args.plot if args.staleness_curve else None, checks=checks,
                     world_sizes=args.world_sizes, max_disagreement=args.max_disagreement,
                     batch_size=args.batch_size, model_name=args.model,
                     progress=None if quiet else (lambda m: print(f"verify: {m} ...", file=sys.stderr)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    if args.json:
        print(json.dumps(rep))
    else:
        print(format_report(rep, limit=args.limit))
    return rep["exit"]["status"]

