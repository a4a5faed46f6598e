"""mashbox: serve one Qwen model over OpenAI Chat Completions, Completions, Responses and Anthropic
Messages, from a hand-written asyncio HTTP/1.1 server in front of a JAX engine worker process.

    python -m mashbox run [MODEL] [--slots N] [--ctx T] [--port 8000] ...

This file is the whole server, in titled sections, in the order a request meets them (a test keeps
this list and the sections' titles the same):
    Limits and errors
    HTTP/1.1                   parse and serialize, pure functions on bytes
    Connection loop (asyncio)  every await and every socket
    Security                   keys, tenants, Origin/Host, content type
    Admission                  the waiting queues
    Generation                 handle_generation -> admit_and_run -> run_generation -> run_attempt
    Engine bridge              the worker process
    Routes                     the routes table
    The server state           the App: configuration, routes, bridge, what the routes share
    Metrics                    Prometheus text, the request log
    API formats (appendix)     API_FORMATS (the index), then per API: parse_* and an Encoder
    CLI, start and stop        the flags, start-up sizing, serve and shut down, a follower host
A request's life is told by the four functions of Generation, in that order: handle_generation
(parse; log and count), admit_and_run (refuse, admit, render), run_generation (the retry rule) and
run_attempt (one attempt: submit, then tokens -> output parser -> encoder).
The server process never imports jax: the engine worker (engine/worker.py) owns the device; of the
engine it loads engine.SERVER_MODULES alone, none of which imports jax (a test holds that list to
what start-up loads).
"""
from __future__ import annotations

import argparse
import asyncio
import email.utils
import hmac
import http
import json
import logging
import os
import queue
import re
import signal
import sys
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

from engine import chat, memory, protocol, registry
from engine.checkpoint import Checkpoint, WeightsError, check_shapes
from engine.config import ConfigError, ModelConfig, check_weights_dtype, config_from_dict, load_config
from engine.sharding import DevicesError, check_devices, distributed_settings
from engine.chat import Job, new_id


# =================================================================================================
# Limits and errors
# =================================================================================================

class ApiError(Exception):
    """An error that carries its HTTP status. Each API maps it to its own error shape in one function
    (openai_error_body / anthropic_error_body); nothing else builds error JSON."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers


class ClientGone(Exception):
    """The client disconnected, or read nothing for STALL_TIMEOUT_S: stop working for it."""


def openai_error_body(err: ApiError) -> dict:
    """The OpenAI error shape, used by every route except /v1/messages*."""
    kind = err.type if err.type not in _ANTHROPIC_ONLY_TYPES else _openai_type(err.status)
    return {"error": {"message": err.message, "type": kind, "code": err.code, "param": err.param}}


def anthropic_error_body(err: ApiError) -> dict:
    """The Anthropic error shape (/v1/messages*). Anthropic clients read the type, which follows the
    status there (a 404 is not_found_error, a 529 overloaded_error), so it is derived from the status."""
    kind = _ANTHROPIC_TYPE_BY_STATUS.get(err.status) or ("api_error" if err.status >= 500
                                                         else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


# Anthropic's error types by status, as its API and SDKs use them.
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error", 529: "overloaded_error",
}
_ANTHROPIC_ONLY_TYPES = {"not_found_error", "request_too_large", "rate_limit_error", "api_error",
                         "overloaded_error"}


def _openai_type(status: int) -> str:
    if status in (503, 529):
        return "unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


# ---- HTTP limits: far above what a real client sends, and a bound on what a hostile one costs ----

# RFC 9112 s3 asks servers to accept request lines of at least 8000 octets and to answer a longer
# request-target than they will parse with 414 (URI Too Long). Every path here is short.
MAX_REQUEST_LINE = 8 * 1024
# The whole head: request line and header lines. Agents send about 20 headers (2-3 KB); long cookies or
# tokens fit too. Beyond it, or beyond MAX_HEADERS lines, 431 (RFC 6585).
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
# Request bodies: Claude Code sends 50-250 KB and a whole 128k-token context is about 0.5 MB of text;
# 32 MiB leaves room for base64 attachments while bounding what one request makes the server hold.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Digits in a Content-Length: 2**63 - 1 has 19, far above MAX_BODY_BYTES; a longer value is refused
# before int() reads it (int() of a hostile million-digit string is slow).
MAX_LENGTH_DIGITS = 19
# A chunk-size line with its extensions (nobody sends extensions; the size is at most 16 hex digits).
MAX_CHUNK_LINE = 1024
# Reading a chunk costs the event loop about 2 us whatever its size: a body may have CHUNKS_FREE chunks
# and one more per MIN_CHUNK_BYTES it holds (clients send kilobytes a chunk), so a body sent a byte a
# chunk is refused instead of costing the loop a second per 500,000 chunks.
CHUNKS_FREE = 1024
MIN_CHUNK_BYTES = 1024
# A request that takes no body (GET /health and the other reads) may still carry this much: nothing
# reads it, so a client without a key cannot make the server hold (or reserve room for) more.
MAX_UNREAD_BODY = 4 * 1024

# After a request with a body this large, the server hands the heap pages it freed back to the
# system (memory.release_free_heap): its parse, rendering and tokenizing ran in threads whose glibc
# arenas would otherwise keep them for good (docs/limits.md, "The server's own memory"). A trim costs
# milliseconds in a thread, and at most one runs each TRIM_DELAY_S, however many such end.
TRIM_AFTER_BODY_BYTES = 128 * 1024
TRIM_DELAY_S = 0.5
# glibc heaps the server's threads share (memory.limit_heap_arenas): with its default of 8 a core,
# each thread that parsed a large body kept what it freed in an arena of its own.
SERVER_HEAP_ARENAS = 2

# ---- request bodies as JSON: what a parse may cost, and names as the APIs define them ----

# Values in a body, counted (from above) by its brackets, commas and colons before it is parsed:
# json.loads holds the GIL whatever thread it runs in, about 0.04 us a value in a list and 0.3 us a
# colon and comma of an object's entry (its key is a new string; an ignored field such as a
# 300,000-entry logit_bias costs as much as any other), and a value costs about 100 bytes parsed. An
# agent's 250 KB request has 10-60 thousand; 200,000 bound a parse to about 0.06 s and 20 MB, and a
# prompt with that much punctuation could not fit any context anyway.
MAX_JSON_VALUES = 200_000
# Nesting of objects and arrays: the agents' requests nest 12 deep (a tool schema's properties within
# properties); every walk of a body (templates, schemas, the grammar) stays far from Python's recursion
# limit below this.
MAX_JSON_DEPTH = 64
# Tools in one request: agents send 4-60 (Claude Code with MCP servers some hundreds, and defers the
# rest to tool search). Past 512 the grammar holds only names; this bounds what one list costs to
# check, render and echo.
MAX_TOOLS = 2048
# Tool names as both OpenAI and Anthropic define them. A name is written into the prompt and into the
# grammar, so nothing in it can close a string or a tag.
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}\Z")

# ---- connection timeouts, seconds (ConnLimits carries them, so tests can shorten them) ----

# The whole head must arrive this soon after the connection opens or the first byte of a later
# request arrives: a client trickling header bytes (slowloris) cannot hold a connection.
HEADER_TIMEOUT_S = 10.0
# A request body that stops arriving for this long is abandoned with 408.
BODY_TIMEOUT_S = 30.0
# After BODY_TIMEOUT_S of grace, a body must arrive at least this fast on average (a slow modem's
# speed), or 408: a client sending a byte now and then cannot hold a connection for ever.
MIN_BODY_BYTES_PER_S = 1024
# An idle keep-alive connection is closed after this long: longer than clients keep idle connections
# in their pools (about 5 s for Node and httpx), so a client never sends on a connection being closed.
KEEPALIVE_TIMEOUT_S = 75.0
# A client that reads nothing for this long while its answer waits to be written is cut off.
STALL_TIMEOUT_S = 30.0
# Open connections at most; each costs a task and buffers. Beyond it a new connection gets 503.
MAX_CONNECTIONS = 1024
# Bytes read ahead (pipelined requests) while a handler runs; reading pauses beyond it.
READ_AHEAD_BYTES = 1024 * 1024
# After an error that ends a connection, unread input is drained this long before closing, so the
# client's TCP stack does not reset the connection and drop the error response unread.
LINGER_S = 2.0
# At MAX_CONNECTIONS a new connection takes the place of one that has waited this long with nothing
# to do (the oldest that never sent a key first): a flood of idle keep-alive connections cannot lock
# anyone out for the keep-alive window. Closing an idle connection is always allowed (RFC 9112 s9.8),
# and the wait leaves a client that just took a connection from its pool time to send on it.
EVICT_IDLE_S = 1.0
# Seconds a client refused for MAX_CONNECTIONS or MAX_BUFFERED_BYTES is told to wait (Retry-After).
RETRY_AFTER_CONNECTIONS_S = 1
# A client refused for MAX_CONNECTIONS is answered in its route's error shape: its request line is
# awaited this long (a client sends it right behind the handshake's last packet, so it is there by
# the time the connection is accepted, or within microseconds). At most CAP_PEEKS such waits at a
# time, so a flood holds few descriptors; beyond that, or when no line came, the OpenAI shape.
CAP_PEEK_S = 0.005
CAP_PEEKS = 16
# Bytes held across all connections at once: buffers, bodies being read (a declared Content-Length
# is reserved when its head arrives), bodies of requests being handled, and answer bytes written but
# not yet taken by a slow reader (a Responses echo of a large tool list). Eight
# bodies of the largest size, or hundreds of agent requests; without it, MAX_CONNECTIONS bodies of
# MAX_BODY_BYTES could make the server hold 32 GiB. Beyond it a request gets 503 with Retry-After.
MAX_BUFFERED_BYTES = 256 * 1024 * 1024
# A client refused for MAX_CONNECTIONS may have sent its request already: this much of it is read and
# dropped (for at most LINGER_S) before the connection closes, so its TCP stack delivers the 503
# instead of resetting the connection. Refusals lingering at once are bounded too.
REFUSED_DRAIN_BYTES = 1024 * 1024
MAX_LINGERING_REFUSALS = 256


# =================================================================================================
# HTTP/1.1: parsing and serializing, pure functions on bytes (no I/O)
# =================================================================================================

class JsonText(str):
    """Text already written as JSON: sent as it is where an object would be serialized."""


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: optional `event:` line, one `data:` line (compact JSON, or a str as is)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()

# Token characters (RFC 9110 s5.6.2): methods and header names are made of these.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
# The start of a request line as far as it has come: a method's characters (a space ends them).
_METHOD_SO_FAR = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]*")
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])\Z")
# A request-target is visible ASCII; a header value has no control characters but tab (RFC 9110 s5.5).
_TARGET = re.compile(rb"[\x21-\x7e]+\Z")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# A chunk-size line: the size, then extensions, whose text is never read but has no control characters
# (a bare CR or a NUL there is how request-smuggling payloads hide a line end from one parser).
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?\Z")
# The path at the start of a request line, as far as it arrived: a refused request (too long, too
# slow, badly framed) is answered in its route's error shape when its path is known.
_LINE_PATH = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ (/[!-~]*?)(?=[ ?#]|\r|\n)")


@dataclass
class Request:
    """One parsed HTTP request. Header names are lowercase; values are as sent (latin-1 text)."""
    method: str
    target: str                              # as sent: "/v1/messages?beta=true"
    path: str                                # "/v1/messages" (not percent-decoded)
    query: dict[str, str]
    headers: list[tuple[str, str]]
    body: bytes = b""
    version: str = "HTTP/1.1"
    keep_alive: bool = True                  # whether the connection may carry another request
    params: dict[str, str] = field(default_factory=dict)   # path parameters, set by the router
    tenant: str | None = None                # set by the security check
    authority: str | None = None             # host[:port] of an absolute-form target (RFC 9112 s3.2.2)

    def header(self, name: str, default: str | None = None) -> str | None:
        """The first value of a header, by lowercase name."""
        for key, value in self.headers:
            if key == name:
                return value
        return default


def _bad(message: str, status: int = 400) -> ApiError:
    return ApiError(status, message, type="invalid_request_error")


class RequestReader:
    """Incremental request parser with no I/O: feed() bytes as they arrive, call next() until it returns
    None (more bytes needed). Raises ApiError (400/408/413/414/431/501/505) for a request that must be
    refused; the connection is then answered and closed, since its framing can no longer be trusted.

    Bodies: Content-Length or chunked. Pipelined requests come out one by one, in order.
    """

    def __init__(self, max_body: int = MAX_BODY_BYTES):
        self.max_body = max_body
        self._buf = bytearray()
        self._scan = 0                       # where the search for the head's end resumes
        self._req: Request | None = None     # head parsed, body still arriving
        self._length = 0                     # Content-Length mode: body bytes expected
        self._chunked: _ChunkedBody | None = None
        self._continue = False               # the client waits for "100 Continue" before its body
        self._head_path: str | None = None   # the path of a head taken from the buffer, until answered

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def state(self) -> str:
        """"idle" (nothing of a next request yet), "head" or "body"."""
        if self._req is not None:
            return "body"
        return "head" if self._buf.strip(b"\r\n") else "idle"

    def path_hint(self) -> str | None:
        """The path of the request being read, as far as it is known: for a refusal's error shape."""
        if self._req is not None:
            return self._req.path
        if self._head_path is not None:
            return self._head_path
        m = _LINE_PATH.match(self._buf.lstrip(b"\r\n"))
        return m.group(1).decode() if m else None

    @property
    def pending(self) -> Request | None:
        """The request whose head was read and whose body is still arriving, if any."""
        return self._req

    @property
    def held(self) -> int:
        """Bytes this reader holds or has been told are coming: its buffer, a chunked body read so
        far, and the rest of a declared Content-Length body (reserved before it arrives)."""
        held = len(self._buf)
        if self._chunked is not None:
            held += len(self._chunked.body)
        elif self._req is not None:
            held += max(0, self._length - len(self._buf))
        return held

    def limit_body(self, req: Request, most: int, why: str) -> None:
        """Hold req to at most `most` body bytes (413 beyond): at its head, before a declared body is
        reserved or read, or once it was read whole."""
        if req is not self._req:
            size = len(req.body)
        elif self._chunked is not None:
            self._chunked.max_body, size = most, len(self._chunked.body)
        else:
            size = self._length
        if size > most:
            raise _bad(f"{why}: a body of at most {most} bytes, got {size}", 413)

    def take_continue(self) -> bool:
        """True once when the client sent `Expect: 100-continue` and waits for an interim answer."""
        wanted, self._continue = self._continue, False
        return wanted

    def next(self) -> Request | None:
        if self._req is None:
            req = self._read_head()
            if req is None:
                return None
            self._req = req
        req = self._req
        if self._chunked is not None:
            body = self._chunked.read(self._buf)
            if body is None:
                return None
            req.body, self._chunked = body, None
        else:
            if len(self._buf) < self._length:
                return None
            req.body = bytes(self._buf[:self._length])
            del self._buf[:self._length]
        self._req, self._continue, self._head_path = None, False, None
        return req

    def _read_head(self) -> Request | None:
        # RFC 9112 s2.2: empty lines before a request line are ignored (some clients send one after a body).
        while self._buf.startswith(b"\r\n"):
            del self._buf[:2]
        end = self._buf.find(b"\r\n\r\n", self._scan)
        if end < 0:
            self._scan = max(0, len(self._buf) - 3)
            self._check_partial_head()
            return None
        if end + 4 > MAX_HEAD_BYTES:
            raise _bad(f"request head larger than {MAX_HEAD_BYTES} bytes", 431)
        head = bytes(self._buf[:end])
        m = _LINE_PATH.match(head + b"\r")
        self._head_path = m.group(1).decode() if m else None
        del self._buf[:end + 4]
        self._scan = 0
        return self._parse_head(head)

    def _check_partial_head(self) -> None:
        """Refuse at once what can never become a valid head, instead of waiting for the timeout."""
        method = _METHOD_SO_FAR.match(self._buf).end()
        if method < len(self._buf) and self._buf[method] != 0x20:
            why = "a TLS handshake: this server speaks plain HTTP (use http://)" if self._buf[:1] == b"\x16" \
                else "not an HTTP request line"
            raise _bad(f"malformed request: {why}")
        line_end = self._buf.find(b"\n")
        if line_end < 0:
            if len(self._buf) > MAX_REQUEST_LINE:
                raise _bad(f"request line longer than {MAX_REQUEST_LINE} bytes", 414)
        elif line_end == 0 or self._buf[line_end - 1] != 0x0D:
            raise _bad("request lines must end with CRLF")
        elif line_end > MAX_REQUEST_LINE:
            raise _bad(f"request line longer than {MAX_REQUEST_LINE} bytes", 414)
        if len(self._buf) > MAX_HEAD_BYTES:
            raise _bad(f"request head larger than {MAX_HEAD_BYTES} bytes", 431)

    def _parse_head(self, head: bytes) -> Request:
        request_line, _, rest = head.partition(b"\r\n")
        if len(request_line) > MAX_REQUEST_LINE:
            raise _bad(f"request line longer than {MAX_REQUEST_LINE} bytes", 414)
        parts = request_line.split(b" ")
        if len(parts) != 3:
            raise _bad("malformed request line (expected: METHOD TARGET HTTP/1.1)")
        method, target, version = parts
        if not _TOKEN.match(method):
            raise _bad("malformed request line: bad method")
        if not _TARGET.match(target):
            raise _bad("malformed request line: bad request target")
        v = _VERSION.match(version)
        if v is None:
            raise _bad("malformed request line: bad HTTP version")
        if v.group(1) != b"1":
            raise _bad(f"HTTP version {version.decode()} is not supported; use HTTP/1.1", 505)
        headers = _parse_header_lines(rest) if rest else []
        req = Request(method=method.decode(), target=target.decode(), path="", query={},
                      headers=headers, version=version.decode())
        req.path, req.query = _split_target(req.target)
        if not req.target.startswith("/") and req.target != "*":
            req.authority = urllib.parse.urlsplit(req.target).netloc
        self._frame(req)
        return req

    def _frame(self, req: Request) -> None:
        """Decide how the body is delimited and whether the connection stays open (RFC 9112 s6, s9.3)."""
        http10 = req.version == "HTTP/1.0"
        hosts = [v for k, v in req.headers if k == "host"]
        if not http10 and len(hosts) != 1:
            raise _bad("an HTTP/1.1 request needs exactly one Host header")
        tokens = {t.strip().lower() for k, v in req.headers if k == "connection" for t in v.split(",")}
        req.keep_alive = not http10 and "close" not in tokens
        lengths = [v for k, v in req.headers if k == "content-length"]
        codings = [t.strip().lower() for k, v in req.headers if k == "transfer-encoding"
                   for t in v.split(",")]
        if codings:
            if http10:
                raise _bad("Transfer-Encoding is not allowed in an HTTP/1.0 request")
            if lengths:
                raise _bad("a request must not have both Content-Length and Transfer-Encoding")
            if codings[-1] != "chunked" or "chunked" in codings[:-1]:
                if "chunked" in codings:
                    raise _bad("chunked must be the last transfer coding, once")
                raise _bad(f"Transfer-Encoding {_shown(codings)} is not supported (only chunked)", 501)
            if len(codings) > 1:
                raise _bad(f"Transfer-Encoding {_shown(codings)} is not supported (only chunked)", 501)
            self._chunked = _ChunkedBody(self.max_body)
        elif lengths:
            if len(lengths) > 1:
                raise _bad("more than one Content-Length header")
            value = lengths[0]
            if not value.isdigit() or not value.isascii() or len(value) > MAX_LENGTH_DIGITS:
                raise _bad(f"Content-Length: not a valid length: {value[:40]!r}")
            self._length = int(value)
            if self._length > self.max_body:
                raise _bad(f"request body of {self._length} bytes is larger than the limit of "
                           f"{self.max_body} bytes", 413)
        else:
            self._length = 0   # RFC 9112 s6.3: a request with neither has no body
        has_body = self._chunked is not None or self._length > 0
        expect = (req.header("expect") or "").lower()
        self._continue = has_body and not http10 and expect == "100-continue"


def _shown(codings: list[str]) -> str:
    """Transfer codings as an error names them: a few, each cut short (the header may be 64 KB)."""
    shown = ", ".join(c[:32] for c in codings[:3])
    return shown + (f", ... ({len(codings)} in all)" if len(codings) > 3 else "")


def _parse_header_lines(block: bytes) -> list[tuple[str, str]]:
    lines = block.split(b"\r\n")
    if len(lines) > MAX_HEADERS:
        raise _bad(f"more than {MAX_HEADERS} header lines", 431)
    headers = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            # Also refuses obsolete line folding (a line starting with a space), as RFC 9112 s5.2 allows.
            raise _bad(f"malformed header line: {line[:60]!r}")
        value = value.strip(b" \t")
        if _BAD_VALUE.search(value):
            raise _bad(f"header {name.decode()}: control characters in its value")
        headers.append((name.decode("ascii").lower(), value.decode("latin-1")))
    return headers


def _split_target(target: str) -> tuple[str, dict[str, str]]:
    """path and query of a request-target: origin form (/path?q), absolute form, or * (OPTIONS)."""
    if target == "*":
        return "*", {}
    if not target.startswith("/"):
        parts = urllib.parse.urlsplit(target)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise _bad(f"malformed request target {target[:60]!r}")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    path, _, query = target.partition("?")
    return path, dict(urllib.parse.parse_qsl(query, keep_blank_values=True))


class _ChunkedBody:
    """Decoder of a chunked body (RFC 9112 s7.1), resumable at any byte boundary."""

    def __init__(self, max_body: int):
        self.max_body = max_body
        self.body = bytearray()
        self.left = 0                        # bytes of the current chunk still to read
        self.stage = "size"                  # size -> data -> crlf -> size ... -> trailer
        self.chunks = 0

    def read(self, buf: bytearray) -> bytes | None:
        """Consume from buf; the whole body once its end was read, else None."""
        while True:
            if self.stage == "size":
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_CHUNK_LINE:
                        raise _bad(f"chunk size line longer than {MAX_CHUNK_LINE} bytes")
                    return None
                m = _CHUNK_SIZE.match(bytes(buf[:end]))
                if m is None:
                    raise _bad(f"malformed chunk size line: {bytes(buf[:min(end, 40)])!r}")
                del buf[:end + 2]
                self.left = int(m.group(1), 16)
                if len(self.body) + self.left > self.max_body:
                    raise _bad(f"request body larger than the limit of {self.max_body} bytes", 413)
                self.chunks += 1
                if self.chunks > CHUNKS_FREE + (len(self.body) + self.left) // MIN_CHUNK_BYTES:
                    raise _bad(f"chunked body in too many small chunks ({self.chunks} for "
                               f"{len(self.body) + self.left} bytes; send {MIN_CHUNK_BYTES} bytes or more "
                               "a chunk)")
                self.stage = "data" if self.left else "trailer"
            elif self.stage == "data":
                if not buf:
                    return None
                take = min(self.left, len(buf))
                self.body += buf[:take]
                del buf[:take]
                self.left -= take
                if self.left:
                    return None
                self.stage = "crlf"
            elif self.stage == "crlf":
                if len(buf) < 2:
                    return None
                if buf[:2] != b"\r\n":
                    raise _bad("chunk data not followed by CRLF")
                del buf[:2]
                self.stage = "size"
            else:  # trailer fields are read and dropped: nothing here uses them
                if buf.startswith(b"\r\n"):
                    del buf[:2]
                    return bytes(self.body)
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise _bad(f"chunked trailer larger than {MAX_HEAD_BYTES} bytes", 431)
                    return None
                _parse_header_lines(bytes(buf[:end]))
                del buf[:end + 4]
                return bytes(self.body)


# ---- serializing ---------------------------------------------------------------------------------

# Reason phrases; 529 is Anthropic's "overloaded", which the stdlib does not know.
_REASONS = {s.value: s.phrase for s in http.HTTPStatus} | {529: "Overloaded"}
SERVER_NAME = "mashbox"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
_date_cache: list = [0, ""]


def http_date() -> str:
    """The Date header's value (RFC 9110 s5.6.7), formatted once per second."""
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[:] = [now, email.utils.formatdate(now, usegmt=True)]
    return _date_cache[1]


def response_head(status: int, headers: Any = (), keep_alive: bool = True) -> bytes:
    """Status line and headers, ending with the empty line. Adds Date, Server and, when the connection
    is to close, Connection: close. A header value with a line break is a bug, and refused."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", f"Date: {http_date()}",
             f"Server: {SERVER_NAME}"]
    for name, value in headers:
        value = str(value)
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"line break in response header {name!r}")
        lines.append(f"{name}: {value}")
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def response_bytes(status: int, body: bytes, content_type: str, headers: Any = (),
                   keep_alive: bool = True, head_only: bool = False) -> bytes:
    """A whole response with a Content-Length body (HEAD: the same head, no body)."""
    fields = [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers]
    head = response_head(status, fields, keep_alive)
    return head if head_only else head + body


def stream_head(status: int = 200, headers: Any = (), keep_alive: bool = True,
                chunked: bool = True) -> bytes:
    """The head of a server-sent-events stream. HTTP/1.0 clients get the stream unframed, ended by
    closing the connection (they do not know chunked)."""
    fields = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), *headers]
    if chunked:
        fields.append(("Transfer-Encoding", "chunked"))
    return response_head(status, fields, keep_alive)


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body. Empty data gives no bytes: an empty chunk would end the body."""
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


# =================================================================================================
# Connection loop (asyncio): every await and every socket of the server is here
# =================================================================================================

log = logging.getLogger("mashbox")

# Bytes asked of the socket per read.
READ_SIZE = 64 * 1024


@dataclass
class ConnLimits:
    """The connection loop's timeouts and bounds; tests shorten them."""
    header_s: float = HEADER_TIMEOUT_S
    body_s: float = BODY_TIMEOUT_S
    keepalive_s: float = KEEPALIVE_TIMEOUT_S
    stall_s: float = STALL_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    linger_s: float = LINGER_S
    min_body_rate: float = MIN_BODY_BYTES_PER_S
    max_buffered: int = MAX_BUFFERED_BYTES


# Connections the kernel may hold for the server before it accepts them. A burst (agents starting
# together, or a flood) larger than the default 100 would have its extra connections retried by the
# clients' TCP stacks a second later; the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 1024
# File descriptors kept out of the connection bound: the listening socket, the worker's pipe, files
# read while serving (tokenizer, key file, spec), logging, and the socket a refused client is told on.
FD_RESERVE = 64


def connection_bound(wanted: int) -> int:
    """How many client connections may be open at once: `wanted`, raising the process's soft limit on
    open files toward its hard limit if needed, else what the limit allows. With the bound below the
    limit a flood is refused early with 503, while accept() still has a descriptor to take the
    connection; at the limit itself, accept() fails and asyncio stops accepting anyone for a second."""
    try:
        import resource
    except ImportError:       # not a Unix: no per-process limit to respect here
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - FD_RESERVE))


class Responder:
    """How a route handler answers one request: a whole response (json / send), or a stream
    (start_stream, then event per SSE frame, then end_stream). A write waits for the socket to drain,
    so a slow client slows its own stream and nothing else, unless it is made with wait=False: the
    generation's frames are, so the engine never waits on a client (what is unsent counts in the
    byte budget). A client that reads nothing for the stall timeout is cut off and ClientGone raised.
    HEAD gets the same status and headers, and no body.

    gone is set as soon as the client disconnects (the connection reads ahead while handlers run).
    """

    def __init__(self, conn: "Connection", req: Request):
        self.app = conn.app
        self.gone: asyncio.Event = conn.gone
        self.started = False          # something was sent: the status can no longer change
        self.finished = False         # the whole response was sent
        self.keep_alive = req.keep_alive
        self._conn = conn
        self._head_only = req.method == "HEAD"
        self._chunked = req.version != "HTTP/1.0"
        self._streaming = False

    async def send(self, status: int, body: bytes, content_type: str, headers: Any = ()) -> None:
        self._start()
        await self._conn.write(response_bytes(status, body, content_type, headers, self.keep_alive,
                                              self._head_only))
        self.finished = True

    async def json(self, status: int, obj: Any, headers: Any = ()) -> None:
        text = obj if isinstance(obj, JsonText) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        body = text.encode()
        await self.send(status, body, "application/json", headers)

    async def start_stream(self, headers: Any = (), status: int = 200, wait: bool = True) -> None:
        self._start()
        self._streaming = True
        if not self._chunked:
            self.keep_alive = False   # an unframed stream ends when the connection does
        await self._conn.write(stream_head(status, headers, self.keep_alive, self._chunked), wait)

    async def event(self, frame: bytes, wait: bool = True) -> None:
        """Write one SSE frame and wait until the socket takes it. wait=False: leave it in the
        connection's buffer (generation goes on while a slow client reads); a client that reads
        nothing for the stall timeout is still cut off."""
        if not self._streaming or self.finished:
            raise RuntimeError("event() outside an open stream")
        if self._head_only:
            if self.gone.is_set():
                raise ClientGone()
            return
        if frame:
            await self._conn.write(chunk(frame) if self._chunked else frame, wait)

    async def end_stream(self) -> None:
        if not self._streaming:
            raise RuntimeError("end_stream() without start_stream()")
        if self.finished:
            return
        self.finished = True
        if self._chunked and not self._head_only:
            await self._conn.write(LAST_CHUNK)

    def _start(self) -> None:
        if self.started:
            raise RuntimeError("a response was already started for this request")
        self.started = True


class Connection:
    """One client connection: reads requests (ahead of the handlers, so a disconnect is seen at once
    and pipelined requests wait in order), answers each through the route table, enforces the timeouts."""

    def __init__(self, app: "App", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.app = app
        self.limits: ConnLimits = app.limits
        self.reader, self.writer = reader, writer
        self.transport = writer.transport
        self.parser = RequestReader()
        self.gone = asyncio.Event()          # the client closed its side or the socket broke
        self.eof = False
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()         # new bytes, or EOF
        self._resume = asyncio.Event()       # cleared while reading ahead is paused
        self._resume.set()
        self._busy = False                   # a handler runs
        self._discard = False                # after a refused request: read and drop what comes
        self._head_t0: float | None = self._loop.time()   # the first head is due within header_s
        self._idle_since = self._loop.time()
        self._last_data = self._loop.time()
        self._bytes_in = 0                   # read from the socket so far
        self._body_t0: float | None = None   # when the current body started arriving
        self._body_bytes0 = 0                # _bytes_in then
        self._held = 0                       # this connection's share of app.buffered
        self._in_use = 0                     # body bytes of the request being handled
        self._over_budget = False            # app.buffered had no room for what arrived
        self._stalled: tuple[float, int] | None = None   # (since, bytes sent then) while the client lags
        self._written = 0                    # bytes given to the transport so far
        self._unsent = 0                     # of them still in its buffer when last looked: in app.buffered
        self._checked: tuple[Request, Route] | None = None   # a head that passed _check
        self.keyed = False                   # a request of it carried a valid key (kept longest)
        self.idle_since: float | None = None   # waiting for a next request since (App's idle lists)

    async def run(self) -> None:
        pump = asyncio.create_task(self._pump())
        try:
            while True:
                try:
                    req = await self._next_request()
                except ApiError as err:
                    await self._refuse(err)
                    break
                if req is None or not await self._answer(req):
                    break
        except ClientGone:
            pass
        finally:
            pump.cancel()
            self.transport.close()
            self.app.connection_busy(self)
            self.app.buffered -= self._held + self._unsent
            self._held = self._unsent = 0

    def close(self) -> None:
        """Server shutdown: drop the connection now."""
        self.transport.abort()

    # ---- reading ---------------------------------------------------------------------------------

    async def _pump(self) -> None:
        """Read the socket into the parser as bytes arrive; at EOF set gone."""
        try:
            while True:
                if self._busy and self.parser.buffered > READ_AHEAD_BYTES:
                    self._resume.clear()
                    await self._resume.wait()
                    continue
                data = await self.reader.read(READ_SIZE)
                if not data:
                    break
                if self.idle_since is not None:
                    self.app.connection_busy(self)
                if not self._discard:
                    self.parser.feed(data)
                    if not self._account():
                        self._discard = self._over_budget = True
                self._bytes_in += len(data)
                self._last_data = self._loop.time()
                self._wake.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            self.gone.set()
            self._wake.set()

    @property
    def busy(self) -> bool:
        """A handler runs (a request is being answered)."""
        return self._busy

    def _account(self) -> bool:
        """Bring this connection's share of the server's buffered bytes up to date; False when it grew
        past what the global budget has left (the share is then kept: the caller refuses). A head's
        worth is always allowed, so health probes and small requests are never refused by it."""
        want = self.parser.held + self._in_use
        grow = want - self._held
        if grow > 0 and want > MAX_HEAD_BYTES and self.app.buffered + grow > self.limits.max_buffered:
            return False
        self.app.buffered += grow
        self._held = want
        return True

    def _over_budget_error(self) -> ApiError:
        return ApiError(503, "the server holds as many request bytes as it may; retry shortly",
                        type="unavailable", headers=(("Retry-After", str(RETRY_AFTER_CONNECTIONS_S)),))

    async def _next_request(self) -> Request | None:
        """The next whole request; None when the connection should close quietly (EOF, idle).
        Raises ApiError for a request to refuse, 408 when a head or body arrives too slowly. A head
        is checked (Host, Origin, key, route, content type) as soon as it is read: a request that will
        be refused is refused before its body is read or `100 Continue` invites it."""
        while True:
            self._wake.clear()
            req = self.parser.next()
            head = self.parser.pending
            if req is None and head is not None and (self._checked is None or self._checked[0] is not head):
                self._checked = (head, self._check(head))
            if req is not None:
                self._in_use = len(req.body)
            if self._over_budget or not self._account():
                raise self._over_budget_error()
            if req is not None:
                self._head_t0 = self._body_t0 = None
                return req
            if self.parser.take_continue():
                await self.write(CONTINUE)
            if self.eof:
                return None   # the client left; a partial request leaves with it
            now = self._loop.time()
            state = self.parser.state
            if state == "body":
                if self._body_t0 is None:
                    self._body_t0, self._body_bytes0 = now, self._bytes_in
                # Each byte buys 1/min_body_rate seconds beyond the grace period.
                earned = (self._bytes_in - self._body_bytes0) / self.limits.min_body_rate
                left = min(self._last_data, self._body_t0 + earned) + self.limits.body_s - now
            elif state == "head" or self._head_t0 is not None:
                if self._head_t0 is None:
                    self._head_t0 = now
                left = self._head_t0 + self.limits.header_s - now
            else:
                left = self._idle_since + self.limits.keepalive_s - now
            if left <= 0:
                if state == "idle":
                    return None
                raise ApiError(408, f"the request {state} did not arrive in time")
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                pass

    # ---- answering -------------------------------------------------------------------------------

    def _check(self, req: Request) -> "Route":
        """The request's route, from its head alone, in this order: Host and Origin (403), the key
        (401, before 404/405 so that paths cannot be probed without one), the route (404/405), the
        content type (415). Raises the ApiError; the tenant is set on req."""
        guard = self.app.guard
        req.tenant = guard.check_head(req, _needs_key(req.path)) if guard is not None else DEFAULT_TENANT
        route = self.app.router.match(req)
        self.keyed = self.keyed or (guard is not None and guard.keys.enabled and route.needs_key)
        if not route.reads_body:     # nothing reads it: a client without a key cannot make it held
            self.parser.limit_body(req, MAX_UNREAD_BODY, f"{req.method} {req.path} reads no body")
        if guard is not None:
            guard.check_content_type(req)
        return route

    async def _answer(self, req: Request) -> bool:
        """Run the request's route; False when the connection must close afterwards."""
        out = Responder(self, req)
        errors = self.app.router.errors_for(req.path)
        self._busy = True
        try:
            checked, self._checked = self._checked, None
            route = checked[1] if checked is not None and checked[0] is req else self._check(req)
            errors = route.errors
            await route.handler(req, out)
            if not out.started:
                raise RuntimeError(f"{req.method} {route.pattern}: the handler sent no response")
            if not out.finished:
                await out.end_stream()
        except ClientGone:
            return False
        except ApiError as err:
            return await self._fail(out, err, errors)
        except Exception:
            log.exception("%s %s failed", req.method, req.path)
            return await self._fail(out, ApiError(500, "internal server error", type="server_error"),
                                    errors)
        finally:
            self._busy = False
            self.app.request_ended(self._in_use >= TRIM_AFTER_BODY_BYTES)
            self._in_use = 0
            self._account()
            self._resume.set()
            self._idle_since = self._loop.time()
            if self.parser.state == "idle" and not self.eof:
                self.app.connection_idle(self)
        return out.keep_alive and not self.transport.is_closing()

    async def _fail(self, out: Responder, err: ApiError, errors: Callable[[ApiError], dict]) -> bool:
        if out.started:
            # Too late for a status. A stream cut without its last chunk tells the client it broke.
            return out.finished and out.keep_alive
        try:
            await out.json(err.status, errors(err), err.headers)
        except ClientGone:
            return False
        return out.keep_alive

    async def _refuse(self, err: ApiError) -> None:
        """Answer a request that could not be read, then close: its framing can no longer be trusted.
        The client may still be sending (a too-large body): half-close and drain a moment first."""
        self._discard = True
        body = json.dumps(self.app.router.errors_for(self.parser.path_hint() or "")(err)).encode()
        try:
            await self.write(response_bytes(err.status, body, "application/json", err.headers,
                                            keep_alive=False))
        except ClientGone:
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        try:
            await asyncio.wait_for(self.gone.wait(), self.limits.linger_s)
        except asyncio.TimeoutError:
            pass

    # ---- writing ---------------------------------------------------------------------------------

    def _count_unsent(self) -> int:
        """Answer bytes the client has not taken yet count in the server's byte budget like request
        bytes (a client that reads nothing holds them until the stall timeout): their number now."""
        size = self.transport.get_write_buffer_size()
        self.app.buffered += size - self._unsent
        self._unsent = size
        return size

    async def write(self, data: bytes, wait: bool = True) -> None:
        """Write and wait while the socket's buffer is full; a client that takes nothing for stall_s is
        cut off. wait=False: return at once (the data stays buffered), with the same cut-off."""
        if self.transport.is_closing():
            self.gone.set()
            raise ClientGone()
        self.writer.write(data)
        self._written += len(data)
        size = self._count_unsent()
        if size <= self.transport.get_write_buffer_limits()[1]:
            self._stalled = None
            return
        if not wait:
            now, sent = self._loop.time(), self._written - size
            if self._stalled is None or sent > self._stalled[1]:
                self._stalled = (now, sent)      # the client took something: the clock starts again
            elif now - self._stalled[0] > self.limits.stall_s:
                log.info("client read nothing for %.0f s; closing its connection", self.limits.stall_s)
                self.transport.abort()
                self.gone.set()
                raise ClientGone()
            return
        sent = self._written - size
        while True:
            try:
                await asyncio.wait_for(self.writer.drain(), self.limits.stall_s)
                self._count_unsent()
                return
            except asyncio.TimeoutError:
                now_sent = self._written - self.transport.get_write_buffer_size()
                if now_sent > sent:              # slow, but reading: a buffered answer drains
                    sent = now_sent
                    continue
                log.info("client read nothing for %.0f s; closing its connection", self.limits.stall_s)
                self.transport.abort()
                self.gone.set()
                raise ClientGone() from None
            except (ConnectionError, OSError):
                self.gone.set()
                raise ClientGone() from None


# =================================================================================================
# Security: keys, tenants, Origin/Host, content type
# =================================================================================================

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
# Everything is one tenant when no keys are configured.
DEFAULT_TENANT = "default"
# Tenants of keys the file does not name, and of MASHBOX_API_KEY. Both have a space, which a name in
# the file cannot have, so no key file can put its keys in their queue.
LINE_TENANT = "line {}"
ENV_TENANT = "env MASHBOX_API_KEY"
# A key is visible ASCII (it travels in a header) and long enough not to be guessed by trying.
_KEY = re.compile(r"[\x21-\x7e]{8,}\Z")
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.@:-]{1,64}\Z")
# A `#` starts a comment at the start of a line or after a space; inside a key it is part of the key.
_COMMENT = re.compile(r"(?:^|\s)#.*")
# Query parameters some clients use for keys. They are never read (URLs end up in logs, proxies and
# shell history); naming them in the 401 tells the user why a key that looks sent was not seen.
QUERY_KEY_NAMES = ("key", "api_key", "api-key", "apikey", "access_token", "token")


def is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class KeyFileError(Exception):
    """The key file cannot be used; the message names the file and the line."""


class Keys:
    """API keys and the tenant each belongs to.

    Key file format, one key a line: `KEY` or `KEY TENANT`. A key is at least 8 visible ASCII
    characters; a tenant name is letters, digits and `_ . @ : -`. `#` at the start of a line or after
    a space starts a comment; blank lines are ignored. Keys that name the same tenant share its queue; a
    key without a name is a tenant of its own. MASHBOX_API_KEY adds one key, its own tenant. A key is
    never logged or exported: tenants of unnamed keys are named after their line, not their text.
    """

    def __init__(self, pairs: list[tuple[bytes, str]], path: str | None = None,
                 env_key: str | None = None):
        self._pairs = pairs
        self.path = path                 # re-read on SIGHUP
        self.env_key = env_key

    @property
    def enabled(self) -> bool:
        return bool(self._pairs)

    @property
    def tenants(self) -> int:
        return len({tenant for _, tenant in self._pairs})

    def __len__(self) -> int:
        return len(self._pairs)

    @classmethod
    def load(cls, path: str | None, env_key: str | None) -> "Keys":
        """The keys of the file and of MASHBOX_API_KEY. Raises KeyFileError (with the line number) for a
        file that cannot be used as a whole: a server never runs with part of its keys."""
        pairs: list[tuple[bytes, str]] = []
        if path == "":
            raise KeyFileError("--api-key-file: the path is empty")
        if path is not None:
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                raise KeyFileError(f"{path}: {e.strerror or e}") from None
            seen: dict[str, int] = {}
            for number, raw in enumerate(data.split(b"\n"), 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise KeyFileError(f"{path}:{number}: not UTF-8 text") from None
                fields = _COMMENT.sub("", text).split()
                if not fields:
                    continue
                if len(fields) > 2:
                    raise KeyFileError(f"{path}:{number}: expected 'KEY' or 'KEY TENANT', "
                                       f"got {len(fields)} fields")
                key = fields[0]
                if not _KEY.match(key):
                    raise KeyFileError(f"{path}:{number}: a key must be at least 8 visible ASCII "
                                       "characters")
                if len(fields) == 2 and not _TENANT_NAME.match(fields[1]):
                    raise KeyFileError(f"{path}:{number}: a tenant name is 1-64 letters, digits "
                                       "and _ . @ : -")
                if key in seen:
                    raise KeyFileError(f"{path}:{number}: the same key as line {seen[key]}")
                seen[key] = number
                pairs.append((key.encode(), fields[1] if len(fields) == 2 else LINE_TENANT.format(number)))
            if not pairs:
                raise KeyFileError(f"{path}: no keys in the file")
        if env_key:
            if not _KEY.match(env_key):
                raise KeyFileError("MASHBOX_API_KEY: a key must be at least 8 visible ASCII characters")
            pairs.append((env_key.encode(), ENV_TENANT))
        return cls(pairs, path, env_key)

    def tenant_for(self, key: str | None) -> str | None:
        """The key's tenant, or None. Compares against every key in constant time per key, with no early
        exit, so the time taken says nothing about which key or how much of one matched."""
        if key is None:
            return None
        given = key.encode("latin-1", "replace")
        found = None
        for known, tenant in self._pairs:
            if hmac.compare_digest(known, given) and found is None:
                found = tenant
        return found


def request_keys(req) -> list[str]:
    """The keys a request carries: `Authorization: Bearer KEY` and/or `x-api-key: KEY` (never the
    query). A client configured with both (an auth token and an API key) is let in by either."""
    keys = []
    auth = req.header("authorization")
    if auth and auth[:7].lower() == "bearer ":
        keys.append(auth[7:].strip())
    if req.header("x-api-key") is not None:
        keys.append(req.header("x-api-key"))
    return keys


# The port of a Host header or an authority: digits only, or nothing after the colon (RFC 3986 s3.2.3).
_PORT = re.compile(r"[0-9]{0,5}\Z")


def _host_name(value: str) -> str | None:
    """The host part of a Host header or of an Origin's authority, lowercased, brackets kept for IPv6;
    None when what follows the host is not a port (`localhost:evil.com` names no host of ours)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[:end + 1], value[end + 1:]
    elif value.count(":") == 1:
        name, rest = value.split(":")
        rest = ":" + rest
    else:
        return value
    if rest and not (rest.startswith(":") and _PORT.match(rest[1:])):
        return None
    return name


class Guard:
    """Who may ask: keys (401), browser protection (403: other origins, DNS rebinding), content type (415).

    Node clients send `sec-fetch-mode: cors` and Claude Code `anthropic-dangerous-direct-browser-access`
    without an Origin: those are not browser requests from another origin, and pass.

    The keys are swapped whole on reload_keys (SIGHUP): check() reads self.keys once, so a request is
    judged by the old set or the new, never a mix, and no connection is touched.
    """

    def __init__(self, keys: Keys, bind_host: str, allowed_hosts: tuple[str, ...] = ()):
        self.keys = keys
        names = {n.lower() for n in LOOPBACK_NAMES} | {"[::1]"} | {h.lower() for h in allowed_hosts}
        names.add(bind_host.lower() if ":" not in bind_host else f"[{bind_host.lower()}]")
        self.allowed_hosts = names
        # Bound to every address: clients reach it by any of the machine's addresses, which the server
        # cannot list; IP literals are then accepted (no DNS name is involved, so no rebinding).
        self.any_address = bind_host in ("0.0.0.0", "::", "")

    def _host_ok(self, host: str) -> bool:
        name = _host_name(host)
        if name is None:
            return False
        if name in self.allowed_hosts:
            return True
        if self.any_address:
            import ipaddress
            try:
                ipaddress.ip_address(name.strip("[]"))
                return True
            except ValueError:
                return False
        return False

    def check(self, req, needs_key: bool) -> str:
        """Raise ApiError(401/403/415) or return the request's tenant. HEAD needs no key: its answer
        has no body, and probes use it."""
        tenant = self.check_head(req, needs_key)
        self.check_content_type(req)
        return tenant

    def check_head(self, req, needs_key: bool) -> str:
        """Host and Origin (403), then the key (401): what the head alone decides, so the connection
        answers before reading a body, and before saying whether a path exists (404/405)."""
        # An absolute-form target names the host itself, and the Host header is then ignored.
        host = getattr(req, "authority", None) or req.header("host")
        if host is not None and not self._host_ok(host):
            raise ApiError(403, "this server does not answer to the host name in the Host header",
                           code="unknown_host")
        origin = req.header("origin")
        if origin is not None:
            scheme, _, authority = origin.partition("://")
            if scheme not in ("http", "https") or host is None or authority.lower() != host.strip().lower():
                raise ApiError(403, "requests from web pages of another origin are refused",
                               code="cross_origin")
        keys = self.keys
        tenant = DEFAULT_TENANT
        if keys.enabled and needs_key and req.method != "HEAD":
            tenant = next((t for t in map(keys.tenant_for, request_keys(req)) if t is not None), None)
            if tenant is None:
                raise ApiError(401, self._no_key_message(req), code="invalid_api_key")
        return tenant

    def keyed(self, req) -> bool:
        """Whether keys are off or req carries a valid one (open routes say more to a keyed caller)."""
        keys = self.keys
        return not keys.enabled or any(keys.tenant_for(k) is not None for k in request_keys(req))

    @staticmethod
    def check_content_type(req) -> None:
        """415 for a POST whose body is not JSON."""
        if req.method == "POST":
            ctype = (req.header("content-type") or "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                raise ApiError(415, "the request body must be Content-Type: application/json",
                               code="unsupported_media_type")

    @staticmethod
    def _no_key_message(req) -> str:
        sent = "a wrong API key" if request_keys(req) else "no API key"
        in_query = [name for name in getattr(req, "query", {}) or {} if name.lower() in QUERY_KEY_NAMES]
        hint = (f"; keys in the URL ({in_query[0]}=...) are never read" if in_query else "")
        return (f"{sent} was sent: send one as Authorization: Bearer KEY or x-api-key: KEY{hint}")

    def reload_keys(self) -> bool:
        """Re-read the key file (on SIGHUP). A file that does not load keeps the old keys, and the log
        says which line is wrong."""
        old = self.keys
        if old.path is None:
            log.info("SIGHUP: no key file to re-read")
            return False
        try:
            new = Keys.load(old.path, old.env_key)
        except KeyFileError as e:
            log.error("key file not re-read, the old keys stay in use: %s", e)
            return False
        self.keys = new
        log.info("key file re-read: %d keys, %d tenants", len(new), new.tenants)
        return True


def reload_keys_on_sighup(guard: "Guard | None", loop: asyncio.AbstractEventLoop) -> None:
    """`kill -HUP` re-reads the key file; open connections and waiting requests are not touched."""
    if guard is None or not hasattr(signal, "SIGHUP"):
        return
    try:
        loop.add_signal_handler(signal.SIGHUP, guard.reload_keys)
    except (NotImplementedError, RuntimeError):
        pass   # not the main thread: nothing to install


# =================================================================================================
# Admission: per-tenant and global waiting queues
# =================================================================================================

# The spec's limits: one tenant may have this many requests waiting for a slot, and the server this
# many in all. Past either the request is refused at once (429 / 529 with Retry-After) instead of
# queueing for minutes behind work the client will have given up on.
MAX_WAITING_PER_TENANT = 32
MAX_WAITING_TOTAL = 256
# What a refused client is told to wait: roughly one short answer's time on a busy server.
RETRY_AFTER_BUSY_S = 2
# count_tokens requests are never queued for a slot, but each tokenizes a whole prompt (a core for
# about 0.3 s per 250 KB), one at a time (App.counting_lane): one tenant may have this many in flight,
# the server this many in all. Claude Code sends bursts of 26 at its start; past either limit, 529
# with Retry-After (the spec's answer for a busy server).
MAX_COUNTING_PER_TENANT = 32
MAX_COUNTING_TOTAL = 128
# While the model loads or its worker restarts: loading takes tens of seconds, so poll gently.
RETRY_AFTER_LOADING_S = 5


class Rejected(Exception):
    """Admission refused a request; reason is a metrics label ("tenant_queue_full", "queue_full")."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Admission:
    """Requests wait here for a slot. The engine is never given more requests than it has slots, so the
    order in which this queue lets them in is the order they run: when a slot frees, waiting tenants
    take turns (round robin over tenants, first come first served within a tenant), so one tenant's
    flood cannot starve another's single request.
    """

    def __init__(self, slots: int, per_tenant: int = MAX_WAITING_PER_TENANT,
                 total: int = MAX_WAITING_TOTAL):
        self.slots = slots
        self.per_tenant = per_tenant
        self.total = total
        self.running = 0
        self._waiting: dict[str, "deque[asyncio.Future]"] = {}
        self._turns: "deque[str]" = deque()   # tenants with waiters, in round-robin order

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def enter(self, tenant: str) -> "asyncio.Future | None":
        """Take a slot now (returns None) or a place in the queue (a future that resolves when the slot
        is yours). Raises Rejected when the tenant's or the server's queue is full."""
        if self.running < self.slots and not self._turns:
            self.running += 1
            return None
        queue_ = self._waiting.get(tenant)
        if queue_ is not None and len(queue_) >= self.per_tenant:
            raise Rejected("tenant_queue_full")
        if self.waiting >= self.total:
            raise Rejected("queue_full")
        if queue_ is None:
            queue_ = self._waiting[tenant] = deque()
            self._turns.append(tenant)
        fut = asyncio.get_running_loop().create_future()
        queue_.append(fut)
        return fut

    def leave_queue(self, tenant: str, fut: "asyncio.Future") -> None:
        """A waiter gave up (its client left): drop it, or hand back the slot it was just given."""
        queue_ = self._waiting.get(tenant)
        if queue_ is not None and fut in queue_:
            queue_.remove(fut)
            if not queue_:
                del self._waiting[tenant]
                self._turns.remove(tenant)
        elif fut.done() and not fut.cancelled():
            self.release()

    def release(self) -> None:
        """A running request ended: give its slot to the next tenant in turn."""
        self.running -= 1
        while self._turns and self.running < self.slots:
            tenant = self._turns.popleft()
            queue_ = self._waiting[tenant]
            fut = queue_.popleft()
            if queue_:
                self._turns.append(tenant)   # back of the line: the other tenants go first
            else:
                del self._waiting[tenant]
            if not fut.done():
                self.running += 1
                fut.set_result(None)

    def resize(self, slots: int) -> None:
        """The worker reported its slot count (at start and after a restart)."""
        self.slots = slots
        self.running += 1
        self.release()


# =================================================================================================
# Generation: one request through the template, the engine, the output parser and its API's encoder
# =================================================================================================

# Anthropic and Responses clients run watchdogs on silent streams; a frame this often while a long
# prompt is prefilled (a 15k-token Claude Code prompt takes about a minute on a CPU) keeps them calm.
KEEPALIVE_S = 5.0

# The spec's retry rule: a request whose client has received no output is sent again once.
RETRIES_AFTER_FAULT = 1

# A request whose worker died waits this long for the new one before it is answered 503/529: a restart
# loads the weights and compiles again (tens of seconds on a CPU with the compile cache); a worker not
# back by then is failing again and again, and the client is better told to come back later.
RESTART_WAIT_S = 300.0


async def handle_generation(app, req, out, fmt: "ApiFormat", tenant: str) -> None:
    """One POST to a generation route: parse, then admit_and_run; whatever happened, log and count."""
    t0 = time.monotonic()
    outcome = Outcome()
    job = None
    try:
        job = await parse_body(req, fmt)
        job.session = job.session or req.header("x-session-id")
        await admit_and_run(app, req, out, fmt, job, tenant, outcome, t0)
    except ApiError as e:
        outcome.status, outcome.finish, outcome.error = e.status, outcome.finish or "error", e.message
        raise
    except ClientGone:
        outcome.status, outcome.finish = 499, "abort"   # 499: nginx's "client closed request"
        raise
    finally:
        e2e = time.monotonic() - t0
        # The whole wait before the request ran: the server's queue and the worker's (from timings).
        waited = outcome.timings["queue_ms"] / 1000 if outcome.timings else outcome.queue_s
        ttft = outcome.first_token_at - t0 if outcome.admitted and outcome.first_token_at else None
        if outcome.admitted:   # requests refused before they ran are counted by their rejection
            decode = (time.monotonic() - outcome.first_token_at) if outcome.first_token_at else None
            app.metrics.request_done(outcome.finish or "stop", outcome.usage, waited, e2e, ttft, decode)
            app.metrics.constrained_done(outcome.constrained, outcome.mask_s)
            app.metrics.drafts_done(outcome.timings)
        app.log(request_log_line(req.method, req.path, outcome, outcome.prompt_tokens, waited, e2e,
                                 job.session if job is not None else None, ttft))


async def admit_and_run(app, req, out, fmt: "ApiFormat", job: Job, tenant: str, outcome: Outcome,
                        t0: float) -> None:
    """Refuse what cannot run now (stopping, loading, an unknown model, admission's limits), render the
    prompt while the request waits for its slot, then run_generation; the slot goes back as soon as
    the engine is done with the request."""
    if app.bridge.closing:
        raise stopping_error(fmt.anthropic)
    if app.bridge.status != "ok":
        app.metrics["admission_rejections_total"].inc(reason="loading")
        raise not_ready_error(fmt.anthropic)
    if not fmt.anthropic:
        check_model(app, job.model)
    # Admission first: a tenant past its limit (or a full server) is refused before its prompt
    # costs any tokenizing; what is admitted is rendered while it waits for its slot.
    try:
        ticket = app.admission.enter(tenant)
    except Rejected as r:
        app.metrics["admission_rejections_total"].inc(reason=r.reason)
        raise rejected_error(fmt.anthropic, r.reason)
    released = False

    def engine_done() -> None:
        """The slot (or the queue place) goes back: at once when the engine is done with it."""
        nonlocal released
        if not released:
            released = True
            if ticket is None:
                app.admission.release()
            else:
                app.admission.leave_queue(tenant, ticket)
    app.bridge.enter()   # from here a shutdown waits for this request (its grace period)
    try:
        prompt = await render_prompt(app, job, fmt)
        outcome.prompt_tokens = len(prompt)
        if app.config.log_prompts:
            log_prompt(app.tokenizer, prompt, req.path, job.session)
        if ticket is not None:
            try:
                await _wait_admitted(ticket, out.gone, app.bridge.ended)
            except ServerStopping:
                raise stopping_error(fmt.anthropic) from None
        outcome.queue_s = time.monotonic() - t0
        outcome.admitted, outcome.admitted_at = True, t0 + outcome.queue_s
        await run_generation(app, req, out, fmt, job, prompt, outcome, engine_done)
    finally:
        engine_done()
        app.bridge.leave()


async def _wait_admitted(ticket: asyncio.Future, gone: asyncio.Event, ended: asyncio.Event) -> None:
    """Wait for a slot. Raises ClientGone if the client leaves first, ServerStopping if the shutdown's
    grace period ends first (either way the caller gives its place up)."""
    left = asyncio.ensure_future(gone.wait())
    stopped = asyncio.ensure_future(ended.wait())
    try:
        done, _ = await asyncio.wait({ticket, left, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        stopped.cancel()
    if ticket not in done:
        raise ServerStopping() if stopped in done else ClientGone()


async def handle_count_tokens(app, req, out, fmt: "ApiFormat") -> None:
    """Anthropic count_tokens: exactly the prompt the Messages route would prefill. Never queued."""
    if app.bridge.status != "ok":
        raise not_ready_error(True)
    tenant = req.tenant or DEFAULT_TENANT
    counting = app.counting
    if counting.get(tenant, 0) >= MAX_COUNTING_PER_TENANT or sum(counting.values()) >= MAX_COUNTING_TOTAL:
        app.metrics["admission_rejections_total"].inc(reason="counting_full")
        raise ApiError(529, "too many token counts are running; retry after a moment",
                       type="overloaded_error", code="counting_full",
                       headers=(("Retry-After", str(RETRY_AFTER_BUSY_S)),))
    counting[tenant] = counting.get(tenant, 0) + 1
    try:
        job = await parse_body(req, fmt, COUNTED_FIELDS)
        await out.json(200, {"input_tokens": await render_prompt(app, job, fmt, count_only=True)})
    finally:
        counting[tenant] -= 1
        if not counting[tenant]:
            del counting[tenant]


# ---- the body: JSON parsed within bounds, off the loop when large ---------------------------------

# A lone surrogate (half of a UTF-16 pair) can only come from a \uD800-\uDFFF escape: a valid pair
# becomes one character, and the body is strict UTF-8. Such text cannot be tokenized, logged or sent
# back, so strings are searched for one only when an escape like it occurs.
_SURROGATE_HINT = re.compile(r"\\u[dD][89a-fA-F]")

LONE_SURROGATE = "with a lone UTF-16 surrogate (half of a pair) is not valid Unicode"

DEEPER = f"nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays"


def _check_tree(doc: Any, strings: bool) -> tuple[str, str] | None:
    """Where and why a parsed body cannot be served (place e.g. `messages[0].content`): nesting
    deeper than MAX_JSON_DEPTH, or (strings=True) a lone surrogate in a string or key. One walk, linear
    in the body: a place's name is made only for the value found, and only objects and arrays are
    stacked (a 100,000-value enum makes no garbage for the collector to walk)."""
    stack: list[tuple[Any, int, Any]] = [(doc, 1, None)]   # (value, depth, (parent's link, key))
    while stack:
        node, depth, link = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return _place(link, 3), DEEPER
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if strings and isinstance(key, str) and not _utf8(key):
                return _place(link), f"a key {LONE_SURROGATE}"
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, (link, key)))
            elif strings and isinstance(value, str) and not _utf8(value):
                return _place((link, key)), f"text {LONE_SURROGATE}"
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _place(link: Any, most: int = MAX_JSON_DEPTH) -> str:
    """messages[0].content from the links (parent's link, key) of _check_tree: its first `most` keys."""
    keys = []
    while link is not None:
        link, key = link
        keys.append(key)
    keys.reverse()
    out = ""
    for key in keys[:most]:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return (out + ("..." if len(keys) > most else "")) or "body"


# A body this large is parsed in a thread, and every prompt is rendered in one: Python hands the GIL
# back to the event loop every few milliseconds, so /health and other requests wait for a slice, not
# for the whole of it (10,000 tools: about 130 ms of parsing and rendering on a quiet 2-core CPU).
PARSE_IN_THREAD_BYTES = 64 * 1024


async def parse_body(req, fmt: "ApiFormat", fields: frozenset[str] | None = None) -> Job:
    """The request's Job (fmt.parse of its JSON body; of its `fields` alone when given, the others
    ignored unread), off the event loop when the body is large."""
    def parse():
        body = json_body(req)
        return fmt.parse(body if fields is None else {k: v for k, v in body.items() if k in fields})
    if len(req.body) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse)
    return parse()


def json_body(req) -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it: not UTF-8 (a
    UTF-16 or UTF-32 body, which json.loads would otherwise guess), more than MAX_JSON_VALUES values
    (counted before the parse), not JSON, nested too deeply, or a lone surrogate."""
    raw = req.body
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"body: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r}); JSON "
                            "bodies must be UTF-8") from None
    values = raw.count(b"{") + raw.count(b"[") + raw.count(b",") + raw.count(b":")
    if values > MAX_JSON_VALUES:
        raise ApiError(400, f"body: more than {MAX_JSON_VALUES} JSON values ({values} brackets, commas "
                            "and colons)")
    try:
        body = json.loads(text)
    except ValueError as e:
        raise ApiError(400, f"body: not valid JSON ({e})") from None
    except RecursionError:   # json's decoder recurses once per level: thousands of [ overflow it
        raise ApiError(400, f"body: {DEEPER}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(body).__name__}")
    found = _check_tree(body, strings=_SURROGATE_HINT.search(text) is not None)
    if found is not None:
        place, why = found
        raise ApiError(400, f"{place}: {why}", param=None if place == "body" else place)
    return body


# ---- refusals, in each API's words ----------------------------------------------------------------

def _retry_shortly(fmt_anthropic: bool, why: str) -> ApiError:
    """503 (OpenAI) / 529 overloaded (Anthropic) with Retry-After: the server will answer this request
    again soon, so the client is told to retry (x-should-retry on Anthropic routes)."""
    headers = (("Retry-After", str(RETRY_AFTER_LOADING_S)),)
    if fmt_anthropic:
        return ApiError(529, f"{why}; retry shortly", type="overloaded_error",
                        headers=headers + (("x-should-retry", "true"),))
    return ApiError(503, f"{why}; retry shortly", type="unavailable", headers=headers)


def not_ready_error(fmt_anthropic: bool) -> ApiError:
    """While the model loads or its worker restarts."""
    return _retry_shortly(fmt_anthropic, "the model is loading")


def stopping_error(fmt_anthropic: bool) -> ApiError:
    """For a request that a shutting-down server will not run or finish (a restarted server will)."""
    return _retry_shortly(fmt_anthropic, "the server is shutting down")


def rejected_error(fmt_anthropic: bool, reason: str) -> ApiError:
    """What admission's refusal sounds like in each API (the spec's 429 and 529): a tenant past its own
    limit is rate-limited (429 everywhere, Anthropic's rate_limit_error); a full server queue is 429 on
    OpenAI routes and Anthropic's 529 overloaded_error on Messages. Both with Retry-After."""
    headers = (("Retry-After", str(RETRY_AFTER_BUSY_S)),)
    if reason == "tenant_queue_full":
        return ApiError(429, "too many of your requests are waiting for a slot", type="unavailable",
                        code=reason, headers=headers)
    why = "the server's queue is full"
    if fmt_anthropic:
        return ApiError(529, why, type="overloaded_error", code=reason, headers=headers)
    return ApiError(429, why, type="unavailable", code=reason, headers=headers)


def check_model(app, name: str | None) -> None:
    """The spec's 404 on the OpenAI routes: a model id other than the one served (or its Hugging Face
    repo name, spelled as models.json gives it) is model_not_found, and the message names the served
    id so the user can fix the client's configuration. Leaving model out is accepted. Messages accepts
    any name (Claude Code sends claude-*) and never calls this."""
    served = app.bridge.facts.id
    if name and name != served and name not in app.model_aliases:
        raise model_not_found(name, served, f" (send model '{served}' or leave it out)")


def model_not_found(name: str, served: str, hint: str = "") -> ApiError:
    """The spec's 404 for a model id this server does not serve (generation routes, /v1/models/{id})."""
    return ApiError(404, f"model: '{name}' is not served here; this server runs '{served}'{hint}",
                    code="model_not_found", param="model")


# ---- the prompt: the one template, then its tokens ------------------------------------------------

# Prompts up to this many characters are tokenized in a thread of the server, by encode_batch, which
# lets go of the GIL (encode holds it, pausing the loop: docs/limits.md, "Long prompts"). Longer ones
# go to the tokenizer process (TokenizerProcess), one at a time: tokenizing takes
# about 150 bytes a character, which a process gives back to the system when it ends.
TOKENIZE_IN_THREAD_CHARS = 256 * 1024

# Prompts tokenized in threads at once: each keeps a core busy, and the event loop needs one too.
# Generation requests (bounded by admission) take up to TOKENIZING_THREADS; count_tokens requests
# take one lane of their own, so a flood of them never delays another tenant's generation.
TOKENIZING_THREADS = 2
COUNTING_THREADS = 1

# The tokenizer process is replaced after a prompt this long, to give back what tokenizing it took.
TOKENIZER_RECYCLE_CHARS = 1024 * 1024


class TokenizerProcess:
    """A process of its own that tokenizes long prompts (chat.serve_tokenizer), started on first use
    and replaced after each very long prompt. One prompt at a time: long prompts wait their turn here
    (each still holds its body, which the connections' byte budget bounds) instead of tokenizing
    together; short prompts never come here."""

    def __init__(self, folder: str):
        self.folder = folder
        self._lock = asyncio.Lock()
        self._proc = None
        self._conn = None

    async def encode(self, prompt: chat.PromptText, limit: int) -> tuple[int, list[int] | None]:
        """(number of tokens, the ids, or None when there are more than limit)."""
        async with self._lock:
            return await asyncio.to_thread(self._encode, prompt, limit)

    def _encode(self, prompt: chat.PromptText, limit: int) -> tuple[int, list[int] | None]:
        import array
        import multiprocessing
        if self._proc is None or not self._proc.is_alive():
            self.close()
            context = multiprocessing.get_context("spawn")
            self._conn, theirs = context.Pipe()
            self._proc = context.Process(target=chat.serve_tokenizer, args=(theirs, self.folder),
                                         name="mashbox-tokenizer", daemon=True)
            self._proc.start()
            theirs.close()
        try:
            self._conn.send((prompt, limit))
            count, data = self._conn.recv()
        except (EOFError, OSError) as e:
            self.close()
            raise ApiError(500, f"the tokenizer process failed: {e}", type="server_error") from None
        if prompt.chars > TOKENIZER_RECYCLE_CHARS:
            self.close()
        if not data:
            return count, None
        ids = array.array("i")
        ids.frombytes(data)
        return count, ids.tolist()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        self._proc = self._conn = None


def prompt_too_long(tokens: str, ctx: int, field: str) -> ApiError:
    return ApiError(400, f"{field}: the prompt is {tokens} tokens, and the context holds {ctx} (with room "
                         "for at least one new token)", param=field)


async def render_prompt(app, job: Job, fmt: "ApiFormat", count_only: bool = False) -> list[int] | int:
    """The one template (rendered in a thread), then its tokens, without stalling the event loop: a
    prompt that cannot fit the context (a token stands for at most max_token_bytes characters) is
    refused before any of it is tokenized; a short one is tokenized in a thread, a long one in the
    tokenizer process, both by chat.Tokenizer.encode_prompt (the client's text as text, the template's
    control tokens as tokens). A prompt longer than the context is a 400 with both numbers.
    count_only: the number of tokens, whatever it is (count_tokens), under the same character bound."""
    facts, tok = app.bridge.facts, app.tokenizer
    if not facts or tok is None:
        raise not_ready_error(False)
    try:
        prompt = await asyncio.to_thread(chat.render_runs, job, facts.chat_format)
    except chat.TemplateError as e:           # a conversation the model's own template refuses
        raise bad_field(fmt.prompt_field, str(e)) from None
    ctx, chars = facts.max_model_len, prompt.chars
    if chars > (ctx - 1) * tok.max_token_bytes:
        least = -(-chars // tok.max_token_bytes)
        raise prompt_too_long(f"{chars} characters, so at least {least}", ctx, fmt.prompt_field)
    if chars <= TOKENIZE_IN_THREAD_CHARS:
        async with app.counting_lane if count_only else app.tokenizing:
            ids = await asyncio.to_thread(tok.encode_prompt, prompt)
        count = len(ids)
    else:
        if app.tokenizer_process is None or app.tokenizer_process.folder != facts.folder:
            app.tokenizer_process = TokenizerProcess(facts.folder)
        count, ids = await app.tokenizer_process.encode(prompt, 0 if count_only else ctx - 1)
    if count_only:
        return count
    if count >= ctx:
        raise prompt_too_long(str(count), ctx, fmt.prompt_field)
    return ids


# ---- the answer: attempts, and each step from the engine to the client ----------------------------

@dataclass
class Outcome:
    """What the request log line and the metrics need to know about a finished request."""
    status: int = 200
    finish: str = ""
    usage: chat.Usage | None = None
    timings: dict | None = None
    first_token_at: float | None = None
    retried: bool = False
    admitted: bool = False
    admitted_at: float | None = None   # time.monotonic() when admission let it run
    queue_s: float = 0.0               # arrival to admitted: parse, render and the admission queue
    prompt_tokens: int = 0             # the rendered prompt's length, once rendered
    constrained: str | None = None     # the Constraint mode its tool calls ran under (engine.grammar)
    mask_s: float = 0.0                # host time its token masks took
    error: str | None = None           # the message its error answer gave the client


def cache_tenant_label(req) -> str:
    """The opaque label the host cache's fairness rule counts bytes by: a hash of the tenant, so the
    worker never holds a tenant's name."""
    import hashlib
    return hashlib.sha256(str(getattr(req, "tenant", "") or "").encode()).hexdigest()[:16]


class _Delivery:
    """What one request has sent its client so far, across attempts (run_generation's retry rule reads
    sent_output)."""

    def __init__(self, out, job: Job, encoder):
        self.out = out
        self.enc = encoder if job.stream else None     # a stream's one encoder, across attempts
        self.started = True          # the encoder's start frames were sent
        self.sent_output = False     # a streamed client has text, reasoning or a tool call: never retry
        self.keepalive = None
        if job.stream:
            self.started = not encoder.starts_on_admission
            # Before the start frames, an SSE comment: every client skips it (an Anthropic ping
            # before message_start would break the SDK's stream accumulator).
            self.keepalive = lambda: out.event(encoder.keepalive() if self.started else SSE_COMMENT, False)

    async def begin(self) -> None:
        """The stream's head and start frames, left in the connection's buffer: the request holds its
        slot, and a client that reads nothing must not keep it (the stall timeout cuts it off)."""
        await self.out.start_stream(wait=False)
        if self.started:
            for frame in self.enc.start():
                await self.out.event(frame, False)


async def run_generation(app, req, out, fmt: "ApiFormat", job: Job, prompt: list[int],
                         outcome: Outcome, engine_done: Callable[[], None] = lambda: None) -> None:
    """Generate for one parsed, rendered, admitted request and write its answer (JSON or SSE).

    Owns the spec's retry rule (run_attempts; one attempt is run_attempt). When the worker dies (or the device fails
    this request) before the client has received any output, the request is sent again once, from the
    start, to the next worker: not streamed, until its response is written; streamed, until its first
    output is sent (the frames of enc.start() are not output). A failure after that, or of the retry,
    is a 500 in the route's shape; a started stream ends with its encoder's error frames, which carry
    the response id. A shutdown whose grace period ran out ends the request the same way with 503/529.

    Frames are left in the connection's buffer while the engine works (a slow reader does not hold the
    engine's answer back), and engine_done() is called as soon as the engine has finished with the
    request, before the rest is written: its slot goes to the next request, and what a slow client has
    still to read is bounded output, cut off by the stall timeout like any other.
    """
    meta, max_tokens = answer_meta(app.bridge.facts, fmt, job, prompt)
    delivery = _Delivery(out, job, fmt.encoder(job, meta) if job.stream else None)
    if job.stream:
        await delivery.begin()
    encoder, err = await run_attempts(app, req, fmt, job, prompt, max_tokens, meta, delivery, outcome)
    engine_done()
    await write_answer(out, job, delivery, encoder, err, outcome)


def answer_meta(facts, fmt: "ApiFormat", job: Job, prompt: list[int]) -> tuple[Meta, int]:
    """The answer's id, model name (the client's where its API echoes it) and prompt length, and the
    most tokens it may generate: what it asked for, within what the context leaves."""
    room = facts.max_model_len - len(prompt)
    max_tokens = room if job.max_tokens is None else min(job.max_tokens, room)
    answer_model = (job.model or facts.id) if fmt.echoes_model else facts.id
    return Meta(id=new_id(fmt.id_prefix), created=int(time.time()), model=answer_model,
                prompt_tokens=len(prompt)), max_tokens


async def run_attempts(app, req, fmt: "ApiFormat", job: Job, prompt: list[int], max_tokens: int, meta: Meta,
                       delivery: _Delivery, outcome: Outcome) -> tuple[Any, ApiError | None]:
    """The retry rule's loop over run_attempt: once, and once more where the worker died before the
    client had any output. Returns the last attempt's encoder and the error that ended the request
    (None: it finished); a client gone, stalled or a server stopping at once is raised."""
    bridge, rid = app.bridge, meta.id
    err: ApiError | None = None
    for attempt in range(RETRIES_AFTER_FAULT + 1):
        encoder = delivery.enc if job.stream else fmt.encoder(job, meta)
        sub_id = rid if attempt == 0 else f"{rid}-retry{attempt}"
        try:
            await run_attempt(app, req, fmt, job, prompt, max_tokens, sub_id, encoder, delivery, outcome)
        except WorkerDied as died:
            bridge.cancel(sub_id)
            if not delivery.sent_output and attempt < RETRIES_AFTER_FAULT:
                outcome.retried = True
                app.log(f"{rid}: {died}; nothing was sent yet, so it runs again from the start")
                continue
            err = ApiError(500, f"the request failed on the device: {died}", type="server_error")
        except ServerStopping:
            bridge.cancel(sub_id)
            err = stopping_error(fmt.anthropic)
        except ApiError as e:                    # no worker came back in time
            err = e
        except ClientGone:
            bridge.cancel(sub_id)
            outcome.finish = outcome.finish or "abort"
            raise
        except Exception:                        # a bug reading or encoding the output
            bridge.cancel(sub_id)
            log.exception("%s: the answer could not be written", rid)
            err = ApiError(500, "internal server error", type="server_error")
        except BaseException:
            bridge.cancel(sub_id)   # client gone, stalled or server stopping: free the slot at once
            outcome.finish = outcome.finish or "abort"
            raise
        break
    return encoder, err


async def write_answer(out, job: Job, delivery: _Delivery, encoder, err: ApiError | None, outcome: Outcome) -> None:
    """The answer's end: a stream's last frames, or the whole JSON body; for an error, a raised ApiError
    (not streamed: its route answers it) or the stream's error frames."""
    if err is None:
        if job.stream:
            await out.end_stream()
        else:
            await out.json(200, encoder.body())
        return
    outcome.status, outcome.finish = err.status, "error"
    if not job.stream:
        raise err
    for frame in delivery.enc.error(err):
        await out.event(frame)
    await out.end_stream()


async def _wait_for_worker(app, gone: asyncio.Event, keepalive: Callable[[], Awaitable[None]] | None,
                           anthropic: bool) -> None:
    """Return once the worker is ready (at once when it is). Meanwhile a stream gets a keep-alive frame
    every KEEPALIVE_S. Raises ClientGone, ServerStopping, or the not-ready error after RESTART_WAIT_S."""
    bridge = app.bridge
    deadline = time.monotonic() + RESTART_WAIT_S
    while bridge.status != "ok":
        if bridge.ended.is_set():
            raise ServerStopping()
        if gone.is_set():
            raise ClientGone()
        left = deadline - time.monotonic()
        if left <= 0:
            raise not_ready_error(anthropic)
        waits = [asyncio.ensure_future(w) for w in (app.wait_ready(), gone.wait(), bridge.ended.wait())]
        try:
            await asyncio.wait(waits, timeout=min(KEEPALIVE_S, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if bridge.status != "ok" and keepalive is not None and not gone.is_set():
            await keepalive()


async def run_attempt(app, req, fmt: "ApiFormat", job: Job, prompt: list[int], max_tokens: int,
                      sub_id: str, encoder, delivery: _Delivery, outcome: Outcome) -> None:
    """One attempt: wait for a ready worker, submit, and feed each Step through the output parser and
    the encoder until the request finishes. Raises WorkerDied (the worker died, or the device failed
    this request), ServerStopping, or ApiError (no worker came back in time)."""
    bridge, tok, out = app.bridge, app.tokenizer, delivery.out
    parser = chat.OutputParser(tok, job, bridge.facts.chat_format)
    usage = chat.Usage(prompt_tokens=len(prompt))
    outcome.usage = usage   # so far: a request that ends early is still counted and logged
    await _wait_for_worker(app, out.gone, delivery.keepalive, fmt.anthropic)
    facts = bridge.facts
    q = bridge.submit(protocol.Submit(
        rid=sub_id, prompt=prompt, max_tokens=max_tokens, sampling=job.sampling,
        stop_ids=list(tok.stop_ids), submitted_at=time.time(),
        cuts=chat.turn_boundaries(prompt, tok), tenant=cache_tenant_label(req),
        constraint=chat.tool_constraint(job, facts.chat_format) if facts.grammar else None))
    while True:
        step = await _next_step(q, out.gone, KEEPALIVE_S)
        if step is None:
            if delivery.keepalive is not None:
                await delivery.keepalive()
            continue
        if isinstance(step, BaseException):
            raise step                   # WorkerDied or ServerStopping
        if step.finish == "error":
            raise WorkerDied(f"device error: {step.error or 'unknown'}")
        if step.prompt_tokens:
            usage.prompt_tokens, usage.cached_tokens = step.prompt_tokens, step.cached_tokens
        if not delivery.started:         # the worker gave the prompt a slot (or answered already)
            delivery.started = True
            encoder.admitted(usage)
            for frame in encoder.start():
                await out.event(frame, False)
        if step.tokens and outcome.first_token_at is None:
            outcome.first_token_at = time.monotonic()
        usage.completion_tokens += len(step.tokens)
        events = parser.feed(step.tokens)
        finish = step.finish
        if parser.stop_hit and finish is None:
            bridge.cancel(sub_id)        # a stop string ended the text: free the slot now
            finish = "stop"
        if finish is not None:
            outcome.timings = _timings(step.timings, usage, outcome)
            outcome.constrained, outcome.mask_s = step.constrained, step.mask_ms / 1000
            events += parser.finish(finish, usage, outcome.timings)
        for ev in events:
            frames = encoder.feed(ev)
            if isinstance(ev, chat.Done):
                outcome.finish, outcome.usage = ev.finish_reason, ev.usage
            if job.stream and frames:
                delivery.sent_output = delivery.sent_output or not isinstance(ev, chat.Done)
                for frame in frames:
                    await out.event(frame, False)
        if finish is not None:
            return


async def _next_step(q: asyncio.Queue, gone: asyncio.Event, timeout: float):
    """The next Step (or WorkerDied) for a request; None on timeout; raises ClientGone if the client left."""
    if gone.is_set():
        raise ClientGone()
    get = asyncio.ensure_future(q.get())
    left = asyncio.ensure_future(gone.wait())
    try:
        done, _ = await asyncio.wait({get, left}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not get.done():
            get.cancel()
    if get in done:
        return get.result()
    if left in done:
        raise ClientGone()
    return None


# Tokens drafted (from the conversation's text or the MTP layer) and those kept (engine.speculative):
# llama-server's names in the timings block; /metrics counts them, and the rounds that carried a
# draft (draft_rounds, not in the block), as vLLM's spec_decode counters.
DRAFT_TIMINGS = ("draft_n", "draft_n_accepted")


def _timings(step_timings: dict | None, usage: chat.Usage, outcome: "Outcome | None" = None) -> dict:
    """llama-server's timings block (ChatTimings) from what the worker measured, with queue_ms counting
    the wait in the server's admission queue too. Where the worker sent no timings (a stop string ended
    the answer before its last Step), the server's clock measures the same spans."""
    t = step_timings or {}
    now = time.monotonic()
    first = outcome.first_token_at if outcome is not None else None
    admitted = outcome.admitted_at if outcome is not None else None
    if "prompt_ms" in t:
        prompt_ms = float(t["prompt_ms"])
    else:
        prompt_ms = (first - admitted) * 1000 if first is not None and admitted is not None else 0.0
    if "predicted_ms" in t:
        predicted_ms = float(t["predicted_ms"])
    else:
        predicted_ms = (now - first) * 1000 if first is not None else 0.0
    waited_ms = outcome.queue_s * 1000 if outcome is not None else 0.0
    prompt_n = usage.prompt_tokens - usage.cached_tokens
    n = usage.completion_tokens
    return {
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_second": round(prompt_n / (prompt_ms / 1000), 3) if prompt_ms > 0 else None,
        "predicted_n": n,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_second": round((n - 1) / (predicted_ms / 1000), 3) if predicted_ms > 0 and n > 1 else None,
        "cache_n": usage.cached_tokens,
        "queue_ms": round(waited_ms + float(t.get("queue_ms", 0.0)), 3),
        # llama-server's drafting counts, where the engine drafts (engine.speculative)
        **{name: int(t[name]) for name in DRAFT_TIMINGS if name in t},
    }


# =================================================================================================
# Engine bridge: the worker process, its messages, supervision
# =================================================================================================

# The worker is started with multiprocessing's "spawn" so it never inherits the server's event loop,
# sockets or threads. Its entry point is named as "module:function" and imported only in the child:
# pickling a function reference would import its module here, and the real worker imports jax.
WORKER_ENTRY = "engine.worker:main"
# Several hosts: what `mashbox run --process-id I` (I > 0) runs instead of a server (follow_leader).
FOLLOWER_ENTRY = "engine.worker:follow"
# For tests only: `MASHBOX_WORKER_ENTRY=tests.fake_worker:main python -m mashbox run ...` serves the
# fake engine, so the CLI's signals and shutdown can be tested on a real process without a model.
WORKER_ENTRY_ENV = "MASHBOX_WORKER_ENTRY"
# A worker that dies again and again before it is ready is started again at once the first time, then
# after 1, 2, 4 ... s, at most RESTART_BACKOFF_MAX_S: a broken device or model must not spin the CPU,
# and the server itself never exits because its worker did.
RESTART_BACKOFF_FIRST_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# A worker whose batch makes no progress for this long is treated as stuck and replaced. The longest
# legitimate silence is one prefill chunk on a slow CPU, which the worker bounds to a few seconds.
STUCK_WORKER_S = 120.0
# How long a worker asked to shut down may take to finish its current step and exit before it is
# killed; and how long a dead worker's process is waited for, to read its exit status.
WORKER_EXIT_WAIT_S = 5.0
# How often the watchdog looks for a stuck worker: a hang is noticed within stuck_s and a few seconds.
WATCHDOG_POLL_S = 5.0


# One BLAS thread in the worker: the host does small numpy bookkeeping between device calls, and a
# BLAS pool would only compete with XLA's own threads for the cores. Measured with bench_engine on a
# 2-core CPU, 1 vs 2 BLAS threads side by side: decode and prefill speeds the same within the shared
# machine's noise (XLA's CPU kernels do not use the BLAS pool), so this is a guard, not a speed-up.
# It must be in the environment before numpy is first imported in the child, and a spawned child
# imports this module (numpy among its imports) before it runs the worker: so the parent puts it in
# the environment the child starts with.
WORKER_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def spawn_worker(entry: str, args) -> tuple[Any, Any]:
    """Start the worker process, the one way it is started: spawned (a fresh interpreter, never a fork
    of the server's threads), with WORKER_THREAD_ENV, running `entry` ("module:function", called with
    (connection, args)). Returns (process, connection); the connection speaks engine.protocol."""
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_worker_trampoline, args=(entry, theirs, args),
                              name="mashbox-worker", daemon=True)
    saved = {name: os.environ.get(name) for name in WORKER_THREAD_ENV}
    os.environ.update(WORKER_THREAD_ENV)
    try:
        process.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    theirs.close()
    return process, ours


def _worker_trampoline(entry: str, conn, args) -> None:
    """Runs in the child process: import the worker's module there, and run it. A model's files that
    do not read as its config says end it with exit status 1 and no traceback: the worker has sent the
    reason as a Fault, which the server logs (and stops on, when it repeats while loading)."""
    import importlib
    module, _, func = entry.partition(":")
    try:
        getattr(importlib.import_module(module), func)(conn, args)
    except (WeightsError, ConfigError):
        sys.exit(1)


def restart_delay(failures: int, first_s: float = RESTART_BACKOFF_FIRST_S,
                  most_s: float = RESTART_BACKOFF_MAX_S) -> float:
    """Seconds before starting a worker after `failures` deaths in a row: 0, then doubling."""
    if failures <= 1:
        return 0.0
    return min(most_s, first_s * 2.0 ** (failures - 2))


class WorkerDied(Exception):
    """The worker process went away while a request was in it."""


class ServerStopping(Exception):
    """The server is shutting down and the request's grace period ran out."""


def _exit_status(code: int | None) -> str:
    """A worker's exit code as a person reads it: "exit code 1", "killed by SIGKILL"."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Bridge:
    """The only owner of the worker process: starts it, sends it Submit/Cancel, routes its Steps to the
    request that waits for them, notices when it dies or hangs, and starts a new one.

    Threads: a reader thread per worker blocks on its pipe and hands each message to the event loop
    with call_soon_threadsafe; one writer thread sends (and closes pipes), so a worker busy with a long
    prefill never blocks the event loop. Everything else runs on the event loop.

    A death (pipe closed, a crash signal, an unreadable message, or no progress for stuck_s while
    requests wait) delivers WorkerDied to every live request, sets status "loading", counts a restart and
    starts a new worker. The requests themselves decide whether to run again (run_generation).

    It also counts the generation requests in flight (enter/leave), so that a shutting-down server can
    wait for them, and end the ones still running when its grace period is over (end_all).
    """

    def __init__(self, worker_args, entry: str = WORKER_ENTRY, log=log.warning, stuck_s: float = STUCK_WORKER_S,
                 backoff_first_s: float = RESTART_BACKOFF_FIRST_S,
                 backoff_max_s: float = RESTART_BACKOFF_MAX_S):
        self.worker_args, self.entry, self.log = worker_args, entry, log
        self.stuck_s, self.backoff_first_s, self.backoff_max_s = stuck_s, backoff_first_s, backoff_max_s
        self.status = "loading"          # "loading" until Ready, and again while a new worker starts
        self.facts = None                # protocol.ModelFacts once ready
        self.pid: int | None = None
        self.restarts = 0
        self.loading: tuple[str, int, int] | None = None   # (phase, done, total) for progress
        self.stats = None                # last protocol.Stats
        self.compiles_after_ready_before = 0   # summed over earlier worker processes
        self.closing = False             # the server takes no new requests (shutting down)
        self.ended = asyncio.Event()     # the grace period is over: requests still here end now
        self.in_flight = 0               # generation requests between enter() and leave()
        self._idle = asyncio.Event()     # set while in_flight == 0
        self._idle.set()
        self._streams: dict[str, asyncio.Queue] = {}
        self._proc = None
        self._conn = None
        self._outbox: "queue.Queue" = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._failures = 0               # consecutive deaths before a Ready, for the backoff
        self._load_fault: str | None = None    # the Fault the worker now loading sent, if any
        self._last_load_fault: str | None = None   # the one the worker before it died of while loading
        self.failed: str | None = None   # why the bridge gave up: the same fault twice while loading
        self.on_failed: list[Callable[[], None]] = []
        self._generation = 0             # which worker process a message came from
        self._last_progress = time.monotonic()
        self.on_ready: list[Callable[[], None]] = []
        # Called with every message but a Step, after the bridge has taken it in (the server log's
        # progress, start-up lines and warnings: EngineLog).
        self.watchers: list[Callable[[Any], None]] = []

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the first worker; call from the running event loop."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._writer, name="bridge-writer", daemon=True).start()
        self._spawn()
        self._loop.create_task(self._watchdog())

    def _spawn(self) -> None:
        proc, parent = spawn_worker(self.entry, self.worker_args)
        self._generation += 1
        self._proc, self._conn, self.pid = proc, parent, proc.pid
        self._last_progress = time.monotonic()
        threading.Thread(target=self._reader, args=(parent, proc, self._generation),
                         name="bridge-reader", daemon=True).start()

    def stop(self) -> None:
        """Ask the worker to exit, then make sure it did. Blocks up to WORKER_EXIT_WAIT_S (plus a kill);
        safe to call from any thread."""
        self._stopping = True
        proc = self._proc
        if proc is None:
            return
        self._outbox.put((self._conn, protocol.Shutdown()))
        proc.join(WORKER_EXIT_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(WORKER_EXIT_WAIT_S)

    def kill(self) -> None:
        """End the worker at once (the server is exiting without a clean shutdown)."""
        self._stopping = True
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    # ---- threads -----------------------------------------------------------------------------------

    def _reader(self, conn, proc, generation: int) -> None:
        why = "worker pipe closed"
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # an unpicklable message: the worker is broken
                why = f"bad message from worker: {e!r}"
                break
            self._call(self._on_message, generation, msg)
        # The pipe is done with: the writer closes it (it may be sending on it right now). The process
        # is reaped here, off the event loop, so its exit status can be logged.
        self._outbox.put((conn, None))
        if generation == self._generation and not self._stopping:
            proc.join(WORKER_EXIT_WAIT_S)
        self._call(self._on_death, generation, why, proc)

    def _writer(self) -> None:
        while True:
            conn, msg = self._outbox.get()
            try:
                if msg is None:
                    conn.close()
                else:
                    conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                pass  # the reader notices the death and answers the requests

    def _call(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                pass  # loop closed during shutdown

    # ---- messages from the worker (event loop) ---------------------------------------------------

    def _on_message(self, generation: int, msg) -> None:
        if generation != self._generation:
            return  # a message from a worker that was already replaced
        self._last_progress = time.monotonic()
        if isinstance(msg, protocol.Step):
            q = self._streams.get(msg.rid)
            if q is not None:
                q.put_nowait(msg)
                if msg.finish is not None:
                    self._streams.pop(msg.rid, None)
        elif isinstance(msg, protocol.Stats):
            self.stats = msg
        elif isinstance(msg, protocol.Loading):
            self.loading = (msg.phase, msg.done, msg.total)
        elif isinstance(msg, protocol.Ready):
            self.facts = msg.facts
            if msg.pid:
                self.pid = msg.pid
            self.status = "ok"
            self.loading = None
            if self._failures:
                self.log(f"worker {self.pid} is ready again after {self.restarts} restart(s)")
            self._failures = 0
            self._last_load_fault = None
            for fn in self.on_ready:
                fn()
        elif isinstance(msg, protocol.Fault):
            self.log(f"worker fault: {msg.message}")
            if self.status != "ok":
                self._load_fault = msg.message
        if not isinstance(msg, protocol.Step):
            for fn in self.watchers:
                fn(msg)

    def _on_death(self, generation: int, why: str, proc=None) -> None:
        if generation != self._generation or self._stopping:
            return
        self._generation += 1  # ignore anything else the dead worker's threads deliver
        proc = proc or self._proc
        status = _exit_status(proc.exitcode if proc is not None else None)
        if proc is not None and proc.is_alive():
            proc.kill()        # stuck, or it broke its pipe and lives on: it must not hold the device
            status = "killed by the server"
        repeated = self._same_load_fault()
        self.log(f"worker {self.pid} died ({why}; {status}); "
                 + ("not starting another" if repeated else "starting a new one"))
        if self.stats is not None:
            self.compiles_after_ready_before += self.stats.compiles_after_ready
        self.stats = None
        self.status = "loading"
        self.loading = None
        streams, self._streams = self._streams, {}
        for q in streams.values():
            q.put_nowait(WorkerDied(why))
        if repeated:
            self.failed = f"the worker failed twice in a row while loading: {self._last_load_fault}"
            self.log(f"{self.failed}; stopping")
            for fn in self.on_failed:
                fn()
            return
        self._failures += 1
        self.restarts += 1
        delay = self.restart_delay(self._failures)
        if delay:
            self.log(f"worker failed {self._failures} times in a row without becoming ready; "
                     f"next start in {delay:g} s")
        self._loop.call_later(delay, self._respawn)

    def restart_delay(self, failures: int) -> float:
        return restart_delay(failures, self.backoff_first_s, self.backoff_max_s)

    def _same_load_fault(self) -> bool:
        """After a death: whether it is the second in a row of a worker that failed the same way while
        loading (the same Fault: a model that cannot load, which no restart mends). The bridge then
        gives up (failed, on_failed: the server stops with that reason) instead of starting workers
        that fail forever; a death without a Fault (a kill, a crash) is restarted as before."""
        fault, self._load_fault = self._load_fault, None
        # A worker of a multi-host group also fails while loading when a peer is gone or slow to come,
        # and that passes once the peer is back (docs/scale-out.md): a group keeps being restarted.
        grouped = isinstance(self.worker_args, dict) and bool(self.worker_args.get("distributed"))
        repeated = fault is not None and fault == self._last_load_fault and not grouped
        self._last_load_fault = fault
        return repeated

    def _respawn(self) -> None:
        if not self._stopping:
            self._spawn()

    async def _watchdog(self) -> None:
        """A worker with requests in it that sends nothing for stuck_s is stuck: replace it."""
        while not self._stopping:
            await asyncio.sleep(min(WATCHDOG_POLL_S, self.stuck_s / 4))   # tests shorten stuck_s
            if (self.status == "ok" and self._streams
                    and time.monotonic() - self._last_progress > self.stuck_s):
                self._on_death(self._generation, f"no progress for {self.stuck_s:g} s")

    # ---- requests ----------------------------------------------------------------------------------

    def submit(self, submit: "protocol.Submit") -> asyncio.Queue:
        """Hand a request to the worker. Its Steps (and a WorkerDied if the worker dies, or
        ServerStopping when the shutdown's grace period ends) arrive on the returned queue; the last
        Step has finish set."""
        q: asyncio.Queue = asyncio.Queue()
        if self.ended.is_set():
            q.put_nowait(ServerStopping())
            return q
        if self.status != "ok":
            q.put_nowait(WorkerDied("worker not ready"))
            return q
        if not self._streams:
            self._last_progress = time.monotonic()  # the stuck clock starts when work arrives
        self._streams[submit.rid] = q
        self._outbox.put((self._conn, submit))
        return q

    def cancel(self, rid: str) -> None:
        if self._streams.pop(rid, None) is not None and self.status == "ok":
            self._outbox.put((self._conn, protocol.Cancel(rid)))

    @property
    def live_requests(self) -> int:
        """Requests handed to the current worker and not finished."""
        return len(self._streams)

    @property
    def compiles_after_ready(self) -> int | None:
        if self.stats is None:
            return None if self.status != "ok" else self.compiles_after_ready_before
        return self.compiles_after_ready_before + self.stats.compiles_after_ready

    # ---- shutdown ----------------------------------------------------------------------------------

    def enter(self) -> None:
        """A generation request begins (counted until leave())."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is in flight; False if some still are after timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def end_all(self) -> None:
        """The grace period is over: every request in the worker, waiting for a slot or for a worker
        ends now with ServerStopping (each answers its client in its route's shape)."""
        self.ended.set()
        streams, self._streams = self._streams, {}
        for rid, q in streams.items():
            q.put_nowait(ServerStopping())
            if self.status == "ok":
                self._outbox.put((self._conn, protocol.Cancel(rid)))


# =================================================================================================
# Routes
# =================================================================================================

Handler = Callable[[Request, Responder], Awaitable[None]]


def _needs_key(pattern: str) -> bool:
    """The spec: with keys configured, /v1 routes, /metrics and /openapi.json need one; health (/,
    /health, /v1/health) stays open for probes."""
    if pattern in ("/", "/health", "/v1/health"):
        return False
    return pattern.startswith("/v1/") or pattern in ("/metrics", "/openapi.json")


@dataclass(frozen=True)
class Route:
    method: str
    pattern: str                               # "/v1/models/{model}"; {name} matches the rest of the path
    handler: Handler                           # async (req, out) -> None; the server state is out.app
    errors: Callable[[ApiError], dict]         # the route's error shape: openai_ or anthropic_error_body
    needs_key: bool

    @property
    def reads_body(self) -> bool:
        return self.method == "POST"


class Router:
    """(method, path pattern) -> Route. Unknown path: 404; known path, other method: 405 with Allow.
    HEAD on every path is the spec's ready check: the `head` route (health's status, no body), so a
    probe works on any URL and a HEAD never tells a protected route's length to a caller without a key."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Route]] = {}
        self._patterns: list[tuple[re.Pattern, dict[str, Route]]] = []
        self.head: Route | None = None

    def add(self, method: str, pattern: str, handler: Handler,
            errors: Callable[[ApiError], dict] = openai_error_body) -> None:
        route = Route(method, pattern, handler, errors, _needs_key(pattern))
        if "{" in pattern:
            regex = re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>.+)", re.escape(pattern)) + r"\Z")
            methods = next((m for r, m in self._patterns if r.pattern == regex.pattern), None)
            if methods is None:
                methods = {}
                self._patterns.append((regex, methods))
        else:
            methods = self._exact.setdefault(pattern, {})
        if method in methods:
            raise ValueError(f"route {method} {pattern} is registered twice")
        methods[method] = route

    def _lookup(self, path: str) -> tuple[dict[str, Route] | None, dict[str, str]]:
        methods = self._exact.get(path)
        if methods is not None:
            return methods, {}
        for regex, methods in self._patterns:
            m = regex.match(path)
            if m:
                return methods, {k: urllib.parse.unquote(v) for k, v in m.groupdict().items()}
        return None, {}

    def match(self, req: Request) -> Route:
        """The request's route (its path parameters set on req.params), or ApiError 404/405."""
        if req.method == "HEAD" and self.head is not None:
            return self.head
        methods, params = self._lookup(req.path)
        method = "GET" if req.method == "HEAD" else req.method   # HEAD is told what GET would be
        if methods is None:
            raise ApiError(404, f"no such route: {method} {req.path}", code="not_found")
        route = methods.get(req.method) or methods.get(method)
        if route is None:
            allowed = sorted(set(methods) | ({"HEAD"} if "GET" in methods else set()))
            raise ApiError(405, f"method {method} is not allowed on {req.path} (allowed: "
                                f"{', '.join(allowed)})", code="method_not_allowed",
                           headers=(("Allow", ", ".join(allowed)),))
        req.params = params
        return route

    def errors_for(self, path: str) -> Callable[[ApiError], dict]:
        """The error shape for a path whose request did not reach a route (405 on an Anthropic path)."""
        methods, _ = self._lookup(path)
        return next(iter(methods.values())).errors if methods else openai_error_body


# ---- the simple routes ---------------------------------------------------------------------------

async def route_health(req: Request, out: Responder) -> None:
    """200 while the server takes requests: not while it loads, nor while it shuts down (its body's
    status is still the model's, ok), so a prober on a kept-alive connection stops sending."""
    app = out.app
    doc = app.health()
    if app.guard is not None and not app.guard.keyed(req):
        doc.pop("worker_pid", None)     # a process id is for the operator, not for any prober
    await out.json(200 if app.ready and not app.bridge.closing else 503, doc)


async def route_ui(req: Request, out: Responder) -> None:
    """`mashbox run --ui`: the MASHBOX Chat page (ui.html), one self-contained file."""
    body, headers = ui_page()
    await out.send(200, body, "text/html; charset=utf-8", headers)


def model_card(app: "App") -> dict:
    """The spec's Model. Before the worker is ready only the id and the --ctx asked for are known."""
    facts = app.facts
    if facts is None:
        return {"id": app.model_id, "object": "model", "owned_by": OWNED_BY, "created": 0,
                "max_model_len": app.config.ctx or app.planned_ctx or 0}
    return {"id": facts.id, "object": "model", "owned_by": OWNED_BY, "created": 0,
            "max_model_len": facts.max_model_len, "weights": facts.weights, "gb": facts.gb,
            "bpw": facts.bpw, "prefix_cache": facts.prefix_cache, "slots": facts.slots,
            "cache_ram_mib": facts.cache_ram_mib}


async def route_models(req: Request, out: Responder) -> None:
    await out.json(200, {"object": "list", "data": [model_card(out.app)]})


async def route_model(req: Request, out: Responder) -> None:
    app, wanted = out.app, req.params["model"]
    if wanted != app.model_id:
        raise model_not_found(wanted, app.model_id)
    await out.json(200, model_card(app))


async def route_openapi(req: Request, out: Responder) -> None:
    await out.send(200, out.app.openapi_bytes(), "application/json")


async def route_metrics(req: Request, out: Responder) -> None:
    app = out.app
    text = app.metrics.render(app.bridge, app.admission)
    await out.send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")


# ---- the generation routes -----------------------------------------------------------------------

# path -> the API format (App.formats) that parses its body and encodes its answer. count_tokens reads a
# Messages body and answers without generating.
API_ROUTES = (
    ("/v1/chat/completions", "chat"),
    ("/v1/completions", "completions"),
    ("/v1/messages", "messages"),
    ("/v1/responses", "responses"),
)
COUNT_TOKENS_ROUTE = ("/v1/messages/count_tokens", "messages")
# What count_tokens reads of a Messages body: the fields the spec lists for it, and context_management,
# which changes the prompt Messages would prefill. The rest (max_tokens, sampling, stream,
# output_config) are ignored unread, as the spec has it for fields a route does not list.
COUNTED_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                            "context_management"})


def api_route(fmt_name: str, count_tokens: bool = False) -> Handler:
    """The handler of a generation route: its API format's parse and encoder, through the engine."""
    async def handler(req: Request, out: Responder) -> None:
        app = out.app
        fmt = app.formats[fmt_name]
        if count_tokens:
            await handle_count_tokens(app, req, out, fmt)
        else:
            await handle_generation(app, req, out, fmt, req.tenant or DEFAULT_TENANT)
    return handler


def build_routes(app: "App") -> Router:
    """The route table. A generation route exists when its API format is given to the App."""
    router = Router()
    for path in ("/v1/health", "/health"):
        router.add("GET", path, route_health)
    router.add("GET", "/", route_ui if app.config.ui else route_health)
    router.head = Route("HEAD", "*", route_health, openai_error_body, needs_key=False)
    router.add("GET", "/v1/models", route_models)
    router.add("GET", "/v1/models/{model}", route_model)
    router.add("GET", "/openapi.json", route_openapi)
    router.add("GET", "/metrics", route_metrics)
    for path, name in API_ROUTES:
        if name in app.formats:
            router.add("POST", path, api_route(name), app.formats[name].error_body)
    path, name = COUNT_TOKENS_ROUTE
    if name in app.formats:
        router.add("POST", path, api_route(name, count_tokens=True), app.formats[name].error_body)
    return router


# ---- the served description ----------------------------------------------------------------------

# The project's copy of the spec, served at /openapi.json. Its examples name this model id, which the
# server replaces with the id it runs.
OPENAPI_FILE = Path(__file__).resolve().parent / "openapi.json"
SPEC_EXAMPLE_MODEL = "qwen3-8-27b"
OWNED_BY = "mashbox-labs"


def openapi_document(model_id: str, base_url: str | None = None) -> bytes:
    """The spec with the running model's id in its examples (and this server's URL, when given)."""
    doc = json.loads(OPENAPI_FILE.read_text(encoding="utf-8"))

    def swap(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) for v in node]
        return model_id if node == SPEC_EXAMPLE_MODEL and model_id else node

    doc = swap(doc)
    if base_url:
        doc["servers"] = [{"url": base_url, "description": "this server"}]
    return json.dumps(doc, ensure_ascii=False, indent=1).encode()


# ---- the chat page -------------------------------------------------------------------------------

# `mashbox run --ui` serves this file at /: everything inline (no CDN, no build step). The browser is
# told to run only its own inline script and style (by hash) and to talk only to this origin, so the
# page cannot load or send anything elsewhere, and the server's Origin check stays on.
UI_FILE = Path(__file__).resolve().parent / "ui.html"
_ui_cache: list = []


def ui_page() -> tuple[bytes, tuple[tuple[str, str], ...]]:
    """The page's bytes and its headers (Content-Security-Policy with its inline blocks' hashes)."""
    if not _ui_cache:
        import base64
        import hashlib
        text = UI_FILE.read_text(encoding="utf-8")

        def hashes(tag: str) -> str:
            blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)
            return " ".join("'sha256-%s'" % base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()
                            for b in blocks)
        policy = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
                  "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                  "frame-ancestors 'none'")
        _ui_cache.append((text.encode(), (("Content-Security-Policy", policy), ("Cache-Control", "no-store"),
                                          ("X-Content-Type-Options", "nosniff"),
                                          ("Referrer-Policy", "no-referrer"))))
    return _ui_cache[0]


# =================================================================================================
# The server state: the App, what the routes share
# =================================================================================================

class App:
    """The server's state: its configuration, the route table, the engine bridge and what the routes
    share (guard, admission, metrics, tokenizer). Handlers reach it as out.app.

    The bridge is read through three members: ready, facts and health().
    """

    def __init__(self, config: "ServeConfig", bridge: "Bridge | None" = None,
                 formats: dict[str, ApiFormat] | None = None, limits: ConnLimits | None = None,
                 guard: Guard | None = None, admission: Admission | None = None,
                 metrics: Metrics | None = None):
        self.config = config
        # A bridge that is never started stays "loading": the server answers 503 until one is.
        self.bridge = bridge if bridge is not None else Bridge(worker_args=None)
        self.formats = API_FORMATS if formats is None else formats
        self.limits = limits or ConnLimits()
        self.guard = guard                     # None: every request is the default tenant, unchecked
        # One slot until the worker reports its count (Admission.resize on ready).
        self.admission = admission if admission is not None else Admission(slots=1)
        self.metrics = metrics if metrics is not None else Metrics()
        self.tokenizer: chat.Tokenizer | None = None   # loaded from the model's folder when it is ready
        self.tokenizer_process: TokenizerProcess | None = None   # long prompts; started on first use
        self.counting: dict[str, int] = {}     # tenant -> count_tokens requests in flight
        self.tokenizing = asyncio.Semaphore(TOKENIZING_THREADS)
        self.counting_lane = asyncio.Semaphore(COUNTING_THREADS)
        self._trim: asyncio.Future | None = None
        self._trim_wanted = False
        self._heap_dirty = False       # a large request ended since the last trim, others in flight
        self.tokenizer_folder: str | None = None
        self.model_aliases: set[str] = set()   # other names of the served model (its HF repo)
        self.planned_ctx: int | None = None    # the context the worker will run (card before ready)
        self.namespace: str | None = None
        self.router = build_routes(self)
        self.port: int | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[Connection] = set()
        # Connections waiting for their next request, oldest first: those that never sent a key, and
        # those that did (dicts as ordered sets). At the connection bound the oldest gives way.
        self._idle: dict[Connection, None] = {}
        self._idle_keyed: dict[Connection, None] = {}
        self._peeking = 0                      # refused connections whose request line is awaited
        self._lingering = 0                    # refused connections being drained before closing
        self.buffered = 0                      # request bytes held by every connection (max_buffered)
        self._ready_waiters: list[asyncio.Event] = []
        self._openapi: tuple[str, bytes] | None = None
        self.bridge.on_ready.append(self._on_ready)
        self.bridge.watchers.append(EngineLog())   # progress, start-up lines, compile warnings

    # ---- what the routes read --------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.bridge.status == "ok"

    @property
    def facts(self) -> "protocol.ModelFacts | None":
        return self.bridge.facts

    @property
    def model_id(self) -> str:
        facts = self.bridge.facts
        return facts.id if facts is not None else (self.config.model or "")

    def health(self) -> dict:
        return health_document(self.bridge, self.admission, self.namespace)

    def openapi_bytes(self) -> bytes:
        """The served spec, built once per model id."""
        if self._openapi is None or self._openapi[0] != self.model_id:
            self._openapi = (self.model_id, openapi_document(self.model_id, self.url))
        return self._openapi[1]

    @property
    def url(self) -> str | None:
        if self.port is None:
            return None
        host = self.config.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def log(self, message: str) -> None:
        log.info("%s", message)

    async def wait_ready(self) -> None:
        """Return once the model is ready (again, after a worker restart)."""
        while not self.ready:
            event = asyncio.Event()
            self._ready_waiters.append(event)
            await event.wait()

    def _on_ready(self) -> None:
        facts = self.bridge.facts
        if self.tokenizer is None or self.tokenizer_folder != facts.folder:
            # Once per model folder (a restarted worker loads the same one); a fraction of a second.
            self.tokenizer = chat.Tokenizer.from_folder(facts.folder)
            self.tokenizer.max_token_bytes    # its byte table, built now rather than in a request
            self.tokenizer_folder = facts.folder
        self.trim_heap_soon()      # what start-up took and freed (the tokenizer's load, the spec's parse)
        # The worker's id (engine.prefix.namespace_id) is the one owner: it tags what it saves.
        self.namespace = facts.cache_namespace
        if self.admission is not None:
            self.admission.resize(facts.slots)
        waiters, self._ready_waiters = self._ready_waiters, []
        for event in waiters:
            event.set()

    # ---- serving ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and accept connections (port 0: any free port, then self.port says which)."""
        bound = connection_bound(self.limits.max_connections)
        if bound < self.limits.max_connections:
            log.warning("open files are limited: at most %d connections (not %d)", bound,
                        self.limits.max_connections)
            self.limits.max_connections = bound
        self._server = await asyncio.start_server(self._on_connect, self.config.host, self.config.port,
                                                  backlog=LISTEN_BACKLOG)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close()
        if self.tokenizer_process is not None:
            self.tokenizer_process.close()
        if self._server is not None:
            await self._server.wait_closed()

    def request_ended(self, large: bool) -> None:
        """A trim after a large request, and another when the last request in flight after one ends
        (what those requests held is freed only then)."""
        self._heap_dirty = self._heap_dirty or large
        if large or (self._heap_dirty and not self._handling()):
            self.trim_heap_soon()

    def _handling(self) -> bool:
        return any(conn.busy for conn in self._connections)

    def trim_heap_soon(self) -> None:
        """A trim in a thread TRIM_DELAY_S from now, covering every large request that ends before it
        starts; one that ends while it runs asks for another."""
        self._trim_wanted = True
        if self._trim is None or self._trim.done():
            async def trim():
                while self._trim_wanted:
                    await asyncio.sleep(TRIM_DELAY_S)
                    self._trim_wanted = False
                    self._heap_dirty = self._handling()
                    await asyncio.to_thread(memory.release_free_heap)
            self._trim = asyncio.ensure_future(trim())

    def connection_idle(self, conn: Connection) -> None:
        conn.idle_since = asyncio.get_running_loop().time()
        (self._idle_keyed if conn.keyed else self._idle)[conn] = None

    def connection_busy(self, conn: Connection) -> None:
        conn.idle_since = None
        self._idle.pop(conn, None)
        self._idle_keyed.pop(conn, None)

    def _evict_idle(self) -> bool:
        """Close the connection idle longest (EVICT_IDLE_S at least), unkeyed first; False if none."""
        now = asyncio.get_running_loop().time()
        for idle in (self._idle, self._idle_keyed):
            conn = next(iter(idle), None)
            if conn is not None and now - conn.idle_since >= EVICT_IDLE_S:
                self.connection_busy(conn)
                self._connections.discard(conn)     # its place is taken now; its task ends soon
                conn.transport.close()              # a FIN: the client's pool sees it closed
                return True
        return False

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.limits.max_connections and not self._evict_idle():
            await self._refuse_connection(reader, writer)
            return
        conn = Connection(self, reader, writer)
        self._connections.add(conn)
        self.connection_idle(conn)    # until its first bytes: a connection that sends nothing gives way
        try:
            await conn.run()
        except Exception:
            log.exception("connection failed")
        finally:
            self._connections.discard(conn)

    async def _refuse_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """503 with Retry-After for a connection past the bound. The client may have sent its request
        already: closing with it unread would reset the connection (the client sees ECONNRESET, not
        the 503), so the answer is written, the sending side shut, and what arrives is read and dropped
        (REFUSED_DRAIN_BYTES, LINGER_S at most) before closing."""
        err = ApiError(503, f"too many open connections (at most {self.limits.max_connections})",
                       type="unavailable", headers=(("Retry-After", str(RETRY_AFTER_CONNECTIONS_S)),))
        errors = openai_error_body
        if self._peeking < CAP_PEEKS:
            self._peeking += 1
            try:
                line = await asyncio.wait_for(reader.readline(), CAP_PEEK_S)
                m = _LINE_PATH.match(line)
                errors = self.router.errors_for(m.group(1).decode()) if m else errors
            except (asyncio.TimeoutError, ValueError, ConnectionError, OSError):
                pass
            finally:
                self._peeking -= 1
        writer.write(response_bytes(503, json.dumps(errors(err)).encode(),
                                    "application/json", err.headers, keep_alive=False))
        if self._lingering >= MAX_LINGERING_REFUSALS or not writer.can_write_eof():
            writer.close()
            return
        self._lingering += 1
        try:
            writer.write_eof()
            deadline = asyncio.get_running_loop().time() + self.limits.linger_s
            left = REFUSED_DRAIN_BYTES
            while left > 0:
                wait = deadline - asyncio.get_running_loop().time()
                if wait <= 0:
                    break
                data = await asyncio.wait_for(reader.read(min(left, READ_SIZE)), wait)
                if not data:
                    break
                left -= len(data)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self._lingering -= 1
            writer.close()


# =================================================================================================
# Metrics: Prometheus text
# =================================================================================================

# Names and meanings follow vLLM's (vllm:num_requests_waiting -> mashbox:num_requests_waiting), so a
# router or dashboard built for vLLM reads these after a prefix change. Bucket boundaries are vLLM's.
METRIC_PREFIX = "mashbox:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Prompt lengths (tokens, upper bounds) that time to first token is also counted by: a chat turn, a
# short agent request, a long agent turn, a full demo context. A short request's first token must
# not follow the long prompts read beside it (engine.scheduler), and this shows whether it does.
PROMPT_LENGTH_BUCKETS = (128, 1024, 8192, 32768)


def prompt_length_label(tokens: int) -> str:
    """The prompt-length range a prompt of `tokens` tokens is counted in ("1-128", ..., "32769+")."""
    low = 1
    for high in PROMPT_LENGTH_BUCKETS:
        if tokens <= high:
            return f"{low}-{high}"
        low = high + 1
    return f"{low}+"


def _label_value(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help_text(v: str) -> str:
    """HELP lines escape only backslash and newline (quotes stay as they are)."""
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items()) + "}"


def _num(v: float) -> str:
    v = float(v)
    if v == float("inf"):
        return "+Inf"
    return str(int(v)) if v.is_integer() else repr(v)


class Metric:
    """One metric family: counter, gauge or histogram, with optional label sets. Values live here and
    are only ever changed on the event loop, so rendering never waits on anything."""

    def __init__(self, name: str, kind: str, help: str, buckets: tuple[float, ...] = ()):
        self.name, self.kind, self.help, self.buckets = METRIC_PREFIX + name, kind, help, buckets
        self.values: dict[tuple, float] = {}          # counter / gauge: labels -> value
        self.hist: dict[tuple, list] = {}             # histogram: labels -> [bucket counts, sum, count]

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def set(self, value: float, **labels) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def observe(self, value: float, **labels) -> None:
        key = tuple(sorted(labels.items()))
        h = self.hist.setdefault(key, [[0] * len(self.buckets), 0.0, 0])
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                h[0][i] += 1
        h[1] += value
        h[2] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {_help_text(self.help)}", f"# TYPE {self.name} {self.kind}"]
        if self.kind == "histogram":
            # An unlabelled histogram shows its zero buckets before the first observation, as vLLM's
            # do, so a dashboard's rate() has a series to start from.
            series = self.hist or {(): [[0] * len(self.buckets), 0.0, 0]}
            for key, (counts, total, count) in sorted(series.items()):
                labels = dict(key)
                for bound, c in zip(self.buckets, counts):
                    lines.append(f"{self.name}_bucket{_labels({**labels, 'le': _num(bound)})} {c}")
                lines.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {count}")
                lines.append(f"{self.name}_sum{_labels(labels)} {_num(total)}")
                lines.append(f"{self.name}_count{_labels(labels)} {count}")
        else:
            for key, value in sorted(self.values.items()):
                lines.append(f"{self.name}{_labels(dict(key))} {_num(value)}")
        return lines


class Metrics:
    """Every metric the server exports. No label ever names a user, a key, a tenant or a session."""

    FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "error")
    CONSTRAINT_MODES = ("auto", "required", "named", "none")

    def __init__(self):
        m = self.m = {}

        def add(name, kind, help, buckets=()):
            m[name] = Metric(name, kind, help, buckets)
            return m[name]

        add("num_requests_running", "gauge", "Requests in the engine now.")
        add("num_requests_waiting", "gauge", "Requests waiting for a slot.")
        add("kv_cache_usage_perc", "gauge", "Fraction of the slots' KV cache holding tokens (0-1).")
        add("cache_config_info", "gauge", "The cache layout: one slot holds one whole context.")
        success = add("request_success_total", "counter", "Requests answered, by finish reason.")
        for reason in self.FINISH_REASONS:
            success.inc(0, finished_reason=reason)
        add("prompt_tokens_total", "counter", "Prompt tokens of answered requests.").inc(0)
        add("generation_tokens_total", "counter", "Tokens generated.").inc(0)
        add("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix caches.").inc(0)
        add("prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix caches.").inc(0)
        add("num_preemptions_total", "counter", "Requests preempted (never: a slot is never taken back).").inc(0)
        add("worker_restarts_total", "counter", "Times the worker was started again after a fault.").inc(0)
        add("compiles_after_ready_total", "counter", "Programs compiled after the server reported ready.").inc(0)
        add("worker_resident_memory_bytes", "gauge",
            "Resident memory of the engine's worker process (0 while none runs).")
        add("host_cache_bytes", "gauge", "Bytes of the host memory prompt cache's K/V and token ids "
            "(as /health's host_cache_bytes).")
        add("snapshot_bytes", "gauge", "Hybrid models: bytes of linear-layer state snapshots in the host "
            "memory prompt cache (as /health's snapshot_bytes).")
        add("routed_experts_info", "gauge", "Mixture-of-experts models: the path the routed experts run on "
            "(kernel, exact or mixed) and the kernel's id, version and package, as /health reports them.")
        add("routed_expert_sites", "gauge", "Mixture-of-experts models: routed-expert call sites traced on "
            "each path.")
        add("deployment_info", "gauge", "What runs: the compiled programs' id, the model's component set "
            "and whether the build passed the certification gate on this chip.")
        rejections = add("admission_rejections_total", "counter", "Requests refused by admission, by reason.")
        for reason in ("tenant_queue_full", "queue_full", "loading", "counting_full"):
            rejections.inc(0, reason=reason)
        constrained = add("constrained_requests_total", "counter", "Requests whose tool calls were "
                          "constrained by a grammar, by tool_choice mode (auto, required, named, none).")
        for mode in self.CONSTRAINT_MODES:
            constrained.inc(0, mode=mode)
        add("grammar_mask_seconds_total", "counter", "Host time spent computing constrained requests' "
            "token masks.").inc(0)
        add("spec_decode_num_draft_tokens_total", "counter", "Tokens drafted (from the requests' own "
            "text or the MTP layer) and verified (speculative decoding).").inc(0)
        add("spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens kept: the model drew "
            "the same token.").inc(0)
        add("spec_decode_num_drafts_total", "counter", "Verifications that carried a draft, per row: "
            "accepted tokens over drafts is the mean accepted length per round.").inc(0)
        add("time_to_first_token_seconds", "histogram", "Time to the first new token.", TTFT_BUCKETS)
        by_length = add("time_to_first_token_by_prompt_seconds", "histogram", "Time to the first new "
                        "token, by the prompt's length in tokens (prompt_tokens: a range).", TTFT_BUCKETS)
        for tokens in (1, *(high + 1 for high in PROMPT_LENGTH_BUCKETS)):   # every range, from zero
            by_length.hist[(("prompt_tokens", prompt_length_label(tokens)),)] = [[0] * len(TTFT_BUCKETS), 0.0, 0]
        add("request_queue_time_seconds", "histogram", "Time waiting for a slot.", LATENCY_BUCKETS)
        add("e2e_request_latency_seconds", "histogram", "Time from request to its last byte.", LATENCY_BUCKETS)
        add("request_time_per_output_token_seconds", "histogram", "Time per new token after the first.",
            TPOT_BUCKETS)

    def __getitem__(self, name: str) -> Metric:
        return self.m[name]

    def request_done(self, finish: str, usage: "chat.Usage | None", queue_s: float, e2e_s: float,
                     ttft_s: float | None, decode_s: float | None) -> None:
        """Account one finished generation request (from the pipeline, once per client request).

        The prefix cache counters come from the same usage the response reports (prompt tokens looked
        up, and those served from a cache), so they add up to what clients were told and only grow,
        whatever happens to the worker process."""
        self.m["request_success_total"].inc(finished_reason=finish if finish in self.FINISH_REASONS else "stop")
        if usage is not None:
            self.m["prompt_tokens_total"].inc(usage.prompt_tokens)
            self.m["generation_tokens_total"].inc(usage.completion_tokens)
            self.m["prefix_cache_queries_total"].inc(usage.prompt_tokens)
            self.m["prefix_cache_hits_total"].inc(usage.cached_tokens)
            if usage.completion_tokens > 1 and decode_s is not None:
                self.m["request_time_per_output_token_seconds"].observe(
                    decode_s / (usage.completion_tokens - 1))
        self.m["request_queue_time_seconds"].observe(queue_s)
        self.m["e2e_request_latency_seconds"].observe(e2e_s)
        if ttft_s is not None:
            self.m["time_to_first_token_seconds"].observe(ttft_s)
            if usage is not None:
                self.m["time_to_first_token_by_prompt_seconds"].observe(
                    ttft_s, prompt_tokens=prompt_length_label(usage.prompt_tokens))

    def drafts_done(self, timings: dict | None) -> None:
        """Account one finished request's drafted and kept tokens (its timings block)."""
        if timings:
            self.m["spec_decode_num_draft_tokens_total"].inc(timings.get("draft_n", 0))
            self.m["spec_decode_num_accepted_tokens_total"].inc(timings.get("draft_n_accepted", 0))
            self.m["spec_decode_num_drafts_total"].inc(timings.get("draft_rounds", 0))

    def constrained_done(self, mode: str | None, mask_s: float) -> None:
        """Account one finished request's tool-call constraint (mode None: it ran unconstrained)."""
        if mode is not None:
            self.m["constrained_requests_total"].inc(mode=mode)
            self.m["grammar_mask_seconds_total"].inc(mask_s)

    def _grow(self, name: str, total: float) -> None:
        """Set a counter kept elsewhere as a running total, never lowering it."""
        metric = self.m[name]
        metric.set(max(total, metric.values.get((), 0.0)))

    def render(self, bridge: "Bridge | None", admission: "Admission | None") -> str:
        """The exposition (text format 0.0.4). Gauges are read from state the event loop already has."""
        stats = bridge.stats if bridge is not None else None
        facts = bridge.facts if bridge is not None else None
        running = admission.running if admission is not None else (stats.live_rows if stats else 0)
        self.m["num_requests_running"].set(running)
        self.m["num_requests_waiting"].set(admission.waiting if admission is not None else 0)
        if stats is not None and stats.kv_capacity_tokens:
            self.m["kv_cache_usage_perc"].set(stats.kv_used_tokens / stats.kv_capacity_tokens)
        else:
            self.m["kv_cache_usage_perc"].set(0)
        self.m["host_cache_bytes"].set(stats.host_cache_bytes if stats else 0)
        self.m["snapshot_bytes"].set(stats.snapshot_bytes if stats else 0)
        if facts is not None and facts.deployment_id:
            info = self.m["deployment_info"]
            info.values.clear()
            info.set(1, deployment_id=facts.deployment_id, component_set_sha=facts.component_set_sha or "",
                     certification=facts.certification)
        if facts is not None:
            info = self.m["cache_config_info"]
            info.values.clear()
            info.set(1, block_size=facts.max_model_len, num_gpu_blocks=facts.slots,
                     enable_prefix_caching=str(facts.prefix_cache).lower(),
                     cache_ram_mib=facts.cache_ram_mib)
        routed = facts.routed_experts if facts is not None else None
        self.m["routed_experts_info"].values.clear()
        self.m["routed_expert_sites"].values.clear()
        if routed is not None:           # a dense model has no series
            kernel = routed.get("kernel") or {}
            self.m["routed_experts_info"].set(1, path=routed["path"], kernel=kernel.get("id", ""),
                                              kernel_version=kernel.get("version", ""),
                                              kernel_package=kernel.get("package", ""))
            for path, count in routed["sites"].items():
                self.m["routed_expert_sites"].set(count, path=path)
        if bridge is not None:
            # The bridge's totals span every worker process, but compiles_after_ready reads None while
            # a new worker loads: a counter never goes back, so keep the largest value seen.
            self._grow("worker_restarts_total", bridge.restarts)
            self._grow("compiles_after_ready_total", bridge.compiles_after_ready or 0)
        # Read from /proc at the scrape: the worker is not asked, so a busy one never delays it.
        rss = memory.resident_bytes(bridge.pid) if bridge is not None and bridge.pid else None
        self.m["worker_resident_memory_bytes"].set(rss or 0)
        lines = []
        for metric in self.m.values():
            lines += metric.render()
        return "\n".join(lines) + "\n"


def health_document(bridge: "Bridge", admission: "Admission | None", namespace: str | None) -> dict:
    """Every field of the spec's Health, with real values where the feature exists and the spec's
    null/0 where it does not."""
    stats = bridge.stats
    facts = bridge.facts
    ready = bridge.status == "ok"
    host_bytes = stats.host_cache_bytes if stats else 0
    snap_bytes = stats.snapshot_bytes if stats else 0
    doc = {
        "status": bridge.status,
        "live_rows": (admission.running if admission is not None else stats.live_rows if stats else 0)
        if ready else None,
        "waiting": admission.waiting if admission is not None else 0,
        "cache_bytes": host_bytes + snap_bytes,
        "host_cache_bytes": host_bytes,
        "snapshot_bytes": snap_bytes,
        "host_cache_cap_bytes": stats.host_cache_cap_bytes if stats else
        (bridge.facts.cache_ram_mib << 20 if bridge.facts else 0),
        "host_cache_evictions": stats.host_cache_evictions if stats else 0,
        "cache_namespace": namespace if ready else None,
        # The worker's (engine.identity, engine.certify); a restarting worker keeps the last ones.
        "deployment_id": facts.deployment_id if facts else None,
        "component_set_sha": facts.component_set_sha if facts else None,
        "certification": facts.certification if facts else "not_certified",
        "compiles_after_ready": bridge.compiles_after_ready if ready else None,
        "routed_experts": bridge.facts.routed_experts if bridge.facts else None,
        "worker_restarts": bridge.restarts,
    }
    if facts is not None and facts.devices is not None:
        # what the model is split over (engine.sharding), and what multiplies its weights there
        # (engine.native's tier, or XLA)
        doc["devices"] = {**facts.devices, "kernel": facts.kernel}
    if bridge.pid is not None:
        doc["worker_pid"] = bridge.pid
    if not ready and bridge.loading is not None:
        phase, done, total = bridge.loading
        doc["loading"] = {"phase": phase, "done": done, "total": total}
    if facts is not None and facts.certification_detail:
        doc["detail"] = f"certification: {facts.certification_detail}"
    return doc


# ---- the server log ------------------------------------------------------------------------------

# A session tag is client text (X-Session-Id, prompt_cache_key). The log keeps at most this many of its
# characters, printable and without spaces, so a request stays one line that splits on spaces and a
# client cannot write fake lines into the log.
MAX_LOG_TAG = 64
# An error's message ends its request's line (why=..., the rest of the line): it can quote client
# text (a model name, a field's value), so it is kept printable, on one line, and this long at most.
MAX_LOG_WHY = 300


def log_tag(value: str | None) -> str | None:
    """A client-given tag as the log shows it, or None when nothing printable is left."""
    if not value:
        return None
    kept = "".join(c for c in str(value) if c.isprintable() and not c.isspace())[:MAX_LOG_TAG]
    return kept or None


def request_log_line(method: str, path: str, outcome: "Outcome", prompt_tokens: int, queue_s: float,
                     total_s: float, session: str | None, ttft_s: float | None = None) -> str:
    """The one line logged when a generation request ends. Never the key, the tenant or the prompt.
    ttft_ms is the time to the first new token ("-" when none came); a request answered with an
    error ends with why= and the message the client got."""
    u = outcome.usage
    tag = log_tag(session)
    ttft = "-" if ttft_s is None else f"{ttft_s * 1000:.0f}"
    return (f"{method} {path} {outcome.status} finish={outcome.finish or '-'} "
            f"prompt={u.prompt_tokens if u else prompt_tokens} cached={u.cached_tokens if u else 0} "
            f"generated={u.completion_tokens if u else 0} queue_ms={queue_s * 1000:.0f} "
            f"ttft_ms={ttft} total_ms={total_s * 1000:.0f}" + _drafts_text(outcome.timings)
            + (" retried=1" if outcome.retried else "")
            + (f" session={tag}" if tag else "")
            + (f" why={_log_text(outcome.error, MAX_LOG_WHY)}" if outcome.error else ""))


def _log_text(value: str, most: int) -> str:
    """Text for the log, on one line: printable characters, each run of white space one space."""
    return " ".join("".join(c if c.isprintable() else " " for c in value).split())[:most]


def _drafts_text(timings: dict | None) -> str:
    """The request's drafting for its log line: tokens kept of those drafted, and the share."""
    if not timings or not timings.get("draft_n"):
        return ""
    drafted, kept = timings["draft_n"], timings.get("draft_n_accepted", 0)
    return f" drafted={drafted} accepted={kept} ({kept / drafted:.0%})"


def log_prompt(tokenizer: "chat.Tokenizer", prompt: list[int], path: str, session: str | None) -> None:
    """--log-prompts: the rendered prompt exactly as the model reads it, as one escaped line."""
    tag = log_tag(session)
    log.info("prompt %s%s (%d tokens): %r", path, f" session={tag}" if tag else "", len(prompt),
             tokenizer.decode(prompt))


class _LogLines:
    """A text stream whose lines go to the server log: progress where stderr is not a terminal."""

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                log.info("%s", line)

    def flush(self) -> None:
        pass


def progress_display(stream=None) -> "registry.ProgressBar":
    """A progress(phase, done, total) callback: a bar redrawn on a terminal, plain log lines (one per
    tenth of a phase) otherwise."""
    stream = stream if stream is not None else sys.stderr
    tty = hasattr(stream, "isatty") and stream.isatty()
    return registry.ProgressBar(stream if tty else _LogLines())


class EngineLog:
    """What the operator reads about the worker, from its messages: progress while it loads weights and
    compiles, the start-up lines when it is ready, and a warning whenever it compiles a program after
    ready (each such compile stalls every running request for seconds). Faults and deaths are logged
    by the bridge, which sees them."""

    def __init__(self, progress: Callable[[str, int, int], None] | None = None):
        self.progress = progress if progress is not None else progress_display()
        self.compiles_seen = 0            # compiles after ready reported by the current worker
        self.grammar_said = False         # the tool-call constraint's state, logged once

    def __call__(self, msg: Any) -> None:
        if isinstance(msg, protocol.Loading):
            self.progress(msg.phase, msg.done, msg.total)
        elif isinstance(msg, protocol.Ready):
            self._ready(msg)
        elif isinstance(msg, protocol.Stats) and msg.compiles_after_ready > self.compiles_seen:
            log.warning("worker compiled %d program(s) after ready (%d since it started): a request "
                        "shape the start-up did not compile; running requests waited for it",
                        msg.compiles_after_ready - self.compiles_seen, msg.compiles_after_ready)
            self.compiles_seen = msg.compiles_after_ready
        elif isinstance(msg, protocol.Note):
            log.info("worker: %s%s", f"{msg.rid}: " if msg.rid else "", msg.message)

    def _ready(self, msg: "protocol.Ready") -> None:
        self.compiles_seen = 0            # a new worker process counts from zero
        f = msg.facts
        log.info("model %s (%s, %s on %s)", f.id, f.family, f.dtype, f.device)
        if f.devices is not None:
            d = f.devices
            log.info("devices: %d %s device(s) in %d process(es), mesh %s, %d KV heads laid out; weights "
                     "multiplied by %s", d["count"], d["platform"], d["processes"],
                     " x ".join(f"{axis}={size}" for axis, size in d["mesh"].items()), d["kv_heads"],
                     f.kernel)
        # bpw is the file's (the spec's Model.bpw); gb what the worker holds, in its own dtype.
        log.info("weights %s (file: %.1f bits per weight; held as %s: %.2f GB)", f.weights, f.bpw,
                 f.dtype, f.gb)
        log.info("slots %d, ctx %d tokens each, prefix cache %s, host cache %d MiB", f.slots,
                 f.max_model_len, "on" if f.prefix_cache else "off", f.cache_ram_mib)
        log.info("deployment %s, components %s", f.deployment_id, f.component_set_sha)
        if f.speculative:
            log.info("speculative decoding %s", f.speculative)
        if f.same_answer:
            log.info("same answer: %s", f.same_answer)
        if not self.grammar_said and (f.grammar or f.grammar_off):
            self.grammar_said = True
            if f.grammar:
                log.info("tool calls: constrained by %s (every call names a tool, with valid arguments)",
                         f.grammar)
            else:
                log.warning("tool calls: unconstrained, %s; calls are read from what the model writes",
                            f.grammar_off)
        line = log.info if f.certification == "certified" else log.warning
        line("%s: %s", f.certification, f.certification_detail or "no certification gate ran")
        log.info("compiled in %.1f s; worker pid %d; ready", f.compile_s, msg.pid)


# =================================================================================================
# API formats (appendix): parse_* (JSON body -> Job, or ApiError naming a field), one Encoder per API
# (neutral events -> that API's SSE frames or JSON body). Pure: no await, no sockets, no token ids.
# =================================================================================================

@dataclass(frozen=True)
class ApiFormat:
    """Everything that differs between the four APIs; the routes and run_generation ask this, never the
    API's name. Its parse function and encoder are named, and looked up when asked for, so that this
    index stands at the appendix's head, above the subsections that define them (a test holds each
    name to its subsection)."""
    name: str                              # "chat", "completions", "messages", "responses"
    parse_name: str                        # its parse_*: JSON body -> Job, or ApiError naming a field
    encoder_name: str                      # its Encoder: neutral events -> SSE frames or a JSON body
    subsection: str                        # the title of the subsection below that defines both
    error_body: Callable[[ApiError], dict]
    id_prefix: str                         # the response id's prefix, as the real API spells it
    echoes_model: bool                     # the answer names the model the client asked for
    anthropic: bool = False                # error statuses: 529 instead of 429/503; any model name
    prompt_field: str = "messages"         # the field a prompt too long for the context is named by

    @property
    def parse(self) -> Callable[[dict], Job]:
        return globals()[self.parse_name]

    @property
    def encoder(self) -> type:
        return globals()[self.encoder_name]


# Every wire format by name, one line each; the routes table points at these. Messages and Responses
# answer with the model name the client sent (Claude Code sends claude-* and checks it comes back);
# Chat and Completions with the served id, as OpenAI-compatible servers do.
API_FORMATS: dict[str, ApiFormat] = {api.name: api for api in (
    ApiFormat("chat", "parse_chat", "ChatEncoder", "OpenAI Chat Completions", openai_error_body, "chatcmpl-", False),
    ApiFormat("completions", "parse_completion", "CompletionEncoder", "OpenAI Completions", openai_error_body,
              "cmpl-", False, prompt_field="prompt"),
    ApiFormat("messages", "parse_messages", "MessagesEncoder", "Anthropic Messages", anthropic_error_body, "msg_",
              True, anthropic=True),
    ApiFormat("responses", "parse_responses", "ResponsesEncoder", "OpenAI Responses", openai_error_body, "resp_",
              True, prompt_field="input"),
)}


@dataclass
class Meta:
    """What an encoder needs besides the events."""
    id: str                       # the response id (chatcmpl-..., cmpl-..., msg_..., resp_...)
    created: int                  # unix time
    model: str                    # the model name to answer with
    prompt_tokens: int = 0        # prompt length after the template (known before generation starts)


class Encoder(Protocol):
    """What run_generation asks of an API's encoder: one class per API, built as Encoder(job, meta),
    pure (events in, bytes and dicts out). Feeding Done produces the stream's last frames itself (the
    finish chunk, usage, [DONE], message_stop, ...). A request that fails (the device, a worker that
    died twice, a shutdown) never reaches Done: run_generation answers it with the status, or ends a
    started stream with error(err)."""

    # True: start() waits until admitted(usage) gave the prompt's cached/uncached split (Anthropic's
    # message_start carries it); the frames before it are SSE comments.
    starts_on_admission: bool = False

    def admitted(self, usage: chat.Usage) -> None:
        """The worker gave the prompt a slot; usage has the prompt's cached tokens."""

    def start(self) -> list[bytes]:
        """SSE frames before any output (e.g. message_start, response.created)."""
        ...

    def feed(self, ev: Any) -> list[bytes]:
        """SSE frames for one neutral event; also accumulates the body."""
        ...

    def keepalive(self) -> bytes:
        """A frame sent while a long prompt is prefilled (a comment or a ping)."""
        ...

    def body(self) -> "dict | JsonText":
        """The non-streamed response, after Done was fed."""
        ...

    def error(self, err: ApiError) -> list[bytes]:
        """Frames that end a started stream with an error."""
        ...


# ---- common fields (sampling, max tokens, stop) -------------------------------------------------

def bad_field(name: str, why: str) -> ApiError:
    return ApiError(400, f"{name}: {why}", param=name)


# The device takes sampling numbers as float32 and integers as int32 (top_k) or 64-bit key data (seed):
# a value outside those would overflow on the way there, and one request's bad value must never reach
# the batch it shares with others. Python's json reads NaN and Infinity, which no range check catches.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38   # the smallest normal float32: a positive value below it is 0 there
INT32_MAX = 2**31 - 1
SEED_RANGE = (-2**63, 2**64 - 1)
# Stop strings: OpenAI's Chat takes at most 4, Anthropic documents no limit; these bounds hold every
# client we know of with room to spare, and keep the stop automaton (engine/chat.StopStrings) small.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1000


def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, hi_open: bool = False) -> float:
    """A JSON number field with its range, finite and representable as float32; bools are not numbers."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_field(name, f"must be a number, got {type(value).__name__}")
    if not -FLOAT32_MAX <= value <= FLOAT32_MAX:     # also false for NaN
        raise bad_field(name, f"must be a finite number (float32), got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise bad_field(name, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise bad_field(name, f"must be {'<' if hi_open else '<='} {hi}, got {value}")
    if lo_open and lo == 0 and value < FLOAT32_TINY:
        raise bad_field(name, f"must be > 0 as a float32 (at least {FLOAT32_TINY:.4g}), got {value}")
    return float(value)


def _integer(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, f"must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise bad_field(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad_field(name, f"must be <= {hi}, got {value}")
    return value


def _stop_strings(value: Any, name: str) -> list[str] | None:
    """stop (a string or a list) or stop_sequences (a list): non-empty strings, bounded in number and
    length, each naming its place when wrong."""
    if value is None:
        return None
    if isinstance(value, str) and name == "stop":
        value = [value]
    if not isinstance(value, list):
        raise bad_field(name, "must be a string or a list of non-empty strings" if name == "stop"
                        else "must be a list of non-empty strings")
    if len(value) > MAX_STOP_STRINGS:
        raise bad_field(name, f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
    for i, x in enumerate(value):
        why = ("must be a non-empty string" if not isinstance(x, str) or not x else
               f"is longer than {MAX_STOP_CHARS} characters ({len(x)})" if len(x) > MAX_STOP_CHARS else None)
        if why:
            raise bad_field(name, f"string {i} {why}")
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_field(name, f"must be true or false, got {type(value).__name__}")
    return value


# Fields a route lists as accepted and ignored, and their type: a wrong type is a client bug worth
# hearing about. A field a route does not list is ignored unread (the spec), whatever its type.
IGNORED_TYPES = {"merge": bool, "store": bool, "metadata": dict, "client_metadata": dict}


def parse_common(body: dict, job: Job, max_tokens_names: tuple[str, ...] = ("max_tokens",),
                 ignored: tuple[str, ...] = ()) -> Job:
    """The fields every generation API shares: sampling, max tokens, stop strings, stream, n.

    max_tokens_names lists the API's names for the token limit, weakest first: a later one wins
    (Chat: max_tokens then max_completion_tokens). None of them set = up to the end of the context.
    ignored: the fields of IGNORED_TYPES the route lists, type-checked and otherwise ignored.
    """
    s = job.sampling
    s.temperature = _number(body, "temperature", 0.0, 0.0, 4.0)
    s.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    s.top_k = _integer(body, "top_k", 0, INT32_MAX) or 0
    s.min_p = _number(body, "min_p", 0.0, 0.0, 1.0, hi_open=True)
    s.seed = _integer(body, "seed", *SEED_RANGE)
    s.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, lo_open=True)
    s.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    s.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise bad_field("n", f"must be 1, got {n}")
    for name in max_tokens_names:
        value = _integer(body, name, 1)
        if value is not None:
            job.max_tokens = value
    stop_sequences = _stop_strings(body.get("stop_sequences"), "stop_sequences")
    stop = _stop_strings(body.get("stop"), "stop")
    job.stop = list(stop if stop is not None else stop_sequences or [])
    job.stream = _boolean(body, "stream")
    job.model = _string(body, "model")
    job.session = _string(body, "prompt_cache_key")
    for name in ignored:
        _typed(body, name, IGNORED_TYPES[name], name)
    return job


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_field(name, f"must be a string, got {type(value).__name__}")
    return value


# ---- OpenAI Chat Completions ---------------------------------------------------------------------

# Chat roles as the template sees them: developer is the newer name of system, function the legacy
# name of tool.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool", "function": "tool"}
# Content parts this text-only model cannot read; refused by name so the client learns why.
MEDIA_PARTS = ("image_url", "input_audio", "file")
# reasoning_effort values that ask for no thinking; every other value turns it on.
NO_THINKING_EFFORTS = ("none", "minimal")
# Chat has no "abort" or "error" finish: an aborted answer's client is gone anyway, and an error ends
# the stream through error().
CHAT_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}
# An SSE comment: clients skip it, and it keeps proxies and idle timers from closing the stream.
SSE_COMMENT = b": keep-alive\n\n"

_KIND_NAMES = {str: "a string", bool: "true or false", dict: "an object", list: "a list"}


def _as(value: Any, kind: type, field: str, default: Any = None) -> Any:
    """value if it has the JSON type kind, default when absent or null, else a 400 naming field."""
    if value is None:
        return default
    if not isinstance(value, kind):
        raise bad_field(field, f"must be {_KIND_NAMES[kind]}, got {type(value).__name__}")
    return value


def _typed(obj: dict, key: str, kind: type, field: str, default: Any = None) -> Any:
    return _as(obj.get(key), kind, field, default)


def _text_parts(parts: list, where: str, kinds: dict[str, str], media: tuple[str, ...], example: str) -> str:
    """A list of text parts joined by newlines. kinds maps each accepted part type to the key holding
    its text; media part types get a 400 saying the model reads text only. Chat and Responses share it."""
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in media:
            raise bad_field(at, f"{kind} parts are not supported: this model reads text only")
        if kind not in kinds:
            raise bad_field(at, f'must be a text part {{"type": "{example}", "text": ...}}, got type {kind!r}')
        texts.append(_typed(part, kinds[kind], str, f"{at}.{kinds[kind]}", ""))
    return "\n".join(texts)


def _content_text(content: Any, field: str, text_kinds: tuple[str, ...] = ("text",)) -> str:
    """Message content as one string: a string, null, or a list of text parts joined by newlines.

    A part {"type": K, K: "..."} is read for each K in text_kinds ("text"; assistants also "refusal").
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(field, f"must be a string, a list of text parts or null, got {type(content).__name__}")
    return _text_parts(content, field, {k: k for k in text_kinds}, MEDIA_PARTS, "text")


def _function_part(obj: Any, where: str, shape: str) -> tuple[dict, str]:
    """A Chat tool or tool call: {"type": "function", "function": {"name": ..., ...}} -> (function, name)."""
    if not isinstance(obj, dict):
        raise bad_field(where, f"must be an object {{{shape}}}")
    if obj.get("type", "function") != "function":
        raise bad_field(f"{where}.type", f"must be function, got {obj.get('type')!r}")
    fn = _typed(obj, "function", dict, f"{where}.function")
    if fn is None:
        raise bad_field(f"{where}.function", "required: an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_field(f"{where}.function.name", "must be a non-empty string")
    return fn, name


def tool_list(value: Any, field: str = "tools") -> list:
    """A request's tool definitions: a list of at most MAX_TOOLS."""
    tools = _as(value, list, field, [])
    if len(tools) > MAX_TOOLS:
        raise bad_field(field, f"{len(tools)} tools; at most {MAX_TOOLS} may be offered at once")
    return tools


def tool_name(value: Any, field: str) -> str:
    """A tool definition's name, as the APIs define it (TOOL_NAME)."""
    if not isinstance(value, str) or not TOOL_NAME.match(value):
        raise bad_field(field, "must be 1-64 letters, digits, underscores or hyphens, got "
                               f"{value if not isinstance(value, str) else value[:80]!r}")
    return value


def _chat_history_calls(calls: Any, field: str) -> list[chat.ToolCall]:
    """An assistant message's earlier tool_calls; arguments stay the JSON text the client sent."""
    out = []
    for j, call in enumerate(_as(calls, list, field, [])):
        where = f"{field}[{j}]"
        fn, name = _function_part(call, where, "id, type, function: {name, arguments}")
        args = fn.get("arguments")
        if isinstance(args, dict):      # some clients send the object itself
            args = json.dumps(args, ensure_ascii=False)
        elif args is not None and not isinstance(args, str):
            raise bad_field(f"{where}.function.arguments", "must be a JSON string")
        call_id = _typed(call, "id", str, f"{where}.id") or new_id("call_")
        out.append(chat.ToolCall(id=call_id, name=name, arguments=args or "{}"))
    return out


def _chat_messages(messages: Any) -> list[chat.Message]:
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_field(f"{where}.role", f"each message must be an object whose role is one of "
                                             f"{', '.join(CHAT_ROLES)}; got {role!r}")
        msg = chat.Message(role=CHAT_ROLES[role])
        if msg.role == "assistant":
            msg.content = _content_text(m.get("content"), f"{where}.content", ("text", "refusal"))
            msg.reasoning = _typed(m, "reasoning_content", str, f"{where}.reasoning_content") or None
            msg.tool_calls = _chat_history_calls(m.get("tool_calls"), f"{where}.tool_calls")
        else:
            msg.content = _content_text(m.get("content"), f"{where}.content")
        name = _typed(m, "name", str, f"{where}.name")   # accepted and ignored, but typed
        if msg.role == "tool":
            msg.tool_call_id = _typed(m, "tool_call_id", str, f"{where}.tool_call_id")
            msg.name = name          # a hint of which tool answered
        out.append(msg)
    return out


def _chat_tools(tools: Any) -> list[chat.Tool]:
    out: list[chat.Tool] = []
    names: set[str] = set()         # a set: a list of 10,000 tools is checked in one pass
    for i, t in enumerate(tool_list(tools)):
        where = f"tools[{i}]"
        fn, _ = _function_part(t, where, "type, function: {name, description, parameters}")
        name = tool_name(fn.get("name"), f"{where}.function.name")
        if name in names:
            raise bad_field(f"{where}.function.name", f"{name!r} names two tools")
        names.add(name)
        tool = chat.Tool(name=name)
        tool.description = _typed(fn, "description", str, f"{where}.function.description", "")
        tool.parameters = _typed(fn, "parameters", dict, f"{where}.function.parameters", tool.parameters)
        out.append(tool)    # "strict" is accepted: the arguments are the model's own JSON either way
    return out


def _chat_tool_choice(choice: Any, tools: list[chat.Tool]) -> str | dict:
    how = 'must be auto, none, required or {"type": "function", "function": {"name": NAME}}'
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_field("tool_choice", f"{how}, got {choice!r}")
        if choice == "required" and not tools:
            raise bad_field("tool_choice", "required needs at least one tool in tools")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_field("tool_choice", how)
    if all(tool.name != name for tool in tools):
        raise bad_field("tool_choice", f"names the tool {name!r}, which is not in tools")
    return {"name": name}


def _chat_thinking(body: dict, job: Job) -> None:
    """job.thinking, .effort and .preserve_thinking. An explicit enable_thinking wins over
    reasoning_effort; preserve_thinking left out is the chat format's default."""
    kwargs = _typed(body, "chat_template_kwargs", dict, "chat_template_kwargs", {})
    enable = _typed(kwargs, "enable_thinking", bool, "chat_template_kwargs.enable_thinking")
    if enable is None:
        enable = _typed(body, "enable_thinking", bool, "enable_thinking")
    effort = _typed(body, "reasoning_effort", str, "reasoning_effort")
    if effort is None:
        effort = _typed(kwargs, "reasoning_effort", str, "chat_template_kwargs.reasoning_effort")
    if enable is None:
        enable = effort is not None and effort not in NO_THINKING_EFFORTS
    job.thinking, job.effort = enable, effort
    job.preserve_thinking = _typed(kwargs, "preserve_thinking", bool, "chat_template_kwargs.preserve_thinking")


def parse_chat(body: dict) -> Job:
    """A Chat Completions request -> Job (400 naming the field for anything this server cannot do)."""
    job = parse_common(body, Job(), ("max_tokens", "max_completion_tokens"), ignored=("merge", "store"))
    if _boolean(body, "logprobs"):            # false is what asking for none says
        raise bad_field("logprobs", "log probabilities are not supported")
    if body.get("top_logprobs") is not None:
        raise bad_field("top_logprobs", "log probabilities are not supported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_field("response_format", 'only {"type": "text"} is supported; structured output '
                                           "(json_object, json_schema) is not")
    job.messages = _chat_messages(body.get("messages"))
    job.tools = _chat_tools(body.get("tools"))
    job.tool_choice = _chat_tool_choice(body.get("tool_choice"), job.tools)
    _chat_thinking(body, job)
    options = _typed(body, "stream_options", dict, "stream_options", {})
    job.include_usage = _typed(options, "include_usage", bool, "stream_options.include_usage", False)
    return job   # merge, store, user, metadata, parallel_tool_calls and unknown fields are ignored


def _fingerprint(job: Job) -> dict:
    """system_fingerprint "seed-<seed>" names the seed that sampled the answer, so a client can
    reproduce it; empty when the request gave none (the worker then draws its own)."""
    seed = job.sampling.seed
    return {} if seed is None else {"system_fingerprint": f"seed-{seed}"}


def _openai_head(job: Job, meta: Meta, obj: str) -> dict:
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            **_fingerprint(job)}


def _openai_usage(usage: chat.Usage, cached: bool) -> dict:
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def _openai_stream_error(err: ApiError, meta: Meta) -> list[bytes]:
    """The spec's error event of a started OpenAI stream: the error body with the response id as
    request_id, then the [DONE] every OpenAI client waits for."""
    body = openai_error_body(err)
    body["error"]["request_id"] = meta.id
    return [sse(body), sse("[DONE]")]


class ChatEncoder(Encoder):
    """Neutral events -> chat.completion.chunk frames, and the chat.completion body."""

    def __init__(self, job: Job, meta: Meta):
        self.job, self.meta = job, meta
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.started: dict[int, chat.ToolCallStart] = {}
        self.calls: dict[int, dict] = {}      # finished calls: index -> {"id", "type", "function": ...}
        self.done: chat.Done | None = None

    def _chunk(self, delta: dict | None, finish: str | None = None, **extra: Any) -> bytes:
        """One chunk; delta None makes the usage chunk, whose choices are empty."""
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return sse({**_openai_head(self.job, self.meta, "chat.completion.chunk"), "choices": choices,
                    **extra})

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def keepalive(self) -> bytes:
        return SSE_COMMENT

    def feed(self, ev: Any) -> list[bytes]:
        if isinstance(ev, chat.TextDelta) and ev.text:
            self.content.append(ev.text)
            return [self._chunk({"content": ev.text})]
        if isinstance(ev, chat.ReasoningDelta) and ev.text:
            self.reasoning.append(ev.text)
            return [self._chunk({"reasoning_content": ev.text})]
        if isinstance(ev, chat.ToolCallStart):
            self.started[ev.index] = ev
            return []
        if isinstance(ev, chat.ToolCallEnd) and ev.index in self.started:
            # A call goes out whole, in one chunk, once it is complete (clients that join pieces get
            # the same text): never half an object, and never a call cut off by max_tokens.
            start = self.started[ev.index]
            call = {"id": start.id, "type": "function", "function": {"name": start.name, "arguments": ev.arguments}}
            self.calls[ev.index] = call
            return [self._chunk({"tool_calls": [{"index": ev.index, **call}]})]
        if isinstance(ev, chat.Done):
            return self._finish(ev)
        return []   # ToolCallArgs: the arguments go out whole with ToolCallEnd

    def _finish(self, done: chat.Done) -> list[bytes]:
        self.done = done
        timings = {"timings": done.timings} if done.timings else {}
        frames = [self._chunk({}, CHAT_FINISH.get(done.finish_reason, "stop"), **timings)]
        if self.job.include_usage:
            frames.append(self._chunk(None, usage=_openai_usage(done.usage, True), **timings))
        return frames + [sse("[DONE]")]

    def body(self) -> dict:
        """The chat.completion."""
        done = self.done or chat.Done("abort")
        text = "".join(self.content)
        calls = [self.calls[i] for i in sorted(self.calls)]
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if calls:
            message["tool_calls"] = calls
        out = {**_openai_head(self.job, self.meta, "chat.completion"),
               "choices": [{"index": 0, "message": message,
                            "finish_reason": CHAT_FINISH.get(done.finish_reason, "stop")}],
               "usage": _openai_usage(done.usage, True)}
        if done.timings:
            out["timings"] = done.timings
        return out

    def error(self, err: ApiError) -> list[bytes]:
        return _openai_stream_error(err, self.meta)

# ---- OpenAI Completions --------------------------------------------------------------------------

# Completions has only these two finishes; a raw prompt has no tools, and an aborted client is gone.
COMPLETION_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def parse_completion(body: dict) -> Job:
    """A Completions request -> Job with the raw prompt (no chat template)."""
    job = parse_common(body, Job(), ("max_tokens", "max_completion_tokens"), ignored=("merge",))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_field("prompt", "must be a string or a list of one string (token arrays and several "
                                  "prompts are not supported)")
    if not prompt:
        raise bad_field("prompt", "must not be empty: there is nothing to continue")
    job.prompt = prompt
    if body.get("logprobs") is not None:
        raise bad_field("logprobs", "log probabilities are not supported")
    if body.get("echo"):
        raise bad_field("echo", "echoing the prompt is not supported")
    if body.get("suffix"):
        raise bad_field("suffix", "a suffix (fill in the middle) is not supported")
    if body.get("best_of") not in (None, 1) or isinstance(body.get("best_of"), bool):
        raise bad_field("best_of", f"must be 1, got {body.get('best_of')!r}")
    return job


class CompletionEncoder(Encoder):
    """Neutral events -> text_completion frames (the stream has no usage), and the body."""

    def __init__(self, job: Job, meta: Meta):
        self.job, self.meta = job, meta
        self.text: list[str] = []
        self.done: chat.Done | None = None

    def _completion(self, text: str, finish: str | None) -> dict:
        return {**_openai_head(self.job, self.meta, "text_completion"),
                "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    def start(self) -> list[bytes]:
        return []

    def keepalive(self) -> bytes:
        return SSE_COMMENT

    def feed(self, ev: Any) -> list[bytes]:
        if isinstance(ev, chat.TextDelta) and ev.text:
            self.text.append(ev.text)
            return [sse(self._completion(ev.text, None))]
        if isinstance(ev, chat.Done):
            self.done = ev
            return [sse(self._completion("", COMPLETION_FINISH.get(ev.finish_reason, "stop"))),
                    sse("[DONE]")]
        return []   # a raw prompt is plain text: no reasoning or tool calls are parsed out of it

    def body(self) -> dict:
        """The text_completion."""
        done = self.done or chat.Done("abort")
        return {**self._completion("".join(self.text), COMPLETION_FINISH.get(done.finish_reason, "stop")),
                "usage": _openai_usage(done.usage, False)}

    def error(self, err: ApiError) -> list[bytes]:
        return _openai_stream_error(err, self.meta)

# ---- Anthropic Messages --------------------------------------------------------------------------

# Claude Code's first system block, `x-anthropic-billing-header: cc_version=...; cch=...;`, changes on
# every request: kept in the prompt, it would make every turn miss the prefix cache from token one.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
# The signature of the thinking blocks we send. Clients echo thinking blocks back with it; any
# signature is accepted on input (there is nothing to verify: the thinking is plain text here).
THINKING_SIGNATURE = "mashbox-local"
# Put before the text of a tool result the client marked is_error, so the model knows the call failed.
TOOL_ERROR_PREFIX = "Error: "
# Block types that carry media: the model reads text only.
MEDIA_BLOCK_TYPES = frozenset({"image", "document", "audio", "file", "container_upload"})
# Tool types the client runs itself; every other type is a server tool (web search, code execution,
# bash_..., text_editor_...), which this server does not run.
CLIENT_TOOL_TYPES = (None, "custom")
# tool_choice.type -> Job.tool_choice ("tool" names one tool and is handled apart).
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Job finish reason -> stop_reason. An aborted answer is never sent, an error ends with an error event.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def _block_type(block: Any, where: str) -> str:
    """The type of one content block; media blocks are refused here, for every role."""
    if not isinstance(block, dict):
        raise bad_field(where, "must be a content block object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise bad_field(f"{where}.type", "must be a string")
    if kind in MEDIA_BLOCK_TYPES:
        raise bad_field(f"{where}.type", f"{kind} blocks are not supported: the model reads text only")
    return kind


def _typed_blocks(content: list, where: str):
    """(where, type, block) for each content block of a list, its type checked by _block_type."""
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        yield at, _block_type(block, at), block


def _block_str(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_field(f"{where}.{key}", "must be a string")
    return value


def _texts(value: Any, where: str) -> list[str]:
    """A string, or a list of text blocks (system prompts, system messages): the texts in order."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise bad_field(where, "must be a string or a list of text blocks")
    texts = []
    for at, kind, block in _typed_blocks(value, where):
        if kind != "text":
            raise bad_field(f"{at}.type", "must be text")
        texts.append(_block_str(block, "text", at))
    return texts


def _messages_tools(value: Any) -> tuple[list[chat.Tool], dict[str, chat.Tool]]:
    """`tools` -> (tools shown up front, deferred tools by name).

    A tool with defer_loading is left out of the up-front list: Claude Code adds such tools to `tools`
    once a tool search found them, and listing them up front would change the start of the prompt
    (and lose the prefix cache) at that moment. The model learns a deferred tool where a tool_result
    references it (see _tool_reference)."""
    shown: list[chat.Tool] = []
    deferred: dict[str, chat.Tool] = {}
    names: set[str] = set()         # of the shown tools (a set: one pass over 10,000 tools)
    for i, spec in enumerate(tool_list(value)):
        at = f"tools[{i}]"
        if not isinstance(spec, dict):
            raise bad_field(at, "must be an object")
        kind = spec.get("type")
        if kind not in CLIENT_TOOL_TYPES:
            raise bad_field(f"{at}.type", f"server tool {kind!r} is not supported: only client tools "
                                          "(type custom or absent)")
        name = tool_name(spec.get("name"), f"{at}.name")
        if name in deferred or name in names:
            raise bad_field(f"{at}.name", f"{name!r} names two tools")
        names.add(name)
        description = spec.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_field(f"{at}.description", "must be a string")
        schema = spec.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise bad_field(f"{at}.input_schema", "must be a JSON Schema object")
        # `$schema` names the JSON Schema dialect: nothing the model needs, tokens in every prompt.
        tool = chat.Tool(name, description or "", {k: v for k, v in schema.items() if k != "$schema"})
        defer = spec.get("defer_loading", False)
        if not isinstance(defer, bool):
            raise bad_field(f"{at}.defer_loading", "must be true or false")
        if defer:
            deferred[name] = tool
        else:
            shown.append(tool)
    return shown, deferred


def _tool_definition(tool: chat.Tool) -> str:
    """A tool as one JSON line, in the shape Qwen chat templates list tools in the system prompt."""
    return chat.tojson({"type": "function", "function": {
        "name": tool.name, "description": tool.description, "parameters": tool.parameters}})


@dataclass
class DeferredTools:
    """A Messages request's tools with defer_loading, and those a tool search's tool_reference has
    shown the model in the conversation: it may call those, though the system prompt lists none."""
    tools: dict[str, chat.Tool]
    referenced: dict[str, chat.Tool] = field(default_factory=dict)


def _tool_reference(block: dict, where: str, deferred: DeferredTools) -> str:
    """A tool_reference (a tool search's answer): the tool's name, or its whole definition when it is a
    deferred tool, which the model has not seen anywhere else."""
    name = _block_str(block, "tool_name", where)
    tool = deferred.tools.get(name)
    if tool is None:
        return name
    deferred.referenced[name] = tool
    return _tool_definition(tool)


def _tool_result(block: dict, where: str, call_names: dict[str, str],
                 deferred: DeferredTools) -> chat.Message:
    call_id = _block_str(block, "tool_use_id", where)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for at, kind, part in _typed_blocks(content, f"{where}.content"):
            if kind == "text":
                parts.append(_block_str(part, "text", at))
            elif kind == "tool_reference":
                parts.append(_tool_reference(part, at, deferred))
            else:
                raise bad_field(f"{at}.type", "must be text or tool_reference")
        text = "\n".join(parts)
    else:
        raise bad_field(f"{where}.content", "must be a string or a list of content blocks")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad_field(f"{where}.is_error", "must be true or false")
    if is_error:
        text = TOOL_ERROR_PREFIX + text
    return chat.Message("tool", text, tool_call_id=call_id, name=call_names.get(call_id))


def _user_turn(content: Any, where: str, call_names: dict[str, str],
               deferred: DeferredTools) -> list[chat.Message]:
    """A user message: each tool_result becomes a tool message, the text blocks between them user
    messages, in the order they came."""
    if isinstance(content, str):
        return [chat.Message("user", content)]
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or a list of content blocks")
    out: list[chat.Message] = []
    texts: list[str] = []
    for at, kind, block in _typed_blocks(content, where):
        if kind == "text":
            texts.append(_block_str(block, "text", at))
        elif kind == "tool_result":
            if texts:
                out.append(chat.Message("user", "\n".join(texts)))
                texts = []
            out.append(_tool_result(block, at, call_names, deferred))
        else:
            raise bad_field(f"{at}.type", f"{kind!r} is not a user block (text, tool_result)")
    if texts or not out:
        out.append(chat.Message("user", "\n".join(texts)))
    return out


def _assistant_turn(content: Any, where: str, call_names: dict[str, str]) -> chat.Message:
    """An assistant message: text, thinking (-> reasoning) and tool_use blocks become one message."""
    msg = chat.Message("assistant")
    if isinstance(content, str):
        msg.content = content
        return msg
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or a list of content blocks")
    texts, thoughts = [], []
    for at, kind, block in _typed_blocks(content, where):
        if kind == "text":
            texts.append(_block_str(block, "text", at))
        elif kind == "thinking":
            thoughts.append(_block_str(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue      # another server's encrypted thinking: nothing the model could read
        elif kind == "tool_use":
            call_id = _block_str(block, "id", at)
            name = _block_str(block, "name", at)
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_field(f"{at}.input", "must be an object")
            call_names[call_id] = name
            msg.tool_calls.append(chat.ToolCall(call_id, name, chat.arguments_text(args)))
        else:
            raise bad_field(f"{at}.type", f"{kind!r} is not an assistant block "
                                          "(text, thinking, redacted_thinking, tool_use)")
    msg.content = "\n".join(texts)
    msg.reasoning = "\n".join(thoughts) if thoughts else None
    return msg


def _conversation(value: Any, deferred: DeferredTools) -> list[chat.Message]:
    """`messages` -> Messages. A system or developer message stays where it stands (Claude Code sends
    one after the first user message; moving it would change what the model reads)."""
    if not isinstance(value, list) or not value:
        raise bad_field("messages", "must be a non-empty list of messages")
    out: list[chat.Message] = []
    call_names: dict[str, str] = {}     # tool_use id -> tool name, to name the tool results
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise bad_field(where, "must be an object")
        role, content = item.get("role"), item.get("content")
        if role == "user":
            out += _user_turn(content, f"{where}.content", call_names, deferred)
        elif role == "assistant":
            out.append(_assistant_turn(content, f"{where}.content", call_names))
        elif role in ("system", "developer"):
            out.append(chat.Message("system", "\n".join(_texts(content, f"{where}.content"))))
        else:
            raise bad_field(f"{where}.role", "must be user, assistant, system or developer")
    return out


def _messages_tool_choice(value: Any, job: Job, deferred: DeferredTools) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_field("tool_choice", "must be an object")
    kind = value.get("type")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str):
            raise bad_field("tool_choice.name", "must be a string")
        if name in deferred.tools:
            job.tools.append(deferred.tools[name])     # the model must see the tool it is made to call
        elif not any(t.name == name for t in job.tools):
            raise bad_field("tool_choice.name", f"no tool named {name!r} in tools")
        job.tool_choice = {"name": name}
    elif kind in TOOL_CHOICES:
        job.tool_choice = TOOL_CHOICES[kind]
        if kind == "any" and not job.tools:
            raise bad_field("tool_choice.type", "any needs at least one tool in tools")
    else:
        raise bad_field("tool_choice.type", "must be auto, any, tool or none")


def _messages_thinking(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise bad_field("thinking", "must be an object")
    kind = value.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_field("thinking.type", "must be enabled, adaptive or disabled")
    budget = value.get("budget_tokens")       # accepted and ignored: the model ends its own thinking
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise bad_field("thinking.budget_tokens", "must be an integer")
    return kind != "disabled"


def _keeps_all_thinking(value: Any) -> bool | None:
    """True where context_management asks to keep every earlier thinking block (Claude Code:
    clear_thinking with keep "all"), else None (the chat format's default). Keeping it in the prompt
    also keeps earlier turns unchanged for the prefix cache."""
    edits = value.get("edits") if isinstance(value, dict) else None
    keep = isinstance(edits, list) and any(
        isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking") and e.get("keep") == "all"
        for e in edits)
    return True if keep else None


def parse_messages(body: dict) -> Job:
    """A Messages (or count_tokens) request -> Job. metadata is typed and ignored; fields not named
    here (safeguards, service_tier, container, mcp_servers, cache_control on any block...) are
    accepted and ignored unread."""
    job = parse_common(body, Job(), ("max_tokens", "max_completion_tokens"), ignored=("metadata",))
    job.tools, found = _messages_tools(body.get("tools"))
    deferred = DeferredTools(found)
    _messages_tool_choice(body.get("tool_choice"), job, deferred)
    job.thinking = _messages_thinking(body.get("thinking"))
    job.preserve_thinking = _keeps_all_thinking(body.get("context_management"))
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_field("output_config", "must be an object")
    if config and config.get("format") is not None:
        raise bad_field("output_config.format", "structured output is not supported")
    system = body.get("system")
    messages: list[chat.Message] = []
    if system is not None:
        text = "\n".join(t for t in _texts(system, "system") if not t.startswith(BILLING_HEADER_PREFIX))
        if text:
            messages.append(chat.Message("system", text))
    job.messages = messages + _conversation(body.get("messages"), deferred)
    listed = {t.name for t in job.tools}
    job.extra_tools = [t for name, t in deferred.referenced.items() if name not in listed]
    return job


def _tool_input(arguments: str) -> dict:
    """tool_use.input from the arguments' JSON text; {} when it is not a JSON object."""
    try:
        value = chat.read_json(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _toolu_id(call_id: str) -> str:
    """Anthropic's tool-use ids start with toolu_; the output parser's start with call_."""
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


class MessagesEncoder(Encoder):
    """Neutral events -> an Anthropic Message (body) or its stream: message_start, ping, per block
    content_block_start / content_block_delta / content_block_stop, message_delta, message_stop."""

    def __init__(self, job: Job, meta: Meta):
        self.meta = meta
        self.content: list[dict] = []        # the body's blocks so far
        self.open: int | None = None         # index of the block being streamed, if any
        self.tool_blocks: dict[int, int] = {}    # tool call index -> its block's index
        self.finished: set[int] = set()          # tool call indices whose call ended (ToolCallEnd)
        self.args_sent: dict[int, str] = {}      # block index -> arguments text streamed so far
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = self._usage(chat.Usage(prompt_tokens=meta.prompt_tokens))
        self.ended = False

    # The spec's message_start usage is the split of the prompt into cached and uncached tokens, known
    # once the worker has given the prompt a slot: the stream's first frames wait for it.
    starts_on_admission = True

    def admitted(self, usage: chat.Usage) -> None:
        self.usage = self._usage(usage)

    @staticmethod
    def _usage(u: chat.Usage) -> dict:
        return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens}

    def _message(self, content: list[dict]) -> dict:
        return {"id": self.meta.id, "type": "message", "role": "assistant", "model": self.meta.model,
                "content": content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self.usage}

    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return sse({"type": kind, **fields}, kind)

    def start(self) -> list[bytes]:
        return [self._event("message_start", message=self._message([])), self.keepalive()]

    def keepalive(self) -> bytes:
        return self._event("ping")

    def body(self) -> dict:
        # A tool_use block whose call never finished (cut off by max_tokens) is not a call to run.
        cut = {at for index, at in self.tool_blocks.items() if index not in self.finished}
        return self._message([block for at, block in enumerate(self.content) if at not in cut])

    def error(self, err: ApiError) -> list[bytes]:
        if self.ended:
            return []
        self.ended = True
        return [sse({**anthropic_error_body(err), "request_id": self.meta.id}, "error")]

    def feed(self, ev) -> list[bytes]:
        if self.ended:
            return []
        if isinstance(ev, chat.TextDelta):
            return self._delta("text", ev.text)
        if isinstance(ev, chat.ReasoningDelta):
            return self._delta("thinking", ev.text)
        if isinstance(ev, chat.ToolCallStart):
            frames = self._close()
            self.tool_blocks[ev.index] = len(self.content)
            self.args_sent[len(self.content)] = ""
            block = {"type": "tool_use", "id": _toolu_id(ev.id), "name": ev.name, "input": {}}
            return frames + self._open(block, dict(block))
        if isinstance(ev, chat.ToolCallArgs):
            at = self.tool_blocks.get(ev.index)
            if at is None or at != self.open or not ev.delta:
                return []
            self.args_sent[at] += ev.delta
            return [self._json_delta(at, ev.delta)]
        if isinstance(ev, chat.ToolCallEnd):
            return self._end_tool(ev)
        if isinstance(ev, chat.Done):
            return self._done(ev)
        return []

    def _open(self, body_block: dict, start_block: dict) -> list[bytes]:
        self.open = len(self.content)
        self.content.append(body_block)
        return [self._event("content_block_start", index=self.open, content_block=start_block)]

    def _close(self) -> list[bytes]:
        """Ends the open block; a thinking block gets its signature first."""
        if self.open is None:
            return []
        at, self.open = self.open, None
        frames = []
        if self.content[at]["type"] == "thinking":
            frames.append(self._event("content_block_delta", index=at,
                                      delta={"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        return frames + [self._event("content_block_stop", index=at)]

    def _delta(self, kind: str, text: str) -> list[bytes]:
        """A piece of text or thinking: continues the open block of that kind, or opens one."""
        if not text:
            return []
        frames = []
        if self.open is None or self.content[self.open]["type"] != kind:
            frames = self._close()
            if kind == "text":
                frames += self._open({"type": "text", "text": ""}, {"type": "text", "text": ""})
            else:
                frames += self._open({"type": "thinking", "thinking": "", "signature": THINKING_SIGNATURE},
                                     {"type": "thinking", "thinking": "", "signature": ""})
        self.content[self.open][kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else \
            {"type": "thinking_delta", "thinking": text}
        return frames + [self._event("content_block_delta", index=self.open, delta=delta)]

    def _json_delta(self, at: int, piece: str) -> bytes:
        return self._event("content_block_delta", index=at,
                           delta={"type": "input_json_delta", "partial_json": piece})

    def _end_tool(self, ev: chat.ToolCallEnd) -> list[bytes]:
        at = self.tool_blocks.get(ev.index)
        if at is None:
            return []
        self.finished.add(ev.index)
        self.content[at]["input"] = _tool_input(ev.arguments)
        if at != self.open:
            return []
        # Whatever of the arguments was not streamed yet goes out before the block ends: a client
        # builds `input` from the deltas alone.
        sent = self.args_sent[at]
        rest = ev.arguments[len(sent):] if ev.arguments.startswith(sent) else ""
        frames = [self._json_delta(at, rest)] if rest else []
        return frames + self._close()

    def _done(self, ev: chat.Done) -> list[bytes]:
        frames = self._close()
        self.ended = True
        self.stop_sequence = ev.stop_sequence
        self.stop_reason = "stop_sequence" if ev.stop_sequence else STOP_REASONS.get(ev.finish_reason, "end_turn")
        self.usage = self._usage(ev.usage)
        return frames + [
            self._event("message_delta", delta={"stop_reason": self.stop_reason,
                                                "stop_sequence": self.stop_sequence}, usage=self.usage),
            self._event("message_stop")]


# ---- OpenAI Responses ----------------------------------------------------------------------------

# Codex is the client that matters here: it sends its system prompt as developer messages, an id and a
# status on every item, namespace and custom (grammar) tools next to hosted ones, and its reasoning
# items back with reasoning_text. Nothing is stored between requests: each one carries its history.

# The tool kinds the client runs. Every other type (web_search, file_search, code_interpreter, mcp,
# tool_search, ...) is run by the provider, which this server is not: such tools are left out of what
# the model sees instead of refused, since Codex lists web_search and tool_search in every request.
RESPONSES_CLIENT_TOOLS = ("function", "custom", "namespace")
# History items of those hosted tools: they never ran here, and the model has nothing to read in them.
RESPONSES_HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call",
    "computer_call", "computer_call_output", "mcp_list_tools", "mcp_call", "mcp_approval_request",
    "mcp_approval_response", "tool_search_call", "tool_search_output"})
# Text parts, by the key that holds their text. Media parts are refused: the model reads text only.
RESPONSES_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
RESPONSES_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
# Fields that point at state stored by a provider; this server keeps none, so it cannot honour them.
RESPONSES_STATEFUL = ("previous_response_id", "conversation", "prompt")
# The tool name the model calls for a local_shell_call history item (its arguments are the action).
LOCAL_SHELL_TOOL = "local_shell"


@dataclass
class ResponsesJob(Job):
    """A Job plus what a Response echoes back and how the client names its tools."""
    tools_echo: str = "[]"                    # the request's tools, as sent, written as JSON once
    tool_choice_echo: Any = "auto"            # the request's tool_choice, as sent
    parallel_tool_calls: bool = False
    client_names: dict | None = None          # name the model sees -> the client's tool name


def _custom_tool_parameters() -> dict:
    """A custom (freeform) tool is shown to the model as a function of one string, its raw input."""
    return {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def _responses_tool(t: dict, where: str, seen: str, namespace: str | None) -> chat.Tool:
    description = _typed(t, "description", str, f"{where}.description", "")
    if t.get("type", "function") == "function":
        params = _typed(t, "parameters", dict, f"{where}.parameters", None)
        tool = chat.Tool(name=seen, description=description, namespace=namespace)
        if params is not None:
            tool.parameters = params
        return tool     # "strict" is accepted: the arguments are the model's own JSON either way
    fmt = _typed(t, "format", dict, f"{where}.format", {"type": "text"})
    if fmt.get("type") == "grammar":
        syntax = _typed(fmt, "syntax", str, f"{where}.format.syntax", "")
        definition = _typed(fmt, "definition", str, f"{where}.format.definition", "")
        rule = (f"The string argument `input` is the raw text itself, written in this {syntax} "
                f"grammar:\n{definition}")
        description = f"{description}\n\n{rule}" if description else rule
    elif fmt.get("type") != "text":
        raise bad_field(f"{where}.format", 'must be {"type": "text"} or {"type": "grammar", "syntax", '
                                           f'"definition"}}, got type {fmt.get("type")!r}')
    return chat.Tool(name=seen, description=description, parameters=_custom_tool_parameters(),
                     kind="custom", namespace=namespace)


def _responses_tools(tools: Any) -> tuple[list[chat.Tool], dict]:
    """(the tools the model sees, {(namespace, client name): name the model sees}).

    A namespace's function is shown under its plain name when no other tool has that name: the model
    was trained on plain names, they cost fewer tokens, and the response gives the namespace back in
    its own field. A name that two tools share is shown as "namespace__name", the MCP convention.
    """
    found = []     # (where, namespace, tool object)
    for i, t in enumerate(tool_list(tools)):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise bad_field(where, 'must be an object with a type ("function", "custom", "namespace", ...)')
        if t["type"] == "namespace":
            ns = _tool_name(t, where)
            for j, inner in enumerate(tool_list(t.get("tools"), f"{where}.tools")):
                if not isinstance(inner, dict) or inner.get("type", "function") not in ("function", "custom"):
                    raise bad_field(f"{where}.tools[{j}]", "a namespace holds function and custom tools")
                found.append((f"{where}.tools[{j}]", ns, inner))
        elif t["type"] in RESPONSES_CLIENT_TOOLS:
            found.append((where, None, t))
    if len(found) > MAX_TOOLS:
        raise bad_field("tools", f"{len(found)} tools with the namespaces' own; at most {MAX_TOOLS} may "
                                 "be offered at once")
    counts: dict[str, int] = {}
    for where, _, t in found:
        name = _tool_name(t, where)
        counts[name] = counts.get(name, 0) + 1
    out, seen_names, shown = [], {}, set()
    for where, ns, t in found:
        seen = t["name"] if ns is None or counts[t["name"]] == 1 else f"{ns}__{t['name']}"
        if seen in shown:
            raise bad_field(f"{where}.name", f"{t['name']!r} names two tools")
        seen_names[(ns, t["name"])] = seen
        shown.add(seen)
        out.append(_responses_tool(t, where, seen, ns))
    return out, seen_names


def _tool_name(t: dict, where: str) -> str:
    return tool_name(t.get("name"), f"{where}.name")


def _responses_tool_choice(choice: Any, job: Job, seen_names: dict) -> str | dict:
    how = ('must be auto, none, required, {"type": "function", "name": NAME} or '
           '{"type": "allowed_tools", "mode": ..., "tools": [...]}')
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_field("tool_choice", f"{how}, got {choice!r}")
        if choice == "required" and not job.tools:
            raise bad_field("tool_choice", "required needs at least one function or custom tool in tools")
        return choice
    if not isinstance(choice, dict):
        raise bad_field("tool_choice", how)
    kind = choice.get("type")
    if kind in ("function", "custom"):
        fn = choice.get("function")
        name = choice.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
        matches = _named_tools(seen_names, name, choice.get("namespace"))
        if len(matches) != 1:
            raise bad_field("tool_choice", f"names the tool {name!r}, which is not one tool in tools")
        return {"name": matches[0]}
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad_field("tool_choice.mode", f"must be auto or required, got {mode!r}")
        allowed = set()
        for entry in _typed(choice, "tools", list, "tool_choice.tools", []):
            if isinstance(entry, dict) and entry.get("type") in ("function", "custom"):
                allowed.update(_named_tools(seen_names, entry.get("name"), entry.get("namespace")))
        job.tools = [t for t in job.tools if t.name in allowed]   # hosted entries name nothing here
        if mode == "required" and not job.tools:
            raise bad_field("tool_choice.tools", "required needs at least one function or custom tool")
        return mode
    raise bad_field("tool_choice.type", f"{kind!r} is not available here: only function and custom "
                                        "tools run on this server")


def _named_tools(seen_names: dict, name: Any, namespace: Any) -> list[str]:
    """The names the model sees for the client's tool `name` (within `namespace` when given; without
    one, a top-level tool of that name before namespace tools)."""
    if namespace is None and (None, name) in seen_names:
        return [seen_names[(None, name)]]
    return [seen for (ns, n), seen in seen_names.items()
            if n == name and (namespace is None or ns == namespace)]


def _responses_text(content: Any, where: str) -> str:
    """Message content or tool output as one string: a string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, f"must be a string or a list of text parts, got {type(content).__name__}")
    return _text_parts(content, where, RESPONSES_TEXT_PARTS, RESPONSES_MEDIA_PARTS, "input_text")


def _required_str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_field(f"{where}.{key}", "must be a non-empty string")
    return value


class _ResponsesHistory:
    """Input items -> Messages.

    The items of one assistant turn (reasoning, then text, then calls, as the model produced them)
    become ONE assistant Message, so that the prompt shows the model exactly what it generated and the
    next request's prompt extends the last one token for token (a prefix-cache hit).
    """
    REASONING, TEXT, CALLS = 0, 1, 2

    def __init__(self, seen_names: dict):
        self.seen_names = seen_names
        self.messages: list[chat.Message] = []
        self.turn: chat.Message | None = None    # the assistant Message this turn's items join
        self.stage = -1
        self.call_names: dict[str, str] = {}     # call_id -> the name the model called

    def assistant(self, stage: int) -> chat.Message:
        """The assistant Message for an item of `stage`: the open one if the item can follow what it
        holds (reasoning < text < calls; calls may repeat), else a new one."""
        if self.turn is None or stage < self.stage or (stage == self.stage != self.CALLS):
            self.turn = chat.Message(role="assistant")
            self.messages.append(self.turn)
        self.stage = stage
        return self.turn

    def seen(self, namespace: str | None, name: str) -> str:
        """The name the model sees for a client's tool (its own name if tools no longer list it)."""
        return self.seen_names.get((namespace, name)) or name

    def add(self, msg: chat.Message) -> None:
        self.messages.append(msg)
        self.turn = None

    def call(self, call_id: str, name: str, arguments: str) -> None:
        self.assistant(self.CALLS).tool_calls.append(chat.ToolCall(id=call_id, name=name, arguments=arguments))
        self.call_names[call_id] = name

    def output(self, call_id: str, content: str) -> None:
        self.add(chat.Message(role="tool", content=content, tool_call_id=call_id,
                              name=self.call_names.get(call_id)))

    def item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise bad_field(where, "must be an object (a message or another input item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self.message(item, where)
        elif kind == "reasoning":
            parts = _typed(item, "content", list, f"{where}.content", [])
            text = "\n".join(p["text"] for p in parts if isinstance(p, dict)
                             and p.get("type") in ("reasoning_text", "text") and isinstance(p.get("text"), str))
            if text:        # a reasoning item with only a summary or encrypted content shows nothing
                self.assistant(self.REASONING).reasoning = text
        elif kind == "function_call":
            args = item.get("arguments")
            if args is not None and not isinstance(args, (str, dict)):   # some clients send the object
                raise bad_field(f"{where}.arguments", "must be a JSON string")
            name = _required_str(item, "name", where)
            ns = _typed(item, "namespace", str, f"{where}.namespace")
            self.call(_required_str(item, "call_id", where), self.seen(ns, name),
                      chat.arguments_text(args) if args else "{}")
        elif kind == "custom_tool_call":
            raw = _typed(item, "input", str, f"{where}.input", "")
            name = _required_str(item, "name", where)
            ns = _typed(item, "namespace", str, f"{where}.namespace")
            self.call(_required_str(item, "call_id", where), self.seen(ns, name),
                      chat.tojson({"input": raw}))    # as the model writes a custom call
        elif kind == "local_shell_call":
            action = _typed(item, "action", dict, f"{where}.action", {})
            call_id = item.get("call_id") or _required_str(item, "id", where)
            self.call(call_id, LOCAL_SHELL_TOOL, chat.tojson(action))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self.output(_required_str(item, "call_id", where),
                        _responses_text(item.get("output", ""), f"{where}.output"))
        elif kind == "local_shell_call_output":
            call_id = item.get("call_id") or _required_str(item, "id", where)
            self.output(call_id, _responses_text(item.get("output", ""), f"{where}.output"))
        elif kind == "item_reference":
            raise bad_field(f"{where}.type", "item_reference needs stored items and this server stores "
                                             "none: send the item itself")
        elif kind not in RESPONSES_HOSTED_ITEMS:
            raise bad_field(f"{where}.type", f"unknown input item type {kind!r}")

    def message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad_field(f"{where}.role", f"must be system, developer, user or assistant, got {role!r}")
        text = _responses_text(item.get("content"), f"{where}.content")
        if role == "assistant":
            self.assistant(self.TEXT).content = text
        else:   # developer is the newer name of system; both stay where they stand
            self.add(chat.Message(role="user" if role == "user" else "system", content=text))


def parse_responses(body: dict) -> Job:
    """A Responses request -> Job (400 naming the field for anything this server cannot do)."""
    job = parse_common(body, ResponsesJob(), ("max_tokens", "max_completion_tokens", "max_output_tokens"),
                       ignored=("store", "client_metadata"))
    for name in RESPONSES_STATEFUL:
        if body.get(name) is not None:
            raise bad_field(name, "this server stores no responses, conversations or prompts: "
                                  "send the whole conversation in input")
    if _typed(body, "background", bool, "background", False):
        raise bad_field("background", "background responses need stored state, which this server "
                                      "does not keep: leave background false")
    if body.get("top_logprobs") is not None:
        raise bad_field("top_logprobs", "log probabilities are not supported")
    for entry in _typed(body, "include", list, "include", []):
        if not isinstance(entry, str):
            raise bad_field("include", "must be a list of strings")
        if "logprobs" in entry:
            raise bad_field("include", f"{entry!r}: log probabilities are not supported")
    text = _typed(body, "text", dict, "text", {})
    fmt = text.get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_field("text.format", 'only {"type": "text"} is supported; structured output '
                                       "(json_object, json_schema) is not")
    job.tools, seen_names = _responses_tools(body.get("tools"))
    job.client_names = {seen: name for (_, name), seen in seen_names.items()}
    # Written once here (off the loop for a large body): every Response event echoes it.
    job.tools_echo = json.dumps(body.get("tools") or [], ensure_ascii=False, separators=(",", ":"))
    job.tool_choice_echo = body.get("tool_choice") or "auto"
    job.tool_choice = _responses_tool_choice(body.get("tool_choice"), job, seen_names)
    job.parallel_tool_calls = _typed(body, "parallel_tool_calls", bool, "parallel_tool_calls", False)
    reasoning = _typed(body, "reasoning", dict, "reasoning", {})
    effort = _typed(reasoning, "effort", str, "reasoning.effort")
    job.thinking, job.effort = effort is not None and effort not in NO_THINKING_EFFORTS, effort
    # The client decides which reasoning the model sees again: every reasoning item it sends back is
    # kept in the prompt, which also keeps the prompt of the next turn an extension of this one.
    job.preserve_thinking = True
    history = _ResponsesHistory(seen_names)
    instructions = _typed(body, "instructions", str, "instructions")
    if instructions:
        history.add(chat.Message(role="system", content=instructions))
    items = body.get("input")
    if isinstance(items, str):
        history.add(chat.Message(role="user", content=items))
    elif isinstance(items, list) and items:
        for i, item in enumerate(items):
            history.item(item, f"input[{i}]")
    else:
        raise bad_field("input", "must be a string or a non-empty list of items")
    job.messages = history.messages
    return job   # store, client_metadata, metadata, user, service_tier, truncation... are ignored


def _input_value_index(buf: str) -> int | None:
    """Where the string value starts in arguments text that begins `{"input": "`: its index, None
    while buf may still become that, -1 once it cannot."""
    i = 0
    for token in ("{", '"input"', ":", '"'):
        while i < len(buf) and buf[i] in " \t\r\n":
            i += 1
        piece = buf[i:i + len(token)]
        if piece != token:
            return None if i + len(piece) == len(buf) and token.startswith(piece) else -1
        i += len(token)
    return i


class _CustomInput:
    """Streams the raw input of a custom tool call out of the model's arguments text
    `{"input": "..."}` as it grows, decoding JSON escapes; an escape cut in two waits for its end.
    Any other shape streams nothing: the whole arguments decide the input at the end."""

    def __init__(self):
        self.buf = ""
        self.pos: int | None = None   # where the undecoded rest of the string starts in buf
        self.closed = False           # the string ended, or the text has another shape

    def feed(self, delta: str) -> str:
        self.buf += delta
        if self.closed:
            return ""
        if self.pos is None:
            start = _input_value_index(self.buf)
            if start is None or start < 0:
                self.closed = start is not None
                return ""
            self.pos = start
        s, j = self.buf, self.pos
        while j < len(s):
            if s[j] == '"':
                self.closed = True    # the closing quote: the input is complete
                break
            size = 1
            if s[j] == "\\":
                size = 2
                if s[j + 1:j + 2] == "u":
                    size = 6
                    if 0xD800 <= _hex(s[j + 2:j + 6]) < 0xDC00:
                        size = 12     # a high surrogate: decode it with its low half, never alone
            if j + size > len(s):
                break
            j += size
        piece, self.pos = s[self.pos:j], j
        try:
            return json.JSONDecoder(strict=False).decode(f'"{piece}"')
        except ValueError:
            self.closed = True
            return ""


def _hex(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        return -1


def _custom_input(arguments: str) -> str:
    """The raw input of a custom tool call from the model's whole arguments text."""
    try:
        value = chat.read_json(arguments, strict=False)
    except ValueError:
        return arguments      # not JSON: the model wrote the raw input itself
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), str):
        return next(iter(value.values()))
    return value if isinstance(value, str) else arguments


def _responses_usage(u: chat.Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class ResponsesEncoder(Encoder):
    """Neutral events -> Responses stream events, and the Response object.

    Every output item is announced (response.output_item.added), filled by its deltas and closed
    (response.output_item.done: Codex records nothing without it); response.completed (or
    .incomplete, or error + response.failed) comes last. Items keep one id and output_index from
    their first event to the final response.
    """

    def __init__(self, job: Job, meta: Meta):
        self.job, self.meta = job, meta
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None             # the message or reasoning item receiving text
        self.calls: dict[int, dict] = {}          # ToolCallStart.index -> its open call item
        self.inputs: dict[int, _CustomInput] = {}  # custom calls: the raw input being decoded
        self.spaces = ""           # whitespace waiting for text: an answer of blanks makes no item
        self.status = "in_progress"
        self.usage: dict | None = None
        self.incomplete: dict | None = None
        self.failure: dict | None = None
        self.tools = {t.name: t for t in job.tools}
        self.client_names = getattr(job, "client_names", None) or {}

    # ---- frames ----

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **fields}, event=kind)

    def _response_event(self, kind: str) -> bytes:
        self.seq += 1
        return sse(JsonText(f'{{"type":"{kind}","sequence_number":{self.seq},"response":{self._response()}}}'),
                   event=kind)

    def _response(self) -> "JsonText":
        """The Response as it stands, as JSON; incomplete_details and error appear only when they
        apply. The tools' echo was written at parse time: it is joined in, never written again (a
        large tool list would cost the event loop a serialization per event)."""
        job = self.job
        out = {"id": self.meta.id, "object": "response", "created_at": self.meta.created,
               "status": self.status, "model": self.meta.model, "output": self.output,
               "parallel_tool_calls": getattr(job, "parallel_tool_calls", False),
               "tool_choice": getattr(job, "tool_choice_echo", job.tool_choice), "usage": self.usage}
        if self.incomplete:
            out["incomplete_details"] = self.incomplete
        if self.failure:
            out["error"] = self.failure
        text = json.dumps(out, ensure_ascii=False, separators=(",", ":"))
        return JsonText(f'{text[:-1]},"tools":{getattr(job, "tools_echo", "[]")}}}')

    def start(self) -> list[bytes]:
        return [self._response_event("response.created"), self._response_event("response.in_progress")]

    def keepalive(self) -> bytes:
        return SSE_COMMENT

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _add(self, item: dict) -> bytes:
        self.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)

    # ---- events ----

    def feed(self, ev: Any) -> list[bytes]:
        if self.status != "in_progress":
            return []       # the response already ended
        if isinstance(ev, chat.TextDelta) and ev.text:
            if self.open is None or self.open["type"] != "message":
                if not ev.text.strip():
                    self.spaces += ev.text
                    return []
                text, self.spaces = self.spaces + ev.text, ""
                return self._text("message", text)
            return self._text("message", ev.text)
        if isinstance(ev, chat.ReasoningDelta) and ev.text:
            self.spaces = ""
            return self._text("reasoning", ev.text)
        if isinstance(ev, chat.ToolCallStart):
            return self._call_start(ev)
        if isinstance(ev, chat.ToolCallArgs) and ev.delta and ev.index in self.calls:
            return self._call_args(ev.index, ev.delta)
        if isinstance(ev, chat.ToolCallEnd) and ev.index in self.calls:
            return self._call_end(ev.index, ev.arguments, "completed")
        if isinstance(ev, chat.Done):
            return self._done(ev)
        return []

    def _text(self, kind: str, delta: str) -> list[bytes]:
        frames = []
        if self.open is None or self.open["type"] != kind:
            frames += self._close_text("completed")
            part = {"type": "output_text", "text": "", "annotations": []} if kind == "message" \
                else {"type": "reasoning_text", "text": ""}
            if kind == "message":
                item = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}
            else:
                item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress",
                        "summary": [], "content": []}
            frames.append(self._add(item))
            item["content"].append(part)
            frames.append(self._event("response.content_part.added", **self._where(item),
                                      content_index=0, part=part))
            self.open = item
        item = self.open
        item["content"][0]["text"] += delta
        if kind == "message":
            frames.append(self._event("response.output_text.delta", **self._where(item), content_index=0,
                                      delta=delta, logprobs=[]))
        else:
            frames.append(self._event("response.reasoning_text.delta", **self._where(item),
                                      content_index=0, delta=delta))
        return frames

    def _close_text(self, status: str) -> list[bytes]:
        """Close the open message or reasoning item: its .done events, then output_item.done."""
        item, self.open = self.open, None
        if item is None:
            return []
        part = item["content"][0]
        item["status"] = status
        done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self._event(done, **self._where(item), content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", **self._where(item), content_index=0, part=part),
                self._event("response.output_item.done", output_index=self.output.index(item), item=item)]

    def _call_start(self, ev: chat.ToolCallStart) -> list[bytes]:
        frames = self._close_text("completed")
        self.spaces = ""
        tool = self.tools.get(ev.name)
        name = self.client_names.get(ev.name, ev.name)
        if tool is not None and tool.kind == "custom":
            item = {"id": new_id("ctc_"), "type": "custom_tool_call", "status": "in_progress",
                    "call_id": ev.id, "name": name, "input": ""}
            self.inputs[ev.index] = _CustomInput()
        else:
            item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                    "call_id": ev.id, "name": name, "arguments": ""}
        if tool is not None and tool.namespace:
            item["namespace"] = tool.namespace
        self.calls[ev.index] = item
        return frames + [self._add(item)]

    def _call_args(self, index: int, delta: str) -> list[bytes]:
        item = self.calls[index]
        if item["type"] == "function_call":
            item["arguments"] += delta
            return [self._event("response.function_call_arguments.delta", **self._where(item), delta=delta)]
        piece = self.inputs[index].feed(delta)
        if not piece:
            return []
        item["input"] += piece
        return [self._event("response.custom_tool_call_input.delta", **self._where(item), delta=piece)]

    def _call_end(self, index: int, arguments: str | None, status: str) -> list[bytes]:
        """Close a call: the whole arguments (None: keep what streamed), then output_item.done."""
        item = self.calls.pop(index)
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = arguments = item["arguments"] if arguments is None else arguments
            frames = [self._event("response.function_call_arguments.done", **self._where(item),
                                  name=item["name"], arguments=arguments)]
        else:
            # The streamed input is normally all of it; send what is missing (or, if the text had a
            # shape the stream could not follow, all of it) before the whole input.
            sent = item["input"]
            whole = sent if arguments is None else _custom_input(arguments)
            rest = whole[len(sent):] if whole.startswith(sent) else ""
            frames = [self._event("response.custom_tool_call_input.delta", **self._where(item), delta=rest)] \
                if rest else []
            item["input"] = whole
            frames.append(self._event("response.custom_tool_call_input.done", **self._where(item),
                                      input=whole))
        return frames + [self._event("response.output_item.done", output_index=self.output.index(item),
                                     item=item)]

    def _done(self, done: chat.Done) -> list[bytes]:
        # Cut off by max_output_tokens: the items still open at the end are incomplete.
        cut = done.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        frames = self._close_text(status)
        for index in sorted(self.calls):
            frames += self._call_end(index, None, status)
        self.usage = _responses_usage(done.usage)
        self.status = status     # an aborted answer's client is gone: completed is as good as any
        if cut:
            self.incomplete = {"reason": "max_output_tokens"}
        return frames + [self._response_event(f"response.{status}")]

    def body(self) -> "JsonText":
        """The Response."""
        return self._response()

    def error(self, err: ApiError) -> list[bytes]:
        """End a started stream: the error event (with the response id as request_id), then
        response.failed with the response as it stood."""
        code = err.code or err.type
        self.status = "failed"
        self.failure = {"code": code, "message": err.message}
        return [self._event("error", code=code, message=err.message, param=err.param,
                            request_id=self.meta.id),
                self._response_event("response.failed")]


# =================================================================================================
# CLI, start and stop
# =================================================================================================

@dataclass
class ServeConfig:
    """What `mashbox run` was asked for (its flags, one field each). None = the model's default from
    models.json."""
    # the model, and where the server listens
    model: str | None = None
    weights: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # the engine's size (the memory may lower the defaults, never what is asked for)
    slots: int | None = None
    ctx: int | None = None
    cache_ram_mib: int | None = None
    # who may call it, and what is logged
    api_key_file: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    log_prompts: bool = False
    # admission's bounds
    max_waiting: int = MAX_WAITING_TOTAL
    max_waiting_per_tenant: int = MAX_WAITING_PER_TENANT
    max_connections: int = MAX_CONNECTIONS
    recertify: bool = False          # run the certification gate even when its result is recorded
    ui: bool = False                 # serve the chat page at /
    weights_dtype: str | None = None  # --weights-dtype (None: models.json's, else auto)
    devices: int | str = 1           # --devices: how many devices the model is split over, or "all"
    # Several hosts (jax.distributed): process 0's host:port, how many processes, this one's id;
    # None: MASHBOX_COORDINATOR, ... (engine.sharding.distributed_settings), else one process.
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    speculative: str = "auto"        # --speculative: auto, mtp, ngram, off (engine.speculative)

    @property
    def distributed(self) -> tuple[str, int, int] | None:
        return (self.coordinator, self.num_processes, self.process_id) if self.coordinator else None


def _at_least(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{what} must be >= {low}, got {value}")
        return value
    return parse


def _path(what: str) -> Callable[[str], str]:
    """A path flag: an empty one (`--api-key-file ''`, an unset variable in a script) is an error,
    not "no file": for keys, that would start a server without the keys it was asked for."""
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"{what} needs a path, got an empty string")
        return text
    return parse


def _devices(text: str) -> int | str:
    """--devices: a count >= 1, or "all" (every device of the platform, counted by the worker)."""
    return "all" if text == "all" else _at_least(1, "--devices")(text)


def _port(text: str) -> int:
    value = _at_least(0, "--port")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"--port must be <= 65535, got {value}")
    return value


def arg_parser() -> argparse.ArgumentParser:
    """`mashbox run`'s flags; each one's default is ServeConfig's, named only there."""
    parser = argparse.ArgumentParser(prog="mashbox", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve one model over HTTP")
    _model_and_engine_flags(run, ServeConfig())
    _server_flags(run, ServeConfig())
    return parser


def _model_and_engine_flags(run: argparse.ArgumentParser, default: ServeConfig) -> None:
    """What is served and how the engine runs it, and where the server listens."""
    run.add_argument("model", nargs="?", default=None,
                     help="a model id from models.json, a Hugging Face folder, or a GGUF file of a qwen2, qwen3, "
                          "qwen3moe, qwen3next, qwen35 or qwen35moe model (default: models.json's default)")
    run.add_argument("--weights", metavar="PATH", help="the weights folder (overrides models.json), or random[:SEED]: "
                                                       "weights drawn at the id's real shape from the seed (default 0), "
                                                       "reading no weight file (benchmarks without the weights)")
    run.add_argument("--host", default=default.host, help=f"address to listen on (default {default.host})")
    run.add_argument("--port", type=_port, default=default.port,
                     help=f"port (default {default.port}; 0 = any free port)")
    run.add_argument("--slots", type=_at_least(1, "--slots"), help="requests decoded together")
    run.add_argument("--ctx", type=_at_least(16, "--ctx"), help="tokens of context per slot")
    run.add_argument("--weights-dtype", choices=registry.WEIGHTS_DTYPE_CHOICES + registry.RANDOM_BLOCK_FORMS,
                     help="how the worker holds the weights: int8 = int8 matrices with per-channel "
                          "scales (a quarter of float32's memory; where the native kernel runs, a "
                          "GGUF's Q5_0, Q8_0, Q4_K, Q5_K and Q6_K matrices keep their own blocks); "
                          "fp8 = an FP8 checkpoint's float8 matrices as they are; auto = the platform's fastest (int8 on CPUs with "
                          "int8 dot instructions or AVX2, else float32; on accelerators bfloat16, or fp8 "
                          "for an FP8 checkpoint) unless models.json sets one. Random weights (--weights "
                          "random) also come as a GGUF's blocks, q8_0, q6_k, q5_k or q4_k, where the native "
                          "kernel runs; their auto is the widest form that fits the memory")
    run.add_argument("--devices", type=_devices, default=default.devices, metavar="N",
                     help=f"split the model over N devices of the platform (tensor parallel; default "
                          f"{default.devices}; all = every one); N must divide the model's attention heads")
    run.add_argument("--coordinator", metavar="HOST:PORT",
                     help="several hosts: process 0's address for jax.distributed; every host runs the "
                          "same command but for --process-id (also MASHBOX_COORDINATOR)")
    run.add_argument("--num-processes", type=_at_least(1, "--num-processes"), metavar="K",
                     help="several hosts: how many (also MASHBOX_NUM_PROCESSES)")
    run.add_argument("--process-id", type=_at_least(0, "--process-id"), metavar="I",
                     help="several hosts: this one's index; 0 serves HTTP, the others follow it "
                          "(also MASHBOX_PROCESS_ID)")
    run.add_argument("--speculative", choices=protocol.SPECULATIVE_MODES, default=default.speculative,
                     help="speculative decoding: draft the next tokens and check them in one step (output "
                          "unchanged); mtp = with the checkpoint's MTP layer, ngram = from the "
                          "conversation's own text, auto = either, where it is exact (the native kernel) "
                          "and measured to pay (default auto)")


def _server_flags(run: argparse.ArgumentParser, default: ServeConfig) -> None:
    """The host cache, who may call, what is logged, admission's bounds, the page, the gate."""
    run.add_argument("--cache-ram", dest="cache_ram_mib", metavar="MIB", type=_at_least(0, "--cache-ram"),
                     help="host memory for saved prompt states, MiB (0 = off)")
    run.add_argument("--api-key-file", metavar="PATH", type=_path("--api-key-file"),
                     help="API keys, one a line: KEY or KEY TENANT (also MASHBOX_API_KEY)")
    run.add_argument("--allowed-host", dest="allowed_hosts", metavar="NAME", action="extend", nargs="+",
                     default=[], help="host names the server answers to besides its own address")
    run.add_argument("--log-prompts", action="store_true", help="log each request's prompt text")
    run.add_argument("--max-waiting", type=_at_least(0, "--max-waiting"), default=default.max_waiting,
                     help=f"requests waiting for a slot, in all (default {default.max_waiting})")
    run.add_argument("--max-waiting-per-tenant", type=_at_least(0, "--max-waiting-per-tenant"),
                     default=default.max_waiting_per_tenant,
                     help=f"requests waiting for a slot, per tenant (default {default.max_waiting_per_tenant})")
    run.add_argument("--max-connections", type=_at_least(1, "--max-connections"),
                     default=default.max_connections,
                     help=f"open client connections (default {default.max_connections})")
    run.add_argument("--ui", action="store_true",
                     help="serve the MASHBOX Chat page at / (health stays at /health and /v1/health)")
    run.add_argument("--recertify", action="store_true",
                     help="run the certification gate even when this build's result is recorded")


def config_from_args(argv: list[str] | None) -> ServeConfig:
    """The flags, one ServeConfig field each (the parser's dest is the field's name)."""
    args = vars(arg_parser().parse_args(argv))
    args["allowed_hosts"] = tuple(args["allowed_hosts"])
    return ServeConfig(**{name: args[name] for name in ServeConfig.__dataclass_fields__})


def worker_args(spec: "registry.ModelSpec", config: ServeConfig, folder: str,
                sizing: "memory.Sizing | None" = None) -> dict:
    """What the engine worker starts with: engine.worker.WorkerArgs's fields, as a dict, so that this
    process never imports the worker's module (and with it jax). sizing: slots, ctx and host cache
    chosen to fit the memory (memory.size); None: the flags, else the model's defaults."""
    if sizing is not None:
        slots, ctx, cache_ram_mib = sizing.slots, sizing.ctx, sizing.cache_ram_mib
    else:
        slots, ctx = config.slots or spec.slots, config.ctx or spec.ctx
        cache_ram_mib = spec.cache_ram_mib if config.cache_ram_mib is None else config.cache_ram_mib
    return {"model_id": spec.id, "weights_folder": folder, "slots": slots, "ctx": ctx,
            "chat_format": spec.chat_format, "cache_ram_mib": cache_ram_mib,
            "recertify": config.recertify, "golden": spec.golden,
            "dtype": weights_dtype(spec, config), "devices": config.devices,
            "distributed": config.distributed, "speculative": config.speculative}


def weights_dtype(spec: "registry.ModelSpec", config: ServeConfig) -> str:
    """--weights-dtype, else the model's default from models.json ("auto": the worker picks)."""
    return config.weights_dtype or spec.weights_dtype


def check_block_form(spec: "registry.ModelSpec", config: ServeConfig) -> None:
    """A --weights-dtype of GGUF blocks (registry.RANDOM_BLOCK_FORMS) is a form of random weights, held
    by the native kernel: a registry.RegistryError where there are no random weights or no kernel."""
    from engine import native
    asked = weights_dtype(spec, config)
    if asked not in registry.RANDOM_BLOCK_FORMS:
        return
    if spec.random_seed is None:
        raise registry.RegistryError(f"--weights-dtype {asked} is a form of random weights (--weights random); "
                                     "a GGUF file's own blocks are held as they are with int8 (or auto)")
    if native.tier() is None or not memory.engine_on_host():
        raise registry.RegistryError(f"--weights-dtype {asked}: GGUF blocks are held by the native kernel, which "
                                     "does not run here (it needs a CPU with one of its tiers): use int8")


def random_form(spec: "registry.ModelSpec", config: ServeConfig, cfg: ModelConfig) -> str:
    """--weights random: the form its folder is drawn in (registry.random_storage), --weights-dtype's
    or, for auto, the widest that fits this host's memory (memory.random_weights_dtype); config then
    asks the worker for the dtype that holds it."""
    asked = weights_dtype(spec, config)
    if asked == "auto":
        asked = memory.random_weights_dtype(cfg, lambda checkpoint, held: memory.size(
            cfg, checkpoint, slots=config.slots, ctx=config.ctx, cache_ram_mib=config.cache_ram_mib,
            default_slots=spec.slots, default_ctx=spec.ctx, default_cache_ram_mib=spec.cache_ram_mib,
            weights_dtype=held, speculative=config.speculative))
        log.info("random weights: %s (the widest form whose worker fits %.0f%% of the available memory)",
                 asked, 100 * memory.RANDOM_AUTO_SHARE)
    stored, config.weights_dtype = registry.random_storage(asked)
    return stored


def size_worker(spec: "registry.ModelSpec", config: ServeConfig, folder: str,
                cfg: ModelConfig | None = None) -> "memory.Sizing":
    """Slots, ctx and host cache that fit this machine's memory, logged with the numbers; raises
    memory.DoesNotFit for a request that cannot fit. cfg: the model as the worker lays it out
    (None: the folder's config.json)."""
    cfg = cfg or load_config(folder)
    check_weights_dtype(cfg, weights_dtype(spec, config))
    sizing = memory.size(cfg, folder, slots=config.slots, ctx=config.ctx,
                         cache_ram_mib=config.cache_ram_mib, default_slots=spec.slots,
                         default_ctx=spec.ctx, default_cache_ram_mib=spec.cache_ram_mib,
                         weights_dtype=weights_dtype(spec, config), speculative=config.speculative)
    given = (config.slots, config.ctx, config.cache_ram_mib) != (None, None, None)
    chosen = ("defaults lowered to fit half the available memory" if sizing.shrunk
              else "the model's defaults, which fit" if not given else "as given")
    log.info("memory: %d slots x %d tokens, host cache %d MiB (%s); %s", sizing.slots, sizing.ctx,
             sizing.cache_ram_mib, chosen, sizing.describe())
    return sizing


# After SIGTERM/SIGINT the requests in flight get this long to finish; then the ones still running
# are ended with their route's error. With SHUTDOWN_WRITE_S and the worker's exit it stays under the
# 30 s that Kubernetes waits by default before it kills the process.
SHUTDOWN_GRACE_S = 20.0
# How long the ended requests get to write their error before every connection is closed.
SHUTDOWN_WRITE_S = 2.0


async def shutdown(app: App, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Stop accepting connections and new requests (503/529), let the generation requests in flight
    finish for grace_s, end the rest with their route's error, close every connection, stop the worker."""
    bridge = app.bridge
    bridge.closing = True
    if app._server is not None:
        app._server.close()     # no new connections; the open ones keep their running requests
    if bridge.in_flight:
        log.info("shutting down: %d request(s) running get %g s to finish", bridge.in_flight, grace_s)
    if not await bridge.wait_idle(grace_s):
        log.info("shutting down: ending the %d request(s) still running", bridge.in_flight)
        bridge.end_all()
        await bridge.wait_idle(SHUTDOWN_WRITE_S)
    await app.close()
    await asyncio.to_thread(bridge.stop)
    log.info("stopped")


async def serve(app: App, stop: asyncio.Event | None = None,
                prepare: Callable[[], Any] | None = None, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Listen, then start the engine, and serve until stop is set (or SIGINT/SIGTERM), then shut down
    cleanly (shutdown). A second SIGINT/SIGTERM exits at once, with status 128 + the signal's number.

    prepare, when given, runs in a thread after the port is open (health answers "loading" meanwhile:
    building the demo model takes a minute) and returns the worker's arguments.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s again: exiting now", sig.name)
            app.bridge.kill()
            os._exit(128 + sig)
        log.info("%s: shutting down (send it again to exit at once)", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError):
            pass   # not the main thread, or a platform without signals
    reload_keys_on_sighup(app.guard, loop)
    await app.start()
    log.info("listening on %s", app.url)
    try:
        if prepare is not None:
            app.bridge.worker_args = await asyncio.to_thread(prepare)
        app.bridge.on_failed.append(stop.set)
        if app.bridge.worker_args is not None:
            app.bridge.start()
        await stop.wait()
    finally:
        await shutdown(app, grace_s)


def main(argv: list[str] | None = None) -> int:
    """`python -m mashbox run ...`, start to stop: its exit status (2: a flag, MODEL or the keys refused;
    1: a model or worker that cannot serve; 0: a clean stop)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    memory.limit_heap_arenas(SERVER_HEAP_ARENAS)
    config = config_from_args(argv)
    try:
        spec, keys = resolve_start(config)
    except StartRefused as e:
        print(f"mashbox: {e}", file=sys.stderr)
        return 2
    if config.distributed is not None and config.process_id != 0:
        return run_follower(spec, config)
    if not keys.enabled and not is_loopback(config.host):
        print(f"mashbox: --host {config.host} is not loopback: give keys with --api-key-file or "
              "MASHBOX_API_KEY", file=sys.stderr)
        return 2
    app = build_app(config, spec, keys)
    try:
        asyncio.run(serve(app, prepare=lambda: prepare_worker(app, spec, config)))
    except (registry.RegistryError, ConfigError, WeightsError, OSError, memory.DoesNotFit) as e:
        print(f"mashbox: {e}", file=sys.stderr)
        return 1
    if app.bridge.failed:
        print(f"mashbox: {app.bridge.failed}", file=sys.stderr)
        return 1
    return 0


class StartRefused(Exception):
    """A flag, MODEL or the key file refused before anything starts (exit status 2); its message
    names which."""


def resolve_start(config: ServeConfig) -> tuple["registry.ModelSpec", "Keys"]:
    """The model to serve and the keys, and config's several-hosts settings from the flags or the
    environment (engine.sharding.distributed_settings); config.model becomes the served id."""
    try:
        spec = registry.resolve(config.model, config.weights)
        keys = Keys.load(config.api_key_file, os.environ.get("MASHBOX_API_KEY"))
    except registry.RegistryError as e:
        raise StartRefused(f"MODEL: {e}") from None
    except (OSError, KeyFileError) as e:
        raise StartRefused(f"keys: {e}") from None
    config.model = spec.id
    try:
        distributed = distributed_settings(config.coordinator, config.num_processes, config.process_id)
    except DevicesError as e:
        raise StartRefused(str(e)) from None
    if distributed is not None:
        config.coordinator, config.num_processes, config.process_id = distributed
    return spec, keys


def build_app(config: ServeConfig, spec: "registry.ModelSpec", keys: "Keys") -> App:
    """The server state for `mashbox run`: the real worker (or MASHBOX_WORKER_ENTRY's, for tests),
    the keys' guard, admission's bounds, the connection bound, the model's other names."""
    entry = os.environ.get(WORKER_ENTRY_ENV) or WORKER_ENTRY
    app = App(config, bridge=Bridge(worker_args=None, entry=entry, log=log.warning),
              guard=Guard(keys, config.host, config.allowed_hosts),
              admission=Admission(slots=config.slots or spec.slots, per_tenant=config.max_waiting_per_tenant,
                                  total=config.max_waiting),
              limits=ConnLimits(max_connections=config.max_connections), metrics=Metrics())
    app.model_aliases = {spec.hf_repo} if spec.hf_repo else set()
    app.planned_ctx = config.ctx or spec.ctx
    return app


def prepare_worker(app: App, spec: "registry.ModelSpec", config: ServeConfig) -> dict:
    """Start-up's checks and sizing, in a thread after the port is open (serve's prepare): the model's
    folder made ready, its config and tensors checked, the worker sized to the memory and the
    tokenizer loaded; the worker's arguments. A model the engine cannot run (a family not built yet,
    an unsupported option) is a start-up error here, not a worker that dies and is restarted forever:
    nothing here imports jax (engine.SERVER_MODULES)."""
    check_block_form(spec, config)
    form = random_form(spec, config, laid_out(config_from_dict(spec.config), config)) \
        if spec.random_seed is not None else "bf16"
    folder = registry.prepare(spec, progress_display(), form=form)
    model = load_config(folder)
    check_shapes(Checkpoint(folder), model)       # the weights are what the config says, by name
    cfg = laid_out(model, config)
    sizing = size_worker(spec, config, folder, cfg)
    app.planned_ctx = sizing.ctx        # the model card's context while the worker loads
    app.tokenizer = load_tokenizer(folder)
    app.tokenizer_folder = folder
    return worker_args(spec, config, folder, sizing)


def laid_out(cfg: ModelConfig, config: ServeConfig) -> ModelConfig:
    """cfg with the KV heads the worker lays out: repeated on more devices than the model has KV
    heads (with several hosts each brings --devices); "all" is counted by the worker."""
    if config.devices == "all":
        return cfg
    return replace(cfg, num_kv_heads=check_devices(cfg, config.devices * (config.num_processes or 1)))


def load_tokenizer(folder: str) -> chat.Tokenizer:
    """The model's tokenizer, now rather than when the worker is ready: a file missing (a weights-only
    folder) or not loading stops start-up with its name, before a minute of compiling."""
    path = Path(folder) / "tokenizer.json"
    try:
        tokenizer = chat.Tokenizer.from_folder(folder)
    except FileNotFoundError:
        raise registry.RegistryError(f"{path} is missing: a model folder holds its tokenizer "
                                     "beside config.json") from None
    except Exception as e:     # tokenizers raises its own Exception for a malformed file
        raise registry.RegistryError(f"the tokenizer in {folder} does not load: {e}") from None
    tokenizer.max_token_bytes      # its byte table, built now rather than in a request
    return tokenizer


def run_follower(spec: "registry.ModelSpec", config: ServeConfig) -> int:
    """A host other than process 0 (--process-id I > 0): follow_leader, as an exit status."""
    try:
        return follow_leader(spec, config)
    except (registry.RegistryError, OSError) as e:
        print(f"mashbox: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def follow_leader(spec: "registry.ModelSpec", config: ServeConfig) -> int:
    """`mashbox run --process-id I` with I > 0: no HTTP server; this host's worker joins the group and
    runs process 0's device calls (engine.worker.follow; the rest of its arguments come from there).
    A worker that fails, or ends because a peer is gone, is started again, after RESTART_BACKOFF_*
    when it keeps failing before it follows: it then waits in jax.distributed.initialize until the
    group forms again (process 0's server restarts its own worker too). Returns when process 0's
    worker stops cleanly (its server shut down), or on SIGINT/SIGTERM."""
    form = random_form(spec, config, config_from_dict(spec.config)) if spec.random_seed is not None else "bf16"
    folder = registry.prepare(spec, progress_display(), form=form)
    args = {"model_id": spec.id, "weights_folder": folder, "distributed": config.distributed}
    # a signal ends this process through its finally (the worker is killed with it)
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))
    failures = 0
    while True:
        process, conn = spawn_worker(FOLLOWER_ENTRY, args)
        log.info("follower worker %d: process %d of %d, coordinator %s", process.pid, config.process_id,
                 config.num_processes, config.coordinator)
        try:
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                if isinstance(msg, protocol.Note):
                    log.info("follower: %s", msg.message)
                    failures = 0
                elif isinstance(msg, protocol.Fault):
                    log.warning("follower fault: %s", msg.message)
            process.join()
        finally:
            if process.is_alive():
                process.kill()
        if process.exitcode == 0:
            log.info("process 0 stopped: this follower stops too")
            return 0
        failures += 1
        delay = restart_delay(failures)
        log.warning("follower worker %d ended (%s); starting a new one in %g s", process.pid,
                    _exit_status(process.exitcode), delay)
        time.sleep(delay)


if __name__ == "__main__":
    sys.exit(main())
