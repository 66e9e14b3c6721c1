"""Train the tiny bundled models on CPU with their family's real objective (`dblock train-tiny`).

llada2_moe (masked block diffusion, LLaDA2 SFT + BD3-LM training):

  data     one example = prompt + answer + <eos>, the prompt at absolute position 0, then <eos> padding up to the
           batch length (a multiple of the block size C, >= the longest example of the batch). The padding is
           trained like any answer token (LLaDA SFT), so the model learns to emit <eos> and to fill the rest of
           the block with it; decoding stops at the first block holding an <eos>.
  noise    per example t ~ U(0,1) (stratified across the batch: t_i = (u + i)/B, MDLM's low-discrepancy sampler),
           p = (1 - eps) t + eps, every non-prompt token replaced by MASK iid with probability p. Prompt positions
           are never masked (they are fixed rows of the first block at inference too).
  loss     per example sum over masked positions of CE / p, divided by the example's answer-region length
           (answer + <eos> + padding), averaged over the batch -- LLaDA's SFT normalisation
           (docs/models.md).
  mask     BD3-LM: one forward over [x_t ; x_0] (2L rows, positions [0..L-1, 0..L-1]) with `bd3_mask`: a noisy
           block b sees itself and the clean blocks < b, a clean block b sees the clean blocks <= b. The block
           grid is on ABSOLUTE positions and the prompt shares the first block, exactly the llada2 grid layout
           of `dblock.decoding.schedules`, so decoding with the exact KV cache (clean blocks appended
           block-causally, the current block bidirectional) is in distribution. Loss on the noisy half only.
  routing  aux-loss-free load balancing (DeepSeek-V3): after each optimizer step, per MoE layer,
           expert_bias_e += u * sign(mean_load - load_e), loads counted from `taps["topk_ids"]` over every row
           of the step's forward (both halves).

diffusion_gemma (uniform-state + self-conditioning): see `dblock.tasks.train_uniform` (encoder causal pass +
decoder over every canvas, uniform replacement noise, two-pass self-conditioning, encoder AR loss, Switch aux loss).

Determinism: the examples and the noise of step s are pure functions of (seed, s) (examples come from the task's
hash-seeded train stream, noise from a torch.Generator seeded with (seed, s)), so the same seed and the same number
of steps give bit-identical weights, and a run resumed from a checkpoint equals the uninterrupted run.
Bit-identical needs the same torch build and thread count (default 1 thread: on the shared 2-core machine 2 threads
ran ~4x slower from oversubscription). Checkpoints (`DIR/train_state.pt`: model incl. expert bias, optimizer, step,
RNG, history) are written every `save_every` steps and at the end; the HF folder (config.json, model.safetensors,
tokenizer.json) is written at the end.

Options (TrainConfig; the defaults reproduce earlier runs bit for bit):
  curriculum     `curriculum_steps` K > 0: the first K steps draw from the task with its size maximum capped, the cap
                 growing from `curriculum_start` to the full size (`task_for_step`): short operands first.
  noisy context  `noisy_context` p > 0: with probability p per example one block is trained with One Block Ahead's
                 warm-up view, its predecessor still noisy (llada2_moe: `noisy_context_mask`, checked against the
                 reference executor's OBA pass in tests/tasks/test_train_long.py; diffusion_gemma: see
                 `dblock.tasks.train_uniform.uniform_loss`).
  evaluation     `eval_every` N > 0: every N steps and at the end, held-out accuracy (overall and by kind) and passes
                 per block of the first `eval_n` test problems, decoded as `dblock eval` does
                 (`eval_during_training`); in the summary's `evals`, not counted in the training time, and without
                 effect on the weights.
  schedule       linear warmup over `warmup` steps, cosine from `lr` down to `lr * min_lr_frac`.

Time budget: `--minutes N` without `--steps` times `calibrate_steps` steps (after 5 warm ones) and fixes the total
number of steps so the run fits N minutes (the cosine schedule needs a known length); the summary prints the equivalent
`--steps` command that reproduces the run bit for bit.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from dblock.config import ModelConfig
from dblock.tasks import CharTokenizer, get_task
from dblock.tasks.bd3 import bd3_mask

STATE_FILE = "train_state.pt"
SUMMARY_FILE = "train_summary.json"

# Model sizes. "small" is the bundled tiny-masked model; "micro" is for tests (seconds per step on CPU).
LLADA2_SIZES = {
    "small": dict(hidden_size=160, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                  intermediate_size=320, moe_intermediate_size=80, num_experts=16, num_experts_per_tok=4,
                  num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2),
    "base": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                 num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2),
    "micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                  num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2),
    # LLaDA2.0-mini's routing scaled down (64 experts top-8 in 8 groups keep 4, one shared expert, the first layer
    # dense): the bundled code-masked model, 10.5M parameters with the 2048-token code vocabulary
    "code": dict(hidden_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=384, moe_intermediate_size=96, num_experts=64, num_experts_per_tok=8,
                 num_shared_experts=1, first_k_dense_replace=1, n_group=8, topk_group=4),
    # the same routing at test scale (seconds per step)
    "code-micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, intermediate_size=64, moe_intermediate_size=8, num_experts=16,
                       num_experts_per_tok=4, num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2),
}


@dataclass
class TrainConfig:
    """Everything that determines a run (stored in the checkpoint; a resumed run uses the stored values)."""

    family: str = "llada2_moe"
    out: str = ""
    size: str = "base"               # key of LLADA2_SIZES
    task: str = "arith"              # a `get_task` name
    add_digits: Optional[tuple] = None  # ArithTask size ranges (None: the task's defaults)
    rev_len: Optional[tuple] = None
    div_digits: Optional[tuple] = None  # (arith-long's div)
    block_size: int = 16
    seed: int = 0
    steps: Optional[int] = None      # total optimizer steps (None: fixed from --minutes after calibration)
    minutes: Optional[float] = None  # wall budget used to choose `steps`
    calibrate_steps: int = 30       # steps timed (after 5 warm ones) to turn --minutes into --steps
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_frac: float = 0.05        # cosine decays to lr * min_lr_frac
    warmup: int = 100
    weight_decay: float = 0.05       # on matrices only (not norms, embeddings or the expert bias)
    grad_clip: float = 1.0
    eps: float = 1e-3                # p = (1 - eps) t + eps
    bias_update: float = 1e-3        # u of the aux-loss-free expert-bias update (0 disables it)
    length_chunk: int = 8            # batches of a chunk of this many steps are formed from examples sorted by length
    curriculum_steps: int = 0        # > 0: over the first steps, the task's size maximum grows from curriculum_start
    curriculum_start: int = 2        # (see `task_for_step`); 0 steps: the full task from step 0
    init_from: Optional[str] = None  # start from this model's weights (a HF folder or bundled name of the same family
                                     # and size) instead of the seeded init: a second stage of a recipe
    noisy_context: float = 0.0       # probability per example that a block sees its predecessor still noisy (OBA's
                                     # warm-up block; see `noisy_context_mask` and train_uniform.uniform_loss)
    eval_every: int = 0              # > 0: held-out accuracy every this many steps (and at the end), in `evals`
    eval_n: int = 64                 # test problems per in-training evaluation
    vocab_size: int = 2048           # task `code`: the byte-level BPE's vocabulary (dblock.tasks.code_corpus)
    tokenizer: Optional[str] = None  # task `code`: take tokenizer.json from this folder instead of building it
    window: int = 288                # task `code`: tokens per training window (a multiple of the block size)
    save_dtype: Optional[str] = None  # store the exported weights in this dtype (e.g. "bfloat16"; config.json then
                                     # names float32 as the dtype to compute in); the training state stays fp32
    block_warmup: Optional[str] = None  # "1:500,4:300": BD3 block sizes of the first steps (`block_size_at`)
    fused_attention: bool = False    # attention by torch's scaled_dot_product_attention in training (the same
                                     # function, fused: ~1.6x faster steps; default off reproduces earlier runs)
    save_every: int = 200
    log_every: int = 10
    threads: int = 1                 # 1: on the shared 2-core box 2 threads ran 4x slower (oversubscription)
    progress: bool = True


# ---------------------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------------------

def llada2_config(size: str = "base", block_size: int = 16, tokenizer=None) -> ModelConfig:
    """A small llada2_moe config over the character tokenizer: every structural feature of LLaDA2.0 (GQA, partial
    rotary 0.5, QK-norm, a dense first layer, sigmoid group-limited routing with an expert bias, a shared expert)."""
    if size not in LLADA2_SIZES:
        raise ValueError(f"--size {size!r}: allowed {', '.join(LLADA2_SIZES)}")
    tok = tokenizer or CharTokenizer()
    return ModelConfig(
        family="llada2_moe", model_type="llada2_moe", vocab_size=tok.vocab_size, **LLADA2_SIZES[size],
        routed_scaling_factor=2.5, score_function="sigmoid", use_expert_bias=True, norm_topk_prob=True,
        partial_rotary_factor=0.5, rope_theta=10000.0, use_qk_norm=True, rms_norm_eps=1e-6,
        mask_token_id=tok.mask_id, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id, block_size=block_size,
        max_position_embeddings=4096,
    ).validate("train-tiny config")


def init_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """GPT-2 style init, deterministic in `seed`: N(0, std) matrices and embeddings, output projections (attention
    `wo`, MLP/expert `down`) scaled by 1/sqrt(2 n_layers), norms 1, expert bias 0."""
    g = torch.Generator().manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            s = std
            if name.endswith(("wo.weight", "down.weight", "w_down")):
                s = std / math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=g) * s)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias") and b is not None:
                b.zero_()


def build_model(cfg: TrainConfig, tok=None) -> torch.nn.Module:
    """The seeded model of a run; `tok` (the run's tokenizer) sets the vocabulary and special ids (default: the
    character tokenizer)."""
    if cfg.family == "diffusion_gemma":
        from dblock.tasks.train_uniform import build_gemma
        model = build_gemma(cfg, tok)
    else:
        from dblock.reference.llada import LladaModel
        model = LladaModel(llada2_config(cfg.size, cfg.block_size, tok))
        init_weights(model, cfg.seed)
    if cfg.fused_attention:
        set_fused_attention(model, True)
    return model


def set_fused_attention(model, on: bool) -> None:
    """Training-time attention through torch's fused `scaled_dot_product_attention` (the same function as the
    reference's explicit softmax, computed in another order): `fused` on every attention module that has it."""
    for mod in model.modules():
        if hasattr(mod, "fused"):
            mod.fused = bool(on)


def make_tokenizer(cfg: TrainConfig, run_dir: str, resume: bool):
    """The run's tokenizer: the character tokenizer, or for task `code` the byte-level BPE -- read back from the run
    folder on --resume, taken from --tokenizer (or the --init-from model's folder), else built from the corpus --
    and written into the run folder so that a resumed run uses the very same one."""
    if not is_code_task(cfg.task):
        return CharTokenizer()
    from dblock.tasks.code_corpus import CodeTokenizer
    if resume:
        return CodeTokenizer.load(run_dir)
    source = cfg.tokenizer
    if source is None and cfg.init_from:
        from dblock.weights_path import resolve_model_path
        source = resolve_model_path(cfg.init_from)
    tok = CodeTokenizer.load(source) if source else CodeTokenizer.build(cfg.vocab_size)
    tok.save(run_dir)
    return tok


def is_code_task(name: str) -> bool:
    return name.partition(":")[0] == "code"


# ---------------------------------------------------------------------------------------------------------------
# the BD3-LM training mask and the data
# ---------------------------------------------------------------------------------------------------------------

def noisy_context_mask(L: int, C: int, warm: torch.Tensor) -> torch.Tensor:
    """(B, 2L, 2L) BD3 masks where, in example b, the noisy block `warm[b]` (>= 1; -1: none) gets One Block Ahead's
    warm-up view: it sees the NOISY block warm[b] - 1 (its x_t rows, which see only the clean blocks before them, as
    the current block does) instead of the clean one, as the warm-up block sees the still-masked current block
    (docs/algorithms.md, One Block Ahead). Every other block keeps the plain BD3 view."""
    base = bd3_mask(L, C)
    B = warm.shape[0]
    if not bool((warm >= 1).any()):
        return base[None].expand(B, 2 * L, 2 * L)
    idx = torch.arange(2 * L)
    half, blk = idx // L, (idx % L) // C
    row_warm = (half[None, :] == 0) & (blk[None, :] == warm[:, None])                    # (B, 2L) query rows
    prev = blk[None, :] == blk[:, None] - 1                                              # (2L, 2L)
    swap_in = prev & (half[None, :] == 0)                                                # keys: noisy prev block
    swap_out = prev & (half[None, :] == 1)                                               # keys: clean prev block
    warm_view = (base & ~swap_out) | swap_in
    return torch.where(row_warm[:, :, None], warm_view[None], base[None])


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


def add_noise(x0: torch.Tensor, prompt: torch.Tensor, mask_id: int, eps: float, gen: torch.Generator):
    """Masked-diffusion forward process. Returns x_t, masked (B, L) bool, p (B,) fp32."""
    B, L = x0.shape
    u = torch.rand((), generator=gen)
    t = (u + torch.arange(B, dtype=torch.float32)) / B            # stratified over the batch, in [0, 1)
    t = t[torch.randperm(B, generator=gen)]
    p = (1 - eps) * t + eps                                        # (B,)
    masked = (torch.rand(B, L, generator=gen) < p[:, None]) & ~prompt
    xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
    return xt, masked, p


def diffusion_loss(model, x0, xt, masked, p, prompt, taps=None, warm=None, block_size=None):
    """LLaDA SFT loss with the BD3 mask: mean over examples of sum_masked CE/p / answer-region length.
    `warm` (B,) long: per example the block trained with the warm-up view (`noisy_context_mask`), -1 none.
    `block_size`: the BD3 block of this step (default the model's; see `block_size_at`)."""
    B, L = x0.shape
    C = block_size or model.config.block_size
    tokens = torch.cat([xt, x0], dim=1)                                   # (B, 2L)
    positions = torch.arange(L).repeat(2)[None].expand(B, 2 * L)          # (B, 2L)
    if warm is None:
        mask = bd3_mask(L, C)[None].expand(B, 2 * L, 2 * L)               # (B, 2L, 2L)
    else:
        mask = noisy_context_mask(L, C, warm)
    hidden, _ = model(tokens, positions, mask, taps=taps)
    rows = hidden[:, :L][masked]                                          # (M, H) masked noisy rows
    logits = model.logits(rows)                                           # (M, V) fp32
    ce = F.cross_entropy(logits, x0[masked], reduction="none")            # (M,)
    ex = masked.nonzero(as_tuple=True)[0]                                 # example of each masked row
    w = 1.0 / (p[ex] * (~prompt).sum(1).clamp(min=1)[ex].float())         # 1/p / answer-region length
    loss = (ce * w).sum() / B
    with torch.no_grad():
        acc = (logits.argmax(-1) == x0[masked]).float().mean() if ce.numel() else torch.tensor(0.0)
        raw = ce.mean() if ce.numel() else torch.tensor(0.0)
    return loss, {"ce": float(raw), "acc": float(acc), "masked": int(masked.sum())}


# ---------------------------------------------------------------------------------------------------------------
# expert load balancing
# ---------------------------------------------------------------------------------------------------------------

def expert_loads(model, taps: dict) -> torch.Tensor:
    """(n_moe_layers, E) int64 counts of (token, expert) assignments of the last forward."""
    E = model.config.num_experts
    return torch.stack([torch.bincount(ids.reshape(-1), minlength=E) for ids in taps.get("topk_ids", [])])


def update_expert_bias(model, loads: torch.Tensor, u: float) -> None:
    """DeepSeek-V3 aux-loss-free update: bias_e += u * sign(mean load - load_e), per MoE layer."""
    if u <= 0:
        return
    moes = [layer.mlp for layer in model.layers if layer.is_moe]
    with torch.no_grad():
        for moe, load in zip(moes, loads):
            load = load.float()
            moe.expert_bias += u * torch.sign(load.mean() - load)


def balance_stats(loads: torch.Tensor) -> dict:
    """Per MoE layer: max/mean load and coefficient of variation, from (n_layers, E) counts."""
    loads = loads.double()
    mean = loads.mean(1, keepdim=True).clamp(min=1e-12)
    frac = loads / loads.sum(1, keepdim=True).clamp(min=1e-12)
    return {"max_over_mean": [round(float(x), 3) for x in (loads.max(1).values / mean[:, 0])],
            "min_over_mean": [round(float(x), 3) for x in (loads.min(1).values / mean[:, 0])],
            "cv": [round(float(x), 3) for x in (loads.std(1) / mean[:, 0])],
            "fraction": [[round(float(v), 4) for v in row] for row in frac]}


# ---------------------------------------------------------------------------------------------------------------
# optimizer, schedule, checkpoints
# ---------------------------------------------------------------------------------------------------------------

def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in sorted(model.named_parameters()):
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine down to lr * min_lr_frac at `total`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def _atomic_save(obj, path: str) -> None:
    """torch.save to `path`.tmp, then renamed over `path`; on any failure (a full disk) the .tmp is removed and
    `path` keeps the previous checkpoint."""
    import io

    from dblock.errors import write_failure
    tmp = path + ".tmp"
    try:
        buf = io.BytesIO()          # serialised first, so that a failed write is an OSError with its errno
        torch.save(obj, buf)
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.remove(tmp)
        if isinstance(e, (OSError, RuntimeError)):     # torch.save: "[enforce fail ...] file write failed"
            raise write_failure(path, e) from None
        raise


def save_state(path: str, model, opt, cfg: TrainConfig, step: int, total: Optional[int], elapsed: float,
               history: list, loads_acc: torch.Tensor, evals: Optional[list] = None) -> None:
    _atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "total_steps": total,
                  "config": asdict(cfg), "elapsed_s": elapsed, "history": history, "loads": loads_acc,
                  "torch_rng": torch.get_rng_state(), "evals": evals or []}, path)


def recent_loss(history: list) -> Optional[float]:
    return history[-1]["loss"] if history else None


def eval_during_training(model, task, tok: CharTokenizer, cfg: TrainConfig, step: int,
                         loss: Optional[float] = None) -> dict:
    """Held-out accuracy of the model being trained: the first `eval_n` test problems of the task, decoded with the
    family's default rule (threshold 0.95 for llada2_moe, entropy-bound seed 0 for diffusion_gemma; reference
    executor, native schedule), as `dblock eval` does. The training RNG state and mode are restored, so a run with
    evaluations has the same weights as one without."""
    from dblock.decoding.params import DecodeConfig
    from dblock.tasks.evaluate import evaluate
    rule = "entropy-bound" if cfg.family == "diffusion_gemma" else "threshold"
    rng = torch.get_rng_state()
    t0 = time.perf_counter()
    model.eval()
    code = is_code_task(cfg.task)
    fused = [m for m in model.modules() if getattr(m, "fused", False)]
    set_fused_attention(model, False)          # decode exactly as `dblock eval` does
    try:
        dec = DecodeConfig(rule=rule, max_new_tokens=64) if code else DecodeConfig(rule=rule)
        r = evaluate(model, task, n=cfg.eval_n, dec=dec, tokenizer=tok)
    finally:
        for m in fused:
            m.fused = True
        model.train()
        torch.set_rng_state(rng)
    if code:
        return {"step": step, "loss": loss, "accuracy": round(r["accuracy"], 4),
                "accuracy_by_kind": {k: round(v, 4) for k, v in r["accuracy_by_kind"].items()},
                **{k: round(m["mean"], 4) for k, m in r["metrics"].items()},
                "passes_per_block_mean": round(r["passes_per_block_mean"], 3), "TPF": round(r["TPF"], 3),
                "eval_s": round(time.perf_counter() - t0, 1)}
    return {"step": step, "loss": loss, "accuracy": round(r["accuracy"], 4),
            "accuracy_by_kind": {k: round(v, 4) for k, v in r["accuracy_by_kind"].items()},
            "passes_per_block_mean": round(r["passes_per_block_mean"], 3),
            "passes_per_block_mean_by_kind": {k: round(v, 3) for k, v in r["passes_per_block_mean_by_kind"].items()},
            "eval_s": round(time.perf_counter() - t0, 1)}


def reproduce_command(cfg: TrainConfig, total: int) -> str:
    """The `dblock train-tiny` command that reproduces this run bit for bit (fixed --steps, no --minutes)."""
    parts = ["dblock", "train-tiny", "--family", cfg.family, "--out", cfg.out, "--size", cfg.size,
             "--task", cfg.task, "--steps", str(total), "--seed", str(cfg.seed), "--batch-size", str(cfg.batch_size),
             "--lr", str(cfg.lr), "--warmup", str(cfg.warmup), "--block-size", str(cfg.block_size)]
    if cfg.add_digits:
        parts += ["--add-digits", "{},{}".format(*cfg.add_digits)]
    if cfg.rev_len:
        parts += ["--rev-len", "{},{}".format(*cfg.rev_len)]
    if cfg.div_digits:
        parts += ["--div-digits", "{},{}".format(*cfg.div_digits)]
    if cfg.bias_update != TrainConfig.bias_update:
        parts += ["--bias-update", str(cfg.bias_update)]
    if cfg.min_lr_frac != TrainConfig.min_lr_frac:
        parts += ["--min-lr-frac", str(cfg.min_lr_frac)]
    if cfg.curriculum_steps:
        parts += ["--curriculum-steps", str(cfg.curriculum_steps), "--curriculum-start", str(cfg.curriculum_start)]
    if cfg.noisy_context:
        parts += ["--noisy-context", str(cfg.noisy_context)]
    if cfg.init_from:
        parts += ["--init-from", cfg.init_from]
    if is_code_task(cfg.task):
        parts += ["--window", str(cfg.window)]
        parts += ["--tokenizer", cfg.tokenizer] if cfg.tokenizer else ["--vocab-size", str(cfg.vocab_size)]
    if cfg.fused_attention:
        parts += ["--fused-attention"]
    if cfg.block_warmup:
        parts += ["--block-warmup", cfg.block_warmup]
    if cfg.save_dtype:
        parts += ["--save-dtype", cfg.save_dtype]
    return " ".join(shlex.quote(p) for p in parts)


# ---------------------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------------------

def train(cfg: TrainConfig, resume: bool = False, stop_after: Optional[int] = None, log=print,
          overwrite: bool = False) -> dict:
    """Train (or resume) and write DIR/train_state.pt plus the HF folder in DIR. Returns the run summary.

    `stop_after`: stop (with a checkpoint, without the final export) once this many steps are done -- for tests
    of resumption and for splitting a long run.

    The output folder DIR (`cfg.out`): a new run needs it missing or empty -- a folder holding anything is an
    OutputExistsError before any compute -- unless `overwrite=True`. Then the run works in a hidden folder beside
    DIR (`.dblock-train-*`) and replaces DIR as a whole only when it ends (export, or `stop_after`'s checkpoint);
    if it fails or is interrupted, that folder is deleted and DIR is as it was. `resume` continues in DIR itself
    (with `overwrite` it is a ConfigError). The final export replaces DIR all or nothing (`export`): no old file of
    the folder's weights or tokenizer survives beside the new ones.
    """
    if cfg.family not in ("llada2_moe", "diffusion_gemma"):
        raise ValueError(f"--family {cfg.family}: train-tiny supports llada2_moe, diffusion_gemma")
    if not cfg.out:
        raise ValueError("--out: give an output folder")
    if is_code_task(cfg.task) and (cfg.window <= 0 or cfg.window % cfg.block_size):
        raise ValueError(f"--window {cfg.window}: must be a positive multiple of --block-size {cfg.block_size}")
    for c, _ in parse_block_warmup(cfg.block_warmup):
        if cfg.family != "llada2_moe":
            raise ValueError("--block-warmup: llada2_moe only")
        if cfg.block_size % c:
            raise ValueError(f"--block-warmup {cfg.block_warmup}: block size {c} does not divide --block-size "
                             f"{cfg.block_size}")
    if not resume and cfg.steps is None and cfg.minutes is None:
        raise ValueError("give --steps or --minutes")
    if cfg.steps is not None and cfg.steps <= 0 or cfg.minutes is not None and cfg.minutes <= 0:
        raise ValueError("--steps and --minutes must be positive")
    if cfg.batch_size <= 0:
        raise ValueError("--batch-size must be positive")
    created = not os.path.exists(cfg.out)
    run_dir, staged = _run_folder(cfg.out, resume, overwrite)
    try:
        return _train(cfg, resume, stop_after, log, run_dir, staged)
    except BaseException:
        if staged or (created and not os.path.exists(os.path.join(run_dir, STATE_FILE))):
            shutil.rmtree(run_dir, ignore_errors=True)      # nothing to resume from: leave nothing behind
        raise


def init_from_model(model: torch.nn.Module, source: str) -> None:
    """Copy the weights (and the expert bias) of the model at `source` into `model`; a ConfigError naming the
    first differing config field when the two are not the same architecture."""
    from dblock.errors import ConfigError
    from dblock.weights import load
    src = load(source)
    a, b = src.config, model.config
    for field in ("family", "vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "moe_intermediate_size"):
        if getattr(a, field, None) != getattr(b, field, None):
            raise ConfigError(f"--init-from {source}: {field} is {getattr(a, field, None)!r} there, "
                              f"{getattr(b, field, None)!r} for this run (family and --size must match)")
    model.load_state_dict(src.state_dict())


def _run_folder(out: str, resume: bool, overwrite: bool) -> tuple:
    """(the folder the run writes its checkpoints in, whether it is a staging folder beside `out`)."""
    from dblock.errors import ConfigError
    from dblock.weights_write import check_out_dir, new_dir
    if resume:
        if overwrite:
            raise ConfigError(f"--overwrite with --resume: --resume continues the run in {out}, --overwrite "
                              "would replace it; give one of them")
        return out, False
    if check_out_dir(out, overwrite):      # holds something, and overwrite=True
        parent = os.path.dirname(os.path.abspath(out))
        return new_dir(parent, ".dblock-train-"), True
    os.makedirs(out, exist_ok=True)
    return out, False


def _train(cfg: TrainConfig, resume: bool, stop_after: Optional[int], log, run_dir: str, staged: bool) -> dict:
    torch.set_num_threads(max(1, cfg.threads))
    state_path = os.path.join(run_dir, STATE_FILE)

    step, total, elapsed_before, history, evals = 0, cfg.steps, 0.0, [], []
    state = None
    if resume:
        if not os.path.isfile(state_path):
            raise FileNotFoundError(f"--resume: no checkpoint {state_path}")
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        stored = TrainConfig(**{**state["config"], "out": cfg.out, "progress": cfg.progress,
                                "threads": cfg.threads,
                                "save_dtype": cfg.save_dtype or state["config"].get("save_dtype")})
        cfg = stored
        step, total = state["step"], state["total_steps"]
        elapsed_before, history = state["elapsed_s"], state["history"]
        evals = state.get("evals", [])
    task = make_task(cfg)
    tok = make_tokenizer(cfg, run_dir, resume)
    windows = None
    if is_code_task(cfg.task):
        from dblock.tasks.code_corpus import TrainWindows
        windows = TrainWindows(tok, cfg.window)
    uniform = cfg.family == "diffusion_gemma"
    if uniform:
        from dblock.tasks.train_uniform import uniform_loss
    model = build_model(cfg, tok)
    opt = make_optimizer(model, cfg)
    n_moe = len(model.config.moe_layers)
    loads_acc = torch.zeros(n_moe, model.config.num_experts, dtype=torch.float64)  # EMA (0.99) of the loads
    if state is None and cfg.init_from:
        init_from_model(model, cfg.init_from)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loads_acc = state["loads"]
        torch.set_rng_state(state["torch_rng"])
    model.train()

    n_params = sum(p.numel() for p in model.parameters())
    log(f"train-tiny: {cfg.family} size={cfg.size} params={n_params:,} task={cfg.task} block={cfg.block_size} "
        f"batch={cfg.batch_size} seed={cfg.seed} " + (f"resuming at step {step}" if resume else
                                                     f"from {cfg.init_from}" if cfg.init_from else "from scratch"))

    bar = None
    if cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=step, unit="step", desc="train-tiny", dynamic_ncols=True,
                   file=sys.stderr, mininterval=2.0)
    t_start = time.perf_counter()
    start_step = last_save = step
    recent, t_cal = [], None
    while total is None or step < total:
        if stop_after is not None and step >= stop_after:
            break
        gen = torch.Generator().manual_seed(_step_seed(cfg.seed, step, 2))
        lr = lr_at(step, cfg, total if total is not None else 10 ** 9)
        for g in opt.param_groups:
            g["lr"] = lr
        taps = {}
        if uniform:
            rows = (code_rows_for_step(windows, cfg, step) if windows is not None else
                    rows_for_step(task, tok, cfg, step))
            loss, info = uniform_loss(model, rows, gen, taps, noisy_context=cfg.noisy_context)
        else:
            x0, prompt = (code_batch_for_step(windows, cfg, step) if windows is not None else
                          batch_for_step(task, tok, cfg, step))
            xt, masked, p = add_noise(x0, prompt, model.config.mask_token_id, cfg.eps, gen)
            warm = (draw_warm_blocks(x0.shape[0], x0.shape[1], cfg.block_size, cfg.noisy_context, gen)
                    if cfg.noisy_context > 0 else None)
            loss, info = diffusion_loss(model, x0, xt, masked, p, prompt, taps, warm=warm,
                                        block_size=block_size_at(cfg, step))
            info["L"] = int(x0.shape[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loads = expert_loads(model, taps)
        if not uniform:
            update_expert_bias(model, loads, cfg.bias_update)
        loads_acc = loads_acc * 0.99 + loads.double()
        step += 1
        recent.append((loss.item(), info["ce"], info["acc"], info.get("ar", 0.0), info.get("aux", 0.0)))
        if step % cfg.log_every == 0 or step == total:
            m = [sum(x) / len(recent) for x in zip(*recent)]
            rec = {"step": step, "loss": round(m[0], 4), "ce": round(m[1], 4), "acc": round(m[2], 4),
                   "lr": round(lr, 6), "grad_norm": round(float(gnorm), 3), "L": int(info["L"]),
                   "elapsed_s": round(elapsed_before + time.perf_counter() - t_start, 1)}
            if uniform:
                rec.update(ar=round(m[3], 4), aux=round(m[4], 4))
            history.append(rec)
            recent = []
            if bar is not None:
                bar.set_postfix(loss=f"{m[0]:.3f}", ce=f"{m[1]:.3f}", acc=f"{m[2]:.3f}", lr=f"{lr:.1e}")
        if bar is not None:
            bar.update(1)
        if total is None and step == start_step + 5:
            t_cal = time.perf_counter()          # the first steps are slower (allocator, caches): skip them
        if total is None and step == start_step + 5 + cfg.calibrate_steps:
            per_step = (time.perf_counter() - t_cal) / cfg.calibrate_steps
            spent = elapsed_before + time.perf_counter() - t_start
            total = max(step + 1, step + int((cfg.minutes * 60 - spent) / per_step))
            log(f"train-tiny: {per_step:.2f} s/step over {cfg.calibrate_steps} steps -> {total} steps "
                f"for {cfg.minutes} min")
            if bar is not None:
                bar.total = total
                bar.refresh()
        if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == total) and \
                not any(e["step"] == step for e in evals):
            t_ev = time.perf_counter()
            evals.append(eval_during_training(model, task, tok, cfg, step, recent_loss(history)))
            dt = time.perf_counter() - t_ev            # evaluation time is not training time
            t_start += dt
            t_cal = None if t_cal is None else t_cal + dt
            log(f"train-tiny: eval at step {step}: " + json.dumps(evals[-1]))
        if step - last_save >= cfg.save_every:
            save_state(state_path, model, opt, cfg, step, total, elapsed_before + time.perf_counter() - t_start,
                       history, loads_acc, evals)
            last_save = step
    if bar is not None:
        bar.close()
    elapsed = elapsed_before + time.perf_counter() - t_start
    save_state(state_path, model, opt, cfg, step, total, elapsed, history, loads_acc, evals)
    summary = {"steps_done": step, "total_steps": total, "wall_s": round(elapsed, 1), "params": n_params,
               "config": asdict(cfg), "reproduce": reproduce_command(cfg, total) if total else None,
               "final": history[-1] if history else None, "evals": evals,
               "expert_balance_ema": balance_stats(loads_acc) if loads_acc.sum() > 0 else None,
               "expert_bias_range": None if uniform else [[round(float(layer.mlp.expert_bias.min()), 4),
                                                           round(float(layer.mlp.expert_bias.max()), 4)]
                                                          for layer in model.layers if layer.is_moe]}
    if total is not None and step >= total:
        # DIR holds this run's checkpoint (a staging run: nothing of the old DIR is carried)
        export(model, cfg.out, tok, extra={SUMMARY_FILE: json.dumps({**summary, "history": history}, indent=1)},
               carry_from=run_dir, overwrite=True, storage_dtype=cfg.save_dtype)
        if staged:
            shutil.rmtree(run_dir, ignore_errors=True)
        log(f"train-tiny: done, {step} steps in {elapsed / 60:.1f} min; wrote {cfg.out} "
            f"(reproduce: {summary['reproduce']})")
    elif staged:                      # stopped early: the checkpoint alone replaces DIR
        from dblock.weights_write import publish
        publish(run_dir, cfg.out, overwrite=True)
    return summary


def _is_weights(name: str) -> bool:
    return name.endswith(".safetensors") or name == "model.safetensors.index.json"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def export(model, out: str, tok, extra: Optional[dict] = None, carry_from: Optional[str] = None,
           overwrite: bool = False, storage_dtype: Optional[str] = None) -> None:
    """The HF folder `out`, written all or nothing (`dblock.weights_write.staged_folder`): config.json + model.safetensors
    (+ the files transformers reads, e.g. DiffusionGemma's generation_config.json), tokenizer.json +
    tokenizer_config.json and `extra` ({name: text}).

    `carry_from`: a folder whose other entries (the run's train_state.pt, a model card) are carried into the new
    folder -- never weights (*.safetensors, the index) nor anything the export writes itself, nor *.tmp leftovers.
    `out` must be missing or empty unless `overwrite` (then the whole folder is replaced)."""
    from dblock.tiny import hf_files
    from dblock.weights_write import staged_folder, write_model
    model.eval()
    with staged_folder(out, overwrite) as tmp:
        write_model(model, tmp, extra_files={**hf_files(model), **(extra or {})}, storage_dtype=storage_dtype)
        tok.save(tmp)
        if carry_from is not None and os.path.isdir(carry_from):
            for name in sorted(os.listdir(carry_from)):
                src, dst = os.path.join(carry_from, name), os.path.join(tmp, name)
                if _is_weights(name) or name.endswith(".tmp") or os.path.lexists(dst):
                    continue
                if os.path.islink(src):
                    os.symlink(os.readlink(src), dst)
                elif os.path.isdir(src):
                    shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(src, dst)
