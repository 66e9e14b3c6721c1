"""A real `dblock serve --model tiny-masked` process on a free 127.0.0.1 port, driven by the official `openai` Python
client: completions and chat completions (plain and streamed), models.list(), and the client's typed errors.

The server runs with an API key (DBLOCK_API_KEY in its environment), so a wrong key is an AuthenticationError.
Readiness is polled for a bounded time; the process is always terminated (SIGTERM, then kill)."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(180)
KEY = "test-key-123"
MODEL = "tiny-masked"
PROMPT = "123+45="
# A prompt outside the training lengths (a reversal of 11 digits; the bundled models saw at most 6): the model is
# unsure there, so a sampled decode visibly differs from the greedy one (on in-distribution prompts it is too sure).
UNSURE = "rev 31415926535="
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DBLOCK_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
    log = open(os.devnull, "w")
    p = subprocess.Popen([sys.executable, "-m", "dblock", "serve", "--model", MODEL, "--port", str(port),
                          "--host", "127.0.0.1", "--log-level", "warning", "--max-new-tokens", "64"],
                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:                                       # /health needs no key
            if p.poll() is not None:
                raise RuntimeError(f"dblock serve exited with {p.returncode} before it was ready")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("dblock serve was not ready within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_completions_plain_and_streamed(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, seed=0)
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    text = r.choices[0].text
    assert "=>" in text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.total_tokens == len(PROMPT) + r.usage.completion_tokens
    parts, reasons, usage = [], [], None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, seed=0, stream=True,
                                           stream_options={"include_usage": True}):
        for c in chunk.choices:
            parts.append(c.text)
            reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    assert "".join(parts) == text
    assert [x for x in reasons if x] == [r.choices[0].finish_reason]
    assert usage.completion_tokens == r.usage.completion_tokens


def test_chat_completions_plain_and_streamed_give_the_completion_answer(client):
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64).choices[0]
    msgs = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    m = r.choices[0]
    assert m.message.role == "assistant" and m.message.content == comp.text
    assert m.finish_reason == comp.finish_reason
    assert r.usage.prompt_tokens == len(PROMPT)
    roles, parts, reasons, usage = [], [], [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=64, stream=True,
                                                stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                parts.append(c.delta.content)
            reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    assert roles == ["assistant"] and "".join(parts) == comp.text
    assert [x for x in reasons if x] == [comp.finish_reason]
    assert usage.prompt_tokens == len(PROMPT) and usage.completion_tokens == r.usage.completion_tokens
    # temperature 0 is dblock's greedy default, whatever the filters
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0, top_p=0.9,
                                        extra_body={"top_k": 5})
    assert r2.choices[0].message.content == comp.text


def test_seeded_sampling_with_n_choices(client):
    kw = dict(model=MODEL, prompt=UNSURE, max_tokens=64, temperature=0.8, seed=1, n=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]          # seeded: repeats
    one = client.completions.create(model=MODEL, prompt=UNSURE, max_tokens=64, temperature=0.8, seed=2)
    assert a.choices[1].text == one.choices[0].text                             # choice j has seed + j
    greedy = client.completions.create(model=MODEL, prompt=UNSURE, max_tokens=64).choices[0].text
    assert a.choices[0].text != greedy


def test_models_list(client):
    models = client.models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [(MODEL, "model", "dblock")]
    assert client.models.retrieve(MODEL).id == MODEL


def test_errors_are_typed_by_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value) and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=8)
    assert e.value.param == "messages" and "non-empty" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": PROMPT}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="not-the-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    # the server still answers after all of that
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].finish_reason
