"""Which method and how many draft tokens each running sequence gets this step.

Fixed methods take their configured k (never past what the sequence may still emit).
`auto` decides for the whole batch at once, each step: verifying speculation for one
request is compute not spent on another, so it maximises the batch's goodput

    goodput = sum_i E_i(k_i) / (verify_s(B, sum_i (k_i + 1)) + draft_s(B_draft) * max k_draft)

where E_i(k) = 1 + a_i + a_i^2 + ... + a_i^k is the expected number of tokens sequence i
emits with k drafts when each draft is accepted with probability a_i (its running
acceptance estimate for that method), and the costs come from `CostModel` (profiled on
this machine, refreshed from measured step times); `_auto` says how the plan is found.
Trained heads (medusa, eagle), when loaded, are options too: a tree of a fixed size
(HEAD_TREE x the request's k) worth 1 + a + .. + a^depth, a being the head's running
acceptance per tree depth; an eagle proposal also costs its head steps. A
sequence whose text repeats gets n-gram or suffix drafts for free (no draft forwards); a busy batch,
where a verify row costs as much as it brings, gets k = 0. There is no threshold table, so
there is no cliff: k falls smoothly as rows get dearer.
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
EAGLE = AUTO_METHODS.index("eagle")
HEAD_TREE = 4  # auto's medusa / eagle tree: this many times the request's k nodes (<= 64)
# auto's n-gram / suffix drafts: up to this many times k, and at least FREE_MIN tokens; they
# cost nothing to make, and the goodput choice prices each verified row
FREE_FACTOR, FREE_MIN = 2, 16
EMA = 0.15  # weight of one new draft outcome in a sequence's acceptance estimate


@dataclass
class _Estimate:
    rate: float

    def update(self, proposed: int, accepted: int) -> None:
        # Each accepted draft is a success; the first rejected one (if any) a failure.
        for _ in range(accepted):
            self.rate += EMA * (1.0 - self.rate)
        if accepted < proposed:
            self.rate += EMA * (0.0 - self.rate)


class Scheduler:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.cost: CostModel | None = None
        self.estimates: dict[tuple[int, str], _Estimate] = {}
        self.global_rate = dict(PRIOR)  # across requests: the prior of a new request
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
            self.estimates[key] = _Estimate(self.global_rate[method])
        return self.estimates[key]

    def observe(self, seqs, plan, counts, n_accepted, draft_s: float, verify_s: float,
                spans=None) -> None:  # fmt: skip
        """counts: draft tokens (tree nodes) verified per row; spans: the longest run each row
        could accept (a tree's depth; a chain's length, the default); draft_s: the draft
        model's propose time this step (not the other proposers', nor the planning)."""
        spans = counts if spans is None else spans
        rows = len(seqs) + sum(counts)
        draft_rows = [i for i, (m, _) in enumerate(plan) if m == "draft" and counts[i]]
        for i, (method, _) in enumerate(plan):
            if spans[i] and method in PRIOR:
                self._estimate(seqs[i], method).update(spans[i], n_accepted[i])
                g = self.global_rate[method]
                self.global_rate[method] = g + 0.02 * (n_accepted[i] / spans[i] - g)
            self.k_counts[counts[i]] = self.k_counts.get(counts[i], 0) + 1
        if self.cost is not None:
            steps = max((counts[i] for i in draft_rows), default=0)
            self.cost.observe(len(seqs), rows, verify_s, steps, len(draft_rows), draft_s)

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

    def _options(self, seq: Sequence) -> list[tuple[str, int, float, int | None]]:
        """(method, most drafts, acceptance estimate, tree depth) open to an `auto` sequence
        now. Chains may use any k up to the most; a head's tree only its full size (depth:
        the longest run it can accept; None for chains)."""
        limit = max(0, seq.room() - 1)
        k = seq.spec.num_speculative_tokens
        opts = []
        ngram = self.engine.proposers["ngram"]
        free = min(MAX_K, max(FREE_FACTOR * k, FREE_MIN), limit)
        avail = len(ngram.lookup(seq, free))
        if avail:
            opts.append(("ngram", avail, self._estimate(seq, "ngram").rate, None))
        suffix = self.engine.proposers["suffix"]
        avail = len(suffix.speculate(seq, free)[0])
        if avail:
            opts.append(("suffix", avail, self._estimate(seq, "suffix").rate, None))
        # A seeded sampled request keeps to deterministic drafts: verified by the target's own
        # per-position sample (verify.py), it then emits what plain sampling with its seed
        # emits, whatever auto chose step by step. Draft-model steps would change the tokens.
        seeded = seq.params.seed is not None and not seq.params.greedy
        if "draft" in self.engine.proposers and min(k, limit) > 0 and not seeded:
            opts.append(("draft", min(k, limit), self._estimate(seq, "draft").rate, None))
        size = min(MAX_K, HEAD_TREE * k, limit)  # heads draft deterministic trees
        for name in ("medusa", "eagle"):
            p = self.engine.proposers.get(name)
            if p is None or size < 1 or not p.ready(seq):
                continue
            depth = p.depth(size) if name == "medusa" else min(seq.spec.speculative_num_steps, size)
            opts.append((name, size, self._estimate(seq, name).rate, depth))
        return opts

    def _eagle_s(self, cost: CostModel, seqs, auto: list[int]) -> float:
        """Modelled cost of one eagle proposal: one head step per depth, each about two
        target layers' worth of a decode step (a layer, plus its head and tree upkeep)."""
        if "eagle" not in self.engine.proposers:
            return 0.0
        layers = max(1, int(getattr(self.engine.target.config, "num_hidden_layers", 1)))
        depth = max(seqs[i].spec.speculative_num_steps for i in auto)
        return depth * 2 * cost.verify_s(1, 1) / layers

    def _auto(self, seqs, plan, auto: list[int]) -> None:
        """Choose (method, k) for the `auto` rows; see the module notes.

        Goodput T / C is a ratio, so it is maximised by Dinkelbach's iteration: with the
        current goodput G, each row independently takes the option that maximises
        gain - G * cost, its cost being its rows in the verify forward (the marginal cost of
        a row at the current plan's size, from the profiled table) and its share of the
        draft forwards; then the plan's exact goodput is computed and the costs
        re-linearised around it. Every draft depth kd is tried (the draft forwards' cost is
        shared by the rows that draft) and the best plan kept, never worse than no drafts.
        Vectorised over rows, options and k: about a millisecond for 16 rows."""
        cost = self.cost or CostModel()  # profiled at the first idle moment (engine.step)
        n = len(seqs)
        fixed_tokens, fixed_rows, fixed_dk, fixed_dn = float(n), 0, 0, 0
        for i, p in enumerate(plan):
            if p is None or p[1] == 0:
                continue
            fixed_rows += p[1]
            if p[0] in PRIOR:
                a = self._estimate(seqs[i], p[0]).rate
                fixed_tokens += sum(a**j for j in range(1, p[1] + 1))
            if p[0] == "draft":
                fixed_dk, fixed_dn = max(fixed_dk, p[1]), fixed_dn + 1
        options = [self._options(seqs[i]) for i in auto]
        top = max((lim for opts in options for _, lim, _, _ in opts), default=0)
        methods = AUTO_METHODS
        rows_idx = np.arange(len(auto))
        ks = np.arange(top + 1)  # [K+1]
        gain = np.full((len(auto), len(methods), top + 1), -np.inf)  # [A, method, k]
        gain[:, :, 0] = 0.0
        for j, opts in enumerate(options):
            for method, lim, a, depth in opts:
                m = methods.index(method)
                if depth is None:  # a chain: any k up to lim
                    gain[j, m, 1 : lim + 1] = np.cumsum(a ** ks[1 : lim + 1])
                else:  # a head's tree: its whole size, worth its depth
                    gain[j, m, lim] = float(np.sum(a ** np.arange(1, depth + 1)))
        can_draft = np.isfinite(gain[:, DRAFT, 1:]).any(1) if top else np.zeros(len(auto), bool)
        eagle_s = self._eagle_s(cost, seqs, auto)
        n_eagle = max(1, int(np.isfinite(gain[:, EAGLE, 1:]).any(1).sum())) if top else 1

        def exact(choice: np.ndarray) -> float:
            """Modelled goodput of a plan (flat indices method * (K+1) + k per auto row)."""
            m, k = np.divmod(choice, top + 1)
            t = fixed_tokens + gain.reshape(len(auto), -1)[rows_idx, choice].sum()
            drafting = (m == DRAFT) & (k > 0)
            dk = max(fixed_dk, int(k[drafting].max()) if drafting.any() else 0)
            c = cost.verify_s(n, n + fixed_rows + int(k.sum()))
            c += dk * cost.draft_s(fixed_dn + int(drafting.sum()))
            c += eagle_s if ((m == EAGLE) & (k > 0)).any() else 0.0
            return t / c

        best_pick = np.zeros(len(auto), dtype=np.int64)  # no drafts
        best_g = exact(best_pick)
        depths = [0]
        if top and "draft" in self.engine.proposers and can_draft.any():
            depths += [d for d in range(1, top + 1) if d >= fixed_dk]
        for kd in depths:
            g = gain.copy()
            g[:, DRAFT, kd + 1 :] = -np.inf  # drafts deeper than kd are not made
            goodput, rows, n_draft = best_g, n + fixed_rows, max(1, int(can_draft.sum()))
            for _ in range(4):
                step = max(1, n)  # marginal cost of a row near the current plan's size
                c_row = (cost.verify_s(n, rows + step) - cost.verify_s(n, rows)) / step
                d_row = kd * cost.draft_s(fixed_dn + n_draft) / (fixed_dn + n_draft)
                row_cost = np.broadcast_to(c_row * ks, g.shape).copy()  # [A, method, K+1]
                row_cost[:, DRAFT, 1:] += d_row
                row_cost[:, EAGLE, 1:] += eagle_s / n_eagle
                choice = (g - goodput * row_cost).reshape(len(auto), -1).argmax(1)  # [A]
                new = exact(choice)
                if new > best_g:
                    best_g, best_pick = new, choice
                if new <= goodput * (1 + 1e-6):
                    break
                m, k = np.divmod(choice, top + 1)
                goodput, rows = new, n + fixed_rows + int(k.sum())
                n_draft = max(1, int(((m == DRAFT) & (k > 0)).sum()))
        for j, i in enumerate(auto):
            m, k = divmod(int(best_pick[j]), top + 1)
            plan[i] = (methods[m], k) if k > 0 else ("none", 0)
