"""Prometheus text exposition (format 0.0.4) of the engine and the HTTP front end, without a client library.

Gauges: queue length, running requests, batch size of the last pass, KV tokens reserved / budget, passes/s and
request-passes/s over the last 10 s, TPF (ΣY/ΣQ of finished requests), fresh-row fraction and cache hit ratio of the
MoE layers (epoch executor: rows computed fresh / served from the decoded-output cache; a dense executor computes
every row: fraction 1, hit ratio 0). Counters: passes, tokens, blocks, requests by outcome, HTTP responses by
status. Histograms: equivalent inter-token latency per block commit and time to first block (seconds).
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Optional

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets=BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.n = 0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            i = next((k for k, b in enumerate(self.buckets) if v <= b), len(self.buckets))
            self.counts[i] += 1
            self.sum += v
            self.n += 1

    def lines(self, name: str) -> list[str]:
        with self._lock:
            counts, s, n = list(self.counts), self.sum, self.n
        out, acc = [], 0
        for b, c in zip(self.buckets, counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {n}')
        out += [f"{name}_sum {s:.9g}", f"{name}_count {n}"]
        return out


class Metrics:
    """Holds the histograms (fed by the engine's observers) and HTTP counters; renders everything."""

    def __init__(self, engine):
        self.engine = engine
        self.itl = Histogram()
        self.ttft = Histogram()
        self.http = Counter()
        self._lock = threading.Lock()
        engine.stats.observers.append(self._observe)

    def _observe(self, kind: str, v: float) -> None:
        (self.itl if kind == "itl" else self.ttft).observe(v)

    def count_http(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http[(endpoint, status)] += 1

    def render(self) -> str:
        s = self.engine.snapshot()
        L: list[str] = []

        def metric(name: str, kind: str, help_: str, value=None, labels: Optional[dict] = None, samples=None):
            L.append(f"# HELP {name} {help_}")
            L.append(f"# TYPE {name} {kind}")
            for lab, v in (samples if samples is not None else [(labels, value)]):
                lab_s = "{" + ",".join(f'{k}="{val}"' for k, val in lab.items()) + "}" if lab else ""
                L.append(f"{name}{lab_s} {float(v):.9g}")

        info = {"executor": s["executor"], "schedule": s["schedule"]}
        metric("dblock_engine_info", "gauge", "engine configuration (value 1)", 1, info)
        metric("dblock_queue_length", "gauge", "requests waiting for admission", s["queue_length"])
        metric("dblock_requests_running", "gauge", "requests in the running batch", s["running"])
        metric("dblock_batch_size", "gauge", "requests carried by the last pass", s["batch_size"])
        metric("dblock_batch_cap", "gauge", "most requests running at once", s["batch_cap"])
        metric("dblock_kv_tokens_reserved", "gauge", "KV positions reserved by running requests",
               s["kv_reserved_tokens"])
        metric("dblock_kv_tokens_budget", "gauge", "KV position budget", s["kv_budget_tokens"])
        metric("dblock_passes_per_second", "gauge", "batched denoising passes per second (last 10 s)",
               s["passes_per_s"])
        metric("dblock_request_passes_per_second", "gauge", "request-passes per second (last 10 s; a pass over B "
               "requests counts B)", s["request_passes_per_s"])
        metric("dblock_tpf", "gauge", "tokens per forward of finished requests, sum Y / sum Q (docs/counters.md)", s["tpf"])
        metric("dblock_fresh_row_fraction", "gauge", "MoE rows computed fresh / all MoE rows (cumulative)",
               s["fresh_row_fraction"])
        metric("dblock_cache_hit_ratio", "gauge", "MoE rows served from the decoded-output cache, cached / (cached "
               "+ fresh) (cumulative)", s["cache_hit_ratio"])
        if s["last_fresh_row_fraction"] is not None:
            metric("dblock_last_pass_fresh_row_fraction", "gauge", "fresh-row fraction of the last pass",
                   s["last_fresh_row_fraction"])
        metric("dblock_passes_total", "counter", "executor calls by kind", samples=[
            ({"kind": "denoise"}, s["denoise_passes"]), ({"kind": "append"}, s["append_passes"])])
        metric("dblock_iterations_total", "counter", "engine iterations", s["iterations"])
        metric("dblock_tokens_generated_total", "counter", "valid tokens streamed to clients", s["tokens"])
        metric("dblock_blocks_committed_total", "counter", "blocks committed", s["blocks"])
        metric("dblock_moe_rows_total", "counter", "MoE rows by source", samples=[
            ({"source": "fresh"}, s["moe_rows_fresh"]), ({"source": "cached"}, s["moe_rows_cached"])])
        metric("dblock_requests_total", "counter", "engine requests by outcome", samples=[
            ({"outcome": "finished"}, s["finished"]), ({"outcome": "cancelled"}, s["cancelled"]),
            ({"outcome": "failed"}, s["failed"])] + [({"outcome": f"rejected_{k}"}, v)
                                                     for k, v in sorted(s["rejected"].items())])
        metric("dblock_engine_busy_seconds_total", "counter", "seconds spent in iterations", s["busy_s"])
        with self._lock:
            http = sorted(self.http.items())
        if http:
            metric("dblock_http_responses_total", "counter", "HTTP responses by endpoint and status",
                   samples=[({"endpoint": e, "status": st}, v) for (e, st), v in http])
        for name, h, help_ in (("dblock_itl_seconds", self.itl, "equivalent inter-token latency per block commit"),
                               ("dblock_ttft_seconds", self.ttft, "time to first committed block")):
            L.append(f"# HELP {name} {help_}")
            L.append(f"# TYPE {name} histogram")
            L += h.lines(name)
        return "\n".join(L) + "\n"
