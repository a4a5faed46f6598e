"""The KV slot pool the model owns, and the few moves the runtime makes on it.

The cache is a list with one dict per layer; for an attention layer:
    "k", "v": [slots, kv_heads, head_dim, ctx]       positions last: attention's products read
                                                     blocks of positions fastest that way (engine.model)
    "k_scale", "v_scale": [slots, kv_heads, ctx]     an int8 cache only: each position's scale
and for a Gated DeltaNet ("linear") layer, the state a slot's sequence has reached:
    "conv":  [slots, conv_dim, kernel - 1]   the last kernel - 1 inputs of the causal convolution
    "state": [slots, value_heads, key_dim, value_dim]   the delta rule's recurrent state
Both float32 whatever the KV dtype: they are small, and they are rewritten every token, so rounding
would accumulate. Unlike K/V they hold the whole sequence at its end and cannot be cut back: the
forward starts them from zero when a row starts at position 0, and a reused prefix brings its state
along as a snapshot (read_state / write_state). The position copies (copy_prefix, read_slot,
write_slot) move attention layers only.
K and V are in the KV dtype (engine.attention.kv_dtype_for: int8 with float32 scales on CPUs with int8
dot products, else float16; bfloat16 on accelerators), and so is what read_slot hands the host
cache. A slot holds one sequence: position p of that sequence lives at index p along ctx. What a
slot holds past its sequence's length is garbage that the forward never reads (its mask stops at
each query's own position).

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
from engine.model import delta_replay
from engine.sharding import to_host

# copy_prefix moves this many positions per loop step: big enough that the loop overhead is
# nothing, small enough that a short prefix does not pay for a long block.
COPY_BLOCK = 256
# Host copies (read_slot/write_slot) move this many positions per call, at a run-time position: one
# program each serves every length, and a call moves 6.4 MiB of the demo's int8 cache (12 in float16).
HOST_BLOCK = 1024
# An int8 cache's per-position scales. Every attention cache array, these too, keeps positions on
# its last axis (a linear layer's state has none), so the position copies treat all alike.
KV_SCALES = ("k_scale", "v_scale")


def _zeros(name: str, shape: tuple, dtype):
    return jnp.zeros(shape, dtype)


def init_cache(cfg: ModelConfig, slots: int, ctx: int, dtype, zeros=_zeros, mtp: bool = False) -> list[dict]:
    """An empty pool of `slots` sequences of up to `ctx` tokens each. zeros(name, shape, dtype)
    makes each array (engine.sharding: already split over the mesh's devices). mtp: two entries
    more, the MTP layer's (engine.model.draft): its KV cache, laid out as an attention layer's, and
    the trunk's hidden state at each slot's last position, {"hidden": [slots, hidden]} float32."""
    if slots < 1 or ctx < 1:
        raise ValueError(f"init_cache needs slots >= 1 and ctx >= 1, got slots={slots} ctx={ctx}")
    cache = []
    kinds = list(cfg.layer_kinds) + ([next(k for k in cfg.layer_kinds if k != "linear")] if mtp else [])
    for kind in kinds:
        if kind == "linear":
            cache.append({
                "conv": zeros("conv", (slots, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1), jnp.float32),
                "state": zeros("state", (slots, cfg.linear_value_heads, cfg.linear_key_dim,
                                         cfg.linear_value_dim), jnp.float32),
            })
            continue
        if kind not in ("attention", "gated_attention"):
            raise ValueError(f"layer kind {kind!r} has no cache layout")
        layer = {name: zeros(name, (slots, cfg.num_kv_heads, cfg.head_dim, ctx), dtype) for name in "kv"}
        if np.dtype(dtype) == np.int8:
            layer.update({name: zeros(name, (slots, cfg.num_kv_heads, ctx), jnp.float32)
                          for name in KV_SCALES})
        cache.append(layer)
    if mtp:
        cache.append({"hidden": zeros("hidden", (slots, cfg.hidden_size), jnp.float32)})
    return cache


def cache_dims(cache) -> tuple[int, int]:
    """(slots, ctx) of a pool (read from its first attention layer: linear layers have no ctx)."""
    shape = next(layer["k"] for layer in cache if "k" in layer).shape
    return shape[0], shape[-1]


def cache_bytes(cache) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))


def has_state(cache) -> bool:
    """Whether the pool has a state at each sequence's end (linear layers, the MTP carry), which a
    prefix reuse must restore (snapshots)."""
    return any(not _positional(layer) for layer in cache)


def _positional(layer: dict) -> bool:
    """An attention layer: its arrays hold one entry per position (K/V), unlike a linear layer's
    state, which holds the whole sequence at its end and moves only as a snapshot (read_state)."""
    return "k" in layer


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
            if not _positional(layer):
                out.append(layer)
                continue
            new = {}
            for name, arr in layer.items():
                axis = arr.ndim - 1
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


def host_block(ctx: int) -> int:
    """Positions one host copy call moves (the last block of a slot is shifted back inside it)."""
    return min(HOST_BLOCK, ctx)


def warm_host_copies(cache):
    """Compile the read_slot/write_slot programs now (start-up), so none compiles after ready.
    Round-trips one block of slot 0 through the host, which leaves its contents as they were."""
    return write_slot(cache, 0, read_slot(cache, 0, 1))


def warm_state_copies(cache):
    """Compile the read_state/write_state programs now (start-up), the same way."""
    return write_state(cache, 0, read_state(cache, 0))


def _block_at(arr, slot, begin, block: int):
    """Positions [begin, begin + block) of one slot of a cache array."""
    sizes = list(arr.shape)
    sizes[0], sizes[-1] = 1, block
    at = (slot,) + (0,) * (arr.ndim - 2) + (begin,)
    return at, lax.dynamic_slice(arr, at, sizes)


@partial(jax.jit, static_argnames=("block",))
def _read(cache, slot, begin, *, block):
    return [{name: _block_at(arr, slot, begin, block)[1][0]
             for name, arr in layer.items()} for layer in cache if _positional(layer)]


@partial(jax.jit, donate_argnames=("cache",))
def _write(cache, slot, begin, lo, hi, arrays):
    """Write one block at positions [begin, begin + block) of `slot`, keeping what the slot holds
    outside [lo, hi): a block shifted back to end at ctx, or one that starts inside a part the
    slot already holds, changes only the positions it was given."""
    out, given = [], iter(arrays)
    for layer in cache:
        if not _positional(layer):
            out.append(layer)
            continue
        new, updated = next(given), {}
        for name, arr in layer.items():
            block = new[name].shape[-1]
            at, old = _block_at(arr, slot, begin, block)
            pos = begin + lax.broadcasted_iota(jnp.int32, old.shape, arr.ndim - 1)
            keep = (pos >= lo) & (pos < hi)
            updated[name] = lax.dynamic_update_slice(
                arr, jnp.where(keep, new[name][None].astype(arr.dtype), old), at)
        out.append(updated)
    return out


def _blocks(start: int, n: int, ctx: int):
    """(begin, lo, hi) of each host copy block covering positions [start, n): each block is
    [begin, begin + host_block(ctx)) inside the slot, and [lo, hi) the part of [start, n) it moves."""
    block = host_block(ctx)
    for lo in range(start, n, block):
        yield min(lo, ctx - block), lo, min(lo + block, n)


def read_slot(cache, slot: int, n: int, start: int = 0) -> list[dict]:
    """Positions [start, n) of one slot as host numpy arrays, per attention layer {"k", "v":
    [kv, d, n - start]} and an int8 cache's scales [kv, n - start] (the cache's own layout and dtype,
    so write_slot puts them back without reshuffling). A start lets a save copy only what the host
    does not hold yet. Moves host_block(ctx) positions per call: one compiled program serves every
    length. Each block is copied into the result as it arrives, so the host holds the result and one
    block, never every block and then their join besides."""
    slots, ctx = cache_dims(cache)
    if not 0 <= slot < slots or not 0 <= start <= n <= ctx:
        raise ValueError(f"read_slot: slot {slot} / positions [{start}, {n}) outside the pool "
                         f"({slots} x {ctx})")
    out = [{name: np.empty(a.shape[1:-1] + (n - start,), a.dtype) for name, a in layer.items()}
           for layer in cache if _positional(layer)]
    for begin, lo, hi in _blocks(start, n, ctx):
        arrays = to_host(_read(cache, jnp.int32(slot), jnp.int32(begin), block=host_block(ctx)))
        for got, layer in zip(arrays, out):
            for name, a in got.items():
                layer[name][..., lo - start:hi - start] = a[..., lo - begin:hi - begin]
    return out


def position_bytes(cache) -> int:
    """Bytes read_slot returns per position (K/V and an int8 cache's scales)."""
    slots, ctx = cache_dims(cache)
    return sum(a.nbytes for layer in cache if _positional(layer) for a in layer.values()) // (slots * ctx)


def write_slot(cache, slot: int, arrays: list[dict], start: int = 0):
    """Put arrays holding positions [start, n) (what read_slot returned, any length) at those
    positions of `slot`, and nothing else: what the slot holds before start, and from n on, stays.
    Returns the new cache (the old one is donated)."""
    slots, ctx = cache_dims(cache)
    layers = [layer for layer in cache if _positional(layer)]
    if len(arrays) != len(layers):
        raise ValueError(f"write_slot: {len(arrays)} layers given, the cache has {len(layers)} "
                         f"attention layers")
    n = start + arrays[0]["k"].shape[-1]
    if not 0 <= slot < slots or not 0 <= start <= n <= ctx:
        raise ValueError(f"write_slot: slot {slot} / positions [{start}, {n}) outside the pool "
                         f"({slots} x {ctx})")
    block = host_block(ctx)
    for begin, lo, hi in _blocks(start, n, ctx):
        padded = []
        for layer, host in zip(layers, arrays):
            blocks = {}
            for name, arr in layer.items():
                blocks[name] = np.zeros(arr.shape[1:-1] + (block,), arr.dtype)
                blocks[name][..., lo - begin:hi - begin] = host[name][..., lo - start:hi - start]
            padded.append(blocks)
        cache = _write(cache, jnp.int32(slot), jnp.int32(begin), jnp.int32(lo), jnp.int32(hi), padded)
    return cache


# ---- linear layers' state: snapshots ------------------------------------------------------------

@jax.jit
def _read_state(cache, slot):
    return [{name: arr[slot] for name, arr in layer.items()} for layer in cache if not _positional(layer)]


@partial(jax.jit, donate_argnames=("cache",))
def _write_state(cache, slot, snapshot):
    given, out = iter(snapshot), []
    for layer in cache:
        if _positional(layer):
            out.append(layer)
            continue
        new = next(given)
        out.append({name: arr.at[slot].set(new[name].astype(arr.dtype)) for name, arr in layer.items()})
    return out


def read_state(cache, slot: int) -> list[dict]:
    """The state a slot's sequence has reached, per linear layer {"conv": [conv_dim, kernel - 1],
    "state": [heads, key_dim, value_dim]} (and the MTP carry {"hidden": [hidden]}, where the pool has
    one) as host numpy arrays: a snapshot, valid at exactly the position the slot's sequence has
    reached when it is read."""
    slots, _ = cache_dims(cache)
    if not 0 <= slot < slots:
        raise ValueError(f"read_state: slot {slot} outside the pool of {slots}")
    return to_host(_read_state(cache, jnp.int32(slot)))


def write_state(cache, slot: int, snapshot: list[dict]):
    """Put a snapshot (what read_state returned) into `slot`'s linear layers; K/V stay as they are.
    Returns the new cache (the old one is donated)."""
    slots, _ = cache_dims(cache)
    linear = sum(1 for layer in cache if not _positional(layer))
    if not 0 <= slot < slots or len(snapshot) != linear:
        raise ValueError(f"write_state: slot {slot} of {slots}, {len(snapshot)} layers given for "
                         f"{linear} layers with a state")
    return _write_state(cache, jnp.int32(slot), snapshot)


# ---- linear layers' state after a verification of drafts ------------------------------------------

@partial(jax.jit, donate_argnames=("cache",))
def keep_steps(cache, steps, slots, at):
    """After a verification of drafts (engine.speculative): row b's slot keeps its state after
    position at[b] of the verification, its last kept token; a row with at[b] < 0 (idle) leaves its
    slot as it was. steps: engine.model.forward's of a verification, one per layer with a state in
    the pool's order: a linear layer's {"conv": the conv's inputs [B, kernel - 1 + T, C], "k", "decay",
    "written": what each position did to the recurrent state}, the MTP carry's {"hidden": [B, T,
    hidden]}. A recurrent state is replayed from the slot's (which the verification left as it was)
    through positions 0 .. at[b] with the decode step's own rounded operations
    (engine.model.delta_replay): the state T decode steps would have reached, bit for bit, from
    T small vectors per head instead of T whole states. The replay is elementwise over the state,
    one pass over it per layer."""
    given, out = iter(steps), []
    rows = jnp.arange(slots.shape[0])
    keep = jnp.maximum(at, 0)
    # A run-time 0 (engine.products.rounded) from the slots, which are never negative: one made from
    # `keep` (at most 0 after max(at, 0)) was folded to a constant for one row, and the replay's
    # products fused into its sums.
    zero = jnp.minimum(jnp.min(slots), 0)
    for layer in cache:
        if _positional(layer):
            out.append(layer)
            continue
        step, new = next(given), {}
        for name, arr in layer.items():
            where = jnp.where(at >= 0, slots, arr.shape[0])                  # idle rows: dropped
            if name == "conv":                   # the window of kernel - 1 inputs after the kept one
                width = arr.shape[-1]
                window = jax.vmap(lambda s, n: lax.dynamic_slice_in_dim(s, n + 1, width, axis=0))(
                    step["conv"], keep)
                kept = jnp.swapaxes(window, 1, 2)
            elif name == "state":
                kept = arr[slots]
                for i in range(step["k"].shape[1]):
                    replayed = delta_replay(kept, step["k"][:, i], step["decay"][:, i], step["written"][:, i], zero)
                    kept = jnp.where((i <= keep)[:, None, None, None], replayed, kept)
            else:
                kept = step[name][rows, keep]
            new[name] = arr.at[where].set(kept, mode="drop")
        out.append(new)
    return out
