"""Causal attention over the KV cache: writing a layer's new keys and values, and reading each slot
up to the batch's live length.

    write_kv(kv, k, v, slots, where) -> the layer's cache with k, v written
    attend(q, kv, slots, positions, live, *, native) -> [B, KV, G, T, D] float32

Two implementations, chosen in attend: engine.native's kernel for every call over the int8 cache
where the kernel serves the model (ModelConfig.native), in one summation order per token, so that a
position's numbers do not depend on the call (decode step, verification, prefill chunk of any
length); XLA's blocked loop (_attend_blocks) for everything else (float caches, accelerators,
several devices, a CPU the kernel does not serve).

The cache (engine.cache) keeps positions on every array's last axis: k, v [slots, KV, D, ctx]; an int8
cache adds k_scale, v_scale float32 [slots, KV, ctx], each position's key and value of a KV head
rounded to int8 on its own scale (largest magnitude / 127). The figures behind the choices here are
in docs/performance.md.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from engine import cpu, native, products
from engine.products import F32, int8_terms, int8_terms_product, quantize_rows, uint8_int8_dot


def kv_dtype_for(platform: str):
    """KV cache dtype for a JAX platform: the narrowest one attention does not run slower with. On a
    CPU int8 with integer products where the CPU has int8 dot products or AVX2
    (engine.cpu.auto_kv_dtype), else float16 (widened to float32 as fast as float32, with half the bytes; bfloat16 ran 3-5x
    slower there). Accelerators keep bfloat16."""
    return jnp.dtype(cpu.auto_kv_dtype()) if platform == "cpu" else jnp.bfloat16


def _kv_compute_dtype(kv_dtype):
    """The dtype attention multiplies a float cache in: float16 (a CPU's storage dtype) is widened to
    float32, which XLA:CPU converts at full speed; other dtypes are used as they are."""
    return F32 if kv_dtype == jnp.float16 else kv_dtype


# Attention reads each slot in blocks of this many positions, in a loop whose trip count is the
# batch's live length (a run-time value), so one compiled program serves every context length and a
# step costs what the live context costs; a short context pays for at most one block past its length.
ATTENTION_BLOCK = 512
# XLA's loop over the int8 cache (where the kernel does not serve) multiplies a few query rows as
# integers, as int8 weights do: the queries become QUERY_TERMS int8 terms, one exact int8 product per
# block reads the keys; the probabilities times the values' scales (never negative) become one
# unsigned term of PROB_LEVELS levels per row. Integer sums are exact, so a prompt served partly from
# the prompt cache gives the tokens a cold run gives (float sums would follow the rows of the call).
QUERY_TERMS = 2
# 255 levels (all of uint8's; 127 were coarse enough to flip a token); where the CPU has no unsigned x
# signed int8 kernels the levels are shifted by PROB_SHIFT into int8 and the shift's product added
# back (exact: the same numbers).
PROB_LEVELS = 255
PROB_SHIFT = 128
# Past this many query rows (a prefill chunk) quantizing the rows cost more than the integer products
# saved: the int8 blocks are widened exactly to WIDE_INT8_ATTENTION instead (bfloat16 where the CPU
# has bfloat16 dot products, else float32).
INT8_ATTENTION_MAX_ROWS = 128
WIDE_INT8_ATTENTION = jnp.bfloat16 if products.CPU_HAS_BF16 else F32


def to_cache(x, dtype):
    """x in the cache's dtype; float16 saturates at its largest finite value instead of becoming
    inf (keys and values of real models stay far below it, but an inf would poison every score)."""
    if dtype == jnp.float16:
        limit = float(jnp.finfo(jnp.float16).max)
        x = jnp.clip(x, -limit, limit)
    return x.astype(dtype)


def write_kv(kv, k, v, slots, where):
    """The layer's cache with keys and values k, v [B, T, KV, D] written at positions where [B, T]
    of the rows' slots (a position past ctx is dropped). An int8 cache also takes their scales."""
    rows = slots[:, None]
    out = {}
    for name, x in (("k", k), ("v", v)):
        if kv[name].dtype == jnp.int8:
            x, scale = quantize_rows(x)
            out[name + "_scale"] = kv[name + "_scale"].at[rows, :, where].set(scale[..., 0], mode="drop")
        out[name] = kv[name].at[rows, :, :, where].set(to_cache(x, kv[name].dtype), mode="drop")
    return out


def attend(q, kv, slots, positions, live, *, native_kernel: bool, valid=None):
    """Causal attention of q [B, KV, G, T, D] (float32, already scaled) over positions [0, live) of
    each row's slot: a query at position p sees keys 0..p. kv: the layer's cache, already holding
    this call's keys and values. native_kernel: engine.native's kernel serves the model. valid [B, T]
    (optional): the positions that are a prompt's or an answer's, not padding; the kernel reads no
    keys for the others, whose outputs are then zero (elsewhere they read up to the live length).
    Returns [B, KV, G, T, D] float32."""
    b, kv_heads, group, t, d = q.shape
    if native_kernel and kv["k"].dtype == jnp.int8:
        # The kernel's attention: exact integer products of the int8 keys and values with the
        # queries and the softmax weights rounded to int16, in a summation order of each token's
        # own (engine/native.cc: Int8Attend). Every token is a query row of its own, which gets
        # the numbers it gets alone: a prompt's keys and values are the same read in any chunks,
        # cold or cached, by a decode step or in a verification of drafts. A chunk's tokens share
        # the kernel's passes over the keys. Padding tokens read nothing (position -1): at a long
        # context a short prompt's padded chunk would otherwise read it all once per padded token.
        flat = q.transpose(0, 3, 1, 2, 4).reshape(b * t, kv_heads, group, d)
        read = jnp.minimum(positions, live - 1)
        if valid is not None:
            read = jnp.where(valid, read, -1)
        out = native.int8_attend(flat, kv["k"], kv["v"], kv["k_scale"], kv["v_scale"],
                                 jnp.repeat(slots, t), read.reshape(b * t))
        return out.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4)
    return _attend_blocks(q, kv, slots, positions, live)


# ---- XLA's attention: the cache read in blocks with a running softmax ------------------------------

def _slot_block(arr, slots, start, block: int):
    """Positions [start, start + block) of each row's slot (positions are every cache array's last
    axis): [B, ...] with `block` last. One row is a plain dynamic slice; a row for every slot slices
    the block of every slot and picks the rows' order from it (faster than a gather); other batches
    gather one block per row, never a whole slot."""
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


def _int8_dot(terms, scales, n: int, block, contract: int):
    """n int8 terms of x [B, KV, R, c] times an int8 cache block [B, KV, ...], contracting x's last
    axis with the block's axis `contract`: [B, KV, R, out] float32."""
    return int8_terms_product(terms, scales, n, block, (((3,), (contract,)), ((0, 1), (0, 1))))


def _probs_product(x, values):
    """x [B, KV, R, S] >= 0 (probabilities times the values' scales) times an int8 value block
    [B, KV, D, S] -> [B, KV, R, D] float32: each row rounded to PROB_LEVELS on its own scale (its
    largest / PROB_LEVELS), one exact integer product, times the scales."""
    peak = jnp.max(x, axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak / PROB_LEVELS, 1.0)
    # x <= peak, so the rounded row stays within [0, PROB_LEVELS].
    levels = jnp.round(x * jnp.where(peak > 0, PROB_LEVELS / peak, 0.0))
    numbers = (((3,), (3,)), ((0, 1), (0, 1)))
    if products.UINT8_DOT:
        y = uint8_int8_dot(levels.astype(jnp.uint8), values, numbers)
    else:                               # sum (l - 128) v + 128 sum v: an int8 x int8 product
        shifted = (levels - PROB_SHIFT).astype(jnp.int8)
        y = lax.dot_general(shifted, values, numbers, preferred_element_type=jnp.int32)
        y = y + PROB_SHIFT * jnp.sum(values, axis=-1, dtype=jnp.int32)[:, :, None, :]
    return y.astype(F32) * scale


def integer_attention(query_rows: int) -> bool:
    """Whether XLA's attention over an int8 cache multiplies integers for a call of this many query
    rows (rows x query heads per KV head x tokens), else widens the cache's blocks."""
    return query_rows <= INT8_ATTENTION_MAX_ROWS


def _attend_blocks(q, kv, slots, positions, live):
    """attend's XLA path: one block of ATTENTION_BLOCK positions at a time with a running (online)
    softmax."""
    b, kv_heads, group, t, d = q.shape
    cache_k, cache_v = kv["k"], kv["v"]
    ctx = cache_k.shape[-1]
    block = min(ATTENTION_BLOCK, ctx)
    # Group and tokens as one axis: XLA:CPU ran this 4-D product 5x faster than a 5-D one with a T
    # axis of 1.
    q = q.reshape(b, kv_heads, group * t, d)
    narrow = cache_k.dtype == jnp.int8
    integer = narrow and integer_attention(b * group * t)
    # An int8 cache's blocks are widened exactly to `calc` (every int8 is a bfloat16) and their
    # per-position scales multiply the scores and the probabilities instead.
    calc = WIDE_INT8_ATTENTION if narrow else _kv_compute_dtype(cache_k.dtype)
    batch = ((0, 1), (0, 1))
    if integer:
        q_terms = int8_terms(q, QUERY_TERMS)
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
