"""Tool-call grammars: which tokens may come next, so that every call the model starts is a real call
that names one of the request's tools with arguments valid for that tool's JSON schema.

    lark(constraint, plain)      a Constraint (engine.protocol) as a grammar in llguidance's Lark
                                 dialect: the call forms engine.chat renders and reads, each tool's
                                 arguments as its JSON schema (`plain` tools: any JSON object)
    Grammars(folder, vocab)      the worker's side: grammars compiled off the engine's thread and kept
                                 per tool set, one matcher per constrained request, the rows' masks

The masks come from llguidance (an optional extra: pip install 'mashbox[tools]'); without it every
request runs unconstrained and the output parser reads whatever the model wrote, as before.

The modes (engine.chat.tool_constraint picks one):
  auto      lazy: the model writes freely until it starts a call in one of the forms small Qwen models
            write calls in: <tool_call>, a ```json (or bare ```) fence whose object opens with "name",
            such an object at the very start of the answer or right after another call, or
            <function=. From there the call must
            name an offered tool and give arguments valid for its schema; after it, text again. Text
            that is not a call (a ```python block, JSON that does not open with "name") stays text.
  required  the prompt opened the call already (chat.answer_prefix): its name and arguments, then
            more calls or the end, no text
  named     the prompt opened the call up to its arguments: those, then the end
  none      text only: no <tool_call> token
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from engine.chat import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, XML_OPEN, Tokenizer
from engine.protocol import Constraint

# ---- the grammar -----------------------------------------------------------------------------------

# Whitespace a call may hold between its tokens (bounded: a model that would rather write text than
# go on with the call must not fill the answer with blanks), the gap between calls (and before the end
# where no text may follow them), and free text (anything; special tokens are not text, so
# <|im_start|> and the like cannot appear in it).
WHITESPACE_RUN = 40
_TERMINALS = rf"""WS: /[ \t\r\n]{{0,{WHITESPACE_RUN}}}/
GAP: /\n{{0,2}}/
TEXT: /(.|\n)*/
"""
# The opening of a Hermes call object, up to the quote that opens its name, as the triggers match it.
_OPENING = r'\{[ \t\r\n]*"name"[ \t\r\n]*:[ \t\r\n]*"'
# The lazy triggers of "auto": each matches as little as it can, so it ends at the first place the
# text opens a call in that form, and the call's grammar takes over from there.
_TRIGGERS = rf"""fenced_head[lazy]: TEXT /```(json)?[ \t]*\r?\n?[ \t]*{_OPENING}/
bare_head[lazy]: /[ \t\r\n]*{_OPENING}/
xml_head[lazy]: TEXT "<function="
"""
# A string parameter's value in the XML form: its text, up to the closing tag.
_XML_STRING = r"""xml_string[lazy]: /(.|\n)*<\/parameter>/
"""


def _literal(text: str) -> str:
    """A Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(text)


def _json_name(name: str) -> str:
    """A tool name as it appears between the quotes of a JSON string."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def _schema(schema: dict) -> str:
    """A tool's arguments schema for %json: keywords the library does not implement are ignored
    rather than refused (lenient), and whitespace runs are bounded as WS is."""
    options = {"lenient": True, "whitespace_pattern": f"[ \\t\\r\\n]{{0,{WHITESPACE_RUN}}}"}
    return json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


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


# Schema keywords that say nothing about a value: a string parameter with only these takes any text.
_ANNOTATIONS = frozenset({"type", "description", "title", "default", "examples", "$comment", "deprecated"})
# The keywords of an arguments schema whose XML form (one parameter per property) can be held to it.
_XML_ROOT = frozenset({"type", "properties", "required", "additionalProperties", "description", "title"})
# A string enum longer than this gets no XML form (the JSON form takes it as one lexeme; as raw-text
# alternatives a huge enum would cost the compile seconds).
XML_ENUM_MAX = 64


def _xml_value(spec: dict) -> str | None:
    """An XML parameter's value and its </parameter>, as engine.chat reads it back: raw text for a
    string (one newline on either side is layout), JSON for other types. None where raw text could
    not be held to the schema (a string with a pattern or a length, a $ref)."""
    if "$ref" in json.dumps(spec):
        return None
    if not _is_string(spec):
        return f'WS %json {_schema(spec)} WS "</parameter>"'
    if set(spec) <= _ANNOTATIONS:
        return "xml_string"
    values = spec.get("enum", [spec.get("const")])
    if set(spec) <= _ANNOTATIONS | {"enum", "const"} and isinstance(values, list) and \
            0 < len(values) <= XML_ENUM_MAX and all(isinstance(v, str) and v.strip("\n") == v for v in values):
        return f'"\\n"? ({" | ".join(_literal(v) for v in values)}) "\\n"? "</parameter>"'
    return None


def _xml_rules(i: int, name: str, schema: dict) -> list[str] | None:
    """The XML form of tool i: <function=NAME>, its parameters in the schema's order (the required
    ones always, the others optional), </function>. None where it cannot be held to the schema."""
    props, required = _properties(schema), schema.get("required", [])
    values = {param: _xml_value(spec) for param, spec in props.items()}
    if not set(schema) <= _XML_ROOT or not isinstance(required, list) or not set(required) <= set(props) \
            or None in values.values():
        return None
    rules, parts = [], []
    for j, (param, value) in enumerate(values.items()):
        rules.append(f"x{i}_{j}: {_literal(f'<parameter={param}>')} {value} WS")
        parts.append(f"x{i}_{j}" if param in required else f"x{i}_{j}?")
    return [f'x{i}: {_literal(name + ">")} WS {" ".join(parts)} "</function>"', *rules]


def _tool_rules(tools: list[tuple[str, dict]], plain: frozenset[str]) -> tuple[list[str], bool]:
    """(rules, whether any tool has an XML form). hermes: the rest of a Hermes call after the quote
    that opens its name; xml: the rest of an XML call after `<function=`. One alternative per tool;
    `plain` tools share one that takes any JSON object as arguments and any parameters."""
    rules, hermes, xml = [], [], []
    arguments = r'"\"" WS "," WS "\"arguments\"" WS ":" WS'
    for i, (name, schema) in enumerate(tools):
        if name in plain:
            continue
        hermes.append(f"h{i}")
        rules.append(f'h{i}: {_literal(_json_name(name))} {arguments} a{i} WS "}}"')
        rules.append(f"a{i}: %json {_schema(schema)}")
        form = _xml_rules(i, name, schema)
        if form is not None:
            xml.append(f"x{i}")
            rules += form
    if any(name in plain for name, _ in tools):
        names = sorted({name for name, _ in tools if name in plain})
        rules.append("PLAIN_NAME: " + " | ".join(_literal(_json_name(n)) for n in names))
        rules.append("PLAIN_TAG: " + " | ".join(_literal(n + ">") for n in names))
        rules.append('any_object: %json {"type": "object"}')
        rules.append(f'h_plain: PLAIN_NAME {arguments} any_object WS "}}"')
        rules.append(r'x_plain: PLAIN_TAG WS ("<parameter=" /[^>\n]+/ ">" xml_string WS)* "</function>"')
        hermes.append("h_plain")
        xml.append("x_plain")
    heads = [f"hermes: {' | '.join(hermes)}"] + ([f"xml: {' | '.join(xml)}"] if xml else [])
    return heads + rules, bool(xml)


def lark(c: Constraint, plain: frozenset[str] = frozenset()) -> str:
    """The grammar of what the answer may be, from where the prompt leaves off (after
    chat.answer_prefix). `plain`: tools whose schema is not enforced (only their name)."""
    think = f"think: {THINK_OPEN} TEXT {THINK_CLOSE}\n" if c.think == "may_open" else ""
    start = "think? " if c.think == "may_open" else ""
    if c.mode == "none":
        return f"%llguidance {{}}\nstart: {start}TEXT\n{think}{_TERMINALS}"
    tools = [(name, schema) for name, schema in c.tools]
    if c.mode == "named":
        tools = [t for t in tools if t[0] == c.name]
    rules, xml = _tool_rules(tools, plain)
    forms = ['"{" WS "\\"name\\"" WS ":" WS "\\"" hermes'] + ([f"{_literal(XML_OPEN)} xml"] if xml else [])
    call = f"{CALL_OPEN} WS ({' | '.join(forms)}) WS {CALL_CLOSE}"
    if c.mode == "auto":
        # A bare object opens a call only where engine.chat reads one: at the start, or right after
        # another call.
        head = (f"start: {start}bare* ((tagged | fenced{' | xml_bare' if xml else ''}) bare*)* TEXT\n{think}"
                f"tagged: TEXT {call}\n"
                'fenced: fenced_head hermes WS "```"\n'
                "bare: bare_head hermes\n"
                + ("xml_bare: xml_head xml\n" if xml else "") + _TRIGGERS)
    elif c.mode == "required":
        head = f"start: hermes WS {CALL_CLOSE} (GAP {call})* GAP\n"
    elif c.mode == "named":
        head = f'start: {"any_object" if c.name in plain else "a0"} WS "}}" WS {CALL_CLOSE} GAP\n'
    else:
        raise ValueError(f"unknown constraint mode {c.mode!r}")
    return "\n".join(["%llguidance {}", head.rstrip("\n"), _TERMINALS.rstrip("\n"), _XML_STRING.rstrip("\n"),
                      *rules]) + "\n"


# ---- the worker's side -----------------------------------------------------------------------------

# Compiled grammars kept, per tool set (agents send the same tools with every request): the least
# recently used go first.
CACHE_GRAMMARS = 32
# A request waits this long for its grammar to compile, then runs unconstrained; the compile goes on
# and the next request with the same tools finds it ready. Real agents' tool sets compile in
# milliseconds (docs/tool-calls.md); a hostile one can take seconds and must not hold a slot.
COMPILE_WAIT_S = 2.0
# Past either bound every tool is constrained by its name only (arguments: any JSON object): a
# thousand small schemas take about half a second to compile, ten thousand exceed the library's limits.
SCHEMA_TOOLS_MAX = 512
SCHEMA_BYTES_MAX = 1 << 20


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token mask: a bit per token."""
    return (vocab_size + 31) // 32


def cache_key(c: Constraint) -> str:
    """The compiled grammar's key: everything lark() reads."""
    text = json.dumps([c.mode, c.name, c.think, c.tools], ensure_ascii=False, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class _Row:
    mode: str
    matcher: object | None        # llguidance.LLMatcher; None: the request runs unconstrained
    mask_s: float = 0.0


class Grammars:
    """Tool-call constraints in the engine worker: open() a request's Constraint when it arrives (the
    grammar compiles on a thread of its own, or comes from the cache), and once settled() it is
    scheduled; masks() gives the next token's mask of every constrained row of a batch, advance()
    feeds each drawn token to its row, close() ends the row. Without llguidance, `off` says why and
    every request settles at once, unconstrained. Notes for the server log collect in `notes`."""

    def __init__(self, folder: str, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.notes: list[tuple[str, str]] = []
        self.rows: dict[str, _Row] = {}
        self._jobs: dict[str, tuple[Constraint, Future, float]] = {}
        self._cache: OrderedDict[str, tuple[object | None, str | None]] = OrderedDict()
        self._lock = threading.Lock()
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
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # The tokenizer's token trie (about a second) is built first, beside the worker's start-up.
        self._tokenizer = self._pool.submit(self._load_tokenizer, folder)
        self._executor = llguidance.LLExecutor()

    def _load_tokenizer(self, folder: str):
        stop_ids = Tokenizer.from_folder(folder).stop_ids
        return self._llg.LLTokenizer(os.path.join(folder, "tokenizer.json"), n_vocab=self.vocab_size,
                                     eos_token=stop_ids)

    # -- a request's grammar ---------------------------------------------------------------------

    def open(self, rid: str, c: Constraint) -> None:
        if self.off is not None:
            self.rows[rid] = _Row(c.mode, None)
            return
        self._jobs[rid] = (c, self._pool.submit(self._compiled, c), time.monotonic())

    def settled(self, rid: str) -> bool:
        """Whether the request can be scheduled: its grammar is ready (or failed, or took too long,
        and it runs unconstrained)."""
        if rid in self.rows:
            return True
        c, job, since = self._jobs[rid]
        if job.done():
            matcher, note = job.result()
        elif time.monotonic() - since >= COMPILE_WAIT_S:
            matcher, note = None, (f"tool-call grammar not compiled after {COMPILE_WAIT_S:g} s; the "
                                   "request runs unconstrained (the compile goes on for the next one)")
        else:
            return False
        del self._jobs[rid]
        if note:
            self.notes.append((rid, note))
        self.rows[rid] = _Row(c.mode, matcher.deep_copy() if matcher is not None else None)
        return True

    def wait(self, timeout: float) -> None:
        """Block until some compile finishes (or the timeout): the engine has nothing else to do."""
        jobs = [job for _, job, _ in self._jobs.values()]
        if jobs:
            wait(jobs, timeout=timeout, return_when=FIRST_COMPLETED)

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    def _compiled(self, c: Constraint) -> tuple[object | None, str | None]:
        """(pristine matcher, note for the log) for a Constraint, compiled now or from the cache. Runs
        on the grammar thread, and never raises: what fails leaves the request unconstrained."""
        try:
            return self._compile(c)
        except Exception as e:       # noqa: BLE001 - a request runs unconstrained, the worker lives
            return None, f"tool-call grammar failed; the request runs unconstrained: {type(e).__name__}: {e}"

    def _compile(self, c: Constraint) -> tuple[object | None, str | None]:
        """A tool whose schema the library refuses is constrained by name only; so is every tool of a
        set too large to compile schema by schema."""
        key = cache_key(c)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0], None
        tok = self._tokenizer.result()
        names = [name for name, _ in c.tools]
        size = sum(len(json.dumps(s, default=str)) for _, s in c.tools)
        plain: frozenset[str] = frozenset()
        if len(c.tools) > SCHEMA_TOOLS_MAX or size > SCHEMA_BYTES_MAX:
            plain = frozenset(names)
            note = (f"{len(c.tools)} tools, {size:,} bytes of schemas: calls are constrained by tool "
                    f"name only (at most {SCHEMA_TOOLS_MAX} tools and {SCHEMA_BYTES_MAX:,} bytes)")
        else:
            note = None
        matcher, error = self._matcher(tok, c, plain)
        if error and not plain:
            refused = frozenset(name for name, schema in c.tools if self._refused(tok, schema))
            plain = refused or frozenset(names)
            note = (f"tool-call grammar: the schemas of {', '.join(sorted(refused)) or 'the tool set'} "
                    f"are not enforced (only the names): {error[:300]}")
            matcher, error = self._matcher(tok, c, plain)
        if error:
            matcher, note = None, f"tool-call grammar failed; the request runs unconstrained: {error[:300]}"
        with self._lock:
            self._cache[key] = (matcher, note)
            while len(self._cache) > CACHE_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher, note

    def _matcher(self, tok, c: Constraint, plain: frozenset[str]):
        try:
            matcher = self._llg.LLMatcher(tok, self._llg.LLMatcher.grammar_from_lark(lark(c, plain)),
                                          log_level=0, limits=self._limits())
        except Exception as e:       # noqa: BLE001 - the library's own failures are reported as text
            return None, f"{type(e).__name__}: {e}"
        # The first line says what failed; the rest would quote the schemas into the log.
        return (None, matcher.get_error().splitlines()[0]) if matcher.is_error() else (matcher, None)

    def _limits(self):
        """The library's default bounds on a grammar's size and each step's work, with short errors."""
        return self._llg.LLParserLimits(verbose_errors=False)

    def _refused(self, tok, schema: dict) -> bool:
        """Whether the library refuses one tool's arguments schema on its own."""
        try:
            grammar = self._llg.LLMatcher.grammar_from_lark(f"start: %json {_schema(schema)}\n")
            return bool(self._llg.LLMatcher.validate_grammar(grammar, tok, limits=self._limits()))
        except Exception:            # noqa: BLE001
            return True

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
        int32, position i's mask given the row's first i drafted tokens, and the drafts cut where
        the grammar refuses a token (the sampler could not draw it there). A row with no
        constraint, and positions past a row's draft, allow every token. Each matcher consumes the
        draft to compute the masks and rolls it back: advance() feeds the tokens drawn."""
        bits = np.full((len(rids), t, self.words), -1, np.int32)
        drafts = [list(d) for d in drafts]
        first = self.masks(rids)
        if first is None:
            return bits, drafts
        bits[:, 0] = first
        t0 = time.perf_counter()
        for i, rid in enumerate(rids):
            if not self.constrained(rid) or not drafts[i]:
                continue
            row = self.rows[rid]
            matcher = row.matcher
            draft = drafts[i][:matcher.validate_tokens(drafts[i])]
            consumed = 0
            for token in draft:
                if not matcher.consume_token(token):
                    break
                consumed += 1
                mask = bits[i, consumed]
                matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            matcher.rollback(consumed)
            drafts[i] = draft[:consumed]
            row.mask_s += time.perf_counter() - t0
            t0 = time.perf_counter()
        return bits, drafts

    def advance(self, rid: str, token: int) -> None:
        """The token drawn for a row (the mask allowed it); a stop id ends the grammar's answer."""
        row = self.rows.get(rid)
        if row is not None and row.matcher is not None and not row.matcher.consume_token(token):
            self._drop(rid, row, row.matcher.get_error())

    def _drop(self, rid: str, row: _Row, why: str) -> None:
        self.notes.append((rid, f"tool-call grammar dropped; the rest runs unconstrained: {why[:300]}"))
        row.matcher = None

    def close(self, rid: str) -> tuple[str | None, float]:
        """End a request's row: (the mode it ran constrained under, or None; its mask time in ms)."""
        self._jobs.pop(rid, None)
        row = self.rows.pop(rid, None)
        if row is None:
            return None, 0.0
        return (row.mode if row.matcher is not None else None), round(row.mask_s * 1000, 3)
