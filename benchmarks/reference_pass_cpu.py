"""One block of denoising passes through the dense reference executor (`dblock.reference.executor.LladaReference`),
three ways, interleaved on the same requests:

    copies   the earlier decoding attention (K and V copied once per query head, `repeat_interleave`, a new tensor
             for the scale and for the mask) and the committed caches stacked again on every pass
    grouped  the attention now in `dblock/reference/llada.py` (the query heads of one kv head stacked against its
             keys, the scale in place, the mask added as 0 / -inf made once per call: `attention_bias`), caches
             still stacked on every pass
    kept     grouped, and the stacked caches kept across the passes of the block (`PastStack`: no append happens
             between them), as the reference and the Epoch executor run now

Each request has a committed prompt of about `--prompt` tokens (cache lengths spread by up to 15, as a batch of real
prompts pads) and one block of 32 rows of which half are masked; a block is `--passes` denoising calls. The logits of
the three are compared bit for bit. Prints per configuration thread-CPU ms per pass (medians of interleaved
repeats), the ratio to `copies`, and the MoE modules' share of the pass (m: the larger it is, the more a skipped
expert row saves, docs/algorithms.md §4.1).

    .venv/bin/python benchmarks/reference_pass_cpu.py --repeats 5
    .venv/bin/python benchmarks/reference_pass_cpu.py --model code-masked --batch 64 --prompt 200

Ratios are taken within one run on one machine. Never used by tests.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dblock  # noqa: E402
from dblock.forward import Segment, StepInput, block_causal  # noqa: E402
from dblock.reference import llada  # noqa: E402
from dblock.reference.executor import LladaReference  # noqa: E402
from benchmarks.epoch_cpu import MoETimer  # noqa: E402

CONFIGS = ("copies", "grouped", "kept")


def attention_copies(self, x, positions, mask, past_k=None, past_v=None):
    """The earlier decoding attention: K and V copied per query head, new tensors for the scale and the mask."""
    B, L, _ = x.shape
    q, k, v = self.project_qkv(x, positions)
    keys = k if past_k is None else torch.cat([past_k, k], dim=2)
    vals = v if past_v is None else torch.cat([past_v, v], dim=2)
    rep = self.n_head // self.n_kv
    keys = keys.repeat_interleave(rep, dim=1)
    vals = vals.repeat_interleave(rep, dim=1)
    att = (q @ keys.transpose(-2, -1)).to(llada.up32(q.dtype)) / math.sqrt(self.head_dim)
    att = att.masked_fill(~mask[:, None], float("-inf"))
    att = torch.softmax(att, dim=-1).to(vals.dtype)
    y = (att @ vals).transpose(1, 2).reshape(B, L, self.n_head * self.head_dim)
    return self.wo(y), k, v


class StackEveryPass:
    """`PastStack` without keeping: the committed caches stacked on every call (the earlier executor)."""

    kept = False

    def get(self, items, make):
        return make()


def requests(model, batch: int, prompt: int, seed: int = 0):
    """(prompts, current blocks): token lists; prompt lengths prompt - 0..15, half of each block masked."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    V, C, M = cfg.vocab_size, cfg.block_size, cfg.mask_token_id
    prompts = [torch.randint(0, min(V, 60), (prompt - int(torch.randint(0, 16, (1,), generator=g)),),
                             generator=g) for _ in range(batch)]
    blocks = []
    for _ in range(batch):
        b = torch.randint(0, min(V, 60), (C,), generator=g)
        b[torch.randperm(C, generator=g)[:C // 2]] = M
        blocks.append(b)
    return prompts, blocks


def _seg(tokens, start, live_N, C):
    return Segment(block=start // C, tokens=tokens, positions=torch.arange(start, start + len(tokens)), live=live_N,
                   decoded=~live_N)


def run_block(model, config: str, prompts, blocks, passes: int, timer: MoETimer):
    """Append the prompts, then `passes` denoising calls of one block -> (thread-CPU s per pass, the last call's
    logits, MoE thread-CPU s per pass)."""
    attn_cls = llada.Attention
    saved = attn_cls.forward
    if config == "copies":
        attn_cls.forward = attention_copies
    try:
        fwd = LladaReference(model)
        if config != "kept":
            fwd.past_stack = StackEveryPass()
        caches = [fwd.new_cache() for _ in prompts]
        C, M = model.config.block_size, model.config.mask_token_id
        fwd.append([StepInput(i, [_seg(p, 0, torch.zeros(len(p), dtype=torch.bool), C)], block_causal(1), caches[i])
                    for i, p in enumerate(prompts)])
        items = [StepInput(i, [_seg(b, len(prompts[i]), b == M, C)], block_causal(1), caches[i])
                 for i, b in enumerate(blocks)]
        timer.moe, timer.on = 0.0, True
        c0 = time.thread_time()
        for _ in range(passes):
            out = fwd.denoise(items)
        cpu = (time.thread_time() - c0) / passes
        timer.on = False
        return cpu, torch.cat([o[0] for o in out]), timer.moe / passes
    finally:
        attn_cls.forward = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="code-masked", help="a llada2_moe / llada_moe folder or bundled name "
                                                           "(default code-masked: the code shape, 64 experts top-8)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=200, help="committed tokens per request (default 200: an exec "
                                                            "program)")
    ap.add_argument("--passes", type=int, default=8, help="denoising calls per block (default 8)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians reported")
    args = ap.parse_args()
    for flag, v in (("--batch", args.batch), ("--prompt", args.prompt), ("--passes", args.passes),
                    ("--repeats", args.repeats)):
        if v < 1:
            raise SystemExit(f"reference_pass_cpu.py: error: {flag} {v}: must be >= 1")
    torch.set_num_threads(1)
    model = dblock.load(args.model)
    if model.config.family not in ("llada2_moe", "llada_moe"):
        raise SystemExit(f"reference_pass_cpu.py: error: --model {args.model}: a llada2_moe or llada_moe model, not "
                         f"{model.config.family}")
    prompts, blocks = requests(model, args.batch, args.prompt)
    timer = MoETimer(model)
    cpu = {c: [] for c in CONFIGS}
    moe = {c: [] for c in CONFIGS}
    logits = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for c in CONFIGS:
                t, z, m = run_block(model, c, prompts, blocks, args.passes, timer)
                cpu[c].append(t)
                moe[c].append(m)
                logits[c] = z
    same = {c: torch.equal(logits[c], logits["copies"]) for c in CONFIGS}
    base = statistics.median(cpu["copies"])
    print(f"# reference_pass_cpu.py --model {args.model} --batch {args.batch} --prompt {args.prompt} "
          f"--passes {args.passes} --repeats {args.repeats}; torch {torch.__version__}, one thread")
    print("| config | CPU ms/pass | vs copies | MoE share m | logits = copies (bitwise) |")
    print("|---|---|---|---|---|")
    for c in CONFIGS:
        t = statistics.median(cpu[c])
        m = statistics.median(moe[c]) / t
        print(f"| {c} | {1e3 * t:.1f} | {base / t:.2f}x | {100 * m:.0f}% | {same[c]} |")


if __name__ == "__main__":
    main()
