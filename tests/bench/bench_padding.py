"""A prompt chunk's padding: what the server's smallest chunk costs by how many of its tokens are a
prompt's (run by hand, not in CI).

    python tests/bench/bench_padding.py [--model demo|27b] [--layers 4] [--at 0,16000] [--rounds 5]

The chunk (scheduler.PREFILL_CHUNKS' smallest, 32 tokens) holds 1, 6, 16 or 32 real tokens, the rest
padding, read from position --at (the context before it already in the cache: attention reads it);
prints the median ms of each, and each against the full chunk. The kernel computes no product row
and reads no key for padding (engine/native.cc: LiveRows; Int8Attend's negative positions), so a
short prompt, or a long prompt's last few tokens, cost their own tokens, not the chunk's. Models as
bench_prefill_kernel's. Results: docs/perf-log.md ("A chunk's padding costs nothing").
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench_prefill_kernel import load  # noqa: E402
from engine import model, native  # noqa: E402
from engine.cache import init_cache  # noqa: E402
from engine.scheduler import PREFILL_CHUNKS  # noqa: E402

REAL_TOKENS = (1, 6, 16, 32)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("demo", "27b"), default="demo")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--at", default="0,16000")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    native.prepare()
    if not native.available():
        raise SystemExit("the native kernel does not run here")
    cfg, params, layout = load(a.model, a.layers)
    chunk = min(PREFILL_CHUNKS)
    tokens = np.random.default_rng(0).integers(0, 20_000, (1, chunk)).astype(np.int32)
    starts = [int(n) for n in a.at.split(",")]
    cache = init_cache(cfg, 1, max(starts) + chunk, np.int8, zeros=layout.cache_zeros)

    def read(start: int, real: int) -> float:
        nonlocal cache
        t0 = time.perf_counter()
        logits, cache = model.jit_forward(params, cache, tokens, np.zeros(1, np.int32), np.full(1, start, np.int32),
                                          np.full(1, real, np.int32), cfg=cfg)
        jax.block_until_ready(logits)
        return time.perf_counter() - t0

    read(0, chunk)                                        # compiled (one program for every count)
    name = f"{a.model}{f' ({a.layers} layers)' if a.model == '27b' else ''}"
    print(f"{name}, a {chunk}-token chunk, medians of {a.rounds} (the counts taken in turn), ms:")
    for start in starts:
        times = {real: [] for real in REAL_TOKENS}
        for _ in range(a.rounds):
            for real in REAL_TOKENS:
                times[real].append(read(start, real))
        ms = {real: statistics.median(ts) * 1e3 for real, ts in times.items()}
        print(f"  from position {start:6d}: " + ", ".join(
            f"{real} real {ms[real]:.1f} ({ms[chunk] / ms[real]:.2f}x)" for real in REAL_TOKENS), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
