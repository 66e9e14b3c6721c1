"""The graded `arith` task: determinism, disjoint splits, grader, length distribution."""

import pytest

from dblock.tasks import MARKER, ArithTask, get_task, solve
from dblock.tasks.arith import solve_add, solve_rev


@pytest.fixture(scope="module")
def task():
    return get_task("arith")


def test_worked_examples():
    assert solve("7+5=").answer == "7+5,0:;+,1:2;=>12"
    assert solve("347+85=").answer == "347+85,0:;34+8,1:2;3+,1:32;+,0:432;=>432"
    assert solve("rev 4821=").answer == "4821:;482:1;48:12;4:128;:1284;=>1284"
    assert solve("rev 3=").answer == "3:;:3;=>3"


def test_solutions_are_correct_and_end_in_marker(task):
    for split in ("train", "test"):
        for e in task.examples(split, 500):
            assert e.answer.endswith(MARKER + e.final) and e.answer.count(MARKER) == 1
            assert len(e.prompt) <= 24
            if e.kind == "add":
                a, b = e.prompt[:-1].split("+")
                assert int(e.final) == int(a) + int(b)
            else:
                assert e.final == e.prompt[4:-1][::-1]
    assert solve_add("999", "1")[1] == "1000" and solve_add("0", "0")[1] == "0"
    assert solve_rev("0120")[1] == "0210"


def test_deterministic(task):
    again = get_task("arith")
    for split in ("train", "test"):
        assert task.examples(split, 200) == again.examples(split, 200)
        assert task.examples(split, 50, start=100) == task.examples(split, 150)[100:]
    assert task.examples("train", 50) != task.examples("test", 50)
    assert get_task("arith:add=3,rev=1").examples("test", 50) != task.examples("test", 50)


def test_splits_disjoint(task):
    train = {e.prompt for e in task.examples("train", 4000)}
    test = {e.prompt for e in task.examples("test", 2000)}
    assert len(test) > 1000 and not train & test
    assert all(task.split_of(p) == "test" for p in test)


def test_grader(task):
    for e in task.examples("test", 300):
        assert task.grade(e.prompt, e.answer)
        assert task.grade(e.prompt, e.answer + "<eos>;9=>0<pad>")  # garbage after EOS is ignored
        wrong = str(int(e.final) + 1).zfill(len(e.final))
        assert not task.grade(e.prompt, e.answer[: -len(e.final)] + wrong)
        assert not task.grade(e.prompt, e.answer.replace(MARKER, ""))  # no marker
    assert not task.grade("12+345=", "")
    assert not task.grade("12+345=", "=>35")  # a prefix of the value is not the value
    assert task.grade("12+345=", "=>357")  # only the final value counts, not the steps
    with pytest.raises(ValueError, match="not an arith prompt"):
        task.grade("12*3=", "=>36")


def test_length_distribution(task):
    s = task.length_stats("test", 2000)
    assert s["min"] < 16 and s["max"] >= 96 and s["mean"] >= 40
    assert s["frac_lt_block"] > 0.02 and s["frac_ge_6_blocks"] > 0.05
    assert s["max"] <= 110


def test_mix_and_registry():
    add = get_task("arith-add").examples("train", 100)
    assert {e.kind for e in add} == {"add"}
    assert {e.kind for e in get_task("arith-rev").examples("test", 100)} == {"rev"}
    heavy = get_task("arith:add=9,rev=1").examples("train", 1000)
    assert 0.8 < sum(e.kind == "add" for e in heavy) / 1000 < 0.97
    short = ArithTask(add_digits=(1, 2), rev_len=(1, 2)).length_stats("train", 300)
    assert short["max"] < 40  # the size knob controls length
    for bad in ("nope", "arith:add=x", "arith:mul=1", "arith:add=nan", "arith:add=inf,rev=1", "arith:add=-1,rev=1"):
        with pytest.raises(ValueError):
            get_task(bad)
    with pytest.raises(ValueError, match="split"):
        get_task("arith").sample("val", 0)
