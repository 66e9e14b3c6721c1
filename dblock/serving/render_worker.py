"""Chat templates rendered with hard bounds: in worker processes that can be abandoned and killed.

A model folder is untrusted input and its chat template runs on every chat request. jinja2's sandbox stops a
template from touching the process (attributes, files) and caps `range()`, but not a loop nest that runs 10^10
times or an output of gigabytes: rendered in the server's process, such a template would hold the event loop (no
`/health`, no other request, no SIGTERM) until it ends. So the server renders elsewhere:

    BoundedRenderer(template, time_limit, max_chars)
        .render(messages, add_generation_prompt, continue_final_message, kwargs) -> text
        raises ChatTemplateError on a template error, on more than `max_chars` characters of output (counted while
        the template streams, so a huge output stops early), or when no answer comes within `time_limit` seconds --
        then the worker is killed (SIGKILL) and replaced; the render costs its own request that long, no more.

Workers are `python -m dblock.serving.render_worker` subprocesses that import only this module and jinja2 (no torch)
and speak JSON lines over pipes, each capped at 1 GiB of address space, at most `max_workers` of them; an idle one
is reused, so a normal render costs a pipe round trip; the time limit starts when the worker has the request (a
worker's start-up is never charged to a render), and a killed worker is replaced in the background. `close()` kills
them all, busy ones included (the server's shutdown). Callers run `render` off the event loop (a thread): while one
request waits for a stuck worker, the loop, `/health` and other renders (other workers) go on.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from dblock.serving.chat import ChatTemplate, ChatTemplateError

TIME_LIMIT_S = 2.0          # default render time limit (--template-timeout)
MAX_CHARS = 1_000_000       # default rendered-prompt size limit in characters (--template-max-chars)
MAX_WORKERS = 4
MEMORY_BYTES = 1 << 30      # address space of a worker: a template that builds gigabytes fails, not the machine


def _worker_main() -> None:                    # pragma: no cover - runs in the child process
    """The child: JSON lines on stdin -> JSON lines on stdout. Capped at MEMORY_BYTES of address space."""
    import json
    import resource
    import signal
    import sys
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C belongs to the server, which kills us
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    except (ValueError, OSError):
        pass
    compiled: dict = {}
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            source = req["source"]
            tpl = compiled.get(source)
            if tpl is None:
                tpl = compiled[source] = ChatTemplate(source, req["special"], req["origin"])
                tpl.template                          # compiled here, inside the bounds
            text = tpl.render(req["messages"], req["add_generation_prompt"], req["continue_final_message"],
                              req["kwargs"], max_chars=req["max_chars"])
            reply = {"ok": text}
        except ChatTemplateError as e:
            reply = {"error": str(e)}
        except MemoryError:
            reply = {"error": f"the template needed more than {MEMORY_BYTES >> 20} MiB (the render was stopped)"}
        except BaseException as e:                     # ValueError on compile, anything else: the request's 400
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class _Worker:
    """One `python -m dblock.serving.render_worker` process (a plain subprocess: nothing of the server is
    re-imported in it), ready when it has said so."""

    def __init__(self, start_timeout: float = 60.0):
        import os
        import subprocess
        import sys
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                  .split(os.pathsep) if p]))
        self.proc = subprocess.Popen([sys.executable, "-m", "dblock.serving.render_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
        self._buf = b""
        line = self.read_line(start_timeout)
        if line != b"ready":
            self.kill()
            raise ChatTemplateError("the template worker did not start")

    def send(self, obj) -> None:
        import json
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())

    def read_line(self, timeout: float) -> Optional[bytes]:
        """One line from the worker, or None when none came within `timeout` seconds (EOFError: it died)."""
        import os
        import select
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.2))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError("the template worker exited")
                self._buf += chunk
            elif self.closing():
                return None
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    closing = staticmethod(lambda: False)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(5)
        except (OSError, ValueError):
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class BoundedRenderer:
    """Render `template` (a `ChatTemplate`) in killable workers with a time and an output-size limit."""

    def __init__(self, template: ChatTemplate, time_limit: float = TIME_LIMIT_S, max_chars: int = MAX_CHARS,
                 max_workers: int = MAX_WORKERS):
        if not time_limit > 0 or max_chars < 1 or max_workers < 1:
            raise ValueError(f"time_limit={time_limit}, max_chars={max_chars}, max_workers={max_workers}: must be "
                             "positive")
        self.template, self.time_limit, self.max_chars, self.max_workers = template, time_limit, max_chars, \
            max_workers
        self._idle: list = []
        self._busy: set = set()
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False
        self.killed = 0                      # workers killed at the time limit (a counter for tests and logs)

    @property
    def origin(self) -> str:
        return self.template.origin

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise ChatTemplateError("the server is shutting down")
                if self._idle:
                    w = self._idle.pop()
                    self._busy.add(w)
                    return w
                if self._count < self.max_workers:
                    self._count += 1
                    break
                self._cond.wait()
        try:
            w = _Worker()
            with self._cond:
                self._busy.add(w)
            return w
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _release(self, w: _Worker) -> None:
        """A worker back to the idle list (killed instead when the renderer is closed)."""
        with self._cond:
            self._busy.discard(w)
            if self._closed:
                self._count -= 1
            else:
                self._idle.append(w)
            self._cond.notify()
        if self._closed:
            w.kill()

    def _drop(self, w: _Worker) -> None:
        """Kill a worker (stuck, dead or failed) and free its slot."""
        w.kill()
        with self._cond:
            if w in self._busy:
                self._busy.discard(w)
                self._count -= 1
            self._cond.notify()

    def start(self) -> "BoundedRenderer":
        """Start one worker now (the first render does not pay the spawn)."""
        self._release(self._acquire())
        return self

    def render(self, messages: list, add_generation_prompt: bool = True, continue_final_message: bool = False,
               kwargs: Optional[dict] = None) -> str:
        import json
        t = self.template
        w = self._acquire()
        try:
            w.closing = lambda: self._closed
            w.send({"source": t.source, "special": t.special_tokens, "origin": t.origin, "messages": messages,
                    "add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                    "kwargs": kwargs, "max_chars": self.max_chars})
            line = w.read_line(self.time_limit)
            if line is None:
                self._drop(w)
                if self._closed:
                    raise ChatTemplateError("the server is shutting down")
                self.killed += 1
                self._prespawn()
                raise ChatTemplateError(f"rendering took longer than {self.time_limit:g} s (the server's template "
                                        "time limit, --template-timeout): the render was stopped")
            reply = json.loads(line)
        except ChatTemplateError:
            raise
        except (OSError, EOFError, ValueError) as e:   # the worker died (killed from outside) or spoke nonsense
            self._drop(w)
            raise ChatTemplateError(f"the template worker failed ({type(e).__name__})") from None
        except BaseException:
            self._drop(w)
            raise
        self._release(w)
        if "error" in reply:
            raise ChatTemplateError(reply["error"])
        return reply["ok"]

    def _prespawn(self) -> None:
        """Replace a killed worker in the background, so the next render does not wait for a start."""
        def start():
            try:
                self._release(self._acquire())
            except ChatTemplateError:
                pass
        threading.Thread(target=start, daemon=True, name="dblock-template-spawn").start()

    def close(self) -> None:
        """Kill every worker, idle or busy (a render under way ends with "the server is shutting down")."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            busy = list(self._busy)
            self._cond.notify_all()
        for w in idle + busy:
            w.kill()


def self_test(renderer: BoundedRenderer) -> None:
    """Render one user message with the server's bounds: a template that cannot is a ValueError at startup naming
    where the template came from, instead of a 400 on every chat request."""
    try:
        renderer.render([{"role": "user", "content": "Hello"}], True, False, None)
    except ChatTemplateError as e:
        raise ValueError(f"{renderer.origin}: the chat template fails its startup self-test (one user message "
                         f"'Hello'): {e}") from None


if __name__ == "__main__":                     # pragma: no cover - the worker process
    _worker_main()
