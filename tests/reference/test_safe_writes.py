"""Writes that leave nothing half-done (dblock.save, make_tiny, train-tiny's folder) and shard paths confined to the
model folder: every refusal names the culprit and changes nothing on disk."""
import errno
import json
import os
import stat

import pytest
import torch

import dblock
import dblock.weights_read as WR
import dblock.weights_write as WW
from dblock.errors import ConfigError, DblockError, OutputExistsError, WeightsError
from dblock.tasks.train import STATE_FILE, train
from dblock.tasks.train_config import TrainConfig
from dblock.tiny import make_tiny, make_tiny_model


def snapshot(folder) -> dict:
    """{relative path: bytes} of every file under `folder` (symlinks as their target)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = os.readlink(p) if os.path.islink(p) else open(p, "rb").read()
    return out


def leftovers(parent) -> list:
    return sorted(p for p in os.listdir(parent) if p.startswith(".dblock-"))


def disk_full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llada2_moe", seed=3)


@pytest.fixture
def old(tmp_path):
    """A model folder from an earlier save, with a tokenizer and a note beside the weights."""
    d = tmp_path / "m"
    dblock.save(make_tiny_model("llada_moe", seed=1), str(d), max_shard_bytes=100_000)
    (d / "tokenizer.json").write_text("{}")
    (d / "notes.txt").write_text("mine")
    return d


# ---------------------------------------------------------------------------------------------------------------
# dblock.save
# ---------------------------------------------------------------------------------------------------------------

def test_new_and_empty_folders_are_fine(tmp_path, model):
    dblock.save(model, str(tmp_path / "a" / "b"))                 # parents created
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o750)
    dblock.save(model, str(empty))
    assert sorted(os.listdir(empty)) == ["config.json", "model.safetensors"]
    assert stat.S_IMODE(os.stat(empty).st_mode) == 0o750          # the folder's permissions are kept
    new = tmp_path / "new"
    dblock.save(model, str(new))
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o777 & ~_umask()  # not mkdtemp's 0700
    assert leftovers(tmp_path) == []


def test_empty_current_folder_is_fine(tmp_path, model, monkeypatch):
    """'.' cannot be renamed over: the files are moved into the (empty) folder instead."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    dblock.save(model, ".")
    assert sorted(os.listdir(".")) == ["config.json", "model.safetensors"] and leftovers(tmp_path) == []


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_non_empty_folder_refused_before_anything(tmp_path, model, old, monkeypatch):
    before = snapshot(old)
    monkeypatch.setattr(WW, "export", lambda m: pytest.fail("exported before the folder was checked"))
    with pytest.raises(OutputExistsError) as e:
        dblock.save(model, str(old))
    msg = str(e.value)
    assert isinstance(e.value, DblockError) and isinstance(e.value, FileExistsError)
    assert msg.startswith(f"{old}: output folder is not empty (holds config.json, model-00001-of-")
    assert "nothing was written" in msg and "overwrite=True (--overwrite)" in msg
    assert snapshot(old) == before and leftovers(old.parent) == []


def test_a_file_is_not_a_folder(tmp_path, model):
    f = tmp_path / "f"
    f.write_text("x")
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError, match=f"{f}: exists and is not a folder"):
            dblock.save(model, str(f), overwrite=overwrite)
    assert f.read_text() == "x"


def test_overwrite_replaces_the_whole_folder(model, old):
    dblock.save(model, str(old), overwrite=True)
    assert sorted(os.listdir(old)) == ["config.json", "model.safetensors"]   # no stale shards, tokenizer, notes
    m = dblock.load(str(old))
    assert m.config.family == "llada2_moe"
    for k, v in model.state_dict().items():
        assert torch.equal(v, m.state_dict()[k]), k
    assert leftovers(old.parent) == []


def test_overwrite_never_replaces_cwd_home_or_root(tmp_path, model, monkeypatch):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "keep.txt").write_text("x")
    monkeypatch.chdir(work / "sub")
    for out in (".", "..", str(work)):
        with pytest.raises(OutputExistsError, match="is the current folder or one above it"):
            dblock.save(model, out, overwrite=True)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(OutputExistsError, match="is the home folder"):
        dblock.save(model, str(tmp_path), overwrite=True)
    with pytest.raises(OutputExistsError, match="is the filesystem root"):
        dblock.save(model, os.sep, overwrite=True)
    assert os.listdir(work) == ["sub"] and leftovers(tmp_path) == []


def test_overwrite_through_a_symlink_leaves_its_target(tmp_path, model, old):
    link = tmp_path / "link"
    os.symlink(old, link)
    before = snapshot(old)
    with pytest.raises(OutputExistsError, match="output folder is not empty"):
        dblock.save(model, str(link))
    dblock.save(model, str(link), overwrite=True)
    assert not os.path.islink(link) and sorted(os.listdir(link)) == ["config.json", "model.safetensors"]
    assert snapshot(old) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_failure_midway_changes_nothing(tmp_path, model, old, monkeypatch, overwrite):
    """A full disk while the weights are written: no temp folder left, the destination as it was."""
    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    target = old if overwrite else tmp_path / "fresh"
    before = snapshot(target) if overwrite else None
    with pytest.raises(OSError, match="No space left"):
        dblock.save(model, str(target), overwrite=overwrite)
    assert leftovers(tmp_path) == []
    if overwrite:
        assert snapshot(target) == before
    else:
        assert not target.exists()


def test_failure_in_extra_files_and_interrupt(tmp_path, model, old, monkeypatch):
    before = snapshot(old)

    class Boom(KeyboardInterrupt):
        pass

    real_open = open

    def open_(path, *a, **k):
        if str(path).endswith("generation_config.json"):
            raise Boom()
        return real_open(path, *a, **k)
    monkeypatch.setattr("builtins.open", open_)
    with pytest.raises(Boom):
        dblock.save(model, str(old), extra_files={"generation_config.json": "{}"}, overwrite=True)
    monkeypatch.undo()
    assert snapshot(old) == before and leftovers(tmp_path) == []


def test_failed_swap_is_rolled_back(tmp_path, model, old, monkeypatch):
    """The second rename of the swap (new folder -> destination) fails: the old folder is put back."""
    before = snapshot(old)
    real = os.rename
    calls = []

    def rename(src, dst):
        calls.append((os.path.basename(src), os.path.basename(dst)))
        if os.path.basename(src).startswith(WW.STAGE_PREFIX) and len(calls) > 1:
            raise OSError(errno.EIO, "I/O error")
        return real(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="I/O error"):
        dblock.save(model, str(old), overwrite=True)
    monkeypatch.undo()
    assert snapshot(old) == before and leftovers(tmp_path) == []


def test_bad_extra_file_names_and_shard_sizes(tmp_path, model):
    for name in ("../escape.json", "sub/x.json", "", ".."):
        with pytest.raises(ConfigError, match="is not a plain file name"):
            dblock.save(model, str(tmp_path / "x"), extra_files={name: "{}"})
    with pytest.raises(ConfigError, match="max_shard_bytes=0"):
        dblock.save(model, str(tmp_path / "x"), max_shard_bytes=0)
    assert not (tmp_path / "x").exists() and leftovers(tmp_path) == [] and not (tmp_path / "escape.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# make_tiny and the CLI
# ---------------------------------------------------------------------------------------------------------------

def test_make_tiny_refuses_non_empty_before_building(old, monkeypatch):
    before = snapshot(old)
    monkeypatch.setattr("dblock.tiny.make_tiny_model", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(OutputExistsError, match="output folder is not empty"):
        make_tiny("llada2_moe", str(old))
    assert snapshot(old) == before


def test_make_tiny_overwrite_and_empty(tmp_path, old):
    make_tiny("diffusion_gemma", str(old), seed=0, overwrite=True)
    assert sorted(os.listdir(old)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert dblock.load(str(old)).config.family == "diffusion_gemma"
    (tmp_path / "e").mkdir()
    make_tiny("llada_moe", str(tmp_path / "e"))
    assert dblock.load(str(tmp_path / "e")).config.family == "llada_moe"


def test_cli_make_tiny_into_non_empty_is_one_line(old, capsys):
    from dblock.cli import main
    before = snapshot(old)
    rc = main(["make-tiny", "--family", "llada2_moe", "--out", str(old)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"dblock: error: {old}: output folder is not empty")
    assert len(err.strip().splitlines()) == 1 and snapshot(old) == before


# ---------------------------------------------------------------------------------------------------------------
# train-tiny's output folder
# ---------------------------------------------------------------------------------------------------------------

def micro(out, **kw):
    base = dict(family="llada2_moe", out=str(out), size="micro", steps=2, batch_size=2, warmup=1, save_every=1,
                log_every=1, progress=False, length_chunk=1)
    return TrainConfig(**{**base, **kw})


def quiet(*a):
    pass


def test_train_refuses_non_empty_before_compute(old, monkeypatch):
    before = snapshot(old)
    monkeypatch.setattr("dblock.tasks.train.build_model", lambda cfg: pytest.fail("built a model"))
    with pytest.raises(OutputExistsError, match="output folder is not empty"):
        train(micro(old), log=quiet)
    with pytest.raises(ConfigError, match="--overwrite with --resume"):
        train(micro(old), resume=True, overwrite=True, log=quiet)
    assert snapshot(old) == before and leftovers(old.parent) == []


def test_train_overwrite_replaces_folder(old):
    train(micro(old), log=quiet, overwrite=True)
    assert sorted(os.listdir(old)) == sorted(["config.json", "model.safetensors", STATE_FILE, "tokenizer.json",
                                              "tokenizer_config.json", "train_summary.json"])   # notes.txt gone
    assert dblock.load(str(old)).config.vocab_size == 32 and leftovers(old.parent) == []


def test_train_failure_with_overwrite_changes_nothing(old, monkeypatch):
    before = snapshot(old)
    import dblock.tasks.train as T
    real = T.save_state
    n = []

    def save_state(*a, **k):
        n.append(1)
        if len(n) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)
    monkeypatch.setattr(T, "save_state", save_state)
    with pytest.raises(OSError, match="No space left"):
        train(micro(old), log=quiet, overwrite=True)
    assert snapshot(old) == before and leftovers(old.parent) == []


def test_train_stop_after_with_overwrite_leaves_the_checkpoint_only(old):
    train(micro(old), stop_after=1, log=quiet, overwrite=True)
    assert os.listdir(old) == [STATE_FILE]
    s = train(micro(old), resume=True, log=quiet)              # and the run resumes there
    assert s["steps_done"] == 2 and (old / "model.safetensors").exists() and leftovers(old.parent) == []


def test_resume_keeps_own_files_and_replaces_stale_weights(tmp_path):
    d = tmp_path / "run"
    train(micro(d), stop_after=1, log=quiet)
    (d / "MODEL_CARD.md").write_text("card")
    (d / "model-00001-of-00002.safetensors").write_bytes(b"stale")   # stale shards beside the checkpoint
    (d / "model.safetensors.index.json").write_text("{}")
    (d / (STATE_FILE + ".tmp")).write_bytes(b"partial")
    train(micro(d), resume=True, log=quiet)
    assert sorted(os.listdir(d)) == sorted(["MODEL_CARD.md", "config.json", "model.safetensors", STATE_FILE,
                                            "tokenizer.json", "tokenizer_config.json", "train_summary.json"])
    assert dblock.load(str(d)).config.family == "llada2_moe"


def test_resume_from_missing_folder_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(micro(tmp_path / "none"), resume=True, log=quiet)
    assert not (tmp_path / "none").exists()


def test_checkpoint_tmp_removed_on_failure(tmp_path, monkeypatch):
    d = tmp_path / "run"
    train(micro(d), stop_after=1, log=quiet)
    before = (d / STATE_FILE).read_bytes()
    import dblock.tasks.train_state as T

    class Full:                    # the checkpoint file: half of it written, then the disk is full
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def write(self, data):
            self.f.write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()
    monkeypatch.setattr(T, "open", Full, raising=False)
    with pytest.raises(OSError, match=r"train_state.st: could not be written \(ENOSPC: No space left on device\)"):
        train(micro(d), resume=True, log=quiet)
    monkeypatch.delattr(T, "open")
    assert (d / STATE_FILE).read_bytes() == before and not (d / (STATE_FILE + ".tmp")).exists()


# ---------------------------------------------------------------------------------------------------------------
# shard paths confined to the model folder
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def sharded(tmp_path):
    d = tmp_path / "s"
    dblock.save(make_tiny_model("llada2_moe", seed=4), str(d), max_shard_bytes=200_000)
    return d


def _index(d):
    return json.loads((d / "model.safetensors.index.json").read_text())


def _set_entry(d, name):
    idx = _index(d)
    key = sorted(idx["weight_map"])[0]
    idx["weight_map"][key] = name
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return key


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "dir_symlink", "not_a_string"])
def test_index_entries_cannot_leave_the_folder(tmp_path, sharded, kind, monkeypatch):
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((sharded / sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[0])
                        .read_bytes())
    name = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink": "link.safetensors",
            "dir_symlink": "sub/outside.safetensors", "not_a_string": 7}[kind]
    if kind == "symlink":
        os.symlink(outside, sharded / "link.safetensors")
    if kind == "dir_symlink":
        os.symlink(tmp_path, sharded / "sub")
    key = _set_entry(sharded, name)
    monkeypatch.setattr(WR, "safe_open", lambda path, *a, **k: pytest.fail(f"read {path}"))
    with pytest.raises(WeightsError) as e:
        dblock.load(str(sharded))
    msg = str(e.value)
    index = sharded / "model.safetensors.index.json"
    assert msg.startswith(f"{index}: weight_map entry {key!r}: {name!r} "), msg
    assert {"dotdot": "leaves the model folder", "absolute": "is an absolute path", "symlink": "outside the model",
            "dir_symlink": "outside the model", "not_a_string": "is not a file name"}[kind] in msg


def test_single_file_symlink_out_of_the_folder(tmp_path, monkeypatch):
    d = tmp_path / "m"
    dblock.save(make_tiny_model("llada2_moe", seed=4), str(d))
    os.replace(d / "model.safetensors", tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", d / "model.safetensors")
    monkeypatch.setattr(WR, "safe_open", lambda path, *a, **k: pytest.fail(f"read {path}"))
    with pytest.raises(WeightsError, match=f"{d / 'model.safetensors'}: 'model.safetensors' is a symlink to "):
        dblock.load(str(d))


def test_symlinks_inside_the_folder_and_hf_cache_blobs_are_fine(tmp_path):
    m = make_tiny_model("llada2_moe", seed=4)
    # a symlink to another file of the same folder
    d = tmp_path / "m"
    dblock.save(m, str(d), max_shard_bytes=200_000)
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    os.replace(d / shard, d / ("real-" + shard))
    os.symlink("real-" + shard, d / shard)
    dblock.load(str(d))
    # the Hugging Face cache layout: snapshots/<commit>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    dblock.save(m, str(tmp_path / "plain"), max_shard_bytes=200_000)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(tmp_path / "plain"))):
        os.replace(tmp_path / "plain" / f, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / f)
    loaded = dblock.load(str(snap))
    assert torch.equal(loaded.state_dict()["lm_head.weight"], m.state_dict()["lm_head.weight"])


def test_index_that_is_not_an_object(sharded):
    (sharded / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(WeightsError, match="model.safetensors.index.json: no 'weight_map' object"):
        dblock.load(str(sharded))
