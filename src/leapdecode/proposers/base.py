"""What every proposer offers the engine: guesses for the next tokens of each sequence.

Lifecycle (the engine calls these at step boundaries):
    add(seqs)        a request joined (its slot is fresh; per-request state starts here)
    propose(seqs, ks) up to ks[i] draft tokens for each sequence, continuing seq.tokens
    accepted(seqs, n) after verification: seqs[i] kept n[i] drafts plus one target token
    target_hidden(seqs, hidden, final)
                     the target's hidden states at the inputs it has just cached for good
                     (the prompt at prefill; the root and the accepted path after a step),
                     for proposers that declare `wants_hidden` (medusa, eagle)
    remove(seqs)     a request finished or was aborted; free what is held for it

What `auto`'s planner asks of a proposer (engine/planner.py), without knowing which it is:
    offer(seq, budget)  what it could draft for seq now (an `Offer`, or None)
    span(seq, k)        the longest run a draft of k tokens can have accepted (a tree's depth)
    unseen(seq)         tokens it must feed before it can draft for seq (a catch-up)
guess_layers(seqs)  a proposal's cost before it is measured
and the class attributes below (prior, sizing, costs, stochastic, free, walks).
An engine builds each registered method's proposer with `build(parts)`.

Shared state (a draft model, its weights and head) is configured once, never per request;
per-request options travel in `seq.spec`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..config import DRAFT_CONTEXT
from ..models.base import CausalLM, HiddenRequest
from ..sequence import Sequence, pad_right
from ..tree import chain_parents

# auto's budget for drafts that cost nothing to make (n-grams, suffix tries): up to twice a
# request's k and at least 16 tokens; the planner prices each verified row
FREE_SIZING = (2, 16)
# a trained head's deterministic tree: up to four times a request's k nodes
HEAD_SIZING = (4, 0)


@dataclass
class Parts:
    """What an engine has loaded that proposers are built from (`Proposer.build` takes what
    it needs and returns None where something it needs is missing)."""

    target: CausalLM
    draft: CausalLM | None = None
    pard: CausalLM | None = None  # a parallel draft model of its own (its own KV cache)
    medusa: object | None = None  # models.medusa.MedusaHeads
    eagle: object | None = None  # models.eagle.Eagle3Head
    peagle: object | None = None  # models.eagle.Eagle3Head with parallel drafting (P-EAGLE)
    suffix_max_depth: int = 24  # the suffix tries' longest counted substring
    suffix_max_cached: int = 10_000  # finished requests the global suffix trie keeps
    token_strings: list[str] | None = None  # each token's text (character matching)
    draft_context: int | None = DRAFT_CONTEXT  # the most tokens a draft model's catch-up feeds


@dataclass
class Offer:
    """What a proposer could draft for one sequence now (`Proposer.offer`); the planner
    scores it with the acceptance it has learnt for (method, bucket)."""

    most: int  # draft tokens (tree nodes) it can give, > 0
    depth: int | None = None  # None: a chain, any k <= most; else a tree of `most` nodes
    # whose accepted run is at most `depth`
    bucket: int = 0  # which of the method's acceptance estimates scores it
    chain: list[int] | None = None  # the chain it made, if made already: scored against
    # what the step emits when the planner does not draft it (so a method left aside can
    # still be found to match again)


@dataclass
class Drafts:
    tokens: torch.Tensor  # [B, k] right-padded with 0
    counts: torch.Tensor  # [B] real drafts per row (<= k)
    probs: torch.Tensor | None = None  # [B, k, V] drafter's processed distribution; None = one-hot
    # [B, k] input index of each draft's parent (0 = the last committed token; tree.py);
    # None: every row is a chain. Trees are deterministic (one-hot q).
    parents: torch.Tensor | None = None
    # [B] bool: rows whose probs are a drafter's real distribution (the rest are
    # deterministic, one-hot); None: every row is stochastic iff probs is given.
    stochastic: torch.Tensor | None = None

    @staticmethod
    def empty(batch: int) -> Drafts:
        return Drafts(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))

    @staticmethod
    def from_lists(rows: list[list[int]]) -> Drafts:
        """Deterministic drafts (one-hot q) from per-sequence token lists."""
        return Drafts(*pad_right(rows))

    @staticmethod
    def from_trees(rows: list[tuple[list[int], list[int]]]) -> Drafts:
        """Deterministic draft trees from per-sequence (tokens, parents) lists, parents as
        input indices (0 = the last committed token, i + 1 = draft i; see tree.py)."""
        tokens, counts = pad_right([t for t, _ in rows])
        parents, _ = pad_right([p for _, p in rows])
        for (t, p), n in zip(rows, counts.tolist(), strict=True):
            if len(p) != n or any(not 0 <= q <= j for j, q in enumerate(p)):
                raise ValueError(f"bad draft tree: tokens {t}, parents {p}")
        if all(p == list(range(len(p))) for _, p in rows):
            return Drafts(tokens, counts)  # only chains: the plain causal path
        return Drafts(tokens, counts, None, parents)

    @staticmethod
    def merge(parts: list[tuple[list[int], Drafts]], batch: int, vocab: int) -> Drafts:
        """One batch's drafts from several proposers: parts = [(row indices, their drafts)].

        Rows no part covers get no drafts. Where some part has probabilities and another
        is deterministic, the deterministic rows get their one-hot q explicitly."""
        k = max((d.tokens.shape[1] for _, d in parts), default=0)
        tokens = torch.zeros(batch, k, dtype=torch.long)
        counts = torch.zeros(batch, dtype=torch.long)
        with_probs = [d.probs for _, d in parts if d.probs is not None]
        probs = None
        if with_probs:
            probs = with_probs[0].new_zeros(batch, k, vocab)
        parents = None
        if any(d.parents is not None for _, d in parts):
            parents = chain_parents(batch, k)
        stochastic = torch.zeros(batch, dtype=torch.bool)
        for rows, d in parts:
            if not rows:
                continue
            idx = torch.tensor(rows, dtype=torch.long)
            w = d.tokens.shape[1]
            tokens[idx, :w] = d.tokens
            counts[idx] = d.counts
            stochastic[idx] = d.probs is not None
            if parents is not None and d.parents is not None:
                parents[idx, :w] = d.parents
            if probs is not None:
                pidx = idx.to(probs.device)
                if d.probs is not None:
                    probs[pidx, :w] = d.probs
                else:
                    one_hot = torch.nn.functional.one_hot(d.tokens, vocab).float()
                    probs[pidx, :w] = one_hot.to(probs.device)
        return Drafts(tokens, counts, probs, parents, stochastic)


class Proposer(ABC):
    name: str = "none"
    # What auto's planner reads (engine/planner.py):
    prior: float | None = None  # a draft token's acceptance before any is seen; None:
    # auto does not plan it and its acceptance is not learnt
    sizing = (1, 0)  # auto offers it budget min(MAX_K, max(a k, b), room) for a request's k
    costs = "proposal"  # "proposal": one measured proposal a step, whatever its rows;
    # "forwards": a model forward per draft token, shared by its rows, and a catch-up of the
    # tokens it has not seen (unseen)
    stochastic = False  # drafts sampled from a distribution (seeded sampled requests keep
    # to deterministic drafts, whose outcome does not depend on what auto chose)
    free = False  # its drafts cost about nothing to make (n-grams, suffix tries): a chain
    # of them on offer marks the text as one that copies (planner.py)
    walks = False  # its offer costs real time: skipped where a free chain offered in full
    # is worth at least its best

    @classmethod
    def build(cls, parts: Parts) -> Proposer | None:
        """This method's proposer from what the engine loaded (None: it cannot run here)."""
        return cls()

    def offer(self, seq: Sequence, budget: int) -> Offer | None:
        """What it could draft for seq now, up to `budget` tokens (None: nothing)."""
        return None

    def span(self, seq: Sequence, k: int) -> int:
        """The longest run a draft of k tokens (tree nodes) from it can have accepted."""
        return k

    def unseen(self, seq: Sequence) -> int:
        """Tokens of seq it must feed before it can draft (0: none)."""
        return 0

    def started(self, seq: Sequence) -> bool:
        """Whether it has fed seq's prompt (what auto learns the draft's share of steps on)."""
        return True

    def guess_layers(self, seqs: list[Sequence]) -> float:
        """A proposal's cost for seqs before it has been measured, in target layers' worth
        of a one-row decode step (0: about free)."""
        return 0.0

    def bucket_at(self, most: int) -> int:
        """The bucket of an offer of `most` tokens (where the bucket is the draft's length)."""
        return 0

    def add(self, seqs: list[Sequence]) -> None:
        """New requests (fresh slots); start their per-request state."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        """Up to ks[i] draft tokens for seqs[i], continuing seqs[i].tokens."""

    def accepted(self, seqs: list[Sequence], n_accepted: list[int]) -> None:
        """After verification: seqs[i] kept n_accepted[i] drafts plus one target token."""

    # The target's hidden states this proposer needs (as transformers' requires_model_outputs);
    # empty: none, and `target_hidden` is never called.
    wants_hidden = HiddenRequest()

    def target_hidden(
        self,
        seqs: list[Sequence],
        hidden: list[torch.Tensor | None],
        final: list[torch.Tensor | None],
    ) -> None:
        """The target cached new inputs of seqs[i] for good (its prompt at prefill; the root
        and the accepted drafts after a step): hidden[i] [n_i, len(layers), H] and final[i]
        [n_i, H] at those inputs, in order (None where not asked). Called after the
        sequences gained their new tokens, so seqs[i].tokens[-1] is the one not yet cached."""

    def remove(self, seqs: list[Sequence]) -> None:
        """The sequences are done (finished or aborted); free what is held for them."""

    wants_target_argmax = False

    def observe_target(self, seqs: list[Sequence], argmax: torch.Tensor) -> None:
        """argmax [len(seqs), T]: the target's choice after each input [root, d1 ..] of the
        step just verified (called before `accepted`, when wants_target_argmax)."""


class NoProposer(Proposer):
    """Plain autoregressive decoding: k = 0 through the same loop."""

    name = "none"

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        return Drafts.empty(len(seqs))
