"""train-tiny --task code: windows of the corpus, the fixed prompt rows, learning, resumption, the export."""
import json
import os

import torch

from dblock.tasks.code_corpus import CodeTokenizer, TrainWindows
from dblock.tasks.train import train
from dblock.tasks.train_config import TrainConfig
from dblock.tasks.train_data import code_batch_for_step
from dblock.weights_path import CHECKPOINTS_DIR

TOKENIZER = os.path.join(CHECKPOINTS_DIR, "code-masked")


def code_cfg(out, **kw):
    base = dict(family="llada2_moe", out=str(out), size="code-micro", task="code", block_size=16, window=64,
                steps=40, batch_size=8, lr=5e-3, warmup=5, log_every=10, progress=False, save_every=1000,
                fused_attention=True, tokenizer=TOKENIZER)
    return TrainConfig(**{**base, **kw})


def test_code_batch_fixes_only_the_rows_of_the_prompt_block_before_its_end():
    cfg = code_cfg("x", batch_size=32)
    w = TrainWindows(CodeTokenizer.load(TOKENIZER), cfg.window)
    x0, fixed = code_batch_for_step(w, cfg, 3)
    x1, fixed1 = code_batch_for_step(w, cfg, 3)
    assert torch.equal(x0, x1) and torch.equal(fixed, fixed1)                # a pure function of (seed, step)
    assert x0.shape == fixed.shape == (32, 64)
    C = cfg.block_size
    for row in fixed:
        idx = row.nonzero().flatten().tolist()
        if idx:                   # one run [block start of P, P) inside a single block, starting at its first row
            assert idx == list(range(idx[0], idx[-1] + 1)) and idx[0] % C == 0 and idx[-1] // C == idx[0] // C
    assert fixed.any(1).float().mean() > 0.5
    assert not torch.equal(code_batch_for_step(w, cfg, 4)[0], x0)


def test_a_few_steps_reduce_the_loss_and_the_export_loads_with_its_tokenizer(tmp_path):
    import dblock
    summary = train(code_cfg(tmp_path / "m"), log=lambda *a: None)
    hist = json.load(open(tmp_path / "m" / "train_summary.json"))["history"]
    assert hist[-1]["ce"] < hist[0]["ce"] - 0.5, hist          # ln(2048) = 7.6 at the start
    assert "--task code" in summary["reproduce"] and "--tokenizer" in summary["reproduce"]
    m = dblock.load(str(tmp_path / "m"))
    assert m.config.vocab_size == 2048 and m.config.num_experts == 16
    assert CodeTokenizer.load(str(tmp_path / "m")).hf.to_str() == CodeTokenizer.load(TOKENIZER).hf.to_str()


def test_uniform_state_code_run_with_noisy_context_reduces_the_loss(tmp_path):
    """`train-tiny --family diffusion_gemma --task code --noisy-context`: the recipe code-uniform is trained with.
    A few steps take the loss down, the command that reproduces it keeps the flag, and the export loads as a
    DiffusionGemma model with the code tokenizer."""
    import dblock
    summary = train(code_cfg(tmp_path / "u", family="diffusion_gemma", noisy_context=0.3, steps=30),
                    log=lambda *a: None)
    hist = json.load(open(tmp_path / "u" / "train_summary.json"))["history"]
    assert hist[-1]["ce"] < hist[0]["ce"] - 0.5, hist
    assert "--family diffusion_gemma" in summary["reproduce"] and "--noisy-context 0.3" in summary["reproduce"]
    m = dblock.load(str(tmp_path / "u"))
    assert m.config.family == "diffusion_gemma" and m.config.vocab_size == 2048
    assert CodeTokenizer.load(str(tmp_path / "u")).hf.to_str() == CodeTokenizer.load(TOKENIZER).hf.to_str()


def test_resumed_code_run_equals_the_uninterrupted_one_and_bf16_export(tmp_path):
    import dblock
    full = code_cfg(tmp_path / "a", steps=6, save_every=2)
    train(full, log=lambda *a: None)
    part = code_cfg(tmp_path / "b", steps=6, save_every=2, tokenizer=None, vocab_size=2048)
    part.tokenizer = TOKENIZER
    train(part, stop_after=3, log=lambda *a: None)
    from dblock.cli import main            # resumed from the command line, the family read from the run itself
    assert main(["train-tiny", "--resume", "--out", str(tmp_path / "b"), "--save-dtype", "bfloat16",
                 "--no-progress"]) == 0
    a, b = dblock.load(str(tmp_path / "a")), dblock.load(str(tmp_path / "b"))
    assert next(b.parameters()).dtype == torch.float32            # stored bf16, computed in fp32 (config.json)
    assert json.load(open(tmp_path / "b" / "config.json"))["torch_dtype"] == "float32"
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va.to(torch.bfloat16).float() if va.is_floating_point() and
                                        "expert_bias" not in ka else va, vb), ka
    assert os.path.getsize(tmp_path / "b" / "model.safetensors") < 0.6 * os.path.getsize(
        tmp_path / "a" / "model.safetensors")


def test_fused_attention_is_the_same_function_for_both_families():
    """--fused-attention computes the training loss through torch's scaled_dot_product_attention: the same value
    (within fp32 rounding) as the reference modules' explicit softmax attention, for both families' masks."""
    from dblock.tasks.train_data import add_noise
    from dblock.tasks.train_loss import diffusion_loss
    from dblock.tasks.train_model import build_model, set_fused_attention
    from dblock.tasks.train_data import code_rows_for_step
    from dblock.tasks.train_uniform import uniform_loss
    tok = CodeTokenizer.load(TOKENIZER)
    w = TrainWindows(tok, 64)
    for family in ("llada2_moe", "diffusion_gemma"):
        cfg = code_cfg("x", family=family, batch_size=4, fused_attention=False)
        m = build_model(cfg, tok)
        losses = []
        for fused in (False, True):
            set_fused_attention(m, fused)
            g = torch.Generator().manual_seed(1)
            if family == "llada2_moe":
                x0, fixed = code_batch_for_step(w, cfg, 0)
                xt, masked, p = add_noise(x0, fixed, m.config.mask_token_id, 1e-3, g)
                losses.append(float(diffusion_loss(m, x0, xt, masked, p, fixed, {})[0]))
            else:
                losses.append(float(uniform_loss(m, code_rows_for_step(w, cfg, 0), g, {})[0]))
        assert abs(losses[0] - losses[1]) < 1e-4 * abs(losses[0]), (family, losses)


def test_uniform_code_rows_end_on_a_canvas_boundary():
    from dblock.tasks.train_data import code_rows_for_step
    cfg = code_cfg("x", family="diffusion_gemma", batch_size=16)
    w = TrainWindows(CodeTokenizer.load(TOKENIZER), cfg.window)
    rows = code_rows_for_step(w, cfg, 2)
    assert rows == code_rows_for_step(w, cfg, 2)
    for ids, P in rows:
        assert 1 <= P <= cfg.window // 2 and (len(ids) - P) % cfg.block_size == 0 and len(ids) - P >= cfg.block_size


def test_block_warmup_schedule_and_its_refusals(tmp_path):
    import pytest

    from dblock.tasks.bd3 import bd3_mask
    from dblock.tasks.train_data import block_size_at
    cfg = code_cfg("x", block_warmup="1:3,4:2")
    assert [block_size_at(cfg, s) for s in range(7)] == [1, 1, 1, 4, 4, 16, 16]
    # block 1 is next-token prediction: a noisy row sees the clean rows before it and itself only
    L = 4
    m = bd3_mask(L, 1)
    assert m[:L, L:].tolist() == [[k < q for k in range(L)] for q in range(L)]
    for bad, msg in (("1:0", "steps >= 1"), ("3:10", "does not divide"), ("x", "BLOCK:STEPS")):
        with pytest.raises(ValueError, match=msg):
            train(code_cfg(tmp_path / "w", block_warmup=bad), log=lambda *a: None)
    assert not (tmp_path / "w").exists()
