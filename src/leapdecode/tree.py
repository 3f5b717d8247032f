"""Draft trees: the attention mask, the positions, and the accepted path, built batched.

A step's input for one sequence is [root, d1 .. dk]: the root is its last committed token,
d1 .. dk its draft nodes. `parents[b, j]` is the input index of node j's parent: 0 for the
root, i + 1 for draft i, always < j + 1 (parents come first). A chain is parents = [0, 1,
.., k-1]. Padding nodes (j >= counts[b]) hang off the root and are never accepted.

    node:        root  d1  d2  d3  d4          parents = [0, 1, 0, 3]
    input index:   0    1   2   3   4          depth   = [0, 1, 2, 1, 2]
    tree:        root -> d1 -> d2,  root -> d3 -> d4

Each node sees the cached prefix, itself and its ancestors, and sits at position
cached + depth, so every root-to-leaf path is scored exactly as if it were a chain.
"""

from __future__ import annotations

import torch


def chain_parents(batch: int, k: int) -> torch.Tensor:
    """Parents of plain chains: [B, k], node j's parent is input j."""
    return torch.arange(k).expand(batch, k).clone()


def full_parents(parents: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Parents over the whole input [B, k+1]: the root is its own parent, padding hangs
    off the root."""
    batch, k = parents.shape
    valid = torch.arange(k)[None, :] < counts[:, None]  # [B, k]
    inner = torch.where(valid, parents, torch.zeros_like(parents))
    return torch.cat([torch.zeros(batch, 1, dtype=torch.long), inner], dim=1)  # [B, k+1]


def ancestor_mask(parents: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool (T = k+1): input t sees input s iff s is t itself or an ancestor."""
    full = full_parents(parents, counts)  # [B, T]
    batch, t = full.shape
    mask = torch.eye(t, dtype=torch.bool).expand(batch, t, t).clone()
    cur = torch.arange(t).expand(batch, t).clone()  # [B, T] walking up from every node
    for _ in range(t - 1):
        cur = full.gather(1, cur)
        mask.scatter_(2, cur[..., None], True)
        if not bool(cur.any()):
            break  # every walk has reached the root
    return mask


def depths(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] depth of every input (root 0) from its ancestor mask."""
    return mask.sum(-1) - 1


def path_to(
    parents: torch.Tensor, counts: torch.Tensor, node: torch.Tensor, depth: torch.Tensor
) -> torch.Tensor:
    """Input indices of the nodes from the root's child down to `node` [B]: [B, max depth],
    right-padded with 0 (row b holds depth[b, node[b]] entries)."""
    full = full_parents(parents, counts)  # [B, T]
    rows = torch.arange(full.shape[0])
    n = depth[rows, node]  # [B]
    width = int(n.max()) if n.numel() else 0
    path = torch.zeros(full.shape[0], width, dtype=torch.long)
    cur = node.clone()
    for step in range(width):
        at = n - 1 - step  # [B] where cur goes in the path
        live = at >= 0
        path[rows[live], at[live]] = cur[live]
        cur = full[rows, cur]
    return path
