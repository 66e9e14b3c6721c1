"""Writing a model folder all or nothing: `save` writes config.json + model.safetensors (or shards + index) with
HF names into a hidden folder beside the destination (`staged_folder`), which then takes its place (`publish`); a
folder that already holds something is refused unless `overwrite=True` replaces it as a whole (`check_out_dir`).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from typing import Optional

import safetensors.torch
import torch

from dblock.config import ConfigError
from dblock.errors import OutputExistsError, WeightsError
from dblock.families import FAMILIES
from dblock.weights import export
from dblock.weights_path import _inside
from dblock.weights_read import _dtype

STAGE_PREFIX = ".dblock-save-"   # the folder being written, beside the destination
OLD_PREFIX = ".dblock-old-"      # the replaced folder, for the instant of the swap


def check_out_dir(out_dir: str, overwrite: bool = False) -> bool:
    """Whether `out_dir` exists and holds something. An OutputExistsError when it does and `overwrite` is False, or
    when it is not a folder; a missing or empty folder is fine."""
    if not os.path.lexists(out_dir):
        return False
    if not os.path.isdir(out_dir):
        raise OutputExistsError(f"{out_dir}: exists and is not a folder; nothing was written")
    try:
        entries = sorted(os.listdir(out_dir))
    except OSError as e:
        raise OutputExistsError(f"{out_dir}: output folder cannot be listed ({e.strerror or e}); nothing was "
                                "written") from None
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        raise OutputExistsError(f"{out_dir}: output folder is not empty (holds {shown}); nothing was written. "
                                "Give a new or empty folder, or overwrite=True (--overwrite) to replace the whole "
                                "folder")
    if entries:                      # overwrite: never a folder whose loss would be a disaster
        real, cwd = os.path.realpath(out_dir), os.path.realpath(os.getcwd())
        what = ("the filesystem root" if real == os.path.realpath(os.sep) else
                "the home folder" if real == os.path.realpath(os.path.expanduser("~")) else
                "the current folder or one above it" if _inside(cwd, [real]) else None)
        if what:
            raise OutputExistsError(f"{out_dir}: is {what}; overwrite=True would delete all of it, so nothing was "
                                    "written. Give a dedicated output folder")
    return bool(entries)


def new_dir(parent: str, prefix: str) -> str:
    """A new folder `parent/prefix<random>` with the usual permissions (mkdtemp's are 0700)."""
    for _ in range(100):
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: no free name for a {prefix}* folder")


def publish(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Put the finished folder `tmp` in `out_dir`'s place: one rename when `out_dir` is missing or empty; when it
    holds something (overwrite only), out_dir -> a sibling, tmp -> out_dir (the first rename undone if the second
    fails), then the old folder is deleted. No instant shows a mix of old and new files."""
    try:
        os.rename(tmp, out_dir)      # POSIX: replaces a missing or empty folder atomically
        return
    except OSError:
        if not os.path.isdir(out_dir):
            raise
    if not os.listdir(out_dir):      # an empty folder rename() would not replace (Windows, a mount point)
        try:
            os.rmdir(out_dir)
        except OSError:              # a mount point: move the files in (the folder was empty, nothing to mix with)
            for name in sorted(os.listdir(tmp)):
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
            return
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            os.makedirs(out_dir, exist_ok=True)
            raise
        return
    if not overwrite:                # something appeared in out_dir while we wrote
        check_out_dir(out_dir, overwrite=False)
    old = new_dir(os.path.dirname(os.path.abspath(out_dir)), OLD_PREFIX)
    os.rmdir(old)                    # only the unique name was needed
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    if os.path.islink(old):          # out_dir was a symlink: the link is replaced, its target left alone
        os.unlink(old)
    else:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(out_dir: str, overwrite: bool = False):
    """Write a folder all or nothing: yields a new empty folder beside `out_dir` (`.dblock-save-*`); when the block
    ends normally it takes `out_dir`'s place (`publish`); on any exception it is deleted and `out_dir` is left as it
    was. `out_dir` must be missing or empty unless `overwrite` (then the whole folder is replaced: no file of the
    old one survives)."""
    check_out_dir(out_dir, overwrite)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = new_dir(parent, STAGE_PREFIX)
    try:
        if os.path.isdir(out_dir):
            try:
                shutil.copymode(out_dir, tmp)
            except OSError:
                pass
        try:
            yield tmp
            publish(tmp, out_dir, overwrite)
        except OSError as e:     # name the user's output folder, not the staging one (and a full disk in one line)
            from dblock.errors import WriteError, write_failure
            w = e if isinstance(e, WriteError) else write_failure(getattr(e, "filename", None) or tmp, e)
            raise WriteError(w.path.replace(tmp, out_dir.rstrip(os.sep)), w.detail) from None
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _save_tensors(save_file, tensors: dict, path: str) -> None:
    """safetensors' save_file, a failed write (a full disk, a file-size limit) as one WriteError naming the file."""
    from dblock.errors import WriteError, write_failure
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except WriteError:
        raise
    except Exception as e:        # SafetensorError (not an OSError) or OSError
        if isinstance(e, (ConfigError, WeightsError)):
            raise
        raise write_failure(path, e) from None


def write_model(model: torch.nn.Module, folder: str, extra_files: Optional[dict] = None,
                max_shard_bytes: Optional[int] = None, storage_dtype=None) -> None:
    """Write config.json + model.safetensors (or shards + index) with HF names, and `extra_files` ({name: str or
    bytes}), into the existing folder `folder` (a staging folder: `save` is the safe way to write a model).

    `storage_dtype` (e.g. "bfloat16"): store the floating tensors in that dtype (the fp32 slots, e.g. the expert
    bias, stay fp32) and record the model's own dtype as config.json's `torch_dtype`, so that `load` computes in it
    again (half the bytes on disk; the weights are rounded once)."""
    for name in extra_files or {}:
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "\\" in name:
            raise ConfigError(f"extra_files: {name!r} is not a plain file name")
    if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool)
                                        or max_shard_bytes <= 0):
        raise ConfigError(f"max_shard_bytes={max_shard_bytes!r}: must be a positive integer")
    save_file = safetensors.torch.save_file   # looked up per call: tests make it fail midway
    cfg = model.config
    tensors = {k: v.detach().contiguous().cpu() for k, v in export(model).items()}
    hf = cfg.to_hf_dict()
    if storage_dtype is not None:
        store = _dtype(storage_dtype)
        keep = {k for k, sl in FAMILIES[cfg.family].slots(cfg).items() if sl.fp32}
        compute = next(p.dtype for p in model.parameters() if p.is_floating_point())
        tensors = {k: (v.to(store) if v.is_floating_point() and k not in keep else v) for k, v in tensors.items()}
        hf["torch_dtype"] = str(compute).removeprefix("torch.")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if max_shard_bytes is None:
        _save_tensors(save_file, tensors, os.path.join(folder, "model.safetensors"))
    else:
        shards, cur, size = [], {}, 0
        for k in sorted(tensors):
            nb = tensors[k].numel() * tensors[k].element_size()
            if cur and size + nb > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = tensors[k]
            size += nb
        shards.append(cur)
        wmap = {}
        for i, sh in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _save_tensors(save_file, sh, os.path.join(folder, name))
            wmap.update({k: name for k in sh})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)
    for name, content in (extra_files or {}).items():
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(os.path.join(folder, name), mode) as f:
            f.write(content)


def save(model: torch.nn.Module, out_dir: str, extra_files: Optional[dict] = None,
         max_shard_bytes: Optional[int] = None, overwrite: bool = False) -> None:
    """Write config.json + model.safetensors (or shards + index) with HF names, plus `extra_files`, as the folder
    `out_dir`, all or nothing (`staged_folder`): everything is written into a temporary folder beside `out_dir`,
    which then takes its place; on any failure (a full disk, an interrupt) the temporary folder is deleted and
    `out_dir` is as it was.

    `out_dir` must be missing or empty: a folder holding anything is an OutputExistsError before anything is
    written, unless `overwrite=True`, which replaces the whole folder (no old file -- a tokenizer, other shards --
    survives beside the new weights)."""
    check_out_dir(out_dir, overwrite)     # before the (possibly long) export
    with staged_folder(out_dir, overwrite) as tmp:
        write_model(model, tmp, extra_files, max_shard_bytes)
