"""One model split over 1, 2, 4 ... devices (engine.sharding) gives the logits of one device.

    python tests/tp_parity.py FOLDER [--devices 1 2 4] [--weights-dtype float32|int8]
        [--routed-path auto|kernel|exact] [--coordinator HOST:PORT --num-processes P --process-id I]

Prints one JSON object: for each device count, the largest logit difference from the first count
in prefill (two chunks, every position) and in decode (a batch of every slot, one live row, three
steps), how the weights and the cache came out split (specs and each device's shard shape), and
the collectives of the compiled prefill and decode programs.
On a CPU, run it with XLA_FLAGS=--xla_force_host_platform_device_count=4 (set before jax starts):
tests/test_sharding.py does; tests/bench/device_check.sh runs it on an accelerator's chips.
With a coordinator, P processes (one per host, or several on one machine) each bring --devices
devices to one mesh (jax.distributed, engine.sharding.init_distributed), run the same programs, and
each prints the logits gathered from every process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from engine.cache import init_cache  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.model import jit_forward  # noqa: E402
from engine.moe import routed_report  # noqa: E402
from engine.sharding import Layout, distributed_settings, init_distributed  # noqa: E402
from engine.weights import load_weights  # noqa: E402

SLOTS, CTX = 4, 64
CHUNKS = ((0, 20), (20, 12))       # (start, tokens) of the two prefill chunks, both in a 32 bucket
BUCKET = 32
DECODE_STEPS = 3
SLOT = 1


def _host(array) -> np.ndarray:
    """A global array as numpy on this process (gathered from the other processes' devices)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


# Cross-device operations in a compiled program's text: "= <shape> <op>(" (or its async "-start"),
# the shape one array's or a tuple's (XLA combines neighbouring all-reduces into one of a tuple).
COLLECTIVE = re.compile(r"^\s*(?:ROOT )?\S+ = ([^=\n]*?) (all-gather|all-reduce|all-to-all|"
                        r"collective-permute|reduce-scatter)(?:-start)?\(", re.M)
ARRAY = re.compile(r"\w+\[[\d,]*\]")


def _collectives(program) -> dict:
    """{"op shape": count} of a compiled program: what XLA inserted between the devices, each array
    of a combined (tuple) collective counted on its own."""
    out: dict[str, int] = {}
    for shape, op in COLLECTIVE.findall(program.as_text()):
        for array in ARRAY.findall(shape):
            out[f"{op} {array}"] = out.get(f"{op} {array}", 0) + 1
    return out


def _spec(array) -> list:
    """The array's PartitionSpec, one entry per dimension (None: not split)."""
    spec = list(array.sharding.spec) + [None] * (array.ndim - len(array.sharding.spec))
    return [s if s is None or isinstance(s, str) else list(s) for s in spec]


def _split(array) -> dict:
    return {"spec": _spec(array), "shard": list(array.addressable_shards[0].data.shape),
            "shape": list(array.shape)}


def run(folder: str, devices: int, weights_dtype: str, routed_path: str = "auto") -> dict:
    checkpoint = dataclasses.replace(load_config(folder), routed_path=routed_path)
    layout = Layout.build(checkpoint, devices)
    cfg = layout.cfg
    params = load_weights(folder, checkpoint, weights_dtype, float_dtype=np.float32,
                          kv_heads=cfg.num_kv_heads, place=layout.place, pack=False)
    cache = init_cache(cfg, SLOTS, CTX, np.float32, zeros=layout.cache_zeros)
    prompt = (np.arange(sum(n for _, n in CHUNKS)) * 7 + 3) % cfg.vocab_size
    prefill = []
    for start, n in CHUNKS:
        tokens = np.zeros((1, BUCKET), np.int32)
        tokens[0, :n] = prompt[start:start + n]
        logits, cache = jit_forward(params, cache, tokens, np.array([SLOT], np.int32),
                                    np.array([start], np.int32), np.array([n], np.int32), cfg=cfg,
                                    all_logits=True)
        prefill.append(_host(logits)[0, :n])
        prefill_args = (params, cache, tokens, np.array([SLOT], np.int32), np.array([start], np.int32),
                        np.array([n], np.int32))
    decode, position, token = [], len(prompt), int(np.argmax(prefill[-1][-1]))
    for _ in range(DECODE_STEPS):
        tokens, starts, lengths = (np.zeros((SLOTS, 1), np.int32), np.zeros(SLOTS, np.int32),
                                   np.zeros(SLOTS, np.int32))
        tokens[SLOT, 0], starts[SLOT], lengths[SLOT] = token, position, 1
        logits, cache = jit_forward(params, cache, tokens, np.arange(SLOTS, dtype=np.int32), starts,
                                    lengths, cfg=cfg)
        decode.append(_host(logits)[SLOT])
        decode_args = (params, cache, tokens, np.arange(SLOTS, dtype=np.int32), starts, lengths)
        # the tokens the first run would pick are fed to every run: the logits stay comparable
        token, position = int(np.argmax(decode[-1])), position + 1
    attention = next(i for i, layer in enumerate(cache) if "k" in layer)
    layer = params["layers"][attention]
    moe = next((p["moe"] for p in params["layers"] if "moe" in p), None)
    linear = next((i for i, p in enumerate(params["layers"]) if "linear" in p), None)
    qkv = layer["qkv"]["q"] if isinstance(layer["qkv"], dict) else layer["qkv"]
    return {"prefill": np.concatenate(prefill), "decode": np.stack(decode), "facts": {
        "layout": layout.describe(),
        "cache_k": {"spec": _spec(cache[attention]["k"]),
                    "shard": list(cache[attention]["k"].addressable_shards[0].data.shape),
                    "shape": list(cache[attention]["k"].shape)},
        "cache_v": {"spec": _spec(cache[attention]["v"]),
                    "shard": list(cache[attention]["v"].addressable_shards[0].data.shape)},
        "qkv": {"spec": _spec(qkv), "shard": list(qkv.addressable_shards[0].data.shape)},
        "embed": _spec(params["embed"]["q"] if isinstance(params["embed"], dict) else params["embed"]),
        "int8_scale": _spec(layer["qkv"]["scale"]) if isinstance(layer["qkv"], dict) else None,
        "decode_collectives": _collectives(jit_forward.lower(*decode_args, cfg=cfg).compile()),
        "prefill_collectives": _collectives(jit_forward.lower(*prefill_args, cfg=cfg,
                                                              all_logits=True).compile()),
        "experts": moe and {name: _split(moe[name]) for name in ("gate_up", "down")},
        "routed": routed_report(cfg),
        "linear": linear is not None and dict(
            {name: _split(params["layers"][linear]["linear"][name]) for name in ("in", "conv", "out")},
            **{f"cache_{name}": _split(cache[linear][name]) for name in ("conv", "state")}) or None,
    }}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--weights-dtype", default="float32")
    parser.add_argument("--routed-path", default="auto")
    parser.add_argument("--check", type=float, metavar="TOLERANCE",
                        help="print a line per count instead of JSON; exit 1 past this difference")
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args()
    init_distributed(distributed_settings(args.coordinator, args.num_processes, args.process_id))
    runs = {n: run(args.folder, n, args.weights_dtype, args.routed_path) for n in args.devices}
    first = runs[args.devices[0]]
    out = {"platform": jax.default_backend(), "visible": len(jax.devices()),
           "processes": jax.process_count(), "process": jax.process_index(), "runs": {}}
    for n, r in runs.items():
        out["runs"][str(n)] = dict(r["facts"],
                                   prefill_diff=float(np.max(np.abs(r["prefill"] - first["prefill"]))),
                                   decode_diff=float(np.max(np.abs(r["decode"] - first["decode"]))),
                                   logit_std=float(first["prefill"].std()),
                                   # the logits themselves, rounded, to compare separate runs
                                   last=np.round(r["decode"][-1].astype(np.float64), 5).tolist())
    if args.check is None:
        print(json.dumps(out))
        return
    worst = 0.0
    for n, r in out["runs"].items():
        worst = max(worst, r["prefill_diff"], r["decode_diff"])
        print(f"{os.path.basename(args.folder)} {args.weights_dtype} on {n} {out['platform']} device(s): "
              f"prefill {r['prefill_diff']:.2e}, decode {r['decode_diff']:.2e} (logit std "
              f"{r['logit_std']:.2f}); cache K {r['cache_k']['spec']}, "
              f"each device's shard {r['cache_k']['shard']}")
    sys.exit(0 if worst <= args.check else 1)


if __name__ == "__main__":
    main()
