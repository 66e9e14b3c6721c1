"""Receiving a request within bounds: its request line and headers within `request_timeout` of the connection
opening (`_h11_protocol`), then its body within `Limits.max_body_bytes` and `request_timeout` (`_read_body`).

Careless or hostile clients:
  * `request_timeout` (`dblock serve --request-timeout`, default 30 s) bounds both halves of receiving a request:
    a connection that has not delivered complete request headers within it is closed (`_h11_protocol`: uvicorn's
    own timers only cover idle keep-alive connections), and a body not fully received within it gets 408 with
    `Connection: close` (a client that declares a Content-Length and never sends the body);
  * bodies above `Limits.max_body_bytes` get 413 (checked on Content-Length and while reading);
  * bytes that are not HTTP get a 400 at once (`could_be_request_line`), or h11's 400, and the connection is
    closed; request headers above `MAX_HEADER_BYTES` likewise;
  * a client that disconnects while sending its body is one info line in the log (no traceback).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re

from starlette.requests import ClientDisconnect

from dblock.serving.protocol_base import APIError

log = logging.getLogger("dblock.serving")

#: default seconds a client has to send a request's headers, and then its body (`dblock serve --request-timeout`)
REQUEST_TIMEOUT = 30.0
#: most bytes of request line + headers (h11's incomplete-event limit; beyond it h11 answers 400 and closes)
MAX_HEADER_BYTES = 64 * 1024


def check_request_timeout(value) -> float:
    """`request_timeout` as a float, or ValueError: a finite number of seconds > 0."""
    import math
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"request_timeout={value!r}: must be a finite number of seconds > 0")
    return float(value)


async def _read_body(request, limit: int, timeout: float = REQUEST_TIMEOUT) -> bytes:
    """The request body, at most `limit` bytes (413 above) and within `timeout` seconds (408 beyond); a client that
    disconnects meanwhile is an `APIError` 499 (logged as one line: nobody reads the answer)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise APIError(400, "Content-Length: not an integer", None, "invalid_header") from None
        if n > limit:
            raise APIError(413, f"request body of {n} bytes exceeds this server's limit of {limit} bytes "
                           "(--max-body-bytes)", None, "body_too_large")
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
                               None, "body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        log.info("%s %s: request body not received within %g s (%d bytes came); answered 408", request.method,
                 request.url.path, timeout, size)
        raise APIError(408, f"request body: not received within {timeout:g} s ({size} of "
                       f"{cl if cl is not None else 'an unknown number of'} bytes came; --request-timeout)", None,
                       "request_timeout") from None
    except ClientDisconnect:
        log.info("%s %s: client disconnected while sending the request body (%d bytes came)", request.method,
                 request.url.path, size)
        raise APIError(499, "client disconnected while sending the request body", None, "cancelled") from None
    return b"".join(chunks)


_METHOD = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_REQUEST_LINE_PREFIX = re.compile(_METHOD + rb"{0,32}(?: [\x21-\x7e]*(?: (?:H(?:T(?:T(?:P(?:/[0-9]?(?:\.[0-9]?)?)?)?)?)?"
                                  rb")?)?)?")
_REQUEST_LINE = re.compile(_METHOD + rb"{1,32} [\x21-\x7e]+ HTTP/[0-9]\.[0-9]\r?")


def could_be_request_line(head: bytes) -> bool:
    """Whether the first bytes of a connection (or of the next request on it) can still become an HTTP/1 request
    line `METHOD SP target SP HTTP/x.y CRLF` (leading empty lines allowed, as RFC 9112 asks): false as soon as a
    byte rules it out, so that noise gets its 400 at once instead of waiting out the header timeout."""
    head = head.lstrip(b"\r\n")
    line, nl, _ = head.partition(b"\n")
    if nl:
        return _REQUEST_LINE.fullmatch(line) is not None
    return _REQUEST_LINE_PREFIX.fullmatch(line) is not None


def _h11_protocol(header_timeout: float):
    """uvicorn's h11 protocol with a header deadline: a connection must deliver a complete request head (request
    line and headers) within `header_timeout` seconds of opening, or of its previous response, or it is closed.

    uvicorn arms no timer on a fresh connection, and its keep-alive timer is cancelled by the first byte that
    arrives, so a client sending nothing, or its headers a byte at a time, would otherwise hold a connection (and
    a --max-queue slot of `limit_concurrency`) for ever. Once a request head is complete the app's body timeout
    takes over (`_read_body`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DblockH11Protocol(H11Protocol):
        _header_timer = None
        _waiting_for = None                 # the cycle that was current when the timer was armed
        _head = b""                          # the first bytes of the request head being waited for

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._disarm()
            self._head = b""
            self._waiting_for = self.cycle
            self._header_timer = self.loop.call_later(header_timeout, self._header_timeout)

        def _disarm(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self):
            self._header_timer = None
            if self.transport.is_closing() or self.cycle is not self._waiting_for:
                return
            client = "%s:%s" % self.client[:2] if self.client else "a client"
            log.info("closing the connection from %s: no complete request headers within %g s (--request-timeout)",
                     client, header_timeout)
            self.transport.close()

        def data_received(self, data):
            # only while h11 waits for a new request: after an early answer (a 413 on Content-Length) the rest of
            # that request's body still arrives on a kept-alive connection, and those bytes are a body, not noise
            if (self._header_timer is not None and self.cycle is self._waiting_for and len(self._head) < 256
                    and self.conn.their_state is h11.IDLE):
                self._head = (self._head + data)[:256]
                if not could_be_request_line(self._head):      # bytes that cannot become HTTP: answer now
                    client = "%s:%s" % self.client[:2] if self.client else "a client"
                    log.info("closing the connection from %s: its first bytes are not an HTTP request line", client)
                    self._disarm()
                    body = json.dumps({"error": {"message": "request: the bytes received cannot be an HTTP request "
                                                 "line (METHOD SP target SP HTTP/x.y)", "type": "invalid_request_error",
                                                 "param": None, "code": "bad_request_line"}}).encode()
                    self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                         b"connection: close\r\ncontent-length: " + str(len(body)).encode() +
                                         b"\r\n\r\n" + body)
                    self.transport.close()
                    return
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._waiting_for:
                self._disarm()              # a request head arrived: the app's body timeout applies now

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()                 # waiting for the next request head on a kept-alive connection

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return DblockH11Protocol
