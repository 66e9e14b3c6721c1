"""Liveness of a block's positions pass by pass: which rows feed a decision (live), which go through the routed
experts under Epoch's LSP (fresh), for the cost and serving models.

From a block's per-position accept passes (`accept[i]` = 1-based pass, as current block, at which position i was
first accepted/decoded; 0 = already accepted at promotion; −1 = never before commit), for pass j = 1..n (docs/algorithms.md §4.3):

    D_j = {i : 0 <= accept[i] < j}          decoded set seen by pass j
    live_j  = C − |D_j|                     rows whose logits feed a decision (the LM-head rows under Epoch)
    new_j   = |D_j \\ D_{j−1}| = |{accept == j − 1}|   newly decoded: fresh once before they may be served from cache
    fresh_j = C                             on the cold pass (j = 1: the block plan is built, the cache is empty)
              C                             on a refresh pass ((j − 1) mod M_C == 0: every entry has age <= M_C − 1)
              live_j + new_j                otherwise

Fractions are of the block's C rows. `LivenessProfile.average` weights every pass equally, i.e. it is the mean over
the passes a serving engine actually runs.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from dblock.simulator.positions import Profile, PositionModel


def per_pass(accept: np.ndarray, m_c: int = 5, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(live_frac, fresh_frac), each of shape (n,), for one block whose positions were accepted at `accept`;
    n defaults to the last accept pass (a masked block stops when its last position is decoded)."""
    if m_c < 1:
        raise ValueError(f"M_C={m_c}: the refresh period must be >= 1")
    acc = np.asarray(accept)
    C = acc.size
    n = int(max(1, acc.max(initial=1))) if n is None else int(n)
    j = np.arange(1, n + 1)
    live = C - ((acc >= 0)[None, :] & (acc[None, :] < j[:, None])).sum(1).astype(float)
    new = (acc[None, :] == (j - 1)[:, None]).sum(1)
    new[0] = 0
    fresh = np.where((j == 1) | ((j - 1) % m_c == 0), float(C), live + new)
    return live / C, fresh / C


@dataclass
class LivenessProfile:
    """Pass-averaged live and fresh fractions (and passes per block) from blocks drawn from a Native profile."""

    live: float           # mean over passes of the live fraction
    fresh: float          # mean over passes of the fresh fraction (LSP with refresh period m_c)
    passes: float         # mean passes per block
    m_c: int = 5
    live_by_u: np.ndarray | None = None    # live fraction by relative pass u = j/n on a 10-point grid
    fresh_by_u: np.ndarray | None = None

    @staticmethod
    def from_accepts(accepts: list[np.ndarray], m_c: int = 5) -> "LivenessProfile":
        if not accepts:
            raise ValueError("LivenessProfile: no blocks")
        lives, freshes, ns = [], [], []
        grid_l = np.zeros(10)
        grid_f = np.zeros(10)
        for acc in accepts:
            lv, fr = per_pass(acc, m_c)
            lives.append(lv)
            freshes.append(fr)
            ns.append(lv.size)
            idx = np.minimum(9, (np.arange(lv.size) * 10) // lv.size)
            for b in range(10):
                sel = idx == b
                grid_l[b] += lv[sel].mean() if sel.any() else lv[min(lv.size - 1, b * lv.size // 10)]
                grid_f[b] += fr[sel].mean() if sel.any() else fr[min(fr.size - 1, b * fr.size // 10)]
        all_l = np.concatenate(lives)
        all_f = np.concatenate(freshes)
        return LivenessProfile(float(all_l.mean()), float(all_f.mean()), float(np.mean(ns)), m_c,
                               grid_l / len(accepts), grid_f / len(accepts))

    @staticmethod
    def from_profile(profile: Profile, blocks: int = 400, m_c: int = 5, seed: int = 0) -> "LivenessProfile":
        """Native blocks from a (parametric or empirical) profile, integer passes."""
        rng = np.random.default_rng(seed)
        model = PositionModel(profile, delta=0.0)
        accs = [model.promote(profile.sample(rng), 0.0, 0, rng).accept for _ in range(blocks)]
        return LivenessProfile.from_accepts(accs, m_c)

    def as_dict(self) -> dict:
        return dict(live=self.live, fresh=self.fresh, passes=self.passes, m_c=self.m_c,
                    live_by_u=None if self.live_by_u is None else self.live_by_u.tolist(),
                    fresh_by_u=None if self.fresh_by_u is None else self.fresh_by_u.tolist())


# ---- liveness measured on a trace --------------------------------------------------------------------------

#: the bundled default: code-masked's Native decode at its card settings (block 32); made by the command in the file
BUNDLED = {"code-masked": os.path.join(os.path.dirname(__file__), "data", "liveness_code_masked.json")}
_CONVERT_COMMAND = ("dblock compare-schedules --model code-masked --task code --n 64 --schedules native --trace-dir "
                    "DIR && python -m dblock.simulator.liveness DIR/native.jsonl > "
                    "dblock/simulator/data/liveness_code_masked.json")


def _block_events(path: str, flag: str = "--liveness-from") -> tuple[list[dict], dict]:
    """Block events and a header from a JSON-lines trace, a trace directory (its native.jsonl) or a bundled JSON;
    every event checked against the trace schema (`dblock.trace.check_event`), errors naming `flag` and the file."""
    from dblock.input_files import read_json, where
    from dblock.trace import check_event, events, read_trace
    if os.path.isdir(path):
        cand = os.path.join(path, "native.jsonl")
        if not os.path.isfile(cand):
            raise ValueError(f"{flag} {path}: a trace directory without native.jsonl (write one with "
                             "`dblock compare-schedules --schedules native --trace-dir DIR`)")
        path = cand
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file (allowed: a `dblock generate --trace` file, a "
                         f"`compare-schedules --trace-dir` directory, or {', '.join(BUNDLED)})")
    if path.endswith(".json"):
        d = read_json(path, flag)
        if not isinstance(d, dict) or not isinstance(d.get("blocks"), list):
            raise ValueError(f"{where(path, flag)}: not a liveness file (a JSON object with a list 'blocks')")
        blocks = [check_event({**b, "event": "block"} if isinstance(b, dict) else b, f"{where(path, flag)}: block {i}")
                  for i, b in enumerate(d["blocks"])]
        head = check_event({**{k: v for k, v in d.items() if k != "blocks"}, "event": "run"}, where(path, flag))
        return blocks, {k: v for k, v in head.items() if k != "event"}
    ev = list(read_trace(path, flag))
    run = next((e for e in ev if e.get("event") == "run"), {})
    return events(ev, "block"), dict(model=run.get("model"), schedule=run.get("schedule"), decode=run.get("decode"),
                                     family=run.get("family"))


def trace_profile(path_or_name: str):
    """The Native block profile (`positions.EmpiricalProfile`: passes and per-position accept passes) of a trace,
    a trace directory, or a bundled name (`code-masked`): what `--liveness-from` puts in place of the uniform
    assumption. Refuses a trace that is not a Native run or has no `accept_pass` lists."""
    from dblock.simulator.positions import EmpiricalProfile
    path = BUNDLED.get(path_or_name, path_or_name)
    blocks, head = _block_events(path)
    sched = head.get("schedule")
    if sched not in (None, "native"):
        raise ValueError(f"--liveness-from {path_or_name}: a {sched} trace; liveness is read from a Native run")
    try:
        prof = EmpiricalProfile.from_block_events(blocks)
    except ValueError:
        raise ValueError(f"--liveness-from {path_or_name}: no block event carries accept_pass (trace a Native "
                         "decode with `dblock generate --trace` or `compare-schedules --trace-dir`)") from None
    prof.source = str(path_or_name)
    prof.family, prof.model = head.get("family"), head.get("model")
    return prof


def _main(argv=None) -> int:  # pragma: no cover - the command that wrote the bundled file
    """Print the compact liveness JSON of a Native trace (the bundled data file's format)."""
    import sys
    path = (argv or sys.argv[1:])[0]
    blocks, head = _block_events(path)
    out = dict(what="Native block events (per-position accept passes) for `--liveness-from`", command=_CONVERT_COMMAND,
               **head, blocks=[dict(passes=b["passes"], size=b.get("size"), tokens=b.get("tokens"),
                                    accept_pass=b["accept_pass"]) for b in blocks if b.get("accept_pass")])
    print(json.dumps(out, separators=(",", ":")))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
