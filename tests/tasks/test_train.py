"""train-tiny: the BD3 training mask, the data and noise, determinism, resumption, export (micro config, seconds)."""
import json
import os

import pytest
import torch

from dblock.tasks import CharTokenizer, get_task
from dblock.tasks.bd3 import bd3_mask
from dblock.tasks.train import lr_at, train
from dblock.tasks.train_config import TrainConfig, llada2_config
from dblock.tasks.train_data import add_noise, batch_for_step
from dblock.tasks.train_loss import expert_loads, update_expert_bias
from dblock.tasks.train_model import build_model


def micro_cfg(out, **kw):
    base = dict(family="llada2_moe", out=str(out), size="micro", steps=4, batch_size=4, warmup=2, save_every=2,
                log_every=1, progress=False, length_chunk=2)
    return TrainConfig(**{**base, **kw})


def test_bd3_mask_hand_built():
    # L = 4, C = 2: noisy rows n0 n0 n1 n1, clean rows c0 c0 c1 c1 (see the docstring of bd3_mask)
    want = torch.tensor([
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(bd3_mask(4, 2), want)
    with pytest.raises(ValueError, match="multiple of the block size"):
        bd3_mask(5, 2)


def test_bd3_rule_three_blocks():
    L, C = 6, 2
    m = bd3_mask(L, C)
    for q in range(2 * L):
        for k in range(2 * L):
            qn, kn = q < L, k < L
            bq, bk = (q % L) // C, (k % L) // C
            ok = (qn == kn and bq == bk) or (qn and not kn and bk < bq) or (not qn and not kn and bk <= bq)
            assert bool(m[q, k]) == ok, (q, k)


def test_training_forward_equals_kv_cache_decoding():
    """The noisy block's logits of the [x_t ; x_0] training forward equal the reference executor's denoise pass
    over the same block with the committed clean blocks in the exact KV cache (the point of BD3 training)."""
    from dblock.forward import Segment, StepInput, block_causal
    from dblock.reference.executor import LladaReference

    torch.manual_seed(0)
    model = build_model(TrainConfig(size="micro", seed=3)).double().eval()
    C, L = model.config.block_size, 3 * model.config.block_size
    x0 = torch.randint(4, 32, (1, L))
    xt = x0.clone()
    xt[0, 2 * C + 1: 2 * C + 9] = model.config.mask_token_id       # block 2 partly masked
    xt[0, :2 * C] = model.config.mask_token_id                       # noise in blocks 0, 1 must be invisible to block 2
    tokens = torch.cat([xt, x0], 1)
    positions = torch.arange(L).repeat(2)[None]
    hidden, _ = model(tokens, positions, bd3_mask(L, C)[None])
    train_logits = model.logits(hidden[0, 2 * C:3 * C])

    fwd = LladaReference(model)
    cache = fwd.new_cache()
    segs = [Segment(block=b, tokens=x0[0, b * C:(b + 1) * C], positions=torch.arange(b * C, (b + 1) * C),
                    live=torch.zeros(C, dtype=torch.bool), decoded=torch.ones(C, dtype=torch.bool), role="prefix")
            for b in range(2)]
    fwd.append([StepInput(0, segs, block_causal(2), cache)])
    cur = Segment(block=2, tokens=xt[0, 2 * C:], positions=torch.arange(2 * C, 3 * C),
                  live=torch.ones(C, dtype=torch.bool), decoded=torch.zeros(C, dtype=torch.bool))
    dec_logits = fwd.denoise([StepInput(0, [cur], torch.ones(1, 1, dtype=torch.bool), cache)])[0][0]
    torch.testing.assert_close(train_logits, dec_logits, atol=1e-5, rtol=1e-5)  # attention and logits run in fp32


def test_batch_and_noise():
    tok, task = CharTokenizer(), get_task("arith")
    cfg = micro_cfg("/unused", batch_size=6, length_chunk=3)
    x0, prompt = batch_for_step(task, tok, cfg, 4)
    assert x0.shape[1] % cfg.block_size == 0 and x0.shape[0] == 6
    again = batch_for_step(task, tok, cfg, 4)
    assert torch.equal(x0, again[0]) and torch.equal(prompt, again[1])
    for row, pr in zip(x0.tolist(), prompt.tolist()):
        P = sum(pr)
        text = tok.decode(row[:P])
        e = task.grade  # the row is prompt + its own worked answer + <eos>, then <eos> padding
        ans = row[P:]
        first_eos = ans.index(tok.eos_id)
        assert all(t == tok.eos_id for t in ans[first_eos:]) and pr[:P] == [True] * P and not any(pr[P:])
        assert e(text, tok.decode(ans[:first_eos]))
    gen = torch.Generator().manual_seed(0)
    xt, masked, p = add_noise(x0, prompt, tok.mask_id, 1e-3, gen)
    assert not masked[prompt].any() and torch.equal(xt[~masked], x0[~masked])
    assert (xt[masked] == tok.mask_id).all() and ((p >= 1e-3) & (p <= 1)).all()
    # stratified t: one draw per 1/B stratum
    t = (p - 1e-3) / (1 - 1e-3)
    assert sorted((t * 6).floor().long().tolist()) == list(range(6))
    # --suffix-mask 1: every example's mask is a suffix of its answer (a cut, everything after it), p its share;
    # with 0 the draws are the plain process's (earlier runs reproduce)
    xs, ms, ps = add_noise(x0, prompt, tok.mask_id, 1e-3, torch.Generator().manual_seed(0), suffix=1.0)
    for m, pr, pp in zip(ms.tolist(), prompt.tolist(), ps.tolist()):
        ans = m[sum(pr):]
        cut = ans.index(True) if True in ans else len(ans)
        assert not any(m[:sum(pr)]) and ans == [False] * cut + [True] * (len(ans) - cut)
        assert abs(pp - max(1e-3, (len(ans) - cut) / len(ans))) < 1e-6
    assert len({tuple(m) for m in ms.tolist()}) > 1
    x0s, m0, p0 = add_noise(x0, prompt, tok.mask_id, 1e-3, torch.Generator().manual_seed(0), suffix=0.0)
    assert torch.equal(m0, masked) and torch.equal(p0, p)


def test_config_ids_from_tokenizer():
    cfg = llada2_config("base")
    tok = CharTokenizer()
    assert (cfg.vocab_size, cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (32, tok.mask_id,
                                                                                       tok.eos_id, tok.eos_id)
    assert cfg.num_experts == 16 and cfg.num_experts_per_tok == 4 and cfg.num_shared_experts == 1
    assert (cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace, cfg.partial_rotary_factor) == (4, 2, 1, 0.5)


def test_expert_bias_update_and_lr():
    model = build_model(TrainConfig(size="micro"))
    E = model.config.num_experts
    ids = torch.zeros(1, 5, model.config.num_experts_per_tok, dtype=torch.long)
    ids[..., 1] = 1
    loads = expert_loads(model, {"topk_ids": [ids]})
    assert loads.shape == (1, E) and loads[0, 0] == 5 and loads[0, 1] == 5 and loads[0, 2:].sum() == 0
    update_expert_bias(model, loads, 0.01)
    bias = model.layers[1].mlp.expert_bias
    assert bias[0] == bias[1] == -0.01 and (bias[2:] == 0.01).all()
    cfg = TrainConfig(lr=1.0, warmup=10, min_lr_frac=0.1)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1) and lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1) and lr_at(55, cfg, 100) == pytest.approx(0.55)


def _state(out):
    from dblock.tasks.train_state import STATE_FILE, contents
    return contents(os.path.join(out, STATE_FILE))


def test_determinism_resume_and_export(tmp_path):
    import dblock

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    sa = train(micro_cfg(a), log=lambda *_: None)
    train(micro_cfg(b), log=lambda *_: None)
    # resumable: stop after 2 steps, resume to 4 -> the same weights, optimizer state and expert bias
    train(micro_cfg(c), stop_after=2, log=lambda *_: None)
    assert _state(c)["step"] == 2 and not (c / "model.safetensors").exists()
    train(micro_cfg(c, steps=None, seed=99), resume=True, log=lambda *_: None)  # stored settings win
    A, B, Cs = _state(a), _state(b), _state(c)
    assert A["step"] == B["step"] == Cs["step"] == 4
    for k in A["model"]:
        assert torch.equal(A["model"][k], B["model"][k]), k
        assert torch.equal(A["model"][k], Cs["model"][k]), k
    assert any(v.abs().sum() > 0 for k, v in A["model"].items() if k.endswith("expert_bias"))
    other = train(micro_cfg(tmp_path / "d", seed=1), log=lambda *_: None)
    assert not torch.equal(_state(tmp_path / "d")["model"]["lm_head.weight"], A["model"]["lm_head.weight"])
    assert other["steps_done"] == 4 and "--steps 4" in sa["reproduce"]
    # --suffix-mask takes effect (other weights from the same seed) and the run says how to reproduce it
    suf = train(micro_cfg(tmp_path / "s", suffix_mask=1.0), log=lambda *_: None)
    assert not torch.equal(_state(tmp_path / "s")["model"]["lm_head.weight"], A["model"]["lm_head.weight"])
    assert "--suffix-mask 1.0" in suf["reproduce"] and "--suffix-mask" not in sa["reproduce"]
    # the export is a loadable HF folder with the char tokenizer and the tokenizer's special ids
    model = dblock.load(str(a))
    cfgj = json.loads((a / "config.json").read_text())
    assert (cfgj["mask_token_id"], cfgj["eos_token_id"], cfgj["pad_token_id"], cfgj["block_size"]) == (3, 1, 1, 16)
    assert (a / "tokenizer.json").exists() and (a / "train_summary.json").exists()
    for k, v in model.state_dict().items():
        assert torch.equal(v, A["model"][k]), k


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="--steps or --minutes"):
        train(micro_cfg(tmp_path, steps=None))
    with pytest.raises(ValueError, match="--family"):
        train(micro_cfg(tmp_path, family="llada_moe"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(micro_cfg(tmp_path / "none"), resume=True)
    with pytest.raises(ValueError, match="--size"):
        llada2_config("huge")


# ---------------------------------------------------------------------------------------------------------------
# diffusion_gemma (uniform-state) objective
# ---------------------------------------------------------------------------------------------------------------

def test_uniform_training_forward_equals_reference_decoding():
    """Encoder K/V + decoder pass of the uniform objective give, for canvas 1, the logits the reference executor
    computes after prefilling the prompt and appending canvas 0 (sliding window shorter than the row)."""
    from dblock.forward import Segment, StepInput, block_causal
    from dblock.reference.gemma_executor import GemmaReference
    from dblock.tasks.train_uniform import decoder_masks, encoder_masks, uniform_rows

    model = build_model(TrainConfig(family="diffusion_gemma", size="micro", seed=1)).double().eval()
    cfg = model.config
    C, W = cfg.canvas_length, cfg.sliding_window
    assert W < 2 * C
    g = torch.Generator().manual_seed(0)
    P = 5
    ids = torch.randint(4, 32, (P + 2 * C,), generator=g).tolist()
    x, valid, Pt, n_canvas = uniform_rows([(ids, P)], C, cfg.eos_token_id, cfg.pad_token_id)
    assert n_canvas == 2 and x.shape == (1, P + 2 * C)
    xt = torch.randint(0, 32, (1, 2 * C), generator=g)
    sc = torch.randn(2 * C, 32, generator=g, dtype=torch.float64)
    positions = torch.arange(x.shape[1])[None]
    with torch.no_grad():
        _, kv = model._stack(model.embed(x), positions, encoder_masks(valid, W), None, decoder=False, taps=None)
        soft = model.soft_embed(sc)[None]
        hidden = model.decode(xt, P + torch.arange(2 * C)[None], decoder_masks(valid, Pt, 2, C, W), kv, soft)
        train_logits = model.logits(hidden[0, C:])

    fwd = GemmaReference(model)
    cache = fwd.new_cache()
    def fixed(t, s):
        n = len(t)
        return Segment(block=-1, tokens=t, positions=torch.arange(s, s + n), live=torch.zeros(n, dtype=torch.bool),
                       decoded=torch.ones(n, dtype=torch.bool), role="prefix")
    fwd.append([StepInput(0, [fixed(x[0, :P], 0)], block_causal(1), cache)])
    fwd.append([StepInput(0, [fixed(x[0, P:P + C], P)], block_causal(1), cache)])
    cur = Segment(block=1, tokens=xt[0, C:], positions=torch.arange(P + C, P + 2 * C),
                  live=torch.ones(C, dtype=torch.bool), decoded=torch.zeros(C, dtype=torch.bool), sc_logits=sc[C:])
    ref_logits = fwd.denoise([StepInput(0, [cur], torch.ones(1, 1, dtype=torch.bool), cache)])[0][0]
    torch.testing.assert_close(train_logits, ref_logits, atol=1e-5, rtol=1e-5)  # logits/softmax run in fp32


def test_uniform_determinism_and_export(tmp_path):
    import dblock

    a, b = tmp_path / "a", tmp_path / "b"
    kw = dict(family="diffusion_gemma", steps=2, save_every=1)
    s = train(micro_cfg(a, **kw), log=lambda *_: None)
    train(micro_cfg(b, **kw), log=lambda *_: None)
    A, B = _state(a), _state(b)
    for k in A["model"]:
        assert torch.equal(A["model"][k], B["model"][k]), k
    assert s["final"]["ar"] > 0 and s["expert_balance_ema"] is not None
    model = dblock.load(str(a))
    assert model.config.family == "diffusion_gemma" and model.config.canvas_length == 16
    assert model.config.eos_token_id == 1 and model.config.pad_token_id == 0 and (a / "tokenizer.json").exists()
    for k, v in model.state_dict().items():
        assert torch.equal(v, A["model"][k]), k
