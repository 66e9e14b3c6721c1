"""A Forward whose logits follow a script, to test schedules and counters by hand without a model."""
from types import SimpleNamespace

import torch

from dblock.forward import Forward


class Cache:
    def __init__(self):
        self.length = 0


class ScriptedForward(Forward):
    """script(position) -> (token, commit_at): a live row at `position` predicts `token` with confidence 0.99 from
    the block's `commit_at`-th pass on (1-based, counted per request and block), 0.5 before. Rows are otherwise
    equally likely, so "nothing clears tau" falls back to the most confident, lowest row."""

    name = "scripted"

    def __init__(self, script, vocab=16, mask_id=15, eos_id=14, block_size=4, family="llada2_moe"):
        self.script, self.V = script, vocab
        self.config = SimpleNamespace(family=family, mask_token_id=mask_id, eos_token_id=eos_id, vocab_size=vocab,
                                      block_size=block_size)
        self.passes = {}          # (request, block) -> denoise passes seen
        self.calls = []           # every call, for assertions on layouts
        self.ended = []

    def new_cache(self):
        return Cache()

    def append(self, items):
        self.calls.append(("append", items))
        for it in items:
            it.cache.length += sum(len(s) for s in it.segments)

    def denoise(self, items):
        self.calls.append(("denoise", items))
        out = []
        for it in items:
            per = []
            for s in it.segments:
                if s.role == "prefix":
                    per.append(torch.zeros(0, self.V))
                    continue
                key = (it.request, s.block)
                self.passes[key] = self.passes.get(key, 0) + 1
                rows = []
                for p in s.positions[s.live].tolist():
                    tok, at = self.script(p)
                    conf = 0.99 if self.passes[key] >= at else 0.5 - 0.001 * p
                    z = torch.full((self.V,), float(torch.log(torch.tensor((1 - conf) / (self.V - 2)))))
                    z[tok] = float(torch.log(torch.tensor(conf)))
                    rows.append(z)
                per.append(torch.stack(rows) if rows else torch.zeros(0, self.V))
            out.append(per)
        return out

    def end_block(self, request, block):
        self.ended.append((request, block))
