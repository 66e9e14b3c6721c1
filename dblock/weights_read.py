"""Reading a model folder's safetensors, validated: the keys a folder must hold (`expected`), where each lies
(`shard_files`: the single file or the index, which must agree with its shards), and the tensors streamed file by
file (`stream_tensors`), each checked before it is used.

Unknown or missing key, wrong shape, unreadable or truncated file, NaN/Inf in a weight -> one `WeightsError`
naming the file and key. Keys real checkpoints carry that dblock never uses (`IGNORED`) are skipped. Every file a
folder names must lie inside it (`dblock.weights_path.confined_path`). Every tensor is opened with safetensors'
`safe_open` and yielded as it is read, so the peak is about the model plus the tensor being read.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Optional

import torch
from safetensors import safe_open

from dblock.config import ConfigError, read_json
from dblock.errors import WeightsError
from dblock.families import FAMILIES
from dblock.weights_path import confined_path

# HF keys real checkpoints carry that dblock never uses: skipped when loading (not an error), never written.
IGNORED = [
    # multi-token-prediction heads (`model.mtp*`, or `mtp.*` where a converter put them at the top level): a
    # training aid; dblock decodes with the main LM head only
    re.compile(r"^model\.mtp"),
    re.compile(r"^mtp\."),
    # RoPE inverse frequencies that older exports saved as a buffer; dblock computes them from the config
    re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
]


def shard_files(folder: str) -> dict:
    """{hf_key: file} from the index, or from the single model.safetensors; the index and the shards must agree.
    Every file must lie inside `folder` (`confined_path`): an index naming '../x.safetensors', an absolute path or
    a symlink out of the folder is a WeightsError naming the index and the entry, before anything is read."""
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        d = read_json(index)
        wmap = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(wmap, dict):
            raise WeightsError(f"{index}: no 'weight_map' object")
        files, paths = {}, {}
        for k, f in wmap.items():   # every entry confined before any shard is looked at
            if not isinstance(f, str) or f not in paths:
                paths[f] = confined_path(folder, f, f"{index}: weight_map entry {k!r}")
        for f in sorted(paths):
            if not os.path.isfile(paths[f]):
                raise WeightsError(f"{index}: shard {f!r} listed but missing")
        key_file = {k: paths[f] for k, f in wmap.items()}
        # every key of every shard must be in the index, and vice versa
        for f in sorted(set(key_file.values())):
            try:
                with safe_open(f, "pt") as h:
                    keys = set(h.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise WeightsError(f"{f}: unreadable safetensors file ({e})") from None
            listed = {k for k, v in key_file.items() if v == f}
            for k in sorted(listed - keys):
                raise WeightsError(f"{f}: key {k!r} listed in the index but not in the shard")
            for k in sorted(keys - listed):
                raise WeightsError(f"{f}: key {k!r} in the shard but not listed in the index")
            files.update({k: f for k in keys})
        return files
    if os.path.isfile(single):
        confined_path(folder, "model.safetensors", single)
        try:
            with safe_open(single, "pt") as h:
                return {k: single for k in h.keys()}
        except Exception as e:
            raise WeightsError(f"{single}: unreadable safetensors file ({e})") from None
    raise WeightsError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def expected(cfg) -> dict:
    """{hf_key: shape} a folder of this config must hold. Keys ending '?' are optional: the carried tensors (a vision
    tower) found in the folder the config was read from, with their stored shapes."""
    fam = FAMILIES[cfg.family]
    shapes = {k: s.shape for k, s in fam.slots(cfg).items()}
    shapes.update(_carried_shapes(fam.carry, getattr(cfg, "source", "")))
    return shapes


def _carried_shapes(prefixes: tuple, source: str) -> dict:
    if not prefixes or not source:
        return {}
    try:
        key_file = shard_files(os.path.dirname(source))
    except WeightsError:
        return {}  # stream_tensors reports the folder's problem itself
    out = {}
    for k, f in key_file.items():
        if k.startswith(prefixes):
            with safe_open(f, "pt") as h:
                out[k + "?"] = tuple(h.get_slice(k).get_shape())
    return out


def _ignored(key: str) -> bool:
    return any(p.search(key) for p in IGNORED)


# a checkpoint loads with a progress bar (one step per shard file) when it has several shards or is this big
PROGRESS_MIN_BYTES = 100 * 2 ** 20


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _progress_bar(folder: str, files: list, progress: Optional[bool]):
    """A tqdm bar over the shard files, or None. progress=False: never. Otherwise only for a checkpoint of more
    than one shard or above PROGRESS_MIN_BYTES, never when TQDM_DISABLE is set, and only when stderr is a terminal
    unless progress=True or DBLOCK_PROGRESS=1 (DBLOCK_PROGRESS=0 turns it off)."""
    if progress is False or _env_on("TQDM_DISABLE"):
        return None
    env = os.environ.get("DBLOCK_PROGRESS", "").strip()
    if env and not _env_on("DBLOCK_PROGRESS"):
        return None
    if not (progress or env or getattr(sys.stderr, "isatty", lambda: False)()):
        return None
    if len(files) < 2 and sum(os.path.getsize(f) for f in files) <= PROGRESS_MIN_BYTES:
        return None
    from tqdm import tqdm
    parts = os.path.normpath(os.path.abspath(folder)).split(os.sep)
    name = (parts[-3][len("models--"):].replace("--", "/")        # a Hugging Face cache snapshot: org/name
            if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--") else parts[-1])
    return tqdm(total=len(files), desc=f"loading {name}", unit="shard", file=sys.stderr, leave=False,
                disable=False, dynamic_ncols=True)


#: Byte alignment of every host tensor `stream_tensors` yields (what torch's CPU allocator gives). safetensors may hand out
#: a tensor at the file's own offset (e.g. 36 bytes past a 64-byte boundary); on an AVX-512 CPU a one-row `linear`
#: over such a weight rounds differently in the last bit from the same weight made in memory (measured on the tiny
#: DiffusionGemma), so a loaded model would not be the model that was saved, bit for bit.
ALIGN = 64


def stream_tensors(folder: str, want: dict, dtype=None, device=None, keep32=frozenset(),
                   progress: Optional[bool] = None):
    """Check the folder's keys against `want` ({key: shape}, optional keys end with '?'; see `expected`), then
    yield (key, tensor) file by file: each tensor checked (shape, floating dtype, finite) and converted as it is
    read. dtype: None keeps the stored dtype; keys in `keep32` keep theirs whatever dtype says. progress: a bar on
    stderr, one step per file (None: automatic, see `_progress_bar`; True: also when stderr is not a terminal)."""
    shapes = {k.rstrip("?"): s for k, s in want.items()}
    key_file = {k: f for k, f in shard_files(folder).items() if k in shapes or not _ignored(k)}
    required = {k for k in want if not k.endswith("?")}
    optional = {k[:-1] for k in want if k.endswith("?")}
    for k in sorted(required - key_file.keys()):
        raise WeightsError(f"{folder}: missing key {k!r}")
    for k in sorted(key_file.keys() - required - optional):
        raise WeightsError(f"{key_file[k]}: unexpected key {k!r}")
    by_file: dict = {}
    for k, f in key_file.items():
        by_file.setdefault(f, []).append(k)
    bar = _progress_bar(folder, sorted(by_file), progress)
    try:
        for f, keys in sorted(by_file.items()):
            if bar is not None:
                bar.set_postfix_str(os.path.basename(f), refresh=False)
            try:
                with safe_open(f, "pt", device="cpu") as h:
                    for k in sorted(keys):
                        meta = h.get_slice(k)
                        shape = tuple(meta.get_shape())
                        if shape != tuple(shapes[k]):
                            raise WeightsError(f"{f}: key {k!r} has shape {shape}, expected {tuple(shapes[k])}")
                        t = h.get_tensor(k)
                        if not t.is_floating_point():
                            raise WeightsError(f"{f}: key {k!r} has dtype {t.dtype}, expected a floating type")
                        if not torch.isfinite(t).all():
                            raise WeightsError(f"{f}: key {k!r} contains NaN or Inf")
                        if dtype is not None and k not in keep32:
                            t = t.to(dtype)
                        if device is not None:
                            t = t.to(device)
                        if t.device.type == "cpu" and t.data_ptr() % ALIGN:   # where the file put it: realign
                            t = t.clone()
                        yield k, t
            except WeightsError:
                raise
            except Exception as e:  # truncated data, bad offsets: safetensors/torch raise various types
                raise WeightsError(f"{f}: unreadable safetensors file ({type(e).__name__}: {e})") from None
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def config_dtype(folder: str):
    """The compute dtype config.json names (`torch_dtype`, or transformers 5's `dtype`), or None; a value that is
    not a dtype name is a ConfigError naming the file and key."""
    path = os.path.join(folder, "config.json")
    raw = read_json(path)
    for key in ("torch_dtype", "dtype"):
        v = raw.get(key)
        if v is None or v == "auto":
            continue
        try:
            return _dtype(str(v).removeprefix("torch."))
        except ConfigError:
            raise ConfigError(f"{path}: {key} {v!r}: allowed float32, bfloat16, float16, float64") from None
    return None


def _dtype(d):
    if d is None or isinstance(d, torch.dtype):
        return d
    table = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if d not in table:
        raise ConfigError(f"dtype={d!r}: allowed {', '.join(table)}")
    return table[d]
