"""`peagle`: a parallel EAGLE head (P-EAGLE) drafts a chain of k tokens in one head forward.

The head is the EAGLE-3 layer of proposers/eagle.py with a mask slot's learnt aux hidden
states and a mask token (models/eagle.py). A proposal is one forward over, per row,

    [the pairs the head has not seen (target features, token after) ..., mask x (k - 1)]

The pairs enter the head's cache as in `eagle`'s catch-up; the output at the last pair
guesses draft 1 (as the root of an EAGLE tree), and mask slot j, at the position j tokens
past it, attending to the cache and to the slots before it, guesses draft j + 1. The slots
never enter the cache. The chain is top-1 at every position (deterministic, one-hot q), so
the engine's chain verification keeps the output the target's, greedy and sampled.

Against `eagle`, whose tree grows one head forward per depth, this trades the drafts'
dependence on each other (slot j does not see drafts 1..j) for a single forward.
"""

from __future__ import annotations

import logging

import torch

from ..sequence import Sequence
from .base import Drafts, Offer, Parts
from .eagle import EagleProposer

log = logging.getLogger("leapdecode")


class PeagleProposer(EagleProposer):
    name = "peagle"
    prior = 0.5
    sizing = (1, 0)  # a chain of up to a request's k

    def __init__(self, head, target) -> None:
        super().__init__(head, target)
        self.warned = False  # a k above what the head was trained for is said once

    @classmethod
    def build(cls, parts: Parts) -> PeagleProposer | None:
        return None if parts.peagle is None else cls(parts.peagle, parts.target)

    def offer(self, seq: Sequence, budget: int) -> Offer | None:
        if budget < 1 or not self.ready(seq):
            return None
        return Offer(min(budget, self.head.parallel))

    def span(self, seq: Sequence, k: int) -> int:
        return k

    def guess_layers(self, seqs: list[Sequence]) -> float:
        return 2.0  # one head forward: about two target layers

    def _k(self, want: int) -> int:
        most = self.head.parallel
        if want > most and not self.warned:
            self.warned = True
            log.warning("peagle: k=%d asked, the head was trained for %d: drafting %d",
                        want, most, most)  # fmt: skip
        return min(want, most)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        rows = [i for i, (s, k) in enumerate(zip(seqs, ks, strict=True)) if k > 0 and self.ready(s)]
        out: list[list[int]] = [[] for _ in seqs]
        if rows:
            want = [self._k(ks[i]) for i in rows]
            chains = self._draft([seqs[i] for i in rows], max(want))  # [n, k] target ids
            for i, w, chain in zip(rows, want, chains.tolist(), strict=True):
                out[i] = chain[:w]
        return Drafts.from_lists(out)

    def _draft(self, seqs: list[Sequence], k: int) -> torch.Tensor:
        """One head forward: each row's unseen pairs, then k - 1 mask slots; the pairs enter
        the cache. Returns the top-1 chains [B, k] (target ids)."""
        h, run, dev = self.head, self.run, self.k_cache.device
        m = k - 1
        for s in seqs:
            s.stats.draft_forwards += 1
        feats, toks = self._take_pending(seqs)
        counts = torch.tensor([len(t) for t in toks])  # [B] new pairs (0: the root is kept)
        b, n_max = len(seqs), int(counts.max())
        t = n_max + m
        if t == 0:  # one draft and nothing new to feed: the kept roots guess it
            logp = torch.stack([self.root[s.id][1] for s in seqs])
            return h.draft_ids[logp.argmax(-1, keepdim=True)].cpu()
        start = torch.tensor([self.fed[s.id] for s in seqs])  # [B] pairs already cached
        slots = torch.tensor([s.slot for s in seqs])
        idx = torch.arange(t)
        is_pair = idx[None, :] < counts[:, None]  # [B, T]
        is_mask = (idx[None, :] >= counts[:, None]) & (idx[None, :] < (counts + m)[:, None])
        # each row's pairs, then its masks, right-padded: index of a row's mask slot j is n + j - 1
        aux = torch.zeros(b, t, len(h.aux_layers), h.target_hidden, device=dev)
        tokens = torch.zeros(b, t, dtype=torch.long)
        for i, (f, tk) in enumerate(zip(feats, toks, strict=True)):
            if f is not None:
                aux[i, : len(f)] = f
                tokens[i, : len(tk)] = torch.tensor(tk)
        g = run.combine(aux)  # [B, T, hidden]
        g = torch.where(is_mask[..., None].to(dev), run.mask_feature, g)
        tokens = torch.where(is_mask, run.pard_token, tokens)
        emb = self.target.embed_tokens(tokens.to(dev)).float()
        positions = (start[:, None] + idx + 1).clamp(max=self.max_len - 1)  # [B, T]
        q, k_new, v_new = run.qkv(g, emb, positions.to(dev))
        write = (start[:, None] + idx).clamp(max=self.max_len - 1)  # [B, T] cache index
        for i in range(b):
            n = int(counts[i])
            if n:
                at = write[i, :n].to(dev)
                self.k_cache[int(slots[i]), :, at] = k_new[i, :, :n]
                self.v_cache[int(slots[i]), :, at] = v_new[i, :, :n]
        span = int((start + counts).max())
        keys = torch.cat([self.k_cache[slots, :, :span], k_new], 2)  # [B, H_kv, S + T, D]
        values = torch.cat([self.v_cache[slots, :, :span], v_new], 2)
        cached = start + counts  # [B] pairs in the cache after this forward
        key = torch.arange(span)
        # pairs: causal over the cache; mask slots: the whole cache, and the slots up to
        # themselves (never the pairs' own new keys twice: those are in the cache part)
        pair_cache = key[None, None, :] <= write[:, :, None]  # [B, T, S]
        mask_cache = key[None, None, :] < cached[:, None, None]
        to_cache = torch.where(is_pair[..., None], pair_cache, mask_cache & is_mask[..., None])
        to_new = (
            is_mask[:, None, :] & is_mask[:, :, None] & (idx[None, None, :] <= idx[None, :, None])
        )
        mask = torch.cat([to_cache, to_new], 2)  # [B, T, S + T]
        mask = mask | ~mask.any(-1, keepdim=True)  # padding rows: anything, unused
        o, logits = run.finish(g, q, keys, values, mask[:, None].to(dev))
        rows = torch.arange(b, device=dev)
        has = (counts > 0).to(dev)
        last = (counts - 1).clamp(min=0).to(dev)
        logp = logits[rows, last].log_softmax(-1)  # [B, Vd] at the last pair
        for i, s in enumerate(seqs):
            if bool(has[i]):
                self.fed[s.id] += int(counts[i])
                self.root[s.id] = (o[i, last[i]], logp[i])
            else:  # nothing new: the root kept from the last forward guesses draft 1
                logp[i] = self.root[s.id][1]
        first = logp.argmax(-1, keepdim=True)  # [B, 1]
        at = (counts[:, None] + torch.arange(m)).to(dev)  # [B, m] mask slot indices
        rest = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)
        return h.draft_ids[torch.cat([first, rest], 1)].cpu()  # [B, k]
