"""The `exec` task: "what does this program print?" (`dblock eval --task exec`).

Program execution as in *Learning to Execute* (Zaremba and Sutskever, 2014) and CRUXEval's output prediction. A
prompt is a short Python program drawn from the generator's own grammar; the answer is what it prints, found by
running it in-process (`run`: `exec` of generated text with no builtins but `print` and `range`, never a user's
code). Every value is a small integer 0..9 (every arithmetic result is taken `% 10`, as the program itself says),
so one value is one character of the character tokenizer.

    a=7                          state: two or three variables (a, b[, c]) set from literals
    b=4
    L=[3,1,4,1,5,9,2,6,5,3]      optional: a list of ten digits that the loop indexes
    print(a,b)
    for i in range(11):          8..16 iterations
     a=(a+b)%10                  one statement per variable, in the order a, b, c:
     if a>b:b=L[a]                   v=(x+y)%10   v=(x-y)%10   v=(x*y)%10   (y a variable, a constant or i)
     else:b=(b*3)%10                 v=x//k   v=x%k   v=L[x]
     print(a,b)                      if x>y:v=E1 / else:v=E2   (> < ==; E1, E2 of the forms above)

The output is one line per state, its values separated by spaces (`7 4`, `1 4`, ...): the state before the loop, then
the state after each iteration. So every printed value depends on the values of the line before (and, for a variable
updated after another, on that one's new value in the same line): the values form dependency chains as long as the
loop (depth 8..16), which a model with a few layers resolves a link or two per forward pass -- the passes a block
lives come from the task, the confidence of each decision from training.

Why this shape. Each value is a function of at most three values at fixed places (the line before, or earlier in its
own line) and of one statement of the program, found by its variable's name; the column of a value names its
variable (`print(a,b,c)` prints them in that order), and a statement reads a variable updated before it in the body
(alphabetically earlier) from the current line, any other from the line before: one rule, no counting. Answers are
`lines x (2 vars x 2 + ...)` characters: 2 variables, 8..16 iterations: 36..68 characters; 3 variables, 8..14
iterations: 54..90 -- two or three blocks of 32. Programs whose trace repeats a state within its first `DISTINCT`
lines are redrawn (a cycle of a few states is copied, not computed).

Splits, as the arith task: `sample(split, index)` is a pure function of (seed key, split, index); a program belongs to
`test` iff the SHA-256 of its text falls in the lowest `test_fraction` of the hash range; problems of the other split
are redrawn. Example.kind is `vars2` / `vars3`; Example.digits (the difficulty grade) is the number of iterations.

Grading (`grade`): the whole answer exact (the printed lines, trailing whitespace ignored) -- the task's accuracy.
`score` adds the per-value accuracy (the share of the reference's printed values equal, position by position, to the
generated ones; a missing value counts as wrong). The held-out loss is the model's training objective on the
reference answer (`dblock.tasks.code_eval.heldout_loss`).
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Optional

from dblock.tasks.arith import SPLITS, Example
from dblock.tasks.tokenizer import SPECIAL_TOKENS, CharTokenizer

NAMES = "abc"
OPS = ("+", "-", "*")
CMPS = (">", "<", "==")
DISTINCT = 8                         # the first DISTINCT states of a trace are all different
ITERS = {2: (8, 16), 3: (8, 14)}     # loop lengths by number of variables (answers of 2..3 blocks of 32)
MAX_ANSWER = 96                      # characters (with <eos>: at most three blocks of 32)

# The character vocabulary of the exec models: the specials, then every character a program or its output uses, a
# multiple of 8 (ids of the specials as in the arith tokenizer).
EXEC_CHARS = "0123456789" + " \n+-*/%=<>!()[],:" + "abcdefghijklmnopqrstuvwxyz" + "L#'_;.?"
EXEC_VOCAB = SPECIAL_TOKENS + tuple(EXEC_CHARS)
assert len(EXEC_VOCAB) % 8 == 0 and len(set(EXEC_VOCAB)) == len(EXEC_VOCAB), len(EXEC_VOCAB)


def exec_tokenizer() -> CharTokenizer:
    """The exec models' character tokenizer (a WordLevel `tokenizer.json` that `transformers.AutoTokenizer` loads)."""
    return CharTokenizer(EXEC_VOCAB)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def run(program: str) -> str:
    """What `program` prints: the generator's own grammar run in-process, with `print` captured and no other
    builtin but `range` (the prompt text is never a user's)."""
    out: list = []

    def _print(*args):
        out.append(" ".join(str(a) for a in args) + "\n")
    exec(compile(program, "<exec-task>", "exec"), {"__builtins__": {"range": range, "print": _print}})  # noqa: S102
    return "".join(out)


def _operand(rng: random.Random, names: str) -> str:
    """A second operand: a variable or a constant 1..9."""
    return rng.choice(names) if rng.random() < 0.45 else str(rng.randint(1, 9))


def _expr(rng: random.Random, names: str, v: str, has_list: bool) -> str:
    """One right-hand side for variable v (see the module docstring)."""
    x = v if rng.random() < 0.5 else rng.choice(names)
    r = rng.random()
    if has_list and r < 0.18:
        return f"L[{x}]"
    if r < 0.28:
        return f"{x}//{rng.randint(2, 3)}"
    if r < 0.38:
        return f"{x}%{rng.randint(2, 9)}"
    return f"({x}{rng.choice(OPS)}{_operand(rng, names)})%10"


def _statement(rng: random.Random, names: str, v: str, has_list: bool) -> str:
    if rng.random() < 0.3:
        x, y = rng.sample(names, 2) if rng.random() < 0.7 else (rng.choice(names), str(rng.randint(1, 8)))
        e1, e2 = _expr(rng, names, v, has_list), _expr(rng, names, v, has_list)
        while e2 == e1:
            e2 = _expr(rng, names, v, has_list)
        return f" if {x}{rng.choice(CMPS)}{y}:{v}={e1}\n else:{v}={e2}\n"
    return f" {v}={_expr(rng, names, v, has_list)}\n"


def draw_program(rng: random.Random, n_vars: int, iters: int, has_list: bool) -> str:
    names = NAMES[:n_vars]
    head = "".join(f"{v}={rng.randint(0, 9)}\n" for v in names)
    if has_list:
        head += "L=[" + ",".join(str(rng.randint(0, 9)) for _ in range(10)) + "]\n"
    pr = f"print({','.join(names)})\n"
    body = "".join(_statement(rng, names, v, has_list) for v in names)
    return head + pr + f"for i in range({iters}):\n" + body + " " + pr


def _good(answer: str) -> bool:
    lines = answer.split("\n")[:-1]
    return len(set(lines[:DISTINCT])) == min(DISTINCT, len(lines)) and len(answer) + 1 <= MAX_ANSWER


@dataclass(frozen=True)
class ExecSizes:
    vars_: tuple = (2, 3)            # numbers of variables drawn (uniformly)
    list_prob: float = 0.35          # probability that a program has the list L
    max_iters: Optional[int] = None  # cap the loop length (the curriculum's early stages; 0: no loop iteration)


class ExecTask:
    """Programs and their outputs (see the module docstring)."""

    style = "exec"
    max_new_tokens = MAX_ANSWER      # what `dblock eval --task exec` generates unless --max-new-tokens says otherwise

    def __init__(self, name: str = "exec", test_fraction: float = 0.05, sizes: ExecSizes = ExecSizes()):
        self.name, self.test_fraction, self.sizes_ = name, float(test_fraction), sizes
        self._seed_key = f"exec|{sizes.vars_}|{sizes.list_prob}|{sizes.max_iters}"

    def describe(self) -> dict:
        return {"name": self.name, "style": self.style, "variables": list(self.sizes_.vars_),
                "iterations": {str(k): list(v) for k, v in ITERS.items()}, "list_probability": self.sizes_.list_prob,
                "distinct_states": DISTINCT,
                "split": f"test iff SHA-256(program) falls in the lowest {self.test_fraction:g} of the hash range "
                         "(dblock/tasks/exec_task.py, ExecTask.split_of); evaluation uses the test split"}

    def sizes(self) -> dict:
        """{kind: (min, max) iterations} (the curriculum reads the largest maximum)."""
        out = {}
        for n in self.sizes_.vars_:
            lo, hi = ITERS[n]
            if self.sizes_.max_iters is not None:
                lo, hi = min(lo, self.sizes_.max_iters), min(hi, self.sizes_.max_iters)
            out[f"vars{n}"] = (lo, hi)
        return out

    def capped(self, max_digits: int) -> "ExecTask":
        """The same grammar with loops of at most `max_digits` iterations (a curriculum stage: below the shortest
        loop, exactly `max_digits`)."""
        s = ExecSizes(self.sizes_.vars_, self.sizes_.list_prob, int(max_digits))
        return ExecTask(self.name, self.test_fraction, s)

    def split_of(self, prompt: str) -> str:
        return "test" if _hash(prompt) % 1_000_000 < self.test_fraction * 1_000_000 else "train"

    def solve(self, prompt: str) -> Example:
        """The reference answer of a program of this grammar (what it prints)."""
        names = re.search(r"^print\(([a-c,]+)\)$", prompt, re.M)
        iters = re.search(r"range\((\d+)\)", prompt)
        if names is None or iters is None:
            raise ValueError(f"not an exec-task program: {prompt[:60]!r}")
        answer = run(prompt)
        n = len(names[1].split(","))
        return Example(prompt=prompt, answer=answer, final=answer, kind=f"vars{n}", digits=int(iters[1]))

    def sample(self, split: str, index: int) -> Example:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        attempt = 0
        while True:
            rng = random.Random(_hash(f"{self._seed_key}|{split}|{index}|{attempt}"))
            n_vars = rng.choice(self.sizes_.vars_)
            lo, hi = self.sizes()[f"vars{n_vars}"]
            iters = rng.randint(lo, hi)
            has_list = rng.random() < self.sizes_.list_prob
            for _ in range(64):
                prog = draw_program(rng, n_vars, iters, has_list)
                if self.split_of(prog) != split:
                    continue
                answer = run(prog)
                if _good(answer):
                    return Example(prompt=prog, answer=answer, final=answer, kind=f"vars{n_vars}", digits=iters)
            attempt += 1

    def examples(self, split: str, n: int, start: int = 0) -> list:
        return [self.sample(split, start + i) for i in range(n)]

    def grade(self, prompt: str, generated_text: str, example: Example | None = None) -> bool:
        """Whole answer exact: the generated lines equal what the program prints (trailing whitespace ignored)."""
        ref = example.answer if example is not None else run(prompt)
        return _lines(generated_text) == _lines(ref)

    @staticmethod
    def score(example: Example, text: str, ids=None, ref_ids=None) -> dict:
        """Per-request metrics: answer_exact (bool) and value_accuracy (share of the reference's printed values
        equal, position by position, to the generated ones)."""
        ref = _values(example.answer)
        got = _values(text)
        hits = sum(1 for k, v in enumerate(ref) if k < len(got) and got[k] == v)
        return {"answer_exact": _lines(text) == _lines(example.answer),
                "value_accuracy": hits / len(ref) if ref else 0.0}


def _lines(text: str) -> list:
    text = text.split("<eos>", 1)[0]
    return [ln.rstrip() for ln in text.rstrip().split("\n")]


def _values(text: str) -> list:
    return text.split("<eos>", 1)[0].split()
