"""Draft trees: masks and paths, greedy acceptance, and lossless multi-candidate sampling.

Statistical test (sampling, verify.sample_match_accept): the target is a Markov chain over V = 5 tokens, p(next | last)
= M[last], with zeros and top-k/top-p processed rows among them. Trees of deterministic
candidates (duplicate siblings, a candidate p rules out, chains, bushy roots) are built from
each row's last token; steps of tree verification are repeated until every row has emitted
3 tokens. Those 3 tokens must follow the chain exactly: Pearson chi-square goodness of fit
over the 125 cells against prod M, N = 40,000 rows per case, p-value above 1e-4 (seeds are
fixed, so the test is deterministic), and cells of probability 0 stay empty.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from leapdecode.sampling import SamplingParams, process_logits
from leapdecode.tree import ancestor_mask, chain_parents, depths, path_to
from leapdecode.verify import greedy_accept, sample_match_accept, tree_greedy_accept

V = 5
N = 40_000


def test_mask_depth_and_path_of_the_documented_example():
    parents = torch.tensor([[0, 1, 0, 3]])
    counts = torch.tensor([4])
    mask = ancestor_mask(parents, counts)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 1, 1, 0, 0],
                             [1, 0, 0, 1, 0],
                             [1, 0, 0, 1, 1]], dtype=torch.bool)  # fmt: skip
    assert torch.equal(mask[0], expected)
    depth = depths(mask)
    assert depth.tolist() == [[0, 1, 2, 1, 2]]
    assert path_to(parents, counts, torch.tensor([4]), depth).tolist() == [[3, 4]]


def test_padding_nodes_see_only_the_root_and_themselves():
    parents = torch.tensor([[0, 1, 2], [0, 0, 0]])
    mask = ancestor_mask(parents, torch.tensor([1, 3]))
    assert mask[0, 2].tolist() == [True, False, True, False]
    assert mask[0, 3].tolist() == [True, False, False, True]


def test_tree_greedy_keeps_the_deepest_agreeing_path():
    # input: root, a=1 (root), b=2 (a), c=3 (root), d=4 (c), e=0 (d)
    drafts = torch.tensor([[1, 2, 3, 4, 0]])
    parents = torch.tensor([[0, 1, 0, 3, 4]])
    argmax = [3, 2, 7, 4, 0, 9]  # the target's choice after root, a, b, c, d, e
    logits = torch.nn.functional.one_hot(torch.tensor([argmax]), 10).float()
    path, n, nxt = tree_greedy_accept(logits, drafts, parents, torch.tensor([5]))
    assert n.tolist() == [3] and path.tolist() == [[3, 4, 5]] and nxt.tolist() == [9]
    # the same tree with the last node cut off by counts
    path, n, nxt = tree_greedy_accept(logits, drafts, parents, torch.tensor([4]))
    assert n.tolist() == [2] and path[0, :2].tolist() == [3, 4] and nxt.tolist() == [0]


def test_tree_greedy_on_chains_equals_chain_greedy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 6, 7, generator=gen)
    drafts = logits[:, :5].argmax(-1)
    flip = torch.rand(64, 5, generator=gen) < 0.3
    drafts = torch.where(flip, (drafts + 1) % 7, drafts)
    counts = torch.randint(0, 6, (64,), generator=gen)
    n_ref, next_ref = greedy_accept(logits, drafts, counts)
    path, n, nxt = tree_greedy_accept(logits, drafts, chain_parents(64, 5), counts)
    assert torch.equal(n, n_ref) and torch.equal(nxt, next_ref)
    for b in range(64):
        assert path[b, : int(n[b])].tolist() == list(range(1, int(n[b]) + 1))


def _chain(gen, name):
    m = torch.rand(V, V, generator=gen) + 0.05
    if name == "zeros":
        m[:, 2] = 0  # token 2 never follows anything: candidates 2 must always be rejected
        m[2] = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    m = m / m.sum(-1, keepdim=True)
    if name == "top-k/top-p processed":
        params = SamplingParams(temperature=0.9, top_k=4, top_p=0.85)
        m = torch.stack([process_logits(torch.log(row), params) for row in m])
    return m


def _tree(last: int, shape: str) -> tuple[list[int], list[int]]:
    """Deterministic candidates after token `last`: (tokens, parents)."""
    a, b, c = (last + 1) % V, (last + 2) % V, (last + 3) % V
    if shape == "chain":
        return [a, b, c], [0, 1, 2]
    if shape == "duplicate siblings":
        return [a, a, b, c, a], [0, 0, 0, 1, 2]
    if shape == "bushy":
        return [a, b, c, 2, a, b], [0, 0, 0, 0, 1, 1]
    if shape == "deep and wide":
        return [a, b, b, c, a, c, 2], [0, 0, 1, 1, 3, 2, 6]
    raise ValueError(shape)


@pytest.mark.parametrize("chain_kind", ["plain", "zeros", "top-k/top-p processed"])
@pytest.mark.parametrize("shape", ["chain", "duplicate siblings", "bushy", "deep and wide"])
def test_tree_sampling_follows_the_target_exactly(chain_kind, shape):
    gen = torch.Generator().manual_seed(hash((chain_kind, shape)) % 1000)
    m = _chain(gen, chain_kind)
    start = 1
    out = [[] for _ in range(N)]
    last = [start] * N
    todo = list(range(N))
    while todo:
        trees = [_tree(last[i], shape) for i in todo]
        k = max(len(t) for t, _ in trees)
        drafts = torch.tensor([t for t, _ in trees])
        parents = torch.tensor([p for _, p in trees])
        counts = torch.full((len(todo),), k)
        node_tokens = torch.cat([torch.tensor([[last[i]] for i in todo]), drafts], dim=1)
        p = m[node_tokens]  # [B, T, V] the target's distribution after each node
        depth = depths(ancestor_mask(parents, counts))  # [B, T]
        fresh = torch.rand(len(todo), k + 1, generator=gen)  # one uniform per output position
        path, n, nxt = sample_match_accept(p, drafts, parents, counts, fresh.gather(1, depth))
        for j, i in enumerate(todo):
            emitted = node_tokens[j, path[j, : int(n[j])]].tolist() + [int(nxt[j])]
            out[i] += emitted
            last[i] = out[i][-1]
        todo = [i for i in todo if len(out[i]) < 3]
    counts3 = np.zeros((V, V, V))
    for row in out:
        counts3[tuple(row[:3])] += 1
    expected = np.zeros((V, V, V))
    for x, y, z in itertools.product(range(V), repeat=3):
        expected[x, y, z] = float(m[start, x] * m[x, y] * m[y, z])
    possible = expected > 0
    assert counts3[~possible].sum() == 0, "a token the target rules out was emitted"
    stat = chisquare(counts3[possible], expected[possible] * N / expected[possible].sum())
    assert stat.pvalue > 1e-4, stat
