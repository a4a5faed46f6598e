"""The model on one accelerator chip: parity with transformers, and speed beside the HBM bound.

    python tests/bench/device_bench.py [--layers 36] [--tiny-shape] [--cpu]

Run by tests/bench/device_check.sh (not in CI). On a machine whose JAX sees no GPU or TPU it says so
and exits 0 at once (--cpu runs it on the CPU anyway, for development; with --tiny-shape too, it
takes seconds). On the first chip:
  - parity: every tiny fixture model (tests/fixtures/tiny/*, float32, matrix products at full
    float32 precision) prefilled at once, every position's logits against transformers' float32
    logits (reference.safetensors), within PARITY_ATOL;
  - speed of a random-weight model shaped like Qwen3-8B (36 layers, hidden 4096, 32 query and 8 KV
    heads of 128, MLP 12288, vocabulary 151936, untied head), in bfloat16, in int8 weight-only
    weights and in fp8 (an FP8 checkpoint's float8 projections with 128 x 128 block scales): decode
    tok/s at 1 and 8 busy rows (each row DECODE_CONTEXT tokens deep) and prefill tok/s of one
    PREFILL_TOKENS-token chunk, each beside its bound: decode reads every weight and
    each row's K/V once per step, so tok/s <= rows x bandwidth / bytes; prefill is bounded by the
    same read per chunk and by the chip's dense bfloat16 FLOP/s (2 FLOPs per weight per token),
    whichever is lower. Bandwidth and FLOP/s come from the device's name (CHIPS); an unknown chip
    gets no bound, and the script says so.
  - one FP8 matrix's product three ways (fp8_products): bfloat16 weights, the engine's (float8
    widened per block at use), and XLA's float8 x float8 dot of rows rounded to float8 (a per-tensor
    scale: the speed an FP8 dot would reach, not the engine's numbers);
The random model's layout is load_weights' own: one layer is laid out from stand-in tensors and each
of its arrays is then drawn at random on the chip, per layer.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from engine import weights as weights_module  # noqa: E402
from engine.cache import init_cache  # noqa: E402
from engine.checkpoint import FP8  # noqa: E402
from engine.config import FP8_DEFAULT_BLOCK, config_from_dict, load_config  # noqa: E402
from engine.attention import kv_dtype_for  # noqa: E402
from engine.model import jit_forward  # noqa: E402
from engine.weights import load_weights, quantized_tensor, weights_bytes  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "tiny")
# float32 on both sides at full precision: only the order of the sums differs (1.5e-5 on a CPU).
PARITY_ATOL = 1e-3
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
TINY_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}
ROWS = (1, 8)
DECODE_CONTEXT = 1024         # tokens already in each decoding row's cache
PREFILL_TOKENS = 2048
CTX = 4096                    # cache depth per slot: the prefill chunk and the decode rows fit
DECODE_STEPS = 32
PREFILL_REPEATS = 3
# (name fragment as jax's device_kind spells it, HBM bytes/s, dense bfloat16 FLOP/s or None), the
# most specific fragment first. Vendors' data sheets.
CHIPS = (
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),               # SXM, "NVIDIA H100 80GB HBM3"
    ("GH200", 4.0e12, 989e12),
    ("B200", 8.0e12, 2250e12),
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),              # the 40 GB cards
    ("L40S", 864e9, 362e12),
    ("L40", 864e9, 181e12),
    ("L4", 300e9, 121e12),
    ("A10G", 600e9, None),
    ("A10", 600e9, 125e12),
    ("T4", 320e9, None),
    ("V100", 900e9, None),
    ("TPU v6", 1.64e12, 918e12),             # Trillium (v6e)
    ("TPU v5 lite", 819e9, 197e12),          # v5e
    ("TPU v5", 2.765e12, 459e12),            # v5p
    ("TPU v4", 1.2e12, 275e12),
)


def chip_limits(kind: str) -> tuple[float | None, float | None]:
    for fragment, bandwidth, flops in CHIPS:
        if fragment.lower() in kind.lower():
            return bandwidth, flops
    return None, None


# ---- parity --------------------------------------------------------------------------------------

def parity() -> bool:
    from safetensors.numpy import load_file
    ok = True
    with jax.default_matmul_precision("highest"):
        for folder in sorted(glob.glob(os.path.join(TINY, "*", "reference.safetensors"))):
            folder = os.path.dirname(folder)
            cfg = load_config(folder)
            params = load_weights(folder, cfg, jnp.float32)
            ref = load_file(os.path.join(folder, "reference.safetensors"))
            tokens = jnp.asarray(ref["tokens"][None, :], jnp.int32)
            one = jnp.zeros((1,), jnp.int32)
            logits, _ = jit_forward(params, init_cache(cfg, 2, 128, jnp.float32), tokens, one, one,
                                    jnp.asarray([tokens.shape[1]], jnp.int32), cfg=cfg, all_logits=True)
            diff = float(np.max(np.abs(np.asarray(logits[0]) - ref["logits"])))
            good = diff <= PARITY_ATOL
            ok &= good
            print(f"  parity {os.path.basename(folder):14s} max |logit - transformers| {diff:.2e} "
                  f"{'ok' if good else f'> {PARITY_ATOL}'}", flush=True)
    return ok


# ---- the random Qwen3-8B-shaped model ------------------------------------------------------------

class _StandIn:
    """Tensors of the asked shape, one value everywhere (a broadcast view: no memory until laid out).
    With `float8` set, the layer projections are an FP8 checkpoint's (float8, 128 x 128 blocks)."""
    float8 = False

    def __init__(self, folder: str):
        pass

    def has(self, name: str) -> bool:
        return False

    def format(self, name: str) -> str:
        return FP8 if self.float8 and quantized_tensor(name) and "layers" in name else "BF16"

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.broadcast_to(np.float32(0.02), shape)

    def fp8(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        rows, cols = shape
        return (np.zeros(shape, ml_dtypes.float8_e4m3fn),
                np.ones((rows, -(-cols // FP8_DEFAULT_BLOCK[1])), np.float32))


def random_params(cfg_dict: dict, dtype) -> tuple[dict, object]:
    """The params pytree load_weights lays out for this config (dtype: jnp.bfloat16, or "int8" or
    "fp8" with bfloat16 for the rest), every array drawn at random on the default device."""
    cfg = config_from_dict(cfg_dict)
    one_layer = config_from_dict({**cfg_dict, "num_hidden_layers": 1})
    shapes = lambda path, tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    real = weights_module._Reader
    weights_module._Reader = type("StandIn", (_StandIn,), {"float8": dtype == "fp8"})
    try:
        template = load_weights("", one_layer, dtype, float_dtype=jnp.bfloat16, place=shapes)
    finally:
        weights_module._Reader = real
    key = [jax.random.PRNGKey(0)]

    def draw(path, leaf):
        key[0], sub = jax.random.split(key[0])
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.ones(leaf.shape, leaf.dtype)
        if leaf.dtype == jnp.int8:
            return jax.random.randint(sub, leaf.shape, -127, 128, jnp.int32).astype(jnp.int8)
        if leaf.dtype == jnp.float8_e4m3fn:
            return jax.random.normal(sub, leaf.shape, jnp.float32).astype(leaf.dtype)
        if "scale" in name:
            return jnp.full(leaf.shape, 0.02 / 127, leaf.dtype)
        return (0.02 * jax.random.normal(sub, leaf.shape, jnp.float32)).astype(leaf.dtype)

    layer = template["layers"][0]
    params = {"embed": jax.tree_util.tree_map_with_path(draw, template["embed"]),
              "norm": jnp.ones(template["norm"].shape, template["norm"].dtype),
              "layers": [jax.tree_util.tree_map_with_path(draw, layer) for _ in range(cfg.num_layers)]}
    params["lm_head"] = (params["embed"] if cfg.tie_word_embeddings
                         else jax.tree_util.tree_map_with_path(draw, template["lm_head"]))
    jax.block_until_ready(params)
    return params, cfg


def _bound(value: float | None, unit: str = "tok/s") -> str:
    return f"{value:,.0f} {unit}" if value else "unknown chip"


def speed(cfg_dict: dict, label: str, dtype, bandwidth: float | None, flops: float | None) -> None:
    t = time.perf_counter()
    params, cfg = random_params(cfg_dict, dtype)
    w_bytes = weights_bytes(params)
    kv_dtype = kv_dtype_for(jax.default_backend())
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(kv_dtype).itemsize
    matrix_params = sum(x.size for x in jax.tree.leaves(params["layers"])) + cfg.vocab_size * cfg.hidden_size
    print(f"  {label}: weights {w_bytes / 1e9:.2f} GB, drawn in {time.perf_counter() - t:.1f} s", flush=True)
    cache = init_cache(cfg, max(ROWS), CTX, kv_dtype)
    for rows in ROWS:
        slots = jnp.arange(rows, dtype=jnp.int32)
        starts = jnp.full((rows,), DECODE_CONTEXT, jnp.int32)
        lengths = jnp.ones((rows,), jnp.int32)
        tokens = jnp.ones((rows, 1), jnp.int32)
        t = time.perf_counter()
        logits, cache = jit_forward(params, cache, tokens, slots, starts, lengths, cfg=cfg)
        logits.block_until_ready()
        compiled = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(DECODE_STEPS):     # the cache is donated from step to step, as the worker does
            logits, cache = jit_forward(params, cache, tokens, slots, starts, lengths, cfg=cfg)
        logits.block_until_ready()
        rate = rows * DECODE_STEPS / (time.perf_counter() - t)
        step_bytes = w_bytes + rows * DECODE_CONTEXT * kv_per_token
        bound = rows * bandwidth / step_bytes if bandwidth else None
        share = f" ({rate / bound:.0%} of it)" if bound else ""
        print(f"  {label} decode, {rows} row(s) at {DECODE_CONTEXT} positions: {rate:,.1f} tok/s; HBM bound "
              f"{_bound(bound)}{share}; first call {compiled:.1f} s", flush=True)
    tokens = jnp.ones((1, PREFILL_TOKENS), jnp.int32)
    zero = jnp.zeros((1,), jnp.int32)
    length = jnp.full((1,), PREFILL_TOKENS, jnp.int32)
    t = time.perf_counter()
    logits, cache = jit_forward(params, cache, tokens, zero, zero, length, cfg=cfg)
    logits.block_until_ready()
    compiled = time.perf_counter() - t
    best = float("inf")
    for _ in range(PREFILL_REPEATS):
        t = time.perf_counter()
        logits, cache = jit_forward(params, cache, tokens, zero, zero, length, cfg=cfg)
        logits.block_until_ready()
        best = min(best, time.perf_counter() - t)
    rate = PREFILL_TOKENS / best
    read_bound = PREFILL_TOKENS * bandwidth / w_bytes if bandwidth else None
    compute_bound = flops / (2 * matrix_params) if flops else None
    bounds = [b for b in (read_bound, compute_bound) if b]
    share = f" ({rate / min(bounds):.0%} of the lower)" if bounds else ""
    print(f"  {label} prefill, one {PREFILL_TOKENS}-token chunk: {rate:,.0f} tok/s; bounds: HBM "
          f"{_bound(read_bound)}, bfloat16 compute {_bound(compute_bound)}{share}; first call "
          f"{compiled:.1f} s", flush=True)
    del params, cache, logits


def fp8_products(bandwidth: float | None) -> None:
    """An [12288, 4096] matrix (Qwen3-8B's MLP up, FP8) times 1, 8 and PREFILL_TOKENS rows: bfloat16
    weights, the engine's product (engine.products: float8 widened per block at use), and a float8 x
    float8 dot. Median of 20 calls each."""
    from engine.products import matmul
    out, inp = 12288, 4096
    key = jax.random.PRNGKey(1)
    f8 = jax.random.normal(key, (out, inp), jnp.float32).astype(jnp.float8_e4m3fn)
    held = {"f8": f8, "f8_scale": jnp.full((out, inp // FP8_DEFAULT_BLOCK[1]), 0.01, jnp.float32)}
    wide = (f8.astype(jnp.float32) * 0.01).astype(jnp.bfloat16)

    def dot8(x, w):
        xs = jnp.max(jnp.abs(x)) / 448.0
        y = jax.lax.dot_general((x / xs).astype(jnp.float8_e4m3fn), w, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y * xs * 0.01

    ways = (("bfloat16 weights", jax.jit(lambda x: matmul(x, wide)), 2),
            ("fp8 widened at use", jax.jit(lambda x: matmul(x, held)), 1),
            ("fp8 x fp8 dot", jax.jit(lambda x: dot8(x, f8)), 1))
    for rows in (1, 8, PREFILL_TOKENS):
        x = jax.random.normal(key, (rows, inp), jnp.float32)
        line = []
        for name, fn, weight_bytes in ways:
            fn(x).block_until_ready()
            times = []
            for _ in range(20):
                t = time.perf_counter()
                fn(x).block_until_ready()
                times.append(time.perf_counter() - t)
            us = float(np.median(times)) * 1e6
            share = f" ({out * inp * weight_bytes / (us * 1e-6) / bandwidth:.0%} of HBM)" if bandwidth else ""
            line.append(f"{name} {us:,.0f} us{share}")
        print(f"  fp8 product, {rows} row(s): " + "; ".join(line), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=QWEN3_8B["num_hidden_layers"])
    p.add_argument("--tiny-shape", action="store_true", help="a small model of the same kind (development)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU anyway (development)")
    args = p.parse_args()
    backend = jax.default_backend()
    if backend == "cpu" and not args.cpu:
        print("device_bench: found no GPU or TPU (JAX's backend is cpu): nothing to measure")
        return 0
    device = jax.devices()[0]
    bandwidth, flops = chip_limits(device.device_kind)
    known = (f"HBM {bandwidth / 1e12:.2f} TB/s" + (f", {flops / 1e12:.0f} TFLOP/s bfloat16" if flops else "")
             if bandwidth else "not in this script's table: no bounds")
    print(f"device_bench: {device.device_kind} ({backend}, {len(jax.devices())} device(s), measuring one): "
          f"{known}", flush=True)
    ok = parity()
    shape = {**QWEN3_8B, **(TINY_SHAPE if args.tiny_shape else {})}
    if not args.tiny_shape:
        shape["num_hidden_layers"] = args.layers
    print(f"  random model: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
          f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads of {shape['head_dim']}, "
          f"MLP {shape['intermediate_size']}, vocabulary {shape['vocab_size']}", flush=True)
    fp8_products(bandwidth)
    for label, dtype in (("bfloat16", jnp.bfloat16), ("int8", "int8"), ("fp8", "fp8")):
        speed(shape, label, dtype, bandwidth, flops)
    print("device_bench: parity " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
