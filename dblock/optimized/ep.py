"""Expert- and sequence-parallel FreshLane on torch.distributed (docs/algorithms.md §4.4) — the public names.

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

The pieces:
  ep_layout.py    ownership, destinations, split counts and bytes of one exchange (pure functions; the wire layout
                  and a worked example)
  ep_dispatch.py  `EPDispatcher` (the four phases over `all_to_all_single`), `EPStats` (the trace's `comm`
                  record) and `comm_summary`
  ep_watchdog.py  timeouts, heartbeats and the diagnosis naming a dead or stalled rank (`EPTimeoutError`, `EPError`)
  ep_launch.py    torchrun (`init_from_env`, `dispatcher_from_cli`) and spawned ranks (`run_distributed`)
The benchmark worker that decodes with both dispatch modes lives with the benchmarks (`benchmarks/ep_workers.py`).
"""
from dblock.optimized.ep_dispatch import MODES, EPDispatcher, EPStats, comm_summary
from dblock.optimized.ep_launch import (DistributedRunError, dispatcher_from_cli, env_rank, init_from_env,
                                        launched_by_torchrun, rank_device, run_distributed)
from dblock.optimized.ep_layout import COUNT_FIELDS, Layout, bounds, destinations, plan_layout, row_bytes, wire_counts
from dblock.optimized.ep_watchdog import DEFAULT_TIMEOUT_S, EPError, EPTimeoutError

__all__ = [
    "COUNT_FIELDS", "DEFAULT_TIMEOUT_S", "MODES", "DistributedRunError", "EPDispatcher", "EPError", "EPStats",
    "EPTimeoutError", "Layout", "bounds", "comm_summary", "destinations", "dispatcher_from_cli", "env_rank",
    "init_from_env", "launched_by_torchrun", "plan_layout", "rank_device", "row_bytes", "run_distributed",
    "wire_counts",
]
