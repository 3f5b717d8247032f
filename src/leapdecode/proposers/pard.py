"""PARD (parallel draft): a draft model that proposes its k tokens in one forward.

The draft is fed what it has not seen of the sequence followed by k - 1 copies of a mask
token, `[.., last, m, m, ..]`: its prediction after `last` is draft 1, after the i-th mask
draft i + 1 (a draft fine-tuned for it predicts several tokens ahead; vLLM runs the same as
`draft_model` with `parallel_drafting`). The masks leave the draft's KV cache right after
the forward, so the cache only ever holds the sequence's own tokens, and the next step feeds
the target's bonus token and the accepted drafts.

Draft i is drawn from the draft's distribution at its position, which does not depend on
the drafts before it: the verification rules (verify.py, token or block) only need the
distribution each draft was drawn from, so the output is the target's either way.

The mask token comes from the draft's config.json: `pard_token`, else `mask_token_id` (the
names vLLM reads). `pard_max_k`, where present, is the most drafts it was trained for: a
larger k is drafted at that size, with a warning (once).

The parallel draft is a model of its own (`Parts.pard`: `--pard PATH`, by default the
embedded `leap-code-draft-pard` beside the embedded target), with its own KV cache, so `auto`
weighs it beside the chain draft (one measured proposal a step, like the heads' costs). A
draft model given as `--draft` that names a mask token also runs `--method pard`, sharing
the chain draft's cache: then `auto` leaves pard out (a sequence must not mix the two in
one cache).
"""

from __future__ import annotations

import logging

import torch

from ..sequence import Sequence
from .base import Drafts, Offer, Parts
from .draft_model import DraftModelProposer

log = logging.getLogger("leapdecode")


def mask_token(config) -> int | None:
    """The parallel draft's mask token from its config (None: not a parallel draft)."""
    for name in ("pard_token", "mask_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


class PardProposer(DraftModelProposer):
    """A parallel draft: one draft forward a step, whatever k (see the module notes)."""

    name = "pard"
    prior = 0.4
    costs = "proposal"  # one forward a step whatever k: priced by its measured proposals

    def __init__(
        self, model, target_vocab_size: int, mask: int, max_k: int | None, shared: bool = False
    ) -> None:
        super().__init__(model, target_vocab_size)
        self.mask, self.max_k = mask, max_k
        self.shared = shared  # the chain draft's model and cache: not for auto
        self.warned = False  # the clamp is said once

    @classmethod
    def build(cls, parts: Parts) -> PardProposer | None:
        model = parts.pard if parts.pard is not None else parts.draft
        config = getattr(model, "config", None)
        mask = mask_token(config)
        if model is None or mask is None:
            return None
        max_k = getattr(config, "pard_max_k", None)
        return cls(model, parts.target.vocab_size, mask, max_k, shared=parts.pard is None)

    def offer(self, seq: Sequence, budget: int) -> Offer | None:
        if self.shared or budget < 1:
            return None
        return Offer(min(budget, self.max_k or budget))

    def guess_layers(self, seqs: list[Sequence]) -> float:
        return float(self.model.config.num_hidden_layers)  # about a target layer each

    def _k(self, want: int) -> int:
        if self.max_k is None or want <= self.max_k:
            return want
        if not self.warned:
            self.warned = True
            log.warning(
                "pard: k=%d asked, the parallel draft was trained for %d: drafting %d",
                want, self.max_k, self.max_k,
            )  # fmt: skip
        return self.max_k

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        rows = [i for i, k in enumerate(ks) if k > 0]
        if not rows:
            return Drafts.empty(len(seqs))
        active = [seqs[i] for i in rows]
        room = self.model.max_context - max(len(s.tokens) for s in active)
        k = min(self._k(max(ks[i] for i in rows)), room)
        if k <= 0:
            return Drafts.empty(len(seqs))
        want = [min(self._k(ks[i]), k) for i in rows]
        behind = [s for s in active if len(s.tokens) - 1 > self.fed[s.id]]
        if behind:  # all but the last token, in forwards of their own (a prompt can be long)
            self._catch_up(behind, upto=[len(s.tokens) - 1 for s in behind])
        start = self.model.lengths(self._slots(active))  # [n]
        block = [[s.tokens[-1]] + [self.mask] * (k - 1) for s in active]
        for s in active:
            s.stats.draft_forwards += 1
        logits = self.model.forward(torch.tensor(block), self._slots(active))  # [n, k, V']
        self.model.truncate(self._slots(active), start + 1)  # the masks leave the cache
        for s in active:
            self.fed[s.id] = len(s.tokens)
            self.fed_drafts[s.id] = 0
        full = self._to_target_vocab(logits.reshape(len(active) * k, -1))  # [n k, V]
        tokens, q = self._choose_all(active, full.view(len(active), k, -1), want)
        out = torch.zeros(len(seqs), k, dtype=torch.long)
        out[rows] = tokens.cpu()
        counts = torch.zeros(len(seqs), dtype=torch.long)
        counts[rows] = torch.tensor(want)
        q_all = None
        if q is not None:
            q_all = torch.zeros(len(seqs), k, self.vocab, device=q.device)
            q_all[torch.tensor(rows, device=q.device)] = q
        return Drafts(out, counts, q_all)

    def _choose_all(self, seqs, logits, want: list[int]):
        """Each row's k drafts [n, k] and their processed distributions [n, k, V] (None: all
        greedy); a sampled row draws one uniform a draft it keeps, from its draft stream."""
        if all(s.params.greedy for s in seqs):
            return logits.argmax(-1), None  # [n, k]
        n, k, _ = logits.shape
        tokens, probs = [], []
        for j in range(k):
            drafting = [j < w for w in want]
            tok, q = self._choose(seqs, logits[:, j], drafting)  # [n], [n, V] | None
            tokens.append(tok)
            probs.append(q)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    def accepted(self, seqs: list[Sequence], n_accepted: list[int]) -> None:
        """Nothing to cut: the drafts never entered the draft's cache."""
