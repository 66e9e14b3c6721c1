"""Which folder a model name stands for: a bundled checkpoint, a local folder, or a Hugging Face id already in the
local Hugging Face cache (`resolve_model_path`). Never touches the network: nothing is ever downloaded.

Also where a folder's own files may lie: every file a folder's metadata names must be inside it (`confined_path`:
no '..', absolute path or symlink out of it; a Hugging Face cache snapshot may point into its repository's blobs).
Imports no torch.
"""
from __future__ import annotations

import os
import re
from typing import Optional

from dblock.config import family_of, read_json
from dblock.errors import WeightsError

CHECKPOINTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


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
    _check_ref(cache_dir, repo_id, revision or "main")
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


#: what huggingface_hub writes into a cache's refs/<branch or tag>: the commit hash the ref points at
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _check_ref(cache_dir: str, repo_id: str, rev: str) -> None:
    """A cache's `refs/<rev>` file, when there is one, must hold a commit hash: anything else ('../../x', a path)
    would lead the snapshot lookup out of the repository's `snapshots/` -- a damaged or tampered cache, refused by
    name (not taken for a missing model)."""
    ref = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"), "refs", rev)
    if not os.path.isfile(ref):
        return
    try:
        with open(ref, "rb") as f:
            raw = f.read(256)
    except OSError as e:
        raise WeightsError(f"{repo_id}: local Hugging Face cache: {ref} cannot be read ({e.strerror or e})") from None
    text = raw.decode("utf-8", "replace").strip()
    if not _COMMIT.match(text):
        shown = text[:60] if text.isprintable() else repr(text[:60])
        out = ("; it would lead out of the repository's snapshots/ folder" if "/" in text or "\\" in text or
               ".." in text else "")
        raise WeightsError(f"{repo_id}: local Hugging Face cache: {ref} holds {shown!r}, not a commit hash (40 hex "
                           f"digits, what huggingface_hub writes there){out}: the cache is damaged or was tampered "
                           "with, so it is not used (fix or delete that file)")


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


def model_family(path_or_name: str) -> str:
    folder = resolve_model_path(path_or_name)
    return family_of(read_json(os.path.join(folder, "config.json")), os.path.join(folder, "config.json"))
