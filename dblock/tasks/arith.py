"""`arith` tasks: graded synthetic problems whose answers are worked solutions ending in a checkable value.

Why: GSM8K / HumanEval answers are long worked solutions ending in a checkable value; block-diffusion decoding is
exercised by answers spanning several blocks, ending in EOS. A ~1-8M-parameter model trained on 2 CPU cores must learn
them, so every character of a solution is *locally computable*: it depends only on a few characters at fixed
distances (from delimiters, or from its own position), never on counting or on long-range arithmetic.

Two answer styles share the prompts (`A+B=`, `rev L=`) and the convention that the checkable value follows the
marker `=>`; the training target is `answer + <eos>`.

Style `lines` (tasks `arith`, `arith-small`, `arith-add`, `arith-rev`, the `arith:...` mixes). A solution is a sequence
of state lines, each ending in `;`, then `=>` and the final value. The first line restates the prompt's input; each
next line drops the LAST digit of the remaining input(s) and adds one digit to the partial result `R` (at its front
for `add`, so the sum is built right to left exactly like carrying by hand; at its end for `rev`).

`add` -- multi-digit addition with carries, line = `A+B,c:R;` (A, B: digits still to add; c: carry in):

    prompt `7+5=`       answer `7+5,0:;+,1:2;=>12`
    prompt `347+85=`    answer `347+85,0:;34+8,1:2;3+,1:32;+,0:432;=>432`
        (7+5+0 = 12: write 2, carry 1; 4+8+1 = 13: write 3, carry 1; 3+0+1 = 4: write 4, carry 0; when A and B
        are empty the final value is R, with the last carry in front when it is 1.)

`rev` -- reverse a digit string, line = `L:R;` (L: digits left; each step moves L's last digit to R's end):

    prompt `rev 3=`     answer `3:;:3;=>3`
    prompt `rev 4821=`  answer `4821:;482:1;48:12;4:128;:1284;=>1284`

Lengths (`lines`): `add` with 1..6-digit operands gives 16..107 characters, `rev` of 1..8 digits 9..100; the default
1:1 mix has a mean of about 52 characters (over 3 blocks, see `length_stats`). Prompts are at most 14 characters.

Style `columns` (task `arith-long`: `add` of 1..8-digit operands, `div` -- short division of a 4..12-digit number
by one digit 2..9 --, and `rev` of 1..6 digits in the `lines` format above; weights 2:3:1). An `add` or `div` answer
is one row of intermediate digits aligned with the operands' columns, the marker, and the result written normally:

`add`, prompt `A+B=`: the CARRY ROW c_n ... c_1 (n: the longer operand's length; c_{j+1} the carry out of the column
of weight 10^j, c_0 = 0 unwritten), most significant first so that it sits right-aligned under the operands, then the
sum (c_n, when 1, followed by s_{n-1} ... s_0), with c_{j+1} = (a_j + b_j + c_j) // 10, s_j = (a_j + b_j + c_j) % 10:

    prompt `123+45=`    answer `000=>168`
    prompt `347+85=`    answer `011=>432`      (7+5 = 12: c_1 = 1; 4+8+1 = 13: c_2 = 1; 3+0+1 = 4: c_3 = 0)
    prompt `999+1=`     answer `111=>1000`

`div`, prompt `A:d=` (`:` the division sign): the REMAINDER ROW r_{n-1} ... r_0 of short division, left-aligned under
the dividend's digits, then the quotient (leading zero dropped), `r` and the remainder, with
q_j = (10 r_{j+1} + a_j) // d, r_j = (10 r_{j+1} + a_j) % d, r_n = 0, digits taken most significant first:

    prompt `4721:8=`    answer `4701=>590r1`   (4: q 0 r 4; 47: q 5 r 7; 72: q 9 r 0; 01: q 0 r 1)
    prompt `7:9=`       answer `7=>0r7`

Why this format for a small non-autoregressive model. (1) Every answer character is a function of at most three
characters, each at a distance that is the same for every column of a problem: a carry c_{j+1} reads a_j and b_j (a
fixed distance left of the prompt's `+` and `=`, the row being right-aligned) and c_j, the next character; a remainder
r_j reads a_j (a fixed distance back: the row is left-aligned with the dividend) and r_{j+1}, the previous character;
a result digit reads its column's carry or remainder and operand digits, a fixed distance back. (The distances
depend on the operands' lengths, so the model learns length-dependent offsets, as the `rev` lines, whose length is
that of the string, already need; they are never counted from the far end of a number.) No mirror lookups
(the column counted from the other end, which a least-significant-first sum needs) and no restated lines (the
`lines` add solutions, which the bundled ~1.5M-parameter model learned to only 0.16 exact answers:
`dblock/checkpoints/tiny-masked/MODEL_CARD.md`). (2) The answer's length follows from the prompt and one character
(c_n; for div the prompt alone), so the EOS position is known early. (3) Real sequential structure, which a model
with a few layers cannot shortcut: a remainder r_j is (the dividend's first n - j digits) mod d, so the remainder row
is a chain decoded in reading order, one or a few digits per pass; a carry is known from its own column where the
column generates or kills it (a_j + b_j != 9) and waits for the carry on its right otherwise, so a carry row is
decoded right to left in waves as long as its propagate runs; the result waits for the row it reads. Division runs in
the direction of the text, so its chains never wait on a later block; addition's run against it, but its chains are
short (a block boundary inside the carry row needs the model to look past a propagate run, 10% of columns). A
least-significant-first multiplication would need mirror lookups, a most-significant-first one long chains against
the block order: division is the single-digit kind that fits. Addition's chains being short, it is the remainder
rows that make blocks live several passes once a model is accurate, hence div's weight (3 of 6) and its long
dividends (4..12 digits). (4) The value after `=>` of `add` is the plain sum, as in the `lines` style, so the
README's `123+45=` reads `000=>168`.

Splits. `sample(split, index)` is a pure function of (task, sizes, split, index): a `random.Random` seeded with a
SHA-256 of those draws a problem class (sub-task and sizes) and then problems of that class; a problem belongs to
`test` iff the SHA-256 of its prompt falls in the lowest `test_fraction` of the hash range, otherwise to `train`, and
problems of the other split are redrawn. So the splits are disjoint by construction (a prompt's split depends on the
prompt alone, the same rule for every task and style) and have the same class mix. Tiny classes repeat (there are
only 10 one-digit `rev` problems). `Example.digits` is the problem's difficulty grade: the longest operand's length.

Sizes (`columns`). `add` draws n uniformly, the other operand's length in n-2..n (both operands long, so carries and
their propagate runs are common), in either order; `div` and `rev` draw their length uniformly. Answers are at most
19 characters for add, 28 for div (12-digit dividends), 64 for rev; prompts at most 18.

Grading. `grade(prompt, text)` re-solves the prompt in the task's style and compares exactly with the value right
after the first `=>` in `text`, the decoded answer (digits; for `div` `Q r R`, e.g. `590r1`; anything from the
first `<eos>` on is ignored if still present).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

MARKER = "=>"
SPLITS = ("train", "test")
STYLES = ("lines", "columns")
_ADD = re.compile(r"(\d+)\+(\d+)=")
_DIV = re.compile(r"(\d+):([1-9])=")
_REV = re.compile(r"rev (\d+)=")
_FINAL = re.compile(re.escape(MARKER) + r"(\d+)")
_FINAL_COLUMNS = re.compile(re.escape(MARKER) + r"(\d+(?:r\d+)?)")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str  # the worked solution, ending in MARKER + final; the target is answer + <eos>
    final: str   # the checkable final value
    kind: str = ""
    digits: int = 0  # difficulty grade: the length of the longest operand (of the string for rev)


def solve_add(a: str, b: str) -> tuple[str, str]:
    """Worked solution (`lines` style) and final value of `a+b=` (see the module docstring)."""
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
    """Worked solution and final value of `rev L=` (both styles)."""
    lines, left, r = [], digits, ""
    while True:
        lines.append(f"{left}:{r};")
        if not left:
            break
        left, r = left[:-1], r + left[-1]
    return "".join(lines) + MARKER + r, r


def solve_add_columns(a: str, b: str) -> tuple[str, str]:
    """Carry row and sum of `a+b=` (`columns` style): `347+85=` -> `011=>432`."""
    n = max(len(a), len(b))
    a, b = a.zfill(n), b.zfill(n)
    carries, digits, c = "", "", 0
    for j in range(n - 1, -1, -1):               # units first
        c, d = divmod(int(a[j]) + int(b[j]) + c, 10)
        carries, digits = str(c) + carries, str(d) + digits
    final = ("1" if c else "") + digits
    return carries + MARKER + final, final


def solve_div(a: str, d: str) -> tuple[str, str]:
    """Remainder row, quotient and remainder of `a:d=` with a single digit d (`columns` style, short division):
    `4721:8=` -> `4701=>590r1`."""
    k, r, rems, quot = int(d), 0, [], []
    for x in a:                                   # most significant digit first, like the text
        q, r = divmod(10 * r + int(x), k)
        rems.append(str(r))
        quot.append(str(q))
    final = ("".join(quot).lstrip("0") or "0") + "r" + str(r)
    return "".join(rems) + MARKER + final, final


def solve(prompt: str, style: str = "lines") -> Example:
    """Reference solution of a prompt in `style` (`lines`: add, rev; `columns`: add, div, rev); ValueError for a
    prompt that is not one of them."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if m := _ADD.fullmatch(prompt):
        n = max(len(m[1]), len(m[2]))
        if style == "columns":
            return Example(prompt, *solve_add_columns(m[1], m[2]), kind="add", digits=n)
        return Example(prompt, *solve_add(m[1], m[2]), kind="add", digits=n)
    if m := _REV.fullmatch(prompt):
        return Example(prompt, *solve_rev(m[1]), kind="rev", digits=len(m[1]))
    if style == "columns" and (m := _DIV.fullmatch(prompt)):
        return Example(prompt, *solve_div(m[1], m[2]), kind="div", digits=len(m[1]))
    raise ValueError(f"not an arith prompt ({style} style): {prompt!r}")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def answer_text(ids: Iterable[int], tokenizer) -> str:
    """Decode generated ids up to (not including) the first EOS -- the text `grade` expects."""
    ids = [int(i) for i in ids]
    if tokenizer.eos_id in ids:
        ids = ids[: ids.index(tokenizer.eos_id)]
    return tokenizer.decode(ids, skip_special=True)


class ArithTask:
    """A weighted mix of sub-tasks. `mix` maps sub-task -> weight; `add_digits`, `rev_len` and `div_digits` are the
    inclusive (min, max) operand / string lengths, drawn uniformly (the difficulty and length knob); `style` is the
    answer format of `add` (`lines` or `columns`, see the module docstring; `div` needs `columns`)."""

    def __init__(self, mix: dict[str, float] | None = None, add_digits: Sequence[int] = (1, 6),
                 rev_len: Sequence[int] = (1, 8), test_fraction: float = 0.1, name: str = "arith",
                 style: str = "lines", div_digits: Sequence[int] = (4, 12)):
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        self.kinds = ("add", "rev") if style == "lines" else ("add", "div", "rev")
        mix = dict(mix or {"add": 1.0, "rev": 1.0})
        unknown = set(mix) - set(self.kinds)
        if unknown or not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
            raise ValueError(f"bad mix {mix}: weights >= 0 over {self.kinds}, not all zero")
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        for lo, hi in (add_digits, rev_len, div_digits):
            if not 1 <= lo <= hi:
                raise ValueError(f"bad size range ({lo}, {hi})")
        self.mix, self.add_digits, self.rev_len = mix, tuple(add_digits), tuple(rev_len)
        self.div_digits, self.style = tuple(div_digits), style
        self.test_fraction, self.name = test_fraction, name
        self._seed_key = f"{name}|{sorted(mix.items())}|{self.add_digits}|{self.rev_len}"
        if style != "lines":        # the `lines` key is unchanged, so the bundled cards' test problems stay the same
            self._seed_key += f"|{self.div_digits}|{style}"

    def sizes(self) -> dict:
        """{kind: (min, max)} of the kinds in the mix."""
        every = {"add": self.add_digits, "div": self.div_digits, "rev": self.rev_len}
        return {k: every[k] for k in self.kinds if self.mix.get(k, 0) > 0}

    def capped(self, max_digits: int) -> "ArithTask":
        """The same task with every size range's maximum lowered to `max_digits` (not below its minimum): the
        curriculum's early stages. A different problem stream (the sizes are part of the seed), the same split rule,
        so its train problems are never test problems of the full task."""
        cap = lambda r: (r[0], max(r[0], min(r[1], int(max_digits))))  # noqa: E731
        return ArithTask(mix=self.mix, add_digits=cap(self.add_digits), rev_len=cap(self.rev_len),
                         test_fraction=self.test_fraction, name=self.name, style=self.style,
                         div_digits=cap(self.div_digits))

    def describe(self) -> dict:
        """What a model card records about the task: kinds, weights, sizes, style and the split rule."""
        return {"name": self.name, "style": self.style, "mix": dict(sorted(self.mix.items())),
                "sizes": {k: list(v) for k, v in self.sizes().items()},
                "split": f"test iff SHA-256(prompt) falls in the lowest {self.test_fraction:g} of the hash range "
                         "(dblock/tasks/arith.py, ArithTask.split_of); evaluation uses the test split"}

    def split_of(self, prompt: str) -> str:
        """The split a problem belongs to, from its prompt alone."""
        return "test" if _hash(prompt) % 1_000_000 < self.test_fraction * 1_000_000 else "train"

    def _draw_class(self, rng: random.Random) -> tuple[str, tuple[int, ...]]:
        kinds = [k for k in self.kinds if self.mix.get(k, 0) > 0]
        kind = rng.choices(kinds, weights=[self.mix[k] for k in kinds])[0]
        if kind == "add" and self.style == "columns":   # both operands long: n, then n-2..n, in either order
            n = rng.randint(*self.add_digits)
            m = rng.randint(max(self.add_digits[0], n - 2), n)
            return kind, ((n, m) if rng.random() < 0.5 else (m, n))
        if kind == "add":
            return kind, (rng.randint(*self.add_digits), rng.randint(*self.add_digits))
        if kind == "div":
            return kind, (rng.randint(*self.div_digits),)
        return kind, (rng.randint(*self.rev_len),)

    @staticmethod
    def _draw_prompt(rng: random.Random, kind: str, sizes: tuple[int, ...]) -> str:
        def number(n: int, lead_zero: bool) -> str:
            first = rng.randint(0 if lead_zero or n == 1 else 1, 9)
            return str(first) + "".join(str(rng.randint(0, 9)) for _ in range(n - 1))

        if kind == "add":
            return "{}+{}=".format(*(number(n, False) for n in sizes))
        if kind == "div":
            return f"{number(sizes[0], False)}:{rng.randint(2, 9)}="
        return f"rev {number(sizes[0], True)}="

    def solve(self, prompt: str) -> Example:
        """The reference solution of `prompt` in this task's style."""
        return solve(prompt, self.style)

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
                    return solve(prompt, self.style)
            attempt += 1

    def examples(self, split: str, n: int, start: int = 0) -> list[Example]:
        return [self.sample(split, start + i) for i in range(n)]

    def grade(self, prompt: str, generated_text: str) -> bool:
        """Exact final answer: the digits right after the first MARKER equal the reference final value."""
        text = generated_text.split("<eos>", 1)[0]
        m = (_FINAL if self.style == "lines" else _FINAL_COLUMNS).search(text)
        return m is not None and m[1] == solve(prompt, self.style).final

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
