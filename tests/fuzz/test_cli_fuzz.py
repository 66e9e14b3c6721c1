"""Careless-user fuzzing of the command line: argument vectors for `generate`, `eval`, `info`, `make-tiny` and
`simulate oba`, built from the real option names with good and bad values (negative, zero, huge, NaN, inf, the
wrong type, empty, special-token text), each run in-process through `dblock.cli.main`.

Every case must end in exit 0, or exit 2 with one stderr line `dblock: error: ...` naming a flag, file or value
(never `internal error`, never a traceback), within its time bound, and a refused case must leave its working
folder (a fresh temporary one; `--out` and `--trace` point into it) and the bundled checkpoints untouched
(tests/fuzz/harness.py). Model runs stay tiny: the bundled models, `--max-new-tokens` at most 16, `--n` at most 2.

Hypothesis runs derandomized with fixed budgets (`EXAMPLES`) sized so the whole suite takes about a minute on two
busy cores; each test prints how many cases it tried and how many ran or were refused.
"""
from __future__ import annotations

import shutil
import tempfile
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.harness import check_contract, run_cli

NAN, INF = "nan", "inf"
HUGE = [str(10 ** 9), str(2 ** 63), str(2 ** 64), "1" * 40]
WRONG = ["abc", "", "1.5", "1e3x", "0x10"]
SPECIAL_TEXT = ["<eos>", "1+1=<eos>", "<mask>", "12<mask>3", "<pad><bos>", "<eos"]

#: examples per command (derandomized): the counts are printed by each test
EXAMPLES = {"generate": 200, "eval": 40, "info": 20, "make-tiny": 30, "simulate oba": 100}
#: seconds one case may take before it counts as a hang
TIME_BOUND = 30.0

SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


class Opt:
    """One option: `good` values (each valid on its own; combinations may still be refused, e.g. a masked-model
    rule on the uniform-state model) and `bad` ones. `None` as a value: a switch without a value."""

    def __init__(self, flag, good, bad=(), p=0.5):
        self.flag, self.good, self.bad, self.p = flag, list(good), list(bad), p


def vector(draw, command: list, opts: list, required: list = ()) -> list:
    """An argument vector: `required` options always present, the others each with probability `p`. The mode
    decides the values: all good, exactly one bad (the rest good), or any value anywhere."""
    mode = draw(st.sampled_from(["good", "good", "one bad", "one bad", "any"]))
    present = [o for o in opts if o in required or draw(st.floats(0, 1)) < o.p]
    bad_one = None
    if mode == "one bad":
        with_bad = [o for o in present if o.bad]
        bad_one = draw(st.sampled_from(with_bad)) if with_bad else None
    argv = list(command)
    for o in present:
        if mode == "any":
            pool = o.good + o.bad
        else:
            pool = o.bad if o is bad_one else o.good
        value = draw(st.sampled_from(pool))
        if value is None:
            argv.append(o.flag)
        elif value.startswith("-"):            # argparse would take "-inf" for an option: spell it --flag=value
            argv.append(f"{o.flag}={value}")
        else:
            argv += [o.flag, value]
    return argv


def decode_opts(max_tokens=("1", "4", "8", "16")):
    return [
        Opt("--max-new-tokens", max_tokens, ["0", "-1", "5000"] + HUGE + WRONG, p=0.9),
        Opt("--block-size", ["4", "8", "16"], ["0", "-3", "5000", "1000000"] + WRONG, p=0.3),
        Opt("--rule", ["threshold", "fixed-k"], ["entropy-bound", "bogus", ""], p=0.2),
        Opt("--threshold", ["0.5", "0.9", "1"], ["0", "1.5", "-0.1", NAN, INF, "-inf"] + WRONG, p=0.3),
        Opt("--max-steps", ["1", "3", "64"], ["0", "-1", "100000"] + WRONG, p=0.2),
        Opt("--steps", ["1", "4"], ["0", "-2", "100000"] + WRONG, p=0.3),
        Opt("--seed", ["0", "7", str(2 ** 63 - 1)], ["-1"] + HUGE + WRONG, p=0.3),
        Opt("--entropy-bound", ["0.1", "0", "2"], ["-1", NAN, INF] + WRONG, p=0.2),
        # one number: the masked models' sampling temperature; a pair: DiffusionGemma's t_max,t_min
        Opt("--temperature", ["0.8,0.4", "1,1", "0", "0.7"], ["0.4,0.8", "nan,nan", "inf,inf", "0,0", "nan", "-1",
                                                              "a,b", "1e-9,1e-9", "-1,-2", "1e9", ""], p=0.2),
        Opt("--stability", ["0", "1", "3"], ["-1", "1000000000"] + WRONG, p=0.2),
        Opt("--confidence", ["0.005", "0"], ["-1", NAN, INF] + WRONG, p=0.2),
        Opt("--schedule", ["native", "oba", "native2c", "dense_mask", "no_accept"], ["bogus", ""], p=0.3),
        Opt("--window", ["2", "3"], ["1", "9", "-1"] + WRONG, p=0.1),
        Opt("--gate", ["0.5", "0", "1"], ["2", NAN] + WRONG, p=0.1),
        Opt("--no-cache", [None], p=0.1),
        # the masked sampler, upstream parity options and stops (docs/algorithms.md §2.4-2.6)
        Opt("--sampling-temperature", ["0", "0.7"], ["-1", "1e-9", NAN, INF] + WRONG, p=0.1),
        Opt("--top-p", ["0.9", "1"], ["0", "1.5", NAN] + WRONG, p=0.1),
        Opt("--top-k", ["0", "5"], ["-1"] + HUGE + WRONG, p=0.1),
        Opt("--threshold-inclusive", [None], p=0.1),
        Opt("--threshold-steps", ["2", "8"], ["0", "-1", "100000"] + WRONG, p=0.1),
        Opt("--mask-policy", ["exclude", "official", "ineligible"], ["bogus", ""], p=0.1),
        Opt("--stop", ["=>", "4", "ids:5,6", "text:12"], ["", "hello", "ids:999", "ids:x", "\x00"], p=0.1),
        Opt("--stop-token-ids", ["1", "19,20"], ["-1", "1,x", "999", ""] + HUGE, p=0.1),
        Opt("--min-tokens", ["0", "2"], ["-1", "100000"] + WRONG, p=0.1),
        Opt("--ignore-eos", [None], p=0.1),
    ]


MODEL = Opt("--model", ["tiny-masked", "tiny-masked", "tiny-uniform"], ["nonexistent", "", ".", "cfg_only"])
PROMPT = Opt("--prompt", ["1+1=", "12+34=", "rev ab:", "1"], ["hello", "", "\x00", "é", "9" * 5000, "1" * 70000]
             + SPECIAL_TEXT)
PROMPT_IDS = Opt("--prompt-ids", ["5,6,7", "5", "3,3,3"], ["", "1,x", "-1", "999", "5," * 5000 + "5", str(2 ** 64)])


@st.composite
def generate_argv(draw):
    opts = [MODEL, PROMPT, PROMPT_IDS] + decode_opts() + [
        Opt("--batch-size", ["1", "2"], ["0", "-1"] + HUGE + WRONG, p=0.3),
        Opt("--n", ["1", "2"], ["0", "-1", "100000"] + WRONG, p=0.1),
        Opt("--device", ["cpu"], ["cuda", "cuda:7", "bogus", ""], p=0.1),
        Opt("--dtype", ["float64", "float32"], ["int8"], p=0.1),
        Opt("--executor", ["reference", "epoch"], ["bogus"], p=0.1),
        Opt("--trace", ["t.jsonl"], ["nodir/t.jsonl", ".", ""], p=0.1),
        Opt("--allow-special-tokens", [None], p=0.2),
        Opt("--json", [None], p=0.5)]
    # --model almost always; a prompt of some kind almost always
    required = [MODEL] if draw(st.integers(0, 19)) else []
    required += [draw(st.sampled_from([PROMPT, PROMPT_IDS]))] if draw(st.integers(0, 19)) else []
    argv = vector(draw, ["generate"], opts, required)
    if draw(st.integers(0, 9)) == 0:
        argv = ["--threads", draw(st.sampled_from(["1", "0", "100000", "x"]))] + argv
    return argv


@st.composite
def eval_argv(draw):
    opts = [MODEL,
            Opt("--n", ["1", "2"], ["0", "-1"] + HUGE + WRONG, p=1.0),
            Opt("--task", ["arith", "arith-small", "arith:add=1,rev=0"],
                ["bogus", "arith:add=nan", "arith:add=inf,rev=1", "arith:x=1", ""]),
            Opt("--split", ["test", "train"], ["bogus"], p=0.2),
            Opt("--seeds", ["0", "0,1"], ["x", str(2 ** 64), "", "1,-1"], p=0.2),
            Opt("--examples", ["0", "1"], ["-1"] + HUGE, p=0.2),
            Opt("--add-digits", ["1,2"], ["3,1", "0,5", "1,1000000", "x"], p=0.1),
            Opt("--json", [None], p=0.5)]
    opts += [o for o in decode_opts(max_tokens=("8", "16"))      # short runs; rule/cache combinations: generate
             if o.flag not in ("--steps", "--max-steps", "--rule", "--no-cache", "--temperature")]
    return vector(draw, ["eval"], opts, required=[MODEL, opts[1]])


@st.composite
def info_argv(draw):
    model = draw(st.sampled_from(["tiny-masked", "tiny-uniform", "nonexistent", "", ".", "/", "org/name",
                                  "cfg_only", "afile", "bad_json"]))
    return ["info", model] + (["--json"] if draw(st.booleans()) else [])


@st.composite
def make_tiny_argv(draw):
    family = Opt("--family", ["llada2_moe", "llada_moe", "diffusion_gemma"], ["bogus", ""], p=0.95)
    out = Opt("--out", ["new", "nodir/sub/new"], ["afile", "full", "", "."], p=0.95)
    opts = [family, out, Opt("--seed", ["0", "3"], ["-1"] + HUGE + WRONG, p=0.4)]
    return vector(draw, ["make-tiny"], opts)


@st.composite
def simulate_oba_argv(draw):
    opts = [Opt("--nbar", ["13.1", "4"], ["0", "-1", NAN, INF, "1e9"] + WRONG),
            Opt("--alpha", ["0.54", "-0.5", "0.99"], ["1", "5", NAN, INF] + WRONG),
            Opt("--r", ["1.26", "0.5"], ["0", "-1", NAN, INF] + WRONG),
            Opt("--k-max", ["1", "10"], ["0", "-1"] + HUGE + WRONG),
            Opt("--simulate", ["0", "1", "2"], ["-1"] + HUGE + WRONG, p=0.3),
            Opt("--tokens", ["gamma:64,0.3", "const:32"], ["bogus", "gamma:inf,0.3", "gamma:nan,0.3", "gamma:-5,0.3",
                                                           "const:1e12", ""]),
            Opt("--block", ["16", "64"], ["0", "-1"] + HUGE + WRONG),
            Opt("--seed", ["0", "5"], ["-1"] + HUGE + WRONG, p=0.3),
            Opt("--plot", ["p.png"], ["nodir/p.png", "."], p=0.1),
            Opt("--paper", [None], p=0.1),
            Opt("--json", [None])]
    argv = vector(draw, ["simulate", "oba"], opts)
    if "--simulate" in argv and "--tokens" not in argv:           # the default workload is 2048-token answers
        argv += ["--tokens", "gamma:64,0.3"]
    # --tokens, --block and --seed act only with --simulate R > 0, the closed forms only without --paper (any of
    # them elsewhere is refused by name): mostly keep them where they act, so that many vectors run
    sim = "--simulate" in argv and argv[argv.index("--simulate") + 1] not in ("0",)
    if (not sim or "--paper" in argv) and draw(st.integers(0, 4)):
        argv = _drop(argv, {"--tokens", "--block", "--seed"} | ({"--nbar", "--alpha", "--r", "--k-max", "--simulate"}
                                                                 if "--paper" in argv else set()))
    return argv


def _drop(argv: list, flags: set) -> list:
    """`argv` without the given options (and their values)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


def _workdir() -> str:
    """A fresh working folder with the files the argument vectors name: a plain file, a folder holding a file,
    a config-only model folder and one with a broken config.json."""
    import os

    from dblock.weights_path import CHECKPOINTS_DIR
    d = tempfile.mkdtemp(prefix="dblock-fuzz-")
    open(os.path.join(d, "afile"), "w").close()
    os.mkdir(os.path.join(d, "full"))
    open(os.path.join(d, "full", "x"), "w").close()
    os.mkdir(os.path.join(d, "cfg_only"))
    shutil.copy(os.path.join(CHECKPOINTS_DIR, "tiny-masked", "config.json"), os.path.join(d, "cfg_only"))
    os.mkdir(os.path.join(d, "bad_json"))
    with open(os.path.join(d, "bad_json", "config.json"), "w") as f:
        f.write('{"model_type": "llada2_moe", "vocab_size": ')
    return d


def _fuzz(name: str, strategy, counts: Counter, capsys):
    @settings(max_examples=EXAMPLES[name], **SETTINGS)
    @given(strategy)
    def case(argv):
        d = _workdir()
        try:
            o = run_cli(argv, d, TIME_BOUND)
            counts[check_contract(o)] += 1
        finally:
            shutil.rmtree(d, ignore_errors=True)

    case()
    with capsys.disabled():
        print(f"\nfuzz {name}: {sum(counts.values())} cases ({counts['ok']} ran, {counts['refused']} refused)")


@pytest.mark.parametrize("name, strategy", [
    ("generate", generate_argv()),
    ("eval", eval_argv()),
    ("info", info_argv()),
    ("make-tiny", make_tiny_argv()),
    ("simulate oba", simulate_oba_argv()),
], ids=lambda x: x if isinstance(x, str) else "")
def test_cli_fuzz(name, strategy, capsys):
    counts = Counter()
    _fuzz(name, strategy, counts, capsys)
    assert sum(counts.values()) >= min(EXAMPLES[name], 5)
