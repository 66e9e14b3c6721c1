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
ran ~4x slower from oversubscription). Checkpoints (`DIR/train_state.st`, `dblock.tasks.train_state`: model incl.
expert bias, optimizer, step, RNG, history; safetensors and JSON, no pickle) are written every `save_every` steps and
at the end; the HF folder (config.json, model.safetensors, tokenizer.json) is written at the end.

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

Layout: what determines a run in `dblock.tasks.train_config`, its model and tokenizer in `train_model`, the data
and noise of a step in `train_data`, the llada2_moe objective and the expert balancing in `train_loss`, the final
HF folder in `train_export`; this module is the loop with its optimizer, schedule, checkpoints and in-training
evaluation.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from typing import Optional

import torch

from dblock.tasks import CharTokenizer, train_state
from dblock.tasks.train_config import TrainConfig, is_code_task, is_exec_task, reproduce_command
from dblock.tasks.train_data import (_step_seed, add_noise, batch_for_step, block_size_at, code_batch_for_step,
                                     code_rows_for_step, draw_warm_blocks, make_task, parse_block_warmup,
                                     rows_for_step)
from dblock.tasks.train_export import export
from dblock.tasks.train_loss import balance_stats, diffusion_loss, expert_loads, update_expert_bias
from dblock.tasks.train_model import build_model, init_from_model, make_tokenizer, set_fused_attention

STATE_FILE = train_state.STATE_FILE
SUMMARY_FILE = "train_summary.json"


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


def save_state(path: str, model, opt, cfg: TrainConfig, step: int, total: Optional[int], elapsed: float,
               history: list, loads_acc: torch.Tensor, evals: Optional[list] = None) -> None:
    """The run's training state, all or nothing (`dblock.tasks.train_state`: safetensors + JSON, no pickle)."""
    train_state.save(path, model, opt, cfg, step, total, elapsed, history, loads_acc, evals)


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
    code = is_code_task(cfg.task) or is_exec_task(cfg.task)
    fused = [m for m in model.modules() if getattr(m, "fused", False)]
    set_fused_attention(model, False)          # decode exactly as `dblock eval` does
    try:
        dec = (DecodeConfig(rule=rule, max_new_tokens=getattr(task, "max_new_tokens", 64)) if code else
               DecodeConfig(rule=rule))
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


# ---------------------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------------------

def train(cfg: TrainConfig, resume: bool = False, stop_after: Optional[int] = None, log=print,
          overwrite: bool = False) -> dict:
    """Train (or resume) and write DIR/train_state.st plus the HF folder in DIR. Returns the run summary.

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
    state_path = train_state.state_path(run_dir) if resume else os.path.join(run_dir, STATE_FILE)

    step, total, elapsed_before, history, evals = 0, cfg.steps, 0.0, [], []
    state = None
    if resume:
        state = train_state.read(state_path)          # validated metadata; the tensors come once the model exists
        if cfg.family != state.config["family"]:
            from dblock.errors import ConfigError
            raise ConfigError(f"--family {cfg.family}: the run in {cfg.out} is {state.config['family']}")
        stored = TrainConfig(**{**state.config, "out": cfg.out, "progress": cfg.progress,
                                "threads": cfg.threads,
                                "save_dtype": cfg.save_dtype or state.config.get("save_dtype")})
        cfg = stored
        step, total = state.step, state.total_steps
        elapsed_before, history = state.elapsed_s, state.history
        evals = state.evals
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
        init_from_model(model, cfg.init_from, tok, first_layers=cfg.init_first_layers)
    if state is not None:
        loads_acc = state.restore(model, opt)       # model, optimizer, expert loads and RNG, checked, then read
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
            xt, masked, p = add_noise(x0, prompt, model.config.mask_token_id, cfg.eps, gen, cfg.suffix_mask)
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
