"""Expert- and sequence-parallel FreshLane on torch.distributed (docs/algorithms.md §4.4).

Experts are sharded over the EP ranks, the rows of the batch are owned by sequence-parallel ranks, and per pass and
MoE layer the rows move with `all_to_all_single` and split sizes: a count exchange, then dispatch, then combine,
then a gather that restores the full logical shard. `EPDispatcher` is a drop-in for `freshlane.LocalDispatcher`
(`EpochExecutor(model, cfg, dispatcher=EPDispatcher(E))`); NCCL on CUDA, gloo on CPU; launch with `torchrun`
(`init_from_env`) or spawn ranks from Python (`run_distributed`). World size 1 runs the same code path (with a
one-process group, or with a local copy standing in for the collective when no group exists).

What is distributed and what is replicated (the CPU stand-in for tensor parallelism). Every rank runs the dense
part of the model — embeddings, attention, norms, the shared expert, the LM head, the samplers — over the same
requests, in lockstep, exactly as one process would; there is no tensor parallelism here. The MoE region is
genuinely distributed:
  * experts: rank r owns the contiguous range [lo_r, hi_r), lo_r = r·E // W (uneven E/W allowed), and loads only
    those experts' weights (every rank holds the whole checkpoint: the stand-in again);
  * rows: the valid rows of the call (the full logical shard, T rows in the executor's flat order) are owned by
    contiguous sequence-parallel shares, rank r owning rows [r·T // W, (r+1)·T // W); an owner packs and sends
    only its own rows, so a rank whose share is all stable decoded rows sends nothing that pass;
  * after combine each owner holds the routed output of its rows, and an all-gather (an `all_to_all_single` with
    the owner's rows sent to every peer) gives every rank the outputs of all rows, so that the replicated dense
    part continues identically everywhere. It is counted separately (`gather_bytes`): with real TP/SP it is the
    all-gather of the sequence-parallel layout, not part of the EP exchange.

FreshLane vs dense dispatch (`mode`). FreshLane moves only the fresh rows (LSP's F_i), dense moves every row of
the call (what a forward-scoped runtime moves every pass). Both return the same fresh outputs: in dense mode the
stable rows travel and are computed, and the executor still serves them from its decoded-output cache, so the
two modes decode the same tokens and differ only in what moves. Whatever the mode, every call also computes the
byte and message counts of *both* protocols for *every* rank (the routing of the whole batch is replicated, so
this needs no communication), and the trace of every pass carries the dense/FreshLane ratio.

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

Order of summation: a row's K slots are summed per expert rank, then across ranks in rank order, so logits agree
with the single-process executor within fp32 tolerance rather than bitwise (bitwise at world size 1). Partial
sums travel in x's dtype (bf16 on GPU: one rounding per partial sum, as DeepEP's bf16 combine).

Failures never hang. Every collective runs under the process group's timeout (`timeout_s`, also handed to gloo);
each rank publishes a heartbeat (its exchange counter and where it is) on the rendezvous store, and when a
collective fails or times out the rank reads the others' heartbeats and raises `EPTimeoutError` naming the rank
that died (silent heartbeat) or stalled (alive but behind). A collective still blocked 1.5·timeout + 5 s later
(a backend that ignores its timeout) ends the process with that message.

Trace (`comm` of every denoise pass event; `EPStats.as_dict`): ``mode``, ``world``, ``rank``, ``calls`` (MoE
calls), ``comm_s`` (this rank's time inside collectives), the compatibility totals of the run mode over all
ranks (``dispatch_rows``, ``dispatch_bytes``, ``combine_bytes``, ``messages``), then ``freshlane`` and ``dense``,
each a dict of per-rank lists (index = rank): ``rows`` (rows sent, to oneself included), ``owned`` (rows owned),
``count_bytes``, ``dispatch_bytes``, ``combine_bytes``, ``gather_bytes`` (bytes this rank puts on the wire per
phase), ``bytes`` (their sum), ``messages`` (non-empty point-to-point sends to other ranks), and ``bytes_ratio``
/ ``rows_ratio`` (dense over FreshLane; dispatch + combine over all ranks; None when FreshLane moved nothing).
`comm_summary(events)` reduces a trace to per-pass means for the simulator's communication model.

Letter legend: W ranks, E experts, K experts per token, H hidden, T rows of the call (full shard), F fresh rows,
N work rows (F or T), S rows owned by this rank, P (row, destination) pairs sent, R rows received.
"""
from __future__ import annotations

import datetime
import io
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from dblock.errors import DistributedError
from dblock.optimized.freshlane import CommStats

MODES = ("freshlane", "dense")
COUNT_FIELDS = 4          # per peer: rows, T, N, call number (the last three catch ranks that fell out of step)
DEFAULT_TIMEOUT_S = float(os.environ.get("DBLOCK_EP_TIMEOUT", "300"))


class EPTimeoutError(DistributedError):
    """A collective failed or timed out; `ranks` are the ranks blamed (died or stalled)."""

    def __init__(self, msg: str, ranks=()):
        super().__init__(msg)
        self.ranks = tuple(ranks)


class EPError(DistributedError):
    """The ranks disagree (the replicated parts diverged, or a rank sent rows it does not own)."""


# ---------------------------------------------------------------------------------------------------------------
# layout: who owns what, who sends what (pure functions, the same on every rank)
# ---------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------
# per-pass statistics
# ---------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------
# heartbeat and diagnosis (never a hang, always a rank in the message)
# ---------------------------------------------------------------------------------------------------------------

class _Heartbeat:
    """Publishes {seq, where, status, beat} under dblock_ep/hb/<n>/<rank> every `period_s` on the rendezvous store
    (n numbers the dispatchers of the process; every rank creates its dispatchers in the same order).

    `beat` increases with every publication, so a peer whose record stops changing has died (or its process is
    frozen), and a peer whose `seq` (exchanges entered) is below ours is stuck before the exchange we wait in.
    """

    instances = 0

    def __init__(self, store, rank: int, world: int, period_s: float = 0.2, kill_after_s: float | None = None):
        self.store, self.rank, self.world, self.period = store, rank, world, period_s
        _Heartbeat.instances += 1
        self.n = _Heartbeat.instances
        self.seq, self.where, self.status, self.beat = 0, "start", "ok", 0
        self.kill_after_s = kill_after_s
        self.blocked_since = None                   # set while the main thread is inside a collective
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"dblock-ep-heartbeat-{rank}", daemon=True)
        self.publish()
        self._thread.start()

    def key(self, r: int) -> str:
        return f"dblock_ep/hb/{self.n}/{r}"

    def publish(self) -> None:
        with self._lock:
            self.beat += 1
            rec = {"seq": self.seq, "where": self.where, "status": self.status, "beat": self.beat}
        self.store.set(self.key(self.rank), json.dumps(rec))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.publish()
            except Exception:                       # the store is gone (rank 0 / launcher died): nothing to say
                return
            since = self.blocked_since
            if self.kill_after_s is not None and since is not None and time.monotonic() - since > self.kill_after_s:
                msg = self.diagnose(f"{self.where} (blocked {time.monotonic() - since:.0f} s, backend did not "
                                    "time out)", None)[0]
                print(f"dblock: {msg}", file=sys.stderr, flush=True)
                os._exit(75)

    def read(self) -> dict:
        out = {}
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                k = self.key(r)
                out[r] = json.loads(self.store.get(k)) if self.store.check([k]) else None
            except Exception:
                out[r] = "unreachable"
        return out

    def diagnose(self, what: str, err) -> tuple[str, list]:
        """One line naming the rank(s) at fault, and their ids."""
        self.status = "failed"
        try:
            self.publish()
            first = self.read()
            time.sleep(3.5 * self.period)
            second = self.read()
        except Exception as e:                      # noqa: BLE001 - the store itself is unreachable
            return (f"rank {self.rank}: {what} failed and the rendezvous store is unreachable (the rank hosting it, "
                    f"rank 0 or the launcher, died?): {_first_line(err or e)}", [0])
        blamed, notes = [], []
        for r in sorted(second, key=lambda q: second[q]["seq"] if isinstance(second[q], dict) else -1):
            a, b = first.get(r), second[r]
            if b == "unreachable":
                notes.append(f"rank {r} unreachable")
                blamed.append(r)
                continue
            if b is None:
                notes.append(f"rank {r} never started")
                blamed.append(r)
                continue
            silent = isinstance(a, dict) and a.get("beat") == b.get("beat")
            behind = b["seq"] < self.seq
            if silent and b["status"] != "failed":
                notes.append(f"rank {r} died (heartbeat silent; its last report, up to {self.period:g} s before "
                             f"it stopped, was at exchange #{b['seq']}: {b['where']})")
                blamed.append(r)
            elif behind and b["status"] != "failed":
                notes.append(f"rank {r} stalled (alive but still at exchange #{b['seq']}: {b['where']}, this rank "
                             f"is at #{self.seq})")
                blamed.append(r)
        if not notes:
            notes.append("every rank is alive at the same exchange; see the backend error")
        detail = f" [backend: {_first_line(err)}]" if err is not None else ""
        return f"rank {self.rank}: {what} failed: " + "; ".join(notes) + detail, blamed

    def close(self) -> None:
        self._stop.set()


def _first_line(e) -> str:
    s = str(e).strip().splitlines()
    return s[0][:300] if s else type(e).__name__


# ---------------------------------------------------------------------------------------------------------------
# the dispatcher
# ---------------------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------------------
# launching: torchrun (init_from_env) and Python (run_distributed)
# ---------------------------------------------------------------------------------------------------------------

def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets RANK/WORLD_SIZE/LOCAL_RANK)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def rank_device(device: str) -> str:
    """Under torchrun, `cuda` means this process's GPU, cuda:LOCAL_RANK; anything else is unchanged."""
    if device == "cuda" and launched_by_torchrun():
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def init_from_env(device: str = "cpu", timeout_s: float | None = None) -> None:
    """Join the torchrun job: NCCL for CUDA devices, gloo otherwise, with `timeout_s` on every collective."""
    import atexit

    import torch.distributed as dist
    if dist.is_initialized():
        return
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S))
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


def dispatcher_from_cli(model, ep: int | None, mode: str = "freshlane", device: str = "cpu",
                        timeout_s: float | None = None):
    """The dispatcher `dblock ... --ep N` asks for: None (single process, LocalDispatcher), an EPDispatcher at
    world size 1 (`--ep 1`: the distributed code path in one process), or the torchrun job's."""
    if ep is not None and ep < 1:
        raise ValueError(f"--ep {ep}: must be >= 1")
    if not launched_by_torchrun():
        if ep is None:
            return None
        if ep == 1:
            return EPDispatcher(model.config.num_experts, mode=mode, timeout_s=timeout_s)
        raise ValueError(f"--ep {ep}: start {ep} processes with torchrun --nproc-per-node {ep} -m dblock ... "
                         f"--ep {ep} (gloo on CPU, NCCL with --device cuda)")
    init_from_env(device, timeout_s)
    import torch.distributed as dist
    W = dist.get_world_size()
    if ep is not None and ep != W:
        raise ValueError(f"--ep {ep}: torchrun started {W} processes; give --nproc-per-node {ep} or --ep {W}")
    return EPDispatcher(model.config.num_experts, mode=mode, timeout_s=timeout_s)


class DistributedRunError(DistributedError):
    """Some ranks failed or did not finish; `per_rank` maps rank -> one-line reason."""

    def __init__(self, per_rank: dict, elapsed: float):
        self.per_rank, self.elapsed = per_rank, elapsed
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(per_rank.items()))
        super().__init__(f"distributed run failed after {elapsed:.1f} s: {lines}")


def _entry(rank, world, port, backend, timeout_s, threads, fn, args, q):
    torch.set_num_threads(threads)
    import torch.distributed as dist
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        res = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(res, buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        q.put((rank, "error", f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:   # noqa: BLE001 - a broken group cannot always be torn down
                pass


def run_distributed(fn, world_size: int, args: tuple = (), backend: str = "gloo", timeout_s: float = 30.0,
                    join_timeout_s: float = 600.0, grace_s: float | None = None, threads: int = 1) -> list:
    """Run fn(rank, world_size, *args) in `world_size` spawned processes joined in one process group on 127.0.0.1.

    The rendezvous store lives in this (parent) process, so it survives any rank. Returns the ranks' return values
    (they travel through torch.save). Bounded: a rank that fails makes the others get `grace_s` (default
    2·timeout_s + 10) to report before they are killed, and nothing runs past `join_timeout_s`; then
    `DistributedRunError` names every rank that failed (with its error) or was killed. `fn` must be importable
    (a module-level function): the ranks are spawned, not forked.
    """
    import multiprocessing as mp
    import queue as queue_

    import torch.distributed as dist
    grace = 2 * timeout_s + 10 if grace_s is None else grace_s
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world_size, store.port, backend, timeout_s, threads, fn, args, q),
                         daemon=True, name=f"dblock-rank-{r}") for r in range(world_size)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    results, errors, first_fail = {}, {}, None
    exited_at = {}
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            limit = t0 + join_timeout_s if first_fail is None else min(t0 + join_timeout_s, first_fail + grace)
            if now >= limit:
                break
            try:
                item = q.get(timeout=min(0.2, limit - now))
            except queue_.Empty:
                for r, p in enumerate(procs):        # died without a word (os._exit, a signal, the OOM killer)
                    if r in results or r in errors or p.exitcode is None:
                        continue
                    exited_at.setdefault(r, now)
                    if now - exited_at[r] > 2.0:     # give its queue feeder time to flush
                        errors[r] = f"process exited with code {p.exitcode} without a result"
                        first_fail = first_fail or now
                continue
            if item[1] == "ok":
                results[item[0]] = torch.load(io.BytesIO(item[2]), weights_only=False)
            else:
                errors[item[0]] = item[2]
                first_fail = first_fail or time.monotonic()
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                if r not in results and r not in errors:
                    errors[r] = (f"did not finish within {time.monotonic() - t0:.1f} s (killed)" if first_fail is None
                                 else "did not finish after another rank failed (killed)")
                p.kill()
        for p in procs:
            p.join(timeout=5)
        q.close()
    if errors:
        raise DistributedRunError(errors, time.monotonic() - t0)
    return [results[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------------------------------
# benchmark worker (CPU here; the GPU script calls the same function with backend="nccl")
# ---------------------------------------------------------------------------------------------------------------

def bench_worker(rank: int, world: int, cfg: dict) -> dict:
    """Decode the same prompts with FreshLane and dense dispatch on this rank, alternating, `repeats` times.

    cfg: model (a folder, a bundled name, or {"family": ..., "seed", "head_scale", **make_tiny_model overrides}),
    device ("cpu"/"cuda"),
    prompts (lists of ids), max_new_tokens, schedule, epoch_config, repeats, timeout_s. Returns, per mode, the
    denoising wall times of every repeat, the MoE-region time, the comm dicts of every denoise pass (rank 0's
    view: all ranks' counts), and the tokens (the two modes must agree).
    """
    from dblock.config import DecodeConfig
    from dblock.optimized.executor import epoch_forward
    from dblock.decoding.generate import generate
    from dblock.trace import TraceWriter

    device = cfg.get("device", "cpu")
    if str(device).startswith("cuda"):
        device = f"cuda:{torch.cuda.current_device()}"
    spec = cfg["model"]
    if isinstance(spec, dict):
        from dblock.tiny import make_tiny_model
        spec = dict(spec)
        head_scale = spec.pop("head_scale", None)     # < 1: a less confident random model, more passes per block
        model = make_tiny_model(spec.pop("family"), seed=spec.pop("seed", 0), **spec).to(device)
        if head_scale is not None:
            with torch.no_grad():
                model.lm_head.weight.mul_(head_scale)
    else:
        import dblock
        model = dblock.load(spec, dtype=cfg.get("dtype", "float32" if device == "cpu" else None), device=device)
    dec = DecodeConfig(max_new_tokens=cfg.get("max_new_tokens", 32))
    out = {m: {"den_s": [], "moe_s": [], "comm": None, "tokens": None} for m in MODES}
    for rep in range(cfg.get("repeats", 3)):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        for mode in order:
            disp = EPDispatcher(model.config.num_experts, mode=mode, timeout_s=cfg.get("timeout_s"))
            fwd = epoch_forward(model, cfg.get("epoch_config", "epoch"), dispatcher=disp)
            buf = io.StringIO()
            res = generate(fwd, cfg["prompts"], dec, cfg.get("schedule", "native"), trace=TraceWriter(buf))
            disp.close()
            evs = [json.loads(line) for line in buf.getvalue().splitlines()]
            den = [e for e in evs if e["event"] == "pass" and e["kind"] == "denoise"]
            out[mode]["den_s"].append(res.times.den_s)
            out[mode]["moe_s"].append(sum(e.get("moe_s", 0.0) for e in den))
            out[mode]["comm_s"] = out[mode].get("comm_s", []) + [sum(e["comm"]["comm_s"] for e in den)]
            if out[mode]["comm"] is None:
                out[mode]["comm"] = [e["comm"] for e in den]
                out[mode]["tokens"] = res.tokens
    return out


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
