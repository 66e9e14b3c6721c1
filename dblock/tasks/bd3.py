"""The BD3-LM training mask: one forward over [x_t ; x_0] trains every block of a sequence at once.

Used by training (`dblock.tasks.train_loss`) and by the held-out loss (`dblock.tasks.code_eval`).
"""
from __future__ import annotations

import torch


def bd3_mask(L: int, C: int) -> torch.Tensor:
    """(2L, 2L) bool attention mask over [x_t ; x_0] (rows = queries, cols = keys), blocks of C on positions 0..L-1.

    allowed(q, k) = (same half and same block)
                  | (q noisy, k clean, block(k) <  block(q))
                  | (q clean, k clean, block(k) <= block(q))
    Worked example, L = 4, C = 2 (n = noisy, c = clean; blocks n0 n0 n1 n1 | c0 c0 c1 c1):
        n0: 1 1 0 0 | 0 0 0 0      n1: 0 0 1 1 | 1 1 0 0
        c0: 0 0 0 0 | 1 1 0 0      c1: 0 0 0 0 | 1 1 1 1
    """
    if L % C:
        raise ValueError(f"sequence length {L} is not a multiple of the block size {C}")
    idx = torch.arange(2 * L)
    half = idx // L                                   # 0 noisy, 1 clean
    blk = (idx % L) // C
    hq, hk = half[:, None], half[None, :]
    bq, bk = blk[:, None], blk[None, :]
    same = (hq == hk) & (bq == bk)
    noisy_to_clean = (hq == 0) & (hk == 1) & (bk < bq)
    clean_to_clean = (hq == 1) & (hk == 1) & (bk <= bq)
    return same | noisy_to_clean | clean_to_clean
