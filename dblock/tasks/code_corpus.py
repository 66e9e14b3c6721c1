"""The code corpus and its tokenizer: the Python sources of the pinned `sympy` package, read where pip installed it.

Nothing is downloaded and the repository copies no source: torch depends on sympy, so every environment that runs
dblock already holds ~1,500 files / 25 MB of real Python with docstrings and doctests (BSD licence). The corpus is
pinned to one sympy version (`SYMPY_VERSION`, also pinned in pyproject.toml): another version is one `ConfigError`
naming both, since a different version would silently be a different corpus and a different split.

Split, by file: a file (its path relative to site-packages, e.g. `sympy/core/add.py`) is held out iff the first
32 bits of SHA-256(path) fall in the lowest `TEST_FRACTION` of their range. The rule depends on the path alone, so
the split is deterministic and disjoint: no line of a held-out file is ever trained on (files are read whole).

Tokenizer (`build_tokenizer`): a byte-level BPE trained with the `tokenizers` library on the train split, the four
special tokens first (`<pad>` 0, `<eos>` 1, `<bos>` 2, `<mask>` 3, the ids of the character tokenizer), vocabulary
`VOCAB_SIZE` = 2048 by default. Byte-level: every string round-trips. The pre-tokenizer is GPT-2's, so a token never
crosses a line end except inside a run of whitespace (a newline and the next line's indentation are one token):
a prompt cut at the end of a line tokenizes as the same ids as inside its file. Training is deterministic (merge
counts over the whole split; the same vocabulary whatever the file order), ~7 s on one core. `save_tokenizer` writes
`tokenizer.json` and `tokenizer_config.json` (special tokens and the chat template) so that
`transformers.AutoTokenizer.from_pretrained(folder)` loads it.

Training windows (`TrainWindows`): a step's examples are windows of L tokens cut from train files chosen with
probability proportional to their length, starting at a line start (the token after one holding a newline, or the
file start); a window that reaches its file's end gets `<eos>` and then `<eos>` padding. A pure function of (seed,
step). See `dblock.tasks.train_data` for how a window becomes a training example.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

from dblock.errors import ConfigError

SYMPY_VERSION = "1.14.0"
TEST_FRACTION = 0.05
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<mask>")
PAD_ID, EOS_ID, BOS_ID, MASK_ID = 0, 1, 2, 3

# A completion model: a conversation renders as its user and assistant texts in order (system messages dropped),
# so one user message is exactly the prompt /v1/completions would get.
CHAT_TEMPLATE = (
    "{#- Chat template of the bundled code models: plain completion models of Python source, trained without a chat "
    "format. A conversation renders as its user and assistant contents in order, each assistant turn closed by "
    "<eos>; system (and developer) messages are dropped. One user message renders as itself, the prompt "
    "/v1/completions would get. -#}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message['role'] in ['user', 'assistant'] -%}\n"
    "        {%- if message['content'] is string -%}{{- message['content'] -}}{%- endif -%}\n"
    "        {%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}\n"
    "    {%- elif message['role'] not in ['system', 'developer'] -%}\n"
    "        {{- raise_exception(\"this model takes system, user and assistant messages; got role '\" ~ "
    "message['role'] ~ \"'\") -}}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n")


def sympy_root() -> Path:
    """site-packages of the installed sympy (the folder holding `sympy/`), after checking its version."""
    spec = importlib.util.find_spec("sympy")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the code corpus is the Python source of sympy {SYMPY_VERSION}, and sympy is not installed "
                          f"(pip install sympy=={SYMPY_VERSION})")
    pkg = Path(list(spec.submodule_search_locations)[0])
    try:
        version = importlib.metadata.version("sympy")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version != SYMPY_VERSION:
        raise ConfigError(f"the code corpus is the source of sympy {SYMPY_VERSION} (pinned in pyproject.toml); this "
                          f"environment has sympy {version} at {pkg}: install sympy=={SYMPY_VERSION} (another version "
                          "is another corpus and another split)")
    return pkg.parent


def split_of(relpath: str) -> str:
    """'test' iff SHA-256 of the file's path (relative to site-packages, '/'-separated) is in the lowest
    TEST_FRACTION of the 32-bit range, else 'train'."""
    h = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16)
    return "test" if h < TEST_FRACTION * 2 ** 32 else "train"


@lru_cache(maxsize=1)
def _all_files(root: str) -> tuple:
    out = []
    for d, dirs, files in os.walk(os.path.join(root, "sympy")):
        dirs.sort()
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return tuple(sorted(out))


def corpus_files(split: Optional[str] = None) -> list:
    """Sorted relative paths of the corpus's .py files, all of them or one split's."""
    if split not in (None, "train", "test"):
        raise ValueError(f"split {split!r}: allowed 'train', 'test'")
    files = _all_files(str(sympy_root()))
    return [f for f in files if split is None or split_of(f) == split]


@lru_cache(maxsize=4096)
def read_source(relpath: str) -> str:
    return (sympy_root() / relpath).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------------------

def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the train split (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 65536:
        raise ConfigError(f"--vocab-size {vocab_size}: allowed {256 + len(SPECIAL_TOKENS) + 1}..65536 (the 256 "
                          "bytes and the special tokens come first)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([read_source(f) for f in corpus_files("train")], trainer)
    # registered as special added tokens, so decoding skips them and prompt text cannot spell them by accident
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def tokenizer_config(model_max_length: int = 4096) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
            "pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "mask_token": "<mask>",
            "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}


class CodeTokenizer:
    """A byte-level BPE tokenizer with the small API training and evaluation use (`encode`, `decode`, the special
    ids, `vocab_size`, `save`)."""

    pad_id, eos_id, bos_id, mask_id = PAD_ID, EOS_ID, BOS_ID, MASK_ID

    def __init__(self, hf):
        self.hf = hf
        for i, s in enumerate(SPECIAL_TOKENS):
            if hf.token_to_id(s) != i:
                raise ConfigError(f"code tokenizer: {s} must have id {i}, has {hf.token_to_id(s)}")

    @classmethod
    def build(cls, vocab_size: int = VOCAB_SIZE) -> "CodeTokenizer":
        return cls(build_tokenizer(vocab_size))

    @classmethod
    def load(cls, folder: str) -> "CodeTokenizer":
        from dblock.tasks.tokenizer import read_tokenizer
        path = folder if str(folder).endswith(".json") else os.path.join(folder, "tokenizer.json")
        return cls(read_tokenizer(path))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def save(self, directory) -> Path:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        return path / "tokenizer.json"


def is_code_tokenizer(tok) -> bool:
    return isinstance(tok, CodeTokenizer)


# ---------------------------------------------------------------------------------------------------------------
# training windows
# ---------------------------------------------------------------------------------------------------------------

class TrainWindows:
    """Windows of `length` tokens from the train split (see the module docstring). Files are tokenized on first
    use and kept; `window(rng)` draws one."""

    def __init__(self, tok: CodeTokenizer, length: int):
        self.tok, self.length = tok, int(length)
        self.files = corpus_files("train")
        sizes = np.array([len(read_source(f)) for f in self.files], dtype=np.float64)
        self.p = sizes / sizes.sum()
        self._ids: dict = {}

    def file_ids(self, i: int):
        ids = self._ids.get(i)
        if ids is None:
            enc = self.tok.hf.encode(read_source(self.files[i]), add_special_tokens=False)
            arr = np.asarray(enc.ids, dtype=np.int32)
            starts = [0] + [j + 1 for j, t in enumerate(enc.tokens) if "\u010a" in t and j + 1 < len(arr)]
            ids = self._ids[i] = (arr, np.asarray(starts, dtype=np.int64))
        return ids

    def window(self, rng: np.random.Generator) -> list:
        """One window: token ids (a list of `length` ids; <eos> after a file's end, then <eos> padding)."""
        i = int(rng.choice(len(self.files), p=self.p))
        arr, starts = self.file_ids(i)
        s = int(starts[int(rng.integers(len(starts)))])
        w = arr[s:s + self.length].tolist()
        if len(w) < self.length:
            w += [EOS_ID] * (self.length - len(w))
        return w
