"""Output paths of the commands (`--out`, `--trace`, `--plot`, ...), checked before any work: a folder or file that
cannot be written is refused naming its flag."""
from __future__ import annotations

import os


def check_out_dir(path: str, flag: str = "--out") -> None:
    """An output folder: refused when it exists as something else, or when its parent is not a writable folder."""
    from dblock.errors import ConfigError
    if not path:
        raise ConfigError(f"{flag}: empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: exists and is not a folder")
    if os.path.isdir(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {path}: the folder is not writable")
        return
    parent = _existing_parent(path)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot create it in {parent} (not writable)")


def check_out_file(path: str, flag: str = "--out") -> None:
    """An output file: refused when it is a folder, or when its folder does not exist or is not writable."""
    from dblock.errors import ConfigError
    if not path:
        raise ConfigError(f"{flag}: empty path")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a folder; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"{flag} {path}: {parent} {what}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path}: the file is not writable")
    if not os.path.exists(path) and not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: the folder {parent} is not writable")


def _existing_parent(path: str) -> str:
    p = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(p):
        nxt = os.path.dirname(p)
        if nxt == p:
            break
        p = nxt
    return p
