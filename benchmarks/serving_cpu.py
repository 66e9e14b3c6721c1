"""Online serving on CPU, side by side: reference-dense vs epoch engines, Native vs OBA, over a range of Poisson
rates — and the SimPy serving model calibrated on one rate and checked on the others.

For every configuration (executor × schedule) the script starts `dblock serve` as a subprocess (its own process, one
torch thread, a JSON-lines engine trace) and sends two warm-up requests. Then, rate by rate, every configuration gets
the same open-loop Poisson arrivals and prompts from `dblock loadgen`'s library (each run waits until its last
response is in), one configuration at a time, in an order rotated per rate. At the end every server is stopped with
SIGTERM (drain).

Then the simulator check: per executor, `dblock.simulator.calibrate` fits the CPU cost model (scale and per-sub-block
overhead, on a measured `cpu` hardware profile) and the Native block profile on the engine trace of the calibration
rate only (plus OBA's trace at that rate for δ); `simulate_serving` then replays the *same arrival times* the load
generator used at every other rate and predicts P95 ITL and throughput, compared with what loadgen measured.

    .venv/bin/python benchmarks/serving_cpu.py               # tiny-masked, rates 1..16, 10 s each, 3 repeats
    .venv/bin/python benchmarks/serving_cpu.py --rates 2,4 --duration 2 --repeats 1 --calibrate-rate 2 \\
        --configs ref-native,epoch-oba --out /tmp/smoke                                                     # smoke
    .venv/bin/python benchmarks/serving_cpu.py --analyse-only       # redo the tables from runs/serving_cpu

Writes OUT/loadgen.json, OUT/itl_vs_rate.png, OUT/trace_<config>.jsonl (+ per-rate splits), OUT/simcheck.json and
OUT/report.md (the tables pasted into BENCHMARKS.md and SIMULATOR.md). Never used by tests.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dblock.serving import loadgen as lg  # noqa: E402
from dblock.tasks import BUNDLED_TASK  # noqa: E402

CONFIGS = {"ref-native": ("reference", "native"), "ref-oba": ("reference", "oba"),
           "epoch-native": ("epoch", "native"), "epoch-oba": ("epoch", "oba")}
WARMUP = 2


def loadavg() -> list:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def start_server(args, executor: str, schedule: str, trace: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dblock", "--threads", "1", "serve", "--model", args.model, "--executor", executor,
           "--schedule", schedule, "--port", "0", "--max-batch", str(args.batch_cap), "--max-tokens-limit",
           str(max(1024, args.max_tokens)), "--trace", trace, "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "DBLOCK_API_KEY"}
    log = open(trace.replace(".jsonl", ".log"), "w+")       # a file, not a pipe: a full pipe would stall the server
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    p.log = log
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        log.seek(0)
        text = log.read()
        if "http://" in text:
            return p, text.split("http://")[1].split()[0].join(["http://", ""])
        if p.poll() is not None:
            break
        time.sleep(0.2)
    p.kill()
    raise RuntimeError(f"server did not start: {text}")


def stop_server(p: subprocess.Popen) -> str:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    p.log.seek(0)
    return p.log.read()


def checkpoint_digest(model: str) -> str:
    import hashlib
    from dblock.weights_path import resolve_model_path
    h = hashlib.sha256()
    folder = resolve_model_path(model)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def run_all(args) -> dict:
    """All servers up at once (idle ones cost nothing: the engine thread sleeps on a condition). For each repetition
    and rate, the configurations run one after the other, in an order rotated per (repetition, rate), on the same
    arrivals and prompts, so that drifts in the machine's background load hit every configuration alike."""
    import httpx
    os.makedirs(args.out, exist_ok=True)
    digest = checkpoint_digest(args.model)
    rates = [float(x) for x in args.rates.split(",")]
    names = args.configs.split(",")
    procs, urls = {}, {}
    runs: dict = {n: [] for n in names}          # execution order per server (= its request-id order)
    try:
        for name in names:
            executor, schedule = CONFIGS[name]
            procs[name], urls[name] = start_server(args, executor, schedule,
                                                   os.path.join(args.out, f"trace_{name}.jsonl"))
            print(f"[{name}] serving at {urls[name]}", flush=True)
            for i in range(WARMUP):                       # first-call costs (allocations, lazy imports)
                httpx.post(urls[name] + "/v1/completions", json={"prompt": "12+34=", "max_tokens": args.max_tokens},
                           timeout=120).raise_for_status()
        for rep in range(args.repeats):
            for k, rate in enumerate(rates):
                seed = args.seed + 1000 * k + 100_000 * rep
                arrivals = lg.poisson_arrivals(rate, args.duration, seed)          # same arrivals for every config
                prompts = lg.load_prompts(f"task:{BUNDLED_TASK}", len(arrivals), seed)  # and the same prompts
                for j in range(len(names)):
                    name = names[(j + k + rep) % len(names)]
                    la0 = loadavg()
                    res = lg.run_load(urls[name], arrivals, prompts, args.max_tokens, seed, rate=rate,
                                      duration=args.duration, timeout=600)
                    res.update(loadavg=[la0, loadavg()], order=j, rep=rep)
                    runs[name].append(res)
                    print(f"[{name}] rep {rep} rate {rate:g}: ok {res['ok']}/{res['sent']} tok/s "
                          f"{res['throughput_tok_s']:.0f} P95 ITL {1e3 * (res['itl']['p95'] or 0):.1f} ms  P95 TTFT "
                          f"{res['ttft']['p95'] or 0:.2f} s load {res['loadavg'][0][0]}", flush=True)
    finally:
        tails = {name: stop_server(p) for name, p in procs.items()}
    servers = [dict(label=n, url=urls[n], executor=CONFIGS[n][0], schedule=CONFIGS[n][1], runs_all=runs[n],
                    runs=aggregate(runs[n], rates), server_log_tail=tails[n][-2000:]) for n in names]
    if checkpoint_digest(args.model) != digest:
        print("WARNING: the checkpoint changed during the run", flush=True)
    data = dict(machine=lg.machine(), model=args.model, checkpoint_sha256_16=digest, rates=rates,
                duration=args.duration, repeats=args.repeats, max_tokens=args.max_tokens, batch_cap=args.batch_cap,
                seed=args.seed, servers=servers, command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                time=time.time())
    with open(os.path.join(args.out, "loadgen.json"), "w") as f:
        json.dump(data, f, indent=1)
    return data


def aggregate(runs: list[dict], rates: list[float]) -> list[dict]:
    """Per rate: the median over repetitions of every statistic (and the P95 ITL range), loadgen's summary shape."""
    import numpy as np
    out = []
    for rate in rates:
        rs = [r for r in runs if r["rate"] == rate]
        med = lambda xs: float(np.median([x for x in xs if x is not None])) if any(  # noqa: E731
            x is not None for x in xs) else None
        out.append(dict(
            rate=rate, reps=len(rs), sent=sum(r["sent"] for r in rs), ok=sum(r["ok"] for r in rs),
            rejected=sum(r["rejected"] for r in rs), errors=sum(r["errors"] for r in rs),
            throughput_tok_s=med([r["throughput_tok_s"] for r in rs]),
            ttft={q: med([r["ttft"][q] for r in rs]) for q in ("p50", "p95", "p99")},
            itl={q: med([r["itl"][q] for r in rs]) for q in ("p50", "p95", "p99")},
            itl_p95_range=[min(r["itl"]["p95"] for r in rs), max(r["itl"]["p95"] for r in rs)],
            loadavg=med([r["loadavg"][0][0] for r in rs if r.get("loadavg") and r["loadavg"][0]])))
    return out


# ---------------------------------------------------------------------------------------------------------------
# splitting a sweep's trace into one trace per rate (request ids are assigned in submit order)
# ---------------------------------------------------------------------------------------------------------------

def split_trace(path: str, counts: list[int], out_prefix: str) -> list[str]:
    from dblock.trace import read_trace
    evs = list(read_trace(path))
    header = next(e for e in evs if e["event"] == "run")
    bounds, lo = [], WARMUP
    for n in counts:
        bounds.append((lo, lo + n))
        lo += n
    paths = []
    for k, (a, b) in enumerate(bounds):
        def mine(e):
            if e["event"] in ("block", "request"):
                return a <= e["request"] < b
            if e["event"] == "pass":
                return all(a <= r < b for r in e["requests"])
            if e["event"] == "iteration":
                return False
            return False
        p = f"{out_prefix}_r{k}.jsonl"
        with open(p, "w") as f:
            f.write(json.dumps(header) + "\n")
            for e in evs:
                if mine(e):
                    f.write(json.dumps(e) + "\n")
        paths.append(p)
        # the same events with every denoising pass timed as its whole engine iteration (append call + denoise
        # call + the schedule's host work): the unit the SimPy serving model advances by
        p_it = f"{out_prefix}_r{k}_iter.jsonl"
        with open(p_it, "w") as f:
            f.write(json.dumps(header) + "\n")
            pending = None
            for e in evs:
                if e["event"] == "pass" and e["kind"] == "denoise" and mine(e):
                    pending = dict(e)
                elif e["event"] == "iteration" and pending is not None:
                    pending["wall_s"] = e["t_end"] - e["t_start"]
                    f.write(json.dumps(pending) + "\n")
                    pending = None
                elif e["event"] in ("block", "request") and mine(e):
                    f.write(json.dumps(e) + "\n")
    return paths


def server_side(path: str) -> dict:
    """P95 ITL (block_time / tokens per commit) and throughput measured by the engine itself."""
    import numpy as np
    from dblock.trace import read_trace
    evs = list(read_trace(path))
    blocks = [e for e in evs if e["event"] == "block" and e.get("tokens")]
    reqs = [e for e in evs if e["event"] == "request"]
    itl = [b["block_time_s"] / b["tokens"] for b in blocks]
    if not reqs:
        return {}
    t0 = min(r["first_pass_s"] for r in reqs)
    t1 = max(r["finish_s"] for r in reqs)
    Y = sum(r["Y"] for r in reqs)
    passes = [e for e in evs if e["event"] == "pass" and e["kind"] == "denoise"]
    return dict(itl_p50=float(np.percentile(itl, 50)), itl_p95=float(np.percentile(itl, 95)),
                throughput=Y / max(1e-9, t1 - t0), mean_batch=float(np.mean([p["batch"] for p in passes])),
                mean_pass_ms=1e3 * float(np.mean([p["wall_s"] for p in passes])),
                Y_mean=Y / len(reqs), F_mean=sum(r["F"] for r in reqs) / len(reqs))


# ---------------------------------------------------------------------------------------------------------------
# the simulator check
# ---------------------------------------------------------------------------------------------------------------

def simcheck(args, data: dict) -> dict:
    from dataclasses import replace

    import numpy as np

    from dblock.simulator import calibrate, cost, hardware
    from dblock.simulator.serving import ServeConfig, simulate_serving

    rates = data["rates"]
    kcal = rates.index(args.calibrate_rate)
    hw_path = os.path.join(args.out, "cpu_profile.json")
    if not os.path.exists(hw_path):
        hardware.calibrate_cpu(path=hw_path)
    hw = hardware.get(hw_path)
    from dblock.weights_path import resolve_model_path
    cfg = cost.get_model(resolve_model_path(data["model"]))
    by = {s["label"]: s for s in data["servers"]}
    splits = {}
    for name, srv in by.items():
        counts = [r["ok"] for r in srv["runs_all"]]
        assert all(r["rejected"] == 0 and r["errors"] == 0 for r in srv["runs_all"]), name
        splits[name] = split_trace(os.path.join(args.out, f"trace_{name}.jsonl"), counts,
                                   os.path.join(args.out, f"trace_{name}"))
    # calibrate on the engine traces at the calibration rate (its repetitions pooled into one trace), predict the
    # runs at every rate (all repetitions) from that calibration alone
    ical = {}
    for name, srv in by.items():
        idx = [i for i, r in enumerate(srv["runs_all"]) if r["rate"] == rates[kcal]]
        pooled = os.path.join(args.out, f"trace_{name}_calibration_iter.jsonl")
        with open(pooled, "w") as f:
            for j, i in enumerate(idx):
                with open(splits[name][i].replace(".jsonl", "_iter.jsonl")) as g:
                    lines = g.readlines()
                f.writelines(lines if j == 0 else lines[1:])          # one run header
        ical[name] = (set(idx), pooled)
    out = dict(calibrate_rate=rates[kcal], hardware=hw.name, rows=[], fits={}, per_rate=[])
    for ex in ("ref", "epoch"):
        nat, oba = f"{ex}-native", f"{ex}-oba"
        if nat not in splits:
            continue
        cal_runs = [calibrate.Run.load(ical[nat][1])]
        if oba in splits:
            cal_runs.append(calibrate.Run.load(ical[oba][1]))
        cal = calibrate.calibrate(cal_runs, hw=hw, cfg=cfg, delta_from="oba" if oba in splits else None)
        fit = cal.cost_fit
        # δ and the Native profile as calibrate() fitted them (the profile's C is the traces' block size); when δ
        # cannot be fitted (e.g. α < 0: warm-up hurts), OBA is reported and not simulated
        profile, delta = cal.profile, cal.delta
        if cal.delta_note:
            print(f"[sim] {ex}: OBA not predicted: {cal.delta_note}", flush=True)
        out["fits"][ex] = dict(scale=fit.cal.scale, overhead_s=fit.cal.overhead_s,
                               median_abs_rel_err=fit.median_abs_rel_err, r2=fit.r2, nbar=cal.nbar, delta=delta,
                               delta_note=cal.delta_note, profile_C=profile.C, alphas=cal.alphas)
        print(f"[sim] {ex}: scale {fit.cal.scale:.3g}, overhead {1e6 * fit.cal.overhead_s:.1f} us/sub-block "
              f"(median |err| {100 * fit.median_abs_rel_err:.1f}%), n̄ {cal.nbar:.2f}, δ {delta} (profile C={profile.C})",
              flush=True)
        # the workload (prompt and response lengths) as seen at the calibration rate
        calreq = cal_runs[0].requests
        C = cfg.block_size
        prompt = "empirical:" + ",".join(str(r["prompt_len"]) for r in calreq)
        tokens = "empirical:" + ",".join(str(max(1, r["Y"])) for r in calreq)
        # diagnostic variant: on llada2's grid the first block also holds the prompt's tail (P mod C rows), so a
        # response's blocks end where (P mod C + Y) says; the serving model starts blocks at the response start.
        # Feeding it P mod C + Y aligns its blocks (and its short last blocks) with the engine's; its throughput is
        # then rescaled by sum(Y) / sum(P mod C + Y).
        aligned = "empirical:" + ",".join(str(max(1, r["Y"] + r["prompt_len"] % C)) for r in calreq)
        align_factor = sum(r["Y"] for r in calreq) / sum(r["Y"] + r["prompt_len"] % C for r in calreq)
        for sched, name in (("native", nat), ("oba", oba)):
            if name not in by:
                continue
            if sched == "oba" and delta is None:
                continue
            # fit_cost fits  wall = scale * roofline + overhead * 2L,  while pass_cost returns
            # scale * (roofline + overhead * 2L): hand it overhead / scale so that it reproduces the fit
            base = ServeConfig(cfg, hw, cost.Parallel(1, 1, 1),
                               cost.Calibration(fit.cal.overhead_s / fit.cal.scale, 0.0, fit.cal.scale),
                               path="dense" if ex == "ref" else "epoch", schedule=sched, profile=profile,
                               delta=delta if sched == "oba" else 0.5, prompt=prompt, tokens=tokens,
                               batch_cap=data["batch_cap"], warmup_frac=0.0, seed=args.seed,
                               max_context=4096)
            for k, run in enumerate(by[name]["runs_all"]):
                res = simulate_serving(replace(base, arrivals=run["arrivals"]))
                res_al = simulate_serving(replace(base, arrivals=run["arrivals"], tokens=aligned))
                meas = server_side(splits[name][k].replace(".jsonl", "_iter.jsonl"))
                row = dict(config=name, rate=run["rate"], rep=run["rep"], calibration=k in ical[name][0],
                           p95_meas=run["itl"]["p95"], p95_server=meas.get("itl_p95"), p95_pred=res.itl["p95"],
                           tput_meas=run["throughput_tok_s"], tput_server=meas.get("throughput"),
                           tput_pred=res.throughput, mean_batch=meas.get("mean_batch"),
                           pred_mean_pass_ms=1e3 * res.mean_pass_s, meas_mean_pass_ms=meas.get("mean_pass_ms"),
                           peak_batch_pred=res.peak_batch, p95_pred_aligned=res_al.itl["p95"],
                           tput_pred_aligned=res_al.throughput * align_factor)
                row["p95_err"] = row["p95_pred"] / row["p95_meas"] - 1 if row["p95_meas"] else None
                row["p95_err_server"] = row["p95_pred"] / row["p95_server"] - 1 if row["p95_server"] else None
                row["tput_err"] = row["tput_pred"] / row["tput_meas"] - 1 if row["tput_meas"] else None
                row["p95_err_aligned"] = row["p95_pred_aligned"] / row["p95_meas"] - 1
                row["tput_err_aligned"] = row["tput_pred_aligned"] / row["tput_meas"] - 1
                out["rows"].append(row)
                cal_tag = " (cal)" if row["calibration"] else ""
                print(f"[sim] {name} rep {run['rep']} @ {run['rate']:g}{cal_tag}: P95 ITL pred "
                      f"{1e3 * row['p95_pred']:.1f} vs meas {1e3 * row['p95_meas']:.1f} ms "
                      f"({100 * row['p95_err']:+.0f}%)"
                      f", tok/s pred {row['tput_pred']:.0f} vs {row['tput_meas']:.0f} ({100 * row['tput_err']:+.0f}%)",
                      flush=True)
            for rate in rates:                          # medians over repetitions, measured and predicted
                rr = [r for r in out["rows"] if r["config"] == name and r["rate"] == rate]
                med = lambda key: float(np.median([r[key] for r in rr]))   # noqa: E731
                agg = dict(config=name, rate=rate, reps=len(rr), calibration=rate == rates[kcal],
                           **{key: med(key) for key in ("p95_meas", "p95_pred", "tput_meas", "tput_pred",
                                                        "p95_pred_aligned", "tput_pred_aligned", "mean_batch",
                                                        "meas_mean_pass_ms", "pred_mean_pass_ms")})
                agg["p95_err"] = agg["p95_pred"] / agg["p95_meas"] - 1
                agg["tput_err"] = agg["tput_pred"] / agg["tput_meas"] - 1
                agg["p95_err_aligned"] = agg["p95_pred_aligned"] / agg["p95_meas"] - 1
                agg["tput_err_aligned"] = agg["tput_pred_aligned"] / agg["tput_meas"] - 1
                out["per_rate"].append(agg)
        held = [r for r in out["per_rate"] if not r["calibration"] and r["config"].startswith(ex)]
        if held:
            out["fits"][ex]["mean_abs_p95_err"] = float(np.mean([abs(r["p95_err"]) for r in held]))
            out["fits"][ex]["mean_abs_tput_err"] = float(np.mean([abs(r["tput_err"]) for r in held]))
            out["fits"][ex]["mean_abs_p95_err_aligned"] = float(np.mean([abs(r["p95_err_aligned"]) for r in held]))
            out["fits"][ex]["mean_abs_tput_err_aligned"] = float(np.mean([abs(r["tput_err_aligned"])
                                                                          for r in held]))
    with open(os.path.join(args.out, "simcheck.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    return out


def report(data: dict, sim: dict | None) -> str:
    reps = data.get("repeats", 1)
    L = [f"Machine: {data['machine']}; model {data['model']} (weights sha256 {data.get('checkpoint_sha256_16')}…); "
         f"batch cap {data['batch_cap']}; max_tokens {data['max_tokens']}; {data['duration']:g} s of Poisson arrivals "
         f"per run, {reps} repetition(s) per (configuration, rate), medians shown; prompts task:{BUNDLED_TASK} (test split).",
         "", "| config | rate (req/s) | ok/sent | tok/s | TTFT P50 (s) | TTFT P95 (s) | ITL P50 (ms) | ITL P95 (ms) "
         "[range] | ITL P99 (ms) | load avg |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in data["servers"]:
        for r in s["runs"]:
            lo, hi = r.get("itl_p95_range", [r["itl"]["p95"]] * 2)
            L.append(f"| {s['label']} | {r['rate']:g} | {r['ok']}/{r['sent']} | {r['throughput_tok_s']:.0f} | "
                     f"{r['ttft']['p50']:.2f} | {r['ttft']['p95']:.2f} | {1e3 * r['itl']['p50']:.1f} | "
                     f"{1e3 * r['itl']['p95']:.1f} [{1e3 * lo:.0f}–{1e3 * hi:.0f}] | {1e3 * r['itl']['p99']:.1f} | "
                     f"{r.get('loadavg') or float('nan'):.1f} |")
    if sim:
        L += ["", f"Simulator calibrated on the engine traces at {sim['calibrate_rate']:g} req/s (repetitions "
              f"pooled), {sim['hardware']}; "
              "medians over repetitions of measured and predicted values:", "",
              "| config | rate | P95 ITL meas (ms) | P95 ITL pred (ms) | error | tok/s meas | tok/s pred | error | "
              "block-aligned: P95 err, tok/s err | mean batch meas | iteration ms meas / pred |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sim["per_rate"]:
            tag = " (cal.)" if r["calibration"] else ""
            L.append(f"| {r['config']} | {r['rate']:g}{tag} | {1e3 * r['p95_meas']:.1f} | {1e3 * r['p95_pred']:.1f} | "
                     f"{100 * r['p95_err']:+.0f}% | {r['tput_meas']:.0f} | {r['tput_pred']:.0f} | "
                     f"{100 * r['tput_err']:+.0f}% | {100 * r['p95_err_aligned']:+.0f}%, "
                     f"{100 * r['tput_err_aligned']:+.0f}% | {r['mean_batch']:.1f} | {r['meas_mean_pass_ms']:.1f} / "
                     f"{r['pred_mean_pass_ms']:.1f} |")
        for ex, f in sim["fits"].items():
            L.append(f"\n{ex}: scale {f['scale']:.3g}, overhead {1e6 * f['overhead_s']:.1f} us/sub-block, "
                     f"iteration-time "
                     f"fit median |err| {100 * f['median_abs_rel_err']:.1f}%, n̄ {f['nbar']:.2f}, "
                     f"δ {f['delta'] or float('nan'):.3f}; held-out rates, mean |error| of the medians: P95 ITL "
                     f"{100 * f.get('mean_abs_p95_err', float('nan')):.0f}%, throughput "
                     f"{100 * f.get('mean_abs_tput_err', float('nan')):.0f}% (block-aligned variant: "
                     f"{100 * f.get('mean_abs_p95_err_aligned', float('nan')):.0f}%, "
                     f"{100 * f.get('mean_abs_tput_err_aligned', float('nan')):.0f}%)")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-masked")
    ap.add_argument("--configs", default="ref-native,ref-oba,epoch-native,epoch-oba")
    ap.add_argument("--rates", default="1,2,4,6,8,10,12,16")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-cap", type=int, default=32)
    ap.add_argument("--calibrate-rate", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/serving_cpu")
    ap.add_argument("--analyse-only", action="store_true", help="reuse OUT/loadgen.json and the traces")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator check")
    args = ap.parse_args(argv)
    if args.analyse_only:
        with open(os.path.join(args.out, "loadgen.json")) as f:
            data = json.load(f)
    else:
        data = run_all(args)
    lg.plot(data["servers"], os.path.join(args.out, "itl_vs_rate.png"))
    sim = None if args.no_sim or args.calibrate_rate not in data["rates"] else simcheck(args, data)
    text = report(data, sim)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"\n{platform.node()}: wrote {args.out}/loadgen.json, itl_vs_rate.png, report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
