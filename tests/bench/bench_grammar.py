"""What constrained tool calls cost (engine.grammar; run by hand, not in CI).

    python tests/bench/bench_grammar.py [--folder HF_FOLDER] [--rounds 8] [--steps 48]

On the demo model (its tokenizer and weights) and Claude Code's recorded tool set (12 tools, 32 KB
of schemas, from ../shared/fixtures/clients; a stand-in set of 12 tools when absent):
  - compile: the tool set's grammar in a fresh process state (cold) and again (cached);
  - mask: the host time of one row's token mask at every step of an answer that says a sentence
    and then writes a Bash call, replayed through the matcher (median, p90, max);
  - decode: tokens/s of 1 and 4 busy rows with every row under the agents' lazy grammar against the
    same rows unconstrained, rounds alternated, medians and the median of each round's ratio (the rows
    draw the same tokens either way);
  - programs compiled after ready (must be 0).
Targets: compile <= 50 ms cold and ~0 cached; mask <= 0.3 ms per row per step; decode with the
grammar within 5% of without at 1 and 4 rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from engine import chat, grammar, registry  # noqa: E402
from engine.protocol import Constraint, Submit  # noqa: E402

CLIENTS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "clients"
CALL = ('I will list the files first.\n<tool_call>\n{"name": "Bash", "arguments": {"command": '
        '"ls -la /home/user/project && cat README.md | head -50", "description": "List the project files '
        'and read the start of the README"}}\n</tool_call>')
PROMPT = "Count from 1 to 300, one number per line, and nothing else."


def claude_code_tools() -> list[tuple[str, dict]]:
    path = CLIENTS / "claude-code" / "default.jsonl"
    if path.is_file():
        import mashbox
        for line in path.read_text().splitlines():
            body = json.loads(line).get("body")
            if isinstance(body, dict) and body.get("tools"):
                return [(t.name, t.parameters) for t in mashbox.parse_messages(body).tools]
    print("(Claude Code's recorded tools are not here: a stand-in set of 12)")
    return [("Bash", {"type": "object", "required": ["command"], "properties": {
        "command": {"type": "string"}, "description": {"type": "string"}, "timeout": {"type": "number"}}})] + [
        (f"Tool{i}", {"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}})
        for i in range(11)]


def compile_times(folder: str, vocab: int, c: Constraint) -> tuple[float, float]:
    g = grammar.Grammars(folder, vocab)
    g._tokenizer.result()                       # the tokenizer's trie is built once per process
    t0 = time.perf_counter()
    first, _ = g._compiled(c)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again, _ = g._compiled(Constraint(c.mode, [(n, json.loads(json.dumps(s))) for n, s in c.tools]))
    assert again is first
    return cold, time.perf_counter() - t0


def mask_times(folder: str, vocab: int, c: Constraint) -> list[float]:
    tok = chat.Tokenizer.from_folder(folder)
    g = grammar.Grammars(folder, vocab)
    g.open("bench", c)
    while not g.settled("bench"):
        g.wait(0.1)
    times = []
    for token in tok.encode(CALL) + tok.stop_ids[:1]:
        t0 = time.perf_counter()
        bits = g.masks(["bench"])
        times.append(time.perf_counter() - t0)
        assert (bits[0, token // 32] >> (token % 32)) & 1, tok.decode([token])
        g.advance("bench", token)
    assert g.close("bench")[0] == "auto"
    return times


def decode_rate(engine, prompt: list[int], rows: int, steps: int, stop_ids: list[int],
                c: Constraint | None) -> float:
    """tokens/s of `rows` requests decoding together (after each one's first token)."""
    for r in range(rows):
        assert engine.submit(Submit(f"r{r}-{time.monotonic_ns()}", prompt, steps + 1, stop_ids=stop_ids,
                                    constraint=c)) == []
    tokens, t0 = 0, None
    while engine.busy:
        for step in engine.step():
            if t0 is None and step.tokens and engine.scheduler.live == rows and not any(
                    s.request and s.request.prefilling for s in engine.scheduler.slots):
                t0, tokens = time.perf_counter(), 0
            elif t0 is not None:
                tokens += len(step.tokens)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", help="a Hugging Face folder (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    folder = args.folder or registry.prepare(registry.resolve(None))
    vocab = json.loads(Path(folder, "config.json").read_text())["vocab_size"]
    c = Constraint("auto", claude_code_tools())
    size = sum(len(json.dumps(s)) for _, s in c.tools)
    cold, cached = compile_times(folder, vocab, c)
    print(f"tool set: {len(c.tools)} tools, {size:,} bytes of schemas")
    print(f"compile, cold      {cold * 1000:8.2f} ms   (target <= 50)")
    print(f"compile, cached    {cached * 1000:8.3f} ms")
    times = mask_times(folder, vocab, c)
    print(f"mask per row, {len(times)} steps of a sentence and a Bash call: median "
          f"{statistics.median(times) * 1000:.3f} ms, p90 {np.percentile(times, 90) * 1000:.3f} ms, "
          f"max {max(times) * 1000:.2f} ms (the first: {times[0] * 1000:.2f} ms)   (target <= 0.3)")

    from engine.worker import Engine, WorkerArgs
    engine = Engine(WorkerArgs("bench", folder, slots=4, ctx=1024, prefill_chunks=(32, 128),
                               compile_cache=None, certify_dir=None))
    tok = chat.Tokenizer.from_folder(folder)
    job = chat.Job(messages=[chat.Message("user", PROMPT)])
    prompt = chat.render(job, tok, engine.facts.chat_format)
    print(f"model {engine.facts.id}, {engine.facts.dtype} weights; decode of {args.steps} tokens per row, "
          f"{args.rounds} rounds alternated")
    for rows in (1, 4):
        got: dict[str, list[float]] = {"free": [], "grammar": []}
        for _ in range(args.rounds):
            for name, constraint in (("free", None), ("grammar", c)):
                got[name].append(decode_rate(engine, prompt, rows, args.steps, tok.stop_ids, constraint))
        free, constrained = statistics.median(got["free"]), statistics.median(got["grammar"])
        # Each round's two runs are side by side: their ratio is what a shared machine's drift spares.
        ratio = statistics.median(g / f for f, g in zip(got["free"], got["grammar"]))
        print(f"decode, {rows} row(s): {free:7.1f} tok/s unconstrained, {constrained:7.1f} tok/s under the "
              f"grammar (median of the rounds' ratios {ratio:.3f}x; target >= 0.95)")
    print(f"compiles after ready: {engine.compiles_after_ready()}")


if __name__ == "__main__":
    main()
