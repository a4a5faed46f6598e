"""Speculative decoding on against off, side by side (run by hand, not in CI).

    python tests/bench/bench_speculative.py [--quick] [--no-llama] [--agent-tokens 256]

Starts `python -m mashbox run` (the demo model, --slots 4) twice, with `--speculative off` and with
`--speculative auto`, both up at once, and runs the same work through their HTTP APIs, each workload
on one server and then on the other (one idles while the other works, so the machine's drift falls
on both alike), greedy (temperature 0), so the two answers must be the same text:
  edit    a 200-line source file (the first 200 lines of engine/scheduler.py) given whole, the answer
          asked for is the whole file with one constant renamed (Chat Completions; llama.cpp reads
          the same text in the model's chat template);
  agent   the recorded coding-agent sessions in ../shared/fixtures/clients (Claude Code over Messages,
          Codex over Responses, Pi over Chat Completions; the `default` session of each, a tool round
          trip), each turn answered up to --agent-tokens tokens; skipped when the folder is absent;
  prose   a story asked for in a few words: nothing in the prompt to copy;
  edit x4 four edit requests at once (four busy slots), each renaming a different constant.
First, in the bench's own process, the demo's logits at 8 drafted positions of one call are compared
with 8 decode steps', to the bit (the output is the same only if they are). Decode tok/s = (new tokens - 1) / (time from the first output event to the last), per request, and for
a workload the sum of its tokens over the sum of its times (edit x4: all tokens over the wall time
from the first output to the last). With llama-cpp-python installed (the bench extra), llama.cpp runs
the edit prompt with and without its prompt-lookup drafting (llama_cpp.llama_speculative's
LlamaPromptLookupDecoding, 10 tokens) on the demo's GGUF, 2 threads, in a process of its own.

Quote ratios from one run on a quiet machine (the 1-minute load average is printed). Results:
docs/performance.md ("Speculative decoding"), every run in docs/perf-log.md.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sessions import CLIENTS, is_output, limited, recorded, start_server, wait_ready  # noqa: E402

EDIT_LINES = 200
EDIT_TOKENS = 3000          # room for the whole file (about 2,400 tokens) and its fences
PROSE_TOKENS = 300
RENAMES = [("SLOT_SNAPSHOTS", "SNAPSHOTS_PER_SLOT"), ("PREFILL_CHUNKS", "CHUNK_LENGTHS"),
           ("SMALL_DECODE_BATCHES", "DECODE_ROW_COUNTS"), ("Buckets", "Shapes")]
SYSTEM = "You are a careful coding assistant."
MODES = ("off", "auto")


def chat_text(user: str) -> str:
    """The demo's chat template (Qwen2.5) around the system prompt and one user message, the answer's
    turn opened: the text the server renders for chat(user), for llama.cpp."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def edit_prompt(rename: tuple[str, str]) -> str:
    source = "\n".join((ROOT / "engine" / "scheduler.py").read_text().splitlines()[:EDIT_LINES])
    return (f"Here is a Python file:\n\n```python\n{source}\n```\n\nReturn the whole file, unchanged "
                     f"except that `{rename[0]}` is renamed to `{rename[1]}` everywhere. Reply with the file "
                     "only, in one code block.")


PROSE = "Write a story of about 250 words about a lighthouse keeper who finds a letter in a bottle."


# ---- one request over HTTP, its output events timed -----------------------------------------------------

def output_text(event: dict) -> str:
    """The generated text an SSE event carries, in any of the APIs (for comparing answers)."""
    delta = event.get("delta")
    if isinstance(delta, str):
        return delta
    if isinstance(delta, dict):
        return delta.get("text") or delta.get("partial_json") or delta.get("thinking") or ""
    out = ""
    for choice in event.get("choices") or []:
        d = choice.get("delta") or {}
        out += choice.get("text") or d.get("content") or d.get("reasoning_content") or ""
        for call in d.get("tool_calls") or []:
            out += (call.get("function") or {}).get("arguments") or ""
    return out


def output_tokens(event: dict) -> int | None:
    u = event.get("usage") or (event.get("response") or {}).get("usage") or {}
    return u.get("output_tokens", u.get("completion_tokens"))


def stream(port: int, path: str, body: dict, headers: dict | None = None) -> dict:
    """POST a streamed request: its output text, new tokens and the first/last output times."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {resp.read()[:300]!r}")
    text, tokens, first, last = "", 0, None, None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if is_output(event) or (event.get("choices") and output_text(event)):
            now = time.monotonic()
            first = first or now
            last = now
        text += output_text(event)
        tokens = output_tokens(event) or tokens
    conn.close()
    return {"text": text, "tokens": tokens, "first": first, "last": last,
            "seconds": (last - first) if first and last else 0.0}


def chat(port: int, user: str, max_tokens: int) -> dict:
    """A streamed Chat Completions request: the system prompt and one user message, greedy."""
    return stream(port, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})


def agent_turns(tokens: int) -> list[dict]:
    """The recorded sessions' generation requests, greedy, answers cut to `tokens`."""
    out = []
    for client in ("claude-code", "codex", "pi"):
        path = CLIENTS / client / "default.jsonl"
        if path.exists():
            for r in recorded(path):
                r = limited(r, tokens)
                r["body"]["temperature"] = 0
                r["body"]["stream"] = True
                out.append(r)
    return out


def replay(port: int, request: dict) -> dict:
    skip = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
    headers = {k: v for k, v in request["headers"] if k.lower() not in skip}
    query = request.get("query") or ""
    return stream(port, request["path"] + ("?" + query if query else ""), request["body"], headers)


def rate(results: list[dict]) -> float:
    tokens = sum(max(0, r["tokens"] - 1) for r in results)
    seconds = sum(r["seconds"] for r in results)
    return tokens / seconds if seconds else 0.0


def edit_x4(port: int) -> list[dict]:
    """Four edit requests at once: all their tokens over the wall time from the first output to the
    last (as one result)."""
    results: list[dict] = [{}] * 4

    def one(i):
        results[i] = chat(port, edit_prompt(RENAMES[i]), EDIT_TOKENS)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["last"] for r in results) - min(r["first"] for r in results)
    return [{"text": "".join(r["text"] for r in results), "tokens": sum(r["tokens"] for r in results) - 3,
             "seconds": wall}]


def run_both(quick: bool, agent_tokens: int) -> dict:
    """Both servers up at once (one idles while the other works), each workload run on `off` and
    then on `auto`, so the machine's drift falls on both alike."""
    args = argparse.Namespace(slots=4, ctx=16384, cache_ram=2048)
    servers = {mode: start_server(args, extra=("--speculative", mode)) for mode in MODES}
    out: dict = {mode: {} for mode in MODES}
    try:
        for proc, port in servers.values():
            wait_ready(port, proc)
            chat(port, "Say hi.", 8)                                    # warm-up
        work = [("edit", lambda port: [chat(port, edit_prompt(RENAMES[0]), EDIT_TOKENS)]),
                ("prose", lambda port: [chat(port, PROSE, PROSE_TOKENS)])]
        turns = agent_turns(agent_tokens)
        if turns:
            work.append(("agent", lambda port: [replay(port, r) for r in turns]))
        if not quick:
            work.append(("edit x4", edit_x4))
        for name, run in work:
            for mode, (_, port) in servers.items():
                out[mode][name] = run(port)
                print(f"  {mode}: {name} {rate(out[mode][name]):.1f} tok/s", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return out


# ---- exactness: a verification's logits against decode steps' ---------------------------------------------

def exactness(positions: int = 8) -> str:
    """The demo's logits at `positions` drafted positions of one call against as many decode steps,
    compared to the bit, at one row and four (the tiny test models' shapes do not reach the float
    ops XLA orders by shape; the demo's do)."""
    import numpy as np

    from engine.model import jit_forward
    from engine.protocol import Submit
    from engine.registry import prepare, resolve
    from engine.worker import Engine, WorkerArgs
    engine = Engine(WorkerArgs("demo", str(prepare(resolve(None))), slots=4, ctx=4096))
    if engine.speculator.off:
        return f"drafting is off here: {engine.speculator.off}"
    rng = np.random.default_rng(0)
    engine.submit(Submit("p", [int(x) for x in rng.integers(100, 50000, 600)], 1))
    while engine.busy:
        engine.step()
    assert len(engine.scheduler.slots[0].tokens) == 600      # a fresh engine's first request: slot 0
    drafted = [int(x) for x in rng.integers(100, 50000, positions)]
    out = []
    for rows in (1, 4):
        tokens = np.zeros((rows, positions), np.int32)
        tokens[0] = drafted
        slots = np.arange(rows, dtype=np.int32)
        starts, lengths = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        starts[0], lengths[0] = 600, positions
        together, engine.cache, _ = jit_forward(engine.params, engine.cache, tokens, slots, starts, lengths,
                                                cfg=engine.cfg, verify=True)
        together = np.asarray(together)[0]
        worst = 0.0
        for i in range(positions):
            starts[0], lengths[0] = 600 + i, 1
            one, engine.cache = jit_forward(engine.params, engine.cache, tokens[:, i:i + 1], slots, starts,
                                            lengths, cfg=engine.cfg)
            worst = max(worst, float(np.abs(np.asarray(one)[0] - together[i]).max()))
        out.append(f"{rows} row(s): " + ("equal to the bit" if worst == 0 else f"DIFFER by up to {worst:.3g}"))
    return "; ".join(out)


# ---- llama.cpp --------------------------------------------------------------------------------------------

def llama_child(gguf: str, prompt: str, lookup: bool, new_tokens: int) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    # With a draft model llama-cpp-python keeps every position's logits (logits_all): n_ctx x vocab
    # floats, so the context is only as long as this run needs.
    n_ctx = len(prompt) // 3 + new_tokens + 256
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=2, n_threads_batch=2, verbose=False, logits_all=lookup,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None)
    llm.create_completion("Say hi.", max_tokens=4, temperature=0)
    first = last = None
    text = ""
    for chunk in llm.create_completion(prompt, max_tokens=new_tokens, temperature=0, stream=True):
        now = time.monotonic()
        first = first or now
        last = now
        text += chunk["choices"][0]["text"]
    tokens = len(llm.tokenize(text.encode(), add_bos=False, special=True))
    print(json.dumps({"tokens": tokens, "seconds": last - first, "text": text}))


def run_llama(prompt: str, lookup: bool) -> dict | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    from bench_vs_llamacpp import demo_gguf
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_speculative as b; "
            f"b.llama_child({str(demo_gguf())!r}, {prompt!r}, {lookup}, {EDIT_TOKENS})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        print(done.stderr[-2000:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="no edit x4 run")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--agent-tokens", type=int, default=256)
    a = p.parse_args()
    print(f"verification logits against decode steps' ({8} positions): {exactness()}", flush=True)
    print(f"1-minute load average at the start: {os.getloadavg()[0]:.2f}")
    runs = run_both(a.quick, a.agent_tokens)
    print(f"\n{'workload':10s} {'off tok/s':>10s} {'auto tok/s':>11s} {'ratio':>6s}  same answer")
    for name in runs["off"]:
        off, on = rate(runs["off"][name]), rate(runs["auto"][name])
        same = [x["text"] for x in runs["off"][name]] == [x["text"] for x in runs["auto"][name]]
        print(f"{name:10s} {off:10.1f} {on:11.1f} {on / off if off else 0:5.2f}x  {'yes' if same else 'NO'}")
    if not a.no_llama:
        rows = {lookup: run_llama(chat_text(edit_prompt(RENAMES[0])), lookup) for lookup in (False, True)}
        if rows[False] and rows[True]:
            plain, lookup = (rows[k]["tokens"] / rows[k]["seconds"] for k in (False, True))
            ours = rate(runs["auto"]["edit"])
            print(f"\nllama.cpp edit: {plain:.1f} tok/s plain, {lookup:.1f} with prompt lookup "
                  f"({lookup / plain:.2f}x); mashbox auto {ours:.1f} = {ours / lookup:.2f}x llama.cpp's lookup")
        else:
            print("\nllama.cpp: not run (llama-cpp-python missing or failed)")
    print(f"1-minute load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
