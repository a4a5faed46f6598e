"""Sizing a worker to the machine's memory (engine.memory) and the server refusing what cannot fit."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import mashbox
from engine import cpu, memory
from engine.config import load_config
from tests.harness import servable

TINY = os.path.join(os.path.dirname(__file__), "fixtures", "tiny", "qwen3")
GIB = 1 << 30
# The demo worker's resident memory with the defaults, at its peak, whatever the traffic (the
# README's "<= 3 GB" rows; docs/memory.md).
DEMO_WORKER_TARGET_BYTES = 3 * 10**9


def sized(available, slots=None, ctx=None, cache_ram_mib=None, on_host=True, defaults=(4, 32768, 2048)):
    """float32 weights (4 B per parameter), whatever this CPU's "auto" would hold."""
    return memory.size(load_config(TINY), TINY, slots=slots, ctx=ctx, cache_ram_mib=cache_ram_mib,
                       default_slots=defaults[0], default_ctx=defaults[1], default_cache_ram_mib=defaults[2],
                       available=available, on_host=on_host, weights_dtype="float32")


def test_the_formula_counts_weights_kv_cache_host_cache_and_runtime():
    """Guards against a sizing that forgets a term: weights (with the keys' smoothing factors) +
    slots x ctx x bytes per token + host cache + runtime, with the KV bytes of a key and a value per
    layer and KV head in the cache's dtype."""
    cfg = load_config(TINY)
    keys_and_values = len(cfg.layer_kinds) * 2 * cfg.num_kv_heads
    assert memory.kv_bytes_per_token(cfg, "float16") == keys_and_values * cfg.head_dim * 2
    # int8: a byte per element and a float32 scale per key or value (engine.cache)
    assert memory.kv_bytes_per_token(cfg, "int8") == keys_and_values * (cfg.head_dim + 4)
    per_token = memory.kv_bytes_per_token(cfg)         # what a worker on this CPU holds
    assert per_token == memory.kv_bytes_per_token(cfg, cpu.auto_kv_dtype())
    params = sum(a.size for a in load_file(os.path.join(TINY, "model.safetensors")).values())
    assert memory.parameter_count(TINY) == params
    plan = sized(100 * GIB)
    assert (plan.slots, plan.ctx, plan.cache_ram_mib, plan.shrunk) == (4, 32768, 2048, False)
    smoothing = len(cfg.layer_kinds) * cfg.num_kv_heads * cfg.head_dim * 4   # a float32 per key channel
    assert plan.total == params * 4 + smoothing + 4 * 32768 * per_token + (2048 << 20) + memory.RUNTIME_BYTES


def test_defaults_shrink_to_half_the_available_memory_host_cache_first():
    """Guards against defaults that do not fit a laptop beside a browser (the kernel then kills the
    worker later): the host cache gives way first, then the context down to 16k, then slots."""
    full = sized(100 * GIB)
    plan = sized(2 * (full.total - (1024 << 20)))           # half of it is 1 GiB short
    assert (plan.slots, plan.ctx, plan.cache_ram_mib, plan.shrunk) == (4, 32768, 1024, True)
    assert plan.total <= plan.available * memory.DEFAULT_MEMORY_SHARE
    plan = sized(2 * (full.total - (2048 << 20) - full.kv // 2))   # no host cache, and 16k tokens
    assert (plan.slots, plan.ctx, plan.cache_ram_mib) == (4, 16384, 0)
    plan = sized(2 * (full.total - (2048 << 20) - full.kv // 2 - full.kv // 8))
    assert (plan.slots, plan.ctx, plan.cache_ram_mib) == (3, 16384, 0)


def test_given_settings_are_kept_and_refused_with_the_numbers_when_they_cannot_fit():
    """Guards against an oversized request starting anyway and being OOM-killed mid-request, and
    against a refusal that does not say what to lower."""
    plan = sized(8 * GIB, slots=2, ctx=65536, cache_ram_mib=4096)
    assert (plan.slots, plan.ctx, plan.cache_ram_mib, plan.shrunk) == (2, 65536, 4096, False)
    with pytest.raises(memory.DoesNotFit) as refused:
        sized(8 * GIB, slots=64, ctx=131072, cache_ram_mib=6144)
    message = str(refused.value)
    for part in ("64 slots x 131072 tokens", "8.0 GiB available", "--slots", "--ctx", "--cache-ram"):
        assert part in message
    # On an accelerator the weights and KV cache are in device memory: only the host side counts.
    assert sized(8 * GIB, slots=64, ctx=131072, cache_ram_mib=6144, on_host=False).weights == 0


def test_the_server_refuses_to_start_a_worker_that_cannot_fit(monkeypatch, capsys):
    """Guards against `mashbox run` with too many slots starting a worker the kernel kills later."""
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 * GIB)
    monkeypatch.setattr(memory, "engine_on_host", lambda: True)
    started = []
    monkeypatch.setattr(mashbox.Bridge, "start", lambda self: started.append(self))
    code = mashbox.main(["run", TINY, "--port", "0", "--slots", "16", "--ctx", "131072"])
    assert code == 1 and not started
    err = capsys.readouterr().err
    assert "not enough memory" in err and "16 slots x 131072 tokens" in err and "1.0 GiB available" in err


def test_resident_bytes_reads_this_process():
    """Guards against a /proc parse that reports pages as bytes or the wrong field."""
    rss = memory.resident_bytes()
    assert 10 << 20 < rss < 64 * GIB
    assert memory.resident_bytes(2 ** 22 + 12345) is None or isinstance(memory.resident_bytes(2 ** 22 + 12345), int)


def test_the_server_lowers_its_defaults_to_the_memory_and_says_so(monkeypatch, caplog, tmp_path):
    """Guards against the defaults being taken as given (then never lowered) because the server
    fills in the context early for the model card."""
    full = sized(100 * GIB)
    # Half the available memory holds the defaults at 16k tokens and without a host cache.
    monkeypatch.setattr(memory, "available_bytes", lambda: 2 * (full.total - (2048 << 20) - full.kv // 2))
    monkeypatch.setattr(memory, "engine_on_host", lambda: True)
    real_resolve = mashbox.registry.resolve
    monkeypatch.setattr(mashbox.registry, "resolve", lambda *a: dataclasses.replace(
        real_resolve(*a), slots=4, ctx=32768, cache_ram_mib=2048))      # the defaults sized() uses
    started = []

    def start(bridge):
        started.append(bridge.worker_args)
        raise KeyboardInterrupt          # stop serve() here: the worker's arguments are what counts
    monkeypatch.setattr(mashbox.Bridge, "start", start)
    caplog.set_level("INFO")
    try:
        mashbox.main(["run", str(servable(Path(TINY), tmp_path / "tiny")), "--port", "0"])
    except KeyboardInterrupt:
        pass
    assert started and (started[0]["slots"], started[0]["ctx"], started[0]["cache_ram_mib"]) == (4, 16384, 0)
    assert any("defaults lowered" in r.getMessage() for r in caplog.records)


def test_a_hybrid_model_counts_kv_of_its_attention_layers_and_the_linear_state_of_each_slot():
    """Guards against sizing a hybrid model's linear layers as K/V (4x too much for Qwen3-Next) and
    against forgetting their per-slot state and the snapshots slots keep until they are saved."""
    from engine.scheduler import SLOT_SNAPSHOTS
    folder = os.path.join(os.path.dirname(TINY), "qwen3-next")
    cfg = load_config(folder)
    attention = cfg.layer_kinds.count("gated_attention")
    assert 0 < attention < len(cfg.layer_kinds)
    assert memory.kv_bytes_per_token(cfg, "float16") == attention * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    linear = cfg.layer_kinds.count("linear")
    state = linear * 4 * (cfg.linear_conv_dim * (cfg.linear_conv_kernel - 1)
                          + cfg.linear_value_heads * cfg.linear_key_dim * cfg.linear_value_dim)
    assert memory.slot_state_bytes(cfg) == state > 0
    args = dict(slots=3, ctx=1024, cache_ram_mib=64, default_slots=4, default_ctx=32768,
                default_cache_ram_mib=2048, available=100 * GIB, weights_dtype="float32")
    host = memory.size(cfg, folder, on_host=True, speculative="off", **args)
    assert host.total == memory.held_weight_bytes(folder, "float32") + 3 * (
        1024 * memory.kv_bytes_per_token(cfg) + state) + 3 * SLOT_SNAPSHOTS * state + (64 << 20) \
        + memory.RUNTIME_BYTES
    device = memory.size(cfg, folder, on_host=False, **args)
    assert device.total == 3 * SLOT_SNAPSHOTS * state + (64 << 20) + memory.RUNTIME_BYTES
    assert "slot snapshots 3 x" in host.describe()
    # Drafting's verification of 3 rows x 8 tokens holds what each position did to the linear
    # layers until the kept one is chosen; drafting runs on int8 weights only.
    assert memory.size(cfg, folder, on_host=True, speculative="auto", **args).total == host.total
    int8 = {**args, "weights_dtype": "int8"}
    drafting, plain = (memory.size(cfg, folder, on_host=True, speculative=mode, **int8) for mode in ("auto", "off"))
    step = linear * 4 * (cfg.linear_conv_dim + cfg.linear_value_heads * (cfg.linear_key_dim + 1 + cfg.linear_value_dim))
    assert drafting.total - plain.total == 3 * 4 * step        # a hybrid verifies 1 + 3 (verify_tokens)
    assert "a verification's linear steps" in drafting.describe()


def test_drafting_counts_the_mtp_layer_and_the_verification_steps_unless_off():
    """Guards against the memory plan missing what drafting holds (the MTP layer's weights and KV
    cache, what a verification's positions did to the linear layers until one is kept: other
    servers' users saw per-position rollback states blow up memory), and against those being whole
    states again: Qwen3.8-27B's are 151 MB a position, what the verification keeps about 4 MB."""
    from engine.checkpoint import MTP_PREFIX, Checkpoint
    folder = os.path.join(os.path.dirname(TINY), "qwen3-8")
    cfg = load_config(folder)
    args = dict(slots=2, ctx=512, cache_ram_mib=0, default_slots=4, default_ctx=32768,
                default_cache_ram_mib=0, available=100 * GIB, weights_dtype="int8", on_host=True)
    off, ngram, auto = (memory.size(cfg, folder, speculative=mode, **args) for mode in ("off", "ngram", "auto"))
    attention = cfg.layer_kinds.count("gated_attention")
    assert ngram.total - off.total == 2 * 4 * memory.verify_step_bytes(cfg) > 0
    checkpoint = Checkpoint(folder)
    mtp_weights = sum(int(np.prod(shape)) for key, shape in checkpoint.shapes.items() if key.startswith(MTP_PREFIX))
    assert mtp_weights > 0
    assert auto.total - ngram.total == mtp_weights + 2 * 512 * memory.kv_bytes_per_token(cfg) // attention
    big = dataclasses.replace(cfg, linear_value_heads=48, linear_key_heads=16, linear_key_dim=128,
                              linear_value_dim=128, layer_kinds=("linear",) * 48)
    assert 150e6 < memory.slot_state_bytes(big) < 160e6
    assert 4e6 < memory.verify_step_bytes(big) < 5e6


def test_a_folder_without_a_tokenizer_stops_start_up_naming_the_file(monkeypatch, capsys):
    """Guards against a weights-only folder loading, compiling and reporting ready, then failing in
    the event loop when the tokenizer is read (every request 503 from then on)."""
    started = []
    monkeypatch.setattr(mashbox.Bridge, "start", lambda self: started.append(self))
    assert mashbox.main(["run", TINY, "--port", "0"]) == 1 and not started
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"mashbox: {os.path.join(TINY, 'tokenizer.json')} is missing: a model folder holds its " \
                      "tokenizer beside config.json"


def test_the_demos_defaults_plan_its_worker_under_its_target_with_a_full_host_cache(demo_folder,
                                                                                  monkeypatch):
    """Guards against demo defaults whose host cache, once full, takes the worker past its target
    (2048 MiB did: 4.1 GiB planned, a 3.97 GiB peak after an hour of agent traffic). Planned as on
    a CPU with int8 dot products, where the defaults hold int8 weights and an int8 cache."""
    flags = cpu.flags() | {"avx512_vnni"}
    monkeypatch.setattr(cpu, "flags", lambda: flags)
    spec = mashbox.registry.resolve(mashbox.registry.default_id())
    plan = memory.size(load_config(demo_folder), demo_folder, slots=None, ctx=None, cache_ram_mib=None,
                       default_slots=spec.slots, default_ctx=spec.ctx,
                       default_cache_ram_mib=spec.cache_ram_mib, available=100 * GIB, on_host=True)
    assert (plan.slots, plan.ctx, plan.shrunk) == (4, 32768, False)
    assert plan.total <= DEMO_WORKER_TARGET_BYTES, plan.describe()


def _huge_pages_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) << 10
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_arena_lays_arrays_end_to_end_from_a_huge_pages_start():
    """Guards against weights copied wrong or misaligned (XLA then copies them back into its own
    4 KB pages), and against one mapping per array (its unused tail resident for every weight)."""
    arena = memory.HugePageArena(arena_bytes=8 << 20)
    rng = np.random.default_rng(0)
    first = rng.integers(-128, 127, size=(100, 33), dtype=np.int8)
    second = rng.standard_normal((7, 5)).astype(np.float32)
    a, b = arena.copy(first), arena.copy(second)
    np.testing.assert_array_equal(a, first)
    np.testing.assert_array_equal(b, second)
    assert a.ctypes.data % memory.HUGE_PAGE == 0
    assert b.ctypes.data == a.ctypes.data + -(-first.nbytes // memory.HUGE_ALIGN) * memory.HUGE_ALIGN
    large = arena.copy(np.ones(9 << 20, np.uint8))             # larger than a mapping: its own
    assert large.ctypes.data % memory.HUGE_PAGE == 0 and int(large.sum()) == 9 << 20
    after = arena.copy(second)                                  # and the next one goes on after it
    assert after.ctypes.data == large.ctypes.data + (9 << 20)


@pytest.mark.skipif(_huge_pages_mode() not in ("always", "madvise") or not Path("/proc/self/smaps").exists(),
                    reason="transparent huge pages are off here")
def test_huge_page_arena_memory_is_in_huge_pages():
    """Guards against the advice not reaching the mapping (the kernel then maps 4 KB pages and a
    decode step's weight stream pays a translation miss every 4 KB)."""
    arena = memory.HugePageArena(arena_bytes=16 << 20)
    a = arena.copy(np.ones(8 << 20, np.uint8))
    assert _anon_huge_bytes(a.ctypes.data) >= memory.HUGE_PAGE


def test_a_large_weight_on_a_cpu_device_is_read_where_the_arena_holds_it(monkeypatch):
    """Guards against jax copying the weight back into its own heap (the huge pages then unused and
    the weight's bytes held twice while it loads), and against the weight's memory unmapped under a
    live array once the loader and the arena drop their references."""
    import gc

    import jax

    from engine import weights
    if jax.default_backend() != "cpu":
        pytest.skip("the arena serves a CPU device")
    arena = memory.HugePageArena(arena_bytes=4 << 20)
    monkeypatch.setattr(weights, "_huge_pages", arena)
    source = np.arange(memory.HUGE_MIN_BYTES // 4 + 3, dtype=np.float32)
    placed = weights.on_device(source)
    second = weights.on_device(source[::-1].copy())             # at the next HUGE_ALIGN boundary
    step = -(-source.nbytes // memory.HUGE_ALIGN) * memory.HUGE_ALIGN
    assert placed.unsafe_buffer_pointer() % memory.HUGE_PAGE == 0
    assert second.unsafe_buffer_pointer() - placed.unsafe_buffer_pointer() == step
    monkeypatch.setattr(weights, "_huge_pages", memory.HugePageArena())
    del arena
    gc.collect()
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda w: w * 2)(placed)), source * 2)
    np.testing.assert_array_equal(np.asarray(second), source[::-1])
    small = weights.on_device(np.ones(16, np.float32))          # stays in XLA's heap
    assert float(small.sum()) == 16


def test_the_workers_placement_on_one_cpu_device_keeps_the_weight_in_the_arena(monkeypatch):
    """Guards against the worker's placement (engine.sharding.Layout.place, which gives each weight
    its mesh sharding) copying an arena's weight back into XLA's heap: the decode step would then
    read 4 KB pages again, and the weight's bytes would be held twice while it loads."""
    import jax

    from engine import sharding, weights
    from engine.config import load_config
    if jax.default_backend() != "cpu":
        pytest.skip("the arena serves a CPU device")
    arena = memory.HugePageArena(arena_bytes=8 << 20)
    monkeypatch.setattr(weights, "_huge_pages", arena)
    source = np.arange(2 << 20, dtype=np.int32).astype(np.int8).reshape(2048, 1024)
    placed = sharding.Layout.build(load_config(TINY), 1).place("layers.0.qkv", source)
    after = arena.copy(np.zeros(1, np.uint8))
    assert after.ctypes.data - placed.unsafe_buffer_pointer() == source.nbytes
    np.testing.assert_array_equal(np.asarray(placed), source)
