"""Running the app over TCP with uvicorn: a listening socket (`bind_socket`; `is_loopback` for the API-key rule),
uvicorn with the header deadline of `receiving._h11_protocol` and a SIGINT/SIGTERM handler that drains in-flight
requests and returns (`run_server`), and `ServerThread` (the app on an ephemeral port in a background thread, for
tests, benchmarks and notebooks).

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections and waits for in-flight responses — the engine keeps
running until they are all delivered — then the app's lifespan shutdown stops the engine (draining anything left;
`server.create_app`). A second signal stops waiting.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from typing import Optional

from dblock.serving.receiving import MAX_HEADER_BYTES, REQUEST_TIMEOUT, _h11_protocol, check_request_timeout

log = logging.getLogger("dblock.serving")


def is_loopback(host: str) -> bool:
    import ipaddress
    if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: an ephemeral port; read it back with getsockname)."""
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise ValueError(f"--host {host}: cannot resolve")
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app, log_level: str, drain_timeout: Optional[float], limit_concurrency: Optional[int],
                    handle_signals: bool, request_timeout: Optional[float] = None):
    import uvicorn

    if request_timeout is None:
        request_timeout = getattr(app, "dblock_request_timeout", REQUEST_TIMEOUT)
    request_timeout = check_request_timeout(request_timeout)

    class Server(uvicorn.Server):
        """uvicorn's server with signal handling that drains and returns (no re-raise of the signal)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if not handle_signals or threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = [signal.SIGINT, signal.SIGTERM]

            def handler(sig, frame):
                if self.should_exit:                      # second signal: stop waiting for in-flight requests
                    self.force_exit = True
                else:
                    log.warning("dblock serve: %s received, draining in-flight requests (again to force)",
                                signal.Signals(sig).name)
                    self.should_exit = True
            old = {s: signal.signal(s, handler) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout, limit_concurrency=limit_concurrency,
                            timeout_keep_alive=5, http=_h11_protocol(request_timeout),
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    return Server(config)


def run_server(app, sock: socket.socket, log_level: str = "info", drain_timeout: Optional[float] = None,
               limit_concurrency: Optional[int] = None, request_timeout: Optional[float] = None) -> None:
    """Serve `app` on the bound socket until SIGINT/SIGTERM; in-flight requests are drained first.
    `request_timeout` (default: the app's, see `create_app`): the header deadline of every connection."""
    server = _uvicorn_server(app, log_level, drain_timeout, limit_concurrency, handle_signals=True,
                             request_timeout=request_timeout)
    server.run(sockets=[sock])


class ServerThread:
    """The app on an ephemeral 127.0.0.1 port in a background thread (tests, benchmarks, notebooks).

        with ServerThread(app) as s:  httpx.get(s.url + "/health")
    `stop()` is a graceful shutdown: it returns once in-flight requests were delivered and the engine stopped.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 drain_timeout: Optional[float] = None, limit_concurrency: Optional[int] = None,
                 request_timeout: Optional[float] = None):
        self.server = _uvicorn_server(app, log_level, drain_timeout, limit_concurrency, handle_signals=False,
                                      request_timeout=request_timeout)
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="dblock-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("dblock server thread did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> bool:
        self.server.should_exit = True
        self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()
        return not self.thread.is_alive()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
