"""The LLaDA reference model: KV-cache path == recompute path, batch invariance, both families end to end."""
import pytest
import torch

import dblock
from dblock.decoding.params import DecodeConfig
from dblock.forward import Segment, StepInput, block_causal
from dblock.reference.executor import LladaReference
from dblock.decoding.generate import generate
from dblock.tiny import make_tiny_model
from tests.conftest import tol


def seg(tokens, start, block, live=None):
    n = len(tokens)
    live = torch.zeros(n, dtype=torch.bool) if live is None else live
    return Segment(block=block, tokens=torch.tensor(tokens), positions=torch.arange(start, start + n), live=live,
                   decoded=~live)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cache_path_equals_recompute_path(dtype):
    model = make_tiny_model("llada2_moe", seed=1, dtype=dtype)
    fwd = LladaReference(model)
    C, M = 8, model.config.mask_token_id
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randint(0, 90, (C,), generator=g).tolist() for _ in range(3)]
    cur = torch.randint(0, 90, (C,), generator=g)
    cur[torch.tensor([1, 4, 6])] = M
    live = cur == M
    # KV path: prefill blocks 0, 1 (block-causal), append block 2, then denoise block 3
    cache = fwd.new_cache()
    fwd.append([StepInput(0, [seg(blocks[0], 0, 0), seg(blocks[1], C, 1)], block_causal(2), cache)])
    fwd.append([StepInput(0, [seg(blocks[2], 2 * C, 2)], block_causal(1), cache)])
    assert cache.length == 3 * C
    kv = fwd.denoise([StepInput(0, [seg(cur.tolist(), 3 * C, 3, live)], block_causal(1), cache)])[0][0]
    # recompute path: all four blocks in one call, block-causal, no cache
    segs = [seg(b, i * C, i) for i, b in enumerate(blocks)] + [seg(cur.tolist(), 3 * C, 3, live)]
    rc = fwd.denoise([StepInput(0, segs, block_causal(4), None)])[0][-1]
    assert kv.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(kv, rc, **tol(dtype))


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
def test_batch_invariance_mixed_prompt_lengths(family):
    model = make_tiny_model(family, seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (3, 11, 1, 8, 17)]
    dec = DecodeConfig(max_new_tokens=20)
    together = generate(model, prompts, dec)
    alone = [generate(model, [p], dec).tokens[0] for p in prompts]
    assert together.tokens == alone
    assert [c.F for c in together.counters] == [generate(model, [p], dec).counters[0].F for p in prompts]


def test_kv_cache_and_no_cache_give_the_same_tokens(tiny_dirs):
    model = dblock.load(tiny_dirs["llada2_moe"], dtype="float64")
    prompts = [[5, 6, 7], list(range(10, 29))]
    a = generate(model, prompts, DecodeConfig(max_new_tokens=40))
    b = generate(model, prompts, DecodeConfig(max_new_tokens=40, no_cache=True))
    assert a.tokens == b.tokens and [c.F for c in a.counters] == [c.F for c in b.counters]


def test_fixed_k_rule_end_to_end(tiny_dirs):
    model = dblock.load(tiny_dirs["llada2_moe"])
    res = generate(model, [[5, 6, 7]], DecodeConfig(max_new_tokens=16, rule="fixed-k", steps=4))
    # block 0 holds 3 prompt rows + 5 masks (4 passes), blocks 1, 2 hold 8 masks each (4 passes)
    assert [b.passes for b in res.counters[0].blocks] == [4, 4, 4]


def test_llada_moe_sees_the_future_masks(tiny_dirs):
    """Full bidirectional layout: changing the length of the MASK tail changes the current block's logits."""
    model = dblock.load(tiny_dirs["llada_moe"], dtype="float64")
    fwd = LladaReference(model)
    M = model.config.mask_token_id
    short = fwd.denoise([StepInput(0, [seg([5, 6, 7] + [M] * 8, 0, 0, torch.tensor([False] * 3 + [True] * 8))],
                                   block_causal(1), None)])[0][0]
    long = fwd.denoise([StepInput(0, [seg([5, 6, 7] + [M] * 16, 0, 0,
                                          torch.tensor([False] * 3 + [True] * 8 + [False] * 8))],
                                  block_causal(1), None)])[0][0]
    assert not torch.allclose(short, long)
