"""Where a request's output ends (docs/algorithms.md §2.6): EOS, stop token ids, stop sequences, min_tokens,
ignore_eos and the budget, checked on committed tokens in order. Torch-free.

Blocks commit in order, so the output is scanned once, block by block, as it commits (`Stopper.feed`). The first
stop ends the output: the stopping token (EOS or a stop id) or the whole stop sequence is kept, every later token is
dropped, and the request finishes after that block (blocks in flight are dropped, as at EOS). A stop sequence may
span blocks; its earlier part was already reported as output (a streaming text layer that hides stop strings holds
back text that could begin one).
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

from dblock.decoding.params import SamplingParams

StopReason = Optional[Union[int, tuple]]


def banned_ids(eos_ids: Iterable[int], sampling: SamplingParams) -> tuple:
    """Ids suppressed on the first `min_tokens` generated positions: the stop ids, and EOS unless ignore_eos."""
    ids = list(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        ids += [int(t) for t in eos_ids]
    return tuple(sorted(set(ids)))


class Stopper:
    """Scan committed output tokens for the first stop.

    `out` holds the valid output so far; `reason` is None while running, then the stopping token id (EOS or a stop
    id) or the stop sequence (a tuple). A stop counts only at output index >= min_tokens (index of its last token).
    """

    def __init__(self, eos_ids: Iterable[int], sampling: SamplingParams):
        self.stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self.stop_ids |= {int(t) for t in eos_ids}
        self.seqs = [s for s in sampling.stop]
        self.min_tokens = sampling.min_tokens
        self.out: list = []
        self.reason: StopReason = None

    @property
    def stopped(self) -> bool:
        return self.reason is not None

    def feed(self, tokens: Iterable[int]) -> int:
        """Append committed tokens (already cut to the budget) until the first stop; returns how many were kept."""
        n0 = len(self.out)
        for t in tokens:
            if self.reason is not None:
                break
            t = int(t)
            self.out.append(t)
            i = len(self.out) - 1
            if i < self.min_tokens:
                continue
            if t in self.stop_ids:
                self.reason = t
                break
            for s in self.seqs:
                if len(s) <= len(self.out) and s[-1] == t and tuple(self.out[-len(s):]) == s:
                    self.reason = s
                    break
        return len(self.out) - n0
