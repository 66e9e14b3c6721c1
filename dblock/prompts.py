"""Prompts from the command line: a model folder's tokenizer.json, text prompts as token ids, `--prompt-ids`.

Text prompts go through `dblock.tasks.tokenizer.encode_prompt`: the literal spelling of a special token (`<eos>`,
`<mask>`, ...) is plain text unless `--allow-special-tokens` is given, a character the vocabulary cannot encode is
named with its position, the model's control ids are refused, and text longer than `CHARS_PER_POSITION` characters
per model position is refused before it is tokenized. Imports nothing heavy.
"""
from __future__ import annotations

import os

from dblock.cli_args import _show

#: characters of a text prompt per position of the model: longer text is refused before it is tokenized (the
#: serving API bounds its prompts the same way, 16 characters per token of its limit)
CHARS_PER_POSITION = 16


def control_ids(cfg) -> set:
    """The model's control token ids (`dblock.tasks.tokenizer.control_ids`)."""
    from dblock.tasks.tokenizer import control_ids as ids
    return ids(cfg)


def load_tokenizer(model_or_folder):
    """The model folder's tokenizer.json through the `tokenizers` package, or None when the folder has none.
    `model_or_folder`: a loaded model (its `.source` folder) or a folder. A file that does not parse is a
    `ConfigError` naming it."""
    folder = model_or_folder if isinstance(model_or_folder, (str, os.PathLike)) else \
        getattr(model_or_folder, "source", "")
    path = os.path.join(folder or "", "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from dblock.tasks.tokenizer import read_tokenizer
    return read_tokenizer(path)


def encode_texts(tok, texts, cfg, labels, allow_special: bool = False, where: str = "") -> list:
    """Text prompts -> token ids through `dblock.tasks.tokenizer.encode_prompt`: at most CHARS_PER_POSITION
    characters per model position, literal special tokens as plain text unless `allow_special`, the model's control
    ids refused. `labels[i]` names prompt i in errors; `where` is the model folder (for the no-tokenizer error)."""
    from dblock.errors import ConfigError
    from dblock.tasks.tokenizer import encode_prompt
    texts = list(texts)
    if texts and tok is None:
        raise ConfigError(f"{labels[0]}: a text prompt needs a tokenizer.json in the model folder {where}; give "
                          "token ids instead")
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    max_chars = CHARS_PER_POSITION * max_pos if max_pos else None
    ctrl = control_ids(cfg)
    return [encode_prompt(tok, t, allow_special, control_ids=ctrl, max_chars=max_chars, name=label,
                          opt_in="--allow-special-tokens") for t, label in zip(texts, labels)]


def parse_ids(s: str, flag: str = "--prompt-ids") -> list:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"{flag} {_show(s)!r}: give comma-separated integers, e.g. 5,6,7") from None
    if not ids:
        raise ValueError(f"{flag} {s!r}: empty; give comma-separated integers, e.g. 5,6,7")
    return ids
