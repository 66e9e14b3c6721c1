"""`dblock simulate oba|alpha`: the One Block Ahead recurrence (fixed point, transient, TPS ratio, break-even, the
paper's rows, a SimPy check) and α fitted from counters or predicted with the position model."""
from __future__ import annotations

import math

from dblock.cli.simulator_common import _dist, _emit
from dblock.cli_args import FlagRule, add_flag_rules, float_arg, int_arg, show_progress
from dblock.out_paths import check_out_file

#: `simulate oba --simulate R`: the most denoising passes (R responses x blocks x passes per block) simulated
MAX_SIM_PASSES = 20_000_000


def add_parsers(sub, common) -> None:
    """The `simulate oba|alpha` subcommands, added to `sub` (`common` adds --json and --seed)."""
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
    add_flag_rules(o, FlagRule(("--nbar", "--alpha", "--r", "--k-max", "--simulate", "--tokens", "--block", "--seed"),
                               "without --paper (--paper checks the paper's own rows)", lambda a, c: not a.paper),
                   FlagRule(("--tokens", "--block", "--seed"), "with --simulate R > 0 (the closed forms draw nothing)",
                            lambda a, c: a.simulate > 0))
    add_flag_rules(a, FlagRule(("--F", "--K", "--Y", "--R", "--nbar", "--block"), "without --paper (--paper predicts "
                               "from the paper's OBA α, not from counters)", lambda a, c: not a.paper),
                   FlagRule(("--responses", "--seed"), "with --paper (fitting α from counters draws nothing)",
                            lambda a, c: a.paper),
                   FlagRule(("--Y", "--block"), "without --K (they estimate K by Eq. 4)", lambda a, c: a.K is None))


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
    if args.simulate and args.alpha < 0:
        raise ValueError(f"--alpha {args.alpha:g} with --simulate {args.simulate}: the simulation's position model "
                         "takes α as the passes a warm-up step saves (δ >= 0); give --alpha >= 0 or leave out "
                         "--simulate (the closed forms take any α in [-0.5, 1))")
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
                                           progress=show_progress(args))
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
