"""Character-level tokenizer for the tiny bundled models.

One character is one token, so a block of C = 16 positions is exactly 16 characters of text. The vocabulary is
fixed (32 ids, a multiple of 8; no merges, no normaliser):

    0 <pad>   1 <eos>   2 <bos>   3 <mask>
    4..13     '0'..'9'
    14 '+'  15 '-'  16 '*'  17 '='  18 '>'  19 ','  20 ':'  21 ';'  22 '('  23 ')'  24 '.'  25 ' '
    26 'r'  27 'e'  28 'v'  29 's'  30 'o'  31 't'

The `arith` task uses the digits, `+ = > : ;`, space and `r e v`; the rest is spare room for later sub-tasks
(keeping ids stable). `encode` adds no BOS/EOS: the caller appends `<eos>` to a target answer. The four special
tokens are also recognised when written literally inside a string (as the `tokenizers` library does for added
tokens), e.g. `encode("12<eos>") == [5, 6, 1]`.

`save(dir)` writes `dir/tokenizer.json` in the Hugging Face `tokenizers` format (a `WordLevel` model over single
characters, a `Split(".", isolated)` pre-tokenizer, the specials registered as special added tokens, a `Fuse`
decoder) and a `tokenizer_config.json` naming the special tokens (so `transformers.AutoTokenizer` loads it too),
so a bundled model is loaded through the same `tokenizer.json` path as a real checkpoint;
`CharTokenizer.load(dir)` reads it back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<mask>")
PAD_ID, EOS_ID, BOS_ID, MASK_ID = 0, 1, 2, 3
CHARS = "0123456789" + "+-*=>,:;(). " + "revsot"
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(CHARS)
assert len(VOCAB) == 32 and len(set(VOCAB)) == 32

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


class CharTokenizer:
    """Maps each character to one id; see the module docstring for the id map."""

    def __init__(self, vocab: Iterable[str] = VOCAB):
        self.vocab = tuple(vocab)
        if self.vocab[:4] != SPECIAL_TOKENS:
            raise ValueError(f"the first four tokens must be {SPECIAL_TOKENS}, got {self.vocab[:4]}")
        self.token_to_id = {t: i for i, t in enumerate(self.vocab)}
        self.pad_id, self.eos_id, self.bos_id, self.mask_id = PAD_ID, EOS_ID, BOS_ID, MASK_ID

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _SPECIAL_RE.split(text):
            if piece in SPECIAL_TOKENS:
                ids.append(self.token_to_id[piece])
                continue
            for pos, ch in enumerate(piece):
                tid = self.token_to_id.get(ch)
                if tid is None or tid < len(SPECIAL_TOKENS):
                    raise ValueError(f"character {ch!r} (in {text!r}) is not in the vocabulary")
                ids.append(tid)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Map ids back to text. With `skip_special`, `<pad>`, `<eos>`, `<bos>`, `<mask>` are dropped (the
        caller cuts at the first EOS first if that is what it wants; see `arith.answer_text`)."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.vocab):
                raise ValueError(f"token id {i} out of range [0, {len(self.vocab)})")
            if skip_special and i < len(SPECIAL_TOKENS):
                continue
            out.append(self.vocab[i])
        return "".join(out)

    def to_hf(self):
        """The equivalent `tokenizers.Tokenizer` (WordLevel over characters)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(self.vocab)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
        return tok

    def save(self, directory: str | Path) -> Path:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.to_hf().save(str(path / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
                  "pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "mask_token": "<mask>"}
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return path / "tokenizer.json"

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        path = Path(directory)
        if path.is_dir():
            path = path / "tokenizer.json"
        data = json.loads(path.read_text())
        model = data.get("model", {})
        if model.get("type") != "WordLevel":
            raise ValueError(f"{path}: expected a WordLevel character tokenizer, got model type {model.get('type')!r}")
        by_id = {i: t for t, i in model["vocab"].items()}
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"{path}: vocabulary ids are not contiguous")
        vocab = [by_id[i] for i in range(len(by_id))]
        bad = [t for t in vocab[len(SPECIAL_TOKENS):] if len(t) != 1]
        if bad:
            raise ValueError(f"{path}: not a character vocabulary (multi-character tokens {bad[:5]})")
        return cls(vocab)
