"""Text side of the engine: the tokenizer, the chat templates, and the output parser.

The one place that knows what a prompt looks like and what the model's output means:
    Job                  one request of any API, parsed into native types (mashbox.py's parse_*)
    render(job, tok)     Job -> prompt token ids (the chat template, hand-written Python)
    OutputParser         generated token ids -> neutral events (text, reasoning, tool calls, done)
Every API's encoder in mashbox.py turns those events into its own JSON or SSE; a fix to tool-call
or thinking handling is made here once for all four APIs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.protocol import Sampling


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
    preserve_thinking: bool = False   # keep reasoning of every earlier assistant turn in the prompt


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
    finish_reason: str            # "stop" | "length" | "tool_calls" | "abort" | "error"
    usage: Usage = field(default_factory=Usage)
    stop_sequence: str | None = None   # the stop string that ended the text, if one did
    timings: dict | None = None        # ChatTimings fields
    error: str | None = None
