"""Which method and how many draft tokens each running sequence gets this step.

Fixed methods take their configured k (never past what the sequence may still emit).
`auto` decides for the whole batch at once, each step: verifying speculation for one
request is compute not spent on another, so it maximises the batch's goodput

    goodput = sum_i E_i(k_i) / (overhead + verify_s(B, sum_i (k_i + 1))
                                + draft_s(B_draft) * max k_draft + sum_m propose_s(m))

where E_i(k) = 1 + r_1 + r_1 r_2 + ... + r_1 ... r_k is the expected number of tokens
sequence i emits with k drafts, r_j being its running estimate, for that method, of the
chance that draft position j is accepted once positions 1..j-1 were (estimates by draft
position: a copied span that matched four tokens tends to match the fifth, which one
flat rate per request would miss), and the costs come from `CostModel` (profiled on this
machine, then refreshed from measured steps: the forwards, each method's proposal, and the
step's fixed overhead, which a longer draft spreads over more tokens); `_auto` says how the
plan is found. Trained heads (medusa, eagle), when loaded, are options too: a tree of a
fixed size (HEAD_TREE x the request's k) worth E over its depth, r_j being the head's
running acceptance at tree depth j. A sequence whose text repeats gets n-gram or suffix
drafts for next to nothing (no draft forwards); a busy batch, where a verify row costs as
much as it brings, gets k = 0. There is no threshold table, so there is no cliff: k falls
smoothly as rows get dearer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import MAX_K
from ..sequence import Sequence
from .cost_model import CostModel

# acceptance before anything is observed (per draft token; per tree depth for the heads)
PRIOR = {"draft": 0.6, "ngram": 0.5, "suffix": 0.5, "medusa": 0.5, "eagle": 0.6}
# what auto chooses from (draft, medusa, eagle: when loaded)
AUTO_METHODS = ("ngram", "suffix", "draft", "medusa", "eagle")
DRAFT = AUTO_METHODS.index("draft")
HEAD_TREE = 4  # auto's medusa / eagle tree: this many times the request's k nodes (<= 64)
# auto's n-gram / suffix drafts: up to this many times k, and at least FREE_MIN tokens; they
# cost nothing to make, and the goodput choice prices each verified row
FREE_FACTOR, FREE_MIN = 2, 16
EMA = 0.15  # weight of one new draft outcome in a sequence's acceptance estimate
GLOBAL_EMA = 0.02  # the same across requests (the prior of the next request)


@dataclass
class _Estimate:
    """Acceptance by draft position: rates[j] = P(position j accepted | 1..j-1 were),
    j = 1..MAX_K (index 0 unused)."""

    rates: np.ndarray  # [MAX_K + 1]

    @classmethod
    def flat(cls, rate: float) -> _Estimate:
        return cls(np.full(MAX_K + 1, float(rate)))

    def copy(self) -> _Estimate:
        return _Estimate(self.rates.copy())

    def update(self, proposed: int, accepted: int, weight: float = EMA) -> None:
        # Positions 1..accepted are successes; the first rejected one (if any) a failure;
        # the positions after it were not tried.
        r = self.rates
        r[1 : accepted + 1] += weight * (1.0 - r[1 : accepted + 1])
        if accepted < proposed:
            r[accepted + 1] -= weight * r[accepted + 1]

    def gains(self, upto: int) -> np.ndarray:
        """[upto] expected accepted drafts with k = 1..upto drafts (E(k) - 1)."""
        return np.cumsum(np.cumprod(self.rates[1 : upto + 1]))

    @property
    def rate(self) -> float:  # the first position's (for reports)
        return float(self.rates[1])


class Scheduler:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.cost: CostModel | None = None
        self.estimates: dict[tuple[int, str], _Estimate] = {}
        # across requests: the prior of a new request, by method
        self.global_rate = {m: _Estimate.flat(r) for m, r in PRIOR.items()}
        self.k_counts: dict[int, int] = {}  # histogram of chosen k (for metrics)

    # --------------------------------------------------------------- lifecycle
    def ensure_cost_model(self) -> CostModel:
        """Profile the step costs (needs empty caches: call while nothing runs)."""
        if self.cost is None:
            e = self.engine
            e.allocate()
            self.cost = CostModel.profile(e.target, e.draft, e.max_num_seqs)
        return self.cost

    def forget(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            for m in PRIOR:
                self.estimates.pop((s.id, m), None)

    def _estimate(self, seq: Sequence, method: str) -> _Estimate:
        key = (seq.id, method)
        if key not in self.estimates:
            self.estimates[key] = self.global_rate[method].copy()
        return self.estimates[key]

    def observe(self, seqs, plan, counts, n_accepted, propose_s: dict[str, float],
                verify_s: float, spans=None, overhead_s: float = 0.0) -> None:  # fmt: skip
        """counts: draft tokens (tree nodes) verified per row; spans: the longest run each row
        could accept (a tree's depth; a chain's length, the default); propose_s: each
        method's propose time this step; overhead_s: the step's time outside the forwards
        and proposals."""
        spans = counts if spans is None else spans
        rows = len(seqs) + sum(counts)
        draft_rows = [i for i, (m, _) in enumerate(plan) if m == "draft" and counts[i]]
        for i, (method, _) in enumerate(plan):
            if spans[i] and method in PRIOR:
                self._estimate(seqs[i], method).update(spans[i], n_accepted[i])
                self.global_rate[method].update(spans[i], n_accepted[i], GLOBAL_EMA)
            self.k_counts[counts[i]] = self.k_counts.get(counts[i], 0) + 1
        if self.cost is not None:
            steps = max((counts[i] for i in draft_rows), default=0)
            self.cost.observe(len(seqs), rows, verify_s, steps, len(draft_rows),
                              propose_s.get("draft", 0.0))  # fmt: skip
            self.cost.observe_step({m: t for m, t in propose_s.items() if m != "draft"},
                                   overhead_s)  # fmt: skip

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
        return plan  # type: ignore[return-value]

    def _options(self, seq: Sequence) -> list[tuple[str, int, _Estimate, int | None]]:
        """(method, most drafts, acceptance estimate, tree depth) open to an `auto` sequence
        now. Chains may use any k up to the most; a head's tree only its full size (depth:
        the longest run it can accept; None for chains)."""
        limit = max(0, seq.room() - 1)
        k = seq.spec.num_speculative_tokens
        opts = []
        ngram = self.engine.proposers["ngram"]
        free = min(MAX_K, max(FREE_FACTOR * k, FREE_MIN), limit)
        avail = len(ngram.lookup(seq, free))
        est = self._estimate(seq, "ngram")
        if avail:
            opts.append(("ngram", avail, est, None))
        suffix, est_s = self.engine.proposers["suffix"], self._estimate(seq, "suffix")
        # a full-length n-gram draft that is worth at least the best suffix draft could be
        # makes the suffix trie walk pointless this step (it costs about a millisecond)
        dominated = free and avail == free and est.gains(free)[-1] >= est_s.gains(free)[-1]
        avail = 0 if dominated else len(suffix.speculate(seq, free)[0])
        if avail:
            opts.append(("suffix", avail, est_s, None))
        # A seeded sampled request keeps to deterministic drafts: verified by the target's own
        # per-position sample (verify.py), it then emits what plain sampling with its seed
        # emits, whatever auto chose step by step. Draft-model steps would change the tokens.
        seeded = seq.params.seed is not None and not seq.params.greedy
        if "draft" in self.engine.proposers and min(k, limit) > 0 and not seeded:
            opts.append(("draft", min(k, limit), self._estimate(seq, "draft"), None))
        size = min(MAX_K, HEAD_TREE * k, limit)  # heads draft deterministic trees
        for name in ("medusa", "eagle"):
            p = self.engine.proposers.get(name)
            if p is None or size < 1 or not p.ready(seq):
                continue
            depth = p.depth(size) if name == "medusa" else min(seq.spec.speculative_num_steps, size)
            opts.append((name, size, self._estimate(seq, name), depth))
        return opts

    def _eagle_s(self, cost: CostModel, seqs, auto: list[int]) -> float:
        """Cost of one eagle proposal: measured once eagle has run, modelled before that as
        one head step per depth, each about two target layers' worth of a decode step (a
        layer, plus its head and tree upkeep)."""
        if "eagle" not in self.engine.proposers:
            return 0.0
        layers = max(1, int(getattr(self.engine.target.config, "num_hidden_layers", 1)))
        depth = max(seqs[i].spec.speculative_num_steps for i in auto)
        return cost.propose_s("eagle", depth * 2 * cost.verify_s(1, 1) / layers)

    def _auto(self, seqs, plan, auto: list[int]) -> None:
        """Choose (method, k) for the `auto` rows; see the module notes.

        Goodput T / C is a ratio, so it is maximised by Dinkelbach's iteration: with the
        current goodput G, each row independently takes the option that maximises
        gain - G * cost, its cost being its rows in the verify forward (the marginal cost of
        a row at the current plan's size, from the profiled table), its share of the draft
        forwards and of its method's proposal; then the plan's exact goodput is computed and
        the costs re-linearised around it. Every draft depth kd is tried (the draft
        forwards' cost is shared by the rows that draft) and the best plan kept, never worse
        than no drafts. A lone auto row has every option's exact goodput computed at once
        instead. Vectorised over rows, options and k, with the verify cost tabulated by total
        rows once per step: a fraction of a millisecond for one row, about one for 16."""
        cost = self.cost or CostModel()  # profiled at the first idle moment (engine.step)
        n = len(seqs)
        fixed_tokens, fixed_rows, fixed_dk, fixed_dn = float(n), 0, 0, 0
        for i, p in enumerate(plan):
            if p is None or p[1] == 0:
                continue
            fixed_rows += p[1]
            if p[0] in PRIOR:
                fixed_tokens += float(self._estimate(seqs[i], p[0]).gains(p[1])[-1])
            if p[0] == "draft":
                fixed_dk, fixed_dn = max(fixed_dk, p[1]), fixed_dn + 1
        options = [self._options(seqs[i]) for i in auto]
        top = max((lim for opts in options for _, lim, _, _ in opts), default=0)
        methods = AUTO_METHODS
        rows_idx = np.arange(len(auto))
        ks = np.arange(top + 1)  # [K+1]
        gain = np.full((len(auto), len(methods), top + 1), -np.inf)  # [A, method, k]
        gain[:, :, 0] = 0.0
        top_draft = 0  # the deepest draft-model chain any row may take
        for j, opts in enumerate(options):
            for method, lim, est, depth in opts:
                m = methods.index(method)
                if depth is None:  # a chain: any k up to lim
                    gain[j, m, 1 : lim + 1] = est.gains(lim)
                    if m == DRAFT:
                        top_draft = max(top_draft, lim)
                else:  # a head's tree: its whole size, worth its depth
                    gain[j, m, lim] = float(est.gains(depth)[-1])
        # each method's proposal cost (draft model: per draft depth, below), shared by the
        # rows that take it
        propose = np.array([0.0 if m == "draft" else
                            (self._eagle_s(cost, seqs, auto) if m == "eagle" else cost.propose_s(m))
                            for m in methods])  # fmt: skip
        a = len(auto)
        offered = np.isfinite(gain[:, :, 1:]).any(2).sum(0) if top else np.zeros(len(methods))
        share = propose / np.maximum(1, offered)  # [method]
        base_rows = n + fixed_rows
        verify = cost.verify_curve(n, base_rows + a * top + n)  # [R + 1] seconds by total rows
        # one draft forward when j of the auto rows draft beside the fixed ones: [A + 1]
        draft_fwd = np.array([cost.draft_s(fixed_dn + j) for j in range(a + 1)])
        flat = gain.reshape(a, -1)  # [A, method * (K+1)]
        m_of, k_of = np.divmod(np.arange(flat.shape[1]), top + 1)  # [method * (K+1)]

        def exact(choice: np.ndarray) -> float:
            """Modelled goodput of a plan (flat indices method * (K+1) + k per auto row)."""
            m, k = m_of[choice], k_of[choice]
            t = fixed_tokens + flat[rows_idx, choice].sum()
            drafting = (m == DRAFT) & (k > 0)
            n_draft = int(drafting.sum())
            dk = max(fixed_dk, int(k[drafting].max()) if n_draft else 0)
            used = np.zeros(len(methods), dtype=bool)
            used[m[k > 0]] = True
            c = cost.overhead_s + verify[base_rows + int(k.sum())] + dk * draft_fwd[n_draft]
            return t / (c + float(propose[used].sum()))

        if a == 1:  # one auto row: every option's exact goodput at once
            drafting = (m_of == DRAFT) & (k_of > 0)
            dk = np.where(drafting, np.maximum(fixed_dk, k_of), fixed_dk)
            c = (cost.overhead_s + verify[base_rows + k_of]
                 + dk * np.where(drafting, draft_fwd[1], draft_fwd[0])
                 + np.where(k_of > 0, propose[m_of], 0.0))  # fmt: skip
            best_pick = np.array([int(np.argmax((fixed_tokens + flat[0]) / c))])
        else:
            best_pick = np.zeros(a, dtype=np.int64)  # no drafts
            best_g = exact(best_pick)
            depths = [0]
            if top_draft:
                depths += [d for d in range(1, top_draft + 1) if d >= fixed_dk]
            n_can_draft = max(1, int(offered[DRAFT])) if top else 1
            for kd in depths:
                g = gain.copy()
                g[:, DRAFT, kd + 1 :] = -np.inf  # drafts deeper than kd are not made
                goodput, rows, n_draft = best_g, base_rows, n_can_draft
                for _ in range(4):
                    step = max(1, n)  # marginal cost of a row near the current plan's size
                    c_row = (verify[rows + step] - verify[rows]) / step
                    d_row = kd * draft_fwd[min(n_draft, a)] / (fixed_dn + n_draft)
                    row_cost = np.broadcast_to(c_row * ks, g.shape).copy()  # [A, method, K+1]
                    row_cost[:, :, 1:] += share[None, :, None]
                    row_cost[:, DRAFT, 1:] += d_row
                    choice = (g - goodput * row_cost).reshape(a, -1).argmax(1)  # [A]
                    new = exact(choice)
                    if new > best_g:
                        best_g, best_pick = new, choice
                    if new <= goodput * (1 + 1e-6):
                        break
                    m, k = m_of[choice], k_of[choice]
                    goodput, rows = new, base_rows + int(k.sum())
                    n_draft = max(1, int(((m == DRAFT) & (k > 0)).sum()))
        for j, i in enumerate(auto):
            m, k = divmod(int(best_pick[j]), top + 1)
            plan[i] = (methods[m], k) if k > 0 else ("none", 0)
