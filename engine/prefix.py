"""Which cached sequence holds the longest start of a new prompt.

Today the candidates are the slots of the device cache: a slot keeps the tokens of the last request
that ran there (prompt and output) after it ends, until another request takes the slot. A host-memory
cache of saved slot states (--cache-ram) would add its entries as further candidates here, with an
LRU under its byte cap; the scheduler's `_assign` is where its hit is written into the chosen slot.
"""
from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
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
