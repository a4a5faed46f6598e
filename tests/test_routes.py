"""The server on a real socket: the route table, HEAD, keep-alive and pipelining, the timeouts, backpressure
and disconnects, errors in each route's shape, and the CLI.

The model side is tests/fake_worker.py behind the real engine bridge (a worker process that loads in
a fraction of a second); tests that need odd handlers add routes to the app's own table.
"""
import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest

import mashbox
from mashbox import App, ClientGone, ServeConfig, ConnLimits
from tests.fake_worker import MODEL_ID, FakeArgs

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT.parent / "shared" / "spec" / "mashbox-openapi.json"
WAIT_S = 30          # most a test waits for the fake worker or the server; a pass takes far less


class Served:
    """An App serving on 127.0.0.1:<free port> from its own event loop in a background thread."""

    def __init__(self, limits: ConnLimits | None = None, worker: FakeArgs | None = None):
        bridge = mashbox.Bridge(worker, entry="tests.fake_worker:main") if worker else None
        self.app = App(ServeConfig(host="127.0.0.1", port=0, model=MODEL_ID), bridge=bridge, limits=limits)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start(worker is not None))
        self.port = self.app.port

    async def _start(self, with_worker: bool) -> None:
        await self.app.start()
        if with_worker:
            self.app.bridge.start()

    @staticmethod
    async def _cancel_tasks() -> None:
        """Let the loop close cleanly: end the tasks still running (the bridge's watchdog, handlers)."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def call(self, coro, timeout: float = WAIT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self) -> None:
        self.call(asyncio.wait_for(self.app.wait_ready(), WAIT_S), WAIT_S + 1)

    def route(self, method: str, path: str, handler, errors=mashbox.openai_error_body) -> None:
        self.loop.call_soon_threadsafe(self.app.router.add, method, path, handler, errors)
        self.call(asyncio.sleep(0))

    def close(self) -> None:
        self.call(self.app.close())
        if self.app.bridge.worker_args is not None:
            self.app.bridge.stop()
        self.call(self._cancel_tasks())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(WAIT_S)
        sock.connect(("127.0.0.1", self.port))
        return sock

    def get(self, path: str, method: str = "GET", body: bytes | None = None,
            headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def server():
    """A ready server with a fake model."""
    served = Served(worker=FakeArgs())
    served.wait_ready()
    yield served
    served.close()


@pytest.fixture
def bare():
    """A server whose engine never starts (loading forever), with short timeouts for the timeout tests."""
    served = Served(limits=ConnLimits(header_s=0.5, body_s=0.5, keepalive_s=0.5, stall_s=0.5,
                                      max_connections=4, linger_s=0.2))
    yield served
    served.close()


def request(path: str, method: str = "GET", extra: bytes = b"", body: bytes = b"") -> bytes:
    length = b"Content-Length: %d\r\n" % len(body) if body or method == "POST" else b""
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + length + extra + b"\r\n"
            + body)


def read_response(f, head: bool = False):
    """(status, headers, body) of the next response on a raw socket's file, or None at EOF."""
    line = f.readline()
    if not line:
        return None
    status = int(line.split(b" ", 2)[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.lower()] = value.strip()
    body = b""
    if head or status in (100, 204, 304):
        pass
    elif headers.get("transfer-encoding") == "chunked":
        while (size := int(f.readline().split(b";")[0], 16)) != 0:
            body += f.read(size)
            assert f.read(2) == b"\r\n"
        assert f.readline() == b"\r\n"
    else:
        body = f.read(int(headers.get("content-length", 0)))
    return status, headers, body


# ---- health, models, the description -------------------------------------------------------------

def test_health_is_503_while_loading_then_200():
    """Guards against a load balancer sending traffic to a server whose model is not loaded yet."""
    served = Served(worker=FakeArgs(load_s=1.0))
    try:
        status, _, body = served.get("/health")
        assert status == 503 and json.loads(body)["status"] == "loading"
        status, headers, body = served.get("/v1/health", method="HEAD")
        assert (status, body) == (503, b"") and int(headers["content-length"]) > 0
        served.wait_ready()
        for path in ("/health", "/v1/health", "/"):
            status, _, body = served.get(path)
            health = json.loads(body)
            assert status == 200 and health["status"] == "ok", path
            assert health["worker_pid"] == served.app.bridge.pid and health["live_rows"] is not None
    finally:
        served.close()


def test_head_answers_every_path_with_the_health_status_and_no_body(server):
    """Guards against HEAD that differs between paths (the spec: HEAD answers the health status on
    every path), a protected route's length leaking through HEAD, or a body after HEAD that breaks
    the next response on the connection."""
    sock = server.connect()
    f = sock.makefile("rb")
    sock.sendall(request("/health", "HEAD"))
    health = read_response(f, head=True)
    assert health[0] == 200 and health[2] == b""
    for path in ("/v1/models", "/openapi.json", "/metrics", "/no/such/path", "/v1/messages",
                 "/v1/chat/completions", "/"):
        sock.sendall(request(path, "HEAD"))
        head = read_response(f, head=True)
        assert (head[0], head[2]) == (200, b""), path
        assert {k: v for k, v in head[1].items() if k != "date"} == \
               {k: v for k, v in health[1].items() if k != "date"}, path
    sock.sendall(request("/health"))        # the same connection is still in step
    assert read_response(f)[0] == 200
    sock.close()


def test_models_lists_the_one_model_and_404s_others(server):
    """Guards against a model list clients cannot parse, or a lookup that answers for any id."""
    status, _, body = server.get("/v1/models")
    listing = json.loads(body)
    assert status == 200 and listing["object"] == "list"
    [card] = listing["data"]
    assert card["id"] == MODEL_ID and card["object"] == "model" and card["created"] == 0
    assert card["max_model_len"] == FakeArgs().ctx and card["slots"] == FakeArgs().slots
    status, _, body = server.get(f"/v1/models/{MODEL_ID}")
    assert status == 200 and json.loads(body) == card
    status, _, body = server.get("/v1/models/qwen3-other")
    error = json.loads(body)["error"]
    assert status == 404 and error["code"] == "model_not_found" and error["param"] == "model"


def test_unknown_path_is_404_and_wrong_method_is_405_with_allow(server):
    """Guards against a 500 or an HTML page for a typo, and a 405 without the methods that work."""
    status, _, body = server.get("/v2/chat")
    assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, headers, body = server.get("/v1/models", method="DELETE")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    status, headers, body = server.get("/v1/chat/completions")
    assert status == 405 and headers["allow"] == "POST"
    status, headers, body = server.get("/v1/messages")
    assert status == 405 and json.loads(body)["type"] == "error"     # Anthropic's shape on its path


def test_openapi_json_validates_and_names_the_running_model(server):
    """Guards against serving an invalid description, or one whose examples name a model not served."""
    validator = pytest.importorskip("openapi_spec_validator")
    status, headers, body = server.get("/openapi.json")
    assert status == 200 and headers["content-type"] == "application/json"
    doc = json.loads(body)
    validator.validate(doc)
    example = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert example["example"]["model"] == MODEL_ID
    assert mashbox.SPEC_EXAMPLE_MODEL.encode() not in body
    assert doc["servers"][0]["url"] == f"http://127.0.0.1:{server.port}"


def test_shipped_spec_is_the_shared_spec():
    """Guards against the served openapi.json drifting from the spec it copies."""
    if not SPEC.exists():
        pytest.skip("the shared spec (../shared/spec) is not here")
    assert json.loads(mashbox.OPENAPI_FILE.read_text()) == json.loads(SPEC.read_text())


def test_metrics_route_serves_prometheus_text(server):
    """Guards against /metrics missing from the table or served with a content type scrapers refuse."""
    status, headers, body = server.get("/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    assert b"mashbox:" in body


def test_generation_routes_answer_in_their_api_error_shape_while_loading(bare):
    """Guards against a POST route missing from the table, or answering Anthropic clients in OpenAI's shape."""
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    status, headers, body = bare.get("/v1/chat/completions", "POST", chat, {"Content-Type": "application/json"})
    assert status == 503 and "retry-after" in headers and json.loads(body)["error"]["type"] == "unavailable"
    messages = json.dumps({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    status, headers, body = bare.get("/v1/messages?beta=true", "POST", messages.encode(),
                                     {"Content-Type": "application/json"})
    assert status == 529 and json.loads(body)["error"]["type"] == "overloaded_error"


# ---- one connection, many requests ---------------------------------------------------------------

def test_pipelined_requests_on_one_socket_are_answered_in_order(server):
    """Guards against lost or reordered answers when a client sends requests before reading answers."""
    sock = server.connect()
    f = sock.makefile("rb")
    sock.sendall(request("/health") + request(f"/v1/models/{MODEL_ID}") + request("/nope")
                 + request("/v1/models", "HEAD") + request("/v1/models", extra=b"Connection: close\r\n"))
    answers = [read_response(f), read_response(f), read_response(f), read_response(f, head=True),
               read_response(f)]
    assert [a[0] for a in answers] == [200, 200, 404, 200, 200]
    assert json.loads(answers[1][2])["id"] == MODEL_ID and answers[3][2] == b""
    assert answers[4][1]["connection"] == "close"
    assert f.read() == b""                  # closed after the request that asked for it
    sock.close()


def test_http10_request_is_answered_and_closed(server):
    """Guards against holding an HTTP/1.0 client's connection open (it waits for the close)."""
    sock = server.connect()
    sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
    f = sock.makefile("rb")
    status, headers, _ = read_response(f)
    assert status == 200 and headers["connection"] == "close" and f.read() == b""
    sock.close()


def test_handler_crash_is_a_500_in_the_route_shape_and_the_connection_survives(server):
    """Guards against one bad request killing its connection or the server, or a 500 in the wrong shape."""
    async def boom(req, out):
        raise RuntimeError("kaboom")
    server.route("GET", "/test/boom", boom)
    server.route("GET", "/test/boom-anthropic", boom, mashbox.anthropic_error_body)
    sock = server.connect()
    f = sock.makefile("rb")
    sock.sendall(request("/test/boom") + request("/test/boom-anthropic") + request("/health"))
    status, _, body = read_response(f)
    assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
    assert "kaboom" not in body.decode()            # internals stay in the log
    status, _, body = read_response(f)
    assert status == 500 and json.loads(body) == {
        "type": "error", "error": {"type": "api_error", "message": "internal server error"}}
    assert read_response(f)[0] == 200
    sock.close()


def test_stream_is_chunked_sse_and_the_connection_is_reused(server):
    """Guards against SSE without chunk framing, an unterminated stream, or a connection lost after it."""
    async def stream(req, out):
        await out.start_stream(headers=[("X-Request-Id", "r1")])
        await out.event(mashbox.sse({"n": 1}))
        await out.event(mashbox.sse("[DONE]"))
        await out.end_stream()
    server.route("GET", "/test/stream", stream)
    sock = server.connect()
    f = sock.makefile("rb")
    sock.sendall(request("/test/stream") + request("/health"))
    status, headers, body = read_response(f)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache" and headers["x-request-id"] == "r1"
    assert body == b'data: {"n":1}\n\ndata: [DONE]\n\n'
    assert read_response(f)[0] == 200
    sock.close()


def test_expect_continue_then_chunked_upload(server):
    """Guards against curl stalling on Expect: 100-continue, and chunked uploads reaching handlers mangled."""
    async def echo(req, out):
        await out.send(200, req.body, "application/octet-stream")
    server.route("POST", "/test/echo", echo)
    sock = server.connect()
    f = sock.makefile("rb")
    sock.sendall(b"POST /test/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
    sock.sendall(b"hello")
    assert read_response(f)[2] == b"hello"
    sock.sendall(b"POST /test/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n")
    assert read_response(f)[2] == b"abcde"
    sock.close()


def test_streamed_chat_completion_runs_through_the_table(server):
    """Guards against the generation routes missing their format, tenant or stream plumbing."""
    body = json.dumps({"model": MODEL_ID, "stream": True,
                       "messages": [{"role": "user", "content": "echo: two words"}]}).encode()
    sock = server.connect()
    f = sock.makefile("rb")
    sock.sendall(request("/v1/chat/completions", "POST", b"Content-Type: application/json\r\n", body))
    status, headers, text = read_response(f)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    frames = [frame[len("data: "):] for frame in text.decode().split("\n\n") if frame]
    assert frames[-1] == "[DONE]"
    content = "".join(c["delta"].get("content") or "" for frame in frames[:-1]
                      for c in json.loads(frame)["choices"])
    assert content == "two words"
    sock.close()


# ---- bad input and limits on the socket ----------------------------------------------------------

def test_malformed_request_gets_400_and_the_connection_closes(bare):
    """Guards against answering garbage with a 500, a hang, or by reading on in a lost framing."""
    sock = bare.connect()
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab")
    f = sock.makefile("rb")
    status, headers, body = read_response(f)
    assert status == 400 and headers["connection"] == "close"
    assert "Content-Length" in json.loads(body)["error"]["message"]
    assert f.read() == b""
    sock.close()


def test_too_large_body_gets_413_that_the_client_can_read(bare):
    """Guards against a 413 lost to a TCP reset because the server closed while the client was sending."""
    sock = bare.connect()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                 % (mashbox.MAX_BODY_BYTES + 1) + b"x" * 100_000)
    status, _, body = read_response(sock.makefile("rb"))
    assert status == 413 and str(mashbox.MAX_BODY_BYTES) in json.loads(body)["error"]["message"]
    sock.close()


def test_too_many_connections_get_503(bare):
    """Guards against unbounded connections: past the limit a client is told to retry, not left hanging."""
    held = [bare.connect() for _ in range(4)]
    for sock in held:                        # each is accepted and waits for its request
        sock.sendall(request("/health"))
        assert read_response(sock.makefile("rb"))[0] == 503   # loading
    extra = bare.connect()
    status, headers, body = read_response(extra.makefile("rb"))
    assert status == 503 and headers["retry-after"] == "1" and "connections" in json.loads(body)["error"]["message"]
    for sock in held + [extra]:
        sock.close()


# ---- timeouts, backpressure, disconnects ---------------------------------------------------------

def test_idle_keep_alive_connection_is_closed(bare):
    """Guards against idle connections held forever."""
    sock = bare.connect()
    f = sock.makefile("rb")
    sock.sendall(request("/health"))
    assert read_response(f)[0] == 503
    t0 = time.monotonic()
    assert f.read() == b""                   # closed by the server, without a response
    assert 0.3 < time.monotonic() - t0 < 5
    sock.close()


def test_silent_new_connection_is_closed_after_the_header_timeout(bare):
    """Guards against a connection that never sends a byte holding its place forever."""
    sock = bare.connect()
    t0 = time.monotonic()
    assert sock.recv(100) == b""
    assert time.monotonic() - t0 < 5
    sock.close()


def test_slow_head_gets_408(bare):
    """Guards against slowloris: a head trickled byte by byte must not hold a connection."""
    sock = bare.connect()
    f = sock.makefile("rb")
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    status, headers, _ = read_response(f)
    assert status == 408 and headers["connection"] == "close"
    sock.close()


def test_stalled_stream_reader_is_cut_off(bare):
    """Guards against a client that stops reading pinning a generation (and its slot) forever."""
    outcome = {}

    async def flood(req, out):
        await out.start_stream()
        frame = mashbox.sse("x" * 16_000)
        t_last = time.monotonic()
        try:
            while True:
                await out.event(frame)
                t_last = time.monotonic()
        except ClientGone:
            outcome["blocked_s"] = time.monotonic() - t_last
            outcome["gone"] = out.gone.is_set()
            raise
    bare.route("GET", "/test/flood", flood)
    sock = bare.connect(rcvbuf=4096)
    sock.sendall(request("/test/flood"))     # and never read
    deadline = time.monotonic() + WAIT_S
    while "gone" not in outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome.get("gone") is True
    assert 0.4 < outcome["blocked_s"] < 5    # stall_s is 0.5
    sock.close()


def test_disconnect_is_noticed_while_the_handler_runs(bare):
    """Guards against generating for a client that left: gone must be set at once, not at the next write."""
    seen = {}

    async def wait(req, out):
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(out.gone.wait(), WAIT_S)
            seen["after_s"] = time.monotonic() - t0
        finally:
            seen.setdefault("after_s", None)
        await out.json(200, {})
    bare.route("GET", "/test/wait", wait)
    sock = bare.connect()
    sock.sendall(request("/test/wait"))
    time.sleep(0.1)
    sock.close()
    deadline = time.monotonic() + WAIT_S
    while "after_s" not in seen and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seen["after_s"] is not None and seen["after_s"] < 5   # without read-ahead: never


# ---- the command line ------------------------------------------------------------------------------

def test_cli_flags_become_the_config():
    """Guards against a flag parsed into the wrong field or silently dropped."""
    config = mashbox.config_from_args([
        "run", "qwen3-0.6b", "--weights", "/w", "--host", "0.0.0.0", "--port", "0", "--slots", "8",
        "--ctx", "4096", "--cache-ram", "512", "--api-key-file", "/k", "--allowed-host", "a.example",
        "b.example", "--allowed-host", "c.example", "--log-prompts"])
    assert config == ServeConfig(model="qwen3-0.6b", weights="/w", host="0.0.0.0", port=0, slots=8, ctx=4096,
                            cache_ram_mib=512, api_key_file="/k",
                            allowed_hosts=("a.example", "b.example", "c.example"), log_prompts=True)
    assert mashbox.config_from_args(["run"]) == ServeConfig()


@pytest.mark.parametrize("argv", [["run", "--slots", "0"], ["run", "--port", "70000"],
                                  ["run", "--ctx", "many"], ["serve"], []])
def test_cli_refuses_bad_flags(argv, capsys):
    """Guards against starting with a nonsense setting instead of saying which flag is wrong."""
    with pytest.raises(SystemExit) as caught:
        mashbox.config_from_args(argv)
    assert caught.value.code == 2
    assert "mashbox" in capsys.readouterr().err


def test_serve_logs_the_bound_port_and_stops(caplog):
    """Guards against port 0 leaving the user (and tests) unable to tell where the server listens."""
    app = App(ServeConfig(port=0))
    caplog.set_level(logging.INFO, logger="mashbox")

    async def run():
        stop = asyncio.Event()
        task = asyncio.create_task(mashbox.serve(app, stop))
        while app.port is None:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", app.port)
        writer.write(request("/health", extra=b"Connection: close\r\n"))
        answer = await reader.read()
        writer.close()
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
        return answer

    answer = asyncio.run(run())
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert f"listening on http://127.0.0.1:{app.port}" in caplog.text


def test_a_model_the_engine_cannot_run_stops_start_up_with_the_reason(tmp_path, capsys):
    """Guards against a worker that dies on an unsupported model and is restarted forever while
    /health says loading."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_act": "gelu", "hidden_size": 64}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert mashbox.main(["run", str(tmp_path), "--port", "0"]) == 1
    assert "hidden_act 'gelu' is not supported" in capsys.readouterr().err


def test_the_server_process_never_imports_jax():
    """Guards against the server pulling in the device runtime (seconds of import, device memory,
    a second owner of the accelerator): only the worker process may import jax."""
    import subprocess
    import sys
    code = "import sys, mashbox; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
