"""`dblock eval --json` lists every request (prompt, tokens, text, correct, passes), so two executors' outputs can be
compared from the command line: full_compute gives the reference's tokens, request by request."""
import json

from dblock.cli import main
from dblock.decoding.params import DecodeConfig
from dblock.tasks import get_task
from dblock.tasks.evaluate import evaluate


def eval_json(capsys, *extra):
    rc = main(["eval", "--model", "tiny-masked", "--task", "arith", "--n", "4", "--batch-size", "4", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_requests_records_match_the_summary():
    import dblock
    task = get_task("arith")
    r = evaluate(dblock.load("tiny-masked"), task, n=3, dec=DecodeConfig(max_new_tokens=64), batch_size=3,
                 seeds=[0, 1])
    reqs = r["requests"]
    assert len(reqs) == 6 and [q["seed"] for q in reqs] == [0, 0, 0, 1, 1, 1]
    assert [q["index"] for q in reqs] == [0, 1, 2, 0, 1, 2]
    for q in reqs:
        assert set(q) >= {"prompt", "tokens", "text", "correct", "passes", "expected"}
        assert q["correct"] == task.grade(q["prompt"], q["text"]) and q["passes"] >= 1
        assert all(isinstance(t, int) for t in q["tokens"])
    assert sum(q["passes"] for q in reqs) == r["F"]
    assert r["accuracy"] == sum(q["correct"] for q in reqs) / len(reqs)


def test_cli_full_compute_tokens_equal_the_reference_per_request(capsys):
    ref = eval_json(capsys)
    fc = eval_json(capsys, "--executor", "epoch", "--epoch-config", "full_compute")
    assert ref["executor"] == "reference" and fc["executor"] == "epoch"
    assert [q["prompt"] for q in fc["requests"]] == [q["prompt"] for q in ref["requests"]]
    assert [q["tokens"] for q in fc["requests"]] == [q["tokens"] for q in ref["requests"]]
    assert [q["passes"] for q in fc["requests"]] == [q["passes"] for q in ref["requests"]]
