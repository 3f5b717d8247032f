"""What a step costs on this machine: the target's verify forward and a draft forward.

Profiled once when `auto` is first needed: forwards of B sequences x T new tokens over a
short cached prefix, fitted by least squares as

    verify_s(B, R) = a + b * B + c * R        (R = all rows of the step, sum of k_i + 1)
    draft_s(B)     = a_d + b_d * B            (one draft forward of B sequences)

and kept honest afterwards: every step's measured forward time nudges a correction factor
(exponential moving average of measured / predicted).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..models.base import CausalLM


def _fill(model: CausalLM, batch: int, cached: int) -> None:
    """Give slots 0..batch-1 a prefix of `cached` tokens."""
    slots = torch.arange(batch)
    model.truncate(slots, torch.zeros(batch, dtype=torch.long))
    model.forward(torch.randint(0, model.vocab_size, (batch, cached)), slots)


def _time_forward(model: CausalLM, batch: int, new: int, cached: int, reps: int) -> float:
    slots = torch.arange(batch)
    times = []
    for _ in range(reps):
        model.truncate(slots, torch.full((batch,), cached, dtype=torch.long))
        tokens = torch.randint(0, model.vocab_size, (batch, new))
        t0 = time.perf_counter()
        model.forward(tokens, slots)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit(rows: list[tuple[float, ...]], times: list[float]) -> np.ndarray:
    x = np.array([(1.0, *r) for r in rows])
    coef, *_ = np.linalg.lstsq(x, np.array(times), rcond=None)
    return np.maximum(coef, 0.0)


class CostModel:
    def __init__(self, verify=(0.0, 0.0, 1.0), draft=(0.0, 1.0)) -> None:
        self.verify_coef = np.asarray(verify, dtype=float)  # a, b, c
        self.draft_coef = np.asarray(draft, dtype=float)  # a_d, b_d
        self.verify_scale = 1.0
        self.draft_scale = 1.0

    @classmethod
    def profile(cls, target: CausalLM, draft: CausalLM | None, max_batch: int,
                max_new: int = 17, cached: int = 64, reps: int = 3) -> CostModel:  # fmt: skip
        """Measure on the engine's own (allocated, empty) caches; leaves them empty."""
        batches = sorted({b for b in (1, 2, 4, 8, 16, 32) if b <= max_batch} | {max_batch})
        news = [t for t in (1, 2, 3, 5, 9, 17) if t <= max_new]
        rows, times = [], []
        for b in batches:
            _fill(target, b, cached)
            for t in news:
                _time_forward(target, b, t, cached, 1)  # warm-up of this shape
                times.append(_time_forward(target, b, t, cached, reps))
                rows.append((b, b * t))
        model = cls(verify=_fit(rows, times))
        if draft is not None:
            d_rows, d_times = [], []
            for b in batches:
                _fill(draft, b, cached)
                _time_forward(draft, b, 1, cached, 1)
                d_times.append(_time_forward(draft, b, 1, cached, reps))
                d_rows.append((b,))
            model.draft_coef = _fit(d_rows, d_times)
            draft.truncate(torch.arange(max_batch), torch.zeros(max_batch, dtype=torch.long))
        target.truncate(torch.arange(max_batch), torch.zeros(max_batch, dtype=torch.long))
        return model

    def verify_s(self, batch: int, rows: int) -> float:
        a, b, c = self.verify_coef
        return self.verify_scale * (a + b * batch + c * rows)

    def draft_s(self, batch: int) -> float:
        if batch == 0:
            return 0.0
        a, b = self.draft_coef
        return self.draft_scale * (a + b * batch)

    def observe(self, batch: int, rows: int, verify_s: float, draft_steps: int, draft_batch: int,
                propose_s: float, rate: float = 0.05) -> None:  # fmt: skip
        """Fold one measured step into the correction factors."""
        predicted = self.verify_s(batch, rows) / self.verify_scale
        if predicted > 0 and verify_s > 0:
            ratio = min(4.0, max(0.25, verify_s / predicted))
            self.verify_scale += rate * (ratio - self.verify_scale)
        if draft_steps and draft_batch:
            predicted = draft_steps * self.draft_s(draft_batch) / self.draft_scale
            if predicted > 0 and propose_s > 0:
                ratio = min(4.0, max(0.25, propose_s / predicted))
                self.draft_scale += rate * (ratio - self.draft_scale)

    def as_dict(self) -> dict:
        return {"verify_coef": self.verify_coef.tolist(), "draft_coef": self.draft_coef.tolist(),
                "verify_scale": self.verify_scale, "draft_scale": self.draft_scale}  # fmt: skip
