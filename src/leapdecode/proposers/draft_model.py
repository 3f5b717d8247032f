"""A separate, smaller draft LM proposes k tokens autoregressively with its own KV cache.

Cache bookkeeping per sequence: `fed[id]` tokens of `seq.tokens` are in the draft cache.
A proposal first feeds what the draft has not seen yet (the target's last token, and the
last draft when all were accepted), then k - 1 more single-token steps. After verification
the cache is cut back to the longest prefix that is still part of the sequence.

A draft's context may be windowed (`context`, the draft-context option): where more than
that many tokens are unseen (a long prompt, or a long run that other methods accepted), the
draft is fed the sequence's first SINK tokens and its last `context - SINK` only, as
StreamingLLM keeps a model's attention sinks and a recent window (MagicDec drafts with such
a cache). Its prefill then costs a bounded number of tokens, however long the prompt; the
draft proposes from a shorter text, and the target still checks every token.
`base[id]`: the draft cache's index of seq.tokens[i] is i + base[id] (0 unless windowed).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from ..config import DRAFT_CONTEXT
from ..errors import LeapDecodeError
from ..models.base import CausalLM
from ..sampling import process_rows, sample_from
from ..sequence import Sequence, pad_right
from .base import Drafts, Offer, Parts, Proposer

SINK = 4  # a windowed draft's first tokens kept (attention sinks)
VOCAB_FILE = "draft_vocab.json"  # {"ranked_token_ids": [...], "recommended": N, "source": ...}


def read_vocab_ranking(draft_dir: str | None) -> dict | None:
    """The draft folder's token ranking (most frequent first), or None when it has none."""
    path = os.path.join(draft_dir or "", VOCAB_FILE)
    if not draft_dir or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_vocab_ranking(
    out_dir: str, tokens, vocab_size: int, recommended: int, source: str
) -> None:
    """Rank the vocabulary by frequency in `tokens` (the data the draft was trained on)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    ranked = np.argsort(-counts, kind="stable")
    covered = float(counts[ranked[:recommended]].sum() / max(1, counts.sum()))
    with open(os.path.join(out_dir, VOCAB_FILE), "w") as f:
        json.dump(
            {
                "ranked_token_ids": ranked.tolist(),
                "recommended": recommended,
                "coverage_of_recommended": covered,
                "source": source,
            },
            f,
        )


def fit_groups(starts: list[int], lengths: list[int], limit: int | None) -> list[list[int]]:
    """Row indices grouped so that each group's padded forward stays in the cache: in every
    group, max(start) + max(length) <= limit. All rows in order when they fit together (or
    there is no limit); otherwise longest rows first, greedily."""
    if limit is None or max(starts) + max(lengths) <= limit:
        return [list(range(len(starts)))]
    groups: list[list[int]] = []
    for i in sorted(range(len(starts)), key=lambda i: -lengths[i]):
        for g in groups:  # each group's first row has its longest length
            if max(starts[j] for j in g + [i]) + lengths[g[0]] <= limit:
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


class DraftModelProposer(Proposer):
    """Drafts with a smaller LM that has its own KV cache, one slot per engine slot.

    The draft model is shared by every request and configured once (its head: see
    `restrict_head`); a request's confidence cut-off travels in `seq.spec.draft_min_prob`:
    a row stops drafting once its next draft token's draft probability falls below it.
    The cut-off depends on the draft alone, so the output stays the target's (greedy and
    sampled). A row draws its sampling uniforms from its own generator, one per draft it
    makes, so a seeded row gives the same tokens alone or in any batch.
    """

    name = "draft"
    prior = 0.6
    costs = "forwards"
    stochastic = True

    def __init__(
        self, model: CausalLM, target_vocab_size: int, context: int | None = DRAFT_CONTEXT
    ) -> None:
        if context is not None and (
            not isinstance(context, int)
            or isinstance(context, bool)
            or 0 < context < 2 * SINK
            or context < 0
        ):
            raise LeapDecodeError(
                f"draft_context must be an integer >= {2 * SINK} (the most tokens of a "
                f"sequence a draft model's catch-up feeds), or 0 for all; got {context!r}",
                field="draft_context",
            )
        self.model = model
        model.exact_rows = False  # its proposals are checked: its rows need no decode step's bits
        self.vocab = target_vocab_size
        self.context = context or None  # the most tokens a catch-up feeds (None: all)
        self.fed: dict[int, int] = {}  # tokens of seq.tokens the draft has seen
        self.base: dict[int, int] = {}  # cache index of seq.tokens[i] - i (windowed: < 0)
        self.fed_drafts: dict[int, int] = {}  # drafts in the cache after them

    @classmethod
    def build(cls, parts: Parts) -> DraftModelProposer | None:
        if parts.draft is None:
            return None
        return cls(parts.draft, parts.target.vocab_size, parts.draft_context)

    def offer(self, seq: Sequence, budget: int) -> Offer | None:
        return Offer(budget) if budget > 0 else None

    def unseen(self, seq: Sequence) -> int:
        """What a catch-up would feed: its prompt (fed lazily) and what other methods
        accepted since it last drafted, at most the window."""
        n = len(seq.tokens) - self.fed.get(seq.id, 0)
        return n if self.context is None else min(n, self.context)

    def started(self, seq: Sequence) -> bool:
        return self.fed.get(seq.id, 0) > 0

    def _slots(self, seqs: list[Sequence]) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs], dtype=torch.long)

    def _forward(self, seqs, tokens, logits_at=None) -> torch.Tensor:
        for seq in seqs:
            seq.stats.draft_forwards += 1
        logits = self.model.forward(tokens, self._slots(seqs), logits_at=logits_at)
        return self._to_target_vocab(logits[:, -1])  # [B, V_target]

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (padded embeddings may differ in size;
        a reduced draft head leaves the other tokens at -inf: the draft never proposes them)."""
        ids = self.model.head_ids
        if ids is not None:
            full = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
            keep = ids < self.vocab
            full[:, ids[keep]] = logits[:, keep]
            return full
        v = logits.shape[-1]
        if v >= self.vocab:
            return logits[:, : self.vocab]
        pad = logits.new_full((logits.shape[0], self.vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def add(self, seqs: list[Sequence]) -> None:
        # The prompt is fed lazily, with the first proposal (auto may never draft for it).
        for s in seqs:
            self.fed[s.id] = 0
            self.base[s.id] = 0
            self.fed_drafts[s.id] = 0
        self.model.truncate(self._slots(seqs), torch.zeros(len(seqs), dtype=torch.long))

    def _catch_up(self, seqs, upto: list[int]) -> torch.Tensor:
        """Feed seq.tokens[fed:upto] for each sequence in right-padded forwards: one, unless
        the padding would run a long sequence past the cache (a newcomer's whole prompt beside
        a sequence near the end of its context); then in groups that fit."""
        pending = [self._pending(s, n) for s, n in zip(seqs, upto, strict=True)]
        start = self.model.lengths(self._slots(seqs))  # [B]
        cache = getattr(self.model, "cache", None)  # the native backend's fixed-size cache
        limit = getattr(cache, "max_len", None)
        logits = [None] * len(seqs)
        for group in fit_groups(start.tolist(), [len(p) for p in pending], limit):
            rows = [seqs[i] for i in group]
            tokens, lengths = pad_right([pending[i] for i in group])
            out = self._forward(rows, tokens, logits_at=lengths - 1)  # [b, V]
            self.model.truncate(self._slots(rows), start[group] + lengths)
            for j, i in enumerate(group):
                logits[i] = out[j]
        for s, n in zip(seqs, upto, strict=True):
            self.fed[s.id] = n
        return torch.stack(logits)  # [B, V]

    def _pending(self, seq: Sequence, upto: int) -> list[int]:
        """The tokens to feed so that the draft has seen seq.tokens[:upto]. More than the
        window unseen: the cache is cut back to the first SINK tokens (fed with them if it
        lacks them) and the window's last tokens follow them."""
        fed = self.fed[seq.id]
        if self.context is None or upto - fed <= self.context:
            return seq.tokens[fed:upto]
        sink = min(SINK, fed + self.base[seq.id])  # sink tokens already in the cache
        self.model.truncate(torch.tensor([seq.slot]), torch.tensor([sink]))
        start = upto - (self.context - SINK)  # seq.tokens[start] follows the sinks
        self.base[seq.id] = SINK - start
        return seq.tokens[sink:SINK] + seq.tokens[start:upto]

    def _choose(self, seqs, logits, drafting: list[bool]):
        """Next draft token per row [B], and the processed q rows [B, V] (None: all greedy)."""
        if all(s.params.greedy for s in seqs):
            return logits.argmax(-1), None
        q = process_rows(logits[:, None], [s.params for s in seqs])[:, 0]  # [B, V]
        u = torch.stack(
            [
                torch.rand((), generator=s.draft_generator) if go else torch.zeros(())
                for s, go in zip(seqs, drafting, strict=True)
            ]
        )
        return sample_from(q, u), q  # [B] and [B, V], on the model's device

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        rows = [i for i, k in enumerate(ks) if k > 0]
        if not rows:
            return Drafts.empty(len(seqs))
        active = [seqs[i] for i in rows]
        want = [ks[i] for i in rows]
        room = self.model.max_context - max(len(s.tokens) for s in active)
        k = min(max(want), room)
        if k <= 0:
            return Drafts.empty(len(seqs))
        want = [min(w, k) for w in want]
        cut = [s.spec.draft_min_prob for s in active]
        logits = self._catch_up(active, upto=[len(s.tokens) for s in active])
        tokens, probs = [], []
        made = [0] * len(active)  # drafts each row keeps
        for step in range(k):
            drafting = [m == step and step < w for m, w in zip(made, want, strict=True)]
            tok, q = self._choose(active, logits, drafting)  # [n], [n, V] | None
            tokens.append(tok)
            probs.append(q)
            # a row's top probability, only where a cut-off asks for it (a full softmax)
            confident = self._confidence(logits, q) if any(c > 0 for c in cut) else None
            for j, go in enumerate(drafting):
                if go:
                    made[j] += 1
                    if cut[j] > 0 and confident[j] < cut[j]:
                        want[j] = made[j]  # this row stops after this draft
            if step == k - 1 or not any(m < w for m, w in zip(made, want, strict=True)):
                break
            logits = self._forward(active, tok[:, None].cpu())
        k = len(tokens)
        for s in active:
            self.fed_drafts[s.id] = k - 1  # drafts now in the draft cache after seq.tokens
        out = torch.zeros(len(seqs), k, dtype=torch.long)
        out[rows] = torch.stack(tokens, dim=1).cpu()  # draft tokens travel on the CPU
        counts = torch.zeros(len(seqs), dtype=torch.long)
        counts[rows] = torch.tensor(made)
        q_all = None
        if probs[0] is not None:
            q_all = torch.zeros(len(seqs), k, self.vocab, device=probs[0].device)
            q_all[torch.tensor(rows, device=q_all.device)] = torch.stack(probs, dim=1)
        return Drafts(out, counts, q_all)

    @staticmethod
    def _confidence(logits: torch.Tensor, q: torch.Tensor | None) -> list[float]:
        """Each row's top draft probability (of the processed q when sampling)."""
        dist = q if q is not None else torch.softmax(logits.float(), dim=-1)  # [n, V]
        return dist.max(dim=-1).values.tolist()

    def accepted(self, seqs: list[Sequence], n_accepted: list[int]) -> None:
        slots, lens = [], []
        for s, n in zip(seqs, n_accepted, strict=True):
            extra = self.fed_drafts.get(s.id, 0)
            if extra == 0:
                continue
            # The draft cache holds fed[id] tokens then `extra` drafts; the first n survive.
            keep = self.fed[s.id] + min(n, extra)
            self.fed[s.id] = keep
            self.fed_drafts[s.id] = 0
            slots.append(s.slot)
            lens.append(keep + self.base[s.id])
        if slots:
            self.model.truncate(torch.tensor(slots), torch.tensor(lens))

    def remove(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.fed.pop(s.id, None)
            self.base.pop(s.id, None)
            self.fed_drafts.pop(s.id, None)
