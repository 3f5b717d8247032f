"""Prompt lookup: propose what followed the last n tokens where they occurred before.

Each sequence keeps a hash index from every n-gram (min_n <= n <= max_n) to the positions
just after its first and its latest occurrence, updated as tokens are committed:
O(max_n - min_n + 1) work per new token, so the per-step cost does not grow with the text.

The longest matching n-gram wins. Its latest occurrence is proposed when it leaves k tokens
to copy (recent text predicts repetitive output best); otherwise the first occurrence, when
that leaves more (while the output copies a block of the prompt, the latest occurrence is
often the copy being written, a few tokens back, and the first is the source).

Tree mode (`use_tree_spec`): every distinct continuation of every matching n-gram size
(latest and first occurrence, longest n first) goes into one trie of at most k nodes, and
the target verifies them together: when the latest copy and the source disagree, one of
them is still accepted.
"""

from __future__ import annotations

from ..sequence import Sequence
from .base import FREE_SIZING, Drafts, Offer, Proposer


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # n -> n-gram -> start of the continuation after its first / its latest occurrence
        self.first: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.latest: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        self.indexed = 0  # continuation starts 1..indexed are registered

    def sync(self, tokens: list[int]) -> None:
        """Register every n-gram that ends before the last token (it has a continuation).
        A prompt is registered with dict updates over zipped slices (the n-grams are built
        and stored in C: a Python loop per token cost about a millisecond a prompt)."""
        hi = len(tokens)  # continuation starts j = lo .. hi - 1
        for n in self.first:
            lo = max(self.indexed + 1, n)
            if lo >= hi:
                continue
            # key j = tuple(tokens[j - n : j]), its i-th element tokens[j - n + i]
            keys = list(zip(*(tokens[lo - n + i : hi - n + i] for i in range(n)), strict=True))
            starts = range(lo, hi)
            self.latest[n].update(zip(keys, starts, strict=True))  # a later occurrence overwrites
            first = self.first[n]
            if not first:  # a prompt: the earliest occurrence of each, in one pass
                self.first[n] = dict(zip(reversed(keys), reversed(starts), strict=True))
            else:  # a step's few tokens: O(1) each, as a merge would copy the table
                for key, j in zip(keys, starts, strict=True):
                    first.setdefault(key, j)
        self.indexed = max(self.indexed, hi - 1)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix (see the module notes)."""
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """`lookup`'s draft and the size of the n-gram it matched (0: none)."""
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            key = tuple(tokens[length - n :])
            latest = self.latest[n].get(key)
            if latest is not None:
                first = self.first[n][key]
                # latest leaves k tokens to copy, or there is no earlier occurrence
                start = latest if length - latest >= k or first == latest else first
                return tokens[start : start + k], n
        return [], 0

    def candidates(self, tokens: list[int], k: int) -> list[list[int]]:
        """Every distinct continuation (up to k tokens) of every matching suffix, the one
        `lookup` proposes first, then by longer n-gram, latest before first occurrence."""
        length = len(tokens)
        out, seen = [], set()
        best = self.lookup(tokens, k)
        if best:
            out.append(best)
            seen.add(tuple(best))
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            key = tuple(tokens[length - n :])
            if key not in self.latest[n]:
                continue
            for start in (self.latest[n][key], self.first[n][key]):
                cand = tokens[start : start + k]
                if cand and tuple(cand) not in seen:
                    seen.add(tuple(cand))
                    out.append(cand)
        return out


def build_trie(candidates: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """Merge token lists into one tree of at most `budget` nodes: (tokens, parents), parents
    as input indices (0 = the last committed token; see tree.py). Earlier lists win the
    budget; a shared prefix costs nothing."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent input index, token) -> input index
    for cand in candidates:
        node = 0
        for tok in cand:
            nxt = children.get((node, tok))
            if nxt is None:
                if len(tokens) >= budget:
                    break
                tokens.append(tok)
                parents.append(node)
                nxt = len(tokens)
                children[(node, tok)] = nxt
            node = nxt
    return tokens, parents


class NgramProposer(Proposer):
    """Prompt lookup; each request's n-gram sizes come from its SpecConfig
    (`prompt_lookup_min` / `prompt_lookup_max`)."""

    name = "ngram"
    prior = 0.5
    free = True
    sizing = FREE_SIZING

    def __init__(self) -> None:
        self.index: dict[int, NgramIndex] = {}

    def offer(self, seq: Sequence, budget: int) -> Offer | None:
        """The chain prompt lookup finds, scored by the size of the n-gram it matched."""
        chain, n = self.match(seq, budget)
        return Offer(len(chain), bucket=n, chain=chain) if chain else None

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.index[seq.id] = NgramIndex(seq.spec.prompt_lookup_min, seq.spec.prompt_lookup_max)

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens to propose for `seq` now (empty when no n-gram matches)."""
        return self.match(seq, k)[0]

    def match(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """`lookup`'s draft and the size of the n-gram it matched (0: none)."""
        if k <= 0:
            return [], 0
        index = self.index[seq.id]
        index.sync(seq.tokens)
        return index.match(seq.tokens, k)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        if not any(s.spec.use_tree_spec for s in seqs):
            return Drafts.from_lists([self.lookup(s, k) for s, k in zip(seqs, ks, strict=True)])
        trees = []
        for s, k in zip(seqs, ks, strict=True):
            if not s.spec.use_tree_spec:
                chain = self.lookup(s, k)
                trees.append((chain, list(range(len(chain)))))
                continue
            index = self.index[s.id]
            index.sync(s.tokens)
            trees.append(build_trie(index.candidates(s.tokens, k) if k > 0 else [], k))
        return Drafts.from_trees(trees)

    def remove(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.index.pop(seq.id, None)
