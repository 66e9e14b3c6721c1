"""The decoding attention stacks the query heads of one kv head against its keys (no per-head copy of K and V): the
same attention as torch's own grouped-query SDPA (`enable_gqa`: query head n reads kv head n // (N / G)), with a
committed cache, masked keys and query heads several to a kv head."""
import pytest
import torch

from dblock.decoding.generate import reference_forward
from dblock.forward import Segment, StepInput, block_causal
from dblock.tasks.train_model import set_fused_attention
from dblock.tiny import make_tiny_model


def _segment(tokens, start, block, live):
    n = len(tokens)
    return Segment(block=block, tokens=torch.tensor(tokens), positions=torch.arange(start, start + n),
                   live=torch.full((n,), live), decoded=torch.full((n,), not live))


def _logits(model, prompts, current):
    """Append each request's prompt to its cache, then one denoising call over its current block."""
    fwd = reference_forward(model)
    caches = [fwd.new_cache() for _ in prompts]
    C = model.config.block_size
    fwd.append([StepInput(i, [_segment(p, 0, 0, False)], block_causal(1), caches[i]) for i, p in enumerate(prompts)])
    out = fwd.denoise([StepInput(i, [_segment(c, C, 1, True)], block_causal(1), caches[i])
                       for i, c in enumerate(current)])
    return torch.cat([o[0] for o in out])


@pytest.mark.parametrize("family", ["llada2_moe", "diffusion_gemma"])
@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (4, 1)])
def test_grouped_attention_is_torch_gqa(family, heads):
    N, G = heads
    model = make_tiny_model(family, seed=5, dtype=torch.float64, num_attention_heads=N, num_key_value_heads=G)
    C, M = model.config.block_size, model.config.mask_token_id
    g = torch.Generator().manual_seed(1)
    # prompts of different lengths (padded, masked keys) and current blocks
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (C, C - 3, 5)]
    current = []
    for _ in prompts:
        c = torch.randint(0, 90, (C,), generator=g)
        if M is not None:                                   # a masked model: half the block still masked
            c[torch.randperm(C, generator=g)[:C // 2]] = M
        current.append(c.tolist())
    ours = _logits(model, prompts, current)
    set_fused_attention(model, True)
    theirs = _logits(model, prompts, current)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)


def test_attention_bias_is_the_mask_and_follows_it():
    """The additive mask is 0 / -inf where the mask is True / False; the kept one is made again for a mask changed
    in place or for another mask tensor, and is reused only for the very same unchanged tensor."""
    from dblock.reference.llada import attention_bias
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 5, generator=g) > 0.3
    b = attention_bias(mask, torch.float32)
    assert torch.equal(b == 0, mask) and bool(torch.isneginf(b[~mask]).all())
    assert attention_bias(mask, torch.float32) is b
    assert attention_bias(mask, torch.float64).dtype == torch.float64
    mask[0, 0, 0] = not bool(mask[0, 0, 0])                   # changed in place: made again
    b2 = attention_bias(mask, torch.float32)
    assert torch.equal(b2 == 0, mask)
    other = mask.clone()
    other[1, 2, 4] = not bool(other[1, 2, 4])
    assert torch.equal(attention_bias(other, torch.float32) == 0, other)
    assert torch.equal(attention_bias(mask, torch.float32) == 0, mask)
