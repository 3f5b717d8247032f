"""The step loop over a batch of sequences: propose -> verify (one target forward) -> accept.

Cache convention: the target's cache holds every token of a sequence except the last one,
which is fed at the next step together with that step's drafts:

    input  [last, d1 .. dk]        -> logits [k+1, V]
    logits[i] scores draft d(i+1); logits[n_accepted] gives the target's own next token
    cache  keeps last + d1 .. d(n_accepted)   (rollback = truncate, O(1))
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .models.base import CausalLM
from .proposers.base import Drafts, Proposer
from .sampling import process_logits
from .sequence import Sequence, pad_right
from .verify import greedy_accept, rejection_accept


class Engine:
    def __init__(self, target: CausalLM, proposer: Proposer) -> None:
        self.target = target
        self.proposer = proposer

    def run(self, seqs: list[Sequence], k: int) -> Iterator[list[tuple[Sequence, list[int]]]]:
        """Generate for `seqs` (slots 0..B-1); yields the tokens each step added per sequence."""
        longest = max(min(s.prompt_len + s.max_new_tokens, s.max_context) for s in seqs)
        max_len = longest + k + 1  # room for right-padding and rejected drafts
        t0 = time.perf_counter()
        self.target.allocate(len(seqs), max_len)
        first = self._prefill(seqs)
        kept = [s.append([tok]) for s, tok in zip(seqs, first, strict=True)]
        self.proposer.start(seqs, len(seqs), max_len)
        prefill_s = time.perf_counter() - t0
        for s in seqs:
            s.stats.prefill_s = prefill_s
        yield list(zip(seqs, kept, strict=True))
        self._retire([s for s in seqs if s.finished])

        t1 = time.perf_counter()
        while True:
            active = [s for s in seqs if not s.finished]
            if not active:
                break
            added = self._step(active, k)
            now = time.perf_counter() - t1
            for s in active:
                s.stats.decode_s = now
            yield added
            self._retire([s for s in active if s.finished])

    def _retire(self, done: list[Sequence]) -> None:
        if done:
            self.proposer.finish(done)

    def _prefill(self, seqs: list[Sequence]) -> list[int]:
        tokens, lengths = pad_right([s.tokens for s in seqs])
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long)
        logits = self.target.forward(tokens, slots, logits_at=lengths - 1)  # [B, 1, V]
        self.target.truncate(slots, lengths)
        for s in seqs:
            s.stats.target_forwards += 1
        empty = Drafts.empty(len(seqs))
        _, next_tokens = self._verify(seqs, logits, empty)
        return next_tokens

    def _step(self, seqs: list[Sequence], k: int) -> list[tuple[Sequence, list[int]]]:
        # Never draft past what a sequence may still emit (its bonus token counts too).
        t0 = time.perf_counter()
        ks = [max(0, min(k, s.room() - 1)) for s in seqs]
        drafts = self.proposer.propose(seqs, ks) if any(ks) else Drafts.empty(len(seqs))
        t1 = time.perf_counter()
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long)
        last = torch.tensor([[s.tokens[-1]] for s in seqs], dtype=torch.long)  # [B, 1]
        inputs = torch.cat([last, drafts.tokens], dim=1)  # [B, k+1]
        cached = self.target.lengths(slots)  # [B]
        logits = self.target.forward(inputs, slots)  # [B, k+1, V]
        t2 = time.perf_counter()
        n_accepted, next_tokens = self._verify(seqs, logits, drafts)
        self.target.truncate(slots, cached + 1 + torch.tensor(n_accepted))
        self.proposer.accepted(seqs, n_accepted)

        added = []
        counts = drafts.counts.tolist()
        for i, s in enumerate(seqs):
            s.stats.record_step(counts[i], n_accepted[i])
            new = drafts.tokens[i, : n_accepted[i]].tolist() + [next_tokens[i]]
            added.append((s, s.append(new)))
        t3 = time.perf_counter()
        for s in seqs:
            s.stats.propose_s += t1 - t0
            s.stats.verify_s += t2 - t1
            s.stats.accept_s += t3 - t2
        return added

    def _verify(self, seqs, logits, drafts: Drafts) -> tuple[list[int], list[int]]:
        """Apply the acceptance rule (verify.py) row by row: greedy rows together."""
        dev = logits.device
        tokens, counts = drafts.tokens.to(dev), drafts.counts.to(dev)
        probs = None if drafts.probs is None else drafts.probs.to(dev)
        n_acc = [0] * len(seqs)
        nxt = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=dev)
            a, t = greedy_accept(logits[idx], tokens[idx], counts[idx])
            a, t = a.tolist(), t.tolist()
            for j, i in enumerate(greedy):
                n_acc[i], nxt[i] = a[j], t[j]
        for i, s in enumerate(seqs):
            if s.params.greedy:
                continue
            n = int(drafts.counts[i])
            p = process_logits(logits[i, : n + 1], s.params)[None]  # [1, n+1, V]
            q = None if probs is None else probs[i : i + 1, :n]
            u = torch.rand(1, n + 1, generator=s.generator)
            a, t = rejection_accept(p, q, tokens[i : i + 1, :n], counts[i : i + 1], u)
            n_acc[i], nxt[i] = int(a[0]), int(t[0])
        return n_acc, nxt
