"""The forward pass of Qwen2/Qwen3 dense, Qwen3-MoE and Qwen3-Next models: one pure function.

    forward(params, cache, tokens, slots, starts, lengths, *, cfg, all_logits=False)
        -> (logits, cache)

One function serves both phases of generation:
    prefill  a chunk of one prompt:   tokens [1, T] (T a bucket), lengths = [real tokens in the chunk]
    decode   one token for each slot: tokens [B, 1], lengths 1 for live rows and 0 for idle ones
Row b writes its keys/values at positions starts[b] .. starts[b]+lengths[b]-1 of cache slot
slots[b] and attends to everything before them in that slot. Padded tokens (t >= lengths[b]) write
nothing, so an idle row (lengths 0) leaves the cache exactly as it was.

A Gated DeltaNet ("linear") layer keeps, per slot, a conv state and a recurrent state that hold its
sequence up to its end (engine.cache): row b continues slot slots[b]'s state from starts[b], or
starts from zero when starts[b] is 0, and a row with no tokens leaves it as it was.

Attention reads each slot only up to the batch's live length, max(starts + lengths), a run-time
value (_attend loops over ATTENTION_BLOCK positions at a time): the cost follows the live context,
not ctx, and one compiled program per (rows, tokens) shape serves every context length.

Numerics: the residual stream, norms, RoPE and softmax are float32; matrix products take the
weights in their own dtype and accumulate in float32 (bfloat16 weights on accelerators).

The one side effect: tracing a routed-expert layer records which path it was given (ROUTED_SITES),
so the worker can report what its compiled programs run (routed_report), not what it meant to.
"""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo
from jax.sharding import AbstractMesh, PartitionSpec

from engine import cpu, native
from engine.config import ROUTED_PATHS, ModelConfig
from engine.sharding import MODEL_AXIS
from engine.weights import INT8_OFFSET

F32 = jnp.float32


def _kv_compute_dtype(kv_dtype):
    """The dtype attention multiplies float cached keys/values in: float16 (a CPU's storage dtype
    without int8 dot products, see kv_dtype_for) is widened to float32, which XLA:CPU converts at
    full speed; other dtypes are used as they are (bfloat16 on accelerators, float32). An int8 cache
    is read by _attend's integer products or widened there."""
    return F32 if kv_dtype == jnp.float16 else kv_dtype


def dtype_for(platform: str):
    """Weights dtype for a JAX platform ("cpu", "gpu", "tpu", ...). XLA:CPU runs bfloat16
    matrix-vector products about 20x slower than float32 at one row, so the CPU computes in float32."""
    return jnp.float32 if platform == "cpu" else jnp.bfloat16


def weights_dtype_for(platform: str, asked: str | None = "auto") -> str:
    """The weights dtype a worker holds (engine.weights.WEIGHTS_DTYPES): the one asked for, or for
    "auto" (or None) what is fastest on the platform: on a CPU with int8 dot-product instructions
    int8 (a quarter of the bytes, and faster: see _matmul's measurement), on other CPUs float32
    (engine.cpu.auto_weights_dtype), on accelerators bfloat16."""
    if asked in (None, "auto"):
        return cpu.auto_weights_dtype() if platform == "cpu" else np.dtype(dtype_for(platform)).name
    return asked


def kv_dtype_for(platform: str):
    """KV cache dtype for a JAX platform: the narrowest one attention does not run slower with.
    On XLA:CPU (2-core AMD EPYC, avx512_vnni): bfloat16 ran attention 3-5x slower than float32
    (XLA:CPU converts it slowly), float16 widened to float32 as fast as float32 with half the bytes,
    and int8 with integer products (QUERY_TERMS) faster still where the CPU has int8 dot products
    (engine.cpu.auto_kv_dtype): the demo's whole decode step with int8 weights, one row, medians of
    12 alternated in one process, three runs at load 1.2-1.7: at 16k positions 62-80 ms against
    float16's 89-95, at 1k 40-47 against 51-53; a 512-token prefill chunk as fast (450 / 460 tok/s
    from position 0, 133 / 131 from 7680). Accuracy: bench_narrow.py kl. Accelerators keep bfloat16."""
    return jnp.dtype(cpu.auto_kv_dtype()) if platform == "cpu" else jnp.bfloat16


# ---- building blocks ---------------------------------------------------------------------------

# XLA:CPU multiplies a few rows by a weight matrix well below the memory bandwidth: its small-row
# dot ran 4 rows at about 2x the cost of one row. The same product written as a broadcast multiply
# summed over the input dimension (XLA hands it to YNNPACK as one fused reduction) streams the
# weights once: 4 rows at 1.0-1.3x the cost of one row (Qwen2.5-0.5B float32, 2 cores). One row
# keeps the dot, a matrix-vector product already at the bandwidth (the summed form is far slower
# there). Past this many rows compute dominates and the dot wins again: a 512-token prefill chunk
# ran 1.3x faster as a dot, while 32- and 128-token chunks ran 1.2-1.4x faster summed.
SUMMED_PRODUCT_MAX_ROWS = 128

# int8 matrices (weights_dtype "int8") are {"q": [..., out, in], "scale": float32 [..., out]}: int8
# values q, held as uint8 plus INT8_OFFSET where the CPU has unsigned x signed int8 kernels (VNNI:
# engine.weights.OFFSET_INT8), else as int8; w = q * scale, one scale per output channel, applied to
# the product's output. XLA:CPU has no fast product of float rows with int8 weights (every
# convert-then-multiply form ran at or below float32's speed), but it hands an integer dot of at
# least 2 rows to YNNPACK. So a decode step quantizes each row of activations to int8 on the fly
# (one scale per row: its largest magnitude / 127) and multiplies integers. One int8 term per row
# cost accuracy: mean KL 0.0096 nats from float32 on the demo, 94.8% greedy agreement. So each row
# is two terms, the row and its rounding error on a 127x finer scale, stacked as rows of one
# product: KL 0.0017 and 97.9%, as with exact activations.
# Weights held offset are the product's first operand (_offset_weights_product): YNNPACK then
# streams them as they are held and packs only the few rows of terms. Held as int8 they are the
# second operand (_int8_product: the rows first, shifted to uint8 where the kernels exist), and
# YNNPACK repacks the whole matrix on every call.
# tests/bench/bench_narrow.py products, 24 layers of Qwen2.5-0.5B's products, 2-core AMD EPYC
# (avx512_vnni, avx512_bf16, no AMX), best of 9, ms per forward, load 1.4-1.9:
#   rows   weights first (held offset)   rows first, uint8 rows   rows first, signed   float32
#   1      14.2                           17.2                     18.3                 36.6 (dot)
#   4      23.5                           29.5                     27.4                 48.9 (summed)
#   8      24.1                           26.9                     35.3                 54.4
#   32     69.7                           51.7                                          86.8
#   128    218.6                          148.3                                         270.0
# On a 2-core AMD EPYC of CPU family 25 (Zen 4, which runs 512-bit instructions in two halves) the
# weights-first products took 28.1 / 31.9 / 42.3 ms at 1 / 4 / 8 rows: one row streams 12.8 GB/s of
# weights where a float32 dot of one row streams 34 GB/s. YNNPACK's integer kernels are compute-bound
# there in either operand order, even with the weights a constant of the program, packed once (13
# GB/s). Tried there and no faster: batches of 16-608 output rows, [in, out] weights in either
# operand, bfloat16 weights (8 G weights/s at best), XLA_FLAGS routing dots to oneDNN or XNNPACK.
# Weights first lose at 32 and 128 rows (small prefill chunks), but rows first there would need the
# weights held a second time as int8: decode, every token, is what they are held for. The demo's
# decode step, the forms alternated in one process: 1 row 22.9 against 27.7 ms, 4 rows 31.5 against
# 35.8. Forms that lost at one row: int8 converted inside a float dot, int8 summed, float16 or
# bfloat16 weights in a dot, an int8 dot of one unpadded row (each slower than float32). A prefill
# chunk (more than INT8_ROWS_MAX_ROWS rows) widens the int8 weights exactly to bfloat16 with float32
# accumulation where the CPU has bfloat16 dot-product instructions (as fast as the integer dot, and
# its rows rounded to 8 bits of mantissa instead of quantized), else float32. Accelerators take the
# dot in bfloat16 at every row count.
# Where the CPU has bfloat16 dot products the bfloat16 dot already wins at 128 rows. The demo's
# prefill chunk, int8 terms against the bfloat16 dot alternated in one process (2-core AMD EPYC, CPU
# family 25, medians of 6-8): 32 tokens 221 against 391 ms, 64 tokens 424 against 487, 128 tokens
# 836 against 669 (from position 2000: 1107 against 889). Without bfloat16 the wide product is a
# float32 dot, no faster than the terms up to 128 rows (above).
# Where engine.native's kernel runs (AVX-512 VNNI, a C++ compiler, one device) the weights are held
# packed for it and the terms' product is its own: weights streamed at the memory's speed instead of
# YNNPACK's compute-bound one. The call makes the rows' two int8 terms and applies the scales itself
# (native.int8_matmul): no XLA loops around it. The 24 layers' products alone (the kernel's integer
# product, when it had a call of its own; random weights, median of 7 alternated in one process,
# 2-core AMD EPYC of CPU family 25), ms per forward:
#   terms (rows)     2 (1)   4 (2)   8 (4)   16 (8)   64 (a 32-token chunk)
#   kernel           14.1    14.7    12.8    35.3     126
#   YNNPACK          26.5    23.8    29.5    43.0     133
# The demo's whole decode step (the product alone, XLA making the terms), medians of 5 alternated in
# one process, 1 / 4 rows: 28.9 / 45.8 ms against 39.8 / 64.5. A prefill chunk's bfloat16 dot takes
# the packed weights widened by the kernel's second pass (native.widen): XLA's transpose of the
# packed layout cost a 512-token chunk 2.35 s against 1.86; widened there, 1.59 against 1.62.
CPU_HAS_BF16 = cpu.has_bf16_dot()
INT8_ROWS_MAX_ROWS = 64 if CPU_HAS_BF16 else SUMMED_PRODUCT_MAX_ROWS


def is_quantized(w) -> bool:
    return isinstance(w, dict)


def _quantize_rows(x):
    """x [rows, in] float32 -> (int8 [rows, in], float32 [rows, 1]): each row rounded to int8 on its own
    scale, so that x ~= q * scale. An all-zero row (padding) gets scale 1 and stays zero."""
    peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def _int8_terms(x, n: int):
    """x [..., rows, c] float32 -> (int8 [..., n * rows, c], scales [..., n * rows, 1]): the rows,
    then (n = 2) what their rounding left, stacked along the rows."""
    terms, scales = [], []
    for _ in range(n):
        q, scale = _quantize_rows(x)
        terms.append(q)
        scales.append(scale)
        x = x - q.astype(F32) * scale
    return jnp.concatenate(terms, axis=-2), jnp.concatenate(scales, axis=-2)


# An unsigned x signed int8 product (the first operand uint8, the second int8) -> int32, as one HLO
# dot. JAX would widen mixed operands to a common type first (int32, whose product XLA:CPU runs ~30x
# slower), so this primitive emits the dot itself: the stored int8 weights times int8 terms
# (_offset_weights_product), and on CPUs with VNNI shifted terms times a cache block (_int8_product).
_uint8_int8_dot_p = jax.extend.core.Primitive("uint8_int8_dot")


def _uint8_int8_dot_shape(x, w, *, dimension_numbers):
    (x_contract, w_contract), (x_batch, w_batch) = dimension_numbers
    free = lambda shape, skip: [n for i, n in enumerate(shape) if i not in skip]
    shape = ([x.shape[i] for i in x_batch] + free(x.shape, x_contract + x_batch)
             + free(w.shape, w_contract + w_batch))
    return jax.core.ShapedArray(tuple(shape), jnp.int32)


def _uint8_int8_dot_lowering(ctx, x, w, *, dimension_numbers):
    (x_contract, w_contract), (x_batch, w_batch) = dimension_numbers
    out = ctx.avals_out[0]
    numbers = stablehlo.DotDimensionNumbers.get(
        lhs_batching_dimensions=list(x_batch), rhs_batching_dimensions=list(w_batch),
        lhs_contracting_dimensions=list(x_contract), rhs_contracting_dimensions=list(w_contract))
    return [stablehlo.dot_general(ir.RankedTensorType.get(out.shape, ir.IntegerType.get_signless(32)),
                                  x, w, numbers)]


_uint8_int8_dot_p.def_abstract_eval(_uint8_int8_dot_shape)
mlir.register_lowering(_uint8_int8_dot_p, _uint8_int8_dot_lowering)

# Whether the integer products take the uint8 x int8 form (_offset_weights_product, _int8_product)
# or, where the CPU has no such kernels (no VNNI), int8 x int8 (read at trace time; tests compare
# both forms).
UINT8_DOT = cpu.has_uint8_dot()


def _int8_product(terms, other, dimension_numbers):
    """terms int8 [..., rows, c] times int8 `other` (lax.dot_general's dimension_numbers, contracting
    terms' last axis, rows its only free axis) -> exact int32 [..., rows, out]. Attention's products
    with the int8 KV cache (the weights' are _offset_weights_product).
    Where the CPU has unsigned x signed int8 kernels (engine.cpu.has_uint8_dot: VNNI) the rows are
    shifted by 128 to uint8, and a row of ones appended to them gives each output's sum over `other`,
    128 times which comes off again: sum((t + 128) w) - 128 sum(w) = sum(t w), exact in int32
    (|sum| <= 255 * 127 * c). YNNPACK runs the uint8 rows on its VNNI kernels, the int8 ones on plain
    AVX-512 ones: int8-held weights' products at 1 / 4 / 8 rows 17.6 / 22.7 / 26.5 ms against
    20.6 / 26.9 / 44.1 signed (the int8 note above); the demo's decode step with 4 rows 34 against
    45 ms. Blocks as the first operand instead (the cache held offset) ran 6x slower: attention's
    products have few positions per block and many rows."""
    if not UINT8_DOT:
        return lax.dot_general(terms, other, dimension_numbers, preferred_element_type=jnp.int32)
    shifted = (terms.astype(jnp.int16) + 128).astype(jnp.uint8)
    ones = jnp.ones(terms.shape[:-2] + (1, terms.shape[-1]), jnp.uint8)
    y = _uint8_int8_dot_p.bind(jnp.concatenate([shifted, ones], axis=-2), other,
                               dimension_numbers=dimension_numbers)
    return y[..., :-1, :] - 128 * y[..., -1:, :]


def _sum_terms(products, scales, n: int):
    """The int32 products of n int8 terms (_int8_terms of x [..., rows, c], stacked along the rows),
    each times its scales, summed: [..., rows, out] float32, x's product."""
    return sum(jnp.split(products.astype(F32) * scales, n, axis=-2))


def _int8_terms_product(terms, scales, n: int, other, dimension_numbers):
    """The sum of n int8 terms (_int8_terms of x [..., rows, c]) times int8 `other`, each term's
    product times its scales: [..., rows, out] float32, x's product with `other`."""
    return _sum_terms(_int8_product(terms, other, dimension_numbers), scales, n)


def int8_values(q):
    """Held int8 weights (int8, or uint8 offset by INT8_OFFSET) -> their signed values (exact)."""
    return q.astype(jnp.int16) - INT8_OFFSET if q.dtype == jnp.uint8 else q


def _offset_weights_product(q, terms):
    """int8 terms [rows, in] times int8 weights held offset (q uint8 [out, in], the values + 128) ->
    exact int32 [rows, out]: the weights as the dot's first operand (see the int8 note above), and
    128 times each term row's sum taken off: sum((w + 128) t) - 128 sum(t) = sum(w t)."""
    if q.dtype != jnp.uint8:
        raise TypeError(f"offset int8 weights are uint8, got {q.dtype}")
    numbers = (((1,), (1,)), ((), ()))
    if not UINT8_DOT:         # no uint8 kernels: the weights' signed values, converted on every call
        return lax.dot_general(terms, int8_values(q).astype(jnp.int8), numbers,
                               preferred_element_type=jnp.int32)
    y = _uint8_int8_dot_p.bind(q, terms, dimension_numbers=numbers)      # [out, rows]
    # Transposed last: with the transpose first, XLA gave the dot a layout YNNPACK does not take, and
    # its own dot emitter has no mixed-type product (a compile error).
    return (y - INT8_OFFSET * jnp.sum(terms.astype(jnp.int32), axis=-1)).T


def _matmul(x, w):
    """x [..., in] times w [out, in] (each output a dot product with a row of w) -> [..., out],
    taking the weights in their own dtype and accumulating in float32. w may be int8 weight-only
    ({"q", "scale"}, see above), its q in engine.native's packed layout, or a GGUF's 5-bit blocks
    (engine.native.pack5)."""
    rows = int(np.prod(x.shape[:-1]))
    if native.is_int5(w):
        # A GGUF's Q5_0 blocks, held as the file has them (engine.native.pack5): the kernel's own
        # product for a few rows, else its values in bfloat16 for XLA's dot (scales applied).
        out_dim, in_dim = w["nib"].shape[0] * native.LANES, w["nib"].shape[1] * native.NIBBLE_GROUP
        flat = x.reshape(rows, in_dim).astype(F32)
        if rows <= INT8_ROWS_MAX_ROWS:
            return native.int5_matmul(flat, w).reshape(*x.shape[:-1], out_dim)
        wide = jnp.bfloat16 if CPU_HAS_BF16 else F32
        y = lax.dot_general(flat.astype(wide), native.widen5(w, after=flat).astype(wide),
                            (((1,), (1,)), ((), ())), preferred_element_type=F32)
        return y.reshape(*x.shape[:-1], out_dim)
    if is_quantized(w):
        q, scale = w["q"], w["scale"]
        packed = native.is_packed(q)
        out_dim, in_dim = (q.shape[0] * native.LANES, q.shape[1] * native.GROUP) if packed else q.shape
        flat = x.reshape(rows, in_dim).astype(F32)
        on_cpu = jax.default_backend() == "cpu"
        if on_cpu and rows <= INT8_ROWS_MAX_ROWS and packed:
            # The kernel makes the terms below, multiplies and scales them in one call.
            return native.int8_matmul(flat, q, scale).reshape(*x.shape[:-1], out_dim)
        if on_cpu and rows <= INT8_ROWS_MAX_ROWS:
            # Two int8 terms per row: the row, then what its rounding left, on a scale 127x finer.
            terms, scales = _int8_terms(flat, 2)
            if q.dtype == jnp.uint8:
                products = _offset_weights_product(q, terms)
            else:
                products = _int8_product(terms, q, (((1,), (1,)), ((), ())))
            y = _sum_terms(products, scales, 2)
        else:
            wide = jnp.bfloat16 if CPU_HAS_BF16 or not on_cpu else F32
            # On a CPU each matrix is widened when its product is next, not all at a program's start
            # (XLA:CPU's scheduler hoists what reads only weights: a 512-token chunk of the demo
            # held every layer's copy, 0.79 GB): the kernel's pass takes the input as an operand it
            # does not read, XLA's convert adds a zero made from it (x * 0 is not folded for floats).
            if packed:
                values = native.widen(q, after=flat)
            elif on_cpu:
                zero = (jnp.where(jnp.isfinite(flat[0, 0]), flat[0, 0], 0.0) * 0.0).astype(wide)
                values = int8_values(q).astype(wide) + zero
            else:
                values = int8_values(q)
            y = lax.dot_general(flat.astype(wide), values.astype(wide), (((1,), (1,)), ((), ())),
                                preferred_element_type=F32)
        return (y * scale).reshape(*x.shape[:-1], out_dim)
    if w.dtype == F32 and 2 <= rows <= SUMMED_PRODUCT_MAX_ROWS:
        flat = x.reshape(rows, 1, w.shape[1]).astype(F32)
        # Weights as the first operand: with the rows first, the same program ran 1.6x slower.
        # Only float32 weights take the summed form: that is the CPU's compute dtype (dtype_for).
        return jnp.sum(w * flat, axis=-1).reshape(*x.shape[:-1], w.shape[0])
    return lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                           preferred_element_type=F32)


def _embed(table, tokens):
    """Rows of the embedding table for tokens, in float32 (an int8 table: its rows times their scales)."""
    if is_quantized(table):
        q = table["q"]
        rows = native.packed_rows(q, tokens) if native.is_packed(q) else q[tokens]
        return int8_values(rows).astype(F32) * table["scale"][tokens][..., None]
    return table[tokens].astype(F32)


def _rms_norm(x, weight, eps):
    x = x.astype(F32)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(F32)


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] and the factor cos/sin are scaled by (1 unless YaRN).
    Computed with numpy from the static config, so they are constants in the compiled program."""
    dim = cfg.rope_dim
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / cfg.rope_theta ** exponents
    if cfg.rope_type == "default":
        return inv_freq.astype(np.float32), 1.0
    # YaRN: keep high-frequency dimensions as trained, interpolate low-frequency ones by `factor`,
    # with a linear ramp between the dimensions that turn beta_fast and beta_slow times over the
    # original context.
    factor = cfg.rope_factor

    def dim_for(rotations):
        return (dim * np.log(cfg.rope_original_max_positions / (rotations * 2 * np.pi))
                / (2 * np.log(cfg.rope_theta)))

    low, high = dim_for(cfg.rope_beta_fast), dim_for(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                     # the ramp's ends met: a step, not a division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp                       # 1 = extrapolate (unchanged), 0 = interpolate
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    attention = cfg.rope_attention_factor
    if attention is None:
        attention = 0.1 * np.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq.astype(np.float32), float(attention)


def _rope_tables(positions, cfg: ModelConfig):
    """(cos, sin), each [B, T, 1, rot/2], of every token's angles (times the YaRN factor): made once
    per forward for all layers. Left as plain cos/sin, XLA:CPU fused them into each of the demo's 48
    rotations and evaluated them there per element, 14 times over for the query heads: those loops
    took 1.03 ms of a 4-row decode step, 0.45 ms with the tables made once (0.43 against 0.21 at one
    row; 2-core AMD EPYC, CPU family 25). The product with the identity (exact: x 1 + 0 + ... = x)
    is what keeps them made once: XLA does not fuse a dot into its consumers, and on CPU it drops
    optimization barriers before fusing."""
    inv_freq, scale = rope_frequencies(cfg)
    angles = positions.astype(F32)[:, :, None, None] * inv_freq          # [B, T, 1, rot/2]
    tables = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1) * scale
    tables = jnp.einsum("btij,jk->btik", tables, jnp.eye(tables.shape[-1], dtype=F32),
                        precision=jax.lax.Precision.HIGHEST)
    return tuple(jnp.split(tables, 2, axis=-1))


def _rope(x, rope):
    """Rotate x [B, T, H, D] by each token's position, given as _rope_tables (halves layout, as
    Qwen checkpoints). Only the first `rot` dimensions turn (Qwen3-Next's partial rotary)."""
    cos, sin = rope
    rot = 2 * cos.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


# ---- attention over the live part of the cache -------------------------------------------------

# Attention reads each slot in blocks of this many positions, in a loop whose trip count is the
# batch's live length (a run-time value), so one compiled program serves every context length and a
# step costs what the live context costs, not what ctx costs. On a 2-core CPU (Qwen2.5-0.5B, one
# decode row at 16k positions) 512 ran as fast as or faster than 1024, 2048 and 8192; a short
# context pays for at most one block past its length.
ATTENTION_BLOCK = 512

# The int8 cache (kv_dtype_for): each position's key and value of a KV head are rounded to int8 on
# their own scale (largest magnitude / 127, kept beside them as float32). A decode step multiplies
# integers, as _matmul does with int8 weights: the queries become int8 terms (the rows, then their
# rounding error on a 127x finer scale: QUERY_TERMS) and one int8 x int8 -> int32 product per block
# reads the int8 keys; the probabilities times the values' scales, never negative, become one
# unsigned 8-bit term per row (_probs_product) and one product reads the int8 values.
# XLA:CPU runs those on YNNPACK's integer kernels, while float keys and values widened to float32
# keep attention compute-bound (a group of 7 query heads per KV head is a thin product). Past
# INT8_ATTENTION_MAX_ROWS query rows (a prefill chunk) the products are wide and the blocks are
# widened instead (WIDE_INT8_ATTENTION): quantizing thousands of rows per block cost more than it
# saved.
# Both arrays keep positions on their last axis: the integer products ran 1.5-1.8x faster reading
# [head_dim, positions] blocks than [positions, head_dim] ones. Measured: see kv_dtype_for. Mean KL
# from a float32 cache on the demo (2k tokens in 16-token chunks, so the integer products run):
# two signed terms each 0.00105 nats (0.00103 in a later run; with int8 weights too 0.00290); one
# signed probability term 0.00236 (5% faster at 16k); one of each 0.0034; two query terms and one
# unsigned probability term (PROB_LEVELS, what runs now) 0.00136 (with int8 weights 0.00338).
# Measured and left out: decode widening its blocks to bfloat16 where the CPU has bfloat16 dot
# products, as a long prefill chunk does. On a 2-core AMD EPYC of CPU family 26 it ran one row at 16k
# positions in 43-53 ms against 51-62 (the same mean KL), but its float sums follow the rows of the
# call, so a prompt served partly from the prompt cache no longer gave the tokens a cold run gives
# (tests/test_prefix_cache.py, tests/test_hybrid.py): the integer sums here are exact.
QUERY_TERMS = 2
# The probabilities' one term: 255 levels on CPUs with unsigned x signed int8 kernels (UINT8_DOT),
# whose VNNI products take the unsigned rows as they are, with no shift and no row of ones (the
# signed terms' _int8_product); else 127 in an int8. One decode row over 16k positions of random
# int8 blocks, the 24 layers' attention alone alternated in one process (2-core AMD EPYC, CPU
# family 25): 32.2 ms against 48.7 for two signed terms; two unsigned terms in two products 45.8,
# stacked in one 60.3 (XLA fuses their quantization into one slow loop). The terms' quantization,
# not the product, is what costs: a block's product of 7 rows takes 11 us, of 15 rows 15 us. Mean
# KL: see QUERY_TERMS above.
PROB_LEVELS = 255 if UINT8_DOT else 127
INT8_ATTENTION_MAX_ROWS = 128
# Past that, the dtype the int8 blocks are widened to: bfloat16 where the CPU has bfloat16 dot
# products (as _matmul's prefill product; the queries and probabilities are rounded to it), else
# float32. A 512-token chunk of the demo, alternated in one process (2-core AMD EPYC with
# avx512_bf16, load 0.8-1.5, medians of 4): from position 0 587 against float32's 544 tok/s, from
# 4096 300 against 263, from 12288 156 against 133. Mean KL with int8 weights and cache, 2k tokens
# in 512-token chunks: 0.0029 nats either way (tests/bench/bench_narrow.py kl).
WIDE_INT8_ATTENTION = jnp.bfloat16 if CPU_HAS_BF16 else F32


def _slot_block(arr, slots, start, block: int):
    """Positions [start, start + block) of each row's slot (positions are every cache array's last
    axis): [B, ...] with `block` last. One row is a plain dynamic slice; a row for every slot slices
    the block of every slot and picks the rows' order from it (a 4-row decode step of 4 slots at
    short context: 133 ms against 147 ms gathering, best of 12, as fast as the bucketed engine's
    133.6 ms); other batches gather one block per row, never a whole slot."""
    sizes = list(arr.shape)
    sizes[0], sizes[-1] = 1, block

    def one(slot):
        at = [slot] + [0] * (arr.ndim - 2) + [start]
        return lax.dynamic_slice(arr, at, sizes)[0]

    if slots.shape[0] == 1:
        return one(slots[0])[None]
    if slots.shape[0] == arr.shape[0]:
        return jnp.take(lax.dynamic_slice_in_dim(arr, start, block, arr.ndim - 1), slots, axis=0)
    return jax.vmap(one)(slots)


def _to_cache(x, dtype):
    """x in the cache's dtype; float16 saturates at its largest finite value instead of becoming
    inf (keys and values of real models stay far below it, but an inf would poison every score)."""
    if dtype == jnp.float16:
        limit = float(jnp.finfo(jnp.float16).max)
        x = jnp.clip(x, -limit, limit)
    return x.astype(dtype)


def _write_kv(kv, k, v, slots, where):
    """The layer's cache with keys and values k, v [B, T, KV, D] written at positions where [B, T]
    of the rows' slots (a position past ctx is dropped). An int8 cache also takes their scales."""
    rows = slots[:, None]
    out = {}
    for name, x in (("k", k), ("v", v)):
        if kv[name].dtype == jnp.int8:
            x, scale = _quantize_rows(x)
            out[name + "_scale"] = kv[name + "_scale"].at[rows, :, where].set(scale[..., 0], mode="drop")
        out[name] = kv[name].at[rows, :, :, where].set(_to_cache(x, kv[name].dtype), mode="drop")
    return out


def _int8_dot(terms, scales, n: int, block, contract: int):
    """n int8 terms of x [B, KV, R, c] times an int8 cache block [B, KV, ...], contracting x's last
    axis with the block's axis `contract`: [B, KV, R, out] float32."""
    return _int8_terms_product(terms, scales, n, block, (((3,), (contract,)), ((0, 1), (0, 1))))


def _probs_product(x, values):
    """x [B, KV, R, S] >= 0 (probabilities times the values' scales) times an int8 value block
    [B, KV, D, S] -> [B, KV, R, D] float32: each row rounded to PROB_LEVELS on its own scale (its
    largest / PROB_LEVELS), one exact integer product, times the scales."""
    peak = jnp.max(x, axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak / PROB_LEVELS, 1.0)
    # x <= peak, so the rounded row stays within [0, PROB_LEVELS].
    levels = jnp.round(x * jnp.where(peak > 0, PROB_LEVELS / peak, 0.0))
    numbers = (((3,), (3,)), ((0, 1), (0, 1)))
    if UINT8_DOT:
        y = _uint8_int8_dot_p.bind(levels.astype(jnp.uint8), values, dimension_numbers=numbers)
    else:
        y = lax.dot_general(levels.astype(jnp.int8), values, numbers, preferred_element_type=jnp.int32)
    return y.astype(F32) * scale


# Where the weights are packed for engine.native's kernel (one device, a CPU it runs on) a decode
# step's attention over the int8 cache is the kernel's too (native.int8_attend): exact integer
# products of the int8 keys and values with the query rows and the softmax weights rounded to int16
# (14 and 15 bits, against the cache's 8), an exact softmax, each row's context in tasks of 2048
# positions on both cores. The path below keeps attention of many rows (prefill chunks) and other
# devices. The demo's decode step, one row, alternated in one process (2-core AMD EPYC, CPU family
# 25): at 1k positions 27.8 ms, at 16k 42.3 (1.52x), against 47.1 and 83.4 with XLA's products and
# this path, when the kernel multiplied in float32; with its int16 products (and the 5-bit weights)
# 23.0-24.3 and 33.7-35.2 ms (1.45-1.46x) against float32's 25.4 and 41.0 (1.62x).
def _packed(w) -> bool:
    return native.is_int5(w) or (is_quantized(w) and native.is_packed(w["q"]))


def _attend(q, kv, slots, positions, live):
    """Causal attention of q [B, KV, G, T, D] (float32, already scaled) over positions [0, live) of
    each row's slot, one block at a time with a running (online) softmax: a query at position p
    sees keys 0..p. kv: the layer's cache (engine.cache). Returns [B, KV, G, T, D] float32."""
    b, kv_heads, group, t, d = q.shape
    cache_k, cache_v = kv["k"], kv["v"]
    ctx = cache_k.shape[-1]
    block = min(ATTENTION_BLOCK, ctx)
    # Group and tokens as one axis: XLA:CPU ran the 4-D product 5x faster than the 5-D einsum with a
    # T axis of 1 (decode, 16k positions, 24 layers, one pass: 54 vs 335 ms).
    q = q.reshape(b, kv_heads, group * t, d)
    narrow = cache_k.dtype == jnp.int8
    integer = narrow and b * group * t <= INT8_ATTENTION_MAX_ROWS
    # An int8 cache's blocks are widened exactly to `calc` (every int8 is a bfloat16) and their
    # per-position scales multiply the scores and the probabilities instead.
    calc = WIDE_INT8_ATTENTION if narrow else _kv_compute_dtype(cache_k.dtype)
    batch = ((0, 1), (0, 1))
    if integer:
        q_terms = _int8_terms(q, QUERY_TERMS)
    else:
        q = q.astype(calc)

    def step(i, carry):
        best, total, acc = carry
        # The last block may reach past ctx: it is shifted back to end at ctx, and positions an
        # earlier block already covered are masked out below.
        begin = i * block
        start = jnp.minimum(begin, ctx - block)
        keys = _slot_block(cache_k, slots, start, block)                   # [B, KV, D, S]
        values = _slot_block(cache_v, slots, start, block)                 # [B, KV, D, S]
        if narrow:
            k_scale = _slot_block(kv["k_scale"], slots, start, block)[:, :, None, :]   # [B, KV, 1, S]
            v_scale = _slot_block(kv["v_scale"], slots, start, block)[:, :, None, :]
        if integer:
            scores = _int8_dot(*q_terms, QUERY_TERMS, keys, 2) * k_scale
        else:
            scores = lax.dot_general(q, keys.astype(calc), (((3,), (2,)), batch), preferred_element_type=F32)
            if narrow:
                scores = scores * k_scale
        key_pos = start + jnp.arange(block, dtype=jnp.int32)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos >= begin)  # [B, T, S]
        mask = jnp.broadcast_to(mask[:, None, None], (b, 1, group, t, block))
        scores = jnp.where(mask.reshape(b, 1, group * t, block), scores, -jnp.inf)
        new_best = jnp.maximum(best, scores.max(axis=-1))                  # [B, KV, G*T]
        # A query whose keys all lie in later blocks has best == -inf so far: it keeps weight 0.
        safe = jnp.where(jnp.isfinite(new_best), new_best, 0.0)
        probs = jnp.exp(scores - safe[..., None])
        scale = jnp.exp(best - safe)
        total = total * scale + probs.sum(axis=-1)
        if integer:
            weighted = _probs_product(probs * v_scale, values)
        else:
            weights = probs * v_scale if narrow else probs
            weighted = lax.dot_general(weights.astype(calc), values.astype(calc), (((3,), (3,)), batch),
                                       preferred_element_type=F32)
        return new_best, total, acc * scale[..., None] + weighted

    shape = (b, kv_heads, group * t)
    init = (jnp.full(shape, -jnp.inf, F32), jnp.zeros(shape, F32), jnp.zeros(shape + (d,), F32))
    _, total, acc = lax.fori_loop(0, (live + block - 1) // block, step, init)
    return (acc / total[..., None]).reshape(b, kv_heads, group, t, d)


# ---- layers ------------------------------------------------------------------------------------

def _attention(layer, kv, x, slots, positions, rope, valid, live, *, cfg: ModelConfig, gated=False):
    """Full causal attention over the slot's cache. x [B, T, hidden] float32 (already normed).
    gated (Qwen3-Next): the query projection also yields, per head, an output gate that scales the
    attention output through a sigmoid before the output projection.
    Returns (output [B, T, hidden], the layer's updated cache)."""
    b, t, _ = x.shape
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = _matmul(x, layer["qkv"])
    if cfg.qkv_bias:
        qkv = qkv + layer["qkv_bias"].astype(F32)
    # Rows grouped by KV head (engine.weights): its query heads (each with its gate when gated),
    # then its key, then its value; a device of a tensor-parallel mesh holds whole groups.
    group = heads // kv_heads
    q_width = group * (2 * d if gated else d)
    q, k, v = jnp.split(qkv.reshape(b, t, kv_heads, q_width + 2 * d), [q_width, q_width + d], axis=-1)
    q = q.reshape(b, t, heads, -1)
    if gated:
        q, gate = jnp.split(q, 2, axis=-1)                                 # per head: query, gate
        gate = gate.reshape(b, t, cfg.q_size)
    if cfg.qk_norm:
        q = _rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = _rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    q, k = _rope(q, rope), _rope(k, rope)

    if kv["k"].dtype == jnp.int8:             # engine.weights.key_smoothing: exact scores, finer keys
        smooth = layer["k_smooth"]                                         # [KV, D]
        k = k / smooth
        q = (q.reshape(b, t, kv_heads, group, d) * smooth[:, None, :]).reshape(q.shape)
    # Write the new keys/values. Padded tokens aim past the end of the slot and are dropped, so
    # idle rows and chunk padding never touch the cache.
    ctx = kv["k"].shape[-1]
    cache = _write_kv(kv, k, v, slots, jnp.where(valid, positions, ctx))

    q = q.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4)      # [B, KV, G, T, D]
    q = q * (1.0 / np.sqrt(d))
    if t == 1 and cache["k"].dtype == jnp.int8 and _packed(layer["qkv"]):
        # Decode on one device where the int8 kernel runs (its weights are packed): see _packed.
        out = native.int8_attend(q[:, :, :, 0], cache["k"], cache["v"], cache["k_scale"], cache["v_scale"],
                                 slots, positions[:, 0])[:, :, :, None]
    else:
        out = _attend(q, cache, slots, positions, live)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.q_size)
    if gated:
        out = out * jax.nn.sigmoid(gate)
    return _matmul(out, layer["o"]), cache


# ---- Gated DeltaNet (linear attention) ---------------------------------------------------------
#
# Per value head h, a recurrent state S [key_dim, value_dim] maps keys to values. At each token, with
# q and k L2-normalized (q also scaled by 1/sqrt(key_dim)), decay g <= 0 and strength beta in (0, 1):
#     S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   out = S^T q
# (the delta rule: write only what S does not already predict for k). Decode runs this one step.
# Prefill runs the same recurrence DELTA_CHUNK tokens at a time in its chunked (WY/UT) form: inside
# a chunk, a unit lower-triangular solve turns the chunk's updates into matrix products, and a scan
# over chunks carries S, so a prefill costs a few matrix products per chunk, not a loop per token.
# Tokens past a row's length get g = 0 and beta = 0, which leaves S exactly as it was; a chunk
# boundary inside a prefill changes only the summation order (tests compare chunkings).

# Tokens per chunk of the chunked delta rule (the width of its triangular solve), as the reference
# implementation uses; prefill chunks that are not a multiple of it are padded inside the layer.
# A power of two (the inverse below squares its way up to it).
DELTA_CHUNK = 64
# Epsilon of the L2 normalization of q and k (the reference's).
L2_EPS = 1e-6


def _l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _delta_step(q, k, v, g, beta, state):
    """One token for every row: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv]."""
    state = state * jnp.exp(g)[..., None, None]
    predicted = jnp.einsum("bhk,bhkv->bhv", k, state)
    state = state + k[..., None] * ((v - predicted) * beta[..., None])[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, state), state


def _delta_chunked(q, k, v, g, beta, state):
    """T tokens per row: q, k [B, T, H, dk], v [B, T, H, dv], g, beta [B, T, H], state [B, H, dk, dv].
    Returns (out [B, T, H, dv], state after the T tokens)."""
    b, t, h, dk = k.shape
    c = DELTA_CHUNK
    pad = -t % c
    n = (t + pad) // c

    def chunks(x):                      # [B, T, H, ...] -> [B, H, n, c, ...], padded with zeros
        x = jnp.moveaxis(x, 2, 1)
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(b, h, n, c, *x.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)                                           # [B, H, n, c]
    lower = jnp.tril(jnp.ones((c, c), bool))
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (masked before exp: above it would overflow).
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta = k * beta[..., None]
    # The chunk's updates interact through (I + L), L strictly lower triangular; its inverse is
    # the finite series sum (-L)^i = (I - L)(I + L^2)(I + L^4)... (L^c = 0): log2(c) squarings, all
    # matrix products. XLA:CPU ran lax.linalg.triangular_solve's batched solve far slower.
    neg = -jnp.where(jnp.tril(jnp.ones((c, c), bool), -1),
                     jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay, 0.0)
    eye = jnp.eye(c, dtype=F32)
    inverse, power = eye + neg, neg
    for _ in range(int(np.log2(c)) - 1):
        power = power @ power
        inverse = inverse @ (eye + power)
    values = inverse @ (v * beta[..., None])                 # what each token writes
    k_decayed = inverse @ (k_beta * jnp.exp(cum)[..., None])  # how much of the old state each erases
    inner = jnp.einsum("...ik,...jk->...ij", q, k) * decay
    q_read = q * jnp.exp(cum)[..., None]
    k_write = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])                                    # [B, H, n]

    def step(s, xs):
        values, k_decayed, inner, q_read, k_write, chunk_decay = xs
        new = values - k_decayed @ s
        out = q_read @ s + inner @ new
        return s * chunk_decay[..., None, None] + jnp.swapaxes(k_write, -1, -2) @ new, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (values, k_decayed, inner, q_read, k_write, chunk_decay))
    state, out = lax.scan(step, state, xs)                                 # out [n, B, H, c, dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, -1)[:, :, :t]
    return jnp.moveaxis(out, 1, 2), state


def _linear_attention(layer, state, x, slots, starts, lengths, valid, *, cfg: ModelConfig):
    """A Gated DeltaNet layer. x [B, T, hidden] float32 (already normed); state the layer's
    {"conv", "state"} pool (engine.cache). Returns (output [B, T, hidden], the updated pool)."""
    b, t, _ = x.shape
    lin = layer["linear"]
    kh, vh, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    vd, kernel = vh * dv, cfg.linear_conv_kernel
    per = vh // kh                       # each key head serves `per` consecutive value heads
    # Rows grouped by key head (engine.weights): its q, k, then its value heads' v, z, b, a; the
    # conv channels (and the conv state) grouped the same way, so a device of a tensor-parallel
    # mesh holds whole key heads with their value heads.
    mixed = _matmul(x, lin["in"]).reshape(b, t, kh, 2 * dk + 2 * per * dv + 2 * per)
    qkv, z, beta, a = jnp.split(mixed, np.cumsum([2 * dk + per * dv, per * dv, per]), axis=-1)
    qkv = qkv.reshape(b, t, kh * (2 * dk + per * dv))
    beta, a = beta.reshape(b, t, vh), a.reshape(b, t, vh)

    # This row's slot state; a row starting at position 0 starts a new sequence from zero.
    fresh = (starts == 0)[:, None, None]
    conv_state = jnp.where(fresh, 0.0, state["conv"][slots])              # [B, C, kernel - 1]
    recurrent = jnp.where(fresh[..., None], 0.0, state["state"][slots])    # [B, H, dk, dv]

    # Short causal depthwise convolution over the last `kernel` inputs, the first kernel - 1 of
    # which the conv state holds; the new conv state is the last kernel - 1 inputs of the row's
    # real tokens (padding comes after them, so it never reaches a real token's output).
    seq = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2), qkv], axis=1)    # [B, kernel-1+T, C]
    w = lin["conv"].astype(F32)
    conv = jax.nn.silu(sum(seq[:, j:j + t] * w[:, j] for j in range(kernel)))
    new_conv = jax.vmap(lambda s, n: lax.dynamic_slice_in_dim(s, n, kernel - 1, axis=0))(seq, lengths)

    q, k, v = jnp.split(conv.reshape(b, t, kh, -1), [dk, 2 * dk], axis=-1)
    q = jnp.repeat(q, per, axis=2)
    k = jnp.repeat(k, per, axis=2)
    q, k = _l2norm(q) * (1.0 / np.sqrt(dk)), _l2norm(k)
    v = v.reshape(b, t, vh, dv)
    real = valid[..., None]
    beta = jnp.where(real, jax.nn.sigmoid(beta), 0.0)                      # [B, T, H]
    g = jnp.where(real, -jnp.exp(lin["A_log"]) * jax.nn.softplus(a + lin["dt_bias"]), 0.0)
    if t == 1:
        out, recurrent = _delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent)
        out = out[:, None]
    else:
        out, recurrent = _delta_chunked(q, k, v, g, beta, recurrent)

    # Gated RMSNorm per value head: normalized, scaled, times silu of the z projection.
    out = _rms_norm(out, lin["norm"], cfg.rms_norm_eps) * jax.nn.silu(z.reshape(b, t, vh, dv))
    out = _matmul(out.reshape(b, t, vd), lin["out"])
    # Rows with no tokens (idle decode rows) write nothing: they aim past the pool and are dropped.
    where = jnp.where(lengths > 0, slots, state["state"].shape[0])
    return out, {"conv": state["conv"].at[where].set(jnp.swapaxes(new_conv, 1, 2), mode="drop"),
                 "state": state["state"].at[where].set(recurrent, mode="drop")}


def _gated(y):
    """silu(gate) * up from a gate_up product y [..., 2 f], gate and up interleaved row by row
    (engine.weights: a device of a tensor-parallel mesh holds the gate and up of the same channels)."""
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    return jax.nn.silu(pairs[..., 0]) * pairs[..., 1]


def _swiglu(rows, gate_up, down):
    return _matmul(_gated(_matmul(rows, gate_up)), down)


def _mlp(layer, x):
    return _swiglu(x, layer["gate_up"], layer["down"])


# ---- routed experts ----------------------------------------------------------------------------
#
# A "moe" layer's MLP: the router scores every expert, each token takes the top experts_per_token
# by softmax probability, and its output is their SwiGLU outputs weighted by those probabilities
# (renormalized to sum to 1 when norm_topk_prob). Qwen3-Next adds a shared expert, an ordinary
# SwiGLU with a sigmoid gate added to the same sum: one more entry under layer["moe"], read in _moe.
#
# Two paths compute the routed sum, chosen per call site while tracing (_routed_path):
#   kernel  tokens sorted by expert, one grouped matrix product per projection by a routed-expert
#           kernel (tokamax.ragged_dot from the `accel` extra on GPU/TPU, else jax.lax.ragged_dot,
#           which GPU and TPU lower to XLA's ragged-dot instruction), then unsorted. A site whose
#           shapes tokamax refuses runs exact, and says so.
#   exact   plain XLA operations: the (token, expert) pairs sorted by expert into tiles of one expert
#           each, a loop over the tiles that reads each tile's expert once, then unsorted.
# Both run on the experts one device holds: all of them on one device, its own block on a mesh
# (expert parallelism: _per_device runs them inside shard_map and adds the devices' sums).
# What counts as "kernel" is the spec's reading: a kernel package's routed-expert kernel. The tiled
# loop groups tokens too, but it is this file's own arithmetic, so it reports as exact. XLA:CPU has
# no such kernel: jax.lax.ragged_dot lowers there to a masked dense product over EVERY expert (its
# _ragged_dot_general_impl), which would read all experts' weights per token, and tokamax's kernels
# are for GPU/TPU only. So the CPU runs exact, and says why.
#
# Cost on XLA:CPU (measured: 128 experts, top-8, hidden 1024, expert width 384, float32, 2 cores):
# the obvious formulation, gathering each row's chosen experts' weights (w[experts]) and multiplying,
# ran at 0.6 GB/s, 40x under the memory bandwidth: XLA:CPU gathers element by element. Taking each
# expert with a dynamic slice inside a loop (lax.scan) streams it at 25 GB/s, the bandwidth. Hence
# the tile loop, with ROUTED_TILE rows per tile in prefill. Decoding 4 rows, one tile per (row, pick)
# (32 matrix-vector products, 4 layers: 41-46 ms) beat one tile per expert of the rows' union (~29
# experts, each multiplied by all 4 rows: 52-81 ms, summed or dot form alike): XLA:CPU's matrix-vector
# product streams faster than its few-row products, and an expert two rows share is read twice
# (from cache when the second read follows soon). One row reads exactly its k experts.

ROUTED_KINDS = ("kernel", "exact")
# Rows per tile of the exact path in a prefill chunk: a tile multiplies its rows by one expert.
# Smaller tiles waste less on each expert's last, partly filled tile; larger ones run the product
# at a better rate. A 512-token chunk, 4 layers of the bench model (tests/bench/bench_moe.py), on a
# loaded 2-core machine: tiles of 32, 64, 128 rows took 1.42, 1.31-2.09, 2.71 s; 64 is kept.
ROUTED_TILE = 64
# Why XLA:CPU runs the exact path (reported in Health's routed_experts.exact_why).
CPU_EXACT_WHY = ("cpu: no routed-expert kernel serves XLA:CPU (jax.lax.ragged_dot lowers there to a "
                 "dense product over every expert; tokamax's kernels target GPU and TPU)")

# (cfg, layer, rows) -> (path, kernel info or None, why or None): every routed-expert call site
# traced in this process. Written while tracing only, so it costs nothing at run time.
ROUTED_SITES: dict[tuple, tuple[str, dict | None, str | None]] = {}


class _NoKernel(Exception):
    """The kernel package refused this call site's shapes or platform (raised while tracing)."""


def _kernel():
    """The routed-expert kernel for this process: (grouped product function, its id/version/package).
    The product takes rows [M, in], stacked weights [experts, out, in] and group sizes [experts]."""
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    if jax.default_backend() in ("gpu", "tpu"):
        try:
            import tokamax
        except ImportError:
            pass
        else:
            def product(rows, w, sizes):
                # The package's own kernels only: its "xla" fallback is jax.lax.ragged_dot's
                # expansion. A kernel that cannot take these shapes says so while tracing.
                refusals = []
                for implementation in ("mosaic", "triton"):
                    try:
                        return tokamax.ragged_dot_general(rows, w, sizes, dims,
                                                          preferred_element_type=F32,
                                                          implementation=implementation)
                    except (NotImplementedError, ValueError) as e:
                        refusals.append(f"{implementation}: {e}")
                raise _NoKernel("tokamax.ragged_dot refused " + "; ".join(refusals))
            return product, {"id": "tokamax.ragged_dot", "version": tokamax.__version__,
                             "package": "tokamax"}

    def product(rows, w, sizes):
        return lax.ragged_dot_general(rows, w, sizes, dims, preferred_element_type=F32)
    return product, {"id": "jax.lax.ragged_dot", "version": jax.__version__, "package": "jax"}


def _routed_path(cfg: ModelConfig) -> tuple[str, str | None]:
    """(path, why it is exact) for a call site being traced now."""
    if cfg.routed_path not in ROUTED_PATHS:
        raise ValueError(f"routed_path must be one of {ROUTED_PATHS}, got {cfg.routed_path!r}")
    if cfg.routed_path in ROUTED_KINDS:
        return cfg.routed_path, ("routed_path=exact was asked for" if cfg.routed_path == "exact"
                                 else None)
    if jax.default_backend() == "cpu":
        return "exact", CPU_EXACT_WHY
    return "kernel", None


def _route(x, router, cfg: ModelConfig):
    """x [N, hidden] -> (weights [N, k] float32, experts [N, k] int32), the top k by probability."""
    probs = jax.nn.softmax(_matmul(x, router), axis=-1)
    weights, experts = lax.top_k(probs, cfg.experts_per_token)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _routed_kernel(x, weights, experts, moe, product):
    """Sort the (token, expert) pairs by expert, two grouped products, unsort. Pairs of no expert
    (experts == the experts held, num: padding) sort last, past every group: the kernel leaves them
    zero."""
    n, k = experts.shape
    num = moe["gate_up"].shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros(num + 1, jnp.int32).at[flat].add(1)[:num]
    rows = x[order // k].astype(moe["gate_up"].dtype)
    gated = _gated(product(rows, moe["gate_up"], sizes)).astype(moe["down"].dtype)
    y = product(gated, moe["down"], sizes)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    y = y[back].reshape(n, k, -1)                                   # unsorted: [token, pick, hidden]
    return jnp.einsum("nk,nkh->nh", jnp.where(experts < num, weights, 0.0), y)


def _routed_exact(x, weights, experts, moe, tile: int):
    """The same sum in plain XLA operations. Pairs are sorted by expert and laid out in tiles of
    `tile` rows, each tile holding rows of one expert only (its last tile zero-padded); a loop over
    the tiles multiplies each tile by its expert, read with a dynamic slice; the outputs are
    gathered back per (token, pick) and weighted. Tiles past the last used one are skipped."""
    n, k = experts.shape
    num = moe["gate_up"].shape[0]
    pairs = n * k
    flat = experts.reshape(-1)                                       # num = no expert (padding)
    sizes = jnp.zeros(num + 1, jnp.int32).at[flat].add(1)[:num]
    tiles_of = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles_of)                                  # tiles of experts 0..e
    first_tile = tile_end - tiles_of
    # Enough tiles for any routing: sum over experts of ceil(pairs_e / tile), at most
    # (pairs + used * (tile - 1)) / tile with at most min(num, pairs) experts used.
    tiles = (pairs + min(num, pairs) * (tile - 1)) // tile
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    live = expert < num
    safe = jnp.minimum(expert, num - 1)
    rank = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[safe]
    where = jnp.where(live, first_tile[safe] * tile + rank, tiles * tile)     # padding: past the end
    token_at = jnp.full(tiles * tile + 1, n, jnp.int32).at[where].set(
        (order // k).astype(jnp.int32))[:-1].reshape(tiles, tile)           # n = a zero row
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(tiles), side="right"), num - 1)
    padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])

    def one_tile(_, i):
        def run():
            e = tile_expert[i]
            return _swiglu(padded[token_at[i]], lax.dynamic_index_in_dim(moe["gate_up"], e, 0, False),
                           lax.dynamic_index_in_dim(moe["down"], e, 0, False))
        return None, lax.cond(i < tile_end[-1], run, lambda: jnp.zeros((tile, x.shape[1]), F32))

    _, y = lax.scan(one_tile, None, jnp.arange(tiles))
    y = jnp.concatenate([y.reshape(tiles * tile, -1), jnp.zeros((1, x.shape[1]), F32)])
    at = jnp.zeros(pairs, jnp.int32).at[order].set(where).reshape(n, k)
    return jnp.einsum("nk,nkh->nh", jnp.where(experts < num, weights, 0.0), y[at])


def _per_device(routed, x, weights, experts, moe, cfg: ModelConfig):
    """routed(x, weights, experts, {"gate_up", "down"}) -> the routed sum, run where the experts are.
    One device: as it is. On a mesh (expert parallelism, engine.sharding) each device holds
    num_experts / devices whole experts, the consecutive block from device * that: inside shard_map
    it runs `routed` on its own experts only, a pick of another device's expert becoming padding
    (local index = expert - the device's first, the padding index where out of range), and a psum
    over the mesh adds the devices' partial sums. Rows, routing and the sum are replicated; no
    expert weight leaves its device. The cost of the split: every device sorts all of the step's
    (token, pick) pairs and runs the tile loop's full trip count (a tile of padding is skipped by its
    lax.cond, not read, so a decode step still reads only the picked experts, each on its own
    device), the step waits for the device whose experts were picked most, and one all-reduce of
    [rows, hidden] per layer combines the partial sums."""
    local = {"gate_up": moe["gate_up"], "down": moe["down"]}
    if cfg.devices == 1:
        return routed(x, weights, experts, local)
    per = cfg.num_experts // cfg.devices

    def own_experts(x, weights, experts, local):
        first = lax.axis_index(MODEL_AXIS) * per
        mine = (experts >= first) & (experts < first + per)
        return lax.psum(routed(x, weights, jnp.where(mine, experts - first, per), local), MODEL_AXIS)

    split, whole = PartitionSpec(MODEL_AXIS), PartitionSpec()
    # check_vma off: `routed` is the one-device code (a tile loop whose lax.cond returns either a
    # tile read from the device's experts or zeros), which that check would refuse as mixing
    # per-device and replicated values; the psum makes the output the same on every device.
    return jax.shard_map(own_experts, mesh=AbstractMesh((cfg.devices,), (MODEL_AXIS,)),
                         in_specs=(whole, whole, whole, split), out_specs=whole,
                         check_vma=False)(x, weights, experts, local)


def routed_experts(x, moe, valid, *, cfg: ModelConfig, site: int | None = None):
    """The routed-expert sum for rows x [N, hidden] (float32); valid [N] False for padding and idle
    rows, which take no expert. The path is chosen here, while tracing, and recorded for the layer
    `site` (None: a call outside the model, not recorded)."""
    n = x.shape[0]
    path, why = _routed_path(cfg)
    weights, experts = _route(x, moe["router"], cfg)
    experts = jnp.where(valid[:, None], experts, cfg.num_experts)
    if path == "kernel":
        product, kernel = _kernel()
        try:
            out = _per_device(lambda *a: _routed_kernel(*a, product), x, weights, experts, moe, cfg)
        except _NoKernel as e:                     # this site runs exact, and Health says why
            path, why = "exact", str(e)
        else:
            if site is not None:
                ROUTED_SITES[(cfg, site, n)] = ("kernel", kernel, None)
            return out
    if site is not None:
        ROUTED_SITES[(cfg, site, n)] = ("exact", None, why)
    # Decode (a few rows): a tile per (row, pick), a matrix-vector product per chosen expert.
    tile = 1 if n * cfg.experts_per_token <= ROUTED_TILE else ROUTED_TILE
    return _per_device(lambda *a: _routed_exact(*a, tile), x, weights, experts, moe, cfg)


def routed_report(cfg: ModelConfig, rows=None) -> dict | None:
    """Health's routed_experts for the programs traced so far with cfg (only those of `rows` tokens
    per call, if given: one engine's programs): None for a dense model or before any routed site
    is traced."""
    sites = [v for (c, _, n), v in ROUTED_SITES.items() if c == cfg and (rows is None or n in rows)]
    if not sites:
        return None
    count = {kind: sum(1 for path, _, _ in sites if path == kind) for kind in ROUTED_KINDS}
    kernel = next((info for path, info, _ in sites if path == "kernel"), None)
    return {"path": "mixed" if count["kernel"] and count["exact"] else
            "kernel" if count["kernel"] else "exact",
            "kernel": kernel, "sites": count,
            "exact_why": sorted({why for _, _, why in sites if why})}


def _moe(layer, x, valid, cfg: ModelConfig, site: int):
    """A "moe" layer's MLP on x [B, T, hidden]; Qwen3-Next's shared expert (layer["moe"]["shared"])
    adds its SwiGLU on every row times sigmoid(x . its gate)."""
    b, t, h = x.shape
    out = routed_experts(x.reshape(b * t, h), layer["moe"], valid.reshape(b * t), cfg=cfg,
                         site=site).reshape(b, t, h)
    shared = layer["moe"].get("shared")
    if shared is not None:
        out = out + jax.nn.sigmoid(_matmul(x, shared["gate"])) * _swiglu(x, shared["gate_up"],
                                                                          shared["down"])
    return out


# ---- the model ---------------------------------------------------------------------------------

def _layer(layer, kv, x, slots, starts, lengths, positions, rope, valid, live, *, cfg: ModelConfig,
           kind: str, mlp: str, site: int | None):
    """One decoder layer on the residual stream x [B, T, hidden]: (x after it, its updated cache)."""
    normed = _rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    if kind == "linear":
        h, kv = _linear_attention(layer, kv, normed, slots, starts, lengths, valid, cfg=cfg)
    elif kind in ("attention", "gated_attention"):
        h, kv = _attention(layer, kv, normed, slots, positions, rope, valid, live, cfg=cfg,
                           gated=kind == "gated_attention")
    else:
        raise ValueError(f"layer kind {kind!r} is not implemented")
    x = x + h
    normed = _rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    return x + (_moe(layer, normed, valid, cfg, site) if mlp == "moe" else _mlp(layer, normed)), kv


# Each layer as a jitted call inside forward: layers of one kind whose weights have the same shapes
# share one trace and one lowered function, which XLA inlines again (the same logits to the bit, the
# same speed). Tracing and lowering comes before the persistent compile cache can even be asked, holds
# the GIL, and ran again at every start: the demo's decode program 0.9 + 0.5 s with the 24 layers
# traced one by one, 0.2 + 0.1 s now (2-core AMD EPYC, CPU family 25). A routed-expert layer keeps a
# trace of its own (site): its path is recorded per layer (ROUTED_SITES).
_jit_layer = jax.jit(_layer, static_argnames=("cfg", "kind", "mlp", "site"))


def forward(params, cache, tokens, slots, starts, lengths, *, cfg: ModelConfig,
            all_logits: bool = False):
    """See the module docstring. tokens int32 [B, T]; slots, starts, lengths int32 [B].
    Returns float32 logits [B, vocab] at each row's last valid token ([B, T, vocab] with
    all_logits), and the updated cache."""
    b, t = tokens.shape
    ctx = next(layer["k"] for layer in cache if "k" in layer).shape[-1]     # linear layers: no ctx
    if slots.shape != (b,) or starts.shape != (b,) or lengths.shape != (b,):
        raise ValueError(f"slots, starts and lengths must have shape ({b},) like tokens' rows")
    steps = jnp.arange(t, dtype=jnp.int32)
    positions = starts[:, None] + steps[None, :]                           # [B, T]
    valid = steps[None, :] < lengths[:, None]                              # [B, T]
    # Positions attention must read; at least one, so that idle rows (all lengths 0) stay finite.
    live = jnp.clip(jnp.max(starts + lengths), 1, ctx)
    rope = _rope_tables(positions, cfg)
    x = _embed(params["embed"], tokens)                                    # [B, T, hidden]
    new_cache = []
    # A Python loop, not lax.scan: XLA:CPU runs the unrolled layers 2-4x faster.
    mlp_kinds = cfg.mlp_kinds or ("dense",) * cfg.num_layers
    for i, (kind, mlp, layer, kv) in enumerate(zip(cfg.layer_kinds, mlp_kinds, params["layers"], cache)):
        x, kv = _jit_layer(layer, kv, x, slots, starts, lengths, positions, rope, valid, live, cfg=cfg,
                           kind=kind, mlp=mlp, site=i if mlp == "moe" else None)
        new_cache.append(kv)
    if not all_logits:
        last = jnp.maximum(lengths - 1, 0)                                 # idle rows: any row
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]      # [B, hidden]
    x = _rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return _matmul(x, params["lm_head"]), new_cache


jit_forward = jax.jit(forward, donate_argnames=("cache",),
                      static_argnames=("cfg", "all_logits"))
