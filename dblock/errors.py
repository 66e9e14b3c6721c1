"""The errors dblock raises on purpose. Each one names the culprit (file, key, flag, field, value and what is
allowed); the CLI prints it as one line and exits with status 2. Anything else that reaches the CLI is a bug and is
reported as `internal error (Type)`.

No imports: every room can raise these without pulling in torch or a model.
"""
from __future__ import annotations


class DblockError(Exception):
    """Base of every error the user can fix: bad input, a bad file, a bad flag."""


class ConfigError(DblockError, ValueError):
    """A config.json, a decode setting or a command-line value that is missing, of the wrong type or out of range."""


class WeightsError(DblockError, ValueError):
    """A checkpoint folder whose tensors do not match its config: missing/unexpected key, shape, dtype, truncation."""


class OutputExistsError(DblockError, FileExistsError):
    """An output folder that is not empty (or not a folder): refused before anything is written, unless the caller
    asked to replace it (`overwrite=True`, `--overwrite`)."""


class TaskError(DblockError, ValueError):
    """A synthetic task name, split or problem that does not exist."""


class PromptError(DblockError, ValueError):
    """A text prompt that cannot be encoded as asked: empty, too long, a character outside the vocabulary, or text
    that would produce a control token. The message names the prompt, the character and its position."""


class InputFileError(DblockError, ValueError):
    """A file given to a command (a trace, an operator profile, a path profile, arrival times, a run folder's train
    state, saved results) that is missing, too large, not UTF-8, not JSON, or not what it should be: the message
    names the flag, the file and, where it can, the line, the key, the value and what is allowed. Such files are
    data: nothing in them is ever run (no pickle, no eval)."""


class DistributedError(DblockError, RuntimeError):
    """A torch.distributed run that failed or timed out; the message says which ranks and what they were doing."""


class WriteError(DblockError, OSError):
    """A file that could not be written (a full disk, a file-size limit, a lost mount): names the output and the
    cause. Whatever was being written is removed; nothing half-written is left."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"{path}: could not be written ({detail}); nothing was left behind")
        self.path, self.detail = path, detail

    def __reduce__(self):
        return (type(self), (self.path, self.detail))


class StdoutError(DblockError, OSError):
    """Standard output could not be written (a full disk or a file-size limit behind a redirect, a closed pipe): the
    message names stdout and the cause; what was printed before is all the output there is."""


def write_failure(path: str, e: BaseException) -> "WriteError":
    """A library's write error (safetensors' SafetensorError, torch.save's RuntimeError "[enforce fail ...] file
    write failed", an OSError) as one WriteError naming `path` and the cause (ENOSPC, EFBIG, ...) when the message
    says which."""
    import errno as _errno
    msg = str(e)
    cause = None
    if isinstance(e, OSError) and e.errno:
        cause = f"{_errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"
    else:
        for code, text in ((_errno.ENOSPC, "No space left on device"), (_errno.EFBIG, "File too large"),
                           (_errno.EDQUOT, "Disk quota exceeded"), (_errno.EIO, "Input/output error")):
            if text.lower() in msg.lower():
                cause = f"{_errno.errorcode[code]}: {text}"
                break
    detail = cause or (msg.splitlines() or [type(e).__name__])[0][:160]
    return WriteError(path, detail)
