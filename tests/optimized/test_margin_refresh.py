"""The Epoch executor's margin-gated exact refresh (docs/algorithms.md §4.7, `EpochConfig.margin_refresh`): the
decision radius the schedule's `DecisionSpec` gives, the gate's counters, and its two ends (δ = 0 never refreshes,
δ = ∞ re-runs every approximate pass exactly). No timing is asserted."""
import copy
import math

import pytest
import torch

from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from dblock.decoding.radius import DecisionSpec, block_radius, decision_rows
from dblock.decoding.schedules import MaskedRule
from dblock.decoding.margins import row_stats
from dblock.optimized.executor import EpochExecutor, epoch_forward
from dblock.optimized.plan import EpochConfig
from dblock.tiny import make_tiny_model

DECODES = {
    "threshold": dict(),
    "threshold-quota": dict(threshold_steps=4),
    "fixed-k": dict(rule="fixed-k", steps=8),
}


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def atlas_model(seed=6):
    """A tiny llada2_moe whose Expert Atlas restricts (B = 4 < E = 16) and whose blocks live several passes."""
    return make_tiny_model("llada2_moe", seed=seed, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)


def atlas_forward(m, **kw):
    return epoch_forward(m, "epoch", refresh=3, atlas_B=4, **kw)


class Nudged(EpochExecutor):
    """full_compute's exact logits z, moved by exactly ε in ∞-norm on every live row toward its runner-up token
    (+ε on it, −ε on the top token, MASK excluded), and every pass declared approximate: a crafted approximation
    whose error bound is known to be ε, which flips every near-tied decision."""

    eps = 0.0

    def _note_approx(self, c) -> None:
        if c.R.approx is not None:
            c.R.approx[:] = True

    def _segment_logits(self, it, s, hidden_NH, rows_N):
        z = super()._segment_logits(it, s, hidden_NH, rows_N)
        if z.shape[0] == 0 or self.eps == 0:
            return z
        zz = z.clone()
        zz[:, self.config.mask_token_id] = -math.inf
        top2 = zz.topk(2, dim=-1).indices
        z = z.clone()
        rows = torch.arange(z.shape[0])
        z[rows, top2[:, 0]] -= self.eps
        z[rows, top2[:, 1]] += self.eps
        return z


def nudged(m, eps, delta):
    cfg = EpochConfig.named("full_compute", margin_refresh=delta)
    f = Nudged(m, cfg)
    f.eps = eps
    return f


@pytest.mark.parametrize("decode", sorted(DECODES))
def test_a_sound_bound_gives_the_reference_tokens_where_the_crafted_nudge_flips_them(decode):
    m = atlas_model()
    ps = prompts(8, seed=1)
    dec = DecodeConfig(max_new_tokens=32, **DECODES[decode])
    ref = generate(m, ps, dec).tokens
    eps = 0.5
    assert generate(nudged(m, eps, None), ps, dec).tokens != ref     # without the gate the near-ties flip
    f = nudged(m, eps, eps)                                         # δ = ε: a sound bound on ‖ẑ − z‖∞
    assert generate(f, ps, dec).tokens == ref
    g = f.stats()["margin_refresh"]
    assert g["approx"] == g["requests"] > 0
    assert 0 < g["refreshed"] < g["approx"]          # only the passes whose radius at ẑ is within ε were re-run
    assert g["rows_refreshed"] > 0 and g["calls_refreshed"] > 0


@pytest.mark.parametrize("decode", sorted(DECODES))
def test_an_unsound_bound_can_leave_flips(decode):
    m = atlas_model()
    ps = prompts(8, seed=1)
    dec = DecodeConfig(max_new_tokens=32, **DECODES[decode])
    ref = generate(m, ps, dec).tokens
    f = nudged(m, 0.5, 0.05)                                        # δ below the real error
    got = generate(f, ps, dec).tokens
    g = f.stats()["margin_refresh"]
    assert g["refreshed"] < nudged_refreshed(m, ps, dec)          # fewer re-runs than the sound bound makes
    assert got != ref


def nudged_refreshed(m, ps, dec):
    f = nudged(m, 0.5, 0.5)
    generate(f, ps, dec)
    return f.stats()["margin_refresh"]["refreshed"]


def test_infinite_bound_refreshes_every_approximate_pass_and_gives_full_compute_tokens():
    m = atlas_model()
    ps = prompts(6, seed=2)
    dec = DecodeConfig(max_new_tokens=32, rule="fixed-k", steps=16)
    plain = atlas_forward(m)
    approx_tokens = generate(plain, ps, dec).tokens
    fc = generate(epoch_forward(m, "full_compute"), ps, dec).tokens
    assert fc == generate(m, ps, dec).tokens
    assert approx_tokens != fc, "the approximation never changed a token: the test would prove nothing"
    f = atlas_forward(m, margin_refresh=math.inf)
    assert generate(f, ps, dec).tokens == fc
    g = f.stats()["margin_refresh"]
    assert g["refreshed"] == g["approx"] > 0 and g["approx"] < g["requests"]   # cold / refresh passes were exact
    assert f.stats()["open_plans"] == 0 and f._exact is not None and not f._exact.plans   # blocks end in both


def test_zero_bound_never_refreshes_and_keeps_the_epoch_tokens():
    m = atlas_model()
    ps = prompts(6, seed=2)
    dec = DecodeConfig(max_new_tokens=32, rule="fixed-k", steps=16)
    want = generate(atlas_forward(m), ps, dec).tokens
    f = atlas_forward(m, margin_refresh=0.0)
    assert generate(f, ps, dec).tokens == want
    g = f.stats()["margin_refresh"]
    assert g["approx"] > 0 and g["refreshed"] == g["gated"] == g["rows_refreshed"] == 0
    assert f._exact is None


def test_gate_is_off_by_default_and_counted_per_pass_when_on():
    m = atlas_model()
    ps = prompts(3, seed=4)
    dec = DecodeConfig(max_new_tokens=16, rule="fixed-k", steps=16)
    off = atlas_forward(m)
    generate(off, ps, dec)
    assert off.ecfg.margin_refresh is None and "margin_refresh" not in off.stats()
    on = atlas_forward(m, margin_refresh=math.inf)
    generate(on, ps, dec)
    assert "refreshed" in on.last_pass_stats()
    g = on.stats()["margin_refresh"]
    assert g["bound"] == math.inf and g["passes"] == on.pass_paths["epoch"] + on.pass_paths["dense"]
    with pytest.raises(ValueError, match="margin_refresh"):
        EpochConfig.named("epoch", margin_refresh=-1.0)


def test_without_a_decision_spec_the_gate_fails_closed():
    """A caller of the Forward protocol that gives no DecisionSpec: every approximate request is re-run."""
    spec = None
    stats = row_stats(torch.randn(3, 10))
    assert block_radius(spec, stats) == 0.0
    assert block_radius(DecisionSpec("opaque"), stats) == 0.0
    assert block_radius(DecisionSpec("none"), stats) == math.inf


# ---- the radius the schedule's DecisionSpec gives is the rule's own decision radius -------------------------

class _Cfg:
    mask_token_id = 0
    eos_token_id = 1
    eos_token_ids = (1,)


def _decide(rule, st, z):
    st = copy.deepcopy(st)
    rule.step(st, z, None, warmup=False)
    return st.tokens


@pytest.mark.parametrize("decode", sorted(DECODES))
def test_perturbations_inside_the_radius_never_change_the_rules_decision(decode):
    """For random blocks at every pass of their clock, logits moved by less than the spec's radius (random and
    worst-case directions) give the real step rule's decision; just outside it some do not (the radius is tight)."""
    g = torch.Generator().manual_seed(0)
    dec = DecodeConfig(max_new_tokens=16, block_size=8, **DECODES[decode])
    rule = MaskedRule(_Cfg, dec)
    tight = 0
    for trial in range(60):
        C, V = 8, 12
        tokens = torch.randint(2, V, (C,), generator=g)
        fixed = torch.zeros(C, dtype=torch.bool)
        st = rule.new_block(tokens, fixed, None)
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):      # advance the clock a few passes
            if st.done:
                break
            rule.step(st, torch.randn(int(st.live.sum()), V, generator=g) * 3, None, warmup=False)
        if st.done:
            continue
        n = int(st.live.sum())
        z = torch.randn(n, V, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 4 + 0.2)
        spec = rule.decision_spec(st, warmup=False)
        r = block_radius(spec, row_stats(decision_rows(z, 0, spec)))
        want = _decide(rule, st, z)
        for k in range(20):
            d = (torch.rand(n, V, generator=g, dtype=torch.float64) * 2 - 1)
            if k % 2:
                d = torch.sign(d)                    # corners of the ∞-ball
            d = d / d.abs().max() * r * 0.999
            assert torch.equal(_decide(rule, st, z + d), want), (decode, trial, r)
        if math.isfinite(r) and r > 0:               # just outside: the worst case over a few directions may flip
            for k in range(40):
                d = torch.sign(torch.rand(n, V, generator=g, dtype=torch.float64) * 2 - 1) * r * 1.5
                if not torch.equal(_decide(rule, st, z + d), want):
                    tight += 1
                    break
    assert tight > 0


# ---- the command line -------------------------------------------------------------------------------------

def test_verify_prints_the_gate_and_an_infinite_bound_agrees_everywhere(verify_argv, capsys):
    from dblock.cli import main
    status = main(verify_argv + ["--max-new-tokens", "24", "--margin-refresh", "inf", "--atlas-B", "4", "--no-probe"])
    out = capsys.readouterr().out
    assert status == 0 and "margin-gated exact refresh (δ = inf)" in out
    assert "decision agreement 100.00%" in out and "identical outputs 3/3" in out
    assert main(verify_argv + ["--margin-refresh", "-1"]) == 2
    assert "--margin-refresh -1: out of range" in capsys.readouterr().err
