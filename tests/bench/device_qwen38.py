"""The spec's model, Qwen3.8-27B (`qwen3-8-27b`), with random weights on one accelerator chip: time per
output token at 1 and 16 busy slots, an 8k-token prefill, and what the worker holds, in bfloat16
and in fp8 (`qwen3-8-27b-fp8`), beside the published figures of other servers on the same chips.

    python tests/bench/device_qwen38.py [--dtypes bfloat16,fp8] [--layers N] [--cpu]

Run by tests/bench/device_check.sh (not in CI). For each dtype it runs `python -m mashbox run MODEL
--weights random --weights-dtype DTYPE --slots ROWS_MAX --ctx CTX` with a fresh MASHBOX_CACHE and
measures, through the HTTP API as a client sees it:
  - ready: empty caches to /health ok (weights drawn on the chip, every program compiled);
  - time per output token (TPOT) at 1 busy slot and at ROWS_MAX busy slots: the timings block's
    predicted_ms / predicted_n of DECODE_TOKENS-token answers, the requests sent at once;
  - prefill: one PREFILL_TOKENS-token prompt's prompt_per_second;
  - held: /v1/models' gb (what the worker holds).
--layers N serves the shape cut to N layers (a 4:1 mix stays 3 DeltaNet : 1 attention) for a short
run; TPOT then scales with the layers. On a machine whose JAX sees no accelerator it says so and
exits 0 (--cpu runs anyway, with --layers 4 and small sizes: a check of the script itself).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_startup import Server, uptime  # noqa: E402

MODELS = {"bfloat16": "qwen3-8-27b", "fp8": "qwen3-8-27b-fp8", "q4_k": "qwen3-8-27b"}
# The form random weights are drawn in for each held dtype (engine.checkpoint.RANDOM_FORMATS); q4_k
# is the CPU's (the --cpu check of this script: a 24 GB host holds the 27B's layers only so).
FORMS = {"bfloat16": "bf16", "fp8": "fp8", "q4_k": "q4_k"}
ROWS_MAX = 16
DECODE_TOKENS = 128
PREFILL_TOKENS = 8192
CTX = PREFILL_TOKENS + 2048           # the prefill and the decode rows fit; 16 slots of it fit 80 GB
# Published time per output token of one request (ms), SGLang with its MTP drafter on, Qwen3.6-27B
# (the same architecture): for the reader's comparison, not a bound.
PUBLISHED_TPOT_MS = {("H100", "bfloat16"): 7.4, ("H100", "fp8"): 5.3, ("H200", "bfloat16"): 5.6,
                     ("H200", "fp8"): 4.3}


def post(port: int, body: dict, path: str = "/v1/chat/completions") -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read() or b"{}")
    if response.status != 200:
        raise RuntimeError(f"{path}: HTTP {response.status}: {answer}")
    return answer


def decode_ms(port: int, rows: int, tokens: int) -> float:
    """Median time per output token of `rows` answers decoded together (ignore_eos-like: random weights
    rarely stop, and an early stop only shortens that row)."""
    body = {"messages": [{"role": "user", "content": "Count on."}], "max_tokens": tokens}
    with concurrent.futures.ThreadPoolExecutor(rows) as pool:
        answers = list(pool.map(lambda _: post(port, body), range(rows)))
    per_token = sorted(a["timings"]["predicted_ms"] / max(1, a["timings"]["predicted_n"]) for a in answers)
    return per_token[len(per_token) // 2]


def one_dtype(dtype: str, opts, cache: Path) -> None:
    model = MODELS[dtype]
    args = [model, "--weights", "random", "--weights-dtype", dtype, "--slots", str(opts.rows),
            "--ctx", str(opts.ctx)]
    if opts.layers:
        from engine import registry
        os.environ[registry.ENV_CACHE] = str(cache)
        spec = registry.resolve(model, "random")
        folder = registry.random_folder(spec, FORMS[dtype], {"num_hidden_layers": opts.layers})
        held = "int8" if dtype == "q4_k" else dtype      # a folder's blocks are held as they are with int8
        args = [str(folder), "--weights-dtype", held, "--slots", str(opts.rows), "--ctx", str(opts.ctx)]
    t0 = time.monotonic()
    server = Server(cache, tuple(args), echo=False)
    try:
        health = server.wait_ok()
        ready_s = time.monotonic() - t0
        card = server.get("/v1/models")["data"][0]
        kind = next((name for name in ("H200", "H100") if name in json.dumps(health.get("devices", ""))), None)
        post(server.port, {"messages": [{"role": "user", "content": "Warm."}], "max_tokens": 8})
        single = decode_ms(server.port, 1, opts.tokens)
        batch = decode_ms(server.port, opts.rows, opts.tokens)
        prompt = " ".join(["token"] * opts.prefill)      # about one token a word
        prefill = post(server.port, {"messages": [{"role": "user", "content": prompt}],
                                     "max_tokens": 1})["timings"]
        published = PUBLISHED_TPOT_MS.get((kind, dtype))
        print(f"{model} {dtype}{f' ({opts.layers} layers)' if opts.layers else ''}: ready {ready_s:.0f} s; "
              f"held {card['gb']:.1f} GB; TPOT {single:.2f} ms at 1 slot, {batch:.2f} ms at {opts.rows} "
              f"({opts.rows * 1000 / batch:.0f} tok/s); prefill {prefill['prompt_n']} tokens at "
              f"{prefill['prompt_per_second']:.0f} tok/s"
              + (f"; published (SGLang, MTP on): {published} ms at 1" if published else ""))
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", help="held forms, comma-separated (default bfloat16,fp8; --cpu: q4_k)")
    parser.add_argument("--layers", type=int, help="the shape cut to this many layers (a shorter run)")
    parser.add_argument("--cpu", action="store_true", help="run without an accelerator (checks the script)")
    opts = parser.parse_args()
    import jax
    if jax.default_backend() == "cpu" and not opts.cpu:
        print("device_qwen38: JAX sees no GPU or TPU here; nothing to measure")
        return 0
    opts.rows, opts.ctx, opts.tokens, opts.prefill = ROWS_MAX, CTX, DECODE_TOKENS, PREFILL_TOKENS
    if opts.cpu:                      # the script's own check: a few layers, small numbers
        opts.layers, opts.rows, opts.ctx, opts.tokens, opts.prefill = opts.layers or 4, 2, 1024, 4, 256
    opts.dtypes = opts.dtypes or ("q4_k" if opts.cpu else "bfloat16,fp8")
    print(f"# {uptime()}; {jax.devices()[0].device_kind}")
    status = 0
    for dtype in opts.dtypes.split(","):
        cache = Path(tempfile.mkdtemp(prefix="mashbox-device-"))
        try:
            one_dtype(dtype, opts, cache)
        except RuntimeError as e:
            print(f"{MODELS[dtype]} {dtype}: {e}")
            status = 1
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
