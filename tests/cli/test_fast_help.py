"""`dblock --help` and `dblock <command> --help` stay light (no torch), every command carries its run function, and
`main` sorts errors into `error` (the user can fix it) and `internal error (Type)` (a bug) with isinstance."""
import argparse
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("torch", "numpy", "scipy", "simpy", "triton")

HELP_SCRIPT = r"""
import argparse, contextlib, io, json, sys
from dblock.cli import build_parser

def commands(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from commands(sub, prefix + (name,))

ap = build_parser()
done = []
for argv in [()] + list(commands(ap)):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            build_parser().parse_args(list(argv) + ["--help"])
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    assert buf.getvalue().startswith("usage: dblock"), (argv, buf.getvalue()[:200])
    done.append(" ".join(argv))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print(json.dumps(dict(done=done, heavy=heavy)))
""" % (HEAVY,)


def test_help_of_every_command_imports_no_torch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", HELP_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for cmd in ("", "info", "generate", "make-tiny", "demo", "simulate", "simulate oba", "simulate calibrate",
                "train-tiny", "eval", "model-card", "verify", "serve", "loadgen", "compare-schedules"):
        assert cmd in out["done"], cmd
    assert "torch" not in {m.split(".")[0] for m in out["heavy"]}, out["heavy"]
    assert not out["heavy"], f"building the parser and printing help imported {out['heavy'][:10]}"


def test_python_m_dblock_help_exits_0():
    res = subprocess.run([sys.executable, "-m", "dblock", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("usage: dblock") and "compare-schedules" in res.stdout


def leaf_parsers(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = list(leaf_parsers(sub, prefix + (name,)))
                yield from nested or [(prefix + (name,), sub)]


def test_every_command_has_a_run_function():
    from dblock.cli import build_parser
    leaves = list(leaf_parsers(build_parser()))
    assert len(leaves) >= 17
    for argv, sub in leaves:
        assert callable(sub.get_default("_run")), f"dblock {' '.join(argv)}: no set_defaults(_run=...)"


def test_train_tiny_defaults_match_train_config():
    from dblock.cli import tasks as tasks_cli
    from dblock.tasks.train_config import LLADA2_SIZES, TrainConfig
    d = TrainConfig()
    assert {k: getattr(d, k) for k in tasks_cli.TRAIN_DEFAULTS} == tasks_cli.TRAIN_DEFAULTS
    assert list(tasks_cli.LLADA2_SIZE_NAMES) == sorted(LLADA2_SIZES)


# ---- error classification ------------------------------------------------------------------------------------

ERRORS = [   # (module, exception class, constructor arguments) -> kind, first line
    ("dblock.errors", "ConfigError", ("bad key 'x'\nsecond line",), "error", "bad key 'x'"),
    ("dblock.errors", "WeightsError", ("missing key",), "error", "missing key"),
    ("dblock.errors", "TaskError", ("unknown task",), "error", "unknown task"),
    ("dblock.errors", "DistributedError", ("rank 1 died",), "error", "rank 1 died"),
    ("dblock.optimized.ep", "EPTimeoutError", ("rank 1 stalled",), "error", "rank 1 stalled"),
    ("dblock.optimized.ep", "EPError", ("exchange failed",), "error", "exchange failed"),
    ("dblock.optimized.ep", "DistributedRunError", ({0: "oom"}, 1.5), "error",
     "distributed run failed after 1.5 s: rank 0: oom"),
    ("builtins", "ValueError", ("--n 0: must be positive",), "error", "--n 0: must be positive"),
    ("builtins", "FileNotFoundError", ("no such file",), "error", "no such file"),
    ("builtins", "FileExistsError", ("exists",), "error", "exists"),
    ("builtins", "PermissionError", ("denied",), "error", "denied"),
    ("builtins", "IsADirectoryError", ("a dir",), "error", "a dir"),
    ("builtins", "NotADirectoryError", ("not a dir",), "error", "not a dir"),
    ("builtins", "RuntimeError", ("boom",), "internal error (RuntimeError)", "boom"),
    ("builtins", "KeyError", ("k",), "internal error (KeyError)", "'k'"),
    ("builtins", "AssertionError", (), "internal error (AssertionError)", "AssertionError"),
]


@pytest.mark.parametrize("module, name, exc_args, kind, line", ERRORS, ids=[e[1] for e in ERRORS])
def test_errors_are_one_line_with_their_kind(module, name, exc_args, kind, line, monkeypatch, capsys):
    import importlib

    import dblock.cli as cli
    exc = getattr(importlib.import_module(module), name)

    def boom(args):
        raise exc(*exc_args)
    monkeypatch.setattr(cli, "_make_tiny", boom)
    monkeypatch.delenv("DBLOCK_DEBUG", raising=False)
    rc = cli.main(["make-tiny", "--family", "llada2_moe", "--out", "x"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err == f"dblock: {kind}: {line}\n"


def test_dblock_debug_reraises(monkeypatch):
    import dblock.cli as cli

    def boom(args):
        raise RuntimeError("boom")
    monkeypatch.setattr(cli, "_make_tiny", boom)
    monkeypatch.setenv("DBLOCK_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["make-tiny", "--family", "llada2_moe", "--out", "x"])


def test_no_command_prints_help_and_one_error_line_exit_2():
    res = subprocess.run([sys.executable, "-m", "dblock"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "" and "usage: dblock" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("dblock: error: give a command")
