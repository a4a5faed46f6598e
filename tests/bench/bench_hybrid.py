"""Hybrid (Qwen3-Next) forward throughput at the engine level (run by hand, not in CI).

    python tests/bench/bench_hybrid.py [--layers 4] [--hidden 1024] [--experts 128] [--steps 16]

A random-weight model shaped like Qwen3-Next-80B-A3B, scaled to fit a small CPU: three Gated
DeltaNet layers to one gated full-attention layer, 16:2 query:key-value heads of 256 with a quarter
rotary, 2 value heads per key head of 128 in the linear layers, a 4-wide conv, top-10 routed experts
of width hidden/4 with a shared expert of the same width; fewer layers, a smaller hidden size,
fewer experts and a smaller vocabulary. This times engine.model's jitted forward directly (the
forward alone, no scheduler or prompt cache), through engine.weights' loader, on the slot pool of
engine.cache. Measures, in one run:
  - prefill tokens/s of one PREFILL_TOKENS-token chunk (the chunked delta rule);
  - decode tokens/s at 1 and 4 busy rows (the one-step recurrence), each row PREFILL_TOKENS deep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

PREFILL_TOKENS = 512
PER_TOKEN = 10                          # Qwen3-Next-80B-A3B's routing: 10 experts per token


def shape(layers: int, hidden: int, experts: int, vocab: int) -> dict:
    """Qwen3-Next-80B-A3B's config.json (hidden 2048, 48 layers, 16:2 heads of 256, linear 16:32
    heads of 128, 512 experts of width 512, top 10, shared expert 512) scaled down."""
    return {"model_type": "qwen3_next", "hidden_size": hidden, "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers, "full_attention_interval": 4,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "partial_rotary_factor": 0.25, "linear_num_key_heads": hidden // 128,
            "linear_num_value_heads": hidden // 64, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": experts,
            "num_experts_per_tok": PER_TOKEN, "moe_intermediate_size": hidden // 4,
            "shared_expert_intermediate_size": hidden // 4, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": vocab,
            "max_position_embeddings": 32768, "rope_theta": 10000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def random_folder(raw: dict) -> str:
    """A Hugging Face folder of random float32 weights in Qwen3-Next's names (experts stacked)."""
    from safetensors.numpy import save_file

    from engine.config import config_from_dict
    cfg = config_from_dict(raw)
    folder = tempfile.mkdtemp(prefix="mashbox-bench-hybrid-")
    Path(folder, "config.json").write_text(json.dumps(raw))
    rng = np.random.default_rng(0)
    h, e, f, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size

    def w(*shape):
        return rng.standard_normal(shape, np.float32) * 0.02

    zeros = np.zeros(h, np.float32)                      # zero-centred norms: scale 1
    kd, vd = cfg.linear_key_heads * cfg.linear_key_dim, cfg.linear_value_heads * cfg.linear_value_dim
    for i, kind in enumerate(cfg.layer_kinds):           # a file per layer keeps the peak memory low
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": zeros, p + "post_attention_layernorm.weight": zeros,
             p + "mlp.gate.weight": w(e, h), p + "mlp.experts.gate_up_proj": w(e, 2 * f, h),
             p + "mlp.experts.down_proj": w(e, h, f), p + "mlp.shared_expert.gate_proj.weight": w(s, h),
             p + "mlp.shared_expert.up_proj.weight": w(s, h),
             p + "mlp.shared_expert.down_proj.weight": w(h, s), p + "mlp.shared_expert_gate.weight": w(1, h)}
        if kind == "linear":
            a = p + "linear_attn."
            t.update({a + "in_proj_qkvz.weight": w(2 * kd + 2 * vd, h),
                      a + "in_proj_ba.weight": w(2 * cfg.linear_value_heads, h),
                      a + "conv1d.weight": w(cfg.linear_conv_dim, 1, cfg.linear_conv_kernel) * 10,
                      a + "A_log": np.log(rng.uniform(1, 16, cfg.linear_value_heads)).astype(np.float32),
                      a + "dt_bias": np.ones(cfg.linear_value_heads, np.float32),
                      a + "norm.weight": np.ones(cfg.linear_value_dim, np.float32),
                      a + "out_proj.weight": w(h, vd)})
        else:
            a, q, kv = p + "self_attn.", cfg.q_size, cfg.kv_size
            t.update({a + "q_proj.weight": w(2 * q, h), a + "k_proj.weight": w(kv, h),
                      a + "v_proj.weight": w(kv, h), a + "o_proj.weight": w(h, q),
                      a + "q_norm.weight": np.zeros(cfg.head_dim, np.float32),
                      a + "k_norm.weight": np.zeros(cfg.head_dim, np.float32)})
        save_file(t, os.path.join(folder, f"layer{i:03d}.safetensors"))
    save_file({"model.embed_tokens.weight": w(cfg.vocab_size, h), "lm_head.weight": w(cfg.vocab_size, h),
               "model.norm.weight": zeros}, os.path.join(folder, "rest.safetensors"))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from engine.cache import init_cache
    from engine.config import load_config
    from engine.attention import kv_dtype_for
    from engine.model import dtype_for, jit_forward
    from engine.weights import load_weights, weights_bytes

    folder = random_folder(shape(a.layers, a.hidden, a.experts, a.vocab))
    try:
        platform = jax.default_backend()
        cfg = load_config(folder)
        params = load_weights(folder, cfg, dtype_for(platform))
        slots, ctx = 4, 2 * PREFILL_TOKENS
        cache = init_cache(cfg, slots, ctx, kv_dtype_for(platform))
        print(f"model: random Qwen3-Next-80B-A3B shape, {a.layers} layers {cfg.layer_kinds}, hidden "
              f"{a.hidden}, {a.experts} experts of {cfg.moe_intermediate_size}, top {PER_TOKEN}, shared "
              f"expert, vocab {a.vocab}; weights {weights_bytes(params) / 1e9:.2f} GB "
              f"({platform}, {os.cpu_count()} cores, machine shared with other work)")
        i32 = lambda *v: jnp.asarray(v, jnp.int32)
        rng = np.random.default_rng(1)

        def prefill(cache, slot):
            tokens = jnp.asarray(rng.integers(0, a.vocab, (1, PREFILL_TOKENS)), jnp.int32)
            logits, cache = jit_forward(params, cache, tokens, i32(slot), i32(0), i32(PREFILL_TOKENS), cfg=cfg)
            logits.block_until_ready()
            return cache

        cache = prefill(cache, 0)                        # compile
        times = []
        for slot in range(slots):                        # every slot PREFILL_TOKENS deep
            t = time.perf_counter()
            cache = prefill(cache, slot)
            times.append(time.perf_counter() - t)
        print(f"load {os.getloadavg()[0]:.2f}; prefill, {PREFILL_TOKENS} tokens: "
              f"{PREFILL_TOKENS / statistics.median(times):.1f} tok/s (median of {len(times)})")
        depth = [PREFILL_TOKENS] * slots                # each slot's next position
        for rows in (1, 4):
            steps = []
            for step in range(a.steps + 1):             # the first compiles
                tokens = jnp.asarray(rng.integers(0, a.vocab, (rows, 1)), jnp.int32)
                t = time.perf_counter()
                logits, cache = jit_forward(params, cache, tokens, i32(*range(rows)), i32(*depth[:rows]),
                                            i32(*[1] * rows), cfg=cfg)
                logits.block_until_ready()
                steps.append(time.perf_counter() - t)
                depth[:rows] = [d + 1 for d in depth[:rows]]
            step_s = statistics.median(steps[1:])
            print(f"load {os.getloadavg()[0]:.2f}; decode, {rows} busy rows: {rows / step_s:7.1f} tok/s "
                  f"({step_s * 1000:6.1f} ms/step, median of {a.steps})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
