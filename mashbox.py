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

import asyncio
import hmac
import json
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from engine import chat, protocol
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

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
# Everything is one tenant when no keys are configured.
DEFAULT_TENANT = "default"


def is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class KeyFileError(Exception):
    pass


class Keys:
    """API keys and the tenant each belongs to.

    Key file format, one key a line: `KEY` or `KEY TENANT`; `#` starts a comment; blank lines are
    ignored. Keys that name the same tenant share its queue; a key without a name is a tenant of its
    own. MASHBOX_API_KEY adds one key, its own tenant. A key is never logged or exported: tenants of
    unnamed keys are named after their line ("key-line-3"), not their text.
    """

    def __init__(self, pairs: list[tuple[bytes, str]]):
        self._pairs = pairs

    @property
    def enabled(self) -> bool:
        return bool(self._pairs)

    @classmethod
    def load(cls, path: str | None, env_key: str | None) -> "Keys":
        pairs: list[tuple[bytes, str]] = []
        if path:
            with open(path, encoding="utf-8") as f:
                for number, raw in enumerate(f, 1):
                    line = raw.split("#", 1)[0].strip()
                    if not line:
                        continue
                    fields = line.split()
                    if len(fields) > 2:
                        raise KeyFileError(f"{path}:{number}: expected 'KEY' or 'KEY TENANT', got {len(fields)} fields")
                    key = fields[0]
                    if not key.isprintable() or len(key) < 8:
                        raise KeyFileError(f"{path}:{number}: a key must be at least 8 printable characters")
                    pairs.append((key.encode(), fields[1] if len(fields) == 2 else f"key-line-{number}"))
        if env_key:
            pairs.append((env_key.encode(), "key-env"))
        return cls(pairs)

    def tenant_for(self, key: str | None) -> str | None:
        """The key's tenant, or None. Compares against every key in constant time per key, with no early
        exit, so the time taken says nothing about which key or how much of one matched."""
        if key is None:
            return None
        given = key.encode()
        found = None
        for known, tenant in self._pairs:
            if hmac.compare_digest(known, given) and found is None:
                found = tenant
        return found


def request_key(req) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY` or `x-api-key: KEY` (never the query)."""
    auth = req.header("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return req.header("x-api-key")


def _host_name(value: str) -> str:
    """The host part of a Host header or of an Origin's authority, lowercased, brackets kept for IPv6."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """Who may ask: keys (401), browser protection (403: other origins, DNS rebinding), content type (415).

    Node clients send `sec-fetch-mode: cors` and Claude Code `anthropic-dangerous-direct-browser-access`
    without an Origin: those are not browser requests from another origin, and pass.
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
        """Raise ApiError(401/403/415) or return the request's tenant."""
        host = req.header("host")
        if host is not None and not self._host_ok(host):
            raise ApiError(403, "this server does not answer to the host name in the Host header",
                           type="permission_error")
        origin = req.header("origin")
        if origin is not None:
            scheme, _, authority = origin.partition("://")
            if scheme not in ("http", "https") or host is None or authority.lower() != host.strip().lower():
                raise ApiError(403, "requests from web pages of another origin are refused",
                               type="permission_error")
        tenant = DEFAULT_TENANT
        if self.keys.enabled and needs_key:
            tenant = self.keys.tenant_for(request_key(req))
            if tenant is None:
                raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)",
                               type="authentication_error")
        if req.method == "POST":
            ctype = (req.header("content-type") or "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                raise ApiError(415, "the request body must be Content-Type: application/json",
                               type="invalid_request_error")
        return tenant


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
# API formats: parse_* (JSON body -> Job, or ApiError naming the field) and one Encoder per API
# (neutral events -> that API's SSE frames or JSON body). Pure: no await, no sockets, no token ids.
# =================================================================================================

@dataclass
class Meta:
    """What an encoder needs besides the events."""
    id: str                       # the response id (chatcmpl-..., cmpl-..., msg_..., resp_...)
    created: int                  # unix time
    model: str                    # the model name to answer with
    prompt_tokens: int = 0        # prompt length after the template (known before generation starts)


def new_id(prefix: str) -> str:
    """A response or tool-call id: the API's prefix and 24 random hex digits (96 bits never repeat)."""
    return prefix + secrets.token_hex(12)


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
# An SSE comment: OpenAI clients skip it, and it keeps proxies and idle timers from closing the stream.
OPENAI_KEEPALIVE = b": keep-alive\n\n"

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
    texts = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise bad_field(where, f"{kind} parts are not supported: this model reads text only")
        if kind not in text_kinds:
            raise bad_field(where, f'must be a text part {{"type": "text", "text": ...}}, got type {kind!r}')
        texts.append(_typed(part, kind, str, f"{where}.{kind}", ""))
    return "\n".join(texts)


def _chat_history_calls(calls: Any, field: str) -> list[chat.ToolCall]:
    """An assistant message's earlier tool_calls; arguments stay the JSON text the client sent."""
    out = []
    for j, call in enumerate(_as(calls, list, field, [])):
        where = f"{field}[{j}]"
        if not isinstance(call, dict):
            raise bad_field(where, "must be an object {id, type, function: {name, arguments}}")
        if call.get("type", "function") != "function":
            raise bad_field(f"{where}.type", f"must be function, got {call.get('type')!r}")
        fn = _typed(call, "function", dict, f"{where}.function")
        if fn is None:
            raise bad_field(f"{where}.function", "required: an object {name, arguments}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{where}.function.name", "must be a non-empty string")
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
        if role not in CHAT_ROLES:
            raise bad_field(f"{where}.role", f"each message must be an object whose role is one of "
                                             f"{', '.join(CHAT_ROLES)}; got {role!r}")
        msg = chat.Message(role=CHAT_ROLES[role])
        if msg.role == "assistant":
            msg.content = _content_text(m.get("content"), f"{where}.content", ("text", "refusal"))
            msg.reasoning = _typed(m, "reasoning_content", str, f"{where}.reasoning_content") or None
            msg.tool_calls = _chat_history_calls(m.get("tool_calls"), f"{where}.tool_calls")
        else:
            msg.content = _content_text(m.get("content"), f"{where}.content")
        if msg.role == "tool":
            msg.tool_call_id = _typed(m, "tool_call_id", str, f"{where}.tool_call_id")
            msg.name = _typed(m, "name", str, f"{where}.name")
        out.append(msg)
    return out


def _chat_tools(tools: Any) -> list[chat.Tool]:
    out: list[chat.Tool] = []
    for i, t in enumerate(_as(tools, list, "tools", [])):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_field(where, 'must be an object {"type": "function", "function": {...}}')
        if t.get("type", "function") != "function":
            raise bad_field(f"{where}.type", f"only function tools are supported, got {t.get('type')!r}")
        fn = _typed(t, "function", dict, f"{where}.function")
        if fn is None:
            raise bad_field(f"{where}.function", "required: an object {name, description, parameters}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{where}.function.name", "must be a non-empty string")
        if any(tool.name == name for tool in out):
            raise bad_field(f"{where}.function.name", f"{name!r} names two tools")
        tool = chat.Tool(name=name, description=_typed(fn, "description", str, f"{where}.function.description", ""))
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


def _chat_thinking(body: dict) -> tuple[bool, bool]:
    """(thinking, preserve_thinking). An explicit enable_thinking wins over reasoning_effort."""
    kwargs = _typed(body, "chat_template_kwargs", dict, "chat_template_kwargs", {})
    enable = _typed(kwargs, "enable_thinking", bool, "chat_template_kwargs.enable_thinking")
    if enable is None:
        enable = _typed(body, "enable_thinking", bool, "enable_thinking")
    effort = _typed(body, "reasoning_effort", str, "reasoning_effort")
    if enable is None:
        enable = effort is not None and effort not in NO_THINKING_EFFORTS
    preserve = _typed(kwargs, "preserve_thinking", bool, "chat_template_kwargs.preserve_thinking", False)
    return enable, preserve


def parse_chat(body: dict) -> Job:
    """A Chat Completions request -> Job (400 naming the field for anything this server cannot do)."""
    job = parse_common(body, Job(), ("max_tokens", "max_completion_tokens"))
    if body.get("logprobs"):
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
    job.thinking, job.preserve_thinking = _chat_thinking(body)
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


def _failed(done: chat.Done) -> ApiError:
    return ApiError(500, f"the request failed on the device: {done.error or 'unknown error'}",
                    type="server_error")


class ChatEncoder:
    """Neutral events -> chat.completion.chunk frames, and the chat.completion body."""

    def __init__(self, job: Job, meta: Meta):
        self.job, self.meta = job, meta
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict] = {}      # index -> {"id", "type", "function": {name, arguments}}
        self.done: chat.Done | None = None

    def _chunk(self, delta: dict | None, finish: str | None = None, **extra: Any) -> bytes:
        """One chunk; delta None makes the usage chunk, whose choices are empty."""
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return sse({**_openai_head(self.job, self.meta, "chat.completion.chunk"), "choices": choices,
                    **extra})

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def keepalive(self) -> bytes:
        return OPENAI_KEEPALIVE

    def feed(self, ev: Any) -> list[bytes]:
        if isinstance(ev, chat.TextDelta) and ev.text:
            self.content.append(ev.text)
            return [self._chunk({"content": ev.text})]
        if isinstance(ev, chat.ReasoningDelta) and ev.text:
            self.reasoning.append(ev.text)
            return [self._chunk({"reasoning_content": ev.text})]
        if isinstance(ev, chat.ToolCallStart):
            self.calls[ev.index] = {"id": ev.id, "type": "function",
                                    "function": {"name": ev.name, "arguments": ""}}
            return [self._chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                                 "function": {"name": ev.name, "arguments": ""}}]})]
        if isinstance(ev, chat.ToolCallArgs):
            return self._arguments(ev.index, ev.delta)
        if isinstance(ev, chat.ToolCallEnd):
            # The deltas normally add up to the whole text; stream whatever is missing (all of "{}"
            # for a call without arguments) so a streaming client ends with the same arguments.
            sent = self.calls[ev.index]["function"]["arguments"]
            self.calls[ev.index]["function"]["arguments"] = ev.arguments
            rest = ev.arguments[len(sent):] if ev.arguments.startswith(sent) else ""
            return [self._chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": rest}}]})] \
                if rest else []
        if isinstance(ev, chat.Done):
            return self._finish(ev)
        return []

    def _arguments(self, index: int, piece: str) -> list[bytes]:
        if not piece:
            return []
        self.calls[index]["function"]["arguments"] += piece
        return [self._chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})]

    def _finish(self, done: chat.Done) -> list[bytes]:
        self.done = done
        if done.finish_reason == "error":
            return self.error(_failed(done))
        timings = {"timings": done.timings} if done.timings else {}
        frames = [self._chunk({}, CHAT_FINISH.get(done.finish_reason, "stop"), **timings)]
        if self.job.include_usage:
            frames.append(self._chunk(None, usage=_openai_usage(done.usage, True), **timings))
        return frames + [sse("[DONE]")]

    def body(self) -> dict:
        """The chat.completion; raises the ApiError of an answer that ended in an error."""
        done = self.done or chat.Done("abort")
        if done.finish_reason == "error":
            raise _failed(done)
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
    job = parse_common(body, Job(), ("max_tokens", "max_completion_tokens"))
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
    if body.get("best_of") not in (None, 1):
        raise bad_field("best_of", f"must be 1, got {body.get('best_of')!r}")
    return job


class CompletionEncoder:
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
        return OPENAI_KEEPALIVE

    def feed(self, ev: Any) -> list[bytes]:
        if isinstance(ev, chat.TextDelta) and ev.text:
            self.text.append(ev.text)
            return [sse(self._completion(ev.text, None))]
        if isinstance(ev, chat.Done):
            self.done = ev
            if ev.finish_reason == "error":
                return self.error(_failed(ev))
            return [sse(self._completion("", COMPLETION_FINISH.get(ev.finish_reason, "stop"))),
                    sse("[DONE]")]
        return []   # a raw prompt is plain text: no reasoning or tool calls are parsed out of it

    def body(self) -> dict:
        """The text_completion; raises the ApiError of an answer that ended in an error."""
        done = self.done or chat.Done("abort")
        if done.finish_reason == "error":
            raise _failed(done)
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


def _block_str(block: dict, key: str, where: str, required: bool = True) -> str:
    value = block.get(key)
    if value is None and not required:
        return ""
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
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        if _block_type(block, at) != "text":
            raise bad_field(f"{at}.type", "must be text")
        texts.append(_block_str(block, "text", at))
    return texts


def _messages_tools(value: Any) -> tuple[list[chat.Tool], dict[str, chat.Tool]]:
    """`tools` -> (tools shown up front, deferred tools by name).

    A tool with defer_loading is left out of the up-front list: Claude Code adds such tools to `tools`
    once a tool search found them, and listing them up front would change the start of the prompt
    (and lose the prefix cache) at that moment. The model learns a deferred tool where a tool_result
    references it (see _tool_reference)."""
    if value is None:
        return [], {}
    if not isinstance(value, list):
        raise bad_field("tools", "must be a list of tools")
    shown: list[chat.Tool] = []
    deferred: dict[str, chat.Tool] = {}
    for i, spec in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(spec, dict):
            raise bad_field(at, "must be an object")
        kind = spec.get("type")
        if kind not in CLIENT_TOOL_TYPES:
            raise bad_field(f"{at}.type", f"server tool {kind!r} is not supported: only client tools "
                                          "(type custom or absent)")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{at}.name", "must be a non-empty string")
        if name in deferred or any(t.name == name for t in shown):
            raise bad_field(f"{at}.name", f"{name!r} names two tools")
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
    """A tool as one JSON line, the way Qwen chat templates list the tools in the system prompt."""
    return json.dumps({"type": "function", "function": {
        "name": tool.name, "description": tool.description, "parameters": tool.parameters}},
        ensure_ascii=False)


def _tool_reference(block: dict, where: str, deferred: dict[str, chat.Tool]) -> str:
    """A tool_reference (a tool search's answer): the tool's name, or its whole definition when it is a
    deferred tool, which the model has not seen anywhere else."""
    name = _block_str(block, "tool_name", where)
    tool = deferred.get(name)
    return _tool_definition(tool) if tool else name


def _tool_result(block: dict, where: str, call_names: dict[str, str],
                 deferred: dict[str, chat.Tool]) -> chat.Message:
    call_id = _block_str(block, "tool_use_id", where)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            kind = _block_type(part, at)
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
               deferred: dict[str, chat.Tool]) -> list[chat.Message]:
    """A user message: each tool_result becomes a tool message, the text blocks between them user
    messages, in the order they came."""
    if isinstance(content, str):
        return [chat.Message("user", content)]
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or a list of content blocks")
    out: list[chat.Message] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
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
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = _block_type(block, at)
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
            msg.tool_calls.append(chat.ToolCall(call_id, name, json.dumps(args, ensure_ascii=False)))
        else:
            raise bad_field(f"{at}.type", f"{kind!r} is not an assistant block "
                                          "(text, thinking, redacted_thinking, tool_use)")
    msg.content = "\n".join(texts)
    msg.reasoning = "\n".join(thoughts) if thoughts else None
    return msg


def _conversation(value: Any, deferred: dict[str, chat.Tool]) -> list[chat.Message]:
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


def _messages_tool_choice(value: Any, job: Job, deferred: dict[str, chat.Tool]) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_field("tool_choice", "must be an object")
    kind = value.get("type")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str):
            raise bad_field("tool_choice.name", "must be a string")
        if name in deferred:
            job.tools.append(deferred[name])     # the model must see the tool it is made to call
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


def _keeps_all_thinking(value: Any) -> bool:
    """context_management asks to keep every earlier thinking block (Claude Code: clear_thinking with
    keep "all"). Keeping it in the prompt also keeps earlier turns unchanged for the prefix cache."""
    edits = value.get("edits") if isinstance(value, dict) else None
    return isinstance(edits, list) and any(
        isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking") and e.get("keep") == "all"
        for e in edits)


def parse_messages(body: dict) -> Job:
    """A Messages (or count_tokens) request -> Job. Fields not named here (metadata, safeguards,
    service_tier, container, mcp_servers, cache_control on any block...) are accepted and ignored."""
    job = parse_common(body, Job(), ("max_tokens", "max_completion_tokens"))
    job.tools, deferred = _messages_tools(body.get("tools"))
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
        texts = [t for t in _texts(system, "system") if not t.startswith(BILLING_HEADER_PREFIX)]
        if texts:
            messages.append(chat.Message("system", "\n".join(texts)))
    job.messages = messages + _conversation(body.get("messages"), deferred)
    return job


# count_tokens takes everything Messages takes (max_tokens is optional in both): the count is the
# rendered prompt of the same Job, so the two can never disagree.
parse_count_tokens = parse_messages


def _tool_input(arguments: str) -> dict:
    """tool_use.input from the arguments' JSON text; {} when it is not a JSON object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _toolu_id(call_id: str) -> str:
    """Anthropic's tool-use ids start with toolu_; the output parser's start with call_."""
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


class MessagesEncoder:
    """Neutral events -> an Anthropic Message (body) or its stream: message_start, ping, per block
    content_block_start / content_block_delta / content_block_stop, message_delta, message_stop."""

    def __init__(self, job: Job, meta: Meta):
        self.meta = meta
        self.content: list[dict] = []        # the body's blocks so far
        self.open: int | None = None         # index of the block being streamed, if any
        self.tool_blocks: dict[int, int] = {}    # tool call index -> its block's index
        self.args_sent: dict[int, str] = {}      # block index -> arguments text streamed so far
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = self._usage(chat.Usage(prompt_tokens=meta.prompt_tokens))
        self.ended = False

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
        return self._message(self.content)

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
        if ev.finish_reason == "error":
            return frames + self.error(ApiError(500, ev.error or "generation failed", type="api_error"))
        self.ended = True
        self.stop_sequence = ev.stop_sequence
        self.stop_reason = "stop_sequence" if ev.stop_sequence else STOP_REASONS.get(ev.finish_reason, "end_turn")
        self.usage = self._usage(ev.usage)
        return frames + [
            self._event("message_delta", delta={"stop_reason": self.stop_reason,
                                                "stop_sequence": self.stop_sequence}, usage=self.usage),
            self._event("message_stop")]


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

# Names and meanings follow vLLM's (vllm:num_requests_waiting -> mashbox:num_requests_waiting), so a
# router or dashboard built for vLLM reads these after a prefix change. Bucket boundaries are vLLM's.
METRIC_PREFIX = "mashbox:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _label_value(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


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
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        if self.kind == "histogram":
            for key, (counts, total, count) in sorted(self.hist.items()):
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
        rejections = add("admission_rejections_total", "counter", "Requests refused by admission, by reason.")
        for reason in ("tenant_queue_full", "queue_full", "loading"):
            rejections.inc(0, reason=reason)
        add("time_to_first_token_seconds", "histogram", "Time to the first new token.", TTFT_BUCKETS)
        add("request_queue_time_seconds", "histogram", "Time waiting for a slot.", LATENCY_BUCKETS)
        add("e2e_request_latency_seconds", "histogram", "Time from request to its last byte.", LATENCY_BUCKETS)
        add("request_time_per_output_token_seconds", "histogram", "Time per new token after the first.",
            TPOT_BUCKETS)

    def __getitem__(self, name: str) -> Metric:
        return self.m[name]

    def request_done(self, finish: str, usage: "chat.Usage | None", queue_s: float, e2e_s: float,
                     ttft_s: float | None, decode_s: float | None) -> None:
        """Account one finished generation request (from the pipeline, once per client request)."""
        self.m["request_success_total"].inc(finished_reason=finish if finish in self.FINISH_REASONS else "stop")
        if usage is not None:
            self.m["prompt_tokens_total"].inc(usage.prompt_tokens)
            self.m["generation_tokens_total"].inc(usage.completion_tokens)
            if usage.completion_tokens > 1 and decode_s is not None:
                self.m["request_time_per_output_token_seconds"].observe(
                    decode_s / (usage.completion_tokens - 1))
        self.m["request_queue_time_seconds"].observe(queue_s)
        self.m["e2e_request_latency_seconds"].observe(e2e_s)
        if ttft_s is not None:
            self.m["time_to_first_token_seconds"].observe(ttft_s)

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
        if facts is not None:
            info = self.m["cache_config_info"]
            info.values.clear()
            info.set(1, block_size=facts.max_model_len, num_gpu_blocks=facts.slots,
                     enable_prefix_caching=str(facts.prefix_cache).lower(),
                     cache_ram_mib=facts.cache_ram_mib)
        if stats is not None:
            self.m["prefix_cache_queries_total"].set(stats.prefix_queries)
            self.m["prefix_cache_hits_total"].set(stats.prefix_hits)
        if bridge is not None:
            self.m["worker_restarts_total"].set(bridge.restarts)
            self.m["compiles_after_ready_total"].set(bridge.compiles_after_ready or 0)
        lines = []
        for metric in self.m.values():
            lines += metric.render()
        return "\n".join(lines) + "\n"


def cache_namespace(facts, tokenizer_path: str) -> str:
    """What cached prompt states are valid for: model, weights, tokenizer, chat template and cache
    policy. Two servers with the same id can share saved states; anything else must not."""
    import hashlib
    h = hashlib.sha256()
    for part in (facts.id, facts.family, facts.weights, facts.chat_format, facts.dtype,
                 f"ctx={facts.max_model_len}", f"prefix={facts.prefix_cache}"):
        h.update(part.encode() + b"\0")
    try:
        with open(tokenizer_path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    except OSError:
        h.update(b"no-tokenizer")
    return "mbx-" + h.hexdigest()[:16]


def health_document(bridge: "Bridge", admission: "Admission | None", namespace: str | None) -> dict:
    """Every field of the spec's Health, with real values where the feature exists and the spec's
    null/0 where it does not."""
    stats = bridge.stats
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
        "deployment_id": None,
        "component_set_sha": None,
        "certification": "not_certified",
        "compiles_after_ready": bridge.compiles_after_ready if ready else None,
        "routed_experts": bridge.facts.routed_experts if bridge.facts else None,
        "worker_restarts": bridge.restarts,
    }
    if bridge.pid is not None:
        doc["worker_pid"] = bridge.pid
    if not ready and bridge.loading is not None:
        phase, done, total = bridge.loading
        doc["loading"] = {"phase": phase, "done": done, "total": total}
    return doc


# =================================================================================================
# Engine bridge: the worker process, its messages, supervision
# =================================================================================================

# The worker is started with multiprocessing's "spawn" so it never inherits the server's event loop,
# sockets or threads. Its entry point is named as "module:function" and imported only in the child:
# pickling a function reference would import its module here, and the real worker imports jax.
WORKER_ENTRY = "engine.worker:main"
# A worker that dies again and again is restarted after 1, 2, 4 ... s, at most this long, so a broken
# device or model does not spin the CPU; the server itself never exits because its worker did.
RESTART_BACKOFF_MAX_S = 30.0
# A worker whose batch makes no progress for this long is treated as stuck and replaced. The longest
# legitimate silence is one prefill chunk on a slow CPU, which the worker bounds to a few seconds.
STUCK_WORKER_S = 120.0


def _worker_trampoline(entry: str, conn, args) -> None:
    """Runs in the child process: import the worker's module there, and run it."""
    import importlib
    module, _, func = entry.partition(":")
    getattr(importlib.import_module(module), func)(conn, args)


class WorkerDied(Exception):
    """The worker process went away while a request was in it."""


class Bridge:
    """The only owner of the worker process: starts it, sends it Submit/Cancel, routes its Steps to the
    request that waits for them, notices when it dies or hangs, and starts a new one.

    Threads: a reader thread blocks on the pipe and hands each message to the event loop with
    call_soon_threadsafe; a writer thread sends, so a worker busy with a long prefill never blocks the
    event loop. Everything else runs on the event loop.
    """

    def __init__(self, worker_args, entry: str = WORKER_ENTRY, log=print):
        self.worker_args = worker_args
        self.entry = entry
        self.log = log
        self.status = "loading"          # "loading" until Ready, and again while a new worker starts
        self.facts = None                # protocol.ModelFacts once ready
        self.pid: int | None = None
        self.restarts = 0
        self.loading: tuple[str, int, int] | None = None   # (phase, done, total) for progress
        self.stats = None                # last protocol.Stats
        self.compiles_after_ready_before = 0   # summed over earlier worker processes
        self._streams: dict[str, asyncio.Queue] = {}
        self._proc = None
        self._conn = None
        self._outbox: "queue.Queue" = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._failures = 0               # consecutive deaths before a Ready, for the backoff
        self._generation = 0             # which worker process a message came from
        self._last_progress = time.monotonic()
        self.on_ready: list[Callable[[], None]] = []

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the first worker; call from the running event loop."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._writer, name="bridge-writer", daemon=True).start()
        self._spawn()
        self._loop.create_task(self._watchdog())

    def _spawn(self) -> None:
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_trampoline, args=(self.entry, child, self.worker_args),
                           name="mashbox-worker", daemon=True)
        proc.start()
        child.close()
        self._generation += 1
        self._proc, self._conn, self.pid = proc, parent, proc.pid
        self._last_progress = time.monotonic()
        threading.Thread(target=self._reader, args=(parent, self._generation),
                         name="bridge-reader", daemon=True).start()

    def stop(self) -> None:
        """Ask the worker to exit, then make sure it did."""
        self._stopping = True
        proc = self._proc
        if proc is None:
            return
        try:
            self._conn.send(protocol.Shutdown())
        except (OSError, EOFError, BrokenPipeError):
            pass
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(2)

    # ---- threads -----------------------------------------------------------------------------------

    def _reader(self, conn, generation: int) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # an unpicklable message: the worker is broken
                self._call(self._on_death, generation, f"bad message from worker: {e!r}")
                return
            self._call(self._on_message, generation, msg)
        self._call(self._on_death, generation, "worker pipe closed")

    def _writer(self) -> None:
        while True:
            conn, msg = self._outbox.get()
            try:
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
            self._failures = 0
            for fn in self.on_ready:
                fn()
        elif isinstance(msg, protocol.Fault):
            self.log(f"worker fault: {msg.message}")

    def _on_death(self, generation: int, why: str) -> None:
        if generation != self._generation or self._stopping:
            return
        self._generation += 1  # ignore anything else the dead worker's threads deliver
        code = self._proc.exitcode if self._proc is not None else None
        if self._proc is not None and code is None:
            self._proc.kill()
        self.log(f"worker {self.pid} died ({why}, exit code {code}); starting a new one")
        if self.stats is not None:
            self.compiles_after_ready_before += self.stats.compiles_after_ready
        self.stats = None
        self.status = "loading"
        streams, self._streams = self._streams, {}
        for q in streams.values():
            q.put_nowait(WorkerDied(why))
        self._failures += 1
        self.restarts += 1
        delay = min(RESTART_BACKOFF_MAX_S, 2.0 ** (self._failures - 1)) if self._failures > 1 else 0.0
        if delay:
            self.log(f"worker failed {self._failures} times in a row; next start in {delay:.0f} s")
        self._loop.call_later(delay, self._respawn)

    def _respawn(self) -> None:
        if not self._stopping:
            self._spawn()

    async def _watchdog(self) -> None:
        """A worker with requests in it that sends nothing for STUCK_WORKER_S is stuck: replace it."""
        while not self._stopping:
            await asyncio.sleep(min(5.0, STUCK_WORKER_S / 4))
            if (self.status == "ok" and self._streams
                    and time.monotonic() - self._last_progress > STUCK_WORKER_S):
                gen = self._generation
                if self._proc is not None:
                    self._proc.kill()
                self._on_death(gen, f"no progress for {STUCK_WORKER_S:.0f} s")

    # ---- requests ----------------------------------------------------------------------------------

    def submit(self, submit: "protocol.Submit") -> asyncio.Queue:
        """Hand a request to the worker. Its Steps (and a WorkerDied, if the worker dies) arrive on the
        returned queue; the last Step has finish set."""
        q: asyncio.Queue = asyncio.Queue()
        if self.status != "ok":
            q.put_nowait(WorkerDied("worker not ready"))
            return q
        self._streams[submit.rid] = q
        if not self._streams or len(self._streams) == 1:
            self._last_progress = time.monotonic()  # the stuck clock starts when work arrives
        self._outbox.put((self._conn, submit))
        return q

    def cancel(self, rid: str) -> None:
        if self._streams.pop(rid, None) is not None and self.status == "ok":
            self._outbox.put((self._conn, protocol.Cancel(rid)))

    @property
    def compiles_after_ready(self) -> int | None:
        if self.stats is None:
            return None if self.status != "ok" else self.compiles_after_ready_before
        return self.compiles_after_ready_before + self.stats.compiles_after_ready


# =================================================================================================
# Generation: one request through the template, the engine, the output parser and its API's encoder
# =================================================================================================

# Anthropic and Responses clients run watchdogs on silent streams; a frame this often while a long
# prompt is prefilled (a 15k-token Claude Code prompt takes about a minute on a CPU) keeps them calm.
KEEPALIVE_S = 5.0
# The spec's retry rule: a request whose client has received no output is sent again once.
RETRIES_AFTER_FAULT = 1


def _timings(step_timings: dict | None, usage: chat.Usage) -> dict:
    """llama-server's timings block (ChatTimings) from what the worker measured."""
    t = step_timings or {}
    prompt_n = usage.prompt_tokens - usage.cached_tokens
    prompt_ms = float(t.get("prompt_ms", 0.0))
    predicted_ms = float(t.get("predicted_ms", 0.0))
    n = usage.completion_tokens
    return {
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_second": round(prompt_n / (prompt_ms / 1000), 3) if prompt_ms > 0 else None,
        "predicted_n": n,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_second": round((n - 1) / (predicted_ms / 1000), 3) if predicted_ms > 0 and n > 1 else None,
        "cache_n": usage.cached_tokens,
        "queue_ms": round(float(t.get("queue_ms", 0.0)), 3),
    }


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


async def run_generation(app, req, out, fmt: "ApiFormat", job: Job, prompt: list[int],
                         outcome: Outcome) -> None:
    """Generate for one parsed, rendered, admitted request and write its answer (JSON or SSE).

    Owns the retry rule: if the worker dies before the client has received any output, the request is
    sent again once from the start; after output was sent, the stream ends with the API's error event.
    """
    facts = app.bridge.facts
    room = facts.max_model_len - len(prompt)
    max_tokens = room if job.max_tokens is None else min(job.max_tokens, room)
    rid = new_id({"chat": "chatcmpl-", "completions": "cmpl-", "messages": "msg_",
                  "responses": "resp_"}[fmt.name])
    answer_model = (job.model or facts.id) if fmt.name in ("messages", "responses") else facts.id
    meta = Meta(id=rid, created=int(time.time()), model=answer_model, prompt_tokens=len(prompt))
    tok = app.tokenizer
    gone = out.gone
    if job.stream:
        await out.start_stream()
        enc = fmt.encoder(job, meta)
        for frame in enc.start():
            await out.event(frame)
    for attempt in range(RETRIES_AFTER_FAULT + 1):
        enc_attempt = fmt.encoder(job, meta) if not job.stream else enc
        parser = chat.OutputParser(tok, job, facts.chat_format)
        sub_id = rid if attempt == 0 else f"{rid}-retry{attempt}"
        q = app.bridge.submit(protocol.Submit(
            rid=sub_id, prompt=prompt, max_tokens=max_tokens, sampling=job.sampling,
            stop_ids=list(tok.stop_ids), submitted_at=time.time()))
        usage = chat.Usage(prompt_tokens=len(prompt))
        sent_output = False
        try:
            while True:
                step = await _next_step(q, gone, KEEPALIVE_S)
                if step is None:
                    if job.stream:
                        await out.event(enc_attempt.keepalive())
                    continue
                if isinstance(step, WorkerDied) or step.finish == "error":
                    why = str(step) if isinstance(step, WorkerDied) else (step.error or "device error")
                    raise WorkerDied(why)
                if step.prompt_tokens:
                    usage.prompt_tokens, usage.cached_tokens = step.prompt_tokens, step.cached_tokens
                if step.tokens and outcome.first_token_at is None:
                    outcome.first_token_at = time.monotonic()
                usage.completion_tokens += len(step.tokens)
                events = parser.feed(step.tokens)
                finish = step.finish
                if parser.stop_hit and finish is None:
                    app.bridge.cancel(sub_id)   # a stop string ended the text: free the slot now
                    finish = "stop"
                if finish is not None:
                    outcome.timings = _timings(step.timings, usage)
                    events += parser.finish(finish, usage, outcome.timings)
                for ev in events:
                    frames = enc_attempt.feed(ev)
                    if isinstance(ev, chat.Done):
                        outcome.finish, outcome.usage = ev.finish_reason, ev.usage
                    if job.stream and frames:
                        if not isinstance(ev, chat.Done):
                            sent_output = True
                        for frame in frames:
                            await out.event(frame)
                if finish is not None:
                    break
        except WorkerDied as died:
            app.bridge.cancel(sub_id)
            if not sent_output and attempt < RETRIES_AFTER_FAULT:
                outcome.retried = True
                app.log(f"{rid}: worker fault ({died}); retrying once from the start")
                await app.wait_ready()
                continue
            err = ApiError(500, f"the request failed on the device: {died}", type="server_error")
            outcome.status, outcome.finish = 500, "error"
            if job.stream:
                for frame in enc_attempt.error(err):
                    await out.event(frame)
                await out.end_stream()
                return
            raise err
        except BaseException:
            app.bridge.cancel(sub_id)   # client gone, stalled or server stopping: free the slot at once
            outcome.finish = outcome.finish or "abort"
            raise
        if job.stream:
            await out.end_stream()
        else:
            await out.json(200, enc_attempt.body())
        return


def json_body(req) -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(req.body)
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"body: not valid JSON ({e})")
    if not isinstance(body, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(body).__name__}")
    return body


def not_ready_error(fmt_anthropic: bool) -> ApiError:
    """503 (OpenAI) / 529 overloaded (Anthropic) while the model loads or its worker restarts."""
    headers = (("Retry-After", str(RETRY_AFTER_LOADING_S)),)
    if fmt_anthropic:
        return ApiError(529, "the model is loading; retry shortly", type="overloaded_error",
                        headers=headers + (("x-should-retry", "true"),))
    return ApiError(503, "the model is loading; retry shortly", type="unavailable", headers=headers)


def rejected_error(fmt_anthropic: bool, reason: str) -> ApiError:
    why = ("too many of your requests are waiting for a slot" if reason == "tenant_queue_full"
           else "the server's queue is full")
    headers = (("Retry-After", str(RETRY_AFTER_BUSY_S)),)
    if fmt_anthropic:
        return ApiError(529, why, type="overloaded_error", headers=headers)
    return ApiError(429, why, type="rate_limit_exceeded", headers=headers)


async def render_prompt(app, job: Job) -> list[int]:
    """The one template, off the event loop (a 50 KB agent prompt takes milliseconds to tokenize)."""
    if not app.bridge.facts or app.tokenizer is None:
        raise not_ready_error(False)
    return await asyncio.to_thread(chat.render, job, app.tokenizer, app.bridge.facts.chat_format)


def check_model(app, name: str | None) -> None:
    """404 model_not_found for a request naming ANOTHER model this installation knows (models.json).
    Foreign names (gpt-5.5, claude-*) are what agents send whatever they talk to: they are answered by
    the one model served, as the recorded clients require."""
    if name and name != app.bridge.facts.id and name in app.other_model_ids:
        raise ApiError(404, f"model: '{name}' is not served here; this server runs '{app.bridge.facts.id}'",
                       code="model_not_found", param="model")


async def handle_generation(app, req, out, fmt: "ApiFormat", tenant: str) -> None:
    """One POST to a generation route: parse, check, render, admit, generate, log, count."""
    t0 = time.monotonic()
    outcome = Outcome()
    job = None
    prompt: list[int] = []
    queue_s = 0.0
    try:
        job = fmt.parse(json_body(req))
        job.session = job.session or req.header("x-session-id")
        if app.bridge.status != "ok":
            raise not_ready_error(fmt.anthropic)
        check_model(app, job.model)
        prompt = await render_prompt(app, job)
        ctx = app.bridge.facts.max_model_len
        if len(prompt) >= ctx:
            raise ApiError(400, f"messages: the prompt is {len(prompt)} tokens, and the context holds "
                                f"{ctx} (with room for at least one new token)", param="messages")
        try:
            ticket = app.admission.enter(tenant)
        except Rejected as r:
            app.metrics["admission_rejections_total"].inc(reason=r.reason)
            raise rejected_error(fmt.anthropic, r.reason)
        if ticket is not None:
            try:
                await _wait_admitted(ticket, out.gone)
            except BaseException:
                app.admission.leave_queue(tenant, ticket)
                raise
        queue_s = time.monotonic() - t0
        outcome.admitted = True
        try:
            await run_generation(app, req, out, fmt, job, prompt, outcome)
        finally:
            app.admission.release()
    except ApiError as e:
        outcome.status, outcome.finish = e.status, outcome.finish or "error"
        raise
    except ClientGone:
        outcome.status, outcome.finish = 499, "abort"   # 499: nginx's "client closed request"
        raise
    finally:
        e2e = time.monotonic() - t0
        if outcome.admitted:   # requests refused before they ran are counted by their rejection
            ttft = outcome.first_token_at - t0 if outcome.first_token_at else None
            decode = (time.monotonic() - outcome.first_token_at) if outcome.first_token_at else None
            app.metrics.request_done(outcome.finish or "stop", outcome.usage, queue_s, e2e, ttft, decode)
        u = outcome.usage
        app.log(f"{req.method} {req.path} {outcome.status} finish={outcome.finish or '-'} "
                f"prompt={u.prompt_tokens if u else len(prompt)} cached={u.cached_tokens if u else 0} "
                f"generated={u.completion_tokens if u else 0} queue_ms={queue_s * 1000:.0f} "
                f"total_ms={e2e * 1000:.0f}" + (f" retried=1" if outcome.retried else "")
                + (f" session={job.session}" if job is not None and job.session else ""))


async def _wait_admitted(ticket: asyncio.Future, gone: asyncio.Event) -> None:
    """Wait for a slot, or raise ClientGone if the client leaves first (its place is given up)."""
    left = asyncio.ensure_future(gone.wait())
    try:
        done, _ = await asyncio.wait({ticket, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if ticket not in done:
        raise ClientGone()


async def handle_count_tokens(app, req, out, fmt: "ApiFormat") -> None:
    """Anthropic count_tokens: exactly the prompt the Messages route would prefill. Never queued."""
    if app.bridge.status != "ok":
        raise not_ready_error(True)
    job = fmt.parse(json_body(req))
    prompt = await render_prompt(app, job)
    await out.json(200, {"input_tokens": len(prompt)})


# =================================================================================================
# Routes
# =================================================================================================


# =================================================================================================
# CLI
# =================================================================================================
