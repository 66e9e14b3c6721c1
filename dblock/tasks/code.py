"""The `code` task: complete held-out Python source (`dblock eval --task code`).

Problems are cut from the files of the corpus's split (`dblock.tasks.code_corpus`: the pinned sympy sources, split
by file), at two kinds of places found with `ast`:

    body    right after a function's signature and docstring (the function has a statement after the docstring);
    block   right after the header line of a compound statement (`if`, `for`, `while`, `with`, `try`, `def`,
            `class`, ... : the line ending with `:` before its body).

The prompt is the text of whole lines ending with that line, without its newline, as many preceding lines as fit in
`CONTEXT_CHARS` characters (the cut line alone must fit); the reference continuation is the rest of the file from that
newline on, `REF_CHARS` characters of it (a place needs `MIN_REF_CHARS` after it). So the model's first token is the newline with the next line's indentation,
the way the file tokenizes (a prompt cut at a line end has the same token ids as in its file). A place qualifies when
the next line is not blank.

Order and determinism: the qualifying places of each kind ordered by SHA-256 of (seed, file, line), the two kinds
alternating (body, block, body, ...) while both last, then the rest of the larger kind (blocks are ~13x as many):
`examples(split, n, start)` is a pure function of the split, the seed and (start, n), and the
first n problems of a split are the same for every n' > n.

Quality metrics (`score`; per request, so that two decoders can be compared request by request, and bootstrap CIs
over requests, `bootstrap_ci`):

    next_line_exact   the generated text's first line (between the leading newline and the next one) equals the
                      reference's (trailing whitespace ignored): the task's `accuracy`;
    token_accuracy    share of the first `TOKEN_N` generated ids equal to the reference's ids at the same position
                      (a missing id counts as wrong);
    loss_per_token    the model's held-out loss on the reference continuation (its training objective measured on
                      the held-out split, `dblock.tasks.code_loss`): a property of the weights, not of the decoder.
"""
from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dblock.tasks.arith import Example
from dblock.tasks.code_corpus import corpus_files, read_source

CONTEXT_CHARS = 320       # prompt: whole lines ending with the cut line, at most this many characters
REF_CHARS = 400           # reference continuation kept (a place needs MIN_REF_CHARS of file after it)
MIN_REF_CHARS = 240
TOKEN_N = 32              # token_accuracy over the first TOKEN_N generated ids
ANSWER_N = 64             # answer_token_accuracy over the first ANSWER_N ids (both blocks of an answer)
KINDS = ("body", "block")
_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef,
             ast.AsyncFunctionDef, ast.ClassDef) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def _places(relpath: str) -> list:
    """[(line index k of the cut line (0-based), kind)] of one file."""
    text = read_source(relpath)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.split("\n")
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, _COMPOUND) or not node.body:
            continue
        body = node.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(body) > 1 and \
                isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and \
                isinstance(body[0].value.value, str):
            out[body[0].end_lineno - 1] = "body"          # the docstring's last line
        k = body[0].lineno - 2                             # the header's last line
        if k >= 0 and lines[k].rstrip().endswith(":"):
            out.setdefault(k, "block")
    good = []
    for k, kind in sorted(out.items()):
        if k + 1 >= len(lines) or not lines[k + 1].strip() or len(lines[k]) > CONTEXT_CHARS or \
                sum(len(x) + 1 for x in lines[k + 1:]) < MIN_REF_CHARS:
            continue
        good.append((k, kind))
    return good


def _example(relpath: str, k: int, kind: str) -> Example:
    lines = read_source(relpath).split("\n")
    a, size = k, len(lines[k])
    while a > 0 and size + 1 + len(lines[a - 1]) <= CONTEXT_CHARS:
        a -= 1
        size += 1 + len(lines[a])
    prompt = "\n".join(lines[a:k + 1])
    ref = "\n" + "\n".join(lines[k + 1:])
    ref = ref[:REF_CHARS]
    nxt = lines[k + 1]
    depth = (len(nxt) - len(nxt.lstrip(" "))) // 4
    return Example(prompt=prompt, answer=ref, final=nxt.rstrip(), kind=kind, digits=depth)


def next_line(text: str) -> str | None:
    """The first line of a continuation that starts with a newline: the text between the first and the second
    newline (or the end, when the text ends there). None when the text does not start with a newline."""
    if not text.startswith("\n"):
        return None
    return text[1:].split("\n", 1)[0].rstrip()


@lru_cache(maxsize=8)
def _order(split: str, seed: int) -> tuple:
    places = [(f, k, kind) for f in corpus_files(split) for k, kind in _places(f)]

    def key(p):
        return hashlib.sha256(f"{seed}:{p[0]}:{p[1]}".encode()).digest()
    by_kind = [sorted((p for p in places if p[2] == kind), key=key) for kind in KINDS]
    out = []                                 # the kinds alternate while both last, then the rest of the larger
    for i in range(max(map(len, by_kind))):
        out += [ps[i] for ps in by_kind if i < len(ps)]
    return tuple(out)


class CodeTask:
    """Completion problems cut from the corpus (see the module docstring). `seed` orders them."""

    name = "code"
    style = "code"
    max_new_tokens = 64           # what `dblock eval --task code` generates unless --max-new-tokens says otherwise

    def __init__(self, seed: int = 0, name: str = "code"):
        self.seed, self.name = int(seed), name
        self._by_prompt: dict = {}        # prompt -> the example `examples` gave for it (for `grade` by prompt)

    def describe(self) -> dict:
        return {"name": self.name, "kinds": list(KINDS), "context_chars": CONTEXT_CHARS, "token_n": TOKEN_N,
                "seed": self.seed,
                "split": "by file: test iff SHA-256 of the file's path falls in the lowest 0.05 of the 32-bit range "
                         "(dblock/tasks/code_corpus.py, split_of); evaluation uses the test split"}

    def count(self, split: str) -> int:
        return len(_order(split, self.seed))

    def examples(self, split: str, n: int, start: int = 0) -> list:
        places = _order(split, self.seed)
        if start + n > len(places):
            raise ValueError(f"the code task's {split} split has {len(places)} problems; asked for {start}..{start + n}")
        out = [_example(f, k, kind) for f, k, kind in places[start:start + n]]
        for e in out:
            self._by_prompt.setdefault(e.prompt, e)
        return out

    def grade(self, prompt: str, generated_text: str, example: Example | None = None) -> bool:
        """next_line_exact against `example`'s reference, or (without it) against the reference of the problem this
        task gave for `prompt` (`examples` keeps them: the reference is not a function of the prompt)."""
        if example is None:
            example = self._by_prompt.get(prompt)
            if example is None:
                raise ValueError("the code task grades against a reference: give example=, or a prompt that "
                                 "`examples` returned")
        return next_line(generated_text) == example.final

    @staticmethod
    def score(example: Example, text: str, ids: list, ref_ids: list) -> dict:
        """Per-request metrics: next_line_exact (bool), token_accuracy over the first TOKEN_N ids (the first block)
        and answer_token_accuracy over the first ANSWER_N (the whole answer: under a multi-block schedule the later
        blocks are the ones a warm-up block prepared)."""
        def acc(n):
            n = min(n, len(ref_ids))
            hits = sum(1 for i in range(n) if i < len(ids) and int(ids[i]) == int(ref_ids[i]))
            return hits / n if n else 0.0
        return {"next_line_exact": next_line(text) == example.final, "token_accuracy": acc(TOKEN_N),
                "answer_token_accuracy": acc(ANSWER_N)}


def bootstrap_ci(values, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> list:
    """Percentile bootstrap CI of the mean of per-request `values` ([lo, hi]; the mean itself when there is one
    value). Deterministic in `seed`."""
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    if v.size == 0:
        return [float("nan"), float("nan")]
    if v.size == 1:
        return [float(v[0]), float(v[0])]
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(1)
    a = (1 - level) / 2
    return [float(np.quantile(means, a)), float(np.quantile(means, 1 - a))]


def paired_bootstrap_ci(a, b, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> list:
    """CI of mean(a) - mean(b) over paired requests (the same problems under two decoders)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired bootstrap: {a.shape} vs {b.shape} requests")
    return bootstrap_ci(a - b, n_boot, level, seed)
