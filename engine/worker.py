"""The engine worker: the process that owns the device.

    main(conn, args)                                the process body: pipe <-> Engine
                                                    (mashbox.spawn_worker starts it, with one BLAS thread)
    Engine(args)                                    the same engine in-process, no pipe (tests, bench)

Engine.step() is one round: schedule -> run the model (one prefill chunk, one decode step of every
live slot) -> sample -> postprocess -> Steps. Every program a request can run is compiled before
Ready (warm-up), so a compile after Ready is a bug; they are counted and reported in Stats.

Several hosts (jax.distributed, WorkerArgs.distributed): process 0's worker runs main() behind the
server and sends every device call to the other processes' workers, which run follow(): the
methods marked device_call are the only code that runs programs, so the processes cannot drift
apart (engine.mirror).

MASHBOX_FAULT makes the process exit abruptly at a chosen point, for tests of the server's recovery:
"warmup", "prefill", "first-token", or "decode:N" (at the N-th decode step). Off unless set.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import numpy as np

from engine import (certify, grammar, identity, memory, mirror, native, prefix, products, sampler,
                    sharding, speculative)
from engine.checkpoint import MTP_PREFIX, MTP_TENSOR, Checkpoint
from engine.cache import (copy_prefix, has_state, host_block, init_cache, keep_steps, position_bytes,
                          read_slot, read_state, warm_host_copies, warm_state_copies, write_slot,
                          write_state)
from engine.config import CHAT_FORMAT, check_weights_dtype, load_config
from engine.attention import kv_dtype_for
from engine.model import (DELTA_STEPS_ENV, delta_by_steps, dtype_for, jit_draft, jit_forward, layer_parameters,
                          weights_dtype_for)
from engine.moe import routed_report
from engine.protocol import (Cancel, Fault, Loading, ModelFacts, Note, Ready, Shutdown, Stats, Step,
                             Submit)
from engine.registry import cache_root
from engine.scheduler import (PREFILL_CHUNKS, VERIFY_MAX_ROWS, Buckets, Decode, Prefill, Sequence,
                              Scheduler, verify_tokens)
from engine.weights import held_key, held_note, load_mtp, load_weights, packs_int8, unread_notes, weights_bytes

# Every program goes to the persistent compile cache, however quick its compile: a restarted worker
# then loads all of them and compiles none (dozens of quick compiles still add up to seconds).
COMPILE_CACHE_MIN_SECONDS = 0.0
# A program the cache has not handed out for this long is deleted when a worker starts: each upgrade,
# flag or model change writes a new set (tens of MB) and jax bounds the folder only with a package we
# do not ship. A month outlasts any schedule of restarts; a program deleted too soon compiles again.
COMPILE_CACHE_KEEP_DAYS = 30
JAX_CACHE_SUFFIX = "-cache"       # how jax names a program's file: nothing else in the folder is deleted
# Exit status of an injected fault (MASHBOX_FAULT): distinct from a crash's usual 1.
FAULT_EXIT_CODE = 70
# While busy, Stats go out at most this often unless the number of rows or waiting requests changed.
STATS_INTERVAL_S = 1.0
# With only requests whose grammar is compiling, a round waits this long for one (the pipe is read
# between rounds, so a Cancel is not kept waiting).
GRAMMAR_POLL_S = 0.05
# Runs of each decode and verification program timed at warm-up for drafting's first estimate (the
# fastest counts): one run's time on a shared host can be twice the program's.
TIMING_RUNS = 3


@dataclass
class WorkerArgs:
    model_id: str
    weights_folder: str                   # config.json, tokenizer and weights (safetensors or a GGUF)
    slots: int = 4
    ctx: int = 4096
    cache_ram_mib: int = 0                # host memory for saved prompt states (MiB; 0 = off)
    prefix_cache: bool = True
    chat_format: str | None = None        # one of engine.chat.FORMATS; None: from the model family
    # weights dtype: one of engine.weights.WEIGHTS_DTYPES (float32, bfloat16, int8, fp8; random
    # weights' block forms are drawn as a GGUF's and held as int8 names them); None or "auto": by
    # platform (engine.model.weights_dtype_for)
    dtype: str | None = None
    kv_dtype: str | None = None           # the KV cache's dtype; None: by platform (kv_dtype_for)
    # Devices the model is split over (engine.sharding: tensor parallel), or "all" of the platform's.
    devices: int | str = 1
    prefill_chunks: tuple[int, ...] = PREFILL_CHUNKS
    # Where compiled programs are kept between runs (a compile per shape costs seconds on CPU): jax's
    # own JAX_COMPILATION_CACHE_DIR where it is set, else beside the other caches; None: off.
    compile_cache: str | None = field(
        default_factory=lambda: os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(cache_root() / "jax"))
    # int8 weights as they are held, so a restart or the next start does not quantize again
    # (engine.weights.HeldWeights); None: quantize at every start
    weights_cache: str | None = field(default_factory=lambda: str(cache_root() / "weights"))
    cache_namespace: str | None = None    # None: computed here (prefix.namespace_id)
    # The certification gate: where its results are recorded (None: never), whether to run it even
    # when a result is recorded, and the golden greedy answer models.json records ({prompt, answer}).
    certify_dir: str | None = field(default_factory=lambda: str(cache_root() / certify.RECORD_DIR))
    recertify: bool = False
    golden: dict | None = None
    # (coordinator host:port, processes, this process's id) of a jax.distributed group (several
    # hosts, engine.sharding.distributed_settings); None: this process alone.
    distributed: tuple | None = None
    # Drafts from the conversation's own text, verified in one call (engine.speculative): "auto"
    # where it is exact and pays, or "off".
    speculative: str = "auto"


# What a follower keeps of its own arguments: where things are on its host, and who it is. Every
# other field comes from the leader, so that both build the same programs.
HOST_FIELDS = ("weights_folder", "compile_cache", "weights_cache", "certify_dir", "distributed")


# ---- fault injection ---------------------------------------------------------------------------

class _Faults:
    """MASHBOX_FAULT, read once: at(point) exits the process when that point is the one named."""

    def __init__(self, spec: str):
        name, _, count = spec.partition(":")
        self.point = name.strip()
        self.count = int(count) if count.strip().isdigit() else 1
        self.seen = 0

    def at(self, point: str) -> None:
        if point != self.point:
            return
        self.seen += 1
        if self.seen >= self.count:
            os._exit(FAULT_EXIT_CODE)


# ---- compile counting --------------------------------------------------------------------------

_compiles = 0


def _count_compile(event: str, *_args, **_kwargs) -> None:
    global _compiles
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compiles_so_far() -> int:
    """Programs compiled (or loaded from the persistent cache) in this process so far."""
    return _compiles


# What compiling one model program takes of the host's memory, per layer it holds (XLA's graph and
# LLVM's buffers: a 64-layer program of the 27B about 2 GB), with room for the estimate to be low.
COMPILE_BYTES_PER_LAYER = 32 << 20
COMPILE_MEMORY_MARGIN = 2


def compile_threads(layers: int) -> int:
    """How many programs of `layers` layers compile at once: one per core, as many as the memory
    left beside the weights and the cache allows (a 27B held in 16 GB of a 24 GB host compiles one
    at a time: two at once took its worker past 20 GB)."""
    cores = max(1, os.cpu_count() or 1)
    free = memory.available_bytes()
    if free is None:
        return cores
    return max(1, min(cores, free // (COMPILE_MEMORY_MARGIN * COMPILE_BYTES_PER_LAYER * max(1, layers))))


def _compile_together(calls, done=None, then=None, threads: int | None = None) -> None:
    """Compile jitted calls [(function, args, static kwargs)] at once, `threads` at a time (one per
    core by default): XLA releases the GIL while it compiles, and jit keeps each compiled program for
    the call that runs it later (or the persistent cache serves it). Arguments are only looked at
    (shapes, dtypes and shardings, which a donated array keeps), never consumed. then(i) runs in this
    thread, in the calls' order, as soon as call i's program is ready, while the pool still compiles
    the rest: every process of a multi-host group runs its programs in the same order."""
    with ThreadPoolExecutor(threads or max(1, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(lambda c=c: c[0].lower(*c[1], **c[2]).compile()) for c in calls]
        for i, future in enumerate(futures):        # progress is reported from this thread only
            future.result()
            if done is not None:
                done()
            if then is not None:
                then(i)


# ---- device calls ------------------------------------------------------------------------------

DEVICE_CALLS: set[str] = set()


def device_call(method):
    """Marks an Engine method that runs programs on the devices: the only code that may. Its
    arguments are host values (numpy, ints, small trees), what it returns is too, and it reads and
    replaces the engine's device state (params, cache, sampler state) only. With several processes
    the leader's engine sends each call's name and arguments to the followers before running it,
    and each follower's engine runs the same method (engine.mirror): one list of calls for all. A
    call made inside another is run by the followers inside theirs already: it is not sent."""
    DEVICE_CALLS.add(method.__name__)

    @functools.wraps(method)
    def call(self, *args):
        if self.mirror is not None and not self._in_call:
            self.mirror.send(method.__name__, args)
        outer, self._in_call = self._in_call, True
        try:
            return method(self, *args)
        finally:
            self._in_call = outer
    return call


_compile_cache_folder: str | None = None     # the process's persistent compile cache, once set


def _use_compile_cache(folder: str | None) -> tuple[int, int]:
    """Every program goes to the persistent compile cache in `folder` (None: no persistent cache).
    jax opens its cache once per process, in the folder set at its first compile, yet hashes the
    folder set at each compile into the program's key (the GPU autotuning folder it derives from it):
    a second folder in the same process (a test's, a bench's engines) would write every program under
    a key no later run finds again. So the first folder stays for the process. Returns what
    forget_unused_programs deleted there (nothing after the first call)."""
    global _compile_cache_folder
    if not folder or _compile_cache_folder is not None:
        return 0, 0
    _compile_cache_folder = folder
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", COMPILE_CACHE_MIN_SECONDS)
    if "://" in folder:           # a store jax reaches itself (JAX_COMPILATION_CACHE_DIR=gs://...)
        return 0, 0
    os.makedirs(folder, exist_ok=True)
    return forget_unused_programs(folder)


def forget_unused_programs(folder: str, keep_days: float = COMPILE_CACHE_KEEP_DAYS) -> tuple[int, int]:
    """Delete the compile cache's programs (jax's files, named *-cache) last read or written more
    than `keep_days` ago; returns (files, bytes) deleted. A read is the file's access time, which
    Linux's default mount option (relatime) moves at least once a day; where access times are off, a
    program in use is deleted once a month and compiled again. Only whole, old files go: jax writes a
    program once and then only reads it, and a reader that has one open keeps it to the end."""
    cutoff, files, size = time.time() - keep_days * 86400, 0, 0
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                stat = entry.stat(follow_symlinks=False)
                if (entry.name.endswith(JAX_CACHE_SUFFIX) and entry.is_file(follow_symlinks=False)
                        and max(stat.st_atime, stat.st_mtime) < cutoff):
                    os.unlink(entry.path)
                    files, size = files + 1, size + stat.st_size
            except OSError:
                pass            # gone already (another server's worker), or not ours to delete
    return files, size


# ---- the engine --------------------------------------------------------------------------------

class Engine:
    """The model, its cache and the scheduler, driven one round at a time. Not thread-safe."""

    def __init__(self, args: WorkerArgs, progress=None, follower: bool = False, on_lost=None):
        """Start-up, step by step. follower: a follower of a jax.distributed group (follow()): load
        the weights and make the cache, then stop; the leader's calls do the rest (the warm-up among
        them). on_lost(why): a follower is gone (engine.mirror.Leader; by default the process says why
        and exits)."""
        self.progress = progress or (lambda phase, done, total: None)
        self.args = args
        self.faults = _Faults(os.environ.get("MASHBOX_FAULT", ""))
        self.mirror: mirror.Leader | None = None
        self._in_call = False
        self.start_notes: list[str] = []          # for the server's log, once (take_notes)
        files, size = _use_compile_cache(args.compile_cache)
        if files:
            self.start_notes.append(f"deleted {files} compiled programs ({size / 1e6:.0f} MB) unused for "
                                    f"{COMPILE_CACHE_KEEP_DAYS} days from {args.compile_cache}")
        if args.devices == 1:             # the kernel is not split over a mesh (native.serves)
            native.prepare()              # a first start builds it beside what follows
        self._lay_out()
        if jax.process_count() > 1 and not follower:     # before the weights: followers load theirs meanwhile
            self._gather_followers(on_lost)
        reference = None if follower else self._gate_reference()
        self._load_weights()
        self._make_pool()
        if follower:
            return
        self._make_scheduler()
        t0 = time.time()
        self._warm_up(self.host is not None, bool(self.scheduler.snapshots))
        compile_s = time.time() - t0
        self.deployment_id = self._deployment_id()
        self.progress("certify", 0, 1)
        # The server logs the outcome from the facts (Ready), the reason with it.
        self.certification, self.certification_detail = certify.gate(
            self, args.certify_dir, args.recertify, args.golden, reference)
        self.progress("certify", 1, 1)
        self.late_compiles = 0            # programs compiled inside step() since ready
        self.facts = self._facts(compile_s)
        memory.release_free_heap()   # what start-up freed (the float checkpoint, the gate's reference)

    # -- start-up ---------------------------------------------------------------------------------

    def _lay_out(self) -> None:
        """The checkpoint's config, and the one the programs run: the same but for the KV heads laid
        out when the mesh has more devices than the model has KV heads (engine.sharding); the
        weights' format (engine.weights.WEIGHTS_DTYPES: int8 and fp8 name narrow matrices beside
        float norms) and the chat format, which with the files make the component set."""
        args = self.args
        self.platform = jax.default_backend()
        self.checkpoint_cfg = load_config(args.weights_folder)
        self.layout = sharding.Layout.build(self.checkpoint_cfg, args.devices)
        self.cfg = self.layout.cfg
        self.weights_dtype = weights_dtype_for(self.platform, args.dtype, fp8=self.checkpoint_cfg.fp8)
        check_weights_dtype(self.checkpoint_cfg, self.weights_dtype)
        self.float_dtype = dtype_for(self.platform)
        self.chat_format = args.chat_format or CHAT_FORMAT[self.cfg.model_type]
        self.component_set_sha = identity.component_set_sha(args.weights_folder, self.chat_format)

    def _gather_followers(self, on_lost) -> None:
        """The leader of a jax.distributed group waits for its followers (engine.mirror)."""
        self.progress("followers", 0, 1)
        self.mirror = mirror.Leader(self.args.distributed, {
            "args": dataclasses.asdict(self.args), "component_set_sha": self.component_set_sha},
            on_lost=on_lost or mirror.exit_lost)
        self.progress("followers", 1, 1)

    def _gate_reference(self):
        """A first start's certification gate will run: its float64 reference starts now, beside the
        weights and the compiles (None where the gate will not run, or has no reference to compute:
        a hybrid model's)."""
        args = self.args
        gate_runs = args.recertify or certify.nothing_recorded(args.certify_dir, self.component_set_sha)
        if not gate_runs or "linear" in self.checkpoint_cfg.layer_kinds:
            return None
        return certify.Reference(args.weights_folder, self.checkpoint_cfg,
                                 certify.reference_path(args.certify_dir, self.component_set_sha),
                                 fresh=args.recertify)

    def _load_weights(self) -> None:
        """The weights, placed (int8 matrices packed for engine.native's kernel where it serves, and
        read from the held-weights cache where a start wrote them); the buckets and drafting's state;
        the MTP layer where it drafts (one device: where the kernel serves)."""
        args, cfg = self.args, self.cfg
        packed = packs_int8(self.weights_dtype, allowed=cfg.native)
        held = None
        if args.weights_cache and self.weights_dtype == "int8":
            held = os.path.join(args.weights_cache, held_key(
                self.component_set_sha, self.weights_dtype, np.dtype(self.float_dtype).name, cfg.num_kv_heads,
                packed))
        self.progress("weights", 0, 1)
        self.params = load_weights(args.weights_folder, self.checkpoint_cfg, self.weights_dtype,
                                   float_dtype=self.float_dtype, kv_heads=cfg.num_kv_heads,
                                   place=self.layout.place, held_cache=held, pack=packed)
        self.progress("weights", 1, 1)
        self.kv_dtype = np.dtype(args.kv_dtype) if args.kv_dtype else np.dtype(kv_dtype_for(self.platform))
        self.buckets = Buckets.for_ctx(args.ctx, tuple(args.prefill_chunks), args.slots)
        self.speculator = self._speculator(Checkpoint(args.weights_folder).has(MTP_TENSOR))
        if self.speculator.mtp:
            self.params["mtp"] = load_mtp(args.weights_folder, self.checkpoint_cfg, self.weights_dtype,
                                          float_dtype=self.float_dtype, kv_heads=cfg.num_kv_heads, pack=packed)

    def _make_pool(self) -> None:
        """The slot pool (engine.cache, with the MTP layer's entries where it drafts) and the
        sampler's per-row state."""
        args, cfg = self.args, self.cfg
        self.cache = init_cache(cfg, args.slots, args.ctx, self.kv_dtype, zeros=self.layout.cache_zeros,
                                mtp=self.speculator.mtp)
        self.state = self.layout.replicate(sampler.init_state(args.slots, cfg.vocab_size))

    def _make_scheduler(self) -> None:
        """The log's start notes, the host prompt cache under this deployment's namespace, the
        scheduler, and the tool-call grammars (engine.grammar: its tokenizer loads beside the warm-up)."""
        args = self.args
        checkpoint = Checkpoint(args.weights_folder)     # headers only (its files are mapped while it lives)
        self.files = (checkpoint.file, checkpoint.bits_per_weight)      # what the facts name as loaded
        self.start_notes += [note for note in [held_note(checkpoint, self.params, self.weights_dtype)] if note]
        # a vision tower, an MTP module not drafting: not loaded
        self.start_notes += unread_notes(checkpoint, loaded=(MTP_PREFIX,) if self.speculator.mtp else ())
        if self.cfg.layered:
            self.start_notes.append(f"runs one program per layer ({layer_parameters(self.cfg) / 1e6:.0f}M weights "
                                    f"a layer): its programs hold one layer's code, not {self.cfg.num_layers}")
        self.namespace = args.cache_namespace or prefix.namespace_id(
            self.component_set_sha, args.model_id, self.cfg.model_type,
            f"{self.weights_dtype}/kv-{self.kv_dtype.name}" + ("/mtp" if self.speculator.mtp else ""),
            args.prefix_cache)
        # Linear layers: a reused prefix needs their state at its end (snapshots, engine.scheduler).
        self.recurrent = has_state(self.cache)
        self.host = prefix.HostCache(args.cache_ram_mib << 20, self.namespace, trimmable=not self.recurrent) \
            if args.cache_ram_mib > 0 and args.prefix_cache else None
        self.scheduler = Scheduler(args.slots, args.ctx, self.cfg.vocab_size, self.buckets, args.prefix_cache,
                                   self.host, recurrent=self.recurrent)
        self.grammars = grammar.Grammars(args.weights_folder, self.cfg.vocab_size)
        self.held: dict[str, Sequence] = {}      # requests waiting for their grammar, in arrival order

    def _facts(self, compile_s: float) -> ModelFacts:
        """What the server reports of the running model (Health, /v1/models, the log)."""
        args, cfg = self.args, self.cfg
        return ModelFacts(
            id=args.model_id, family=cfg.model_type, weights=self.files[0], folder=args.weights_folder,
            chat_format=self.chat_format,
            gb=round(weights_bytes(self.params) / 1e9, 3),
            bpw=self.files[1],
            max_model_len=args.ctx, slots=args.slots, prefix_cache=args.prefix_cache,
            cache_ram_mib=args.cache_ram_mib, vocab_size=cfg.vocab_size, device=self.platform,
            devices=self.layout.describe(),
            dtype=self.weights_dtype, compile_s=round(compile_s, 2),
            cache_namespace=self.namespace,
            # What the warm-up traced, so Health reports the path the programs really run.
            routed_experts=routed_report(cfg, {rows * t for _, rows, t in self.programs()}),
            component_set_sha=self.component_set_sha, deployment_id=self.deployment_id,
            certification=self.certification, certification_detail=self.certification_detail,
            grammar=self.grammars.version, grammar_off=self.grammars.off or "",
            kernel=f"native {native.tier()}" if cfg.native else "xla",
            speculative=self._speculative_fact(), same_answer=self._same_answer_fact())


    def _speculator(self, has_mtp: bool) -> speculative.Speculator:
        """Drafting's state, off (and why) where it would not be exact (engine.speculative), else
        the verification programs: each decode batch of up to VERIFY_MAX_ROWS rows, with each of the
        model's lengths (engine.scheduler.verify_tokens) whose rows the kernel's products and
        attention take one by one. has_mtp: the checkpoint has an MTP layer, which drafts where the
        mode lets it."""
        cfg, args = self.cfg, self.args
        if args.speculative not in speculative.MODES:
            raise ValueError(f"speculative: must be one of {speculative.MODES}, got {args.speculative!r}")
        why = ("--speculative off" if args.speculative == "off" else self._rows_apart_why() or
               ("--speculative mtp: the checkpoint has no MTP layer (mtp.* tensors)"
                if args.speculative == "mtp" and not has_mtp else None))
        shapes = {} if why else {
            rows: tuple(t for t in verify_tokens(cfg) if rows * t <= products.INT8_ROWS_MAX_ROWS and t < args.ctx)
            for rows in self.buckets.decode_rows if rows <= VERIFY_MAX_ROWS}
        shapes = {rows: ts for rows, ts in shapes.items() if ts}
        off = why or (None if shapes else "no verification fits the context")
        return speculative.Speculator(off, shapes, ngram=args.speculative in ("auto", "ngram"),
                                      mtp=off is None and has_mtp and args.speculative in ("auto", "mtp"))

    def _rows_apart_why(self) -> str | None:
        """Why a decode step's rows could get other numbers than each alone (None: they cannot):
        what drafting's exactness and the same-answer guarantee rest on."""
        cfg, args = self.cfg, self.args
        return ("the native kernel does not serve this model" if not cfg.native else
                f"{self.weights_dtype} weights' products are not the same per position whatever the "
                "rows beside them (int8 and block weights' integer products are)"
                if self.weights_dtype != "int8" else
                "the KV cache is not int8 (the kernel's attention reads int8)" if self.kv_dtype != np.int8 else
                f"a decode step of every slot ({args.slots} rows) is past the {products.INT8_ROWS_MAX_ROWS} "
                "rows whose products are the same per row whatever the rows beside it"
                if args.slots > products.INT8_ROWS_MAX_ROWS else None)

    def _same_answer_fact(self) -> str:
        """Whether the same request gets the same answer, as the start-up log says it: a row's numbers
        apart from the rows beside it and from drafting (decode steps, verifications), a prompt's
        apart from the chunks it was read in (cold, or its prefix from a cache), and where not, why."""
        apart = self._rows_apart_why()
        if apart:
            return (f"not guaranteed: {apart}, so a row's numbers can depend on the rows beside it and "
                    "on the chunks its prompt was read in")
        cfg = self.cfg
        widened = products.widened_kinds(self.params)
        chunks = (f"prefill chunks past {products.INT8_ROWS_MAX_ROWS} rows of its "
                  f"{', '.join(sorted(widened))} weights are widened for XLA's dot on this CPU"
                  if widened else
                  f"its Gated DeltaNet layers sum a chunk in sub-chunks set by its length ({DELTA_STEPS_ENV}=0)"
                  if "linear" in cfg.layer_kinds and not delta_by_steps(cfg) else None)
        rows = ("a row's numbers are the same whatever the rows beside it and with drafting on or off, "
                "and a seeded draw depends on the seed and the position only")
        if chunks is None:
            return (f"guaranteed: {rows}; a prompt reads into the same cache in any of the server's chunks, "
                    "cold or cached, as the decode steps that wrote an earlier answer did")
        return (f"{rows}; a prompt's cached keys and values can differ in their last bits from a cold "
                f"read in other chunks ({chunks}), so an answer can depend on what the cache held")

    def _speculative_fact(self) -> str:
        """Drafting as Health and the start-up log say it: which drafters run, and why the others do not."""
        spec, mode = self.speculator, self.args.speculative
        if spec.off:
            return f"off: {spec.off}"
        drafters = " and ".join(name for name, on in (("the checkpoint's MTP layer", spec.mtp),
                                                      ("the conversation's text", spec.ngram)) if on)
        why_not = ("" if spec.mtp else
                   "; no MTP drafts: --speculative ngram" if mode == "ngram" else
                   "; no MTP drafts: the checkpoint has no MTP layer (mtp.* tensors)")
        lengths = sorted({t for ts in spec.shapes.values() for t in ts})
        return (f"drafts from {drafters}, {' or '.join(map(str, lengths))} tokens per row verified "
                f"in one step, in batches of up to {max(spec.shapes)} rows, where measured to pay{why_not}")

    def programs(self) -> list[tuple[str, int, int]]:
        """Every model program a request can run, as (kind, rows, tokens per row): prefill chunks
        (one row), decode steps (one token per row, each decode batch size) and verifications of
        drafts (engine.speculative; their logits at every position). Attention length is a run-time
        value, so it multiplies nothing here."""
        b = self.buckets
        return ([("prefill", 1, c) for c in b.chunks] + [("decode", rows, 1) for rows in b.decode_rows]
                + [("verify", rows, t) for rows, ts in self.speculator.shapes.items() for t in ts])

    def draft_programs(self) -> list[tuple[int, int]]:
        """The MTP layer's draft programs (engine.model.draft), as (rows, drafts): one before each
        verification program, drafting all but its first token."""
        if not self.speculator.mtp:
            return []
        return [(rows, t - 1) for rows, ts in self.speculator.shapes.items() for t in ts]

    def _draft_call(self, rows: int, k: int) -> tuple:
        """Arguments of a draft program on idle rows (lengths 0 write nothing)."""
        return (self.params, self.cache, np.zeros(rows, np.int32), np.arange(rows, dtype=np.int32),
                np.zeros(rows, np.int32), np.zeros(rows, np.int32))

    @staticmethod
    def _program_options(kind: str) -> dict:
        return {"verify": True} if kind == "verify" else {}

    def _model_call(self, rows: int, t: int) -> tuple:
        """Arguments of a model call on idle rows (lengths 0 leave the cache untouched)."""
        return (self.params, self.cache, np.zeros((rows, t), np.int32), np.arange(rows, dtype=np.int32),
                np.zeros(rows, np.int32), np.zeros(rows, np.int32))

    def _deployment_id(self) -> str:
        """The id of what this worker runs: the text of every model program the warm-up compiled
        (lowered again: jit keeps the traces, so this costs the text, not a trace), with the software,
        the device and the settings that shape the programs."""
        texts = [jit_forward.lower(*self._model_call(rows, t), cfg=self.cfg,
                                   **self._program_options(kind)).as_text()
                 for kind, rows, t in self.programs()]
        texts += [jit_draft.lower(*self._draft_call(rows, k), cfg=self.cfg, k=k).as_text()
                  for rows, k in self.draft_programs()]
        device = self.layout.mesh.devices.flat[0]
        import jaxlib
        return identity.deployment_id(texts, {
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": device.platform,
            "device_kind": device.device_kind, "devices": self.layout.describe(), "dtype": self.weights_dtype,
            "kv_dtype": self.kv_dtype.name,
            "slots": self.args.slots, "ctx": self.args.ctx, "buckets": repr(self.buckets),
            "prefix_cache": self.args.prefix_cache, "host_cache": self.host is not None,
            "speculative": self.speculator.off or sorted(self.speculator.shapes.items()),
            # the sampler's and the cache copies' small programs: their source
            "sources": [identity.file_sha256(m.__file__) for m in (sampler, prefix, sharding)]
            + [identity.file_sha256(init_cache.__code__.co_filename)]
            # the int8 kernel the programs call by name
            + ([identity.file_sha256(str(native.SOURCE)), native.tier()] if self.cfg.native else [])})

    @device_call
    def _warm_up(self, host_copies: bool, state_copies: bool) -> None:
        """Compile every program and run each once. Independent programs compile at the same time
        (XLA compiles one program mostly on one core), and jit keeps each compiled program for the
        calls that run it later; a program found in the persistent compile cache is loaded instead.
        Every model program then runs once on idle rows (lengths 0: the cache is untouched): a
        program's first run costs far more than the next (on a CPU the demo's 512-token chunk took
        2.2 s against 0.8 s, its 128-token chunk 1.0 against 0.4: YNNPACK sets up each of its
        fusions on their first call), and that first run belongs to the start, not to the first
        request that needs it. A prefill program runs as soon as it is compiled, while the pool still
        traces and loads the others (a warm start of the demo on a 2-core EPYC of CPU family 25 spent
        5.6 s in those runs after every program had loaded). The sampler, and the token mask of
        constrained rows, are compiled for logits of the decode programs, one token per row (cheap):
        jit keys on where its inputs live, so logits made on the host would compile a different
        program than the one requests run."""
        self.faults.at("warmup")
        total = len(self.programs()) + 1
        self.progress("compile", 0, total)
        self._compile_model_programs(total)
        for rows, k in self.draft_programs():
            _, self.cache = jit_draft(*self._draft_call(rows, k), cfg=self.cfg, k=k)
        _compile_together(self._sampler_programs())
        self._time_programs()
        self.state = sampler.start_row(self.state, np.int32(0), np.zeros(self.cfg.vocab_size, bool))
        self.cache = copy_prefix(self.cache, np.int32(0), np.int32(0), np.int32(0))
        if host_copies:
            self.cache = warm_host_copies(self.cache)
        if state_copies:
            self.cache = warm_state_copies(self.cache)
        jax.block_until_ready((self.cache, self.state))
        self.progress("compile", total, total)

    @device_call
    def _compile_model_programs(self, total: int) -> None:
        """The warm-up's model programs, compiled together; each prefill program runs once on idle
        rows as soon as it is compiled, or after them all where the memory holds one compile at a
        time (the decode programs run in _sampler_programs)."""
        programs, done = self.programs(), [0]

        # Each compile's and first run's freed heap is handed back at once: glibc keeps it, and a
        # large model's worker grew by gigabytes over its ready size through its start
        # (docs/perf-log.md, "The 27B's start").
        def compiled() -> None:
            memory.release_free_heap()
            done[0] += 1
            self.progress("compile", min(done[0], total - 1), total)

        def first_run(i: int) -> None:
            kind, rows, t = programs[i]
            if kind == "prefill":
                _, self.cache = jit_forward(*self._model_call(rows, t), cfg=self.cfg)
                jax.block_until_ready(self.cache)
                memory.release_free_heap()

        # Where the memory holds one compile at a time, the first runs wait for the compiles too: a
        # long chunk's first run beside the next compile holds both programs' memory at once.
        threads = compile_threads(1 if self.cfg.layered else self.cfg.num_layers)   # layered: a layer per program
        beside = threads >= (os.cpu_count() or 1)
        _compile_together([(jit_forward, self._model_call(rows, t),
                            {"cfg": self.cfg, **self._program_options(kind)})
                           for kind, rows, t in programs], compiled, then=first_run if beside else None,
                          threads=threads)
        if not beside:
            for i in range(len(programs)):
                first_run(i)

    @device_call
    def _sampler_programs(self) -> list[tuple]:
        """The sampler's programs (and the token mask's) for _compile_together, on the logits of each
        decode and verification program, which run here once on idle rows to make them."""
        samples, masks = [], []
        for rows in self.buckets.decode_rows:      # every row count a prefill chunk has too (one)
            logits, self.cache = jit_forward(*self._model_call(rows, 1), cfg=self.cfg)
            params = sampler.row_params([(sampler.Sampling(), 0, 0)] * rows)
            # Only the batch of every slot samples with every_slot=True; a smaller decode batch and a
            # prefill's one row (even when one row is every slot) gather their slots' state.
            for every in {rows == self.args.slots} | ({False} if rows == 1 else set()):
                for flags in sampler.FLAG_COMBINATIONS:
                    samples.append((sampler.sample, (self.state, logits, np.arange(rows, dtype=np.int32),
                                                     np.zeros(rows, bool), params),
                                    dict(every_slot=every, native_kernel=self.cfg.native, **flags)))
            bits = np.zeros((rows, grammar.mask_words(self.cfg.vocab_size)), np.int32)
            masks.append((sampler.allowed_only, (logits, bits), {}))
        for rows, ts in self.speculator.shapes.items():
            for t in ts:
                logits, self.cache, steps = jit_forward(*self._model_call(rows, t), cfg=self.cfg, verify=True)
                if steps:                               # the commit after it, on idle rows (a no-op)
                    self.cache = keep_steps(self.cache, steps, np.arange(rows, dtype=np.int32),
                                            np.full(rows, -1, np.int32))
                params = sampler.row_params([(sampler.Sampling(), 0, 0)] * rows)
                bits = np.zeros((rows, t, grammar.mask_words(self.cfg.vocab_size)), np.int32)
                for flags in sampler.FLAG_COMBINATIONS:
                    samples.append((sampler.verify, (self.state, logits, np.zeros((rows, t), np.int32),
                                                     np.arange(rows, dtype=np.int32), np.zeros(rows, np.int32),
                                                     params, bits),
                                    dict(every_slot=rows == self.args.slots, native_kernel=self.cfg.native,
                                         **flags)))
        return samples + masks

    @device_call
    def _time_programs(self) -> None:
        """Drafting's first estimate of each decode, verification and draft program's time (the fastest of
        TIMING_RUNS runs on idle rows after a first: their products cost what a real call's do, and
        the fastest is the least disturbed by the host); real calls refine it."""
        def fastest(run) -> float:
            times = []
            for _ in range(1 + TIMING_RUNS):
                t0 = time.perf_counter()
                jax.block_until_ready(run())
                times.append(time.perf_counter() - t0)
            return min(times[1:])

        def model(rows: int, t: int):
            logits, self.cache, *_ = jit_forward(*self._model_call(rows, t), cfg=self.cfg, verify=t > 1)
            return logits

        def drafts(rows: int, k: int):
            out, self.cache = jit_draft(*self._draft_call(rows, k), cfg=self.cfg, k=k)
            return out

        for rows, ts in self.speculator.shapes.items():
            for t in (1,) + ts:
                self.speculator.measured(rows, t, fastest(lambda: model(rows, t)))
        for rows, k in self.draft_programs():
            self.speculator.measured(rows, k, fastest(lambda: drafts(rows, k)), draft=True)

    # -- requests ---------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.scheduler.busy or bool(self.held)

    def submit(self, msg: Submit) -> list[Step]:
        """Queue a request; a bad one is answered at once with finish="error"."""
        now = time.time()
        error = self.scheduler.check(msg.rid, msg.prompt, msg.max_tokens, msg.cuts)
        if error is not None:
            return [Step(msg.rid, [], finish="error", prompt_tokens=len(msg.prompt), error=error,
                         timings={"queue_ms": 0.0, "prompt_ms": 0.0, "predicted_ms": 0.0})]
        s = msg.sampling
        seed = s.seed if s.seed is not None else secrets.randbits(63)
        error = sampler.row_error(s, seed)
        if error is not None:
            return [Step(msg.rid, [], finish="error", prompt_tokens=len(msg.prompt), error=error,
                         timings={"queue_ms": 0.0, "prompt_ms": 0.0, "predicted_ms": 0.0})]
        request = Sequence(msg.rid, list(msg.prompt), msg.max_tokens, s, frozenset(msg.stop_ids), seed,
                          cuts=sorted(set(msg.cuts)), tenant=msg.tenant)
        request.times["arrived"] = msg.submitted_at or now
        if msg.constraint is not None:
            self.grammars.open(msg.rid, msg.constraint, msg.tenant)     # its compile queues per tenant
            self.held[msg.rid] = request
            self._release_held()
        else:
            self.scheduler.add(request)
        return []

    def _release_held(self) -> None:
        """Requests whose grammar is settled join the scheduler's queue, in the order they came."""
        for rid in [rid for rid in self.held if self.grammars.settled(rid)]:
            self.scheduler.add(self.held.pop(rid))

    def cancel(self, rid: str) -> list[Step]:
        request = self.held.pop(rid, None)
        if request is not None:
            request.finish = "abort"
        else:
            request = self.scheduler.cancel(rid)
        return [] if request is None else [self._step(request, [], "abort")]

    # -- one round --------------------------------------------------------------------------------

    def step(self) -> list[Step]:
        """One scheduling round and its device calls; the Steps of every request that moved.
        Compiles are counted around the round, not process-wide, so other engines in the same
        process (tests, benchmarks) do not show up in this one's count."""
        before = compiles_so_far()
        try:
            return self._round()
        finally:
            self.late_compiles += compiles_so_far() - before

    def _round(self) -> list[Step]:
        if self.held:
            self._release_held()
            if not self.scheduler.busy:          # nothing to run until a grammar is ready
                self.grammars.wait(GRAMMAR_POLL_S)
                return []
        plan = self.scheduler.schedule()
        now = time.time()
        for request in plan.started:
            request.times["started"] = now
            if sampler.uses_penalties(request.sampling):
                seen = np.zeros(self.cfg.vocab_size, bool)
                seen[request.prompt] = True
                self._start_row(request.slot, seen)
        for save in plan.saves:
            self._save(save, protect=[seg for load in plan.loads for seg in load.path])
        for load in plan.loads:
            self._load(load)
        for src, dst, n in plan.copies:
            self._copy_prefix(src, dst, n)
        for slot, snapshot in plan.restores:
            self._write_state(slot, snapshot)
        if plan.saves or plan.loads:       # segments evicted, slot reads and writes freed
            memory.release_free_heap()
        emits = []
        t0 = time.perf_counter()
        if plan.decode is not None:
            emits += self.scheduler.decoded(plan.decode, self._decode(plan.decode))
        t1 = time.perf_counter()
        if plan.prefill is not None:
            token = self._prefill(plan.prefill)
            snapshot = self._read_state(plan.prefill.request.slot) if plan.prefill.snapshot else None
            emits += self.scheduler.prefilled(plan.prefill, token, snapshot)
        self.scheduler.spent(plan, t1 - t0, time.perf_counter() - t1)    # the pace of prompts
        now = time.time()
        # A request given a slot is told at once how much of its prompt came from a cache: the
        # server's first frames report it (Anthropic's message_start) before the first token.
        steps = [Step(r.rid, [], prompt_tokens=len(r.prompt), cached_tokens=r.cached)
                 for r in plan.started]
        for e in emits:
            e.request.times.setdefault("first", now)
            e.request.times["last"] = now
            steps.append(self._step(e.request, e.tokens, e.finish))
        return steps

    def _save(self, save, protect) -> None:
        """Copy what a slot holds to the host cache, unless it is saved there already; for a hybrid
        model with its snapshots and the state at its end (the slot's live state, exact there)."""
        covered = self.host.covered(save.tokens)
        snapshots = None
        if save.snapshots is not None:
            snapshots = {**save.snapshots, len(save.tokens): self._read_state(save.slot)}
        elif covered >= len(save.tokens):
            return
        # Read segment by segment as the cache makes room for each: a whole slot read at once
        # (32k positions of the demo: 0.2 GB) would sit beside the cache at its cap.
        kv = prefix.Reader(lambda a, b: self._read_slot(save.slot, b, a), position_bytes(self.cache))
        self.host.insert(save.tokens, kv, save.cuts, save.tenant, protect=protect,
                         kv_start=covered, snapshots=snapshots)

    def _load(self, load) -> None:
        """Write the saved start of a request's prompt into its slot: only the positions the slot
        does not hold already (an agent's sessions share their system prompt and tools)."""
        request = load.request
        hit = self.host.lookup(request.prompt[:load.tokens + 1])
        if hit.tokens != load.tokens:   # the plan's segments were protected: this cannot happen
            raise RuntimeError(f"host cache lost {load.tokens - hit.tokens} planned tokens")
        # Run by run, not the prefix joined into one copy first.
        for start, kv in self.host.runs(hit, load.start, join_below=host_block(self.args.ctx)):
            self._write_slot(request.slot, kv, start)
        if self.recurrent:                  # a hybrid hit ends at a segment with a snapshot
            self._write_state(request.slot, hit.path[-1].snapshot)

    def _prefill(self, work: Prefill) -> int | None:
        """Run one prompt chunk (one row); the first new token if the chunk ends the prompt."""
        self.faults.at("prefill")
        request = work.request
        tokens = np.zeros((1, work.chunk), np.int32)
        tokens[0, :len(work.tokens)] = work.tokens
        draw = None if not work.last else (
            sampler.row_params([(request.sampling, request.seed, 0)]), False,
            sampler.batch_flags([request.sampling]), self.grammars.masks([request.rid]))
        token = self._forward(tokens, np.array([request.slot], np.int32), np.array([work.start], np.int32),
                              np.array([len(work.tokens)], np.int32), draw)
        if token is None:
            return None
        self.grammars.advance(request.rid, int(token[0]))
        return int(token[0])

    def _decode(self, work: Decode) -> list:
        """New tokens for every generating request: one each, or (engine.speculative) a list for a
        row that carried a draft. The batch of every slot puts slot i on row i (idle rows masked),
        so its program never changes with the number of live requests; a smaller batch
        (Buckets.decode_rows) packs the rows and names each row's slot."""
        self.faults.at("decode")
        n = work.batch
        every = n == self.args.slots
        where = [r.slot if every else i for i, r in enumerate(work.rows)]
        ctx = self.args.ctx
        plan = self.speculator.plan(n, [
            (r.rid, r.prompt, r.output, min(r.max_tokens - len(r.output), ctx - len(r.prompt) - len(r.output)))
            for r in work.rows])
        t = plan.t
        slots = np.arange(n, dtype=np.int32)
        tokens = np.zeros((n, t), np.int32)
        starts = np.zeros(n, np.int32)
        lengths = np.zeros(n, np.int32)
        rows = [(sampler.Sampling(), 0, 0)] * n
        rids: list[str | None] = [None] * n
        for row, r in zip(where, work.rows):
            rids[row] = r.rid
            slots[row] = r.slot
            tokens[row, 0] = r.output[-1]
            starts[row] = len(self.scheduler.slots[r.slot].tokens)
            lengths[row] = 1
            rows[row] = (r.sampling, r.seed, len(r.output))
        draw = (sampler.row_params(rows), every, sampler.batch_flags([r.sampling for r in work.rows]))
        t0 = time.perf_counter()
        drafts, sources = self._drafts(plan, work, where, tokens[:, 0], slots, starts, lengths)
        by_row: list[list[int]] = [[] for _ in range(n)]
        for row, r, draft in zip(where, work.rows, drafts):   # a stop ends the answer: never drafted
            by_row[row] = draft[:next((i for i, x in enumerate(draft) if x in r.stop_ids), len(draft))]
        if not any(by_row):
            drawn = self._forward(tokens[:, :1], slots, starts, lengths, draw + (self.grammars.masks(rids),))
            self.speculator.measured(n, 1, time.perf_counter() - t0)
            for row, r in zip(where, work.rows):
                self.grammars.advance(r.rid, int(drawn[row]))
            return [int(drawn[row]) for row in where]
        masks, by_row = self.grammars.masks_ahead(rids, by_row, t)
        drafted = np.zeros((n, t), np.int32)
        for row, draft in enumerate(by_row):
            tokens[row, 1:1 + len(draft)] = draft
            drafted[row, :len(draft)] = draft
            lengths[row] += len(draft)
        t1 = time.perf_counter()
        picks = self._verify(tokens, slots, starts, lengths, drafted, draw + (masks,))
        self.speculator.measured(n, t, time.perf_counter() - t1)
        return self._kept(work, where, by_row, sources, picks, drafted, lengths)

    def _drafts(self, plan, work: Decode, where, newest, slots, starts, lengths) -> tuple[list, list]:
        """Each row's draft for the round (its n-gram one, or where the plan has the MTP layer draft
        first, the better of the two: Speculator.choose) and the drafter of each."""
        if not plan.mtp:
            return plan.ngram, ["ngram"] * len(plan.ngram)
        t0 = time.perf_counter()
        k = plan.t - 1
        # The MTP entry of each row's newest token sits at its last position (engine.model.draft).
        proposed = self._draft(newest, slots, starts - 1, lengths, k)
        self.speculator.measured(len(slots), k, time.perf_counter() - t0, draft=True)
        return self.speculator.choose(plan, [r.rid for r in work.rows], [proposed[row] for row in where])

    def _kept(self, work: Decode, where, by_row, sources, picks, drafted, lengths) -> list:
        """Each row's new tokens after a verification: the drafts kept and the token drawn after them,
        up to a stop; each drafter's acceptance is told."""
        out = []
        kept_by_row = speculative.kept_counts(picks, drafted, lengths)
        for row, r, source in zip(where, work.rows, sources):
            draft, kept = by_row[row], int(kept_by_row[row])
            new = [int(x) for x in picks[row, :kept + 1]]
            stop = next((i for i, x in enumerate(new) if x in r.stop_ids), None)
            new = new if stop is None else new[:stop + 1]
            self.speculator.verified(r.rid, len(draft), kept, source)
            for token in new:
                self.grammars.advance(r.rid, token)
            out.append(new)
        return out

    # -- the device calls (device_call): host values in and out -------------------------------------

    @device_call
    def _forward(self, tokens, slots, starts, lengths, draw):
        """One model call on the rows given. draw None: wait for it (a prompt's chunk before its
        last: with asynchronous dispatch a long prompt's chunks would all be queued at once, and
        the worker would go silent, no Stats, for minutes on a CPU, long enough for the server to
        take it for stuck) and return None. Else draw = (row params, every_slot, batch flags, token
        masks or None): the token sampled for each row (rows with length 0 are idle), among the
        tokens its mask allows (engine.grammar)."""
        logits, self.cache = jit_forward(self.params, self.cache, tokens, slots, starts, lengths,
                                         cfg=self.cfg)
        if draw is None:
            jax.block_until_ready(logits)
            return None
        params, every, flags, masks = draw
        if masks is not None:
            logits = sampler.allowed_only(logits, masks)
        drawn, self.state = sampler.sample(self.state, logits, slots, lengths > 0, params,
                                           every_slot=every, native_kernel=self.cfg.native, **flags)
        return sharding.to_host(drawn)

    @device_call
    def _verify(self, tokens, slots, starts, lengths, drafts, draw):
        """A decode step whose rows carry drafts (engine.speculative): tokens [B, T], each row's
        last token and its draft (lengths[b] of them real), drafts [B, T] the drafted tokens after
        each position; draw = (row params, every_slot, batch flags, masks [B, T, words]). The tokens
        drawn at every position [B, T] (sampler.verify)."""
        logits, self.cache, steps = jit_forward(self.params, self.cache, tokens, slots, starts, lengths,
                                                cfg=self.cfg, verify=True)
        params, every, flags, masks = draw
        picks, self.state = sampler.verify(self.state, logits, drafts, slots, lengths, params, masks,
                                           every_slot=every, native_kernel=self.cfg.native, **flags)
        picks = sharding.to_host(picks)
        if steps:            # linear layers: each row keeps the state at its last kept position
            at = np.where(lengths > 0, speculative.kept_counts(picks, drafts, lengths), -1)
            self.cache = keep_steps(self.cache, steps, slots, at.astype(np.int32))
        return picks

    @device_call
    def _draft(self, tokens, slots, starts, lengths, k: int) -> np.ndarray:
        """The MTP layer's k drafts for each row [B, k] (engine.model.draft): tokens [B] each row's
        newest token, starts [B] its last position, lengths [B] 1 live, 0 idle."""
        drafts, self.cache = jit_draft(self.params, self.cache, tokens, slots, starts, lengths, cfg=self.cfg, k=k)
        return sharding.to_host(drafts)

    @device_call
    def logits(self, tokens, slots, starts, lengths) -> np.ndarray:
        """A model call's last-position logits of every row, float32 [rows, vocab] (certify)."""
        logits, self.cache = jit_forward(self.params, self.cache, tokens, slots, starts, lengths,
                                         cfg=self.cfg)
        return sharding.to_host(logits)

    @device_call
    def routed_experts(self, x, valid, path: str) -> np.ndarray:
        """The first routed layer's experts on rows x through one path (certify's check)."""
        from engine.moe import routed_experts
        cfg = dataclasses.replace(self.cfg, routed_path=path)
        layer = self.params["layers"][list(cfg.mlp_kinds).index("moe")]["moe"]
        return sharding.to_host(jax.jit(lambda a, m, v: routed_experts(a, m, v, cfg=cfg))(x, layer, valid))

    @device_call
    def _start_row(self, slot: int, seen) -> None:
        self.state = sampler.start_row(self.state, np.int32(slot), seen)

    @device_call
    def _copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.cache = copy_prefix(self.cache, np.int32(src), np.int32(dst), np.int32(n))

    @device_call
    def _read_slot(self, slot: int, n: int, start: int) -> list[dict]:
        return read_slot(self.cache, slot, n, start=start)

    @device_call
    def _write_slot(self, slot: int, kv: list[dict], start: int) -> None:
        self.cache = write_slot(self.cache, slot, kv, start=start)

    @device_call
    def _read_state(self, slot: int) -> list[dict]:
        return read_state(self.cache, slot)

    @device_call
    def _write_state(self, slot: int, snapshot: list[dict]) -> None:
        self.cache = write_state(self.cache, slot, snapshot)

    def run_call(self, name: str, args: tuple):
        """A follower runs one of the leader's calls (follow())."""
        if name not in DEVICE_CALLS:
            raise ValueError(f"the leader sent {name!r}, which is not a device call")
        return getattr(self, name)(*args)

    def _step(self, request: Sequence, tokens: list[int], finish: str | None) -> Step:
        step = Step(request.rid, tokens, finish)
        if finish is not None:
            step.constrained, step.mask_ms = self.grammars.close(request.rid)
        if not request.first_sent:
            if tokens:
                self.faults.at("first-token")
            request.first_sent = True
            step.prompt_tokens, step.cached_tokens = len(request.prompt), request.cached
        if finish is not None:
            t = request.times
            now = time.time()
            started = t.get("started", now)
            first = t.get("first", now)
            step.timings = {
                "queue_ms": round(max(0.0, started - t["arrived"]) * 1000, 3),
                "prompt_ms": round(max(0.0, first - started) * 1000, 3),
                "predicted_ms": round(max(0.0, t.get("last", first) - first) * 1000, 3),
            }
            drafted, kept, rounds = self.speculator.finish(request.rid)
            if self.speculator.off is None:
                step.timings.update(draft_n=drafted, draft_n_accepted=kept, draft_rounds=rounds)
        return step

    def take_notes(self) -> list[Note]:
        """What the server should log about the requests scheduled since the last call."""
        notes = [Note(text) for text in self.start_notes]
        self.start_notes = []
        notes += [Note(text, rid) for rid, text in self.scheduler.notes + self.grammars.notes]
        self.scheduler.notes.clear()
        self.grammars.notes.clear()
        return notes

    # -- numbers ----------------------------------------------------------------------------------

    def compiles_after_ready(self) -> int:
        return self.late_compiles

    def stats(self) -> Stats:
        s, host = self.scheduler, self.host
        return Stats(live_rows=s.live, waiting=len(s.waiting) + len(self.held),
                     kv_used_tokens=s.kv_used_tokens(), kv_capacity_tokens=self.args.slots * self.args.ctx,
                     compiles_after_ready=self.compiles_after_ready(),
                     host_cache_bytes=host.bytes - host.snapshot_bytes if host else 0,
                     snapshot_bytes=host.snapshot_bytes if host else 0,
                     host_cache_cap_bytes=host.cap_bytes if host else 0,
                     host_cache_evictions=host.evictions if host else 0,
                     prefix_queries=s.prefix_queries, prefix_hits=s.prefix_hits)


# ---- the process -------------------------------------------------------------------------------

def _inbox(conn, block: bool) -> list:
    """Every message waiting on the pipe; waits for the first one when `block`."""
    messages = []
    if block:
        messages.append(conn.recv())
    while conn.poll():
        messages.append(conn.recv())
    return messages


def main(conn, args: WorkerArgs | dict) -> None:
    """The worker process: load and compile, send Ready, then serve the pipe until Shutdown or
    until the server's end of the pipe closes. An error it cannot recover from is sent as Fault.
    args may be a dict of WorkerArgs's fields: the server builds it without importing this module.
    With several processes this is the leader's worker (process 0): a follower that is gone is a
    Fault, and the process ends at once (it may be waiting in a collective for that follower)."""
    lock = threading.Lock()           # engine.mirror's watch threads send a Fault too

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    def lost(why: str) -> None:
        try:
            send(Fault(why))
        finally:
            mirror.exit_lost(why)

    try:
        if isinstance(args, dict):
            args = WorkerArgs(**args)
        _join(args, send)
        engine = Engine(args, progress=lambda phase, done, total: send(Loading(phase, done, total)),
                        on_lost=lost)
        send(Ready(engine.facts, os.getpid()))
        for note in engine.take_notes():             # what start-up has to say (held_note)
            send(note)
        last_stats, last_shape = 0.0, None
        while True:
            was_busy = engine.busy
            for msg in _inbox(conn, block=not engine.busy):
                if isinstance(msg, Shutdown):
                    if engine.mirror is not None:
                        engine.mirror.close()       # only here: after a failure they restart
                    return
                replies = engine.submit(msg) if isinstance(msg, Submit) else \
                    engine.cancel(msg.rid) if isinstance(msg, Cancel) else []
                for reply in replies:
                    send(reply)
            if engine.busy:
                for step in engine.step():
                    send(step)
                for note in engine.take_notes():
                    send(note)
            if was_busy and not engine.busy:         # the last request ended or was cancelled
                memory.release_free_heap()
            stats = engine.stats()
            shape = (stats.live_rows, stats.waiting, stats.compiles_after_ready, stats.host_cache_bytes,
                     stats.host_cache_evictions)
            if shape != last_shape or (engine.busy and time.time() - last_stats >= STATS_INTERVAL_S):
                send(stats)
                last_stats, last_shape = time.time(), shape
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return                                  # the server is gone: nothing to tell
    except BaseException as e:                  # noqa: BLE001 - any failure ends the worker
        try:
            send(Fault(f"{type(e).__name__}: {e}"))
        finally:
            raise


def _join(args: WorkerArgs, send) -> None:
    """Join the jax.distributed group, if there is one: before anything touches a device. It waits
    for every process of the group (jax's initialization timeout, then fails)."""
    if args.distributed:
        send(Loading("processes", 0, int(args.distributed[1])))
        sharding.init_distributed(tuple(args.distributed))


def follow(conn, args: WorkerArgs | dict) -> None:
    """A follower's worker (process id > 0 of the group; `mashbox run --process-id`, which restarts
    it): join the group, take the leader's arguments but for HOST_FIELDS, load the same weights,
    then run the leader's device calls until it stops (return) or is gone (engine.mirror ends the
    process). conn: the pipe to `mashbox run`, which logs the Notes and Faults."""
    try:
        if isinstance(args, dict):
            args = WorkerArgs(**args)
        _join(args, conn.send)
        link = mirror.Follower(tuple(args.distributed))
        ours = {name: getattr(args, name) for name in HOST_FIELDS}
        engine = Engine(WorkerArgs(**dict(link.hello["args"], **ours)), follower=True,
                        progress=lambda phase, done, total: conn.send(Loading(phase, done, total)))
        if engine.component_set_sha != link.hello["component_set_sha"]:
            raise ValueError(f"the model here ({args.weights_folder}) is not the leader's: component "
                             f"set {engine.component_set_sha[:12]} here, "
                             f"{link.hello['component_set_sha'][:12]} on process 0")
        conn.send(Note(f"process {args.distributed[2]} of {args.distributed[1]} follows process 0: "
                       f"mesh {dict(engine.layout.mesh.shape)}"))
        for name, call_args in link.calls():
            engine.run_call(name, call_args)
    except BaseException as e:                  # noqa: BLE001 - any failure ends the follower
        try:
            conn.send(Fault(f"{type(e).__name__}: {e}"))
        finally:
            raise
