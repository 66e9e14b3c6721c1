"""Open-loop load generator for OpenAI-compatible `/v1/completions` servers (`dblock loadgen`).

Arrivals: Poisson at `rate` req/s for `duration` seconds (exponential gaps from a seeded generator), or replayed
from a file (`read_arrivals`: one time per line, a JSON list, a loadgen JSON output, or an engine trace whose request
events carry `arrival_s`). Every request is sent at its arrival time whatever happened to earlier ones (open loop),
streaming, and timed on the client:

  TTFT                first chunk carrying tokens − send time
  equivalent ITL      per chunk carrying n tokens (one per committed block on dblock):
                        (receive time − receive time of the previous such chunk) / n;
                      for the first chunk the server's own block time (dblock's `block_time_s`: first pass →
                      commit) / n when the server reports it, else no sample (TTFT covers it)
  ITL (server)        dblock's reported block_time_s / tokens for every block (no network or client delay)
  throughput          tokens received / (last response done − first request sent)
  e2e                 last byte − send time
P50/P95/P99 of each. Rejections (429/503) and errors are counted, never fatal. Tokens per chunk: `token_ids` when the
server sends them (dblock, vLLM with return_token_ids), else 1 per non-empty text chunk (one token per chunk, as vLLM
and SGLang stream).
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


# ---------------------------------------------------------------------------------------------------------------
# arrivals and prompts
# ---------------------------------------------------------------------------------------------------------------

def poisson_arrivals(rate: float, duration: float, seed: int = 0) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process of `rate` per second."""
    if rate <= 0:
        raise ValueError(f"--rate {rate}: must be positive (requests per second)")
    if duration <= 0:
        raise ValueError(f"--duration {duration}: must be positive (seconds)")
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration:
            return out
        out.append(t)


#: arrival times one file may hold, and the span they may cover (seconds)
MAX_ARRIVALS = 10_000_000
MAX_SPAN_S = 1e9


def read_arrivals(path: str, flag: str = "--replay") -> list[float]:
    """Arrival times (s, from 0) from a file: one number per line, a JSON list, a loadgen `--json` output (the
    arrivals of its first run), or a JSON-lines engine trace (request events' `arrival_s`). Read as untrusted input
    (`dblock.input_files`): finite times >= 0, at most MAX_ARRIVALS of them within MAX_SPAN_S; every problem is one
    error naming `flag` and the file."""
    import math

    from dblock.errors import InputFileError
    from dblock.input_files import MAX_TRACE_BYTES, read_text, where
    from dblock.trace import check_event
    w = where(path, flag)
    text = read_text(path, flag, MAX_TRACE_BYTES)
    vals = None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, list):
        vals = obj
    elif isinstance(obj, dict) and obj.get("servers"):
        try:
            vals = obj["servers"][0]["runs"][0]["arrivals"]
        except (KeyError, IndexError, TypeError):
            raise InputFileError(f"{w}: a loadgen results file without servers[0].runs[0].arrivals") from None
    elif obj is not None and not isinstance(obj, (int, float)):
        raise InputFileError(f"{w}: JSON that holds no arrival times (a list of seconds, loadgen results or an "
                             "engine trace)")
    if vals is None and text.lstrip().startswith("{"):
        vals = []
        for i, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line:
                try:
                    ev = json.loads(line)
                except (ValueError, RecursionError):
                    raise InputFileError(f"{w}:{i}: not JSON (an engine trace has one event per line)") from None
                ev = check_event(ev, f"{w}:{i}")
                if ev.get("event") == "request" and ev.get("arrival_s") is not None:
                    vals.append(ev["arrival_s"])
    if vals is None:
        vals = [line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not isinstance(vals, list) or len(vals) > MAX_ARRIVALS:
        raise InputFileError(f"{w}: expected at most {MAX_ARRIVALS:,} arrival times in seconds")
    try:
        a = sorted(float(v) for v in vals if not isinstance(v, bool))
    except (TypeError, ValueError):
        raise InputFileError(f"{w}: expected arrival times in seconds") from None
    if len(a) != len(vals):
        raise InputFileError(f"{w}: expected arrival times in seconds (found true/false)")
    if not a:
        raise InputFileError(f"{w}: no arrival times")
    if not all(math.isfinite(t) for t in a) or a[-1] - a[0] > MAX_SPAN_S:
        raise InputFileError(f"{w}: arrival times must be finite and span at most {MAX_SPAN_S:g} s")
    return [t - a[0] for t in a]


def load_prompts(spec: str, n: int, seed: int = 0, token_ids: bool = False) -> list:
    """`task:NAME` (the task's test-split prompts, e.g. task:arith), `file:PATH` (one prompt per line, or JSON
    lines with a "prompt" key), or `ids:1,2,3;4,5` (token-id prompts). `token_ids`: send task/file prompts as ids
    encoded with the character tokenizer (for models without a tokenizer.json)."""
    if n <= 0:
        return []
    kind, _, arg = spec.partition(":")
    if kind == "task":
        from dblock.tasks import BUNDLED_TASK, get_task
        exs = get_task(arg or BUNDLED_TASK).examples("test", min(n, 500))
        base = [e.prompt for e in exs]
    elif kind == "file":
        from dblock.errors import InputFileError
        from dblock.input_files import parse_json, read_text
        lines = [line for line in read_text(arg, "--prompts").splitlines() if line.strip()]
        base = []
        for i, line in enumerate(lines, 1):
            if line.lstrip().startswith("{"):
                d = parse_json(line, f"--prompts {arg}:{i}")
                if not isinstance(d, dict) or not isinstance(d.get("prompt"), str):
                    raise InputFileError(f"--prompts {arg}:{i}: a JSON line needs a string 'prompt'")
                base.append(d["prompt"])
            else:
                base.append(line)
    elif kind == "ids":
        try:
            base = [[int(x) for x in part.split(",") if x.strip()] for part in arg.split(";") if part.strip()]
        except ValueError:
            raise ValueError(f"--prompts {spec}: expected ids:1,2,3;4,5") from None
    else:
        raise ValueError(f"--prompts {spec!r}: expected task:NAME, file:PATH or ids:1,2,3;4,5")
    if not base:
        raise ValueError(f"--prompts {spec}: no prompts")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(base))
    out = [base[order[i % len(base)]] for i in range(n)]
    if token_ids:
        from dblock.tasks import CharTokenizer
        tok = CharTokenizer()
        out = [tok.encode(p) if isinstance(p, str) else p for p in out]
    return out


# ---------------------------------------------------------------------------------------------------------------
# one request
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Sample:
    i: int
    t_send: float                       # seconds from the run start (scheduled arrival)
    status: int = 0                     # HTTP status; 0 = connection error
    error: Optional[str] = None
    t_first: Optional[float] = None     # first chunk with tokens
    t_done: Optional[float] = None
    tokens: int = 0
    itl: list = field(default_factory=list)
    itl_server: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    text: str = ""
    token_ids: list = field(default_factory=list)


def _chunk_tokens(choice: dict) -> int:
    if "token_ids" in choice and isinstance(choice["token_ids"], list):
        return len(choice["token_ids"])
    return 1 if choice.get("text") else 0


async def _one(client, url: str, body: dict, headers: dict, s: Sample, t0: float) -> None:
    prev = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            s.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    s.error = json.loads(raw)["error"]["message"]
                except Exception:
                    s.error = raw[:200].decode(errors="replace")
                s.t_done = time.perf_counter() - t0
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    s.error = obj["error"].get("message", "error")
                    continue
                now = time.perf_counter() - t0
                for ch in obj.get("choices") or []:
                    n = _chunk_tokens(ch)
                    s.text += ch.get("text") or ""
                    s.token_ids += ch.get("token_ids") or []
                    if ch.get("finish_reason"):
                        s.finish_reason = ch["finish_reason"]
                    if n <= 0:
                        continue
                    ext = obj.get("dblock") or {}
                    if prev is None:
                        s.t_first = now
                        if ext.get("block_time_s") is not None:
                            s.itl.append(ext["block_time_s"] / n)
                    else:
                        s.itl.append((now - prev) / n)
                    if ext.get("block_time_s") is not None:
                        s.itl_server.append(ext["block_time_s"] / n)
                    prev = now
                    s.tokens += n
            s.t_done = time.perf_counter() - t0
    except Exception as e:                     # connection refused/reset, timeout: recorded, never fatal
        s.error = f"{type(e).__name__}: {e}"
        s.t_done = time.perf_counter() - t0


def pcts(x: Sequence[float]) -> dict:
    if len(x) == 0:
        return dict(p50=None, p95=None, p99=None, mean=None, n=0)
    a = np.asarray(x, dtype=float)
    return dict(p50=float(np.percentile(a, 50)), p95=float(np.percentile(a, 95)), p99=float(np.percentile(a, 99)),
                mean=float(a.mean()), n=int(a.size))


def summarize(samples: list[Sample], arrivals: Sequence[float], rate: Optional[float], duration: float) -> dict:
    ok = [s for s in samples if s.status == 200 and s.error is None]
    rejected = [s for s in samples if s.status in (429, 503)]
    errors = [s for s in samples if s not in ok and s not in rejected]
    tokens = sum(s.tokens for s in ok)
    t_first_send = min((s.t_send for s in samples), default=0.0)
    t_last = max((s.t_done for s in ok if s.t_done is not None), default=t_first_send)
    span = max(1e-9, t_last - t_first_send)
    return dict(
        rate=rate, offered_rate=len(arrivals) / duration if duration > 0 else None, duration=duration,
        sent=len(samples), ok=len(ok), rejected=len(rejected), errors=len(errors),
        error_examples=sorted({s.error for s in errors if s.error})[:3],
        tokens=tokens, throughput_tok_s=tokens / span, completed_req_s=len(ok) / span, wall_s=span,
        ttft=pcts([s.t_first - s.t_send for s in ok if s.t_first is not None]),
        itl=pcts([v for s in ok for v in s.itl]), itl_server=pcts([v for s in ok for v in s.itl_server]),
        e2e=pcts([s.t_done - s.t_send for s in ok if s.t_done is not None]),
        arrivals=[round(float(a), 6) for a in arrivals],
    )


async def run_arrivals(url: str, arrivals: Sequence[float], prompts: Sequence, max_tokens: int, seed: int = 0,
                       api_key: Optional[str] = None, model: Optional[str] = None, timeout: float = 120.0,
                       keep_outputs: bool = False) -> list[Sample]:
    """Send one streaming request per arrival time (open loop); return the per-request samples."""
    import httpx
    endpoint = url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        tasks, samples = [], []
        for i, t in enumerate(arrivals):
            delay = t - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "seed": seed + i, "stream": True}
            if model:
                body["model"] = model
            s = Sample(i, float(t))
            samples.append(s)
            tasks.append(asyncio.create_task(_one(client, endpoint, body, headers, s, t0)))
        await asyncio.gather(*tasks)
    if not keep_outputs:
        for s in samples:
            s.text, s.token_ids = "", []
    return samples


def run_load(url: str, arrivals: Sequence[float], prompts: Sequence, max_tokens: int, seed: int = 0,
             rate: Optional[float] = None, duration: Optional[float] = None, **kw) -> dict:
    """Blocking: one run (one rate or one replayed arrival list) against one server; the summary dict."""
    samples = asyncio.run(run_arrivals(url, arrivals, prompts, max_tokens, seed, **kw))
    dur = duration if duration is not None else (max(arrivals) if arrivals else 0.0)
    return summarize(samples, arrivals, rate, dur)


def machine() -> str:
    return f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


# ---------------------------------------------------------------------------------------------------------------
# plots and tables
# ---------------------------------------------------------------------------------------------------------------

def plot(servers: list[dict], path: str) -> None:
    """P95 ITL (ms) and throughput vs offered rate, one line per server, side by side."""
    import matplotlib
    import sys
    if "matplotlib.pyplot" not in sys.modules:  # headless default; keep a notebook's backend
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for srv in servers:
        runs = [r for r in srv["runs"] if r.get("itl", {}).get("p95") is not None]
        xs = [r["rate"] if r.get("rate") is not None else r["offered_rate"] for r in runs]
        a1.plot(xs, [1e3 * r["itl"]["p95"] for r in runs], marker="o", label=srv["label"])
        a2.plot(xs, [r["throughput_tok_s"] for r in runs], marker="o", label=srv["label"])
    a1.set_xlabel("offered rate (req/s)")
    a1.set_ylabel("P95 equivalent ITL (ms)")
    a1.set_title("P95 inter-token latency per block commit")
    a2.set_xlabel("offered rate (req/s)")
    a2.set_ylabel("tokens/s")
    a2.set_title("throughput")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(servers: list[dict]) -> str:
    def ms(d, k="p95"):
        v = d.get(k)
        return f"{1e3 * v:8.1f}" if v is not None else "       -"
    lines = [f"{'server':22s} {'rate':>6s} {'sent':>5s} {'ok':>4s} {'rej':>4s} {'err':>4s} {'tok/s':>8s} "
             f"{'TTFT p50':>8s} {'TTFT p95':>8s} {'ITL p50':>8s} {'ITL p95':>8s} {'ITL p99':>8s}  (ms)"]
    for srv in servers:
        for r in srv["runs"]:
            rate = r["rate"] if r.get("rate") is not None else r["offered_rate"]
            lines.append(f"{srv['label'][:22]:22s} {rate:6.2f} {r['sent']:5d} {r['ok']:4d} {r['rejected']:4d} "
                         f"{r['errors']:4d} {r['throughput_tok_s']:8.1f} {ms(r['ttft'], 'p50')} {ms(r['ttft'])} "
                         f"{ms(r['itl'], 'p50')} {ms(r['itl'])} {ms(r['itl'], 'p99')}")
    return "\n".join(lines)
