"""Routed experts: the MLP of a "moe" layer (Qwen3-MoE, Qwen3-Next).

    routed_experts(x, moe, valid, *, cfg, site=None) -> the routed sum for rows x [N, hidden]
    routed_report(cfg, rows=None) -> Health's routed_experts: what the compiled programs run

The router scores every expert, each token takes the top experts_per_token by softmax probability,
and its output is their SwiGLU outputs weighted by those probabilities (renormalized to sum to 1
when norm_topk_prob). Qwen3-Next's shared expert is added by engine.model's layer.

Two paths compute the routed sum, chosen per call site while tracing (_routed_path):
  kernel  tokens sorted by expert, one grouped matrix product per projection by a routed-expert
          kernel (tokamax.ragged_dot from the `accel` extra on GPU/TPU, else jax.lax.ragged_dot,
          which GPU and TPU lower to XLA's ragged-dot instruction), then unsorted. A site whose
          shapes tokamax refuses runs exact, and says so.
  exact   plain XLA operations: the (token, expert) pairs sorted by expert into tiles of one expert
          each, a loop over the tiles that reads each tile's expert once, then unsorted.
Both run on the experts one device holds: all of them on one device, its own block on a mesh
(expert parallelism: _per_device runs them inside shard_map and adds the devices' sums).
What counts as "kernel" is the spec's reading: a kernel package's routed-expert kernel; the tile
loop is this file's own arithmetic, so it reports as exact. XLA:CPU has no such kernel
(jax.lax.ragged_dot lowers there to a masked dense product over every expert), so the CPU runs
exact, and says why.

Why tiles: XLA:CPU gathers element by element, so multiplying each row by its experts' gathered
weights ran 40x under the memory bandwidth, while an expert taken with a dynamic slice inside a loop
streams at the bandwidth. A decode step takes one tile per (row, pick), so one row reads exactly its
k experts (docs/performance.md).

The one side effect: tracing a routed-expert call site records which path it was given
(ROUTED_SITES), so the worker reports what its compiled programs run, not what it meant to.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, PartitionSpec

from engine.config import ROUTED_PATHS, ModelConfig
from engine.products import (F32, fp8_values, gated, int8_values, matmul, row_exact_matmul,
                             row_exact_rows, swiglu, tree_sum, weight_kind, wide_dtype)
from engine.sharding import MODEL_AXIS

ROUTED_KINDS = ("kernel", "exact")
# Rows per tile of the exact path in a prefill chunk: a tile multiplies its rows by one expert.
# Smaller tiles waste less on each expert's last, partly filled tile; larger ones run the product
# at a better rate; 64 ran fastest of 32, 64 and 128 (docs/performance.md).
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
    """x [N, hidden] -> (weights [N, k] float32, experts [N, k] int32), the top k by probability.
    On XLA:CPU every sum is in one fixed order (products.row_exact_matmul, tree_sum) for any rows
    where the native kernel serves the model, else up to INT8_ROWS_MAX_ROWS rows (decode steps,
    verifications of drafts): a row is routed alike whatever rows run beside it, so drafting
    (engine.speculative) stays exact and a prompt is routed alike in any chunks."""
    most = row_exact_rows(cfg.native)
    exact = most is None or x.shape[0] <= most
    total = tree_sum if exact else (lambda v: jnp.sum(v, axis=-1, keepdims=True))
    scores = row_exact_matmul(x, router, native_kernel=cfg.native) if exact else matmul(x, router)
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))            # the softmax
    weights, experts = lax.top_k(e / total(e), cfg.experts_per_token)
    if cfg.norm_topk_prob:
        weights = weights / total(weights)
    return weights, experts.astype(jnp.int32)


def _held(stacked) -> int:
    """How many experts a stacked projection holds (an array, or float8 parts: engine.weights)."""
    return jax.tree_util.tree_leaves(stacked)[0].shape[0]


def _expert(stacked, e):
    """Expert e of a stacked projection, in its own form (a dynamic slice of every part)."""
    return jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, e, 0, False), stacked)


def _widened(stacked):
    """A stacked projection as the grouped product takes it: float8 experts widened per block, int8
    ones times their scales (to bfloat16 on accelerators, at each call: held narrow, they take half
    or a quarter of the memory). The kernel path runs on GPU and TPU only, where experts are never
    packed for the native kernel."""
    kind = weight_kind(stacked)
    if kind == "fp8":
        return fp8_values(stacked, wide_dtype())
    if kind == "int8":
        return (int8_values(stacked["q"]).astype(F32) * stacked["scale"][..., None]).astype(wide_dtype())
    return stacked


def _routed_kernel(x, weights, experts, moe, product):
    """Sort the (token, expert) pairs by expert, two grouped products, unsort. Pairs of no expert
    (experts == the experts held, num: padding) sort last, past every group: the kernel leaves them
    zero."""
    n, k = experts.shape
    gate_up, down = _widened(moe["gate_up"]), _widened(moe["down"])
    num = gate_up.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros(num + 1, jnp.int32).at[flat].add(1)[:num]
    rows = x[order // k].astype(gate_up.dtype)
    hidden = gated(product(rows, gate_up, sizes)).astype(down.dtype)
    y = product(hidden, down, sizes)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    y = y[back].reshape(n, k, -1)                                   # unsorted: [token, pick, hidden]
    return jnp.einsum("nk,nkh->nh", jnp.where(experts < num, weights, 0.0), y)


def _routed_exact(x, weights, experts, moe, tile: int):
    """The same sum in plain XLA operations. Pairs are sorted by expert and laid out in tiles of
    `tile` rows, each tile holding rows of one expert only (its last tile zero-padded); a loop over
    the tiles multiplies each tile by its expert, read with a dynamic slice; the outputs are
    gathered back per (token, pick) and weighted. Tiles past the last used one are skipped."""
    n, k = experts.shape
    num = _held(moe["gate_up"])
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
            return swiglu(padded[token_at[i]], _expert(moe["gate_up"], e), _expert(moe["down"], e))
        return None, lax.cond(i < tile_end[-1], run, lambda: jnp.zeros((tile, x.shape[1]), F32))

    _, y = lax.scan(one_tile, None, jnp.arange(tiles))
    y = jnp.concatenate([y.reshape(tiles * tile, -1), jnp.zeros((1, x.shape[1]), F32)])
    at = jnp.zeros(pairs, jnp.int32).at[order].set(where).reshape(n, k)
    # The picks' weighted sum in tree_sum's order (as _route's: the same per row whatever beside it).
    weighted = jnp.where(experts < num, weights, 0.0)[..., None] * y[at]           # [token, pick, hidden]
    return tree_sum(jnp.swapaxes(weighted, 1, 2))[..., 0]


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
