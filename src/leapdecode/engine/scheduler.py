"""Which method and how many draft tokens each running sequence gets this step.

Fixed methods take their configured k (never past what the sequence may still emit).
`auto` decides for the whole batch at once, each step: verifying speculation for one
request is compute not spent on another, so it maximises the batch's goodput

    goodput = sum_i E_i(k_i) / (verify_s(B, sum_i (k_i + 1)) + draft_s(B_draft) * max k_draft)

where E_i(k) = 1 + a_i + a_i^2 + ... + a_i^k is the expected number of tokens sequence i
emits with k drafts when each draft is accepted with probability a_i (its running
acceptance estimate for that method), and the costs come from `CostModel` (profiled on
this machine, refreshed from measured step times). It starts every sequence at k = 0 and
keeps adding the draft (or the jump to a first k under some method) that raises goodput
most, until none does. A sequence whose text repeats gets n-gram drafts for free (no draft
forwards); a busy batch, where a verify row costs as much as it brings, gets k = 0. There
is no threshold table, so there is no cliff: k falls smoothly as rows get dearer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MAX_K
from ..sequence import Sequence
from .cost_model import CostModel

PRIOR = {"draft": 0.6, "ngram": 0.5}  # acceptance before anything is observed
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

    def observe(self, seqs, plan, counts, n_accepted, propose_s: float, verify_s: float) -> None:
        rows = len(seqs) + sum(counts)
        draft_rows = [i for i, (m, _) in enumerate(plan) if m == "draft" and counts[i]]
        for i, (method, _) in enumerate(plan):
            if counts[i] and method in PRIOR:
                self._estimate(seqs[i], method).update(counts[i], n_accepted[i])
                g = self.global_rate[method]
                self.global_rate[method] = g + 0.02 * (n_accepted[i] / counts[i] - g)
            self.k_counts[counts[i]] = self.k_counts.get(counts[i], 0) + 1
        if self.cost is not None:
            steps = max((counts[i] for i in draft_rows), default=0)
            self.cost.observe(len(seqs), rows, verify_s, steps, len(draft_rows), propose_s)

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

    def _options(self, seq: Sequence) -> list[tuple[str, int, float]]:
        """(method, most drafts, acceptance estimate) open to an `auto` sequence now."""
        limit = max(0, seq.room() - 1)
        k = seq.spec.num_speculative_tokens
        opts = []
        ngram = self.engine.proposers["ngram"]
        avail = len(ngram.lookup(seq, min(MAX_K, 2 * k, limit)))
        if avail:
            opts.append(("ngram", avail, self._estimate(seq, "ngram").rate))
        if "draft" in self.engine.proposers and min(k, limit) > 0:
            opts.append(("draft", min(k, limit), self._estimate(seq, "draft").rate))
        return opts

    def _auto(self, seqs, plan, auto: list[int]) -> None:
        cost = self.cost or CostModel()  # profiled at the first idle moment (engine.step)
        n = len(seqs)
        ks = [p[1] if p else 0 for p in plan]
        methods = [p[0] if p else "none" for p in plan]
        rate = [0.0] * n
        tokens = float(n)
        for i, p in enumerate(plan):
            if p is not None and p[1] > 0 and p[0] in PRIOR:
                rate[i] = self._estimate(seqs[i], p[0]).rate
                tokens += sum(rate[i] ** j for j in range(1, p[1] + 1))
        options = {i: self._options(seqs[i]) for i in auto}

        def total_cost(ks_, methods_) -> float:
            rows = n + sum(ks_)
            drafting = [k for k, m in zip(ks_, methods_, strict=True) if m == "draft" and k > 0]
            d = max(drafting, default=0) * cost.draft_s(len(drafting))
            return cost.verify_s(n, rows) + d

        current = tokens / max(1e-9, total_cost(ks, methods))
        while True:
            best = None  # (goodput, row, method, k, rate, tokens)
            for i in auto:
                for method, limit, a in options[i]:
                    if ks[i] > 0 and method != methods[i]:
                        continue
                    # from k = 0, consider every first k (a draft's first forward is the
                    # dear one); afterwards one more draft at a time
                    last = limit if ks[i] == 0 else min(limit, ks[i] + 1)
                    for k in range(ks[i] + 1, last + 1):
                        gain = sum(a**j for j in range(ks[i] + 1, k + 1))
                        trial_k, trial_m = list(ks), list(methods)
                        trial_k[i], trial_m[i] = k, method
                        g = (tokens + gain) / max(1e-9, total_cost(trial_k, trial_m))
                        if best is None or g > best[0]:
                            best = (g, i, method, k, gain)
            if best is None or best[0] <= current * 1.001:
                break
            current, i, method, k, gain = best
            ks[i], methods[i] = k, method
            tokens += gain
        for i in auto:
            plan[i] = (methods[i], ks[i]) if ks[i] > 0 else ("none", 0)
