"""One training step of `dblock train-tiny` (llada2_moe: the BD3 loss, forward and backward) with and without the
noisy copies of the all-prompt blocks (`diffusion_loss(..., trim=)`, dblock/tasks/train_loss.py): the same loss and
gradient (tests/tasks/test_train_long.py checks it), fewer rows.

    .venv/bin/python benchmarks/train_step_cpu.py --task exec:grammar=chain-k --repeats 5

Prints one markdown row: thread-CPU seconds per step (medians of interleaved repeats), their ratio, and the ratio of
rows in the forward (the bound if a step's cost were linear in its rows; attention is quadratic, so the measured
ratio may pass it). One torch thread; the batch and its noise are fixed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse(argv, doc: str, task: str) -> argparse.Namespace:
    """The options of the training-step benchmarks (this one and benchmarks/moe_train_cpu.py)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--task", default=task)
    ap.add_argument("--size", default="code")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    return ap.parse_args(argv)


def fixed_step(args) -> tuple:
    """(model, (x0, xt, masked, p, prompt)): a llada2_moe `train-tiny` model of `args.size` with fused attention
    and one fixed batch of `args.task` with fixed noise, on one torch thread."""
    from dblock.tasks.exec_task import exec_tokenizer
    from dblock.tasks.tokenizer import CharTokenizer
    from dblock.tasks.train_config import TrainConfig, is_exec_task
    from dblock.tasks.train_data import add_noise, batch_for_step, make_task
    from dblock.tasks.train_model import build_model, set_fused_attention

    torch.set_num_threads(1)
    cfg = TrainConfig(family="llada2_moe", out="/unused", size=args.size, task=args.task, block_size=32,
                      batch_size=args.batch, steps=10)
    tok = exec_tokenizer() if is_exec_task(args.task) else CharTokenizer()
    model = build_model(cfg, tok)
    set_fused_attention(model, True)
    x0, prompt = batch_for_step(make_task(cfg), tok, cfg, 5)
    xt, masked, p = add_noise(x0, prompt, model.config.mask_token_id, cfg.eps, torch.Generator().manual_seed(0))
    return model, (x0, xt, masked, p, prompt)


def main(argv=None) -> int:
    from dblock.tasks.train_loss import _prompt_blocks, diffusion_loss
    args = parse(argv, __doc__, "exec:grammar=chain-k")
    model, (x0, xt, masked, p, prompt) = fixed_step(args)
    L, d = x0.shape[1], _prompt_blocks(prompt, 32) * 32
    times = {False: [], True: []}
    for _ in range(args.repeats):
        for trim in (False, True):
            model.zero_grad()
            t = time.thread_time()
            loss, _ = diffusion_loss(model, x0, xt, masked, p, prompt, {}, trim=trim)
            loss.backward()
            times[trim].append(time.thread_time() - t)
    full, trimmed = statistics.median(times[False]), statistics.median(times[True])
    print("| task | size | batch | L | rows full / trimmed | step s full / trimmed (thread-CPU) | speedup | rows ratio |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.task} | {args.size} | {args.batch} | {L} | {2 * L} / {2 * L - d} | {full:.2f} / {trimmed:.2f} | "
          f"**{full / trimmed:.2f}x** | {2 * L / (2 * L - d):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
