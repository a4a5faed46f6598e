"""A CPU decode step with its weights in huge pages (engine.memory.HugePageArena, as the worker places
them) against the same weights in XLA's own heap (4 KB pages where transparent huge pages are only
on request); run by hand, not in CI.

    python tests/bench/bench_huge_pages.py [--layers 8] [--rounds 9]

Qwen3.8-27B's layers at full width (`--layers` of its 64, 3 Gated DeltaNet layers to each attention
layer, random Q4_K weights: about 0.25 GB a layer), loaded once as the worker loads them, then
copied by XLA into its heap; a decode step (1 row) of each, 4 steps a round, the two alternated
`--rounds` times; prints the medians, their ratio and the weights' bytes a step reads per second.
Also prints the transparent huge pages setting and how much of the first copy the kernel holds in
huge pages. Results: docs/perf-log.md ("Weights in huge pages").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_prefill_kernel import decode_medians, load  # noqa: E402
from engine import model, native  # noqa: E402
from engine.cache import init_cache  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_gb() -> float:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1e6
    return 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    native.prepare()
    if not native.available():
        raise SystemExit("the native kernel does not run here")
    print(f"transparent huge pages: {THP.read_text().strip() if THP.exists() else 'absent'}", flush=True)
    cfg, huge, layout = load("27b", a.layers)
    print(f"after loading: {anon_huge_gb():.2f} GB in huge pages", flush=True)
    heap = jax.tree.map(jnp.copy, huge)                   # the same values, in buffers XLA allocated
    jax.block_until_ready(heap)
    weights = sum(x.nbytes for x in jax.tree.leaves(huge["layers"]))
    forward = jax.jit(model.forward, donate_argnames=("cache",), static_argnames=("cfg", "all_logits", "verify"))
    token = np.array([[5]], np.int32)
    heap_way = "XLA's heap"
    ways = {"huge pages": huge, heap_way: heap}
    caches = {way: init_cache(cfg, 1, 4 * a.rounds + 8, np.int8, zeros=layout.cache_zeros) for way in ways}

    def step(way: str, at: int) -> None:
        logits, caches[way] = forward(ways[way], caches[way], token, np.zeros(1, np.int32), np.full(1, at, np.int32),
                                      np.ones(1, np.int32), cfg=cfg)
        jax.block_until_ready(logits)

    for way in ways:
        step(way, 0)                                       # compiled (one program for both)
    ms = decode_medians(ways, step, a.rounds)
    print(f"27b ({a.layers} layers, {weights / 1e9:.2f} GB of layer weights), a decode step, medians of "
          f"{a.rounds}: " + ", ".join(f"{way} {t:.1f} ms ({weights / t / 1e6:.1f} GB/s)" for way, t in ms.items())
          + f"; {ms[heap_way] / ms['huge pages']:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
