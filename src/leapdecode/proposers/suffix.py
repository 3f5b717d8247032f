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

leapdecode's own addition (chains, `suffix_decoding_char_match`): the request's text is also
matched on its characters (char_lookup.py), which finds the source again right after an edit
changed the tokens; that draft wins when it is longer.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque

from ..errors import LeapDecodeError
from ..sequence import Sequence
from .base import FREE_SIZING, Drafts, Offer, Parts, Proposer
from .char_lookup import CharIndex


class Node:
    """The end of an edge of `length` tokens, src[start : start + length]: src is the token
    list of a sequence where the edge occurs (the list itself, so the tokens stay readable
    after that sequence leaves the tree). Every string along an edge occurs `count` times."""

    __slots__ = ("count", "children", "stamp", "src", "start", "length")

    def __init__(self, src: list[int] | None = None, start: int = 0, length: int = 0) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}
        self.stamp = 0  # when the count last grew: the most recent wins a tie
        self.src, self.start, self.length = src, start, length

    def token(self, offset: int) -> int:
        return self.src[self.start + offset]

    def split(self) -> Node:
        """Cut this edge's first token off as a node of its own above it (the rest of the
        edge its only child), and return that node: a 1-token edge about to occur once more."""
        head = Node(self.src, self.start, 1)
        head.count = self.count
        self.start += 1
        self.length -= 1
        head.children[self.token(0)] = self
        return head

    def best_child(self) -> tuple[int, Node] | None:
        if not self.children:
            return None
        return max(self.children.items(), key=lambda kv: (kv[1].count, kv[1].stamp))


class SuffixTree:
    """Counts of every substring of up to `max_depth` tokens of the sequences it holds, as a
    trie whose single-occurrence tails are compressed into one edge: memory grows with the
    tokens and the repeated substrings, not with tokens x depth."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.tokens: dict = {}  # sequence id -> its tokens
        self.active: dict = {}  # sequence id -> nodes where its growing suffixes end
        self.clock = itertools.count(1)

    def __contains__(self, sid) -> bool:
        return sid in self.tokens

    def extend(self, sid, new: list[int]) -> None:
        """Append `new` to sequence `sid`: each of its (at most max_depth) growing suffixes
        steps down by one token. The step is written out in the loop (a prompt of a few
        hundred tokens is thousands of steps; a method call each made this 3x slower)."""
        if sid not in self.tokens:
            if not self.root.children:  # an empty trie (a request's own, given its prompt)
                self._fill(sid, new)
                return
            self.tokens[sid], self.active[sid] = [], deque()
        seq, active, root = self.tokens[sid], self.active[sid], self.root
        max_depth, clock = self.max_depth, self.clock
        for tok in new:
            j = len(seq)
            seq.append(tok)
            active.append(root)  # a suffix starting at this token
            root.count += 1
            if len(active) > max_depth:
                active.popleft()  # the oldest suffix is max_depth long: it stops growing
            stamp = next(clock)
            for i, node in enumerate(active):
                # the suffix ending at `node` grows by tok (seq[j]); active[i]: where it ends now
                child = node.children.get(tok)
                if child is None:
                    if (
                        node.count == 1
                        and node is not root
                        and not node.children
                        and node.src is seq
                        and node.start + node.length == j
                    ):
                        node.length += 1  # this suffix's own tail: the edge runs on with the text
                        node.stamp = stamp
                        continue
                    child = node.children[tok] = Node(seq, j, 1)
                elif child.length > 1:  # split: a 1-token edge that now occurs once more
                    node.children[tok] = child = child.split()
                child.count += 1
                child.stamp = stamp
                child.src, child.start = seq, j  # its latest occurrence
                active[i] = child

    def _fill(self, sid, new: list[int]) -> None:
        """extend() of an empty trie by a whole sequence, one suffix after another instead of
        one token after another: the same trie (counts, edges, latest occurrences, stamps)
        and the same growing suffixes, as every node's occurrences still arrive in text
        order. A suffix stops costing once it leaves the text seen before: its unique rest
        becomes one edge at once, where extend() walked it a token at a time (a prompt's
        suffixes share a few tokens on average, not max_depth: the bench prompts, 356 tokens
        on average, 2.05 -> 1.3 ms each)."""
        seq = self.tokens[sid] = list(new)
        active = self.active[sid] = deque()
        depth, n, root = self.max_depth, len(seq), self.root
        base = next(self.clock)  # token j's stamp is base + j, as extend() counts them
        self.clock = itertools.count(base + n)
        root.count += n
        for i in range(n):
            end = min(i + depth, n)  # suffix i: seq[i:end]
            node, j = root, i
            while j < end:
                tok = seq[j]
                child = node.children.get(tok)
                if child is None:  # new from here on: one edge to its end
                    leaf = node.children[tok] = Node(seq, j, end - j)
                    leaf.count = 1
                    leaf.stamp = base + end - 1  # its last token's
                    node = leaf
                    break
                if child.length > 1:  # split: a 1-token edge that now occurs once more
                    node.children[tok] = child = child.split()
                child.count += 1
                child.stamp = base + j
                child.src, child.start = seq, j  # its latest occurrence
                node = child
                j += 1
            if i >= n - depth:  # still growing when the next token comes
                active.append(node)

    def remove(self, sid) -> None:
        """Subtract every substring the sequence added (O(length x max_depth) steps)."""
        seq = self.tokens.pop(sid, None)
        self.active.pop(sid, None)
        if seq is None:
            return
        self.root.count -= len(seq)
        for i in range(len(seq)):
            end = min(self.max_depth, len(seq) - i)  # this suffix's length
            node, depth = self.root, 0
            while depth < end:  # occurrences end on node boundaries
                tok = seq[i + depth]
                child = node.children[tok]
                child.count -= 1
                if child.count == 0:
                    del node.children[tok]  # its whole subtree came from this sequence
                    break
                depth += child.length
                node = child

    def _walk(self, tokens: list[int]) -> tuple[Node, int] | None:
        """Where `tokens` lead from the root: (node, tokens of its edge used), or None."""
        node, used = self.root, 0
        for tok in tokens:
            if used < node.length:
                if node.token(used) != tok:
                    return None
                used += 1
            else:
                node = node.children.get(tok)
                if node is None:
                    return None
                used = 1
        return node, used

    def match(self, context: list[int]):
        """(m, (node, used)) for every match length m = 1, 2, .. of the context's suffix."""
        longest = min(len(context), self.max_depth - 1)
        for m in range(1, longest + 1):
            at = self._walk(context[len(context) - m :])
            if at is None:
                return  # a longer suffix cannot match either
            yield m, at

    def own_matches(self, sid) -> list[tuple[int, tuple[Node, int]]]:
        """match() of sequence `sid`'s own text against this trie, for free: the nodes where
        its growing suffixes end are those matches (each at the end of its edge)."""
        active = self.active.get(sid, ())
        longest = min(len(active), self.max_depth - 1)
        return [(m, (active[-m], active[-m].length)) for m in range(1, longest + 1)]

    def draft(
        self, at: tuple[Node, int], max_tokens: int, min_prob: float, tree: bool
    ) -> tuple[list[int], list[int], float]:
        """(tokens, parents as input indices, score) grown from a match `at`."""
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        node, used = at
        if not tree:
            prob = 1.0
            while len(tokens) < max_tokens:
                if used < node.length:  # along the edge the count does not change
                    tok = node.token(used)
                    used += 1
                else:
                    best = node.best_child()
                    if best is None:
                        break
                    tok, child = best
                    prob *= child.count / node.count
                    if prob < min_prob:
                        break
                    node, used = child, 1
                tokens.append(tok)
                parents.append(len(tokens) - 1)
                score += prob
            return tokens, parents, score
        order = itertools.count()
        # (-path probability, tie-break, node, edge tokens used, its input index, its token)
        heap = [(-1.0, next(order), node, used, 0, -1)]
        while heap and len(tokens) < max_tokens:
            neg, _, node, used, index, tok = heapq.heappop(heap)
            if tok >= 0:  # the match itself is already in the text
                tokens.append(tok)
                parents.append(index)
                score += -neg
                index = len(tokens)
            if used < node.length:
                heapq.heappush(heap, (neg, next(order), node, used + 1, index, node.token(used)))
                continue
            for child_tok, child in node.children.items():
                p = -neg * child.count / node.count
                if p >= min_prob:
                    heapq.heappush(heap, (-p, next(order), child, 1, index, child_tok))
        return tokens, parents, score


def token_strings(tokenizer, vocab: int) -> list[str]:
    """Each token id's string (the tokenizer's own pieces), for matching a text on its
    characters; ids past the tokenizer's (a model's padded rows) get ""."""
    names = tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(tokenizer)))))
    return [n or "" for n in names] + [""] * max(0, vocab - len(names))


class SuffixProposer(Proposer):
    """Per-request and global suffix tries. Shared settings (depth, global size) are set
    once; each request's SpecConfig gives max_spec_factor, min_token_prob and tree mode."""

    name = "suffix"
    prior = 0.5
    free = True
    sizing = FREE_SIZING
    walks = True  # a trie walk: about a millisecond

    def __init__(
        self,
        max_depth: int = 24,
        max_cached_requests: int = 10_000,
        token_strings: list[str] | None = None,
    ) -> None:
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.local: dict[int, SuffixTree] = {}
        self.synced: dict[int, int] = {}  # sequence id -> its tokens the global tree has seen
        self.global_tree = SuffixTree(max_depth)
        self.global_order: OrderedDict = OrderedDict()  # FIFO of cached requests' ids
        self.memo: dict = {}  # sequence id -> (its length, k, draft) of its last speculation
        # Each token's characters (from the tokenizer): with them a request's text is also
        # matched on characters (char_lookup.py); None: tokens only.
        self.token_strings = token_strings
        self.chars: dict[int, CharIndex] = {}
        self.clock = itertools.count()
        # While frozen (the sequential benchmark), running requests do not enter the global
        # tree: it holds only what `cache_output` adds, so a prompt's repeated runs never
        # meet their own earlier output.
        self.frozen = False

    def add(self, seqs: list[Sequence]) -> None:
        # Only requests that may draft with suffix (suffix, auto) build a trie or reach the
        # global tree: the others pay nothing for this method.
        # The request's own trie takes its prompt now, at admission: built lazily it cost the
        # same, but inside the decode step, where auto's learnt step overhead took it in.
        for seq in seqs:
            if not seq.spec.may_use("suffix"):
                continue
            self.local[seq.id] = tree = SuffixTree(self.max_depth)
            tree.extend(0, seq.tokens[: seq.prompt_len])
            if self.token_strings is not None and seq.spec.suffix_decoding_char_match:
                self.chars[seq.id] = CharIndex(self.token_strings)
                self.chars[seq.id].extend(seq.tokens[: seq.prompt_len])
            self.synced[seq.id] = seq.prompt_len  # the global tree holds outputs only
            if self.max_cached > 0 and not self.frozen:
                self._cache(seq.id)

    @classmethod
    def build(cls, parts: Parts) -> SuffixProposer:
        if not (isinstance(parts.suffix_max_depth, int) and 2 <= parts.suffix_max_depth <= 256):
            raise LeapDecodeError(
                "suffix_decoding_max_tree_depth must be an integer in 2..256",
                field="suffix_decoding_max_tree_depth",
            )
        if not (isinstance(parts.suffix_max_cached, int) and parts.suffix_max_cached >= 0):
            raise LeapDecodeError(
                "suffix_decoding_max_cached_requests must be an integer >= 0 (0: no global tree)",
                field="suffix_decoding_max_cached_requests",
            )
        return cls(parts.suffix_max_depth, parts.suffix_max_cached, parts.token_strings)

    def offer(self, seq: Sequence, budget: int) -> Offer | None:
        """Its best draft now, scored by its length (`bucket_at`); a chain is kept to be
        scored against what the step emits, should the planner not draft it."""
        tokens, parents, _ = self.speculate(seq, budget)
        if not tokens:
            return None
        chain = tokens if parents == list(range(len(tokens))) else None
        return Offer(len(tokens), bucket=self.bucket_at(len(tokens)), chain=chain)

    def bucket_at(self, most: int) -> int:
        """1, 2, 3-4, 5-8, 9+ (a draft's length: the match length caps it)."""
        return most if most <= 2 else 3 if most <= 4 else 4 if most <= 8 else 5

    def _sync(self, seq: Sequence) -> None:
        """Bring the request's own trie (prompt and output) and, if it is cached, the
        global tree (output only) up to its tokens."""
        local = self.local[seq.id]
        have = len(local.tokens.get(0, ()))
        if have < len(seq.tokens):
            local.extend(0, seq.tokens[have:])
            if seq.id in self.chars:
                self.chars[seq.id].extend(seq.tokens[have:])
        self._sync_global(seq)

    def _sync_global(self, seq: Sequence) -> None:
        done = self.synced[seq.id]
        if seq.id in self.global_order and done < len(seq.tokens):
            self.global_tree.extend(seq.id, seq.tokens[done:])
        self.synced[seq.id] = len(seq.tokens)

    def speculate(self, seq: Sequence, k: int) -> tuple[list[int], list[int], float]:
        """The best draft for `seq` now: (tokens, parents, score). Within one step a second
        call (auto sizes its options, then proposes) takes the first one's draft, cut to k:
        the first k nodes of a path or of a best-first tree are themselves a draft."""
        if k <= 0:
            return [], [], 0.0
        memo = self.memo.get(seq.id)
        if memo is not None and memo[0] == len(seq.tokens) and memo[1] >= k:
            tokens, parents, score = memo[2]
            return tokens[:k], parents[:k], score
        best = self._speculate(seq, k)
        self.memo[seq.id] = (len(seq.tokens), k, best)
        return best

    def _speculate(self, seq: Sequence, k: int) -> tuple[list[int], list[int], float]:
        self._sync(seq)
        spec = seq.spec
        local = self.local[seq.id]
        matches = []
        for m, at in local.own_matches(0):
            if at[0].count < 2:  # only here, at the text's end: nothing follows it (nor a
                break  # longer suffix, which occurs no more often)
            matches.append((m, local, at))
        if self.global_tree.root.children:
            context = seq.tokens[-self.max_depth :]
            matches += [(m, self.global_tree, at) for m, at in self.global_tree.match(context)]
        # longest matches first: a draft's score (expected accepted length) is at most its
        # cap, so once the caps fall to the best score the shorter matches cannot win
        matches.sort(key=lambda x: -x[0])
        best: tuple[list[int], list[int], float] = ([], [], 0.0)
        for m, tree, at in matches:
            limit = min(k, int(m * spec.suffix_decoding_max_spec_factor + 1e-6))
            if limit <= best[2]:
                break
            got = tree.draft(at, limit, spec.suffix_decoding_min_token_prob, spec.use_tree_spec)
            if got[2] > best[2] or (got[2] == best[2] and len(got[0]) > len(best[0])):
                best = got
        chars = self.chars.get(seq.id)
        if chars is not None and not spec.use_tree_spec and len(best[0]) < k:
            # the text's last characters, where they end a token earlier: what followed
            # there, when longer than the trie's draft (char_lookup.py)
            start = chars.match()
            if start >= 0 and len(seq.tokens) - start > len(best[0]):
                draft = seq.tokens[start : start + k]
                best = (draft, list(range(len(draft))), float(len(draft)))
        return best

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        return Drafts.from_trees([self.speculate(s, k)[:2] for s, k in zip(seqs, ks, strict=True)])

    def _cache(self, sid) -> None:
        """Enter a request into the global tree's FIFO; evict the oldest finished ones."""
        self.global_order[sid] = None
        while len(self.global_order) > self.max_cached:
            victim = next((x for x in self.global_order if x not in self.local), None)
            if victim is None:
                break  # every cached request is still running
            del self.global_order[victim]
            self.global_tree.remove(victim)

    def cache_output(self, tokens: list[int]) -> None:
        """Add a finished request's output to the global tree (benchmarks replay a server's
        history with it)."""
        if self.max_cached > 0:
            sid = ("cached", next(self.clock))
            self._cache(sid)
            self.global_tree.extend(sid, list(tokens))

    def remove(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.id in self.local:
                self._sync_global(seq)  # its last tokens count for later requests too
            self.local.pop(seq.id, None)
            self.synced.pop(seq.id, None)
            self.memo.pop(seq.id, None)
            self.chars.pop(seq.id, None)
