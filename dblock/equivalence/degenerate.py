"""Degenerate settings that must be exact (docs/algorithms.md §5), as checks `dblock verify --check NAME` runs.

  full-compute   the `full_compute` configuration (support = all experts, M_C = 1) gives the reference's tokens
                 exactly (fp32), and on the teacher-forced shadow every decision agrees
  paired-block   under the OBA mask the current block's logits in a paired pass [current ‖ warm-up] equal the same
                 block decoded alone — the warm-up half changes nothing upstream of the current block (fp64,
                 |Δ| <= 1e-10). Every OBA pass of a real decode is checked by recomputing the current block alone on
                 the same cache. llada2_moe and diffusion_gemma (llada_moe has no block-causal structure to pair).
                 The check probes whether the fp64 model really computes in fp64: the references downcast some ops
                 to fp32 (attention probabilities, norms, router), where the paired pass and the block alone differ
                 by fp32 shape effects (a softmax over more, masked, keys); then the tolerance is fp32 rounding and
                 the message names the downcasting ops.
  world-size     FreshLane with expert parallelism (`dblock.optimized.ep`, gloo ranks on this machine) at world
                 sizes W gives the same tokens as world size 1 and the same logits within fp32 tolerance (partial
                 sums are added in rank order, so not bitwise); world size 1 (the EP code path in one process)
                 also against the plain single-process executor. Until `dblock.optimized.ep` exists the check
                 reports "expert parallelism not available".

Each check returns {"ok": True | False | None (not applicable), "message": str, ...numbers}.
"""
from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace

import torch

from dblock.forward import Forward, StepInput

PAIRED_TOL = 1e-10
PAIRED_TOL_FP32_OPS = 1e-5  # relative to max|logit|: when the fp64 model still computes some ops in fp32
WORLD_TOL = 1e-4      # fp32 logits, different summation order of expert partial sums


# ---------------------------------------------------------------------------------------------------------------
# full_compute ≡ reference
# ---------------------------------------------------------------------------------------------------------------

def check_full_compute(model, prompts, dec, schedule="native", batch_size=None) -> dict:
    from dblock.equivalence.audit import audited_epoch_forward
    from dblock.equivalence.shadow import ShadowForward, shadow_generate
    from dblock.optimized.executor import epoch_forward
    from dblock.decoding.generate import generate, reference_forward

    ref = generate(model, prompts, dec, schedule, batch_size=batch_size)
    fc = generate(epoch_forward(model, "full_compute"), prompts, dec, schedule, batch_size=batch_size)
    same = sum(a == b for a, b in zip(ref.tokens, fc.tokens))
    sh = ShadowForward(audited_epoch_forward(model, "full_compute"), reference_forward(model))
    shadow_generate(sh, prompts, dec, schedule, batch_size)
    rows = [a for r in sh.rows if r.get("decision", True) for a in r["agree"]]
    agree = sum(rows) / len(rows) if rows else 1.0
    ok = same == len(prompts) and agree == 1.0 and not sh.violations
    return {"ok": ok, "identical": same, "requests": len(prompts), "decision_agreement": agree,
            "max_abs_logits": sh.logits.max, "F_reference": sum(c.F for c in ref.counters),
            "F_full_compute": sum(c.F for c in fc.counters),
            "message": f"full_compute tokens identical to the reference for {same}/{len(prompts)} requests; "
                       f"shadow decision agreement {100 * agree:.2f}%, max|Δlogits| {sh.logits.max:.3g}"}


# ---------------------------------------------------------------------------------------------------------------
# paired-block proposition
# ---------------------------------------------------------------------------------------------------------------

class PairedBlockCheck(Forward):
    """Wraps a reference Forward; on every paired pass also runs the current block alone and records |Δ|."""

    name = "paired-block-check"

    def __init__(self, inner: Forward):
        self.inner, self.config = inner, inner.config
        self.max_abs = 0.0
        self.max_logit = 0.0
        self.passes = 0
        self.rows = 0
        self.worst = None
        self.fp32_ops = None          # ops that turned float64 tensors into float32 (probed on the first call)

    def new_cache(self):
        return self.inner.new_cache()

    def append(self, items):
        self.inner.append(items)

    def end_block(self, request, block):
        self.inner.end_block(request, block)

    def end_request(self, request):
        self.inner.end_request(request)

    @torch.no_grad()
    def denoise(self, items: list[StepInput]):
        if self.fp32_ops is None:
            with _Downcasts() as probe:
                out = self.inner.denoise(items)
            self.fp32_ops = dict(probe.ops)
        else:
            out = self.inner.denoise(items)
        solo, where = [], []
        for b, it in enumerate(items):
            roles = [s.role for s in it.segments]
            if "current" not in roles or len(roles) < 2:
                continue
            c = roles.index("current")
            if c == len(roles) - 1 or bool(it.visibility[:c + 1, c + 1:].any()):
                continue     # nothing after the current block, or it sees it (Dense Mask): not the proposition
            solo.append(replace(it, segments=it.segments[:c + 1], visibility=it.visibility[:c + 1, :c + 1].clone()))
            where.append((b, c, it))
        if solo:
            alone = self.inner.denoise(solo)
            for (b, c, it), got in zip(where, alone):
                paired, single = out[b][c], got[c]
                if paired.shape != single.shape:
                    raise RuntimeError("paired-block check: the current block's live rows differ between calls")
                if paired.numel():
                    self.max_logit = max(self.max_logit, float(single.double().abs().max()))
                    d = float((paired.double() - single.double()).abs().max())
                    if d > self.max_abs:
                        self.max_abs = d
                        self.worst = {"request": it.request, "block": it.segments[c].block, "delta": d}
                self.passes += 1
                self.rows += paired.shape[0]
        return out


def check_paired_block(model, prompts, dec, batch_size=None) -> dict:
    from dblock.decoding.generate import generate, reference_forward

    fam = model.config.family
    if fam == "llada_moe":
        return {"ok": None, "message": "llada_moe decodes one bidirectional sequence: no paired pass exists"}
    m64 = copy.deepcopy(model).to(torch.float64)
    chk = PairedBlockCheck(reference_forward(m64))
    generate(chk, prompts, dec, "oba", batch_size=batch_size)
    if chk.passes == 0:
        return {"ok": None, "message": "no paired pass happened (every request fits one block)", "passes": 0}
    tol, note = PAIRED_TOL, ""
    if chk.fp32_ops:
        # The reference itself computes some ops in fp32 even for an fp64 model (attention probabilities, norms,
        # the router): the paired pass and the block alone then differ by fp32 shape effects (softmax over a
        # different number of keys), not by anything the warm-up half contributes. Exactness is unreachable
        # there; hold the check to fp32 rounding and say why.
        tol = PAIRED_TOL_FP32_OPS * max(1.0, chk.max_logit)
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(chk.fp32_ops.items()))
        note = (f"; the float64 reference downcasts to float32 in: {ops} -- float64 exactness needs those to "
                f"promote instead, so the tolerance is fp32 rounding ({tol:.2g})")
    ok = chk.max_abs <= tol
    return {"ok": ok, "passes": chk.passes, "rows": chk.rows, "max_abs": chk.max_abs, "tolerance": tol,
            "worst": chk.worst, "dtype": "float64", "fp32_ops": chk.fp32_ops,
            "message": f"{chk.passes} OBA paired passes in float64: current block's logits vs the block alone "
                       f"max|Δ| {chk.max_abs:.3g} (tolerance {tol:.2g}){note}"}


class _Downcasts(torch.overrides.TorchFunctionMode):
    """Counts torch calls that take a float64 tensor and return a float32 one (where an fp64 model is not fp64)."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            self.ops[name] = self.ops.get(name, 0) + 1
        return out


# ---------------------------------------------------------------------------------------------------------------
# world-size invariance (expert parallelism)
# ---------------------------------------------------------------------------------------------------------------

def ep_available() -> bool:
    return importlib.util.find_spec("dblock.optimized.ep") is not None


class _Recorder(Forward):
    """Records the logits every denoising call returns (rank 0's view)."""

    def __init__(self, inner):
        self.inner, self.config, self.logits = inner, inner.config, []

    def new_cache(self):
        return self.inner.new_cache()

    def append(self, items):
        self.inner.append(items)

    def end_block(self, request, block):
        self.inner.end_block(request, block)

    def end_request(self, request):
        self.inner.end_request(request)

    def denoise(self, items):
        out = self.inner.denoise(items)
        self.logits.append([[t.detach().cpu() for t in seg] for seg in out])
        return out


def world_size_worker(rank: int, world: int, cfg: dict) -> dict:
    """One rank of the world-size check: decode with the epoch executor over an EP dispatcher (module level: the
    ranks are spawned)."""
    import dblock
    from dblock.decoding.params import DecodeConfig
    from dblock.optimized.ep import EPDispatcher
    from dblock.optimized.executor import epoch_forward
    from dblock.decoding.generate import generate

    model = dblock.load(cfg["model"], dtype=cfg.get("dtype", "float32"))
    disp = None if cfg.get("local") else EPDispatcher(model.config.num_experts, timeout_s=cfg.get("timeout_s", 60.0))
    rec = _Recorder(epoch_forward(model, cfg["epoch_config"], dispatcher=disp, **cfg.get("epoch_kw", {})))
    try:
        res = generate(rec, cfg["prompts"], DecodeConfig(**cfg["dec"]), cfg["schedule"])
    finally:
        if disp is not None:
            disp.close()
    return {"tokens": res.tokens, "logits": rec.logits if rank == 0 else None}


def _compare_logits(a, b):
    worst = 0.0
    for pa, pb in zip(a, b):
        for sa, sb in zip(pa, pb):
            for ta, tb in zip(sa, sb):
                if ta.shape != tb.shape:
                    return float("inf")
                if ta.numel():
                    worst = max(worst, float((ta.double() - tb.double()).abs().max()))
    return worst


def check_world_sizes(model_path, prompts, dec, world_sizes=(1, 2, 4), epoch_config="epoch", schedule="native",
                      epoch_kw=None, dtype="float32", timeout_s=120.0) -> dict:
    """Decode at every world size (gloo ranks) and compare with world size 1."""
    if not ep_available():
        return {"ok": None, "message": "expert parallelism not available (dblock.optimized.ep does not exist yet)",
                "world_sizes": list(world_sizes)}
    if not model_path:
        return {"ok": None, "message": "the world-size check needs a model folder (ranks load it themselves)"}
    from dataclasses import asdict

    from dblock.optimized.ep import run_distributed
    kw = {k: v for k, v in (epoch_kw or {}).items() if k != "dispatcher"}   # each rank builds its own
    cfg = {"model": model_path, "dtype": dtype, "prompts": [list(p) for p in prompts], "dec": asdict(dec),
           "schedule": schedule, "epoch_config": epoch_config, "epoch_kw": kw, "timeout_s": timeout_s}
    sizes = sorted(set([1] + [int(w) for w in world_sizes]))
    results = {"local": world_size_worker(0, 1, {**cfg, "local": True})}   # the single-process executor
    for W in sizes:
        if W == 1:
            results[W] = world_size_worker(0, 1, cfg)        # the same code path in this process
        else:
            results[W] = run_distributed(world_size_worker, W, args=(cfg,), timeout_s=timeout_s,
                                         join_timeout_s=max(600.0, 4 * timeout_s))[0]
    base = results[1]
    per = {}
    ok = True
    for W in ["local"] + sizes[1:]:
        r = results[W]
        same = sum(a == b for a, b in zip(base["tokens"], r["tokens"]))
        d = _compare_logits(base["logits"], r["logits"]) if same == len(prompts) else None
        good = same == len(prompts) and d is not None and d <= WORLD_TOL
        ok &= good
        per[W] = {"identical": same, "max_abs_logits": d, "ok": good}
    msg = "; ".join(f"{'W=' + str(W) if W != 'local' else 'single-process executor'}: tokens identical "
                    f"{v['identical']}/{len(prompts)}, max|Δlogits| "
                    f"{'-' if v['max_abs_logits'] is None else format(v['max_abs_logits'], '.3g')}"
                    for W, v in per.items()) or "only world size 1 requested"
    return {"ok": ok, "world_sizes": sizes, "per_world_size": per, "tolerance": WORLD_TOL,
            "message": f"expert-parallel FreshLane ({epoch_config}) against world size 1: {msg}"}
