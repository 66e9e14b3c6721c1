"""Native decoding of DiffusionGemma through `dblock.decoding.generate.generate` against transformers'
`DiffusionGemmaForBlockDiffusion.generate`: identical tokens, identical pass counts, EOS and pad.

Batch size. Token identity is checked at batch 1 (`torch.manual_seed(S)` + transformers' generate versus one
generator per request seeded with S). transformers' *batched* generate cannot be reproduced token for token, by
design on both sides: it draws one randint (B, C) and one multinomial over B*C rows per step from the global stream,
so a row's draws depend on every other row; rows that finished keep consuming draws until all rows stop; and
left-padded prompts share one arange of positions, shifting the shorter prompts. dblock gives each request its own
generator (a request's tokens never depend on the batch) and its own positions. Parity at batch 3 is covered by the
teacher-forced logits test in test_gemma_model.py; here batch 3 is run end to end for its counters.
"""
import pytest
import torch

import dblock
from dblock.decoding.params import DecodeConfig
from dblock.tiny import save_for_transformers
from dblock.decoding.entropy_bound import transformers_tpf_of
from dblock.decoding.generate import generate
from tests.reference.gemma_util import hf_generate, hf_twin, make_ours, one_thread

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


CASES = [
    # (config, seed, prompt, DecodeConfig overrides)
    ("tiny", 0, [5, 6, 7, 8, 9], dict(max_new_tokens=48)),
    ("tiny", 2, list(range(30, 41)), dict(max_new_tokens=48)),
    ("tiny", 7, [200], dict(max_new_tokens=32)),
    # canvas 8, window 4, a budget that is not a multiple of the canvas, non-default sampler settings
    ("w4", 1, [9, 8, 7, 6, 5, 4], dict(max_new_tokens=20, steps=12, entropy_bound=0.3, temperature=(1.0, 0.5),
                                       stability=2, confidence=0.05)),
    ("untied", 3, [11, 12, 13], dict(max_new_tokens=24, steps=16)),
]


@pytest.mark.parametrize("name,seed,prompt,over", CASES, ids=[f"{c[0]}-s{c[1]}" for c in CASES])
def test_native_tokens_and_passes_identical(tmp_path, name, seed, prompt, over):
    ours = make_ours(name, seed=seed + 10)
    hf = hf_twin(ours, str(tmp_path / name), exact=False)   # transformers as a user runs it (sdpa, grouped_mm)
    dec = DecodeConfig(rule="entropy-bound", seed=seed, **over)
    res = generate(ours, [prompt], dec)
    theirs, passes, tpf = hf_generate(hf, prompt, seed, dec)
    run, c = res.runs[0], res.counters[0]
    assert run.generated == theirs                          # every committed canvas, pad after EOS included
    assert c.F == passes and c.Q == c.F + c.K and c.K == len(theirs) // ours.config.canvas_length
    assert transformers_tpf_of(res)[0] == pytest.approx(tpf, rel=1e-6)
    assert res.tokens[0] == theirs[:len(res.tokens[0])] and len(res.tokens[0]) == c.Y <= dec.max_new_tokens


def test_native_bf16_identical(tmp_path):
    """bfloat16 weights on both sides (transformers with eager attention and experts, the reference's op order)."""
    save_for_transformers(make_ours("tiny", seed=8), str(tmp_path / "m"))
    hf = hf_twin(None, str(tmp_path / "m"), dtype=torch.bfloat16)
    ours = dblock.load(str(tmp_path / "m"), dtype="bfloat16")
    dec = DecodeConfig(rule="entropy-bound", seed=9, max_new_tokens=32, steps=24)
    res = generate(ours, [[17, 18, 19, 20]], dec)
    theirs, passes, _ = hf_generate(hf, [17, 18, 19, 20], 9, dec)
    assert res.runs[0].generated == theirs and res.counters[0].F == passes


@pytest.mark.parametrize("name,seed", [("tiny", 4), ("w4", 5)])
def test_eos_stops_and_pads_like_transformers(tmp_path, name, seed):
    """EOS forced into the second canvas: pick as EOS a token the first run puts in canvas 2 but not in canvas 1
    (the trajectory up to the end of canvas 2 is unchanged by the choice). Both stop after canvas 2 and pad after
    the EOS; counters count up to and including it."""
    ours = make_ours(name, seed=seed)
    C = ours.config.canvas_length
    dec = DecodeConfig(rule="entropy-bound", max_new_tokens=4 * C, seed=seed, steps=16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ours.config.eos_token_ids = (ours.config.vocab_size,)  # probe run: an id the model cannot produce
    first = generate(ours, [prompt], dec).runs[0].generated
    assert len(first) == 4 * C
    j = next(i for i in range(C, 2 * C) if first[i] not in first[:C] and first[i] != 0)
    eos = first[j]
    ours.config.eos_token_ids = (eos,)
    hf = hf_twin(ours, str(tmp_path / name), exact=False)
    res = generate(ours, [prompt], dec)
    theirs, passes, tpf = hf_generate(hf, prompt, seed, dec, eos=eos)
    run, c = res.runs[0], res.counters[0]
    k = first.index(eos)
    assert run.generated == theirs == first[:k + 1] + [0] * (2 * C - k - 1)
    assert res.tokens[0] == first[:k + 1] and c.Y == k + 1 and c.K == 2 and c.blocks[-1].eos
    assert c.F == passes and c.Q == c.F + 2
    assert transformers_tpf_of(res)[0] == pytest.approx(tpf, rel=1e-6)


def test_batch3_end_to_end_counters():
    ours = make_ours("w4", seed=6)
    dec = DecodeConfig(rule="entropy-bound", max_new_tokens=20, steps=10)
    prompts = [[5], list(range(20, 33)), [7, 8, 9, 10]]
    res = generate(ours, prompts, dec, seeds=[1, 2, 3])
    for r, c, toks in zip(res.runs, res.counters, res.tokens):
        assert c.Q == c.F + c.K and c.F == sum(b.passes for b in c.blocks) and 0 < c.Y <= 20
        assert all(1 <= b.passes <= 10 for b in c.blocks) and toks == r.output_tokens()
    s = res.summary()
    assert s["Y"] == sum(c.Y for c in res.counters) and s["TPF"] == pytest.approx(s["Y"] / s["Q"])
    # a request alone gets the same sampler stream (its own generator); decisions depend on its logits only
    alone = generate(ours, [prompts[1]], dec, seeds=[2])
    assert alone.counters[0].K >= 1


@pytest.mark.parametrize("schedule", ["oba", "flowblock", "no_accept", "drop_time", "dense_mask"])
def test_multi_block_schedules_run(schedule):
    """The rule's warm-up / promotion hooks under the schedules that use them (their semantics are tested in
    test_gemma_sampler.py): every request finishes, blocks commit in order, warm-up passes are recorded."""
    ours = make_ours("w4", seed=7)
    dec = DecodeConfig(rule="entropy-bound", max_new_tokens=24, steps=8)
    res = generate(ours, [[5, 6, 7], [40, 41]], dec, schedule=schedule, seeds=[0, 1])
    for c in res.counters:
        assert [b.block for b in c.blocks] == list(range(c.K)) and c.Q == c.F + c.K
        assert all(b.passes >= 1 for b in c.blocks)
        if c.K > 1:
            assert any(b.warmup_steps > 0 for b in c.blocks[1:])
