"""Greedy speculative output equals `transformers` `generate(do_sample=False)`, token for token.

A divergence is tolerated only at a numerical tie: where the target's top-2 logits at that
position differ by less than 1e-4. The test measures that margin; it does not skip.
"""

import pytest

import helpers
from helpers import assert_lossless

N_PROMPTS = 50
MAX_NEW = 32


@pytest.fixture(scope="module")
def prompts(decoder):
    return helpers.random_prompts(decoder.tokenizer, N_PROMPTS, 3, 61, seed=0)


@pytest.fixture(scope="module")
def reference(prompts, hf_target):
    return helpers.greedy_reference(hf_target, prompts, MAX_NEW)


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_matches_transformers_generate(decoder, prompts, reference, hf_target, method, k):
    results = decoder.generate_batch(prompts, method=method, k=k, max_new_tokens=MAX_NEW)
    assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)
    proposed = sum(r.stats.proposed for r in results)
    accepted = sum(r.stats.accepted for r in results)
    if method == "none":
        assert proposed == 0
        assert all(r.stats.decode_steps == len(r.token_ids) - 1 for r in results)
    else:  # both paths (acceptance and rejection) were exercised
        assert 0 < accepted < proposed


TREE_METHODS = [
    ("ngram", {"use_tree_spec": True, "ngram_min": 1}),
    ("suffix", {}),
    ("suffix", {"use_tree_spec": True}),
    ("lookahead", {}),
    (
        "lookahead",
        {"lookahead_window": 4, "lookahead_ngram_size": 4, "lookahead_max_candidates": 2},
    ),
]


@pytest.mark.parametrize("method,kw", TREE_METHODS)
@pytest.mark.parametrize("k", [4, 16])
def test_greedy_draftless_and_tree_methods_match_transformers(
    target_dir, prompts, reference, hf_target, method, kw, k
):
    """Each case on a fresh decoder (the suffix method's global tree starts empty): a first
    pass over the prompts, then a second pass that the first one's outputs can feed."""
    from leapdecode import LeapDecoder

    dec = LeapDecoder.from_pretrained(target_dir)
    rates = []
    for _ in range(2):
        results = dec.generate_batch(prompts, method=method, k=k, max_new_tokens=MAX_NEW, **kw)
        assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)
        proposed = sum(r.stats.proposed for r in results)
        accepted = sum(r.stats.accepted for r in results)
        assert 0 < proposed
        rates.append(accepted / sum(r.stats.decode_steps for r in results))
    if method == "suffix":  # the second pass drafts from the first one's outputs
        assert rates[1] > rates[0] + 0.5, rates
    else:
        assert rates[1] > 0, rates


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_one_prompt_at_a_time(decoder, prompts, reference, hf_target, method):
    outputs = [decoder.generate(p, method=method, k=4, max_new_tokens=MAX_NEW).token_ids
               for p in prompts[:20]]  # fmt: skip
    assert_lossless(prompts[:20], outputs, reference[:20], hf_target)


def test_transformers_backend_is_lossless_too(target_dir, draft_dir, prompts, reference, hf_target):
    from leapdecode import LeapDecoder

    dec = LeapDecoder.from_pretrained(target_dir, draft=draft_dir, backend="transformers")
    outputs = [dec.generate(p, method="draft", k=4, max_new_tokens=MAX_NEW).token_ids
               for p in prompts[:10]]  # fmt: skip
    assert_lossless(prompts[:10], outputs, reference[:10], hf_target)


def test_draft_confidence_cut_off_is_lossless_and_drafts_less(
    decoder, prompts, reference, hf_target
):
    full = decoder.generate_batch(prompts, method="draft", k=8, max_new_tokens=MAX_NEW)
    cut = decoder.generate_batch(
        prompts, method="draft", k=8, max_new_tokens=MAX_NEW, draft_min_prob=0.6
    )
    assert_lossless(prompts, [r.token_ids for r in cut], reference, hf_target)
    per_step = [sum(r.stats.proposed for r in rs) / sum(r.stats.decode_steps for r in rs)
                for rs in (full, cut)]  # fmt: skip
    assert per_step[1] < per_step[0]  # the cut-off shortened some steps' drafts
