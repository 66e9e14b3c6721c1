"""A model card's `decoding` block sets the commands' decoding defaults (the bundled code-masked decodes with
LLaDA2.0's steps S = 8 over the threshold rule); a flag overrides it, and `--threshold-steps 0` turns it off."""
import json
import shutil

from dblock.cli import main
from dblock.tasks.card import decoding_of
from dblock.weights_path import resolve_model_path


def _eval(capsys, *argv):
    assert main(["eval", "--n", "2", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_card_sets_the_default_and_flags_override_it(tmp_path, capsys):
    folder = tmp_path / "m"
    shutil.copytree(resolve_model_path("tiny-masked"), folder)
    assert decoding_of(str(folder)) == {}
    base = _eval(capsys, "--model", str(folder))
    assert base["decode"]["threshold_steps"] is None
    card = json.loads((folder / "card.json").read_text())
    card["decoding"] = {"threshold_steps": 4}
    (folder / "card.json").write_text(json.dumps(card))
    assert decoding_of(str(folder)) == {"threshold_steps": 4}
    r = _eval(capsys, "--model", str(folder))
    assert r["decode"]["threshold_steps"] == 4
    assert max(int(k) for k in r["passes_per_block_hist"]) <= 4          # at least C/4 commits a pass
    assert _eval(capsys, "--model", str(folder), "--threshold-steps", "2")["decode"]["threshold_steps"] == 2
    off = _eval(capsys, "--model", str(folder), "--threshold-steps", "0")
    assert off["decode"]["threshold_steps"] is None and off["passes_per_block_hist"] == base["passes_per_block_hist"]
    assert _eval(capsys, "--model", str(folder), "--rule", "fixed-k")["decode"]["threshold_steps"] is None


def test_models_without_a_card_have_no_card_decoding():
    assert decoding_of("no-such-model") == {} and decoding_of(None) == {}


def test_a_uniform_state_card_sets_the_steps_per_block(tmp_path, capsys):
    """A uniform-state model's card sets N (entropy-bound steps per block); --steps overrides it."""
    folder = tmp_path / "u"
    shutil.copytree(resolve_model_path("tiny-uniform"), folder)
    card = json.loads((folder / "card.json").read_text())
    card["decoding"] = {"steps": 3}
    (folder / "card.json").write_text(json.dumps(card))
    r = _eval(capsys, "--model", str(folder))
    assert r["decode"]["steps"] == 3 and max(int(k) for k in r["passes_per_block_hist"]) <= 3
    assert _eval(capsys, "--model", str(folder), "--steps", "5")["decode"]["steps"] == 5
    assert _eval(capsys, "--model", str(resolve_model_path("tiny-uniform")))["decode"]["steps"] is None
