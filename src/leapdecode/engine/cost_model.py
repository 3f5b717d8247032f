"""What a step costs on this machine: the target's verify forward and a draft forward.

Profiled once (when `auto` is first needed, or at server start) on a grid of batch sizes B,
new tokens a row T and cached prefixes L, the table kept and interpolated, because a small
model's forward is flat in T while per-operator overhead dominates and linear once arithmetic
does, so no single line fits it:

    verify_s(B, R, L) = table(B, R / B, L)  (R = the step's forward rows)
    draft_s(B)        = table_d(B)          (one draft forward of B one-token rows)
    catch_up_s(n)     = n * per-token cost  (the draft feeding n tokens it has not seen)

and kept honest afterwards from every measured step (served forwards do not keep the
profile's level or shape): a correction factor per batch size and a relative one per (B, T)
cell, and moving averages of each method's proposal cost and of the step's fixed overhead.
Why each of these, with the measurements: docs/auto_planning.md.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..models.base import CausalLM

BATCHES = (1, 2, 4, 8, 16, 32, 64)
NEW_TOKENS = (1, 2, 4, 8, 16)
CONTEXTS = (256, 768)  # cached prefixes profiled (clamped to each model's context)
SHAPE_RATE = 0.1  # how fast a (B, T) cell of the shape correction follows its steps


def _fill(model: CausalLM, batch: int, cached: int) -> None:
    """Give slots 0..batch-1 a prefix of `cached` tokens."""
    slots = torch.arange(batch)
    model.truncate(slots, torch.zeros(batch, dtype=torch.long))
    model.forward(torch.randint(0, model.vocab_size, (batch, cached)), slots)


def _time_forward(model: CausalLM, batch: int, new: int, cached: int, reps: int) -> float:
    """Fastest of `reps` forwards (the least disturbed by anything else on the machine)."""
    slots = torch.arange(batch)
    best = float("inf")
    for _ in range(reps):
        model.truncate(slots, torch.full((batch,), cached, dtype=torch.long))
        tokens = torch.randint(0, model.vocab_size, (batch, new))
        t0 = time.perf_counter()
        model.forward(tokens, slots)
        best = min(best, time.perf_counter() - t0)
    return best


class CostModel:
    def __init__(
        self, batches=(1,), news=(1, 2), verify=((1.0, 2.0),), draft=(0.5,), contexts=(256,)
    ) -> None:
        """verify[c][i][j]: seconds for batches[i] sequences x news[j] tokens over cached
        prefixes of contexts[c] tokens (a 2-d table: one context); draft[i]: one draft
        forward of batches[i] sequences. The default is a made-up placeholder."""
        self.batches = np.asarray(batches, dtype=float)
        self.news = np.asarray(news, dtype=float)
        self.contexts = np.asarray(contexts, dtype=float)
        verify = np.asarray(verify, dtype=float)
        if verify.ndim == 2:
            verify = verify[None]
        if verify.shape != (len(self.contexts), len(self.batches), len(self.news)):
            raise ValueError(
                f"verify table {verify.shape} does not match the grid "
                f"{len(contexts)} x {len(batches)} x {len(news)}"
            )
        self.verify = verify  # [len(contexts), len(batches), len(news)]
        self._by_batch: dict[int, list[np.ndarray]] = {}  # batch -> its rows of the table
        self.draft = np.asarray(draft, dtype=float)  # [len(batches)]
        self.verify_scale = 1.0  # measured / table over all steps (the factor of unserved sizes)
        self.batch_scale = np.ones(len(self.batches))  # [len(batches)] the same by batch size
        self.batch_seen = np.zeros(len(self.batches))  # [len(batches)] steps (weighted) behind it
        # [len(batches), len(news)] what is left over, relative to the batch size's factor
        self.verify_shape = np.ones((len(self.batches), len(self.news)))
        self.draft_scale = 1.0
        self.draft_token_s = 0.0  # the draft's prefill cost per token (catching up)
        self.propose: dict[str, float] = {}  # method -> seconds of one proposal (measured)
        self.overhead_s = 0.0  # seconds of a step outside its forwards and proposals

    @classmethod
    def profile(
        cls,
        target: CausalLM,
        draft: CausalLM | None,
        max_batch: int,
        cached: int = 256,
        reps: int = 3,
    ) -> CostModel:
        """Measure on the engine's own (allocated, empty) caches; leaves them empty."""
        batches = sorted({b for b in BATCHES if b <= max_batch} | {max_batch})
        for m in (target, draft) if draft is not None else (target,):
            cached = max(1, min(cached, m.max_context // 2 - max(NEW_TOKENS)))
        # the target also over a long prefix, where its context allows one
        longest = target.max_context - max(NEW_TOKENS) - 1
        contexts = [cached] + [c for c in CONTEXTS[1:] if cached < min(c, longest)]
        contexts = sorted({min(c, longest) for c in contexts})
        table = np.zeros((len(contexts), len(batches), len(NEW_TOKENS)))
        for c, length in enumerate(contexts):
            for i, b in enumerate(batches):
                _fill(target, b, length)
                for j, t in enumerate(NEW_TOKENS):
                    table[c, i, j] = _time_forward(target, b, t, length, reps)
        d = np.zeros(len(batches))
        token_s = 0.0
        if draft is not None:
            _fill(draft, 1, 1)
            slot = torch.arange(1)
            for _ in range(reps):
                draft.truncate(slot, torch.zeros(1, dtype=torch.long))
                t0 = time.perf_counter()
                _fill(draft, 1, cached)
                token_s = min(token_s or float("inf"), (time.perf_counter() - t0) / cached)
            for i, b in enumerate(batches):
                _fill(draft, b, cached)
                d[i] = _time_forward(draft, b, 1, cached, reps)
            draft.truncate(torch.arange(max_batch), torch.zeros(max_batch, dtype=torch.long))
        target.truncate(torch.arange(max_batch), torch.zeros(max_batch, dtype=torch.long))
        # a forward never gets cheaper with more rows or a longer prefix: smooth out noise
        for axis in (2, 1, 0):
            table = np.maximum.accumulate(table, axis=axis)
        out = cls(batches, NEW_TOKENS, table, np.maximum.accumulate(d), contexts)
        out.draft_token_s = token_s
        return out

    @staticmethod
    def _weights(grid: np.ndarray, x: float) -> list[tuple[int, float]]:
        """(grid index, weight) pairs that interpolate linearly at x, clamped at the ends."""
        if x <= grid[0]:
            return [(0, 1.0)]
        if x >= grid[-1]:
            return [(len(grid) - 1, 1.0)]
        i = int(np.searchsorted(grid, x, side="right")) - 1
        w = float((x - grid[i]) / (grid[i + 1] - grid[i]))
        return [(i, 1.0 - w), (i + 1, w)]

    def _level(self, batch: int) -> float:
        """The learnt measured / table factor at `batch` sequences."""
        scales = np.where(self.batch_seen > 0, self.batch_scale, self.verify_scale)
        return float(sum(w * scales[i] for i, w in self._weights(self.batches, batch)))

    def _shape_by_new(self, batch: int) -> np.ndarray:
        """[len(news)] the learnt shape correction at `batch` sequences."""
        return sum(w * self.verify_shape[i] for i, w in self._weights(self.batches, batch))

    def _interp_batch(self, values: np.ndarray, batch: float) -> np.ndarray | float:
        """Linear in the batch size between grid points, extrapolated linearly past the last."""
        b = self.batches
        if len(b) == 1:
            return values[0] * batch / b[0]
        if batch >= b[-1]:
            slope = (values[-1] - values[-2]) / (b[-1] - b[-2])
            return values[-1] + slope * (batch - b[-1])
        i = int(np.searchsorted(b, batch, side="right")) - 1
        i = max(0, min(i, len(b) - 2))
        w = (batch - b[i]) / (b[i + 1] - b[i])
        return values[i] * (1 - w) + values[i + 1] * w

    def _by_new(self, batch: int, context: float | None) -> np.ndarray:
        """[len(news)] seconds of `batch` sequences x each grid T over `context` cached
        tokens (None: the shortest profiled), linear in the context between the profiled
        ones, extrapolated linearly past the longest, the shortest's below it."""
        tables = self._by_batch.get(batch)  # the profiled table never changes: kept per B
        if tables is None:
            tables = [self._interp_batch(t, batch) for t in self.verify]  # [len(contexts)] x [T]
            for t in tables:
                t.flags.writeable = False  # shared by every later call
            self._by_batch[batch] = tables
        c = self.contexts
        if context is None or len(c) == 1 or context <= c[0]:
            return tables[0]
        i = min(int(np.searchsorted(c, context)) - 1, len(c) - 2)
        w = (context - c[i]) / (c[i + 1] - c[i])
        return tables[i] * (1 - w) + tables[i + 1] * w

    def _table_at(self, batch: int, per_seq: np.ndarray, context: float | None) -> np.ndarray:
        """The profiled table at `batch` sequences and each per_seq new tokens over `context`,
        uncorrected: linear in per_seq between the grid's T, and past the last."""
        by_new = self._by_new(batch, context)  # [len(news)]
        n = self.news
        slope = (by_new[-1] - by_new[-2]) / (n[-1] - n[-2])
        inside = np.interp(per_seq, n, by_new)
        return np.where(per_seq >= n[-1], by_new[-1] + slope * (per_seq - n[-1]), inside)

    def _table_s(self, batch: int, per_seq: float, context: float | None) -> float:
        return float(self._table_at(batch, np.asarray(per_seq, dtype=float), context))

    def _verify_at(self, batch: int, rows: np.ndarray, context: float | None) -> np.ndarray:
        """verify_s at each of `rows` (new tokens in all): the table, corrected by the learnt
        level of this batch size and the shape left over."""
        per_seq = np.maximum(1.0, rows / max(1, batch))
        shape = np.interp(per_seq, self.news, self._shape_by_new(batch))  # clamped
        return self._level(batch) * shape * self._table_at(batch, per_seq, context)

    def verify_s(self, batch: int, rows: float, context: float | None = None) -> float:
        """One verify forward: `batch` sequences, `rows` new tokens in all, over cached
        prefixes of up to `context` tokens."""
        return float(self._verify_at(batch, np.asarray(rows, dtype=float), context))

    def verify_curve(self, batch: int, max_rows: int, context: float | None = None) -> np.ndarray:
        """[max_rows + 1] verify_s(batch, R, context) for R = 0 .. max_rows, in one pass."""
        return self._verify_at(batch, np.arange(max_rows + 1, dtype=float), context)

    def catch_up_s(self, tokens: int | np.ndarray) -> float | np.ndarray:
        """The draft model feeding `tokens` tokens it has not seen yet."""
        return self.draft_scale * self.draft_token_s * tokens

    def draft_s(self, batch: int) -> float:
        return float(self.draft_curve(batch, batch)[0])

    def draft_curve(self, lo: int, hi: int) -> np.ndarray:
        """[hi - lo + 1] draft_s(B) for B = lo .. hi, in one pass."""
        x = np.arange(lo, hi + 1, dtype=float)
        b, d = self.batches, self.draft
        if len(b) == 1:
            out = d[0] * x / b[0]
        else:  # _interp_batch's arithmetic, element by element
            i = np.clip(np.searchsorted(b, x, side="right") - 1, 0, len(b) - 2)
            w = (x - b[i]) / (b[i + 1] - b[i])
            slope = (d[-1] - d[-2]) / (b[-1] - b[-2])
            out = np.where(x >= b[-1], d[-1] + slope * (x - b[-1]), d[i] * (1 - w) + d[i + 1] * w)
        return np.where(x == 0, 0.0, self.draft_scale * out)

    def observe(
        self,
        batch: int,
        rows: int,
        verify_s: float,
        draft_steps: int,
        draft_batch: int,
        propose_s: float,
        catch_up: int = 0,
        rate: float = 0.05,
        context: float | None = None,
    ) -> None:
        """Fold one measured step into the correction factors (catch_up: tokens the draft
        model fed before drafting; context: the batch's longest sequence)."""
        per_seq = max(1.0, rows / max(1, batch))
        table = self._table_s(batch, per_seq, context)
        if table > 0 and verify_s > 0:
            self.verify_scale += rate * (min(4.0, max(0.25, verify_s / table)) - self.verify_scale)
            # the batch size's factor, net of the shape
            shape = float(np.interp(per_seq, self.news, self._shape_by_new(batch)))
            ratio = min(4.0, max(0.25, verify_s / (table * shape)))
            for i, wb in self._weights(self.batches, batch):
                old = self.batch_scale[i] if self.batch_seen[i] > 0 else self.verify_scale
                w = wb * max(rate, 1.0 / (1.0 + self.batch_seen[i]))
                self.batch_scale[i] = old + w * (ratio - old)
                self.batch_seen[i] += wb
            # the cells around (B, T): what the factor still misses, at a higher rate (each
            # cell sees fewer steps than the factor does)
            rel = min(4.0, max(0.25, verify_s / (self._level(batch) * shape * table)))
            for i, wb in self._weights(self.batches, batch):
                for j, wn in self._weights(self.news, per_seq):
                    self.verify_shape[i, j] *= 1.0 + SHAPE_RATE * wb * wn * (rel - 1.0)
        if draft_steps and draft_batch:
            predicted = draft_steps * self.draft_s(draft_batch) / self.draft_scale
            predicted += self.draft_token_s * catch_up
            if predicted > 0 and propose_s > 0:
                ratio = min(4.0, max(0.25, propose_s / predicted))
                self.draft_scale += rate * (ratio - self.draft_scale)

    def propose_s(self, method: str, default: float = 0.0) -> float:
        """Seconds of one proposal by `method` (the default until one is measured)."""
        return self.propose.get(method, default)

    def observe_step(
        self, propose_s: dict[str, float], overhead_s: float, rate: float = 0.1
    ) -> None:
        """Fold one step's measured proposal times (draft model excepted: see `observe`)
        and its overhead into their moving averages; the first measurement is taken whole."""
        for method, seconds in propose_s.items():
            old = self.propose.get(method)
            self.propose[method] = seconds if old is None else old + rate * (seconds - old)
        if overhead_s > 0:
            old = self.overhead_s
            self.overhead_s = overhead_s if old == 0 else old + rate * (overhead_s - old)

    def as_dict(self) -> dict:
        return {
            "batches": self.batches.tolist(),
            "new_tokens": self.news.tolist(),
            "contexts": self.contexts.tolist(),
            "verify_s": self.verify.tolist(),
            "draft_s": self.draft.tolist(),
            "verify_scale": self.verify_scale,
            "batch_scale": np.where(
                self.batch_seen > 0, self.batch_scale, self.verify_scale
            ).tolist(),
            "verify_shape": self.verify_shape.tolist(),
            "draft_scale": self.draft_scale,
            "draft_token_s": self.draft_token_s,
            "propose_s": dict(self.propose),
            "overhead_s": self.overhead_s,
        }
