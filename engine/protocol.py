"""The messages between the server process and the engine worker process.

Plain dataclasses, pickled over a multiprocessing pipe. Nothing else lives here: the server never
imports jax, and these messages (with Sampling, which engine.chat fills in) are all that passes between
it and the worker.

Server -> worker: Submit, Cancel, Shutdown.
Worker -> server: Loading (progress while weights load and programs compile), Ready (the model
facts), Step (new tokens of one request, and its end), Fault (the worker is about to die), Stats,
Note (a line for the server log).
"""
from __future__ import annotations

from dataclasses import dataclass, field


# --speculative: "auto" drafts with the checkpoint's MTP layer where it has one and from the
# conversation's text, each where measured to pay; "mtp" and "ngram" with one drafter; "off" never
# (engine.speculative).
SPECULATIVE_MODES = ("auto", "mtp", "ngram", "off")

@dataclass
class Sampling:
    """Per-request sampling. Defaults are the spec's: greedy, every filter off."""
    temperature: float = 0.0        # 0 = greedy
    top_p: float = 1.0              # (0, 1]
    top_k: int = 0                  # 0 = off
    min_p: float = 0.0              # [0, 1)
    seed: int | None = None         # None = a random seed chosen by the worker
    repetition_penalty: float = 1.0  # > 0; 1 = off
    frequency_penalty: float = 0.0   # [-2, 2]
    presence_penalty: float = 0.0    # [-2, 2]


@dataclass
class Constraint:
    """What a request's answer may be beyond what the model writes: its tool calls, each naming one of
    the request's tools with arguments valid for that tool's JSON schema (engine.grammar; made by
    engine.chat.tool_constraint). The worker masks the tokens that would break it."""
    mode: str                     # "auto": calls start where the model starts one; "required": the
                                  # answer is calls; "named": one call of `name`; "none": no call
    tools: list[tuple[str, dict]] = field(default_factory=list)   # (name, arguments' JSON schema)
    name: str | None = None       # "named": the tool called
    # Where the answer's thinking stands: "none" (no thought), "may_open" (the answer may open with a
    # <think> block: Qwen3, thinking on) or "open" (the prompt opened the thought: the answer starts
    # inside it and closes it with </think> before any call: Qwen3.5, thinking on).
    think: str = "none"
    # How the chat format writes a call inside <tool_call></tool_call>: "json" (Hermes: {"name": ...,
    # "arguments": ...}, Qwen3 and Qwen2.5) or "xml" (<function=NAME> with <parameter=P> elements,
    # Qwen3.5 and Qwen3-Coder). required / named continue the call the prompt opened in this form.
    form: str = "json"


# ---- server -> worker -------------------------------------------------------------------------

@dataclass
class Submit:
    rid: str                      # request id, unique per server process
    prompt: list[int]             # prompt token ids (already rendered by engine.chat)
    max_tokens: int               # most new tokens; the worker also stops at the end of --ctx
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: list[int] = field(default_factory=list)  # token ids that end the row (eos, <|im_end|>)
    submitted_at: float = 0.0     # time.time() when the server handed it over (for queue_ms)
    # Positions in the prompt right after each turn boundary the template made (the end of the system
    # prompt and tools, of each turn): where the host cache cuts what it saves. Sorted, 1..len(prompt).
    cuts: list[int] = field(default_factory=list)
    # An opaque label of who sent it (a hash, never a key or a name): the host cache evicts from the
    # label holding the most bytes first. Never exported or logged.
    tenant: str = ""
    constraint: Constraint | None = None   # None: the model writes freely


@dataclass
class Cancel:
    rid: str                      # the worker frees the row and answers with Step(finish="abort")


@dataclass
class Shutdown:
    pass


# ---- worker -> server -------------------------------------------------------------------------

@dataclass
class Loading:
    phase: str                    # "weights", "compile", "demo-model", ...
    done: int = 0
    total: int = 0


@dataclass
class ModelFacts:
    """What the worker loaded; the server's /v1/models and /health read it."""
    id: str
    family: str                   # "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"
    weights: str                  # the weights folder or file loaded
    folder: str                   # the HF folder: the server loads tokenizer.json from here
    chat_format: str              # "qwen3" | "qwen2.5": which template engine.chat renders
    gb: float                     # weights in device memory, GB
    bpw: float                    # bits per weight of the weights file
    max_model_len: int            # --ctx
    slots: int                    # --slots
    prefix_cache: bool
    cache_ram_mib: int
    vocab_size: int
    device: str                   # "cpu", "gpu", "tpu"
    dtype: str                    # compute dtype
    compile_s: float = 0.0        # start-up compile time
    cache_namespace: str | None = None
    # Mixture-of-experts models: Health's routed_experts (engine.moe.routed_report); None if dense.
    routed_experts: dict | None = None
    component_set_sha: str | None = None   # engine.identity: the model's components as loaded
    deployment_id: str | None = None       # engine.identity: the compiled programs and what shapes them
    certification: str = "not_certified"   # engine.certify's gate: "certified" | "not_certified"
    certification_detail: str = ""         # what the gate checked, or why it failed
    # The devices the model is split over (engine.sharding.Layout.describe): count, platform, mesh
    # axes, processes, KV heads laid out. None: a worker that does not say (the test fake).
    devices: dict | None = None
    # Constrained tool calls (engine.grammar): the library that masks tokens ("llguidance 1.9.1"), or
    # None with the reason in grammar_off (the server logs it once).
    grammar: str | None = None
    grammar_off: str = ""
    # What multiplies the weights on a CPU: "native avx512_vnni" or "native avx2" (engine.native's
    # kernel and its tier), else "xla"; Health's kernel.
    kernel: str = "xla"
    # Speculative decoding (engine.speculative): what it verifies, or "off: why"; "" from a worker
    # that does not say (the test fake).
    speculative: str = ""
    # Whether the same request gets the same answer (rows, drafting, chunks and the prompt cache),
    # and where not, why; "" from a worker that does not say (the test fake).
    same_answer: str = ""


@dataclass
class Ready:
    facts: ModelFacts
    pid: int = 0


@dataclass
class Step:
    """New tokens of one request. The last Step of a request has finish set."""
    rid: str
    tokens: list[int]
    finish: str | None = None     # "stop" (a stop id, not included in tokens), "length", "abort", "error"
    prompt_tokens: int = 0        # set on the first Step of a request
    cached_tokens: int = 0        # prompt tokens served from a slot or the host cache (first Step)
    error: str | None = None      # finish == "error": what failed
    # timings in ms, set on the last Step: queue_ms, prompt_ms (run start -> first token),
    # predicted_ms (first -> last token)
    timings: dict | None = None
    # Set on the last Step of a request that ran under its Constraint: the mode, and the host time
    # its token masks took (ms). None: it ran unconstrained (none asked, or it could not be).
    constrained: str | None = None
    mask_ms: float = 0.0


@dataclass
class Stats:
    """Sent by the worker after each scheduling round that changed something (cheap to read)."""
    live_rows: int
    waiting: int
    kv_used_tokens: int           # tokens held in slots
    kv_capacity_tokens: int       # slots * ctx
    compiles_after_ready: int
    host_cache_bytes: int = 0
    snapshot_bytes: int = 0
    host_cache_cap_bytes: int = 0
    host_cache_evictions: int = 0
    prefix_queries: int = 0       # prompt tokens looked up (cumulative)
    prefix_hits: int = 0          # prompt tokens served from a cache (cumulative)


@dataclass
class Note:
    """Something the operator should read in the server log (e.g. where a prompt that continues a
    cached conversation diverged from it). Never prompt text."""
    message: str
    rid: str | None = None


@dataclass
class Fault:
    """The worker hit an error it cannot recover from and is about to exit."""
    message: str
