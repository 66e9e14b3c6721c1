"""`dblock <command>`: thin argparse front end. Parse, call library functions, print.

Errors are one line on stderr with exit status 2 (set DBLOCK_DEBUG=1 to see the traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

COMMANDS = {}  # name -> (add_arguments(parser), run(args) -> int)


def command(name: str, help: str):
    def deco(fn_pair):
        COMMANDS[name] = (help, *fn_pair)
        return fn_pair
    return deco


# ---------------------------------------------------------------------------------------------------------------
# shared option groups
# ---------------------------------------------------------------------------------------------------------------

def add_model_args(p, required=True):
    p.add_argument("--model", required=required,
                   help="model folder (HF config.json + safetensors) or bundled name: tiny-masked, tiny-uniform")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float64", "float16"],
                   help="compute dtype (default: float32 on cpu, the stored dtype on cuda)")


def add_decode_args(p):
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=int, default=128, help="generation budget per request (default 128)")
    g.add_argument("--block-size", type=int, default=None, help="block size C (default: the model's)")
    g.add_argument("--rule", default=None, choices=["threshold", "fixed-k", "entropy-bound"],
                   help="step rule (default: threshold for masked models, entropy-bound for uniform-state)")
    g.add_argument("--threshold", type=float, default=0.95, help="threshold rule: commit when confidence >= tau")
    g.add_argument("--max-steps", type=int, default=64, help="threshold rule: passes per block before commit-all")
    g.add_argument("--steps", type=int, default=None,
                   help="fixed-k: passes per block (default 32); entropy-bound: denoising steps N (default 48)")
    g.add_argument("--no-cache", action="store_true",
                   help="llada2_moe: recompute the whole prefix every pass instead of the exact KV cache")
    g.add_argument("--seed", type=int, default=0,
                   help="noise seed (uniform-state; Native: same stream as torch.manual_seed(S) + transformers)")
    g.add_argument("--entropy-bound", type=float, default=0.1, help="entropy-bound rule: budget b (default 0.1)")
    g.add_argument("--temperature", default="0.8,0.4", help="entropy-bound rule: t_max,t_min (default 0.8,0.4)")
    g.add_argument("--stability", type=int, default=1, help="entropy-bound stop: argmax stable for this many steps")
    g.add_argument("--confidence", type=float, default=0.005, help="entropy-bound stop: mean entropy below this")
    g.add_argument("--schedule", default="native",
                   help="native | native2c | oba | dense_mask | flowblock | drop_time | keep_signal | keep_tokens "
                        "| no_accept | no_signal (default native)")
    g.add_argument("--window", type=int, default=None, help="flowblock: blocks in flight W (2..4, default 2)")
    g.add_argument("--gate", type=float, default=None, help="flowblock: readiness gate gamma (default 0.5)")


def add_executor_args(p):
    g = p.add_argument_group("executor")
    g.add_argument("--executor", default="reference", choices=["reference", "epoch"],
                   help="reference (dense, readable) or epoch (optimized: Expert Atlas + LSP + FreshLane)")
    g.add_argument("--epoch-config", default="epoch", choices=["epoch", "full_compute", "no_atlas", "no_lsp", "dense"],
                   help="epoch executor configuration (default epoch: all on)")
    g.add_argument("--refresh", type=int, default=None, help="LSP refresh period M_C (default 5)")
    g.add_argument("--atlas-alpha", type=float, default=None, help="Expert Atlas coverage floor alpha (default 0.9)")
    g.add_argument("--atlas-q", type=float, default=None, help="Expert Atlas covered-token quota q (default 0.95)")
    g.add_argument("--update-every", type=int, default=None, help="Expert Atlas hot-update period in passes (default 4)")
    g.add_argument("--atlas-m", type=int, default=None, help="Expert Atlas extra candidates per token (default K)")
    g.add_argument("--atlas-B", type=int, default=None,
                   help="Expert Atlas initial support size (default min(E, 4K))")
    g.add_argument("--atlas-beta", type=float, default=None, help="Expert Atlas score weight beta (default 1)")
    g.add_argument("--atlas-c", type=int, default=None, help="Expert Atlas experts added per repair round (default K)")
    g.add_argument("--use-triton", action="store_true",
                   help="run the epoch executor's Triton kernels (interpreter on a machine without a GPU)")
    # expert/sequence-parallel MoE on torch.distributed (dblock.optimized.ep)
    g.add_argument("--ep", type=int, default=None,
                   help="expert-parallel ranks: launch with torchrun --nproc-per-node N -m dblock ... --ep N (gloo on "
                        "cpu, NCCL on cuda; default: the launcher's world size, or 1 process without torchrun; "
                        "--ep 1 runs the distributed code path in one process)")
    g.add_argument("--ep-dispatch", default="freshlane", choices=["freshlane", "dense"],
                   help="with --ep / torchrun: move only fresh rows (freshlane, default) or every row (dense, for "
                        "comparison); traces count both either way")


def decode_config(args, family: str):
    from dblock.config import ConfigError, DecodeConfig
    try:
        temp = tuple(float(x) for x in args.temperature.split(","))
    except ValueError:
        raise ConfigError(f"--temperature {args.temperature!r}: give t_max,t_min, e.g. 0.8,0.4") from None
    rule = args.rule or ("entropy-bound" if family == "diffusion_gemma" else "threshold")
    if family == "diffusion_gemma" and rule != "entropy-bound":
        raise ConfigError(f"--rule {rule}: diffusion_gemma is uniform-state and decodes with entropy-bound")
    return DecodeConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size, rule=rule,
                        threshold=args.threshold, max_steps=args.max_steps, steps=args.steps,
                        no_cache=args.no_cache, seed=args.seed, entropy_bound=args.entropy_bound,
                        temperature=temp, stability=args.stability, confidence=args.confidence).validate()


def load_model(args):
    import dblock
    dtype = args.dtype or ("float32" if args.device == "cpu" else None)
    device = args.device
    if device == "cuda" and "LOCAL_RANK" in os.environ:      # torchrun: one GPU per process
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    return dblock.load(args.model, dtype=dtype, device=device)


def under_torchrun() -> bool:
    """Started by torchrun: every rank runs the command, rank 0 prints and writes files."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def make_forward(model, args):
    """The executor chosen on the command line, over the loaded model's weights."""
    from dblock.decoding.generate import reference_forward
    ep = getattr(args, "ep", None)
    if ep is not None and (getattr(args, "executor", "reference") == "reference" or args.epoch_config == "dense"):
        raise ValueError(f"--ep {ep}: expert parallelism runs the epoch executor; add --executor epoch (and an "
                         "--epoch-config other than dense)")
    if getattr(args, "executor", "reference") == "reference":
        return reference_forward(model)
    from dblock.optimized.executor import epoch_forward
    dispatcher = None
    if (ep is not None or under_torchrun()) and args.epoch_config != "dense":
        from dblock.optimized.ep import dispatcher_from_cli
        dispatcher = dispatcher_from_cli(model, ep, args.ep_dispatch, str(model.embed.weight.device))
    return epoch_forward(model, args.epoch_config, refresh=args.refresh, atlas_alpha=args.atlas_alpha,
                         atlas_q=args.atlas_q, update_every=args.update_every, use_triton=args.use_triton,
                         dispatcher=dispatcher, atlas_m=args.atlas_m, atlas_B=args.atlas_B,
                         atlas_beta=args.atlas_beta, atlas_c=args.atlas_c)


def load_tokenizer(model):
    """The model folder's tokenizer.json through the `tokenizers` package, or None."""
    path = os.path.join(getattr(model, "source", ""), "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


def parse_ids(s: str) -> list:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids {s!r}: give comma-separated integers, e.g. 5,6,7") from None
    if not ids:
        raise ValueError("--prompt-ids: empty")
    return ids


# ---------------------------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------------------------

def _info_args(p):
    p.add_argument("model", help="model folder or bundled name")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _info(args) -> int:
    from dblock.info import model_info
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


command("info", "config summary, total and active parameters, weight memory")((_info_args, _info))


def _generate_args(p):
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text (needs tokenizer.json in the model folder); repeat for a batch")
    p.add_argument("--prompt-ids", action="append", default=None,
                   help="prompt token ids, comma-separated; repeat for a batch")
    add_decode_args(p)
    add_executor_args(p)
    p.add_argument("--batch-size", type=int, default=None, help="requests per forward (default: all)")
    p.add_argument("--trace", default=None, help="write a JSON-lines per-pass trace to this file")
    p.add_argument("--json", action="store_true", help="print {tokens, text, counters} as JSON")
    p.add_argument("--progress", action="store_true", help="show a progress bar")


def _generate(args) -> int:
    from dblock.decoding.generate import generate
    from dblock.decoding.schedules import schedule_spec
    from dblock.trace import TraceWriter

    if not args.prompt and not args.prompt_ids:
        raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3")
    model = load_model(args)
    tok = load_tokenizer(model)
    prompts = []
    if args.prompt:
        if tok is None:
            raise ValueError(f"--prompt needs a tokenizer.json in {model.source}; use --prompt-ids")
        prompts += [tok.encode(t).ids for t in args.prompt]
    prompts += [parse_ids(s) for s in args.prompt_ids or []]
    dec = decode_config(args, model.config.family)
    spec = schedule_spec(args.schedule, args.window, args.gate)
    fwd = make_forward(model, args)
    with TraceWriter(args.trace if is_rank0() else None) as tr:
        if tr.enabled:
            tr.run_header(model=args.model, family=model.config.family, executor=fwd.name, schedule=spec.name,
                          decode=vars(dec))
        show = (args.progress or len(prompts) > 8) and is_rank0()
        res = generate(fwd, prompts, dec, spec, trace=tr, progress=show, batch_size=args.batch_size)
    texts = [tok.decode(t, skip_special_tokens=True) for t in res.tokens] if tok is not None else None
    out = {"tokens": res.tokens, "counters": {"summary": res.summary(),
                                              "per_request": [c.as_dict() for c in res.counters]}}
    if texts is not None:
        out["text"] = texts
    if args.json:
        print(json.dumps(out))
        return 0
    for i, t in enumerate(res.tokens):
        print(f"[{i}] " + (texts[i] if texts is not None else ",".join(map(str, t))))
    s = res.summary()
    print(f"Y={s['Y']} K={s['K']} F={s['F']} Q={s['Q']} TPF={s['TPF']:.3f} T_den={s['T_den_ms']:.2f}ms "
          f"TPS={s['TPS']:.1f} wall_TPS={s['wall_TPS']:.1f}")
    return 0


command("generate", "decode prompts and print tokens and counters")((_generate_args, _generate))


def _make_tiny_args(p):
    p.add_argument("--family", required=True, choices=["llada2_moe", "llada_moe", "diffusion_gemma"],
                   help="model family")
    p.add_argument("--out", required=True, help="output folder (config.json + model.safetensors)")
    p.add_argument("--seed", type=int, default=0, help="weight seed")


def _make_tiny(args) -> int:
    from dblock.tiny import make_tiny
    make_tiny(args.family, args.out, seed=args.seed)
    print(f"wrote a random tiny {args.family} checkpoint to {args.out}")
    return 0


command("make-tiny", "write a random tiny checkpoint in the real HF format")((_make_tiny_args, _make_tiny))


def _demo_args(p):
    p.add_argument("--n", type=int, default=None, help="problems per row (default: the demo's own)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def _demo(args) -> int:
    from dblock.demo import run_demo
    return run_demo(n=args.n, as_json=args.json)


command("demo", "the main job: decode held-out problems on the bundled models, one table")((_demo_args, _demo))


ROOMS = ("dblock.simulator.cli", "dblock.tasks.cli", "dblock.equivalence.cli", "dblock.serving.cli",
         "dblock.schedules_cli", "dblock.optimized.cli")


def _room_modules():
    """Rooms ship their own commands: a module with `add_parser(subparsers)` and `main(args) -> int`."""
    import importlib
    mods = []
    for name in ROOMS:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name != name:  # a real missing dependency inside the room: surface it
                raise
    return mods


def build_parser():
    ap = argparse.ArgumentParser(prog="dblock", description="Block-diffusion MoE LMs: reference and Epoch "
                                 "executors, One Block Ahead schedules, equivalence suite, simulator.")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("DBLOCK_THREADS", "1")),
                    help="CPU intra-op threads for torch (default 1, or $DBLOCK_THREADS: the bundled models are "
                         "tiny, and extra threads only spin on a busy machine; raise it for real checkpoints)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    runners = {}
    for name, (help_, add, run) in COMMANDS.items():
        add(sub.add_parser(name, help=help_, description=help_))
        runners[name] = run
    for mod in _room_modules():
        before = set(sub.choices)
        mod.add_parser(sub)
        for name in set(sub.choices) - before:
            runners[name] = mod.main
    ap.set_defaults(_runners=runners)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.command:
        ap.print_help()
        return 2
    if args.threads < 1:
        print(f"dblock: error: --threads {args.threads}: must be >= 1", file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(args.threads)
    prog = "dblock"
    if under_torchrun():                 # every rank runs the command; rank 0 alone prints results
        prog = f"dblock[rank {os.environ['RANK']}]"
        if not is_rank0():
            sys.stdout = open(os.devnull, "w")
            os.environ["TQDM_DISABLE"] = "1"     # progress bars too (tqdm >= 4.66 reads it)
    try:
        return args._runners[args.command](args) or 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line, no traceback (DBLOCK_DEBUG=1 re-raises)
        if os.environ.get("DBLOCK_DEBUG"):
            raise
        known = ("ConfigError", "WeightsError", "ValueError", "FileNotFoundError", "TaskError", "EPTimeoutError",
                 "EPError")
        kind = "error" if type(e).__name__ in known else f"internal error ({type(e).__name__})"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{prog}: {kind}: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
