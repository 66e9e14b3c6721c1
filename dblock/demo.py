"""`make demo` / `dblock demo`: the main job.

While no trained model is bundled, it decodes with a random tiny checkpoint and says so.
"""
from __future__ import annotations

import json
import os
import tempfile

from dblock.weights import CHECKPOINTS_DIR


def _bundled() -> list:
    if not os.path.isdir(CHECKPOINTS_DIR):
        return []
    return sorted(d for d in os.listdir(CHECKPOINTS_DIR) if os.path.isfile(os.path.join(CHECKPOINTS_DIR, d,
                                                                                         "config.json")))


def run_demo(n=None, as_json=False) -> int:
    import dblock
    from dblock.config import DecodeConfig
    from dblock.tiny import make_tiny

    rows = []
    if not _bundled():
        print("dblock demo: no trained model is bundled yet; decoding with a RANDOM tiny llada2_moe checkpoint "
              "(its text is meaningless; this shows the pipeline and the counters).")
        with tempfile.TemporaryDirectory() as d:
            make_tiny("llada2_moe", d, seed=0)
            model = dblock.load(d)
            prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]][: n or 2]
            for no_cache in (False, True):
                res = dblock.generate(model, prompts, DecodeConfig(max_new_tokens=32, no_cache=no_cache))
                s = res.summary()
                rows.append({"model": "random-tiny-llada2", "executor": "reference",
                             "schedule": "native" + (" (no cache)" if no_cache else ""), "TPF": s["TPF"],
                             "TPS": s["TPS"], "passes/block": s["passes_per_block"]})
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = list(rows[0])
    print(" | ".join(f"{c:>14s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>14.2f}" if isinstance(r[c], float) else f"{str(r[c]):>14s}" for c in cols))
    return 0
