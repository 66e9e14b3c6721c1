"""The reference Forward for the LLaDA families: batched, padded, exact prefix KV cache, dense MoE.

Batching: every request of a call is padded to the longest query run (L) and the longest cache (Lc); the mask
hides padding, so a request's rows never see another request's and padded rows change nothing that is returned.
"""
from __future__ import annotations

import torch

from dblock.forward import Forward, StepInput
from dblock.reference.llada import LladaModel


class KVCache:
    """Committed prefix of one request: per layer k, v of shape (G, Lc, D), in position order 0..Lc-1."""

    def __init__(self, n_layers: int):
        self.k: list = [None] * n_layers
        self.v: list = [None] * n_layers
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=1)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


def build_layout(items: list[StepInput], device):
    """Pad a batch of StepInputs: tokens/positions (B, L), mask (B, L, Lc + L), valid (B, L), row offsets.

    Keys are [cache padded to Lc_max ; new rows padded to L_max]. Query row q of request b sees cache key j iff
    j < Lc_b, and new key r iff visibility[seg(q), seg(r)]. Padded query rows see only themselves (no NaN).
    """
    B = len(items)
    lens = [sum(len(s) for s in it.segments) for it in items]
    cache_lens = [it.cache.length if it.cache is not None else 0 for it in items]
    L, Lc = max(lens), max(cache_lens)
    tokens = torch.zeros(B, L, dtype=torch.long, device=device)
    positions = torch.zeros(B, L, dtype=torch.long, device=device)
    valid = torch.zeros(B, L, dtype=torch.bool, device=device)
    mask = torch.zeros(B, L, Lc + L, dtype=torch.bool, device=device)
    for b, it in enumerate(items):
        seg_id = torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(it.segments)])
        n = lens[b]
        tokens[b, :n] = torch.cat([s.tokens for s in it.segments]).to(device)
        positions[b, :n] = torch.cat([s.positions for s in it.segments]).to(device)
        valid[b, :n] = True
        mask[b, :n, :cache_lens[b]] = True
        vis = it.visibility.to(torch.bool)
        mask[b, :n, Lc:Lc + n] = vis[seg_id[:, None], seg_id[None, :]].to(device)
        pad = torch.arange(n, L, device=device)
        mask[b, pad, Lc + pad] = True
    return tokens, positions, mask, valid, lens, cache_lens


def stack_past(items: list[StepInput], n_layers: int, Lc: int):
    """Per layer (k, v) of shape (B, G, Lc, D), zero-padded; None when no request has a cache."""
    if Lc == 0:
        return None
    past = []
    for layer in range(n_layers):
        ks, vs = [], []
        for it in items:
            k, v = it.cache.k[layer], it.cache.v[layer]
            n = 0 if k is None else k.shape[1]
            if k is None:  # a request with an empty cache in a batch with others: all padding
                ref = next(i.cache.k[layer] for i in items if i.cache.k[layer] is not None)
                k = v = ref.new_zeros(ref.shape[0], 0, ref.shape[2])
            pad = Lc - n
            ks.append(torch.nn.functional.pad(k, (0, 0, 0, pad)))
            vs.append(torch.nn.functional.pad(v, (0, 0, 0, pad)))
        past.append((torch.stack(ks), torch.stack(vs)))
    return past


class PastStack:
    """A call's committed caches stacked for the batch, kept while the same caches come back at the same lengths: the
    passes of one block append nothing, so they share one stacking. `get(items, make)` returns the kept stacking or
    `make()`'s; `kept` says which. The key holds the cache objects themselves (compared by identity, kept alive by
    the key), never their ids. Both families' executors use it (the stacking itself is the family's)."""

    def __init__(self):
        self.key: list = []
        self.past = None
        self.kept = False

    def get(self, items: list[StepInput], make):
        key = [(it.cache, it.cache.length if it.cache is not None else 0) for it in items]
        self.kept = self.past is not None and len(key) == len(self.key) and all(
            a is c and n == m for (a, n), (c, m) in zip(key, self.key))
        if not self.kept:
            self.past, self.key = make(), key
        return self.past


class LladaReference(Forward):
    """Dense reference executor over a LladaModel."""

    name = "reference"

    def __init__(self, model: LladaModel):
        self.model = model
        self.config = model.config
        self.past_stack = PastStack()           # shared with the Epoch executor that runs over this reference

    @property
    def device(self):
        return self.model.embed.weight.device

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_hidden_layers)

    @torch.no_grad()
    def _run(self, items: list[StepInput], taps=None):
        tokens, positions, mask, valid, lens, cache_lens = build_layout(items, self.device)
        n, Lc = self.config.num_hidden_layers, mask.shape[2] - tokens.shape[1]
        past = self.past_stack.get(items, lambda: stack_past(items, n, Lc))
        hidden, new_kv = self.model(tokens, positions, mask, past, taps)
        return hidden, new_kv, lens

    @torch.no_grad()
    def append(self, items: list[StepInput]) -> None:
        _, new_kv, lens = self._run(items)
        for b, it in enumerate(items):
            for layer, (k, v) in enumerate(new_kv):
                it.cache.append(layer, k[b, :, :lens[b]], v[b, :, :lens[b]])
            it.cache.length += lens[b]

    @torch.no_grad()
    def denoise(self, items: list[StepInput], taps=None) -> list[list[torch.Tensor]]:
        hidden, _, lens = self._run(items, taps)
        out = []
        for b, it in enumerate(items):
            per_seg, off = [], 0
            for s in it.segments:
                rows = hidden[b, off:off + len(s)][s.live.to(hidden.device)]
                per_seg.append(self.model.logits(rows))
                off += len(s)
            out.append(per_seg)
        return out
