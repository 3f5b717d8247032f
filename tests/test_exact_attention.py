"""Exact rows (models/exact_attention.py): in bfloat16 on the CPU, every query row of a step
(a chain's verify rows, a batch of sequences at different lengths, a tree's nodes) computes
the very bits the one-row decode step of its token computes, whatever the step's row count,
so that speculation breaks logit ties as plain decoding does."""

import pytest
import torch

from leapdecode.models import exact_attention as exact

H, H_KV, D = 12, 2, 64  # Qwen2.5-1.5B's heads: 6 query heads a key head


def _cache(batch: int, span: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    room = exact.padded_span(span)
    keys = torch.randn(batch, H_KV, room, D, generator=g)
    return keys, torch.randn(batch, H_KV, room, D, generator=g)


def _decode(q, keys, values, b: int, at: int):
    """The decode step of the token at cache index `at` of sequence b: q [H, D] -> [H, D]."""
    span = exact.padded_span(at + 1)
    mask = exact.chain_masks(torch.tensor([at]), 1, span, torch.tensor([[at]]), {None}, H // H_KV,
                             "cpu")[None]  # fmt: skip
    k, v = keys[b : b + 1, :, :span], values[b : b + 1, :, :span]
    return exact.attend(q[None, :, None], k, v, exact.additive(mask))[0, :, 0]


@pytest.mark.parametrize("context", [40, 500, 509, 1100])  # key blocks crossed by the step
def test_every_chain_row_holds_the_decode_bits(context):
    starts = torch.tensor([context, context - 30])  # two sequences, one step
    for n_new in (1, 2, 5, 9, 11, 17, 33):  # 11: 66 rows, a last query block of 2 unpadded
        span = exact.padded_span(int(starts.max()) + n_new)
        keys, values = _cache(2, span)
        q = torch.randn(2, H, n_new, D, generator=torch.Generator().manual_seed(n_new))
        pos = starts[:, None] + torch.arange(n_new)
        masks = exact.chain_masks(starts, n_new, span, pos, {None}, H // H_KV, "cpu")
        out = exact.attend(q, keys[:, :, :span], values[:, :, :span], exact.additive(masks[None]))
        for b in range(2):
            for t in range(n_new):
                one = _decode(q[b, :, t], keys, values, b, int(starts[b]) + t)
                assert torch.equal(out[b, :, t], one), (context, n_new, b, t)
        # and the same call's rows without the padding are the masked attention's, closely
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, keys[:, :, :span], values[:, :, :span],
            attn_mask=(torch.arange(span) <= pos[..., None])[:, None], enable_gqa=True,
        )  # fmt: skip
        assert torch.allclose(out, ref, atol=1e-5)


def test_a_tree_row_holds_the_bits_of_its_chain(monkeypatch):
    """Node t of a tree reads its ancestors among other nodes; its output is the decode
    step's of its token after its ancestors alone, laid out as a chain."""
    start, parents = 700, [-1, 0, 0, 1, 1, 2, 4]  # a tree of 7 nodes
    n = len(parents)
    tree = torch.zeros(1, n, n, dtype=torch.bool)
    for t in range(n):
        j = t
        while j >= 0:
            tree[0, t, j] = True
            j = parents[j]
    depth = tree.sum(-1) - 1  # [1, T]
    span = exact.padded_span(start + n)
    keys, values = _cache(1, span, seed=3)
    q = torch.randn(1, H, n, D, generator=torch.Generator().manual_seed(4))
    index, masks = exact.tree_plan(torch.tensor([start]), tree, span, start + depth, {None},
                                   H // H_KV, "cpu")  # fmt: skip
    masks = exact.additive(masks[None])
    out = exact.attend_tree(q, keys[:, :, :span], values[:, :, :span], index, masks)
    row_bytes = 2 * H_KV * span * D * 4  # and a few rows at a time: the same bits
    monkeypatch.setattr(exact, "TREE_BYTES", 3 * row_bytes)
    few = exact.attend_tree(q, keys[:, :, :span], values[:, :, :span], index, masks)
    assert torch.equal(few, out)
    for t in range(n):
        path = tree[0, t].nonzero()[:, 0]  # its ancestors and itself, in order
        k, v = keys.clone(), values.clone()  # the chain: the prefix, then the path
        k[:, :, start : start + len(path)] = keys[:, :, start + path]
        v[:, :, start : start + len(path)] = values[:, :, start + path]
        one = _decode(q[0, :, t], k, v, 0, start + len(path) - 1)
        assert torch.equal(out[0, :, t], one), t


def test_every_verify_step_attends_exactly():
    from leapdecode.config import MAX_K

    assert exact.MAX_ROWS == MAX_K + 1


def test_query_rows_never_leave_a_short_last_block():
    for rows in range(1, 2000):
        r = exact.query_rows(rows)
        split = 256 if r >= 768 else 64 if r >= 192 else 32
        assert r >= max(rows, exact.MIN_ROWS) and (r % split == 0 or r % split >= exact.MIN_ROWS)
        assert r - rows <= exact.MIN_ROWS
