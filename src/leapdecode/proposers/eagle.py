"""`eagle`: an EAGLE-3-style head drafts a dynamic tree (EAGLE-2) at the feature level.

Per sequence the head keeps its own KV cache over the pairs (target features at token t,
token t+1) for every token the target has cached (models/eagle.py). A proposal:

1. catch up: run the pairs the head has not seen (the target's aux hidden states arrive
   through `target_hidden`), batched and right-padded; the output at the last pair (kept
   as the sequence's root) guesses the first draft token. An eagle sequence that gets no
   drafts for a while has its pairs fed as they pile up (past BACKLOG), so they stay
   bounded; an auto one keeps them (bounded by its context) until auto picks eagle;
2. grow the tree (EAGLE-2): the root's top_k tokens are depth 1; at each depth the
   frontier (top_k nodes) runs one head step in one batched forward (each node attends to
   the cache, its ancestors and itself), each node's top_k children are scored by their
   cumulative log-probability, and the best top_k of those become the next frontier;
3. rerank: the `num_speculative_tokens` best nodes of all scored candidates (a child never
   scores above its parent, so the set holds every chosen node's parent) form the draft
   tree, in depth order.

The tree nodes never enter the head's cache: after verification the target's real
features for the accepted tokens replace them. Drafts are deterministic (top-k), so the
engine's tree verification keeps the output exactly the target's, greedy and sampled.
"""

from __future__ import annotations

import torch

from ..models.base import CausalLM, HiddenRequest
from ..models.eagle import Eagle3Head
from ..models.kv_cache import zeros
from ..sequence import Sequence, pad_right
from .base import HEAD_SIZING, Drafts, Offer, Parts, Proposer

BACKLOG = 256  # pending pairs past which a sequence's features are fed without a proposal


class EagleProposer(Proposer):
    name = "eagle"
    prior = 0.6
    sizing = HEAD_SIZING

    def __init__(self, head: Eagle3Head, target: CausalLM) -> None:
        self.head = head.to(device=target.device, dtype=torch.float32).eval()
        self.run = self.head.runner()  # the head's computation with fused weights
        self.target = target
        self.wants_hidden = HiddenRequest(layers=head.aux_layers)
        self.max_len = min(target.max_context + 2, head.max_positions)
        self.k_cache: torch.Tensor | None = None  # [slots, H_kv, max_len, D]
        self.v_cache: torch.Tensor | None = None
        self.fed: dict[int, int] = {}  # seq id -> pairs in its cache
        self.pending: dict[int, list[torch.Tensor]] = {}  # seq id -> [n, n_aux, H] features
        self.n_pending: dict[int, int] = {}  # seq id -> pairs in pending (kept, not summed)
        self.root: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq id -> (o, log-probs)

    # ---------------------------------------------------------------- lifecycle
    def _ensure_slots(self, n_slots: int) -> None:
        h = self.head
        if self.k_cache is None or self.k_cache.shape[0] < n_slots:
            shape = (n_slots, h.kv_heads, self.max_len, h.head_dim)
            old_k, old_v = self.k_cache, self.v_cache
            self.k_cache = zeros(shape, torch.float32, self.target.device)
            self.v_cache = zeros(shape, torch.float32, self.target.device)
            if old_k is not None:
                self.k_cache[: old_k.shape[0]] = old_k
                self.v_cache[: old_v.shape[0]] = old_v

    def add(self, seqs: list[Sequence]) -> None:
        # only eagle requests (and auto ones, which may pick it) keep features and a cache
        seqs = [s for s in seqs if s.spec.may_use(self.name)]
        if seqs:
            self._ensure_slots(1 + max(s.slot for s in seqs))
        for s in seqs:
            self.fed[s.id] = 0
            self.pending[s.id] = []
            self.n_pending[s.id] = 0

    def target_hidden(self, seqs, hidden, final) -> None:
        for s, h in zip(seqs, hidden, strict=True):
            # a finished row (stopped inside the accepted path) leaves this step: it may hold
            # fewer new tokens than features, and needs no more drafts
            if h is not None and s.id in self.pending and not s.finished:
                self.pending[s.id].append(h.float())
                self.n_pending[s.id] += len(h)
        # eagle rows that keep getting k = 0 (a busy batch) would pile up features: feed them
        # now. An auto row keeps its features (at most its context's) until auto first picks
        # eagle for it: most never do, and the head's pass over a whole prompt costs a
        # sizeable share of the target's prefill.
        backlog = [
            s
            for s in seqs
            if not s.finished
            and s.spec.method == self.name
            and self.n_pending.get(s.id, 0) > BACKLOG
        ]
        if backlog:
            with torch.inference_mode():
                self._catch_up(backlog)

    def remove(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.fed.pop(s.id, None)
            self.pending.pop(s.id, None)
            self.n_pending.pop(s.id, None)
            self.root.pop(s.id, None)

    @classmethod
    def build(cls, parts: Parts) -> EagleProposer | None:
        return None if parts.eagle is None else cls(parts.eagle, parts.target)

    def offer(self, seq: Sequence, budget: int) -> Offer | None:
        """A tree of `budget` nodes grown `speculative_num_steps` deep, once its features
        have arrived."""
        if budget < 1 or not self.ready(seq):
            return None
        return Offer(budget, depth=self.span(seq, budget))

    def span(self, seq: Sequence, k: int) -> int:
        return min(k, seq.spec.speculative_num_steps)

    def guess_layers(self, seqs: list[Sequence]) -> float:
        """A head step per depth, each about two target layers (a layer, plus its head and
        the tree's upkeep)."""
        return 2.0 * max(s.spec.speculative_num_steps for s in seqs)

    def ready(self, seq: Sequence) -> bool:
        """Whether `seq` can be drafted for now (its features have arrived)."""
        return bool(self.pending.get(seq.id)) or seq.id in self.root

    # ------------------------------------------------------------------ propose
    def _take_pending(self, seqs: list[Sequence]):
        """Each row's pairs not yet fed, emptied from `pending`: (features [n, n_aux, H] or
        None, the token after each feature)."""
        feats, toks = [], []
        for s in seqs:
            aux = torch.cat(self.pending[s.id]) if self.pending[s.id] else None
            self.pending[s.id], self.n_pending[s.id] = [], 0
            fed = self.fed[s.id]
            n = 0 if aux is None else len(aux)
            toks.append(s.tokens[fed + 1 : fed + 1 + n])  # the token after each feature
            feats.append(None if aux is None else aux[: len(toks[-1])])
        return feats, toks

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Feed every pending pair of `seqs` (each has some) into the head's cache; keep
        each row's output at its last pair (the root of its next tree) in `self.root`."""
        h = self.head
        dev = self.k_cache.device
        feats, toks = self._take_pending(seqs)
        counts = torch.tensor([len(t) for t in toks])
        if int(counts.min()) == 0:
            raise RuntimeError("eagle: a sequence has no new target features to draft from")
        tokens, _ = pad_right(toks)  # [B, T]
        b, t = tokens.shape
        aux = torch.zeros(b, t, len(h.aux_layers), h.target_hidden, device=dev)
        for i, f in enumerate(feats):
            aux[i, : len(f)] = f
        start = torch.tensor([self.fed[s.id] for s in seqs])  # [B]
        slots = torch.tensor([s.slot for s in seqs])
        positions = (start[:, None] + torch.arange(t) + 1).clamp(max=self.max_len - 1)
        g = self.run.combine(aux)  # [B, T, hidden]
        emb = self.target.embed_tokens(tokens).float()
        q, k, v = self.run.qkv(g, emb, positions.to(dev))
        write = (start[:, None] + torch.arange(t)).clamp(max=self.max_len - 1)  # [B, T]
        for i in range(b):
            n = int(counts[i])
            slot, at = int(slots[i]), write[i, :n].to(dev)
            self.k_cache[slot, :, at] = k[i, :, :n]
            self.v_cache[slot, :, at] = v[i, :, :n]
        span = int((start + counts).max())
        keys, values = self.k_cache[slots, :, :span], self.v_cache[slots, :, :span]
        key = torch.arange(span)
        mask = key[None, None, :] <= write[:, :, None]  # [B, T, S] causal
        o, logits = self.run.finish(g, q, keys, values, mask[:, None].to(dev))
        last = (counts - 1).to(dev)
        rows = torch.arange(b, device=dev)
        o, logp = o[rows, last], logits[rows, last].log_softmax(-1)  # [B, h], [B, Vd]
        for i, (s, n) in enumerate(zip(seqs, counts.tolist(), strict=True)):
            self.fed[s.id] += n
            self.root[s.id] = (o[i], logp[i])

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        rows = [
            i
            for i, (s, k) in enumerate(zip(seqs, ks, strict=True))
            if k > 0 and (self.pending.get(s.id) or s.id in self.root)
        ]
        out: list[tuple[list[int], list[int]]] = [([], [])] * len(seqs)
        groups: dict[tuple[int, int], list[int]] = {}  # each request's own tree shape
        for i in rows:
            spec = seqs[i].spec
            groups.setdefault((spec.speculative_eagle_topk, spec.speculative_num_steps), []).append(
                i
            )
        for (top_k, depth), group in groups.items():
            trees = self._grow([seqs[i] for i in group], [ks[i] for i in group], top_k, depth)
            for j, i in enumerate(group):
                out[i] = trees[j]
        return Drafts.from_trees(out)

    def _grow(self, seqs: list[Sequence], budgets: list[int], top_k: int, depth: int):
        """The draft trees (tokens, parents) of `seqs`, top_k nodes kept per depth, `depth`
        depths (see the module notes)."""
        depth = min(depth, max(budgets))  # b nodes reach depth b at most: the same trees
        for s in seqs:
            s.stats.draft_forwards += depth  # the catch-up, then one per depth grown
        fresh = [s for s in seqs if self.pending[s.id]]
        if fresh:
            self._catch_up(fresh)
        o = torch.stack([self.root[s.id][0] for s in seqs])  # [B, h] output at the last pair
        logp = torch.stack([self.root[s.id][1] for s in seqs])  # [B, Vd]
        cached = torch.tensor([self.fed[s.id] for s in seqs])  # [B] pairs in the cache
        b, dev = len(seqs), o.device
        slots = torch.tensor([s.slot for s in seqs])
        span = int(cached.max())
        n_tree = (depth - 1) * top_k  # nodes run through the head (all but the last depth)
        # committed keys, then each depth's nodes: [B, H_kv, S + n_tree, D]
        keys = torch.cat(
            [
                self.k_cache[slots, :, :span],
                self.k_cache.new_zeros(b, self.head.kv_heads, n_tree, self.head.head_dim),
            ],
            2,
        )
        values = torch.cat([self.v_cache[slots, :, :span], torch.zeros_like(keys[:, :, span:])], 2)
        committed = (torch.arange(span)[None, :] < cached[:, None]).to(dev)  # [B, S]
        committed = committed[:, None].expand(b, top_k, span)  # [B, top_k, S]
        eye = torch.eye(top_k, dtype=torch.bool, device=dev).expand(b, top_k, top_k)
        # candidate nodes (all depths): draft-vocab id, score, parent candidate (-1 = root)
        score, tok = logp.topk(top_k, dim=-1)  # [B, top_k]
        cand_tok, cand_score = [tok], [score]
        cand_parent = [torch.full((b, top_k), -1, device=dev)]
        frontier = torch.arange(top_k, device=dev).expand(b, top_k)  # candidate ids
        front_feat = o[:, None].expand(b, top_k, o.shape[-1])  # [B, top_k, hidden]
        front_tok, front_score = tok, score  # [B, top_k] the frontier's tokens and scores
        anc = torch.zeros(b, top_k, 0, dtype=torch.bool, device=dev)  # frontier -> run nodes
        for d in range(1, depth):
            n_run = (d - 1) * top_k  # nodes run before this depth
            emb = self.target.embed_tokens(self.head.draft_ids[front_tok]).float()
            positions = (cached[:, None] + d).expand(b, top_k).clamp(max=self.max_len - 1)
            q, k, v = self.run.qkv(front_feat, emb, positions.to(dev))
            keys[:, :, span + n_run : span + n_run + top_k] = k
            values[:, :, span + n_run : span + n_run + top_k] = v
            # a node sees the committed cache, its ancestors (its parent's, then its parent)
            # and itself
            anc = torch.cat([anc, eye], dim=2)  # [B, top_k, n_run + top_k]
            mask = torch.cat([committed, anc], dim=2)[:, None]
            upto = span + n_run + top_k
            o_new, logits = self.run.finish(
                front_feat, q, keys[:, :, :upto], values[:, :, :upto], mask
            )
            child_score, child_tok = logits.log_softmax(-1).topk(top_k, dim=-1)  # [B, k, k]
            total = (front_score[..., None] + child_score).flatten(1)  # [B, k*k]
            c0 = sum(t.shape[1] for t in cand_tok)
            cand_tok.append(child_tok.flatten(1))
            cand_score.append(total)
            cand_parent.append(frontier[:, :, None].expand(b, top_k, top_k).flatten(1))
            front_score, best = total.topk(top_k, dim=-1)  # [B, top_k] among this depth's
            parent = best // top_k  # [B, top_k] the frontier slot each new node hangs off
            front_tok = child_tok.flatten(1).gather(1, best)
            front_feat = o_new.gather(1, parent[..., None].expand(-1, -1, o.shape[-1]))
            anc = anc.gather(1, parent[..., None].expand(-1, -1, anc.shape[2]))
            frontier = c0 + best
        return self._rerank(cand_tok, cand_score, cand_parent, budgets)

    def _rerank(self, cand_tok, cand_score, cand_parent, budgets):
        h = self.head
        toks = h.draft_ids[torch.cat(cand_tok, 1)].cpu()  # [B, C] target ids
        scores = torch.cat(cand_score, 1).cpu()
        parents = torch.cat(cand_parent, 1).cpu()
        trees = []
        for i, budget in enumerate(budgets):
            row = scores[i].nan_to_num(nan=float("-inf"))
            # a child never scores above its parent and has a larger id: on ties the stable
            # order keeps the parent first, so the best `budget` are a tree
            order = row.argsort(descending=True, stable=True)[:budget].tolist()
            chosen = set(order)
            for c in list(order):  # defensive: a dropped parent is added back
                p = int(parents[i, c])
                while p >= 0 and p not in chosen:
                    chosen.add(p)
                    p = int(parents[i, p])
            # candidate ids grow with depth: parents come first, and any prefix is a tree
            nodes = sorted(chosen)[:budget]
            index = {c: j + 1 for j, c in enumerate(nodes)}
            tokens = [int(toks[i, c]) for c in nodes]
            par = [index.get(int(parents[i, c]), 0) for c in nodes]
            trees.append((tokens, par))
        return trees
