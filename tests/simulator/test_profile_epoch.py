"""The profile's Epoch MoE table follows the executor on a real decode (dblock/profiling/profiler_epoch.py): its
calibration decodes exercise the Expert Atlas's per-token fail-closed where synthetic blocks barely do, and the
table prices decode passes wherever one landed (synthetic blocks only elsewhere). No timing is asserted."""
from collections import Counter

import numpy as np
import pytest

from dblock.profiling import profiler_epoch


def _profiler():
    from dblock.profiling.profiler import Profiler
    from dblock.tiny import make_tiny_model
    # 64 experts top-8, blocks of 16: the Atlas restricts routing (B = 32 < E), as on code-masked
    m = make_tiny_model("llada2_moe", seed=0, block_size=16, num_experts=64, num_experts_per_tok=8)
    return Profiler(m, name="tiny", repeats=2, max_rows_blocks=2, max_requests=2, context_blocks=2,
                    min_sample_s=0.0)


def test_decode_passes_carry_the_atlas_fail_closed_that_synthetic_blocks_miss():
    prof = _profiler()
    dec, syn = Counter(), Counter()
    passes = profiler_epoch.decode_passes(prof, 2, rounds=1, hot=dec)
    profiler_epoch.synthetic_passes(prof, 2, syn)
    assert passes and all(0 < f <= 1 and m >= 0 for f, m in passes)
    assert dec["rows"] > 0 and syn["rows"] > 0          # both route hot rows within a support
    # rows decoded between passes want experts the support never saw: opened far more often on a real decode
    assert dec["under"] / dec["rows"] > 4 * syn["under"] / syn["rows"]
    assert dec["repaired_experts"] > 0


def test_the_table_prices_decode_passes_and_synthetic_blocks_only_where_none_landed(monkeypatch):
    prof = _profiler()
    C, n_moe = prof.C, len(prof.cfg.moe_layers)
    real = {0.5: 3e-3, 0.75: 4e-3, 1.0: 5e-3}           # decode passes: no pass with under half its rows fresh

    def decode(p, B, rounds, hot=None):
        hot.update(rows=10 * B, under=3 * B)
        return [(f + 0.01 * k, B * v) for f, v in real.items() for k in range(3)]

    def synthetic(p, B, hot=None):
        hot.update(rows=10 * B, under=0)
        return ({j: [B * 1e-3 * (1 + f)] for j, f in enumerate(profiler_epoch.FRACS)},
                {0: [1e-4 * B], 1: [2e-4 * B]})
    monkeypatch.setattr(profiler_epoch, "decode_passes", decode)
    monkeypatch.setattr(profiler_epoch, "synthetic_passes", synthetic)
    tables = {t.name: t for t in prof.epoch()}
    em = tables["epoch_moe"]
    assert em.grid == [[C * B for B in prof.requests], profiler_epoch.FRACS]
    assert prof.cells == {"decode": 3 * len(prof.requests), "synthetic": 2 * len(prof.requests), "neighbour": 0}
    assert prof.atlas_hot["decode"]["under"] > 0 == prof.atlas_hot["synthetic"]["under"]
    for B in prof.requests:
        for f in profiler_epoch.FRACS:
            want = B * real[f] if f in real else B * 1e-3 * (1 + f)
            # the median of the cell's passes per MoE layer (a monotone table: no running maximum bites)
            assert em(B * C, f, q="median") == pytest.approx(want)
    assert np.all(em.lo <= em.median) and np.all(em.median <= em.hi)
