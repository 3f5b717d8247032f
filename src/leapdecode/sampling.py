"""Logits -> probabilities, shared by the target, every drafter and every method.

Drafts and the target go through the very same processing, so that rejection
sampling reproduces exactly the target's *processed* distribution.
Order (as in Hugging Face `generate`): temperature, then top-k, then top-p.
"""

from __future__ import annotations

import math

import torch

from .config import SamplingParams

__all__ = ["SamplingParams", "process_logits", "process_rows", "sample_from"]


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits [..., V] into the sampling distribution [..., V] (float32): temperature,
    top-k, then top-p (a token is dropped once the mass ranked above it reaches top_p; the
    first always stays). Greedy params give a one-hot distribution on the argmax. One row of
    `process_rows`, which does it for a batch of rows with their own params."""
    shape = logits.shape
    return process_rows(logits.reshape(1, -1, shape[-1]), [params]).reshape(shape)


def process_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The sampling distributions of a mixed batch in one pass: logits [B, T, V], one
    SamplingParams per row (see `process_logits`; greedy rows become one-hot)."""
    logits = logits.float()
    batch, _, vocab = logits.shape
    dev = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=dev)  # [B]
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    x = logits / temp[:, None, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], device=dev)
    if bool((top_k > 0).any()):
        kmax = int(top_k.max())
        top = torch.topk(x, kmax, dim=-1).values  # [B, T, kmax]
        idx = (top_k.clamp(min=1) - 1)[:, None, None].expand(batch, x.shape[1], 1)
        kth = top.gather(-1, idx)  # [B, T, 1]
        x = torch.where((top_k > 0)[:, None, None] & (x < kth), -math.inf, x)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_p < 1.0).any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_probs = sorted_x.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None, None]
        drop_sorted[..., 0] = False
        drop_sorted &= (top_p < 1.0)[:, None, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    probs = x.softmax(-1)
    if bool(greedy.any()):
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


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
