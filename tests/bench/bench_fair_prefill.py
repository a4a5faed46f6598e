"""Prompts read side by side: what long prompts make other requests wait (run by hand, not in CI).

    python tests/bench/bench_fair_prefill.py [--long-tokens 8192] [--short-tokens 100]
                                             [--seconds 180] [--parts ttft,throughput,decode]

Starts `python -m mashbox run` (the demo model at its defaults: 4 slots, ctx 32768) with four API
keys, one tenant each, and measures over HTTP (streamed Chat Completions, greedy):
  ttft        three clients keep sending --long-tokens prompts (answers of --long-max-tokens), each
              new prompt unlike every earlier one (no cache serves it); a fourth sends
              --short-tokens prompts one after another, 0.2-1 s apart, for --seconds. Its time to
              first token (the first streamed text), median and max; first alone, for comparison.
  throughput  three long prompts (one token answers) one after another, then three others at once:
              the time of the three together against the sum of their times one after another.
  decode      a long answer's decode speed (generated tokens after the first per second) alone, then
              while three long prompts are read beside it from its first token on.
  chunks      (alone: --parts chunks) no server: one call of each prefill program of the demo from
              positions 0 to 15,800, in this process (what CHUNK_S is fitted to).
  simulate    (alone: --parts simulate [--scale F]) no server: engine.scheduler driven on the demo's
              measured call costs (CHUNK_S, DECODE_S) through the ttft scenario, long prompts of
              several tenants at once, and one tenant's stream of short prompts beside another's
              long prompt. Seconds of simulated time; a check of the policy, not of the machine.
Targets (docs/limits.md; issue 52): short TTFT median <= 1 s and max <= 3 s; the three together
>= 0.9x the throughput of one after another; decode beside long prompts >= 0.7x its speed alone.

The 1-minute load average is printed at the start and the end of each part: other work on the
machine moves every figure here, so run it when the load is below 0.5. Results: docs/perf-log.md.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.bench_sessions import is_output, start_server, usage_of, wait_ready  # noqa: E402

KEYS = {f"sk-bench-fair-prefill-{i}": f"tenant{i}" for i in range(4)}
LONG_CLIENTS = 3
# Words the prompts are drawn from: prose a tokenizer splits into ordinary tokens.
WORDS = ("the file function returns value when tests pass after change module import class error "
         "branch merge commit review line index buffer stream token cache slot prompt answer model "
         "server client request response header body length table column query result state").split()
REQUEST_TIMEOUT_S = 1800
TARGETS = {"ttft_median_s": 1.0, "ttft_max_s": 3.0, "throughput_ratio": 0.9, "decode_ratio": 0.7}


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Texts:
    """User messages of a given number of tokens (the demo's tokenizer), each unlike the others
    from its first word on."""

    def __init__(self):
        from tokenizers import Tokenizer
        from engine import registry
        folder = registry.prepare(registry.resolve(None))
        self.tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        self.n = 0

    def make(self, tokens: int) -> list[dict]:
        """A conversation: a system message that differs from every other (so that it is not cached
        and does not continue a cached conversation) and a user message of `tokens` tokens."""
        self.n += 1
        rng = random.Random(self.n)
        ids = self.tok.encode(" ".join(rng.choice(WORDS) for _ in range(tokens))).ids[:tokens]
        return [{"role": "system", "content": f"Note {self.n}-{rng.random():.6f}."},
                {"role": "user", "content": self.tok.decode(ids)}]


def stream(port: int, key: str, messages: list[dict], max_tokens: int,
           started: threading.Event | None = None) -> dict:
    """One streamed chat completion: sent, first text, end (time.monotonic()) and its usage;
    `started` is set at its first text."""
    body = {"messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    sent = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first, usage, generated = None, None, 0
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if first is None and is_output(event):
            first = time.monotonic()
            if started is not None:
                started.set()
        usage = usage_of(event) or usage
        if event.get("usage"):
            generated = event["usage"].get("completion_tokens", 0)
    end = time.monotonic()
    conn.close()
    prompt, cached = usage or (0, 0)
    return {"sent": sent, "first": first or end, "end": end, "ttft": (first or end) - sent,
            "prompt": prompt, "cached": cached, "generated": generated}


def keys() -> list[str]:
    return list(KEYS)


# ---- the parts ------------------------------------------------------------------------------------

def part_ttft(port: int, texts: Texts, a) -> dict:
    short_key = keys()[LONG_CLIENTS]
    alone = [stream(port, short_key, texts.make(a.short_tokens), a.short_max_tokens)["ttft"]
             for _ in range(5)]
    stop = threading.Event()
    longs: list[dict] = []

    def long_client(key: str) -> None:
        while not stop.is_set():
            longs.append(stream(port, key, texts.make(a.long_tokens), a.long_max_tokens))

    threads = [threading.Thread(target=long_client, args=(k,), daemon=True) for k in keys()[:LONG_CLIENTS]]
    for t in threads:
        t.start()
    time.sleep(a.settle)                   # the three long prompts are being read
    shorts, deadline = [], time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        r = stream(port, short_key, texts.make(a.short_tokens), a.short_max_tokens)
        shorts.append(r)
        print(f"  short: prompt {r['prompt']:5d}  ttft {r['ttft']:6.2f} s", flush=True)
        time.sleep(random.uniform(0.2, 1.0))
    stop.set()
    for t in threads:
        t.join()
    ttfts = [r["ttft"] for r in shorts]
    return {"short_alone_median_s": statistics.median(alone), "short_n": len(ttfts),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_p90_s": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
            "ttft_max_s": max(ttfts), "long_n": len(longs),
            "long_ttft_median_s": statistics.median([r["ttft"] for r in longs]) if longs else None,
            "short_prompt_tokens": shorts[0]["prompt"] if shorts else None,
            "long_prompt_tokens": longs[0]["prompt"] if longs else None}


def part_throughput(port: int, texts: Texts, a) -> dict:
    one_by_one = 0.0
    for k in keys()[:LONG_CLIENTS]:
        r = stream(port, k, texts.make(a.long_tokens), 1)
        one_by_one += r["end"] - r["sent"]
        print(f"  one after another: prompt {r['prompt']} (cached {r['cached']}) "
              f"{r['end'] - r['sent']:.1f} s",
              flush=True)
    out: list[dict] = []
    prompts = [texts.make(a.long_tokens) for _ in range(LONG_CLIENTS)]
    threads = [threading.Thread(target=lambda k=k, p=p: out.append(stream(port, k, p, 1)))
               for k, p in zip(keys(), prompts)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = max(r["end"] for r in out) - t0
    print(f"  together: {together:.1f} s; first tokens at " +
          ", ".join(f"{r['first'] - t0:.1f}" for r in sorted(out, key=lambda r: r["first"])) + " s",
          flush=True)
    tokens = sum(r["prompt"] - r["cached"] for r in out)
    return {"one_by_one_s": one_by_one, "together_s": together, "throughput_ratio": one_by_one / together,
            "together_tok_s": tokens / together}


DECODE_PROMPT = [{"role": "user", "content": "Write the numbers from 1 to 400 in words, one per line, and "
                                              "nothing else."}]


def part_decode(port: int, texts: Texts, a) -> dict:
    talker = keys()[LONG_CLIENTS]
    alone = stream(port, talker, DECODE_PROMPT, a.decode_tokens)
    rate_alone = (alone["generated"] - 1) / (alone["end"] - alone["first"])
    print(f"  alone: {alone['generated']} tokens, {rate_alone:.1f} tok/s", flush=True)
    result: dict = {}
    started = threading.Event()
    talk = threading.Thread(target=lambda: result.update(
        stream(port, talker, DECODE_PROMPT, a.decode_tokens, started)))
    talk.start()
    started.wait(REQUEST_TIMEOUT_S)
    longs: list[dict] = []
    beside = [threading.Thread(target=lambda k=k: longs.append(stream(port, k, texts.make(a.long_tokens), 1)))
              for k in keys()[:LONG_CLIENTS]]
    for t in beside:
        t.start()
    talk.join()
    busy_until = min([r["first"] for r in longs] or [float("inf")])
    for t in beside:
        t.join()
    rate = (result["generated"] - 1) / (result["end"] - result["first"])
    print(f"  beside three long prompts: {result['generated']} tokens, {rate:.1f} tok/s; prompts read "
          f"throughout: {busy_until >= result['end']}", flush=True)
    return {"decode_alone_tok_s": rate_alone, "decode_beside_tok_s": rate, "decode_ratio": rate / rate_alone,
            "prompts_read_throughout": busy_until >= result["end"]}


# ---- the scheduler alone, on a cost model ----------------------------------------------------------

# Seconds of one prefill call of the demo (chunk -> (at position 0, per position more)) and of a
# decode step (fixed, per row, per position of the deepest row), measured on a 2-core AMD EPYC (Zen 4)
# at load 8-9 (docs/perf-log.md, "Prompts read side by side"); --scale shrinks them toward an idle
# machine. The policy's figures are relative: no device runs.
CHUNK_S = {1: (0.045, 2e-6), 32: (0.140, 3.1e-5), 128: (1.006, 1.46e-4), 512: (4.026, 9e-4)}
DECODE_S = (0.045, 0.004, 2e-6)


class Simulation:
    """engine.scheduler.Scheduler driven as the worker drives it, each round's calls taking what
    CHUNK_S and DECODE_S say; arrivals join between rounds."""

    def __init__(self, scale: float):
        from engine.scheduler import Buckets, Scheduler
        self.s = Scheduler(4, 32768, 150000, Buckets.for_ctx(32768, slots=4))
        self.scale, self.t, self.n = scale, 0.0, 0
        self.arrivals: list[tuple[float, object]] = []
        self.first: dict[str, float] = {}
        self.sent: dict[str, float] = {}

    def request(self, tokens: int, max_tokens: int, tenant: str, at: float | None = None) -> str:
        from engine.protocol import Sampling
        from engine.scheduler import Sequence
        self.n += 1
        rid = f"{tenant}-{self.n}"
        ids = [(self.n * 7919 + i * 104729) % 149000 for i in range(tokens)]
        request = Sequence(rid, ids, max_tokens, Sampling(), frozenset(), tenant=tenant)
        self.arrivals.append((self.t if at is None else at, request))
        return rid

    def round(self) -> list:
        """One round (or a jump to the next arrival when idle); the requests that ended."""
        for at, r in [a for a in self.arrivals if a[0] <= self.t]:
            self.arrivals.remove((at, r))
            self.sent[r.rid] = at
            self.s.add(r)
        if not self.s.busy:
            self.t = min(at for at, _ in self.arrivals)
            return []
        plan, emits, d, p = self.s.schedule(), [], 0.0, 0.0
        if plan.decode:
            base, row, pos = DECODE_S
            deepest = max(len(r.prompt) + len(r.output) for r in plan.decode.rows)
            d = self.scale * (base + row * len(plan.decode.rows) + pos * deepest)
            emits += self.s.decoded(plan.decode, [5] * len(plan.decode.rows))
        if plan.prefill:
            w = plan.prefill
            base, pos = CHUNK_S[w.chunk]
            p = self.scale * (base + pos * (w.start + w.chunk / 2))
            emits += self.s.prefilled(w, 5 if w.last else None)
        self.s.spent(plan, d, p)
        self.t += d + p
        for e in emits:
            self.first.setdefault(e.request.rid, self.t)
        return [e.request for e in emits if e.finish]

    def ttft(self, rid: str) -> float:
        return self.first[rid] - self.sent[rid]


def simulate_ttft(a) -> dict:
    """Three tenants keep sending long prompts, a fourth short ones 0.2-1 s apart."""
    sim, rng, shorts = Simulation(a.scale), random.Random(0), []
    for k in range(LONG_CLIENTS):
        sim.request(a.long_tokens, a.long_max_tokens, f"long{k}")
    sim.request(a.short_tokens + 27, a.short_max_tokens, "short", at=a.settle)
    while sim.t < a.settle + a.seconds:
        for r in sim.round():
            if r.tenant == "short":
                shorts.append(sim.ttft(r.rid))
                later = sim.t + rng.uniform(0.2, 1.0)
                sim.request(a.short_tokens + 27, a.short_max_tokens, "short", at=later)
            else:
                sim.request(a.long_tokens, a.long_max_tokens, r.tenant)
    return {"short_n": len(shorts), "ttft_median_s": statistics.median(shorts), "ttft_max_s": max(shorts)}


def simulate_together(a, tenants: list[str]) -> list[float]:
    """Long prompts arriving at once (one-token answers): each one's first token, seconds."""
    sim = Simulation(a.scale)
    rids = [sim.request(a.long_tokens, 1, t) for t in tenants]
    while sim.s.busy or sim.arrivals:
        sim.round()
    return [round(sim.ttft(r), 1) for r in rids]


def simulate_flood(a, clients: int) -> dict:
    """One tenant's long prompt while another sends short prompts from `clients` clients, each
    prompt after its client's last answer (4 tokens): the long prompt's first token, seconds."""
    sim = Simulation(a.scale)
    rid, served = sim.request(a.long_tokens, 1, "long"), 0
    for _ in range(clients):
        sim.request(a.short_tokens + 27, 4, "flood")
    while rid not in sim.first:
        for r in sim.round():
            if r.tenant == "flood":
                served += 1
                sim.request(a.short_tokens + 27, 4, "flood")
    return {"long_ttft_s": round(sim.ttft(rid), 1), "short_answers": served}


def part_simulate(a) -> dict:
    return {"ttft": simulate_ttft(a),
            "three_tenants_at_once": simulate_together(a, ["a", "b", "c"]),
            "a_twice_b_once": simulate_together(a, ["a", "a", "b"]),
            "long_alone_s": simulate_flood(a, 0)["long_ttft_s"],
            "long_beside_3_flooding_clients": simulate_flood(a, 3),
            "long_beside_1_flooding_client": simulate_flood(a, 1)}


def part_chunks(a) -> dict:
    """Seconds of one call of each prefill program from several positions (the best of --reps, the
    programs taking turns), in this process: the figures CHUNK_S is fitted to."""
    import numpy as np
    from engine import registry
    from engine.worker import Engine, WorkerArgs
    engine = Engine(WorkerArgs("bench", registry.prepare(registry.resolve(None)), slots=1, ctx=16384))
    chunks, depths = engine.buckets.chunks, (0, 1024, 2048, 4096, 8192, 12288, 15800)
    best = {(c, d): float("inf") for c in chunks for d in depths}
    for _ in range(a.reps):
        for (c, d) in best:
            t0 = time.perf_counter()
            engine._forward(np.ones((1, c), np.int32), np.zeros(1, np.int32), np.array([d], np.int32),
                            np.array([c], np.int32), None)
            best[c, d] = min(best[c, d], time.perf_counter() - t0)
    for d in depths:
        print(f"  from position {d:5d}: " + "  ".join(
            f"{c} tokens {best[c, d] * 1000:6.0f} ms ({c / best[c, d]:4.0f} tok/s)" for c in chunks),
            flush=True)
    return {f"{c}@{d}": round(best[c, d], 4) for c, d in best}


# ---- main -----------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long-tokens", type=int, default=8192)
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument("--short-tokens", type=int, default=100)
    p.add_argument("--short-max-tokens", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--seconds", type=float, default=180.0, help="how long the short client runs")
    p.add_argument("--settle", type=float, default=5.0, help="seconds before the short client starts")
    p.add_argument("--parts", default="ttft,throughput,decode", help="by comma; or simulate alone")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--cache-ram", type=int, default=384)
    p.add_argument("--scale", type=float, default=1.0, help="simulate: the costs' factor")
    p.add_argument("--reps", type=int, default=4, help="chunks: runs of each program at each position")
    a = p.parse_args()
    if a.parts in ("simulate", "chunks"):
        before = load()
        found = part_simulate(a) if a.parts == "simulate" else part_chunks(a)
        report({a.parts: {"load_before": before, **found, "load_after": load()}})
        return 0
    key_file = Path(tempfile.mkdtemp(prefix="mashbox-bench-fair-")) / "keys.txt"
    key_file.write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    texts = Texts()
    proc, port = start_server(a, extra=("--api-key-file", str(key_file)))
    results: dict = {}
    try:
        wait_ready(port, proc)
        stream(port, keys()[0], texts.make(64), 2)                 # the first request's own costs
        for part in a.parts.split(","):
            before = load()
            print(f"{part} (load {before:.2f})", flush=True)
            run_part = {"ttft": part_ttft, "throughput": part_throughput, "decode": part_decode}[part]
            results[part] = {"load_before": before, **run_part(port, texts, a), "load_after": load()}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:             # noqa: BLE001 - it is gone or going: kill it
            proc.kill()
    report(results)
    return 0


def report(results: dict) -> None:
    print(json.dumps(results, indent=1))
    flat = {k: v for part in results.values() for k, v in part.items()}
    for name, target in TARGETS.items():
        if name in flat:
            ok = flat[name] <= target if name.startswith("ttft") else flat[name] >= target
            print(f"{name:18s} {flat[name]:8.3f}  target {'<=' if name.startswith('ttft') else '>='} "
                  f"{target}  {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
