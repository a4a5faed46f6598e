"""Weight-only int8 weights (engine.weights quantize at load, engine.products.matmul computes with them)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import attention, cpu, memory, model, products, weights
from engine.cache import init_cache
from engine.config import load_config
from engine.model import jit_forward
from engine.weights import INT8_MAX, load_weights, offset_int8, quantize_int8, weights_bytes

TINY = os.path.join(os.path.dirname(__file__), "fixtures", "tiny")
# Dense models: in a routed model an int8 rounding may flip a token's expert choice, which moves
# its logits by a whole expert's output (measured up to 3.5 on qwen3-moe); that is covered by the
# demo's KL bound (tests/bench/bench_narrow.py kl), not by a tolerance here.
MODELS = ["qwen3", "qwen3-tied", "qwen2"]
SLOTS, CTX = 2, 64
# int8 against float32 weights on the tiny fixtures (random weights; logits' standard deviation
# about 1.7, span +-7): measured mean |difference| 0.04-0.05, max 0.34-0.47 with the integer terms
# and 0.33-0.47 with the bfloat16 wide product at every row count. Random tiny models have near-ties
# between their top tokens (most top-two margins are under 0.5), so the greedy token agrees at
# 92-96% of positions (measured), not all; the demo's greedy answer and KL are the real model's
# checks.
INT8_ATOL = 0.6
INT8_MEAN_ATOL = 0.08
INT8_GREEDY_AGREEMENT = 0.9


def _logits(cfg, params, tokens, forward=jit_forward, kv_dtype=jnp.float32):
    """Logits at every position: a prefill of all but the last 4 tokens, then 4 one-row decode steps."""
    cache = init_cache(cfg, SLOTS, CTX, kv_dtype)
    split = len(tokens) - 4
    i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
    logits, cache = forward(params, cache, jnp.asarray(tokens[None, :split], jnp.int32), i32(1), i32(0),
                            i32(split), cfg=cfg, all_logits=True)
    rows = list(np.asarray(logits[0]))
    for pos in range(split, len(tokens)):
        logits, cache = forward(params, cache, jnp.asarray([[tokens[pos]]], jnp.int32), i32(1), i32(pos),
                                i32(1), cfg=cfg)
        rows.append(np.asarray(logits[0]))
    return np.stack(rows)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("int8_max_rows", [products.INT8_ROWS_MAX_ROWS, 0])
@pytest.mark.parametrize("offset", [True, False])
def test_int8_logits_stay_close_to_float32_and_keep_the_greedy_tokens(name, int8_max_rows, offset,
                                                                      monkeypatch):
    """Guards against the int8 products (the integer terms' product, and the wide prefill dot at
    every row count when int8_max_rows is 0), with the weights held offset as uint8 or as int8,
    drifting from the float32 model or changing its tokens."""
    monkeypatch.setattr(weights, "OFFSET_INT8", offset)
    from safetensors.numpy import load_file
    folder = os.path.join(TINY, name)
    cfg = load_config(folder)
    tokens = np.asarray(load_file(os.path.join(folder, "reference.safetensors"))["tokens"])
    monkeypatch.setattr(products, "INT8_ROWS_MAX_ROWS", int8_max_rows)
    monkeypatch.setattr(products, "PREFILL_BY_KERNEL", products.PREFILL_BY_KERNEL and bool(int8_max_rows))
    # fresh functions (the forward and its layers), so jit traces them again with the patched constant
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
    monkeypatch.setattr(model, "_jit_layer", jax.jit(lambda *a, **k: model._layer(*a, **k),
                                                     static_argnames=model.LAYER_STATIC_ARGNAMES))
    want = _logits(cfg, load_weights(folder, cfg, jnp.float32), tokens, forward)
    params = load_weights(folder, cfg, "int8", pack=False)    # XLA's products (the kernel's: test_native)
    assert params["layers"][0]["qkv"]["q"].dtype == (jnp.uint8 if offset else jnp.int8)
    got = _logits(cfg, params, tokens, forward)
    np.testing.assert_allclose(got, want, atol=INT8_ATOL, rtol=0)
    assert np.abs(got - want).mean() < 0.4
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= INT8_GREEDY_AGREEMENT


def test_quantized_rows_round_trip_within_half_a_step():
    """Guards against a wrong scale (per output channel, largest magnitude -> INT8_MAX), an
    all-zero row dividing by zero, or rounding a few rows at a time changing a number."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 33)).astype(np.float32) * np.array([[1e-3], [1], [30], [0], [2]], np.float32)
    q, scale = quantize_int8(w)
    assert q.dtype == np.int8 and scale.shape == (5,)
    assert np.abs(q).max() == INT8_MAX and q.min() >= -INT8_MAX
    assert np.all(q[3] == 0) and np.isfinite(scale).all()
    assert np.all(np.abs(q * scale[:, None] - w) <= scale[:, None] / 2 + 1e-7)
    with pytest.MonkeyPatch.context() as m:                       # two rows at a time: the same numbers
        m.setattr(weights, "QUANTIZE_CHUNK_BYTES", 2 * 33 * 4)
        again = quantize_int8(w)
    np.testing.assert_array_equal(again[0], q)
    np.testing.assert_array_equal(again[1], scale)


@pytest.mark.parametrize("pack", [False, True])
def test_vocabulary_matrices_read_in_slices_are_held_as_read_whole(pack, monkeypatch):
    """Guards against the embedding table and the LM head, read, rounded and packed a slice of rows
    at a time (so that no float32 copy of a whole table is resident), differing from the same
    matrices done whole: the slices' scales, their packed blocks, the last shorter slice."""
    if pack and not weights.packs_int8("int8"):
        pytest.skip("the native kernel does not run here")
    folder = os.path.join(TINY, "qwen3")
    cfg = load_config(folder)
    whole = load_weights(folder, cfg, "int8", pack=pack)
    monkeypatch.setattr(weights, "PUT_ROWS", 48)                # 320 rows: 6 slices of 48, then 32
    sliced = load_weights(folder, cfg, "int8", pack=pack)
    for name in ("embed", "lm_head"):
        for part in ("q", "scale"):
            np.testing.assert_array_equal(sliced[name][part], whole[name][part])
    assert (whole["lm_head"]["q"].ndim == 4) == pack


def test_offset_int8_is_the_values_plus_128():
    """Guards against the sign-bit flip that offsets int8 values giving other bytes than v + 128."""
    values = np.arange(-128, 128, dtype=np.int16).astype(np.int8)
    np.testing.assert_array_equal(offset_int8(values), np.arange(256, dtype=np.uint8))


def test_tied_int8_head_is_the_int8_embedding_counted_once():
    """Guards against int8 weights keeping a float32 table beside the int8 head (or counting it twice)."""
    folder = os.path.join(TINY, "qwen3-tied")
    cfg = load_config(folder)
    params = load_weights(folder, cfg, "int8")
    assert params["lm_head"] is params["embed"]
    # packed for the native kernel: offset, its operand; else as XLA's products take them
    assert params["embed"]["q"].dtype == (np.uint8 if weights.packs_int8("int8") else weights.held_int8_dtype())
    assert params["embed"]["scale"].shape == (cfg.vocab_size,)


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied", "qwen2", "qwen3-moe", "qwen3-next"])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_memory_formula_counts_the_weights_as_loaded(name, dtype):
    """Guards against the sizing (memory.held_weight_bytes) and the loaded weights disagreeing."""
    folder = os.path.join(TINY, name)
    params = load_weights(folder, load_config(folder), dtype)
    assert memory.held_weight_bytes(folder, dtype) == weights_bytes(params)


def test_int8_weights_take_about_a_quarter_of_float32():
    folder = os.path.join(TINY, "qwen2")
    assert memory.held_weight_bytes(folder, "int8") < 0.3 * memory.held_weight_bytes(folder, "float32")


def test_auto_weights_dtype_is_int8_on_a_cpu_with_int8_avx2_or_arm_dot_products(monkeypatch):
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert model.weights_dtype_for("cpu", "auto") == "int8"
    assert model.weights_dtype_for("cpu", None) == "int8"
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"avx2", "fma"}))
    assert model.weights_dtype_for("cpu", "auto") == "int8"
    monkeypatch.setattr(cpu, "flags", lambda: frozenset({"fp", "asimd", "asimddp"}))   # ARM with sdot
    assert model.weights_dtype_for("cpu", "auto") == "int8"
    for flags in ({"sse4_2", "fma"}, {"fp", "asimd"}):
        monkeypatch.setattr(cpu, "flags", lambda f=frozenset(flags): f)
        assert model.weights_dtype_for("cpu", "auto") == "float32"
    assert model.weights_dtype_for("gpu", "auto") == "bfloat16"
    assert model.weights_dtype_for("cpu", "int8") == "int8"
    assert model.weights_dtype_for("cpu", "float32") == "float32"


def test_server_sizes_auto_weights_as_the_worker_will_hold_them(monkeypatch):
    """memory.size (the server, no jax) and the worker must agree on what "auto" holds."""
    folder = os.path.join(TINY, "qwen2")
    cfg = load_config(folder)
    for cpu_flags, held in (({"avx512_vnni"}, "int8"), ({"avx2"}, "int8"), ({"sse4_2"}, "float32")):
        monkeypatch.setattr(cpu, "flags", lambda f=frozenset(cpu_flags): f)
        plan = memory.size(cfg, folder, slots=1, ctx=64, cache_ram_mib=0, default_slots=1, default_ctx=64,
                           default_cache_ram_mib=0, available=None, on_host=True, weights_dtype="auto")
        assert plan.weights == memory.held_weight_bytes(folder, held) == memory.held_weight_bytes(
            folder, model.weights_dtype_for("cpu", "auto"))


def test_int8_hybrid_model_runs_close_to_float32():
    """Guards against the hybrid layers (gated attention's and Gated DeltaNet's int8 projections beside
    float shared experts) breaking with int8 weights. A routed model: an int8 rounding may flip a
    token's experts, so only the mean is bounded (measured 0.30 here with the DeltaNet projections in
    int8, 0.16 with them float; 0.09-0.10 on qwen3-moe)."""
    from safetensors.numpy import load_file
    folder = os.path.join(TINY, "qwen3-next")
    cfg = load_config(folder)
    tokens = np.asarray(load_file(os.path.join(folder, "reference.safetensors"))["tokens"])
    want = _logits(cfg, load_weights(folder, cfg, jnp.float32), tokens)
    got = _logits(cfg, load_weights(folder, cfg, "int8"), tokens)
    assert np.isfinite(got).all()
    assert np.abs(got - want).mean() < 0.4


@pytest.mark.parametrize("rows", [1, 4, 200])
def test_int8_product_matches_the_dequantized_weights_at_decode_and_prefill_rows(rows):
    """Guards the CPU's integer decode path (activations as two int8 terms, engine.products.matmul)
    against losing its second term: with an outlier in the row, one term errs by 0.12 of the output's
    largest magnitude, two by 7e-4. 200 rows take the prefill path (rows rounded to bfloat16)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    w[:, 3] *= 40                                         # an outlier input channel, as real models have
    q, scale = quantize_int8(w)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    x[:, 7] *= 30                                         # an outlier activation
    want = x @ (np.asarray(q, np.float32) * np.asarray(scale)[:, None]).T
    got = np.asarray(jax.jit(products.matmul)(jnp.asarray(x), {"q": jnp.asarray(offset_int8(q)),
                                                              "scale": jnp.asarray(scale)}))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < (2e-3 if rows <= products.INT8_ROWS_MAX_ROWS else 1e-2), err


@pytest.mark.parametrize("uint8_dot", [True, False])
def test_offset_weights_product_is_exact(uint8_dot, monkeypatch):
    """Guards the weights' integer product (engine.products.offset_weights_product: weights held plus
    128, less 128 times each term row's sum; or, without uint8 kernels, their signed values) against
    any rounding: it equals the int64 product at decode and prefill row counts, the largest products
    included."""
    monkeypatch.setattr(products, "UINT8_DOT", uint8_dot)
    rng = np.random.default_rng(4)
    for rows in (1, 2, 8, 128):
        t = rng.integers(-INT8_MAX, INT8_MAX + 1, (rows, 300), dtype=np.int8)
        w = rng.integers(-INT8_MAX, INT8_MAX + 1, (70, 300), dtype=np.int8)
        t[:, :40], w[:, :40] = -INT8_MAX, -INT8_MAX         # the largest products, all of one sign
        got = np.asarray(jax.jit(products.offset_weights_product)(offset_int8(w), t))
        assert got.dtype == np.int32 and got.shape == (rows, 70)
        np.testing.assert_array_equal(got, t.astype(np.int64) @ w.astype(np.int64).T)
    with pytest.raises(TypeError, match="uint8"):
        products.offset_weights_product(jnp.asarray(w), jnp.asarray(t))   # signed weights: refused


@pytest.mark.parametrize("uint8_dot", [True, False])
def test_integer_product_is_exact_with_rows_signed_or_shifted_to_uint8(uint8_dot, monkeypatch):
    """Guards the uint8 shift (engine.products.int8_product: rows + 128, less 128 times a row of ones'
    product) against any rounding: both forms equal the int64 product, for a plain matrix and for
    attention's batched cache blocks, extreme values included."""
    monkeypatch.setattr(products, "UINT8_DOT", uint8_dot)
    rng = np.random.default_rng(3)
    cases = [((5, 300), (70, 300), (((1,), (1,)), ((), ())), "rc,oc->ro"),
             ((2, 3, 6, 64), (2, 3, 64, 40), (((3,), (2,)), ((0, 1), (0, 1))), "bkrc,bkcs->bkrs"),
             ((2, 3, 6, 40), (2, 3, 64, 40), (((3,), (3,)), ((0, 1), (0, 1))), "bkrc,bkdc->bkrd")]
    for x_shape, w_shape, numbers, spec in cases:
        x = rng.integers(-INT8_MAX, INT8_MAX + 1, x_shape, dtype=np.int8)
        w = rng.integers(-INT8_MAX, INT8_MAX + 1, w_shape, dtype=np.int8)
        x.flat[:20], w.flat[:20] = -INT8_MAX, -INT8_MAX    # the largest products, all of one sign
        got = np.asarray(jax.jit(lambda a, b: products.int8_product(a, b, numbers))(x, w))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.einsum(spec, x.astype(np.int64), w.astype(np.int64)))


@pytest.mark.parametrize("uint8_dot", [True, False])
def test_probability_product_rounds_each_row_on_its_own_scale_and_sums_exactly(uint8_dot, monkeypatch):
    """Guards attention's probability product (engine.attention._probs_product): each row rounded to
    PROB_LEVELS steps of its own largest value (a row of tiny probabilities keeps its precision, an
    all-zero row stays zero), the integer product exact (without unsigned kernels: the levels shifted
    into int8 and the shift added back), so the result is within half a step per position of the float
    product, and the same numbers with or without unsigned kernels."""
    levels = attention.PROB_LEVELS
    monkeypatch.setattr(products, "UINT8_DOT", uint8_dot)
    rng = np.random.default_rng(5)
    x = rng.random((2, 3, 7, 96)).astype(np.float32) * np.array([1, 1e-6, 0.3, 0, 1, 1, 1],
                                                                 np.float32)[:, None]
    x[0, 0, 0, :5] = 0.0                                    # masked positions
    v = rng.integers(-INT8_MAX, INT8_MAX + 1, (2, 3, 64, 96), dtype=np.int8)
    got = np.asarray(jax.jit(attention._probs_product)(x, v))
    want = np.einsum("bkrs,bkds->bkrd", x.astype(np.float64), v.astype(np.float64))
    step = x.max(-1, keepdims=True) / levels               # one level of each row
    bound = 0.5 * step * np.abs(v.astype(np.float64)).sum(-1)[:, :, None, :] + 1e-5 * np.abs(want)
    assert np.all(np.abs(got - want) <= bound)
    assert np.all(got[:, :, 3] == 0)
    monkeypatch.setattr(products, "UINT8_DOT", not uint8_dot)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a, b: attention._probs_product(a, b))(x, v)), got)


def test_uint8_products_leave_the_int8_models_logits_bit_for_bit(monkeypatch):
    """The offsets are exact, so int8 weights with an int8 KV cache give the same logits whether the
    weights are held offset as uint8 (weights first) or as int8 (rows first, shifted to uint8 or
    signed). XLA's products, all three (the native kernel's are tests/test_native.py's)."""
    from safetensors.numpy import load_file
    folder = os.path.join(TINY, "qwen2")
    cfg = load_config(folder)
    tokens = np.asarray(load_file(os.path.join(folder, "reference.safetensors"))["tokens"])
    runs = []
    for offset, uint8_dot in ((True, True), (False, True), (False, False)):
        monkeypatch.setattr(weights, "OFFSET_INT8", offset)
        monkeypatch.setattr(products, "UINT8_DOT", uint8_dot)
        params = load_weights(folder, cfg, "int8", pack=False)
        # fresh functions (the forward and its layers), so jit traces them again with the patched flag
        forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
        monkeypatch.setattr(model, "_jit_layer", jax.jit(lambda *a, **k: model._layer(*a, **k),
                                                         static_argnames=model.LAYER_STATIC_ARGNAMES))
        runs.append(_logits(cfg, params, tokens, forward, kv_dtype=jnp.int8))
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


# ---- int8 weights kept as they are held (engine.weights.HeldWeights) ---------------------------------

def _leaves(params):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]


def test_held_int8_weights_are_read_back_without_the_checkpoint(tmp_path, monkeypatch):
    """Guards the restart path: the second load must not read (and quantize) the float checkpoint
    again, and must give the same arrays."""
    folder = os.path.join(TINY, "qwen3")
    cfg = load_config(folder)
    held = str(tmp_path / "weights" / "int8-one")
    first = load_weights(folder, cfg, "int8", held_cache=held)
    assert os.path.exists(os.path.join(held, "manifest.json"))

    def no_checkpoint(*_):
        raise AssertionError("the checkpoint was read although a held copy exists")
    monkeypatch.setattr(weights._Reader, "get", no_checkpoint)
    second = load_weights(folder, cfg, "int8", held_cache=held)
    assert jax.tree_util.tree_structure(first) == jax.tree_util.tree_structure(second)
    for a, b in zip(_leaves(first), _leaves(second)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_a_broken_held_copy_is_quantized_again(tmp_path):
    folder = os.path.join(TINY, "qwen3")
    cfg = load_config(folder)
    held = tmp_path / "weights" / "int8-one"
    want = _leaves(load_weights(folder, cfg, "int8", held_cache=str(held)))
    (held / "manifest.json").write_text("{not json")
    got = _leaves(load_weights(folder, cfg, "int8", held_cache=str(held)))
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_only_the_newest_held_copies_are_kept(tmp_path):
    """Guards the disk: every model or dtype change writes a copy; old ones go."""
    folder = os.path.join(TINY, "qwen3")
    cfg = load_config(folder)
    root = tmp_path / "weights"
    for i in range(weights.HELD_KEEP + 2):
        load_weights(folder, cfg, "int8", held_cache=str(root / f"int8-{i}"))
        os.utime(root / f"int8-{i}", (1000 + i, 1000 + i))
    kept = sorted(p.name for p in root.iterdir())
    assert len(kept) == weights.HELD_KEEP and f"int8-{weights.HELD_KEEP + 1}" in kept
