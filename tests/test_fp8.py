"""Qwen's official FP8 checkpoints (engine.checkpoint reads them; engine.config accepts their
quantization_config and refuses other methods). The fixtures are the tiny Hugging Face ones rewritten
in the official layout: each projection weight float8_e4m3fn ("F8_E4M3") with `<name>_scale_inv`,
one float32 scale per block; norms, embeddings, the head and the MoE router stay as they were."""
from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine import certify, memory, native
from engine.checkpoint import Checkpoint
from engine.config import ConfigError, check_weights_dtype, config_from_dict, load_config
from engine.model import weights_dtype_for
from engine.products import weight_kind
from engine.weights import held_note, load_weights, weights_bytes
from tests.test_int8 import INT8_ATOL, _logits

TINY = Path(__file__).parent / "fixtures" / "tiny"
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)      # 448
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors' own writer takes no float8 (numpy has none): the format written by hand."""
    kinds = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.float32): "F32",
             np.dtype(ml_dtypes.bfloat16): "BF16"}
    header, blobs, at = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": kinds[array.dtype], "shape": list(array.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w [rows, cols] -> (float8_e4m3fn values, float32 scales [ceil(rows/b0), ceil(cols/b1)]), each
    block on the scale that maps its largest magnitude to e4m3's largest, as Qwen's converter does."""
    rows, cols = w.shape
    scales = np.ones((-(-rows // block[0]), -(-cols // block[1])), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].astype(np.float32)
            peak = float(np.abs(part).max())
            scales[i, j] = peak / E4M3_MAX if peak > 0 else 1.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                (part / scales[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scales


def _dequantize(q: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    wide = np.repeat(np.repeat(scales.astype(np.float32), block[0], axis=0), block[1], axis=1)
    wide = wide[:q.shape[0], :q.shape[1]]
    return q.astype(np.float32) * wide


def fp8_pair(tmp_path: Path, model: str, block: tuple[int, int] = (128, 128),
             scale_dtype=np.float32) -> tuple[Path, Path]:
    """(the FP8 checkpoint of a tiny model, the same model with those FP8 weights dequantized to
    float32 in a plain checkpoint): what the FP8 folder must read as. scale_dtype: how the scales are
    stored (float32, or bfloat16 as some checkpoints have them)."""
    src = TINY / model
    fp8, plain = tmp_path / f"{model}-fp8", tmp_path / f"{model}-plain"
    fp8.mkdir()
    plain.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS and w.ndim == 2:
            q, scales = _quantize(w, block)
            scales = scales.astype(scale_dtype)
            quantized[name], quantized[name + "_scale_inv"] = q, scales
            dequantized[name] = _dequantize(q, scales, block)
        else:
            quantized[name] = dequantized[name] = w
    _write_safetensors(fp8 / "model.safetensors", quantized)
    save_file(dequantized, str(plain / "model.safetensors"))
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block)}}))
    shutil.copy(src / "config.json", plain / "config.json")
    return fp8, plain


@pytest.mark.parametrize("block, scale_dtype", [((128, 128), np.float32), ((16, 24), np.float32),
                                                ((16, 24), ml_dtypes.bfloat16)])
def test_fp8_weights_read_as_their_values_times_their_block_scales(tmp_path, block, scale_dtype):
    """Guards against a block scale applied to the wrong rows or columns (a partial last block, a
    block size other than 128), bfloat16 scales misread, the scales listed as weights of their own,
    and a bits-per-weight that hides the scales' bytes or counts them as weights."""
    fp8, plain = fp8_pair(tmp_path, "qwen3", block, scale_dtype)
    got, want = Checkpoint(str(fp8)), Checkpoint(str(plain))
    assert set(got.shapes) == set(want.shapes) and got.shapes == want.shapes
    name = "model.layers.0.mlp.down_proj.weight"
    assert got.formats[name] == "F8_E4M3" and got.formats["model.norm.weight"] == want.formats["model.norm.weight"]
    for name in want.shapes:
        np.testing.assert_array_equal(got.get(name), want.get(name), err_msg=name)
    with open(fp8 / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    # the file's every byte (scales included) over the weights alone (scales excluded)
    data = sum(info["data_offsets"][1] - info["data_offsets"][0] for info in header.values())
    weights = sum(int(np.prod(shape)) for shape in want.shapes.values())
    assert got.bits_per_weight == round(8 * data / weights, 2) < want.bits_per_weight


@pytest.mark.parametrize("model", ["qwen3", "qwen3-moe"])
def test_an_fp8_checkpoint_serves_the_logits_of_its_dequantized_weights(tmp_path, model):
    """Guards the whole path (config, checkpoint, loader, forward) against reading an FP8 checkpoint as
    anything but its values: held in float32 the logits are those of the dequantized weights to the
    bit; held as int8 (a CPU's `auto`) within int8's own tolerance; and the certification gate's
    reference reads the same weights."""
    fp8, plain = fp8_pair(tmp_path, model, (16, 24))
    cfg = load_config(str(fp8))
    assert cfg.fp8 and dataclasses.replace(cfg, fp8=False) == load_config(str(plain))
    tokens = np.asarray(load_file(str(TINY / model / "reference.safetensors"))["tokens"])[:20]
    want = _logits(cfg, load_weights(str(plain), cfg, jnp.float32), tokens)
    np.testing.assert_array_equal(_logits(cfg, load_weights(str(fp8), cfg, jnp.float32), tokens), want)
    prompt = [int(t) for t in tokens]
    reference = certify.reference_logits(str(fp8), cfg, prompt)
    np.testing.assert_array_equal(reference, certify.reference_logits(str(plain), cfg, prompt))
    assert certify.compare("prefill", want[len(prompt) - 5], reference[-5], certify.TOLERANCE["float32"]) is None
    if model == "qwen3":      # a random tiny MoE's router flips experts on int8's rounding: dense only
        int8 = _logits(cfg, load_weights(str(fp8), cfg, "int8"), tokens)
        assert np.abs(int8 - want).max() < INT8_ATOL
        for at in range(len(prompt)):   # the gate's comparison, at every position
            assert certify.compare("prefill", int8[at], reference[at], certify.TOLERANCE["int8"]) is None


@pytest.mark.parametrize("model, block", [("qwen3", (32, 32)), ("qwen3", (16, 24)), ("qwen3-moe", (16, 16))])
def test_weights_dtype_fp8_holds_the_float8_matrices_and_computes_their_values(tmp_path, model, block):
    """Guards the held FP8 form (an accelerator's `auto`): every dense projection and routed expert the
    checkpoint stores as float8 stays float8, each row with its block scales through the loader's row
    operations (q/k/v grouped by KV head, gate and up interleaved, experts stacked), so the logits are
    the dequantized weights' (widened to float32 on a CPU: to the float32 rounding); blocks that do
    not divide the columns (16 x 24 of 64) get a scale per column; the memory plan counts the bytes
    held."""
    fp8, plain = fp8_pair(tmp_path, model, block)
    cfg = load_config(str(fp8))
    params = load_weights(str(fp8), cfg, "fp8")
    layer = params["layers"][0]
    for name in ("qkv", "o") + (("gate_up", "down") if "gate_up" in layer else ()):
        assert weight_kind(layer[name]) == "fp8", name
        assert layer[name]["f8"].dtype == jnp.float8_e4m3fn and layer[name]["f8_scale"].dtype == jnp.float32
    cols = layer["o"]["f8"].shape[1]
    assert layer["o"]["f8_scale"].shape[1] == (cols // block[1] if cols % block[1] == 0 else cols)
    assert weight_kind(params["embed"]) == "float"
    tokens = np.asarray(load_file(str(TINY / model / "reference.safetensors"))["tokens"])[:20]
    want = _logits(cfg, load_weights(str(plain), cfg, jnp.float32), tokens)
    # float32 sums in another order (per block, then scaled): measured up to 1.2e-5 on logits of ~5
    np.testing.assert_allclose(_logits(cfg, params, tokens), want, atol=2e-5, rtol=0)
    assert memory.held_weight_bytes(str(fp8), "fp8") == weights_bytes(params)
    if "moe" in layer:                         # the routed experts float8 too, stacked part by part
        for name in ("gate_up", "down"):
            held = layer["moe"][name]
            assert weight_kind(held) == "fp8" and held["f8"].shape[0] == cfg.num_experts, name
            assert held["f8_scale"].shape[:2] == held["f8"].shape[:2]
    assert held_note(Checkpoint(str(fp8)), params, "fp8").endswith("layer matrices)")


def test_fp8_is_auto_on_accelerators_for_an_fp8_checkpoint_and_refused_for_others(tmp_path):
    """Guards the choice of the held form: an FP8 checkpoint on an accelerator is held in float8 by
    default (half of bfloat16's bytes), a CPU keeps its own choice, and fp8 asked of a checkpoint
    without float8 matrices stops start-up in one line saying what to use."""
    fp8, plain = fp8_pair(tmp_path, "qwen3")
    assert weights_dtype_for("gpu", "auto", fp8=True) == "fp8"
    assert weights_dtype_for("gpu", "auto", fp8=False) == "bfloat16"
    assert weights_dtype_for("cpu", "auto", fp8=True) == weights_dtype_for("cpu", "auto")
    check_weights_dtype(load_config(str(fp8)), "fp8")
    with pytest.raises(ConfigError, match="fp8 holds an FP8 checkpoint's float8 matrices.*use int8 or bfloat16"):
        check_weights_dtype(load_config(str(plain)), "fp8")


def test_a_worker_holding_an_fp8_checkpoint_in_float8_is_certified(tmp_path):
    """Guards the served path with the float8 form (the worker's load, its compiled prefill and decode
    programs) against computing other than the certification gate's float64 reference."""
    from engine.worker import Engine, WorkerArgs
    fp8, _ = fp8_pair(tmp_path, "qwen3", (32, 32))
    engine = Engine(WorkerArgs("tiny", str(fp8), slots=1, ctx=64, prefix_cache=False, prefill_chunks=(8,),
                               compile_cache=None, weights_cache=None, certify_dir=None, dtype="fp8"))
    assert engine.certification == "certified", engine.certification_detail
    assert engine.facts.dtype == "fp8"
    projections = sum(1 for name in Checkpoint(str(fp8)).shapes if name.split(".")[-2] in PROJECTIONS)
    layers = load_config(str(fp8)).num_layers
    assert engine.start_notes == [f"{fp8}: {projections} matrices F8_E4M3 with block scales, held as they "
                                  f"are (float8, in {4 * layers} layer matrices)"]


def test_an_fp8_weight_without_its_scales_is_refused_by_name(tmp_path):
    fp8, _ = fp8_pair(tmp_path, "qwen3")
    tensors = {}
    with open(fp8 / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "BF16": ml_dtypes.bfloat16}[info["dtype"]]
        tensors[name] = np.frombuffer(data[start:end], dtype).reshape(info["shape"])
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    _write_safetensors(fp8 / "model.safetensors", tensors)
    with pytest.raises(ValueError, match="o_proj.weight is float8.*without its block scales"):
        Checkpoint(str(fp8))


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", None])
def test_other_quantization_methods_are_refused_naming_the_method(method):
    """Guards against a GPTQ/AWQ checkpoint's packed integers being read as weights (garbage answers)."""
    raw = json.loads((TINY / "qwen3" / "config.json").read_text())
    with pytest.raises(ConfigError, match=f"quant_method {method!r} is not served"):
        config_from_dict({**raw, "quantization_config": {"quant_method": method, "bits": 4}})
    fp8 = config_from_dict({**raw, "quantization_config": {"quant_method": "fp8"}})
    assert fp8.fp8 and dataclasses.replace(fp8, fp8=False) == config_from_dict(raw)


def test_a_worker_serving_an_fp8_checkpoint_as_int8_is_certified(tmp_path):
    """Guards against the served path (the worker's load, its compiled prefill and decode programs,
    int8 weights as a CPU with int8 dot products holds them by default) computing an FP8 checkpoint
    other than the certification gate's float64 reference of its values."""
    from engine.worker import Engine, WorkerArgs
    fp8, _ = fp8_pair(tmp_path, "qwen3", (16, 24))
    engine = Engine(WorkerArgs("tiny", str(fp8), slots=1, ctx=64, prefix_cache=False, prefill_chunks=(8,),
                               compile_cache=None, weights_cache=None, certify_dir=None, dtype="int8"))
    assert engine.certification == "certified", engine.certification_detail
    assert engine.facts.dtype == "int8" and engine.facts.bpw == Checkpoint(str(fp8)).bits_per_weight
    # Health's devices.kernel: what multiplies the int8 weights here
    assert engine.facts.kernel == (f"native {native.tier()}" if native.available() else "xla")
    projections = sum(1 for name in Checkpoint(str(fp8)).shapes if name.split(".")[-2] in PROJECTIONS)
    assert engine.start_notes == [f"{fp8}: {projections} matrices F8_E4M3 with block scales, "
                                  "rounded again to int8 per channel"]


def test_a_quantized_checkpoint_of_another_method_stops_start_up_naming_it(tmp_path, capsys):
    """Guards against a GPTQ folder's worker dying on its packed tensors and restarting forever: the
    server refuses it before any worker starts, in one line, exit status 1."""
    raw = json.loads((TINY / "qwen3" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128}}))
    shutil.copy(TINY / "qwen3" / "model.safetensors", tmp_path / "model.safetensors")
    import mashbox
    assert mashbox.main(["run", str(tmp_path), "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "quant_method 'gptq' is not served" in err and "FP8" in err and "GGUF" in err


def test_fp8_asked_of_a_checkpoint_without_float8_stops_start_up_in_one_line(capsys):
    """Guards against a worker started with nothing to hold in float8 (and restarted forever): the
    server refuses before any worker starts, saying what to use instead."""
    import mashbox
    assert mashbox.main(["run", str(TINY / "qwen3"), "--weights-dtype", "fp8", "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--weights-dtype fp8" in err and "use int8 or bfloat16" in err
