"""What drafting costs where nothing it drafts is kept: Qwen3.8-27B's layers with random weights (its
MTP module drawn too), --speculative auto (and mtp) against off, side by side (run by hand, not in CI).

    python tests/bench/bench_mtp_cost.py [--layers 16] [--tokens 96] [--rounds 3] [--modes off,auto,mtp]

The model: qwen3-8-27b's config with --layers of its 64 (3 Gated DeltaNet then 1 attention, repeated;
its embedding, head and MTP module whole), random Q4_K weights, one slot of 4096 tokens: three
engines of the full 64 layers would not fit a 24 GB host, and fewer layers make the MTP layer a
larger share of a step (at 16, one layer in 17) than it is in the 27B (one in 65), so the cost
measured is an upper bound.
Random weights keep almost nothing the MTP layer drafts, the case where drafting only costs. Each
engine is built in this process, then each round runs one greedy request of --tokens new tokens from
the same 64-token prompt on each engine in turn; decode tok/s = (tokens - 1) / the request's
predicted_ms. Prints the medians, their ratio to off, the drafts made and kept, and the load average.
Results: docs/speculative.md, docs/perf-log.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from engine import registry  # noqa: E402
from engine.protocol import Submit  # noqa: E402
from engine.worker import Engine, WorkerArgs  # noqa: E402

PROMPT_TOKENS = 64


def run(engine: Engine, rid: str, prompt: list[int], tokens: int) -> dict:
    engine.submit(Submit(rid, prompt, tokens))
    while True:
        for step in engine.step():
            if step.rid == rid and step.finish:
                return step.timings or {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="off,auto,mtp")
    a = p.parse_args()
    spec = registry.resolve("qwen3-8-27b", "random")
    folder = str(registry.random_folder(spec, "q4_k", {"num_hidden_layers": a.layers}))
    modes = a.modes.split(",")
    engines = {mode: Engine(WorkerArgs(spec.id, folder, slots=1, ctx=4096, dtype="int8", speculative=mode,
                                       certify_dir=None)) for mode in modes}
    for mode, engine in engines.items():
        print(f"{mode}: {engine.facts.speculative}", flush=True)
    prompt = np.random.default_rng(0).integers(0, 20_000, PROMPT_TOKENS).tolist()
    rates = {mode: [] for mode in modes}
    drafts = {mode: [0, 0] for mode in modes}
    for r in range(a.rounds):
        for mode, engine in engines.items():
            t = run(engine, f"{mode}-{r}", prompt, a.tokens)
            rates[mode].append((a.tokens - 1) / (t["predicted_ms"] / 1000))
            drafts[mode][0] += t.get("draft_n", 0)
            drafts[mode][1] += t.get("draft_n_accepted", 0)
    print(f"qwen3-8-27b, {a.layers} layers, random Q4_K with its MTP module; {a.tokens} tokens x "
          f"{a.rounds} rounds; load {os.getloadavg()[0]:.2f}")
    off = statistics.median(rates["off"]) if "off" in rates else None
    for mode in modes:
        rate = statistics.median(rates[mode])
        ratio = f", {rate / off:.3f}x off" if off else ""
        print(f"  {mode:5s} {rate:6.2f} tok/s{ratio}; drafted {drafts[mode][0]}, kept {drafts[mode][1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
