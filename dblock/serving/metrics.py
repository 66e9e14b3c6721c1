"""Prometheus metrics of the engine and the HTTP front end, through `prometheus_client` with one `CollectorRegistry`
per server (not the process-wide default, so several servers can live in one process), exposed as text format 0.0.4.

dblock's own series (read from `Engine.snapshot()` at every scrape, or fed by the engine's observers):
  gauges    dblock_engine_info{executor,schedule}, dblock_queue_length, dblock_requests_running, dblock_batch_size,
            dblock_batch_cap, dblock_kv_tokens_reserved, dblock_kv_tokens_budget, dblock_passes_per_second and
            dblock_request_passes_per_second (last 10 s), dblock_tpf (sum Y / sum Q of finished requests,
            docs/counters.md), dblock_fresh_row_fraction and dblock_cache_hit_ratio of the MoE layers (epoch executor:
            rows computed fresh / served from the decoded-output cache; a dense executor computes every row: fraction
            1, hit ratio 0), dblock_last_pass_fresh_row_fraction
  counters  dblock_passes_total{kind}, dblock_iterations_total, dblock_tokens_generated_total,
            dblock_blocks_committed_total, dblock_moe_rows_total{source}, dblock_requests_total{outcome},
            dblock_engine_busy_seconds_total, dblock_http_responses_total{endpoint,status}
  histograms dblock_itl_seconds (equivalent inter-token latency per block commit), dblock_ttft_seconds (time to
            first committed block)

vLLM's names (`vllm:` -> `dblock:`, label `model_name`), fed by the server's request events:
  dblock:num_requests_running, dblock:num_requests_waiting, dblock:kv_cache_usage_perc (reserved / budget; gauges);
  dblock:time_to_first_token_seconds (arrival to first committed block), dblock:inter_token_latency_seconds (a
  block of n tokens committed after t seconds gives n samples of t / n), dblock:e2e_request_latency_seconds,
  dblock:request_queue_time_seconds (histograms); dblock:prompt_tokens_total, dblock:generation_tokens_total,
  dblock:request_success_total{finished_reason} (stop, length, abort; counters).
Block diffusion:
  dblock:tokens_per_forward (histogram, one sample per finished request: Y / Q, docs/counters.md),
  dblock:passes_per_block (histogram, one sample per committed block), dblock:fresh_row_fraction (gauge, as
  dblock_fresh_row_fraction), and from the epoch executor's `stats()` when the engine runs it:
  dblock:epoch_paths_total{path} (block-plan paths per MoE layer: cold, hot-skip, hot-update, refresh, fallback...),
  dblock:atlas_hits_total (hot-skip: a layer of a block routed within its reused Expert Atlas support) and
  dblock:atlas_builds_total (supports built); both 0 for an executor without an Atlas.
"""
from __future__ import annotations

import logging
import numbers

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

try:                                                   # prometheus_client >= 0.22: LATEST is format 1.0.0
    from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE
except ImportError:                                    # pragma: no cover - older clients only speak 0.0.4
    from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE

log = logging.getLogger("dblock.serving")

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0)
TPF_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)
PASSES_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128)


def executor_paths(fwd) -> dict:
    """The epoch executor's cumulative block-plan path counts (`stats()["paths"]`), or {} for any other executor
    or anything unexpected (read defensively: the executor is written by the engine thread)."""
    stats = getattr(fwd, "stats", None)
    if not callable(stats):
        return {}
    for _ in range(3):                                 # the engine thread may grow the counter while we copy it
        try:
            paths = stats().get("paths")
            if not isinstance(paths, dict):
                return {}
            return {str(k): float(v) for k, v in paths.items() if isinstance(v, numbers.Real)}
        except RuntimeError:
            continue
        except Exception:                              # never let a scrape fail on an executor change
            log.debug("metrics: executor stats() unreadable", exc_info=True)
            return {}
    return {}


class _EngineCollector:
    """Series computed from `Engine.snapshot()` (and the executor's stats) at scrape time."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def describe(self):                                # no scrape at registration time
        return []

    def collect(self):
        s = self.engine.snapshot()

        def gauge(name, help_, value, labels=None):
            labels = labels or {}
            g = GaugeMetricFamily(name, help_, labels=list(labels))
            g.add_metric(list(labels.values()), float(value))
            return g

        def counter(name, help_, value=None, labelnames=None, samples=None):
            c = CounterMetricFamily(name, help_, labels=labelnames or [])
            for lv, v in (samples if samples is not None else [([], value)]):
                c.add_metric(lv, float(v))
            return c

        yield gauge("dblock_engine_info", "engine configuration (value 1)", 1,
                    {"executor": s["executor"], "schedule": s["schedule"]})
        yield gauge("dblock_queue_length", "requests waiting for admission", s["queue_length"])
        yield gauge("dblock_requests_running", "requests in the running batch", s["running"])
        yield gauge("dblock_batch_size", "requests carried by the last pass", s["batch_size"])
        yield gauge("dblock_batch_cap", "most requests running at once", s["batch_cap"])
        yield gauge("dblock_kv_tokens_reserved", "KV positions reserved by running requests", s["kv_reserved_tokens"])
        yield gauge("dblock_kv_tokens_budget", "KV position budget", s["kv_budget_tokens"])
        yield gauge("dblock_passes_per_second", "batched denoising passes per second (last 10 s)", s["passes_per_s"])
        yield gauge("dblock_request_passes_per_second", "request-passes per second (last 10 s; a pass over B requests "
                    "counts B)", s["request_passes_per_s"])
        yield gauge("dblock_tpf", "tokens per forward of finished requests, sum Y / sum Q (docs/counters.md)", s["tpf"])
        yield gauge("dblock_fresh_row_fraction", "MoE rows computed fresh / all MoE rows (cumulative)",
                    s["fresh_row_fraction"])
        yield gauge("dblock_cache_hit_ratio", "MoE rows served from the decoded-output cache, cached / (cached + "
                    "fresh) (cumulative)", s["cache_hit_ratio"])
        if s["last_fresh_row_fraction"] is not None:
            yield gauge("dblock_last_pass_fresh_row_fraction", "fresh-row fraction of the last pass",
                        s["last_fresh_row_fraction"])
        yield counter("dblock_passes", "executor calls by kind", labelnames=["kind"],
                      samples=[(["denoise"], s["denoise_passes"]), (["append"], s["append_passes"])])
        yield counter("dblock_iterations", "engine iterations", s["iterations"])
        yield counter("dblock_tokens_generated", "valid tokens streamed to clients", s["tokens"])
        yield counter("dblock_blocks_committed", "blocks committed", s["blocks"])
        yield counter("dblock_moe_rows", "MoE rows by source", labelnames=["source"],
                      samples=[(["fresh"], s["moe_rows_fresh"]), (["cached"], s["moe_rows_cached"])])
        outcomes = [(["finished"], s["finished"]), (["cancelled"], s["cancelled"]), (["failed"], s["failed"])]
        outcomes += [([f"rejected_{k}"], v) for k, v in sorted(s["rejected"].items())]
        yield counter("dblock_requests", "engine requests by outcome", labelnames=["outcome"], samples=outcomes)
        yield counter("dblock_engine_busy_seconds", "seconds spent in iterations", s["busy_s"])

        m, ml = [self.model_name], {"model_name": self.model_name}
        yield gauge("dblock:num_requests_running", "requests in the running batch", s["running"], ml)
        yield gauge("dblock:num_requests_waiting", "requests waiting for admission", s["queue_length"], ml)
        yield gauge("dblock:kv_cache_usage_perc", "KV positions reserved / budget (1 = full)",
                    s["kv_reserved_tokens"] / (s["kv_budget_tokens"] or 1), ml)
        yield gauge("dblock:fresh_row_fraction", "MoE rows computed fresh / all MoE rows (cumulative; 1 for a dense "
                    "executor)", s["fresh_row_fraction"], ml)
        paths = executor_paths(getattr(self.engine, "fwd", None))
        yield counter("dblock:epoch_paths", "epoch executor block-plan paths, per MoE layer per block per pass",
                      labelnames=["model_name", "path"], samples=[(m + [k], v) for k, v in sorted(paths.items())])
        yield counter("dblock:atlas_hits", "MoE layer-block-passes routed within a reused Expert Atlas support "
                      "(hot-skip)", labelnames=["model_name"], samples=[(m, paths.get("hot-skip", 0.0))])
        yield counter("dblock:atlas_builds", "Expert Atlas supports built (cold, update and fallback passes)",
                      labelnames=["model_name"], samples=[(m, paths.get("support_build", 0.0))])


class Metrics:
    """One server's registry: the engine collector, histograms fed by the engine's observers and the server's
    request events (`on_event`, called from the engine thread), HTTP counters. `render()` is the /metrics body."""

    def __init__(self, engine, model_name: str = "dblock"):
        self.engine = engine
        self.registry = reg = CollectorRegistry(auto_describe=False)
        reg.register(_EngineCollector(engine, model_name))
        self.itl = Histogram("dblock_itl_seconds", "equivalent inter-token latency per block commit", buckets=BUCKETS,
                             registry=reg)
        self.ttft = Histogram("dblock_ttft_seconds", "time to first committed block", buckets=BUCKETS, registry=reg)
        self.http = Counter("dblock_http_responses", "HTTP responses by endpoint and status", ["endpoint", "status"],
                            registry=reg)

        def hist(name, help_, buckets):
            return Histogram(name, help_, ["model_name"], buckets=buckets, registry=reg).labels(model_name)

        def count(name, help_):
            return Counter(name, help_, ["model_name"], registry=reg).labels(model_name)

        self.v_ttft = hist("dblock:time_to_first_token_seconds", "arrival to first committed block", LATENCY_BUCKETS)
        self.v_itl = hist("dblock:inter_token_latency_seconds", "equivalent inter-token latency: a block of n tokens "
                          "committed t s after the previous one (or the first pass) gives n samples of t / n",
                          LATENCY_BUCKETS)
        self.v_e2e = hist("dblock:e2e_request_latency_seconds", "arrival to finish of finished requests",
                          LATENCY_BUCKETS)
        self.v_queue = hist("dblock:request_queue_time_seconds", "arrival to admission of finished requests",
                            LATENCY_BUCKETS)
        self.prompt_tokens = count("dblock:prompt_tokens", "prompt tokens prefilled")
        self.generation_tokens = count("dblock:generation_tokens", "tokens committed and streamed")
        self.success = Counter("dblock:request_success", "requests that ended, by finish reason",
                               ["model_name", "finished_reason"], registry=reg)
        self._success = {k: self.success.labels(model_name, k) for k in ("stop", "length", "abort")}
        self.tpf = hist("dblock:tokens_per_forward", "tokens per forward of a finished request, Y / Q "
                        "(docs/counters.md)", TPF_BUCKETS)
        self.ppb = hist("dblock:passes_per_block", "denoising passes a block took before it committed",
                        PASSES_BUCKETS)
        engine.stats.observers.append(self._observe)

    def _observe(self, kind: str, v: float) -> None:
        if kind == "itl":
            self.itl.observe(v)
        elif kind == "ttft":
            self.ttft.observe(v)

    def on_event(self, kind: str, r, data: dict) -> None:
        """An engine event of a request served over HTTP (engine thread; never raises into the engine)."""
        try:
            if kind == "block":
                n = len(data.get("ids", ()))
                self.generation_tokens.inc(n)
                if data.get("passes") is not None:
                    self.ppb.observe(data["passes"])
                itl = data.get("itl_s")
                if itl is not None:
                    for _ in range(n):
                        self.v_itl.observe(itl)
                if data.get("index") == 0:
                    self.prompt_tokens.inc(len(r.prompt))
                    if data.get("t") is not None:
                        self.v_ttft.observe(max(0.0, data["t"] - r.t_arrival))
            elif kind == "done":
                reason = data.get("finish_reason")
                if reason in self._success:
                    self._success[reason].inc()
                if data.get("e2e_s") is not None:
                    self.v_e2e.observe(data["e2e_s"])
                if data.get("queue_s") is not None:
                    self.v_queue.observe(data["queue_s"])
                c = data.get("counters") or {}
                if c.get("Q"):
                    self.tpf.observe(c["Y"] / c["Q"])
            elif kind == "cancelled":
                self._success["abort"].inc()
        except Exception:                              # pragma: no cover - metrics never break serving
            log.exception("metrics: event %s not recorded", kind)

    def count_http(self, endpoint: str, status: int) -> None:
        self.http.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry view without the `*_created` timestamp series prometheus_client adds to counters and histograms
    (process-wide switch otherwise; the families are built fresh at every collect, so filtering them is safe)."""

    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
