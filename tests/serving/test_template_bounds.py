"""A chat template is untrusted input: its renders are bounded in time and size and run off the event loop
(dblock/serving/render_worker.py). A looping template costs its own request at most the limit, while /health and a
concurrent normal request are answered; SIGTERM during such a render stops the server within its drain timeout; a
template that fails its startup self-test is one clear startup error."""
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dblock.serving.chat import ChatTemplate, ChatTemplateError
from dblock.serving.render_worker import BoundedRenderer

from .conftest import running_server

#: loops ~10^10 times when the first message says "loop", else renders the message
LOOPING = ("{% if messages[0]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{% endif %}{{ messages[0]['content'] }}")
HUGE = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}"


def test_renderer_stops_a_loop_at_its_time_limit_and_a_flood_at_its_size_limit():
    r = BoundedRenderer(ChatTemplate(LOOPING), time_limit=1.0, max_chars=1000).start()
    try:
        assert r.render([{"role": "user", "content": "hi"}]) == "hi"
        t0 = time.monotonic()
        with pytest.raises(ChatTemplateError, match="longer than 1 s"):
            r.render([{"role": "user", "content": "loop"}])
        assert time.monotonic() - t0 < 3 and r.killed == 1
        assert r.render([{"role": "user", "content": "again"}]) == "again"      # a fresh worker took its place
    finally:
        r.close()
    r = BoundedRenderer(ChatTemplate(HUGE), time_limit=30.0, max_chars=1000)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChatTemplateError, match="more than 1000 characters"):
            r.render([{"role": "user", "content": "x"}])
        assert time.monotonic() - t0 < 10
    finally:
        r.close()


def test_a_looping_render_costs_its_own_request_only(model, tokenizer):
    from dblock.serving.engine import Engine, EngineConfig
    from dblock.serving.server import ServerThread, create_app

    from .conftest import DEC, SlowForward, make_forward
    engine = Engine(SlowForward(make_forward(model, "reference")), "native", DEC, EngineConfig())
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny", drain_timeout=30, poll_s=0.05,
                     chat_template=LOOPING, template_timeout=1.5)
    srv = ServerThread(app).start()
    try:
        out = {}

        def looping():
            t0 = time.monotonic()
            out["r"] = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                                  json={"messages": [{"role": "user", "content": "loop"}], "max_tokens": 4})
            out["s"] = time.monotonic() - t0
        t = threading.Thread(target=looping)
        t.start()
        time.sleep(0.3)                                       # the looping render is under way
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        normal = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                            json={"messages": [{"role": "user", "content": "12+3="}], "max_tokens": 4})
        assert normal.status_code == 200 and time.monotonic() - t0 < 1.2      # answered while the loop runs
        t.join(30)
        r = out["r"]
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "longer than 1.5 s" in r.json()["error"]["message"] and out["s"] < 4
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        assert srv.stop(timeout=30)


def test_a_template_failing_its_self_test_is_a_startup_error(model, tokenizer):
    from dblock.serving.engine import Engine, EngineConfig
    from dblock.serving.server import create_app

    from .conftest import DEC, SlowForward, make_forward
    engine = Engine(SlowForward(make_forward(model, "reference")), "native", DEC, EngineConfig())
    for tpl, why in ((HUGE, "more than"), ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                            "{% endfor %}", "longer than"),
                     ("{{ raise_exception('no') }}", "no")):
        with pytest.raises(ValueError, match="fails its startup self-test.*" + why):
            create_app(engine, tokenizer=tokenizer, chat_template=tpl, template_timeout=1.0,
                       template_max_chars=10_000)


def test_sigterm_during_a_looping_render_stops_the_server_within_its_drain_timeout(model_dir, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text(LOOPING)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-m", "dblock", "serve", "--model", model_dir, "--port", "0",
                          "--chat-template", str(tpl), "--template-timeout", "60", "--drain-timeout", "3",
                          "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        url = p.stdout.readline().split()[2]
        assert httpx.get(url + "/health", timeout=10).status_code == 200

        def looping():
            try:
                httpx.post(url + "/v1/chat/completions", timeout=30,
                           json={"messages": [{"role": "user", "content": "loop"}], "max_tokens": 4})
            except httpx.HTTPError:
                pass
        threading.Thread(target=looping, daemon=True).start()
        time.sleep(1.0)
        assert httpx.get(url + "/health", timeout=5).status_code == 200       # the loop holds no one else
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(20)
        assert time.monotonic() - t0 < 3 + 4                                  # drain timeout + exit
    finally:
        if p.poll() is None:
            p.kill()
            pytest.fail("the server did not stop on SIGTERM")
