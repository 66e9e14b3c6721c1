"""The Epoch executor's operator tables of `dblock simulate profile` (`Profiler.epoch`):

    epoch_moe(rows, fresh_frac)   per MoE layer, the Epoch MoE region of a pass of `rows` valid rows of which
                                  `fresh_frac` are fresh
    epoch_call_denoise(requests, segments)   the Epoch call's fixed cost (whole call minus its operators)

`epoch_moe` comes from the passes of real Native decodes with the Epoch executor (`decode_passes`): B prompts of
the model's own task (its card's, test problems from PROMPTS_START on; random prompts for a model without one) decoded at the card's
decoding, 3 blocks each, every pass timed, its MoE region the executor's own `moe_s` share of the pass. Those
passes carry what the Expert Atlas does on a real decode — the per-token fail-closed check and the re-routing of the
rows it opens (`_cover_fresh`: rows decoded since the support was built want experts the build never saw), the hot
repair, the dense-path cold and refresh passes — which synthetic blocks cannot reproduce: their tokens never change
between passes, so no row is ever opened (on `code-masked` the synthetic table priced real hot passes 24–29% low,
SIMULATOR.md "On the bundled code model"). A (rows, fresh_frac) cell that no decode pass lands in (a Native decode
rarely has fewer than a quarter of its rows fresh) is filled from synthetic blocks (`synthetic_passes`: decoded share
0 … 7/8, cold, hot and refresh passes), as the table was before; `Profile.meta["epoch_moe_cells"]` counts both.
`epoch_call_denoise` stays on the synthetic blocks (the call's fixed cost does not depend on the routing).
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from dblock.profiling.measure import TimedForward

FRACS = [0.125, 0.25, 0.5, 0.75, 1.0]
DECODE_BLOCKS = 3                     # blocks decoded per request in a calibration decode
PROMPTS_START = 1000                  # the calibration decodes' first test problem (see decode_prompts)


def decode_prompts(model, n: int, gen) -> list:
    """`n` prompts (token ids) of the model's own task (the card's), test split from problem PROMPTS_START on --
    the card, `simulate validate`, the demo, the notebooks and BENCHMARKS.md decode the first few hundred, so the
    profile never times the runs it predicts (and the code task's test split lists in 2 s, its train split in 30)
    -- else random prompts of half a block."""
    import torch
    cfg = model.config
    src = getattr(model, "source", None)
    try:
        from dblock.tasks import get_task
        from dblock.tasks.card import read_card
        from dblock.tasks.evaluate import TokenizerAdapter
        card = read_card(src) if src else None
        if card and card.get("task"):
            tok = TokenizerAdapter.from_folder(src)
            return [tok.encode(e.prompt) for e in get_task(card["task"]).examples("test", n, start=PROMPTS_START)]
    except (OSError, ValueError, KeyError):
        pass
    V, mask = cfg.vocab_size, cfg.mask_token_id
    out = []
    for _ in range(n):
        t = torch.randint(0, V, (cfg.block_size // 2 + 1,), generator=gen)
        t[t == mask] = (mask + 1) % V
        out.append(t.tolist())
    return out


def decode_passes(prof, B: int, rounds: int, hot: Counter | None = None) -> list:
    """(fresh_frac, per-layer MoE seconds) of every denoising pass of `rounds` Native decodes of B requests with a
    fresh Epoch executor (its first pass, which allocates the cache arena, left out) whose B requests are all in
    flight with one block each (valid rows = B·C). The executors' `atlas_hot` counters are added to `hot`."""
    from dblock.decoding.generate import generate
    from dblock.decoding.params import DecodeConfig
    from dblock.optimized.executor import epoch_forward
    from dblock.tasks.card import decoding_of
    model, C = prof.model, prof.C
    n_moe = len(prof.cfg.moe_layers)
    try:
        card = decoding_of(getattr(model, "source", None) or prof.name)
    except (OSError, ValueError, KeyError):
        card = {}
    dec = DecodeConfig(max_new_tokens=DECODE_BLOCKS * C, seed=0, **card)
    prompts = decode_prompts(model, B, prof.gen)
    out = []
    for r in range(rounds):
        tf = _PassTimer(epoch_forward(model, "epoch"), timer=prof.timer)
        generate(tf, prompts, dataclasses.replace(dec, seed=r), "native", batch_size=B)
        if hot is not None:
            hot.update(tf.fwd.atlas_hot)
        for k, (shape, dt, share) in enumerate(tf.passes):
            if k == 0 or shape.valid_rows != B * C or shape.segments != 1:
                continue
            out.append((shape.fresh_frac, dt * share / n_moe))
    return out


class _PassTimer(TimedForward):
    """`TimedForward` that also keeps each pass's MoE share (the executor's moe_s / executor_s) in `passes`."""

    def reset(self) -> None:
        super().reset()
        self.passes: list = []         # (CallShape, seconds, MoE share)

    def denoise(self, items):
        res = super().denoise(items)
        st = self.fwd.last_pass_stats()
        shape, dt = self.calls[-1]
        self.passes.append((shape, dt, st["moe_s"] / st["executor_s"] if st.get("executor_s") else 0.0))
        return res


def synthetic_passes(prof, B: int, hot: Counter | None = None):
    """Epoch passes over the life of synthetic blocks of B requests: ({fresh column: [per-layer MoE s]} of the
    one-segment blocks, {segments: [call residual s]} of half-decoded blocks) (the profile's method before
    `decode_passes`; its residual is the whole pass minus the operators at the call's shapes). The executors'
    `atlas_hot` counters are added to `hot`."""
    from dblock.optimized.executor import epoch_forward
    C, n_moe = prof.C, len(prof.cfg.moe_layers)
    moe = {j: [] for j in range(len(FRACS))}
    call = {0: [], 1: []}
    M_C = 5
    for segments in (1, 2):
        for d in ([0.875, 0.75, 0.5, 0.25, 0.0] if segments == 1 else [0.5]):
            fwd = epoch_forward(prof.model, "epoch")
            items = prof._items(fwd, B, segments, d, warm_all_masked=True)
            live = [int(s.live.sum()) for it in items for s in it.segments]
            ctx = items[0].cache.length + segments * C
            other = prof._ops_fn(B, segments * C, ctx, live, with_moe=False)  # non-MoE operators at these shapes
            other()
            for p in range(max(2 * M_C, prof.repeats + 2)):
                t0 = prof.timer()
                fwd.denoise(items)
                dt = prof.timer() - t0
                t0 = prof.timer()
                other()
                t_other = prof.timer() - t0
                st = fwd.last_pass_stats()
                if p == 0 and segments == 1 and d == 0.0:
                    continue                 # the very first pass also allocates the cache arena
                share = st["moe_s"] / st["executor_s"] if st.get("executor_s") else 0.0
                m = dt * share / n_moe
                if segments == 1:
                    fr = st["fresh"] / max(1, B * C)
                    moe[int(np.argmin([abs(fr - f) for f in FRACS]))].append(m)
                    if d == 0.5:
                        call[0].append(dt - n_moe * m - t_other)
                else:
                    call[1].append(dt - n_moe * m - t_other)
            if hot is not None:
                hot.update(fwd.atlas_hot)
    return moe, call


def epoch_tables(prof) -> list:
    """epoch_moe(rows, fresh_frac) from decode passes (synthetic where none landed) and epoch_call_denoise(requests,
    segments) from synthetic blocks; `prof.cells` gets the per-source cell counts, `prof.atlas_hot` the executors'
    fail-closed counters per source."""
    from dblock.simulator.profile import OpTable
    if not prof.cfg.moe_layers:
        return []
    rows = [B * prof.C for B in prof.requests]
    em = np.zeros((len(rows), len(FRACS), prof.repeats))
    ec = np.zeros((len(prof.requests), 2, prof.repeats))
    cells = {"decode": 0, "synthetic": 0, "neighbour": 0}
    hot = {"decode": Counter(), "synthetic": Counter()}

    def pick(v):
        v = sorted(v)
        idx = np.linspace(0, len(v) - 1, prof.repeats).round().astype(int)
        return [v[k] for k in idx]                  # quantile-preserving subsample of the passes
    with prof.torch.no_grad():
        for i, B in enumerate(prof.requests):
            real = {j: [] for j in range(len(FRACS))}
            for fr, m in decode_passes(prof, B, rounds=2, hot=hot["decode"]):
                real[int(np.argmin([abs(fr - f) for f in FRACS]))].append(m)
            syn, call = synthetic_passes(prof, B, hot["synthetic"])
            for j in range(len(FRACS)):
                src = "decode" if real[j] else "synthetic" if syn[j] else None
                if src:
                    cells[src] += 1
                    em[i, j] = pick(real[j] or syn[j])
                else:
                    em[i, j] = np.nan
            for s in (0, 1):
                ec[i, s] = pick(call[s]) if call[s] else np.nan
            prof._tick(f"epoch requests {B}")
    for i in range(len(rows)):                      # a (rows, fraction) cell no pass landed in: its neighbour
        for j in range(len(FRACS)):
            if np.isnan(em[i, j]).any():
                k = min((k for k in range(len(FRACS)) if not np.isnan(em[i, k]).any()), key=lambda k: abs(k - j),
                        default=None)
                em[i, j] = em[i, k] if k is not None else 0.0
                cells["neighbour"] += 1
    prof.cells = cells
    prof.atlas_hot = {k: dict(v) for k, v in hot.items()}
    return [OpTable.from_samples("epoch_moe", ["rows", "fresh_frac"], [rows, FRACS], em, [True, True],
                                 per="MoE layer", note="Epoch MoE region of Native decode passes of the model's task "
                                 "(Atlas fail-closed, re-routing, repair included; synthetic blocks where no decode "
                                 "pass landed): the pass's thread time × the executor's moe_s/executor_s, per MoE "
                                 "layer"),
            OpTable.from_samples("epoch_call_denoise", ["requests", "segments"], [prof.requests, [1, 2]],
                                 np.nan_to_num(ec), [True, True], per="denoising call",
                                 note="whole Epoch call minus operators (synthetic blocks)")]
