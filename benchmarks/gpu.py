"""Triton kernels on a CUDA GPU: each checked against its golden model in bf16 and timed against torch baselines,
then dense vs epoch at batch 32-512 on a random LLaDA2.0-mini-shaped config. One table, with the card's name.

    python benchmarks/gpu.py                       # on a GPU: the full run (budget: under 5 minutes on an H100/H200)
    python benchmarks/gpu.py --json out.json       # also write the rows as JSON
    python benchmarks/gpu.py --cpu-check           # no GPU needed: every check at tiny shapes in fp32 through the
                                                   # Triton interpreter (no meaningful times); tests run this
    python benchmarks/gpu.py --compile-only        # no GPU needed: compile every kernel variant the GPU run
                                                   # launches for sm_90 (through ptxas) and report registers,
                                                   # shared memory and spills (cuobjdump) per kernel

Sections (every row says what was compared and how it went; a failing row does not stop the run):
  kernels   route, align, grouped SwiGLU MLP (and its GeGLU variant, DiffusionGemma's experts), compact, merge, attention (Native and OBA-paired layouts over a
            prefix cache), LM head of live rows. Check: vs the `*_torch` golden model (bf16 inputs upcast to fp32;
            atol 2e-2, integers exact, routing ids as per-row sets). Times: medians of `triton.testing.do_bench`
            for the kernel and its torch baselines (`F.grouped_mm`, SDPA with a dense mask, compiled
            FlexAttention with the same block mask, torch indexing, the golden models themselves).
  moe       one MoE layer (routed experts only; the shared expert is the same on both sides) at batch B requests x
            one block of C = 32 rows: dense (every row, all experts: reference loop and grouped_mm) vs epoch (half
            the rows fresh, each request's block restricted to a support of 4K experts, Triton route + grouped MLP
            + merge with cached rows).
  executor  a whole denoising pass of LladaReference (dense) vs the Epoch executor with torch stages and with
            `use_triton`, on the same StepInputs (a 256-token cached prefix and one half-decoded block each),
            after warm-up passes so the epoch plans run their hot path.
Medians of repeats; ratios within one run. Results go to BENCHMARKS.md with this command line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# LLaDA2.0-mini (docs/models.md): the layer shapes are the real ones; only the depth is
# cut (--layers) so that building random weights and the executor section fit the time budget.
MINI = dict(vocab_size=157184, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
            intermediate_size=5120, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
            num_shared_experts=1, first_k_dense_replace=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
            partial_rotary_factor=0.5, rope_theta=600000.0, block_size=32, mask_token_id=156895,
            eos_token_id=156892, pad_token_id=156892, max_position_embeddings=32768)

# The --cpu-check shapes: small enough for the interpreter (a few dozen programs per launch)
TINY = dict(F=37, E=16, K=4, G=4, TG=2, H=64, I=32, N=4, KV=2, D=16, C=8, B=3, Lc=16, V=96)
GPU = dict(F=4096, E=256, K=8, G=8, TG=4, H=2048, I=512, N=16, KV=4, D=128, C=32, B=64, Lc=512, V=157184)


class Bench:
    def __init__(self, device, dtype, timed: bool, deadline: float):
        import torch
        self.torch = torch
        self.device, self.dtype, self.timed = device, dtype, timed
        self.t0, self.deadline = time.time(), deadline
        self.rows: list[dict] = []

    def left(self) -> float:
        return self.deadline - (time.time() - self.t0)

    def ms(self, fn):
        """Median milliseconds of fn: do_bench on a GPU; 3 wall-clock runs on a CPU (--cpu-check --cpu-timed, which
        only exercises the timing code paths); None when untimed."""
        if not self.timed:
            return None
        if self.device.type != "cuda":
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                ts.append(1000 * (time.perf_counter() - t))
            return statistics.median(ts)
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))

    def row(self, section, op, shape, check, ok, triton_ms=None, baselines=None):
        self.rows.append(dict(section=section, op=op, shape=shape, check=check, ok=bool(ok), triton_ms=triton_ms,
                              baselines=baselines or {}))

    def guard(self, section, op, fn):
        """Run one check; an exception becomes a failed row with its one-line message."""
        if self.left() < 0:
            self.row(section, op, "-", "skipped: time budget", True)
            return
        try:
            fn()
        except Exception as e:          # noqa: BLE001 - a benchmark row, not control flow
            msg = (str(e).splitlines() or [type(e).__name__])[0][:120]
            self.row(section, op, "-", f"ERROR {type(e).__name__}: {msg}", False)
            if os.environ.get("DBLOCK_DEBUG"):
                traceback.print_exc()


def close(a, b, atol):
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return err <= atol, f"max|err| {err:.2e} (atol {atol:g})"


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------

def kernel_rows(b: Bench, S: dict) -> None:
    import torch
    import torch.nn.functional as F_
    from dblock.kernels.align import align_torch, align_triton
    from dblock.kernels.attention import attention_torch, attention_triton, tile_schedule, tile_schedule_torch
    from dblock.kernels.compact import compact_triton, merge_torch, merge_triton, positions_of
    from dblock.kernels.grouped_mlp import grouped_mlp_grouped_mm, grouped_mlp_torch, grouped_mlp_triton
    from dblock.kernels.lm_head import lm_head_torch, lm_head_triton
    from dblock.kernels.route import route_torch, route_triton

    dev, dt = b.device, b.dtype
    atol = 2e-2 if dt == torch.bfloat16 else 1e-4
    g = torch.Generator(device="cpu").manual_seed(0)
    F, E, K, H, I = S["F"], S["E"], S["K"], S["H"], S["I"]

    def rn(*shape, scale=1.0, dtype=None):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype or dt)

    # route: fp32 logits, each row's support a random quarter of the experts
    logits = rn(F, E, scale=2.0, dtype=torch.float32)
    bias = rn(E, scale=0.1, dtype=torch.float32)
    allowed = (torch.rand(F, E, generator=g) < 0.25).to(dev)
    rkw = dict(top_k=K, sigmoid=True, n_group=S["G"], topk_group=S["TG"], renormalize=True, scale=2.5)
    ids, w = route_triton(logits, bias, allowed, **rkw)

    def route():
        ids_r, w_r = route_torch(logits, bias, allowed, **rkw)
        sa, oa = ids.sort(1)
        sb, ob = ids_r.sort(1)
        bad = int((sa != sb).any(1).sum())
        ok_w, msg = close(w.gather(1, oa), w_r.gather(1, ob), 1e-5)
        b.row("kernels", "route", f"F{F} E{E} K{K} G{S['G']}/{S['TG']}", f"id rows differing {bad}; w {msg}",
              bad <= F // 1000 and ok_w, b.ms(lambda: route_triton(logits, bias, allowed, **rkw)),
              {"route_torch": b.ms(lambda: route_torch(logits, bias, allowed, **rkw))})
    b.guard("kernels", "route", route)

    # align
    ids_v = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(F)]).to(dev)
    ids_v[torch.rand(F, K, generator=g).to(dev) < 0.05] = -1        # some slots with no expert
    BM = 64 if F * K > 32 * E else 16

    def align():
        got, ref = align_triton(ids_v, E, BM), align_torch(ids_v, E, BM)
        ok = all(torch.equal(x, y) for x, y in zip(got, ref))
        b.row("kernels", "align", f"P{F * K} E{E} BM{BM}", "exact" if ok else "MISMATCH", ok,
              b.ms(lambda: align_triton(ids_v, E, BM)), {"align_torch": b.ms(lambda: align_torch(ids_v, E, BM))})
    b.guard("kernels", "align", align)

    # grouped SwiGLU (vLLM's test scale: randn / 10)
    x = rn(F, H, scale=0.1)
    wr = torch.rand(F, K, generator=g).to(dev)
    wg, wu, wd = rn(E, I, H, scale=0.1), rn(E, I, H, scale=0.1), rn(E, H, I, scale=0.1)

    def mlp():
        y = grouped_mlp_triton(x, ids_v, wr, wg, wu, wd)
        ref = grouped_mlp_torch(x.float(), ids_v, wr, wg.float(), wu.float(), wd.float())
        ok, msg = close(y, ref, atol)
        base = {"F.grouped_mm": b.ms(lambda: grouped_mlp_grouped_mm(x, ids_v, wr, wg, wu, wd))} \
            if hasattr(F_, "grouped_mm") else {}
        if b.timed and b.left() > 60:
            base["per-expert loop"] = b.ms(lambda: grouped_mlp_torch(x, ids_v, wr, wg, wu, wd))
        b.row("kernels", "grouped_mlp", f"F{F} K{K} E{E} H{H} I{I}", msg, ok,
              b.ms(lambda: grouped_mlp_triton(x, ids_v, wr, wg, wu, wd)), base)
    b.guard("kernels", "grouped_mlp", mlp)

    # the same kernel as DiffusionGemma's GeGLU experts: the tanh GELU, gate and up as views of one (E, 2I, H) tensor
    gu = torch.cat([wg, wu], dim=1)

    def geglu():
        from dblock.optimized.freshlane import grouped_geglu_torch
        y = grouped_mlp_triton(x, ids_v, wr, gu[:, :I], gu[:, I:], wd, activation="gelu_tanh")
        ref = grouped_mlp_torch(x.float(), ids_v, wr, wg.float(), wu.float(), wd.float(), activation="gelu_tanh")
        ok, msg = close(y, ref, atol)
        b.row("kernels", "grouped_mlp geglu", f"F{F} K{K} E{E} H{H} I{I}", msg, ok,
              b.ms(lambda: grouped_mlp_triton(x, ids_v, wr, gu[:, :I], gu[:, I:], wd, activation="gelu_tanh")),
              {"grouped_geglu_torch": b.ms(lambda: grouped_geglu_torch(x, ids_v, wr, gu, wd))})
    b.guard("kernels", "grouped_mlp geglu", geglu)

    # compact and merge (half the rows fresh, a quarter served from a cache buffer)
    T = 4 * F
    xt = rn(T, H)
    perm = torch.randperm(T, generator=g).to(dev)
    idx = perm[: T // 2].sort().values
    cache = rn(T // 4, H)
    cpos = torch.full((T,), -1, dtype=torch.int32, device=dev)
    cpos[perm[T // 2: T // 2 + T // 4]] = torch.arange(T // 4, dtype=torch.int32, device=dev)
    fpos = positions_of(idx, T)
    yf = rn(idx.numel(), H)

    def compact():
        ok = torch.equal(compact_triton(xt, idx), xt[idx])
        b.row("kernels", "compact", f"T{T} F{idx.numel()} H{H}", "exact" if ok else "MISMATCH", ok,
              b.ms(lambda: compact_triton(xt, idx)), {"x[idx]": b.ms(lambda: xt[idx])})
    b.guard("kernels", "compact", compact)

    def merge():
        ok = torch.equal(merge_triton(yf, fpos, cache, cpos), merge_torch(yf, fpos, cache, cpos))

        def torch_merge():
            out = torch.zeros(T, H, dtype=yf.dtype, device=dev)
            out[idx] = yf
            c = cpos >= 0
            out[c] = cache[cpos[c].long()]
            return out
        b.row("kernels", "merge", f"T{T} H{H}", "exact" if ok else "MISMATCH", ok,
              b.ms(lambda: merge_triton(yf, fpos, cache, cpos)), {"index_put": b.ms(torch_merge)})
    b.guard("kernels", "merge", merge)

    # attention: B requests with a cache of Lc, Native [current] and OBA [current, warm-up]
    N, KV, D, C, B, Lc = S["N"], S["KV"], S["D"], S["C"], S["B"], S["Lc"]
    for name, segs, vis in (("attention native", [C], [[1]]), ("attention oba", [C, C], [[1, 0], [1, 1]])):
        def attn(name=name, segs=segs, vis=vis):
            L = sum(segs)
            vis_t = torch.tensor(vis, dtype=torch.bool)
            sched = tile_schedule([Lc] * B, [segs] * B, [vis_t] * B, C).to(dev)
            seg_id = torch.cat([torch.full((n,), i) for i, n in enumerate(segs)])
            mask = torch.zeros(B, L, Lc + L, dtype=torch.bool)
            mask[:, :, :Lc] = True
            mask[:, :, Lc:] = vis_t[seg_id[:, None], seg_id[None, :]]
            mask = mask.to(dev)
            q, k, v = rn(B, N, L, D), rn(B, KV, L, D), rn(B, KV, L, D)
            pk, pv = rn(B, KV, Lc, D), rn(B, KV, Lc, D)
            scale = 1 / math.sqrt(D)
            same = all(torch.equal(x.cpu(), y) for x, y in zip(
                (sched.kv_num_blocks, sched.full_kv_num_blocks), (lambda s: (s.kv_num_blocks, s.full_kv_num_blocks))(
                    tile_schedule_torch(mask.cpu(), C))))
            out = attention_triton(q, k, v, pk, pv, mask, sched, scale)
            ok, msg = close(out, attention_torch(q.float(), k.float(), v.float(), pk.float(), pv.float(), mask,
                                                 scale), atol)
            keys, vals = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            base = {}
            if b.timed:
                base["SDPA dense mask"] = b.ms(lambda: F_.scaled_dot_product_attention(
                    q, keys, vals, attn_mask=mask[:, None], scale=scale, enable_gqa=True))
                if b.left() > 90:
                    try:
                        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                        # Flex's own tile (128): its compiled kernel wants that, so it sees partial tiles here
                        bm = create_block_mask(lambda bb, h, qq, kv: mask[bb, qq, kv], B, 1, L, Lc + L, device=dev)
                        flex = torch.compile(flex_attention)
                        base["flex (compiled)"] = b.ms(lambda: flex(q, keys, vals, block_mask=bm, scale=scale,
                                                                    enable_gqa=True))
                    except Exception as e:      # noqa: BLE001
                        base["flex (compiled)"] = f"n/a: {type(e).__name__}"
            c = sched.counts()
            b.row("kernels", name, f"B{B} N{N}/{KV} D{D} Lc{Lc} L{L} tile{C}",
                  f"{msg}; schedule==mask's {same}; tiles full {c['full']} partial {c['partial']} "
                  f"skipped {c['skipped']}", ok and same,
                  b.ms(lambda: attention_triton(q, k, v, pk, pv, mask, sched, scale)), base)
        b.guard("kernels", name, attn)

    # LM head of the live rows of B blocks of C rows (half live)
    V = S["V"]

    def head():
        hid = rn(B * C, H)
        live = (torch.rand(B * C, generator=g) < 0.5).to(dev).nonzero(as_tuple=True)[0]
        nw, wv = rn(H, scale=0.1) + 1, rn(V, H, scale=1 / math.sqrt(H))
        out = lm_head_triton(hid, live, nw, wv, 1e-6)
        ok, msg = close(out, lm_head_torch(hid.float(), live, nw.float(), wv.float(), 1e-6), atol * 2)

        def torch_head():
            xx = hid[live].float()
            xx = (xx * torch.rsqrt(xx.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt) * nw
            return F_.linear(xx, wv).float()
        b.row("kernels", "lm_head", f"R{live.numel()} H{H} V{V}", msg, ok,
              b.ms(lambda: lm_head_triton(hid, live, nw, wv, 1e-6)),
              {"norm+linear (all rows)": b.ms(lambda: F_.linear(hid, wv)), "norm+linear (live)": b.ms(torch_head)})
    b.guard("kernels", "lm_head", head)


# ---------------------------------------------------------------------------------------------------------------
# dense vs epoch: one MoE layer, and whole executor passes
# ---------------------------------------------------------------------------------------------------------------

def moe_rows(b: Bench, cfg, batches, C) -> None:
    import torch
    from dblock.kernels.compact import merge_triton, positions_of
    from dblock.kernels.grouped_mlp import grouped_mlp_grouped_mm, grouped_mlp_torch, grouped_mlp_triton
    from dblock.kernels.route import route_args, route_torch, route_triton

    dev, dt = b.device, b.dtype
    E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(1)
    wg = (torch.randn(E, I, H, generator=g) / math.sqrt(H)).to(dev, dt)
    wu = (torch.randn(E, I, H, generator=g) / math.sqrt(H)).to(dev, dt)
    wd = (torch.randn(E, H, I, generator=g) / math.sqrt(I)).to(dev, dt)
    gate = (torch.randn(E, H, generator=g) / math.sqrt(H)).to(dev, torch.float32)
    bias = (0.05 * torch.randn(E, generator=g)).to(dev)
    rargs = route_args(cfg)
    for B in batches:
        def one(B=B):
            T = B * C
            x = torch.randn(T, H, generator=g).to(dev, dt)
            all_ok = torch.ones(T, E, dtype=torch.bool, device=dev)
            # each request's block: a support of min(E, 4K) experts; half its rows fresh
            sup = torch.zeros(B, E, dtype=torch.bool)
            for r in range(B):
                sup[r, torch.randperm(E, generator=g)[: min(E, 4 * K)]] = True
            allowed = sup.repeat_interleave(C, 0).to(dev)
            fresh = (torch.rand(T, generator=g) < 0.5).to(dev)
            idx = fresh.nonzero(as_tuple=True)[0]
            cache = torch.randn(T, H, generator=g).to(dev, dt)
            cpos = torch.where(fresh, -1, torch.arange(T, device=dev)).to(torch.int32)
            fpos = positions_of(idx, T)

            def dense_loop():
                ids, w = route_torch(x.float() @ gate.T, bias, all_ok, **rargs)
                return grouped_mlp_torch(x, ids, w, wg, wu, wd)

            def dense_mm():
                ids, w = route_torch(x.float() @ gate.T, bias, all_ok, **rargs)
                return grouped_mlp_grouped_mm(x, ids, w, wg, wu, wd)

            def epoch():
                xf = x[idx]
                ids, w = route_triton(xf.float() @ gate.T, bias, allowed[idx], **rargs)
                return merge_triton(grouped_mlp_triton(xf, ids, w, wg, wu, wd), fpos, cache, cpos)

            y = epoch()
            xf = x[idx].float()
            ids_r, w_r = route_torch(xf @ gate.T, bias, allowed[idx], **rargs)
            ok_f, msg = close(y[idx], grouped_mlp_torch(xf, ids_r, w_r, wg.float(), wu.float(), wd.float()),
                              2e-2 if dt == torch.bfloat16 else 1e-4)
            ok = ok_f and torch.equal(y[~fresh], cache[~fresh])
            base = {"dense grouped_mm": b.ms(dense_mm)}
            if b.timed and B <= 128 and b.left() > 60:
                base["dense loop (reference)"] = b.ms(dense_loop)
            if not b.timed:
                dense_mm()
                dense_loop()
            b.row("moe", f"MoE layer B={B}", f"T{T} fresh {idx.numel()} support {min(E, 4 * K)}/{E}",
                  f"fresh rows vs restricted golden: {msg}; served rows = cache", ok, b.ms(epoch), base)
        b.guard("moe", f"MoE layer B={B}", one)


def executor_rows(b: Bench, model, batches, prefix: int, passes: int) -> None:
    import torch
    from dblock.forward import Segment, StepInput, block_causal
    from dblock.optimized.executor import epoch_forward
    from dblock.reference.executor import LladaReference

    cfg = model.config
    C, M = cfg.block_size, cfg.mask_token_id
    dev = b.device
    for B in batches:
        def one(B=B):
            g = torch.Generator().manual_seed(B)
            dense = LladaReference(model)
            caches = [dense.new_cache() for _ in range(B)]
            nb = prefix // C
            pre = [StepInput(r, [Segment(k, torch.randint(0, M, (C,), generator=g), torch.arange(k * C, k * C + C),
                                         torch.zeros(C, dtype=torch.bool), torch.ones(C, dtype=torch.bool),
                                         role="prefix") for k in range(nb)], block_causal(nb), caches[r])
                   for r in range(B)] if nb else []
            if pre:
                dense.append(pre)
            items = []
            for r in range(B):
                tok = torch.randint(0, M, (C,), generator=g)
                tok[torch.rand(C, generator=g) < 0.5] = M
                items.append(StepInput(r, [Segment(nb, tok, torch.arange(nb * C, nb * C + C), tok == M, tok != M)],
                                       torch.ones(1, 1, dtype=torch.bool), caches[r]))

            last = {}

            def timed(fwd, n, key=None):
                ts = []
                for _ in range(n):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    out = fwd.denoise(items)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    ts.append(1000 * (time.perf_counter() - t))
                if key:
                    last[key] = torch.cat([z for per in out for z in per]).float().cpu()
                return ts

            res, errs = {}, []
            res["dense"] = statistics.median(timed(dense, 1 + passes)[1:])
            for name, tri in (("epoch (torch stages)", False), ("epoch (use_triton)", True)):
                try:
                    ts = timed(epoch_forward(model, "epoch", use_triton=tri), 1 + passes, name)   # pass 0: cold
                    res[name] = statistics.median(ts[1:])
                except Exception as e:          # noqa: BLE001
                    errs.append(f"{name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}")
            chk = "; ".join(errs)
            if len(last) == 2:
                a, c = last.values()
                chk = f"live logits, triton vs torch stages: max|diff| {(a - c).abs().max().item():.2e}"
            if not b.timed:
                res = {}
            b.row("executor", f"denoise pass B={B}", f"{B}x[{prefix} cached + {C}], {cfg.num_hidden_layers} layers",
                  chk, not errs, res.get("epoch (use_triton)"),
                  {k: v for k, v in res.items() if k != "epoch (use_triton)"})
        b.guard("executor", f"denoise pass B={B}", one)


def build_model(cfg_kw: dict, layers: int, device, dtype):
    """A random LLaDA2.0-mini-shaped model built directly on the device."""
    import torch
    from dblock.reference.llada import LladaModel
    from dblock.tiny import tiny_config
    cfg = tiny_config("llada2_moe", **{**cfg_kw, "num_hidden_layers": layers})
    with torch.device(device):
        model = LladaModel(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.normal_(0.0, 0.05, generator=g)
    return model.to(dtype).eval()


# ---------------------------------------------------------------------------------------------------------------
# compile only (no GPU): every kernel variant through the real NVIDIA pipeline, resources from cuobjdump
# ---------------------------------------------------------------------------------------------------------------

def setup_compile_only(arch: int) -> list:
    """Before dblock.kernels is imported: compiled-mode kernels, a driver that only names the target, and launches
    that compile (JITFunction.run with warmup=True) instead of running. Returns the list compiled kernels go to."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class TargetOnly:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

    torch.cuda.is_available = lambda: True       # dblock.kernels: do not switch to the interpreter
    driver.set_active(TargetOnly())
    compiled = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        t = time.time()
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, time.time() - t, kernel))
        return kernel
    JITFunction.run = compile_only
    return compiled


def resources(kernel) -> str:
    import subprocess
    import tempfile
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln.strip() for ln in out.splitlines() if ln.strip().startswith("REG:")), "")
    keep = [kv for kv in line.split() if kv.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL")]
    return " ".join(keep) or "cuobjdump: no resource line"


def compile_rows(b: Bench, compiled: list) -> None:
    """Launch (= compile) every variant the GPU run and the executor use, at the GPU run's shapes."""
    import torch
    import dblock.kernels as K
    from dblock.forward import dense
    from dblock.kernels import align, attention, compact, grouped_mlp, lm_head, route
    for mod in (route, align, grouped_mlp, compact, attention, lm_head):
        mod.check_runnable = lambda device: None     # CPU tensors stand in for device memory; nothing launches
    assert not K.INTERPRET
    S, bf = GPU, torch.bfloat16

    def variant(name, fn):
        n0 = len(compiled)

        def go():
            fn()
            for kname, secs, kernel in compiled[n0:]:
                b.row("compile", f"{name}: {kname}", f"sm_{kernel.metadata.target.arch}", resources(kernel), True,
                      baselines={"compile s": round(secs, 1)})
        b.guard("compile", name, go)

    E, K_, H, I = S["E"], S["K"], S["H"], S["I"]
    ids = torch.stack([torch.randperm(E)[:K_] for _ in range(256)])
    variant("route llada2", lambda: route.route_triton(torch.randn(256, E), torch.randn(E), torch.rand(256, E) < .3,
                                                       top_k=K_, sigmoid=True, n_group=S["G"], topk_group=S["TG"]))
    variant("route llada_moe", lambda: route.route_triton(torch.randn(256, 64), None, torch.rand(256, 64) < .3,
                                                          top_k=8, sigmoid=False))
    for dt, F in ((bf, 256), (bf, S["F"]), (torch.float32, 256)):
        idsF = torch.stack([torch.randperm(E)[:K_] for _ in range(F)])
        variant(f"grouped_mlp {str(dt)[6:]} F{F}", lambda dt=dt, F=F, idsF=idsF: grouped_mlp.grouped_mlp_triton(
            torch.randn(F, H).to(dt), idsF, torch.rand(F, K_), torch.empty(E, I, H, dtype=dt),
            torch.empty(E, I, H, dtype=dt), torch.empty(E, H, I, dtype=dt)))
    gu_ = torch.empty(E, 2 * I, H, dtype=bf)
    variant("grouped_mlp geglu bf16 F256", lambda: grouped_mlp.grouped_mlp_triton(
        torch.randn(256, H).to(bf), torch.stack([torch.randperm(E)[:K_] for _ in range(256)]), torch.rand(256, K_),
        gu_[:, :I], gu_[:, I:], torch.empty(E, H, I, dtype=bf), activation="gelu_tanh"))
    x = torch.randn(1024, H).to(bf)
    variant("compact", lambda: compact.compact_triton(x, torch.arange(0, 1024, 2)))
    variant("merge", lambda: compact.merge_triton(x[:512], compact.positions_of(torch.arange(0, 1024, 2), 1024), x,
                                                  torch.arange(1024, dtype=torch.int32)))
    N, KV, D, C = S["N"], S["KV"], S["D"], S["C"]
    for dt, nkv, Lc, segs, tag in ((bf, KV, 512, [C, C], "oba, aligned cache"),
                                   (bf, KV, 500, [C], "ragged cache"),
                                   (bf, N, 0, [77], "llada_moe full sequence"),
                                   (torch.float32, KV, 512, [C], "fp32")):
        def attn(dt=dt, nkv=nkv, Lc=Lc, segs=segs):
            B, L = 4, sum(segs)
            items_vis = [dense(len(segs))] * B
            tile = attention.pick_tile([Lc, L] + segs, dt)
            sched = attention.tile_schedule([Lc] * B, [segs] * B, items_vis, tile)
            q = torch.randn(B, N, L, D).to(dt)
            k, v = torch.randn(B, nkv, L, D).to(dt), torch.randn(B, nkv, L, D).to(dt)
            pk = torch.randn(B, nkv, Lc, D).to(dt) if Lc else None
            pv = torch.randn(B, nkv, Lc, D).to(dt) if Lc else None
            attention.attention_triton(q, k, v, pk, pv, torch.ones(B, L, Lc + L, dtype=torch.bool), sched, 0.1)
        variant(f"attention {tag}", attn)
    for dt in (bf, torch.float32):
        variant(f"lm_head {str(dt)[6:]}", lambda dt=dt: lm_head.lm_head_triton(
            torch.randn(64, H).to(dt), torch.arange(0, 64, 2), torch.ones(H, dtype=dt),
            torch.empty(S["V"], H, dtype=dt), 1e-6))
    del ids


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------

def fmt_ms(v):
    return "-" if v is None else (v if isinstance(v, str) else f"{v:.3f}")


def table(rows, title: str) -> str:
    out = [title, "", "| section | op | shape | check | ok | triton ms | baselines (ms) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = ", ".join(f"{k} {fmt_ms(v)}" for k, v in r["baselines"].items())
        t = r["triton_ms"]
        ratios = [f"{v / t:.2f}x" for v in r["baselines"].values() if isinstance(v, float) and t]
        if ratios:
            base += f" (speedup {', '.join(ratios)})"
        out.append(f"| {r['section']} | {r['op']} | {r['shape']} | {r['check']} | {'yes' if r['ok'] else 'NO'} | "
                   f"{fmt_ms(t)} | {base or '-'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-check", action="store_true",
                    help="no GPU: run every check at tiny shapes in fp32 through the Triton interpreter, untimed")
    ap.add_argument("--cpu-timed", action="store_true",
                    help="with --cpu-check: also run the timing code paths (wall clock; meaningless numbers)")
    ap.add_argument("--compile-only", action="store_true",
                    help="no GPU: compile every kernel variant for --arch through ptxas, report registers/spills")
    ap.add_argument("--arch", type=int, default=90, help="--compile-only target compute capability (default 90)")
    ap.add_argument("--layers", type=int, default=4,
                    help="executor section: layers of the LLaDA2.0-mini-shaped model (1 dense + MoE; default 4)")
    ap.add_argument("--batches", default="32,128,512", help="batch sizes of the moe and executor sections")
    ap.add_argument("--prefix", type=int, default=256, help="executor section: cached prefix length per request")
    ap.add_argument("--passes", type=int, default=3, help="executor section: timed passes after the cold one")
    ap.add_argument("--budget", type=float, default=280.0, help="seconds; later rows are skipped past it")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: kernels, moe, executor")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    if args.cpu_check:
        os.environ["TRITON_INTERPRET"] = "1"        # before dblock.kernels decorates anything
    import torch
    if args.compile_only:
        import triton
        if "dblock.kernels" in sys.modules or os.environ.get("TRITON_INTERPRET") == "1":
            print("benchmarks/gpu.py: --compile-only needs a fresh process without TRITON_INTERPRET", file=sys.stderr)
            return 2
        compiled = setup_compile_only(args.arch)
        b = Bench(torch.device("cpu"), torch.bfloat16, timed=False, deadline=args.budget * 3)
        compile_rows(b, compiled)
        print(table(b.rows, f"benchmarks/gpu.py --compile-only: every kernel variant compiled for sm_{args.arch} "
                            f"(triton {triton.__version__}, ptxas; nothing launched), {time.time() - b.t0:.0f} s"))
        return 0 if all(r["ok"] for r in b.rows) else 1
    if not args.cpu_check and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA GPU here; use --cpu-check for the interpreter checks", file=sys.stderr)
        return 2
    import triton
    import dblock.kernels as K
    if args.cpu_check and not K.INTERPRET:
        print("benchmarks/gpu.py: dblock.kernels is already in compiled mode in this process", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    skip = set(filter(None, args.skip.split(",")))
    if args.cpu_check:
        device, dtype, S = torch.device("cpu"), torch.float32, TINY
        batches, card = [2], "CPU (Triton interpreter, fp32; times not meaningful)"
    else:
        device, dtype, S = torch.device("cuda"), torch.bfloat16, GPU
        batches, card = [int(x) for x in args.batches.split(",")], torch.cuda.get_device_name()
    b = Bench(device, dtype, timed=not args.cpu_check or args.cpu_timed, deadline=args.budget)
    if "kernels" not in skip:
        kernel_rows(b, S)
    if args.cpu_check:
        from dblock.tiny import make_tiny_model, tiny_config
        cfg = tiny_config("llada2_moe")
        if "moe" not in skip:
            moe_rows(b, cfg, batches, cfg.block_size)
        if "executor" not in skip:
            executor_rows(b, make_tiny_model("llada2_moe", seed=0), batches, prefix=2 * cfg.block_size, passes=1)
    else:
        from dblock.tiny import tiny_config
        cfg = tiny_config("llada2_moe", **{**MINI, "num_hidden_layers": args.layers})
        if "moe" not in skip:
            moe_rows(b, cfg, batches, cfg.block_size)
        if "executor" not in skip and b.left() > 30:
            model = None
            try:
                model = build_model(MINI, args.layers, device, dtype)
            except Exception as e:              # noqa: BLE001
                b.row("executor", "build model", "-", f"ERROR {type(e).__name__}: {e}", False)
            if model is not None:
                executor_rows(b, model, batches, args.prefix, args.passes)
    title = (f"benchmarks/gpu.py on {card} — torch {torch.__version__}, triton {triton.__version__}, "
             f"{dtype}, {time.time() - b.t0:.0f} s; command: python benchmarks/gpu.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    print(table(b.rows, title))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "title": title, "rows": b.rows}, f, indent=1)
    return 0 if all(r["ok"] for r in b.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
