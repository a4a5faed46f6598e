"""A large model's layers run as one program each against one fused program of them all (run by
hand, not in CI).

    python tests/bench/bench_layered.py [--layers 16] [--distinct 4] [--chunk 512] [--rounds 9]

Qwen3.8-27B's layers at full width with random Q4_K weights: --distinct of them drawn and read in
turn as --layers (so that the host holds them; each step still streams every layer's weights from
memory), its embedding and head whole. The same calls the engine makes (engine.model.jit_forward
with cfg.layered off and on), alternated --rounds times in one process, both compiled before: a
--chunk-token prefill chunk from position 0, then 8 decode steps after it. Prints the medians and
layered / fused, and each form's minor page faults in one chunk (a program's temporaries that
glibc maps afresh at each call). Results: docs/perf-log.md ("One program per layer").
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from engine import native, registry, sharding  # noqa: E402
from engine.cache import init_cache  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.model import jit_forward  # noqa: E402
from engine.weights import load_weights, packs_int8  # noqa: E402

CTX = 4096
DECODE_STEPS = 8


def minor_faults() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--distinct", type=int, default=4)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    native.prepare()
    spec = registry.resolve("qwen3-8-27b", "random")
    folder = str(registry.random_folder(spec, "q4_k", {"num_hidden_layers": a.distinct}))
    raw = load_config(folder)
    layout = sharding.Layout.build(raw, 1)
    params = load_weights(folder, raw, "int8", float_dtype=np.float32, kv_heads=layout.cfg.num_kv_heads,
                          place=layout.place, pack=packs_int8("int8", layout.cfg.native))
    whole = load_config(str(registry.random_folder(spec, "q4_k", {})))
    cfg = dataclasses.replace(layout.cfg, num_layers=a.layers, layer_kinds=whole.layer_kinds[:a.layers],
                              mlp_kinds=whole.mlp_kinds[:a.layers])
    params = dict(params, layers=[params["layers"][i % a.distinct] for i in range(a.layers)])
    forms = {False: dataclasses.replace(cfg, layered=False), True: dataclasses.replace(cfg, layered=True)}
    caches = {k: init_cache(c, 1, CTX, np.int8, zeros=layout.cache_zeros) for k, c in forms.items()}
    prompt = np.random.default_rng(0).integers(0, 20_000, (1, a.chunk)).astype(np.int32)
    one, start = np.zeros(1, np.int32), np.zeros(1, np.int32)
    times = {(what, k): [] for what in ("chunk", "decode") for k in forms}
    faults = {k: [] for k in forms}

    def run(layered: bool, record: bool) -> None:
        c = forms[layered]
        f0, t0 = minor_faults(), time.perf_counter()
        logits, caches[layered] = jit_forward(params, caches[layered], prompt, one, start,
                                              np.array([a.chunk], np.int32), cfg=c)
        jax.block_until_ready(logits)
        if record:
            times[("chunk", layered)].append(time.perf_counter() - t0)
            faults[layered].append(minor_faults() - f0)
        for i in range(DECODE_STEPS):
            t0 = time.perf_counter()
            logits, caches[layered] = jit_forward(params, caches[layered], prompt[:, i:i + 1], one,
                                                  np.array([a.chunk + i], np.int32), np.ones(1, np.int32), cfg=c)
            jax.block_until_ready(logits)
            if record:
                times[("decode", layered)].append(time.perf_counter() - t0)

    for layered in forms:                   # compiles and first runs
        run(layered, False)
    for r in range(a.rounds):
        for layered in ((False, True) if r % 2 == 0 else (True, False)):
            run(layered, True)
    print(f"Qwen3.8-27B's layers, {a.layers} ({a.distinct} distinct, random Q4_K), {a.rounds} rounds alternated")
    for what in ("chunk", "decode"):
        fused, layered = (statistics.median(times[(what, k)]) for k in (False, True))
        print(f"{what:>6} ({a.chunk if what == 'chunk' else 1} tokens): fused {fused * 1e3:9.1f} ms, layered "
              f"{layered * 1e3:9.1f} ms, layered / fused {layered / fused:.3f}")
    print(f"minor page faults in a chunk: fused {statistics.median(faults[False]):.0f}, "
          f"layered {statistics.median(faults[True]):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
