"""One training step of `dblock train-tiny` (llada2_moe, the BD3 loss, forward and backward) with the routed experts
found per expert by a scan (`ids == e`, then `w_gate[e]`: the reference MoE's earlier loop) and by one stable sort
with the weights unbound once (`dblock.reference.llada.MoE.routed` now). The forward is the same bit for bit (the
same rows, in the same order, summed in the same order: checked here); backward differs only in the order the input
gradient's rows are summed.

    .venv/bin/python benchmarks/moe_train_cpu.py --repeats 5

Prints one markdown row: thread-CPU seconds per step (medians of interleaved repeats), their ratio, and the MoE
layers' share of the scan's step (the Amdahl bound of a faster MoE). One torch thread; the batch and its noise are
fixed. Never used by tests.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dblock.reference.llada import MoE, up32  # noqa: E402


def routed_scan(self, x_TH, ids_TK, w_TK):
    """The earlier loop: per expert, its rows by `(ids == e).nonzero()`, its weights by indexing (each index's
    backward adds a zero-filled (E, I, H) tensor)."""
    acc = up32(x_TH.dtype)
    out = torch.zeros(x_TH.shape, dtype=acc, device=x_TH.device)
    for e in ids_TK.unique().tolist():
        tok, slot = (ids_TK == e).nonzero(as_tuple=True)
        x = x_TH[tok]
        y = F.linear(F.silu(F.linear(x, self.w_gate[e])) * F.linear(x, self.w_up[e]), self.w_down[e])
        out.index_add_(0, tok, y.to(acc) * w_TK[tok, slot, None])
    return out.to(x_TH.dtype)


def main(argv=None) -> int:
    from benchmarks.train_step_cpu import fixed_step, parse
    from dblock.tasks.train_loss import diffusion_loss
    args = parse(argv, __doc__, "exec:grammar=chain-b")
    model, (x0, xt, masked, p, prompt) = fixed_step(args)
    sort = MoE.routed
    moe_s = [0.0]

    def timed(fn):
        def run(self, *a):
            t = time.thread_time()
            y = fn(self, *a)
            moe_s[0] += time.thread_time() - t
            return y
        return run

    def step(fn, grads: bool = True):
        MoE.routed = fn
        model.zero_grad()
        loss, _ = diffusion_loss(model, x0, xt, masked, p, prompt, {}, trim=True)
        if grads:
            loss.backward()
        return loss

    try:
        with torch.no_grad():
            same = torch.equal(step(routed_scan, False), step(sort, False))
        times = {"scan": [], "sort": []}
        for _ in range(args.repeats):
            for name, fn in (("scan", routed_scan), ("sort", sort)):
                t = time.thread_time()
                step(fn)
                times[name].append(time.thread_time() - t)
        moe_s[0] = 0.0
        t = time.thread_time()
        step(timed(routed_scan), grads=False)             # the MoE share of a forward (the backward is not split)
        share = moe_s[0] / (time.thread_time() - t)
    finally:
        MoE.routed = sort
    scan, srt = statistics.median(times["scan"]), statistics.median(times["sort"])
    print("| task | size | batch | step s scan / sort (thread-CPU) | speedup | forward loss identical | MoE share of "
          "the scan's forward |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.task} | {args.size} | {args.batch} | {scan:.2f} / {srt:.2f} | **{scan / srt:.2f}x** | {same} | "
          f"{100 * share:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
