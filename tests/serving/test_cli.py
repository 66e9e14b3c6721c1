"""`dblock serve` / `dblock loadgen` on the command line: safe defaults, one-line errors, a real process that
drains on SIGTERM."""
import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from dblock.cli import main

pytestmark = pytest.mark.timeout(90)


def test_commands_are_registered(capsys):
    from dblock.cli import build_parser
    sub = build_parser()._subparsers._group_actions[0].choices
    assert "serve" in sub and "loadgen" in sub


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1", "::"])
def test_non_loopback_without_a_key_is_refused(model_dir, capsys, monkeypatch, host):
    monkeypatch.delenv("DBLOCK_API_KEY", raising=False)
    rc = main(["serve", "--model", model_dir, "--host", host, "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--api-key" in err and "--allow-unauthenticated" in err and len(err.strip().splitlines()) == 1


def test_loopback_detection():
    from dblock.serving.server import is_loopback
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.3.2.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")


def test_loadgen_usage_errors(capsys):
    assert main(["loadgen", "--rate", "1"]) == 2 and "--url" in capsys.readouterr().err
    assert main(["loadgen", "--url", "http://127.0.0.1:9"]) == 2 and "--rate" in capsys.readouterr().err


def test_serve_process_answers_and_drains_on_sigterm(model_dir, tmp_path):
    trace = str(tmp_path / "serve.jsonl")
    env = {"DBLOCK_API_KEY": "k3y", "PATH": "/usr/bin:/bin"}
    p = subprocess.Popen([sys.executable, "-m", "dblock", "serve", "--model", model_dir, "--port", "0",
                          "--schedule", "oba", "--trace", trace, "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert "http://127.0.0.1:" in line and "API key required" in line, line
        url = line.split()[2]
        h = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.post(url + "/v1/completions", json={"prompt": "12+3="}, timeout=10).status_code == 401
        out = {}

        def long_request():        # still decoding when SIGTERM arrives
            r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 400}, headers=h,
                           timeout=60)
            out["r"] = r
        t = threading.Thread(target=long_request)
        t.start()
        for _ in range(500):
            m = httpx.get(url + "/metrics", headers=h, timeout=10).text
            if "dblock_requests_running 1" in m:
                break
        p.send_signal(signal.SIGTERM)
        t.join(60)
        rc = p.wait(60)
        rest = p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0, rest
    r = out["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == len(r.json()["choices"][0]["token_ids"])
    assert "stopped after 1 requests" in rest
    events = [json.loads(x) for x in open(trace)]
    assert events[0]["event"] == "run" and events[0]["schedule"] == "oba"
    assert sum(e["event"] == "request" for e in events) == 1
