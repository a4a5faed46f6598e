"""Start-up, restart, memory and a fully cached long turn, on the demo model (run by hand, not in CI).

    python tests/bench/bench_startup.py [--keep-model] [--max-tokens 8]

Runs `python -m mashbox run` with its defaults (slots, ctx and --cache-ram as the server chooses
them for this machine) and a fresh, empty MASHBOX_CACHE, and measures:
  - cold start: empty caches to /health ok (the demo model is built from its PyPI parts, then every
    program compiles); with --keep-model the built demo folder is linked in, so only the compile
    caches are empty;
  - warm start: the same again, a second time (programs come from the persistent compile cache);
  - worker RSS (VmRSS, and its peak VmHWM) with the default settings, and the server's sizing line;
  - a fully cached long turn: the recorded Claude Code session's first request (11,396 tokens) is run
    cold, short prompts then take its slot (it is saved to the host cache), and the same request is
    sent again: time to first token with every prompt token but one from the host cache; then the
    session's next request (its prompt extends the first);
  - restart after SIGKILL: the worker is killed, and the clock runs until /health is ok again and a
    request is answered;
  - the decode step at 1k and 16k positions of context (one row, bare device calls alternated, in
    this process after the server has stopped).
Targets (2-core CPU): cold <= 90 s, warm <= 20 s, restart <= 20 s, RSS <= 3 GB, cached-turn TTFT
<= 1 s, decode step at 16k <= 1.5x the step at 1k.

Results: docs/performance.md (every run: docs/perf-log.md) (the summary: README, Performance).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sessions  # noqa: E402  (the recorded sessions and one turn over HTTP)

START_TIMEOUT_S = 1800
CLAUDE_SESSION = bench_sessions.CLIENTS / "claude-code" / "default.jsonl"
DECODE_CONTEXTS = (1024, 16384)
# Steps per context length: with 12 one run read 1.57x where two runs of 30 minutes later read 1.43x
# and 1.47x (a shared 2-core machine): the noise was about what separated the ratio from its target.
DECODE_STEPS = 30


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + " ".join(f.read().split()[:3])


def proc_status(pid: int | str = "self") -> dict:
    """VmRSS and VmHWM (peak) of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    return out


class Server:
    """`python -m mashbox run --port 0 [ARGS]` (with MASHBOX_CACHE=cache when given), its log
    collected and, with echo, shown (progress bars left out)."""

    def __init__(self, cache: Path | None = None, args: tuple[str, ...] = (), echo: bool = True):
        env = dict(os.environ, MASHBOX_CACHE=str(cache)) if cache else None
        self.echo = echo
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "mashbox", "run", "--port", "0", *args], cwd=ROOT,
                                     env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self.port: int | None = None
        self._found = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._found.wait(START_TIMEOUT_S) or self.port is None:
            self.stop()
            raise RuntimeError("the server never said where it listens:\n" + self.tail())

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            found = re.search(r"listening on http://[^:]+:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                self._found.set()
            if self.echo and "[#" not in line and "[-" not in line and "%|" not in line:
                sys.stderr.write("  server: " + line)
        self._found.set()

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.lines[-n:])

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())

    def health(self) -> dict:
        return self.get("/health")

    def wait_ok(self, not_pid: int | None = None) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n" + self.tail())
            try:
                doc = self.health()
                if doc.get("status") == "ok" and doc.get("worker_pid") != not_pid:
                    return doc
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError("the server never became ready")

    def chat(self, text: str, max_tokens: int = 4) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"chat: HTTP {resp.status}: {data[:200]!r}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def timed_start(cache: Path, label: str) -> tuple[Server, float]:
    server = Server(cache)
    doc = server.wait_ok()
    took = time.monotonic() - server.t0
    print(f"{label}: {took:.1f} s to /health ok (worker pid {doc['worker_pid']}; {uptime()})", flush=True)
    return server, took


def cached_turns(server: Server, max_tokens: int, slots: int) -> list[tuple[str, dict]]:
    requests = bench_sessions.recorded(CLAUDE_SESSION)
    first = bench_sessions.limited(requests[0], max_tokens)
    out = [("turn 1, cold", bench_sessions.run_turn(server.port, first))]
    for i in range(slots):           # unrelated prompts take every slot: turn 1 is saved to the host
        server.chat(f"Say the number {i} in words.")
    out.append(("turn 1 again, from the host cache", bench_sessions.run_turn(server.port, first)))
    for i in range(slots):
        server.chat(f"Name the colour number {i} of the rainbow.")
    if len(requests) > 1:
        nxt = bench_sessions.limited(requests[1], max_tokens)
        out.append(("turn 2, from the host cache", bench_sessions.run_turn(server.port, nxt)))
    return out


def restart_after_kill(server: Server) -> tuple[float, float]:
    """(seconds to /health ok, seconds to an answered request) after SIGKILL of the worker."""
    pid = server.health()["worker_pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    server.wait_ok(not_pid=pid)
    ok = time.monotonic() - t0
    server.chat("Say hi.")
    return ok, time.monotonic() - t0


def decode_steps(cache: Path) -> dict[int, float]:
    """Median seconds of a one-row decode step at each context length (bare model calls, alternated
    so that both see the same load; the step's cost does not depend on what the cache holds)."""
    import numpy as np

    os.environ["MASHBOX_CACHE"] = str(cache)
    from engine import registry
    from engine.model import jit_forward
    from engine.worker import Engine, WorkerArgs
    spec = registry.resolve(None)
    engine = Engine(WorkerArgs(spec.id, registry.prepare(spec), slots=1, ctx=max(DECODE_CONTEXTS) + 512,
                               compile_cache=str(cache / "jax")))
    one = np.ones((1, 1), np.int32)
    slot, length = np.zeros(1, np.int32), np.ones(1, np.int32)
    times: dict[int, list[float]] = {n: [] for n in DECODE_CONTEXTS}
    for i in range(DECODE_STEPS + 2):
        for n in DECODE_CONTEXTS:
            t = time.perf_counter()
            logits, engine.cache = jit_forward(engine.params, engine.cache, one, slot,
                                               np.array([n], np.int32), length, cfg=engine.cfg)
            logits.block_until_ready()
            if i >= 2:
                times[n].append(time.perf_counter() - t)
    return {n: float(np.median(v)) for n, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep-model", action="store_true",
                    help="link the built demo model in: the cold start then only has empty compile caches")
    ap.add_argument("--max-tokens", type=int, default=8)
    a = ap.parse_args()
    print(f"{os.cpu_count()} cores, machine shared with other work; {uptime()}")
    cache = Path(tempfile.mkdtemp(prefix="mashbox-bench-startup-"))
    try:
        if a.keep_model:
            from engine import registry
            spec = registry.resolve(None)
            (cache / "models").mkdir()
            (cache / "models" / spec.id).symlink_to(registry.prepare(spec))
        server, cold = timed_start(cache, "cold start" + (" (demo model already built)" if a.keep_model else ""))
        server.stop()
        server, warm = timed_start(cache, "warm start")
        sizing = next((line for line in server.lines if "memory:" in line), "")
        print("sizing:", sizing.split("memory:", 1)[-1].strip())
        doc = server.health()
        slots = next((int(m.group(1)) for line in server.lines
                      for m in [re.search(r"memory: (\d+) slots", line)] if m), 4)
        rss = proc_status(doc["worker_pid"])
        print(f"worker RSS after start: {rss['VmRSS'] / 1e9:.2f} GB", flush=True)
        turns = cached_turns(server, a.max_tokens, slots)
        for label, r in turns:
            print(f"{label}: prompt {r['prompt']} tokens, {r['cached']} cached, time to first token "
                  f"{r['ttft']:.2f} s", flush=True)
        doc = server.health()
        rss = proc_status(doc["worker_pid"])
        print(f"worker RSS after the turns: {rss['VmRSS'] / 1e9:.2f} GB (peak {rss['VmHWM'] / 1e9:.2f} GB); "
              f"host cache {doc.get('host_cache_bytes', 0) / 1e9:.2f} GB of "
              f"{doc.get('host_cache_cap_bytes', 0) / 1e9:.2f} GB", flush=True)
        ok, answered = restart_after_kill(server)
        print(f"restart after SIGKILL: /health ok after {ok:.1f} s, a request answered after "
              f"{answered:.1f} s; {uptime()}", flush=True)
        server.stop()
        steps = decode_steps(cache)
        short, long = (steps[n] for n in DECODE_CONTEXTS)
        print(f"decode step, one row: {short * 1000:.0f} ms at {DECODE_CONTEXTS[0]} positions, "
              f"{long * 1000:.0f} ms at {DECODE_CONTEXTS[1]} -> {long / short:.2f}x; {uptime()}")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
