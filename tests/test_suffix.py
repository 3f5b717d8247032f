"""Suffix decoding's count tries: counts, removal, FIFO eviction, drafts, and the global tree."""

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.bench.repeated import write as write_repeated
from leapdecode.config import SpecConfig
from leapdecode.proposers.suffix import SuffixProposer, SuffixTree
from leapdecode.sampling import SamplingParams
from leapdecode.sequence import Sequence


def _counts(tree: SuffixTree) -> dict[tuple, int]:
    out = {}

    def walk(node, path):
        for child in node.children.values():
            edge = tuple(child.token(o) for o in range(child.length))
            for o in range(1, len(edge) + 1):  # every string along an edge has its count
                out[path + edge[:o]] = child.count
            walk(child, path + edge)

    walk(tree.root, ())
    return out


def _brute(seqs: list[list[int]], depth: int) -> dict[tuple, int]:
    """How many (sequence, start) pairs have each substring of length <= depth."""
    out: dict[tuple, int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


@pytest.mark.parametrize("seed,vocab,depth", [(0, 4, 5), (1, 2, 8), (2, 30, 6), (3, 3, 24)])
def test_counts_match_brute_force_after_appends_and_removals(seed, vocab, depth):
    rng = random.Random(seed)
    tree = SuffixTree(max_depth=depth)
    seqs = {i: [rng.randrange(vocab) for _ in range(rng.randrange(5, 60))] for i in range(6)}
    seqs[6] = seqs[0][:20] * 3  # long repeats: shared edges split, tails grow
    for sid, toks in seqs.items():
        for a in range(0, len(toks), 7):  # appended in pieces, as a request grows
            tree.extend(sid, toks[a : a + 7])
    assert _counts(tree) == _brute(list(seqs.values()), depth)
    for sid in (1, 4, 6):
        tree.remove(sid)
        del seqs[sid]
    assert _counts(tree) == _brute(list(seqs.values()), depth)
    tree.extend(9, seqs[0])  # a sequence again, after removals
    seqs[9] = seqs[0]
    assert _counts(tree) == _brute(list(seqs.values()), depth)
    assert tree.root.count == sum(len(s) for s in seqs.values())


class _TokenByToken(SuffixTree):
    """The reference: an empty trie filled one token at a time, as extend() grows a trie."""

    def _fill(self, sid, new):
        self.tokens[sid], self.active[sid] = [], deque()
        self.extend(sid, new)


def _same_trie(a: SuffixTree, b: SuffixTree, sid) -> None:
    """Node for node: edges, counts, stamps, latest occurrences; and the growing suffixes."""
    pairs = {id(a.root): b.root}

    def walk(x, y):
        assert sorted(x.children) == sorted(y.children)
        for tok, cx in x.children.items():
            cy = y.children[tok]
            assert (cx.count, cx.stamp, cx.start, cx.length) == (
                cy.count, cy.stamp, cy.start, cy.length)  # fmt: skip
            assert (cx.src is a.tokens[sid]) == (cy.src is b.tokens[sid])
            pairs[id(cx)] = cy
            walk(cx, cy)

    walk(a.root, b.root)
    assert a.root.count == b.root.count and a.tokens[sid] == b.tokens[sid]
    assert [pairs[id(n)] for n in a.active[sid]] == list(b.active[sid])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.lists(st.integers(0, 4), max_size=80),
       st.lists(st.lists(st.integers(0, 4), max_size=6), max_size=6))  # fmt: skip
def test_a_prompt_filled_at_once_is_the_trie_token_by_token(vocab, depth, prompt, pieces):
    """extend() of an empty trie takes a prompt suffix by suffix (_fill): the trie must be the
    one token-by-token appends build, and grow the same way after it."""
    prompt = [t % vocab for t in prompt]
    fast, slow = SuffixTree(depth), _TokenByToken(depth)
    fast.extend(0, prompt)
    slow.extend(0, prompt)
    _same_trie(fast, slow, 0)
    for piece in pieces:  # a request's accepted tokens, step by step
        piece = [t % vocab for t in piece]
        fast.extend(0, piece)
        slow.extend(0, piece)
    _same_trie(fast, slow, 0)
    for m, at in fast.own_matches(0):
        assert fast.draft(at, 8, 0.1, False) == slow.draft(slow.own_matches(0)[m - 1][1], 8,
                                                           0.1, False)  # fmt: skip


@pytest.mark.parametrize("seed,vocab,depth", [(0, 3, 6), (1, 2, 24), (2, 40, 8)])
def test_own_matches_are_the_walks_from_the_root(seed, vocab, depth):
    """A request's matches against its own trie come from the nodes its growing suffixes end
    at, without walking: they must be exactly what walking each suffix from the root finds."""
    rng = random.Random(seed)
    tree = SuffixTree(max_depth=depth)
    text: list[int] = []
    for _ in range(40):  # appended in pieces, repeats included (edges split, tails grow)
        piece = text[-rng.randrange(1, 9) :] if text and rng.random() < 0.4 else []
        piece = piece or [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        tree.extend(0, piece)
        text += piece
        walked = list(tree.match(text[-depth:]))
        assert [(m, at[0], at[1]) for m, at in tree.own_matches(0)] == [
            (m, at[0], at[1]) for m, at in walked
        ]


def test_path_draft_follows_the_most_frequent_continuation():
    tree = SuffixTree(max_depth=8)
    tree.extend(0, [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2])
    (m, node), *_ = [x for x in tree.match([1, 2]) if x[0] == 2]
    assert m == 2
    tokens, parents, score = tree.draft(node, 4, 0.0, tree=False)
    # p(3 | 1 2) = 3/4 (the live suffix counts too), then 2/3, then a tie of 4 -> 1 and
    # 4 -> 9 (the more recent wins), then 1 for sure
    assert tokens == [3, 4, 9, 1] and parents == [0, 1, 2, 3]
    assert score == pytest.approx(3 / 4 + 1 / 2 + 1 / 4 + 1 / 4)
    tokens, parents, _ = tree.draft(node, 4, 0.0, tree=True)
    assert tokens[:3] == [3, 4, 5] and parents[:3] == [0, 1, 1]  # best-first: 3, then 4 and 5
    assert tree.draft(node, 4, 0.9, tree=False)[0] == []  # 3/4 < 0.9: nothing


def _seq(i, tokens, **spec):
    return Sequence(id=i, tokens=list(tokens), prompt_len=len(tokens), params=SamplingParams(),
                    max_new_tokens=64, max_context=256, stop_token_ids=frozenset(),
                    spec=SpecConfig(method="suffix", **spec))  # fmt: skip


def test_global_tree_serves_later_requests_and_evicts_fifo():
    prop = SuffixProposer(max_depth=16, max_cached_requests=2)
    out = [7, 8, 9, 10, 11, 12, 13, 14]
    a = _seq(0, [1, 2, 3])
    prop.add([a])
    a.tokens += out
    prop.remove([a])  # finished: its output stays in the global tree
    b = _seq(1, [5, 7, 8, 9])  # a new request whose text meets that output
    prop.add([b])
    tokens, _, _ = prop.speculate(b, 8)
    assert tokens[:3] == [10, 11, 12]
    prop.remove([b])
    for i in (2, 3):
        s = _seq(i, [40 + i])
        prop.add([s])
        prop.remove([s])
    assert 0 not in prop.global_order and 0 not in prop.global_tree  # evicted, oldest first
    c = _seq(4, [5, 7, 8, 9])
    prop.add([c])
    assert prop.speculate(c, 8)[0] == []


def test_a_frozen_global_tree_holds_only_what_the_benchmark_caches():
    """The sequential benchmark freezes the global tree: a prompt's own runs never enter it
    (a repeat must not meet its earlier output), only outputs cached after each prompt."""
    prop = SuffixProposer(max_depth=16)
    prop.frozen = True
    out = [7, 8, 9, 10, 11, 12, 13, 14]
    a = _seq(0, [1, 2, 3])
    prop.add([a])
    a.tokens += out
    prop.remove([a])
    assert not prop.global_order and prop.global_tree.root.count == 0
    b = _seq(1, [5, 7, 8, 9])
    prop.add([b])
    assert prop.speculate(b, 8)[0] == []  # nothing to replay
    prop.remove([b])
    prop.cache_output(out)  # what an earlier request wrote, as a server would have it
    c = _seq(2, [5, 7, 8, 9])
    prop.add([c])
    assert prop.speculate(c, 8)[0][:3] == [10, 11, 12]


def test_requests_of_other_methods_cost_the_suffix_proposer_nothing():
    prop = SuffixProposer()
    s = _seq(0, [1, 2, 3])
    s = Sequence(**{**s.__dict__, "spec": SpecConfig(method="ngram")})
    prop.add([s])
    assert not prop.local and not prop.global_order


def test_repeated_bench_report(tmp_path):
    per = [{"id": f"r{i}", "tokens": 10, "seconds": 1.0, "mean_accepted_tokens": 1 + i / 10,
            "acceptance_rate": 0.5} for i in range(8)]  # fmt: skip
    paths = write_repeated({"suffix (global tree)": per, "ngram": per[::-1]},
                           {"target": "t", "requests": 8, "k": 16, "threads": 1,
                            "torch": "x"}, str(tmp_path))  # fmt: skip
    md = open(paths["markdown"]).read()
    assert "| suffix (global tree) | 1.05 | 1.65 |" in md
    assert open(paths["plot"], "rb").read()[:4] == b"\x89PNG"


def test_running_requests_are_never_evicted_from_the_global_tree():
    prop = SuffixProposer(max_depth=8, max_cached_requests=1)
    a, b = _seq(0, [1, 2, 3]), _seq(1, [4, 5, 6])
    prop.add([a, b])  # both running: the cache holds both for now
    assert list(prop.global_order) == [0, 1]
    prop.remove([a])
    c = _seq(2, [7, 8])
    prop.add([c])  # a has finished: it goes; b still runs and stays
    assert list(prop.global_order) == [1, 2]


def test_lookahead_steps_have_the_size_of_their_window_and_candidates():
    from leapdecode.errors import LeapDecodeError

    spec = SpecConfig(method="lookahead")  # W = N = G = 3
    assert spec.k == spec.k_at(8) == 2 + 3 + 6
    with pytest.raises(LeapDecodeError, match="more than 64"):
        SpecConfig(method="lookahead", lookahead_window=16, lookahead_ngram_size=6)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(0, 3), min_size=1, max_size=60),
       st.integers(1, 12), st.booleans())  # fmt: skip
def test_a_draft_skips_only_the_suffixes_with_nothing_after_them(vocab, text, k, tree):
    """_speculate stops at the first own suffix the text holds once (at its end, so nothing
    follows it, nor any longer suffix): its draft must be the best over every match."""
    text = [t % vocab for t in text]
    prop = SuffixProposer(max_depth=12, max_cached_requests=0)
    seq = _seq(0, text, use_tree_spec=tree)
    prop.add([seq])
    got = prop.speculate(seq, k)
    local, spec = prop.local[0], seq.spec
    best = ([], [], 0.0)
    for m, at in sorted(local.own_matches(0), key=lambda x: -x[0]):  # every match, as vLLM
        limit = min(k, int(m * spec.suffix_decoding_max_spec_factor + 1e-6))
        if limit <= best[2]:
            break
        d = local.draft(at, limit, spec.suffix_decoding_min_token_prob, tree)
        if d[2] > best[2] or (d[2] == best[2] and len(d[0]) > len(best[0])):
            best = d
    assert got == best
