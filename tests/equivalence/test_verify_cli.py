"""`dblock verify` end to end through the CLI: report fields, exit statuses, the fault self-check, the staleness
curve, prompt files."""
import json
import os

import pytest

from dblock.cli import main
from dblock.cli.equivalence import read_prompts
from dblock.weights_path import CHECKPOINTS_DIR


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "p.txt"
    p.write_text("5,6,7,8,9,10,11\n3,4,5\n\n12,13,14,15,16,17,18,19,20\n")
    return str(p)


def run(capsys, *argv):
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_verify_json_report(tiny_dirs, prompt_file, capsys):
    status, out, _ = run(capsys, "verify", "--model", tiny_dirs["llada2_moe"], "--prompts", prompt_file,
                         "--max-new-tokens", "24", "--json", "--max-disagreement", "1")
    rep = json.loads(out)
    assert status == 0 and rep["exit"] == {"status": 0, "reasons": []}
    main_ = rep["main"]
    for key in ("logits", "layers", "margin", "decisions", "margin_violations", "cache", "coverage", "invariants"):
        assert key in main_
    assert {"within_gamma", "within_gamma_exact", "by_block_pass", "by_path"} <= set(main_["margin"])
    assert {"agreement", "disagreements", "list"} <= set(main_["decisions"])
    assert all({"request", "block", "pass", "position", "delta", "gamma"} <= set(v) for v in main_["margin_violations"])
    assert [ly["layer"] for ly in main_["layers"]] == [1, 2]
    assert rep["probe"]["cache"]["max_age"] == 4 and rep["e2e"]["requests"] == 3
    assert all(s["ok"] for s in main_["invariants"].values())


def test_verify_text_report_and_disagreement_gate(tiny_dirs, prompt_file, capsys):
    status, out, _ = run(capsys, "verify", "--model", tiny_dirs["llada2_moe"], "--prompts", prompt_file,
                         "--max-new-tokens", "24", "--max-disagreement", "0", "--no-probe", "--no-e2e")
    assert "decision agreement" in out and "cache ages at read" in out and "invariants:" in out
    rep_rate = [line for line in out.splitlines() if line.startswith("decision agreement")][0]
    if "100.00%" in rep_rate.split()[2]:
        assert status == 0
    else:                                          # a random model flips some decisions: gated by the threshold
        assert status == 1 and "decision disagreement rate" in out


@pytest.mark.parametrize("fault,name", [("stale-cache", "staleness"), ("skip-live-logits", "lm-head")])
def test_inject_fault_exits_nonzero_naming_it(tiny_dirs, prompt_file, capsys, fault, name):
    status, out, _ = run(capsys, "verify", "--model", tiny_dirs["llada2_moe"], "--prompts", prompt_file,
                         "--max-new-tokens", "16", "--no-e2e", "--inject-fault", fault)
    assert status == 1
    assert f"invariant {name} broken" in out


def test_full_compute_is_exact_with_the_default_gate(tiny_dirs, prompt_file, capsys):
    status, out, _ = run(capsys, "verify", "--model", tiny_dirs["llada_moe"], "--prompts", prompt_file,
                         "--max-new-tokens", "16", "--epoch-config", "full_compute", "--json", "--no-probe",
                         "--check", "full-compute")
    rep = json.loads(out)
    assert status == 0 and rep["max_disagreement"] == 0.0
    assert rep["main"]["decisions"]["agreement"] == 1.0 and rep["checks"]["full-compute"]["ok"] is True


def test_staleness_curve_table_and_plot(tiny_dirs, prompt_file, tmp_path, capsys):
    png = tmp_path / "curve.png"
    status, out, _ = run(capsys, "verify", "--model", tiny_dirs["llada2_moe"], "--prompts", prompt_file,
                         "--max-new-tokens", "16", "--staleness-curve", "--max-age", "6", "--plot", str(png),
                         "--json", "--max-disagreement", "1", "--no-e2e")
    rep = json.loads(out)
    assert status == 0 and png.stat().st_size > 1000
    t = rep["staleness"]["tables"]["probe"]
    assert [r["age"] for r in t["rows"]] == [1, 2, 3, 4, 5, 6]
    assert t["rows"][0]["decoded"]["n"] > 0 and t["rows"][0]["live"]["n"] > 0
    assert all(r["served"]["n"] == 0 for r in t["rows"][4:])            # nothing older than M_C - 1 is ever read
    assert t["M_C"] == 5 and t["at_M_C"]["age"] == 5


def test_usage_errors(tiny_dirs, prompt_file, capsys):
    status, _, err = run(capsys, "verify", "--model", tiny_dirs["llada2_moe"])
    assert status == 2 and "--task" in err
    status, _, err = run(capsys, "verify", "--model", tiny_dirs["llada2_moe"], "--prompts", prompt_file,
                         "--executor", "reference", "--inject-fault", "stale-cache")
    assert status == 2 and "inject-fault" in err


def test_read_prompts(tmp_path):
    class Tok:
        def encode(self, text):
            return [ord(c) % 50 for c in text]
    p = tmp_path / "p.json"
    p.write_text(json.dumps(["ab", [1, 2, 3]]))
    assert read_prompts(str(p), Tok()) == [[47, 48], [1, 2, 3]]
    q = tmp_path / "q.txt"
    q.write_text("1, 2,3\nhello\n")
    assert read_prompts(str(q), Tok())[0] == [1, 2, 3]
    with pytest.raises(ValueError, match="no tokenizer"):
        read_prompts(str(q), None)


@pytest.mark.skipif(not os.path.isdir(os.path.join(CHECKPOINTS_DIR, "tiny-masked")), reason="tiny-masked not bundled")
def test_bundled_model_verifies_clean(capsys):
    """Done when: `dblock verify` on tiny-masked with the default epoch configuration exits 0."""
    status, out, _ = run(capsys, "verify", "--model", "tiny-masked", "--task", "arith", "--n", "3", "--json")
    rep = json.loads(out)
    assert status == 0, rep["exit"]
    assert rep["e2e"]["accuracy_reference"] is not None


def test_the_liveness_probe_drops_the_threshold_rules_own_options():
    """A model whose card decodes with LLaDA2.0's steps S (threshold rule) still gets its fixed-k probe."""
    from dblock.decoding.params import DecodeConfig
    from dblock.equivalence.verify import probe_decode
    p = probe_decode(DecodeConfig(max_new_tokens=64, threshold_steps=8), 32).validate()
    assert (p.rule, p.steps, p.threshold_steps, p.max_new_tokens) == ("fixed-k", 32, None, 64)
