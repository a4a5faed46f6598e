"""Speculative decoding (engine.speculative): the drafter's index, the choice of when to draft, the
sampler's verification, and the engine's output with drafting on against off, token for token."""
from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

from engine import products, sampler
from engine.protocol import Sampling, Submit
from engine.speculative import RECHECK_ROUNDS, Drafter, RowStats, Speculator, expected_tokens

TINY = Path(__file__).parent / "fixtures" / "tiny"


# ---- the drafter ------------------------------------------------------------------------------------

def test_a_draft_continues_the_latest_earlier_occurrence_of_the_last_tokens():
    d = Drafter([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert d.propose(3) == [7, 8, 1]          # the latest earlier "1 2 3" was followed by 7 8 1
    assert d.propose(1) == [7]


def test_the_longest_matching_ngram_wins_over_a_later_shorter_one():
    d = Drafter([5, 1, 2, 3, 40, 41, 9, 2, 3, 50, 1, 2, 3])
    assert d.propose(2) == [40, 41]           # "1 2 3" (not the later "2 3", which led to 50)


def test_nothing_is_drafted_without_an_earlier_match_or_room():
    assert Drafter([1, 2, 3, 4]).propose(4) == []
    assert Drafter([1, 2, 1, 2]).propose(0) == []


def test_tokens_added_later_are_indexed_and_drafted_from():
    d = Drafter([1, 2, 3])
    d.extend([9, 1, 2])
    assert d.propose(2) == [3, 9]


# ---- when to draft ----------------------------------------------------------------------------------

def timed(shapes, seconds) -> Speculator:
    s = Speculator(None, shapes)
    for key, value in seconds.items():
        s.measured(*key, value)
    return s


def test_a_round_drafts_only_when_the_expected_tokens_per_second_beat_a_decode_step():
    rows = [("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3], 100)]
    cheap = timed({1: (4, 8)}, {(1, 1): 1.0, (1, 4): 1.2, (1, 8): 1.5})
    plan = cheap.plan(1, rows)
    assert plan.t in (4, 8) and plan.ngram == [[4, 5, 6, 7, 8, 9, 1][:plan.t - 1]] and not plan.mtp
    dear = timed({1: (4, 8)}, {(1, 1): 1.0, (1, 4): 3.0, (1, 8): 5.0})
    assert (dear.plan(1, [("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3], 100)]).t, dear.plan(1, [
        ("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3], 100)]).ngram) == (1, [[]])


def test_rows_with_nothing_to_draft_run_the_plain_decode_step():
    s = timed({1: (4, 8)}, {(1, 1): 1.0, (1, 4): 1.01, (1, 8): 1.02})
    plan = s.plan(1, [("a", [10, 11, 12], [13], 50)])
    assert (plan.t, plan.ngram) == (1, [[]])


def test_a_draft_never_reaches_past_the_tokens_a_row_may_still_take():
    s = timed({1: (8,)}, {(1, 1): 1.0, (1, 8): 1.0})
    plan = s.plan(1, [("a", [1, 2, 3, 4, 5, 6, 7, 8], [1, 2], 3)])
    assert plan.t == 8 and plan.ngram == [[3, 4]]      # room 3: two drafted, one drawn after them


def test_acceptance_follows_what_a_row_keeps():
    s = timed({1: (4, 8)}, {(1, 1): 1.0, (1, 4): 1.6, (1, 8): 2.6})
    rows = [("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3], 100)]
    assert s.plan(1, rows).t > 1
    for _ in range(10):
        s.verified("a", 7, 0)
    assert s.rows["a"].acceptance < 0.05 and s.plan(1, rows).t == 1
    assert s.finish("a") == (70, 0, 10) and "a" not in s.rows


def test_a_verification_passed_over_on_a_stale_time_runs_again_to_be_measured():
    """Guards against a program's high estimate (a noisy warm-up) keeping it from ever running, and so
    from ever being measured again: a near choice passed over RECHECK_ROUNDS times runs once."""
    s = timed({1: (4, 8)}, {(1, 1): 1.0, (1, 4): 1.2, (1, 8): 2.9})     # 8: near, never best
    rows = [("a", list(range(20)) * 2, [], 1000)]
    s.rows["a"] = RowStats(Drafter(rows[0][1]), acceptance=0.9)
    picks = [s.plan(1, rows).t for _ in range(RECHECK_ROUNDS)]
    assert picks == [4] * (RECHECK_ROUNDS - 1) + [8]
    s.measured(1, 8, 1.3)                      # it ran, cheaper than thought: now the best
    assert s.plan(1, rows).t == 8 and (1, 8, False) not in s.passed
    far = timed({1: (4, 8)}, {(1, 1): 1.0, (1, 4): 1.2, (1, 8): 50.0})  # not near: never retried
    far.rows["a"] = RowStats(Drafter(rows[0][1]), acceptance=0.9)
    assert {far.plan(1, rows).t for _ in range(2 * RECHECK_ROUNDS)} == {4}


def test_expected_tokens_counts_the_kept_run_and_the_drawn_token():
    assert expected_tokens(0, 0.9) == 1.0
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


# ---- the sampler's verification ----------------------------------------------------------------------

def test_verification_keeps_the_target_distribution_for_a_deterministic_draft():
    """The standard acceptance rule for a deterministic draft: the draft is kept with the target's
    probability of it, and a rejected position's token follows the target without the draft token.
    Drawn over many seeds at one position, the chi-square statistic stays below its 0.001 quantile."""
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    n, draft = 4000, 1
    logits = jnp.asarray(np.broadcast_to(np.log(probs), (n, 2, 4)).copy())
    params = sampler.row_params([(Sampling(temperature=1.0), seed, 0) for seed in range(n)])
    state = sampler.init_state(n, 4)
    picks, _ = sampler.verify(state, logits, jnp.full((n, 2), draft, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                              jnp.full(n, 2, jnp.int32), params, jnp.full((n, 2, 1), -1, jnp.int32),
                              every_slot=True, draw="sampled")
    first = np.asarray(picks)[:, 0]
    counts = np.bincount(first, minlength=4)
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 16.27                        # 3 degrees of freedom
    kept = (first == draft).mean()
    assert abs(kept - probs[draft]) < 0.03
    rejected = counts.copy()
    rejected[draft] = 0
    rest = probs.copy()
    rest[draft] = 0
    assert np.abs(rejected / rejected.sum() - rest / rest.sum()).max() < 0.03


def test_verification_draws_what_sequential_draws_give_with_penalties():
    """Position t draws with the key of output step t and the penalties of the tokens drawn before
    it, so a fully kept draft gives the tokens that sample() gives one step at a time."""
    rng = np.random.default_rng(0)
    vocab, t = 32, 4
    logits = rng.normal(size=(1, t, vocab)).astype(np.float32)
    s = Sampling(temperature=0.9, frequency_penalty=0.7, repetition_penalty=1.3, seed=5)
    seen = np.zeros(vocab, bool)
    seen[[3, 4]] = True

    def fresh():
        return sampler.start_row(sampler.init_state(1, vocab), np.int32(0), seen)

    state, sequential = fresh(), []
    for i in range(t):
        token, state = sampler.sample(state, jnp.asarray(logits[:, i]), jnp.zeros(1, jnp.int32),
                                      jnp.ones(1, bool), sampler.row_params([(s, 5, i)]),
                                      every_slot=True, draw="sampled")
        sequential.append(int(token[0]))
    drafts = np.zeros((1, t), np.int32)
    drafts[0, :t - 1] = sequential[:t - 1]
    picks, after = sampler.verify(fresh(), jnp.asarray(logits), jnp.asarray(drafts), jnp.zeros(1, jnp.int32),
                                  jnp.full(1, t, jnp.int32), sampler.row_params([(s, 5, 0)]),
                                  jnp.full((1, t, 1), -1, jnp.int32), every_slot=True, draw="sampled")
    assert list(np.asarray(picks)[0]) == sequential
    assert np.array_equal(np.asarray(after.counts), np.asarray(state.counts))


def test_tokens_after_a_rejected_draft_are_not_counted_for_penalties():
    vocab = 8
    logits = np.zeros((1, 3, vocab), np.float32)
    logits[:, :, 5] = 10.0                    # greedy picks 5 everywhere
    state = sampler.init_state(1, vocab)
    picks, state = sampler.verify(state, jnp.asarray(logits), jnp.asarray([[2, 5, 0]], jnp.int32),
                                  jnp.zeros(1, jnp.int32), jnp.full(1, 3, jnp.int32),
                                  sampler.row_params([(Sampling(frequency_penalty=0.5), 0, 0)]),
                                  jnp.full((1, 3, 1), -1, jnp.int32), every_slot=True, draw="greedy")
    assert list(np.asarray(picks)[0])[:1] == [5]       # the draft (2) was not drawn: one token out
    assert int(np.asarray(state.counts)[0, 5]) == 1


# ---- the engine: drafting on against off ----------------------------------------------------------------

# Tiny models drafted: dense, mixture of experts, and the hybrids (Gated DeltaNet layers beside
# gated attention: Qwen3-Next with its shared expert, and Qwen3.5's architecture at Qwen3.8-27B's
# ratios, which the smaller qwen3-5 fixture would only repeat).
MODELS = ["qwen3", "qwen3-moe", "qwen3-next", "qwen3-8"]
HYBRID = MODELS[2:]
# And Qwen3.8's shape run as one program per layer, as a large model runs on a CPU host
# (engine.model.runs_layered): drafting's exactness holds across those programs too.
LAYERED = "qwen3-8 layered"


def _engine(speculative: str, folder: str = "qwen3", slots: int = 4, compile_cache=None, **more):
    """A tiny int8 engine (drafting needs the native kernel's int8 products and cache); a folder
    named with " layered" runs one program per layer."""
    from engine.model import LAYERED_ENV
    from engine.worker import Engine, WorkerArgs
    folder, _, form = folder.partition(" ")
    with mock.patch.dict(os.environ, {LAYERED_ENV: "1" if form == "layered" else "0"}):
        return Engine(WorkerArgs("tiny", str(TINY / folder), slots=slots, ctx=256, prefill_chunks=(8, 32),
                                 compile_cache=compile_cache, dtype="int8", kv_dtype="int8",
                                 speculative=speculative, **more))


@pytest.fixture(scope="module", params=MODELS + [LAYERED])
def engines(request, compile_cache):
    """Each tiny model, drafting on and off."""
    on = _engine("auto", request.param, compile_cache=compile_cache)
    assert on.cfg.layered == (request.param == LAYERED)
    if on.speculator.off:
        pytest.skip(f"drafting is off here: {on.speculator.off}")
    return on, _engine("off", request.param, compile_cache=compile_cache)


def _run(engine, submits) -> dict:
    out = {}
    for s in submits:
        engine.submit(s)
    for _ in range(5000):
        if not engine.busy:
            return out
        for step in engine.step():
            r = out.setdefault(step.rid, {"tokens": [], "timings": None, "finish": None})
            r["tokens"] += step.tokens
            if step.finish:
                r["finish"], r["timings"] = step.finish, step.timings
    pytest.fail("the engine did not finish")


def _prompts():
    rng = np.random.default_rng(3)
    piece = [int(x) for x in rng.integers(5, 200, 12)]
    return [piece * 4, piece[:7] * 5 + [9, 8], [int(x) for x in rng.integers(5, 200, 30)]]


SAMPLINGS = [Sampling(), Sampling(temperature=0.8, top_k=20, seed=11),
             Sampling(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3, seed=3)]
SAMPLING_IDS = ["greedy", "seeded", "penalties"]


def _on_and_off(engines, sampling) -> tuple[dict, dict]:
    """Each prompt alone (the one-row programs) and all together (the four-row ones), drafting off
    (rid -> tokens) and on (rid -> the whole result, with its timings)."""
    on, off = engines
    prompts = _prompts()
    alone = [Submit(f"alone{i}", p, 48, sampling) for i, p in enumerate(prompts)]
    together = [Submit(f"together{i}", p, 48, sampling) for i, p in enumerate(prompts)]
    want = {**{s.rid: _run(off, [s])[s.rid]["tokens"] for s in alone}, **{
        rid: r["tokens"] for rid, r in _run(off, together).items()}}
    got = {**{s.rid: _run(on, [s])[s.rid] for s in alone}, **_run(on, together)}
    return want, got


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_output_with_drafting_is_the_output_without_token_for_token(engines, sampling):
    """Guards against a drafted row's tokens differing from plain decoding's, alone (the one-row
    programs) and beside others (the four-row ones), greedy or seeded, or a program compiled after
    ready. The dense tiny models' greedy output repeats its prompt, so the drafter finds drafts."""
    on, _ = engines
    want, got = _on_and_off(engines, sampling)
    assert {rid: r["tokens"] for rid, r in got.items()} == want
    assert on.compiles_after_ready() == 0
    drafted = sum(r["timings"]["draft_n"] for r in got.values())
    kept = sum(r["timings"]["draft_n_accepted"] for r in got.values())
    assert 0 <= kept <= drafted
    if sampling.temperature == 0 and on.cfg.model_type in ("qwen3", "qwen3_moe"):
        assert kept > 0, "the tiny model's repetitive greedy output was never drafted from"


def _oracle(monkeypatch, engine, truth: dict[tuple, list[int]], wrong_every: int = 5) -> None:
    """Make `engine` draft the output it must give (truth: prompt -> output), each wrong_every-th
    output token drafted wrong, so that verifications keep runs of every length and reject the
    rest; and make it take every verification for as cheap as a decode step (its real cost would
    keep the tiny hybrids from drafting at all). The drafter only proposes: the output stays
    verification's."""
    from engine import speculative

    def propose(self, k):
        for prompt, out in truth.items():
            if tuple(self.tokens[:len(prompt)]) == prompt and len(self.tokens) >= len(prompt):
                done = len(self.tokens) - len(prompt)
                return [(x + 1) % engine.cfg.vocab_size if (done + i) % wrong_every == wrong_every - 1 else x
                        for i, x in enumerate(out[done:done + k])]
        return []
    monkeypatch.setattr(speculative.Drafter, "propose", propose)
    spec = engine.speculator
    for rows, ts in spec.shapes.items():
        for t in ts:
            spec.seconds[(rows, t)] = spec.seconds[(rows, 1)]
    monkeypatch.setattr(spec, "measured", lambda *args, **kw: None)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=SAMPLING_IDS)
def test_output_with_drafts_right_and_wrong_in_turns_is_the_output_without(engines, sampling, monkeypatch):
    """Guards against a kept run or a rejected draft changing what follows (the KV cache written
    past the kept position, a linear layer's state or conv window after a rejected token): drafts
    that are right for 0 to 4 tokens at a time, greedy, seeded and penalized, alone and beside
    others, give plain decoding's tokens."""
    on, off = engines
    want, _ = _on_and_off((off, off), sampling)
    prompts = _prompts()
    truth = {tuple(p): want[f"alone{i}"] for i, p in enumerate(prompts)}
    _oracle(monkeypatch, on, truth)
    _, got = _on_and_off((on, off), sampling)
    assert {rid: r["tokens"] for rid, r in got.items()} == want
    drafted = sum(r["timings"]["draft_n"] for r in got.values())
    kept = sum(r["timings"]["draft_n_accepted"] for r in got.values())
    assert 0 < kept < drafted
    assert on.compiles_after_ready() == 0


@pytest.mark.parametrize("t", [4, 8])
def test_a_verification_gives_each_position_the_logits_of_a_decode_step_bit_for_bit(engines, t):
    """Guards against a position's numbers depending on the positions run beside it (the float ops
    of a call XLA orders by its shape: a norm's sum, a division by a broadcast factor): the logits
    of t positions in one call equal those of t decode steps, to the bit."""
    import jax
    from engine.model import jit_forward
    on, _ = engines
    _run(on, [Submit("p", _prompts()[2], 1)])
    slot = next(s.index for s in on.scheduler.slots if len(s.tokens) == len(_prompts()[2]))
    start = len(on.scheduler.slots[slot].tokens)
    tokens = np.arange(7, 7 + t, dtype=np.int32)[None]
    args = (np.array([slot], np.int32), np.array([start], np.int32))
    together, on.cache, _ = jit_forward(on.params, on.cache, tokens, *args[:1], args[1], np.array([t], np.int32),
                                        cfg=on.cfg, verify=True)
    together = np.asarray(together)[0]
    for i in range(t):
        one, on.cache = jit_forward(on.params, on.cache, tokens[:, i:i + 1], args[0], args[1] + i,
                                    np.array([1], np.int32), cfg=on.cfg)
        assert np.array_equal(np.asarray(one)[0], together[i]), f"position {i}"
    jax.block_until_ready(on.cache)


# A prompt's reads as (tokens, the program's length) per call: whole; in the engine's chunks of 32 or
# 8; split unevenly with chunks padded (a prefix from the cache, then the rest); its last 16 tokens
# written one by one as decode steps write an answer.
READS = {"whole": [(96, 96)], "32s": [(32, 32)] * 3, "8s": [(8, 8)] * 12,
         "uneven": [(27, 32), (32, 32), (32, 32), (5, 8)], "decoded": [(32, 32), (32, 32), (16, 32)] + [(1, 1)] * 16}


def test_a_prompt_reads_into_the_same_cache_in_any_chunks_and_as_decode_steps(engines):
    """Guards the same answer for the same request (engine.worker's same-answer line, which says it is
    guaranteed): a prompt's keys, values, linear-layer states and last logits are the same bits
    however it was read, so a prompt served from the cache, or a conversation's earlier answer, is a
    cold read of its text. Covers the products past 64 rows, attention, the Gated DeltaNet
    recurrence and the routers."""
    import jax
    from engine.model import jit_forward
    on, _ = engines
    tokens = np.random.default_rng(5).integers(5, 200, 96).astype(np.int32)
    read = {}
    for name, calls in READS.items():
        at = 0
        for n, length in calls:
            part = np.zeros((1, length), np.int32)
            part[0, :n] = tokens[at:at + n]
            logits, on.cache = jit_forward(on.params, on.cache, part, np.zeros(1, np.int32), np.array([at], np.int32),
                                           np.array([n], np.int32), cfg=on.cfg)
            at += n
        read[name] = [np.asarray(logits)[0]] + [
            np.asarray(a)[0, ..., :96] if key in ("k", "v", "k_scale", "v_scale") else np.asarray(a)[0]
            for layer in on.cache[:on.cfg.num_layers] for key, a in sorted(layer.items())]
    jax.block_until_ready(on.cache)
    held = on.scheduler.slots[0]                   # what the engine thought slot 0 held is gone
    held.tokens, held.snapshots, held.cuts = [], {}, []
    whole = read.pop("whole")
    for name, arrays in read.items():
        for i, (got, want) in enumerate(zip(arrays, whole)):
            np.testing.assert_array_equal(got, want, err_msg=f"{name}: array {i}")
    assert on.facts.same_answer.startswith("guaranteed: "), on.facts.same_answer


def test_a_rows_norm_is_the_same_whatever_rows_run_beside_it():
    """Guards against the norm's sum going back to XLA's reduce, which from 8 rows on vectorizes
    across rows and sums a row in another order (the demo's width, 896)."""
    import jax
    from engine.model import _rms_norm
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(1, 8, 896)) * 3).astype(np.float32)
    w = rng.normal(size=896).astype(np.float32)
    norm = jax.jit(lambda x, w: _rms_norm(x, w, 1e-6))
    together = np.asarray(norm(x, w))[0]
    assert all(np.array_equal(np.asarray(norm(x[:, i:i + 1], w))[0, 0], together[i]) for i in range(8))


def test_a_drafted_row_stops_at_its_limit_and_at_a_stop_token(engines):
    on, off = engines
    prompt = _prompts()[0]
    full = _run(off, [Submit("f", prompt, 40)])["f"]["tokens"]
    stop = full[20]
    for engine in (on, off):
        r = _run(engine, [Submit("n", prompt, 13)])["n"]
        assert r["tokens"] == full[:13] and r["finish"] == "length"
        r = _run(engine, [Submit("s", prompt, 40, stop_ids=[stop])])["s"]
        assert r["tokens"] == full[:full.index(stop)] and r["finish"] == "stop"


# ---- hybrid models: the linear layers' state at each row's last kept position -------------------------

def test_a_verification_leaves_each_row_the_linear_state_of_its_last_kept_position(engines):
    """Guards against a rejected draft's tokens staying in the recurrent state or the conv window
    (gibberish after a rejected draft): after a verification of 8 positions a row keeps, for each
    kept length, exactly the state 1 + kept decode steps reach (replayed from what each position
    wrote); two rows keeping different lengths keep their own; an idle row and the verification
    itself leave the pool as it was; one row alone too."""
    from engine.cache import has_state, keep_steps, read_state, write_state
    from engine.model import jit_forward
    on, _ = engines
    if not has_state(on.cache):
        pytest.skip("no linear layers")
    _run(on, [Submit("p", _prompts()[2], 1), Submit("q", _prompts()[1], 1)])
    a, b = (next(s.index for s in on.scheduler.slots if len(s.tokens) == len(p)) for p in _prompts()[2:0:-1])
    t, rows = 8, np.array([a, b, 2, 3], np.int32)
    rows[2:] = [i for i in range(4) if i not in (a, b)]
    starts = np.array([len(on.scheduler.slots[a].tokens), len(on.scheduler.slots[b].tokens), 0, 0], np.int32)
    tokens = np.zeros((4, t), np.int32)
    tokens[:2] = np.arange(7, 7 + 2 * t).reshape(2, t)
    before = {slot: read_state(on.cache, slot) for slot in rows}
    _, on.cache, steps = jit_forward(on.params, on.cache, tokens, rows, starts, np.array([t, t, 0, 0], np.int32),
                                     cfg=on.cfg, verify=True)
    assert all(_same(read_state(on.cache, slot), before[slot]) for slot in rows)
    reached = {a: [], b: []}
    for i in range(t):
        one = np.array([1, 1, 0, 0], np.int32)
        _, on.cache = jit_forward(on.params, on.cache, tokens[:, i:i + 1], rows, starts + i, one, cfg=on.cfg)
        for slot in (a, b):
            reached[slot].append(read_state(on.cache, slot))
    for kept_a, kept_b in [(0, 7), (3, 1), (7, 0), (5, 5)]:
        for slot in rows:
            on.cache = write_state(on.cache, slot, before[slot])
        on.cache = keep_steps(on.cache, steps, rows, np.array([kept_a, kept_b, -1, -1], np.int32))
        assert _same(read_state(on.cache, a), reached[a][kept_a]), f"row a kept {kept_a}"
        assert _same(read_state(on.cache, b), reached[b][kept_b]), f"row b kept {kept_b}"
        assert all(_same(read_state(on.cache, slot), before[slot]) for slot in rows[2:])
    # One row alone (its replay's run-time zero once folded to a constant there, and the replayed
    # products fused into their sums: an ulp off the decode steps' state).
    on.cache = write_state(on.cache, a, before[a])
    _, on.cache, steps = jit_forward(on.params, on.cache, tokens[:1], rows[:1], starts[:1], np.array([t], np.int32),
                                     cfg=on.cfg, verify=True)
    for kept in (0, 3):
        on.cache = write_state(on.cache, a, before[a])
        on.cache = keep_steps(on.cache, steps, rows[:1], np.array([kept], np.int32))
        assert _same(read_state(on.cache, a), reached[a][kept]), f"one row kept {kept}"


def _same(x: list[dict], y: list[dict]) -> bool:
    return all(np.array_equal(p[k], q[k]) for p, q in zip(x, y) for k in p)


def _conversations(engine, seeds, turns: int = 3, answer: int = 24) -> dict[int, list[tuple]]:
    """Conversations (one per seed) taking turns on one engine: each turn appends a user turn to its
    history, cut at every turn boundary (the prompt cache snapshots there), and its answer. Returns
    each conversation's (prompt, answer) per turn."""
    from tests.test_worker import run
    rngs = {seed: np.random.default_rng(seed) for seed in seeds}
    history = {seed: ([], []) for seed in seeds}
    answers: dict[int, list[tuple]] = {seed: [] for seed in seeds}
    for t in range(turns):
        for seed in seeds:
            tokens, cuts = history[seed]
            tokens = tokens + [int(x) for x in rngs[seed].integers(5, 200, 12)]
            rid = f"s{seed}-{t}"
            got = run(engine, Submit(rid, tokens, answer, cuts=cuts + [len(tokens)]))[rid]["tokens"]
            answers[seed].append((tokens, got))
            history[seed] = (tokens + got, cuts + [len(tokens), len(tokens) + len(got)])
    return answers


def test_a_hybrid_conversation_drafted_from_the_prompt_cache_and_across_a_restart_is_the_cold_output(
        compile_cache, monkeypatch):
    """Guards against a drafted row whose linear state is not the one its slot's tokens reach once
    prefixes are reused (the snapshots of turn boundaries, one slot shared by conversations taking
    turns so each reloads from the host cache) and after the worker restarts (programs loaded from
    the compile cache): every answer equals drafting off without any cache, and drafting ran."""
    from engine.cache import has_state
    hot = _engine("auto", "qwen3-8", slots=1, compile_cache=compile_cache, cache_ram_mib=16)
    cold = _engine("off", "qwen3-8", slots=1, compile_cache=compile_cache, prefix_cache=False)
    assert has_state(hot.cache) and hot.speculator.off is None
    seeds = [1, 2, 3]
    want = _conversations(cold, seeds)
    truth = {tuple(prompt): answer for turns in want.values() for prompt, answer in turns}
    _oracle(monkeypatch, hot, truth)
    assert _conversations(hot, seeds) == want
    assert hot.scheduler.host_hits > 0 and hot.speculator.accepted["ngram"] > 0
    assert hot.compiles_after_ready() == 0
    del hot
    again = _engine("auto", "qwen3-8", slots=1, compile_cache=compile_cache, cache_ram_mib=16)
    _oracle(monkeypatch, again, truth)
    assert _conversations(again, seeds[::-1]) == {seed: want[seed] for seed in seeds[::-1]}
    assert again.speculator.accepted["ngram"] > 0 and again.compiles_after_ready() == 0


@pytest.mark.parametrize("case, why", [
    ({}, None), ({"speculative": "off"}, "--speculative off"), ({"native": False}, "native kernel"),
    ({"weights": "float32"}, "float32 weights"), ({"weights": "fp8"}, "fp8 weights"),
    ({"kv": np.float16}, "KV cache is not int8"), ({"kinds": ("linear", "attention")}, None),
    ({"mlp": ("moe", "dense")}, None),
    ({"slots": products.INT8_ROWS_MAX_ROWS + 1}, f"every slot ({products.INT8_ROWS_MAX_ROWS + 1} rows)")])
def test_drafting_is_on_only_where_it_is_exact(case, why):
    """Guards against drafting on a path whose numbers depend on the rows beside a position (XLA's
    float products, float caches); linear layers draft (each position's steps are kept), 1 + 3 tokens."""
    from types import SimpleNamespace

    from engine.scheduler import Buckets
    from engine.worker import Engine
    e = Engine.__new__(Engine)
    e.cfg = SimpleNamespace(native=case.get("native", True), layer_kinds=case.get("kinds", ("attention",)),
                            mlp_kinds=case.get("mlp"), linear_conv_dim=96, linear_conv_kernel=4,
                            linear_value_heads=4, linear_key_dim=16, linear_value_dim=16)   # a tiny state
    e.args = SimpleNamespace(speculative=case.get("speculative", "auto"), ctx=4096, slots=case.get("slots", 8))
    e.weights_dtype, e.kv_dtype = case.get("weights", "int8"), np.dtype(case.get("kv", np.int8))
    e.buckets = Buckets.for_ctx(4096, slots=8)
    spec = e.speculator = e._speculator(has_mtp=case.get("mtp_layer", False))
    if why is None:
        lengths = (4,) if "linear" in e.cfg.layer_kinds else (4, 8)      # engine.scheduler.verify_tokens
        assert spec.off is None and spec.shapes == {1: lengths, 4: lengths}    # 8 rows: never drafted
        assert [p for p in e.programs() if p[0] == "verify"] == [("verify", rows, t) for rows in (1, 4)
                                                                 for t in lengths]
    else:
        assert why in spec.off and not spec.shapes
        assert not any(kind == "verify" for kind, _, _ in e.programs())
