"""Sampling, stop conditions and the parity options of the masked rules (docs/algorithms.md §2.1, §2.4-§2.6)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dblock.decoding.generate import generate, reference_forward
from dblock.decoding.params import DecodeConfig, SamplingParams
from dblock.decoding.samplers import (MaskedBlock, filter_top_k, filter_top_p, inverse_cdf, masked_step,
                                      pass_uniforms, predict, sample, sampling_probs, threshold_commit,
                                      threshold_rule)
from dblock.decoding.schedules import Request
from dblock.decoding.stopping import Stopper
from dblock.errors import ConfigError
from dblock.tiny import make_tiny_model

V, MASK = 8, 7


@pytest.fixture(scope="module")
def masked():
    return reference_forward(make_tiny_model("llada2_moe", seed=0))


@pytest.fixture(scope="module")
def fullseq():
    return reference_forward(make_tiny_model("llada_moe", seed=1))


@pytest.fixture(scope="module")
def eos_models():
    """Tiny models whose EOS is a token they often emit (random tiny models otherwise never stop)."""
    return [reference_forward(make_tiny_model("llada2_moe", seed=0, eos_token_id=45, pad_token_id=45)),
            reference_forward(make_tiny_model("llada_moe", seed=1, eos_token_id=56, pad_token_id=56))]


def dec(**kw):
    base = dict(max_new_tokens=24, block_size=8)
    base.update(kw)
    return DecodeConfig(**base)


prompts_st = st.lists(st.integers(0, 90), min_size=1, max_size=11)


# ---- the sampler on hand-made logits --------------------------------------------------------------------------

def test_top_k_keeps_ties_of_the_kth():
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert torch.isinf(filter_top_k(z, 2)).tolist() == [[False, True, False, False, True]]
    assert torch.equal(filter_top_k(z, 0), z) and torch.equal(filter_top_k(z, 9), z)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    z = p.log()
    assert torch.isinf(filter_top_p(z, 0.45)).tolist() == [[False, True, True, True]]
    assert torch.isinf(filter_top_p(z, 0.55)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_p(z, 0.75)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_p(z, 0.85)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_top_p(z, 1e-6)).tolist() == [[False, True, True, True]]  # the top token always stays


def test_inverse_cdf_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]], dtype=torch.float64).expand(4000, 4)
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok = inverse_cdf(probs, u)
    freq = torch.bincount(tok, minlength=4).double() / 4000
    assert freq[1] == 0 and torch.allclose(freq, probs[0], atol=0.03)
    edges = inverse_cdf(probs[:3], torch.tensor([0.0, 0.1 - 1e-12, 0.1], dtype=torch.float64))
    assert edges.tolist() == [0, 0, 2]


@settings(max_examples=40)
@given(st.integers(0, 10 ** 6), st.floats(0.05, 5.0), st.sampled_from([0, 1, 3]), st.sampled_from([1.0, 0.9, 0.3]))
def test_sampled_confidence_is_the_drawn_tokens_probability(seed, T, k, p):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(5, 11, generator=g) * 3
    sp = SamplingParams(temperature=T, top_k=k, top_p=p)
    u = torch.rand(5, generator=g, dtype=torch.float64)
    tok, conf = sample(z, sp, u)
    probs = sampling_probs(z, T, k, p)
    assert torch.equal(conf, probs.gather(-1, tok[:, None]).squeeze(-1)) and bool((conf > 0).all())


@settings(max_examples=40)
@given(st.integers(0, 10 ** 6), st.floats(0.01, 100.0), st.sampled_from([torch.float32, torch.float64]))
def test_top_k_1_draws_the_greedy_token(seed, T, dtype):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(6, 13, generator=g) * 4).to(dtype)
    u = torch.rand(6, generator=g, dtype=torch.float64)
    tok, conf = sample(z, SamplingParams(temperature=T, top_k=1), u)
    assert torch.equal(tok, z.argmax(-1)) and bool((conf == 1).all())


def test_temperature_zero_ignores_the_filters():
    z = torch.randn(4, 9, generator=torch.Generator().manual_seed(3))
    a = sample(z, SamplingParams())
    b = sample(z, SamplingParams(top_k=2, top_p=0.5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_pass_uniforms_are_stateless_and_distinct():
    a = pass_uniforms(12345, 0, 8)
    assert torch.equal(a, pass_uniforms(12345, 0, 8))
    assert not torch.equal(a, pass_uniforms(12345, 1, 8)) and not torch.equal(a, pass_uniforms(12346, 0, 8))
    assert a.dtype == torch.float64 and bool(((a >= 0) & (a < 1)).all())


# ---- threshold comparison, dtype, quota, MASK policy ------------------------------------------------------------

def _rows(probs_rows, mask_logit=-30.0, dtype=torch.float32):
    """Logits over V whose softmax over the 7 real tokens gives the listed probabilities (token i -> row's p_i)."""
    z = torch.full((len(probs_rows), V), -30.0, dtype=torch.float64)
    for r, (t, p) in enumerate(probs_rows):
        rest = (1 - p) / 6
        z[r, :MASK] = math.log(rest)
        z[r, t] = math.log(p)
        z[r, MASK] = mask_logit
    return z.to(dtype)


def test_threshold_is_strict_unless_inclusive():
    z = _rows([(1, 0.95), (2, 0.99)])
    tau = float(predict(z, MASK)[1][0])                           # row 0's confidence exactly
    assert threshold_rule(z, MASK, tau).commit.tolist() == [False, True]
    assert threshold_rule(z, MASK, tau, inclusive=True).commit.tolist() == [True, True]


def test_fp64_logits_decide_in_fp64():
    base = _rows([(1, 0.6), (1, 0.6)], dtype=torch.float64)
    base[1, 1] += 1e-12                                         # row 1 more confident by ~1e-13: an fp32 tie
    tok, conf = predict(base, MASK)
    assert conf.dtype == torch.float64 and conf[1] > conf[0]
    assert threshold_rule(base, MASK).commit.tolist() == [False, True]
    assert threshold_rule(base.float(), MASK).commit.tolist() == [True, False]   # fp32: a tie -> lowest row


def test_steps_quota_commits_max_of_above_and_quota():
    conf = torch.tensor([0.99, 0.5, 0.6, 0.3])
    assert threshold_commit(conf, 0.95, quota=2).tolist() == [True, False, True, False]
    assert threshold_commit(conf, 0.95, quota=1).tolist() == [True, False, False, False]
    assert threshold_commit(conf, 0.95, quota=0).tolist() == [True, False, False, False]
    assert threshold_commit(torch.tensor([0.5, 0.5]), 0.95, quota=0).tolist() == [False, False]
    assert threshold_commit(conf, 0.95, quota=9).all()


def test_steps_quota_block_finishes_within_s_passes():
    b = MaskedBlock(torch.tensor([3, MASK, MASK, MASK, MASK, MASK]), torch.tensor([True] + [False] * 5), MASK)
    seen = []
    while not b.done:
        n = int(b.live.sum())
        masked_step(b, _rows([(1, 0.4)] * n), "threshold", 0.95, 64, 0, quota_steps=3)
        seen.append(n - int(b.live.sum()))
    assert b.schedule == [2, 2, 2] and seen == [2, 2, 1] and b.passes == 3   # quota over C = 6, capped at live


def test_mask_policies():
    z = _rows([(1, 0.97), (2, 0.6)])
    z[0, MASK] = 10.0                                           # row 0: MASK is the argmax
    ex = threshold_rule(z, MASK)
    assert ex.tokens.tolist() == [1, 2] and ex.commit.tolist() == [True, False]
    off = threshold_rule(z, MASK, mask_policy="official")
    assert off.tokens.tolist() == [MASK, 2] and off.commit.tolist() == [True, False]
    z2 = z
    ine = threshold_rule(z2, MASK, mask_policy="ineligible")
    assert ine.tokens.tolist() == [MASK, 2] and ine.commit.tolist() == [False, True]   # the fallback skips row 0
    b = MaskedBlock(torch.full((2,), MASK), torch.zeros(2, dtype=torch.bool), MASK)
    masked_step(b, z2, "threshold", 0.95, 64, 0, mask_policy="official")          # commits row 0 = MASK: stays live
    assert b.tokens.tolist() == [MASK, MASK] and b.passes == 1
    masked_step(b, z2, "threshold", 0.95, 2, 0, mask_policy="official")           # the last pass: real tokens
    assert b.tokens.tolist() == [1, 2]


# ---- validation ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(sampling_temperature=-1.0), "sampling_temperature"), (dict(sampling_temperature=float("nan")),
                                                                 "sampling_temperature"),
    (dict(sampling_temperature=1e-9), "sampling_temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_p=float("inf")), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(stop=["abc"]), "stop"), (dict(stop=[[]]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=500), "min_tokens"), (dict(ignore_eos=1), "ignore_eos"), (dict(n=0), "n"),
    (dict(mask_policy="maybe"), "mask_policy"), (dict(threshold_steps=0), "threshold_steps"),
    (dict(rule="fixed-k", threshold_steps=4), "threshold_steps"), (dict(threshold_inclusive="yes"),
                                                                   "threshold_inclusive"),
    (dict(entropy_bound=float("nan")), "entropy_bound"), (dict(seed=1.5), "seed"),
])
def test_decode_config_refuses_with_the_field_name(kw, field):
    with pytest.raises(ConfigError, match=field):
        DecodeConfig(**kw).validate()


def test_sampling_params_normalise_and_refuse():
    sp = SamplingParams(stop=[[5, 6], 7, (5, 6)], stop_token_ids=[9, 9, 2])
    assert sp.stop == ((5, 6), (7,)) and sp.stop_token_ids == (9, 2)
    assert DecodeConfig(stop=[[1, 2]], stop_token_ids=[4]).validate().stop == ((1, 2),)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=2)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=True)


def test_request_level_checks(masked):
    with pytest.raises(ConfigError, match="vocabulary"):
        generate(masked, [[1, 2]], dec(stop_token_ids=[500]))
    with pytest.raises(ConfigError, match="min_tokens"):
        generate(masked, [Request([1, 2], 4, sampling=SamplingParams(min_tokens=5))], dec())
    gemma = reference_forward(make_tiny_model("diffusion_gemma", seed=0))
    with pytest.raises(ConfigError, match="entropy-bound"):
        generate(gemma, [[1, 2]], DecodeConfig(rule="entropy-bound", max_new_tokens=8, sampling_temperature=0.7))
    with pytest.raises(ValueError, match="mask_policy"):
        generate(gemma, [[1, 2]], DecodeConfig(rule="entropy-bound", max_new_tokens=8, mask_policy="official"))


# ---- generate-level properties ---------------------------------------------------------------------------------

@settings(max_examples=8)
@given(prompts_st, st.sampled_from([0, 1, 5]), st.sampled_from([1.0, 0.5]))
def test_temperature_zero_is_greedy(masked, prompt, k, p):
    base = generate(masked, [prompt], dec())
    assert generate(masked, [prompt], dec(sampling_temperature=0.0, top_k=k, top_p=p)).tokens == base.tokens


@settings(max_examples=6)
@given(prompts_st, prompts_st, st.integers(0, 2 ** 31), st.sampled_from(["native", "oba"]))
def test_seeded_sampling_independent_of_batch(masked, p, q, seed, schedule):
    d = dec(sampling_temperature=0.9, top_p=0.95, top_k=20)
    alone = generate(masked, [p], d, schedule, seeds=[seed])
    batch = generate(masked, [q, p, q], d, schedule, seeds=[seed + 1, seed, seed + 7])
    assert batch.tokens[1] == alone.tokens[0]
    # per-request sampling in a batch of greedy requests: the same tokens again
    mixed = generate(masked, [Request(q, 24, seed=3, id="g"),
                              Request(p, 24, seed=seed, id="s", sampling=d.sampling_params())], dec(), schedule)
    assert mixed.tokens[1] == alone.tokens[0] and mixed.tokens[0] == generate(masked, [q], dec(), schedule).tokens[0]


def test_sampling_changes_tokens_and_reproduces(masked):
    d = dec(sampling_temperature=1.5, max_new_tokens=32)
    ps = [[5, 6, 7], [9, 1]]
    a = generate(masked, ps, d, seeds=[1, 2])
    assert a.tokens == generate(masked, ps, d, seeds=[1, 2]).tokens
    assert a.tokens != generate(masked, ps, d, seeds=[3, 4]).tokens
    assert a.tokens != generate(masked, ps, dec(max_new_tokens=32)).tokens


def test_n_samples_are_seeds_in_a_row(masked):
    d = dec(sampling_temperature=1.0, n=3, seed=10)
    r = generate(masked, [[4, 5], [6]], d)
    assert len(r.tokens) == 6 and r.samples(1) == r.tokens[3:]
    for j in range(3):
        assert r.samples(0)[j] == generate(masked, [[4, 5]], d.replace(n=1, seed=10 + j)).tokens[0]


def _no_eos(fwd, prompt, **kw):
    return generate(fwd, [prompt], dec(ignore_eos=True, max_new_tokens=32, **kw)).tokens[0]


@settings(max_examples=10)
@given(prompts_st, st.data())
def test_stop_sequences_truncate(masked, prompt, data):
    full = _no_eos(masked, prompt)
    assert len(full) == 32                                     # ignore_eos: the whole budget
    i = data.draw(st.integers(0, 30))
    L = data.draw(st.integers(1, 3))
    seq = tuple(full[i:i + L])
    r = generate(masked, [prompt], dec(ignore_eos=True, max_new_tokens=32, stop=[seq]))
    end = next(j + len(seq) for j in range(len(full)) if tuple(full[j:j + len(seq)]) == seq)
    assert r.tokens[0] == full[:end] and r.counters[0].Y == end
    assert r.finish_reasons == ["stop"] and r.stop_reasons == [seq]
    t = full[i]
    r2 = generate(masked, [prompt], dec(ignore_eos=True, max_new_tokens=32, stop_token_ids=[t]))
    assert r2.tokens[0] == full[:full.index(t) + 1] and r2.stop_reasons == [t]


def test_stop_sequence_across_blocks_and_budget(fullseq):
    full = _no_eos(fullseq, [3, 4, 5])
    seq = tuple(full[6:10])                                    # spans the blocks [0, 8) and [8, 16)
    r = generate(fullseq, [[3, 4, 5]], dec(ignore_eos=True, max_new_tokens=32, stop=[seq]))
    end = next(j + 4 for j in range(32) if tuple(full[j:j + 4]) == seq)
    assert r.tokens[0] == full[:end] and r.counters[0].K == (end - 1) // 8 + 1
    r = generate(fullseq, [[3, 4, 5]], dec(ignore_eos=True, max_new_tokens=32, stop=[(999 % 96, 998 % 96, 7, 7)]))
    assert r.tokens[0] == full and r.finish_reasons == ["length"] and r.stop_reasons == [None]


@settings(max_examples=8)
@given(prompts_st, st.integers(1, 20), st.booleans())
def test_min_tokens_suppresses_eos_and_stop_ids(eos_models, prompt, m, which):
    fwd = eos_models[which]
    eos = fwd.config.eos_token_id
    out = _no_eos(fwd, prompt)
    stop_id = out[0] if out[0] != eos else out[-1]
    r = generate(fwd, [prompt], dec(max_new_tokens=32, min_tokens=m, stop_token_ids=[stop_id]))
    toks = r.tokens[0]
    assert all(t not in (eos, stop_id) for t in toks[:m])
    if r.finish_reasons == ["stop"]:
        assert len(toks) >= m + 1 and toks[-1] in (eos, stop_id) and r.stop_reasons[0] == toks[-1]
    else:
        assert len(toks) == 32


def test_min_tokens_moves_eos(eos_models):
    fwd = eos_models[0]
    a = generate(fwd, [[1, 2, 3]], dec(max_new_tokens=32)).tokens[0]
    b = generate(fwd, [[1, 2, 3]], dec(max_new_tokens=32, min_tokens=10)).tokens[0]
    assert a[-1] == b[-1] == 45 and len(a) < 10 < len(b)


def test_ignore_eos_decodes_the_whole_budget(eos_models):
    stopped = 0
    for fwd in eos_models:
        eos = fwd.config.eos_token_id
        for p in ([1, 2, 3], [7], [40, 41, 42, 43, 44]):
            a = generate(fwd, [p], dec(max_new_tokens=32)).tokens[0]
            b = _no_eos(fwd, p)
            assert len(b) == 32 and a == b[:len(a)]            # the same decisions; only the end differs
            if len(a) < 32:
                stopped += 1
                assert a[-1] == eos and eos in b
    assert stopped >= 3
    gemma = reference_forward(make_tiny_model("diffusion_gemma", seed=0))
    r = generate(gemma, [[1, 2]], DecodeConfig(rule="entropy-bound", max_new_tokens=20, steps=4, ignore_eos=True))
    assert len(r.tokens[0]) == 20


def test_stopper_counts_from_min_tokens():
    s = Stopper([1], SamplingParams(stop=[(4, 5)], min_tokens=3))
    assert s.feed([1, 4, 5]) == 3 and not s.stopped              # EOS at 0 and (4,5) ending at 2: before min_tokens
    assert s.feed([9, 4, 5, 6]) == 3 and s.reason == (4, 5) and s.out == [1, 4, 5, 9, 4, 5]
    s = Stopper([1], SamplingParams(ignore_eos=True, stop_token_ids=[8]))
    assert s.feed([1, 1, 8, 2]) == 3 and s.reason == 8


def test_uniform_family_stops_and_min_tokens():
    import dblock
    fwd = reference_forward(dblock.load("tiny-uniform"))
    d = DecodeConfig(rule="entropy-bound", max_new_tokens=32, steps=8)
    base = generate(fwd, [[5, 6, 7]], d).tokens[0]
    x = base[1]                                                      # a token the model emits early: the stop id
    assert x in base[:12] and x != fwd.config.eos_token_id
    r = generate(fwd, [[5, 6, 7]], d.replace(stop_token_ids=[x]))
    assert r.tokens[0] == base[:base.index(x) + 1] and r.stop_reasons == [x]
    r = generate(fwd, [[5, 6, 7]], d.replace(stop_token_ids=[x], min_tokens=12))
    toks = r.tokens[0]
    assert x not in toks[:12] and (toks[-1] == x or len(toks) == 32)
    seq = tuple(base[3:5])
    end = next(j + 2 for j in range(31) if tuple(base[j:j + 2]) == seq)
    r = generate(fwd, [[5, 6, 7]], d.replace(stop=[seq]))
    assert r.tokens[0] == base[:end] and r.finish_reasons == ["stop"]
