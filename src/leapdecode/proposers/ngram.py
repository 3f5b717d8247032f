"""Prompt lookup: propose what followed the last n tokens where they occurred before.

Each sequence keeps a hash index from every n-gram (min_n <= n <= max_n) to the positions
just after its first and its latest occurrence, updated as tokens are committed:
O(max_n - min_n + 1) work per new token, so the per-step cost does not grow with the text.

The longest matching n-gram wins. Its latest occurrence is proposed when it leaves k tokens
to copy (recent text predicts repetitive output best); otherwise the first occurrence, when
that leaves more (while the output copies a block of the prompt, the latest occurrence is
often the copy being written, a few tokens back, and the first is the source).
"""

from __future__ import annotations

from ..sequence import Sequence
from .base import Drafts, Proposer


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # n -> n-gram -> [first, latest] start of the continuation
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        self.indexed = 0  # continuation starts 1..indexed are registered

    def sync(self, tokens: list[int]) -> None:
        """Register every n-gram that ends before the last token (it has a continuation)."""
        for j in range(self.indexed + 1, len(tokens)):  # j = start of the continuation
            for n, table in self.tables.items():
                if j >= n:
                    seen = table.get(key := tuple(tokens[j - n : j]))
                    if seen is None:
                        table[key] = [j, j]
                    else:
                        seen[1] = j
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix (see the module notes)."""
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            seen = self.tables[n].get(tuple(tokens[length - n :]))
            if seen is not None:
                first, latest = seen
                # latest leaves k tokens to copy, or there is no earlier occurrence
                start = latest if length - latest >= k or first == latest else first
                return tokens[start : start + k]
        return []


class NgramProposer(Proposer):
    """Prompt lookup; each request's n-gram sizes come from its SpecConfig
    (`prompt_lookup_min` / `prompt_lookup_max`)."""

    name = "ngram"

    def __init__(self) -> None:
        self.index: dict[int, NgramIndex] = {}

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.index[seq.id] = NgramIndex(seq.spec.prompt_lookup_min, seq.spec.prompt_lookup_max)

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens to propose for `seq` now (empty when no n-gram matches)."""
        if k <= 0:
            return []
        index = self.index[seq.id]
        index.sync(seq.tokens)
        return index.lookup(seq.tokens, k)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        return Drafts.from_lists([self.lookup(s, k) for s, k in zip(seqs, ks, strict=True)])

    def remove(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.index.pop(seq.id, None)
