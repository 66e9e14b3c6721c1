"""LM head of live rows: lm_head_triton vs the fp64 golden model and the model's own `logits`."""
import pytest
import torch

from dblock.kernels.lm_head import lm_head_torch, lm_head_triton
from dblock.tiny import make_tiny_model
from tests.conftest import tol


@pytest.mark.parametrize("L,H,V,live", [(4, 16, 24, [0, 1, 1, 0]), (1, 40, 33, [1]), (37, 64, 96, None),
                                        (8, 16, 16, [0] * 8)])
def test_matches_fp64_reference(L, H, V, live):
    g = torch.Generator().manual_seed(L + H)
    h = torch.randn(L, H, generator=g) * 3
    live = torch.tensor(live, dtype=torch.bool) if live is not None else torch.rand(L, generator=g) < 0.6
    idx = live.nonzero(as_tuple=True)[0]
    nw, w = 1 + 0.1 * torch.randn(H, generator=g), torch.randn(V, H, generator=g)
    out = lm_head_triton(h, idx, nw, w, 1e-6)
    assert out.shape == (int(live.sum()), V) and out.dtype == torch.float32
    ref = lm_head_torch(h.double(), idx, nw.double(), w.double(), 1e-6)
    torch.testing.assert_close(out.double(), ref, **tol(torch.float32))


def test_matches_model_logits_of_live_rows():
    m = make_tiny_model("llada2_moe", seed=1)
    h = torch.randn(8, m.config.hidden_size)
    live = torch.tensor([1, 0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    out = lm_head_triton(h, live.nonzero(as_tuple=True)[0], m.norm.weight.detach(), m.lm_head.weight.detach(),
                         m.norm.eps)
    with torch.no_grad():
        torch.testing.assert_close(out, m.logits(h[live]), atol=1e-4, rtol=1e-5)   # logits of size ~50


def test_launcher_asserts_layout():
    h, nw, w = torch.randn(4, 16), torch.ones(16), torch.randn(8, 16)
    with pytest.raises(AssertionError, match="weight_VH: must be contiguous"):
        lm_head_triton(h, torch.tensor([0]), nw, w.t().contiguous().t(), 1e-6)
    with pytest.raises(AssertionError, match="norm_weight_H: dtype"):
        lm_head_triton(h, torch.tensor([0]), nw.double(), w, 1e-6)
