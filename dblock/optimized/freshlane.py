"""FreshLane (docs/algorithms.md §4.4): only fresh (token, expert) pairs move through the MoE region.

compact -> route -> dispatch -> grouped expert MLP -> combine -> scatter/merge. The compact layout never leaves
this region: the caller hands in the fresh rows' normed hidden states (F, H) and gets their routed-expert outputs
(F, H) back, and scatters them into the full shard itself.

Wire layout (the dispatcher contract; `dblock.optimized.ep` implements it with torch.distributed): one row per
(fresh token, destination rank) carrying the hidden state, with the token's K expert ids made rank-local (-1 for
experts on other ranks) and its K routing weights. The receiving rank runs its experts on the rows, applies the
routing weights, and sums over its own slots; `combine` returns one partial sum per (token, rank) and the owner
adds them up (DeepEP's convention: combine itself is an unweighted sum). With one rank this is the identity.

Letter legend: F fresh rows, K experts per token, P (row, slot) pairs, E experts, H hidden, I expert width,
X rows of one expert.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F_


def sort_by_expert(ids_FK: torch.Tensor, num_experts: Optional[int] = None):
    """Valid (row, slot) pairs grouped by expert, stable within an expert: one sort and one bincount for the whole
    worklist (no loop over experts).

    Returns row_P, slot_P (int64) and counts_E (int64; per expert id 0..E-1, E = `num_experts`, or the largest id
    present + 1 when it is None).
    Example: ids = [[2, 0], [0, -1], [2, 1], [1, 0]] (4 rows, K = 2, -1 = no expert)
      pairs in expert order: expert 0 <- (0,1) (1,0) (3,1); expert 1 <- (2,1) (3,0); expert 2 <- (0,0) (2,0)
      row_P = [0, 1, 3, 2, 3, 0, 2], slot_P = [1, 0, 1, 1, 0, 0, 0], counts = [3, 2, 2]
    """
    lay = expert_layout(ids_FK, num_experts)
    return lay.row_P, lay.slot_P, lay.counts_E


@dataclass
class ExpertLayout:
    """The (row, slot) pairs of a worklist grouped by expert: pair p is row `row_P[p]`, slot `slot_P[p]`; expert e
    owns the contiguous pairs [offsets[e], offsets[e] + counts[e]) (`offsets` = exclusive prefix sums)."""

    order_P: torch.Tensor       # flat (row * K + slot) index of each valid pair, in expert order
    row_P: torch.Tensor
    slot_P: torch.Tensor
    counts_E: torch.Tensor      # (E,) int64, on the ids' device
    counts: list                # the same on the host (one transfer per worklist)

    @property
    def P(self) -> int:
        return self.order_P.numel()


def expert_layout(ids_FK: torch.Tensor, num_experts: Optional[int] = None) -> ExpertLayout:
    """Group a worklist's valid (row, slot) pairs by expert with one stable sort: slots with id -1 get the key E and
    sort last, where they are cut off, so they load no weights and join no reduction. Example in `sort_by_expert`."""
    F, K = ids_FK.shape
    flat = ids_FK.reshape(-1)
    if num_experts is None:
        num_experts = int(flat.max()) + 1 if flat.numel() else 0
    E = num_experts
    key = flat.masked_fill(flat < 0, E)                       # -1 -> E: after every expert
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=E + 1)             # (E + 1,): the last bin counts the empty slots
    host = counts.tolist()
    P = F * K - host[E]
    order = order[:P]
    return ExpertLayout(order, order // K, order % K, counts[:E], host[:E])


def expert_groups(ids_FK: torch.Tensor, num_experts: Optional[int] = None):
    """(e, rows_X, slots_X) for every expert e with rows, in expert order (`expert_layout`): the loop runs over the
    non-empty experts only."""
    lay = expert_layout(ids_FK, num_experts)
    start = 0
    for e, n in enumerate(lay.counts):
        if n:
            yield e, lay.row_P[start:start + n], lay.slot_P[start:start + n]
            start += n


def swiglu(x_XH: torch.Tensor, w_gate_IH, w_up_IH, w_down_HI) -> torch.Tensor:
    """One expert's MLP: down(silu(gate x) · up x) -> (X, H)."""
    return F_.linear(F_.silu(F_.linear(x_XH, w_gate_IH)) * F_.linear(x_XH, w_up_IH), w_down_HI)


def _grouped_mm_fn():
    """`torch.nn.functional.grouped_mm` (or `torch._grouped_mm`) when this torch has one that runs here on CPU
    tensors, else None. Probed once with a two-group product against `torch.mm`."""
    fn = getattr(F_, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    try:
        a, b = torch.ones(3, 4), torch.ones(2, 4, 4)
        y = fn(a, b.transpose(1, 2), offs=torch.tensor([1, 3], dtype=torch.int32))
        if not torch.equal(y, a @ b[0]):
            return None
    except Exception:            # no CPU kernel in this build, or a changed signature: the per-expert loop
        return None
    return fn


GROUPED_MM = _grouped_mm_fn()


def _grouped_mm_ok(x: torch.Tensor, *ws: torch.Tensor) -> bool:
    """grouped_mm takes fp32/bf16/fp16 operands whose row strides are multiples of 16 bytes."""
    if GROUPED_MM is None or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.device.type != "cpu":
        return False
    el = x.element_size()
    return all(w.dtype == x.dtype and w.is_contiguous() and (w.shape[1] * el) % 16 == 0 and
               (w.shape[2] * el) % 16 == 0 for w in ws)


#: Bytes of pair buffers (gathered inputs, gate, up, product, outputs) one chunk of experts may fill. The pair-ordered
#: buffers of a whole worklist stream through memory several times; chunks of consecutive experts of a few MiB stay
#: in the per-core cache instead (measured on the 2-core Xeon of BENCHMARKS.md: 4 MiB chunks ran the mini-scaled
#: model's routed step 1.3x faster than the reference loop and 1.7x faster than one unchunked grouped pass).
CHUNK_BYTES = 4 << 20


def chunk_pairs(H: int, I: int, elem: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Pairs per chunk: the pair buffers of one chunk hold 2H + 3I elements per pair."""
    return max(1, chunk_bytes // ((2 * H + 3 * I) * elem))


def expert_chunks(counts: list, budget: int):
    """(e0, e1, p0, p1): consecutive experts [e0, e1) owning the pairs [p0, p1), at most `budget` pairs each unless
    one expert alone has more. Example: counts [3, 0, 2, 4], budget 5 -> (0, 3, 0, 5), (3, 4, 5, 9)."""
    E, e0, p0 = len(counts), 0, 0
    while e0 < E:
        e1, n = e0, 0
        while e1 < E and (n == 0 or n + counts[e1] <= budget):
            n += counts[e1]
            e1 += 1
        if n:
            yield e0, e1, p0, p0 + n
        e0, p0 = e1, p0 + n


def grouped_swiglu_torch(x_FH: torch.Tensor, ids_FK: torch.Tensor, w_FK: torch.Tensor, w_gate_EIH, w_up_EIH,
                         w_down_EHI, chunk_bytes: int = CHUNK_BYTES, grouped_mm: bool = True) -> torch.Tensor:
    """Σ_k w[f,k] · down_e(silu(gate_e x_f) · up_e x_f), e = ids[f,k]; slots with id -1 contribute nothing.

    Group the (row, slot) pairs by expert (`expert_layout`: one sort for the worklist), then per chunk of
    consecutive experts (`expert_chunks`, about `chunk_bytes` of pair buffers): gather the chunk's rows once, run
    the experts' MLPs over contiguous slices — one grouped GEMM per projection (`torch.nn.functional.grouped_mm`)
    where this torch has it for the dtype, else a loop over the chunk's non-empty experts — weight the pair outputs
    and add them into their rows with one `index_add_`. Each row accumulates its experts in ascending expert order
    in fp32 (fp64 for fp64 inputs), as the reference `MoE.routed` does; returns x's dtype.

    `grouped_mm=False` keeps the loop: the reference's own per-expert `linear` calls on the same rows, so the result
    is the reference's bit for bit (the dense path uses it: full_compute promises the reference's logits). The
    grouped GEMM is faster on short worklists but may round differently in the last bit for some shapes.
    """
    acc = torch.promote_types(x_FH.dtype, torch.float32)                 # fp32, or fp64 for fp64 references
    F, H = x_FH.shape
    if F == 0:
        return torch.zeros(x_FH.shape, dtype=x_FH.dtype, device=x_FH.device)
    E, I = w_gate_EIH.shape[0], w_gate_EIH.shape[1]
    lay = expert_layout(ids_FK, E)
    w_P = w_FK.reshape(-1)[lay.order_P]
    out_FH = torch.zeros((F, H), dtype=torch.promote_types(acc, w_P.dtype), device=x_FH.device)
    gmm = grouped_mm and _grouped_mm_ok(x_FH, w_gate_EIH, w_up_EIH, w_down_EHI)
    for e0, e1, p0, p1 in expert_chunks(lay.counts, chunk_pairs(H, I, x_FH.element_size(), chunk_bytes)):
        rows_X = lay.row_P[p0:p1]
        x_XH = x_FH.index_select(0, rows_X)                               # the chunk's rows in expert order
        if gmm and e1 - e0 > 1:
            offs, t = [], 0
            for n in lay.counts[e0:e1]:
                t += n
                offs.append(t)
            offs = torch.tensor(offs, dtype=torch.int32, device=x_FH.device)
            g_XI = GROUPED_MM(x_XH, w_gate_EIH[e0:e1].transpose(1, 2), offs=offs)
            u_XI = GROUPED_MM(x_XH, w_up_EIH[e0:e1].transpose(1, 2), offs=offs)
            y_XH = GROUPED_MM(F_.silu(g_XI).mul_(u_XI), w_down_EHI[e0:e1].transpose(1, 2), offs=offs)
        else:
            y_XH = x_XH.new_empty(p1 - p0, H)
            a = 0
            for e in range(e0, e1):
                n = lay.counts[e]
                if n:
                    y_XH[a:a + n] = swiglu(x_XH[a:a + n], w_gate_EIH[e], w_up_EIH[e], w_down_EHI[e])
                    a += n
        y_XH = y_XH.to(acc)
        y_XH = y_XH.mul_(w_P[p0:p1, None]) if w_P.dtype == acc else y_XH * w_P[p0:p1, None]
        out_FH.index_add_(0, rows_X, y_XH)
    return out_FH.to(x_FH.dtype)


def geglu(x_XH: torch.Tensor, w_gate_up_JH, w_down_HI) -> torch.Tensor:
    """One DiffusionGemma expert (J = 2I, fused [gate ; up]): down(gelu_tanh(gate x) · up x) -> (X, H), the
    reference's `Experts.expert` op for op."""
    gate, up = F_.linear(x_XH, w_gate_up_JH).chunk(2, dim=-1)
    return F_.linear(F_.gelu(gate, approximate="tanh") * up, w_down_HI)


#: Below this many multiply-adds for running *every* expert on every row (F·E·3·I·H), `grouped_geglu_torch` does
#: exactly that (two batched GEMMs over all experts and one weighted sum) instead of sorting the (row, expert) pairs:
#: about half the tensor ops, which is what a call this small costs (measured on the 2-core CPU of BENCHMARKS.md:
#: the bundled tiny-uniform's batch-1 pass, 16 rows of 8 experts, 3.1 M multiply-adds).
ALL_EXPERTS_MACS = 1 << 22


def all_experts_geglu(x_FH: torch.Tensor, ids_FK: torch.Tensor, w_FK: torch.Tensor, w_gate_up_EJH, w_down_EHI):
    """Σ_k w[f,k] · Expert_{ids[f,k]}(x_f) by running every expert on every row (the weights of the experts a row
    did not choose are 0; a -1 slot must carry weight 0): one batched GEMM per projection over all E experts, then
    the per-row weighted sum over experts -> (F, H) in x's dtype."""
    E = w_gate_up_EJH.shape[0]
    W_FE = torch.zeros(x_FH.shape[0], E, dtype=w_FK.dtype, device=x_FH.device).scatter_add_(
        1, ids_FK.clamp(min=0), w_FK)
    gate, up = torch.matmul(x_FH, w_gate_up_EJH.transpose(1, 2)).chunk(2, dim=-1)      # (E, F, I) each
    y_EFH = torch.matmul(F_.gelu(gate, approximate="tanh") * up, w_down_EHI.transpose(1, 2))
    return (y_EFH * W_FE.t().unsqueeze(-1)).sum(0).to(x_FH.dtype)


def grouped_geglu_torch(x_FH: torch.Tensor, ids_FK: torch.Tensor, w_FK: torch.Tensor, w_gate_up_EJH, w_down_EHI,
                        chunk_bytes: int = CHUNK_BYTES, grouped_mm: bool = True) -> torch.Tensor:
    """DiffusionGemma's routed experts over a whole worklist: Σ_k w[f,k] · down_e(gelu_tanh(gate_e x_f) · up_e x_f),
    e = ids[f,k], with the fused (E, 2I, H) gate_up weights as stored; slots with id -1 contribute nothing.

    The same grouping as `grouped_swiglu_torch` (one sort for the worklist, chunks of consecutive experts): per
    chunk two grouped GEMMs (gate_up, down) where this torch has `grouped_mm` for the dtype and `grouped_mm` is on,
    else the reference's per-expert `linear` calls (`geglu`). Rows accumulate their experts in ascending expert order
    in x's dtype, as the reference `Experts.forward` does. A call so small that running every expert on every row
    costs less than the grouping's own tensor ops (`ALL_EXPERTS_MACS`) runs `all_experts_geglu` instead (where the
    grouped GEMM would run). Returns x's dtype."""
    F, H = x_FH.shape
    E, I, K = w_gate_up_EJH.shape[0], w_down_EHI.shape[2], ids_FK.shape[1]
    gmm = grouped_mm and _grouped_mm_ok(x_FH, w_gate_up_EJH, w_down_EHI)
    if gmm and 0 < F * E * 3 * I * H <= ALL_EXPERTS_MACS:
        return all_experts_geglu(x_FH, ids_FK, w_FK, w_gate_up_EJH, w_down_EHI)
    out_FH = torch.zeros((F, H), dtype=x_FH.dtype, device=x_FH.device)
    if F == 0:
        return out_FH
    key = ids_FK.reshape(-1) + 1                               # -1 (no expert) -> 0: sorts first, cut off below
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=E + 1).tolist()
    order = order[counts[0]:]
    counts = counts[1:]
    row_P, w_P = order // K, w_FK.reshape(-1)[order]
    for e0, e1, p0, p1 in expert_chunks(counts, chunk_pairs(H, I, x_FH.element_size(), chunk_bytes)):
        rows_X = row_P[p0:p1]
        x_XH = x_FH.index_select(0, rows_X)                               # the chunk's rows in expert order
        if gmm and e1 - e0 > 1:
            offs, t = [], 0
            for n in counts[e0:e1]:
                t += n
                offs.append(t)
            offs = torch.tensor(offs, dtype=torch.int32, device=x_FH.device)
            gate, up = GROUPED_MM(x_XH, w_gate_up_EJH[e0:e1].transpose(1, 2), offs=offs).chunk(2, dim=-1)
            y_XH = GROUPED_MM(F_.gelu(gate, approximate="tanh") * up, w_down_EHI[e0:e1].transpose(1, 2), offs=offs)
        else:
            y_XH = x_XH.new_empty(p1 - p0, H)
            a = 0
            for e in range(e0, e1):
                n = counts[e]
                if n:
                    y_XH[a:a + n] = geglu(x_XH[a:a + n], w_gate_up_EJH[e], w_down_EHI[e])
                    a += n
        out_FH.index_add_(0, rows_X, (y_XH * w_P[p0:p1, None]).to(out_FH.dtype))
    return out_FH


def moe_buffer_bytes(F: int, P: int, H: int, I: int, elem: int, acc_elem: int = 4,
                     chunk_bytes: int = CHUNK_BYTES) -> int:
    """Peak bytes of the MoE region's row buffers (`grouped_swiglu_torch`) for F rows and P (row, expert) pairs:
    the compact input and the combined rows (F·H each, the latter in fp32), the (F, K) routing, and one chunk's
    pair buffers (gathered inputs and outputs 2·H, gate, up and product 3·I per pair, at most `chunk_pairs`
    pairs). Grows with the fresh rows, bounded in the pairs."""
    pairs = min(P, chunk_pairs(H, I, elem, chunk_bytes)) if P else 0
    return F * H * (elem + acc_elem) + P * (8 + 4) + pairs * (2 * H + 3 * I) * elem


@dataclass
class CommStats:
    """Bytes and messages the MoE region would move (or moved, with torch.distributed) in one call."""

    dispatch_rows: int = 0
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    messages: int = 0
    per_rank: list = field(default_factory=list)

    def add(self, other: "CommStats") -> None:
        self.dispatch_rows += other.dispatch_rows
        self.dispatch_bytes += other.dispatch_bytes
        self.combine_bytes += other.combine_bytes
        self.messages += other.messages


class LocalDispatcher:
    """World size 1: dispatch and combine are the identity; experts are all local."""

    world_size = 1
    rank = 0

    def __init__(self, num_experts: int):
        self.local_experts = range(num_experts)

    def run(self, x_FH, ids_FK, w_FK, experts) -> tuple[torch.Tensor, CommStats]:
        """Routed-expert output of the fresh rows (F, H) and what a wire would have carried."""
        y = experts(x_FH, ids_FK, w_FK)
        nb = x_FH.shape[0] * x_FH.shape[1] * x_FH.element_size()
        # one row per token and destination rank; with one rank: one row per fresh token, each way
        return y, CommStats(dispatch_rows=x_FH.shape[0], dispatch_bytes=nb + ids_FK.numel() * 8 + w_FK.numel() * 4,
                            combine_bytes=nb, messages=0)
