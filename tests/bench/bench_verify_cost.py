"""What a verification of drafts costs against a decode step at Qwen3.8-27B's layer shapes (run by
hand, not in CI).

    python tests/bench/bench_verify_cost.py [--folder DIR] [--ctx 4096] [--runs 7] [--tokens 2-16]

Writes the full-width slice (tests/fixtures/qwen3_8_slice.py: 3 Gated DeltaNet layers and 1 gated
attention layer at hidden 5120, the 27B's 3:1 mix, a small vocabulary) unless --folder holds it, loads
it as the worker serves drafting (int8 weights packed for the native kernel, an int8 KV cache, one
slot), and times on idle rows, as the worker's warm-up does (engine.worker: _time_programs): a decode
step (1 token), and a verification of T tokens for each T of --tokens (default: the worker's, 4 and 8;
the row's token and T - 1 drafts, the DeltaNet positions one at a time in decode steps' arithmetic,
each position's state kept). Each figure is the median of --runs calls after a first; the ratio to
the decode step is what a draft must earn back: beside it, the acceptance (each draft kept with that
probability given the ones before it were, engine.speculative: expected_tokens) at which the T - 1
drafts break even. Results: docs/perf-log.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", help="the slice, written there if absent (default: a temporary folder)")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--tokens", help="the verification lengths T: a list (4,8) or a range (2-16)")
    a = p.parse_args()
    import jax

    from engine import native, sharding
    from engine.cache import init_cache
    from engine.config import load_config
    from engine.model import jit_forward
    from engine.scheduler import VERIFY_TOKENS
    from engine.weights import load_weights, packs_int8
    from tests.fixtures.qwen3_8_slice import write_slice

    folder = a.folder or tempfile.mkdtemp(prefix="mashbox-slice-")
    try:
        if not os.path.exists(os.path.join(folder, "config.json")):
            t0 = time.perf_counter()
            write_slice(folder)
            print(f"slice written in {time.perf_counter() - t0:.0f} s", flush=True)
        native.prepare()
        layout = sharding.Layout.build(load_config(folder), 1)
        cfg = layout.cfg
        params = load_weights(folder, load_config(folder), "int8", float_dtype=np.float32,
                              kv_heads=cfg.num_kv_heads, place=layout.place, pack=packs_int8("int8", cfg.native))
        cache = init_cache(cfg, 1, a.ctx, np.int8, zeros=layout.cache_zeros)
        print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; kernel "
              f"{'native ' + native.tier() if cfg.native else 'xla'}", flush=True)
        times = {}
        # (tokens, verify): the decode step, the verification's path with one token (no draft: the
        # two paths side by side), and the verifications the worker builds
        for t, verify in [(1, False), (1, True)] + [(t, True) for t in _lengths(a.tokens, VERIFY_TOKENS)]:
            args = (np.zeros((1, t), np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32))
            runs = []
            for i in range(1 + a.runs):
                t0 = time.perf_counter()
                logits, cache, *_ = jit_forward(params, cache, *args, cfg=cfg, verify=verify)
                jax.block_until_ready(logits)
                if i:
                    runs.append(time.perf_counter() - t0)
            times[t, verify] = statistics.median(runs)
        step = times[1, False]
        for (t, verify), s in times.items():
            what = "decode step" if not verify else f"verification of 1 + {t - 1}"
            even = _break_even(t - 1, s / step) if verify and t > 1 else None
            print(f"{what:>24}: {s * 1000:7.1f} ms  ({s / step:.2f}x)"
                  + (f"  breaks even at acceptance {even:.2f}" if even is not None else ""), flush=True)
        print(f"load at the end {os.getloadavg()[0]:.2f}")
    finally:
        if not a.folder:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


def _lengths(spec: str | None, default) -> list[int]:
    if not spec:
        return list(default)
    if "-" in spec:
        low, high = map(int, spec.split("-"))
        return list(range(low, high + 1))
    return [int(t) for t in spec.split(",")]


def _break_even(drafts: int, cost: float) -> float | None:
    """The acceptance at which a verification of 1 + drafts costing `cost` decode steps gives as many
    tokens per second as decode steps (bisection: expected_tokens rises with the acceptance); None
    where even every draft kept does not pay."""
    from engine.speculative import expected_tokens
    if expected_tokens(drafts, 1.0) < cost:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens(drafts, mid) < cost else (low, mid)
    return high


if __name__ == "__main__":
    sys.exit(main())
