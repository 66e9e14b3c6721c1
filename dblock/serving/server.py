"""OpenAI-compatible HTTP front end of the engine (FastAPI on uvicorn, the stack vLLM and SGLang use): the app.

`create_app(engine, ...)` builds it: the engine's lifespan (start the engine thread; at shutdown drain and stop it,
and close the chat template's render workers), thin routes that call the endpoint modules, the API key middleware
(`AuthMiddleware`) and the error handlers. The pieces, as vLLM's OpenAI entrypoint lays them out:
  serving_engine.py        `OpenAIServing`: what the endpoints share (body, sampling fields, submit and answer)
  serving_completion.py    /v1/completions and its response format
  serving_chat.py          /v1/chat/completions: messages through the chat template; its response format
  serving_tokenization.py  /tokenize, /detokenize
  serving_models.py        /v1/models, /version
  streaming.py             engine events -> server-sent events or one body; the text side of stop strings
  responses.py             OpenAI-shaped JSON answers and error handlers
  receiving.py             receiving a request within bounds (header deadline, body size and time)
  launcher.py              sockets, uvicorn, `run_server`, `ServerThread`
  protocol.py              the request and response bodies (pydantic), one module per endpoint behind it
`ServerThread`, `run_server`, `bind_socket`, `is_loopback` (launcher.py) and `check_request_timeout`,
`could_be_request_line` (receiving.py) are importable from here too.

Endpoints (request and response bodies: the pydantic models of `protocol.py`)
  POST /v1/completions       OpenAI completions. Non-streaming: one `text_completion`. `"stream": true`: server-sent
                             events, one chunk per committed block (its text and token ids, plus a `dblock` object
                             with the block's index, tokens, passes and server-side block time), then a chunk with
                             `finish_reason` ("stop" at EOS, a stop id or a stop string, "length" at max_tokens),
                             an optional usage chunk (`stream_options.include_usage`), and `data: [DONE]`. With
                             `n` > 1 (or several prompts) every chunk names its choice by `index`.
  POST /v1/chat/completions  OpenAI chat: `messages` rendered by the model's chat template (`chat.py`), then as
                             above; streamed as `chat.completion.chunk`s: `delta.role` first, `delta.content` per
                             committed block, an empty delta with `finish_reason`, usage, `data: [DONE]`. A model
                             without a template (and no --chat-template) answers 400.
  GET  /v1/models            the served model (OpenAI list shape); GET /v1/models/{id} one model
  POST /tokenize             vLLM's: {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}
  POST /detokenize           vLLM's: {"tokens"} -> {"prompt"}
  GET  /version              {"version"}
  GET  /health               200 {"status": "ok"} while serving, 503 {"status": "draining"} during shutdown; never
                             needs a key
  GET  /metrics              Prometheus text (`metrics.py`)

Choices carry `token_ids` beside `text` / `message` (as vLLM's `return_token_ids`); without a tokenizer.json in the
model folder prompts must be token ids and `text` is "" (as vLLM with `skip_tokenizer_init`), and chat is refused.

Sampling: each request's sampling fields become its own `SamplingParams` over the server's defaults; `n` choices are n
engine requests with seeds seed, seed + 1, ...; stop strings are matched on the text (`serving_engine.py`).

Errors, every one of them (bad field 400, API key 401, unknown model or path 404, wrong method 405, body not sent
in time 408, body too large 413, framework validation 422, busy 429 with Retry-After, shutting down 503, internal
500), are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.

Safety: with an API key every endpoint but /health needs `Authorization: Bearer <key>` (401 otherwise, compared in
constant time); bodies above `Limits.max_body_bytes` get 413 (checked on Content-Length and while reading);
prompt length and max_tokens above their limits get 400; a full queue 429, shutdown 503. Careless or hostile
clients:
  * a body nesting arrays/objects deeper than `protocol.MAX_JSON_DEPTH` levels: 400 from a scan of the raw bytes,
    before the JSON parser sees it;
  * `request_timeout` (`dblock serve --request-timeout`, default 30 s) bounds both halves of receiving a request,
    the headers and then the body (`receiving.py`); bytes that are not HTTP get a 400 and the connection is closed;
  * text never becomes a control token by its spelling (`protocol.encode`; chat: `chat.find_special_text`) unless
    the request says `"allow_special_tokens": true`.

Threads: the engine runs in its own thread (the only one touching the model); handlers hand their requests to it
and await its events on the event loop (`serving_engine.py`).

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections and waits for in-flight responses — the engine keeps
running until they are all delivered — then the lifespan shutdown stops the engine (draining anything left).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response

from dblock.serving.chat import ChatTemplate
from dblock.serving.engine import Engine
from dblock.serving.launcher import ServerThread, bind_socket, is_loopback, run_server
from dblock.serving.metrics import CONTENT_TYPE, Metrics
from dblock.serving.protocol_base import APIError, Limits
from dblock.serving.receiving import MAX_HEADER_BYTES, REQUEST_TIMEOUT, check_request_timeout, could_be_request_line
from dblock.serving.render_worker import MAX_CHARS, TIME_LIMIT_S, BoundedRenderer
from dblock.serving.render_worker import self_test as template_self_test
from dblock.serving.responses import _json_response, add_error_handlers
from dblock.serving.serving_chat import OpenAIServingChat
from dblock.serving.serving_completion import OpenAIServingCompletion
from dblock.serving.serving_models import OpenAIServingModels
from dblock.serving.serving_tokenization import OpenAIServingTokenization
from dblock.tasks.tokenizer import control_ids as tokenizer_control_ids

log = logging.getLogger("dblock.serving")

#: importable from here (`dblock.serving.server`) as before the split, wherever they live now
__all__ = ["AuthMiddleware", "MAX_HEADER_BYTES", "REQUEST_TIMEOUT", "ServerThread", "bind_socket",
           "check_request_timeout", "could_be_request_line", "create_app", "is_loopback", "run_server"]


class AuthMiddleware:
    """ASGI middleware: `Authorization: Bearer <key>` on every path but the open ones."""

    def __init__(self, app, api_key: str, open_paths=("/health",)):
        self.app, self.key, self.open = app, api_key.encode(), set(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.open:
            return await self.app(scope, receive, send)
        auth = b""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                auth = v
                break
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            msg = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "invalid API key"
            body = json.dumps(APIError(401, msg, None, "invalid_api_key").body()).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        return await self.app(scope, receive, send)


def create_app(engine: Engine, *, tokenizer=None, model_name: str = "dblock", limits: Optional[Limits] = None,
               api_key: Optional[str] = None, drain_timeout: Optional[float] = None, poll_s: float = 0.25,
               chat_template: Union[ChatTemplate, str, None] = None, request_timeout: float = REQUEST_TIMEOUT,
               template_timeout: float = TIME_LIMIT_S, template_max_chars: int = MAX_CHARS):
    """The ASGI app over `engine`. Its lifespan starts the engine thread and, at shutdown, drains and stops it.

    `chat_template`: a `ChatTemplate` (`chat.load_chat_template`), template text, or None (chat answers 400).
    `request_timeout`: seconds a client has to send the request headers, and then the body (408 beyond); the
    returned app carries it as `dblock_request_timeout` for `ServerThread` / `run_server` (the header half).
    The template renders in killable worker processes (`render_worker.BoundedRenderer`) with at most
    `template_timeout` seconds and `template_max_chars` characters a render (a 400 for that request beyond), off
    the event loop; it must render one user message at startup (`self_test`: a ValueError otherwise)."""

    limits = (limits or Limits()).validate()
    request_timeout = check_request_timeout(request_timeout)
    metrics = Metrics(engine, model_name)
    if isinstance(chat_template, str):
        chat_template = ChatTemplate(chat_template, origin="chat_template")
    renderer = None
    if chat_template is not None:
        renderer = BoundedRenderer(chat_template, template_timeout, template_max_chars).start()
        try:
            template_self_test(renderer)
        except BaseException:
            renderer.close()
            raise
    created = int(time.time())
    max_model_len = int(getattr(engine, "max_positions", 0) or 0)
    control_ids = tokenizer_control_ids(getattr(engine, "cfg", None))
    common = dict(metrics=metrics, limits=limits, tokenizer=tokenizer, model_name=model_name, control_ids=control_ids,
                  request_timeout=request_timeout, poll_s=poll_s)
    serving_completion = OpenAIServingCompletion(engine, **common)
    serving_chat = OpenAIServingChat(engine, chat_template=chat_template, renderer=renderer, **common)
    serving_tokenization = OpenAIServingTokenization(engine, render=serving_chat.render, max_model_len=max_model_len,
                                                     **common)
    serving_models = OpenAIServingModels(model_name, created, max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        log.info("engine started: %s executor, %s schedule, batch cap %d", engine.snapshot()["executor"],
                 engine.spec.name, engine.config.batch_cap)
        yield
        engine.stop_accepting()
        ok = await asyncio.to_thread(engine.shutdown, True, drain_timeout)
        if renderer is not None:
            renderer.close()
        log.info("engine stopped (%s)", "drained" if ok else "drain timed out")

    app = FastAPI(title="dblock", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.metrics, app.state.chat_template = engine, metrics, chat_template

    @app.get("/health")
    async def health():
        s = engine.snapshot()
        body = {"status": "ok" if s["accepting"] else "draining", "running": s["running"],
                "queued": s["queue_length"]}
        return _json_response(200 if s["accepting"] else 503, body)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return await serving_models.show_version()

    @app.get("/v1/models")
    async def models():
        return await serving_models.show_available_models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return await serving_models.show_model(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving_completion.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving_chat.create_chat_completion(request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving_tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving_tokenization.detokenize(request)

    add_error_handlers(app)

    out = app if api_key is None else AuthMiddleware(app, api_key)
    out.dblock_request_timeout = request_timeout
    return out
