"""Suffix decoding's lookup on characters: the brute-force definition, and the draft right
after an edit that changed the tokens but not the characters' ends."""

from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.config import SpecConfig
from leapdecode.proposers.char_lookup import CharIndex
from leapdecode.proposers.suffix import SuffixProposer
from leapdecode.sampling import SamplingParams
from leapdecode.sequence import Sequence

PIECES = ["a", "b", "ab", "ba", " a", "", "bb"]


def _brute(tokens: list[int], min_chars: int, max_chars: int) -> int:
    text = "".join(PIECES[t] for t in tokens)
    starts, pos = {}, 0  # offset where a token ends -> the index of the next token
    for i, t in enumerate(tokens):
        pos += len(PIECES[t])
        starts[pos] = i + 1
    best = -1
    for n in range(min_chars, min(max_chars, len(text) - 1) + 1):
        ends = [e for e in range(n, len(text)) if text[e - n : e] == text[-n:] and e in starts]
        if not ends:
            break
        best = starts[max(ends)]
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(PIECES) - 1), max_size=40), st.integers(1, 40),
       st.integers(1, 5))  # fmt: skip
def test_match_is_the_latest_longest_suffix_ending_on_a_token_boundary(tokens, cut, min_chars):
    index = CharIndex(PIECES, min_chars=min_chars, max_chars=12, max_tries=10_000)
    index.extend(tokens[:cut])  # in two pieces, as a prompt and then a step's tokens
    index.extend(tokens[cut:])
    assert index.text == "".join(PIECES[t] for t in tokens)
    assert index.match() == _brute(tokens, min_chars, 12)


# a source line `x = fields, globals` and its revision `x = new_fields`, tokenized as
# byte-level BPE does: ` fields` (after a space) is one token, `fields` after `_` another
STRINGS = [" x", " =", " fields", ",", " globals", "\n", " new", "_", "fields"]
X, EQ, SP_FIELDS, COMMA, GLOBALS, NL, SP_NEW, UNDER, FIELDS = range(9)
SOURCE = [X, EQ, SP_FIELDS, COMMA, GLOBALS, NL]
REVISED = [X, EQ, SP_NEW, UNDER, FIELDS]


def _suffix_draft(strings, **spec) -> list[int]:
    prop = SuffixProposer(max_depth=24, max_cached_requests=0)
    prop.token_strings = strings
    tokens = SOURCE + [NL] + REVISED
    seq = Sequence(id=0, tokens=tokens, prompt_len=len(tokens), params=SamplingParams(),
                   max_new_tokens=16, max_context=256, stop_token_ids=frozenset(),
                   spec=SpecConfig(method="suffix", **spec))  # fmt: skip
    prop.add([seq])
    return prop.speculate(seq, 3)[0]


def test_after_an_edit_the_draft_is_what_followed_the_same_characters():
    # `... new_fields` ends with the characters of the source's ` fields`: what followed it
    assert _suffix_draft(STRINGS) == [COMMA, GLOBALS, NL]
    # tokens only: the last token occurs nowhere before
    for draft in (_suffix_draft(None), _suffix_draft(STRINGS, suffix_decoding_char_match=False)):
        assert draft[:3] != [COMMA, GLOBALS, NL]
