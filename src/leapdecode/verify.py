"""The acceptance rule, in one place.

Greedy: keep the longest prefix of the drafts that equals the target's argmax, then the
target's own next token (the bonus token, or the correction at the first mismatch).

Sampling with a draft model (Leviathan et al. 2023; Chen et al. 2023): accept draft i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from
normalise(max(0, p_i - q_i)); when every draft is accepted, sample the bonus token from p_k.
The output then follows p exactly, whatever q is.

Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding",
Algorithm 2; `verify="block"`), for a draft model's chains under sampling: the drafts are
judged as a block. With w_0 = 1 and, for draft i, w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i)),
the block up to draft i is kept with probability h_i = Z_i / (Z_i + 1 - w_i), where
Z_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)) (h = 0 where Z = 0; at the last draft,
h_n = w_n); the longest i whose test passes wins, and the next token comes from
normalise(max(0, w_i p_{i+1} - q_{i+1})) (p_n itself after the whole block). The output
still follows p exactly, and the expected number of kept drafts is never below the
token-level rule's. A row whose draft stops early (a confidence cut-off) is a block that
ends there: the same formulas with n its own length. With one-hot q (deterministic drafts)
it keeps draft i with probability p_1(d_1) ... p_i(d_i), as the token-level rule does
(the h_i telescope), so it changes nothing there; trees are verified token by token.

Sampling with deterministic drafts (n-grams, suffix, lookahead; chains or trees): at every
node, draw the target's own token y = inverse-CDF(p, u) with the uniform u of the output
position the node stands for, and accept the child whose token is y (if any): the emitted
token at output position t is always inverse-CDF(p_t, u_t). So the output is exactly what
plain sampling with the same per-position uniforms gives, whatever was proposed: a seeded
request emits the same tokens with or without these methods. It accepts with the same
probabilities as the rejection rule with a one-hot q ("accept x with probability p(x), else
zero it, renormalise and try the next sibling", SpecInfer / EAGLE): sibling x is accepted
with probability p(x) either way.

Trees (tree.py says how a tree is laid out): keep the deepest node whose whole path agrees
with the target's choice (argmax, or the sample above).
"""

from __future__ import annotations

import torch

from .sampling import process_rows, sample_from
from .tree import ancestor_mask, chain_parents, depths, full_parents, path_to


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


def _no_drafts(p: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows without drafts: none accepted, the next token sampled from p [B, 1, V]."""
    n = torch.zeros(p.shape[0], dtype=torch.long, device=p.device)
    return n, sample_from(p[:, 0], uniforms[:, 0])


def _ratio(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """p(d_i) / q(d_i) for each draft [B, k] (1 where q gives it no mass; q None: one-hot)."""
    p_draft = p[:, : drafts.shape[1]].gather(-1, drafts[..., None])[..., 0]  # [B, k]
    if q is None:
        return p_draft
    q_draft = q.gather(-1, drafts[..., None])[..., 0]  # [B, k]
    return torch.where(q_draft > 0, p_draft / q_draft.clamp(min=1e-30), torch.ones_like(p_draft))


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
        return _no_drafts(p, uniforms)
    ratio = _ratio(p, q, drafts)  # [B, k]
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


def block_accept(
    p: torch.Tensor,  # [B, k+1, V] target's processed probabilities
    q: torch.Tensor,  # [B, k, V] drafter's processed probabilities
    drafts: torch.Tensor,  # [B, k]
    n_drafts: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, k+1] in [0, 1): k block tests + one sample
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification of chains (module notes): (n_accepted [B], next_token [B])."""
    batch, k = drafts.shape
    uniforms = uniforms.to(p.device)
    rows = torch.arange(batch, device=p.device)
    if k == 0:
        return _no_drafts(p, uniforms)
    ratio = _ratio(p, q, drafts)  # [B, k]
    weight = torch.ones(batch, device=p.device)  # w_i  [B]
    kept = torch.zeros(batch, dtype=torch.long, device=p.device)  # tau  [B]
    kept_weight = torch.ones(batch, device=p.device)  # w_tau  [B]
    for i in range(1, k + 1):
        drafted = i <= n_drafts  # [B]
        w = torch.where(drafted, (weight * ratio[:, i - 1]).clamp(max=1.0), weight)
        if i < k:  # the residual mass after draft i (rows whose block goes on)
            z = (w[:, None] * p[:, i] - q[:, i]).clamp(min=0.0).sum(-1)  # [B]
            h = torch.where(z > 0, z / (z + 1.0 - w).clamp(min=1e-30), torch.zeros_like(z))
        else:
            h = w
        h = torch.where(i == n_drafts, w, h)  # the block's last draft
        passed = drafted & (uniforms[:, i - 1] < h)
        kept = torch.where(passed, i, kept)
        kept_weight = torch.where(passed, w, kept_weight)
        weight = w
    p_next = p[rows, kept]  # [B, V]
    q_next = q[rows, kept.clamp(max=k - 1)]  # [B, V]
    residual = (kept_weight[:, None] * p_next - q_next).clamp(min=0.0)  # [B, V]
    cut = (kept < n_drafts) & (residual.sum(-1) > 0)  # rounding can leave no mass: guard
    next_token = sample_from(torch.where(cut[:, None], residual, p_next), uniforms[:, k])
    return kept, next_token


def _accept_by_choice(
    choice: torch.Tensor,  # [B, T] the target's token after each input (argmax or sample)
    drafts: torch.Tensor,  # [B, k]
    parents: torch.Tensor,  # [B, k] input index of each node's parent (tree.py)
    counts: torch.Tensor,  # [B] real nodes per row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The deepest node whose path agrees with `choice`: (path [B, n_max] input indices,
    n_accepted [B], next_token [B])."""
    choice, drafts, parents, counts = choice.cpu(), drafts.cpu(), parents.cpu(), counts.cpu()
    batch, k = drafts.shape
    full = full_parents(parents, counts)  # [B, T]
    mask = ancestor_mask(parents, counts)  # [B, T, T]
    depth = depths(mask)  # [B, T]
    valid = torch.arange(k)[None, :] < counts[:, None]
    agree = valid & (drafts == choice.gather(1, full[:, 1:]))  # [B, k] vs its parent's choice
    ok = torch.cat([torch.ones(batch, 1, dtype=torch.bool), agree], dim=1)  # [B, T]
    on_path = ~(mask & ~ok[:, None, :]).any(-1)  # [B, T] the node and its ancestors agree
    t = k + 1
    score = torch.where(on_path, depth * t + (t - 1 - torch.arange(t)), -1)  # deepest, then first
    best = score.argmax(-1)  # [B]
    rows = torch.arange(batch)
    return path_to(parents, counts, best, depth), depth[rows, best], choice[rows, best]


def tree_greedy_accept(
    target_logits: torch.Tensor,  # [B, k+1, V] at [root, d1 .. dk]
    drafts: torch.Tensor,  # [B, k]
    parents: torch.Tensor,  # [B, k]
    counts: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy over a tree: (path [B, n_max], n_accepted [B], next_token [B])."""
    return _accept_by_choice(target_logits.argmax(-1), drafts, parents, counts)


def sample_match_accept(
    p: torch.Tensor,  # [B, k+1, V] target's processed probabilities at [root, d1 .. dk]
    drafts: torch.Tensor,  # [B, k] deterministic drafts (a chain or a tree)
    parents: torch.Tensor,  # [B, k]
    counts: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, k+1] the uniform of the output position of each input
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampling with deterministic drafts (see the module notes): (path [B, n_max],
    n_accepted [B], next_token [B])."""
    batch, t, vocab = p.shape
    choice = sample_from(p.reshape(batch * t, vocab), uniforms.reshape(-1)).view(batch, t)
    return _accept_by_choice(choice, drafts, parents, counts)


def accept_batch(
    seqs: list,  # [B] Sequence: each row's sampling params and seeded streams
    logits: torch.Tensor,  # [B, k+1, V] the target's, at the last token and each draft
    tokens: torch.Tensor,  # [B, k] drafts, right-padded
    counts: torch.Tensor,  # [B] real drafts per row
    probs: torch.Tensor | None = None,  # [B, k, V] a drafter's distributions (None: one-hot)
    parents: torch.Tensor | None = None,  # [B, k] draft trees (tree.py); None: chains
    stochastic: torch.Tensor | None = None,  # [B] rows whose probs are real (None: all if any)
) -> tuple[torch.Tensor, list[int], list[int]]:
    """The acceptance rules above for a whole batch, in at most four calls: greedy rows;
    sampled rows with a draft model's drafts (rejection sampling, or block verification for
    chains whose spec.verify is not "token"; uniforms from the row's draft stream); every
    other sampled row (deterministic drafts or none: the target's own sample at each
    position, from the row's per-position uniforms). Each row keeps its own
    temperature / top-k / top-p and seeded streams, so a row draws the same alone or batched.

    Returns (paths [B, k]: input indices of each row's accepted drafts, n_accepted,
    next_token); a chain's path is 1 .. n."""
    batch, k = tokens.shape
    tree = parents
    parents = parents if parents is not None else chain_parents(batch, k)
    paths = torch.arange(1, k + 1).expand(batch, k).clone()  # [B, k]
    n_acc, nxt = [0] * batch, [0] * batch
    if stochastic is None:
        stochastic = torch.full((batch,), probs is not None)
    stochastic = stochastic & (counts > 0)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy and stochastic[i]]
    as_block = {i for i in sampled if tree is None and seqs[i].spec.verify != "token"}
    block = [i for i in sampled if i in as_block]
    rejection = [i for i in sampled if i not in as_block]
    matched = [i for i, s in enumerate(seqs) if not s.params.greedy and not stochastic[i]]

    def keep(rows, path, a, t):
        if path is not None:
            paths[torch.tensor(rows), : path.shape[1]] = path
        for j, i in enumerate(rows):
            n_acc[i], nxt[i] = int(a[j]), int(t[j])

    if greedy:
        keep(greedy, *_greedy_rows(greedy, logits, tokens, counts, tree, parents))
    for rule, rows in ((rejection_accept, rejection), (block_accept, block)):
        if rows:  # a draft model's chains: token by token, or as blocks
            keep(rows, None, *_stochastic_rows(rule, rows, seqs, logits, tokens, counts, probs))
    if matched:
        idx = torch.tensor(matched)
        p = process_rows(logits[idx.to(logits.device)], [seqs[i].params for i in matched])
        depth = depths(ancestor_mask(parents[idx], counts[idx]))  # [M, k+1]
        u = torch.stack(
            [seqs[i].uniforms(seqs[i].n_out, k + 1)[depth[j]] for j, i in enumerate(matched)]
        )
        keep(matched, *sample_match_accept(p, tokens[idx], parents[idx], counts[idx], u))
    return paths, n_acc, nxt


def _greedy_rows(rows, logits, tokens, counts, tree, parents):
    """(path or None, n_accepted, next_token) of the greedy rows. Every row greedy (the usual
    batch): the logits as they are, not an indexed copy of them ([16, 9, 8192] floats: about
    a millisecond a step)."""
    dev = logits.device
    idx = torch.tensor(rows)
    every = len(rows) == logits.shape[0]
    mine = logits if every else logits[idx.to(dev)]
    if tree is not None:
        return tree_greedy_accept(mine, tokens[idx], parents[idx], counts[idx])
    return (None, *greedy_accept(mine, tokens.to(dev)[idx.to(dev)], counts.to(dev)[idx.to(dev)]))


def _stochastic_rows(rule, rows, seqs, logits, tokens, counts, probs):
    """(n_accepted, next_token) of the sampled rows with a draft model's drafts, by `rule`
    (rejection_accept or block_accept): the row's processed distributions against the
    drafter's, uniforms from the row's draft stream."""
    dev = logits.device
    k = tokens.shape[1]
    idx = torch.tensor(rows, device=dev)
    p = process_rows(logits[idx, : k + 1], [seqs[i].params for i in rows])
    u = torch.zeros(len(rows), k + 1)
    for j, i in enumerate(rows):
        n = int(counts[i])
        draw = torch.rand(n + 1, generator=seqs[i].draft_generator)
        u[j, :n], u[j, k] = draw[:n], draw[n]
    return rule(p, probs.to(dev)[idx], tokens.to(dev)[idx], counts.to(dev)[idx], u)
