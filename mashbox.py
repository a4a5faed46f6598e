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

def bad_field(name: str, why: str) -> ApiError:
    return ApiError(400, f"{name}: {why}", param=name)


def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, hi_open: bool = False) -> float:
    """A JSON number field with its range; bools are not numbers here."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_field(name, f"must be a number, got {type(value).__name__}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise bad_field(name, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise bad_field(name, f"must be {'<' if hi_open else '<='} {hi}, got {value}")
    return float(value)


def _integer(body: dict, name: str, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, f"must be an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise bad_field(name, f"must be >= {lo}, got {value}")
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_field(name, f"must be true or false, got {type(value).__name__}")
    return value


def parse_common(body: dict, job: Job, max_tokens_names: tuple[str, ...] = ("max_tokens",)) -> Job:
    """The fields every generation API shares: sampling, max tokens, stop strings, stream, n.

    max_tokens_names lists the API's names for the token limit, weakest first: a later one wins
    (Chat: max_tokens then max_completion_tokens). None of them set = up to the end of the context.
    """
    s = job.sampling
    s.temperature = _number(body, "temperature", 0.0, 0.0, 4.0)
    s.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    s.top_k = _integer(body, "top_k", 0) or 0
    s.min_p = _number(body, "min_p", 0.0, 0.0, 1.0, hi_open=True)
    s.seed = _integer(body, "seed")
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
    stop = body.get("stop")
    if stop is None:
        stop = body.get("stop_sequences")
        field_name = "stop_sequences"
    else:
        field_name = "stop"
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise bad_field(field_name, "must be a string or a list of non-empty strings")
        job.stop = list(stop)
    job.stream = _boolean(body, "stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", "must be a string")
    job.model = model
    key = body.get("prompt_cache_key")
    if isinstance(key, str):
        job.session = key
    return job


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
