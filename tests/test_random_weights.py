"""--weights random: models.json's ids at their real shapes, weights drawn from a seed in place of files
(engine.checkpoint.RandomSource), through the same loader, memory plan, identity and server as a real
folder; the memory plan's refusal of a model that does not fit; the 27B's form on a 24 GB host."""
from __future__ import annotations

import json
import mmap
import os

import numpy as np
import pytest

from engine import checkpoint, identity, memory, native, registry
from engine.checkpoint import Checkpoint, random_checkpoint
from engine.config import config_from_dict, load_config

GIB = 1 << 30
BIG = "qwen3-8-27b"          # the spec's model: Qwen3.8-27B's shape
# Fewer layers and a small vocabulary, the rest of the 27B's shape: one full-attention layer and three
# Gated DeltaNet layers at their real widths, a forward in seconds (the vocabulary only sizes the ends).
SMALL_27B = {"num_hidden_layers": 4, "vocab_size": 4096, "eos_token_id": [4095]}


def spec_of(model_id: str, seed: int = 0) -> registry.ModelSpec:
    """The id's random weights; their folders are made under the cache root, as the server makes them
    (the native kernel's build and Qwen3.5's converted vocabulary are there once, not once per run)."""
    return registry.resolve(model_id, f"random:{seed}")


# ---- models.json: every id has its shape ----------------------------------------------------------

def test_every_models_json_id_resolves_with_a_shape_of_its_family_and_context():
    """Guards against an id whose `config` is missing, does not parse, names another family or another
    context length than the entry, or has the wrong size (the published parameter counts)."""
    published = {"qwen2.5-coder-0.5b-instruct": 0.49e9, "qwen2.5-7b-instruct": 7.62e9, "qwen3-0.6b": 0.60e9,
                 "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.5e9, "qwen3-next-80b-a3b-instruct": 79.7e9,
                 BIG: 26.9e9, "qwen3.5-35b-a3b": 34.7e9}
    for model_id, entry in registry.load_models()["models"].items():
        cfg = config_from_dict(entry["config"])
        assert cfg.model_type == entry["family"], model_id
        assert cfg.max_position_embeddings == entry["context_length"], model_id
        assert spec_of(model_id).random_seed == 0
        if model_id in published:
            count = memory.parameter_count(random_checkpoint(cfg, 0, "bf16"))
            assert abs(count / published[model_id] - 1) < 0.01, (model_id, count)


def test_the_spec_model_is_qwen3_8_27b_in_bfloat16_and_fp8():
    """Guards against the spec's model id drifting from the published Qwen3.8-27B: 64 layers, three
    Gated DeltaNet then one gated attention, 24 query and 4 KV heads of 256, a quarter rotated, KV 64
    KiB per token in bfloat16, DeltaNet state 144 MiB and conv 5.6 MiB per sequence; its FP8 sibling
    in 128 x 128 blocks."""
    models = registry.load_models()["models"]
    cfg = config_from_dict(models[BIG]["config"])
    assert cfg.layer_kinds == ("linear", "linear", "linear", "gated_attention") * 16
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (5120, 17408, 248320)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (24, 4, 256, 64)
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.rope_theta) == (16, 48, 1e7)
    assert memory.kv_bytes_per_token(cfg, "bfloat16") == 64 << 10
    assert memory.slot_state_bytes(cfg) == (144 << 20) + 48 * cfg.linear_conv_dim * 3 * 4
    assert cfg.eos_token_ids == (248046, 248044) and not cfg.tie_word_embeddings
    fp8 = config_from_dict(models[BIG + "-fp8"]["config"])
    assert fp8.fp8 and fp8.layer_kinds == cfg.layer_kinds
    assert models[BIG]["chat_format"] == models[BIG + "-fp8"]["chat_format"] == "qwen3.8"


# ---- the random tensor source ----------------------------------------------------------------------

def test_random_weights_are_the_same_for_a_seed_whatever_rows_are_read_and_differ_between_seeds():
    """Guards against draws that depend on how a tensor is read (a slice of rows, the whole) or
    that ignore the seed."""
    cfg = config_from_dict(registry.load_models()["models"][BIG]["config"])
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    for form in ("bf16", "q4_k", "q6_k", "q8_0"):
        a, b = random_checkpoint(cfg, 0, form), random_checkpoint(cfg, 0, form)
        whole = a.get(name, slice(0, 1024))
        np.testing.assert_array_equal(np.asarray(b.get(name, slice(300, 700)), np.float32),
                                      np.asarray(whole[300:700], np.float32))
        other = random_checkpoint(cfg, 1, form).get(name, slice(0, 1024))
        assert not np.array_equal(np.asarray(other, np.float32), np.asarray(whole, np.float32)), form


def test_random_weights_have_the_real_shapes_and_the_form_named():
    """Guards against a random checkpoint that is not the model's (names, shapes) or not in the form
    asked for: Q4_K blocks for every layer projection and the head, as a GGUF of it would hold, and
    the MTP module's 15 tensors beside the trunk, as the published checkpoint has them (the drafter
    reads them: tests/bench/bench_mtp_cost.py)."""
    cfg = config_from_dict(registry.load_models()["models"][BIG]["config"])
    ck = random_checkpoint(cfg, 0, "q4_k")
    mtp = {name for name in ck.shapes if name.startswith("mtp.")}
    assert len(ck.shapes) - len(mtp) == 851             # Qwen3.8-27B's text model tensors
    assert len(mtp) == 15 and ck.has(checkpoint.MTP_TENSOR)
    assert ck.shapes["mtp.fc.weight"] == (5120, 10240) and ck.formats["mtp.fc.weight"] == "Q4_K"
    assert ck.shapes["mtp.layers.0.self_attn.q_proj.weight"] == (2 * 24 * 256, 5120)   # gated, as the trunk's
    assert ck.shapes["mtp.layers.0.mlp.down_proj.weight"] == (5120, 17408)
    assert ck.formats["mtp.norm.weight"] == "F32" and not ck.get("mtp.norm.weight").any()   # 1 + w: neutral
    assert ck.shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 24 * 256, 5120)
    assert ck.shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120)
    assert ck.shapes["model.layers.0.linear_attn.conv1d.weight"] == (10240, 1, 4)
    assert ck.shapes["lm_head.weight"] == ck.shapes["model.embed_tokens.weight"] == (248320, 5120)
    assert ck.formats["model.layers.5.mlp.down_proj.weight"] == ck.formats["lm_head.weight"] == "Q4_K"
    assert ck.formats["model.layers.0.linear_attn.A_log"] == "F32" and ck.bits_per_weight == 4.5
    parts = ck.k_quant("model.layers.5.mlp.down_proj.weight", slice(0, 16))
    assert parts["levels"].shape == (16, 17408) and parts["levels"].max() <= 15
    assert parts["sc"].max() <= 63 and parts["d"].dtype == np.float16       # 6-bit scales, valid blocks
    values = ck.get("model.layers.5.mlp.down_proj.weight", slice(0, 64))
    assert abs(values.std() * np.sqrt(17408) - 1) < 0.1 and abs(values.mean()) < 1e-3
    f8 = random_checkpoint(cfg, 0, "fp8")
    values, scales = f8.fp8("model.layers.3.self_attn.o_proj.weight")
    assert str(values.dtype) == "float8_e4m3fn"
    assert scales.shape == (5120, 6144 // 128) and f8.formats["lm_head.weight"] == "BF16"


def test_random_folder_holds_no_weight_file_and_its_identity_names_random_and_the_seed():
    """Guards against a random folder that writes or reads weight files, or whose component set sha
    is the same for two seeds (two different models): its only "weights" are the marker."""
    spec = spec_of(BIG, 7)
    folder = registry.random_folder(spec, "q4_k", SMALL_27B)
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", checkpoint.RANDOM_MARKER,
                                          "tokenizer.json", "tokenizer_config.json"]
    assert Checkpoint(str(folder)).files == [str(folder / checkpoint.RANDOM_MARKER)]
    marker = json.loads((folder / checkpoint.RANDOM_MARKER).read_text())
    assert (marker["weights"], marker["seed"], marker["form"]) == ("random", 7, "q4_k")
    shas = {identity.component_set_sha(str(registry.random_folder(spec_of(BIG, seed), "q4_k", SMALL_27B)),
                                       "qwen3.8") for seed in (7, 7, 8)}
    assert len(shas) == 2
    assert registry.stop_token_ids(str(folder)) == SMALL_27B["eos_token_id"]        # the config's, written
    assert registry.random_folder(spec, "q4_k", SMALL_27B) == folder          # made once, reused


def test_bad_random_weights_are_refused_naming_what_is_wrong(tmp_path):
    with pytest.raises(registry.RegistryError, match="random:SEED"):
        registry.resolve(BIG, "random:x")
    with pytest.raises(registry.RegistryError, match="models.json id"):
        registry.resolve(str(tmp_path), "random")
    with pytest.raises(registry.RegistryError, match="not an FP8 checkpoint"):
        registry.random_folder(spec_of(BIG), "fp8")


# ---- through the loader and the model ----------------------------------------------------------------

def _logits(folder, dtype):
    import jax.numpy as jnp
    from engine.cache import init_cache
    from engine.model import jit_forward
    from engine.weights import load_weights
    cfg = load_config(str(folder))
    params = load_weights(str(folder), cfg, dtype)
    tokens = jnp.asarray([[11, 2000, 7, 4000, 5]], jnp.int32)
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    logits, _ = jit_forward(params, init_cache(cfg, 1, 64, jnp.float32), tokens, i32([0]), i32([0]), i32([5]),
                            cfg=cfg)
    return params, np.asarray(logits[0])


# The bfloat16 case's MLPs narrowed too: drawing and rounding floats is the slow part of a test.
@pytest.mark.parametrize("form, dtype, narrower", [("bf16", "int8", {"intermediate_size": 1024}),
                                                   ("q4_k", "int8", {})])
def test_a_random_27b_shape_loads_without_reading_a_file_and_gives_finite_spread_logits(monkeypatch,
                                                                                       form, dtype, narrower):
    """Guards against a random model whose forward is not finite or whose logits are flat (every token
    alike), against a loader that opens a weight file for it, and against Gated DeltaNet matrices left
    in float32 (22 GB at 27B): they are held int8, or in the form's blocks where the kernel serves."""
    folder = registry.random_folder(spec_of(BIG), form, {**SMALL_27B, **narrower})

    def no_file(*args, **kwargs):
        raise AssertionError("a weight file was opened for random weights")
    anonymous = mmap.mmap

    def no_file_mapped(fileno, *args, **kwargs):       # anonymous maps (the weights' huge pages) are not files
        if fileno != -1:
            no_file()
        return anonymous(fileno, *args, **kwargs)
    monkeypatch.setattr(np, "memmap", no_file)
    monkeypatch.setattr(mmap, "mmap", no_file_mapped)
    params, logits = _logits(folder, dtype)
    assert np.all(np.isfinite(logits))
    # spread, and most tokens' logits apart (a degenerate head, rows repeated or zero, gives few values)
    assert 1.0 < logits.std() < 10.0 and len(np.unique(logits)) > logits.size // 2
    linear = params["layers"][0]["linear"]
    for name in ("in", "out"):
        assert isinstance(linear[name], dict), name                    # not a float array
    if form == "q4_k" and native.available():
        assert native.k_kind(linear["in"]) == "Q4_K"


# ---- the memory plan ------------------------------------------------------------------------------

def _plan(folder_or_checkpoint, cfg, weights_dtype, available, spec):
    return memory.size(cfg, folder_or_checkpoint, slots=None, ctx=None, cache_ram_mib=None,
                       default_slots=spec.slots, default_ctx=spec.ctx, default_cache_ram_mib=spec.cache_ram_mib,
                       available=available, on_host=True, weights_dtype=weights_dtype)


def test_a_host_the_27b_does_not_fit_is_refused_in_one_line_naming_the_memory_and_the_gguf_route(monkeypatch):
    """Guards against a 24 GB host starting a worker the kernel kills later, or refusing with advice
    that cannot help (fewer slots): the weights alone do not fit, so the line says how much they need
    and that a Q4_K_M GGUF (~16 GB) does."""
    spec = spec_of(BIG)
    cfg = config_from_dict(spec.config)
    with pytest.raises(memory.DoesNotFit) as refused:
        _plan(random_checkpoint(cfg, 0, "bf16"), cfg, "int8", 24 * GIB, spec)
    line = str(refused.value)
    held = memory.held_weight_bytes(random_checkpoint(cfg, 0, "bf16"), "int8") + \
        memory.drafting_bytes(cfg, random_checkpoint(cfg, 0, "bf16"), spec.slots, "auto", "int8")[0]
    assert "\n" not in line and f"The weights alone need {held / GIB:.1f} GiB" in line and held > 24 * GIB
    assert "Q4_K_M GGUF of the model instead (about 16 GB" in line
    plan = _plan(random_checkpoint(cfg, 0, "bf16"), cfg, "int8", 80 * GIB, spec)   # as on an 80 GB host
    assert (plan.slots, plan.ctx) == (spec.slots, spec.ctx)


def test_auto_random_weights_on_a_24_gb_cpu_are_the_widest_blocks_that_fit_and_int8_where_it_fits(monkeypatch):
    """Guards against an auto form that takes a 24 GB machine past its memory (int8: 27 GB) or one
    narrower than needed for a model that fits as int8 (qwen3-0.6b)."""
    monkeypatch.setattr(native, "tier", lambda: "avx512_vnni")
    monkeypatch.setattr(memory, "engine_on_host", lambda: True)
    monkeypatch.setattr(memory.cpu, "auto_weights_dtype", lambda: "int8")
    for model_id, available, want in ((BIG, 23 * GIB, "q4_k"), (BIG, 64 * GIB, "int8"),
                                      ("qwen3-0.6b", 23 * GIB, "int8")):
        spec = spec_of(model_id)
        cfg = config_from_dict(spec.config)
        got = memory.random_weights_dtype(
            cfg, lambda ck, held: _plan(ck, cfg, held, available, spec), available=available)
        assert got == want, (model_id, available)
    trunk = memory.held_weight_bytes(random_checkpoint(config_from_dict(spec_of(BIG).config), 0, "q4_k"), "int8")
    assert trunk < 16.5e9                  # Q4_K blocks as the kernel holds them, the embedding int8


# ---- a served random model ------------------------------------------------------------------------

def test_a_served_random_model_answers_a_chat_request_and_says_what_it_holds():
    """Guards against random weights that the server cannot serve end to end (its tokenizer, the
    worker's load, the programs) or describes untruthfully: a real server and worker on a real socket,
    Qwen3-0.6B's shape cut to one layer; /v1/models names the random weights, their stored bits per
    weight and what the worker holds; Health reports them not certified."""
    import asyncio
    import mashbox
    from tests.harness import HOST, Server
    folder = registry.random_folder(spec_of("qwen3-0.6b"), "bf16", {"num_hidden_layers": 1})
    args = {"model_id": "qwen3-0.6b", "weights_folder": str(folder), "slots": 1, "ctx": 256, "dtype": "int8",
            "prefill_chunks": [32], "cache_ram_mib": 0, "chat_format": "qwen3",   # the server's compile cache
            "speculative": "off"}     # fewer programs to compile: drafting is not what this tests
    app = mashbox.App(mashbox.ServeConfig(host=HOST, port=0, model="qwen3-0.6b"),
                      bridge=mashbox.Bridge(args, log=lambda m: None))
    server = Server(app, args)
    try:
        server.call(asyncio.wait_for(app.wait_ready(), 300), 301)
        status, _, raw = server.request("POST", "/v1/chat/completions", {
            "model": "qwen3-0.6b", "messages": [{"role": "user", "content": "Name three planets."}],
            "max_tokens": 8})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] >= 1
        status, _, raw = server.request("GET", "/v1/models")
        model = json.loads(raw)["data"][0]
        assert (model["weights"], model["bpw"]) == ("random:0 (BF16)", 16.0) and 0.1 < model["gb"] < 0.5
        status, _, raw = server.request("GET", "/health")
        assert "random weights, not certified" in raw.decode()
    finally:
        server.stop()


def test_the_plan_counts_the_27bs_mtp_drafter():
    """Guards memory.drafting_bytes at Qwen3.8-27B's shape: its random checkpoint holds its MTP
    module, and the plan counts the MTP layer's weights, its KV cache and a verification's steps
    (megabytes, not the per-position states' gigabytes)."""
    base = registry.load_models()["models"][BIG]["config"]
    full = config_from_dict(base)
    assert random_checkpoint(full, 0, "q4_k").has(checkpoint.MTP_TENSOR)
    weights, kv, states = memory.drafting_bytes(full, random_checkpoint(full, 0, "q4_k"), 1, "auto", "int8")
    assert weights > 400e6 and kv > 0 and 0 < states < 64e6
    cut = config_from_dict({**base, "num_hidden_layers": 16})
    assert memory.drafting_bytes(cut, random_checkpoint(cut, 0, "q4_k"), 1, "off", "int8") == (0, 0, 0)
