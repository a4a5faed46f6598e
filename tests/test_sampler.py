"""The sampler on logits small enough to check by hand."""
from __future__ import annotations

import numpy as np
import pytest

from engine import native, sampler
from engine.protocol import Sampling


def draw(logits, samplings, seeds=None, steps=None, state=None, slots=None, active=None):
    """Run sample() on numpy logits [B, V]; returns (tokens, state)."""
    logits = np.asarray(logits, np.float32)
    b, v = logits.shape
    seeds = seeds if seeds is not None else [0] * b
    steps = steps if steps is not None else [0] * b
    state = state if state is not None else sampler.init_state(b, v)
    slots = np.arange(b, dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
    active = np.ones(b, bool) if active is None else np.asarray(active)
    params = sampler.row_params(list(zip(samplings, seeds, steps)))
    tokens, state = sampler.sample(state, logits, slots, active, params, every_slot=False,
                                   **sampler.batch_flags(samplings))
    return np.asarray(tokens), state


def params(**kw):
    return sampler.row_params([(Sampling(**kw), 0, 0)])


@pytest.fixture(params=["native", "xla"])
def cut_path(request):
    """filter_mask's two ways to its cuts (its native_kernel): engine.native's kernel (where it
    runs) and XLA's."""
    if request.param == "native" and not native.available():
        pytest.skip("the native kernel does not run here")
    return request.param == "native"


def test_greedy_is_the_default_and_takes_the_first_maximum():
    """Guards against a default request sampling at random, or ties picking an arbitrary token."""
    tokens, _ = draw([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0]], [Sampling(), Sampling()])
    assert tokens.tolist() == [1, 0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    """Guards against the penalty pushing a negative logit up (dividing it) as a naive version does."""
    logits = np.array([[3.0, -1.0, 2.0, 0.5]], np.float32)
    seen = np.array([[True, True, False, False]])
    counts = np.array([[0, 0, 0, 1]], np.int32)
    out = sampler.apply_penalties(logits, seen, counts, params(repetition_penalty=2.0))
    np.testing.assert_allclose(np.asarray(out), [[1.5, -2.0, 2.0, 0.25]])


def test_frequency_and_presence_penalties_follow_generated_counts():
    """Guards against presence scaling with the count, or penalties reading prompt tokens."""
    logits = np.zeros((1, 4), np.float32)
    seen = np.array([[True, False, False, False]])            # prompt only: no effect here
    counts = np.array([[0, 3, 1, 0]], np.int32)
    out = sampler.apply_penalties(logits, seen, counts,
                                  params(frequency_penalty=0.5, presence_penalty=0.25))
    np.testing.assert_allclose(np.asarray(out), [[0.0, -1.75, -0.75, 0.0]])


def test_penalties_steer_greedy_and_count_only_active_rows():
    """Guards against penalties applied to the wrong slot's history or pad rows being counted."""
    state = sampler.init_state(2, 3)
    state = sampler.start_row(state, np.int32(1), np.array([True, False, False]))
    s = Sampling(repetition_penalty=4.0)
    logits = [[3.0, 2.0, 0.0]]
    tokens, state = draw(logits, [s], state=state, slots=[1])
    assert tokens.tolist() == [1]                      # token 0 was in slot 1's prompt: 3/4 < 2
    tokens, state = draw(logits, [s], state=state, slots=[0], active=[False])
    assert tokens.tolist() == [0]                      # slot 0 saw nothing
    counts = np.asarray(state.counts)
    assert counts[1].tolist() == [0, 1, 0] and counts[0].tolist() == [0, 0, 0]


@pytest.mark.parametrize("kw, kept", [
    (dict(top_k=2), [0, 1]),
    (dict(top_p=0.6), [0, 1]),            # 0.5 < 0.6: the token that crosses is kept
    (dict(top_p=0.5), [0]),
    (dict(min_p=0.4), [0, 1]),            # >= 0.4 * 0.5
    (dict(top_k=3, top_p=0.8), [0, 1]),   # top-p over the renormalized top 3 (0.9): 0.75/0.9 >= 0.8
    (dict(top_k=1, top_p=0.1, min_p=0.9), [0]),
    (dict(), [0, 1, 2, 3]),
])
def test_filters_keep_the_hand_computed_tokens(kw, kept, cut_path):
    """Guards against off-by-one nucleus cuts and filters applied in the wrong order."""
    probs = np.array([[0.5, 0.25, 0.15, 0.1]], np.float32)
    mask = np.asarray(sampler.filter_mask(probs, params(**kw), cut_path))[0]
    assert np.flatnonzero(mask).tolist() == kept


def test_draws_follow_the_softmax_and_respect_filters():
    """Guards against a biased draw (wrong CDF) or a filtered token ever being drawn."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    rows = 4000
    batch = np.tile(logits, (rows, 1))
    tokens, _ = draw(batch, [Sampling(temperature=1.0)] * rows, seeds=list(range(rows)))
    freq = np.bincount(tokens, minlength=4) / rows
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    tokens, _ = draw(batch, [Sampling(temperature=1.0, top_k=2)] * rows, seeds=list(range(rows)))
    freq = np.bincount(tokens, minlength=4) / rows
    assert set(tokens.tolist()) == {0, 1}
    np.testing.assert_allclose(freq[:2], [0.625, 0.375], atol=0.03)


def test_temperature_flattens_the_distribution():
    """Guards against temperature being ignored or inverted."""
    logits = np.tile(np.array([2.0, 0.0], np.float32), (4000, 1))
    seeds = list(range(4000))
    cold, _ = draw(logits, [Sampling(temperature=0.5)] * 4000, seeds=seeds)
    hot, _ = draw(logits, [Sampling(temperature=4.0)] * 4000, seeds=seeds)
    # P(1) = 1 / (1 + e^(2/T)): 0.018 at T=0.5, 0.378 at T=4
    assert abs(cold.mean() - 0.018) < 0.01 and abs(hot.mean() - 0.378) < 0.03


def test_seeded_draw_depends_only_on_seed_and_step():
    """Guards against a seeded request changing with its neighbours, its row or the batch size."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 50)).astype(np.float32)
    s = Sampling(temperature=1.0, top_p=0.95)
    alone = [int(draw(logits, [s], seeds=[42], steps=[k])[0][0]) for k in range(12)]
    others = rng.normal(size=(3, 50)).astype(np.float32)
    mixed = []
    for k in range(12):
        batch = np.concatenate([others[:2], logits, others[2:]])
        row_s = [Sampling(temperature=2.0, top_k=5), Sampling(), s, Sampling(temperature=0.3)]
        tokens, _ = draw(batch, row_s, seeds=[1, 2, 42, 3], steps=[k, 0, k, 9])
        mixed.append(int(tokens[2]))
    assert alone == mixed
    assert len(set(alone)) > 1                         # the step changes the draw
    other_seed = [int(draw(logits, [s], seeds=[43], steps=[k])[0][0]) for k in range(12)]
    assert other_seed != alone


def test_row_without_filters_keeps_its_whole_tail_in_a_filtered_batch(cut_path):
    """Guards against a neighbour's top-p trimming this row's rare tokens, which would make a seeded
    request draw differently depending on what runs beside it."""
    probs = np.array([[0.9999998, 1e-7, 1e-7], [0.5, 0.3, 0.2]], np.float32)
    p = sampler.row_params([(Sampling(temperature=1.0), 0, 0),
                            (Sampling(temperature=1.0, top_p=0.5), 0, 0)])
    mask = np.asarray(sampler.filter_mask(probs, p, cut_path))
    assert mask[0].all() and mask[1].tolist() == [True, False, False]


def test_greedy_row_stays_greedy_beside_sampled_rows():
    """Guards against a batch-wide switch making a temperature-0 row sample."""
    logits = np.tile(np.array([1.0, 0.9, 0.8], np.float32), (64, 1))
    samplings = [Sampling(temperature=0.0 if i % 2 else 4.0) for i in range(64)]
    tokens, _ = draw(logits, samplings, seeds=list(range(64)))
    assert (tokens[1::2] == 0).all() and len(set(tokens[0::2].tolist())) > 1


def test_any_python_int_is_a_seed():
    """Guards against negative or huge seeds (valid JSON integers) crashing the worker."""
    for seed in (-1, 0, 2**70 + 5, 123):
        hi, lo = sampler.seed_key(seed)
        assert 0 <= hi < 2**32 and 0 <= lo < 2**32
    assert sampler.seed_key(-1) != sampler.seed_key(1)


def test_inverse_cdf_finds_the_token_a_uniform_lands_on_across_blocks():
    """Guards the two-level draw (block masses, then the one block's running sum) against picking
    the wrong block or token, or a token of probability 0 when rounding puts u past the last sum."""
    rng = np.random.default_rng(4)
    vocab = 3 * sampler.DRAW_BLOCK + 17                     # a partial last block
    probs = rng.random((6, vocab)).astype(np.float32)
    probs[:, rng.random(vocab) < 0.5] = 0.0                 # filtered-out tokens
    probs[1, :] = 0.0
    probs[1, sampler.DRAW_BLOCK - 1] = 1.0                  # one token, at a block's end
    probs[2, sampler.DRAW_BLOCK:] = 0.0                     # mass in the first block only
    u = rng.random((6, 1)).astype(np.float32) * probs.sum(-1, keepdims=True)
    u[3] = probs[3].sum() * 1.001                           # past the last sum: the last positive token
    got = np.asarray(sampler._inverse_cdf(probs, sampler._block_sums(probs), u))
    cdf = np.cumsum(probs.astype(np.float64), axis=-1)
    for row in range(6):
        want = min(int(np.sum(cdf[row] <= u[row, 0])), int(np.flatnonzero(probs[row])[-1]))
        assert got[row] == want, (row, got[row], want)
        assert probs[row, got[row]] > 0


def test_a_rows_sums_are_the_same_bits_alone_in_a_batch_or_among_drafted_positions():
    """Guards seeded draws against the batch: a row's probability sums (the softmax's, the draw's
    total, its blocks' masses) must not depend on how many rows run beside it. XLA's own sum of a
    152k-token row's softmax, in one program with it as the draw has them, came out an ulp apart from
    2 rows on, so a uniform within that of a token's edge drew another token in a verification of
    drafts (rows x positions) than in a decode step."""
    import jax
    logits = (np.random.default_rng(7).standard_normal((32, 151936)) * 3).astype(np.float32)
    sums = jax.jit(lambda x: sampler.row_sum(jax.nn.softmax(x, axis=-1)))
    blocks = jax.jit(lambda x: sampler._block_sums(jax.nn.softmax(x, axis=-1)))
    alone, alone_blocks = np.asarray(sums(logits[:1]))[0], np.asarray(blocks(logits[:1]))[0]
    for rows in (2, 4, 8, 32):
        assert np.asarray(sums(logits[:rows]))[0].view(np.uint32) == alone.view(np.uint32), rows
        np.testing.assert_array_equal(np.asarray(blocks(logits[:rows]))[0].view(np.uint32),
                                      alone_blocks.view(np.uint32))
    np.testing.assert_allclose(alone[0], 1.0, rtol=1e-5)


def test_a_seeded_row_draws_the_same_tokens_beside_any_number_of_rows(cut_path):
    """Guards the draw end to end: a seeded row of a 152k vocabulary, alone and beside 7 or 31 other
    rows, plain and filtered, draws the same token at every step."""
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((32, 151936)) * 2).astype(np.float32)
    for s in (Sampling(temperature=1.0), Sampling(temperature=0.8, top_k=40, top_p=0.9)):
        for step in range(4):
            alone = draw(logits[:1], [s], seeds=[5], steps=[step])[0][0]
            for rows in (8, 32):
                got = draw(logits[:rows], [s] * rows, seeds=[5] + list(range(rows - 1)), steps=[step] * rows)[0]
                assert got[0] == alone, (s, step, rows)


def _reference_mask(probs, top_k, top_p):
    """top-k then top-p over what top-k kept, in float64 with a full sort."""
    order = np.sort(probs.astype(np.float64))[::-1]
    t_k = order[top_k - 1] if top_k > 0 else 0.0
    kept = np.sort(probs[probs >= t_k].astype(np.float64))[::-1]
    cut = int(np.sum(np.cumsum(kept) < top_p * kept.sum())) if top_p < 1 else len(kept) - 1
    return probs >= max(t_k, kept[min(cut, len(kept) - 1)])


def test_filters_cut_exactly_among_the_candidates_or_by_bisection_whatever_the_neighbours(cut_path):
    """Guards the two ways a filter finds its cuts (the largest FILTER_CANDIDATES probabilities
    sorted, or bisection when a cut lies beyond them) against keeping other tokens than a full sort
    does, and against a row's cut depending on whether a neighbour needed the bisection."""
    rng = np.random.default_rng(6)
    vocab = 4 * sampler.FILTER_CANDIDATES
    logits = rng.normal(size=(4, vocab)) * np.array([[3.0], [3.0], [0.2], [3.0]])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    rows = [dict(top_k=20, top_p=0.8),                       # both cuts among the candidates
            dict(top_p=0.5),
            dict(top_p=0.9),                                 # a flat row: its nucleus is wider
            dict(top_k=sampler.FILTER_CANDIDATES + 50)]      # top-k past the candidates
    samplings = [Sampling(temperature=1.0, **kw) for kw in rows]
    p = sampler.row_params([(s, 0, 0) for s in samplings])
    mask = np.asarray(sampler.filter_mask(probs, p, cut_path))
    for row, kw in enumerate(rows):
        want = _reference_mask(probs[row], kw.get("top_k", 0), kw.get("top_p", 1.0))
        assert (mask[row] == want).all(), (kw, mask[row].sum(), want.sum())
    assert mask[2].sum() > sampler.FILTER_CANDIDATES and mask[3].sum() == sampler.FILTER_CANDIDATES + 50
    alone = np.asarray(sampler.filter_mask(probs[:1], sampler.row_params([(samplings[0], 0, 0)]), cut_path))
    assert (alone[0] == mask[0]).all()
