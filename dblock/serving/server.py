"""OpenAI-compatible HTTP front end of the engine (FastAPI on uvicorn, the stack vLLM and SGLang use).

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

Sampling (`sampling_of` in `create_app`): each request's temperature / top_p / top_k / stop / stop_token_ids /
min_tokens / ignore_eos become its own `SamplingParams` over the server's defaults (absent temperature: greedy,
dblock's default, unless `dblock serve --temperature T`), so one batch mixes greedy and sampled requests and a seeded
request gets the same tokens alone or batched (docs/algorithms.md §2.4). `n` choices are n engine requests with
seeds seed, seed + 1, ...; choice index = prompt * n + j. Stop strings are tokenized for the engine and matched on
the text (`_TextStops`): the text ends before the first one, as OpenAI; while streaming, text that could begin a
stop string is held back until it cannot.

Errors, every one of them (bad field 400, API key 401, unknown model or path 404, wrong method 405, body not sent
in time 408, body too large 413, framework validation 422, busy 429 with Retry-After, shutting down 503, internal
500), are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.

Safety: with an API key every endpoint but /health needs `Authorization: Bearer <key>` (401 otherwise, compared in
constant time); bodies above `Limits.max_body_bytes` get 413 (checked on Content-Length and while reading);
prompt length and max_tokens above their limits get 400; a full queue 429, shutdown 503. Careless or hostile
clients:
  * a body nesting arrays/objects deeper than `protocol.MAX_JSON_DEPTH` levels: 400 from a scan of the raw bytes,
    before the JSON parser sees it;
  * `request_timeout` (`dblock serve --request-timeout`, default 30 s) bounds both halves of receiving a request:
    a connection that has not delivered complete request headers within it is closed (`_h11_protocol`: uvicorn's
    own timers only cover idle keep-alive connections), and a body not fully received within it gets 408 with
    `Connection: close` (a client that declares a Content-Length and never sends the body);
  * bytes that are not HTTP get h11's 400 and the connection is closed; request headers above
    `MAX_HEADER_BYTES` likewise;
  * a client that disconnects while sending its body is one info line in the log (no traceback);
  * text never becomes a control token by its spelling (`protocol.encode`; chat: `chat.find_special_text`) unless
    the request says `"allow_special_tokens": true`.

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
import re
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
from starlette.requests import ClientDisconnect

from dblock.serving.chat import ChatTemplate, ChatTemplateError, find_special_text, special_text_pattern
from dblock.serving.render_worker import MAX_CHARS, TIME_LIMIT_S, BoundedRenderer
from dblock.serving.render_worker import self_test as template_self_test
from dblock.errors import ConfigError
from dblock.serving.engine import Engine, Rejected
from dblock.serving.metrics import CONTENT_TYPE, Metrics
from dblock.tasks.tokenizer import control_ids as tokenizer_control_ids
from dblock.serving.protocol import (APIError, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatMessageOut,
                                     CompletionChoice, CompletionResponse, DeltaMessage, DetokenizeRequest,
                                     DetokenizeResponse, Limits, ModelCard, ModelList, TokenizeRequest,
                                     TokenizeResponse, UsageInfo, VersionResponse, MAX_SEED, encode, encode_text,
                                     parse, parse_completion)

log = logging.getLogger("dblock.serving")

#: default seconds a client has to send a request's headers, and then its body (`dblock serve --request-timeout`)
REQUEST_TIMEOUT = 30.0
#: most bytes of request line + headers (h11's incomplete-event limit; beyond it h11 answers 400 and closes)
MAX_HEADER_BYTES = 64 * 1024


def _json_response(status: int, body: dict, headers: Optional[dict] = None):
    return JSONResponse(body, status_code=status, headers=headers)


def _error(e: APIError):
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    if e.status == 408:                                   # the rest of the body may never come: end the connection
        headers = {"Connection": "close"}
    return _json_response(e.status, e.body(), headers)


def check_request_timeout(value) -> float:
    """`request_timeout` as a float, or ValueError: a finite number of seconds > 0."""
    import math
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"request_timeout={value!r}: must be a finite number of seconds > 0")
    return float(value)


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


async def _read_body(request, limit: int, timeout: float = REQUEST_TIMEOUT) -> bytes:
    """The request body, at most `limit` bytes (413 above) and within `timeout` seconds (408 beyond); a client that
    disconnects meanwhile is an `APIError` 499 (logged as one line: nobody reads the answer)."""
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

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
                               None, "body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        log.info("%s %s: request body not received within %g s (%d bytes came); answered 408", request.method,
                 request.url.path, timeout, size)
        raise APIError(408, f"request body: not received within {timeout:g} s ({size} of "
                       f"{cl if cl is not None else 'an unknown number of'} bytes came; --request-timeout)", None,
                       "request_timeout") from None
    except ClientDisconnect:
        log.info("%s %s: client disconnected while sending the request body (%d bytes came)", request.method,
                 request.url.path, size)
        raise APIError(499, "client disconnected while sending the request body", None, "cancelled") from None
    return b"".join(chunks)


def _special_spellings(tokenizer) -> list:
    """The text of the tokenizer's special added tokens (what `tokenizers` turns into control tokens)."""
    try:
        return [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    except AttributeError:                                  # not a tokenizers.Tokenizer
        return []


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
    special_re = special_text_pattern(_special_spellings(tokenizer)) if tokenizer is not None else None

    async def read_body(request):
        return await _read_body(request, limits.max_body_bytes, request_timeout)

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

    def decode(ids) -> str:
        if tokenizer is None:
            return ""
        return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def fail(endpoint: str, e: APIError):
        metrics.count_http(endpoint, e.status)
        return _error(e)

    def render(req, add_special_tokens: bool) -> list:
        """`messages` through the chat template and the tokenizer -> prompt ids (or APIError naming `messages`).

        Message strings (and `chat_template_kwargs` strings) holding a special token's spelling are refused unless
        `allow_special_tokens`; the rendered text is then tokenized with special tokens recognised, so the ones the
        template writes are real control tokens (see `chat.py`)."""
        if chat_template is None:
            raise APIError(400, "messages: this model has no chat template (neither chat_template.jinja nor a "
                           "chat_template in tokenizer_config.json in its folder): start the server with "
                           "--chat-template PATH_OR_STRING, or send a prompt to /v1/completions", "messages",
                           "no_chat_template")
        if tokenizer is None:
            raise APIError(400, "messages: this model folder has no tokenizer.json, so messages cannot be encoded: "
                           "send token ids to /v1/completions", "messages", "no_tokenizer")
        messages = req.template_messages()
        allow = bool(req.allow_special_tokens)
        if not allow and special_re is not None:
            hit = find_special_text(messages, special_re, "messages") or \
                find_special_text(req.chat_template_kwargs or {}, special_re, "chat_template_kwargs")
            if hit is not None:
                where, pos, spelled = hit
                raise APIError(400, f"{where}: the text {spelled!r} at position {pos} is the spelling of a special "
                               "token; message text cannot produce control tokens (send \"allow_special_tokens\": "
                               "true to opt in)", where, "special_token_in_text")
        try:
            text = renderer.render(messages, bool(req.add_generation_prompt), bool(req.continue_final_message),
                                   req.chat_template_kwargs)
        except ChatTemplateError as e:
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages",
                           "chat_template_error") from None
        if not text:
            empty = next((i for i, m in enumerate(messages) if not m.get("content")), None)
            if empty is not None:
                raise APIError(400, f"messages[{empty}].content: missing or empty, and the chat template rendered "
                               "nothing from the messages (an empty prompt)", f"messages[{empty}].content",
                               "missing_field")
            roles = ", ".join(sorted({str(m.get("role")) for m in messages}))
            raise APIError(400, f"messages: the chat template rendered nothing from these messages (roles: {roles}; "
                           "an empty prompt -- this model's template may drop system messages: add a user "
                           "message)", "messages", "empty_prompt")
        try:
            return encode(text, "messages", limits, tokenizer, add_special_tokens, allow_special=True)
        except APIError as e:
            if e.code != "invalid_value" or not text:
                raise
            for i, m in enumerate(messages):             # name the message whose text cannot be tokenized
                for key, v in m.items():
                    if isinstance(v, str) and v and v in text:       # (what the template actually wrote)
                        encode_text(tokenizer, v, "messages", allow, add_special_tokens=False,
                                    name=f"messages[{i}].{key}")
            raise

    def sampling_of(req):
        """The request's sampling and stop fields over the server's defaults (`engine.dec`, the `dblock serve`
        decoding flags): (`SamplingParams`, `_TextStops`), or APIError naming the field. OpenAI -> dblock:
        temperature -> SamplingParams.temperature (absent: the server's default, greedy 0 unless --temperature was
        given; OpenAI's default of 1 is not assumed), top_p, top_k (-1 -> 0 = off), stop_token_ids, min_tokens,
        ignore_eos; `stop` strings are tokenized (decoding ends at the first one) and matched on the text, which
        ends before the first stop string (OpenAI). A stop string the tokenizer cannot encode is matched on the
        text only. Without request `stop`, the server's own stop sequences (--stop) are matched as their text."""
        base = engine.dec.sampling_params()
        kw = {}
        if req.temperature is not None:
            kw["temperature"] = float(req.temperature)
        if req.top_p is not None:
            kw["top_p"] = float(req.top_p)
        if req.top_k is not None:
            kw["top_k"] = max(int(req.top_k), 0)
        if req.stop_token_ids is not None:
            kw["stop_token_ids"] = tuple(req.stop_token_ids)
        if req.min_tokens is not None:
            kw["min_tokens"] = int(req.min_tokens)
        if req.ignore_eos is not None:
            kw["ignore_eos"] = bool(req.ignore_eos)
        strings = req.stop_strings
        if req.stop is not None:
            if strings and tokenizer is None:
                raise APIError(400, "stop: this model folder has no tokenizer.json, so stop strings cannot be "
                               "matched: send stop_token_ids", "stop", "no_tokenizer")
            seqs = []
            for i, text in enumerate(strings):
                try:
                    seqs.append(tuple(encode_text(tokenizer, text, "stop", False, add_special_tokens=False)))
                except APIError:                            # cannot be encoded: the text match still applies
                    pass
            kw["stop"] = tuple(seqs)
        else:
            strings = [t for t in (decode(q) for q in base.stop) if t]
        try:
            sampling = base.replace(**kw)
        except ConfigError as e:
            msg = str(e)
            param = next((k for k in kw if msg.startswith(k)), None)
            raise APIError(400, f"{param}: {msg}" if param else msg, param, "invalid_value") from None
        return sampling, _TextStops(decode, strings, sampling)

    async def generate(request, endpoint: str, fmt, prompts: list, max_tokens, seed, stream: bool,
                       include_usage: bool, sampling=None, stops=None, n: int = 1):
        """Submit every prompt n times (sample j with seed + j; choice index prompt * n + j) and answer."""
        stops = stops or _TextStops(decode)
        seeds = None
        if n > 1:
            s0 = engine.dec.seed if seed is None else seed
            if s0 + n - 1 > MAX_SEED:
                return fail(endpoint, APIError(400, f"seed: the {n} choices get seeds {s0}..{s0 + n - 1}, beyond "
                                               f"2^63-1; give a seed <= {MAX_SEED - n + 1}", "seed", "invalid_value"))
            if len(prompts) * n > limits.max_prompts:
                return fail(endpoint, APIError(400, f"n: {len(prompts)} prompts x n={n} = {len(prompts) * n} choices; "
                                               f"at most {limits.max_prompts}", "n", "limit_exceeded"))
            seeds = [s0 + j for _ in prompts for j in range(n)]
            prompts = [p for p in prompts for _ in range(n)]
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def listener(kind, r, data):                       # engine thread -> metrics, event loop
            metrics.on_event(kind, r, data)
            try:
                loop.call_soon_threadsafe(q.put_nowait, (kind, r, data))
            except RuntimeError:                            # loop closed: nobody is listening any more
                pass

        try:
            reqs = engine.submit_many(prompts, max_tokens, seed, listener, tag=fmt.id, sampling=sampling, seeds=seeds)
        except Rejected as e:
            return fail(endpoint, APIError(e.status, e.message, e.param, e.code))
        index = {r.id: i for i, r in enumerate(reqs)}
        metrics.count_http(endpoint, 200)
        if stream:
            return StreamingResponse(_stream(engine, reqs, index, q, fmt, include_usage, stops),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(engine, request, reqs, index, q, fmt, stops, poll_s)

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
            body = await read_body(request)
            creq = parse_completion(body, limits, tokenizer, (model_name,), control_ids)
            sampling, stops = sampling_of(creq)
        except APIError as e:
            return fail(ep, e)
        fmt = _CompletionFormat("cmpl-" + uuid.uuid4().hex[:24], model_name)
        return await generate(request, ep, fmt, creq.prompts, creq.max_tokens, creq.seed, bool(creq.stream),
                              creq.include_usage, sampling, stops, creq.n or 1)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        ep = "/v1/chat/completions"
        try:
            body = await read_body(request)
            creq = parse(ChatCompletionRequest, body, limits, (model_name,))
            ids = await asyncio.to_thread(render, creq, bool(creq.add_special_tokens))   # off the event loop
            sampling, stops = sampling_of(creq)
        except APIError as e:
            return fail(ep, e)
        fmt = _ChatFormat("chatcmpl-" + uuid.uuid4().hex[:24], model_name)
        return await generate(request, ep, fmt, [ids], creq.budget, creq.seed, bool(creq.stream),
                              creq.include_usage, sampling, stops, creq.n or 1)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        ep = "/tokenize"
        try:
            body = await read_body(request)
            req = parse(TokenizeRequest, body, limits, (model_name,))
            if req.messages is not None:
                ids = await asyncio.to_thread(render, req, req.special_tokens)
            else:
                ids = encode(req.prompt, "prompt", limits, tokenizer, req.special_tokens,
                             allow_special=bool(req.allow_special_tokens), control_ids=control_ids)
        except APIError as e:
            return fail(ep, e)
        strs = [tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs and tokenizer else None
        metrics.count_http(ep, 200)
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request):
        ep = "/detokenize"
        try:
            body = await read_body(request)
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

    out = app if api_key is None else AuthMiddleware(app, api_key)
    out.dblock_request_timeout = request_timeout
    return out


# ---------------------------------------------------------------------------------------------------------------
# response shapes: completions and chat share the engine side (`_collect`, `_stream`)
# ---------------------------------------------------------------------------------------------------------------

class _TextStops:
    """The text side of a request's stops, OpenAI's semantics (as vLLM): the returned text ends *before* the first
    stop string (excluded); the text of a stop token id that ended the output is not shown (its id stays in
    `token_ids`); `token_ids` end with the token that completes the stop string. Streaming holds back the end of
    the text while it could still be the start of a stop string (`held`)."""

    def __init__(self, decode, strings=(), sampling=None):
        self.decode, self.strings = decode, [s for s in strings if s]
        self.stop_ids = set(sampling.stop_token_ids) if sampling is not None else set()
        self.min_tokens = sampling.min_tokens if sampling is not None else 0

    def visible(self, ids: list) -> str:
        if ids and ids[-1] in self.stop_ids and len(ids) > self.min_tokens:
            ids = ids[:-1]                                  # the output ends at this stop id (docs/algorithms.md §2.6)
        return self.decode(ids)

    def find(self, text: str) -> Optional[int]:
        """Index of the earliest stop string in `text`, or None."""
        hits = [k for k in (text.find(s) for s in self.strings) if k >= 0]
        return min(hits) if hits else None

    def held(self, text: str) -> int:
        """Characters at the end of `text` that could begin a stop string (not sent yet while streaming)."""
        best = 0
        for s in self.strings:
            for m in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:m]):
                    best = m
                    break
        return best

    def cut(self, ids: list) -> tuple:
        """(text, token ids, stopped by a stop string) of a whole output."""
        text = self.visible(ids)
        k = self.find(text) if self.strings else None
        if k is None:
            return text, list(ids), False
        lo, hi = 1, len(ids)                                # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if self.find(self.visible(ids[:mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        return text[:k], list(ids[:lo]), True


def _usage(reqs, outputs: Optional[dict] = None) -> UsageInfo:
    """Token counts; `outputs` (request id -> the token ids returned) when the text layer cut them at a stop."""
    p = sum(len(r.prompt) for r in reqs)
    c = sum(len(outputs[r.id]) if outputs and r.id in outputs else len(r.output_tokens) for r in reqs)
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

    def text(self, i: int, text: str) -> dict:
        """Text held back while it could start a stop string, sent once the output is final."""
        return self._chunk([CompletionChoice(index=i, text=text, token_ids=[])])

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

    def text(self, i: int, text: str) -> dict:
        return self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=text))])

    def final(self, i: int, r, data: dict) -> dict:
        return self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(),
                                                       finish_reason=data["finish_reason"])],
                           dblock={"request": _request_info(r, data)})

    def response(self, results: list, usage: UsageInfo, infos: list) -> dict:
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage, dblock={"requests": infos},
            choices=[ChatCompletionChoice(index=i, message=ChatMessageOut(content=text), token_ids=ids,
                                          finish_reason=fr) for i, text, ids, fr in results]).model_dump()


async def _collect(engine, request, reqs, index, q, fmt, stops, poll_s):
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
    out, infos, outputs = [], [], {}
    for r in reqs:
        kind, d = results[r.id]
        text, ids, cut = stops.cut(d["ids"])
        outputs[r.id] = ids
        out.append((index[r.id], text, ids, "stop" if cut else d["finish_reason"]))
        infos.append(_request_info(r, d))
    return _json_response(200, fmt.response(out, _usage(reqs, outputs), infos))


def _sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))) + "\n\n"


async def _stream(engine, reqs, index, q, fmt, include_usage, stops):
    """SSE chunks as blocks commit. Cancellation (client gone) lands in `finally`, which cancels the requests.
    Text that could begin a stop string is held back until it cannot (`_TextStops`); after a stop string the
    request's further blocks send nothing."""
    done: set = set()
    ids_so_far = {r.id: [] for r in reqs}
    text_so_far = {r.id: "" for r in reqs}
    sent_ids = {r.id: [] for r in reqs}
    cut_at: dict = {}                                       # request id -> True once its text reached a stop string

    def advance(rid, text):
        prev = text_so_far[rid]
        text_so_far[rid] = text
        return text[len(prev):] if text.startswith(prev) else text

    try:
        for chunk in fmt.opening(len(reqs)):
            yield _sse(chunk)
        while len(done) < len(reqs):
            kind, r, data = await q.get()
            i = index[r.id]
            if kind == "block":
                if r.id in cut_at:
                    continue
                ids_so_far[r.id] += data["ids"]
                text, ids, cut = stops.cut(ids_so_far[r.id])
                if cut:
                    cut_at[r.id] = True
                else:
                    text = text[:len(text) - stops.held(text)]
                new_ids = ids[len(sent_ids[r.id]):]
                sent_ids[r.id] = ids
                yield _sse(fmt.block(i, advance(r.id, text), new_ids, data))
            elif kind == "done":
                done.add(r.id)
                cut = r.id in cut_at
                if not cut:
                    text, ids, cut = stops.cut(data["ids"])
                    sent_ids[r.id] = ids
                    rest = advance(r.id, text)
                    if rest:
                        yield _sse(fmt.text(i, rest))
                yield _sse(fmt.final(i, r, {**data, "finish_reason": "stop"} if cut else data))
            else:                                           # executor error or cancelled
                done.add(r.id)
                status = data.get("status", 499)
                yield _sse(APIError(status, data.get("message", kind), None,
                                    "executor_error" if kind == "error" else kind).body())
        if include_usage:
            yield _sse(fmt.usage(_usage(reqs, sent_ids)))
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


_METHOD = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_REQUEST_LINE_PREFIX = re.compile(_METHOD + rb"{0,32}(?: [\x21-\x7e]*(?: (?:H(?:T(?:T(?:P(?:/[0-9]?(?:\.[0-9]?)?)?)?)?)?"
                                  rb")?)?)?")
_REQUEST_LINE = re.compile(_METHOD + rb"{1,32} [\x21-\x7e]+ HTTP/[0-9]\.[0-9]\r?")


def could_be_request_line(head: bytes) -> bool:
    """Whether the first bytes of a connection (or of the next request on it) can still become an HTTP/1 request
    line `METHOD SP target SP HTTP/x.y CRLF` (leading empty lines allowed, as RFC 9112 asks): false as soon as a
    byte rules it out, so that noise gets its 400 at once instead of waiting out the header timeout."""
    head = head.lstrip(b"\r\n")
    line, nl, _ = head.partition(b"\n")
    if nl:
        return _REQUEST_LINE.fullmatch(line) is not None
    return _REQUEST_LINE_PREFIX.fullmatch(line) is not None


def _h11_protocol(header_timeout: float):
    """uvicorn's h11 protocol with a header deadline: a connection must deliver a complete request head (request
    line and headers) within `header_timeout` seconds of opening, or of its previous response, or it is closed.

    uvicorn arms no timer on a fresh connection, and its keep-alive timer is cancelled by the first byte that
    arrives, so a client sending nothing, or its headers a byte at a time, would otherwise hold a connection (and
    a --max-queue slot of `limit_concurrency`) for ever. Once a request head is complete the app's body timeout
    takes over (`_read_body`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DblockH11Protocol(H11Protocol):
        _header_timer = None
        _waiting_for = None                 # the cycle that was current when the timer was armed
        _head = b""                          # the first bytes of the request head being waited for

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._disarm()
            self._head = b""
            self._waiting_for = self.cycle
            self._header_timer = self.loop.call_later(header_timeout, self._header_timeout)

        def _disarm(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self):
            self._header_timer = None
            if self.transport.is_closing() or self.cycle is not self._waiting_for:
                return
            client = "%s:%s" % self.client[:2] if self.client else "a client"
            log.info("closing the connection from %s: no complete request headers within %g s (--request-timeout)",
                     client, header_timeout)
            self.transport.close()

        def data_received(self, data):
            # only while h11 waits for a new request: after an early answer (a 413 on Content-Length) the rest of
            # that request's body still arrives on a kept-alive connection, and those bytes are a body, not noise
            if (self._header_timer is not None and self.cycle is self._waiting_for and len(self._head) < 256
                    and self.conn.their_state is h11.IDLE):
                self._head = (self._head + data)[:256]
                if not could_be_request_line(self._head):      # bytes that cannot become HTTP: answer now
                    client = "%s:%s" % self.client[:2] if self.client else "a client"
                    log.info("closing the connection from %s: its first bytes are not an HTTP request line", client)
                    self._disarm()
                    body = json.dumps({"error": {"message": "request: the bytes received cannot be an HTTP request "
                                                 "line (METHOD SP target SP HTTP/x.y)", "type": "invalid_request_error",
                                                 "param": None, "code": "bad_request_line"}}).encode()
                    self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                         b"connection: close\r\ncontent-length: " + str(len(body)).encode() +
                                         b"\r\n\r\n" + body)
                    self.transport.close()
                    return
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._waiting_for:
                self._disarm()              # a request head arrived: the app's body timeout applies now

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()                 # waiting for the next request head on a kept-alive connection

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return DblockH11Protocol


def _uvicorn_server(app, log_level: str, drain_timeout: Optional[float], limit_concurrency: Optional[int],
                    handle_signals: bool, request_timeout: Optional[float] = None):
    import uvicorn

    if request_timeout is None:
        request_timeout = getattr(app, "dblock_request_timeout", REQUEST_TIMEOUT)
    request_timeout = check_request_timeout(request_timeout)

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
                            timeout_keep_alive=5, http=_h11_protocol(request_timeout),
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    return Server(config)


def run_server(app, sock: socket.socket, log_level: str = "info", drain_timeout: Optional[float] = None,
               limit_concurrency: Optional[int] = None, request_timeout: Optional[float] = None) -> None:
    """Serve `app` on the bound socket until SIGINT/SIGTERM; in-flight requests are drained first.
    `request_timeout` (default: the app's, see `create_app`): the header deadline of every connection."""
    server = _uvicorn_server(app, log_level, drain_timeout, limit_concurrency, handle_signals=True,
                             request_timeout=request_timeout)
    server.run(sockets=[sock])


class ServerThread:
    """The app on an ephemeral 127.0.0.1 port in a background thread (tests, benchmarks, notebooks).

        with ServerThread(app) as s:  httpx.get(s.url + "/health")
    `stop()` is a graceful shutdown: it returns once in-flight requests were delivered and the engine stopped.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 drain_timeout: Optional[float] = None, limit_concurrency: Optional[int] = None,
                 request_timeout: Optional[float] = None):
        self.server = _uvicorn_server(app, log_level, drain_timeout, limit_concurrency, handle_signals=False,
                                      request_timeout=request_timeout)
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
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
