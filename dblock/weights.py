"""Local Hugging Face folders <-> models. Never touches the network.

A model is named by a bundled checkpoint's name, a folder, or a Hugging Face id (`org/name[@revision]`) already in
the local Hugging Face cache (`resolve_model_path`); nothing is ever downloaded.

A model folder holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Everything is validated before any tensor is used: unknown model_type, unsupported
config value, missing or unexpected key, wrong shape, unreadable or truncated file, NaN/Inf in a weight -> one
`WeightsError` naming the file and key. Keys real checkpoints carry that dblock never uses (`IGNORED`) are skipped.
Every file a folder names must lie inside it (`confined_path`: no '..', absolute path or symlink out of it).

`save` writes a folder all or nothing (`staged_folder`): into a hidden folder beside the destination, which then
takes its place; a folder that already holds something is refused unless `overwrite=True` replaces it as a whole.

Each family maps its HF names onto its model once (`Family.slots`, dblock/families.py): that map gives the keys a
folder must hold, where each tensor goes on load and what `save` writes. Loading streams: every file is opened with
safetensors' `safe_open` and each tensor goes straight to its place in the model (a routed expert into its row of
one preallocated (E, ...) stack), so the peak is about the model plus the tensor being read.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import sys
from typing import Optional

import safetensors.torch
import torch
from safetensors import safe_open

from dblock.config import ConfigError, family_of, load_config, read_json
from dblock.errors import OutputExistsError, WeightsError
from dblock.families import FAMILIES

CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")

# HF keys real checkpoints carry that dblock never uses: skipped when loading (not an error), never written.
IGNORED = [
    # multi-token-prediction heads (`model.mtp*`, or `mtp.*` where a converter put them at the top level): a
    # training aid; dblock decodes with the main LM head only
    re.compile(r"^model\.mtp"),
    re.compile(r"^mtp\."),
    # RoPE inverse frequencies that older exports saved as a buffer; dblock computes them from the config
    re.compile(r"(^|\.)rotary_emb\.inv_freq$"),
]


# ---------------------------------------------------------------------------------------------------------------
# Reading and validating a folder
# ---------------------------------------------------------------------------------------------------------------

def bundled_models() -> list:
    """Names of the checkpoints shipped inside the package (dblock/checkpoints/<name>/config.json)."""
    if not os.path.isdir(CHECKPOINTS_DIR):
        return []
    return sorted(d for d in os.listdir(CHECKPOINTS_DIR) if os.path.isfile(os.path.join(CHECKPOINTS_DIR, d,
                                                                                          "config.json")))


# `org/name` or `org/name@revision` (a branch, a tag or a commit hash), as the Hub spells repository ids
_HF_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[^\s@]+))?$")


_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")


def check_hf_id(repo: str, revision: Optional[str], given: str) -> None:
    """Refuse an id or revision that is not a valid Hugging Face one, before any cache path is formed from it: the id
    with `huggingface_hub`'s own validator; the revision as a git ref or commit (letters, digits, `._/-`, no `..`,
    no empty path part, no `.lock` end) -- so `org/name@../../x` cannot walk out of the cache's `refs/`."""
    try:
        from huggingface_hub.utils import validate_repo_id
    except ImportError:               # the regex of `_HF_ID` already bounds the characters
        validate_repo_id = None
    if validate_repo_id is not None:
        try:
            validate_repo_id(repo)
        except Exception as e:       # HFValidationError
            raise WeightsError(f"{given}: {repo!r} is not a valid Hugging Face repository id "
                               f"({(str(e).splitlines() or [''])[0]})") from None
    if revision is None:
        return
    bad = (not _REVISION.match(revision) or ".." in revision or "//" in revision or revision.endswith(("/", ".lock"))
           or any(part.startswith(".") for part in revision.split("/")))
    if bad:
        raise WeightsError(f"{given}: revision {revision!r} is not a valid Hugging Face revision (a branch, tag or "
                           "commit: letters, digits and . _ / -, no '..', no empty or hidden path part)")


def hf_cache_dir() -> str:
    """The Hugging Face hub cache, from the environment at call time (huggingface_hub reads it once, at import):
    HF_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    path = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not path:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        path = os.path.join(home, "hub")
    return os.path.abspath(os.path.expanduser(path))


def hf_cached_snapshot(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> Optional[str]:
    """The snapshot folder of `repo_id` at `revision` (default `main`) in the local Hugging Face cache, or None.

    Local only: `huggingface_hub.snapshot_download(..., local_files_only=True)`, which never opens a connection
    (nor does HF_HUB_OFFLINE change that); without huggingface_hub installed, the same cache layout is read
    directly (`models--org--name/refs/<revision>` -> `snapshots/<commit>/`). A snapshot the cache knows to be
    incomplete is a WeightsError."""
    cache_dir = cache_dir or hf_cache_dir()
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        snapshot_download = None
    if snapshot_download is not None:
        try:
            folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
        except (LocalEntryNotFoundError, HFValidationError):   # not cached; not a valid id
            return None
        except Exception as e:    # an incomplete snapshot, an unreadable cache: say so, never retry online
            raise WeightsError(f"{repo_id}: local Hugging Face cache {cache_dir}: {type(e).__name__}: {e}") \
                from None
        return folder if os.path.isdir(folder) else None
    storage = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit = rev
    ref = os.path.join(storage, "refs", rev)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    folder = os.path.join(storage, "snapshots", commit)
    return folder if os.path.isdir(folder) else None


def resolve_model_path(name_or_path: str) -> str:
    """The folder a model name stands for, looked up in this order: a bundled checkpoint (`tiny-masked`,
    `tiny-uniform`), an existing local folder, a Hugging Face id `org/name` (optionally `org/name@revision`) in the
    local Hugging Face cache (HF_HUB_CACHE / HF_HOME; see `hf_cache_dir`). dblock never downloads: anything else is
    one WeightsError saying where it looked."""
    bundled = bundled_models()
    if name_or_path in bundled:
        return os.path.join(CHECKPOINTS_DIR, name_or_path)
    if os.path.isdir(name_or_path):
        return name_or_path
    cache_dir = hf_cache_dir()
    shown = name_or_path if name_or_path.isprintable() else repr(name_or_path)   # one line, whatever it holds
    m = _HF_ID.match(name_or_path)
    if m:
        check_hf_id(m["repo"], m["rev"], shown)
        folder = hf_cached_snapshot(m["repo"], m["rev"], cache_dir)
        if folder is not None:
            snaps = os.path.join(cache_dir, "models--" + m["repo"].replace("/", "--"), "snapshots")
            if not _inside(os.path.realpath(folder), [os.path.realpath(snaps)]):
                raise WeightsError(f"{shown}: the cache resolves it to {folder}, outside the repository's "
                                   f"snapshots folder {snaps}")
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise WeightsError(f"{shown}: the local Hugging Face cache has a snapshot ({folder}) but "
                                   "no config.json in it (an incomplete download?)")
            return folder
    if m:
        at = f" at revision {m['rev']!r}" if m["rev"] else ""
        where, repo = f"not in the local Hugging Face cache {cache_dir}{at}", m["repo"]
    else:
        where, repo = (f"not a Hugging Face id of the form org/name (those are looked up in the local cache "
                       f"{cache_dir})"), "org/name"
    raise WeightsError(f"{shown}: no such model folder, not a bundled model (bundled: "
                       f"{', '.join(bundled) or 'none'}), and {where}. dblock never downloads: on a connected "
                       f"machine run `huggingface-cli download {repo}` (then point HF_HOME or HF_HUB_CACHE at that "
                       "cache), or pass the model folder")


def _allowed_roots(folder: str) -> list:
    """Real paths the files of `folder` may resolve into: the folder itself and, for a Hugging Face cache snapshot
    (`models--org--name/snapshots/<commit>/`, whose files are symlinks into `../../blobs/`), that repository's
    `blobs/` folder."""
    root = os.path.realpath(folder)
    roots = [root]
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots":
        blobs = os.path.join(os.path.dirname(parent), "blobs")
        if os.path.isdir(blobs):
            roots.append(os.path.realpath(blobs))
    return roots


def _inside(path: str, roots: list) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def confined_path(folder: str, name, what: str) -> str:
    """folder/name for a file the folder's own metadata names (`what` says where, for the message): a WeightsError
    unless `name` is a relative path inside the folder that does not leave it through '..', an absolute path or a
    symlink. Checked before the file is opened or even tested for existence."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise WeightsError(f"{what}: {name!r} is not a file name")
    parts = re.split(r"[\\/]", name)
    if os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise WeightsError(f"{what}: {name!r} is an absolute path; shards must lie inside the model folder {folder}")
    if ".." in parts:
        raise WeightsError(f"{what}: {name!r} leaves the model folder {folder} ('..')")
    path = os.path.join(folder, name)
    real = os.path.realpath(path)
    if not _inside(real, _allowed_roots(folder)):
        raise WeightsError(f"{what}: {name!r} is a symlink to {real}, outside the model folder {folder}")
    return path


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


@contextlib.contextmanager
def _no_init():
    """Build a model skeleton without running the modules' random initialisers: their values are replaced by the
    checkpoint anyway, and on the meta device they dispatch through torch's reference ops, whose first use imports
    torch._dynamo (seconds of start-up). transformers' `no_init_weights` does the same."""
    import torch.nn.init as init
    names = [n for n in ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                         "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                         "sparse_") if hasattr(init, n)]
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


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


# ---------------------------------------------------------------------------------------------------------------
# Folder -> model, model -> folder
# ---------------------------------------------------------------------------------------------------------------

class _Assembly:
    """A model's state dict as its HF tensors stream in. A whole tensor is kept as read; experts and fused rows are
    copied into one tensor per parameter, allocated when its first piece arrives; a copy (`Slot.copy`) is compared
    with its parameter once both are in, and dropped."""

    def __init__(self, slots: dict, targets: dict):
        self.slots, self.targets = slots, targets     # {hf_key: Slot}; {param: meta tensor} (shapes)
        self.sd: dict = {}                            # param -> tensor
        self.waiting: dict = {}                       # copies read before their parameter: hf_key -> tensor
        self.bad: set = set()                         # copies that differ from their parameter

    def put(self, key: str, t: torch.Tensor) -> None:
        s = self.slots[key]
        if s.fp32:
            t = t.float()
        if s.copy:
            if s.differs is not None:                 # an unchecked copy feeds nothing: dropped
                self.waiting[key] = t
        elif s.index is None:
            self.sd[s.param] = t
        else:
            if s.param not in self.sd:
                self.sd[s.param] = torch.empty(self.targets[s.param].shape, dtype=t.dtype, device=t.device)
            self.sd[s.param][s.index] = t
        if self.waiting:
            self._compare_waiting()

    def _compare_waiting(self) -> None:
        for key in [k for k in self.waiting if self.slots[k].param in self.sd]:
            if not torch.equal(self.waiting.pop(key), self.sd[self.slots[key].param]):
                self.bad.add(key)

    def state_dict(self, src: str) -> dict:
        """Every parameter, once all tensors are in; a WeightsError naming the first copy (table order) that
        differs from its parameter."""
        self._compare_waiting()
        for key, s in self.slots.items():
            if key in self.bad:
                raise WeightsError(f"{src}: key {key!r} {s.differs}")
        return self.sd


def load(path_or_name: str, dtype=None, device=None, progress: Optional[bool] = None) -> torch.nn.Module:
    """Load a local HF folder, a bundled model name or a Hugging Face id already in the local cache (see
    `resolve_model_path`) into the family's reference model, validated first.

    dtype: None takes config.json's `torch_dtype` (or `dtype`) when it names one -- as transformers'
    `torch_dtype="auto"` does; a checkpoint stored in bfloat16 whose config says float32 (the bundled code models) is
    computed in float32 -- and otherwise keeps the stored dtype; "float32"/"bfloat16"/"float64" or a torch dtype
    converts (expert_bias stays fp32). device: where the weights go ("cpu", "cuda"). progress: a bar per shard file on stderr (None:
    only for a large or sharded checkpoint on a terminal; see `stream_tensors`).
    """
    folder = resolve_model_path(path_or_name)
    cfg = load_config(folder)
    if dtype is None:
        dtype = config_dtype(folder)
    fam = FAMILIES[cfg.family]
    slots = fam.slots(cfg)
    with torch.device("meta"), _no_init():
        model = fam.model_class(cfg)
    parts, carried = _Assembly(slots, model.state_dict()), {}
    keep32 = frozenset(k for k, s in slots.items() if s.fp32)
    for key, t in stream_tensors(folder, expected(cfg), _dtype(dtype), device, keep32, progress):
        if key in slots:
            parts.put(key, t)
        else:
            carried[key] = t
    src = os.path.dirname(os.path.join(folder, "config.json"))
    model.load_state_dict(parts.state_dict(src), strict=True, assign=True)
    if fam.carry:
        model.vision_weights = carried
    model.source = folder
    return model.eval()


def export(model: torch.nn.Module) -> dict:
    """model -> {hf_key: tensor} under the family's HF names (copies cloned, carried tensors as they are)."""
    fam = FAMILIES[model.config.family]
    sd = model.state_dict()
    out = {}
    for key, s in fam.slots(model.config).items():
        t = sd[s.param] if s.index is None else sd[s.param][s.index]
        t = t.float() if s.fp32 else t
        out[key] = t.clone() if s.copy else t
    if fam.carry:
        out.update(model.vision_weights)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Writing a folder: all or nothing
# ---------------------------------------------------------------------------------------------------------------

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


def model_family(path_or_name: str) -> str:
    folder = resolve_model_path(path_or_name)
    return family_of(read_json(os.path.join(folder, "config.json")), os.path.join(folder, "config.json"))
