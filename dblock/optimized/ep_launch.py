"""Expert-parallel FreshLane, launching (docs/algorithms.md §4.4): join a torchrun job (`init_from_env`, and
`dispatcher_from_cli` for `dblock ... --ep N`) or spawn ranks from Python (`run_distributed`, bounded: a failed or
silent rank never hangs the parent). NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import datetime
import io
import os
import time
import traceback

import torch

from dblock.errors import DistributedError
from dblock.optimized.ep_dispatch import EPDispatcher
from dblock.optimized.ep_watchdog import DEFAULT_TIMEOUT_S


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
    atexit.register(_leave_group)


def _leave_group() -> None:
    """At exit: wait for every rank to reach its end (a barrier bounded by the group's timeout), then tear the group
    down. Without the barrier a rank that finished first closed its gloo pairs while a slower rank (a loaded
    machine) was still finishing, and the teardown could abort a process (SIGABRT)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except Exception:   # noqa: BLE001 - a peer that failed: tear down what is left
        pass
    try:
        dist.destroy_process_group()
    except Exception:   # noqa: BLE001 - a broken group cannot always be torn down
        pass


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
