"""How much memory a worker needs, how much the machine has, and the defaults that fit. No jax: the
server sizes the worker before it starts one.

    worker bytes = weights + slots x ctx x KV bytes per token + host cache (--cache-ram) + runtime
    weights      = float32: 4 B per parameter
                   int8:    1 B per parameter of the int8 tensors (engine.weights.int8_held_tensor:
                            projections, routed experts, embedding / head) + 4 B per output
                            channel (its scale) + 4 B per parameter of the rest (norms, biases,
                            routers, shared experts, Gated DeltaNet matrices)
                   fp8:     1 B per parameter of an FP8 checkpoint's float8 projections and
                            experts + 4 B per row and block of columns (their scales) + the
                            rest in the float dtype
                   each:   + 4 B per key channel of each attention layer (its key smoothing)
                   (where the kernel has a tier, a GGUF's layer matrices and head, and random
                   weights in a block form, are counted at their blocks' bytes as held:
                   BLOCK_HELD_BYTES, 0.45 B per weight for Q3_K to 1.06 for Q8_0, each part of a
                   matrix of mixed types by its own; without a tier, at int8's, with a Q8_0
                   matrix's 2 B scale per 32 weights in place of the row's scale)
    KV bytes     = per attention layer, KV head, key and value: head_dim x 2 B (float16), or
                   head_dim x 1 B + a 4 B scale (int8; engine.cpu.auto_kv_dtype picks)

On a CPU every term lives in host memory. On an accelerator the weights and the KV cache live in
device memory, and only the host cache and the runtime count here.

A request for more than the machine has is refused at start-up with these numbers, instead of a
worker the kernel kills later. When slots, ctx or --cache-ram are not given, the model's defaults
(models.json) are the most that is used, and they shrink to fit DEFAULT_MEMORY_SHARE of what is
available: first the host cache, then the context (not below MIN_DEFAULT_CTX), then the slots.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from engine import cpu
from engine.checkpoint import FP8, MTP_PREFIX, MTP_TENSOR, Q8_0_BLOCK, Checkpoint
from engine.config import ModelConfig
from engine.scheduler import SLOT_SNAPSHOTS, VERIFY_MAX_ROWS, verify_tokens

# Bytes per key or value element of each KV cache dtype (engine.attention.kv_dtype_for); an int8 cache adds
# a float32 scale per position, KV head and key or value (engine.cache).
KV_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
KV_SCALE_BYTES = {"int8": 4}
# Bytes per element of a linear layer's conv and recurrent state (float32 on every platform).
STATE_ELEMENT_BYTES = 4
# Bytes per float weight as the engine holds them on CPU: float32 (engine.model.dtype_for).
CPU_WEIGHT_BYTES = 4
# Bytes per weight of each weights dtype (engine.weights.WEIGHTS_DTYPES); int8 adds a float32 scale
# per output channel (held_weight_bytes).
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1, "fp8": 1}
SCALE_BYTES = 4
Q8_0_SCALE_BYTES = 2                  # a GGUF Q8_0 block's float16 scale (per Q8_0_BLOCK weights)
# What the worker holds besides weights, KV cache and host cache: the interpreter, jax and XLA, the
# compiled programs, the tokenizer, sampler state and a decode step's temporaries. Measured: a
# worker serving the tiny test model held 0.55 GiB resident; rounded up.
RUNTIME_BYTES = 768 << 20
# Without explicit settings, a worker takes at most this share of the memory available at start:
# the rest stays with the desktop, a browser, and the compile that a first start runs.
DEFAULT_MEMORY_SHARE = 0.5
# Defaults never shrink the context below this: coding agents send 12-16k-token prompts.
MIN_DEFAULT_CTX = 16384
GIB = 1 << 30


class DoesNotFit(ValueError):
    """The requested slots, context and host cache need more memory than the machine has."""


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str | None = None) -> int:
    """KV cache bytes of one position of one slot: a key and a value per attention layer and KV
    head, in kv_dtype (None: what a worker on this CPU holds, engine.cpu.auto_kv_dtype), with their
    scales (a hybrid model's linear layers keep a state per slot instead: slot_state_bytes)."""
    kv_dtype = kv_dtype or cpu.auto_kv_dtype()
    attention = sum(1 for kind in cfg.layer_kinds if kind != "linear")
    per_head = cfg.head_dim * KV_ELEMENT_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0)
    return attention * 2 * cfg.num_kv_heads * per_head


def slot_state_bytes(cfg: ModelConfig) -> int:
    """A hybrid model's linear layers' state of one slot (conv and recurrent state, float32, as
    engine.cache holds them); one snapshot of it is as big. 0 for a model without linear layers."""
    linear = sum(1 for kind in cfg.layer_kinds if kind == "linear")
    if not linear:
        return 0
    per_layer = cfg.linear_conv_dim * (cfg.linear_conv_kernel - 1) + \
        cfg.linear_value_heads * cfg.linear_key_dim * cfg.linear_value_dim
    return linear * per_layer * STATE_ELEMENT_BYTES


def verify_step_bytes(cfg: ModelConfig) -> int:
    """What a verification of drafts keeps of one position of one row for its linear layers until
    each row's kept position is chosen (engine.cache.keep_steps): the conv's input and, per value
    head, the position's key, decay and what it wrote, float32; 0 for a model without linear layers.
    Replaying those is exact (engine.model.delta_replay), so the per-position states (a slot's whole
    state each: slot_state_bytes) are never held."""
    linear = sum(1 for kind in cfg.layer_kinds if kind == "linear")
    per_head = cfg.linear_key_dim + 1 + cfg.linear_value_dim
    return linear * (cfg.linear_conv_dim + cfg.linear_value_heads * per_head) * STATE_ELEMENT_BYTES if linear else 0


def drafting_bytes(cfg: ModelConfig, source, slots: int, speculative: str, weights_dtype: str) -> tuple[int, int, int]:
    """What drafting (engine.speculative) may hold besides the slot pool, where --speculative lets it
    run: (its MTP layer's weights, its KV cache per position of a slot, the largest verification's
    linear-layer steps: verify_step_bytes), each 0 where it does not apply. Drafting runs only on
    int8 weights (a GGUF's blocks among them) under the native kernel (the worker decides at start,
    engine.worker: Engine._speculator): the plan counts it there unless --speculative off."""
    if speculative == "off" or weights_dtype != "int8":
        return 0, 0, 0
    states = min(slots, VERIFY_MAX_ROWS) * max(verify_tokens(cfg)) * verify_step_bytes(cfg)
    checkpoint = _checkpoint(source)
    if speculative not in ("auto", "mtp") or not checkpoint.has(MTP_TENSOR):
        return 0, 0, states
    per_weight = WEIGHT_BYTES.get(weights_dtype, 1)
    weights = sum(_count(shape) for key, shape in checkpoint.shapes.items() if key.startswith(MTP_PREFIX))
    one_layer = kv_bytes_per_token(cfg) // max(1, sum(1 for kind in cfg.layer_kinds if kind != "linear"))
    return weights * per_weight, one_layer, states


# Where a multimodal checkpoint keeps its text model's tensors (engine.weights.LANGUAGE_MODEL), and
# what else it holds that the worker never loads (its vision tower).
_LANGUAGE_MODEL, _UNLOADED = "model.language_model.", ("model.visual.",)


def _checkpoint(source) -> Checkpoint:
    return source if isinstance(source, Checkpoint) else Checkpoint(source)


def _model_tensors(source):
    """(name, shape, stored format) of the text model's tensors (model.*, lm_head.*, by their text-only
    names) in a weights folder or a Checkpoint, read from the files' headers (engine.checkpoint; no
    tensor is loaded)."""
    checkpoint = _checkpoint(source)
    for key, shape in sorted(checkpoint.shapes.items()):
        if key.startswith(("model.", "lm_head.")) and not key.startswith(_UNLOADED):
            name = "model." + key[len(_LANGUAGE_MODEL):] if key.startswith(_LANGUAGE_MODEL) else key
            yield name, shape, checkpoint.formats.get(key)


def _count(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def parameter_count(source) -> int:
    """Weights of the model's tensors (a weights folder or a Checkpoint), from the files' headers."""
    return sum(_count(shape) for _, shape, _ in _model_tensors(source))


def held_weight_bytes(source, weights_dtype: str, float_bytes: int = CPU_WEIGHT_BYTES) -> int:
    """Bytes the worker holds the weights in (the formula in the module docstring) of a weights folder
    or a Checkpoint; float_bytes is what the float tensors take beside int8 ones. A tied head is the
    embedding table: counted once."""
    from engine.weights import fp8_held_tensor, int8_held_tensor
    checkpoint = _checkpoint(source)
    tensors = list(_model_tensors(checkpoint))
    # Each attention layer adds its keys' smoothing factors (engine.weights.key_smoothing): float32,
    # one per key channel.
    total = sum(shape[0] * SCALE_BYTES for name, shape, _ in tensors if name.endswith("self_attn.k_proj.weight"))
    if weights_dtype == "fp8":           # the float8 matrices as stored, a scale per row and block of columns
        narrow = lambda name, shape, kind: kind == FP8 and fp8_held_tensor(name)  # noqa: E731
        scales = lambda name, shape, kind: _count(shape) // _fp8_columns(checkpoint, name) * SCALE_BYTES  # noqa: E731
    elif weights_dtype == "int8":            # a scale per output row (of each expert, where stacked)
        narrow = lambda name, shape, kind: int8_held_tensor(name) and len(shape) >= 2  # noqa: E731
        scales = lambda name, shape, kind: max(_count(shape[:-1]) * SCALE_BYTES, (  # noqa: E731
            _count(shape) // Q8_0_BLOCK * Q8_0_SCALE_BYTES if kind == "Q8_0" else 0))
    else:
        return total + sum(_count(shape) for _, shape, _ in tensors) * WEIGHT_BYTES[weights_dtype]
    blocks = weights_dtype == "int8" and _blocks_held(checkpoint)
    for name, shape, kind in tensors:
        if blocks and _kept_in_blocks(name, kind, shape):
            total += int(_count(shape) * BLOCK_HELD_BYTES[kind])
        elif narrow(name, shape, kind):
            total += _count(shape) * WEIGHT_BYTES[weights_dtype] + scales(name, shape, kind)
        else:
            total += _count(shape) * float_bytes
    return total


def _fp8_columns(checkpoint: Checkpoint, name: str) -> int:
    stored = name if name in checkpoint.shapes else _LANGUAGE_MODEL + name[len("model."):]
    return checkpoint.fp8_scale_columns(stored)


# What engine.native's kernel holds a weight of each GGUF block type in (pack5, pack8, pack_k, pack_s:
# the levels' bits or codes, and the scales, mins and d of its blocks), bytes per weight.
BLOCK_HELD_BYTES = {"Q5_0": 0.6875, "Q8_0": 1.0625, "Q4_K": 0.578125, "Q5_K": 0.703125, "Q6_K": 0.8203125,
                    "IQ4_NL": 0.5625, "IQ4_XS": 0.5390625, "IQ3_S": 0.5390625, "Q3_K": 0.4453125}
# Inputs per block of each (a matrix whose inputs they do not divide is rounded to int8 instead), and
# the outputs the kernel takes at a time.
BLOCK_INPUTS = {"Q5_0": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_NL": 32, "IQ4_XS": 256,
                "IQ3_S": 256, "Q3_K": 256}
BLOCK_OUTPUTS = 16


def _blocks_held(checkpoint: Checkpoint) -> bool:
    """Whether a checkpoint's block-stored matrices are counted in their blocks (BLOCK_HELD_BYTES): a
    GGUF's or random weights in a block form, where the kernel has a tier on this CPU (without it the
    worker rounds them to int8). A GGUF's matrix whose parts are of different types is held per part,
    each in its own form (engine.weights.PER_PART), so each tensor counts by its own type."""
    from engine import native
    return checkpoint.kind in ("gguf", "random") and native.tier() is not None


def _kept_in_blocks(name: str, kind: str | None, shape) -> bool:
    """Whether the loader keeps a block-stored tensor in its blocks (engine.weights.projection,
    put_rows): the layer projections and the head, where their shape fits the kernel's blocks; the
    embedding table in Q8_0 and the K-quants (its rows read from them); routed experts are read as
    floats and rounded to int8."""
    from engine import native
    from engine.weights import quantized_tensor
    if kind not in BLOCK_HELD_BYTES or not quantized_tensor(name):
        return False
    if len(shape) != 2 or shape[0] % BLOCK_OUTPUTS or shape[1] % BLOCK_INPUTS[kind]:
        return False
    return kind == "Q8_0" or kind in native.K_SUB or name != "model.embed_tokens.weight"


def engine_on_host() -> bool:
    """Whether jax will run on the CPU (weights and KV cache in host memory): JAX_PLATFORMS says so,
    or no accelerator plugin (CUDA, ROCm, TPU) is installed for jax to pick."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0] == "cpu"
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
    return not any(importlib.util.find_spec(p) for p in plugins)


def available_bytes() -> int | None:
    """Memory a new process can take now: the kernel's MemAvailable, lowered to what is left under
    this process's cgroup limit when it has one. None where neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if path is not None:
            base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                limit = f.read().strip()
            with open(os.path.join(base, "memory.current")) as f:
                current = int(f.read())
            if limit != "max":
                found.append(max(0, int(limit) - current))
    except (OSError, ValueError, StopIteration):
        pass
    return min(found) if found else None


def resident_bytes(pid: int | str = "self") -> int | None:
    """A process's resident set size (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Sizing:
    slots: int
    ctx: int
    cache_ram_mib: int
    weights: int                  # bytes counted in host memory (0 on an accelerator)
    kv_per_token: int             # bytes per position per slot (counted only on the CPU)
    available: int | None
    on_host: bool
    shrunk: bool = False          # defaults were lowered to fit
    state_per_slot: int = 0       # hybrid models: the linear layers' state of one slot
    verify_states: int = 0        # drafting: the largest verification's linear-layer steps (drafting_bytes)

    @property
    def kv(self) -> int:
        """The slot pool: K/V, and a hybrid model's per-slot state (counted only on the CPU)."""
        return self.slots * (self.ctx * self.kv_per_token + self.state_per_slot) if self.on_host else 0

    @property
    def snapshots(self) -> int:
        """Snapshots a hybrid model's slots keep in host memory until they are saved to the host
        cache (engine.scheduler.SLOT_SNAPSHOTS each), on every platform."""
        return self.slots * SLOT_SNAPSHOTS * self.state_per_slot

    @property
    def total(self) -> int:
        return (self.weights + self.kv + self.snapshots + self.verify_states + (self.cache_ram_mib << 20)
                + RUNTIME_BYTES)

    def describe(self) -> str:
        where = "host memory" if self.on_host else "host memory (weights and KV cache on the device)"
        have = f"{self.available / GIB:.1f} GiB available" if self.available is not None else \
            "available memory unknown"
        state = f" + {self.slots} x {self.state_per_slot} B linear state" if self.state_per_slot else ""
        kv = (f"KV cache {self.slots} slots x {self.ctx} tokens x {self.kv_per_token} B{state} = "
              f"{self.kv / GIB:.2f} GiB, " if self.on_host else "")
        if self.state_per_slot:
            kv += (f"slot snapshots {self.slots} x {SLOT_SNAPSHOTS} x {self.state_per_slot} B = "
                   f"{self.snapshots / GIB:.2f} GiB, ")
        if self.verify_states:
            kv += f"a verification's linear steps {self.verify_states / GIB:.3f} GiB, "
        return (f"{where}: weights {self.weights / GIB:.2f} GiB + {kv}host cache "
                f"{self.cache_ram_mib} MiB + runtime {RUNTIME_BYTES / GIB:.2f} GiB = "
                f"{self.total / GIB:.2f} GiB; {have}")


def size(cfg: ModelConfig, folder, *, slots: int | None, ctx: int | None, cache_ram_mib: int | None,
         default_slots: int, default_ctx: int, default_cache_ram_mib: int,
         available: int | None = None, on_host: bool | None = None,
         weights_dtype: str = "auto", speculative: str = "auto") -> Sizing:
    """Slots, ctx and --cache-ram for a worker: the given ones as they are, the others from the
    defaults, shrunk to fit (see the module docstring). Raises DoesNotFit, naming the numbers, when
    what was given (or the smallest defaults) needs more than is available. folder: a weights folder
    or a Checkpoint (engine.checkpoint.random_checkpoint: a form weighed before its folder is made).
    weights_dtype: as
    --weights-dtype ("auto": on a CPU engine.cpu.auto_weights_dtype, as the worker decides in
    engine.model.weights_dtype_for; on accelerators the weights are not in host memory).
    speculative: as --speculative (drafting's MTP layer and verification states: drafting_bytes)."""
    on_host = engine_on_host() if on_host is None else on_host
    available = available_bytes() if available is None else available
    held = cpu.auto_weights_dtype() if weights_dtype == "auto" else weights_dtype
    mtp_weights, mtp_kv, states = drafting_bytes(cfg, folder, slots or default_slots, speculative, held)
    weights = held_weight_bytes(folder, held) + mtp_weights if on_host else 0
    plan = Sizing(slots or default_slots, ctx or default_ctx,
                  default_cache_ram_mib if cache_ram_mib is None else cache_ram_mib,
                  weights, kv_bytes_per_token(cfg) + mtp_kv, available, on_host,
                  state_per_slot=slot_state_bytes(cfg), verify_states=states if on_host else 0)
    if available is None:
        return plan
    budget = int(available * DEFAULT_MEMORY_SHARE)
    if cache_ram_mib is None and plan.total > budget:
        spare = budget - (plan.total - (plan.cache_ram_mib << 20))
        plan.cache_ram_mib, plan.shrunk = max(0, min(plan.cache_ram_mib, spare >> 20)), True
    while ctx is None and plan.total > budget and plan.ctx // 2 >= MIN_DEFAULT_CTX:
        plan.ctx, plan.shrunk = plan.ctx // 2, True
    while slots is None and plan.total > budget and plan.slots > 1:
        plan.slots, plan.shrunk = plan.slots - 1, True
    if plan.total > available:
        raise DoesNotFit(f"not enough memory for this worker: {plan.describe()}. {_what_fits(plan, folder)}")
    return plan


# llama.cpp's Q4_K_M: Q4_K matrices, with Q6_K for the head and half the value and down projections,
# about 4.85 bits per weight in all (its quantize tool's table; Qwen3.8-27B's: ~16 GB).
Q4_K_M_BITS = 4.85


def _what_fits(plan: Sizing, folder) -> str:
    """What to do about a plan that does not fit: a smaller KV cache where the weights fit, else the
    model as a Q4_K_M GGUF, with its size."""
    if plan.weights + RUNTIME_BYTES + plan.slots * plan.state_per_slot < plan.available:
        return (f"Lower --slots, --ctx or --cache-ram (the KV cache costs "
                f"{plan.kv_per_token * plan.ctx / GIB:.2f} GiB per slot of {plan.ctx} tokens)")
    gguf = parameter_count(folder) * Q4_K_M_BITS / 8
    return (f"The weights alone need {plan.weights / GIB:.1f} GiB: serve a Q4_K_M GGUF of the model "
            f"instead (about {gguf / 1e9:.0f} GB: mashbox run FILE.gguf) or use a host with more memory")


# --weights random with --weights-dtype auto on a CPU: the widest form whose worker (at the model's
# defaults, lowered to fit) takes at most RANDOM_AUTO_SHARE of the memory available: the platform's
# auto (int8 per channel from a bfloat16 checkpoint), else a GGUF's blocks where engine.native's kernel
# holds them, Q8_0 down to Q4_K. The rest is for what the plan does not count: a first start converts
# one matrix at a time beside the weights, and XLA's compiles take their own memory.
RANDOM_AUTO_BLOCK_FORMS = ("q8_0", "q6_k", "q5_k", "q4_k")
RANDOM_AUTO_SHARE = 0.8


def random_weights_dtype(cfg: ModelConfig, plan, available: int | None = None) -> str:
    """--weights-dtype auto for random weights of cfg on this host (RANDOM_AUTO_SHARE's comment). plan:
    (checkpoint, weights dtype) -> Sizing (size's, with the server's settings); "auto" on an
    accelerator, where the worker picks."""
    from engine import native
    from engine.checkpoint import random_checkpoint
    from engine.registry import random_storage
    if not engine_on_host():
        return "auto"
    available = available_bytes() if available is None else available
    forms = (cpu.auto_weights_dtype(),) + (RANDOM_AUTO_BLOCK_FORMS if native.tier() else ())
    for form in forms:
        stored, held = random_storage(form)
        try:
            sizing = plan(random_checkpoint(cfg, 0, stored), held)
        except DoesNotFit:
            continue
        if available is None or sizing.total <= available * RANDOM_AUTO_SHARE:
            return form
    return forms[-1]


def release_free_heap() -> None:
    """Hand freed heap pages back to the kernel. glibc keeps what a process freed (in every thread's
    arena) for reuse, so a burst of large, short-lived objects (a worker's start-up tensors, a
    server's parse of a large body) would count in resident memory for the process's whole life.
    A no-op where the C library has no malloc_trim (not glibc)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# glibc's mallopt parameter for the number of heap arenas (M_ARENA_MAX in malloc.h).
_M_ARENA_MAX = -8


def limit_heap_arenas(arenas: int) -> None:
    """At most `arenas` glibc heaps for the process's threads (the default is 8 a core). Each thread
    that parses or tokenizes a large request otherwise frees into an arena of its own, where the
    pages stay: fewer arenas share and reuse them. Call before threads start; a no-op off glibc."""
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas)
    except (OSError, AttributeError):
        pass


# ---- a CPU device's weights in huge pages ---------------------------------------------------------
#
# A decode step streams every weight once, and a 4 KB page's translation is one more miss every 4 KB
# of that stream (the hardware prefetchers stop at each page's end): from 2 MB pages the native
# kernel's products read faster (docs/perf-log.md, "Weights in huge pages"). XLA's host
# allocator maps its buffers in 4 KB pages wherever transparent huge pages are only on request (the
# usual "madvise" setting), so a CPU device's large weights live here instead, asked for huge pages,
# and XLA reads them in place (engine.weights.on_device).

HUGE_PAGE = 2 << 20
# Bytes mapped at a time: arrays are laid end to end in it (each HUGE_ALIGN-aligned), so the only pages
# not used are those after the last array, which are never touched and so never resident.
HUGE_ARENA_BYTES = 1 << 30
# Arrays smaller than this stay in XLA's own heap: norms and scales are not streamed at any length.
HUGE_MIN_BYTES = 1 << 20
# Each array's start: XLA:CPU reads a buffer it did not allocate only at this alignment (else copies).
HUGE_ALIGN = 64


class HugePageArena:
    """Host memory asked for transparent huge pages, handed out as numpy arrays laid end to end.
    Each array keeps its mapping alive (numpy holds the buffer), so a mapping is returned to the
    system when the last array in it is freed and the arena has moved on to another; freed space is
    not reused (a worker's weights live as long as it does). Where the system has no transparent huge
    pages, or not on request, the memory is ordinary pages: nothing is lost but the gain."""

    def __init__(self, arena_bytes: int = HUGE_ARENA_BYTES):
        self.arena_bytes = arena_bytes
        self._map = None
        self._used = 0

    def copy(self, a: np.ndarray) -> np.ndarray:
        """a's values in a new array in this arena (its own mapping when a is larger than one)."""
        size = -(-a.nbytes // HUGE_ALIGN) * HUGE_ALIGN
        if self._map is None or self._used + size > len(self._map):
            self._new_map(size)
        out = np.frombuffer(self._map, np.uint8, count=a.nbytes, offset=self._used).view(a.dtype).reshape(a.shape)
        out[...] = a
        self._used += size
        return out

    def _new_map(self, size: int) -> None:
        import mmap
        length = max(self.arena_bytes, size + HUGE_PAGE)
        self._map = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):       # Linux; elsewhere ordinary pages
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:                      # huge pages off: ordinary pages
                pass
        start = np.frombuffer(self._map, np.uint8, count=1).ctypes.data
        self._used = -start % HUGE_PAGE          # the first array at a huge page's start
