"""Speculative decoding: drafts from the conversation's own text or from the checkpoint's MTP layer,
checked in one weight pass, exact.

    Drafter(tokens)            an n-gram index over one request's tokens (prompt, then output):
                               propose(k) continues the latest earlier occurrence of its last tokens
    Speculator(...)            the worker's side: which draft length a decode round runs (or none),
                               whether the MTP layer drafts first (engine.model.draft), and each
                               row's better draft, from each program's measured time and each
                               row's recent acceptance, per drafter

Qwen3.5/3.8 checkpoints carry their own drafter, one MTP layer (engine.model's section on it): it
reads the trunk's last hidden state and the newest token and predicts the token after it, again
from its own output for further drafts. It costs a draft program per round (a layer and the LM head
per drafted token), so it drafts where its measured acceptance pays for that too; a row whose text
repeats keeps its n-gram draft where that is expected to give more (Speculator.choose).

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
(engine.model: its float32 operations each rounded once, whatever the program around them), and what
each position wrote into the state comes back with the logits (a few vectors per head, not a state);
once the sampler has decided, each row's slot replays its kept positions from the state it had with
the same operations and keeps the state of its last kept one (engine.cache.keep_steps), the one
those decode steps reach.

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

from engine.protocol import SPECULATIVE_MODES

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
MODES = SPECULATIVE_MODES


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
    """One request's drafting: its index, and how much of what each drafter proposed was kept (an
    exponential average of the share kept, and counts)."""
    drafter: Drafter
    acceptance: float = PRIOR_ACCEPTANCE          # the n-gram drafts'
    mtp_acceptance: float = PRIOR_ACCEPTANCE      # the MTP layer's
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0                               # verifications that carried a draft of it


@dataclass
class Round:
    """What a decode round drafts: T (1: a plain decode step), each row's n-gram draft, whether the
    MTP layer drafts T - 1 tokens for the rows first (then Speculator.choose takes each row's better
    draft), and each row's room (the most tokens it may still take)."""
    t: int
    ngram: list[list[int]]
    mtp: bool = False
    room: list[int] = field(default_factory=list)


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
    decode batch size), each program's measured seconds per call (and the MTP layer's draft program's
    per (rows, k)), and every running request's RowStats. off: why drafting is off (None: it runs
    where it pays); ngram and mtp: which drafters may run (mtp: the checkpoint's MTP layer is loaded).
    Since start: rows' verifications that carried a draft, tokens drafted and kept, by drafter."""
    off: str | None
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)   # batch rows -> T choices
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, T) -> s per call
    rows: dict[str, RowStats] = field(default_factory=dict)
    passed: dict[tuple, int] = field(default_factory=dict)   # rounds a near choice (rows, T, mtp) waited
    stale: set[tuple] = field(default_factory=set)          # (draft?, rows, T) estimates a recheck replaces
    ngram: bool = True
    mtp: bool = False
    draft_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, k) -> s per call
    # The share of MTP drafts kept lately, over every row: a new row's starting estimate, so a
    # drafter that keeps nothing (random weights) is not tried again by every request.
    mtp_prior: float = PRIOR_ACCEPTANCE
    verifications: dict[str, int] = field(default_factory=lambda: {"ngram": 0, "mtp": 0})
    drafted: dict[str, int] = field(default_factory=lambda: {"ngram": 0, "mtp": 0})
    accepted: dict[str, int] = field(default_factory=lambda: {"ngram": 0, "mtp": 0})

    def measured(self, rows: int, t: int, seconds: float, draft: bool = False) -> None:
        """A program of `rows` x `t` tokens ran in `seconds` (decode: t = 1; draft: the MTP layer's
        draft program of t tokens). A recheck's time replaces the stale estimate; other runs refine it."""
        table = self.draft_seconds if draft else self.seconds
        old = table.get((rows, t))
        stale = (draft, rows, t) in self.stale
        self.stale.discard((draft, rows, t))
        table[(rows, t)] = seconds if old is None or stale else old + TIME_WEIGHT * (seconds - old)

    def _stats(self, rid: str, prompt: list[int], output: list[int]) -> RowStats:
        stats = self.rows.get(rid)
        if stats is None:
            stats = self.rows[rid] = RowStats(Drafter(prompt + output), mtp_acceptance=self.mtp_prior)
        else:
            stats.drafter.extend(output[len(stats.drafter.tokens) - len(prompt):])
        return stats

    def plan(self, batch: int, rows: list[tuple[str, list[int], list[int], int]]) -> Round:
        """The Round for a decode batch of `batch` rows: rows are (rid, prompt, output so far, the
        most tokens it may still take). T = 1 (no drafts) unless a verification program (after the
        MTP layer's draft program, where it drafts) is expected to give more tokens per second than a
        decode step: each row's expected tokens from its better draft (expected_tokens, at its
        drafter's recent acceptance) over the programs' measured seconds."""
        choices = self.shapes.get(batch, ()) if self.off is None else ()
        rooms = [room for *_, room in rows]
        if not choices or (batch, 1) not in self.seconds:
            return Round(1, [[] for _ in rows], room=rooms)
        longest = max(choices) - 1
        stats = [self._stats(rid, prompt, output) for rid, prompt, output, _ in rows]
        drafts = [s.drafter.propose(min(longest, room - 1)) if self.ngram else [] for s, room in zip(stats, rooms)]
        best, rates = (1, False), {}
        rates[best] = len(rows) / self.seconds[(batch, 1)]
        for t in choices:
            for mtp in (False, True) if self.mtp else (False,):
                seconds = self.seconds.get((batch, t))
                if mtp and (batch, t - 1) in self.draft_seconds and seconds is not None:
                    seconds += self.draft_seconds[(batch, t - 1)]
                elif mtp or seconds is None:
                    continue
                rates[(t, mtp)] = sum(max(expected_tokens(min(len(d), t - 1), s.acceptance),
                                          expected_tokens(min(t - 1, room - 1), s.mtp_acceptance) if mtp else 0)
                                      for d, s, room in zip(drafts, stats, rooms)) / seconds
                if rates[(t, mtp)] > rates[best]:
                    best = (t, mtp)
        best = self._recheck(batch, best, rates, any(drafts) or self.mtp)
        return Round(best[0], [d[:best[0] - 1] for d in drafts], best[1], rooms)

    def _recheck(self, batch: int, best: tuple[int, bool], rates: dict, drafting: bool) -> tuple[int, bool]:
        """A program's time is only measured when it runs, so a high estimate (a noisy warm-up, a busy
        spell) would keep it from ever running again. A verification that was a near choice (its
        expected tokens per second at least RECHECK_SHARE of the best's) but was passed over for
        RECHECK_ROUNDS rounds runs once, and its time then replaces the estimate."""
        if not drafting:
            return best
        for option, rate in rates.items():
            if option != best and option[0] > 1 and rate >= RECHECK_SHARE * rates[best]:
                self.passed[(batch, *option)] = self.passed.get((batch, *option), 0) + 1
        stale = [o for o in rates if o[0] > 1 and self.passed.get((batch, *o), 0) >= RECHECK_ROUNDS]
        if not stale:
            return best
        t, mtp = best = max(stale, key=lambda o: self.passed[(batch, *o)])
        self.passed.pop((batch, t, mtp))
        self.stale.update({(False, batch, t)} | ({(True, batch, t - 1)} if mtp else set()))
        return best

    def choose(self, plan: Round, rids: list[str], mtp_drafts) -> tuple[list[list[int]], list[str]]:
        """Each row's draft for a Round whose MTP layer drafted (mtp_drafts [rows, T - 1]): the MTP
        layer's, or the n-gram one where that is expected to give more. Returns (drafts, drafters)."""
        drafts, sources = [], []
        for rid, ngram, mtp, room in zip(rids, plan.ngram, mtp_drafts, plan.room):
            stats = self.rows[rid]
            mtp = [int(x) for x in mtp[:min(plan.t - 1, room - 1)]]
            if expected_tokens(len(ngram), stats.acceptance) >= expected_tokens(len(mtp), stats.mtp_acceptance):
                drafts.append(ngram)
                sources.append("ngram")
            else:
                drafts.append(mtp)
                sources.append("mtp")
        return drafts, sources

    def verified(self, rid: str, drafted: int, kept: int, source: str = "ngram") -> None:
        """A row's draft of `drafted` tokens from `source` ("ngram", "mtp") ran; the first `kept`
        were kept."""
        stats = self.rows.get(rid)
        if drafted <= 0 or stats is None:
            return
        share = kept / drafted
        if source == "mtp":
            stats.mtp_acceptance += ACCEPTANCE_WEIGHT * (share - stats.mtp_acceptance)
            self.mtp_prior += ACCEPTANCE_WEIGHT * (share - self.mtp_prior)
        else:
            stats.acceptance += ACCEPTANCE_WEIGHT * (share - stats.acceptance)
        stats.drafted += drafted
        stats.accepted += kept
        stats.rounds += 1
        self.verifications[source] += 1
        self.drafted[source] += drafted
        self.accepted[source] += kept

    def finish(self, rid: str) -> tuple[int, int, int]:
        """A request ended: (tokens it drafted, tokens kept, verifications that carried a draft)."""
        stats = self.rows.pop(rid, None)
        return (stats.drafted, stats.accepted, stats.rounds) if stats is not None else (0, 0, 0)
