"""The spec's model with random weights on this CPU: start, memory, the spec's example requests, and
decode speed against the memory's bandwidth (run by hand, not in CI).

    python tests/bench/bench_random.py [--model qwen3-8-27b] [--layers N] [--ctx 32768] [--steps 64]

Runs `python -m mashbox run MODEL --weights random --slots 1 --ctx CTX` with a fresh, empty
MASHBOX_CACHE (--weights-dtype auto: the form the memory allows; --layers N serves the same shape cut
to N layers, for development: its random folder is made here and served as a folder) and measures:
  - the host's memory bandwidth: a 2 GiB array OR-ed as 64-bit words on every core at once (what decode
    does: stream the weights once per step), the best of BANDWIDTH_RUNS before the server starts and
    again after the decode runs (other work on a shared host lowers both);
  - ready: empty caches to /health ok (the random folder made, the weights drawn and packed, every
    program compiled), and the worker's peak RSS (VmHWM) then and after the requests, with the log
    line last written when a once-a-second sample of it was largest (the start's phase then);
  - the spec's example requests (/v1/chat/completions, /v1/completions, /v1/messages,
    /v1/messages/count_tokens, /v1/responses on model qwen3-8-27b), each must answer 200;
  - decode tok/s of one row (the timings block's predicted_per_second of a chat answer of --steps
    tokens, the best of DECODE_RUNS), beside its ceiling: bandwidth / the bytes one decode step reads
    (every weight the worker holds but the embedding table, of which it reads one row, and the Gated
    DeltaNet state, read and written).
Results: docs/perf-log.md.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_startup import Server, proc_status, uptime  # noqa: E402
from engine import memory, registry  # noqa: E402
from engine.config import config_from_dict, load_config  # noqa: E402

BANDWIDTH_BYTES = 2 << 30
BANDWIDTH_RUNS = 5
DECODE_RUNS = 3
# The spec's example requests (its paths' examples), model qwen3-8-27b.
EXAMPLES = (
    ("/v1/chat/completions", {"model": "qwen3-8-27b", "max_tokens": 64,
                              "messages": [{"role": "user", "content": "Name three planets."}]}),
    ("/v1/completions", {"model": "qwen3-8-27b", "prompt": "The three largest planets are", "max_tokens": 32}),
    ("/v1/messages", {"model": "qwen3-8-27b", "max_tokens": 64,
                      "messages": [{"role": "user", "content": "Name three planets."}]}),
    ("/v1/messages/count_tokens", {"model": "qwen3-8-27b",
                                   "messages": [{"role": "user", "content": "Name three planets."}]}),
    ("/v1/responses", {"model": "qwen3-8-27b", "input": "Name three planets.", "max_output_tokens": 64}),
)


def bandwidth() -> float:
    """Bytes per second the host streams from memory: one thread per core, each OR-ing its share of a
    BANDWIDTH_BYTES array as 64-bit words (NumPy lets go of the GIL; no arithmetic to wait on: it ran
    21.5 GB/s here where float sums ran 13-16), the best of BANDWIDTH_RUNS."""
    cores = os.cpu_count() or 1
    parts = [np.ones(BANDWIDTH_BYTES // cores // 8, np.uint64) for _ in range(cores)]
    best = 0.0
    for _ in range(BANDWIDTH_RUNS):
        threads = [threading.Thread(target=np.bitwise_or.reduce, args=(part,)) for part in parts]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        best = max(best, sum(p.nbytes for p in parts) / (time.perf_counter() - t0))
    return best


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def step_bytes(cfg, held_bytes: float) -> float:
    """Bytes one decode step of one row reads: what the worker holds (/v1/models' gb) less the
    embedding table, of which it reads one row, plus the linear layers' state, read and written."""
    table = cfg.vocab_size * (cfg.hidden_size + memory.SCALE_BYTES)         # int8 rows and their scales
    return held_bytes - table + 2 * memory.slot_state_bytes(cfg)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8-27b")
    parser.add_argument("--layers", type=int, help="the model's shape cut to this many layers (development)")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=64)
    opts = parser.parse_args()
    print(f"# {uptime()}; {os.cpu_count()} cores; MemAvailable {memory.available_bytes() / 2**30:.1f} GiB")
    bw = bandwidth()
    print(f"memory bandwidth: {bw / 1e9:.1f} GB/s ({os.cpu_count()} threads reading {BANDWIDTH_BYTES >> 30} GiB)")
    cache = Path(tempfile.mkdtemp(prefix="mashbox-random-"))
    try:
        model = [opts.model, "--weights", "random"]
        spec = registry.resolve(opts.model, "random")
        cfg = config_from_dict(spec.config)
        if opts.layers:
            os.environ[registry.ENV_CACHE] = str(cache)
            folder = registry.random_folder(spec, "q4_k", {"num_hidden_layers": opts.layers})
            model, cfg = [str(folder), "--weights-dtype", "int8"], load_config(str(folder))
        return run(model, cache, opts, bw, cfg)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


class Sampler:
    """The server's worker's RSS once a second from a thread: its largest, and the log line last
    written before it (which phase of the start it was in)."""

    def __init__(self, server: Server):
        self.server, self.peak, self.when, self.done = server, 0, "", False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.done:
            for pid in _children(self.server.proc.pid):
                try:
                    rss = proc_status(pid)["VmRSS"]
                except (OSError, KeyError):
                    continue
                if rss > self.peak:
                    self.peak, self.when = rss, (self.server.lines or [""])[-1].strip()[:100]
            time.sleep(1)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def run(model: list[str], cache: Path, opts, bw: float, cfg) -> int:
    t0 = time.monotonic()
    server = Server(cache, (*model, "--slots", "1", "--ctx", str(opts.ctx)))
    sampler = Sampler(server)
    try:
        health = server.wait_ok()
        ready_s = time.monotonic() - t0
        worker = health["worker_pid"]
        print(f"ready after {ready_s:.0f} s; worker peak RSS {proc_status(worker)['VmHWM'] / 1e9:.2f} GB "
              f"(sampled each second: {sampler.peak / 1e9:.2f} GB, after: {sampler.when})")
        failed = 0
        served = server.get("/v1/models")["data"][0]["id"]      # a folder cut to --layers has its own
        for path, body in EXAMPLES:
            status, answer = post(server.port, path, {**body, "model": served})
            failed += status != 200
            print(f"  POST {path}: {status}" + ("" if status == 200 else f" {answer}"))
        card = server.get("/v1/models")["data"][0]
        best = 0.0
        for _ in range(DECODE_RUNS):
            status, answer = post(server.port, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Name three planets."}], "max_tokens": opts.steps})
            if status != 200:
                print(f"  decode run: {status} {answer}")
                return 1
            best = max(best, answer["timings"]["predicted_per_second"] or 0.0)
        read = step_bytes(cfg, card["gb"] * 1e9)
        after = bandwidth()                 # again beside the decode: a shared host's load moves both
        print(f"memory bandwidth after the decode runs: {after / 1e9:.1f} GB/s")
        bw = max(bw, after)
        print(f"held: {card['weights']} ({card['bpw']} bits per weight stored), {card['gb']:.2f} GB; "
              f"worker peak RSS {proc_status(worker)['VmHWM'] / 1e9:.2f} GB")
        print(f"decode: {best:.2f} tok/s (1 row, {opts.steps} tokens, best of {DECODE_RUNS}); one step reads "
              f"{read / 1e9:.2f} GB: ceiling {bw / read:.2f} tok/s at {bw / 1e9:.1f} GB/s "
              f"({100 * best * read / bw:.0f}% of it)")
        return 1 if failed else 0
    finally:
        sampler.done = True
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
