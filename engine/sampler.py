"""Per-row sampling over a batch of logits, as one jitted function with static shapes.

Each row carries its own parameters (temperature, top-k/p, min-p, penalties, seed), so requests with
different settings share one device call. The order of operations, per row:
    penalties (repetition: HF; frequency/presence: OpenAI) -> greedy pick
    -> temperature -> min-p, top-k, top-p masks -> inverse-CDF draw -> greedy if temperature == 0
A row's random key is derived from (its seed, tokens it has generated so far) only, so a seeded
request draws the same tokens whatever runs beside it and whichever slot it lands in.

Penalty state lives on the device, one row per slot (see SamplerState); the worker resets a slot's
row when a request starts there (start_row) and sample() counts each drawn token.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from engine import native
from engine.products import tree_sum
from engine.protocol import Sampling

# A temperature below this is treated as greedy; dividing by it would overflow float32.
MIN_TEMPERATURE = 1e-5


class SamplerState(NamedTuple):
    """Per-slot token statistics the penalties need. [slots, vocab] each: cheap next to the KV cache
    (16 slots x 152k vocab = 12 MB) and, unlike a bounded history, exact for any length."""
    prompt_seen: jax.Array        # bool: token occurs in the prompt (repetition penalty)
    counts: jax.Array             # int32: times the token was generated (all three penalties)


class RowParams(NamedTuple):
    """Sampling parameters of each row of a batch, one array each, leading dim = batch rows."""
    temperature: jax.Array        # f32
    top_p: jax.Array              # f32, 1 = off
    top_k: jax.Array              # int32, 0 = off
    min_p: jax.Array              # f32, 0 = off
    repetition: jax.Array         # f32, 1 = off
    frequency: jax.Array          # f32, 0 = off
    presence: jax.Array           # f32, 0 = off
    key: jax.Array                # uint32 [B, 2]: raw threefry key data from the row's seed
    step: jax.Array               # int32: tokens the row has generated so far (folded into the key)


def init_state(slots: int, vocab: int) -> SamplerState:
    return SamplerState(jnp.zeros((slots, vocab), jnp.bool_), jnp.zeros((slots, vocab), jnp.int32))


def seed_key(seed: int) -> tuple[int, int]:
    """Any Python int seed -> two uint32 words of key data (the seed modulo 2**64)."""
    seed %= 1 << 64
    return seed >> 32, seed & 0xFFFFFFFF


def row_params(rows: list[tuple[Sampling, int, int]]) -> RowParams:
    """Host-side: numpy RowParams for a batch. rows: (sampling, seed actually used, tokens so far)
    per row; pad rows may repeat any entry (their draws are discarded)."""
    s = [r[0] for r in rows]
    return RowParams(
        temperature=np.array([x.temperature for x in s], np.float32),
        top_p=np.array([x.top_p for x in s], np.float32),
        top_k=np.array([x.top_k for x in s], np.int32),
        min_p=np.array([x.min_p for x in s], np.float32),
        repetition=np.array([x.repetition_penalty for x in s], np.float32),
        frequency=np.array([x.frequency_penalty for x in s], np.float32),
        presence=np.array([x.presence_penalty for x in s], np.float32),
        key=np.array([seed_key(r[1]) for r in rows], np.uint32),
        step=np.array([r[2] for r in rows], np.int32),
    )


def row_error(sampling: Sampling, seed: int) -> str | None:
    """Why one request's sampling cannot join a batch (a value that does not fit its array, or is
    not finite), or None. The worker asks before the request is scheduled, so a bad value fails that
    request alone instead of the batch (and the process) it would have joined."""
    try:
        with np.errstate(over="ignore"):       # a float past float32 becomes inf: refused below
            p = row_params([(sampling, seed, 0)])
    except (OverflowError, ValueError, TypeError) as e:
        return f"sampling: {e}"
    for name in ("temperature", "top_p", "min_p", "repetition", "frequency", "presence"):
        if not np.isfinite(getattr(p, name)).all():
            return f"sampling: {name} is not a finite float32"
    return None


@partial(jax.jit, donate_argnames=("state",))
def start_row(state: SamplerState, slot: jax.Array, prompt_seen: jax.Array) -> SamplerState:
    """A request starts in `slot`: its prompt's tokens (bool [vocab]) are seen, nothing generated."""
    return SamplerState(state.prompt_seen.at[slot].set(prompt_seen), state.counts.at[slot].set(0))


def apply_penalties(logits, seen, counts, p: RowParams):
    """HF repetition penalty over prompt+output tokens (divide positive logits, multiply negative
    ones), then OpenAI frequency/presence penalties over generated tokens."""
    rep = p.repetition[:, None]
    seen = seen | (counts > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = counts.astype(jnp.float32)
    return logits - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)


# Bisection rounds for a probability threshold: 24 halvings of [0, p_max] reach float32 precision.
THRESHOLD_ROUNDS = 24
# top-p aims a hair below top_p of the mass: float32 sums of the kept tokens may round below the exact
# mass, and top_p = 1 must keep every token that top-k kept.
TOP_P_ROUNDING = 1e-6


def _first_max(x, native_kernel: bool):
    """argmax along the last axis (first index of the maximum) of logits [B, V]. Where engine.native's
    kernel serves, its one pass (about 5x faster); else two plain reductions, which run much faster
    than XLA:CPU's argmax over a 152k vocabulary (docs/performance.md)."""
    if native_kernel:
        return native.first_max(x)
    return _first_max_reduced(x)


def _first_max_reduced(x):
    top = jnp.max(x, axis=-1, keepdims=True)
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == top, idx, x.shape[-1]), axis=-1).astype(jnp.int32)


def _threshold(probs, measure, target):
    """Largest t in [0, p_max] with measure(probs >= t) >= target, by bisection (no sort: sorting a
    152k vocabulary costs ~30 ms per row on CPU). measure is decreasing in t; t = 0 always passes."""
    lo = jnp.zeros(probs.shape[:-1] + (1,), probs.dtype)
    hi = jnp.max(probs, axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = measure(probs >= mid) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, THRESHOLD_ROUNDS, halve, (lo, hi))[0]


# Rows whose cuts fall among their FILTER_CANDIDATES largest probabilities (top-k at most that, and
# a nucleus no wider) take exact thresholds from those, sorted by lax.top_k; only a batch with some
# other row runs the bisections, and each row keeps its own kind of threshold whatever its
# neighbours, so a seeded request draws the same beside any batch. A draw with top-k 20 and top-p
# 0.8 over 152k tokens (2-core AMD EPYC, family 25): 0.74 ms for one row against 1.71 bisecting,
# 2.90 for four against 8.58 (lax.top_k of 256 takes 0.5 / 1.8 ms of it).
FILTER_CANDIDATES = 256


def _bisected_thresholds(probs, p: RowParams, k):
    """(top-k threshold, top-p threshold) per row [B, 1], by bisection over the whole vocabulary."""
    t_k = _threshold(probs, lambda m: jnp.sum(m, axis=-1, keepdims=True, dtype=jnp.float32), k)
    kept = jnp.where(probs >= t_k, probs, 0.0)
    mass = row_sum(kept)
    t_p = _threshold(kept, lambda m: row_sum(jnp.where(m, kept, 0.0)),
                     jnp.minimum(p.top_p[:, None], 1.0) * mass * (1 - TOP_P_ROUNDING))
    return t_k, t_p


def _candidate_thresholds(probs, p: RowParams, k):
    """(top-k threshold, top-p threshold, exact) per row [B, 1] from the row's FILTER_CANDIDATES
    largest probabilities: the k-th largest, and the value whose running sum (over what top-k kept,
    largest first) first reaches top-p of the kept mass. exact: both cuts fell among them."""
    top = jax.lax.top_k(probs, min(FILTER_CANDIDATES, probs.shape[-1]))[0]       # descending
    n = top.shape[-1]
    t_k = jnp.take_along_axis(top, jnp.clip(k.astype(jnp.int32) - 1, 0, n - 1), axis=-1)
    top_k_on = p.top_k[:, None] > 0
    t_k = jnp.where(top_k_on, t_k, 0.0)
    mass = row_sum(jnp.where(probs >= t_k, probs, 0.0))
    kept = jnp.where(top >= t_k, top, 0.0)
    target = jnp.minimum(p.top_p[:, None], 1.0) * mass * (1 - TOP_P_ROUNDING)
    cut = jnp.sum(jnp.cumsum(kept, axis=-1) < target, axis=-1, keepdims=True)
    t_p = jnp.take_along_axis(kept, jnp.minimum(cut, n - 1), axis=-1)
    exact = (~top_k_on | (k <= n)) & ((p.top_p[:, None] >= 1.0) | (cut < n))
    return t_k, t_p, exact


def filter_mask(probs, p: RowParams, native_kernel: bool = False):
    """bool [B, V]: tokens that survive top-k, then top-p (over what top-k kept, renormalized), and
    min-p (p >= min_p * p_max), on temperature-scaled probabilities. At least the top token survives."""
    return probs >= filter_cut(probs, p, native_kernel)


def filter_cut(probs, p: RowParams, native_kernel: bool = False):
    """[B, 1]: the least probability filter_mask keeps in each row (0 where the row has no filter).
    Where engine.native's kernel serves (native_kernel), its exact cuts (native.filter_cuts: a
    filtered draw 2-4x faster, docs/performance.md); else XLA's (_xla_cuts)."""
    if native_kernel:
        reach = jnp.where(p.top_p < 1.0, p.top_p * (1 - TOP_P_ROUNDING), 1.0)
        cuts = native.filter_cuts(probs, p.top_k, reach)
        t_k, t_p = cuts[:, :1], cuts[:, 1:]
    else:
        t_k, t_p = _xla_cuts(probs, p)
    t_min = p.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    # A row whose filter is off keeps every token exactly, so it draws the same in any batch.
    t_k = jnp.where(p.top_k[:, None] > 0, t_k, 0.0)
    t_p = jnp.where(p.top_p[:, None] < 1.0, t_p, 0.0)
    return jnp.maximum(jnp.maximum(t_k, t_p), t_min)


def _xla_cuts(probs, p: RowParams):
    """(top-k cut, top-p cut) [B, 1] each, from the candidates where both fall among them, else by
    bisection (only a batch with such a row runs the bisections)."""
    vocab = probs.shape[-1]
    k = jnp.where(p.top_k > 0, jnp.minimum(p.top_k, vocab), vocab).astype(jnp.float32)[:, None]
    t_k, t_p, exact = _candidate_thresholds(probs, p, k)

    def bisect_the_rest():
        b_k, b_p = _bisected_thresholds(probs, p, k)
        return jnp.where(exact, t_k, b_k), jnp.where(exact, t_p, b_p)

    return jax.lax.cond(jnp.all(exact), lambda: (t_k, t_p), bisect_the_rest)


def _uniform(key_data, step):
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), step)
    return jax.random.uniform(key, (), jnp.float32)


# The inverse CDF runs in two levels: the running sum over blocks of this many tokens' mass, then
# over the one block the draw falls in. XLA:CPU's cumulative sum over a whole 152k vocabulary took
# 1.4 ms for one row and 4.6 ms for four (the draw with it 1.5 and 9.2 ms: a 4-row decode step is
# about 55 ms); the block masses and their running sum take 0.2 ms (2-core AMD EPYC, family 25).
DRAW_BLOCK = 128


def _last_positive(x):
    """Index of the last entry > 0 along the last axis of x (the last index if none)."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1)


def _block_sums(x):
    """x [B, V] -> [B, ceil(V / DRAW_BLOCK)]: each block of DRAW_BLOCK tokens summed in
    products.tree_sum's fixed order (zeros pad the last block)."""
    b, vocab = x.shape
    blocks = -(-vocab // DRAW_BLOCK)
    return tree_sum(jnp.pad(x, ((0, 0), (0, blocks * DRAW_BLOCK - vocab))).reshape(b, blocks, DRAW_BLOCK))[..., 0]


def row_sum(x):
    """x [B, V] summed over V, [B, 1], in one order whatever the rows beside it: its blocks' sums
    (_block_sums), then theirs by tree_sum. XLA's reduce orders a row's sum by the batch (a 152k-token
    row's softmax, summed in one program with it, came out an ulp apart from 2 rows on), and a seeded
    draw whose uniform falls within that of a token's edge would take the other token in a
    verification of drafts or a batch than alone."""
    return tree_sum(_block_sums(x))


def _inverse_cdf(probs, mass, u):
    """The first token whose running sum of probs [B, V] (>= 0) passes u [B, 1] in [0, total): the
    draw of a uniform u times the row's total. mass: _block_sums(probs). Never a token of
    probability 0."""
    b, vocab = probs.shape
    blocks = mass.shape[-1]
    probs = jnp.pad(probs, ((0, 0), (0, blocks * DRAW_BLOCK - vocab))).reshape(b, blocks, DRAW_BLOCK)
    ends = jnp.cumsum(mass, axis=-1)                 # a running sum's order is the row's own
    # The block the draw falls in: the first whose running sum passes u (a block of no mass never
    # does). Rounding may put u past the last sum: then the last block with mass.
    block = jnp.minimum(jnp.sum(ends <= u, axis=-1), _last_positive(mass))
    inner = jnp.take_along_axis(probs, block[:, None, None], axis=1)[:, 0]   # [B, DRAW_BLOCK]
    before = jnp.take_along_axis(ends - mass, block[:, None], axis=1)
    within = jnp.sum(before + jnp.cumsum(inner, axis=-1) <= u, axis=-1)
    # Likewise inside the block: at most its last token with probability above 0.
    return (block * DRAW_BLOCK + jnp.minimum(within, _last_positive(inner))).astype(jnp.int32)


def _draw(logits, p: RowParams, native_kernel: bool):
    """Sampled tokens for every row: filters (when some sampled row has one: a run-time branch), then
    inverse-CDF with one uniform per row. Every sum in one order per row (row_sum), so a seeded row
    draws the same token alone, in a batch or in a verification of drafts."""
    temperature = jnp.maximum(p.temperature, MIN_TEMPERATURE)[:, None]
    scaled = logits / temperature
    e = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    probs = e / row_sum(e)
    filtered = jnp.any((p.temperature >= MIN_TEMPERATURE) & ((p.top_k > 0) | (p.top_p < 1.0) | (p.min_p > 0.0)))
    # The branches return each row's cut, not a copy of the probabilities; 0 keeps every token.
    cut = jax.lax.cond(filtered, lambda x: filter_cut(x, p, native_kernel),
                       lambda x: jnp.zeros((x.shape[0], 1), x.dtype), probs)
    probs = jnp.where(probs >= cut, probs, 0.0)
    mass = _block_sums(probs)
    u = jax.vmap(_uniform)(p.key, p.step)[:, None] * tree_sum(mass)
    return _inverse_cdf(probs, mass, u)


def _allowed_only(logits: jax.Array, bits: jax.Array) -> jax.Array:
    """logits [B, V] with every token a row's mask does not allow set to -inf, so the draw that
    follows (greedy or sampled, penalties and filters alike) picks an allowed token. bits: int32
    [B, ceil(V / 32)], token t allowed where bit t % 32 of word t // 32 is set (llguidance's layout;
    engine.grammar). The worker calls it only for a batch with a constrained row; verify() at every
    position (all ones where no row is constrained)."""
    rows, vocab = logits.shape
    lanes = jnp.arange(32, dtype=jnp.int32)
    allowed = ((bits[:, :, None] >> lanes) & 1).reshape(rows, -1)[:, :vocab]
    return jnp.where(allowed != 0, logits, -jnp.inf)


allowed_only = jax.jit(_allowed_only, donate_argnums=0)


# How a batch draws: every row greedy, or some row samples (its filters and every row's penalties
# are run-time branches of one program: each static switch doubles the programs the worker compiles
# and keeps resident, docs/memory.md, "Fewer sampler programs").
DRAW_MODES = ("greedy", "sampled")


def uses_penalties(s: Sampling) -> bool:
    """Whether a request's draws read its slot's statistics (then the worker resets them as it starts)."""
    return s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0


def batch_flags(rows: list[Sampling]) -> dict:
    """The static switch of sample() for a batch: whether any of its rows samples."""
    return {"draw": "sampled" if any(s.temperature >= MIN_TEMPERATURE for s in rows) else "greedy"}


# Every value of sample()'s static switches: the worker compiles each one before it is ready.
FLAG_COMBINATIONS = tuple({"draw": d} for d in DRAW_MODES)


def _sample(state: SamplerState, logits: jax.Array, slots: jax.Array, active: jax.Array,
            p: RowParams, *, every_slot: bool, draw: str,
            native_kernel: bool = False) -> tuple[jax.Array, SamplerState]:
    """sample()'s body, not jitted: verify() runs it at every position of a drafted row."""
    logits = logits.astype(jnp.float32)

    def penalized(x):
        if every_slot:
            return apply_penalties(x, state.prompt_seen, state.counts, p)
        return apply_penalties(x, state.prompt_seen[slots], state.counts[slots], p)

    penalties = jnp.any((p.repetition != 1.0) | (p.frequency != 0.0) | (p.presence != 0.0))
    if draw == "greedy":            # the branches return the picks, not a copy of the logits
        tokens = jax.lax.cond(penalties, lambda x: _first_max(penalized(x), native_kernel),
                              lambda x: _first_max(x, native_kernel), logits)
    else:
        logits = jax.lax.cond(penalties, penalized, lambda x: x, logits)
        tokens = jnp.where(p.temperature >= MIN_TEMPERATURE, _draw(logits, p, native_kernel=native_kernel),
                           _first_max(logits, native_kernel))
    # Counted for every row, penalties or not (a few entries; the state itself never passes through a
    # branch, which would copy it): a slot's counts are read only by the request that started there.
    counts = state.counts.at[slots, tokens].add(active.astype(jnp.int32))
    return tokens, SamplerState(state.prompt_seen, counts)


_STATIC = ("every_slot", "draw", "native_kernel")


@partial(jax.jit, donate_argnames=("state",), static_argnames=_STATIC)
def sample(state: SamplerState, logits: jax.Array, slots: jax.Array, active: jax.Array,
           p: RowParams, *, every_slot: bool, draw: str,
           native_kernel: bool = False) -> tuple[jax.Array, SamplerState]:
    """Draw one token per row. logits f32 [B, V]; slots int32 [B]: each row's slot (its penalty
    state); active bool [B]: rows whose draw counts (pad rows leave the state alone).
    Static switches, always passed by name (jit keys on which keywords were given; batch_flags picks
    draw). Penalties and filters are run-time branches, taken only where some row has them, so a
    batch pays only for what its rows use:
      every_slot: row i is slot i for every slot (the decode batch): no gather of the state;
      draw: one of DRAW_MODES; "greedy" compiles no draw at all;
      native_kernel: engine.native's kernel serves the model (ModelConfig.native): its greedy pick
        and filter cuts.
    Returns (tokens int32 [B], state)."""
    return _sample(state, logits, slots, active, p, every_slot=every_slot, draw=draw, native_kernel=native_kernel)


@partial(jax.jit, donate_argnames=("state",), static_argnames=_STATIC)
def verify(state: SamplerState, logits: jax.Array, drafts: jax.Array, slots: jax.Array,
           lengths: jax.Array, p: RowParams, masks: jax.Array | None, *, every_slot: bool,
           draw: str, native_kernel: bool = False) -> tuple[jax.Array, SamplerState]:
    """The draws of a decode step that carried drafts (engine.speculative): logits f32 [B, T, V] at
    each row's T positions, drafts int32 [B, T] (drafts[b, t] the token drafted after position t;
    lengths[b] positions are real), masks int32 [B, T, words] or None (engine.grammar: each
    position's mask, given the drafted tokens before it). Position t draws as sequential decoding
    would at output step p.step + t, with the penalties of the tokens drawn before it, and counts
    only while every earlier position drew its draft (the later ones are not output). The positions
    run in a loop, not unrolled: one position's program, whatever T (unrolled, each position's draw
    was compiled and kept again).
    Returns (tokens int32 [B, T], state): row b's output is tokens[b, :n + 1], n the drafts kept."""
    rows, positions = drafts.shape

    def position(t, carry):
        state, going, picks = carry
        logits_t = jax.lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False)
        if masks is not None:
            logits_t = _allowed_only(logits_t, jax.lax.dynamic_index_in_dim(masks, t, axis=1, keepdims=False))
        token, state = _sample(state, logits_t, slots, going & (t < lengths), p._replace(step=p.step + t),
                               every_slot=every_slot, draw=draw, native_kernel=native_kernel)
        drafted = jax.lax.dynamic_index_in_dim(drafts, t, axis=1, keepdims=False)
        picks = jax.lax.dynamic_update_index_in_dim(picks, token, t, axis=1)
        return state, going & (token == drafted) & (t + 1 < lengths), picks

    state, _, picks = jax.lax.fori_loop(0, positions, position,
                                        (state, lengths > 0, jnp.zeros((rows, positions), jnp.int32)))
    return picks, state
