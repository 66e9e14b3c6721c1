"""The training state of a run (dblock/tasks/train_state.py): nothing read from a run folder runs code, a resumed run
equals the uninterrupted one in every part of its state, and a damaged or hostile state file is one error naming it.

The hostile files are the ones a shared run folder could carry: a torch zip and a plain pickle whose `__reduce__`
would create a marker file when unpickled, as the old `train_state.pt` and under the new name; a state whose
metadata or tensors were edited. None may run, none may reach an internal error, none may change the folder.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

from dblock.errors import InputFileError
from dblock.tasks.train import train
from dblock.tasks.train_config import TrainConfig
from dblock.tasks.train_state import META_KEY, OLD_STATE_FILE, STATE_FILE, contents
from tests.fuzz.harness import check_contract, run_cli, snapshot


def micro_cfg(out, **kw):
    base = dict(family="llada2_moe", out=str(out), size="micro", steps=4, batch_size=4, warmup=2, save_every=2,
                log_every=1, progress=False, length_chunk=2)
    return TrainConfig(**{**base, **kw})


class Payload:
    """Unpickling this runs `open(marker, "w")`: the proof of code execution a test looks for."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _hostile(path, kind: str, marker: str) -> None:
    obj = {"config": {"family": "llada2_moe"}, "step": 1, "x": Payload(marker)}
    if kind == "zip":
        torch.save(obj, path)                        # torch's zip format, as the old train_state.pt was
    else:
        with open(path, "wb") as f:
            pickle.dump(obj, f)


@pytest.mark.parametrize("name", [OLD_STATE_FILE, STATE_FILE])
@pytest.mark.parametrize("kind", ["zip", "plain"])
@pytest.mark.parametrize("family", [[], ["--family", "llada2_moe"]], ids=["no-family", "family"])
def test_a_hostile_state_file_runs_no_code(tmp_path, name, kind, family):
    run = tmp_path / "run"
    run.mkdir()
    marker = str(tmp_path / "PWNED")
    _hostile(str(run / name), kind, marker)
    # the payload is live: plain unpickling would run it (what `torch.load(weights_only=False)` did)
    with open(run / name, "rb") as f:
        if kind == "plain":
            pickle.load(f)
    if kind == "zip":
        torch.load(run / name, weights_only=False)
    assert os.path.exists(marker)
    os.remove(marker)
    o = run_cli(["train-tiny", "--resume", "--out", "run", "--no-progress", *family], tmp_path)
    assert check_contract(o) == "refused"
    assert not os.path.exists(marker), "a state file ran code"
    line = o.err.strip()
    assert str(run / name).replace(str(tmp_path) + os.sep, "") in line or name in line, line
    if name == OLD_STATE_FILE:
        assert "earlier format" in line and "not opened" in line, line
    else:
        assert "not a readable train state" in line, line


def _strip_times(records):
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "eval_s")} for r in records]


def test_a_resumed_state_equals_the_uninterrupted_one_in_every_part(tmp_path):
    """Weights, AdamW's moments and steps, the expert loads' EMA, the RNG, the history and the evaluations: the
    state after stop-and-resume is the state of the uninterrupted run (times aside)."""
    kw = dict(eval_every=2, eval_n=2)
    train(micro_cfg(tmp_path / "a", **kw), log=lambda *_: None)
    train(micro_cfg(tmp_path / "b", **kw), stop_after=2, log=lambda *_: None)
    mid = contents(str(tmp_path / "b" / STATE_FILE))
    assert mid["step"] == 2 and mid["optimizer"] and len(mid["evals"]) == 1
    train(micro_cfg(tmp_path / "b", steps=None), resume=True, log=lambda *_: None)
    A, B = contents(str(tmp_path / "a" / STATE_FILE)), contents(str(tmp_path / "b" / STATE_FILE))
    assert A["step"] == B["step"] == 4 and A["total_steps"] == B["total_steps"] == 4
    assert A["model"].keys() == B["model"].keys() and all(torch.equal(A["model"][k], B["model"][k]) for k in A["model"])
    assert A["optimizer"].keys() == B["optimizer"].keys()
    for i in A["optimizer"]:
        assert A["optimizer"][i].keys() == B["optimizer"][i].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(A["optimizer"][i][k], B["optimizer"][i][k]) for k in A["optimizer"][i])
    assert torch.equal(A["loads"], B["loads"]) and A["loads"].dtype == torch.float64
    assert A["param_groups"] == B["param_groups"] and {**A["config"], "out": ""} == {**B["config"], "out": ""}
    assert _strip_times(A["history"]) == _strip_times(B["history"]) and len(A["history"]) == 4
    assert _strip_times(A["evals"]) == _strip_times(B["evals"]) and [e["step"] for e in A["evals"]] == [2, 4]


def test_restore_loads_every_tensor_where_it_belongs(tmp_path):
    """`TrainState.restore` puts the stored weights, AdamW state and RNG state back as they were saved."""
    from dblock.tasks.train import make_optimizer
    from dblock.tasks.train_model import build_model, make_tokenizer
    from dblock.tasks.train_state import read
    cfg = micro_cfg(tmp_path / "r")
    train(cfg, stop_after=3, log=lambda *_: None)
    path = str(tmp_path / "r" / STATE_FILE)
    want = contents(path)
    model = build_model(cfg, make_tokenizer(cfg, str(tmp_path / "r"), True))
    opt = make_optimizer(model, cfg)
    torch.manual_seed(12345)
    loads = read(path).restore(model, opt)
    assert torch.equal(torch.get_rng_state(), want["torch_rng"]) and torch.equal(loads, want["loads"])
    assert all(torch.equal(v, want["model"][k]) for k, v in model.state_dict().items())
    got = opt.state_dict()
    assert got["state"].keys() == want["optimizer"].keys()
    assert all(torch.equal(got["state"][i][k], want["optimizer"][i][k]) for i in got["state"] for k in got["state"][i])
    assert [dict(g, betas=list(g["betas"])) for g in got["param_groups"]] == want["param_groups"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A micro run stopped after 1 of 2 steps: a valid state to damage."""
    d = tmp_path_factory.mktemp("stopped") / "run"
    train(micro_cfg(d, steps=2), stop_after=1, log=lambda *_: None)
    return d


def _rewrite(src, dst, meta=None, tensors=None):
    """Copy the state file at `src` to `dst` with its metadata dict edited by `meta(d)` and its tensors by
    `tensors(t)` (each returns the new value)."""
    from safetensors import safe_open
    from safetensors.torch import load, save
    with safe_open(str(src), "pt") as f:
        d = json.loads(f.metadata()[META_KEY])
    t = load(src.read_bytes())
    d = meta(d) if meta else d
    t = tensors(t) if tensors else t
    text = d if isinstance(d, str) else json.dumps(d)
    dst.write_bytes(save(t, metadata={META_KEY: text}))


def _set(path, value):
    def edit(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return d
    return edit


DAMAGE = {
    "nan step": dict(meta=_set(["step"], float("nan"))),
    "step past total": dict(meta=_set(["step"], 99)),
    "huge block": dict(meta=_set(["config", "block_size"], 10 ** 9)),
    "string batch": dict(meta=_set(["config", "batch_size"], "4")),
    "unknown config key": dict(meta=_set(["config", "bogus"], 1)),
    "other format": dict(meta=_set(["format"], "dblock-train-state/9")),
    "other size": dict(meta=_set(["config", "size"], "huge")),
    "history not a list": dict(meta=_set(["history"], {"step": 1})),
    "groups of other params": dict(meta=lambda d: {**d, "param_groups": [dict(g, params=[0]) for g in
                                                                         d["param_groups"]]}),
    "lr not a number": dict(meta=lambda d: {**d, "param_groups": [dict(g, lr="fast") for g in d["param_groups"]]}),
    "metadata not JSON": dict(meta=lambda d: "{not json"),
    "wrong shape": dict(tensors=lambda t: {**t, "model.lm_head.weight": torch.zeros(3, 3)}),
    "wrong dtype": dict(tensors=lambda t: {**t, "loads": t["loads"].float()}),
    "extra tensor": dict(tensors=lambda t: {**t, "optimizer.999.exp_avg": torch.zeros(1)}),
    "unknown optimizer slot": dict(tensors=lambda t: {**t, "optimizer.0.momentum": torch.zeros(1)}),
    "missing tensor": dict(tensors=lambda t: {k: v for k, v in t.items() if k != "model.lm_head.weight"}),
    "missing moment": dict(tensors=lambda t: {k: v for k, v in t.items() if k != "optimizer.0.exp_avg_sq"}),
    "rng of the wrong length": dict(tensors=lambda t: {**t, "torch_rng": t["torch_rng"][:10].clone()}),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_state_is_one_error_naming_the_file_and_changes_nothing(stopped, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    _rewrite(stopped / STATE_FILE, run / STATE_FILE, **DAMAGE[damage])
    before = snapshot(str(run))
    with pytest.raises(InputFileError) as e:
        train(micro_cfg(run, steps=None), resume=True, log=lambda *_: None)
    msg = str(e.value)
    assert str(run / STATE_FILE) in msg and "\n" not in msg, msg
    assert snapshot(str(run)) == before
    o = run_cli(["train-tiny", "--resume", "--out", str(run), "--no-progress"], tmp_path)
    assert check_contract(o) == "refused" and STATE_FILE in o.err


def test_a_truncated_state_is_one_error_with_and_without_family(stopped, tmp_path):
    """The case that used to reach PytorchStreamReader's internal error when --family was given."""
    run = tmp_path / "run"
    run.mkdir()
    data = (stopped / STATE_FILE).read_bytes()
    (run / STATE_FILE).write_bytes(data[:len(data) // 2])
    for family in ([], ["--family", "llada2_moe"]):
        o = run_cli(["train-tiny", "--resume", "--out", "run", "--no-progress", *family], tmp_path)
        assert check_contract(o) == "refused" and "not a readable train state" in o.err, o.err


def test_resume_with_another_family_is_refused(stopped, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    o = run_cli(["train-tiny", "--resume", "--out", "run", "--family", "diffusion_gemma", "--no-progress"], tmp_path)
    assert check_contract(o) == "refused" and "--family diffusion_gemma" in o.err and "llada2_moe" in o.err


def test_the_package_loads_nothing_with_pickle():
    """No module of dblock calls torch.load on a file, pickle.load(s), eval, exec or yaml.load: the one torch.load
    left reads bytes its own spawned ranks sent (dblock/optimized/ep_launch.py), never a file."""
    import re
    root = os.path.join(os.path.dirname(__file__), "..", "..", "dblock")
    hits = []
    pat = re.compile(r"torch\.load\(|pickle\.loads?\(|(?<![\w.])eval\(|(?<![\w.])exec\(|yaml\.(unsafe_)?load\(|"
                     r"weights_only\s*=\s*False|marshal\.loads?\(|dill\.|joblib\.load")
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                for i, line in enumerate(open(path, encoding="utf-8"), 1):
                    if pat.search(line.split("#")[0]):
                        hits.append(f"{os.path.relpath(path, root)}:{i}: {line.strip()}")
    assert len(hits) == 1 and hits[0].startswith("optimized/ep_launch.py:") and "io.BytesIO(item[2])" in hits[0], \
        hits
