"""The audit taps and the deliberate faults live outside the production executor and hook its named steps.

A renamed step would silently disable a fault (the self-check would then report status 3) or an audit record; these
tests pin the contract: every override names a step the production executor has, the production executor carries
no instrumentation, and auditing changes nothing it computes.
"""
import inspect

import pytest

from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from dblock.equivalence import faults as fl
from dblock.equivalence.audit import AuditedEpochExecutor, audited_epoch_forward, instrumented_executor
from dblock.equivalence.report import FAULTS
from dblock.optimized.executor import EpochExecutor, epoch_config, epoch_forward
from dblock.optimized.moe_steps import MoeSteps
from dblock.optimized.rows import LayerCall, Rows
from dblock.optimized.stages import TorchStages
from dblock.tiny import make_tiny_model

MODEL = make_tiny_model("llada2_moe", seed=6, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


def overridden_steps(cls) -> set:
    return {k for k, v in vars(cls).items() if callable(v) and not (k.startswith("__") and k.endswith("__"))}


@pytest.mark.parametrize("cls", [AuditedEpochExecutor, *fl.INJECTORS.values()])
def test_every_override_names_a_production_step(cls):
    own = {"_audit_layer", "_tap_layer"} if cls is AuditedEpochExecutor else set()
    missing = overridden_steps(cls) - own - set(dir(EpochExecutor))
    assert not missing, f"{cls.__name__} overrides steps the executor does not have: {sorted(missing)}"


def test_every_fault_has_an_injector():
    assert set(fl.INJECTORS) == set(FAULTS)
    with pytest.raises(ValueError, match="allowed"):
        fl.with_faults(EpochExecutor, ["no-such-fault"])


def test_production_executor_carries_no_instrumentation():
    src = "".join(inspect.getsource(c) for c in (EpochExecutor, MoeSteps, LayerCall, TorchStages, Rows))
    for word in [*FAULTS, "inject", "self.audit", "self.taps"]:
        assert word not in src, word
    f = epoch_forward(MODEL, "epoch")
    assert type(f) is EpochExecutor
    assert not any(hasattr(f, a) for a in ("audit", "audit_heads", "taps"))
    assert not hasattr(epoch_config("epoch"), "inject")


def test_faults_compose_in_any_order_with_or_without_the_audit():
    cfg = epoch_config("epoch")
    a = instrumented_executor(MODEL, cfg, faults=["stale-cache", "skip-live-logits"])
    b = audited_epoch_forward(MODEL, "epoch", faults=["skip-live-logits", "stale-cache"])
    assert isinstance(a, AuditedEpochExecutor) and type(a).__mro__[1:] == type(b).__mro__[1:]
    assert a.faults == b.faults == frozenset({"stale-cache", "skip-live-logits"})
    c = instrumented_executor(MODEL, cfg, audit=False, faults=["route-outside-support"])
    assert isinstance(c, fl.RouteOutsideSupport) and not isinstance(c, AuditedEpochExecutor)
    assert c.ap.B == MODEL.config.num_experts_per_tok and not hasattr(c, "audit")
    assert type(audited_epoch_forward(MODEL, "epoch")) is AuditedEpochExecutor
    with pytest.raises(ValueError):
        audited_epoch_forward(MODEL, "dense")
    assert not {"audit", "inject"} & set(inspect.signature(epoch_forward).parameters)


def _observed(f, dec):
    res = generate(f, PROMPTS, dec)
    last = {k: v for k, v in f.last_pass_stats().items() if not k.endswith("_s")}
    return res.tokens, [[c.F for c in cs] if isinstance(cs, list) else cs.F for cs in res.counters], f.stats(), last


def test_auditing_changes_nothing_it_observes():
    dec = DecodeConfig(max_new_tokens=24)
    plain = _observed(epoch_forward(MODEL, "epoch", refresh=3), dec)
    audited = instrumented_executor(MODEL, epoch_config("epoch", refresh=3))
    audited.taps = {}
    assert _observed(audited, dec) == plain
    assert audited.audit and audited.audit_heads
    moe = len(MODEL.config.moe_layers)
    assert len(audited.taps["routed"]) == len(audited.taps["moe_in"]) == moe * audited._pass
    assert all(y.shape == x.shape for y, x in zip(audited.taps["routed"], audited.taps["moe_in"]))
