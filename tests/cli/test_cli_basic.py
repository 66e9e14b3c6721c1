"""The CLI: make-tiny -> generate --json (same tokens with --no-cache), info, and one-line errors."""
import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from dblock.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_make_tiny_generate_json_and_no_cache(tmp_path, capsys):
    d = str(tmp_path / "m")
    assert run(capsys, "make-tiny", "--family", "llada2_moe", "--out", d)[0] == 0
    rc, out, _ = run(capsys, "generate", "--model", d, "--prompt-ids", "5,6,7", "--max-new-tokens", "64", "--json")
    a = json.loads(out)
    assert rc == 0 and len(a["tokens"][0]) <= 64 and a["counters"]["summary"]["Y"] == len(a["tokens"][0])
    for key in ("Y", "K", "F", "Q", "TPF", "T_den_ms", "TPS", "wall_TPS"):
        assert key in a["counters"]["summary"]
    rc, out, _ = run(capsys, "generate", "--model", d, "--prompt-ids", "5,6,7", "--max-new-tokens", "64", "--json",
                     "--no-cache")
    assert json.loads(out)["tokens"] == a["tokens"]


def test_info(tiny_dirs, capsys):
    rc, out, _ = run(capsys, "info", tiny_dirs["llada2_moe"], "--json")
    info = json.loads(out)
    assert rc == 0 and info["config"]["num_experts"] == 16
    assert info["parameters_active_per_token"] < info["parameters_total"]
    assert info["weight_bytes"] == 4 * info["parameters_total"]  # fp32 on disk


@pytest.mark.parametrize("damage, needle", [
    ("truncate", "unreadable safetensors"),
    ("missing", "missing key 'model.norm.weight'"),
    ("shape", "'lm_head.weight' has shape"),
])
def test_bad_checkpoints_one_line(tmp_path, tiny_dirs, capsys, damage, needle):
    import shutil
    d = tmp_path / "bad"
    shutil.copytree(tiny_dirs["llada2_moe"], d)
    f = d / "model.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:5000])
    else:
        t = load_file(str(f))
        if damage == "missing":
            del t["model.norm.weight"]
        else:
            t["lm_head.weight"] = t["lm_head.weight"][:, :10].contiguous()
        save_file(t, str(f))
    rc, out, err = run(capsys, "generate", "--model", str(d), "--prompt-ids", "1,2", "--json")
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_bad_arguments_one_line(tiny_dirs, capsys):
    rc, _, err = run(capsys, "generate", "--model", tiny_dirs["llada2_moe"], "--prompt-ids", "1,x")
    assert rc == 2 and "--prompt-ids" in err
    rc, _, err = run(capsys, "generate", "--model", tiny_dirs["llada2_moe"], "--prompt-ids", "1,999")
    assert rc == 2 and "outside the vocabulary" in err
    rc, _, err = run(capsys, "generate", "--model", tiny_dirs["llada2_moe"], "--prompt", "hello")
    assert rc == 2 and "tokenizer.json" in err
    rc, _, err = run(capsys, "generate", "--model", tiny_dirs["llada_moe"], "--prompt-ids", "1", "--schedule", "oba")
    assert rc == 2 and "llada_moe" in err


def test_console_script_exit_status(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dblock", "generate", "--model", str(tmp_path / "none"),
                        "--prompt-ids", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("dblock: error:") and "no such model folder" in r.stderr
