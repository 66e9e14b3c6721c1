"""Which torchrun rank this process is: under torchrun every rank runs the command, rank 0 alone prints and writes
files (a process started without torchrun is rank 0)."""
from __future__ import annotations

import os


def under_torchrun() -> bool:
    """Started by torchrun: every rank runs the command, rank 0 prints and writes files."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"
