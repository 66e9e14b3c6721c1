"""Careless-user fuzzing of a model folder's config.json through the command line: the bundled tiny checkpoints
with one config.json key set to a wrong value, deleted or added, or the file's text corrupted, then `dblock info`
and a tiny `dblock generate` on the folder.

The readers themselves are fuzzed key by key in tests/reference/test_config_validation.py; this checks what a user
sees: exit 0, or exit 2 with one line `dblock: error: ...` naming the file (config.json, model.safetensors, ...)
or a flag, never `internal error`, never a hang, and the folder left as it was (tests/fuzz/harness.py).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from dblock.weights_path import CHECKPOINTS_DIR
from tests.fuzz.harness import check_contract, run_cli
from tests.fuzz.test_cli_fuzz import SETTINGS, TIME_BOUND

EXAMPLES = 100
VALUES = [0, -1, 1, 2, 3, 7, 10 ** 12, 2 ** 64, 0.5, 1.5, -0.5, 1e308, float("nan"), float("inf"), True, False,
          None, "", "x", "llada2_moe", [], [1], [1, "a"], {}, {"a": 1}]
EXTRA_KEYS = ["bogus_key", "rope_scaling", "torch_dtype", "use_cache", "attention_bias", "hidden_act"]


@st.composite
def damaged_config(draw):
    """(model name, config.json text) with one damage."""
    name = draw(st.sampled_from(["tiny-masked", "tiny-uniform"]))
    with open(os.path.join(CHECKPOINTS_DIR, name, "config.json")) as f:
        text = f.read()
    d = json.loads(text)
    target = d["text_config"] if "text_config" in d and draw(st.booleans()) else d
    kind = draw(st.sampled_from(["set", "set", "set", "delete", "add", "text"]))
    if kind == "set":
        target[draw(st.sampled_from(sorted(target)))] = draw(st.sampled_from(VALUES))
    elif kind == "delete":
        target.pop(draw(st.sampled_from(sorted(target))))
    elif kind == "add":
        target[draw(st.sampled_from(EXTRA_KEYS))] = draw(st.sampled_from(VALUES))
    else:
        cut = draw(st.integers(0, len(text)))
        return name, draw(st.sampled_from([text[:cut], "[]", "null", "1", '"x"', "\ufeff" + text, text + "}",
                                           text.replace(":", "=", 1)]))
    return name, json.dumps(d)


def test_config_fuzz(capsys):
    counts = Counter()

    @settings(max_examples=EXAMPLES, **SETTINGS)
    @given(damaged_config(), st.sampled_from(["info", "generate"]))
    def case(damaged, command):
        name, text = damaged
        work = tempfile.mkdtemp(prefix="dblock-cfgfuzz-")
        try:
            folder = os.path.join(work, "m")
            shutil.copytree(os.path.join(CHECKPOINTS_DIR, name), folder)
            with open(os.path.join(folder, "config.json"), "w") as f:
                f.write(text)
            argv = (["info", "m", "--json"] if command == "info" else
                    ["generate", "--model", "m", "--prompt-ids", "5,6", "--max-new-tokens", "4", "--json"])
            counts[check_contract(run_cli(argv, work, TIME_BOUND))] += 1
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()
    with capsys.disabled():
        print(f"\nfuzz config.json: {sum(counts.values())} cases ({counts['ok']} ran, {counts['refused']} refused)")
    assert sum(counts.values()) >= 10
