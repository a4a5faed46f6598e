"""Mixture-of-experts throughput beside the active-bytes ceiling (run by hand, not in CI).

    python tests/bench/bench_moe.py [--layers 4] [--hidden 1024] [--slots 4] [--steps 16]
                                    [--path auto|exact|kernel] [--tile ROWS]

A random-weight model shaped like Qwen3-30B-A3B, scaled to fit a small CPU: the same 128 experts,
8 picked per token, renormalized, expert width 3/8 of the hidden size and 16:2 query:key-value
heads, but fewer layers, a smaller hidden size and a smaller vocabulary. Measures, in one run:
  - memory-copy bandwidth with numpy (read + written bytes, as bench_engine.py);
  - decode tokens/s at 1 and 4 busy slots, against the ceiling from the ACTIVE bytes of a step:
    attention, routers, the head, and only the experts the rows picked (8 at one row; at 4 rows the
    union of their picks, counted as its expectation under uniform routing, though the CPU's exact
    path reads an expert once per row picking it: see engine/moe.py);
  - prefill tokens/s of one 512-token prompt;
  - the routed-expert path the programs were traced with (Health's routed_experts).
Target on a 2-core CPU: batch-1 decode >= 60% of the active-bytes ceiling.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import bench_engine  # noqa: E402
from engine import moe  # noqa: E402
from engine.worker import Engine, WorkerArgs  # noqa: E402

EXPERTS, PER_TOKEN = 128, 8            # Qwen3-30B-A3B's routing, kept as it is
PREFILL_TOKENS = 512


def shape(layers: int, hidden: int, vocab: int) -> dict:
    """Qwen3-30B-A3B's config.json (hidden 2048, expert width 768, 32:4 heads of 128, 48 layers,
    vocabulary 151936) with fewer layers, a smaller hidden size and vocabulary."""
    return {"model_type": "qwen3_moe", "hidden_size": hidden, "intermediate_size": 3 * hidden,
            "moe_intermediate_size": 3 * hidden // 8, "num_experts": EXPERTS,
            "num_experts_per_tok": PER_TOKEN, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
            "num_key_value_heads": max(1, hidden // 512), "head_dim": 64, "vocab_size": vocab,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def random_folder(cfg: dict) -> str:
    """A Hugging Face folder of random float32 weights, one tensor per expert as published."""
    from safetensors.numpy import save_file
    folder = tempfile.mkdtemp(prefix="mashbox-bench-moe-")
    Path(folder, "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    h, f, v = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]

    def w(*s):
        return rng.standard_normal(s, np.float32) * 0.02

    ones = np.ones(h, np.float32)
    for i in range(cfg["num_hidden_layers"]):      # a file per layer keeps the peak memory low
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones,
             p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
             p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
             p + "self_attn.q_norm.weight": np.ones(cfg["head_dim"], np.float32),
             p + "self_attn.k_norm.weight": np.ones(cfg["head_dim"], np.float32),
             p + "mlp.gate.weight": w(EXPERTS, h)}
        for j in range(EXPERTS):
            e = f"{p}mlp.experts.{j}."
            t.update({e + "gate_proj.weight": w(f, h), e + "up_proj.weight": w(f, h),
                      e + "down_proj.weight": w(h, f)})
        save_file(t, os.path.join(folder, f"layer{i:03d}.safetensors"))
    save_file({"model.embed_tokens.weight": w(v, h), "lm_head.weight": w(v, h),
               "model.norm.weight": ones}, os.path.join(folder, "rest.safetensors"))
    return folder


def active_bytes(engine: Engine, experts_read: float) -> float:
    """Bytes a decode step reads: every weight but the embedding table and the experts, plus
    experts_read experts in each routed layer."""
    import jax
    p, cfg = engine.params, engine.cfg
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(p)) - p["embed"].nbytes
    for layer in p["layers"]:
        if "moe" in layer:
            one = (layer["moe"]["gate_up"].nbytes + layer["moe"]["down"].nbytes) / cfg.num_experts
            total -= one * (cfg.num_experts - experts_read)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--path", choices=("auto", "exact", "kernel"), default="auto")
    ap.add_argument("--tile", type=int, help=f"rows per prefill tile (default {moe.ROUTED_TILE})")
    a = ap.parse_args()
    if a.tile:
        moe.ROUTED_TILE = a.tile              # read while tracing, before the warm-up
    cfg = shape(a.layers, a.hidden, a.vocab)
    folder = random_folder(cfg)
    try:
        if a.path != "auto":
            import engine.config as config
            load = config.load_config
            config.load_config = lambda f: __import__("dataclasses").replace(load(f), routed_path=a.path)
            import engine.worker as worker
            worker.load_config = config.load_config
        bandwidth = bench_engine.copy_bandwidth()
        t = time.perf_counter()
        engine = Engine(WorkerArgs("bench-moe", folder, slots=a.slots, ctx=a.ctx, compile_cache=None))
        start_s = time.perf_counter() - t
        print(f"model: random Qwen3-30B-A3B shape, {a.layers} layers, hidden {a.hidden}, expert width "
              f"{cfg['moe_intermediate_size']}, {EXPERTS} experts, top {PER_TOKEN}, vocab {a.vocab} "
              f"({engine.facts.dtype}, {engine.facts.device}, {os.cpu_count()} cores, machine shared "
              f"with other work; load {os.getloadavg()[0]:.2f})")
        print(f"weights {engine.facts.gb:.2f} GB; start-up (load + compile {len(engine.programs())} "
              f"programs) {start_s:.1f} s; routed_experts: {engine.facts.routed_experts}")
        print(f"memory copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
        union4 = EXPERTS * (1 - (1 - PER_TOKEN / EXPERTS) ** 4)
        for rows, experts in ((1, PER_TOKEN), (min(4, a.slots), union4)):
            per_step = active_bytes(engine, experts)
            ceiling = bandwidth / per_step
            rate, step_s = bench_engine.decode_rate(engine, rows, a.steps, seed=rows)
            print(f"decode, {rows} busy slots: {rate:7.1f} tok/s ({step_s * 1000:6.1f} ms/step); "
                  f"active bytes {per_step / 1e6:.0f} MB/step ({experts:.1f} experts/layer) -> "
                  f"ceiling {ceiling:6.1f} steps/s; {step_s and 1 / step_s / ceiling:4.0%} of it")
        prefill = bench_engine.prefill_rate(engine, PREFILL_TOKENS)
        print(f"prefill, {PREFILL_TOKENS} tokens: {prefill:.1f} tok/s")
        print(f"programs compiled after ready: {engine.compiles_after_ready()}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
