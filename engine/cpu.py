"""What this CPU's instructions make fast, read once from its flags (/proc/cpuinfo). No jax: the
server sizes a worker (engine.memory) before one starts, and the answer must be the worker's.

The choices rest on measurements (engine.products, beside INT8_ROWS_MAX_ROWS and UINT8_DOT;
tests/bench/bench_narrow.py), not on the platform's name: a product runs in a narrow type where the
CPU has dot-product instructions for that type, else in float32. What `auto` holds on each kind of
CPU, with or without the native kernel (engine.native.TIERS; MASHBOX_NATIVE=0 or no compiler), and
what stands behind it (docs/perf-log.md):

  CPU flags              kernel tier    weights  KV cache  measured
  avx512_vnni, bw, vl    avx512_vnni    int8     int8      Zen 4: int8 1.4-1.8x float32 at 1-4 rows
                                                           without the kernel; decode with it
                                                           1.13-1.41x llama.cpp after 512 tokens
  avx2, fma, f16c        avx2           int8     int8      Zen 3: decode 1.27x llama.cpp after 512
                                                           tokens, 1.55x after 8k; without the kernel
                                                           int8 1.49x float32 at 1 row, 1.14x at 4,
                                                           and the int8 cache no slower than float16
  avx_vnni (no AVX-512)  avx_vnni       int8     int8      its products, forced on an Emerald Rapids
                                                           Xeon: int8 and Q8_0 at 16-64 rows 1.3-1.9x
                                                           the avx2 tier's, 1-4 rows and Q5_0 /
                                                           K-quants the same; no such CPU here to
                                                           time a whole decode
  asimddp (ARM)          neon_dotprod   int8     int8      not measured (tested under qemu-user only)
  none of these          none           float32  float16   not measured: the safe choice
"""
from __future__ import annotations

from functools import lru_cache

# Instruction sets with bfloat16 dot products (XLA:CPU's bfloat16 dot uses them for a prefill chunk).
BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# Instruction sets with int8 dot products (VNNI). YNNPACK's int8 x int8 -> int32 kernels on them made
# int8 weights 1.4-1.8x faster than float32 at 1-4 decode rows (2-core AMD EPYC, avx512_vnni).
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
# Without them, AVX2's integer products still made int8 weights faster than float32 where measured
# (the demo's decode step on a Zen 3 EPYC: 1.49x at 1 row, 1.14x at 4; a prefill chunk as fast), at
# a quarter of the bytes: int8 is `auto` there too. ARM with dot products (asimddp: the native
# kernel's NEON tier, tested under emulation only) likewise, unmeasured: a decode step streams every
# weight, and int8 streams a quarter of float32's bytes. Other CPUs keep float32 (unmeasured).
INT8_WEIGHTS_FLAGS = INT8_DOT_FLAGS | {"avx2", "asimddp"}
# The int8 KV cache: CPUs with int8 dot products, and AVX2, where it was faster too (decode after 8k
# tokens about twice as fast with the native kernel: docs/perf-log.md, "The native kernel's AVX2
# tier"; without the kernel no slower than float16), and ARM's NEON tier as above (unmeasured).
INT8_KV_FLAGS = INT8_DOT_FLAGS | {"avx2", "asimddp"}
# Instruction sets YNNPACK has unsigned x signed int8 kernels for (VNNI's vpdpbusd multiplies an
# unsigned byte by a signed one; AMX likewise). Its int8 x int8 kernels use plain AVX-512 instead,
# so there int8 weights are held offset as uint8 (engine.weights.OFFSET_INT8) and attention's rows are
# shifted to uint8 (engine.products.int8_product). avx_vnni alone has no such kernel (only a slow
# portable one).
UINT8_DOT_FLAGS = frozenset({"avx512_vnni", "amx_int8"})
# Intel's matrix units (AMX): XLA:CPU's bfloat16 dot runs on their tiles.
AMX_FLAGS = frozenset({"amx_bf16", "amx_int8", "amx_tile"})


@lru_cache(maxsize=1)
def flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read, e.g. not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16_dot() -> bool:
    return bool(flags() & BF16_DOT_FLAGS)


def has_uint8_dot() -> bool:
    return bool(flags() & UINT8_DOT_FLAGS)


def has_amx() -> bool:
    return bool(flags() & AMX_FLAGS)


def auto_weights_dtype() -> str:
    """--weights-dtype auto on a CPU: int8 where the CPU multiplies int8 fast (a quarter of float32's
    bytes, and faster: INT8_WEIGHTS_FLAGS), else float32."""
    return "int8" if flags() & INT8_WEIGHTS_FLAGS else "float32"


def auto_kv_dtype() -> str:
    """The KV cache's dtype on a CPU (engine.attention.kv_dtype_for): int8 with a scale per position where
    the CPU multiplies int8 well (INT8_KV_FLAGS: attention's products then run on integer kernels), else
    float16."""
    return "int8" if flags() & INT8_KV_FLAGS else "float16"
