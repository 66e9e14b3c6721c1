"""A full disk or a file-size limit while `make-tiny` / `train-tiny` write: one line naming the output and the cause
(EFBIG here, ENOSPC on a full disk), exit 2, and nothing left behind. The limit is RLIMIT_FSIZE in the child (with
SIGXFSZ ignored, a write past it fails with EFBIG, as on a full disk with ENOSPC)."""
import os
import resource
import signal
import subprocess
import sys

import pytest

from dblock.errors import write_failure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(argv, limit):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return subprocess.run([sys.executable, "-m", "dblock"] + argv, capture_output=True, text=True, preexec_fn=pre,
                          cwd=ROOT, timeout=300)


@pytest.mark.parametrize("argv", [["make-tiny", "--family", "llada2_moe"],
                                  ["make-tiny", "--family", "diffusion_gemma"],
                                  ["train-tiny", "--family", "llada2_moe", "--size", "micro", "--steps", "2",
                                   "--no-progress"]])
def test_a_write_past_the_limit_is_one_line_naming_the_file_and_the_cause(tmp_path, argv):
    out = tmp_path / "m"
    p = _run(argv + ["--out", str(out)], 20_000)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert lines[0].startswith(f"dblock: error: {out}/") and "EFBIG" in lines[0] and "internal error" not in lines[0]
    assert not out.exists() and os.listdir(tmp_path) == []


def test_write_failure_names_the_cause_from_a_library_message():
    e = write_failure("/x/model.safetensors", RuntimeError("Error while serializing: IoError(No space left on device)"))
    assert str(e) == "/x/model.safetensors: could not be written (ENOSPC: No space left on device); nothing was left behind"
    assert isinstance(e, OSError)
