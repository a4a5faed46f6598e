"""The native int8 kernel (engine/native.cc, built and registered by engine.native) against
numpy, and the model with packed weights against the plain layout's XLA products."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import cpu, model, native, products, registry, sampler, weights
from engine.cache import init_cache
from engine.checkpoint import s_block_parts
from engine.config import load_config
from engine.weights import held_key, load_weights
from tests.test_int8 import _logits
from tests.test_registry import cache, tiny_demo  # noqa: F401  (fixtures)

TINY = os.path.join(os.path.dirname(__file__), "fixtures", "tiny")

needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason="the kernel needs AVX-512 VNNI, AVX2 (FMA, F16C) or NEON dot products, "
                                         "and a C++ compiler")

HARNESS = os.path.join(os.path.dirname(__file__), "kernel_harness")
NEON_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"       # Debian's g++-aarch64-linux-gnu, qemu-user
# The harness's operand types, in xla::ffi::DataType's order (tests/kernel_harness/xla/ffi/api/ffi.h).
HARNESS_TYPES = ["float32", "uint8", "int8", "uint32", "float16", "bfloat16", "int32"]


class XlaTier:
    """The kernel tier this CPU runs, through XLA's custom calls (engine.native), as numpy arrays."""

    def __getattr__(self, name):
        call = jax.jit(getattr(native, name))

        def run(*args):
            got = call(*args)
            return [np.asarray(one) for one in got] if isinstance(got, (tuple, list)) else np.asarray(got)
        return run


class HarnessTier:
    """A kernel tier this machine cannot load into XLA beside its own: tests/kernel_harness/harness.cc
    built for it and run as a command (under qemu-user for another architecture), with engine.native's
    calls (the same operands and result shapes)."""

    def __init__(self, command: list[str]):
        self.command = command

    def _run(self, name, operands, shape, dtype):
        """The kernel's result of `shape`, or its results (a list of shapes), all of `dtype`."""
        import struct
        import subprocess
        import ml_dtypes
        dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        shapes = shape if isinstance(shape, list) else [shape]
        parts = [name.encode() + b"\n", struct.pack("<ii", len(operands) + len(shapes), len(shapes))]
        for array in map(np.ascontiguousarray, operands):
            parts.append(struct.pack(f"<BB{array.ndim}q", HARNESS_TYPES.index(array.dtype.name), array.ndim,
                                     *array.shape))
            parts.append(array.tobytes())
        for one in shapes:                                       # the results: their shapes only
            parts.append(struct.pack(f"<BB{len(one)}q", HARNESS_TYPES.index(dtype.name), len(one), *one))
        done = subprocess.run(self.command, input=b"".join(parts), capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        ends = np.cumsum([0] + [int(np.prod(one)) * dtype.itemsize for one in shapes])
        got = [np.frombuffer(done.stdout[a:b], dtype).reshape(one) for a, b, one in zip(ends, ends[1:], shapes)]
        return got if isinstance(shape, list) else got[0]

    def int8_matmul(self, x, q, scale):
        return self._run("int8_matmul", [x, q, scale], (x.shape[0], q.shape[0] * native.LANES), "float32")

    def widen(self, q, after):
        return self._run("int8_widen", [q, after], (q.shape[0] * q.shape[2], q.shape[1] * q.shape[3]), "bfloat16")

    def int5_matmul(self, x, w):
        return self._run("int5_matmul", [x, w["nib"], w["fifth"], w["d"]],
                         (x.shape[0], w["nib"].shape[0] * native.LANES), "float32")

    def widen5(self, w, after):
        blocks, groups = w["nib"].shape[:2]
        return self._run("int5_widen", [w["nib"], w["fifth"], w["d"], after],
                         (blocks * native.LANES, groups * native.NIBBLE_GROUP), "bfloat16")

    def q8_matmul(self, x, w):
        return self._run("q8_matmul", [x, w["q8"], w["q8_d"]], (x.shape[0], w["q8"].shape[0] * native.LANES),
                         "float32")

    def widen8(self, w, after):
        blocks, groups, lanes, group = w["q8"].shape
        return self._run("q8_widen", [w["q8"], w["q8_d"], after], (blocks * lanes, groups * group), "bfloat16")

    def k_matmul(self, x, w):
        kind = native.k_kind(w)
        return self._run(f"{kind[:2].lower()}k_matmul", [x, *(w[key] for key in native._K_OPERANDS[kind])],
                         (x.shape[0], w["knib"].shape[0] * native.LANES), "float32")

    def widen_k(self, w, after):
        kind = native.k_kind(w)
        blocks, groups = w["knib"].shape[:2]
        return self._run(f"{kind[:2].lower()}k_widen", [*(w[key] for key in native._K_OPERANDS[kind]), after],
                         (blocks * native.LANES, groups * native.NIBBLE_GROUP), "bfloat16")

    def s_matmul(self, x, w):
        kind = native.s_kind(w)
        return self._run(f"{native._S_KEY[kind]}_matmul", [x, *(w[key] for key in native._S_OPERANDS[kind])],
                         (x.shape[0], native.s_shape(w)[0]), "float32")

    def widen_s(self, w, after):
        kind = native.s_kind(w)
        return self._run(f"{native._S_KEY[kind]}_widen", [*(w[key] for key in native._S_OPERANDS[kind]), after],
                         native.s_shape(w), "bfloat16")

    def first_max(self, logits):
        return self._run("first_max", [logits], logits.shape[:1], "int32")

    def row_dot(self, x, w):
        return self._run("row_dot", [x, w], (x.shape[0], w.shape[0]), "float32")

    def delta_steps(self, q, k, v, decay, beta, state):
        return self._run("delta_steps", [q, k, v, decay, beta, state], [v.shape, state.shape, v.shape], "float32")

    def delta_steps_in_place(self, q, k, v, decay, beta, states, slots, starts, lengths):
        return self._run("delta_steps_in_place", [q, k, v, decay, beta, states, slots, starts, lengths],
                         [v.shape, v.shape, states.shape], "float32")

    def filter_cuts(self, probs, top_k, top_p):
        return self._run("filter_cuts", [probs, top_k, top_p], (probs.shape[0], 2), "float32")

    def int8_attend(self, q, k, v, k_scale, v_scale, slots, positions):
        return self._run("int8_attend", [q, k, v, k_scale, v_scale, slots, positions], q.shape, "float32")


def _harness(tmp_path_factory, compiler: str, tier: str, extra: tuple[str, ...] = ()) -> str:
    """The harness built with `compiler` at a tier's flags (native.TIERS): the binary's path."""
    import subprocess
    binary = str(tmp_path_factory.mktemp(tier) / "harness")
    flags = [f for f in native.BASE_FLAGS if f not in ("-shared", "-fPIC")] + list(native.TIERS[tier][1])
    done = subprocess.run([compiler, *flags, *extra, f"-I{HARNESS}", os.path.join(HARNESS, "harness.cc"), "-o",
                           binary], capture_output=True, text=True, timeout=native.BUILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return binary


@pytest.fixture(scope="session")
def neon_harness(tmp_path_factory):
    """The harness built for the NEON tier, or a skip where this machine has no cross-compiler or
    qemu-user, or is ARM itself (there the xla tier is the NEON one)."""
    import platform
    import shutil
    if platform.machine() in ("aarch64", "arm64"):
        pytest.skip("an ARM CPU: its own tier runs through XLA")
    if not (shutil.which(NEON_CXX) and shutil.which(QEMU)):
        pytest.skip(f"the NEON tier's tests need {NEON_CXX} and {QEMU} (Debian: g++-aarch64-linux-gnu, qemu-user)")
    return HarnessTier([QEMU, _harness(tmp_path_factory, NEON_CXX, "neon_dotprod", ("-static",))])


@pytest.fixture(scope="session")
def avx_vnni_harness(tmp_path_factory):
    """The harness built for the AVX-VNNI tier and run here, on a CPU that has its instructions but
    serves another tier through XLA (AVX-512 VNNI ones from Sapphire Rapids and Zen 5 on); a skip
    elsewhere (there it is the xla tier, or cannot run)."""
    if not native.TIERS["avx_vnni"][0] <= cpu.flags():
        pytest.skip("this CPU has no AVX-VNNI")
    if native.tier() == "avx_vnni":
        pytest.skip("the AVX-VNNI tier is this CPU's own: it runs through XLA")
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    return HarnessTier([_harness(tmp_path_factory, native._compiler(), "avx_vnni")])


@pytest.fixture(params=["xla", "avx_vnni", "neon"])
def kernel(request):
    """Each kernel test runs on this CPU's tier through XLA, and on the tiers that run here beside it
    as the harness (AVX-VNNI on a CPU with AVX-512 VNNI too; NEON under qemu-user): every tier held
    to the same numpy definitions."""
    if request.param != "xla":
        return request.getfixturevalue(f"{request.param}_harness")
    if not native.available():
        pytest.skip("the kernel needs AVX-512 VNNI, AVX-VNNI or AVX2 (FMA, F16C), or NEON dot products, and a C++ compiler")
    return XlaTier()


def _offset_weights(rng, n, k):
    """Offset int8 weights as the engine holds them: values -127..127 (engine.weights.INT8_MAX), so
    1..255; the AVX2 tier's sign trick needs -128 absent."""
    return rng.integers(1, 256, (n, k), dtype=np.uint8)


@pytest.mark.parametrize("n, k", [(16, 4), (32, 64), (48, 68), (16, 260), (896, 4864)])
def test_widen_gives_the_weights_int8_values_exactly(kernel, n, k):
    """Guards against the 16 x 16 transpose or the tail of inputs (K/4 not a multiple of 16) putting
    a weight in the wrong place, or the bfloat16 conversion rounding one."""
    q = _offset_weights(np.random.default_rng(k), n, k)
    got = kernel.widen(native.pack(q), np.zeros(1, np.float32)).astype(np.float32)
    np.testing.assert_array_equal(got, q.astype(np.float32) - 128)


def _terms(x, count=2):
    """engine.products.int8_terms in numpy, in float32 with IEEE rounding: [(int8 term, its scales)]
    x count."""
    out = []
    for _ in range(count):
        peak = np.abs(x).max(-1, keepdims=True)
        scale = np.where(peak > 0, peak / np.float32(127), np.float32(1)).astype(np.float32)
        term = np.clip(np.round(x / scale), -127, 127).astype(np.int8)
        out.append((term, scale))
        x = (x - term.astype(np.float32) * scale).astype(np.float32)
    return out


@pytest.mark.parametrize("n, k", [(16, 4), (80, 96), (48, 68), (64, 900), (1152, 896)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_int8_matmul_is_the_two_terms_products_and_scales_rounded_once_each(kernel, n, k, rows):
    """Guards against the fused call's quantization (half to even, clipped, a zero row's scale 1), a
    pass of rows (4 at a time, then the rest: 9 rows), a chunk edge, the tail of a row (K not a
    multiple of 16) or the offset's correction going wrong, or its float32 sum differing from what
    the terms define: the same numbers numpy computes, the products exact."""
    rng = np.random.default_rng(n * 1000 + k + rows)
    q = _offset_weights(rng, n, k)
    scale = rng.random(n).astype(np.float32)
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1, 50], (rows, 1))).astype(np.float32)
    x[0, :] = 0                                        # a padding row
    got = kernel.int8_matmul(x, native.pack(q), scale)
    np.testing.assert_array_equal(got, _int8_product(x, q, scale))
    assert not got[0].any()


def _int8_product(x, q, scale):
    """The int8 product's definition: each row's two terms' exact products with the offset weights'
    values, each times its scale, summed, times the output's scale, each rounded to float32 once."""
    values = q.astype(np.int64) - 128
    want = sum((term.astype(np.int64) @ values.T).astype(np.float32) * s for term, s in _terms(x))
    return (want * scale).astype(np.float32)


@pytest.fixture(scope="session")
def emulated_tiles_harness(tmp_path_factory):
    """The harness with the AMX tiles' pass, each tile instruction emulated in plain C++
    (MASHBOX_AMX_EMULATED), at this CPU's tier: the tiling held to the definitions on any CPU."""
    if native.tier() is None or native._compiler() is None:
        pytest.skip("the emulated tiles build at this CPU's kernel tier, with a C++ compiler")
    return HarnessTier([_harness(tmp_path_factory, native._compiler(), native.tier(), ("-DMASHBOX_AMX_EMULATED",))])


@pytest.fixture(params=["xla", "emulated"])
def tiles(request):
    """The kernel's tiles' pass: on this CPU's tiles through XLA where it has AMX (native.tiles()),
    and emulated everywhere."""
    if request.param == "emulated":
        return request.getfixturevalue("emulated_tiles_harness")
    if not (native.available() and native.tiles()):
        pytest.skip("this CPU's kernel has no AMX tiles (native.tiles())")
    return XlaTier()


@pytest.mark.parametrize("n, k", [(16, 64), (48, 192), (1152, 896), (80, 4864), (64, 900)])
@pytest.mark.parametrize("rows", [16, 17, 40])
def test_int8_matmul_on_tiles_is_the_two_terms_products_and_scales_rounded_once_each(tiles, n, k, rows):
    """Guards the AMX tiles' pass (a chunk of 16 rows or more, K a multiple of 64): a panel's last
    rows (17, 40: not whole panels of 16), a claim's lone last block (16, 48 outputs: an odd number
    of blocks; 1152: claims of 16 blocks and 8), the offsets' correction, the float operations' order
    after the sums, and K = 900 (not whole tiles: the row passes serve). The same numbers numpy
    computes, as for the row passes."""
    rng = np.random.default_rng(n * 1000 + k + rows)
    q = _offset_weights(rng, n, k)
    scale = rng.random(n).astype(np.float32)
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1, 50], (rows, 1))).astype(np.float32)
    x[0, :] = 0                                        # a zero row among the live ones
    got = tiles.int8_matmul(x, native.pack(q), scale)
    np.testing.assert_array_equal(got, _int8_product(x, q, scale))
    assert not got[0].any()


def test_a_rows_numbers_on_the_tiles_are_its_numbers_alone(tiles):
    """The same-answer guarantee on an AMX CPU: a row of a long chunk (the tiles) gets the bits it gets
    alone (a decode step: the row passes), and the chunk's padding rows stay zero."""
    rng = np.random.default_rng(7)
    q = _offset_weights(rng, 96, 256)
    scale = rng.random(96).astype(np.float32)
    x = rng.standard_normal((48, 256)).astype(np.float32)
    x[37:] = 0                                          # the chunk's padding
    got = tiles.int8_matmul(x, native.pack(q), scale)
    alone = np.concatenate([tiles.int8_matmul(x[i:i + 1], native.pack(q), scale) for i in range(37)])
    np.testing.assert_array_equal(got[:37], alone)
    assert not got[37:].any()


def _block_form(form, rng, n, k):
    """Random weights of a block form as the engine holds them, and the kernel's product for them."""
    if form == "Q5_0":
        return native.pack5(*_q5_0(rng, n, k)), "int5_matmul"
    if form == "Q8_0":
        return native.pack8(*_q8_0(rng, n, k)), "q8_matmul"
    if form in S_KINDS:
        return _s_held(form, random_s_blocks(rng, form, n, k)), "s_matmul"
    return _k_held(form, random_k_blocks(rng, form, n, k)), "k_matmul"


@pytest.mark.parametrize("form, n, k", [("Q5_0", 48, 96), ("Q5_0", 896, 896), ("Q8_0", 16, 64), ("Q8_0", 80, 4864),
                                        ("Q4_K", 48, 512), ("Q4_K", 1152, 256), ("Q5_K", 48, 512),
                                        ("Q6_K", 48, 512), ("Q6_K", 80, 1280), ("IQ4_NL", 48, 256),
                                        ("IQ4_XS", 80, 512), ("IQ3_S", 48, 512), ("Q3_K", 48, 768)])
@pytest.mark.parametrize("rows", [16, 40])
def test_a_block_forms_rows_on_the_tiles_get_their_numbers_alone(tiles, form, n, k, rows):
    """Guards the block forms' tiles' pass (BlockTilePass: a sub-block of 32 inputs, Q6_K's and Q3_K's
    of 16, per tdpbsud): each row of a long chunk gets the bits the row passes give it, which are its
    numbers alone (a decode step's), over a panel's last rows (40), a claim's lone last block (48 and
    80 outputs), claims of 16 blocks and fewer (1152 outputs; K = 4864: claims within the tiles' L2
    budget), the levels unpacked per claim (Q5_0's fifth bits, Q5_K's, Q6_K's top bits, the table
    forms' levels + 128, Q3_K's bit planes) or read as held (Q8_0), the offsets, mins and sub-block
    scales, and a zero row and zero block among the live."""
    rng = np.random.default_rng(n + k + rows)
    w, product = _block_form(form, rng, n, k)
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1, 50], (rows, 1))).astype(np.float32)
    x[0, :] = 0
    x[-1, :k // 2] = 0
    got = getattr(tiles, product)(x, w)
    # Below 16 rows the row passes serve, which give each row its numbers alone.
    alone = np.concatenate([getattr(tiles, product)(x[i:i + 15], w) for i in range(0, rows, 15)])
    np.testing.assert_array_equal(got, alone)
    assert got[1:].any(axis=1).all() and not got[0].any()


@pytest.mark.parametrize("form, n, k", [("Q5_0", 48, 896), ("Q8_0", 48, 96), ("Q4_K", 48, 512), ("Q5_K", 32, 256), ("Q6_K", 32, 256),
                                        ("IQ4_XS", 32, 256)])
def test_a_long_chunks_rows_get_their_numbers_alone_on_every_tier(kernel, form, n, k):
    """The same-answer guarantee on the row passes: a row of a chunk of 12 (more rows than one pass
    takes: Q5_0's levels then decoded once per chunk of blocks, Block5<R, true>) gets the bits it gets
    alone, a decode step's."""
    rng = np.random.default_rng(n + k)
    w, product = _block_form(form, rng, n, k)
    x = (rng.standard_normal((12, k)) * rng.choice([1e-3, 1, 50], (12, 1))).astype(np.float32)
    x[3, :] = 0
    got = getattr(kernel, product)(x, w)
    alone = np.concatenate([getattr(kernel, product)(x[i:i + 1], w) for i in range(12)])
    np.testing.assert_array_equal(got, alone)
    assert not got[3].any() and np.delete(got, 3, axis=0).any(axis=1).all()


def test_the_tiles_check_passes_on_the_emulated_tiles(emulated_tiles_harness):
    """mashbox_tiles_check (what engine.native runs before the tiles serve) finds the tiles' pass and
    the row passes equal: its exit status 0."""
    import subprocess
    done = subprocess.run(emulated_tiles_harness.command, input=b"tiles_check\n", capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 16384, 40000])
def test_first_max_takes_each_rows_first_largest_logit(kernel, vocab):
    """Guards the greedy pick: ties go to the first index, also across the kernel's pieces of 16384;
    a row of -inf picks 0; a NaN is never picked (XLA's reductions differ there: theirs is compared
    on the other rows); lanes past V never win."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1] = np.float32(-np.inf)
    x[2, :] = 0.0
    x[3, vocab // 2:] = 7.0                               # the first of many equal maxima
    x[4, rng.integers(vocab)] = np.nan
    x[5, -1] = 1e30                                       # the very last logit
    got = kernel.first_max(x)
    np.testing.assert_array_equal(got, np.argmax(np.nan_to_num(x, nan=-np.inf), -1))
    reduced = np.asarray(jax.jit(sampler._first_max_reduced)(x))
    np.testing.assert_array_equal(np.delete(got, 4), np.delete(reduced, 4))


def test_filter_cuts_keep_what_a_full_sort_keeps(kernel):
    """Guards the sampling filters' cuts against keeping other tokens than a float64 full sort does
    (tests/test_sampler.py: _reference_mask): peaked, flat and tied rows, cuts inside the histogram's
    buckets, top-k past the vocabulary, underflowed zeros; each filter off gives a cut of 0."""
    from tests.test_sampler import _reference_mask
    rng = np.random.default_rng(9)
    vocab = 3000
    rows = []
    for spread, top_k, top_p in [(3.0, 20, 0.8), (3.0, 0, 0.5), (0.2, 0, 0.9), (3.0, 2000, 1.0),
                                 (0.0, 5, 0.3), (8.0, 0, 0.999), (3.0, 1, 0.1), (3.0, 0, 1e-6),
                                 (60.0, 0, 0.95), (1.0, 5000, 0.99)]:
        logits = rng.normal(size=vocab) * spread
        probs = np.exp(logits - logits.max())
        rows.append(((probs / probs.sum()).astype(np.float32), top_k, top_p))
    probs = np.stack([r[0] for r in rows])
    probs[4, :100] = probs[4, 0]                      # ties at the top-k cut
    top_k = np.array([r[1] for r in rows], np.int32)
    top_p = np.array([r[2] for r in rows], np.float32)
    cuts = kernel.filter_cuts(probs, top_k, top_p)
    for row, (_, k, tp) in enumerate(rows):
        got = probs[row] >= cuts[row].max()
        want = _reference_mask(probs[row], min(k, vocab), float(np.float32(tp)))
        assert (got == want).all(), (row, got.sum(), want.sum())
        assert (cuts[row, 0] == 0) == (k == 0) and (cuts[row, 1] == 0) == (tp >= 1)


def _q5_0(rng, n, k):
    """Random Q5_0 blocks of an [n, k] matrix: levels 0..31, a float16 scale per 32 inputs (some
    negative, one block all zero as in a pruned row)."""
    levels = rng.integers(0, 32, (n, k)).astype(np.uint8)
    scales = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)
    scales[0, 0] = 0
    return levels, scales


def _q5_0_values(levels, scales):
    return (levels.astype(np.float32) - 16) * np.repeat(scales.astype(np.float32), 32, axis=1)


@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (896, 4864)])
@pytest.mark.parametrize("rows", [1, 4, 5, 9])
def test_int5_matmul_is_each_blocks_exact_product_times_its_scales(kernel, n, k, rows):
    """Guards against the nibble and fifth-bit layout, a pass of 8 rows (then the rest), the level's
    offset of 16 or the scales' order going wrong: per 32 inputs each row is rounded to int8 on its
    own scale, the product with the levels is an integer, then float32, times the weights' scales
    times the row's (one rounding) and added to the sum of the blocks before it (one rounding)."""
    rng = np.random.default_rng(n + k + rows)
    levels, scales = _q5_0(rng, n, k)
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1, 50], (rows, 1))).astype(np.float32)
    if k > 32:
        x[-1, :32] = 0                                 # a zero block
    if rows > 1:
        x[0, :] = 0                                    # a padding row (one row: the decode step's own)
    got = kernel.int5_matmul(x, native.pack5(levels, scales))
    values = levels.astype(np.int64) - 16
    want = np.zeros((rows, n), np.float32)
    for b in range(k // 32):
        block = slice(32 * b, 32 * b + 32)
        (term, row_scale), = _terms(x[:, block], 1)
        exact = (term.astype(np.int64) @ values[:, block].T).astype(np.float32)
        both = scales[:, b].astype(np.float32) * row_scale              # [rows, n], rounded once
        # a fused multiply-add; float64 holds the product exactly, and the sum all but always
        want = (want.astype(np.float64) + exact.astype(np.float64) * both.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert got.any() and (rows == 1 or not got[0].any())
    # Within what rounding each input by at most half its block's step can move the product.
    weights = _q5_0_values(levels, scales).astype(np.float64)
    steps = np.concatenate([np.repeat(_terms(x[:, 32 * b:32 * b + 32], 1)[0][1], 32, axis=-1)
                            for b in range(k // 32)], axis=-1)                          # [rows, k]
    bound = (steps / 2) @ np.abs(weights).T
    assert (np.abs(got - x.astype(np.float64) @ weights.T) <= bound * 1.001 + 1e-6 * np.abs(got).max()).all()


@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (896, 4864)])
def test_widen5_rounds_each_weight_to_bfloat16(kernel, n, k):
    """Guards against a weight in the wrong place or rounded other than to the nearest bfloat16 (ties
    to even) when 5-bit weights are widened for a prefill chunk's dot."""
    import ml_dtypes
    levels, scales = _q5_0(np.random.default_rng(k), n, k)
    got = kernel.widen5(native.pack5(levels, scales), np.zeros(1, np.float32))
    want = _q5_0_values(levels, scales).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def _q8_0(rng, n, k):
    """Random Q8_0 blocks of an [n, k] matrix: levels -127..127, a float16 scale per 32 inputs (some
    negative, one block all zero)."""
    levels = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scales = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)
    scales[0, 0] = 0
    return levels, scales


def _q8_0_values(levels, scales):
    return levels.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=1)


@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (896, 4864)])
@pytest.mark.parametrize("rows", [1, 4, 5, 9])
def test_q8_matmul_is_each_blocks_exact_product_times_its_scales(kernel, n, k, rows):
    """Guards against the packed levels' offset, a pass of 8 rows (AVX2 and NEON: 4; then the rest) or
    the scales' order going wrong: per 32 inputs each row is rounded to int8 on its own scale, the
    product with the levels is an integer, then float32, times the weights' scales times the row's
    (one rounding) and added to the sum of the blocks before it (one rounding)."""
    rng = np.random.default_rng(n + k + rows + 1)
    levels, scales = _q8_0(rng, n, k)
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1, 50], (rows, 1))).astype(np.float32)
    if k > 32:
        x[-1, :32] = 0                                 # a zero block
    if rows > 1:
        x[0, :] = 0                                    # a padding row (one row: the decode step's own)
    got = kernel.q8_matmul(x, native.pack8(levels, scales))
    want = np.zeros((rows, n), np.float32)
    for b in range(k // 32):
        block = slice(32 * b, 32 * b + 32)
        (term, row_scale), = _terms(x[:, block], 1)
        exact = (term.astype(np.int64) @ levels[:, block].astype(np.int64).T).astype(np.float32)
        both = scales[:, b].astype(np.float32) * row_scale
        want = (want.astype(np.float64) + exact.astype(np.float64) * both.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert got.any() and (rows == 1 or not got[0].any())


@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (896, 4864)])
def test_widen8_rounds_each_weight_to_bfloat16(kernel, n, k):
    """Guards against a weight in the wrong place or rounded other than to the nearest bfloat16 (ties
    to even) when Q8_0 blocks are widened for a prefill chunk's dot."""
    import ml_dtypes
    levels, scales = _q8_0(np.random.default_rng(k + 1), n, k)
    got = kernel.widen8(native.pack8(levels, scales), np.zeros(1, np.float32))
    want = _q8_0_values(levels, scales).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_q8_blocks_give_an_embedding_tables_rows_and_refuse_a_level_of_minus_128():
    """Guards the embedding's row gather from Q8_0 blocks (a tied head's table) against a level or
    scale from another row, and packable8's refusal of -128 (the AVX2 tier's sign trick)."""
    levels, scales = _q8_0(np.random.default_rng(3), 48, 64)
    rows = np.array([[0, 47], [17, 17]])
    got = np.asarray(native.q8_rows({k: jnp.asarray(v) for k, v in native.pack8(levels, scales).items()},
                                    jnp.asarray(rows)))
    np.testing.assert_array_equal(got, _q8_0_values(levels, scales)[rows])
    assert native.packable8(levels.shape, int(levels.min()))
    levels[5, 7] = -128
    assert not native.packable8(levels.shape, int(levels.min())) and not native.packable8((40, 64), 0)


def random_k_blocks(rng, kind: str, rows: int, cols: int, step: float = 3e-4) -> np.ndarray:
    """Random GGUF super-blocks of an [rows, cols] matrix, uint8 [rows, cols / 256, bytes]: every
    level, scale and min drawn at random, d (and dmin) about `step` (some negative, as in files),
    one super-block's d zero as in a pruned row."""
    from engine.checkpoint import K_BYTES
    raw = rng.integers(0, 256, (rows, cols // 256, K_BYTES[kind]), dtype=np.uint8)
    scale = lambda: (rng.standard_normal((rows, cols // 256)) * step).astype(np.float16)  # noqa: E731
    d = scale()
    d[0, 0] = 0
    if kind in ("Q4_K", "Q5_K"):
        raw[..., 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
        raw[..., 2:4] = np.abs(scale()).view(np.uint8).reshape(rows, -1, 2)
    else:
        raw[..., 208:210] = d.view(np.uint8).reshape(rows, -1, 2)
    return raw


def _k_values(kind, raw):
    """gguf's own dequantization of super-blocks [rows, n, bytes] -> float32 [rows, 256 n]."""
    import gguf
    from gguf.quants import dequantize
    rows = raw.shape[0]
    return dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[kind]).reshape(rows, -1)


def _k_held(kind, raw):
    from engine.checkpoint import k_quant_parts
    return native.pack_k(kind, **k_quant_parts(kind, raw))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_parts_are_the_blocks_own_numbers(kind):
    """Guards against the 6-bit scales and mins of Q4_K and Q5_K, Q5_K's fifth bits or Q6_K's split
    levels being unpacked into other numbers than gguf's own decoder gives: d sc q - dmin m, d sc
    (q - 32)."""
    from engine.checkpoint import k_quant_parts
    raw = random_k_blocks(np.random.default_rng(1), kind, 16, 512)
    parts = {key: value.astype(np.float32) for key, value in k_quant_parts(kind, raw).items()}
    sub = native.K_SUB[kind]
    d = np.repeat(parts["d"], 256 // sub, axis=1) * parts["sc"]                       # per sub-block
    if kind != "Q6_K":
        values = np.repeat(d, sub, axis=1) * parts["levels"] - np.repeat(
            np.repeat(parts["dmin"], 8, axis=1) * parts["mins"], sub, axis=1)
    else:
        values = np.repeat(d, sub, axis=1) * (parts["levels"] - 32)
    np.testing.assert_array_equal(values, _k_values(kind, raw))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_blocks_give_an_embedding_tables_rows_as_gguf_decodes_them(kind):
    """Guards the embedding's row gather from K-quant blocks (a Q4_K_M file's table, held as the file
    has it) against a level, fifth bit, top bits, scale or min read from another row or lane: every
    row, in any order and shape, is gguf's own dequantization to the bit."""
    raw = random_k_blocks(np.random.default_rng(5), kind, 48, 512)
    rows = np.stack([np.arange(48), np.arange(47, -1, -1)]).reshape(2, 3, 16)
    got = np.asarray(native.k_rows({k: jnp.asarray(v) for k, v in _k_held(kind, raw).items()}, jnp.asarray(rows)))
    np.testing.assert_array_equal(got, _k_values(kind, raw)[rows])


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("n, k", [(16, 256), (48, 512), (896, 4864)])
@pytest.mark.parametrize("rows", [1, 4, 5, 9])
def test_k_matmul_is_each_super_blocks_exact_product_times_its_scales(kernel, kind, n, k, rows):
    """Guards against the K-quant layout (nibbles, Q5_K's fifth bits, Q6_K's top bits, scales and
    mins per lane), a
    pass of 4 rows (then the rest) or the order of the roundings going wrong: per 256 inputs each row
    is rounded to int8 on its own scale; per sub-block j the mins' part (dmin m_j, Q6_K's 32 d sc_j)
    times the row's scale times the terms' sum is taken off the float32 sum (each product rounded
    once, then a fused multiply-add); after the super-block its exact integer sum of sc_j q t, in
    float32, times d times the row's scale is added (a fused multiply-add)."""
    from engine.checkpoint import k_quant_parts
    rng = np.random.default_rng(n + k + rows)
    raw = random_k_blocks(rng, kind, n, k)
    parts = k_quant_parts(kind, raw)
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1, 50], (rows, 1))).astype(np.float32)
    if k > 256:
        x[-1, :256] = 0                                # a zero super-block
    if rows > 1:
        x[0, :] = 0                                    # a padding row (one row: the decode step's own)
    got = kernel.k_matmul(x, native.pack_k(kind, **parts))
    sub = native.K_SUB[kind]
    levels = parts["levels"].astype(np.int64)
    sc = parts["sc"].astype(np.int64)
    d = parts["d"].astype(np.float32)
    dm = d * np.float32(32) if kind == "Q6_K" else parts["dmin"].astype(np.float32)
    mins = sc if kind == "Q6_K" else parts["mins"].astype(np.int64)
    def fma(a, b, c):          # float64 holds the product exactly, and the sum all but always
        return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)
    want = np.zeros((rows, n), np.float32)
    for s in range(k // 256):
        (term, row_scale), = _terms(x[:, 256 * s:256 * s + 256], 1)                   # [rows, 256], [rows, 1]
        term = term.astype(np.int64)
        exact = np.zeros((rows, n), np.int64)
        for j in range(256 // sub):
            at = slice(256 * s + sub * j, 256 * s + sub * j + sub)
            js = s * (256 // sub) + j
            part = row_scale[:, 0] * term[:, sub * j:sub * j + sub].sum(1).astype(np.float32)  # [rows]
            minus = dm[:, s] * mins[:, js].astype(np.float32)                             # [n]
            want = fma(-minus[None, :], part[:, None], want)
            exact += (term[:, sub * j:sub * j + sub] @ levels[:, at].T) * sc[:, js][None, :]
        want = fma(exact.astype(np.float32), d[:, s][None, :] * row_scale, want)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert got.any() and (rows == 1 or not got[0].any())
    # Within what rounding each input by at most half its super-block's step can move the product.
    weights = _k_values(kind, raw).astype(np.float64)
    steps = np.concatenate([np.repeat(_terms(x[:, 256 * s:256 * s + 256], 1)[0][1], 256, axis=-1)
                            for s in range(k // 256)], axis=-1)
    bound = (steps / 2) @ np.abs(weights).T
    assert (np.abs(got - x.astype(np.float64) @ weights.T) <= bound * 1.001 + 1e-5 * np.abs(got).max()).all()


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("n, k", [(16, 256), (896, 4864)])
def test_widen_k_rounds_each_weight_to_bfloat16(kernel, kind, n, k):
    """Guards against a weight in the wrong place or other than gguf's value rounded to the nearest
    bfloat16 when K-quant blocks are widened for a prefill chunk's dot."""
    import ml_dtypes
    raw = random_k_blocks(np.random.default_rng(k), kind, n, k)
    got = kernel.widen_k(_k_held(kind, raw), np.zeros(1, np.float32))
    want = _k_values(kind, raw).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


S_KINDS = list(native.S_BYTES)


def random_s_blocks(rng, kind: str, rows: int, cols: int, step: float = 3e-4, extremes: bool = False) -> np.ndarray:
    """Random GGUF blocks of `kind` for an [rows, cols] matrix, uint8 [rows, cols / span, bytes]: every
    code, grid index, sign and scale drawn at random (each form's every bit pattern is a valid block),
    d about `step` (some negative), one block's d zero as in a pruned row, the last block all zero
    bytes; with `extremes`, d at float16's largest (65504) and smallest subnormal magnitudes too."""
    span = native.S_SPAN[kind]
    raw = rng.integers(0, 256, (rows, cols // span, native.S_BYTES[kind]), dtype=np.uint8)
    d = (rng.standard_normal((rows, cols // span)) * step).astype(np.float16)
    d[0, 0] = 0
    if extremes:
        d.flat[1::5] = np.float16(65504)
        d.flat[2::5] = -np.float16(2.0 ** -24)
    at = 108 if kind == "Q3_K" else 0
    raw[..., at:at + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    raw[-1, -1] = 0
    return raw


def _s_values(kind, raw):
    """gguf's own dequantization of blocks [rows, n, bytes] -> float32 [rows, span n]."""
    import gguf
    from gguf.quants import dequantize
    rows = raw.shape[0]
    return dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[kind]).reshape(rows, -1)


@pytest.mark.parametrize("kind", S_KINDS)
def test_s_block_parts_are_the_blocks_own_numbers(kind):
    """Guards against IQ4_XS's split 6-bit scales, IQ3_S's grid indices' ninth bits, signs and odd
    scales, Q3_K's three bit planes and packed scales, or any form's code order being read into other
    numbers than gguf's own decoder gives, bit for bit: (d sc) level[code], d at float16's extremes
    and all-zero blocks included."""
    raw = random_s_blocks(np.random.default_rng(1), kind, 16, 512, extremes=True)
    parts = s_block_parts(kind, raw)
    span, sub = native.S_SPAN[kind], native.S_SUB[kind]
    assert parts["codes"].max() < len(native.S_LEVELS[kind])
    d = np.repeat(parts["d"].astype(np.float32), span // sub, axis=1)
    if kind != "IQ4_NL":
        d = d * parts["sc"].astype(np.float32)
    values = np.repeat(d, sub, axis=1) * native.S_LEVELS[kind][parts["codes"]].astype(np.float32)
    want = _s_values(kind, raw)
    assert np.isfinite(want).all() and (want == 0).any() and np.abs(want).max() > 1e6
    np.testing.assert_array_equal(values, want)


def test_s_block_parts_and_pack_s_name_a_wrong_size_or_type():
    """Bad input is a clear error naming the block type and its size, not an index error deep in numpy."""
    with pytest.raises(ValueError, match=r"IQ4_XS blocks are \[rows, n, 136\]"):
        s_block_parts("IQ4_XS", np.zeros((2, 1, 110), np.uint8))
    with pytest.raises(ValueError, match="no form for 'IQ2_S'"):
        s_block_parts("IQ2_S", np.zeros((2, 1, 82), np.uint8))
    parts = s_block_parts("Q3_K", np.zeros((8, 1, 110), np.uint8))
    with pytest.raises(ValueError, match=r"Q3_K codes are \[N, K\] with N a multiple of 16 and K of 256, "
                                         r"got \[8, 256\]"):
        native.pack_s("Q3_K", **parts)


def _s_held(kind, raw):
    return native.pack_s(kind, **s_block_parts(kind, raw))


@pytest.mark.parametrize("kind", S_KINDS)
@pytest.mark.parametrize("n, k", [(16, 256), (48, 512), (896, 4864)])
@pytest.mark.parametrize("rows", [1, 4, 5, 9])
def test_s_matmul_is_each_spans_exact_product_times_its_scales(kernel, kind, n, k, rows):
    """Guards against the scaled-level layouts (nibble codes through the table, Q3_K's bit pairs and
    third-bit masks, scales and d per lane), a pass of 8 rows (AVX2 and NEON: 4; then the rest), the
    held levels' offset or the order of the roundings going wrong: per span (IQ4_NL 32 inputs, else
    256) each row is rounded to int8 on its own scale; per sub-block the exact integer sum of level x
    term times its scale adds to the span's integer sum, which in float32 times d times the row's
    scale (rounded once) is added to the float32 sum (a fused multiply-add)."""
    rng = np.random.default_rng(n + k + rows)
    raw = random_s_blocks(rng, kind, n, k)
    parts = s_block_parts(kind, raw)
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1, 50], (rows, 1))).astype(np.float32)
    if k > 256:
        x[-1, :256] = 0                                # a zero span
    if rows > 1:
        x[0, :] = 0                                    # a padding row (one row: the decode step's own)
    got = kernel.s_matmul(x, native.pack_s(kind, **parts))
    span, sub = native.S_SPAN[kind], native.S_SUB[kind]
    levels = native.S_LEVELS[kind][parts["codes"]].astype(np.int64)
    sc = parts["sc"].astype(np.int64) if kind != "IQ4_NL" else np.ones((n, k // sub), np.int64)
    d = parts["d"].astype(np.float32)
    want = np.zeros((rows, n), np.float32)
    for s in range(k // span):
        (term, row_scale), = _terms(x[:, span * s:span * s + span], 1)
        exact = np.zeros((rows, n), np.int64)
        for j in range(span // sub):
            at = slice(span * s + sub * j, span * s + sub * j + sub)
            exact += (term[:, sub * j:sub * j + sub].astype(np.int64) @ levels[:, at].T) * sc[:, at.start // sub]
        both = d[:, s][None, :] * row_scale                                                  # rounded once
        want = (exact.astype(np.float32).astype(np.float64) * both.astype(np.float64) + want).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert got.any() and (rows == 1 or not got[0].any())
    # Within what rounding each input by at most half its span's step can move the product.
    weights = _s_values(kind, raw).astype(np.float64)
    steps = np.concatenate([np.repeat(_terms(x[:, span * s:span * s + span], 1)[0][1], span, axis=-1)
                            for s in range(k // span)], axis=-1)
    bound = (steps / 2) @ np.abs(weights).T
    assert (np.abs(got - x.astype(np.float64) @ weights.T) <= bound * 1.001 + 1e-5 * np.abs(got).max()).all()


@pytest.mark.parametrize("kind", S_KINDS)
@pytest.mark.parametrize("n, k", [(16, 256), (896, 4864)])
def test_widen_s_rounds_each_weight_to_bfloat16(kernel, kind, n, k):
    """Guards against a weight in the wrong place or other than gguf's value rounded to the nearest
    bfloat16 (ties to even) when scaled-level blocks are widened for a prefill chunk's dot; d at float16's
    extremes and all-zero blocks included."""
    import ml_dtypes
    raw = random_s_blocks(np.random.default_rng(k), kind, n, k, extremes=True)
    got = kernel.widen_s(_s_held(kind, raw), np.zeros(1, np.float32))
    want = _s_values(kind, raw).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@needs_kernel
@pytest.mark.parametrize("kind", S_KINDS)
@pytest.mark.parametrize("int8_max_rows", [products.INT8_ROWS_MAX_ROWS, 0])
def test_products_multiply_scaled_level_blocks_in_their_own_form(kind, int8_max_rows, monkeypatch):
    """Guards engine.products' dispatch: weights held by pack_s are their own kind, of their matrix's
    shape, multiplied by the kernel's product for a few rows or widened for a prefill chunk's dot
    (int8_max_rows 0), either way within rounding of the blocks' values in float32."""
    monkeypatch.setattr(products, "INT8_ROWS_MAX_ROWS", int8_max_rows)
    monkeypatch.setattr(products, "PREFILL_BY_KERNEL", products.PREFILL_BY_KERNEL and bool(int8_max_rows))
    raw = random_s_blocks(np.random.default_rng(5), kind, 48, 512)
    held = _s_held(kind, raw)
    assert products.weight_kind(held) == kind.lower() and native.s_shape(held) == (48, 512)
    x = np.random.default_rng(6).standard_normal((2, 3, 512)).astype(np.float32)
    got = np.asarray(jax.jit(products.matmul)(jnp.asarray(x), {key: jnp.asarray(v) for key, v in held.items()}))
    want = x @ _s_values(kind, raw).T
    assert got.shape == (2, 3, 48)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("form", ["int8", "Q4_K", "IQ4_XS"])
def test_a_prefill_chunk_widens_a_large_matrix_in_parts_with_the_same_products(form, monkeypatch):
    """Guards products.WIDEN_PART_BYTES' parts: a matrix widened and multiplied part by part (5
    blocks of 16 outputs in parts of 2, 2 and 1) gives every output the bits of the whole matrix's
    product, and the parts are really three widenings."""
    monkeypatch.setattr(products, "INT8_ROWS_MAX_ROWS", 0)
    monkeypatch.setattr(products, "PREFILL_BY_KERNEL", False)
    rng = np.random.default_rng(11)
    n, k = 5 * native.LANES, 512
    if form == "int8":
        held = {"q": native.pack(_offset_weights(rng, n, k)), "scale": rng.random(n, dtype=np.float32)}
        call = "mashbox_int8_widen"
    elif form == "Q4_K":
        held, call = _k_held(form, random_k_blocks(rng, form, n, k)), "mashbox_q4k_widen"
    else:
        held, call = _s_held(form, random_s_blocks(rng, form, n, k)), "mashbox_iq4xs_widen"
    held = {key: jnp.asarray(v) for key, v in held.items()}
    x = jnp.asarray(rng.standard_normal((3, k)).astype(np.float32))

    def product():
        f = jax.jit(lambda x, w: products.matmul(x, w))        # a new function: traced again
        return np.asarray(f(x, held)), f.lower(x, held).as_text().count(call)

    whole, widenings = product()
    assert widenings == 1
    monkeypatch.setattr(products, "WIDEN_PART_BYTES", 2 * native.LANES * k * 2)
    parts, widenings = product()
    assert widenings == 3
    np.testing.assert_array_equal(parts.view(np.uint32), whole.view(np.uint32))


def _product(form: str, rng, n: int, k: int):
    """(engine.native's product call, its weights after x) of a random [n, k] matrix in `form`."""
    from engine.checkpoint import k_quant_parts
    if form == "int8":
        return "int8_matmul", (native.pack(_offset_weights(rng, n, k)), rng.random(n).astype(np.float32))
    if form == "Q5_0":
        return "int5_matmul", (native.pack5(*_q5_0(rng, n, k)),)
    if form == "Q8_0":
        return "q8_matmul", (native.pack8(*_q8_0(rng, n, k)),)
    if form in native.K_SUB:
        return "k_matmul", (native.pack_k(form, **k_quant_parts(form, random_k_blocks(rng, form, n, k))),)
    return "s_matmul", (native.pack_s(form, **s_block_parts(form, random_s_blocks(rng, form, n, k))),)


@pytest.mark.parametrize("form", ["int8", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "Q3_K"])
def test_a_products_trailing_zero_rows_answer_zero_and_leave_the_rows_before_them_alone(kernel, form):
    """A prompt chunk's padding reaches a product as trailing zero rows (engine/model.py:
    _padding_zeroed), which the kernel does not compute (LiveRows). Guards against the rows before
    them getting other numbers than they get alone (a pass of rows cut at the wrong row), a zero row
    inside the live ones being dropped, the padding's outputs being anything but zero, or a call of
    padding only (an idle decode batch) going wrong."""
    rng = np.random.default_rng(len(form))
    call, w = _product(form, rng, 48, 512)
    call = getattr(kernel, call)
    x = rng.standard_normal((11, 512)).astype(np.float32)
    x[2] = 0                                           # a zero row among the live ones
    x[6:] = 0                                          # the padding
    got = call(x, *w)
    np.testing.assert_array_equal(got[:6], call(x[:6], *w))
    assert got[:6].any() and not got[2].any() and not got[6:].any()
    assert not call(np.zeros((5, 512), np.float32), *w).any()


def test_packed_layout_round_trips_and_reads_rows():
    """Guards against pack, unpack and packed_rows disagreeing about where element [n, k] lives."""
    q = _offset_weights(np.random.default_rng(0), 48, 20)
    packed = native.pack(q)
    assert packed.shape == (3, 5, 16, 4) and native.is_packed(packed)
    assert packed[2, 3, 5, 1] == q[2 * 16 + 5, 3 * 4 + 1]
    np.testing.assert_array_equal(native.unpack(packed), q)
    rows = np.array([[0, 47], [17, 17]])
    np.testing.assert_array_equal(native.packed_rows(jnp.asarray(packed), jnp.asarray(rows)), q[rows])
    assert not native.packable((48, 18)) and not native.packable((40, 20)) and native.packable((48, 20))


@needs_kernel
@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied", "qwen2"])
@pytest.mark.parametrize("int8_max_rows", [products.INT8_ROWS_MAX_ROWS, 0])
def test_packed_weights_give_the_plain_layouts_logits(name, int8_max_rows, monkeypatch):
    """Guards against the kernel's path (the terms' product, the tied head, the embedding's packed
    rows, and the widened weights of a prefill chunk when int8_max_rows is 0) computing anything but
    what XLA's products compute from the same int8 weights. Not to the bit: XLA's fused loops round
    the terms' float32 sums a unit in the last place differently (the kernel rounds as the previous
    test's numpy does); measured on the tiny models up to 0.005 apart, the greedy tokens the same."""
    from safetensors.numpy import load_file
    monkeypatch.setattr(weights, "OFFSET_INT8", True)
    monkeypatch.setattr(products, "INT8_ROWS_MAX_ROWS", int8_max_rows)
    monkeypatch.setattr(products, "PREFILL_BY_KERNEL", products.PREFILL_BY_KERNEL and bool(int8_max_rows))
    folder = os.path.join(TINY, name)
    cfg = load_config(folder)
    tokens = np.asarray(load_file(os.path.join(folder, "reference.safetensors"))["tokens"])[:24]
    # fresh functions (the forward and its layers), so jit traces them again with the patched constant
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
    monkeypatch.setattr(model, "_jit_layer", jax.jit(lambda *a, **k: model._layer(*a, **k),
                                                     static_argnames=model.LAYER_STATIC_ARGNAMES))
    packed = load_weights(folder, cfg, "int8")
    plain = load_weights(folder, cfg, "int8", pack=False)
    assert native.is_packed(packed["layers"][0]["qkv"]["q"]) and native.is_packed(packed["embed"]["q"])
    assert plain["layers"][0]["qkv"]["q"].ndim == 2
    got, want = _logits(cfg, packed, tokens, forward), _logits(cfg, plain, tokens, forward)
    np.testing.assert_allclose(got, want, atol=0.02, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_kernel
@pytest.mark.parametrize("name", ["qwen3-8", "qwen2"])
def test_a_chunks_padding_reaches_every_product_as_zero_rows(name, monkeypatch):
    """The kernel skips a product's trailing zero rows (LiveRows): guards against a product of a
    layer (the projections, the attention's or the linear attention's output, the MLP; Qwen2's
    biased qkv) getting a padded position's row as anything but zero, and against the zeroing
    changing a real position's numbers (the same logits as the prompt in a chunk of its own length)."""
    from dataclasses import replace
    from safetensors.numpy import load_file
    folder = os.path.join(TINY, name)
    cfg = replace(load_config(folder), native=True)
    params = load_weights(folder, cfg, "int8", pack=True)
    tokens = np.asarray(load_file(os.path.join(folder, "reference.safetensors"))["tokens"])[:6]
    padded_rows, matmul = [], products.matmul

    def watched(x, w):
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] == 32:                           # the chunk's rows (the head reads one)
            jax.debug.callback(lambda rows: padded_rows.append(np.abs(rows).max()), flat[6:])
        return matmul(x, w)
    monkeypatch.setattr(model, "matmul", watched)
    monkeypatch.setattr(products, "matmul", watched)      # the MLP's (products.swiglu)
    # fresh functions (the forward and its layers), so jit traces them again with the watched products
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg",))
    monkeypatch.setattr(model, "_jit_layer", jax.jit(lambda *a, **k: model._layer(*a, **k),
                                                     static_argnames=model.LAYER_STATIC_ARGNAMES))
    i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731

    def last_logits(chunk):
        kv = init_cache(cfg, 1, 64, jnp.int8)
        padded = jnp.asarray(np.pad(tokens, (0, chunk - len(tokens)))[None], jnp.int32)
        logits, _ = forward(params, kv, padded, i32(0), i32(0), i32(len(tokens)), cfg=cfg)
        jax.effects_barrier()
        return np.asarray(logits)
    alone = last_logits(6)
    assert not padded_rows
    np.testing.assert_array_equal(last_logits(32), alone)
    assert len(padded_rows) == 4 * cfg.num_layers and max(padded_rows) == 0


@needs_kernel
@pytest.mark.parametrize("int8_max_rows", [products.INT8_ROWS_MAX_ROWS, 0])
def test_a_ggufs_q5_0_matrices_are_held_at_5_bits_and_compute_their_values(tiny_demo, int8_max_rows,
                                                                          tmp_path, monkeypatch):
    """Guards against a GGUF's Q5_0 matrices losing their exact values (int8 per channel rounds them
    again) or a matrix with any other block type in it (the tiny GGUF's qkv: Q8_0 values; gate_up: a
    Q8_0 up) being held at 5 bits; and the 5-bit path (the kernel's product, or the widened weights
    of a prefill chunk when int8_max_rows is 0), or its held copy, computing other logits than the
    same weights in float32."""
    monkeypatch.setattr(weights, "OFFSET_INT8", True)
    monkeypatch.setattr(products, "INT8_ROWS_MAX_ROWS", int8_max_rows)
    monkeypatch.setattr(products, "PREFILL_BY_KERNEL", products.PREFILL_BY_KERNEL and bool(int8_max_rows))
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
    monkeypatch.setattr(model, "_jit_layer", jax.jit(lambda *a, **k: model._layer(*a, **k),
                                                     static_argnames=model.LAYER_STATIC_ARGNAMES))
    spec, _, _ = tiny_demo
    folder = registry.prepare(spec)
    cfg = load_config(folder)
    held = str(tmp_path / "held")
    narrow = load_weights(folder, cfg, "int8", held_cache=held)
    layer = narrow["layers"][0]
    assert native.is_int5(layer["down"])
    assert not any(native.is_int5(layer[name]) for name in ("qkv", "o", "gate_up"))
    again = load_weights(folder, cfg, "int8", held_cache=held)                   # the held copy
    assert native.is_int5(again["layers"][0]["down"])
    # The same model with the down projection in float32 (the file's values exactly: Q5_0 decodes
    # into float32 without rounding), the rest as held.
    down = load_weights(folder, cfg, jnp.float32)["layers"][0]["down"]
    wide = {**narrow, "layers": [{**layer, "down": down}]}
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, cfg.intermediate_size)), jnp.float32)
    tolerance = 2e-2          # bfloat16 rows and weights, or the kernel's rows in int8 per 32 inputs
    got = np.asarray(jax.jit(products.matmul)(x, layer["down"]))
    want = np.asarray(x) @ np.asarray(down).T
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * np.abs(want).max())
    tokens = np.arange(2, 26) % cfg.vocab_size
    logits = _logits(cfg, narrow, tokens, forward)
    np.testing.assert_array_equal(_logits(cfg, again, tokens, forward), logits)
    want = _logits(cfg, wide, tokens, forward)
    np.testing.assert_allclose(logits, want, atol=tolerance * np.abs(want).max(), rtol=0)


@needs_kernel
@pytest.mark.parametrize("int8_max_rows", [products.INT8_ROWS_MAX_ROWS, 0])
def test_a_ggufs_q8_0_head_is_held_in_its_blocks_and_computes_its_values(tiny_demo, int8_max_rows, tmp_path,
                                                                         monkeypatch):
    """Guards against a GGUF's Q8_0 head (the demo's) being rounded again to int8 per channel, or a
    matrix with another block type in it (the tiny GGUF's gate_up: a Q5_0 gate beside a Q8_0 up) held
    as Q8_0; and the Q8_0 path (the kernel's product, or the widened weights of a prefill chunk when
    int8_max_rows is 0), or its held copy, computing other logits than the file's values in float32."""
    monkeypatch.setattr(products, "INT8_ROWS_MAX_ROWS", int8_max_rows)
    monkeypatch.setattr(products, "PREFILL_BY_KERNEL", products.PREFILL_BY_KERNEL and bool(int8_max_rows))
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
    spec, _, _ = tiny_demo
    folder = registry.prepare(spec)
    cfg = load_config(folder)
    held = str(tmp_path / "held")
    narrow = load_weights(folder, cfg, "int8", held_cache=held)
    assert native.is_q8(narrow["lm_head"]) and not cfg.tie_word_embeddings
    assert not native.is_q8(narrow["layers"][0]["gate_up"]) and not native.is_q8(narrow["embed"])
    again = load_weights(folder, cfg, "int8", held_cache=held)                   # the held copy
    assert native.is_q8(again["lm_head"])
    head = load_weights(folder, cfg, jnp.float32)["lm_head"]          # Q8_0 decodes into float32 exactly
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, cfg.hidden_size)), jnp.float32)
    tolerance = 2e-2          # bfloat16 rows and weights, or the kernel's rows in int8 per 32 inputs
    got = np.asarray(jax.jit(products.matmul)(x, narrow["lm_head"]))
    want = np.asarray(x) @ np.asarray(head).T
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * np.abs(want).max())
    tokens = np.arange(2, 26) % cfg.vocab_size
    logits = _logits(cfg, narrow, tokens, forward)
    np.testing.assert_array_equal(_logits(cfg, again, tokens, forward), logits)
    want = _logits(cfg, {**narrow, "lm_head": head}, tokens, forward)
    np.testing.assert_allclose(logits, want, atol=tolerance * np.abs(want).max(), rtol=0)


def test_switched_off_or_without_a_tier_the_weights_stay_plain(monkeypatch):
    """Guards against packing (or a build) where the kernel cannot run: MASHBOX_NATIVE=0, or a CPU
    with neither tier's instructions (AVX2 without F16C), keeps XLA's products on the plain layout."""
    folder = os.path.join(TINY, "qwen2")
    cfg = load_config(folder)
    for env, flags in (({"MASHBOX_NATIVE": "0"}, None), ({}, frozenset({"avx2", "fma"}))):
        native.available.cache_clear()
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            if flags is not None:
                m.setattr(native.cpu, "flags", lambda: flags)
            assert not native.available()
            assert load_weights(folder, cfg, "int8")["layers"][0]["down"]["q"].ndim == 2
    native.available.cache_clear()


def test_the_tier_is_the_best_the_cpu_has_or_the_one_forced(monkeypatch):
    """Guards the tier choice (native.TIERS): AVX-512 VNNI first, then AVX-VNNI, then AVX2, NEON on ARM
    with dot products (not without), MASHBOX_NATIVE_TIER forcing a tier the CPU has (never one it
    lacks: that build would fault), none when switched off."""
    avx2, avx_vnni = native.TIERS["avx2"][0], native.TIERS["avx_vnni"][0]
    avx512 = native.TIERS["avx512_vnni"][0] | avx_vnni
    for flags, env, want in ((avx512, {}, "avx512_vnni"), (avx512, {native.TIER_ENV: "avx2"}, "avx2"),
                             (avx512, {native.TIER_ENV: "avx_vnni"}, "avx_vnni"),
                             (avx_vnni, {}, "avx_vnni"), (avx_vnni, {native.TIER_ENV: "avx2"}, "avx2"),
                             (avx2, {}, "avx2"), (avx2, {native.TIER_ENV: "avx512_vnni"}, None),
                             (avx2, {native.TIER_ENV: "avx_vnni"}, None),
                             (avx512, {native.ENV_SWITCH: "0"}, None), (frozenset({"sse4_2"}), {}, None),
                             (frozenset({"fp", "asimd", "asimddp"}), {}, "neon_dotprod"),
                             (frozenset({"fp", "asimd"}), {}, None)):
        with monkeypatch.context() as m:
            m.setattr(native.cpu, "flags", lambda: flags)
            for key in (native.TIER_ENV, native.ENV_SWITCH):
                m.delenv(key, raising=False)
            for key, value in env.items():
                m.setenv(key, value)
            assert native.tier() == want, (sorted(flags), env)
    if native.tier():                   # this CPU's: built for its tier's instructions
        assert set(native.TIERS[native.tier()][1]) <= set(native.compile_flags())


@pytest.mark.skipif(not native.available(), reason="the kernel does not run here")
def test_a_tier_the_compiler_cannot_build_gives_way_to_the_next(monkeypatch):
    """A compiler too old for a tier's flags (GCC before 11 has no -mavxvnni) costs that tier, not
    the kernel: the next tier the CPU has is built instead."""
    monkeypatch.delenv(native.TIER_ENV, raising=False)
    own = native.tier()
    monkeypatch.setattr(native, "TIERS", {"unbuildable": (frozenset(), ("-mno-such-instructions",)), **native.TIERS})
    monkeypatch.setattr(native, "_unbuildable", set())
    assert native.tier() == "unbuildable"
    library = native._build_best(native._compiler())
    assert native.tier() == own and library.name.startswith(f"native-{own}-") and library.exists()
    assert native._unbuildable == {"unbuildable"}


AMX_CPU = native.TIERS["avx512_vnni"][0] | native.TIERS["avx2"][0] | native.TILE_FLAGS[0]


def test_the_kernel_takes_amx_tiles_only_on_the_avx512_tier_of_a_cpu_with_them(monkeypatch):
    """Guards native.tiles_wanted: the tiles' flags only where the AVX-512 tier runs on a CPU with AMX
    (a build with them elsewhere would fault), not when switched off (MASHBOX_AMX=0), not once refused,
    and the tiles' long chunks for every kind the kernel holds, none once the tiles are refused
    (engine.products.kernel_takes)."""
    from engine import products
    for flags, env, want in ((AMX_CPU, {}, True), (AMX_CPU, {native.TILES_ENV: "0"}, False),
                             (AMX_CPU, {native.TIER_ENV: "avx2"}, False),
                             (native.TIERS["avx512_vnni"][0], {}, False), (native.TIERS["avx2"][0], {}, False)):
        with monkeypatch.context() as m:
            m.setattr(native.cpu, "flags", lambda: flags)
            for key in (native.TIER_ENV, native.ENV_SWITCH, native.TILES_ENV):
                m.delenv(key, raising=False)
            for key, value in env.items():
                m.setenv(key, value)
            m.setattr(native, "_tiles_refused", None)
            assert native.tiles_wanted() == want, (sorted(flags), env)
            assert (native.TILE_FLAGS[1][0] in native.compile_flags()) == want
            m.setattr(native, "_tiles_refused", "refused")
            assert not native.tiles_wanted()
    with monkeypatch.context() as m:
        m.setattr(products, "PREFILL_BY_KERNEL", False)
        m.setattr(native, "_tiles", True)
        rows = products.INT8_ROWS_MAX_ROWS + 1
        for kind in ("int8_packed", "int8", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "iq3_s",
                     "q3_k"):
            assert products.kernel_takes(rows, kind), kind
        held = {"layers": [{"o": {"q": np.zeros((1, 1, 16, 4), np.uint8), "scale": np.ones(16, np.float32)},
                            "down": {"knib": np.zeros(1, np.uint8)}, "attn_norm": np.ones(4, np.float32),
                            "linear": {"parts": {"0": {"q8": np.zeros(1, np.uint8)}, "1": np.ones((16, 4)),
                                                 "2": {"iq4xs": np.zeros(1, np.uint8)}}}}]}
        assert products.widened_kinds(held) == set()
        m.setattr(native, "_tiles", False)
        assert not products.kernel_takes(rows, "q4_k") and products.kernel_takes(rows - 1, "q4_k")
        assert products.widened_kinds(held) == {"Q4_K", "Q8_0", "IQ4_XS", "int8"}


@pytest.mark.parametrize("verdict", [0, 1, 2, 3, -11])
def test_tiles_that_fail_their_check_give_way_to_the_same_tier_without_them(verdict, monkeypatch, tmp_path, caplog):
    """Guards native._build_checked: the library built with the tiles serves only when its own check
    (run in a process of its own: a fault there, -11, cannot take the worker down) says 0; otherwise
    the log says why and the same tier's library without them serves, its long chunks widened."""
    import logging
    import subprocess
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    libraries = {}
    for tiled, code in ((True, verdict), (False, 3)):
        body = f"int mashbox_tiles_check(void) {{ {'raise(SIGSEGV); ' if code < 0 else ''}return {max(code, 0)}; }}"
        path = libraries[tiled] = tmp_path / f"tiled-{tiled}.so"
        subprocess.run([native._compiler(), "-x", "c", "-shared", "-fPIC", "-o", str(path), "-"],
                       input=f"#include <signal.h>\n{body}\n", text=True, check=True)
    monkeypatch.setattr(native.cpu, "flags", lambda: AMX_CPU)
    for key in (native.TIER_ENV, native.ENV_SWITCH, native.TILES_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(native, "_tiles_refused", None)
    monkeypatch.setattr(native, "_tiles", False)
    monkeypatch.setattr(native, "_build", lambda compiler: libraries[native.TILE_FLAGS[1][0] in native.compile_flags()])
    with caplog.at_level(logging.WARNING, logger="mashbox.engine"):
        library = native._build_checked("c++")
    assert (library, native.tiles()) == ((libraries[True], True) if verdict == 0 else (libraries[False], False))
    if verdict:
        why = native.TILES_REFUSED.get(verdict, f"its check ended with status {verdict}")
        assert native._tiles_refused == why and f"AMX tiles unused ({why})" in caplog.text
    else:
        assert native._tiles_refused is None and not caplog.text


@pytest.mark.skipif(native.tier() not in ("avx512_vnni", "avx_vnni"),
                    reason="this CPU's only tier is the one the suite runs")
def test_the_avx2_tier_passes_the_kernel_tests_on_a_vnni_cpu():
    """Every tier is held to the same numpy definitions on one machine: the kernel's own tests again
    (its products, widening, attention, float products and sampling helpers; not the model-level
    ones, which add nothing per tier), in a process whose kernel is built for AVX2
    (MASHBOX_NATIVE_TIER)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "(matmul or widen or first_max or filter_cuts or attend or row_dot or delta_steps) and not prefill "
                           "and not neon and not avx_vnni"],
                          env={**os.environ, native.TIER_ENV: "avx2"},
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:]


def test_packed_and_plain_weights_are_held_apart():
    """Guards against a start reading a held copy in the other layout (a worker on several devices
    holds them plain, one on a single device packed)."""
    assert held_key("sha", "int8", "float32", 2, True) != held_key("sha", "int8", "float32", 2, False)


def _attention_reference(q, k, v, k_scale, v_scale, slots, positions):
    """Decode attention over an int8 cache in float64, exactly."""
    out = np.zeros(q.shape)
    for b, (slot, last) in enumerate(zip(slots, positions)):
        keys = k[slot, :, :, :last + 1] * k_scale[slot, :, None, :last + 1]            # [KV, D, P]
        values = v[slot, :, :, :last + 1] * v_scale[slot, :, None, :last + 1]
        scores = np.einsum("hgd,hdp->hgp", q[b].astype(np.float64), keys)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[b] = np.einsum("hgp,hdp->hgd", probs / probs.sum(-1, keepdims=True), values)
    return out


# What the kernel rounds (engine/native.cc): each query row to int16 on its own scale, and per
# task of ATTEND_SPLIT positions each row's softmax weights times the values' scales to int16 on
# theirs.
ATTEND_SPLIT, QUERY_LEVELS, WEIGHT_LEVELS = 2048, 16383, 32767


def _attention_rounded(q, k, v, k_scale, v_scale, slots, positions):
    """Decode attention over an int8 cache in float64, with the kernel's roundings: what
    native.int8_attend computes."""
    out = np.zeros(q.shape)
    for b, (slot, last) in enumerate(zip(slots, positions)):
        rows = q[b].astype(np.float64)
        unit = np.abs(rows).max(-1, keepdims=True) / QUERY_LEVELS
        rows = np.round(rows / unit) * unit
        tasks = []
        for begin in range(0, last + 1, ATTEND_SPLIT):
            span = slice(begin, min(begin + ATTEND_SPLIT, last + 1))
            keys = k[slot, :, :, span] * k_scale[slot, :, None, span].astype(np.float64)
            scores = np.einsum("hgd,hdp->hgp", rows, keys)
            best = scores.max(-1, keepdims=True)
            probs = np.exp(scores - best)
            weights = probs * v_scale[slot, :, None, span]
            top = weights.max(-1, keepdims=True) / WEIGHT_LEVELS
            sums = np.einsum("hgp,hdp->hgd", np.round(weights / top), v[slot, :, :, span]) * top
            tasks.append((best[..., 0], probs.sum(-1), sums))
        best = np.max([t[0] for t in tasks], axis=0)
        total = sum(t[1] * np.exp(t[0] - best) for t in tasks)
        out[b] = sum(t[2] * np.exp(t[0] - best)[..., None] for t in tasks) / total[..., None]
    return out


@pytest.mark.parametrize("group, d, positions", [(7, 64, [0, 17, 4095, 5000]), (2, 16, [1, 2047, 2048, 9]),
                                                  (12, 8, [3, 3, 3000, 40])])
def test_int8_attend_is_softmax_attention_over_each_rows_own_context(kernel, group, d, positions):
    """Guards against a row reading past its own position or another slot, a task boundary (every
    2048 positions) or a tail of fewer than 32 positions merging wrongly, or groups of more than 8
    query rows losing some; and against the int16 roundings costing more than 1/2000 of the
    largest output."""
    rng = np.random.default_rng(group)
    slots, kv, ctx = 3, 2, 5120
    k = rng.integers(-127, 128, (slots, kv, d, ctx), dtype=np.int8)
    v = rng.integers(-127, 128, (slots, kv, d, ctx), dtype=np.int8)
    k_scale = (rng.random((slots, kv, ctx)) * 0.02).astype(np.float32)
    v_scale = rng.random((slots, kv, ctx)).astype(np.float32)
    q = (rng.standard_normal((len(positions), kv, group, d)) / 4).astype(np.float32)
    rows = np.array([2, 0, 1, 0], np.int32)[:len(positions)]
    where = np.array(positions, np.int32)
    got = kernel.int8_attend(q, k, v, k_scale, v_scale, rows, where)
    rounded = _attention_rounded(q, k, v, k_scale, v_scale, rows, where)
    np.testing.assert_allclose(got, rounded, rtol=1e-4, atol=1e-5 * np.abs(rounded).max())
    exact = _attention_reference(q, k, v, k_scale, v_scale, rows, where)
    assert np.abs(got - exact).max() < np.abs(exact).max() / 2000
    k[rows[0], :, :, positions[0] + 1:] = 127                 # what lies past a row's position is not read
    again = kernel.int8_attend(q, k, v, k_scale, v_scale, rows, where)
    np.testing.assert_array_equal(again[0], got[0])


def _wide_model(folder) -> None:
    """A random Qwen2-shaped checkpoint whose layers' weights, widened, outweigh a chunk's activations."""
    import json
    from safetensors.numpy import save_file
    h, f, heads, kv_heads, layers, vocab = 256, 2048, 4, 2, 8, 256
    kv = kv_heads * h // heads
    json.dump({"model_type": "qwen2", "hidden_size": h, "intermediate_size": f, "num_hidden_layers": layers,
               "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
               "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": True, "torch_dtype": "float32"}, open(os.path.join(folder, "config.json"), "w"))
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.02  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": np.ones(h, np.float32),
                        p + "post_attention_layernorm.weight": np.ones(h, np.float32),
                        p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.q_proj.bias": w(h),
                        p + "self_attn.k_proj.weight": w(kv, h), p + "self_attn.k_proj.bias": w(kv),
                        p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.v_proj.bias": w(kv),
                        p + "self_attn.o_proj.weight": w(h, h), p + "mlp.gate_proj.weight": w(f, h),
                        p + "mlp.up_proj.weight": w(f, h), p + "mlp.down_proj.weight": w(h, f)})
    save_file(tensors, os.path.join(folder, "model.safetensors"))


@pytest.mark.parametrize("pack", [False, pytest.param(True, marks=needs_kernel)])
def test_prefill_widens_each_layers_weights_only_when_its_product_is_next(pack, tmp_path, monkeypatch):
    """Guards against XLA's scheduler moving every layer's int8 -> bfloat16 widening to the start
    of a prefill program, which then holds all the layers' wide copies at once (the demo's 512-token
    chunk: 0.79 GB of temporaries, against 0.09 GB with each made when its product is next)."""
    _wide_model(str(tmp_path))
    cfg = load_config(str(tmp_path))
    params = load_weights(str(tmp_path), cfg, "int8", pack=pack)
    assert native.is_packed(params["layers"][0]["gate_up"]["q"]) == pack
    monkeypatch.setattr(products, "INT8_ROWS_MAX_ROWS", 0)        # every chunk takes the wide product
    monkeypatch.setattr(products, "PREFILL_BY_KERNEL", False)
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
    monkeypatch.setattr(model, "_jit_layer", jax.jit(lambda *a, **k: model._layer(*a, **k),
                                                     static_argnames=model.LAYER_STATIC_ARGNAMES))
    i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
    compiled = forward.lower(params, init_cache(cfg, 1, 256, jnp.int8), jnp.zeros((1, 64), jnp.int32), i32(0),
                             i32(0), i32(64), cfg=cfg).compile()
    layer = params["layers"][0]
    wide_layer = 2 * sum(m["q"].size for m in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"]))
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * wide_layer < cfg.num_layers * wide_layer / 2


@pytest.mark.parametrize("group", [1, 6])
def test_int8_attend_gives_each_row_of_a_chunk_the_numbers_it_gets_alone(kernel, group):
    """A prefill chunk's tokens are consecutive rows of one slot, which share the kernel's passes over
    the keys (blocks of 16 rows). Guards against a row's numbers depending on its neighbours: a
    row's sums running past its own position, a block's task boundary (every 2048 positions) that
    an early row does not reach, or a block cut between slots."""
    rng = np.random.default_rng(group)
    slots, kv, d, ctx = 2, 2, 32, 4200
    k = rng.integers(-127, 128, (slots, kv, d, ctx), dtype=np.int8)
    v = rng.integers(-127, 128, (slots, kv, d, ctx), dtype=np.int8)
    k_scale = (rng.random((slots, kv, ctx)) * 0.02).astype(np.float32)
    v_scale = rng.random((slots, kv, ctx)).astype(np.float32)
    chunk = list(range(2030, 2070))                      # 40 tokens across the boundary at 2048
    positions = chunk[:20] + [5] + chunk[20:] + [4199, 0, 3]
    rows = np.array([1] * 41 + [0, 0, 1], np.int32)
    where = np.array(positions, np.int32)
    q = (rng.standard_normal((len(positions), kv, group, d)) / 4).astype(np.float32)
    whole = kernel.int8_attend(q, k, v, k_scale, v_scale, rows, where)
    for b in range(len(positions)):
        alone = kernel.int8_attend(q[b:b + 1], k, v, k_scale, v_scale, rows[b:b + 1], where[b:b + 1])
        np.testing.assert_array_equal(whole[b], alone[0], err_msg=f"row {b} at position {positions[b]}")


def test_int8_attend_reads_nothing_for_a_padding_row(kernel):
    """A padded token of a prompt chunk comes at position -1 (engine.attention.attend with valid):
    guards against it reading keys (its output must be zero), its neighbours' numbers changing with
    it (the rows after it, of its slot, are a block of their own), or a call of padding only."""
    rng = np.random.default_rng(5)
    slots, kv, group, d, ctx = 2, 2, 3, 32, 300
    k = rng.integers(-127, 128, (slots, kv, d, ctx), dtype=np.int8)
    v = rng.integers(-127, 128, (slots, kv, d, ctx), dtype=np.int8)
    k_scale = (rng.random((slots, kv, ctx)) * 0.02).astype(np.float32)
    v_scale = rng.random((slots, kv, ctx)).astype(np.float32)
    where = np.array([100, 101, -1, 102, 250, -1, -1], np.int32)
    rows = np.array([1, 1, 1, 1, 0, 0, 1], np.int32)
    q = (rng.standard_normal((len(where), kv, group, d)) / 4).astype(np.float32)
    got = kernel.int8_attend(q, k, v, k_scale, v_scale, rows, where)
    for b in np.flatnonzero(where >= 0):
        alone = kernel.int8_attend(q[b:b + 1], k, v, k_scale, v_scale, rows[b:b + 1], where[b:b + 1])
        np.testing.assert_array_equal(got[b], alone[0], err_msg=f"row {b}")
    assert got[where >= 0].any(axis=(1, 2, 3)).all() and not got[where < 0].any()
    assert not kernel.int8_attend(q[:2], k, v, k_scale, v_scale, rows[:2], np.full(2, -1, np.int32)).any()


def _row_dot_definition(x, w):
    """native.row_dot's sums in numpy float32: each output's products rounded one by one, added in
    16 partial sums (partial j takes inputs j, j + 16, ...), then 8 + 8, 4 + 4, 2 + 2, 1 + 1."""
    k = x.shape[1]
    pad = -k % 16
    x = np.pad(x, [(0, 0), (0, pad)]).reshape(x.shape[0], 1, -1, 16)
    w = np.pad(w, [(0, 0), (0, pad)]).reshape(1, w.shape[0], -1, 16)
    products = x * w                                            # [R, N, K/16, 16] float32
    part = np.zeros(products.shape[:2] + (16,), np.float32)
    for step in range(products.shape[2]):
        part = part + products[:, :, step]
    for width in (8, 4, 2, 1):
        part = part[..., :width] + part[..., width:2 * width]
    return part[..., 0]


@pytest.mark.parametrize("rows, k, n", [(1, 2048, 128), (5, 40, 7), (70, 100, 66), (3, 16, 1)])
def test_row_dot_sums_in_its_one_order_for_any_rows_beside_it(kernel, rows, k, n):
    """Guards the float products a MoE router's scores take (products.row_exact_matmul): the bits of
    the one summation order on every tier, whatever the row count (blocks of 4 or 2 rows and
    outputs, their tails, a K tail shorter than 16), and each row alone the same as in the batch."""
    rng = np.random.default_rng(rows * k + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = kernel.row_dot(x, w)
    np.testing.assert_array_equal(got, _row_dot_definition(x, w))
    np.testing.assert_array_equal(kernel.row_dot(x[-1:], w), got[-1:])


def _delta_definition(q, k, v, decay, beta, state):
    """native.delta_steps in numpy float32, token after token (each operation rounded once, as numpy's
    elementwise ones are): engine/model.py's _delta_step, its key sums padded to a power of two and
    halved."""
    def key_sum(x):                                             # [H, dk, dv] -> [H, dv]
        size = 1 << max(x.shape[1] - 1, 0).bit_length()
        x = np.pad(x, [(0, 0), (0, size - x.shape[1]), (0, 0)])
        while x.shape[1] > 1:
            x = x[:, :x.shape[1] // 2] + x[:, x.shape[1] // 2:]
        return x[:, 0]

    state = state.copy()
    out, written = np.zeros_like(v), np.zeros_like(v)
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            decayed = state[b] * decay[b, t][:, None, None]
            predicted = key_sum(k[b, t][:, :, None] * decayed)
            written[b, t] = (v[b, t] - predicted) * beta[b, t][:, None]
            state[b] = decayed + k[b, t][:, :, None] * written[b, t][:, None, :]
            out[b, t] = key_sum(q[b, t][:, :, None] * state[b])
    return out, state, written


def _delta_tokens(rng, rows, tokens, heads, dk, dv):
    """Random q, k [rows, tokens, heads, dk] (L2-normalized, q scaled by 1/sqrt(dk), as the layer
    makes them), v [..., dv], decay in [0.5, 1) and beta in [0, 1) [rows, tokens, heads], float32."""
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)  # noqa: E731
    q = unit(rng.standard_normal((rows, tokens, heads, dk))) / np.float32(np.sqrt(dk))
    k = unit(rng.standard_normal((rows, tokens, heads, dk)))
    v = rng.standard_normal((rows, tokens, heads, dv)).astype(np.float32)
    decay = rng.uniform(0.5, 1.0, (rows, tokens, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (rows, tokens, heads)).astype(np.float32)
    return q, k, v, decay, beta


@pytest.mark.parametrize("rows, tokens, heads, dk, dv", [(2, 5, 3, 128, 128), (2, 1, 3, 128, 128), (1, 1, 2, 24, 40),
                                                         (3, 4, 1, 16, 16)])
def test_delta_steps_are_the_decode_steps_bits(kernel, rows, tokens, heads, dk, dv):
    """Guards the Gated DeltaNet recurrence a prefill chunk and a verification run in the kernel
    (model._delta_steps): its outputs, final state and what each token wrote are the numpy
    definition's bits on every tier (whole and tail column blocks, a key width padded to a power of
    two; a few tokens on the state where it is, more in contiguous blocks), and on the tier XLA
    calls, the bits of XLA's own steps, which a decode step runs."""
    rng = np.random.default_rng(rows * 100 + dk)
    q, k, v, decay, beta = _delta_tokens(rng, rows, tokens, heads, dk, dv)
    state = rng.standard_normal((rows, heads, dk, dv)).astype(np.float32)
    got = kernel.delta_steps(q, k, v, decay, beta, state)
    for name, a, b in zip(("out", "state", "written"), got, _delta_definition(q, k, v, decay, beta, state)):
        np.testing.assert_array_equal(a, b, err_msg=name)
    if isinstance(kernel, XlaTier):
        steps = jax.jit(lambda *a: model._delta_steps(*a, native_kernel=False))    # zero: a run-time 0
        for name, a, b in zip(("out", "state", "written"), got, steps(q, k, v, decay, beta, state, np.int32(0))):
            np.testing.assert_array_equal(a, np.asarray(b), err_msg=name)


@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_delta_steps_in_place_update_each_rows_slot_and_no_other(kernel, tokens):
    """Guards the decode step's and prefill chunk's recurrence (model._linear_attention), which
    reads and writes each row's state in its slot of the layer's pool: a row continuing from its
    slot and a row starting at position 0 (from zero) get delta_steps's outputs and states in their
    slots; an idle row (no tokens) whose slot is another row's changes nothing and gets zeros; the
    other slots keep their bits. A decode step's and a few tokens' state is read where it is, a
    chunk's through contiguous blocks."""
    rng = np.random.default_rng(11)
    rows, heads, dk, dv, slots_n = 3, 2, 32, 48, 4
    q, k, v, decay, beta = _delta_tokens(rng, rows, tokens, heads, dk, dv)
    pool = rng.standard_normal((slots_n, heads, dk, dv)).astype(np.float32)
    slots, starts, lengths = (np.array(a, np.int32) for a in ([2, 0, 2], [7, 0, 9], [3, 3, 0]))
    out, written, after = kernel.delta_steps_in_place(q, k, v, decay, beta, pool.copy(), slots, starts, lengths)
    begin = np.stack([pool[2], np.zeros_like(pool[0]), pool[2]])
    want_out, want_state, want_written = _delta_definition(q, k, v, decay, beta, begin)
    for b in (0, 1):
        np.testing.assert_array_equal(out[b], want_out[b], err_msg=f"row {b}")
        np.testing.assert_array_equal(written[b], want_written[b], err_msg=f"row {b}")
    assert not out[2].any() and not written[2].any()
    np.testing.assert_array_equal(after[2], want_state[0])
    np.testing.assert_array_equal(after[0], want_state[1])
    np.testing.assert_array_equal(after[[1, 3]], pool[[1, 3]])

