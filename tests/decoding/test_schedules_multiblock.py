"""Multi-block schedules (docs/algorithms.md §3): the paired-block proposition, promotion per ablation, in-order commits,
counters by hand, noise streams, FlowBlock's gate."""
import copy

import pytest
import torch

from dblock.decoding.params import DecodeConfig
from dblock.forward import Segment, StepInput, block_causal, dense
from dblock.reference.executor import LladaReference
from dblock.decoding.generate import generate, reference_forward
from dblock.decoding.schedules import (OBA_ABLATIONS, Request, RequestRun, RunTimes, ScheduleSpec, schedule_spec,
                                        step_once)
from dblock.tiny import make_tiny_model
from tests.conftest import logits_tol, tol
from tests.reference.scripted import ScriptedForward


def seg(tokens, start, block, mask_id):
    t = torch.as_tensor(tokens)
    live = t == mask_id if mask_id is not None else torch.ones(len(t), dtype=torch.bool)
    return Segment(block=block, tokens=t, positions=torch.arange(start, start + len(t)), live=live, decoded=~live)


# ---- the paired-block proposition ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_paired_block_proposition_llada2(dtype):
    m = make_tiny_model("llada2_moe", seed=11, dtype=dtype)
    fwd, M, C = LladaReference(m), m.config.mask_token_id, 8
    cache = fwd.new_cache()
    fwd.append([StepInput(0, [seg(list(range(10, 18)), 0, 0, M)], block_causal(1), cache)])
    cur = seg([20, M, M, 21, M, M, M, 22], C, 1, M)
    warm = seg([M] * 5 + [30, M, M], 2 * C, 2, M)
    alone = fwd.denoise([StepInput(0, [cur], block_causal(1), cache)])[0][0]
    paired = fwd.denoise([StepInput(0, [cur, warm], block_causal(2), cache)])[0]
    densem = fwd.denoise([StepInput(0, [cur, warm], dense(2), cache)])[0]
    assert paired[1].shape == (7, m.config.vocab_size)          # the warm-up half returns its own live rows
    torch.testing.assert_close(paired[0], alone, **logits_tol(dtype, alone))
    # Dense Mask lets the current block read the warm-up block: the proposition breaks, visibly
    assert (densem[0] - alone).abs().max() > 1e-3


def test_warmup_half_sees_the_current_block_as_if_committed_llada2():
    """The warm-up half's positions and visibility: with the current block fully decoded, the warm-up block's logits
    in a paired pass equal its logits once the current block is committed to the cache and it decodes alone."""
    m = make_tiny_model("llada2_moe", seed=11, dtype=torch.float64)
    fwd, M, C = LladaReference(m), m.config.mask_token_id, 8
    cache = fwd.new_cache()
    fwd.append([StepInput(0, [seg(list(range(10, 18)), 0, 0, M)], block_causal(1), cache)])
    cur = seg(list(range(20, 28)), C, 1, M)
    warm = seg([M] * 5 + [30, M, M], 2 * C, 2, M)
    paired = fwd.denoise([StepInput(0, [cur, warm], block_causal(2), cache)])[0][1]
    fwd.append([StepInput(0, [cur], block_causal(1), cache)])
    alone = fwd.denoise([StepInput(0, [warm], block_causal(1), cache)])[0][0]
    torch.testing.assert_close(paired, alone, **tol(torch.float64))


def test_paired_block_proposition_diffusion_gemma():
    from dblock.reference.gemma_tiny import make_tiny_gemma
    m = make_tiny_gemma(seed=2, dtype=torch.float64)
    fwd = reference_forward(m)
    C = m.config.block_size
    cache = fwd.new_cache()
    fwd.append([StepInput(0, [seg([5, 6, 7], 0, -1, None)], block_causal(1), cache)])
    g = torch.Generator().manual_seed(0)
    V = m.config.vocab_size
    cur = seg(torch.randint(0, V, (C,), generator=g), 3, 0, None)
    warm = seg(torch.randint(0, V, (C,), generator=g), 3 + C, 1, None)
    cur.sc_logits = torch.randn(C, V, generator=g, dtype=torch.float64)
    alone = fwd.denoise([StepInput(0, [cur], block_causal(1), cache)])[0][0]
    paired = fwd.denoise([StepInput(0, [cur, warm], block_causal(2), cache)])[0][0]
    densem = fwd.denoise([StepInput(0, [cur, warm], dense(2), cache)])[0][0]
    torch.testing.assert_close(paired, alone, **tol(torch.float64))
    assert (densem - alone).abs().max() > 1e-6


def test_oba_refused_on_llada_moe():
    m = make_tiny_model("llada_moe", seed=0)
    for name in ("oba", "dense_mask", "flowblock", "keep_tokens"):
        with pytest.raises(ValueError, match="llada_moe"):
            generate(m, [[1, 2]], DecodeConfig(max_new_tokens=8), name)


# ---- masked diffusion: order, counters, promotion -----------------------------------------------------------

def oba_script(p):
    # block 1 = rows 4..7 (its rows clear tau from the block's 3rd pass); block 2 = rows 8..11 (from its 1st)
    return (2, 3) if p < 8 else (5, 1)


def test_oba_counters_by_hand_and_in_order_commit():
    fwd = ScriptedForward(oba_script)
    res = generate(fwd, [[1, 2, 3, 4]], DecodeConfig(max_new_tokens=8, block_size=4), "oba")
    c = res.counters[0]
    # pass 1: block 1 commits its most confident row (fallback); the warm-up block 2 rides along but decodes
    # nothing (masked diffusion cannot revise, so a waiting block commits nothing: docs/algorithms.md §3).
    # pass 2: block 1 commits one more row (fallback).  pass 3: block 1's last two rows clear tau -> block 1
    # commits; block 2 is promoted as a fresh block.  pass 4 (block 2 alone, the final block): all 4 rows clear tau.
    assert [b.block for b in c.blocks] == [1, 2]
    assert [b.passes for b in c.blocks] == [3, 1] and [b.warmup_steps for b in c.blocks] == [0, 3]
    assert (c.F, c.K, c.Q, c.Y) == (4, 2, 6, 8)
    assert res.tokens[0] == [2, 2, 2, 2, 5, 5, 5, 5]
    assert res.tokens == generate(ScriptedForward(oba_script), [[1, 2, 3, 4]],
                                  DecodeConfig(max_new_tokens=8, block_size=4), "native").tokens
    # every denoising call while block 1 is current paired the two blocks with the block-causal mask
    den = [items for kind, items in fwd.calls if kind == "denoise"]
    assert all([s.block for s in items[0].segments] == [1, 2] for items in den[:3])
    assert all(torch.equal(items[0].visibility, block_causal(2)) for items in den[:3])
    assert [s.block for s in den[3][0].segments] == [2]
    assert [s.role for s in den[0][0].segments] == ["current", "warmup"]


def test_eos_in_current_block_drops_the_warmup():
    fwd = ScriptedForward(lambda p: (14, 1) if p == 5 else (2, 1))
    res = generate(fwd, [[1, 2, 3, 4]], DecodeConfig(max_new_tokens=40, block_size=4), "oba")
    assert res.tokens[0] == [2, 14] and res.counters[0].K == 1
    assert (0, 2) in fwd.ended  # the warm-up block's plan/state is released


def test_final_block_has_no_warmup():
    fwd = ScriptedForward(lambda p: (3, 1))
    generate(fwd, [[1, 2, 3, 4]], DecodeConfig(max_new_tokens=12, block_size=4), "oba")
    den = [items[0] for kind, items in fwd.calls if kind == "denoise"]
    assert [s.block for s in den[-1].segments] == [3]   # blocks 1..3; the last pass carries block 3 alone


@pytest.mark.parametrize("name", ["oba", "drop_time", "keep_tokens", "no_accept", "dense_mask"])
def test_masked_warmup_block_commits_nothing(name):
    # fixed-k, 8 steps per block of 8: block 0 holds 4 prompt rows + 4 masks (one per pass) beside the warm-up
    # block 1. Masked diffusion cannot revise a revealed token, so under every OBA variant the waiting block decodes
    # nothing and is promoted as a fresh block: all rows masked, pass clock 0 (docs/algorithms.md §3).
    dec = DecodeConfig(max_new_tokens=20, block_size=8, rule="fixed-k", steps=8)
    fwd = ScriptedForward(lambda p: (3, 1), block_size=8)
    run = RequestRun(Request([1, 2, 3, 4], 20, id=0), fwd, schedule_spec(name), dec)
    t = RunTimes()
    while run.counters.K == 0:
        step_once([run], fwd, t)
    promoted = run.inflight[0].state
    assert run.inflight[0].index == 1 and run.counters.blocks[0].passes == 4
    assert run.inflight[0].warmup_steps == 4
    assert bool((promoted.tokens == 15).all()) and promoted.passes == 0 and promoted.draws == 0


def test_warmup_clock_holds_before_max_steps():
    """A warm-up block never reaches the commit-everything pass of the threshold rule while waiting."""
    fwd = ScriptedForward(lambda p: (2, 99))   # nothing ever clears tau
    dec = DecodeConfig(max_new_tokens=8, block_size=4, max_steps=3)
    run = RequestRun(Request([1, 2, 3, 4], 8, id=0), fwd, schedule_spec("oba"), dec)
    t = RunTimes()
    for _ in range(2):
        step_once([run], fwd, t)
    warm = run.inflight[1].state
    assert warm.passes <= dec.max_steps - 1 and int(warm.live.sum()) == 4  # masked: a waiting block decodes nothing


# ---- uniform-state: promotion per ablation and noise streams --------------------------------------------------

@pytest.fixture(scope="module")
def gemma():
    from dblock.reference.gemma_tiny import make_tiny_gemma
    return make_tiny_gemma(seed=4)


@pytest.mark.parametrize("name", sorted(OBA_ABLATIONS))
def test_uniform_promotion_per_ablation(gemma, name):
    """Drive a two-block request by hand and look at the warm-up block's state just before and just after
    promotion: x, z, t kept or reset as the ablation says; sigma always reset."""
    fwd = reference_forward(gemma)
    dec = DecodeConfig(max_new_tokens=3 * gemma.config.block_size, rule="entropy-bound", seed=1, steps=6)
    run = RequestRun(Request([5, 6, 7], dec.max_new_tokens, seed=1, id=0), fwd, schedule_spec(name), dec)
    seen = {}
    promote = run.rule.promote

    def recording_promote(st, keep):
        seen["before"], seen["keep"] = copy.deepcopy(st), keep
        return promote(st, keep)
    run.rule.promote = recording_promote
    t, warm_inputs = RunTimes(), []
    while run.counters.K == 0:
        warm_inputs.append(run.denoise_input().segments[-1]) if run.pending() == "denoise" else None
        step_once([run], fwd, t)
    before, after = seen["before"], run.inflight[0].state
    keep = OBA_ABLATIONS[name][0]
    assert seen["keep"] == frozenset(keep)
    assert torch.equal(after.x, before.x) == ("x" in keep)
    assert (after.z is not None) == ("z" in keep)
    if "z" in keep:
        assert torch.equal(after.z, before.z)
    assert after.t == (before.t if "t" in keep else dec.n_steps)
    assert before.t < dec.n_steps                              # the warm-up clock did advance
    assert after.history is None and not after.stopped          # sigma always restarts
    if name == "no_accept":
        assert not before.accepted.any() and before.z is not None  # nothing accepted, z still propagates
    if name == "no_signal":
        assert all(s.sc_logits is None and not s.sc_enabled for s in warm_inputs if s.role == "warmup")
    else:
        assert any(s.sc_logits is not None for s in warm_inputs if s.role == "warmup")


def test_noise_streams_do_not_shift_with_a_warmup_block():
    from dblock.reference.gemma_tiny import make_tiny_gemma
    m = make_tiny_gemma(seed=5, dtype=torch.float64)
    dec = DecodeConfig(max_new_tokens=2 * m.config.block_size, rule="entropy-bound", seed=3, steps=8)
    native_block_rng = ScheduleSpec("native", rng="block")
    a = generate(m, [[5, 6, 7]], dec, native_block_rng)
    b = generate(m, [[5, 6, 7]], dec, "oba")
    C = m.config.block_size
    # the first block's draws and logits are its own: identical trajectory, whatever the warm-up block does
    assert a.runs[0].generated[:C] == b.runs[0].generated[:C]
    assert a.counters[0].blocks[0].passes == b.counters[0].blocks[0].passes


# ---- FlowBlock -------------------------------------------------------------------------------------------------

def test_flowblock_gate_and_window():
    # block 1's rows clear one per pass (readiness 1/4, 2/4, ...); gate 0.5 starts block 2 after pass 2
    fwd = ScriptedForward(lambda p: (3, 99))
    res = generate(fwd, [[1, 2, 3, 4]], DecodeConfig(max_new_tokens=16, block_size=4),
                   schedule_spec("flowblock", window=3, gate=0.5))
    den = [items[0] for kind, items in fwd.calls if kind == "denoise"]
    widths = [len(it.segments) for it in den]
    assert widths[:3] == [1, 1, 2] and max(widths) <= 3
    assert all(torch.equal(it.visibility, block_causal(len(it.segments))) for it in den)
    assert [b.block for b in res.counters[0].blocks] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="window"):
        schedule_spec("flowblock", window=5)


def test_native2c_doubles_the_block():
    fwd = ScriptedForward(lambda p: (3, 1), block_size=4)
    res = generate(fwd, [[1, 2, 3, 4, 5, 6, 7, 8]], DecodeConfig(max_new_tokens=16, block_size=4), "native2c")
    assert [b.size for b in res.counters[0].blocks] == [8, 8]
