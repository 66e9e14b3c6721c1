"""End-to-end check of the capacity planner on this machine: plan, then serve at the plan and at 1.25x it.

1. Plan (`dblock.simulator.plan_profiled`, what `dblock simulate plan --operator-profile` runs): this CPU's operator
   profile of the model as the hardware, one replica; the batch cap and executor (reference = dense, epoch) that hold
   P95 ITL <= --slo-itl and P95 TTFT <= --slo-ttft at the highest Poisson rate. The workload is the model's own Native
   decode of its task (`dblock compare-schedules --schedules native --trace-dir`, made here when --native-trace is
   not given): every request's prompt length and block chain replayed. The profile is scaled to what a real server's
   calls cost (`--drift probe`): a probe server at --probe-rate first, then (--probe-rounds) a probe of the planned
   executor at the planned rate and cap and a re-plan, until the planned rate moves by at most --probe-tol — the
   server's calls cost more under the planned load (the load generator, HTTP and the tokenizer share the cores).
2. Serve: a real `dblock serve` (one torch thread, the planned executor and `--max-batch` = the planned cap) and
   `dblock loadgen`'s open-loop Poisson arrivals for --duration seconds at the planned rate and at 1.25x it, prompts
   from the task's test split, --max-tokens as in the trace.
3. Print planned beside measured (P95 ITL, P95 TTFT, throughput) with the error, and whether the SLO holds at the
   planned rate and fails at 1.25x; when it also holds at 1.25x the plan was conservative, and the script says by
   how much (the measured P95s' margin to the SLO at 1.25x).

    .venv/bin/python benchmarks/plan_cpu.py --out runs/plan_cpu            # code-masked, about 10 minutes
    .venv/bin/python benchmarks/plan_cpu.py --analyse-only --out runs/plan_cpu

Writes OUT/plan.json, OUT/loadgen.json, OUT/report.md. Never used by tests.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serving_cpu import loadavg, start_server, stop_server  # noqa: E402
from dblock.serving import loadgen as lg  # noqa: E402


def native_trace(args) -> str:
    if args.native_trace:
        return args.native_trace
    d = os.path.join(args.out, "native")
    path = os.path.join(d, "native.jsonl")
    if not os.path.isfile(path):
        cmd = [sys.executable, "-m", "dblock", "--threads", "1", "compare-schedules", "--model", args.model,
               "--task", args.task, "--n", str(args.n), "--schedules", "native", "--trace-dir", d, "--json"]
        print("trace:", " ".join(cmd[2:]), file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return path


def workload(path: str):
    from dblock.simulator import batch
    from dblock.simulator.calibrate import Run
    run = Run.load(path)
    by: dict = {}
    for b in run.blocks:
        by.setdefault(str(b["request"]), []).append(b)
    reqs = [r for r in run.requests if str(r["request"]) in by]
    mnt = int((run.header.get("decode") or {}).get("max_new_tokens") or 64)
    return batch.Workload.from_runs([r["prompt_len"] for r in reqs], mnt, [by[str(r["request"])] for r in reqs],
                                    run.block_size), mnt


def plan(args):
    from dblock.cli.simulator_profile import _profile_path
    from dblock.simulator.plan_profiled import plan_profiled, serve
    from dblock.simulator.profile import Profile, ProfiledCost
    path = args.profile or _profile_path(args.model)
    if not os.path.isfile(path):
        sys.exit(f"no operator profile at {path}: `dblock simulate profile --model {args.model}` first")
    prof = Profile.load(path)
    wl, mnt = workload(native_trace(args))
    scale, dr = 1.0, None
    execs = ["reference", "epoch"]
    if args.drift == "probe":
        args.max_tokens = mnt
        dr = {ex: probe(args, path, ex) for ex in execs}
        for ex, d in dr.items():
            print(f"probe {ex}: the server's calls x{d['factor']:.3f} the profile's", file=sys.stderr)

        def replan():
            t0 = time.time()
            parts = [plan_profiled(prof, wl, args.slo_itl, args.slo_ttft, caps=[int(c) for c in args.caps.split(",")],
                                   executors=[ex], n=args.requests, seed=args.seed, scale=dr[ex]["factor"],
                                   rate_margin=args.rate_margin,
                                   progress=lambda s: print("plan:", s, file=sys.stderr)) for ex in execs]
            o = dict(parts[0], plans=sorted([p for q in parts for p in q["plans"]], key=lambda p: -p["rate"]),
                     table=[t for q in parts for t in q["table"]])
            o["plan_s"] = time.time() - t0
            return o

        def summary(o, i):
            b = o["plans"][0] if o["plans"] else None
            return dict(round=i, factors={ex: d["factor"] for ex, d in dr.items()},
                        probed={ex: dict(rate=d["rate"], cap=d["cap"]) for ex, d in dr.items()},
                        executor=b and b["executor"], batch_cap=b and b["batch_cap"], rate=b and b["rate"])
        out = replan()
        rounds = [summary(out, 0)]
        # the probe's load is not the plan's: the server's calls cost more at the planned rate (the load generator,
        # HTTP and the tokenizer share the cores). Probe again where the plan will run, re-plan, until it settles.
        for i in range(1, args.probe_rounds):
            if not out["plans"]:
                break
            best = out["plans"][0]
            ex = best["executor"]
            dr[ex] = probe(args, path, ex, rate=best["rate"], cap=best["batch_cap"], tag=f"round{i}")
            print(f"probe round {i} ({ex} at {best['rate']:.2f} req/s, cap {best['batch_cap']}): the server's "
                  f"calls x{dr[ex]['factor']:.3f} the profile's", file=sys.stderr)
            out = replan()
            rounds.append(summary(out, i))
            new = out["plans"][0]["rate"] if out["plans"] else 0.0
            if abs(new - best["rate"]) <= args.probe_tol * best["rate"] and \
                    (out["plans"] and out["plans"][0]["executor"] == ex):
                break
        out["probe_rounds"] = rounds
        scale = dr[out["plans"][0]["executor"]]["factor"] if out["plans"] else 1.0
    elif args.drift != "none":
        # the profile is thread-CPU time on a quiet core; the server runs on the wall clock of this machine now
        import dblock
        from dblock.profiling.profiler import drift
        dr = drift(prof, dblock.load(args.model), timer=time.perf_counter if args.drift == "wall" else time.thread_time)
        scale = dr["factor"]
        print(f"drift ({args.drift} clock) x{scale:.3f}", file=sys.stderr)
    if args.drift != "probe":
        t0 = time.time()
        out = plan_profiled(prof, wl, args.slo_itl, args.slo_ttft, caps=[int(c) for c in args.caps.split(",")],
                            n=args.requests, seed=args.seed, scale=scale, rate_margin=args.rate_margin,
                            progress=lambda s: print("plan:", s, file=sys.stderr))
        out["plan_s"] = time.time() - t0
    if not out["plans"]:
        sys.exit("no plan holds the SLO on this machine: loosen --slo-itl / --slo-ttft")
    best = out["plans"][0]
    # what the plan predicts at 1.25x its rate (same settings)
    s = serve(wl, ProfiledCost(prof, best["executor"], scale=scale), 1.25 * best["rate"], best["batch_cap"],
              args.requests, args.seed)
    out["at_125"] = dict(p95_itl_s=s["itl_p95"], p95_ttft_s=s["ttft_p95"], throughput_tok_s=s["throughput"])
    out.update(profile=path, max_tokens=mnt, model=args.model, scale=scale, drift=dr, drift_clock=args.drift)
    return out


def measure(args, pl: dict) -> dict:
    best = pl["plans"][0]
    args.batch_cap, args.max_tokens = best["batch_cap"], pl["max_tokens"]
    srv, url = start_server(args, "reference" if best["executor"] == "reference" else "epoch", "native",
                            os.path.join(args.out, "trace_serve.jsonl"))
    runs = {}
    try:
        warm = lg.load_prompts(f"task:{args.task}", 2, args.seed)
        lg.run_load(url, [0.0, 0.1], warm, pl["max_tokens"], args.seed)
        for mult in sorted({1.0, 1.25, *[float(x) for x in args.mults.split(",") if x.strip()]}):
            rate = best["rate"] * mult
            arr = lg.poisson_arrivals(rate, args.duration, args.seed)
            prompts = lg.load_prompts(f"task:{args.task}", len(arr), args.seed)
            la0 = loadavg()
            r = lg.run_load(url, arr, prompts, pl["max_tokens"], args.seed, rate=rate, duration=args.duration)
            r.update(loadavg_before=la0, loadavg_after=loadavg(), mult=mult)
            runs[str(mult)] = r
            print(f"measured at {rate:.3f} req/s: P95 ITL {r['itl']['p95']}, TTFT {r['ttft']['p95']}, "
                  f"{r['throughput_tok_s']:.1f} tok/s", file=sys.stderr)
    finally:
        stop_server(srv)
    return runs


def call_ratios(path: str, profile_path: str, executor: str, scale: float = 1.0) -> list:
    """Measured denoising calls of a real server (its trace) against the profile's price of the same shapes: median
    measured / predicted by batch size, and over all calls (batch 0)."""
    import numpy as np
    from dblock.simulator.profile import CallShape, Profile, ProfiledCost
    from dblock.trace import read_trace
    if not os.path.isfile(path):
        return []
    cost = ProfiledCost(Profile.load(profile_path), executor, scale=scale)
    ratios: dict = {}
    for e in read_trace(path):
        if e.get("event") != "pass" or e.get("kind") != "denoise":
            continue
        L = max(sum(n for _, _, n in seg) for seg in e["segments"])
        B = e["batch"]
        shape = CallShape("denoise", B, L, max(e["cache_len"]) + L, max(len(seg) for seg in e["segments"]),
                          tuple([max(1, round(e["live"] / B))] * B), e["rows"], 0.75 if executor == "epoch" else 1.0)
        ratios.setdefault(B, []).append((e["wall_s"], cost.call(shape)))
    ratios[0] = [x for v in ratios.values() for x in v]
    out = []
    for B in sorted(ratios):
        m = np.array(ratios[B])
        out.append(dict(batch=B, calls=len(m), measured_ms=1e3 * float(np.median(m[:, 0])),
                        predicted_ms=1e3 * float(np.median(m[:, 1])), ratio=float(np.median(m[:, 0] / m[:, 1]))))
    return out


def probe(args, profile_path: str, executor: str, rate: float | None = None, cap: int | None = None,
          tag: str = "") -> dict:
    """The machine as the server sees it now: a real `dblock serve` with this executor and batch cap (default the
    largest of --caps) under `dblock loadgen` at `rate` (default --probe-rate) for --probe-duration s; the median of
    its denoising calls' wall time over the profile's price of the same shapes. Its arrivals use another seed than
    the validated runs', so they are held out from it."""
    rate = args.probe_rate if rate is None else rate
    args.batch_cap = max(int(c) for c in args.caps.split(",")) if cap is None else cap
    trace = os.path.join(args.out, f"probe_{executor}{'_' + tag if tag else ''}.jsonl")
    srv, url = start_server(args, executor, "native", trace)
    try:
        warm = lg.load_prompts(f"task:{args.task}", 2, args.seed)
        lg.run_load(url, [0.0, 0.1], warm, args.max_tokens, args.seed)
        arr = lg.poisson_arrivals(rate, args.probe_duration, args.seed + 1)
        lg.run_load(url, arr, lg.load_prompts(f"task:{args.task}", len(arr), args.seed + 1), args.max_tokens,
                    args.seed + 1)
    finally:
        stop_server(srv)
    rows = call_ratios(trace, profile_path, executor)
    return dict(factor=rows[0]["ratio"], calls=rows[0]["calls"], rate=rate, cap=args.batch_cap,
                duration=args.probe_duration, loadavg=loadavg())


def at_arrivals(args, pl: dict, run: dict) -> dict:
    """The plan's settings (executor, cap, scale) simulated at exactly the arrival times a measured run sent."""
    from dblock.simulator.plan_profiled import serve
    from dblock.simulator.profile import Profile, ProfiledCost
    best = pl["plans"][0]
    wl, _ = workload(native_trace(args))
    cost = ProfiledCost(Profile.load(pl["profile"]), best["executor"], scale=pl.get("scale", 1.0))
    s = serve(wl, cost, 1.0, best["batch_cap"], len(run["arrivals"]), args.seed, arr=run["arrivals"])
    return dict(p95_itl_s=s["itl_p95"], p95_ttft_s=s["ttft_p95"], throughput_tok_s=s["throughput"])


def report(args, pl: dict, runs: dict) -> str:
    best = pl["plans"][0]
    m1, m2 = runs["1.0"], runs["1.25"]
    a1, a2 = at_arrivals(args, pl, m1), at_arrivals(args, pl, m2)

    def err(p, m):
        return f"{100 * (p - m) / m:+.0f}%" if m else "-"
    b = best["band"]
    rows = [("P95 ITL (ms)", 1e3 * best["p95_itl_s"], [1e3 * x for x in b["itl_p95"]], 1e3 * a1["p95_itl_s"],
             1e3 * m1["itl"]["p95"], 1e3 * a2["p95_itl_s"], 1e3 * m2["itl"]["p95"]),
            ("P95 TTFT (s)", best["p95_ttft_s"], b["ttft_p95"], a1["p95_ttft_s"], m1["ttft"]["p95"],
             a2["p95_ttft_s"], m2["ttft"]["p95"]),
            ("throughput (tok/s)", best["throughput_tok_s"], b["throughput"], a1["throughput_tok_s"],
             m1["throughput_tok_s"], a2["throughput_tok_s"], m2["throughput_tok_s"])]
    rate = best["rate"]
    lines = [f"Plan: {args.model}, SLO P95 ITL <= {1e3 * args.slo_itl:g} ms and P95 TTFT <= {args.slo_ttft:g} s; "
             f"operator profile {os.path.basename(pl['profile'])}; planned: executor {best['executor']}, batch cap "
             f"{best['batch_cap']}, {rate:.3f} req/s"
             + (f" (the SLO edge {best['slo_edge_rate']:.3f} req/s / {1 + best['rate_margin']:g})"
                if best.get("rate_margin") else "")
             + f" ({pl['plan_s']:.0f} s to plan); measured with `dblock serve` + "
             f"`dblock loadgen`, {args.duration:g} s of arrivals per rate, {m1['ok']} and {m2['ok']} requests",
             "",
             f"| quantity | plan ({pl['requests']} simulated requests; profile band) | predicted at the run's "
             f"arrivals, {rate:.2f} req/s | measured | error | predicted at 1.25x ({1.25 * rate:.2f} req/s) | measured | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, p, band, q1, m, q2, mm2 in rows:
        lines.append(f"| {name} | {p:.3g} ({band[0]:.3g}..{band[1]:.3g}) | {q1:.3g} | {m:.3g} | {err(q1, m)} | "
                     f"{q2:.3g} | {mm2:.3g} | {err(q2, mm2)} |")

    def holds(m):
        return m["itl"]["p95"] <= args.slo_itl and m["ttft"]["p95"] <= args.slo_ttft
    h1, h2 = holds(m1), holds(m2)
    more = sorted((float(k), v) for k, v in runs.items() if float(k) > 1.25)
    if more:
        lines.append("")
        lines.append("Further multiples of the planned rate (measured; predicted at the run's arrivals in brackets): "
                     + "; ".join(f"{k:g}x = {k * rate:.2f} req/s: P95 ITL {1e3 * v['itl']['p95']:.0f} ms "
                                 f"[{1e3 * at_arrivals(args, pl, v)['p95_itl_s']:.0f}], P95 TTFT "
                                 f"{v['ttft']['p95']:.2f} s, {v['throughput_tok_s']:.0f} tok/s, SLO "
                                 f"{'holds' if holds(v) else 'fails'}" for k, v in more) + ".")
    lines.append("")
    lines.append(f"SLO at the planned rate: {'holds' if h1 else 'FAILS'}; at 1.25x: {'holds' if h2 else 'fails'}.")
    if h2:
        fail = next((k for k, v in more if not holds(v)), None)
        held = max([1.25] + [k for k, v in more if holds(v)])
        lines.append(f"The plan was conservative: at 1.25x the measured P95 ITL is "
                     f"{100 * (1 - m2['itl']['p95'] / args.slo_itl):.0f}% and P95 TTFT "
                     f"{100 * (1 - m2['ttft']['p95'] / args.slo_ttft):.0f}% below the objectives; the SLO held up to "
                     f"{held:g}x the planned rate" + (f" and failed at {fail:g}x." if fail else
                                                    " (the highest multiple measured)."))
    elif not h1:
        worst = max(m1["itl"]["p95"] / args.slo_itl, m1["ttft"]["p95"] / args.slo_ttft)
        lines.append(f"The plan was optimistic: at the planned rate the measured P95s reach {worst:.2f}x the "
                     "objective.")
    lines.append(f"Machine: {lg.machine()} (load average {m1.get('loadavg_before')} "
                 f"before the planned-rate run). Profile scaled by x{pl.get('scale', 1.0):.3f} before planning "
                 + (f"(probe: a real server's denoising calls at {args.probe_rate:g} req/s for "
                    f"{args.probe_duration:g} s over the profile's price of the same shapes, median)."
                    + _rounds_text(pl) if pl.get("drift_clock") == "probe" else
                    f"({pl.get('drift_clock', 'none')}-clock drift of its anchors re-timed just before planning)."))
    pc = call_ratios(os.path.join(args.out, "trace_serve.jsonl"), pl["profile"], best["executor"],
                     pl.get("scale", 1.0))
    if pc:
        sel = [r for r in pc if r["calls"] >= 5 and r["batch"] in (0, 1, 4, 8, 12, 16)]
        lines.append("Denoising calls of the real server at the two validated rates (its trace) against the plan's "
                     "price of the same shapes (median by batch; 0 = all): "
                     + "; ".join(f"batch {r['batch']}: {r['measured_ms']:.0f} ms measured, "
                                 f"{r['predicted_ms']:.0f} predicted (x{r['ratio']:.2f})" for r in sel) + ".")
    return "\n".join(lines)


def _rounds_text(pl: dict) -> str:
    rounds = pl.get("probe_rounds") or []
    if len(rounds) < 2:
        return ""
    return (" Probe rounds (each probe at the previous plan's rate and cap, then a re-plan): " + "; ".join(
        f"round {r['round']}: factors " + ", ".join(f"{ex} x{f:.2f}" for ex, f in r["factors"].items())
        + (f" -> {r['executor']}, cap {r['batch_cap']}, {r['rate']:.2f} req/s" if r["rate"] else " -> no plan")
        for r in rounds) + ".")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="code-masked")
    ap.add_argument("--task", default="code")
    ap.add_argument("--n", type=int, default=64, help="problems of the Native trace made when none is given")
    ap.add_argument("--native-trace", default=None)
    ap.add_argument("--profile", default=None, help="operator profile (default: the model's on this machine)")
    ap.add_argument("--slo-itl", type=float, default=0.25)
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--caps", default="8,16")
    ap.add_argument("--requests", type=int, default=96, help="requests per simulated run")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drift", default="probe", choices=["probe", "wall", "cpu", "none"],
                    help="scale the profile before planning: probe = a real server's calls at --probe-rate against "
                         "the profile's price (default); wall/cpu = its anchors re-timed now on that clock; none")
    ap.add_argument("--mults", default="1,1.25",
                    help="multiples of the planned rate to measure (1 and 1.25 always; more find where it fails)")
    ap.add_argument("--reuse-plan", action="store_true", help="measure again with OUT/plan.json's plan")
    ap.add_argument("--probe-rate", type=float, default=1.0)
    ap.add_argument("--probe-duration", type=float, default=20.0)
    ap.add_argument("--probe-rounds", type=int, default=3,
                    help="probe -> plan rounds: after the first probe at --probe-rate, probe the planned executor at "
                         "the planned rate and cap and re-plan, until the rate moves by at most --probe-tol (1: the "
                         "single probe at --probe-rate)")
    ap.add_argument("--rate-margin", type=float, default=0.0,
                    help="plan at the SLO edge's rate / (1 + this) (`simulate plan --rate-margin`; default 0)")
    ap.add_argument("--probe-tol", type=float, default=0.1, help="relative change of the planned rate that ends the "
                                                                  "probe rounds (default 0.1)")
    ap.add_argument("--out", default="runs/plan_cpu")
    ap.add_argument("--analyse-only", action="store_true", help="reuse OUT/plan.json and OUT/loadgen.json")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    pj, lj = os.path.join(args.out, "plan.json"), os.path.join(args.out, "loadgen.json")
    if args.analyse_only:
        pl, runs = json.load(open(pj)), json.load(open(lj))
    else:
        if args.reuse_plan:
            pl = json.load(open(pj))
        else:
            pl = plan(args)
            json.dump(pl, open(pj, "w"), indent=1)
        runs = measure(args, pl)
        json.dump(runs, open(lj, "w"), indent=1)
    text = report(args, pl, runs)
    open(os.path.join(args.out, "report.md"), "w").write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
