"""Masked diffusion cannot revise a revealed token, so on masked models a waiting block (OBA's warm-up block and its
ablations, FlowBlock's later blocks) decodes nothing before promotion (docs/algorithms.md §3): every multi-block
schedule gives Native's tokens and passes, greedy or sampled, and only pays for the wider pass."""
import pytest

from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from dblock.tiny import make_tiny_model

SCHEDULES = ["oba", "flowblock", "drop_time", "keep_signal", "keep_tokens", "no_accept", "no_signal"]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llada2_moe", seed=7, block_size=8)


@pytest.mark.parametrize("dec", [DecodeConfig(max_new_tokens=32, rule="fixed-k", steps=4),
                                 DecodeConfig(max_new_tokens=32, threshold=0.3, max_steps=6),
                                 DecodeConfig(max_new_tokens=32, rule="fixed-k", steps=4, sampling_temperature=0.8,
                                              seed=3)], ids=["fixed-k", "threshold", "sampled"])
def test_multiblock_schedules_give_natives_tokens_on_masked_models(model, dec):
    prompts = [[5, 6, 7], [9] * 11, [4, 3, 2, 1, 5, 6]]
    nat = generate(model, prompts, dec, "native")
    for name in SCHEDULES:
        res = generate(model, prompts, dec, name)
        assert res.tokens == nat.tokens, name
        assert [(c.F, c.K, c.Y) for c in res.counters] == [(c.F, c.K, c.Y) for c in nat.counters], name
        assert [b.passes for c in res.counters for b in c.blocks] == \
            [b.passes for c in nat.counters for b in c.blocks], name


def test_the_waiting_block_rides_every_pass_but_decodes_nothing(model):
    from tests.reference.scripted import ScriptedForward
    fwd = ScriptedForward(lambda p: (3, 1), block_size=4)     # every live row clears tau on its first pass
    res = generate(fwd, [[1, 2, 3, 4]], DecodeConfig(max_new_tokens=12, block_size=4), "oba")
    den = [items[0] for kind, items in fwd.calls if kind == "denoise"]
    assert [len(it.segments) for it in den] == [2, 2, 1]      # the final block has no warm-up block
    assert all(bool(it.segments[1].live.all()) for it in den[:2])   # the warm-up half stays all MASK
    assert [b.passes for b in res.counters[0].blocks] == [1, 1, 1]
