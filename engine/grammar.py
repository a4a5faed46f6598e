"""Tool-call grammars: which tokens may come next, so that every call the model starts is a real call
that names one of the request's tools with arguments valid for that tool's JSON schema, written
byte for byte as the model's chat template writes calls.

    lark(constraint, plain)      a Constraint (engine.protocol) as a grammar in llguidance's Lark
                                 dialect: the call forms engine.chat renders and reads, each tool's
                                 arguments as its JSON schema (`plain` tools: any arguments)
    Grammars(folder, vocab)      the worker's side: grammars compiled off the engine's thread (each
                                 first in a trial process, killed past its budget), tenants in
                                 turn, kept per tool set; one matcher per constrained request, the
                                 rows' masks

The masks come from llguidance (an optional extra: pip install 'mashbox[tools]'); without it every
request runs unconstrained and the output parser reads whatever the model wrote, as before.

The call forms (Constraint.form), inside <tool_call> ... </tool_call> exactly as the templates write
calls in history, no other whitespace anywhere:
  json  <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>, ARGS compact as json.dumps
        writes it (", " and ": ")
  xml   <tool_call>\\n<function=NAME>\\n, per parameter <parameter=P>\\nVALUE\\n</parameter>\\n (the
        schema's order, the required ones always), </function>\\n</tool_call>; VALUE is raw text for a
        string parameter (one that has no other type), else compact JSON valid for its schema (a
        boolean also as True / False, as Qwen3.5's template writes it)
Calls follow each other after a "\\n". Where the XML form cannot hold a schema (xml_holds):
  - a string parameter with a pattern, or keywords other than enum / const / minLength / maxLength,
    takes any text (its other parameters stay typed);
  - a schema whose top level says more than properties, required and additionalProperties (anyOf,
    patternProperties, a required name with no property ...) gets its properties, each optional, in
    its order; one with no properties gets any parameter names, their values any text.
The name and the layout hold either way. `plain` tools (a schema the library refuses, or a tool set
too large) get that last form, and in the json form any JSON object as arguments.

The modes (engine.chat.tool_constraint picks one):
  auto      lazy: the model writes freely until it starts a call: <tool_call> (the request's form,
            exact), or one of the forms small Qwen models improvise: a ```json (or bare ```) fence
            whose object opens with "name", such an object at the very start of the answer or right
            after another call, or <function=. From there the call must name an offered tool and give
            arguments valid for its schema; after it, text again. The improvised forms allow blanks
            between the object's keys and around it (WHITESPACE_RUN at most); their arguments are
            compact. Text that is not a call (a ```python block, JSON that does not open with "name")
            stays text; text never spells a call's or a thought's markers out in characters (the
            output parser would read them as markup).
  required  the prompt opened the call already (chat.answer_prefix): its name and arguments, then
            more calls (each after a "\n") or the end (a "\n" may come before it), no text
  named     the prompt opened the call up to its arguments (json) or parameters (xml): those, then
            the end
  none      text only: no <tool_call> token
And where the thinking stands (Constraint.think): "may_open" lets the answer open with a
<think> ... </think> block, "open" starts inside the thought: text, then </think>, then the mode's
answer. required / named with a thought: the thought, "\\n\\n", then the whole call (the prompt could
not have opened it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from engine.chat import (CALL_CLOSE, CALL_HEAD, CALL_OPEN, THINK_CLOSE, THINK_OPEN, XML_OPEN, XML_VALUE_ENDS,
                         Tokenizer)
from engine.protocol import Constraint

# ---- the grammar -----------------------------------------------------------------------------------

MODES = ("auto", "required", "named", "none")
THINKS = ("none", "may_open", "open")
FORMS = ("json", "xml")

# The template's bytes around a call (engine.chat writes the same): after <tool_call>, the opening of
# each form; between a Hermes call's name and its arguments; an XML parameter's end and the
# function's; between two calls; between a thought and a forced call.
_JSON_OPEN = CALL_HEAD[len(CALL_OPEN):]
_XML_CALL_OPEN = "\n" + XML_OPEN
_ARGUMENTS = '", "arguments": '
_NAME_END = ">\n"
_PARAM_END = "\n</parameter>\n"
_FUNCTION_END = "</function>"
_BETWEEN = "\n"
_AFTER_THOUGHT = "\n\n"
# The markers engine.chat's output parser finds in the text it reads: free text must not spell them
# out in characters (the special tokens are not text at all).
_MARKERS = (CALL_OPEN, CALL_CLOSE, THINK_OPEN, THINK_CLOSE)

# Whitespace the improvised forms may hold between their keys and around their object (bounded: a
# model that would rather write text than go on with the call must not fill the answer with blanks).
WHITESPACE_RUN = 40


def _regex_text(text: str) -> str:
    """A literal string inside a Lark /regex/ (Rust regex syntax; the slash is the delimiter)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$#&~\-/])", r"\\\1", text)


def _without(*texts: str) -> str:
    """A terminal's regex: any text that holds none of `texts`."""
    return rf"/(.|\n)*/ & ~/(.|\n)*({'|'.join(_regex_text(t) for t in texts)})(.|\n)*/"


# Free text (anything but the markers; special tokens are not text, so <|im_start|> and the like
# cannot appear in it), the improvised forms' blanks, and a string parameter's raw value: text that
# holds none of what ends a value where engine.chat reads one, then the parameter's end.
_TERMINALS = f"""TEXT: {_without(*_MARKERS)}
WS: /[ \\t\\r\\n]{{0,{WHITESPACE_RUN}}}/
RAW: {_without(*XML_VALUE_ENDS)}
xml_string[lazy]: RAW {json.dumps(_PARAM_END)}
PARAM_NAME: /[^<>\\s]+/
"""
# The opening of an improvised Hermes object, up to the quote that opens its name, as the triggers
# match it.
_OPENING = r'\{[ \t\r\n]*"name"[ \t\r\n]*:[ \t\r\n]*"'
# The lazy triggers of "auto": each matches as little as it can, so it ends at the first place the
# text opens a call in that form, and the call's grammar takes over from there.
_TRIGGERS = rf"""fenced_head[lazy]: TEXT /```(json)?[ \t]*\r?\n?[ \t]*{_OPENING}/
bare_head[lazy]: /[ \t\r\n]*{_OPENING}/
xml_head[lazy]: TEXT {json.dumps(XML_OPEN)}
"""


def _literal(text: str) -> str:
    """A Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _json_name(name: str) -> str:
    """A tool name as it appears between the quotes of a JSON string."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


# JSON as the templates' tojson writes it (engine.chat.tojson): ", " and ": " and no other
# whitespace; keywords the library does not implement are ignored rather than refused (lenient).
_EXACT_JSON = {"lenient": True, "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _schema(schema: dict) -> str:
    """A JSON schema for %json, written as the templates write JSON."""
    return json.dumps({**schema, "x-guidance": _EXACT_JSON}, ensure_ascii=False)


def _properties(schema: dict) -> dict:
    props = schema.get("properties")
    return {k: v for k, v in props.items() if isinstance(v, dict)} if isinstance(props, dict) else {}


def _is_string(spec: dict) -> bool:
    """Whether an XML parameter's value is raw text (engine.chat._param_type: "string" unless the
    schema names another type)."""
    kind = spec.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return not isinstance(kind, str) or kind == "string"


# Keywords that say nothing about a value (a string parameter with only these takes any text).
# "format" is an annotation too unless a validator opts in (JSON Schema 2020-12): raw text is not
# held to it.
_ANNOTATIONS = frozenset({"type", "description", "title", "default", "examples", "$comment", "deprecated",
                          "format", "readOnly", "writeOnly"})
# The top-level keywords of an arguments schema whose XML form (one parameter per property, the
# required ones always) holds it; definitions are carried into the parameters that refer to them.
_XML_ROOT = frozenset({"type", "properties", "required", "additionalProperties", "description", "title",
                       "$schema", "$id", "$comment", "$defs", "definitions", "examples", "default"})
# A string enum longer than this is raw text in the XML form (the JSON form takes it as one lexeme; as
# raw-text alternatives a huge enum would cost the compile seconds).
XML_ENUM_MAX = 64


def _readable(param: str) -> bool:
    """Whether engine.chat reads a parameter's name back as written (<parameter=([^>\\n]*)>, stripped)."""
    return bool(param) and param == param.strip() and not any(c in param for c in "<>\n")


def _with_defs(spec: dict, schema: dict) -> dict | None:
    """A parameter's schema with the definitions its $refs name carried over from the tool's schema,
    or None where a $ref points elsewhere (the tool's root, another document)."""
    refs = re.findall(r'"\$ref": "([^"]*)"', json.dumps(spec))
    if not refs:
        return spec
    defs = {key: schema[key] for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)}
    if not all(any(ref.startswith(f"#/{key}/") for key in defs) for ref in refs):
        return None
    return {**spec, **defs}


def _string_value(rule: str, spec: dict) -> list[str] | None:
    """The rules of a raw string value (rule `rule`, up to its parameter's end) held to its schema, or
    None where raw text cannot be (a pattern, keywords other than enum / const / minLength /
    maxLength)."""
    extra = set(spec) - _ANNOTATIONS
    if not extra:
        return [f"{rule}: xml_string"]
    values = spec["enum"] if "enum" in spec else [spec.get("const")]
    if extra in ({"enum"}, {"const"}) and isinstance(values, list) and 0 < len(values) <= XML_ENUM_MAX \
            and all(isinstance(v, str) and not any(end in v for end in XML_VALUE_ENDS) for v in values):
        return [f"{rule}: ({' | '.join(_literal(v) for v in values)}) {_literal(_PARAM_END)}"]
    low, high = spec.get("minLength", 0), spec.get("maxLength", "")
    if extra <= {"minLength", "maxLength"} and all(isinstance(n, int) and n >= 0 for n in (low, high or 0)):
        terminal = rule.upper()
        return [rf"{terminal}: (RAW & /(.|\n){{{low},{high}}}/) {_literal(_PARAM_END)}",
                f"{rule}[lazy]: {terminal}"]
    return None


def _xml_value(rule: str, spec: dict, schema: dict) -> tuple[list[str], bool]:
    """(rules, held) of one XML parameter's value (rule `rule`) as engine.chat reads it back: raw
    text for a string, JSON of its schema for another type; then the parameter's end. held: the value
    is held to the parameter's schema (else it is any text, or any JSON)."""
    if spec.get("type") == "boolean" and set(spec) <= _ANNOTATIONS:
        # Qwen3.5's and Qwen3-Coder's templates write a boolean as Python's str() does, Qwen3.8's as
        # JSON; engine.chat reads either.
        return [f'{rule}: ("true" | "false" | "True" | "False") {_literal(_PARAM_END)}'], True
    if not _is_string(spec):
        typed = _with_defs(spec, schema)
        if typed is None:
            return [f"{rule}: %json {_schema({})} {_literal(_PARAM_END)}"], False
        return [f"{rule}: %json {_schema(typed)} {_literal(_PARAM_END)}"], True
    string = _string_value(rule, spec)
    return (string, True) if string is not None else ([f"{rule}: xml_string"], False)


def xml_holds(schema: dict) -> bool:
    """Whether the XML form holds a tool's arguments schema whole: its top level (parameters by name,
    the required ones always) and every parameter's value; else it gets the fallback the module's
    docstring describes."""
    return _xml_rules(0, "tool", schema)[1]


def _xml_rules(i: int, name: str, schema: dict) -> tuple[list[str], bool]:
    """(rules, held) of tool i's XML form after `<function=`: x{i} is its name and p{i}, p{i} its
    parameters in the schema's order (the required ones always, where the top level holds) and
    </function>. A schema that declares no parameters takes any (their values any text) unless it
    forbids them."""
    props, required = _properties(schema), schema.get("required", [])
    root = set(schema) <= _XML_ROOT and isinstance(required, list) and set(required) <= set(props) \
        and all(_readable(p) for p in required)
    params = {p: spec for p, spec in props.items() if _readable(p)}
    rules, parts, held = [f"x{i}: {_literal(name + _NAME_END)} p{i}"], [], root and len(params) == len(props)
    extra = schema.get("additionalProperties", True)
    if not params and extra is not False:
        return [*rules, f"p{i}: p_any"], held and extra is True
    for j, (param, spec) in enumerate(params.items()):
        value, typed = _xml_value(f"v{i}_{j}", spec, schema)
        rules += [*value, f"x{i}_{j}: {_literal(f'<parameter={param}' + _NAME_END)} v{i}_{j}"]
        parts.append(f"x{i}_{j}" if root and param in required else f"x{i}_{j}?")
        held = held and typed
    return [*rules, f"p{i}: {' '.join([*parts, _literal(_FUNCTION_END)])}"], held


def _hermes_rules(key, name: str, schema: dict | None) -> list[str]:
    """The Hermes form of tool `key` after the quote that opens its name (`name`: the name's Lark
    expression): h{key} exact, l{key} with blanks between the keys (the improvised forms), both to
    the object's closing brace; a{key} the arguments (schema None: any object)."""
    args = f"a{key}: %json {_schema(schema if schema is not None else {'type': 'object'})}"
    return [f"h{key}: {name} {_literal(_ARGUMENTS)} a{key} \"}}\"",
            f'l{key}: {name} "\\"" WS "," WS "\\"arguments\\"" WS ":" WS a{key} WS "}}"', args]


def _tool_rules(c: Constraint, plain: frozenset[str]) -> list[str]:
    """hermes / loose / xml: the alternatives of the forms the grammar needs, one per tool; `plain`
    tools share one of each that names any of them (arguments: any object; parameters: any names,
    any text)."""
    tools = [(n, s) for n, s in c.tools if c.mode != "named" or n == c.name]
    if not tools:
        raise ValueError(f"the named tool {c.name!r} is not one of the request's tools")
    json_form, xml_form = c.form == "json" or c.mode == "auto", c.form == "xml" or c.mode == "auto"
    names = sorted({n for n, _ in tools if n in plain})
    rules, keys = [], []
    for i, (name, schema) in enumerate(tools):
        if name not in plain:
            keys.append(i)
            rules += _hermes_rules(i, _literal(_json_name(name)), schema) if json_form else []
            rules += _xml_rules(i, name, schema)[0] if xml_form else []
    if names:
        keys.append("_plain")
        if json_form:
            rules += [*_hermes_rules("_plain", "PLAIN_NAME", None),
                      "PLAIN_NAME: " + " | ".join(_literal(_json_name(n)) for n in names)]
        if xml_form:
            rules += ["x_plain: PLAIN_TAG p_plain", "p_plain: p_any",
                      "PLAIN_TAG: " + " | ".join(_literal(n + _NAME_END) for n in names)]
    heads = []
    if json_form:
        heads += [f"hermes: {' | '.join(f'h{k}' for k in keys)}", f"loose: {' | '.join(f'l{k}' for k in keys)}"]
    if xml_form:
        heads += [f"xml: {' | '.join(f'x{k}' for k in keys)}",
                  f"p_any: ({_literal('<parameter=')} PARAM_NAME {_literal(_NAME_END)} xml_string)* "
                  f"{_literal(_FUNCTION_END)}"]
    return heads + rules


def _thought(think: str) -> tuple[str, str, list[str]]:
    """(what opens the answer before a free answer, before a forced call, rules) for Constraint.think:
    nothing; an optional <think> block; the open thought's text and its </think>."""
    if think == "may_open":
        return "think? ", f"(think {_literal(_AFTER_THOUGHT)})? ", [f"think: {THINK_OPEN} TEXT {THINK_CLOSE}"]
    if think == "open":
        return f"TEXT {THINK_CLOSE} ", f"TEXT {THINK_CLOSE} {_literal(_AFTER_THOUGHT)} ", []
    return "", "", []


def _start(c: Constraint, plain: frozenset[str]) -> list[str]:
    """The rules from the start of the answer (where chat.answer_prefix leaves off) to its end (the
    mode is one of MODES)."""
    free, forced, rules = _thought(c.think)
    form = "hermes" if c.form == "json" else "xml"
    close = f"{_literal(_BETWEEN)} {CALL_CLOSE}"
    opening = _JSON_OPEN if c.form == "json" else _XML_CALL_OPEN
    call = f"call: {CALL_OPEN} {_literal(opening)} {form} {close}"
    # More calls, each after a "\n"; a "\n" may also end the answer: a model that writes one after
    # its last call (the demo does) must not be held to another call it has no room for.
    more = f"({_literal(_BETWEEN)} call)* {_literal(_BETWEEN)}?"
    if c.mode == "none":
        return [f"start: {free}TEXT", *rules]
    if c.mode == "auto":
        # A bare object opens a call only where engine.chat reads one: at the start, or right after
        # another call.
        return [f"start: {free}bare* ((tagged | fenced | xml_bare) bare*)* TEXT", "tagged: TEXT call",
                'fenced: fenced_head loose WS "```"', "bare: bare_head loose", "xml_bare: xml_head xml",
                call, *rules, _TRIGGERS.rstrip("\n")]
    if forced:                          # the prompt could not have opened the call: it is all here
        return [f"start: {forced}call{' ' + more if c.mode == 'required' else ''}", call, *rules]
    if c.mode == "required":
        return [f"start: {form} {close} {more}", call]
    key = "_plain" if c.name in plain else 0
    rest = f'a{key} "}}"' if c.form == "json" else f"p{key}"      # the arguments and their call's brace
    return [f"start: {rest} {close}"]


def lark(c: Constraint, plain: frozenset[str] = frozenset()) -> str:
    """The grammar of what the answer may be, from where the prompt leaves off (after
    chat.answer_prefix). `plain`: tools whose schema is not enforced (only their name)."""
    for field, value, known in (("mode", c.mode, MODES), ("think", c.think, THINKS), ("form", c.form, FORMS)):
        if value not in known:
            raise ValueError(f"unknown constraint {field} {value!r}; known: {', '.join(known)}")
    tools = _tool_rules(c, plain) if c.mode != "none" else []
    return "\n".join(["%llguidance {}", *_start(c, plain), _TERMINALS.rstrip("\n"), *tools]) + "\n"


# ---- the worker's side -----------------------------------------------------------------------------

# Compiled grammars kept, per tool set (agents send the same tools with every request): the least
# recently used go first.
CACHE_GRAMMARS = 32
# A request waits this long for its grammar to compile, then runs unconstrained. Real agents' tool
# sets compile in milliseconds (docs/tool-calls.md); a hostile one must not hold a slot.
COMPILE_WAIT_S = 2.0
# Past either bound every tool is constrained by its name only (arguments: any JSON object): a
# thousand small schemas take about half a second to compile, ten thousand exceed the library's limits.
SCHEMA_TOOLS_MAX = 512
SCHEMA_BYTES_MAX = 1 << 20
# What compiling one request's schemas may spend: CPU seconds of its trial process (what a loaded
# host does not stretch), and wall-clock seconds (a starved one). The library bounds its lexer and
# parser (LLParserLimits) but not its JSON-schema stage (an allOf of anyOfs multiplies out: four of
# ten string patterns are 10,000 intersections, seconds a tool), and a compile cannot be stopped
# inside the worker: so every grammar is first compiled in a trial process, killed past either bound,
# and then the tool set is constrained by name only. A grammar that passes compiles again here, in
# about the trial's CPU time. Real agents' tool sets take milliseconds (docs/tool-calls.md).
COMPILE_BUDGET_S = 2.0
COMPILE_WALL_S = 10.0
# How often a trial's CPU time is read while it compiles.
TRIAL_POLL_S = 0.05
# Grammars compiled at once, each of a different tenant: a tenant's compiles wait behind its own.
COMPILE_THREADS = 2
# How long a trial process may take to start (its imports) before schemas go unchecked (names only).
TRIAL_START_S = 30.0
# Address space a trial may take beyond what its process holds when it starts: past it the trial fails.
TRIAL_MEMORY_BYTES = 1 << 30
# A trial's message starts with the length of what follows, in this many bytes (little-endian).
_FRAME = 8


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token mask: a bit per token."""
    return (vocab_size + 31) // 32


def cache_key(c: Constraint) -> str:
    """The compiled grammar's key: everything lark() reads."""
    text = json.dumps([c.mode, c.name, c.think, c.form, c.tools], ensure_ascii=False, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _limits(llg):
    """The library's default bounds on a grammar's size and each step's work, with short errors."""
    return llg.LLParserLimits(verbose_errors=False)


@dataclass
class _Budget:
    """Where one request's trial compiles stop: the trial process's CPU seconds, time.monotonic()."""
    cpu: float
    wall: float


class _Trial:
    """A process that compiles grammars as the library does without a tokenizer (the schemas, the
    grammar, its lexer: what the tokenizer adds is bounded by LLParserLimits) and says what failed.
    Started at its first use; killed when a compile runs past its budget, and started again at once,
    so that the next compile finds its imports (about 0.3 s, more on a loaded machine) done."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._ready = False

    def ready(self) -> None:
        """Wait until the process is there to compile (started if it is not): a compile's budget
        counts from here. OSError if it does not start within TRIAL_START_S."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        if not self._ready:
            said = self._reply(self._proc, time.monotonic() + TRIAL_START_S)
            if said != "":
                self.close()
                raise OSError(f"the trial process did not start: {said or f'not within {TRIAL_START_S:g} s'}")
            self._ready = True

    def check(self, text: str, budget: _Budget) -> str | None:
        """"" when the grammar compiles, the library's error when it does not, None when the budget
        ran out first (the process is killed, and a fresh one starts). Call ready() first."""
        if self.cpu_s() >= budget.cpu or time.monotonic() >= budget.wall:
            return None
        data = text.encode()
        try:
            self._proc.stdin.write(len(data).to_bytes(_FRAME, "little") + data)
            self._proc.stdin.flush()
            reply = self._reply(self._proc, budget.wall, budget.cpu)
        except OSError as e:
            self.close()
            return f"the trial compile failed: {e}"
        if reply is None:
            self.close()
            self._start()
        return reply

    def cpu_s(self) -> float:
        """The process's CPU seconds so far (0 where /proc does not say: the wall-clock bound alone)."""
        try:
            with open(f"/proc/{self._proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, AttributeError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self._proc = subprocess.Popen([sys.executable, "-m", "engine.grammar"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        self._ready = False

    def _reply(self, proc: subprocess.Popen, deadline: float, cpu: float = float("inf")) -> str | None:
        """The trial's next message, or None past the deadline (time.monotonic()) or once the process
        has spent `cpu` seconds. A process that ended answers its exit."""
        fd, data, need = proc.stdout.fileno(), b"", _FRAME
        while len(data) < need:
            wait = max(0.0, min(TRIAL_POLL_S, deadline - time.monotonic()))
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                if time.monotonic() >= deadline or self.cpu_s() >= cpu:
                    return None
                continue
            chunk = os.read(fd, need - len(data))
            if not chunk:
                return f"the trial compile ended with exit status {proc.wait()}"
            data += chunk
            if len(data) == _FRAME and need == _FRAME:
                need += int.from_bytes(data, "little")
        return data[_FRAME:].decode(errors="replace")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def _serve_trials() -> None:
    """The trial process (python -m engine.grammar): grammars in, the library's verdict out (the
    first line of its error, or nothing), until the worker closes the pipe or dies."""
    import llguidance
    if sys.platform == "linux":
        _bound_trial()
    limits = _limits(llguidance)
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    try:
        sink.write(bytes(_FRAME))               # ready: an empty message
        sink.flush()
        while len(head := source.read(_FRAME)) == _FRAME:
            text = source.read(int.from_bytes(head, "little")).decode()
            try:
                error = llguidance.LLMatcher.validate_grammar(text, None, limits=limits)
            except Exception as e:   # noqa: BLE001 - the verdict is the text
                error = f"{type(e).__name__}: {e}"
            reply = (error.splitlines() or [""])[0].encode()
            sink.write(len(reply).to_bytes(_FRAME, "little") + reply)
            sink.flush()
    except BrokenPipeError:
        return                                  # the worker is gone


def _bound_trial() -> None:
    """The trial process dies with the worker (not left compiling), and its address space is bounded."""
    import ctypes
    import resource
    ctypes.CDLL(None).prctl(1, 9)               # PR_SET_PDEATHSIG, SIGKILL
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = held + TRIAL_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _allows(bits: np.ndarray, token: int) -> bool:
    """Whether a row's mask (int32 words, llguidance's layout) allows a token."""
    return bool(bits.view(np.uint32)[token >> 5] >> np.uint32(token & 31) & 1)


def _forbid(bits: np.ndarray, token: int) -> None:
    """Take a token out of a row's mask, unless it is the only one the mask allows (then the state
    before it is the dead end, and the grammar drops when that token is drawn, as without drafts)."""
    words, w = bits.view(np.uint32), token >> 5
    before = words[w]
    words[w] = before & ~np.uint32(1 << (token & 31))
    if not words.any():
        words[w] = before


@dataclass
class _Row:
    mode: str
    matcher: object | None        # llguidance.LLMatcher; None: the request runs unconstrained
    mask_s: float = 0.0


@dataclass
class _Job:
    """One tenant's compile of a tool set: the requests waiting for it (a request that goes, or stops
    waiting, leaves; a job nobody waits for is dropped before it starts) and its result."""
    key: str
    constraint: Constraint
    tenant: str
    rids: set[str] = field(default_factory=set)
    result: tuple[object | None, str | None] | None = None      # (pristine matcher, note) once done


class Grammars:
    """Tool-call constraints in the engine worker: open() a request's Constraint when it arrives (from
    the cache at once, or compiled off the engine's thread: COMPILE_THREADS threads, one tenant's
    compile on each, tenants in turn), and once settled() it is scheduled; masks() gives the next
    token's mask of every constrained row of a batch, advance() feeds each drawn token to its row,
    close() ends the row. Without llguidance, `off` says why and every request settles at once,
    unconstrained. Notes for the server log collect in `notes`."""

    def __init__(self, folder: str, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.notes: list[tuple[str, str]] = []
        self.rows: dict[str, _Row] = {}
        self.dropped = 0                  # compiles dropped before they started: nobody waited
        self._waiting: dict[str, tuple[str, _Job, float]] = {}       # rid -> (mode, its job, since)
        self._cache: OrderedDict[str, tuple[object | None, str | None]] = OrderedDict()
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # tenant -> its jobs, in turn
        self._jobs: dict[tuple[str, str], _Job] = {}                 # (tenant, key) -> queued or running
        self._compiling: set[str] = set()                            # tenants with a compile running
        self._trials: list[_Trial] = []                              # idle trial processes
        self._cond = threading.Condition()
        try:
            import llguidance
        except ImportError:
            self.off, self.version = "llguidance is not installed (pip install 'mashbox[tools]')", None
            return
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            self.off, self.version = f"{folder} has no tokenizer.json", None
            return
        self.off, self.version = None, f"llguidance {getattr(llguidance, '__version__', '')}".strip()
        self._llg = llguidance
        # The tokenizer's token trie (about a second) is built first, beside the worker's start-up.
        self._tokenizer: Future = Future()
        threading.Thread(target=self._load_tokenizer, args=(folder,), name="grammar-tokenizer",
                         daemon=True).start()
        for i in range(COMPILE_THREADS):
            threading.Thread(target=self._serve, name=f"grammar-{i}", daemon=True).start()
        self._executor = llguidance.LLExecutor()

    def _load_tokenizer(self, folder: str) -> None:
        try:
            stop_ids = Tokenizer.from_folder(folder).stop_ids
            self._tokenizer.set_result(self._llg.LLTokenizer(
                os.path.join(folder, "tokenizer.json"), n_vocab=self.vocab_size, eos_token=stop_ids))
        except BaseException as e:   # noqa: BLE001 - every compile reports it
            self._tokenizer.set_exception(e)

    # -- a request's grammar ---------------------------------------------------------------------

    def open(self, rid: str, c: Constraint, tenant: str = "") -> None:
        """A request's constraint: its row at once from the cache (never behind a compile), else
        its tenant's compile of it, queued or joined."""
        if self.off is not None:
            self.rows[rid] = _Row(c.mode, None)
            return
        key = cache_key(c)
        with self._cond:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.rows[rid] = self._row(c.mode, self._cache[key][0])
                return
            job = self._jobs.get((tenant, key))
            if job is None:
                job = self._jobs[(tenant, key)] = _Job(key, c, tenant)
                self._queues.setdefault(tenant, deque()).append(job)
                self._cond.notify_all()
            job.rids.add(rid)
            self._waiting[rid] = (c.mode, job, time.monotonic())

    @staticmethod
    def _row(mode: str, pristine) -> _Row:
        return _Row(mode, pristine.deep_copy() if pristine is not None else None)

    def settled(self, rid: str) -> bool:
        """Whether the request can be scheduled: its grammar is ready (or failed, or took too long,
        and it runs unconstrained)."""
        if rid in self.rows:
            return True
        mode, job, since = self._waiting[rid]
        with self._cond:
            if job.result is not None:
                (pristine, note), found = job.result, True
            elif job.key in self._cache:        # another tenant's compile of the same tools
                (pristine, _), note, found = self._cache[job.key], None, True
            else:
                found = False
            if not found and time.monotonic() - since < COMPILE_WAIT_S:
                return False
            del self._waiting[rid]
            job.rids.discard(rid)
        if not found:
            pristine, note = None, (f"tool-call grammar not compiled after {COMPILE_WAIT_S:g} s; the request "
                                    "runs unconstrained")
        if note:
            self.notes.append((rid, note))
        self.rows[rid] = self._row(mode, pristine)
        return True

    def wait(self, timeout: float) -> None:
        """Block until some compile finishes (or the timeout): the engine has nothing else to do."""
        with self._cond:
            jobs = [job for _, job, _ in self._waiting.values()]
            if jobs and not any(job.result is not None or job.key in self._cache for job in jobs):
                self._cond.wait(timeout)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # -- the compile threads ---------------------------------------------------------------------

    def _serve(self) -> None:
        """A compile thread: the next tenant's oldest job that someone waits for, compiled."""
        while True:
            job = self._next_job()
            result = self._compiled(job.constraint)
            with self._cond:
                job.result = result
                self._compiling.discard(job.tenant)
                del self._jobs[(job.tenant, job.key)]
                self._cond.notify_all()

    def _next_job(self) -> _Job:
        """Tenants take turns (the one served goes to the back), each with one compile at most; jobs
        whose requests all went (or stopped waiting) are dropped."""
        with self._cond:
            while True:
                for tenant in list(self._queues):
                    queue = self._queues[tenant]
                    if tenant in self._compiling:
                        continue
                    while queue and not queue[0].rids:
                        gone = queue.popleft()
                        del self._jobs[(tenant, gone.key)]
                        self.dropped += 1
                    if not queue:
                        del self._queues[tenant]
                        continue
                    self._queues.move_to_end(tenant)
                    self._compiling.add(tenant)
                    return queue.popleft()
                self._cond.wait()

    def _compiled(self, c: Constraint) -> tuple[object | None, str | None]:
        """(pristine matcher, note for the log) for a Constraint, compiled now or from the cache. Never
        raises: what fails leaves the request unconstrained."""
        key = cache_key(c)
        with self._cond:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0], None
        with self._cond:
            trial = self._trials.pop() if self._trials else _Trial()
        try:
            result = self._compile(c, trial)
        except Exception as e:       # noqa: BLE001 - a request runs unconstrained, the worker lives
            result = None, ("tool-call grammar failed; the request runs unconstrained: "
                            f"{type(e).__name__}: {e}")
        with self._cond:
            self._trials.append(trial)
            self._cache[key] = result
            while len(self._cache) > CACHE_GRAMMARS:
                self._cache.popitem(last=False)
        return result

    def _compile(self, c: Constraint, trial: _Trial) -> tuple[object | None, str | None]:
        """Schemas within the bounds and the budget are enforced; a tool whose schema the library
        refuses is constrained by name only, and so is every tool of a set too large or too slow."""
        tok = self._tokenizer.result()
        size = sum(len(json.dumps(s, default=str)) for _, s in c.tools)
        if len(c.tools) > SCHEMA_TOOLS_MAX or size > SCHEMA_BYTES_MAX:
            plain = frozenset(name for name, _ in c.tools)
            note = (f"{len(c.tools)} tools, {size:,} bytes of schemas: calls are constrained by tool "
                    f"name only (at most {SCHEMA_TOOLS_MAX} tools and {SCHEMA_BYTES_MAX:,} bytes)")
        else:
            try:
                trial.ready()
                budget = _Budget(trial.cpu_s() + COMPILE_BUDGET_S, time.monotonic() + COMPILE_WALL_S)
                plain, note = self._screened(c, trial, budget)
            except OSError as e:
                plain = frozenset(name for name, _ in c.tools)
                note = f"tool-call grammar: the schemas go unchecked, so unenforced (only the names): {e}"
        matcher, error = self._matcher(tok, c, plain)
        if error and len(plain) < len(c.tools):     # past what the trial compiles: by the names
            plain = frozenset(name for name, _ in c.tools)
            note = f"tool-call grammar: the schemas are not enforced (only the names): {error[:300]}"
            matcher, error = self._matcher(tok, c, plain)
        if error:
            matcher, note = None, f"tool-call grammar failed; the request runs unconstrained: {error[:300]}"
        return matcher, note

    def _screened(self, c: Constraint, trial: _Trial, budget: _Budget) -> tuple[frozenset[str], str | None]:
        """(the tools constrained by name only, a note) after trial compiles within the budget: the
        whole grammar, and when it fails each tool's schema on its own (in order, while the budget
        lasts; those left are by name)."""
        error = trial.check(lark(c), budget)
        if error == "":
            return frozenset(), None
        tools = [(n, s) for n, s in c.tools if c.mode != "named" or n == c.name]
        names = frozenset(name for name, _ in c.tools)
        if error is None:
            return names, (f"tool-call grammar: the schemas did not compile within {COMPILE_BUDGET_S:g} s of "
                           f"CPU ({COMPILE_WALL_S:g} s in all); calls are constrained by tool name only")
        refused: set[str] = set()
        for i, (name, schema) in enumerate(tools):
            verdict = trial.check(lark(dataclasses.replace(c, tools=[(name, schema)])), budget)
            if verdict is None:
                refused.update(n for n, _ in tools[i:])
                error += f" (past the budget: {len(tools) - i} of the schemas not checked)"
                break
            if verdict:
                refused.add(name)
        plain = frozenset(refused) or names
        return plain, (f"tool-call grammar: the schemas of {', '.join(sorted(refused)) or 'the tool set'} "
                       f"are not enforced (only the names): {error[:300]}")

    def _matcher(self, tok, c: Constraint, plain: frozenset[str]):
        try:
            matcher = self._llg.LLMatcher(tok, self._llg.LLMatcher.grammar_from_lark(lark(c, plain)),
                                          log_level=0, limits=_limits(self._llg))
        except Exception as e:       # noqa: BLE001 - the library's own failures are reported as text
            return None, f"{type(e).__name__}: {e}"
        # The first line says what failed; the rest would quote the schemas into the log.
        return (None, matcher.get_error().splitlines()[0]) if matcher.is_error() else (matcher, None)

    # -- the rows ----------------------------------------------------------------------------------

    def constrained(self, rid: str | None) -> bool:
        row = self.rows.get(rid) if rid is not None else None
        return row is not None and row.matcher is not None

    def masks(self, rids: list[str | None]) -> np.ndarray | None:
        """The allowed tokens of a batch's next draw, one bit per token ([rows, words] int32; a row
        with no constraint allows every token), or None when no row is constrained."""
        rows = [(i, self.rows[rid]) for i, rid in enumerate(rids) if self.constrained(rid)]
        if not rows:
            return None
        bits = np.full((len(rids), self.words), -1, np.int32)
        t0 = time.perf_counter()
        if len(rows) == 1:
            i, row = rows[0]
            row.matcher.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)
        else:
            self._executor.unsafe_compute_mask_ptr([(row.matcher, i) for i, row in rows], bits.ctypes.data,
                                                   self.words * 4, len(rids))
        spent = (time.perf_counter() - t0) / len(rows)
        for i, row in rows:
            row.mask_s += spent
            if row.matcher.is_error() or not bits[i].any():
                self._drop(rids[i], row, row.matcher.get_error() or "no token is allowed")
                bits[i] = -1
        return bits

    def masks_ahead(self, rids: list[str | None], drafts: list[list[int]], t: int
                    ) -> tuple[np.ndarray, list[list[int]]]:
        """The masks of a decode step whose rows carry drafts (engine.speculative): [rows, t, words]
        int32, position i's mask given the row's first i drafted tokens, and each draft cut before
        its first token that its position's mask refuses (the sampler could not draw it there) or
        after which no token may follow (a dead end the library sees only once there: that token
        leaves its position's mask). A row's draft runs on a copy of its matcher, so the row's own
        advances by the drawn tokens only (advance()), as without drafts, whatever a draft holds. A
        row with no constraint, and positions past a row's draft, allow every token."""
        bits = np.full((len(rids), t, self.words), -1, np.int32)
        drafts = [list(d) for d in drafts]
        first = self.masks(rids)
        if first is None:
            return bits, drafts
        bits[:, 0] = first
        for i, rid in enumerate(rids):
            if self.constrained(rid) and drafts[i]:
                row = self.rows[rid]
                t0 = time.perf_counter()
                drafts[i] = self._ahead(row.matcher.deep_copy(), drafts[i], bits[i])
                row.mask_s += time.perf_counter() - t0
        return bits, drafts

    def _ahead(self, matcher, draft: list[int], bits: np.ndarray) -> list[int]:
        """One row's masks after each drafted token (bits[1:], bits[0] given), on a matcher of its
        own; the draft as far as the sampler could draw it."""
        for k, token in enumerate(draft):
            drawable = 0 <= token < self.vocab_size and _allows(bits[k], token)
            if not drawable or not matcher.consume_token(token):
                return draft[:k]
            mask = bits[k + 1]
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if matcher.is_error():              # nothing may follow the token: never draw it here
                _forbid(bits[k], token)
                return draft[:k]
        return draft

    def advance(self, rid: str, token: int) -> None:
        """The token drawn for a row (the mask allowed it); a stop id ends the grammar's answer."""
        row = self.rows.get(rid)
        if row is not None and row.matcher is not None and not row.matcher.consume_token(token):
            self._drop(rid, row, row.matcher.get_error())

    def _drop(self, rid: str, row: _Row, why: str) -> None:
        self.notes.append((rid, f"tool-call grammar dropped; the rest runs unconstrained: {why[:300]}"))
        row.matcher = None

    def close(self, rid: str) -> tuple[str | None, float]:
        """End a request's row: (the mode it ran constrained under, or None; its mask time in ms). A
        request that goes while its grammar is queued leaves the compile (dropped if nobody else waits)."""
        with self._cond:
            waiting = self._waiting.pop(rid, None)
            if waiting is not None:
                waiting[1].rids.discard(rid)
        row = self.rows.pop(rid, None)
        if row is None:
            return None, 0.0
        return (row.mode if row.matcher is not None else None), round(row.mask_s * 1000, 3)


if __name__ == "__main__":
    _serve_trials()
