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

User text goes through `encode_prompt(tok, text, allow_special=False)` instead (the CLI's prompts; the server can
call it too): there the literal spelling of a special token is plain text unless the caller opts in, as with the
`tokenizers` library's `Tokenizer.encode_special_tokens` (Hugging Face's `split_special_tokens`), so a prompt that
says `<eos>` cannot end its own completion. It works on a `tokenizers.Tokenizer`, a `CharTokenizer` or an adapter
holding one in `.hf`, and raises `PromptError` naming the prompt, the character and its position.

`save(dir)` writes `dir/tokenizer.json` in the Hugging Face `tokenizers` format (a `WordLevel` model over single
characters, a `Split(".", isolated)` pre-tokenizer, the specials registered as special added tokens, a `Fuse`
decoder) and a `tokenizer_config.json` naming the special tokens (so `transformers.AutoTokenizer` loads it too),
so a bundled model is loaded through the same `tokenizer.json` path as a real checkpoint;
`CharTokenizer.load(dir)` reads it back.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Iterable

from dblock.errors import ConfigError, PromptError

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


def control_ids(cfg) -> set:
    """The model's control token ids (mask, EOS — every one of a multi-EOS model —, pad, BOS) from its config: the ids
    a text prompt must never produce without opting in (`encode_prompt`'s `control_ids`)."""
    out = set()
    for key in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool):
            out.add(v)
    for v in getattr(cfg, "eos_token_ids", None) or ():
        if isinstance(v, int) and not isinstance(v, bool):
            out.add(v)
    return out


def read_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json; a file that does not parse is a `ConfigError` naming it."""
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers package raises a bare Exception with serde's message
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{path}: not a valid tokenizer.json ({detail})") from None


# ---------------------------------------------------------------------------------------------------------------
# user text -> token ids
# ---------------------------------------------------------------------------------------------------------------

_COPIES: dict = {}                # (id(tok), allow_special) -> (tok, copy): tokenizers prepared for prompts
_COPIES_LOCK = threading.Lock()
_COPIES_MAX = 16


def _prompt_tokenizer(tok, allow_special: bool):
    """A private copy of a `tokenizers.Tokenizer` for prompts: no truncation, no padding (a too-long prompt is
    refused, never cut), and `encode_special_tokens = not allow_special` (literal special-token text split into
    ordinary tokens). A copy, so the caller's tokenizer is never mutated while other threads use it."""
    key = (id(tok), bool(allow_special))
    with _COPIES_LOCK:
        hit = _COPIES.get(key)
        if hit is not None and hit[0] is tok:
            return hit[1]
    from tokenizers import Tokenizer
    copy = Tokenizer.from_str(tok.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = not allow_special
    with _COPIES_LOCK:
        if len(_COPIES) >= _COPIES_MAX:
            _COPIES.pop(next(iter(_COPIES)))
        _COPIES[key] = (tok, copy)
    return copy


def _special_tokens(tok) -> dict:
    """{id: text} of the tokenizer's special added tokens."""
    if isinstance(tok, CharTokenizer):
        return {tok.token_to_id[s]: s for s in SPECIAL_TOKENS}
    try:
        return {int(i): t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    except AttributeError:   # an older tokenizers without get_added_tokens_decoder
        return {}


def _short(text: str, at: int, width: int = 24) -> str:
    lo = max(0, at - width // 2)
    piece = text[lo:lo + width]
    return ("..." if lo else "") + piece + ("..." if lo + width < len(text) else "")


def _unencodable(text: str, encode_one, skip: tuple, name: str, specials: dict, allow_special: bool,
                 opt_in: str, detail: str) -> PromptError:
    """The error for text the tokenizer refused: the first character it cannot encode on its own, with its position
    (`skip`: literal spellings matched whole, passed over)."""
    i = 0
    while i < len(text):
        hit = next((s for s in skip if s and text.startswith(s, i)), None)
        if hit is not None:
            i += len(hit)
            continue
        ch = text[i]
        try:
            ok = bool(encode_one(ch))
        except Exception:
            ok = False
        if not ok:
            msg = (f"{name}: character {ch!r} at position {i} (in {_short(text, i)!r}) is not in the tokenizer's "
                   "vocabulary, which has no unknown token")
            spelled = next((s for s in specials.values() if s and ch in s and s in text), None)
            if spelled is not None and not allow_special:
                msg += (f"; {spelled!r} is a special token and prompt text stays plain text (opt in with {opt_in} "
                        "to use it as the control token)")
            return PromptError(msg)
        i += 1
    return PromptError(f"{name}: cannot be tokenized ({detail})")


def encode_prompt(tok, text: str, allow_special: bool = False, *, add_special_tokens: bool = True,
                  control_ids: Iterable[int] = (), max_chars: int | None = None, name: str = "prompt",
                  opt_in: str = "allow_special=True") -> list[int]:
    """User text -> token ids, never a control token the user did not ask for.

    `tok`: a `tokenizers.Tokenizer`, a `CharTokenizer`, or an object holding one in `.hf` (the tasks' adapter).
    `allow_special` False (default): the literal text of a special token (`<eos>`, `<mask>`, `<pad>`, `<bos>`, ...)
    is encoded as ordinary characters (`tokenizers`' `encode_special_tokens`; vLLM and Hugging Face's
    `split_special_tokens` do the same), and any result id that is a special added token or in `control_ids` (the
    model's mask/EOS/pad/BOS ids) is refused. True: special-token text becomes the special token (the
    `tokenizers` default). `add_special_tokens`: let the tokenizer's post-processor add its template tokens (a BOS),
    which are not from the text. `max_chars`: refuse longer text before tokenizing it. `name` names the prompt in
    errors (`--prompt [0]`, `prompt[1]`); `opt_in` names the caller's way to set `allow_special`.

    Raises `PromptError` (a `DblockError` and `ValueError`): empty text, too long, a character outside the vocabulary
    (named, with its 0-based position), or text that encodes to a control token.
    """
    if hasattr(tok, "hf") and not isinstance(tok, CharTokenizer):
        tok = tok.hf
    if not isinstance(text, str):
        raise PromptError(f"{name}: expected text, got {type(text).__name__}")
    if text == "":
        raise PromptError(f"{name}: empty text: give at least one character")
    if max_chars is not None and len(text) > max_chars:
        raise PromptError(f"{name}: {len(text)} characters; at most {max_chars} are accepted (the model's positions "
                          "bound the prompt)")
    specials = _special_tokens(tok)
    control = set(specials) | {int(i) for i in control_ids}
    if isinstance(tok, CharTokenizer):
        ids, offsets = [], []
        pieces = _SPECIAL_RE.split(text) if allow_special else [text]
        pos = 0
        for piece in pieces:
            if allow_special and piece in SPECIAL_TOKENS:
                ids.append(tok.token_to_id[piece])
                offsets.append((pos, pos + len(piece)))
                pos += len(piece)
                continue
            for ch in piece:
                tid = tok.token_to_id.get(ch)
                if tid is None or tid < len(SPECIAL_TOKENS):
                    raise _unencodable(text, lambda c: tok.token_to_id.get(c, -1) >= len(SPECIAL_TOKENS),
                                       SPECIAL_TOKENS if allow_special else (), name, specials, allow_special,
                                       opt_in, "not in the vocabulary")
                ids.append(tid)
                offsets.append((pos, pos + 1))
                pos += 1
        added = [0] * len(ids)                 # no post-processor: every id comes from the text
    else:
        enc_tok = _prompt_tokenizer(tok, allow_special)
        try:
            enc = enc_tok.encode(text, add_special_tokens=False)
        except Exception as e:
            skip = tuple(sorted(specials.values(), key=len, reverse=True)) if allow_special else ()
            raise _unencodable(text, lambda c: enc_tok.encode(c, add_special_tokens=False).ids, skip, name,
                               specials, allow_special, opt_in,
                               (str(e).splitlines() or [type(e).__name__])[0]) from None
        ids, offsets = list(enc.ids), list(enc.offsets)
        if add_special_tokens and enc_tok.post_processor is not None:
            post = enc_tok.post_process(enc, None, True)
            ids, offsets, added = list(post.ids), list(post.offsets), list(post.special_tokens_mask)
        else:
            added = [0] * len(ids)
    if not allow_special:
        for j, t in enumerate(ids):
            if t in control and not added[j]:    # template tokens (a BOS) are not from the text
                a, b = offsets[j] if j < len(offsets) else (0, 0)
                label = specials.get(t) or (tok.vocab[t] if isinstance(tok, CharTokenizer) else tok.id_to_token(t))
                raise PromptError(f"{name}: the text {text[a:b]!r} at position {a} encodes to the control token "
                                  f"{label!r} (id {t}); prompt text cannot produce control tokens (opt in with "
                                  f"{opt_in})")
    if not ids:
        raise PromptError(f"{name}: {text[:40]!r} encodes to no tokens")
    return ids
