"""Tests of the checker: deliberately broken executors must each be caught, with a clear message naming the
violation; a healthy executor on the same workload must pass."""
import pytest
import torch

from dblock.decoding.params import DecodeConfig
from dblock.equivalence import invariants as inv
from dblock.equivalence.audit import AuditedEpochExecutor, audited_epoch_forward
from dblock.equivalence.report import FAULTS
from dblock.equivalence.shadow import ShadowForward, shadow_generate
from dblock.equivalence.verify import run_verify
from dblock.optimized import moe_steps
from dblock.optimized.atlas import SupportResult
from dblock.reference.executor import LladaReference
from dblock.tiny import make_tiny_model

MODEL = make_tiny_model("llada2_moe", seed=2)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
DEC = DecodeConfig(max_new_tokens=24)


def broken(rep):
    return {name for sec in ("main", "probe") if rep.get(sec) for name, s in rep[sec]["invariants"].items()
            if not s["ok"]}


PHRASES = {
    "stale-cache": "served a cache entry of age",
    "cache-newly-decoded": "newly decoded row served from the cache",
    "route-outside-support": "routed (row, expert) pairs outside the support",
    "skip-live-logits": "live row without its LM head",
    "drift-unchecked": "served an entry whose MoE input moved by",
}
#: the knobs a fault needs to have something to break: drift-unchecked skips LSP's drift bound, so one must be set
#: (ε = 0: any row whose input moved at all must not be served)
FAULT_KW = {"drift-unchecked": {"lsp_drift": 0.0}}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_injected_fault_is_caught_and_named(fault):
    rep = run_verify(MODEL, PROMPTS, DEC, faults=[fault], e2e=False, max_disagreement=1.0,
                     epoch_kw=FAULT_KW.get(fault))
    assert rep["exit"]["status"] == 1
    assert FAULTS[fault] in broken(rep)
    reason = next(r for r in rep["exit"]["reasons"] if r.startswith(f"invariant {FAULTS[fault]} broken"))
    assert PHRASES[fault] in reason                            # the first violation, verbatim, in the reason
    assert "request" in reason and ("position" in reason or "layer" in reason)   # with where it happened


def test_healthy_executor_passes_the_same_workload():
    rep = run_verify(MODEL, PROMPTS, DEC, e2e=False, max_disagreement=1.0)
    assert broken(rep) == set() and rep["exit"]["status"] == 0
    assert rep["probe"]["cache"]["max_age"] == 4              # the probe exercised reads up to M_C - 1
    assert rep["main"]["invariants"]["staleness"]["ok"]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_audit_only_checks_catch_the_faults_too(fault):
    """`check_executor` judges a plain run (no shadow) from the audit records alone."""
    from dblock.forward import Segment, StepInput, block_causal
    from dblock.decoding.generate import generate
    f = audited_epoch_forward(MODEL, "epoch", faults=[fault], **FAULT_KW.get(fault, {}))
    if fault == "skip-live-logits":     # a schedule cannot even consume its output: one hand-driven pass
        M = MODEL.config.mask_token_id
        t = torch.tensor([5, 6, M, M, M, 7, M, M])
        f.denoise([StepInput(0, [Segment(0, t, torch.arange(8), t == M, t != M)], block_causal(1),
                             f.new_cache())])
    else:
        generate(f, PROMPTS[:2], DecodeConfig(max_new_tokens=16, rule="fixed-k", steps=8))
    names = {v.invariant for v in inv.check_executor(f)}
    assert FAULTS[fault] in names


def test_uncaught_fault_is_a_failed_self_check():
    """route-outside-support without Expert Atlas has no support to leave: the self-check must say so (status 3)."""
    rep = run_verify(MODEL, PROMPTS[:1], DEC, config="no_atlas", faults=["route-outside-support"], e2e=False,
                     max_disagreement=1.0)
    assert rep["exit"]["status"] == 3
    assert any(r.startswith("SELF-CHECK FAILED: fault route-outside-support") for r in rep["exit"]["reasons"])


class NoClearExecutor(AuditedEpochExecutor):
    """Broken: keeps block plans (supports, caches) after the block commits."""

    def end_block(self, request, block):
        pass

    def end_request(self, request):
        pass


def test_plans_surviving_a_block_are_caught():
    from dblock.optimized.plan import EpochConfig
    sh = ShadowForward(NoClearExecutor(MODEL, EpochConfig.named("epoch")), LladaReference(MODEL))
    shadow_generate(sh, PROMPTS[:2], DEC)
    names = {v.invariant for v in sh.violations}
    assert "block-boundary" in names
    msg = next(v.message for v in sh.violations if v.invariant == "block-boundary")
    assert "after the block committed" in msg or "left after the request ended" in msg


def test_reused_block_key_without_clearing_is_caught():
    """A leaked plan whose (request, block) key comes back (a server reusing request ids) is read across the
    boundary: its plan clock runs ahead of the block's own pass count."""
    from dblock.optimized.plan import EpochConfig
    f = NoClearExecutor(MODEL, EpochConfig.named("epoch"))
    sh = ShadowForward(f, LladaReference(MODEL))
    shadow_generate(sh, PROMPTS[:1], DEC)
    sh.violations.clear()
    shadow_generate(sh, PROMPTS[:1], DEC)                   # same request id 0, same block indices
    assert any(v.invariant == "block-boundary" and "survived its block" in v.message for v in sh.violations)


def test_lying_atlas_is_caught_by_the_independent_coverage_recheck(monkeypatch):
    """A support build that claims success with one expert: the audit says |U| = 0, the recomputation from the
    layer's MoE input says otherwise."""
    def lying_builds(W, I, R, lens, E, p):
        out, a = [], 0
        for n in lens:
            s = torch.zeros(E, dtype=torch.bool)
            s[int(I[a, 0])] = True
            out.append(SupportResult(s, True, 0, 0))
            a += n
        return out
    monkeypatch.setattr(moe_steps, "build_supports", lying_builds)
    # B < E so that supports are built at all (with B >= E the support is every expert and nothing is built)
    sh = ShadowForward(audited_epoch_forward(MODEL, "epoch", atlas_B=MODEL.config.num_experts_per_tok),
                       LladaReference(MODEL))
    shadow_generate(sh, PROMPTS[:2], DEC)
    cov = [v for v in sh.violations if v.invariant == "coverage"]
    assert cov and "reported as a success" in cov[0].message and "recomputed" in cov[0].message


def test_failed_build_that_keeps_a_support_is_caught(monkeypatch):
    """Fail closed means all experts: a failed build whose support is still used is a violation."""
    rec = {"request": 0, "block": 1, "pass": 3, "plan_pass": 2, "layer": 1, "path": "hot", "N": 8, "fresh": 8,
           "served_rows": [], "served_ages": [], "newly_decoded": [], "decoded": [], "support": [0, 1],
           "support_ok": False, "under": 5, "routed_outside_support": 0, "refresh": 5, "built_at": 2,
           "alpha": 0.9, "q": 0.95}
    assert [v.invariant for v in inv.check_record(rec)] == ["fail-closed"]
