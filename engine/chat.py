"""Text side of the engine: the tokenizer, the chat templates, and the output parser.

The one place that knows what a prompt looks like and what the model's output means:
    Job                  one request of any API, parsed into native types (mashbox.py's parse_*)
    Tokenizer            tokenizer.json: encode, decode, stop ids, each token's bytes
    render(job, tok, fmt)  Job -> prompt token ids (the chat template, hand-written Python);
                         render_runs the same prompt as text runs between the template's control
                         tokens, render_text as one string, answer_prefix its answer opening
    OutputParser         generated token ids -> neutral events (text, reasoning, tool calls, done)
    tool_constraint(job, fmt)  what the answer's tool calls must be (engine.grammar masks the tokens)
Every API's encoder in mashbox.py turns those events into its own JSON or SSE; a fix to tool-call
or thinking handling is made here once for all four APIs.
"""
from __future__ import annotations

import codecs
import json
import os
import re
import secrets
from dataclasses import dataclass, field

from engine.protocol import Constraint, Sampling


# ---- the request model, shared by every API ----------------------------------------------------

@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str                # JSON text, exactly as the model (or the client) wrote it


@dataclass
class Message:
    role: str                     # "system", "user", "assistant", "tool"
    content: str = ""             # text (parts already joined)
    reasoning: str | None = None  # assistant: earlier thinking (reasoning_content / thinking blocks)
    tool_calls: list[ToolCall] = field(default_factory=list)   # assistant
    tool_call_id: str | None = None                            # tool: the call it answers
    name: str | None = None       # tool: the tool's name, when known


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    kind: str = "function"        # "function" | "custom" (Responses freeform tools: one string input)
    namespace: str | None = None  # Responses namespace tool this function belongs to


@dataclass
class Job:
    """One generation request, whatever API it came through."""
    messages: list[Message] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | dict = "auto"  # "auto" | "none" | "required" | {"name": NAME}
    thinking: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None     # None = up to the end of the context; clamped, never refused
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False       # Chat: stream_options.include_usage
    model: str | None = None          # the request's model field, echoed where an API does
    session: str | None = None        # X-Session-Id / prompt_cache_key, for the log only
    prompt: str | None = None         # Completions: raw text, no template
    # Keep the reasoning of every earlier assistant turn in the prompt; None: the format's default
    # (Qwen3.8 keeps it, the others drop it before the last user query)
    preserve_thinking: bool | None = None
    effort: str | None = None         # the reasoning effort the request named (Qwen3.8's tiers)
    # Tools the model may call that the prompt's tool list leaves out (Messages: deferred tools that
    # a tool search showed it in the conversation)
    extra_tools: list[Tool] = field(default_factory=list)


# ---- neutral output events ----------------------------------------------------------------------

@dataclass
class TextDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int                    # 0, 1, ... within this answer
    id: str                       # "call_..." (encoders may re-prefix, e.g. toolu_)
    name: str


@dataclass
class ToolCallArgs:
    index: int
    delta: str                    # the next piece of the arguments' JSON text


@dataclass
class ToolCallEnd:
    """A call the model finished writing. A call cut off (max_tokens, or the answer's end inside it)
    gets none: it started, but it is not a call its tool can run, and the encoders report it as the
    APIs report a truncated answer."""
    index: int
    arguments: str                # the whole arguments JSON text ("{}" when none)


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass
class Done:
    finish_reason: str            # "stop" | "length" | "tool_calls" | "abort"
    usage: Usage = field(default_factory=Usage)
    stop_sequence: str | None = None   # the stop string that ended the text, if one did
    timings: dict | None = None        # ChatTimings fields


def new_id(prefix: str) -> str:
    """A response or tool-call id: the API's prefix and 24 random hex digits (96 bits never repeat)."""
    return prefix + secrets.token_hex(12)


# ---- the tokenizer --------------------------------------------------------------------------------

# Token strings that end an answer in every Qwen chat model; the worker stops a row on any of them.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _byte_level_alphabet() -> dict[int, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1 bytes as
    themselves, every other byte as the next code point from 256 on. This maps a character's code
    point back to its byte (a str.translate table: token.translate(table).encode("latin-1"))."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = b
        else:
            alphabet[256 + shifted] = b
            shifted += 1
    return alphabet


class Tokenizer:
    """The model's tokenizer.json (through the `tokenizers` package) and what the server needs of it:
    the ids that end an answer, and each token's raw bytes for streaming detokenization."""

    def __init__(self, inner, eos_token: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        self._tok = inner
        # The same model, normalizer and pre-tokenizer with no added tokens: text that writes
        # <|im_start|> or <think> is tokenized as the characters it is. It shares the model (no copy;
        # built in microseconds), and gives what `inner` gives for text without added tokens.
        self._plain = HFTokenizer(inner.model)
        if inner.normalizer is not None:
            self._plain.normalizer = inner.normalizer
        if inner.pre_tokenizer is not None:
            self._plain.pre_tokenizer = inner.pre_tokenizer
        # Control strings that are one token here (Qwen2.5 has no <think> or <tool_response>: those
        # it reads as text, in the template too).
        self._added: dict[str, int] = {t.content: i for i, t in inner.get_added_tokens_decoder().items()}
        self.vocab_size: int = inner.get_vocab_size(with_added_tokens=True)
        self.stop_ids: list[int] = []
        for name in (*STOP_TOKENS, eos_token):
            token_id = self.id_of(name) if name else None
            if token_id is not None and token_id not in self.stop_ids:
                self.stop_ids.append(token_id)
        self._bytes: list[bytes] | None = None     # built on first use (151k entries, ~0.1 s)
        self._max_token_bytes: int | None = None

    @classmethod
    def from_folder(cls, folder: str) -> "Tokenizer":
        """A Hugging Face model folder: tokenizer.json, and tokenizer_config.json for the eos token."""
        from tokenizers import Tokenizer as HFTokenizer
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{folder}: no tokenizer.json")
        config: dict = {}
        config_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        return cls(HFTokenizer.from_file(path), eos if isinstance(eos, str) else None)

    def encode(self, text: str) -> list[int]:
        """Text -> ids; special tokens written in the text (<|im_start|>, <think>) become their ids.
        For short pieces of the server's own (tests, turn_boundaries); prompts go through
        encode_prompt, which keeps the client's text text."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, prompt: "PromptText") -> list[int]:
        """A rendered prompt -> ids: each run of text as text (whatever control strings the client
        wrote in it), each of the template's control tokens as its id. Added tokens split a text
        before anything else reads it, so a prompt whose client text writes none gets exactly the ids
        of encoding it whole. A Completions prompt (raw) is encoded whole, its control strings as
        tokens. encode_batch, not encode: it lets go of the GIL for the whole call (encode holds it
        throughout), with the same ids. One run a call: a batch of several is spread over every core,
        which took the CPU from the event loop's thread (on 2 cores, 67 ms pauses against 6)."""
        if prompt.raw:
            return self._tok.encode_batch(prompt.runs, add_special_tokens=False)[0].ids
        runs, between, run = [], [], [prompt.runs[0]]
        for control, text in zip(prompt.controls, prompt.runs[1:]):
            token = self._added.get(control)
            if token is None:          # not a token in this vocabulary: text, as it always was
                run += [control, text]
            else:
                runs.append("".join(run))
                between.append(token)
                run = [text]
        runs.append("".join(run))
        ids = self._plain.encode_batch(runs[:1], add_special_tokens=False)[0].ids
        for token, text in zip(between, runs[1:]):
            ids.append(token)
            ids += self._plain.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for (128 for Qwen's vocabulary). A text of N characters is
        at least N / max_token_bytes tokens, so a prompt that cannot fit a context is known as such
        before any of it is tokenized."""
        if self._max_token_bytes is None:
            if self._bytes is None:
                self._bytes = self._byte_table()
            self._max_token_bytes = max(1, max(map(len, self._bytes)))
        return self._max_token_bytes

    def id_of(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for; a token may end inside a UTF-8 character. Ids past the
        tokenizer's vocabulary (the model's embedding is padded) stand for nothing."""
        if self._bytes is None:
            self._bytes = self._byte_table()
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def _byte_table(self) -> list[bytes]:
        from tokenizers import decoders
        table = [b""] * self.vocab_size
        added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        alphabet = _byte_level_alphabet()
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i >= len(table):
                continue
            if i in added:
                table[i] = added[i].encode()
            elif byte_level:
                table[i] = token.translate(alphabet).encode("latin-1", "replace")
            else:   # not byte-level: whole characters only (no Qwen tokenizer takes this path)
                table[i] = self._tok.decode([i]).encode()
        return table


# ---- chat formats (hand-written; token for token what the models' official templates render) ------
#
# One class per family's format (FORMATS, by the name models.json, a folder's config or a GGUF's
# template picks): how a conversation is written, how the answer opens, how its calls look. Each is
# tested token for token against its official Jinja template (tests/test_chat_template.py).

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# The control tokens the templates write. Only the template's own are tokens: the same strings in
# the client's text (messages, tool results, tool definitions, call arguments) are tokenized as text,
# so a message cannot open a turn, a call or a thought of its own.
CONTROL_TOKENS = (IM_START, IM_END, THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN,
                  RESPONSE_CLOSE)
_CONTROL = re.compile("(" + "|".join(map(re.escape, CONTROL_TOKENS)) + ")")
# Thinking off: the answer starts with an empty thought, as the models were trained to see it.
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"
# The start of a Hermes-style call, as the templates write calls in history; tool_choice forces it.
CALL_HEAD = '<tool_call>\n{"name": "'
# The start of an XML call (Qwen3.5 and Qwen3-Coder): its tool's name follows, then ">\n".
XML_CALL_HEAD = "<tool_call>\n<function="
# Small models also write a call without the tags: the same object in a ```json (or bare ```) fence,
# and Qwen3-Coder its XML form with no <tool_call> before it. Both are read as calls when they name an
# offered tool, and engine.grammar constrains them from where they open.
FENCE = "```"
FENCE_HEAD = re.compile(r"```(?:json)?[ \t]*\r?\n?[ \t]*")
XML_OPEN = "<function="


class TemplateError(ValueError):
    """A conversation the model's official template refuses to render (it raises): the server
    answers 400 with this message, naming the conversation's field."""


def tojson(value) -> str:
    """JSON exactly as the templates' `tojson` writes it: ", " and ": " separators, key order kept,
    non-ASCII characters as themselves."""
    return json.dumps(value, ensure_ascii=False)


def arguments_text(value) -> str:
    """A call's arguments as JSON text: a string is already JSON text, an object is serialized as the
    template would. API parsers use this so history renders the same whichever way a client sent it."""
    return value if isinstance(value, str) else tojson(value)


def _tool_json(tool: Tool) -> str:
    function = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return tojson({"type": "function", "function": function})


def offered_tools(job: Job) -> list[Tool]:
    """The tools written into the prompt: none when tool_choice is "none"."""
    return [] if job.tool_choice == "none" else job.tools


def callable_tools(job: Job) -> list[Tool]:
    """The tools a call may name: those offered, and those the conversation showed the model."""
    return [] if job.tool_choice == "none" else job.tools + job.extra_tools


def _is_forced(job: Job) -> bool:
    return bool(job.tools) and job.tool_choice not in ("auto", "none")


@dataclass
class PromptText:
    """A rendered prompt: runs of text with the template's own control tokens between them (runs[0],
    controls[0], runs[1], ..., runs[-1]). A run is tokenized as text whatever it holds (the client's
    text among the template's words); a control is its token. A Completions prompt is one run with
    `raw` set: there the client writes the template, so its control strings are tokens."""
    runs: list[str]
    controls: list[str] = field(default_factory=list)
    raw: bool = False

    @property
    def text(self) -> str:
        return "".join(p for pair in zip(self.runs, self.controls + [""]) for p in pair)

    @property
    def chars(self) -> int:
        return sum(map(len, self.runs)) + sum(map(len, self.controls))


class _Writer:
    """Builds a PromptText: template() for the template's own text, where a control string is its
    control token; client() for what the request holds, which is text whatever it writes."""

    def __init__(self):
        self.runs: list[str] = []
        self.controls: list[str] = []
        self._run: list[str] = []      # the open run's parts, joined once when it ends

    def template(self, *parts: str) -> None:
        for part in parts:
            for k, piece in enumerate(_CONTROL.split(part)):
                if k % 2:
                    self.runs.append("".join(self._run))
                    self.controls.append(piece)
                    self._run = []
                elif piece:
                    self._run.append(piece)

    def client(self, text: str) -> None:
        self._run.append(text)

    def done(self) -> PromptText:
        return PromptText(self.runs + ["".join(self._run)], self.controls)


def _is_tool_response(text: str) -> bool:
    return text.startswith(RESPONSE_OPEN) and text.endswith(RESPONSE_CLOSE)


def _last_query(messages: list[Message], strip: bool = False) -> int | None:
    """The index of the last real user query (a user turn that is not a pasted tool response), where
    the templates' current tool-use loop begins; None when there is none."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "user" and not _is_tool_response(m.content.strip() if strip else m.content):
            return i
    return None


def _split_thought(message: Message) -> tuple[str, str]:
    """(reasoning, content) of an assistant turn: its reasoning field, or a <think> block written
    into its content. The split reads the client's text, as the official templates do; what it
    gives back is text again, between <think> and </think> tokens that the template writes."""
    content = message.content
    if message.reasoning is not None:
        return message.reasoning, content
    if THINK_CLOSE in content:
        before, after = content.split(THINK_CLOSE)[0], content.split(THINK_CLOSE)[-1]
        return before.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n"), after.lstrip("\n")
    return "", content


def _normalized(messages: list[Message]) -> list[Message]:
    """Roles as the templates know them: developer instructions are system instructions."""
    return [Message(**{**m.__dict__, "role": "system"}) if m.role == "developer" else m for m in messages]


def _tool_results(w: _Writer, messages: list[Message], i: int, open_turn: bool, content: str) -> None:
    """A tool result; consecutive results share one user turn (open_turn: this one opens it)."""
    if open_turn:
        w.template(f"{IM_START}user")
    w.template(f"\n{RESPONSE_OPEN}\n")
    w.client(content)
    w.template(f"\n{RESPONSE_CLOSE}")
    if i == len(messages) - 1 or messages[i + 1].role != "tool":
        w.template(f"{IM_END}\n")


class ChatFormat:
    """A family's chat format. render() writes the conversation (turns), the assistant's opening and
    the answer's start that the prompt writes itself (opening: an empty or an opened thought, a
    forced call's head). The attributes say what the output parser and the grammar need to know."""
    name = ""
    call_form = "json"        # how its calls are written inside <tool_call>: "json" (Hermes) or "xml"
    thinks = False            # whether requests can turn a thinking mode on
    opens_thought = False     # thinking on: the prompt itself opens the thought ("<think>\n")

    def render(self, job: Job) -> PromptText:
        w = _Writer()
        self.turns(w, _normalized(job.messages), offered_tools(job), job)
        w.template(f"{IM_START}assistant\n")
        self.opening(w, job)
        return w.done()

    def turns(self, w: _Writer, messages: list[Message], tools: list[Tool], job: Job) -> None:
        raise NotImplementedError

    def thought(self, job: Job) -> str:
        """What the prompt writes of the answer's thought: the empty thought when thinking is off
        (or a forced call skips it: the model cannot think once the call has begun), "<think>\\n"
        where the prompt opens it, else nothing."""
        if not self.thinks:
            return ""
        if _is_forced(job) or not job.thinking:
            return EMPTY_THOUGHT
        return f"{THINK_OPEN}\n" if self.opens_thought else ""

    def opening(self, w: _Writer, job: Job) -> None:
        if job.prompt is not None:
            return
        w.template(self.thought(job))
        if not _is_forced(job):
            return
        named = job.tool_choice["name"] if isinstance(job.tool_choice, dict) else None
        if self.call_form == "xml":
            w.template(XML_CALL_HEAD)
            if named is not None:
                w.client(named)
                w.template(">\n")
        else:
            w.template(CALL_HEAD)
            if named is not None:                 # a named tool: the prompt writes its name too
                w.client(named)
                w.template('", "arguments": ')

    def think_state(self, job: Job) -> str:
        """Constraint.think: where the answer's thinking stands when it starts."""
        if not self.thinks or not job.thinking or _is_forced(job):
            return "none"
        return "open" if self.opens_thought else "may_open"

    def constraint(self, job: Job) -> Constraint | None:
        if job.prompt is not None or not job.tools:
            return None
        think, form = self.think_state(job), self.call_form
        if job.tool_choice == "none":
            return Constraint("none", think=think, form=form)
        tools = [(t.name, t.parameters) for t in callable_tools(job)]
        if isinstance(job.tool_choice, dict):
            return Constraint("named", tools, name=job.tool_choice["name"], form=form)
        mode = "required" if job.tool_choice == "required" else "auto"
        return Constraint(mode, tools, think=think, form=form)


# ---- Qwen3 and Qwen2.5: Hermes calls, tools after the system text ----

TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and "
               "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _hermes_call(w: _Writer, call: ToolCall, arguments: str) -> None:
    # The name as a JSON string's inside: what the template writes for every real tool name, and a
    # name from an earlier turn (sent back by the client) cannot close the string.
    w.template(CALL_HEAD)
    w.client(json.dumps(call.name, ensure_ascii=False)[1:-1])
    w.template('", "arguments": ')
    w.client(arguments)
    w.template(f"}}\n{CALL_CLOSE}")


def _system_and_tools(w: _Writer, messages: list[Message], tools: list[Tool],
                      default_system: str | None) -> None:
    """The opening system turn: the first system message (or the default), then the tools block."""
    first = messages[0].content if messages and messages[0].role == "system" else None
    if first is None and default_system is None and not tools:
        return
    w.template(f"{IM_START}system\n")
    if first is not None:
        w.client(first)
    elif default_system is not None:
        w.template(default_system)
    if tools:
        w.template("\n\n" if first is not None or default_system is not None else "", TOOLS_INTRO)
        for tool in tools:
            w.template("\n")
            w.client(_tool_json(tool))
        w.template(TOOLS_OUTRO)
    w.template(f"{IM_END}\n")


class Qwen3(ChatFormat):
    """Qwen3 (dense, MoE, Qwen3-Next): Hermes calls; the model opens its own thought when thinking.
    Prefix stability: an answer re-renders as the model wrote it while it is after the last user
    query (a tool-use loop keeps its reasoning). At a new user query the official template drops
    earlier reasoning, and the empty thought of thinking-off answers, so the prompt changes there;
    preserve_thinking keeps non-empty reasoning and with it the prefix."""
    name, thinks = "qwen3", True

    def turns(self, w, messages, tools, job):
        _system_and_tools(w, messages, tools, None)
        last_query = _last_query(messages)
        last_query = len(messages) - 1 if last_query is None else last_query
        for i, m in enumerate(messages):
            if m.role == "user" or (m.role == "system" and i > 0):
                w.template(f"{IM_START}{m.role}\n")
                w.client(m.content)
                w.template(f"{IM_END}\n")
            elif m.role == "assistant":
                reasoning, content = _split_thought(m)
                keep = (i > last_query or job.preserve_thinking) and (i == len(messages) - 1 or reasoning)
                w.template(f"{IM_START}assistant\n")
                if keep:
                    w.template(f"{THINK_OPEN}\n")
                    w.client(reasoning.strip("\n"))
                    w.template(f"\n{THINK_CLOSE}\n\n")
                    w.client(content.lstrip("\n"))
                else:
                    w.client(content)
                for k, call in enumerate(m.tool_calls):
                    w.template("\n" if k or content else "")
                    _hermes_call(w, call, call.arguments)
                w.template(f"{IM_END}\n")
            elif m.role == "tool":
                _tool_results(w, messages, i, i == 0 or messages[i - 1].role != "tool", m.content)


class Qwen25(ChatFormat):
    """Qwen2.5 (the demo model): a default system prompt, no thinking, Hermes calls whose arguments
    the template serializes with tojson."""
    name = "qwen2.5"
    DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

    @staticmethod
    def arguments(text: str) -> str:
        """JSON text read back into a value first (as servers do before rendering); text that is
        not JSON is written as a JSON string."""
        try:
            return tojson(json.loads(text))
        except (ValueError, RecursionError):
            return tojson(text)

    def turns(self, w, messages, tools, job):
        _system_and_tools(w, messages, tools, self.DEFAULT_SYSTEM)
        for i, m in enumerate(messages):
            if m.role == "user" or (m.role == "system" and i > 0) or (m.role == "assistant" and not m.tool_calls):
                w.template(f"{IM_START}{m.role}\n")
                w.client(m.content)
                w.template(f"{IM_END}\n")
            elif m.role == "assistant":
                w.template(f"{IM_START}assistant")
                if m.content:
                    w.template("\n")
                    w.client(m.content)
                for call in m.tool_calls:
                    w.template("\n")
                    _hermes_call(w, call, self.arguments(call.arguments))
                w.template(f"{IM_END}\n")
            elif m.role == "tool":
                _tool_results(w, messages, i, i == 0 or messages[i - 1].role != "tool", m.content)


# ---- Qwen3.5 / 3.8 and Qwen3-Coder: XML calls ----

QWEN35_TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN35_TOOLS_OUTRO = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can "
    "span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function "
    "calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide "
    "optional reasoning for your function call in natural language BEFORE the function call, but NOT "
    "after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>")
# The system messages of a conversation, joined (the spec: system and developer messages join the
# system prompt; the Qwen3.5 templates refuse a system message anywhere but first).
SYSTEM_JOIN = "\n\n"


def _xml_arguments(text: str) -> dict | str:
    """A call's arguments as the XML templates iterate them: the JSON object read back into a
    mapping (clients send arguments as JSON text); anything else stays the text it is."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _xml_call(w: _Writer, call: ToolCall, head: str, value_text) -> None:
    """<tool_call>, <function=NAME> and one <parameter=P> element per argument, as the XML templates
    write history calls; value_text(value) is how the family writes an argument's value."""
    w.template(head + XML_CALL_HEAD)
    w.client(call.name)
    w.template(">\n")
    arguments = _xml_arguments(call.arguments)
    if isinstance(arguments, dict):
        for name, value in arguments.items():
            w.template("<parameter=")
            w.client(name)
            w.template(">\n")
            w.client(value_text(value))
            w.template("\n</parameter>\n")
    else:        # not a JSON object: its text as the client sent it
        w.client(arguments)
    w.template(f"</function>\n{CALL_CLOSE}")


def _jinja_string(value) -> str:
    """Jinja's `string` filter: Python's str() (True, None, 1.0)."""
    return str(value)


class Qwen35(ChatFormat):
    """Qwen3.5 (and 3.6 where its template is the same): the tools block and the XML call
    instructions first, then the system text; every message's text trimmed; the prompt opens the
    thought when thinking is on. A conversation with no user query is refused, as its template
    raises."""
    name, call_form, thinks, opens_thought = "qwen3.5", "xml", True, True

    def value_text(self, value) -> str:
        return _xml_value(value)

    def system_prefix(self, job: Job) -> str:
        """Text the template writes before the system text (Qwen3.8's reasoning effort)."""
        return ""

    def keeps_thought(self, job: Job) -> bool:
        """Whether turns before the last user query keep their thought block (preserve_thinking)."""
        return False

    def reasoning(self, m: Message, content: str) -> tuple[str, str]:
        if m.reasoning is not None:
            return m.reasoning, content
        return _split_thought(Message("assistant", content))

    def render(self, job: Job) -> PromptText:
        messages = _joined_system(_normalized(job.messages))
        if _last_query(messages, strip=True) is None:
            raise TemplateError("the conversation has no user message: this model's chat template needs "
                                "at least one")
        w = _Writer()
        self.turns(w, messages, offered_tools(job), job)
        w.template(f"{IM_START}assistant\n")
        self.opening(w, job)
        return w.done()

    def head(self, w: _Writer, messages: list[Message], tools: list[Tool], job: Job) -> None:
        system = messages[0].content.strip() if messages and messages[0].role == "system" else None
        before = self.system_prefix(job)
        if tools:
            w.template(f"{IM_START}system\n", before, QWEN35_TOOLS_INTRO)
            for tool in tools:
                w.template("\n")
                w.client(_tool_json(tool))
            w.template(QWEN35_TOOLS_OUTRO)
            if system:
                w.template("\n\n")
                w.client(system)
            w.template(f"{IM_END}\n")
        elif system is not None:
            w.template(f"{IM_START}system\n", before)
            w.client(system)
            w.template(f"{IM_END}\n")

    def turns(self, w, messages, tools, job):
        self.head(w, messages, tools, job)
        last_query = _last_query(messages, strip=True)
        for i, m in enumerate(messages):
            content = m.content.strip()
            if m.role == "user":
                w.template(f"{IM_START}user\n")
                w.client(content)
                w.template(f"{IM_END}\n")
            elif m.role == "assistant":
                self.assistant(w, m, content, i > last_query or self.keeps_thought(job))
            elif m.role == "tool":
                _tool_results(w, messages, i, i > 0 and messages[i - 1].role != "tool", content)

    def assistant(self, w: _Writer, m: Message, content: str, keep: bool) -> None:
        reasoning, content = self.reasoning(m, content)
        w.template(f"{IM_START}assistant\n")
        if keep:
            w.template(f"{THINK_OPEN}\n")
            w.client(reasoning.strip())
            w.template(f"\n{THINK_CLOSE}\n\n")
        w.client(content)
        for k, call in enumerate(m.tool_calls):
            _xml_call(w, call, "\n" if k else ("\n\n" if content.strip() else ""), self.value_text)
        w.template(f"{IM_END}\n")


def _joined_system(messages: list[Message]) -> list[Message]:
    """One system message first, holding every system message's text in order (SYSTEM_JOIN)."""
    system = [m.content.strip() for m in messages if m.role == "system"]
    if not system:
        return messages
    rest = [m for m in messages if m.role != "system"]
    return [Message("system", SYSTEM_JOIN.join(s for s in system if s))] + rest


# Qwen3.8's reasoning tiers (its template's reasoning_effort, default xhigh): what each writes before
# the system text when thinking is on. medium writes nothing.
QWEN38_EFFORT_TEXT = {
    "xhigh": "Reasoning effort is set to xhigh. Please think carefully through the task, validate key "
             "assumptions, consider plausible alternatives, and prioritize correctness, consistency, "
             "and clarity in the final answer.",
    "medium": "",
    "low": "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the "
           "conclusion without unnecessary elaboration.",
}
# The request's effort (any API's name for it) -> Qwen3.8's tier; unnamed and unknown efforts get
# the template's default, xhigh.
QWEN38_EFFORT = {"low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh", "max": "xhigh"}


class Qwen38(Qwen35):
    """Qwen3.8: Qwen3.5's format with reasoning tiers (a line before the system text when thinking
    is on), every earlier thought kept unless a request says preserve_thinking false, reasoning read
    only from the reasoning field, and arguments' non-string values as JSON."""
    name = "qwen3.8"

    def value_text(self, value) -> str:
        return value if isinstance(value, str) else tojson(value)

    def system_prefix(self, job: Job) -> str:
        if not job.thinking or _is_forced(job):
            return ""
        text = QWEN38_EFFORT_TEXT[self.effort(job)]
        return text + "\n\n" if text else ""

    @staticmethod
    def effort(job: Job) -> str:
        return QWEN38_EFFORT.get((job.effort or "").lower(), "xhigh")

    def keeps_thought(self, job: Job) -> bool:
        return job.preserve_thinking is not False

    def reasoning(self, m: Message, content: str) -> tuple[str, str]:
        return m.reasoning or "", content

    def head(self, w, messages, tools, job):
        system = messages[0].content.strip() if messages and messages[0].role == "system" else ""
        effort = self.system_prefix(job).rstrip("\n")
        if tools or system:
            super().head(w, messages, tools, job)
        elif effort:
            w.template(f"{IM_START}system\n{effort}{IM_END}\n")


QWEN3_CODER_DEFAULT_SYSTEM = ("You are Qwen, a helpful AI assistant that can interact with a computer to "
                              "solve tasks.")
QWEN3_CODER_TOOLS_INTRO = "\n\n# Tools\n\nYou have access to the following tools:\n\n<tools>"
QWEN3_CODER_TOOLS_OUTRO = (
    "\n</tools>\n\nIf you choose to call a tool ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nvalue_2\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
    "Reminder:\n- Function calls MUST follow the specified format: the tool calling block MUST begin with an "
    "opening <tool_call> tag and end with a closing </tool_call> tag.\n- Required parameters MUST be "
    "specified\n- You may provide optional reasoning for your function call in natural language BEFORE the "
    "function call, but NOT after\n- If there is no function call available, answer the question like "
    "normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>")


def _xml_value(value) -> str:
    """An XML template's value: JSON for a mapping or a list, else Jinja's `string`."""
    return tojson(value) if isinstance(value, (dict, list)) else _jinja_string(value)


def _coder_keys(schema, handled: tuple[str, ...]) -> str:
    """Qwen3-Coder's tool listing of a schema's other keys: one <KEY>VALUE</KEY> line each."""
    if not isinstance(schema, dict):
        return ""
    return "".join(f"\n<{key}>{_xml_value(value)}</{key}>" for key, value in schema.items() if key not in handled)


def _coder_tool(tool: Tool) -> str:
    """A tool as Qwen3-Coder's template lists it: XML elements, not JSON."""
    out = [f"\n<function>\n<name>{tool.name}</name>"]
    if tool.description:
        out.append(f"\n<description>{tool.description.strip()}</description>")
    out.append("\n<parameters>")
    params = tool.parameters if isinstance(tool.parameters, dict) else {}
    if isinstance(params.get("properties"), dict):
        for name, spec in params["properties"].items():
            out.append(f"\n<parameter>\n<name>{name}</name>")
            if isinstance(spec, dict) and "type" in spec:
                out.append(f"\n<type>{_jinja_string(spec['type'])}</type>")
            if isinstance(spec, dict) and "description" in spec:
                out.append(f"\n<description>{str(spec['description']).strip()}</description>")
            out.append(_coder_keys(spec, ("name", "type", "description")) + "\n</parameter>")
    out.append(_coder_keys(params, ("type", "properties")) + "\n</parameters>\n</function>")
    return "".join(out)


class Qwen3Coder(ChatFormat):
    """Qwen3-Coder: a default system prompt beside tools, the tools listed as XML elements, XML calls,
    no thinking; messages written as they are (a later system message in its own turn)."""
    name, call_form = "qwen3-coder", "xml"

    def turns(self, w, messages, tools, job):
        system = messages[0].content if messages and messages[0].role == "system" else None
        rest = messages[1:] if system is not None else messages
        if system is not None or tools:
            w.template(f"{IM_START}system\n")
            if system is not None:
                w.client(system)
            else:
                w.template(QWEN3_CODER_DEFAULT_SYSTEM)
            if tools:
                w.template(QWEN3_CODER_TOOLS_INTRO)
                for tool in tools:
                    w.client(_coder_tool(tool))
                w.template(QWEN3_CODER_TOOLS_OUTRO)
            w.template(f"{IM_END}\n")
        for i, m in enumerate(rest):
            if m.role == "assistant" and m.tool_calls:
                w.template(f"{IM_START}assistant")
                if m.content.strip():
                    w.template("\n")
                    w.client(m.content.strip())
                    w.template("\n")
                for call in m.tool_calls:
                    _xml_call(w, call, "\n", _xml_value)
                w.template(f"{IM_END}\n")
            elif m.role == "tool":        # its own layout: a newline after each result, none before
                if i > 0 and rest[i - 1].role != "tool":
                    w.template(f"{IM_START}user\n")
                w.template(f"{RESPONSE_OPEN}\n")
                w.client(m.content)
                w.template(f"\n{RESPONSE_CLOSE}\n")
                if i == len(rest) - 1 or rest[i + 1].role != "tool":
                    w.template(f"{IM_END}\n")
            else:
                w.template(f"{IM_START}{m.role}\n")
                w.client(m.content)
                w.template(f"{IM_END}\n")


FORMATS: dict[str, ChatFormat] = {f.name: f for f in (Qwen3(), Qwen25(), Qwen35(), Qwen38(), Qwen3Coder())}
CHAT_FORMATS = tuple(FORMATS)
# The official templates these renderers are tested against, token for token
# (tests/test_chat_template.py), by the sha256 of their Jinja text. A GGUF or a folder whose template is
# one of these is rendered exactly as its template would; another is rendered in its family's format.
TESTED_TEMPLATES = {
    "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5": "qwen3",
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": "qwen2.5",
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715": "qwen3.5",
    "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041": "qwen3.8",
    "d287fb2edf144207f868ae1b282755dc19db2a3f1c5b3a3d57e9e5abffa98392": "qwen3-coder",
}


def chat_format(fmt: str) -> ChatFormat:
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown chat format {fmt!r}; known: {', '.join(CHAT_FORMATS)}") from None


def answer_prefix(job: Job, fmt: str) -> str:
    """The start of the answer that the prompt itself writes after `<|im_start|>assistant\\n`: the
    empty (or, Qwen3.5, the opened) thought, the opening of a call that tool_choice forces. The
    OutputParser reads it first, so it starts in the state the model continues from."""
    w = _Writer()
    chat_format(fmt).opening(w, job)
    return w.done().text


def tool_constraint(job: Job, fmt: str) -> Constraint | None:
    """What the answer's tool calls must be, from where answer_prefix leaves off (engine.grammar), or
    None when the model writes freely: no tools, or Completions. tool_choice none keeps calls out;
    required and a named tool continue the call the prompt opened; auto lets a call start wherever
    the model starts one."""
    return chat_format(fmt).constraint(job)


def render_runs(job: Job, fmt: str) -> PromptText:
    """The prompt: the conversation in the model's chat format, then the opening of the assistant's
    answer, as text runs between the template's own control tokens. Completions (job.prompt set) use
    the prompt as it is. The one rendering every API, count_tokens and the prefix cache see.
    TemplateError: a conversation the format's official template refuses."""
    if job.prompt is not None:
        return PromptText([job.prompt], raw=True)
    return chat_format(fmt).render(job)


def render_text(job: Job, fmt: str) -> str:
    """The prompt as one string (to compare with the official templates, or to read): render_runs'
    text, which does not say which of its control strings are tokens."""
    return render_runs(job, fmt).text


def render(job: Job, tok: Tokenizer, fmt: str) -> list[int]:
    """Job -> prompt ids (what the server's render_prompt does, in one call)."""
    return tok.encode_prompt(render_runs(job, fmt))


def serve_tokenizer(conn, folder: str) -> None:
    """The body of a tokenizer process (the server's TokenizerProcess): receives (PromptText, limit),
    sends back (number of tokens, their ids as int32 bytes, or b"" when there are more than limit).
    Large prompts are tokenized here so that the memory tokenizing takes (about 150 bytes a character)
    is this process's, returned to the system when it ends, and the server's event loop never waits."""
    import array
    tok = Tokenizer.from_folder(folder)
    while True:
        try:
            prompt, limit = conn.recv()
        except (EOFError, OSError):
            return
        ids = tok.encode_prompt(prompt)
        conn.send((len(ids), array.array("i", ids).tobytes() if len(ids) <= limit else b""))


def turn_boundaries(ids: list[int], tok: Tokenizer) -> list[int]:
    """Positions right after each `<|im_end|>` (and the newline the templates write after it): where
    the system prompt and tools, and each turn, end. The engine's host cache cuts saved prompt states
    there, so a conversation's next request finds them as an exact start."""
    end = tok.id_of(IM_END)
    newline = tok.encode("\n")
    if end is None:
        return []
    out = []
    for i, t in enumerate(ids):
        if t == end:
            after = i + 1
            if len(newline) == 1 and after < len(ids) and ids[after] == newline[0]:
                after += 1
            out.append(after)
    return out


# ---- streaming detokenizer -------------------------------------------------------------------------

class StreamDecoder:
    """Token ids -> text, one token at a time; bytes of a UTF-8 character split across tokens wait
    for the rest of the character."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """The end of the output: an unfinished character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


# ---- output parser: generated text -> neutral events -----------------------------------------------

_TEXT, _THINK, _CALL, _STOPPED = "text", "think", "call", "stopped"
_WHITESPACE = " \t\r\n"
# Hermes calls: the name is read as soon as its string closes, then the arguments value streams.
_HERMES_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_HERMES_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_HERMES_ARGS_KEYS = (',"arguments":', ',"parameters":')
# XML calls (Qwen3-Coder and later): <function=NAME> <parameter=P>value</parameter> </function>
_NAME_MAY_END = re.compile(r'["{}\[\]<]')
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>")
# What ends an XML parameter's raw value (engine.grammar keeps raw values from writing them).
XML_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>", CALL_CLOSE)
# A <function= tag longer than this is not a tag: the call is text.
MAX_XML_TAG = 256


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper beginning of marker (it may complete)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class StopStrings:
    """All of a request's stop strings as one automaton (Aho-Corasick): the text is read once, a
    character at a time, whatever the number or length of the strings, so the work per generated
    character is bounded (holding text back and searching it again for each string after every token
    grew with their count times their length squared).

    feed(text, start) reads text[start:] and returns (where the first completed stop string starts,
    the string), or None; `pending` is the length of the longest end of what was read that may still
    grow into a stop string: the text to hold back."""

    def __init__(self, stops: list[str]):
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._out: list[str | None] = [None]      # the longest stop string ending at this state
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = self._goto[node][ch] = len(self._goto)
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._out.append(None)
                node = nxt
            self._out[node] = stop
        self._fail = [0] * len(self._goto)
        order = list(self._goto[0].values())
        for node in order:                         # breadth first: a node's fail link is shallower
            for ch, nxt in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                self._fail[nxt] = self._goto[f].get(ch, 0) if node else 0
                if self._out[nxt] is None:
                    self._out[nxt] = self._out[self._fail[nxt]]
                order.append(nxt)
        self.state = 0

    def reset(self) -> None:
        self.state = 0

    @property
    def pending(self) -> int:
        return self._depth[self.state]

    def feed(self, text: str, start: int = 0) -> tuple[int, str] | None:
        goto, fail, out = self._goto, self._fail, self._out
        state = self.state
        for i in range(start, len(text)):
            ch = text[i]
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if out[state] is not None:
                self.state = state
                return i + 1 - len(out[state]), out[state]
        self.state = state
        return None


# The longest JSON escape (a surrogate pair, \ud83d\ude00) less one character: how much of an
# unfinished string's end may be an escape still being written.
MAX_PARTIAL_ESCAPE = 11


def _decode_partial_string(body: str) -> str | None:
    """The text of the start of a JSON string body that is still being written (an escape at its
    end may be unfinished); None when its escapes are not valid JSON."""
    for cut in range(len(body), max(len(body) - MAX_PARTIAL_ESCAPE, 0) - 1, -1):
        try:
            text = json.loads(f'"{body[:cut]}"')
        except ValueError:
            continue
        # Half of a surrogate pair: its other half is still to come; any other half is no text.
        if text and "\ud800" <= text[-1] <= "\udbff":
            text = text[:-1]
        return _whole_text(text)
    return None


def _may_become_call_head(text: str, names) -> bool:
    """Whether text (which starts with `{`) can still grow into `{"name": "N"` for one of the names.
    JSON allows whitespace between the tokens and escapes in the name."""
    rest = text[1:].lstrip()
    for literal in ('"name"', ":", '"'):
        if len(rest) <= len(literal) and literal.startswith(rest):
            return True
        if not rest.startswith(literal):
            return False
        rest = rest[len(literal):]
        rest = rest if literal == '"' else rest.lstrip()
    if "\\" in rest:
        rest = _decode_partial_string(rest)
    return rest is not None and any(name.startswith(rest) for name in names)


class _JsonScanner:
    """Where a JSON value ends, in text that arrives in pieces: bracket depth outside strings, kept
    between calls so each character is read once however long the value grows."""

    def __init__(self, pos: int, depth: int = 0):
        self.pos, self.depth = pos, depth
        self.in_string = self.escaped = False

    def scan(self, text: str) -> str | None:
        """Reads text on from pos. "end": the brackets closed (pos is just past the last one);
        "markup": a `<` outside a string, so the JSON was cut off (pos is at the `<`); None: the
        value goes on (pos is the end of text)."""
        i, n = self.pos, len(text)
        while i < n:
            ch = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return "end"
            elif ch == "<":
                self.pos = i - 1
                return "markup"
        self.pos = n
        return None


# Model output read as JSON (a call's arguments) nests at most this deep: Python's parser recurses a
# level at a time, and the encoders that write the value back out (an Anthropic tool_use.input) do
# too, so a model writing a thousand `[` would otherwise fail the request far from where it began.
MAX_OUTPUT_DEPTH = 64
_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_OPENERS = re.compile(r"[\[{]")
_BRACKETS = re.compile(r"[\[\]{}]")
# A \uD800-\uDFFF escape: the only way JSON text can hold a lone half of a surrogate pair.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_HALF = re.compile(r"[\ud800-\udfff]")


def _json_depth(text: str) -> int:
    depth = most = 0
    for ch in _BRACKETS.findall(_JSON_STRINGS.sub("", text)):
        depth += 1 if ch in "{[" else -1
        most = max(most, depth)
    return most


def _whole_text(value):
    """value with every lone surrogate in its strings (keys too) made U+FFFD: model text that cannot
    be written as UTF-8 must not reach an answer's encoder."""
    if isinstance(value, str):
        return _LONE_HALF.sub("\ufffd", value)
    if isinstance(value, list):
        return [_whole_text(v) for v in value]
    if isinstance(value, dict):
        return {_whole_text(k): _whole_text(v) for k, v in value.items()}
    return value


def read_json(text: str, strict: bool = True):
    """Model output as a JSON value, or ValueError: NaN and Infinity refused, at most MAX_OUTPUT_DEPTH
    deep, lone surrogates made U+FFFD. strict=False lets strings hold raw control characters (a
    custom tool's raw input, newlines and all)."""
    if len(_OPENERS.findall(text)) > MAX_OUTPUT_DEPTH and _json_depth(text) > MAX_OUTPUT_DEPTH:
        raise ValueError(f"nested deeper than {MAX_OUTPUT_DEPTH}")

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    try:
        value = json.JSONDecoder(parse_constant=refuse, strict=strict).decode(text)
    except RecursionError:
        raise ValueError("nested too deep") from None
    return _whole_text(value) if _SURROGATE_ESCAPE.search(text) else value


def _json_string(body: str) -> str:
    """The text of a JSON string's body; written as it is when its escapes are not valid JSON."""
    try:
        return read_json(f'"{body}"')
    except ValueError:
        return body


def _param_type(tool: Tool | None, name: str) -> str:
    """A parameter's JSON schema type; "string" when the schema does not say."""
    props = tool.parameters.get("properties") if tool and isinstance(tool.parameters, dict) else None
    spec = props.get(name) if isinstance(props, dict) else None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else "string"


def _param_json(raw: str, kind: str) -> str:
    """An XML parameter's text as JSON of its schema type; a string when it does not parse as one."""
    if kind != "string":
        text = raw.strip()
        if kind == "boolean" and text.lower() in ("true", "false"):
            text = text.lower()
        try:
            return tojson(read_json(text))
        except (ValueError, RecursionError):
            pass
    return tojson(raw)


class _CallReader:
    """One <tool_call> body -> tool call events. It reads the body as it grows (the parser's buffer
    holds all of it) and keeps its position; advance() answers "more" (wait for text), "done" (the
    call ended; `used` characters of the body are consumed) or "text" (not a call: deliver as text).

    Phases, each a method: detect -> Hermes JSON (hermes_name -> hermes_key -> hermes_args) or XML
    (xml_function -> xml_params <-> xml_value) -> tail (up to </tool_call>). A phase returns None
    after moving on, or the status when it must wait or is done.

    The forms (`form`): "tagged" (after <tool_call>, up to </tool_call>); the untagged ones read the
    same way, but "bare" and "fenced" (a Hermes object alone, or in a ``` fence) end where the object's
    braces close, and "xml" (<function=...> alone) at </function>; then a </tool_call> right after is
    skipped, for a fenced call the closing ``` instead.
    """

    def __init__(self, parser: "OutputParser", form: str = "tagged"):
        self.p = parser
        self.form = form
        self.bare = form != "tagged"
        self.phase = "detect"
        self.pos = 0              # read position in the body
        self.name_read = 0        # how much of the body _hermes_name has read
        self.used = 0
        self.index: int | None = None
        self.name = ""
        self.args: list[str] = []
        self.value_scan: _JsonScanner | None = None    # the Hermes arguments value, once it began
        self.object_scan: _JsonScanner | None = None   # a bare call's object, to its closing brace
        self.closed = False                            # a bare call's object was read to its end
        # XML parameters
        self.param: str | None = None
        self.param_kind = "string"
        self.value_start = 0
        self.value_sent = 0
        self.value_fresh = False  # the newline right after <parameter=...> is not yet decided
        self.value_cut = False    # the output ended inside a value: the call is not whole

    # -- events --
    def start(self, name: str) -> None:
        self.index, self.name = self.p._ncalls, name
        self.p._ncalls += 1
        self.p._out.append(ToolCallStart(self.index, new_id("call_"), name))

    def send(self, delta: str) -> None:
        if delta:
            self.args.append(delta)
            self.p._out.append(ToolCallArgs(self.index, delta))

    def end(self, complete: bool = True) -> None:
        """The call's end. complete False: the output ended inside it (its arguments would be
        broken): no ToolCallEnd."""
        if not self.args:
            self.send("{}")
        if complete:
            self.p._out.append(ToolCallEnd(self.index, "".join(self.args)))
            self.p._complete_calls += 1
        self.phase = "tail"

    # -- reading --
    def advance(self, body: str, final: bool) -> str:
        while True:
            before = (self.phase, self.pos)
            status = getattr(self, "_" + self.phase)(body, final)
            if status is not None:
                return status
            if (self.phase, self.pos) == before:
                return "more"

    def _detect(self, body: str, final: bool) -> str | None:
        head = body.lstrip()
        if head.startswith("{"):
            self.phase = "hermes_name"
            return None
        if head.startswith("<function="):
            self.phase = "xml_function"
            return None
        if final or (head and not "<function=".startswith(head)):
            return "text"
        return "more"

    def _body_end(self, body: str, final: bool) -> int | None:
        """Where a whole Hermes body ends: at </tool_call>, or for a bare call where its object's
        braces close; at the end of the output when it is final; None while it may still come."""
        if self.bare:
            if self.object_scan is None:
                self.object_scan = _JsonScanner(len(body) - len(body.lstrip()))
            if self.object_scan.scan(body) is not None:
                return self.object_scan.pos
        else:
            close = body.find(CALL_CLOSE, self.pos)
            if close >= 0:
                return close
        return len(body) if final else None

    def _finish_whole(self, body: str, stop: int, final: bool) -> str:
        """Read a whole Hermes body at once (keys in another order, or the closing tag already here)."""
        try:
            call = read_json(body[:stop].strip())
        except (ValueError, RecursionError):
            call = None
        whole = isinstance(call, dict) and isinstance(call.get("name"), str)
        if not whole:
            if self.index is None:
                return "text"
            call = {}
        if self.index is None:
            self.start(call["name"])
        value = call.get("arguments", call.get("parameters"))
        if not self.args and value is not None:
            self.send(arguments_text(value))
        self.end(complete=whole)
        self.pos, self.closed = stop, True
        return self._tail(body, final)

    def _hermes_name(self, body: str, final: bool) -> str | None:
        # Nothing can change until a quote (the name's end), a bracket or `<` (a bare object's end or
        # markup) or a closing tag arrives: a name that never ends is read once, not once a token.
        if not final and not _NAME_MAY_END.search(body, self.name_read) and \
                CALL_CLOSE not in body[max(self.name_read - len(CALL_CLOSE), 0):]:
            self.name_read = len(body)
            return "more"
        self.name_read = len(body)
        close = body.find(CALL_CLOSE)
        match = _HERMES_NAME.match(body)
        if match and (close < 0 or match.end() <= close):
            self.start(_json_string(match.group(1)))
            self.pos, self.phase = match.end(), "hermes_key"
            return None
        stop = self._body_end(body, final)
        return "more" if stop is None else self._finish_whole(body, stop, final)

    def _hermes_key(self, body: str, final: bool) -> str | None:
        rest = body[self.pos:]
        match = _HERMES_ARGS_KEY.match(rest)
        if match:
            self.pos += match.end()
            self.phase = "hermes_args"
            return None
        compact = "".join(rest.split())
        if compact.startswith("}"):        # {"name": ...} with no arguments
            self.end()
            return None
        if not final and any(key.startswith(compact) for key in _HERMES_ARGS_KEYS):
            return "more"
        stop = self._body_end(body, final)
        return "more" if stop is None else self._finish_whole(body, stop, final)

    def _hermes_args(self, body: str, final: bool) -> str | None:
        """Stream the raw JSON text of the arguments object until its closing brace (or markup
        outside a string: the JSON was cut off)."""
        if self.value_scan is None:    # the value has not begun yet
            rest = body[self.pos:]
            head = rest.lstrip()
            if not head:
                return self._finish_whole(body, len(body), final) if final else "more"
            if head[0] not in "{[":     # a string or other value: read the whole body instead
                stop = self._body_end(body, final)
                return "more" if stop is None else self._finish_whole(body, stop, final)
            self.pos += len(rest) - len(head)
            self.value_scan = _JsonScanner(self.pos)
        sent = self.value_scan.pos
        complete = self.value_scan.scan(body) is not None
        self.send(body[sent:self.value_scan.pos])
        if complete or final:
            self.pos = self.value_scan.pos
            self.end(complete)
            return None
        return "more"

    def _xml_function(self, body: str, final: bool) -> str | None:
        match = _XML_FUNCTION.match(body)
        if match:
            self.start(match.group(1).strip())
            self.pos, self.phase = match.end(), "xml_params"
            return None
        if final or len(body) > MAX_XML_TAG or "\n" in body.lstrip():
            return "text"
        return "more"

    def _xml_params(self, body: str, final: bool) -> str | None:
        rest = body[self.pos:]
        head = rest.lstrip()
        skipped = len(rest) - len(head)
        match = _XML_PARAMETER.match(head)
        if match:
            self._begin_value(match.group(1).strip(), self.pos + skipped + match.end())
            return None
        for tag in ("</function>", CALL_CLOSE):
            if head.startswith(tag):
                self.send("}" if self.args else "")
                self.end()
                self.pos += skipped + (len(tag) if tag != CALL_CLOSE else 0)
                self.closed = True
                return None
        if final:
            self.send("}" if self.args else "")
            self.end(complete=not self.value_cut)
            self.closed = True
            return None
        incomplete_tag = head.startswith("<parameter=") or any(
            tag.startswith(head) for tag in ("<parameter=", "</function>", CALL_CLOSE))
        if incomplete_tag and len(head) < MAX_XML_TAG:
            return "more"
        nxt = head.find("<", 1)          # stray text between parameters: skip it
        self.pos += skipped + (nxt if nxt > 0 else len(head))
        return None

    def _begin_value(self, name: str, start: int) -> None:
        self.param, self.param_kind = name, _param_type(self.p._tools.get(self.name), name)
        self.value_start = self.value_sent = start
        self.value_fresh = True
        self.pos, self.phase = start, "xml_value"
        self.send(("{" if not self.args else ", ") + tojson(name) + ": ")
        if self.param_kind == "string":
            self.send('"')

    def _xml_value(self, body: str, final: bool) -> str | None:
        if self.value_fresh:
            if self.pos >= len(body) and not final:
                return "more"
            if body.startswith("\n", self.pos):      # the newline after the tag is layout
                self.value_start = self.value_sent = self.pos = self.pos + 1
            self.value_fresh = False
        # No end tag can begin inside what was already sent (a partial one is always held back).
        ends = [(body.find(t, self.value_sent), t) for t in XML_VALUE_ENDS]
        ends = [(i, t) for i, t in ends if i >= 0]
        if ends or final:
            stop, tag = min(ends) if ends else (len(body), "")
            self.value_cut = not ends            # the output ended inside this value
            raw = body[self.value_start:stop]
            raw = raw[:-1] if raw.endswith("\n") else raw        # and so is the one before the end
            if self.param_kind == "string":
                self.send(tojson(raw[self.value_sent - self.value_start:])[1:-1] + '"')
            else:
                self.send(_param_json(raw, self.param_kind))
            self.pos = stop + (len(tag) if tag == "</parameter>" else 0)
            self.phase = "xml_params"
            return None
        if self.param_kind == "string":
            # Send what cannot be the start of an end tag, keeping one newline that may be layout.
            hold = max(_partial_suffix(body, t) for t in XML_VALUE_ENDS)
            safe = len(body) - hold
            if safe > self.value_sent and body[safe - 1] == "\n":
                safe -= 1
            if safe > self.value_sent:
                self.send(tojson(body[self.value_sent:safe])[1:-1])
                self.value_sent = safe
        return "more"

    def _tail(self, body: str, final: bool) -> str | None:
        """After the call's value: skip to </tool_call>."""
        if self.bare:
            return self._bare_tail(body, final)
        close = body.find(CALL_CLOSE, self.pos)
        if close >= 0:
            self.used = close + len(CALL_CLOSE)
            return "done"
        if final:
            self.used = len(body)
            return "done"
        return "more"

    def _bare_tail(self, body: str, final: bool) -> str | None:
        """After an untagged call's value: the rest of its object, then a </tool_call> if the model
        adds one (a fenced call: the closing ```)."""
        if not self.closed:
            if self.object_scan is None:       # the value ended inside the object
                self.object_scan = _JsonScanner(self.pos, depth=1)
            ended = self.object_scan.scan(body)
            if ended is None:
                if not final:
                    return "more"
                self.used = len(body)
                return "done"
            self.pos, self.closed = self.object_scan.pos, True
            if ended == "markup":              # cut off by markup: that is read as text again
                self.used = self.pos
                return "done"
        head = body[self.pos:].lstrip()
        closer = FENCE if self.form == "fenced" else CALL_CLOSE
        if head.startswith(closer):
            self.used = len(body) - len(head) + len(closer)
            return "done"
        if not final and closer.startswith(head):
            return "more"
        self.used = self.pos
        return "done"


class OutputParser:
    """Generated token ids -> neutral events (TextDelta, ReasoningDelta, ToolCallStart/Args/End, Done).

    Streaming: feed() returns the events the new tokens complete; text that could still turn into
    markup (a partial <tool_call>, </think>) or a stop string waits for the next tokens. finish() ends
    the answer: held-back text is flushed, an open call is closed, Done comes last.
    The answer reads as the templates render it back, so history re-renders as the model wrote it:
    reasoning without the newlines around it, text without newlines after </think> or whitespace
    before a call. Stop strings apply to the text (not to reasoning or arguments).

    Small models often write a call without the tags, and these are read as calls too: an answer
    that begins (after thinking and whitespace), or goes on right after any call, with `{"name": "N"`
    for an offered tool N; a ```json (or bare ```) fence anywhere whose object opens the same way; and
    `<function=N>` anywhere. What may still become one of them is held back (a leading `{`, a fence,
    `<function=`) and is text the moment it cannot: a ```python block, JSON without "name" first,
    a name no tool has.
    """

    def __init__(self, tok: Tokenizer, job: Job, fmt: str):
        self._decoder = StreamDecoder(tok)
        raw = job.prompt is not None                    # Completions: plain text, no markup
        self._calls_on = not raw and bool(callable_tools(job))
        self._tools = {t.name: t for t in callable_tools(job)}
        stops = [s for s in job.stop if s]
        self._stops = StopStrings(stops) if stops else None
        self._stops_read = 0                            # characters of _buf the automaton has read
        self.stop_hit: str | None = None
        self._mode = _TEXT
        self._buf = ""                                  # text not yet turned into events
        self._at_start = not raw                        # <think> opens reasoning only before any text
        self._strip = "" if raw else "\n"               # characters dropped where the text begins
        self._dropped = ""                              # whitespace dropped before <tool_call>
        self._bare_ok = self._calls_on                  # a bare call may begin: no text since
                                                        # the start or the last call
        self._judged = 0                                # _buf before this: no untagged call starts
        self._call: _CallReader | None = None
        self._ncalls = 0
        self._complete_calls = 0                        # calls with a ToolCallEnd (not cut off)
        self._reasoning_tokens = 0
        self._out: list = []
        # The prompt already wrote the answer's start (empty thought, forced call): read it silently,
        # keeping only the start of a forced call.
        self._consume(answer_prefix(job, fmt), final=False)
        self._out = [e for e in self._out if isinstance(e, (ToolCallStart, ToolCallArgs))]

    # -- public --
    def feed(self, token_ids: list[int]) -> list:
        for token_id in token_ids:
            before = self._mode
            self._consume(self._decoder.feed(token_id), final=False)
            if _THINK in (before, self._mode):
                self._reasoning_tokens += 1
        return self._take()

    def finish(self, finish_reason: str, usage: Usage | None = None, timings: dict | None = None) -> list:
        """The last events: flushed text, closed calls, then Done. usage comes from the caller;
        reasoning_tokens is counted here."""
        self._consume(self._decoder.flush(), final=True)
        usage = usage if usage is not None else Usage()
        usage.reasoning_tokens = self._reasoning_tokens
        if self.stop_hit is not None:
            finish_reason = "stop"
        elif finish_reason == "stop" and self._complete_calls:
            finish_reason = "tool_calls"
        return self._take() + [Done(finish_reason, usage, self.stop_hit, timings)]

    # -- internals --
    def _take(self) -> list:
        """The pending events, consecutive deltas of one kind merged."""
        merged: list = []
        for ev in self._out:
            last = merged[-1] if merged else None
            if isinstance(ev, (TextDelta, ReasoningDelta)) and type(last) is type(ev):
                last.text += ev.text
            elif isinstance(ev, ToolCallArgs) and isinstance(last, ToolCallArgs) and last.index == ev.index:
                last.delta += ev.delta
            else:
                merged.append(ev)
        self._out = []
        return merged

    def _consume(self, text: str, final: bool) -> None:
        self._buf += text
        while True:
            if self._mode == _TEXT:
                moved = self._advance_text(final)
            elif self._mode == _THINK:
                moved = self._advance_think(final)
            elif self._mode == _CALL:
                moved = self._advance_call(final)
            else:
                self._buf, moved = "", False
            if not moved:
                return

    def _text(self, text: str) -> None:
        if text:
            self._out.append(TextDelta(text))
            self._at_start = self._bare_ok = False

    def _leave_text(self) -> None:
        """Text mode ends (a call, thinking, a stop): the next text is read by the automaton afresh."""
        if self._stops is not None:
            self._stops.reset()
        self._stops_read = 0
        self._judged = 0

    def _advance_text(self, final: bool) -> bool:
        """Text: read the buffer up to the first thing that ends text (a bare call at the answer's
        start, a stop string, <tool_call>, a fence or <function=, the opening <think>) and go on from
        there; else hand on the text that can no longer be the start of one. True: read on."""
        buf = self._buf
        if self._strip:
            buf = buf.lstrip(self._strip)      # only before any text: the automaton has read none
            if buf:
                self._strip = ""
        if self._bare_ok and buf.lstrip().startswith("{"):
            moved = self._bare_start(buf, final)
            if moved is not None:
                return moved
        untagged = self._untagged_call(buf, final) if self._calls_on else None
        end = self._text_end(buf, untagged)
        if end is not None:
            return self._end_text(buf, end, untagged)
        if final:
            self._text(buf)
            self._buf, self._stops_read = "", 0
            return False
        self._hold_back(buf, untagged)
        return False

    def _bare_start(self, buf: str, final: bool) -> bool | None:
        """A JSON object at the answer's very start: a call (True: read on, as a call), not known
        yet (False: wait for more), or text (None: read it as text)."""
        verdict = self._bare_call(buf.lstrip(), final)
        if verdict == "more":
            self._buf = buf
            return False
        if verdict == "call":
            self._buf, self._mode = buf.lstrip(), _CALL
            self._call = _CallReader(self, "bare")
            self._at_start = False
            self._dropped = ""
            self._leave_text()
            return True
        self._bare_ok = False
        return None

    def _text_end(self, buf: str, untagged) -> tuple[int, int, str] | None:
        """The first thing in buf that ends text: (where, 0 for a stop string else 1, what: the stop
        string, CALL_OPEN, THINK_OPEN or the untagged call's form), or None."""
        found = []
        if self._stops is not None:
            hit = self._stops.feed(buf, self._stops_read)
            self._stops_read = len(buf)
            if hit is not None:
                found.append((hit[0], 0, hit[1]))
        if self._calls_on:
            found.append((buf.find(CALL_OPEN), 1, CALL_OPEN))
        if self._at_start:
            i = buf.find(THINK_OPEN)
            if i >= 0 and not buf[:i].strip():
                found.append((i, 1, THINK_OPEN))
        if untagged is not None and untagged[1] == "call":
            found.append((untagged[0], 1, untagged[2]))
        found = [f for f in found if f[0] >= 0]
        return min(found) if found else None

    def _end_text(self, buf: str, end: tuple[int, int, str], untagged) -> bool:
        """Text ends at end (_text_end): the text before it handed on, then a call, the thought or
        the stop. True: read on, in the new mode."""
        i, _, what = end
        self._leave_text()
        if what in ("fenced", "xml"):          # the fence's head is not part of the call
            before = buf[:i].rstrip()
            self._text(before)
            self._dropped = buf[len(before):untagged[3]]
            self._buf, self._mode = buf[untagged[3]:], _CALL
            self._call = _CallReader(self, what)
            self._at_start = False
        elif what == CALL_OPEN:
            before = buf[:i].rstrip()
            self._text(before)
            self._dropped = buf[len(before):i]
            self._buf, self._mode = buf[i + len(CALL_OPEN):], _CALL
            self._call = _CallReader(self)
            self._at_start = False
        elif what == THINK_OPEN:
            self._buf, self._mode, self._at_start = buf[i + len(THINK_OPEN):], _THINK, False
            self._strip = "\n"
        else:
            self._text(buf[:i])
            self.stop_hit, self._buf, self._mode = what, "", _STOPPED
            return False
        return True

    def _hold_back(self, buf: str, untagged) -> None:
        """No end in buf yet: hand on the text that can no longer begin a marker, a stop string or a
        call, and keep the rest for the next tokens."""
        markers = [CALL_OPEN, FENCE, XML_OPEN] if self._calls_on else []
        markers += [THINK_OPEN] if self._at_start else []
        hold = max((_partial_suffix(buf, m) for m in markers), default=0)
        if self._stops is not None:
            hold = max(hold, self._stops.pending)
        keep = len(buf) - hold
        if untagged is not None:                # "more": it may still open a call
            keep = min(keep, untagged[0])
        if self._calls_on:              # trailing whitespace is dropped if a call follows
            keep = len(buf[:keep].rstrip())
        if self._at_start and not buf[:keep].strip():
            keep = 0
        self._text(buf[:keep])
        self._buf = buf[keep:]
        self._stops_read = len(buf) - keep      # what is held back was read: never read again
        self._judged = max(0, self._judged - keep)

    def _untagged_call(self, buf: str, final: bool) -> tuple[int, str, str, int] | None:
        """The first place in buf, past what was judged already, that opens a call without
        <tool_call> (a fence, <function=): (where, "call" or "more", its form, where the call's body
        begins), or None. What cannot open one is judged text and never read for this again."""
        while True:
            found = [(buf.find(m, self._judged), m) for m in (FENCE, XML_OPEN)]
            found = [(i, m) for i, m in found if i >= 0]
            if not found:
                return None
            i, marker = min(found)
            if marker == FENCE:
                body = FENCE_HEAD.match(buf, i).end()
                rest, label = buf[body:], buf[i + len(FENCE):]
                if rest.startswith("{"):
                    verdict = self._bare_call(rest, final)
                elif not final and (not rest or len(label) < 4 and "json".startswith(label)):
                    verdict = "more"               # the fence's head is still being written
                else:
                    verdict = "text"
            else:
                body, verdict = i, self._xml_call(buf[i:], final)
            if verdict != "text":
                return i, verdict, "fenced" if marker == FENCE else "xml", body
            self._judged = i + len(marker)

    def _xml_call(self, text: str, final: bool) -> str:
        """Whether text that begins with <function= opens a call of an offered tool (as _bare_call)."""
        match = _XML_FUNCTION.match(text)
        if match:
            return "call" if match.group(1).strip() in self._tools else "text"
        name = text[len(XML_OPEN):]
        if not final and "\n" not in name and any(tool.startswith(name) for tool in self._tools):
            return "more"
        return "text"

    def _bare_call(self, head: str, final: bool) -> str:
        """Whether text that begins with `{` is a call written without its tags: "call" once it
        names an offered tool, "more" while it still may, "text" when it cannot."""
        match = _HERMES_NAME.match(head)
        if match:
            return "call" if _json_string(match.group(1)) in self._tools else "text"
        if not final and _may_become_call_head(head, self._tools):
            return "more"
        return "text"

    def _reasoning(self, text: str) -> None:
        if text:
            self._out.append(ReasoningDelta(text))

    def _advance_think(self, final: bool) -> bool:
        buf = self._buf
        if self._strip:
            buf = buf.lstrip(self._strip)
            if buf:
                self._strip = ""
        i = buf.find(THINK_CLOSE)
        if i >= 0:
            self._reasoning(buf[:i].rstrip("\n"))
            self._buf, self._mode, self._strip = buf[i + len(THINK_CLOSE):], _TEXT, "\n"
            return True
        if final:
            self._reasoning(buf.rstrip("\n"))
            self._buf = ""
            return False
        keep = len(buf) - _partial_suffix(buf, THINK_CLOSE)
        keep = len(buf[:keep].rstrip("\n"))       # newlines just before </think> are layout
        self._reasoning(buf[:keep])
        self._buf = buf[keep:]
        return False

    def _advance_call(self, final: bool) -> bool:
        status = self._call.advance(self._buf, final)
        if status == "more":
            return False
        if status == "text":                     # not a call after all: it is text
            self._text(self._dropped + ("" if self._call.bare else CALL_OPEN))
            self._bare_ok = False
            self._judged = len(XML_OPEN) if self._call.form == "xml" else 0
        else:
            self._buf = self._buf[self._call.used:]
            self._strip = _WHITESPACE
            self._bare_ok = True                 # right after a call, a bare one may follow
        self._mode, self._call = _TEXT, None
        return True
