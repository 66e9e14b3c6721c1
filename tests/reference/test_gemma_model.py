"""DiffusionGemma reference model against transformers 5.23: teacher-forced encoder K/V and decoder logits, weight
folders in both directions, the Segment visibility contract, and every refused input.

Tolerance: with eager attention and batch 1 the two implementations are bitwise equal (same op order); batched
padded calls differ by float reassociation only, so everything is compared with the fp32 row of the tolerance
table (atol = rtol = 1e-5; logits are soft-capped to |z| <= 30).
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import dblock
from dblock.config import ConfigError, load_config
from dblock.decoding.params import DecodeConfig
from dblock.forward import StepInput, block_causal
from dblock.gemma_config import FULL, SLIDING, GemmaConfig
from dblock.reference.gemma_executor import GemmaReference
from dblock.reference.gemma_tiny import make_tiny_gemma, tiny_gemma_config
from dblock.tiny import save_for_transformers
from dblock.decoding.generate import generate
from dblock.errors import WeightsError
from tests.conftest import tol
from tests.reference.gemma_util import (TINY_CONFIGS, canvas_segment, fixed_segment, hf_generate, hf_twin, make_exact,
                                        make_ours, one_thread, teacher_forced)

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def _close(kind, ours, theirs, scale=30.0):
    """fp32 row of the tolerance table; for logits the absolute part is taken relative to their range (the
    soft-cap, 30): padded batched shapes reassociate fp32 sums, an O(1e-6) relative effect."""
    assert ours.shape == theirs.shape, (kind, ours.shape, theirs.shape)
    t = dict(tol(torch.float32))
    if kind == "logits":
        t["atol"] = t["atol"] * scale
    torch.testing.assert_close(ours, theirs, **t)


# ---- teacher-forced parity ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_teacher_forced_batch1_bitwise(tmp_path, name):
    """Prompt longer than the window (sliding caches trimmed), two canvases, three passes each: K/V of every layer
    after every encoder call and the logits of every pass are *identical* to transformers' at batch 1."""
    ours = make_ours(name, seed=1)
    hf = hf_twin(ours, str(tmp_path / name))

    def exact(kind, a, b):
        assert a.shape == b.shape and torch.equal(a, b), (kind, (a - b).abs().max())

    assert teacher_forced(ours, hf, [list(range(3, 14))], n_blocks=2, steps=3, check=exact) > 0


def test_teacher_forced_bf16_bitwise(tmp_path):
    """The same in bfloat16 (both loaded with dtype=bfloat16): dblock rounds where transformers rounds --
    including the self-conditioning logits cast to the weight dtype before their softmax."""
    save_for_transformers(make_ours("w4", seed=4), str(tmp_path / "m"))
    hf = hf_twin(None, str(tmp_path / "m"), dtype=torch.bfloat16)
    ours = dblock.load(str(tmp_path / "m"), dtype="bfloat16")

    def exact(kind, a, b):
        assert a.dtype == b.dtype and torch.equal(a, b), (kind, (a.float() - b.float()).abs().max())

    teacher_forced(ours, hf, [list(range(3, 12))], n_blocks=2, steps=3, check=exact)


@pytest.mark.parametrize("name", ["tiny", "w4"])
def test_teacher_forced_batch3_padded(tmp_path, name):
    """Three requests with different prompt lengths (shorter and longer than the window) in every batched call,
    each compared with transformers run alone: padding and per-layer cache lengths change nothing."""
    ours = make_ours(name, seed=2)
    hf = hf_twin(ours, str(tmp_path / name))
    prompts = [[7, 8, 9], list(range(20, 31)), list(range(40, 46))]
    assert teacher_forced(ours, hf, prompts, n_blocks=2, steps=2, seed=3, check=_close) > 0


def test_segment_visibility_paired_pass():
    """OBA layout [current, warm-up] with visibility [[1,0],[1,1]]: the current block's logits equal those of the
    block decoded alone (docs/algorithms.md §5 paired-block proposition); the warm-up block sees the current one (its logits
    change when the current tokens change) and Dense Mask lets the current block see the warm-up block."""
    ours = make_ours("w4", seed=3)
    fwd = GemmaReference(ours)
    C = ours.config.canvas_length
    cache = fwd.new_cache()
    P = torch.arange(10, 21)
    fwd.append([StepInput(0, [fixed_segment(P, 0)], block_causal(1), cache)])
    g = torch.Generator().manual_seed(0)
    cur, warm = torch.randint(0, 256, (C,), generator=g), torch.randint(0, 256, (C,), generator=g)
    s0, s1 = len(P), len(P) + C

    def run(cur_tokens, vis):
        segs = [canvas_segment(cur_tokens, s0, 0), canvas_segment(warm, s1, 1, role="warmup")]
        return fwd.denoise([StepInput(0, segs, vis, cache)])[0]

    alone = fwd.denoise([StepInput(0, [canvas_segment(cur, s0, 0)], block_causal(1), cache)])[0][0]
    paired = run(cur, block_causal(2))
    _close("logits", paired[0], alone)
    other = cur.clone()
    other[0] = (other[0] + 1) % 256
    assert not torch.allclose(run(other, block_causal(2))[1], paired[1])
    assert not torch.allclose(run(cur, torch.ones(2, 2, dtype=torch.bool))[0], alone)


def test_layer_mask_worked_example():
    """The worked example of `layer_mask`'s docstring, row by row."""
    from dblock.reference.gemma import GemmaCache
    from dblock.reference.gemma_executor import build_batch, layer_mask, stack_past
    cfg = tiny_gemma_config(sliding_window=3)          # layers: sliding, sliding, full
    cache = GemmaCache(cfg)
    for i in range(3):
        cache.append(i, torch.zeros(2, 5, 4), torch.zeros(2, 5, 4), torch.arange(5))
    cache.length = 5
    ref = torch.zeros(1)

    def visible(items, encoder, layer):
        batch = build_batch(items, "cpu", encoder)
        _, _, kpos, kvalid = stack_past(items, layer, ref)
        mask = layer_mask(batch, kpos, kvalid, cfg.is_sliding(layer), cfg.sliding_window)[0]
        keys = torch.cat([kpos[0], batch.positions[0]])
        return {int(q): keys[mask[r]].tolist() for r, q in enumerate(batch.positions[0])}

    enc = [StepInput(0, [fixed_segment(torch.zeros(4, dtype=torch.long), 5)], block_causal(1), cache)]
    assert visible(enc, True, 2)[5] == [0, 1, 2, 3, 4, 5] and visible(enc, True, 2)[8] == list(range(9))
    assert visible(enc, True, 0)[5] == [3, 4, 5] and visible(enc, True, 0)[8] == [6, 7, 8]
    segs = [canvas_segment(torch.zeros(2, dtype=torch.long), 5, 0),
            canvas_segment(torch.zeros(2, dtype=torch.long), 7, 1, role="warmup")]
    dec = [StepInput(0, segs, block_causal(2), cache)]
    full, sliding = visible(dec, False, 2), visible(dec, False, 0)
    assert full[5] == full[6] == [0, 1, 2, 3, 4, 5, 6] and full[7] == full[8] == list(range(9))
    assert sliding[5] == sliding[6] == [3, 4, 5, 6] and sliding[7] == sliding[8] == [5, 6, 7, 8]


def test_denoise_never_writes_cache_and_live_rows_only():
    ours = make_ours("tiny", seed=0)
    fwd = GemmaReference(ours)
    cache = fwd.new_cache()
    fwd.append([StepInput(0, [fixed_segment(torch.arange(5, 17), 0)], block_causal(1), cache)])
    before = [k.clone() for k in cache.k], cache.length
    seg = canvas_segment(torch.arange(16), 12)
    seg.live[::2] = False
    out = fwd.denoise([StepInput(0, [seg], block_causal(1), cache)])[0][0]
    assert out.shape == (8, 256) and out.dtype == torch.float32 and out.abs().max() <= 30.0
    assert cache.length == before[1] and all(torch.equal(a, b) for a, b in zip(cache.k, before[0]))
    # the sliding layers keep exactly the last window-1 positions
    W = ours.config.sliding_window
    assert cache.pos[0].tolist() == list(range(12 - (W - 1), 12)) and cache.pos[2].tolist() == list(range(12))


# ---- weight folders in both directions ---------------------------------------------------------------------------

def _hf_tiny(tie=True, softcap=None):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    tc = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=5,
              layer_types=[SLIDING, SLIDING, FULL], num_experts=4, top_k_experts=2, moe_intermediate_size=16,
              max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if softcap is not None:
        tc["final_logit_softcapping"] = softcap
    vc = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=8, patch_size=2, position_embedding_size=8)
    cfg = DiffusionGemmaConfig(text_config=tc, vision_config=vc, canvas_length=8, tie_word_embeddings=tie,
                               image_token_id=127, boi_token_id=125, eoi_token_id=126)
    torch.manual_seed(0)
    hf = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():  # transformers' init is near-uniform: sharpen it and perturb the ones-initialised parts
        for name, p in hf.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif "norm" in name or "scale" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.9 if "encoder" in name else 1.1)  # the two stacks' scalars are stored separately
    return hf


def test_load_folder_saved_by_transformers(tmp_path):
    """save_pretrained folder (vision tower included, tied weights written once) -> dblock.load: same config,
    bitwise-equal teacher-forced K/V and logits (the encoder's and decoder's layer scalars kept apart)."""
    hf = _hf_tiny(softcap=12.0)
    hf.save_pretrained(str(tmp_path / "hf"))
    make_exact(hf)
    ours = dblock.load(str(tmp_path / "hf"))
    cfg = ours.config
    assert (cfg.family, cfg.canvas_length, cfg.global_head_dim, cfg.num_global_key_value_heads) == \
        ("diffusion_gemma", 8, 16, 1)
    assert cfg.final_logit_softcapping == 12.0 and cfg.image_token_id == 127 and cfg.block_size == 8
    assert float(ours.layers[0].enc_layer_scalar) == pytest.approx(0.9)
    assert float(ours.layers[0].layer_scalar) == pytest.approx(1.1)
    assert ours.vision_weights  # carried, never used

    def exact(kind, a, b):
        assert torch.equal(a, b), (kind, (a - b).abs().max())

    teacher_forced(ours, hf, [list(range(3, 12))], n_blocks=2, steps=2, check=exact)
    # Native decoding agrees too (its generation_config.json names no EOS: give transformers text_config's)
    dec = DecodeConfig(rule="entropy-bound", seed=4, max_new_tokens=24, steps=10)
    theirs, passes, _ = hf_generate(hf, [9, 10, 11], 4, dec, eos=1, pad=0)
    res = generate(ours, [[9, 10, 11]], dec)
    assert res.runs[0].generated == theirs and res.counters[0].F == passes
    # ... and a dblock save of it is loaded by transformers again with no missing key
    dblock.save(ours, str(tmp_path / "again"))
    hf_twin(ours, str(tmp_path / "again"))


def test_make_tiny_cli_folder_loads_in_transformers(tmp_path):
    """`dblock make-tiny --family diffusion_gemma` (dblock.tiny.make_tiny) -> from_pretrained: no missing,
    unexpected or mismatched key; the weights are dblock's."""
    from dblock.tiny import make_tiny
    out = make_tiny("diffusion_gemma", str(tmp_path / "t"), seed=5)
    hf = hf_twin(None, out)
    ours = dblock.load(out)
    assert torch.equal(hf.lm_head.weight, ours.embed_tokens.weight)
    assert torch.equal(hf.model.encoder.language_model.layers[2].experts.gate_up_proj,
                       ours.layers[2].experts.gate_up_proj)
    assert json.load(open(os.path.join(out, "generation_config.json")))["eos_token_id"] == 1
    again = make_tiny_gemma(seed=5)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))


def test_untied_folder(tmp_path):
    """tie_word_embeddings=False: transformers writes an lm_head and a separate encoder stack. Loaded when the
    encoder equals the decoder (the LM head is used); refused naming the key when the stacks differ."""
    hf = _hf_tiny(tie=False)
    enc = hf.model.encoder.language_model
    with torch.no_grad():
        for (name, p), (_, q) in zip(enc.layers.named_parameters(), hf.model.decoder.layers.named_parameters()):
            p.copy_(q)
        enc.embed_tokens.weight.copy_(hf.model.decoder.embed_tokens.weight)
    hf.save_pretrained(str(tmp_path / "ok"))
    ours = dblock.load(str(tmp_path / "ok"))
    assert ours.lm_head is not None and torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    make_exact(hf)
    teacher_forced(ours, hf, [[5, 6, 7, 8]], n_blocks=1, steps=2, check=_close)  # untied: lm_head used
    with torch.no_grad():
        enc.layers[1].mlp.up_proj.weight.add_(1.0)
    hf.save_pretrained(str(tmp_path / "bad"))
    with pytest.raises(WeightsError, match=r"model\.encoder\.language_model\.layers\.1\.mlp\.up_proj\.weight"):
        dblock.load(str(tmp_path / "bad"))


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("tie", [True, False])
def test_round_trip(tmp_path, sharded, tie):
    m = make_tiny_gemma(seed=2, tie_word_embeddings=tie)
    dblock.save(m, str(tmp_path / "m"), max_shard_bytes=300_000 if sharded else None)
    assert os.path.isfile(tmp_path / "m" / "model.safetensors.index.json") == sharded
    m2 = dblock.load(str(tmp_path / "m"))
    assert m2.config == m.config and m.state_dict().keys() == m2.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert m2.vision_weights.keys() == m.vision_weights.keys()


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "nan"])
def test_bad_weights_name_file_and_key(tmp_path, case):
    folder = str(tmp_path / "m")
    save_for_transformers(make_tiny_gemma(seed=0), folder)
    path = os.path.join(folder, "model.safetensors")
    t = load_file(path)
    key = "model.decoder.layers.2.self_attn.k_proj.weight"
    if case == "missing":
        del t[key]
    elif case == "unexpected":
        t["model.decoder.layers.2.self_attn.v_proj.weight"] = t[key].clone()   # full layers have no v_proj
        key = "model.decoder.layers.2.self_attn.v_proj.weight"
    elif case == "shape":
        t[key] = t[key][:-1].clone()
    else:
        t[key] = t[key].clone()
        t[key][0, 0] = float("nan")
    save_file(t, path)
    with pytest.raises(WeightsError, match=key.replace(".", r"\.")):
        dblock.load(folder)


# ---- configs and refused inputs ------------------------------------------------------------------------------------

def _hf_config_dict():
    cfg = tiny_gemma_config()
    return cfg.to_hf_dict()


def test_config_round_trip_and_defaults(tmp_path):
    d = _hf_config_dict()
    cfg = GemmaConfig.from_hf_dict(d, "x/config.json")
    ref = tiny_gemma_config()
    for k in ("vocab_size", "head_dim", "global_head_dim", "num_global_key_value_heads", "layer_types",
              "sliding_window", "canvas_length", "eos_token_ids", "pad_token_id", "rope_parameters"):
        assert getattr(cfg, k) == getattr(ref, k), k
    assert cfg.mask_token_id is None and cfg.top_k == cfg.num_experts_per_tok == 2
    # transformers' constructor form: no per_layer_config, global_head_dim / num_global_key_value_heads kwargs;
    # layer_types unset -> 5:1 pattern, last layer forced to full
    tc = dict(d["text_config"])
    for k in ("per_layer_config", "layer_types"):
        tc.pop(k)
    tc.update(num_hidden_layers=7, global_head_dim=32, num_global_key_value_heads=1)
    cfg = GemmaConfig.from_hf_dict({**d, "text_config": tc}, "x/config.json")
    assert cfg.layer_types == [SLIDING] * 5 + [FULL, FULL]
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads) == (32, 1)
    # EOS / pad from a generation_config.json beside the config (what transformers' generate uses)
    os.makedirs(tmp_path / "m")
    json.dump(d, open(tmp_path / "m" / "config.json", "w"))
    json.dump({"eos_token_id": [7, 1], "pad_token_id": 3}, open(tmp_path / "m" / "generation_config.json", "w"))
    cfg = load_config(str(tmp_path / "m"))
    assert cfg.eos_token_ids == (7, 1) and cfg.eos_token_id == 7 and cfg.pad_token_id == 3


def test_transformers_config_constructor_agrees(tmp_path):
    """A config transformers writes from its constructor kwargs reads to the same per-layer geometry."""
    from transformers import DiffusionGemmaConfig
    tc = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
              num_experts=4, top_k_experts=2, moe_intermediate_size=16)
    c = DiffusionGemmaConfig(text_config=tc, canvas_length=4, vision_config=dict(hidden_size=16))
    d = c.to_dict()
    cfg = GemmaConfig.from_hf_dict(d, "x/config.json")
    t = c.text_config
    assert cfg.layer_types == list(t.layer_types)
    for i in range(6):
        assert cfg.layer_head_dim(i) == t.per_layer_config[i].head_dim
        assert cfg.layer_kv_heads(i) == t.per_layer_config[i].num_key_value_heads
    assert cfg.sliding_window == t.sliding_window and cfg.canvas_length == 4


@pytest.mark.parametrize("path,value,match", [
    (("text_config", "use_bidirectional_attention"), "all", "use_bidirectional_attention"),
    (("text_config", "hidden_activation"), "silu", "hidden_activation"),
    (("text_config", "attention_bias"), True, "attention_bias"),
    (("text_config", "layer_types"), [SLIDING, "chunked_attention", FULL], "layer_types"),
    (("text_config", "rope_parameters"), {SLIDING: {"rope_type": "yarn", "rope_theta": 1.0},
                                          FULL: {"rope_type": "default"}}, "rope_type"),
    (("text_config", "rope_parameters"), {SLIDING: {"rope_type": "default", "partial_rotary_factor": 0.5},
                                          FULL: {"rope_type": "default"}}, "partial_rotary_factor"),
    (("text_config", "per_layer_config"), {"2": {"intermediate_size": 8}}, "per_layer_config"),
    (("text_config", "top_k_experts"), 99, "top_k_experts"),
    (("text_config", "sliding_window"), 1, "sliding_window"),
    (("text_config", "num_experts"), None, "num_experts"),
    (("text_config", "final_logit_softcapping"), None, "final_logit_softcapping"),
    (("text_config",), None, "text_config"),
])
def test_unsupported_config_values(path, value, match):
    d = json.loads(json.dumps(_hf_config_dict()))
    target = d
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    with pytest.raises(ConfigError, match=match):
        GemmaConfig.from_hf_dict(d, "x/config.json")


def test_image_inputs_refused():
    ours = make_ours("tiny")
    img = ours.config.image_token_id
    with pytest.raises(ValueError, match="image"):
        generate(ours, [[5, img, 6]], DecodeConfig(rule="entropy-bound", max_new_tokens=4, steps=2))
    with pytest.raises(ValueError, match="pixel_values"):
        ours.encode(torch.tensor([[5]]), torch.tensor([[0]]), {}, pixel_values=torch.zeros(1, 3, 4, 4))


def test_masked_rules_refused():
    with pytest.raises(ValueError, match="entropy-bound"):
        generate(make_ours("tiny"), [[5, 6]], DecodeConfig(max_new_tokens=4))


@pytest.mark.parametrize("name", ["tiny-uniform", "code-uniform"])
def test_bundled_folders_run_unchanged_in_transformers_generate(name):
    """A bundled DiffusionGemma folder, as it is on disk: transformers' from_pretrained + generate run it (its
    config carries an integer image_token_id: transformers' generate fails on null) and give dblock's reference
    tokens at batch 1 for the same seed and sampler settings."""
    import os

    from transformers import DiffusionGemmaForBlockDiffusion

    from dblock.weights_path import CHECKPOINTS_DIR
    folder = os.path.join(CHECKPOINTS_DIR, name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        pytest.fail(f"{folder}: the bundled model is missing")
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(folder).eval()
    ours = dblock.load(name)
    hf = hf.to(next(ours.parameters()).dtype)
    dec = DecodeConfig(rule="entropy-bound", seed=3, max_new_tokens=32)
    prompt = [5, 6, 7, 17] if name == "tiny-uniform" else [10, 300, 301, 12]
    theirs, passes, _ = hf_generate(hf, prompt, 3, dec, eos=ours.config.eos_token_id, pad=ours.config.pad_token_id)
    res = generate(ours, [prompt], dec)
    assert res.runs[0].generated == theirs and res.counters[0].F == passes
