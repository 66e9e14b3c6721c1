"""`dblock <command>`: thin argparse front end. Parse, call library functions, print.

The command line is its own room, on top of every library room (docs/architecture.md): no library module imports
it. This package holds the command tree and, one module per room, that room's commands: `decoding.py`
(compare-schedules), `tasks.py` (train-tiny, eval, model-card), `equivalence.py` (verify), `serving.py` (serve,
loadgen) and `simulator.py` (simulate, over `simulator_oba.py`, `simulator_roofline.py`, `simulator_plan.py`,
`simulator_profile.py`, `simulator_published.py` and their shared `simulator_common.py`).

The command tree is plain argparse, built by `build_parser()`: this module's own commands (info, generate, make-tiny,
demo), then every room's commands, each from its module's `add_parser(subparsers)` (`ROOM_CLIS`, imported here
by name). Every subcommand carries its run function as `set_defaults(_run=fn)`; `main` calls `args._run(args)`.
Shared option groups live in `dblock.cli_args`, what the parsed flags become beside what they serve
(`dblock.decode_flags`, `dblock.model_flags`, `dblock.prompts`, `dblock.out_paths`); rooms import them from there,
not from here. Building the tree imports no torch: each run function imports what it needs.

Errors are one line on stderr with exit status 2 (set DBLOCK_DEBUG=1 to see the traceback): `dblock: error: ...`
for the errors a user can fix (`DblockError` and the standard `USER_ERRORS`), `dblock: internal error (Type): ...`
for anything else. Usage errors (an unknown flag, a value of the wrong type or out of its range) are one line too:
the parser is `dblock.cli_args.ArgumentParser`, and every numeric flag carries its range in its argparse `type`.
What depends on the model (block size, prompt + --max-new-tokens against the positions, token ids against the
vocabulary, the device) is checked from config.json before the weights are read.
"""
from __future__ import annotations

import json
import os
import sys

from dblock.cli_args import (ArgumentParser, FlagRule, add_batch_size_arg, add_decode_args, add_executor_args,
                             add_flag_rules, add_model_args, add_special_tokens_arg, check_flag_rules, int_arg, seed_arg)
from dblock.cli import decoding as decoding_cli
from dblock.cli import equivalence as equivalence_cli
from dblock.cli import serving as serving_cli
from dblock.cli import simulator as simulator_cli
from dblock.cli import tasks as tasks_cli
from dblock.decode_flags import check_fits, decode_config, schedule_from_args
from dblock.errors import DblockError, StdoutError
from dblock.model_flags import load_model, make_forward, model_config, prepare_triton
from dblock.out_paths import check_out_dir, check_out_file
from dblock.prompts import encode_texts, load_tokenizer, parse_ids
from dblock.ranks import is_rank0, under_torchrun

#: rooms whose commands follow this module's own, in `dblock --help` order
ROOM_CLIS = (simulator_cli, tasks_cli, equivalence_cli, serving_cli, decoding_cli)

#: besides `DblockError`, the exceptions whose message is meant for the user (`dblock: error: ...`)
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


# ---------------------------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------------------------

def _info_args(p):
    p.add_argument("model", help="model folder or bundled name")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _info(args) -> int:
    from dblock.info import model_info
    if not args.model.strip():
        raise ValueError("info: empty model name; give a model folder or a bundled name (tiny-masked, tiny-uniform)")
    info = model_info(args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"  {kk:28s} {vv}")
        else:
            print(f"{k:30s} {v}")
    return 0


def _generate_args(p):
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text (needs tokenizer.json in the model folder); repeat for a batch. The text of a "
                        "special token (<eos>, <mask>) stays plain text unless --allow-special-tokens")
    p.add_argument("--prompt-ids", action="append", default=None,
                   help="prompt token ids, comma-separated; repeat for a batch")
    add_special_tokens_arg(p)
    add_decode_args(p)
    add_executor_args(p)
    add_batch_size_arg(p)
    p.add_argument("--n", dest="samples", type=int_arg(1, 4096), default=1,
                   help="samples per prompt (default 1): every prompt is decoded n times with seeds --seed, "
                        "--seed+1, ...; outputs are printed prompt-major as [prompt.sample]")
    p.add_argument("--trace", default=None, help="write a JSON-lines per-pass trace to this file")
    p.add_argument("--json", action="store_true",
                   help="print {tokens, text, finish_reason, n, counters} as JSON (outputs prompt-major)")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    add_flag_rules(p, FlagRule("--allow-special-tokens", "with a text --prompt (--prompt-ids are token ids already)",
                               lambda a, c: bool(a.prompt)))


def _generate(args) -> int:
    from dblock.decoding.generate import generate
    from dblock.trace import TraceWriter

    if not args.prompt and not args.prompt_ids:
        raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3")
    if args.trace is not None:
        check_out_file(args.trace, "--trace")
    # everything that can be refused is refused from config.json and tokenizer.json, before the weights are read
    folder, cfg = model_config(args)
    dec = decode_config(args, cfg.family, tokenizer=folder)
    spec = schedule_from_args(args)
    texts = args.prompt or []
    labels = [f"--prompt [{i}]" if len(texts) > 1 else "--prompt" for i in range(len(texts))]
    if texts:
        tok = load_tokenizer(folder)
        if tok is None:
            raise ValueError(f"--prompt needs a tokenizer.json in {folder}; use --prompt-ids")
    else:
        tok = None
    prompts = encode_texts(tok, texts, cfg, labels, args.allow_special_tokens, folder)
    ids = args.prompt_ids or []
    prompts += [parse_ids(s) for s in ids]
    labels += [f"--prompt-ids [{i}]" if len(ids) > 1 else "--prompt-ids" for i in range(len(ids))]
    check_fits(cfg, dec, spec, list(zip(labels, prompts)))
    model = load_model(args)
    if tok is None:
        tok = load_tokenizer(folder)
    fwd = make_forward(model, args)
    with TraceWriter(args.trace if is_rank0() else None) as tr:
        if tr.enabled:
            tr.run_header(model=args.model, family=model.config.family, executor=fwd.name, schedule=spec.name,
                          decode=vars(dec), gate=spec.gate if spec.name.startswith("flowblock") else None)
        show = (args.progress or len(prompts) > 8) and is_rank0()
        res = generate(fwd, prompts, dec, spec, trace=tr, progress=show, batch_size=args.batch_size)
    texts = [tok.decode(t, skip_special_tokens=True) for t in res.tokens] if tok is not None else None
    out = {"tokens": res.tokens, "finish_reason": res.finish_reasons, "n": res.n,
           "counters": {"summary": res.summary(), "per_request": [c.as_dict() for c in res.counters]}}
    if texts is not None:
        out["text"] = texts
    if args.json:
        print(json.dumps(out))
        return 0
    for i, t in enumerate(res.tokens):
        label = f"[{i}]" if res.n == 1 else f"[{i // res.n}.{i % res.n}]"
        print(f"{label} " + (texts[i] if texts is not None else ",".join(map(str, t))))
    s = res.summary()
    print(f"Y={s['Y']} K={s['K']} F={s['F']} Q={s['Q']} TPF={s['TPF']:.3f} T_den={s['T_den_ms']:.2f}ms "
          f"TPS={s['TPS']:.1f} wall_TPS={s['wall_TPS']:.1f}")
    return 0


def _make_tiny_args(p):
    p.add_argument("--family", required=True, choices=["llada2_moe", "llada_moe", "diffusion_gemma"],
                   help="model family")
    p.add_argument("--out", required=True, help="output folder (config.json + model.safetensors)")
    p.add_argument("--seed", type=seed_arg, default=0, help="weight seed in [0, 2**63-1]")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out as a whole when it holds something (default: refuse a non-empty folder)")


def _make_tiny(args) -> int:
    from dblock.tiny import make_tiny
    check_out_dir(args.out, "--out")
    make_tiny(args.family, args.out, seed=args.seed, overwrite=args.overwrite)
    print(f"wrote a random tiny {args.family} checkpoint to {args.out}")
    return 0


def _demo_args(p):
    p.add_argument("--n", type=int_arg(1, 100_000), default=None, help="problems per row (default: the demo's own)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def _demo(args) -> int:
    from dblock.demo import run_demo
    return run_demo(n=args.n, as_json=args.json)


def _add_command(sub, name: str, help_: str, add_arguments, run):
    p = sub.add_parser(name, help=help_, description=help_)
    add_arguments(p)
    p.set_defaults(_run=run)
    return p


def add_parser(sub) -> None:
    """This module's own commands."""
    _add_command(sub, "info", "config summary, total and active parameters, weight memory", _info_args, _info)
    _add_command(sub, "generate", "decode prompts and print tokens and counters", _generate_args, _generate)
    _add_command(sub, "make-tiny", "write a random tiny checkpoint in the real HF format", _make_tiny_args,
                 _make_tiny)
    _add_command(sub, "demo", "the main job: decode held-out problems on the bundled models, one table", _demo_args,
                 _demo)


def build_parser():
    ap = ArgumentParser(prog="dblock", description="Block-diffusion MoE LMs: reference and Epoch "
                                 "executors, One Block Ahead schedules, equivalence suite, simulator.")
    ap.add_argument("--threads", type=int_arg(1, 1024), default=os.environ.get("DBLOCK_THREADS", "1"),
                    help="CPU intra-op threads for torch (default 1, or $DBLOCK_THREADS: the bundled models are "
                         "tiny, and extra threads only spin on a busy machine; raise it for real checkpoints)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    add_parser(sub)
    for room in ROOM_CLIS:
        room.add_parser(sub)
    return ap


def error_kind(e: BaseException) -> str:
    """`error` for what the user can fix, `internal error (Type)` for a bug."""
    return "error" if isinstance(e, (DblockError,) + USER_ERRORS) else f"internal error ({type(e).__name__})"


def main(argv=None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:              # --help (0) or a usage error, already printed as one line (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if not args.command:
        ap.print_help(sys.stderr)
        print("dblock: error: give a command (the list above; `dblock COMMAND --help` for one)", file=sys.stderr)
        return 2
    try:
        check_flag_rules(args)           # a flag given where it would do nothing: refused before anything runs
    except DblockError as e:
        print(f"dblock: error: {e}", file=sys.stderr)
        return 2
    prepare_triton(args)                 # --use-triton without CUDA: interpreter mode, before triton is imported
    import torch
    torch.set_num_threads(args.threads)
    prog = "dblock"
    if under_torchrun():                 # every rank runs the command; rank 0 alone prints results
        prog = f"dblock[rank {os.environ['RANK']}]"
        if not is_rank0():
            sys.stdout = open(os.devnull, "w")
            os.environ["TQDM_DISABLE"] = "1"     # progress bars too (tqdm >= 4.66 reads it)
    out = sys.stdout
    sys.stdout = _Stdout(out)
    try:
        rc = args._run(args) or 0
        sys.stdout.flush()               # a full disk behind `> file` shows here, not at exit
        return rc
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line, no traceback (DBLOCK_DEBUG=1 re-raises)
        if os.environ.get("DBLOCK_DEBUG"):
            raise
        if isinstance(e, StdoutError):
            _drop_stdout(out)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{prog}: {error_kind(e)}: {msg}", file=sys.stderr)
        return 2
    finally:
        if isinstance(sys.stdout, _Stdout):
            sys.stdout = out


class _Stdout:
    """sys.stdout while a command runs: a write or flush that fails (ENOSPC, EFBIG, EPIPE) is one StdoutError naming
    stdout and the cause, instead of an `internal error (OSError)` from whichever print happened to flush."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _stdout_error(e) from None

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as e:
            raise _stdout_error(e) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _stdout_error(e: OSError) -> StdoutError:
    import errno
    cause = (f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}" if e.errno else str(e) or type(e).__name__)
    return StdoutError(f"stdout: could not be written ({cause}); the output is incomplete")


def _drop_stdout(stream) -> None:
    """After a failed write to stdout: point its file descriptor at /dev/null, so that the interpreter's flush at
    exit (of what is still buffered) cannot fail a second time with a traceback."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
