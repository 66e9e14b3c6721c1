"""Expert-parallel FreshLane, the watchdog (docs/algorithms.md §4.4): failures never hang, and name a rank.

Every collective runs under the process group's timeout (`DEFAULT_TIMEOUT_S`, env DBLOCK_EP_TIMEOUT, or the
dispatcher's `timeout_s`, also handed to gloo); each rank publishes a heartbeat (its exchange counter and where it
is) on the rendezvous store, and when a collective fails or times out the rank reads the others' heartbeats and
raises `EPTimeoutError` naming the rank that died (silent heartbeat) or stalled (alive but behind). A collective
still blocked 1.5·timeout + 5 s later (a backend that ignores its timeout) ends the process with that message.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

from dblock.errors import DistributedError

DEFAULT_TIMEOUT_S = float(os.environ.get("DBLOCK_EP_TIMEOUT", "300"))


class EPTimeoutError(DistributedError):
    """A collective failed or timed out; `ranks` are the ranks blamed (died or stalled)."""

    def __init__(self, msg: str, ranks=()):
        super().__init__(msg)
        self.ranks = tuple(ranks)


class EPError(DistributedError):
    """The ranks disagree (the replicated parts diverged, or a rank sent rows it does not own)."""


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
