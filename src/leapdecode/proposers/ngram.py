"""Prompt lookup: propose what followed the last n tokens the previous time they occurred.

Each sequence keeps a hash index from every n-gram (min_n <= n <= max_n) to the position
just after its latest occurrence, updated as tokens are committed: O(max_n - min_n + 1)
work per new token, so the per-step cost does not grow with the length of the text.
"""

from __future__ import annotations

from ..errors import LeapDecodeError
from ..sequence import Sequence
from .base import Drafts, Proposer


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tables: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        self.indexed = 0  # continuation starts 1..indexed are registered

    def sync(self, tokens: list[int]) -> None:
        """Register every n-gram that ends before the last token (it has a continuation)."""
        for j in range(self.indexed + 1, len(tokens)):  # j = start of the continuation
            for n, table in self.tables.items():
                if j >= n:
                    table[tuple(tokens[j - n : j])] = j
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix (latest occurrence)."""
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            j = self.tables[n].get(tuple(tokens[length - n :]))
            if j is not None:
                return tokens[j : j + k]
        return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not (1 <= min_n <= max_n <= 32):
            raise LeapDecodeError(
                f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n}) <= 32"
            )
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[int, NgramIndex] = {}

    def start(self, seqs: list[Sequence], n_slots: int, max_len: int) -> None:
        for seq in seqs:
            self.index[seq.id] = NgramIndex(self.min_n, self.max_n)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        rows = []
        for seq, k in zip(seqs, ks, strict=True):
            index = self.index[seq.id]
            index.sync(seq.tokens)
            rows.append(index.lookup(seq.tokens, k) if k > 0 else [])
        return Drafts.from_lists(rows)

    def finish(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.index.pop(seq.id, None)
