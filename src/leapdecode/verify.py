"""The acceptance rule, in one place.

Greedy: keep the longest prefix of the drafts that equals the target's argmax, then the
target's own next token (the bonus token, or the correction at the first mismatch).

Sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from normalise(max(0, p_i - q_i));
when every draft is accepted, sample the bonus token from p_k. Draftless proposers
(n-grams, lookahead) propose deterministically, which is a one-hot q.
The output then follows p exactly, whatever q is.
"""

from __future__ import annotations

import torch

from .sampling import sample_from


def _valid(n_drafts: torch.Tensor, k: int) -> torch.Tensor:
    return torch.arange(k, device=n_drafts.device)[None, :] < n_drafts[:, None]  # [B, k]


def greedy_accept(
    target_logits: torch.Tensor,  # [B, k+1, V]
    drafts: torch.Tensor,  # [B, k] (right-padded)
    n_drafts: torch.Tensor,  # [B] real drafts per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (n_accepted [B], next_token [B])."""
    k = drafts.shape[1]
    choice = target_logits.argmax(-1)  # [B, k+1]
    agree = (drafts == choice[:, :k]) & _valid(n_drafts, k)  # [B, k]
    n_accepted = agree.long().cumprod(-1).sum(-1)  # [B]
    next_token = choice.gather(1, n_accepted[:, None])[:, 0]  # [B]
    return n_accepted, next_token


def rejection_accept(
    p: torch.Tensor,  # [B, k+1, V] target's processed probabilities
    q: torch.Tensor | None,  # [B, k, V] drafter's processed probabilities; None = one-hot
    drafts: torch.Tensor,  # [B, k]
    n_drafts: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, k+1] in [0, 1): k acceptance tests + one sample
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (n_accepted [B], next_token [B])."""
    batch, k = drafts.shape
    uniforms = uniforms.to(p.device)
    rows = torch.arange(batch, device=p.device)
    if k == 0:
        return torch.zeros(batch, dtype=torch.long, device=p.device), sample_from(
            p[:, 0], uniforms[:, 0]
        )

    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, k]
    if q is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = q.gather(-1, drafts[..., None])[..., 0]  # [B, k]
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp(min=1e-30), torch.ones_like(p_draft))
    ok = (uniforms[:, :k] < ratio.clamp(max=1.0)) & _valid(n_drafts, k)  # [B, k]
    n_accepted = ok.long().cumprod(-1).sum(-1)  # [B]

    p_next = p[rows, n_accepted]  # [B, V]
    at = n_accepted.clamp(max=k - 1)
    if q is None:
        q_next = torch.zeros_like(p_next).scatter(1, drafts[rows, at][:, None], 1.0)
    else:
        q_next = q[rows, at]  # [B, V]
    rejected = n_accepted < n_drafts  # [B]
    residual = (p_next - q_next).clamp(min=0.0)  # [B, V]
    # A rejection only happens where p(d) < q(d), so the residual has mass; guard rounding anyway.
    usable = residual.sum(-1) > 0
    dist = torch.where((rejected & usable)[:, None], residual, p_next)
    next_token = sample_from(dist, uniforms[:, k])
    return n_accepted, next_token
