"""How large a bound δ the margin-gated exact refresh needs (docs/algorithms.md §4.7), measured on the equivalence
suite's teacher-forced shadow run (`dblock verify`'s main run, gate off).

For every (pass, block) of the Epoch trajectory the shadow records ‖ẑ − z‖∞ over the block's live rows (Epoch logits
against the dense reference's on the same inputs) and the block's exact decision radius Γ* (min over its live rows).
This prints the distribution of the error on the approximate passes (hot: a cached row served or a restricted
support; the cold and refresh passes compute what full_compute computes) and, for a few bounds δ, the share of block
passes a gate of that bound would re-run (radius ≤ δ; the radius at the dense logits, which the gate approximates
with the radius at the Epoch logits) and the disagreeing block passes it would miss.

    .venv/bin/python benchmarks/margin_gate.py --n 50                 # the code-masked numbers of docs/algorithms.md §4.7

Never used by tests; no timing.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="code-masked", help="a bundled name or a trained model folder")
    ap.add_argument("--task", default=None, help="default: the task the model was trained on (its card)")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--epoch-config", default="epoch")
    ap.add_argument("--bounds", default="0.01,0.03,0.1,0.3,1,2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import dblock
    from dblock.decoding.generate import reference_forward
    from dblock.decoding.params import DecodeConfig
    from dblock.equivalence.audit import audited_epoch_forward
    from dblock.equivalence.shadow import ShadowForward, shadow_generate
    from dblock.errors import DblockError
    from dblock.tasks.card import decoding_of
    from dblock.tasks.evaluate import held_out_prompts

    try:
        model = dblock.load(args.model)
        task, tok, _, prompts = held_out_prompts(model, args.n, args.task)
    except DblockError as e:
        raise SystemExit(f"margin_gate.py: error: {e}") from None
    dec = DecodeConfig(max_new_tokens=getattr(task, "max_new_tokens", 128),
                       threshold_steps=decoding_of(model.source).get("threshold_steps"))
    sh = ShadowForward(audited_epoch_forward(model, args.epoch_config), reference_forward(model))
    shadow_generate(sh, prompts, dec, "native")
    rows = [{"path": r["path"], "dmax": max(r["delta"]), "gmin": min(r["gamma_exact"]), "agree": all(r["agree"])}
            for r in sh.rows if r.get("decision", True)]
    q = torch.tensor([0.5, 0.9, 0.99, 1.0], dtype=torch.float64)
    print(f"{args.model}, {task.name} n={args.n}, {args.epoch_config}: {len(rows)} block passes")
    for path in sorted({r["path"] for r in rows}):
        d = torch.tensor([r["dmax"] for r in rows if r["path"] == path], dtype=torch.float64)
        print(f"  {path:8s} {d.numel():5d} block passes  max_i ‖ẑ−z‖∞ p50/p90/p99/max "
              + " / ".join(f"{v:.3g}" for v in torch.quantile(d, q).tolist())
              + f"   disagreeing {sum(not r['agree'] for r in rows if r['path'] == path)}")
    g = torch.tensor([r["gmin"] for r in rows], dtype=torch.float64)
    print("  block radius min Γ* p10/p50/p90: "
          + " / ".join(f"{v:.3g}" for v in torch.quantile(g, torch.tensor([0.1, 0.5, 0.9],
                                                                              dtype=torch.float64)).tolist()))
    approx = [r for r in rows if r["path"] == "hot"]
    for delta in (float(x) for x in args.bounds.split(",")):
        re_run = sum(r["gmin"] <= delta for r in approx)
        missed = sum(not r["agree"] and r["gmin"] > delta for r in approx)
        print(f"  δ = {delta:<5g} re-runs {re_run / max(1, len(approx)):6.1%} of the approximate block passes, "
              f"misses {missed} disagreeing ones")


if __name__ == "__main__":
    main()
