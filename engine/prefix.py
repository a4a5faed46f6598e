"""Which cached sequence holds the longest start of a new prompt: a slot of the device cache, or the
host-memory cache of saved slot states (--cache-ram).

A slot keeps the tokens of the last request that ran there (prompt and output) after it ends, until
another request takes the slot. Before a slot is given to a prompt that diverges from what it holds,
what it holds is saved to host memory (HostCache.insert), so a session whose slot was taken by
another one still finds its conversation when its next turn comes.

The host cache is a tree of segments (a radix tree over token ids). A segment holds the K/V of a run
of consecutive positions; its parent holds the positions before it, so two conversations that share
a system prompt and tools share those bytes, and each copy is counted once. A saved sequence is cut
into segments at the cut points the server sends with each request (the template's turn
boundaries): eviction then drops the end of a conversation before its shared beginning. A hybrid
model's linear layers keep a recurrent state that cannot be trimmed back to an earlier position, so
its segments also end at those points and carry the state there (Segment.snapshot, taken while the
prompt was prefilled, and the live state at the end of a saved sequence); a hit for such a model
ends at a segment end with a snapshot. Dense models have none, so their snapshot_bytes stays 0.

Nothing here touches the device: the worker reads and writes slots (engine.cache) and hands this
module numpy arrays.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):     # long prompts: compare at once
        differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
        return int(differ[0]) if differ.size else n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable(held: Sequence[int], prompt: Sequence[int]) -> int:
    """Tokens of `prompt` a sequence `held` in the cache can serve. At least one prompt token is
    always left to run, because the model's logits for the first new token come from it."""
    return min(common_prefix(held, prompt), len(prompt) - 1)


def best_match(candidates: Sequence[tuple[int, Sequence[int], int]], prompt: Sequence[int]
               ) -> tuple[int | None, int]:
    """candidates: (key, tokens held, last used tick). Returns (key, reusable tokens) of the one
    serving the most tokens, the least recently used among equals; (None, 0) if none serves any."""
    best, best_n, best_tick = None, 0, 0
    for key, held, tick in candidates:
        n = reusable(held, prompt)
        if n > best_n or (n == best_n and n > 0 and tick < best_tick):
            best, best_n, best_tick = key, n, tick
    return best, best_n


# ---- the namespace: what saved states are valid for ---------------------------------------------

# Bumped whenever what a segment holds changes meaning (layout, cut rule): old states are then
# never read by a new engine.
CACHE_FORMAT = "kv-segments-2"


def namespace_id(component_set_sha: str, model_id: str, family: str, dtype: str, prefix_cache: bool) -> str:
    """The one id of everything a saved prompt state depends on: the model's component set (config,
    weights, tokenizer and chat template, as engine.identity hashes them), the model id and family,
    the compute dtype, the cache policy and the segment format. Two engines with the same id could
    share states; an entry tagged with another id is never used."""
    h = hashlib.sha256()
    for part in (CACHE_FORMAT, component_set_sha, model_id, family, dtype, f"prefix={prefix_cache}"):
        h.update(str(part).encode() + b"\0")
    return "mbx-" + h.hexdigest()[:16]


# ---- the host cache --------------------------------------------------------------------------------

def snapshot_nbytes(snapshot: list[dict] | None) -> int:
    return 0 if snapshot is None else sum(a.nbytes for layer in snapshot for a in layer.values())


@dataclass(eq=False)
class Segment:
    """Positions [start, start + len(tokens)) of a saved sequence whose earlier positions are its
    parent's. kv: per attention layer {"k", "v": [kv_heads, d, n]} and an int8 cache's
    {"k_scale", "v_scale": [kv_heads, n]} (the slot layout, positions last); snapshot: per linear
    layer {"conv", "state"} at position `end` (engine.cache.read_state)."""
    start: int
    tokens: np.ndarray                    # int32 token ids
    kv: list[dict]
    parent: "Segment | None"
    namespace: str
    tenant: str                           # who saved it: eviction takes from the biggest holder first
    last_used: int = 0
    at_cut: bool = False                  # its end is a cut point (a turn boundary) of the prompt
    snapshot: list[dict] | None = None    # linear layers' state at its end (None: dense, or not taken)
    children: list["Segment"] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Everything it holds: token ids, K/V and its snapshot (the cap counts them all)."""
        return self.tokens.nbytes + sum(a.nbytes for layer in self.kv for a in layer.values()) \
            + snapshot_nbytes(self.snapshot)


@dataclass
class HostHit:
    """A lookup's answer: the segments from the root that hold the first `tokens` prompt positions
    (the last one possibly in part), and the longest cut-point end among them."""
    path: list[Segment]
    tokens: int
    stable: int = 0                       # end of the deepest segment on the path ending at a cut


def _slice_kv(kv: list[dict], a: int, b: int) -> list[dict]:
    """Positions [a, b) of per-layer arrays, as copies that own their bytes (a view would keep the
    whole source alive while counting only its slice)."""
    return [{name: np.ascontiguousarray(x[..., a:b]) for name, x in layer.items()} for layer in kv]


@dataclass
class Reader:
    """K/V of a sequence's positions, read when a segment is made: read(a, b) returns positions
    [a, b) as per-layer arrays that own their bytes (a slot, engine.cache.read_slot), and
    position_bytes is what one position takes. A save then holds no more than the segment it is
    making beside what the cache keeps, and never reads a segment that has no room."""
    read: Callable[[int, int], list[dict]]
    position_bytes: int


def _held(kv: list[dict], kv_start: int) -> Reader:
    """A Reader over arrays already in host memory that hold positions [kv_start, ...)."""
    n = kv[0]["k"].shape[-1] if kv else 0
    per = sum(a.nbytes for layer in kv for a in layer.values()) // n if n else 0
    return Reader(lambda a, b: _slice_kv(kv, a - kv_start, b - kv_start), per)


def concat_kv(parts: list[list[dict]]) -> list[dict]:
    """Join per-layer arrays of consecutive position runs into one run."""
    return [{name: np.concatenate([p[i][name] for p in parts], axis=-1) for name in parts[0][i]}
            for i in range(len(parts[0]))]


def _joined(runs: list[tuple[int, list[dict]]]) -> tuple[int, list[dict]]:
    """Consecutive (first position, K/V) runs as one."""
    return runs[0] if len(runs) == 1 else (runs[0][0], concat_kv([kv for _, kv in runs]))


class HostCache:
    """Saved slot states in host memory, under a byte cap.

    Eviction takes a leaf segment (one no other segment continues): from the tenant holding the most
    bytes, the least recently used of its leaves. A tenant can so push another's states out only
    until it holds more than that tenant, never all of them in one burst; and the shared beginning
    of many conversations goes last, since it stops being a leaf only when everything after it has
    gone. Bytes are checked before each insert (evicting first), so they never exceed the cap.

    trimmable: a sequence's state can be cut back to any earlier position (attention K/V). A hybrid
    model's recurrent state cannot, so a hit ends at a segment end that has a snapshot. `bytes`
    counts everything held (the cap bounds it), `snapshot_bytes` the snapshots' part of it.
    """

    def __init__(self, cap_bytes: int, namespace: str, trimmable: bool = True):
        self.cap_bytes = cap_bytes
        self.namespace = namespace
        self.trimmable = trimmable
        self.roots: list[Segment] = []
        self.bytes = 0
        self.snapshot_bytes = 0
        self.evictions = 0
        self.tenant_bytes: dict[str, int] = {}
        self.tick = 0

    # -- reading ------------------------------------------------------------------------------------

    def _children(self, parent: Segment | None) -> list[Segment]:
        return self.roots if parent is None else parent.children

    def _walk(self, tokens: np.ndarray) -> tuple[list[Segment], int]:
        """Segments from the root matching the start of `tokens`, and how many tokens they match (the
        last segment may match in part). Segments of another namespace are never followed."""
        path, pos, parent = [], 0, None
        while pos < len(tokens):
            best, best_n = None, 0
            for child in self._children(parent):
                if child.namespace != self.namespace:
                    continue
                n = common_prefix(child.tokens, tokens[pos:pos + len(child.tokens)])
                if n > best_n:
                    best, best_n = child, n
            if best is None:
                break
            path.append(best)
            pos += best_n
            if best_n < len(best.tokens):
                break
            parent = best
        return path, pos

    def lookup(self, prompt: Sequence[int]) -> HostHit:
        """The longest saved start of `prompt` (leaving its last token to run, as `reusable` does)."""
        tokens = np.asarray(prompt, np.int32)
        path, n = self._walk(tokens)
        n = min(n, len(tokens) - 1)
        if not self.trimmable:                     # only whole segments with their state at the end
            while path and (path[-1].end > n or path[-1].snapshot is None):
                path.pop()
            n = path[-1].end if path else 0
        while path and path[-1].start >= n:
            path.pop()
        stable = max((s.end for s in path if s.at_cut), default=0)
        return HostHit(path, n if path else 0, stable)

    def touch(self, path: list[Segment]) -> None:
        self.tick += 1
        for s in path:
            s.last_used = self.tick

    def gather(self, hit: HostHit, start: int = 0) -> list[dict]:
        """The K/V of positions [start, hit.tokens) of the hit, as one run (runs())."""
        runs = self.runs(hit, start, join_below=hit.tokens + 1)
        return runs[0][1] if runs else _slice_kv(hit.path[0].kv, 0, 0)

    def runs(self, hit: HostHit, start: int = 0, join_below: int = 0) -> list[tuple[int, list[dict]]]:
        """(first position, K/V) of consecutive runs that cover positions [start, hit.tokens) of the
        hit, for write_slot (views into the segments' arrays: not to be kept): a slot that already
        holds the first `start` positions is sent only the rest. Runs shorter than join_below
        positions are joined until they reach it (fewer, fuller writes); a longer one stays a view.
        So a load copies less than twice join_below positions, never the whole prefix."""
        self.touch(hit.path)
        out, pending = [], []
        for s in hit.path:
            if s.end <= start:
                continue
            a, b = max(start, s.start), min(hit.tokens, s.end)
            if b - a >= join_below and pending:
                out.append(_joined(pending))
                pending = []
            pending.append((a, [{name: x[..., a - s.start:b - s.start] for name, x in layer.items()}
                                for layer in s.kv]))
            if b - pending[0][0] >= join_below:
                out.append(_joined(pending))
                pending = []
        if pending:
            out.append(_joined(pending))
        return out

    def covered(self, tokens: Sequence[int]) -> int:
        """How many leading positions of `tokens` are already saved."""
        return self._walk(np.asarray(tokens, np.int32))[1]

    # -- writing ------------------------------------------------------------------------------------

    def _split(self, seg: Segment, n: int) -> Segment:
        """Cut `seg` after its first n tokens; returns the new first part (seg keeps the rest)."""
        head = Segment(seg.start, seg.tokens[:n].copy(), _slice_kv(seg.kv, 0, n), seg.parent,
                       seg.namespace, seg.tenant, seg.last_used, at_cut=False)
        siblings = self._children(seg.parent)
        siblings[siblings.index(seg)] = head
        seg.start, seg.tokens, seg.kv, seg.parent = seg.start + n, seg.tokens[n:].copy(), \
            _slice_kv(seg.kv, n, len(seg.tokens)), head
        head.children.append(seg)
        return head

    def insert(self, tokens: Sequence[int], kv: list[dict] | Reader, cuts: Sequence[int], tenant: str,
               protect: Sequence[Segment] = (), kv_start: int = 0,
               snapshots: dict[int, list[dict]] | None = None) -> int:
        """Save positions [0, len(tokens)) of a sequence; kv holds positions [kv_start, len(tokens))
        (or is a Reader of them), and kv_start is at most what is saved already (covered()). The new
        part is cut into segments at `cuts` and at the positions of `snapshots` (position -> the
        linear layers' state there), and each segment ending at one of them carries it; a saved
        segment that ends at one and has none yet is given it. Each segment's K/V is taken (read)
        only once the cache has made room for it. Evicts (never a segment in `protect`, nor one on this
        sequence's own path) to stay under the cap; saves as much of the start as fits. Returns the
        number of leading positions saved now (old and new)."""
        tokens = np.asarray(tokens, np.int32)
        snapshots = {p: s for p, s in (snapshots or {}).items() if 0 < p <= len(tokens)}
        path, pos = self._walk(tokens)
        if pos < kv_start:
            raise ValueError(f"insert: positions [{pos}, {kv_start}) are neither saved nor given")
        if path and pos < path[-1].end:             # ends inside a segment: cut it there
            path[-1] = self._split(path[-1], pos - path[-1].start)
        self.touch(path)
        keep = set(map(id, protect)) | set(map(id, path))
        for at in sorted(p for p in snapshots if p <= pos):
            path = self._attach(path, at, snapshots[at], keep)
        parent = path[-1] if path else None
        cuts = set(cuts)
        ends = sorted({c for c in cuts | set(snapshots) if pos < c < len(tokens)} | {len(tokens)})
        reader = kv if isinstance(kv, Reader) else _held(kv, kv_start)
        for end in ends:
            if end <= pos:
                continue
            need = (end - pos) * (tokens.itemsize + reader.position_bytes) + \
                snapshot_nbytes(snapshots.get(end))
            if not self._make_room(need, keep):
                break
            seg = Segment(pos, tokens[pos:end].copy(), reader.read(pos, end), parent, self.namespace,
                          tenant, self.tick, at_cut=end in cuts, snapshot=snapshots.get(end))
            self._children(parent).append(seg)
            self._count(seg, +1)
            keep.add(id(seg))
            parent, pos = seg, end
        return pos

    def _attach(self, path: list[Segment], at: int, snapshot: list[dict], keep: set[int]
                ) -> list[Segment]:
        """Give the saved segment ending at position `at` of `path` its snapshot (cutting the one
        that holds `at` there first) unless it has one; returns the path with the cut."""
        i = next(i for i, s in enumerate(path) if s.start < at <= s.end)
        seg = path[i]
        if seg.end == at and seg.snapshot is not None:
            return path
        need = snapshot_nbytes(snapshot)
        if not self._make_room(need, keep):
            return path
        if seg.end > at:
            head = self._split(seg, at - seg.start)
            path = path[:i] + [head] + path[i:]
            keep.add(id(head))
            seg = head
        seg.snapshot = snapshot
        self.bytes += need
        self.snapshot_bytes += need
        self.tenant_bytes[seg.tenant] = self.tenant_bytes.get(seg.tenant, 0) + need
        return path

    def _count(self, seg: Segment, sign: int) -> None:
        """Add (+1) or take away (-1) a segment's bytes from the totals."""
        self.bytes += sign * seg.nbytes
        self.snapshot_bytes += sign * snapshot_nbytes(seg.snapshot)
        self.tenant_bytes[seg.tenant] = self.tenant_bytes.get(seg.tenant, 0) + sign * seg.nbytes
        if not self.tenant_bytes[seg.tenant]:
            del self.tenant_bytes[seg.tenant]

    def _make_room(self, need: int, keep: set[int]) -> bool:
        """Evict until `need` more bytes fit under the cap; False if they cannot."""
        if need > self.cap_bytes:
            return False
        while self.bytes + need > self.cap_bytes:
            victim = self._victim(keep)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _victim(self, keep: set[int]) -> Segment | None:
        leaves = [s for s in self.segments() if not s.children and id(s) not in keep]
        if not leaves:
            return None
        return min(leaves, key=lambda s: (-self.tenant_bytes.get(s.tenant, 0), s.last_used))

    def _evict(self, seg: Segment) -> None:
        self._children(seg.parent).remove(seg)
        self._count(seg, -1)
        self.evictions += 1

    def segments(self) -> list[Segment]:
        """Every segment, parents before children."""
        out, stack = [], list(self.roots)
        while stack:
            s = stack.pop()
            out.append(s)
            stack.extend(s.children)
        return out
