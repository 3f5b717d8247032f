"""Suffix decoding's count tries: counts, removal, FIFO eviction, drafts, and the global tree."""

import random

import pytest

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
