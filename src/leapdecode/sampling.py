"""Logits -> probabilities, shared by the target, every drafter and every method.

Drafts and the target go through the very same processing, so that rejection
sampling reproduces exactly the target's *processed* distribution.
Order (as in Hugging Face `generate`): temperature, then top-k, then top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import LeapDecodeError

MAX_TOP_K = 1_000_000


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise LeapDecodeError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0 or self.top_k > MAX_TOP_K:
            raise LeapDecodeError(f"top-k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise LeapDecodeError(f"top-p must be in (0, 1] (1 = off), got {p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise LeapDecodeError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits [..., V] into the sampling distribution [..., V] (float32).

    Greedy params give a one-hot distribution on the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass of the tokens ranked above it already reaches top_p;
        # the first token always stays.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V] (rows need not be normalised), uniform [B] in [0, 1).

    Taking the randomness as explicit uniforms lets every sequence of a batch draw from
    its own seeded generator while the arithmetic stays vectorised.
    """
    cdf = probs.cumsum(-1)  # [B, V]
    target = uniform.to(probs.device) * cdf[:, -1]  # [B]
    idx = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]  # [B]
    # Never land on a zero-probability token through rounding at the top end.
    idx = idx.clamp(max=probs.shape[-1] - 1)
    bad = probs.gather(1, idx[:, None])[:, 0] <= 0
    if bool(bad.any()):
        last_nonzero = (probs > 0).float().cumsum(-1).argmax(-1)  # [B]
        idx = torch.where(bad, last_nonzero, idx)
    return idx
