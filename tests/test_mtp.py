"""The model's own drafter (engine.model.draft): the checkpoint's MTP layer against a float32
reference made with transformers' layers (tests/fixtures/qwen3_8_mtp_reference.py), its KV cache
following the slot's tokens, and drafting with it in the engine against drafting off."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from engine.cache import init_cache, read_slot, read_state
from engine.config import load_config
from engine.model import jit_draft, jit_forward
from engine.protocol import Sampling, Submit
from engine.weights import load_mtp, load_weights

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3_8 = str(FIXTURES / "tiny" / "qwen3-8")
# float32 against float32 transformers: summation order only (the trunk's chunked delta rule, as
# tests/test_hybrid.py's QWEN3_8_ATOL).
ATOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    return load_file(str(FIXTURES / "qwen3-8-mtp.reference.safetensors"))


@pytest.fixture(scope="module")
def float_model():
    cfg = load_config(QWEN3_8)
    params = load_weights(QWEN3_8, cfg, jnp.float32)
    params["mtp"] = load_mtp(QWEN3_8, cfg, jnp.float32)
    return cfg, params


def _i32(*values):
    return tuple(np.asarray(v, np.int32) for v in values)


def test_the_mtp_layer_predicts_each_token_after_next_as_the_reference(float_model, reference):
    """Guards against the MTP layer reading the wrong trunk state (before its final norm), joining
    embedding and state in the other order, missing a norm, or its entries landing at the wrong
    positions: after the first p + 1 tokens run, the pool's carry is the trunk's normed state at p
    and the first draft from token p + 1 is the reference's most likely token after it."""
    cfg, params = float_model
    tokens, want = reference["tokens"], reference["mtp_logits"]
    n = len(tokens)
    checked = 0
    for p in range(0, n - 1, 3):
        cache = init_cache(cfg, 1, 64, jnp.float32, mtp=True)
        # the whole sequence given, the first p + 1 live: one program for every p
        _, cache = jit_forward(params, cache, tokens[None, :], *_i32([0], [0], [p + 1]), cfg=cfg)
        carry = read_state(cache, 0)[-1]["hidden"]
        np.testing.assert_allclose(carry, reference["hidden"][p], atol=ATOL)
        drafts, cache = jit_draft(params, cache, *_i32([tokens[p + 1]], [0], [p], [1]), cfg=cfg, k=1)
        top = np.sort(want[p])[-2:]
        if top[1] - top[0] > 10 * ATOL:                     # a clear first choice
            assert int(drafts[0, 0]) == int(np.argmax(want[p])), f"entry {p}"
            checked += 1
    assert checked >= 10


# ---- which drafter runs, and why ----------------------------------------------------------------------

@pytest.mark.parametrize("mode, has_mtp, mtp, ngram, why", [
    ("auto", True, True, True, None), ("auto", False, False, True, None), ("mtp", True, True, False, None),
    ("mtp", False, False, False, "no MTP layer"), ("ngram", True, False, True, None),
    ("off", True, False, False, "--speculative off")])
def test_the_mode_and_the_checkpoint_decide_which_drafter_runs_and_the_log_says_why(mode, has_mtp, mtp, ngram,
                                                                                      why):
    """Guards against the MTP layer drafting where it was not asked for or is absent (a checkpoint
    quantized without its mtp.* tensors: drafting by MTP off, and the start-up line says why)."""
    from types import SimpleNamespace

    from engine.scheduler import Buckets
    from engine.worker import Engine
    e = Engine.__new__(Engine)
    e.cfg = dataclasses.replace(load_config(QWEN3_8), native=True)
    e.args = SimpleNamespace(speculative=mode, ctx=4096, slots=4)
    e.weights_dtype, e.kv_dtype = "int8", np.dtype(np.int8)
    e.buckets = Buckets.for_ctx(4096, slots=4)
    spec = e.speculator = e._speculator(has_mtp=has_mtp)
    assert (spec.mtp, spec.ngram and spec.off is None) == (mtp, ngram)
    assert (spec.off is None) == (why is None) and (why is None or why in spec.off)
    note = e._speculative_fact()             # Health's, and the start-up log's line
    if why is not None:
        assert why in note and note.startswith("off")
    elif mtp:
        assert "MTP layer" in note
    else:
        assert ("no MTP layer" if mode == "auto" else "--speculative ngram") in note
    assert e.draft_programs() == ([(1, 3), (4, 3)] if mtp else [])     # a hybrid verifies 1 + 3


# ---- drafting with the MTP layer in the engine ----------------------------------------------------------

@pytest.fixture(scope="module")
def engines(compile_cache):
    """qwen3-8 drafting by its MTP layer alone, with two slots and a host cache (three conversations
    take turns in them, reloading their starts and snapshots), and drafting off without any cache."""
    from tests.test_speculative import _engine
    on = _engine("mtp", "qwen3-8", slots=2, compile_cache=compile_cache, cache_ram_mib=16)
    assert on.speculator.mtp and "mtp" in on.params
    return on, _engine("off", "qwen3-8", slots=2, compile_cache=compile_cache, prefix_cache=False)


def _always_draft(monkeypatch, engine) -> None:
    """Make the engine draft with its MTP layer every round whatever it keeps (the random tiny layer
    keeps almost nothing, and `auto` would stop): acceptance estimates held at 1, and verifications
    and drafts taken for as cheap as a decode step."""
    from engine import speculative
    spec = engine.speculator
    monkeypatch.setattr(speculative, "ACCEPTANCE_WEIGHT", 0.0)
    monkeypatch.setattr(spec, "mtp_prior", 1.0)
    for rows, ts in spec.shapes.items():
        for t in ts:
            spec.seconds[(rows, t)] = spec.seconds[(rows, 1)]
            spec.draft_seconds[(rows, t - 1)] = 0.0
    monkeypatch.setattr(spec, "measured", lambda *args, **kw: None)


def _runs(engine, prompts, sampling, tag: str) -> dict:
    from tests.test_speculative import _run
    alone = {f"{tag}{i}": _run(engine, [Submit(f"{tag}{i}", p, 32, sampling)])[f"{tag}{i}"]
             for i, p in enumerate(prompts)}
    together = _run(engine, [Submit(f"{tag}-both{i}", p, 32, sampling) for i, p in enumerate(prompts[:2])])
    return {**alone, **together}


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_k=20, seed=11)],
                         ids=["greedy", "seeded"])
def test_mtp_drafts_rejected_and_kept_give_the_output_without_drafting(engines, sampling, monkeypatch):
    """Guards against gibberish after a rejected draft and against a kept run leaving the wrong MTP
    carry: the random layer's own drafts (nearly all rejected), then drafts of the right tokens with
    every fifth wrong (kept runs of every length), alone and beside another row, give plain
    decoding's tokens, with no program compiled after ready."""
    from tests.test_speculative import _prompts
    on, off = engines
    _always_draft(monkeypatch, on)
    prompts = _prompts()
    want = {rid: r["tokens"] for rid, r in _runs(off, prompts, sampling, "x").items()}
    before = dict(on.speculator.drafted)
    got = _runs(on, prompts, sampling, "x")
    assert {rid: r["tokens"] for rid, r in got.items()} == want
    assert on.speculator.drafted["mtp"] > before["mtp"]
    truth = {i: want[f"x{i}"] for i in range(len(prompts))}

    def oracle(tokens, slots, starts, lengths, k):         # the right tokens, each fifth wrong
        out = np.zeros((len(slots), k), np.int32)
        for row, slot in enumerate(slots):
            held = on.scheduler.slots[int(slot)]
            if lengths[row] and held.request is not None:
                done, right = len(held.request.output), truth[int(held.request.rid[-1])]
                drafts = (right[done:done + k] + [0] * k)[:k]
                out[row] = [(x + 1) % on.cfg.vocab_size if (done + j) % 5 == 4 else x for j, x in enumerate(drafts)]
        return out
    monkeypatch.setattr(on, "_draft", oracle)
    kept = dict(on.speculator.accepted)
    got = _runs(on, prompts, sampling, "x")
    assert {rid: r["tokens"] for rid, r in got.items()} == want
    assert on.speculator.accepted["mtp"] > kept["mtp"]
    assert on.compiles_after_ready() == 0


def _cold_mtp(engine, tokens: list[int]) -> tuple[dict, dict]:
    """The MTP entries and carry a cold run of `tokens` writes: a fresh pool of one slot, the prompt
    read in the engine's largest chunk."""
    cache = init_cache(engine.cfg, 1, engine.args.ctx, engine.kv_dtype, mtp=True)
    chunk = max(engine.buckets.chunks)
    for start in range(0, len(tokens), chunk):
        part = np.zeros((1, chunk), np.int32)
        real = tokens[start:start + chunk]
        part[0, :len(real)] = real
        _, cache = jit_forward(engine.params, cache, part, *_i32([0], [start], [len(real)]), cfg=engine.cfg)
    return read_slot(cache, 0, len(tokens))[-1], read_state(cache, 0)[-1]


def test_the_mtp_cache_follows_its_slots_tokens_through_the_prompt_cache_and_a_restart(engines, compile_cache,
                                                                                        monkeypatch):
    """Guards against the MTP layer's cache not following its slot's tokens (other servers' users saw
    acceptance fall to 0 after a few turns, and empty answers with MTP and prefix caching): three
    conversations take turns on two slots, each turn reloading its start and snapshot from the host
    cache; every answer equals drafting off without any cache, and after each conversation the MTP
    entries and carry of its slot are those a cold run of the same tokens writes (to int8 rounding).
    Then a restarted worker answers the same."""
    from tests.test_speculative import _conversations, _engine
    on, off = engines
    _always_draft(monkeypatch, on)
    seeds = [4, 5, 6]
    want = _conversations(off, seeds)
    hits = on.scheduler.host_hits
    assert _conversations(on, seeds) == want
    assert on.scheduler.host_hits > hits and on.speculator.verifications["mtp"] > 0
    for seed in seeds:
        prompt, answer = want[seed][-1]
        held = prompt + answer[:-1]                      # the answer's last token is never run
        slot = next((s for s in on.scheduler.slots if s.tokens == held), None)
        if slot is None:
            continue                                     # its slot went to another conversation
        hot_kv, hot_carry = read_slot(on.cache, slot.index, len(held))[-1], read_state(on.cache, slot.index)[-1]
        cold_kv, cold_carry = _cold_mtp(on, held)
        for name in "kv":
            h = hot_kv[name].astype(np.float32) * hot_kv[f"{name}_scale"][:, None]
            c = cold_kv[name].astype(np.float32) * cold_kv[f"{name}_scale"][:, None]
            entries = slice(0, len(held) - 1)            # entry p reads token p + 1: the last is next
            assert np.abs(h - c)[..., entries].mean() < 0.02 * np.abs(c)[..., entries].mean(), (seed, name)
        # the trunk's state read through the int8 cache in other chunks and steps (measured up to 0.4%)
        h, c = hot_carry["hidden"], cold_carry["hidden"]
        assert np.abs(h - c).mean() < 0.01 * np.abs(c).mean() and np.abs(h - c).max() < 0.05 * np.abs(c).max()
    again = _engine("mtp", "qwen3-8", slots=2, compile_cache=compile_cache, cache_ram_mib=16)
    _always_draft(monkeypatch, again)
    assert _conversations(again, seeds[::-1]) == {seed: want[seed] for seed in seeds[::-1]}
    assert again.speculator.verifications["mtp"] > 0 and again.compiles_after_ready() == 0


def test_a_ggufs_nextn_block_drafts_and_gives_the_output_without_drafting(tmp_path, monkeypatch):
    """Guards the GGUF route to the drafter: a qwen35 GGUF written the converter's way keeps the MTP
    module as its block past the trunk (nextn.*); served with --speculative mtp its layer is loaded
    and drafts every round (nearly all rejected: the tiny layer is random), and the tokens are those
    of the same file with drafting off, greedy and seeded."""
    from engine import registry
    from engine.worker import Engine, WorkerArgs
    from tests.test_qwen35_gguf import write_qwen35_gguf
    from tests.test_speculative import _prompts
    monkeypatch.setenv(registry.ENV_CACHE, str(tmp_path / "cache"))
    folder = str(registry.prepare(registry.resolve(str(write_qwen35_gguf("qwen3-8", tmp_path / "Tiny-3.8.gguf")))))

    def engine(mode: str) -> Engine:
        return Engine(WorkerArgs("tiny-gguf", folder, slots=2, ctx=256, prefill_chunks=(8, 32), dtype="int8",
                                 kv_dtype="int8", speculative=mode, compile_cache=None))
    on, off = engine("mtp"), engine("off")
    if on.speculator.off:
        pytest.skip(f"drafting is off here: {on.speculator.off}")
    assert on.speculator.mtp and "mtp" in on.params
    _always_draft(monkeypatch, on)
    prompts = _prompts()
    for sampling in (Sampling(), Sampling(temperature=0.8, top_k=20, seed=11)):
        want = {rid: r["tokens"] for rid, r in _runs(off, prompts, sampling, "g").items()}
        before = on.speculator.drafted["mtp"]
        assert {rid: r["tokens"] for rid, r in _runs(on, prompts, sampling, "g").items()} == want
        assert on.speculator.drafted["mtp"] > before
