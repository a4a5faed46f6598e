"""The engine's one native kernel (engine/native.cc), for CPUs where XLA:CPU's integer dot is
compute-bound (engine.products, engine.attention, engine.sampler call it): int8 weights, and a GGUF's
Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ3_S and Q3_K blocks, times a few rows (decode steps,
prefill chunks) at the memory's speed, attention over the int8 cache, every kind of weights widened
for a prefill chunk's dot where XLA's serves it, float products in one order (routers), a Gated
DeltaNet layer's recurrence token by token, and the sampler's greedy pick and filter cuts.
It is built on first use with the host's C++ compiler against jaxlib's FFI headers, kept under the
cache root (rebuilt when the source, the compiler or jaxlib changes) and registered with XLA as
custom calls.

It comes in tiers, chosen by the CPU's flags (TIERS): AVX-512 VNNI, else AVX2 with FMA and F16C
and AVX-VNNI's 256-bit dot products (Alder Lake and later cores without AVX-512), else AVX2 alone
(the same products from vpmaddubsw and vpmaddwd, bit for bit), and on ARM NEON with dot products
(sdot); MASHBOX_NATIVE_TIER=avx2 forces a lower tier on a CPU that has several. On a CPU with AMX the
AVX-512 tier is built with its tiles too (TILE_FLAGS), which take a long chunk's products (int8 and
every GGUF block form) once the library's own check passes (tiles()). tests/test_native.py runs
every tier the CPU has, the NEON tier cross-compiled under qemu-user, and the tiles' passes with each
tile instruction emulated.

It is optional: without a tier's instructions, without a compiler, on several devices (the
weights split over them: a custom call is not partitioned), or with MASHBOX_NATIVE=0, the weights
stay in their plain [out, in] layout and XLA's own products and attention serve: the same int8
weights and cache, the products equal to a float32 rounding, attention with quantized queries and
probabilities, as the kernel's does (its products int16 pairs: vpdpwssd; tests/test_native.py).

Packed layout of an [N, K] matrix (N a multiple of 16, K of 4): [N/16, K/4, 16, 4], element
[n, k] at [n // 16, k // 4, n % 16, k % 4]: one 64-byte load holds 4 inputs of 16 outputs.
5-bit weights (a GGUF's Q5_0 blocks, held as the file has them) are a dict {"nib", "fifth", "d"}:
levels 0..31 as nibbles and fifth bits, 8 inputs of 16 outputs per 64-byte load, and a float16
scale per 32 inputs; pack5 states the layout. 8-bit ones (Q8_0) are {"q8", "q8_d"}: the levels in
the packed layout and a float16 scale per 32 inputs (pack8). K-quant weights (a GGUF's Q4_K, Q5_K, Q6_K blocks)
are a dict {"knib", ...} of the same nibbles with the blocks' scales, mins and top bits; pack_k
states that layout. Scaled-level weights (IQ4_NL, IQ4_XS, IQ3_S, Q3_K: a small level per weight
times d and a sub-block's integer scale, no mins) are a dict {"iq4nl" | "iq4xs" | "iq3s" | "q3k", ...}
of 4-bit codes as the same nibbles (Q3_K's 3-bit codes as Q6_K's top bits and a mask), their
scales and d; pack_s states that layout (engine.checkpoint.s_block_parts reads a file's blocks into its
arguments).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from engine import cpu

log = logging.getLogger("mashbox.engine")

SOURCE = Path(__file__).with_name("native.cc")
# The custom calls it registers, and their symbols.
TARGETS = {"mashbox_int8_matmul": "MashboxInt8Matmul",
           "mashbox_int8_widen": "MashboxInt8Widen", "mashbox_int8_attend": "MashboxInt8Attend",
           "mashbox_int5_matmul": "MashboxInt5Matmul", "mashbox_int5_widen": "MashboxInt5Widen",
           "mashbox_q8_matmul": "MashboxQ8Matmul", "mashbox_q8_widen": "MashboxQ8Widen",
           "mashbox_q4k_matmul": "MashboxQ4KMatmul", "mashbox_q4k_widen": "MashboxQ4KWiden",
           "mashbox_q5k_matmul": "MashboxQ5KMatmul", "mashbox_q5k_widen": "MashboxQ5KWiden",
           "mashbox_q6k_matmul": "MashboxQ6KMatmul", "mashbox_q6k_widen": "MashboxQ6KWiden",
           "mashbox_iq4nl_matmul": "MashboxIq4NlMatmul", "mashbox_iq4nl_widen": "MashboxIq4NlWiden",
           "mashbox_iq4xs_matmul": "MashboxIq4XsMatmul", "mashbox_iq4xs_widen": "MashboxIq4XsWiden",
           "mashbox_iq3s_matmul": "MashboxIq3SMatmul", "mashbox_iq3s_widen": "MashboxIq3SWiden",
           "mashbox_q3k_matmul": "MashboxQ3KMatmul", "mashbox_q3k_widen": "MashboxQ3KWiden",
           "mashbox_row_dot": "MashboxRowDot", "mashbox_delta_steps": "MashboxDeltaSteps",
           "mashbox_delta_steps_in_place": "MashboxDeltaStepsInPlace", "mashbox_first_max": "MashboxFirstMax",
           "mashbox_filter_cuts": "MashboxFilterCuts"}
ENV_SWITCH = "MASHBOX_NATIVE"                      # "0": never build or use the kernel
TIER_ENV = "MASHBOX_NATIVE_TIER"                   # a tier's name: that tier, if the CPU has it
# The kernel's tiers, the first whose instructions (/proc/cpuinfo flags; ARM's "Features") the CPU
# has serves; a CPU with none keeps XLA's products. native.cc's MASHBOX_AVX512 / _AVX2 (with
# _AVXVNNI) / _NEON follow the compiler flags. The AVX-VNNI tier is tested on CPUs that have it
# beside AVX-512, and the NEON tier (AArch64 with sdot) under qemu-user (tests/test_native.py, as a
# command: tests/kernel_harness); neither's speed is measured on a CPU of its own.
TIERS = {
    "avx512_vnni": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"}),
                    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c")),
    "avx_vnni": (frozenset({"avx2", "fma", "f16c", "avx_vnni"}), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    "neon_dotprod": (frozenset({"asimd", "asimddp"}), ("-march=armv8.2-a+dotprod",)),
}
# No contraction into fused multiply-adds: int8_matmul rounds each operation once, as defined.
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
# Intel's matrix units (AMX): the AVX-512 tier built with them where the CPU has them multiplies a
# long chunk's rows on its tiles (native.cc: TilePass for int8, BlockTilePass for the block forms),
# bit for bit the row passes' numbers, so a prefill chunk of any length takes the kernel's products
# there too (engine.products.kernel_takes: TILE_KINDS).
# TILES_ENV=0 builds without them. Not yet timed on such a CPU (tests/bench/bench_tiles.py).
TILE_FLAGS = (frozenset({"amx_tile", "amx_int8"}), ("-mamx-tile", "-mamx-int8"))
TILES_ENV = "MASHBOX_AMX"
# The library's own check of its tiles (mashbox_tiles_check), run in a process of its own: its exit
# status -> why the tiles cannot serve (0: they can).
TILES_REFUSED = {1: "Linux did not grant the tiles' state (arch_prctl; Linux 5.16 or later grants it)",
                 2: "a product on the tiles differed from the row passes' (a fault of the tiles' pass)",
                 3: "the library was built without them"}
TILES_CHECK_TIMEOUT_S = 60
BUILD_TIMEOUT_S = 300                              # about 5 s on 2 cores; a stuck compiler is given up
LANES, GROUP = 16, 4                               # the packed block: 16 outputs x 4 inputs
NIBBLE_GROUP, Q5_BLOCK = 8, 32                     # 5-bit: 8 inputs per load, a scale per 32
Q8_BLOCK = 32                                      # Q8_0: a scale per 32 inputs
K_SUPER = 256                                      # K-quants: inputs per super-block (d, dmin)
K_SUB = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16}       # inputs per sub-block scale, by GGUF block type
# Scaled-level blocks (pack_s), by GGUF block type: inputs per d (and per row term in the kernel's
# product), inputs per sub-block scale, and bytes per block in the file.
S_SPAN = {"IQ4_NL": 32, "IQ4_XS": 256, "IQ3_S": 256, "Q3_K": 256}
S_SUB = {"IQ4_NL": 32, "IQ4_XS": 32, "IQ3_S": 32, "Q3_K": 16}
S_BYTES = {"IQ4_NL": 18, "IQ4_XS": 136, "IQ3_S": 110, "Q3_K": 110}
# Each code's level (w = d sc level[code]): IQ4's 16 levels, IQ3_S's odd -15..15, Q3_K's -4..3.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
S_LEVELS = {"IQ4_NL": IQ4_LEVELS, "IQ4_XS": IQ4_LEVELS, "IQ3_S": np.arange(-15, 16, 2, dtype=np.int8),
            "Q3_K": np.arange(-4, 4, dtype=np.int8)}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (found := shutil.which(name)):
            return found
    return None


# Tiers whose build failed in this process (a compiler too old for its flags: GCC learned -mavxvnni
# in version 11): the next tier the CPU has serves instead.
_unbuildable: set[str] = set()


def tier() -> str | None:
    """The tier this CPU runs (TIERS; TIER_ENV picks a lower one), or None: no tier's instructions,
    or the kernel switched off."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    have = [name for name, (flags, _) in TIERS.items() if flags <= cpu.flags() and name not in _unbuildable]
    asked = os.environ.get(TIER_ENV)
    if asked:
        return asked if asked in have else None
    return have[0] if have else None


def compile_flags() -> tuple[str, ...]:
    return BASE_FLAGS + TIERS[tier()][1] + (TILE_FLAGS[1] if tiles_wanted() else ())


# Why the tiles do not serve in this process (their build or check failed), or None.
_tiles_refused: str | None = None
_tiles = False                          # whether the registered kernel multiplies long chunks on tiles


def tiles_wanted() -> bool:
    """Whether the kernel is built with AMX tiles: the AVX-512 tier on a CPU with them, unless
    switched off (TILES_ENV=0) or refused in this process."""
    return (tier() == "avx512_vnni" and TILE_FLAGS[0] <= cpu.flags() and os.environ.get(TILES_ENV, "1") != "0"
            and _tiles_refused is None)


def tiles() -> bool:
    """Whether the registered kernel multiplies a long chunk's rows on AMX tiles (engine.products'
    TILE_KINDS; read while tracing: the kernel is registered by then)."""
    return _tiles


def _check_tiles(library: Path) -> str | None:
    """Why the library's tiles cannot serve (None: they can), from its own check in a process of its
    own, so that a fault there cannot take this one down."""
    import sys
    code = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).mashbox_tiles_check())"
    try:
        done = subprocess.run([sys.executable, "-c", code, str(library)], capture_output=True,
                              timeout=TILES_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"its check ran past {TILES_CHECK_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    return TILES_REFUSED.get(done.returncode, f"its check ended with status {done.returncode}")


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler, jaxlib and tier: built now unless already there."""
    import jax.ffi
    import jaxlib

    from engine.registry import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), version.encode(), jaxlib.__version__.encode(),
                                     " ".join(compile_flags()).encode()])).hexdigest()[:20]
    folder = cache_root() / "native"
    library = folder / f"native-{tier()}-{key}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *compile_flags(), f"-I{jax.ffi.include_dir()}", str(SOURCE),
                               "-o", tmp], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:] or f"{compiler} exited {done.returncode}")
        os.replace(tmp, library)          # whole or absent: two workers building at once both succeed
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library


_building = threading.Lock()            # one build at a time in a process (prepare and available)
_registered = False                     # XLA takes one registration of a target name per process


def prepare() -> None:
    """Build and register the kernel in a thread of its own (where it can run), so that a first
    start's compile overlaps the rest of start-up; available() then waits for it."""
    if _runs_here():
        threading.Thread(target=available, name="int8-kernel", daemon=True).start()


def _runs_here() -> bool:
    """Not switched off, a CPU with a tier's instructions, and XLA computing on it (on an
    accelerator host the weights stay XLA's, whatever the host CPU)."""
    if tier() is None:
        return False
    import jax
    return jax.default_backend() == "cpu"


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether the kernel is built and registered in this process (built on the first call).
    Says in the log why not when the CPU could run it."""
    if not _runs_here():
        return False
    with _building:
        return _build_and_register()


def serves(devices: int) -> bool:
    """Whether the kernel serves a model on `devices` devices: the one place this is decided (at
    start-up, into ModelConfig.native). Built and registered here, and one device: a custom call is
    not partitioned over a mesh."""
    return devices == 1 and available()


def _build_best(compiler: str) -> Path:
    """The library of the best tier the CPU has that the compiler builds (_build's errors if none)."""
    global _tiles_refused
    while True:
        try:
            return _build(compiler)
        except RuntimeError as e:
            if tiles_wanted():                # the compiler refused the tiles' flags: the tier without
                _tiles_refused = f"the compiler did not build them: {str(e)[-300:]}"
                log.warning("int8 kernel: AMX tiles unused (%s)", _tiles_refused)
                continue
            failed = tier()                   # the compiler refused this tier's flags: the next one
            _unbuildable.add(failed)
            if tier() is None:
                raise
            log.warning("int8 kernel: the %s tier did not build (%s); building the %s tier",
                        failed, str(e)[-300:], tier())


def _build_checked(compiler: str) -> Path:
    """_build_best's library, with AMX tiles where they are wanted and pass their check; where they
    fail it, the same tier's library without them."""
    global _tiles, _tiles_refused
    library = _build_best(compiler)
    if tiles_wanted():
        why = _check_tiles(library)
        if why is not None:
            _tiles_refused = why
            log.warning("int8 kernel: AMX tiles unused (%s); a long prefill chunk is widened for XLA's dot",
                        why)
            library = _build_best(compiler)
    _tiles = tiles_wanted()
    return library


def _build_and_register() -> bool:
    global _registered
    if _registered:                       # available() asked again (its cache cleared): still there
        return True
    compiler = _compiler()
    if compiler is None:
        log.warning("int8 kernel: no C++ compiler found (c++, g++, clang++ or $CXX); XLA's "
                    "products serve int8 weights instead, about half as fast in decode")
        return False
    try:
        import jax.ffi

        library = ctypes.cdll.LoadLibrary(str(_build_checked(compiler)))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("int8 kernel unavailable (%s); XLA's products serve int8 weights instead", e)
        return False
    _registered = True
    return True


def packable(shape) -> bool:
    """Whether an [out, in] matrix can be packed (whole blocks of 16 outputs x 4 inputs)."""
    return len(shape) == 2 and shape[0] % LANES == 0 and shape[1] % GROUP == 0


def pack(q: np.ndarray) -> np.ndarray:
    """[N, K] -> the packed layout [N/16, K/4, 16, 4] (the module docstring)."""
    n, k = q.shape
    return np.ascontiguousarray(q.reshape(n // LANES, LANES, k // GROUP, GROUP).transpose(0, 2, 1, 3))


def is_packed(q) -> bool:
    return q.ndim == 4


def unpack(q):
    """The packed layout -> [N, K] (a jax or numpy array: transposes in the array's own library)."""
    blocks, groups, lanes, group = q.shape
    return q.transpose(0, 2, 1, 3).reshape(blocks * lanes, groups * group)


def packed_rows(q, rows):
    """Rows `rows` (an integer array of any shape) of a packed [N, K] matrix: [*rows.shape, K]."""
    blocks, groups, lanes, group = q.shape
    return q[rows // LANES, :, rows % LANES, :].reshape(*rows.shape, groups * group)


def pack5(levels: np.ndarray, scales: np.ndarray) -> dict:
    """Q5_0 blocks of an [N, K] matrix, w = scales (levels - 16) (levels uint8 [N, K] in 0..31, scales
    float16 [N, K/32]; N a multiple of 16, K of 32) -> the kernel's 5-bit form, the one statement of
    its layout (engine/native.cc reads it so):
      nib    uint8   [N/16, K/8, 16, 4]  byte j of lane l in input group g: levels[16b + l, 8g + j] % 16
                                         in its low nibble, levels[16b + l, 8g + 4 + j] % 16 in its high
      fifth  uint32  [N/16, K/8, 4]      the levels' fifth bits, as two little-endian 64-bit masks per
                                         group (words 0-1, 2-3): bit 4l + j of the first for the low
                                         nibbles' levels, of the second for the high ones'
      d      float16 [N/16, K/32, 16]    the scales of the block's 16 outputs per 32 inputs"""
    n, k = levels.shape
    d = scales.reshape(n // LANES, LANES, k // Q5_BLOCK).transpose(0, 2, 1)
    return {"nib": _nibbles(levels), "fifth": _fifth_bits(levels), "d": np.ascontiguousarray(d.astype(np.float16))}


def _blocked(levels: np.ndarray) -> np.ndarray:
    """[N, K] -> [N/16, K/8, 16, 2, 4]: per block of 16 outputs and group of 8 inputs, each lane's
    low four inputs, then its high four."""
    n, k = levels.shape
    return levels.reshape(n // LANES, LANES, k // NIBBLE_GROUP, 2, GROUP).transpose(0, 2, 1, 3, 4)


def _nibbles(levels: np.ndarray) -> np.ndarray:
    """pack5's nib: the levels' low four bits, 8 inputs of 16 outputs per 64 bytes."""
    blocked = _blocked(levels)
    return np.ascontiguousarray(((blocked[..., 0, :] & 15) | ((blocked[..., 1, :] & 15) << 4)).astype(np.uint8))


def _fifth_bits(levels: np.ndarray, bit: int = 4) -> np.ndarray:
    """pack5's fifth: the levels' fifth bits (or another `bit`: Q3_K's third) as two 64-bit masks per
    64 nibble bytes."""
    n, k = levels.shape
    bits = ((_blocked(levels) >> bit) & 1).transpose(0, 1, 3, 2, 4).reshape(n // LANES, k // NIBBLE_GROUP, 2, 64)
    fifth = np.packbits(bits.astype(np.uint8), axis=-1, bitorder="little").view("<u8")[..., 0]
    return np.ascontiguousarray(fifth).view(np.uint32)


def _bit_pairs(pairs: np.ndarray) -> np.ndarray:
    """Two-bit values [N, K] -> 32 bytes per 64 nibble bytes (pack_k's khi): byte p's bits 0-1 and 2-3
    those of nib byte p's low and high nibble, bits 4-5 and 6-7 those of nib byte p + 32's."""
    n = pairs.shape[0]
    blocked = _blocked(pairs)                                                   # [N/16, K/8, 16, 2, 4]
    byte = (blocked[..., 0, :] | (blocked[..., 1, :] << 2)).reshape(n // LANES, -1, 64)
    return np.ascontiguousarray((byte[..., :32] | (byte[..., 32:] << 4)).astype(np.uint8))


def is_int5(w) -> bool:
    return isinstance(w, dict) and "nib" in w


def packable5(shape) -> bool:
    """Whether an [out, in] matrix fits pack5's blocks (16 outputs x 32 inputs)."""
    return len(shape) == 2 and shape[0] % LANES == 0 and shape[1] % Q5_BLOCK == 0


def int5_matmul(x, w):
    """Float32 rows x [R, K] times 5-bit weights w (pack5) -> float32 [R, N]: each row rounded to
    int8 per 32 inputs on each block's own scale, each block's exact product times both scales."""
    import jax
    import jax.numpy as jnp

    _require()
    n = w["nib"].shape[0] * LANES
    return jax.ffi.ffi_call("mashbox_int5_matmul", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x, w["nib"], w["fifth"], w["d"])


def widen5(w, after):
    """5-bit weights (pack5) -> their values rounded to bfloat16 [N, K], for a prefill chunk's dot
    (the scales change along the inputs, so unlike int8's they are applied here). after: as widen's."""
    import jax
    import jax.numpy as jnp

    _require()
    blocks, groups = w["nib"].shape[:2]
    return jax.ffi.ffi_call("mashbox_int5_widen", jax.ShapeDtypeStruct(
        (blocks * LANES, groups * NIBBLE_GROUP), jnp.bfloat16))(w["nib"], w["fifth"], w["d"], after)


def pack8(levels: np.ndarray, scales: np.ndarray) -> dict:
    """Q8_0 blocks of an [N, K] matrix, w = scales levels (levels int8 [N, K] in -127..127, scales
    float16 [N, K/32]; N a multiple of 16, K of 32) -> the kernel's 8-bit form, the one statement of
    its layout (engine/native.cc reads it so):
      q8    uint8   [N/16, K/4, 16, 4]   the levels plus 128, packed as pack's
      q8_d  float16 [N/16, K/32, 16]     the scales of the block's 16 outputs per 32 inputs
    A level of -128 (which GGUF's own rounding never writes: d = largest / 127) has no place in the
    AVX2 tier's products (its sign trick negates it to itself): packable8 says where it fits."""
    n, k = levels.shape
    d = scales.reshape(n // LANES, LANES, k // Q8_BLOCK).transpose(0, 2, 1)
    return {"q8": pack((levels.astype(np.int16) + 128).astype(np.uint8)),
            "q8_d": np.ascontiguousarray(d.astype(np.float16))}


def is_q8(w) -> bool:
    return isinstance(w, dict) and "q8" in w


def packable8(shape, lowest: int) -> bool:
    """Whether Q8_0 levels of an [out, in] matrix fit pack8's blocks (16 outputs x 32 inputs); lowest:
    their lowest level (a -128 has no place in the AVX2 tier's products: pack8)."""
    return len(shape) == 2 and shape[0] % LANES == 0 and shape[1] % Q8_BLOCK == 0 and lowest > -128


def q8_rows(w, rows):
    """Rows `rows` (an integer array of any shape) of Q8_0 blocks (pack8) -> float32 [*rows.shape, K]:
    the levels times their scales (exact in float32), for an embedding table held so."""
    import jax.numpy as jnp
    levels = packed_rows(w["q8"], rows).astype(jnp.int16) - 128
    d = w["q8_d"][rows // LANES, :, rows % LANES].astype(jnp.float32)                # [*rows, K/32]
    return levels.astype(jnp.float32) * jnp.repeat(d, Q8_BLOCK, axis=-1)


def q8_matmul(x, w):
    """Float32 rows x [R, K] times Q8_0 blocks w (pack8) -> float32 [R, N]: each row rounded to int8
    per 32 inputs on its own scale, each block's exact product times both scales."""
    import jax
    import jax.numpy as jnp

    _require()
    n = w["q8"].shape[0] * LANES
    return jax.ffi.ffi_call("mashbox_q8_matmul", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x, w["q8"], w["q8_d"])


def widen8(w, after):
    """Q8_0 blocks (pack8) -> their values rounded to bfloat16 [N, K], for a prefill chunk's dot.
    after: as widen's."""
    import jax
    import jax.numpy as jnp

    _require()
    blocks, groups, lanes, group = w["q8"].shape
    return jax.ffi.ffi_call("mashbox_q8_widen", jax.ShapeDtypeStruct(
        (blocks * lanes, groups * group), jnp.bfloat16))(w["q8"], w["q8_d"], after)


def pack_k(kind: str, levels: np.ndarray, sc: np.ndarray, d: np.ndarray, mins=None, dmin=None) -> dict:
    """K-quant blocks of an [N, K] matrix as a GGUF holds them (N a multiple of 16, K of 256) -> the
    kernel's form, the one statement of its layout (engine/native.cc reads it so):
      Q4_K  w = d sc q - dmin m: levels uint8 [N, K] 0..15, sc and mins uint8 [N, K/32] 0..63,
            d and dmin float16 [N, K/256]
      Q5_K  the same, levels 0..31
      Q6_K  w = d sc (q - 32): levels uint8 [N, K] 0..63, sc int8 [N, K/16], d float16 [N, K/256]
    held as
      knib    uint8   [N/16, K/8, 16, 4]  the levels' low four bits, as pack5's nib
      kfifth  uint32  [N/16, K/8, 4]      Q5_K: their fifth bits, as pack5's fifth
      khi     uint8   [N/16, K/8, 32]     Q6_K: their top two bits; byte p of a group: bits 0-1
                                          and 2-3 those of nib byte p's low and high nibble, bits 4-5
                                          and 6-7 those of nib byte p + 32's
      ksc     int8    [N/16, K/sub, 16]   the 16 outputs' sub-block scales (sub: K_SUB)
      kmin    uint8   [N/16, K/32, 16]    Q4_K, Q5_K: the sub-blocks' mins
      kd      float16 [N/16, K/256, 16]   the super-blocks' d
      kdmin   float16 [N/16, K/256, 16]   Q4_K, Q5_K: their dmin"""
    n = levels.shape[0]
    per_lane = lambda a: np.ascontiguousarray(a.reshape(n // LANES, LANES, -1).transpose(0, 2, 1))  # noqa: E731
    held = {"knib": _nibbles(levels), "ksc": per_lane(sc).view(np.int8), "kd": per_lane(d.astype(np.float16))}
    if kind == "Q6_K":
        held["khi"] = _bit_pairs((levels >> 4) & 3)
        return held
    if kind == "Q5_K":
        held["kfifth"] = _fifth_bits(levels)
    held["kmin"] = per_lane(mins.astype(np.uint8))
    held["kdmin"] = per_lane(dmin.astype(np.float16))
    return held


def k_kind(w) -> str | None:
    """"Q4_K", "Q5_K" or "Q6_K" for weights held by pack_k, else None."""
    if not (isinstance(w, dict) and "knib" in w):
        return None
    return "Q6_K" if "khi" in w else "Q5_K" if "kfifth" in w else "Q4_K"


def packable_k(shape) -> bool:
    """Whether an [out, in] matrix fits pack_k's blocks (16 outputs x 256 inputs)."""
    return len(shape) == 2 and shape[0] % LANES == 0 and shape[1] % K_SUPER == 0


def k_rows(w, rows):
    """Rows `rows` (an integer array of any shape) of K-quant blocks (pack_k) -> float32 [*rows.shape,
    K]: each weight as its blocks define it, d sc q - dmin m (Q6_K: d sc (q - 32)), for an embedding
    table held so. Every product is exact in float32 (at most 24 significant bits), so each value is
    rounded once, at the minus: gguf's own dequantizer's numbers."""
    import jax.numpy as jnp
    kind = k_kind(w)
    block, lane = rows // LANES, rows % LANES
    nib = w["knib"][block, :, lane]                                               # [*rows, K/8, 4]
    levels = jnp.concatenate([nib & 15, nib >> 4], axis=-1).astype(jnp.int32)     # inputs 8g .. 8g + 7
    wide = lambda key: w[key][block, :, lane].astype(jnp.float32)                 # noqa: E731  [*rows, K/span]
    if kind == "Q5_K":        # lane l's bits 4l .. 4l + 3 of the low nibbles' mask, then the high's
        words = w["kfifth"][block]                                                # [*rows, K/8, 4]
        at = (4 * (lane % 8))[..., None, None].astype(jnp.uint32) + jnp.arange(4, dtype=jnp.uint32)
        second = (lane // 8 == 1)[..., None]                                      # the mask's upper word
        low = jnp.where(second, words[..., 1], words[..., 0])[..., None]
        high = jnp.where(second, words[..., 3], words[..., 2])[..., None]
        fifth = jnp.concatenate([(low >> at) & 1, (high >> at) & 1], axis=-1).astype(jnp.int32)
        levels = levels | (fifth << 4)
    if kind == "Q6_K":        # nib byte p = 4 l + j: khi byte p % 32, bits 4 (p // 32) onwards
        hi = w["khi"][block]                                                      # [*rows, K/8, 32]
        at = (4 * (lane % 8))[..., None, None] + jnp.arange(4)
        pairs = jnp.take_along_axis(hi, jnp.broadcast_to(at, (*hi.shape[:-1], 4)), axis=-1).astype(jnp.int32)
        shift = (4 * (lane // 8))[..., None, None]
        top = jnp.concatenate([(pairs >> shift) & 3, (pairs >> (shift + 2)) & 3], axis=-1)
        levels = levels | (top << 4)
    levels = levels.reshape(*rows.shape, -1).astype(jnp.float32)                  # [*rows, K]
    per_input = lambda a: jnp.repeat(a, levels.shape[-1] // a.shape[-1], axis=-1)  # noqa: E731
    d = per_input(wide("kd")) * per_input(wide("ksc"))
    if kind == "Q6_K":
        return d * (levels - 32)
    return d * levels - per_input(wide("kdmin")) * per_input(wide("kmin"))


_K_OPERANDS = {"Q4_K": ("knib", "ksc", "kmin", "kd", "kdmin"),
               "Q5_K": ("knib", "kfifth", "ksc", "kmin", "kd", "kdmin"),
               "Q6_K": ("knib", "khi", "ksc", "kd")}


def k_matmul(x, w):
    """Float32 rows x [R, K] times K-quant blocks w (pack_k) -> float32 [R, N]: each row rounded to
    int8 per 256 inputs, each super-block's exact integer sums times its scales, its mins taken off."""
    import jax
    import jax.numpy as jnp

    _require()
    kind = k_kind(w)
    n = w["knib"].shape[0] * LANES
    return jax.ffi.ffi_call(f"mashbox_{kind[:2].lower()}k_matmul", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x, *(w[key] for key in _K_OPERANDS[kind]))


def widen_k(w, after):
    """K-quant blocks (pack_k) -> their values rounded to bfloat16 [N, K], for a prefill chunk's dot.
    after: as widen's."""
    import jax
    import jax.numpy as jnp

    _require()
    kind = k_kind(w)
    blocks, groups = w["knib"].shape[:2]
    return jax.ffi.ffi_call(f"mashbox_{kind[:2].lower()}k_widen", jax.ShapeDtypeStruct(
        (blocks * LANES, groups * NIBBLE_GROUP), jnp.bfloat16))(*(w[key] for key in _K_OPERANDS[kind]), after)


# The held dict's keys by block type: its codes' key names the kind (s_kind); the kernel's operands
# in their order.
_S_KEY = {"IQ4_NL": "iq4nl", "IQ4_XS": "iq4xs", "IQ3_S": "iq3s", "Q3_K": "q3k"}
_S_OPERANDS = {kind: (key, *(("q3k_third",) if kind == "Q3_K" else ()), *(() if kind == "IQ4_NL" else (f"{key}_sc",)),
                      f"{key}_d") for kind, key in _S_KEY.items()}


def pack_s(kind: str, codes: np.ndarray, d: np.ndarray, sc=None) -> dict:
    """Scaled-level blocks of an [N, K] matrix as a GGUF holds them (engine.checkpoint.s_block_parts:
    codes uint8 [N, K], d float16 [N, K / S_SPAN], sc int8 [N, K / S_SUB] but for IQ4_NL; N a multiple
    of 16, K of the span) -> the kernel's form, the one statement of its layout (engine/native.cc reads
    it so), with key = iq4nl, iq4xs, iq3s or q3k (_S_KEY):
      key          uint8   [N/16, K/8, 16, 4]  IQ4_NL, IQ4_XS, IQ3_S: the 4-bit codes, as pack5's nib
                   uint8   [N/16, K/8, 32]     Q3_K: the codes' low two bits, as pack_k's khi
      q3k_third    uint32  [N/16, K/8, 4]      Q3_K: the codes' third bits, as pack5's fifth
      key_sc       int8    [N/16, K/sub, 16]   the 16 outputs' sub-block scales (not IQ4_NL)
      key_d        float16 [N/16, K/span, 16]  their d
    IQ3_S's codes take 4 bits where the file's grid indices and signs take 3.25 per weight."""
    if not packable_s(kind, codes.shape):
        raise ValueError(f"pack_s: {kind} codes are [N, K] with N a multiple of {LANES} and K of "
                         f"{S_SPAN[kind]}, got {list(codes.shape)}")
    key = _S_KEY[kind]
    n = codes.shape[0]
    per_lane = lambda a: np.ascontiguousarray(a.reshape(n // LANES, LANES, -1).transpose(0, 2, 1))  # noqa: E731
    if kind == "Q3_K":
        held = {key: _bit_pairs(codes & 3), "q3k_third": _fifth_bits(codes, bit=2)}
    else:
        held = {key: _nibbles(codes)}
    if kind != "IQ4_NL":
        held[f"{key}_sc"] = per_lane(np.asarray(sc, np.int8))
    held[f"{key}_d"] = per_lane(np.asarray(d, np.float16))
    return held


def s_kind(w) -> str | None:
    """"IQ4_NL", "IQ4_XS", "IQ3_S" or "Q3_K" for weights held by pack_s, else None."""
    if isinstance(w, dict):
        for kind, key in _S_KEY.items():
            if key in w:
                return kind
    return None


def packable_s(kind: str, shape) -> bool:
    """Whether an [out, in] matrix fits pack_s's blocks of `kind` (16 outputs x its span of inputs)."""
    return len(shape) == 2 and shape[0] % LANES == 0 and shape[1] % S_SPAN[kind] == 0


def s_shape(w) -> tuple[int, int]:
    """(out, in) of weights held by pack_s."""
    codes = w[_S_KEY[s_kind(w)]]
    return codes.shape[0] * LANES, codes.shape[1] * NIBBLE_GROUP


def s_matmul(x, w):
    """Float32 rows x [R, K] times scaled-level blocks w (pack_s) -> float32 [R, N]: each row rounded
    to int8 per span (IQ4_NL 32 inputs, else 256), each sub-block's exact integer sum times its scale,
    each span's sum times d and the row's scale."""
    import jax
    import jax.numpy as jnp

    _require()
    kind = s_kind(w)
    return jax.ffi.ffi_call(f"mashbox_{_S_KEY[kind]}_matmul", jax.ShapeDtypeStruct(
        (x.shape[0], s_shape(w)[0]), jnp.float32))(x, *(w[key] for key in _S_OPERANDS[kind]))


def widen_s(w, after):
    """Scaled-level blocks (pack_s) -> their values rounded to bfloat16 [N, K], for a prefill chunk's
    dot. after: as widen's."""
    import jax
    import jax.numpy as jnp

    _require()
    kind = s_kind(w)
    return jax.ffi.ffi_call(f"mashbox_{_S_KEY[kind]}_widen", jax.ShapeDtypeStruct(s_shape(w), jnp.bfloat16))(
        *(w[key] for key in _S_OPERANDS[kind]), after)


def int8_matmul(x, q, scale):
    """Float32 rows x [R, K] times packed offset weights q with their output channels' scales [N]
    -> float32 [R, N]: engine.products.matmul's two int8 terms per row, their products and the scales,
    in one call."""
    import jax
    import jax.numpy as jnp

    _require()
    n = q.shape[0] * LANES
    return jax.ffi.ffi_call("mashbox_int8_matmul",
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(x, q, scale)


def widen(q, after):
    """Packed offset weights q -> their int8 values as bfloat16 [N, K] (exact), for a product of
    many rows (XLA's dot). The kernel's own pass: XLA's transpose of the packed layout ran slowly.
    after: any array, not read, that the widening waits for (the product's input). With no such
    operand XLA moved every widening to the start of the program, so a prefill chunk of the demo
    held all 24 layers' bfloat16 copies at once: 0.79 GB of temporaries (0.09 GB waiting)."""
    import jax
    import jax.numpy as jnp

    _require()
    blocks, groups, lanes, group = q.shape
    return jax.ffi.ffi_call("mashbox_int8_widen",
                            jax.ShapeDtypeStruct((blocks * lanes, groups * group), jnp.bfloat16))(q, after)


def int8_attend(q, k, v, k_scale, v_scale, slots, positions):
    """Decode attention over an int8 cache (engine.cache), its products in int16 (the kernel's
    Int8Attend): q [B, KV, G, D] float32 (one token per row, scaled and smoothed; D even, at most
    1024), k, v int8 [slots, KV, D, ctx], k_scale, v_scale float32 [slots, KV, ctx], slots,
    positions int32 [B] -> [B, KV, G, D]: row b attends to positions 0 .. positions[b] of slot
    slots[b]; a row at a negative position (padding) reads nothing, its outputs zero."""
    import jax
    import jax.numpy as jnp

    _require()
    return jax.ffi.ffi_call("mashbox_int8_attend", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k, v, k_scale, v_scale, slots, positions)


def row_dot(x, w):
    """float32 x [R, K] times float32 w [N, K] -> [R, N] (the kernel's RowDot): each output's K
    products rounded one by one and added in 16 partial sums (partial j: inputs j, j + 16, ...),
    which a fixed tree adds; a row's numbers whatever rows run beside it, on every tier."""
    import jax
    import jax.numpy as jnp

    _require()
    return jax.ffi.ffi_call("mashbox_row_dot", jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))(x, w)


def delta_steps(q, k, v, decay, beta, state):
    """T tokens of a Gated DeltaNet layer's recurrence per row (the kernel's DeltaSteps): q, k
    float32 [B, T, H, dk], v [B, T, H, dv], decay, beta [B, T, H], state [B, H, dk, dv] -> (out [B, T,
    H, dv], the state after the T tokens, what each token wrote [B, T, H, dv]), bit for bit
    engine.model._delta_step's, token after token."""
    import jax
    import jax.numpy as jnp

    _require()
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return jax.ffi.ffi_call("mashbox_delta_steps", (f32(v.shape), f32(state.shape), f32(v.shape)))(
        q, k, v, decay, beta, state)


def delta_steps_in_place(q, k, v, decay, beta, states, slots, starts, lengths):
    """delta_steps for rows whose states live in a layer's pool states [S, H, dk, dv] (the kernel's
    DeltaStepsInPlace): row b starts from its slot slots[b] (from zero where starts[b] == 0) and its
    state after the T tokens goes back there; a row with lengths[b] == 0 touches no state and gets
    zeros. Returns (out [B, T, H, dv], what each token wrote [B, T, H, dv], the pool): the pool is the
    given buffer updated in place (aliased)."""
    import jax
    import jax.numpy as jnp

    _require()
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return jax.ffi.ffi_call("mashbox_delta_steps_in_place", (f32(v.shape), f32(v.shape), f32(states.shape)),
                            input_output_aliases={5: 2})(
        q, k, v, decay, beta, states, *(jnp.asarray(a, jnp.int32) for a in (slots, starts, lengths)))


def first_max(logits):
    """float32 [R, V] -> int32 [R]: each row's first index of its largest value, NaN never picked (a
    row of NaN and -inf gives 0), in one pass over the logits."""
    import jax
    import jax.numpy as jnp

    _require()
    return jax.ffi.ffi_call("mashbox_first_max", jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))(logits)


def filter_cuts(probs, top_k, top_p):
    """probs float32 [R, V] (>= 0), top_k int32 [R] (0: off), top_p float32 [R] (1: off) -> float32
    [R, 2]: each row's top-k cut (its k-th largest probability) and top-p cut (among those >= the
    first, largest first, the one whose running sum reaches top_p of their sum), 0 where a filter is
    off; probs >= both cuts is what the filters keep. Exact, from a histogram of the row."""
    import jax
    import jax.numpy as jnp

    _require()
    return jax.ffi.ffi_call("mashbox_filter_cuts", jax.ShapeDtypeStruct((probs.shape[0], 2), jnp.float32))(
        probs, top_k, top_p)


def _require():
    if not available():
        raise RuntimeError("a native kernel call (packed weights, attention or the sampler's), but the "
                           "kernel is not available here")
