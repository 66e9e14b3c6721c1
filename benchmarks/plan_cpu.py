"""End-to-end check of the capacity planner on this machine: plan, then serve at the plan and at 1.25x it.

1. Plan (`dblock.simulator.plan_profiled`, what `dblock simulate plan --operator-profile` runs): this CPU's operator
   profile of the model as the hardware, one replica; the batch cap and executor (reference = dense, epoch) that hold
   P95 ITL <= --slo-itl and P95 TTFT <= --slo-ttft at the highest Poisson rate. The workload is the model's own Native
   decode of its task (`dblock compare-schedules --schedules native --trace-dir`, made here when --native-trace is
   not given): every request's prompt length and block chain replayed.
2. Serve: a real `dblock serve` (one torch thread, the planned executor and `--max-batch` = the planned cap) and
   `dblock loadgen`'s open-loop Poisson arrivals for --duration seconds at the planned rate and at 1.25x it, prompts
   from the task's test split, --max-tokens as in the trace.
3. Print planned beside measured (P95 ITL, P95 TTFT, throughput) with the error, and whether the SLO holds at the
   planned rate and fails at 1.25x; when it also holds at 1.25x the plan was conservative, and the script says by
   how much (the measured P95s' margin to the SLO at 1.25x).

    .venv/bin/python benchmarks/plan_cpu.py --out runs/plan_cpu            # code-masked, about 6 minutes
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
    from dblock.simulator.cli_profile import _profile_path
    from dblock.simulator.plan_profiled import plan_profiled, serve
    from dblock.simulator.profile import Profile, ProfiledCost
    path = args.profile or _profile_path(args.model)
    if not os.path.isfile(path):
        sys.exit(f"no operator profile at {path}: `dblock simulate profile --model {args.model}` first")
    prof = Profile.load(path)
    wl, mnt = workload(native_trace(args))
    t0 = time.time()
    out = plan_profiled(prof, wl, args.slo_itl, args.slo_ttft, caps=[int(c) for c in args.caps.split(",")],
                        n=args.requests, seed=args.seed, progress=lambda s: print("plan:", s, file=sys.stderr))
    out["plan_s"] = time.time() - t0
    if not out["plans"]:
        sys.exit("no plan holds the SLO on this machine: loosen --slo-itl / --slo-ttft")
    best = out["plans"][0]
    # what the plan predicts at 1.25x its rate (same settings)
    s = serve(wl, ProfiledCost(prof, best["executor"]), 1.25 * best["rate"], best["batch_cap"], args.requests,
              args.seed)
    out["at_125"] = dict(p95_itl_s=s["itl_p95"], p95_ttft_s=s["ttft_p95"], throughput_tok_s=s["throughput"])
    out.update(profile=path, max_tokens=mnt, model=args.model)
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
        for mult in (1.0, 1.25):
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


def report(args, pl: dict, runs: dict) -> str:
    best = pl["plans"][0]
    m1, m2 = runs["1.0"], runs["1.25"]

    def err(p, m):
        return f"{100 * (p - m) / m:+.0f}%" if m else "-"
    b = best["band"]
    rows = [("P95 ITL (ms)", 1e3 * best["p95_itl_s"], [1e3 * x for x in b["itl_p95"]], 1e3 * m1["itl"]["p95"],
             1e3 * pl["at_125"]["p95_itl_s"], 1e3 * m2["itl"]["p95"]),
            ("P95 TTFT (s)", best["p95_ttft_s"], b["ttft_p95"], m1["ttft"]["p95"], pl["at_125"]["p95_ttft_s"],
             m2["ttft"]["p95"]),
            ("throughput (tok/s)", best["throughput_tok_s"], b["throughput"], m1["throughput_tok_s"],
             pl["at_125"]["throughput_tok_s"], m2["throughput_tok_s"])]
    rate = best["rate"]
    lines = [f"Plan: {args.model}, SLO P95 ITL <= {1e3 * args.slo_itl:g} ms and P95 TTFT <= {args.slo_ttft:g} s; "
             f"operator profile {os.path.basename(pl['profile'])}; planned: executor {best['executor']}, batch cap "
             f"{best['batch_cap']}, {rate:.3f} req/s ({pl['plan_s']:.0f} s to plan); measured with `dblock serve` + "
             f"`dblock loadgen`, {args.duration:g} s of arrivals per rate, {m1['ok']} and {m2['ok']} requests",
             "",
             f"| quantity | planned at {rate:.2f} req/s (profile band) | measured at {rate:.2f} | error | "
             f"predicted at {1.25 * rate:.2f} (1.25x) | measured at {1.25 * rate:.2f} | error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, p, band, m, p2, mm2 in rows:
        lines.append(f"| {name} | {p:.3g} ({band[0]:.3g}..{band[1]:.3g}) | {m:.3g} | {err(p, m)} | {p2:.3g} | "
                     f"{mm2:.3g} | {err(p2, mm2)} |")

    def holds(m):
        return m["itl"]["p95"] <= args.slo_itl and m["ttft"]["p95"] <= args.slo_ttft
    h1, h2 = holds(m1), holds(m2)
    lines.append("")
    lines.append(f"SLO at the planned rate: {'holds' if h1 else 'FAILS'}; at 1.25x: {'holds' if h2 else 'fails'}.")
    if h2:
        lines.append(f"The plan was conservative: at 1.25x the measured P95 ITL is "
                     f"{100 * (1 - m2['itl']['p95'] / args.slo_itl):.0f}% and P95 TTFT "
                     f"{100 * (1 - m2['ttft']['p95'] / args.slo_ttft):.0f}% below the objectives.")
    elif not h1:
        worst = max(m1["itl"]["p95"] / args.slo_itl, m1["ttft"]["p95"] / args.slo_ttft)
        lines.append(f"The plan was optimistic: at the planned rate the measured P95s reach {worst:.2f}x the "
                     "objective.")
    lines.append(f"Machine: {lg.machine()}, shared with a training run (load average {m1.get('loadavg_before')} "
                 f"before the planned-rate run).")
    return "\n".join(lines)


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
    ap.add_argument("--out", default="runs/plan_cpu")
    ap.add_argument("--analyse-only", action="store_true", help="reuse OUT/plan.json and OUT/loadgen.json")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    pj, lj = os.path.join(args.out, "plan.json"), os.path.join(args.out, "loadgen.json")
    if args.analyse_only:
        pl, runs = json.load(open(pj)), json.load(open(lj))
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
