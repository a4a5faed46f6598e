"""Speculative decoding from the conversation's own text: drafts without a draft model, checked in one
weight pass, exact.

    Drafter(tokens)            an n-gram index over one request's tokens (prompt, then output):
                               propose(k) continues the latest earlier occurrence of its last tokens
    Speculator(...)            the worker's side: which draft length a decode round runs (or none),
                               from each program's measured time and each row's recent acceptance

Coding agents re-emit text already in their context (an edit's old text copied from the file just
read, a rewritten file, paths and identifiers of earlier turns). A decode row carries its draft: the
row's last token and up to k drafted tokens run as k + 1 positions of one call, which writes their
keys and values and gives the logits at each. The sampler draws at every position exactly as
sequential decoding would (the same penalties, the same random key for the same output step,
engine.sampler.verify) and a drafted token is kept while it equals the token drawn before it: the
first mismatch is replaced by the drawn token, and the positions written past it are garbage the
slot overwrites later (its tokens say how far it is valid). The output is therefore the tokens decoding
without drafts gives, greedy or seeded, and for a deterministic draft this is the standard
acceptance rule (a draft token is kept with the target's probability of it; otherwise the token
comes from the target with the draft token removed).

That holds only where a position's numbers do not depend on how many positions run beside it: the
native kernel's products are exact integer sums per row and its attention reads each query row on its
own (engine.attention), up to products.INT8_ROWS_MAX_ROWS rows. Elsewhere (XLA's float products,
accelerators) drafting is off: the worker says why at start (Speculator.off).

A hybrid model's linear layers hold a recurrent state and a conv window that a verification advances
past every drafted token. Its T positions run one at a time, in the arithmetic of T decode steps
(engine.model: its float32 operations each rounded once, whatever the program around them), and the
state after each position comes back with the logits; once the sampler has decided, each row's slot
keeps the state of its last kept position (engine.cache.keep_steps: selected, not recomputed).

Whether drafting pays is measured, not assumed: a verification program of T tokens per row costs
more than a decode step (how much depends on the CPU's integer throughput: docs/performance.md), so
a round drafts only when the rows' expected accepted tokens per second beat plain decoding's, with
each program's time measured as it runs (seeded at warm-up) and each row's acceptance rate its own
recent history. Rows with no match have nothing to draft and cost nothing: text with no repetition decodes
as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The n-gram lengths the drafter matches, longest first: a longer match predicts its continuation
# better; two tokens still find an identifier or a line being copied.
NGRAM_SIZES = (4, 3, 2)
# A row's acceptance rate before it has drafted (the share of drafted tokens kept), and how fast its
# estimate follows what it keeps: an exponential average over its recent verifications.
PRIOR_ACCEPTANCE = 0.5
ACCEPTANCE_WEIGHT = 0.3
# How fast a program's measured time follows its latest runs (exponential average).
TIME_WEIGHT = 0.2
# A program's time is only measured when it runs, so a high estimate (a noisy warm-up, a busy spell)
# would keep it from ever running again. A verification that was a near choice (its expected tokens
# per second at least RECHECK_SHARE of the best's) but was passed over for RECHECK_ROUNDS rounds runs
# once, and its time then replaces the estimate: at most one round in RECHECK_ROUNDS is a worse
# choice than the best.
RECHECK_ROUNDS = 32
RECHECK_SHARE = 0.6
MODES = ("auto", "off")


class Drafter:
    """An index over one request's tokens: for each n-gram (NGRAM_SIZES) the position after its
    latest occurrence that has a continuation. propose(k) takes the longest n-gram ending the
    tokens that occurred before and returns up to k tokens that followed it there."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            i = len(self.tokens) - 1          # the new token continues the n-grams ending before it
            for n in NGRAM_SIZES:
                if i >= n:
                    self.after[tuple(self.tokens[i - n:i])] = i

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in NGRAM_SIZES:
            if end >= n:
                at = self.after.get(tuple(self.tokens[end - n:]))
                if at is not None:
                    return self.tokens[at:at + k]
        return []


@dataclass
class RowStats:
    """One request's drafting: its index and how much of what it drafted was kept."""
    drafter: Drafter
    acceptance: float = PRIOR_ACCEPTANCE
    drafted: int = 0
    accepted: int = 0


def kept_counts(picks, drafts, lengths):
    """Each row's kept drafts after a verification: the drafted tokens (drafts[b, :lengths[b] - 1])
    before the first one that differs from the token drawn at its position (picks [B, T]). The row's
    new tokens are picks[b, :kept + 1], and its last kept position is kept[b]. numpy int [B]."""
    picks, drafts, lengths = np.asarray(picks), np.asarray(drafts), np.asarray(lengths)
    drafted = np.arange(picks.shape[1])[None] < (lengths - 1)[:, None]
    return np.cumprod(drafted & (picks == drafts), axis=1).sum(axis=1)


def expected_tokens(draft: int, acceptance: float) -> float:
    """Tokens a verification gives a row with `draft` drafted tokens when each is kept with
    probability `acceptance` given the ones before it were: the drawn token plus the kept run."""
    return 1.0 + sum(acceptance ** i for i in range(1, draft + 1))


@dataclass
class Speculator:
    """The worker's drafting state: the verification programs it has (`shapes`: (rows, T) per
    decode batch size), each program's measured seconds per call, and every running request's
    RowStats. off: why drafting is off (None: it runs where it pays)."""
    off: str | None
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)   # batch rows -> T choices
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, T) -> s per call
    rows: dict[str, RowStats] = field(default_factory=dict)
    passed: dict[tuple[int, int], int] = field(default_factory=dict)   # rounds a near choice waited
    # Since start: rows' verifications that carried a draft, tokens drafted, and tokens kept.
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0

    def measured(self, rows: int, t: int, seconds: float) -> None:
        """A program of `rows` x `t` tokens ran in `seconds` (decode: t = 1). A recheck's time
        replaces the stale estimate; other runs refine it."""
        old = self.seconds.get((rows, t))
        stale = self.passed.pop((rows, t), 0) >= RECHECK_ROUNDS
        self.seconds[(rows, t)] = seconds if old is None or stale else old + TIME_WEIGHT * (seconds - old)

    def plan(self, batch: int, rows: list[tuple[str, list[int], list[int], int]]
             ) -> tuple[int, list[list[int]]]:
        """(T, each row's draft) for a decode batch of `batch` rows: rows are (rid, prompt, output
        so far, the most tokens it may still take). T = 1 (no drafts) unless a verification program
        is expected to give more tokens per second than a decode step."""
        choices = self.shapes.get(batch, ()) if self.off is None else ()
        if not choices or (batch, 1) not in self.seconds:
            return 1, [[] for _ in rows]
        longest = max(choices) - 1
        drafts, rates = [], []
        for rid, prompt, output, room in rows:
            stats = self.rows.get(rid)
            if stats is None:
                stats = self.rows[rid] = RowStats(Drafter(prompt + output))
            else:
                stats.drafter.extend(output[len(stats.drafter.tokens) - len(prompt):])
            drafts.append(stats.drafter.propose(min(longest, room - 1)))
            rates.append(stats.acceptance)
        best_t, best = 1, len(rows) / self.seconds[(batch, 1)]
        rates_by_t = {}
        for t in choices:
            seconds = self.seconds.get((batch, t))
            if seconds is None:
                continue
            rates_by_t[t] = rate = sum(expected_tokens(min(len(d), t - 1), a)
                                       for d, a in zip(drafts, rates)) / seconds
            if rate > best:
                best_t, best = t, rate
        if any(drafts):
            for t, rate in rates_by_t.items():
                if t != best_t and rate >= RECHECK_SHARE * best:
                    self.passed[(batch, t)] = self.passed.get((batch, t), 0) + 1
            stale = [t for t in rates_by_t if self.passed.get((batch, t), 0) >= RECHECK_ROUNDS]
            if stale:
                best_t = max(stale, key=lambda t: self.passed[(batch, t)])
        return best_t, [d[:best_t - 1] for d in drafts]

    def verified(self, rid: str, drafted: int, kept: int) -> None:
        """A row's draft of `drafted` tokens ran; the first `kept` were kept."""
        stats = self.rows.get(rid)
        if drafted <= 0 or stats is None:
            return
        stats.acceptance += ACCEPTANCE_WEIGHT * (kept / drafted - stats.acceptance)
        stats.drafted += drafted
        stats.accepted += kept
        self.verifications += 1
        self.drafted += drafted
        self.accepted += kept

    def finish(self, rid: str) -> tuple[int, int]:
        """A request ended: (tokens it drafted, tokens kept)."""
        stats = self.rows.pop(rid, None)
        return (stats.drafted, stats.accepted) if stats is not None else (0, 0)
