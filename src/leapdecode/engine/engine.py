"""The engine as a service: requests join and leave at step boundaries; one step at a time.

    add_request(seq)   queue a request (validated Sequence)
    abort(id)          drop a request, waiting or running, and free its slot
    step()             admit waiting requests into free KV slots and prefill them; then one
                       propose -> verify -> accept round for every running sequence

Every running sequence gets its own method and k each step (0 allowed) from the planner
(`auto` picks them to maximise the batch's goodput). Drafts of different proposers are
merged into one ragged batch and verified in one target forward.

Cache convention: the target's cache holds every token of a sequence except the last one,
which is fed at the next step together with that step's drafts:

    input  [last, d1 .. dk]        -> logits [k+1, V]
    logits[i] scores draft d(i+1); logits[n_accepted] gives the target's own next token
    cache  keeps last + d1 .. d(n_accepted)   (rollback = truncate, O(1))
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from .. import memory
from ..config import DRAFT_CONTEXT, MAX_K
from ..errors import LeapDecodeError
from ..models.base import CausalLM, HiddenRequest
from ..proposers import registry
from ..proposers.base import Drafts, Parts, Proposer
from ..sequence import Sequence, pad_right
from ..tree import ancestor_mask, depths
from ..verify import accept_batch
from .cost_model import CostModel
from .planner import Planner

log = logging.getLogger("leapdecode")

PREFILL_PADDING = 0.25  # a prefill forward's padding may be at most this share of its real tokens
PREFILL_PAD_ROWS = 64  # ... or this many rows (cheaper than another forward's fixed cost)
PREFILL_TOKENS = 1024  # a prefill forward of several prompts holds at most this many rows


def length_groups(
    lengths: list[int],
    slack: float = PREFILL_PADDING,
    pad_rows: int = PREFILL_PAD_ROWS,
    budget: int = PREFILL_TOKENS,
) -> list[list[int]]:
    """Indices of `lengths` in groups to prefill together: longest first, a group grows while
    its padding (rows padded to its longest, less its real tokens) stays within slack x its
    real tokens or pad_rows, and its rows (padding included) within budget. One right-padded
    forward for every prompt admitted at once spent a third of its rows on padding, and a
    row of padding costs what a real one does on a CPU; and a forward's tokens/s falls past
    about a thousand rows, as its activations outgrow the caches (figures:
    docs/auto_planning.md, "Prefill groups")."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        real = sum(lengths[j] for j in g) + lengths[i] if g else 0
        rows = (len(g) + 1) * lengths[g[0]] if g else 0
        if g is not None and rows - real <= max(slack * real, pad_rows) and rows <= budget:
            g.append(i)
        else:
            groups.append([i])
    return groups


class Engine:
    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None = None,
        max_num_seqs: int = 16,
        metrics=None,
        suffix_decoding_max_tree_depth: int = 24,
        suffix_decoding_max_cached_requests: int = 10_000,
        medusa=None,
        eagle=None,
        token_strings: list[str] | None = None,
        peagle=None,
        pard: CausalLM | None = None,
        max_model_len: int | None = None,
        kv_cache_memory: int | str | None = None,
        draft_context: int | None = DRAFT_CONTEXT,
    ) -> None:
        """target, draft: the models (pard: a parallel draft model beside the draft, with
        its own cache); medusa, eagle, peagle: heads trained on the target;
        token_strings: each token's text (the suffix method matches characters with it);
        max_model_len: the longest sequence (prompt and output), at most the target's own
        context (default: the longest whose KV caches fit kv_cache_memory); kv_cache_memory:
        bytes, or a size such as "4GiB", for every model's KV cache together (default: a
        share of the memory free now; memory.py); draft_context: the most tokens a draft
        model's catch-up feeds (a window of the sequence; None: all; proposers/draft_model.py).
        Every registered method whose proposer can run on these is built (registry.py)."""
        if max_num_seqs < 1:
            raise LeapDecodeError("max_num_seqs must be >= 1", field="max_num_seqs")
        self.target = target
        self.max_num_seqs = max_num_seqs
        self.max_model_len = self._size_context(
            {"target": target, "draft": draft, "pard": pard},
            {"eagle": eagle, "peagle": peagle},
            max_model_len,
            kv_cache_memory,
        )
        self.max_len = self.max_model_len + MAX_K + 1  # room for drafts past the last token
        parts = Parts(
            target,
            draft,
            pard,
            medusa,
            eagle,
            peagle,
            suffix_decoding_max_tree_depth,
            suffix_decoding_max_cached_requests,
            token_strings,
            draft_context,
        )
        self.proposers: dict[str, Proposer] = {}
        for name in registry.names()[:-1]:  # all but auto
            built = registry.get(name).proposer_class().build(parts)
            if built is not None:
                built.name = name
                self.proposers[name] = built
        self.draft, self.pard = draft, pard
        self.metrics = metrics
        self.planner = Planner(self.proposers, target, self._profile_costs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(max_num_seqs))
        self.last_step_ks: list[int] = []  # drafts per sequence in the last decode step

    def _size_context(self, models: dict, heads: dict, max_model_len, kv_cache_memory) -> int:
        """The engine's max_model_len (memory.plan_length), set on every model as its
        `max_context`, so that requests, proposers and the cost model keep to it."""
        models = {name: m for name, m in models.items() if m is not None}
        for m in models.values():
            m.limit_context(None)  # the model's own maximum, whatever an engine set before
        per_token = {name: m.kv_bytes_per_token() for name, m in models.items()}
        for name, head in heads.items():
            if head is not None and hasattr(head, "kv_heads"):
                per_token[name] = memory.head_bytes_per_token(head)
        if kv_cache_memory is None:
            held = sum(memory.cache_bytes(m) for m in models.values())
            budget, note = memory.default_budget(self.target.device, held)
        else:
            budget, note = memory.parse_size(kv_cache_memory), ""
        length = memory.plan_length(
            self.target.model_max_context,
            per_token,
            self.max_num_seqs,
            MAX_K + 1,
            max_model_len,
            budget,
            note,
        )
        for m in models.values():
            m.limit_context(length)
        self.kv_cache_bytes = self.max_num_seqs * (length + MAX_K + 1) * sum(per_token.values())
        log.info(
            "max_model_len %d: KV caches of up to %s for %d slots (kv_cache_memory %s%s)",
            length, memory.format_size(self.kv_cache_bytes), self.max_num_seqs,
            memory.format_size(budget), f", {note}" if note else "",
        )  # fmt: skip
        return length

    # ------------------------------------------------------------------ service
    def allocate(self) -> None:
        """Reserve every KV slot (cheap when they exist already: the caches are only emptied).
        Done whenever the engine is idle and gets work, so that code which used the models
        directly in between (a cost measurement, say) cannot leave them in another shape."""
        if self.running or self.waiting:
            return  # the caches are in use
        self.target.allocate(self.max_num_seqs, self.max_len)
        for model in (self.draft, self.pard):
            if model is not None:
                model.allocate(self.max_num_seqs, self.max_len)

    def saved_costs(self) -> CostModel | None:
        """The step costs a process before measured for these models on this machine, or
        None (then `auto` profiles them when first needed: cost_model.py)."""
        return CostModel.load(self.target, self.draft, self.max_num_seqs)

    def _profile_costs(self) -> CostModel:
        """The saved step costs (saved_costs), else measured on this engine's own (emptied)
        caches and saved."""
        cost = self.saved_costs()
        if cost is None:
            self.allocate()
            cost = CostModel.profile(self.target, self.draft, self.max_num_seqs)
            cost.save(self.target, self.draft, self.max_num_seqs)
        return cost

    def compile(self) -> float:
        """Compile the target's short steps (native backend) for this engine's batch size and
        the hidden states its proposers want; returns the seconds the warm-up took."""
        compile_model = getattr(self.target, "compile", None)
        if compile_model is None:
            raise LeapDecodeError(
                f"--compile needs the native backend, not {self.target.name}: leave it out"
            )
        want = HiddenRequest()
        for p in self.proposers.values():
            want = want.union(p.wants_hidden)
        self.allocate()
        return compile_model(self.max_num_seqs, want.layers)

    def capabilities(self) -> dict:
        """What `registry.check` needs to know of this engine (the server's HTTP process
        checks requests with it, away from the models)."""
        return {"backend": self.target.name, "loaded": list(self.proposers)}

    def check(self, spec) -> None:
        """Refuse a request this engine cannot run (before it is queued)."""
        registry.check(spec, **self.capabilities())

    def add_request(self, seq: Sequence) -> None:
        self.check(seq.spec)
        self.allocate()
        self.waiting.append(seq)

    def abort(self, seq_id) -> Sequence | None:
        """Drop a request wherever it is; returns it (finish_reason "abort"), or None."""
        for seq in list(self.waiting):
            if seq.id == seq_id:
                self.waiting.remove(seq)
                seq.finished, seq.finish_reason = True, "abort"
                return seq
        for seq in self.running:
            if seq.id == seq_id:
                seq.finished, seq.finish_reason = True, "abort"
                self._retire([seq])
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One engine step; returns (sequence, tokens it gained) for every sequence touched.
        A finished sequence (seq.finished) has left the engine when this returns."""
        if (
            self.planner.cost is None
            and not self.running
            and any(s.spec.method == "auto" for s in self.waiting)
        ):
            self.planner.ensure_cost_model()  # needs empty caches: profile while idle
        t0 = time.perf_counter()
        self.last_step_ks = []
        admitted = self._admit()
        out = self._prefill(admitted) if admitted else []
        new = {id(s) for s in admitted}
        decoding = [s for s in self.running if not s.finished and id(s) not in new]
        # in slot order: consecutive slots make the caches' reads views, not gathered copies
        decoding.sort(key=lambda s: s.slot)
        if decoding:
            out += self._decode(decoding)
        self._retire([s for s in self.running if s.finished])
        if self.metrics is not None:
            self.metrics.on_step(self, time.perf_counter() - t0, out)
        return out

    # -------------------------------------------------------------------- steps
    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            admitted.append(seq)
        if admitted:
            self.running.extend(admitted)
            for p in self.proposers.values():
                p.add(admitted)
        return admitted

    def _retire(self, done: list[Sequence]) -> None:
        if not done:
            return
        for p in self.proposers.values():
            p.remove(done)
        for seq in done:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        self.free_slots.sort()
        self.planner.forget(done)

    def _slots(self, seqs: list[Sequence]) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs], dtype=torch.long)

    def _prefill(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """The admitted prompts' forwards: prompts of very different lengths go in separate
        forwards (see length_groups). Returns (sequence, its first token) in seqs' order."""
        done: dict[int, tuple[Sequence, list[int]]] = {}
        admitted = time.perf_counter()  # queue_s ends here for all of them
        for group in length_groups([len(s.tokens) for s in seqs]):
            for s, toks in self._prefill_group([seqs[i] for i in group], admitted):
                done[id(s)] = (s, toks)
        return [done[id(s)] for s in seqs]

    def _prefill_group(
        self, seqs: list[Sequence], admitted: float
    ) -> list[tuple[Sequence, list[int]]]:
        t0 = time.perf_counter()
        tokens, lengths = pad_right([s.tokens for s in seqs])
        slots = self._slots(seqs)
        self.target.truncate(slots, torch.zeros(len(seqs), dtype=torch.long))
        want = self._wanted(seqs)
        logits, outs = self._forward(tokens, slots, want, logits_at=lengths - 1)  # [B, 1, V]
        self.target.truncate(slots, lengths)
        _, _, first = self._verify(seqs, logits, Drafts.empty(len(seqs)))
        now = time.perf_counter()
        out = []
        for s, tok in zip(seqs, first, strict=True):
            s.stats.target_forwards += 1
            s.stats.prefill_s = now - t0
            s.stats.first_token_s = now
            s.stats.queue_s = admitted - s.arrival_s
            out.append((s, s.append([tok])))
        if outs is not None:
            self._share_hidden(seqs, outs, want, [torch.arange(int(n)) for n in lengths])
        return out

    def _wanted(self, seqs: list[Sequence]) -> HiddenRequest:
        """The hidden states the batch's methods need from the target (as transformers'
        requires_model_outputs): only batches with medusa or eagle requests ask for any."""
        want = HiddenRequest()
        for p in self.proposers.values():
            if any(s.spec.may_use(p.name) for s in seqs):  # auto may pick a loaded head
                want = want.union(p.wants_hidden)
        return want

    def _forward(self, inputs, slots, want: HiddenRequest, **kw):
        """The target's forward: (logits, ForwardOutput or None)."""
        if not want:
            return self.target.forward(inputs, slots, **kw), None
        outs = self.target.forward_outputs(inputs, slots, want, **kw)
        return outs.logits, outs

    def _share_hidden(self, seqs, outs, want: HiddenRequest, cached: list[torch.Tensor]) -> None:
        """Give the proposers that want them the hidden states at the inputs each sequence
        has just cached for good (cached[i]: their input indices)."""
        hidden = [None] * len(seqs)
        final = [None] * len(seqs)
        for i, idx in enumerate(cached):
            at = idx.to(outs.logits.device)
            if outs.hidden is not None:
                hidden[i] = outs.hidden[i, at]  # [n, layers, H]
            if outs.final is not None:
                final[i] = outs.final[i, at]  # [n, H]
        for p in self.proposers.values():
            if p.wants_hidden and any(s.spec.may_use(p.name) for s in seqs):
                layers = [want.layers.index(j) for j in p.wants_hidden.layers]
                p.target_hidden(
                    seqs,
                    [h[:, layers] if h is not None and layers else None for h in hidden],
                    final,
                )

    def _decode(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """One step of the running sequences: plan, propose, one target forward over every
        row's last token and drafts, accept (verify.py), roll the caches back to what was
        accepted, and commit the new tokens."""
        t0 = time.perf_counter()
        plan = self.planner.plan(seqs)  # [(method, k)] per sequence
        groups, drafts, propose_s = self._propose(seqs, plan)
        t1 = time.perf_counter()
        slots, want = self._slots(seqs), self._wanted(seqs)
        cached = self.target.lengths(slots)  # [B]
        last = torch.tensor([[s.tokens[-1]] for s in seqs], dtype=torch.long)  # [B, 1]
        inputs = torch.cat([last, drafts.tokens], dim=1)  # [B, k+1]
        logits, outs, spans = self._score(inputs, slots, want, drafts)
        t2 = time.perf_counter()
        paths, n_accepted, next_tokens = self._verify(seqs, logits, drafts)
        self._roll_back(slots, cached, drafts, paths, n_accepted)
        self._feed(seqs, groups, logits, n_accepted)
        added = []
        for i, s in enumerate(seqs):
            new = inputs[i, paths[i, : n_accepted[i]]].tolist() + [next_tokens[i]]
            added.append((s, s.append(new)))
        if outs is not None:  # the root and the accepted path are cached for good
            zero = torch.zeros(1, dtype=torch.long)
            kept = [torch.cat([zero, paths[i, : n_accepted[i]]]) for i in range(len(seqs))]
            self._share_hidden(seqs, outs, want, kept)
        self._record(
            seqs, plan, drafts, n_accepted, propose_s, spans, (t0, t1, t2, time.perf_counter())
        )
        return added

    def _propose(self, seqs, plan) -> tuple[dict[str, list[int]], Drafts, dict[str, float]]:
        """Each planned method's drafts for its rows, merged into one batch: (rows by
        method, drafts, each method's propose time)."""
        groups: dict[str, list[int]] = {}
        for i, (method, k) in enumerate(plan):
            if k > 0:
                groups.setdefault(method, []).append(i)
        parts, propose_s = [], {}
        for method, rows in groups.items():
            tp = time.perf_counter()
            drafts = self.proposers[method].propose(
                [seqs[i] for i in rows], [plan[i][1] for i in rows]
            )
            parts.append((rows, drafts))
            propose_s[method] = time.perf_counter() - tp
        return groups, Drafts.merge(parts, len(seqs), self.target.vocab_size), propose_s

    def _score(self, inputs, slots, want: HiddenRequest, drafts: Drafts):
        """The target's forward over every row's last token and drafts (chains: each row's
        own tokens where the backend packs rows; trees: under their ancestor mask).
        Returns (logits [B, k+1, V], hidden outputs or None, the longest run each row can
        accept)."""
        if drafts.parents is None:
            logits, outs = self._forward(inputs, slots, want, counts=1 + drafts.counts)
            return logits, outs, drafts.counts.tolist()
        mask = ancestor_mask(drafts.parents, drafts.counts)  # [B, k+1, k+1]
        depth = depths(mask)  # [B, k+1]
        logits, outs = self._forward(inputs, slots, want, tree_mask=mask, position_offsets=depth)
        spans = depth.max(1).values.tolist()  # padding sits at depth 1, under the root
        return logits, outs, [min(d, c) for d, c in zip(spans, drafts.counts.tolist(), strict=True)]

    def _roll_back(self, slots, cached, drafts: Drafts, paths, n_accepted: list[int]) -> None:
        """Keep in the target's cache the last token and the accepted drafts (a tree's
        accepted path moved into place), nothing after."""
        n = 1 + torch.tensor(n_accepted)
        if drafts.parents is None:
            self.target.truncate(slots, cached + n)
        else:
            picked = torch.cat([torch.zeros(len(paths), 1, dtype=torch.long), paths], dim=1)
            self.target.keep(slots, cached, picked, n)

    def _feed(self, seqs, groups: dict[str, list[int]], logits, n_accepted: list[int]) -> None:
        """Tell each proposer what became of its drafts (and, where it asks, the target's
        own choices at every position)."""
        argmax = None
        for method, rows in groups.items():
            proposer = self.proposers[method]
            group = [seqs[i] for i in rows]
            if proposer.wants_target_argmax:
                argmax = logits.argmax(-1).cpu() if argmax is None else argmax  # [B, k+1]
                proposer.observe_target(group, argmax[rows])
            proposer.accepted(group, [n_accepted[i] for i in rows])

    def _record(self, seqs, plan, drafts: Drafts, n_accepted, propose_s, spans, times) -> None:
        """The step's figures: each sequence's stats, and what the planner learns from
        (acceptance, the forward's time, the step's overhead outside forward and proposals)."""
        t0, t1, t2, t3 = times
        counts = drafts.counts.tolist()
        self.last_step_ks = counts
        overhead_s = (t3 - t0) - (t2 - t1) - sum(propose_s.values())  # planning, verifying
        packed = drafts.parents is None and self.target.last_packed  # ran without padding
        self.planner.observe(
            seqs, plan, counts, n_accepted, propose_s, t2 - t1, spans, overhead_s, packed
        )
        for i, s in enumerate(seqs):
            s.stats.record_step(counts[i], n_accepted[i])
            s.stats.propose_s += t1 - t0
            s.stats.verify_s += t2 - t1
            s.stats.accept_s += t3 - t2
            s.stats.decode_s = t3 - s.stats.first_token_s

    def _verify(self, seqs, logits, drafts: Drafts) -> tuple[torch.Tensor, list[int], list[int]]:
        """verify.accept_batch on this step's drafts: (paths, n_accepted, next_token)."""
        return accept_batch(
            seqs,
            logits,
            drafts.tokens,
            drafts.counts,
            drafts.probs,
            drafts.parents,
            drafts.stochastic,
        )
