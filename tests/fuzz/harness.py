"""Run `dblock.cli.main(argv)` in-process the way a user's shell would, and check the outcome contract:

  exit 0, or exit 2 with exactly one stderr line `dblock: error: ...` (never `internal error`, never a traceback)
  that names the culprit (a flag of the command line, the command, the model argument or a file); never a hang
  (`run_cli` raises `Hang` past `timeout_s`); nothing created or changed on failure (the working folder, a fresh
  temporary one, and the bundled checkpoints are snapshotted before and after).

Used by tests/fuzz/test_cli_fuzz.py, tests/fuzz/test_config_fuzz.py and tests/cli/test_bad_input.py.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import time
import warnings
from dataclasses import dataclass

from dblock.weights_path import CHECKPOINTS_DIR

#: files whose names in a message say which input was bad
CULPRIT_FILES = ("config.json", "tokenizer.json", "safetensors", "card.json")


class Hang(BaseException):
    """A command ran past its time bound (BaseException: `main`'s `except Exception` must not swallow it)."""


@dataclass
class Outcome:
    argv: list
    rc: int
    out: str
    err: str
    seconds: float
    changed: list          # paths created, removed or modified under the watched folders


def snapshot(*roots) -> dict:
    """{path: (size, mtime_ns)} of every file and folder under the roots."""
    snap = {}
    for root in roots:
        if not os.path.exists(root):
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                snap[p] = (st.st_size if name in filenames else -1, st.st_mtime_ns)
    return snap


def _diff(before: dict, after: dict) -> list:
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


@contextlib.contextmanager
def _time_bound(seconds: float, argv):
    def boom(signum, frame):
        raise Hang(f"dblock {' '.join(map(str, argv))[:300]}: still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli(argv, cwd, timeout_s: float = 30.0, watch=()) -> Outcome:
    """`dblock.cli.main(argv)` with cwd = `cwd`, stdout/stderr captured, warnings kept off stderr (a real terminal
    would show them; they are not the error line), at most `timeout_s` seconds."""
    from dblock.cli import main
    argv = [str(a) for a in argv]
    roots = [cwd, CHECKPOINTS_DIR, *watch]
    before = snapshot(*roots)
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    tqdm_env = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"          # progress bars are not the error line
    t0 = time.perf_counter()
    try:
        os.chdir(cwd)
        with warnings.catch_warnings(record=True), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err), _time_bound(timeout_s, argv):
            rc = main(argv)
    finally:
        os.chdir(here)
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env
    seconds = time.perf_counter() - t0
    return Outcome(argv, rc, out.getvalue(), err.getvalue(), seconds, _diff(before, snapshot(*roots)))


def culprit_named(line: str, argv) -> bool:
    """The error line names the culprit: a flag (one the user gave, or the one missing), a value the user gave
    (3 characters or more, or followed by a colon: a model, a path), or one of the model folder's files. The
    parser's `(see `dblock CMD --help`)` tail does not count."""
    flags = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    words = [a for a in argv if a and not a.startswith("-")]
    body = line.split(" (see `", 1)[0]
    named_flag = re.search(r"(^|[\s(`'])--[a-z]", body) is not None
    return (any(f in body for f in flags) or named_flag or any(f in body for f in CULPRIT_FILES)
            or any((len(w) >= 3 and w in body) or f"{w}:" in body for w in words))


def check_contract(o: Outcome) -> str:
    """'ok' or 'refused' after asserting the outcome contract (see the module docstring)."""
    assert o.rc in (0, 2), f"exit {o.rc} for {o.argv}: {o.err[-500:]}"
    if o.rc == 0:
        return "ok"
    lines = o.err.strip().splitlines()
    assert len(lines) == 1, f"{o.argv}: stderr is not one line:\n{o.err[-2000:]}"
    line = lines[0]
    assert line.startswith("dblock: error:"), f"{o.argv}: {line}"
    assert "internal error" not in line and "Traceback" not in o.err, f"{o.argv}: {line}"
    assert culprit_named(line, o.argv), f"{o.argv}: the message names no flag, file or value: {line}"
    assert not o.changed, f"{o.argv}: refused but changed {o.changed[:5]}"
    return "refused"
