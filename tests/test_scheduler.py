"""The scheduler alone: admission, slots, prefix reuse, chunked prefill, decode rows, finish reasons.
No model: a fake 'device' feeds back tokens chosen by the test."""
from __future__ import annotations

import pytest

from engine.protocol import Sampling
from engine.scheduler import MAX_PASSED, PREFILL_SHARE, ROUND_TOKENS, Buckets, Sequence, Scheduler

VOCAB = 1000
STOP = 999


def request(rid, prompt, max_tokens=100, stop=(STOP,)):
    return Sequence(rid, list(prompt), max_tokens, Sampling(), frozenset(stop))


def scheduler(slots=2, ctx=256, chunks=(8, 32), prefix_cache=True):
    return Scheduler(slots, ctx, VOCAB, Buckets.for_ctx(ctx, chunks, slots), prefix_cache)


def run_round(s, next_token=lambda r: 7):
    """Execute one plan as a model would: each finished prompt and each decode row gets
    next_token(request). Returns (plan, emits)."""
    plan = s.schedule()
    emits = []
    if plan.decode:
        emits += s.decoded(plan.decode, [next_token(r) for r in plan.decode.rows])
    if plan.prefill:
        p = plan.prefill
        emits += s.prefilled(p, next_token(p.request) if p.last else None)
    return plan, emits


def run_until_done(s, next_token=lambda r: 7, limit=1000):
    for _ in range(limit):
        if not s.busy:
            return
        run_round(s, next_token)
    raise AssertionError("scheduler did not finish")


# ---- buckets -------------------------------------------------------------------------------------

def test_the_program_shapes_do_not_grow_with_the_context():
    """Guards against the attention length coming back as a shape: each (chunk or batch) x length
    pair was a compiled program, 45 of them for the demo's 32k context."""
    assert Buckets.for_ctx(1000) == Buckets.for_ctx(32768) == Buckets.for_ctx(131072)
    assert Buckets.for_ctx(32768, slots=4) == Buckets((32, 128, 512), (1, 4))


def test_chunk_choice_limits_padding_and_covers_min_fill():
    """Guards against padding a short remainder up to the largest chunk (a padded token costs its
    compute), and against more than half of a chunk beyond the smallest being padding."""
    b = Buckets((32, 128, 512), (1,))
    assert b.chunk_for(1) == 1              # a cached prompt's last token: the one-row decode program
    assert b.chunk_for(2) == b.chunk_for(5) == 32
    assert b.chunk_for(129) == 128          # 512 would be three quarters padding
    big = Buckets((8, 32), (1,))            # chunks all within a round's work
    assert big.chunk_for(20) == 32 and big.chunk_for(70) == 32
    for start in (0, 1000, 5000):
        for remaining in range(1, 1200):
            chunk = b.chunk_for(remaining, start)
            assert min(chunk, remaining) >= b.min_fill(chunk)


def test_a_chunk_is_at_most_a_rounds_work_wherever_it_starts():
    """Guards against one chunk holding every other request for seconds: the demo's 512-token chunk
    at 8k positions took 4 s on a 2-core CPU, which each first token and decode step beside it
    waited for. A short prompt still takes one chunk."""
    b = Buckets.for_ctx(32768, slots=4)
    assert b.chunk_for(100) == 128 and b.chunk_for(300) == 128 and b.chunk_for(5000) == 128
    assert b.chunk_for(5000, start=4096) == 32
    start = 0
    while start < 8192:
        chunk = b.chunk_for(8192 - start, start)
        assert chunk == b.chunks[0] or Buckets.cost(chunk, start) <= ROUND_TOKENS
        start += chunk


def test_a_few_live_requests_decode_in_a_small_batch():
    """Guards against one or a few live requests paying for a step of every slot (1.4x on CPU)."""
    b = Buckets.for_ctx(1024, slots=8)
    assert b.decode_rows == (1, 4, 8)
    assert [b.decode_batch(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert Buckets.for_ctx(1024, slots=4).decode_rows == (1, 4)
    assert Buckets.for_ctx(1024, slots=1).decode_rows == (1,)


def test_chunks_longer_than_ctx_are_dropped():
    """Guards against compiling prefill programs that cannot fit the context."""
    assert Buckets.for_ctx(64, (32, 128, 512)).chunks == (32,)


# ---- admission ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, max_tokens, field", [
    ([], 10, "prompt"), (list(range(256)), 10, "prompt"), ([1, VOCAB], 10, "prompt"),
    ([1, -1], 10, "prompt"), ([1, 2], 0, "max_tokens")])
def test_bad_requests_are_refused_by_field(prompt, max_tokens, field):
    """Guards against an empty, overlong or out-of-vocabulary prompt reaching the device."""
    error = scheduler().check("a", prompt, max_tokens)
    assert error is not None and error.startswith(field + ":")


def test_a_prompt_of_ctx_minus_one_tokens_is_accepted():
    """Guards against an off-by-one that refuses the longest prompt that still leaves one token."""
    assert scheduler().check("a", [1] * 255, 10) is None


def test_duplicate_rid_is_refused():
    """Guards against two requests sharing one id and mixing their tokens."""
    s = scheduler()
    s.add(request("a", [1, 2, 3]))
    assert s.check("a", [1, 2], 5).startswith("rid:")


# ---- running ----------------------------------------------------------------------------------------

def test_long_prompt_is_prefilled_in_chunks_then_decoded():
    """Guards against chunk bookkeeping that skips or repeats prompt tokens."""
    s = scheduler()
    prompt = list(range(1, 71))
    s.add(request("a", prompt, max_tokens=3))
    seen, chunks = [], []
    while True:
        plan, emits = run_round(s)
        if plan.prefill:
            seen += plan.prefill.tokens
            chunks.append(plan.prefill.chunk)
        if emits:
            break
    assert seen == prompt and chunks == [32, 32, 8]
    assert emits[0].tokens == [7] and s.slots[0].tokens == prompt


def test_new_request_joins_the_running_batch_at_the_next_round():
    """Guards against a new request waiting for the running ones to finish."""
    s = scheduler()
    s.add(request("a", [1, 2, 3], max_tokens=50))
    run_round(s)                                    # a: prefill -> first token
    s.add(request("b", [4, 5, 6], max_tokens=50))
    plan, _ = run_round(s)
    assert plan.prefill.request.rid == "b"
    assert [r.rid for r in plan.decode.rows] == ["a"]
    plan, _ = run_round(s)
    assert sorted(r.rid for r in plan.decode.rows) == ["a", "b"]


def test_stop_id_ends_without_being_output():
    """Guards against the end-of-turn token leaking into the answer."""
    s = scheduler()
    s.add(request("a", [1, 2, 3]))
    tokens = iter([5, 6, STOP])
    emits = []
    for _ in range(5):
        emits += run_round(s, lambda r: next(tokens))[1]
        if emits and emits[-1].finish:
            break
    assert [t for e in emits for t in e.tokens] == [5, 6]
    assert emits[-1].finish == "stop"


def test_max_tokens_ends_with_length():
    """Guards against generating one token too many or too few."""
    s = scheduler()
    s.add(request("a", [1, 2, 3], max_tokens=4))
    emits = []
    while s.busy:
        emits += run_round(s)[1]
    assert sum(len(e.tokens) for e in emits) == 4 and emits[-1].finish == "length"


def test_end_of_context_ends_with_length():
    """Guards against writing past the end of a slot: prompt + output stops at ctx."""
    s = scheduler(ctx=64, chunks=(32,))
    s.add(request("a", list(range(1, 61)), max_tokens=1000))
    emits = []
    while s.busy:
        emits += run_round(s)[1]
    assert sum(len(e.tokens) for e in emits) == 4 and emits[-1].finish == "length"


def test_cancel_frees_the_slot_for_the_next_round():
    """Guards against a cancelled request holding its slot while others wait."""
    s = scheduler(slots=1)
    s.add(request("a", [1, 2, 3]))
    s.add(request("b", [9, 8, 7]))
    run_round(s)
    plan, _ = run_round(s)
    assert plan.prefill is None                     # b waits: the only slot is busy
    assert s.cancel("a").finish == "abort"
    plan, _ = run_round(s)
    assert plan.prefill.request.rid == "b" and plan.decode is None


def test_cancel_of_a_waiting_request_removes_it():
    """Guards against a cancelled request starting later anyway."""
    s = scheduler(slots=1)
    s.add(request("a", [1, 2, 3]))
    s.add(request("b", [4, 5]))
    s.cancel("b")
    assert [r.rid for r in s.waiting] == ["a"] and s.cancel("b") is None


# ---- prefix reuse ---------------------------------------------------------------------------------

def test_finished_slot_serves_the_shared_prefix():
    """Guards against re-running a prompt start the cache already holds."""
    s = scheduler(slots=3)
    s.add(request("a", [1, 2, 3, 4, 5], max_tokens=2))
    run_until_done(s)
    slot_a = next(x.index for x in s.slots if x.tokens)
    s.add(request("b", [1, 2, 3, 4, 5, 7, 9, 10]))
    plan, _ = run_round(s)
    b = plan.prefill.request
    # a's slot holds 1 2 3 4 5 7 (prompt + its first output token fed back); 7 matches b too
    assert b.slot == slot_a and b.cached == 6 and plan.prefill.tokens == [9, 10]
    assert s.prefix_hits == 6 and s.prefix_queries == 13


def test_identical_prompt_leaves_one_token_to_run():
    """Guards against a fully cached prompt with no token left to produce the first logits."""
    s = scheduler()
    s.add(request("a", [1, 2, 3, 4], max_tokens=1))
    run_until_done(s)
    s.add(request("b", [1, 2, 3, 4]))
    plan, _ = run_round(s)
    assert plan.prefill.request.cached == 3 and plan.prefill.tokens == [4]


def test_unrelated_prompt_takes_the_least_recently_used_slot():
    """Guards against evicting a useful cached prefix while an older slot is free."""
    s = scheduler(slots=2)
    s.add(request("a", [1, 2, 3], max_tokens=1))
    run_until_done(s)
    s.add(request("b", [5, 6, 7], max_tokens=1))
    run_until_done(s)
    s.add(request("c", [1, 2, 9], max_tokens=1))    # shares [1, 2] with a: a's slot, not b's
    plan, _ = run_round(s)
    assert plan.prefill.request.slot == s.slots[0].index and plan.prefill.request.cached == 2
    s.add(request("d", [8, 8, 8], max_tokens=1))
    run_until_done(s)
    assert s.requests == {} and s.slots[1].tokens[:3] == [8, 8, 8]


def test_prefix_of_a_running_request_is_copied_into_a_free_slot():
    """Guards against two concurrent requests with one system prompt both running it in full."""
    s = scheduler(slots=2)
    s.add(request("a", list(range(1, 21)), max_tokens=50))
    run_round(s)
    s.add(request("b", list(range(1, 16)) + [500, 501]))
    plan, _ = run_round(s)
    assert plan.copies == [(0, 1, 15)]
    assert plan.prefill.request.cached == 15 and plan.prefill.tokens == [500, 501]


def test_prefix_reuse_can_be_turned_off():
    """Guards against --no-prefix-cache still reusing slots."""
    s = scheduler(prefix_cache=False)
    s.add(request("a", [1, 2, 3], max_tokens=1))
    run_until_done(s)
    s.add(request("b", [1, 2, 3, 4]))
    plan, _ = run_round(s)
    assert plan.prefill.request.cached == 0 and plan.prefill.tokens == [1, 2, 3, 4]


# ---- hybrid models: reuse only where the linear layers' state is known ---------------------------

def hybrid(slots=2, ctx=256, chunks=(8, 32)):
    return Scheduler(slots, ctx, VOCAB, Buckets.for_ctx(ctx, chunks, slots), True, recurrent=True)


def run_hybrid(s, next_token=lambda r: 7, limit=1000):
    """Run to the end as the worker does for a hybrid model: a Prefill that asks for a snapshot
    gets one (a string naming the slot and position). Returns the Prefills run."""
    prefills = []
    for _ in range(limit):
        if not s.busy:
            return prefills
        plan = s.schedule()
        if plan.decode:
            s.decoded(plan.decode, [next_token(r) for r in plan.decode.rows])
        if plan.prefill:
            p = plan.prefill
            prefills.append(p)
            end = p.start + len(p.tokens)
            s.prefilled(p, next_token(p.request) if p.last else None,
                        f"slot{p.request.slot}@{end}" if p.snapshot else None)
    raise AssertionError("scheduler did not finish")


def test_a_hybrid_prefill_ends_a_chunk_at_every_cut_point_and_snapshots_there():
    """Guards against a cut point inside a prefill chunk: the state at a turn boundary would never
    exist, and the next turn could reuse nothing. The prompt's end is snapshotted too: the next
    turn shares it whatever the answer was."""
    s = hybrid()
    r = request("a", range(1, 71), max_tokens=2)
    r.cuts = [10, 45]
    s.add(r)
    prefills = run_hybrid(s)
    assert [(p.start, len(p.tokens), p.snapshot) for p in prefills] == [
        (0, 8, False), (8, 2, True), (10, 32, False), (42, 3, True), (45, 25, True)]
    assert s.slots[r.slot].snapshots == {10: "slot0@10", 45: "slot0@45", 70: "slot0@70"}


def test_a_hybrid_slot_is_reused_only_at_a_snapshot_or_its_end_and_the_loss_is_logged():
    """Guards against reusing a shared prefix whose linear state the slot no longer has (wrong
    tokens), and against losing reuse silently: the tokens run again are logged."""
    s = hybrid(slots=1)
    a = request("a", range(1, 71), max_tokens=3)
    a.cuts = [10, 45]
    s.add(a)
    run_hybrid(s, next_token=lambda r: 500)
    held = list(s.slots[0].tokens)
    assert held == list(range(1, 71)) + [500, 500]       # the last token drawn is never fed

    b = request("b", list(range(1, 61)) + [900] * 5, max_tokens=1)
    s.add(b)
    plan = s.schedule()
    assert b.cached == 45 and plan.restores == [(0, "slot0@45")]
    assert any("shares 60 tokens" in text and "15 tokens are prefilled again" in text
               for rid, text in s.notes if rid == "b")
    run_hybrid(s)

    dense = scheduler(slots=1)
    d = request("d", range(1, 71), max_tokens=1)
    dense.add(d)
    run_until_done(dense)
    dense.add(request("e", list(range(1, 61)) + [900] * 5, max_tokens=1))
    assert dense.schedule().started[0].cached == 60      # K/V alone can be cut anywhere

    s.notes.clear()
    c = request("c", list(range(1, 61)) + [900] * 5 + [901, 902], max_tokens=1)
    s.add(c)
    plan = s.schedule()
    assert c.cached == 65 and plan.restores == [] and not s.notes    # b's end: the live state


def test_a_hybrid_prefix_copied_from_a_running_slot_comes_with_its_snapshot():
    """Guards against copying K/V from a busy slot without the linear state at the copied end."""
    s = hybrid(slots=2)
    a = request("a", range(1, 41), max_tokens=50)
    a.cuts = [20]
    s.add(a)
    for _ in range(4):                                  # prefilled, now decoding
        plan = s.schedule()
        if plan.decode:
            s.decoded(plan.decode, [7] * len(plan.decode.rows))
        if plan.prefill:
            p = plan.prefill
            s.prefilled(p, 7 if p.last else None, f"a@{p.start + len(p.tokens)}" if p.snapshot else None)
    assert not a.prefilling and a.finish is None
    b = request("b", list(range(1, 31)) + [900] * 3, max_tokens=1)
    s.add(b)
    plan = s.schedule()
    assert plan.copies == [(a.slot, b.slot, 20)] and plan.restores == [(b.slot, "a@20")]
    assert b.cached == 20


# ---- prompts read side by side -------------------------------------------------------------------

def run_timed(s, decode_s=0.01, chunk_s=lambda p: 0.001 * len(p.tokens), next_token=lambda r: 7):
    """run_round, and tell the scheduler what the calls took (as the worker does)."""
    plan, emits = run_round(s, next_token)
    s.spent(plan, decode_s if plan.decode else 0.0, chunk_s(plan.prefill) if plan.prefill else 0.0)
    return plan, emits


def chunks_of(s, rid, rounds=1000, **kw):
    """Run until `rid` has its first token; its chunks as (start, tokens, chunk)."""
    seen = []
    for _ in range(rounds):
        plan, emits = run_timed(s, **kw)
        if plan.prefill and plan.prefill.request.rid == rid:
            p = plan.prefill
            seen.append((p.start, len(p.tokens), p.chunk))
        if any(e.request.rid == rid for e in emits):
            return seen
    raise AssertionError(f"{rid} never got its first token")


def test_every_waiting_request_gets_a_free_slot_in_the_same_round():
    """Guards against requests taking slots one at a time, each waiting for the prompt before it."""
    s = scheduler(slots=3)
    for i, rid in enumerate("abc"):
        s.add(request(rid, range(100 * i + 1, 100 * i + 60)))
    plan = s.schedule()
    assert sorted(r.rid for r in plan.started) == ["a", "b", "c"] and not s.waiting
    assert len({r.slot for r in plan.started}) == 3


def test_a_short_prompt_is_read_after_the_chunk_under_way_not_after_the_long_prompt():
    """Guards against one prompt being read at a time: a chat's first token waited for another
    tenant's whole 8,700-token prompt (51.5 s)."""
    s = scheduler(slots=2)
    s.add(request("long", range(1, 201), max_tokens=5))
    run_timed(s)
    s.add(request("short", range(300, 306), max_tokens=5))
    plan, emits = run_timed(s)
    assert plan.prefill.request.rid == "short"
    assert [e.tokens for e in emits if e.request.rid == "short"] == [[7]]
    assert s.requests["long"].prefilling


def test_a_prompts_chunks_are_the_same_whatever_is_read_beside_it():
    """Guards against chunks cut by what else is read: a prompt's numbers would then depend on
    other tenants' traffic."""
    alone = scheduler(slots=3)
    alone.add(request("a", range(1, 151)))
    want = chunks_of(alone, "a")
    busy = scheduler(slots=3)
    busy.add(request("b", range(400, 450), max_tokens=40))
    busy.add(request("a", range(1, 151)))
    busy.add(request("c", range(500, 520), max_tokens=3))
    assert chunks_of(busy, "a") == want


def test_shorter_prompts_pass_a_long_one_at_most_max_passed_times_in_a_row():
    """Guards against a stream of short prompts starving a long one (shortest first alone would)."""
    s = scheduler(slots=2)
    s.add(request("long", range(1, 201), max_tokens=1))
    gaps, gap, n = [], 0, 0
    while "long" in s.requests:
        if not s.waiting and s.live < 2:
            n += 1
            s.add(request(f"short{n}", range(300, 305), max_tokens=1))
        plan, _ = run_timed(s)
        if plan.prefill and plan.prefill.request.rid == "long":
            gaps.append(gap)
            gap = 0
        elif plan.prefill:
            gap += 1
    assert n > 10 and max(gaps) == MAX_PASSED


def test_prompts_take_their_share_of_the_time_beside_decoding_rows_which_never_stall():
    """Guards against decoding rows slowed to the pace of long prefill chunks (each round a 0.3 s
    chunk beside a 0.03 s step left streaming answers at a tenth of their speed)."""
    s = scheduler(slots=2, ctx=4096)
    s.add(request("talk", range(1, 9), max_tokens=3000))
    run_timed(s)
    s.add(request("long", range(100, 2100), max_tokens=1))
    decode_s = prefill_s = 0.0
    while "long" in s.requests:
        plan, _ = run_timed(s, decode_s=0.03, chunk_s=lambda p: 0.3)
        assert plan.decode and [r.rid for r in plan.decode.rows] == ["talk"]
        decode_s += 0.03
        prefill_s += 0.3 if plan.prefill else 0.0
    assert prefill_s / (decode_s + prefill_s) == pytest.approx(PREFILL_SHARE, abs=0.02)
    # with nothing decoding, prompts take every round
    s = scheduler(slots=2)
    s.add(request("long", range(1, 201), max_tokens=1))
    s.add(request("other", range(300, 500), max_tokens=1))
    while s.busy:
        assert run_timed(s, chunk_s=lambda p: 0.3)[0].prefill


def test_a_chunk_that_gives_a_first_token_runs_on_credit_and_long_prompts_repay_it():
    """Guards against a short prompt waiting for decode steps to repay a long prompt's chunk (the
    wait would be (1 - share) / share of that chunk), and against its reading left unpaid."""
    s = scheduler(slots=4, ctx=4096)
    s.add(request("talk", range(1, 9), max_tokens=3000))
    run_timed(s)
    s.add(request("long", range(100, 2100), max_tokens=1))
    plan, _ = run_timed(s, decode_s=0.03, chunk_s=lambda p: 0.3)
    assert plan.prefill.request.rid == "long" and s.pace.owed > 0
    s.add(request("short", range(3000, 3006), max_tokens=1))
    s.add(request("short2", range(3100, 3106), max_tokens=1))
    firsts = []
    for _ in range(2):
        plan, emits = run_timed(s, decode_s=0.03, chunk_s=lambda p: 0.01)
        firsts += [e.request.rid for e in emits if e.request.rid.startswith("short")]
    assert sorted(firsts) == ["short", "short2"]
    rounds = 0
    while not run_timed(s, decode_s=0.03, chunk_s=lambda p: 0.01)[0].prefill:
        rounds += 1
    earned = 0.03 * PREFILL_SHARE / (1 - PREFILL_SHARE)       # per decode step
    assert rounds == pytest.approx((0.3 + 0.02 - 3 * earned) / earned, abs=1)   # all of it repaid


def test_a_prompt_sharing_the_start_of_one_being_read_waits_for_it_then_copies_it():
    """Guards against two prompts with one system prompt and tools both reading it when they arrive
    together (side by side, neither could copy it from the other)."""
    s = scheduler(slots=2)
    shared = list(range(1, 91))
    s.add(request("a", shared + [200, 201, 202], max_tokens=20))
    s.add(request("b", shared + [300, 301], max_tokens=2))
    read = {"a": 0, "b": 0}
    copies = []
    while s.busy:
        plan, _ = run_timed(s)
        copies += plan.copies
        if plan.prefill:
            read[plan.prefill.request.rid] += len(plan.prefill.tokens)
    assert read == {"a": 93, "b": 2} and copies == [(0, 1, 90)]


def test_a_prompt_that_shares_little_with_one_being_read_does_not_wait():
    """Guards against waiting for a shared start shorter than a chunk: reading it costs less."""
    s = scheduler(slots=2)
    s.add(request("a", range(1, 200), max_tokens=2))
    run_timed(s)
    s.add(request("b", [1, 2, 3] + list(range(500, 520)), max_tokens=2))
    plan, _ = run_timed(s)
    assert [r.rid for r in plan.started] == ["b"]


def test_cancelling_a_prompt_mid_read_frees_its_slot_and_the_others_read_on():
    """Guards against a cancelled prompt holding its slot, or a chunk of it read after the cancel."""
    s = scheduler(slots=2)
    s.add(request("a", range(1, 200), max_tokens=2))
    s.add(request("b", range(300, 500), max_tokens=2))
    s.add(request("c", range(600, 610), max_tokens=2))
    run_timed(s)
    run_timed(s)
    assert s.requests["a"].prefilling and s.requests["b"].prefilling
    s.cancel("a")
    plan, _ = run_timed(s)
    assert [r.rid for r in plan.started] == ["c"]
    rids = set()
    while s.busy:
        plan, _ = run_timed(s)
        if plan.prefill:
            rids.add(plan.prefill.request.rid)
    assert "a" not in rids and s.requests == {}


def test_tenants_take_turns_by_the_work_of_their_chunks():
    """Guards against one tenant's prompts taking another's turns: two prompts of one tenant beside
    one of another get half of the chunks between them, and a tenant whose chunks cost more (longer
    chunks) gets fewer of them."""
    s = Scheduler(3, 512, VOCAB, Buckets.for_ctx(512, (8, 32), 3), True)
    for i, (rid, tenant) in enumerate((("a1", "x"), ("a2", "x"), ("b", "y"))):
        r = request(rid, range(100 * i + 1, 100 * i + 101), max_tokens=1)
        r.tenant = tenant
        s.add(r)
    tenants = [run_timed(s)[0].prefill.request.tenant for _ in range(6)]
    assert tenants == ["x", "y", "x", "y", "x", "y"]
    # tenant x's 8-token prompts one after another, tenant y's long prompt in 32-token chunks: by
    # work, not by chunks (by chunks, x's stream would take a fifth of y's share)
    s = Scheduler(3, 512, VOCAB, Buckets((8, 32), (1, 3)), True)
    long = request("long", range(1, 400), max_tokens=1)
    long.tenant = "y"
    s.add(long)
    tokens, n = {"x": 0, "y": 0}, 0
    for _ in range(40):
        while s.live + len(s.waiting) < 3:
            n += 1
            r = request(f"x{n}", range(1000 + 10 * n, 1008 + 10 * n), max_tokens=1)
            r.tenant = "x"
            s.add(r)
        p = run_timed(s)[0].prefill
        tokens[p.request.tenant] += len(p.tokens)
    assert abs(tokens["x"] - tokens["y"]) <= 32 and tokens["y"] >= 32 * 5


def test_hybrid_prompts_read_side_by_side_snapshot_each_at_its_own_cut_points():
    """Guards against a snapshot taken at another prompt's cut point or in another's slot when
    chunks of several prompts alternate."""
    s = hybrid(slots=2)
    a, b = request("a", range(1, 71), max_tokens=2), request("b", range(300, 500), max_tokens=2)
    a.cuts, b.cuts = [10, 45], [20]
    s.add(a)
    s.add(b)
    prefills = run_hybrid(s)
    rids = [p.request.rid for p in prefills]
    assert sum(x != y for x, y in zip(rids, rids[1:])) >= 2              # their chunks alternate
    assert s.slots[a.slot].snapshots == {10: "slot0@10", 45: "slot0@45", 70: "slot0@70"}
    assert s.slots[b.slot].snapshots == {20: "slot1@20", 200: "slot1@200"}
