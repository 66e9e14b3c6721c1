"""Parity with the upstream decoders (docs/algorithms.md §2.1, §2.2, §2.4, §2.5).

Each oracle is a small, independent loop written from a published algorithm, over the plain model forward (no KV
cache, no dblock schedule, no dblock step rule):

  llada_generate    LLaDA `generate.py`: low-confidence remasking with a fixed number of tokens per step, over the
                    whole bidirectional sequence [prompt ; gen_length MASKs], MASK included in the argmax
  llada2_generate   LLaDA2.0 `generate`: blocks on the absolute grid, block-causal attention, per step the
                    positions with confidence > threshold, at least the quota (the block length split over
                    `steps`); temperature / top-k / top-p sampling, confidence = the sampled token's probability;
                    temperature 0 is greedy (LLaDA2.1's fix of the 2.0 code, which sampled at T = 1)
  dinfer_generate   dInfer's threshold decoder: rows whose argmax is MASK cannot commit; commit confidence >=
                    min(threshold, max confidence - 1e-5)

dblock runs the same settings through `generate` (the reference executor, KV cache and all) and must give the same
tokens. The tiny models are fp64, so the oracles' uncached forward and dblock's cached one agree to ~1e-15 and the
decisions (made in fp64, §2) cannot differ by rounding. Where an upstream decoder leaves MASK in its output (it
committed a MASK prediction that nothing re-decoded) dblock differs on purpose (§2.5); the cases below are checked
not to hit it.
"""

import pytest
import torch

from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from dblock.decoding.samplers import block_uniforms
from dblock.tiny import make_tiny_model

NEG = float("-inf")


# ---------------------------------------------------------------------------------------------------------------
# the plain forward: the model under a given attention mask, no cache
# ---------------------------------------------------------------------------------------------------------------

def logits_fn(model, block_causal_C=None):
    """x (L,) -> logits (L, V): bidirectional over x, or block-causal with blocks of C on the absolute grid."""
    def f(x):
        L = x.numel()
        if block_causal_C is None:
            mask = torch.ones(L, L, dtype=torch.bool)
        else:
            blk = torch.arange(L) // block_causal_C
            mask = blk[None, :] <= blk[:, None]
        with torch.no_grad():
            h, _ = model(x[None], torch.arange(L)[None], mask[None])
            return model.logits(h[0])
    return f


# ---------------------------------------------------------------------------------------------------------------
# oracles
# ---------------------------------------------------------------------------------------------------------------

def get_num_transfer_tokens(n, steps):
    base, rem = divmod(int(n), steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def llada_generate(f, prompt, *, mask_id, steps, gen_length, block_length):
    """LLaDA generate.py, temperature 0, remasking='low_confidence'."""
    P = len(prompt)
    x = torch.cat([torch.tensor(prompt), torch.full((gen_length,), mask_id)])
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    for nb in range(num_blocks):
        s, e = P + nb * block_length, P + (nb + 1) * block_length
        num_transfer = get_num_transfer_tokens(int((x[s:e] == mask_id).sum()), steps)
        for i in range(steps):
            mask_index = x == mask_id
            logits = f(x)
            x0 = torch.argmax(logits, dim=-1)
            p = torch.softmax(logits.to(torch.float64), dim=-1)
            x0_p = torch.gather(p, -1, x0[:, None]).squeeze(-1)
            x0_p[e:] = NEG
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(NEG, dtype=x0_p.dtype))
            _, idx = torch.topk(confidence, k=num_transfer[i])
            x[idx] = x0[idx]
    return x[P:].tolist()


def top_k_logits(logits, k):
    if not k:
        return logits
    kth = torch.topk(logits, k).values[..., -1, None]
    return torch.where(logits < kth, torch.full_like(logits, NEG), logits)


def top_p_logits(logits, p):
    if p is None or p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=True, stable=True)
    cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cum > p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, sorted_idx, remove)
    return logits.masked_fill(mask, NEG)


def multinomial(probs, u):
    """A categorical draw per row from a given uniform (the randomness is plugged in so both sides share it)."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    out = []
    for r in range(probs.shape[0]):
        x = float(u[r]) * float(cdf[r, -1])
        out.append(int((cdf[r] > x).nonzero()[0]))
    return torch.tensor(out)


def llada2_sample(logits, temperature, top_k, top_p, u):
    if temperature == 0:
        probs = torch.softmax(logits, dim=-1)
        x0_p, x0 = probs.max(dim=-1)
        return x0, x0_p
    logits = top_p_logits(top_k_logits(logits / temperature, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    x0 = multinomial(probs, u)
    return x0, probs.gather(-1, x0[:, None]).squeeze(-1)


def llada2_generate(f, prompt, *, mask_id, eos_id, gen_length, block_length, steps, threshold, temperature=0.0,
                    top_k=None, top_p=None, uniforms=None):
    """LLaDA2.0 generate (block-causal grid, threshold + steps quota). `uniforms(block, step)` -> (block_length,)."""
    C = block_length
    P = len(prompt)
    num_blocks = (P + gen_length + C - 1) // C
    x = torch.full((num_blocks * C,), mask_id)
    x[:P] = torch.tensor(prompt)
    schedule = get_num_transfer_tokens(C, steps)
    for b in range(P // C, num_blocks):
        end = (b + 1) * C
        for step in range(steps):
            active = x[end - C:end] == mask_id
            if not active.any():
                break
            logits = f(x[:end])[-C:]
            u = uniforms(b, step) if uniforms is not None else None
            x0, x0_p = llada2_sample(logits, temperature, top_k, top_p, u)
            k = schedule[step]
            confidence = torch.where(active, x0_p, torch.tensor(NEG, dtype=x0_p.dtype))
            high = confidence > threshold
            if int(high.sum()) >= k:
                transfer = high
            else:
                transfer = torch.zeros(C, dtype=torch.bool)
                transfer[torch.topk(confidence, k=min(k, int(active.sum()))).indices] = True
            blk = x[end - C:end]
            blk[transfer] = x0[transfer]
        if (x[P:end] == eos_id).any():
            break
    out = x[P:P + gen_length].tolist()
    return out[:out.index(eos_id) + 1] if eos_id in out else out


def dinfer_generate(f, prompt, *, mask_id, eos_id, gen_length, block_length, threshold, max_iters=200):
    """dInfer threshold decoding (`get_transfer_index_threshold`, rm_mask=True, float64) over grid blocks.
    Returns (tokens, near_tie): near_tie when the fallback committed several rows within 1e-5 of the best one."""
    C = block_length
    P = len(prompt)
    num_blocks = (P + gen_length + C - 1) // C
    x = torch.full((num_blocks * C,), mask_id)
    x[:P] = torch.tensor(prompt)
    near_tie = False
    for b in range(P // C, num_blocks):
        end = (b + 1) * C
        for _ in range(max_iters):
            mask_index = x[end - C:end] == mask_id
            if not mask_index.any():
                break
            logits = f(x[:end])[-C:]
            x0 = torch.argmax(logits, dim=-1)
            p = torch.softmax(logits.to(torch.float64), dim=-1)
            x0_p = p.gather(-1, x0[:, None]).squeeze(-1)
            mask_index = mask_index & (x0 != mask_id)
            confidence = torch.where(mask_index, x0_p, torch.tensor(NEG, dtype=torch.float64))
            actual = min(max(float(confidence.max()) - 1e-5, -1000.0), threshold)
            transfer = confidence >= actual
            if actual < threshold and int(transfer.sum()) > 1:
                near_tie = True
            blk = x[end - C:end]
            blk[transfer] = x0[transfer]
        else:
            raise AssertionError("dInfer oracle: block never finished")
        if (x[P:end] == eos_id).any():
            break
    out = x[P:P + gen_length].tolist()
    return (out[:out.index(eos_id) + 1] if eos_id in out else out), near_tie


# ---------------------------------------------------------------------------------------------------------------
# models and cases
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llada2():
    return [make_tiny_model("llada2_moe", seed=s, dtype=torch.float64) for s in (0, 1)]


@pytest.fixture(scope="module")
def llada2_eos():
    """EOS set to a token the random model emits, so the oracles' and dblock's EOS handling is exercised."""
    return make_tiny_model("llada2_moe", seed=0, dtype=torch.float64, eos_token_id=45, pad_token_id=45)


PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40] * 8, [12, 80, 3, 3, 9]]


def _no_mask(tokens, model):
    assert model.config.mask_token_id not in tokens, "oracle left MASK in its output (docs/algorithms.md §2.5)"


def test_llada_fixed_k_matches_generate_py():
    model = make_tiny_model("llada_moe", seed=0, dtype=torch.float64)
    cfg = model.config
    for prompt in PROMPTS:
        for steps, gen_length, C in ((16, 16, 8), (8, 16, 8), (12, 24, 8)):
            want = llada_generate(logits_fn(model), prompt, mask_id=cfg.mask_token_id, steps=steps,
                                  gen_length=gen_length, block_length=C)
            _no_mask(want, model)
            d = DecodeConfig(rule="fixed-k", steps=steps // (gen_length // C), max_new_tokens=gen_length,
                             block_size=C, mask_policy="official", ignore_eos=True)
            assert generate(model, [prompt], d).tokens[0] == want, (prompt, steps, gen_length)


@pytest.mark.parametrize("steps, threshold", [(8, 0.95), (4, 0.95), (8, 0.7), (3, 0.99)])
def test_llada2_threshold_and_quota_greedy(llada2, llada2_eos, steps, threshold):
    for model in llada2 + [llada2_eos]:
        cfg = model.config
        C = 8
        for prompt in PROMPTS:
            want = llada2_generate(logits_fn(model, C), prompt, mask_id=cfg.mask_token_id,
                                   eos_id=cfg.eos_token_id, gen_length=24, block_length=C, steps=steps,
                                   threshold=threshold)
            _no_mask(want, model)
            d = DecodeConfig(rule="threshold", threshold=threshold, threshold_steps=steps, max_new_tokens=24,
                             block_size=C, mask_policy="official")
            assert generate(model, [prompt], d).tokens[0] == want, (prompt, steps, threshold)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 20, None), (1.3, None, 0.9),
                                                       (0.5, 5, 0.8)])
def test_llada2_sampling(llada2, temperature, top_k, top_p):
    C, seed = 8, 17
    for model in llada2:
        cfg = model.config
        for prompt in PROMPTS:
            want = llada2_generate(logits_fn(model, C), prompt, mask_id=cfg.mask_token_id,
                                   eos_id=cfg.eos_token_id, gen_length=24, block_length=C, steps=8,
                                   threshold=0.9, temperature=temperature, top_k=top_k, top_p=top_p,
                                   uniforms=lambda b, s: block_uniforms(seed, b, s, C))
            _no_mask(want, model)
            d = DecodeConfig(rule="threshold", threshold=0.9, threshold_steps=8, max_new_tokens=24, block_size=C,
                             mask_policy="official", sampling_temperature=temperature, top_k=top_k or 0,
                             top_p=top_p or 1.0, seed=seed)
            assert generate(model, [prompt], d).tokens[0] == want, (prompt, temperature, top_k, top_p)


def test_llada2_greedy_threshold_without_quota_is_dblocks_default(llada2):
    """With steps = 1 block length the quota is 1 per pass: LLaDA2.0's decoder is the plain threshold rule with its
    single-row fallback, i.e. dblock's default (MASK handling aside)."""
    C = 8
    for model in llada2:
        cfg = model.config
        for prompt in PROMPTS:
            want = llada2_generate(logits_fn(model, C), prompt, mask_id=cfg.mask_token_id,
                                   eos_id=cfg.eos_token_id, gen_length=24, block_length=C, steps=C, threshold=0.95)
            _no_mask(want, model)
            d = DecodeConfig(max_new_tokens=24, block_size=C, mask_policy="official")
            assert generate(model, [prompt], d).tokens[0] == want


@pytest.mark.parametrize("threshold", [0.95, 0.8])
def test_dinfer_threshold_with_ineligible_mask(llada2, llada2_eos, threshold):
    C = 8
    checked = 0
    for model in llada2 + [llada2_eos]:
        cfg = model.config
        for prompt in PROMPTS:
            want, near_tie = dinfer_generate(logits_fn(model, C), prompt, mask_id=cfg.mask_token_id,
                                             eos_id=cfg.eos_token_id, gen_length=24, block_length=C,
                                             threshold=threshold)
            if near_tie:        # dInfer commits every row within 1e-5 of the best; dblock one (§2.1)
                continue
            d = DecodeConfig(threshold=threshold, threshold_inclusive=True, mask_policy="ineligible",
                             max_new_tokens=24, block_size=C, max_steps=200)
            assert generate(model, [prompt], d).tokens[0] == want, (prompt, threshold)
            checked += 1
    assert checked >= 8


def test_mask_policy_matters_when_mask_is_likely():
    """A model that sometimes predicts MASK: 'official' and 'ineligible' follow their upstream decoders (LLaDA2.0,
    dInfer), and both differ from 'exclude'."""
    model = make_tiny_model("llada2_moe", seed=3, dtype=torch.float64)
    cfg = model.config
    with torch.no_grad():                      # MASK's head row close to a frequent token's: MASK wins some rows
        model.lm_head.weight[cfg.mask_token_id] = 0.95 * model.lm_head.weight[83]
    C, outs, passes = 8, {}, {}
    for policy in ("exclude", "official", "ineligible"):
        d = DecodeConfig(max_new_tokens=24, block_size=C, mask_policy=policy, threshold_inclusive=policy != "official",
                         max_steps=200)
        res = [generate(model, [p], d) for p in PROMPTS]
        outs[policy] = [r.tokens[0] for r in res]
        passes[policy] = [r.counters[0].F for r in res]
    assert outs["exclude"] != outs["official"] and outs["exclude"] != outs["ineligible"]
    assert passes["exclude"] != passes["official"]         # committed MASK predictions cost passes
    assert all(cfg.mask_token_id not in t for o in outs.values() for t in o)
    for prompt, got_ine, got_off in zip(PROMPTS, outs["ineligible"], outs["official"]):
        want, near_tie = dinfer_generate(logits_fn(model, C), prompt, mask_id=cfg.mask_token_id,
                                         eos_id=cfg.eos_token_id, gen_length=24, block_length=C, threshold=0.95)
        assert near_tie or got_ine == want
        want = llada2_generate(logits_fn(model, C), prompt, mask_id=cfg.mask_token_id, eos_id=cfg.eos_token_id,
                               gen_length=24, block_length=C, steps=C, threshold=0.95)
        _no_mask(want, model)
        assert got_off == want
