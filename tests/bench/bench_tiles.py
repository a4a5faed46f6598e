"""A long prefill chunk's product three ways, side by side in one process (run by hand, not in CI):
the kernel's (on AMX tiles where native.tiles(), else its row passes), XLA's own int8 dot on as many
int8 terms per row (the matrix units' reference), and the weights widened for XLA's bfloat16 dot
(what an AMX CPU ran before the tiles).

    python tests/bench/bench_tiles.py [--form int8|q4_k|q6_k|q5_0|...] [--rows 64,512] [--rounds 7]

--form: the weights' kind (engine.products.TILE_KINDS; random weights): int8 (two terms per row), or
a GGUF block form (one term per row, on each block's scale). Shapes: the demo's products (896 wide,
4,864 inner) and Qwen3.8-27B's (5,120 wide, 17,408 inner), those the form's blocks fit. Prints, per
shape and row count, the median ms of each way, the kernel's int8 operations per second (2 R N K per
term) and its ratios to the other two. On an AMX CPU the issue's target is the kernel at >= 70% of
XLA's int8 dot; elsewhere the kernel's row passes run, and the line says so. Where the kernel has
tiles, a second process built without them (MASHBOX_AMX=0) times the row passes on the same shapes
right after each shape, for the tiles' ratio to them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from engine import checkpoint, cpu, native, products  # noqa: E402

# (name, outputs N, inputs K) of the products a prefill chunk runs.
SHAPES = [("demo qkv", 1152, 896), ("demo gate_up", 9728, 896), ("demo down", 896, 4864),
          ("27b attn", 5120, 5120), ("27b gate_up", 34816, 5120), ("27b down", 5120, 17408)]


def timed(fn, *args, rounds: int) -> float:
    """Median ms of fn(*args) over `rounds` calls, after one call to compile."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def held(form: str, rng, n: int, k: int) -> dict:
    """Random weights of an [n, k] matrix as the engine holds them in `form`."""
    if form == "int8":
        return {"q": native.pack(rng.integers(1, 256, (n, k), dtype=np.uint8)),
                "scale": rng.random(n).astype(np.float32)}
    scales = lambda blocks: (rng.standard_normal((n, blocks)) * 3e-4).astype(np.float16)  # noqa: E731
    if form == "q5_0":
        return native.pack5(rng.integers(0, 32, (n, k)).astype(np.uint8), scales(k // 32))
    if form == "q8_0":
        return native.pack8(rng.integers(-127, 128, (n, k)).astype(np.int8), scales(k // 32))
    kind = form.upper()
    if kind in checkpoint.K_BYTES:
        raw = rng.integers(0, 256, (n, k // 256, checkpoint.K_BYTES[kind]), dtype=np.uint8)
        raw[..., 0:4] = np.abs(scales(2 * (k // 256))).view(np.uint8).reshape(n, -1, 4)   # d, dmin
        if kind == "Q6_K":
            raw[..., 208:210] = scales(k // 256).view(np.uint8).reshape(n, -1, 2)
        return native.pack_k(kind, **checkpoint.k_quant_parts(kind, raw))
    span = native.S_SPAN[kind]
    raw = rng.integers(0, 256, (n, k // span, native.S_BYTES[kind]), dtype=np.uint8)
    at = 108 if kind == "Q3_K" else 0
    raw[..., at:at + 2] = scales(k // span).view(np.uint8).reshape(n, -1, 2)
    return native.pack_s(kind, **checkpoint.s_block_parts(kind, raw))


def fits(form: str, k: int) -> bool:
    """Whether the form's blocks (256 inputs for the K-quants and the 256-wide scaled-level forms)
    tile an inner dimension of k."""
    kind = form.upper()
    block = 256 if kind in checkpoint.K_BYTES else native.S_SPAN.get(kind, 32)
    return k % block == 0


def traced(by_kernel: bool):
    """products.matmul as traced with the kernel taking every row count (its tiles where it has them),
    or with none (the widened dot at any row count)."""
    def product(x, w):
        saved = native._tiles, products.INT8_ROWS_MAX_ROWS, products.PREFILL_BY_KERNEL
        native._tiles = native._tiles and by_kernel
        products.INT8_ROWS_MAX_ROWS = products.INT8_ROWS_MAX_ROWS if by_kernel else 0
        products.PREFILL_BY_KERNEL = by_kernel
        try:
            return products.matmul(x, w)
        finally:
            native._tiles, products.INT8_ROWS_MAX_ROWS, products.PREFILL_BY_KERNEL = saved
    return product


def ways(w: dict, n: int, k: int):
    """The three products, each a jitted function: the kernel's and the widened dot's of rows x by the
    weights w, and XLA's int8 dot of the rows' int8 terms by int8 weights of the same shape."""
    kernel, widened = traced(True), traced(False)
    values = jnp.asarray(np.random.default_rng(1).integers(-127, 128, (n, k), dtype=np.int8))

    def xla_int8(terms):
        return lax.dot_general(terms, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return jax.jit(lambda x: kernel(x, w)), jax.jit(lambda x: widened(x, w)), jax.jit(xla_int8)


def row_passes_ms(form: str, name: str, rows: str, rounds: int) -> dict[str, float]:
    """The kernel's ms per row count for one shape, in a process whose kernel has no tiles."""
    command = [sys.executable, __file__, "--form", form, "--kernel-only", name, "--rows", rows, "--rounds",
               str(rounds)]
    done = subprocess.run(command, env={**os.environ, native.TILES_ENV: "0"}, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


def kernel_only(form: str, name: str, rows: str, rounds: int) -> None:
    """Prints {rows: the kernel's ms} for one shape as one JSON line (row_passes_ms's child)."""
    _, n, k = next(shape for shape in SHAPES if shape[0] == name)
    rng = np.random.default_rng(0)
    kernel = ways(held(form, rng, n, k), n, k)[0]
    print(json.dumps({r: timed(kernel, jnp.asarray(rng.standard_normal((int(r), k)).astype(np.float32)),
                               rounds=rounds) for r in rows.split(",")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--form", default="int8", choices=sorted(products.TILE_KINDS - {"int8_packed"}))
    parser.add_argument("--rows", default="64,512", help="rows per chunk, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kernel-only", metavar="SHAPE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not native.available():
        sys.exit("the native kernel does not run on this CPU")
    if args.kernel_only:
        return kernel_only(args.form, args.kernel_only, args.rows, args.rounds)
    print(f"{args.form} weights, tier {native.tier()}, AMX {'yes' if cpu.has_amx() else 'no'}, kernel on tiles: "
          f"{'yes' if native.tiles() else 'no (its row passes)'}")
    terms_per_row = products.ROW_TERMS if args.form == "int8" else 1
    tiled = native.tiles()
    print(f"{'shape':14} {'rows':>5} {'kernel ms':>10} {'int8 TOPS':>10} {'XLA int8 ms':>12} "
          f"{'x XLA int8':>10} {'widened ms':>11} {'x widened':>10}" + (f" {'x row passes':>13}" if tiled else ""))
    rng = np.random.default_rng(0)
    for name, n, k in SHAPES:
        if not fits(args.form, k):
            print(f"{name:14} (K = {k} is not whole {args.form} blocks)")
            continue
        w = jax.tree_util.tree_map(jnp.asarray, held(args.form, rng, n, k))
        kernel, widened, xla_int8 = ways(w, n, k)
        passes = row_passes_ms(args.form, name, args.rows, args.rounds) if tiled else {}
        for rows in map(int, args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
            terms, _ = products.int8_terms(x, terms_per_row)
            ms = timed(kernel, x, rounds=args.rounds)
            ms_int8 = timed(xla_int8, terms, rounds=args.rounds)
            ms_wide = timed(widened, x, rounds=args.rounds)
            tops = 2 * terms_per_row * rows * n * k / ms / 1e9
            print(f"{name:14} {rows:5d} {ms:10.2f} {tops:10.2f} {ms_int8:12.2f} {ms_int8 / ms:10.2f} "
                  f"{ms_wide:11.2f} {ms_wide / ms:10.2f}"
                  + (f" {passes[str(rows)] / ms:13.2f}" if tiled else ""), flush=True)
        del w


if __name__ == "__main__":
    main()
