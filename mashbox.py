"""mashbox: serve one Qwen model over OpenAI Chat Completions, Completions, Responses and Anthropic
Messages, from a hand-written asyncio HTTP/1.1 server in front of a JAX engine worker process.

    python -m mashbox run [MODEL] [--slots N] [--ctx T] [--port 8000] ...

This file is the whole server, in titled sections, read top to bottom:
    limits and errors -> HTTP/1.1 (parse/serialize, no I/O) -> connection loop (asyncio)
    -> security -> admission -> API formats (parse_* -> Job; Encoder: events -> JSON/SSE; pure)
    -> metrics -> engine bridge (worker process) -> routes table -> CLI
The server process never imports jax: the engine worker (engine/worker.py) owns the device.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from engine import chat
from engine.chat import Job


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


# =================================================================================================
# HTTP/1.1: parsing and serializing, pure functions on bytes (no I/O)
# =================================================================================================

def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: optional `event:` line, one `data:` line (compact JSON, or a str as is)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


# =================================================================================================
# Connection loop (asyncio): every await and every socket of the server is here
# =================================================================================================


# =================================================================================================
# Security: keys, tenants, Origin/Host, content type
# =================================================================================================


# =================================================================================================
# Admission: per-tenant and global waiting queues
# =================================================================================================


# =================================================================================================
# API formats: parse_* (JSON body -> Job, or ApiError naming the field) and one Encoder per API
# (neutral events -> that API's SSE frames or JSON body). Pure: no await, no sockets, no token ids.
# =================================================================================================

@dataclass
class Meta:
    """What an encoder needs besides the events."""
    id: str                       # the response id (chatcmpl-..., cmpl-..., msg_..., resp_...)
    created: int                  # unix time
    model: str                    # the model name to answer with


# Encoder interface (one class per API):
#   Encoder(job: Job, meta: Meta)
#   .start() -> list[bytes]        SSE frames before any output (e.g. message_start, response.created)
#   .feed(event) -> list[bytes]    SSE frames for one neutral event; also accumulates the body
#   .keepalive() -> bytes          a frame sent while a long prompt is prefilled (comment or ping)
#   .body() -> dict                the non-streamed response, after Done was fed
#   .error(err: ApiError) -> list[bytes]   frames that end a started stream with an error
#   .done_frames() are produced by feed(Done(...)) itself (finish chunk, usage chunk, [DONE], ...)

# ---- common fields (sampling, max tokens, stop) -------------------------------------------------

# ---- OpenAI Chat Completions ---------------------------------------------------------------------

# ---- OpenAI Completions --------------------------------------------------------------------------

# ---- Anthropic Messages --------------------------------------------------------------------------

# ---- OpenAI Responses ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiFormat:
    name: str                              # "chat", "completions", "messages", "responses"
    parse: Callable[[dict], Job]
    encoder: type
    error_body: Callable[[ApiError], dict]
    anthropic: bool = False                # error statuses: 529 instead of 429/503


# =================================================================================================
# Metrics: Prometheus text
# =================================================================================================


# =================================================================================================
# Engine bridge: the worker process, its messages, supervision
# =================================================================================================


# =================================================================================================
# Routes
# =================================================================================================


# =================================================================================================
# CLI
# =================================================================================================
