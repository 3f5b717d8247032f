"""The planner: which method and how many draft tokens each running sequence gets this step.

It is given the proposers (by method name) and the target whose steps it plans, never the
engine, and knows no method by name: it asks each proposer what it can `offer` a sequence
and reads the traits the proposer declares (proposers/base.py) and the registry's.

Fixed methods take their configured k (never past what the sequence may still emit).
`auto` plans the whole batch at once, each step, because verifying one request's drafts is
compute not spent on another: it maximises the batch's goodput, the tokens the step is
expected to emit over what it costs,

    goodput = sum_i E_i(k_i) / (overhead + verify_s(B, R, L) + draft forwards + proposals)

where E_i(k) = 1 + r_1 + r_1 r_2 + ... + r_1 ... r_k, r_j being the running estimate (per
request, method and kind of draft on offer, `Offer.bucket`) that draft position j is accepted
once 1..j-1 were; R is the step's forward rows (each row padded to the longest draft, or,
where the target packs rows, its own), L the context that prices it; the costs come from
`CostModel`. Trained heads (medusa, eagle) are options too: a tree worth E over its depth.
There is no threshold table, so there is no cliff: k falls smoothly as rows get dearer.
The reasoning and the measurements behind each choice: docs/auto_planning.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..config import MAX_K
from ..models.base import CausalLM
from ..proposers import registry
from ..proposers.base import Offer, Proposer
from ..sequence import Sequence
from .cost_model import CostModel

# the prices of a draft token (in emitted tokens) whose plans `_packed` scores
PRICES = np.concatenate([[0.0], np.geomspace(0.02, 1.0, 23)])
EMA = 0.15  # weight of one new draft outcome in a sequence's acceptance estimate
GLOBAL_EMA = 0.02  # the same across requests (the prior of the next request)
# ... whose starting guess (Proposer.prior) counts as this many outcomes: until a position has seen
# about 1 / GLOBAL_EMA outcomes its rate is their running mean, not an EMA that still
# weighs the guess (0.98^49 = 37% after 49 outcomes: deep positions, rarely tried, stayed
# near 0.5 where 0.9 was measured, and auto undervalued long drafts of 2- and 3-gram matches)
GLOBAL_PSEUDO = 4
PSEUDO = 20  # outcomes at a draft position before its own rate outweighs the one before it
# A draft model's catch-up (a prompt, or what other methods accepted; Proposer.unseen) is paid
# once and serves the row's later draft steps, so it is charged over the draft steps the row is expected to take:
# the steps it has left (about two tokens a step) x the share of steps auto has drafted with
# the draft model for rows it had already fed (learnt: on text that n-grams copy, the draft
# is picked on few steps, and a 2000-token prompt fed for two draft steps cost more than it
# brought).
DRAFT_SHARE_PRIOR, DRAFT_SHARE_EMA = 0.5, 0.02


def _context(seqs: list[Sequence], own: bool) -> int:
    """The cached length that prices a step of these rows: their mean where the target reads
    each row's own context (own), else the longest, which every row attends up to."""
    lengths = [len(s.tokens) for s in seqs]
    return round(sum(lengths) / len(lengths)) if own else max(lengths)


@dataclass
class _Estimate:
    """Acceptance by draft position: rates[j] = P(position j accepted | 1..j-1 were),
    j = 1..MAX_K (index 0 unused); seen[j]: outcomes observed at position j."""

    rates: np.ndarray  # [MAX_K + 1]
    seen: np.ndarray | None = None  # [MAX_K + 1]

    def __post_init__(self) -> None:
        if self.seen is None:
            self.seen = np.zeros_like(self.rates)

    @classmethod
    def flat(cls, rate: float) -> _Estimate:
        return cls(np.full(MAX_K + 1, float(rate)))

    def copy(self) -> _Estimate:
        return _Estimate(self.rates.copy(), self.seen.copy())

    def prior(self) -> _Estimate:
        """A new request's estimate from this (cross-request) one: a position seen a few
        times leans on the position before it, so depths nobody has drafted to yet (a
        fixed k = 2 before auto asks for 4) take the deepest evidence, not the flat prior."""
        rates, seen = self.rates.tolist(), self.seen.tolist()  # Python floats: a short loop
        out = rates[:]
        for j in range(2, MAX_K + 1):
            w = seen[j] / (seen[j] + PSEUDO)
            out[j] = w * rates[j] + (1 - w) * out[j - 1]
        return _Estimate(np.array(out))

    def update(
        self, proposed: int, accepted: int, weight: float = EMA, pseudo: float | None = None
    ) -> None:
        """Positions 1..accepted are successes; the first rejected one (if any) a failure;
        the positions after it were not tried. pseudo: the starting rates count as this many
        outcomes, so a position's rate is the running mean of its outcomes (and that many
        pseudo-outcomes) until 1 / (seen + pseudo + 1) falls to `weight`, an EMA after."""
        r = self.rates
        tried = accepted + 1 if accepted < proposed else accepted
        w = np.full(tried + 1, weight)  # [tried + 1] (index 0 unused)
        if pseudo is not None:
            w = np.maximum(w, 1.0 / (self.seen[: tried + 1] + pseudo + 1))
        r[1 : accepted + 1] += w[1 : accepted + 1] * (1.0 - r[1 : accepted + 1])
        if accepted < proposed:
            r[accepted + 1] -= w[accepted + 1] * r[accepted + 1]
        self.seen[1 : tried + 1] += 1

    def gains(self, upto: int) -> np.ndarray:
        """[upto] expected accepted drafts with k = 1..upto drafts (E(k) - 1)."""
        return np.cumsum(np.cumprod(self.rates[1 : upto + 1]))


@dataclass
class _Scoring:
    """What every plan of one step is scored with (`Planner._scoring`): the rows of fixed
    methods' share, each auto row's gains, and the costs on the grids the plans index."""

    n: int  # rows in the step
    top: int  # the most drafts any auto row is offered
    cost: CostModel
    gain: np.ndarray  # [A, method, K+1] expected accepted drafts (see Planner._gains)
    fixed_tokens: float  # the step's expected tokens from every row but auto's drafts
    fixed_k: int  # the longest fixed row's k
    fixed_rows: int  # rows plus the fixed rows' drafts (a packed step's tokens before auto's)
    fixed_dk: int  # the fixed draft-model rows' depth
    fixed_dn: int  # and their number
    fixed_used: set[str]  # the fixed rows' methods
    fixed_propose: float  # their proposals' seconds
    verify: np.ndarray  # [R + 1] the verify forward's seconds by forward rows
    draft_fwd: np.ndarray  # [A + 1] one draft forward's seconds by auto draft rows
    catch: np.ndarray  # [A] each auto row's draft catch-up share
    propose: dict[str, float]  # seconds of one proposal by each method but the draft model's
    kds: np.ndarray  # [D] the draft-model depths scored
    methods: tuple[str, ...]  # the method axis
    draft: int  # the draft model's place on it (-1: none loaded)
    trees: tuple[int, ...]  # the places of methods whose drafts are trees (heads)

    def propose_of(self, m: np.ndarray, k: np.ndarray, axis: int) -> np.ndarray:
        """The proposals' seconds of plans whose rows (along `axis`) take methods m with
        k drafts: each method once if any row drafts with it (the fixed rows' already paid)."""
        out = 0.0
        for name, t in self.propose.items():
            if t and name not in self.fixed_used:
                out = out + t * ((m == self.methods.index(name)) & (k > 0)).any(axis)
        return out


class Planner:
    def __init__(
        self,
        proposers: dict[str, Proposer],
        target: CausalLM,
        profile: Callable[[], CostModel] | None = None,
    ) -> None:
        """proposers: by method name; target: the model whose steps are planned (what prices
        them: whether it packs rows, reads each row's own context; its depth); profile:
        measures the step costs when `auto` first needs them (the caches empty)."""
        self.proposers = proposers
        self.target = target
        # auto's method axis: the loaded methods it may choose, in the registry's order
        self.methods = tuple(m for m in registry.auto_choices() if m in proposers)
        stepped = [m for m in self.methods if proposers[m].costs == "forwards"]
        if len(stepped) > 1:
            raise ValueError(f"auto plans one draft model's forwards, not {stepped}")
        self.stepped = stepped[0] if stepped else None  # the draft model's method
        self.draft = self.methods.index(self.stepped) if stepped else -1
        self.trees = tuple(
            i for i, m in enumerate(self.methods) if registry.get(m).tree == registry.TREE
        )
        self.profile = profile
        self.cost: CostModel | None = None
        # (seq id, method, bucket) -> that request's estimate; see _bucket
        self.estimates: dict[tuple[int, str, int], _Estimate] = {}
        # across requests: the prior of a new request, by (method, bucket)
        self.global_rate: dict[tuple[str, int], _Estimate] = {}
        # seq id -> {method: the bucket of the draft it was offered at its last plan}
        self.buckets: dict[int, dict[str, int]] = {}
        self.catch_up = 0  # tokens the draft model feeds before this step's drafts
        self.draft_share = DRAFT_SHARE_PRIOR  # of fed auto rows' steps, those with draft
        # seq id -> (its length when planned, {free method: (the chain it offered, bucket)})
        self.shadow: dict[int, tuple[int, dict[str, tuple[list[int], int]]]] = {}

    # --------------------------------------------------------------- lifecycle
    def ensure_cost_model(self) -> CostModel:
        """Profile the step costs (needs empty caches: call while nothing runs)."""
        if self.cost is None:
            if self.profile is None:
                raise RuntimeError("this scheduler was made without a way to profile costs")
            self.cost = self.profile()
        return self.cost

    def _context(self, seqs: list[Sequence]) -> int:
        return _context(seqs, self.target.reads_own_context)

    def forget(self, seqs: list[Sequence]) -> None:
        ids = {s.id for s in seqs}
        for i in ids:
            self.shadow.pop(i, None)
            self.buckets.pop(i, None)
        for key in [key for key in self.estimates if key[0] in ids]:
            del self.estimates[key]

    def _global(self, method: str, bucket: int) -> _Estimate:
        key = (method, bucket)
        if key not in self.global_rate:
            self.global_rate[key] = _Estimate.flat(self.proposers[method].prior)
        return self.global_rate[key]

    def _bucket_of(self, seq: Sequence, method: str) -> int:
        """The bucket of the draft `method` was offered at seq's last plan; -1 for the rows
        of fixed methods, which auto does not plan (they keep apart from auto's estimates)."""
        planned = self.buckets.get(seq.id)
        return -1 if planned is None else planned.get(method, 0)

    def _estimate(self, seq: Sequence, method: str, bucket: int | None = None) -> _Estimate:
        """seq's estimate for `method` in `bucket` (default: the one of its last plan)."""
        if bucket is None:
            bucket = self._bucket_of(seq, method)
        key = (seq.id, method, bucket)
        if key not in self.estimates:
            self.estimates[key] = self._global(method, bucket).prior()
        return self.estimates[key]

    def observe(
        self,
        seqs,
        plan,
        counts,
        n_accepted,
        propose_s: dict[str, float],
        verify_s: float,
        spans=None,
        overhead_s: float = 0.0,
        packed: bool = False,
    ) -> None:
        """counts: draft tokens (tree nodes) verified per row; spans: the longest run each row
        could accept (a tree's depth; a chain's length, the default); propose_s: each
        method's propose time this step; overhead_s: the step's time outside the forwards
        and proposals."""
        spans = counts if spans is None else spans
        # the forward's rows: drafts padded to the longest, or each row's own (packed)
        rows = len(seqs) + sum(counts) if packed else len(seqs) * (1 + max(counts, default=0))
        draft_rows = [i for i, (m, _) in enumerate(plan) if m == self.stepped and counts[i]]
        for i, (method, _) in enumerate(plan):
            if spans[i] and self._learns(method):
                bucket = self._bucket_of(seqs[i], method)
                self._estimate(seqs[i], method, bucket).update(spans[i], n_accepted[i])
                self._global(method, bucket).update(
                    spans[i], n_accepted[i], GLOBAL_EMA, GLOBAL_PSEUDO
                )
            self._shadow_outcomes(seqs[i], method if spans[i] else None)
        if self.cost is not None:
            steps = max((counts[i] for i in draft_rows), default=0)
            self.cost.observe(
                len(seqs),
                rows,
                verify_s,
                steps,
                len(draft_rows),
                propose_s.get(self.stepped, 0.0),
                self.catch_up,
                context=self._context(seqs),
            )
            others = {m: t for m, t in propose_s.items() if m != self.stepped}
            self.cost.observe_step(others, overhead_s)

    def _learns(self, method: str) -> bool:
        """Whether `method`'s acceptance is learnt (those auto can plan)."""
        p = self.proposers.get(method)
        return p is not None and p.prior is not None

    def _shadow_outcomes(self, seq: Sequence, verified: str | None) -> None:
        """Score the chains the free methods offered `seq` and did not draft this step
        against the tokens it emitted (the target's own, greedy or sampled: a deterministic
        draft token is accepted exactly when it equals them). Without this, a few misses
        could drive a request's estimate so low that auto stopped drafting with the method,
        and a method never tried again was never found to match again."""
        planned = self.shadow.pop(seq.id, None)
        if planned is None:
            return
        length, chains = planned
        emitted = seq.tokens[length:]
        for method, (chain, bucket) in chains.items():
            if method == verified or not chain or not emitted:
                continue
            n = min(len(chain), len(emitted))  # positions the emitted tokens decide
            hits = next((j for j in range(n) if chain[j] != emitted[j]), n)
            self._estimate(seq, method, bucket).update(n, hits)
            self._global(method, bucket).update(n, hits, GLOBAL_EMA, GLOBAL_PSEUDO)

    # -------------------------------------------------------------------- plan
    def plan(self, seqs: list[Sequence]) -> list[tuple[str, int]]:
        """(method, k) for every running sequence this step."""
        plan: list[tuple[str, int] | None] = []
        batch = len(seqs)
        for s in seqs:
            limit = max(0, s.room() - 1)  # its bonus token counts too
            m = s.spec.method
            plan.append(None if m == "auto" else (m, min(s.spec.k_at(batch), limit)))
        auto = [i for i, p in enumerate(plan) if p is None]
        if auto:
            self._auto(seqs, plan, auto)
            self._learn_draft_share([seqs[i] for i in auto], [plan[i] for i in auto])
        self.catch_up = sum(
            self._unseen(s)
            for s, p in zip(seqs, plan, strict=True)
            if p[0] == self.stepped and p[1] > 0
        )
        return plan  # type: ignore[return-value]

    def _learn_draft_share(self, seqs: list[Sequence], plan) -> None:
        """Fold this step's choices for rows the draft model has fed into `draft_share` (a
        share learnt low still lets short prompts in, whose catch-up is cheap: if the draft
        then wins their steps, the share rises again)."""
        if self.stepped is None:
            return
        draft = self.proposers[self.stepped]
        fed = [  # rows whose prompt it has fed
            p[0] == self.stepped and p[1] > 0
            for s, p in zip(seqs, plan, strict=True)
            if s.spec.may_use(self.stepped) and s.room() > 1 and draft.started(s)
        ]
        for used in fed:
            self.draft_share += DRAFT_SHARE_EMA * (float(used) - self.draft_share)

    def _catch_share(self, cost: CostModel, seq: Sequence) -> float:
        """seq's draft catch-up, charged over the draft steps it is expected to take (its
        steps left, about two tokens a step, x draft_share)."""
        steps = seq.room() / 2 * self.draft_share
        return float(cost.catch_up_s(self._unseen(seq))) / max(1.0, steps)

    def _unseen(self, seq: Sequence) -> int:
        """Tokens of `seq` the draft model has not fed yet (it feeds a prompt lazily, and
        what other methods accepted when it drafts next)."""
        return 0 if self.stepped is None else self.proposers[self.stepped].unseen(seq)

    def _options(self, seq: Sequence) -> list[tuple[str, int, _Estimate, int | None]]:
        """(method, most drafts, acceptance estimate, tree depth) open to an `auto` sequence
        now, from each allowed proposer's `offer`. Chains may use any k up to the most; a
        tree only its full size (depth: the longest run it can accept; None for chains)."""
        limit = max(0, seq.room() - 1)  # its bonus token counts too
        k = seq.spec.num_speculative_tokens
        # A seeded sampled request keeps to deterministic drafts: verified by the target's own
        # per-position sample (verify.py), it then emits what plain sampling with its seed
        # emits, whatever auto chose step by step. Sampled drafts would change the tokens.
        seeded = seq.params.seed is not None and not seq.params.greedy
        offers: dict[str, Offer] = {}
        for name in self.methods:
            p = self.proposers[name]
            if name not in seq.spec.auto_methods or (p.stochastic and seeded):
                continue
            a, b = p.sizing
            budget = min(MAX_K, max(a * k, b), limit)
            if budget < 1 or (p.walks and self._dominated(seq, p, budget, offers)):
                continue
            got = p.offer(seq, budget)
            if got is not None and got.most > 0:
                offers[name] = got
        # a draft model's estimate is kept apart by whether a free chain was on offer too:
        # where n-grams copy the text, the draft model tends to copy it too
        free = any(o.depth is None and self.proposers[m].free for m, o in offers.items())
        if self.stepped in offers:
            offers[self.stepped].bucket = int(free)
        self.buckets[seq.id] = {m: o.bucket for m, o in offers.items()}
        # the free chains not drafted are scored after the step (_shadow_outcomes)
        chains = {m: (o.chain, o.bucket) for m, o in offers.items() if o.chain}
        self.shadow[seq.id] = (len(seq.tokens), chains)
        return [(m, o.most, self._estimate(seq, m, o.bucket), o.depth) for m, o in offers.items()]

    def _dominated(self, seq: Sequence, p: Proposer, budget: int, offers) -> bool:
        """Whether a free chain already offered in full is worth at least the best `p` could
        offer (then its offer, a trie walk of about a millisecond, is pointless this step)."""
        best = self._estimate(seq, p.name, p.bucket_at(budget)).gains(budget)[-1]
        return any(
            o.depth is None
            and o.most == budget
            and self.proposers[m].free
            and self._estimate(seq, m, o.bucket).gains(budget)[-1] >= best
            for m, o in offers.items()
        )

    def _propose_s(self, cost: CostModel, name: str, seqs: list[Sequence]) -> float:
        """One proposal's seconds for `name` over the `auto` rows seqs: measured once it has
        run, before that its own guess (Proposer.guess_layers) in the target's layers."""
        rows = [s for s in seqs if name in s.spec.auto_methods]
        if not rows:
            return 0.0
        layers = max(1, int(getattr(self.target.config, "num_hidden_layers", 1)))
        guess = self.proposers[name].guess_layers(rows)
        return cost.propose_s(name, guess * cost.verify_s(1, 1) / layers if guess else 0.0)

    def _auto_alone(self, seq: Sequence, opts, cost: CostModel) -> tuple[str, int]:
        """`_auto` for a batch of one `auto` row (C = 1): each (method, k) on offer scored
        with the same goodput, one by one in plain Python. For one row the vectorised
        search's numpy calls cost more than the few dozen plans they score (docs/auto_planning.md
        has the figures)."""
        goodput = self._alone_goodput(seq, opts, cost)
        best, plan = goodput("none", 0, 0.0), ("none", 0)
        for method, lim, est, depth in opts:
            if depth is None:  # a chain: any k up to lim
                offered = enumerate(est.gains(lim).tolist(), start=1)
            else:  # a head's tree: its whole size, worth its depth
                offered = [(lim, float(est.gains(depth)[-1]))]
            for k, gain in offered:
                if gain > 0:
                    g = goodput(method, k, gain)
                    if g > best:
                        best, plan = g, (method, k)
        return plan

    def _alone_goodput(self, seq: Sequence, opts, cost: CostModel):
        """goodput(method, k, expected accepted drafts) of a step with `seq` alone: the
        terms of `_auto`'s cost for a batch of one."""
        top = max((lim for _, lim, _, _ in opts), default=0)
        verify = cost.verify_curve(1, 1 + top, len(seq.tokens)).tolist()  # [top + 2]
        fixed = cost.overhead_s
        extra = {}  # method -> (seconds once, seconds per draft token)
        for method, *_ in opts:
            if method == self.stepped:
                extra[method] = (self._catch_share(cost, seq), cost.draft_s(1))
            else:
                extra[method] = (self._propose_s(cost, method, [seq]), 0.0)

        def goodput(method: str, k: int, gain: float) -> float:
            if k == 0:
                return 1.0 / (fixed + verify[1])
            once, per_draft = extra[method]
            return (1.0 + gain) / (fixed + verify[1 + k] + once + per_draft * k)

        return goodput

    def _auto(self, seqs, plan, auto: list[int], alone: bool = True) -> None:
        """Choose (method, k) for the `auto` rows: every plan of a family is scored exactly
        by the goodput (module notes) and the best kept. Two families: under a cap c on
        every row's k (`_capped`; the verify forward pads rows to the longest draft, so a
        row's drafts up to c are free in it), and, where the target packs rows, each row's
        drafts priced one by one (`_packed`)."""
        cost = self.cost or CostModel()  # profiled at the first idle moment (engine.step)
        if alone and len(seqs) == 1 and auto == [0]:  # one request alone: see _auto_alone
            plan[0] = self._auto_alone(seqs[0], self._options(seqs[0]), cost)
            return
        sc = self._scoring(seqs, plan, auto, cost)
        best_g, best_plan = self._capped(sc)
        chains_only = all(registry.get(m).tree != registry.TREE for m in sc.fixed_used) and not any(
            s.spec.use_tree_spec for s in seqs
        )
        if self.target.packs_rows and len(seqs) > 1 and chains_only and sc.top:
            packed = self._packed(sc, self.target.packs_rows - 1)
            if packed[0] > best_g:
                best_g, best_plan = packed
        m, k = best_plan
        for j, i in enumerate(auto):
            plan[i] = (self.methods[int(m[j])], int(k[j])) if k[j] > 0 else ("none", 0)

    def _fixed(self, seqs, plan) -> dict:
        """What the rows of fixed methods bring to every plan: their expected tokens (a head's
        tree worth its depth, a chain its length), longest k, real tokens, draft-model depth
        and rows, and the methods they use."""
        out = dict(
            fixed_tokens=float(len(seqs)),
            fixed_k=0,
            fixed_rows=len(seqs),
            fixed_dk=0,
            fixed_dn=0,
            fixed_used=set(),
        )
        for i, p in enumerate(plan):
            if p is None or p[1] == 0:
                continue
            method, k = p
            out["fixed_k"] = max(out["fixed_k"], k)
            out["fixed_rows"] += k  # the step's real tokens, where the target packs rows
            out["fixed_used"].add(method)
            if self._learns(method):
                span = self.proposers[method].span(seqs[i], k)
                out["fixed_tokens"] += float(self._estimate(seqs[i], method).gains(span)[-1])
            if method == self.stepped:
                out["fixed_dk"], out["fixed_dn"] = max(out["fixed_dk"], k), out["fixed_dn"] + 1
        return out

    def _gains(self, options, top: int) -> tuple[np.ndarray, int]:
        """[A, method, K+1] each auto row's expected accepted drafts by method and k (-inf
        where not on offer; a head's tree only at its whole size), and the deepest draft-model
        chain any row may take."""
        n_m = len(self.methods)
        ks = np.arange(top + 1)
        gain = np.full((len(options), n_m, top + 1), -np.inf)
        gain[:, :, 0] = 0.0
        top_draft, chains = 0, []  # chains: (row, method, most drafts, rates)
        for j, opts in enumerate(options):
            for method, lim, est, depth in opts:
                m = self.methods.index(method)
                if depth is None:  # a chain: any k up to lim
                    chains.append((j, m, lim, est.rates[1 : top + 1]))
                    if m == self.draft:
                        top_draft = max(top_draft, lim)
                else:  # a head's tree: its whole size, worth its depth
                    gain[j, m, lim] = float(est.gains(depth)[-1])
        if chains and top:  # every chain's E(k) - 1 for k = 1..top at once (_Estimate.gains)
            rows, ms, lims, rates = zip(*chains, strict=True)
            g = np.cumsum(np.cumprod(np.stack(rates), axis=1), axis=1)  # [chains, K]
            g[ks[1:][None, :] > np.array(lims)[:, None]] = -np.inf  # past each one's most
            gain[np.array(rows), np.array(ms), 1:] = g
        return gain, top_draft

    def _scoring(self, seqs, plan, auto: list[int], cost: CostModel) -> _Scoring:
        """Everything every plan of this step is scored with."""
        fixed = self._fixed(seqs, plan)
        options = [self._options(seqs[i]) for i in auto]
        top = max((lim for opts in options for _, lim, _, _ in opts), default=0)
        gain, top_draft = self._gains(options, top)
        rows = [seqs[i] for i in auto]
        propose = {m: self._propose_s(cost, m, rows) for m in self.methods if m != self.stepped}
        n, a = len(seqs), len(auto)
        # a row's draft catch-up is paid once and then serves the row's later draft steps:
        # spread over those it is expected to take (DRAFT_SHARE_PRIOR above)
        catch = np.zeros(a)  # [A]
        if top_draft:
            catch = np.array([self._catch_share(cost, seqs[i]) for i in auto])
        # beside fixed draft rows the draft forwards run anyway: any depth up to theirs is free;
        # every draft-model depth kd is scored at once, on a leading axis [D]
        lo = max(1, min(fixed["fixed_dk"], top_draft))
        return _Scoring(
            n=n,
            top=top,
            cost=cost,
            gain=gain,
            **fixed,
            fixed_propose=sum(propose.get(m, 0.0) for m in fixed["fixed_used"]),
            verify=cost.verify_curve(n, n * (1 + max(top, fixed["fixed_k"])), self._context(seqs)),
            draft_fwd=cost.draft_curve(fixed["fixed_dn"], fixed["fixed_dn"] + a),  # [A + 1]
            catch=catch,
            propose=propose,
            kds=np.array([0] + list(range(lo, top_draft + 1))),
            methods=self.methods,
            draft=self.draft,
            trees=self.trees,
        )

    @staticmethod
    def _capped(sc: _Scoring) -> tuple[float, tuple[np.ndarray, np.ndarray]]:
        """The best plan under a cap c on every row's k (the verify forward is one
        [B, 1 + max_i k_i] block: each row's most valuable option with k <= c), every cap,
        draft-model depth kd <= c and subset of the offered heads (whose proposals cost real
        time once any row takes them) scored at once; returns (goodput, (m, k))."""
        gain, n, cost = sc.gain, sc.n, sc.cost
        a, n_m, top1 = gain.shape
        ks = np.arange(top1)  # [C] the caps
        # under cap c: the best gain with k <= c, and the smallest k that reaches it
        best = np.maximum.accumulate(gain, axis=2)  # [A, method, C]
        prev = np.concatenate([np.full((a, n_m, 1), -np.inf), best[:, :, :-1]], axis=2)
        k_at = np.maximum.accumulate(np.where(gain > prev, ks, 0), axis=2)  # [A, method, C]
        d_cap = np.minimum(ks[None, :], sc.kds[:, None])  # [D, C] the draft drafts at most kd
        base = np.broadcast_to(best, (len(sc.kds),) + best.shape).copy()  # [D, A, method, C]
        base_k = np.broadcast_to(k_at, base.shape).copy()
        dm = sc.draft
        if dm >= 0:
            base[:, :, dm] = best[:, dm][:, d_cap].transpose(1, 0, 2)  # [D, A, C]
            base[sc.kds == 0, :, dm] = -np.inf
            base_k[:, :, dm] = k_at[:, dm][:, d_cap].transpose(1, 0, 2)
        best_g, best_plan = -1.0, (np.zeros(a, dtype=np.int64), np.zeros(a, dtype=np.int64))
        offered = [h for h in sc.trees if sc.top and np.isfinite(gain[:, h, 1:]).any()]
        for mask in range(1 << len(offered)):
            value = base
            if offered:
                value = base.copy()
                for b, h in enumerate(offered):
                    if not mask >> b & 1:
                        value[:, :, h, 1:] = -np.inf
            m = value.argmax(2)  # [D, A, C] each row's method under each (kd, cap)
            g = value.max(2)  # [D, A, C] (at m)
            k = np.take_along_axis(base_k, m[:, :, None], 2)[:, :, 0]  # [D, A, C]
            k = np.where(np.isfinite(g) & (g > 0), k, 0)
            g = np.where(k > 0, g, 0.0)
            longest = np.maximum(sc.fixed_k, k.max(1))  # [D, C]
            drafting = (m == dm) & (k > 0)  # [D, A, C]
            dk = np.maximum(sc.fixed_dk, np.where(drafting, k, 0).max(1))  # [D, C]
            c = (
                cost.overhead_s
                + sc.fixed_propose
                + sc.verify[n * (1 + longest)]
                + dk * sc.draft_fwd[drafting.sum(1)]
                + np.einsum("dac,a->dc", drafting, sc.catch)
            )
            c = c + sc.propose_of(m, k, axis=1)
            goodput = (sc.fixed_tokens + g.sum(1)) / c  # [D, C]
            di, ci = np.unravel_index(int(goodput.argmax()), goodput.shape)
            if goodput[di, ci] > best_g:
                best_g, best_plan = float(goodput[di, ci]), (m[di, :, ci], k[di, :, ci])
        return best_g, best_plan

    @staticmethod
    def _packed(sc: _Scoring, most: int) -> tuple[float, tuple[np.ndarray, np.ndarray]]:
        """The best chains-only plan where the target packs rows (`CausalLM.packs_rows`): the
        verify forward then costs the step's real tokens, n + sum_i k_i, not the longest
        row's count n times, so a row's drafts are priced one by one. For a price p (of a
        draft token, in emitted tokens) each row takes the option maximising E(k) - 1 - p k:
        its first k positions whose chance of being reached and accepted beats p (a chain's
        r_1 ... r_j falls with j). Every price on a grid from 0 to 1 (and every draft-model
        depth, as in the caps' search) is scored exactly; a row drafts at most `most` tokens
        (the longest row the target packs); returns (goodput, (m, k))."""
        kds = sc.kds
        chain = sc.gain.copy()  # [A, method, K+1]; heads' trees are not chains
        chain[:, list(sc.trees), 1:] = -np.inf
        with np.errstate(invalid="ignore"):  # -inf - -inf past a row's most
            marg = np.diff(chain, axis=2)  # [A, method, K] what each next draft adds
        marg = np.where(np.isfinite(marg), marg, -np.inf)
        marg[:, :, most:] = -np.inf
        k = (marg[None] > PRICES[:, None, None, None]).sum(-1)  # [P, A, method] its first k
        ks = np.broadcast_to(k[None], (len(kds),) + k.shape).copy()  # [D, P, A, method]
        dm = sc.draft
        if dm >= 0:
            ks[:, :, :, dm] = np.minimum(k[None, :, :, dm], kds[:, None, None])
        g = np.take_along_axis(
            np.broadcast_to(chain, ks.shape[:2] + chain.shape), ks[..., None], -1
        )[..., 0]  # [D, P, A, method]
        if dm >= 0:
            g[kds == 0, :, :, dm] = -np.inf
        m = (g - PRICES[None, :, None, None] * ks).argmax(-1)  # [D, P, A] each row's method
        g = np.take_along_axis(g, m[..., None], -1)[..., 0]  # [D, P, A]
        k = np.take_along_axis(ks, m[..., None], -1)[..., 0]
        k = np.where(np.isfinite(g) & (g > 0), k, 0)
        g = np.where(k > 0, g, 0.0)
        drafting = (m == dm) & (k > 0)  # [D, P, A]
        dk = np.maximum(sc.fixed_dk, np.where(drafting, k, 0).max(-1))  # [D, P]
        c = (
            sc.cost.overhead_s
            + sc.fixed_propose
            + sc.verify[sc.fixed_rows + k.sum(-1)]
            + dk * sc.draft_fwd[drafting.sum(-1)]
            + (drafting * sc.catch).sum(-1)
        )
        c = c + sc.propose_of(m, k, axis=-1)
        goodput = (sc.fixed_tokens + g.sum(-1)) / c  # [D, P]
        di, pi = np.unravel_index(int(goodput.argmax()), goodput.shape)
        return float(goodput[di, pi]), (m[di, pi], k[di, pi])
