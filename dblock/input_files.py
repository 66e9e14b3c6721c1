"""Files given to a command, read as untrusted input: traces, operator and path profiles, arrival times, saved
results. Every file from outside is data: it is read as text or JSON (never unpickled, never evaluated), bounded in
size before it is read, and a problem is one `InputFileError` naming the flag, the path and what is wrong (missing,
a folder, too large, not UTF-8, not JSON, at which line).

`read_text`, `read_json` (a whole document) and `read_jsonl` (one JSON value per line, for traces) do the reading;
what the values must be is each reader's schema (`dblock.trace` for traces, `dblock.simulator.profile` for operator
profiles). Config only: no torch, no numpy.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional

from dblock.errors import InputFileError

#: a JSON document (a profile, a liveness file, saved results, arrival times) at most this large
MAX_JSON_BYTES = 64 << 20
#: a JSON-lines trace at most this large, each line at most MAX_LINE_BYTES
MAX_TRACE_BYTES = 1 << 30
MAX_LINE_BYTES = 16 << 20


def where(path: str, flag: Optional[str] = None) -> str:
    """`--flag PATH` (or `PATH` alone): how messages name a file."""
    return f"{flag} {path}" if flag else str(path)


def _check(path: str, flag: Optional[str], limit: int) -> None:
    w = where(path, flag)
    if not isinstance(path, str) or not path or "\x00" in path:
        raise InputFileError(f"{w!r}: not a file name")
    if os.path.isdir(path):
        raise InputFileError(f"{w}: is a folder; give a file")
    if not os.path.isfile(path):
        raise InputFileError(f"{w}: no such file")
    size = os.path.getsize(path)
    if size > limit:
        raise InputFileError(f"{w}: {size:,} bytes, beyond the {limit:,} this input may have")


def _decode(data: bytes, path: str, flag: Optional[str], offset: int = 0, line: Optional[int] = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = f" at line {line}" if line is not None else f" at byte {offset + e.start}"
        raise InputFileError(f"{where(path, flag)}: not UTF-8 text (byte 0x{data[e.start]:02x}{at}); expected "
                             "a JSON or text file") from None


def _read(path: str, flag: Optional[str], limit: int) -> bytes:
    _check(path, flag, limit)
    try:
        with open(path, "rb") as f:
            return f.read(limit + 1)
    except OSError as e:
        raise InputFileError(f"{where(path, flag)}: cannot be read ({e.strerror or e})") from None


def read_text(path: str, flag: Optional[str] = None, limit: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of `path` (at most `limit` bytes)."""
    return _decode(_read(path, flag, limit), path, flag)


def parse_json(text: str, source: str) -> Any:
    """`json.loads(text)`, an InputFileError naming `source` (and the line) when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputFileError(f"{source}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise InputFileError(f"{source}: not JSON this reader accepts (nested too deeply)") from None
    except ValueError as e:                 # an integer beyond Python's digit limit
        raise InputFileError(f"{source}: not JSON this reader accepts ({str(e)[:80]})") from None


def read_json(path: str, flag: Optional[str] = None, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value of `path` (any JSON value: callers that need an object check it)."""
    return parse_json(read_text(path, flag, limit), where(path, flag))


def read_jsonl(path: str, flag: Optional[str] = None, limit: int = MAX_TRACE_BYTES,
               line_limit: int = MAX_LINE_BYTES) -> Iterator[tuple]:
    """(line number, JSON value) for every non-blank line of `path`; a line that is not UTF-8 or not JSON is an
    InputFileError naming the flag, the file and the line."""
    _check(path, flag, limit)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputFileError(f"{where(path, flag)}: cannot be read ({e.strerror or e})") from None
    with f:
        for i, raw in enumerate(iter(lambda: f.readline(line_limit + 1), b""), 1):
            if len(raw) > line_limit:
                raise InputFileError(f"{where(path, flag)}:{i}: a line longer than {line_limit:,} bytes")
            line = _decode(raw, path, flag, line=i).strip()
            if not line:
                continue
            yield i, parse_json(line, f"{where(path, flag)}:{i}")


def require(cond: bool, path: str, flag: Optional[str], what: str) -> None:
    """An InputFileError `--flag PATH: what` unless `cond`."""
    if not cond:
        raise InputFileError(f"{where(path, flag)}: {what}")


def validation_message(e) -> str:
    """The first problem of a pydantic `ValidationError` as `key.sub: what (got VALUE)`."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ())) or "value"
    got = err.get("input")
    shown = repr(got)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    more = len(e.errors()) - 1
    return f"{loc}: {err.get('msg', 'invalid')} (got {shown})" + (f"; and {more} more" if more > 0 else "")
