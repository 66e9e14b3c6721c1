"""`evaluate` / `dblock eval` on the bundled tiny-masked model (a handful of problems), and CLI errors."""
import json

import pytest

import dblock
from dblock.cli import main
from dblock.decoding.params import DecodeConfig
from dblock.tasks import CharTokenizer, get_task
from dblock.tasks.evaluate import TokenizerAdapter, evaluate
from dblock.weights_path import resolve_model_path


@pytest.fixture(scope="module")
def model():
    return dblock.load("tiny-masked")


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_bundled_folder_and_tokenizer(model):
    folder = resolve_model_path("tiny-masked")
    cfg = model.config
    assert cfg.family == "llada2_moe" and cfg.vocab_size == 32 and cfg.block_size == 16
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (3, 1, 1)
    assert cfg.num_experts >= 8 and cfg.num_shared_experts == 1 and cfg.first_k_dense_replace == 1
    hf, char = TokenizerAdapter.from_folder(folder), CharTokenizer()
    for e in get_task("arith").examples("test", 20):
        assert hf.encode(e.prompt) == char.encode(e.prompt)
        assert hf.decode(char.encode(e.answer) + [1, 1]) == e.answer
    assert hf.eos_id == char.eos_id


def test_evaluate_counters_consistent(model):
    task = get_task("arith")
    r = evaluate(model, task, n=4, dec=DecodeConfig(max_new_tokens=128), batch_size=4, examples=4)
    assert 0.0 <= r["accuracy"] <= 1.0 and r["n"] == 4
    assert r["accuracy"] == sum(e["correct"] for e in r["examples"]) / 4
    assert r["Q"] == r["F"] + r["K"] and r["TPF"] == pytest.approx(r["Y"] / r["Q"])
    assert sum(r["passes_per_block_hist"].values()) == r["K"]
    assert sum(k * v for k, v in r["passes_per_block_hist"].items()) == r["F"]
    assert sum(r["blocks_per_answer_hist"].values()) == 4
    assert sum(k * v for k, v in r["blocks_per_answer_hist"].items()) == r["K"]
    assert all(1 <= k <= 64 for k in r["passes_per_block_hist"])
    for e in r["examples"]:
        assert e["correct"] == task.grade(e["prompt"], e["output"])
    # greedy threshold decoding: the same tokens and counters whatever the seed
    r2 = evaluate(model, task, n=4, dec=DecodeConfig(max_new_tokens=128), batch_size=4, seeds=[5], examples=4)
    assert [e["output"] for e in r2["examples"]] == [e["output"] for e in r["examples"]]
    assert (r2["Y"], r2["K"], r2["F"]) == (r["Y"], r["K"], r["F"])


def test_eval_cli_json(capsys):
    rc, out, err = run(capsys, "eval", "--model", "tiny-masked", "--task", "arith", "--n", "3", "--batch-size", "3",
                       "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert 0.0 <= r["accuracy"] <= 1.0 and r["executor"] == "reference" and r["schedule"] == "native"
    for key in ("TPF", "TPS", "wall_s", "passes_per_block_hist", "blocks_per_answer_mean", "Y", "K", "F", "Q"):
        assert key in r


@pytest.mark.parametrize("argv, needle", [
    (["eval", "--model", "tiny-masked", "--n", "0"], "--n 0"),
    (["eval", "--model", "tiny-masked", "--task", "poetry"], "unknown task"),
    (["eval", "--model", "no-such-model"], "no such model folder"),
    (["train-tiny", "--family", "llada2_moe", "--out", "/tmp/dblock-unused"], "--steps S or --minutes N"),
    (["train-tiny", "--family", "llada2_moe", "--out", "/tmp/dblock-unused", "--steps", "0"], "must be positive"),
    (["train-tiny", "--out", "/tmp/dblock-unused", "--steps", "2"], "give --family"),
    (["train-tiny", "--out", "/tmp/dblock-unused-x", "--resume"], "nothing to resume"),
])
def test_cli_errors_one_line(capsys, argv, needle):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_resume_without_checkpoint_one_line(capsys, tmp_path):
    rc, out, err = run(capsys, "train-tiny", "--family", "llada2_moe", "--out", str(tmp_path), "--resume")
    assert rc == 2 and "no checkpoint" in err and len(err.strip().splitlines()) == 1


def test_tokenizer_adapter_wraps_bare_tokenizer(model):
    from tokenizers import Tokenizer
    folder = resolve_model_path("tiny-masked")
    bare = Tokenizer.from_file(f"{folder}/tokenizer.json")
    r = evaluate(model, get_task("arith-rev"), n=1, tokenizer=bare)
    assert r["n"] == 1 and r["accuracy"] in (0.0, 1.0) and r["task"] == "arith-rev"


def test_evaluate_bundled_uniform_seeds():
    """tiny-uniform: entropy-bound sampling draws noise, so each seed is its own run; counters add up."""
    m = dblock.load("tiny-uniform")
    assert m.config.family == "diffusion_gemma" and m.config.canvas_length == 16 and m.config.vocab_size == 32
    dec = DecodeConfig(max_new_tokens=64, rule="entropy-bound")
    r = evaluate(m, "arith-small", n=2, dec=dec, batch_size=2, seeds=[0, 1])
    assert len(r["per_seed"]) == 2 and r["accuracy"] == pytest.approx(sum(p["accuracy"] for p in r["per_seed"]) / 2)
    assert r["Q"] == r["F"] + r["K"] and sum(r["passes_per_block_hist"].values()) == r["K"]
    assert sum(r["blocks_per_answer_hist"].values()) == 4          # 2 problems x 2 seeds
    assert all(2 <= k <= 48 for k in r["passes_per_block_hist"])  # the stop rule needs two equal argmax canvases
