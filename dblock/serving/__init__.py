"""Serving: a continuous-batching engine at pass granularity, an OpenAI-compatible streaming server, a Poisson load
generator.

    engine.py    `Engine`: request queue, admission (batch cap, KV token budget, queue bound), one pass at a time over
                 every running request (`schedules.step_once`), joins and leaves at pass boundaries, per-block commit
                 events, cancellation, traces. No HTTP, no asyncio: usable in-process.
    protocol.py  the `/v1/completions` body, validated by hand (every 4xx names its field), limits.
    server.py    `create_app(engine, ...)` (FastAPI/uvicorn): /v1/completions (SSE per committed block), /health,
                 /metrics, /v1/models; API key middleware; body limits; graceful drain; `ServerThread` for tests.
    metrics.py   Prometheus text exposition.
    loadgen.py   open-loop Poisson / replayed arrivals, TTFT, equivalent ITL per block commit, P50/P95/P99, plots.
    cli.py       `dblock serve`, `dblock loadgen`.

Only `engine` is imported here; the server needs the `serve` extra (fastapi, uvicorn, httpx).
"""
from dblock.serving.engine import Engine, EngineConfig, EngineRequest, Rejected, footprint, offline_tokens

__all__ = ["Engine", "EngineConfig", "EngineRequest", "Rejected", "footprint", "offline_tokens"]
