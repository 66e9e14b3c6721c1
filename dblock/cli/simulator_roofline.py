"""`dblock simulate pass|serve|search`: the roofline cost of one pass (r of each layout, memory and OOM, Epoch vs
dense) and the SimPy serving model over it (P95 ITL, TTFT and throughput against the request rate; the best batch
cap under an ITL objective)."""
from __future__ import annotations

import json
import math
import sys

from dblock.cli.simulator_common import _dist, _emit, _floats, _ints, _positive_floats
from dblock.cli_args import FlagRule, add_flag_rules, float_arg, int_arg, show_progress
from dblock.out_paths import check_out_file


def add_parsers(sub, common) -> None:
    """The `simulate pass|serve|search` subcommands, added to `sub` (`common` adds --json and --seed)."""
    ps = sub.add_parser("pass", help="roofline cost of one pass, r of each layout, memory/OOM, Epoch vs dense")
    common(ps)
    ps.set_defaults(_run=_pass)
    ps.add_argument("--model", default="llada2-mini", help="llada2-mini, llada-moe-7b, or a model folder")
    ps.add_argument("--hardware", default="h100", help="h100, h200, b200, gb300, a100, cpu or a profile .json")
    ps.add_argument("--tp", type=int_arg(1, 4096), default=8, help="tensor-parallel ranks (default 8)")
    ps.add_argument("--ep", type=int_arg(1, 4096), default=8, help="expert-parallel ranks (default 8)")
    ps.add_argument("--sp", type=int_arg(1, 4096), default=8, help="sequence-parallel ranks (default 8)")
    ps.add_argument("--batch", default="1,32,64,128,256,512", help="comma-separated batch sizes")
    ps.add_argument("--cache-len", type=float_arg(0.0, 1e8), default=512.0,
                    help="committed prefix per request (tokens)")
    _calibration_args(ps)
    ps.add_argument("--max-context", type=int_arg(1, 1 << 26), default=4096,
                    help="KV cache tokens reserved per request")
    ps.add_argument("--plot", default=None, metavar="PNG", help="write the Epoch/dense speedup-vs-batch plot")
    _liveness_arg(ps)

    sv = sub.add_parser("serve", help="SimPy serving model: P95 ITL, TTFT, throughput vs request rate")
    common(sv)
    sv.set_defaults(_run=_serve)
    _serve_args(sv)
    sv.add_argument("--rates", default="6,10,14,18,22,26", help="comma-separated Poisson rates (req/s)")
    sv.add_argument("--arrivals", default=None,
                    help="trace-driven arrivals: a file of arrival times in seconds (one per line, or a JSON list)")
    sv.add_argument("--plot", default=None, metavar="PNG", help="write P95 ITL vs rate to this file")

    se = sub.add_parser("search", help="highest request rate holding a P95 ITL SLO, and the best batch cap")
    common(se)
    se.set_defaults(_run=_search)
    _serve_args(se)
    se.add_argument("--slo", type=float, required=True,
                    help="P95 ITL objective (seconds), of the --itl-definition")
    se.add_argument("--itl-definition", default="epoch", choices=["epoch", "dblock", "token", "block"],
                    help="which ITL --slo holds (see `simulate serve`; default epoch: the Epoch paper's, a block's "
                         "latency)")
    se.add_argument("--caps", default="32,64,128,256,512", help="batch caps to try (comma-separated)")
    se.add_argument("--rate-max", type=float_arg(0.0, 1e6, lo_open=True), default=64.0,
                    help="upper end of the rate bisection (req/s)")
    add_flag_rules(ps, FlagRule("--seed", "to the simulations that draw random numbers; simulate pass is closed-form",
                                lambda a, c: False))
    passes = FlagRule("--passes", "without --liveness-from (the trace's blocks give the passes)",
                      lambda a, c: a.liveness_from is None)
    add_flag_rules(sv, passes, FlagRule("--rates", "without --arrivals (the arrival times set the load)",
                                        lambda a, c: a.arrivals is None))
    add_flag_rules(se, passes)


def _serve_args(sp):
    sp.add_argument("--model", default="llada2-mini", help="llada2-mini, llada-moe-7b, or a model folder")
    sp.add_argument("--hardware", default="h100", help="h100, h200, b200, gb300, a100, cpu or a profile .json")
    sp.add_argument("--tp", type=int_arg(1, 4096), default=8, help="tensor-parallel ranks (default 8)")
    sp.add_argument("--ep", type=int_arg(1, 4096), default=8, help="expert-parallel ranks (default 8)")
    sp.add_argument("--sp", type=int_arg(1, 4096), default=8, help="sequence-parallel ranks (default 8)")
    _calibration_args(sp)
    sp.add_argument("--scale", type=float_arg(0.0, 1e6, lo_open=True), default=1.0,
                    help="multiply every pass time (the CPU scale fitted by `simulate calibrate`; default 1)")
    sp.add_argument("--path", default="both", choices=["dense", "epoch", "both"], help="executor path(s) to model")
    sp.add_argument("--schedule", default="native", choices=["native", "oba"], help="decoding schedule")
    sp.add_argument("--batch-cap", type=int_arg(1, 1 << 20), default=256, help="most requests running at once")
    sp.add_argument("--prompt", default="const:256", help="prompt-length distribution (e.g. lognormal:256,0.5)")
    sp.add_argument("--tokens", default="lognormal:256,0.5", help="response-length distribution")
    sp.add_argument("--passes", default=None,
                    help="Native passes-per-block distribution (default: 32 / the model card's tokens per forward: "
                         "llada2-mini gamma:12.55,0.3, llada2-flash gamma:10.03,0.3; else gamma:10,0.3)")
    sp.add_argument("--requests", type=int_arg(1, 1_000_000), default=300, help="requests per simulated run")
    _liveness_arg(sp)


def _calibration_args(sp):
    sp.add_argument("--calibration", default="published",
                    help="'published' (the GPU cost model fitted on published measurements, SIMULATOR.md; "
                         "default), 'fig2' (the older fit on the Epoch paper's Figure 2 alone), 'none' (pure "
                         "roofline) or OVERHEAD_S,MOE_ROW_S")


def _liveness_arg(sp):
    sp.add_argument("--liveness-from", default=None, metavar="TRACE",
                    help="a Native decode trace (`dblock generate --trace`, a `compare-schedules --trace-dir` "
                         "folder) or code-masked (the bundled one): its blocks' passes and per-position accept "
                         "passes replace the uniform liveness assumption (and --passes)")


def _trace_profile(args, C: int):
    """The --liveness-from profile (None without the flag), checked against the model's block size."""
    if not getattr(args, "liveness_from", None):
        return None
    from dblock.simulator.liveness import trace_profile
    prof = trace_profile(args.liveness_from)
    if prof.C != C:
        raise ValueError(f"--liveness-from {args.liveness_from}: blocks of {prof.C} tokens; {args.model} decodes "
                         f"blocks of {C}")
    return prof


def _calibration(text: str, cache_len: float = 512.0):
    from dblock.simulator import cost, papers
    if text == "published":
        from dblock.simulator import gpufit
        return gpufit.calibration("engine")
    if text == "fig2":
        return papers.fig2_calibration(papers.epoch_setup(cache_len))["cal"]
    if text == "none":
        return cost.Calibration()
    try:
        vals = _floats(text)
    except ValueError:
        vals = []
    if len(vals) != 2 or min(vals) < 0:
        raise ValueError(f"--calibration {text!r}: expected published, fig2, none, or OVERHEAD_S,MOE_ROW_S (two "
                         "numbers >= 0)")
    return cost.Calibration(overhead_s=vals[0], moe_row_s=vals[1])


def _cal_source(args) -> str:
    if args.calibration == "published":
        return "published fit (dblock/simulator/data/gpu_fit.json)"
    return args.calibration


def _cal_text(cal) -> str:
    """The calibration's non-default terms, readably."""
    from dblock.simulator import cost
    base = cost.Calibration()
    parts = []
    for k, v in vars(cal).items():
        if v == getattr(base, k):
            continue
        if k == "gemm":
            parts.append("GEMM " + ", ".join(f"{d} {x:.3g}" for d, x in v))
        elif k.endswith("_s") and v is not None:
            parts.append(f"{k} {1e6 * v:.3g} us")
        else:
            parts.append(f"{k} {v:.4g}")
    return "; ".join(parts) or "pure roofline"


def _setup(args):
    from dblock.simulator import cost, hardware
    return cost.get_model(args.model), hardware.get(args.hardware), cost.Parallel(args.tp, args.ep, args.sp)


def _pass(args) -> int:
    from dblock.simulator import cost, papers
    if args.plot:
        check_out_file(args.plot, "--plot")
    cfg, hw, par = _setup(args)
    cal = _calibration(args.calibration, args.cache_len)
    setup = papers.EpochSetup(cfg, hw, par, args.cache_len)
    fig2 = None
    if args.calibration == "fig2":
        fig2 = papers.fig2_calibration(setup)
        fig2 = dict(fit=fig2["fit"], targets=fig2["targets"], roofline_batch1_s=fig2["roofline_batch1_s"])
    from dblock.simulator.liveness import LivenessProfile
    tprof = _trace_profile(args, cfg.block_size)
    live = LivenessProfile.from_profile(tprof if tprof is not None else papers.LLADA2_PROFILE)
    rows = papers.epoch_batch_trend(cal, _ints(args.batch, "--batch"), setup, liveness=live,
                                    max_context=args.max_context)
    rs = {lay: cost.r_of(cfg, lay, hw, par, cal, cache_len=args.cache_len) for lay in ("oba", "dense_mask", "native2c")}
    data = dict(model=args.model, hardware=hw.name, parallel=vars(par), calibration=vars(cal),
                calibration_source=_cal_source(args), r_batch1=rs, rows=rows,
                fig2=fig2, liveness=dict(live.as_dict(), source=args.liveness_from or "uniform"))
    lines = [f"{hw.name}, TP={par.tp} EP={par.ep} SP={par.sp}, calibration {_cal_source(args)}: {_cal_text(cal)}",
             f"liveness ({args.liveness_from or f'uniform assumption, n̄ = {papers.LLADA2_PROFILE.nbar:.2f}'}): live share {live.live:.3f}, fresh "
             f"share {live.fresh:.3f}, {live.passes:.2f} passes per block"]
    if fig2:
        f, t = fig2["fit"], fig2["targets"]
        lines.append(f"Figure 2 fit: batch-1 pass {1e3 * f['t_batch1']:.1f} ms (paper {1e3 * t['t_batch1']:.1f}), "
                     f"MoE share {100 * f['moe_share_batch1']:.1f}% (paper {100 * t['moe_share_batch1']:.0f}%) at 1, "
                     f"{100 * f['moe_share_batch32']:.1f}% (paper {100 * t['moe_share_batch32']:.0f}%) at 32; "
                     f"pure roofline at batch 1: {1e3 * fig2['roofline_batch1_s']:.2f} ms")
    lines += ["r at batch 1: " + ", ".join(f"{k} {v:.3f}" for k, v in rs.items()),
              f"{'batch':>6s} {'dense ms':>9s} {'epoch ms':>9s} {'speedup':>8s} {'MoE %':>6s} {'dense GB':>9s} "
              f"{'epoch GB':>9s} OOM(dense/epoch)"]
    for r in rows:
        lines.append(f"{r['batch']:6d} {1e3 * r['dense_s']:9.2f} {1e3 * r['epoch_s']:9.2f} {r['speedup']:8.3f} "
                     f"{100 * r['dense_moe_share']:6.1f} {r['dense_mem_gb']:9.1f} {r['epoch_mem_gb']:9.1f} "
                     f"{r['dense_oom']}/{r['epoch_oom']}")
    if args.plot:
        from dblock.simulator import plots
        plots.speedup_vs_batch(rows, args.plot)
    _emit(args, data, "\n".join(lines))
    return 0


def _serve_config(args, path: str):
    from dblock.simulator.positions import ParametricProfile
    from dblock.simulator.serving import ServeConfig
    from dataclasses import replace
    cfg, hw, par = _setup(args)
    if args.scale <= 0:
        raise ValueError(f"--scale={args.scale}: must be positive")
    cal = replace(_calibration(args.calibration), scale=args.scale)
    _dist(args.prompt, "--prompt", 1e7)
    _dist(args.tokens, "--tokens", 1e7)
    from dblock.simulator.papers import default_passes
    passes = args.passes or default_passes(args.model)
    _dist(passes, "--passes", 1e5)
    prof = _trace_profile(args, cfg.block_size) or ParametricProfile(C=cfg.block_size, passes=passes)
    return ServeConfig(cfg, hw, par, cal, path=path, schedule=args.schedule, profile=prof, prompt=args.prompt,
                       tokens=args.tokens, batch_cap=args.batch_cap, requests=args.requests, seed=args.seed)


def _read_arrivals(path: str) -> list[float]:
    from dblock.input_files import MAX_TRACE_BYTES, read_text
    from dblock.serving.loadgen import MAX_ARRIVALS
    text = read_text(path, "--arrivals", MAX_TRACE_BYTES)
    try:
        vals = json.loads(text)
        if not isinstance(vals, list):
            raise ValueError
    except (ValueError, RecursionError):
        vals = [line.split()[0] for line in text.splitlines() if line.strip()]
    if len(vals) > MAX_ARRIVALS:
        raise ValueError(f"--arrivals {path}: more than {MAX_ARRIVALS:,} arrival times")
    try:
        if any(isinstance(v, bool) for v in vals):
            raise TypeError
        out = [float(v) for v in vals]
    except (TypeError, ValueError):
        raise ValueError(f"--arrivals {path}: expected arrival times in seconds") from None
    if not out or not all(math.isfinite(v) and 0 <= v <= 1e9 for v in out):
        raise ValueError(f"--arrivals {path}: expected one or more finite arrival times in [0, 1e9] (seconds)")
    return out


def _serve(args) -> int:
    from dataclasses import replace
    from dblock.simulator.serving import simulate_serving
    if args.plot:
        check_out_file(args.plot, "--plot")
    paths = ["dense", "epoch"] if args.path == "both" else [args.path]
    arrivals = _read_arrivals(args.arrivals) if args.arrivals else None
    rates = [None] if arrivals else _positive_floats(args.rates, "--rates")
    curves: dict = {}
    lines = [f"{'path':6s} {'rate':>6s} {'P50 epoch':>10s} {'P95 epoch':>10s} {'P95 dblock':>10s} {'P95 token':>10s} "
             f"{'P95 block':>10s} {'P95 TTFT s':>10s} {'tok/s':>8s} {'peak B':>6s} OOM   keeps up"]
    total = len(paths) * len(rates)
    bar = None
    if not args.json and total > 1:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="simulate serving", unit="run", file=sys.stderr)
    for path in paths:
        base = _serve_config(args, path)
        curves[path] = []
        for lam in rates:
            sc = replace(base, arrivals=arrivals) if arrivals else replace(base, rate=lam)
            res = simulate_serving(sc)
            rate = lam if lam is not None else len(arrivals) / max(1e-9, max(arrivals) - min(arrivals))
            curves[path].append(dict(rate=rate, p95_itl=res.itl["p95"], itl=res.itl, itl_token=res.itl_token,
                                     itl_block=res.itl_block, itl_epoch=res.itl_epoch, ttft=res.ttft,
                                     throughput=res.throughput, peak_batch=res.peak_batch, oom=res.oom,
                                     stable=res.stable))
            lines.append(f"{path:6s} {rate:6.2f} {1e3 * res.itl_epoch['p50']:10.1f} {1e3 * res.itl_epoch['p95']:10.1f} "
                         f"{1e3 * res.itl['p95']:10.2f} {1e3 * res.itl_token['p95']:10.2f} "
                         f"{1e3 * res.itl_block['p95']:10.1f} "
                         f"{res.ttft['p95']:10.2f} {res.throughput:8.0f} {res.peak_batch:6d} {str(res.oom):5s} "
                         f"{res.stable}")
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if args.plot:
        from dblock.simulator import plots
        plots.itl_vs_rate(curves, args.plot)
    from dblock.simulator.serving import ITL_DEFINITIONS
    lines.append("ITL in ms, four definitions: " + "; ".join(f"{k} = {v}" for k, v in ITL_DEFINITIONS.items()))
    _emit(args, dict(curves=curves, calibration=_cal_source(args),
                     itl_definitions=dict(itl=ITL_DEFINITIONS["dblock"], itl_epoch=ITL_DEFINITIONS["epoch"],
                                          itl_token=ITL_DEFINITIONS["token"], itl_block=ITL_DEFINITIONS["block"])),
          "\n".join(lines))
    return 0


def _search(args) -> int:
    from dblock.simulator.serving import best_batch_cap
    if not (math.isfinite(args.slo) and args.slo > 0):
        raise ValueError(f"--slo={args.slo}: must be positive (seconds)")
    paths = ["dense", "epoch"] if args.path == "both" else [args.path]
    data, lines = {}, []
    for path in paths:
        res = best_batch_cap(_serve_config(args, path), args.slo, _ints(args.caps, "--caps"),
                             progress=show_progress(args), rate_hi=args.rate_max, itl=args.itl_definition)
        data[path] = res
        b = res["best"]
        lines.append(f"{path}: best batch cap {b['batch_cap']} holds P95 ITL ({args.itl_definition}) <= "
                     f"{1e3 * args.slo:.0f} ms up to "
                     f"{b['max_rate']:.2f} req/s")
        for row in res["table"]:
            lines.append(f"   cap {row['batch_cap']:5d}: max rate {row['max_rate']:.2f} req/s")
    _emit(args, data, "\n".join(lines))
    return 0
