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
value: the cost follows the live context, not ctx, and one compiled program per (rows, tokens)
shape serves every context length.

Numerics: the residual stream, norms, RoPE and softmax are float32; matrix products take the
weights in their own form and accumulate in float32 (bfloat16 weights on accelerators). A linear
layer's per-token arithmetic is plain float32, each operation rounded once, in every program (see
"arithmetic whose bits do not depend on the program around it").

The rooms beside this one: engine.products (every weight form's matrix product), engine.attention
(the KV cache written and read, XLA's and the native kernel's), engine.moe (routed experts).
"""
from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engine import cpu, native
from engine.attention import attend, write_kv
from engine.config import ModelConfig
from engine.moe import routed_experts
from engine.products import (F32, embed, gated, matmul, rounded, row_exact_matmul, row_exact_rows, swiglu,
                             tree_sum, weight_kind)


def dtype_for(platform: str):
    """Weights dtype for a JAX platform ("cpu", "gpu", "tpu", ...). XLA:CPU runs bfloat16
    matrix-vector products about 20x slower than float32 at one row, so the CPU computes in float32."""
    return jnp.float32 if platform == "cpu" else jnp.bfloat16


def weights_dtype_for(platform: str, asked: str | None = "auto", fp8: bool = False) -> str:
    """The weights dtype a worker holds (engine.weights.WEIGHTS_DTYPES): the one asked for, or for
    "auto" (or None) what is fastest on the platform: on a CPU with int8 dot-product instructions
    int8 (a quarter of the bytes, and faster: docs/performance.md), on other CPUs float32
    (engine.cpu.auto_weights_dtype), on accelerators bfloat16, or fp8 for an FP8 checkpoint (`fp8`:
    ModelConfig.fp8; its float8 matrices held as they are, half of bfloat16's bytes). Whether the
    checkpoint can be held as asked is engine.config.check_weights_dtype's to say."""
    if asked in (None, "auto"):
        if platform == "cpu":
            return cpu.auto_weights_dtype()
        return "fp8" if fp8 else np.dtype(dtype_for(platform)).name
    return asked


# ---- building blocks ---------------------------------------------------------------------------

def _rms_norm(x, weight, eps):
    x = x.astype(F32)
    return x * lax.rsqrt(tree_sum(x * x) / x.shape[-1] + eps) * weight.astype(F32)


def _padding_zeroed(x, valid, cfg: ModelConfig):
    """x [B, T, ...] with its padded positions (a prompt chunk's tail, an idle decode row: not valid)
    zero, where the native kernel serves: it does not compute a product's trailing zero rows
    (engine/native.cc: LiveRows), so a short prompt in a longer chunk pays for its own tokens' products
    only. Padded positions' numbers are never read (their keys aim past the cache, their state updates
    are none), and a valid position's are unchanged."""
    if not cfg.native:
        return x
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0.0)


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
    per forward for all layers. Left as plain cos/sin, XLA:CPU fused them into each rotation and
    evaluated them there per element, once per head. The product with the identity (exact: x 1 + 0
    + ... = x) is what keeps them made once: XLA does not fuse a dot into its consumers, and on CPU
    it drops optimization barriers before fusing (docs/performance.md)."""
    inv_freq, scale = rope_frequencies(cfg)
    angles = positions.astype(F32)[:, :, None, None] * inv_freq          # [B, T, 1, rot/2]
    tables = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1) * scale
    tables = _materialized(tables)
    return tuple(jnp.split(tables, 2, axis=-1))


def _rope(x, rope):
    """Rotate x [B, T, H, D] by each token's position, given as _rope_tables (halves layout, as
    Qwen checkpoints). Only the first `rot` dimensions turn (Qwen3-Next's partial rotary)."""
    cos, sin = rope
    rot = 2 * cos.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


# ---- layers ------------------------------------------------------------------------------------

def _attention(layer, kv, x, slots, positions, rope, valid, live, *, cfg: ModelConfig, gated=False):
    """Full causal attention over the slot's cache. x [B, T, hidden] float32 (already normed).
    gated (Qwen3-Next): the query projection also yields, per head, an output gate that scales the
    attention output through a sigmoid before the output projection.
    Returns (output [B, T, hidden], the layer's updated cache)."""
    b, t, _ = x.shape
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    q, gate, cache = _attention_entries(layer, kv, x, slots, positions, rope, valid, cfg=cfg, gated=gated)
    q = q.reshape(b, t, cfg.num_kv_heads, group, d).transpose(0, 2, 3, 1, 4)   # [B, KV, G, T, D]
    q = q * (1.0 / np.sqrt(d))
    out = attend(q, cache, slots, positions, live, native_kernel=cfg.native, valid=valid)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.q_size)
    if gated:
        out = out * jax.nn.sigmoid(gate)
    return matmul(_padding_zeroed(out, valid, cfg), layer["o"]), cache


def _attention_entries(layer, kv, x, slots, positions, rope, valid, *, cfg: ModelConfig, gated: bool):
    """An attention layer's projections of x [B, T, hidden] (normed), its keys and values written
    into the cache where valid. Returns (the queries [B, T, heads, head_dim], rotated; the output
    gates [B, T, q_size] or None; the updated cache)."""
    b, t, _ = x.shape
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = matmul(x, layer["qkv"])
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
        # Times the reciprocal, not divided: XLA turns a division by a broadcast factor into that
        # product in some programs and not in others (by how much the broadcast widens it), which
        # gave a position's key an ulp more or less in a verification of drafts than in a decode
        # step (engine.speculative). A product is rounded once, alike in every program.
        k = k * (1.0 / smooth)
        q = (q.reshape(b, t, kv_heads, group, d) * smooth[:, None, :]).reshape(q.shape)
    # Write the new keys/values. Padded tokens aim past the end of the slot and are dropped, so
    # idle rows and chunk padding never touch the cache.
    ctx = kv["k"].shape[-1]
    cache = write_kv(kv, k, v, slots, jnp.where(valid, positions, ctx))
    return q, gate if gated else None, cache


# ---- Gated DeltaNet (linear attention) ---------------------------------------------------------
#
# Per value head h, a recurrent state S [key_dim, value_dim] maps keys to values. At each token, with
# q and k L2-normalized (q also scaled by 1/sqrt(key_dim)), decay g <= 0 and strength beta in (0, 1):
#     S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   out = S^T q
# (the delta rule: write only what S does not already predict for k). Decode runs this one step;
# where the native kernel serves, so does a prefill chunk, token by token (delta_by_steps).
# Elsewhere prefill runs the same recurrence DELTA_CHUNK tokens at a time in its chunked (WY/UT) form:
# inside a chunk, a unit lower-triangular solve turns the chunk's updates into matrix products, and a
# scan over chunks carries S, so a prefill costs a few matrix products per chunk, not a loop per token.
# Tokens past a row's length get g = 0 and beta = 0, which leaves S exactly as it was; a chunk
# boundary inside a prefill changes only the summation order (tests compare chunkings).

# Where a prefill chunk runs the recurrence token by token as decode steps do (_delta_steps), not in
# its chunked form: wherever the native kernel serves the model, whose loop (native.delta_steps)
# runs a chunk faster than XLA's chunked form on a CPU and gives each position the decode step's
# bits however the prompt was chunked, cold or cached, or written by decode steps (docs/perf-log.md,
# "The delta rule in the kernel"). Accelerators run the chunked form's matrix products far faster.
DELTA_STEPS_ENV = "MASHBOX_DELTA_STEPS"             # "0" / "1": override (tests compare both forms)


def delta_by_steps(cfg: ModelConfig) -> bool:
    """Whether prefill chunks run the delta rule token by token (read while tracing)."""
    setting = os.environ.get(DELTA_STEPS_ENV)
    return setting == "1" if setting in ("0", "1") else cfg.native


# Tokens per chunk of the chunked delta rule (the width of its triangular solve), as the reference
# implementation uses; prefill chunks that are not a multiple of it are padded inside the layer.
# A power of two (the inverse below squares its way up to it).
DELTA_CHUNK = 64
# Epsilon of the L2 normalization of q and k (the reference's).
L2_EPS = 1e-6


# ---- arithmetic whose bits do not depend on the program around it --------------------------------
#
# A verification of drafts (engine.speculative) must give every position the numbers of a decode
# step, and a linear layer's recurrent state carries any difference to every later token. XLA:CPU
# rounds some things by the program around them: it turns a product and the sum it feeds into one
# fused multiply-add wherever both land in one fusion, and its exp gave some elements other last bits
# by the length of the loop around it (3, 5-7, 11 and 13-15 elements did). So the linear layers'
# per-token arithmetic is written out here in float32 operations each rounded once: every product
# that a sum uses is rounded on its own (engine.products.rounded), and exp, log1p and the sigmoid
# are polynomials of such operations.

# exp: e^x = 2^n e^r with n = round(x log2 e) and |r| <= ln 2 / 2, r = x - n ln 2 in two parts (the
# high part's 9 bits times n's 8 are exact), e^r by its Taylor series to r^EXP_DEGREE (the rest is
# below 2^-27 of it). Inputs are clipped to +-EXP_LIMIT, where 2^n stays a normal float32.
LOG2E = 1.4426950408889634
LN2_HI = 0.693359375
LN2_LO = -2.1219444005469057e-4
EXP_DEGREE = 7
EXP_LIMIT = 87.0
# log1p(t) for t in [0, 1] as 2 atanh(s), s = t / (2 + t) <= 1/3: the odd series to s^(2 n - 1)
# with n = LOG1P_TERMS (the rest is below 2^-27 of it).
LOG1P_TERMS = 8


def _zero(counts):
    """A run-time 0 (engine.products.rounded) from int32 values the caller knows are never negative."""
    return jnp.minimum(jnp.min(counts), 0)


def _exp(x, zero):
    """e^x (within 1.2 ulp; see EXP_DEGREE)."""
    x = jnp.clip(x, -EXP_LIMIT, EXP_LIMIT)
    n = jnp.floor(rounded(x * LOG2E, zero) + 0.5)
    r = x - rounded(n * LN2_HI, zero) - rounded(n * LN2_LO, zero)
    p = jnp.full_like(r, 1.0 / math.factorial(EXP_DEGREE))
    for k in range(EXP_DEGREE - 1, -1, -1):
        p = rounded(p * r, zero) + 1.0 / math.factorial(k)
    two_n = lax.bitcast_convert_type(lax.shift_left(n.astype(jnp.int32) + 127, 23), F32)
    return rounded(p * two_n, zero)


def _log1p(t, zero):
    """log(1 + t) for t in [0, 1] (within 3 ulp; see LOG1P_TERMS)."""
    s = t / (2.0 + t)
    s2 = rounded(s * s, zero)
    p = jnp.full_like(s, 1.0 / (2 * LOG1P_TERMS - 1))
    for k in range(LOG1P_TERMS - 2, -1, -1):
        p = rounded(p * s2, zero) + 1.0 / (2 * k + 1)
    return rounded(2.0 * s * p, zero)


def _sigmoid(x, zero):
    return 1.0 / (1.0 + _exp(-x, zero))


def _silu(x, zero):
    return rounded(x * _sigmoid(x, zero), zero)


def _softplus(x, zero):
    """log(1 + e^x), as jax.nn.softplus computes it."""
    return jnp.maximum(x, 0.0) + _log1p(_exp(-jnp.abs(x), zero), zero)


def _l2norm(x, zero):
    return x * lax.rsqrt(tree_sum(rounded(x * x, zero)) + L2_EPS)


def _key_sum(x):
    """x [..., dk, dv] summed over its keys (dk) in tree_sum's fixed pairwise order: a row's numbers
    whatever the rows and positions beside it (XLA's dot orders its sums by the shape around it)."""
    n = x.shape[-2]
    size = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, size - n), (0, 0)])
    while x.shape[-2] > 1:
        half = x.shape[-2] // 2
        x = x[..., :half, :] + x[..., half:, :]
    return x[..., 0, :]


def _materialized(x):
    """x as it is (exact: x 1 + 0 + ... = x), made once in memory before what uses it: XLA does not
    fuse a dot into its consumers (on CPU it drops optimization barriers before fusing)."""
    return jnp.einsum("...i,ij->...j", x, jnp.eye(x.shape[-1], dtype=F32), precision=lax.Precision.HIGHEST)


def _delta_step(q, k, v, decay, beta, state, zero):
    """One token for every row: q, k [B, H, dk], v [B, H, dv], decay (exp(g)), beta [B, H], state
    [B, H, dk, dv]; zero a run-time 0 (engine.products.rounded). Every product is rounded before it
    is summed. The per-head inputs are made once first: fused into the state's loops, a decode
    step computed each (the decay's exp, the conv, the norms) again for every element of the state
    it scales (docs/perf-log.md, "The Gated DeltaNet decode step"). The decay and beta ride with v:
    the identity's dot runs over each head's own values, never over the heads, which a mesh splits.
    Returns (out [B, H, dv], the new state, what k wrote [B, H, dv]: delta_replay's `written`)."""
    q, k = _materialized(q), _materialized(k)
    vdb = _materialized(jnp.concatenate([v, decay[..., None], beta[..., None]], axis=-1))
    v, decay, beta = vdb[..., :-2], vdb[..., -2], vdb[..., -1]
    decayed = _decayed(state, decay, zero)
    predicted = _key_sum(rounded(k[..., None] * decayed, zero))
    written = rounded((v - predicted) * beta[..., None], zero)            # what k writes
    state = _written_into(decayed, k, written, zero)
    return _key_sum(rounded(q[..., None] * state, zero)), state, written


def _decayed(state, decay, zero):
    return rounded(state * decay[..., None, None], zero)


def _written_into(decayed, k, written, zero):
    return decayed + rounded(k[..., None] * written[..., None, :], zero)


def delta_replay(state, k, decay, written, zero):
    """A state [..., H, dk, dv] after one more token, from that token's key [..., H, dk], decay
    [..., H] and what it wrote [..., H, dv] (_delta_step's): the same rounded operations in the same
    order as the step, so the same bits (engine.cache.keep_steps replays a verification's kept
    positions with it)."""
    return _written_into(_decayed(state, decay, zero), k, written, zero)


def _delta_steps(q, k, v, decay, beta, state, zero, *, native_kernel: bool):
    """T tokens per row one at a time, as T decode steps run them (a verification of drafts,
    engine.speculative; a prefill chunk on a CPU): q, k [B, T, H, dk], v [B, T, H, dv], decay, beta
    [B, T, H]. Returns (out [B, T, H, dv], the state after the T tokens, what each position wrote
    [B, T, H, dv]): with each position's key and decay, the state after any of them follows from
    the one before them (delta_replay), so a verification keeps T small vectors per head, not T
    states. native_kernel: engine.native's DeltaSteps runs the loop (the same bits, several times
    as fast as XLA's loop on a chunk: docs/perf-log.md, "The delta rule in the kernel")."""
    if native_kernel:
        return native.delta_steps(q, k, v, decay, beta, state)

    def step(state, xs):
        out, state, written = _delta_step(*xs, state, zero)
        return state, (out, written)

    # A loop, not T steps unrolled: XLA fused the unrolled steps into chains that computed each
    # state again for every later one (a verification of 8 cost 46 decode steps of the tiny model).
    state, (outs, written) = lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, decay, beta)))
    return jnp.moveaxis(outs, 0, 1), state, jnp.moveaxis(written, 0, 1)


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

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (values, k_decayed, inner, q_read, k_write, chunk_decay))

    def step(i, carry):
        s, out = carry
        values, k_decayed, inner, q_read, k_write, chunk_decay = (x[i] for x in xs)
        new = values - k_decayed @ s
        out = out.at[i].set(q_read @ s + inner @ new)
        return s * chunk_decay[..., None, None] + jnp.swapaxes(k_write, -1, -2) @ new, out

    # The chunks' outputs are a carry made from this layer's values (every chunk overwrites its
    # own), not a loop's stacked outputs: those start as zeros XLA made at the program's start, every
    # linear layer's at once, all held throughout the program.
    state, out = lax.fori_loop(0, n, step, (state, xs[0] * 0.0))           # out [n, B, H, c, dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, -1)[:, :, :t]
    return jnp.moveaxis(out, 1, 2), state


def _delta_inputs(lin, x, conv_state, valid, zero, cfg: ModelConfig):
    """A Gated DeltaNet layer's projections and causal conv for x [B, T, hidden]: (the conv's inputs
    [B, kernel - 1 + T, C], q, k [B, T, H, dk], v, z [B, T, H, dv], g, beta [B, T, H]); padded tokens
    (not valid) get g = 0 and beta = 0, which leave the state exactly as it was."""
    b, t, _ = x.shape
    kh, vh, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    kernel, per = cfg.linear_conv_kernel, vh // kh     # each key head serves `per` value heads
    # Rows grouped by key head (engine.weights): its q, k, then its value heads' v, z, b, a; the
    # conv channels (and the conv state) grouped the same way, so a device of a tensor-parallel
    # mesh holds whole key heads with their value heads.
    mixed = rounded(matmul(x, lin["in"]), zero).reshape(b, t, kh, 2 * dk + 2 * per * dv + 2 * per)
    qkv, z, beta, a = jnp.split(mixed, np.cumsum([2 * dk + per * dv, per * dv, per]), axis=-1)
    qkv = qkv.reshape(b, t, kh * (2 * dk + per * dv))
    # Short causal depthwise convolution over the last `kernel` inputs, the first kernel - 1 of
    # which the conv state holds (padding comes after a row's real tokens, so it never reaches a
    # real token's output).
    seq = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2), qkv], axis=1)    # [B, kernel-1+T, C]
    w = lin["conv"].astype(F32)
    conv = _silu(sum(rounded(seq[:, j:j + t] * w[:, j], zero) for j in range(kernel)), zero)
    q, k, v = jnp.split(conv.reshape(b, t, kh, -1), [dk, 2 * dk], axis=-1)
    q = rounded(_l2norm(jnp.repeat(q, per, axis=2), zero) * (1.0 / np.sqrt(dk)), zero)
    k = rounded(_l2norm(jnp.repeat(k, per, axis=2), zero), zero)
    real = valid[..., None]
    beta = jnp.where(real, _sigmoid(beta.reshape(b, t, vh), zero), 0.0)
    g = -_exp(lin["A_log"], zero) * _softplus(a.reshape(b, t, vh) + lin["dt_bias"], zero)
    g = rounded(jnp.where(real, g, 0.0), zero)
    return seq, q, k, v.reshape(b, t, vh, dv), z.reshape(b, t, vh, dv), g, beta


def _linear_attention(layer, state, x, slots, starts, lengths, valid, zero, *, cfg: ModelConfig,
                      verify: bool = False):
    """A Gated DeltaNet layer. x [B, T, hidden] float32 (already normed); state the layer's
    {"conv", "state"} pool (engine.cache); zero a run-time 0 (engine.products.rounded). Returns
    (output [B, T, hidden], the updated pool, None). verify: the T tokens run one at a time as decode
    steps run them, the pool is left as it was, and the third item is what each position did to
    the state (engine.cache.keep_steps replays a row's up to its last kept token): {"conv": the
    conv's inputs [B, kernel - 1 + T, C], "k": [B, T, H, dk], "decay": [B, T, H], "written": [B, T,
    H, dv]}."""
    b, t, _ = x.shape
    lin = layer["linear"]
    # This row's slot state; a row starting at position 0 starts a new sequence from zero.
    fresh = (starts == 0)[:, None, None]
    conv_state = jnp.where(fresh, 0.0, state["conv"][slots])              # [B, C, kernel - 1]
    recurrent = jnp.where(fresh[..., None], 0.0, state["state"][slots])    # [B, H, dk, dv]
    seq, q, k, v, z, g, beta = _delta_inputs(lin, x, conv_state, valid, zero, cfg)
    steps, pool = None, None
    if cfg.native and not verify and (t == 1 or delta_by_steps(cfg)):
        # The kernel reads and writes each row's state in its slot (the gathered `recurrent` is
        # then never used, and XLA drops it).
        out, _, pool = native.delta_steps_in_place(q, k, v, _exp(g, zero), beta, state["state"], slots, starts,
                                                   lengths)
    elif verify:
        decay = _exp(g, zero)
        out, _, written = _delta_steps(q, k, v, decay, beta, recurrent, zero, native_kernel=cfg.native)
        steps = {"conv": seq, "k": k, "decay": decay, "written": written}
    elif t == 1:
        out, recurrent, _ = _delta_step(q[:, 0], k[:, 0], v[:, 0], _exp(g[:, 0], zero), beta[:, 0], recurrent,
                                        zero)
        out = out[:, None]
    elif delta_by_steps(cfg):
        out, recurrent, _ = _delta_steps(q, k, v, _exp(g, zero), beta, recurrent, zero, native_kernel=False)
    else:
        out, recurrent = _delta_chunked(q, k, v, g, beta, recurrent)
    # Gated RMSNorm per value head: normalized, scaled, times silu of the z projection.
    out = _rms_norm(out, lin["norm"], cfg.rms_norm_eps) * _silu(z, zero)
    out = matmul(_padding_zeroed(out.reshape(b, t, -1), valid, cfg), lin["out"])
    if verify:
        return out, state, steps
    # The new conv state is the last kernel - 1 inputs of the row's real tokens. Rows with no
    # tokens (idle decode rows) write nothing: they aim past the pool and are dropped.
    width = cfg.linear_conv_kernel - 1
    new_conv = jax.vmap(lambda s, n: lax.dynamic_slice_in_dim(s, n, width, axis=0))(seq, lengths)
    where = jnp.where(lengths > 0, slots, state["state"].shape[0])
    return out, {"conv": state["conv"].at[where].set(jnp.swapaxes(new_conv, 1, 2), mode="drop"),
                 "state": state["state"].at[where].set(recurrent, mode="drop") if pool is None else pool}, None


def _mlp(layer, x):
    return swiglu(x, layer["gate_up"], layer["down"])


def _shared_expert(x, shared, zero, cfg: ModelConfig):
    """Qwen3-Next's shared expert on rows x [N, hidden]: its SwiGLU times sigmoid(x . its gate). Its
    matrices stay float (engine.weights); on XLA:CPU each float product sums in one fixed order
    (row_exact_matmul: any rows where the native kernel serves the model), so a row's numbers are
    those of a decode step whatever runs beside it (a verification of drafts, engine.speculative; a
    prefill chunk of any length), as routing's are. Not on a mesh: its tree sums over a split axis
    would move partial sums between devices at every level, and drafting, which needs them, runs on
    one device only (the native kernel's)."""
    def product(rows, w):
        most = row_exact_rows(cfg.native)
        exact = (most is None or rows.shape[0] <= most) and cfg.devices == 1
        return (row_exact_matmul(rows, w, native_kernel=cfg.native) if exact and weight_kind(w) == "float"
                else matmul(rows, w))
    out = product(gated(product(x, shared["gate_up"])), shared["down"])
    return _sigmoid(product(x, shared["gate"]), zero) * out


def _moe(layer, x, valid, zero, cfg: ModelConfig, site: int):
    """A "moe" layer's MLP on x [B, T, hidden]; Qwen3-Next's shared expert (layer["moe"]["shared"])
    adds its SwiGLU on every row times sigmoid(x . its gate)."""
    b, t, h = x.shape
    out = routed_experts(x.reshape(b * t, h), layer["moe"], valid.reshape(b * t), cfg=cfg,
                         site=site).reshape(b, t, h)
    shared = layer["moe"].get("shared")
    if shared is not None:
        out = out + _shared_expert(x.reshape(b * t, h), shared, zero, cfg).reshape(b, t, h)
    return out


# ---- the model ---------------------------------------------------------------------------------

def _layer(layer, kv, x, slots, starts, lengths, positions, rope, valid, live, *, cfg: ModelConfig,
           kind: str, mlp: str, site: int | None, verify: bool = False):
    """One decoder layer on the residual stream x [B, T, hidden]: (x after it, its updated cache,
    a linear layer's state after each position in a verification or else None)."""
    normed = _padding_zeroed(_rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps), valid, cfg)
    steps, zero = None, _zero(lengths)
    if kind == "linear":
        h, kv, steps = _linear_attention(layer, kv, normed, slots, starts, lengths, valid, zero, cfg=cfg,
                                         verify=verify)
    elif kind in ("attention", "gated_attention"):
        h, kv = _attention(layer, kv, normed, slots, positions, rope, valid, live, cfg=cfg,
                           gated=kind == "gated_attention")
    else:
        raise ValueError(f"layer kind {kind!r} is not implemented")
    x = x + h
    normed = _padding_zeroed(_rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps), valid, cfg)
    mixed = _moe(layer, normed, valid, zero, cfg, site) if mlp == "moe" else _mlp(layer, normed)
    return x + mixed, kv, steps


# Each layer as a jitted call inside forward: layers of one kind whose weights have the same shapes
# share one trace and one lowered function, which XLA inlines again (the same logits to the bit, the
# same speed). Tracing and lowering comes before the persistent compile cache can even be asked, holds
# the GIL, and ran again at every start: traced once per kind, a start traces a few times less
# (docs/performance.md). A routed-expert layer keeps a trace of its own (site): its path is recorded
# per layer (engine.moe.ROUTED_SITES). Tests that re-jit it (a patched constant) take its static
# arguments from LAYER_STATIC_ARGNAMES.
LAYER_STATIC_ARGNAMES = ("cfg", "kind", "mlp", "site", "verify")
_jit_layer = jax.jit(_layer, static_argnames=LAYER_STATIC_ARGNAMES)


# ---- the model's own drafter: its MTP layer ---------------------------------------------------------
#
# Qwen3.5/3.8 checkpoints carry one MTP (multi-token prediction) layer (engine.weights.load_mtp). Its
# entry at position p reads the trunk's hidden state h_p (the one that predicted token p + 1) and the
# embedding of token p + 1, and predicts token p + 2:
#     u = fc([norm_e(embed(x_{p+1})), norm_h(h_p)])     the embedding first, as vLLM and SGLang join them
#     y = norm(its decoder layer(u) at position p)      full attention over the MTP layer's own KV cache
#     logits = the trunk's head(y)
# and a further draft reads y as its h (vLLM's and SGLang's). Every model call also writes the MTP
# entries of its tokens, so the MTP layer's cache holds an entry for every position its slot's
# sequence holds (prefix copies, the host cache and snapshots carry it as they carry the trunk's):
# a call over tokens s .. s+T-1 writes the entries s-1 .. s+T-2, the first from h_{s-1}, which the
# pool keeps per slot ({"hidden"}, the carry; engine.cache). draft() writes the entry of a row's last
# position and its drafts' entries after it, which the next model call writes again from the trunk.

# Which trunk hidden state the MTP layer reads: "final_norm" (after the trunk's final norm, the state
# its head reads: vLLM's model hands its drafter that output; llama.cpp's reads it after the norm
# too) or "residual" (before the final norm, as one other published implementation reads it). The
# majority's choice; the real checkpoint's acceptance rate settles it (docs/perf-log.md).
MTP_HIDDEN = "final_norm"


def _mtp_kind(cfg: ModelConfig) -> str:
    """The MTP layer's attention kind: the trunk's full-attention layers' (engine.weights: _Loader.mtp)."""
    return next(k for k in cfg.layer_kinds if k != "linear")


def _mtp_input(params, hidden, embedded, cfg: ModelConfig):
    """u = fc([norm_e(embedded), norm_h(hidden)]) [B, T, H] (above)."""
    mtp, eps = params["mtp"], cfg.rms_norm_eps
    return matmul(jnp.concatenate([_rms_norm(embedded, mtp["embed_norm"], eps),
                                   _rms_norm(hidden, mtp["hidden_norm"], eps)], axis=-1), mtp["fc"])


def _mtp_entries(params, kv, hidden, embedded, slots, positions, valid, live, *, cfg: ModelConfig):
    """The MTP layer's entries at positions [B, T] from hidden [B, T, H] (h_p) and embedded [B, T, H]
    (the embedding of token p + 1); writes their keys and values into kv, the MTP layer's cache,
    where valid. Returns (y [B, T, H], kv)."""
    mlp = (cfg.mlp_kinds or ("dense",))[-1]
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
    y, kv, _ = _jit_layer(params["mtp"]["layer"], kv, _mtp_input(params, hidden, embedded, cfg), slots,
                          positions[:, 0], lengths, positions, _rope_tables(positions, cfg), valid, live,
                          cfg=cfg, kind=_mtp_kind(cfg), mlp=mlp, site=cfg.num_layers if mlp == "moe" else None)
    return _rms_norm(y, params["mtp"]["norm"], cfg.rms_norm_eps), kv


def _mtp_keys(params, kv, hidden, embedded, slots, positions, valid, *, cfg: ModelConfig):
    """The MTP layer's keys and values at positions [B, T] (as _mtp_entries writes them), and nothing
    else: a model call keeps the MTP layer's cache following its slot with the layer's input and its
    key and value projections, not its attention, MLP and head (under a third of the layer's weights
    at Qwen3.8-27B's shape), so a call that drafts nothing costs little more than without it."""
    layer = params["mtp"]["layer"]
    normed = _rms_norm(_mtp_input(params, hidden, embedded, cfg), layer["attn_norm"], cfg.rms_norm_eps)
    _, _, kv = _attention_entries(layer, kv, normed, slots, positions, _rope_tables(positions, cfg), valid,
                                  cfg=cfg, gated=_mtp_kind(cfg) == "gated_attention")
    return kv


def _mtp_fill(params, pool, embedded, hidden, slots, positions, valid, *, cfg: ModelConfig, verify: bool):
    """A model call's MTP entries (above): pool [MTP KV, carry]; embedded and hidden [B, T, H] its
    tokens' embeddings and the trunk's hidden states. Returns (the new pool, the carry after each
    position for a verification, which the pool does not hold yet: engine.cache.keep_steps)."""
    kv, carry = pool
    held = carry["hidden"][slots]                                             # h_{s-1} [B, H]
    before = jnp.concatenate([held[:, None], hidden[:, :-1]], axis=1)
    at = positions - 1                                   # token p + 1's entry is at p
    kv = _mtp_keys(params, kv, before, embedded, slots, at, valid & (at >= 0), cfg=cfg)
    if verify:
        return [kv, carry], {"hidden": hidden}
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    where = jnp.where(lengths > 0, slots, carry["hidden"].shape[0])          # idle rows: dropped
    return [kv, {"hidden": carry["hidden"].at[where].set(last, mode="drop")}], None


def forward(params, cache, tokens, slots, starts, lengths, *, cfg: ModelConfig,
            all_logits: bool = False, verify: bool = False):
    """See the module docstring. tokens int32 [B, T]; slots, starts, lengths int32 [B].
    Returns float32 logits [B, vocab] at each row's last valid token ([B, T, vocab] with
    all_logits or verify), and the updated cache. verify: each row is a decode step's token and its
    draft (engine.speculative), every position computed as a decode step computes it; a third item
    is then each linear layer's state after every position (a list, empty for a model without
    them: _linear_attention; the MTP carry's last, with an MTP layer), which the returned cache
    does not hold yet (engine.cache.keep_steps). With params["mtp"] the call also writes its tokens'
    MTP entries (_mtp_fill; the pool's last two entries are the MTP layer's).
    Runs every layer in this one program (jit_forward runs a large model's one program per layer)."""
    return _through_layers(params, cache, tokens, slots, starts, lengths, cfg=cfg, all_logits=all_logits,
                           verify=verify, inputs=_model_inputs, layer_call=_jit_layer, outputs=_model_outputs)


def _through_layers(params, cache, tokens, slots, starts, lengths, *, cfg: ModelConfig, all_logits: bool,
                    verify: bool, inputs, layer_call, outputs):
    """A model call's body, whichever programs run it: inputs, each layer in turn, outputs (the
    functions themselves, or their programs for a layered model: _Forward)."""
    all_logits = all_logits or verify
    ctx = _checked_ctx(cache, tokens, slots, starts, lengths)
    x, positions, rope, valid, live = inputs(params["embed"], tokens, starts, lengths, ctx=ctx, cfg=cfg)
    new_cache, states = [], []
    # A Python loop, not lax.scan: XLA:CPU runs the unrolled layers 2-4x faster.
    for i, (kind, mlp, layer, kv) in enumerate(zip(cfg.layer_kinds, _mlp_kinds(cfg), params["layers"], cache)):
        x, kv, steps = layer_call(layer, kv, x, slots, starts, lengths, positions, rope, valid, live,
                                  cfg=cfg, kind=kind, mlp=mlp, site=i if mlp == "moe" else None,
                                  verify=verify)
        new_cache.append(kv)
        if steps is not None:
            states.append(steps)
    logits, pool, carried = outputs(_ends(params), cache[cfg.num_layers:], x, tokens, slots, positions,
                                    valid, lengths, cfg=cfg, all_logits=all_logits, verify=verify)
    return (logits, new_cache + pool, states + carried) if verify else (logits, new_cache + pool)


def _checked_ctx(cache, tokens, slots, starts, lengths) -> int:
    """The cache's context length (linear layers have none), after checking the rows' shapes."""
    b = tokens.shape[0]
    if slots.shape != (b,) or starts.shape != (b,) or lengths.shape != (b,):
        raise ValueError(f"slots, starts and lengths must have shape ({b},) like tokens' rows")
    return next(layer["k"] for layer in cache if "k" in layer).shape[-1]


def _mlp_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    return cfg.mlp_kinds or ("dense",) * cfg.num_layers


def _ends(params) -> dict:
    """The weights a model call reads besides its layers: the embedding, head, final norm, MTP layer."""
    return {key: value for key, value in params.items() if key != "layers"}


def _model_inputs(table, tokens, starts, lengths, *, ctx: int, cfg: ModelConfig):
    """What the first layer reads: the tokens' embeddings [B, T, hidden] (the residual stream), their
    positions and RoPE tables, which are valid, and how far attention reads."""
    t = tokens.shape[1]
    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = starts[:, None] + offsets[None, :]                         # [B, T]
    valid = offsets[None, :] < lengths[:, None]                            # [B, T]
    # Positions attention must read; at least one, so that idle rows (all lengths 0) stay finite.
    live = jnp.clip(jnp.max(starts + lengths), 1, ctx)
    return embed(table, tokens), positions, _rope_tables(positions, cfg), valid, live


def _model_outputs(ends, pool, x, tokens, slots, positions, valid, lengths, *, cfg: ModelConfig,
                   all_logits: bool, verify: bool):
    """After the last layer: the MTP layer's entries (pool: its cache, empty without one) and the
    logits. Returns (logits, the pool after the call, [the MTP carry] for a verification else [])."""
    carried = []
    if "mtp" in ends:
        normed = _rms_norm(x, ends["norm"], cfg.rms_norm_eps)
        pool, carry = _mtp_fill(ends, pool, embed(ends["embed"], tokens),
                                normed if MTP_HIDDEN == "final_norm" else x, slots, positions, valid,
                                cfg=cfg, verify=verify)
        carried = [carry] if verify else []
    if not all_logits:
        last = jnp.maximum(lengths - 1, 0)                                 # idle rows: any row
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]      # [B, hidden]
    x = _rms_norm(x, ends["norm"], cfg.rms_norm_eps)
    return matmul(x, ends["lm_head"]), pool, carried


_jit_unrolled = jax.jit(forward, donate_argnames=("cache",), static_argnames=("cfg", "all_logits", "verify"))


# ---- one program per layer -----------------------------------------------------------------------
#
# XLA:CPU holds a compiled program's instructions, buffer plan and code in host memory, and a program
# of every layer holds each layer's: a large model's fused programs took its worker gigabytes past
# its weights and cache, and long to compile. A large model on a CPU (cfg.layered: runs_layered) runs
# instead as a program for its inputs, one per distinct layer (the layers of one kind whose weights
# have the same forms share it) and one for its outputs, called in turn: the same arithmetic per
# layer. A prompt's chunks cost a little more (each layer's program maps its temporaries afresh at
# every call); a small model keeps its one fused program, whose dispatch and temporaries would weigh
# more on its shorter steps. Figures: docs/perf-log.md, "One program per layer".

LAYERED_MIN_LAYER_PARAMS = 128_000_000
LAYERED_ENV = "MASHBOX_LAYERED"               # "1" / "0": one program per layer or not, whatever the size


def layer_parameters(cfg: ModelConfig) -> int:
    """The weights one decoder layer holds, on average over the layers (a MoE layer's routed
    experts all counted; its shared expert not)."""
    h, total = cfg.hidden_size, 0
    for kind, mlp in zip(cfg.layer_kinds, _mlp_kinds(cfg)):
        if kind == "linear":
            total += h * (cfg.linear_conv_dim + cfg.linear_value_heads * (cfg.linear_value_dim + 2))
            total += cfg.linear_value_heads * cfg.linear_value_dim * h
        else:
            total += h * (cfg.q_size * (2 if kind == "gated_attention" else 1) + 2 * cfg.kv_size) + cfg.q_size * h
        total += 3 * h * (cfg.moe_intermediate_size * cfg.num_experts if mlp == "moe" else cfg.intermediate_size)
    return total // max(1, cfg.num_layers)


def runs_layered(cfg: ModelConfig, platform: str, devices: int) -> bool:
    """Whether the model runs one program per layer (above): on one CPU device, a model without
    routed experts (each such layer is traced on its own, so its programs would not be shared) whose
    layers read at least LAYERED_MIN_LAYER_PARAMS weights each; MASHBOX_LAYERED overrides the size."""
    if platform != "cpu" or devices != 1 or "moe" in _mlp_kinds(cfg):
        return False
    asked = os.environ.get(LAYERED_ENV, "")
    return asked == "1" if asked in ("0", "1") else layer_parameters(cfg) >= LAYERED_MIN_LAYER_PARAMS


_jit_inputs = jax.jit(_model_inputs, static_argnames=("ctx", "cfg"))
_jit_layer_step = jax.jit(_layer, donate_argnames=("kv",), static_argnames=LAYER_STATIC_ARGNAMES)
_jit_outputs = jax.jit(_model_outputs, donate_argnames=("pool",), static_argnames=("cfg", "all_logits", "verify"))


def _layered_calls(params, cache, tokens, slots, starts, lengths, *, cfg: ModelConfig, all_logits: bool,
                   verify: bool):
    """The programs of a layered model call, in order: (jitted function, positional arguments,
    static keyword arguments, which layer or None), with the layers' residual stream and inputs as
    abstract values (jax.eval_shape): what compiling or lowering them needs."""
    all_logits = all_logits or verify
    ctx = _checked_ctx(cache, tokens, slots, starts, lengths)
    inputs = (params["embed"], tokens, starts, lengths)
    x, positions, rope, valid, live = jax.eval_shape(lambda *a: _model_inputs(*a, ctx=ctx, cfg=cfg), *inputs)
    calls, seen = [(_jit_inputs, inputs, {"ctx": ctx, "cfg": cfg})], set()
    for i, (kind, mlp, layer, kv) in enumerate(zip(cfg.layer_kinds, _mlp_kinds(cfg), params["layers"], cache)):
        static = {"cfg": cfg, "kind": kind, "mlp": mlp, "site": None, "verify": verify}
        shapes = jax.tree.map(lambda a: (a.shape, a.dtype), (layer, kv))
        key = (kind, mlp, jax.tree.structure((layer, kv)), tuple(jax.tree.leaves(shapes)))
        if key not in seen:
            seen.add(key)
            calls.append((_jit_layer_step, (layer, kv, x, slots, starts, lengths, positions, rope, valid, live),
                          static))
    calls.append((_jit_outputs, (_ends(params), cache[cfg.num_layers:], x, tokens, slots, positions, valid,
                                 lengths), {"cfg": cfg, "all_logits": all_logits, "verify": verify}))
    return calls


class _LayeredLowered:
    """jit_forward.lower(...) of a layered model: its distinct programs lowered (as_text) or compiled."""

    def __init__(self, calls):
        self.lowered = [function.lower(*args, **static) for function, args, static in calls]

    def compile(self):
        return [lowered.compile() for lowered in self.lowered]

    def as_text(self) -> str:
        return "\n".join(lowered.as_text() for lowered in self.lowered)


class _Forward:
    """forward, compiled: jit_forward(params, cache, tokens, slots, starts, lengths, *, cfg,
    all_logits=False, verify=False) donates the cache and returns forward's results. A model with
    cfg.layered runs its programs per layer (above), any other the one program of every layer;
    .lower(...) lowers what a call runs (.compile(), .as_text())."""

    def __call__(self, params, cache, tokens, slots, starts, lengths, *, cfg: ModelConfig,
                 all_logits: bool = False, verify: bool = False):
        if not cfg.layered:
            return _jit_unrolled(params, cache, tokens, slots, starts, lengths, cfg=cfg, all_logits=all_logits,
                                 verify=verify)
        # On the device once, not once per layer's call.
        slots, starts, lengths = (jnp.asarray(a, jnp.int32) for a in (slots, starts, lengths))
        return _through_layers(params, cache, tokens, slots, starts, lengths, cfg=cfg, all_logits=all_logits,
                               verify=verify, inputs=_jit_inputs, layer_call=_jit_layer_step, outputs=_jit_outputs)

    def lower(self, params, cache, tokens, slots, starts, lengths, *, cfg: ModelConfig,
              all_logits: bool = False, verify: bool = False):
        if not cfg.layered:
            return _jit_unrolled.lower(params, cache, tokens, slots, starts, lengths, cfg=cfg,
                                       all_logits=all_logits, verify=verify)
        return _LayeredLowered(_layered_calls(params, cache, tokens, slots, starts, lengths, cfg=cfg,
                                              all_logits=all_logits, verify=verify))


    @staticmethod
    def _cache_size() -> int:
        """Programs compiled for model calls so far (the tests' count of shapes)."""
        return sum(f._cache_size() for f in (_jit_unrolled, _jit_inputs, _jit_layer_step, _jit_outputs))


jit_forward = _Forward()


def draft(params, cache, tokens, slots, starts, lengths, *, cfg: ModelConfig, k: int):
    """k drafts for each row from the MTP layer (above): tokens int32 [B] each row's newest token
    (drawn, not yet run), starts [B] its last position (whose trunk hidden state the pool's carry
    holds), lengths [B] 1 for a live row, 0 for an idle one (which writes nothing). Each draft is the
    MTP logits' first largest token. Returns (drafts int32 [B, k], the cache: MTP entries written at
    starts .. starts + k - 1, which the next model call writes again from the trunk's states)."""
    ctx = next(layer["k"] for layer in cache if "k" in layer).shape[-1]
    kv, carry = cache[cfg.num_layers:]
    hidden, token = carry["hidden"][slots], tokens
    valid = (lengths > 0)[:, None]
    drafts = []
    for i in range(k):
        positions = (starts + i)[:, None]
        live = jnp.clip(jnp.max(starts) + i + 1, 1, ctx)
        y, kv = _mtp_entries(params, kv, hidden[:, None], embed(params["embed"], token[:, None]), slots,
                             positions, valid, live, cfg=cfg)
        hidden = y[:, 0]
        token = jnp.argmax(matmul(hidden, params["lm_head"]), axis=-1).astype(jnp.int32)
        drafts.append(token)
    return jnp.stack(drafts, axis=1), cache[:cfg.num_layers] + [kv, carry]


jit_draft = jax.jit(draft, donate_argnames=("cache",), static_argnames=("cfg", "k"))
