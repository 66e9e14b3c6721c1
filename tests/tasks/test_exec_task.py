"""The `exec` task: deterministic programs whose answers are what Python prints, a stable split, the grader, the
tokenizer, and `train-tiny --task exec` learning."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dblock.tasks import get_task
from dblock.tasks.exec_task import CHAIN_B_BODY, CHAIN_BODY, CHAIN_U_BODY, DISTINCT, ITERS, MAX_ANSWER, ExecTask, exec_tokenizer, run


def _python_prints(examples) -> list:
    """What a separate CPython process (the real interpreter, all builtins) prints for each example's program."""
    progs = "\n".join(f"exec({e.prompt!r})\nprint('---')" for e in examples)
    out = subprocess.run([sys.executable, "-c", progs], capture_output=True, text=True, check=True, timeout=60).stdout
    return out.split("---\n")[:-1]


def test_answers_are_what_a_real_python_process_prints():
    task = ExecTask()
    examples = task.examples("test", 12) + task.examples("train", 12, start=1000)
    printed = _python_prints(examples)
    assert printed == [e.answer for e in examples]


@settings(max_examples=40, deadline=None)
@given(index=st.integers(0, 10 ** 9), split=st.sampled_from(["train", "test"]))
def test_generator_is_deterministic_and_within_its_grammar(index, split):
    task = ExecTask()
    e = task.sample(split, index)
    assert e == ExecTask().sample(split, index)                       # a pure function of (split, index)
    assert task.split_of(e.prompt) == split
    assert task.solve(e.prompt) == e                                  # run in-process = the example's answer
    lines = e.answer.split("\n")[:-1]
    n_vars = int(e.kind[-1])
    lo, hi = ITERS[n_vars]
    assert lo <= e.digits <= hi and len(lines) == e.digits + 1
    assert all(len(ln.split()) == n_vars and all(v in "0123456789" for v in ln.split()) for ln in lines)
    assert len(set(lines[:DISTINCT])) == DISTINCT                     # no short cycle copied instead of computed
    assert len(e.answer) + 1 <= MAX_ANSWER                            # answer + <eos> in three blocks of 32
    exec_tokenizer().encode(e.prompt + e.answer)                      # every character is in the vocabulary


def test_python_agrees_over_many_seeds():
    """A property over seeds, in one interpreter call: 200 programs of both splits."""
    task = ExecTask()
    examples = [task.sample(s, i) for i in range(100) for s in ("train", "test")]
    assert _python_prints(examples) == [e.answer for e in examples]


def test_split_is_stable_disjoint_and_pinned():
    task = ExecTask()
    test = task.examples("test", 200)
    train = task.examples("train", 2000)
    assert not {e.prompt for e in test} & {e.prompt for e in train}
    # nor the same program with another loop length (its answer would be a prefix of the other's)
    blank = lambda e: re.sub(r"range\(\d+\)", "range(N)", e.prompt)       # noqa: E731
    assert not {blank(e) for e in test} & {blank(e) for e in train}
    assert all(task.split_of(e.prompt) == "test" for e in test)
    # the split depends on the program text alone: a fresh task object (other sizes) agrees on every prompt
    other = ExecTask().capped(9)
    assert all(other.split_of(e.prompt) == "test" for e in test)
    # the first held-out problems are pinned: a change of the generator changes the benchmark, on purpose only
    import hashlib
    digest = hashlib.sha256("".join(e.prompt + e.answer for e in test[:50]).encode()).hexdigest()[:16]
    assert digest == PINNED_TEST_DIGEST, digest
    # both kinds and every construct of the grammar occur
    kinds = {e.kind for e in test}
    assert kinds == {"vars2", "vars3"}
    text = "".join(e.prompt for e in test)
    for construct in ("if ", "else:", "L[", "//", "%", "*", "-", "+"):
        assert construct in text, construct


PINNED_TEST_DIGEST = "e8f727bc2609b7f4"  # the first 50 held-out problems of the generator of record


def test_grading_whole_answer_and_values():
    task = get_task("exec")
    e = task.examples("test", 1)[0]
    assert task.grade(e.prompt, e.answer) and task.grade(e.prompt, e.answer + "<eos>junk")
    assert task.grade(e.prompt, e.answer.rstrip("\n"))               # trailing whitespace ignored
    wrong = ("9" if e.answer[0] != "9" else "8") + e.answer[1:]
    assert not task.grade(e.prompt, wrong)
    s = task.score(e, wrong)
    n = len(e.answer.split())
    assert not s["answer_exact"] and s["value_accuracy"] == pytest.approx((n - 1) / n)
    assert task.score(e, "")["value_accuracy"] == 0.0
    assert task.score(e, e.answer) == {"answer_exact": True, "value_accuracy": 1.0}


def test_curriculum_caps_the_loop():
    t = ExecTask().capped(3)
    assert t.sizes() == {"vars2": (3, 3), "vars3": (3, 3)}
    assert all(e.digits == 3 for e in t.examples("train", 20))
    assert ExecTask().capped(12).sizes() == {"vars2": (8, 12), "vars3": (8, 12)}


def test_task_names():
    assert isinstance(get_task("exec"), ExecTask)
    arith = get_task("exec:grammar=arith")
    assert arith.sizes_.grammar == "arith" and arith.name == "exec:grammar=arith"
    assert all(re.fullmatch(r"[abc]=\([abc][-+*]([abc]|[1-9])\)%10", ln.strip())
               for e in arith.examples("train", 10) for ln in e.prompt.split("\n")[3:-3])
    assert "L=[" not in "".join(e.prompt for e in arith.examples("train", 30))    # the list belongs to "full"
    one = get_task("exec:grammar=arith,vars=1")
    assert one.sizes() == {"vars1": (14, 30)} and one._seed_key != arith._seed_key
    examples = one.examples("test", 8) + get_task("exec:vars=1").examples("train", 8)
    assert _python_prints(examples) == [e.answer for e in examples]
    assert all("def f(a):\n" in e.prompt and e.kind == "vars1" for e in examples)
    for bad in ("exec:foo=1", "exec:grammar=loops", "exec:grammar", "exec:vars=4", "exec:vars=1,vars=2",
                "exec:grammar=arith;vars=1"):
        with pytest.raises(ValueError, match="exec"):
            get_task(bad)


def test_an_exec_run_starts_from_a_bpe_code_model(tmp_path):
    """`train-tiny --task exec --init-from code-masked`: the character model takes every weight of the BPE model,
    its embedding and LM-head rows re-indexed so that each character keeps its learned row."""
    import dblock
    from dblock.tasks.code_corpus import CodeTokenizer
    from dblock.tasks.train_config import TrainConfig
    from dblock.tasks.train_model import build_model, init_from_model
    tok = exec_tokenizer()
    model = build_model(TrainConfig(size="code", task="exec", block_size=32, out=str(tmp_path)), tok)
    init_from_model(model, "code-masked", tok)
    src = dblock.load("code-masked")
    bpe = CodeTokenizer.load(src.source)
    for ch in ("7", " ", "\n", "(", "a", "%"):
        assert torch.equal(model.embed.weight[tok.encode(ch)[0]], src.embed.weight[bpe.encode(ch)[0]].float()), ch
    assert torch.equal(model.embed.weight[tok.mask_id], src.embed.weight[src.config.mask_token_id].float())
    name = "layers.1.mlp.w_gate"                                  # the routed experts of the first MoE layer
    assert torch.equal(model.state_dict()[name], src.state_dict()[name].float())
    from dblock.errors import ConfigError
    with pytest.raises(ConfigError, match="num_hidden_layers is 5 there, 4"):   # another shape: refused by name
        init_from_model(build_model(TrainConfig(size="base", task="exec", block_size=32, out=str(tmp_path)), tok),
                        "code-masked", tok)


def test_an_exec_run_starts_from_the_bpe_uniform_model(tmp_path):
    """The same for diffusion_gemma (`--init-from code-uniform`): its one tied embedding is re-indexed too."""
    import dblock
    from dblock.tasks.code_corpus import CodeTokenizer
    from dblock.tasks.train_config import TrainConfig
    from dblock.tasks.train_model import build_model, init_from_model
    tok = exec_tokenizer()
    model = build_model(TrainConfig(family="diffusion_gemma", size="code", task="exec", block_size=32,
                                    out=str(tmp_path)), tok)
    init_from_model(model, "code-uniform", tok)
    src = dblock.load("code-uniform")
    bpe = CodeTokenizer.load(src.source)
    emb, src_emb = model.state_dict()["embed_tokens.weight"], src.state_dict()["embed_tokens.weight"]
    assert emb.shape[0] == tok.vocab_size
    for ch in ("7", " ", "\n", "(", "a", "%"):
        assert torch.equal(emb[tok.encode(ch)[0]], src_emb[bpe.encode(ch)[0]].float()), ch


@pytest.mark.parametrize("family,source", [("llada2_moe", "code-masked"), ("diffusion_gemma", "code-uniform")])
def test_a_shallower_run_starts_from_a_deeper_models_first_layers(tmp_path, family, source):
    """`--size code-3 --init-from M --init-first-layers`: the three-layer model takes M's first three layers, its
    final norm and head (embedding re-indexed as above); without the flag the layer count is refused by name, and a
    source with fewer layers than the run is refused."""
    import dblock
    from dblock.errors import ConfigError
    from dblock.tasks.train_config import TrainConfig, reproduce_command
    from dblock.tasks.train_model import build_model, init_from_model
    tok = exec_tokenizer()
    cfg = TrainConfig(family=family, size="code-3", task="exec", block_size=32, out=str(tmp_path),
                      init_from=source, init_first_layers=True)
    model = build_model(cfg, tok)
    assert model.config.num_hidden_layers == 3
    with pytest.raises(ConfigError, match="num_hidden_layers is 5 there, 3"):
        init_from_model(model, source, tok)
    init_from_model(model, source, tok, first_layers=True)
    src = dblock.load(source).state_dict()
    got = model.state_dict()
    assert {k.split(".")[1] for k in got if k.startswith("layers.")} == {"0", "1", "2"}
    same = [k for k in got if k.startswith(("layers.", "norm."))]
    assert len(same) > 20 and all(torch.equal(got[k], src[k].float()) for k in same)
    assert "--init-from " + source + " --init-first-layers" in reproduce_command(cfg, 10)
    deep = build_model(TrainConfig(family=family, size="code", task="exec", block_size=32, out=str(tmp_path)), tok)
    shallow = tmp_path / "shallow"
    from dblock.tasks.train_export import export
    export(model, str(shallow), tok)
    with pytest.raises(ConfigError, match="--init-first-layers: .* has 3 layers, this run 5"):
        init_from_model(deep, str(shallow), tok, first_layers=True)


def test_tokenizer_round_trips_and_loads_in_transformers(tmp_path):
    tok = exec_tokenizer()
    e = ExecTask().examples("test", 1)[0]
    ids = tok.encode(e.prompt + e.answer)
    assert tok.decode(ids) == e.prompt + e.answer and tok.vocab_size % 8 == 0
    tok.save(tmp_path)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode(e.prompt, add_special_tokens=False) == tok.encode(e.prompt)


def test_train_tiny_exec_reduces_the_loss(tmp_path):
    import dblock
    from dblock.tasks.train import train
    from dblock.tasks.train_config import TrainConfig
    cfg = TrainConfig(family="llada2_moe", out=str(tmp_path / "m"), size="code-micro", task="exec", block_size=32,
                      steps=30, batch_size=8, lr=5e-3, warmup=5, log_every=10, progress=False, save_every=1000,
                      fused_attention=True)
    summary = train(cfg, log=lambda *a: None)
    hist = json.load(open(tmp_path / "m" / "train_summary.json"))["history"]
    assert hist[-1]["ce"] < hist[0]["ce"] - 0.5, hist                 # ln(64) = 4.2 at the start
    assert "--task exec" in summary["reproduce"]
    m = dblock.load(str(tmp_path / "m"))
    assert m.config.vocab_size == exec_tokenizer().vocab_size
    from dblock.tasks.tokenizer import CharTokenizer
    assert CharTokenizer.load(str(tmp_path / "m")).vocab == exec_tokenizer().vocab


@pytest.mark.parametrize("program, what", [
    ("import os\nprint(a)\n", "Import"),
    ("def f(a):\n __import__('os').system('touch x')\nf(1)\n", "a call other than print"),
    ("def f(a):\n print(a.__class__)\nf(1)\n", "a call other than print"),
    ("def f(a):\n while a<2:\n  a=(a+1)%10\nf(1)\n", "While"),
    ("def f(a):\n for i in range(10**9):\n  a=(a+1)%10\nf(1)\n", "integer literal 0..64"),
    ("def f(a):\n for i in range(99):\n  a=(a+1)%10\nf(1)\n", "integer literal 0..64"),
    ("def f(a):\n for i in range(2):\n  a=a//0\nf(1)\n", "division by zero"),
    ("x=1\n", "assignment to 'x'"),
    ("a=1\n", "assignment to 'a' here"),
    ("def f(a):\n print(b)\nf(1)\n", "'b' is not a variable"),
    ("def f(a):\n print(a)\nf(1)\nf(2)\nf(3)\nf(4)\n", "a call other than f(digits) after its def (at most 3 calls)"),
    ("def f(a):\n print(a)\n", "never calls f"),
    ("def g(a):\n print(a)\ng(1)\n", "FunctionDef"),
    ("a=(1\n", "line 1"),
    ("L=[1,2]\ndef f(a):\n for i in range(1):\n  a=L[a+5]\nf(1)\n", "outside L"),
    ("a=1\n" * 1500, "at most"),
])
def test_the_interpreter_runs_nothing_outside_its_grammar(program, what, tmp_path, monkeypatch):
    """`run` interprets; it never execs: a hostile prompt given to solve/grade is one ValueError naming what is
    wrong, and nothing it asks for happens."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(what)):
        run(program)
    with pytest.raises(ValueError):
        get_task("exec").grade(program, "1")
    assert not os.listdir(tmp_path)


def test_the_simpler_grammars_are_what_python_prints_and_a_bad_one_is_refused():
    from dblock.tasks.exec_task import ExecSizes
    copy = ExecTask(sizes=ExecSizes(grammar="copy"))
    counter = ExecTask(sizes=ExecSizes(grammar="counter", list_prob=0.0)).capped(3)
    for task in (copy, counter):
        examples = task.examples("train", 6)
        assert _python_prints(examples) == [e.answer for e in examples]
    assert all("for" not in e.prompt and e.answer.count("\n") == 1 for e in copy.examples("test", 5))
    lens = {len(e.prompt) for e in counter.examples("train", 20) if e.kind == "vars3"}
    assert len(lens) == 1                                # one layout per size: every lookup at a fixed offset
    assert copy._seed_key != ExecTask()._seed_key and copy.describe()["grammar"] == "copy"
    with pytest.raises(ValueError, match="exec grammar 'loops'"):
        ExecSizes(grammar="loops")


@pytest.mark.parametrize("grammar", ["acc", "acc-pm"])
def test_the_acc_grammars_take_the_step_as_an_argument_and_are_what_python_prints(grammar):
    """`def f(a,b,k):` -- each variable steps by the next one, the last by the argument k: what a real Python
    prints; the step k is 1..9; the split and the determinism hold as for the full grammar."""
    task = get_task(f"exec:grammar={grammar},vars=2")
    examples = task.examples("train", 8) + task.examples("test", 8)
    assert _python_prints(examples) == [e.answer for e in examples]
    for e in examples:
        assert e.prompt.startswith("def f(a,b,k):\n") and task.solve(e.prompt) == e
        k = int(re.search(r"^f\(\d,\d,(\d)\)$", e.prompt, re.M)[1])
        assert 1 <= k <= 9 and ("b=(b+k)%10" in e.prompt or "b=(b-k)%10" in e.prompt)
        assert task.split_of(e.prompt) == ("train" if e in examples[:8] else "test")
    # the few traces of this grammar (initial state x step) are held out whole: no held-out program is a training
    # one with another loop length (its answer a prefix of the other's)
    blank = lambda p: re.sub(r"range\(\d+\)", "range(N)", p)                 # noqa: E731
    assert not {blank(e.prompt) for e in task.examples("test", 60)} & \
        {blank(e.prompt) for e in task.examples("train", 600)}
    signs = {re.search(r"a=\(a(.)b\)", e.prompt)[1] for e in task.examples("train", 40)}
    assert signs == ({"+"} if grammar == "acc" else {"+", "-"})
    assert task.sample("train", 3) == get_task(f"exec:grammar={grammar},vars=2").sample("train", 3)


@pytest.mark.parametrize("grammar", ["chain", "chain-k", "chain-u", "chain-b"])
def test_the_chain_grammars_are_one_program_of_three_variables_and_what_python_prints(grammar):
    """One fixed loop body with a branch (the trace is piecewise): what a real Python prints; three variables
    whatever the task name says; chain-k takes the else-branch's step as its argument k (1..9), chain writes 7;
    chain-u's every value is a map of one value (a of the line before's b, b of its c, c of the new a); chain-b's a
    map of its own value chosen by a branch on the variable before it."""
    task = get_task(f"exec:grammar={grammar}")
    assert task.sizes_.vars_ == (3,)
    examples = task.examples("train", 8) + task.examples("test", 8)
    assert _python_prints(examples) == [e.answer for e in examples]
    body = "\n".join("  " + ln for v in "abc" for ln in (CHAIN_U_BODY if grammar == "chain-u" else CHAIN_BODY)[v])
    for e in examples:
        assert task.solve(e.prompt) == e and e.kind == "vars3"
        if grammar == "chain-u":
            assert e.prompt.startswith("def f(a,b,c):\n") and body in e.prompt
            for before, after in zip(e.answer.split("\n")[:-2], e.answer.split("\n")[1:-1]):
                (_, b, c), (a2, b2, c2) = map(int, before.split()), map(int, after.split())
                assert (a2, b2, c2) == ((3 * b + 1) % 10, (c + 7) % 10, (7 * a2 if a2 > 4 else a2 + 3) % 10)
        elif grammar == "chain-b":
            assert e.prompt.startswith("def f(a,b,c):\n")
            assert "\n".join("  " + ln for v in "abc" for ln in CHAIN_B_BODY[v]) in e.prompt
            for before, after in zip(e.answer.split("\n")[:-2], e.answer.split("\n")[1:-1]):
                (a, b, c), (a2, b2, c2) = map(int, before.split()), map(int, after.split())
                assert a2 == ((3 * a + 1) % 10 if c > 4 else (a + 7) % 10)
                assert b2 == (7 * b % 10 if a2 > 4 else (b + 3) % 10) and c2 == ((c + 1) % 10 if b2 > 4 else 3 * c % 10)
        elif grammar == "chain":
            assert e.prompt.startswith("def f(a,b,c):\n") and body.replace("K", "7") in e.prompt
        else:
            assert e.prompt.startswith("def f(a,b,c,k):\n") and body.replace("K", "k") in e.prompt
            assert 1 <= int(re.search(r"^f\(\d,\d,\d,(\d)\)$", e.prompt, re.M)[1]) <= 9
        lines = e.answer.split("\n")[:-1]
        assert len(set(lines[:DISTINCT])) == DISTINCT and 54 <= len(e.answer) <= MAX_ANSWER - 1
    with pytest.raises(ValueError, match=f"exec grammar '{grammar}' has 3 variables, not 2"):
        get_task(f"exec:grammar={grammar},vars=2")


@pytest.mark.parametrize("program, what", [
    ("def f(k,a):\n print(a)\nf(1,2)\n", "FunctionDef"),            # k only as the last parameter
    ("def f(k):\n print(k)\nf(1)\n", "FunctionDef"),                 # and never alone
    ("def f(a,k):\n for i in range(2):\n  k=(k+1)%10\nf(1,2)\n", "assignment to 'k'"),
])
def test_the_step_argument_is_read_only_and_last(program, what):
    with pytest.raises(ValueError, match=re.escape(what)):
        run(program)


def test_the_held_out_problems_are_distinct_and_a_small_split_says_how_small():
    """A one-program grammar has 1,000 initial states x its loop lengths; 5% of the states are held out, so plain
    draws repeat: `examples` skips a program already drawn, and refuses by count when the split runs out."""
    t = get_task("exec:grammar=chain-b")
    ex = t.examples("test", 200)
    assert len({e.prompt for e in ex}) == 200 and all(t.split_of(e.prompt) == "test" for e in ex)
    assert [e.prompt for e in ex[:20]] == [e.prompt for e in t.examples("test", 20)]     # a prefix: stable
    with pytest.raises(ValueError, match=r"gave \d+ distinct programs in \d+ draws; 2000 were asked for"):
        t.examples("test", 2000)


@pytest.mark.parametrize("grammar", ["chain", "chain-u", "chain-b"])
def test_a_one_program_grammar_describes_its_body_and_held_out_starts(grammar):
    """The card of a one-program grammar names its loop body (each line in every program) and how many of the
    1,000 initial states the split holds out: every held-out problem starts from one of them."""
    from dblock.tasks.card import _exec_data_text
    t = get_task(f"exec:grammar={grammar}")
    d = t.describe()
    ex = t.examples("test", 120)
    assert all("  " + ln + "\n" in e.prompt for e in ex for ln in d["body"])
    starts = {e.prompt.rsplit("f(", 1)[1] for e in ex}
    assert len(starts) <= d["held_out_starts"] <= 100
    text = _exec_data_text({"task_description": d, "vocab_size": 64, "family": "llada2_moe"})
    assert all(f"`{ln}`" in text for ln in d["body"]) and f"{d['held_out_starts']} of the 1,000 initial states" in text
    assert "body" not in get_task("exec").describe()                  # the full grammar: many programs


@pytest.mark.parametrize("sep", ["", ",sep=none"])
def test_chain_s_branches_on_the_programs_list_and_is_what_python_prints(sep):
    """`exec:grammar=chain-s`: chain-b's maps, each branch `x in L` for a list L of five distinct digits drawn per
    program (so a value several links on is not a function of the state); what a real Python prints; the card names
    the body and the list; `in` over anything but L is refused."""
    from dblock.tasks.card import _exec_data_text
    from dblock.tasks.exec_task import CHAIN_S_BODY, SET_SIZE
    task = get_task("exec:grammar=chain-s" + sep)
    assert task.sizes_.vars_ == (3,)
    examples = task.examples("train", 8) + task.examples("test", 8)
    assert _python_prints(examples) == [e.answer for e in examples]
    body = "\n".join("  " + ln for v in "abc" for ln in CHAIN_S_BODY[v])
    sets = set()
    for e in examples:
        head = re.match(r"L=\[([\d,]+)\]\ndef f\(a,b,c\):\n", e.prompt)
        L = [int(d) for d in head[1].split(",")]
        assert len(L) == SET_SIZE and L == sorted(set(L)) and body in e.prompt and task.solve(e.prompt) == e
        sets.add(tuple(L))
        lines = e.answer.split("\n")[:-1]
        assert len(set(lines[:DISTINCT])) == DISTINCT and len(e.answer) + 1 <= MAX_ANSWER
        for before, after in zip(lines, lines[1:]):
            (a, b, c), (a2, b2, c2) = (map(int, ln.split() if " " in ln else ln) for ln in (before, after))
            assert a2 == ((3 * a + 1) % 10 if c in L else (a + 7) % 10)
            assert b2 == (7 * b % 10 if a2 in L else (b + 3) % 10) and c2 == ((c + 1) % 10 if b2 in L else 3 * c % 10)
    assert len(sets) > 8                                              # the list varies from program to program
    d = task.describe()
    text = _exec_data_text({"task_description": d, "vocab_size": 64, "family": "llada2_moe"})
    assert all(f"`{ln}`" in text for ln in d["body"]) and "a list `L` of 5 distinct digits" in text
    assert "held_out_starts" not in d
    for bad in ("if a in M:b=1\n  else:b=2", "if a in (1,2):b=1\n  else:b=2"):
        with pytest.raises(ValueError, match="x in L"):
            run(f"L=[1,2]\ndef f(a,b):\n for i in range(2):\n  {bad}\nf(1,2)\n")


def test_sep_none_prints_a_state_as_its_digits_and_is_what_python_prints():
    """`exec:grammar=chain-b,sep=none`: `print(a,b,c,sep='')` (lines `671`), longer loops so the answers keep their
    2..3 blocks; what a real Python prints; the values are the digits; another separator or keyword is refused."""
    from dblock.tasks.exec_task import TIGHT_ITERS
    task = get_task("exec:grammar=chain-b,sep=none")
    examples = task.examples("train", 8) + task.examples("test", 8)
    assert _python_prints(examples) == [e.answer for e in examples]
    lo, hi = TIGHT_ITERS[3]
    for e in examples:
        assert e.prompt.count("print(a,b,c,sep='')") == 2 and task.solve(e.prompt) == e
        lines = e.answer.split("\n")[:-1]
        assert lo <= e.digits <= hi and len(lines) == e.digits + 1 and len(e.answer) + 1 <= MAX_ANSWER
        assert all(len(ln) == 3 and ln.isdigit() for ln in lines)
        for before, after in zip(lines, lines[1:]):
            (a, b, c), (a2, b2, c2) = map(int, before), map(int, after)
            assert a2 == ((3 * a + 1) % 10 if c > 4 else (a + 7) % 10)
            assert b2 == (7 * b % 10 if a2 > 4 else (b + 3) % 10) and c2 == ((c + 1) % 10 if b2 > 4 else 3 * c % 10)
    e = examples[0]
    wrong = e.answer[:-2] + ("0" if e.answer[-2] != "0" else "1") + "\n"
    assert task.score(e, e.answer) == {"answer_exact": True, "value_accuracy": 1.0}
    got = task.score(e, wrong)
    assert not got["answer_exact"] and got["value_accuracy"] == pytest.approx(1 - 1 / (3 * (e.digits + 1)))
    assert get_task("exec:grammar=chain-b").examples("test", 1)[0].prompt.count("sep=") == 0   # the default layout
    for bad in ("print(a,b,sep='-')", "print(a,b,end='')"):
        with pytest.raises(ValueError, match="print\\(variables, sep=''\\)"):
            run(f"def f(a,b):\n {bad}\nf(1,2)\n")
    with pytest.raises(ValueError, match="sep=none"):
        get_task("exec:grammar=chain-b,sep=tab")


@pytest.mark.parametrize("calls,sep", [(2, ",sep=none"), (3, ",sep=none"), (2, "")])
def test_several_calls_are_independent_traces_what_python_prints_held_out_call_by_call(calls, sep):
    """`calls=K`: one function called K times from distinct initial states; what a real Python prints; each trace is
    the one-call program's own (a later trace does not depend on the answer before it); a held-out program's every
    call is held out alone, a training program's none; the card says so."""
    from dblock.tasks.card import _exec_data_text
    from dblock.tasks.exec_task import CALL_ITERS, _call_programs
    task = get_task(f"exec:grammar=chain-b{sep},calls={calls}")
    assert task.sizes_.calls == calls
    lo, hi = CALL_ITERS["" if sep else " "][(3, calls)]
    train, test = task.examples("train", 12), task.examples("test", 12)
    assert _python_prints(train + test) == [e.answer for e in train + test]
    for e, split in [(e, "train") for e in train] + [(e, "test") for e in test]:
        parts = _call_programs(e.prompt)
        assert len(parts) == calls and len({p.rsplit("f(", 1)[1] for p in parts}) == calls
        assert "".join(run(p) for p in parts) == e.answer                       # K independent traces, in order
        assert all(task.split_of(p) == split for p in parts) and task.split_of(e.prompt) == split
        assert lo <= e.digits <= hi and len(e.answer) + 1 <= MAX_ANSWER and task.solve(e.prompt) == e
        assert len(e.answer.split("\n")[:-1]) == calls * (e.digits + 1)
    # a program mixing a held-out call with a training one is never held out
    held = _call_programs(test[0].prompt)[0]
    stem = held.rsplit("f(", 1)[0]
    other = next(c for c in (f"f({a},{b},{c})\n" for a in range(10) for b in range(10) for c in range(10))
                 if task.split_of(stem + c) == "train")
    assert task.split_of(held) == "test" and task.split_of(held + other) == "train"
    d = task.describe()
    assert d["calls"] == calls and "that call alone" in d["split"]
    text = _exec_data_text({"task_description": d, "vocab_size": 64, "family": "diffusion_gemma"})
    assert f"called {calls} times" in text and "every call starts from one" in text
    # one call is the task as before: same programs, same split
    one = get_task(f"exec:grammar=chain-b{sep}")
    assert one.sizes_.calls == 1 and "calls" not in one.describe() and len(_call_programs(one.sample("train", 0).prompt)) == 1


def test_several_calls_are_refused_outside_their_range_and_grammars():
    with pytest.raises(ValueError, match="calls=K"):
        get_task("exec:grammar=chain-b,calls=4")
    with pytest.raises(ValueError, match="one-program grammars"):
        get_task("exec:grammar=arith,calls=2")
    from dblock.tasks.exec_task import ExecSizes
    with pytest.raises(ValueError, match="exec calls 0"):
        ExecSizes(vars_=(3,), grammar="chain-b", calls=0)
    prog = "def f(a):\n print(a)\n" + "f(1)\n" * 4
    assert run("def f(a):\n print(a)\n" + "f(1)\n" * 3) == "1\n1\n1\n"
    with pytest.raises(ValueError, match="at most 3 calls"):
        run(prog)


def _b4_maps():
    return {"a": (lambda x: (3 * x + 1) % 10, lambda x: (x + 7) % 10), "b": (lambda x: 7 * x % 10, lambda x: (x + 3) % 10),
            "c": (lambda x: (x + 1) % 10, lambda x: 3 * x % 10), "d": (lambda x: (x + 9) % 10, lambda x: (x + 8) % 10)}


def _p_maps():
    return {"a": (lambda x: (3 * x + 1) % 10, lambda x: (3 * x + 6) % 10),
            "b": (lambda x: 7 * x % 10, lambda x: 9 - 7 * x % 10),
            "c": (lambda x: (x + 1) % 10, lambda x: (x + 6) % 10),
            "d": (lambda x: (3 * x + 2) % 10, lambda x: (3 * x + 7) % 10)}


@pytest.mark.parametrize("grammar,maps", [("chain-b4", _b4_maps), ("chain-p", _p_maps)])
@pytest.mark.parametrize("sep", ["", ",sep=none"])
def test_the_rings_of_four_are_what_python_prints_and_never_repeat_a_state(grammar, maps, sep):
    """`exec:grammar=chain-b4|chain-p`: a ring of four variables (a branches on d, b on the new a, ...); what a real
    Python prints; the rule digit by digit (an oracle written here, not read from the body); the step is a
    permutation of the 10,000 states with no cycle short enough for an answer to repeat a state (no answer can be
    copied from a period); chain-p's two maps of every link give values of different halves (no link cuts the chain
    of branch bits), chain-b4's do not; the card names four variables and 10,000 starts."""
    from dblock.tasks.card import _exec_data_text
    from dblock.tasks.exec_task import TIGHT_ITERS
    task = get_task(f"exec:grammar={grammar}{sep}")
    assert task.sizes_.vars_ == (4,)
    examples = task.examples("train", 8) + task.examples("test", 8)
    assert _python_prints(examples) == [e.answer for e in examples]
    m = maps()

    def step(*s):
        s = list(s)
        for k, v in enumerate("abcd"):
            s[k] = m[v][0](s[k]) if s[k - 1] > 4 else m[v][1](s[k])
        return tuple(s)
    for e in examples:
        assert e.prompt.startswith("def f(a,b,c,d):") and task.solve(e.prompt) == e
        lines = [tuple(map(int, ln.split() if " " in ln else ln)) for ln in e.answer.split("\n")[:-1]]
        assert all(step(*x) == y for x, y in zip(lines, lines[1:])) and len(e.answer) + 1 <= MAX_ANSWER
    longest = max(TIGHT_ITERS[4][1], ExecTask().sizes_.iters[4][1]) + 1   # lines of the longest answer
    seen, shortest = set(), 10 ** 4
    for s0 in ((k // 1000, k // 100 % 10, k // 10 % 10, k % 10) for k in range(10 ** 4)):
        if s0 in seen:
            continue
        cur, n = step(*s0), 1
        while cur != s0:
            seen.add(cur)
            cur, n = step(*cur), n + 1
        seen.add(s0)
        shortest = min(shortest, n)
    assert shortest > longest
    cuts = sum((hi(x) > 4) == (lo(x) > 4) for hi, lo in m.values() for x in range(10))
    assert (cuts == 0) == (grammar == "chain-p")
    d = task.describe()
    assert d["starts"] == 10 ** 4 and 0 < d["held_out_starts"] < 10 ** 4
    text = _exec_data_text({"task_description": d, "vocab_size": 64, "family": "llada2_moe"})
    assert "function of 4 variables" in text and "`f(a,b,c,d)`" in text and "of the 10,000 initial states" in text
