"""A weights folder's tensors by their Hugging Face names, whichever files hold them.

    Checkpoint(folder)
        .shapes   {name: shape}     every tensor, [out, in] like Hugging Face, from the file headers
        .formats  {name: str}       how each is stored: "F32", "BF16", ... or a GGUF block type "Q8_0"
        .files    [path]            the weight files read (identity hashes them)
        .file     str               what the model facts name as loaded: the GGUF, else the folder
        .bits_per_weight  float     the files' bytes x 8 / the weights they hold
        .get(name) -> ndarray       one tensor, read now
        .q5_0(name) -> (levels, scales)   a GGUF's Q5_0 tensor as its blocks hold it (no floats)
        .k_quant(name) -> {levels, sc, d, [mins, dmin]}   a GGUF's Q4_K, Q5_K or Q6_K tensor, likewise
        .s_quant(name) -> {codes, d, [sc]}   a GGUF's IQ4_NL, IQ4_XS, IQ3_S or Q3_K tensor, likewise
        .column_order(name)         where the blocks readers' columns differ from get()'s (a qwen35 file)
        .fp8(name) -> (values, scales)    an FP8 weight as stored, its block scales per row

Four kinds of folder:
- Hugging Face safetensors (one file, or shards listed by model.safetensors.index.json): get() returns
  the tensor in its stored dtype.
- An official FP8 checkpoint (config.json's quantization_config, engine.config.fp8_block): safetensors
  whose projection weights are float8_e4m3fn ("F8_E4M3"), each with `<name>_scale_inv`, one float
  scale per block of rows x columns (128 x 128). get() returns such a weight in float32, each value
  times its block's scale (exact: an e4m3 value times a float32 scale rounds once), a block of rows at
  a time; the scales are consumed, not listed as tensors.
- One GGUF file beside config.json and the tokenizer files (the demo model, engine.registry). llama.cpp
  names are mapped to Hugging Face's and each tensor is dequantized to float32 by gguf's own block
  decoders (Q4_K, Q5_0, Q6_K, Q8_0, ...) when it is read, a slice of rows at a time: the weights
  loader narrows it at once (engine.weights), so the whole model is never held in float32. What
  llama.cpp's converter reshaped or reordered (qwen3next, qwen35, qwen35moe) is read back to Hugging
  Face's layout, and an MTP module it kept in a block past the trunk's is listed under mtp.*.
- Random weights (--weights random: RANDOM_MARKER beside config.json, no weight file): every tensor of
  the config's model drawn from a seed when it is read, stored as the marker's form says (bfloat16, FP8
  with block scales, or a GGUF's Q8_0 / K-quant blocks), read through the same methods (RandomSource).

This module must stay importable without jax and without gguf (the server process reads shapes for
its memory plan): gguf is imported when a GGUF folder is opened.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from typing import Iterator

import numpy as np

from engine.config import FP8_DEFAULT_BLOCK, ConfigError, fp8_block

INDEX_FILE = "model.safetensors.index.json"
# The tensor a checkpoint with an MTP module has (engine.model.draft), and the prefix of them all
# (a GGUF's nextn.* tensors are read under these names: MTP_NAMES).
MTP_TENSOR, MTP_PREFIX = "mtp.fc.weight", "mtp."
GGUF_SUFFIX = ".gguf"
# A GGUF tensor is dequantized this many float32 bytes at a time: the decoders' temporaries scale
# with the slice, so a 545 MB embedding table costs its float32 result, not several copies of it.
DEQUANT_CHUNK_BYTES = 64 << 20
Q5_0_BLOCK, Q5_0_BYTES = 32, 22         # GGUF's Q5_0: weights per block, bytes per block (q5_0)
Q8_0_BLOCK, Q8_0_BYTES = 32, 34         # GGUF's Q8_0: a float16 scale, then 32 int8 levels (q8_0)
K_BLOCK = 256                           # GGUF's K-quants: weights per super-block
K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}    # bytes per super-block (k_quant)
FP8, FP8_SCALE = "F8_E4M3", "_scale_inv"  # an FP8 checkpoint's weights, and their scales' suffix


class WeightsError(ValueError):
    """The checkpoint does not match its config or is missing: the message names the tensor or file."""


def k_quant_parts(kind: str, blocks: np.ndarray) -> dict:
    """K-quant super-blocks uint8 [rows, n, bytes] (K_BYTES) -> {levels uint8 [rows, 256 n], sc, d, and
    for Q4_K and Q5_K mins, dmin}, each per row (engine.native.pack_k's arguments):
      Q4_K (144 bytes): d, dmin float16; 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32 (the
        first four in bytes 0-3 and 4-7's low six bits, the last four from bytes 8-11's nibbles and
        the top two bits of bytes 0-7); 128 bytes of levels 0..15, 32 bytes per 64 inputs, low
        nibbles first. w = d sc q - dmin m.
      Q5_K (176 bytes): as Q4_K, with 32 bytes of fifth bits before the 128 of nibbles (bit j of byte
        i: input 32 j + i), levels 0..31.
      Q6_K (210 bytes): 128 bytes of the levels' low four bits (64 bytes per 128 inputs, low nibbles
        first), 64 bytes of their top two bits (32 per 128 inputs, the four pairs of a byte for
        inputs 32 apart), 16 int8 scales (one per 16 inputs), d float16. w = d sc (q - 32)."""
    rows, n, _ = blocks.shape
    if kind in ("Q4_K", "Q5_K"):
        d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
        dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        packed = blocks[..., 4:16]
        first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
        sc = np.concatenate([first & 63, (rest & 15) | ((first >> 6) << 4)], axis=-1)
        mins = np.concatenate([second & 63, (rest >> 4) | ((second >> 6) << 4)], axis=-1)
        qs = blocks[..., -128:].reshape(rows, n, 4, 1, 32)
        levels = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15).reshape(rows, n, 8, 32)
        if kind == "Q5_K":
            fifth = blocks[..., 16:48].reshape(rows, n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            levels = levels | ((fifth & 1) << 4)
        return {"levels": levels.reshape(rows, n * K_BLOCK), "sc": sc.reshape(rows, -1),
                "mins": mins.reshape(rows, -1), "d": d, "dmin": dmin}
    low = (blocks[..., :128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
    top = (blocks[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    levels = low.reshape(rows, n, 2, 4, 32) | (top << 4)                                # [rows, n, 2, 4, 32]
    return {"levels": levels.reshape(rows, n * K_BLOCK),
            "sc": np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1),
            "d": np.ascontiguousarray(blocks[..., 208:210]).view(np.float16)[..., 0]}


def _uint8(values) -> np.ndarray:
    return np.asarray(values, np.uint8)


def s_block_parts(kind: str, blocks: np.ndarray) -> dict:
    """A GGUF's scaled-level blocks uint8 [rows, n, engine.native.S_BYTES[kind]] -> {codes uint8 [rows,
    n span], d float16 [rows, n], and but for IQ4_NL sc int8 [rows, n span / sub]}, each per row
    (engine.native.pack_s's arguments); w = d sc S_LEVELS[kind][code]:
      IQ4_NL (18 bytes per 32 inputs): d; 16 bytes of codes, input i's in byte i's low nibble, input
        16 + i's in its high.
      IQ4_XS (136 bytes per 256): d; the 8 sub-blocks' 6-bit scales ls (sc = ls - 32), their top two
        bits in a little-endian uint16 (2 per sub-block), their low four in 4 bytes (low nibble
        first); 128 bytes of codes, 16 per 32 inputs as IQ4_NL's.
      IQ3_S (110 bytes per 256): d; 64 grid indices' low 8 bits and 8 bytes of their ninth (bit i of
        byte k: index 8k + i), each index 4 inputs' magnitudes in gguf's grid of 512 (odd 1..15);
        32 bytes of signs (bit i of byte k: input 8k + i negative); 4 bytes of 4-bit scales s, low
        nibble first (sc = 1 + 2 s). Each input's code is (its signed magnitude + 15) / 2.
      Q3_K (110 bytes per 256): 32 bytes of the levels' third bits (bit m of byte i: input 32 m + i),
        64 of their low two bits (bits 2c of byte 32 h + i: input 128 h + 32 c + i), 12 bytes of 16
        6-bit scales (sc = s - 32: the low four bits of scale j in byte j % 8, nibble j // 8; the top
        two in byte 8 + j % 4, bits 2 (j // 4)), d last. code = the level + 4.
    IQ3_S's grid is gguf's own (gguf.quants), imported here: these blocks come from a GGUF."""
    from engine.native import S_BYTES, S_SPAN
    if kind not in S_BYTES:
        raise ValueError(f"scaled-level blocks: no form for {kind!r} (one of {', '.join(S_BYTES)})")
    if blocks.ndim != 3 or blocks.shape[-1] != S_BYTES[kind]:
        raise ValueError(f"scaled-level blocks: {kind} blocks are [rows, n, {S_BYTES[kind]}] bytes, got "
                         f"{list(blocks.shape)}")
    rows, n, _ = blocks.shape
    at = 108 if kind == "Q3_K" else 0
    d = np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0]
    parts = {"d": d, **_S_PARSERS[kind](blocks, rows, n)}
    parts["codes"] = np.ascontiguousarray(parts["codes"].reshape(rows, n * S_SPAN[kind]).astype(np.uint8))
    if "sc" in parts:
        parts["sc"] = np.ascontiguousarray(parts["sc"].reshape(rows, -1).astype(np.int8))
    return parts


def _iq4_nl_parts(blocks, rows, n):
    qs = blocks[..., 2:18].reshape(rows, n, 1, 16)
    return {"codes": (qs >> _uint8([0, 4]).reshape(2, 1)) & 15}


def _iq4_xs_parts(blocks, rows, n):
    top = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")                      # [rows, n, 1]
    j = np.arange(8)
    ls = ((blocks[..., 4 + j // 2] >> _uint8(4 * (j % 2))) & 15) | (((top >> (2 * j).astype(np.uint16)) & 3) << 4)
    qs = blocks[..., 8:136].reshape(rows, n, 8, 1, 16)
    return {"codes": (qs >> _uint8([0, 4]).reshape(2, 1)) & 15, "sc": ls.astype(np.int16) - 32}


def _iq3_s_parts(blocks, rows, n):
    from gguf.quants import IQ3_S
    IQ3_S.init_grid()
    grid = IQ3_S.grid.reshape(512, 4).astype(np.int8)                              # odd 1..15
    k = np.arange(64)
    ninth = (blocks[..., 66 + k // 8] >> _uint8(k % 8)) & 1
    magnitudes = grid[blocks[..., 2:66].astype(np.int16) | (ninth.astype(np.int16) << 8)].reshape(rows, n, 256)
    i = np.arange(256)
    negative = (blocks[..., 74 + i // 8] >> _uint8(i % 8)) & 1
    j = np.arange(8)
    s = (blocks[..., 106 + j // 2] >> _uint8(4 * (j % 2))) & 15
    return {"codes": (np.where(negative == 1, -magnitudes, magnitudes) + 15) // 2, "sc": 1 + 2 * s.astype(np.int16)}


def _q3_k_parts(blocks, rows, n):
    low = (blocks[..., 32:96].reshape(rows, n, 2, 1, 32) >> _uint8([0, 2, 4, 6]).reshape(4, 1)) & 3
    third = (blocks[..., 0:32].reshape(rows, n, 1, 1, 32) >> _uint8(np.arange(8)).reshape(2, 4, 1)) & 1
    j = np.arange(16)
    s = ((blocks[..., 96 + j % 8] >> _uint8(4 * (j // 8))) & 15) | (
        ((blocks[..., 104 + j % 4] >> _uint8(2 * (j // 4))) & 3) << 4)
    return {"codes": low | (third << 2), "sc": s.astype(np.int16) - 32}


_S_PARSERS = {"IQ4_NL": _iq4_nl_parts, "IQ4_XS": _iq4_xs_parts, "IQ3_S": _iq3_s_parts, "Q3_K": _q3_k_parts}


# ---- llama.cpp's tensor names ---------------------------------------------------------------------

# GGUF tensor name (blk.N. prefix removed) -> HF name (model.layers.N. prefix added), for the qwen2,
# qwen3 and qwen3moe architectures. Their GGUFs keep q and k rows in Hugging Face's order (llama-arch
# GGUFs permute them; these do not).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    # qwen3moe: the router, and every expert's matrices stacked [experts, out, in] in one tensor each.
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    # qwen3next: its norm after attention, shared expert and Gated DeltaNet (the four that llama.cpp's
    # converter reshaped are listed under these names until _qwen3next_layout undoes it).
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.ssm_a",
    "ssm_conv1d.weight": "linear_attn.ssm_conv1d",
    "attn_qkv.weight": "linear_attn.in_proj_qkv",
    "attn_gate.weight": "linear_attn.in_proj_z",
    # qwen35 / qwen35moe: the Gated DeltaNet's beta and decay projections on their own (the rest as
    # qwen3next's names, read by _qwen35_layout).
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    # The MTP module's own tensors, kept by llama.cpp's converter in the block after the trunk's
    # (renamed to Hugging Face's mtp.* by Checkpoint._mtp_names).
    **{f"nextn.{name}.weight": f"nextn.{name}.weight"
       for name in ("eh_proj", "enorm", "hnorm", "shared_head_norm", "embed_tokens", "shared_head_head")},
}
# The MTP module's tensors by Hugging Face's names (mtp.*, beside model.*: the drafter reads them there,
# from a folder or a GGUF alike): a nextn tensor of the first block past the trunk -> its name.
MTP_NAMES = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
             "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight",
             "nextn.embed_tokens.weight": "mtp.embed_tokens.weight",
             "nextn.shared_head_head.weight": "mtp.lm_head.weight"}
# How llama.cpp's converter stores qwen3next's tensors, undone at read (Checkpoint._qwen3next_layout):
# A as -exp(A_log); the conv kernels [channels, kernel] without their middle axis; in_proj_qkvz split
# into its q, k, v rows (each for all key heads in turn) and its z rows, where Hugging Face
# interleaves them per key head; every zero-centred RMSNorm's weight w stored as 1 + w (these).
_NEXT_ONE_PLUS = re.compile(r"(model\.norm|(model|mtp)\.layers\.\d+\.(input_layernorm|post_attention_layernorm"
                            r"|self_attn\.[qk]_norm)|mtp\.(norm|pre_fc_norm_embedding|pre_fc_norm_hidden))\.weight")
# Stacked experts as engine.weights reads them: gate and up joined along the rows of each expert
# (transformers' own stacked layout), read from the GGUF's two tensors.
_JOINED = {"mlp.experts.gate_up_proj": ("mlp.experts.gate_proj", "mlp.experts.up_proj")}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Qwen2 name of a GGUF tensor; an unknown name is an error, never dropped."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, name = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and name in _LAYER_NAMES:
        return f"model.layers.{layer}.{_LAYER_NAMES[name]}"
    raise WeightsError(f"the GGUF has a tensor mashbox does not know: {gguf_name}")


# Block types gguf's numpy decoders read (gguf.quants), besides plain floats.
_FLOAT_TYPES = ("F32", "F16", "F64")


def _readable_type(gguf_name: str, kind: int):
    """The GGMLQuantizationType of a tensor's type number, if mashbox can decode it; else an error
    naming the tensor and the type (never a tensor read wrong or dropped)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import _type_traits
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise WeightsError(f"the GGUF's tensor {gguf_name} has a type mashbox does not know (number {kind})") \
            from None
    if qtype.name not in _FLOAT_TYPES and qtype not in _type_traits:
        raise WeightsError(f"the GGUF's tensor {gguf_name} is {qtype.name}, which mashbox cannot decode")
    return qtype


def _config_json(folder: str) -> dict:
    """config.json in the folder (a GGUF's companion folder has one; its text model's keys where it
    nests them), or {}."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _joined_name(name: str) -> tuple[str, tuple[str, str]] | None:
    """(joined name, its two parts) when `name` is the first part of a joined tensor (_JOINED)."""
    for joined, (first, second) in _JOINED.items():
        if name.endswith("." + first):
            prefix = name[: -len(first)]
            return prefix + joined, (name, prefix + second)
    return None


def _grouped_from_tiled(key_heads: int, value_heads: int) -> np.ndarray:
    """Where each value head of Hugging Face's order (grouped by key head: head k r + j is key head
    k's j-th) is in llama.cpp's tiled order (head j key_heads + k)."""
    per = value_heads // key_heads
    grouped = np.arange(value_heads)
    return (grouped % per) * key_heads + grouped // per


# GGUF model types whose layout llama.cpp's converter changed, and the Checkpoint method that reads it back.
_GGUF_LAYOUTS = {"qwen3_next": "_qwen3next_layout", "qwen3_5": "_qwen35_layout", "qwen3_5_moe": "_qwen35_layout"}


# ---- finding the files ----------------------------------------------------------------------------

def weight_files(folder: str) -> tuple[str, list[str]]:
    """("safetensors" | "gguf", the files) of a weights folder, from names only (nothing is opened).
    safetensors win when both are there; a folder of neither, or of several GGUFs, is an error."""
    names = sorted(os.listdir(folder))
    if RANDOM_MARKER in names:            # random weights: the marker stands in for the files
        return "random", [os.path.join(folder, RANDOM_MARKER)]
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index} has no weight_map")
        return "safetensors", sorted({os.path.join(folder, file) for file in weight_map.values()})
    safetensors = [os.path.join(folder, n) for n in names if n.endswith(".safetensors")]
    if safetensors:
        return "safetensors", safetensors
    ggufs = [os.path.join(folder, n) for n in names if n.endswith(GGUF_SUFFIX)]
    if len(ggufs) == 1 or (ggufs and split_parts(ggufs[0]) == ggufs):
        return "gguf", ggufs
    if ggufs:
        raise WeightsError(f"{folder} holds {len(ggufs)} GGUF files; mashbox reads one model file per folder")
    raise WeightsError(f"no .safetensors or .gguf files in {folder}")


# llama.cpp's split GGUFs: NAME-00001-of-00003.gguf, NAME-00002-of-00003.gguf, ...
SPLIT_PART = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def split_parts(path: str) -> list[str] | None:
    """Every part of the split GGUF whose first part is `path`, in order (each must exist); None when
    `path` is not a split's first part."""
    found = SPLIT_PART.match(path)
    if found is None or int(found.group(2)) != 1:
        return None
    base, count = found.group(1), int(found.group(3))
    parts = [f"{base}-{i:05d}-of-{count:05d}{GGUF_SUFFIX}" for i in range(1, count + 1)]
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise WeightsError(f"{path} is the first of {count} parts, but {missing[0]} is missing")
    return parts


# ---- a GGUF file's header -------------------------------------------------------------------------
#
# Every count, length and dimension in a GGUF header is the file's word, and a damaged or hostile file
# can say anything (a tensor of 4294967295 dimensions, 2^63 tensors): each is checked against the bytes
# the file has left before anything is read or allocated by it, so reading a header costs at most
# about the file's own size, and a file that lies is refused naming the key or tensor.

# GGUF metadata value types (the format's numbering) -> their struct code; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MAGIC = b"GGUF"
_GGUF_HEAD = struct.Struct("<4sIQQ")    # magic, version, tensor count, metadata key count
_GGUF_LENGTH = struct.Struct("<Q")      # a string's length
_GGUF_DEFAULT_ALIGNMENT = 32
# The format's own bounds: a tensor has at most 4 dimensions (GGML_MAX_DIMS), its name at most 64 bytes
# (GGML_MAX_NAME), a metadata key at most 65,535 bytes.
GGUF_MAX_DIMS, GGUF_MAX_NAME, GGUF_MAX_KEY = 4, 64, 65535
# The fewest bytes a metadata entry (an empty key, a type, one byte) and a tensor's entry (an empty
# name, one dimension, type, offset) take: a header's counts cannot be more than its bytes hold.
_GGUF_MIN_KV_BYTES, _GGUF_MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8
# Values a metadata array read as a value may hold: far above any a Qwen GGUF holds (its largest are
# the vocabulary and its merges: 151,936 tokens in the demo, 248,320 in Qwen3.5's), so that no key
# makes the reader build a list the size of the file.
GGUF_MAX_ARRAY = 1 << 22


class GGUFHeader:
    """A GGUF file's header (version 2 or 3), read from a memory map without trusting it (the comment
    above): .tensors [(name, dimensions fastest first, GGML type number, absolute byte offset)] and its
    metadata as a read-only mapping, each value decoded when it is asked for (arrays as lists), so a
    key that is never read costs nothing. Use it in a `with` block: the map stays open while it is
    read. gguf's own reader decodes every value first, about 8 s for the demo's 151k-token vocabulary;
    this lists them in a fraction of a second. Errors are WeightsErrors naming the key or tensor."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < _GGUF_HEAD.size:
                raise WeightsError(f"{path} is not a GGUF file")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)   # only the header's pages are read
        try:
            if self._buf[:4] != _GGUF_MAGIC:
                raise WeightsError(f"{path} is not a GGUF file")
            self._read()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "GGUFHeader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._buf.close()

    def _read(self) -> None:
        _, version, n_tensors, n_kv = _GGUF_HEAD.unpack_from(self._buf)
        if version not in (2, 3):
            raise WeightsError(f"the GGUF's version {version} is not supported (2 and 3 are)")
        self._pos = _GGUF_HEAD.size
        self._check_count(n_kv, _GGUF_MIN_KV_BYTES, "metadata entries")
        self._values: dict[str, tuple[int, int]] = {}        # key -> (type, where its value begins)
        for _ in range(n_kv):
            key = self._string(GGUF_MAX_KEY, "a metadata key")
            kind = self._scalar("I", f"metadata key {key}'s type")
            if key in self._values:
                raise WeightsError(f"the GGUF's metadata key {key} appears twice")
            self._values[key] = (kind, self._pos)
            self._skip(kind, key)
        self._check_count(n_tensors, _GGUF_MIN_TENSOR_BYTES, "tensors")
        infos = [self._tensor_info() for _ in range(n_tensors)]
        end = self._pos
        alignment = self._alignment()
        start = end + (-end % alignment)          # tensor data begins aligned, after the header
        self.tensors = [(name, dims, kind, start + offset) for name, dims, kind, offset in infos]
        self._check_tensors(alignment, start)

    def _check_count(self, count: int, least: int, what: str) -> None:
        room = (len(self._buf) - self._pos) // least
        if count > room:
            raise WeightsError(f"the GGUF's header lists {count} {what}; the {len(self._buf)}-byte file holds "
                               f"at most {room}")

    def _take(self, n: int, what: str) -> int:
        """The position of the next n bytes (what: for the error), moving past them."""
        if n > len(self._buf) - self._pos:
            raise WeightsError(f"the GGUF does not read ({what} runs past the end of the file: {n} bytes at "
                               f"byte {self._pos} of {len(self._buf)}); is the file whole?")
        self._pos += n
        return self._pos - n

    def _scalar(self, code: str, what: str):
        return struct.unpack_from("<" + code, self._buf, self._take(struct.calcsize(code), what))[0]

    def _string(self, most: int, what: str) -> str:
        n = self._scalar("Q", what)
        if n > most:
            raise WeightsError(f"the GGUF's header has {what} of {n} bytes (the format allows {most})")
        start = self._take(n, what)
        return self._buf[start:start + n].decode("utf-8", "replace")

    def _skip(self, kind: int, key: str, in_array: bool = False) -> None:
        """Move past a value of this type, its bytes checked to be there."""
        what = f"metadata key {key}'s value"
        if kind in _GGUF_SCALARS:
            self._take(struct.calcsize(_GGUF_SCALARS[kind]), what)
        elif kind == _GGUF_STRING:
            self._take(self._scalar("Q", what), what)
        elif kind == _GGUF_ARRAY and not in_array:
            item, count = self._array_head(key)
            if item in _GGUF_SCALARS:
                self._take(count * struct.calcsize(_GGUF_SCALARS[item]), what)
            elif item == _GGUF_STRING:
                self._strings(count, key, keep=False)
            else:
                self._skip(item, key, in_array=True)
        else:
            raise WeightsError(f"the GGUF's metadata key {key} has value type {kind}, which "
                               + ("GGUF does not nest in an array" if in_array and kind == _GGUF_ARRAY
                                  else "GGUF does not define"))

    def _array_head(self, key: str) -> tuple[int, int]:
        """An array's item type and length, the length checked against the bytes left."""
        item = self._scalar("I", f"metadata key {key}'s array type")
        count = self._scalar("Q", f"metadata key {key}'s array length")
        least = struct.calcsize(_GGUF_SCALARS[item]) if item in _GGUF_SCALARS else 8   # a string: its length
        if count > (len(self._buf) - self._pos) // least:
            raise WeightsError(f"the GGUF does not read (metadata key {key} is an array of {count} values, "
                               f"more than the rest of the file holds); is the file whole?")
        return item, count

    def _alignment(self) -> int:
        if "general.alignment" not in self._values:
            return _GGUF_DEFAULT_ALIGNMENT
        kind, _ = self._values["general.alignment"]
        value = self["general.alignment"] if kind == _GGUF_UINT32 else None
        if value is None or value <= 0 or value & (value - 1):
            raise WeightsError("the GGUF's metadata general.alignment must be a uint32 power of two, got "
                               + (f"{value}" if value is not None else f"a value of type {kind}"))
        return value

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string(GGUF_MAX_NAME, "a tensor name")
        n_dims = self._scalar("I", f"tensor {name}'s dimension count")
        if not 1 <= n_dims <= GGUF_MAX_DIMS:
            raise WeightsError(f"the GGUF's tensor {name} has {n_dims} dimensions (the format allows 1 to "
                               f"{GGUF_MAX_DIMS})")
        dims = struct.unpack_from(f"<{n_dims}Q", self._buf, self._take(8 * n_dims, f"tensor {name}'s dimensions"))
        if 0 in dims:
            raise WeightsError(f"the GGUF's tensor {name} has a dimension of 0 ({list(dims)})")
        return name, dims, self._scalar("I", f"tensor {name}'s type"), self._scalar("Q", f"tensor {name}'s offset")

    def _check_tensors(self, alignment: int, start: int) -> None:
        """Each tensor once, of a type gguf knows, its rows whole blocks, aligned and inside the file."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        seen = set()
        for name, dims, kind, offset in self.tensors:
            if name in seen:
                raise WeightsError(f"the GGUF lists its tensor {name} twice")
            seen.add(name)
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise WeightsError(f"the GGUF's tensor {name} has a type mashbox does not know (number {kind})") \
                    from None
            if dims[0] % block:
                raise WeightsError(f"the GGUF's tensor {name} has rows of {dims[0]} values, not whole "
                                   f"{GGMLQuantizationType(kind).name} blocks of {block}")
            size = math.prod(dims) // block * block_bytes
            if (offset - start) % alignment or offset + size > len(self._buf):
                raise WeightsError(f"the GGUF's tensor {name} ({size} bytes at byte {offset}) is not aligned to "
                                   f"{alignment} bytes or runs past the end of the {len(self._buf)}-byte file")

    # ---- the metadata: a read-only mapping ----

    def __contains__(self, key) -> bool:
        return key in self._values

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str, default=None):
        return self[key] if key in self._values else default

    def __getitem__(self, key: str):
        kind, where = self._values[key]
        self._pos = where
        if kind != _GGUF_ARRAY:
            return self._value(kind, key)
        item, count = self._array_head(key)
        if count > GGUF_MAX_ARRAY:
            raise WeightsError(f"the GGUF's metadata key {key} is an array of {count} values; mashbox reads "
                               f"at most {GGUF_MAX_ARRAY}")
        if item in _GGUF_SCALARS:
            code = _GGUF_SCALARS[item]
            at = self._take(count * struct.calcsize(code), f"metadata key {key}'s value")
            return list(struct.unpack_from(f"<{count}{code}", self._buf, at))
        return self._strings(count, key, keep=True)

    def _strings(self, count: int, key: str, keep: bool) -> list[str] | None:
        """An array's `count` strings (keep: decoded, else only moved past), each length checked
        against the bytes left; one tight loop, as a vocabulary has hundreds of thousands."""
        buf, pos, end, length = self._buf, self._pos, len(self._buf), _GGUF_LENGTH.unpack_from
        out = [] if keep else None
        for _ in range(count):
            n = length(buf, pos)[0] if pos + 8 <= end else end
            if pos + 8 + n > end:
                raise WeightsError(f"the GGUF does not read (metadata key {key}'s strings run past the end "
                                   f"of the file at byte {pos} of {end}); is the file whole?")
            if keep:
                out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", "replace"))
            pos += 8 + n
        self._pos = pos
        return out

    def _value(self, kind: int, key: str):
        if kind == _GGUF_STRING:
            return self._string(len(self._buf), f"metadata key {key}'s value")
        return self._scalar(_GGUF_SCALARS[kind], f"metadata key {key}'s value")


def gguf_tensor_index(path: str) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, dimensions fastest first, GGML type number, absolute byte offset) of each tensor of a GGUF
    file, read from its header (GGUFHeader)."""
    with GGUFHeader(path) as header:
        return header.tensors


def _e4m3_table() -> np.ndarray:
    """float32 of each of the 256 float8_e4m3fn bytes (NaN for the two NaN codes). A byte looked up in
    it is the same float32 as ml_dtypes' cast, 3-4x faster (measured on 4096 x 12288: 0.3-0.5 s
    against 0.8-1.2 s on a Zen 3 core pair)."""
    import ml_dtypes
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


# safetensors' own bound on a file's JSON header (its reader's MAX_HEADER_SIZE).
SAFETENSORS_MAX_HEADER = 100_000_000
# Bytes per value of each safetensors dtype of a whole byte or more (a tensor's span is checked by them).
_SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _safetensors_header(path: str) -> tuple[dict, int]:
    """(the header, the byte offset where the tensors' data begins). Its length is checked against the
    file before it is read, and each tensor's entry (dtype, shape, where its bytes are) against the
    file's size: a WeightsError naming the file and tensor."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\xff"))
        if n > min(SAFETENSORS_MAX_HEADER, size - 8):
            raise WeightsError(f"{path} is not a whole safetensors file: its header's length is {n} bytes, "
                               f"in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise WeightsError(f"{path}: its safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: its safetensors header is not a JSON object")
    for name, info in header.items():
        if name != "__metadata__":
            _check_safetensors_entry(path, name, info, size - 8 - n)
    return header, 8 + n


def _check_safetensors_entry(path: str, name: str, info, data_bytes: int) -> None:
    try:
        dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        whole = all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (*shape, start, end))
    except (TypeError, KeyError, ValueError):
        whole = False
    if not whole or not isinstance(dtype, str) or not start <= end <= data_bytes:
        raise WeightsError(f"{path}: tensor {name}'s entry {json.dumps(info)[:120]} is not a dtype, a shape and "
                           f"data offsets within the file's {data_bytes} bytes of data")
    if dtype in _SAFETENSORS_BYTES and end - start != math.prod(shape) * _SAFETENSORS_BYTES[dtype]:
        raise WeightsError(f"{path}: tensor {name} ({dtype} {shape}) holds {end - start} bytes, not "
                           f"{math.prod(shape) * _SAFETENSORS_BYTES[dtype]}")


# ---- the checkpoint against its config -----------------------------------------------------------

def check_shapes(checkpoint: "Checkpoint", cfg) -> None:
    """A WeightsError naming the first tensor the model of `cfg` (a ModelConfig) reads that the
    checkpoint lacks or holds in another shape. Said at start-up, in one line, before a worker loads
    anything: there it would fail partway through the load, and again in each worker started after it.
    The tensors are model_tensors' (the loader's), by their text-only names (a multimodal checkpoint's
    language model is read under its prefix), with a mixture of experts' experts one by one or stacked,
    as the checkpoint holds them."""
    from engine.weights import LANGUAGE_MODEL          # where the loader reads a multimodal checkpoint's text model
    if checkpoint.kind == "random":                    # drawn as model_tensors gives them
        return
    stored = {"model." + name[len(LANGUAGE_MODEL):]: name for name in checkpoint.shapes
              if name.startswith(LANGUAGE_MODEL)}
    for name, shape in _expected_shapes(cfg, lambda n: stored.get(n, n) in checkpoint.shapes):
        held = checkpoint.shapes.get(stored.get(name, name))
        if held is None or tuple(held) != tuple(shape):
            gguf = checkpoint.gguf_names.get(name)
            where = f"tensor {name}" + (f" (the GGUF's {gguf})" if gguf else "")
            raise WeightsError(f"{where} is missing from the checkpoint" if held is None else
                               f"{where} has shape {list(held)}; the model's config gives {list(shape)}: the "
                               "config (config.json, or a GGUF's metadata) does not describe these weights")


def _expected_shapes(cfg, has) -> Iterator[tuple[str, tuple[int, ...]]]:
    """model_tensors(cfg)'s (name, shape), a layer at a time: a config that asks for more layers or
    experts than the checkpoint holds is found at its first layer, never listed whole (10^3 layers of
    10^3 experts are millions of names). Each "moe" layer's experts as the checkpoint holds them
    (has(name)): stacked [experts, 2 x width, hidden] and [experts, hidden, width] where it has
    experts.gate_up_proj, else one by one (the loader reads them either way)."""
    from dataclasses import replace
    e, m, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    first, kinds = "model.layers.0.", {}
    for i, kind in enumerate(zip(cfg.layer_kinds, cfg.mlp_kinds or ("dense",) * cfg.num_layers)):
        if kind not in kinds:        # layer 0 of a one-layer model of this kind (and the model's ends)
            kinds[kind] = model_tensors(replace(cfg, num_layers=1, layer_kinds=kind[:1], mlp_kinds=kind[1:]))
        if i == 0:
            yield from ((name, shape) for name, shape in kinds[kind].items() if not name.startswith(first))
        p = f"model.layers.{i}."
        yield from ((p + name[len(first):], shape) for name, shape in kinds[kind].items()
                    if name.startswith(first) and ".mlp.experts." not in name)
        if kind[1] != "moe":
            continue
        if has(p + "mlp.experts.gate_up_proj"):
            yield from ((p + "mlp.experts.gate_up_proj", (e, 2 * m, h)), (p + "mlp.experts.down_proj", (e, h, m)))
        else:
            for j in range(e):
                yield from _swiglu_tensors(f"{p}mlp.experts.{j}.", m, h).items()


# ---- the checkpoint -------------------------------------------------------------------------------

class Checkpoint:
    """The tensors of one weights folder (the module docstring). Files stay open (memory-mapped) while
    the object lives; tensors are read only by get()."""

    def __init__(self, folder: str):
        self.folder = folder
        self.kind, self.files = weight_files(folder)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.formats: dict[str, str] = {}
        self._where: dict[str, str] = {}          # safetensors: name -> file
        self._open: dict[str, object] = {}
        self._tensors: dict[str, tuple] = {}      # gguf: name -> (type, byte offset, bytes, its file's map)
        self._maps: dict[str, mmap.mmap] = {}     # gguf: name -> its file's mmap (_release)
        self.gguf_names: dict[str, str] = {}      # gguf: name -> the file's own name for it (llama.cpp's)
        # gguf: name -> where Hugging Face's rows (columns) are in the file: its row i is the file's
        # row order[i] (a qwen35 file's value heads in llama.cpp's tiled order: _qwen35_layout).
        self._row_order: dict[str, np.ndarray] = {}
        self._col_order: dict[str, np.ndarray] = {}
        data_bytes = weights = 0
        if self.kind == "random":
            self._init_random(_random_source(folder))
            return
        if self.kind == "gguf":
            data_bytes, weights = self._init_gguf()
        else:
            self.file = folder
            self._raw: dict[str, tuple[str, int, int]] = {}     # name -> (file, data start, end)
            for path in self.files:
                header, data = _safetensors_header(path)
                for name, info in header.items():
                    if name == "__metadata__" or name in self.shapes:
                        continue
                    self._where[name] = path
                    self.shapes[name] = tuple(info["shape"])
                    self.formats[name] = info["dtype"]
                    start, end = info["data_offsets"]
                    self._raw[name] = (path, data + start, data + end)
                    data_bytes += end - start
                    weights += math.prod(info["shape"])
            weights -= self._pair_fp8_scales()
        self.bits_per_weight = round(8 * data_bytes / weights, 2) if weights else 0.0

    def _init_gguf(self) -> tuple[int, int]:
        """A GGUF's listing (one file, or the parts of a split GGUF in order), by Hugging Face's names
        and layout; returns (its tensors' bytes, their weights)."""
        self.file = os.path.realpath(self.files[0])     # a companion folder links the file
        try:
            from gguf.constants import GGML_QUANT_SIZES
        except ImportError:
            raise WeightsError(f"{self.file} is a GGUF: reading it needs the gguf package "
                               f"(pip install 'mashbox[demo]')") from None
        data_bytes = weights = 0
        for path in self.files:
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            data = np.frombuffer(mapped, np.uint8)
            for gguf_name, dims, kind, offset in gguf_tensor_index(path):
                name = hf_name(gguf_name)
                qtype = _readable_type(gguf_name, kind)
                block, block_bytes = GGML_QUANT_SIZES[qtype]
                count = int(np.prod(dims, dtype=np.int64))
                # GGUF lists dimensions fastest first (ne0 = columns); HF lists them slowest first.
                self.shapes[name] = tuple(int(n) for n in reversed(dims))
                self.formats[name] = qtype.name
                self._tensors[name] = (qtype, offset, count // block * block_bytes, data)
                self._maps[name] = mapped
                self.gguf_names[name] = gguf_name
                data_bytes += count // block * block_bytes
                weights += count
        self._join_parts()
        self._derived: dict[str, tuple[tuple[str, ...], object]] = {}   # name -> (parts, values from them)
        config = _config_json(self.folder)
        if config.get("model_type") in _GGUF_LAYOUTS:
            self._mtp_names(config)
            getattr(self, _GGUF_LAYOUTS[config["model_type"]])(config)
        return data_bytes, weights

    def _init_random(self, source: "RandomSource") -> None:
        """A random checkpoint's listing: its source's tensors, formats and bits per weight."""
        self._random = source
        self.file = source.name
        self.shapes, self.formats = dict(source.shapes), dict(source.formats)
        self.bits_per_weight = source.bits_per_weight
        self._fp8 = {name: (None, FP8_DEFAULT_BLOCK) for name, kind in self.formats.items() if kind == FP8}

    def _pair_fp8_scales(self) -> int:
        """Pair each F8_E4M3 weight with its block scales (taken out of the listing: they are read
        with it). Returns how many numbers the scales hold (not weights, though their bytes count)."""
        self._fp8: dict[str, tuple[str, tuple[int, int]]] = {}   # weight -> (its scales, block)
        names = [name for name, kind in self.formats.items() if kind == FP8]
        if not names:
            return 0
        try:
            with open(os.path.join(self.folder, "config.json"), encoding="utf-8") as f:
                block = fp8_block(json.load(f)) or FP8_DEFAULT_BLOCK
        except (OSError, ValueError, ConfigError):
            block = FP8_DEFAULT_BLOCK           # engine.config refuses a bad config.json, with its reason
        scales = 0
        for name in names:
            scale = name + FP8_SCALE
            shape = self.shapes[name]
            if scale not in self.shapes:
                raise WeightsError(f"tensor {name} is float8 ({FP8}) without its block scales {scale}")
            if len(shape) != 2:
                raise WeightsError(f"tensor {name} is float8 ({FP8}) with shape {list(shape)}: mashbox reads "
                                   "float8 matrices only (two dimensions, a scale per block)")
            want = tuple(-(-n // b) for n, b in zip(shape, block))
            if self.shapes[scale] != want:
                raise WeightsError(f"tensor {scale} has shape {list(self.shapes[scale])}; {name} "
                                   f"{list(shape)} in blocks of {list(block)} needs {list(want)}")
            self._fp8[name] = (scale, block)
            scales += int(np.prod(want))
            del self.shapes[scale], self.formats[scale]
        return scales

    def _join_parts(self) -> None:
        """List each joined tensor (_JOINED) in place of its two parts, which are read from the file
        when it is (so nothing is counted twice)."""
        self._joined: dict[str, tuple[str, str]] = {}
        self._part_shapes: dict[str, tuple[int, ...]] = {}
        for name in list(self.shapes):
            found = _joined_name(name)
            if found is None or found[1][1] not in self.shapes:
                continue
            joined, (first, second) = found
            a, b = self.shapes.pop(first), self.shapes.pop(second)
            if a[0] != b[0] or a[2:] != b[2:]:
                raise WeightsError(f"the GGUF's {first} {list(a)} and {second} {list(b)} do not stack")
            self.shapes[joined] = (a[0], a[1] + b[1], *a[2:])
            self.formats[joined] = self.formats.pop(first)
            if self.formats.pop(second) != self.formats[joined]:
                self.formats[joined] = "mixed"
            self._part_shapes.update({first: a, second: b})
            self._joined[joined] = (first, second)

    def _rename(self, old: str, new: str) -> None:
        """List a GGUF's tensor under another Hugging Face name."""
        for table in (self.shapes, self.formats, self._tensors, self._maps, self.gguf_names):
            if old in table:
                table[new] = table.pop(old)

    def _mtp_names(self, config: dict) -> None:
        """The blocks past the trunk's num_hidden_layers (llama.cpp keeps a Qwen3-Next / Qwen3.5 MTP
        module there) listed by Hugging Face's MTP names: block L + j's layer tensors as mtp.layers.j.*,
        block L's nextn tensors as MTP_NAMES gives them. The trunk's loader never reads them."""
        layers = config.get("num_hidden_layers")
        if not isinstance(layers, int):
            return
        for name in list(self.shapes):
            found = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
            if found is None or int(found.group(1)) < layers:
                continue
            block, rest = int(found.group(1)) - layers, found.group(2)
            self._rename(name, MTP_NAMES.get(rest) if rest in MTP_NAMES and block == 0
                         else f"mtp.layers.{block}.{rest}")

    def _qwen35_layout(self, config: dict) -> None:
        """List a qwen35 / qwen35moe GGUF's tensors as Hugging Face holds them. llama.cpp's converter
        (Qwen3_5TextModel) moves each Gated DeltaNet layer's value heads from Hugging Face's order,
        grouped by key head (key head k's value heads k r .. k r + r - 1), to a tiled one (value head
        r' k_heads + k: each key head's first, then each one's second, ...) in in_proj_qkv's v rows,
        in_proj_z, in_proj_b, in_proj_a, A, dt_bias, the conv's v channels and out_proj's columns;
        stores A as -exp(A_log) and every RMSNorm but the DeltaNet's as 1 + w. Rows and columns are
        read back through _row_order / _col_order (so a matrix's blocks are read as the file holds
        them), the rest through functions of the stored tensors (_derive)."""
        kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
        kd, dv = kh * config["linear_key_head_dim"], config["linear_value_head_dim"]
        heads = _grouped_from_tiled(kh, vh)
        v_rows = lambda width: (heads[:, None] * width + np.arange(width)).reshape(-1)  # noqa: E731
        channels = np.concatenate([np.arange(2 * kd), 2 * kd + v_rows(dv)])
        for name in list(self.shapes):
            stem, _, last = name.rpartition(".")
            if last in ("in_proj_qkv", "in_proj_z"):
                self._rename(name, name + ".weight")
                self._order(self._row_order, name + ".weight", channels if last == "in_proj_qkv" else v_rows(dv))
            elif name.endswith((".in_proj_b.weight", ".in_proj_a.weight")):
                self._order(self._row_order, name, heads)
            elif name.endswith(".linear_attn.out_proj.weight"):
                self._order(self._col_order, name, v_rows(dv))
            elif name.endswith(".linear_attn.ssm_a"):
                self._derive(stem + ".A_log", (name,), lambda a: np.log(-a)[heads], self.shapes[name])
            elif name.endswith(".linear_attn.dt_bias"):
                self._derive(name, (name,), lambda b: b[heads], self.shapes[name])
            elif name.endswith(".linear_attn.ssm_conv1d"):
                self._derive(stem + ".conv1d.weight", (name,), lambda w: w[channels][:, None, :],
                             (self.shapes[name][0], 1, self.shapes[name][-1]))
            elif _NEXT_ONE_PLUS.fullmatch(name):
                self._derive(name, (name,), lambda w: w - 1, self.shapes[name])

    def _order(self, orders: dict, name: str, order: np.ndarray) -> None:
        """Read `name`'s rows (or columns) in this order, where the tensor has as many (a tensor of
        another shape keeps its own: check_shapes names it)."""
        axis = 0 if orders is self._row_order else -1
        if self.shapes[name][axis] == len(order) and not np.array_equal(order, np.arange(len(order))):
            orders[name] = order

    def _qwen3next_layout(self, config: dict) -> None:
        """List a qwen3next GGUF's tensors as Hugging Face holds them (_NEXT_ONE_PLUS's comment), each
        read through a function of the stored ones (get)."""
        kh, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
        per_head_v = config["linear_num_value_heads"] // kh * config["linear_value_head_dim"]

        def qkvz(qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
            q, k, v = np.split(qkv, [kh * dk, 2 * kh * dk])
            heads = [part.reshape(kh, -1, part.shape[-1]) for part in (q, k, v, z)]
            return np.concatenate(heads, axis=1).reshape(-1, qkv.shape[-1])

        for name in list(self.shapes):
            stored = name.rpartition(".")[0] + "."
            if name.endswith(".linear_attn.ssm_a"):
                self._derive(stored + "A_log", (name,), lambda a: np.log(-a), self.shapes[name])
            elif name.endswith(".linear_attn.ssm_conv1d"):
                channels, kernel = self.shapes[name]
                self._derive(stored + "conv1d.weight", (name,), lambda w: w[:, None, :], (channels, 1, kernel))
            elif name.endswith(".linear_attn.in_proj_qkv"):
                z = stored + "in_proj_z"
                rows = self.shapes[name][0] + self.shapes[z][0]
                if (rows % kh or self.shapes[z][0] != kh * per_head_v
                        or self.shapes[name][0] != 2 * kh * dk + kh * per_head_v):
                    raise WeightsError(f"the GGUF's {name} {list(self.shapes[name])} and {z} "
                                       f"{list(self.shapes[z])} do not make in_proj_qkvz of {kh} key heads")
                self._derive(stored + "in_proj_qkvz.weight", (name, z), qkvz, (rows, self.shapes[name][1]))
            elif _NEXT_ONE_PLUS.fullmatch(name):
                self._derive(name, (name,), lambda w: w - 1, self.shapes[name])

    def _derive(self, name: str, parts: tuple[str, ...], values, shape: tuple[int, ...]) -> None:
        """List `name` as values(*parts read), in `shape`, in place of its stored parts."""
        kinds = {self.formats[part] for part in parts}
        for part in parts:
            self._part_shapes[part] = self.shapes.pop(part)
            self.formats.pop(part)
        self.shapes[name], self.formats[name] = shape, kinds.pop() if len(kinds) == 1 else "mixed"
        self._derived[name] = (parts, values)

    def has(self, name: str) -> bool:
        return name in self.shapes

    def derived(self, name: str) -> bool:
        """Whether a tensor is computed from others the file stores (a qwen3next GGUF's joined
        projections): read as floats only, never as the blocks of one."""
        return name in getattr(self, "_derived", {})

    def fp8_scale_columns(self, name: str) -> int:
        """How many columns each of fp8(name)'s scales covers: the block's, or 1 where the blocks do not
        divide the columns."""
        block_cols = self._fp8[name][1][1]
        return block_cols if self.shapes[name][1] % block_cols == 0 else 1

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor, in its stored dtype (safetensors) or float32 (GGUF, FP8), in HF's shape; rows: only
        those of a matrix (read and decoded alone where the format allows)."""
        if name not in self.shapes:
            raise WeightsError(f"tensor {name} is missing from the checkpoint")
        these = rows or slice(None)
        if self.kind == "random":
            return self._random.get(name, rows)
        if self.kind == "gguf":
            if name in self._derived:
                parts, values = self._derived[name]
                return values(*(self._dequantize(part) for part in parts))[these]
            if name in self._joined:
                return np.concatenate([self._dequantize(part) for part in self._joined[name]], axis=1)[these]
            return self._dequantize(name, these)
        if name in self._fp8:
            return self._fp8_values(name)[these]
        if rows is not None:                           # safetensors' slices are not clamped
            self._tensor(name, opened_only=True)
            return self._open[self._where[name]].get_slice(name)[slice(*rows.indices(self.shapes[name][0]))]
        return self._tensor(name)

    def q5_0(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A GGUF tensor stored as Q5_0 [rows, cols] -> (levels uint8 [rows, cols] in 0..31, scales
        float16 [rows, cols / 32]) with the weights = scales (levels - 16), each scale repeated over
        its 32 columns: the file's own numbers, for weights held at 5 bits (engine.native.pack5).
        A Q5_0 block is 22 bytes: the float16 scale, 4 bytes of fifth bits (bit j for column j of
        the block), 16 bytes of nibbles (byte j: column j low, column j + 16 high)."""
        if self.formats.get(name) != "Q5_0":
            raise WeightsError(f"tensor {name} is not stored as Q5_0")
        blocks = self._block_rows(name, Q5_0_BYTES)
        rows, cols = blocks.shape[0], blocks.shape[1] * Q5_0_BLOCK
        scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        fifth = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")[..., 0]
        nibbles = blocks[..., 6:]
        low = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)                   # [rows, blocks, 32]
        bits = (fifth[..., None] >> np.arange(Q5_0_BLOCK, dtype=np.uint32)) & 1
        levels = (low | (bits.astype(np.uint8) << 4)).reshape(rows, cols)
        self._release(name)
        return levels, scales

    def q8_0(self, name: str, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A GGUF tensor stored as Q8_0 [rows, cols] -> (levels int8 [rows, cols], scales float16 [rows,
        cols / 32]), the weights = scales levels, each scale repeated over its 32 columns: the file's
        own numbers, for weights held at 8.5 bits (engine.native.pack8); rows: only those."""
        if self.formats.get(name) != "Q8_0":
            raise WeightsError(f"tensor {name} is not stored as Q8_0")
        if self.kind == "random":
            parts = self._random.stored(name, "Q8_0", rows)
            return parts["levels"], parts["scales"]
        blocks = self._block_rows(name, Q8_0_BYTES, rows)
        scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        levels = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(blocks.shape[0], -1)
        self._release(name)
        return levels, scales

    def q8_0_lowest(self, name: str) -> int:
        """The lowest level of a Q8_0 tensor, read in place (a view of the file: no copy)."""
        if self.kind == "random":
            return -127                   # drawn in -127..127 (engine.checkpoint._q8_0_piece)
        (_, offset, size, data) = self._tensors[name]
        lowest = int(data[offset:offset + size].reshape(-1, Q8_0_BYTES)[:, 2:].view(np.int8).min())
        self._release(name)
        return lowest

    def _block_rows(self, name: str, block_bytes: int, rows: slice | None = None) -> np.ndarray:
        """A GGUF matrix's blocks uint8 [rows, blocks per row, block_bytes] as the file holds them (a
        view of its map), or only `rows` of Hugging Face's order (_row_order: a copy of those)."""
        (_, offset, size, data), shape = self._tensors[name], self.shapes[name]
        blocks = data[offset:offset + size].reshape(shape[0], -1, block_bytes)
        order = self._row_order.get(name)
        return blocks[rows or slice(None)] if order is None else blocks[order[rows or slice(None)]]

    def column_order(self, name: str) -> np.ndarray | None:
        """Where each of Hugging Face's columns of a GGUF matrix is among the file's (its column j is
        the file's column order[j]), when they differ: the blocks readers (q5_0, q8_0, k_quant, s_quant)
        give the file's columns, get() Hugging Face's."""
        return getattr(self, "_col_order", {}).get(name)

    def k_quant(self, name: str, rows: slice | None = None) -> dict:
        """A GGUF tensor stored as Q4_K, Q5_K or Q6_K [rows, cols] -> its blocks' own numbers per row, for
        weights held as the file has them (engine.native.pack_k): k_quant_parts; rows: only those."""
        kind = self.formats.get(name)
        if kind not in K_BYTES:
            raise WeightsError(f"tensor {name} is not stored as Q4_K, Q5_K or Q6_K")
        if self.kind == "random":
            return self._random.stored(name, kind, rows)
        parts = k_quant_parts(kind, self._block_rows(name, K_BYTES[kind], rows))
        self._release(name)
        return parts

    def s_quant(self, name: str, rows: slice | None = None) -> dict:
        """A GGUF tensor stored as IQ4_NL, IQ4_XS, IQ3_S or Q3_K [rows, cols] -> its blocks' own numbers per
        row, for weights held as the file has them (engine.native.pack_s): s_block_parts;
        rows: only those."""
        from engine import native
        kind = self.formats.get(name)
        if kind not in native.S_BYTES or self.kind != "gguf":
            raise WeightsError(f"tensor {name} is not stored as one of {', '.join(native.S_BYTES)}")
        parts = s_block_parts(kind, self._block_rows(name, native.S_BYTES[kind], rows))
        self._release(name)
        return parts

    def fp8(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """An FP8 weight [rows, cols] as stored -> (float8_e4m3fn [rows, cols], float32 scales
        [rows, cols / block columns]): each row with its block row's scales, so that any row operation
        (stacking, interleaving, splitting) moves a row's scales with it; the values times their
        block's scale are get()'s. Where the blocks do not divide the columns (no Qwen checkpoint),
        each column gets its scale (fp8_scale_columns)."""
        import ml_dtypes
        if name not in self._fp8:
            raise WeightsError(f"tensor {name} is not stored as float8 ({FP8})")
        if self.kind == "random":
            parts = self._random.stored(name, FP8)
            return parts["f8"], parts["f8_scale"]
        scale_name, (block_rows, block_cols) = self._fp8[name]
        path, start, end = self._raw[name]
        rows, cols = self.shapes[name]
        values = np.memmap(path, np.uint8, mode="r", offset=start, shape=(end - start,)).reshape(rows, cols)
        scales = np.repeat(self._tensor(scale_name).astype(np.float32), block_rows, axis=0)[:rows]
        if self.fp8_scale_columns(name) != block_cols:
            scales = np.repeat(scales, block_cols, axis=1)[:, :cols]
        return np.array(values).view(ml_dtypes.float8_e4m3fn), np.ascontiguousarray(scales)

    def _tensor(self, name: str, opened_only: bool = False) -> np.ndarray | None:
        """A safetensors tensor in its stored dtype (any name, the scales too); opened_only: just open
        its file."""
        path = self._where[name]
        if path not in self._open:
            import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before bf16 files are read)
            from safetensors import safe_open
            self._open[path] = safe_open(path, framework="numpy")
        return None if opened_only else self._open[path].get_tensor(name)

    def _fp8_values(self, name: str) -> np.ndarray:
        """An FP8 weight [rows, cols] in float32: each value times its block's scale, a block of rows
        at a time (safetensors' numpy reader has no float8, so the bytes are mapped and viewed)."""
        scale_name, (block_rows, block_cols) = self._fp8[name]
        path, start, end = self._raw[name]
        rows, cols = self.shapes[name]
        values = np.memmap(path, np.uint8, mode="r", offset=start, shape=(end - start,)).reshape(rows, cols)
        scales = self._tensor(scale_name).astype(np.float32)
        out = np.empty((rows, cols), np.float32)
        table = _e4m3_table()
        for b, r0 in enumerate(range(0, rows, block_rows)):
            part = out[r0:r0 + block_rows]
            np.take(table, values[r0:r0 + block_rows], out=part)       # written in place: no temporaries
            part *= np.repeat(scales[b], block_cols)[:cols]
        return out

    def _release(self, name: str) -> None:
        """Drop this process's page mappings of a GGUF tensor's bytes once they are read (what is
        returned is a copy): the pages stay in the page cache and a later read maps them again, but
        the file no longer adds up in the worker's RSS while the whole model is converted beside the
        certification reference's reads (docs/perf-log.md, "The first start's peak memory")."""
        mapped = self._maps.get(name)
        if mapped is None:
            return
        (_, offset, size, _) = self._tensors[name]
        start = offset - offset % mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, start, offset + size - start)

    def _dequantize(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        from gguf.quants import dequantize
        (qtype, offset, size, data) = self._tensors[name]
        shape = self.shapes.get(name) or self._part_shapes[name]
        n = shape[0] if len(shape) > 1 else 1
        # [rows, bytes per row]: one row (ne0 values) is a whole number of blocks
        rows = rows if len(shape) > 1 else slice(None)
        order = self._row_order.get(name)
        data = data[offset:offset + size].reshape(n, -1)[rows if order is None else order[rows]]
        out = np.empty((data.shape[0], int(np.prod(shape)) // n), np.float32)
        step = max(1, DEQUANT_CHUNK_BYTES // (out.shape[1] * 4))
        for start in range(0, data.shape[0], step):
            out[start:start + step] = dequantize(np.asarray(data[start:start + step]), qtype)
        self._release(name)
        if name in self._col_order:
            out = out[:, self._col_order[name]]
        return out.reshape(out.shape[0], *shape[1:]) if len(shape) > 1 else out.reshape(shape)


# ---- random weights: a checkpoint drawn from its config, reading no file ----------------------------
#
# A random folder (engine.registry: --weights random[:SEED]) holds config.json, the tokenizer and
# RANDOM_MARKER, which names the seed and the form: what its matrices are stored as, like a real
# file's (a Hugging Face checkpoint's bfloat16, an official FP8 checkpoint's float8 with 128 x 128
# block scales, or a GGUF's blocks). Checkpoint reads such a folder like any other: the tensors a
# checkpoint of that config holds, by their Hugging Face names and shapes, each drawn when it is read,
# RANDOM_ROWS rows per seed, so any slice of rows reads the same numbers and no tensor is drawn whole
# unless it is asked for whole. Block forms are drawn as blocks (random levels, valid scales), never
# as floats first.

RANDOM_MARKER = "mashbox-random.json"
# Forms (the name --weights-dtype gives) -> the stored format of the matrices.
RANDOM_FORMATS = {"bf16": "BF16", "fp8": FP8, "q8_0": "Q8_0", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}
RANDOM_ROWS = 256                       # rows drawn per seed (a multiple of the FP8 scale block's 128)
# Inputs per block of each block format: a matrix whose inputs they do not divide is stored BF16.
RANDOM_BLOCK_INPUTS = {"Q8_0": Q8_0_BLOCK, "Q4_K": K_BLOCK, "Q5_K": K_BLOCK, "Q6_K": K_BLOCK}
# Bytes per weight of each stored format (K_BYTES, Q8_0_BYTES: the GGUF block sizes).
FORMAT_BYTES = {"F32": 4.0, "BF16": 2.0, FP8: 1.0, "Q8_0": Q8_0_BYTES / Q8_0_BLOCK,
                **{kind: size / K_BLOCK for kind, size in K_BYTES.items()}}
# Sizes that keep a random model's forward finite and its logits spread: each projection's output
# about as large as its RMS-normed input (std 1 / sqrt(fan-in)); the embedding and head drawn so that
# a unit-RMS final state gives logits of std RANDOM_LOGIT_STD (a few tokens stand out; with the
# embedding's std 1, a tied 1024-wide head gave logits of std 32, every step one certain token).
RANDOM_LOGIT_STD = 3.0
RANDOM_BIAS_STD = 0.1
# Gated DeltaNet's decay per value head, as Mamba-style layers start: A in [1, 16] (A_log its log),
# the time step softplus(dt_bias) log-uniform in [1e-3, 1e-1].
RANDOM_A_RANGE = (1.0, 16.0)
RANDOM_DT_RANGE = (1e-3, 1e-1)
# Random block levels: Q4_K / Q5_K sub-block scales drawn in [32, 63] with mins equal to them and
# dmin = d x the levels' middle, so each sub-block is d sc (q - middle): zero mean.
_K_LEVELS = {"Q4_K": 16, "Q5_K": 32, "Q6_K": 64}
_K_SUB_INPUTS = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16}
_SCALE_LOW, _SCALE_SPAN = 32, 32
_LAYER_MATRIX = re.compile(r"(model|mtp)\.layers\.\d+\.(self_attn\.[qkvo]_proj\.weight|mlp\.(experts\.\d+\.|"
                           r"shared_expert\.)?(gate|up|down)_proj\.weight|mlp\.experts\.(gate_up|down)_proj|"
                           r"linear_attn\.(in_proj_\w+|out_proj)\.weight)|mtp\.fc\.weight")
_ENDS = ("model.embed_tokens.weight", "lm_head.weight")


def is_random(folder: str) -> bool:
    """Whether a folder is a random one (its weights drawn from RANDOM_MARKER's seed)."""
    return os.path.isfile(os.path.join(folder, RANDOM_MARKER))


def _random_source(folder: str) -> "RandomSource":
    """A random folder's source: its config.json, and the seed and form its marker names."""
    from engine.config import load_config
    try:
        with open(os.path.join(folder, RANDOM_MARKER), encoding="utf-8") as f:
            marker = json.load(f)
        seed, form = int(marker["seed"]), str(marker["form"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{folder}/{RANDOM_MARKER} does not name a seed and a form: {e}") from None
    return RandomSource(load_config(folder), seed, form)


def random_checkpoint(cfg, seed: int, form: str) -> "Checkpoint":
    """A Checkpoint of random weights with no folder behind it (the memory plan weighs a form before
    its folder is made)."""
    checkpoint = Checkpoint.__new__(Checkpoint)
    checkpoint.folder, checkpoint.kind, checkpoint.files = None, "random", []
    checkpoint._maps = {}
    checkpoint._init_random(RandomSource(cfg, seed, form))
    return checkpoint


def model_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """{Hugging Face name: shape} of every tensor a checkpoint of this ModelConfig holds (its text
    model, text-only names): what --weights random draws."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    for i, (kind, mlp) in enumerate(zip(cfg.layer_kinds, cfg.mlp_kinds or ("dense",) * cfg.num_layers)):
        out.update(_layer_tensors(cfg, f"model.layers.{i}.", kind, mlp))
    return out


def mtp_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the MTP module past the trunk that cfg states (mtp_layers; engine.weights:
    _Loader.mtp reads it): fc over the normed embedding and hidden state side by side, their norms,
    decoder layers laid out as the trunk's full-attention ones with its last layer's MLP, and a final
    norm. What a random checkpoint draws beside model_tensors; optional in a real one (a quantization
    may drop it: drafting is then off), so the start-up's shape check does not ask for it."""
    kind = next((k for k in cfg.layer_kinds if k != "linear"), None)
    if not cfg.mtp_layers or kind is None:
        return {}
    h = cfg.hidden_size
    out = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for j in range(cfg.mtp_layers):
        out.update(_layer_tensors(cfg, f"mtp.layers.{j}.", kind, (cfg.mlp_kinds or ("dense",))[-1]))
    return out


def _layer_tensors(cfg, p: str, kind: str, mlp: str) -> dict:
    h = cfg.hidden_size
    out = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    out.update(_linear_tensors(cfg, p + "linear_attn.") if kind == "linear" else
               _attention_tensors(cfg, p + "self_attn.", kind == "gated_attention"))
    out.update(_expert_tensors(cfg, p + "mlp.") if mlp == "moe" else
               _swiglu_tensors(p + "mlp.", cfg.intermediate_size, h))
    return out


def _attention_tensors(cfg, p: str, gated: bool) -> dict:
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    out = {p + "q_proj.weight": (2 * q if gated else q, h), p + "k_proj.weight": (kv, h),
           p + "v_proj.weight": (kv, h), p + "o_proj.weight": (h, q)}
    if cfg.qkv_bias:
        out.update({p + "q_proj.bias": (q,), p + "k_proj.bias": (kv,), p + "v_proj.bias": (kv,)})
    if cfg.qk_norm:
        out.update({p + "q_norm.weight": (cfg.head_dim,), p + "k_norm.weight": (cfg.head_dim,)})
    return out


def _linear_tensors(cfg, p: str) -> dict:
    """A Gated DeltaNet layer's: Qwen3.5's four input projections, or Qwen3-Next's two joined ones."""
    h, vh = cfg.hidden_size, cfg.linear_value_heads
    kd, vd = cfg.linear_key_heads * cfg.linear_key_dim, vh * cfg.linear_value_dim
    if cfg.model_type == "qwen3_next":
        out = {p + "in_proj_qkvz.weight": (2 * kd + 2 * vd, h), p + "in_proj_ba.weight": (2 * vh, h)}
    else:
        out = {p + "in_proj_qkv.weight": (2 * kd + vd, h), p + "in_proj_z.weight": (vd, h),
               p + "in_proj_b.weight": (vh, h), p + "in_proj_a.weight": (vh, h)}
    return {**out, p + "conv1d.weight": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel), p + "A_log": (vh,),
            p + "dt_bias": (vh,), p + "norm.weight": (cfg.linear_value_dim,), p + "out_proj.weight": (h, vd)}


def _swiglu_tensors(p: str, width: int, h: int) -> dict:
    return {p + "gate_proj.weight": (width, h), p + "up_proj.weight": (width, h), p + "down_proj.weight": (h, width)}


def _expert_tensors(cfg, p: str) -> dict:
    """Routed experts (Qwen3.5's stacked, as its checkpoints hold them; the others one per expert) and
    a hybrid model's shared expert."""
    e, m, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    out = {p + "gate.weight": (e, h)}
    if cfg.model_type == "qwen3_5_moe":
        out.update({p + "experts.gate_up_proj": (e, 2 * m, h), p + "experts.down_proj": (e, h, m)})
    else:
        for j in range(e):
            out.update(_swiglu_tensors(f"{p}experts.{j}.", m, h))
    if cfg.shared_expert_intermediate_size:
        out.update(_swiglu_tensors(p + "shared_expert.", cfg.shared_expert_intermediate_size, h))
        out[p + "shared_expert_gate.weight"] = (1, h)
    return out


def random_format(name: str, shape: tuple[int, ...], form: str) -> str:
    """How a random checkpoint of `form` stores a tensor: its layer matrices (and, in a block form, the
    embedding and head: a GGUF quantizes them too) in the form's format, vectors in float32, the rest
    (routers, the conv, the shared expert's gate) in bfloat16, as the files hold them."""
    stored = RANDOM_FORMATS[form]
    if len(shape) == 1:
        return "F32"
    narrow = bool(_LAYER_MATRIX.fullmatch(name)) or (name in _ENDS and stored in RANDOM_BLOCK_INPUTS)
    if not narrow or shape[-1] % RANDOM_BLOCK_INPUTS.get(stored, 1):
        return "BF16"
    return stored


class RandomSource:
    """The tensors of a random checkpoint: config (a ModelConfig), seed, form (RANDOM_FORMATS)."""

    def __init__(self, cfg, seed: int, form: str):
        if form not in RANDOM_FORMATS:
            raise WeightsError(f"random weights' form {form!r} is not one of {', '.join(RANDOM_FORMATS)}")
        self.cfg, self.seed, self.form = cfg, int(seed), form
        self.shapes = {**model_tensors(cfg), **mtp_tensors(cfg)}
        self.formats = {name: random_format(name, shape, form) for name, shape in self.shapes.items()}
        self.name = f"random:{self.seed} ({RANDOM_FORMATS[form]})"
        weights = sum(int(np.prod(shape)) for shape in self.shapes.values())
        stored = sum(int(np.prod(shape)) * FORMAT_BYTES[self.formats[n]] for n, shape in self.shapes.items())
        stored += sum(int(np.prod(shape)) // FP8_DEFAULT_BLOCK[1] * 4 / FP8_DEFAULT_BLOCK[0]   # fp8 scales
                      for n, shape in self.shapes.items() if self.formats[n] == FP8)
        self.bits_per_weight = round(8 * stored / weights, 2)

    # ---- what each tensor is drawn as ----

    def _std(self, name: str, shape: tuple[int, ...]) -> float:
        if name in _ENDS:
            return RANDOM_LOGIT_STD / np.sqrt(self.cfg.hidden_size)
        return 1.0 / np.sqrt(shape[-1])

    def _vector(self, name: str, size: int) -> np.ndarray:
        """A 1-D tensor: norms at their neutral scale (0 where stored zero-centred: scale 1 + w), biases
        small, the decay's A_log and dt_bias in their ranges."""
        rng = self._rng(name, 0)
        if name.endswith("norm.weight"):
            neutral = 0.0 if self.cfg.zero_centred_norms and ".linear_attn." not in name else 1.0
            return np.full(size, neutral, np.float32)
        if name.endswith("A_log"):
            return np.log(rng.uniform(*RANDOM_A_RANGE, size)).astype(np.float32)
        if name.endswith("dt_bias"):
            dt = np.exp(rng.uniform(*np.log(RANDOM_DT_RANGE), size))
            return (dt + np.log(-np.expm1(-dt))).astype(np.float32)          # softplus's inverse
        return _uniform(rng, size, RANDOM_BIAS_STD)

    def _rng(self, name: str, block: int) -> np.random.Generator:
        import zlib
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(
            [self.seed, zlib.crc32(name.encode()), block])))

    # ---- reading ----

    def _pieces(self, name: str, rows: slice | None) -> tuple[list[dict], slice, tuple[int, ...]]:
        """The stored pieces (RANDOM_ROWS rows each, as flat [rows, inputs]) covering `rows` of the
        first axis, the slice of their rows that is wanted, and the shape of what is returned."""
        shape = self.shapes[name]
        inner = int(np.prod(shape[1:-1]))                  # flat rows per first-axis index
        start, stop, _ = (rows or slice(None)).indices(shape[0])
        stop = max(stop, start)
        first, last = start * inner // RANDOM_ROWS, -(-stop * inner // RANDOM_ROWS)
        pieces = [self._piece(name, b) for b in range(first, last)]
        offset = first * RANDOM_ROWS
        return pieces, slice(start * inner - offset, stop * inner - offset), (stop - start, *shape[1:])

    def _piece(self, name: str, block: int) -> dict:
        shape, kind = self.shapes[name], self.formats[name]
        flat_rows = int(np.prod(shape[:-1]))
        n = min(RANDOM_ROWS, flat_rows - block * RANDOM_ROWS)
        rng, std, cols = self._rng(name, block + 1), self._std(name, shape), shape[-1]
        if kind == "BF16":
            return {"w": _bfloat16(_uniform(rng, n * cols, std)).reshape(n, cols)}
        if kind == FP8:
            return _fp8_piece(rng, n, cols, std)
        if kind == "Q8_0":
            return _q8_0_piece(rng, n, cols, std)
        return _k_piece(kind, rng, n, cols, std)

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor as a file of this form gives it: bfloat16 where stored so, else float32 (blocks
        and float8 dequantized), in its shape; rows: only those of its first axis."""
        if name not in self.shapes:
            raise WeightsError(f"tensor {name} is missing from the checkpoint")
        shape = self.shapes[name]
        if len(shape) == 1:
            return self._vector(name, shape[0])[rows or slice(None)]
        pieces, wanted, out_shape = self._pieces(name, rows)
        kind = self.formats[name]
        values = [p["w"] if kind == "BF16" else _dequantized(kind, p) for p in pieces]
        return np.concatenate(values)[wanted].reshape(out_shape)

    def stored(self, name: str, kind: str, rows: slice | None = None) -> dict:
        """A matrix's stored parts (one of _fp8_piece's, _q8_0_piece's, _k_piece's) for `rows`,
        each part's rows joined."""
        if self.formats.get(name) != kind:
            raise WeightsError(f"tensor {name} is not stored as {kind}")
        pieces, wanted, _ = self._pieces(name, rows)
        return {part: np.concatenate([p[part] for p in pieces])[wanted] for part in pieces[0]}


def _uniform(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """n float32 values uniform in [-std sqrt 3, std sqrt 3] (std `std`), from raw random bits: 16
    bits a value, several times faster than numpy's float draws."""
    bits = rng.bit_generator.random_raw(-(-n // 4)).view(np.int16)[:n]
    return bits.astype(np.float32) * np.float32(std * np.sqrt(3.0) / 32768)


def _bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 by keeping the top 16 bits (rounding toward zero): a bit shift, where
    ml_dtypes' rounding cast ran at a tenth of the draw's speed."""
    import ml_dtypes
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)


def _random_bytes(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    return rng.bit_generator.random_raw(-(-rows * cols // 8)).view(np.uint8)[:rows * cols].reshape(rows, cols)


def _fp8_piece(rng, rows: int, cols: int, std: float) -> dict:
    """float8 values (uniform, std 1) and each row's scale per 128 columns (its block row's): per
    block, std times a factor in [0.5, 1.5], as each block of a real checkpoint has its own."""
    import ml_dtypes
    block_rows, block_cols = FP8_DEFAULT_BLOCK
    blocks = rng.uniform(0.5, 1.5, (-(-rows // block_rows), -(-cols // block_cols))) * std
    scales = np.repeat(blocks.astype(np.float32), block_rows, axis=0)[:rows]
    values = _uniform(rng, rows * cols, 1.0).reshape(rows, cols).astype(ml_dtypes.float8_e4m3fn)
    return {"f8": values, "f8_scale": np.ascontiguousarray(scales)}


def _q8_0_piece(rng, rows: int, cols: int, std: float) -> dict:
    """Levels uniform in -127..127 (GGUF's rounding never writes -128) and a float16 scale per 32."""
    levels = np.maximum(_random_bytes(rng, rows, cols).view(np.int8), -127)
    level_std = np.sqrt((255 ** 2 - 1) / 12)
    scales = (rng.uniform(0.75, 1.25, (rows, cols // Q8_0_BLOCK)) * std / level_std).astype(np.float16)
    return {"levels": levels, "scales": scales}


def _k_piece(kind: str, rng, rows: int, cols: int, std: float) -> dict:
    """K-quant blocks as k_quant_parts gives them (levels, sc, d and for Q4_K / Q5_K mins, dmin): each
    sub-block d sc (q - the levels' middle), uniform levels, so the weights have std `std`."""
    levels_n = _K_LEVELS[kind]
    levels = _random_bytes(rng, rows, cols) & np.uint8(levels_n - 1)
    subs = cols // _K_SUB_INPUTS[kind]
    sc = (_random_bytes(rng, rows, subs) % _SCALE_SPAN + _SCALE_LOW).astype(np.uint8)
    level_std = np.sqrt((levels_n ** 2 - 1) / 12)
    d = (rng.uniform(0.75, 1.25, (rows, cols // K_BLOCK)) * std
         / (level_std * (_SCALE_LOW + (_SCALE_SPAN - 1) / 2))).astype(np.float16)
    if kind == "Q6_K":
        return {"levels": levels, "sc": sc.view(np.int8), "d": d}
    dmin = (d.astype(np.float32) * (levels_n - 1) / 2).astype(np.float16)
    return {"levels": levels, "sc": sc, "mins": sc.copy(), "d": d, "dmin": dmin}


def _dequantized(kind: str, parts: dict) -> np.ndarray:
    """A stored piece's float32 values (w = its scales times its levels, as the format defines)."""
    if kind == FP8:
        block = parts["f8"].shape[1] // parts["f8_scale"].shape[1]
        return parts["f8"].astype(np.float32) * np.repeat(parts["f8_scale"], block, axis=1)
    if kind == "Q8_0":
        return parts["levels"].astype(np.float32) * np.repeat(parts["scales"].astype(np.float32), Q8_0_BLOCK, axis=1)
    levels, sub = parts["levels"], _K_SUB_INPUTS[kind]
    rows, cols = levels.shape
    per_super = K_BLOCK // sub
    scale = np.repeat(parts["d"].astype(np.float32), per_super, axis=1) * parts["sc"].astype(np.float32)
    if kind == "Q6_K":
        w = (levels.reshape(rows, -1, sub).astype(np.float32) - 32) * scale[..., None]
    else:
        low = np.repeat(parts["dmin"].astype(np.float32), per_super, axis=1) * parts["mins"].astype(np.float32)
        w = levels.reshape(rows, -1, sub).astype(np.float32) * scale[..., None] - low[..., None]
    return w.reshape(rows, cols)
