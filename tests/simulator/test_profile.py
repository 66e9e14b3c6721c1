"""The operator profile: JSON round trip, interpolation exact on grid points and monotone where the operator is,
pricing a call, and the profiler's output on a tiny model (never a timing asserted)."""
import json
import time

import numpy as np
import pytest

from dblock.simulator.profile import CallShape, OpTable, Profile, ProfiledCost, geometric_grid, touched_experts

MODEL = dict(name="synthetic", family="llada2_moe", num_hidden_layers=4, n_moe_layers=3, num_experts=16,
             num_experts_per_tok=4, hidden_size=128, vocab_size=32, block_size=16)


def table_of(name, axes, grid, fn, monotone=None, spread=0.0):
    g = [np.asarray(x, dtype=float) for x in grid]
    mesh = np.meshgrid(*g, indexing="ij")
    med = np.vectorize(fn)(*mesh) if len(g) > 1 else np.array([fn(x) for x in g[0]])
    return OpTable(name, list(axes), [list(x) for x in grid], med, med * (1 - spread), med * (1 + spread),
                   monotone or [True] * len(axes))


def synthetic_profile(spread=0.0, a=1e-3):
    """Every operator a known affine function of its coordinates (seconds)."""
    rows = geometric_grid(1, 1024)
    ctx = [16, 32, 64, 128, 256]
    req = geometric_grid(1, 64)
    T = [table_of("attention", ["requests", "rows", "context"], [req, [4, 8, 16, 32, 64, 128], ctx],
                  lambda b, r, c: a + 2e-6 * b * r + 1e-8 * b * r * c + 1e-8 * b * c, spread=spread),
         table_of("dense_mlp", ["rows"], [rows], lambda r: a / 2 + 1e-6 * r, spread=spread),
         table_of("router", ["rows"], [rows], lambda r: a / 4 + 1e-7 * r, spread=spread),
         table_of("moe", ["rows", "touched"], [rows, [4, 8, 16]], lambda r, t: a + 5e-5 * t + 1e-6 * r,
                  spread=spread),
         table_of("lm_head", ["live"], [geometric_grid(1, 64)], lambda n: 2e-5 + 1e-7 * n, spread=spread),
         table_of("call_denoise", ["requests", "segments"], [req, [1, 2, 4]], lambda b, s: a + 1e-4 * b * s,
                  spread=spread),
         table_of("call_append", ["requests"], [req], lambda b: a + 5e-5 * b, spread=spread),
         table_of("driver", ["requests"], [req], lambda b: 0.0, spread=spread),
         table_of("epoch_moe", ["rows", "fresh_frac"], [[16 * b for b in req], [0.125, 0.25, 0.5, 0.75, 1.0]],
                  lambda r, f: a + 1e-6 * r * f, spread=spread),
         table_of("epoch_call_denoise", ["requests", "segments"], [req, [1, 2]], lambda b, s: 2 * a + 1e-4 * b * s,
                  spread=spread)]
    return Profile(dict(model=MODEL, machine="synthetic", timer="fake"), {t.name: t for t in T})


def test_profile_round_trips_through_json(tmp_path):
    p = synthetic_profile(spread=0.1)
    path = str(tmp_path / "p.json")
    p.save(path)
    q = Profile.load(path)
    assert q.meta == json.loads(json.dumps(p.meta)) and sorted(q.tables) == sorted(p.tables)
    for k, t in p.tables.items():
        u = q.tables[k]
        assert u.axes == t.axes and u.grid == t.grid and u.monotone == t.monotone
        for qq in ("median", "lo", "hi"):
            np.testing.assert_array_equal(getattr(u, qq), getattr(t, qq))
    s = CallShape("denoise", 8, 32, 96, 2, (10, 16) * 8, 256, 0.6)
    for ex in ("reference", "epoch"):
        assert ProfiledCost(q, ex).call(s) == ProfiledCost(p, ex).call(s)


def test_bad_profiles_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a dblock operator profile"):
        Profile.load(str(bad))
    bad.write_text(json.dumps(dict(version=99, meta={}, tables={})))
    with pytest.raises(ValueError, match="version"):
        Profile.load(str(bad))
    with pytest.raises(ValueError, match="ascending"):
        OpTable("x", ["rows"], [[2, 1]], np.ones(2), np.ones(2), np.ones(2), [True])
    with pytest.raises(ValueError, match="no 'epoch_moe'"):
        ProfiledCost(Profile(dict(model=MODEL), {}), "epoch")


def test_interpolation_is_exact_on_grid_points():
    p = synthetic_profile()
    for t in p.tables.values():
        for idx in np.ndindex(*t.median.shape):
            x = [t.grid[a][i] for a, i in enumerate(idx)]
            assert t(*x) == pytest.approx(float(t.median[idx]), rel=1e-12, abs=1e-15)


def test_interpolation_between_points_of_an_affine_operator_is_exact():
    p = synthetic_profile()
    assert p["dense_mlp"](300) == pytest.approx(0.5e-3 + 1e-6 * 300)
    assert p["attention"](3, 24, 40) == pytest.approx(1e-3 + 2e-6 * 72 + 1e-8 * 72 * 40 + 1e-8 * 120, rel=0.02)
    assert p["dense_mlp"](4096) == pytest.approx(0.5e-3 + 1e-6 * 4096)       # linear extrapolation beyond the grid


def test_noisy_table_interpolates_monotone_along_monotone_axes():
    rng = np.random.default_rng(0)
    rows, ctx = [1, 2, 4, 8, 16, 32], [16, 32, 64]
    med = np.add.outer(np.arange(6.0), np.arange(3.0)) + rng.normal(0, 2.0, (6, 3))   # noise dips below trend
    t = OpTable("attention", ["rows", "context"], [rows, ctx], med, med, med, [True, True])
    fine_r, fine_c = np.linspace(1, 32, 60), np.linspace(16, 64, 25)
    v = np.array([[t(r, c) for c in fine_c] for r in fine_r])
    assert np.all(np.diff(v, axis=0) >= -1e-12) and np.all(np.diff(v, axis=1) >= -1e-12)
    env = t.envelope()
    for idx in np.ndindex(*med.shape):                      # exact on the grid: the monotone envelope's values
        assert t(rows[idx[0]], ctx[idx[1]]) == pytest.approx(max(0.0, float(env[idx])), abs=1e-12)
    # an axis the operator is not monotone along keeps its dips
    u = OpTable("x", ["a"], [[1, 2, 3]], np.array([3.0, 1.0, 2.0]), np.array([3.0, 1.0, 2.0]),
                np.array([3.0, 1.0, 2.0]), [False])
    assert u(2) == pytest.approx(1.0)


def test_quantiles_bracket_the_median_and_price_an_interval():
    p = synthetic_profile(spread=0.2)
    s = CallShape("denoise", 4, 16, 48, 1, (8,) * 4)
    lo, mid, hi = (ProfiledCost(p, "reference", q).call(s) for q in ("lo", "median", "hi"))
    assert lo < mid < hi


def test_call_parts_follow_the_model_structure():
    p = synthetic_profile()
    c = ProfiledCost(p, "reference")
    s = CallShape("denoise", 2, 16, 48, 1, (16, 16))
    parts = c.parts(s)
    N = 32
    assert parts["attention"] == pytest.approx(4 * p["attention"](2, 16, 48))
    assert parts["dense_mlp"] == pytest.approx(1 * p["dense_mlp"](N))
    assert parts["moe"] == pytest.approx(3 * p["moe"](N, touched_experts(N, 16, 4)))
    assert parts["lm_head"] == pytest.approx(2 * p["lm_head"](16))
    a = c.parts(CallShape("append", 2, 16, 48))
    assert "lm_head" not in a and a["call"] == pytest.approx(p["call_append"](2))
    e = ProfiledCost(p, "epoch").parts(CallShape("denoise", 2, 16, 48, 1, (16, 16), 32, 0.5))
    assert e["moe"] == pytest.approx(3 * p["epoch_moe"](32, 0.5)) and "router" not in e


def test_touched_experts():
    assert touched_experts(0, 16, 4) == 0
    assert touched_experts(1, 16, 4) == pytest.approx(4)
    assert 15.9 < touched_experts(100, 16, 4) <= 16


def test_profiler_writes_every_table_on_a_tiny_model(tmp_path):
    from dblock.profiling.profiler import Profiler
    from dblock.tiny import make_tiny_model
    m = make_tiny_model("llada2_moe", seed=0, block_size=8)
    prof = Profiler(m, name="tiny", repeats=2, max_rows_blocks=2, max_requests=2, context_blocks=2,
                    min_sample_s=0.0, timer=time.thread_time).run(("reference", "epoch"))
    assert {"attention", "dense_mlp", "router", "moe", "lm_head", "call_denoise", "call_append", "driver",
            "epoch_moe", "epoch_call_denoise"} <= set(prof.tables)
    assert prof["attention"].axes == ["requests", "rows", "context"]
    assert prof["attention"].grid == [[1, 2], [2, 4, 8, 16, 32, 64], [8, 16]]
    assert prof.meta["model"]["n_moe_layers"] == len(m.config.moe_layers)
    from dblock.simulator.fingerprint import code_fingerprint
    assert prof.meta["code"] == code_fingerprint() and len(prof.meta["code"]) == 16
    for t in prof.tables.values():
        assert np.all(np.isfinite(t.median)) and t.median.shape == tuple(len(g) for g in t.grid)
    path = str(tmp_path / "tiny.json")
    prof.save(path)
    c = ProfiledCost(Profile.load(path), "epoch")
    assert c.call(CallShape("denoise", 2, 16, 32, 2, (8, 8, 4, 8), 32, 0.5)) >= 0


def test_profiler_refuses_uniform_state_models():
    from dblock.profiling.profiler import Profiler
    from dblock.reference.gemma_tiny import make_tiny_gemma
    with pytest.raises(ValueError, match="not profiled"):
        Profiler(make_tiny_gemma(seed=0))


def test_degenerate_axes_interpolate():
    one = OpTable("x", ["a", "b"], [[1], [2, 4]], np.array([[1.0, 3.0]]), np.array([[1.0, 3.0]]),
                  np.array([[1.0, 3.0]]), [True, True])
    assert one(7, 3) == pytest.approx(2.0)
    const = OpTable("c", ["a", "b"], [[1], [2]], np.array([[5.0]]), np.array([[5.0]]), np.array([[5.0]]),
                    [True, True])
    assert const(3, 9) == 5.0
