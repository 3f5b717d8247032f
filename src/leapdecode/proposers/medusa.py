"""`medusa`: a static tree of the Medusa heads' top tokens, verified in one target forward.

The heads read the target's normed last hidden state at the last input the target has
cached (the one whose logits chose the sequence's last token); head i's ranked tokens
fill depth i of the static tree (models/medusa.py says how the tree is chosen). The drafts
are deterministic, so the engine's tree verification keeps the output exactly the
target's: greedy, and under sampling (verify.py).
"""

from __future__ import annotations

import torch

from ..models.base import CausalLM, HiddenRequest
from ..models.medusa import MedusaHeads, tree_layout
from ..sequence import Sequence
from .base import HEAD_SIZING, Drafts, Offer, Parts, Proposer


class MedusaProposer(Proposer):
    name = "medusa"
    wants_hidden = HiddenRequest(final=True)
    prior = 0.5
    sizing = HEAD_SIZING

    def __init__(self, heads: MedusaHeads, target: CausalLM) -> None:
        self.heads = heads.to(device=target.device, dtype=torch.float32)
        self.target = target
        self.last: dict[int, torch.Tensor] = {}  # seq id -> [hidden] at its last cached input
        self.max_rank = 1 + max((p[-1] for p in heads.tree), default=0)
        self.layouts: dict[int, tuple[list[int], list[int], list[int]]] = {}  # k -> layout

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.last.pop(s.id, None)

    def target_hidden(self, seqs, hidden, final) -> None:
        for s, f in zip(seqs, final, strict=True):
            if f is not None and len(f) and s.spec.may_use(self.name):
                self.last[s.id] = f[-1].clone()  # not a view keeping the prefill's states

    @classmethod
    def build(cls, parts: Parts) -> MedusaProposer | None:
        return None if parts.medusa is None else cls(parts.medusa, parts.target)

    def offer(self, seq: Sequence, budget: int) -> Offer | None:
        """Its static tree's first `budget` nodes, once the target's state has arrived."""
        return Offer(budget, depth=self.depth(budget)) if budget > 0 and self.ready(seq) else None

    def span(self, seq: Sequence, k: int) -> int:
        return self.depth(k)

    def ready(self, seq: Sequence) -> bool:
        return seq.id in self.last

    def depth(self, k: int) -> int:
        """Depth of the first k nodes of the static tree."""
        return max((len(p) for p in self.heads.tree[:k]), default=0)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        rows = [
            i for i, (s, k) in enumerate(zip(seqs, ks, strict=True)) if k > 0 and s.id in self.last
        ]
        if not rows:
            return Drafts.empty(len(seqs))
        for i in rows:
            seqs[i].stats.draft_forwards += 1  # one pass of the heads
        for i in rows:
            if ks[i] not in self.layouts:  # the static tree's first k nodes
                self.layouts[ks[i]] = tree_layout(self.heads.tree, ks[i])
        n = max(max(self.layouts[ks[i]][0]) + 1 for i in rows)  # heads the trees reach
        h = torch.stack([self.last[seqs[i].id] for i in rows]).float()  # [R, hidden]
        z = self.heads(h, n)  # [R, n, hidden]
        logits = self.target.head_logits(z)  # [R, n, V]
        top = logits.topk(self.max_rank, dim=-1).indices.cpu()  # [R, n, ranks]
        trees = []
        for j, i in enumerate(rows):
            head, rank, parents = self.layouts[ks[i]]
            tokens = top[j, head, rank].tolist()
            trees.append((tokens, parents))
        out: list[tuple[list[int], list[int]]] = [([], [])] * len(seqs)
        for j, i in enumerate(rows):
            out[i] = trees[j]
        return Drafts.from_trees(out)

    def remove(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.last.pop(s.id, None)
