"""The OpenAI/vLLM surface of the server (in-process, ephemeral 127.0.0.1 ports): chat completions through the chat
template, /tokenize, /detokenize, /v1/models, /version, OpenAI-shaped errors for every status, pydantic validation
naming the field, and Prometheus metrics (dblock's and vLLM's names) read back with prometheus_client's parser."""
import json
import os

import httpx
import pytest

from dblock.serving.chat import ChatTemplate, load_chat_template, resolve_template_arg

from .conftest import offline, running_server

pytestmark = pytest.mark.timeout(90)
T = 30.0
CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "dblock",
                           "checkpoints")


@pytest.fixture(scope="module")
def template():
    """The bundled models' template (the serving tests' random tiny model uses the same character tokenizer)."""
    return load_chat_template(os.path.join(CHECKPOINTS, "tiny-masked"))


def chat(url, body, **kw):
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=T, **kw)


def sse(url, path, body):
    chunks, lines = [], []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=T) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if line[6:] != "[DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks, lines


# ---- chat templates ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-masked", "tiny-uniform"])
def test_bundled_templates_render_a_single_user_message_as_the_bare_prompt(name):
    t = load_chat_template(os.path.join(CHECKPOINTS, name))
    assert t is not None and t.origin.endswith("chat_template.jinja")
    assert t.render([{"role": "user", "content": "123+45="}]) == "123+45="
    assert t.render([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "rev 12="}]) == \
        "rev 12="
    two = [{"role": "user", "content": "7+5="}, {"role": "assistant", "content": "=>12"},
           {"role": "user", "content": "1+1="}]
    assert t.render(two) == "7+5==>12<eos>1+1="
    assert t.render(two[:2], add_generation_prompt=False, continue_final_message=True) == "7+5==>12"
    with pytest.raises(ValueError, match="role 'tool'"):
        t.render([{"role": "tool", "content": "x"}])


def test_template_sources_and_the_command_line_rule(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    assert load_chat_template(str(d)) is None                                # no template anywhere
    cfg = {"eos_token": {"content": "</s>"}, "bos_token": "<s>",
           "chat_template": [{"name": "tool_use", "template": "T"},
                             {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
                                                             "{{ m.content }}{% endfor %}"
                                                             "{% if add_generation_prompt %}[assistant]{% endif %}"}]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_chat_template(str(d))
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi[assistant]"
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<s>[user]hi"
    (d / "chat_template.jinja").write_text("{{ messages[0].content }}{{ eos_token }}")   # the file wins
    assert load_chat_template(str(d)).render([{"role": "user", "content": "hi"}]) == "hi</s>"
    override = tmp_path / "over.jinja"
    override.write_text("{{ raise_exception('no chat here') }}")
    with pytest.raises(ValueError, match="no chat here"):
        load_chat_template(str(d), str(override)).render([{"role": "user", "content": "hi"}])
    assert load_chat_template(str(d), "{{ messages | length }}\\n.").render([{"role": "user"}]) == "1\n."
    with pytest.raises(ValueError, match="looks like a file path"):
        resolve_template_arg(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        ChatTemplate("{% for %}")


def test_the_template_runs_in_a_sandbox():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        t.render([{"role": "user", "content": "x"}])
    t = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}")      # immutable: no mutation
    with pytest.raises(ValueError):
        t.render([{"role": "user", "content": "x"}])


# ---- chat completions ----------------------------------------------------------------------------------------

def test_chat_gives_the_completion_of_the_rendered_prompt_streaming_or_not(model, tokenizer, template):
    msgs = [{"role": "user", "content": "12+34="}]
    with running_server(model, tokenizer, "reference", "oba", chat_template=template) as (srv, _, _):
        r = chat(srv.url, dict(messages=msgs, max_tokens=24, seed=2, model="tiny"))
        assert r.status_code == 200, r.text
        full = r.json()
        comp = httpx.post(srv.url + "/v1/completions", json=dict(prompt="12+34=", max_tokens=24, seed=2),
                          timeout=T).json()
        chunks, lines = sse(srv.url, "/v1/chat/completions",
                            dict(messages=msgs, max_completion_tokens=24, seed=2,
                                 stream_options={"include_usage": True}))
    ids = offline(model, "reference", "oba", tokenizer.encode("12+34=").ids, 24, 2)
    assert full["object"] == "chat.completion" and full["id"].startswith("chatcmpl-") and full["model"] == "tiny"
    ch = full["choices"][0]
    assert ch["message"]["role"] == "assistant" and ch["token_ids"] == ids == comp["choices"][0]["token_ids"]
    assert ch["message"]["content"] == comp["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert ch["finish_reason"] in ("stop", "length") and ch["logprobs"] is None
    assert full["usage"] == {"prompt_tokens": 6, "completion_tokens": len(ids), "total_tokens": 6 + len(ids)}
    # stream: role first, content per block, an empty delta with finish_reason, usage, [DONE]
    assert lines[-1] == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body = [c for c in chunks[1:] if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert body and all(set(c["choices"][0]["delta"]) == {"content"} for c in body)
    assert "".join(c["choices"][0]["delta"]["content"] for c in body) == ch["message"]["content"]
    assert [t for c in body for t in c["choices"][0]["token_ids"]] == ids
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["delta"] == {}
    assert final[0]["choices"][0]["finish_reason"] == ch["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert all("usage" not in c for c in chunks[:-1])


def test_chat_errors(model, tokenizer, template):
    with running_server(model, tokenizer) as (srv, engine, _):               # no template: a clear 400
        r = chat(srv.url, dict(messages=[{"role": "user", "content": "1+1="}]))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "messages" and err["code"] == "no_chat_template" and "--chat-template" in err["message"]
    with running_server(model, None, chat_template=template) as (srv, engine, _):    # no tokenizer.json
        r = chat(srv.url, dict(messages=[{"role": "user", "content": "1+1="}]))
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer"
    with running_server(model, tokenizer, chat_template=template) as (srv, engine, _):
        user = [{"role": "user", "content": "1+1="}]
        for body, param, needle in [
            ({}, "messages", "required"),
            ({"messages": []}, "messages", "non-empty"),
            ({"messages": "hi"}, "messages", "list"),
            ({"messages": [{"content": "x"}]}, "messages[0].role", "required"),
            ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
             "messages[0].content", "text parts"),
            ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "role 'tool'"),
            ({"messages": [{"role": "user", "content": "é"}]}, "messages", "tokenized"),
            ({"messages": user, "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
            ({"messages": user, "temperature": -0.5}, "temperature", ">= 0"),
            ({"messages": user, "top_p": 1.5}, "top_p", "(0, 1]"),
            ({"messages": user, "top_k": -2}, "top_k", "top-k"),
            ({"messages": user, "n": 0}, "n", ">= 1"),
            ({"messages": user, "stop": ["x", 3]}, "stop", "list of strings"),
            ({"messages": user, "min_tokens": -1}, "min_tokens", ">= 0"),
            ({"messages": user, "ignore_eos": "yes"}, "ignore_eos", "true or false"),
            ({"messages": user, "temperature": 1e-6}, "temperature", "0 (greedy)"),
            ({"messages": user, "logprobs": True}, "logprobs", "not supported"),
            ({"messages": user, "tools": [{"type": "function"}]}, "tools", "not supported"),
            ({"messages": user, "chat_template": "{{ 1 }}"}, "chat_template", "--chat-template"),
            ({"messages": user, "continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
            ({"messages": user, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
             "true or false"),
        ]:
            r = chat(srv.url, body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["message"].startswith(param + ":") and needle in err["message"], \
                (body, err)
            assert err["type"] == "invalid_request_error"
        r = chat(srv.url, dict(messages=user, model="gpt-4"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # the neutral values of the sampling and stop fields, penalties and user: same tokens
        plain = chat(srv.url, dict(messages=user, max_tokens=8)).json()["choices"][0]["token_ids"]
        r = chat(srv.url, dict(messages=user, max_tokens=8, temperature=0, top_p=1, top_k=-1, min_tokens=0,
                               ignore_eos=False, stop=[], n=1, presence_penalty=0, user="u"))
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == plain
        # messages that render to nothing: the message and field named, or the template said to render nothing
        for msgs, param, needle in (([{"role": "user"}], "messages[0].content", "missing or empty"),
                                    ([{"role": "user", "content": ""}], "messages[0].content", "missing or empty"),
                                    ([{"role": "system", "content": "be brief"}], "messages",
                                     "rendered nothing")):
            r = chat(srv.url, dict(messages=msgs, max_tokens=8))
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and needle in err["message"], (msgs, err)
        # a field the server would not honour is refused by name, never ignored
        for extra, needle in ((dict(logit_bias={"5": 10}), "no per-token logit offsets"),
                              (dict(functions=[{"name": "f"}]), "legacy function calling"),
                              (dict(function_call="auto"), "legacy function calling"),
                              (dict(presence_penalty=0.5), "not applied"),
                              (dict(unknown_field=1), "not a field this server accepts")):
            r = chat(srv.url, dict(messages=user, max_tokens=8, **extra))
            err = r.json()["error"]
            name = next(iter(extra))
            assert r.status_code == 400 and err["param"] == name and err["message"].startswith(name + ":") and \
                needle in err["message"], (extra, err)
        r = httpx.post(srv.url + "/v1/completions", json=dict(prompt="1+1=", max_tokens=4, logit_bias={"5": 1}),
                       timeout=T)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
        assert engine.snapshot()["failed"] == 0


def test_tokenize_detokenize_models_version(model, tokenizer, template):
    with running_server(model, tokenizer, chat_template=template) as (srv, engine, _):
        post = lambda path, body: httpx.post(srv.url + path, json=body, timeout=T)  # noqa: E731
        r = post("/tokenize", {"prompt": "12+3=", "model": "tiny"}).json()
        assert r["tokens"] == tokenizer.encode("12+3=").ids and r["count"] == 5
        assert r["max_model_len"] == engine.max_positions
        r = post("/tokenize", {"messages": [{"role": "user", "content": "12+3="}], "return_token_strs": True}).json()
        assert r["tokens"] == tokenizer.encode("12+3=").ids and r["token_strs"] == list("12+3=")
        assert post("/detokenize", {"tokens": r["tokens"] + [1]}).json() == {"prompt": "12+3=<eos>"}
        for path, body, param in [("/tokenize", {}, "prompt"),
                                  ("/tokenize", {"prompt": "1", "messages": [{"role": "user", "content": "1"}]},
                                   "prompt"),
                                  ("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/detokenize", {"tokens": [5, "x"]}, "tokens[1]"),
                                  ("/detokenize", {"tokens": [5, 10 ** 6]}, "tokens")]:
            r = post(path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
        m = httpx.get(srv.url + "/v1/models", timeout=T).json()
        assert m["object"] == "list" and [(d["id"], d["object"], d["owned_by"]) for d in m["data"]] == \
            [("tiny", "model", "dblock")]
        assert httpx.get(srv.url + "/v1/models/tiny", timeout=T).json()["id"] == "tiny"
        assert httpx.get(srv.url + "/v1/models/other", timeout=T).status_code == 404
        from dblock import __version__
        assert httpx.get(srv.url + "/version", timeout=T).json() == {"version": __version__}


def test_every_error_is_openai_shaped(model, tokenizer):
    from fastapi.testclient import TestClient

    from dblock.serving.engine import Engine
    from dblock.serving.protocol import Limits
    from dblock.serving.server import create_app

    from .conftest import SlowForward, make_forward

    def shaped(r, status):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        return err

    with running_server(model, tokenizer, api_key="k", limits=Limits(max_body_bytes=500)) as (srv, _, _):
        ok = {"Authorization": "Bearer k"}
        assert shaped(httpx.get(srv.url + "/v1/models", timeout=T), 401)["type"] == "authentication_error"
        err = shaped(httpx.post(srv.url + "/v1/nothing", headers=ok, timeout=T), 404)
        assert err["code"] == "unknown_url" and "/v1/nothing" in err["message"]
        r = httpx.get(srv.url + "/v1/chat/completions", headers=ok, timeout=T)
        assert shaped(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
        shaped(httpx.delete(srv.url + "/metrics", headers=ok, timeout=T), 405)
        shaped(httpx.post(srv.url + "/v1/completions", headers=ok, content=b"x" * 600, timeout=T), 413)
        shaped(httpx.post(srv.url + "/tokenize", headers=ok, json={"prompt": 1}, timeout=T), 400)
    # 422: a parameter FastAPI validates itself (none of the built-in routes has one; a route added for the test)
    app = create_app(Engine(SlowForward(make_forward(model, "reference")), "native"), tokenizer=tokenizer)

    @app.get("/typed")
    async def typed(n: int):
        return {"n": n}
    client = TestClient(app)                       # no lifespan: the engine thread is not started
    err = shaped(client.get("/typed?n=abc"), 422)
    assert err["param"] == "n" and err["message"].startswith("n:")
    assert client.get("/typed?n=3").json() == {"n": 3}


def test_prometheus_metrics_parse_with_vllm_and_diffusion_series(model, tokenizer, template):
    from prometheus_client.parser import text_string_to_metric_families

    with running_server(model, tokenizer, "epoch", "oba", chat_template=template) as (srv, engine, _):
        outs = []
        for i in range(3):
            r = httpx.post(srv.url + "/v1/completions", json=dict(prompt=[5 + i, 6], max_tokens=24), timeout=T)
            outs.append(r.json())
        outs.append(chat(srv.url, dict(messages=[{"role": "user", "content": "1+2="}], max_tokens=16)).json())
        text = httpx.get(srv.url + "/metrics", timeout=T).text
        snap = engine.snapshot()
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name, sample=None, **labels):
        f = fams[name]
        got = [s.value for s in f.samples if s.name == (sample or name)
               and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(got) == 1, (name, sample, labels, f.samples)
        return got[0]

    assert "_created" not in text
    for name, kind in [("dblock:num_requests_running", "gauge"), ("dblock:num_requests_waiting", "gauge"),
                       ("dblock:time_to_first_token_seconds", "histogram"),
                       ("dblock:inter_token_latency_seconds", "histogram"),
                       ("dblock:e2e_request_latency_seconds", "histogram"), ("dblock:prompt_tokens", "counter"),
                       ("dblock:generation_tokens", "counter"), ("dblock:tokens_per_forward", "histogram"),
                       ("dblock:passes_per_block", "histogram"), ("dblock:fresh_row_fraction", "gauge"),
                       ("dblock:atlas_hits", "counter"), ("dblock_tpf", "gauge"), ("dblock_passes", "counter"),
                       ("dblock_itl_seconds", "histogram"), ("dblock_requests", "counter")]:
        assert fams[name].type == kind, name
    n = len(outs)
    prompt = sum(o["usage"]["prompt_tokens"] for o in outs)
    gen = sum(o["usage"]["completion_tokens"] for o in outs)
    m = {"model_name": "tiny"}
    assert value("dblock:num_requests_running", **m) == 0 and value("dblock:num_requests_waiting", **m) == 0
    assert value("dblock:prompt_tokens", "dblock:prompt_tokens_total", **m) == prompt
    assert value("dblock:generation_tokens", "dblock:generation_tokens_total", **m) == gen == snap["tokens"]
    for h in ("dblock:time_to_first_token_seconds", "dblock:e2e_request_latency_seconds",
              "dblock:tokens_per_forward"):
        assert value(h, h + "_count", **m) == n, h
    assert value("dblock:inter_token_latency_seconds", "dblock:inter_token_latency_seconds_count", **m) == gen
    assert value("dblock:passes_per_block", "dblock:passes_per_block_count", **m) == snap["blocks"]
    assert value("dblock:passes_per_block", "dblock:passes_per_block_sum", **m) >= snap["blocks"]
    assert sum(s.value for s in fams["dblock:request_success"].samples) == n
    assert value("dblock:tokens_per_forward", "dblock:tokens_per_forward_sum", **m) > 0
    frac = value("dblock:fresh_row_fraction", **m)
    assert frac == pytest.approx(snap["fresh_row_fraction"]) and 0 < frac < 1     # the epoch cache served rows
    paths = {s.labels["path"]: s.value for s in fams["dblock:epoch_paths"].samples}
    assert paths and value("dblock:atlas_hits", "dblock:atlas_hits_total", **m) == paths.get("hot-skip", 0) > 0
    assert value("dblock_requests", "dblock_requests_total", outcome="finished") == n
    assert value("dblock_http_responses", "dblock_http_responses_total", endpoint="/v1/chat/completions",
                 status="200") == 1
