"""Shared helpers of the DiffusionGemma tests: tiny configs, transformers twins, a teacher-forced harness."""
from __future__ import annotations

import contextlib
import os

import torch

from dblock.decoding.params import DecodeConfig
from dblock.forward import Segment, StepInput, block_causal
from dblock.gemma_config import FULL, SLIDING
from dblock.reference.gemma_executor import GemmaReference
from dblock.reference.gemma_tiny import make_tiny_gemma
from dblock.tiny import save_for_transformers
from dblock.weights_read import ALIGN

# Random tiny configs covering the structural variants (overrides of dblock.reference.gemma_tiny.TINY_GEMMA).
TINY_CONFIGS = {
    # 2 sliding (GQA 4q/2kv, head 16) + 1 full (4q/1kv, head 32, V = K, proportional RoPE on 25%); window 8
    "tiny": {},
    # window 4 (shorter than prompt and canvas), MHA sliding layers, proportional RoPE on half the dims with a
    # `factor`, alternating layer types, canvas 8
    "w4": dict(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, FULL], num_key_value_heads=4, head_dim=8,
               global_head_dim=16, num_global_key_value_heads=2, sliding_window=4, canvas_length=8,
               rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 100.0},
                                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                       "rope_theta": 10_000.0, "factor": 2.0}}),
    # full layers only, plain RoPE on them, untied LM head, other soft-cap, 3-of-4 experts
    "untied": dict(num_hidden_layers=2, layer_types=[FULL, FULL], global_head_dim=16, num_global_key_value_heads=2,
                   tie_word_embeddings=False, final_logit_softcapping=10.0, num_experts=4, top_k_experts=3,
                   canvas_length=8, rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                                                     FULL: {"rope_type": "default", "rope_theta": 50_000.0}}),
}


@contextlib.contextmanager
def one_thread():
    """Tiny shapes run fastest single-threaded (two busy shared cores make OpenMP index_add_ crawl)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def hf_twin(model, folder: str, exact: bool = True, dtype=None):
    """Save a dblock GemmaModel (unless `folder` already holds one) and load it with transformers.

    exact=True: eager attention and the eager expert loop -- the same op order as dblock's reference, so batch-1
    results are bitwise equal. exact=False: transformers' defaults (sdpa, grouped_mm experts), as a user runs it.
    dtype: loaded as `from_pretrained(dtype=...)` does it (RoPE tables stay fp32).
    """
    from transformers import DiffusionGemmaForBlockDiffusion
    if not os.path.isfile(os.path.join(folder, "config.json")):
        save_for_transformers(model, folder)
    kw = dict(attn_implementation="eager", experts_implementation="eager") if exact else {}
    if dtype is not None:
        kw["dtype"] = dtype
    hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return aligned(hf.eval())


def aligned(module):
    """`module` with every parameter and buffer in freshly allocated (64-byte aligned) memory. transformers may leave
    weights where the safetensors file put them (an mmap at the header's offset, e.g. 36 bytes past a 64-byte
    boundary), and on an AVX-512 CPU a one-row `linear` over a misaligned weight rounds differently in the last bit
    (measured: expert 2 of the tiny model, one routed row). Alignment is the machine's business, not the op order
    these tests compare, so both sides get the same kind of memory."""
    for t in list(module.parameters()) + list(module.buffers()):
        if t.numel() and t.data_ptr() % ALIGN:
            t.data = t.data.clone()
    return module


def make_exact(hf):
    """Switch a transformers model built in memory to eager attention and the eager expert loop."""
    hf.set_attn_implementation("eager")
    hf.set_experts_implementation("eager")
    return hf


def hf_cache(hf):
    from transformers.cache_utils import DynamicCache
    return DynamicCache(config=hf.config.get_text_config(decoder=True))


def fixed_segment(tokens: torch.Tensor, start: int, block: int = -1) -> Segment:
    n = tokens.numel()
    return Segment(block=block, tokens=tokens, positions=torch.arange(start, start + n),
                   live=torch.zeros(n, dtype=torch.bool), decoded=torch.ones(n, dtype=torch.bool), role="prefix")


def canvas_segment(tokens: torch.Tensor, start: int, block: int = 0, sc=None, role="current") -> Segment:
    n = tokens.numel()
    return Segment(block=block, tokens=tokens, positions=torch.arange(start, start + n),
                   live=torch.ones(n, dtype=torch.bool), decoded=torch.zeros(n, dtype=torch.bool), role=role,
                   sc_logits=sc)


def teacher_forced(ours, hf, prompts, n_blocks=2, steps=3, seed=0, check=None):
    """Drive dblock's executor (all requests batched in every call) and transformers (one request at a time, its own
    DynamicCache) through the same inputs: prefill, `steps` denoising passes per canvas fed the same random canvas
    and the same self-conditioning logits (the previous step's processed logits), then the append of the argmax
    canvas. `check(kind, ours, theirs)` gets ("kv", ...) after every encoder call for every layer and ("logits", ...)
    after every denoising pass. Returns the number of comparisons."""
    cfg = ours.config
    fwd = GemmaReference(ours)
    C, V = cfg.canvas_length, cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    caches = [fwd.new_cache() for _ in prompts]
    hcs = [hf_cache(hf) for _ in prompts]
    starts = [len(p) for p in prompts]
    n = 0

    def compare_kv():
        nonlocal n
        for r, hc in enumerate(hcs):
            for i, layer in enumerate(hc.layers):
                check("kv", caches[r].k[i], layer.keys[0])
                check("kv", caches[r].v[i], layer.values[0])
                n += 2

    def encode(token_lists, starts_):
        fwd.append([StepInput(r, [fixed_segment(t, s, -1)], block_causal(1), caches[r])
                    for r, (t, s) in enumerate(zip(token_lists, starts_))])
        with torch.no_grad():
            for r, (t, s) in enumerate(zip(token_lists, starts_)):
                hf.model.encoder(input_ids=t[None], past_key_values=hcs[r],
                                 position_ids=torch.arange(s, s + t.numel())[None])
        compare_kv()

    encode([torch.as_tensor(p) for p in prompts], [0] * len(prompts))
    for b in range(n_blocks):
        sc = [None] * len(prompts)
        for step in range(steps):
            xs = [torch.randint(0, V, (C,), generator=g) for _ in prompts]
            items = [StepInput(r, [canvas_segment(xs[r], starts[r], b, sc[r])], block_causal(1), caches[r])
                     for r in range(len(prompts))]
            out = fwd.denoise(items)
            for r in range(len(prompts)):
                with torch.no_grad():
                    theirs = hf(decoder_input_ids=xs[r][None], past_key_values=hcs[r],
                                self_conditioning_logits=None if sc[r] is None else sc[r][None].to(hf.dtype),
                                decoder_position_ids=torch.arange(starts[r], starts[r] + C)[None]).logits[0]
                check("logits", out[r][0], theirs)
                n += 1
                sc[r] = out[r][0] / (0.4 + 0.4 * (steps - step) / steps)  # processed logits feed the next step
        committed = [o[0].argmax(-1) for o in out]
        encode(committed, starts)
        starts = [s + C for s in starts]
    return n


def hf_generate(hf, prompt, seed, dec: DecodeConfig, eos=None, pad=0):
    """transformers' generate with the same settings; returns new tokens, decoder passes, its TPF."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
    calls = []
    h = hf.model.decoder.register_forward_hook(lambda *a: calls.append(1))
    t_max, t_min = dec.temperature
    kw = dict(max_new_tokens=dec.max_new_tokens, max_denoising_steps=dec.n_steps,
              sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(dec.entropy_bound)), t_max=t_max,
              t_min=t_min, stability_threshold=dec.stability, confidence_threshold=float(dec.confidence),
              pad_token_id=pad)
    if eos is not None:
        kw["eos_token_id"] = eos
    try:
        torch.manual_seed(seed)
        out = hf.generate(torch.tensor([prompt]), **kw)
    finally:
        h.remove()
    return out.sequences[0, len(prompt):].tolist(), len(calls), float(out.tokens_per_forward[0])


def make_ours(name: str, seed: int = 0, **extra):
    return make_tiny_gemma(seed=seed, **{**TINY_CONFIGS[name], **extra})
