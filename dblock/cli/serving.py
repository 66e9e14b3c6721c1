"""`dblock serve` (OpenAI-compatible server over the engine) and `dblock loadgen` (Poisson load generator).

Thin: parse, call the library, print. `dblock.cli` imports this module and calls `add_parser`.
"""
from __future__ import annotations

import json
import os
import sys

from dblock.cli_args import (FlagRule, add_decode_args, add_executor_args, add_flag_rules, add_model_args, float_arg,
                             int_arg, port_arg, seed_arg)
from dblock.decode_flags import check_fits, check_stops, decode_config, positions_needed, schedule_from_args
from dblock.model_flags import load_model, make_forward, model_config
from dblock.out_paths import check_out_file
from dblock.prompts import load_tokenizer
from dblock.tasks import BUNDLED_TASK

API_KEY_ENV = "DBLOCK_API_KEY"


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated numbers, e.g. 2,4,8") from None
    if not vals:
        raise ValueError(f"{text!r}: no numbers")
    return vals


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server: continuous batching at pass granularity",
                              description="Serve a model over HTTP, OpenAI-compatible: POST /v1/completions and "
                                          "/v1/chat/completions (stream committed blocks as server-sent events), "
                                          "GET /v1/models, POST /tokenize and /detokenize, GET /version, GET /health, "
                                          "GET /metrics (Prometheus). Binds 127.0.0.1 unless told otherwise.")
    p.set_defaults(_run=_serve)
    add_model_args(p)
    add_decode_args(p, serving=True)     # requests may sample whatever the defaults: no SAMPLING_RULES
    add_executor_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    g.add_argument("--port", type=port_arg, default=8000,
                   help="TCP port in [1, 65535] (default 8000; 0 = any free port, printed at startup)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: ${API_KEY_ENV}"
                        " if set; prefer the variable: a command line is visible to other users)")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="allow binding a non-loopback address without an API key")
    g.add_argument("--served-model-name", default=None, help="model name in responses (default: the --model value)")
    g.add_argument("--chat-template", default=None, metavar="PATH_OR_STRING",
                   help="Jinja chat template for /v1/chat/completions: a file or the template text (default: the "
                        "model folder's chat_template.jinja, else tokenizer_config.json's chat_template)")
    g.add_argument("--template-timeout", type=float_arg(0.0, 3600.0, lo_open=True), default=2.0, metavar="SECONDS",
                   help="a chat-template render is stopped (400) after this long; it runs in a worker process, so "
                        "other requests and /health go on meanwhile (default 2 s)")
    g.add_argument("--template-max-chars", type=int_arg(1, 1 << 30), default=1_000_000, metavar="N",
                   help="a chat-template render writing more than N characters is stopped (400) (default 1000000)")
    g.add_argument("--max-batch", type=int_arg(1, 1 << 16), default=16,
                   help="most requests in one pass (batch cap; default 16)")
    g.add_argument("--max-queue", type=int_arg(1, 1 << 24), default=256,
                   help="most requests waiting for admission; beyond it 429 (default 256)")
    g.add_argument("--kv-budget-tokens", type=int_arg(1, 1 << 40), default=65536,
                   help="KV positions reserved by running requests at most (prompt + max_tokens on the block grid "
                        "per request); a request needing more than all of it gets 400 (default 65536)")
    g.add_argument("--max-body-bytes", type=int_arg(1, 1 << 34), default=1 << 20,
                   help="request body limit, 413 above (default 1 MiB)")
    g.add_argument("--max-prompt-tokens", type=int_arg(1, 1 << 24), default=4096,
                   help="prompt length limit, 400 above (default 4096)")
    g.add_argument("--max-tokens-limit", type=int_arg(1, 1 << 24), default=1024,
                   help="max_tokens limit, 400 above (default 1024)")
    g.add_argument("--drain-timeout", type=float_arg(0.0, 1e6), default=300.0,
                   help="on SIGINT/SIGTERM wait at most this long for in-flight requests (default 300 s)")
    g.add_argument("--request-timeout", type=float_arg(0.0, 1e6, lo_open=True), default=30.0, metavar="SECONDS",
                   help="a client must send a request's headers within this long (else the connection is closed), "
                        "then its body within this long again (else 408) (default 30 s)")
    g.add_argument("--trace", default=None, help="write a JSON-lines engine trace (passes, blocks, requests)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])

    lg = subparsers.add_parser("loadgen", help="Poisson load generator: throughput, TTFT, P50/P95/P99 ITL",
                               description="Open-loop load against OpenAI-compatible /v1/completions servers. "
                                           "Equivalent ITL per block commit = block time / tokens committed.")
    lg.set_defaults(_run=_loadgen)
    lg.add_argument("--url", action="append", default=None, metavar="[LABEL=]URL",
                    help="server base URL, e.g. http://127.0.0.1:8000 (repeat for several servers side by side)")
    lg.add_argument("--rate", type=float_arg(0.0, 1e6, lo_open=True), default=None,
                    help="Poisson arrival rate (req/s)")
    lg.add_argument("--rates", default=None, help="comma-separated rates for a sweep, e.g. 2,4,8")
    lg.add_argument("--duration", type=float_arg(0.0, 1e6, lo_open=True), default=10.0,
                    help="seconds of arrivals per rate (default 10)")
    lg.add_argument("--replay", default=None, metavar="FILE",
                    help="replay arrival times from a file (times per line, JSON list, loadgen JSON, engine trace)")
    lg.add_argument("--prompts", default=f"task:{BUNDLED_TASK}",
                    help="task:NAME (test split), file:PATH, or ids:1,2,3;4,5 (default task:"
                         f"{BUNDLED_TASK}, the bundled models' task)")
    lg.add_argument("--token-ids", action="store_true",
                    help="send task/file prompts as character-tokenizer ids (servers without tokenizer.json)")
    lg.add_argument("--max-tokens", type=int_arg(1, 1 << 24), default=64, help="max_tokens per request (default 64)")
    lg.add_argument("--seed", type=seed_arg, default=0,
                    help="arrival and prompt seed; request i gets seed+i (default 0)")
    lg.add_argument("--model", default=None, help="'model' field to send (default: none)")
    lg.add_argument("--api-key", default=None, help=f"bearer key (default ${API_KEY_ENV})")
    lg.add_argument("--timeout", type=float_arg(0.0, 1e6, lo_open=True), default=120.0,
                    help="per-request timeout in seconds (default 120)")
    lg.add_argument("--json", action="store_true", help="print the results as JSON")
    lg.add_argument("--out", default=None, help="also write the JSON results to this file")
    lg.add_argument("--plot", default=None, metavar="PNG", help="draw P95 ITL and throughput vs rate per server")
    lg.add_argument("--from", dest="from_", nargs="*", default=None, metavar="JSON",
                    help="plot/print saved loadgen JSON results instead of running")
    add_flag_rules(p, FlagRule("--allow-unauthenticated", "when binding a --host other machines can reach without an "
                               "API key (on loopback, or with a key, nothing is left to allow)",
                               lambda a, c: _exposed(a)))
    add_flag_rules(lg, FlagRule(("--url", "--rate", "--rates", "--duration", "--replay", "--prompts", "--token-ids",
                                 "--max-tokens", "--seed", "--model", "--api-key", "--timeout"),
                                "without --from (--from reports saved results; nothing is sent)",
                                lambda a, c: a.from_ is None),
                   FlagRule("--duration", "with --rate or --rates (a replay lasts as long as its arrival times)",
                            lambda a, c: a.replay is None),
                   FlagRule("--token-ids", "with task: or file: prompts (ids: prompts are token ids already)",
                            lambda a, c: not str(a.prompts).startswith("ids:")))


def _exposed(args) -> bool:
    from dblock.serving.server import is_loopback
    return not is_loopback(args.host) and not (args.api_key or os.environ.get(API_KEY_ENV))


# ---- serve ---------------------------------------------------------------------------------------------------

def check_bind(host: str, api_key, allow_unauthenticated: bool) -> None:
    from dblock.serving.server import is_loopback
    if not is_loopback(host) and not api_key and not allow_unauthenticated:
        raise ValueError(f"--host {host} is reachable from other machines and no API key is set: give --api-key "
                         f"(or ${API_KEY_ENV}), bind 127.0.0.1, or pass --allow-unauthenticated")


def build_server(args):
    """(app, engine, trace writer, api key) from parsed `serve` arguments; nothing is bound yet."""
    from dblock.decoding.schedules import schedule_spec
    from dblock.serving.chat import load_chat_template
    from dblock.serving.engine import Engine, EngineConfig
    from dblock.serving.protocol import Limits
    from dblock.serving.server import create_app
    from dblock.trace import NULL_TRACE, TraceWriter

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_bind(args.host, api_key, args.allow_unauthenticated)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens_limit=args.max_tokens_limit).validate()
    if args.max_new_tokens > limits.max_tokens_limit:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} (the default max_tokens) exceeds "
                         f"--max-tokens-limit {limits.max_tokens_limit}")
    cfg = EngineConfig(batch_cap=args.max_batch, kv_budget_tokens=args.kv_budget_tokens,
                       max_queue=args.max_queue).validate()
    if args.trace is not None:
        check_out_file(args.trace, "--trace")
    # refused from config.json before the weights are read: a KV budget that cannot hold the smallest request
    # (1 prompt token + 1 generated token on the block grid) would start a server that never serves
    folder, mcfg = model_config(args)
    dec0 = decode_config(args, mcfg.family, tokenizer=folder)
    check_stops(mcfg, dec0)
    spec0 = schedule_from_args(args)
    check_fits(mcfg, dec0, spec0, [("serve: a 1-token prompt at the default max_tokens", [0])])  # block, budget
    block = (dec0.block_size or mcfg.block_size) * spec0.width
    smallest = positions_needed(1, 1, block, mcfg.family)
    if cfg.kv_budget_tokens < smallest:
        raise ValueError(f"--kv-budget-tokens {cfg.kv_budget_tokens}: cannot hold even the smallest request (1 prompt "
                         f"token + 1 generated token need {smallest} positions with {block}-position blocks); give "
                         f"at least {smallest}")
    model = load_model(args)
    tok = load_tokenizer(model)
    dec = decode_config(args, model.config.family, tokenizer=tok)
    spec = schedule_spec(args.schedule, args.window, args.gate)
    fwd = make_forward(model, args)
    trace = TraceWriter(args.trace) if args.trace else NULL_TRACE
    header = None
    if trace.enabled:
        mc = model.config.to_hf_dict() if hasattr(model.config, "to_hf_dict") else None
        header = dict(model=args.model, family=model.config.family, executor=fwd.name, schedule=spec.name,
                      decode=vars(dec), model_config=mc, serving=dict(batch_cap=cfg.batch_cap,
                                                                      kv_budget_tokens=cfg.kv_budget_tokens))
    engine = Engine(fwd, spec, dec, cfg, trace=trace, trace_header=header)
    name = args.served_model_name or args.model
    template = load_chat_template(getattr(model, "source", None), getattr(args, "chat_template", None))
    app = create_app(engine, tokenizer=tok, model_name=name, limits=limits, api_key=api_key,
                     drain_timeout=args.drain_timeout, chat_template=template,
                     request_timeout=args.request_timeout,
                     template_timeout=getattr(args, "template_timeout", 2.0),
                     template_max_chars=getattr(args, "template_max_chars", 1_000_000))
    return app, engine, trace, api_key


def _serve(args) -> int:
    import logging

    from dblock.serving.server import bind_socket, run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app, engine, trace, api_key = build_server(args)
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    snap = engine.snapshot()
    print(f"dblock serve: http://{shown}:{port} model={args.model} executor={snap['executor']} "
          f"schedule={snap['schedule']} batch cap {engine.config.batch_cap}, "
          f"{'API key required' if api_key else 'no API key'}",
          flush=True)
    try:
        run_server(app, sock, log_level=args.log_level, drain_timeout=args.drain_timeout,
                   limit_concurrency=engine.config.max_queue + engine.config.batch_cap + 64)
    finally:
        trace.close()
    s = engine.snapshot()
    print(f"dblock serve: stopped after {s['finished']} requests ({s['cancelled']} cancelled, {s['failed']} failed)",
          flush=True)
    return 0


# ---- loadgen -------------------------------------------------------------------------------------------------

def _loadgen(args) -> int:
    from dblock.serving import loadgen as lg

    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path:
            check_out_file(path, flag)         # before any load is sent
    if args.from_ is not None:
        if not args.from_:
            raise ValueError("--from: give one or more saved loadgen results (JSON files)")
        servers = []
        for path in args.from_:
            servers += _saved_results(path)["servers"]
        return _report(args, dict(servers=servers))
    if not args.url:
        raise ValueError("loadgen: give --url http://HOST:PORT (repeat for several servers), or --from results.json")
    if args.replay and (args.rate or args.rates):
        raise ValueError("loadgen: --replay replaces --rate/--rates; give one or the other")
    if not args.replay and not (args.rate or args.rates):
        raise ValueError("loadgen: give --rate R, --rates R1,R2,... or --replay FILE")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    rates = [None] if args.replay else ([args.rate] if args.rate else _floats(args.rates))
    servers = []
    for spec in args.url:
        label, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        label = label or url
        runs = []
        for k, rate in enumerate(rates):
            if rate is None:
                arrivals = lg.read_arrivals(args.replay, "--replay")
                duration = max(arrivals) if arrivals else 0.0
            else:
                arrivals = lg.poisson_arrivals(rate, args.duration, args.seed + 1000 * k)
                duration = args.duration
            prompts = lg.load_prompts(args.prompts, max(1, len(arrivals)), args.seed, args.token_ids)
            if not args.json:
                print(f"loadgen: {label} rate {rate if rate else 'replay'}: {len(arrivals)} requests over "
                      f"{duration:.1f} s", file=sys.stderr, flush=True)
            runs.append(lg.run_load(url, arrivals, prompts, args.max_tokens, args.seed, rate=rate, duration=duration,
                                    api_key=api_key, model=args.model, timeout=args.timeout))
        servers.append(dict(label=label, url=url, runs=runs))
    return _report(args, dict(machine=lg.machine(), max_tokens=args.max_tokens, prompts=args.prompts,
                              duration=args.duration, seed=args.seed, servers=servers))


def _saved_results(path: str) -> dict:
    """A saved `dblock loadgen --json` / `--out` file, read as untrusted input: the keys the table and the plot read,
    typed and finite (an InputFileError naming --from and the file otherwise)."""
    from typing import Annotated, Optional

    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    from dblock.errors import InputFileError
    from dblock.input_files import read_json, validation_message, where
    Num = Optional[Annotated[float, Field(strict=True, allow_inf_nan=False)]]
    Count = Annotated[int, Field(strict=True, ge=0)]

    class Run(BaseModel):
        model_config = ConfigDict(extra="allow")
        rate: Num = None
        offered_rate: Num = None
        sent: Count
        ok: Count
        rejected: Count
        errors: Count
        throughput_tok_s: Annotated[float, Field(strict=True, allow_inf_nan=False)]
        ttft: dict[str, Num]
        itl: dict[str, Num]

    class Server(BaseModel):
        model_config = ConfigDict(extra="allow")
        label: str
        runs: list[Run]

    class Results(BaseModel):
        model_config = ConfigDict(extra="allow")
        servers: list[Server]

    d = read_json(path, "--from")
    try:
        Results.model_validate(d)
    except ValidationError as e:
        raise InputFileError(f"{where(path, '--from')}: not loadgen results: {validation_message(e)}") from None
    if any(r.get("rate") is None and r.get("offered_rate") is None for srv in d["servers"] for r in srv["runs"]):
        raise InputFileError(f"{where(path, '--from')}: a run without rate or offered_rate")
    return d


def _report(args, data: dict) -> int:
    from dblock.serving import loadgen as lg
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    if args.plot:
        lg.plot(data["servers"], args.plot)
    if args.json:
        print(json.dumps(data))
    else:
        print(lg.table(data["servers"]))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
