"""Tensor parallelism inside one worker: one model instance over N devices of one mesh.

    check_devices(cfg, n)          the KV heads the model lays out on n devices, or DevicesError
    Layout.build(cfg, devices)     the mesh, the config the programs are traced with, and the
                                   sharding of every weight and cache array

One mesh axis, MODEL_AXIS, over the N devices. The weights and the cache are split along it where
they are created (engine.weights places each tensor straight into its shards; the cache is made
as zeros already split), the compiled programs take them as they are, and XLA's SPMD partitioner
inserts the collectives: an all-reduce after each product whose input is split (attention's and the
Gated DeltaNet layers' output projections, the MLP's and the shared expert's down projections) and
after the vocabulary-split embedding lookup; the logits leave the forward split by vocabulary, as
the sampler takes them. Activations (the residual stream) are replicated.

Routed experts are split whole (expert parallelism): each device holds num_experts / N consecutive
experts, and the routed sum runs inside jax.shard_map (engine.moe._per_device): every device
routes all rows (the router is replicated), computes the picks that fall in its own experts, and a
psum adds the devices' partial sums. The partitioner is not asked to serve a run-time expert index
on a split axis (it would gather every expert onto every device). Those all-reduces, of
[rows, hidden] arrays, are the only cross-device operations in the compiled programs
(tests/test_sharding.py reads them, prefill and decode).

What is split where is decided here only, in PARAM_SPECS and CACHE_SPECS: parameter path (the
layer index written *) -> how each dimension is split (MODEL_AXIS) or not (None); an empty tuple is
replicated. Each entry can be checked against engine.model and engine.weights's layout: stacked
projections are laid out so that a block of rows is whole heads or whole channels (KV groups in
"qkv", gate and up interleaved in "gate_up", key heads with their value heads in a Gated DeltaNet
layer's "in" and "conv").

Which counts work (check_devices): N must divide the attention heads, the MLP and shared-expert
channels and the routed experts (a count that does not is refused, with the counts that work: the
experts are not split by channel instead); the KV heads must divide N or be divided by it (fewer
than N: each is repeated). The Gated DeltaNet layers split by key head when N divides the key heads
(Qwen3-Next-80B's 16), else they and their state stay replicated (linear_splits).

Several hosts (jax.distributed, init_distributed): each process brings its --devices devices and
the mesh spans all of them; every process must then run the same programs on the same inputs
(engine.mirror sends process 0's calls to the others), and reads a split result with to_host.

This module imports jax only where it builds the mesh: the server checks --devices against the
model's config.json without importing jax.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re

import numpy as np

from engine.config import ConfigError, ModelConfig

MODEL_AXIS = "model"
M = MODEL_AXIS

PARAM_SPECS: dict[str, tuple] = {
    # [vocab, hidden]: by vocabulary (when the vocabulary divides evenly, else replicated). The
    # embedding is a row gather; the head's logits come out split by vocabulary.
    "embed": (M, None),
    "lm_head": (M, None),
    "norm": (),
    "layers.*.attn_norm": (),
    "layers.*.mlp_norm": (),
    # [rows grouped by KV head, hidden]: whole KV groups per device, each with its query heads,
    # key and value (engine.weights.group_qkv), so attention runs on each device's own heads.
    "layers.*.qkv": (M, None),
    "layers.*.qkv_bias": (M,),
    "layers.*.k_smooth": (M, None),                  # [KV, head_dim]: with its KV head
    "layers.*.q_norm": (),                           # [head_dim]: the same for every head
    "layers.*.k_norm": (),
    "layers.*.o": (None, M),                         # [hidden, query heads x head_dim]
    # [intermediate channels, gate and up interleaved, hidden] and [hidden, intermediate].
    "layers.*.gate_up": (M, None),
    "layers.*.down": (None, M),
    # Routed experts [experts, ...]: whole experts per device, device d the consecutive block
    # d * E/N .. (d + 1) * E/N - 1 (expert parallelism: engine.moe._per_device computes each
    # device's own picks inside shard_map).
    "layers.*.moe.router": (),
    "layers.*.moe.gate_up": (M, None, None),
    "layers.*.moe.down": (M, None, None),
    "layers.*.moe.shared.gate_up": (M, None),
    "layers.*.moe.shared.down": (None, M),
    "layers.*.moe.shared.gate": (),                  # [1, hidden]
    # Gated DeltaNet layers, by key head (each with the value heads it serves), when the device
    # count divides the key heads (else replicated: Layout.linear_split). engine.weights lays out
    # "in" [rows, hidden] and "conv" [channels, kernel] grouped by key head (group_by_key_head:
    # each key head's q, k, then its value heads' v, z, b, a rows; the conv's q, k, v channels
    # reordered from the checkpoints' all-q, all-k, all-v), so a block of rows is whole key heads.
    "layers.*.linear.in": (M, None),
    "layers.*.linear.conv": (M, None),
    "layers.*.linear.A_log": (M,),                   # [value heads]
    "layers.*.linear.dt_bias": (M,),
    "layers.*.linear.norm": (),                      # [value_dim]: the same for every head
    "layers.*.linear.out": (None, M),                # [hidden, value heads x value_dim]
}
# Names of PARAM_SPECS's vocabulary-split entries.
VOCAB_SPLIT = ("embed", "lm_head")
# The cache (engine.cache): K and V [slots, kv_heads, head_dim, ctx] and an int8 cache's scales
# [slots, kv_heads, ctx] by KV head, as "qkv" computes them; a Gated DeltaNet layer's conv state
# [slots, channels grouped by key head, kernel - 1] and recurrent state [slots, value heads, key_dim,
# value_dim] by key head, like its weights (replicated with them when they are).
CACHE_SPECS: dict[str, tuple] = {
    "k": (None, M, None, None),
    "v": (None, M, None, None),
    "k_scale": (None, M, None),
    "v_scale": (None, M, None),
    "conv": (None, M, None),
    "state": (None, M, None, None),
    "hidden": (),              # the MTP layer's carry [slots, hidden] (engine.cache): on every device
}
# CACHE_SPECS's entries of the Gated DeltaNet layers (split or replicated with their weights).
LINEAR_STATE = ("conv", "state")
# int8 weight-only matrices are {"q": [out, in], "scale": [out]}: "q" is split like the float
# matrix, and the scales go with their output rows (replicated when the rows are not split).
INT8_PARTS = ("q", "scale")
# A GGUF's 5-bit matrices (engine.native.pack5) are held only on one device (the kernel is not
# split): their parts, each with the output blocks first, follow the matrix's output axis.
INT5_PARTS = ("nib", "fifth", "d")
# And so are its Q8_0 matrices (engine.native.pack8).
Q8_PARTS = ("q8", "q8_d")
# And so are its K-quant matrices (engine.native.pack_k).
K_PARTS = ("knib", "kfifth", "khi", "ksc", "kmin", "kd", "kdmin")
# And so are its IQ4_NL, IQ4_XS, IQ3_S and Q3_K matrices (engine.native.pack_s).
S_PARTS = ("iq4nl", "iq4nl_d", "iq4xs", "iq4xs_sc", "iq4xs_d", "iq3s", "iq3s_sc", "iq3s_d",
           "q3k", "q3k_third", "q3k_sc", "q3k_d")
# A matrix held per part (engine.weights.PER_PART) exists only where those do: one device, whole.
PER_PART_KEY = re.compile(r"\.(parts\.\*\..*|rows|cols)$")
# FP8 matrices are {"f8": [out, in], "f8_scale": [out, in / block]}: both split like the float matrix
# (each row's scales per block of columns go with its columns when those are split).
FP8_PARTS = ("f8", "f8_scale")


# jax.distributed's settings, read from the environment when no flag gives them: the coordinator's
# host:port (process 0 listens there), how many processes, and this one's index.
DISTRIBUTED_ENV = ("MASHBOX_COORDINATOR", "MASHBOX_NUM_PROCESSES", "MASHBOX_PROCESS_ID")
# Collectives between processes on a CPU: gloo (TCP), which jaxlib ships; accelerators use their own.
CPU_COLLECTIVES = "gloo"


class DevicesError(ConfigError):
    """The model cannot be split over the devices asked for: the message says why, and what works."""


def _problems(cfg: ModelConfig, n: int) -> list[str]:
    """Why the model cannot be split n ways (empty: it can)."""
    out = []
    if cfg.num_heads % n:
        out.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        out.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
    mlp_kinds = cfg.mlp_kinds or ("dense",) * cfg.num_layers
    widths = [("MLP channels", cfg.intermediate_size, "dense"),
              ("routed experts", cfg.num_experts, "moe"),
              ("shared-expert channels", cfg.shared_expert_intermediate_size, "moe")]
    for what, width, kind in widths:
        if kind in mlp_kinds and width and width % n:
            out.append(f"{width} {what}")
    return out


def check_devices(cfg: ModelConfig, n: int, available: int | None = None) -> int:
    """The KV heads the model lays out on n devices: its own, or n when there are fewer (each KV
    head is then repeated so that every device holds the one its query heads read). Raises
    DevicesError when n does not divide the heads, the MLP channels or the routed experts."""
    if n < 1:
        raise DevicesError(f"--devices must be at least 1, got {n}")
    problems = _problems(cfg, n)
    if problems:
        upto = available or max(cfg.num_heads, n)
        fits = [str(m) for m in range(1, upto + 1) if not _problems(cfg, m)]
        raise DevicesError(f"--devices {n} does not divide the model's {', '.join(problems)}; it "
                           f"splits over {', '.join(fits)} device(s)"
                           + (f" (of the {available} here)" if available else ""))
    return max(cfg.num_kv_heads, n)


def linear_splits(cfg: ModelConfig, n: int) -> bool:
    """Whether the Gated DeltaNet layers split over n devices: by key head, so n must divide the
    key heads (the value heads, a multiple of them, then divide too). Else they stay replicated
    (every device computes them whole)."""
    return cfg.linear_key_heads % n == 0 if "linear" in cfg.layer_kinds else True


def spec_of(path: str) -> tuple:
    """PARAM_SPECS's entry for a parameter path ("layers.3.qkv", "layers.3.qkv.scale")."""
    key = re.sub(r"\.\d+(\.|$)", r".*\1", path)
    if key in PARAM_SPECS:
        return PARAM_SPECS[key]
    if PER_PART_KEY.search(key) and PER_PART_KEY.sub("", key) in PARAM_SPECS:
        return ()
    base, _, part = key.rpartition(".")
    if part in INT8_PARTS + INT5_PARTS + Q8_PARTS + K_PARTS + S_PARTS + FP8_PARTS and base in PARAM_SPECS:
        spec = PARAM_SPECS[base]
        return spec if part in ("q",) + FP8_PARTS else spec[:1]
    raise KeyError(f"no partition spec for parameter {path!r}: add it to engine.sharding.PARAM_SPECS")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One model instance's mesh: `cfg` is the config the programs are traced with (its
    num_kv_heads as laid out, see check_devices)."""
    mesh: object                      # jax.sharding.Mesh, one axis MODEL_AXIS
    cfg: ModelConfig
    vocab_split: bool
    linear_split: bool = True         # Gated DeltaNet layers split by key head (linear_splits)

    @classmethod
    def build(cls, cfg: ModelConfig, devices: int | str = 1) -> "Layout":
        """devices: how many of this process's devices ("all": every one). With several processes
        (jax.distributed), each brings that many and the mesh spans all of them."""
        import jax
        from jax.sharding import Mesh

        from engine import native
        from engine.model import runs_layered

        local = jax.local_devices()
        n = len(local) if devices == "all" else int(devices)
        if n > len(local):
            raise DevicesError(f"--devices {n}: this process sees {len(local)} "
                               f"{jax.default_backend()} device(s)")
        chips = [d for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)[:n]]
        kv_heads = check_devices(cfg, len(chips), available=len(local) * jax.process_count())
        return cls(Mesh(np.array(chips), (MODEL_AXIS,)),
                   dataclasses.replace(cfg, num_kv_heads=kv_heads, devices=len(chips),
                                       native=native.serves(len(chips)),
                                       layered=runs_layered(cfg, jax.default_backend(), len(chips))),
                   cfg.vocab_size % len(chips) == 0, linear_splits(cfg, len(chips)))

    @property
    def devices(self) -> int:
        return self.mesh.size

    def describe(self) -> dict:
        """What Health and the log say: the device count, platform, mesh axes, processes, KV heads."""
        chips = list(self.mesh.devices.flat)
        return {"count": self.devices, "platform": chips[0].platform, "mesh": dict(self.mesh.shape),
                "processes": len({d.process_index for d in chips}), "kv_heads": self.cfg.num_kv_heads}

    def sharding(self, spec: tuple):
        from jax.sharding import NamedSharding, PartitionSpec
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def param_sharding(self, path: str):
        spec = spec_of(path)
        if path.split(".")[0] in VOCAB_SPLIT and not self.vocab_split:
            spec = ()
        if ".linear." in path and not self.linear_split:
            spec = ()
        return self.sharding(spec)

    def place(self, path: str, tree):
        """A subtree of numpy arrays (engine.weights's `place`) as jax arrays, each device given
        only its own shard: no device ever holds a whole split tensor. On one device each is placed
        whole (engine.weights.on_device: a CPU's large weights in huge pages)."""
        import jax

        from engine.weights import on_device

        def one(key_path, array):
            name = ".".join([path] + [str(k.key) for k in key_path])
            if self.devices == 1:
                return jax.device_put(on_device(array), self.param_sharding(name))
            return jax.make_array_from_callback(array.shape, self.param_sharding(name),
                                                lambda index: array[index])
        return jax.tree_util.tree_map_with_path(one, tree)

    def cache_zeros(self, name: str, shape: tuple, dtype):
        """A zero cache array (engine.cache.init_cache's `zeros`), made already split on the devices."""
        spec = () if name in LINEAR_STATE and not self.linear_split else CACHE_SPECS[name]
        return _zeros_program(self.sharding(spec), tuple(shape), np.dtype(dtype))()

    def replicate(self, tree):
        """Small state every device reads whole (the sampler's), on every device of the mesh."""
        import jax
        return jax.device_put(tree, self.sharding(()))


@functools.lru_cache(maxsize=None)
def _zeros_program(sharding, shape: tuple, dtype):
    """One program per cache array shape (every layer's K shares it): a fresh one per layer would
    be compiled again, or loaded again from the persistent cache."""
    import jax
    import jax.numpy as jnp
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def to_host(tree):
    """A tree of jax arrays as numpy. An array split over several processes' devices is gathered
    from all of them: a collective, so every process of the mesh must make the same call (the
    worker's device calls do, engine.worker.device_call); a replicated one is read here."""
    import jax

    def one(array):
        if not isinstance(array, jax.Array) or array.is_fully_addressable or array.is_fully_replicated:
            return np.asarray(array)
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return jax.tree_util.tree_map(one, tree)


def distributed_settings(coordinator: str | None = None, processes: int | None = None,
                         process_id: int | None = None) -> tuple[str, int, int] | None:
    """(coordinator, processes, process id) from the arguments, else DISTRIBUTED_ENV; None when no
    coordinator is named (one process). A partial or inconsistent setting is a DevicesError."""
    env = [os.environ.get(name) or None for name in DISTRIBUTED_ENV]
    coordinator = coordinator or env[0]
    if not coordinator:
        return None
    try:
        processes = int(processes if processes is not None else env[1])
        process_id = int(process_id if process_id is not None else env[2])
    except (TypeError, ValueError):
        raise DevicesError(f"a coordinator ({coordinator}) needs the process count and this process's id "
                           f"as integers (--num-processes/--process-id or {DISTRIBUTED_ENV[1]}/"
                           f"{DISTRIBUTED_ENV[2]})") from None
    if processes < 1 or not 0 <= process_id < processes:
        raise DevicesError(f"process id {process_id} is not one of {processes} process(es)")
    return coordinator, processes, process_id


def init_distributed(settings: tuple[str, int, int] | None) -> None:
    """Join the other processes of the mesh (jax.distributed), before this process touches a device."""
    if settings is None:
        return
    import jax
    coordinator, processes, process_id = settings
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes,
                               process_id=process_id)
    # Starting the backend exchanges every process's devices through the coordinator: start it now,
    # before this process waits for another one on anything else (which would then wait for this).
    jax.devices()
