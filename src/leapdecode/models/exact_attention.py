"""Attention whose every query row computes the bits a one-row decode step computes.

With bfloat16 or float16 weights on the CPU, logits tie often (18.0 and 18.0), and a verify
row that rounds otherwise than the decode step of its token breaks a tie another way: the
speculative output would leave the plain one. PyTorch's CPU attention (flash attention, here
in float32) takes keys in blocks of KV_BLOCK and query rows in blocks of 32 (64 from 192
rows, 256 from 768), and a row's result does not depend on the other rows of its block once
the block has MIN_ROWS rows or more. So a step of such a model attends with its keys padded
to whole blocks and its query rows to a count whose last block holds MIN_ROWS or more, under
a mask: row t of a verify step then reads the same keys, at the same places, in blocks of the
same size, as the decode step of its token (a key block no row sees changes no bit). One call
a layer for every row: the query heads that share a key head go in as rows of that head
(grouped-query attention without copying the keys; a decode step of Qwen2.5's 12 query heads
over 2 key heads is then 6 rows).

A tree row's keys are not where its decode step had them (its ancestors lie among other
nodes), so each tree row gets its own copy: the cached prefix, then its ancestors in order,
exactly the layout of the chain it stands for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KV_BLOCK = 512  # the CPU flash attention kernel's key block (kv_split_size)
MIN_ROWS = 4  # from this many rows a query block gives each row the same bits
MAX_ROWS = 65  # steps of up to config.MAX_K + 1 new tokens attend this way (a test checks)
TREE_BYTES = 64 << 20  # a tree step copies its rows' keys and values this many bytes at a time


def padded_span(span: int) -> int:
    """The keys a step reads: its span rounded up to whole blocks (the cache has room)."""
    return -(-span // KV_BLOCK) * KV_BLOCK


def _visible(limit: torch.Tensor, query_pos: torch.Tensor, width: int, window) -> torch.Tensor:
    """[..., width] True where key j is seen by a query at cache index `limit` [...] and
    position `query_pos` [...]; a key's position is its index (the chain layout)."""
    key = torch.arange(width)
    seen = key <= limit[..., None]
    if window is not None:
        seen &= key > (query_pos[..., None] - window)
    return seen


def query_rows(rows: int) -> int:
    """The rows a call runs for `rows` query rows: at least MIN_ROWS, and never a last query
    block (the kernel's q_split_size) of fewer than MIN_ROWS."""
    rows = max(rows, MIN_ROWS)
    while True:
        split = 256 if rows >= 768 else 64 if rows >= 192 else 32
        if rows % split == 0 or rows % split >= MIN_ROWS:
            return rows
        rows += 1


def _grouped(seen: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, T, S] per token -> the mask [N, 1, R, S] of a call whose rows are each key head's
    query heads (g * T + t), padded to R = query_rows(groups * T) rows that see key 0 alone."""
    n, t, s = seen.shape
    seen = seen[:, None].expand(n, groups, t, s).reshape(n, groups * t, s)
    rows = query_rows(groups * t)
    if rows > groups * t:
        pad = torch.zeros(n, rows - groups * t, s, dtype=torch.bool)
        pad[:, :, 0] = True
        seen = torch.cat([seen, pad], dim=1)
    return seen[:, None]


def additive(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the float one SDPA makes of it (0 seen, -inf not): made once a step
    instead of once a layer."""
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def chain_masks(start, n_new: int, span: int, query_pos, windows, groups: int, device) -> dict:
    """Boolean masks for `attend` (`additive` turns them into its float ones), one per window
    size, for a step of new tokens in a chain (row t of sequence b at cache index start[b] +
    t); span from padded_span, groups = query heads per key head."""
    limit = start[:, None] + torch.arange(n_new)  # [B, T]
    qpos = query_pos.cpu()
    return {w: _grouped(_visible(limit, qpos, span, w), groups).to(device) for w in windows}


def tree_plan(start, tree_mask, span: int, query_pos, windows, groups: int, device):
    """For a tree step: (index [B, T, span], masks per window for `attend` over B * T calls
    of one token). index[b, t] lists the cache positions row t reads in its chain's order:
    the cached prefix in place, then its ancestors and itself (tree_mask[b, t], in order)."""
    batch, n_new = tree_mask.shape[:2]
    tree = tree_mask.cpu()  # [B, T, T] True: t sees node j
    start = start.cpu()
    # the ancestors' indices first, in order (a stable sort puts True before False)
    order = torch.sort((~tree).to(torch.int8), dim=-1, stable=True).indices  # [B, T, T]
    index = torch.arange(span).repeat(batch, n_new, 1)  # [B, T, S]
    at = start[:, None, None] + torch.arange(n_new)  # [B, 1, T] where the nodes lie
    index.scatter_(2, at.expand(-1, n_new, -1), at.expand(-1, n_new, -1).gather(2, order))
    depth = tree.sum(-1) - 1  # [B, T]
    limit = start[:, None] + depth  # [B, T] the row's own place in its chain
    qpos = query_pos.cpu()
    masks = {}
    for w in windows:
        seen = _visible(limit, qpos, span, w).view(batch * n_new, 1, span)
        masks[w] = _grouped(seen, groups).to(device)
    return index.to(device), masks


def attend(q, keys, values, mask) -> torch.Tensor:
    """q [B, H, T, D], keys / values [B, H_kv, S, D], a mask [B, 1, R, S] from chain_masks or
    tree_plan (rows g * T + t, then padding) -> [B, H, T, D]."""
    b, h, t, d = q.shape
    h_kv = keys.shape[1]
    rows = h // h_kv * t
    q = q.reshape(b, h_kv, rows, d)  # head h = key head h // (h / h_kv): rows g * T + t
    if mask.shape[2] > rows:
        q = torch.cat([q, q.new_zeros(b, h_kv, mask.shape[2] - rows, d)], dim=2)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return o[:, :, :rows].reshape(b, h, t, d)


def attend_tree(q, keys, values, index, mask) -> torch.Tensor:
    """q [B, H, T, D], keys / values [B, H_kv, S, D], (index, mask) from tree_plan ->
    [B, H, T, D]: each row alone over its own copy of its chain's keys."""
    b, h, t, d = q.shape
    span = index.shape[-1]
    seq = torch.arange(b, device=index.device)[:, None].expand(b, t).reshape(-1)  # [B*T]
    index = index.reshape(b * t, span)  # [B*T, S]
    one = q.transpose(1, 2).reshape(b * t, h, 1, d)  # every row a call of its own
    o = torch.empty_like(one)  # [B*T, H, 1, D]
    # a few rows at a time: each row's copy of its keys is its span (a 65-node tree over 4k
    # cached tokens would copy half a GB a layer at once); a row's bits do not depend on it
    step = max(1, TREE_BYTES // (2 * keys.shape[1] * span * d * keys.element_size()))
    for lo in range(0, b * t, step):
        r = slice(lo, lo + step)
        at = (seq[r, None], slice(None), index[r])  # -> [rows, S, H_kv, D]
        k = keys[at].transpose(1, 2)  # [rows, H_kv, S, D]
        v = values[at].transpose(1, 2)
        o[r] = attend(one[r], k, v, mask[r])
    return o.view(b, t, h, d).transpose(1, 2)
