"""Soak: every hostile request of tests/test_hostile_work.py, replayed for minutes against one
`python -m mashbox run` with keys, while normal clients are served beside it. Run by hand:

    python tests/soak_hostile.py --minutes 3

The server runs the fake engine with the real sampler (MASHBOX_FAKE={"sampler": true}: every token is
drawn by engine.sampler with the request's own sampling), so a sampling value that reached the worker
and could not be batched would show up as a worker death. Attackers (tenant "mallory") send, in turn:
keyless 32 MiB bodies, 200,000 stop strings, the most and longest stop strings allowed, a 20 MB prompt,
a 480k-character prompt (the tokenizer process), sampling values past int32 / NaN / Infinity, lone
surrogates in a streamed Messages request, a slow reader, a flood past the connection bound, a full
tenant queue, Host tricks and a bare CR in a chunk extension; then round two: 20,000 and 2,048 tools
and an injected tool name, deep, dense, UTF-16 and escaped-pair bodies, one-byte chunks and a long
transfer coding, keyless /health heads declaring 32 MiB, a flood of idle keep-alive connections,
Responses streams echoing 2.5 MB of tools to clients that read nothing, a count_tokens flood, and
model output nested 985 deep or with lone surrogates. Normal clients (tenant "bob") send short
requests to the four generation APIs and must get exactly their text back; a 429/503/529 with
Retry-After is retried and counted, anything else is a lost request.

Round three's grammar attacks need the real worker's grammars, so a second `mashbox run` serves the
tiny model with a byte-level tokenizer (its forced calls come back valid only when they ran under
their grammar): mallory sends six requests at once whose tool sets take the library seconds each to
compile, and forced calls in a conversation holding earlier calls (the worker drafts from them); bob
sends forced calls there too, each with a tool set the worker has not seen, and a call that is not
valid for its schema is a lost request.

It passes when: 0 worker restarts (same worker pids), 0 lost requests, every attack answered as it
should be, the server's memory (RSS) back within 20% of its start after the attacks end, and the
grammar server's worker (with its trial compiles) idle within its budget once the attacks end.
/health latency (p50, p99, max) of both servers is reported.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
ALICE, BOB, MALLORY = "sk-soak-alice-0001", "sk-soak-bob-000002", "sk-soak-mallory-03"
MAX_CONNECTIONS = 160
FAKE = {"delay_s": 0.005, "sampler": True, "ctx": 4096}
# RSS after the attacks may differ from RSS before them by this fraction.
RSS_SLACK = 0.20
ANSWER_S = 60.0
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def request(port: int, method: str, path: str, body=None, key: str | None = None,
            headers: dict | None = None, timeout: float = ANSWER_S) -> tuple[int, dict, bytes]:
    headers = dict(headers or {})
    if key:
        headers["x-api-key"] = key
    data = body
    if isinstance(body, (dict, list)):
        data = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def raw(port: int, data: bytes, timeout: float = ANSWER_S) -> int:
    """Send bytes, return the first response's status (0 when none came)."""
    sock = socket.create_connection((HOST, port), timeout=timeout)
    try:
        try:
            sock.sendall(data)
        except OSError:
            pass
        line = sock.makefile("rb").readline()
        return int(line.split(b" ", 2)[1]) if line else 0
    finally:
        sock.close()


def chat(text: str, **extra) -> dict:
    return {"max_tokens": 64, "messages": [{"role": "user", "content": text}], **extra}


# ---- the attacks: each returns None when the server answered as it should, else what went wrong ----

def keyless_bodies(port):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: 33554432\r\n\r\n")
    got = [raw(port, head) for _ in range(5)]
    return None if got == [401] * 5 else f"keyless bodies: {got}"


def huge_stop_list(port):
    status, _, _ = request(port, "POST", "/v1/chat/completions", chat("echo: hi", stop=["x"] * 200_000), MALLORY)
    return None if status == 400 else f"200,000 stop strings: {status}"


def longest_stops(port):
    stops = [("ab" * 1000)[:997] + f"Z{i:02d}" for i in range(31)] + ["ab the END"]
    status, _, body = request(port, "POST", "/v1/chat/completions",
                              chat("echo: " + "ab" * 600 + " the END.", stop=stops, max_tokens=2000), MALLORY)
    ok = status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "ab" * 599
    return None if ok else f"longest stops: {status} {body[:100]!r}"


def huge_prompt(port):
    status, _, _ = request(port, "POST", "/v1/messages", chat("word " * 4_000_000), MALLORY)
    return None if status == 400 else f"20 MB prompt: {status}"


def long_prompt(port):
    text = "lorem ipsum dolor sit amet " * 18_000
    status, _, body = request(port, "POST", "/v1/messages/count_tokens",
                              {"messages": [{"role": "user", "content": text}]}, MALLORY)
    if status != 200 or json.loads(body)["input_tokens"] < 4096:
        return f"480k-character count_tokens: {status} {body[:100]!r}"
    status, _, _ = request(port, "POST", "/v1/chat/completions", chat(text), MALLORY)
    return None if status == 400 else f"480k-character prompt: {status}"


def bad_sampling(port):
    for name, value in (("top_k", 2**31), ("temperature", float("nan")), ("repetition_penalty", float("inf")),
                        ("seed", 2**64), ("min_p", float("nan"))):
        status, _, _ = request(port, "POST", "/v1/chat/completions", json.dumps(chat("echo: hi", **{name: value})).encode(),
                               MALLORY, {"Content-Type": "application/json"})
        if status != 400:
            return f"{name}={value}: {status}"
    return None


def surrogates(port):
    body = json.dumps({"model": "m", "max_tokens": 8, "stream": True,
                       "messages": [{"role": "user", "content": "a\ud800b"}]}).encode()
    status, headers, _ = request(port, "POST", "/v1/messages", body, MALLORY, {"Content-Type": "application/json"})
    return None if status == 400 else f"lone surrogate: {status}"


def slow_reader(port):
    body = json.dumps(chat("echo: " + "slowly " * 2000, max_tokens=3000, stream=True)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(ANSWER_S)
    sock.connect((HOST, port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"x-api-key: %s\r\nContent-Length: %d\r\n\r\n%s" % (MALLORY.encode(), len(body), body))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            if not sock.recv(1024):
                break
            time.sleep(0.05)
    finally:
        sock.close()
    return None


def connection_flood(port):
    socks, statuses = [], Counter()
    try:
        for _ in range(MAX_CONNECTIONS + 20):
            s = socket.create_connection((HOST, port), timeout=ANSWER_S)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            socks.append(s)
        for s in socks:
            line = s.makefile("rb").readline()
            statuses[int(line.split(b" ", 2)[1]) if line else 0] += 1
    except OSError as e:
        return f"connection flood: {e!r}"
    finally:
        for s in socks:
            s.close()
    return None if set(statuses) <= {200, 503} else f"connection flood: {dict(statuses)}"


def at_once(n: int, send) -> Counter:
    """send() from n threads at once: the statuses it returned (an OSError's repr instead), counted."""
    statuses = Counter()

    def one():
        try:
            statuses[send()] += 1
        except OSError as e:
            statuses[repr(e)] += 1
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ANSWER_S * 2)
    return statuses


def full_tenant_queue(port):
    statuses = at_once(48, lambda: request(port, "POST", "/v1/chat/completions",
                                           chat("echo: " + "wait " * 30, max_tokens=40), MALLORY)[0])
    # 429: the tenant's queue is full; 503: the connection bound, when a flood runs at the same time.
    return None if set(statuses) <= {200, 429, 503} else f"full tenant queue: {dict(statuses)}"


def small_tricks(port):
    got = [raw(port, b"GET http://evil.example/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"),
           raw(port, b"GET /health HTTP/1.1\r\nHost: localhost:evil.example\r\n\r\n"),
           raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"x-api-key: " + MALLORY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n2;a\rb\r\n{}\r\n0\r\n\r\n"),
           raw(port, b"GET /v1/nothing HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")]
    return None if got == [403, 403, 400, 401] else f"small tricks: {got}"


def tool_lists(port):
    many = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(20_000)]
    most = many[:2048]
    got = [request(port, "POST", "/v1/messages/count_tokens", {"tools": tools, "messages": [
        {"role": "user", "content": "hi"}]}, MALLORY)[0] for tools in (many, most)]
    injected = {"name": 'get", "arguments": {}}', "input_schema": {"type": "object"}}
    got.append(request(port, "POST", "/v1/messages", {**chat("echo: hi"), "tools": [injected],
                       "tool_choice": {"type": "tool", "name": injected["name"]}}, MALLORY)[0])
    ok = got[0] in (400, 503) and got[1] in (200, 503) and got[2] in (400, 503)    # 503: a flood beside it
    return None if ok else f"tool lists (20,000, 2,048, an injected name): {got}"


def costly_json(port):
    bodies = ['{"a": ' + "[" * 5000 + "]" * 5000 + "}", '{"a": [' + "[]," * 3_000_000 + "[]]}",
              '{"model": "x"}'.encode("utf-16").decode("latin-1"),
              json.dumps(chat("\U0001F600" * 100_000))]          # escaped pairs, 1.2 MB
    got = []
    for i, b in enumerate(bodies):
        try:
            got.append(request(port, "POST", "/v1/chat/completions", b.encode("latin-1") if i < 3 else b.encode(),
                               MALLORY, {"Content-Type": "application/json"})[0])
        except (BrokenPipeError, ConnectionResetError):
            got.append(503)     # refused at the connection bound while the 9 MB body was still going out
    # 503: the connection bound, when a flood runs at the same time; 429: the escaped pairs' body is a
    # request like any other, and the tenant's queue may be full of its other attacks' requests.
    return None if set(got) <= {400, 429, 503} else f"deep, dense, UTF-16 and escaped-pair bodies: {got}"


def byte_chunks(port):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"x-api-key: " + MALLORY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    got = [raw(port, head + b"1\r\n \r\n" * 5000),
           raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: "
                     + b"x" * 5000 + b", chunked\r\n\r\n")]
    return None if got[0] in (400, 503) and got[1] in (501, 503) else f"one-byte chunks, a long transfer coding: {got}"


def keyless_reads(port):
    got = [raw(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 33554432\r\n\r\n")
           for _ in range(8)]
    status, _, body = request(port, "GET", "/health")
    shown = status == 200 and "worker_pid" in json.loads(body)
    return None if set(got) <= {413, 503} and not shown else f"keyless reads: {got}, worker pid shown: {shown}"


def idle_flood(port):
    """Keyless keep-alive /health connections, all left idle: new ones (keyed or not) take their places."""
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.create_connection((HOST, port), timeout=ANSWER_S)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            socks.append(s)
        time.sleep(1.5)
        status = request(port, "POST", "/v1/chat/completions", chat("echo: hi"), MALLORY)[0]
    finally:
        for s in socks:
            s.close()
    # 503 only while the other attacker's flood holds every place with requests, not idle ones.
    return None if status in (200, 429, 503) else f"idle flood: a keyed request got {status}"


def unread_streams(port):
    """Responses streams echoing ~2.5 MB of tools to clients that read nothing: they must not hold slots."""
    tools = [{"type": "function", "name": f"t{i}", "description": "d" * 1000, "parameters": {"type": "object"}}
             for i in range(2048)]
    body = json.dumps({"max_output_tokens": 4, "stream": True, "tools": tools, "input": "echo: hi"}).encode()
    socks = []
    try:
        for _ in range(4):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((HOST, port))
            sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"x-api-key: %s\r\nContent-Length: %d\r\n\r\n%s" % (MALLORY.encode(), len(body), body))
            socks.append(sock)
        time.sleep(3)
    finally:
        for sock in socks:
            sock.close()
    return None


def count_flood(port):
    text = "lorem ipsum dolor sit amet " * 2_000          # 54k characters: about 50 ms each, one at a time
    statuses = at_once(48, lambda: request(port, "POST", "/v1/messages/count_tokens",
                                           {"messages": [{"role": "user", "content": text}]}, MALLORY)[0])
    # 529 past the tenant's 32 in flight; 503: the connection bound, when a flood runs at the same time.
    return None if set(statuses) <= {200, 529, 503} else f"count_tokens flood: {dict(statuses)}"


def hostile_output(port):
    """The model writes a call nested 985 deep and one with lone surrogates: 200s, never a 500."""
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    got = []
    for text in ('<tool_call>\n{"name": "f", "arguments": {"a": ' + "[" * 985 + "]" * 985 + '}}\n</tool_call>',
                 '<tool_call>\n{"name": "f\\ud800", "arguments": {"a": "\\udc00"}}\n</tool_call>'):
        for stream in (False, True):
            got.append(request(port, "POST", "/v1/messages", {**chat("echo: " + text), "tools": tools,
                                                              "stream": stream}, MALLORY)[0])
    return None if got == [200] * 4 else f"hostile model output: {got}"


def costly_tool_sets(port):
    """Six requests at once, each with tool sets the grammar's library takes seconds to compile."""
    from tests.test_tool_grammar import costly_tools

    def send():
        tools = [{"type": "function", "function": {"name": n, "parameters": schema}}
                 for n, schema in costly_tools(2, f"{time.time_ns()}")]
        return request(port, "POST", "/v1/chat/completions", chat("hi", max_tokens=8, tools=tools), MALLORY)[0]
    statuses = at_once(6, send)
    # 429: mallory's queue is full (the other attacker sends these too).
    return None if set(statuses) <= {200, 429} else f"costly tool sets: {dict(statuses)}"


NUMBER = {"type": "integer", "minimum": 0, "maximum": 10**9}       # a call short enough to finish
COUNT = {"name": "count", "parameters": {"type": "object", "additionalProperties": False,
                                         "properties": {"n": NUMBER, "m": NUMBER}}}


def forced_call(port, key: str, tool: dict, messages: list[dict], **sampling) -> str | None:
    """A forced call of `tool`: None when it came back as one call valid for its schema, else why not."""
    import jsonschema
    status, headers, answer = request(port, "POST", "/v1/chat/completions", {
        "max_tokens": 120, "messages": messages, "tools": [{"type": "function", "function": tool}],
        "tool_choice": {"type": "function", "function": {"name": tool["name"]}}, **sampling}, key)
    if status != 200:
        refused = status in (429, 503, 529) and "retry-after" in headers
        return "retry" if refused else f"{status} {answer[:120]!r}"
    calls = json.loads(answer)["choices"][0]["message"].get("tool_calls") or []
    try:
        assert len(calls) == 1 and calls[0]["function"]["name"] == tool["name"]
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), tool["parameters"])
    except (AssertionError, ValueError, jsonschema.ValidationError):
        choice = json.loads(answer)["choices"][0]
        return f"not a valid call ({choice['finish_reason']}): {json.dumps(choice['message'])[:200]}"
    return None


def drafted_calls(port):
    """Forced calls in a conversation whose earlier turns hold calls: the worker drafts from them."""
    messages = [{"role": "user", "content": "Count."}]
    for i in range(3):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "count", "arguments": '{"n": 123456789}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"}]
    messages.append({"role": "user", "content": "Again."})
    # Alice's: mallory's own costly compiles come before mallory's other requests (by design).
    why = [forced_call(port, ALICE, COUNT, messages, temperature=1.0, seed=time.time_ns() % 2**31)
           for _ in range(4)]
    wrong = [w for w in why if w not in (None, "retry")]
    return None if not wrong else f"drafted calls: {wrong[:2]}"


# Run against the grammar server (the real worker), in turn with ATTACKS.
GRAMMAR_ATTACKS = (costly_tool_sets, drafted_calls)
# The grammar server's worker, its trial compiles included, once the attacks are over: CPU seconds in
# IDLE_WINDOW_S at most (a compile under way ends within its budget first).
IDLE_WINDOW_S = 5.0
IDLE_CPU_S = 1.0


ATTACKS = (keyless_bodies, huge_stop_list, longest_stops, huge_prompt, long_prompt, bad_sampling, surrogates,
           slow_reader, connection_flood, full_tenant_queue, small_tricks, tool_lists, costly_json, byte_chunks,
           keyless_reads, idle_flood, unread_streams, count_flood, hostile_output)


# ---- normal clients ----------------------------------------------------------------------------------

def normal_once(port: int, rng: random.Random, counts: Counter, bad: list) -> None:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
    api = rng.choice(("chat", "completions", "messages", "responses"))
    path, body = {
        "chat": ("/v1/chat/completions", chat("echo: " + text)),
        "completions": ("/v1/completions", {"max_tokens": 64, "prompt": "echo: " + text}),
        "messages": ("/v1/messages", chat("echo: " + text)),
        "responses": ("/v1/responses", {"max_output_tokens": 64, "input": "echo: " + text}),
    }[api]
    sampling = rng.choice(({}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": rng.randint(0, 2**40)},
                           {"temperature": 1.5, "min_p": 0.1, "frequency_penalty": 1.0, "repetition_penalty": 1.1}))
    body = {**body, **sampling}
    for _ in range(20):
        try:
            status, headers, answer = request(port, "POST", path, body, BOB)
        except OSError as e:
            bad.append(f"{api}: {e!r}")
            return
        if status in (429, 503, 529) and "retry-after" in headers:
            counts["refused, retried"] += 1
            time.sleep(0.2)
            continue
        if status != 200:
            bad.append(f"{api}: {status} {answer[:200]!r}")
            return
        doc = json.loads(answer)
        got = {"chat": lambda: doc["choices"][0]["message"]["content"],
               "completions": lambda: doc["choices"][0]["text"],
               "messages": lambda: doc["content"][0]["text"],
               "responses": lambda: doc["output"][0]["content"][0]["text"]}[api]()
        if got != text:
            bad.append(f"{api}: {got!r} != {text!r}")
            return
        counts["answered"] += 1
        return
    bad.append(f"{api}: refused 20 times")


def grammar_once(port: int, counts: Counter, bad: list) -> None:
    """Bob's forced call on the grammar server, with a tool set it has not seen: a valid call, or lost."""
    tool = {"name": f"pick_{time.time_ns()}", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["unit", "n"],
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "n": {"type": "boolean"}}}}
    for _ in range(20):
        try:
            why = forced_call(port, BOB, tool, [{"role": "user", "content": "Pick one."}])
        except OSError as e:
            why = repr(e)
        if why == "retry":
            counts["grammar refused, retried"] += 1
            time.sleep(0.2)
            continue
        if why:
            bad.append(f"forced call: {why}")
        else:
            counts["grammar calls"] += 1
        return
    bad.append("forced call: refused 20 times")


def latency(ms: list[float]) -> dict:
    """p50, p99 and max of sorted latencies."""
    return {"n": len(ms), "p50": round(ms[len(ms) // 2], 1), "p99": round(ms[int(len(ms) * 0.99)], 1),
            "max": round(ms[-1], 1)}


class EngineServer:
    """`python -m mashbox run` with the real worker: the tiny model, a byte-level tokenizer, int8 (it
    drafts), the same keys."""

    def __init__(self, keys: str):
        from tests.test_tool_grammar import byte_level_folder
        folder = byte_level_folder(Path(tempfile.mkdtemp()))
        env = {k: v for k, v in os.environ.items() if k not in ("MASHBOX_WORKER_ENTRY", "MASHBOX_FAKE")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mashbox", "run", folder, "--port", "0", "--api-key-file", keys,
             "--slots", "4", "--ctx", "8192", "--weights-dtype", "int8"],
            cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE, text=True)
        self.port: int | None = None
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            if self.port is None and "listening on http://" in line:
                self.port = int(line.rsplit(":", 1)[1])

    def wait_ready(self, seconds: float = 600) -> dict:
        deadline = time.monotonic() + seconds
        while self.port is None or json.loads(request(self.port, "GET", "/health")[2]).get("status") != "ok":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the grammar server did not start:\n" + "\n".join(self.log[-20:]))
            time.sleep(0.2)
        return json.loads(request(self.port, "GET", "/health", key=ALICE)[2])

    def worker_cpu_s(self, pid: int) -> float:
        """CPU seconds of the worker and of its children alive now (the trial compiles)."""
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(entry) == pid or int(fields[1]) == pid:
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---- the run -------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--attackers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=3)
    args = ap.parse_args(argv)

    keys = tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False)
    keys.write(f"{ALICE} alice\n{BOB} bob\n{MALLORY} mallory\n")
    keys.close()
    env = dict(os.environ, MASHBOX_WORKER_ENTRY="tests.fake_worker:main", MASHBOX_FAKE=json.dumps(FAKE),
               PYTHONPATH=str(ROOT))
    sys.path.insert(0, str(ROOT))
    from tests.harness import servable
    folder = servable(ROOT / "tests" / "fixtures" / "tiny" / "qwen3", Path(tempfile.mkdtemp()) / "qwen3")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mashbox", "run", str(folder),
         "--port", "0", "--api-key-file", keys.name, "--max-connections", str(MAX_CONNECTIONS),
         "--slots", "4", "--ctx", "4096"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    port: list[int] = []
    log: list[str] = []

    def read_log():
        for line in proc.stderr:
            log.append(line.rstrip())
            if not port and "listening on http://" in line:
                port.append(int(line.rsplit(":", 1)[1]))
    threading.Thread(target=read_log, daemon=True).start()
    report: dict = {}
    engine: EngineServer | None = None
    try:
        deadline = time.monotonic() + 120
        while not port or json.loads(request(port[0], "GET", "/health")[2]).get("status") != "ok":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + "\n".join(log[-20:]))
            time.sleep(0.2) if port else time.sleep(0.05)
        p = port[0]
        health0 = json.loads(request(p, "GET", "/health", key=ALICE)[2])
        engine = EngineServer(keys.name)
        grammar0 = engine.wait_ready()
        gp = engine.port
        attacks = [(a, p) for a in ATTACKS] + [(a, gp) for a in GRAMMAR_ATTACKS]

        counts, bad, failed_attacks, attack_counts = Counter(), [], [], Counter()
        health_ms: list[float] = []
        stop_all, stop_attacks = threading.Event(), threading.Event()

        grammar_health_ms: list[float] = []

        def probe():
            while not stop_all.is_set():
                for server, times in ((p, health_ms), (gp, grammar_health_ms)):
                    t0 = time.monotonic()
                    try:
                        request(server, "GET", "/health", timeout=10)
                    except OSError:
                        pass
                    times.append((time.monotonic() - t0) * 1000)
                time.sleep(0.05)

        def grammar_client():
            while not stop_all.is_set():
                grammar_once(gp, counts, bad)

        def client(n):
            rng = random.Random(n)
            while not stop_all.is_set():
                normal_once(p, rng, counts, bad)

        def attacker(n):
            i = n
            while not stop_attacks.is_set():
                attack, at = attacks[i % len(attacks)]
                i += 1
                try:
                    why = attack(at)
                except Exception as e:   # noqa: BLE001 - a failed attack is reported, not raised
                    why = f"{attack.__name__}: {e!r}"
                attack_counts[attack.__name__] += 1
                if why:
                    failed_attacks.append(why)

        workers = [threading.Thread(target=probe, daemon=True)]
        workers += [threading.Thread(target=client, args=(n,), daemon=True) for n in range(args.clients)]
        workers.append(threading.Thread(target=grammar_client, daemon=True))
        for w in workers:
            w.start()
        time.sleep(10)                         # warm: every program compiled, every pool started
        rss_start = rss(proc.pid)
        attackers = [threading.Thread(target=attacker, args=(n,), daemon=True) for n in range(args.attackers)]
        for a in attackers:
            a.start()
        time.sleep(args.minutes * 60)
        stop_attacks.set()
        for a in attackers:
            a.join(ANSWER_S * 3)
        rss_peak_seen = rss(proc.pid)
        time.sleep(15)                         # attacks over: lingering connections close
        rss_end = rss(proc.pid)
        stop_all.set()                         # the grammar server's worker is left with nothing to do
        for w in workers:
            w.join(ANSWER_S)
        cpu0 = engine.worker_cpu_s(grammar0["worker_pid"])
        time.sleep(IDLE_WINDOW_S)
        idle_cpu = engine.worker_cpu_s(grammar0["worker_pid"]) - cpu0
        health1 = json.loads(request(p, "GET", "/health", key=ALICE)[2])
        grammar1 = json.loads(request(gp, "GET", "/health", key=ALICE)[2])
        ms = sorted(health_ms)
        report = {
            "minutes": args.minutes, "attacks": dict(attack_counts), "failed_attacks": failed_attacks[:20],
            "normal": dict(counts), "lost": bad[:20], "lost_count": len(bad),
            "worker_restarts": health1["worker_restarts"] + grammar1["worker_restarts"],
            "same_worker": health1["worker_pid"] == health0["worker_pid"]
            and grammar1["worker_pid"] == grammar0["worker_pid"],
            "grammar_worker_idle_cpu_s": round(idle_cpu, 2),
            "rss_mib": {"start": round(rss_start / 2**20, 1), "end_of_attacks": round(rss_peak_seen / 2**20, 1),
                        "after": round(rss_end / 2**20, 1)},
            "health_ms": latency(ms), "grammar_server_health_ms": latency(sorted(grammar_health_ms)),
        }
        report["ok"] = (not failed_attacks and not bad and counts["answered"] > 0
                        and counts["grammar calls"] > 0
                        and report["worker_restarts"] == 0 and report["same_worker"] and idle_cpu < IDLE_CPU_S
                        and abs(rss_end - rss_start) <= RSS_SLACK * rss_start)
    finally:
        if engine is not None:
            engine.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(keys.name)
    print(json.dumps(report, indent=1))
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
