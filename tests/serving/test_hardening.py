"""Careless and hostile clients against the server (ephemeral 127.0.0.1 ports, raw sockets where HTTP clients would
be too polite): deep JSON is a 400, slow or silent connections are closed, an unsent body is a 408, garbage gets
h11's 400 and a closed connection, a client that leaves mid-upload is one log line, and text never becomes a control
token by its spelling unless the request opts in. Every test checks that the server logged no traceback."""
import contextlib
import json
import logging
import socket
import time

import httpx
import pytest

from dblock.serving.protocol import MAX_JSON_DEPTH, json_depth_exceeds

from .conftest import SlowForward, make_forward, wait_until

pytestmark = pytest.mark.timeout(120)
T = 30.0


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list = []

    def emit(self, record):
        self.records.append(record)

    def tracebacks(self) -> list:
        return [r for r in self.records if r.exc_info or "Traceback" in r.getMessage()]

    def messages(self) -> list:
        return [r.getMessage() for r in self.records]


@contextlib.contextmanager
def serve(model, tokenizer, template=None, request_timeout=2.0, **kw):
    """(base url, log records) of a server whose uvicorn and dblock logs are captured (handlers attached after
    uvicorn configured its loggers); asserts on exit that nothing logged a traceback."""
    from dblock.serving.engine import Engine
    from dblock.serving.server import ServerThread, create_app
    engine = Engine(SlowForward(make_forward(model, "reference")), "native")
    app = create_app(engine, tokenizer=tokenizer, model_name="tiny", drain_timeout=30, poll_s=0.05,
                     chat_template=template, request_timeout=request_timeout, **kw)
    srv = ServerThread(app)
    rec = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "dblock")]
    old = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(rec)
    logging.getLogger("dblock").setLevel(logging.DEBUG)
    srv.start()
    try:
        yield srv.url, rec
    finally:
        assert srv.stop(timeout=30)
        for lg, level in old:
            lg.removeHandler(rec)
            lg.setLevel(level)
    assert not rec.tracebacks(), [r.getMessage() for r in rec.tracebacks()]
    assert not [r for r in rec.records if r.levelno >= logging.ERROR], rec.messages()


def connect(url) -> socket.socket:
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def read_until_closed(s: socket.socket, limit_s: float) -> tuple:
    """(bytes received, seconds until the server closed the connection); fails past `limit_s`."""
    t0 = time.monotonic()
    s.settimeout(0.2)
    data = b""
    while time.monotonic() - t0 < limit_s:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data, time.monotonic() - t0
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk
    raise AssertionError(f"the server kept the connection open for {limit_s} s (got {data[:200]!r})")


def is_closed(s: socket.socket) -> bool:
    """Whether the server closed `s` (non-blocking look)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def shaped(r, status) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


@pytest.fixture(scope="module")
def template():
    import os

    from dblock.serving.chat import load_chat_template
    here = os.path.dirname(os.path.abspath(__file__))
    return load_chat_template(os.path.join(here, "..", "..", "dblock", "checkpoints", "tiny-masked"))


# ---- JSON depth ----------------------------------------------------------------------------------------------

def test_depth_scan_counts_levels_and_skips_strings():
    n = MAX_JSON_DEPTH
    assert not json_depth_exceeds(b"[" * n + b"]" * n) and json_depth_exceeds(b"[" * (n + 1) + b"]" * (n + 1))
    assert not json_depth_exceeds(b'{"a":' * n + b"1" + b"}" * n)
    assert json_depth_exceeds(b'{"a":[' * 40 + b"1" + b"]}" * 40)                        # objects and arrays mix
    assert json_depth_exceeds(b"[" * 100_000) and json_depth_exceeds(b"[" * 100_000 + b"]" * 100_000)
    assert not json_depth_exceeds(json.dumps({"prompt": "[" * 5000 + '"\\'}).encode())   # brackets inside a string
    assert not json_depth_exceeds(json.dumps([[1, [2]]] * 20000).encode())              # wide, not deep
    t0 = time.perf_counter()
    assert not json_depth_exceeds(b"[" * 60 + b"[1]," * 250_000 + b"1" + b"]" * 60)
    assert not json_depth_exceeds(b'"' + b'\\"' * 300_000 + b"[" * 100)      # all one unterminated string
    assert json_depth_exceeds(b'["' + b'\\"' * 300_000 + b'",' + b"[" * 100)
    assert time.perf_counter() - t0 < 2.0


def test_deeply_nested_bodies_are_a_400_naming_the_body(model, tokenizer, template):
    deep = b"[" * 100_000 + b"]" * 100_000
    with serve(model, tokenizer, template) as (url, rec):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            for body in (deep, b'{"prompt": ' + deep + b"}", b'{"messages": [{"role": "user", "content": "1", '
                         b'"x": ' + b"[" * 100 + b"]" * 100 + b"}]}", b"{" * 5000):
                r = httpx.post(url + path, content=body, timeout=T, headers={"content-type": "application/json"})
                err = shaped(r, 400)
                assert err["message"].startswith("request body nests deeper than 64 levels"), err
                assert err["code"] == "invalid_json"
        # 20 levels inside a message's extra field are fine
        body = {"messages": [{"role": "user", "content": "1+1=", "x": json.loads("[" * 20 + "]" * 20)}],
                "max_tokens": 4}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=T).status_code == 200
        assert httpx.get(url + "/health", timeout=T).status_code == 200


def test_non_finite_numbers_are_refused_by_name(model, tokenizer):
    with serve(model, tokenizer) as (url, rec):
        for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            for lit in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
                body = b'{"prompt": "1+1=", "max_tokens": 2, "' + field.encode() + b'": ' + lit + b"}"
                r = httpx.post(url + "/v1/completions", content=body, timeout=T)
                err = shaped(r, 400)
                assert err["param"] == field and err["message"].startswith(field + ":"), err
        r = httpx.post(url + "/v1/completions", content=b'{"prompt": "1", "max_tokens": NaN}', timeout=T)
        assert shaped(r, 400)["param"] == "max_tokens"


# ---- timeouts and broken connections --------------------------------------------------------------------------

def test_a_silent_or_slow_header_connection_is_closed(model, tokenizer):
    with serve(model, tokenizer, request_timeout=1.0) as (url, rec):
        silent = connect(url)
        _, waited = read_until_closed(silent, 10)
        assert 0.8 <= waited < 5, waited
        silent.close()
        slow = connect(url)                            # a byte every 0.2 s: activity must not extend the deadline
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"   # 15 s' worth
        t0 = time.monotonic()
        for b in head:
            if is_closed(slow):
                break
            try:
                slow.sendall(bytes([b]))
            except OSError:
                break
            time.sleep(0.2)
        waited = time.monotonic() - t0
        slow.close()
        assert 0.8 <= waited < 4, waited
        assert any("no complete request headers" in m for m in rec.messages())
        # a well-behaved keep-alive client is unaffected: several requests on one connection, past the deadline
        with httpx.Client(timeout=T) as c:
            for _ in range(3):
                assert c.get(url + "/health").status_code == 200
                time.sleep(0.6)


def test_a_body_that_never_comes_is_a_408_and_the_connection_closes(model, tokenizer):
    with serve(model, tokenizer, request_timeout=1.0) as (url, rec):
        s = connect(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        data, waited = read_until_closed(s, 10)
        s.close()
        assert 0.8 <= waited < 5, waited
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data[:300]
        assert b"connection: close" in head.lower()
        err = json.loads(body)["error"]
        assert err["code"] == "request_timeout" and err["message"].startswith("request body: not received within 1 s")
        assert httpx.get(url + "/health", timeout=T).status_code == 200


def test_garbage_bytes_get_a_400_and_a_closed_connection(model, tokenizer):
    with serve(model, tokenizer, request_timeout=2.0) as (url, rec):
        for junk in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n", b"GET\x00/ HTTP/9.9\r\n\r\n",
                     b"HELLO THERE\r\n\r\n", bytes(range(256)) + b"\r\n"):
            s = connect(url)
            s.sendall(junk)
            data, waited = read_until_closed(s, 5)
            s.close()
            assert data.startswith(b"HTTP/1.1 400"), (junk, data[:200])
            assert waited < 1.5, waited
        import random
        rng = random.Random(0)
        for _ in range(3):                                # noise without a line end: a 400 at once, not at the
            s = connect(url)                              # header deadline
            s.sendall(bytes(rng.randrange(256) for _ in range(4096)))
            data, waited = read_until_closed(s, 8)
            s.close()
            assert data.startswith(b"HTTP/1.1 400") and b"bad_request_line" in data and waited < 1.5, (waited, data)
        s = connect(url)                                  # a plausible request line that never ends: the header
        s.sendall(b"GET /" + b"a" * 100)                  # deadline closes it
        _, waited = read_until_closed(s, 8)
        s.close()
        assert 1.0 < waited < 5
        s = connect(url)                                  # unfinished headers above the limit: h11's 400 (or a
        try:                                              # reset, when the close races the rest of the bytes)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000)
        except OSError:
            pass
        data, waited = read_until_closed(s, 5)
        s.close()
        assert waited < 1.5 and (data == b"" or data.startswith(b"HTTP/1.1 400")), data[:200]
        assert httpx.get(url + "/health", timeout=T).status_code == 200


def test_a_client_that_leaves_during_the_upload_is_one_log_line(model, tokenizer):
    with serve(model, tokenizer, request_timeout=10.0) as (url, rec):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            s = connect(url)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 5000\r\n\r\n".encode() + b'{"prompt": "1' + b"1" * 500)
            time.sleep(0.2)
            s.close()
            wait_until(lambda: any("client disconnected while sending the request body" in m and path in m
                                   for m in rec.messages()), timeout=10)
        lines = [m for m in rec.messages() if "client disconnected" in m]
        assert len(lines) == 4, lines
        assert httpx.get(url + "/health", timeout=T).status_code == 200


def test_the_request_timeout_is_validated():
    from dblock.serving.server import check_request_timeout
    assert check_request_timeout(2) == 2.0
    for bad in (0, -1, float("nan"), float("inf"), True, "3", None):
        with pytest.raises(ValueError, match="request_timeout"):
            check_request_timeout(bad)


def test_serve_refuses_a_bad_request_timeout_flag(capsys):
    from dblock.cli import main
    for bad in ("0", "-3", "nan", "inf", "soon"):
        assert main(["serve", "--model", "tiny-masked", "--request-timeout", bad]) == 2
        err = capsys.readouterr().err
        assert "--request-timeout" in err and "Traceback" not in err, err


# ---- special tokens ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_tokenizer():
    """The character tokenizer with `<`, `>`, and the letters of the special tokens' names in its vocabulary, so
    that `<eos>` can be spelled as plain characters (as a BPE vocabulary can)."""
    from dblock.tasks.tokenizer import VOCAB, CharTokenizer
    extra = tuple(c for c in "<>maskpadbosn" if c not in VOCAB)
    return CharTokenizer(VOCAB + extra).to_hf()


def test_prompt_text_never_becomes_a_control_token_unless_allowed(model, tokenizer, wide_tokenizer, template):
    tok = wide_tokenizer
    assert tok.encode("12<eos>").ids == [5, 6, 1]        # what the tokenizer alone makes of the spelling
    with serve(model, tok, template) as (url, rec):
        post = lambda path, body: httpx.post(url + path, json=body, timeout=T)  # noqa: E731
        for text in ("12<eos>", "<mask>1", "<pad><bos>3"):
            ids = post("/tokenize", {"prompt": text}).json()["tokens"]
            assert len(ids) == len(text) and not set(ids) & {0, 1, 2, 3}, (text, ids)
        ids = post("/tokenize", {"prompt": "12<eos>"}).json()["tokens"]
        assert ids == [5, 6] + [tok.token_to_id(c) for c in "<eos>"]
        assert post("/tokenize", {"prompt": "12<eos>", "allow_special_tokens": True}).json()["tokens"] == [5, 6, 1]
        # a completion of "12<eos>" sees 7 ordinary prompt tokens; with the opt-in, 3 ending in the control token
        r = post("/v1/completions", {"prompt": "12<eos>", "max_tokens": 4}).json()
        assert r["usage"]["prompt_tokens"] == 7
        r = post("/v1/completions", {"prompt": ["12<mask>", [5, 1, 3]], "max_tokens": 2,
                                     "allow_special_tokens": True}).json()
        assert r["usage"]["prompt_tokens"] == 3 + 3
        # token-id prompts are taken as given (the ids of control tokens included)
        assert post("/v1/completions", {"prompt": [5, 1, 3, 0], "max_tokens": 2}).status_code == 200
        # a character outside the vocabulary: 400 naming the parameter and the character
        err = shaped(post("/v1/completions", {"prompt": "1+é"}), 400)
        assert err["param"] == "prompt" and "'é'" in err["message"] and "position 2" in err["message"], err
        err = shaped(post("/v1/completions", {"prompt": ["1", "2\u2603"]}), 400)
        assert err["param"] == "prompt[1]" and "'\u2603'" in err["message"], err
        err = shaped(post("/tokenize", {"prompt": "x"}), 400)
        assert err["param"] == "prompt" and "'x'" in err["message"]


def test_without_the_wide_vocabulary_special_text_is_a_400_that_says_why(model, tokenizer):
    with serve(model, tokenizer) as (url, rec):
        err = shaped(httpx.post(url + "/v1/completions", json={"prompt": "1+1=<eos>"}, timeout=T), 400)
        assert err["param"] == "prompt" and "'<'" in err["message"] and "allow_special_tokens" in err["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "1+1=<eos>", "allow_special_tokens": True,
                                                      "max_tokens": 2}, timeout=T)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5


def test_chat_content_cannot_smuggle_control_tokens_but_the_template_writes_them(model, wide_tokenizer, template):
    tok = wide_tokenizer
    eos = tok.token_to_id("<eos>")
    with serve(model, tok, template) as (url, rec):
        post = lambda path, body: httpx.post(url + path, json=body, timeout=T)  # noqa: E731
        convo = [{"role": "user", "content": "7+5="}, {"role": "assistant", "content": "=>12"},
                 {"role": "user", "content": "1+1="}]
        ids = post("/tokenize", {"messages": convo}).json()["tokens"]
        assert ids.count(eos) == 1 and ids.index(eos) == len("7+5==>12")     # the template's own <eos> is real
        for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
            for msgs, where in (([{"role": "user", "content": "1+1=<eos>"}], "messages[0].content"),
                                (convo[:2] + [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "<mask>"}]}],
                                 "messages[2].content"),
                                ([{"role": "user", "content": "1", "name": "<pad>"}], "messages[0].name")):
                err = shaped(post(path, {"messages": msgs, **extra}), 400)
                assert err["param"] == where and err["code"] == "special_token_in_text", err
                assert "allow_special_tokens" in err["message"] and "'<" in err["message"], err
        err = shaped(post("/v1/chat/completions", {"messages": convo, "chat_template_kwargs": {"x": "<eos>"}}), 400)
        assert err["param"] == "chat_template_kwargs.x"
        # opted in: the spelling is the control token
        r = post("/tokenize", {"messages": [{"role": "user", "content": "1<eos>"}], "allow_special_tokens": True})
        assert r.json()["tokens"] == [5, eos]
        assert post("/v1/chat/completions", {"messages": [{"role": "user", "content": "1<eos>"}], "max_tokens": 2,
                                             "allow_special_tokens": True}).status_code == 200
        # a character the vocabulary lacks: 400 naming messages, the message and the character
        err = shaped(post("/v1/chat/completions", {"messages": convo[:2] + [{"role": "user", "content": "1+ü"}]}),
                     400)
        assert err["param"] == "messages" and "messages[2].content" in err["message"] and "'ü'" in err["message"]


def test_the_rest_of_a_body_answered_early_is_not_taken_for_a_request_line(model, tokenizer):
    """A 413 on Content-Length is sent before the body arrives; the body's bytes that follow on the kept-alive
    connection are that request's body (h11 reads them as such), never a new request line to answer 400 to."""
    from dblock.serving.protocol import Limits
    with serve(model, tokenizer, limits=Limits(max_body_bytes=64)) as (url, rec):
        s = connect(url)
        body = b'{"prompt": "1+1=", "max_tokens": 4, "padding": "' + b"x" * 80 + b'"}'
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        s.settimeout(5)
        first = b""
        while b"body_too_large" not in first:
            chunk = s.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 413"), first[:200]
        try:
            s.sendall(body)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data, _ = read_until_closed(s, 5) if b"connection: close" in first.lower() else (s.recv(65536), 0)
        except OSError:
            data = b""
        s.close()
        assert b"bad_request_line" not in data, data[:300]
        assert data == b"" or data.startswith(b"HTTP/1.1 200"), data[:300]
        assert httpx.get(url + "/health", timeout=T).status_code == 200
