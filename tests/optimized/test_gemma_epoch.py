"""The Epoch executor on DiffusionGemma (bundled tiny-uniform): full_compute gives the reference's tokens (fp32 and
fp64, alone and inside a batch, Native and OBA), its logits within the fp32 tolerance, the grouped GeGLU experts
against the reference's loop, the Expert Atlas under `verify` (coverage, agreement, a caught fault)."""
import pytest
import torch

import dblock
from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from dblock.equivalence.verify import run_verify
from dblock.forward import StepInput, block_causal
from dblock.optimized.executor import EpochExecutor, epoch_forward
import dblock.optimized.freshlane as fl
from dblock.optimized.freshlane import grouped_geglu_torch
from dblock.optimized.gemma_epoch import GemmaEpochExecutor
from dblock.reference.gemma import Experts
from dblock.reference.gemma_executor import build_batch, layer_mask
from tests.conftest import logits_tol, tol
from tests.reference.gemma_util import canvas_segment, fixed_segment

DEC = DecodeConfig(rule="entropy-bound", seed=3, max_new_tokens=32)


@pytest.fixture(scope="module")
def m32():
    return dblock.load("tiny-uniform")


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("schedule", ["native", "oba"])
def test_full_compute_gives_reference_tokens_alone_and_in_a_batch(m32, schedule):
    ps = prompts(3, seed=1)
    ref = generate(m32, ps, DEC, schedule)
    fwd = epoch_forward(m32, "full_compute")
    assert type(fwd) is GemmaEpochExecutor
    got = generate(fwd, ps, DEC, schedule)
    assert got.tokens == ref.tokens
    assert [c.F for c in got.counters] == [c.F for c in ref.counters]
    p = ps[0]                                              # alone: a fresh executor, batch 1
    assert generate(epoch_forward(m32, "full_compute"), [p], DEC, schedule).tokens[0] == \
        generate(m32, [p], DEC, schedule).tokens[0]
    st = fwd.stats()
    assert set(st["pass_paths"]) == {"dense"} and st["lsp"] is False and not st["cache_age_hist"]


def test_full_compute_fp64_tokens_identical_in_a_batch():
    m = dblock.load("tiny-uniform", dtype="float64")
    ps = prompts(2, seed=4)
    ref = [generate(m, [p], DEC).tokens[0] for p in ps]        # the reference alone
    assert generate(epoch_forward(m, "full_compute"), ps, DEC).tokens == ref


def test_full_compute_logits_within_fp32_tolerance_of_the_reference(m32):
    """Teacher-forced: the same prefill and the same batched canvases (with self-conditioning logits) through both."""
    ref, opt = epoch_forward(m32, "dense"), epoch_forward(m32, "full_compute")
    g = torch.Generator().manual_seed(0)
    ps = prompts(3, seed=7)
    C, V = m32.config.canvas_length, m32.config.vocab_size
    caches = {f: [f.new_cache() for _ in ps] for f in (ref, opt)}
    for f in (ref, opt):
        f.append([StepInput(r, [fixed_segment(torch.tensor(p), 0)], block_causal(1), caches[f][r])
                  for r, p in enumerate(ps)])
    sc = [None, torch.randn(C, V, generator=g) * 3, None]
    xs = [torch.randint(0, V, (C,), generator=g) for _ in ps]
    outs = {}
    for f in (ref, opt):
        outs[f] = f.denoise([StepInput(r, [canvas_segment(xs[r], len(p), 0, sc[r])], block_causal(1), caches[f][r])
                             for r, p in enumerate(ps)])
    for a, b in zip(outs[ref], outs[opt]):
        torch.testing.assert_close(b[0], a[0], **logits_tol(torch.float32, a[0]))
    items = [StepInput(r, [canvas_segment(xs[r], len(p), 0)], block_causal(1), caches[opt][r])
             for r, p in enumerate(ps)]
    slow = build_batch(items, opt.device, encoder=False)
    for _ in range(2):                          # the one-segment fast path, built and then kept from the last call
        fast, _, masks, _ = opt._layout(items)
        for k in ("tokens", "positions", "anchor", "new_vis", "lens"):
            assert torch.equal(torch.as_tensor(getattr(fast, k)), torch.as_tensor(getattr(slow, k))), k
    kpos, kvalid = opt._past[0][2:]
    assert torch.equal(masks["sliding_attention"], layer_mask(slow, kpos, kvalid, True, m32.config.sliding_window))


def test_grouped_geglu_matches_the_reference_experts():
    """The grouped GeGLU (grouped GEMM or loop) against the reference `Experts` module; -1 slots add nothing."""
    cfg = dblock.load("tiny-uniform").config
    g = torch.Generator().manual_seed(2)
    ex = Experts(cfg).double()
    with torch.no_grad():
        ex.gate_up_proj.normal_(std=0.1, generator=g)
        ex.down_proj.normal_(std=0.1, generator=g)
    x = torch.randn(9, cfg.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g, dtype=torch.float64)
    want = ex(x, ids, w)
    got = grouped_geglu_torch(x, ids, w, ex.gate_up_proj.data, ex.down_proj.data)
    assert torch.equal(got, want)                        # fp64: the per-expert loop, the reference's own ops
    ids[4, 1], w[4, 1] = -1, 0.0                         # no expert: as a zero-weight slot in the reference
    torch.testing.assert_close(grouped_geglu_torch(x, ids, w, ex.gate_up_proj.data, ex.down_proj.data),
                               ex(x, ids.clamp(min=0), w).detach(), **tol(torch.float64))
    x32, w32 = x.float(), w.float()
    gu, dn = ex.gate_up_proj.data.float(), ex.down_proj.data.float()
    ref32 = Experts(cfg)
    ref32.gate_up_proj.data, ref32.down_proj.data = gu, dn
    want32 = ref32(x32, ids.clamp(min=0), w32).detach()
    for rows in (9, 300):              # every expert on every row (a tiny call), and the grouped GEMM
        assert (rows * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size <= fl.ALL_EXPERTS_MACS) \
            == (rows == 9)
        xr, ir, wr = x32.repeat(rows // 9 + 1, 1)[:rows], ids.repeat(rows // 9 + 1, 1)[:rows], \
            w32.repeat(rows // 9 + 1, 1)[:rows]
        got = grouped_geglu_torch(xr, ir, wr, gu, dn, grouped_mm=True)
        torch.testing.assert_close(got, want32.repeat(rows // 9 + 1, 1)[:rows], **logits_tol(torch.float32, want32))


def test_epoch_with_a_real_atlas_passes_verify_and_catches_a_routing_fault(m32):
    ps = prompts(4, seed=3)
    rep = run_verify(m32, ps, DEC, executor="epoch", config="epoch", epoch_kw={"atlas_B": 4}, e2e=False)
    main = rep["main"]
    assert rep["exit"]["status"] == 0, rep["exit"]
    assert main["decisions"]["agreement"] >= 0.995
    cov = main["coverage"]
    assert cov["B"] == 4 and cov["routed_outside_support"] == 0 and cov["hot"]["rows"] > 0
    bad = run_verify(m32, ps[:2], DEC, executor="epoch", config="epoch", epoch_kw={"atlas_B": 4}, e2e=False,
                     faults=["route-outside-support"])
    assert bad["exit"]["status"] == 1 and "support-routing" in " ".join(bad["exit"]["reasons"])
    head = run_verify(m32, ps[:1], DEC, executor="epoch", config="full_compute", e2e=False,
                      faults=["skip-live-logits"])          # the one-call LM head still goes through _head_rows
    assert head["exit"]["status"] == 1 and "lm-head" in " ".join(head["exit"]["reasons"])
    with pytest.raises(ValueError, match="without LSP"):
        run_verify(m32, ps[:1], DEC, executor="epoch", config="epoch", faults=["stale-cache"])


def test_family_classes_and_refusals(m32):
    with pytest.raises(ValueError, match="epoch_forward"):
        EpochExecutor(m32)
    f = epoch_forward(m32, "epoch")
    assert f._block_dense(16, 16)                      # B = min(E, 4K) = E: the Atlas is inert, dense path
    assert not epoch_forward(m32, "epoch", atlas_B=4)._block_dense(16, 16)


@pytest.mark.slow
def test_expert_parallel_gloo_gives_the_single_process_tokens():
    """Two gloo ranks (FreshLane's all_to_all dispatch of the normed rows) against world size 1 on tiny-uniform."""
    from dblock.equivalence import degenerate as dg
    from dblock.weights_path import resolve_model_path
    r = dg.check_world_sizes(resolve_model_path("tiny-uniform"), prompts(1, seed=5), DEC.replace(max_new_tokens=16),
                             [2], epoch_config="full_compute", timeout_s=60.0)
    assert r["ok"] is True, r
    assert r["per_world_size"][2]["identical"] == 1 and r["per_world_size"][2]["max_abs_logits"] <= dg.WORLD_TOL
