"""Soak: mixed streaming traffic against `python -m mashbox run` while its worker is SIGKILLed again and
again. Run by hand (the CI suite runs a short version, tests/test_faults.py):

    python tests/soak_faults.py --minutes 20 --kill-every 120

The server runs the fake engine (MASHBOX_WORKER_ENTRY=tests.fake_worker:main) on a free loopback port.
Client threads send requests to the four generation APIs, streamed or not, each with its own text for
the fake to echo, so every answer is known in advance. Every request must end one of two ways:
  answered: 200 and exactly its text (a stream: its text once, then the route's normal end), or
  failed as documented: 500 / 503 / 529 in the route's error shape, or a stream that ends with the
  route's error event after a prefix of its text (never a repeat).
Anything else fails the soak: a hung connection (no byte for HANG_S), a reset, a wrong or doubled text.
The server's memory (RSS) and open descriptors must stay flat, and SIGTERM must end it with status 0.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
# A connection silent this long is hung: far beyond a worker restart of the fake (about a second) and
# the server's keep-alive frames (every 5 s).
HANG_S = 60.0
# The server's RSS may grow this much from the first restart to the end: a leak of one request's
# buffers or one worker's pipe per kill would pass it within minutes.
RSS_GROWTH_LIMIT_BYTES = 24 << 20
# Open descriptors may differ by this many (connections being opened or closed at the moment of reading).
FD_SLACK = 16
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega").split()
APIS = ("chat", "completions", "messages", "responses")
# A refused client (503/529 while the worker restarts) tries again after this long: sooner than the
# Retry-After the server asks for, to keep traffic dense across restarts.
RETRY_WAIT_S = 0.5
# What the fake engine does: a token every DELAY_S, so each answer takes about a second.
FAKE = {"delay_s": 0.04}


@dataclass
class Report:
    outcomes: Counter = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)
    kills: int = 0
    restarts: int = 0
    rss_start: int = 0
    rss_end: int = 0
    fds_start: int = 0
    fds_end: int = 0
    exit_code: int | None = None

    @property
    def ok(self) -> bool:
        return (not self.bad and self.outcomes["answered"] > 0 and self.exit_code == 0
                and self.rss_end - self.rss_start <= RSS_GROWTH_LIMIT_BYTES
                and abs(self.fds_end - self.fds_start) <= FD_SLACK)

    def summary(self) -> dict:
        return {"ok": self.ok, "outcomes": dict(self.outcomes), "bad": self.bad[:20], "kills": self.kills,
                "worker_restarts": self.restarts, "rss_mib": [round(self.rss_start / 2**20, 1),
                                                              round(self.rss_end / 2**20, 1)],
                "open_fds": [self.fds_start, self.fds_end], "exit_code": self.exit_code}


# ---- the server -----------------------------------------------------------------------------------

class ServerProcess:
    def __init__(self):
        env = dict(os.environ, MASHBOX_WORKER_ENTRY="tests.fake_worker:main", MASHBOX_FAKE=json.dumps(FAKE),
                   PYTHONPATH=str(ROOT))
        sys.path.insert(0, str(ROOT))       # run as a script: tests/ is the path's first entry
        from tests.harness import servable
        self._folder = tempfile.TemporaryDirectory()
        folder = servable(ROOT / "tests" / "fixtures" / "tiny" / "qwen3", Path(self._folder.name) / "qwen3")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mashbox", "run", str(folder), "--port", "0"],
            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.port: int | None = None
        self.log: list[str] = []
        threading.Thread(target=self._read_log, daemon=True).start()
        self._wait(lambda: self.port is not None, "the server to listen")
        self._wait(lambda: self.health().get("status") == "ok", "the worker to be ready")

    def _read_log(self):
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            if self.port is None and "listening on http://" in line:
                self.port = int(line.rsplit(":", 1)[1])

    def _wait(self, cond, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gave up waiting for {what}: " + "\n".join(self.log[-20:]))
            time.sleep(0.05)

    def health(self) -> dict:
        try:
            conn = http.client.HTTPConnection(HOST, self.port, timeout=10)
            conn.request("GET", "/health")
            return json.loads(conn.getresponse().read())
        except (OSError, ValueError):
            return {}

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def kill_worker(self) -> bool:
        pid = self.health().get("worker_pid")
        if not pid:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            self._folder.cleanup()


# ---- one request and its outcome ------------------------------------------------------------------

def _body(api: str, text: str, stream: bool) -> tuple[str, dict]:
    path, body = _route_body(api, text, stream)
    return path, {"model": "mashbox-fake", **body}


def _route_body(api: str, text: str, stream: bool) -> tuple[str, dict]:
    if api == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "stream": stream}
    if api == "completions":
        return "/v1/completions", {"prompt": text, "max_tokens": 200, "stream": stream}
    if api == "messages":
        return "/v1/messages", {"max_tokens": 200, "messages": [{"role": "user", "content": text}],
                                "stream": stream}
    return "/v1/responses", {"input": text, "stream": stream}


def _whole_text(api: str, doc: dict) -> str:
    if api == "chat":
        return doc["choices"][0]["message"]["content"]
    if api == "completions":
        return doc["choices"][0]["text"]
    if api == "messages":
        return "".join(b["text"] for b in doc["content"] if b["type"] == "text")
    return "".join(p["text"] for item in doc["output"] if item["type"] == "message" for p in item["content"])


def _delta_text(api: str, name: str | None, doc: dict) -> str:
    if api in ("chat", "completions"):
        choices = doc.get("choices") or [{}]
        return (choices[0].get("delta", {}).get("content") if api == "chat" else choices[0].get("text")) or ""
    if api == "messages":
        delta = doc.get("delta", {})
        return delta.get("text", "") if delta.get("type") == "text_delta" else ""
    return doc.get("delta", "") if name == "response.output_text.delta" else ""


def _error_shape_ok(api: str, status: int, doc: dict) -> bool:
    if api == "messages":
        return doc.get("type") == "error" and isinstance(doc.get("error", {}).get("message"), str)
    return isinstance(doc.get("error", {}).get("message"), str)


def _stream_end(api: str, events: list[tuple[str | None, str]]) -> str:
    """'done' for the route's normal end, 'error' for its error event (with the request id), else ''."""
    if not events:
        return ""
    names = [n for n, _ in events]
    datas = [d for _, d in events]
    if api in ("chat", "completions"):
        if datas[-1] != "[DONE]":
            return ""
        last = json.loads(datas[-2]) if len(datas) > 1 else {}
        return "error" if "error" in last and last["error"].get("request_id") else "done"
    if api == "messages":
        if names[-1] == "message_stop":
            return "done"
        return "error" if names[-1] == "error" and json.loads(datas[-1]).get("request_id") else ""
    if names[-1] == "response.completed":
        return "done"
    if names[-2:] == ["error", "response.failed"] and json.loads(datas[-2]).get("request_id"):
        return "error"
    return ""


def one_request(port: int, api: str, stream: bool, expected: str) -> tuple[str, str]:
    """(outcome, detail): outcome is "answered", "failed:<status>", "stream-error" or "bad"."""
    path, body = _body(api, f"echo: {expected}", stream)
    conn = http.client.HTTPConnection(HOST, port, timeout=HANG_S)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            doc = json.loads(resp.read())
            if resp.status in (500, 503, 529) and _error_shape_ok(api, resp.status, doc):
                if resp.status != 500 and not resp.getheader("retry-after"):
                    return "bad", f"{api} {resp.status} without Retry-After"
                return f"failed:{resp.status}", ""
            return "bad", f"{api} status {resp.status}: {doc}"
        if not stream:
            text = _whole_text(api, json.loads(resp.read()))
            return ("answered", "") if text == expected else ("bad", f"{api} text {text!r} != {expected!r}")
        events, text, name, data = [], "", None, []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif not line and data:
                events.append((name, "\n".join(data)))
                if data[0] != "[DONE]":
                    text += _delta_text(api, name, json.loads("\n".join(data)))
                name, data = None, []
        end = _stream_end(api, events)
        if end == "done" and text == expected:
            return "answered", ""
        if end == "error" and expected.startswith(text):
            return "stream-error", ""
        return "bad", f"{api} stream end={end or 'broken'} text {text!r} (expected {expected!r})"
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        return "bad", f"{api} stream={stream}: {type(e).__name__}: {e}"
    finally:
        conn.close()


# ---- the soak -------------------------------------------------------------------------------------

def run_soak(seconds: float, kill_every_s: float, clients: int = 4, seed: int = 0,
             log=lambda line: None) -> Report:
    report = Report()
    server = ServerProcess()
    stop = threading.Event()
    lock = threading.Lock()
    try:
        def client(n: int):
            rng = random.Random(seed * 1000 + n)
            i = 0
            while not stop.is_set():
                i += 1
                api, stream = rng.choice(APIS), rng.random() < 0.7
                expected = f"c{n} r{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
                outcome, detail = one_request(server.port, api, stream, expected)
                with lock:
                    report.outcomes[outcome] += 1
                    if detail:
                        report.bad.append(detail)
                if outcome in ("failed:503", "failed:529"):
                    stop.wait(RETRY_WAIT_S)

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        next_kill = t0 + kill_every_s
        while time.monotonic() - t0 < seconds:
            time.sleep(0.2)
            if time.monotonic() >= next_kill:
                next_kill += kill_every_s
                report.kills += server.kill_worker()
                if report.kills == 1:   # the baseline: after one restart, with traffic flowing
                    server._wait(lambda: server.health().get("status") == "ok", "the first restart")
                    time.sleep(1.0)
                    report.rss_start, report.fds_start = server.rss(), server.fds()
                log(f"{time.monotonic() - t0:6.0f} s  kills={report.kills} {dict(report.outcomes)} "
                    f"rss={server.rss() / 2**20:.1f} MiB fds={server.fds()}")
        stop.set()
        for t in threads:
            t.join(HANG_S + 5)
            if t.is_alive():
                report.bad.append("a client thread never returned (hung connection)")
        server._wait(lambda: server.health().get("status") == "ok", "the last restart")
        report.restarts = server.health().get("worker_restarts", -1)
        report.rss_end, report.fds_end = server.rss(), server.fds()
        if not report.rss_start:
            report.rss_start, report.fds_start = report.rss_end, report.fds_end
    finally:
        stop.set()
        report.exit_code = server.stop()
    if report.restarts != report.kills:
        report.bad.append(f"{report.kills} kills but worker_restarts is {report.restarts}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long to run (default 20)")
    parser.add_argument("--kill-every", type=float, default=120.0, help="seconds between worker kills")
    parser.add_argument("--clients", type=int, default=6, help="client threads sending requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = run_soak(args.minutes * 60, args.kill_every, args.clients, args.seed,
                      log=lambda line: print(line, flush=True))
    print(json.dumps(report.summary(), indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
