"""LSP's drift bound (docs/algorithms.md §4.3, `EpochConfig.lsp_drift`): a stable decoded row is served from the cache
only while its MoE input stays within ε (relative L2) of the input its entry was computed at. Its two ends (ε = 0
gives the exact tokens, ε = ∞ is plain LSP), a middle ε that both serves and recomputes, the audit's `drift`
invariant and its deliberate fault, the arena's kept inputs and the refusals. No timing is asserted."""
import math

import pytest
import torch

from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from dblock.equivalence.audit import audited_epoch_forward
from dblock.equivalence.invariants import check_executor, check_record
from dblock.optimized.executor import epoch_forward
from dblock.optimized.liveness import CacheArena
from dblock.optimized.plan import EpochConfig
from dblock.tiny import make_tiny_model

# blocks of 16 rows that commit 2 a pass: 8 passes, most rows decoded and stable for several of them
DEC = DecodeConfig(max_new_tokens=32, rule="fixed-k", steps=8)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llada2_moe", seed=3, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)


def served(f) -> int:
    return sum(f.stats()["cache_age_hist"].values())


def test_zero_bound_gives_the_reference_tokens_and_serves_only_unmoved_rows(model):
    ps = prompts(6)
    ref = generate(model, ps, DEC).tokens
    plain = epoch_forward(model, "no_atlas", path="epoch")
    assert generate(plain, ps, DEC).tokens != ref          # plain LSP's staleness changes some decisions here
    f = epoch_forward(model, "no_atlas", path="epoch", lsp_drift=0.0)
    assert generate(f, ps, DEC).tokens == ref
    d = f.stats()["lsp_drift"]
    assert d["bound"] == 0.0 and d["checked"] > 0
    assert d["checked"] - d["recomputed"] == served(f)      # what passed ε = 0 is what was served


def test_infinite_bound_is_plain_lsp(model):
    ps = prompts(6, seed=1)
    plain = epoch_forward(model, "epoch", path="epoch")
    f = epoch_forward(model, "epoch", path="epoch", lsp_drift=math.inf)
    assert generate(f, ps, DEC).tokens == generate(plain, ps, DEC).tokens
    assert f.stats()["lsp_drift"]["recomputed"] == 0
    assert f.stats()["cache_age_hist"] == plain.stats()["cache_age_hist"]
    assert "lsp_drift" not in plain.stats()


def test_a_middle_bound_serves_the_rows_within_it_and_recomputes_the_others(model):
    ps = prompts(6, seed=2)
    probe = audited_epoch_forward(model, "no_atlas", path="epoch", lsp_drift=math.inf)
    generate(probe, ps, DEC)
    drifts = sorted(d for rec in probe.audit for d in (rec["served_drift"] or []))
    assert drifts and drifts[0] < drifts[-1]
    eps = drifts[len(drifts) // 2]                          # the median drift of plain LSP's served rows
    f = audited_epoch_forward(model, "no_atlas", path="epoch", lsp_drift=eps)
    generate(f, ps, DEC)
    d = f.stats()["lsp_drift"]
    assert 0 < d["recomputed"] < d["checked"]
    got = [x for rec in f.audit for x in (rec["served_drift"] or [])]
    assert got and max(got) <= eps
    assert not check_executor(f)                             # every invariant, drift among them, holds


def _record(**kw):
    rec = {"request": 0, "block": 0, "pass": 3, "plan_pass": 3, "layer": 1, "N": 4, "refresh": 5,
           "served_rows": [1, 2], "served_ages": [1, 2], "newly_decoded": [], "decoded": [1, 2],
           "support": None, "support_ok": True, "under": 0, "routed_outside_support": 0, "opened": 0,
           "built_at": 0, "alpha": 0.9, "q": 0.95, "lsp_drift": 0.05, "served_drift": [0.01, 0.05]}
    rec.update(kw)
    return rec


def test_the_drift_invariant_names_a_row_served_past_the_bound_and_a_missing_check():
    assert not [v for v in check_record(_record()) if v.invariant == "drift"]
    bad = [v for v in check_record(_record(served_drift=[0.01, 0.2])) if v.invariant == "drift"]
    assert len(bad) == 1 and "row 2" in bad[0].message and "0.2" in bad[0].message
    missing = [v for v in check_record(_record(served_drift=None)) if v.invariant == "drift"]
    assert len(missing) == 1 and "without a drift check" in missing[0].message
    nan = [v for v in check_record(_record(served_drift=[float("nan"), 0.0])) if v.invariant == "drift"]
    assert len(nan) == 1
    assert not [v for v in check_record(_record(lsp_drift=None, served_drift=None)) if v.invariant == "drift"]


def test_the_drift_unchecked_fault_is_caught_by_the_drift_invariant(model):
    ps = prompts(6, seed=2)
    f = audited_epoch_forward(model, "no_atlas", path="epoch", lsp_drift=0.0, faults=["drift-unchecked"])
    generate(f, ps, DEC)
    assert f.stats()["lsp_drift"]["recomputed"] == 0         # measured, never enforced
    assert any(v.invariant == "drift" for v in check_executor(f))


def test_the_arena_keeps_each_entrys_input_through_growth_and_requires_it():
    a = CacheArena([1], H=3, dtype=torch.float32, device="cpu", capacity=2, keep_inputs=True)
    base = a.alloc(2)
    slot = torch.tensor([base, base + 1])
    x = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    a.write(1, slot, torch.ones(2, 3), torch.tensor([[0, 7, 0], [0, 8, 0]]), x)
    a.alloc(5)                                               # grows the slabs
    assert a.capacity >= 7 and torch.equal(a.inputs[1][slot], x)
    with pytest.raises(ValueError, match="inputs_WH"):
        a.write(1, slot, torch.ones(2, 3), torch.tensor([[0, 7, 0], [0, 8, 0]]))
    assert CacheArena([1], H=3, dtype=torch.float32, device="cpu").inputs is None


def test_bad_bounds_and_families_are_refused():
    with pytest.raises(ValueError, match="lsp_drift=-0.1"):
        EpochConfig.named("epoch", lsp_drift=-0.1)
    with pytest.raises(ValueError, match="lsp_drift=nan"):
        EpochConfig.named("epoch", lsp_drift=float("nan"))
    gemma = make_tiny_model("diffusion_gemma", seed=0)
    with pytest.raises(ValueError, match="LSP is off"):
        epoch_forward(gemma, "full_compute", lsp_drift=0.1)


def test_verify_prints_the_drift_bound_and_refuses_a_negative_one(verify_argv, capsys):
    from dblock.cli import main
    status = main(verify_argv + ["--max-new-tokens", "24", "--epoch-config", "no_atlas", "--lsp-drift", "0",
                                 "--no-probe"])
    out = capsys.readouterr().out
    assert status == 0 and "LSP drift bound (ε = 0)" in out and "drift ok" in out
    assert "identical outputs 3/3" in out
    assert main(verify_argv + ["--lsp-drift", "-1"]) == 2
    assert "--lsp-drift -1: out of range" in capsys.readouterr().err
    assert main(verify_argv + ["--inject-fault", "drift-unchecked"]) == 2
    assert "give the epoch executor one with --lsp-drift" in capsys.readouterr().err
