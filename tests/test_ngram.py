"""The prompt-lookup index: registering a text at once (a prompt) or a few tokens at a time
(decode steps) leaves the same first and latest occurrence of every n-gram as a plain scan."""

from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.proposers.ngram import NgramIndex


def scan(tokens: list[int], min_n: int, max_n: int) -> dict[int, dict[tuple, tuple[int, int]]]:
    """n -> n-gram -> (first, latest) start of the token after it, by a per-token scan."""
    out: dict[int, dict[tuple, tuple[int, int]]] = {n: {} for n in range(min_n, max_n + 1)}
    for j in range(1, len(tokens)):
        for n, table in out.items():
            if j >= n:
                key = tuple(tokens[j - n : j])
                table[key] = (table[key][0], j) if key in table else (j, j)
    return out


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=120),
    prompt=st.integers(0, 120),
    chunks=st.lists(st.integers(1, 6), max_size=60),
    sizes=st.sampled_from([(1, 1), (2, 4), (1, 3), (3, 5)]),
)
def test_index_matches_a_scan_however_the_text_arrives(tokens, prompt, chunks, sizes):
    index = NgramIndex(*sizes)
    at = min(prompt, len(tokens))
    index.sync(tokens[:at])
    for step in chunks:
        at = min(len(tokens), at + step)
        index.sync(tokens[:at])
    index.sync(tokens)
    want = scan(tokens, *sizes)
    for n, table in want.items():
        assert index.first[n] == {key: f for key, (f, _) in table.items()}
        assert index.latest[n] == {key: last for key, (_, last) in table.items()}


def test_lookup_copies_the_latest_occurrence_or_the_source():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    index.sync(tokens)
    assert index.lookup(tokens, 2) == [4, 5]  # the only earlier occurrence
    tokens += [4]
    index.sync(tokens)
    # [2, 3, 4] occurred at 1..3 (then 5 followed) and is the suffix itself now
    assert index.lookup(tokens, 3) == [5, 9, 1]
