"""`dblock simulate profile`: time every operator of a pass of one model on this machine (the measuring side).

This module and `measure.py`, `validate.py` are the simulator's model side: they load a model and run executors.
The predictive modules (`profile.py`, `batch.py`, `serving.py`, `cost.py`, ...) read only the JSON this writes.

What is timed (the operators of `profile.py`, over the model's own modules with synthetic inputs of the right
shapes; llada2_moe and llada_moe models):

    attention(requests, rows, context)   `Block.attn_norm` + `Block.attn` + residual on (B, L, H) with a
                               (B, G, context − L, D) KV prefix: B requests of L rows each, all-visible mask
    dense_mlp(rows)            `mlp_norm` + SwiGLU + residual of the first dense layer
    router(rows)               `MoE.route` (fp32 router logits + the family's top-K rule)
    moe(rows, touched)         `mlp_norm` + `MoE.routed` with the routing fixed so that exactly `touched` experts
                               receive the rows evenly (row t takes experts (tK + k) mod touched) + shared expert
                               + residual
    lm_head(live)              `LladaModel.logits` of `live` rows (what the executors run per segment)
    call_denoise(requests, segments), call_append(requests)
                               whole reference-executor calls on synthetic requests (a KV cache of 2C keys each,
                               `segments` blocks of C rows, half decoded) minus the operators above at their shapes
    driver(requests), admit(requests)   the serving engine's `step` on real Native requests minus the time inside
                               executor calls; the extra of the iteration that admits them
    epoch_moe(rows, fresh_frac)  the Epoch MoE region of the passes of real Native decodes of the model's task
                               (the Expert Atlas's fail-closed, re-routing and repair included; synthetic blocks
                               only where no decode pass lands), from the executor's own `moe_s` share of the pass
    epoch_call_denoise(requests, segments)   Epoch passes over the life of synthetic blocks minus the operators
                               (`profiler_epoch.py`)

Every value is a per-call time from `time.thread_time` (the calling thread's CPU time, which excludes waiting for a
core on a shared machine): each grid point is run `repeats` times (after one warm-up), each repeat timing enough
back-to-back calls to pass `min_sample_s`, and the median and quartiles are kept (`OpTable.from_samples`).
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import time
from typing import Callable, Optional, Sequence

import numpy as np

from dblock.simulator.fingerprint import code_fingerprint, machine_tag
from dblock.simulator.profile import OpTable, Profile, TIMER, geometric_grid, model_meta

QUICK = dict(repeats=3, max_rows_blocks=32, max_requests=32, context_blocks=8)
FULL = dict(repeats=7, max_rows_blocks=128, max_requests=64, context_blocks=16)


def _samples(fn: Callable[[], object], repeats: int, timer: Callable[[], float], min_s: float) -> list:
    """Per-call seconds of `fn`, `repeats` samples, each over enough back-to-back calls to last `min_s`."""
    fn()                                          # warm-up (allocations, first-touch)
    n = 1
    while True:
        t0 = timer()
        for _ in range(n):
            fn()
        dt = timer() - t0
        if dt >= min_s or n >= 4096:
            break
        n = min(4096, max(n * 2, int(math.ceil(n * min_s / max(dt, 1e-7)))))
    out = []
    for _ in range(repeats):
        t0 = timer()
        for _ in range(n):
            fn()
        out.append((timer() - t0) / n)
    return out


def rows_grid(C: int, max_blocks: int) -> list:
    """1, 2, 4, ... below the block size, then C, 2C, 4C, ... up to max_blocks·C rows."""
    small = [r for r in geometric_grid(1, C) if r < C]
    return small + [C * m for m in geometric_grid(1, max_blocks)]


class Profiler:
    """Measures one loaded LLaDA-family model. `timer` is injectable (tests give a fake clock)."""

    def __init__(self, model, name: str = "model", repeats: int = 7, max_rows_blocks: int = 128,
                 max_requests: int = 64, context_blocks: int = 16, min_sample_s: float = 2e-3,
                 timer: Callable[[], float] = time.thread_time, progress: bool = False, seed: int = 0):
        import torch
        cfg = model.config
        if cfg.family not in ("llada2_moe", "llada_moe"):
            raise ValueError(f"simulate profile: {cfg.family} models are not profiled (the LLaDA families are); "
                             "their r and β are measured on the same rows instead (see SIMULATOR.md)")
        self.torch, self.model, self.cfg, self.name = torch, model, cfg, name
        self.repeats, self.min_s, self.timer, self.progress = repeats, min_sample_s, timer, progress
        self.C = int(cfg.block_size)
        self.rows = rows_grid(self.C, max_rows_blocks)
        self.context = [self.C * m for m in geometric_grid(1, context_blocks)]
        self.requests = geometric_grid(1, max_requests)
        self.req_rows = geometric_grid(max(1, self.C // 4), 8 * self.C)     # rows per request of a call
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = model.embed.weight.dtype
        self.tables: dict = {}
        self._bar = None

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _tick(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(what)
            self._bar.update(1)

    def _x(self, *shape):
        return self.torch.randn(*shape, generator=self.gen, dtype=self.dtype)

    def _tokens(self, n: int):
        V, mask = self.cfg.vocab_size, self.cfg.mask_token_id
        t = self.torch.randint(0, V, (n,), generator=self.gen)
        t[t == mask] = (mask + 1) % V
        return t

    def _block(self, layer_index: int):
        return self.model.layers[layer_index]

    # ---- operators --------------------------------------------------------------------------------------------
    def attention(self) -> OpTable:
        """attention(requests, rows, context): `requests` requests of `rows` query rows each over `context` keys per
        query (a KV prefix of context − rows). Both splits matter on a CPU: scores grow with requests·rows·context,
        the key/value concatenation and head expansion with requests·context."""
        torch, cfg = self.torch, self.cfg
        blk = self._block(0)
        G, D = cfg.num_key_value_heads, cfg.head_dim
        samples = np.zeros((len(self.requests), len(self.req_rows), len(self.context), self.repeats))
        with torch.no_grad():
            for i, B in enumerate(self.requests):
                for j, Lq in enumerate(self.req_rows):
                    for k, s in enumerate(self.context):
                        Lc = max(0, s - Lq)       # a context shorter than the rows: measured at context = rows
                        x = self._x(B, Lq, cfg.hidden_size)
                        pos = torch.arange(Lc, Lc + Lq).expand(B, Lq)
                        mask = torch.ones(B, Lq, Lc + Lq, dtype=torch.bool)
                        pk = self._x(B, G, Lc, D) if Lc else None
                        pv = self._x(B, G, Lc, D) if Lc else None

                        def fn(x=x, pos=pos, mask=mask, pk=pk, pv=pv):
                            return x + blk.attn(blk.attn_norm(x), pos, mask, pk, pv)[0]
                        samples[i, j, k] = _samples(fn, self.repeats, self.timer, self.min_s)
                self._tick(f"attention requests {B}")
        return OpTable.from_samples("attention", ["requests", "rows", "context"],
                                    [self.requests, self.req_rows, self.context], samples, [True, True, True],
                                    per="layer", note="rows = query rows per request (padded), context = keys each "
                                                      "query sees (cache + rows)")

    def dense_mlp(self) -> Optional[OpTable]:
        cfg = self.cfg
        dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
        if not dense:
            return None
        blk = self._block(dense[0])
        samples = np.zeros((len(self.rows), self.repeats))
        with self.torch.no_grad():
            for i, r in enumerate(self.rows):
                x = self._x(1, r, cfg.hidden_size)
                samples[i] = _samples(lambda x=x: x + blk.mlp(blk.mlp_norm(x)), self.repeats, self.timer, self.min_s)
        self._tick("dense_mlp")
        return OpTable.from_samples("dense_mlp", ["rows"], [self.rows], samples, [True], per="dense layer")

    def _moe_block(self):
        cfg = self.cfg
        return self._block(cfg.moe_layers[0]) if cfg.moe_layers else None

    def router(self) -> Optional[OpTable]:
        blk = self._moe_block()
        if blk is None:
            return None
        samples = np.zeros((len(self.rows), self.repeats))
        with self.torch.no_grad():
            for i, r in enumerate(self.rows):
                x = self._x(r, self.cfg.hidden_size)
                samples[i] = _samples(lambda x=x: blk.mlp.route(x), self.repeats, self.timer, self.min_s)
        self._tick("router")
        return OpTable.from_samples("router", ["rows"], [self.rows], samples, [True], per="MoE layer")

    def touched_grid(self) -> list:
        E, K = self.cfg.num_experts, self.cfg.num_experts_per_tok
        return sorted(set([K] + [t for t in geometric_grid(K, E) if t <= E] + [E]))

    def moe(self) -> Optional[OpTable]:
        torch, cfg = self.torch, self.cfg
        blk = self._moe_block()
        if blk is None:
            return None
        moe, K = blk.mlp, cfg.num_experts_per_tok
        touched = self.touched_grid()
        samples = np.zeros((len(self.rows), len(touched), self.repeats))
        with torch.no_grad():
            for i, r in enumerate(self.rows):
                x = self._x(r, cfg.hidden_size)
                for j, t in enumerate(touched):
                    ids = ((torch.arange(r)[:, None] * K + torch.arange(K)[None, :]) % t).long()
                    w = torch.full((r, K), 1.0 / K, dtype=torch.float32)

                    def fn(x=x, ids=ids, w=w):
                        xn = blk.mlp_norm(x)
                        y = moe.routed(xn, ids, w)
                        if moe.shared is not None:
                            y = y + moe.shared(xn)
                        return x + y
                    samples[i, j] = _samples(fn, self.repeats, self.timer, self.min_s)
            self._tick("moe")
        return OpTable.from_samples("moe", ["rows", "touched"], [self.rows, touched], samples, [True, True],
                                    per="MoE layer", note="rows spread evenly over `touched` experts: rows per "
                                                          "expert = rows·K/touched; shared expert included")

    def lm_head(self) -> OpTable:
        live = geometric_grid(1, 4 * self.C)
        samples = np.zeros((len(live), self.repeats))
        with self.torch.no_grad():
            for i, n in enumerate(live):
                h = self._x(n, self.cfg.hidden_size)
                samples[i] = _samples(lambda h=h: self.model.logits(h), self.repeats, self.timer, self.min_s)
        self._tick("lm_head")
        return OpTable.from_samples("lm_head", ["live"], [live], samples, [True], per="segment")

    # ---- whole calls ------------------------------------------------------------------------------------------
    def _items(self, fwd, B: int, segments: int, decoded_frac: float, cache_blocks: int = 2, warm_all_masked=False):
        """B synthetic requests: a KV cache of `cache_blocks`·C committed keys (one real append), then `segments`
        in-flight blocks of C rows, `decoded_frac` of the first one decoded (the others all MASK when
        `warm_all_masked`)."""
        from dblock.forward import Segment, StepInput, block_causal
        torch, C, M = self.torch, self.C, self.cfg.mask_token_id
        items = []
        for b in range(B):
            cache = fwd.new_cache()
            pre = [Segment(block=k, tokens=self._tokens(C), positions=torch.arange(k * C, (k + 1) * C),
                           live=torch.zeros(C, dtype=torch.bool), decoded=torch.ones(C, dtype=torch.bool),
                           role="prefix") for k in range(cache_blocks)]
            if pre:
                fwd.append([StepInput(("profile", b), pre, block_causal(len(pre)), cache)])
            segs = []
            for s in range(segments):
                k = cache_blocks + s
                tok = torch.full((C,), M, dtype=torch.long)
                nd = int(round(decoded_frac * C)) if (s == 0 or not warm_all_masked) else 0
                if nd:
                    tok[:nd] = self._tokens(nd)
                dec = tok != M
                segs.append(Segment(block=k, tokens=tok, positions=torch.arange(k * C, (k + 1) * C), live=~dec,
                                    decoded=dec, role="current" if s == 0 else "warmup"))
            items.append(StepInput(("profile", b), segs, block_causal(segments), cache))
        return items

    def _ops_of(self, B: int, rows_per_req: int, context: float, live: Sequence[int], kind: str = "denoise",
                moe_per_layer: float | None = None) -> float:
        """The operators' share of a reference call (what the whole-call residual subtracts)."""
        from dblock.simulator.profile import touched_experts
        cfg, T = self.cfg, self.tables
        N = B * rows_per_req
        t = cfg.num_hidden_layers * T["attention"](B, rows_per_req, context)
        n_moe = len(cfg.moe_layers)
        if "dense_mlp" in T:
            t += (cfg.num_hidden_layers - n_moe) * T["dense_mlp"](N)
        if n_moe:
            if moe_per_layer is not None:
                t += n_moe * moe_per_layer
            else:
                E, K = cfg.num_experts, cfg.num_experts_per_tok
                t += n_moe * (T["router"](N) + T["moe"](N, max(K, touched_experts(N, E, K))))
        if kind == "denoise":
            t += sum(T["lm_head"](x) for x in live if x > 0)
        return t

    def _ops_fn(self, B: int, rows_per_req: int, context: int, live: Sequence[int], kind: str = "denoise",
                with_moe: bool = True):
        """A closure running, at this call's shapes, exactly the operators the tables price (every layer's attention,
        dense MLP, router and experts, the LM head per segment): timed right beside the whole call, so the residual
        is taken at one moment of the machine."""
        from dblock.simulator.profile import touched_experts
        torch, cfg = self.torch, self.cfg
        blk = self._block(0)
        G, D, H = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        Lc = max(0, int(context) - rows_per_req)
        x = self._x(B, rows_per_req, H)
        pos = torch.arange(Lc, Lc + rows_per_req).expand(B, rows_per_req)
        mask = torch.ones(B, rows_per_req, Lc + rows_per_req, dtype=torch.bool)
        pk = self._x(B, G, Lc, D) if Lc else None
        pv = self._x(B, G, Lc, D) if Lc else None
        N = B * rows_per_req
        n_moe = len(cfg.moe_layers) if with_moe else 0
        n_dense = cfg.num_hidden_layers - len(cfg.moe_layers)
        dense_blk = next((self._block(i) for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)), None)
        mb = self._moe_block()
        xr = self._x(N, H)
        ids = w = None
        if mb is not None:
            K = cfg.num_experts_per_tok
            t = max(K, int(round(touched_experts(N, cfg.num_experts, K))))
            ids = ((torch.arange(N)[:, None] * K + torch.arange(K)[None, :]) % t).long()
            w = torch.full((N, K), 1.0 / K, dtype=torch.float32)
        heads = [self._x(n, H) for n in live if n > 0] if kind == "denoise" else []

        def fn():
            for _ in range(cfg.num_hidden_layers):
                x + blk.attn(blk.attn_norm(x), pos, mask, pk, pv)[0]
            for _ in range(n_dense):
                xr + dense_blk.mlp(dense_blk.mlp_norm(xr))
            for _ in range(n_moe):
                mb.mlp.route(xr)
                xn = mb.mlp_norm(xr)
                y = mb.mlp.routed(xn, ids, w)
                if mb.mlp.shared is not None:
                    y = y + mb.mlp.shared(xn)
                xr + y
            for h in heads:
                self.model.logits(h)
        return fn

    def _residual(self, call, ops, fresh=None) -> list:
        """`repeats` samples of (call − ops), each pair timed back to back (`fresh()` rebuilds the call's state)."""
        call(), ops()                                  # warm-up
        out = []
        for _ in range(self.repeats):
            arg = fresh() if fresh is not None else None
            t0 = self.timer()
            call(arg) if fresh is not None else call()
            tc = self.timer() - t0
            t0 = self.timer()
            ops()
            out.append(tc - (self.timer() - t0))
        return out

    def calls(self) -> list:
        """call_denoise(requests, segments) and call_append(requests): whole calls minus their operators, each
        residual from a call and its operators timed back to back."""
        from dblock.decoding.generate import reference_forward
        from dblock.forward import Segment, StepInput, block_causal
        torch, C = self.torch, self.C
        fwd = reference_forward(self.model)
        segs_grid = [1, 2, 4]
        den = np.zeros((len(self.requests), len(segs_grid), self.repeats))
        app = np.zeros((len(self.requests), self.repeats))
        with torch.no_grad():
            for i, B in enumerate(self.requests):
                for j, S in enumerate(segs_grid):
                    items = self._items(fwd, B, S, 0.5)
                    live = [int(s.live.sum()) for it in items for s in it.segments]
                    ctx = items[0].cache.length + S * C
                    den[i, j] = self._residual(lambda: fwd.denoise(items), self._ops_fn(B, S * C, ctx, live))
                # append: one committed block per request onto a 2C cache; each sample on fresh caches
                base = self._items(fwd, B, 1, 1.0)

                def fresh(base=base):
                    trial = []
                    for it in base:
                        c = fwd.new_cache()
                        c.k, c.v, c.length = list(it.cache.k), list(it.cache.v), it.cache.length
                        s = it.segments[0]
                        seg = Segment(block=s.block, tokens=s.tokens, positions=s.positions,
                                      live=torch.zeros(C, dtype=torch.bool), decoded=torch.ones(C, dtype=torch.bool),
                                      role="prefix")
                        trial.append(StepInput(it.request, [seg], block_causal(1), c))
                    return trial

                def call(trial=None):
                    fwd.append(trial if trial is not None else fresh())
                app[i] = self._residual(call, self._ops_fn(B, C, base[0].cache.length + C, [], kind="append"),
                                        fresh=fresh)
                self._tick(f"calls requests {B}")
        return [OpTable.from_samples("call_denoise", ["requests", "segments"], [self.requests, segs_grid], den,
                                     [True, True], per="denoising call",
                                     note="whole call minus its operators (layout, KV stacking, embedding, Python)"),
                OpTable.from_samples("call_append", ["requests"], [self.requests], app, [True], per="append call",
                                     note="whole call minus its operators")]

    def driver(self) -> list:
        """Host work of an iteration outside the executor calls, on the serving engine (`Engine.step`: the driver's
        `step_once` plus the engine's bookkeeping): `driver(requests)` per iteration with `requests` running, and
        `admit(requests)` the extra cost of the iteration that admits them (their `RequestRun`s are built)."""
        from dblock.decoding.generate import reference_forward
        from dblock.decoding.params import DecodeConfig
        from dblock.serving.engine import Engine, EngineConfig
        torch, C = self.torch, self.C
        fwd = _CallTimer(reference_forward(self.model), self.timer)
        dec = DecodeConfig(max_new_tokens=3 * C)
        samples = np.zeros((len(self.requests), self.repeats))
        admit = np.zeros((len(self.requests), self.repeats))
        with torch.no_grad():
            for i, B in enumerate(self.requests):
                steady, first = [], []
                while len(steady) < self.repeats + 1 or len(first) < self.repeats + 1:
                    eng = Engine(fwd, "native", dec, EngineConfig(batch_cap=B, kv_budget_tokens=1 << 30,
                                                                  max_queue=1 << 20))
                    eng.submit_many([self._tokens(C // 2 + 1).tolist() for _ in range(B)])
                    times = []
                    for _ in range(4):                   # the first iterations: every request still running
                        fwd.inside = 0.0
                        t0 = self.timer()
                        eng.step()
                        times.append(self.timer() - t0 - fwd.inside)
                    first.append(times[0])
                    steady += times[1:]
                steady = sorted(steady)[: self.repeats + 1]
                med = float(np.median(steady))
                samples[i] = steady[1:] if len(steady) > self.repeats else steady[: self.repeats]
                admit[i] = [max(0.0, f - med) for f in first[1: self.repeats + 1]]
                self._tick(f"driver requests {B}")
        return [OpTable.from_samples("driver", ["requests"], [self.requests], samples, [True], per="iteration",
                                     note="serving engine step minus executor calls; Native, masked sampler"),
                OpTable.from_samples("admit", ["requests"], [self.requests], admit, [True], per="iteration",
                                     note="extra host work of the iteration that admits this many requests")]

    def epoch(self) -> list:
        """epoch_moe(rows, fresh_frac) from real Native decode passes and epoch_call_denoise(requests, segments)
        (`profiler_epoch.epoch_tables`)."""
        from dblock.profiling.profiler_epoch import epoch_tables
        return epoch_tables(self)

    # ---- drift anchors ----------------------------------------------------------------------------------------
    def anchors(self) -> dict:
        """A few operators and one whole call, timed now: stored with the profile and re-timed when it is used, so
        the machine's drift since profiling (clock, shared caches, neighbours) shows as one factor, measured on
        microbenchmarks — never fitted on a decoding run (`drift`)."""
        from dblock.decoding.generate import reference_forward
        torch, cfg, C = self.torch, self.cfg, self.C
        blk = self._block(0)
        out = {}
        with torch.no_grad():
            for B in (1, 8, 32):
                x = self._x(B, C, cfg.hidden_size)
                pos = torch.arange(2 * C, 3 * C).expand(B, C)
                mask = torch.ones(B, C, 3 * C, dtype=torch.bool)
                pk, pv = self._x(B, cfg.num_key_value_heads, 2 * C, cfg.head_dim), \
                    self._x(B, cfg.num_key_value_heads, 2 * C, cfg.head_dim)
                out[f"attention_{B}"] = float(np.median(_samples(
                    lambda: x + blk.attn(blk.attn_norm(x), pos, mask, pk, pv)[0], self.repeats, self.timer,
                    self.min_s)))
            mb = self._moe_block()
            if mb is not None:
                h = self._x(8 * C, cfg.hidden_size)
                out["moe_layer"] = float(np.median(_samples(lambda: mb.mlp(mb.mlp_norm(h)), self.repeats, self.timer,
                                                            self.min_s)))
            h = self._x(C, cfg.hidden_size)
            out["lm_head"] = float(np.median(_samples(lambda: self.model.logits(h), self.repeats, self.timer,
                                                      self.min_s)))
            fwd = reference_forward(self.model)
            for B in (1, 8, 32):       # small and large calls: contention on a shared machine depends on the size
                items = self._items(fwd, B, 1, 0.5)
                out[f"call_{B}"] = float(np.median(_samples(lambda: fwd.denoise(items), self.repeats, self.timer,
                                                            self.min_s)))
        return out

    # ---- all of it -------------------------------------------------------------------------------------------
    def run(self, executors: Sequence[str] = ("reference", "epoch")) -> Profile:
        steps = 4 + len(self.requests) * (3 + ("epoch" in executors))
        if self.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=steps, desc=f"profile {self.name}", unit="step")
        t0 = time.perf_counter()
        try:
            for fn in (self.attention, self.dense_mlp, self.router, self.moe, self.lm_head):
                t = fn()
                if t is not None:
                    self.tables[t.name] = t
            for t in self.calls() + self.driver():
                self.tables[t.name] = t
            if "epoch" in executors:
                for t in self.epoch():
                    self.tables[t.name] = t
        finally:
            if self._bar is not None:
                self._bar.close()
        anchor = self.anchors()
        torch = self.torch
        meta = dict(model=dict(name=self.name, **model_meta(self.cfg)), machine=machine_tag(), anchor=anchor,
                    processor=platform.processor() or platform.machine(), cores=os.cpu_count(),
                    torch=torch.__version__, threads=torch.get_num_threads(), dtype=str(self.dtype).split(".")[-1],
                    device="cpu", timer=TIMER, repeats=self.repeats, min_sample_s=self.min_s,
                    executors=list(executors), seconds=time.perf_counter() - t0, code=code_fingerprint(),
                    epoch_moe_cells=getattr(self, "cells", None), epoch_atlas_hot=getattr(self, "atlas_hot", None),
                    created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        return Profile(meta, dict(self.tables))


class _CallTimer:
    """A Forward proxy that adds the thread time spent inside executor calls to `inside`."""

    def __init__(self, fwd, timer):
        self.fwd, self.timer, self.inside = fwd, timer, 0.0
        self.config, self.name = fwd.config, fwd.name

    def __getattr__(self, name):
        return getattr(self.fwd, name)

    def append(self, items):
        t0 = self.timer()
        try:
            return self.fwd.append(items)
        finally:
            self.inside += self.timer() - t0

    def denoise(self, items):
        t0 = self.timer()
        try:
            return self.fwd.denoise(items)
        finally:
            self.inside += self.timer() - t0


def drift(profile, model, repeats: int = 7, timer: Callable[[], float] = time.thread_time) -> dict:
    """The machine's speed now against when `profile` was measured: the median over its anchors of (time now / time
    then). 1.0 (with a note) when the profile has no anchors or is of another model shape."""
    then = profile.meta.get("anchor") or {}
    if not then:
        return dict(factor=1.0, note="the profile has no drift anchors", anchors={})
    now = Profiler(model, name="anchor", repeats=repeats, timer=timer).anchors()
    ratios = {k: now[k] / then[k] for k in then if k in now and then[k] > 0}
    if not ratios:
        return dict(factor=1.0, note="no common anchors", anchors={})
    # the whole calls decide: a single operator in a tight loop keeps its weights hot and moves less with the
    # machine's load than a pass does; the operator anchors are reported beside them
    calls = [v for k, v in ratios.items() if k.startswith("call_")] or list(ratios.values())
    return dict(factor=float(np.median(calls)), anchors=ratios,
                note="time now / time at profiling, median over the whole-call anchors")


def profile_model(model: str, out: Optional[str] = None, executors: Sequence[str] = ("reference", "epoch"),
                  quick: bool = False, repeats: Optional[int] = None, progress: bool = False,
                  timer: Callable[[], float] = time.thread_time) -> Profile:
    """Load `model` (a bundled name or folder), profile it, write the JSON to `out` when given; return it."""
    import dblock
    m = dblock.load(model)
    knobs = dict(QUICK if quick else FULL)
    if repeats is not None:
        knobs["repeats"] = repeats
    prof = Profiler(m, name=os.path.basename(os.path.normpath(model)), progress=progress, timer=timer,
                    **knobs).run(executors)
    prof.meta["quick"] = quick
    if out:
        prof.save(out)
    return prof
