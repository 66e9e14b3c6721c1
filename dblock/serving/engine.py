"""The serving engine: continuous batching at pass granularity over the schedules' `RequestRun`s.

One engine owns one executor (`Forward`) and runs one *iteration* at a time (`step`): a batched append call for
every running request that needs one (prompt prefill or a committed block's append pass) and one batched denoising
pass over every running request — `dblock.decoding.schedules.step_once`, the same function `generate` drives.
Between iterations (pass boundaries) the engine

* drops cancelled requests (a client went away) and tells the executor (`forward.end_request`),
* admits queued requests in arrival order while the batch cap and the KV token budget allow, so a new request's
  prefill and first denoising pass ride the very next iteration — nobody waits for another request's block,
* reports every block that committed on the last iteration to its request's listener, and retires finished
  requests at once (their slot and budget are free for the next iteration).

Each request keeps its own schedule state and block plan (Native, OBA, FlowBlock...: whatever `ScheduleSpec` the
engine was built with), so its tokens are exactly what offline `generate` gives for the same prompt, budget and
seed, whatever else is in flight (tested for the reference and the epoch executors).

Admission control (`EngineConfig`):
  batch_cap          most requests running at once (one denoising pass carries all of them)
  kv_budget_tokens   most KV/sequence positions reserved by running requests; a request reserves every position it
                     may ever occupy: its prompt and its generation budget rounded up to the block grid
                     (`footprint`). A request larger than the whole budget (or than the model's positions) can
                     never run and is rejected at once (`Rejected`, status 400); one that fits later waits.
  max_queue          most requests waiting; beyond it `submit` raises `Rejected` with status 429 (and 503 once the
                     engine is draining for shutdown).
Admission is FIFO: a large request at the head of the queue is not overtaken by smaller ones (no starvation).

Threading: `start()` runs `step` in one background thread, the only thread that touches the model (torch forwards
are not run concurrently). `submit`/`cancel`/`snapshot` are safe from any thread; listeners are called from the
engine thread and must not block (the server hands events to its event loop with `call_soon_threadsafe`).

Timing per request (engine clock, `time.perf_counter`): arrival (submit), admission, first pass (start of its first
iteration), every block commit (end of that iteration), finish. Equivalent inter-token latency of a commit =
(commit − previous commit of that request, or its first pass for the first block) / tokens committed.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from dblock.decoding.params import DecodeConfig, SamplingParams, footprint
from dblock.errors import ConfigError
from dblock.forward import Forward
from dblock.decoding.schedules import Request, RequestRun, RunTimes, ScheduleSpec, schedule_spec, step_once
from dblock.trace import NULL_TRACE, TraceWriter

log = logging.getLogger("dblock.serving")

# listener(kind, request, data): kind is "block" (a block committed: data has tokens, ids, itl_s...), "done"
# (finished: data has finish_reason, stop_reason, counters) or "error" (data has status, message). Called from the
# engine thread.
Listener = Callable[[str, "EngineRequest", dict], None]


class Rejected(Exception):
    """A request the engine will not take: `status` 400 (can never fit / invalid), 429 (queue full), 503
    (shutting down). `param` names the offending request field when there is one."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class EngineConfig:
    batch_cap: int = 16
    kv_budget_tokens: int = 65536
    max_queue: int = 256

    def validate(self) -> "EngineConfig":
        for name in ("batch_cap", "kv_budget_tokens", "max_queue"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "max_queue" else 1):
                raise ValueError(f"{name}={v!r}: must be an integer >= {0 if name == 'max_queue' else 1}")
        return self


@dataclass
class EngineRequest:
    """One request's life in the engine (read-only for callers; the engine thread writes it)."""

    id: int
    prompt: list
    max_new_tokens: int
    seed: int
    footprint: int
    listener: Optional[Listener] = None
    tag: Any = None                          # caller's label (e.g. the HTTP completion id)
    sampling: Optional[SamplingParams] = None  # own sampler and stops (None: the engine's DecodeConfig defaults)
    status: str = "queued"                   # queued | running | finished | cancelled | failed
    t_arrival: float = 0.0
    t_admit: Optional[float] = None
    t_first_pass: Optional[float] = None
    t_finish: Optional[float] = None
    commits: list = field(default_factory=list)       # per committed block: dict(t, tokens, itl_s, block, passes)
    run: Optional[RequestRun] = None
    emitted: int = 0                          # output tokens already reported
    blocks_seen: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    cancel_requested: bool = False
    done_event: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def output_tokens(self) -> list:
        return self.run.output_tokens() if self.run is not None else []

    @property
    def ttft_s(self) -> Optional[float]:
        return self.commits[0]["t"] - self.t_arrival if self.commits else None


class _Stats:
    """Engine-wide counters read by `/metrics` (written by the engine thread; read racily, which is fine)."""

    def __init__(self):
        self.iterations = 0
        self.denoise_passes = 0
        self.append_passes = 0
        self.request_passes = 0          # Σ batch size over denoising passes
        self.last_batch = 0
        self.tokens = 0
        self.blocks = 0
        self.Y = 0
        self.Q = 0
        self.finished = 0
        self.cancelled = 0
        self.failed = 0
        self.rejected = {400: 0, 429: 0, 503: 0}
        self.moe_fresh = 0
        self.moe_cached = 0
        self.last_fresh_frac: Optional[float] = None
        self.busy_s = 0.0
        self.recent: deque = deque()     # (t_end, batch) of recent iterations, for passes/s
        self.observers: list = []         # callables(kind, value): ITL / TTFT samples for the metrics histograms


class Engine:
    """Continuous batching engine over one executor. See the module docstring."""

    def __init__(self, forward: Forward, spec: ScheduleSpec | str = "native", dec: Optional[DecodeConfig] = None,
                 config: Optional[EngineConfig] = None, trace: TraceWriter = NULL_TRACE,
                 clock: Callable[[], float] = time.perf_counter, trace_header: Optional[dict] = None):
        self.fwd = forward
        self.spec = spec if isinstance(spec, ScheduleSpec) else schedule_spec(spec)
        self.dec = (dec or DecodeConfig()).validate()
        self.config = (config or EngineConfig()).validate()
        self.cfg = forward.config
        self.family = self.cfg.family
        self.block = (self.dec.block_size or self.cfg.block_size) * self.spec.width
        self.max_positions = int(getattr(self.cfg, "max_position_embeddings", 1 << 30) or (1 << 30))
        self.trace = trace
        self.clock = clock
        self.t0 = clock()
        self.stats = _Stats()
        self.times = RunTimes()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._reserved = 0
        self._accepting = True
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        if trace.enabled and trace_header is not None:
            trace.run_header(**trace_header)

    # ---- submission (any thread) --------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], max_new_tokens: int, param_prompt: str = "prompt") -> int:
        """Validate one request against the model and the budgets; return its footprint or raise `Rejected`."""
        if len(prompt) == 0:
            raise Rejected(400, "prompt: empty; give at least one token", "prompt", "invalid_value")
        V = self.cfg.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V:
                raise Rejected(400, f"{param_prompt}: token id {t!r} outside the vocabulary 0..{V - 1}",
                               param_prompt, "invalid_value")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise Rejected(400, f"max_tokens: must be an integer >= 1, got {max_new_tokens!r}", "max_tokens",
                           "invalid_value")
        fp = footprint(len(prompt), max_new_tokens, self.block, self.family)
        if fp > self.max_positions:
            raise Rejected(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_new_tokens}) needs {fp} positions "
                           f"on the block grid; the model has {self.max_positions}", "max_tokens",
                           "context_length_exceeded")
        if fp > self.config.kv_budget_tokens:
            raise Rejected(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_new_tokens}) needs {fp} KV "
                           f"positions; this server's whole budget is {self.config.kv_budget_tokens} "
                           "(--kv-budget-tokens), so the request can never be scheduled", "max_tokens",
                           "context_length_exceeded")
        return fp

    def submit(self, prompt: Sequence[int], max_new_tokens: Optional[int] = None, seed: Optional[int] = None,
               listener: Optional[Listener] = None, tag: Any = None,
               sampling: Optional[SamplingParams] = None) -> EngineRequest:
        """Queue one request; raises `Rejected` (400 never fits or invalid, 429 queue full, 503 draining).
        `sampling`: the request's own sampler and stop conditions (None: the engine's `DecodeConfig` defaults)."""
        return self.submit_many([prompt], max_new_tokens, seed, listener, tag, sampling=sampling)[0]

    def submit_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: Optional[int] = None,
                    seed: Optional[int] = None, listener: Optional[Listener] = None, tag: Any = None,
                    sampling: Optional[SamplingParams] = None, seeds: Optional[Sequence[int]] = None
                    ) -> list[EngineRequest]:
        """Queue several requests atomically: all are queued, or none (and `Rejected` says why). They share
        `sampling` (checked against the model: `check_sampling`); `seeds` gives each its own seed (else all get
        `seed`, default the engine's)."""
        m = self.dec.max_new_tokens if max_new_tokens is None else max_new_tokens
        s = self.dec.seed if seed is None else seed
        prompts = [list(p) for p in prompts]
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")
        try:
            fps = [self.check(p, m, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts)]
            if sampling is not None:
                self.check_sampling(sampling, m)
        except Rejected as e:
            self.stats.rejected[e.status] = self.stats.rejected.get(e.status, 0) + 1
            raise
        now = self.clock()
        with self._lock:
            if not self._accepting:
                self.stats.rejected[503] += 1
                raise Rejected(503, "the server is shutting down: not accepting new requests", None, "unavailable")
            if len(self._queue) + len(prompts) > self.config.max_queue:
                self.stats.rejected[429] += 1
                raise Rejected(429, f"server busy: {len(self._queue)} requests already queued (max_queue "
                               f"{self.config.max_queue}, batch cap {self.config.batch_cap}); retry later", None,
                               "rate_limit_exceeded")
            reqs = []
            for i, (p, fp) in enumerate(zip(prompts, fps)):
                r = EngineRequest(next(self._ids), p, m, int(s if seeds is None else seeds[i]), fp, listener, tag,
                                  sampling=sampling, t_arrival=now)
                self._queue.append(r)
                reqs.append(r)
            self._wake.notify_all()
        return reqs

    def check_sampling(self, sampling: SamplingParams, max_new_tokens: int) -> None:
        """A request's `SamplingParams` against the model and its budget (`SamplingParams.check_request`), or
        `Rejected` 400 naming the request field: temperature / top_p / top_k other than greedy on DiffusionGemma
        (it samples with its own entropy-bound schedule), stop ids outside the vocabulary, min_tokens > max_tokens."""
        uniform = self.family == "diffusion_gemma"
        if uniform:
            for name, neutral in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0)):
                v = getattr(sampling, name)
                if v != neutral:
                    raise Rejected(400, f"{name}: {v!r} is the masked models' sampler; {self.family} samples with "
                                   "its entropy-bound rule and the server's temperature schedule (dblock serve "
                                   f"--temperature t_max,t_min): allowed {neutral!r}" +
                                   (" (or absent)" if name != "top_k" else " or -1 (or absent)"), name,
                                   "unsupported_value")
        V = self.cfg.vocab_size
        for name, ids in [("stop_token_ids", sampling.stop_token_ids)] + [("stop", q) for q in sampling.stop]:
            bad = next((t for t in ids if t >= V), None)
            if bad is not None:
                raise Rejected(400, f"{name}: token id {bad} outside the vocabulary 0..{V - 1}", name,
                               "invalid_value")
        try:
            sampling.check_request(V, max_new_tokens, uniform=uniform, family=self.family)
        except ConfigError as e:
            msg = str(e)
            name = next((f for f in ("min_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop")
                         if msg.startswith(f)), None)
            if name == "min_tokens":
                msg = f"{sampling.min_tokens} exceeds max_tokens ({max_new_tokens})"
            raise Rejected(400, f"{name}: {msg}" if name else msg, name, "invalid_value") from None

    def cancel(self, req: EngineRequest) -> None:
        """Drop a request (its client went away): removed at the next pass boundary, its slot freed."""
        with self._lock:
            if req.status in ("finished", "cancelled", "failed"):
                return
            req.cancel_requested = True
            self._wake.notify_all()

    # ---- the loop -----------------------------------------------------------------------------------------
    def _admit_locked(self) -> list[EngineRequest]:
        admitted = []
        while self._queue and len(self._running) < self.config.batch_cap:
            head = self._queue[0]
            if self._reserved + head.footprint > self.config.kv_budget_tokens:
                break                                  # FIFO: wait for budget rather than let others overtake
            self._queue.popleft()
            self._running.append(head)
            self._reserved += head.footprint
            admitted.append(head)
        return admitted

    def _cancel_pending_locked(self) -> list[EngineRequest]:
        gone = [r for r in self._queue if r.cancel_requested]
        for r in gone:
            self._queue.remove(r)
        gone_running = [r for r in self._running if r.cancel_requested]
        for r in gone_running:
            self._running.remove(r)
            self._reserved -= r.footprint
        return gone + gone_running

    def step(self) -> bool:
        """One iteration (pass boundary work, one append call, one denoising pass). False when idle."""
        with self._lock:
            cancelled = self._cancel_pending_locked()
            admitted = self._admit_locked()
            running = list(self._running)
        for r in cancelled:
            self._end(r, "cancelled")
        now = self.clock()
        for r in admitted:
            r.t_admit = now
            try:
                r.run = RequestRun(Request(r.prompt, r.max_new_tokens, r.seed, r.id, sampling=r.sampling), self.fwd,
                                   self.spec, self.dec)
                r.status = "running"
            except Exception as e:                       # validated at submit; anything left is a clean failure
                self._fail([r], 400, f"{type(e).__name__}: {e}")
        running = [r for r in running if r.status == "running"]
        if not running:
            return bool(cancelled or admitted)
        t_start = self.clock()
        for r in running:
            if r.t_first_pass is None:
                r.t_first_pass = t_start
        n_app, n_den = self.times.app_calls, self.times.den_calls
        try:
            with torch.no_grad():
                step_once([r.run for r in running], self.fwd, self.times, self.trace)
        except Exception as e:                           # executor failure: fail this batch, keep serving
            log.exception("engine: forward failed; failing %d running requests", len(running))
            self._fail(running, 500, f"executor error: {type(e).__name__}: {e}")
            return True
        t_end = self.clock()
        st = self.stats
        st.iterations += 1
        st.append_passes += self.times.app_calls - n_app
        dn = self.times.den_calls - n_den
        st.denoise_passes += dn
        st.request_passes += len(running) if dn else 0
        st.last_batch = len(running)
        st.busy_s += t_end - t_start
        st.recent.append((t_end, len(running)))
        while st.recent and st.recent[0][0] < t_end - 10.0:
            st.recent.popleft()
        if dn:
            self._read_pass_stats()
        finished = []
        for r in running:
            self._report_commits(r, t_end)
            if r.run.finished:
                finished.append(r)
        if finished:
            with self._lock:
                for r in finished:
                    self._running.remove(r)
                    self._reserved -= r.footprint
            for r in finished:
                self._finish(r, t_end)
        if self.trace.enabled:
            self.trace.write("iteration", t_start=t_start - self.t0, t_end=t_end - self.t0, batch=len(running),
                             admitted=[r.id for r in admitted], finished=[r.id for r in finished],
                             queued=len(self._queue))
        return True

    def _read_pass_stats(self) -> None:
        extra = self.fwd.last_pass_stats() if hasattr(self.fwd, "last_pass_stats") else {}
        layers = extra.get("layers") if isinstance(extra, dict) else None
        if layers:
            fresh = sum(int(l.get("fresh", 0)) for l in layers)
            cached = sum(int(l.get("cached", 0)) for l in layers)
            self.stats.moe_fresh += fresh
            self.stats.moe_cached += cached
            self.stats.last_fresh_frac = fresh / (fresh + cached) if fresh + cached else None
        else:
            self.stats.last_fresh_frac = 1.0            # dense executor: every row through every MoE layer

    def _report_commits(self, r: EngineRequest, t: float) -> None:
        blocks = r.run.counters.blocks
        while r.blocks_seen < len(blocks):
            b = blocks[r.blocks_seen]
            r.blocks_seen += 1
            prev = r.commits[-1]["t"] if r.commits else r.t_first_pass
            n = b.tokens
            new = r.run.output_tokens()[r.emitted:r.emitted + n]   # several blocks may commit in one pass
            r.emitted += len(new)
            rec = dict(t=t, block=b.block, tokens=n, passes=b.passes, warmup_steps=b.warmup_steps,
                       block_time_s=t - prev, itl_s=(t - prev) / n if n else None)
            r.commits.append(rec)
            self.stats.blocks += 1
            self.stats.tokens += len(new)
            for obs in self.stats.observers:
                if rec["itl_s"] is not None:
                    obs("itl", rec["itl_s"])
                if len(r.commits) == 1:
                    obs("ttft", t - r.t_arrival)
            if self.trace.enabled:
                self.trace.write("block", request=r.id, t_s=t - self.t0, block_time_s=rec["block_time_s"],
                                 **vars(b))
            self._notify(r, "block", dict(ids=new, index=len(r.commits) - 1, **rec))

    def _finish(self, r: EngineRequest, t: float) -> None:
        r.run.cache = None                                 # the KV cache is freed now, not when the client leaves
        r.status = "finished"
        r.t_finish = t
        r.finish_reason = r.run.finish_reason
        c = r.run.counters
        self.stats.finished += 1
        self.stats.Y += c.Y
        self.stats.Q += c.Q
        if self.trace.enabled:
            self.trace.write("request", request=r.id, prompt_len=c.prompt_len, Y=c.Y, K=c.K, F=c.F, Q=c.Q,
                             max_new_tokens=r.max_new_tokens, seed=r.seed, arrival_s=r.t_arrival - self.t0,
                             admit_s=r.t_admit - self.t0, first_pass_s=r.t_first_pass - self.t0,
                             finish_s=t - self.t0, ttft_s=r.ttft_s, wall_s=t - r.t_arrival)
        self._notify(r, "done", dict(finish_reason=r.finish_reason, stop_reason=r.run.stop_reason,
                                     ids=r.run.output_tokens(), counters=c.as_dict(),
                                     ttft_s=r.ttft_s, e2e_s=t - r.t_arrival, queue_s=r.t_admit - r.t_arrival))
        r.done_event.set()

    def _end(self, r: EngineRequest, status: str) -> None:
        """A cancelled request leaves: the executor drops its per-request state (plans, caches)."""
        if r.run is not None and not r.run.finished:
            try:
                self.fwd.end_request(r.id)
            except Exception:                             # pragma: no cover - best effort
                log.exception("engine: end_request(%s) failed", r.id)
        if r.run is not None:
            r.run.cache = None
        r.status = status
        r.t_finish = self.clock()
        if status == "cancelled":
            self.stats.cancelled += 1
        self._notify(r, "done" if status != "cancelled" else "cancelled", dict(finish_reason=status))
        r.done_event.set()

    def _fail(self, reqs: list[EngineRequest], status: int, message: str) -> None:
        with self._lock:
            for r in reqs:
                if r in self._running:
                    self._running.remove(r)
                    self._reserved -= r.footprint
        for r in reqs:
            if r.run is not None and not r.run.finished:
                try:
                    self.fwd.end_request(r.id)
                except Exception:                         # pragma: no cover
                    pass
            if r.run is not None:
                r.run.cache = None
            r.status, r.error, r.t_finish = "failed", message, self.clock()
            self.stats.failed += 1
            self._notify(r, "error", dict(status=status, message=message))
            r.done_event.set()

    @staticmethod
    def _notify(r: EngineRequest, kind: str, data: dict) -> None:
        if r.listener is None:
            return
        try:
            r.listener(kind, r, data)
        except Exception:                                 # a broken listener never stops the engine
            log.exception("engine: listener of request %s failed", r.id)

    # ---- background thread --------------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._loop, name="dblock-engine", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not self._queue and not self._running and not self._stop:
                    self._wake.wait()
                if self._stop and not self._queue and not self._running:
                    return
            try:
                self.step()
            except Exception:                             # pragma: no cover - step already contains failures
                log.exception("engine: iteration failed")
                time.sleep(0.01)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> bool:
        """Stop taking requests; with `drain`, finish every queued and running one first. True when the engine
        thread ended within `timeout` (None: wait as long as it takes)."""
        with self._lock:
            self._accepting = False
            if not drain:
                for r in list(self._queue) + list(self._running):
                    r.cancel_requested = True
            self._stop = True
            self._wake.notify_all()
        if self._thread is None:
            while self.step():
                pass
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- synchronous helpers ------------------------------------------------------------------------------
    def run_until_idle(self, max_iterations: int = 1_000_000) -> None:
        """Drive the engine in the calling thread until nothing is queued or running (no background thread)."""
        for _ in range(max_iterations):
            with self._lock:
                idle = not self._queue and not self._running
            if idle:
                return
            self.step()
        raise RuntimeError(f"engine still busy after {max_iterations} iterations")

    # ---- introspection ------------------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        return self._accepting

    def snapshot(self) -> dict:
        with self._lock:
            q, run, res = len(self._queue), len(self._running), self._reserved
        st = self.stats
        now = self.clock()
        window = [b for t, b in st.recent if t >= now - 10.0]
        span = min(10.0, max(1e-9, now - self.t0))
        moe = st.moe_fresh + st.moe_cached
        return dict(
            queue_length=q, running=run, batch_size=st.last_batch, kv_reserved_tokens=res,
            kv_budget_tokens=self.config.kv_budget_tokens, batch_cap=self.config.batch_cap,
            max_queue=self.config.max_queue, accepting=self._accepting,
            iterations=st.iterations, denoise_passes=st.denoise_passes, append_passes=st.append_passes,
            request_passes=st.request_passes,
            passes_per_s=len(window) / span, request_passes_per_s=sum(window) / span,
            tokens=st.tokens, blocks=st.blocks, Y=st.Y, Q=st.Q, tpf=st.Y / st.Q if st.Q else 0.0,
            finished=st.finished, cancelled=st.cancelled, failed=st.failed, rejected=dict(st.rejected),
            moe_rows_fresh=st.moe_fresh, moe_rows_cached=st.moe_cached,
            fresh_row_fraction=(st.moe_fresh / moe) if moe else (1.0 if st.denoise_passes else 0.0),
            cache_hit_ratio=(st.moe_cached / moe) if moe else 0.0,
            last_fresh_row_fraction=st.last_fresh_frac, busy_s=st.busy_s, uptime_s=now - self.t0,
            executor=getattr(self.fwd, "name", type(self.fwd).__name__), schedule=self.spec.name,
        )


def offline_tokens(forward: Forward, prompt: Sequence[int], max_new_tokens: int, seed: int,
                   spec: ScheduleSpec | str, dec: DecodeConfig, sampling: Optional[SamplingParams] = None) -> list:
    """What offline `generate` gives for one request alone (the engine's reference answer); `sampling` as in
    `Engine.submit`."""
    from dblock.decoding.generate import generate
    req = Request(list(prompt), max_new_tokens, int(seed), id=0, sampling=sampling)
    res = generate(forward, [req], dec.replace(max_new_tokens=max_new_tokens, n=1), spec)
    return res.tokens[0]
