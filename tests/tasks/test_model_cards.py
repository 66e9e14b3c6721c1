"""The bundled models' cards: every number re-computed by the command the card names."""
import json
import os
import shutil

import pytest

from dblock.cli import main
from dblock.tasks import BUNDLED_TASK
from dblock.tasks.card import CARD_JSON, CARD_MD, build_card, read_card, render_markdown, task_of
from dblock.cli.tasks import run_eval_command
from dblock.weights_path import CHECKPOINTS_DIR

ARITH = ["tiny-masked", "tiny-uniform"]
CODE = ["code-masked", "code-uniform"]  # trained on the code task; their full evaluations (200 problems) take
EXEC = ["exec-masked"]                  # minutes, so their fresh check is the card's fixed subset, request by request
BUNDLED = ARITH + CODE + EXEC           # (exec-masked: trained on one exec grammar, which its card names)


def _card(name):
    folder = os.path.join(CHECKPOINTS_DIR, name)
    card = read_card(folder)
    assert card is not None, f"{folder}: no {CARD_JSON}; write it with `dblock model-card`"
    return folder, card


@pytest.mark.parametrize("name", ARITH)
def test_card_matches_a_fresh_evaluation(name):
    folder, card = _card(name)
    assert card["name"] == name and card["eval_command"].startswith(f"dblock eval --model {name} ")
    r = run_eval_command(card["eval_command"])
    e = card["eval"]
    assert r["accuracy"] == e["accuracy"]
    assert r["accuracy_by_kind"] == e["accuracy_by_kind"]
    assert (r["Y"], r["K"], r["F"]) == (e["Y"], e["K"], e["F"])
    assert r["passes_per_block_hist"] == e["passes_per_block_hist"]
    assert r["accuracy_by_grade"] == {k: {g: list(v) for g, v in by.items()}
                                      for k, by in e["accuracy_by_grade"].items()}
    md = open(os.path.join(folder, CARD_MD)).read()
    assert f"accuracy **{e['accuracy']:.3f}**" in md and card["train_command"] in md
    for sched, es in card.get("eval_schedules", {}).items():          # e.g. tiny-uniform under OBA
        r = run_eval_command(es["command"])
        assert es["command"].endswith(f"--schedule {sched}") and r["schedule"] == es["schedule"]
        assert (r["accuracy"], r["Y"], r["K"], r["F"]) == (es["accuracy"], es["Y"], es["K"], es["F"])
        assert es["command"] in md
    assert os.path.isfile(os.path.join(folder, "loss_curve.png")) and "loss_curve.png" in md
    assert all(st["command"] in md for st in card["train_stages"])


@pytest.mark.parametrize("name", BUNDLED)
def test_card_describes_the_weights_beside_it(name):
    import dblock
    folder, card = _card(name)
    m = dblock.load(name)
    assert m.config.family == card["family"]
    assert sum(p.numel() for p in m.parameters()) == card["params"]
    assert f"--family {card['family']}" in card["train_command"] and f"--steps {card['train_steps']}" in \
        card["train_command"]
    if name in CODE + EXEC:
        assert task_of(name) == card["task"] == ("code" if name in CODE else card["train_task"])
        assert name in CODE or card["task"].startswith("exec:")
        md = open(os.path.join(folder, CARD_MD)).read()
        assert card["eval_command"] in md and f"{card['eval']['passes_per_block_mean']:.2f}" in md
    else:
        assert task_of(name) == card["task"] == BUNDLED_TASK  # the defaults that need no model use BUNDLED_TASK
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        assert size <= 20 * 2 ** 20, f"{folder}: {size} bytes, over the 20 MB budget for an arithmetic model"


def test_the_code_checkpoints_fit_their_budget():
    """The code models store bf16 weights; together at most 40 MB. exec-masked (the code shape with a character
    vocabulary, bf16) at most 21 MB."""
    for names, mb in ((CODE, 40), (EXEC, 21)):
        size = sum(os.path.getsize(os.path.join(CHECKPOINTS_DIR, n, f)) for n in names
                   for f in os.listdir(os.path.join(CHECKPOINTS_DIR, n)))
        assert size <= mb * 2 ** 20, f"{names}: {size} bytes together, over the {mb} MB budget"


@pytest.mark.parametrize("name", BUNDLED)
def test_regression_subset_in_every_executor(name):
    """The card's small fixed subset (its first test problems): the reference gives the recorded result problem by
    problem; the Epoch executor loads the same weights and its exact configuration (full_compute) gives the same
    tokens (on the uniform-state models too: the DiffusionGemma Epoch executor); on llada2_moe the approximate
    default (epoch) gives the same accuracy within one problem."""
    _, card = _card(name)
    sub = card["subset"]
    ref = run_eval_command(sub["command"])
    assert [q["correct"] for q in ref["requests"]] == sub["correct"] and ref["accuracy"] == sub["accuracy"]
    key = "token_accuracy" if "token_accuracy" in sub else "value_accuracy" if "value_accuracy" in sub else None
    if key:                                  # code / exec: the quality metrics and the passes, request by request
        assert [q[key] for q in ref["requests"]] == sub[key]
        assert [q["passes"] for q in ref["requests"]] == sub["passes"]
        # the decoded metrics exactly; the held-out loss (a float reduction over the vocabulary) to 1e-6: its last
        # bits depend on the CPU's vector width, and a card measured on one machine is checked on another
        got, want = ref["metrics"], sub["metrics"]
        assert set(got) == set(want)
        for k in want:
            tol = 1e-6 if k == "loss_per_token" else 0
            assert got[k]["n"] == want[k]["n"] and got[k]["mean"] == pytest.approx(want[k]["mean"], rel=tol)
            assert got[k]["ci"] == pytest.approx(want[k]["ci"], rel=tol)
    fc = run_eval_command(sub["command"] + " --executor epoch --epoch-config full_compute")
    assert [q["tokens"] for q in fc["requests"]] == [q["tokens"] for q in ref["requests"]]
    if card["family"] == "llada2_moe":
        ep = run_eval_command(sub["command"] + " --executor epoch")
        assert abs(ep["accuracy"] - sub["accuracy"]) <= 1 / sub["n"] + 1e-9


def test_task_of_defaults_without_a_card(tmp_path):
    assert task_of(str(tmp_path)) == "arith"
    assert task_of("no-such-model", default="x") == "x"


def test_task_of_reads_a_runs_summary_without_a_card(tmp_path):
    """A train-tiny run folder (or its export) has no card but a train_summary.json: the benchmarks and `dblock
    eval` decode its task, not the default (an exec model given arithmetic prompts measures nothing); a card wins;
    a summary without a task name is refused by file and key."""
    summary = tmp_path / "train_summary.json"
    summary.write_text(json.dumps({"config": {"task": "exec:grammar=chain-p,sep=none"}}))
    assert task_of(str(tmp_path)) == "exec:grammar=chain-p,sep=none"
    (tmp_path / "card.json").write_text(json.dumps({"task": "arith-long"}))
    assert task_of(str(tmp_path)) == "arith-long"
    (tmp_path / "card.json").unlink()
    for bad in ({"config": {"task": 5}}, {"config": "x"}, [1]):
        summary.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"train_summary\.json: config\.task"):
            task_of(str(tmp_path))
    summary.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        task_of(str(tmp_path))


def _summary():
    return {"config": {"family": "llada2_moe", "size": "base", "task": "arith-small", "block_size": 16, "threads": 1},
            "params": 123, "steps_done": 10, "wall_s": 90.0, "final": {"loss": 1.0},
            "reproduce": "dblock train-tiny --family llada2_moe --out /tmp/private/run --steps 10 --seed 0",
            "history": [{"step": s, "loss": 1.0 / s, "acc": 0.1} for s in range(1, 26)]}


def test_build_card_hides_the_private_folder_and_keeps_the_last_step():
    r = {"n": 4, "split": "test", "accuracy": 0.5, "accuracy_by_kind": {"add": 0.0, "rev": 1.0}, "Y": 8, "K": 4,
         "F": 6, "TPF": 8 / 6, "passes_per_block_mean": 1.5, "passes_per_block_mean_by_kind": {"add": 2.0, "rev": 1.0},
         "passes_per_block_hist": {"1": 2, "2": 2}, "blocks_per_answer_mean": 1.0, "eos_rate": 1.0}
    card = build_card("tiny-x", _summary(), r, 4)
    assert card["train_command"] == "dblock train-tiny --family llada2_moe --out runs/tiny-x --steps 10 --seed 0"
    assert card["train_curve"][-1]["step"] == 25 and card["train_wall_min"] == 1.5
    assert card["eval_command"] == "dblock eval --model tiny-x --task arith-small --n 4"
    md = render_markdown(card)
    assert "accuracy **0.500** over 4 problems (add 0.000, rev 1.000)" in md and "1:2 2:2" in md


def test_build_card_of_a_two_stage_recipe_and_its_curve(tmp_path):
    r = {"n": 4, "split": "test", "accuracy": 0.5, "accuracy_by_kind": {"add": 0.0, "rev": 1.0}, "Y": 8, "K": 4,
         "F": 6, "TPF": 8 / 6, "passes_per_block_mean": 1.5, "passes_per_block_mean_by_kind": {"add": 2.0, "rev": 1.0},
         "passes_per_block_hist": {"1": 2, "2": 2}, "blocks_per_answer_mean": 1.0, "eos_rate": 1.0}
    one = _summary()
    two = {**_summary(), "wall_s": 30.0, "evals": [{"step": 25, "accuracy": 0.75, "n": 4}],
           "reproduce": "dblock train-tiny --family llada2_moe --out /tmp/x/b --steps 10 --seed 0 --init-from /tmp/x/a"}
    two["config"] = {**two["config"], "init_from": "/tmp/x/a"}
    oba = {**r, "schedule": "oba", "TPF": 8 / 5, "F": 5}
    card = build_card("tiny-x", [one, two], r, 4, {"oba": ("dblock eval --model tiny-x --schedule oba", oba)})
    assert [st["command"] for st in card["train_stages"]] == [
        "dblock train-tiny --family llada2_moe --out runs/tiny-x-stage1 --steps 10 --seed 0",
        "dblock train-tiny --family llada2_moe --out runs/tiny-x --steps 10 --seed 0 --init-from runs/tiny-x-stage1"]
    assert card["train_command"] == card["train_stages"][-1]["command"]
    assert card["train_wall_min"] == 2.0 and card["train_stages"][1]["final_eval"]["accuracy"] == 0.75
    assert card["task_description"]["mix"] == {"add": 1.0, "rev": 1.0}
    md = render_markdown(card)
    assert "Stage 2: 10 steps, 0.5 minutes; held-out accuracy at its end 0.75 on 4 problems of its task" in md
    assert "TPF +20.0%, accuracy +0.0 points" in md and "`add` 50% (sizes 1..4)" in md
    from dblock.tasks.card import plot_curve
    plot_curve([one, two], str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_card_cli_refuses_bad_input_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "m"
    shutil.copytree(os.path.join(CHECKPOINTS_DIR, "tiny-masked"), folder,
                    ignore=shutil.ignore_patterns(CARD_JSON, CARD_MD))
    assert main(["model-card", "--model", str(folder), "--train-summary", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: no such file" in capsys.readouterr().err
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"config": {}}))
    assert main(["model-card", "--model", str(folder), "--train-summary", str(bad)]) == 2
    assert "missing key 'params'" in capsys.readouterr().err
    s = tmp_path / "ok.json"
    s.write_text(json.dumps(_summary()))
    assert main(["model-card", "--model", str(folder), "--train-summary", str(s), "--task", "arith"]) == 2
    assert "trained on 'arith-small'" in capsys.readouterr().err
    assert not (folder / CARD_JSON).exists() and not (folder / CARD_MD).exists()


def test_model_card_cli_writes_both_files(tmp_path, capsys):
    folder = tmp_path / "m"
    shutil.copytree(os.path.join(CHECKPOINTS_DIR, "tiny-masked"), folder,
                    ignore=shutil.ignore_patterns(CARD_JSON, CARD_MD))
    s = tmp_path / "ok.json"
    s.write_text(json.dumps(_summary()))
    assert main(["model-card", "--model", str(folder), "--train-summary", str(s), "--n", "4"]) == 0
    card = read_card(str(folder))
    assert card["name"] == "m" and card["eval"]["n"] == 4 and card["task"] == "arith-small"
    assert (folder / CARD_MD).read_text().startswith("# m\n")
    assert "accuracy" in capsys.readouterr().out


def test_model_card_evaluates_a_reweighted_mix_on_its_task(tmp_path):
    """A stage trained on `arith:add=3,rev=1` (the same problems and split as `arith`, other kind weights) is carded
    on `arith`; the card names both, and a different task family is still refused."""
    folder = tmp_path / "m"
    shutil.copytree(os.path.join(CHECKPOINTS_DIR, "tiny-masked"), folder,
                    ignore=shutil.ignore_patterns(CARD_JSON, CARD_MD))
    summ = _summary()
    summ["config"]["task"] = "arith:add=3,rev=1"
    s = tmp_path / "mix.json"
    s.write_text(json.dumps(summ))
    assert main(["model-card", "--model", str(folder), "--train-summary", str(s), "--task", "arith-small"]) == 2
    assert not (folder / CARD_JSON).exists()
    assert main(["model-card", "--model", str(folder), "--train-summary", str(s), "--task", "arith", "--n", "4"]) == 0
    card = read_card(str(folder))
    assert card["task"] == "arith" and card["train_task"] == "arith:add=3,rev=1"
    assert card["eval_command"] == "dblock eval --model m --task arith --n 4" and task_of(str(folder)) == "arith"
    assert "drew its problems from `arith:add=3,rev=1`" in (folder / CARD_MD).read_text()
