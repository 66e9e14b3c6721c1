"""`dblock simulate plan`: the cheapest deployment that meets P95 ITL / TTFT objectives (dblock/simulator/plan.py),
as a ranked table (or `--json` `{"plans": [...]}`), with bands from the unmeasured inputs and the Pareto plot."""
from __future__ import annotations

import math
import os
import sys

from dblock.cli.simulator_common import _dist, _emit, _ints
from dblock.cli_args import FlagRule, add_flag_rules, float_arg, given, int_arg, show_progress
from dblock.out_paths import check_out_file


def add_parsers(sub, common) -> None:
    from dblock.simulator.hardware import PRICES
    p = sub.add_parser("plan", help="the cheapest deployment (GPUs, TP/EP/SP, replicas, batch cap, executor) that "
                                    "meets P95 ITL / TTFT objectives",
                       description="Search hardware kinds, GPUs per replica, TP/EP/SP, replicas, batch cap, executor "
                                   "(dense, Epoch) and schedule (Native; OBA on uniform-state models) for the "
                                   "cheapest plans that meet the SLOs at a request rate: analytic pruning, then the "
                                   "SimPy serving model on the cheapest (SIMULATOR.md, 'Capacity planning'). Prices "
                                   "are placeholders: " + ", ".join(f"{k} ${v:.2f}" for k, v in PRICES.items())
                                   + " per GPU-hour.")
    common(p)
    p.set_defaults(_run=_plan)
    p.add_argument("--model", default="llada2-mini",
                   help="llada2-mini, llada2-flash, llada-moe-7b, diffusion-gemma, or a model folder")
    p.add_argument("--hardware", default="h100,h200,b200,gb300", help="hardware kinds to consider (comma-separated)")
    p.add_argument("--price", action="append", default=[], metavar="KIND=USD",
                   help="US$ per GPU-hour of a kind, e.g. --price h100=2.5 (repeat, or comma-separate)")
    p.add_argument("--rate", type=float_arg(0.0, 1e6, lo_open=True), default=None,
                   help="Poisson request rate to serve (req/s); required unless --trace")
    p.add_argument("--trace", default=None,
                   help="requests to serve from a trace: arrival times (a `dblock loadgen --json` output, an engine "
                        "trace of `dblock serve --trace`, or one time per line); an engine trace's prompt and "
                        "answer lengths replace --prompt/--tokens")
    p.add_argument("--prompt", default="lognormal:1024,0.5", help="prompt-length distribution (default "
                                                                  "lognormal:1024,0.5)")
    p.add_argument("--tokens", default="lognormal:512,0.5", help="answer-length distribution (default "
                                                                 "lognormal:512,0.5)")
    p.add_argument("--slo-itl", type=float_arg(0.0, 1e4, lo_open=True), default=None,
                   help="P95 inter-token latency objective (s), of the --itl-definition")
    p.add_argument("--itl-definition", default="epoch", choices=["epoch", "dblock", "token", "block"],
                   help="which ITL --slo-itl holds: 'epoch' (the Epoch paper's equivalent ITL read as a block's "
                        "latency; default), 'dblock' (dblock's equivalent ITL, per token), 'token' (SGLang "
                        "bench_serving's per-token ITL), 'block' (vLLM bench serve's per-block ITL); all four are "
                        "reported")
    p.add_argument("--slo-ttft", type=float_arg(0.0, 1e6, lo_open=True), default=None,
                   help="P95 time-to-first-token objective (s)")
    p.add_argument("--passes", default=None,
                   help="Native passes per block (default: from the model card's tokens per forward — llada2-mini "
                        "gamma:12.55,0.3 (TPF 2.55), llada2-flash gamma:10.03,0.3 (TPF 3.19), llada-moe-7b "
                        "gamma:10,0.3; diffusion-gemma: the OBA paper's n̄ 13.1; ignored with --liveness-from)")
    p.add_argument("--liveness-from", default=None, metavar="TRACE",
                   help="Native decode trace (or code-masked, the bundled one) for passes and liveness instead of "
                        "the uniform assumption")
    p.add_argument("--calibration", default="published",
                   help="'published' (the GPU cost model fitted on published measurements; default), 'fig2', 'none' "
                        "or OVERHEAD_S,MOE_ROW_S (`simulate pass`)")
    p.add_argument("--gpus-per-replica", default="1,2,4,8", help="GPUs per replica to try (powers of two)")
    p.add_argument("--caps", default="16,32,64,128,256,512", help="batch caps to try")
    p.add_argument("--executors", default="dense,epoch", help="dense, epoch or both")
    p.add_argument("--max-gpus", type=int_arg(1, 1 << 20), default=1024, help="GPU budget (default 1024)")
    p.add_argument("--top", type=int_arg(1, 100), default=5, help="plans to print (default 5)")
    p.add_argument("--requests", type=int_arg(20, 100_000), default=200,
                   help="requests per verifying simulation (default 200)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the cost / P95 ITL Pareto frontier")
    p.add_argument("--operator-profile", default=None, metavar="JSON",
                   help="plan one replica on the machine this operator profile measured (`simulate profile`) "
                        "instead of GPUs: the batch cap and executor holding the SLOs at the highest rate; the "
                        "workload is the Native trace given with --liveness-from, replayed request by request")
    p.add_argument("--scale", type=float_arg(0.0, 1e3, lo_open=True), default=1.0,
                   help="with --operator-profile: multiply every call's price (the machine now against the profile, "
                        "e.g. the probe factor of benchmarks/plan_cpu.py; default 1)")
    p.add_argument("--rate-margin", type=float_arg(0.0, 10.0), default=0.0,
                   help="with --operator-profile: plan at the highest rate holding the SLOs divided by (1 + this), "
                        "a reserve below the SLO edge for what the profile does not price (default 0)")
    add_flag_rules(p, *PLAN_RULES)


#: `simulate plan` has two modes: GPUs priced by the roofline (the default) and one replica on the machine an
#: operator profile measured (--operator-profile); a flag of one mode given in the other would do nothing
PLAN_RULES = (
    FlagRule(("--scale", "--rate-margin"), "with --operator-profile (to the plan of the profiled machine)",
             lambda a, c: a.operator_profile is not None),
    FlagRule(("--model", "--hardware", "--price", "--rate", "--trace", "--prompt", "--tokens", "--passes",
              "--calibration", "--gpus-per-replica", "--max-gpus", "--plot"),
             "without --operator-profile (a profiled plan is one replica on the profiled machine, its model and "
             "workload those of the --liveness-from trace, its rate the highest that holds the SLOs)",
             lambda a, c: a.operator_profile is None),
    FlagRule("--passes", "without --liveness-from (the trace's blocks give the passes)",
             lambda a, c: a.liveness_from is None),
)


def _prices(items: list, kinds: list) -> dict:
    from dblock.simulator.plan import PRICES
    out = {k: PRICES.get(k) for k in kinds}
    for item in items:
        for part in str(item).split(","):
            if not part.strip():
                continue
            k, eq, v = part.partition("=")
            k = k.strip().lower()
            try:
                val = float(v)
            except ValueError:
                val = float("nan")
            if not eq or not math.isfinite(val) or val <= 0:
                raise ValueError(f"--price {part!r}: expected KIND=USD with a positive price, e.g. h100=2.5")
            if k not in out:
                raise ValueError(f"--price {part!r}: {k!r} is not among --hardware ({', '.join(kinds)})")
            out[k] = val
    missing = [k for k, v in out.items() if v is None]
    if missing:
        raise ValueError(f"--price: no default price for {', '.join(missing)}; give --price {missing[0]}=USD")
    return out


def _trace_workload(path: str):
    """(arrivals, prompt dist, tokens dist) of a request trace; the dists are None without request lengths."""
    from dblock.serving.loadgen import read_arrivals
    from dblock.trace import read_trace
    arr = read_arrivals(path, "--trace")
    prompts, ys = [], []
    with open(path, "rb") as f:
        engine_trace = f.read(1) == b"{"
    if engine_trace:
        try:
            for ev in read_trace(path, "--trace"):
                if ev.get("event") == "request" and ev.get("prompt_len") is not None and "Y" in ev:
                    prompts.append(int(ev["prompt_len"]))
                    ys.append(int(ev["Y"]))
        except ValueError:           # loadgen results (one JSON document, not events): arrivals only
            prompts, ys = [], []
    if len(arr) < 2 or max(arr) <= 0:
        raise ValueError(f"--trace {path}: needs two or more distinct arrival times")
    emp = (lambda v: "empirical:" + ",".join(str(x) for x in v)) if prompts else (lambda v: None)
    return arr, emp(prompts), emp(ys)


def _inputs(args):
    from dblock.simulator import cost, hardware, plan
    from dblock.cli.simulator_roofline import _calibration
    from dblock.simulator.positions import ParametricProfile
    kinds = [k.strip().lower() for k in args.hardware.split(",") if k.strip()]
    if not kinds:
        raise ValueError(f"--hardware {args.hardware!r}: give one or more of {', '.join(hardware.PROFILES)}")
    hws = {}
    for k in kinds:
        if k not in hardware.PROFILES:
            raise ValueError(f"--hardware {k!r}: unknown (allowed: {', '.join(hardware.PROFILES)})")
        hws[k] = hardware.get(k)
    prices = _prices(args.price, kinds)
    cfg = cost.get_model(args.model)
    if args.rate is not None and args.trace is not None:
        raise ValueError(f"--rate {args.rate:g} with --trace {args.trace}: the trace's arrivals set the rate; give "
                         "one of them")
    if args.rate is None and args.trace is None:
        raise ValueError("--rate or --trace: one is required (the load to plan for)")
    prompt, tokens, arrivals, rate = args.prompt, args.tokens, None, args.rate
    if args.trace:
        arrivals, p2, t2 = _trace_workload(args.trace)
        rate = (len(arrivals) - 1) / (max(arrivals) - min(arrivals))
        for flag, dist in (("--prompt", p2), ("--tokens", t2)):
            if dist and given(args, flag[2:]):
                raise ValueError(f"{flag}: the --trace {args.trace} gives every request's length, so here it would "
                                 "do nothing (refused, not ignored)")
        prompt, tokens = p2 or prompt, t2 or tokens
    _dist(prompt, "--prompt", 1e6)
    _dist(tokens, "--tokens", 1e6)
    if args.liveness_from:
        from dblock.simulator.liveness import trace_profile
        profile = trace_profile(args.liveness_from)
        if profile.C != cfg.block_size:
            raise ValueError(f"--liveness-from {args.liveness_from}: blocks of {profile.C} tokens; {args.model} "
                             f"decodes blocks of {cfg.block_size}")
        _warn_family(f"--liveness-from {args.liveness_from}", getattr(profile, "family", None), args.model,
                     cfg.family)
    else:
        from dblock.simulator.papers import default_passes
        passes = args.passes or default_passes(args.model)
        _dist(passes, "--passes", 1e4)
        profile = ParametricProfile(C=cfg.block_size, passes=passes)
    execs = tuple(e.strip() for e in args.executors.split(",") if e.strip())
    if not execs or any(e not in plan.EXECUTORS for e in execs):
        raise ValueError(f"--executors {args.executors!r}: allowed dense, epoch")
    gpus = tuple(_ints(args.gpus_per_replica, "--gpus-per-replica", 1024))
    if any(g & (g - 1) for g in gpus):
        raise ValueError(f"--gpus-per-replica {args.gpus_per_replica!r}: powers of two (1, 2, 4, 8, ...)")
    cal = _calibration(args.calibration)
    caps = tuple(_ints(args.caps, "--caps", 1 << 16))
    if args.slo_itl is None and args.slo_ttft is None:
        print("note: no --slo-itl or --slo-ttft: plans only keep up with the rate", file=sys.stderr)
    cal_name = ("the published fit" if args.calibration == "published" else f"--calibration {args.calibration}")
    return plan.Inputs(cfg=cfg, model=args.model, cal_name=cal_name, itl=args.itl_definition, hardware=hws, prices=prices, rate=rate, prompt=prompt,
                       tokens=tokens, slo_itl=args.slo_itl, slo_ttft=args.slo_ttft, profile=profile,
                       uniform_state=args.model in cost.UNIFORM_STATE, cal=cal, gpus=gpus,
                       caps=caps, executors=execs, max_gpus=args.max_gpus,
                       top=args.top, requests=args.requests, arrivals=arrivals, seed=args.seed)


def _warn_family(what: str, family, model: str, model_family) -> None:
    """One warning line when a trace of one model family prices another (its passes and liveness are a property of
    the family's decoding: a masked model's blocks are not a uniform-state model's)."""
    if family and model_family and family != model_family:
        print(f"warning: {what} is a {family} trace, applied to {model} ({model_family}): its passes and liveness "
              f"are {family}'s, not {model_family}'s", file=sys.stderr)


def _rng(lo_hi, fmt) -> str:
    lo, hi = lo_hi
    f = (lambda v: "inf" if not math.isfinite(v) else fmt(v))
    return f(lo) if f(lo) == f(hi) else f"{f(lo)}–{f(hi)}"


def _table(res, inp) -> str:
    slo = []
    if inp.slo_itl is not None:
        slo.append(f"P95 ITL ({inp.itl}) <= {inp.slo_itl * 1e3:g} ms")
    if inp.slo_ttft is not None:
        slo.append(f"P95 TTFT <= {inp.slo_ttft:g} s")
    st = res.stats
    head = (f"{inp.model}, {inp.rate:.3g} req/s, prompts {inp.prompt[:40]}, answers {inp.tokens[:40]}; "
            f"{' and '.join(slo) or 'no SLO'}; decode profile {st['decode_profile']} (n̄ "
            f"{inp.profile.nbar:.2f} passes per {inp.cfg.block_size}-token block); costs: {inp.cal_name}\n"
            f"searched {res.searched} replica shapes ({len(res.dropped)} dropped: "
            f"{sum(1 for _, w in res.dropped if w.startswith('OOM'))} out of memory), simulated {res.simulated}")
    oom, seen = [], set()
    for sh, why in res.dropped:
        if why.startswith("OOM") and (sh.hardware, sh.gpus) not in seen and len(oom) < 4:
            seen.add((sh.hardware, sh.gpus))
            oom.append(f"  {sh.hardware} x{sh.gpus} (TP{sh.tp} EP{sh.ep} SP{sh.sp}, {sh.executor}): {why}")
    if oom:
        head += "\nout of memory, for example:\n" + "\n".join(oom)
    if not res.plans:
        return head + f"\nno plan meets the SLOs: {res.binding}"
    lines = [head, f"{'#':>2} {'hardware':8s} {'GPUs (band)':>14s} {'TPxEPxSP':>9s} {'repl':>5s} {'cap':>4s} "
                   f"{'executor':8s} {'sched':6s} {'$/Mtok (band)':>16s} {'P95 ITL ms (band)':>18s} "
                   f"{'P95 TTFT s (band)':>18s} {'headroom':>9s} band driven by"]
    for i, p in enumerate(res.plans, 1):
        b = p["band"]
        lines.append(f"{i:>2} {p['hardware']:8s} {p['gpus']:>4d} ({_rng(b['gpus'], lambda v: f'{v:.0f}'):>7s}) "
                     f"{p['tp']}x{p['ep']}x{p['sp']:<4} {p['replicas']:>5d} {p['batch_cap']:>4d} {p['executor']:8s} "
                     f"{p['schedule']:6s} {p['cost_per_mtok']:>6.2f} "
                     f"({_rng(b['cost_per_mtok'], lambda v: f'{v:.2f}'):>11s})"
                     f" {1e3 * p['p95_itl_s']:>6.1f} ({_rng(b['p95_itl_s'], lambda v: f'{1e3 * v:.0f}'):>9s}) "
                     f"{p['p95_ttft_s']:>6.2f} ({_rng(b['p95_ttft_s'], lambda v: f'{v:.2f}'):>9s}) "
                     f"{100 * p['headroom']['rate']:>8.0f}% {b['dominant']}")
    p = res.plans[0]
    b = p["band"]
    lines.append(f"cheapest: {_rng(b['gpus'], lambda v: f'{v:.0f}')} {p['hardware'].upper()}s "
                 f"({p['gpus']} planned: {p['replicas']} replica{'s' if p['replicas'] > 1 else ''} of "
                 f"{p['gpus_per_replica']}), "
                 f"${p['cost_per_hour']:.0f}/h; the band comes mostly from the {b['dominant']} "
                 f"(efficiency factors, decode profile: n̄ ±20% and liveness uniform vs trace, α on OBA)")
    lines.append(f"one replica ({p['gpus_per_replica']} {p['hardware'].upper()}s) holds the SLOs up to "
                 f"{p['max_rate_per_replica']:.3g} req/s (analytic) and runs {inp.rate / p['replicas']:.3g} req/s here")
    by = (p.get("simulated") or {}).get("p95_itl_by_definition")
    if by:
        lines.append(f"its simulated P95 ITL by definition (the SLO holds '{inp.itl}'): Epoch's (a block's latency) "
                     f"{1e3 * by['epoch']:.1f} ms, dblock's equivalent (per token) {1e3 * by['dblock']:.2f} ms, "
                     f"SGLang's per-token {1e3 * by['token']:.2f} ms, vLLM's per-block {1e3 * by['block']:.1f} ms")
    lines.append("P95s: simulated (SimPy serving model, one replica at rate/replicas); headroom: the extra load the "
                 "plan's replicas take at the SLO (analytic); prices are placeholders (--price)")
    return "\n".join(lines)


def _plan_profiled(args) -> int:
    """`--operator-profile`: dblock/simulator/plan_profiled.py on a Native trace's requests."""
    import os
    from dblock.simulator import batch
    from dblock.simulator.calibrate import Run
    from dblock.simulator.plan_profiled import plan_profiled
    from dblock.simulator.profile import Profile
    if not os.path.isfile(args.operator_profile):
        raise ValueError(f"--operator-profile {args.operator_profile}: no such file (write one with `dblock "
                         "simulate profile --model M`)")
    if not args.liveness_from or not os.path.isfile(args.liveness_from):
        raise ValueError("--liveness-from: with --operator-profile give a Native trace file of the model "
                         "(`dblock generate --trace`): its requests are the workload")
    if args.slo_itl is None and args.slo_ttft is None:
        raise ValueError("--slo-itl or --slo-ttft: with --operator-profile the plan is the highest rate holding one")
    prof = Profile.load(args.operator_profile, "--operator-profile")
    run = Run.load(args.liveness_from, flag="--liveness-from")
    _check_profile_fits_trace(prof, run, args)
    by: dict = {}
    for b in run.blocks:
        by.setdefault(str(b["request"]), []).append(b)
    reqs = [r for r in run.requests if str(r["request"]) in by]
    if not reqs:
        raise ValueError(f"--liveness-from {args.liveness_from}: no request with block events")
    mnt = int((run.header.get("decode") or {}).get("max_new_tokens") or 64)
    wl = batch.Workload.from_runs([r["prompt_len"] for r in reqs], mnt, [by[str(r["request"])] for r in reqs],
                                  run.block_size)
    caps = _ints(args.caps, "--caps", 1 << 12)
    execs = ["reference" if e.strip() == "dense" else e.strip() for e in args.executors.split(",") if e.strip()]
    if any(e not in ("reference", "epoch") for e in execs):
        raise ValueError(f"--executors {args.executors!r}: allowed dense (the reference executor), epoch")
    out = plan_profiled(prof, wl, args.slo_itl, args.slo_ttft, caps, execs, n=min(args.requests, 200),
                        seed=args.seed, scale=args.scale, rate_margin=args.rate_margin,
                        progress=None if args.json else (lambda s: print(s, file=sys.stderr)))
    lines = [f"one replica on {prof.meta.get('machine', '?')} (operator profile {args.operator_profile}); "
             f"{len(reqs)} requests of the trace replayed"]
    for p in out["plans"][:args.top]:
        b = p["band"]
        lines.append(f"executor {p['executor']:9s} cap {p['batch_cap']:4d}: {p['rate']:.3f} req/s, P95 ITL "
                     f"{1e3 * p['p95_itl_s']:.0f} ms ({1e3 * b['itl_p95'][0]:.0f}–{1e3 * b['itl_p95'][1]:.0f}), "
                     f"P95 TTFT {p['p95_ttft_s']:.2f} s, {p['throughput_tok_s']:.0f} tok/s"
                     + (f" (SLO edge {p['slo_edge_rate']:.3f} req/s / {1 + p['rate_margin']:g})"
                        if p["rate_margin"] else ""))
    if not out["plans"]:
        lines.append("no executor and cap holds the SLOs at any rate on this machine")
    _emit(args, out, "\n".join(lines))
    return 0 if out["plans"] else 1


def _check_profile_fits_trace(prof, run, args) -> None:
    """The operator profile prices the trace's own model: another family is refused (its calls have another
    structure: DiffusionGemma's encoder and canvases are not a masked model's blocks), another model of the family
    gets one warning line naming both; a schedule other than Native is refused (the workload is Native blocks)."""
    pm = prof.model
    fam, name = run.header.get("family"), run.header.get("model")
    if fam and pm.get("family") not in (None, "?") and fam != pm["family"]:
        raise ValueError(f"--operator-profile {args.operator_profile} measured {pm.get('name') or 'a model'} "
                         f"({pm['family']}); --liveness-from {args.liveness_from} is a trace of {name or 'a model'} "
                         f"({fam}): a profile prices the calls of its own family only")
    if name and pm.get("name") and os.path.basename(os.path.normpath(str(name))) != \
            os.path.basename(os.path.normpath(str(pm["name"]))):
        print(f"warning: --operator-profile {args.operator_profile} measured {pm['name']}; --liveness-from "
              f"{args.liveness_from} is a trace of {name}: the plan prices {name}'s requests with {pm['name']}'s "
              "operators", file=sys.stderr)
    if run.schedule not in ("native",):
        raise ValueError(f"--liveness-from {args.liveness_from}: a {run.schedule} trace; the workload is read from "
                         "a Native run")


def _plan(args) -> int:
    from dblock.simulator import plan
    if args.plot:
        check_out_file(args.plot, "--plot")
    if args.operator_profile:
        return _plan_profiled(args)
    inp = _inputs(args)
    inp.frontier = bool(args.plot)
    res = plan.search(inp, progress=show_progress(args))
    if args.plot:
        from dblock.simulator.plots import plan_frontier
        plan_frontier(res.points, res.plans, args.plot, f"{inp.model} at {inp.rate:.3g} req/s")
    _emit(args, res.as_dict(), _table(res, inp))
    return 0 if res.plans else 1
