"""Property tests: Expert Atlas coverage and support-only routing on random scores; the LSP decoded-output cache as a
state machine under random liveness sequences (the real Epoch executor, judged by `invariants.check_record`)."""
import contextlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dblock.equivalence import invariants as inv
from dblock.equivalence.audit import audited_epoch_forward
from dblock.forward import Segment, StepInput, block_causal
from dblock.optimized.atlas import (AtlasParams, build_support, build_supports, candidates, coverage,
                                   route_restricted)
from dblock.reference.llada import route_llada2, route_llada_moe
from dblock.tiny import make_tiny_model, tiny_config

# ---- Expert Atlas on random score matrices ----------------------------------------------------------------------

ROUTERS = {
    "sigmoid-grouped": dict(family="llada2_moe"),                         # E 16, K 4, 4 groups keep 2
    "sigmoid-8x2": dict(family="llada2_moe", num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
    "softmax": dict(family="llada_moe"),                                  # E 8, K 2
}


@st.composite
def router_case(draw):
    name = draw(st.sampled_from(sorted(ROUTERS)))
    cfg = tiny_config(**ROUTERS[name])
    N = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
    logits = torch.randn(N, cfg.num_experts, generator=g) * scale
    bias = 0.1 * torch.randn(cfg.num_experts, generator=g) if cfg.use_expert_bias else None
    return cfg, logits, bias, g


@given(router_case(), st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.integers(1, 16), st.integers(0, 4),
       st.integers(0, 4), st.floats(0.0, 2.0))
def test_atlas_success_means_coverage_quota_met(case, alpha, q, B, c, m, beta):
    cfg, logits, bias, _ = case
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    ap = AtlasParams(m=m, alpha=alpha, q=q, B=B, c=c, beta=beta).resolved(E, K)
    W, I, R = candidates(logits, bias, cfg, ap.m)
    res = build_support(W, I, R, E, ap)
    _, U = coverage(W.double(), I, R.double(), res.support, alpha)
    N = logits.shape[0]
    if res.success:
        assert int(U.sum()) <= (1 - q) * N + 1e-9                       # recomputed independently of the build
        assert res.under == int(U.sum())
    else:
        assert res.under > (1 - q) * N - 1e-9
    assert int(res.support.sum()) >= min(ap.B, E)                          # starts from the B most popular


def plain_build(W, I, R, E, p):
    """The greedy construction of docs/algorithms.md §4.2 for one block, written as plainly as possible: the oracle
    of the batched `build_supports`. -> (support, success, under, rounds)."""
    N, J = W.shape
    W, R = W.double(), R.double()
    mass = [[0.0] * E for _ in range(N)]
    for t in range(N):
        for j in range(J):
            mass[t][int(I[t, j])] += float(W[t, j])
    target = [p.alpha * float(R[t]) for t in range(N)]
    pop = [sum(mass[t][e] for t in range(N)) for e in range(E)]
    S = set(sorted(range(E), key=lambda e: -pop[e])[:min(p.B, E)])
    rounds = 0
    while True:
        cover = [sum(mass[t][e] for e in S) for t in range(N)]
        U = [t for t in range(N) if cover[t] < target[t] - 1e-12]
        if len(U) <= (1 - p.q) * N + 1e-9:
            return S, True, len(U), rounds
        if p.c <= 0:
            return S, False, len(U), rounds
        score = {}
        for e in range(E):
            if e in S:
                continue
            G = sum(min(mass[t][e], max(0.0, target[t] - cover[t])) for t in U)
            H = sum(1 for t in U if mass[t][e] > 0 and cover[t] + mass[t][e] >= target[t] - 1e-12)
            if H + p.beta * G > 0:
                score[e] = H + p.beta * G
        if not score:
            return S, False, len(U), rounds
        S |= set(sorted(score, key=lambda e: -score[e])[:p.c])
        rounds += 1


@settings(max_examples=60, deadline=None)
@given(st.lists(router_case(), min_size=1, max_size=4), st.floats(0.5, 1.0), st.floats(0.0, 1.0),
       st.integers(1, 16), st.integers(0, 4), st.integers(0, 4), st.floats(0.0, 2.0))
def test_batched_atlas_builds_equal_each_block_alone_and_the_plain_loop(cases, alpha, q, B, c, m, beta):
    """`build_supports` over several blocks gives each block the support it gets alone, and that equals the plain
    per-block loop (random scores: ties have probability zero, so the greedy order is the same)."""
    cfg = cases[0][0]
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    ap = AtlasParams(m=m, alpha=alpha, q=q, B=B, c=c, beta=beta).resolved(E, K)
    blocks = []
    for _, logits, _, g in cases:                       # one router (the first case's), each case's rows and seed
        bias = 0.1 * torch.randn(E, generator=g) if cfg.use_expert_bias else None
        blocks.append(candidates(logits[:, :E] if logits.shape[1] >= E else torch.randn(logits.shape[0], E,
                                                                                          generator=g),
                                 bias, cfg, ap.m))
    W, I, R = (torch.cat([b[k] for b in blocks]) for k in range(3))
    together = build_supports(W, I, R, [b[0].shape[0] for b in blocks], E, ap)
    assert len(together) == len(blocks)
    for (Wb, Ib, Rb), res in zip(blocks, together):
        alone = build_support(Wb, Ib, Rb, E, ap)
        assert torch.equal(res.support, alone.support)
        assert (res.success, res.under, res.rounds) == (alone.success, alone.under, alone.rounds)
        S, ok, under, rounds = plain_build(Wb, Ib, Rb, E, ap)
        assert set(torch.nonzero(res.support).flatten().tolist()) == S
        assert (res.success, res.under, res.rounds) == (ok, under, rounds)


@given(router_case(), st.integers(0, 2 ** 31 - 1), st.sampled_from(["random", "support", "all"]))
def test_restricted_routing_never_leaves_the_support(case, seed, kind):
    cfg, logits, bias, g = case
    N, E = logits.shape
    if kind == "all":
        allowed = torch.ones(N, E, dtype=torch.bool)
    elif kind == "support":
        W, I, R = candidates(logits, bias, cfg, cfg.num_experts_per_tok)
        sup = build_support(W, I, R, E, AtlasParams(B=2, q=0.5).resolved(E, cfg.num_experts_per_tok)).support
        allowed = sup[None].expand(N, E)
    else:
        allowed = torch.rand(N, E, generator=torch.Generator().manual_seed(seed)) < 0.4
    ids, w = route_restricted(logits, bias, cfg, allowed)
    valid = ids >= 0
    assert bool(allowed.gather(1, ids.clamp(min=0))[valid].all())       # never outside the support
    assert bool((w[~valid] == 0).all())                                   # empty slots carry no weight
    if kind == "all":                                                     # with everything allowed: the router
        ref_ids, ref_w = (route_llada2 if cfg.score_function == "sigmoid" else route_llada_moe)(logits, bias, cfg)
        assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
        torch.testing.assert_close(w.gather(1, ids.argsort(-1)), ref_w.gather(1, ref_ids.argsort(-1)))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 40), st.integers(2, 70), st.data(), st.sampled_from([torch.float32, torch.float64]))
def test_candidate_selection_is_the_topk_set_on_every_row(T, E, data, dtype):
    """`atlas._largest` (numpy's argpartition on the host) selects, row by row, the same set as `topk`: random
    scores with -inf holes (experts a row already took) and, in some rows, ties across the cut -- there any of the
    tied ids is right, so the test compares the selected values and that the ids are distinct."""
    from dblock.optimized.atlas import _largest
    n = data.draw(st.integers(1, E - 1))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    x = torch.randn(T, E, generator=g, dtype=dtype)
    if data.draw(st.booleans()):                                   # ties: values on a coarse grid
        x = (x * 2).round() / 2
    holes = torch.rand(T, E, generator=g) < data.draw(st.sampled_from([0.0, 0.3]))
    holes[:, :n] = False                                           # at least n finite entries per row
    x = x.masked_fill(holes, float("-inf"))
    ids = _largest(x, n)
    assert ids.shape == (T, n) and ids.dtype == torch.int64
    assert all(len(set(r)) == n for r in ids.tolist())
    assert torch.equal(x.gather(1, ids).sort(-1).values, x.topk(n, dim=-1).values.sort(-1).values)
    assert torch.equal(_largest(x[:1], n), ids[:1])                 # a row's choice depends on that row only


# ---- the LSP cache as a state machine -------------------------------------------------------------------------------

MODEL = make_tiny_model("llada2_moe", seed=11, num_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2)
MASK = MODEL.config.mask_token_id
C = 8


def segment(tokens, start, block):
    t = torch.tensor(tokens)
    live = t == MASK
    return Segment(block=block, tokens=t, positions=torch.arange(start, start + len(tokens)), live=live,
                   decoded=~live)


class LSPMachine(RuleBasedStateMachine):
    """Random liveness sequences through the real executor: decode rows, re-mask a row (an odd transition), change
    a decoded row's token, commit the block (sometimes reusing its (request, block) key), and step. After every
    pass, every audit record must satisfy the invariants, and the served rows are checked directly too."""

    @initialize(refresh=st.integers(1, 6), config=st.sampled_from(["epoch", "no_atlas"]), prompt=st.integers(0, 7))
    def setup(self, refresh, config, prompt):
        self.M = refresh
        self.f = audited_epoch_forward(MODEL, config, refresh=refresh)
        self.cache = self.f.new_cache()
        p = list(range(5, 5 + C))
        self.f.append([StepInput(0, [segment(p, 0, 0)], block_causal(1), self.cache)])
        self.block, self.start = 1, C
        self.tokens = [(10 + i) if i < prompt else MASK for i in range(C)]   # prompt tail rows are decoded
        self.block_pass = 0
        self.prev_decoded = set(i for i, t in enumerate(self.tokens) if t != MASK)
        self.steps = 0

    @rule(data=st.data())
    def decode_and_step(self, data):
        live = [i for i, t in enumerate(self.tokens) if t == MASK]
        if live:
            rows = data.draw(st.sets(st.sampled_from(live), max_size=min(2, len(live))))
            for r in rows:
                self.tokens[r] = 20 + r
        self.step()

    @rule(data=st.data())
    def remask(self, data):
        dec = [i for i, t in enumerate(self.tokens) if t != MASK]
        if dec:
            self.tokens[data.draw(st.sampled_from(dec))] = MASK

    @rule(data=st.data())
    def change_token(self, data):
        dec = [i for i, t in enumerate(self.tokens) if t != MASK]
        if dec:
            r = data.draw(st.sampled_from(dec))
            self.tokens[r] = 40 + (self.tokens[r] % 7)

    @precondition(lambda self: self.block_pass > 0)
    @rule(reuse=st.booleans())
    def commit(self, reuse):
        self.f.end_block(0, self.block)
        assert (0, self.block) not in self.f.plans, "a block plan survived its commit"
        if not reuse:                       # the next block on the grid (reuse: the same key starts over)
            done = [t if t != MASK else 1 for t in self.tokens]
            self.f.append([StepInput(0, [segment(done, self.start, self.block)], block_causal(1), self.cache)])
            self.block, self.start = self.block + 1, self.start + C
        self.tokens = [MASK] * C
        self.block_pass = 0

    @rule()
    def step(self):
        a0 = len(self.f.audit)
        out = self.f.denoise([StepInput(0, [segment(self.tokens, self.start, self.block)], block_causal(1),
                                        self.cache)])
        n_live = sum(t == MASK for t in self.tokens)
        assert out[0][0].shape[0] == n_live
        decoded_now = set(i for i, t in enumerate(self.tokens) if t != MASK)
        for rec in self.f.audit[a0:]:
            assert inv.check_record(rec, self.block_pass) == []
            for r, age in zip(rec["served_rows"], rec["served_ages"]):
                assert 1 <= age <= self.M - 1                     # never an entry of age >= M_C
                assert r in decoded_now                           # never a live row
                if self.block_pass == 0 or rec["plan_pass"] == 0:
                    raise AssertionError("a block's first pass served a cache entry: it crossed a block")
            assert not set(rec["served_rows"]) & set(rec["newly_decoded"])   # never a newly decoded row
            if self.block_pass > 0:                               # newly decoded = decoded now, not on the last pass
                expected_newly = decoded_now - self.prev_decoded
                if rec["path"] != "fallback":
                    assert set(rec["newly_decoded"]) == expected_newly
        for rec in self.f.audit_heads[-1:]:
            assert inv.check_head(rec) == []
        self.prev_decoded = decoded_now
        self.block_pass += 1
        self.steps += 1

    @invariant()
    def ages_bounded(self):
        if hasattr(self, "f"):
            assert all(a <= self.M - 1 for a in self.f.age_hist)


LSPMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None, derandomize=True)
TestLSPCacheStateMachine = LSPMachine.TestCase


def test_state_machine_reaches_the_cache():
    """The machine's sequences really exercise cache reads at the age bound (else it would prove nothing)."""
    f = audited_epoch_forward(MODEL, "no_atlas", refresh=4)
    cache = f.new_cache()
    f.append([StepInput(0, [segment(list(range(5, 13)), 0, 0)], block_causal(1), cache)])
    tokens = [MASK] * C
    for i in range(C):
        f.denoise([StepInput(0, [segment(tokens, C, 1)], block_causal(1), cache)])
        tokens[i] = 20 + i
    assert max(f.age_hist) == 3 and inv.check_executor(f) == []


@contextlib.contextmanager
def group_scoring(tournament: bool):
    """Force the group scores through `_top2`'s tournament (every call) or `topk(2)` (every call of a test's
    size) by moving the size switch."""
    from dblock.optimized import atlas
    old = atlas.TOURNAMENT_MIN_SCORES
    atlas.TOURNAMENT_MIN_SCORES = 0 if tournament else 1 << 62
    try:
        yield
    finally:
        atlas.TOURNAMENT_MIN_SCORES = old


ODD_GROUPS = dict(family="llada2_moe", num_experts=20, num_experts_per_tok=3, n_group=4, topk_group=2)   # 5 a group


@st.composite
def tie_heavy_router_case(draw):
    """Router inputs where ties are the rule: logits on a coarse grid (equal scores within and across groups),
    saturated sigmoids (scores of exactly 1.0), a zero or absent bias; also 5-expert groups (not a power of two)."""
    name = draw(st.sampled_from(sorted(ROUTERS) + ["odd-groups"]))
    cfg = tiny_config(**(ODD_GROUPS if name == "odd-groups" else ROUTERS[name]))
    N = draw(st.integers(1, 24))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    grid = draw(st.sampled_from([0.5, 1.0, 30.0]))
    logits = torch.randint(-3, 4, (N, cfg.num_experts), generator=g).float() * grid
    bias = None
    if cfg.use_expert_bias:
        bias = draw(st.sampled_from([None, "zero", "grid"]))
        bias = None if bias is None else (torch.zeros(cfg.num_experts) if bias == "zero" else
                                          torch.randint(-1, 2, (cfg.num_experts,), generator=g).float() * 0.25)
    return cfg, logits, bias


@given(st.one_of(router_case().map(lambda c: c[:3]), tie_heavy_router_case()))
def test_plain_routing_is_the_reference_router_bit_for_bit(case):
    """`route_restricted` without a support (the executor's router on the dense path and for unrestricted rows)
    returns the reference router's ids in the same order and its weights bit for bit, ties included: the group
    scores come from a max/min tournament instead of `topk(2)`, the final top-K from the same scores."""
    cfg, logits, bias = case
    ref_ids, ref_w = (route_llada2 if cfg.score_function == "sigmoid" else route_llada_moe)(logits, bias, cfg)
    every = torch.ones(logits.shape, dtype=torch.bool)
    for tournament in (False, True):                     # both ways of scoring groups (they switch on size)
        with group_scoring(tournament):
            ids, w = route_restricted(logits, bias, cfg)
            assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
            ids_all, w_all = route_restricted(logits, bias, cfg, every)
            assert torch.equal(ids_all, ref_ids) and torch.equal(w_all, ref_w)


@given(tie_heavy_router_case(), st.floats(0.0, 1.0), st.integers(0, 2 ** 31 - 1))
def test_group_scores_are_the_top2_sums_of_finite_scores(case, density, seed):
    """The tournament's group score is the sum of the group's two best finite scores (one: that score; none: -inf),
    against `topk(2)` per group, on scores with -inf holes (experts outside a support) and ties."""
    from dblock.optimized.atlas import group_mask, group_scores, router_scores
    cfg, logits, bias = case
    if cfg.n_group <= 1:
        return
    N, E = logits.shape
    _, b = router_scores(logits, bias, cfg)
    allowed = torch.rand(N, E, generator=torch.Generator().manual_seed(seed)) < density
    b = b.masked_fill(~allowed, float("-inf"))
    top2 = b.view(N, cfg.n_group, E // cfg.n_group).topk(2, dim=-1).values
    finite = torch.isfinite(top2)
    want = torch.where(finite, top2, torch.zeros_like(top2)).sum(-1)
    want = torch.where(finite[..., 0], want, torch.full_like(want, float("-inf")))
    keep = want.topk(cfg.topk_group, dim=-1).indices
    kept = torch.zeros_like(want, dtype=torch.bool).scatter_(1, keep, True)
    expect = kept[:, :, None].expand(N, cfg.n_group, E // cfg.n_group).reshape(N, E) & torch.isfinite(b)
    for tournament in (False, True):
        with group_scoring(tournament):
            assert torch.equal(group_scores(b, cfg), want)
            assert torch.equal(group_mask(b, cfg), expect)      # the mask: finite experts of the kept groups
