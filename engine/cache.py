"""The KV slot pool the model owns, and the few moves the runtime makes on it.

The cache is a list with one dict per layer; for an attention layer:
    "k": [slots, kv_heads, ctx, head_dim]
    "v": [slots, kv_heads, head_dim, ctx]    stored TRANSPOSED: the attention-times-V product then
                                             runs on XLA:CPU's fast dot (measured much faster)
A slot holds one sequence: position p of that sequence lives at index p along ctx. What a slot
holds past its sequence's length is garbage that the forward never reads (its mask stops at each
query's own position).

Helpers that change the cache are jitted with the cache donated, so XLA updates it in place
instead of writing a fresh copy of the whole pool.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine.config import ModelConfig

# copy_prefix moves this many positions per loop step: big enough that the loop overhead is
# nothing, small enough that a short prefix does not pay for a long block.
COPY_BLOCK = 256
# Host copies (read_slot/write_slot) move a power-of-two bucket of positions, so the number of
# compiled programs grows with log2(ctx), not with every length; below this they share one bucket.
MIN_HOST_BUCKET = 64


def init_cache(cfg: ModelConfig, slots: int, ctx: int, dtype) -> list[dict]:
    """An empty pool of `slots` sequences of up to `ctx` tokens each."""
    if slots < 1 or ctx < 1:
        raise ValueError(f"init_cache needs slots >= 1 and ctx >= 1, got slots={slots} ctx={ctx}")
    cache = []
    for kind in cfg.layer_kinds:
        if kind != "attention":
            raise ValueError(f"layer kind {kind!r} has no cache layout")
        cache.append({
            "k": jnp.zeros((slots, cfg.num_kv_heads, ctx, cfg.head_dim), dtype),
            "v": jnp.zeros((slots, cfg.num_kv_heads, cfg.head_dim, ctx), dtype),
        })
    return cache


def cache_dims(cache) -> tuple[int, int]:
    """(slots, ctx) of a pool."""
    slots, _, ctx, _ = cache[0]["k"].shape
    return slots, ctx


def cache_bytes(cache) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))


@partial(jax.jit, donate_argnames=("cache",))
def copy_prefix(cache, src_slot, dst_slot, n):
    """Copy positions [0, n) of `src_slot` into `dst_slot` (prefix reuse across slots).
    All three are traced ints: one compiled program serves every slot pair and length, and the
    loop moves COPY_BLOCK positions at a time up to n, so the cost follows n, not ctx."""
    _, ctx = cache_dims(cache)
    block = min(COPY_BLOCK, ctx)

    def copy_block(i, cache):
        # The last block may reach past ctx; dynamic_slice then shifts it back to end at ctx, and
        # the mask below is computed from where the block really starts.
        start = jnp.minimum(i * block, ctx - block)
        out = []
        for layer in cache:
            new = {}
            for name, arr in layer.items():
                axis = 2 if name == "k" else 3                  # where ctx lives in this array
                sizes = list(arr.shape)
                sizes[0], sizes[axis] = 1, block
                at = lambda slot: tuple(slot if a == 0 else start if a == axis else 0
                                        for a in range(arr.ndim))
                src = lax.dynamic_slice(arr, at(src_slot), sizes)
                dst = lax.dynamic_slice(arr, at(dst_slot), sizes)
                pos = start + lax.broadcasted_iota(jnp.int32, sizes, axis)
                new[name] = lax.dynamic_update_slice(arr, jnp.where(pos < n, src, dst), at(dst_slot))
            out.append(new)
        return out

    return lax.fori_loop(0, (n + block - 1) // block, copy_block, cache)


def _host_bucket(n: int, ctx: int) -> int:
    bucket = MIN_HOST_BUCKET
    while bucket < n:
        bucket *= 2
    return min(bucket, ctx)


def host_buckets(ctx: int) -> list[int]:
    """Every length read_slot/write_slot compile a program for, given ctx."""
    buckets, bucket = [], MIN_HOST_BUCKET
    while bucket < ctx:
        buckets.append(bucket)
        bucket *= 2
    return buckets + [ctx]


def warm_host_copies(cache):
    """Compile every read_slot/write_slot program now (start-up), so none compiles after ready.
    Round-trips slot 0 through the host, which leaves its contents as they were."""
    _, ctx = cache_dims(cache)
    for bucket in host_buckets(ctx):
        cache = write_slot(cache, 0, read_slot(cache, 0, bucket))
    return cache


@partial(jax.jit, static_argnames=("length",))
def _read(cache, slot, begin, *, length):
    return [{"k": lax.dynamic_slice_in_dim(
                 lax.dynamic_index_in_dim(layer["k"], slot, 0, keepdims=False), begin, length, 1),
             "v": lax.dynamic_slice_in_dim(
                 lax.dynamic_index_in_dim(layer["v"], slot, 0, keepdims=False), begin, length, 2)}
            for layer in cache]


def read_slot(cache, slot: int, n: int, start: int = 0) -> list[dict]:
    """Positions [start, n) of one slot as host numpy arrays, per layer {"k": [kv, n - start, d],
    "v": [kv, d, n - start]} (the cache's own layout, so write_slot puts them back without
    reshuffling). A start lets a save copy only what the host does not hold yet."""
    slots, ctx = cache_dims(cache)
    if not 0 <= slot < slots or not 0 <= start <= n <= ctx:
        raise ValueError(f"read_slot: slot {slot} / positions [{start}, {n}) outside the pool "
                         f"({slots} x {ctx})")
    length = _host_bucket(n - start, ctx)
    begin = min(start, ctx - length)      # the bucket must lie inside the slot: start it earlier
    arrays = jax.device_get(_read(cache, jnp.int32(slot), jnp.int32(begin), length=length))
    a, b = start - begin, n - begin
    return [{"k": np.ascontiguousarray(layer["k"][:, a:b, :]),
             "v": np.ascontiguousarray(layer["v"][:, :, a:b])} for layer in arrays]


@partial(jax.jit, donate_argnames=("cache",))
def _write(cache, slot, arrays):
    out = []
    for layer, new in zip(cache, arrays):
        out.append({name: lax.dynamic_update_slice(
            arr, new[name][None].astype(arr.dtype), (slot, 0, 0, 0)) for name, arr in layer.items()})
    return out


def write_slot(cache, slot: int, arrays: list[dict]):
    """Put what read_slot returned (any length n <= ctx) at positions [0, n) of `slot`; returns the
    new cache (the old one is donated). Positions from n up to the next bucket are overwritten with
    zeros, which is harmless: nothing past a slot's length is ever read."""
    slots, ctx = cache_dims(cache)
    if len(arrays) != len(cache):
        raise ValueError(f"write_slot: {len(arrays)} layers given, the cache has {len(cache)}")
    n = arrays[0]["k"].shape[1]
    if not 0 <= slot < slots or not 0 <= n <= ctx:
        raise ValueError(f"write_slot: slot {slot} / length {n} outside the pool ({slots} x {ctx})")
    bucket = _host_bucket(n, ctx)
    padded = [{"k": np.pad(layer["k"], ((0, 0), (0, bucket - n), (0, 0))),
               "v": np.pad(layer["v"], ((0, 0), (0, 0), (0, bucket - n)))} for layer in arrays]
    return _write(cache, jnp.int32(slot), padded)
