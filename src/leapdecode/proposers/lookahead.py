"""Lookahead decoding (Fu et al. 2024): Jacobi guesses and an n-gram pool, no second model.

Each step's input is one tree rooted at the last committed token x (tree.py lays it out):

  lookahead branch  a window of W columns x (N-1) levels of guesses. Level 0 holds the
                    guesses for positions x+1 .. x+W-1 (column 0 of level 0 is x itself);
                    cell (l, i) has parent (l-1, i), and (0, i) has parent (0, i-1), so it
                    sits at depth i + l and sees x, level 0 up to column i and its own
                    column below it: the paper's mask.
  verification      up to G n-grams of N-1 tokens from the pool entry of x, each a chain
  branch            under x.

The target scores it all in one forward. Its argmax at the last level's cells are the
window's next guesses (the Jacobi step); each column then yields an n-gram, keyed by its
level-0 token: (levels 1 .. N-2, new guess) goes into the pool (at most G per key, the most
recent kept). The window moves up one level. The pool also gets every n-gram of the prompt
and of the committed output, so lookahead finds what prompt lookup finds too.

Every node is a deterministic guess, so any accepted path is lossless under tree
verification (greedy and sampling); the window itself is only ever a source of guesses.
Lookahead needs spare compute per step: T = 1 + (W-1) + (N-2) W + G (N-1) input tokens.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import torch

from ..sequence import Sequence
from .base import Drafts, Proposer
from .ngram import build_trie


class _State:
    def __init__(self, seq: Sequence) -> None:
        spec = seq.spec
        self.w = spec.lookahead_window
        self.n = spec.lookahead_ngram_size
        self.g = spec.lookahead_max_candidates
        prompt = seq.tokens[: seq.prompt_len]
        # its own guesses' randomness, never the sampler's; seeded by the prompt, so a
        # prompt's runs (a benchmark's repeats) guess alike
        rng = random.Random(hash(tuple(prompt)))
        # levels[0]: columns 1 .. W-1; levels[1 .. N-2]: columns 0 .. W-1
        self.levels = [[rng.choice(prompt) for _ in range(self.w - 1)]] + [
            [rng.choice(prompt) for _ in range(self.w)] for _ in range(self.n - 2)
        ]
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.pooled = 0  # tokens whose n-grams are in the pool
        self.last_level: list[int] | None = None  # input index of the last level's cells

    def remember(self, key: int, gram: tuple[int, ...]) -> None:
        entry = self.pool.setdefault(key, OrderedDict())
        entry.pop(gram, None)
        entry[gram] = None  # most recent last
        while len(entry) > self.g:
            entry.popitem(last=False)

    def pool_text(self, tokens: list[int]) -> None:
        """Every n-gram (key + N-1 tokens) of the committed text not pooled yet."""
        span = self.n - 1
        for j in range(max(0, self.pooled - span), len(tokens) - span):
            self.remember(tokens[j], tuple(tokens[j + 1 : j + 1 + span]))
        self.pooled = len(tokens)


class LookaheadProposer(Proposer):
    """Per-request windows and pools; W, N, G from each request's SpecConfig."""

    name = "lookahead"
    wants_target_argmax = True

    def __init__(self) -> None:
        self.state: dict[int, _State] = {}

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.spec.method == "lookahead":
                self.state[seq.id] = _State(seq)

    def tree(self, seq: Sequence, budget: int) -> tuple[list[int], list[int]]:
        """This step's (tokens, parents) for `seq`, at most `budget` nodes."""
        st = self.state[seq.id]
        st.pool_text(seq.tokens)
        st.last_level = None
        tokens: list[int] = []
        parents: list[int] = []
        window = (st.w - 1) + (st.n - 2) * st.w
        if window <= budget:  # the lookahead branch, level by level (not near a request's
            # end, where fewer tokens may still come than the window holds)
            below = [0]  # input index of level l's cells, column 0 first (x for level 0)
            for i, tok in enumerate(st.levels[0]):
                tokens.append(tok)
                parents.append(below[i])
                below.append(len(tokens))
            for level in st.levels[1:]:
                row = []
                for i, tok in enumerate(level):
                    tokens.append(tok)
                    parents.append(below[i])
                    row.append(len(tokens))
                below = row
            st.last_level = below
        x = seq.tokens[-1]
        grams = [list(g) for g in reversed(st.pool.get(x, {}))]  # most recent first
        extra, extra_parents = build_trie(grams, budget - len(tokens))  # shared prefixes once
        base = len(tokens)
        tokens += extra
        parents += [0 if q == 0 else q + base for q in extra_parents]
        return tokens, parents

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        return Drafts.from_trees([self.tree(s, k) for s, k in zip(seqs, ks, strict=True)])

    def observe_target(self, seqs: list[Sequence], argmax: torch.Tensor) -> None:
        """The Jacobi step: the last level's argmax become the newest guesses."""
        for seq, row in zip(seqs, argmax.tolist(), strict=True):
            st = self.state[seq.id]
            if st.last_level is None:
                continue
            new = [row[i] for i in st.last_level]  # [W]
            for i in range(st.w):  # column i's n-gram, keyed by its level-0 token
                key = seq.tokens[-1] if i == 0 else st.levels[0][i - 1]
                st.remember(key, tuple(level[i] for level in st.levels[1:]) + (new[i],))
            # up one level: level 1 loses column 0 (the next x) and becomes level 0
            st.levels = [st.levels[1][1:]] + st.levels[2:] + [new]

    def remove(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.state.pop(seq.id, None)
