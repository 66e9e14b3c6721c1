"""The entropy-bound rule alone, against hand-made logits and transformers' own sampler pieces."""
from types import SimpleNamespace

import pytest
import torch

from dblock.decoding.params import DecodeConfig
from dblock.decoding.entropy_bound import (UniformRule, entropy_bound_accept, pad_after_eos, stable_and_confident,
                                            temperature, token_entropy, transformers_tpf)

gen_mod = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

V, C = 12, 6
CFG = SimpleNamespace(family="diffusion_gemma", vocab_size=V, eos_token_id=3, eos_token_ids=(3,), pad_token_id=0)


def rule(**kw):
    return UniformRule(CFG, DecodeConfig(rule="entropy-bound", **kw))


def peaked(tokens, sharp=60.0):
    """(C, V) logits whose argmax is `tokens`, near-zero entropy."""
    z = torch.zeros(len(tokens), V)
    z[torch.arange(len(tokens)), torch.as_tensor(tokens)] = sharp
    return z


# ---- pure pieces ----------------------------------------------------------------------------------------------------

def test_entropy_bound_prefix_boundaries():
    # dyadic entropies: sums are exact, so "<= bound" is tested at equality
    H = torch.tensor([0.5, 0.0, 0.0625, 0.03125, 0.25, 0.125])
    # sorted 0, 1/32, 1/16, 1/8, 1/4, 1/2 ; cumsum - H = 0, 0, 1/32, 3/32, 7/32, 15/32
    assert entropy_bound_accept(H, 3 / 32).tolist() == [False, True, True, True, False, True]
    assert entropy_bound_accept(H, 3 / 32 - 1e-6).tolist() == [False, True, True, True, False, False]
    assert entropy_bound_accept(H, 0.0).tolist() == [False, True, False, True, False, False]
    assert entropy_bound_accept(H, 100.0).all()
    # the lowest-entropy position is always accepted, even when all are huge
    assert entropy_bound_accept(torch.tensor([9.0, 8.0, 7.0]), 0.1).tolist() == [False, False, True]


def test_matches_transformers_sampler_pieces():
    g = torch.Generator().manual_seed(0)
    sampler = gen_mod.EntropyBoundSampler(gen_mod.EntropyBoundSamplerConfig(entropy_bound=0.3), C, V, 48)
    proc = gen_mod.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=48)
    for n in (48, 31, 7, 1):
        logits = 6.0 * torch.randn(2, C, V, generator=g)
        theirs = proc(None, logits, cur_step=torch.tensor(n, dtype=torch.int32))
        ours = logits / temperature(n, 48, 0.8, 0.4)
        assert torch.equal(ours, theirs)
        cur, den = torch.randint(0, V, (2, C), generator=g), torch.randint(0, V, (2, C), generator=g)
        acc = sampler.accept_canvas(cur, den, ours, n)
        for b in range(2):
            mask = entropy_bound_accept(token_entropy(ours[b]), 0.3)
            assert torch.equal(mask, sampler.accepted_token_mask[b])
            assert torch.equal(torch.where(mask, den[b], cur[b]), acc[b])


@pytest.mark.parametrize("stability", [0, 1, 2])
def test_stop_rule_history_matches_transformers(stability):
    theirs = gen_mod.StableAndConfidentStoppingCriteria(stability_threshold=stability, confidence_threshold=0.01)
    seq = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 5, 7], [1, 2, 3, 4, 5, 7],
           [1, 2, 3, 4, 5, 7]]
    hist, stops = None, []
    for i, a in enumerate(seq):
        logits = peaked(a, sharp=60.0 if i != 4 else 1.0)   # step 4 is stable but not confident
        proc = logits / 0.5
        expect = bool(theirs(torch.tensor([a]), proc[None])[0])
        stop, hist = stable_and_confident(hist, torch.tensor(a), token_entropy(proc), stability, 0.01)
        assert stop == expect
        stops.append(stop)
    # hand-checked: stability 1 needs one unchanged repeat, 2 needs two
    assert stops == {0: [True, True, True, True, False, True], 1: [False, True, False, True, False, True],
                     2: [False, False, False, False, False, True]}[stability]


def test_pad_after_eos_and_tpf():
    t = torch.tensor([5, 3, 7, 3, 9, 2])
    assert pad_after_eos(t, (3,), 0).tolist() == [5, 3, 0, 0, 0, 0]
    assert pad_after_eos(t, (9, 3), 1).tolist() == [5, 3, 1, 1, 1, 1]
    assert pad_after_eos(torch.tensor([4, 4]), (3,), 0).tolist() == [4, 4]
    ids = torch.tensor([[8, 8, 5, 3, 0, 0, 0, 0]])
    ref = gen_mod.DiffusionGemmaGenerationMixin._compute_tokens_per_forward(ids, torch.tensor([5]), 2, 0)
    assert transformers_tpf([5, 3, 0, 0, 0, 0], 5, 0) == pytest.approx(float(ref[0]))


# ---- the rule as a block state machine ---------------------------------------------------------------------------

def test_rng_order_init_then_multinomial_then_randint():
    r = rule(steps=4)
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    st = r.new_block(torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.bool), g1)
    x0 = torch.randint(0, V, (C,), generator=g2)
    assert torch.equal(st.x, x0)
    logits = 4.0 * torch.randn(C, V, generator=torch.Generator().manual_seed(1))
    r.step(st, logits, g1, warmup=False)
    proc = logits / temperature(4, 4, 0.8, 0.4)
    prop = torch.multinomial(torch.softmax(proc, -1), 1, generator=g2).squeeze(-1)
    noise = torch.randint(0, V, (C,), generator=g2)
    mask = entropy_bound_accept(token_entropy(proc), 0.1)
    assert torch.equal(st.x, torch.where(mask, prop, noise))
    assert torch.equal(st.z, proc) and torch.equal(st.argmax, proc.argmax(-1)) and st.t == 3
    assert r.readiness(st) == pytest.approx(mask.float().mean().item())


def test_clock_stop_and_commit():
    r = rule(steps=3)
    g = torch.Generator().manual_seed(0)
    st = r.new_block(torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.bool), g)
    assert not r.done(st) and r.readiness(st) == 0.0
    a = [4, 3, 8, 3, 1, 2]
    r.step(st, peaked(a), g, warmup=False)          # argmax history empty: not stable yet
    assert not r.done(st)
    r.step(st, peaked(a), g, warmup=False)          # same argmax, confident: stops
    assert r.done(st) and st.t == 1
    assert r.final_tokens(st).tolist() == [4, 3, 0, 0, 0, 0]   # the argmax canvas, pad after the first EOS
    # without confidence the clock runs out after N current steps
    st = r.new_block(torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.bool), g)
    for i in range(3):
        assert not r.done(st)
        r.step(st, peaked(a, sharp=0.5), g, warmup=False)
    assert r.done(st) and st.t == 0


def test_warmup_holds_clock_never_stops_then_promotion():
    r = rule(steps=3)
    g = torch.Generator().manual_seed(0)
    st = r.new_block(torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.bool), g)
    a = [5, 6, 7, 8, 9, 10]
    for _ in range(6):                              # stable and confident, but warm-up: never done, n >= 1
        r.step(st, peaked(a), g, warmup=True)
        assert not r.done(st) and st.t >= 1
    assert st.t == 1 and st.history is not None and st.current_passes == 0
    z = st.z.clone()
    st = r.promote(st, frozenset({"x", "z", "t"}))
    assert st.history is None and not st.stopped and st.t == 1 and torch.equal(st.z, z)
    r.step(st, peaked(a), g, warmup=False)          # its clock was kept at its last step: done now
    assert r.done(st)
    stats = r.block_stats(st, warmup_steps=6)
    # every position accepted with the same token since the first warm-up pass: held through promotion -> 0
    assert stats["accept_pass"] == [0] * C and all(stats["kept"])
    assert stats["first_pass_accepted"] == C and stats["first_pass_kept"] == C


@pytest.mark.parametrize("keep", [frozenset(), frozenset({"z"}), frozenset({"x"}), frozenset({"x", "z", "t"})])
def test_promote_keeps_what_it_says(keep):
    r = rule(steps=5)
    g = torch.Generator().manual_seed(3)
    st = r.new_block(torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.bool), g)
    r.step(st, peaked([1, 2, 4, 5, 6, 7], sharp=5.0), g, warmup=True)
    r.step(st, peaked([1, 2, 4, 5, 6, 7], sharp=5.0), g, warmup=True)
    x, z = st.x.clone(), st.z.clone()
    snap = torch.Generator()
    snap.set_state(g.get_state())
    fresh = torch.randint(0, V, (C,), generator=snap)
    st = r.promote(st, keep)
    assert torch.equal(st.x, x) == ("x" in keep)
    if "x" not in keep:
        assert torch.equal(st.x, fresh) and not st.accepted.any()   # fresh noise from the block's own generator
    assert (st.z is not None and torch.equal(st.z, z)) == ("z" in keep)
    assert st.t == (3 if "t" in keep else 5)
    assert st.history is None and not st.stopped


def test_no_accept_renoises_everything_but_z_propagates():
    r = rule(steps=4)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    st = r.new_block(torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.bool), g1)
    torch.randint(0, V, (C,), generator=g2)
    logits = peaked([1, 2, 4, 5, 6, 7])
    r.step(st, logits, g1, warmup=True, accept=False)
    proc = logits / temperature(4, 4, 0.8, 0.4)
    torch.multinomial(torch.softmax(proc, -1), 1, generator=g2)
    assert torch.equal(st.x, torch.randint(0, V, (C,), generator=g2))   # all re-noised
    assert torch.equal(st.z, proc) and not st.accepted.any() and r.readiness(st) == 0.0


def test_block_stats_first_pass_and_held_runs():
    """Bound 0: a pass accepts only its lowest-entropy position (a second one would cost that entropy, > 0)."""
    r = rule(steps=10, entropy_bound=0.0)
    g = torch.Generator().manual_seed(0)
    st = r.new_block(torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.bool), g)
    target = [4, 5, 6, 7, 8, 9]

    def pass_where(pos, sharp_pos):
        z = peaked(target, sharp=2.0)                 # every argmax is the target, entropies well above 0
        z[pos, target[pos]] = sharp_pos               # `pos` is the least uncertain (entropy small but > 0)
        return z

    for pos, sharp in ((0, 12.0), (0, 13.0), (2, 12.0), (2, 12.5)):
        r.step(st, pass_where(pos, sharp), g, warmup=False)
    stats = r.block_stats(st, warmup_steps=0)
    # position 0: accepted on passes 1-2 then re-noised; position 2: accepted with the same token since pass 3
    assert stats["accept_pass"] == [-1, -1, 3, -1, -1, -1]
    assert stats["kept"] == [False, False, True, False, False, False]
    assert stats["first_pass_accepted"] == 1 and stats["first_pass_kept"] == 1   # token 4 == committed argmax
    assert r.final_tokens(st).tolist() == target


def test_refuses_fixed_positions_and_masked_rules():
    r = rule()
    with pytest.raises(ValueError, match="fixed"):
        r.new_block(torch.zeros(C, dtype=torch.long), torch.ones(C, dtype=torch.bool), torch.Generator())
    with pytest.raises(ValueError, match="entropy-bound"):
        UniformRule(CFG, DecodeConfig(rule="threshold"))
