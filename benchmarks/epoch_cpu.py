"""Epoch executor vs the dense reference on CPU, side by side in one run (issue: the Epoch optimized executor).

For every model and batch size, the five configurations decode the same prompts:
  dense (the reference executor), full_compute (all experts, M_C = 1), no_atlas, no_lsp, epoch.
Per configuration: wall time per denoising pass and its MoE share, TPS, fresh-row fraction, experts in support,
counted MoE FLOPs and bytes per pass, accuracy (graded task) and token agreement with the dense run; at the largest
batch, the process's peak resident memory measured in a fresh subprocess per configuration.

    .venv/bin/python benchmarks/epoch_cpu.py                   # tiny-masked + the scaled LLaDA2.0-mini-shaped config
    .venv/bin/python benchmarks/epoch_cpu.py --quick           # smaller batches, one repeat (a smoke run)
    .venv/bin/python benchmarks/epoch_cpu.py --json out.json

Timings are medians of repeats; ratios are taken within one run on one machine. Never used by tests.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dblock.config import DecodeConfig  # noqa: E402
from dblock.optimized.executor import epoch_forward  # noqa: E402
from dblock.decoding.generate import generate  # noqa: E402

CONFIGS = ["dense", "full_compute", "no_atlas", "no_lsp", "epoch"]

# LLaDA2.0-mini's shape (256 experts top-8 in 8 groups keep 4, 1 shared expert, one dense layer, partial RoPE,
# GQA), scaled down so that the MoE path dominates a CPU pass as it does on 8xH100 (60-77% of the forward).
MINI_SCALED = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=32, intermediate_size=512, moe_intermediate_size=128,
                   num_experts=64, num_experts_per_tok=8, num_shared_experts=1, first_k_dense_replace=1, n_group=8,
                   topk_group=4, routed_scaling_factor=2.5, mask_token_id=511, eos_token_id=510, pad_token_id=510,
                   block_size=32)


class MoETimer:
    """Wall time inside the reference model's MoE modules (forward hooks)."""

    def __init__(self, model):
        self.t, self._t0, self.on = 0.0, None, False   # counts only while `on` (denoising calls, not appends)
        self.hooks = []
        for layer in model.layers:
            if layer.is_moe:
                self.hooks.append(layer.mlp.register_forward_pre_hook(self._pre))
                self.hooks.append(layer.mlp.register_forward_hook(self._post))

    def _pre(self, *a):
        self._t0 = time.perf_counter()

    def _post(self, *a):
        if self.on:
            self.t += time.perf_counter() - self._t0

    def remove(self):
        for h in self.hooks:
            h.remove()


def load_models(quick: bool, only=None):
    from dblock.tiny import make_tiny_model
    from dblock.weights import CHECKPOINTS_DIR
    import dblock
    models = []
    if os.path.isdir(os.path.join(CHECKPOINTS_DIR, "tiny-masked")):
        models.append(("tiny-masked", dblock.load("tiny-masked")))
    models.append(("mini-scaled (random)", make_tiny_model("llada2_moe", seed=0, **MINI_SCALED)))
    return [m for m in models if only is None or m[0].split(" ")[0] in only]


def prompts_for(name, model, batch, rule="threshold"):
    if name == "tiny-masked":
        from dblock.tasks import get_task
        from dblock.tasks.evaluate import TokenizerAdapter
        tok = TokenizerAdapter.from_folder(model.source)
        task = get_task("arith-small")
        exs = task.examples("test", batch)
        return [tok.encode(e.prompt) for e in exs], (task, tok, exs), _dec(model, 128, rule)
    g = torch.Generator().manual_seed(batch)
    V = model.config.vocab_size - 2
    ps = [torch.randint(0, V, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
          for _ in range(batch)]
    return ps, None, _dec(model, 64, rule)


def _dec(model, max_new, rule):
    """threshold: the Epoch evaluation decoder (tau 0.95, few passes per block on these models); fixed-k: LLaDA's
    generate.py default of one pass per position (steps = C), where blocks live long and LSP has work to skip."""
    if rule == "fixed-k":
        return DecodeConfig(max_new_tokens=max_new, rule="fixed-k", steps=model.config.block_size)
    return DecodeConfig(max_new_tokens=max_new)


def flops_bytes(cfg, stats_passes, dense_rows):
    """Counted per denoising pass, summed over MoE layers: router, expert and shared-expert FLOPs; expert weight
    bytes touched (distinct experts x 3 matrices) and expert activation bytes (pairs x (H + 2I) fp32)."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    Ish = I * cfg.num_shared_experts
    el = 4
    if stats_passes is None:   # dense reference: every row routed and through K experts; every expert touched
        n_moe = len(cfg.moe_layers)
        rows, pairs = dense_rows, dense_rows * cfg.num_experts_per_tok
        fl = n_moe * (2 * rows * H * E + 6 * pairs * H * I + 6 * rows * H * Ish)
        by = n_moe * (min(E, pairs) * 3 * H * I * el + pairs * (H + 2 * I) * el)
        return fl, by
    fl = by = 0
    for layers in stats_passes:
        for s in layers:
            fl += 2 * s["routed_rows"] * H * E + 6 * s["pairs"] * H * I + 6 * s["rows"] * H * Ish
            by += s["experts_used"] * 3 * H * I * el + s["pairs"] * (H + 2 * I) * el
    n = max(1, len(stats_passes))
    return fl / n, by / n


def run_config(config, model, prompts, dec):
    if config == "dense":
        from dblock.decoding.generate import reference_forward
        fwd = reference_forward(model)
        timer = MoETimer(model)
    else:
        fwd, timer = epoch_forward(model, config), None
    per_pass = []
    if timer is None:
        orig = fwd.denoise

        def denoise(items):
            out = orig(items)
            per_pass.append(fwd.last_pass_stats())
            return out
        fwd.denoise = denoise
    rows = []
    if timer is not None:
        orig_ref = fwd.denoise

        def denoise_ref(items):
            rows.append(sum(len(s) for it in items for s in it.segments))
            timer.on = True
            try:
                return orig_ref(items)
            finally:
                timer.on = False
        fwd.denoise = denoise_ref
    res = generate(fwd, prompts, dec)
    s = res.summary()
    moe_s = timer.t if timer is not None else sum(p["moe_s"] for p in per_pass)
    if timer is not None:
        timer.remove()
    out = {"s_per_pass": res.times.den_s / max(1, res.times.den_calls), "moe_share": moe_s / res.times.den_s,
           "moe_s_per_pass": moe_s / max(1, res.times.den_calls), "TPS": s["TPS"], "F": s["F"],
           "tokens": res.tokens}
    if timer is None:
        n_moe = len(model.config.moe_layers)
        fr = sum(x["fresh"] for p in per_pass for x in p["layers"])
        tot = sum(x["rows"] for p in per_pass for x in p["layers"])
        out["fresh_frac"] = fr / tot if tot else 1.0
        out["support"] = statistics.mean(x["support"] for p in per_pass for x in p["layers"])
        out["flops"], out["bytes"] = flops_bytes(model.config, [p["layers"] for p in per_pass], None)
        out["paths"] = fwd.stats()["paths"]
        out["_n_moe"] = n_moe
    else:
        out["fresh_frac"], out["support"] = 1.0, model.config.num_experts
        out["flops"], out["bytes"] = flops_bytes(model.config, None, statistics.mean(rows))
    return out


def _vm(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) / 1024   # kB -> MiB
    return float("nan")


def peak_rss(model_name, config, batch, rule="threshold"):
    """Peak resident memory (MiB) of decoding one batch with one configuration, in a fresh process: the high-water
    mark is reset after loading (Linux /proc/self/clear_refs), so the number is what decoding itself adds on top
    of the loaded model and interpreter."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r});"
            "import torch; torch.set_num_threads(1);"
            "import benchmarks.epoch_cpu as b;"
            f"ms = dict(b.load_models(True)); m = ms[{model_name!r}];"
            f"p, _, d = b.prompts_for({model_name!r}, m, {batch}, {rule!r});"
            "base = b._vm('VmRSS'); open('/proc/self/clear_refs', 'w').write('5');"
            f"b.run_config({config!r}, m, p, d);"
            "print(b._vm('VmHWM'), base)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if r.returncode:
        return None, None
    peak, base = map(float, r.stdout.split()[-2:])
    return peak, base


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32,64,128)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per cell; the median time is reported")
    ap.add_argument("--quick", action="store_true", help="batches 1,8 and one repeat")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--json", default=None, help="write all rows to this file")
    ap.add_argument("--models", default=None, help="comma-separated subset: tiny-masked, mini-scaled")
    ap.add_argument("--rules", default="threshold,fixed-k", help="decoding regimes: threshold, fixed-k (steps = C)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in (args.batches or ("1,8" if args.quick else "1,8,32,64,128")).split(",")]
    repeats = 1 if args.quick else args.repeats
    machine = f"{platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread"
    print(f"# benchmarks/epoch_cpu.py on {machine}")
    all_rows = []
    only = set(args.models.split(",")) if args.models else None
    for (name, model), rule in [(nm, r) for nm in load_models(args.quick, only) for r in args.rules.split(",")]:
        print(f"\n## {name}, {rule} rule")
        print(f"{'batch':>5} {'config':>12} {'ms/pass':>8} {'MoE%':>5} {'TPS':>8} {'speedup':>7} {'fresh':>6} "
              f"{'support':>7} {'GFLOP/p':>8} {'MB/p':>7} {'MoE/fresh·dense':>15} {'agree':>6} {'acc':>6}")
        for batch in batches:
            prompts, grading, dec = prompts_for(name, model, batch, rule)
            cells = {}
            for rep in range(repeats):
                for config in CONFIGS:   # interleaved, so machine noise hits every configuration alike
                    r = run_config(config, model, prompts, dec)
                    cells.setdefault(config, []).append(r)
            dense = cells["dense"]
            d_pass = statistics.median(x["s_per_pass"] for x in dense)
            d_moe = statistics.median(x["moe_s_per_pass"] for x in dense)
            d_tps = statistics.median(x["TPS"] for x in dense)
            for config in CONFIGS:
                runs = cells[config]
                r0 = runs[0]
                row = {"model": name, "rule": rule, "batch": batch, "config": config,
                       "ms_per_pass": 1e3 * statistics.median(x["s_per_pass"] for x in runs),
                       "moe_share": statistics.median(x["moe_share"] for x in runs),
                       "TPS": statistics.median(x["TPS"] for x in runs),
                       "fresh_frac": r0["fresh_frac"], "support": r0["support"],
                       "gflops_per_pass": r0["flops"] / 1e9, "mb_per_pass": r0["bytes"] / 2 ** 20,
                       "agreement": sum(a == b for a, b in zip(r0["tokens"], dense[0]["tokens"])) / batch}
                row["speedup_TPS"] = row["TPS"] / d_tps
                moe_pp = statistics.median(x["moe_s_per_pass"] for x in runs)
                row["moe_vs_fresh_dense"] = moe_pp / (r0["fresh_frac"] * d_moe) if d_moe else None
                if grading is not None:
                    task, tok, exs = grading
                    from dblock.tasks import answer_text
                    row["accuracy"] = sum(task.grade(e.prompt, answer_text(t, tok))
                                          for e, t in zip(exs, r0["tokens"])) / batch
                if "paths" in r0:
                    row["paths"] = r0["paths"]
                all_rows.append(row)
                acc = f"{row['accuracy']:.3f}" if "accuracy" in row else "-"
                print(f"{batch:>5} {config:>12} {row['ms_per_pass']:>8.2f} {100 * row['moe_share']:>5.1f} "
                      f"{row['TPS']:>8.1f} {row['speedup_TPS']:>7.2f} {row['fresh_frac']:>6.2f} "
                      f"{row['support']:>7.1f} {row['gflops_per_pass']:>8.3f} {row['mb_per_pass']:>7.1f} "
                      f"{row['moe_vs_fresh_dense']:>15.2f} {row['agreement']:>6.2f} {acc:>6}", flush=True)
        if not args.no_memory:
            big = batches[-1]
            print(f"\npeak resident memory, batch {big} (MiB, fresh process per configuration; baseline = after "
                  "loading, before decoding)")
            for config in CONFIGS:
                peak, base = peak_rss(name, config, big, rule)
                if peak is None:
                    print(f"  {config:>12}: failed")
                    continue
                print(f"  {config:>12}: peak {peak:8.1f}  decode +{peak - base:7.1f}")
                all_rows.append({"model": name, "rule": rule, "batch": big, "config": config, "peak_rss_mib": peak,
                                 "decode_rss_mib": peak - base})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rows": all_rows}, f, indent=1)


if __name__ == "__main__":
    main()
