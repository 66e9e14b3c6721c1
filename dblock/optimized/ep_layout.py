"""Expert-parallel FreshLane, the layout of one exchange (docs/algorithms.md §4.4): who owns what, who sends what.

Pure functions of the call's routing, the same on every rank (every rank computes the whole layout, so the counts
of both protocols need no communication). `ep_dispatch.EPDispatcher` moves the rows this layout describes.

Ownership: rank r owns experts [lo_r, hi_r), lo_r = r·E // W (uneven E/W allowed), and the contiguous share
[r·T // W, (r+1)·T // W) of the call's T valid rows (the full logical shard, in the executor's flat order).

Wire layout: one row per (owned row, destination rank), DeepEP's convention (a token is sent once per destination
rank, not once per (token, k)). A row is one contiguous run of bytes, all fields of all rows in one buffer and one
`all_to_all_single` per phase:

    [ hidden (H · elem bytes of x) | int32 owner position (index of the row in the full shard)
      | int32 × K rank-local expert ids (id − lo_d, or -1 where the expert lives on another rank)
      | fp32 × K routing weights ]

The receiving (expert) rank runs its experts on the rows, multiplies by the routing weights and sums over its own
slots, so combine returns one *partial sum* per (row, expert rank), in the dispatch order; the owner adds the
partial sums of all ranks (combine itself is an unweighted sum, as in DeepEP). Sends are ordered by destination
rank, then by row; the owner keeps the (destination, row) order as its handle, so combine needs no index.

Worked example (W = 2, E = 4: rank 0 owns experts 0,1 and rank 1 owns 2,3; K = 2; T = 4 rows, all fresh;
ids = [[0,2], [1,0], [3,2], [1,3]]). Rank 0 owns rows 0,1 and rank 1 owns rows 2,3.
    rank 0 sends: to rank 0 rows 0 (local ids [0,-1]) and 1 ([1,0]); to rank 1 row 0 ([-1,0])  counts [2, 1]
    rank 1 sends: to rank 0 row 3 ([1,-1]); to rank 1 rows 2 ([1,0]) and 3 ([-1,1])           counts [1, 2]
    count exchange: rank 0 learns it receives [2, 1] rows, rank 1 [1, 2]
    dispatch: rank 0 receives rows 0, 1, 3; rank 1 receives rows 0, 2, 3 (positions travel with them)
    experts: rank 0: w00·E0(x0); w10·E1(x1) + w11·E0(x1); w30·E1(x3)
             rank 1: w01·E2(x0); w20·E3(x2) + w21·E2(x2); w31·E3(x3)
    combine (splits swapped): rank 0 gets partials [row 0 from 0, row 1 from 0, row 0 from 1] → y0 = sum of two,
             y1 = one; rank 1 gets [row 3 from 0, row 2 from 1, row 3 from 1] → y2 = one, y3 = sum of two
    gather: rank 0 sends y0, y1 to rank 1 and rank 1 sends y2, y3 to rank 0
With H = 4 in fp32 a row is 16 + 4 + 8 + 8 = 36 bytes; rank 0 puts 1 dispatch row (36 B) and 1 combine row
(16 B) on the wire, rank 1 the same; each gather sends 2 rows (32 B). Rows to oneself are copies, not wire bytes.

Letter legend: W ranks, E experts, K experts per token, H hidden, T rows of the call (full shard), N work rows
(F fresh rows or T).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

COUNT_FIELDS = 4          # per peer: rows, T, N, call number (the last three catch ranks that fell out of step)


def bounds(n: int, W: int) -> list:
    """Contiguous shares of n items over W ranks: rank r holds [b[r], b[r+1]), b[r] = r·n // W.
    bounds(10, 4) = [0, 2, 5, 7, 10] (uneven shares 2, 3, 2, 3); bounds(1, 4) = [0, 0, 0, 0, 1]."""
    return [r * n // W for r in range(W + 1)]


def destinations(ids_NK: torch.Tensor, ebounds: list) -> torch.Tensor:
    """(N, W) bool: row n goes to rank d iff one of its valid expert ids lies in [ebounds[d], ebounds[d+1])."""
    W = len(ebounds) - 1
    N, K = ids_NK.shape
    edges = torch.tensor(ebounds[1:-1], dtype=ids_NK.dtype, device=ids_NK.device)
    rank_NK = torch.bucketize(ids_NK, edges, right=True)                  # rank owning each id
    dest = torch.zeros(N, W + 1, dtype=torch.bool, device=ids_NK.device)
    dest.scatter_(1, torch.where(ids_NK >= 0, rank_NK, torch.full_like(rank_NK, W)), True)
    return dest[:, :W]


@dataclass
class Layout:
    """The exchange of one MoE call, for every rank at once (all ranks compute the same one).

    rows_N: index of each work row in the full shard (sorted); obounds: each rank's share of the work rows
    (positions into rows_N); dest_NW: destinations; counts_WW[o, d]: rows owner o sends to expert rank d.
    """

    rows_N: torch.Tensor
    obounds: list
    dest_NW: torch.Tensor
    counts_WW: torch.Tensor


def plan_layout(ids_NK: torch.Tensor, rows_N: torch.Tensor, T: int, E: int, W: int) -> Layout:
    """Ownership by position in the full shard (rank r owns shard rows [r·T//W, (r+1)·T//W)) and the counts.

    Worked example (the module's): ids = [[0,2],[1,0],[3,2],[1,3]], rows_N = [0,1,2,3], T = 4, E = 4, W = 2:
    obounds = [0, 2, 4]; dest = [[1,1],[1,0],[0,1],[1,1]]; counts = [[2, 1], [1, 2]].
    """
    tb = torch.tensor(bounds(T, W)[1:-1], dtype=torch.long)
    owner_N = torch.bucketize(rows_N.cpu(), tb, right=True)
    obounds = [0] + torch.bincount(owner_N, minlength=W).cumsum(0).tolist()
    dest = destinations(ids_NK, bounds(E, W)).cpu()
    counts = torch.zeros(W, W, dtype=torch.long)
    counts.index_add_(0, owner_N, dest.long())
    return Layout(rows_N, obounds, dest, counts)


def row_bytes(H: int, K: int, elem: int) -> int:
    """Bytes of one dispatch row: hidden, owner position, K local ids (int32), K weights (fp32)."""
    return H * elem + 4 * (1 + K) + 4 * K


def wire_counts(lay: Layout, H: int, K: int, elem: int) -> dict:
    """Per-rank lists of what each rank sends in the four phases of one call (bytes to other ranks only)."""
    C = lay.counts_WW.tolist()                                               # W x W, W small: plain Python
    W = len(C)
    owned = [lay.obounds[r + 1] - lay.obounds[r] for r in range(W)]
    rb = row_bytes(H, K, elem)
    sent = [sum(C[r][d] for d in range(W) if d != r) for r in range(W)]          # rows to other ranks
    back = [sum(C[o][r] for o in range(W) if o != r) for r in range(W)]          # partial sums to other owners
    peers = [sum(1 for d in range(W) if d != r and C[r][d]) + sum(1 for o in range(W) if o != r and C[o][r])
             for r in range(W)]
    out = {
        "rows": [sum(row) for row in C],
        "owned": owned,
        "count_bytes": [(W - 1) * COUNT_FIELDS * 8] * W,
        "dispatch_bytes": [n * rb for n in sent],
        "combine_bytes": [n * H * elem for n in back],
        "gather_bytes": [(W - 1) * s * H * elem for s in owned],
        "messages": [p + (W - 1) + ((W - 1) if s else 0) for p, s in zip(peers, owned)],
    }
    out["bytes"] = [sum(out[k][r] for k in ("count_bytes", "dispatch_bytes", "combine_bytes", "gather_bytes"))
                    for r in range(W)]
    return out
