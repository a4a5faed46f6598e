"""A prompt's prefill with every chunk through the native kernel against chunks past
products.INT8_ROWS_MAX_ROWS widened for XLA's dot (run by hand, not in CI).

    python tests/bench/bench_prefill_kernel.py [--model demo|8b|27b] [--layers 4] [--tokens 512,2048,8192]
                                               [--chunk 512] [--rounds 3]

demo: the demo model as the server holds it (int8, its GGUF blocks where the kernel serves them);
8b: Qwen3-8B's layers at full width, random int8 weights; 27b: Qwen3.8-27B's layers at full width,
random Q4_K weights (`--layers` of their 36 or 64; the embedding and head whole). On an AMX CPU the
kernel's way multiplies each model's long chunks on its tiles (native.tiles(), products.TILE_KINDS).
Each prompt is read from position 0 in chunks of --chunk tokens (the server's largest chunk), one way
then the other, --rounds times alternated, both programs compiled before; prints the median tokens/s
of each way, their ratio, and the temporaries XLA asks for one chunk (`memory_analysis`). Results:
docs/perf-log.md ("Prefill through the kernel").
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

from engine import model, native, products, registry, sharding  # noqa: E402
from engine.cache import init_cache  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.weights import load_weights, packs_int8  # noqa: E402


# Models read as a cut of their layers, with random weights in the form given (else the demo).
RANDOM_MODELS = {"27b": ("qwen3-8-27b", "q4_k"), "30b-a3b": ("qwen3-30b-a3b", "q8_0"), "8b": ("qwen3-8b", "bf16")}


def load(which: str, layers: int):
    """(cfg, params, layout) of the demo as the server holds it, or of `layers` of a RANDOM_MODELS
    model's layers at full width."""
    if which in RANDOM_MODELS:
        name, form = RANDOM_MODELS[which]
        spec = registry.resolve(name, "random")
        folder = str(registry.random_folder(spec, form, {"num_hidden_layers": layers}))
    else:
        folder = str(registry.prepare(registry.resolve(None)))
    raw = load_config(folder)
    layout = sharding.Layout.build(raw, 1)
    cfg = layout.cfg
    params = load_weights(folder, raw, "int8", float_dtype=np.float32, kv_heads=cfg.num_kv_heads,
                          place=layout.place, pack=packs_int8("int8", cfg.native))
    return cfg, params, layout


def traced(by_kernel: bool):
    """A forward traced with PREFILL_BY_KERNEL as given (fresh functions: jit traces them again)."""
    products.PREFILL_BY_KERNEL = by_kernel
    native._tiles = by_kernel and native.tiles_wanted()          # AMX tiles, where built with them
    layer = jax.jit(lambda *a, **k: model._layer(*a, **k), static_argnames=model.LAYER_STATIC_ARGNAMES)
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), donate_argnames=("cache",),
                      static_argnames=("cfg", "all_logits", "verify"))
    return forward, layer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("demo", "8b", "27b"), default="demo")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    native.prepare()
    if not native.available():
        raise SystemExit("the native kernel does not run here")
    cfg, params, layout = load(a.model, a.layers)
    lengths = [int(n) for n in a.tokens.split(",")]
    ctx = max(lengths)
    tokens = np.random.default_rng(0).integers(0, 20_000, (1, ctx)).astype(np.int32)
    ways = {}
    chunk_args = (np.zeros(1, np.int32), np.zeros(1, np.int32), np.full(1, a.chunk, np.int32))

    def read(way: str, n: int) -> float:
        forward, layer = ways[way]
        model._jit_layer = layer
        cache = init_cache(cfg, 1, ctx, np.int8, zeros=layout.cache_zeros)
        t0 = time.perf_counter()
        for at in range(0, n, a.chunk):
            logits, cache = forward(params, cache, tokens[:, at:at + a.chunk], np.zeros(1, np.int32),
                                    np.full(1, at, np.int32), np.full(1, a.chunk, np.int32), cfg=cfg)
        jax.block_until_ready(logits)
        return time.perf_counter() - t0

    for way, by_kernel in (("kernel", True), ("widened", False)):
        ways[way] = forward, layer = traced(by_kernel)       # traced below, with the flag as set here
        model._jit_layer = layer
        cache = init_cache(cfg, 1, ctx, np.int8, zeros=layout.cache_zeros)
        temp = forward.lower(params, cache, tokens[:, :a.chunk], *chunk_args, cfg=cfg).compile() \
            .memory_analysis().temp_size_in_bytes
        read(way, a.chunk)                                    # compile, and the first run's set-up
        print(f"{way}: a {a.chunk}-token chunk's temporaries {temp / 1e6:.0f} MB", flush=True)
    print(f"{a.model}{f' ({a.layers} layers)' if a.model == '27b' else ''}, chunks of {a.chunk}, "
          f"medians of {a.rounds} alternated, tokens/s:")
    for n in lengths:
        speed = alternated(ways, n, a.rounds, read)
        print(f"  {n:6d} tokens: kernel {speed['kernel']:7.1f}, widened {speed['widened']:7.1f}, "
              f"kernel / widened {speed['kernel'] / speed['widened']:.2f}x", flush=True)
    return 0


def alternated(ways, n: int, rounds: int, read) -> dict:
    """Each way's median tokens/s reading an n-token prompt (read(way, n) -> seconds), the ways
    taken in turn `rounds` times."""
    times = {way: [] for way in ways}
    for _ in range(rounds):
        for way in ways:
            times[way].append(read(way, n))
    return {way: n / statistics.median(ts) for way, ts in times.items()}


def decode_medians(ways, step, rounds: int, steps: int = 4) -> dict:
    """Each way's median ms per decode step: `steps` steps a round (step(way, position) runs one),
    the ways taken in turn `rounds` times, each at the next positions of its own cache."""
    times = {way: [] for way in ways}
    for r in range(rounds):
        for way in ways:
            t0 = time.perf_counter()
            for i in range(steps):
                step(way, 1 + steps * r + i)
            times[way].append((time.perf_counter() - t0) / steps)
    return {way: statistics.median(ts) * 1e3 for way, ts in times.items()}


if __name__ == "__main__":
    raise SystemExit(main())
