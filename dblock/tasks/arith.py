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

Style `groups` (task `arith-long`: `add` of 1..8-digit operands, `div` -- short division of a 2..8-digit number by
one digit 2..9 --, and `rev` of 1..6 digits in the `lines` format above; weights 3:2:1). An `add` or `div` answer is
one GROUP of four characters per column of the longer operand (of the dividend), most significant column first,
groups separated by `,`, then the marker and the result written normally. A group restates the column's input
digits, then its two output digits:

`add`, prompt `A+B=`, operands zero-padded to n = the longer one's length; group j = `a_j b_j c_j s_j` with c_j the
carry INTO column j (from the column on its right; 0 for the units), s_j = (a_j + b_j + c_j) % 10; the sum is the
carry out of the top column, when 1, followed by the s_j:

    prompt `7+5=`       answer `7502=>12`
    prompt `347+85=`    answer `3014,4813,7502=>432`   (7+5 = 12: s 2, carry 1 into the tens; 4+8+1 = 13: s 3, carry
                                                        1 into the hundreds; 3+0+1 = 4: s 4, no carry out)
    prompt `123+45=`    answer `1001,2406,3508=>168`

`div`, prompt `A:d=` (`:` the division sign): group j = `a_j r_{j-1} q_j r_j` with r_{j-1} the remainder carried
in (0 for the first digit; the previous group's last character), q_j, r_j = divmod(10 r_{j-1} + a_j, d); the value is
the quotient (its leading zero dropped), `r` and the last remainder:

    prompt `4721:8=`    answer `4004,7457,2790,1001=>590r1`   (4: q 0 r 4; 47: q 5 r 7; 72: q 9 r 0; 01: q 0 r 1)
    prompt `7:9=`       answer `7007=>0r7`

Why this format for a small non-autoregressive model. (1) Every output character is a function of characters inside
its own group or in the neighbouring group, at distances that are the same for every column and every problem: s_j
reads a_j, b_j, c_j (1-3 back); c_j is the carry out of the group on its right (five characters on: that group's
a, b and c); r_{j-1} is the previous group's last character (two back); q_j and r_j read a_j, r_{j-1} and the
divisor. The one long-range step is the restatement of the operand digits, a copy from the prompt, and the result
after `=>`, a copy of every group's fourth (add) or third (div) character. An earlier layout with only the carry
row (`011=>432`) needed every result digit to find its operand digits at offsets that depend on the operands'
lengths; the bundled ~1.5M-parameter model learned it to 0.10 exact sums, this one past 0.5 in the same number of
steps (`dblock/checkpoints/tiny-masked/MODEL_CARD.md` records the trained model). (2) The answer's length follows from
the prompt and one bit (the carry out of the top column; for div the prompt alone), so the EOS position is known
early. (3) Real sequential structure that a model with a few layers cannot shortcut: a remainder r_j is (the
dividend's first j + 1 digits) mod d, so the div groups are a chain decoded in reading order, a group or two per
pass; a carry is known from the column on its right when that column generates or kills it (a + b != 9) and waits
otherwise, so the add groups resolve right to left in waves along propagate runs; the value waits for the groups it
copies. That was the design's expectation of several passes per block; measured, the trained bundled models resolve
most of it at once (tiny-masked: 1.57 passes per block at threshold 0.95 -- add 1.33, div 2.11, rev 1.00 -- its
MODEL_CARD.md): a few layers suffice to look a carry up across a short propagate run, and only long chains wait. (4) The value after `=>` of `add` is the plain sum, as
in the `lines` style.

Splits. `sample(split, index)` is a pure function of (task, sizes, split, index): a `random.Random` seeded with a
SHA-256 of those draws a problem class (sub-task and sizes) and then problems of that class; a problem belongs to
`test` iff the SHA-256 of its prompt falls in the lowest `test_fraction` of the hash range, otherwise to `train`, and
problems of the other split are redrawn. So the splits are disjoint by construction (a prompt's split depends on the
prompt alone, the same rule for every task and style) and have the same class mix. Tiny classes repeat (there are
only 10 one-digit `rev` problems). `Example.digits` is the problem's difficulty grade: the longest operand's length.

Sizes (`groups`). `add` draws n uniformly, the other operand's length in n-2..n (both operands long, so carries and
their propagate runs are common), in either order; `div` and `rev` draw their length uniformly. Answers are at most
50 characters for add, 50 for div, 64 for rev; prompts at most 18.

Grading. `grade(prompt, text)` re-solves the prompt in the task's style and compares exactly with the value right
after the first `=>` in `text`, the decoded answer (digits; for `div` `Q r R`, e.g. `590r1`; anything from the
first `<eos>` on is ignored if still present).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

MARKER = "=>"
SPLITS = ("train", "test")
STYLES = ("lines", "groups")
_ADD = re.compile(r"(\d+)\+(\d+)=")
_DIV = re.compile(r"(\d+):([1-9])=")
_REV = re.compile(r"rev (\d+)=")
_FINAL = re.compile(re.escape(MARKER) + r"(\d+)")
_FINAL_GROUPS = re.compile(re.escape(MARKER) + r"(\d+(?:r\d+)?)")


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


def solve_add_groups(a: str, b: str) -> tuple[str, str]:
    """Column groups and sum of `a+b=` (`groups` style): `347+85=` -> `3014,4813,7502=>432`."""
    n = max(len(a), len(b))
    a, b = a.zfill(n), b.zfill(n)
    groups, c = [""] * n, 0
    for j in range(n - 1, -1, -1):               # units first: the carry runs right to left
        c_in = c
        c, d = divmod(int(a[j]) + int(b[j]) + c_in, 10)
        groups[j] = f"{a[j]}{b[j]}{c_in}{d}"
    final = ("1" if c else "") + "".join(g[3] for g in groups)
    return ",".join(groups) + MARKER + final, final


def solve_div(a: str, d: str) -> tuple[str, str]:
    """Digit groups, quotient and remainder of `a:d=` with a single digit d (`groups` style, short division):
    `4721:8=` -> `4004,7457,2790,1001=>590r1`."""
    k, r, groups, quot = int(d), 0, [], []
    for x in a:                                   # most significant digit first, like the text
        q, r_out = divmod(10 * r + int(x), k)
        groups.append(f"{x}{r}{q}{r_out}")
        quot.append(str(q))
        r = r_out
    final = ("".join(quot).lstrip("0") or "0") + "r" + str(r)
    return ",".join(groups) + MARKER + final, final


def solve(prompt: str, style: str = "lines") -> Example:
    """Reference solution of a prompt in `style` (`lines`: add, rev; `groups`: add, div, rev); ValueError for a
    prompt that is not one of them."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if m := _ADD.fullmatch(prompt):
        n = max(len(m[1]), len(m[2]))
        if style == "groups":
            return Example(prompt, *solve_add_groups(m[1], m[2]), kind="add", digits=n)
        return Example(prompt, *solve_add(m[1], m[2]), kind="add", digits=n)
    if m := _REV.fullmatch(prompt):
        return Example(prompt, *solve_rev(m[1]), kind="rev", digits=len(m[1]))
    if style == "groups" and (m := _DIV.fullmatch(prompt)):
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
    answer format of `add` (`lines` or `groups`, see the module docstring; `div` needs `groups`)."""

    def __init__(self, mix: dict[str, float] | None = None, add_digits: Sequence[int] = (1, 6),
                 rev_len: Sequence[int] = (1, 8), test_fraction: float = 0.1, name: str = "arith",
                 style: str = "lines", div_digits: Sequence[int] = (2, 8)):
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        self.kinds = ("add", "rev") if style == "lines" else ("add", "div", "rev")
        mix = dict(mix or {"add": 1.0, "rev": 1.0})
        unknown = set(mix) - set(self.kinds)
        if unknown or not mix or not all(math.isfinite(w) and w >= 0 for w in mix.values()) or \
                sum(mix.values()) <= 0:
            raise ValueError(f"bad mix {mix}: finite weights >= 0 over {self.kinds}, not all zero")
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
        if kind == "add" and self.style == "groups":   # both operands long: n, then n-2..n, in either order
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
        m = (_FINAL if self.style == "lines" else _FINAL_GROUPS).search(text)
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
