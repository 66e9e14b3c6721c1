"""`arith-long` (the `groups` answer style): worked examples, determinism, disjoint splits, grading of every kind,
difficulty grades in both splits; the `lines` tasks unchanged; the curriculum's capped tasks."""
import hashlib

import pytest

from dblock.tasks import MARKER, get_task, solve
from dblock.tasks.arith import solve_add_groups, solve_div

KINDS = ("add", "div", "rev")


@pytest.fixture(scope="module")
def task():
    return get_task("arith-long")


def test_worked_examples():
    grp = lambda p: solve(p, "groups").answer  # noqa: E731
    assert grp("123+45=") == "1001,2406,3508=>168"
    assert grp("347+85=") == "3014,4813,7502=>432"
    assert grp("999+1=") == "9010,9010,9100=>1000"
    assert grp("7+5=") == "7502=>12" and grp("0+0=") == "0000=>0"
    assert grp("4721:8=") == "4004,7457,2790,1001=>590r1"
    assert grp("7:9=") == "7007=>0r7" and grp("12:3=") == "1001,2140=>4r0"
    assert grp("rev 4821=") == solve("rev 4821=").answer == "4821:;482:1;48:12;4:128;:1284;=>1284"
    assert solve("123+45=").answer != grp("123+45=") and solve("123+45=").final == solve("123+45=", "groups").final
    assert solve_add_groups("99999999", "1")[1] == "100000000"
    assert solve_div("10000000", "9")[1] == "1111111r1"
    with pytest.raises(ValueError, match="not an arith prompt"):
        solve("4721:8=")                      # div is a `groups` kind
    with pytest.raises(ValueError, match="style"):
        solve("1+2=", "rows")


def _groups(row: str) -> list:
    return row.split(",")


def test_solutions_are_correct(task):
    for split in ("train", "test"):
        for e in task.examples(split, 1500):
            assert e.answer.endswith(MARKER + e.final) and e.answer.count(MARKER) == 1
            row = e.answer.split(MARKER)[0]
            if e.kind == "add":
                a, b = e.prompt[:-1].split("+")
                n = max(len(a), len(b))
                assert e.final == str(int(a) + int(b)) and e.digits == n == len(_groups(row))
                for j, g in enumerate(_groups(row)):        # a_j b_j c_j s_j, most significant column first
                    assert len(g) == 4 and g[:2] == a.zfill(n)[j] + b.zfill(n)[j]
                    assert int(g[3]) == (int(g[0]) + int(g[1]) + int(g[2])) % 10
                    nxt = _groups(row)[j + 1] if j + 1 < n else "0000"    # the carry comes from the right
                    assert int(g[2]) == (int(nxt[0]) + int(nxt[1]) + int(nxt[2]) >= 10 if j + 1 < n else 0)
                assert e.final.endswith("".join(g[3] for g in _groups(row)))
            elif e.kind == "div":
                a, d = e.prompt[:-1].split(":")
                q, r = e.final.split("r")
                assert int(q) * int(d) + int(r) == int(a) and 0 <= int(r) < int(d) and 2 <= int(d) <= 9
                assert q == str(int(q)) and len(_groups(row)) == len(a) == e.digits
                prev = "0"
                for x, g in zip(a, _groups(row)):           # a_j r_{j-1} q_j r_j
                    assert g[0] == x and g[1] == prev and divmod(10 * int(prev) + int(x), int(d)) == (int(g[2]),
                                                                                                       int(g[3]))
                    prev = g[3]
                assert prev == r
            else:
                assert e.kind == "rev" and e.final == e.prompt[4:-1][::-1] and e.digits == len(e.final)
            assert len(e.prompt) <= 18 and len(e.answer) + len(e.prompt) + 1 <= 128


def test_deterministic(task):
    again = get_task("arith-long")
    for split in ("train", "test"):
        assert task.examples(split, 300) == again.examples(split, 300)
        assert task.examples(split, 50, start=100) == task.examples(split, 150)[100:]
    assert task.examples("train", 50) != task.examples("test", 50)
    assert get_task("arith-long:add=1,div=1,rev=1").examples("test", 50) != task.examples("test", 50)


def test_splits_disjoint_and_graded_both_sides(task):
    train = task.examples("train", 6000)
    test = task.examples("test", 2000)
    tr, te = {e.prompt for e in train}, {e.prompt for e in test}
    assert len(te) > 1500 and not tr & te
    assert all(task.split_of(p) == "test" for p in te) and all(task.split_of(p) == "train" for p in tr)
    for kind in KINDS:
        lo, hi = task.sizes()[kind]
        want = set(range(lo, hi + 1))
        assert {e.digits for e in train if e.kind == kind} == want, kind
        assert {e.digits for e in test if e.kind == kind} == want, kind
    share = {k: sum(e.kind == k for e in test) / len(test) for k in KINDS}
    assert 0.45 < share["add"] < 0.55 and 0.28 < share["div"] < 0.38 and 0.12 < share["rev"] < 0.22


def test_grader_every_kind(task):
    seen = set()
    for e in task.examples("test", 400):
        seen.add(e.kind)
        assert task.grade(e.prompt, e.answer)
        assert task.grade(e.prompt, e.answer + "<eos>9=>0<pad>")
        row = e.answer.split(MARKER)[0]
        assert task.grade(e.prompt, "x" * len(row) + MARKER + e.final)    # only the final value counts
        if e.kind == "div":
            q, r = e.final.split("r")
            assert not task.grade(e.prompt, f"{row}{MARKER}{q}")           # the remainder is part of the value
            assert not task.grade(e.prompt, f"{row}{MARKER}{int(q) + 1}r{r}")
            assert not task.grade(e.prompt, f"{row}{MARKER}{q}r{(int(r) + 1) % 10}")
        else:
            wrong = str(int(e.final) + 1).zfill(len(e.final))
            assert not task.grade(e.prompt, row + MARKER + wrong)
            assert not task.grade(e.prompt, row + MARKER + e.final + "0")
        assert not task.grade(e.prompt, e.answer.replace(MARKER, ""))
    assert seen == set(KINDS)
    assert task.grade("123+45=", "1001,2406,3508=>168") and not task.grade("123+45=", "=>16")
    with pytest.raises(ValueError, match="not an arith prompt"):
        task.grade("12*3=", "=>36")


def test_lines_tasks_unchanged():
    """`arith` and `arith-small` (the bundled cards' task) draw exactly the problems they drew before `arith-long`."""
    pins = {("arith", "train"): "f3f6c0cd8e43f620", ("arith", "test"): "7236b90566a694f4",
            ("arith-small", "train"): "b23864a67cea7031", ("arith-small", "test"): "97539a621772d8c2"}
    for (name, split), want in pins.items():
        exs = get_task(name).examples(split, 300)
        got = hashlib.sha256("\n".join(e.prompt + "|" + e.answer for e in exs).encode()).hexdigest()[:16]
        assert got == want, (name, split)
    assert get_task("arith").kinds == ("add", "rev")
    with pytest.raises(ValueError):
        get_task("arith:div=1")
    with pytest.raises(ValueError):
        get_task("arith-long:mul=1")


def test_capped_and_describe(task):
    small = task.capped(3)
    assert small.sizes() == {"add": (1, 3), "div": (2, 3), "rev": (1, 3)} and small.style == "groups"
    assert all(e.digits <= 3 for e in small.examples("train", 300))
    # capped train problems keep the split rule: never a test problem of the full task
    assert all(task.split_of(e.prompt) == "train" for e in small.examples("train", 300))
    assert task.capped(99).sizes() == task.sizes()
    d = task.describe()
    assert d["style"] == "groups" and d["sizes"]["add"] == [1, 8] and "SHA-256" in d["split"]


def test_lengths(task):
    s = task.length_stats("test", 1000)
    assert s["max"] <= 64 and s["mean"] > 12
