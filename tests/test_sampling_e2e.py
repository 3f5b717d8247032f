"""End to end: with sampling, every method (and both verification rules) emits the target's
own distribution.

The exact joint distribution of the first two sampled tokens is computed from the target
with `transformers` (temperature 1.5, top-k 3: at most 9 outcomes), summing the
target's processed probabilities over every prefix. Each method draws
N = 3000 samples (one batch of differently seeded rows); a Pearson chi-square goodness-of-fit
test must give a p-value above 1e-4. Seeds are fixed, so the test is deterministic.
"""

import itertools
import json
import os

import numpy as np
import pytest
import torch

import helpers
from helpers import exact_pairs, gof_pvalue
from leapdecode import LeapDecoder
from leapdecode.sampling import SamplingParams, process_logits

N = 3000
PARAMS = dict(temperature=1.5, top_k=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok_dir):
    """A tiny target whose next token depends on the current token only (attention output
    zeroed: a bigram model), and a noisy copy of it as the draft. Prompt lookup then finds
    drafts that the target may accept, so both its accept and reject paths run."""
    path = str(tmp_path_factory.mktemp("bigram_target"))
    target = helpers.make_llama(path, seed=3, tokenizer_dir=tok_dir)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    target.save_pretrained(path)
    draft_path = str(tmp_path_factory.mktemp("bigram_draft"))
    helpers.make_noisy_copy(target, draft_path, noise=0.5, seed=4, tokenizer_dir=tok_dir)
    config_path = os.path.join(draft_path, "config.json")  # also a parallel draft (pard)
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "pard_token": config["vocab_size"] - 1}, f)
    # heads learn from the target's own samples (self-distillation data, as Medusa-2)
    root = tmp_path_factory.mktemp("bigram_heads")
    plain = LeapDecoder.from_pretrained(path, speculators=[])
    starts = [
        [int(t)]
        for t in torch.randint(1, helpers.VOCAB, (96,), generator=torch.Generator().manual_seed(6))
    ]
    outs = plain.generate_batch(starts, max_new_tokens=64, seed=0, **PARAMS)
    stream = np.array([t for s, o in zip(starts, outs, strict=True) for t in s + o.token_ids])
    np.save(root / "stream.npy", stream)
    heads = helpers.train_heads(path, str(root), steps=150, tokens=str(root / "stream.npy"),
                                lr=0.01)  # fmt: skip
    peagle = helpers.train_peagle(path, heads[1], steps=80, k=4, tokens=str(root / "stream.npy"),
                                  lr=0.01)  # fmt: skip
    speculators = [*heads, peagle]
    # 256 rows decoded together: each row's seed is seed + its index, so batching changes
    # no sample, and N = 3000 rows take a dozen engine batches instead of 188
    dec = LeapDecoder.from_pretrained(path, draft=draft_path, speculators=speculators,
                                      max_num_seqs=256, max_model_len=64)  # fmt: skip
    return target, dec


@pytest.fixture(scope="module")
def hf_target(models):
    return models[0]


@pytest.fixture(scope="module")
def decoder(models):
    return models[1]


@pytest.fixture(scope="module")
def prompt(hf_target):
    """Random tokens, preceded by each likely first token and its likely successor."""
    gen = torch.Generator().manual_seed(5)
    tail = torch.randint(1, hf_target.config.vocab_size, (8,), generator=gen).tolist()
    params = SamplingParams(**PARAMS)
    head = []
    with torch.no_grad():
        p1 = process_logits(hf_target(torch.tensor([tail])).logits[0, -1], params)
        for c in torch.nonzero(p1)[:, 0].tolist():
            head += [c, int(hf_target(torch.tensor([tail + [c]])).logits[0, -1].argmax())]
    return head + tail


@pytest.fixture(scope="module")
def exact(hf_target, prompt):
    return exact_pairs(hf_target, prompt, PARAMS)


def sample_pairs(decoder, prompt, method, seed, sampling=PARAMS, **kw):
    results = decoder.generate_batch(
        [prompt] * N, method=method, k=3, max_new_tokens=4, seed=seed, **sampling, **kw
    )
    return results, [tuple(r.token_ids[:2]) for r in results]


def test_exact_distribution_is_spread(exact):
    assert abs(sum(exact.values()) - 1) < 1e-5
    assert len(exact) >= 4


@pytest.mark.parametrize(
    "method,kw",
    [
        ("none", {}),
        ("draft", {}),
        ("draft", {"draft_min_prob": 0.3}),
        ("draft", {"verify": "token"}),
        ("draft", {"verify": "token", "draft_min_prob": 0.3}),
        ("pard", {}),
        ("pard", {"verify": "token"}),
        ("ngram", {"ngram_min": 1, "verify": "block"}),
        ("ngram", {"ngram_min": 1}),
        ("ngram", {"ngram_min": 1, "use_tree_spec": True}),
        ("suffix", {}),
        ("suffix", {"use_tree_spec": True, "suffix_decoding_min_token_prob": 0.0}),
        ("lookahead", {}),
        ("medusa", {}),
        ("eagle", {}),
        ("eagle", {"speculative_num_steps": 2, "speculative_eagle_topk": 3}),
        ("peagle", {}),
    ],  # fmt: skip
)
def test_first_two_tokens_follow_the_target(decoder, prompt, exact, method, kw):
    results, pairs = sample_pairs(decoder, prompt, method, seed=1000, **kw)
    if method != "none":
        proposed = sum(r.stats.proposed for r in results)
        accepted = sum(r.stats.accepted for r in results)
        assert 0 < accepted < proposed, (accepted, proposed)
    pvalue = gof_pvalue(pairs, exact)
    assert pvalue > 1e-4, f"{method}: chi-square p-value {pvalue:.2e}"


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("verify", ["token", "block"])
def test_draft_chains_follow_the_target_under_either_rule(hf_target, decoder, prompt, verify,
                                                         temperature):  # fmt: skip
    """A draft model's sampled chains, verified token by token or as a block (verify.py),
    at the temperatures users run (top-k 3 keeps the outcomes countable)."""
    sampling = dict(temperature=temperature, top_k=3)
    exact = exact_pairs(hf_target, prompt, sampling)
    results, pairs = sample_pairs(decoder, prompt, "draft", 2000, sampling, verify=verify)
    accepted = sum(r.stats.accepted for r in results)
    assert 0 < accepted < sum(r.stats.proposed for r in results)
    pvalue = gof_pvalue(pairs, exact)
    assert pvalue > 1e-4, f"{verify} at T={temperature}: chi-square p-value {pvalue:.2e}"


def test_seeded_sampling_repeats(decoder, prompt):
    a = decoder.generate(prompt, method="draft", k=3, max_new_tokens=12, seed=7, **PARAMS)
    b = decoder.generate(prompt, method="draft", k=3, max_new_tokens=12, seed=7, **PARAMS)
    assert a.token_ids == b.token_ids


def test_all_outcomes_reachable(exact):
    # Sanity of the fixture itself: outcomes are pairs over at most 3 x 3 tokens.
    firsts = {a for a, _ in exact}
    assert len(firsts) <= 3 and all(len(list(g)) <= 3 for _, g in itertools.groupby(sorted(exact)))


@pytest.mark.parametrize("method,kw", [("ngram", {"ngram_min": 1}),
                                       ("ngram", {"ngram_min": 1, "use_tree_spec": True}),
                                       ("suffix", {}), ("lookahead", {}), ("medusa", {}),
                                       ("eagle", {}), ("peagle", {})])  # fmt: skip
def test_seeded_draftless_methods_emit_what_plain_sampling_emits(decoder, prompt, method, kw):
    """Deterministic drafts are verified by the target's own per-position sample, so a seeded
    request gives the same tokens with or without them (verify.py)."""
    ref = decoder.generate_batch([prompt] * 8, method="none", max_new_tokens=24, seed=11, **PARAMS)
    out = decoder.generate_batch([prompt] * 8, method=method, k=4, max_new_tokens=24, seed=11,
                                 **PARAMS, **kw)  # fmt: skip
    assert sum(r.stats.accepted for r in out) > 0
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
