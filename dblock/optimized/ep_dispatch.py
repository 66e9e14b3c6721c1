"""Expert-parallel FreshLane, the dispatcher (docs/algorithms.md §4.4): `EPDispatcher` moves one MoE call's rows
with `all_to_all_single` and split sizes — a count exchange, then dispatch, then combine, then a gather that restores
the full logical shard on every rank — in the wire layout of `ep_layout`, watched by `ep_watchdog`.

FreshLane vs dense dispatch (`mode`). FreshLane moves only the fresh rows (LSP's F_i), dense moves every row of
the call (what a forward-scoped runtime moves every pass). Both return the same fresh outputs: in dense mode the
stable rows travel and are computed, and the executor still serves them from its decoded-output cache, so the
two modes decode the same tokens and differ only in what moves. Whatever the mode, every call also computes the
byte and message counts of *both* protocols for *every* rank (the routing of the whole batch is replicated, so
this needs no communication), and the trace of every pass carries the dense/FreshLane ratio.

Order of summation: a row's K slots are summed per expert rank, then across ranks in rank order, so logits agree
with the single-process executor within fp32 tolerance rather than bitwise (bitwise at world size 1). Partial
sums travel in x's dtype (bf16 on GPU: one rounding per partial sum, as DeepEP's bf16 combine).

Trace (`comm` of every denoise pass event; `EPStats.as_dict`): ``mode``, ``world``, ``rank``, ``calls`` (MoE
calls), ``comm_s`` (this rank's time inside collectives), the compatibility totals of the run mode over all
ranks (``dispatch_rows``, ``dispatch_bytes``, ``combine_bytes``, ``messages``), then ``freshlane`` and ``dense``,
each a dict of per-rank lists (index = rank): ``rows`` (rows sent, to oneself included), ``owned`` (rows owned),
``count_bytes``, ``dispatch_bytes``, ``combine_bytes``, ``gather_bytes`` (bytes this rank puts on the wire per
phase), ``bytes`` (their sum), ``messages`` (non-empty point-to-point sends to other ranks), and ``bytes_ratio``
/ ``rows_ratio`` (dense over FreshLane; dispatch + combine over all ranks; None when FreshLane moved nothing).
`comm_summary(events)` reduces a trace to per-pass means for the simulator's communication model
(docs/counters.md).

Letter legend: W ranks, E experts, K experts per token, H hidden, T rows of the call (full shard), F fresh rows,
N work rows (F or T), S rows owned by this rank, P (row, destination) pairs sent, R rows received.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dblock.optimized.ep_layout import bounds, plan_layout, wire_counts
from dblock.optimized.ep_watchdog import DEFAULT_TIMEOUT_S, EPError, EPTimeoutError, _first_line, _Heartbeat
from dblock.optimized.freshlane import CommStats

MODES = ("freshlane", "dense")


@dataclass
class EPStats(CommStats):
    """CommStats of the run mode (totals over all ranks) plus per-rank counts of both protocols."""

    mode: str = "freshlane"
    world: int = 1
    rank: int = 0
    calls: int = 0
    comm_s: float = 0.0
    freshlane: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)

    def add(self, other: "CommStats") -> None:
        super().add(other)
        if not isinstance(other, EPStats):
            return
        self.mode, self.world, self.rank = other.mode, other.world, other.rank
        self.calls += other.calls
        self.comm_s += other.comm_s
        for mine, theirs in ((self.freshlane, other.freshlane), (self.dense, other.dense)):
            for k, v in theirs.items():
                mine[k] = [a + b for a, b in zip(mine[k], v)] if k in mine else list(v)

    def as_dict(self) -> dict:
        def moved(d):
            return sum(d.get("dispatch_bytes", [])) + sum(d.get("combine_bytes", []))
        fl, dn = moved(self.freshlane), moved(self.dense)
        fr, dr = sum(self.freshlane.get("rows", [])), sum(self.dense.get("rows", []))
        return {"mode": self.mode, "world": self.world, "rank": self.rank, "calls": self.calls,
                "comm_s": self.comm_s, "dispatch_rows": self.dispatch_rows, "dispatch_bytes": self.dispatch_bytes,
                "combine_bytes": self.combine_bytes, "messages": self.messages,
                "freshlane": self.freshlane, "dense": self.dense or None,
                "bytes_ratio": dn / fl if self.dense and fl else None,
                "rows_ratio": dr / fr if self.dense and fr else None}


class EPDispatcher:
    """`LocalDispatcher`'s contract over torch.distributed: run(x_FH, ids_FK, w_FK, experts) -> (y_FH, EPStats).

    num_experts: E of the model. mode: "freshlane" (fresh rows only) or "dense" (every row of the call).
    group: a process group (default: the default group if one is initialised, else world size 1 without one).
    timeout_s: the collectives' timeout (also set on the group by `init_from_env` / `run_distributed`).
    count_dense: also count the dense protocol while running FreshLane (needs the router over stable rows too).
    record: keep every call's (counts_WW, rows owned per rank) in `self.layouts` (tests, debugging).

    The executor hands in, besides the fresh rows, the whole call (`x_all` (T, H), `ids_all`/`w_all` (T, K), every
    row routed within its block's support, and `idx_fresh` (F,) into it): ownership is by position in the full
    shard, and dense dispatch moves all of it. Without them the fresh rows are taken as the whole shard.
    """

    wants_all_rows = True

    def __init__(self, num_experts: int, mode: str = "freshlane", group=None, timeout_s: float | None = None,
                 count_dense: bool = True, store=None, heartbeat_s: float = 0.2, record: bool = False):
        if mode not in MODES:
            raise ValueError(f"ep mode {mode!r}: allowed {', '.join(MODES)}")
        import torch.distributed as dist
        self.dist = dist
        self.group = group if group is not None else (dist.group.WORLD if dist.is_available() and
                                                      dist.is_initialized() else None)
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.backend = dist.get_backend(self.group) if self.group is not None else "local"
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts}: must be >= 1")
        self.E, self.mode, self.count_dense = num_experts, mode, count_dense
        self.ebounds = bounds(num_experts, self.world_size)
        self._lo_hi = {}                                                     # device -> (lo_W, hi_W) tensors
        self.local_experts = range(self.ebounds[self.rank], self.ebounds[self.rank + 1])
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.calls = 0
        self.layouts = [] if record else None
        self.hb = None
        if self.group is not None and self.world_size > 1:
            if store is None:
                try:
                    store = dist.distributed_c10d._get_default_store()
                except Exception:   # noqa: BLE001 - no store: failures still raise, without the rank diagnosis
                    store = None
            if store is not None:
                self.hb = _Heartbeat(store, self.rank, self.world_size, heartbeat_s,
                                     kill_after_s=1.5 * self.timeout_s + 5.0)

    def new_stats(self) -> EPStats:
        return EPStats(mode=self.mode, world=self.world_size, rank=self.rank)

    def close(self) -> None:
        """Stop the heartbeat (also done when the dispatcher is garbage collected)."""
        if self.hb is not None:
            self.hb.close()

    def __del__(self):
        try:
            self.close()
        except Exception:   # noqa: BLE001 - interpreter shutdown
            pass

    # ---- the collective, watched --------------------------------------------------------------------------
    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list, phase: str,
             st: EPStats) -> None:
        where = f"{phase} of MoE call {self.calls}"
        if self.hb is not None:
            self.hb.seq += 1
            self.hb.where = where
        if self.group is None:                     # world size 1 without a process group: the copy it would do
            out.copy_(inp)
            return
        t0 = time.perf_counter()
        if self.hb is not None:
            self.hb.blocked_since = time.monotonic()
        try:
            self.dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except Exception as e:                     # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            if self.hb is None:
                raise EPTimeoutError(f"rank {self.rank}: {where} (exchange) failed: {_first_line(e)}") from e
            msg, ranks = self.hb.diagnose(f"{where} (exchange #{self.hb.seq})", e)
            raise EPTimeoutError(msg, ranks) from e
        finally:
            if self.hb is not None:
                self.hb.blocked_since = None
        st.comm_s += time.perf_counter() - t0

    # ---- one MoE call -------------------------------------------------------------------------------------
    def run(self, x_FH, ids_FK, w_FK, experts, x_all=None, ids_all=None, w_all=None, idx_fresh=None):
        """Routed-expert output of the fresh rows (F, H) (x's dtype), the same on every rank, and the stats."""
        dev = x_FH.device
        W, r = self.world_size, self.rank
        F_, H = x_FH.shape
        K = ids_FK.shape[1]
        if x_all is None:                                                     # the fresh rows are the shard
            x_all, ids_all, w_all, idx_fresh = x_FH, ids_FK, w_FK, torch.arange(F_)
        T = x_all.shape[0]
        idx_fresh = idx_fresh.to(dev)
        ids_all, w_all = ids_all.to(dev), w_all.to(dev)
        elem = x_FH.element_size()
        st = self.new_stats()
        st.calls = 1
        fl = plan_layout(ids_all[idx_fresh], idx_fresh, T, self.E, W)
        dn = plan_layout(ids_all, torch.arange(T, device=dev), T, self.E, W) if (
            self.mode == "dense" or self.count_dense) else None
        st.freshlane = wire_counts(fl, H, K, elem)
        if dn is not None:
            st.dense = wire_counts(dn, H, K, elem)
        lay = fl if self.mode == "freshlane" else dn
        run = st.freshlane if self.mode == "freshlane" else st.dense
        st.dispatch_rows, st.dispatch_bytes = sum(run["rows"]), sum(run["dispatch_bytes"])
        st.combine_bytes, st.messages = sum(run["combine_bytes"]), sum(run["messages"])

        if self.layouts is not None:
            self.layouts.append((lay.counts_WW.clone(), run["owned"]))

        # 1) pack the rows this rank owns, one per (row, destination rank), destination-major
        rows_N = lay.rows_N.to(dev)
        o0, o1 = lay.obounds[r], lay.obounds[r + 1]
        own_S = rows_N[o0:o1]                                                 # (S,) positions in the shard
        dest_SW = lay.dest_NW[o0:o1].to(dev)
        d_P, s_P = dest_SW.t().nonzero(as_tuple=True)                        # (P,) sorted by destination, row
        send_counts = lay.counts_WW[r].tolist()
        src_P = own_S[s_P]
        if dev not in self._lo_hi:
            self._lo_hi[dev] = (torch.tensor(self.ebounds[:-1], device=dev), torch.tensor(self.ebounds[1:], device=dev))
        lo_P, hi_P = self._lo_hi[dev][0][d_P], self._lo_hi[dev][1][d_P]
        g_PK = ids_all[src_P]
        here = (g_PK >= lo_P[:, None]) & (g_PK < hi_P[:, None])
        lid_PK = torch.where(here, g_PK - lo_P[:, None], torch.full_like(g_PK, -1)).to(torch.int32)
        wt_PK = torch.where(here, w_all[src_P].float(), torch.zeros((), device=dev))
        meta = torch.cat([src_P.to(torch.int32)[:, None], lid_PK], 1)       # (P, 1 + K) int32
        buf = torch.cat([x_all[src_P].contiguous().view(torch.uint8), meta.view(torch.uint8),
                         wt_PK.contiguous().view(torch.uint8)], 1)            # (P, row bytes)
        rb = buf.shape[1]

        # 2) count exchange: rows, and the call's shape, so that ranks out of step fail loudly
        hdr = torch.tensor([[c, T, rows_N.numel(), self.calls] for c in send_counts], dtype=torch.long, device=dev)
        rhdr = torch.empty_like(hdr)
        self._a2a(rhdr, hdr, [1] * W, [1] * W, "count exchange", st)
        rhdr = rhdr.cpu()
        recv_counts = rhdr[:, 0].tolist()
        for o in range(W):
            if rhdr[o, 1:].tolist() != [T, rows_N.numel(), self.calls] or recv_counts[o] != int(lay.counts_WW[o, r]):
                raise EPError(f"rank {r}: rank {o} is out of step at MoE call {self.calls}: it sends "
                              f"{recv_counts[o]} rows for (T, N, call) = {tuple(rhdr[o, 1:].tolist())}, this rank "
                              f"expects {int(lay.counts_WW[o, r])} for {(T, rows_N.numel(), self.calls)} (the "
                              "replicated parts of the model diverged between ranks)")

        # 3) dispatch
        recv = torch.empty(sum(recv_counts), rb, dtype=torch.uint8, device=dev)
        self._a2a(recv, buf, recv_counts, send_counts, "dispatch", st)
        hb_ = H * elem
        x_R = recv[:, :hb_].contiguous().view(x_FH.dtype)                    # (R, H)
        meta_R = recv[:, hb_:hb_ + 4 * (1 + K)].contiguous().view(torch.int32)
        w_R = recv[:, hb_ + 4 * (1 + K):].contiguous().view(torch.float32)  # (R, K)
        tb = bounds(T, W)
        src_rank_R = torch.repeat_interleave(torch.arange(W, device=dev), torch.tensor(recv_counts, device=dev))
        pos_R = meta_R[:, 0].long()
        lo_t = torch.tensor(tb[:-1], device=dev)[src_rank_R]
        hi_t = torch.tensor(tb[1:], device=dev)[src_rank_R]
        if bool(((pos_R < lo_t) | (pos_R >= hi_t)).any()):
            raise EPError(f"rank {r}: received rows from a rank that does not own them (MoE call {self.calls})")

        # 4) local experts over the received worklist (invalid slots load no weights and join no sum)
        lid_R = meta_R[:, 1:].long()
        gid_R = torch.where(lid_R >= 0, lid_R + self.ebounds[r], torch.full_like(lid_R, -1))
        if x_R.shape[0]:
            y_R = experts(x_R, gid_R, w_R).to(x_FH.dtype)
        else:
            y_R = torch.zeros(0, H, dtype=x_FH.dtype, device=dev)

        # 5) combine: partial sums back to the owners, splits swapped; the owner adds them up in rank order
        back = torch.empty(len(s_P), H, dtype=x_FH.dtype, device=dev)
        self._a2a(back, y_R.contiguous(), send_counts, recv_counts, "combine", st)
        acc = torch.promote_types(x_FH.dtype, torch.float32)
        y_S = torch.zeros(own_S.numel(), H, dtype=acc, device=dev)
        y_S.index_add_(0, s_P, back.to(acc))
        y_S = y_S.to(x_FH.dtype)

        # 6) gather: every rank gets every owner's rows (owners are contiguous, so the result is in row order)
        shares = [lay.obounds[q + 1] - lay.obounds[q] for q in range(W)]
        y_N = torch.empty(rows_N.numel(), H, dtype=x_FH.dtype, device=dev)
        self._a2a(y_N, y_S.repeat(W, 1), shares, [own_S.numel()] * W, "gather", st)
        self.calls += 1
        if self.mode == "freshlane":
            return y_N, st
        return y_N[idx_fresh], st


def comm_summary(events) -> dict:
    """Per-pass means of a trace's `comm` records (denoise passes with an EP dispatcher): what the simulator's
    communication model reads. Keys: world, passes, calls_per_pass, and for "freshlane" and "dense" the per-rank
    mean bytes per pass (by phase), rows and messages, and the overall dense/FreshLane bytes and rows ratios."""
    evs = [e for e in events if e.get("event") == "pass" and isinstance(e.get("comm"), dict)
           and "freshlane" in e["comm"]]
    if not evs:
        return {"passes": 0}
    n = len(evs)
    W = evs[0]["comm"]["world"]
    out = {"world": W, "passes": n, "calls_per_pass": sum(e["comm"]["calls"] for e in evs) / n}
    for proto in MODES:
        recs = [e["comm"][proto] for e in evs if e["comm"].get(proto)]
        if not recs:
            out[proto] = None
            continue
        out[proto] = {k: [sum(rec[k][r] for rec in recs) / len(recs) for r in range(W)] for k in recs[0]}
    moved = {p: sum(sum(out[p][k]) for k in ("dispatch_bytes", "combine_bytes")) if out.get(p) else 0
             for p in MODES}
    rows = {p: sum(out[p]["rows"]) if out.get(p) else 0 for p in MODES}
    out["bytes_ratio"] = moved["dense"] / moved["freshlane"] if moved["freshlane"] and out["dense"] else None
    out["rows_ratio"] = rows["dense"] / rows["freshlane"] if rows["freshlane"] and out["dense"] else None
    return out
