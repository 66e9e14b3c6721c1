"""Loader round trips and every bad-input case: one error naming the file and key, nothing loaded."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import dblock
from dblock.errors import WeightsError
from dblock.tiny import make_tiny_model


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip(tmp_path, family, sharded):
    m = make_tiny_model(family, seed=4)
    dblock.save(m, str(tmp_path / "m"), max_shard_bytes=200_000 if sharded else None)
    files = os.listdir(tmp_path / "m")
    assert ("model.safetensors.index.json" in files) == sharded
    m2 = dblock.load(str(tmp_path / "m"))
    for (k, a), (k2, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert m2.config == m.config or m2.config.to_hf_dict() == m.config.to_hf_dict()


def test_hf_names_on_disk(tiny_dirs):
    keys = set(load_file(os.path.join(tiny_dirs["llada2_moe"], "model.safetensors")))
    assert "model.layers.1.attention.query_key_value.weight" in keys
    assert "model.layers.1.mlp.gate.expert_bias" in keys and "model.layers.1.mlp.experts.15.down_proj.weight" in keys
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    t = load_file(os.path.join(tiny_dirs["llada2_moe"], "model.safetensors"))
    assert t["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32
    keys = set(load_file(os.path.join(tiny_dirs["llada_moe"], "model.safetensors")))
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.embed_tokens.weight" in keys


def test_dtype_conversion_keeps_bias_fp32(tiny_dirs):
    m = dblock.load(tiny_dirs["llada2_moe"], dtype="bfloat16")
    assert m.embed.weight.dtype == torch.bfloat16 and m.layers[1].mlp.expert_bias.dtype == torch.float32


@pytest.fixture
def folder(tmp_path, tiny_dirs):
    d = tmp_path / "bad"
    shutil.copytree(tiny_dirs["llada2_moe"], d)
    return d


def _edit(folder, fn):
    path = folder / "model.safetensors"
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


def test_truncated_file(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="model.safetensors.*unreadable"):
        dblock.load(str(folder))


def test_missing_key(folder):
    _edit(folder, lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(WeightsError, match="missing key 'model.layers.2.mlp.experts.3.up_proj.weight'"):
        dblock.load(str(folder))


def test_unexpected_key(folder):
    _edit(folder, lambda t: t.__setitem__("model.layers.9.extra.weight", torch.zeros(2)))
    with pytest.raises(WeightsError, match="unexpected key 'model.layers.9.extra.weight'"):
        dblock.load(str(folder))


def test_wrong_shape(folder):
    _edit(folder, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    with pytest.raises(WeightsError, match=r"'model.norm.weight' has shape \(65,\), expected \(64,\)"):
        dblock.load(str(folder))


def test_nan_weight(folder):
    def poison(t):
        t["lm_head.weight"][3, 3] = float("nan")
    _edit(folder, poison)
    with pytest.raises(WeightsError, match="'lm_head.weight' contains NaN or Inf"):
        dblock.load(str(folder))


def test_unknown_model_type_and_bad_config(folder):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mystery"}))
    with pytest.raises(ValueError, match="unknown model_type 'mystery'"):
        dblock.load(str(folder))
    (folder / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        dblock.load(str(folder))


def test_sharded_index_mismatch(tmp_path):
    m = make_tiny_model("llada2_moe", seed=4)
    d = tmp_path / "s"
    dblock.save(m, str(d), max_shard_bytes=200_000)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k + ".ghost"] = idx["weight_map"][k]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(WeightsError, match="ghost.*listed in the index but not in the shard"):
        dblock.load(str(d))


def test_no_weights_and_unknown_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(make_tiny_model("llada2_moe").config.to_hf_dict()))
    with pytest.raises(WeightsError, match="no model.safetensors"):
        dblock.load(str(tmp_path))
    with pytest.raises(WeightsError, match="not a bundled model"):
        dblock.load("no-such-model-anywhere")


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    """A save that fails midway leaves the destination as it was."""
    m = make_tiny_model("llada2_moe", seed=4)
    dest = tmp_path / "dest"
    dblock.save(m, str(dest))
    before = (dest / "model.safetensors").read_bytes()
    import dblock.weights_write as W

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError):
        W.save(make_tiny_model("llada2_moe", seed=5), str(dest))
    assert (dest / "model.safetensors").read_bytes() == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".dblock-save-")]
