"""The shadow (teacher-forced) comparison: it observes without perturbing, compares on identical inputs, and its
numbers obey the margin theorem."""
import math

import pytest

from dblock.decoding.params import DecodeConfig
from dblock.equivalence.audit import audited_epoch_forward
from dblock.equivalence.report import shadow_section
from dblock.equivalence.shadow import ShadowForward, shadow_generate
from dblock.optimized.executor import epoch_forward
from dblock.decoding.generate import generate, reference_forward
from dblock.tiny import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def llada2():
    return make_tiny_model("llada2_moe", seed=4)


def run_shadow(model, config, dec, schedule="native", prompts=PROMPTS, **kw):
    opt = audited_epoch_forward(model, config, **kw)
    sh = ShadowForward(opt, reference_forward(model), staleness_ages=6)
    res = shadow_generate(sh, prompts, dec, schedule)
    return sh, opt, res


def test_full_compute_shadow_is_exact(llada2):
    dec = DecodeConfig(max_new_tokens=24)
    sh, opt, res = run_shadow(llada2, "full_compute", dec)
    sec = shadow_section(sh, opt)
    assert sec["decisions"]["agreement"] == 1.0 and sec["margin"]["within_gamma"] == 1.0
    assert sec["logits"]["max_abs"] <= 1e-5
    assert all(ly["routed_all"] <= 1e-5 for ly in sec["layers"])
    assert sh.violations == [] and sec["cache"]["reads"] == 0
    assert res.tokens == generate(llada2, PROMPTS, dec).tokens


@pytest.mark.parametrize("schedule", ["native", "oba"])
def test_shadow_observes_without_perturbing(llada2, schedule):
    """The trajectory under the shadow is exactly the optimized executor's own (the shadow returns its logits)."""
    dec = DecodeConfig(max_new_tokens=24)
    sh, opt, res = run_shadow(llada2, "epoch", dec, schedule)
    plain = generate(epoch_forward(llada2, "epoch"), PROMPTS, dec, schedule)
    assert res.tokens == plain.tokens
    assert [c.F for c in res.counters] == [c.F for c in plain.counters]
    assert sh.violations == []
    if schedule == "oba":                                   # warm-up blocks are compared too, with their context
        assert any(r["role"] == "warmup" for r in sh.rows)


def test_margin_theorem_holds_on_real_passes(llada2):
    """No decision differs on a (pass, block) whose every live row stayed inside Γ*, and every disagreement is
    listed as a margin violation."""
    for dec in (DecodeConfig(max_new_tokens=32), DecodeConfig(max_new_tokens=16, rule="fixed-k", steps=8)):
        sh, opt, _ = run_shadow(llada2, "epoch", dec)
        sec = shadow_section(sh, opt)
        assert sec["decisions"]["disagreements_inside_exact_margin"] == 0
        listed = {(v["request"], v["pass"], v["position"]) for v in sec["margin_violations"]}
        for d in sec["decisions"]["list"]:
            assert (d["request"], d["pass"], d["position"]) in listed
        assert sec["margin"]["rows"] > 0 and 0 < sec["margin"]["within_gamma"] <= sec["margin"]["within_gamma_exact"]


def test_attribution_per_layer_and_staleness(llada2):
    """On identical inputs the first MoE layer's fresh rows agree to rounding; only cached rows differ there. Served
    entries are compared with the fresh output by age, and the lagged curves exist for decoded and live rows."""
    dec = DecodeConfig(max_new_tokens=16, rule="fixed-k", steps=8)
    sh, opt, _ = run_shadow(llada2, "no_atlas", dec, refresh=4)
    first = sh.routed[sh.moe_layers[0]]
    assert first["fresh"].max <= 1e-5 and first["cached"].n > 0 and first["cached"].max > 1e-3
    assert set(sh.served_cos) == {1, 2, 3}                   # ages 1..M_C-1, nothing older
    assert all(-1.0 <= c <= 1.0 for v in sh.served_cos.values() for c in v)
    assert sh.lagged_cos[("decoded", 1)] and sh.lagged_cos[("live", 1)]
    assert dict(sh.age_hist) == dict(opt.age_hist)


def test_llada_moe_full_sequence_and_no_cache_prefix():
    m = make_tiny_model("llada_moe", seed=1)
    sh, opt, res = run_shadow(m, "epoch", DecodeConfig(max_new_tokens=16))
    assert sh.violations == [] and sh.rows
    m2 = make_tiny_model("llada2_moe", seed=1)
    sh2, _, res2 = run_shadow(m2, "full_compute", DecodeConfig(max_new_tokens=24, no_cache=True))
    assert sh2.violations == [] and all(all(r["agree"]) for r in sh2.rows)
    assert res2.tokens == generate(m2, PROMPTS, DecodeConfig(max_new_tokens=24, no_cache=True)).tokens


def test_reference_against_itself_on_diffusion_gemma():
    """The shadow runs any pair of Forwards; on a uniform-state model decisions are the entropy-bound check under
    the block's shared randomness."""
    m = make_tiny_model("diffusion_gemma", seed=0)
    sh = ShadowForward(reference_forward(m), reference_forward(m))
    dec = DecodeConfig(rule="entropy-bound", steps=6, max_new_tokens=16)
    res = shadow_generate(sh, [[5, 6, 7]], dec)
    assert res.tokens == generate(m, [[5, 6, 7]], dec).tokens   # the copies never consumed the real stream
    assert sh.rows and all(r["kind"] == "entropy-bound" and all(r["agree"]) for r in sh.rows)
    assert sh.logits.max == 0.0 and all(math.isnan(g) for r in sh.rows for g in r["gamma"])
