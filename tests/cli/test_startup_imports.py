"""Start-up stays lean: loading a bundled model and decoding imports neither torch._dynamo nor torch's FSDP (building
the model skeleton on the meta device used to run the modules' initialisers through torch's reference ops, whose
first use imports dynamo: seconds of start-up)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import contextlib, io, json, sys
from dblock.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    rc = main({argv!r})
print(json.dumps([rc, [m for m in ("torch._dynamo", "torch.distributed.fsdp") if m in sys.modules]]))
"""


@pytest.mark.parametrize("argv", [["generate", "--model", "tiny-masked", "--prompt", "1+1="],
                                  ["generate", "--model", "tiny-uniform", "--prompt", "1+1="],
                                  ["eval", "--model", "tiny-masked", "--n", "2"]])
def test_a_plain_command_imports_no_dynamo_nor_fsdp(argv):
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(argv=argv)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    rc, heavy = json.loads(p.stdout.strip().splitlines()[-1])
    assert rc == 0 and heavy == [], (heavy, p.stderr[-2000:])


def test_the_skeleton_builder_restores_torch_init():
    import torch

    from dblock.weights import _no_init
    before = torch.nn.init.normal_
    with _no_init():
        assert torch.nn.init.normal_ is not before
    assert torch.nn.init.normal_ is before
