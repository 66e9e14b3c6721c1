"""Synthetic graded tasks and the character tokenizer for the tiny bundled models.

`get_task(name)` names: `exec` (what a short generated Python program prints, `dblock/tasks/exec_task.py`), `code` (completing held-out Python source, `dblock/tasks/code.py`; `code:seed=N` orders
its problems with another seed), `arith` (add + rev, 1:1), `arith-add`, `arith-rev`, `arith-small` (add + rev, 1:1, with
1..4-digit operands and 1..6-digit strings: about 3 blocks per answer),
`arith-long` (the `groups` answer style of `dblock/tasks/arith.py`: add of 1..8-digit operands, div -- short
division of a 2..8-digit number by one digit --, rev of 1..6 digits, weights 3:2:1; what the bundled tiny models are
trained on), or a mix spelled
`arith:add=3,rev=1` / `arith-long:add=1,div=1,rev=0` (weights over that task's kinds, with its sizes and style).
Keyword arguments go to `ArithTask` (sizes, test_fraction) and override a variant's sizes.
"""

from __future__ import annotations

from .arith import MARKER, ArithTask, Example, answer_text, solve
from .tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, CharTokenizer

Task = ArithTask

# The task the bundled tiny models are trained on (their card.json records it; tests/tasks/test_model_cards.py checks
# the two agree). Defaults that need no model at hand (loadgen prompts, benchmarks) use it.
BUNDLED_TASK = "arith-long"

_FIXED = {"arith": None, "arith-add": {"add": 1.0}, "arith-rev": {"rev": 1.0}}
_VARIANTS = {"arith-small": dict(mix=None, add_digits=(1, 4), rev_len=(1, 6)),
             "arith-long": dict(mix={"add": 3.0, "div": 2.0, "rev": 1.0}, add_digits=(1, 8), div_digits=(2, 8),
                                rev_len=(1, 6), style="groups")}
_MIXABLE = ("arith", "arith-long")    # `NAME:kind=W,...` re-weights these


def base_task(name: str) -> str:
    """A task name without its kind weights: 'arith-long:add=3,div=4,rev=1' -> 'arith-long'. Weights change which
    problems training draws, not the problems or the split rule (`ArithTask.split_of`), so a model trained on a
    reweighted mix is evaluated on its base task's held-out split like one trained on the task itself."""
    return name.partition(":")[0]


def get_task(name: str, **kwargs):
    if base_task(name) == "exec":
        from dblock.tasks.exec_task import ExecTask
        from dblock.tasks.exec_task import FIXED_VARS, GRAMMARS, ExecSizes
        if kwargs:
            raise ValueError(f"task exec: size options {sorted(kwargs)} apply to the arith tasks only")
        if name == "exec":
            return ExecTask()
        bad = (f"bad task {name!r}: the exec task takes 'exec' or 'exec:OPTION=VALUE,...' with grammar=G (G one of "
               f"{', '.join(GRAMMARS)}), vars=N (N of 1, 2, 3: the number of variables), sep=none (a state "
               "printed as its digits alone, print(a,b,c,sep='')) and/or calls=K (K of 1, 2, 3: f called K times, "
               "one-program grammars), e.g. 'exec:grammar=arith,vars=1'")
        opts = {}
        for item in name.partition(":")[2].split(","):
            key, eq, val = item.partition("=")
            if not eq or key in opts or key not in ("grammar", "vars", "sep", "calls"):
                raise ValueError(bad)
            opts[key] = val
        if opts.get("grammar", "full") not in GRAMMARS or opts.get("vars", "2") not in ("1", "2", "3") or \
                opts.get("sep", "space") not in ("space", "none") or opts.get("calls", "1") not in ("1", "2", "3"):
            raise ValueError(bad)
        grammar, sep = opts.get("grammar", "full"), "" if opts.get("sep") == "none" else " "
        vars_ = ((int(opts["vars"]),) if "vars" in opts else (FIXED_VARS[grammar],) if grammar in FIXED_VARS
                 else ExecSizes.vars_)                      # the dataclass default: 2 or 3 variables
        return ExecTask(name=name, sizes=ExecSizes(vars_=vars_, grammar=grammar, sep=sep,
                                                   calls=int(opts.get("calls", "1"))))
    if base_task(name) == "code":
        from dblock.tasks.code import CodeTask
        if kwargs:
            raise ValueError(f"task code: size options {sorted(kwargs)} apply to the arith tasks only")
        seed = 0
        if name != "code":
            key, _, val = name.partition(":")[2].partition("=")
            if key != "seed" or not val.isdigit():
                raise ValueError(f"bad task {name!r}: the code task takes 'code' or 'code:seed=N'")
            seed = int(val)
        return CodeTask(seed=seed, name=name)
    if name in _FIXED:
        return ArithTask(mix=_FIXED[name], name=name, **kwargs)
    if name in _VARIANTS:
        return ArithTask(name=name, **{**_VARIANTS[name], **kwargs})
    base, sep, spec = name.partition(":")           # base == base_task(name)
    if sep and base in _MIXABLE:
        try:
            mix = {k.strip(): float(v) for k, v in (item.split("=") for item in spec.split(","))}
        except ValueError:
            raise ValueError(f"bad task mix {name!r}: expected e.g. 'arith:add=3,rev=1'") from None
        defaults = _VARIANTS.get(base, {})
        return ArithTask(name=name, **{**defaults, "mix": mix, **kwargs})
    raise ValueError(f"unknown task {name!r}; known: {['code', 'exec'] + sorted(_FIXED) + sorted(_VARIANTS)}, 'arith:add=W,rev=W' or "
                     "'arith-long:add=W,div=W,rev=W'")


__all__ = ["ArithTask", "BOS_ID", "BUNDLED_TASK", "CharTokenizer", "EOS_ID", "Example", "MARKER", "MASK_ID", "PAD_ID",
           "Task", "answer_text", "base_task", "get_task", "solve"]
