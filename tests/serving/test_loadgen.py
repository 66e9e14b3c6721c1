"""The load generator: Poisson arrivals, replay formats, prompts, statistics, a short run against a live server,
the CLI (`dblock loadgen`) with --json and --plot."""
import json

import numpy as np
import pytest

from dblock.serving import loadgen as lg

from .conftest import running_server

pytestmark = pytest.mark.timeout(90)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = lg.poisson_arrivals(50.0, 200.0, seed=3)
    assert a == lg.poisson_arrivals(50.0, 200.0, seed=3) and a != lg.poisson_arrivals(50.0, 200.0, seed=4)
    assert all(0 <= x < 200 for x in a) and a == sorted(a)
    assert len(a) / 200.0 == pytest.approx(50.0, rel=0.03)
    gaps = np.diff(a)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.05)     # exponential gaps: cv = 1
    with pytest.raises(ValueError, match="rate"):
        lg.poisson_arrivals(0, 1)


def test_replay_formats(tmp_path):
    (tmp_path / "a.txt").write_text("# seconds\n1.5\n0.5\n2.0\n")
    (tmp_path / "b.json").write_text("[3, 1, 2]")
    (tmp_path / "c.jsonl").write_text('{"event": "run"}\n{"event": "request", "arrival_s": 4.0}\n'
                                      '{"event": "request", "arrival_s": 3.5}\n')
    (tmp_path / "d.json").write_text(json.dumps({"servers": [{"runs": [{"arrivals": [0.2, 0.1]}]}]}))
    assert lg.read_arrivals(str(tmp_path / "a.txt")) == [0.0, 1.0, 1.5]
    assert lg.read_arrivals(str(tmp_path / "b.json")) == [0.0, 1.0, 2.0]
    assert lg.read_arrivals(str(tmp_path / "c.jsonl")) == [0.0, 0.5]
    assert lg.read_arrivals(str(tmp_path / "d.json")) == pytest.approx([0.0, 0.1])
    with pytest.raises(ValueError, match="no such|No such"):
        lg.read_arrivals(str(tmp_path / "missing"))


def test_prompts():
    p = lg.load_prompts("task:arith", 5, seed=1)
    assert len(p) == 5 and all(isinstance(x, str) and x.endswith("=") for x in p)
    ids = lg.load_prompts("task:arith", 5, seed=1, token_ids=True)
    assert all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in ids)
    assert lg.load_prompts("ids:1,2;3", 3) in ([[1, 2], [3], [1, 2]], [[3], [1, 2], [3]])
    with pytest.raises(ValueError, match="task:NAME"):
        lg.load_prompts("bogus", 1)


def test_statistics_on_synthetic_samples():
    s = [lg.Sample(0, 0.0, 200, t_first=0.5, t_done=1.0, tokens=10, itl=[0.01, 0.02]),
         lg.Sample(1, 0.5, 429, error="busy", t_done=0.6),
         lg.Sample(2, 1.0, 200, t_first=1.2, t_done=2.0, tokens=30, itl=[0.03])]
    out = lg.summarize(s, [0.0, 0.5, 1.0], 1.5, 2.0)
    assert (out["sent"], out["ok"], out["rejected"], out["errors"]) == (3, 2, 1, 0)
    assert out["throughput_tok_s"] == pytest.approx(40 / 2.0)
    assert out["ttft"]["p50"] == pytest.approx(0.35) and out["itl"]["n"] == 3
    assert out["itl"]["p50"] == pytest.approx(0.02)


def test_a_short_run_against_the_server_and_the_cli(model, tokenizer, tmp_path, capsys):
    from dblock.cli import main
    with running_server(model, tokenizer, "reference", "oba", batch_cap=4) as (srv, engine, _):
        arrivals = lg.poisson_arrivals(20.0, 0.6, seed=0)
        res = lg.run_load(srv.url, arrivals, lg.load_prompts("task:arith", len(arrivals)), 24, rate=20.0,
                          duration=0.6)
        assert res["sent"] == len(arrivals) == res["ok"] == engine.snapshot()["finished"]
        assert res["tokens"] == engine.snapshot()["tokens"] and res["throughput_tok_s"] > 0
        assert res["itl"]["p95"] > 0 and res["itl_server"]["n"] == engine.snapshot()["blocks"]
        assert res["ttft"]["n"] == res["ok"]
        out = str(tmp_path / "lg.json")
        rc = main(["loadgen", "--url", f"oba={srv.url}", "--rates", "10,20", "--duration", "0.4", "--max-tokens",
                   "16", "--json", "--out", out])
        data = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["rate"] for r in data["servers"][0]["runs"]] == [10.0, 20.0]
    assert data["servers"][0]["label"] == "oba" and all(r["errors"] == 0 for r in data["servers"][0]["runs"])
    png = str(tmp_path / "itl.png")
    assert main(["loadgen", "--from", out, out, "--plot", png]) == 0
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "ITL p95" in capsys.readouterr().out


def test_rejections_and_errors_are_counted_not_fatal():
    # nothing listens on this port: every request is an error, the run still returns a summary
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    res = lg.run_load(f"http://127.0.0.1:{port}", [0.0, 0.01], [[5]], 4, timeout=2.0)
    assert res["errors"] == 2 and res["ok"] == 0 and res["error_examples"]
