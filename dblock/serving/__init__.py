"""Serving: a continuous-batching engine at pass granularity, an OpenAI-compatible streaming server, a Poisson load
generator.

    engine.py    `Engine`: request queue, admission (batch cap, KV token budget, queue bound), one pass at a time over
                 every running request (`schedules.step_once`), joins and leaves at pass boundaries, per-block commit
                 events, cancellation, traces. No HTTP, no asyncio: usable in-process.
    protocol.py  pydantic request and response bodies (completions, chat, tokenize), limits; every 4xx names its
                 field in the OpenAI error shape. The models live per endpoint in `protocol_base.py` (errors,
                 Limits, the strict base, parsing), `protocol_prompt.py`, `protocol_sampling.py`,
                 `protocol_completion.py`, `protocol_chat.py`, `protocol_tokenize.py`, `protocol_models.py`;
                 protocol.py re-exports them.
    chat.py      chat templates (`chat_template.jinja` or tokenizer_config.json), rendered in jinja2's sandbox.
    render_worker.py  the template's renders in killable worker processes, with a time and size bound.
    server.py    `create_app(engine, ...)` (FastAPI/uvicorn): /v1/completions and /v1/chat/completions (SSE per
                 committed block), /v1/models, /tokenize, /detokenize, /version, /health, /metrics; API key
                 middleware; graceful drain. Its routes call, as vLLM's OpenAI entrypoint does:
      serving_engine.py        `OpenAIServing`, what the endpoints share: body, sampling fields, submit and answer
      serving_completion.py    /v1/completions and its response format
      serving_chat.py          /v1/chat/completions (messages through the chat template) and its response format
      serving_tokenization.py  /tokenize, /detokenize
      serving_models.py        /v1/models, /version
      streaming.py             engine events -> server-sent events or one body; the text side of stop strings
      responses.py             OpenAI-shaped JSON answers and error handlers
      receiving.py             receiving a request within bounds: header deadline, body size and time
      launcher.py              sockets, uvicorn, signal drain, `run_server`, `ServerThread` for tests
    metrics.py   prometheus_client registry per server: vLLM's series names plus the diffusion ones.
    loadgen.py   open-loop Poisson / replayed arrivals, TTFT, equivalent ITL per block commit, P50/P95/P99, plots.

Its commands (`dblock serve`, `dblock loadgen`) are dblock/cli/serving.py. Only `engine` is exported here (imported on first use); the server needs the `serve` extra (fastapi, uvicorn,
httpx, pydantic, prometheus_client, jinja2).
"""


def __getattr__(name):
    """The engine imports torch: loaded on first use, so `dblock serve --help` stays light."""
    if name in __all__:
        from dblock.serving import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'dblock.serving' has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "EngineRequest", "Rejected", "footprint", "offline_tokens"]
