"""Weight-only int8 against float32 on XLA:CPU, on Qwen2.5-0.5B's shapes (run by hand).

    python tests/bench/bench_narrow.py products         # formulations, random weights
    python tests/bench/bench_narrow.py kl [FOLDER]      # int8 weights/KV vs float32
    python tests/bench/bench_narrow.py forward [FOLDER]
    python tests/bench/bench_narrow.py kv [FOLDER]      # decode at 512 / 8k positions: KV float16 vs int8
    python tests/bench/bench_narrow.py gguf [FOLDER]    # GGUF blocks -> int8 per channel: the error
    python tests/bench/bench_narrow.py blocks           # the kernel's block forms against its int8
    python tests/bench/bench_narrow.py blocks-27b       # Qwen3.8-27B's GGUF forms against Q4_K
    python tests/bench/bench_narrow.py fp8              # FP8 blocks -> int8 per channel: the error
    python tests/bench/bench_narrow.py fp8-kl [FOLDER]  # an FP8 checkpoint held as int8 vs float32

products: the 24 layers' matrix products (fused qkv, o, fused gate_up, down; no attention or head),
chained as the model runs them, per forward, at 1, 4, 8 rows and a 512-row prefill chunk, for each
formulation of the product. Prints ms per forward (best of REPEATS) and the load average.

forward: the demo's whole decode forward (1 and 4 rows, 1k-position cache), float32 against int8
weights (XLA's products; int8 with a float32 head; int8 packed for engine.native's kernel where it
runs), run in turn in one process, best of 20 each, in ms; then a 512-token prefill chunk from
position 0 and 4096, float32 against int8, medians of 4 alternated, in tokens/s.

kv: the demo's decode forward with int8 weights (packed for the native kernel where it runs) at 1
and 4 rows, each row 512 or 8192 positions deep, with a float16 cache (XLA's attention) against an
int8 cache (the kernel's attention where it runs, else XLA's integer one), the same two caches
without the kernel (XLA's int8 products and attention: MASHBOX_NATIVE=0's path), and where the
kernel runs the float16 cache with the GGUF's K-quant matrices rounded to int8 (not kept in their
blocks); in turn, best of 12 each, in ms; then a 512-token prefill chunk from position 0 and 4096,
medians of 4, in tokens/s. First the weights' bytes a decode step reads, both ways.

gguf: each tensor the int8 weights dtype narrows (engine.weights.quantized_tensor), as the loader
does it: dequantized from its GGUF blocks (engine.checkpoint), then int8 with one scale per output
channel (engine.weights.quantize_int8). Prints, per GGUF block type, the tensors, their weights and
the relative RMS error of the int8 values against the dequantized ones (sqrt(sum err^2 / sum w^2)).
(Where the native kernel runs, matrices wholly of Q5_0, of Q4_K, of Q5_K or of Q6_K blocks keep them
instead: no error.)

blocks: one matrix (the demo's down projection, 896 x 4864, and a Qwen3-8B-sized 4096 x 4096) held
each way the native kernel takes it (int8 per channel, packed; Q5_0; Q8_0; Q4_K; Q5_K; Q6_K; IQ4_NL;
IQ4_XS; IQ3_S; Q3_K; random blocks), its product at 1, 4, 16 and 64 rows (the kernel) and 512 rows
(widened, then XLA's dot), in turn, best of REPEATS; prints ms per product and the bits held per
weight (beside the file's). blocks-27b: the same for Qwen3.8-27B's down projection (5120 x 17408) in
the forms its GGUFs mix (Q4_K, IQ4_NL, IQ4_XS, IQ3_S, Q3_K), at 1, 4, 16 and 64 rows.

fp8-kl: an FP8 checkpoint in Qwen's official layout made from a model's float weights (the demo's,
dequantized from its GGUF; and the tiny Qwen3 fixture), read by engine.checkpoint and held as float32
(the FP8 values exactly) and as int8 per channel (a CPU's `auto`), both with a float32 KV cache: the
mean KL of the next-token distributions (FP8 in float32 || FP8 as int8) on a fixed text, and, for
scale, the original float weights against each and against their own int8.

kl: the demo model with float32 weights and a float32 KV cache against narrower ones (KL_CONFIGS:
int8 weights, an int8 cache, both), a fixed ~2k-token text through each in 512-token chunks (or
`kl FOLDER 64`: chunks small enough for the native kernel's products; 512 takes the widened ones); prints
the mean KL divergence of the next-token distributions (float32 || narrow), the largest one, and how
often the greedy token agrees. Bound: KL_BOUND nats, on int8 weights with an int8 cache.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's engine, not an installed one

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HIDDEN, INTERMEDIATE, LAYERS = 896, 4864, 24
QKV = HIDDEN + 2 * 128
ROWS = (1, 4, 8, 32, 128, 512)
REPEATS = 9
KL_BOUND = 0.01
F32 = jnp.float32


def _dot(x, w):
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _summed(x, w):
    return jnp.sum(w * x[:, None, :], axis=-1)


def _engine(x, w):
    """The engine's own product (engine.products.matmul) on int8 weights held offset as uint8 (w[5]): at
    up to 128 rows the weights first times each row as two int8 terms (YNNPACK's integer dot), past
    that a bfloat16 dot."""
    from engine.products import matmul
    return matmul(x, {"q": w[5], "scale": w[1]})


def _kernel(x, w):
    """The engine's product with engine.native's kernel (AVX-512 VNNI): the same two int8 terms per
    row times the packed offset weights (w[6]); past INT8_ROWS_MAX_ROWS its widened weights in a
    bfloat16 dot."""
    from engine.products import matmul
    return matmul(x, {"q": w[6], "scale": w[1]})


def _rows_first(x, w, uint8_dot=True):
    """The engine's product on int8 weights held as int8 (CPUs without uint8 kernels): each row as two
    int8 terms first, times the weights; the terms shifted to uint8 with a row of ones (uint8_dot) or
    kept signed (int8 x int8: YNNPACK's plain AVX-512 kernels): engine.products.UINT8_DOT while tracing."""
    from engine import products
    kept, products.UINT8_DOT = products.UINT8_DOT, uint8_dot
    try:
        return products.matmul(x, {"q": w[0], "scale": w[1]})
    finally:
        products.UINT8_DOT = kept


def _int4_engine(x, w):
    """int4 weights (w[3], jnp.int4, one scale per output channel) widened to int8 inside the program,
    then the engine's two-term integer product. XLA:CPU 0.10 routes no int4 operand to YNNPACK, so
    the widening runs as a separate XLA loop over the whole matrix."""
    from engine.products import int8_terms, int8_terms_product
    return int8_terms_product(*int8_terms(x, 2), 2, w[3].astype(jnp.int8), (((1,), (1,)), ((), ()))) * w[4]


def _int8_one_term(x, w, pad=2):
    """Rows quantized to int8 once (one scale per row), padded to `pad` rows, int8 x int8 -> int32."""
    from engine.products import quantize_rows
    xq, xs = quantize_rows(jnp.pad(x, ((0, max(0, pad - x.shape[0])), (0, 0))))
    y = lax.dot_general(xq, w[0], (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return (y.astype(F32) * xs)[:x.shape[0]] * w[1]


# Each formulation: (x [rows, in] float32, weight) -> [rows, out] float32. int8 weights are the tuple
# (q, scale, q transposed, int4 q, int4 scale, q offset as uint8, that packed for engine.native) of
# _layers.
FORMS = {
    "f32 dot": lambda x, w: _dot(x, w),
    "f32 summed": lambda x, w: _summed(x, w),
    "i8 dot(convert w)": lambda x, w: _dot(x, w[0].astype(F32)) * w[1],
    "i8 dot(bf16)": lambda x, w: _dot(x.astype(jnp.bfloat16), w[0].astype(jnp.bfloat16)) * w[1],
    "i8 engine (2 terms)": _engine,
    "i8 kernel (2 terms)": _kernel,
    "i8 rows first, uint8": _rows_first,
    "i8 rows first, signed": lambda x, w: _rows_first(x, w, uint8_dot=False),
    "i4 widened, engine": _int4_engine,
    "i8 rows x i8, 1 term": _int8_one_term,
    "i8 rows x i8, unpadded": lambda x, w: _int8_one_term(x, w, pad=1),
    "i8 summed": lambda x, w: _summed(x, w[0].astype(F32)) * w[1],
    "i8 summed, scale in": lambda x, w: _summed(x, w[0].astype(F32) * w[1][:, None]),
    # the int8 weight stored transposed, [in, out]: the reduction runs across rows of it
    "i8T summed": lambda x, w: jnp.sum(w[2].astype(F32) * x[:, :, None], axis=1) * w[1],
    "i8T pad2 summed": lambda x, w: (jnp.sum(w[2].astype(F32) * jnp.pad(x, ((0, 1), (0, 0)))[:, :, None],
                                             axis=1) * w[1])[:1],
    "i8 pad2 summed": lambda x, w: _summed(jnp.pad(x, ((0, 1), (0, 0))), w[0].astype(F32))[:1] * w[1],
    "i8 pad4 summed": lambda x, w: _summed(jnp.pad(x, ((0, 3), (0, 0))), w[0].astype(F32))[:1] * w[1],
}
# Which formulations to time at which row counts (the summed forms are far too slow at 512 rows).
PLAN = {
    1: ["f32 dot", "i8 engine (2 terms)", "i8 kernel (2 terms)", "i8 rows first, uint8",
        "i8 rows first, signed", "i4 widened, engine", "i8 rows x i8, 1 term", "i8 rows x i8, unpadded",
        "i8 dot(convert w)", "i8 pad2 summed"],
    4: ["f32 dot", "f32 summed", "i8 engine (2 terms)", "i8 kernel (2 terms)", "i8 rows first, uint8",
        "i8 rows first, signed", "i4 widened, engine", "i8 rows x i8, 1 term", "i8 summed"],
    8: ["f32 summed", "i8 engine (2 terms)", "i8 kernel (2 terms)", "i8 rows first, uint8",
        "i8 rows first, signed", "i8 summed"],
    32: ["f32 summed", "i8 engine (2 terms)", "i8 kernel (2 terms)", "i8 rows first, uint8", "i8 dot(bf16)"],
    128: ["f32 summed", "i8 engine (2 terms)", "i8 kernel (2 terms)", "i8 rows first, uint8", "i8 dot(bf16)"],
    512: ["f32 dot", "i8 engine (2 terms)", "i8 kernel (2 terms)", "i8 rows x i8, 1 term", "i8 dot(bf16)"],
}


def _layers(rng, int8: bool):
    from engine import native
    from engine.weights import offset_int8
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
              "down": (HIDDEN, INTERMEDIATE)}
    out = []
    for _ in range(LAYERS):
        layer = {}
        for name, shape in shapes.items():
            w = rng.standard_normal(shape, dtype=np.float32) * 0.02
            if int8:
                scale = np.abs(w).max(axis=1) / 127
                q = np.rint(w / scale[:, None]).astype(np.int8)
                scale4 = scale * 127 / 7                         # int4: -7..7 per output channel
                q4 = jnp.asarray(np.rint(w / scale4[:, None]).astype(np.int8)).astype(jnp.int4)
                layer[name] = (jnp.asarray(q), jnp.asarray(scale), jnp.asarray(np.ascontiguousarray(q.T)),
                               q4, jnp.asarray(scale4), jnp.asarray(offset_int8(q)),
                               jnp.asarray(native.pack(offset_int8(q))))
            else:
                layer[name] = jnp.asarray(w)
        out.append(layer)
    return out


def _forward(form):
    product = FORMS[form]

    def run(layers, x):
        for layer in layers:
            h = product(x, layer["qkv"])[:, :HIDDEN]
            x = x + product(h, layer["o"])
            gate, up = jnp.split(product(x, layer["gate_up"]), 2, axis=-1)
            x = x + product(jax.nn.silu(gate) * up, layer["down"]) * 0.01
        return x
    return jax.jit(run)


def products(only=None) -> None:
    from engine import native
    rng = np.random.default_rng(0)
    weights = {"f32": _layers(rng, False), "i8": _layers(rng, True)}
    print(f"# {LAYERS} layers of Qwen2.5-0.5B products, ms per forward (best of {REPEATS}); "
          f"jax {jax.__version__}")
    print("# load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    for rows in ROWS:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), dtype=np.float32))
        if only and rows not in only[0]:
            continue
        for form in (only[1] if only else PLAN[rows]):
            if "kernel" in form and not native.available():
                continue
            fn = _forward(form)
            layers = weights["f32" if form.startswith("f32") else "i8"]
            fn(layers, x).block_until_ready()
            times = []
            for _ in range(REPEATS if rows < 512 else 2):
                t0 = time.perf_counter()
                fn(layers, x).block_until_ready()
                times.append(time.perf_counter() - t0)
            best = min(times) * 1e3
            print(f"rows {rows:4d}  {form:22s} {best:9.1f} ms" +
                  (f"  ({rows / min(times):.0f} tok/s)" if rows == 512 else ""), flush=True)
    print("# load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


def _text_tokens(folder: str, n: int) -> np.ndarray:
    """A fixed text of n tokens: this project's engine sources, as the tokenizer reads them (a
    mix of code and English prose, the demo's use)."""
    from tokenizers import Tokenizer
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    text = ""
    for name in ("model.py", "weights.py", "memory.py"):
        with open(os.path.join(root, "engine", name), encoding="utf-8") as f:
            text += f.read()
    ids = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).encode(text).ids
    return np.asarray(ids[:n], np.int32)


# (weights, KV cache) dtypes kl compares with float32 weights and a float32 cache; the last is what a
# CPU with int8 dot products serves by default, and KL_BOUND applies to it.
# "int8/rounded": int8 weights with every GGUF K-quant matrix rounded again to int8 per channel (as
# before Q4_K and Q6_K blocks were kept), beside "int8" (kept where the native kernel serves).
KL_CONFIGS = (("int8", "float16"), ("int8/rounded", "float16"), ("float32", "int8"), ("int8", "int8"))


def _k_rounded(folder: str, cfg):
    """int8 weights (packed where the kernel runs) with every K-quant matrix rounded again to int8 per
    channel, as the loader held them before it kept Q4_K and Q6_K blocks."""
    from engine import native
    from engine.weights import load_weights
    kept = native.K_SUB
    native.K_SUB = {}                                  # the loader's K-quant branch never matches
    try:
        return load_weights(folder, cfg, "int8")
    finally:
        native.K_SUB = kept


def read_per_token(params) -> int:
    """Bytes a decode step reads of the weights: every layer and the head (the embedding's rows are
    a few)."""
    leaves = {id(x): x for x in jax.tree_util.tree_leaves([params["layers"], params["lm_head"]])}
    return sum(x.nbytes for x in leaves.values())


def kl(folder: str, tokens: int = 2048, chunk: int = 512) -> None:
    from engine.cache import init_cache
    from engine.config import load_config
    from engine.model import jit_forward
    from engine.weights import load_weights

    cfg = load_config(folder)
    ids = _text_tokens(folder, tokens)
    params = {}

    def log_probs(weights: str, kv: str) -> np.ndarray:
        if weights not in params:
            params[weights] = (_k_rounded(folder, cfg) if weights.endswith("/rounded")
                               else load_weights(folder, cfg, weights))
        cache = init_cache(cfg, 1, len(ids), np.dtype(kv))
        outs = []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk][None]
            out, cache = jit_forward(params[weights], cache, part, np.zeros(1, np.int32),
                                     np.array([start], np.int32), np.array([part.shape[1]], np.int32),
                                     cfg=cfg, all_logits=True)
            outs.append(np.asarray(jax.nn.log_softmax(out[0], axis=-1)))
        return np.concatenate(outs)

    p = log_probs("float32", "float32")
    print(f"# {len(ids)} tokens of engine/*.py through {folder}, {chunk}-token chunks, against float32 "
          f"weights and a float32 KV cache")
    for weights, kv in KL_CONFIGS:
        q = log_probs(weights, kv)
        per_token = np.sum(np.exp(p) * (p - q), axis=-1)
        agree = float(np.mean(p.argmax(-1) == q.argmax(-1)))
        print(f"{weights} weights, {kv} KV: mean KL {per_token.mean():.5f} nats, max {per_token.max():.4f}, "
              f"greedy agreement {agree:.4f}", flush=True)
    print(f"bound on the last: {KL_BOUND}")
    if per_token.mean() >= KL_BOUND:
        sys.exit(f"mean KL {per_token.mean():.5f} is over the bound {KL_BOUND}")


def forward(folder: str) -> None:
    from engine import model
    from engine.cache import init_cache
    from engine.config import load_config
    from engine.weights import load_weights

    cfg = load_config(folder)
    print("# load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    f32 = load_weights(folder, cfg, jnp.float32)
    i8 = load_weights(folder, cfg, "int8", pack=False)
    weights = {"float32": f32, "int8": i8, "int8, float32 head": dict(i8, lm_head=f32["lm_head"]),
               "int8, kernel": load_weights(folder, cfg, "int8")}    # packed where it runs

    def alternated(rows, n=20):
        """Best (min) ms per forward of each weights set, the sets run in turn n times: on a shared
        machine a load that comes and goes then hits every set alike."""
        caches = {name: init_cache(cfg, 4, 1024, np.float16) for name in weights}
        args = (np.zeros((rows, 1), np.int32), np.arange(rows, dtype=np.int32),
                np.full(rows, 100, np.int32), np.ones(rows, np.int32))
        times = {name: [] for name in weights}
        for i in range(n + 1):
            for name, params in weights.items():
                t0 = time.perf_counter()
                out, caches[name] = model.jit_forward(params, caches[name], *args, cfg=cfg)
                out.block_until_ready()
                if i:                                   # the first call compiles
                    times[name].append(time.perf_counter() - t0)
        return {name: min(t) * 1e3 for name, t in times.items()}

    for rows in (1, 4):
        print(f"rows {rows}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in alternated(rows).items()),
              flush=True)
    # A 512-token prefill chunk from the start and from 4096, float32 against int8, medians alternated.
    for start in (0, 4096):
        chunk, times = 512, {"float32": [], "int8": []}
        caches = {name: init_cache(cfg, 1, 8192, np.float16) for name in times}
        args = (np.zeros((1, chunk), np.int32), np.zeros(1, np.int32), np.full(1, start, np.int32),
                np.full(1, chunk, np.int32))
        for i in range(5):
            for name in times:
                t0 = time.perf_counter()
                out, caches[name] = model.jit_forward(weights[name], caches[name], *args, cfg=cfg)
                out.block_until_ready()
                if i:                                   # the first call compiles
                    times[name].append(time.perf_counter() - t0)
        print(f"prefill {chunk} tokens from {start}: " + ", ".join(
            f"{name} {chunk / np.median(t):.0f} tok/s" for name, t in times.items()), flush=True)
    print("# load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


def kv_dtypes(folder: str) -> None:
    from engine import model, native
    from engine.cache import init_cache
    from engine.config import load_config
    from engine.weights import load_weights

    cfg = load_config(folder)
    print("# load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"# native kernel: {native.tier() if native.available() else 'none'}", flush=True)
    kernel = dataclasses.replace(cfg, native=native.serves(1))
    packed, plain = load_weights(folder, cfg, "int8", pack=kernel.native), load_weights(folder, cfg, "int8", pack=False)
    sets = {"float16 KV": (packed, np.float16, kernel), "int8 KV": (packed, np.int8, kernel),
            "XLA, float16 KV": (plain, np.float16, cfg), "XLA, int8 KV": (plain, np.int8, cfg)}
    if kernel.native:                                  # the K-quant blocks against int8 in their place
        sets["float16 KV, K rounded"] = (_k_rounded(folder, cfg), np.float16, kernel)
    read = {"held": packed, "K rounded": sets.get("float16 KV, K rounded", (plain,))[0]}
    print("# weights read per decode step: " + ", ".join(f"{name} {read_per_token(p) / 1e9:.3f} GB"
                                                         for name, p in read.items()), flush=True)
    for depth in (512, 8192):
        for rows in (1, 4):
            caches = {name: init_cache(c, rows, depth + 64, kv) for name, (_, kv, c) in sets.items()}
            args = (np.zeros((rows, 1), np.int32), np.arange(rows, dtype=np.int32),
                    np.full(rows, depth, np.int32), np.ones(rows, np.int32))
            times = {name: [] for name in sets}
            for i in range(13):
                for name, (params, _, c) in sets.items():
                    t0 = time.perf_counter()
                    out, caches[name] = model.jit_forward(params, caches[name], *args, cfg=c)
                    out.block_until_ready()
                    if i:                                   # the first call compiles
                        times[name].append(time.perf_counter() - t0)
            print(f"{rows} row(s) at {depth}: " + ", ".join(f"{name} {min(t) * 1e3:.1f} ms"
                                                          for name, t in times.items()), flush=True)
    for start in (0, 4096):              # a 512-token prefill chunk, medians of 4
        chunk = 512
        caches = {name: init_cache(c, 1, 8192, kv) for name, (_, kv, c) in sets.items()}
        args = (np.zeros((1, chunk), np.int32), np.zeros(1, np.int32), np.full(1, start, np.int32),
                np.full(1, chunk, np.int32))
        times = {name: [] for name in sets}
        for i in range(5):
            for name, (params, _, c) in sets.items():
                t0 = time.perf_counter()
                out, caches[name] = model.jit_forward(params, caches[name], *args, cfg=c)
                out.block_until_ready()
                if i:
                    times[name].append(time.perf_counter() - t0)
        print(f"prefill {chunk} tokens from {start}: " + ", ".join(
            f"{name} {chunk / np.median(t):.0f} tok/s" for name, t in times.items()), flush=True)
    print("# load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


# The file's bits per weight of each GGUF block form (its blocks' bytes x 8 / their weights).
FILE_BITS = {"Q5_0": 5.5, "Q8_0": 8.5, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "IQ4_NL": 4.5, "IQ4_XS": 4.25,
             "IQ3_S": 3.4375, "Q3_K": 3.4375}


def _block_form(rng, kind: str, n: int, k: int) -> dict:
    """An [n, k] matrix of random blocks of `kind` in the kernel's form, on the device."""
    from engine import native
    from engine.checkpoint import k_quant_parts, s_block_parts
    from tests.test_native import random_k_blocks, random_s_blocks

    if kind == "int8":
        held = {"q": native.pack(rng.integers(1, 256, (n, k), dtype=np.uint8)), "scale": np.full(n, 0.01, np.float32)}
    elif kind == "Q5_0":
        held = native.pack5(rng.integers(0, 32, (n, k), dtype=np.uint8),
                            (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16))
    elif kind == "Q8_0":
        held = native.pack8(rng.integers(-127, 128, (n, k), dtype=np.int8),
                            (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16))
    elif kind in native.K_SUB:
        held = native.pack_k(kind, **k_quant_parts(kind, random_k_blocks(rng, kind, n, k)))
    else:
        held = native.pack_s(kind, **s_block_parts(kind, random_s_blocks(rng, kind, n, k)))
    return jax.tree_util.tree_map(jnp.asarray, held)


def block_forms(shapes=((896, 4864), (4096, 4096)), kinds=("int8", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
                                                             "IQ4_NL", "IQ4_XS", "IQ3_S", "Q3_K"),
                rows_list=(1, 4, 16, 64, 512)) -> None:
    from engine import native, products as engine_products

    if not native.available():
        sys.exit("blocks: the native kernel does not run here")
    print("# load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"# native kernel: {native.tier()}", flush=True)
    rng = np.random.default_rng(0)
    for n, k in shapes:
        forms = {kind: _block_form(rng, kind, n, k) for kind in kinds}
        held = {name: sum(a.nbytes for a in jax.tree_util.tree_leaves(w)) * 8 / (n * k)
                for name, w in forms.items()}
        print(f"[{n}, {k}] bits held per weight: " + ", ".join(
            f"{name} {b:.4f}" + (f" (file {FILE_BITS[name]})" if name in FILE_BITS else "")
            for name, b in held.items()))
        product = jax.jit(engine_products.matmul)
        for rows in rows_list:
            x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
            times = {name: [] for name in forms}
            for i in range(REPEATS + 1):
                for name, w in forms.items():
                    t0 = time.perf_counter()
                    product(x, w).block_until_ready()
                    if i:                                       # the first call compiles
                        times[name].append(time.perf_counter() - t0)
            print(f"  {rows:3d} rows: " + ", ".join(f"{name} {min(t) * 1e3:.2f} ms" for name, t in times.items()),
                  flush=True)
        del forms
    print("# load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


def gguf_conversion(folder: str) -> None:
    from engine.checkpoint import Checkpoint
    from engine.weights import quantize_int8, quantized_tensor

    ck = Checkpoint(folder)
    if ck.kind != "gguf":
        sys.exit(f"{folder} holds no GGUF")
    totals: dict[str, list] = {}
    for name in sorted(ck.shapes):
        if not quantized_tensor(name):
            continue
        w = ck.get(name)
        q, scale = quantize_int8(w)
        err = w - q.astype(np.float32) * scale[:, None]
        t = totals.setdefault(ck.formats[name], [0, 0, 0.0, 0.0])
        t[0] += 1
        t[1] += w.size
        t[2] += float(np.sum(np.square(err, dtype=np.float64)))
        t[3] += float(np.sum(np.square(w, dtype=np.float64)))
    print(f"# {ck.file}: {ck.bits_per_weight} bits per weight")
    print("| GGUF type | tensors | weights | int8 per channel: relative RMS error |")
    print("|---|---|---|---|")
    for kind, (n, size, e2, w2) in sorted(totals.items()):
        print(f"| {kind} | {n} | {size:,} | {np.sqrt(e2 / w2):.4f} |")
    n, size, e2, w2 = (sum(t[i] for t in totals.values()) for i in range(4))
    print(f"| all | {n} | {size:,} | {np.sqrt(e2 / w2):.4f} |")


def fp8_conversion() -> None:
    """FP8 weights (Qwen's layout: e4m3, a scale per 128 x 128 block) held as int8 per channel: the
    relative error of each step, on random weights with a few outlier input channels."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from engine.weights import quantize_int8
    from tests.test_fp8 import _dequantize, _quantize

    rng = np.random.default_rng(0)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    print("| shape | FP8 vs float | int8 of the FP8 values vs FP8 | int8 of FP8 vs float | int8 of float vs float |")
    for shape in ((1024, 4096), (4096, 1024)):
        w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        w[:, rng.integers(0, shape[1], 8)] *= 8
        fp8 = _dequantize(*_quantize(w, (128, 128)), (128, 128))
        values, scale = quantize_int8(fp8)
        held = values.astype(np.float32) * scale[:, None]
        values, scale = quantize_int8(w)
        direct = values.astype(np.float32) * scale[:, None]
        print(f"| {shape[0]} x {shape[1]} | {rel(fp8, w):.4f} | {rel(held, fp8):.4f} | {rel(held, w):.4f} "
              f"| {rel(direct, w):.4f} |")


def _fp8_folder(src: str, out: Path, block=(128, 128)) -> Path:
    """An FP8 checkpoint (tests/test_fp8.py's layout) of the model in `src`: every layer projection
    matrix float8_e4m3fn with its block scales, the rest (norms, biases, embeddings, head) float32."""
    import json
    import shutil
    from engine.checkpoint import Checkpoint
    from tests.test_fp8 import PROJECTIONS, _quantize, _write_safetensors

    ck = Checkpoint(src)
    tensors = {}
    for name in sorted(ck.shapes):
        w = np.asarray(ck.get(name), np.float32)
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS and w.ndim == 2:
            tensors[name], tensors[name + "_scale_inv"] = _quantize(w, block)
        else:
            tensors[name] = w
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors(out / "model.safetensors", tensors)
    config = json.loads(Path(src, "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))
    if Path(src, "tokenizer.json").exists():
        shutil.copy(Path(src, "tokenizer.json"), out / "tokenizer.json")
    return out


def _log_probs(folder: str, weights: str, ids: np.ndarray, chunk: int) -> np.ndarray:
    """log softmax of the next-token logits at every position of ids, weights held as `weights`
    (float32 KV cache), the text run in `chunk`-token prefill chunks."""
    from engine.cache import init_cache
    from engine.config import load_config
    from engine.model import jit_forward
    from engine.weights import load_weights

    cfg = load_config(folder)
    params = load_weights(folder, cfg, weights, pack=False)
    cache = init_cache(cfg, 1, len(ids), np.dtype("float32"))
    outs = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk][None]
        out, cache = jit_forward(params, cache, part, np.zeros(1, np.int32), np.array([start], np.int32),
                                 np.array([part.shape[1]], np.int32), cfg=cfg, all_logits=True)
        outs.append(np.asarray(jax.nn.log_softmax(out[0], axis=-1)))
    return np.concatenate(outs)


def fp8_kl(folder: str, tokens: int = 1024, chunk: int = 512) -> None:
    import tempfile
    from safetensors.numpy import load_file

    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3"
    with tempfile.TemporaryDirectory() as tmp:
        for src, ids in ((str(tiny), load_file(str(tiny / "reference.safetensors"))["tokens"].astype(np.int32)),
                         (folder, _text_tokens(folder, tokens))):
            t0 = time.time()
            fp8 = str(_fp8_folder(src, Path(tmp) / Path(src).name))
            runs = {"float": ("float32", src), "float as int8": ("int8", src),
                    "FP8 in float32": ("float32", fp8), "FP8 as int8": ("int8", fp8)}
            p = {name: _log_probs(where, weights, ids, chunk) for name, (weights, where) in runs.items()}
            print(f"# {src}: {len(ids)} tokens, {chunk}-token chunks, float32 KV cache "
                  f"({time.time() - t0:.0f} s)")
            print("| reference | held as | mean KL (nats) | max KL | greedy agreement |")
            print("|---|---|---|---|---|")
            for ref, narrow in (("FP8 in float32", "FP8 as int8"), ("float", "FP8 in float32"),
                                ("float", "FP8 as int8"), ("float", "float as int8")):
                per_token = np.sum(np.exp(p[ref]) * (p[ref] - p[narrow]), axis=-1)
                agree = float(np.mean(p[ref].argmax(-1) == p[narrow].argmax(-1)))
                print(f"| {ref} | {narrow} | {per_token.mean():.5f} | {per_token.max():.4f} | {agree:.4f} |",
                      flush=True)
            del p


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "products"
    if what == "products":
        products()
    elif what == "fp8":
        fp8_conversion()
    elif what == "blocks":
        block_forms()
    elif what == "blocks-27b":                         # Qwen3.8-27B's down projection, the forms its GGUFs mix
        block_forms(((5120, 17408),), ("Q4_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "Q3_K"), (1, 4, 16, 64))
    elif what == "transposed":
        products(((4, 8), ["f32 summed", "i8 summed", "i8T summed"]))
        products(((1,), ["f32 dot", "i8 pad2 summed", "i8T pad2 summed"]))
    elif what in ("kl", "forward", "gguf", "fp8-kl", "kv"):
        folder = sys.argv[2] if len(sys.argv) > 2 else os.path.expanduser(
            "~/.cache/mashbox/models/qwen2.5-coder-0.5b-instruct")
        if what == "kl":
            kl(folder, chunk=int(sys.argv[3]) if len(sys.argv) > 3 else 512)
        elif what == "gguf":
            gguf_conversion(folder)
        elif what == "fp8-kl":
            fp8_kl(folder)
        elif what == "kv":
            kv_dtypes(folder)
        else:
            forward(folder)
    else:
        sys.exit(f"unknown mode {what!r}: products, transposed, forward, kv, blocks, blocks-27b, gguf, fp8, "
                 "fp8-kl or kl")
