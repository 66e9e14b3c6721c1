"""`arith`: a graded synthetic task whose answers are worked solutions of 1 to 7 blocks (C = 16 characters).

Why: GSM8K / HumanEval answers are long worked solutions ending in a checkable value; block-diffusion decoding is
exercised by answers spanning many blocks, ending in EOS. A ~1-3M-parameter model trained on 2 CPU cores must learn
it, so every character of a solution is *locally computable*: it depends only on a few characters of the current
line (next to fixed delimiters) or on the character at the same place in the line above (a structured copy), never
on counting or on long-range arithmetic.

Format. A solution is a sequence of state lines, each ending in `;`, then the marker `=>` and the final value; the
training target is `answer + <eos>`. The first line restates the prompt's input; each next line drops the LAST digit
of the remaining input(s) and adds one digit to the partial result `R` (at its front for `add`, so the sum is built
right to left exactly like carrying by hand; at its end for `rev`).

`add` -- multi-digit addition with carries, line = `A+B,c:R;` (A, B: digits still to add; c: carry in):

    prompt `7+5=`       answer `7+5,0:;+,1:2;=>12`
    prompt `347+85=`    answer `347+85,0:;34+8,1:2;3+,1:32;+,0:432;=>432`
        (7+5+0 = 12: write 2, carry 1; 4+8+1 = 13: write 3, carry 1; 3+0+1 = 4: write 4, carry 0; when A and B
        are empty the final value is R, with the last carry in front when it is 1.)

`rev` -- reverse a digit string, line = `L:R;` (L: digits left; each step moves L's last digit to R's end):

    prompt `rev 3=`     answer `3:;:3;=>3`
    prompt `rev 4821=`  answer `4821:;482:1;48:12;4:128;:1284;=>1284`

Lengths: `add` with 1..6-digit operands gives 16..107 characters, `rev` of 1..8 digits 9..100; the default 1:1 mix
has a mean of about 52 characters (over 3 blocks, see `length_stats`). Prompts are at most 14 characters.

Splits. `sample(split, index)` is a pure function of (mix, sizes, split, index): a `random.Random` seeded with a
SHA-256 of those draws a problem class (sub-task and sizes) and then problems of that class; a problem belongs to
`test` iff the SHA-256 of its prompt falls in the lowest `test_fraction` of the hash range, otherwise to `train`, and
problems of the other split are redrawn. So the splits are disjoint by construction (a prompt's split depends on the
prompt alone) and have the same class mix. Tiny classes repeat (there are only 10 one-digit `rev` problems).

Grading. `grade(prompt, text)` re-solves the prompt and compares exactly with the digits right after the first `=>`
in `text`, the decoded answer (anything from the first `<eos>` on is ignored if still present).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

MARKER = "=>"
SPLITS = ("train", "test")
_ADD = re.compile(r"(\d+)\+(\d+)=")
_REV = re.compile(r"rev (\d+)=")
_FINAL = re.compile(re.escape(MARKER) + r"(\d+)")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str  # the worked solution, ending in MARKER + final; the target is answer + <eos>
    final: str   # the checkable final value
    kind: str = ""


def solve_add(a: str, b: str) -> tuple[str, str]:
    """Worked solution and final value of `a+b=` (see the module docstring)."""
    lines, c, r = [], 0, ""
    while True:
        lines.append(f"{a}+{b},{c}:{r};")
        if not a and not b:
            break
        s = int(a[-1:] or 0) + int(b[-1:] or 0) + c
        a, b, r, c = a[:-1], b[:-1], str(s % 10) + r, s // 10
    final = ("1" if c else "") + r
    return "".join(lines) + MARKER + final, final


def solve_rev(digits: str) -> tuple[str, str]:
    """Worked solution and final value of `rev L=`."""
    lines, left, r = [], digits, ""
    while True:
        lines.append(f"{left}:{r};")
        if not left:
            break
        left, r = left[:-1], r + left[-1]
    return "".join(lines) + MARKER + r, r


def solve(prompt: str) -> Example:
    """Reference solution of any `arith` prompt; ValueError for a prompt that is not one."""
    if m := _ADD.fullmatch(prompt):
        return Example(prompt, *solve_add(m[1], m[2]), kind="add")
    if m := _REV.fullmatch(prompt):
        return Example(prompt, *solve_rev(m[1]), kind="rev")
    raise ValueError(f"not an arith prompt: {prompt!r}")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def answer_text(ids: Iterable[int], tokenizer) -> str:
    """Decode generated ids up to (not including) the first EOS -- the text `grade` expects."""
    ids = [int(i) for i in ids]
    if tokenizer.eos_id in ids:
        ids = ids[: ids.index(tokenizer.eos_id)]
    return tokenizer.decode(ids, skip_special=True)


class ArithTask:
    """Mix of the `add` and `rev` sub-tasks. `mix` maps sub-task -> weight; `add_digits` and `rev_len` are the
    inclusive (min, max) operand / list lengths, drawn uniformly (the difficulty and length knob)."""

    kinds = ("add", "rev")

    def __init__(self, mix: dict[str, float] | None = None, add_digits: Sequence[int] = (1, 6),
                 rev_len: Sequence[int] = (1, 8), test_fraction: float = 0.1, name: str = "arith"):
        mix = dict(mix or {"add": 1.0, "rev": 1.0})
        unknown = set(mix) - set(self.kinds)
        if unknown or not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
            raise ValueError(f"bad mix {mix}: weights >= 0 over {self.kinds}, not all zero")
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        for lo, hi in (add_digits, rev_len):
            if not 1 <= lo <= hi:
                raise ValueError(f"bad size range ({lo}, {hi})")
        self.mix, self.add_digits, self.rev_len = mix, tuple(add_digits), tuple(rev_len)
        self.test_fraction, self.name = test_fraction, name
        self._seed_key = f"{name}|{sorted(mix.items())}|{self.add_digits}|{self.rev_len}"

    def split_of(self, prompt: str) -> str:
        """The split a problem belongs to, from its prompt alone."""
        return "test" if _hash(prompt) % 1_000_000 < self.test_fraction * 1_000_000 else "train"

    def _draw_class(self, rng: random.Random) -> tuple[str, tuple[int, ...]]:
        kinds = [k for k in self.kinds if self.mix.get(k, 0) > 0]
        kind = rng.choices(kinds, weights=[self.mix[k] for k in kinds])[0]
        if kind == "add":
            return kind, (rng.randint(*self.add_digits), rng.randint(*self.add_digits))
        return kind, (rng.randint(*self.rev_len),)

    @staticmethod
    def _draw_prompt(rng: random.Random, kind: str, sizes: tuple[int, ...]) -> str:
        def number(n: int, lead_zero: bool) -> str:
            first = rng.randint(0 if lead_zero or n == 1 else 1, 9)
            return str(first) + "".join(str(rng.randint(0, 9)) for _ in range(n - 1))

        if kind == "add":
            return "{}+{}=".format(*(number(n, False) for n in sizes))
        return f"rev {number(sizes[0], True)}="

    def sample(self, split: str, index: int) -> Example:
        """Draw a class (sub-task, sizes), then problems of that class until one belongs to `split`; a class
        with no problem of `split` after 64 tries (e.g. the 10 one-digit `rev` problems) is redrawn. So both
        splits keep the class proportions of `mix` (up to such tiny classes) and stay disjoint."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        attempt = 0
        while True:
            rng = random.Random(_hash(f"{self._seed_key}|{split}|{index}|{attempt}"))
            kind, sizes = self._draw_class(rng)
            for _ in range(64):
                prompt = self._draw_prompt(rng, kind, sizes)
                if self.split_of(prompt) == split:
                    return solve(prompt)
            attempt += 1

    def examples(self, split: str, n: int, start: int = 0) -> list[Example]:
        return [self.sample(split, start + i) for i in range(n)]

    def grade(self, prompt: str, generated_text: str) -> bool:
        """Exact final answer: the digits right after the first MARKER equal the reference final value."""
        text = generated_text.split("<eos>", 1)[0]
        m = _FINAL.search(text)
        return m is not None and m[1] == solve(prompt).final

    def length_stats(self, split: str, n: int, block_size: int = 16) -> dict:
        """Answer length statistics in characters (= tokens, without EOS) over the first n samples of a split."""
        lens = sorted(len(e.answer) for e in self.examples(split, n))
        q = lambda p: lens[min(n - 1, int(p * n))]  # noqa: E731
        return {
            "n": n, "mean": sum(lens) / n, "min": lens[0], "max": lens[-1],
            "quantiles": {p: q(p) for p in (0.1, 0.25, 0.5, 0.75, 0.9)},
            "frac_lt_block": sum(x < block_size for x in lens) / n,
            "frac_ge_6_blocks": sum(x >= 6 * block_size for x in lens) / n,
            "mean_blocks_with_eos": sum(-(-(x + 1) // block_size) for x in lens) / n,
        }
