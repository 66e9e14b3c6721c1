"""What determines a `dblock train-tiny` run: `TrainConfig` (stored in the checkpoint), the model sizes, the small
llada2_moe config they give, and the command line that reproduces a run bit for bit (`reproduce_command`)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Optional

from dblock.config import ModelConfig
from dblock.tasks import CharTokenizer, base_task

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
    # the same routing with narrow experts (a third of the code shape's expert compute per token): the exec models
    "exec": dict(hidden_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=384, moe_intermediate_size=32, num_experts=64, num_experts_per_tok=8,
                 num_shared_experts=1, first_k_dense_replace=1, n_group=8, topk_group=4),
    # the same routing at test scale (seconds per step)
    "code-micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, intermediate_size=64, moe_intermediate_size=8, num_experts=16,
                       num_experts_per_tok=4, num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2),
}

# the code shape with three layers (the dense first layer and two MoE layers): fewer dependency-chain hops per
# forward, so a block of a chain takes more passes (`--init-first-layers` starts it from a deeper model)
LLADA2_SIZES["code-3"] = dict(LLADA2_SIZES["code"], num_hidden_layers=3)


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
    init_first_layers: bool = False  # with init_from: take the source's first layers when the run has fewer
    noisy_context: float = 0.0       # probability per example that a block sees its predecessor still noisy (OBA's
                                     # warm-up block; see `noisy_context_mask` and train_uniform.uniform_loss)
    suffix_mask: float = 0.0         # llada2_moe: probability per example that the noise masks a suffix of the answer
                                     # instead of random positions (`train_data.add_noise`)
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


def is_code_task(name: str) -> bool:
    return base_task(name) == "code"


def is_exec_task(name: str) -> bool:
    return base_task(name) == "exec"


def reproduce_command(cfg: TrainConfig, total: int) -> str:
    """The `dblock train-tiny` command that reproduces this run bit for bit (fixed --steps, no --minutes)."""
    parts = ["dblock", "train-tiny", "--family", cfg.family, "--out", cfg.out, "--size", cfg.size,
             "--task", cfg.task, "--steps", str(total), "--seed", str(cfg.seed), "--batch-size", str(cfg.batch_size),
             "--lr", str(cfg.lr), "--warmup", str(cfg.warmup), "--block-size", str(cfg.block_size)]
    for flag, size_range in (("--add-digits", cfg.add_digits), ("--rev-len", cfg.rev_len),
                             ("--div-digits", cfg.div_digits)):
        if size_range:
            parts += [flag, "{},{}".format(*size_range)]
    if cfg.bias_update != TrainConfig.bias_update and cfg.family == "llada2_moe":    # DiffusionGemma has no bias
        parts += ["--bias-update", str(cfg.bias_update)]
    if cfg.min_lr_frac != TrainConfig.min_lr_frac:
        parts += ["--min-lr-frac", str(cfg.min_lr_frac)]
    if cfg.curriculum_steps:
        parts += ["--curriculum-steps", str(cfg.curriculum_steps), "--curriculum-start", str(cfg.curriculum_start)]
    if cfg.noisy_context:
        parts += ["--noisy-context", str(cfg.noisy_context)]
    if cfg.suffix_mask:
        parts += ["--suffix-mask", str(cfg.suffix_mask)]
    if cfg.init_from:
        parts += ["--init-from", cfg.init_from] + (["--init-first-layers"] if cfg.init_first_layers else [])
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
