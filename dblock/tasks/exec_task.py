"""The `exec` task: "what does this program print?" (`dblock eval --task exec`).

Program execution as in *Learning to Execute* (Zaremba and Sutskever, 2014) and CRUXEval's output prediction. A
prompt is a short Python program drawn from the generator's own grammar; the answer is what it prints, found by
interpreting it in-process (`run`: `ast.parse`, then a walker that knows only this grammar; nothing is `exec`'d).
Every value is a small integer 0..9 (every arithmetic result is taken `% 10`, as the program itself says), so one
value is one character of the character tokenizer.

    L=[3,1,4,1,5,9,2,6,5,3]      optional ("full" grammar): a list of ten digits that the loop indexes
    def f(a,b):                  two or three variables (a, b[, c]), the function's arguments
     print(a,b)
     for i in range(11):         8..16 iterations
      a=(a+b)%10                 one statement per variable, in the order a, b, c:
      if a>b:b=L[a]                  v=(x+y)%10   v=(x-y)%10   v=(x*y)%10   (y a variable, a constant or i)
      else:b=(b*3)%10                v=x//k   v=x%k   v=L[x]
      print(a,b)                     if x>y:v=E1 / else:v=E2   (> < ==; E1, E2 of the forms above)
    f(7,4)                       the call: the initial state, written just before the answer (CRUXEval's layout)

The output is one line per state, its values separated by spaces (`7 4`, `1 4`, ...): the state before the loop, then
the state after each iteration. So every printed value depends on the values of the line before (and, for a variable
updated after another, on that one's new value in the same line): the values form dependency chains as long as the
loop (depth 8..16), which a model with a few layers resolves a link or two per forward pass -- the passes a block
lives come from the task, the confidence of each decision from training.

Grammars (`GRAMMARS`, `exec:grammar=G` as a task name): "full" (the forms above, the task `exec`), "arith" (only
v=(x op y)%10, no list), "counter" (v=(v+k)%10 with k a constant), "copy" (no loop), and the two "acc" grammars,
whose function takes the step as its last argument and whose every value is a function of two values at fixed
places:

    def f(a,b,k):                "acc": a=(a+b)%10, b=(b+k)%10; "acc-pm": each `+` may be a `-`
     print(a,b)
     for i in range(12):
      a=(a+b)%10
      b=(b-k)%10
      print(a,b)
    f(8,1,3)

and the two "chain" grammars: one fixed program of three variables, whose branch makes the trace piecewise (no
column of it is a polynomial to extrapolate); "chain" writes the step 7, "chain-k" takes it as the argument k:

    def f(a,b,c,k):
     print(a,b,c)
     for i in range(10):
      a=(a+b)%10
      if a>c:b=(b+c)%10
      else:b=(b+k)%10
      c=(c+a)%10
      print(a,b,c)
    f(1,1,8,7)

and "chain-u", whose every value is a map of one value at a fixed place (`a=(b*3+1)%10`, `b=(c+7)%10`,
`if a>4:c=(a*7)%10` / `else:c=(a+3)%10`): a sum mod 10 of two uniform digits says nothing about either alone, so a
model gets no gradient toward reading one operand before it reads both; a map of one value does. "chain-b" makes
each variable a map of its own value chosen by a branch on the variable before it (`if c>4:a=(a*3+1)%10` /
`else:a=(a+7)%10`, then b on the new a, c on the new b): one value and one bit each, a chain of three through
every line.

"chain-s" keeps chain-b's maps and makes each branch a membership test in a list L of five distinct digits drawn per
program (`L=[1,4,5,8,9]` before the def; `if c in L:a=(a*3+1)%10` / `else:a=(a+7)%10`, ...): chain-b's step is
one permutation of the 1,000 states, so a value k links on is a fixed function of the state that a model can learn
as a lookup and commit several links a forward; with L varying, each link reads L once more.

"chain-b4" is chain-b over four variables in a ring (`if d>4:a=(a*3+1)%10` / `else:a=(a+7)%10`, b on the new a, c
on the new b, `if c>4:d=(d+9)%10` / `else:d=(d+8)%10`; d's maps chosen so that the step's shortest cycle is 218
states: no answer repeats a state, so none is copied from a period). With three variables every value two or more links on is a
function of the same three digits, so a model can learn each run of links as a lookup on 1,000 states and commit more
links a forward the longer it trains; with four, a value k links on reads k + 1 digits, and from the third link on
all four (10,000 states): past two links a model has to compose what it knows.

"chain-p" is the ring of four whose branches never cut the chain: a link's two maps always give values of different
halves (`if d>4:a=(a*3+1)%10` / `else:a=(a*3+6)%10`, `if a>4:b=(b*7)%10` / `else:b=9-(b*7)%10`, `if b>4:c=(c+1)%10`
/ `else:c=(c+6)%10`, `if c>4:d=(d*3+2)%10` / `else:d=(d*3+7)%10`). In chain-b (and chain-b4) about half of the
values give the same half under either map, so the branch bit after them is known whatever came before: the chain
of bits is cut every two links or so, and a run of links is a lookup on fewer digits than the state. Here every bit
is the parity of the bits before it with what the values add, so from the fourth link on a value is a function of
all four digits before it (10,000 states). The step's shortest cycle is 30 states.

`calls=K` (2 or 3, `exec:grammar=chain-b,sep=none,calls=2`, one-program grammars only) calls the same function K
times with different initial states, one call after another (`f(6,7,1)` / `f(2,0,9)`): the answer is K independent
traces, each of `CALL_ITERS` iterations (shorter, so that the K traces keep the answer's two to three blocks; one
loop length, so that each trace starts at the same place in every answer). A later
trace depends on the prompt, not on the answer before it, so a block that holds the start of the next trace can be
decoded beside the block before it: the layout in which a warm-up block (One Block Ahead) has something to settle.

`sep=none` (`exec:grammar=chain-b,sep=none`) prints a state as its digits alone, `print(a,b,c,sep='')` (lines
`671`): a block of 32 characters then holds 24 chained digits instead of 16, and the loops are longer (`TIGHT_ITERS`)
so that the answers keep their two to three blocks.

The simpler ones are what the learnability probe (benchmarks/exec_probe.py) starts from; docs/models.md ("The exec
task") says which one the bundled exec model is trained on and why.

Why this shape. Each value is a function of at most three values at fixed places (the line before, or earlier in its
own line) and of one statement of the program, found by its variable's name; the column of a value names its
variable (`print(a,b,c)` prints them in that order), and a statement reads a variable updated before it in the body
(alphabetically earlier) from the current line, any other from the line before: one rule, no counting. Answers are
`lines x (2 vars x 2 + ...)` characters: 2 variables, 8..16 iterations: 36..68 characters; 3 variables, 8..14
iterations: 54..90 -- two or three blocks of 32. Programs whose trace repeats a state within its first `DISTINCT`
lines are redrawn (a cycle of a few states is copied, not computed).

Splits, as the arith task: `sample(split, index)` is a pure function of (seed key, split, index); a program belongs to
`test` iff the SHA-256 of its text, with the loop length blanked (`range(N)`), falls in the lowest `test_fraction` of
the hash range -- programs that differ only in their loop length print prefixes of one trace, so they are held out
together; problems of the other split are redrawn. A program of several calls is `test` iff each call alone (the
program with only that call) is, so a held-out program's every trace starts from a held-out state; training draws
only programs whose every call is a training one (`split_of` calls a mixed program `train`, and nothing draws it). Example.kind is `vars2` / `vars3`; Example.digits (the difficulty grade) is the number of iterations.

Grading (`grade`): the whole answer exact (the printed lines, trailing whitespace ignored) -- the task's accuracy.
`score` adds the per-value accuracy (the share of the reference's printed values equal, position by position, to the
generated ones; a missing value counts as wrong). The held-out loss is the model's training objective on the
reference answer (`dblock.tasks.code_eval.heldout_loss`).
"""
from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass, replace
from typing import Optional

from dblock.tasks.arith import SPLITS, Example
from dblock.tasks.tokenizer import SPECIAL_TOKENS, CharTokenizer

NAMES = "abcd"
OPS = ("+", "-", "*")
CMPS = (">", "<", "==")
DISTINCT = 8                         # the first DISTINCT states of a trace are all different
ITERS = {1: (14, 30), 2: (8, 16), 3: (8, 14), 4: (8, 10)}   # loop lengths by number of variables (answers of 2..3 blocks of 32)
#: loop lengths with `sep=none` (lines of n + 1 characters instead of 2n: the answers keep their 2..3 blocks)
TIGHT_ITERS = {1: (14, 30), 2: (12, 24), 3: (16, 22), 4: (12, 17)}
MAX_ANSWER = 96                      # characters (with <eos>: at most three blocks of 32)
MAX_CALLS = 3                        # calls of f in one program (`calls=K`)
#: the loop length of a program of K calls of a function of V variables, by layout (sep) and (V, K): the K traces of
#: iters + 1 lines keep the answer within MAX_ANSWER (a line is V + 1 characters with sep='', 2V with sep=' '). One
#: length, so that every trace starts at the same place in every answer: a model that had to count lines to find
#: where the next trace starts did not learn it (the first wrong line of 14 of 16 answers was the second trace's
#: first, after 400 steps with loops of 8..10; docs/models.md)
CALL_ITERS = {"": {(3, 2): (9, 9), (3, 3): (6, 6), (4, 2): (8, 8), (4, 3): (5, 5)},
              " ": {(3, 2): (6, 6), (3, 3): (4, 4), (4, 2): (4, 4), (4, 3): (2, 2)}}

# The character vocabulary of the exec models: the specials, then every character a program or its output uses, a
# multiple of 8 (ids of the specials as in the arith tokenizer).
EXEC_CHARS = "0123456789" + " \n+-*/%=<>!()[],:" + "abcdefghijklmnopqrstuvwxyz" + "L#'_;.?"
EXEC_VOCAB = SPECIAL_TOKENS + tuple(EXEC_CHARS)
assert len(EXEC_VOCAB) % 8 == 0 and len(set(EXEC_VOCAB)) == len(EXEC_VOCAB), len(EXEC_VOCAB)


def exec_tokenizer() -> CharTokenizer:
    """The exec models' character tokenizer (a WordLevel `tokenizer.json` that `transformers.AutoTokenizer` loads)."""
    return CharTokenizer(EXEC_VOCAB)


_LOOP_LEN = re.compile(r"range\(\d+\)")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


MAX_PROGRAM = 2000                   # characters: a program of this grammar is a few hundred


def run(program: str) -> str:
    """What `program` prints, found by interpreting it: the text is parsed with `ast.parse` (which runs nothing)
    and walked by `_Interp`, which knows only the generator's grammar (assignments of digits and of the expression
    forms above, a list of digits, one `for` over `range(N)`, `if`/`else` on one comparison, `print` of variables,
    at most `MAX_CALLS` calls of f)
    and refuses anything else with a ValueError naming the construct and its line. Nothing is `exec`'d: a prompt
    given to `solve` or `grade` may come from anywhere."""
    if not isinstance(program, str) or len(program) > MAX_PROGRAM:
        raise ValueError(f"not an exec-task program: expected text of at most {MAX_PROGRAM} characters")
    try:
        tree = ast.parse(program, mode="exec")
    except SyntaxError as e:
        raise ValueError(f"not an exec-task program: line {e.lineno}: {e.msg}") from None
    out: list = []
    it = _Interp(out)
    it.block(tree.body)
    if not it.called:
        raise ValueError("not an exec-task program: it never calls f")
    return "".join(out)


_BINOPS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y,
           ast.FloorDiv: lambda x, y: x // y, ast.Mod: lambda x, y: x % y}
_CMPOPS = {ast.Gt: lambda x, y: x > y, ast.Lt: lambda x, y: x < y, ast.Eq: lambda x, y: x == y}
_MAX_LOOP = 64


def _params_ok(params: list) -> bool:
    """f's parameters: a[, b[, c]], optionally followed by the step k (the acc grammars)."""
    names = params[:-1] if params[-1:] == ["k"] else params
    return bool(names) and names == list(NAMES[:len(names)])


class _Interp:
    """A walker over the AST of one program of the exec grammar (see `run`)."""

    def __init__(self, out: list):
        self.out, self.env, self.func, self.called = out, {}, None, 0

    @staticmethod
    def refuse(node, what: str):
        raise ValueError(f"not an exec-task program: line {getattr(node, 'lineno', '?')}: {what}")

    def block(self, stmts, level: str = "module") -> None:
        """Run statements at `level`: "module" (the list L, `def f(...)`, the calls `f(digits)`), "function" (its
        body: print, one for loop), "loop" (assignments, if/else, print)."""
        for st in stmts:
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                name = st.targets[0].id
                if name == "L" and level == "module" and isinstance(st.value, ast.List):
                    self.env["L"] = [self.digit(e) for e in st.value.elts]
                elif name in NAMES and level == "loop":
                    self.env[name] = self.expr(st.value)
                else:
                    self.refuse(st, f"assignment to {name!r} here")
            elif (level == "module" and isinstance(st, ast.FunctionDef) and st.name == "f" and not st.decorator_list
                  and not st.returns and not (st.args.posonlyargs or st.args.vararg or st.args.kwonlyargs
                                              or st.args.kwarg or st.args.defaults)
                  and _params_ok([a.arg for a in st.args.args])
                  and self.func is None):
                self.func = st
            elif level == "module" and isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) \
                    and isinstance(st.value.func, ast.Name) and st.value.func.id == "f":
                call = st.value
                if self.func is None or self.called >= MAX_CALLS or call.keywords \
                        or len(call.args) != len(self.func.args.args):
                    self.refuse(st, f"a call other than f(digits) after its def (at most {MAX_CALLS} calls)")
                self.called += 1
                self.env.update({a.arg: self.digit(v) for a, v in zip(self.func.args.args, call.args)})
                self.block(self.func.body, "function")
            elif level in ("function", "loop") and isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                self.print_(st.value)
            elif (level == "function" and isinstance(st, ast.For) and isinstance(st.target, ast.Name)
                  and st.target.id == "i" and isinstance(st.iter, ast.Call) and isinstance(st.iter.func, ast.Name)
                  and st.iter.func.id == "range" and len(st.iter.args) == 1 and not st.iter.keywords
                  and not st.orelse):
                n = self.digit(st.iter.args[0], hi=_MAX_LOOP)
                for k in range(n):
                    self.env["i"] = k
                    self.block(st.body, "loop")
            elif isinstance(st, ast.If) and level == "loop" and len(st.body) == 1 and len(st.orelse) == 1:
                self.block(st.body if self.test(st.test) else st.orelse, "loop")
            else:
                self.refuse(st, f"a statement the grammar does not have here ({type(st).__name__})")

    def digit(self, node, hi: int = 9) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= hi:
            return node.value
        self.refuse(node, f"expected an integer literal 0..{hi}")

    def test(self, node) -> bool:
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
            return _CMPOPS[type(node.ops[0])](self.expr(node.left), self.expr(node.comparators[0]))
        if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In)
                and isinstance(node.comparators[0], ast.Name) and node.comparators[0].id == "L" and "L" in self.env):
            return self.expr(node.left) in self.env["L"]
        self.refuse(node, "a condition other than one comparison (>, <, ==) or `x in L`")

    def expr(self, node) -> int:
        if isinstance(node, ast.Constant):
            return self.digit(node, hi=10)          # operands 0..9 and the modulus 10
        if isinstance(node, ast.Name):
            if node.id in self.env and node.id != "L":
                return self.env[node.id]
            self.refuse(node, f"name {node.id!r} is not a variable set before it")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            x, y = self.expr(node.left), self.expr(node.right)
            if y == 0 and isinstance(node.op, (ast.FloorDiv, ast.Mod)):
                self.refuse(node, "division by zero")
            return _BINOPS[type(node.op)](x, y)
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "L"
                and "L" in self.env):
            k = self.expr(node.slice)
            if not 0 <= k < len(self.env["L"]):
                self.refuse(node, f"index {k} outside L")
            return self.env["L"][k]
        self.refuse(node, f"an expression the grammar does not have ({type(node).__name__})")

    def print_(self, call) -> None:
        """print(variables) or print(variables, sep='') (or sep=' ')."""
        seps = [k.value.value for k in call.keywords if k.arg == "sep" and isinstance(k.value, ast.Constant)
                and k.value.value in ("", " ")]
        if not (isinstance(call.func, ast.Name) and call.func.id == "print" and len(seps) == len(call.keywords) <= 1
                and all(isinstance(a, ast.Name) for a in call.args)):
            self.refuse(call, "a call other than print(variables) or print(variables, sep='')")
        self.out.append((seps[0] if seps else " ").join(str(self.expr(a)) for a in call.args) + "\n")


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


def _statement(rng: random.Random, names: str, v: str, has_list: bool) -> list:
    """One statement of the loop body for variable v: its lines, unindented."""
    if rng.random() < 0.3:
        x, y = rng.sample(names, 2) if rng.random() < 0.7 and len(names) > 1 else (rng.choice(names),
                                                                                    str(rng.randint(1, 8)))
        e1, e2 = _expr(rng, names, v, has_list), _expr(rng, names, v, has_list)
        while e2 == e1:
            e2 = _expr(rng, names, v, has_list)
        return [f"if {x}{rng.choice(CMPS)}{y}:{v}={e1}", f"else:{v}={e2}"]
    return [f"{v}={_expr(rng, names, v, has_list)}"]


def _arith(rng: random.Random, names: str, v: str, has_list: bool) -> list:
    """v=(x op y)%10 only: x is v or another variable, y a variable or a constant 1..9."""
    x = v if rng.random() < 0.6 else rng.choice(names)
    return [f"{v}=({x}{rng.choice(OPS)}{_operand(rng, names)})%10"]


def _counter(rng: random.Random, names: str, v: str, has_list: bool) -> list:
    return [f"{v}=({v}+{rng.randint(1, 9)})%10"]


def _acc(rng: random.Random, names: str, v: str, has_list: bool, ops: str = "+") -> list:
    """v=(v op w)%10 with w the next variable (the last one steps by the argument k): each printed value is a
    function of two values at fixed places, the program's variation is in its call and its loop length."""
    i = names.index(v)
    w = names[i + 1] if i + 1 < len(names) else "k"
    return [f"{v}=({v}{rng.choice(ops)}{w})%10"]


def _acc_pm(rng: random.Random, names: str, v: str, has_list: bool) -> list:
    return _acc(rng, names, v, has_list, "+-")


#: the loop body of the chain grammars, by variable ("K": 7 in "chain", the argument k in "chain-k")
CHAIN_BODY = {"a": ["a=(a+b)%10"], "b": ["if a>c:b=(b+c)%10", "else:b=(b+K)%10"], "c": ["c=(c+a)%10"]}


def _chain(rng: random.Random, names: str, v: str, has_list: bool, step: str = "7") -> list:
    """One fixed program of three variables (the branch of b makes the trace piecewise, no polynomial): every value
    is a function of at most three values at fixed places, the line before or earlier in its own line."""
    return [ln.replace("K", step) for ln in CHAIN_BODY[v]]


def _chain_k(rng: random.Random, names: str, v: str, has_list: bool) -> list:
    return _chain(rng, names, v, has_list, "k")


#: the loop body of "chain-u": every value a function of ONE value at a fixed place (a from the line before's b, b
#: from its c, c from the new a), each map a permutation of the digits (`*3+1`, `+7`; `*7` / `+3` by the branch)
CHAIN_U_BODY = {"a": ["a=(b*3+1)%10"], "b": ["b=(c+7)%10"], "c": ["if a>4:c=(a*7)%10", "else:c=(a+3)%10"]}


#: the loop body of "chain-b": each variable a map of its own value chosen by a branch on the variable before it
#: (a on the line before's c, b on the new a, c on the new b) -- every value one map of one value plus one bit, a
#: chain of three through each line; each map a permutation, so the step is one-to-one on the 1,000 states
CHAIN_B_BODY = {"a": ["if c>4:a=(a*3+1)%10", "else:a=(a+7)%10"], "b": ["if a>4:b=(b*7)%10", "else:b=(b+3)%10"],
                "c": ["if b>4:c=(c+1)%10", "else:c=(c*3)%10"]}


#: the loop body of "chain-b4": chain-b's ring of maps over four variables (a branches on d, b on the new a, c on the new
#: b, d on the new c). A value k links on depends on k + 1 of the digits before it, so past two links it is a function
#: of all four (10,000 states), where chain-b's is a function of three (1,000) from the second link on. d's maps make
#: the step a permutation of the 10,000 states whose shortest cycle is 218 (no answer repeats a state)
CHAIN_B4_BODY = {"a": ["if d>4:a=(a*3+1)%10", "else:a=(a+7)%10"], "b": ["if a>4:b=(b*7)%10", "else:b=(b+3)%10"],
                 "c": ["if b>4:c=(c+1)%10", "else:c=(c*3)%10"], "d": ["if c>4:d=(d+9)%10", "else:d=(d+8)%10"]}
#: the loop body of "chain-p": a ring of four variables like chain-b4, each map pair chosen so that the branch always
#: decides the new value's half (`x>4`): no link cuts the chain of branch bits (in chain-b 47% of the (value, map)
#: pairs give the same half either way, in chain-b4 55%), and the step's shortest cycle is 30 states
CHAIN_P_BODY = {"a": ["if d>4:a=(a*3+1)%10", "else:a=(a*3+6)%10"], "b": ["if a>4:b=(b*7)%10", "else:b=9-(b*7)%10"],
                "c": ["if b>4:c=(c+1)%10", "else:c=(c+6)%10"], "d": ["if c>4:d=(d*3+2)%10", "else:d=(d*3+7)%10"]}
#: the loop body of "chain-s": chain-b's maps, each branch a membership test of the value before it in the program's
#: list L of five distinct digits (`if c in L:`) -- L is drawn per program, so a value several links down the chain
#: is not a function of the state alone: each link reads L once more (one attention hop), a forward cannot fold
#: several links into one lookup
CHAIN_S_BODY = {"a": ["if c in L:a=(a*3+1)%10", "else:a=(a+7)%10"], "b": ["if a in L:b=(b*7)%10", "else:b=(b+3)%10"],
                "c": ["if b in L:c=(c+1)%10", "else:c=(c*3)%10"]}
SET_SIZE = 5                         # the digits of chain-s's list L


def _fixed(body: dict):
    """The statement generator of a one-program grammar: its loop body's lines for variable v, whatever the draw."""
    return lambda rng, names, v, has_list: list(body[v])


#: statement generators by grammar: "full" is the task; "arith" (only v=(x op y)%10), "counter" (each variable steps
#: by its own constant: every program of a size has the same layout) and "copy" (no loop: the answer is the initial
#: state) are the simpler grammars the learnability probe (benchmarks/exec_probe.py) and a curriculum start from
GRAMMARS = {"full": _statement, "arith": _arith, "counter": _counter, "copy": None, "acc": _acc, "acc-pm": _acc_pm,
            "chain": _chain, "chain-k": _chain_k, "chain-u": _fixed(CHAIN_U_BODY), "chain-b": _fixed(CHAIN_B_BODY),
            "chain-s": _fixed(CHAIN_S_BODY), "chain-b4": _fixed(CHAIN_B4_BODY),
            "chain-p": _fixed(CHAIN_P_BODY)}
#: grammars whose function takes the step k as its last argument (`def f(a,b,k):`, the call `f(7,4,3)`)
WITH_K = ("acc", "acc-pm", "chain-k")
#: grammars of one program: every prompt is the same loop body, only the call's digits and the loop length vary
#: (with how its values depend on each other, for a model card)
ONE_PROGRAM = {
    "chain": "Each value is a function of at most three values at fixed places, the line before or earlier in its "
             "own line (a sum, and b's branch on a comparison).",
    "chain-u": "Each value is one map (a permutation of the digits) of one value at a fixed place: a of the line "
               "before's b, b of its c, c of the new a.",
    "chain-b": "Each value is one map of its own previous value chosen by a one-bit branch on the value computed just "
               "before it, so a line's three values are a chain of three and an answer a chain of three values per "
               "iteration.",
    "chain-b4": "Each value is one map of its own previous value chosen by a one-bit branch on the value computed just "
                "before it, over four variables in a ring, so an answer is one chain of four values per iteration and "
                "a value k links on depends on k + 1 digits before it (all four from the third link on).",
    "chain-p": "Each value is one of two maps of its own previous value chosen by whether the value computed just "
               "before it is over 4, over four variables in a ring, the two maps of a pair always giving values of "
               "different halves (0..4, 5..9): every branch bit depends on every branch bit before it, so a value "
               "several links on is a function of all four digits before it, never of fewer."}
#: grammars of one loop body whose programs also differ in a list L of `SET_SIZE` digits (with how their values
#: depend on each other, for a model card)
WITH_SET = {
    "chain-s": "Each value is one map of its own previous value chosen by whether the value computed just before it "
               "is in the program's list L, so a line's three values are a chain of three, and each link reads L "
               "(drawn per program) once more: a value several links on is not a function of the state alone."}
#: grammars written for one number of variables (the task's default for them)
FIXED_VARS = {"chain": 3, "chain-k": 3, "chain-u": 3, "chain-b": 3, "chain-s": 3, "chain-b4": 4, "chain-p": 4}


def draw_program(rng: random.Random, n_vars: int, iters: int, has_list: bool, grammar: str = "full",
                 sep: str = " ") -> str:
    """`def f(a,b[,c]):` (print the state, loop `iters` times: update each variable, print the state), then the call
    `f(digits)` -- the initial state is written just before the answer (CRUXEval's layout). `sep=""` prints a state
    as its digits alone (`print(a,b,c,sep='')`: `671`)."""
    names = NAMES[:n_vars]
    params = names + ("k" if grammar in WITH_K else "")
    args = ",".join(str(rng.randint(0, 9) if p != "k" else rng.randint(1, 9)) for p in params)
    head = ("L=[" + ",".join(str(rng.randint(0, 9)) for _ in range(10)) + "]\n") if has_list and grammar == "full" else ""
    if grammar in WITH_SET:
        head = "L=[" + ",".join(str(d) for d in sorted(rng.sample(range(10), SET_SIZE))) + "]\n"
    pr = f"print({','.join(names)}" + (",sep=''" if sep == "" else "") + ")"
    lines = [f"def f({','.join(params)}):", f" {pr}"]
    if GRAMMARS[grammar] is not None:
        lines.append(f" for i in range({iters}):")
        for v in names:
            lines += ["  " + ln for ln in GRAMMARS[grammar](rng, names, v, has_list)]
        lines.append(f"  {pr}")
    return head + "\n".join(lines) + f"\nf({args})\n"


def _call_programs(prompt: str) -> list:
    """The one-call programs of `prompt`: its text before the first call, with each call `f(...)` alone."""
    lines = prompt.split("\n")
    first = next((k for k, ln in enumerate(lines) if ln.startswith("f(")), None)
    if first is None:
        return [prompt]
    stem = "\n".join(lines[:first]) + "\n"
    return [stem + ln + "\n" for ln in lines[first:] if ln.startswith("f(")]


def _good(answer: str) -> bool:
    lines = answer.split("\n")[:-1]
    return len(set(lines[:DISTINCT])) == min(DISTINCT, len(lines)) and len(answer) + 1 <= MAX_ANSWER


@dataclass(frozen=True)
class ExecSizes:
    vars_: tuple = (2, 3)            # numbers of variables drawn (uniformly)
    list_prob: float = 0.35          # probability that a program has the list L
    max_iters: Optional[int] = None  # cap the loop length (the curriculum's early stages; 0: no loop iteration)
    grammar: str = "full"            # a key of GRAMMARS
    sep: str = " "                   # between a state's printed values: " " (print's default) or "" (sep='')
    calls: int = 1                   # calls of f in a program, each from its own initial state (1..MAX_CALLS)

    @property
    def iters(self) -> dict:
        """Loop lengths by number of variables: `TIGHT_ITERS` with sep='', else `ITERS`; `CALL_ITERS` for a program
        of several calls."""
        if self.calls > 1:
            return {v: CALL_ITERS[self.sep][(v, self.calls)] for v in self.vars_}
        return TIGHT_ITERS if self.sep == "" else ITERS

    def __post_init__(self):
        if self.grammar not in GRAMMARS:
            raise ValueError(f"exec grammar {self.grammar!r}: expected one of {', '.join(GRAMMARS)}")
        if self.sep not in (" ", ""):
            raise ValueError(f"exec sep {self.sep!r}: expected ' ' or ''")
        if not (isinstance(self.calls, int) and 1 <= self.calls <= MAX_CALLS):
            raise ValueError(f"exec calls {self.calls!r}: expected 1..{MAX_CALLS}")
        if self.calls > 1 and self.grammar not in FIXED_VARS:
            raise ValueError(f"exec calls={self.calls}: several calls are for the one-program grammars "
                             f"({', '.join(FIXED_VARS)}), not {self.grammar!r}")
        if self.grammar in FIXED_VARS and tuple(self.vars_) != (FIXED_VARS[self.grammar],):
            raise ValueError(f"exec grammar {self.grammar!r} has {FIXED_VARS[self.grammar]} variables, "
                             f"not {', '.join(map(str, self.vars_))}")


class ExecTask:
    """Programs and their outputs (see the module docstring)."""

    style = "exec"
    max_new_tokens = MAX_ANSWER      # what `dblock eval --task exec` generates unless --max-new-tokens says otherwise

    def __init__(self, name: str = "exec", test_fraction: float = 0.05, sizes: ExecSizes = ExecSizes()):
        self.name, self.test_fraction, self.sizes_ = name, float(test_fraction), sizes
        self._seed_key = f"exec|{sizes.vars_}|{sizes.list_prob}|{sizes.max_iters}" + (
            f"|{sizes.grammar}" if sizes.grammar != "full" else "") + ("|sep=" if sizes.sep == "" else "") + (
            f"|calls={sizes.calls}" if sizes.calls > 1 else "")

    def describe(self) -> dict:
        """What the task is, for a model card. A one-program grammar (`ONE_PROGRAM`) adds its loop body and how many
        of the 1,000 initial states are held out (`held_out_starts`): its programs differ only in the call's digits
        and the loop length, and the split blanks the loop length."""
        g = self.sizes_.grammar
        out = {"name": self.name, "style": self.style, "variables": list(self.sizes_.vars_),
               "iterations": {str(k): list(v) for k, v in self.sizes_.iters.items()
                              if k in self.sizes_.vars_}, "sep": self.sizes_.sep,
               "list_probability": self.sizes_.list_prob, "grammar": g, "distinct_states": DISTINCT,
               "split": f"test iff SHA-256(program with range(N) blanked) falls in the lowest {self.test_fraction:g} "
                        "of the hash range (dblock/tasks/exec_task.py, ExecTask.split_of); evaluation uses the test "
                        "split"}
        if g in ONE_PROGRAM or g in WITH_SET:
            rng = random.Random(0)
            names = NAMES[:FIXED_VARS[g]]
            out["body"] = [ln for v in names for ln in GRAMMARS[g](rng, names, v, False)]
            out["structure"] = {**ONE_PROGRAM, **WITH_SET}[g]
        if g in WITH_SET:
            out["set_size"] = SET_SIZE
        if self.sizes_.calls > 1:
            out["calls"] = self.sizes_.calls
            out["split"] = out["split"].replace("test iff SHA-256(program", "test iff, for each call, SHA-256(the "
                                                "program with that call alone")
        if g in ONE_PROGRAM:
            n = FIXED_VARS[g]
            prog = draw_program(rng, n, 8, False, g, self.sizes_.sep)
            call = prog.rsplit("f(", 1)[0]
            out["held_out_starts"] = sum(self.split_of(f"{call}f({','.join(str(k // 10 ** j % 10) for j in range(n))})\n")
                                         == "test" for k in range(10 ** n))
            out["starts"] = 10 ** n
        return out

    def sizes(self) -> dict:
        """{kind: (min, max) iterations} (the curriculum reads the largest maximum)."""
        out = {}
        for n in self.sizes_.vars_:
            lo, hi = self.sizes_.iters[n]
            if self.sizes_.max_iters is not None:
                lo, hi = min(lo, self.sizes_.max_iters), min(hi, self.sizes_.max_iters)
            out[f"vars{n}"] = (lo, hi)
        return out

    def capped(self, max_digits: int) -> "ExecTask":
        """The same grammar with loops of at most `max_digits` iterations (a curriculum stage: below the shortest
        loop, exactly `max_digits`)."""
        return ExecTask(self.name, self.test_fraction, replace(self.sizes_, max_iters=int(max_digits)))

    def split_of(self, prompt: str) -> str:
        """By the hash of the program with its loop length blanked: programs that differ only in `range(N)` print
        prefixes of one trace, so they fall on the same side (no held-out answer is a prefix of a training one). A
        program of several calls is `test` iff each of its one-call programs is (`train` otherwise; training draws
        only programs whose every call is `train`)."""
        parts = _call_programs(prompt)
        if len(parts) > 1:
            return "test" if all(self.split_of(p) == "test" for p in parts) else "train"
        return "test" if _hash(_LOOP_LEN.sub("range(N)", prompt)) % 1_000_000 < self.test_fraction * 1_000_000 \
            else "train"

    def solve(self, prompt: str) -> Example:
        """The reference answer of a program of this grammar (what it prints)."""
        names = re.search(r"^ print\(([a-d,]+?)(?:,sep='')?\)$", prompt, re.M)
        iters = re.search(r"range\((\d+)\)", prompt)
        if names is None or (iters is None and self.sizes_.grammar != "copy"):
            raise ValueError(f"not an exec-task program: {prompt[:60]!r}")
        answer = run(prompt)
        n = len(names[1].split(","))
        return Example(prompt=prompt, answer=answer, final=answer, kind=f"vars{n}", digits=int(iters[1]) if iters else 0)

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
            if self.sizes_.calls > 1:
                drawn = self._draw_calls(rng, split, n_vars, iters)
                if drawn is not None:
                    prog, answer = drawn
                    return Example(prompt=prog, answer=answer, final=answer, kind=f"vars{n_vars}", digits=iters)
                attempt += 1
                continue
            for _ in range(64):
                prog = draw_program(rng, n_vars, iters, has_list, self.sizes_.grammar, self.sizes_.sep)
                if self.split_of(prog) != split:
                    continue
                answer = run(prog)
                if _good(answer):
                    return Example(prompt=prog, answer=answer, final=answer, kind=f"vars{n_vars}", digits=iters)
            attempt += 1

    def _draw_calls(self, rng: random.Random, split: str, n_vars: int, iters: int) -> Optional[tuple]:
        """(program, answer): `calls` calls of one drawn function, each from a distinct initial state whose one-call
        program is of `split` and whose trace is good; None when 64 draws a call found none."""
        one = draw_program(rng, n_vars, iters, False, self.sizes_.grammar, self.sizes_.sep)
        stem = _call_programs(one)[0].rsplit("f(", 1)[0]
        calls: list = []
        for _ in range(64 * self.sizes_.calls):
            call = "f(" + ",".join(str(rng.randint(0, 9)) for _ in range(n_vars)) + ")\n"
            if call in calls or self.split_of(stem + call) != split or not _good(run(stem + call)):
                continue
            calls.append(call)
            if len(calls) == self.sizes_.calls:
                prog = stem + "".join(calls)
                answer = run(prog)
                return (prog, answer) if len(answer) + 1 <= MAX_ANSWER else None
        return None

    def examples(self, split: str, n: int, start: int = 0) -> list:
        """`n` distinct problems of `split`: samples `start`, `start + 1`, ..., a program already drawn skipped (a
        one-program grammar has only about 1,000 x its loop lengths programs, 5% of them held out, so plain draws
        repeat). A ValueError when the split cannot give `n` distinct programs."""
        out, seen, i = [], set(), start
        while len(out) < n:
            if i - start >= 20 * n + 1000:
                raise ValueError(f"task {self.name}: its {split} split gave {len(out)} distinct programs in "
                                 f"{i - start} draws; {n} were asked for")
            e = self.sample(split, i)
            i += 1
            if e.prompt not in seen:
                seen.add(e.prompt)
                out.append(e)
        return out

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
    """The printed values, in order: every value is one digit, so each character of a printed word (`6 7 1` or
    `671`)."""
    return [c for w in text.split("<eos>", 1)[0].split() for c in w]
