"""The `use_triton` switch: the epoch executor with the Triton stack (interpreter, fp32) gives the same tokens as
with the torch stack, on random tiny models of both families and on the bundled `tiny-masked`; the CLI runs it.

Each generate here runs every kernel of the stack through the interpreter (about a second per pass), so prompts
and budgets are small and `max_steps` caps the passes per block; together they cover Native with and without a
KV cache, OBA's paired layout, llada_moe's full-sequence segment (partial tiles), padding between requests, LSP
cache hits and restricted supports.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import dblock
from dblock.decoding.params import DecodeConfig
from dblock.forward import Segment, StepInput
from dblock.kernels.stack import TritonStages
from dblock.optimized.executor import epoch_forward
from dblock.optimized.stages import TorchStages
from dblock.decoding.generate import generate
from dblock.tiny import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prompts(vocab_hi, lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab_hi, (n,), generator=g).tolist() for n in lens]


def same_tokens(model, ps, dec, schedule="native", config="epoch", **kw):
    torch_fwd = epoch_forward(model, config, **kw)
    triton_fwd = epoch_forward(model, config, use_triton=True, **kw)
    assert isinstance(triton_fwd.stages, TritonStages) and isinstance(torch_fwd.stages, TorchStages)
    a = generate(torch_fwd, ps, dec, schedule)
    b = generate(triton_fwd, ps, dec, schedule)
    assert b.tokens == a.tokens
    assert [c.F for c in b.counters] == [c.F for c in a.counters]
    return triton_fwd


def test_same_tokens_llada2_with_cache_oba():
    m = make_tiny_model("llada2_moe", seed=3)
    # prompt lengths 5 and 11 with C = 8: prompt tails in the first block, one request with a cache, padding;
    # OBA passes pair [current, warm-up]; the last block runs alone (the Native layout)
    f = same_tokens(m, prompts(90, [5, 11], seed=1), DecodeConfig(max_new_tokens=16, max_steps=4), "oba",
                    refresh=3)
    paths = f.stats()["paths"]
    assert paths.get("hot-skip", 0) > 0                              # restricted supports were routed through
    assert f.stages.last_schedule_counts["partial"] == 0            # tile = C: no element masks needed


def test_same_tokens_llada2_no_cache_prefix_segments():
    m = make_tiny_model("llada2_moe", seed=4)
    same_tokens(m, prompts(90, [9], seed=2), DecodeConfig(max_new_tokens=16, no_cache=True, max_steps=3))


def test_same_tokens_llada_moe_full_sequence():
    m = make_tiny_model("llada_moe", seed=5)
    f = same_tokens(m, prompts(90, [6], seed=3), DecodeConfig(max_new_tokens=8, max_steps=6))
    assert f.stages.last_schedule_counts["partial"] > 0             # 6 + 8 rows: partial tiles, element masks


def test_same_tokens_tiny_masked():
    """The bundled trained model (`dblock/checkpoints/tiny-masked`); not skipped: a missing folder fails here."""
    m = dblock.load("tiny-masked")
    assert m.config.family == "llada2_moe"
    # prompt 20 with C = 16: a cached block, then a tail of 4 in the first generated block; padding between the two
    same_tokens(m, prompts(m.config.vocab_size - 2, [7, 20], seed=4), DecodeConfig(max_new_tokens=12, max_steps=3))


def test_one_pass_logits_close_to_torch_stack():
    """Beyond tokens: the live-row logits of one paired (OBA) pass agree to fp32 rounding."""
    m = make_tiny_model("llada2_moe", seed=6)
    M = m.config.mask_token_id
    outs = []
    for use_triton in (False, True):
        f = epoch_forward(m, "epoch", use_triton=use_triton)
        cache = f.new_cache()
        f.append([StepInput(0, [Segment(0, torch.arange(10, 18), torch.arange(8), torch.zeros(8, dtype=torch.bool),
                                        torch.ones(8, dtype=torch.bool))], torch.ones(1, 1, dtype=torch.bool),
                            cache)])
        cur = torch.tensor([20, M, M, 21, M, M, M, M])
        segs = [Segment(1, cur, torch.arange(8, 16), cur == M, cur != M),
                Segment(2, torch.full((8,), M), torch.arange(16, 24), torch.ones(8, dtype=torch.bool),
                        torch.zeros(8, dtype=torch.bool), role="warmup")]
        outs.append(f.denoise([StepInput(0, segs, torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), cache)])[0])
    for a, b in zip(*outs):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)      # logits of size ~10-50


def test_fp64_model_is_a_clear_error():
    m = make_tiny_model("llada2_moe", seed=0, dtype=torch.float64)
    with pytest.raises(ValueError, match="use-triton"):
        generate(epoch_forward(m, "epoch", use_triton=True), [[5, 6]], DecodeConfig(max_new_tokens=8))


def test_cli_generate_use_triton_in_a_fresh_process(tiny_dirs):
    """`dblock generate ... --executor epoch --use-triton` in a new process. The CLI sets TRITON_INTERPRET itself
    (`--use-triton` without a GPU) before anything imports triton; the test's environment does not set it."""
    ids, folder = "5,9,12,7,6", tiny_dirs["llada2_moe"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""                                 # the CPU path on any machine
    cmd = [sys.executable, "-m", "dblock", "generate", "--model", folder, "--prompt-ids", ids, "--max-new-tokens", "8",
           "--max-steps", "3", "--executor", "epoch", "--use-triton", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["tokens"]
    ref = generate(epoch_forward(dblock.load(folder), "epoch"), [[int(x) for x in ids.split(",")]],
                   DecodeConfig(max_new_tokens=8, max_steps=3))
    assert got == ref.tokens


def test_diffusion_gemma_runs_the_kernels_that_apply_and_keeps_the_reference_tokens():
    """`--use-triton` on DiffusionGemma: routing, GeGLU experts and compaction through the kernels (attention, norms
    and the soft-capped LM head in torch), full_compute and the Expert Atlas, tokens equal to the reference's."""
    import dblock
    from dblock.optimized.gemma_stages import GemmaTritonStages
    m = dblock.load("tiny-uniform")
    dec = DecodeConfig(rule="entropy-bound", max_new_tokens=16)
    ps = [[5, 6, 7, 8, 9], [10, 11, 12]]
    ref = generate(m, ps, dec).tokens
    for config, kw in (("full_compute", {}), ("epoch", {"atlas_B": 4})):
        f = epoch_forward(m, config, use_triton=True, **kw)
        assert isinstance(f.stages, GemmaTritonStages)
        calls = {"route": 0, "experts": 0}
        for name in calls:
            inner = getattr(f.stages, name)

            def counted(*a, _n=name, _f=inner):
                calls[_n] += 1
                return _f(*a)
            setattr(f.stages, name, counted)
        assert generate(f, ps, dec).tokens == ref
        assert calls["route"] > 0 and calls["experts"] > 0          # the kernels ran, not the torch stages
    m64 = dblock.load("tiny-uniform", dtype="float64")
    with pytest.raises(ValueError, match="use-triton"):
        generate(epoch_forward(m64, "full_compute", use_triton=True), ps[:1], dec)
