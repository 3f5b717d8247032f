"""Suffix decoding (Oliaro et al., NeurIPS 2025; vLLM's `method="suffix"`): propose what
followed the current suffix, weighted by how often it did, in this request's own text and
in earlier requests' outputs.

Two count tries of every substring of up to `max_depth` tokens:
  - a per-request one over prompt + output (freed when the request ends);
  - a global one over the outputs of the last `max_cached_requests` requests (FIFO: the
    oldest request's substrings are subtracted when a new one needs the room). It outlives
    each request, so a server that sees the same kind of request again drafts better.

Appending a token costs one step down from each of the (at most max_depth) suffixes still
growing: O(max_depth) dictionary updates, a constant that does not grow with the text
(`bench/suffix_update.py` measures it).

Drafting: for every match length m (the last m tokens, matched from the root), grow a draft
of at most min(k, m * max_spec_factor) tokens from the matched node, following children
while the path probability (product of child count / parent count) stays >= min_token_prob:
the most frequent child only (path mode), or best-first over all children (tree mode,
`use_tree_spec`). Each draft's score is the sum of its nodes' probabilities (its expected
accepted length); the best score over both tries and every m wins.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque

from ..sequence import Sequence
from .base import Drafts, Proposer


class Node:
    __slots__ = ("count", "children", "stamp")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}
        self.stamp = 0  # when the count last grew: the most recent wins a tie

    def best_child(self) -> tuple[int, Node] | None:
        if not self.children:
            return None
        return max(self.children.items(), key=lambda kv: (kv[1].count, kv[1].stamp))


class SuffixTree:
    """Counts of every substring of up to `max_depth` tokens of the sequences it holds."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.tokens: dict[int, list[int]] = {}  # sequence id -> its tokens
        self.active: dict[int, deque[Node]] = {}  # sequence id -> suffixes still growing
        self.clock = itertools.count(1)

    def __contains__(self, sid: int) -> bool:
        return sid in self.tokens

    def extend(self, sid: int, new: list[int]) -> None:
        if sid not in self.tokens:
            self.tokens[sid], self.active[sid] = [], deque()
        tokens, active, root = self.tokens[sid], self.active[sid], self.root
        for tok in new:
            active.append(root)  # a suffix starting at this token
            root.count += 1
            if len(active) > self.max_depth:
                active.popleft()  # the oldest suffix is max_depth long: it stops growing
            tokens.append(tok)
            stamp = next(self.clock)
            for i, node in enumerate(active):
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = Node()
                child.count += 1
                child.stamp = stamp
                active[i] = child

    def remove(self, sid: int) -> None:
        """Subtract every substring the sequence added (O(length x max_depth))."""
        tokens = self.tokens.pop(sid, None)
        self.active.pop(sid, None)
        if tokens is None:
            return
        self.root.count -= len(tokens)
        for start in range(len(tokens)):
            node = self.root
            for tok in tokens[start : start + self.max_depth]:
                child = node.children[tok]
                child.count -= 1
                if child.count == 0:
                    del node.children[tok]  # its whole subtree came from this sequence
                    break
                node = child

    def match(self, context: list[int]):
        """(m, node) for every match length m = 1, 2, .. of the context's suffix."""
        longest = min(len(context), self.max_depth - 1)
        for m in range(1, longest + 1):
            node = self.root
            for tok in context[len(context) - m :]:
                node = node.children.get(tok)
                if node is None:
                    return  # a longer suffix cannot match either
            yield m, node

    def draft(self, node: Node, max_tokens: int, min_prob: float,
              tree: bool) -> tuple[list[int], list[int], float]:  # fmt: skip
        """(tokens, parents as input indices, score) grown from `node`."""
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        if not tree:
            prob, parent = 1.0, 0
            while len(tokens) < max_tokens:
                best = node.best_child()
                if best is None or node.count <= 0:
                    break
                tok, child = best
                prob *= child.count / node.count
                if prob < min_prob:
                    break
                tokens.append(tok)
                parents.append(parent)
                parent = len(tokens)
                score += prob
                node = child
            return tokens, parents, score
        order = itertools.count()
        # (-path probability, tie-break, node, its parent's input index, its token)
        heap = [(-1.0, next(order), node, 0, -1)]
        while heap and len(tokens) < max_tokens:
            neg, _, at, parent, tok = heapq.heappop(heap)
            index = 0
            if tok >= 0:  # the matched node itself is the root, already in the text
                tokens.append(tok)
                parents.append(parent)
                score += -neg
                index = len(tokens)
            if at.count <= 0:
                continue
            for child_tok, child in at.children.items():
                p = -neg * child.count / at.count
                if p >= min_prob:
                    heapq.heappush(heap, (-p, next(order), child, index, child_tok))
        return tokens, parents, score


class SuffixProposer(Proposer):
    """Per-request and global suffix tries. Shared settings (depth, global size) are set
    once; each request's SpecConfig gives max_spec_factor, min_token_prob and tree mode."""

    name = "suffix"

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 10_000) -> None:
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.local: dict[int, SuffixTree] = {}
        self.synced: dict[int, int] = {}  # sequence id -> tokens already in its tries
        self.global_tree = SuffixTree(max_depth)
        self.global_order: OrderedDict = OrderedDict()  # FIFO of cached requests' ids
        self.clock = itertools.count()

    def add(self, seqs: list[Sequence]) -> None:
        # Only requests that may draft with suffix (suffix, auto) build a trie or reach the
        # global tree: the others pay nothing for this method.
        for seq in seqs:
            if seq.spec.method not in ("suffix", "auto"):
                continue
            tree = SuffixTree(self.max_depth)
            tree.extend(0, seq.tokens[: seq.prompt_len])
            self.local[seq.id] = tree
            self.synced[seq.id] = seq.prompt_len
            if self.max_cached > 0:
                self._cache(seq.id)

    def _sync(self, seq: Sequence) -> None:
        done = self.synced[seq.id]
        new = seq.tokens[done:]
        if new:
            self.local[seq.id].extend(0, new)
            if seq.id in self.global_order:
                self.global_tree.extend(seq.id, new)  # outputs only: the prompt stays local
            self.synced[seq.id] = len(seq.tokens)

    def speculate(self, seq: Sequence, k: int) -> tuple[list[int], list[int], float]:
        """The best draft for `seq` now: (tokens, parents, score)."""
        if k <= 0:
            return [], [], 0.0
        self._sync(seq)
        spec = seq.spec
        context = seq.tokens[-self.max_depth :]
        best: tuple[list[int], list[int], float] = ([], [], 0.0)
        for tree in (self.local[seq.id], self.global_tree):
            for m, node in tree.match(context):
                limit = min(k, int(m * spec.suffix_decoding_max_spec_factor + 1e-6))
                if limit <= 0:
                    continue
                got = tree.draft(node, limit, spec.suffix_decoding_min_token_prob,
                                 spec.use_tree_spec)  # fmt: skip
                if got[2] > best[2] or (got[2] == best[2] and len(got[0]) > len(best[0])):
                    best = got
        return best

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        return Drafts.from_trees([self.speculate(s, k)[:2] for s, k in zip(seqs, ks, strict=True)])

    def _cache(self, sid) -> None:
        self.global_order[sid] = None
        while len(self.global_order) > self.max_cached:
            old, _ = self.global_order.popitem(last=False)
            self.global_tree.remove(old)

    def cache_output(self, tokens: list[int]) -> None:
        """Add a finished request's output to the global tree (benchmarks replay a server's
        history with it)."""
        if self.max_cached > 0:
            sid = ("cached", next(self.clock))
            self._cache(sid)
            self.global_tree.extend(sid, list(tokens))

    def drop_last(self) -> None:
        """Take the most recently started request's output out of the global tree."""
        if self.global_order:
            sid, _ = self.global_order.popitem(last=True)
            self.global_tree.remove(sid)

    def remove(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.id in self.local:
                self._sync(seq)  # its last tokens count for later requests too
            self.local.pop(seq.id, None)
            self.synced.pop(seq.id, None)
