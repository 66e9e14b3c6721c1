"""The call-level choice between the epoch path and the dense path (docs/algorithms.md §4.1), the batched liveness
planner it rests on, and the cache coherence of dense calls."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dblock.decoding.generate import generate
from dblock.decoding.params import DecodeConfig
from dblock.equivalence import invariants as inv
from dblock.equivalence.audit import audited_epoch_forward
from dblock.forward import Segment, StepInput, block_causal
from dblock.optimized.executor import epoch_forward
from dblock.optimized.liveness import Liveness, plan_passes
from dblock.optimized.plan import EpochConfig, PathModel
from dblock.tiny import make_tiny_model, tiny_config


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ---- the rule -----------------------------------------------------------------------------------------------------

def test_path_model_rule_and_break_even():
    pm = PathModel(moe_share=0.6, overhead_share=0.06)
    assert pm.break_even == pytest.approx(0.9)
    assert pm.epoch_pays(0.5) and pm.epoch_pays(0.89) and not pm.epoch_pays(0.91) and not pm.epoch_pays(1.0)
    assert not PathModel(0.6, 0.0).epoch_pays(1.0)              # nothing to skip: never the epoch path
    assert PathModel(0.6, 0.0).epoch_pays(0.999)
    assert not PathModel(0.3, 0.4).epoch_pays(0.0) and PathModel(0.3, 0.4).break_even == 0.0


def test_path_model_from_the_cost_model_and_from_a_profile(tmp_path):
    cfg = tiny_config(family="llada2_moe")
    pm = PathModel.from_cost(cfg, batch=8, rows_per_request=cfg.block_size)
    assert 0.0 < pm.moe_share <= 1.0 and pm.overhead_share >= 0.0 and 0.0 < pm.break_even < 1.0
    assert "cost model" in pm.source
    f = tmp_path / "profile.json"
    f.write_text(json.dumps({"moe_share": 0.5, "overhead_share": 0.1}))
    assert PathModel.load(str(f)) == PathModel(0.5, 0.1, "")
    for bad in ({"moe_share": 1.5, "overhead_share": 0.1}, {"moe_share": 0.5}, {"moe_share": "x", "overhead_share": 0}):
        with pytest.raises(ValueError):
            PathModel.from_dict(bad)
    with pytest.raises(ValueError, match="path"):
        EpochConfig.named("epoch", path="sometimes")


# ---- the batched liveness planner ---------------------------------------------------------------------------------

def plan_one(st_, decoded, pass_index, refresh, lsp):
    """The per-block rule written out plainly (docs/algorithms.md §4.3), on a dict state."""
    prev = st_.get("prev")
    if prev is None:
        path = "cold"
    elif prev.shape != decoded.shape:
        path = "fallback"
    elif (prev & ~decoded).any():
        path = "fallback"
    elif not lsp or pass_index - st_.get("last", -10 ** 9) >= refresh:
        path = "refresh"
    else:
        path = "hot"
    p = prev if prev is not None and prev.shape == decoded.shape else torch.zeros_like(decoded)
    stable = decoded & p
    fresh = torch.ones_like(decoded) if path != "hot" else ~stable
    if path != "hot":
        st_["last"] = pass_index
    st_["prev"] = decoded.clone()
    return path, fresh, decoded & ~p


@settings(max_examples=40)
@given(st.integers(1, 4), st.integers(1, 6), st.booleans(), st.integers(0, 2 ** 31 - 1))
def test_batched_planner_equals_the_per_block_rule(blocks, refresh, lsp, seed):
    """Several blocks planned in one call, pass after pass (decoding, sometimes re-masking a row), give exactly the
    per-block rule's paths, fresh and newly decoded sets."""
    g = torch.Generator().manual_seed(seed)
    lens = [int(torch.randint(1, 7, (1,), generator=g)) for _ in range(blocks)]
    states, refs = [Liveness(n) for n in lens], [{} for _ in lens]
    decoded = [torch.zeros(n, dtype=torch.bool) for n in lens]
    for i in range(8):
        for b in range(blocks):
            decoded[b] = decoded[b] | (torch.rand(lens[b], generator=g) < 0.3)
            if torch.rand(1, generator=g) < 0.1:
                decoded[b][int(torch.randint(0, lens[b], (1,), generator=g))] = False     # a reversal
        pp = plan_passes(states, torch.cat(decoded), lens, [i] * blocks, refresh, lsp)
        fresh, newly = pp.fresh.split(lens), pp.newly.split(lens)
        for b in range(blocks):
            path, f_ref, n_ref = plan_one(refs[b], decoded[b], i, refresh, lsp)
            assert pp.paths[b] == path
            assert torch.equal(fresh[b], f_ref) and torch.equal(states[b].fresh, f_ref)
            assert torch.equal(newly[b], n_ref) and torch.equal(states[b].newly, n_ref)
    assert Liveness(3).plan_pass(torch.tensor([True, False, True]), 0, 5, True) == "cold"


# ---- the path a call takes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
@pytest.mark.parametrize("config", ["full_compute", "no_atlas"])
def test_dense_path_gives_the_skip_path_tokens_at_mc1(family, config):
    """At M_C = 1 with every expert every row is fresh on every pass: the epoch path computes what the dense path
    computes, so pinning either (or the cost rule's choice) decodes the same tokens."""
    m = make_tiny_model(family, seed=3)
    ps, dec = prompts(6, seed=1), DecodeConfig(max_new_tokens=24)
    got = {p: generate(epoch_forward(m, config, refresh=1, path=p), ps, dec).tokens for p in ("epoch", "dense", None)}
    assert got["epoch"] == got["dense"] == got[None] == generate(m, ps, dec).tokens


def test_full_compute_takes_the_dense_path_every_call():
    m = make_tiny_model("llada2_moe", seed=3)
    f = epoch_forward(m, "full_compute")
    generate(f, prompts(3), DecodeConfig(max_new_tokens=16))
    st_ = f.stats()
    assert set(st_["pass_paths"]) == {"dense"} and set(st_["paths"]) == {"dense"}
    last = f.last_pass_stats()
    assert last["path"] == "dense" and all(x["path"] == "dense" for x in last["layers"])
    assert last["fresh_frac"] == 1.0 and last["moe_buffer_bytes"] > 0


def seg(tokens, start, block, mask_id):
    t = torch.tensor(tokens)
    live = t == mask_id
    return Segment(block=block, tokens=t, positions=torch.arange(start, start + len(tokens)), live=live,
                   decoded=~live)


def test_the_rule_picks_per_call_and_dense_calls_keep_the_cache_coherent():
    """f* = 0.5: a cold call (f = 1) and a call with few stable rows go dense, one with most rows stable goes the
    epoch path and serves the entries the dense calls wrote (fresh decoded rows), within the age bound."""
    m = make_tiny_model("llada2_moe", seed=7)
    M = m.config.mask_token_id
    f = audited_epoch_forward(m, "no_atlas", refresh=6, path_model=PathModel(0.5, 0.25))
    cache = f.new_cache()
    f.append([StepInput(0, [seg(list(range(5, 13)), 0, 0, M)], block_causal(1), cache)])
    block = [M] * 8
    paths = []
    for decode in ([], [0, 1], [2, 3, 4, 5], [6], []):
        for r in decode:
            block[r] = 20 + r
        f.denoise([StepInput(0, [seg(block, 8, 1, M)], block_causal(1), cache)])
        paths.append((f.last_pass_stats()["path"], f.last_pass_stats()["fresh_frac"]))
    # pass 0 cold (f 1); 1: rows 0-1 newly decoded (f 1); 2: rows 0-1 stable (f 6/8); 3: 0-5 stable (f 2/8);
    # 4: 0-6 stable (f 1/8)
    assert [p for p, _ in paths] == ["dense", "dense", "dense", "epoch", "epoch"], paths
    served = [a for a in f.audit if a["served_rows"]]
    assert served and {a["pass_path"] for a in served} == {"epoch"}
    assert inv.check_executor(f) == []
    assert max(f.age_hist) <= 5 and f.stats()["pass_paths"] == {"dense": 3, "epoch": 2}
    # rows 2-5 were written on the dense call that decoded them (pass 2), rows 0-1 on pass 1: served at ages 1-3
    assert sorted(f.age_hist) == [1, 2, 3]


def test_auto_path_invariants_hold_on_a_whole_decode():
    """A whole fixed-k decode under the cost rule (both paths taken): every audit invariant holds."""
    m = make_tiny_model("llada2_moe", seed=6, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)
    f = audited_epoch_forward(m, "epoch", refresh=3, path_model=PathModel(0.6, 0.2))
    generate(f, prompts(5, seed=4), DecodeConfig(max_new_tokens=24, rule="fixed-k", steps=8))
    assert set(f.stats()["pass_paths"]) == {"dense", "epoch"}
    assert inv.check_executor(f) == []
    assert any(a["served_rows"] for a in f.audit) and max(f.age_hist) <= 2
    assert any(a["support"] is not None and len(a["support"]) < 16 for a in f.audit)


def test_epoch_path_batch_invariance_at_mc1_with_the_atlas():
    """The Atlas path pinned (the cost rule would take the dense path at M_C = 1, where f = 1): still batch
    invariant."""
    m = make_tiny_model("llada2_moe", seed=5)
    ps = prompts(6, seed=2)
    dec = DecodeConfig(max_new_tokens=24)
    together = generate(epoch_forward(m, "no_lsp", refresh=1, path="epoch"), ps, dec).tokens
    alone = [generate(epoch_forward(m, "no_lsp", refresh=1, path="epoch"), [p], dec).tokens[0] for p in ps]
    assert together == alone


# ---- the path is chosen per block, from the block alone ----------------------------------------------------------

@pytest.mark.parametrize("sched", ["native", "oba", "flowblock"])
def test_auto_path_is_batch_invariant(sched):
    """The default cost rule decides per block from the block's own fresh fraction (docs/algorithms.md §4.1), and a
    block's routed outputs are the same on the literal dense path and as a dense block of an epoch call: a request
    decodes the same tokens alone and in a batch of 4 (both paths taken)."""
    m = make_tiny_model("llada2_moe", seed=0)
    dec = DecodeConfig(max_new_tokens=20)
    ps = [[5 + i, 6, 7, 8][: 1 + i % 4] for i in range(8)]
    alone = [generate(epoch_forward(m, path="auto"), [p], dec, sched, seeds=[i]).tokens[0] for i, p in enumerate(ps)]
    f = epoch_forward(m, path="auto")
    together = generate(f, ps, dec, sched, seeds=list(range(8)), batch_size=4).tokens
    assert together == alone
    assert set(f.stats()["pass_paths"]) == {"dense", "epoch"}
    assert {"dense", "hot-skip"} <= set(f.stats()["paths"])


def test_a_blocks_path_depends_only_on_the_block():
    """The same mostly-stable block takes the epoch path alone and in a call whose other blocks are all fresh (cold:
    dense); its served rows, path counters and cache entries are the same, and the dense blocks build no support and
    serve nothing."""
    m = make_tiny_model("llada2_moe", seed=7)
    M = m.config.mask_token_id
    recs = {}
    for others in (0, 3):
        f = audited_epoch_forward(m, "epoch", refresh=6, path_model=PathModel(0.5, 0.25))
        caches = [f.new_cache() for _ in range(1 + others)]
        for r, c in enumerate(caches):                  # one prefill each: request 0's K/V alike in both runs
            f.append([StepInput(r, [seg(list(range(5 + r, 13 + r)), 0, 0, M)], block_causal(1), c)])
        block = [M] * 8
        for i, decode in enumerate(([], [0, 1, 2, 3, 4, 5], [], [6])):
            for r in decode:
                block[r] = 20 + r
            items = [StepInput(0, [seg(block, 8, 1, M)], block_causal(1), caches[0])]
            if i >= 2:                                   # other requests join with cold (all-fresh) blocks
                items += [StepInput(r, [seg([M] * 8, 8, 1 + i, M)], block_causal(1), caches[r])
                          for r in range(1, 1 + others)]
            f.denoise(items)
        last = f.last_pass_stats()
        assert last["dense_blocks"] == others and last["path"] == "epoch"
        mine = [a for a in f.audit if a["request"] == 0 and a["pass"] == 3]
        theirs = [a for a in f.audit if a["request"] != 0 and a["pass"] == 3]
        assert {a["pass_path"] for a in mine} == {"epoch"} and mine[0]["served_rows"] == [0, 1, 2, 3, 4, 5]
        assert all(a["pass_path"] == "dense" and not a["served_rows"] and a["built_at"] < 0 for a in theirs)
        assert inv.check_executor(f) == []
        plan = f.plans[(0, 1)]
        recs[others] = ([a["served_rows"] for a in mine], plan.counters(),
                        [f.plan_cache(plan, li).values.clone() for li in f.config.moe_layers])
    assert recs[0][0] == recs[3][0] and recs[0][1] == recs[3][1]
    for a, b in zip(recs[0][2], recs[3][2]):          # same entries (a batch's GEMM shapes move last bits only)
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
def test_routing_within_every_expert_is_the_plain_router_bit_for_bit(family):
    """A dense block of an epoch call is routed by `route_restricted` over every expert when another block
    restricts its support: that must be the plain router exactly (ids in order and weights)."""
    from dblock.optimized.atlas import route_restricted
    from dblock.reference.llada import route_llada2, route_llada_moe
    kw = dict(num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2) if family == "llada2_moe" else {}
    cfg = tiny_config(family=family, **kw)
    rule = route_llada2 if cfg.score_function == "sigmoid" else route_llada_moe
    g = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 4.0):
        logits = torch.randn(64, cfg.num_experts, generator=g) * scale
        bias = 0.1 * torch.randn(cfg.num_experts, generator=g) if cfg.use_expert_bias else None
        ids, w = route_restricted(logits, bias, cfg, torch.ones(logits.shape, dtype=torch.bool))
        ref_ids, ref_w = rule(logits, bias, cfg)
        assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)


def test_grouped_mm_is_opt_in():
    assert EpochConfig().grouped_mm is False and EpochConfig().path_batch == 32
    m = make_tiny_model("llada2_moe", seed=3)
    assert epoch_forward(m).stages.grouped_mm is False
