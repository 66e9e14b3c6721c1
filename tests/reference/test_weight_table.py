"""The HF-name tables drive expected keys, loading and saving; loading streams file by file; keys real checkpoints
carry but dblock never uses are skipped, any other unexpected key is still an error."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import dblock
from dblock.errors import WeightsError
from dblock.families import FAMILIES
from dblock.reference.gemma_tiny import make_tiny_gemma
from dblock.tiny import make_tiny_model
from dblock.weights import export
from dblock.weights_read import expected, stream_tensors

LLADA_VARIANTS = [("llada2_moe", {}), ("llada2_moe", dict(use_qk_norm=False, use_expert_bias=False,
                                                          num_shared_experts=0, first_k_dense_replace=0)),
                  ("llada_moe", {}), ("llada_moe", dict(use_expert_bias=True, use_qk_norm=False))]


def _same(m, m2):
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert sd[k].dtype == sd2[k].dtype and torch.equal(sd[k], sd2[k]), k


@pytest.mark.parametrize("family,overrides", LLADA_VARIANTS)
def test_table_drives_expected_export_and_load(tmp_path, family, overrides):
    m = make_tiny_model(family, seed=3, **overrides)
    slots = FAMILIES[family].slots(m.config)
    tensors = export(m)
    # one table: the expected keys are the exported keys, with the exported shapes
    assert {k: tuple(t.shape) for k, t in tensors.items()} == expected(m.config)
    # every parameter and buffer of the model is filled by some row
    assert {s.param for s in slots.values()} == set(m.state_dict())
    dblock.save(m, str(tmp_path / "m"))
    _same(m, dblock.load(str(tmp_path / "m")))


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
def test_round_trip_bf16_keeps_expert_bias_fp32(tmp_path, family):
    m = make_tiny_model(family, seed=1, use_expert_bias=True).to(torch.bfloat16)
    dblock.save(m, str(tmp_path / "m"))
    bias = [k for k in load_file(str(tmp_path / "m" / "model.safetensors")) if k.endswith("expert_bias")]
    assert bias and all(load_file(str(tmp_path / "m" / "model.safetensors"))[k].dtype == torch.float32 for k in bias)
    m2 = dblock.load(str(tmp_path / "m"))
    assert m2.embed.weight.dtype == torch.bfloat16 and m2.layers[-1].mlp.expert_bias.dtype == torch.float32
    for k, v in m.state_dict().items():
        assert torch.equal(v.float(), m2.state_dict()[k].float()), k


def _write_shards(folder, tensors: dict, n: int) -> None:
    """Deal the keys round-robin over n shards (experts of one layer land in different files) + an index."""
    keys = sorted(tensors)
    wmap = {}
    for s in range(n):
        name = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[s::n]}
        save_file(part, os.path.join(folder, name), metadata={"format": "pt"})
        wmap.update({k: name for k in part})
    json.dump({"metadata": {}, "weight_map": wmap}, open(os.path.join(folder, "model.safetensors.index.json"), "w"))


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe", "diffusion_gemma"])
def test_streaming_sharded_load_is_identical(tmp_path, family):
    m = make_tiny_model(family, seed=6)
    d = tmp_path / "s"
    d.mkdir()
    json.dump(m.config.to_hf_dict(), open(d / "config.json", "w"))
    _write_shards(str(d), {k: v.detach().clone() for k, v in export(m).items()}, 3)
    _same(m, dblock.load(str(d)))
    # the stream yields every key once, file by file
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    wmap = json.load(open(d / "model.safetensors.index.json"))["weight_map"]
    seen = [k for k, _ in stream_tensors(str(d), expected(dblock.load_config(str(d))))]
    assert sorted(seen) == sorted(wmap) and len(seen) == len(set(seen))
    assert [files.index(wmap[k]) for k in seen] == sorted(files.index(wmap[k]) for k in seen)


IGNORED_KEYS = ["model.mtp.layers.0.mlp.gate.weight", "model.mtp_head.weight", "mtp.norm.weight",
                "model.layers.0.attention.rotary_emb.inv_freq"]


@pytest.mark.parametrize("sharded", [False, True])
def test_ignored_keys_are_skipped(tmp_path, sharded):
    m = make_tiny_model("llada2_moe", seed=2)
    d = tmp_path / "m"
    dblock.save(m, str(d))
    t = load_file(str(d / "model.safetensors"))
    t.update({k: torch.ones(4) for k in IGNORED_KEYS})
    if sharded:
        os.remove(d / "model.safetensors")
        _write_shards(str(d), t, 2)
    else:
        save_file(t, str(d / "model.safetensors"))
    _same(m, dblock.load(str(d)))


def test_other_unexpected_keys_still_fail(tmp_path):
    d = tmp_path / "m"
    dblock.save(make_tiny_model("llada_moe", seed=2), str(d))
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.mlp.mtp.weight"] = torch.ones(2)     # not an ignored pattern: mtp must start the key
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.safetensors: unexpected key 'model\.layers\.0\.mlp\.mtp\.weight'"):
        dblock.load(str(d))


def _untied_shards(tmp_path, edit=None):
    """A tie_word_embeddings=False DiffusionGemma with the encoder copies in the first shard, before the decoder's."""
    m = make_tiny_gemma(seed=1, tie_word_embeddings=False)
    d = tmp_path / "u"
    d.mkdir(parents=True)
    json.dump(m.config.to_hf_dict(), open(d / "config.json", "w"))
    t = {k: v.detach().clone().contiguous() for k, v in export(m).items()}
    if edit:
        edit(t)
    enc = {k: v for k, v in t.items() if k.startswith("model.encoder.language_model.")}
    rest = {k: v for k, v in t.items() if k not in enc}
    wmap = {}
    for name, part in (("model-00001-of-00002.safetensors", enc), ("model-00002-of-00002.safetensors", rest)):
        save_file(part, str(d / name), metadata={"format": "pt"})
        wmap.update({k: name for k in part})
    json.dump({"weight_map": wmap}, open(d / "model.safetensors.index.json", "w"))
    return m, str(d)


def test_untied_copies_checked_whichever_file_comes_first(tmp_path):
    m, d = _untied_shards(tmp_path)
    _same(m, dblock.load(d))
    enc = "model.encoder.language_model."

    def bump(key):
        def edit(t):
            t[key] = t[key] + 1.0
        return edit
    # the encoder's final norm feeds nothing: not checked
    _same(m, dblock.load(_untied_shards(tmp_path / "n", bump(enc + "norm.weight"))[1]))
    key = enc + "layers.1.mlp.up_proj.weight"
    with pytest.raises(WeightsError, match=rf"key '{key}' differs from the decoder's model\.decoder\.layers\.1\."):
        dblock.load(_untied_shards(tmp_path / "l", bump(key))[1])
    with pytest.raises(WeightsError, match="differs from the decoder's embedding"):
        dblock.load(_untied_shards(tmp_path / "e", bump(enc + "embed_tokens.weight"))[1])


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
def test_loaded_tensors_sit_in_aligned_memory(tmp_path, family):
    """Every tensor the loader yields, and every parameter of the loaded model, starts on a 64-byte boundary (a file
    can place a tensor anywhere: a one-row linear over a misaligned weight may round differently on AVX-512)."""
    from safetensors import safe_open
    from dblock.weights_read import ALIGN
    m = make_tiny_model(family, seed=2)
    dblock.save(m, str(tmp_path / "m"))
    f = str(tmp_path / "m" / "model.safetensors")
    with safe_open(f, "pt") as h:                                 # the file itself holds misaligned tensors
        raw = [h.get_tensor(k) for k in h.keys()]
    assert any(t.data_ptr() % ALIGN for t in raw if t.numel()), "no misaligned tensor in the file: test is moot"
    seen = list(stream_tensors(str(tmp_path / "m"), expected(m.config)))
    assert seen and all(t.data_ptr() % ALIGN == 0 for _, t in seen)
    m2 = dblock.load(str(tmp_path / "m"))
    assert all(t.data_ptr() % ALIGN == 0 for t in list(m2.parameters()) + list(m2.buffers()) if t.numel())
    _same(m, m2)
