"""Careless-client fuzzing of the HTTP server: request bodies for `/v1/completions`, `/v1/chat/completions`,
`/tokenize` and `/detokenize`, built from the real field names with good and bad values (wrong types, huge,
negative, NaN and Infinity numbers — the JSON literals too —, missing and unknown fields, nested junk, unicode,
special-token text), plus raw bodies that are not JSON objects at all (truncated, deep, invalid UTF-8, lone
surrogates), sent over loopback to one in-process server (`dblock.serving.server.ServerThread`, a random tiny
llada2_moe with the character tokenizer, at most 8 new tokens).

Every case must end in a 2xx (a stream ending in `data: [DONE]`), or a 4xx in the OpenAI error shape whose message
starts with the field it names (`param`), or with "request body" when the body as a whole is at fault; never a
5xx, never past the per-request time bound (`T`), and never a traceback or an error line in the server's log.

Hypothesis runs derandomized with fixed budgets (`EXAMPLES`) sized so this file takes well under a minute on two
busy cores; each test prints how many cases it tried and how many were answered 2xx or 4xx.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(240)

#: examples per endpoint (derandomized): the counts are printed by each test
EXAMPLES = {"/v1/completions": 500, "/v1/chat/completions": 400, "/tokenize": 250, "/detokenize": 150, "raw": 250}
#: seconds one request may take before it counts as a hang
T = 20.0
SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
CHAT_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "dblock",
                             "checkpoints", "tiny-masked")

# ---- value pools ----------------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
ARITH = "0123456789+-*=>,:;(). revsot"
SPECIAL_TEXT = ["<eos>", "1+1=<eos>", "<mask>", "12<mask>3", "<pad><bos>", "<eos", "eos>", "<<eos>>"]
HUGE_INTS = [2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 10 ** 30, -(2 ** 63), -(10 ** 30), 10 ** 300]
BAD_NUMBERS = [NAN, INF, -INF, -1, 0, -0.0, 1.5, 1e308, -1e-308] + HUGE_INTS

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(BAD_NUMBERS),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.sampled_from(SPECIAL_TEXT))
junk = st.recursive(scalars, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=6), ch,
                                                                                   max_size=3), max_leaves=6)
arith = st.text(alphabet=ARITH, min_size=1, max_size=12)
texts = st.one_of(arith, arith, arith, st.sampled_from(SPECIAL_TEXT), st.text(max_size=10),
                  st.sampled_from(["", " ", "\x00", "é", "\u2603", "\U0001f600", "1" * 300, "1" * 2000]))
token_ids = st.lists(st.integers(0, 40), min_size=1, max_size=8)
bad_token_ids = st.lists(st.one_of(st.integers(), st.sampled_from(BAD_NUMBERS), st.text(max_size=3), st.none(),
                                   st.booleans()), max_size=5)
bools = st.booleans()
not_bool = st.one_of(st.sampled_from(["true", "false", 1, 0, NAN, [], {}]), junk)


def field(good, bad, p=0.5):
    return (good, bad, p)


def sampling_fields(budget: str) -> dict:
    return {
        "model": field(st.just("tiny"), st.one_of(st.sampled_from(["gpt-4", "", "TINY"]), junk), 0.3),
        budget: field(st.integers(1, 8), st.one_of(st.sampled_from([0, 9, 1024, 2.0, "8", True]), st.sampled_from(
            BAD_NUMBERS), junk), 0.8),
        "seed": field(st.one_of(st.integers(0, 2 ** 63 - 1), st.none()),
                      st.one_of(st.sampled_from([-1, 2 ** 63, 1.0, "0"]), st.sampled_from(BAD_NUMBERS)), 0.4),
        "stream": field(bools, not_bool, 0.4),
        "stream_options": field(st.fixed_dictionaries({"include_usage": bools}),
                                st.one_of(st.fixed_dictionaries({"include_usage": not_bool}), junk), 0.2),
        "temperature": field(st.one_of(st.just(0), st.floats(1e-4, 2)),
                             st.sampled_from([NAN, INF, -INF, -0.5, "1", 1e999, 1e-6]), 0.3),
        "top_p": field(st.floats(0.01, 1), st.sampled_from([NAN, INF, 0, 1.5, -1, "1"]), 0.2),
        "top_k": field(st.sampled_from([-1, 0, 1, 20]), st.sampled_from([-2, 1.5, NAN, "5", 2 ** 64]), 0.2),
        # the server applies no penalties: only 0 or null is accepted, any other number is refused by name
        "presence_penalty": field(st.sampled_from([0, 0.0, None]),
                                  st.one_of(st.floats(-2, 2).filter(bool), st.sampled_from([NAN, INF, 3, "0"])), 0.1),
        "frequency_penalty": field(st.sampled_from([0, 0.0, None]),
                                   st.one_of(st.floats(-2, 2).filter(bool), st.sampled_from([NAN, -INF, 3, "0"])),
                                   0.1),
        "n": field(st.sampled_from([1, 2]), st.sampled_from([0, 5, -1, NAN, "1", 2 ** 64]), 0.2),
        "stop": field(st.one_of(st.sampled_from([None, [], "\n", ";", ["=>", "x"]]), arith),
                      st.one_of(st.sampled_from(["", [""], [1], ["a"] * 17, "x" * 300]), junk), 0.2),
        "stop_token_ids": field(st.lists(st.integers(0, 31), max_size=3),
                                st.one_of(st.sampled_from([[-1], [96], [2 ** 64], [True], "1"]), junk), 0.1),
        "min_tokens": field(st.integers(0, 1), st.sampled_from([9, -1, NAN, "0"]), 0.1),
        "ignore_eos": field(bools, st.sampled_from(["no", 0]), 0.1),
        "user": field(st.text(max_size=8), junk, 0.1),
    }


COMPLETION_FIELDS = {
    "prompt": field(st.one_of(texts, token_ids, st.lists(st.one_of(texts, token_ids), min_size=1, max_size=3)),
                    st.one_of(bad_token_ids, st.lists(st.one_of(texts, bad_token_ids), max_size=6), junk), 0.95),
    **sampling_fields("max_tokens"),
    "best_of": field(st.just(1), st.sampled_from([0, 2, NAN]), 0.1),
    "echo": field(st.just(False), st.sampled_from([True, "false"]), 0.1),
    "logprobs": field(st.sampled_from([None, 0]), st.sampled_from([1, -1, NAN, "0"]), 0.1),
    "suffix": field(st.none(), st.one_of(st.text(max_size=4), junk), 0.1),
    "add_special_tokens": field(bools, not_bool, 0.2),
    "allow_special_tokens": field(bools, not_bool, 0.3),
}

ROLES = ["user", "assistant", "system", "developer"]


@st.composite
def message(draw, good: bool):
    content = st.one_of(texts, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                                   min_size=1, max_size=2))
    if good:        # text the tokenizer spells, with no special token's spelling in it
        m = {"role": draw(st.sampled_from(ROLES)), "content": draw(st.one_of(arith, st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": arith}), min_size=1, max_size=2)))}
        if draw(st.floats(0, 1)) < 0.15:
            m[draw(st.sampled_from(["name", "x", "tool_calls"]))] = draw(junk)
        return m
    kind = draw(st.sampled_from(["role", "content", "text", "missing", "junk", "parts"]))
    if kind == "text":         # None, special-token spelling, characters outside the vocabulary
        return {"role": draw(st.sampled_from(ROLES)), "content": draw(content)}
    if kind == "role":
        return {"role": draw(st.one_of(st.sampled_from(["tool", "", "USER", "function"]), junk)),
                "content": draw(content)}
    if kind == "content":
        return {"role": "user", "content": draw(junk)}
    if kind == "missing":
        return draw(st.sampled_from([{"content": "1"}, {"role": "user"}, {}]))
    if kind == "parts":
        return {"role": "user", "content": draw(st.lists(st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", "", 1]), "text": junk}), junk),
            min_size=1, max_size=3))}
    return draw(junk)


def messages(good: bool):
    if good:
        return st.lists(message(True), min_size=1, max_size=4)
    return st.one_of(st.lists(st.one_of(message(True), message(False)), min_size=1, max_size=4), st.just([]), junk)


RENDER_FIELDS = {
    "add_generation_prompt": field(bools, not_bool, 0.2),
    # true together with add_generation_prompt (default true) is refused by name: "any" mode reaches it
    "continue_final_message": field(st.just(False), st.one_of(st.just(True), not_bool), 0.15),
    "chat_template_kwargs": field(st.dictionaries(st.text(alphabet="abcxyz_", max_size=6), st.one_of(
                                      st.none(), st.booleans(), st.integers(), arith), max_size=3),
                                  st.one_of(st.sampled_from([[], "x", 1]), junk), 0.15),
    "add_special_tokens": field(bools, not_bool, 0.15),
    "allow_special_tokens": field(bools, not_bool, 0.3),
}

CHAT_FIELDS = {
    "messages": field(messages(True), messages(False), 0.95),
    **sampling_fields("max_completion_tokens"),
    "max_tokens": field(st.integers(1, 8), st.sampled_from([0, 9, NAN, "2"]), 0.3),
    **RENDER_FIELDS,
    "chat_template": field(st.none(), st.one_of(st.text(max_size=6), junk), 0.05),
    "logprobs": field(st.just(False), st.sampled_from([True, 1, "no"]), 0.1),
    "top_logprobs": field(st.sampled_from([None, 0]), st.sampled_from([1, -1, NAN]), 0.1),
    "tools": field(st.sampled_from([None, []]), st.one_of(st.just([{"type": "function"}]), junk), 0.1),
    "tool_choice": field(st.sampled_from([None, "none", "auto"]), st.one_of(st.just("required"), junk), 0.1),
    "response_format": field(st.sampled_from([None, {"type": "text"}]),
                             st.one_of(st.just({"type": "json_object"}), junk), 0.1),
}

TOKENIZE_FIELDS = {
    "model": field(st.just("tiny"), st.one_of(st.just("gpt-4"), junk), 0.2),
    "prompt": field(texts, st.one_of(token_ids, junk), 0.6),
    "messages": field(messages(True), messages(False), 0.5),
    "return_token_strs": field(bools, not_bool, 0.3),
    **RENDER_FIELDS,
}

DETOKENIZE_FIELDS = {
    "model": field(st.just("tiny"), st.one_of(st.just("gpt-4"), junk), 0.2),
    "tokens": field(st.lists(st.integers(0, 31), max_size=8), st.one_of(bad_token_ids, junk), 0.95),
}

#: fields of which a valid body has exactly one
ONE_OF = {"/tokenize": ("prompt", "messages")}
FIELDS = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS, "/tokenize": TOKENIZE_FIELDS,
          "/detokenize": DETOKENIZE_FIELDS}


@st.composite
def body(draw, path: str) -> dict:
    """A JSON object for `path`: all fields good, exactly one bad, or any value anywhere; sometimes an unknown
    field or two."""
    fields = FIELDS[path]
    mode = draw(st.sampled_from(["good", "good", "one bad", "one bad", "any"]))
    present = [k for k, (_, _, p) in fields.items() if draw(st.floats(0, 1)) < p]
    if path in ONE_OF and mode != "any" and draw(st.floats(0, 1)) < 0.9:
        keep = draw(st.sampled_from(ONE_OF[path]))
        present = [k for k in present if k not in ONE_OF[path]] + [keep]
    bad_one = draw(st.sampled_from(present)) if mode == "one bad" and present else None
    out = {}
    for k in present:
        good, bad, _ = fields[k]
        use_bad = k == bad_one or (mode == "any" and draw(st.booleans()))
        out[k] = draw(bad if use_bad else good)
    if draw(st.floats(0, 1)) < 0.2:        # fields the server does not honour: refused by name, never ignored
        from dblock.serving.protocol import NOT_HONOURED
        out[draw(st.sampled_from(["unknown", "extra_body", "dblock", "", "prompt_ids"] + sorted(NOT_HONOURED)))] = \
            draw(junk)
    return out


def encode(obj, draw) -> bytes:
    """JSON text, NaN and Infinity as their (non-standard) literals; sometimes escaped to ASCII."""
    return json.dumps(obj, allow_nan=True, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")


@st.composite
def request_bytes(draw, path: str) -> bytes:
    return encode(draw(body(path)), draw)


@st.composite
def raw_request(draw):
    """(path, bytes) of bodies that are not a valid JSON object for the endpoint, or barely one."""
    path = draw(st.sampled_from(sorted(FIELDS)))
    kind = draw(st.sampled_from(["truncated", "not an object", "deep", "bytes", "surrogate", "literal", "empty",
                                 "duplicate keys", "big number"]))
    if kind == "truncated":
        b = encode(draw(body(path)), draw)
        return path, b[: draw(st.integers(0, max(0, len(b) - 1)))]
    if kind == "not an object":
        return path, encode(draw(st.one_of(scalars, st.lists(junk, max_size=3))), draw)
    if kind == "deep":
        n = draw(st.sampled_from([63, 64, 65, 200, 5000, 100_000]))
        o, c = draw(st.sampled_from([("[", "]"), ('{"a":', "}"), ('{"prompt":[', "]}")]))
        inner = draw(st.sampled_from(["1", "", '"x"']))
        return path, (o * n + inner + (c * n if draw(st.booleans()) else "")).encode()
    if kind == "bytes":
        return path, draw(st.binary(max_size=40))
    if kind == "surrogate":
        return path, ('{"prompt": "1\ud800", "messages": [{"role": "user", "content": "\udfff"}], '
                      '"tokens": [1]}').encode("utf-8", "surrogatepass")
    if kind == "literal":
        lit = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000, "0x10", "01",
                                    "1.", ".5", "+1", "true", "null", "undefined"]))
        key = draw(st.sampled_from(["max_tokens", "seed", "temperature", "tokens", "prompt", "top_p", "n"]))
        return path, ('{"prompt": "1+1=", "messages": [{"role": "user", "content": "1"}], "tokens": [1], "'
                      + key + '": ' + lit + "}").encode()
    if kind == "empty":
        return path, draw(st.sampled_from([b"", b" ", b"\n", b"{}", b"[]", b"null", b"\xef\xbb\xbf{}"]))
    if kind == "duplicate keys":
        return path, b'{"prompt": "1", "prompt": [5], "tokens": [1], "tokens": "x", "max_tokens": 2}'
    return path, ('{"prompt": [5], "tokens": [5], "max_tokens": ' + "9" * draw(st.integers(18, 400)) + "}").encode()


# ---- the server and the contract -------------------------------------------------------------------------------

class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, log handler, httpx client) of one server over a random tiny model, for the whole module."""
    import dblock
    from dblock.prompts import load_tokenizer
    from dblock.decoding.params import DecodeConfig
    from dblock.serving.chat import load_chat_template
    from dblock.serving.engine import Engine, EngineConfig
    from dblock.serving.protocol import Limits
    from dblock.serving.server import ServerThread, create_app
    from dblock.tasks import CharTokenizer
    from dblock.tiny import make_tiny
    from tests.serving.conftest import SlowForward, make_forward

    d = str(tmp_path_factory.mktemp("request-fuzz") / "tiny")
    make_tiny("llada2_moe", d, seed=0)
    CharTokenizer().save(d)
    model = dblock.load(d, dtype="float32")
    engine = Engine(SlowForward(make_forward(model, "reference")), "native", DecodeConfig(max_new_tokens=8),
                    EngineConfig(batch_cap=4, max_queue=64))
    limits = Limits(max_body_bytes=1 << 20, max_prompt_tokens=64, max_tokens_limit=8, max_prompts=4)
    app = create_app(engine, tokenizer=load_tokenizer(model), model_name="tiny", limits=limits, drain_timeout=30,
                     poll_s=0.05, chat_template=load_chat_template(CHAT_TEMPLATE), request_timeout=10.0)
    srv = ServerThread(app)
    log = _Log()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "dblock")]
    for lg in loggers:
        lg.addHandler(log)
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=T) as client:
            yield srv.url, log, client
    finally:
        assert srv.stop(timeout=30)
        for lg in loggers:
            lg.removeHandler(log)


def check(server, path: str, data: bytes) -> str:
    """Send one body and check the contract; return "2xx" or "4xx"."""
    url, log, client = server
    seen = len(log.records)
    headers = {"content-type": "application/json"}
    try:
        with client.stream("POST", path, content=data, headers=headers) as r:
            raw = r.read()
    except httpx.TimeoutException:
        pytest.fail(f"POST {path} hung for more than {T} s: {data[:300]!r}")
    where = f"POST {path} {data[:300]!r} -> {r.status_code} {raw[:400]!r}"
    assert r.status_code < 500, where
    new = log.records[seen:]
    bad = [x for x in new if x.exc_info or x.levelno >= logging.ERROR or "Traceback" in x.getMessage()]
    assert not bad, (where, [x.getMessage() for x in bad])
    if 200 <= r.status_code < 300:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
            assert events and events[-1] == "[DONE]", where
            chunks = [json.loads(e) for e in events[:-1]]
            assert all("error" not in c for c in chunks), where
        else:
            json.loads(raw)
        return "2xx"
    assert 400 <= r.status_code < 500, where
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, where
    msg, param = err["message"], err["param"]
    assert isinstance(msg, str) and msg, where
    if param is not None:
        assert msg.startswith(param + ":"), where
    else:
        assert msg.startswith("request body"), where
    return "4xx"


#: one body per endpoint that the contract accepts, tried before the generated ones, so the accepted side is
#: exercised whatever sequence this Hypothesis version draws
VALID = {"/v1/completions": {"model": "tiny", "prompt": "1+1=", "max_tokens": 4, "temperature": 0},
         "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "1+1="}],
                                  "max_completion_tokens": 4, "stream": True},
         "/tokenize": {"model": "tiny", "prompt": "12+3="}, "/detokenize": {"model": "tiny", "tokens": [5, 6, 7]}}


def _fuzz(name: str, strategy, server, capsys):
    counts: Counter = Counter()

    @settings(max_examples=EXAMPLES[name], **SETTINGS)
    @given(strategy)
    def run(case):
        path, data = case
        counts[check(server, path, data)] += 1

    if name in VALID:
        run = example((name, json.dumps(VALID[name]).encode()))(run)
    run()
    with capsys.disabled():
        print(f"\nrequest fuzz {name}: {sum(counts.values())} cases ({counts['2xx']} 2xx, {counts['4xx']} 4xx)")
    assert sum(counts.values()) >= EXAMPLES[name] // 2
    return counts


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_request_bodies(path, server, capsys):
    counts = _fuzz(path, st.tuples(st.just(path), request_bytes(path)), server, capsys)
    assert counts["2xx"] and counts["4xx"], counts        # both sides of the contract were exercised


def test_raw_bodies(server, capsys):
    counts = _fuzz("raw", raw_request(), server, capsys)
    assert counts["4xx"], counts


def test_the_server_is_still_healthy_and_counted_no_failures(server):
    url, log, client = server
    assert client.get("/health").status_code == 200
    assert not [x for x in log.records if x.exc_info or x.levelno >= logging.ERROR]
