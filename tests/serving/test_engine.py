"""The engine alone (no HTTP): continuous batching at pass granularity, same tokens as offline generate whatever
else is in flight, admission control, cancellation, failures, traces."""
import io
import json

import pytest

from dblock.serving.engine import Engine, EngineConfig, Rejected, footprint
from dblock.trace import TraceWriter

from .conftest import DEC, SlowForward, make_forward, offline

PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21], [30, 31, 32, 33, 34], [40, 41, 42, 43]]


@pytest.mark.parametrize("executor, schedule", [("reference", "native"), ("reference", "oba"),
                                                ("reference", "flowblock"), ("epoch", "native"), ("epoch", "oba"),
                                                ("epoch", "flowblock")])
def test_staggered_requests_get_offline_tokens(model, executor, schedule):
    eng = Engine(make_forward(model, executor), schedule, DEC, EngineConfig(batch_cap=3))
    reqs = []
    for i, p in enumerate(PROMPTS):           # arrivals between passes: every request meets a different batch
        reqs.append(eng.submit(p, max_new_tokens=6 + 5 * i, seed=i))
        for _ in range(i % 3):
            eng.step()
    eng.run_until_idle()
    for r in reqs:
        assert r.status == "finished"
        assert r.output_tokens == offline(model, executor, schedule, r.prompt, r.max_new_tokens, r.seed)
        assert sum(c["tokens"] for c in r.commits) == len(r.output_tokens)


def test_new_requests_join_at_the_next_pass_and_finished_ones_leave_at_once(model):
    eng = Engine(make_forward(model, "reference"), "native", DEC, EngineConfig(batch_cap=4))
    a = eng.submit([5, 6, 7], max_new_tokens=64)
    eng.step()
    eng.step()
    assert a.status == "running"
    b = eng.submit([9, 10], max_new_tokens=4)
    eng.step()                                 # b's prefill and first pass ride this very iteration
    assert b.t_first_pass is not None and not a.run.finished
    while b.status != "finished":
        eng.step()
        assert eng.snapshot()["running"] == (1 if b.status == "finished" else 2)
    assert not a.run.finished                  # b did not wait for a's blocks, nor a for b
    eng.run_until_idle()
    assert a.output_tokens == offline(model, "reference", "native", [5, 6, 7], 64)


def test_batch_cap_fifo_and_token_budget(model):
    buf = io.StringIO()
    C = model.config.block_size
    fp = footprint(3, 16, C, "llada2_moe")
    eng = Engine(make_forward(model, "reference"), "native", DEC,
                 EngineConfig(batch_cap=3, kv_budget_tokens=2 * fp), trace=TraceWriter(buf))
    reqs = [eng.submit([5 + i, 6, 7], max_new_tokens=16) for i in range(6)]
    peak = 0
    while eng.step():
        s = eng.snapshot()
        peak = max(peak, s["running"])
        assert s["kv_reserved_tokens"] <= 2 * fp
    assert peak == 2                            # the budget (2 footprints) binds before the cap (3)
    admits = [r.t_admit for r in reqs]
    assert admits == sorted(admits)             # FIFO
    passes = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert max(e["batch"] for e in passes if e["event"] == "pass") <= 2


def test_rejections(model):
    eng = Engine(make_forward(model, "reference"), "native", DEC, EngineConfig(batch_cap=1, kv_budget_tokens=64,
                                                                             max_queue=2))
    with pytest.raises(Rejected) as e:
        eng.submit([5] * 10, max_new_tokens=60)   # 70 positions -> 72 on the grid > 64: can never run
    assert e.value.status == 400 and "never" in e.value.message and e.value.param == "max_tokens"
    with pytest.raises(Rejected) as e:
        eng.submit([5, 500])
    assert e.value.status == 400 and "500" in e.value.message and e.value.param == "prompt"
    eng.submit([5], max_new_tokens=8)
    eng.submit([6], max_new_tokens=8)
    with pytest.raises(Rejected) as e:
        eng.submit([7], max_new_tokens=8)       # queue of 2 is full (nothing admitted yet)
    assert e.value.status == 429
    with pytest.raises(Rejected):
        eng.submit_many([[7], [8]], max_new_tokens=8)
    assert eng.snapshot()["queue_length"] == 2  # all-or-nothing
    eng.stop_accepting()
    with pytest.raises(Rejected) as e:
        eng.submit([7], max_new_tokens=8)
    assert e.value.status == 503
    assert eng.shutdown(drain=True)             # no thread: drains in the caller
    assert eng.snapshot()["finished"] == 2 and eng.snapshot()["rejected"] == {400: 2, 429: 2, 503: 1}


@pytest.mark.parametrize("executor", ["reference", "epoch"])
def test_cancel_frees_the_slot_and_the_executor_state(model, executor):
    fwd = SlowForward(make_forward(model, executor))
    eng = Engine(fwd, "oba", DEC, EngineConfig(batch_cap=1))
    events = []
    a = eng.submit([5, 6, 7], max_new_tokens=200, listener=lambda k, r, d: events.append((r.id, k)))
    b = eng.submit([8, 9], max_new_tokens=8)
    q = eng.submit([8, 9], max_new_tokens=8)
    for _ in range(3):
        eng.step()
    assert a.status == "running" and b.status == "queued"
    eng.cancel(a)
    eng.cancel(q)                               # queued requests leave the queue too
    eng.step()
    assert a.status == "cancelled" and q.status == "cancelled" and (a.id, "cancelled") in events
    assert fwd.ended[0] == a.id
    if executor == "epoch":
        assert not [k for k in fwd.inner.plans if k[0] == a.id]
    assert b.status == "running"                # the freed slot went to the next in line at once
    eng.run_until_idle()
    assert b.output_tokens == offline(model, executor, "oba", [8, 9], 8)
    assert eng.snapshot()["cancelled"] == 2


def test_executor_failure_fails_the_batch_and_the_engine_keeps_serving(model):
    fwd = SlowForward(make_forward(model, "reference"))
    eng = Engine(fwd, "native", DEC, EngineConfig(batch_cap=4))
    got = []
    a = eng.submit([5, 6], max_new_tokens=8, listener=lambda k, r, d: got.append((k, d)))
    fwd.fail_next = True
    eng.step()
    assert a.status == "failed" and got[-1][0] == "error" and got[-1][1]["status"] == 500
    b = eng.submit([5, 6], max_new_tokens=8)
    eng.run_until_idle()
    assert b.output_tokens == offline(model, "reference", "native", [5, 6], 8)


def test_background_thread_and_trace_feed_the_simulator(model, tmp_path):
    from dblock.simulator.calibrate import Run
    path = str(tmp_path / "serve.jsonl")
    tr = TraceWriter(path)
    eng = Engine(make_forward(model, "epoch"), "native", DEC, EngineConfig(batch_cap=4), trace=tr,
                 trace_header=dict(model="tiny", family="llada2_moe", executor="epoch", schedule="native",
                                   decode=vars(DEC), model_config=model.config.to_hf_dict())).start()
    reqs = [eng.submit([5 + i, 6], max_new_tokens=12 + i) for i in range(5)]
    for r in reqs:
        assert r.done_event.wait(30)
    assert eng.shutdown(drain=True, timeout=30)
    tr.close()
    run = Run.load(path)
    c = run.counters()
    assert c["R"] == 5 and c["Y"] == sum(len(r.output_tokens) for r in reqs)
    assert all("accept_pass" in b and "t_s" in b for b in run.blocks)
    assert all("arrival_s" in r for r in run.requests)
    s = eng.snapshot()
    assert 0 < s["fresh_row_fraction"] < 1 and s["cache_hit_ratio"] == pytest.approx(1 - s["fresh_row_fraction"])
    assert s["tpf"] == pytest.approx(sum(r.run.counters.Y for r in reqs) / sum(r.run.counters.Q for r in reqs))
