"""A checkpoint's tensors (engine.checkpoint) -> the weights pytree engine.model reads. Names,
dtypes and layout; no math.

The pytree (all jax arrays in the compute dtype):
    {"embed":   [vocab, hidden]                    token embedding table (a row gather)
     "lm_head": [vocab, hidden]                    the same array as "embed" when tied
     "norm":    [hidden]                           final RMSNorm
     "layers":  [ per layer, a dict:
        "attn_norm": [hidden], "mlp_norm": [hidden],
        "qkv":  [q + 2 kv, hidden]                 q, k, v projections stacked (one matmul),
                                                   grouped by KV head: each KV head's query heads'
                                                   rows, then its key's, then its value's
                [2 q + 2 kv, hidden]               "gated_attention": each query head's rows are
                                                   followed by its output gate's (Qwen3-Next)
        "qkv_bias": [q + 2 kv]                     Qwen2 only (grouped the same way)
        "q_norm", "k_norm": [head_dim]             Qwen3 only
        "k_smooth": [kv, head_dim]                 float32, what an int8 KV cache divides keys by
                                                   (key_smoothing)
        "o":    [hidden, q]
        "gate_up": [2 * intermediate, hidden]      gate and up interleaved (one matmul)  dense layers
        "down": [hidden, intermediate]
        "moe": {                                                                          moe layers
            "router":  [experts, hidden]
            "gate_up": [experts, 2 * moe_intermediate, hidden]   every expert's gate and up
            "down":    [experts, hidden, moe_intermediate],
            "shared": {"gate_up": [2 * shared, hidden], "down": [hidden, shared],
                       "gate": [1, hidden]} }                          Qwen3-Next's shared expert
        "linear": {                                          "linear" layers (Gated DeltaNet) instead
            "in":      [2 kd + 2 vd + 2 vh, hidden]   q, k, v, z (output gate), b (beta), a (decay)
                                                      projections, grouped by key head: each key
                                                      head's q, k rows, then its value heads' v,
                                                      z, b, a rows (group_by_key_head)
            "conv":    [2 kd + vd, kernel]            depthwise causal conv over the q, k, v
                                                      channels, grouped by key head the same way
            "A_log", "dt_bias": [vh]                  decay g = -exp(A_log) * softplus(a + dt_bias)
            "norm":    [value_dim]                    gated RMSNorm (a plain scale, never 1 + w)
            "out":     [hidden, vd] } ]}              (kd, vd: all key / value heads' widths)
Stacked projections keep what one device of a tensor-parallel mesh needs together (engine.sharding
splits their rows into N equal blocks): "qkv" grouped by KV head keeps each head's query, key and
value rows in one block, and every "gate_up" (dense, routed and shared experts) interleaves gate and
up row by row (gate_0, up_0, gate_1, up_1, ...), so a block holds the gate and up of the same
channels; a Gated DeltaNet layer's "in" and "conv" are grouped by key head, each key head with the
value heads it serves, so a block is whole key heads with their value heads (the checkpoints' conv
runs over all heads' q, then all k, then all v: its rows are reordered here, as the projections').
With more devices than KV heads (kv_heads > the checkpoint's), each KV head is repeated so
that every device holds the key and value its query heads read. The layout is the same on one device.
Zero-centred norms (Qwen3-Next's layer, final and q/k norms: scale = 1 + w) are stored as 1 + w,
computed once here in float32, so the model multiplies by an ordinary scale.
Matrices are stored [out, in], as the checkpoints hold them: each output is a dot product with one
contiguous row, the layout in which XLA:CPU reads the weights fastest for a few decode rows (see
engine.products.matmul), and a tied LM head is the embedding table itself, with no copy. Layers stay
a Python list (not one stacked array): the forward loops over them in Python, which XLA:CPU runs
2-4x faster than lax.scan. Experts are the opposite: Hugging Face saves one tensor per expert, and
they are stacked here, once, into [experts, ...] arrays, so the forward picks experts by index.

Weights dtype "int8" (weight-only): every dense layer matrix (qkv, o, gate_up, down) and the
embedding table / LM head become {"q": [out, in], "scale": float32 [out]} with w ~ q * scale, q
int8 values (held as uint8 plus 128 where the CPU's kernels want that: INT8_OFFSET), one scale per
output channel (per vocabulary row of the embedding, which is the tied head's output
channel, so one int8 table serves both). So do the routed experts, each expert's matrices with
their own scales, the parts stacked along a first axis ({"q": [experts, ...], "scale": [experts,
out]}). Each tensor is quantized as it is read, so no second full float32 copy is ever resident.
So do a Gated DeltaNet layer's "in" and "out" projections. Norms, biases, MoE routers, shared experts
and the DeltaNet's conv and decay stay in the float dtype (float32 on CPU, bfloat16 on accelerators):
engine.products.matmul computes with either form.
Where the int8 matrices are packed for engine.native's kernel, a layer matrix made only of a GGUF's
Q5_0 tensors (the demo's gate_up and o, and qkv where v is Q5_0 too) keeps the file's own blocks
instead, read without floats (engine.checkpoint: q5_0) and held at 5.5 bits (engine.native.pack5):
int8 per channel would round the file's values a second time, in more bytes. So does a matrix made
only of Q4_K, only of Q5_K or only of Q6_K tensors (the blocks of Q4_K_M / Q5_K_M / Q6_K files;
engine.native.pack_k, at 4.6, 5.6 and 6.6 bits), and a separate LM head or the embedding table of
one of them (engine.products.embed reads a table's rows from the blocks); and a matrix
made only of Q8_0 tensors, the embedding table and head included (engine.native.pack8, 8.5 bits:
the file's values, with half the int8 form's products for a few rows; engine.products.embed reads
a table's rows from them); and one made only of IQ4_NL, IQ4_XS, IQ3_S or Q3_K tensors
(engine.native.pack_s). A matrix whose parts are of different types (Q4_K_M's q and k Q4_K with v
Q6_K; a Gated DeltaNet "in" of Q6_K, Q4_K and float parts) is held per part (PER_PART): each run of
parts of one type in its own form, floats rounded to int8 per channel, engine.products.matmul
joining their outputs. Other block types are rounded to int8 per channel; the log says how many of
each.

Weights dtype "fp8" (an official FP8 checkpoint, on accelerators by default): every dense layer
matrix the checkpoint stores as float8 becomes {"f8": float8_e4m3fn [out, in], "f8_scale": float32
[out, in / block columns]}, the file's own values and each row's block scales (engine.checkpoint:
fp8), so that w = f8 * f8_scale per block of columns: 1 byte per weight, and 1/32 more for the
scales of 128-column blocks; so are the MoE experts' and the shared expert's (each part of the
routed experts stacked along a first axis), and a Gated DeltaNet layer's projections where every
part of one is float8. What the checkpoint keeps in bfloat16 (embedding, LM head, norms, routers) is
in the float dtype.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time

import ml_dtypes
import numpy as np

from engine import cpu, native
from engine.memory import HUGE_MIN_BYTES, HugePageArena, release_free_heap
from engine.checkpoint import FP8, MTP_TENSOR, Checkpoint, WeightsError
from engine.config import MIXER_KINDS, ModelConfig

# Weights dtypes the loader builds; "auto" is chosen per platform (engine.model.weights_dtype_for).
# "fp8" holds an FP8 checkpoint's float8 matrices as they are (the rest in the float dtype).
WEIGHTS_DTYPES = ("float32", "bfloat16", "int8", "fp8")
# How weights dtype fp8 holds an FP8 checkpoint's matrices (its own float8 values).
FLOAT8 = np.dtype(ml_dtypes.float8_e4m3fn)
# int8 values span -INT8_MAX..INT8_MAX (symmetric: -128 is never used, so q * scale is sign-exact).
INT8_MAX = 127
# Where the CPU has unsigned x signed int8 kernels (engine.cpu.has_uint8_dot) they are held plus
# INT8_OFFSET as uint8 (offset binary), the operand those kernels take unsigned: the weights then
# stream as the first operand (engine.products.offset_weights_product). Elsewhere they are held as int8.
INT8_OFFSET = 128
OFFSET_INT8 = cpu.has_uint8_dot()        # read at load time (tests load both forms)


# Checkpoint tensors weights dtype int8 holds as int8, besides the embedding / LM head: layers'
# attention and MLP projections, Gated DeltaNet's input and output projections (and the routed
# experts: int8_held_tensor). Shared experts, routers and the rest of linear-attention layers stay float.
_INT8_TENSOR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                          r"|linear_attn\.(in_proj_(qkvz|qkv|z|b|a|ba)|out_proj))\.weight")


def quantized_tensor(name: str) -> bool:
    """Whether weights dtype int8 holds this checkpoint tensor as int8 (the others stay float)."""
    return name in ("model.embed_tokens.weight", "lm_head.weight") or bool(_INT8_TENSOR.fullmatch(name))


# An FP8 checkpoint's MLP matrices beyond the dense layers' (routed experts, the shared expert),
# which weights dtype fp8 holds in float8 too.
_FP8_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj\.weight")


# Routed experts' matrices, as a Hugging Face checkpoint (one expert each) or a GGUF (stacked) names
# them: weights dtype int8 holds them as int8 too, each expert's rows with their own scales.
_EXPERT_TENSOR = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+\.(gate|up|down)_proj\.weight"
                            r"|gate_up_proj|down_proj)")


def int8_held_tensor(name: str) -> bool:
    """Whether weights dtype int8 holds this checkpoint tensor as int8: the quantized tensors and the
    routed experts (norms, biases, routers, shared experts and Gated DeltaNet matrices stay float)."""
    return quantized_tensor(name) or bool(_EXPERT_TENSOR.fullmatch(name))


def fp8_held_tensor(name: str) -> bool:
    """Whether weights dtype fp8 holds this checkpoint tensor as float8, where the file has it so (the
    rest, MoE routers and Gated DeltaNet matrices among them, is widened to the float dtype)."""
    return quantized_tensor(name) or bool(_FP8_EXPERT.fullmatch(name))


# GGUF block types the native kernel holds as the file has them (engine.native: pack5, pack8, pack_k,
# pack_s), in the order the log names them.
HELD_BLOCKS = ("Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "Q3_K")
# The key of a matrix held per part: {PER_PART: {"0": part, "1": ...}, "rows": int32 [out], "cols":
# int32 [in]}, each part a run of rows in its own form, "rows" (where combine reorders them) where each
# output is in the parts' joined outputs, "cols" (where the file reorders the inputs) where each of the
# parts' inputs is in the matrix's (engine.products.matmul multiplies it so).
PER_PART = "parts"

# quantize_int8 rounds this many float32 bytes of rows at a time: its temporaries (the magnitudes,
# the quotients) then cost a few slices, not several copies of a 0.9 GB embedding table.
QUANTIZE_CHUNK_BYTES = 32 << 20
# put_rows reads a vocabulary-sized matrix this many rows at a time (a multiple of the kernel's 16
# outputs per block, so that each slice packs on its own): 8192 rows of a 1536-wide table are 50 MB
# of float32.
PUT_ROWS = 8192


def quantize_int8(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (int8 [out, in], float32 scales [out]) with array ~ q * scale[:, None]:
    each row's largest magnitude maps to INT8_MAX (an all-zero row gets scale 1)."""
    q = np.empty(array.shape, np.int8)
    scale = np.empty(array.shape[0], np.float32)
    step = max(1, QUANTIZE_CHUNK_BYTES // (4 * max(1, array.shape[-1])))
    for start in range(0, array.shape[0], step):
        a = np.asarray(array[start:start + step], dtype=np.float32)
        amax = np.max(np.abs(a), axis=-1)
        rows = scale[start:start + step] = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
        q[start:start + step] = np.clip(np.rint(a / rows[:, None]), -INT8_MAX, INT8_MAX)
    return q, scale


def offset_int8(values: np.ndarray) -> np.ndarray:
    """int8 values -> plus INT8_OFFSET, as uint8 (the sign bit flipped: the same bytes)."""
    return np.asarray(values, np.int8).view(np.uint8) ^ np.uint8(INT8_OFFSET)


def held_int8_dtype() -> np.dtype:
    """How int8 weights are held for XLA's products on this machine (OFFSET_INT8); packed for the
    native kernel they are always offset (packs_int8)."""
    return np.dtype(np.uint8 if OFFSET_INT8 else np.int8)


def key_smoothing(k_rows, k_bias, attn_norm, k_norm, head_dim: int) -> np.ndarray:
    """Per KV head and channel, the factor c an int8 cache divides keys by before rounding them (and
    multiplies queries by: scores stay exact), [kv_heads, head_dim] float32 from the layer's weights:
    k_rows [kv_heads * head_dim, hidden] float (the key projection as laid out), k_bias
    [kv_heads * head_dim] or None, attn_norm [hidden], k_norm [head_dim] or None (Qwen3).
    A few key channels of Qwen2 models run 10-100x larger than the rest (their bias), and one int8
    scale per key left the others a few levels: mean KL 0.018 nats from a float32 cache on the demo
    (92% greedy agreement), against 0.00004 for int8 values. c is the square root of a channel's
    expected size (bias plus weight row norm times the input norm's scale; Qwen3's key norm scale),
    the larger of the two channels RoPE turns into each other (a rotated key spreads a channel over
    its pair): KL 0.0011 (c the size itself, not its root: 0.0035)."""
    k_rows = np.asarray(k_rows, np.float32)
    if k_norm is not None:
        size = np.broadcast_to(np.abs(np.asarray(k_norm, np.float32)), (k_rows.shape[0] // head_dim, head_dim))
    else:
        size = np.linalg.norm(k_rows * np.asarray(attn_norm, np.float32), axis=-1).reshape(-1, head_dim)
        if k_bias is not None:
            size = size + np.abs(np.asarray(k_bias, np.float32)).reshape(-1, head_dim)
    half = head_dim // 2
    pair = np.maximum(size[:, :half], size[:, half:])
    c = np.sqrt(np.maximum(np.concatenate([pair, pair], axis=-1), 1e-6))
    return c.astype(np.float32)


# Where a multimodal checkpoint keeps its language model's tensors.
LANGUAGE_MODEL = "model.language_model."
# What such a checkpoint holds beside it and the loader never reads (unread_notes says so, once).
UNREAD_PARTS = {"model.visual.": "vision tower: {} tensors, not loaded (image parts are refused with 400)",
                "mtp.": "mtp: {} tensors, not used"}


class _Reader:
    """Reads named tensors of a checkpoint (engine.checkpoint: safetensors or a GGUF), checking
    shapes against the config."""

    def __init__(self, folder: str):
        self.checkpoint = Checkpoint(folder)
        # Multimodal checkpoints (Qwen3.5) keep the language model under model.language_model.;
        # its tensors are read by their text-only names, the rest (vision) is never read.
        self.names = {"model." + name[len(LANGUAGE_MODEL):]: name for name in self.checkpoint.shapes
                      if name.startswith(LANGUAGE_MODEL)}

    def has(self, name: str) -> bool:
        return self.checkpoint.has(self.names.get(name, name))

    def format(self, name: str) -> str | None:
        """How the tensor is stored ("derived" where computed from others: no blocks of its own)."""
        stored = self.names.get(name, name)
        return "derived" if self.checkpoint.derived(stored) else self.checkpoint.formats.get(stored)

    def q5_0(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        self.check_shape(name, shape)
        return self.checkpoint.q5_0(self.names.get(name, name))

    def q8_0(self, name: str, shape: tuple[int, ...], rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        self.check_shape(name, shape)
        return self.checkpoint.q8_0(self.names.get(name, name), rows)

    def q8_0_lowest(self, name: str) -> int:
        return self.checkpoint.q8_0_lowest(self.names.get(name, name))

    def k_quant(self, name: str, shape: tuple[int, ...], rows: slice | None = None) -> dict:
        self.check_shape(name, shape)
        return self.checkpoint.k_quant(self.names.get(name, name), rows)

    def s_quant(self, name: str, shape: tuple[int, ...], rows: slice | None = None) -> dict:
        self.check_shape(name, shape)
        return self.checkpoint.s_quant(self.names.get(name, name), rows)

    def column_order(self, name: str) -> np.ndarray | None:
        return self.checkpoint.column_order(self.names.get(name, name))

    def fp8(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        self.check_shape(name, shape)
        return self.checkpoint.fp8(self.names.get(name, name))

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """Raise WeightsError unless the checkpoint holds the tensor in this shape."""
        stored = self.names.get(name, name)
        if not self.checkpoint.has(stored):
            raise WeightsError(f"tensor {name} is missing from the checkpoint")
        stored_shape = self.checkpoint.shapes[stored]
        if stored_shape != shape:
            raise WeightsError(f"tensor {name} has shape {stored_shape}, config expects {shape}")

    def get(self, name: str, shape: tuple[int, ...], rows: slice | None = None) -> np.ndarray:
        self.check_shape(name, shape)
        return self.checkpoint.get(self.names.get(name, name), rows)


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [..., f, in] -> [..., 2 f, in], rows gate_0, up_0, gate_1, up_1, ... (the docstring)."""
    *lead, f, width = gate.shape
    return np.stack([gate, up], axis=-2).reshape(*lead, 2 * f, width)


def group_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv: int, kv_heads: int) -> np.ndarray:
    """Query rows [heads * width, ...] and key/value rows [kv * head_dim, ...] -> rows grouped by KV
    head (the docstring). kv_heads, a multiple of kv, is how many KV heads to lay out: each of the kv
    heads is repeated kv_heads / kv times, its query heads split among the copies in order."""
    rest = q.shape[1:]
    repeat = kv_heads // kv
    k = np.repeat(k.reshape(kv, -1, *rest), repeat, axis=0)
    v = np.repeat(v.reshape(kv, -1, *rest), repeat, axis=0)
    return np.concatenate([q.reshape(kv_heads, -1, *rest), k, v], axis=1).reshape(-1, *rest)


def group_by_key_head(parts: list[np.ndarray], key_heads: int) -> np.ndarray:
    """Rows of a Gated DeltaNet layer's projections (or conv channels) [heads' rows, ...], each part
    over all heads in head order -> one array grouped by key head: key head 0's rows of every part
    in turn (its q, its k, the v of the value heads it serves, ...), then key head 1's, ..."""
    rest = parts[0].shape[1:]
    return np.concatenate([p.reshape(key_heads, -1, *rest) for p in parts], axis=1).reshape(-1, *rest)


def place_on_default_device(path: str, tree):
    """Every numpy leaf of a subtree as a jax array on the default device (no mesh)."""
    import jax
    return jax.tree_util.tree_map(on_device, tree)


_huge_pages = HugePageArena()


def on_device(array: np.ndarray):
    """A weight as a jax array on the default device. On a CPU a large one is copied into huge pages
    (engine.memory.HugePageArena) and XLA reads it there; elsewhere, small ones, and dtypes DLPack
    cannot name (bfloat16, float8), jax copies it."""
    import jax
    if jax.default_backend() != "cpu" or array.nbytes < HUGE_MIN_BYTES or array.dtype.kind not in "iuf":
        return jax.numpy.asarray(array)
    return jax.dlpack.from_dlpack(_huge_pages.copy(np.asarray(array)))


def load_weights(folder: str, cfg: ModelConfig, dtype, float_dtype=None, *, kv_heads: int | None = None,
                 place=place_on_default_device, held_cache: str | None = None,
                 pack: bool = True) -> dict:
    """Load a Qwen2/Qwen3/Qwen3-MoE/Qwen3-Next checkpoint (Hugging Face safetensors, or a GGUF beside
    config.json: engine.checkpoint) as the pytree above, in `dtype` (a jnp dtype, or "int8":
    weight-only int8 matrices, the rest in float_dtype, float32 unless given). kv_heads: KV heads to
    lay out (a multiple of the config's; None: the config's).
    place(path, subtree of numpy arrays) puts each part on the device(s) as soon as it is read
    (engine.sharding: straight into each device's shard), so the host holds one layer at a time.
    held_cache: a folder for int8 weights as they are held (HeldWeights): read from there when it
    holds them, else quantized from the checkpoint and written there for the next start.
    pack: int8 matrices in engine.native's packed layout where its kernel is available (False: never;
    the worker passes ModelConfig.native, the one decision whether the kernel serves)."""
    int8 = str(dtype) == "int8"
    narrow = int8 or str(dtype) == "fp8"          # some matrices narrow, the rest in float_dtype
    pack = packs_int8(dtype, pack)
    writer = None
    if held_cache and int8:
        held = HeldWeights(held_cache)
        parts = held.read(place)
        if parts is not None:
            return _assemble(parts, cfg)
        place = writer = held.writer(place)
    kv_heads = kv_heads or cfg.num_kv_heads
    if kv_heads % cfg.num_kv_heads:
        raise WeightsError(f"kv_heads {kv_heads} is not a multiple of the config's {cfg.num_kv_heads}")
    load = _Loader(_Reader(folder), cfg, np.dtype(float_dtype or np.float32) if narrow else np.dtype(dtype),
                   int8=int8, fp8=str(dtype) == "fp8", pack=pack, kv_heads=kv_heads)
    # The vocabulary-sized ends first: a table's slices, the whole and its device copy (twice the
    # table, 2.5 GB for a 27B's int8 one) then meet while little else is held, not on top of the layers.
    parts = {"embed": place("embed", load.embedding())}
    if not cfg.tie_word_embeddings:
        parts["lm_head"] = place("lm_head", load.lm_head())
    parts["norm"] = place("norm", load.norm("model.norm.weight", cfg.hidden_size))
    for i, (kind, mlp) in enumerate(zip(cfg.layer_kinds, cfg.mlp_kinds or ("dense",) * cfg.num_layers)):
        parts[f"layers.{i}"] = place(f"layers.{i}", load.layer(i, kind, mlp))
        # Each layer's temporaries handed back to the kernel as they go: kept by the heap until the end,
        # they stood on the held weights through the compiles that follow (a 27B's peak).
        release_free_heap()
    if writer is not None:
        writer.finish()
    return _assemble(parts, cfg)


def load_mtp(folder: str, cfg: ModelConfig, dtype, float_dtype=None, *, kv_heads: int | None = None,
             place=place_on_default_device, pack: bool = True) -> dict | None:
    """A checkpoint's MTP module (_Loader.mtp) held as load_weights holds the trunk's layers (int8
    matrices quantized at every start: they are not among the held weights), placed as "mtp"; None
    where the checkpoint has none."""
    reader = _Reader(folder)
    if not reader.has(MTP_TENSOR):
        return None
    int8, narrow = str(dtype) == "int8", str(dtype) in ("int8", "fp8")
    load = _Loader(reader, cfg, np.dtype(float_dtype or np.float32) if narrow else np.dtype(dtype), int8=int8,
                   fp8=str(dtype) == "fp8", pack=packs_int8(dtype, pack), kv_heads=kv_heads or cfg.num_kv_heads)
    return place("mtp", load.mtp())


class _Loader:
    """load_weights' steps: each reads its tensors from the checkpoint by their Hugging Face names and
    returns them as held (the pytree's layout, the module docstring), one layer at a time."""

    def __init__(self, reader: _Reader, cfg: ModelConfig, dtype: np.dtype, *, int8: bool, pack: bool,
                 kv_heads: int, fp8: bool = False):
        self.r, self.cfg, self.dtype = reader, cfg, dtype      # dtype: of everything not int8 or fp8
        self.int8, self.fp8, self.pack, self.kv_heads = int8, fp8, pack, kv_heads
        self.offset = pack or held_int8_dtype() == np.uint8   # packed weights are the kernel's: offset

    # ---- one layer ----

    def layer(self, i: int, kind: str, mlp: str, p: str | None = None) -> dict:
        """Layer i (or the one whose tensors are under the prefix p) as held."""
        cfg, h = self.cfg, self.cfg.hidden_size
        if kind not in MIXER_KINDS or mlp not in ("dense", "moe"):
            raise WeightsError(f"layer {i} kind {kind!r} / {mlp!r} has no weight layout")
        p = p or f"model.layers.{i}."
        layer = {"attn_norm": self.norm(p + "input_layernorm.weight", h),
                 "mlp_norm": self.norm(p + "post_attention_layernorm.weight", h)}
        if kind == "linear":
            layer["linear"] = self.delta_net(p + "linear_attn.")
        else:
            layer.update(self.attention(p + "self_attn.", kind, layer["attn_norm"]))
        if mlp == "moe":
            layer["moe"] = self.experts(p + "mlp.")
            if cfg.shared_expert_intermediate_size:
                layer["moe"]["shared"] = self.shared_expert(p + "mlp.")
        else:
            layer.update(self.mlp(p + "mlp."))
        return layer

    def mtp(self) -> dict:
        """The MTP module (mtp.*, engine.model.draft): fc over the normed embedding and hidden state
        side by side, the two norms, one decoder layer laid out as the trunk's are (its full attention,
        gated where the trunk's is; its MLP as the trunk's last layer's), and its final norm."""
        cfg, h = self.cfg, self.cfg.hidden_size
        kind = next(k for k in cfg.layer_kinds if k != "linear")
        mlp = (cfg.mlp_kinds or ("dense",))[-1]
        return {"fc": self.projection(lambda w: w, [("mtp.fc.weight", (h, 2 * h))]),
                "embed_norm": self.norm("mtp.pre_fc_norm_embedding.weight", h),
                "hidden_norm": self.norm("mtp.pre_fc_norm_hidden.weight", h),
                "layer": self.layer(cfg.num_layers, kind, mlp, p="mtp.layers.0."),
                "norm": self.norm("mtp.norm.weight", h)}

    def mlp(self, p: str) -> dict:
        """A dense layer's MLP: gate and up interleaved (interleave_gate_up), and down."""
        h, f = self.cfg.hidden_size, self.cfg.intermediate_size
        return {"gate_up": self.projection(interleave_gate_up, [(p + "gate_proj.weight", (f, h)),
                                                                (p + "up_proj.weight", (f, h))]),
                "down": self.projection(lambda d: d, [(p + "down_proj.weight", (h, f))])}

    def attention(self, attn: str, kind: str, attn_norm: np.ndarray) -> dict:
        """Full (or gated) attention: qkv grouped by KV head, o, the biases and q/k norms the config
        has, and the keys' smoothing scales (key_smoothing)."""
        cfg, h, q, kv, kv_heads = self.cfg, self.cfg.hidden_size, self.cfg.q_size, self.cfg.kv_size, self.kv_heads
        # Gated attention's q_proj holds each head's query rows then its gate rows.
        wide = 2 * q if kind == "gated_attention" else q
        rows = self.qkv(attn, wide, lambda n, rows: self.matrix(n + ".weight", rows, h))
        bias = self.qkv(attn, wide, lambda n, rows: self.r.get(n + ".bias", (rows,))) if cfg.qkv_bias else None
        out = {"qkv": self.projection(lambda *qkv: group_qkv(*qkv, cfg.num_kv_heads, kv_heads),
                                      [(attn + "q_proj.weight", (wide, h)), (attn + "k_proj.weight", (kv, h)),
                                       (attn + "v_proj.weight", (kv, h))], floats=rows),
               "o": self.projection(lambda o: o, [(attn + "o_proj.weight", (h, q))])}
        if bias is not None:
            out["qkv_bias"] = self.put(bias)
        if cfg.qk_norm:
            out["q_norm"] = self.norm(attn + "q_norm.weight", cfg.head_dim)
            out["k_norm"] = self.norm(attn + "k_norm.weight", cfg.head_dim)

        def keys(x):                      # the key rows of each KV head's group (group_qkv)
            first, rest = wide // kv_heads, x.shape[1:]
            return x.reshape(kv_heads, -1, *rest)[:, first:first + cfg.head_dim].reshape(-1, *rest)

        out["k_smooth"] = key_smoothing(keys(rows), None if bias is None else keys(bias), attn_norm,
                                        out.get("k_norm"), cfg.head_dim)
        return out

    def qkv(self, p: str, wide: int, rows_of):
        """The layer's q, k, v rows grouped by KV head (see group_qkv); rows_of(name, rows) reads
        one projection's weight or bias."""
        kv = self.cfg.kv_size
        return group_qkv(rows_of(p + "q_proj", wide), rows_of(p + "k_proj", kv),
                         rows_of(p + "v_proj", kv), self.cfg.num_kv_heads, self.kv_heads)

    def delta_net(self, p: str) -> dict:
        """Gated DeltaNet weights grouped by key head (group_by_key_head). Qwen3.5 stores all
        heads' q, then k, v in in_proj_qkv, and z, b, a in three more projections; Qwen3-Next
        interleaves in_proj_qkvz and in_proj_ba per key head ([q, k, v, z] of each key head's
        group, then the next). Both store the conv over all heads' q, then k, then v."""
        cfg, r, h = self.cfg, self.r, self.cfg.hidden_size
        kh, vh, dk, dv = (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
                          cfg.linear_value_dim)
        per = vh // kh
        kd, vd = kh * dk, vh * dv
        if r.has(p + "in_proj_qkv.weight"):
            parts = [(p + "in_proj_qkv.weight", (2 * kd + vd, h)), (p + "in_proj_z.weight", (vd, h)),
                     (p + "in_proj_b.weight", (vh, h)), (p + "in_proj_a.weight", (vh, h))]

            def combine(qkv, z, b, a):
                return group_by_key_head(np.split(qkv, [kd, 2 * kd]) + [z, b, a], kh)
        else:
            parts = [(p + "in_proj_qkvz.weight", (2 * kd + 2 * vd, h)), (p + "in_proj_ba.weight", (2 * vh, h))]

            def combine(qkvz, ba):
                rest = qkvz.shape[1:]
                qkvz = np.split(qkvz.reshape(kh, -1, *rest), np.cumsum([dk, dk, per * dv]), axis=1)
                ba = np.split(ba.reshape(kh, 2 * per, *rest), [per], axis=1)
                return group_by_key_head([part.reshape(-1, *rest) for part in qkvz + ba], kh)
        conv = r.get(p + "conv1d.weight", (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel))[:, 0]
        # The projections as the other layers' (projection): narrow where the weights dtype is.
        return {"in": self.projection(combine, parts),
                "conv": self.put(group_by_key_head(np.split(conv, [kd, 2 * kd]), kh)),
                "A_log": r.get(p + "A_log", (vh,)).astype(np.float32),
                "dt_bias": r.get(p + "dt_bias", (vh,)).astype(np.float32),
                "norm": r.get(p + "norm.weight", (dv,)).astype(np.float32),
                "out": self.projection(lambda o: o, [(p + "out_proj.weight", (h, vd))])}

    def experts(self, p: str) -> dict:
        """A layer's router and experts, each expert's tensors stacked along a new first axis.
        Checkpoints written by newer transformers may hold them stacked already (gate_up_proj,
        gate rows then up rows)."""
        r, h = self.r, self.cfg.hidden_size
        e, m = self.cfg.num_experts, self.cfg.moe_intermediate_size
        if r.has(p + "experts.gate_up_proj"):
            stacked = r.get(p + "experts.gate_up_proj", (e, 2 * m, h))
            both = interleave_gate_up(stacked[:, :m], stacked[:, m:])
            down = r.get(p + "experts.down_proj", (e, h, m))
        elif self.fp8 and r.format(f"{p}experts.0.gate_proj.weight") == FP8:
            # float8 experts, as the dense matrices (projection): their values and block scales stacked
            both = _stacked([self.fp8_gate_up(f"{p}experts.{j}.", m) for j in range(e)])
            down = _stacked([self.projection(lambda d: d, [(f"{p}experts.{j}.down_proj.weight", (h, m))])
                             for j in range(e)])
            return {"router": self.put(self.matrix(p + "gate.weight", e, h)), "gate_up": both, "down": down}
        else:
            both = np.stack([self.gate_up(f"{p}experts.{j}.", m) for j in range(e)])
            down = np.stack([self.matrix(f"{p}experts.{j}.down_proj.weight", h, m) for j in range(e)])
        return {"router": self.put(self.matrix(p + "gate.weight", e, h)), "gate_up": self.put_experts(both),
                "down": self.put_experts(down)}

    def put_experts(self, stacked: np.ndarray):
        """Experts' matrices [experts, out, in] in the weights dtype: int8 each expert as put_matrix
        holds a matrix (packed where the kernel serves), the parts stacked along the first axis."""
        if not self.int8:
            return self.put(stacked)
        return _part_by_part(np.stack, [self.put_matrix(matrix) for matrix in stacked])

    def fp8_gate_up(self, p: str, width: int):
        """An expert's gate and up interleaved (gate_up), float8 where the weights dtype is fp8 and the
        checkpoint has them so (projection), else in the float dtype."""
        h = self.cfg.hidden_size
        if not self.fp8:
            return self.put(self.gate_up(p, width))
        return self.projection(interleave_gate_up, [(p + "gate_proj.weight", (width, h)),
                                                    (p + "up_proj.weight", (width, h))])

    def shared_expert(self, p: str) -> dict:
        s, h = self.cfg.shared_expert_intermediate_size, self.cfg.hidden_size
        down = p + "shared_expert.down_proj.weight"
        return {"gate_up": self.fp8_gate_up(p + "shared_expert.", s),
                "down": (self.projection(lambda d: d, [(down, (h, s))]) if self.fp8
                         else self.put(self.matrix(down, h, s))),
                "gate": self.put(self.matrix(p + "shared_expert_gate.weight", 1, h))}

    # ---- the model's ends ----

    def embedding(self):
        # K-quant blocks kept (engine.products.embed reads their rows): the file's values, in fewer
        # bytes than int8 per row.
        return self.put_rows("model.embed_tokens.weight", (self.cfg.vocab_size, self.cfg.hidden_size),
                             blocks=self.r.format("model.embed_tokens.weight") in native.K_SUB)

    def lm_head(self):
        return self.put_rows("lm_head.weight", (self.cfg.vocab_size, self.cfg.hidden_size), blocks=True)

    # ---- tensors as held ----

    def norm(self, name: str, size: int) -> np.ndarray:
        """An RMSNorm scale; a zero-centred one becomes 1 + w, in float32 (the norm's own dtype)."""
        w = self.r.get(name, (size,))
        if self.cfg.zero_centred_norms:
            return 1.0 + w.astype(np.float32)
        return self.put(w)

    def matrix(self, name: str, out_dim: int, in_dim: int) -> np.ndarray:
        return self.r.get(name, (out_dim, in_dim))          # nn.Linear's own [out, in]

    def gate_up(self, p: str, width: int) -> np.ndarray:
        h = self.cfg.hidden_size
        return interleave_gate_up(self.matrix(p + "gate_proj.weight", width, h),
                                  self.matrix(p + "up_proj.weight", width, h))

    def projection(self, combine, parts: list[tuple[str, tuple[int, int]]], floats=None):
        """A layer's matrix combine(*tensors) of the named tensors [(name, shape)] (combine is a row
        operation: stacking, interleaving), as held: as float8 with each row's block scales (the module
        docstring) when every part is an FP8 checkpoint's and the weights dtype is fp8; where the int8
        matrices are packed and a part is a GGUF's blocks of a form the kernel holds, in those blocks
        (in_blocks); else put_matrix of the floats. floats: the combined matrix, when the caller has
        read it already."""
        if self.fp8 and all(self.r.format(name) == FP8 for name, _ in parts):
            stored = [self.r.fp8(name, shape) for name, shape in parts]
            return {"f8": np.ascontiguousarray(combine(*(v for v, _ in stored))),
                    "f8_scale": np.ascontiguousarray(combine(*(sc for _, sc in stored)))}
        held = self.in_blocks(combine, parts) if self.pack else None
        if held is not None:
            return held
        if floats is None:
            floats = combine(*(self.matrix(name, *shape) for name, shape in parts))
        return self.put_matrix(floats)

    def in_blocks(self, combine, parts: list[tuple[str, tuple[int, int]]]):
        """projection's matrix in the file's own blocks (None where no part has blocks the kernel holds,
        or they do not fit its shape). Parts of one block type are joined and held as one (blocks_of);
        a matrix whose parts differ is held per part (PER_PART): each run of parts of one type in
        its own form (parts stored as floats, or whose blocks do not fit, rounded to int8 per channel as
        put_matrix holds them), their outputs joined and put in combine's order by "rows". Where the
        file holds the inputs in another order than Hugging Face (a qwen35 file's DeltaNet out_proj:
        engine.checkpoint), the blocks stay so and "cols" gathers the input to match."""
        kinds = [self.r.format(name) if self.r.format(name) in HELD_BLOCKS else None for name, _ in parts]
        orders = [self.r.column_order(name) for name, _ in parts]
        if not any(kinds) or any(o is not None and not np.array_equal(o, orders[0]) for o in orders):
            return None
        cols = None if orders[0] is None else np.argsort(orders[0]).astype(np.int32)
        runs: dict[str | None, list[int]] = {}
        for i, kind in enumerate(kinds):
            runs.setdefault(kind, []).append(i)
        if len(runs) == 1:
            held = self.blocks_of(kinds[0], combine, parts)
            return held if held is None or cols is None else {PER_PART: {"0": held}, "cols": cols}
        held, at, where = {}, 0, [None] * len(parts)
        for run, (kind, members) in enumerate(runs.items()):
            run_parts = [parts[i] for i in members]
            one = self.blocks_of(kind, lambda *a: np.concatenate(a), run_parts) if kind else None
            if one is None:
                floats = np.concatenate([self.matrix(name, *shape) for name, shape in run_parts])
                one = self.put_matrix(floats if cols is None else floats[:, cols])
            held[str(run)] = one
            for i in members:
                where[i] = np.arange(at, at + parts[i][1][0])[:, None]
                at += parts[i][1][0]
        out = {PER_PART: held}
        rows = combine(*where)[:, 0]
        if not np.array_equal(rows, np.arange(len(rows))):
            out["rows"] = rows.astype(np.int32)
        if cols is not None:
            out["cols"] = cols
        return out

    def blocks_of(self, kind: str, combine, parts: list[tuple[str, tuple[int, int]]]):
        """combine(*parts), every part a GGUF's `kind` blocks, in the kernel's form of that kind (the
        file's own levels and scales, exact): engine.native.pack5 (Q5_0), pack8 (Q8_0), pack_k (Q4_K,
        Q5_K, Q6_K), pack_s (IQ4_NL, IQ4_XS, IQ3_S, Q3_K); None where the joined shape does not fit it."""
        shape = (combine(*(np.empty((s[0], 1), np.int8) for _, s in parts)).shape[0], parts[0][1][1])
        if kind == "Q5_0" and native.packable5(shape):
            blocks = [self.r.q5_0(name, s) for name, s in parts]
            return native.pack5(combine(*(b[0] for b in blocks)), combine(*(b[1] for b in blocks)))
        if kind == "Q8_0" and native.packable8(shape, min(self.r.q8_0_lowest(name) for name, _ in parts)):
            blocks = [self.r.q8_0(name, s) for name, s in parts]
            return native.pack8(combine(*(b[0] for b in blocks)), combine(*(b[1] for b in blocks)))
        join = lambda arrays: combine(*arrays)  # noqa: E731
        if kind in native.K_SUB and native.packable_k(shape):
            return native.pack_k(kind, **_part_by_part(join, [self.r.k_quant(name, s) for name, s in parts]))
        if kind in native.S_SPAN and native.packable_s(kind, shape):
            return native.pack_s(kind, **_part_by_part(join, [self.r.s_quant(name, s) for name, s in parts]))
        return None

    def put_rows(self, name: str, shape: tuple[int, int], blocks: bool = False):
        """A vocabulary-sized matrix (the embedding table, a separate LM head) as projection holds
        it (blocks: K-quant and scaled-level ones kept too; Q8_0 ones always, engine.products.embed reads their
        rows), read, narrowed and packed PUT_ROWS rows at a time, so that no float32 copy of the
        whole (0.9 GB for a 1.5B model's table) is ever resident."""
        kind = self.r.format(name)
        if not self.int8 or (blocks and kind == "Q5_0"):
            return self.projection(lambda w: w, [(name, shape)])
        keep = blocks and self.pack and kind in native.K_SUB and native.packable_k(shape)
        keep_s = blocks and self.pack and kind in native.S_SPAN and native.packable_s(kind, shape)
        keep8 = self.pack and kind == "Q8_0" and native.packable8(shape, self.r.q8_0_lowest(name))
        packed = native.packable(shape)                    # decided for the whole, not per slice
        parts = []
        for start in range(0, shape[0], PUT_ROWS):
            rows = slice(start, start + PUT_ROWS)
            if keep:
                parts.append(native.pack_k(kind, **self.r.k_quant(name, shape, rows)))
            elif keep_s:
                parts.append(native.pack_s(kind, **self.r.s_quant(name, shape, rows)))
            elif keep8:
                parts.append(native.pack8(*self.r.q8_0(name, shape, rows)))
            else:
                parts.append(self.put_matrix(self.r.get(name, shape, rows), packed))
        return _part_by_part(np.concatenate, parts)

    def put(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array.astype(self.dtype, copy=False))

    def put_matrix(self, array: np.ndarray, packable: bool | None = None):
        """A dense [out, in] matrix in the weights dtype (int8: quantized now, see the docstring);
        packable: whether the matrix it is a slice of packs (default: whether this one does)."""
        if not self.int8:
            return self.put(array)
        values, scale = quantize_int8(array)
        q = offset_int8(values) if self.offset else values
        packable = native.packable(q.shape) if packable is None else packable
        return {"q": native.pack(q) if self.pack and packable else q, "scale": scale}


def _stacked(matrices: list) -> dict:
    """Experts' float8 matrices ({"f8", "f8_scale"} each) -> one, each part stacked along a new first
    axis (expert parallelism splits it)."""
    if not all(isinstance(m, dict) and "f8" in m for m in matrices):
        raise WeightsError("an FP8 checkpoint's experts must all be float8 with block scales")
    return _part_by_part(np.stack, matrices)


def _part_by_part(join, held: list):
    """join (stack, concatenate, a row operation) of matrices as held: plain arrays, or each part of
    a held form ({"q", "scale"}, K-quant or float8 parts) joined with its own kind."""
    if not isinstance(held[0], dict):
        return join(held)
    return {part: join([h[part] for h in held]) for part in held[0]}


def _assemble(parts: dict, cfg: ModelConfig) -> dict:
    """The weights pytree from its placed parts ("layers.I", "embed", "lm_head" unless tied, "norm")."""
    return {
        "embed": parts["embed"],
        "lm_head": parts["embed"] if cfg.tie_word_embeddings else parts["lm_head"],
        "norm": parts["norm"],
        "layers": [parts[f"layers.{i}"] for i in range(cfg.num_layers)],
    }


# ---- int8 weights kept as they are held -------------------------------------------------------------

# Quantizing the demo at load costs about 10 s of a start (reading 2.5 GB of float32 and rounding it);
# a restarted worker must not pay it again. So int8 weights are written once, as they are held, one
# .npy file per array with a manifest of the tree, under the cache root (engine.worker names the
# folder after everything the arrays depend on), and later starts map them in as they are.
HELD_FORMAT = "held-weights-10"      # bumped when the layout of what is written changes (10: K-quant embedding)
HELD_KEEP = 2                        # held copies kept under one cache folder (the newest used)
HELD_TMP_STALE_S = 600               # an unfinished copy this old was left by a worker that died
_MANIFEST = "manifest.json"


def packs_int8(dtype, allowed: bool = True) -> bool:
    """Whether load_weights holds the int8 matrices in engine.native's packed layout (offset: the
    kernel's operand, whatever XLA's products would take): weights dtype int8, the kernel available,
    and `allowed` (False where the weights are split over several devices: the kernel is not)."""
    return allowed and str(dtype) == "int8" and native.available()


def held_key(component_set_sha: str, dtype: str, float_dtype: str, kv_heads: int, packed: bool) -> str:
    """The folder name of one held copy: the checkpoint's files, the dtypes (int8's as held here),
    the KV heads laid out, whether the matrices are packed (load_weights) and HELD_FORMAT (the
    layout code's version)."""
    h = hashlib.sha256(json.dumps([HELD_FORMAT, component_set_sha, dtype, held_int8_dtype().name,
                                   float_dtype, kv_heads] + (["packed"] if packed else [])).encode())
    return "int8-" + h.hexdigest()[:20]


class HeldWeights:
    """One held copy of a model's weights: a folder of .npy arrays and a manifest of the tree."""

    def __init__(self, folder: str):
        self.folder = folder

    def read(self, place) -> dict | None:
        """Every part placed as load_weights would, or None when the copy is absent or unreadable
        (then the weights are quantized again and the copy rewritten)."""
        try:
            with open(os.path.join(self.folder, _MANIFEST), encoding="utf-8") as f:
                manifest = json.load(f)
            if manifest.get("format") != HELD_FORMAT:
                return None
            parts = {path: place(path, self._load(tree)) for path, tree in manifest["parts"]}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        os.utime(self.folder)                   # the newest used is kept longest (HELD_KEEP)
        return parts

    def _load(self, tree):
        if isinstance(tree, dict):
            return {key: self._load(sub) for key, sub in tree.items()}
        return np.load(os.path.join(self.folder, tree), mmap_mode="r")

    def writer(self, place):
        """A place function that also writes each part into a temporary folder; its finish() makes
        the copy visible at once (a rename), so a reader never sees half a copy."""
        tmp = f"{self.folder}.tmp-{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        written = []

        def dump(path: str, tree):
            if isinstance(tree, dict):
                return {key: dump(f"{path}.{key}", sub) for key, sub in tree.items()}
            name = path + ".npy"
            np.save(os.path.join(tmp, name), np.asarray(tree))
            return name

        def write_then_place(path: str, tree):
            written.append((path, dump(path, tree)))
            return place(path, tree)

        def finish():
            with open(os.path.join(tmp, _MANIFEST), "w", encoding="utf-8") as f:
                json.dump({"format": HELD_FORMAT, "parts": written}, f)
            try:
                os.rename(tmp, self.folder)
            except OSError:                     # another worker wrote it first: theirs is the same
                shutil.rmtree(tmp, ignore_errors=True)
            self._evict()

        write_then_place.finish = finish
        return write_then_place

    def _evict(self):
        """Keep the HELD_KEEP newest used copies beside this one; an unfinished folder of a worker
        that died is removed with them."""
        root = os.path.dirname(self.folder)
        try:
            entries = sorted((e for e in os.scandir(root) if e.is_dir()), key=lambda e: e.stat().st_mtime,
                             reverse=True)
        except OSError:
            return
        done = [e for e in entries if ".tmp-" not in e.name]
        stale = done[HELD_KEEP:] + [e for e in entries if ".tmp-" in e.name
                                   and time.time() - e.stat().st_mtime > HELD_TMP_STALE_S]
        for e in stale:
            shutil.rmtree(e.path, ignore_errors=True)


def held_note(checkpoint, params, dtype: str) -> str | None:
    """For the log, what a GGUF's blocks became: which block types its matrices have, how many layer
    matrices (or parts of one) are held in them as the file has them, how many per part, and that the
    rest were rounded again to int8 per channel (or widened to a float dtype, exactly); what an FP8
    checkpoint's float8 matrices became;
    random weights drawn as blocks likewise. None for other checkpoints."""
    blocks = checkpoint.kind == "gguf" or (checkpoint.kind == "random" and any(
        kind in native.K_SUB or kind == "Q8_0" for kind in checkpoint.formats.values()))
    if not blocks:
        fp8 = sum(1 for kind in checkpoint.formats.values() if kind == FP8)
        if not fp8:
            return None
        if dtype == "fp8":
            import jax
            kept = sum(1 for leaf in jax.tree_util.tree_leaves(params) if leaf.dtype == FLOAT8)
            widened = sum(1 for name, kind in checkpoint.formats.items() if kind == FP8 and not fp8_held_tensor(name))
            held = f"held as they are (float8, in {kept} layer matrices)" + (
                f", {widened} others (linear attention) widened to the float dtype" if widened else "")
        else:
            held = {"int8": "rounded again to int8 per channel",
                    "float32": "held as float32 (their values exactly)"}.get(dtype, f"rounded to {dtype}")
        return f"{checkpoint.file}: {fp8} matrices {FP8} with block scales, {held}"
    import jax
    kinds: dict[str, int] = {}
    for name, kind in checkpoint.formats.items():
        if int8_held_tensor(name):
            kinds[kind] = kinds.get(kind, 0) + 1
    blocks = ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items()))
    if dtype != "int8":
        return f"{checkpoint.file}: matrices {blocks}, held as {dtype} (their values exactly)"
    kept, mixed = {kind: 0 for kind in HELD_BLOCKS}, 0
    is_held = lambda leaf: _block_kind(leaf) is not None or (isinstance(leaf, dict) and PER_PART in leaf)  # noqa: E731
    for leaf in {id(x): x for x in jax.tree_util.tree_leaves(params, is_leaf=is_held)}.values():
        if isinstance(leaf, dict) and PER_PART in leaf:
            mixed += 1
        for part in leaf[PER_PART].values() if isinstance(leaf, dict) and PER_PART in leaf else [leaf]:
            if _block_kind(part) is not None:
                kept[_block_kind(part)] += 1
    held = ", ".join(f"{n} {kind}" for kind, n in kept.items() if n) or "none"
    matrices = "matrix" if mixed == 1 else "matrices"
    per_part = f" ({mixed} {matrices} of mixed types held per part, each part in its own form)" if mixed else ""
    return (f"{checkpoint.file}: matrices {blocks}; held in the file's own blocks (where a matrix's parts have "
            f"one of {', '.join(HELD_BLOCKS)} and the native kernel serves): {held}{per_part}; the rest "
            f"rounded again to int8 per channel")


def _block_kind(leaf) -> str | None:
    """The GGUF block type a held matrix keeps (HELD_BLOCKS), or None."""
    if native.is_int5(leaf):
        return "Q5_0"
    if native.is_q8(leaf):
        return "Q8_0"
    return native.k_kind(leaf) or native.s_kind(leaf)


def unread_notes(checkpoint, loaded: tuple[str, ...] = ()) -> list[str]:
    """For the log: the parts of a multimodal checkpoint left unread (UNREAD_PARTS) it holds, but for
    those `loaded` (an MTP module drafting: load_mtp)."""
    counts = {part: sum(1 for name in checkpoint.shapes if name.startswith(part))
              for part in UNREAD_PARTS if part not in loaded}
    return [UNREAD_PARTS[part].format(n) for part, n in counts.items() if n]


def weights_bytes(params) -> int:
    """Bytes the weights occupy on the device (for the model facts); a tied head counts once."""
    import jax

    unique = {id(x): x for x in jax.tree_util.tree_leaves(params)}
    return sum(x.nbytes for x in unique.values())
