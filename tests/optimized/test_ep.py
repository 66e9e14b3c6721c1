"""Expert/sequence-parallel FreshLane: gloo ranks on 127.0.0.1 against the single-process executor.

Every distributed test is bounded: `run_distributed` kills ranks that outlive their deadline, and each test
asserts its own elapsed time. One spawn per world size runs all scenarios, to keep process start-up (torch import
on a busy 2-core machine) off the bill.
"""
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dblock.decoding.params import DecodeConfig
from dblock.forward import Forward
from dblock.optimized.ep import (DistributedRunError, EPDispatcher, bounds, comm_summary, plan_layout, row_bytes,
                                 run_distributed, wire_counts)
from dblock.optimized.executor import epoch_forward
from dblock.decoding.generate import generate
from dblock.tiny import make_tiny_model
from dblock.trace import TraceWriter
from tests.conftest import tol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (family, model overrides, schedule, dispatch mode, requests, max_new_tokens, prompt seed)
SCENARIOS = {
    "native": ("llada2_moe", {}, "native", "freshlane", 3, 24, 0),
    "oba": ("llada2_moe", {}, "oba", "freshlane", 3, 24, 1),
    "dense_dispatch": ("llada2_moe", {}, "native", "dense", 3, 16, 2),
    # 7 experts: uneven shares at every world size (W=2: 3+4, W=4: 1+2+2+2)
    "uneven_experts": ("llada_moe", dict(num_experts=7, num_experts_per_tok=2), "native", "freshlane", 2, 16, 3),
    # one request of one 8-row block: at W=4 ranks own 2 rows each, and soon some own no fresh row at all
    "one_request": ("llada2_moe", {}, "native", "freshlane", 1, 24, 4),
}


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


class Recorder(Forward):
    """Passes every call through to `inner` and keeps the logits of every denoise call."""

    def __init__(self, inner, fail_at=None):
        self.inner, self.config, self.name = inner, inner.config, inner.name
        self.logits, self.fail_at = [], fail_at

    def new_cache(self):
        return self.inner.new_cache()

    def append(self, items):
        return self.inner.append(items)

    def denoise(self, items):
        if self.fail_at is not None and len(self.logits) == self.fail_at[0]:
            if self.fail_at[1] == "die":
                os._exit(3)
            time.sleep(3600)                        # stall: the parent kills us
        out = self.inner.denoise(items)
        self.logits.append([t.clone() for per in out for t in per])
        return out

    def end_block(self, request, block):
        self.inner.end_block(request, block)

    def end_request(self, request):
        self.inner.end_request(request)

    def last_pass_stats(self):
        return self.inner.last_pass_stats()


def run_scenario(name, dispatcher_fn=None, fail_at=None):
    fam, over, sched, mode, n, new, seed = SCENARIOS[name]
    m = make_tiny_model(fam, seed=3, **over)
    disp = dispatcher_fn(m, mode) if dispatcher_fn else None
    rec = Recorder(epoch_forward(m, "epoch", dispatcher=disp), fail_at)
    buf = io.StringIO()
    res = generate(rec, prompts(n, seed), DecodeConfig(max_new_tokens=new), sched, trace=TraceWriter(buf))
    comm = [json.loads(s).get("comm") for s in buf.getvalue().splitlines()
            if json.loads(s)["event"] == "pass" and json.loads(s)["kind"] == "denoise"]
    if disp is not None:
        disp.close()
    return {"tokens": res.tokens, "logits": rec.logits, "comm": comm,
            "layouts": disp.layouts if disp is not None else None}


def _ep(m, mode):
    return EPDispatcher(m.config.num_experts, mode=mode, timeout_s=20, record=True)


def _worker(rank, world, names):
    out = {}
    for name in names:
        r = run_scenario(name, _ep)
        if rank != 0:                               # the other ranks only prove they decoded the same tokens
            r = {"tokens": r["tokens"]}
        out[name] = r
    return out


def _faulty(rank, world, kind):
    run_scenario("native", _ep, fail_at=(2, kind) if rank == 1 else None)


@pytest.fixture(scope="module")
def single():
    """The single-process executor (LocalDispatcher) on every scenario."""
    return {name: run_scenario(name) for name in SCENARIOS}


def assert_same(got, ref, name):
    """Tokens exactly; logits within the fp32 tolerance *of the logits' scale*: the ranks sum a row's expert slots
    in another order (per rank, then across ranks), and the tiny models' wide LM head (std 3, logits up to ~100)
    turns those last-bit differences of the hidden state into ~1e-5 absolute on logits of any size."""
    assert got["tokens"] == ref["tokens"], name
    assert len(got["logits"]) == len(ref["logits"]), name
    t = tol(torch.float32)
    for a, b in zip(got["logits"], ref["logits"]):
        for x, y in zip(a, b):
            scale = max(1.0, float(y.abs().max())) if y.numel() else 1.0
            torch.testing.assert_close(x, y, atol=t["atol"] * scale, rtol=t["rtol"], msg=name)


# ---- pure layout ------------------------------------------------------------------------------------------------

def test_bounds_and_the_docstring_worked_example():
    assert bounds(10, 4) == [0, 2, 5, 7, 10] and bounds(1, 4) == [0, 0, 0, 0, 1] and bounds(7, 1) == [0, 7]
    lay = plan_layout(torch.tensor([[0, 2], [1, 0], [3, 2], [1, 3]]), torch.arange(4), 4, 4, 2)
    assert lay.obounds == [0, 2, 4]
    assert lay.dest_NW.tolist() == [[True, True], [True, False], [False, True], [True, True]]
    assert lay.counts_WW.tolist() == [[2, 1], [1, 2]]
    c = wire_counts(lay, H=4, K=2, elem=4)
    assert row_bytes(4, 2, 4) == 36
    assert c["dispatch_bytes"] == [36, 36] and c["combine_bytes"] == [16, 16] and c["gather_bytes"] == [32, 32]
    assert c["rows"] == [3, 3] and c["owned"] == [2, 2]


def test_layout_empty_and_invalid_slots():
    # -1 slots go nowhere; a row with only -1 is owned but sends nothing; a rank can own nothing
    ids = torch.tensor([[-1, -1], [4, -1], [0, 5]])
    lay = plan_layout(ids, torch.tensor([1, 5, 6]), 8, 6, 4)     # shard of 8 rows: owners [0,2) [2,4) [4,6) [6,8)
    assert lay.obounds == [0, 1, 1, 2, 3]                         # rank 1 owns no work row
    # E=6 over 4 ranks: [0,1) [1,3) [3,4) [4,6)
    assert lay.counts_WW.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 1]]
    c = wire_counts(lay, H=2, K=2, elem=4)
    assert c["owned"] == [1, 0, 1, 1] and c["gather_bytes"][1] == 0


@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 3), st.integers(0, 12), st.data())
def test_layout_matches_a_naive_loop(W, E, K, T, data):
    """Split sizes: ownership partitions the work rows by shard position; counts = per (owner, expert rank)
    number of rows with a valid expert there; empty splits and owners without rows included."""
    rows = sorted(data.draw(st.sets(st.integers(0, max(0, T - 1)), max_size=T))) if T else []
    ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, E - 1), min_size=K, max_size=K),
                                          min_size=len(rows), max_size=len(rows))), dtype=torch.long).view(-1, K)
    lay = plan_layout(ids, torch.tensor(rows, dtype=torch.long), T, E, W)
    tb, eb = bounds(T, W), bounds(E, W)
    owner = [next(r for r in range(W) if tb[r] <= t < tb[r + 1]) for t in rows]
    assert lay.obounds == [0] + [sum(1 for o in owner if o <= r) for r in range(W)]
    naive = [[sum(1 for n, o in enumerate(owner) if o == a and any(eb[d] <= int(e) < eb[d + 1] for e in ids[n]))
              for d in range(W)] for a in range(W)]
    assert lay.counts_WW.tolist() == naive
    c = wire_counts(lay, H=3, K=K, elem=4)
    assert sum(c["rows"]) == int(lay.dest_NW.sum()) and sum(c["owned"]) == len(rows)


def test_world1_without_a_group_is_bitwise_the_local_dispatcher(single):
    got = run_scenario("native", _ep)
    ref = single["native"]
    assert got["tokens"] == ref["tokens"]
    assert all(torch.equal(x, y) for a, b in zip(got["logits"], ref["logits"]) for x, y in zip(a, b))
    c = got["comm"][-1]
    assert c["world"] == 1 and c["freshlane"]["dispatch_bytes"] == [0] and c["dense"] is not None
    s = comm_summary([{"event": "pass", "comm": c} for c in got["comm"]])
    assert s["passes"] == len(got["comm"]) and s["rows_ratio"] >= 1.0


# ---- gloo ranks ---------------------------------------------------------------------------------------------------

@pytest.mark.timeout(170)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_distributed_equals_single_process(world, single):
    # dense dispatch runs at W=2 only, and W=1 (the same code path, one rank) runs the plain case
    names = {1: ["native"], 2: list(SCENARIOS), 4: [n for n in SCENARIOS if n != "dense_dispatch"]}[world]
    t0 = time.monotonic()
    res = run_distributed(_worker, world, args=(names,), timeout_s=20, join_timeout_s=150)
    assert time.monotonic() - t0 < 150
    for name in names:
        assert_same(res[0][name], single[name], f"{name} @ world {world}")
        for r in range(1, world):
            assert res[r][name]["tokens"] == single[name]["tokens"], f"rank {r} {name}"
    if world == 1:
        return
    # the edge cases really happened: empty splits, a rank without fresh rows, uneven expert shares
    lays = [lay for name in names for lay in res[0][name]["layouts"]]
    assert any(0 in owned and sum(owned) > 0 for _, owned in lays), "no rank ever owned zero fresh rows"
    assert any((c == 0).any() and c.sum() > 0 for c, _ in lays), "no empty split"
    assert len(set(bounds(7, world)[i + 1] - bounds(7, world)[i] for i in range(world))) > 1
    # traces: both protocols counted on every pass, dense moves at least what FreshLane moves
    comms = [c for name in names if name != "dense_dispatch" for c in res[0][name]["comm"]]
    assert all(c["world"] == world and len(c["freshlane"]["bytes"]) == world and c["dense"] for c in comms)
    assert all(sum(c["dense"]["rows"]) >= sum(c["freshlane"]["rows"]) for c in comms)
    assert any(c["bytes_ratio"] and c["bytes_ratio"] > 1.5 for c in comms), "LSP never saved any traffic"
    dd = res[0]["dense_dispatch"]["comm"] if "dense_dispatch" in names else []
    assert all(c["mode"] == "dense" and c["dispatch_rows"] == sum(c["dense"]["rows"]) for c in dd)


@pytest.mark.timeout(100)
@pytest.mark.parametrize("kind", ["die", "stall"])
def test_a_dead_or_stalled_rank_is_named_within_bounded_time(kind):
    """Rank 1 dies (os._exit) or stalls (sleeps) before its third pass; rank 0 waits in that pass's first
    exchange. Gloo reports a dead peer at once and a stalled one after timeout_s; rank 0 must name rank 1."""
    world = 2
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError) as ei:
        run_distributed(_faulty, world, args=(kind,), timeout_s=2, join_timeout_s=80, grace_s=2)
    elapsed = time.monotonic() - t0
    err = ei.value
    assert elapsed < 80 and err.elapsed < 80
    survivors = [r for r in range(world) if r != 1]
    for r in survivors:
        msg = err.per_rank[r]
        assert "EPTimeoutError" in msg and ("rank 1 died" if kind == "die" else "rank 1 stalled") in msg, msg
    assert 1 in err.per_rank and "rank 1" in str(err)


# ---- command line -------------------------------------------------------------------------------------------------

def test_cli_ep_flags(tiny_dirs, tmp_path, capsys):
    from dblock.cli import main
    base = ["generate", "--model", tiny_dirs["llada2_moe"], "--prompt-ids", "5,6,7", "--max-new-tokens", "8"]
    assert main(base + ["--executor", "epoch", "--ep", "2"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert main(base + ["--ep", "2"]) == 2                       # reference executor: refused
    assert "--executor epoch" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    assert main(base + ["--executor", "epoch", "--ep", "1", "--json", "--trace", str(trace)]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(base + ["--executor", "epoch", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == one["tokens"]
    den = [json.loads(s) for s in trace.read_text().splitlines() if '"denoise"' in s]
    assert den and all(e["comm"]["mode"] == "freshlane" and e["comm"]["dense"] for e in den)


@pytest.mark.timeout(150)
def test_torchrun_generate_world2_prints_once(tiny_dirs, capsys):
    from dblock.cli import main
    args = ["generate", "--model", tiny_dirs["llada2_moe"], "--prompt-ids", "5,6,7", "--prompt-ids", "8,9",
            "--max-new-tokens", "16", "--executor", "epoch", "--json"]
    assert main(args) == 0
    single = json.loads(capsys.readouterr().out)
    env = {**os.environ, "PYTHONPATH": ROOT, "DBLOCK_EP_TIMEOUT": "30"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dblock", *args, "--ep", "2"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    # on failure: the ranks' own messages (a C++ abort names itself in `terminate` / `what()` lines), then the tail
    said = [s for s in p.stderr.splitlines() if any(k in s for k in ("terminate", "what()", "gloo", "Error", "rank"))]
    assert p.returncode == 0, "\n".join(said[:40]) + "\n...\n" + p.stderr[-2000:]
    lines = [s for s in p.stdout.splitlines() if s.startswith("{")]
    assert len(lines) == 1                                        # rank 0 alone prints
    assert json.loads(lines[0])["tokens"] == single["tokens"]
