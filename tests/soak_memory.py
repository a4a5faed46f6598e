"""Soak: the worker's memory under mixed traffic, against the demo server. Run by hand (not in CI):

    python tests/soak_memory.py --minutes 12 [--port 8931] [--int8-host] [-- SERVER ARGS ...]
    python tests/soak_memory.py --url http://127.0.0.1:8931 --minutes 12     # a server already running

Starts `python -m mashbox run --port PORT SERVER ARGS` (the demo model, its defaults unless given)
unless --url names a running one, then for --minutes sends rounds of (Traffic.rounds):
  agents    the three recorded agent sessions (Claude Code: Messages, Codex: Responses, Pi: Chat;
            ../shared/fixtures/clients), each turn adding an answer and a ~1k-token file excerpt,
            back to the recorded start past AGENT_MAX_CHARS: growing conversations that come back
  sweeps    one-off Chat prompts of 2k-8k tokens (this repository's source), never repeated
  replays   every recorded generation request of every client, resent as it was (cache hits); one
            asking for structured output (Codex's thread title) must get the spec's 400
  batches   4 short Chat requests with a tool at once (the 4-row decode batch), two of them forced
            calls (tool_choice required and named: the call grammar)
  cancels   an 18,859-token stream closed mid-prefill, and a stream closed mid-decode
Answers are cut to a few tokens: prefill, the cache copies and the decode batches are what is driven.
At the end every open connection is closed (the server cancels them) and the worker is let go idle.

The worker's VmRSS is sampled every SAMPLE_S from /proc; its VmHWM (peak) is reset at the start of the
traffic (/proc/PID/clear_refs) so the peak reported is the traffic's, not the start-up's. Each rise
of the peak by PEAK_STEP_BYTES is logged with what was in flight, so a peak can be traced to a cause.

--int8-host: on a CPU without int8 dot products (no VNNI) hold the weights and the KV cache in int8,
as the defaults do on one with them (the host the README's memory numbers were measured on): the
worker runs with engine.cpu's flags plus avx_vnni (int8_host_worker). Slower products, the same bytes.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "bench"))
import bench_sessions  # noqa: E402  (a recorded turn grown in its API's shape)
from bench_startup import proc_status  # noqa: E402

# Every rise of the worker's peak by this much is logged with the requests in flight.
PEAK_STEP_BYTES = 32 << 20
SAMPLE_S = 0.2
HEALTH_EVERY_S = 2.0
ARENA_BYTES = 64 << 20                   # glibc's heap size for a thread's arena on 64-bit
# The finding's target: the worker's peak with the defaults, whatever the traffic.
PEAK_LIMIT_BYTES = 3 * 10**9
# Characters per token of this repository's source in the demo's tokenizer (measured: 3.8).
CHARS_PER_TOKEN = 3.8
# An agent's conversation starts again from its recorded first turn past this many characters
# (about 24k tokens: below the demo's 32768-token slots with room for the answer).
AGENT_MAX_CHARS = 90_000
EXCERPT_CHARS = 4000                     # what a turn adds: about 1k tokens of a source file
SWEEP_TOKENS = (2000, 4000, 6000, 8000)
CANCEL_PREFILL_TOKENS = 18_859           # the finding's cancelled request
CANCEL_AFTER_S = 8.0                     # into its prefill (at ~140 tokens/s: about 1.1k tokens)
CANCEL_DECODE_EVENTS = 6                 # stream events read before a decode is cut
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 1800
AGENTS = ("claude-code", "codex", "pi")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# The batch's four requests: two free to answer in text, two forced calls (the call grammar's state).
TOOL_CHOICES = ("auto", "required", "auto", {"type": "function", "function": {"name": "get_weather"}})


def int8_host_worker(conn, args) -> None:
    """The worker entry --int8-host names (MASHBOX_WORKER_ENTRY): engine.cpu sees avx_vnni too."""
    from engine import cpu
    flags = frozenset(cpu.flags() | {"avx_vnni"})
    cpu.flags = lambda: flags
    from engine import worker
    worker.main(conn, args)


# ---- the worker's memory -------------------------------------------------------------------------

def anonymous_by_kind(pid: int) -> dict[str, int]:
    """The process's anonymous resident bytes by where they are: glibc's main heap ([heap]), its
    other arenas (anonymous mappings at 64 MiB-aligned addresses, each at most 64 MiB: the arenas
    that threads get), and the rest (mmap'd blocks: large arrays, XLA buffers)."""
    out = {"heap": 0, "thread_arenas": 0, "other_anonymous": 0}
    kind = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                name = head[5] if len(head) > 5 else ""
                kind = "heap" if name == "[heap]" else None if name else \
                    "thread_arenas" if lo % ARENA_BYTES == 0 and hi - lo <= ARENA_BYTES else "other_anonymous"
            elif head[0] == "Rss:" and kind:
                out[kind] += int(head[1]) * 1024
    return out


def reset_peak(pid: int) -> bool:
    """Set VmHWM back to VmRSS (Linux clear_refs "5"); False where it is not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """Samples the worker's memory, and the host cache's bytes (/health) every HEALTH_EVERY_S: the
    resident bytes beside the cache (rss - cache) are what the runtime itself grew to."""

    def __init__(self, pid: int, port: int, in_flight: dict, started: float):
        super().__init__(daemon=True)
        self.pid, self.port, self.in_flight, self.started = pid, port, in_flight, started
        self.max_rss = self.cache = self.max_beside = 0
        self.hwm = proc_status(pid)["VmHWM"]
        self.rises: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        logged, asked = self.hwm, 0.0
        while not self.stop.wait(SAMPLE_S):
            try:
                s = proc_status(self.pid)
                if time.monotonic() - asked >= HEALTH_EVERY_S:
                    self.cache, asked = health(self.port)["cache_bytes"], time.monotonic()
            except (OSError, ValueError, KeyError):
                continue
            self.max_rss, self.hwm = max(self.max_rss, s["VmRSS"]), s["VmHWM"]
            self.max_beside = max(self.max_beside, s["VmRSS"] - self.cache)
            if s["VmHWM"] - logged >= PEAK_STEP_BYTES:
                logged = s["VmHWM"]
                line = (f"{time.monotonic() - self.started:7.1f}s peak {gb(logged)} GB, "
                        f"rss {gb(s['VmRSS'])}, host cache {gb(self.cache)}; in flight: "
                        f"{', '.join(sorted(self.in_flight.values())) or '-'}")
                self.rises.append(line)
                print("  " + line, flush=True)


def gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


# ---- traffic ---------------------------------------------------------------------------------------

def corpus() -> str:
    files = sorted(ROOT.glob("engine/*.py")) + [ROOT / "mashbox.py", ROOT / "README.md"]
    return "\n\n".join(p.read_text() for p in files)


def recorded_requests(clients: Path) -> dict[str, list[dict]]:
    """Every recorded generation request, by client/session (tests/bench/bench_sessions.recorded)."""
    from tests.bench.bench_sessions import recorded
    found = {f"{p.parent.name}/{p.stem}": reqs for p in sorted(clients.glob("*/*.jsonl"))
             if (reqs := recorded(p))}
    missing = [f"{name}/default" for name in AGENTS if f"{name}/default" not in found]
    if missing:
        raise SystemExit(f"no recorded sessions {missing} under {clients} (--clients)")
    return found


def asks_structured_output(body: dict) -> bool:
    """Whether a request asks for structured output, which the spec answers with 400 on every API
    (Chat's response_format, Responses' text.format, Messages' output_config.format)."""
    formats = [(body.get("response_format") or {}).get("type"),
               ((body.get("text") or {}).get("format") or {}).get("type")]
    return any(f not in (None, "text") for f in formats) or "format" in (body.get("output_config") or {})


def grown(request: dict, k: int, excerpt: str) -> dict:
    """The next turn of an agent's session: an answer and a user turn with a file excerpt appended,
    in the request's own API shape."""
    answer = f"Step {k}: I read the file and changed the function; {k * 3} tests pass."
    ask = f"Now look at this part of the code and tell me what to change next:\n```\n{excerpt}\n```"
    return bench_sessions.with_turn(request, answer, ask)


class Traffic:
    def __init__(self, port: int, deadline: float, seed: int, recorded: dict[str, list[dict]]):
        self.port, self.deadline = port, deadline
        self.text = corpus()
        self.recorded = recorded
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.in_flight: dict[int, str] = {}          # connection id -> what it is
        self.conns: dict[int, http.client.HTTPConnection] = {}
        self.counts: dict[str, list[int]] = {}       # kind -> [requests, prompt tokens, cached, errors]
        self.closing = False

    def running(self) -> bool:
        return time.monotonic() < self.deadline and not self.closing

    def excerpt(self, chars: int) -> str:
        with self.lock:
            at = self.rng.randrange(len(self.text) - chars)
        return self.text[at:at + chars]

    def send(self, kind: str, path: str, body: dict, headers=(), cut_after: float | None = None,
             cut_events: int | None = None, expect: int = 200) -> None:
        """One request, streamed when the body says so; cut_after seconds from the first byte of the
        answer's head, or after cut_events stream events, the connection is closed (a cancel). Any
        status but `expect` counts as an error; an expected refusal is read and counted as done."""
        from tests.bench.bench_sessions import DROP_HEADERS, usage_of
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        key = id(conn)
        with self.lock:
            if self.closing:
                return
            self.in_flight[key], self.conns[key] = kind, conn
        usage, error = None, 0
        try:
            hdrs = {k: v for k, v in headers if k.lower() not in DROP_HEADERS}
            hdrs["content-type"] = "application/json"
            conn.request("POST", path, json.dumps(body).encode(), hdrs)
            resp = conn.getresponse()
            if resp.status != 200 or expect != 200:
                error = int(resp.status != expect)
                resp.read()
                return
            if not body.get("stream"):
                usage = usage_of(json.loads(resp.read()))
                return
            events = 0
            if cut_after is not None:
                threading.Timer(cut_after, conn.close).start()
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                events += 1
                if cut_events is not None and events >= cut_events:
                    break
                usage = usage_of(json.loads(line[5:])) or usage
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            error = 0 if (cut_after is not None or self.closing) else 1
        finally:
            conn.close()
            with self.lock:
                self.in_flight.pop(key, None)
                self.conns.pop(key, None)
                c = self.counts.setdefault(kind, [0, 0, 0, 0])
                c[0] += 1
                if usage:
                    c[1] += usage[0]
                    c[2] += usage[1]
                c[3] += error

    def request(self, kind: str, recorded: dict, stream: bool = True) -> None:
        from tests.bench.bench_sessions import limited
        r = limited(recorded, MAX_TOKENS)
        r["body"]["stream"] = stream
        query = r.get("query") or ""
        if isinstance(query, dict):
            query = "&".join(f"{k}={v}" for k, v in query.items())
        self.send(kind, r["path"] + ("?" + query.lstrip("?") if query else ""), r["body"], r["headers"],
                  expect=400 if asks_structured_output(r["body"]) else 200)

    # -- the rounds --------------------------------------------------------------------------------

    def together(self, calls) -> None:
        """Run (function, args, kwargs) calls at once, each in its own thread; wait for all."""
        threads = [threading.Thread(target=f, args=args, kwargs=kw, daemon=True) for f, args, kw in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def rounds(self) -> None:
        """Round after round until the deadline, each a few groups run one after another (a prefill
        runs one request at a time, so more at once would only queue): the agents' next turns beside
        a sweep (4 slots busy), 4 tool requests at once (every slot retaken: what the others held is
        saved to the host cache, and the agents' next turns load it back), a replay, the cancels."""
        agents = {name: (self.recorded[f"{name}/default"][-1], 0) for name in AGENTS}
        every = [(name, r) for name, reqs in self.recorded.items() for r in reqs]
        while self.running():
            calls = [(self.request, (f"agent {name} turn {k}", turn), {})
                     for name, (turn, k) in agents.items()]
            tokens = self.rng.choice(SWEEP_TOKENS)
            text = f"Request {self.rng.random()}: review this code.\n" + \
                self.excerpt(int(tokens * CHARS_PER_TOKEN))
            calls.append((self.send, (f"sweep {tokens}", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS}), {}))
            self.together(calls)
            for name, (turn, k) in agents.items():
                turn = grown(turn, k + 1, self.excerpt(EXCERPT_CHARS))
                agents[name] = (turn, k + 1) if len(json.dumps(turn["body"])) <= AGENT_MAX_CHARS else \
                    (self.recorded[f"{name}/default"][-1], 0)
            if not self.running():
                break
            self.together([(self.send, (f"batch {choice if isinstance(choice, str) else 'named'}",
                                        "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"What is the weather in {city}? Then a haiku."}],
                "tools": TOOLS, "tool_choice": choice, "max_tokens": 48}), {})
                for city, choice in zip(("Paris", "Lima", "Oslo", "Hanoi"), TOOL_CHOICES)])
            name, r = self.rng.choice(every)
            self.together([(self.request, (f"replay {name}", r), {"stream": self.rng.random() < 0.5})])
            if not self.running():
                break
            text = f"Cancel me {self.rng.random()}.\n" + \
                self.excerpt(int(CANCEL_PREFILL_TOKENS * CHARS_PER_TOKEN))
            self.together([
                (self.send, ("cancel mid-prefill", "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": text}], "max_tokens": 64, "stream": True}),
                 {"cut_after": CANCEL_AFTER_S + self.rng.random() * CANCEL_AFTER_S}),
                (self.send, ("cancel mid-decode", "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": f"Count to 300, {self.rng.random()}."}],
                    "max_tokens": 400, "stream": True}), {"cut_events": CANCEL_DECODE_EVENTS})])

    def close_all(self) -> None:
        with self.lock:
            self.closing = True
            conns = list(self.conns.values())
        for conn in conns:
            try:
                conn.sock and conn.sock.shutdown(2)
            except OSError:
                pass
            conn.close()


# ---- the server ------------------------------------------------------------------------------------

def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.loads(r.read())


def wait_ok(port: int, server: subprocess.Popen | None) -> dict:
    from tests.bench.bench_sessions import wait_ready
    try:
        return wait_ready(port, server)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def wait_idle(port: int, timeout: float = 300) -> dict:
    end = time.monotonic() + timeout
    while True:
        doc = health(port)
        if (not doc.get("live_rows") and not doc.get("waiting")) or time.monotonic() > end:
            return doc
        time.sleep(1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=12)
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--url", help="a running server (its /health names the worker's pid)")
    p.add_argument("--int8-host", action="store_true", help="int8 weights and cache on a CPU without VNNI")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--clients", type=Path, default=None,
                   help="the recorded sessions (default: tests/bench/bench_sessions.CLIENTS)")
    p.add_argument("--limit-gb", type=float, default=PEAK_LIMIT_BYTES / 1e9,
                   help="the peak that passes (default: the demo's target with its defaults)")
    p.add_argument("--json", help="write the report here too")
    p.add_argument("server_args", nargs="*", help="after --: flags for `mashbox run`")
    a = p.parse_args()
    from tests.bench.bench_sessions import CLIENTS
    recorded = recorded_requests(a.clients or CLIENTS)
    server, port = None, a.port
    if a.url:
        port = int(a.url.rsplit(":", 1)[1].strip("/"))
    else:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if a.int8_host:
            env["MASHBOX_WORKER_ENTRY"] = "tests.soak_memory:int8_host_worker"
        server = subprocess.Popen([sys.executable, "-m", "mashbox", "run", "--port", str(port),
                                   *a.server_args], cwd=ROOT, env=env)
    try:
        doc = wait_ok(port, server)
        pid = doc["worker_pid"]
        ready = proc_status(pid)
        print(f"worker {pid}: rss {gb(ready['VmRSS'])} GB after ready, "
              f"start-up peak {gb(ready['VmHWM'])} GB; "
              f"host cache cap {doc['host_cache_cap_bytes'] >> 20} MiB", flush=True)
        peak_reset = reset_peak(pid)
        t0 = time.monotonic()
        traffic = Traffic(port, t0 + a.minutes * 60, a.seed, recorded)
        sampler = Sampler(pid, port, traffic.in_flight, t0)
        sampler.start()
        driver = threading.Thread(target=traffic.rounds, daemon=True)
        driver.start()
        driver.join(timeout=max(0.0, traffic.deadline - time.monotonic()))
        traffic.close_all()
        driver.join(timeout=30)
        end = wait_idle(port)
        time.sleep(2)
        sampler.stop.set()
        after = proc_status(pid)
        where = anonymous_by_kind(pid)
        peak = after["VmHWM"] if peak_reset else max(sampler.max_rss, after["VmRSS"])
        report = {
            "minutes": a.minutes, "worker_pid": pid, "pid_same": end.get("worker_pid") == pid,
            "rss_ready": ready["VmRSS"], "startup_peak": ready["VmHWM"], "traffic_peak": peak,
            "peak_from": "VmHWM" if peak_reset else "sampled VmRSS", "rss_after": after["VmRSS"],
            "host_cache_bytes": end["cache_bytes"], "host_cache_cap_bytes": end["host_cache_cap_bytes"],
            "host_cache_evictions": end["host_cache_evictions"],
            "compiles_after_ready": end["compiles_after_ready"], "worker_restarts": end["worker_restarts"],
            "requests": {k: dict(zip(("n", "prompt_tokens", "cached_tokens", "errors"), v))
                         for k, v in sorted(traffic.counts.items())},
            "peak_rises": sampler.rises,
        }
        kinds: dict[str, list[int]] = {}
        for k, v in traffic.counts.items():
            kind = k.split(" turn ")[0]
            kinds[kind] = [x + y for x, y in zip(kinds.get(kind, [0, 0, 0, 0]), v)]
        print("\n  kind                            requests  prompt tok  cached tok  errors")
        for k, v in sorted(kinds.items()):
            print(f"  {k:32s} {v[0]:8d} {v[1]:11d} {v[2]:11d} {v[3]:7d}")
        print(f"\nworker rss: ready {gb(ready['VmRSS'])} GB (start-up peak {gb(ready['VmHWM'])}); "
              f"traffic peak {gb(peak)} GB ({report['peak_from']}); after {gb(after['VmRSS'])} GB")
        print(f"most resident beside the host cache: {gb(sampler.max_beside)} GB "
              f"(ready: {gb(ready['VmRSS'])})")
        print("anonymous after: " + ", ".join(f"{k} {gb(v)} GB" for k, v in where.items()))
        print(f"host cache {gb(end['cache_bytes'])} of {gb(end['host_cache_cap_bytes'])} GB, "
              f"{end['host_cache_evictions']} evictions; compiles after ready {end['compiles_after_ready']}; "
              f"worker restarts {end['worker_restarts']}")
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=1))
        ok = peak <= a.limit_gb * 1e9 and report["pid_same"]
        print(("PASS" if ok else "FAIL") + f": peak {gb(peak)} GB against {a.limit_gb:.2f} GB"
              + ("" if report["pid_same"] else " (the worker was restarted)"))
        return 0 if ok else 1
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    sys.exit(main())
