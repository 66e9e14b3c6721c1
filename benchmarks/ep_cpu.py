"""Expert/sequence-parallel FreshLane vs dense dispatch on gloo CPU ranks, side by side in one run.

For each world size (default 2 and 4) and model, the same ranks decode the same prompts with FreshLane (only fresh
rows move) and with dense dispatch (every row of the call moves), alternating the order across repeats. Reported:
  * bytes per pass (dispatch + combine, all ranks; also with the count exchange and the restoring gather) and the
    dense/FreshLane ratio, from the counts both protocols produce on every pass of the FreshLane run;
  * wall time of the denoising passes, of the MoE region and of the collectives (rank 0), medians of repeats, and
    the dense/FreshLane ratios;
  * destination ranks per dispatched row, against the uniform-routing estimate the simulator's cost model uses
    (ranks_per_token = W·(1 − (1 − 1/W)^K));
  * whether the two modes decoded the same tokens.

    .venv/bin/python benchmarks/ep_cpu.py                        # worlds 2 and 4, both models, 3 repeats
    .venv/bin/python benchmarks/ep_cpu.py --worlds 2 --repeats 1 # a smoke run
    .venv/bin/python benchmarks/ep_cpu.py --markdown BENCHMARKS.md   # also append the tables there

The multi-GPU path is the same function (`benchmarks.ep_workers.bench_worker`) under `run_distributed(...,
backend="nccl")` with cfg["device"] = "cuda". Never used by tests.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.ep_workers import bench_worker  # noqa: E402
from dblock.optimized.ep import comm_summary, run_distributed  # noqa: E402

# A random LLaDA2-shaped model in which the routed experts dominate the pass (32 experts top-4, wide experts); its
# LM head is scaled by 0.3 so that blocks take ~8 passes, as a trained model's do, instead of ~2.
MOE_HEAVY = dict(family="llada2_moe", seed=0, head_scale=0.3, vocab_size=256, hidden_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                 moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                 mask_token_id=255, eos_token_id=254, pad_token_id=254, block_size=32)


def models(batch: int, max_new: int):
    """(name, model spec for bench_worker, prompts, max_new_tokens, K)."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, 250, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
          for _ in range(batch)]
    out = [("moe-heavy (random, E=32 K=4 H=128 I=256, C=32, head x0.3)", MOE_HEAVY, ps, max_new, 4)]
    from dblock.weights_path import CHECKPOINTS_DIR
    if os.path.isfile(os.path.join(CHECKPOINTS_DIR, "tiny-masked", "model.safetensors")):
        import dblock
        from dblock.tasks import get_task
        from dblock.tasks.evaluate import TokenizerAdapter
        m = dblock.load("tiny-masked")
        tok = TokenizerAdapter.from_folder(m.source)
        from dblock.tasks.card import task_of
        exs = get_task(task_of("tiny-masked")).examples("test", batch)
        out.append((f"tiny-masked ({task_of('tiny-masked')} prompts, E=16 K=4, C=16)", "tiny-masked", [tok.encode(e.prompt) for e in exs],
                    max_new, m.config.num_experts_per_tok))
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarise(res: list, K: int) -> dict:
    r0 = res[0]
    fl_runs, dn_runs = r0["freshlane"], r0["dense"]
    ev = [{"event": "pass", "comm": c} for c in fl_runs["comm"]]
    s = comm_summary(ev)
    W = s["world"]

    def tot(proto, keys):
        return sum(sum(s[proto][k]) for k in keys)
    dc = ("dispatch_bytes", "combine_bytes")
    allk = ("count_bytes", "dispatch_bytes", "combine_bytes", "gather_bytes")
    owned = sum(s["freshlane"]["owned"]) or 1
    return {
        "world": W, "passes": s["passes"],
        "fresh_frac": sum(s["freshlane"]["owned"]) / max(1, sum(s["dense"]["owned"])),
        "bytes_fl": tot("freshlane", dc), "bytes_dn": tot("dense", dc),
        "bytes_ratio": tot("dense", dc) / max(1, tot("freshlane", dc)),
        "all_bytes_ratio": tot("dense", allk) / max(1, tot("freshlane", allk)),
        "messages_fl": sum(s["freshlane"]["messages"]), "messages_dn": sum(s["dense"]["messages"]),
        "dense_run_bytes_match": abs(sum(c["dispatch_bytes"] + c["combine_bytes"] for c in dn_runs["comm"]) /
                                     max(1, len(dn_runs["comm"])) - tot("dense", dc)) < 1e-6 * tot("dense", dc) + 1,
        "den_fl": med(fl_runs["den_s"]), "den_dn": med(dn_runs["den_s"]),
        "moe_fl": med(fl_runs["moe_s"]), "moe_dn": med(dn_runs["moe_s"]),
        "comm_fl": med(fl_runs["comm_s"]), "comm_dn": med(dn_runs["comm_s"]),
        "ranks_per_row": sum(s["freshlane"]["rows"]) / owned,
        "ranks_per_row_uniform": W * (1 - (1 - 1 / W) ** K),
        "same_tokens": fl_runs["tokens"] == dn_runs["tokens"] and all(
            r["freshlane"]["tokens"] == fl_runs["tokens"] for r in res),
    }


def table(rows: list) -> str:
    head = ("| model | W | passes | fresh rows | bytes/pass FL | bytes/pass dense | bytes ratio | incl. gather | "
            "msgs FL / dense | denoise s FL / dense (ratio) | MoE s ratio | comm s ratio | ranks/row (uniform) | "
            "same tokens |\n|" + "---|" * 14)
    out = [head]
    for name, r in rows:
        out.append(
            f"| {name} | {r['world']} | {r['passes']} | {100 * r['fresh_frac']:.0f}% | {r['bytes_fl']:,.0f} | "
            f"{r['bytes_dn']:,.0f} | **{r['bytes_ratio']:.2f}x** | {r['all_bytes_ratio']:.2f}x | "
            f"{r['messages_fl']:.1f} / {r['messages_dn']:.1f} | {r['den_fl']:.2f} / {r['den_dn']:.2f} "
            f"(**{r['den_dn'] / r['den_fl']:.2f}x**) | {r['moe_dn'] / r['moe_fl']:.2f}x | "
            f"{r['comm_dn'] / max(r['comm_fl'], 1e-9):.2f}x | {r['ranks_per_row']:.2f} "
            f"({r['ranks_per_row_uniform']:.2f}) | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per mode, order alternating (default 3)")
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per request (default 64)")
    ap.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds (default 120)")
    ap.add_argument("--json", default=None, help="write the raw summaries to this file")
    ap.add_argument("--markdown", default=None, help="append a section with the tables to this markdown file")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    t0 = time.time()
    for name, spec, ps, new, K in models(args.batch, args.max_new_tokens):
        for W in worlds:
            cfg = dict(model=spec, prompts=ps, max_new_tokens=new, repeats=args.repeats, timeout_s=args.timeout)
            res = run_distributed(bench_worker, W, args=(cfg,), timeout_s=args.timeout, join_timeout_s=3600)
            r = summarise(res, K)
            rows.append((name, r))
            print(f"{name} W={W}: bytes ratio {r['bytes_ratio']:.2f}x, denoise time ratio "
                  f"{r['den_dn'] / r['den_fl']:.2f}x, same tokens {r['same_tokens']}", flush=True)
    md = table(rows)
    print(md)
    cores = os.cpu_count()
    cmd = "python benchmarks/ep_cpu.py " + " ".join(sys.argv[1:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": n, **r} for n, r in rows], f, indent=1)
    if args.markdown:
        new_file = not os.path.exists(args.markdown)
        with open(args.markdown, "a") as f:
            if new_file:
                f.write("# Benchmarks\n\nEach section: the command that produced it, the machine, the numbers.\n")
            f.write(f"\n## Expert/sequence-parallel FreshLane vs dense dispatch (gloo, CPU)\n\n"
                    f"Command: `{cmd.strip()}` ({time.time() - t0:.0f} s). Machine: `{' '.join(platform.uname())}`, "
                    f"{cores} cores (load average {os.getloadavg()[0]:.1f} at the end: other jobs share them), "
                    f"torch {torch.__version__}, one torch thread per rank, batch {args.batch}, "
                    f"{args.max_new_tokens} new tokens per request, `epoch` configuration (M_C = 5), Native "
                    f"schedule, medians of {args.repeats} repeats.\n\n{md}\n\n"
                    "Bytes are counted, not timed: per pass (summed over MoE layers and ranks) what goes to *other* "
                    "ranks in dispatch and combine; 'incl. gather' adds the count exchange and the all-gather that "
                    "restores the full shard on every rank (the CPU stand-in for TP/SP). Both protocols are "
                    "counted on every pass of the FreshLane run; the dense run's own counts agree"
                    f" ({'yes' if all(r['dense_run_bytes_match'] for _, r in rows) else 'NO'}). "
                    "**Timings on this shared 2-core machine are noisy**: W ranks share 2 cores (W=4 is "
                    "oversubscribed), gloo moves bytes through loopback TCP, and at these sizes the collectives' "
                    "latency, not their bytes, dominates; the time ratios say little about NVLink/IB.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
