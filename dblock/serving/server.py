"""OpenAI-compatible HTTP front end of the engine (FastAPI on uvicorn, the stack vLLM and SGLang use).

Endpoints (request and response bodies: the pydantic models of `protocol.py`)
  POST /v1/completions       OpenAI completions. Non-streaming: one `text_completion`. `"stream": true`: server-sent
                             events, one chunk per committed block (its text and token ids, plus a `dblock` object
                             with the block's index, tokens, passes and server-side block time), then a chunk with
                             `finish_reason` ("stop" at EOS, "length" at max_tokens), an optional usage chunk
                             (`stream_options.include_usage`), and `data: [DONE]`.
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

Errors, every one of them (bad field 400, API key 401, unknown model or path 404, wrong method 405, body too large
413, framework validation 422, busy 429 with Retry-After, shutting down 503, internal 500), are OpenAI-shaped:
{"error": {"message", "type", "param", "code"}}.

Safety: with an API key every endpoint but /health needs `Authorization: Bearer <key>` (401 otherwise, compared in
constant time); bodies above `Limits.max_body_bytes` get 413 (checked on Content-Length and while reading);
prompt length and max_tokens above their limits get 400; a full queue 429, shutdown 503.

Threads: the engine runs in its own thread (the only one touching the model); a handler submits its request with a
listener that records the request's metrics and hands each engine event to the event loop
(`loop.call_soon_threadsafe`), where the handler awaits a per-request asyncio queue. A client that disconnects
cancels its requests: the slot is free at the next pass boundary.

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections and waits for in-flight responses — the engine keeps
running until they are all delivered — then the lifespan shutdown stops the engine (draining anything left).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dblock.serving.chat import ChatTemplate, ChatTemplateError
from dblock.serving.engine import Engine, Rejected
from dblock.serving.metrics import CONTENT_TYPE, Metrics
from dblock.serving.protocol import (APIError, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatMessageOut,
                                     CompletionChoice, CompletionResponse, DeltaMessage, DetokenizeRequest,
                                     DetokenizeResponse, Limits, ModelCard, ModelList, TokenizeRequest,
                                     TokenizeResponse, UsageInfo, VersionResponse, encode, parse, parse_completion)

log = logging.getLogger("dblock.serving")


def _json_response(status: int, body: dict, headers: Optional[dict] = None):
    return JSONResponse(body, status_code=status, headers=headers)


def _error(e: APIError):
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return _json_response(e.status, e.body(), headers)


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


async def _read_body(request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise APIError(400, "Content-Length: not an integer", None, "invalid_header") from None
        if n > limit:
            raise APIError(413, f"request body of {n} bytes exceeds this server's limit of {limit} bytes "
                           "(--max-body-bytes)", None, "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
                           None, "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(engine: Engine, *, tokenizer=None, model_name: str = "dblock", limits: Optional[Limits] = None,
               api_key: Optional[str] = None, drain_timeout: Optional[float] = None, poll_s: float = 0.25,
               chat_template: Union[ChatTemplate, str, None] = None):
    """The ASGI app over `engine`. Its lifespan starts the engine thread and, at shutdown, drains and stops it.

    `chat_template`: a `ChatTemplate` (`chat.load_chat_template`), template text, or None (chat answers 400)."""

    limits = (limits or Limits()).validate()
    metrics = Metrics(engine, model_name)
    if isinstance(chat_template, str):
        chat_template = ChatTemplate(chat_template, origin="chat_template")
    created = int(time.time())
    max_model_len = int(getattr(engine, "max_positions", 0) or 0)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        log.info("engine started: %s executor, %s schedule, batch cap %d", engine.snapshot()["executor"],
                 engine.spec.name, engine.config.batch_cap)
        yield
        engine.stop_accepting()
        ok = await asyncio.to_thread(engine.shutdown, True, drain_timeout)
        log.info("engine stopped (%s)", "drained" if ok else "drain timed out")

    app = FastAPI(title="dblock", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.metrics, app.state.chat_template = engine, metrics, chat_template

    def decode(ids) -> str:
        if tokenizer is None:
            return ""
        return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def fail(endpoint: str, e: APIError):
        metrics.count_http(endpoint, e.status)
        return _error(e)

    def render(req, add_special_tokens: bool) -> list:
        """`messages` through the chat template and the tokenizer -> prompt ids (or APIError naming `messages`)."""
        if chat_template is None:
            raise APIError(400, "messages: this model has no chat template (neither chat_template.jinja nor a "
                           "chat_template in tokenizer_config.json in its folder): start the server with "
                           "--chat-template PATH_OR_STRING, or send a prompt to /v1/completions", "messages",
                           "no_chat_template")
        if tokenizer is None:
            raise APIError(400, "messages: this model folder has no tokenizer.json, so messages cannot be encoded: "
                           "send token ids to /v1/completions", "messages", "no_tokenizer")
        try:
            text = chat_template.render(req.template_messages(), bool(req.add_generation_prompt),
                                        bool(req.continue_final_message), req.chat_template_kwargs)
        except ChatTemplateError as e:
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages",
                           "chat_template_error") from None
        return encode(text, "messages", limits, tokenizer, add_special_tokens)

    async def generate(request, endpoint: str, fmt, prompts: list, max_tokens, seed, stream: bool,
                       include_usage: bool):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def listener(kind, r, data):                       # engine thread -> metrics, event loop
            metrics.on_event(kind, r, data)
            try:
                loop.call_soon_threadsafe(q.put_nowait, (kind, r, data))
            except RuntimeError:                            # loop closed: nobody is listening any more
                pass

        try:
            reqs = engine.submit_many(prompts, max_tokens, seed, listener, tag=fmt.id)
        except Rejected as e:
            return fail(endpoint, APIError(e.status, e.message, e.param, e.code))
        index = {r.id: i for i, r in enumerate(reqs)}
        metrics.count_http(endpoint, 200)
        if stream:
            return StreamingResponse(_stream(engine, reqs, index, q, fmt, include_usage, decode),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(engine, request, reqs, index, q, fmt, decode, poll_s)

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
        from dblock import __version__
        return VersionResponse(version=__version__).model_dump()

    def card() -> ModelCard:
        return ModelCard(id=model_name, created=created, root=model_name, max_model_len=max_model_len or None)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return _error(APIError(404, f"model: {model_id!r} is not served here (serving {model_name!r})", "model",
                                   "model_not_found"))
        return card().model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        ep = "/v1/completions"
        try:
            body = await _read_body(request, limits.max_body_bytes)
            creq = parse_completion(body, limits, tokenizer, (model_name,))
        except APIError as e:
            return fail(ep, e)
        fmt = _CompletionFormat("cmpl-" + uuid.uuid4().hex[:24], model_name)
        return await generate(request, ep, fmt, creq.prompts, creq.max_tokens, creq.seed, bool(creq.stream),
                              creq.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ep = "/v1/chat/completions"
        try:
            body = await _read_body(request, limits.max_body_bytes)
            creq = parse(ChatCompletionRequest, body, limits, (model_name,))
            ids = render(creq, bool(creq.add_special_tokens))
        except APIError as e:
            return fail(ep, e)
        fmt = _ChatFormat("chatcmpl-" + uuid.uuid4().hex[:24], model_name)
        return await generate(request, ep, fmt, [ids], creq.budget, creq.seed, bool(creq.stream),
                              creq.include_usage)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        ep = "/tokenize"
        try:
            body = await _read_body(request, limits.max_body_bytes)
            req = parse(TokenizeRequest, body, limits, (model_name,))
            if req.messages is not None:
                ids = render(req, req.special_tokens)
            else:
                ids = encode(req.prompt, "prompt", limits, tokenizer, req.special_tokens)
        except APIError as e:
            return fail(ep, e)
        strs = [tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs and tokenizer else None
        metrics.count_http(ep, 200)
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request):
        ep = "/detokenize"
        try:
            body = await _read_body(request, limits.max_body_bytes)
            req = parse(DetokenizeRequest, body, limits, (model_name,))
            if tokenizer is None:
                raise APIError(400, "tokens: this model folder has no tokenizer.json, so ids cannot be decoded",
                               "tokens", "no_tokenizer")
            V = tokenizer.get_vocab_size(with_added_tokens=True)
            bad = next((t for t in req.tokens if not 0 <= t < V), None)
            if bad is not None:
                raise APIError(400, f"tokens: token id {bad} outside the vocabulary 0..{V - 1}", "tokens",
                               "invalid_value")
        except APIError as e:
            return fail(ep, e)
        metrics.count_http(ep, 200)
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False)).model_dump()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):                   # unknown path, wrong method, ... in OpenAI shape
        where = f"{request.method} {request.url.path}"
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            e = APIError(404, f"{where}: no such endpoint", None, "unknown_url")
        elif exc.status_code == 405:
            allowed = headers.get("Allow") or headers.get("allow")
            e = APIError(405, f"{where}: method not allowed" + (f" (allowed: {allowed})" if allowed else ""), None,
                         "method_not_allowed")
        else:
            e = APIError(exc.status_code, f"{where}: {exc.detail}", None, None)
        return _json_response(e.status, e.body(), headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):                      # parameters FastAPI itself validated
        errs = exc.errors() or [{}]
        loc = [p for p in errs[0].get("loc", ()) if p not in ("body", "query", "path", "header", "cookie")]
        param = "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + str(p) for i, p in enumerate(loc))
        msg = str(errs[0].get("msg", "invalid"))
        e = APIError(422, f"{param}: {msg}" if param else msg, param or None, "invalid_value")
        return _json_response(422, e.body())

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):                   # one JSON line instead of a bare 500 page
        log.exception("unhandled error on %s", request.url.path)
        return _json_response(500, APIError(500, f"internal error: {type(exc).__name__}").body())

    return app if api_key is None else AuthMiddleware(app, api_key)


# ---------------------------------------------------------------------------------------------------------------
# response shapes: completions and chat share the engine side (`_collect`, `_stream`)
# ---------------------------------------------------------------------------------------------------------------

def _usage(reqs) -> UsageInfo:
    p = sum(len(r.prompt) for r in reqs)
    c = sum(len(r.output_tokens) for r in reqs)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _request_info(r, data: dict) -> dict:
    c = data.get("counters", {})
    return {"Y": c.get("Y"), "K": c.get("K"), "F": c.get("F"), "Q": c.get("Q"), "TPF": c.get("TPF"),
            "ttft_s": data.get("ttft_s"), "e2e_s": data.get("e2e_s"), "queue_s": data.get("queue_s"),
            "blocks": [{k: b[k] for k in ("block", "tokens", "passes", "block_time_s")} for b in r.commits]}


def _block_info(data: dict) -> dict:
    return {"block": data["index"], "tokens": data["tokens"], "passes": data["passes"],
            "block_time_s": data["block_time_s"], "itl_s": data["itl_s"]}


class _CompletionFormat:
    def __init__(self, id_: str, model: str):
        self.id, self.model, self.created = id_, model, int(time.time())

    def _chunk(self, choices, **kw) -> dict:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  **kw).model_dump()

    def opening(self, n: int) -> list:
        return []

    def block(self, i: int, text: str, ids: list, data: dict) -> dict:
        return self._chunk([CompletionChoice(index=i, text=text, token_ids=ids)], dblock=_block_info(data))

    def final(self, i: int, r, data: dict) -> dict:
        return self._chunk([CompletionChoice(index=i, text="", token_ids=[], finish_reason=data["finish_reason"])],
                           dblock={"request": _request_info(r, data)})

    def usage(self, usage: UsageInfo) -> dict:
        return self._chunk([], usage=usage)

    def response(self, results: list, usage: UsageInfo, infos: list) -> dict:
        return self._chunk([CompletionChoice(index=i, text=text, token_ids=ids, finish_reason=fr)
                            for i, text, ids, fr in results], usage=usage, dblock={"requests": infos})


class _ChatFormat(_CompletionFormat):
    def _chunk(self, choices, **kw) -> dict:
        return ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                            **kw).model_dump()

    def opening(self, n: int) -> list:
        return [self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(n)]

    def block(self, i: int, text: str, ids: list, data: dict) -> dict:
        return self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=text), token_ids=ids)],
                           dblock=_block_info(data))

    def final(self, i: int, r, data: dict) -> dict:
        return self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(),
                                                       finish_reason=data["finish_reason"])],
                           dblock={"request": _request_info(r, data)})

    def response(self, results: list, usage: UsageInfo, infos: list) -> dict:
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage, dblock={"requests": infos},
            choices=[ChatCompletionChoice(index=i, message=ChatMessageOut(content=text), token_ids=ids,
                                          finish_reason=fr) for i, text, ids, fr in results]).model_dump()


async def _collect(engine, request, reqs, index, q, fmt, decode, poll_s):
    results: dict = {}
    try:
        while len(results) < len(reqs):
            try:
                kind, r, data = await asyncio.wait_for(q.get(), timeout=poll_s)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return _json_response(499, APIError(499, "client disconnected", None, "cancelled").body())
                continue
            if kind in ("done", "error", "cancelled"):
                results[r.id] = (kind, data)
    finally:
        for r in reqs:
            if r.id not in results:
                engine.cancel(r)
    errors = [(k, d) for k, d in results.values() if k != "done"]
    if errors:
        kind, d = errors[0]
        status = d.get("status", 500) if kind == "error" else 499
        return _json_response(status, APIError(status, d.get("message", kind), None,
                                               "executor_error" if status == 500 else kind).body())
    out, infos = [], []
    for r in reqs:
        kind, d = results[r.id]
        ids = d["ids"]
        out.append((index[r.id], decode(ids), ids, d["finish_reason"]))
        infos.append(_request_info(r, d))
    return _json_response(200, fmt.response(out, _usage(reqs), infos))


def _sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))) + "\n\n"


async def _stream(engine, reqs, index, q, fmt, include_usage, decode):
    """SSE chunks as blocks commit. Cancellation (client gone) lands in `finally`, which cancels the requests."""
    done: set = set()
    ids_so_far = {r.id: [] for r in reqs}
    text_so_far = {r.id: "" for r in reqs}
    try:
        for chunk in fmt.opening(len(reqs)):
            yield _sse(chunk)
        while len(done) < len(reqs):
            kind, r, data = await q.get()
            i = index[r.id]
            if kind == "block":
                ids_so_far[r.id] += data["ids"]
                full = decode(ids_so_far[r.id])
                prev = text_so_far[r.id]
                delta = full[len(prev):] if full.startswith(prev) else full
                text_so_far[r.id] = full
                yield _sse(fmt.block(i, delta, data["ids"], data))
            elif kind == "done":
                done.add(r.id)
                yield _sse(fmt.final(i, r, data))
            else:                                           # executor error or cancelled
                done.add(r.id)
                status = data.get("status", 499)
                yield _sse(APIError(status, data.get("message", kind), None,
                                    "executor_error" if kind == "error" else kind).body())
        if include_usage:
            yield _sse(fmt.usage(_usage(reqs)))
        yield _sse("[DONE]")
    finally:
        for r in reqs:
            if r.id not in done:
                engine.cancel(r)


# ---------------------------------------------------------------------------------------------------------------
# running it
# ---------------------------------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    import ipaddress
    if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: an ephemeral port; read it back with getsockname)."""
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise ValueError(f"--host {host}: cannot resolve")
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app, log_level: str, drain_timeout: Optional[float], limit_concurrency: Optional[int],
                    handle_signals: bool):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with signal handling that drains and returns (no re-raise of the signal)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if not handle_signals or threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = [signal.SIGINT, signal.SIGTERM]

            def handler(sig, frame):
                if self.should_exit:                      # second signal: stop waiting for in-flight requests
                    self.force_exit = True
                else:
                    log.warning("dblock serve: %s received, draining in-flight requests (again to force)",
                                signal.Signals(sig).name)
                    self.should_exit = True
            old = {s: signal.signal(s, handler) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout, limit_concurrency=limit_concurrency,
                            timeout_keep_alive=5)
    return Server(config)


def run_server(app, sock: socket.socket, log_level: str = "info", drain_timeout: Optional[float] = None,
               limit_concurrency: Optional[int] = None) -> None:
    """Serve `app` on the bound socket until SIGINT/SIGTERM; in-flight requests are drained first."""
    server = _uvicorn_server(app, log_level, drain_timeout, limit_concurrency, handle_signals=True)
    server.run(sockets=[sock])


class ServerThread:
    """The app on an ephemeral 127.0.0.1 port in a background thread (tests, benchmarks, notebooks).

        with ServerThread(app) as s:  httpx.get(s.url + "/health")
    `stop()` is a graceful shutdown: it returns once in-flight requests were delivered and the engine stopped.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 drain_timeout: Optional[float] = None, limit_concurrency: Optional[int] = None):
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = _uvicorn_server(app, log_level, drain_timeout, limit_concurrency, handle_signals=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="dblock-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("dblock server thread did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> bool:
        self.server.should_exit = True
        self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()
        return not self.thread.is_alive()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
