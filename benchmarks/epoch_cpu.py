"""Epoch executor vs the dense reference on CPU, side by side in one run (docs/algorithms.md §4).

Cells (model, decoding rule, batch): the mini-scaled LLaDA2.0-shaped configuration under fixed-k decoding (block 32,
steps = C: one position per pass) at batch 32, 64 and 128, and the bundled `tiny-masked` under the threshold rule at
batch 32. In each cell five configurations decode the same prompts, interleaved within every repeat so that machine
noise hits them alike:

    dense          the reference executor
    full_compute   Epoch with nothing relaxed (all experts, M_C = 1): every call takes the dense path
    epoch          Expert Atlas + LSP cache (M_C = 5)
    no_atlas       LSP cache only
    no_lsp         Expert Atlas only (every row fresh: nothing to skip, so the cost rule picks the dense path)
    epoch@δ        (on request, `--configs`) epoch with the margin-gated exact refresh of bound δ
                   (`EpochConfig.margin_refresh`, docs/algorithms.md §4.7): its share of approximate request passes
                   re-run exactly is reported beside it
    no_atlas~ε     (on request; any approximate configuration) with LSP's drift bound ε (`EpochConfig.lsp_drift`,
                   docs/algorithms.md §4.3): its f and bound B count the rows the drift bound sent back through the
                   experts, and its share of cache candidates recomputed is reported beside it (`name~ε@δ`: both)

Per configuration: thread-CPU time per pass (`time.thread_time`, the primary clock: on a shared machine it is the
work this thread did) and wall time per pass, TPS on both clocks, MoE share of the pass, the fresh-row fraction f
(rows the block plans send through the routed experts / rows), the share of calls that took the dense path, MoE
time per pass against f × the dense reference's MoE time, and for the Epoch configurations the Amdahl bound
B = 1 / ((1 − m) + m·f) (m: the dense reference's MoE share in the same cell) and the fraction of B reached; the
peak MoE-region buffer bytes at the largest batch (`last_pass_stats()["moe_buffer_bytes"]`, the buffers the
MoE region allocates for the rows it computes); requests whose whole output equals the dense run's; accuracy on
tiny-masked. Medians of the repeats.

Before the repeats each cell measures its own per-machine path profile (`dblock.optimized.plan.PathModel`, docs/
algorithms.md §4.1): m = the MoE share of a dense reference pass (router, routed and shared experts),
o = the epoch path's extra cost at f = 1 over the dense path (full_compute, and no_lsp for the Atlas), on short
decodes of the cell's own batch; the Epoch configurations run with it (`--path-model cost` uses the roofline cost
model instead).

    .venv/bin/python benchmarks/epoch_cpu.py                              # every cell, 5 repeats
    .venv/bin/python benchmarks/epoch_cpu.py --cells mini-scaled:fixed-k:32 --repeats 1 --max-new-tokens 32
    .venv/bin/python benchmarks/epoch_cpu.py --json epoch_cpu.json --write-benchmarks   # replace the section
    .venv/bin/python benchmarks/epoch_cpu.py --markdown                   # print the section instead
    .venv/bin/python benchmarks/epoch_cpu.py --cells code-masked:threshold:32 --configs dense,full_compute,epoch,epoch@0.1
    .venv/bin/python benchmarks/epoch_cpu.py --cells code-masked:threshold:32 --configs dense,full_compute,no_atlas,no_atlas~0.02

Ratios are taken within one run on one machine. Never used by tests.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import re
import resource
import shlex
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dblock.out_paths import check_out_file  # noqa: E402
from dblock.decoding.generate import generate, reference_forward  # noqa: E402
from dblock.decoding.params import DecodeConfig  # noqa: E402
from dblock.errors import ConfigError  # noqa: E402
from dblock.optimized.executor import epoch_forward  # noqa: E402
from dblock.optimized.freshlane import moe_buffer_bytes  # noqa: E402
from dblock.optimized.plan import PathModel  # noqa: E402

CONFIGS = ["dense", "full_compute", "epoch", "no_atlas", "no_lsp"]
EPOCH_LIKE = ("epoch", "no_atlas")                      # configurations with something to skip: bound reported
SECTION = "## Epoch executor vs the dense reference on CPU"
DEFAULT_CELLS = "mini-scaled:fixed-k:32,mini-scaled:fixed-k:64,mini-scaled:fixed-k:128,tiny-masked:threshold:32"

# LLaDA2.0-mini's shape (256 experts top-8 in 8 groups keep 4, 1 shared expert, one dense layer, partial RoPE,
# GQA), scaled down so that the MoE path dominates a CPU pass as it does on 8xH100 (60-77% of the forward).
MINI_SCALED = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=32, intermediate_size=512, moe_intermediate_size=128,
                   num_experts=64, num_experts_per_tok=8, num_shared_experts=1, first_k_dense_replace=1, n_group=8,
                   topk_group=4, routed_scaling_factor=2.5, mask_token_id=511, eos_token_id=510, pad_token_id=510,
                   block_size=32)


MODELS = ("mini-scaled", "tiny-masked", "code-masked", "exec-masked")
#: --code-masked / --exec-masked MODEL: another folder (or bundled name) in those cells
MODEL_PATH = {"code-masked": "code-masked", "exec-masked": "exec-masked"}


def load_model(name: str):
    if name in ("tiny-masked", "code-masked", "exec-masked"):
        import dblock
        return dblock.load(MODEL_PATH.get(name, name))
    if name == "mini-scaled":
        from dblock.tiny import make_tiny_model
        return make_tiny_model("llada2_moe", seed=0, **MINI_SCALED)
    raise SystemExit(f"unknown model {name!r}: {', '.join(MODELS)}")


def prompts_for(name, model, batch, rule="threshold", max_new=None):
    """(prompt ids, grading or None, DecodeConfig). tiny-masked: held-out problems of its card task, 128 new tokens;
    code-masked: held-out problems of the code task, 64 new tokens (two blocks); exec-masked: held-out programs of
    its card's task, up to 96 new tokens (three blocks); mini-scaled: random prompts of 8-23
    tokens, 64 new tokens (two blocks)."""
    if name in ("code-masked", "exec-masked", "tiny-masked"):
        from dblock.tasks.evaluate import held_out_prompts
        task, tok, exs, ps = held_out_prompts(model, batch, "code" if name == "code-masked" else None)
        return ps, (task, tok, exs), _dec(model, max_new or getattr(task, "max_new_tokens", 128), rule)
    g = torch.Generator().manual_seed(batch)
    V = model.config.vocab_size - 2
    ps = [torch.randint(0, V, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
          for _ in range(batch)]
    return ps, None, _dec(model, max_new or 64, rule)


def _dec(model, max_new, rule):
    """threshold: the Epoch evaluation decoder (tau 0.95, with the model card's LLaDA2.0 steps S where it sets one:
    code-masked); fixed-k: LLaDA's
    generate.py default of one position per pass (steps = C), where blocks live long and LSP has work to skip."""
    if rule == "fixed-k":
        return DecodeConfig(max_new_tokens=max_new, rule="fixed-k", steps=model.config.block_size)
    from dblock.tasks.card import decoding_of
    return DecodeConfig(max_new_tokens=max_new, threshold_steps=decoding_of(getattr(model, "source", None)).get("threshold_steps"))


RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def steady_allocator() -> str:
    """Keep freed memory inside the process (glibc `mallopt`: M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB), so
    that a pass does not page-fault its buffers back in after the previous configuration's run returned them to the
    OS. Without it the thread clock (which counts system time) charges a configuration 0-70 ms a pass of page
    faults depending on what ran before it (measured at batch 128). PyTorch's CPU tuning guide recommends a caching
    allocator (jemalloc, tcmalloc) for the same reason. -> how the allocator was set, for the machine line."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(-3, 1 << 30) == 1 and libc.mallopt(-1, (1 << 31) - 1) == 1   # M_MMAP_ / M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        ok = False
    return ("glibc malloc held steady (`mallopt` M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB)" if ok else
            "the default allocator (`mallopt` unavailable)")


class MoETimer:
    """Thread-CPU time inside the reference model's MoE modules and, separately, their shared experts (forward
    hooks; counted only while `on`: denoising calls, not appends)."""

    def __init__(self, model):
        self.moe = self.shared = 0.0
        self.on = False
        self.hooks, self._t0 = [], {}
        for layer in model.layers:
            if layer.is_moe:
                self._hook(layer.mlp, "moe")
                if layer.mlp.shared is not None:
                    self._hook(layer.mlp.shared, "shared")

    def _hook(self, mod, what):
        def pre(*a):
            self._t0[what] = time.thread_time()

        def post(*a):
            if self.on:
                setattr(self, what, getattr(self, what) + time.thread_time() - self._t0[what])
        self.hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def remove(self):
        for h in self.hooks:
            h.remove()


def parse_config(config: str):
    """`name`, `name@δ` (the margin-gated exact refresh of bound δ), `name~ε` (LSP's drift bound ε) or `name~ε@δ`
    -> (name, δ or None, ε or None). A name may carry LSP's age bound: `epoch#3` is epoch at M_C = 3
    (`config_refresh`)."""
    head, _, delta = config.partition("@")
    name, _, eps = head.partition("~")
    return name.partition("#")[0], (float(delta) if delta else None), (float(eps) if eps else None)


def config_refresh(config: str):
    """M_C of `epoch#3` (3), None where the name gives none (the configuration's default, 5)."""
    m = config.partition("@")[0].partition("~")[0].partition("#")[2]
    if m and not (m.isdigit() and int(m) >= 1):
        raise ValueError(f"M_C {m!r}")
    return int(m) if m else None


def run_config(config, model, prompts, dec, path=None, path_model=None) -> dict:
    """Decode `prompts` with one configuration; per-pass clocks measured around the executor call only (reading the
    executor's statistics happens outside them; a gated configuration's exact re-runs are inside them)."""
    timer = None
    if config == "dense":
        fwd = reference_forward(model)
        timer = MoETimer(model)
    else:
        name, delta, eps = parse_config(config)
        fwd = epoch_forward(model, name, path=path, path_model=path_model, margin_refresh=delta, lsp_drift=eps,
                            refresh=config_refresh(config))
    orig = fwd.denoise
    acc = {"cpu": 0.0, "wall": 0.0, "calls": 0, "rows": 0, "n_fresh": 0.0, "computed": 0, "layer_rows": 0,
           "moe_cpu": 0.0, "moe_bytes": 0, "moe_bytes_sum": 0, "dense_calls": 0, "sys": 0.0, "minflt": 0}

    def denoise(items):
        if timer is not None:
            timer.on = True
        r0 = resource.getrusage(RUSAGE_THREAD)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = orig(items)
        acc["cpu"] += time.thread_time() - c0
        acc["wall"] += time.perf_counter() - t0
        r1 = resource.getrusage(RUSAGE_THREAD)
        acc["sys"] += r1.ru_stime - r0.ru_stime
        acc["minflt"] += r1.ru_minflt - r0.ru_minflt
        if timer is not None:
            timer.on = False
        acc["calls"] += 1
        rows = sum(len(s) for it in items for s in it.segments)
        acc["rows"] += rows
        if timer is None:
            st = fwd.last_pass_stats()
            acc["n_fresh"] += st["fresh_frac"] * rows
            acc["computed"] += sum(x["fresh"] for x in st["layers"])
            acc["layer_rows"] += sum(x["rows"] for x in st["layers"])
            acc["moe_cpu"] += st["moe_cpu_s"]
            nb = st["moe_buffer_bytes"]
            acc["dense_calls"] += st["path"] == "dense"
        else:
            cfg = model.config
            F = len(items) * max(sum(len(s) for s in it.segments) for it in items)     # padded rows
            nb = moe_buffer_bytes(F, F * cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                  model.embed.weight.element_size())
        acc["moe_bytes"] = max(acc["moe_bytes"], nb)
        acc["moe_bytes_sum"] += nb
        return out
    fwd.denoise = denoise
    res = generate(fwd, prompts, dec)
    if timer is not None:
        timer.remove()
        acc["moe_cpu"], acc["shared_cpu"] = timer.moe, timer.shared
        acc["n_fresh"] = acc["rows"]
        acc["computed"] = acc["layer_rows"] = 1
    n = max(1, acc["calls"])
    Y = res.summary()["Y"]
    return {"cpu_per_pass": acc["cpu"] / n, "wall_per_pass": acc["wall"] / n, "moe_per_pass": acc["moe_cpu"] / n,
            "sys_per_pass": acc["sys"] / n, "minflt_per_pass": acc["minflt"] / n,
            "shared_per_pass": acc.get("shared_cpu", 0.0) / n, "moe_share": acc["moe_cpu"] / max(acc["cpu"], 1e-12),
            "TPS": Y / max(acc["cpu"], 1e-12), "TPS_wall": Y / max(acc["wall"], 1e-12), "passes": acc["calls"],
            "fresh_frac": acc["n_fresh"] / max(1, acc["rows"]), "computed_frac": acc["computed"] / acc["layer_rows"],
            "dense_calls": acc["dense_calls"] / n, "moe_bytes": acc["moe_bytes"],
            "moe_bytes_mean": acc["moe_bytes_sum"] / n, "tokens": res.tokens,
            "paths": fwd.stats()["paths"] if timer is None else {},
            "margin_refresh": fwd.stats().get("margin_refresh") if timer is None else None,
            "lsp_drift": fwd.stats().get("lsp_drift") if timer is None else None}


def calibrate(model, prompts, dec, repeats: int) -> dict:
    """The cell's per-machine path profiles (`PathModel`, docs/algorithms.md §4.1), from short interleaved decodes
    of its own prompts (one block): m = the dense reference's MoE share of a pass (router, routed and shared
    experts: all of it follows the fresh rows); o = what the epoch
    path adds at f = 1 over the dense path, without (full_compute) and with (no_lsp) the Expert Atlas."""
    short = dec.replace(max_new_tokens=model.config.block_size)
    runs = {k: [] for k in ("dense", "fc_dense", "fc_epoch", "atlas_epoch")}
    for _ in range(repeats):
        runs["dense"].append(run_config("dense", model, prompts, short))
        runs["fc_dense"].append(run_config("full_compute", model, prompts, short, path="dense"))
        runs["fc_epoch"].append(run_config("full_compute", model, prompts, short, path="epoch"))
        runs["atlas_epoch"].append(run_config("no_lsp", model, prompts, short, path="epoch"))
    med = {k: statistics.median(r["cpu_per_pass"] for r in v) for k, v in runs.items()}
    d = runs["dense"]
    m = statistics.median(r["moe_per_pass"] / r["cpu_per_pass"] for r in d)
    o_plain = max(0.0, med["fc_epoch"] / med["fc_dense"] - 1.0)
    o_atlas = max(0.0, med["atlas_epoch"] / med["fc_dense"] - 1.0)
    src = f"measured ({repeats} short runs of the cell)"
    plain, atlas = PathModel(m, o_plain, src + ", no Atlas"), PathModel(m, o_atlas, src + ", with Atlas")
    return {"full_compute": plain, "no_atlas": plain, "epoch": atlas, "no_lsp": atlas}


def parse_cells(s: str) -> list:
    out = []
    for c in s.split(","):
        parts = c.strip().split(":")
        if len(parts) != 3 or parts[1] not in ("threshold", "fixed-k") or not parts[2].isdigit() or \
                int(parts[2]) < 1 or parts[0] not in MODELS:
            raise ConfigError(f"--cells {c!r}: give model:rule:batch with model in {', '.join(MODELS)}, rule "
                              "threshold or fixed-k and batch >= 1, e.g. mini-scaled:fixed-k:32")
        out.append((parts[0], parts[1], int(parts[2])))
    return out


def parse_configs(s: str) -> list:
    out = []
    for c in s.split(","):
        c = c.strip()
        try:
            name, delta, eps = parse_config(c)
            if config_refresh(c) is not None and name not in EPOCH_LIKE:
                raise ValueError(c)
        except ValueError:
            name, delta, eps = None, None, None
        exact = name in ("dense", "full_compute")
        if name not in CONFIGS or (delta is not None and (exact or not delta >= 0)) or \
                (eps is not None and (exact or name == "no_lsp" or not eps >= 0)):
            raise ConfigError(f"--configs {c!r}: give names among {', '.join(CONFIGS)}, or an approximate one with "
                              "the margin-gated refresh's bound (epoch@0.1) and/or, where LSP is on, LSP's drift "
                              "bound (no_atlas~0.02), and/or LSP's age bound M_C (epoch#3)")
        out.append(c)
    if "dense" not in out:
        raise ConfigError("--configs: dense must be among them (every ratio is to it)")
    return out


def run_cell(name, model, rule, batch, args) -> list:
    configs = args.configs
    prompts, grading, dec = prompts_for(name, model, batch, rule, args.max_new_tokens)
    models = calibrate(model, prompts, dec, args.calibration_repeats) if args.path_model == "measured" else {}
    for cfg, pm in models.items():
        if cfg in ("epoch", "no_atlas"):
            print(f"  path model ({cfg}): m = {pm.moe_share:.3f}, o = {pm.overhead_share:.3f}, "
                  f"break-even f* = {pm.break_even:.3f}", flush=True)
    cells = {c: [] for c in configs}
    for _ in range(args.repeats):
        for config in configs:            # interleaved, so machine noise hits every configuration alike
            cells[config].append(run_config(config, model, prompts, dec,
                                            path_model=models.get(parse_config(config)[0])))
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    dense = cells["dense"]
    d_cpu, d_moe, d_tps = med(dense, "cpu_per_pass"), med(dense, "moe_per_pass"), med(dense, "TPS")
    m = med(dense, "moe_share")
    rows = []
    for config in configs:
        runs = cells[config]
        r0 = runs[0]
        f = r0["fresh_frac"] if r0.get("lsp_drift") is None else r0["computed_frac"]   # drift: rows recomputed too
        row = {"model": name, "rule": rule, "batch": batch, "config": config,
               "TPS": med(runs, "TPS"), "TPS_wall": med(runs, "TPS_wall"),
               "cpu_ms_per_pass": 1e3 * med(runs, "cpu_per_pass"), "wall_ms_per_pass": 1e3 * med(runs, "wall_per_pass"),
               "moe_share": med(runs, "moe_share"), "moe_ms_per_pass": 1e3 * med(runs, "moe_per_pass"),
               "sys_ms_per_pass": 1e3 * med(runs, "sys_per_pass"), "minflt_per_pass": med(runs, "minflt_per_pass"),
               "fresh_frac": f, "computed_frac": r0["computed_frac"], "dense_calls": r0["dense_calls"],
               "passes": r0["passes"], "moe_buffer_bytes": r0["moe_bytes"],
               "moe_buffer_bytes_mean": r0["moe_bytes_mean"],
               "identical": sum(a == b for a, b in zip(r0["tokens"], dense[0]["tokens"])) / batch,
               "repeats": len(runs)}
        row["speedup"] = row["TPS"] / d_tps
        row["moe_vs_fresh_dense"] = row["moe_ms_per_pass"] / (1e3 * f * d_moe) if d_moe and f else None
        if parse_config(config)[0] in EPOCH_LIKE:
            row["bound"] = 1.0 / ((1.0 - m) + m * f)
            row["fraction_of_bound"] = (d_cpu / med(runs, "cpu_per_pass")) / row["bound"]
        if config in models:
            row["path_model"] = models[config].as_dict()
        g = r0.get("margin_refresh")
        if g:
            row["margin_refresh"] = g
            row["refreshed_of_approx"] = g["refreshed"] / g["approx"] if g["approx"] else 0.0
            row["refreshed_of_all"] = g["refreshed"] / g["requests"] if g["requests"] else 0.0
        dr = r0.get("lsp_drift")
        if dr:
            row["lsp_drift"] = dr
            row["drift_recomputed"] = dr["recomputed"] / dr["checked"] if dr["checked"] else 0.0
        if grading is not None:
            task, tok, exs = grading
            from dblock.tasks import answer_text
            row["accuracy"] = sum(task.grade(e.prompt, answer_text(t, tok)) for e, t in zip(exs, r0["tokens"])) / batch
            if getattr(task, "style", None) == "code":
                row.update(code_quality(task, tok, exs, r0["tokens"], dense[0]["tokens"]))
        if r0["paths"]:
            row["paths"] = r0["paths"]
        rows.append(row)
    return rows


def code_quality(task, tok, exs, tokens, dense_tokens) -> dict:
    """The code task's quality of one configuration's outputs: next-line exact and token accuracy with 95% bootstrap
    CIs over requests, and the paired CI of the token-accuracy difference against the dense run's outputs."""
    from dblock.tasks import answer_text
    from dblock.tasks.code import bootstrap_ci, paired_bootstrap_ci

    def scores(toks):
        out = []
        for e, t in zip(exs, toks):
            ids = [int(i) for i in t]
            ids = ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids
            out.append(task.score(e, answer_text(t, tok), ids, tok.encode(e.answer)))
        return out
    mine, base = scores(tokens), scores(dense_tokens)
    nle = [float(x["next_line_exact"]) for x in mine]
    ta = [x["token_accuracy"] for x in mine]
    return {"next_line_exact": sum(nle) / len(nle), "next_line_exact_ci": bootstrap_ci(nle),
            "token_accuracy": sum(ta) / len(ta), "token_accuracy_ci": bootstrap_ci(ta),
            "token_accuracy_delta_ci": paired_bootstrap_ci(ta, [x["token_accuracy"] for x in base])}


def print_rows(rows):
    print(f"{'config':>13} {'cpu ms/p':>9} {'wall ms/p':>9} {'TPS':>8} {'vs dense':>8} {'MoE%':>5} {'fresh':>6} "
          f"{'dense calls':>11} {'MoE/f·dMoE':>10} {'bound':>6} {'of B':>5} {'MoE MiB pk/mean':>15} {'ident':>6}")
    for r in rows:
        b = f"{r['bound']:.2f}" if "bound" in r else "-"
        fb = f"{r['fraction_of_bound']:.2f}" if "fraction_of_bound" in r else "-"
        mv = f"{r['moe_vs_fresh_dense']:.2f}" if r["moe_vs_fresh_dense"] is not None else "-"
        print(f"{r['config']:>13} {r['cpu_ms_per_pass']:>9.2f} {r['wall_ms_per_pass']:>9.2f} {r['TPS']:>8.1f} "
              f"{r['speedup']:>8.2f} {100 * r['moe_share']:>5.1f} {r['fresh_frac']:>6.2f} {r['dense_calls']:>11.2f} "
              f"{mv:>10} {b:>6} {fb:>5} {r['moe_buffer_bytes'] / 2 ** 20:>7.2f}/"
              f"{r['moe_buffer_bytes_mean'] / 2 ** 20:<7.2f} "
              f"{r['identical']:>6.2f}" + "".join(_row_notes(r)), flush=True)


def _row_notes(r) -> list:
    """What a row adds after its columns: the margin gate's re-runs, the drift bound's recomputed candidates, the
    code task's quality."""
    out = []
    if "margin_refresh" in r:
        out.append(f"  refreshed {r['refreshed_of_approx']:.2f} of approximate request passes "
                   f"({r['refreshed_of_all']:.2f} of all)")
    if "lsp_drift" in r:
        out.append(f"  drift recomputed {r['drift_recomputed']:.2f} of cache candidates")
    if "token_accuracy" in r:
        lo, hi = r["token_accuracy_delta_ci"]
        out.append(f"  next-line {r['next_line_exact']:.3f} token-acc {r['token_accuracy']:.3f} "
                   f"(delta CI {lo:+.3f}...{hi:+.3f})")
    return out


def markdown(rows, meta) -> str:
    """The BENCHMARKS.md section for these rows."""
    out = [SECTION, "",
           f"Command: `{meta['command']}` ({meta['minutes']:.1f} min). Machine: {meta['machine']}. "
           f"{meta['repeats']} interleaved repeats per cell, medians; thread-CPU time (`time.thread_time`) is the "
           "primary clock (the work this thread did, whatever else ran on the machine), wall time beside it.",
           "",
           "Models: `mini-scaled`, a random llada2_moe shaped like LLaDA2.0-mini scaled down so that the MoE path "
           "dominates a pass (E = 64, top-8, 8 groups keep 4, one shared expert, H = 256, I = 128, C = 32; random "
           "prompts, 64 new tokens) under fixed-k decoding with steps = C (one position per pass, where blocks live C "
           "passes and LSP has the most to skip), and the bundled `tiny-masked` (E = 16, top-4, C = 16; held-out "
           "problems of its card task, 128 new tokens) under the threshold rule (τ = 0.95). Columns: TPS on the thread-CPU "
           "clock and its ratio to dense; MoE share of the pass; f, the fresh-row fraction (rows the block plans send "
           "through the routed experts / rows); dense calls, the share of calls the cost rule of docs/algorithms.md "
           "§4.1 sent down the dense path (m·(1 − f) ≤ o, with the cell's measured path profile); MoE time / "
           "(f × dense MoE), 1.00 = MoE work exactly proportional to fresh rows; B = 1/((1 − m) + m·f), the Amdahl "
           "bound with m the dense reference's MoE share (router, routed and shared experts: all of it counted as "
           "skippable, so B is generous), and the share of it reached (above 100% where the dense path itself beats "
           "the reference); identical outputs, requests whose whole output equals the dense run's. Below each table: "
           "the MoE region's row-buffer bytes (`last_pass_stats()[\"moe_buffer_bytes\"]`, peak and mean over passes; "
           "for dense the same accounting over every row), the system time and page faults per pass, and the "
           "measured path profiles.", ""]
    cells = []
    for r in rows:
        key = (r["model"], r["rule"])
        if key not in cells:
            cells.append(key)
    for model, rule in cells:
        sub = [r for r in rows if (r["model"], r["rule"]) == (model, rule)]
        big = max(r["batch"] for r in sub)
        out += [f"**{model}, {rule} rule**", "",
                "| batch | config | CPU ms/pass | wall ms/pass | TPS | TPS vs dense | MoE share | fresh rows f | "
                "dense calls | MoE ms/pass | MoE / (f × dense MoE) | bound B | of B | identical outputs |"
                + (" accuracy |" if any("accuracy" in r for r in sub) else ""),
                "|---" * (14 + any("accuracy" in r for r in sub)) + "|"]
        for r in sub:
            mv = f"{r['moe_vs_fresh_dense']:.2f}" if r["moe_vs_fresh_dense"] is not None else "-"
            tps = f"**{r['speedup']:.2f}x**" if r["config"] == "epoch" else f"{r['speedup']:.2f}x"
            bound = f"{r['bound']:.2f}" if "bound" in r else "-"
            line = (f"| {r['batch']} | {r['config']} | {r['cpu_ms_per_pass']:.1f} | {r['wall_ms_per_pass']:.1f} | "
                    f"{r['TPS']:.0f} | {tps} | {100 * r['moe_share']:.0f}% | {100 * r['fresh_frac']:.0f}% | "
                    f"{100 * r['dense_calls']:.0f}% | {r['moe_ms_per_pass']:.1f} | {mv} | {bound}")
            line += (f" | {100 * r['fraction_of_bound']:.0f}%" if "fraction_of_bound" in r else " | -")
            line += f" | {100 * r['identical']:.0f}% |"
            if "accuracy" in r:
                line += f" {r['accuracy']:.3f} |"
            out.append(line)
        pms = {r["config"]: r["path_model"] for r in sub if "path_model" in r and r["batch"] == big}
        mem = ", ".join(f"{r['config']} {r['moe_buffer_bytes'] / 2 ** 20:.2f} / "
                        f"{r['moe_buffer_bytes_mean'] / 2 ** 20:.2f}"
                        for r in sub if r["batch"] == big)
        out += ["", f"MoE-region buffers at batch {big}, peak / mean over passes (MiB; the peak is an all-fresh pass, "
                    f"the mean follows f): {mem}."]
        sysl = "; ".join(f"batch {b}: " + ", ".join(f"{r['config']} {r['sys_ms_per_pass']:.2f} ms / "
                                                    f"{r['minflt_per_pass']:.0f}"
                                                    for r in sub if r["batch"] == b)
                         for b in sorted({r["batch"] for r in sub}))
        out.append(f"System time and minor page faults per pass (inside the CPU ms above): {sysl}.")
        gated = [r for r in sub if "margin_refresh" in r]
        if gated:
            out.append("Margin-gated exact refresh (request passes re-run through full_compute, of the approximate "
                       "ones and of all): " + "; ".join(
                           f"batch {r['batch']} {r['config']} {100 * r['refreshed_of_approx']:.0f}% / "
                           f"{100 * r['refreshed_of_all']:.0f}%" for r in gated) + ".")
        drifted = [r for r in sub if "lsp_drift" in r]
        if drifted:
            out.append("LSP's drift bound (cache candidates computed fresh because their MoE input moved more than ε; "
                       "their f counts them): " + "; ".join(
                           f"batch {r['batch']} {r['config']} {100 * r['drift_recomputed']:.0f}%" for r in drifted)
                       + ".")
        if pms:
            out.append(f"Measured path profiles at batch {big}: " + "; ".join(
                f"{c}: m = {p['moe_share']:.3f}, o = {p['overhead_share']:.3f}, f* = {p['break_even']:.3f}"
                for c, p in pms.items() if c in ("epoch", "no_atlas")) + ".")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_section(path: str, text: str, heading: str = SECTION) -> None:
    """Replace the section that starts with `heading` (up to the next `## ` heading) in `path`, or append it."""
    old = open(path).read() if os.path.exists(path) else ""
    start = old.find(heading + "\n")
    if start < 0:
        new = old.rstrip() + "\n\n" + text
    else:
        m = re.compile(r"^## ", re.M).search(old, start + len(heading))
        end = m.start() if m else len(old)
        new = old[:start] + text + ("\n" if m else "") + old[end:]
    _write_atomic(path, new)


def _write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it: a crash leaves the old file or none."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=DEFAULT_CELLS, help=f"model:rule:batch,... (default {DEFAULT_CELLS})")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per cell; medians reported (>= 5 "
                                                           "for the BENCHMARKS.md numbers)")
    ap.add_argument("--calibration-repeats", type=int, default=3, help="short runs per path-profile measurement")
    ap.add_argument("--path-model", choices=["measured", "cost"], default="measured",
                    help="measured: the cell's own per-machine profile; cost: the roofline cost model (default "
                         "hardware of EpochConfig)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"configurations, interleaved in this order (default {','.join(CONFIGS)}); name@δ runs an "
                         "approximate one with the margin-gated exact refresh of bound δ, e.g. epoch@0.1")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="override the cells' token budgets (smoke runs)")
    ap.add_argument("--allocator", choices=["steady", "default"], default="steady",
                    help="steady: keep freed memory in the process (glibc mallopt), so that page faults do not "
                         "depend on which configuration ran before; default: leave malloc as it is")
    ap.add_argument("--code-masked", default="code-masked", metavar="MODEL",
                    help="the model of the code-masked cells (default the bundled code-masked)")
    ap.add_argument("--exec-masked", default="exec-masked", metavar="MODEL",
                    help="the model of the exec-masked cells: a trained folder with a card (default the bundled "
                         "exec-masked)")
    ap.add_argument("--json", default=None, help="write all rows to this file")
    ap.add_argument("--markdown", action="store_true", help="print the BENCHMARKS.md section")
    ap.add_argument("--write-benchmarks", nargs="?", const=os.path.join(ROOT, "BENCHMARKS.md"), default=None,
                    metavar="PATH", help="replace the section in BENCHMARKS.md (or PATH)")
    args = ap.parse_args()
    try:                                # refuse bad output paths and cells now, not after the whole run
        for path, flag in ((args.json, "--json"), (args.write_benchmarks, "--write-benchmarks")):
            if path:
                check_out_file(path, flag)
        if args.repeats < 1 or args.calibration_repeats < 1:
            raise ConfigError(f"--repeats {args.repeats} / --calibration-repeats {args.calibration_repeats}: "
                              "must be >= 1")
        cells = parse_cells(args.cells)
        args.configs = parse_configs(args.configs)
    except ConfigError as e:
        raise SystemExit(f"epoch_cpu.py: error: {e}") from None
    torch.set_num_threads(1)
    MODEL_PATH.update({"code-masked": args.code_masked, "exec-masked": args.exec_masked})
    alloc = steady_allocator() if args.allocator == "steady" else "the default allocator"
    t_start = time.perf_counter()
    machine = (f"`{platform.platform()}`, {os.cpu_count()} cores, torch {torch.__version__}, one torch thread, "
               f"{alloc}")
    print(f"# benchmarks/epoch_cpu.py on {machine}")
    rows, loaded = [], {}
    for name, _, _ in cells:            # every model loads (or is refused) before the first cell runs
        if name not in loaded:
            try:
                loaded[name] = load_model(name)
            except (OSError, ValueError) as e:
                raise SystemExit(f"epoch_cpu.py: error: the {name} cells: model "
                                 f"{MODEL_PATH.get(name, name)!r}: {e}") from None
    for name, rule, batch in cells:
        print(f"\n## {name}, {rule} rule, batch {batch}", flush=True)
        cell = run_cell(name, loaded[name], rule, batch, args)
        print_rows(cell)
        rows += cell
    minutes = (time.perf_counter() - t_start) / 60
    meta = {"machine": machine, "allocator": args.allocator, "repeats": args.repeats, "minutes": minutes,
            "command": ".venv/bin/python benchmarks/epoch_cpu.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    if args.json:
        _write_atomic(args.json, json.dumps({**meta, "rows": rows}, indent=1))
    if args.markdown or args.write_benchmarks:
        text = markdown(rows, meta)
        if args.markdown:
            print("\n" + text)
        if args.write_benchmarks:
            write_section(args.write_benchmarks, text)
            print(f"wrote the section {SECTION!r} of {args.write_benchmarks}")


if __name__ == "__main__":
    main()
