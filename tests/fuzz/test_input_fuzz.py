"""Hostile-user fuzzing of the files and flags the planner and the trainer read: decode traces (`--liveness-from`,
`--native-trace`, `simulate calibrate`), operator profiles (`--operator-profile`, `simulate predict --profile`), run
folders (`train-tiny --resume`, with and without --family) and `simulate plan`'s flags in both of its modes.

Each file starts from a valid one written by dblock itself and gets one damage: a value set to something hostile
(NaN, infinities, huge, negative, the wrong type, nested junk), a key deleted or added, the text cut, bytes that are
not UTF-8, a pickle where a state belongs. Every case must end in exit 0, or exit 2 with one line
`dblock: error: ...` naming a flag or the file, never `internal error`, never a hang, and a refused case changes
nothing (tests/fuzz/harness.py). A run folder's state never runs code: its pickles carry a payload that would create
a marker file, and the marker must never appear.

Hypothesis runs derandomized with fixed budgets (`EXAMPLES`); each test prints how many cases ran or were refused.
A case that runs is a real plan search, a simulated serving curve, a calibration or a training step (seconds of
CPU); one that is refused takes milliseconds.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz.harness import check_contract, run_cli
from tests.fuzz.test_cli_fuzz import SETTINGS, Opt, vector

EXAMPLES = {"trace": 40, "profile": 30, "run folder": 30, "plan flags": 40}
#: seconds one case may take before it counts as a hang: a plan that runs simulates its search (about 5 s of CPU),
#: so the bound is wider than the command-line fuzzers' on a machine whose cores are busy with other work
PLAN_BOUND = 120.0
NAN, INF = float("nan"), float("inf")
VALUES = [0, -1, 1, 3, 10 ** 12, 2 ** 64, -(10 ** 12), 0.5, -0.5, 1e308, 1e-308, NAN, INF, -INF, True, False, None,
          "", "7", "x", [], [1], [-1, 2], [NAN], {}, {"a": 1}, [[1, "a"]], "\u2603" * 3]
values = st.one_of(st.sampled_from(VALUES), st.integers(), st.floats(allow_nan=True, allow_infinity=True))


def damaged_json(draw, doc, max_depth=6):
    """`doc` (a JSON value) with one damage at a path drawn through it: set, delete or add."""
    node, path = doc, []
    for _ in range(max_depth):
        if isinstance(node, dict) and node and draw(st.integers(0, 3)):
            k = draw(st.sampled_from(sorted(node)))
        elif isinstance(node, list) and node and draw(st.integers(0, 3)):
            k = draw(st.integers(0, len(node) - 1))
        else:
            break
        path.append((node, k))
        node = node[k]
    kind = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
    if not path:
        return draw(values) if kind == "set" else doc
    parent, k = path[-1]
    if kind == "set":
        parent[k] = draw(values)
    elif kind == "delete":
        del parent[k]
    elif isinstance(parent, dict):
        parent[draw(st.sampled_from(["bogus", "passes", "event", "version", "tables"]))] = draw(values)
    else:
        parent.append(draw(values))
    return doc


def damaged_text(draw, text: str) -> bytes:
    """The file's text cut, broken or replaced by bytes that are not UTF-8."""
    cut = draw(st.integers(0, len(text)))
    return draw(st.sampled_from([text[:cut].encode(), b"\xff\xfe" + text.encode(), bytes(range(128, 256)),
                                 text.replace(":", "=", 1).encode(), text.encode() + b"}\n{",
                                 ("[" * 100000).encode(), b""]))


def _write(path, text_or_bytes):
    with open(path, "wb") as f:
        f.write(text_or_bytes if isinstance(text_or_bytes, bytes) else text_or_bytes.encode())


# ---- inputs written by dblock itself -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_dirs):
    """A Native trace and an operator profile of a random tiny llada2_moe, and a run folder stopped after 1 step."""
    import dblock
    from dblock.cli import main
    from dblock.profiling.profiler import Profiler
    from dblock.tasks.train import train
    from dblock.tasks.train_config import TrainConfig
    d = tmp_path_factory.mktemp("fuzz-sources")
    folder = tiny_dirs["llada2_moe"]
    prof = Profiler(dblock.load(folder), name="tiny", repeats=2, max_rows_blocks=2, max_requests=2, context_blocks=2,
                    min_sample_s=0.0, timer=time.thread_time).run(("reference",))
    prof.meta["model"]["name"] = folder
    prof.save(str(d / "profile.json"))
    assert main(["generate", "--model", folder, "--prompt-ids", "5,6,7", "--prompt-ids", "8,9,10,11",
                 "--max-new-tokens", "16", "--trace", str(d / "native.jsonl")]) == 0
    train(TrainConfig(family="llada2_moe", out=str(d / "run"), size="micro", steps=2, batch_size=2, warmup=1,
                      save_every=1, log_every=1, progress=False, length_chunk=2), stop_after=1, log=lambda *_: None)
    return dict(trace=str(d / "native.jsonl"), profile=str(d / "profile.json"), run=str(d / "run"), model=folder)


def plan_outcome(o) -> str:
    """`simulate plan` exits 1 when no plan holds the SLOs (SIMULATOR.md, "Infeasible"): a result, printed on
    stdout, with nothing on stderr but warnings and progress. Anything else is the harness's contract."""
    if o.rc == 1:
        assert o.out.strip() and "error" not in o.err and "Traceback" not in o.err, (o.argv, o.err[-500:])
        assert '"plans": []' in o.out or "no plan meets" in o.out or "no executor and cap holds" in o.out, o.out[-500:]
        return "infeasible"
    return check_contract(o)


def _fuzz(name, strategy, run_case, capsys):
    counts = Counter()

    @settings(max_examples=EXAMPLES[name], **SETTINGS)
    @given(strategy)
    def case(x):
        work = tempfile.mkdtemp(prefix="dblock-inputfuzz-")
        try:
            counts[run_case(x, work)] += 1
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()
    with capsys.disabled():
        print(f"\nfuzz {name}: {sum(counts.values())} cases ({counts['ok']} ran, {counts['refused']} refused"
              + (f", {counts['infeasible']} planned nothing" if counts["infeasible"] else "") + ")")
    assert sum(counts.values()) >= min(EXAMPLES[name], 10)
    return counts


# ---- traces --------------------------------------------------------------------------------------------------

@st.composite
def damaged_trace(draw, source):
    """(file bytes, how to read it): a Native trace with one event damaged, or its text broken."""
    with open(source) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if draw(st.integers(0, 4)) == 0:
        data = damaged_text(draw, "\n".join(json.dumps(e) for e in lines))
    else:
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = damaged_json(draw, lines[i])
        data = "\n".join(json.dumps(e) for e in lines).encode()
    use = draw(st.sampled_from(["pass", "serve", "calibrate", "predict"]))
    return data, use


def test_trace_fuzz(sources, capsys):
    def run_case(x, work):
        data, use = x
        path = os.path.join(work, "trace.jsonl")
        _write(path, data)
        shutil.copy(sources["profile"], os.path.join(work, "p.json"))
        argv = {"pass": ["simulate", "pass", "--model", sources["model"], "--batch", "1,8", "--liveness-from",
                         "trace.jsonl"],
                "serve": ["simulate", "serve", "--model", sources["model"], "--rates", "2", "--requests", "20",
                          "--path", "dense", "--liveness-from", "trace.jsonl"],
                "calibrate": ["simulate", "calibrate", "trace.jsonl"],
                "predict": ["simulate", "predict", "--profile", "p.json", "--native-trace", "trace.jsonl",
                            "--executors", "reference", "--schedules", "native"]}[use]
        return check_contract(run_cli(argv, work, PLAN_BOUND))
    _fuzz("trace", damaged_trace(sources["trace"]), run_case, capsys)


# ---- operator profiles ---------------------------------------------------------------------------------------

@st.composite
def damaged_profile(draw, source):
    with open(source) as f:
        text = f.read()
    if draw(st.integers(0, 5)) == 0:
        return damaged_text(draw, text), draw(st.booleans())
    d = damaged_json(draw, json.loads(text), max_depth=draw(st.integers(1, 6)))
    return json.dumps(d).encode(), draw(st.integers(0, 3)) == 0      # the profiled plan now and then: the costlier


def test_profile_fuzz(sources, capsys):
    def run_case(x, work):
        data, plan = x
        _write(os.path.join(work, "p.json"), data)
        shutil.copy(sources["trace"], os.path.join(work, "native.jsonl"))
        argv = (["simulate", "plan", "--operator-profile", "p.json", "--liveness-from", "native.jsonl", "--slo-itl",
                 "0.5", "--caps", "2", "--executors", "dense", "--requests", "20"] if plan else
                ["simulate", "predict", "--profile", "p.json", "--requests", "4", "--executors", "reference",
                 "--schedules", "native"])
        return plan_outcome(run_cli(argv, work, PLAN_BOUND))
    _fuzz("profile", damaged_profile(sources["profile"]), run_case, capsys)


# ---- run folders ---------------------------------------------------------------------------------------------

class Payload:
    """Unpickling this creates the marker file (the proof that a state ran code)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@st.composite
def damaged_run(draw):
    """(damage, detail) for a copy of a stopped run folder."""
    kind = draw(st.sampled_from(["metadata", "metadata", "metadata", "tensor", "bytes", "pickle", "old pickle",
                                 "missing", "tokenizer"]))
    if kind == "metadata":
        return kind, draw(st.integers(0, 10 ** 6))        # the seed of the damage, drawn again inside
    if kind == "tensor":
        return kind, (draw(st.sampled_from(["drop", "reshape", "dtype", "add"])), draw(st.integers(0, 10 ** 6)))
    if kind == "bytes":
        return kind, draw(st.sampled_from(["cut", "random", "empty"]))
    if kind in ("pickle", "old pickle"):
        return kind, draw(st.sampled_from(["zip", "plain"]))
    return kind, None


def _damage_run(run, kind, detail, marker):
    import random

    import torch
    from safetensors import safe_open
    from safetensors.torch import load, save

    from dblock.tasks.train_state import META_KEY, OLD_STATE_FILE, STATE_FILE
    path = os.path.join(run, STATE_FILE)
    if kind in ("metadata", "tensor"):
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()[META_KEY])
        t = load(open(path, "rb").read())
        if kind == "metadata":
            rng = random.Random(detail)
            d = {"config": meta["config"], "top": meta, "group": meta["param_groups"][0]}[
                rng.choice(["config", "top", "group"])]
            d[rng.choice(sorted(d) + ["bogus"])] = rng.choice(VALUES)
        else:
            how, seed = detail
            name = random.Random(seed).choice(sorted(t))
            if how == "drop":
                del t[name]
            elif how == "reshape":
                t[name] = t[name].reshape(-1)[:max(0, t[name].numel() - 1)].clone()
            elif how == "dtype":
                t[name] = t[name].to(torch.float16 if t[name].dtype != torch.float16 else torch.float32)
            else:
                t[f"optimizer.{seed % 1000}.exp_avg"] = torch.zeros(2)
        data = save(t, metadata={META_KEY: json.dumps(meta)})     # before the file is truncated: `t` maps it
        _write(path, data)
    elif kind == "bytes":
        data = open(path, "rb").read()
        _write(path, {"cut": data[:len(data) // 3], "random": random.Random(7).randbytes(4096), "empty": b""}[detail])
    elif kind in ("pickle", "old pickle"):
        target = path if kind == "pickle" else os.path.join(run, OLD_STATE_FILE)
        if kind == "old pickle":
            os.remove(path)
        obj = {"config": {"family": "llada2_moe"}, "step": 1, "x": Payload(marker)}
        if detail == "zip":
            torch.save(obj, target)
        else:
            with open(target, "wb") as f:
                pickle.dump(obj, f)
    elif kind == "missing":
        os.remove(path)
    else:
        _write(os.path.join(run, "tokenizer.json"), b"{not a tokenizer")


def test_run_folder_fuzz(sources, capsys):
    def run_case(x, work):
        (kind, detail), family = x
        run = os.path.join(work, "run")
        shutil.copytree(sources["run"], run)
        marker = os.path.join(tempfile.gettempdir(), f"dblock-fuzz-marker-{os.getpid()}")
        _damage_run(run, kind, detail, marker)
        o = run_cli(["train-tiny", "--resume", "--out", "run", "--no-progress"] +
                    (["--family", "llada2_moe"] if family else []), work, PLAN_BOUND)
        ran = os.path.exists(marker)
        if ran:
            os.remove(marker)
        assert not ran, f"a {kind} ({detail}) state ran code"
        outcome = check_contract(o)
        if kind in ("pickle", "old pickle", "bytes", "missing", "tensor"):
            assert outcome == "refused", (kind, detail, o.err)
        return outcome
    _fuzz("run folder", st.tuples(damaged_run(), st.booleans()), run_case, capsys)


# ---- simulate plan's flags -----------------------------------------------------------------------------------

HUGE = [str(10 ** 9), str(2 ** 64), "1" * 40]
WRONG = ["abc", "", "1e3x", "0x10"]


@st.composite
def plan_argv(draw):
    profiled = draw(st.booleans())
    both = [Opt("--slo-itl", ["0.5", "0.2"], ["0", "-1", "nan", "inf"] + WRONG, p=0.9),
            Opt("--slo-ttft", ["5"], ["0", "-1", "nan"] + WRONG, p=0.3),
            Opt("--caps", ["2", "2,4"], ["0", "", ",,", "-2", "1e9", "x"], p=0.6),
            Opt("--executors", ["dense"], ["", ",,", "fast", "dense,,"], p=0.8),
            Opt("--requests", ["20"], ["0", "19", "-1"] + HUGE + WRONG, p=0.8),
            Opt("--top", ["1"], ["0", "1000"] + WRONG, p=0.3),
            Opt("--seed", ["0", "7"], ["-1"] + HUGE, p=0.2),
            Opt("--json", [None], p=0.5)]
    roofline = [Opt("--model", ["llada2-mini"], ["", "nonexistent", "."], p=0.9),      # one small search when valid
                Opt("--hardware", ["h200"], ["", ",,", "tpu"], p=1.0),
                Opt("--gpus-per-replica", ["8"], ["3", "0", ""], p=1.0),
                Opt("--rate", ["2", "5"], ["0", "-1", "nan", "inf"] + WRONG, p=0.9),
                Opt("--price", ["h200=2"], ["h200=-1", "h200=nan", "x=1", "=", ""], p=0.2),
                Opt("--prompt", ["const:256"], ["const:1e12", "gamma:nan,1", "bogus", ""], p=0.3),
                Opt("--tokens", ["const:64"], ["const:-5", "", "uniform:9,1"], p=0.3),
                Opt("--passes", ["gamma:5,0.3"], ["gamma:inf,0.3", "const:0", ""], p=0.2),
                Opt("--calibration", ["none", "fig2"], ["1", "nan,1", ""], p=0.2),
                Opt("--max-gpus", ["64"], ["0"] + HUGE, p=0.1),
                Opt("--liveness-from", ["code-masked"], ["nope.jsonl", "."], p=0.2)]
    profile = [Opt("--operator-profile", ["p.json"], ["missing.json", ".", ""], p=1.0),
               Opt("--liveness-from", ["native.jsonl"], ["nope.jsonl", "", "."], p=0.95),
               Opt("--scale", ["1", "2"], ["0", "-1", "nan", "1e9"], p=0.3),
               Opt("--rate-margin", ["0.1"], ["-1", "nan", "11"], p=0.3)]
    # the other mode's flags, now and then: refused by name
    stray = draw(st.sampled_from([[], [], [], ["--rate-margin", "0.1"], ["--scale", "2"], ["--hardware", "h200"],
                                  ["--rate", "3"], ["--passes", "gamma:4,0.3"], ["--model", "llada2-mini"]]))
    argv = vector(draw, ["simulate", "plan"], both + (profile if profiled else roofline))
    return argv + stray


def test_plan_flag_fuzz(sources, capsys):
    def run_case(argv, work):
        shutil.copy(sources["profile"], os.path.join(work, "p.json"))
        shutil.copy(sources["trace"], os.path.join(work, "native.jsonl"))
        o = run_cli(argv, work, PLAN_BOUND)
        outcome = plan_outcome(o)
        profiled = "--operator-profile" in argv
        other_mode = {"--hardware", "--rate", "--passes", "--model"} if profiled else {"--rate-margin", "--scale"}
        if other_mode & set(argv):                   # a flag of the other mode: it would do nothing
            assert outcome == "refused", (argv, o.err)
        return outcome
    _fuzz("plan flags", plan_argv(), run_case, capsys)
