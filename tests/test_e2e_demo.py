"""End to end on the demo model: `python -m mashbox run` as users start it, driven by the real OpenAI and
Anthropic SDKs over HTTP. Greedy answers are checked against what the model is known to say.

The server runs with 2 slots of 512 tokens, so start-up compiles few programs (and reuses the
persistent compile cache on later runs).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Cold start on a 2-core CPU: loading 2.5 GB of weights and compiling every program; warm: seconds.
START_TIMEOUT_S = 900
FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def demo_server(demo_folder):
    proc = subprocess.Popen(
        [sys.executable, "-m", "mashbox", "run", "--slots", "2", "--ctx", "512", "--port", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    url_found = threading.Event()
    url: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url.append(m.group(1))
                url_found.set()
    threading.Thread(target=read, daemon=True).start()
    try:
        assert url_found.wait(60), "".join(lines)
        import urllib.request
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(url[0] + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "server not ready in time:\n" + "".join(lines[-20:])
            time.sleep(1)
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, "".join(lines[-20:])


def test_the_demo_health_reports_no_routed_experts_and_a_certified_build(demo_server):
    """Guards against a dense model claiming a routed-expert path in /health, and a demo whose
    compiled programs do not pass the certification gate (numpy reference, golden answer)."""
    import json
    import urllib.request
    with urllib.request.urlopen(demo_server + "/health", timeout=5) as r:
        health = json.load(r)
    assert health["routed_experts"] is None
    assert health["certification"] == "certified", health.get("detail")
    assert len(health["deployment_id"]) == 64 and len(health["component_set_sha"]) == 64


def test_chat_answers_the_france_question_greedily(demo_server):
    """Guards against a server whose engine, template or tokenizer drifted from the real model."""
    import openai
    client = openai.OpenAI(base_url=demo_server + "/v1", api_key="local")
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b-instruct",
                                       messages=[{"role": "user", "content": FRANCE}], max_tokens=16)
    assert r.choices[0].message.content.startswith("The capital of France is Paris.")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 20 and r.usage.completion_tokens == 7


def test_streamed_chat_equals_the_plain_answer_and_reports_cached_tokens(demo_server):
    """Guards against streams that differ from the JSON answer, and a prefix cache that never hits."""
    import openai
    client = openai.OpenAI(base_url=demo_server + "/v1", api_key="local")
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": FRANCE}], max_tokens=16, stream=True,
        stream_options={"include_usage": True}, model="Qwen/Qwen2.5-Coder-0.5B-Instruct")   # the HF name
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("The capital of France is Paris.")
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens > 0   # the same prompt ran just before


def test_anthropic_sdk_stream_and_count_tokens_agree(demo_server):
    """Guards against count_tokens counting a different prompt than the Messages route prefills."""
    import anthropic
    client = anthropic.Anthropic(base_url=demo_server, api_key="local")
    messages = [{"role": "user", "content": FRANCE}]
    with client.messages.stream(model="claude-any", max_tokens=16, messages=messages) as s:
        final = s.get_final_message()
    assert final.content[0].text.startswith("The capital of France is Paris.")
    assert final.stop_reason == "end_turn" and final.model == "claude-any"
    counted = client.messages.count_tokens(model="claude-any", messages=messages).input_tokens
    assert counted == final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)


def test_responses_and_completions_answer(demo_server):
    """Guards against the Responses and Completions routes breaking on a real model."""
    import openai
    client = openai.OpenAI(base_url=demo_server + "/v1", api_key="local")
    r = client.responses.create(input=FRANCE, max_output_tokens=16, model="qwen2.5-coder-0.5b-instruct")
    assert r.status == "completed" and r.output_text.startswith("The capital of France is Paris.")
    with pytest.raises(openai.NotFoundError):             # another model's id: the spec's 404
        client.responses.create(input=FRANCE, max_output_tokens=4, model="gpt-5.5")
    c = client.completions.create(model="qwen2.5-coder-0.5b-instruct", prompt="def add(a, b):\n    return",
                                  max_tokens=4)
    assert c.choices[0].text.strip().startswith("a + b")


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_the_readme_tool_example_is_a_real_call_on_every_api(demo_server):
    """Guards against the README's own tool example coming back as text (the demo writes its calls
    bare or in a ```json fence, not in <tool_call> tags), on Chat, Messages and Responses."""
    import anthropic
    import jsonschema
    import openai
    client = openai.OpenAI(base_url=demo_server + "/v1", api_key="local")
    question = "What is the weather in Paris?"
    r = client.chat.completions.create(
        model="qwen2.5-coder-0.5b-instruct", messages=[{"role": "user", "content": question}], max_tokens=48,
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                 "parameters": WEATHER}}])
    call = r.choices[0].message.tool_calls[0].function
    assert r.choices[0].finish_reason == "tool_calls" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    m = anthropic.Anthropic(base_url=demo_server, api_key="local").messages.create(
        model="claude-any", max_tokens=48, messages=[{"role": "user", "content": question}],
        tools=[{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}])
    use = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use[0].name == "get_weather"
    jsonschema.validate(use[0].input, WEATHER)
    resp = client.responses.create(model="qwen2.5-coder-0.5b-instruct", input=question, max_output_tokens=48,
                                   tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}])
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_forced_calls_fit_their_schema_and_are_counted(demo_server):
    """Guards against tool_choice required or a named tool letting the model name a tool that does
    not exist or break its schema, and /metrics not counting the constrained requests."""
    import jsonschema
    import openai
    import urllib.request
    client = openai.OpenAI(base_url=demo_server + "/v1", api_key="local")
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in (
        ("get_weather", WEATHER),
        ("convert", {"type": "object", "additionalProperties": False, "required": ["amount", "unit"],
                     "properties": {"amount": {"type": "number"}, "unit": {"enum": ["km", "mi"]}}}))]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for choice in ("required", {"type": "function", "function": {"name": "convert"}}):
        r = client.chat.completions.create(
            model="qwen2.5-coder-0.5b-instruct", max_tokens=64, tools=tools, tool_choice=choice,
            messages=[{"role": "user", "content": "Hello! How far is 10 miles?"}])
        for call in r.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert isinstance(choice, str) or r.choices[0].message.tool_calls[0].function.name == "convert"
    with urllib.request.urlopen(demo_server + "/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert 'mashbox:constrained_requests_total{mode="required"} 1' in metrics
    assert 'mashbox:constrained_requests_total{mode="named"} 1' in metrics
