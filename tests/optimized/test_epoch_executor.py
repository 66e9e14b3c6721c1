"""The Epoch executor: exactness of full_compute, fail-closed faults, staleness and support invariants."""
import pytest
import torch

from dblock.decoding.params import DecodeConfig
from dblock.equivalence.audit import audited_epoch_forward
from dblock.forward import Segment, StepInput, block_causal
from dblock.optimized.executor import epoch_forward
from dblock.optimized.freshlane import grouped_swiglu_torch, sort_by_expert
from dblock.reference.executor import LladaReference
from dblock.decoding.generate import generate
from dblock.tiny import make_tiny_model
from tests.conftest import tol


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
@pytest.mark.parametrize("batch", [1, 16])
def test_full_compute_gives_reference_tokens(family, batch):
    m = make_tiny_model(family, seed=3)
    ps = prompts(batch, seed=batch)
    dec = DecodeConfig(max_new_tokens=24)
    ref = generate(m, ps, dec)
    got = generate(epoch_forward(m, "full_compute"), ps, dec)
    assert got.tokens == ref.tokens
    assert [c.F for c in got.counters] == [c.F for c in ref.counters]


def test_full_compute_oba_gives_reference_tokens():
    m = make_tiny_model("llada2_moe", seed=3)
    ps = prompts(4, seed=9)
    dec = DecodeConfig(max_new_tokens=32)
    assert generate(epoch_forward(m, "full_compute"), ps, dec, "oba").tokens == generate(m, ps, dec, "oba").tokens


def test_epoch_batch_invariance_at_mc1():
    m = make_tiny_model("llada2_moe", seed=5)
    ps = prompts(6, seed=2)
    dec = DecodeConfig(max_new_tokens=24)
    together = generate(epoch_forward(m, "no_lsp", refresh=1), ps, dec).tokens
    alone = [generate(epoch_forward(m, "no_lsp", refresh=1), [p], dec).tokens[0] for p in ps]
    assert together == alone


def test_staleness_and_support_invariants_hold():
    m = make_tiny_model("llada2_moe", seed=6, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)
    f = audited_epoch_forward(m, "epoch", refresh=3)
    generate(f, prompts(5, seed=4), DecodeConfig(max_new_tokens=40))
    served = [a for a in f.audit if a["served_rows"]]
    assert served, "the cache was never used: the test would prove nothing"
    for a in f.audit:
        assert all(1 <= age <= a["refresh"] - 1 for age in a["served_ages"])
        assert not set(a["served_rows"]) & set(a["newly_decoded"])        # newly decoded rows are never served
        assert set(a["served_rows"]) <= set(a["decoded"])
        assert a["routed_outside_support"] == 0
    assert max(f.age_hist) <= 2 and f.stats()["paths"].get("hot-skip", 0) > 0
    # supports were really restricted somewhere (B = 4K = 8 of 16 experts)
    assert any(a["support"] is not None and len(a["support"]) < 16 for a in f.audit)


# ---- fault injection: every fault falls back to the exact result ------------------------------------------------

def seg(tokens, start, block, mask_id):
    t = torch.tensor(tokens)
    live = t == mask_id
    return Segment(block=block, tokens=t, positions=torch.arange(start, start + len(tokens)), live=live,
                   decoded=~live)


class Driver:
    """Hand-driven passes over one block: the epoch executor and the reference see the same inputs."""

    def __init__(self, config="no_atlas", refresh=4, **kw):
        self.m = make_tiny_model("llada2_moe", seed=7, dtype=torch.float64)
        self.M = self.m.config.mask_token_id
        self.f = epoch_forward(self.m, config, refresh=refresh, **kw)
        self.ref = LladaReference(self.m)
        self.caches = (self.f.new_cache(), self.ref.new_cache())
        prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
        for fw, c in zip((self.f, self.ref), self.caches):
            fw.append([StepInput(0, [seg(prompt[0], 0, 0, self.M)], block_causal(1), c)])
        self.block = [self.M] * 8

    def step(self, tokens=None, block=1):
        tokens = tokens or self.block
        outs = []
        for fw, c in zip((self.f, self.ref), self.caches):
            outs.append(fw.denoise([StepInput(0, [seg(tokens, 8, block, self.M)], block_causal(1), c)])[0][0])
        return outs

    def decode(self, rows, tok=3):
        for r in rows:
            self.block[r] = tok

    def plan(self, block=1):
        return self.f.plans[(0, block)]


def warm(d: Driver):
    d.step()                         # cold
    d.decode([0, 1, 2])
    d.step()                         # rows 0-2 newly decoded: fresh, cached
    d.decode([3])
    return d.step()                  # rows 0-2 served from cache


def test_hot_pass_really_differs_and_cold_is_exact():
    d = Driver()
    e, r = d.step()
    torch.testing.assert_close(e, r, **tol(torch.float64))
    e, r = warm(d)
    assert d.f.stats()["paths"].get("hot-skip", 0) > 0
    assert (e - r).abs().max() > 1e-9    # the cache is approximate: a fault test would catch a silent read


def test_stale_version_falls_back():
    d = Driver()
    warm(d)
    for li in d.m.config.moe_layers:
        d.f.plan_cache(d.plan(), li).version[:] = -5
    e, r = d.step()
    torch.testing.assert_close(e, r, **tol(torch.float64))
    assert d.f.stats()["paths"]["fallback"] > 0 and d.f.totals["fallback:version"] > 0


def test_cache_entry_of_age_mc_falls_back():
    d = Driver(refresh=4)
    warm(d)
    plan = d.plan()
    for li in d.m.config.moe_layers:
        d.f.plan_cache(plan, li).written[:3] = plan.passes - 4   # age M_C at read
    e, r = d.step()
    torch.testing.assert_close(e, r, **tol(torch.float64))
    assert d.f.totals["fallback:age"] > 0


def test_decoded_back_to_live_falls_back():
    d = Driver()
    warm(d)
    d.block[1] = d.M                  # a decoded row turns live again: not a masked-diffusion transition
    e, r = d.step()
    torch.testing.assert_close(e, r, **tol(torch.float64))
    assert d.f.totals["fallback:reversal"] == 1


def test_shape_mismatch_falls_back():
    d = Driver()
    warm(d)
    e, r = d.step(tokens=d.block + [d.M, d.M])   # the block's segment changed length under the same key
    torch.testing.assert_close(e, r, **tol(torch.float64))
    assert d.f.totals["fallback:shape"] == 1


def test_atlas_failure_uses_all_experts():
    # no_lsp keeps every row fresh; a support that can never reach coverage (B=1, no repair) fails closed. Every row
    # fresh means nothing to skip, so the cost rule would send every call down the dense path (no support at all):
    # the epoch path is pinned, it is the one whose Atlas failure is under test
    d = Driver(config="no_lsp", atlas_q=1.0, path="epoch")
    d.f.ap.B, d.f.ap.c = 1, 0
    for _ in range(3):
        e, r = d.step()
        torch.testing.assert_close(e, r, **tol(torch.float64))
    assert d.f.totals["fallback:atlas"] > 0


def test_token_change_under_a_decoded_row_falls_back():
    d = Driver()
    warm(d)
    d.block[0] = 9                    # same liveness, different token: the cached output is for another token
    e, r = d.step()
    torch.testing.assert_close(e, r, **tol(torch.float64))
    assert d.f.totals["fallback:token"] > 0


# ---- FreshLane edges --------------------------------------------------------------------------------------------

def test_sort_by_expert_docstring_example():
    row, slot, counts = sort_by_expert(torch.tensor([[2, 0], [0, -1], [2, 1], [1, 0]]))
    assert row.tolist() == [0, 1, 3, 2, 3, 0, 2] and slot.tolist() == [1, 0, 1, 1, 0, 0, 0]
    assert counts.tolist() == [3, 2, 2]


def test_grouped_swiglu_zero_rows_and_against_loop():
    E, I, H = 4, 6, 5
    g = torch.Generator().manual_seed(0)
    wg, wu, wd = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)
    empty = grouped_swiglu_torch(torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), wg, wu, wd)
    assert empty.shape == (0, H)
    x = torch.randn(7, H, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 3], [3, -1], [1, 0], [0, 1], [2, 2], [-1, -1], [3, 0]])
    w = torch.rand(7, 2, generator=g, dtype=torch.float64)
    got = grouped_swiglu_torch(x, ids, w, wg.double(), wu.double(), wd.double())
    want = torch.zeros(7, H, dtype=torch.float64)
    for t in range(7):
        for k in range(2):
            e = int(ids[t, k])
            if e >= 0:
                h = torch.nn.functional.silu(wg[e].double() @ x[t]) * (wu[e].double() @ x[t])
                want[t] += w[t, k] * (wd[e].double() @ h)
    torch.testing.assert_close(got, want, **tol(torch.float64))
    assert torch.equal(got[5], torch.zeros(H, dtype=torch.float64))


def test_zero_fresh_rows_in_a_pass():
    """A pass whose every row is a stable decoded row: nothing goes through the experts."""
    d = Driver(refresh=10)
    d.step()
    d.block = [3] * 8
    d.step()                          # all rows newly decoded -> fresh, cached
    d.step()                          # all rows stable -> zero fresh rows
    assert all(s["fresh"] == 0 for s in d.f.last_pass_stats()["layers"])
    assert all(s["cached"] == 8 for s in d.f.last_pass_stats()["layers"])


def test_shared_expert_runs_on_fresh_rows_and_is_cached_with_the_routed_output():
    """LSP caches a stable row's whole MoE output: the shared expert sees only the fresh rows, and the cache holds
    routed + shared (here the reference's MoE output of the pass that wrote it, every row being fresh then)."""
    d = Driver()
    layers = d.m.config.moe_layers
    shared_rows, ref_out = [], {}
    hooks = [d.m.layers[li].mlp.shared.register_forward_hook(lambda mod, a, out: shared_rows.append(a[0].shape[0]))
             for li in layers]
    hooks += [d.m.layers[li].mlp.register_forward_hook(lambda mod, a, out, li=li: ref_out.__setitem__(li, out))
              for li in layers]                     # only the reference calls the MoE module itself
    try:
        d.step()
        d.decode([0, 1, 2])
        d.step()                                    # rows 0-2 newly decoded: fresh, written with their MoE output
        for li in layers:
            got = d.f.plan_cache(d.plan(), li).values[:3]
            torch.testing.assert_close(got, ref_out[li][0, :3].to(got.dtype), **tol(torch.float64))
        d.decode([3])
        shared_rows.clear()
        d.step()                                    # rows 0-2 served
        st = d.f.last_pass_stats()["layers"]
        assert [s["cached"] for s in st] == [3] * len(layers)
        n = len(layers)                             # the epoch pass's layers, then the reference's (all 8 rows)
        assert shared_rows[:n] == [s["fresh"] for s in st] == [5] * n and shared_rows[n:] == [8] * n
    finally:
        for h in hooks:
            h.remove()


def test_supports_are_built_only_where_every_row_of_the_block_is_fresh():
    """A build reads every row's router scores; it happens only on passes where the router runs for all of the
    block's rows anyway (all fresh: cold, refresh, fallback; or the block on the dense path), reusing those logits."""
    m = make_tiny_model("llada2_moe", seed=6, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)
    f = audited_epoch_forward(m, "epoch", refresh=3, update_every=2)
    generate(f, prompts(5, seed=4), DecodeConfig(max_new_tokens=40))
    built = [a for a in f.audit if a["built_at"] == a["plan_pass"]]
    assert any(a["plan_pass"] > 0 for a in built), "no rebuild after the cold pass: the test would prove nothing"
    assert all(a["pass_path"] == "dense" or a["fresh"] == a["N"] and a["path"] != "hot" for a in built)
    assert any(a["path"] == "hot" and a["support"] is not None and len(a["support"]) < 16 for a in f.audit)


@pytest.mark.parametrize("path", ["auto", "epoch"])
def test_a_building_block_routes_with_every_expert_and_its_candidates_are_that_choice(path):
    """On the pass that builds a block's support the block's rows are routed with every expert (the plain router,
    bit for bit), the build's first K candidates are exactly those ids, and the candidate lists equal the ones
    computed from scratch; the new support restricts the block's routing from its next pass (audited)."""
    from dblock.optimized import moe_steps as X
    from dblock.optimized.atlas import candidates, route_restricted
    m = make_tiny_model("llada2_moe", seed=6, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)
    f = audited_epoch_forward(m, "epoch", refresh=3, update_every=2, path=path)
    seen = {"builds": 0, "restricted": 0}
    real_candidates = X.candidates

    def checked(logits, bias, cfg, mm, top=None):
        assert top is not None, "the executor recomputed the router's choice for a build"
        ids, _ = route_restricted(logits, bias, cfg)
        assert torch.equal(top, ids.to(top.device))                  # routed with every expert on the build pass
        got = real_candidates(logits, bias, cfg, mm, top)
        for a, b in zip(got, real_candidates(logits, bias, cfg, mm)):
            assert torch.equal(a, b)
        seen["builds"] += 1
        return got
    X.candidates = checked
    try:
        generate(f, prompts(5, seed=4), DecodeConfig(max_new_tokens=40))
    finally:
        X.candidates = real_candidates
    assert seen["builds"] > 0
    for a in f.audit:
        assert a["routed_outside_support"] == 0
        if a["pass_path"] == "epoch" and a["support"] is not None and len(a["support"]) < 16 \
                and a["built_at"] < a["plan_pass"]:
            seen["restricted"] += 1
    assert seen["restricted"] > 0, "no pass routed within a real support: the test would prove nothing"


def test_a_hot_row_its_support_does_not_cover_is_routed_with_every_expert():
    """Per-token fail-closed (docs/algorithms.md §4.2): on a hot pass a fresh row whose support-restricted choice
    keeps less than alpha of its own dense top-K mass is routed with every expert (the plain router's ids); the other
    rows keep their restricted choice, inside the support. Small supports (B = K) so that both happen; the audit's
    support-routing invariant counts only the rows left inside."""
    from dblock.equivalence.invariants import check_executor
    from dblock.optimized.atlas import candidates, route_restricted
    m = make_tiny_model("llada2_moe", seed=6, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)
    ex = audited_epoch_forward(m, "epoch", atlas_B=2, refresh=4, path="epoch")
    seen = {"open": 0, "kept": 0}
    real = type(ex)._cover_fresh

    def checked(self, c, allowed, ids, w):
        out_ids, out_w = real(self, c, allowed, ids, w)
        W, I, R = candidates(c.logits_FE, c.moe.expert_bias, self.config, 0)
        kept_mass = (W * (I.unsqueeze(2) == ids.unsqueeze(1)).any(2).to(W.dtype)).sum(-1)
        restricted = ~allowed.all(1)
        opened = restricted & (kept_mass < self.ap.alpha * R - 1e-9)
        assert torch.equal(opened, c.open_F)
        plain_ids, plain_w = route_restricted(c.logits_FE, c.moe.expert_bias, self.config)
        # the same experts; the weights up to float rounding: the executor routes the opened rows on their own,
        # the plain router here routes every row in one call, and the vectorised reductions may round differently
        assert torch.equal(out_ids[opened], plain_ids[opened])
        torch.testing.assert_close(out_w[opened], plain_w[opened], rtol=1e-6, atol=1e-6)
        assert torch.equal(out_ids[~opened], ids[~opened])
        seen["open"] += int(opened.sum())
        seen["kept"] += int((restricted & ~opened).sum())
        return out_ids, out_w
    type(ex)._cover_fresh = checked
    try:
        generate(ex, prompts(4, seed=2), DecodeConfig(max_new_tokens=32, rule="fixed-k", steps=16))
    finally:
        type(ex)._cover_fresh = real
    assert seen["open"] > 0 and seen["kept"] > 0, seen
    h = ex.stats()["atlas_hot"]
    assert h["under"] == seen["open"] and h["rows"] == seen["open"] + seen["kept"]
    assert all(a["routed_outside_support"] == 0 for a in ex.audit) and sum(a["opened"] for a in ex.audit) > 0
    assert not [v for v in check_executor(ex) if v.invariant == "support-routing"]


@pytest.mark.parametrize("repair", [True, False])
def test_hot_repair_grows_a_support_by_the_experts_of_its_opened_rows(repair):
    """With the hot repair (the default) the dense top-K experts of rows opened on a hot pass join their block's
    support until its next build, so later hot passes open fewer rows; without it the support stays as built."""
    m = make_tiny_model("llada2_moe", seed=6, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)
    ex = audited_epoch_forward(m, "epoch", atlas_B=2, refresh=4, path="epoch", atlas_repair=repair)
    generate(ex, prompts(4, seed=2), DecodeConfig(max_new_tokens=32, rule="fixed-k", steps=16))
    h = ex.stats()["atlas_hot"]
    assert h["under"] > 0
    grown = 0
    for a in ex.audit:                   # a hot record's support against its block's last build at that layer
        if a["support"] is None or a["built_at"] == a["plan_pass"]:
            continue
        built = next(b for b in ex.audit if (b["request"], b["block"], b["layer"], b["plan_pass"]) ==
                     (a["request"], a["block"], a["layer"], a["built_at"]))
        assert set(built["support"] or range(16)) <= set(a["support"])
        grown += len(a["support"]) > len(built["support"] or range(16))
    assert (grown > 0 and h["repaired_experts"] > 0) if repair else (grown == 0 and not h.get("repaired_experts"))
