"""Which requests run in the next device call, and what their new tokens mean. Pure Python: no
arrays, no clock, no device; the worker turns a Plan into model calls and feeds the tokens back (and,
for pacing, how long its calls took).

Every request gets a slot as soon as one is free, and the prompts in slots are read side by side:
each round is one decode step of every slot whose request is generating (never skipped) and at most
one prefill chunk, of the prompt whose turn it is (Scheduler._turn: tenants take turns by the work
their chunks cost; within a tenant the shortest rest first, none passed over more than MAX_PASSED
times in a row). So a short prompt that arrives while a long one is read waits for the chunk under
way, not for the whole long prompt, and one tenant's prompts cannot take another's turns. While
rows decode, prompts take at most PREFILL_SHARE of the device's time (Pace). A prompt's chunks
depend only on the prompt, its cached start and its cut points, never on what else is read: its
numbers are the same whatever runs beside it.

A slot holds one whole sequence; when its request ends, the slot keeps those tokens, and a later
prompt that starts the same way reuses them instead of running them again. A prompt that shares
its start with a prompt still being read waits until that start is read, then copies it. With a
host cache (--cache-ram), what a slot holds is saved to host memory before the slot is given
to a prompt that diverges from it, and a prompt whose start was saved there is loaded back into its
slot instead of being run again (the worker does the copies the Plan names).

A hybrid model's linear layers hold their sequence's state at its end, which cannot be cut back to
an earlier position: its prompt cache reuses a prefix only where that state is known. Prefill chunks
end at the prompt's cut points (turn boundaries) and the worker snapshots the state there and at
the prompt's end
(Slot.snapshots); a slot no request runs in also holds the exact state at its sequence's end. A
prefix is reused up to the longest of those positions (or a host segment end with a snapshot), and
the tokens shared beyond it that are run again are logged.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine import prefix
from engine.config import ModelConfig
from engine.protocol import Sampling

# ---- the buckets: every shape a device call can have comes from here ---------------------------

# Prefill chunk lengths (tokens per call). A few sizes, 4x apart: each is a compiled program, and
# padding waste stays bounded (see chunk_for). Attention length is not a shape: the forward reads each
# slot up to its live length at run time, so one program per chunk serves every context length.
PREFILL_CHUNKS = (32, 128, 512)
# A chunk is at most this much work, counted in tokens at a prompt's start (Buckets.cost), unless it
# is the smallest: a request that arrives while prompts are read waits for the one chunk under way,
# and decoding rows for at most one chunk between their steps. The demo's 512-token chunk took
# seconds (docs/perf-log.md, "Prompts read side by side"), which every first token then waited for.
ROUND_TOKENS = 160
# The position where a prompt token's attention costs what its weights' products cost, so a token
# at position p costs 1 + p / ATTENTION_SPAN tokens at the start (fitted to the demo on a 2-core CPU:
# docs/perf-log.md, "Prompts read side by side").
ATTENTION_SPAN = 4096
# Decode batch sizes below the full slot count (each is one more program).
# Measured on a 2-core CPU (Qwen2.5-0.5B, float32, the forward alone): 2, 4 and 8 rows cost 1.22x,
# 1.15x and 1.38x one row (78 ms). One row runs its own program (the full batch would cost it 1.4x),
# and up to 4 rows run a 4-row program when there are more slots; more rows run the batch of every
# slot (idle rows masked).
SMALL_DECODE_BATCHES = (1, 4)
# Verification programs (engine.speculative): tokens per row, the row's last token and up to T - 1
# drafted ones. Each (rows, T) is one more compiled program; two lengths let a short draft pay a
# short program's cost.
VERIFY_TOKENS = (4, 8)
# A hybrid model verifies VERIFY_TOKENS_LINEAR only: its linear layers run a verification's positions
# one after another, so a verification past the kernel's one pass of rows costs far more than 1 + 3
# and pays only where nearly every draft is kept; and each verification program of a large hybrid
# stays resident beside the weights (docs/perf-log.md, "A verification's cost curve" and "The 27B
# drafts on a CPU host").
VERIFY_TOKENS_LINEAR = (4,)
# Decode batches up to this many rows may draft: a batch's verification costs its rows times its
# tokens in products, and past 4 rows it could not pay on the CPUs measured (docs/performance.md).
VERIFY_MAX_ROWS = 4


def verify_tokens(cfg: ModelConfig) -> tuple[int, ...]:
    """The verification lengths (tokens per row) a model's drafting builds. A hybrid model's
    verification keeps, for each position, what it did to its linear layers' states (a key, a decay
    and what it wrote, per head: engine.cache.keep_steps replays a row's kept ones), not the states
    (engine.memory.verify_step_bytes)."""
    return VERIFY_TOKENS_LINEAR if "linear" in cfg.layer_kinds else VERIFY_TOKENS


# Snapshots a slot keeps of its sequence's linear-layer state (hybrid models), besides the exact
# state at its end. Each is every linear layer's recurrent and conv state (about 75 MiB for
# Qwen3-Next-80B), held in host memory until the slot is saved to the host cache. Past this many,
# the oldest but the first go: the first is the system prompt and tools, which other sessions
# share; the latest are where the next turn of the same conversation resumes.
SLOT_SNAPSHOTS = 4

# ---- prompts read side by side --------------------------------------------------------------------

# While rows decode, the prompts being read take at most this share of the device's time (Pace), so
# a streaming answer keeps about 1 - share of its speed beside long prompts (the target is 0.7x; the
# host's work between calls is not counted, hence the margin: docs/perf-log.md).
PREFILL_SHARE = 0.2
# Within a tenant, a prompt passed over this many times in a row reads next: the tenant's shorter
# prompts arriving one after another slow its long prompt to one turn in MAX_PASSED + 1, never stop it.
MAX_PASSED = 4


@dataclass(frozen=True)
class Buckets:
    chunks: tuple[int, ...]       # prefill chunk lengths, ascending
    decode_rows: tuple[int, ...]  # decode batch sizes, ascending, the last one == slots

    @classmethod
    def for_ctx(cls, ctx: int, chunks: tuple[int, ...] = PREFILL_CHUNKS, slots: int = 1) -> "Buckets":
        """The chunk sizes that are not longer than ctx (at least the smallest one), and the decode
        batch sizes for `slots`."""
        usable = tuple(sorted(c for c in chunks if c <= ctx)) or (min(chunks),)
        rows = tuple(sorted({r for r in SMALL_DECODE_BATCHES if r < slots} | {slots}))
        return cls(usable, rows)

    def decode_batch(self, live: int) -> int:
        """Rows of the decode program for `live` generating requests."""
        return next(r for r in self.decode_rows if r >= live)

    def chunk_for(self, remaining: int, start: int = 0) -> int:
        """Chunk length for a prompt with `remaining` tokens still to run from position `start`,
        among the chunks whose cost there is within ROUND_TOKENS (the smallest always is): the
        smallest chunk that holds them all when at most half of it is padding, else the largest
        chunk that is filled (one call more costs one more read of the weights; a padded token
        costs its compute). It depends on the prompt alone, never on what else is read.
        One last token runs alone, in the one-row decode program: a prompt served from a cache but
        for its last token would otherwise pay for a whole padded chunk's attention over its context
        (at 11k positions, 31 padded rows cost more than the weights)."""
        if remaining == 1:
            return 1
        chunks = [c for c in self.chunks if c == self.chunks[0] or self.cost(c, start) <= ROUND_TOKENS]
        for c in chunks:
            if c >= remaining:
                if c <= 2 * remaining or c == chunks[0]:
                    return c
                break
        return max([c for c in chunks if c <= remaining] or [chunks[0]])

    @staticmethod
    def cost(chunk: int, start: int) -> float:
        """A chunk's work from position `start`, in tokens at a prompt's start: its tokens' products
        and their attention over the positions before them."""
        return chunk * (1 + (start + chunk / 2) / ATTENTION_SPAN)

    def min_fill(self, chunk: int) -> int:
        """The fewest real tokens chunk_for ever puts in `chunk`: at most half of a chunk is padding,
        except in the smallest one (and the one-token chunk)."""
        return 1 if chunk in (1, self.chunks[0]) else (chunk + 1) // 2


# ---- requests and slots --------------------------------------------------------------------------

@dataclass
class Sequence:
    """One request as the engine sees it: prompt ids, sampling, the tokens made so far and its slot.
    (mashbox.Request is the HTTP request; this is what the worker schedules.)"""
    rid: str
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    seed: int = 0                 # the seed actually used (the worker picks one when none is given)
    slot: int | None = None
    done: int = 0                 # prompt tokens in the slot's cache (reused + prefilled)
    cached: int = 0               # prompt tokens reused from a cached sequence (slot or host)
    cuts: list[int] = field(default_factory=list)   # turn boundaries of the prompt (positions)
    tenant: str = ""              # opaque label: whose bytes a saved state counts against
    output: list[int] = field(default_factory=list)
    finish: str | None = None
    first_sent: bool = False      # its first Step (with prompt_tokens) went out
    passed: int = 0               # chunks of other prompts read since its own last one
    times: dict = field(default_factory=dict)   # the worker's clock: arrived, started, first, last

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.prompt)


@dataclass
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)   # the sequence whose K/V the slot holds
    request: Sequence | None = None
    last_used: int = 0
    cuts: list[int] = field(default_factory=list)     # cut points of the request that ran last
    tenant: str = ""
    # Hybrid models: position -> the linear layers' state there (opaque here: the worker's arrays),
    # for positions of `tokens` (its end too, while it is not running, is its live state).
    snapshots: dict = field(default_factory=dict)

    def keep_snapshot(self, position: int, snapshot) -> None:
        self.snapshots[position] = snapshot
        if len(self.snapshots) > SLOT_SNAPSHOTS:
            del self.snapshots[sorted(self.snapshots)[1]]

    def exact(self, n: int) -> bool:
        """Whether the linear layers' state of the first n positions can be had here: a snapshot
        there, or the live state of a sequence that has stopped at n."""
        return n in self.snapshots or (self.request is None and n == len(self.tokens))


# ---- what the worker runs --------------------------------------------------------------------------

@dataclass
class Prefill:
    request: Sequence
    start: int                    # position of the chunk's first token (tokens already in the slot)
    tokens: list[int]             # the chunk's real tokens (the worker pads them to `chunk`)
    chunk: int
    snapshot: bool = False        # it ends at a cut point or the prompt: the worker snapshots there

    @property
    def last(self) -> bool:
        """This chunk ends the prompt: its logits give the first new token."""
        return self.start + len(self.tokens) == len(self.request.prompt)


@dataclass
class Decode:
    rows: list[Sequence]          # requests generating; each row feeds its last token
    batch: int                    # rows of the program (a decode bucket >= len(rows))


@dataclass
class Save:
    """Save what `slot` holds to the host cache before the slot is overwritten."""
    slot: int
    tokens: list[int]
    cuts: list[int]
    tenant: str
    # hybrid models: the slot's snapshots (position -> state); the worker adds the live state at
    # the end. None: a dense model.
    snapshots: dict | None = None


@dataclass
class Load:
    """Write the host cache's positions [start, tokens) of `request`'s prompt into its slot (the slot
    holds the first `start` already). `path` is the lookup's segments: a save in the same round must
    not evict them."""
    request: Sequence
    tokens: int
    path: list
    start: int = 0


@dataclass
class Plan:
    # Run in this order: saves (they read slots about to be overwritten), loads, copies, restores,
    # then the model.
    saves: list[Save] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (src slot, dst slot, tokens)
    restores: list[tuple[int, object]] = field(default_factory=list)  # (slot, snapshot to write)
    started: list[Sequence] = field(default_factory=list)            # requests new in a slot
    prefill: Prefill | None = None
    decode: Decode | None = None

    @property
    def empty(self) -> bool:
        return not (self.saves or self.loads or self.copies or self.restores or self.started
                    or self.prefill or self.decode)


@dataclass
class Pace:
    """The device time prompts take while rows decode. The worker says what each round's calls took
    (Scheduler.spent): a decode step earns prompts share / (1 - share) of its time, a chunk read
    beside decoding rows spends its own, and a chunk runs only when nothing is owed, so over a few
    rounds decode keeps 1 - share of the device. A chunk that ends its prompt (it gives the first
    token: a short prompt's only chunk) runs whatever is owed, and the prompts' later chunks repay
    it: a short request waits for the call under way, not for the repayment of a long prompt's
    chunk. With no row decoding nothing is owed."""
    share: float = PREFILL_SHARE
    owed: float = 0.0             # seconds of reading not yet repaid by decode steps

    def allows(self, decoding: bool, last: bool) -> bool:
        return not decoding or last or self.owed <= 0

    def spent(self, decode_s: float, prefill_s: float, decoding: bool) -> None:
        self.owed = max(0.0, self.owed + prefill_s - decode_s * self.share / (1 - self.share)) \
            if decoding else 0.0


@dataclass
class Emit:
    """New tokens of one request after a round, and its end if it ended."""
    request: Sequence
    tokens: list[int]
    finish: str | None = None


# ---- the scheduler -----------------------------------------------------------------------------------

class Scheduler:
    def __init__(self, slots: int, ctx: int, vocab_size: int, buckets: Buckets | None = None,
                 prefix_cache: bool = True, host: prefix.HostCache | None = None,
                 recurrent: bool = False):
        self.ctx = ctx
        # The model has linear layers: a prefix is reused only where their state is known.
        self.recurrent = recurrent
        self.vocab_size = vocab_size
        self.buckets = buckets or Buckets.for_ctx(ctx, slots=slots)
        self.prefix_cache = prefix_cache
        self.host = host if prefix_cache else None
        self.slots = [Slot(i) for i in range(slots)]
        self.waiting: deque[Sequence] = deque()
        self.requests: dict[str, Sequence] = {}    # every request not yet finished
        self.tick = 0
        self.prefix_queries = 0                   # prompt tokens looked up (cumulative)
        self.prefix_hits = 0                      # prompt tokens served from a cache (cumulative)
        self.host_hits = 0                        # of which from the host cache
        self.notes: list[tuple[str, str]] = []    # (rid, text) for the server log; the worker sends them
        self.pace = Pace()
        # tenant -> the work its chunks cost (Buckets.cost), beyond the least of the reading tenants'
        self.served: dict[str, float] = {}

    # -- intake ---------------------------------------------------------------------------------

    def check(self, rid: str, prompt: list[int], max_tokens: int, cuts: list[int] = ()) -> str | None:
        """Why a request cannot run (a message naming the field), or None."""
        if rid in self.requests:
            return f"rid: request {rid!r} is already running"
        if not prompt:
            return "prompt: is empty"
        if len(prompt) >= self.ctx:
            return (f"prompt: {len(prompt)} tokens do not fit the context of {self.ctx} tokens "
                    f"(at most {self.ctx - 1}, leaving room for one new token)")
        bad = next((t for t in prompt if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            return f"prompt: token id {bad!r} is outside the vocabulary [0, {self.vocab_size})"
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return f"max_tokens: must be >= 1, got {max_tokens!r}"
        bad = next((c for c in cuts if not (isinstance(c, int) and 0 < c <= len(prompt))), None)
        if bad is not None:
            return f"cuts: position {bad!r} is outside the prompt (1 to {len(prompt)})"
        return None

    def add(self, request: Sequence) -> None:
        """Queue a request that passed check()."""
        self.requests[request.rid] = request
        self.waiting.append(request)

    def cancel(self, rid: str) -> Sequence | None:
        """End a request now; its slot is free for the next round. None if it is not running."""
        request = self.requests.get(rid)
        if request is None:
            return None
        self._finish(request, "abort")
        return request

    # -- one round ------------------------------------------------------------------------------

    def schedule(self) -> Plan:
        """Every waiting request that can have a slot gets one; rows that are generating decode; and
        the prompt whose turn it is reads one chunk, if the pace allows it beside decoding rows."""
        plan = Plan()
        decoding = [s.request for s in self.slots if s.request and not s.request.prefilling]
        if decoding:
            plan.decode = Decode(decoding, self.buckets.decode_batch(len(decoding)))
        while self.waiting and any(s.request is None for s in self.slots):
            request = next((r for r in self.waiting if not self._follows(r)), None)
            if request is None:
                break
            self._assign(plan, request)
        readers = [s.request for s in self.slots if s.request and s.request.prefilling]
        if readers:
            reading = min(readers, key=self._turn)
            work = self._chunk(reading)
            if self.pace.allows(bool(decoding), work.last):
                plan.prefill = work
                self._took_turn(reading, readers, work)
        return plan

    def spent(self, plan: Plan, decode_s: float, prefill_s: float) -> None:
        """What the plan's decode step and prefill chunk took (seconds, the worker's clock): pacing."""
        self.pace.spent(decode_s, prefill_s, plan.decode is not None)

    def _turn(self, request: Sequence) -> tuple:
        """Sort key of the prompts being read: the least is read next. The tenant whose chunks have
        cost the least goes first (a stream of one tenant's short prompts takes no more than its
        share from another's long prompt); within a tenant, the fewest tokens left first."""
        return (self.served.get(request.tenant, 0.0), request.passed < MAX_PASSED,
                len(request.prompt) - request.done, request.slot)

    def _took_turn(self, reading: Sequence, readers: list[Sequence], work: Prefill) -> None:
        """The prompts passed over count it; the reader's tenant is counted the chunk's work. Work
        counted before the least any reading tenant has is forgotten: a tenant that comes back does
        not find credit saved up while it was away."""
        for r in readers:
            r.passed = 0 if r is reading else r.passed + 1
        floor = min(self.served.get(r.tenant, 0.0) for r in readers)
        self.served = {t: v - floor for t, v in self.served.items() if v > floor}
        self.served[reading.tenant] = self.served.get(reading.tenant, 0.0) + \
            self.buckets.cost(work.chunk, work.start)

    def _chunk(self, reading: Sequence) -> Prefill:
        """The next chunk of a prompt: as long as its rest and its next cut point allow."""
        start = reading.done
        end = len(reading.prompt)
        if self.snapshots:                       # the next cut point ends a chunk
            end = min((c for c in reading.cuts if c > start), default=end)
        chunk = self.buckets.chunk_for(end - start, start)
        tokens = reading.prompt[start:min(start + chunk, end)]
        # The prompt's end is snapshotted too: the next turn shares it (it ends with the
        # assistant turn's opening, which the answer follows) even when the answer differs.
        ends = start + len(tokens)
        return Prefill(reading, start, tokens, chunk, snapshot=self.snapshots and (
            ends in reading.cuts or ends == len(reading.prompt)))

    def _follows(self, request: Sequence) -> bool:
        """Whether a prompt being read shares more of this one's start than any cache serves now (at
        least a smallest chunk more) and has not read it yet: the request waits, then copies that
        start, rather than the two prompts reading it twice. A hybrid model's shared start ends at
        one of the other prompt's cut points, where its state is snapshotted."""
        readers = [s.request for s in self.slots if s.request and s.request.prefilling]
        if not self.prefix_cache or not readers:
            return False
        now = self._best_slot(request.prompt)[1]
        if self.host is not None:
            now = max(now, self.host.lookup(request.prompt).tokens)
        for other in readers:
            shared = prefix.reusable(other.prompt, request.prompt)
            if self.recurrent:
                shared = max((c for c in (*other.cuts, len(other.prompt)) if c <= shared), default=0)
            if other.done < shared and shared >= now + self.buckets.chunks[0]:
                return True
        return False

    @property
    def snapshots(self) -> bool:
        """Whether prefills snapshot the linear layers' state at cut points."""
        return self.recurrent and self.prefix_cache

    def _assign(self, plan: Plan, request: Sequence) -> None:
        """Give a waiting request a free slot, reusing the longest cached start of its
        prompt: a free slot that holds it is taken as is; one held by a running request is copied
        into the least recently used free slot; a longer start in the host cache is loaded into the
        chosen slot. What the chosen slot held beyond the part kept is saved to the host cache first.
        For a hybrid model the start reused ends where the linear layers' state is known."""
        free = [s for s in self.slots if s.request is None]
        self.waiting.remove(request)
        self.tick += 1
        slot, reuse, source, load, restore = min(free, key=lambda s: s.last_used), 0, None, None, None
        if self.prefix_cache:
            key, reuse, shared = self._best_slot(request.prompt)
            if key is not None:
                if self.slots[key].request is None:
                    slot = self.slots[key]
                else:
                    # the running request's slot is never rewritten below what it already holds
                    source = key
                held = self.slots[key]
                if self.recurrent and reuse < len(held.tokens):   # not its live state: a snapshot
                    restore = held.snapshots[reuse]
            stable = max((c for c in self.slots[key].cuts if c <= len(self.slots[key].tokens)),
                         default=0) if key is not None else 0
            if self.host is not None:
                hit = self.host.lookup(request.prompt)
                if hit.tokens > reuse:
                    reuse, source, restore, stable = hit.tokens, None, None, hit.stable
                    load = Load(request, hit.tokens, hit.path)
                if self.recurrent:
                    shared = max(shared, min(self.host.covered(request.prompt), len(request.prompt) - 1))
            self._note_divergence(request, shared if self.recurrent else reuse, stable)
            if shared > reuse:
                self.notes.append((request.rid, f"prompt shares {shared} tokens with a cached sequence, "
                                                f"but its linear layers' state is saved only up to "
                                                f"token {reuse}: {shared - reuse} tokens are prefilled "
                                                f"again for lack of a snapshot"))
        kept = prefix.common_prefix(slot.tokens, request.prompt[:reuse])
        if load is not None:
            load.start = kept
        if self.host is not None and len(slot.tokens) > kept:
            plan.saves.append(Save(slot.index, list(slot.tokens), list(slot.cuts), slot.tenant,
                                   dict(slot.snapshots) if self.recurrent else None))
        snapshots = {p: v for p, v in slot.snapshots.items() if p <= kept}
        if restore is not None:
            plan.restores.append((slot.index, restore))
            snapshots[reuse] = restore
        slot.snapshots = snapshots
        slot.tokens = slot.tokens[:reuse] if source is None and load is None else list(request.prompt[:reuse])
        if source is not None:
            plan.copies.append((source, slot.index, reuse))
        if load is not None:
            plan.loads.append(load)
            self.host_hits += reuse
        slot.request, slot.last_used = request, self.tick
        slot.cuts, slot.tenant = request.cuts, request.tenant
        request.slot, request.done, request.cached = slot.index, reuse, reuse
        self.prefix_queries += len(request.prompt)
        self.prefix_hits += reuse
        plan.started.append(request)

    def _best_slot(self, prompt: list[int]) -> tuple[int | None, int, int]:
        """(slot index, tokens it can serve, tokens it shares with the prompt) of the slot serving
        the most, the least recently used among equals. Dense: every shared token serves. Hybrid:
        only up to the longest position whose linear state the slot has (Slot.exact)."""
        if not self.recurrent:
            key, reuse = prefix.best_match([(s.index, s.tokens, s.last_used) for s in self.slots], prompt)
            return key, reuse, reuse
        best, best_n, best_tick, shared = None, 0, 0, 0
        for s in self.slots:
            n = prefix.reusable(s.tokens, prompt)
            shared = max(shared, n)
            n = max((p for p in (*s.snapshots, len(s.tokens)) if p <= n and s.exact(p)), default=0)
            if n > best_n or (n == best_n and n > 0 and s.last_used < best_tick):
                best, best_n, best_tick = s.index, n, s.last_used
        return best, best_n, shared

    def _note_divergence(self, request: Sequence, reuse: int, stable: int) -> None:
        """A prompt that continues a cached conversation past its first turn boundary but differs
        from it before that conversation's last turn boundary: an earlier turn rendered differently
        (a template instability) or was edited. The position is logged so it can be found."""
        first_cut = min(request.cuts, default=0)
        if first_cut and first_cut < reuse < min(stable, len(request.prompt) - 1):
            self.notes.append((request.rid, f"prompt diverged from a cached conversation at token "
                                            f"{reuse} of {len(request.prompt)} (cached up to its turn "
                                            f"boundary at {stable}); the rest is prefilled"))

    # -- results ----------------------------------------------------------------------------------

    def prefilled(self, work: Prefill, token: int | None, snapshot=None) -> list[Emit]:
        """The chunk ran; `token` is the first new token when it was the prompt's last chunk, and
        `snapshot` the linear layers' state after it when the Prefill asked for one."""
        request = work.request
        slot = self.slots[request.slot]
        slot.tokens.extend(work.tokens)         # what the slot holds now, even if cancelled meanwhile
        if snapshot is not None:
            slot.keep_snapshot(len(slot.tokens), snapshot)
        if request.finish is not None:          # cancelled while the chunk ran
            return []
        request.done += len(work.tokens)
        if not work.last:
            return []
        return [self._take(request, token)]

    def decoded(self, work: Decode, tokens: list) -> list[Emit]:
        """The decode step ran; tokens[i] is the new token of work.rows[i], or the list of its new
        tokens when the row carried a draft (engine.speculative): each one's position was run with
        the tokens before it, so the slot holds the keys/values of all but the last, as after that
        many decode steps. A stop or a length limit ends the row there; the rest is dropped."""
        emits = []
        for request, drawn in zip(work.rows, tokens):
            if request.finish is not None:
                continue
            slot = self.slots[request.slot]
            out: list[int] = []
            for token in drawn if isinstance(drawn, list) else [drawn]:
                slot.tokens.append(request.output[-1])
                emit = self._take(request, token)
                out += emit.tokens
                if emit.finish is not None:
                    break
            emits.append(Emit(request, out, request.finish))
        return emits

    def _take(self, request: Sequence, token: int) -> Emit:
        """A new token for a request: a stop id ends it (the id is not output), else it is output and
        max_tokens or a full context (prompt + output == ctx) end it with "length"."""
        if token in request.stop_ids:
            self._finish(request, "stop")
            return Emit(request, [], "stop")
        request.output.append(token)
        if len(request.output) >= request.max_tokens or \
                len(request.prompt) + len(request.output) >= self.ctx:
            self._finish(request, "length")
            return Emit(request, [token], "length")
        return Emit(request, [token])

    def _finish(self, request: Sequence, reason: str) -> None:
        request.finish = reason
        self.requests.pop(request.rid, None)
        if request.slot is None:
            self.waiting.remove(request)
            return
        slot = self.slots[request.slot]
        slot.request = None
        self.tick += 1
        slot.last_used = self.tick

    # -- numbers ------------------------------------------------------------------------------------

    @property
    def live(self) -> int:
        return sum(1 for s in self.slots if s.request is not None)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.live > 0

    def kv_used_tokens(self) -> int:
        """Tokens held for running requests (finished slots' tokens are kept only as a cache)."""
        return sum(len(s.tokens) for s in self.slots if s.request is not None)
