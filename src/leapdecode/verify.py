"""The acceptance rule, in one place.

Greedy: keep the longest prefix of the drafts that equals the target's argmax, then the
target's own next token (the bonus token, or the correction at the first mismatch).

Sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from normalise(max(0, p_i - q_i));
when every draft is accepted, sample the bonus token from p_k. Draftless proposers
(n-grams, lookahead) propose deterministically, which is a one-hot q.
The output then follows p exactly, whatever q is.

Trees (tree.py says how a tree is laid out): greedy keeps the deepest node whose whole path
agrees with the target's argmax. Sampling tries, at each node, its children in turn, each
against what the rejected ones left (SpecInfer's multi-candidate rule for deterministic
drafts, as in EAGLE): accept child x with probability r(x), where r starts as p and each
rejected x is zeroed and r renormalised; when every child is rejected, sample from r.
The emitted tokens follow p exactly at every step, however many candidates there are.
"""

from __future__ import annotations

import torch

from .sampling import sample_from
from .tree import ancestor_mask, depths, full_parents, path_to


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


def tree_greedy_accept(
    target_logits: torch.Tensor,  # [B, k+1, V] at [root, d1 .. dk]
    drafts: torch.Tensor,  # [B, k]
    parents: torch.Tensor,  # [B, k] input index of each node's parent (tree.py)
    counts: torch.Tensor,  # [B] real nodes per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (path [B, n_max] input indices of the accepted nodes, n_accepted [B],
    next_token [B])."""
    choice = target_logits.argmax(-1).cpu()  # [B, T]
    drafts, parents, counts = drafts.cpu(), parents.cpu(), counts.cpu()
    batch, k = drafts.shape
    full = full_parents(parents, counts)  # [B, T]
    mask = ancestor_mask(parents, counts)  # [B, T, T]
    depth = depths(mask)  # [B, T]
    valid = torch.arange(k)[None, :] < counts[:, None]
    agree = valid & (drafts == choice.gather(1, full[:, 1:]))  # [B, k] vs its parent's argmax
    ok = torch.cat([torch.ones(batch, 1, dtype=torch.bool), agree], dim=1)  # [B, T]
    on_path = ~(mask & ~ok[:, None, :]).any(-1)  # [B, T] the node and its ancestors agree
    t = k + 1
    score = torch.where(on_path, depth * t + (t - 1 - torch.arange(t)), -1)  # deepest, then first
    best = score.argmax(-1)  # [B]
    rows = torch.arange(batch)
    return path_to(parents, counts, best, depth), depth[rows, best], choice[rows, best]


def tree_sample_accept(
    p: torch.Tensor,  # [B, k+1, V] target's processed probabilities at [root, d1 .. dk]
    drafts: torch.Tensor,  # [B, k] deterministic draft nodes (one-hot q)
    parents: torch.Tensor,  # [B, k]
    counts: torch.Tensor,  # [B]
    uniforms: list[torch.Tensor],  # per row: counts[b] + 1 draws in [0, 1), used in order
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (path [B, n_max], n_accepted [B], next_token [B]); see the module notes."""
    batch = drafts.shape[0]
    drafts_l, parents_l, counts_l = drafts.tolist(), parents.tolist(), counts.tolist()
    paths, next_tokens = [], []
    for b in range(batch):
        children: dict[int, list[int]] = {}
        for j in range(counts_l[b]):
            children.setdefault(parents_l[b][j], []).append(j + 1)
        draws = uniforms[b].tolist()
        node, path = 0, []
        while True:
            probs = p[b, node]  # [V]
            rejected: list[int] = []
            mass = 1.0
            chosen = None
            for child in children.get(node, []):
                x = drafts_l[b][child - 1]
                if x in rejected:
                    continue  # already zeroed: accepted with probability 0
                px = float(probs[x])
                if mass > 0 and draws.pop(0) < px / mass:
                    chosen = child
                    break
                rejected.append(x)
                mass -= px
            if chosen is None:
                residual = probs.clone()
                if rejected:
                    residual[torch.tensor(rejected, device=probs.device)] = 0.0
                if not bool(residual.sum() > 0):  # rounding only: r has mass in exact arithmetic
                    residual = probs
                next_tokens.append(int(sample_from(residual[None], torch.tensor([draws[0]]))[0]))
                break
            path.append(chosen)
            node = chosen
        paths.append(path)
    width = max((len(x) for x in paths), default=0)
    out = torch.zeros(batch, width, dtype=torch.long)
    for b, path in enumerate(paths):
        out[b, : len(path)] = torch.tensor(path, dtype=torch.long)
    n = torch.tensor([len(x) for x in paths], dtype=torch.long)
    return out, n, torch.tensor(next_tokens, dtype=torch.long)
