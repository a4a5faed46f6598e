"""A prompt's prefill as it runs now, every position's numbers the same in any chunks (the kernel's
attention for every call, the Gated DeltaNet recurrence token by token, routers in one order),
against the paths before (XLA's blocked attention for chunks, the chunked delta rule, routers
through XLA's dot past 64 rows); run by hand, not in CI.

    python tests/bench/bench_same_answer.py [--model demo|27b|30b-a3b] [--layers 4]
                                            [--tokens 512,2048,8192] [--chunk 512] [--rounds 3]
    python tests/bench/bench_same_answer.py --attention | --delta | --decode [--layers 8] [--rounds 15]

demo: the demo model as the server holds it; 27b: Qwen3.8-27B's layers at full width (`--layers`
of its 64: 3 Gated DeltaNet layers to each attention layer), random Q4_K weights; 30b-a3b:
Qwen3-30B-A3B's (`--layers` of its 48), random Q8_0 weights. Each prompt is read from position 0 in
chunks of --chunk tokens (the server's largest), one way then the other, --rounds times alternated,
both compiled before; prints the median tokens/s of each way and their ratio. --attention: one
call of attention alone over random int8 caches, the kernel against XLA's blocked loop, at the
demo's, an 8-KV-head and the 27B's head shapes (a 512-token chunk at 512 / 2,048 / 8,192 positions,
16 and 64 tokens at 2,048). --delta: one Gated DeltaNet layer's recurrence alone at the 27B's
state shape, the kernel against XLA's loop and the chunked form (delta_alone). --decode: a decode
step of the 27B's layers, the recurrence's state in place in its slot against gathered and
scattered (decode_in_place). Results:
docs/perf-log.md ("The same numbers in any chunks", "The delta rule in the kernel").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_prefill_kernel import RANDOM_MODELS, alternated, decode_medians, load  # noqa: E402
from engine import attention, model, moe, native, products  # noqa: E402
from engine.cache import init_cache  # noqa: E402


def _attend_before(q, kv, slots, positions, live, *, native_kernel: bool):
    """attention.attend as it was: the kernel for decode steps only, XLA's blocks for chunks."""
    if native_kernel and q.shape[3] == 1 and kv["k"].dtype == jnp.int8:
        return attention.attend(q, kv, slots, positions, live, native_kernel=True)
    return attention._attend_blocks(q, kv, slots, positions, live)


def traced(way: str):
    """A forward traced the way given (fresh functions: jit traces them again with the paths set)."""
    model.attend = attention.attend if way == "now" else _attend_before
    os.environ[model.DELTA_STEPS_ENV] = "1" if way == "now" else "0"
    moe.row_exact_rows = products.row_exact_rows if way == "now" else (lambda _: products.INT8_ROWS_MAX_ROWS)
    layer = jax.jit(lambda *a, **k: model._layer(*a, **k), static_argnames=model.LAYER_STATIC_ARGNAMES)
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), donate_argnames=("cache",),
                      static_argnames=("cfg", "all_logits", "verify"))
    return forward, layer


def attention_alone(rounds: int) -> None:
    """attention.attend through the kernel against XLA's blocked loop, one call's time (medians)."""
    rng = np.random.default_rng(0)
    for kv_heads, group, d in ((2, 7, 64), (8, 2, 128), (4, 6, 256)):
        for t, live in ((512, 512), (512, 2048), (512, 8192), (16, 2048), (64, 2048)):
            ctx = max(live, 1024)
            kv = {"k": rng.integers(-127, 128, (1, kv_heads, d, ctx), dtype=np.int8),
                  "v": rng.integers(-127, 128, (1, kv_heads, d, ctx), dtype=np.int8),
                  "k_scale": (rng.random((1, kv_heads, ctx)) * 0.02).astype(np.float32),
                  "v_scale": rng.random((1, kv_heads, ctx)).astype(np.float32)}
            q = (rng.standard_normal((1, kv_heads, group, t, d)) / 4).astype(np.float32)
            args = (q, kv, np.zeros(1, np.int32), (live - t + np.arange(t, dtype=np.int32))[None], np.int32(live))
            ways = {"kernel": jax.jit(lambda *a: attention.attend(*a, native_kernel=True)),
                    "xla": jax.jit(attention._attend_blocks)}
            ms = _call_medians(ways, args, rounds)
            print(f"  KV {kv_heads} x {group} heads of {d}, {t:3d} tokens at {live:4d}: kernel {ms['kernel']:6.1f} ms, "
                  f"XLA {ms['xla']:6.1f} ms, {ms['xla'] / ms['kernel']:.2f}x", flush=True)


def _call_medians(ways, args, rounds: int) -> dict:
    """Each way's median ms for one call f(*args), the ways alternated (each compiled first)."""
    times = {way: [] for way in ways}
    for way, f in ways.items():
        jax.block_until_ready(f(*args))
    for _ in range(rounds):
        for way, f in ways.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[way].append(time.perf_counter() - t0)
    return {way: statistics.median(ts) * 1e3 for way, ts in times.items()}


def delta_alone(rounds: int) -> None:
    """The Gated DeltaNet recurrence of one layer alone at Qwen3.8-27B's state shape (48 value heads
    of 128 x 128), T tokens of one row: the kernel's DeltaSteps against XLA's loop of the same steps
    and (from 64 tokens) the chunked form (medians)."""
    rng = np.random.default_rng(0)
    h, d = 48, 128
    for t in (1, 4, 64, 512):
        q, k = (rng.standard_normal((1, t, h, d)).astype(np.float32) / np.sqrt(d) for _ in range(2))
        v = rng.standard_normal((1, t, h, d)).astype(np.float32)
        decay, beta = (rng.uniform(0.3, 1.0, (1, t, h)).astype(np.float32) for _ in range(2))
        state = rng.standard_normal((1, h, d, d)).astype(np.float32) * 0.1
        ways = {"kernel": jax.jit(lambda *a: model._delta_steps(*a, native_kernel=True)),
                "xla": jax.jit(lambda *a: model._delta_steps(*a, native_kernel=False))}
        if t >= model.DELTA_CHUNK:
            ways["chunked"] = jax.jit(lambda q, k, v, decay, beta, state, zero:
                                      model._delta_chunked(q, k, v, jnp.log(decay), beta, state))
        ms = _call_medians(ways, (q, k, v, decay, beta, state, np.int32(0)), rounds)
        print(f"  {t:3d} tokens: kernel {ms['kernel']:7.2f} ms, XLA's steps {ms['xla']:7.2f} ms "
              f"({ms['xla'] / ms['kernel']:.2f}x)" + (f", chunked {ms['chunked']:7.2f} ms "
              f"({ms['chunked'] / ms['kernel']:.2f}x)" if "chunked" in ms else ""), flush=True)


def decode_in_place(layers: int, rounds: int) -> None:
    """A decode step of the 27B's layers (random Q4_K, `layers` of its 64), the recurrence reading
    and writing each row's state in its slot (native.delta_steps_in_place) against the state
    gathered from the pool, run, and scattered back (as before), alternated (medians)."""
    import types

    def gathered(q, k, v, decay, beta, states, slots, starts, lengths):
        state = jnp.where((starts == 0)[:, None, None, None], 0.0, states[slots])
        out, new, written = native.delta_steps(q, k, v, decay, beta, state)
        return out, written, states.at[jnp.where(lengths > 0, slots, states.shape[0])].set(new, mode="drop")

    before = types.SimpleNamespace(**{**vars(native), "delta_steps_in_place": gathered})
    cfg, params, layout = load("27b", layers)
    ways, caches = {}, {}
    token = np.array([[5]], np.int32)

    def step(way: str, at: int) -> None:
        model.native, (forward, layer) = (native if way == "in place" else before), ways[way]
        model._jit_layer = layer
        logits, caches[way] = forward(params, caches[way], token, np.zeros(1, np.int32), np.full(1, at, np.int32),
                                      np.ones(1, np.int32), cfg=cfg)
        jax.block_until_ready(logits)

    for way in ("in place", "gathered"):
        ways[way] = (jax.jit(lambda *a, **k: model.forward(*a, **k), donate_argnames=("cache",),
                             static_argnames=("cfg", "all_logits", "verify")),
                     jax.jit(lambda *a, **k: model._layer(*a, **k), static_argnames=model.LAYER_STATIC_ARGNAMES))
        caches[way] = init_cache(cfg, 1, 4 * rounds + 8, np.int8, zeros=layout.cache_zeros)
        step(way, 0)                                           # traced with its recurrence, compiled
    ms = decode_medians(ways, step, rounds)
    model.native = native
    print(f"27b ({layers} layers), a decode step, medians of {rounds}: in place {ms['in place']:.2f} ms, "
          f"gathered {ms['gathered']:.2f} ms, {ms['gathered'] / ms['in place']:.3f}x", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("demo", *RANDOM_MODELS), default="demo")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention", action="store_true", help="attention alone, kernel against XLA")
    p.add_argument("--delta", action="store_true", help="the delta rule alone, kernel against XLA")
    p.add_argument("--decode", action="store_true", help="the 27B's decode step, its state in place or gathered")
    a = p.parse_args()
    native.prepare()
    if not native.available():
        raise SystemExit("the native kernel does not run here")
    if a.attention or a.delta:
        (attention_alone if a.attention else delta_alone)(a.rounds)
        return 0
    if a.decode:
        decode_in_place(a.layers, a.rounds)
        return 0
    cfg, params, layout = load(a.model, a.layers)
    lengths = [int(n) for n in a.tokens.split(",")]
    ctx = max(lengths)
    tokens = np.random.default_rng(0).integers(0, 20_000, (1, ctx)).astype(np.int32)
    ways = {}

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

    for way in ("now", "before"):
        ways[way] = traced(way)
        read(way, a.chunk)                                    # traced and compiled with the paths set
    print(f"{a.model}{f' ({a.layers} layers)' if a.model in RANDOM_MODELS else ''}, chunks of {a.chunk}, "
          f"medians of {a.rounds} alternated, tokens/s:")
    for n in lengths:
        speed = alternated(ways, n, a.rounds, read)
        print(f"  {n:6d} tokens: now {speed['now']:7.1f}, before {speed['before']:7.1f}, "
              f"now / before {speed['now'] / speed['before']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
