"""The model against transformers, and the cache moves the runtime relies on.

Reference logits come from transformers in float32 (tests/fixtures/make_tiny.py); these tests only
read the committed files, so they need neither torch nor the network.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine import cache as cache_module
from engine.cache import (COPY_BLOCK, HOST_BLOCK, _read, _write, copy_prefix, init_cache, read_slot,
                          warm_host_copies, write_slot)
from engine.config import ConfigError, config_from_dict, load_config
from engine import attention, model
from engine.model import dtype_for, jit_forward
from engine.weights import WeightsError, load_weights, weights_bytes

TINY = os.path.join(os.path.dirname(__file__), "fixtures", "tiny")
MODELS = ["qwen3", "qwen3-tied", "qwen2", "qwen3-moe", "qwen3-moe-raw"]
# float32 against float32 transformers: only summation order differs (measured ~1.5e-5 at most).
PARITY_ATOL = 1e-4
# The same model run in differently shaped batches or chunks: reduction order may change a little.
SHAPE_ATOL = 1e-5
SLOTS, CTX = 4, 64


def _load(name: str, dtype=jnp.float32):
    folder = os.path.join(TINY, name)
    cfg = load_config(folder)
    return cfg, load_weights(folder, cfg, dtype), load_file(os.path.join(folder, "reference.safetensors"))


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    return _load(request.param)


def _i32(*values):
    return jnp.asarray(values, jnp.int32)


def _run(params, cache, cfg, tokens, slots, starts, lengths, all_logits=False, forward=jit_forward):
    tokens = jnp.asarray(np.asarray(tokens, np.int32).reshape(len(slots), -1))
    return forward(params, cache, tokens, _i32(*slots), _i32(*starts), _i32(*lengths),
                   cfg=cfg, all_logits=all_logits)


def _snapshot(cache):
    return [{k: np.asarray(v) for k, v in layer.items()} for layer in cache]


# ---- parity with transformers ------------------------------------------------------------------

def test_logits_match_transformers(tiny):
    """Guards against any numerical difference from the reference (norms, RoPE, GQA, biases, head)."""
    cfg, params, ref = tiny
    tokens = ref["tokens"]
    logits, _ = _run(params, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, [2], [0],
                     [len(tokens)], all_logits=True)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], atol=PARITY_ATOL, rtol=0)


def test_last_token_logits_are_the_last_valid_row_not_the_padding(tiny):
    """Guards against returning logits of a padded position when a chunk is not full."""
    cfg, params, ref = tiny
    tokens = np.zeros(32, np.int32)
    tokens[:21] = ref["tokens"][:21]
    logits, _ = _run(params, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, [0], [0], [21])
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"][20], atol=PARITY_ATOL, rtol=0)


def test_chunked_prefill_then_decode_equals_one_full_pass(tiny):
    """Guards against cache writes/reads at the wrong position across chunks and decode steps."""
    cfg, params, ref = tiny
    tokens, n = ref["tokens"], len(ref["tokens"])
    cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
    got = []
    # Prefill 30 tokens as chunks of a 16-token bucket (the second chunk half padded), then decode.
    for start, length in [(0, 16), (16, 14)]:
        chunk = np.zeros(16, np.int32)
        chunk[:length] = tokens[start:start + length]
        logits, cache = _run(params, cache, cfg, chunk, [1], [start], [length], all_logits=True)
        got.extend(np.asarray(logits[0, :length]))
    for pos in range(30, n):
        logits, cache = _run(params, cache, cfg, tokens[pos:pos + 1], [1], [pos], [1])
        got.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.stack(got), ref["logits"], atol=PARITY_ATOL, rtol=0)


# ---- batching and idle rows --------------------------------------------------------------------

def _prefilled(cfg, params, ref, prefixes: dict[int, int]):
    """A cache whose slot s holds the first prefixes[s] reference tokens."""
    cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
    tokens = ref["tokens"]            # every prefill uses this one padded shape: one compile
    for slot, n in prefixes.items():
        _, cache = _run(params, cache, cfg, tokens, [slot], [0], [n])
    return cache


def test_batch_of_rows_equals_each_row_alone(tiny):
    """Guards against rows of one decode batch leaking into each other (slots, starts, masks)."""
    cfg, params, ref = tiny
    tokens = ref["tokens"]
    prefixes = {0: 5, 2: 17, 3: 9}
    batch_cache = _prefilled(cfg, params, ref, prefixes)
    rows = [(3, 9), (0, 5), (2, 17)]          # (slot, start), not in slot order
    next_tokens = [tokens[start] for _, start in rows]
    batch_logits, batch_cache = _run(params, batch_cache, cfg, next_tokens, [s for s, _ in rows],
                                     [p for _, p in rows], [1, 1, 1])
    for i, (slot, start) in enumerate(rows):
        alone = _prefilled(cfg, params, ref, {slot: start})
        logits, alone = _run(params, alone, cfg, [tokens[start]], [slot], [start], [1])
        np.testing.assert_allclose(np.asarray(batch_logits[i]), np.asarray(logits[0]),
                                   atol=SHAPE_ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(batch_logits[i]), ref["logits"][start],
                                   atol=PARITY_ATOL, rtol=0)
        for got, want in zip(batch_cache, alone):
            np.testing.assert_allclose(np.asarray(got["k"][slot, :, :, :start + 1]),
                                       np.asarray(want["k"][slot, :, :, :start + 1]), atol=SHAPE_ATOL)
            np.testing.assert_allclose(np.asarray(got["v"][slot, :, :, :start + 1]),
                                       np.asarray(want["v"][slot, :, :, :start + 1]), atol=SHAPE_ATOL)


def test_idle_rows_and_padding_leave_the_cache_untouched(tiny):
    """Guards against idle decode rows (lengths=0) or chunk padding overwriting a live slot."""
    cfg, params, ref = tiny
    tokens = ref["tokens"]
    cache = _prefilled(cfg, params, ref, {0: 12, 1: 20})
    before = _snapshot(cache)
    # Row 0 decodes slot 0; rows 1 and 2 are idle and point at live slot 1 (at its end and at 0).
    _, cache = _run(params, cache, cfg, [tokens[12], 7, 9], [0, 1, 1], [12, 20, 0], [1, 0, 0])
    # A prefill chunk of 3 real tokens padded to 8 must write positions 12..14 of slot 0 only.
    _, cache = _run(params, cache, cfg, list(tokens[13:16]) + [5] * 5, [0], [13], [3])
    after = _snapshot(cache)
    for old, new in zip(before, after):
        for name, seq_axis in (("k", 3), ("v", 3)):
            np.testing.assert_array_equal(new[name][1], old[name][1])     # the idle rows' slot
            np.testing.assert_array_equal(new[name][2:], old[name][2:])   # slots nobody used
            changed = np.any(new[name][0] != old[name][0], axis=tuple(
                a for a in range(3) if a != seq_axis - 1))
            assert list(np.nonzero(changed)[0]) == [12, 13, 14, 15]


# ---- cache moves -------------------------------------------------------------------------------

def test_copy_prefix_copies_only_the_first_n_positions(tiny):
    """Guards against prefix reuse copying too much, too little, or into the wrong slot."""
    cfg, params, ref = tiny
    cache = _prefilled(cfg, params, ref, {0: 20, 3: 30})
    before = _snapshot(cache)
    cache = copy_prefix(cache, _i32(3)[0], _i32(1)[0], _i32(10)[0])
    after = _snapshot(cache)
    for old, new in zip(before, after):
        np.testing.assert_array_equal(new["k"][1, :, :, :10], old["k"][3, :, :, :10])
        np.testing.assert_array_equal(new["v"][1, :, :, :10], old["v"][3, :, :, :10])
        np.testing.assert_array_equal(new["k"][1, :, :, 10:], old["k"][1, :, :, 10:])
        np.testing.assert_array_equal(new["v"][1, :, :, 10:], old["v"][1, :, :, 10:])
        for slot in (0, 2, 3):
            np.testing.assert_array_equal(new["k"][slot], old["k"][slot])
            np.testing.assert_array_equal(new["v"][slot], old["v"][slot])


def test_copied_prefix_continues_like_the_original(tiny):
    """Guards against a reused prefix producing different next-token logits than a fresh prefill."""
    cfg, params, ref = tiny
    tokens = ref["tokens"]
    cache = copy_prefix(_prefilled(cfg, params, ref, {2: 25}), 2, 0, 11)
    logits, _ = _run(params, cache, cfg, tokens[11:19], [0], [11], [8])
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"][18], atol=PARITY_ATOL, rtol=0)


def test_read_slot_then_write_slot_restores_the_sequence(tiny):
    """Guards against host copies of a slot losing positions or landing transposed."""
    cfg, params, ref = tiny
    tokens = ref["tokens"]
    cache = _prefilled(cfg, params, ref, {1: 23})
    saved = read_slot(cache, 1, 23)
    assert saved[0]["k"].shape == (cfg.num_kv_heads, cfg.head_dim, 23)
    assert saved[0]["v"].shape == (cfg.num_kv_heads, cfg.head_dim, 23)
    other = _prefilled(cfg, params, ref, {3: 40})          # slot 3 holds something else
    other = write_slot(other, 3, saved)
    np.testing.assert_array_equal(read_slot(other, 3, 23)[1]["v"], saved[1]["v"])
    logits, _ = _run(params, other, cfg, tokens[23:24], [3], [23], [1])
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"][23], atol=PARITY_ATOL, rtol=0)


def test_slot_helpers_refuse_out_of_range_slots_and_lengths():
    """Guards against a bad slot index silently clamping onto another slot's data."""
    cfg = load_config(os.path.join(TINY, "qwen2"))
    cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
    with pytest.raises(ValueError, match="slot"):
        read_slot(cache, SLOTS, 4)
    with pytest.raises(ValueError, match=r"positions \[0, 65\) outside the pool"):
        read_slot(cache, 0, CTX + 1)


# ---- loading -----------------------------------------------------------------------------------

def _reshard(src: str, dst: str, shards: int) -> None:
    """Write src's tensors as `shards` files plus model.safetensors.index.json, like big checkpoints."""
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, os.path.join(dst, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("name", MODELS)
def test_sharded_checkpoint_loads_the_same_weights(name, tmp_path):
    """Guards against tensors lost or mixed up when a checkpoint is split over several files."""
    cfg, params, _ = _load(name)
    _reshard(os.path.join(TINY, name), str(tmp_path), shards=3)
    sharded = load_weights(str(tmp_path), load_config(str(tmp_path)), jnp.float32)
    for got, want in zip(jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tied_head_is_the_embedding_table_counted_once():
    """Guards against a tied model keeping a second copy of its embedding table as the head (or
    counting it twice in the weights' size)."""
    cfg, params, _ = _load("qwen3-tied")
    assert cfg.tie_word_embeddings
    assert params["lm_head"] is params["embed"]
    assert params["lm_head"].shape == (cfg.vocab_size, cfg.hidden_size)
    leaves = jax.tree_util.tree_leaves(params)
    assert weights_bytes(params) == sum(x.nbytes for x in leaves) - params["embed"].nbytes


def test_bfloat16_weights_give_close_logits():
    """Guards against the accelerator path (bf16 weights, f32 accumulation) breaking or drifting."""
    cfg, params, ref = _load("qwen3", jnp.bfloat16)
    assert params["layers"][0]["qkv"].dtype == jnp.bfloat16
    tokens = ref["tokens"]
    logits, _ = _run(params, init_cache(cfg, 2, CTX, jnp.bfloat16), cfg, tokens, [0], [0],
                     [len(tokens)], all_logits=True)
    assert logits.dtype == jnp.float32
    # bf16 keeps ~3 significant digits; the float32 logits spread over about +-6.
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], atol=0.25, rtol=0)
    assert (np.argmax(logits[0], -1) == np.argmax(ref["logits"], -1)).mean() > 0.9


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    """Guards against a broken checkpoint failing with a bare KeyError or a shape crash in jit."""
    src = os.path.join(TINY, "qwen2")
    cfg = load_config(src)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.bias"]
    save_file(missing, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_weights(str(tmp_path), cfg, jnp.float32)
    wrong = dict(tensors)
    wrong["model.norm.weight"] = np.ones(cfg.hidden_size + 1, np.float32)
    save_file(wrong, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.norm\.weight"):
        load_weights(str(tmp_path), cfg, jnp.float32)


# ---- config ------------------------------------------------------------------------------------

QWEN3_0_6B = {   # the keys of Qwen/Qwen3-0.6B's config.json (facts of the published checkpoint)
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_config_reads_explicit_head_dim_and_flags():
    """Guards against deriving head_dim as hidden/heads for Qwen3 (1024/16=64, the truth is 128)."""
    cfg = config_from_dict(QWEN3_0_6B)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (128, 16, 8, 28)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e6 and cfg.rope_type == "default"
    assert cfg.layer_kinds == ("attention",) * 28
    assert cfg.eos_token_ids == (151645,)
    hash(cfg)     # a static jit argument must be hashable


def test_qwen2_config_derives_head_dim_and_has_biases():
    """Guards against Qwen2 losing its q/k/v biases (its config.json has no key for them)."""
    raw = dict(QWEN3_0_6B, model_type="qwen2", hidden_size=896, num_attention_heads=14,
               num_key_value_heads=2)
    del raw["head_dim"], raw["attention_bias"]
    cfg = config_from_dict(raw)
    assert cfg.head_dim == 64 and cfg.qkv_bias and not cfg.qk_norm


def test_new_style_rope_parameters_read_like_the_classic_keys():
    """Guards against configs saved by newer transformers (rope_parameters) losing rope_theta/YaRN."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    classic = dict(QWEN3_0_6B, rope_scaling=yarn)
    new = dict(QWEN3_0_6B, rope_parameters={**yarn, "rope_theta": 1000000})
    del new["rope_theta"], new["rope_scaling"]
    assert config_from_dict(classic) == config_from_dict(new)
    assert config_from_dict(new).rope_factor == 4.0


@pytest.mark.parametrize("change, key", [
    ({"model_type": "llama"}, "model_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": "1024"}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["full_attention"] * 27}, "layer_types"),
])
def test_unsupported_or_broken_config_names_the_key(change, key):
    """Guards against a bad config.json surfacing as a crash deep inside the model."""
    with pytest.raises(ConfigError, match=key):
        config_from_dict(dict(QWEN3_0_6B, **change))


def test_compute_dtype_is_float32_on_cpu_and_bfloat16_elsewhere():
    """Guards against bf16 on CPU, where one-row matrix-vector products run ~20x slower."""
    assert dtype_for("cpu") == jnp.float32
    assert dtype_for("gpu") == jnp.bfloat16 and dtype_for("tpu") == jnp.bfloat16


def _forward_in_blocks(monkeypatch, block: int):
    """The forward compiled afresh with attention read `block` positions at a time."""
    monkeypatch.setattr(attention, "ATTENTION_BLOCK", block)
    return jax.jit(model.forward, donate_argnames=("cache",), static_argnames=("cfg", "all_logits"))


@pytest.mark.parametrize("block", [5, 16, CTX])
def test_attention_in_blocks_matches_transformers_at_every_block_size(tiny, monkeypatch, block):
    """Guards against the block loop over the live length dropping or double counting positions:
    a block boundary inside a chunk, a live length that is not a multiple of the block, the last
    block shifted back to end at ctx (64 is no multiple of 5), rows of different lengths in one
    batch. One block of the whole ctx is the former single-pass attention."""
    cfg, params, ref = tiny
    forward = _forward_in_blocks(monkeypatch, block)
    tokens, n = ref["tokens"], len(ref["tokens"])
    cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
    got = []
    for start, length in [(0, 16), (16, 14)]:        # a full chunk, then a half padded one
        chunk = np.zeros(16, np.int32)
        chunk[:length] = tokens[start:start + length]
        logits, cache = _run(params, cache, cfg, chunk, [1], [start], [length], all_logits=True,
                             forward=forward)
        got.extend(np.asarray(logits[0, :length]))
    _, cache = _run(params, cache, cfg, tokens[:9], [3], [0], [9], forward=forward)
    for pos in range(30, n):                          # slot 1 decodes beside a short slot 3
        logits, cache = _run(params, cache, cfg, [tokens[pos], tokens[pos - 21]], [1, 3],
                             [pos, pos - 21], [1, 1], forward=forward)
        got.append(np.asarray(logits[0]))
        np.testing.assert_allclose(np.asarray(logits[1]), ref["logits"][pos - 21],
                                   atol=PARITY_ATOL, rtol=0)
    np.testing.assert_allclose(np.stack(got), ref["logits"], atol=PARITY_ATOL, rtol=0)


@pytest.mark.parametrize("block", [5, CTX])
def test_a_row_for_every_slot_in_any_order_reads_each_rows_own_slot(tiny, monkeypatch, block):
    """Guards against the every-slot batch (its blocks sliced for all slots at once, then put in the
    rows' order) reading another row's slot: rows name the slots out of order, at different lengths."""
    cfg, params, ref = tiny
    forward = _forward_in_blocks(monkeypatch, block)
    tokens = ref["tokens"]
    prefixes = {0: 5, 1: 30, 2: 17, 3: 9}
    cache = _prefilled(cfg, params, ref, prefixes)
    rows = [(2, 17), (0, 5), (3, 9), (1, 30)]
    logits, _ = _run(params, cache, cfg, [tokens[p] for _, p in rows], [s for s, _ in rows],
                     [p for _, p in rows], [1, 1, 1, 1], forward=forward)
    for i, (_, start) in enumerate(rows):
        np.testing.assert_allclose(np.asarray(logits[i]), ref["logits"][start], atol=PARITY_ATOL, rtol=0)


def test_one_program_serves_every_context_length(tiny):
    """Guards against the attention length turning back into a compiled shape (a program per
    length bucket made the demo compile 45 programs)."""
    cfg, params, ref = tiny
    tokens = ref["tokens"]
    cache = _prefilled(cfg, params, ref, {0: 40})
    _, cache = _run(params, cache, cfg, tokens[40:41], [0], [40], [1])
    compiled = jit_forward._cache_size()
    for pos in (1, 7, 33, CTX - 1):
        _, cache = _run(params, cache, cfg, [tokens[3]], [0], [pos], [1])
    assert jit_forward._cache_size() == compiled


# The float16 KV cache against float32: keys and values rounded to 11 significant bits. Measured on
# the tiny fixtures: at most 1.0e-2 apart in the logits (qwen2; their values span about +-7).
FLOAT16_KV_ATOL = 2e-2
# The int8 cache (8 bits per key or value, engine.model's QUERY_TERMS / PROB_LEVELS) against
# float32 on the tiny fixtures, whose random weights put top tokens near ties: measured mean
# |difference| 0.017-0.025, max 0.18-0.29 (a tiny MoE model's router flips an expert on such
# changes: 1.26 there, not checked), the same greedy token at 46-48 of 48 positions. The real checks
# are the demo's KL (tests/bench/bench_narrow.py kl) and its golden answer.
INT8_KV_ATOL, INT8_KV_MEAN_ATOL, INT8_KV_GREEDY_AGREEMENT = 0.5, 0.04, 0.9


def _cached_logits(cfg, params, tokens, dtype, forward=jit_forward):
    """Logits at every position through a cache of `dtype`: a prefill of 24 tokens, then one decode
    step per token."""
    cache = init_cache(cfg, SLOTS, CTX, dtype)
    logits, cache = _run(params, cache, cfg, tokens[:24], [0], [0], [24], all_logits=True, forward=forward)
    rows = list(np.asarray(logits[0]))
    for pos in range(24, len(tokens)):
        logits, cache = _run(params, cache, cfg, tokens[pos:pos + 1], [0], [pos], [1], forward=forward)
        rows.append(np.asarray(logits[0]))
    return np.stack(rows)


def test_float16_kv_cache_stays_close_and_keeps_the_greedy_tokens(tiny):
    """Guards against the float16 cache changing what the model says: logits within FLOAT16_KV_ATOL
    of the float32 cache and of transformers, and the same greedy token at every position."""
    cfg, params, ref = tiny
    got = _cached_logits(cfg, params, ref["tokens"], jnp.float16)
    np.testing.assert_allclose(got, _cached_logits(cfg, params, ref["tokens"], jnp.float32),
                               atol=FLOAT16_KV_ATOL, rtol=0)
    np.testing.assert_allclose(got, ref["logits"], atol=FLOAT16_KV_ATOL, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), ref["logits"].argmax(-1))


@pytest.mark.parametrize("path", ["kernel", "integer", "widened"])
def test_int8_kv_cache_stays_close_to_float32(tiny, path, monkeypatch):
    """Guards against the int8 cache (its scales, smoothed keys, and attention through the native
    kernel, through XLA's integer products, or with the blocks widened to float32 as XLA's long
    chunks do) drifting from the float32 cache or changing its tokens beyond the rounding of 8-bit
    keys and values."""
    import dataclasses
    from engine import native
    cfg, params, ref = tiny
    if path == "kernel":
        if not native.available():
            pytest.skip("the native kernel is not available here")
        cfg = dataclasses.replace(cfg, native=True)
    if path == "widened":
        monkeypatch.setattr(attention, "INT8_ATTENTION_MAX_ROWS", 0)
    # a fresh function, so jit traces it again with the patched constant
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
    got = _cached_logits(cfg, params, ref["tokens"], jnp.int8, forward)
    want = _cached_logits(cfg, params, ref["tokens"], jnp.float32, forward)
    if not cfg.num_experts:
        np.testing.assert_allclose(got, want, atol=INT8_KV_ATOL, rtol=0)
    assert np.abs(got - want).mean() < INT8_KV_MEAN_ATOL
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= INT8_KV_GREEDY_AGREEMENT


def test_float16_cache_saturates_instead_of_overflowing():
    """Guards against a key beyond float16's range becoming inf and every score NaN."""
    big = attention.to_cache(jnp.asarray([1e6, -1e6, 3.0], jnp.float32), jnp.float16)
    assert np.isfinite(np.asarray(big)).all() and float(big[2]) == 3.0


def test_kv_cache_dtype_is_int8_where_the_cpu_multiplies_int8_and_bfloat16_on_accelerators(monkeypatch):
    """Guards against a wide cache on CPU (float32: 2-4x the memory), bfloat16 there (3-4x slower
    attention), or int8 on a CPU without integer products of any speed (engine.cpu.INT8_KV_FLAGS)."""
    from engine import cpu
    for flags in ({"avx2", "avx512_vnni"}, {"avx_vnni"}, {"avx2", "fma", "f16c"}, {"asimd", "asimddp"}):
        monkeypatch.setattr(cpu, "flags", lambda: frozenset(flags))
        assert attention.kv_dtype_for("cpu") == jnp.int8, flags
    for flags in ({"sse4_2", "avx"}, {"asimd"}):
        monkeypatch.setattr(cpu, "flags", lambda: frozenset(flags))
        assert attention.kv_dtype_for("cpu") == jnp.float16, flags
    assert attention.kv_dtype_for("gpu") == jnp.bfloat16 and attention.kv_dtype_for("tpu") == jnp.bfloat16


def test_copy_prefix_across_blocks_and_up_to_the_end_of_the_slot():
    """Guards against the block-wise copy missing a block boundary or the clamped last block."""
    cfg = load_config(os.path.join(TINY, "qwen2"))
    ctx = 2 * COPY_BLOCK + 88                    # the last block is shifted back to end at ctx
    rng = np.random.default_rng(0)
    cache = [{name: jnp.asarray(rng.standard_normal(arr.shape, np.float32))
              for name, arr in layer.items()} for layer in init_cache(cfg, 3, ctx, jnp.float32)]
    for n in (COPY_BLOCK + 1, ctx - 5, ctx, 0):
        before = _snapshot(cache)
        cache = copy_prefix(cache, 2, 0, n)
        after = _snapshot(cache)
        for old, new in zip(before, after):
            np.testing.assert_array_equal(new["k"][0, :, :, :n], old["k"][2, :, :, :n])
            np.testing.assert_array_equal(new["k"][0, :, :, n:], old["k"][0, :, :, n:])
            np.testing.assert_array_equal(new["v"][0, :, :, :n], old["v"][2, :, :, :n])
            np.testing.assert_array_equal(new["v"][0, :, :, n:], old["v"][0, :, :, n:])
            np.testing.assert_array_equal(new["k"][1:], old["k"][1:])
            np.testing.assert_array_equal(new["v"][1:], old["v"][1:])


def test_warmed_host_copies_compile_nothing_later():
    """Guards against read_slot/write_slot compiling a new program after the server is ready: one
    program each moves a block at a run-time position, whatever the length or start."""
    cfg = load_config(os.path.join(TINY, "qwen2"))
    ctx = 2 * HOST_BLOCK + 300                   # the last block is shifted back to end at ctx
    rng = np.random.default_rng(1)
    cache = [{name: jnp.asarray(rng.standard_normal(arr.shape, np.float32))
              for name, arr in layer.items()} for layer in init_cache(cfg, 2, ctx, jnp.float32)]
    before = _snapshot(cache)
    cache = warm_host_copies(cache)
    for old, new in zip(before, _snapshot(cache)):
        np.testing.assert_array_equal(new["k"], old["k"])
        np.testing.assert_array_equal(new["v"], old["v"])
    compiled = (_read._cache_size(), _write._cache_size())
    for start, n in ((0, 1), (0, 63), (5, 65), (HOST_BLOCK - 3, HOST_BLOCK + 700), (0, ctx), (ctx, ctx)):
        cache = write_slot(cache, 1, read_slot(cache, 0, n, start=start), start=start)
    assert (_read._cache_size(), _write._cache_size()) == compiled


@pytest.mark.parametrize("block", [16, 100])
def test_write_slot_changes_only_the_positions_it_is_given(monkeypatch, block):
    """Guards against a host-cache load overwriting what the slot already holds (its start, shared
    with the saved conversation, is not sent again) or anything past the loaded part, including
    when a block is shifted back to end at ctx (ctx 150 is no multiple of 16 or 100)."""
    monkeypatch.setattr(cache_module, "HOST_BLOCK", block)
    cfg = load_config(os.path.join(TINY, "qwen2"))
    ctx = 150
    rng = np.random.default_rng(2)
    cache = [{name: jnp.asarray(rng.standard_normal(arr.shape, np.float32))
              for name, arr in layer.items()} for layer in init_cache(cfg, 3, ctx, jnp.float32)]
    for start, n in ((0, 10), (7, 40), (33, 149), (140, 150), (0, 150), (20, 20)):
        before = _snapshot(cache)
        given = [{"k": rng.standard_normal((cfg.num_kv_heads, cfg.head_dim, n - start)).astype(np.float32),
                  "v": rng.standard_normal((cfg.num_kv_heads, cfg.head_dim, n - start)).astype(np.float32)}
                 for _ in cache]
        cache = write_slot(cache, 1, given, start=start)
        after = _snapshot(cache)
        for old, new, want in zip(before, after, given):
            np.testing.assert_array_equal(new["k"][1, :, :, start:n], want["k"])
            np.testing.assert_array_equal(new["v"][1, :, :, start:n], want["v"])
            for name, axis in (("k", 2), ("v", 2)):
                outside = np.delete(new[name][1], np.arange(start, n), axis=axis)
                np.testing.assert_array_equal(outside, np.delete(old[name][1], np.arange(start, n), axis=axis))
                np.testing.assert_array_equal(new[name][[0, 2]], old[name][[0, 2]])
        back = read_slot(cache, 1, n, start=start)
        for got, want in zip(back, given):
            np.testing.assert_array_equal(got["k"], want["k"])
            np.testing.assert_array_equal(got["v"], want["v"])


# ---- one program per layer ---------------------------------------------------------------------

@pytest.mark.parametrize("model_id, layered", [("qwen3-8-27b", True), ("qwen3-8b", True), ("qwen3-4b", False),
                                               ("qwen2.5-coder-0.5b-instruct", False), ("qwen3-30b-a3b", False)])
def test_a_large_model_on_one_cpu_device_runs_one_program_per_layer(model_id, layered, monkeypatch):
    """Guards the choice engine.sharding.Layout makes (engine.model.runs_layered): a model whose
    layers hold 128M weights or more (Qwen3.8-27B's 380M, Qwen3-8B's 193M) runs a program per layer on
    one CPU device, where its fused programs held gigabytes of host memory; a smaller one (Qwen3-4B's
    101M, the demo's 15M) keeps its fused program, whose dispatch would cost it more of a step; so do
    routed experts (traced per layer), accelerators and meshes. MASHBOX_LAYERED overrides the size."""
    from engine import registry
    monkeypatch.delenv(model.LAYERED_ENV, raising=False)
    cfg = config_from_dict(registry.resolve(model_id).config)
    assert model.runs_layered(cfg, "cpu", 1) == layered
    assert not model.runs_layered(cfg, "gpu", 1) and not model.runs_layered(cfg, "cpu", 2)
    monkeypatch.setenv(model.LAYERED_ENV, "0" if layered else "1")
    assert model.runs_layered(cfg, "cpu", 1) == (not layered and "moe" not in cfg.mlp_kinds)


@pytest.mark.parametrize("name", ["qwen3", "qwen3-8"])
def test_a_layered_model_call_compiles_a_program_per_distinct_layer_and_gives_the_logits(name):
    """Guards the layered model call (engine.model.jit_forward with cfg.layered) against a layer's
    program being compiled per layer rather than per kind and form, a cache entry left unwritten or
    written twice, or its arithmetic drifting from the fused program's: one layer program per layer
    kind; the cache the same shapes; prefill and decode logits
    within float32's rounding of the fused program's (XLA fuses a layer's first and last operations
    with its neighbours' there), with the same greedy tokens."""
    import dataclasses
    folder = os.path.join(TINY, name)
    cfg = load_config(folder)
    params = load_weights(folder, cfg, jnp.float32)
    fused, layered = dataclasses.replace(cfg, layered=False), dataclasses.replace(cfg, layered=True)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 24)).astype(np.int32)
    runs = {}
    for c in (fused, layered):
        cache = init_cache(c, SLOTS, CTX, jnp.float32)
        before = model._jit_layer_step._cache_size()
        logits, cache = _run(params, cache, c, tokens[0], [0], [0], [24], all_logits=True)
        assert model._jit_layer_step._cache_size() - before == (len(set(cfg.layer_kinds)) if c.layered else 0)
        steps = [np.asarray(logits[0])]
        for pos in range(24, 28):
            one, cache = _run(params, cache, c, [int(np.argmax(steps[-1][-1]))], [0], [pos], [1])
            steps.append(np.asarray(one)[None])
        runs[c.layered] = steps, cache
    (want, want_cache), (got, got_cache) = runs[False], runs[True]
    assert jax.tree.map(np.shape, got_cache) == jax.tree.map(np.shape, want_cache)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
        assert (np.argmax(g, -1) == np.argmax(w, -1)).all()
