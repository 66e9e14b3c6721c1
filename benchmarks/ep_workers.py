"""Rank workers of the expert-parallel benchmarks (`benchmarks/ep_cpu.py`; the same function runs on GPUs with
`run_distributed(..., backend="nccl")` and cfg["device"] = "cuda").

`run_distributed` spawns its ranks, so a worker must be a module-level function of an importable module: this one
(`benchmarks` is a package; the scripts put the repository root on sys.path, and spawned ranks inherit it).
"""
from __future__ import annotations

import io
import json

import torch


def bench_worker(rank: int, world: int, cfg: dict) -> dict:
    """Decode the same prompts with FreshLane and dense dispatch on this rank, alternating, `repeats` times.

    cfg: model (a folder, a bundled name, or {"family": ..., "seed", "head_scale", **make_tiny_model overrides}),
    device ("cpu"/"cuda"),
    prompts (lists of ids), max_new_tokens, schedule, epoch_config, repeats, timeout_s. Returns, per mode, the
    denoising wall times of every repeat, the MoE-region time, the comm dicts of every denoise pass (rank 0's
    view: all ranks' counts), and the tokens (the two modes must agree).
    """
    from dblock.decoding.generate import generate
    from dblock.decoding.params import DecodeConfig
    from dblock.optimized.ep import MODES, EPDispatcher
    from dblock.optimized.executor import epoch_forward
    from dblock.trace import TraceWriter

    device = cfg.get("device", "cpu")
    if str(device).startswith("cuda"):
        device = f"cuda:{torch.cuda.current_device()}"
    spec = cfg["model"]
    if isinstance(spec, dict):
        from dblock.tiny import make_tiny_model
        spec = dict(spec)
        head_scale = spec.pop("head_scale", None)     # < 1: a less confident random model, more passes per block
        model = make_tiny_model(spec.pop("family"), seed=spec.pop("seed", 0), **spec).to(device)
        if head_scale is not None:
            with torch.no_grad():
                model.lm_head.weight.mul_(head_scale)
    else:
        import dblock
        model = dblock.load(spec, dtype=cfg.get("dtype", "float32" if device == "cpu" else None), device=device)
    dec = DecodeConfig(max_new_tokens=cfg.get("max_new_tokens", 32))
    out = {m: {"den_s": [], "moe_s": [], "comm": None, "tokens": None} for m in MODES}
    for rep in range(cfg.get("repeats", 3)):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        for mode in order:
            disp = EPDispatcher(model.config.num_experts, mode=mode, timeout_s=cfg.get("timeout_s"))
            fwd = epoch_forward(model, cfg.get("epoch_config", "epoch"), dispatcher=disp)
            buf = io.StringIO()
            res = generate(fwd, cfg["prompts"], dec, cfg.get("schedule", "native"), trace=TraceWriter(buf))
            disp.close()
            evs = [json.loads(line) for line in buf.getvalue().splitlines()]
            den = [e for e in evs if e["event"] == "pass" and e["kind"] == "denoise"]
            out[mode]["den_s"].append(res.times.den_s)
            out[mode]["moe_s"].append(sum(e.get("moe_s", 0.0) for e in den))
            out[mode]["comm_s"] = out[mode].get("comm_s", []) + [sum(e["comm"]["comm_s"] for e in den)]
            if out[mode]["comm"] is None:
                out[mode]["comm"] = [e["comm"] for e in den]
                out[mode]["tokens"] = res.tokens
    return out
