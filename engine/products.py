"""Matrix products with the weights in every form the engine holds them, and the integer products
attention shares with them.

    matmul(x, w)        x [..., in] times w [out, in] -> [..., out] float32
    embed(table, rows)  rows of an embedding table -> float32

A weight is one of four kinds (weight_kind), each with one product:
    float        an array in the compute dtype (float32 on a CPU, bfloat16 on accelerators)
    int8         {"q": [out, in], "scale": float32 [out]}: w = q * scale, one scale per output
                 channel; q held as int8, or as uint8 plus INT8_OFFSET where the CPU has unsigned x
                 signed int8 kernels (engine.weights.OFFSET_INT8)
    int8_packed  the same, q in engine.native's packed layout for its kernel
    q5_0         a GGUF's Q5_0 blocks as the file has them (engine.native.pack5)
    q8_0         a GGUF's Q8_0 blocks as the file has them (engine.native.pack8)
    q4_k, q5_k,  a GGUF's Q4_K, Q5_K or Q6_K blocks as the file has them (engine.native.pack_k)
    q6_k
    iq4_nl,      a GGUF's IQ4_NL, IQ4_XS, IQ3_S or Q3_K blocks as the file has them (IQ3_S's grid
    iq4_xs,      expanded to a 4-bit code per weight: engine.native.pack_s)
    iq3_s, q3_k
    fp8          {"f8": float8_e4m3fn [out, in], "f8_scale": float32 [out, in / block]}: an FP8
                 checkpoint's values, w = f8 * f8_scale per block of columns (engine.weights)
    parts        a matrix held per part (engine.weights.PER_PART: a GGUF matrix whose parts are of
                 different block types), each part a run of its rows in one of the kinds above
The packed kinds exist only where engine.native's kernel serves the model (ModelConfig.native,
decided once at start-up): load_weights packs them, so the kind of a weight is the decision.

How each kind is multiplied depends on the rows: a few rows (decode steps, small prefill chunks)
are bound by reading the weights, many rows (a prefill chunk) by arithmetic. The figures behind
every threshold here are in docs/performance.md.
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

from engine import cpu, native
from engine.weights import INT8_OFFSET, PER_PART

F32 = jnp.float32

WEIGHT_KINDS = ("float", "int8", "int8_packed", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs",
                "iq3_s", "q3_k", "fp8", "parts")

# XLA:CPU's dot of a few rows runs well below the memory's speed, while the same product written as
# a broadcast multiply summed over the input (one fused reduction) streams the weights once. One
# row keeps the dot (a matrix-vector product is already at the bandwidth); past this many rows
# compute dominates and the dot wins again.
SUMMED_PRODUCT_MAX_ROWS = 128
# int8 weights: up to this many rows the activations become int8 terms and the product is an
# integer one (or the kernel's); past it the weights are widened for a float dot. Where the CPU has
# bfloat16 dot products the widened dot already wins at 128 rows over XLA's integer terms (the
# kernel's own products past it: PREFILL_BY_KERNEL).
CPU_HAS_BF16 = cpu.has_bf16_dot()
INT8_ROWS_MAX_ROWS = 64 if CPU_HAS_BF16 else SUMMED_PRODUCT_MAX_ROWS
# A prefill chunk past INT8_ROWS_MAX_ROWS rows through engine.native's kernel too, where its integer
# products beat XLA's widened dot (and make smaller programs): the AVX-512 VNNI tier on a CPU without
# AMX, against XLA's bfloat16 dot (a Zen 4 EPYC: docs/perf-log.md, "Prefill through the kernel"), and
# the AVX2 tiers, against its float32 dot (a Zen 3 EPYC, AVX2 alone: "Prefill through the kernel on
# AVX2"; the AVX-VNNI tier does the same work in fewer instructions). A row's products are then the
# decode step's whatever the chunk holds. With AMX, XLA's bfloat16 dot runs on the tiles: there the
# kernel takes long chunks only where it multiplies them on the tiles itself (native.tiles():
# TILE_KINDS); every long chunk on the NEON tier (not measured) stays widened.
PREFILL_BY_KERNEL = native.tier() in ("avx512_vnni", "avx_vnni", "avx2") and not cpu.has_amx()
# The weight kinds (weight_kind) whose long chunks the kernel multiplies on AMX tiles: every kind it
# holds (fp8 is an accelerator's form; a mixed matrix's parts go their own kinds' ways).
TILE_KINDS = frozenset(WEIGHT_KINDS) - {"float", "fp8", "parts"}
# Whether the integer products take the uint8 x int8 form, or (no VNNI) int8 x int8. Read while
# tracing; tests compare both forms.
UINT8_DOT = cpu.has_uint8_dot()
# Activations become two int8 terms per row: the row, then what its rounding left on a scale 127x
# finer. One term cost accuracy (mean KL 0.0096 nats from float32 on the demo); two are as good as
# exact activations (0.0017).
ROW_TERMS = 2


def weight_kind(w) -> str:
    """Which of WEIGHT_KINDS w is (the module docstring)."""
    if not isinstance(w, dict):
        return "float"
    if PER_PART in w:
        return "parts"
    if native.is_int5(w):
        return "q5_0"
    if native.is_q8(w):
        return "q8_0"
    if kind := native.k_kind(w) or native.s_kind(w):
        return kind.lower()
    if "f8" in w:
        return "fp8"
    return "int8_packed" if native.is_packed(w["q"]) else "int8"


def _xla_cpu() -> bool:
    return jax.default_backend() == "cpu"


# ---- int8 terms and integer products ------------------------------------------------------------

def quantize_rows(x):
    """x [rows, in] float32 -> (int8 [rows, in], float32 [rows, 1]): each row rounded to int8 on its own
    scale, so that x ~= q * scale. An all-zero row (padding) gets scale 1 and stays zero."""
    peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def int8_terms(x, n: int):
    """x [..., rows, c] float32 -> (int8 [..., n * rows, c], scales [..., n * rows, 1]): the rows,
    then (n = 2) what their rounding left, stacked along the rows."""
    terms, scales = [], []
    for _ in range(n):
        q, scale = quantize_rows(x)
        terms.append(q)
        scales.append(scale)
        x = x - q.astype(F32) * scale
    return jnp.concatenate(terms, axis=-2), jnp.concatenate(scales, axis=-2)


# An unsigned x signed int8 product -> int32 as one HLO dot. JAX would widen mixed operands to a
# common type first (int32, whose product XLA:CPU runs ~30x slower), so this primitive emits the dot
# itself.
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


def uint8_int8_dot(x, w, dimension_numbers):
    """uint8 x times int8 w (lax.dot_general's dimension_numbers) -> exact int32."""
    return _uint8_int8_dot_p.bind(x, w, dimension_numbers=dimension_numbers)


def int8_product(terms, other, dimension_numbers):
    """terms int8 [..., rows, c] times int8 `other` (contracting terms' last axis, rows its only free
    axis) -> exact int32 [..., rows, out]. Where the CPU has unsigned x signed kernels (UINT8_DOT)
    the rows are shifted by 128 to uint8, and a row of ones appended to them gives each output's sum
    over `other`, 128 times which comes off again: sum((t + 128) w) - 128 sum(w) = sum(t w), exact
    in int32. The unsigned rows run on the VNNI kernels, signed ones on slower plain ones."""
    if not UINT8_DOT:
        return lax.dot_general(terms, other, dimension_numbers, preferred_element_type=jnp.int32)
    shifted = (terms.astype(jnp.int16) + 128).astype(jnp.uint8)
    ones = jnp.ones(terms.shape[:-2] + (1, terms.shape[-1]), jnp.uint8)
    y = uint8_int8_dot(jnp.concatenate([shifted, ones], axis=-2), other, dimension_numbers)
    return y[..., :-1, :] - 128 * y[..., -1:, :]


def rounded(x, zero):
    """x (float32), each value rounded on its own before what uses it. XLA:CPU turns a product and
    the sum it feeds into one fused multiply-add (one rounding, not two) wherever both land in one
    fusion, and which land together depends on the program around them (a decode step's and a
    verification's, engine.speculative); an integer or with `zero`, a run-time 0 the compiler cannot
    fold, keeps the product a value of its own, rounded as the kernel's are."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) | zero, F32)


def sum_terms(products, scales, n: int, zero=None):
    """The int32 products of n int8 terms (int8_terms of x [..., rows, c], stacked along the rows),
    each times its scales, summed: [..., rows, out] float32, x's product. zero: a run-time 0 that
    rounds each term's product before the sum (rounded)."""
    parts = products.astype(F32) * scales
    return sum(jnp.split(parts if zero is None else rounded(parts, zero), n, axis=-2))


def int8_terms_product(terms, scales, n: int, other, dimension_numbers):
    """The sum of n int8 terms (int8_terms of x [..., rows, c]) times int8 `other`, each term's
    product times its scales: [..., rows, out] float32, x's product with `other`."""
    return sum_terms(int8_product(terms, other, dimension_numbers), scales, n)


def int8_values(q):
    """Held int8 weights (int8, or uint8 offset by INT8_OFFSET) -> their signed values (exact)."""
    return q.astype(jnp.int16) - INT8_OFFSET if q.dtype == jnp.uint8 else q


def offset_weights_product(q, terms):
    """int8 terms [rows, in] times int8 weights held offset (q uint8 [out, in], the values + 128) ->
    exact int32 [rows, out]. The weights are the dot's first operand, so that YNNPACK streams them
    as held and packs only the few rows of terms (as the second operand it repacked the whole matrix
    on every call); 128 times each term row's sum comes off: sum((w + 128) t) - 128 sum(t) = sum(w t)."""
    if q.dtype != jnp.uint8:
        raise TypeError(f"offset int8 weights are uint8, got {q.dtype}")
    numbers = (((1,), (1,)), ((), ()))
    if not UINT8_DOT:         # no uint8 kernels: the weights' signed values, converted on every call
        return lax.dot_general(terms, int8_values(q).astype(jnp.int8), numbers,
                               preferred_element_type=jnp.int32)
    y = uint8_int8_dot(q, terms, numbers)                                  # [out, rows]
    # Transposed last: with the transpose first, XLA gave the dot a layout YNNPACK does not take, and
    # its own dot emitter has no mixed-type product (a compile error).
    return (y - INT8_OFFSET * jnp.sum(terms.astype(jnp.int32), axis=-1)).T


# ---- one product per weight kind ------------------------------------------------------------------

def wide_dtype():
    """What int8 or 5-bit weights are widened to for a prefill chunk's dot: bfloat16 (exact for int8
    values, float32 accumulation) on accelerators and on CPUs with bfloat16 dot products, else
    float32."""
    return jnp.bfloat16 if CPU_HAS_BF16 or not _xla_cpu() else F32


def _wide_dot(flat, values, wide=None):
    wide = wide or wide_dtype()
    return lax.dot_general(flat.astype(wide), values.astype(wide), (((1,), (1,)), ((), ())),
                           preferred_element_type=F32)


# The most of a matrix widened at once for a prefill chunk's dot (bfloat16 bytes): a larger matrix is
# widened and multiplied in parts of whole 16-output blocks, one after another, so a program holds
# one part's copy, not the whole matrix's (the 27B's gate_up is 356 MB in bfloat16; measured in
# docs/perf-log.md, "The 27B's start"); the demo's layers stay whole.
WIDEN_PART_BYTES = 64 << 20


def _widened_dot(flat, held: dict, widen):
    """flat [rows, in] times a matrix whose held arrays (`held`: each with the matrix's 16-output
    blocks along its first axis) widen(held, after) widens to bfloat16 [out, in]: one dot per part
    of at most WIDEN_PART_BYTES, each part's widening tied to the part before it (`after`), so XLA
    neither hoists nor overlaps them. Each output is its own row's dot, whichever part holds it."""
    blocks = next(iter(held.values())).shape[0]
    per_block = native.LANES * flat.shape[-1] * 2
    step = max(1, min(blocks, WIDEN_PART_BYTES // per_block))
    if step >= blocks:
        return _wide_dot(flat, widen(held, flat))
    outs, after = [], flat
    for start in range(0, blocks, step):
        # The part's start made from `after` (a run-time 0 added), so XLA cannot slice every part of
        # every matrix at the program's start (a copy of the weights).
        bits = lax.bitcast_convert_type(after.reshape(-1)[0], jnp.int32)
        at = start + jnp.minimum(lax.shift_right_logical(bits, 31), 0)
        part = {k: lax.dynamic_slice_in_dim(v, at, min(step, blocks - start), axis=0) for k, v in held.items()}
        outs.append(_wide_dot(flat, widen(part, after)))
        after = outs[-1]
    return jnp.concatenate(outs, axis=-1)


def _int8_matmul(flat, w):
    """flat [rows, in] float32 times int8 weights in the plain layout -> [rows, out]."""
    q, scale = w["q"], w["scale"]
    # Where the kernel takes every chunk (PREFILL_BY_KERNEL), a matrix it cannot pack (a shape not
    # of whole lanes: only tiny models have them) keeps the integer products past
    # INT8_ROWS_MAX_ROWS too, so its rows get the decode step's numbers as the packed ones do.
    if _xla_cpu() and kernel_takes(flat.shape[0], "int8"):
        terms, scales = int8_terms(flat, ROW_TERMS)
        if q.dtype == jnp.uint8:
            products = offset_weights_product(q, terms)
        else:
            products = int8_product(terms, q, (((1,), (1,)), ((), ())))
        # The weights' scales are never negative: a run-time 0 (a row's numbers in every program).
        return sum_terms(products, scales, ROW_TERMS, zero=(scale[0] < 0).astype(jnp.int32)) * scale
    if _xla_cpu():
        # Each matrix widened when its product is next, not all at a program's start: XLA:CPU's
        # scheduler hoists what reads only weights (a 512-token chunk of the demo held every layer's
        # copy, 0.79 GB). Adding a zero made from the input ties the convert to it (x * 0 is not
        # folded for floats).
        wide = wide_dtype()
        zero = (jnp.where(jnp.isfinite(flat[0, 0]), flat[0, 0], 0.0) * 0.0).astype(wide)
        return _wide_dot(flat, int8_values(q).astype(wide) + zero) * scale
    return _wide_dot(flat, int8_values(q)) * scale


def kernel_takes(rows: int, kind: str) -> bool:
    """Whether the kernel's own product serves this many rows of weights of `kind` (weight_kind), else
    widened for XLA's dot: always where it takes every chunk (PREFILL_BY_KERNEL) or where it
    multiplies the kind's long chunks on AMX tiles (TILE_KINDS)."""
    return PREFILL_BY_KERNEL or rows <= INT8_ROWS_MAX_ROWS or (kind in TILE_KINDS and native.tiles())


def _is_held(x) -> bool:
    """Whether x is a quantized matrix's dict (weight_kind other than "float"), not a layer's."""
    return isinstance(x, dict) and (("q" in x and "scale" in x) or PER_PART in x or "f8" in x or native.is_int5(x)
                                    or native.is_q8(x) or bool(native.k_kind(x) or native.s_kind(x)))


def widened_kinds(params) -> set[str]:
    """The weight kinds of params' quantized matrices (a mixed matrix's, of its parts) whose long
    prefill chunks are widened for XLA's dot (kernel_takes), as the start-up log names them: there a
    row's numbers depend on its chunk."""
    held = [leaf for leaf in jax.tree_util.tree_leaves(params, is_leaf=_is_held) if _is_held(leaf)]
    parts = [part for leaf in held for part in (leaf[PER_PART].values() if PER_PART in leaf else [leaf])]
    kinds = {weight_kind(part) for part in parts if _is_held(part)}
    return {"int8" if kind.startswith("int8") else kind.upper()
            for kind in kinds if not kernel_takes(INT8_ROWS_MAX_ROWS + 1, kind)}


def _int8_packed_matmul(flat, w):
    """The kernel's product (kernel_takes): it makes the ROW_TERMS terms, multiplies and scales them
    in one call, streaming the weights at the memory's speed (YNNPACK's integer kernels are
    compute-bound there). A longer chunk elsewhere takes the weights widened by the kernel's second
    pass (XLA's transpose of the packed layout was slower), which reads the input first for the same
    reason as _int8_matmul's zero."""
    q, scale = w["q"], w["scale"]
    if kernel_takes(flat.shape[0], "int8_packed"):
        return native.int8_matmul(flat, q, scale)
    return _widened_dot(flat, {"q": q}, lambda part, after: native.widen(part["q"], after=after)) * scale


def _q5_0_matmul(flat, w):
    """The kernel's own product (kernel_takes), else the blocks' values (scales applied) widened for
    XLA's dot."""
    if kernel_takes(flat.shape[0], "q5_0"):
        return native.int5_matmul(flat, w)
    return _widened_dot(flat, w, lambda part, after: native.widen5(part, after=after))


def _q8_0_matmul(flat, w):
    """As _q5_0_matmul, for Q8_0 blocks."""
    if kernel_takes(flat.shape[0], "q8_0"):
        return native.q8_matmul(flat, w)
    return _widened_dot(flat, w, lambda part, after: native.widen8(part, after=after))


def _k_matmul(flat, w):
    """As _q5_0_matmul, for K-quant blocks."""
    if kernel_takes(flat.shape[0], weight_kind(w)):
        return native.k_matmul(flat, w)
    return _widened_dot(flat, w, lambda part, after: native.widen_k(part, after=after))


_S_KINDS = ("iq4_nl", "iq4_xs", "iq3_s", "q3_k")          # engine.native.pack_s's


def _s_matmul(flat, w):
    """As _q5_0_matmul, for scaled-level blocks (IQ4_NL, IQ4_XS, IQ3_S, Q3_K)."""
    if kernel_takes(flat.shape[0], weight_kind(w)):
        return native.s_matmul(flat, w)
    return _widened_dot(flat, w, lambda part, after: native.widen_s(part, after=after))


def fp8_values(w, dtype):
    """FP8 weights -> their values f8 * f8_scale [..., out, in] in dtype (stacked experts too): each
    block's product rounded once from float32 (exact in float32: an e4m3 value has 4 significant
    bits)."""
    f8, scale = w["f8"], w["f8_scale"]
    block = f8.shape[-1] // scale.shape[-1]
    return (f8.astype(F32) * jnp.repeat(scale, block, axis=-1, total_repeat_length=f8.shape[-1])).astype(dtype)


def _fp8_matmul(flat, w):
    """FP8 weights widened per block at use, then one dot: on accelerators in bfloat16 (XLA fuses
    the widening into the dot's operand where it can: tests/bench/device_bench.py measures it), on a
    CPU in float32, even one with bfloat16 dot products (the rows' bfloat16 rounding is what int8's
    prefill chunks trade for speed; FP8's dot serves every row). The weights stay 1 byte each in
    memory."""
    wide = F32 if _xla_cpu() else wide_dtype()
    return _wide_dot(flat, fp8_values(w, wide), wide)


def _parts_matmul(flat, w):
    """A matrix held per part (engine.weights.PER_PART): the input gathered by "cols" where the parts
    hold the inputs in another order, each part's own product, their outputs joined and gathered by
    "rows" into the matrix's order: each output is its part's product, exactly."""
    if "cols" in w:
        flat = jnp.take(flat, w["cols"], axis=-1)
    y = jnp.concatenate([matmul(flat, w[PER_PART][key]) for key in sorted(w[PER_PART], key=int)], axis=-1)
    return jnp.take(y, w["rows"], axis=-1) if "rows" in w else y


def _shape(w, kind: str) -> tuple[int, int]:
    """(out, in) of a quantized weight as a matrix."""
    if kind == "parts":
        parts = [tuple(p.shape) if weight_kind(p) == "float" else _shape(p, weight_kind(p))
                 for p in w[PER_PART].values()]
        return (len(w["rows"]) if "rows" in w else sum(out for out, _ in parts),
                len(w["cols"]) if "cols" in w else parts[0][1])
    if kind == "q5_0":
        return w["nib"].shape[0] * native.LANES, w["nib"].shape[1] * native.NIBBLE_GROUP
    if kind == "q8_0":
        return w["q8"].shape[0] * native.LANES, w["q8"].shape[1] * native.GROUP
    if kind in ("q4_k", "q5_k", "q6_k"):
        return w["knib"].shape[0] * native.LANES, w["knib"].shape[1] * native.NIBBLE_GROUP
    if kind in _S_KINDS:
        return native.s_shape(w)
    if kind == "fp8":
        return w["f8"].shape
    q = w["q"]
    return (q.shape[0] * native.LANES, q.shape[1] * native.GROUP) if kind == "int8_packed" else q.shape


_QUANTIZED_MATMUL = {"int8": _int8_matmul, "int8_packed": _int8_packed_matmul, "q5_0": _q5_0_matmul,
                     "q8_0": _q8_0_matmul, "q4_k": _k_matmul, "q5_k": _k_matmul, "q6_k": _k_matmul,
                     **{kind: _s_matmul for kind in _S_KINDS}, "fp8": _fp8_matmul, "parts": _parts_matmul}


def matmul(x, w):
    """x [..., in] times w [out, in] (each output a dot product with a row of w) -> [..., out]
    float32, taking the weights in their own form (weight_kind) and accumulating in float32."""
    rows = int(np.prod(x.shape[:-1]))
    kind = weight_kind(w)
    if kind != "float":
        out_dim, in_dim = _shape(w, kind)
        y = _QUANTIZED_MATMUL[kind](x.reshape(rows, in_dim).astype(F32), w)
        return y.reshape(*x.shape[:-1], out_dim)
    if w.dtype == F32 and 2 <= rows <= SUMMED_PRODUCT_MAX_ROWS:
        flat = x.reshape(rows, 1, w.shape[1]).astype(F32)
        # Weights as the first operand: with the rows first, the same program ran 1.6x slower.
        # Only float32 weights take the summed form: that is the CPU's compute dtype.
        return jnp.sum(w * flat, axis=-1).reshape(*x.shape[:-1], w.shape[0])
    return lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                           preferred_element_type=F32)


def embed(table, tokens):
    """Rows of the embedding table for tokens, in float32 (an int8 table: its rows times their scales;
    Q8_0 and K-quant blocks: their weights as the blocks define them)."""
    kind = weight_kind(table)
    if kind == "float":
        return table[tokens].astype(F32)
    if kind == "q8_0":
        return native.q8_rows(table, tokens)
    if kind.upper() in native.K_SUB:
        return native.k_rows(table, tokens)
    q = table["q"]
    rows = native.packed_rows(q, tokens) if kind == "int8_packed" else q[tokens]
    return int8_values(rows).astype(F32) * table["scale"][tokens][..., None]


def tree_sum(x):
    """The sum over x's last axis (kept, size 1) in one fixed pairwise order: the upper half added to
    the lower, elementwise, until one is left (zeros pad it to a power of two). XLA's reduce orders a
    row's sum by the shape around it (from 8 rows on it vectorizes across rows): with it a decode
    step and a verification of drafts (engine.speculative) gave one position different numbers."""
    n = x.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def row_exact_rows(native_kernel: bool) -> int | None:
    """How many rows row_exact_matmul takes on XLA:CPU (None: any), and 0 elsewhere."""
    return 0 if not _xla_cpu() else None if native_kernel else INT8_ROWS_MAX_ROWS


def row_exact_matmul(x, w, *, native_kernel: bool):
    """x [rows, in] times float w [out, in], a row's numbers whatever the rows beside it, as the
    integer products' are (a MoE router's scores in a prefill chunk, a decode step and a
    verification of drafts alike). native_kernel: engine.native's row_dot, any rows; else each
    output summed in tree_sum's order, up to INT8_ROWS_MAX_ROWS rows (its broadcast product is
    rows x out x in floats)."""
    if native_kernel:
        return native.row_dot(x.astype(F32), w.astype(F32))
    return tree_sum(w[None].astype(F32) * x[:, None, :].astype(F32))[..., 0]


def swiglu(rows, gate_up, down):
    """The SwiGLU MLP (dense layers, each routed expert, the shared expert): down(silu(gate) * up)."""
    return matmul(gated(matmul(rows, gate_up)), down)


def gated(y):
    """silu(gate) * up from a gate_up product y [..., 2 f], gate and up interleaved row by row
    (engine.weights: a device of a tensor-parallel mesh holds the gate and up of the same channels)."""
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    return jax.nn.silu(pairs[..., 0]) * pairs[..., 1]
