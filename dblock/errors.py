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


class DistributedError(DblockError, RuntimeError):
    """A torch.distributed run that failed or timed out; the message says which ranks and what they were doing."""
