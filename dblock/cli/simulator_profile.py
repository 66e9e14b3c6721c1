"""`dblock simulate calibrate|profile|predict|validate`: the simulator fitted to this machine — calibration on
traces, the operator profile of a model, predictions priced by that profile, and their validation against
measurement."""
from __future__ import annotations

import os
import sys

from dblock.cli.simulator_common import _dist, _emit
from dblock.cli_args import FlagRule, add_flag_rules, float_arg, int_arg, show_progress
from dblock.out_paths import check_out_file


def add_parsers(sub, common) -> None:
    """The `simulate calibrate|profile|predict|validate` subcommands, added to `sub` (`common` adds --json and --seed)."""
    ca = sub.add_parser("calibrate", help="measure the CPU profile, or calibrate on traces and predict held-out runs")
    common(ca)
    ca.set_defaults(_run=_calibrate)
    ca.add_argument("traces", nargs="*", help="JSON-lines traces to calibrate on (one Native run at least)")
    ca.add_argument("--cpu", action="store_true", help="measure matmul and memory-stream rates here; write a profile")
    ca.add_argument("--out", default=None, help="where --cpu writes its profile (default ~/.cache/dblock/), or --published its fit")
    ca.add_argument("--hold-out", nargs="*", default=[], help="traces to predict from the calibration")
    ca.add_argument("--hardware", default=None, help="hardware profile for the cost fit (default: none = skip)")
    ca.add_argument("--model", default=None, help="model config when the trace headers carry none")
    ca.add_argument("--delta-from", default="oba", help="schedule whose fitted α calibrates δ (default oba)")
    ca.add_argument("--gamma", type=float_arg(0.0, 1.0), default=None,
                    help="FlowBlock readiness gate γ (default: the gate the FlowBlock trace records, else the "
                         "decoder's default 0.5)")
    ca.add_argument("--published", nargs="?", const=_published_default(), default=None, metavar="FILE",
                    help="fit the GPU cost model on the calibration points of a published-measurements file "
                         "(default: the project's, dblock/simulator/data/published_gpu.json) and print every fitted "
                         "value with the points that determine it; --out FIT.json writes the fit")

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
                    help="leave out the α rows (OBA and FlowBlock on --alpha-model, each predicted with δ calibrated "
                         "on the other)")
    va.add_argument("--alpha-only", action="store_true",
                    help="only the α rows (no operator profile, no timing rows; about 5 min on code-uniform)")
    va.add_argument("--alpha-model", default="code-uniform",
                    help="the uniform-state (diffusion_gemma) model whose α rows are predicted (default code-uniform)")
    va.add_argument("--alpha-n", type=int_arg(8, 100_000), default=256,
                    help="requests per α run (default 256: the fitted α's own 95%% interval is about ±0.1 wide)")
    va.add_argument("--published", nargs="?", const=_published_default(), default=None, metavar="FILE",
                    help="instead of this machine: predict every point of a published-measurements file (default: "
                         "the project's) with the GPU cost model and print it beside the published value, with the "
                         "error and whether the point was fitted (any file in the schema of "
                         "dblock/simulator/published.py: your own cluster's measurements)")
    va.add_argument("--fit", default=None, metavar="FIT.json",
                    help="with --published: the fit to predict with (default: the stored one, "
                         "dblock/simulator/data/gpu_fit.json; write another with `calibrate --published --out`)")

    add_flag_rules(ca, FlagRule("--out", "with --cpu (where it writes the CPU profile) or --published (where it "
                                "writes the fit)", lambda a, c: a.cpu or a.published is not None),
                   FlagRule(("--hold-out", "--hardware", "--model", "--delta-from", "--gamma"),
                            "to calibrating on traces, not with --cpu or --published",
                            lambda a, c: not a.cpu and a.published is None),
                   FlagRule("--seed", "to the simulations that draw random numbers; calibrate fits and measures",
                            lambda a, c: False))
    add_flag_rules(pr, FlagRule("--seed", "to the simulations that draw random numbers; profile times operators",
                                lambda a, c: False))
    add_flag_rules(pd, FlagRule(("--prompt", "--tokens", "--passes", "--requests"), "without --native-trace (its "
                                "requests are replayed as they were)", lambda a, c: a.native_trace is None),
                   FlagRule("--batch-cap", "with --rate (the serving batch cap; closed batches take --batch-size)",
                            lambda a, c: a.rate is not None),
                   FlagRule("--batch-size", "without --rate (closed batches; serving takes --batch-cap)",
                            lambda a, c: a.rate is None),
                   FlagRule("--seed", "to what draws random numbers: a sampled workload (no --native-trace) or "
                            "Poisson arrivals (--rate)", lambda a, c: a.native_trace is None or a.rate is not None))
    add_flag_rules(va, FlagRule(("--model", "--profile", "--n", "--repeats", "--no-epoch"),
                                "without --alpha-only (they set the timing rows)", lambda a, c: not a.alpha_only),
                   FlagRule(("--alpha-model", "--alpha-n"), "without --no-alpha (they set the α rows)",
                            lambda a, c: not a.no_alpha),
                   FlagRule("--fit", "with --published (the fit its points are predicted with)",
                            lambda a, c: a.published is not None))


def _refuse_with_published(args, defaults: dict) -> None:
    """--published works on published points, not on this machine: a flag of the machine's runs is refused."""
    given = [k for k, v in defaults.items() if getattr(args, k) != v]
    if given:
        flags = ", ".join(("--" + k.replace("_", "-")) if k != "traces" else "trace files" for k in given)
        raise ValueError(f"--published predicts published GPU points: {flags} does not apply to it")


def _published_default() -> str:
    from dblock.simulator.published import DATA_PATH
    return DATA_PATH


def _calibrate(args) -> int:
    from dblock.simulator import calibrate, cost, hardware
    if args.published:
        _refuse_with_published(args, dict(cpu=False, traces=[], hold_out=[], hardware=None, model=None,
                                          delta_from="oba", gamma=None))
        from dblock.cli.simulator_published import calibrate_published
        return calibrate_published(args)
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
    runs = [calibrate.Run.load(p, flag="trace") for p in args.traces]
    hw = hardware.get(args.hardware) if args.hardware else None
    cfg = cost.get_model(args.model) if args.model else None
    cal = calibrate.calibrate(runs, hw=hw, cfg=cfg, delta_from=args.delta_from, gamma=args.gamma)
    preds = [calibrate.predict_run(cal, calibrate.Run.load(p, flag="--hold-out")) for p in args.hold_out]
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
    from dblock.simulator.fingerprint import machine_tag
    return default_path(model, machine_tag())


def _profile(args) -> int:
    import numpy as np
    from dblock.profiling.profiler import profile_model
    out = args.out or _profile_path(args.model)
    if args.out:
        check_out_file(args.out, "--out")
    ex = [e.strip() for e in args.executors.split(",") if e.strip()]
    bad = [e for e in ex if e not in ("reference", "epoch")]
    if bad or not ex or "reference" not in ex:
        raise ValueError(f"--executors {args.executors!r}: give reference or reference,epoch")
    prof = profile_model(args.model, out=out, executors=ex, quick=args.quick, repeats=args.repeats,
                         progress=show_progress(args))
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
    prof = Profile.load(path, "--profile" if args.profile else None)
    C = int(prof.model.get("block_size") or 16)
    if args.native_trace:
        from dblock.simulator.calibrate import Run
        run = Run.load(args.native_trace, flag="--native-trace")
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
    from dblock.profiling import validate
    from dblock.simulator.profile import Profile
    if args.published:
        _refuse_with_published(args, dict(model="tiny-masked", profile=None, n=32, repeats=3, quick=False,
                                          no_epoch=False, no_alpha=False, alpha_only=False,
                                          alpha_model="code-uniform", alpha_n=256))
        from dblock.cli.simulator_published import validate_published
        return validate_published(args)
    if args.fit:
        raise ValueError("--fit: only with --published (the fit the published points are predicted with)")
    path = args.profile or _profile_path(args.model)
    if args.profile and not os.path.isfile(args.profile):
        raise ValueError(f"--profile {args.profile}: no such file (write one with `dblock simulate profile`)")
    plan = validate.Plan(model=args.model, n=args.n, repeats=args.repeats, epoch=not args.no_epoch,
                         alpha_model=None if args.no_alpha else args.alpha_model, alpha_n=args.alpha_n,
                         seed=args.seed)
    if plan.alpha_model:                  # refused before any measurement: its runs come last
        from dblock.config import load_config
        from dblock.weights_path import resolve_model_path
        fam = load_config(resolve_model_path(plan.alpha_model)).family
        if fam != "diffusion_gemma":
            raise ValueError(f"--alpha-model {plan.alpha_model}: a {fam} model; the α rows need a uniform-state "
                             "(diffusion_gemma) model: on a masked model α = 0 by construction")
    if args.quick:
        plan.n, plan.repeats, plan.batches, plan.serve_requests = min(args.n, 16), min(args.repeats, 2), (1, 8, 16), 32
        plan.alpha_n = min(args.alpha_n, 32)
    if args.alpha_only:
        if args.no_alpha:
            raise ValueError("--alpha-only with --no-alpha: give one of them")
        import time
        t0 = time.perf_counter()
        rows = validate.alpha_rows(plan, progress=None if args.json else (lambda s: print(s, file=sys.stderr)))
        rep = validate.Report(rows, dict(alpha_model=plan.alpha_model, alpha_n=plan.alpha_n,
                                         alpha_batch=plan.alpha_batch, seed=plan.seed,
                                         seconds=time.perf_counter() - t0))
        _emit(args, rep.as_dict(), f"{plan.alpha_model}: α of each warm-up schedule predicted with δ calibrated on "
                                   f"the other ({plan.alpha_n} held-out problems per run)\n" + rep.table())
        return 0
    if os.path.isfile(path):
        prof = Profile.load(path, "--profile" if args.profile else None)
        from dblock.simulator.fingerprint import code_fingerprint
        if prof.meta.get("code") != code_fingerprint():
            print(f"warning: the profile {path} was measured on other executor code than this checkout's: its "
                  f"predictions price that code (`dblock simulate profile --model {args.model}` re-measures it)",
                  file=sys.stderr)
    else:
        from dblock.profiling.profiler import profile_model
        if not args.json:
            print(f"no profile at {path}: measuring one first{' (quick)' if args.quick else ''}", file=sys.stderr)
        prof = profile_model(args.model, out=path, quick=args.quick, progress=show_progress(args),
                             executors=("reference",) if args.no_epoch else ("reference", "epoch"))
    rep = validate.run(plan, prof, progress=None if args.json else (lambda s: print(s, file=sys.stderr)))
    d = rep.meta.get("drift", {})
    text = (f"{args.model}: predicted from the profile ({path}; machine drift since profiling x"
            f"{d.get('factor', 1.0):.3f}) and the counters of one Native run; measured in thread-CPU time, "
            f"{plan.repeats} repeats\n" + rep.table())
    _emit(args, rep.as_dict(), text)
    return 0
