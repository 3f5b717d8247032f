"""The committed pair in models/: loadable by transformers, and the native backend's greedy
output equals transformers' own on it."""

import os

import pytest
import torch

from leapdecode import LeapDecoder
from leapdecode.cli import DEFAULT_MODELS

TARGET = os.path.join(DEFAULT_MODELS, "leap-code-target")
DRAFT = os.path.join(DEFAULT_MODELS, "leap-code-draft")
PROMPTS = [
    "import os\n\n\ndef read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    '"""Utilities for parsing configuration files."""\n\nimport re\n',
]

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DRAFT, "config.json")),
    reason="the embedded models are not committed yet (issue: embedded default models)",
)


@pytest.fixture(scope="module")
def hf_pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(TARGET)
    assert AutoTokenizer.from_pretrained(DRAFT).get_vocab() == tok.get_vocab()
    return target, draft, tok


@pytest.fixture(scope="module")
def decoder():
    return LeapDecoder.from_pretrained(TARGET, draft=DRAFT, dtype="float32")


def test_native_greedy_equals_transformers(hf_pair, decoder):
    target, _, tok = hf_pair
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = target.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
        want = ref[0, len(ids) :].tolist()
        for method in ("none", "draft", "ngram"):
            got = decoder.generate(ids, method=method, k=4, max_new_tokens=32).token_ids
            assert got == want, (prompt, method)


def test_cli_defaults_to_the_embedded_pair(capsys):
    import json

    from leapdecode.cli import main

    code = main(["generate", "--method", "draft", "--max-new-tokens", "6", "--json", "def f(x):"])
    out, err = capsys.readouterr()
    assert code == 0, err
    obj = json.loads(out)
    assert len(obj["token_ids"]) <= 6 and obj["stats"]["draft_forwards"] > 0


def test_bfloat16_speculation_equals_plain_decoding_and_transformers_up_to_ties():
    """In bfloat16 (`--dtype bfloat16`, the usual choice on CUDA): every method emits what
    `none` emits, and `none` emits what transformers does, except after a top-2 tie."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leapdecode.bench.lossless import first_difference, tie_tolerance

    dec = LeapDecoder.from_pretrained(TARGET, draft=DRAFT, dtype="bfloat16")
    assert dec.target.dtype == dec.draft.dtype == torch.bfloat16
    # the target's verify rows hold a one-row step's bits; the draft's need not (cheaper)
    assert dec.target.exact_rows and not dec.draft.exact_rows
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(TARGET)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        plain = dec.generate(ids, method="none", max_new_tokens=48).token_ids
        for method, k in (("draft", 3), ("ngram", 8)):
            assert dec.generate(ids, method=method, k=k, max_new_tokens=48).token_ids == plain
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
        want = ref[0, len(ids) :].tolist()
        pos = first_difference(plain, want)
        if pos is not None:
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([ids + want[:pos]])).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            assert float(top[0] - top[1]) <= tie_tolerance(float(top[0]), torch.bfloat16), prompt


# Functions written for this test (so never seen in training), in the corpus' style.
COPY_FUNCTIONS = [
    '''def merge_ranges(ranges):
    """Merge overlapping (start, stop) ranges; return them sorted."""
    merged = []
    for start, stop in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged
''',
    """def count_words(path, encoding="utf-8"):
    counts = {}
    with open(path, encoding=encoding) as f:
        for line in f:
            for word in line.split():
                word = word.strip(".,;:!?").lower()
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return counts
""",
    """def parse_header(line):
    if ":" not in line:
        raise ValueError("malformed header: %r" % (line,))
    name, _, value = line.partition(":")
    name = name.strip().lower()
    value = value.strip()
    if not name:
        raise ValueError("empty header name")
    return name, value
""",
]


def test_embedded_target_copies_a_function_asked_for_unchanged(decoder):
    """The copying the mission rests on (code revision mirrors its input): asked for a
    function again, the target writes out most of it before its first departure. A pin of
    what the committed target does (measured: 58 of 99, 11 of 70 and 69 of 69 tokens), not
    the project's bar (80% over 24 held-out functions; the model card says it is not met)."""
    from leapdecode.bench.lossless import first_difference
    from leapdecode.code_edits import copy_prompt

    shares = []
    for code in COPY_FUNCTIONS:
        prompt, rest = copy_prompt(code)
        want = decoder.tokenizer.encode(rest, add_special_tokens=False)
        got = decoder.generate(prompt, method="ngram", k=8, max_new_tokens=len(want)).token_ids
        same = first_difference(got, want)
        shares.append(1.0 if same is None else same / len(want))
    assert max(shares) == 1.0 and sum(shares) / len(shares) >= 0.5, shares


def test_embedded_heads_are_lossless(hf_pair):
    """The committed Medusa, EAGLE and parallel EAGLE heads beside the target, and the
    committed parallel draft: greedy output equals transformers' own."""
    from leapdecode.models.heads import beside
    from leapdecode.paths import PARD_NAME, default_model

    heads = beside(TARGET)
    assert {os.path.basename(p) for p in heads} == {
        "leap-code-target-medusa",
        "leap-code-target-eagle",
        "leap-code-target-peagle",
    }
    target, _, tok = hf_pair
    dec = LeapDecoder.from_pretrained(
        TARGET, dtype="float32", speculators=heads, pard=default_model(PARD_NAME)
    )
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = target.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
        want = ref[0, len(ids) :].tolist()
        for method in ("medusa", "eagle", "peagle", "pard"):
            got = dec.generate(ids, method=method, k=8, max_new_tokens=32).token_ids
            assert got == want, (prompt, method)


def test_suffix_on_a_revision_is_lossless_and_matches_characters(hf_pair, decoder):
    """A revision (rename an argument) through suffix decoding with its matching on the
    text's characters on (the decoder gives it every token's characters): greedy output
    equals transformers' own."""
    import random

    from leapdecode.code_edits import candidates, revision

    target, _, tok = hf_pair
    suffix = decoder.engine.proposers["suffix"]
    assert suffix.token_strings is not None and len(suffix.token_strings) == target.vocab_size
    for code in COPY_FUNCTIONS[:2]:
        (_, snippet, names), *_ = candidates(code, min_lines=3)
        prompt, _, _ = revision(snippet, names, random.Random(0))
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = target.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
        got = decoder.generate(ids, method="suffix", k=16, max_new_tokens=48)
        assert got.token_ids == ref[0, len(ids) :].tolist()
        assert got.stats.accepted > 0
