"""The reference executor of DiffusionGemma: `GemmaReference` (a Forward) over a `GemmaModel`, with the batching
and the per-layer-type attention masks it needs.

Sliding windows (transformers' DynamicSlidingWindowLayer + its masks, in absolute positions). A sliding layer's cache
keeps only the last `sliding_window - 1` positions. Encoder query q sees key k iff k <= q and q - k < W. The
transformers decoder applies no window mask of its own: the canvas sees whatever the sliding cache holds (the last
W-1 positions) plus the whole canvas. Written as a rule on positions: a decoder query of a segment starting at s sees
key k iff s - k < W. Decision where transformers is silent (several segments in one denoising pass, for OBA /
FlowBlock): every segment anchors its window at its own first position, so a warm-up block sees exactly the keys
it will see once it is current (the W-1 positions before its start), and in-flight segments follow `visibility`.

Letter legend for shapes: B batch, L query rows, S key rows (cache + new), Sc cached keys, G kv heads, D head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dblock.forward import Forward, StepInput
from dblock.reference.gemma import GemmaCache, GemmaModel
from dblock.gemma_config import SLIDING


@dataclass
class GemmaBatch:
    """A padded batch of StepInputs. Rows of request b: [its segments' rows ; padding]."""

    tokens: torch.Tensor       # (B, L) int64
    positions: torch.Tensor    # (B, L) int64 absolute positions
    anchor: torch.Tensor       # (B, L) int64: where each row's sliding window is measured from
    new_vis: torch.Tensor      # (B, L, L) bool: row q may see new row r (segments, causality; padding sees itself)
    lens: list                 # rows per request


def build_batch(items: list[StepInput], device, encoder: bool) -> GemmaBatch:
    """Encoder (append): causal inside the run (r visible iff pos r <= pos q and visibility allows), anchor = the
    query's own position. Decoder (denoise): `visibility` between segments, full inside a segment, anchor = the
    first position of the query's segment (see the module docstring)."""
    B = len(items)
    lens = [sum(len(s) for s in it.segments) for it in items]
    L = max(lens)
    tokens = torch.zeros(B, L, dtype=torch.long, device=device)
    positions = torch.zeros(B, L, dtype=torch.long, device=device)
    anchor = torch.zeros(B, L, dtype=torch.long, device=device)
    new_vis = torch.zeros(B, L, L, dtype=torch.bool, device=device)
    for b, it in enumerate(items):
        n = lens[b]
        seg_id = torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(it.segments)])
        pos = torch.cat([s.positions for s in it.segments]).to(torch.long)
        tokens[b, :n] = torch.cat([s.tokens for s in it.segments]).to(device)
        positions[b, :n] = pos.to(device)
        vis = it.visibility.to(torch.bool)[seg_id[:, None], seg_id[None, :]]             # (n, n)
        if encoder:
            vis = vis & (pos[None, :] <= pos[:, None])
            anchor[b, :n] = pos.to(device)
        else:
            starts = torch.stack([s.positions.min() if len(s) else torch.tensor(0) for s in it.segments])
            anchor[b, :n] = starts[seg_id].to(device)
        new_vis[b, :n, :n] = vis.to(device)
        pad = torch.arange(n, L, device=device)
        new_vis[b, pad, pad] = True                     # padded rows see only themselves (no NaN), change nothing
    return GemmaBatch(tokens, positions, anchor, new_vis, lens)


def stack_past(items: list[StepInput], layer: int, ref: torch.Tensor):
    """One layer's caches, zero-padded: k, v (B, G, Sc, D), key positions (B, Sc), key valid (B, Sc)."""
    n = [0 if it.cache is None or it.cache.k[layer] is None else it.cache.k[layer].shape[1] for it in items]
    Sc = max(n)
    B = len(items)
    kpos = torch.zeros(B, Sc, dtype=torch.long, device=ref.device)
    kvalid = torch.zeros(B, Sc, dtype=torch.bool, device=ref.device)
    if Sc == 0:
        return None, None, kpos, kvalid
    ks, vs = [], []
    for b, it in enumerate(items):
        if n[b] == 0:
            k0 = next(i.cache.k[layer] for i in items if i.cache is not None and i.cache.k[layer] is not None)
            k = v = k0.new_zeros(k0.shape[0], 0, k0.shape[2])
        else:
            k, v = it.cache.k[layer], it.cache.v[layer]
            kpos[b, :n[b]] = it.cache.pos[layer].to(ref.device)
            kvalid[b, :n[b]] = True
        ks.append(F.pad(k, (0, 0, 0, Sc - n[b])))
        vs.append(F.pad(v, (0, 0, 0, Sc - n[b])))
    return torch.stack(ks), torch.stack(vs), kpos, kvalid


def append_to_caches(items: list[StepInput], batch: GemmaBatch, new_kv) -> None:
    """Commit an encoder call's keys and values (`new_kv`: per layer (k, v) over the batch) to each item's cache."""
    for b, it in enumerate(items):
        n = batch.lens[b]
        pos = batch.positions[b, :n]
        for layer, (k, v) in enumerate(new_kv):
            it.cache.append(layer, k[b, :, :n], v[b, :, :n], pos)
        it.cache.length += n


def layer_mask(batch: GemmaBatch, kpos, kvalid, sliding: bool, window: int) -> torch.Tensor:
    """(B, L, Sc + L) bool over keys [cache ; new rows] for one layer type.

    Worked example, W = 3, one request whose cache holds positions 0..4 (full layers: 0..4; sliding layers keep
    the last W-1 = 2: 3, 4).
      encoder, appending 5..8 (anchor = own position, causal):
        full     q5: 0..5          q8: 0..8
        sliding  q5: 3, 4, 5       q8: 6, 7, 8          (q - k < 3)
      decoder, segments current 5..6 and warm-up 7..8, visibility [[1, 0], [1, 1]] (anchor = segment start):
        full     q5, q6: 0..4, 5, 6      q7, q8: 0..4, 5..8
        sliding  q5, q6: 3, 4, 5, 6      q7, q8: 5..8   (7 - 4 = 3: position 4 is out of the warm-up's window)
    """
    cache = kvalid[:, None, :].expand(-1, batch.tokens.shape[1], -1)                     # (B, L, Sc)
    new = batch.new_vis                                                                   # (B, L, L)
    if sliding:
        cache = cache & (batch.anchor[:, :, None] - kpos[:, None, :] < window)
        new = new & (batch.anchor[:, :, None] - batch.positions[:, None, :] < window)
    return torch.cat([cache, new], dim=-1)


class GemmaReference(Forward):
    """Dense reference executor over a GemmaModel: `append` runs the causal encoder and writes the caches,
    `denoise` runs the decoder over the in-flight segments and returns fp32 soft-capped logits of live rows.

    Batching: requests are padded to the longest query run and, per layer, to the longest cache; the masks keep
    every request's rows apart, so a request's logits do not depend on what else is in the call.
    """

    name = "reference"

    def __init__(self, model: GemmaModel):
        self.model = model
        self.config = model.config

    @property
    def device(self):
        return self.model.embed_tokens.weight.device

    def new_cache(self) -> GemmaCache:
        return GemmaCache(self.config)

    def _check_prompts(self, items: list[StepInput]) -> None:
        """Refuse image placeholders in a prompt (the first append to an empty cache), before any compute.
        Canvases and committed blocks may hold any id: the model can sample the placeholder, and transformers
        then embeds it as a plain token, as we do."""
        img = self.config.image_token_id
        for it in items:
            if img is None or it.cache is None or it.cache.length > 0:
                continue
            for s in it.segments:
                if bool((s.tokens == img).any()):
                    raise ValueError(f"request {it.request!r}: prompt token {img} is DiffusionGemma's image "
                                     "placeholder; image inputs are not supported by dblock (text-only prompts)")

    def _masks_and_past(self, items, batch: GemmaBatch):
        cfg = self.config
        ref = self.model.embed_tokens.weight
        past, masks = [], {}
        for i in range(cfg.num_hidden_layers):
            k, v, kpos, kvalid = stack_past(items, i, ref)
            past.append((k, v))
            t = cfg.layer_types[i]
            if t not in masks:  # every layer of a type holds the same positions
                masks[t] = layer_mask(batch, kpos, kvalid, t == SLIDING, cfg.sliding_window)
        return past, masks

    @torch.no_grad()
    def append(self, items: list[StepInput]) -> None:
        self._check_prompts(items)
        batch = build_batch(items, self.device, encoder=True)
        past, masks = self._masks_and_past(items, batch)
        append_to_caches(items, batch, self.model.encode(batch.tokens, batch.positions, masks, past))

    @torch.no_grad()
    def hidden(self, items: list[StepInput], taps=None):
        """Decoder final hidden states (B, L, H) (before the final norm) and the row counts."""
        batch = build_batch(items, self.device, encoder=False)
        past, masks = self._masks_and_past(items, batch)
        m = self.model
        soft = torch.zeros(*batch.tokens.shape, self.config.hidden_size, dtype=m.embed_tokens.weight.dtype,
                           device=self.device)                                           # (B, L, H)
        for b, it in enumerate(items):
            off = 0
            for s in it.segments:
                if s.sc_enabled and s.sc_logits is not None:
                    soft[b, off:off + len(s)] = m.soft_embed(s.sc_logits.to(self.device))
                off += len(s)
        return m.decode(batch.tokens, batch.positions, masks, past, soft, taps), batch.lens

    @torch.no_grad()
    def denoise(self, items: list[StepInput], taps=None) -> list[list[torch.Tensor]]:
        hidden, _ = self.hidden(items, taps)
        out = []
        for b, it in enumerate(items):
            per_seg, off = [], 0
            for s in it.segments:
                rows = hidden[b, off:off + len(s)][s.live.to(hidden.device)]
                per_seg.append(self.model.logits(rows))
                off += len(s)
            out.append(per_seg)
        return out
