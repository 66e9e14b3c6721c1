"""DiffusionGemma on CPU: dblock's optimized executor against dblock's reference and transformers' own
`DiffusionGemmaForBlockDiffusion.generate`, side by side in one process (docs/algorithms.md §4).

Per batch size (default 1, 8, 32), the same held-out prompts of the model card's task, the same seed and the same
entropy-bound decoder (the model's defaults, `--max-new-tokens`) through:

    reference      dblock's readable reference executor (`dblock.reference.gemma_executor.GemmaReference`)
    full_compute   the Epoch executor with nothing relaxed (`epoch_forward(model, "full_compute")`: every expert
                   eligible, LSP off; grouped experts for the whole batch, fused attention, one LM head call)
    epoch          the Epoch executor with the Expert Atlas (`--atlas-B`, default E / 2: the default B = min(E, 4K)
                   is every expert on a model with few experts, which leaves the Atlas inert)
    transformers   `DiffusionGemmaForBlockDiffusion.from_pretrained(folder)` + `generate` (its defaults: sdpa,
                   grouped_mm experts), the batch left-padded with an attention mask, `torch.manual_seed(seed)`

interleaved within every repeat (the order rotates) so that machine noise hits them alike. Primary clock: thread-CPU
time of the whole `generate` call (`time.thread_time`, one torch thread: on a shared machine it is the work this
thread did); wall time beside it. Medians of the repeats. Speed ratios are transformers' time over the executor's.
Tokens identical: per request, the generated canvases against the reference's (and transformers' at batch 1: its
batched generate draws one random stream for the whole batch and cannot be reproduced per request, see
tests/reference/test_gemma_generate.py). Quality: the task's grade of each output.

Then One Block Ahead on the optimized executor: Native and OBA schedules at the largest batch, reference, full_compute
and epoch: TPF (generated tokens per denoising pass, docs/counters.md), TPS on the thread clock, accuracy. Then
`dblock verify`'s decision agreement (`--verify-n` requests) and an LSP probe: over consecutive passes of a block,
how many rows keep their token and how far their routed-expert output moves anyway (docs/algorithms.md §4.6).

    .venv/bin/python benchmarks/gemma_cpu.py                                  # tiny-uniform, 5 repeats
    .venv/bin/python benchmarks/gemma_cpu.py --model code-uniform                      # once it is trained
    .venv/bin/python benchmarks/gemma_cpu.py --repeats 1 --batches 1,8        # a smoke run
    .venv/bin/python benchmarks/gemma_cpu.py --random-size code              # code-uniform's shapes, random
    .venv/bin/python benchmarks/gemma_cpu.py --json gemma_cpu.json --markdown

Ratios are taken within one run on one machine. Never used by tests.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dblock  # noqa: E402
from dblock.decoding.generate import generate, reference_forward  # noqa: E402
from dblock.decoding.params import DecodeConfig  # noqa: E402
from dblock.errors import ConfigError  # noqa: E402
from dblock.optimized.executor import epoch_forward  # noqa: E402
from dblock.out_paths import check_out_file  # noqa: E402

CONFIGS = ("reference", "full_compute", "epoch", "transformers")


def workload(model_name: str, model, n: int, task_name=None):
    """(prompt ids, examples, task, tokenizer): the first n held-out problems of the card's task."""
    from dblock.tasks import get_task
    from dblock.tasks.card import task_of
    from dblock.tasks.evaluate import TokenizerAdapter
    tok = TokenizerAdapter.from_folder(model.source)
    task = get_task(task_name or task_of(model_name, "arith"))
    exs = task.examples("test", n)
    return [tok.encode(e.prompt) for e in exs], exs, task, tok


def random_model(size: str, vocab: int, canvas: int, folder: str):
    """A random DiffusionGemma of `dblock.tasks.train_uniform.GEMMA_SIZES[size]` (the shapes a bundled model is
    trained at: `code` for code-uniform) saved where transformers can load it -> the loaded dblock model. Its near
    uniform logits keep the entropy-bound rule busy for many passes a block: a compute-heavy stand-in while the
    trained model is not there."""
    from dblock.reference.gemma_tiny import make_tiny_gemma
    from dblock.tasks.train_uniform import GEMMA_SIZES
    from dblock.tiny import save_for_transformers
    if size not in GEMMA_SIZES:
        raise SystemExit(f"gemma_cpu.py: error: --random-size {size!r}: allowed {', '.join(GEMMA_SIZES)}")
    m = make_tiny_gemma(seed=0, **GEMMA_SIZES[size], vocab_size=vocab, canvas_length=canvas, image_token_id=None,
                        boi_token_id=None, eoi_token_id=None)
    save_for_transformers(m, folder, overwrite=True)
    return dblock.load(folder)


def random_workload(model, n: int, seed: int = 0):
    """n random prompts of 8-23 ids (no special ids), no grading."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    return [torch.randint(3, V, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def grade(task, tok, exs, tokens) -> int:
    if task is None:
        return 0
    from dblock.tasks import answer_text
    code = getattr(task, "style", None) == "code"
    return sum(bool(task.grade(e.prompt, answer_text(t, tok), example=e) if code else
                    task.grade(e.prompt, answer_text(t, tok))) for e, t in zip(exs, tokens))


def token_accuracy(task, tok, exs, tokens):
    """The code task's whole-answer token accuracy (the first 64 generated ids against the file's, both blocks),
    mean over requests; None on other tasks."""
    if getattr(task, "style", None) != "code":
        return None
    from dblock.tasks.evaluate import prompts_and_grader
    prompts, grader = prompts_and_grader(task, tok, exs)
    return sum(grader(p, t)["answer_token_accuracy"] for p, t in zip(prompts, tokens)) / len(exs)


def hf_generate(hf, prompts, dec: DecodeConfig, pad: int):
    """transformers' generate over the batch, left-padded with an attention mask -> per request the generated ids
    (committed canvases, pad after EOS) and its decoder passes."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (L - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    t_max, t_min = dec.temperature
    calls, enc = [], []
    h = hf.model.decoder.register_forward_hook(lambda *a: calls.append(1))
    he = hf.model.encoder.register_forward_hook(lambda *a: enc.append(1))
    try:
        torch.manual_seed(dec.seed)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=dec.max_new_tokens,
                              max_denoising_steps=dec.n_steps,
                              sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(dec.entropy_bound)),
                              t_max=t_max, t_min=t_min, stability_threshold=dec.stability,
                              confidence_threshold=float(dec.confidence), pad_token_id=pad)
    finally:
        h.remove()
        he.remove()
    return [out.sequences[i, L:].tolist() for i in range(len(prompts))], len(calls), len(enc)


def run_one(config, model, hf, prompts, dec, atlas_B, schedule="native") -> dict:
    """One decode of the batch with one configuration: clocks, tokens, passes."""
    t0, c0 = time.perf_counter(), time.thread_time()
    if config == "transformers":
        gen, passes, enc = hf_generate(hf, prompts, dec, model.config.pad_token_id)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        eos = model.config.eos_token_id
        toks = [g[:g.index(eos) + 1] if eos in g else g for g in gen]
        return {"cpu_s": cpu, "wall_s": wall, "generated": gen, "tokens": toks, "F": passes,
                "Y": sum(len(t) for t in toks), "calls": passes, "append_calls": enc}
    fwd = {"reference": lambda: reference_forward(model),
           "full_compute": lambda: epoch_forward(model, "full_compute"),
           "epoch": lambda: epoch_forward(model, "epoch", atlas_B=atlas_B)}[config]()
    res = generate(fwd, prompts, dec, schedule)
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    out = {"cpu_s": cpu, "wall_s": wall, "generated": [r.generated for r in res.runs], "tokens": res.tokens,
           "F": sum(c.F for c in res.counters), "Y": sum(c.Y for c in res.counters),
           "calls": res.times.den_calls, "append_calls": res.times.app_calls}
    if config == "epoch":
        hot = fwd.stats()["atlas_hot"]
        out["atlas"] = {"rows_within_support": hot.get("rows", 0), "opened": hot.get("under", 0),
                        "mean_support": hot.get("support_sum", 0) / max(1, hot.get("calls", 0))}
    return out


def run_batch(B, model, hf, prompts, exs, task, tok, dec, args) -> dict:
    ps, ex = prompts[:B], exs[:B]
    runs = {c: [] for c in CONFIGS}
    for r in range(args.repeats):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for c in order:
            runs[c].append(run_one(c, model, hf, ps, dec, args.atlas_B))
    ref = runs["reference"][0]
    row = {"batch": B, "requests": B}
    for c in CONFIGS:
        first = runs[c][0]
        row[c] = {"cpu_s": statistics.median(x["cpu_s"] for x in runs[c]),
                  "wall_s": statistics.median(x["wall_s"] for x in runs[c]),
                  "F": first["F"], "Y": first["Y"], "calls": first["calls"], "append_calls": first["append_calls"],
                  "identical_to_reference": sum(a == b for a, b in zip(first["generated"], ref["generated"])),
                  "accuracy": grade(task, tok, ex, first["tokens"]) / B if task is not None else None,
                  "stable_over_repeats": all(x["generated"] == first["generated"] for x in runs[c])}
        if "atlas" in first:
            row[c]["atlas"] = first["atlas"]
    hf_cpu = row["transformers"]["cpu_s"]
    for c in CONFIGS[:3]:
        row[c]["speed_vs_transformers"] = hf_cpu / row[c]["cpu_s"]
        row[c]["wall_speed_vs_transformers"] = row["transformers"]["wall_s"] / row[c]["wall_s"]
    return row


def run_oba(model, prompts, exs, task, tok, dec, args) -> list:
    B = max(args.batches)
    ps, ex = prompts[:B], exs[:B]
    out = []
    for sched in ("native", "oba"):
        for c in ("reference", "full_compute", "epoch"):
            rs = [run_one(c, model, None, ps, dec, args.atlas_B, sched) for _ in range(max(1, args.oba_repeats))]
            cpu = statistics.median(r["cpu_s"] for r in rs)
            r0 = rs[0]
            out.append({"schedule": sched, "config": c, "batch": B, "TPF": r0["Y"] / max(1, r0["F"]),
                        "TPS": r0["Y"] / cpu, "cpu_s": cpu, "F": r0["F"], "Y": r0["Y"],
                        "accuracy": grade(task, tok, ex, r0["tokens"]) / B if task is not None else None,
                        "token_accuracy": token_accuracy(task, tok, ex, r0["tokens"]),
                        "tokens": r0["generated"]})
    ref = {o["schedule"]: o["tokens"] for o in out if o["config"] == "reference"}
    for o in out:
        o["identical_to_reference"] = sum(a == b for a, b in zip(o.pop("tokens"), ref[o["schedule"]]))
    return out


def lsp_probe(model, prompts, dec) -> dict:
    """Could LSP serve any row of a uniform-state block? Decode with the reference, recording each current block's
    canvas tokens and every layer's routed-expert output per pass; over consecutive passes of a block: the share of
    rows whose token is unchanged (the only candidates), and for those rows the relative change
    ‖y_t − y_{t−1}‖ / ‖y_t‖ of the routed output (what serving the previous pass's entry would be off by)."""
    from dblock.reference.gemma_executor import GemmaReference

    class Rec(GemmaReference):
        def __init__(self, m):
            super().__init__(m)
            self.last, self.rows, self.same, self.rel = {}, 0, 0, []

        def denoise(self, items, taps=None):
            taps = {}
            out = super().denoise(items, taps)
            for b, it in enumerate(items):
                s = it.segments[0]
                if s.role != "current":
                    continue
                n = len(s)
                y = torch.stack([t[b, :n] for t in taps["routed"]])              # (layers, n, H)
                key = (it.request, s.block)
                if key in self.last:
                    tok0, y0 = self.last[key]
                    same = s.tokens == tok0
                    self.rows += n
                    self.same += int(same.sum())
                    if same.any():
                        d = (y[:, same] - y0[:, same]).norm(dim=-1) / y[:, same].norm(dim=-1).clamp_min(1e-30)
                        self.rel += d.flatten().tolist()
                self.last[key] = (s.tokens.clone(), y)
            return out

    rec = Rec(model)
    generate(rec, prompts, dec)
    rel = sorted(rec.rel)
    return {"pairs_of_passes_rows": rec.rows, "unchanged_token_share": rec.same / max(1, rec.rows),
            "rel_change_median": rel[len(rel) // 2] if rel else None,
            "rel_change_p10": rel[len(rel) // 10] if rel else None}


def verify_numbers(model, prompts, dec, args) -> dict:
    """`dblock verify`'s decision agreement and invariants for full_compute and epoch on the first prompts."""
    from dblock.equivalence.verify import run_verify
    out = {}
    for config, kw in (("full_compute", {}), ("epoch", {"atlas_B": args.atlas_B})):
        rep = run_verify(model, prompts[:args.verify_n], dec, config=config, epoch_kw=kw, e2e=False)
        d = rep["main"]["decisions"]
        out[config] = {"requests": args.verify_n, "decisions": d["rows"], "agreement": d["agreement"],
                       "max_abs_logits": rep["main"]["logits"]["max_abs"], "exit": rep["exit"]["status"]}
    return out


def _acc(a) -> str:
    return "-" if a is None else f"{a:.3f}"


def markdown(meta, rows, oba, ver, probe=None) -> str:
    L = [f"Command: `{meta['command']}` ({meta['minutes']:.1f} min). Machine: {meta['machine']}. Model "
         f"`{meta['model']}`, task `{meta['task']}`, entropy-bound decoder"
         f"{' with the card decoding ' + json.dumps(meta['decoding']) if meta.get('decoding') else ''}, "
         f"{meta['max_new_tokens']} new tokens, seed "
         f"{meta['seed']}, {meta['repeats']} interleaved repeats (medians), Atlas B = {meta['atlas_B']}.", "",
         "| batch | config | thread-CPU s | × transformers (CPU) | × transformers (wall) | denoising calls | "
         "ms per call | identical to reference | accuracy |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for c in CONFIGS:
            x = r[c]
            sp = x.get("speed_vs_transformers")
            ws = x.get("wall_speed_vs_transformers")
            L.append(f"| {r['batch']} | {c} | {x['cpu_s']:.3f} | {'-' if sp is None else f'{sp:.2f}'} | "
                     f"{'-' if ws is None else f'{ws:.2f}'} | {x['calls']} | "
                     f"{1e3 * x['cpu_s'] / max(1, x['calls'] + x['append_calls']):.1f} | "
                     f"{x['identical_to_reference']}/{r['requests']} | "
                     f"{_acc(x['accuracy'])} |")
    if oba:
        L += ["", f"One Block Ahead on the optimized executor (batch {oba[0]['batch']}):", "",
              "| schedule | config | TPF | TPS (thread) | passes | identical to reference | accuracy "
              "| token accuracy (whole answer) |",
              "|---|---|---|---|---|---|---|---|"]
        for o in oba:
            L.append(f"| {o['schedule']} | {o['config']} | {o['TPF']:.2f} | {o['TPS']:.0f} | {o['F']} | "
                     f"{o['identical_to_reference']}/{o['batch']} | {_acc(o['accuracy'])} | "
                     f"{_acc(o.get('token_accuracy'))} |")
    if ver:
        L += ["", "`dblock verify` (teacher-forced shadow against the reference): " + "; ".join(
            f"{c}: decision agreement {100 * v['agreement']:.2f}% over {v['decisions']} decisions "
            f"({v['requests']} requests), max|Δlogits| {v['max_abs_logits']:.2g}, exit {v['exit']}"
            for c, v in ver.items()) + "."]
    if probe and probe["rel_change_median"] is not None:
        L += ["", f"LSP probe (reference, current blocks, consecutive passes): {100 * probe['unchanged_token_share']:.1f}% "
              f"of {probe['pairs_of_passes_rows']} rows keep their token; for those the routed-expert output moves by "
              f"a median {100 * probe['rel_change_median']:.2g}% (10th percentile "
              f"{100 * probe['rel_change_p10']:.2g}%) of its norm between the passes."]
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-uniform", help="a bundled DiffusionGemma name or model folder")
    ap.add_argument("--task", default=None, help="the prompts' task (default: the model card's)")
    ap.add_argument("--random-size", default=None, metavar="SIZE",
                    help="instead of --model: a random DiffusionGemma of this training size (train_uniform.GEMMA_SIZES, "
                         "e.g. code: code-uniform's shapes) with random prompts, saved to --random-dir; no accuracy")
    ap.add_argument("--random-vocab", type=int, default=2048, help="vocabulary of --random-size (code: 2048)")
    ap.add_argument("--random-canvas", type=int, default=32, help="canvas length of --random-size")
    ap.add_argument("--random-dir", default="/tmp/dblock-gemma-random", help="where --random-size is saved")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes (default 1,8,32)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per batch size (medians)")
    ap.add_argument("--oba-repeats", type=int, default=1, help="repeats of each OBA row (thread clock median)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="generation budget (default: the task's, e.g. 64 for code; else 128, the CLI's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--atlas-B", type=int, default=None, help="the epoch row's initial support (default E / 2)")
    ap.add_argument("--verify-n", type=int, default=16, help="requests of the verify rows (0: skip)")
    ap.add_argument("--no-oba", action="store_true", help="skip the One Block Ahead rows")
    ap.add_argument("--json", default=None, help="write every number to this file")
    ap.add_argument("--markdown", action="store_true", help="print the BENCHMARKS.md section's body")
    args = ap.parse_args()
    try:
        if args.json:
            check_out_file(args.json, "--json")
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
        if not args.batches or min(args.batches) < 1 or args.repeats < 1:
            raise ConfigError(f"--batches {args.batches} / --repeats {args.repeats}: positive integers")
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"gemma_cpu.py: error: {e}") from None
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    if args.random_size:
        model = random_model(args.random_size, args.random_vocab, args.random_canvas, args.random_dir)
        args.model = f"random {args.random_size}-size DiffusionGemma (vocab {args.random_vocab}, canvas " \
                     f"{args.random_canvas})"
    else:
        model = dblock.load(args.model)
    if model.config.family != "diffusion_gemma":
        raise SystemExit(f"gemma_cpu.py: error: {args.model} is {model.config.family}, not diffusion_gemma")
    from transformers import DiffusionGemmaForBlockDiffusion
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(model.source).eval()
    if args.atlas_B is None:
        args.atlas_B = max(model.config.num_experts_per_tok, model.config.num_experts // 2)
    if args.random_size:
        prompts, exs, task, tok = random_workload(model, max(args.batches), args.seed), [None] * max(args.batches), \
            None, None
    else:
        prompts, exs, task, tok = workload(args.model, model, max(args.batches), args.task)
    if args.max_new_tokens is None:
        args.max_new_tokens = getattr(task, "max_new_tokens", None) or 128
    from dblock.tasks.card import decoding_of      # the card's decoding (code-uniform: N steps per block), as the CLI
    card_dec = {} if args.random_size else decoding_of(model.source)
    dec = DecodeConfig(rule="entropy-bound", seed=args.seed, max_new_tokens=args.max_new_tokens,
                       **card_dec).validate()
    machine = (f"`{platform.platform()}`, {os.cpu_count()} cores, torch {torch.__version__}, transformers "
               f"{__import__('transformers').__version__}, one torch thread")
    print(f"# benchmarks/gemma_cpu.py on {machine}", flush=True)
    for B in args.batches:                                    # warm-up: first calls of every path
        run_one("full_compute", model, hf, prompts[:B], dec, args.atlas_B)
        run_one("transformers", model, hf, prompts[:B], dec, args.atlas_B)
    rows = []
    for B in args.batches:
        row = run_batch(B, model, hf, prompts, exs, task, tok, dec, args)
        rows.append(row)
        print(f"batch {B}: " + "  ".join(f"{c} {row[c]['cpu_s']:.3f}s" + (
            f" ({row[c]['speed_vs_transformers']:.2f}x)" if c != "transformers" else "") for c in CONFIGS) +
            f"  identical full_compute {row['full_compute']['identical_to_reference']}/{B}  denoising calls "
            f"{row['full_compute']['calls']} vs transformers {row['transformers']['calls']}", flush=True)
    oba = [] if args.no_oba else run_oba(model, prompts, exs, task, tok, dec, args)
    for o in oba:
        print(f"{o['schedule']:6s} {o['config']:12s} TPF {o['TPF']:.2f} TPS {o['TPS']:.0f} acc {_acc(o['accuracy'])}")
    ver = verify_numbers(model, prompts, dec, args) if args.verify_n else {}
    probe = lsp_probe(model, prompts[:max(args.batches)], dec)
    print(f"LSP probe: {probe}")
    for c, v in ver.items():
        print(f"verify {c}: agreement {v['agreement']:.4f} over {v['decisions']} decisions, exit {v['exit']}")
    meta = {"machine": machine, "model": args.model, "task": getattr(task, "name", "random prompts"),
            "max_new_tokens": args.max_new_tokens, "decoding": card_dec, "seed": args.seed, "repeats": args.repeats,
            "atlas_B": args.atlas_B, "minutes": (time.perf_counter() - t_start) / 60,
            "command": ".venv/bin/python benchmarks/gemma_cpu.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows, "oba": oba, "verify": ver, "lsp_probe": probe}, f, indent=1)
    if args.markdown:
        print("\n" + markdown(meta, rows, oba, ver, probe))


if __name__ == "__main__":
    main()
