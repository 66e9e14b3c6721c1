"""bf16 inputs through the interpreter: the kernels load, upcast to fp32, compute and cast only at the store, so the
only bf16 effect left is the interpreter's truncating fp32->bf16 store (at most 1 ulp off torch's rounding).
A kernel that did arithmetic in bf16 under the interpreter would be off by orders of magnitude (triton#11584)."""
import math

import torch

from dblock.forward import dense
from dblock.kernels.attention import attention_torch, attention_triton, tile_schedule
from dblock.kernels.compact import compact_triton, merge_torch, merge_triton, positions_of
from dblock.kernels.grouped_mlp import grouped_mlp_torch, grouped_mlp_triton
from dblock.kernels.lm_head import lm_head_torch, lm_head_triton

BF = torch.bfloat16


def ulps(out_bf16, ref):
    """Max error in units of bf16 spacing (2^-7 relative, the truncation bound) at the output's largest magnitude."""
    spacing = ref.abs().max().clamp(min=1e-30) * 2.0 ** -7
    return ((out_bf16.double() - ref.double()).abs() / spacing).max().item()


def test_copies_are_exact_in_bf16():
    x = torch.randn(20, 24).to(BF)
    idx = torch.tensor([3, 0, 19, 7])
    assert torch.equal(compact_triton(x, idx), x[idx])
    y = torch.randn(4, 24).to(BF)
    fpos, cpos = positions_of(idx, 20), torch.arange(20, dtype=torch.int32)
    assert torch.equal(merge_triton(y, fpos, x, cpos), merge_torch(y, fpos, x, cpos))


def test_grouped_mlp_bf16_within_bf16_rounding():
    g = torch.Generator().manual_seed(0)
    F, K, E, H, I = 13, 2, 4, 32, 16
    x = (torch.randn(F, H, generator=g) / 2).to(BF)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(F)])
    w = torch.rand(F, K, generator=g)
    wg, wu = [(torch.randn(E, I, H, generator=g) / math.sqrt(H)).to(BF) for _ in range(2)]
    wd = (torch.randn(E, H, I, generator=g) / math.sqrt(I)).to(BF)
    y = grouped_mlp_triton(x, ids, w, wg, wu, wd)
    assert y.dtype == BF
    # the kernel stores the SwiGLU activation in bf16 between its two GEMMs (as vLLM does): a few ulps in all
    ref = grouped_mlp_torch(x.double(), ids, w.double(), wg.double(), wu.double(), wd.double())
    assert ulps(y, ref) < 2


def test_attention_bf16_within_bf16_rounding():
    g = torch.Generator().manual_seed(1)
    B, N, G, L, Lc, D = 2, 4, 2, 8, 8, 16
    q, k, v = [torch.randn(B, n, L, D, generator=g).to(BF) for n in (N, G, G)]
    pk, pv = [torch.randn(B, G, Lc, D, generator=g).to(BF) for _ in range(2)]
    mask = torch.ones(B, L, Lc + L, dtype=torch.bool)
    sched = tile_schedule([Lc] * B, [[L]] * B, [dense(1)] * B, 8)
    out = attention_triton(q, k, v, pk, pv, mask, sched, 0.25)
    ref = attention_torch(q.double(), k.double(), v.double(), pk.double(), pv.double(), mask, 0.25)
    assert out.dtype == BF and ulps(out, ref) < 2


def test_lm_head_bf16_inputs_fp32_logits():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 32, generator=g).to(BF)
    nw, w = (1 + 0.1 * torch.randn(32, generator=g)).to(BF), (torch.randn(40, 32, generator=g) / 6).to(BF)
    idx = torch.tensor([0, 2, 5])
    out = lm_head_triton(h, idx, nw, w, 1e-6)
    ref = lm_head_torch(h.double(), idx, nw.double(), w.double(), 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)   # fp32 math all the way (interpreter)
