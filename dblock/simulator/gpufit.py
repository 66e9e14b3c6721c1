"""The GPU cost model fitted on published measurements, and its predictions of every published point.

`cost.pass_cost` prices a pass from the model's published configuration and the GPU's datasheet (`hardware.py`). What
no datasheet gives is fitted here, on the calibration points of `data/published_gpu.json` only (`published.py`):

* the achieved GEMM fraction of the low precisions (`gemm_fp8`, `gemm_fp4`: the grouped expert GEMMs at ~16 rows
  per expert of the points that use them) and a factor on the hardware table's stream fraction (`stream_scale`);
* per serving class, fixed costs per pass (`pass_s`), per layer (`layer_s`) and per all-to-all (`a2a_s`) where the
  class has calibration points that determine them: `engine` (SGLang, vLLM, Diffulex, dInfer, the OBA paper's
  kernels; the Epoch paper's testbed is priced as one: `COSTS_OF`) and `moe-replay` (one MoE layer replayed in
  isolation). A value no point determines is held and said so (`FIXED`); a class with no calibration point
  (`llama.cpp`) is not predicted.

The fit is least squares in log space (scipy `least_squares`, parameters in log space so they stay positive, within
bounds): the residual of a point is log(predicted / published), 0 inside a published range, else the log distance
to its nearer end. `fit()` returns the values, the residuals and, for every fitted value, the points that determine
it (the calibration points whose prediction moves by more than 1% when that value moves by 10%). The fitted values
are stored in `data/gpu_fit.json` for the CLI (`dblock simulate calibrate --published --out
dblock/simulator/data/gpu_fit.json` rewrites it; a test re-runs the fit and checks the stored values equal it).

Predictions (`predict`): a point's settings give the pass shape — batch, block, layout of its schedule, committed
prefix (prompt + half the answer) — and the metric says how passes combine; what the source does not state is an
assumption the prediction names (`ASSUMED_TPF`, `ASSUMED_PROMPT`, `ASSUMED_CACHE`, `EPOCH_ONLINE`):

    pass_ms        one pass                          moe_layer_ms   one MoE sub-block of one layer
    canvas_ms      n · pass (n passes per block)    r              pass(schedule) / pass(Native)
    ttft_ms        prefill + n · pass               tpot_ms        (K − 1)·(n + 1)·pass / (Y − 1)
    request_ms     ttft + (K − 1)·(n + 1)·pass      tps_per_request, output_tps   Y / request
    moe_share      MoE path / pass                  speedup_vs_baseline   dense pass / Epoch pass
    p95_equivalent_itl_ms   P95 block latency of the analytic serving model (`plan.Evaluator`) at the point's rate

with n = block / TPF (or the stated steps per block), K = Y / block blocks per answer, one append pass per
committed block (the KV write of the finished block), Y the answer length; SGLang prefills a prompt in block-sized
chunks (its dLLM token budget is max_running_requests · block), other engines in one pass.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

import numpy as np

from dblock.simulator import cost, hardware
from dblock.simulator.published import Point, PublishedFile

FIT_PATH = os.path.join(os.path.dirname(__file__), "data", "gpu_fit.json")

#: tokens per forward assumed where a source gives neither TPF nor a step count
ASSUMED_TPF = {
    # LLaDA2.0 model cards (LLaDA2.0-mini-CAP / flash-CAP cards: 12 benchmarks, threshold decoding): mini 2.55,
    # flash 3.19 tokens per forward
    # (LLaDA2.1's Speedy Mode, SGLang's JointThreshold default, averages 5.93 on the LLaDA2.1 report's benchmarks; the
    # SGLang cookbook's runs decode random-token prompts, and their own TTFT/TPOT ratio under SGLang's block-sized
    # prefill chunks implies ~14 passes per block, so the card's figure is taken for them too: SIMULATOR.md)
    ("llada2-mini", "threshold"): (2.55, "TPF 2.55 (LLaDA2.0-mini model card, 12 benchmarks)"),
    ("llada2-flash", "threshold"): (3.19, "TPF 3.19 (LLaDA2.0-flash model card, 12 benchmarks)"),
    # DiffusionGemma's entropy-bound sampler: 21 steps for one 256-token canvas (llama.cpp PR 24423, L4 run)
    ("diffusion-gemma", "entropy"): (256 / 21, "21 steps per 256-token canvas (llama.cpp PR 24423's entropy-bound run)"),
}
#: prompt lengths assumed by benchmark where a source gives none
ASSUMED_PROMPT = {"gsm8k": (150.0, "GSM8K prompt ~150 tokens (question + chat template; assumed)")}
#: committed prefix assumed for a pass whose source gives no lengths
ASSUMED_CACHE = {
    "diffusion-gemma": (1500.0, "cache 1500 tokens (the OBA paper's responses average ~2,100 tokens; assumed)"),
    "*": (512.0, "cache 512 tokens (assumed)"),
}
#: the Epoch paper's online workload (not stated there; the planner's earlier assumption)
EPOCH_ONLINE = dict(prompt="const:256", tokens="lognormal:256,0.5", batch_cap=256)

PRECISION = {  # dtype -> (dense dtype, dense bytes/weight, expert dtype, expert bytes/weight)
    "bf16": ("bf16", 2.0, "bf16", 2.0), "fp16": ("fp16", 2.0, "fp16", 2.0), "fp8": ("fp8", 1.0, "fp8", 1.0),
    # NVFP4: 4-bit values plus one FP8 scale per 16 = 0.5625 bytes per weight
    "nvfp4-moe+fp8": ("fp8", 1.0, "fp4", 0.5625),
}
CLASSES = ("engine", "epoch-paper", "moe-replay")
#: classes priced with another's costs: the Epoch paper's testbed (a vLLM-style fused-MoE runtime) has no parameter
#: of its own — its online figures and MoE shares are the engine's to predict (its Figure 2's absolute time is not
#: reconcilable with them: SIMULATOR.md)
COSTS_OF = {"epoch-paper": "engine"}


# ---- parameters ---------------------------------------------------------------------------------------------------

#: the fitted parameters: name -> (class or None for shared, Calibration field or global, lower, upper, start)
PARAMS = {
    "gemm_fp8": (None, "gemm_fp8", 0.005, 0.95, 0.4),
    "gemm_fp4": (None, "gemm_fp4", 0.002, 0.95, 0.3),
    "stream_scale": (None, "stream_scale", 0.05, 1.15, 0.7),
    "engine.layer_s": ("engine", "layer_s", 1e-7, 0.01, 5e-5),
    "engine.a2a_s": ("engine", "a2a_s", 5e-6, 0.05, 3e-5),
    "moe-replay.a2a_s": ("moe-replay", "a2a_s", 1e-7, 0.05, 2e-4),
}
#: values no calibration point determines, held and named (class, field) -> (value, why)
FIXED = {
    (None, "gemm_bf16"): (None, "no calibration point is bound by bf16 GEMMs (every bf16 point is memory- or "
                                "fixed-cost-bound): the hardware table's GEMM fraction is used"),
    ("engine", "pass_s"): (0.0, "with a cost per layer the calibration points leave no per-pass remainder (fitted "
                                "beside it, it went to 2e-5 s)"),
    ("moe-replay", "layer_s"): (0.0, "its points differ only in rows, so a per-layer cost and the per-all-to-all "
                                     "one are not separable: the constant is carried by a2a_s"),
    ("moe-replay", "pass_s"): (0.0, "a MoE-layer replay has no pass"),
}


@dataclass
class GpuParams:
    """The fitted values: shared ones and, per serving class, a `cost.Calibration`."""

    values: dict                                   # PARAMS name -> value

    def shared(self) -> dict:
        return {k: v for k, v in self.values.items() if PARAMS[k][0] is None}

    def cal(self, klass: str) -> cost.Calibration | None:
        """The serving class's `Calibration` (None: the class has no fitted values)."""
        if klass not in CLASSES:
            return None
        klass = COSTS_OF.get(klass, klass)
        g = self.values
        kw = dict(gemm=(("fp8", g["gemm_fp8"]), ("fp4", g["gemm_fp4"])), stream_scale=g["stream_scale"])
        for name, (k, fld, *_rest) in PARAMS.items():
            if k == klass:
                kw[fld] = g[name]
        for (k, fld), (v, _why) in FIXED.items():
            if k == klass:
                kw[fld] = g[f"{v}.{fld}"] if isinstance(v, str) else v
        return cost.Calibration(**kw)

    def as_dict(self) -> dict:
        return dict(values=dict(self.values))


# ---- predictions --------------------------------------------------------------------------------------------------

@dataclass
class Prediction:
    value: float | None                  # None: cannot be predicted (see `reason`)
    reason: str = ""
    assumptions: list = field(default_factory=list)


class CannotPredict(Exception):
    pass


@dataclass
class _Ctx:
    p: Point
    cfg: object
    hw: object
    par: cost.Parallel
    cal: cost.Calibration
    prec: tuple
    C: int
    notes: list

    def pass_cost(self, shape: cost.PassShape) -> cost.PassCost:
        dt, wb, xdt, xwb = self.prec
        return cost.pass_cost(self.cfg, shape, self.hw, self.par, self.cal, dtype=dt, wbytes=wb, expert_dtype=xdt,
                              expert_wbytes=xwb)


def _context(p: Point, params: GpuParams) -> _Ctx:
    klass = p.klass
    cal = params.cal(klass)
    if cal is None:
        raise CannotPredict(f"serving class {klass!r} has no calibration point (fitted classes: {', '.join(CLASSES)})")
    if p.dtype not in PRECISION:
        raise CannotPredict(f"dtype {p.dtype!r}: no tensor rate for it in the hardware table and no calibration "
                            "point of that precision")
    hw = hardware.get(p.hardware)
    prec = PRECISION[p.dtype]
    for dt in (prec[0], prec[2]):
        try:
            hw.flops(dt)
        except ValueError as e:
            raise CannotPredict(str(e)) from None
    cfg = cost.get_model(p.model)
    tp = p.tp or (p.gpus if not p.ep else max(1, p.gpus // p.ep))
    ep = p.ep or 1
    sp = p.gpus if klass == "epoch-paper" else (ep if ep > 1 else 1)
    notes = []
    if p.tp is None:
        notes.append(f"TP {tp} (not stated)")
    C = p.decoding.block or cfg.block_size
    return _Ctx(p, cfg, hw, cost.Parallel(tp, ep, sp), cal, prec, C, notes)


def _rule(p: Point) -> str:
    return "entropy" if p.model == "diffusion-gemma" else "threshold"


def passes_per_block(ctx: _Ctx) -> float:
    d = ctx.p.decoding
    if d.steps_per_block:
        return float(d.steps_per_block)
    if d.tpf:
        return ctx.C / d.tpf
    key = (ctx.p.model, _rule(ctx.p))
    if key not in ASSUMED_TPF:
        raise CannotPredict(f"needs tokens per forward (decoding.tpf or steps_per_block); the source gives neither "
                            f"and none is published for {ctx.p.model} under this decoding")
    tpf, why = ASSUMED_TPF[key]
    ctx.notes.append(why)
    return ctx.C / tpf


def _lengths(ctx: _Ctx) -> tuple[float | None, float | None]:
    w = ctx.p.workload
    prompt, y = w.prompt_tokens, w.output_tokens
    if prompt is None and w.benchmark:
        for k, (v, why) in ASSUMED_PROMPT.items():
            if k in w.benchmark.lower():
                prompt = v
                ctx.notes.append(why)
    return prompt, y


def cache_len(ctx: _Ctx) -> float:
    prompt, y = _lengths(ctx)
    if prompt is not None and y is not None:
        return prompt + y / 2
    if prompt is not None:
        return prompt
    v, why = ASSUMED_CACHE.get(ctx.p.model, ASSUMED_CACHE["*"])
    ctx.notes.append(why)
    return v


def _layout(p: Point) -> tuple[str, int | None]:
    s = p.decoding.schedule
    if s == "native-2c":
        return "native", None             # Native(2C) is Native with the wider block (decoding.block)
    return {"native": "native", "oba": "oba", "dense-mask": "dense_mask", "flowblock": "native"}[s], None


def _pass(ctx: _Ctx, batch: int, layout: str = "native", cache: float | None = None, block: int | None = None,
          **kw) -> cost.PassCost:
    L = cache_len(ctx) if cache is None else cache
    C = block or ctx.C
    if layout != "native" and ctx.p.decoding.schedule in ("oba", "dense-mask"):
        C = ctx.C
    return ctx.pass_cost(cost.PassShape(batch=batch, layout=layout, block=C, cache_len=L, **kw))


def _prefill_s(ctx: _Ctx, prompt: float) -> float:
    """The prompt's prefill. SGLang admits at most max_running_requests · block tokens of dLLM work per forward
    (its dLLM PrefillAdder budget), so with one running request a prompt is prefilled in block-sized chunks, each
    one pass over the growing prefix; other engines prefill it in one pass."""
    if "sglang" in ctx.p.software.lower():
        chunks = max(1, math.ceil(prompt / ctx.C))
        ctx.notes.append(f"prefill in {chunks} block-sized chunks (SGLang's dLLM token budget)")
        return sum(ctx.pass_cost(cost.PassShape(batch=1, block=ctx.C, cache_len=i * ctx.C, lm_rows="live",
                                                live_frac=0.0)).total for i in range(chunks))
    return ctx.pass_cost(cost.PassShape(batch=0, block=ctx.C, cache_len=0.0, extra_rows=int(round(prompt)))).total


def _request_s(ctx: _Ctx, batch: int = 1) -> tuple[float, float, float]:
    """(TTFT, decode time after the first block, answer tokens) of one request at batch `batch`."""
    prompt, y = _lengths(ctx)
    n = passes_per_block(ctx)
    if y is None:
        raise CannotPredict("needs the answer length (workload.output_tokens)")
    if prompt is None:
        raise CannotPredict("needs the prompt length (workload.prompt_tokens or a known benchmark)")
    t = _pass(ctx, batch, cache=prompt + y / 2).total
    K = max(1.0, y / ctx.C)
    ttft = _prefill_s(ctx, prompt) + n * t
    return ttft, (K - 1.0) * (n + 1.0) * t, y


_MEMO: dict = {}


def decode_profile(C: int, n: float):
    """The Native decode profile of n passes per C-token block (gamma, cv 0.3; positions decoded uniformly over the
    block's life), one object per (C, n) so that the planner's caches hold."""
    from dblock.simulator.positions import ParametricProfile
    key = ("profile", C, round(n, 4))
    if key not in _MEMO:
        _MEMO[key] = ParametricProfile(C=C, passes=f"gamma:{n:.4f},0.3", shape=1.0)
    return _MEMO[key]


def _liveness(C: int, n: float):
    from dblock.simulator.liveness import LivenessProfile
    key = ("liveness", C, round(n, 4))
    if key not in _MEMO:
        _MEMO[key] = LivenessProfile.from_profile(decode_profile(C, n))
    return _MEMO[key]


def _work_stats(C: int, n: float):
    from dblock.simulator import plan
    key = ("ws", C, round(n, 4))
    if key not in _MEMO:
        _MEMO[key] = plan.work_stats(C, decode_profile(C, n), "native", 0.0, EPOCH_ONLINE["prompt"],
                                     EPOCH_ONLINE["tokens"])
    return _MEMO[key]


def _serving_itl(ctx: _Ctx) -> float:
    from dblock.simulator import plan
    rate = ctx.p.workload.rate
    if rate is None:
        raise CannotPredict("needs the arrival rate (workload.rate)")
    n = passes_per_block(ctx)
    ctx.notes.append("prompts 256, answers lognormal mean 256 (cv 0.5), batch cap 256 (assumed); analytic steady "
                     "state (plan.Evaluator)")
    ws = _work_stats(ctx.C, n)
    shape = plan.Shape(ctx.p.hardware, ctx.p.gpus, ctx.par.tp, ctx.par.ep, ctx.par.sp, ctx.p.path, "native")
    ev = plan.Evaluator(ctx.cfg, ctx.hw, shape, ctx.cal, ws)
    pr = ev.predict(rate)
    if pr is not None:
        return pr["p95_itl_s"]
    # the replica cannot keep up: the running batch sits at its cap and the excess waits in the queue
    cap = EPOCH_ONLINE["batch_cap"]
    ctx.notes.append(f"cannot keep up at {rate:g} req/s: the batch sits at its cap {cap}, the excess queues")
    t = ev.pass_s(cap, cap * (ws.prompt_mean + ws.y_mean) / ws.passes_mean)
    return t * ws.block_q95


def _speedup(ctx: _Ctx, batch: int) -> float:
    n = passes_per_block(ctx)
    lp = _liveness(ctx.C, n)
    L = cache_len(ctx)
    ctx.notes.append(f"liveness: uniform decoding over {n:.1f} passes per block, M_C = 5 (live {lp.live:.2f}, "
                     f"fresh {lp.fresh:.2f})")
    dense = ctx.pass_cost(cost.PassShape(batch=batch, block=ctx.C, cache_len=L)).total
    ep = ctx.pass_cost(cost.PassShape(batch=batch, block=ctx.C, cache_len=L, path="epoch", live_frac=lp.live,
                                      fresh_frac=lp.fresh,
                                      support_frac=min(1.0, 1 - (1 - 0.16) ** batch))).total
    return dense / ep


def predict(p: Point, params: GpuParams) -> Prediction:
    """The model's value of a point's metric (in the metric's unit), or why it cannot give one."""
    try:
        ctx = _context(p, params)
        v = _predict(ctx)
        return Prediction(v, assumptions=list(dict.fromkeys(ctx.notes)))
    except CannotPredict as e:
        return Prediction(None, reason=str(e))


def _predict(ctx: _Ctx) -> float:
    p, m = ctx.p, ctx.p.metric
    B = p.workload.batch or p.workload.concurrency or 1
    layout, _ = _layout(p)
    if m == "pass_ms":
        if p.decoding.schedule == "flowblock":
            return 1e3 * _flowblock_pass(ctx, B)
        return 1e3 * _pass(ctx, B, layout).total
    if m == "r":
        base = _pass(ctx, B, "native").total
        if p.decoding.schedule == "flowblock":
            return _flowblock_pass(ctx, B) / base
        if p.decoding.schedule == "native-2c":
            return _pass(ctx, B, "native", block=2 * ctx.C).total / base
        return _pass(ctx, B, layout).total / base
    if m == "moe_share":
        return _pass(ctx, B, layout).moe_share
    if m == "canvas_ms":
        return 1e3 * passes_per_block(ctx) * _pass(ctx, B, layout).total
    if m == "moe_layer_ms":
        M = p.workload.local_tokens
        if M is None:
            raise CannotPredict("needs the tokens one rank's MoE layer sees (workload.local_tokens)")
        rows = M * max(ctx.par.ep, 1)
        par = cost.Parallel(1, ctx.par.ep, max(ctx.par.ep, 1))
        c = cost.pass_cost(ctx.cfg, cost.PassShape(batch=1, block=rows, cache_len=0.0), ctx.hw, par, ctx.cal,
                           dtype=ctx.prec[0], wbytes=ctx.prec[1], expert_dtype=ctx.prec[2], expert_wbytes=ctx.prec[3])
        return 1e3 * c.moe / len(ctx.cfg.moe_layers)
    if m in ("ttft_ms", "tpot_ms", "request_ms", "tps_per_request", "output_tps"):
        ttft, dec, y = _request_s(ctx, B)
        if m == "ttft_ms":
            return 1e3 * ttft
        if m == "tpot_ms":
            return 1e3 * dec / max(1.0, y - 1.0)
        if m == "request_ms":
            return 1e3 * (ttft + dec)
        return y / (ttft + dec) * (B if m == "output_tps" else 1)
    if m == "speedup_vs_baseline":
        return _speedup(ctx, B)
    if m == "p95_equivalent_itl_ms":
        return 1e3 * _serving_itl(ctx)
    raise CannotPredict(f"metric {m!r} is not modelled")


def _flowblock_pass(ctx: _Ctx, B: int) -> float:
    s = ctx.p.decoding.paired_share
    if s is None:
        raise CannotPredict("FlowBlock needs the share of paired passes (decoding.paired_share)")
    return (1 - s) * _pass(ctx, B, "native").total + s * _pass(ctx, B, "oba").total


def error(predicted: float, p: Point) -> float:
    """predicted / published − 1; for a range 0 inside it, else against the nearer end."""
    lo, hi = p.low_high
    if lo <= predicted <= hi:
        return 0.0
    ref = lo if predicted < lo else hi
    return predicted / ref - 1.0


def log_residual(predicted: float, p: Point) -> float:
    lo, hi = p.low_high
    if not (predicted > 0 and math.isfinite(predicted)):
        return 10.0
    if lo <= predicted <= hi:
        return 0.0
    return math.log(predicted / (lo if predicted < lo else hi))


# ---- the fit ------------------------------------------------------------------------------------------------------

@dataclass
class FitResult:
    params: GpuParams
    residuals: dict                      # calibration id -> log residual
    determined_by: dict                  # parameter -> [calibration ids]
    ids: list
    cost: float
    message: str

    keys: list = field(default_factory=list)   # what identifies each fitted point: id, model, hardware, metric, value
    excluded: dict = field(default_factory=dict)   # calibration points the model cannot predict: id -> why

    def as_dict(self) -> dict:
        return dict(values=self.params.values, determined_by=self.determined_by, calibration=self.ids,
                    calibration_points=self.keys, residuals=self.residuals, cost=self.cost, message=self.message,
                    excluded=self.excluded)


def _vector_to_params(x: np.ndarray, names: list) -> GpuParams:
    return GpuParams({n: float(math.exp(v)) for n, v in zip(names, x)})


def fit(points: list, names: list | None = None) -> FitResult:
    """Least squares in log space over the calibration points (module docstring)."""
    from scipy.optimize import least_squares
    names = list(names or PARAMS)
    start = _vector_to_params(np.log([PARAMS[n][4] for n in names]), names)
    cal_pts, excluded = [], {}
    for p in points:
        if p.role != "calibration":
            continue
        pr = predict(p, start)
        if pr.value is None:        # what cannot be predicted cannot be fitted on: said, not silently dropped
            excluded[p.id] = pr.reason
        else:
            cal_pts.append(p)
    if not cal_pts:
        raise ValueError("fit: no calibration point the model can predict (role: calibration)"
                         + (f"; not predictable: {excluded}" if excluded else ""))
    lo = np.log([PARAMS[n][2] for n in names])
    hi = np.log([PARAMS[n][3] for n in names])
    x0 = np.log([PARAMS[n][4] for n in names])

    def resid(x):
        prm = _vector_to_params(x, names)
        out = []
        for p in cal_pts:
            pr = predict(p, prm)
            out.append(10.0 if pr.value is None else log_residual(pr.value, p))
        return np.asarray(out)

    best = None
    for start in (x0, 0.5 * (lo + hi)):
        r = least_squares(resid, start, bounds=(lo, hi), x_scale=1.0, diff_step=1e-3, max_nfev=400)
        if best is None or r.cost < best.cost:
            best = r
    prm = _vector_to_params(best.x, names)
    res = resid(best.x)
    # which points determine each value: |Δ log prediction| > 1% when the value moves by 10%
    det = {}
    base = {p.id: predict(p, prm).value for p in cal_pts}
    for i, n in enumerate(names):
        x = best.x.copy()
        x[i] += math.log(1.1)
        moved = _vector_to_params(x, names)
        ids = []
        for p in cal_pts:
            v0, v1 = base[p.id], predict(p, moved).value
            if v0 and v1 and abs(math.log(v1 / v0)) > 0.01:
                ids.append(p.id)
        det[n] = ids
    return FitResult(prm, {p.id: float(r) for p, r in zip(cal_pts, res)}, det, [p.id for p in cal_pts],
                     float(best.cost), str(best.message), [point_key(p) for p in cal_pts], excluded)


def point_key(p: Point) -> list:
    """What identifies a measurement across files: id, model, hardware, metric and published value."""
    return [p.id, p.model, p.hardware, p.metric, list(p.value) if isinstance(p.value, tuple) else p.value]


# ---- the stored fit -------------------------------------------------------------------------------------------------

def save_fit(res: FitResult, path: str = FIT_PATH, source: str = "dblock/simulator/data/published_gpu.json") -> None:
    """Write the fitted values (all or nothing: a temporary file renamed over the old one)."""
    d = dict(about="The GPU cost model's fitted values (dblock/simulator/gpufit.py), written by `dblock simulate "
                   "calibrate --published --write`; a test re-runs the fit and checks these equal it.",
             data=source, **res.as_dict(),
             fixed={f"{k or 'shared'}.{fld}": dict(value=v, why=why) for (k, fld), (v, why) in FIXED.items()})
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def load_fit(path: str = FIT_PATH) -> tuple[GpuParams, dict]:
    """The stored fit: its parameters and the whole record (calibration ids, what determines each value)."""
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    vals = d["values"]
    missing = [k for k in PARAMS if k not in vals]
    if missing:
        raise ValueError(f"{path}: no fitted value for {', '.join(missing)} (re-run `dblock simulate calibrate "
                         "--published --write`)")
    return GpuParams({k: float(vals[k]) for k in PARAMS}), d


_STORED: dict = {}


def stored() -> GpuParams:
    """The stored fit, read once."""
    if "p" not in _STORED:
        _STORED["p"] = load_fit()[0]
    return _STORED["p"]


def calibration(klass: str = "engine") -> cost.Calibration:
    """The fitted `Calibration` of a serving class (what `--calibration published` uses)."""
    cal = stored().cal(klass)
    if cal is None:
        raise ValueError(f"serving class {klass!r}: no fitted values (allowed: {', '.join(CLASSES)})")
    return cal


def fit_lines(res: FitResult) -> list:
    """Every fitted value with the calibration points that determine it, then the held values and why."""
    out = [f"fitted on {len(res.ids)} calibration points ({', '.join(res.ids)}); least squares in log space, "
           f"cost {res.cost:.4f}"]
    for pid, why in res.excluded.items():
        out.append(f"  calibration point {pid} not fitted on: it cannot be predicted ({why})")
    for name, v in res.params.values.items():
        unit = "s" if name.endswith("_s") else ""
        det = ", ".join(res.determined_by[name]) or "none (its bound)"
        out.append(f"  {name:<24} {v:.4g}{' ' + unit if unit else ''}   determined by {det}")
    out.append("held (no calibration point determines them):")
    for (k, fld), (v, why) in FIXED.items():
        out.append(f"  {(k or 'shared') + '.' + fld:<24} {'table' if v is None else v}   {why}")
    return out


# ---- validation rows ------------------------------------------------------------------------------------------------

def rows(pf: PublishedFile, params: GpuParams, fitted: list | None = None) -> list:
    """One row per point: id, metric, published, predicted, error, role — `fit` when the point is one the fit was
    made on (same id, model, hardware, metric and value: `fitted`, the fit's `calibration_points`), else
    `held-out` (a point its file marks calibration but the fit did not see says so)."""
    keys = [json.dumps(k) for k in (fitted or [])]
    out = []
    for p in pf.points:
        pr = predict(p, params)
        in_fit = json.dumps(point_key(p)) in keys
        role = "fit" if in_fit else ("held-out (marked calibration, not in this fit)" if p.role == "calibration"
                                     else "held-out")
        pub = list(p.value) if isinstance(p.value, tuple) else p.value
        row = dict(id=p.id, metric=p.metric, model=p.model, hardware=p.hardware, serving_class=p.klass,
                   published=pub, predicted=pr.value, error=None if pr.value is None else error(pr.value, p),
                   role=role, assumptions=pr.assumptions, source=p.source)
        if pr.value is None:
            row["not_predicted"] = pr.reason
        out.append(row)
    return out


def summary(rs: list) -> dict:
    def stats(sel):
        e = [abs(r["error"]) for r in sel if r["error"] is not None and math.isfinite(r["error"])]
        if not e:
            return dict(n=0, median_abs_error=None, max_abs_error=None, beyond_2x=[])
        beyond = [r["id"] for r in sel if r["error"] is not None and not (0.5 <= 1 + r["error"] <= 2.0)]
        return dict(n=len(e), median_abs_error=float(np.median(e)), max_abs_error=float(max(e)), beyond_2x=beyond)
    return dict(fit=stats([r for r in rs if r["role"] == "fit"]),
                held_out=stats([r for r in rs if r["role"] != "fit"]),
                not_predicted=[r["id"] for r in rs if r["predicted"] is None])
