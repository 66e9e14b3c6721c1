"""The data of a `dblock train-tiny` step, a pure function of (seed, step): the task's examples batched by length
(`rows_for_step`, `batch_for_step`), the code task's windows (`code_batch_for_step`, `code_rows_for_step`), the BD3
block size of the step (`block_size_at`), the masked-diffusion noise (`add_noise`) and the blocks trained with One
Block Ahead's warm-up view (`draw_warm_blocks`)."""
from __future__ import annotations

from typing import Optional

import torch

from dblock.tasks import CharTokenizer, get_task
from dblock.tasks.train_config import TrainConfig, is_code_task


def draw_warm_blocks(B: int, L: int, C: int, prob: float, gen: torch.Generator) -> torch.Tensor:
    """(B,) the block of each example trained with the warm-up view (uniform in 1..L/C - 1) with probability
    `prob`, else -1."""
    pick = torch.rand(B, generator=gen) < prob
    n_blocks = L // C
    w = torch.randint(1, max(2, n_blocks), (B,), generator=gen)
    return torch.where(pick & (n_blocks >= 2), w, torch.full_like(w, -1))


def make_task(cfg: TrainConfig):
    if is_code_task(cfg.task):
        return get_task(cfg.task)
    kw = {}
    if cfg.add_digits:
        kw["add_digits"] = tuple(cfg.add_digits)
    if cfg.rev_len:
        kw["rev_len"] = tuple(cfg.rev_len)
    if cfg.div_digits:
        kw["div_digits"] = tuple(cfg.div_digits)
    return get_task(cfg.task, **kw)


def task_for_step(task, cfg: TrainConfig, step: int):
    """The task the examples of `step` come from. With `curriculum_steps` K > 0, steps s < K draw from
    `task.capped(m)` (every size range's maximum lowered to m), m growing linearly from `curriculum_start` to the
    task's largest maximum over the K steps, by chunks of `length_chunk` steps (a chunk has one m): short operands
    first. A pure function of (cfg, step), so determinism and resumption are unchanged."""
    K = cfg.curriculum_steps
    if K <= 0 or step >= K:
        return task
    hi = max(r[1] for r in task.sizes().values())
    lo = min(max(1, cfg.curriculum_start), hi)
    first = (step // max(1, cfg.length_chunk)) * max(1, cfg.length_chunk)
    m = lo + (hi - lo + 1) * first // K
    return task if m >= hi else task.capped(m)


def _step_seed(seed: int, step: int, salt: int) -> int:
    return (int(seed) * 1_000_003 + int(step) * 7_919 + salt * 104_729) % (2 ** 63 - 1)


def encode_example(tok: CharTokenizer, ex) -> tuple[list, int]:
    """(ids of prompt + answer + <eos>, prompt length)."""
    p = tok.encode(ex.prompt)
    return p + tok.encode(ex.answer) + [tok.eos_id], len(p)


_CHUNK_CACHE: dict = {}


def rows_for_step(task, tok: CharTokenizer, cfg: TrainConfig, step: int) -> list:
    """The examples of optimizer step `step`: [(ids of prompt + answer + <eos>, prompt length)].

    Steps are grouped in chunks of `length_chunk`: the chunk's examples (the task's train stream at indices
    offset by the seed) are sorted by length and cut into batches, whose order inside the chunk is a seeded
    permutation -- less padding than random batches, same data, a pure function of (seed, step)."""
    B, n = cfg.batch_size, max(1, cfg.length_chunk)
    chunk, within = divmod(step, n)
    task = task_for_step(task, cfg, step)
    key = (task._seed_key, cfg.seed, B, n, chunk)
    if _CHUNK_CACHE.get("key") != key:
        base = cfg.seed * 1_000_000_000 + chunk * n * B
        encoded = [encode_example(tok, task.sample("train", base + i)) for i in range(n * B)]
        order = sorted(range(n * B), key=lambda i: (len(encoded[i][0]), i))
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(_step_seed(cfg.seed, chunk, 1))).tolist()
        _CHUNK_CACHE.update(key=key, batches=[[encoded[i] for i in order[j * B:(j + 1) * B]] for j in perm])
    return _CHUNK_CACHE["batches"][within]


def batch_for_step(task, tok: CharTokenizer, cfg: TrainConfig, step: int):
    """The clean llada2 batch of step `step`: x0 (B, L) int64, prompt (B, L) bool, L a multiple of C (the grid
    layout: the prompt at position 0 shares the first block), <eos> padding up to L."""
    rows = rows_for_step(task, tok, cfg, step)
    B, C = len(rows), cfg.block_size
    L = -(-max(len(ids) for ids, _ in rows) // C) * C
    x0 = torch.full((B, L), tok.eos_id, dtype=torch.long)
    prompt = torch.zeros(B, L, dtype=torch.bool)
    for b, (ids, P) in enumerate(rows):
        x0[b, :len(ids)] = torch.tensor(ids)
        prompt[b, :P] = True
    return x0, prompt


def code_batch_for_step(windows, cfg: TrainConfig, step: int):
    """The clean batch of step `step` on the code task: x0 (B, L = cfg.window) windows of the train split
    (`dblock.tasks.code_corpus.TrainWindows`) and `fixed` (B, L) bool, the rows kept clean and out of the loss.

    Every block of a window is trained (noised, and predicted from the clean blocks before it: BD3-LM), except that
    each example draws a prompt end P uniform in [0, L/2] and the rows of P's block before P stay clean -- the
    block that holds a prompt's tail at decoding time (the llada2 grid layout), whose first rows are fixed. A pure
    function of (seed, step)."""
    import numpy as np
    B, L, C = cfg.batch_size, cfg.window, cfg.block_size
    rng = np.random.default_rng(_step_seed(cfg.seed, step, 3))
    x0 = torch.tensor([windows.window(rng) for _ in range(B)], dtype=torch.long)
    P = rng.integers(0, L // 2 + 1, size=B)
    fixed = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate(P.tolist()):
        fixed[b, (p // C) * C:p] = True
    return x0, fixed


def parse_block_warmup(spec: Optional[str]) -> list:
    """'1:500,4:300' -> [(1, 500), (4, 300)]: train with block size 1 for 500 steps, then 4 for 300, then the
    model's block size. A ValueError names a bad item."""
    if not spec:
        return []
    out = []
    for item in spec.split(","):
        try:
            c, n = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--block-warmup {spec!r}: give BLOCK:STEPS,..., e.g. 1:500,4:300") from None
        if c < 1 or n < 1:
            raise ValueError(f"--block-warmup {spec!r}: {item!r} needs a block size >= 1 and steps >= 1")
        out.append((c, n))
    return out


def block_size_at(cfg: TrainConfig, step: int) -> int:
    """The BD3 block size of optimizer step `step`: LLaDA2.0's block-size warm-up (`block_warmup`: small blocks
    first -- block 1 is next-token prediction from a clean left context, the AR objective in the diffusion model's
    own no-shift form -- then larger ones), then `block_size`. A window length is a multiple of every block size
    used (checked when the run starts)."""
    at = 0
    for c, n in parse_block_warmup(cfg.block_warmup):
        at += n
        if step < at:
            return c
    return cfg.block_size


def code_rows_for_step(windows, cfg, step: int) -> list:
    """The examples of step `step` on the code task: [(ids, prompt length P)], each a training window
    (`dblock.tasks.code_corpus.TrainWindows`) with P uniform in [1, L/2], cut to P plus a whole number of canvases
    (so that no canvas is padded with an <eos> the file does not have). A pure function of (seed, step)."""
    import numpy as np

    B, L, C = cfg.batch_size, cfg.window, cfg.block_size
    rng = np.random.default_rng(_step_seed(cfg.seed, step, 3))
    rows = []
    for _ in range(B):
        w = windows.window(rng)
        P = int(rng.integers(1, L // 2 + 1))
        rows.append((w[:P + (L - P) // C * C], P))
    return rows


def add_noise(x0: torch.Tensor, prompt: torch.Tensor, mask_id: int, eps: float, gen: torch.Generator,
              suffix: float = 0.0):
    """Masked-diffusion forward process. Returns x_t, masked (B, L) bool, p (B,) fp32.

    `suffix` > 0 (`train-tiny --suffix-mask`): with that probability per example the mask is instead a suffix of the
    answer -- every answer position from a cut drawn uniformly over the answer on, none before it -- the state a
    block is in when it decodes a dependency chain left to right; its p is the masked share of the answer (so the
    loss weight Σ CE / p / answer length is the mean CE over the masked positions). With `suffix` 0 the draws are
    those of the plain process, so earlier runs reproduce."""
    B, L = x0.shape
    u = torch.rand((), generator=gen)
    t = (u + torch.arange(B, dtype=torch.float32)) / B            # stratified over the batch, in [0, 1)
    t = t[torch.randperm(B, generator=gen)]
    p = (1 - eps) * t + eps                                        # (B,)
    masked = (torch.rand(B, L, generator=gen) < p[:, None]) & ~prompt
    if suffix > 0:
        use = torch.rand(B, generator=gen) < suffix
        answer = ~prompt
        n_ans = answer.sum(1)                                       # (B,) answer positions (the prompt is a prefix)
        start = L - n_ans
        cut = start + (torch.rand(B, generator=gen) * n_ans).long()     # in [start, L)
        suf = (torch.arange(L)[None, :] >= cut[:, None]) & answer
        masked = torch.where(use[:, None], suf, masked)
        p = torch.where(use, (suf.sum(1) / n_ans.clamp(min=1)).float().clamp(min=eps), p)
    xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
    return xt, masked, p
