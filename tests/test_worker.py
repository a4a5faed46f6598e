"""The engine on the tiny checkpoints: in-process (Engine) and as a worker process over the pipe."""
from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest

from engine.protocol import Cancel, Loading, Ready, Sampling, Shutdown, Stats, Step, Submit
from engine.worker import FAULT_EXIT_CODE, Engine, WorkerArgs
from mashbox import WORKER_ENTRY, WORKER_THREAD_ENV, spawn_worker

TINY = Path(__file__).parent / "fixtures" / "tiny"
CTX = 256
# Small chunks so that a 40-token prompt takes several prefill calls.
CHUNKS = (8, 32)


def make_engine(folder="qwen3", slots=4, ctx=CTX, chunks=CHUNKS, prefix_cache=True, dtype="float32"):
    """float32 by default: these tests compare against float32 references (auto may pick int8)."""
    return Engine(WorkerArgs("tiny", str(TINY / folder), slots=slots, ctx=ctx, prefix_cache=prefix_cache,
                             prefill_chunks=chunks, compile_cache=None, dtype=dtype))


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def run(engine, *submits, cancel_after=None):
    """Submit, step until idle; returns rid -> {"tokens", "finish", "first": first Step, "last"}."""
    out = {}

    def take(step: Step):
        r = out.setdefault(step.rid, {"tokens": [], "finish": None, "first": step})
        r["tokens"] += step.tokens
        if step.finish:
            r["finish"], r["last"] = step.finish, step
    for s in submits:
        for step in engine.submit(s):
            take(step)
    rounds = 0
    while engine.busy:
        for step in engine.step():
            take(step)
        rounds += 1
        if cancel_after and rounds == cancel_after[1]:
            for step in engine.cancel(cancel_after[0]):
                take(step)
        assert rounds < 2000
    return out


def prompt(seed, n):
    return [(seed * 37 + i * 11) % 300 + 3 for i in range(n)]


def test_greedy_tokens_do_not_change_beside_other_requests(engine):
    """Guards against rows leaking into each other (batch invariance of the decode batch)."""
    alone = run(engine, Submit("a", prompt(1, 20), 12))["a"]["tokens"]
    together = run(engine, Submit("b", prompt(2, 33), 15, Sampling(temperature=1.0, seed=5)),
                   Submit("a", prompt(1, 20), 12),
                   Submit("c", prompt(3, 5), 9, Sampling(frequency_penalty=1.0)),
                   Submit("d", prompt(4, 40), 14, Sampling(temperature=0.7, top_k=5)))
    assert len(alone) == 12 and together["a"]["tokens"] == alone
    assert all(together[r]["finish"] == "length" for r in "abcd")


def test_a_small_decode_batch_of_many_slots_keeps_each_rows_tokens_and_penalties():
    """Guards against the 4-row decode program (8 slots, 2-4 live rows) mixing up which slot a row
    belongs to: each row's greedy tokens and penalties must be its own."""
    big = make_engine(slots=8)
    assert big.buckets.decode_rows == (1, 4, 8)
    alone = {rid: run(big, s)[rid]["tokens"] for rid, s in
             (("a", Submit("a", prompt(1, 20), 10)),
              ("c", Submit("c", prompt(3, 5), 10, Sampling(frequency_penalty=1.5))))}
    together = run(big, Submit("a", prompt(1, 20), 10), Submit("b", prompt(2, 9), 10),
                   Submit("c", prompt(3, 5), 10, Sampling(frequency_penalty=1.5)))
    assert together["a"]["tokens"] == alone["a"] and together["c"]["tokens"] == alone["c"]
    assert big.compiles_after_ready() == 0


def test_seeded_sampling_is_reproducible(engine):
    """Guards against a seeded request drawing from a shared or global random state."""
    s = Sampling(temperature=1.0, top_p=0.9, seed=1234)
    first = run(engine, Submit("a", prompt(5, 12), 16, s))["a"]["tokens"]
    second = run(engine, Submit("x", prompt(6, 30), 8, Sampling(temperature=1.0)),
                 Submit("a", prompt(5, 12), 16, s))["a"]["tokens"]
    assert first == second
    other = run(engine, Submit("a", prompt(5, 12), 16, Sampling(temperature=1.0, top_p=0.9, seed=99)))
    assert other["a"]["tokens"] != first


def test_cancel_answers_abort_and_frees_the_slot_at_once(engine):
    """Guards against a cancelled request keeping its row while another waits for it."""
    for i in range(4):
        engine.submit(Submit(f"long{i}", prompt(20 + i, 5), 100))
    engine.submit(Submit("b", prompt(2, 5), 3))
    for _ in range(6):
        engine.step()
    assert engine.stats().waiting == 1
    steps = engine.cancel("long2")
    assert [(s.rid, s.finish) for s in steps] == [("long2", "abort")] and steps[0].timings
    first = [s for s in engine.step() if s.rid == "b"]
    assert first and first[0].prompt_tokens == 5
    assert engine.cancel("long2") == []
    for i in (0, 1, 3):
        engine.cancel(f"long{i}")
    run(engine)


def test_prefix_reuse_serves_cached_tokens_and_matches_a_cold_run(engine):
    """Guards against a reused prefix producing different tokens from running the prompt in full."""
    shared = prompt(7, 40)
    run(engine, Submit("warm", shared + [5, 6], 4))
    follow = shared + prompt(8, 9)
    hot = run(engine, Submit("hot", follow, 10))["hot"]
    assert hot["first"].cached_tokens >= 40 and hot["first"].prompt_tokens == 49
    cold_engine = make_engine(prefix_cache=False)
    cold = run(cold_engine, Submit("cold", follow, 10))["cold"]
    assert cold["first"].cached_tokens == 0
    assert hot["tokens"] == cold["tokens"]

    # the same prefix held by a request still running is copied into the new request's slot
    other = prompt(30, 50)
    engine.submit(Submit("runner", other + [1, 2], 30))
    while not engine.scheduler.requests["runner"].output:
        engine.step()
    beside = other[:45] + prompt(31, 6)
    copied = run(engine, Submit("copied", beside, 10))["copied"]
    assert copied["first"].cached_tokens == 45
    assert copied["tokens"] == run(cold_engine, Submit("cold", beside, 10))["cold"]["tokens"]


def test_a_prompt_cached_but_its_last_token_runs_one_token_and_compiles_nothing(engine):
    """Guards against a fully cached turn paying for a padded chunk's attention over its whole
    context (31 wasted rows at 11k positions took a second on a CPU), and against the one-token
    chunk needing a program the warm-up did not compile."""
    tokens = prompt(21, 45)
    first = run(engine, Submit("once", tokens, 6))["once"]
    chunks = []
    real = engine._prefill
    engine._prefill = lambda work: chunks.append(work.chunk) or real(work)
    try:
        again = run(engine, Submit("again", tokens, 6))["again"]
    finally:
        del engine._prefill
    assert again["first"].cached_tokens == 44 and chunks == [1]
    assert again["tokens"] == first["tokens"]
    assert engine.compiles_after_ready() == 0


def test_chunked_prefill_equals_one_shot(engine):
    """Guards against chunk boundaries corrupting positions or the cache."""
    p = prompt(9, 45)
    chunked = run(engine, Submit("a", p, 10))["a"]["tokens"]      # 32 + 8 + 8 (padded)
    one_shot = run(make_engine(chunks=(64,), prefix_cache=False), Submit("a", p, 10))["a"]["tokens"]
    assert chunked == one_shot


def test_max_tokens_and_end_of_context_finish_with_length(engine):
    """Guards against running past max_tokens or past the context."""
    r = run(engine, Submit("a", prompt(10, 6), 5))["a"]
    assert len(r["tokens"]) == 5 and r["finish"] == "length"
    r = run(engine, Submit("b", prompt(11, CTX - 4), 1000))["b"]
    assert len(r["tokens"]) == 4 and r["finish"] == "length"
    assert set(r["last"].timings) == {"queue_ms", "prompt_ms", "predicted_ms"}


def test_stop_id_ends_the_request_without_output(engine):
    """Guards against a stop id being sent to the client as text."""
    free = run(engine, Submit("a", prompt(12, 7), 6))["a"]["tokens"]
    stopped = run(engine, Submit("a", prompt(12, 7), 6, stop_ids=[free[2]]))["a"]
    assert stopped["tokens"] == free[:2] and stopped["finish"] == "stop"


@pytest.mark.parametrize("bad, field", [([], "prompt"), ([1] * CTX, "prompt"), ([1, 10**6], "prompt")])
def test_bad_prompt_is_an_error_step_that_spares_others(engine, bad, field):
    """Guards against one malformed request failing the batch (or the worker)."""
    good = run(engine, Submit("ok", prompt(13, 8), 6))["ok"]["tokens"]
    out = run(engine, Submit("ok", prompt(13, 8), 6), Submit("bad", bad, 5))
    assert out["bad"]["finish"] == "error" and out["bad"]["last"].error.startswith(field)
    assert out["ok"]["tokens"] == good


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0, top_k=2**31), Sampling(temperature=float("nan")),
                                      Sampling(repetition_penalty=float("inf")), Sampling(min_p=1e300)])
def test_a_sampling_value_the_device_cannot_take_fails_its_request_alone(engine, sampling):
    """Guards against one request's sampling value (past int32, not finite) raising in the batch's
    host-side setup and taking the worker, and every request beside it, down."""
    out = run(engine, Submit("a", prompt(1, 20), 6), Submit("bad", prompt(2, 8), 6, sampling),
              Submit("c", prompt(3, 9), 6))
    assert out["bad"]["finish"] == "error" and "sampling" in out["bad"]["last"].error
    assert out["bad"]["tokens"] == []
    assert len(out["a"]["tokens"]) == 6 and len(out["c"]["tokens"]) == 6


def test_no_program_compiles_after_ready(engine):
    """Guards against a shape or argument the warm-up missed (a multi-second stall mid-request)."""
    run(engine, Submit("a", prompt(14, 70), 20, Sampling(temperature=0.5, repetition_penalty=1.3)),
        Submit("b", prompt(15, 3), 30, Sampling(presence_penalty=0.5)),
        Submit("c", prompt(16, 200), 40))
    assert engine.stats().compiles_after_ready == 0


def _recv_until(conn, kind, timeout=300):
    messages = []
    while True:
        assert conn.poll(timeout), f"no {kind.__name__} from the worker"
        msg = conn.recv()
        messages.append(msg)
        if isinstance(msg, kind):
            return messages


def test_worker_process_round_trip(compile_cache):
    """Guards against the pipe protocol breaking: Loading, Ready, Submit -> Steps -> finish, Stats."""
    # as a dict of WorkerArgs's fields, the way the server (which never imports jax) sends them
    args = {"model_id": "tiny", "weights_folder": str(TINY / "qwen3"), "slots": 2, "ctx": 128,
            "prefill_chunks": [32], "compile_cache": compile_cache}
    process, conn = spawn_worker(WORKER_ENTRY, args)
    try:
        start = _recv_until(conn, Ready)
        assert any(isinstance(m, Loading) for m in start)
        facts = start[-1].facts
        assert facts.max_model_len == 128 and facts.slots == 2 and facts.family == "qwen3"
        assert facts.routed_experts is None                   # a dense model
        assert start[-1].pid == process.pid
        conn.send(Submit("a", prompt(1, 10), 5))
        conn.send(Submit("b", prompt(2, 10), 50))
        conn.send(Cancel("b"))
        steps, stats = {}, []
        while len([r for r in steps.values() if r[-1].finish]) < 2:
            assert conn.poll(120)
            msg = conn.recv()
            if isinstance(msg, Step):
                steps.setdefault(msg.rid, []).append(msg)
            elif isinstance(msg, Stats):
                stats.append(msg)
        assert sum(len(s.tokens) for s in steps["a"]) == 5 and steps["a"][-1].finish == "length"
        assert steps["a"][0].prompt_tokens == 10
        assert steps["b"][-1].finish == "abort"
        stats = [m for m in _recv_until(conn, Stats)] if not stats else stats
        assert stats[-1].compiles_after_ready == 0
        conn.send(Shutdown())
        process.join(60)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()


# Starts an engine with a compile cache and prints how many programs the persistent cache served.
_START_AND_COUNT = """
import json, sys, jax
counts = {"hits": 0, "misses": 0}
def seen(event, **_):
    for name in counts:
        if event == "/jax/compilation_cache/cache_" + name:
            counts[name] += 1
jax.monitoring.register_event_listener(seen)
from engine.worker import Engine, WorkerArgs
engine = Engine(WorkerArgs("tiny", sys.argv[1], slots=4, ctx=256, cache_ram_mib=1, compile_cache=sys.argv[2]))
print(json.dumps(counts))
"""


def test_a_restarted_worker_loads_every_program_from_the_persistent_cache(tmp_path):
    """Guards against a worker restarted after a fault compiling again (minutes on a CPU while every
    request gets 503): on the second start in a new process, every program is a persistent-cache hit
    (no program is too quick to be cached, and the cache keys are stable across processes)."""
    import json
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    runs = [json.loads(subprocess.run(
        [sys.executable, "-c", _START_AND_COUNT, str(TINY / "qwen3"), str(tmp_path / "jax")],
        env=env, cwd=root, capture_output=True, text=True, check=True, timeout=600).stdout.splitlines()[-1])
        for _ in range(2)]
    assert runs[0]["misses"] > 0 and runs[0]["hits"] == 0
    assert runs[1] == {"hits": runs[0]["misses"], "misses": 0}


def test_the_compile_cache_forgets_programs_unused_for_a_month(tmp_path):
    """Guards against the compile cache growing by a set of programs with every upgrade or flag change
    for as long as the host runs: a program neither read nor written for COMPILE_CACHE_KEEP_DAYS goes
    at a worker's start; one read lately (its access time) stays, however old it is."""
    from engine.worker import COMPILE_CACHE_KEEP_DAYS, forget_unused_programs
    day, now = 86400, time.time()
    ages = {"stale": (COMPILE_CACHE_KEEP_DAYS + 1, COMPILE_CACHE_KEEP_DAYS + 1),   # (since read, since written)
            "read-lately": (1, 400), "written-lately": (COMPILE_CACHE_KEEP_DAYS + 5, 2)}
    for name, (read, written) in ages.items():
        (tmp_path / f"{name}-cache").write_bytes(b"x" * 1000)
        os.utime(tmp_path / f"{name}-cache", (now - read * day, now - written * day))
    (tmp_path / "a-folder-cache").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for other in ("a-folder-cache", "notes.txt"):        # not programs of jax's: never deleted
        os.utime(tmp_path / other, (now - 400 * day, now - 400 * day))
    assert forget_unused_programs(str(tmp_path)) == (1, 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a-folder-cache", "notes.txt", "read-lately-cache", "written-lately-cache"]


def test_a_worker_keeps_its_programs_where_jax_is_told_to(monkeypatch, tmp_path):
    """Guards against an operator's JAX_COMPILATION_CACHE_DIR being overridden by the server's own
    folder (and against the tests' servers with a cache root of their own compiling cold each run)."""
    monkeypatch.setenv("MASHBOX_CACHE", str(tmp_path / "root"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert WorkerArgs("tiny", str(TINY / "qwen3")).compile_cache == str(tmp_path / "jax")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert WorkerArgs("tiny", str(TINY / "qwen3")).compile_cache == str(tmp_path / "root" / "jax")


def test_fault_injection_exits_the_process(tmp_path, monkeypatch):
    """Guards against MASHBOX_FAULT not firing, which would leave the server's recovery untested."""
    monkeypatch.setenv("MASHBOX_FAULT", "warmup")
    args = WorkerArgs("tiny", str(TINY / "qwen3"), slots=2, ctx=128, prefill_chunks=(32,),
                      compile_cache=None)
    process, conn = spawn_worker(WORKER_ENTRY, args)
    try:
        process.join(120)
        assert process.exitcode == FAULT_EXIT_CODE
    finally:
        if process.is_alive():
            process.kill()


def report_environment(conn, args) -> None:
    """A worker entry for the test below: sends back the thread settings it started with."""
    conn.send({name: os.environ.get(name) for name in args})


def test_one_spawn_path_and_the_worker_gets_one_blas_thread(monkeypatch):
    """Guards against a second way to start the worker (one without the thread settings), and against
    the settings not reaching the child, whatever the server's own environment says."""
    root = Path(__file__).resolve().parent.parent
    worker_spawns = []
    for path in [root / "mashbox.py", *sorted((root / "engine").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            for call in ast.walk(func):
                if (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "Process"
                        and not any(k.arg == "name" and getattr(k.value, "value", "") == "mashbox-tokenizer"
                                    for k in call.keywords)):
                    worker_spawns.append((path.name, func.name))
    assert worker_spawns == [("mashbox.py", "spawn_worker")]
    for name in WORKER_THREAD_ENV:
        monkeypatch.setenv(name, "7")
    process, conn = spawn_worker(f"{__name__}:report_environment", list(WORKER_THREAD_ENV))
    try:
        assert conn.poll(120), "no answer from the spawned process"
        assert conn.recv() == WORKER_THREAD_ENV
        assert {name: os.environ[name] for name in WORKER_THREAD_ENV} == dict.fromkeys(WORKER_THREAD_ENV, "7")
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


def test_int8_weights_get_their_own_cache_namespace_and_deployment_id(engine):
    """Guards against a float32 worker and an int8 one sharing saved prompt states (their KV values
    differ) or reporting the same deployment: the weights dtype is part of both ids."""
    narrow = Engine(WorkerArgs("tiny", str(TINY / "qwen3"), slots=4, ctx=CTX, prefix_cache=True,
                               prefill_chunks=CHUNKS, compile_cache=None, certify_dir=None,
                               cache_ram_mib=1, dtype="int8"))
    assert narrow.facts.dtype == "int8" and engine.facts.dtype == "float32"
    assert narrow.facts.cache_namespace != engine.facts.cache_namespace
    assert narrow.deployment_id != engine.deployment_id
    assert narrow.component_set_sha == engine.component_set_sha       # the same files on disk
    assert narrow.facts.gb < 0.3 * engine.facts.gb


def test_programs_compile_one_at_a_time_when_memory_is_tight(monkeypatch):
    """Guards against a large model's compiles, run one per core, taking the worker past the memory
    its plan counted (the 27B on a 24 GB host: two 64-layer compiles at once peaked at 20.8 GB)."""
    from engine import memory, worker
    monkeypatch.setattr(worker.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(memory, "available_bytes", lambda: 5 << 30)        # 16 GB of 22 already held
    assert worker.compile_threads(64) == 1
    monkeypatch.setattr(memory, "available_bytes", lambda: 20 << 30)       # the demo's start
    assert worker.compile_threads(24) == 2
    monkeypatch.setattr(memory, "available_bytes", lambda: None)           # not Linux: one per core
    assert worker.compile_threads(64) == 2
