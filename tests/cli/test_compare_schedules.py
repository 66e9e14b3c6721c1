"""`dblock compare-schedules`: every schedule runs on the same prompts; the derived columns follow their formulas."""
import json

import pytest

from dblock.cli import main
from dblock.compare import compare_schedules, derive
from dblock.config import DecodeConfig
from dblock.reference.generate import reference_forward
from dblock.simulator.oba import fit_alpha
from dblock.tiny import make_tiny_model


def test_rows_and_derived_columns():
    fwd = reference_forward(make_tiny_model("llada2_moe", seed=1))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    calls = []

    def grader(ids, out):
        calls.append((tuple(ids), tuple(out)))
        return len(out) % 2 == 0
    rows = compare_schedules(fwd, prompts, DecodeConfig(max_new_tokens=24), ["native", "oba", "native2c"],
                             seeds=[0, 100], grader=grader)
    assert [r["schedule"] for r in rows] == ["native", "oba", "native2c"]
    native, oba, wide = rows
    assert native["r"] == 1.0 and native["R"] == 4 and len(calls) == 12
    nbar = native["F"] / native["K"]
    assert oba["alpha_naive"] == pytest.approx(nbar / (oba["F"] / oba["K"]) - 1)
    assert oba["alpha"] == pytest.approx(fit_alpha(oba["F"], oba["K"], oba["R"], nbar))
    assert oba["verdict"] == ("pays" if oba["alpha"] > oba["r"] - 1 else "does not pay")
    assert wide["alpha"] is None and 0.0 <= native["accuracy"] <= 1.0
    # the paired pass counts once in F, and OBA never takes more passes than Native on these prompts
    assert oba["F"] <= native["F"]


def test_derive_without_native_leaves_ratios_empty():
    rows = derive([{"schedule": "oba", "T_den_ms": 1.0, "F": 10, "K": 2, "R": 1, "TPF": 1.0, "TPS": 1.0}])
    assert rows[0]["r"] is None and rows[0]["verdict"] is None


def test_cli_json_and_llada_moe_skips_multiblock(tmp_path, tiny_dirs, capsys):
    f = tmp_path / "p.txt"
    f.write_text("[5, 6, 7]\n\n[8, 9]\n")
    rc = main(["compare-schedules", "--model", tiny_dirs["llada_moe"], "--prompts", str(f), "--max-new-tokens",
               "16", "--json", "--schedules", "native,oba,native2c"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and [r["schedule"] for r in rows] == ["native", "native2c"]
    f.write_text("hello\n")
    rc = main(["compare-schedules", "--model", tiny_dirs["llada2_moe"], "--prompts", str(f)])
    assert rc == 2 and "tokenizer.json" in capsys.readouterr().err
