"""Hostile input against a running server: malformed HTTP, oversized request lines, heads and bodies,
slowloris heads and trickled bodies, a thousand idle connections, a flood past the connection bound,
bodies that are not JSON or not an object, and a wrong type in every field the spec lists for every
API. Each is answered with its 4xx (never a 500, never a hang), and a normal request is served during
and after."""
import copy
import json
import os
import resource
import socket
import time

import pytest

import mashbox
from mashbox import ConnLimits
from tests.harness import MODEL_ID, ROUTES, error_of, read_answer, start_server, until

# Short timeouts so the timeout tests take a second or two; the code paths are the production ones.
LIMITS = dict(header_s=1.0, body_s=1.0, keepalive_s=2.0, stall_s=2.0, linger_s=0.2)
ANSWER_S = 10        # most a test waits for any one answer; a hang fails the test instead of the suite
POST_ROUTES = [r for r in ROUTES if r[0] == "POST"]


@pytest.fixture(scope="module")
def server():
    with start_server(limits=ConnLimits(**LIMITS), ctx=8192) as s:
        yield s


def served_normally(server) -> None:
    """A normal request still gets its normal answer."""
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "model": MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": "echo: still here"}]},
        timeout=ANSWER_S)
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "still here"


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closes the connection (EOF or reset) within ANSWER_S."""
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def exchange(server, data: bytes) -> tuple[int, dict, bytes, bool]:
    """Send raw bytes; (status, headers, body, whether the server then closed the connection)."""
    sock = server.connect(timeout=ANSWER_S)
    try:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass   # the server answered and closed before taking it all: the answer is still there
        status, headers, body = read_answer(sock)
        return status, headers, body, closed_by_server(sock)
    finally:
        sock.close()


# ---- malformed and oversized HTTP ----------------------------------------------------------------

GET = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
MALFORMED = {
    "garbage": (b"GARBAGE\r\n\r\n", 400),
    "binary": (b"\x00\x01\x02\x03\r\n\r\n", 400),
    "bare LF line ends": (b"GET /v1/models HTTP/1.1\nHost: 127.0.0.1\n\n", 400),
    "no Host": (b"GET /v1/models HTTP/1.1\r\n\r\n", 400),
    "two Hosts": (GET + b"Host: 127.0.0.1\r\n\r\n", 400),
    "header without colon": (GET + b"no colon here\r\n\r\n", 400),
    "folded header": (GET + b"X-A: 1\r\n  continued\r\n\r\n", 400),
    "NUL in a header": (GET + b"X-A: a\x00b\r\n\r\n", 400),
    "space in the target": (b"GET /v1/mo dels HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
    "non-ASCII target": (b"GET /\xff\xfe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
    "HTTP/3.0": (b"GET /v1/models HTTP/3.0\r\nHost: 127.0.0.1\r\n\r\n", 505),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
    "Content-Length and chunked": (POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    "two Content-Lengths": (POST + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    "negative Content-Length": (POST + b"Content-Length: -1\r\n\r\n", 400),
    "Content-Length not a number": (POST + b"Content-Length: 1e3\r\n\r\n", 400),
    "gzip transfer coding": (POST + b"Transfer-Encoding: gzip\r\n\r\n", 501),
    "bad chunk size": (POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    "chunk without CRLF": (POST + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n", 400),
    # limits: answered as soon as they are passed, without reading the rest
    "request line past 8 KiB": (b"GET /" + b"a" * (mashbox.MAX_REQUEST_LINE + 10) + b" HTTP/1.1\r\n", 414),
    "head past 64 KiB": (GET + b"X-Pad: " + b"a" * mashbox.MAX_HEAD_BYTES + b"\r\n\r\n", 431),
    "too many header lines": (GET + b"X-A: 1\r\n" * (mashbox.MAX_HEADERS + 1) + b"\r\n", 431),
    "body past 32 MiB": (POST + b"Content-Length: %d\r\n\r\n" % (mashbox.MAX_BODY_BYTES + 1), 413),
    "chunk past 32 MiB": (POST + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (mashbox.MAX_BODY_BYTES + 1), 413),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_or_oversized_http_gets_its_4xx_and_the_connection_closes(server, name):
    """Guards against a 500, a hang, or reading on in a framing that can no longer be trusted."""
    data, expected = MALFORMED[name]
    t0 = time.monotonic()
    status, headers, body, closed = exchange(server, data)
    assert status == expected, (name, body)
    assert headers.get("connection") == "close" and closed
    error_of(status, body, "openai")
    assert time.monotonic() - t0 < LIMITS["header_s"] + 2   # refused at once, not by a timeout
    served_normally(server)


def test_a_tls_handshake_on_the_plain_port_is_refused_at_once(server):
    """Guards against an https:// client (bytes with no line end) waiting for the header timeout (10 s
    by default) to learn this server speaks plain HTTP."""
    t0 = time.monotonic()
    hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(0x80, 0xc0))   # no line end
    status, _, body, closed = exchange(server, hello)
    assert status == 400 and closed and "TLS" in error_of(status, body, "openai")["message"]
    assert time.monotonic() - t0 < LIMITS["header_s"] / 2
    served_normally(server)


# ---- slow clients ----------------------------------------------------------------------------------

def test_slowloris_heads_are_cut_off_while_others_are_served(server):
    """Guards against a few sockets trickling header bytes holding connections (and memory) for ever."""
    socks = [server.connect(timeout=ANSWER_S) for _ in range(20)]
    head = GET + b"X-Trickle: " + b"a" * 100
    t0 = time.monotonic()
    for i in range(len(head)):
        for sock in socks:
            try:
                sock.send(head[i:i + 1])
            except OSError:
                pass
        if i == 3:
            served_normally(server)
        time.sleep(0.05)
        if time.monotonic() - t0 > LIMITS["header_s"] + 3:
            break
    for sock in socks:
        status, _, _ = read_answer(sock)
        assert status == 408 and closed_by_server(sock)
        sock.close()
    assert time.monotonic() - t0 < LIMITS["header_s"] + 5
    served_normally(server)


def test_a_trickled_body_is_cut_off_but_a_steady_slow_upload_is_not(server):
    """Guards against a body sent a byte at a time holding a connection, without refusing slow links."""
    sock = server.connect(timeout=ANSWER_S)
    sock.sendall(POST + b"Content-Length: 1000\r\n\r\n{")
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < LIMITS["body_s"] + 3:
            sock.send(b" ")
            time.sleep(0.3)          # inside body_s: only the rate bound can end this
    except OSError:
        pass
    status, _, _ = read_answer(sock)
    assert status == 408 and time.monotonic() - t0 < LIMITS["body_s"] + 3
    sock.close()
    # 4 KiB in 4 pieces over 1.5 s: longer than body_s, but at more than the minimum rate
    body = json.dumps({"model": MODEL_ID, "max_tokens": 8, "messages": [
        {"role": "user", "content": "echo: ok" + " " * 4000}]}).encode()
    sock = server.connect(timeout=ANSWER_S)
    sock.sendall(POST + b"Content-Length: %d\r\n\r\n" % len(body))
    for i in range(4):
        time.sleep(0.5)
        sock.sendall(body[i * len(body) // 4:(i + 1) * len(body) // 4])
    status, _, answer = read_answer(sock)
    assert status == 200, answer
    sock.close()


# ---- many connections --------------------------------------------------------------------------------

# How long the thousand idle connections are held: time to open them all on a loaded machine.
IDLE_S = 6.0


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def many_files():
    """Room for a thousand connections at both ends (client and server live in this process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2500 or not os.path.isdir("/proc/self/fd"):
        pytest.skip("cannot open 2,500 files here")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_thousand_idle_connections_are_held_then_closed_and_others_are_served(many_files):
    """Guards against idle connections held for ever (file descriptors leaking), or starving real clients."""
    with start_server(limits=ConnLimits(**{**LIMITS, "header_s": IDLE_S})) as server:
        before = open_files()
        socks = [server.connect(timeout=ANSWER_S) for _ in range(1000)]
        until(lambda: server.on_loop(lambda: len(server.app._connections)) >= 1000, "1,000 connections")
        served_normally(server)
        t0 = time.monotonic()
        assert all(closed_by_server(sock) for sock in socks)     # silent connections: closed, no answer
        assert time.monotonic() - t0 < IDLE_S + 5
        for sock in socks:
            sock.close()
        until(lambda: server.on_loop(lambda: len(server.app._connections)) == 0, "every connection closed")
        until(lambda: open_files() <= before + 5, "the file descriptors to be released")
        served_normally(server)


def test_connections_past_the_bound_are_refused_at_once_with_503(many_files):
    """Guards against a connection flood exhausting file descriptors instead of being refused early.
    The held connections have begun a request (a connection idle for a second would give way to a
    new one instead: tests/test_hostile_work.py)."""
    bound = 50
    with start_server(limits=ConnLimits(**{**LIMITS, "header_s": 3.0, "max_connections": bound})) as server:
        held = [server.connect(timeout=ANSWER_S) for _ in range(bound)]
        for sock in held:
            sock.sendall(b"GET /health HTTP/1.1\r\n")          # a head begun, never finished
        until(lambda: server.on_loop(lambda: len(server.app._connections)) == bound, "the bound to fill")
        t0 = time.monotonic()
        for _ in range(150):
            sock = server.connect(timeout=ANSWER_S)
            status, headers, body = read_answer(sock)
            assert status == 503 and headers["retry-after"] == str(mashbox.RETRY_AFTER_CONNECTIONS_S)
            assert closed_by_server(sock)
            sock.close()
        assert time.monotonic() - t0 < 10     # refused at once, not after a timeout
        assert server.on_loop(lambda: len(server.app._connections)) == bound
        for sock in held:
            assert closed_by_server(sock)     # the unfinished heads leave at the header timeout
            sock.close()
        until(lambda: server.on_loop(lambda: len(server.app._connections)) == 0, "the idle ones to go")
        served_normally(server)


def test_the_connection_bound_fits_under_the_open_files_limit(monkeypatch):
    """Guards against a bound the process cannot reach: accept() failing with EMFILE stalls everyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert mashbox.connection_bound(1024) == 1024        # the soft limit is raised when it can be
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1024 + mashbox.FD_RESERVE
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    asked = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (300, 300))     # a hard limit of 300
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: asked.append(limits))
    assert mashbox.connection_bound(1024) == 300 - mashbox.FD_RESERVE   # else the bound shrinks to fit
    assert asked == [(300, 300)]


# ---- bodies that are not JSON objects ------------------------------------------------------------------

NOT_AN_OBJECT = {
    "empty": b"",
    "truncated": b'{"model": "m", "messages": [',
    "not JSON": b"model=m&messages=hi",
    "not UTF-8": b'{"model": "\xff\xfe"}',
    "a list": b"[1, 2]",
    "a string": b'"hello"',
    "null": b"null",
    "a number": b"42",
    "nested 100,000 deep": b"[" * 100_000,
    "objects nested 100,000 deep": b'{"a":' * 100_000,
    "a 5,000-digit number": b'{"max_tokens": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("method, path, body, api", POST_ROUTES, ids=[r[1] for r in POST_ROUTES])
def test_bodies_that_are_not_json_objects_get_400_naming_the_body(server, method, path, body, api):
    """Guards against a 500 (or a crashed parser) on a body that is not a JSON object, on any route."""
    for name, data in NOT_AN_OBJECT.items():
        status, _, answer = server.request("POST", path, data, {"Content-Type": "application/json"},
                                           timeout=ANSWER_S)
        assert status == 400, (name, answer[:200])
        err = error_of(400, answer, api)
        assert name == "a 5,000-digit number" or "body" in err["message"], (name, err)
    served_normally(server)


# ---- a wrong type in every field -----------------------------------------------------------------------

SPEC = json.loads(mashbox.OPENAPI_FILE.read_text(encoding="utf-8"))
SCHEMAS = SPEC["components"]["schemas"]
# One value of each JSON type; a field gets every one its schema does not allow (null is left out:
# clients send null for "not set", and the server reads it so).
VALUES = (("string", "wrong"), ("integer", 7), ("boolean", True), ("array", ["wrong"]), ("object", {"wrong": 1}))

# Valid requests that carry every nested part the spec describes (tool calls, tool results, tools,
# thinking...), so that a wrong type can be put in each.
CHAT = {"model": MODEL_ID, "max_tokens": 4, "messages": [
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "echo: hi"},
    {"role": "assistant", "content": None, "reasoning_content": "r",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "ok"},
    {"role": "user", "content": "echo: hi"}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                "parameters": {"type": "object", "properties": {}}}}]}
MESSAGES = {"model": MODEL_ID, "max_tokens": 4, "system": "be brief", "messages": [
    {"role": "user", "content": "echo: hi"}, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    {"role": "user", "content": "echo: hi"}],
    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {}}}],
    "thinking": {"type": "enabled", "budget_tokens": 1024}}
RESPONSES = {"model": MODEL_ID, "max_output_tokens": 4, "instructions": "be brief",
             "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "echo: hi"}]}],
             "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
             "reasoning": {"effort": "low"}}
COMPLETION = {"model": MODEL_ID, "prompt": "echo: hi", "max_tokens": 4}
COUNT = {k: MESSAGES[k] for k in ("model", "system", "messages", "tools", "thinking")}
REQUESTS = {"/v1/chat/completions": ("ChatCompletionRequest", CHAT, "openai"),
            "/v1/completions": ("CompletionRequest", COMPLETION, "openai"),
            "/v1/messages": ("MessagesRequest", MESSAGES, "anthropic"),
            "/v1/messages/count_tokens": ("CountTokensRequest", COUNT, "anthropic"),
            "/v1/responses": ("ResponsesRequest", RESPONSES, "openai")}

# The one field whose wrong type is accepted on purpose: clients (Pi among them) replay tool-call
# arguments as an object instead of JSON text, and the template renders both the same. Strict: if the
# parser ever refuses it, this list must lose it.
ACCEPTED_TODAY = {
    ("/v1/chat/completions", "messages[2].tool_calls[0].function.arguments"),
}


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = SCHEMAS[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _wrong_values(schema: dict) -> list:
    kinds = schema.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds or ())
    if not kinds:
        return []   # any type is allowed
    return [v for kind, v in VALUES if kind not in kinds and not (kind == "integer" and "number" in kinds)]


def _fields(schema: dict, base, path: tuple = ()):
    """(path, the field's schema) for every property the spec lists, here and in the nested objects and
    list items the base request has."""
    for name, sub in _resolve(schema).get("properties", {}).items():
        sub = _resolve(sub)
        yield path + (name,), sub
        here = base.get(name) if isinstance(base, dict) else None
        if "properties" in sub:
            yield from _fields(sub, here if isinstance(here, dict) else {}, path + (name,))
        items = _resolve(sub.get("items", {}))
        if "properties" in items and isinstance(here, list) and here:
            for prop, prop_schema in items["properties"].items():
                # the first item that has the field (a tool_call_id is a tool message's), else the first
                i = next((i for i, item in enumerate(here) if isinstance(item, dict) and prop in item), 0)
                yield from _fields({"properties": {prop: prop_schema}}, here[i], path + (name, i))


def _name(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _with(base: dict, path: tuple, value) -> dict:
    body = copy.deepcopy(base)
    node = body
    for p in path[:-1]:
        if isinstance(node, dict) and p not in node:
            node[p] = {}
        node = node[p]
    node[path[-1]] = value
    return body


def _cases():
    for path, (schema_name, base, api) in REQUESTS.items():
        for field_path, schema in _fields(SCHEMAS[schema_name], base):
            values = _wrong_values(schema)
            if values:
                name = _name(field_path)
                marks = [pytest.mark.xfail(strict=True, reason="the parser accepts this wrong type")] \
                    if (path, name) in ACCEPTED_TODAY else []
                yield pytest.param(path, field_path, values, api, id=f"{path} {name}", marks=marks)


def test_the_wrong_type_cases_cover_every_field_of_every_api():
    """Guards against the case generator silently covering less than the spec (a renamed schema)."""
    fields = {(p.values[0], _name(p.values[1])) for p in _cases()}
    assert len(fields) > 100
    for path, (schema_name, _, _) in REQUESTS.items():
        for top in SCHEMAS[schema_name]["properties"]:
            assert (path, top) in fields, (path, top)
    assert ("/v1/chat/completions", "messages[2].tool_calls[0].function.name") in fields
    assert ACCEPTED_TODAY <= fields


@pytest.mark.parametrize("path, field_path, values, api", list(_cases()))
def test_a_wrong_type_in_any_field_is_a_400_naming_the_field(server, path, field_path, values, api):
    """Guards against a wrong type reaching the model, crashing a parser (500), or a 400 that does not
    say which field is wrong."""
    base = REQUESTS[path][1]
    leaf = [p for p in field_path if isinstance(p, str)][-1]
    for value in values:
        status, _, answer = server.request("POST", path, _with(base, field_path, value), timeout=ANSWER_S)
        assert status == 400, (value, answer[:300])
        err = error_of(400, answer, api)
        assert leaf in err["message"] or leaf == err.get("param"), (value, err)


def test_the_base_requests_are_valid_and_the_server_still_serves(server):
    """Guards against wrong-type cases that pass only because the request around them was already bad."""
    for path, (_, base, _) in REQUESTS.items():
        status, _, answer = server.request("POST", path, base, timeout=ANSWER_S)
        assert status == 200, (path, answer[:300])
    served_normally(server)
