"""Degenerate settings are exact (docs/algorithms.md §5): full_compute ≡ reference, the paired-block proposition, world-size
invariance — and each check can fail (a check that cannot fail proves nothing)."""
import pytest
import torch

from dblock.decoding.params import DecodeConfig
from dblock.equivalence import degenerate as dg
from dblock.decoding.generate import generate, reference_forward
from dblock.tiny import make_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
def test_full_compute_check(family):
    m = make_tiny_model(family, seed=5)
    r = dg.check_full_compute(m, PROMPTS, DecodeConfig(max_new_tokens=24))
    assert r["ok"] is True and r["identical"] == 3 and r["decision_agreement"] == 1.0, r
    assert r["F_reference"] == r["F_full_compute"]


def test_paired_block_proposition_llada2():
    m = make_tiny_model("llada2_moe", seed=5)
    r = dg.check_paired_block(m, PROMPTS, DecodeConfig(max_new_tokens=32))
    assert r["ok"] is True and r["passes"] > 10, r
    assert m.embed.weight.dtype == torch.float32                 # the check works on an fp64 copy
    if not r["fp32_ops"]:                                        # a truly fp64 reference: exact
        assert r["max_abs"] <= 1e-10
    else:                                                        # else fp32 shape effects, and the message says where
        assert "downcasts to float32" in r["message"]


def test_paired_block_proposition_diffusion_gemma():
    m = make_tiny_model("diffusion_gemma", seed=0)
    r = dg.check_paired_block(m, [[5, 6, 7]], DecodeConfig(rule="entropy-bound", steps=3, max_new_tokens=32))
    assert r["ok"] is True and r["passes"] > 0, r


def test_paired_block_not_applicable_to_llada_moe():
    r = dg.check_paired_block(make_tiny_model("llada_moe", seed=0), PROMPTS, DecodeConfig(max_new_tokens=16))
    assert r["ok"] is None and "no paired pass" in r["message"]


class LeakyWarmup(dg.PairedBlockCheck.__mro__[1]):
    """A broken Forward: the current block's logits depend on the warm-up block's tokens."""

    name = "leaky"

    def __init__(self, inner):
        self.inner, self.config = inner, inner.config

    def new_cache(self):
        return self.inner.new_cache()

    def append(self, items):
        self.inner.append(items)

    def denoise(self, items):
        out = self.inner.denoise(items)
        for b, it in enumerate(items):
            if len(it.segments) > 1 and out[b][0].numel():
                out[b][0] = out[b][0] + 1e-3 * float(it.segments[1].tokens.float().mean())
        return out


def test_paired_block_check_catches_a_leak():
    m = make_tiny_model("llada2_moe", seed=5).to(torch.float64)
    chk = dg.PairedBlockCheck(LeakyWarmup(reference_forward(m)))
    generate(chk, PROMPTS, DecodeConfig(max_new_tokens=32), "oba")
    assert chk.passes > 0 and chk.max_abs > dg.PAIRED_TOL


def test_world_size_hook_without_expert_parallelism(monkeypatch):
    monkeypatch.setattr(dg, "ep_available", lambda: False)
    r = dg.check_world_sizes("unused", PROMPTS, DecodeConfig(max_new_tokens=8), [1, 2, 4])
    assert r["ok"] is None and r["message"].startswith("expert parallelism not available")


@pytest.mark.skipif(not dg.ep_available(), reason="dblock.optimized.ep not present")
def test_world_size_one_matches_the_single_process_executor(tiny_dirs):
    r = dg.check_world_sizes(tiny_dirs["llada2_moe"], PROMPTS[:2], DecodeConfig(max_new_tokens=16), [1])
    assert r["ok"] is True and r["per_world_size"]["local"]["identical"] == 2, r


@pytest.mark.slow
@pytest.mark.skipif(not dg.ep_available(), reason="dblock.optimized.ep not present")
def test_world_size_invariance_gloo(tiny_dirs):
    """Spawns two gloo ranks (about 15 s on a busy 2-core machine, most of it importing torch in each rank)."""
    r = dg.check_world_sizes(tiny_dirs["llada2_moe"], PROMPTS[:1], DecodeConfig(max_new_tokens=8), [2],
                             timeout_s=60.0)
    assert r["ok"] is True, r
    assert r["per_world_size"][2]["identical"] == 1 and r["per_world_size"][2]["max_abs_logits"] <= dg.WORLD_TOL
