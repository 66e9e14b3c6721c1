"""The hostile inputs of the planner, the schedule comparison, the evaluation, the model lookup and stdout: each is
one line `dblock: error: ...` naming the flag and the file (exit 2, nothing written), or a run with one warning line
where the input is usable but not the model's own.

  traces        `passes: NaN`, `passes: 1e12`, random bytes as --liveness-from
  profiles      an operator profile of negative times; a profile of one family pricing a trace of another (refused),
                of another model of the same family (a warning naming both)
  flags         compare-schedules --schedules '' (as ',,'), simulate plan --rate-margin without --operator-profile
  tokenizers    eval of a task whose prompts the model's tokenizer cannot spell (the character named)
  the HF cache  a refs/main that climbs out of snapshots/ (a damaged cache, not a missing model)
  stdout        a full disk (ENOSPC) or a file-size limit (EFBIG) behind `> file`

The train state (code in a run folder) is tests/tasks/test_train_state.py; the flag rule over every command is
tests/cli/test_flag_rules.py.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from dblock.simulator.liveness import BUNDLED
from tests.fuzz.harness import check_contract, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = ["simulate", "plan", "--model", "llada2-mini", "--hardware", "h200", "--gpus-per-replica", "8", "--executors",
        "epoch", "--rate", "5", "--slo-itl", "0.1", "--requests", "40", "--top", "1"]


def _liveness(tmp_path, passes):
    with open(BUNDLED["code-masked"]) as f:
        d = json.load(f)
    d["blocks"] = [dict(b, passes=passes) for b in d["blocks"]]
    path = tmp_path / "live.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("passes, why", [(float("nan"), "passes"), (1e12, "passes"), (10 ** 12, "passes"),
                                         (-3, "passes"), ("7", "passes")])
def test_a_liveness_trace_with_impossible_passes_is_refused(tmp_path, passes, why):
    path = _liveness(tmp_path, passes)
    o = run_cli(PLAN + ["--liveness-from", path], tmp_path)
    assert check_contract(o) == "refused" and f"--liveness-from {path}" in o.err and why in o.err, o.err
    assert o.seconds < 20


def test_random_bytes_as_a_trace_name_the_flag_and_the_file(tmp_path):
    path = tmp_path / "noise.jsonl"
    path.write_bytes(bytes(range(128, 256)) * 8)
    o = run_cli(PLAN + ["--liveness-from", str(path)], tmp_path)
    assert check_contract(o) == "refused" and f"--liveness-from {path}: not UTF-8" in o.err, o.err


@pytest.fixture(scope="module")
def profiled(tiny_dirs, tmp_path_factory):
    """(operator profile of a tiny llada2_moe, Native trace of that model, Native trace of tiny-uniform)."""
    import dblock
    from dblock.cli import main
    from dblock.profiling.profiler import Profiler
    d = tmp_path_factory.mktemp("profiled")
    prof = Profiler(dblock.load(tiny_dirs["llada2_moe"]), name="tiny", repeats=2, max_rows_blocks=2, max_requests=2,
                    context_blocks=2, min_sample_s=0.0, timer=time.thread_time).run(("reference",))
    prof.meta["model"]["name"] = tiny_dirs["llada2_moe"]
    prof.save(str(d / "p.json"))
    for model, name in ((tiny_dirs["llada2_moe"], "masked"), ("tiny-uniform", "uniform")):
        assert main(["generate", "--model", model, "--prompt-ids", "5,6,7", "--prompt-ids", "8,9",
                     "--max-new-tokens", "16", "--trace", str(d / f"{name}.jsonl")]) == 0
    return str(d / "p.json"), str(d / "masked.jsonl"), str(d / "uniform.jsonl")


def _plan_profiled(profile, trace):
    return ["simulate", "plan", "--operator-profile", profile, "--liveness-from", trace, "--slo-itl", "0.5",
            "--caps", "2", "--executors", "dense", "--requests", "20"]


def test_a_profile_of_negative_times_is_refused(profiled, tmp_path):
    prof, masked, _ = profiled
    d = json.load(open(prof))
    for t in d["tables"].values():
        for q in ("median", "lo", "hi"):
            t[q] = _negate(t[q])
    bad = tmp_path / "neg.json"
    bad.write_text(json.dumps(d))
    o = run_cli(_plan_profiled(str(bad), masked), tmp_path)
    assert check_contract(o) == "refused" and f"--operator-profile {bad}: table" in o.err, o.err
    for value in (float("nan"), float("inf"), "0.1", True):
        d2 = json.load(open(prof))
        t = d2["tables"]["attention"]
        t["median"] = _first_set(t["median"], value)
        bad.write_text(json.dumps(d2))
        o = run_cli(_plan_profiled(str(bad), masked), tmp_path)
        assert check_contract(o) == "refused" and "--operator-profile" in o.err, (value, o.err)


def _negate(v):
    return [_negate(x) for x in v] if isinstance(v, list) else -abs(v)


def _first_set(v, value):
    if isinstance(v, list):
        return [_first_set(v[0], value)] + v[1:]
    return value


def test_a_profile_of_one_family_pricing_a_trace_of_another_is_refused(profiled, tmp_path):
    prof, _, uniform = profiled
    o = run_cli(_plan_profiled(prof, uniform), tmp_path)
    assert check_contract(o) == "refused", o.err
    assert "llada2_moe" in o.err and "diffusion_gemma" in o.err and "tiny-uniform" in o.err


def test_a_profile_of_another_model_of_the_family_is_one_warning(profiled, tmp_path):
    prof, masked, _ = profiled
    d = json.load(open(prof))
    d["meta"]["model"]["name"] = "tiny-masked"              # the trace is of the random tiny folder
    other = tmp_path / "other.json"
    other.write_text(json.dumps(d))
    o = run_cli(_plan_profiled(str(other), masked) + ["--json"], tmp_path)
    assert o.rc in (0, 1), o.err
    warnings = [line for line in o.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "tiny-masked" in warnings[0] and masked in warnings[0], o.err
    o = run_cli(_plan_profiled(prof, masked) + ["--json"], tmp_path)
    assert not [line for line in o.err.splitlines() if line.startswith("warning:")], o.err


def test_flags_of_another_mode_and_empty_schedule_lists_are_refused(tmp_path):
    o = run_cli(PLAN + ["--rate-margin", "0.2"], tmp_path)
    assert check_contract(o) == "refused" and o.err.startswith("dblock: error: --rate-margin:"), o.err
    for value in ("", ",,", " , "):
        o = run_cli(["compare-schedules", "--model", "tiny-masked", "--task", "arith", "--n", "1", "--schedules",
                     value], tmp_path)
        assert check_contract(o) == "refused" and "--schedules" in o.err and "names no schedule" in o.err, o.err


def test_eval_of_a_task_the_tokenizer_cannot_spell_names_model_task_and_character(tmp_path):
    o = run_cli(["eval", "--model", "tiny-masked", "--task", "code", "--n", "1"], tmp_path)
    assert check_contract(o) == "refused", o.err
    line = o.err.strip()
    assert "--task code" in line and "--model tiny-masked" in line and "character" in line and "vocabulary" in line


def test_an_hf_ref_that_climbs_out_of_snapshots_is_a_damaged_cache(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for target in ("../../../../elsewhere", "../../x", "main"):
        (repo / "refs" / "main").write_text(target)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        o = run_cli(["info", "org/name"], tmp_path)
        assert check_contract(o) == "refused", o.err
        assert "refs/main" in o.err and "not a commit hash" in o.err and "download" not in o.err, o.err
        assert ("out of the repository's snapshots" in o.err) == ("/" in target), o.err


def _run_out(argv, stdout, limit=None):
    def pre():
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return subprocess.run([sys.executable, "-m", "dblock"] + argv, stdout=stdout, stderr=subprocess.PIPE, text=True,
                          cwd=ROOT, timeout=300, preexec_fn=pre)


JSON_PLAN = PLAN + ["--json"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to make stdout's disk full")
def test_stdout_on_a_full_disk_is_one_line_naming_stdout():
    with open("/dev/full", "w") as full:
        p = _run_out(JSON_PLAN, full)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines == ["dblock: error: stdout: could not be written (ENOSPC: No space left on "
                                           "device); the output is incomplete"], p.stderr[-2000:]


@pytest.mark.parametrize("argv", [JSON_PLAN, ["simulate", "oba"]], ids=["large output", "small output"])
def test_stdout_past_a_file_size_limit_is_one_line_naming_stdout(tmp_path, argv):
    with open(tmp_path / "out.txt", "w") as f:
        p = _run_out(argv, f, limit=100)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("dblock: error: stdout: could not be "
                                                                         "written (EFBIG"), p.stderr[-2000:]
