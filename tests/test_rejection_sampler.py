"""The rejection sampler's output follows the target distribution p, whatever q proposes,
under the token-level rule and under block verification (verify.py).

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
from leapdecode.verify import block_accept, greedy_accept, rejection_accept

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


RULES = {"token": rejection_accept, "block": block_accept}


def run(p_rows, q_rows, k, gen, rule="token", counts=None):
    """p_rows [k+1, V], q_rows [k, V]: N independent verification rounds (counts [N]: each
    round's drafts, k by default)."""
    p = p_rows[None].expand(N, k + 1, V)
    q = q_rows[None].expand(N, k, V)
    u_draft = torch.rand(N, k, generator=gen)
    drafts = torch.stack([sample_from(q[:, i], u_draft[:, i]) for i in range(k)], dim=1)
    is_one_hot = bool((q_rows.max(-1).values == 1).all())
    u = torch.rand(N, k + 1, generator=gen)
    counts = torch.full((N,), k, dtype=torch.long) if counts is None else counts
    q_arg = None if is_one_hot and rule == "token" else q
    n_acc, nxt = RULES[rule](p, q_arg, drafts, counts, u)
    return drafts, n_acc, nxt


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", CASES)
def test_first_token_follows_p(case, rule):
    gen = torch.Generator().manual_seed(CASES.index(case))
    p, q = make_case(case, gen)
    drafts, n_acc, nxt = run(torch.stack([p, p]), q[None], 1, gen, rule)
    first = torch.where(n_acc >= 1, drafts[:, 0], nxt)
    check_follows(first, p)
    alpha = float(torch.minimum(p, q).sum())
    rate = float((n_acc >= 1).double().mean())
    assert abs(rate - alpha) < 5 * np.sqrt(alpha * (1 - alpha) / N + 1e-12)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", ["dense q", "q zero where p > 0", "one-hot q",
                                  "top-k/top-p processed p"])  # fmt: skip
def test_three_drafts_each_position_follows_its_p(case, rule):
    gen = torch.Generator().manual_seed(100 + CASES.index(case))
    ps = [make_case(case, gen)[0] for _ in range(4)]
    qs = [make_case(case, gen)[1] for _ in range(3)]
    drafts, n_acc, nxt = run(torch.stack(ps), torch.stack(qs), 3, gen, rule)
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


def test_block_rows_that_stop_early_follow_p():
    """A row whose drafter stopped after n < k drafts (a confidence cut-off) is a block of
    its own length: every position still follows its p."""
    gen = torch.Generator().manual_seed(300)
    ps = [_dist(gen) for _ in range(4)]
    qs = [_dist(gen) for _ in range(3)]
    counts = torch.randint(0, 4, (N,), generator=gen)  # 0 .. 3 drafts a row
    drafts, n_acc, nxt = run(torch.stack(ps), torch.stack(qs), 3, gen, "block", counts)
    assert bool((n_acc <= counts).all())
    for i in range(4):
        reached = n_acc >= i
        tok = torch.where(n_acc > i, drafts[:, min(i, 2)], nxt)[reached]
        check_follows(tok, ps[i])


def test_block_keeps_the_papers_toy_example():
    """Sun et al. 2024, section 2: p = [1/3, 2/3], q = [2/3, 1/3] at every position, two
    drafts: the token-level rule keeps 10/9 drafts a step on average, the block rule 11/9."""
    gen = torch.Generator().manual_seed(301)
    p = torch.tensor([1 / 3, 2 / 3] + [0.0] * (V - 2))
    q = torch.tensor([2 / 3, 1 / 3] + [0.0] * (V - 2))
    means = {}
    for rule in RULES:
        gen.manual_seed(301)  # the same drafts and uniforms for both rules
        _, n_acc, _ = run(torch.stack([p] * 3), torch.stack([q] * 2), 2, gen, rule)
        means[rule] = float(n_acc.double().mean())
        sigma = float(n_acc.double().std()) / np.sqrt(N)
    assert abs(means["token"] - 10 / 9) < 5 * sigma
    assert abs(means["block"] - 11 / 9) < 5 * sigma


@pytest.mark.parametrize("seed", range(4))
def test_block_keeps_at_least_as_many_drafts_on_the_same_draws(seed):
    gen = torch.Generator().manual_seed(400 + seed)
    ps = torch.stack([_dist(gen) for _ in range(7)])
    qs = torch.stack([_dist(gen) for _ in range(6)])
    kept = {}
    for rule in RULES:
        gen.manual_seed(500 + seed)
        kept[rule] = run(ps, qs, 6, gen, rule)[1].double()
    diff = kept["block"] - kept["token"]  # paired: the same drafts and uniforms
    assert float(diff.mean()) > -3 * float(diff.std()) / np.sqrt(N)


def test_block_with_one_hot_drafts_keeps_what_the_token_rule_keeps():
    """With one-hot q the block tests telescope: draft i is kept with probability
    p_1(d_1) ... p_i(d_i) under either rule (verify.py)."""
    gen = torch.Generator().manual_seed(600)
    ps = torch.stack([_dist(gen) for _ in range(5)])
    qs = torch.stack([_one_hot(i) for i in (1, 4, 2, 6)])
    for rule in RULES:
        gen.manual_seed(601)
        n_acc = run(ps, qs, 4, gen, rule)[1]
        for i in range(1, 5):
            want = float(torch.prod(torch.tensor([ps[j, int(qs[j].argmax())] for j in range(i)])))
            got = float((n_acc >= i).double().mean())
            assert abs(got - want) < 5 * np.sqrt(want * (1 - want) / N + 1e-12), (rule, i)
