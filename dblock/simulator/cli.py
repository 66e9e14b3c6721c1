"""`dblock simulate oba|alpha|pass|serve|search|calibrate ...` — thin: parse, call the library, print.

`dblock/cli.py` calls `add_parser(subparsers)`; each `simulate` subcommand runs its `set_defaults(_run=...)` function.
Errors are `ValueError`s with one clear message; the top-level CLI prints them as one line. Numeric flags carry
their ranges in their argparse types (`dblock.cli_args.int_arg`, `float_arg`): NaN, inf and out-of-range values are
refused at parse time, naming the flag. Work that would not finish (`oba --simulate` on a workload of more than
`MAX_SIM_PASSES` denoising passes) is refused before it starts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from dblock.cli_args import ArgumentParser, float_arg, int_arg, seed_arg
from dblock.out_paths import check_out_file

#: `simulate oba --simulate R`: the most denoising passes (R responses x blocks x passes per block) simulated
MAX_SIM_PASSES = 20_000_000


def _floats(text: str, flag: str = "") -> list[float]:
    """Comma-separated finite numbers (`flag` names the option in errors)."""
    where = f"{flag} " if flag else ""
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{where}{str(text)[:60]!r}: expected a comma-separated list of numbers") from None
    bad = next((v for v in vals if not math.isfinite(v)), None)
    if bad is not None:
        raise ValueError(f"{where}{str(text)[:60]!r}: {bad} is not a finite number")
    return vals


def _positive_floats(text: str, flag: str) -> list[float]:
    vals = _floats(text, flag)
    if not vals or min(vals) <= 0:
        raise ValueError(f"{flag} {str(text)[:60]!r}: give one or more positive numbers")
    return vals


def _ints(text: str, flag: str = "", hi: int = 1 << 20) -> list[int]:
    """Comma-separated integers in [1, hi]."""
    vals = _floats(text, flag)
    if not vals or any(v != int(v) or not 1 <= v <= hi for v in vals):
        raise ValueError(f"{flag + ' ' if flag else ''}{str(text)[:60]!r}: give one or more integers in [1, {hi}]")
    return [int(v) for v in vals]


def _dist(text: str, flag: str, max_mean: float) -> str:
    """A distribution flag (`kind:params`, dblock/simulator/dists.py) with finite parameters and a mean of at most
    `max_mean`; returned as given."""
    from dblock.simulator.dists import Dist
    try:
        d = Dist.parse(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    if not all(math.isfinite(v) for v in d.params):
        raise ValueError(f"{flag} {text!r}: parameters must be finite numbers")
    mean = d.params[0] if d.kind != "uniform" else sum(d.params) / 2
    if d.kind == "empirical":
        mean = max(d.params) if d.params else 0
    if mean > max_mean:
        raise ValueError(f"{flag} {text!r}: mean {mean:g} is beyond {max_mean:g}")
    return text


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="capacity planning: OBA closed forms, alpha, pass cost, serving",
                              description="Simulate block-diffusion MoE decoding and serving (see SIMULATOR.md).")
    sub = p.add_subparsers(dest="sim_command",
                           metavar="{oba,alpha,pass,serve,search,calibrate,profile,predict,validate}")
    sub.required = True

    def common(sp):
        sp.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
        sp.add_argument("--seed", type=seed_arg, default=0,
                        help="random seed of every simulation, in [0, 2**63-1] (default 0)")

    o = sub.add_parser("oba", help="OBA recurrence: fixed point, transient, TPS ratio and break-even")
    common(o)
    o.set_defaults(_run=_oba)
    o.add_argument("--nbar", type=float_arg(0.0, 1e6, lo_open=True), default=None,
                   help="Native passes per block n̄ (default: the paper's 13.1)")
    o.add_argument("--alpha", type=float_arg(-0.5, 1.0, hi_open=True), default=0.54,
                   help="passes saved per warm-up step α in [-0.5, 1) (default 0.54)")
    o.add_argument("--r", type=float_arg(0.0, 1e3, lo_open=True), default=1.26,
                   help="pass-cost ratio r of the paired pass (default 1.26)")
    o.add_argument("--k-max", type=int_arg(1, 10_000), default=10, help="blocks of the transient to print (default 10)")
    o.add_argument("--simulate", type=int_arg(0, 1_000_000), default=0, metavar="R",
                   help="also run the SimPy decoding model on R responses and compare with the closed forms")
    o.add_argument("--tokens", default="gamma:2048,0.3",
                   help="response-length distribution for --simulate (default gamma:2048,0.3)")
    o.add_argument("--block", type=int_arg(1, 1 << 16), default=256, help="block size C for --simulate (default 256)")
    o.add_argument("--paper", action="store_true", help="check every row of the One Block Ahead paper's tables")
    o.add_argument("--plot", default=None, metavar="PNG",
                   help="write the recurrence plot (or, with --paper, the break-even map) to this file")

    a = sub.add_parser("alpha", help="fit α from counters or traces, or predict it with the position model")
    common(a)
    a.set_defaults(_run=_alpha)
    pos = float_arg(0.0, lo_open=True)
    a.add_argument("--F", type=pos, help="denoising passes ΣF of the schedule's run")
    a.add_argument("--K", type=pos, help="blocks ΣK (omit to use Eq. 4 from --Y and --block)")
    a.add_argument("--Y", type=pos, help="generated tokens ΣY (for Eq. 4)")
    a.add_argument("--R", type=pos, help="responses R")
    a.add_argument("--nbar", type=pos, help="Native passes per block n̄")
    a.add_argument("--block", type=int_arg(1, 1 << 16), default=256, help="block size C for Eq. 4 (default 256)")
    a.add_argument("--paper", action="store_true",
                   help="predict FlowBlock(2) and Keep Tokens α from the paper's OBA α with the position model")
    a.add_argument("--responses", type=int_arg(1, 100_000), default=300,
                   help="simulated responses for --paper (default 300)")

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
    ps.add_argument("--calibration", default="fig2",
                    help="'fig2' (fit on the Epoch paper's Figure 2), 'none' (pure roofline) or OVERHEAD_S,MOE_ROW_S")
    ps.add_argument("--max-context", type=int_arg(1, 1 << 26), default=4096,
                    help="KV cache tokens reserved per request")
    ps.add_argument("--plot", default=None, metavar="PNG", help="write the Epoch/dense speedup-vs-batch plot")

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
                    help="P95 equivalent ITL objective (seconds)")
    se.add_argument("--caps", default="32,64,128,256,512", help="batch caps to try (comma-separated)")
    se.add_argument("--rate-max", type=float_arg(0.0, 1e6, lo_open=True), default=64.0,
                    help="upper end of the rate bisection (req/s)")

    ca = sub.add_parser("calibrate", help="measure the CPU profile, or calibrate on traces and predict held-out runs")
    common(ca)
    ca.set_defaults(_run=_calibrate)
    ca.add_argument("traces", nargs="*", help="JSON-lines traces to calibrate on (one Native run at least)")
    ca.add_argument("--cpu", action="store_true", help="measure matmul and memory-stream rates here; write a profile")
    ca.add_argument("--out", default=None, help="where --cpu writes its profile (default ~/.cache/dblock/)")
    ca.add_argument("--hold-out", nargs="*", default=[], help="traces to predict from the calibration")
    ca.add_argument("--hardware", default=None, help="hardware profile for the cost fit (default: none = skip)")
    ca.add_argument("--model", default=None, help="model config when the trace headers carry none")
    ca.add_argument("--delta-from", default="oba", help="schedule whose fitted α calibrates δ (default oba)")
    ca.add_argument("--gamma", type=float_arg(0.0, 1.0), default=None,
                    help="FlowBlock readiness gate γ (default: the gate the FlowBlock trace records, else the "
                         "decoder's default 0.5)")

    pr = sub.add_parser("profile", help="time every operator of a pass of a model on this machine; write a profile",
                        description="Time attention by (rows, context), dense MLP and router by rows, MoE by (rows, "
                                    "experts touched), the LM head by live rows and the fixed per-call costs, over a "
                                    "grid, with repeats and thread-CPU time; write the JSON profile the simulator "
                                    "interpolates (dblock/simulator/profile.py). About 1 minute for tiny-masked on "
                                    "2 cores (--quick: about 30 s).")
    common(pr)
    pr.set_defaults(_run=_profile)
    pr.add_argument("--model", required=True, help="an LLaDA-family model: bundled name (tiny-masked) or folder")
    pr.add_argument("--out", default=None,
                    help="where to write the profile (default ~/.cache/dblock/profiles/<model>-<machine>.json)")
    pr.add_argument("--quick", action="store_true", help="a smaller grid and 3 repeats (a smoke run)")
    pr.add_argument("--repeats", type=int_arg(2, 1000), default=None, help="repeats per grid point (default 7)")
    pr.add_argument("--executors", default="reference,epoch",
                    help="executors to profile: reference, epoch or both (default both)")

    pd = sub.add_parser("predict", help="predict TPS, T_den, TPS ratios, ITL and throughput from an operator profile",
                        description="The batched SimPy model (dblock/simulator/batch.py) priced by an operator profile "
                                    "(`simulate profile`): a workload (prompt and answer lengths, passes per block, "
                                    "or a Native trace replayed request by request), a batch size or an arrival "
                                    "rate, schedules and executors; every value with an interval from the profile's "
                                    "repeat quartiles.")
    common(pd)
    pd.set_defaults(_run=_predict)
    pd.add_argument("--profile", default=None, help="profile JSON (default: the one of --model on this machine)")
    pd.add_argument("--model", default="tiny-masked", help="model whose default profile to read (default tiny-masked)")
    pd.add_argument("--native-trace", default=None,
                    help="a Native run's trace (`compare-schedules --trace-dir`): its requests are replayed exactly")
    pd.add_argument("--prompt", default="uniform:5,12", help="prompt-length distribution (default uniform:5,12)")
    pd.add_argument("--tokens", default="uniform:8,48", help="answer-length distribution (default uniform:8,48)")
    pd.add_argument("--passes", default="gamma:1.6,0.5", help="Native passes per block (default gamma:1.6,0.5)")
    pd.add_argument("--requests", type=int_arg(1, 100_000), default=32, help="requests (default 32)")
    pd.add_argument("--batch-size", type=int_arg(1, 1 << 16), default=None,
                    help="closed batches of this many (default: all at once)")
    pd.add_argument("--rate", type=float_arg(0.0, 1e6, lo_open=True), default=None,
                    help="serve Poisson arrivals at this rate (requests per second) instead of closed batches")
    pd.add_argument("--batch-cap", type=int_arg(1, 1 << 16), default=16, help="serving batch cap (default 16)")
    pd.add_argument("--schedules", default="native,oba", help="native, native_nocache, oba, flowblock")
    pd.add_argument("--executors", default="reference,epoch", help="reference, epoch")
    pd.add_argument("--alpha", type=float_arg(0.0, 1.0, hi_open=True), default=0.0,
                    help="uniform-state models: passes saved per warm-up step (0 = masked: the waiting block decodes "
                         "nothing)")

    va = sub.add_parser("validate", help="predicted vs measured on this machine, held out from the profile",
                        description="Measure T_den, TPS ratios between schedules and executors, and serving "
                                    "throughput and P95 ITL on this machine (thread-CPU time, repeated) and print "
                                    "each beside the simulator's prediction from the operator profile and the "
                                    "counters of one Native run; median |error|. About 40 s on 2 cores, plus "
                                    "the profile when there is none yet.")
    common(va)
    va.set_defaults(_run=_validate)
    va.add_argument("--model", default="tiny-masked", help="an llada2_moe model (default tiny-masked)")
    va.add_argument("--profile", default=None,
                    help="profile JSON (default: the one `simulate profile` writes; measured first when missing)")
    va.add_argument("--n", type=int_arg(2, 10_000), default=32, help="problems per decoding run (default 32)")
    va.add_argument("--repeats", type=int_arg(1, 100), default=3, help="repeats of every measurement (default 3)")
    va.add_argument("--quick", action="store_true",
                    help="a smoke run: 16 problems, 2 repeats, batches 1,8,16, a quick profile when none exists")
    va.add_argument("--no-epoch", action="store_true", help="leave the Epoch executor out")
    va.add_argument("--no-alpha", action="store_true",
                    help="leave out the α rows (OBA and FlowBlock on tiny-uniform, each predicted with δ calibrated "
                         "on the other; about 2 min)")
    va.add_argument("--alpha-n", type=int_arg(8, 100_000), default=256,
                    help="requests per α run (default 256: the fitted α's own 95%% interval is about ±0.1 wide)")
    return p


def _serve_args(sp):
    sp.add_argument("--model", default="llada2-mini", help="llada2-mini, llada-moe-7b, or a model folder")
    sp.add_argument("--hardware", default="h100", help="h100, h200, b200, gb300, a100, cpu or a profile .json")
    sp.add_argument("--tp", type=int_arg(1, 4096), default=8, help="tensor-parallel ranks (default 8)")
    sp.add_argument("--ep", type=int_arg(1, 4096), default=8, help="expert-parallel ranks (default 8)")
    sp.add_argument("--sp", type=int_arg(1, 4096), default=8, help="sequence-parallel ranks (default 8)")
    sp.add_argument("--calibration", default="fig2",
                    help="'fig2', 'none' or OVERHEAD_S,MOE_ROW_S (see `simulate pass`)")
    sp.add_argument("--scale", type=float_arg(0.0, 1e6, lo_open=True), default=1.0,
                    help="multiply every pass time (the CPU scale fitted by `simulate calibrate`; default 1)")
    sp.add_argument("--path", default="both", choices=["dense", "epoch", "both"], help="executor path(s) to model")
    sp.add_argument("--schedule", default="native", choices=["native", "oba"], help="decoding schedule")
    sp.add_argument("--batch-cap", type=int_arg(1, 1 << 20), default=256, help="most requests running at once")
    sp.add_argument("--prompt", default="const:256", help="prompt-length distribution (e.g. lognormal:256,0.5)")
    sp.add_argument("--tokens", default="lognormal:256,0.5", help="response-length distribution")
    sp.add_argument("--passes", default="gamma:10,0.3", help="Native passes-per-block distribution")
    sp.add_argument("--requests", type=int_arg(1, 1_000_000), default=300, help="requests per simulated run")


def _calibration(text: str, cache_len: float = 512.0):
    from dblock.simulator import cost, papers
    if text == "fig2":
        return papers.fig2_calibration(papers.epoch_setup(cache_len))["cal"]
    if text == "none":
        return cost.Calibration()
    try:
        vals = _floats(text)
    except ValueError:
        vals = []
    if len(vals) != 2 or min(vals) < 0:
        raise ValueError(f"--calibration {text!r}: expected fig2, none, or OVERHEAD_S,MOE_ROW_S (two numbers >= 0)")
    return cost.Calibration(overhead_s=vals[0], moe_row_s=vals[1])


def _emit(args, data: dict, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=_jsonable))
    else:
        print(text)


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)


def main(args) -> int:
    """Run a parsed `simulate` subcommand (what `dblock.cli.main` does, without its error handling)."""
    return args._run(args)


# ---- sub-commands --------------------------------------------------------------------------------------------

def _oba(args) -> int:
    from dblock.simulator import oba, papers
    if args.paper:
        if args.plot:
            check_out_file(args.plot, "--plot")
        rows = papers.oba_rows()
        lines = [f"{'schedule':18s} {'alpha':>6s} {'r':>5s} {'r-1':>5s} {'(1+a)/r':>8s} {'measured':>8s} verdict"]
        for r in rows:
            lines.append(f"{r['schedule']:18s} {r['alpha']:6.2f} {r['r']:5.2f} {r['break_even']:5.2f} "
                         f"{r['predicted_tps_ratio']:8.3f} {r['measured_tps_ratio']:8.3f} "
                         f"{'pays' if r['pays'] else 'does not pay'}"
                         f" ({'agrees' if r['verdict_agrees'] else 'DISAGREES'})")
        if args.plot:
            from dblock.simulator import plots
            plots.break_even_map([dict(name=r["schedule"], alpha=r["alpha"], r=r["r"]) for r in rows], args.plot)
        _emit(args, dict(rows=rows), "\n".join(lines))
        return 0
    if args.plot:
        check_out_file(args.plot, "--plot")
    nbar = args.nbar if args.nbar is not None else papers.paper_native_nbar()
    if nbar <= 0:
        raise ValueError(f"--nbar={nbar}: must be positive")
    if args.simulate:
        _dist(args.tokens, "--tokens", 1e7)
        from dblock.simulator.dists import Dist
        d = Dist.parse(args.tokens)
        mean = d.params[0] if d.kind != "uniform" else sum(d.params) / 2
        passes = args.simulate * max(1.0, math.ceil(max(mean, 1.0) / args.block)) * nbar
        if passes > MAX_SIM_PASSES:
            raise ValueError(f"--simulate {args.simulate}: about {passes:.3g} denoising passes ({args.simulate} "
                             f"responses of ~{mean:g} tokens in {args.block}-token blocks, n̄ = {nbar:g}); at most "
                             f"{MAX_SIM_PASSES:g} are simulated: lower --simulate or --tokens, or raise --block")
    ks = list(range(1, args.k_max + 1))
    data = dict(nbar=nbar, alpha=args.alpha, r=args.r, fixed_point=oba.fixed_point(nbar, args.alpha),
                transient=[oba.transient(nbar, args.alpha, k) for k in ks],
                tps_ratio=oba.tps_ratio(args.alpha, args.r), break_even=oba.break_even(args.r),
                pays=oba.pays(args.alpha, args.r))
    sim_means = None
    if args.simulate:
        from dblock.simulator.decoding import simulate_decoding
        from dblock.simulator.positions import ParametricProfile, PositionModel
        prof = ParametricProfile(C=args.block, passes=f"gamma:{nbar},0.25")
        res = {}
        for sched in ("native", "oba"):
            m = PositionModel(prof, delta=args.alpha, noise_sd=0.2)
            res[sched] = simulate_decoding(m, sched, args.tokens, args.simulate, r=args.r, seed=args.seed,
                                           progress=not args.json)
        nb = res["native"].F / res["native"].K
        sim_means = res["oba"].mean_passes_by_index(args.k_max)
        try:
            fitted = oba.fit_alpha(res["oba"].F, res["oba"].K, res["oba"].R, nb)
        except ValueError as e:
            raise ValueError(f"--simulate {args.simulate} (--tokens {args.tokens}, --block {args.block}): α cannot "
                             f"be fitted on this workload: {e}; simulate more or longer responses") from None
        data["simulated"] = dict(native=res["native"].summary(), oba=res["oba"].summary(),
                                 n_by_block=sim_means.tolist(),
                                 fit_alpha=fitted,
                                 naive_alpha=oba.naive_alpha(nb, res["oba"].F, res["oba"].K),
                                 tps_ratio=res["oba"].tps / res["native"].tps)
    lines = [f"n̄ = {nbar:.3f}, α = {args.alpha}, r = {args.r}",
             f"fixed point n* = n̄/(1+α) = {data['fixed_point']:.3f} passes per block",
             "transient n_k = " + ", ".join(f"{x:.2f}" for x in data["transient"]),
             f"TPS ratio at n* = (1+α)/r = {data['tps_ratio']:.3f}; break-even α > r-1 = {data['break_even']:.3f}: "
             f"{'pays' if data['pays'] else 'does not pay'}"]
    if sim_means is not None:
        s = data["simulated"]
        lines.append("SimPy n_k     = " + ", ".join(f"{x:.2f}" for x in sim_means))
        lines.append(f"SimPy: fitted α = {s['fit_alpha']:.3f}, naive ᾱ = {s['naive_alpha']:.3f}, "
                     f"TPS ratio = {s['tps_ratio']:.3f}")
    if args.plot:
        from dblock.simulator import plots
        plots.alpha_recurrence(nbar, args.alpha, args.plot, args.k_max, sim_means)
    _emit(args, data, "\n".join(lines))
    return 0


def _alpha(args) -> int:
    from dblock.simulator import oba, papers
    if args.paper:
        data = papers.oba_position_predictions(responses=args.responses, seed=args.seed)
        lines = [f"paper-like Native profile: C=256, n̄={data['nbar']:.2f}, shape={data['profile']['shape']:.3f}"]
        for r in data["rows"]:
            lines.append(f"[{r['discount']} discount] δ={r['delta']:.3f} (OBA α=0.54), γ={r['gamma']:.3f}: "
                         f"FlowBlock α pred {r['flowblock_alpha']:.3f} vs paper {r['flowblock_paper']}; "
                         f"Keep Tokens α pred {r['keep_tokens_max']:.3f}..{r['keep_tokens_count']:.3f} "
                         f"(max..count rule) vs paper {r['keep_tokens_paper']}")
        _emit(args, data, "\n".join(lines))
        return 0
    for k in ("F", "R", "nbar"):
        if getattr(args, k) is None:
            raise ValueError(f"--{k}: required to fit α (or use --paper)")
    K = args.K
    if K is None:
        if args.Y is None:
            raise ValueError("--K or --Y: one is required (Eq. 4 estimates K from Y)")
        K = oba.blocks_from_tokens(args.Y, args.block, args.R)
    a = oba.fit_alpha(args.F, K, args.R, args.nbar)
    data = dict(alpha=a, naive_alpha=oba.naive_alpha(args.nbar, args.F, K), K=K,
                fixed_point=oba.fixed_point(args.nbar, a))
    _emit(args, data, f"α = {a:.4f} (Eq. 6), naive ᾱ = {data['naive_alpha']:.4f}, K = {K:g}")
    return 0


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
    rows = papers.epoch_batch_trend(cal, _ints(args.batch, "--batch"), setup, max_context=args.max_context)
    rs = {lay: cost.r_of(cfg, lay, hw, par, cal, cache_len=args.cache_len) for lay in ("oba", "dense_mask", "native2c")}
    data = dict(model=args.model, hardware=hw.name, parallel=vars(par), calibration=vars(cal), r_batch1=rs, rows=rows,
                fig2=fig2)
    lines = [f"{hw.name}, TP={par.tp} EP={par.ep} SP={par.sp}, calibration {vars(cal)}"]
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
    _dist(args.passes, "--passes", 1e5)
    return ServeConfig(cfg, hw, par, cal, path=path, schedule=args.schedule,
                       profile=ParametricProfile(C=cfg.block_size, passes=args.passes), prompt=args.prompt,
                       tokens=args.tokens, batch_cap=args.batch_cap, requests=args.requests, seed=args.seed)


def _read_arrivals(path: str) -> list[float]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--arrivals {path}: {e.strerror}") from None
    try:
        vals = json.loads(text)
        if not isinstance(vals, list):
            raise ValueError
    except ValueError:
        vals = [line.split()[0] for line in text.splitlines() if line.strip()]
    try:
        out = [float(v) for v in vals]
    except (TypeError, ValueError):
        raise ValueError(f"--arrivals {path}: expected arrival times in seconds") from None
    if not out or not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(f"--arrivals {path}: expected one or more finite arrival times >= 0 (seconds)")
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
    lines = [f"{'path':6s} {'rate':>6s} {'P50 ITL ms':>10s} {'P95 ITL ms':>10s} {'P99 ITL ms':>10s} "
             f"{'P95 TTFT s':>10s} {'tok/s':>8s} {'peak B':>6s} OOM   keeps up"]
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
            curves[path].append(dict(rate=rate, p95_itl=res.itl["p95"], itl=res.itl, ttft=res.ttft,
                                     throughput=res.throughput, peak_batch=res.peak_batch, oom=res.oom,
                                     stable=res.stable))
            lines.append(f"{path:6s} {rate:6.2f} {1e3 * res.itl['p50']:10.1f} {1e3 * res.itl['p95']:10.1f} "
                         f"{1e3 * res.itl['p99']:10.1f} {res.ttft['p95']:10.2f} {res.throughput:8.0f} "
                         f"{res.peak_batch:6d} {str(res.oom):5s} {res.stable}")
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if args.plot:
        from dblock.simulator import plots
        plots.itl_vs_rate(curves, args.plot)
    _emit(args, dict(curves=curves), "\n".join(lines))
    return 0


def _search(args) -> int:
    from dblock.simulator.serving import best_batch_cap
    if not (math.isfinite(args.slo) and args.slo > 0):
        raise ValueError(f"--slo={args.slo}: must be positive (seconds)")
    paths = ["dense", "epoch"] if args.path == "both" else [args.path]
    data, lines = {}, []
    for path in paths:
        res = best_batch_cap(_serve_config(args, path), args.slo, _ints(args.caps, "--caps"), progress=not args.json,
                             rate_hi=args.rate_max)
        data[path] = res
        b = res["best"]
        lines.append(f"{path}: best batch cap {b['batch_cap']} holds P95 ITL <= {1e3 * args.slo:.0f} ms up to "
                     f"{b['max_rate']:.2f} req/s")
        for row in res["table"]:
            lines.append(f"   cap {row['batch_cap']:5d}: max rate {row['max_rate']:.2f} req/s")
    _emit(args, data, "\n".join(lines))
    return 0


def _calibrate(args) -> int:
    from dblock.simulator import calibrate, cost, hardware
    if args.cpu:
        if args.out:
            check_out_file(args.out, "--out")
        path = args.out or hardware.CPU_PROFILE_PATH
        hw = hardware.calibrate_cpu(path=path)
        _emit(args, dict(profile=hw.as_dict(), path=path),
              f"{hw.name}: {hw.bf16_flops / 1e9:.1f} GFLOP/s matmul (fp32), {hw.hbm_bw / 1e9:.1f} GB/s stream; "
              f"written to {path}")
        return 0
    if not args.traces:
        raise ValueError("calibrate: give trace files to calibrate on, or --cpu to measure this machine")
    runs = [calibrate.Run.load(p) for p in args.traces]
    hw = hardware.get(args.hardware) if args.hardware else None
    cfg = cost.get_model(args.model) if args.model else None
    cal = calibrate.calibrate(runs, hw=hw, cfg=cfg, delta_from=args.delta_from, gamma=args.gamma)
    preds = [calibrate.predict_run(cal, calibrate.Run.load(p)) for p in args.hold_out]
    lines = [f"n̄ = {cal.nbar:.3f} (Native), T_den = {1e3 * cal.native_t_den:.3f} ms"]
    if cal.liveness is not None:
        lines.append(f"liveness: live {cal.liveness.live:.3f}, fresh {cal.liveness.fresh:.3f} of rows per pass")
    if cal.cost_fit is not None:
        f = cal.cost_fit
        lines.append(f"cost fit (2 fitted factors: scale and overhead_s; moe_row_s held at 0): scale "
                     f"{f.cal.scale:.3f}, overhead {1e6 * f.cal.overhead_s:.1f} us/sub-block, "
                     f"median |err| {100 * f.median_abs_rel_err:.1f}% over {f.n_passes} passes (on CPU prefer the "
                     "operator profile: `dblock simulate profile`, `simulate validate`)")
    for s, a in cal.alphas.items():
        lines.append(f"{s}: α = {a['alpha']:.3f} (naive {a['naive']:.3f}), r = {a['r']:.3f}, "
                     f"pays: {a['alpha'] > a['r'] - 1}")
    if cal.delta is not None:
        lines.append(f"δ = {cal.delta:.3f} (from {cal.delta_from})")
    elif cal.delta_note:
        lines.append(cal.delta_note + " -> α of held-out schedules is not predicted")
    for p in preds:
        pr, me, er = p["predicted"], p["measured"], p["rel_error"]
        al = (f", α pred {pr['alpha']:.3f}" + (f" (bracket {pr['alpha_bracket'][0]:.3f}..{pr['alpha_bracket'][1]:.3f})"
              if "alpha_bracket" in pr else "") + f" vs fitted {me['alpha']:.3f}") if p["schedule"] != "native" else ""
        lines.append(f"held out {p['path']} ({p['schedule']}): TPS ratio pred {pr['tps_ratio']:.3f} vs measured "
                     f"{me['tps_ratio']:.3f} ({100 * er['tps_ratio']:+.1f}%), n pred {pr['n']:.2f} vs {me['n']:.2f}, "
                     f"T_den pred {1e3 * pr['t_den']:.3f} vs {1e3 * me['t_den']:.3f} ms{al}"
                     + (f" [{p['note']}]" if p.get("note") else ""))
    _emit(args, dict(calibration=cal.as_dict(), predictions=preds), "\n".join(lines))
    return 0


def _profile_path(model: str) -> str:
    from dblock.simulator.profile import default_path
    from dblock.simulator.profiler import machine_tag
    return default_path(model, machine_tag())


def _profile(args) -> int:
    import numpy as np
    from dblock.simulator.profiler import profile_model
    out = args.out or _profile_path(args.model)
    if args.out:
        check_out_file(args.out, "--out")
    ex = [e.strip() for e in args.executors.split(",") if e.strip()]
    bad = [e for e in ex if e not in ("reference", "epoch")]
    if bad or not ex or "reference" not in ex:
        raise ValueError(f"--executors {args.executors!r}: give reference or reference,epoch")
    prof = profile_model(args.model, out=out, executors=ex, quick=args.quick, repeats=args.repeats,
                         progress=not args.json)
    lines = [f"profile of {args.model} on {prof.meta['machine']} ({prof.meta['threads']} thread(s), "
             f"{prof.meta['repeats']} repeats, {prof.meta['seconds']:.0f} s), written to {out}"]
    for name, t in sorted(prof.tables.items()):
        spread = float(np.nanmedian((t.hi - t.lo) / np.maximum(t.median, 1e-12)))
        lines.append(f"  {name:<20} {'x'.join(str(len(g)) for g in t.grid):>6} points over ({', '.join(t.axes)}): "
                     f"{1e3 * float(t.median.min()):.3f}..{1e3 * float(t.median.max()):.3f} ms per {t.per}, "
                     f"quartile spread {100 * spread:.0f}%")
    _emit(args, dict(path=out, meta=prof.meta, tables=sorted(prof.tables)), "\n".join(lines))
    return 0


def _predict(args) -> int:
    from dblock.simulator import batch
    from dblock.simulator.positions import ParametricProfile
    from dblock.simulator.profile import Profile
    path = args.profile or _profile_path(args.model)
    if not os.path.isfile(path):
        raise ValueError(f"profile {path}: no such file (write one with `dblock simulate profile --model ...`)")
    prof = Profile.load(path)
    C = int(prof.model.get("block_size") or 16)
    if args.native_trace:
        from dblock.simulator.calibrate import Run
        run = Run.load(args.native_trace)
        by_req: dict = {}
        for b in run.blocks:
            by_req.setdefault(str(b["request"]), []).append(b)
        reqs = [r for r in run.requests if str(r["request"]) in by_req]
        if not reqs:
            raise ValueError(f"--native-trace {args.native_trace}: no request with block events")
        mnt = int((run.header.get("decode") or {}).get("max_new_tokens") or 128)
        wl = batch.Workload.from_runs([r["prompt_len"] for r in reqs], mnt,
                                      [by_req[str(r["request"])] for r in reqs], run.block_size)
    else:
        for flag, text in (("--prompt", args.prompt), ("--tokens", args.tokens)):
            _dist(text, flag, 1e6)
        _dist(args.passes, "--passes", 1e4)
        wl = batch.Workload.sample(args.requests, args.prompt, args.tokens, ParametricProfile(C=C, passes=args.passes),
                                   C, seed=args.seed)
    scheds = [s.strip() for s in args.schedules.split(",") if s.strip()]
    exs = [e.strip() for e in args.executors.split(",") if e.strip()]
    for e in exs:
        if e not in ("reference", "epoch"):
            raise ValueError(f"--executors {args.executors!r}: allowed reference, epoch")
    masked = args.alpha == 0.0
    arrivals = None
    if args.rate:
        import numpy as np
        arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1.0 / args.rate, len(wl))).tolist()
    rows = batch.predict(wl, prof, exs, [batch.Schedule(s, masked=masked, alpha=args.alpha) for s in scheds],
                         args.batch_size, arrivals, args.batch_cap)
    regime = (f"serving at {args.rate:g} req/s, batch cap {args.batch_cap}" if args.rate else
              f"closed batches of {args.batch_size or len(wl)}")
    lines = [f"{len(wl)} requests, {regime}; profile {path}; α input {args.alpha:g}"
             + (" (masked: α = 0 by construction)" if masked else ""),
             f"{'executor':<10} {'schedule':<15} {'TPS':>18} {'T_den ms':>18} {'TPF':>6} {'α fit':>6} "
             f"{'TPS ratio':>18}" + (f" {'tok/s':>18} {'P95 ITL ms':>18}" if args.rate else "")]

    def iv(d, k=1.0, f="{:.2f}"):
        return f"{f.format(k * d['value'])} [{f.format(k * d['interval'][0])}..{f.format(k * d['interval'][1])}]"
    for r in rows:
        a = "-" if r["alpha"] is None else f"{r['alpha']:.3f}"
        lines.append(f"{r['executor']:<10} {r['schedule']:<15} {iv(r['TPS'], f='{:.0f}'):>18} "
                     f"{iv(r['T_den_s'], 1e3):>18} {r['TPF']:>6.2f} {a:>6} {iv(r['tps_ratio'], f='{:.3f}'):>18}"
                     + (f" {iv(r['throughput'], f='{:.0f}'):>18} {iv(r['itl_p95'], 1e3):>18}" if args.rate else ""))
    _emit(args, dict(profile=path, regime=regime, rows=rows), "\n".join(lines))
    return 0


def _validate(args) -> int:
    from dblock.simulator import validate
    from dblock.simulator.profile import Profile
    path = args.profile or _profile_path(args.model)
    if args.profile and not os.path.isfile(args.profile):
        raise ValueError(f"--profile {args.profile}: no such file (write one with `dblock simulate profile`)")
    plan = validate.Plan(model=args.model, n=args.n, repeats=args.repeats, epoch=not args.no_epoch,
                         alpha_model=None if args.no_alpha else "tiny-uniform", alpha_n=args.alpha_n)
    if args.quick:
        plan.n, plan.repeats, plan.batches, plan.serve_requests = min(args.n, 16), min(args.repeats, 2), (1, 8, 16), 32
        plan.alpha_n = min(args.alpha_n, 32)
    if os.path.isfile(path):
        prof = Profile.load(path)
        from dblock.simulator.profiler import code_fingerprint
        if prof.meta.get("code") != code_fingerprint():
            print(f"warning: the profile {path} was measured on other executor code than this checkout's: its "
                  f"predictions price that code (`dblock simulate profile --model {args.model}` re-measures it)",
                  file=sys.stderr)
    else:
        from dblock.simulator.profiler import profile_model
        if not args.json:
            print(f"no profile at {path}: measuring one first{' (quick)' if args.quick else ''}", file=sys.stderr)
        prof = profile_model(args.model, out=path, quick=args.quick, progress=not args.json,
                             executors=("reference",) if args.no_epoch else ("reference", "epoch"))
    rep = validate.run(plan, prof, progress=None if args.json else (lambda s: print(s, file=sys.stderr)))
    d = rep.meta.get("drift", {})
    text = (f"{args.model}: predicted from the profile ({path}; machine drift since profiling x"
            f"{d.get('factor', 1.0):.3f}) and the counters of one Native run; measured in thread-CPU time, "
            f"{plan.repeats} repeats\n" + rep.table())
    _emit(args, rep.as_dict(), text)
    return 0


def _standalone(argv=None) -> int:  # pragma: no cover - `python -m dblock.simulator.cli` for quick use
    parser = ArgumentParser(prog="dblock")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    try:
        return main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_standalone())
