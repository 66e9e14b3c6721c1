"""Hugging Face interoperability of model folders: models named by a Hugging Face id load from the local Hugging
Face cache only (never the network); the shard loop shows a progress bar only when asked for or on a terminal, never
in tests; a llada_moe config.json is written as the official LLaDA-MoE config writes `moe_layer_freq`."""
import json
import os
import shutil
import socket
import sys

import pytest
import torch

import dblock
from dblock.config import ConfigError, llada_config_from_dict, load_config
from dblock.errors import WeightsError
from dblock.tiny import make_tiny, make_tiny_model
from dblock.weights_path import CHECKPOINTS_DIR, hf_cache_dir, model_family, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMIT_V1 = "fedcba9876543210fedcba9876543210fedcba98"


def _add_snapshot(hub, repo_id: str, commit: str, src: str, ref: str = "main") -> str:
    """A cache entry laid out as huggingface_hub writes it: blobs/ holds the files, snapshots/<commit>/ links to
    them, refs/<ref> names the commit."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for name in sorted(os.listdir(src)):
        blob = repo / "blobs" / f"{commit[:8]}-{name}"
        shutil.copyfile(os.path.join(src, name), blob)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return str(snap)


@pytest.fixture
def hub(tmp_path_factory, monkeypatch):
    """HF_HOME at a temporary folder whose hub/ cache holds org/tiny (main and a v1 branch); nothing from the
    environment's own cache settings leaks in."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "DBLOCK_PROGRESS", "TQDM_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path_factory.mktemp("hf_home")
    src = make_tiny("llada2_moe", str(tmp_path_factory.mktemp("src") / "tiny"), seed=3)
    src_v1 = make_tiny("llada2_moe", str(tmp_path_factory.mktemp("src_v1") / "tiny"), seed=4)
    h = home / "hub"
    _add_snapshot(h, "org/tiny", COMMIT, src)
    _add_snapshot(h, "org/tiny", COMMIT_V1, src_v1, ref="v1")
    monkeypatch.setenv("HF_HOME", str(home))
    return dict(home=home, hub=h, src=src, src_v1=src_v1)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(*a, **k):
        raise AssertionError("dblock tried to open a network connection")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_load_by_id_from_hf_home(hub, no_network):
    snap = os.path.realpath(hub["hub"] / "models--org--tiny" / "snapshots" / COMMIT)
    assert hf_cache_dir() == str(hub["hub"])
    assert os.path.realpath(resolve_model_path("org/tiny")) == snap
    m = dblock.load("org/tiny")
    assert os.path.realpath(m.source) == snap and m.config.family == "llada2_moe"
    assert _same_weights(m, dblock.load(hub["src"]))
    assert model_family("org/tiny") == "llada2_moe"


def test_revision_branch_and_commit(hub, no_network):
    v1 = dblock.load("org/tiny@v1")
    assert _same_weights(v1, dblock.load(hub["src_v1"]))
    assert os.path.realpath(resolve_model_path(f"org/tiny@{COMMIT}")).endswith(COMMIT)
    with pytest.raises(WeightsError, match="revision 'v2'"):
        resolve_model_path("org/tiny@v2")


def test_ids_and_revisions_that_are_not_valid_are_refused_before_any_path(hub, monkeypatch, no_network):
    """`org/name@../../x` must not walk out of refs/: here the path it would form names the snapshot of another
    repository (`../../models--org--tiny/refs/main` from org/other), which a path join would happily load."""
    other = hub["hub"] / "models--org--other"
    (other / "refs").mkdir(parents=True)
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: pytest.fail("a path was formed from an invalid revision"))
    for bad, why in (("org/other@../../models--org--tiny/refs/main", "not a valid Hugging Face revision"),
                     ("org/tiny@..", "not a valid Hugging Face revision"), ("org/tiny@a//b", "revision"),
                     ("org/tiny@.hidden", "revision"), ("org/tiny@main.lock", "revision"),
                     ("org/ti..ny", "not a valid Hugging Face repository id"),
                     ("org/tiny--x", "not a valid Hugging Face repository id")):
        with pytest.raises(WeightsError, match=why):
            resolve_model_path(bad)


def test_hf_hub_cache_and_offline(hub, monkeypatch, no_network):
    # HF_HUB_CACHE names the hub folder itself and wins over HF_HOME
    monkeypatch.setenv("HF_HOME", str(hub["home"] / "elsewhere"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["hub"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert dblock.load("org/tiny").config.family == "llada2_moe"
    monkeypatch.delenv("HF_HUB_CACHE")
    with pytest.raises(WeightsError, match="elsewhere"):
        resolve_model_path("org/tiny")


def test_missing_id_is_one_clear_error(hub, no_network):
    with pytest.raises(WeightsError) as e:
        dblock.load("org/missing")
    msg = str(e.value)
    for needle in ("org/missing", "no such model folder", "not a bundled model", "tiny-masked",
                   f"not in the local Hugging Face cache {hub['hub']}", "never downloads",
                   "huggingface-cli download org/missing"):
        assert needle in msg, needle
    assert "\n" not in msg
    # not an id at all: the same three lookups named
    with pytest.raises(WeightsError, match="not a Hugging Face id of the form org/name") as e:
        resolve_model_path(str(hub["home"] / "no" / "such" / "folder"))
    assert str(hub["hub"]) in str(e.value)


def test_snapshot_without_config(hub, no_network):
    _add_snapshot(hub["hub"], "org/partial", COMMIT, hub["src"])
    os.remove(hub["hub"] / "models--org--partial" / "snapshots" / COMMIT / "config.json")
    with pytest.raises(WeightsError, match="no config.json"):
        resolve_model_path("org/partial")


def test_without_huggingface_hub_installed(hub, monkeypatch, no_network):
    """The cache layout is read directly when huggingface_hub is absent: same answers."""
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)     # `import huggingface_hub` -> ImportError
    assert os.path.realpath(resolve_model_path("org/tiny")).endswith(COMMIT)
    assert os.path.realpath(resolve_model_path("org/tiny@v1")).endswith(COMMIT_V1)
    assert os.path.realpath(resolve_model_path(f"org/tiny@{COMMIT_V1}")).endswith(COMMIT_V1)
    with pytest.raises(WeightsError, match="never downloads"):
        resolve_model_path("org/missing")


def test_order_bundled_then_folder_then_cache(hub, tmp_path, monkeypatch, no_network):
    # a folder named like a bundled model does not shadow it ...
    (tmp_path / "tiny-masked").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-masked") == os.path.join(CHECKPOINTS_DIR, "tiny-masked")
    # ... but a local folder that looks like an id wins over the cache
    local = make_tiny("llada2_moe", str(tmp_path / "org" / "tiny"), seed=5)
    assert resolve_model_path("org/tiny") == "org/tiny"
    assert _same_weights(dblock.load("org/tiny"), dblock.load(local))


# ---- progress bar of the shard loop --------------------------------------------------------------------------

@pytest.fixture
def sharded(tmp_path, monkeypatch):
    for var in ("DBLOCK_PROGRESS", "TQDM_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "sharded"
    dblock.save(make_tiny_model("llada2_moe", seed=0), str(out), max_shard_bytes=64_000)
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    return str(out)


def test_no_progress_when_stderr_is_not_a_terminal(sharded, capsys):
    dblock.load(sharded)
    assert capsys.readouterr().err == ""


def test_progress_forced(sharded, capsys, monkeypatch):
    n = len([f for f in os.listdir(sharded) if f.endswith(".safetensors")])
    dblock.load(sharded, progress=True)
    err = capsys.readouterr().err
    assert "loading sharded" in err and f"/{n} " in err and "shard" in err   # one step per shard file
    monkeypatch.setenv("DBLOCK_PROGRESS", "1")
    dblock.load(sharded)
    assert "loading sharded" in capsys.readouterr().err
    # TQDM_DISABLE wins; so does progress=False
    monkeypatch.setenv("TQDM_DISABLE", "1")
    dblock.load(sharded, progress=True)
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("TQDM_DISABLE")
    dblock.load(sharded, progress=False)
    assert capsys.readouterr().err == ""


def test_no_progress_for_one_small_file(capsys, monkeypatch):
    monkeypatch.setenv("DBLOCK_PROGRESS", "1")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    dblock.load("tiny-masked")
    assert capsys.readouterr().err == ""


def test_progress_names_a_cached_model_by_its_id(hub, capsys, monkeypatch):
    out = hub["home"] / "sh"
    dblock.save(make_tiny_model("llada2_moe", seed=0), str(out), max_shard_bytes=64_000)
    _add_snapshot(hub["hub"], "org/sharded", COMMIT, str(out))
    dblock.load("org/sharded", progress=True)
    assert "loading org/sharded" in capsys.readouterr().err


# ---- llada_moe config.json: moe_layer_freq as the official config writes it -------------------------------------

def test_llada_moe_round_trip_writes_moe_layer_freq_list(tiny_dirs):
    folder = tiny_dirs["llada_moe"]
    with open(os.path.join(folder, "config.json")) as f:
        d = json.load(f)
    assert d["moe_layer_freq"] == [1] * d["num_hidden_layers"]   # the official class indexes it per layer
    cfg = load_config(folder)
    assert cfg.to_hf_dict()["moe_layer_freq"] == d["moe_layer_freq"]
    assert dblock.load(folder).config.moe_layers == list(range(cfg.num_hidden_layers))


def test_bundled_checkpoints_are_not_llada_moe():
    """A bundled llada_moe checkpoint would have to be rewritten (its config.json written with the list)."""
    for name in os.listdir(CHECKPOINTS_DIR):
        path = os.path.join(CHECKPOINTS_DIR, name, "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                assert json.load(f)["model_type"] not in ("llada", "lladamoe", "llada_moe"), name


def _llada_moe_dict(tiny_dirs, **kw):
    with open(os.path.join(tiny_dirs["llada_moe"], "config.json")) as f:
        return {**json.load(f), **kw}


def test_moe_layer_freq_int_and_list_both_read(tiny_dirs):
    d = _llada_moe_dict(tiny_dirs)
    n = d["num_hidden_layers"]
    a = llada_config_from_dict({**d, "moe_layer_freq": 1})
    b = llada_config_from_dict({**d, "moe_layer_freq": [1] * n})
    c = llada_config_from_dict({k: v for k, v in d.items() if k != "moe_layer_freq"})
    assert llada_config_from_dict({**d, "moe_layer_freq": None}).moe_layers == list(range(n))
    assert a.moe_layers == b.moe_layers == c.moe_layers == list(range(n))


@pytest.mark.parametrize("freq, why", [
    ("short", "malformed"), ("long", "malformed"), ([2], "malformed"), (["1"], "malformed"), ([True], "malformed"),
    ([0.5], "malformed"), ("dense", "unsupported"), (2, "unsupported"), (0, "unsupported"), ("1", "unsupported"),
])
def test_moe_layer_freq_refused(tiny_dirs, freq, why):
    d = _llada_moe_dict(tiny_dirs)
    n = d["num_hidden_layers"]
    if freq == "short":
        freq = [1] * (n - 1)
    elif freq == "long":
        freq = [1] * (n + 1)
    elif freq == "dense":
        freq = [0] + [1] * (n - 1)        # well formed, but dblock implements every layer MoE only
    elif isinstance(freq, list):
        freq = freq * n
    with pytest.raises(ConfigError, match=f"{why} moe_layer_freq"):
        llada_config_from_dict({**d, "moe_layer_freq": freq}, "x/config.json")
