"""The Forward protocol: the one seam between schedules (block lifecycles, samplers) and executors (model math).

A schedule describes, per request, which positions go through the model on this call and who may attend to whom;
the executor returns logits for the rows that feed a decision. Schedules and samplers are written once, so a
difference between executors is always a difference of forward math.

Attention layout. Each request's call holds a read-only committed KV cache (every query sees all of it) and a list
of *segments*: contiguous runs of positions, normally one diffusion block each (the current block, a warm-up block,
FlowBlock's in-flight blocks, or — on the no-cache path — the committed prefix blocks recomputed every pass).
``visibility[i, j]`` says whether queries of segment i see keys of segment j; inside a segment attention is
bidirectional (LLaDA) — except where the model defines otherwise (DiffusionGemma's encoder is causal).

Examples (C = block size; `cache` = committed prefix):
  Native, KV cache:     segments [current]                      visibility [[1]]
  Native, no cache:     [prefix block 0, ..., prefix block b-1, current]  lower-triangular (block-causal)
  OBA paired pass:      [current, warm-up]                      [[1, 0], [1, 1]]
  OBA Dense Mask:       [current, warm-up]                      [[1, 1], [1, 1]]
  FlowBlock(W=3):       [b, b+1, b+2]                            lower-triangular
  llada_moe full seq:   [the whole sequence]                    [[1]]   (no cache, nothing appended)

Two calls:
  ``append(items)``  writes the K/V of every segment's positions into each request's cache (prompt prefill, and the
                     one append pass per committed block); returns nothing.
  ``denoise(items)`` reads the cache, writes nothing, returns for every segment the fp32 logits of its ``live``
                     rows, shape (n_live, V), in row order. Rows that are not live feed no decision, so an executor
                     may skip their LM head (the optimized executor does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class Segment:
    """One contiguous run of positions of one request in one call."""

    block: int                      # block index on the request's block grid (prefix blocks too)
    tokens: torch.Tensor            # (L,) int64 token ids (MASK where masked diffusion has not decoded)
    positions: torch.Tensor         # (L,) int64 absolute positions (RoPE and the block grid)
    live: torch.Tensor              # (L,) bool: rows whose logits are returned (they feed a decode decision)
    decoded: torch.Tensor           # (L,) bool: rows already fixed (prompt tail, committed-in-block). LSP hint.
    role: str = "current"           # "current" | "warmup" | "inflight" | "prefix" (for traces and plans)
    sc_logits: Optional[torch.Tensor] = None  # (L, V) self-conditioning input (uniform-state models); None = zeros
    sc_enabled: bool = True         # False: run without self-conditioning (OBA "no_signal" ablation)
    decision: Any = None            # what the block's step decides from these logits (`dblock.decoding.radius.
                                    # DecisionSpec`, set by the schedule): an executor may gate on its decision
                                    # radius (Epoch's margin-gated refresh); None = unknown

    def __post_init__(self):
        L = self.tokens.shape[0]
        for name in ("positions", "live", "decoded"):
            t = getattr(self, name)
            if t.shape != (L,):
                raise ValueError(f"Segment.{name}: shape {tuple(t.shape)} != tokens shape ({L},)")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class StepInput:
    """One request's share of a forward call."""

    request: Any                    # request id, stable across calls (keys plans and caches in the executor)
    segments: list[Segment]
    visibility: torch.Tensor        # (S, S) bool: visibility[i, j] = queries of segment i see keys of segment j
    cache: Any                      # the executor's KV-cache handle for this request (from new_cache())
    pass_index: int = 0             # denoising passes this request's current block has taken before this call
    meta: dict = field(default_factory=dict)  # schedule notes for traces (e.g. {"schedule": "oba"})

    def __post_init__(self):
        S = len(self.segments)
        if tuple(self.visibility.shape) != (S, S):
            raise ValueError(f"StepInput.visibility: shape {tuple(self.visibility.shape)} != ({S}, {S})")


def block_causal(n: int) -> torch.Tensor:
    """(n, n) lower-triangular visibility: segment i sees segments 0..i."""
    return torch.tril(torch.ones(n, n, dtype=torch.bool))


def dense(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool)


class Forward:
    """Base class of executors. Subclasses implement `new_cache`, `append` and `denoise`."""

    #: model config (ModelConfig or GemmaConfig)
    config: Any
    name: str = "forward"

    def new_cache(self) -> Any:
        raise NotImplementedError

    def append(self, items: list[StepInput]) -> None:
        raise NotImplementedError

    def denoise(self, items: list[StepInput]) -> list[list[torch.Tensor]]:
        raise NotImplementedError

    def end_block(self, request: Any, block: int) -> None:
        """The schedule committed (or dropped) `block` of `request`: per-block state may be destroyed."""

    def end_request(self, request: Any) -> None:
        """The request finished: drop everything kept for it."""

    def stats(self) -> dict:
        """Executor counters for traces and reports (empty for the reference)."""
        return {}
