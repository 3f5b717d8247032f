"""The rejection sampler's output follows the target distribution p, whatever q proposes.

Statistical test: Pearson chi-square goodness of fit of the emitted token's histogram
(N = 200,000 draws per case) against p, cells with p = 0 must stay empty; we require a
p-value above 1e-4 (seeds are fixed, so the test is deterministic). The acceptance rate
of the first draft must match its theoretical value sum_x min(p(x), q(x)) within 5 sigma.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from leapdecode.sampling import SamplingParams, process_logits, sample_from
from leapdecode.verify import greedy_accept, rejection_accept

N = 200_000
V = 8


def _dist(gen, zeros=()):
    x = torch.rand(V, generator=gen) + 0.05
    x[list(zeros)] = 0
    return x / x.sum()


def _one_hot(i):
    return torch.nn.functional.one_hot(torch.tensor(i), V).float()


def make_case(name, gen):
    if name == "dense q":
        return _dist(gen), _dist(gen)
    if name == "one-hot q":
        return _dist(gen), _one_hot(3)
    if name == "one-hot q on a token p rules out":
        return _dist(gen, zeros=[5]), _one_hot(5)
    if name == "q zero where p > 0":
        return _dist(gen), _dist(gen, zeros=[0, 1, 2, 6])
    if name == "top-k/top-p processed p":
        logits = torch.randn(V, generator=gen)
        p = process_logits(logits, SamplingParams(temperature=1.2, top_k=5, top_p=0.8))
        assert 2 <= int((p > 0).sum()) <= 5
        return p, _dist(gen)
    if name == "q equals p":
        p = _dist(gen)
        return p, p.clone()
    raise ValueError(name)


CASES = [
    "dense q",
    "one-hot q",
    "one-hot q on a token p rules out",
    "q zero where p > 0",
    "top-k/top-p processed p",
    "q equals p",
]


def check_follows(samples: torch.Tensor, p: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=V).double().numpy()
    expected = p.double().numpy() * counts.sum()
    zero = expected == 0
    assert counts[zero].sum() == 0, "a token with p = 0 was emitted"
    if (~zero).sum() == 1:
        return
    stat = chisquare(counts[~zero], expected[~zero] * counts[~zero].sum() / expected[~zero].sum())
    assert stat.pvalue > 1e-4, f"chi-square p-value {stat.pvalue:.2e}: output does not follow p"


def run(p_rows, q_rows, k, gen):
    """p_rows [k+1, V], q_rows [k, V]: N independent verification rounds."""
    p = p_rows[None].expand(N, k + 1, V)
    q = q_rows[None].expand(N, k, V)
    u_draft = torch.rand(N, k, generator=gen)
    drafts = torch.stack([sample_from(q[:, i], u_draft[:, i]) for i in range(k)], dim=1)
    is_one_hot = bool((q_rows.max(-1).values == 1).all())
    u = torch.rand(N, k + 1, generator=gen)
    counts = torch.full((N,), k, dtype=torch.long)
    n_acc, nxt = rejection_accept(p, None if is_one_hot else q, drafts, counts, u)
    return drafts, n_acc, nxt


@pytest.mark.parametrize("case", CASES)
def test_first_token_follows_p(case):
    gen = torch.Generator().manual_seed(CASES.index(case))
    p, q = make_case(case, gen)
    drafts, n_acc, nxt = run(torch.stack([p, p]), q[None], 1, gen)
    first = torch.where(n_acc >= 1, drafts[:, 0], nxt)
    check_follows(first, p)
    alpha = float(torch.minimum(p, q).sum())
    rate = float((n_acc >= 1).double().mean())
    assert abs(rate - alpha) < 5 * np.sqrt(alpha * (1 - alpha) / N + 1e-12)


@pytest.mark.parametrize("case", ["dense q", "q zero where p > 0", "one-hot q"])
def test_three_drafts_each_position_follows_its_p(case):
    gen = torch.Generator().manual_seed(100 + CASES.index(case))
    ps = [make_case(case, gen)[0] for _ in range(4)]
    qs = [make_case(case, gen)[1] for _ in range(3)]
    drafts, n_acc, nxt = run(torch.stack(ps), torch.stack(qs), 3, gen)
    # Token i of the step's output, among the rounds that emitted at least i + 1 tokens.
    for i in range(3):
        reached = n_acc >= i  # the output has a token at position i
        tok = torch.where(n_acc > i, drafts[:, i], nxt)[reached]
        check_follows(tok, ps[i])
    bonus = nxt[n_acc == 3]
    check_follows(bonus, ps[3])


def test_no_drafts_samples_from_p():
    gen = torch.Generator().manual_seed(7)
    p = _dist(gen)
    n_acc, nxt = rejection_accept(
        p[None, None].expand(N, 1, V),
        None,
        torch.zeros(N, 0, dtype=torch.long),
        torch.zeros(N, dtype=torch.long),
        torch.rand(N, 1, generator=gen),
    )
    assert int(n_acc.sum()) == 0
    check_follows(nxt, p)


def test_greedy_accepts_longest_agreeing_prefix():
    logits = torch.full((3, 4, 5), -1.0)
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0]])
    logits.scatter_(2, argmax[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 0], [1, 2, 3], [0, 0, 0]])
    counts = torch.tensor([3, 3, 1])  # the last row has one real draft, then padding
    n_acc, nxt = greedy_accept(logits, drafts, counts)
    assert n_acc.tolist() == [2, 3, 1]
    assert nxt.tolist() == [3, 4, 0]
