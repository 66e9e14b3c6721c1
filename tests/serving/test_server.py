"""The HTTP server on an ephemeral 127.0.0.1 port: tokens equal offline generate under concurrency, streaming,
4xx for bad input, 429 under overload, disconnects free slots, API keys, body limits, graceful drain."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dblock.serving.protocol import Limits

from .conftest import offline, running_server, wait_until

pytestmark = pytest.mark.timeout(90)
T = 30.0   # client timeout (s) of every request


def post(url, body, **kw):
    return httpx.post(url + "/v1/completions", json=body, timeout=T, **kw)


def stream(url, body, headers=None):
    """(chunks as dicts, raw data lines) of one streamed completion."""
    chunks, lines = [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=T,
                      headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if line[6:] != "[DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks, lines


@pytest.mark.parametrize("executor, schedule", [("reference", "native"), ("reference", "oba"), ("epoch", "oba"),
                                                ("epoch", "flowblock")])
def test_concurrent_requests_get_exactly_the_offline_tokens(model, tokenizer, executor, schedule):
    jobs = [dict(prompt=[5 + i, 6, 7, 8][: 1 + i % 4], max_tokens=8 + 6 * i, seed=i, stream=i % 2 == 1)
            for i in range(8)]
    jobs.append(dict(prompt="12+34=", max_tokens=20, seed=3))           # a text prompt through tokenizer.json

    with running_server(model, tokenizer, executor, schedule, batch_cap=4) as (srv, engine, _):
        def one(job):
            if job.get("stream"):
                chunks, _ = stream(srv.url, job)
                return [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]], None
            r = post(srv.url, job)
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            return ch["token_ids"], ch["text"]
        with ThreadPoolExecutor(len(jobs)) as ex:
            outs = list(ex.map(one, jobs))
        assert engine.snapshot()["finished"] == len(jobs)
    for job, (ids, text) in zip(jobs, outs):
        prompt = tokenizer.encode(job["prompt"]).ids if isinstance(job["prompt"], str) else job["prompt"]
        assert ids == offline(model, executor, schedule, prompt, job["max_tokens"], job["seed"]), job
        if text is not None:
            assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_streaming_delivers_blocks_in_order_and_ends_with_the_same_text(model, tokenizer):
    body = dict(prompt="rev 4821=", max_tokens=40, seed=1, stream_options={"include_usage": True})
    with running_server(model, tokenizer, "reference", "oba") as (srv, _, _):
        full = post(srv.url, body).json()
        chunks, lines = stream(srv.url, body)
    assert lines[-1] == "[DONE]"
    blocks = [c for c in chunks if c["choices"] and c["choices"][0]["token_ids"]]
    idx = [c["dblock"]["block"] for c in blocks]
    assert len(blocks) >= 3 and idx == sorted(idx) and len(set(idx)) == len(idx)
    assert all(c["dblock"]["tokens"] == len(c["choices"][0]["token_ids"]) for c in blocks)
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == full["usage"] and chunks[-1]["choices"] == []
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    ids = [t for c in blocks for t in c["choices"][0]["token_ids"]]
    assert ids == full["choices"][0]["token_ids"] == offline(model, "reference", "oba",
                                                             tokenizer.encode("rev 4821=").ids, 40, 1)
    assert len({c["id"] for c in chunks}) == 1


def test_several_prompts_in_one_request_are_independent_choices(model, tokenizer):
    body = dict(prompt=["7+5=", [9, 10, 11]], max_tokens=20, seed=2)
    with running_server(model, tokenizer, "reference", "oba", batch_cap=4) as (srv, _, _):
        full = post(srv.url, body).json()
        chunks, _ = stream(srv.url, body)
    expect = [offline(model, "reference", "oba", p, 20, 2) for p in (tokenizer.encode("7+5=").ids, [9, 10, 11])]
    assert [c["token_ids"] for c in sorted(full["choices"], key=lambda c: c["index"])] == expect
    for i in (0, 1):
        ids = [t for c in chunks for ch in c["choices"] if ch["index"] == i for t in ch["token_ids"]]
        assert ids == expect[i]
    assert full["usage"]["completion_tokens"] == sum(map(len, expect))


BAD = [
    (b"{not json", None, "JSON"),
    (b"[1, 2]", None, "object"),
    ({"max_tokens": 4}, "prompt", "required"),
    ({"prompt": 12}, "prompt", "prompt"),
    ({"prompt": [5, "x"]}, "prompt", "integers"),
    ({"prompt": [5, 99999]}, "prompt", "vocabulary"),
    ({"prompt": []}, "prompt", "prompt"),
    ({"prompt": "a\u00e9"}, "prompt", "tokenized"),
    ({"prompt": [5], "max_tokens": "8"}, "max_tokens", "integer"),
    ({"prompt": [5], "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": [5], "max_tokens": True}, "max_tokens", "integer"),
    ({"prompt": [5], "seed": -1}, "seed", "seed"),
    ({"prompt": [5], "seed": 1.5}, "seed", "seed"),
    ({"prompt": [5], "stream": "yes"}, "stream", "true or false"),
    ({"prompt": [5], "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "true or false"),
    ({"prompt": [5], "n": 0}, "n", ">= 1"),
    ({"prompt": [5], "n": 17}, "n", "at most 16"),
    ({"prompt": [5], "stop": [""]}, "stop", "empty"),
    ({"prompt": [5], "stop": 5}, "stop", "string"),
    ({"prompt": [5], "stop_token_ids": [-1]}, "stop_token_ids", "negative"),
    ({"prompt": [5], "temperature": "hot"}, "temperature", "number"),
    ({"prompt": [5], "model": 3}, "model", "string"),
]


def test_malformed_requests_get_400_naming_the_field(model, tokenizer):
    with running_server(model, tokenizer) as (srv, engine, _):
        for body, param, needle in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = httpx.post(srv.url + "/v1/completions", timeout=T, **kw)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and needle in err["message"], (body, err)
            if param:
                assert err["message"].startswith(param + ":")
        r = post(srv.url, {"prompt": [5], "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert httpx.get(srv.url + "/v1/nothing", timeout=T).status_code == 404
        assert post(srv.url, {"prompt": [5], "max_tokens": 4, "model": "tiny"}).status_code == 200
        assert engine.snapshot()["finished"] == 1 and engine.snapshot()["failed"] == 0


def test_limits_oversized_body_413_long_prompt_and_max_tokens_400_never_fits_400(model, tokenizer):
    limits = Limits(max_body_bytes=2000, max_prompt_tokens=20, max_tokens_limit=64)
    with running_server(model, tokenizer, limits=limits, kv_budget_tokens=48) as (srv, _, _):
        r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "' + b"1" * 5000 + b'"}', timeout=T,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]

        def chunks():                            # no Content-Length: the limit is enforced while reading
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"1" * 500
            yield b'"}'
        r = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=T)
        assert r.status_code == 413
        r = post(srv.url, {"prompt": [5] * 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "20" in r.json()["error"]["message"]
        r = post(srv.url, {"prompt": "1" * 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = post(srv.url, {"prompt": [5], "max_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = post(srv.url, {"prompt": [5] * 10, "max_tokens": 40})     # 56 positions on the grid > budget 48
        assert r.status_code == 400 and "never" in r.json()["error"]["message"]
        assert post(srv.url, {"prompt": [5] * 10, "max_tokens": 6}).status_code == 200


def test_more_requests_than_the_budget_get_429_never_a_crash(model, tokenizer):
    n = 12
    with running_server(model, tokenizer, delay=0.01, batch_cap=2, max_queue=2) as (srv, engine, _):
        barrier = threading.Barrier(n)

        def one(i):
            barrier.wait(10)
            return post(srv.url, dict(prompt=[5 + i, 6], max_tokens=24, seed=i))
        with ThreadPoolExecutor(n) as ex:
            rs = list(ex.map(one, range(n)))
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2, codes
        for i, r in enumerate(rs):
            if r.status_code == 429:
                assert r.headers.get("retry-after") and "busy" in r.json()["error"]["message"]
            else:
                assert r.json()["choices"][0]["token_ids"] == offline(model, "reference", "native", [5 + i, 6], 24, i)
        assert httpx.get(srv.url + "/health", timeout=T).json()["status"] == "ok"
        assert post(srv.url, dict(prompt=[5], max_tokens=4)).status_code == 200
        m = httpx.get(srv.url + "/metrics", timeout=T).text
        assert f'dblock_requests_total{{outcome="rejected_429"}} {codes.count(429)}' in m


def test_a_client_that_disconnects_frees_its_slot(model, tokenizer):
    with running_server(model, tokenizer, delay=0.02, batch_cap=1) as (srv, engine, fwd):
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=T,
                          json=dict(prompt=[5, 6], max_tokens=400, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break                      # got the first block: hang up
        wait_until(lambda: engine.snapshot()["cancelled"] == 1 and engine.snapshot()["running"] == 0)
        assert len(fwd.ended) == 1             # the executor was told to drop the request's state
        # a non-streaming client waiting in the queue behind a long request hangs up too
        long = threading.Thread(target=lambda: post(srv.url, dict(prompt=[7], max_tokens=60)))
        long.start()
        wait_until(lambda: engine.snapshot()["running"] == 1)
        with pytest.raises(httpx.ReadTimeout):      # the client gives up while its request is still queued
            httpx.post(srv.url + "/v1/completions", json=dict(prompt=[8], max_tokens=60), timeout=0.3)
        wait_until(lambda: engine.snapshot()["cancelled"] == 2, timeout=15)
        long.join(T)
        r = post(srv.url, dict(prompt=[5, 6], max_tokens=16))
        assert r.status_code == 200
        assert r.json()["choices"][0]["token_ids"] == offline(model, "reference", "native", [5, 6], 16)


def test_api_key_required_on_every_endpoint_but_health(model, tokenizer):
    with running_server(model, tokenizer, api_key="s3cret") as (srv, _, _):
        assert httpx.get(srv.url + "/health", timeout=T).status_code == 200
        for path, method in (("/v1/completions", "POST"), ("/metrics", "GET"), ("/v1/models", "GET")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, srv.url + path, json={"prompt": [5]}, headers=headers, timeout=T)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, headers)
                assert "API key" in r.json()["error"]["message"]
        ok = {"Authorization": "Bearer s3cret"}
        assert post(srv.url, {"prompt": [5], "max_tokens": 4}, headers=ok).status_code == 200
        assert httpx.get(srv.url + "/metrics", headers=ok, timeout=T).status_code == 200
        chunks, _ = stream(srv.url, {"prompt": [5], "max_tokens": 4}, headers=ok)
        assert chunks


def test_metrics_and_models(model, tokenizer):
    with running_server(model, tokenizer, "epoch", "oba") as (srv, _, _):
        for i in range(3):
            assert post(srv.url, dict(prompt=[5 + i, 6], max_tokens=24)).status_code == 200
        m = httpx.get(srv.url + "/metrics", timeout=T)
        assert m.headers["content-type"].startswith("text/plain")
        vals = {line.split(" ")[0]: float(line.split(" ")[1]) for line in m.text.splitlines()
                if line and not line.startswith("#")}
        for name in ("dblock_queue_length", "dblock_batch_size", "dblock_passes_per_second", "dblock_tpf",
                     "dblock_fresh_row_fraction", "dblock_cache_hit_ratio", "dblock_itl_seconds_count",
                     'dblock_passes_total{kind="denoise"}', 'dblock_requests_total{outcome="finished"}'):
            assert name in vals, name
        assert vals["dblock_passes_per_second"] > 0 and vals["dblock_tpf"] > 0
        assert 0 < vals["dblock_cache_hit_ratio"] < 1           # epoch serves decoded rows from its cache
        assert vals["dblock_fresh_row_fraction"] + vals["dblock_cache_hit_ratio"] == pytest.approx(1)
        assert vals['dblock_requests_total{outcome="finished"}'] == 3
        assert httpx.get(srv.url + "/v1/models", timeout=T).json()["data"][0]["id"] == "tiny"


def test_shutdown_drains_in_flight_requests(model, tokenizer):
    from dblock.serving.engine import Engine, EngineConfig
    from dblock.serving.server import ServerThread, create_app

    from .conftest import DEC, SlowForward, make_forward
    engine = Engine(SlowForward(make_forward(model, "reference"), 0.01), "native", DEC, EngineConfig(batch_cap=2))
    srv = ServerThread(create_app(engine, tokenizer=tokenizer, model_name="tiny", drain_timeout=30)).start()
    jobs = [dict(prompt=[5 + i, 6], max_tokens=40, seed=i, stream=i % 2 == 0) for i in range(5)]
    results = [None] * len(jobs)

    def one(i):
        job = jobs[i]
        if job["stream"]:
            chunks, lines = stream(srv.url, job)
            results[i] = ([t for c in chunks for ch in c["choices"] for t in ch["token_ids"]], lines[-1])
        else:
            r = post(srv.url, job)
            results[i] = (r.json()["choices"][0]["token_ids"], r.status_code)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    wait_until(lambda: engine.snapshot()["running"] + engine.snapshot()["queue_length"] == len(jobs))
    assert engine.snapshot()["queue_length"] > 0            # some are still queued when the shutdown begins
    assert srv.stop(timeout=60)                              # returns once everything was delivered
    for t in threads:
        t.join(T)
    for job, res in zip(jobs, results):
        assert res is not None and res[1] in ("[DONE]", 200)
        assert res[0] == offline(model, "reference", "native", job["prompt"], 40, job["seed"])
    assert not engine.accepting and not engine._thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=2)
