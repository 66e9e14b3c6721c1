"""train-tiny on `arith-long`: a few steps reduce the loss (both families), the curriculum, the noisy-context
objectives (the masked one against One Block Ahead's warm-up pass), in-training evaluation (micro config, seconds)."""
import os

import pytest
import torch

from dblock.tasks import CharTokenizer, get_task, solve
from dblock.tasks.bd3 import bd3_mask
from dblock.tasks.train import train
from dblock.tasks.train_config import TrainConfig, reproduce_command
from dblock.tasks.train_data import add_noise, batch_for_step, draw_warm_blocks, make_task, rows_for_step, task_for_step
from dblock.tasks.train_loss import diffusion_loss, noisy_context_mask
from dblock.tasks.train_model import build_model, init_from_model
from dblock.errors import ConfigError
from dblock.tasks.train_uniform import noisy_context_draw, uniform_loss


def micro_cfg(out, **kw):
    base = dict(family="llada2_moe", out=str(out), size="micro", task="arith-long", steps=4, batch_size=8,
                warmup=2, save_every=1000, log_every=1, progress=False, length_chunk=2)
    return TrainConfig(**{**base, **kw})


def _state(out):
    from dblock.tasks.train_state import STATE_FILE, contents
    return contents(os.path.join(out, STATE_FILE))


def _fixed_loss(model, cfg, step=10_000):
    """The family's training loss of `model` on one fixed batch with fixed noise (no gradient)."""
    tok, task = CharTokenizer(), make_task(cfg)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        if cfg.family == "diffusion_gemma":
            return uniform_loss(model, rows_for_step(task, tok, cfg, step), gen, {})[0].item()
        x0, prompt = batch_for_step(task, tok, cfg, step)
        xt, masked, p = add_noise(x0, prompt, model.config.mask_token_id, cfg.eps, gen)
        return diffusion_loss(model, x0, xt, masked, p, prompt)[0].item()


@pytest.mark.parametrize("family", ["llada2_moe", "diffusion_gemma"])
def test_few_steps_reduce_the_loss(tmp_path, family):
    cfg = micro_cfg(tmp_path / family, family=family, steps=30, lr=1e-2, warmup=3, batch_size=16,
                    noisy_context=0.25)
    before = _fixed_loss(build_model(cfg).eval(), cfg)
    train(cfg, log=lambda *_: None)
    model = build_model(cfg)
    model.load_state_dict(_state(cfg.out)["model"])
    after = _fixed_loss(model.eval(), cfg)
    assert after < 0.75 * before, (before, after)


def test_curriculum_short_operands_first():
    task = get_task("arith-long")
    cfg = micro_cfg("/unused", curriculum_steps=40, curriculum_start=2, length_chunk=4, batch_size=8)
    caps = [max(r[1] for r in task_for_step(task, cfg, s).sizes().values()) for s in range(0, 44, 4)]
    assert caps[0] == 2 and caps == sorted(caps) and caps[-1] == 8 and task_for_step(task, cfg, 40) is task
    tok = CharTokenizer()
    early = rows_for_step(task, tok, cfg, 0)
    assert all(solve(tok.decode(ids[:P]), "groups").digits <= 2 for ids, P in early)
    assert rows_for_step(task, tok, cfg, 0) == early                      # a pure function of the step
    assert task_for_step(task, micro_cfg("/unused"), 0) is task           # off by default
    cmd = reproduce_command(TrainConfig(out="x", task="arith-long", curriculum_steps=400, noisy_context=0.25,
                                        min_lr_frac=0.1), 1000)
    assert "--curriculum-steps 400 --curriculum-start 2" in cmd and "--noisy-context 0.25" in cmd
    assert "--min-lr-frac 0.1" in cmd and "--curriculum" not in reproduce_command(TrainConfig(out="x"), 10)


def test_init_from_copies_weights_and_refuses_another_size(tmp_path):
    a = tmp_path / "a"
    train(micro_cfg(a, steps=2), log=lambda *_: None)
    cfg = micro_cfg(tmp_path / "b", steps=1, init_from=str(a))
    model = build_model(cfg)
    init_from_model(model, str(a))
    trained = _state(a)["model"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    assert not torch.equal(build_model(cfg).state_dict()["embed.weight"],
                           trained["embed.weight"])             # not the seeded init
    assert "--init-from " + str(a) in reproduce_command(cfg, 1)
    with pytest.raises(ConfigError, match="hidden_size"):
        init_from_model(build_model(micro_cfg(tmp_path / "c", size="base")), str(a))


def test_noisy_context_mask_rule():
    L, C = 6, 2
    m = noisy_context_mask(L, C, torch.tensor([-1, 2]))
    assert torch.equal(m[0], bd3_mask(L, C))
    w = m[1]
    for q in range(2 * L):
        for k in range(2 * L):
            qn, kn = q < L, k < L
            bq, bk = (q % L) // C, (k % L) // C
            if qn and bq == 2:   # the warm-up block: itself, the NOISY block before it, the clean blocks before
                ok = (kn and bk in (bq, bq - 1)) or (not kn and bk < bq - 1)
            else:                # every other row: the plain BD3 rule
                ok = bool(bd3_mask(L, C)[q, k])
            assert bool(w[q, k]) == ok, (q, k)
    g = torch.Generator().manual_seed(0)
    w = draw_warm_blocks(1000, 4 * C, C, 0.3, g)
    assert set(w.tolist()) == {-1, 1, 2, 3} and 0.25 < (w > 0).float().mean() < 0.35
    assert (draw_warm_blocks(10, C, C, 1.0, g) == -1).all()      # one block: no predecessor


def test_noisy_context_forward_equals_oba_warmup_pass():
    """A noisy block's logits under the noisy-context mask equal the warm-up block's logits of a One Block Ahead
    pass of the reference executor: clean blocks in the KV cache, then [current ; warm-up] with the current block
    still partly masked."""
    from dblock.forward import Segment, StepInput, block_causal
    from dblock.reference.executor import LladaReference

    model = build_model(TrainConfig(size="micro", seed=5)).double().eval()
    C, L, M = model.config.block_size, 3 * model.config.block_size, model.config.mask_token_id
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(4, 32, (1, L), generator=g)
    xt = x0.clone()
    xt[0, C + 2:C + 11] = M                # the current block (1), partly decoded
    xt[0, 2 * C + 1:3 * C - 1] = M         # the warm-up block (2)
    xt[0, :C] = M                          # block 0 is in the cache: its noisy copy must stay invisible
    hidden, _ = model(torch.cat([xt, x0], 1), torch.arange(L).repeat(2)[None],
                      noisy_context_mask(L, C, torch.tensor([2])))
    train_logits = model.logits(hidden[0, 2 * C:3 * C])

    fwd = LladaReference(model)
    cache = fwd.new_cache()
    fwd.append([StepInput(0, [Segment(block=0, tokens=x0[0, :C], positions=torch.arange(C),
                                      live=torch.zeros(C, dtype=torch.bool), decoded=torch.ones(C, dtype=torch.bool),
                                      role="prefix")], block_causal(1), cache)])
    segs = [Segment(block=b, tokens=xt[0, b * C:(b + 1) * C], positions=torch.arange(b * C, (b + 1) * C),
                    live=torch.ones(C, dtype=torch.bool), decoded=xt[0, b * C:(b + 1) * C] != M, role=role)
            for b, role in ((1, "current"), (2, "warmup"))]
    warm_logits = fwd.denoise([StepInput(0, segs, block_causal(2), cache)])[0][1]
    torch.testing.assert_close(train_logits, warm_logits, atol=1e-5, rtol=1e-5)


def test_uniform_noisy_context_draw_and_default():
    P = torch.tensor([3, 5, 4, 6])
    C, n_canvas, Lf = 4, 3, 6 + 12
    noise, draws, j = noisy_context_draw(torch.Generator().manual_seed(0), P, n_canvas, C, 32, 1.0, Lf)
    assert ((j >= 0) & (j <= n_canvas - 2)).all() and draws.shape == noise.shape == (4, Lf)
    for b in range(4):
        hit = noise[b].nonzero().flatten()
        start = int(P[b] + j[b] * C)
        assert ((hit >= start) & (hit < start + C)).all()
    none = noisy_context_draw(torch.Generator().manual_seed(0), P, 1, C, 32, 1.0, Lf)
    assert not none[0].any() and (none[2] == -1).all()             # one canvas: no predecessor to noise
    # p = 0 is the plain loss, bit for bit; p = 1 trains and stays finite
    cfg = micro_cfg("/unused", family="diffusion_gemma")
    model, tok, task = build_model(cfg), CharTokenizer(), get_task("arith-long")
    rows = rows_for_step(task, tok, cfg, 3)
    a = uniform_loss(model, rows, torch.Generator().manual_seed(1), {})[0]
    b = uniform_loss(model, rows, torch.Generator().manual_seed(1), {}, noisy_context=0.0)[0]
    c = uniform_loss(model, rows, torch.Generator().manual_seed(1), {}, noisy_context=1.0)[0]
    assert torch.equal(a, b) and torch.isfinite(c) and not torch.equal(a, c)


def test_in_training_eval_keeps_the_weights(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    sa = train(micro_cfg(a, eval_every=2, eval_n=3), log=lambda *_: None)
    train(micro_cfg(b), log=lambda *_: None)
    A, B = _state(a), _state(b)
    for k in A["model"]:
        assert torch.equal(A["model"][k], B["model"][k]), k
    assert [e["step"] for e in sa["evals"]] == [2, 4] and A["evals"] == sa["evals"]
    e = sa["evals"][-1]
    assert 0 <= e["accuracy"] <= 1 and set(e["accuracy_by_kind"]) <= {"add", "div", "rev"}
    assert e["passes_per_block_mean"] >= 1 and e["loss"] is not None


def test_leaving_out_the_noisy_copies_of_prompt_blocks_changes_no_loss_or_gradient():
    """The exec programs fill whole blocks of prompt: the loss runs without their noisy copies (nothing else attends
    to them and they carry no loss) -- the same loss and the same gradient as over the whole [x_t ; x_0]."""
    from dblock.tasks.exec_task import exec_tokenizer
    from dblock.tasks.train_loss import _prompt_blocks
    cfg = micro_cfg("/unused", task="exec:grammar=chain-k", block_size=8, batch_size=4)
    tok, task = exec_tokenizer(), make_task(cfg)
    model = build_model(cfg, tok)
    x0, prompt = batch_for_step(task, tok, cfg, 3)
    assert _prompt_blocks(prompt, 8) == int(prompt.sum(1).min()) // 8 >= 10      # programs of 130+ characters
    xt, masked, p = add_noise(x0, prompt, model.config.mask_token_id, cfg.eps, torch.Generator().manual_seed(0))
    grads = []
    for trim in (True, False):
        model.zero_grad()
        loss, info = diffusion_loss(model, x0, xt, masked, p, prompt, trim=trim, block_size=8)
        loss.backward()
        grads.append((loss.item(), info["masked"], [q.grad.clone() for q in model.parameters() if q.grad is not None]))
    (l1, m1, g1), (l2, m2, g2) = grads
    assert m1 == m2 == int(masked.sum()) > 0 and l1 == pytest.approx(l2, rel=1e-5)
    assert len(g1) == len(g2) and all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g1, g2))
    assert _prompt_blocks(torch.zeros(2, 16, dtype=torch.bool), 8) == 0              # no prompt: nothing left out
    assert _prompt_blocks(torch.ones(2, 16, dtype=torch.bool), 8) == 2
