"""The parallel EAGLE head (proposers/peagle.py, `leapdecode train peagle`): k drafts in one
head forward from the target's features; greedy output equals transformers' `generate` at
every k from 2 to 8, one head forward a step, a k past the trained one is drafted at that
size with a warning, the folder carries vLLM's parallel-drafting names. (Sampled output:
test_sampling_e2e.py.)"""

import json
import logging
import os

import pytest
import torch

import helpers
from helpers import assert_lossless
from leapdecode import LeapDecoder
from leapdecode.errors import LeapDecodeError
from leapdecode.models.eagle import Eagle3Head

MAX_NEW = 24
TRAINED_K = 8


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target_dir):
    medusa, eagle = helpers.train_heads(target_dir, str(tmp_path_factory.mktemp("pheads")))
    return eagle, helpers.train_peagle(target_dir, eagle, steps=60, k=TRAINED_K)


@pytest.fixture(scope="module")
def dec(target_dir, heads):
    return LeapDecoder.from_pretrained(target_dir, speculators=[heads[1]])


@pytest.fixture(scope="module")
def prompts(dec):
    return helpers.random_prompts(dec.tokenizer, 24, 3, 50, seed=4)


@pytest.fixture(scope="module")
def reference(prompts, hf_target):
    return helpers.greedy_reference(hf_target, prompts, MAX_NEW)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7, 8])
def test_greedy_matches_transformers_generate(dec, prompts, reference, hf_target, k):
    results = dec.generate_batch(prompts, method="peagle", k=k, max_new_tokens=MAX_NEW)
    assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)
    assert 0 < sum(r.stats.accepted for r in results) < sum(r.stats.proposed for r in results)
    # the whole chain from one head forward a step
    assert sum(r.stats.draft_forwards for r in results) <= sum(
        r.stats.decode_steps for r in results
    )


def test_alone_equals_batched_and_mixed_with_other_methods(dec, prompts, reference, hf_target):
    alone = [dec.generate(p, method="peagle", k=4, max_new_tokens=MAX_NEW).token_ids
             for p in prompts[:6]]  # fmt: skip
    batched = dec.generate_batch(prompts[:6], method="peagle", k=4, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in batched] == alone
    methods = ("peagle", "none", "ngram")
    seqs = [dec.request(p, method=methods[i % 3], k=4, max_new_tokens=MAX_NEW)
            for i, p in enumerate(prompts[:9])]  # fmt: skip
    for _ in dec._run(seqs):
        pass
    assert_lossless(prompts[:9], [s.output for s in seqs], reference[:9], hf_target)


def test_a_k_past_the_trained_one_is_drafted_at_that_size_with_a_warning(target_dir, heads,
                                                                         prompts, caplog):  # fmt: skip
    dec = LeapDecoder.from_pretrained(target_dir, speculators=[heads[1]])  # not warned yet
    with caplog.at_level(logging.WARNING, logger="leapdecode"):
        out = dec.generate(prompts[0], method="peagle", k=9, max_new_tokens=MAX_NEW)
    assert len(out.stats.proposed_by_position) == TRAINED_K
    assert f"trained for {TRAINED_K}" in caplog.text


def test_the_folder_is_a_parallel_eagle3_head_by_vllms_names(heads):
    eagle, peagle = heads
    config = json.load(open(os.path.join(peagle, "config.json")))
    assert config["parallel_drafting"] is True and config["pard_max_k"] == TRAINED_K
    assert isinstance(config["pard_token"], int)
    head = Eagle3Head.load(peagle)
    # vLLM's mask_hidden: the aux hidden states of a mask slot, before fc
    assert head.mask_hidden.shape == (len(head.aux_layers) * head.target_hidden,)
    assert torch.equal(head.draft_ids, Eagle3Head.load(eagle).draft_ids)  # --init kept them
    card = open(os.path.join(peagle, "README.md")).read()
    assert "P-EAGLE" in card and "draft position" in card
    acc = config["accuracy"]["top1_by_depth"]
    assert len(acc) == TRAINED_K


def test_errors_say_what_to_do(target_dir, heads, capsys):
    from leapdecode.cli import main

    eagle, peagle = heads
    only_eagle = LeapDecoder.from_pretrained(target_dir, speculators=[eagle])
    with pytest.raises(LeapDecodeError, match=r"needs a parallel EAGLE head.*train peagle"):
        only_eagle.generate("def f():", method="peagle")
    with pytest.raises(LeapDecodeError, match="holds a parallel EAGLE head, not a language model"):
        LeapDecoder.from_pretrained(target_dir, draft=peagle)
    with pytest.raises(LeapDecodeError, match="backend native"):
        LeapDecoder.from_pretrained(target_dir, backend="transformers", speculators=[peagle])
    argv = ["train", "peagle", "--target", target_dir, "--out", peagle + "-x", "--k", "1"]
    assert main(argv) == 2
    assert "--k must be in 2..16" in capsys.readouterr().err
    # a chain of one-hot drafts: block verification is the token rule there, and allowed
    dec = LeapDecoder.from_pretrained(target_dir, speculators=[peagle])
    assert dec.generate("def f():", method="peagle", verify="block", max_new_tokens=4).token_ids


def test_auto_weighs_the_parallel_head_and_stays_lossless(dec, prompts, reference, hf_target):
    with helpers.planned_methods(dec.engine.planner) as used:
        out = dec.generate_batch(prompts, method="auto", auto_methods=("ngram", "peagle"), k=4,
                                 max_new_tokens=MAX_NEW)  # fmt: skip
    assert_lossless(prompts, [r.token_ids for r in out], reference, hf_target)
    assert "peagle" in used


def test_export_writes_vllms_peagle_speculator(tmp_path, tok_dir):
    """`leapdecode export` of a parallel head: speculators type "peagle" (vLLM runs it as
    eagle3 with parallel_drafting), the mask token as mask_token_id, mask_hidden [3 T]."""
    import numpy as np
    from safetensors.torch import load_file

    from leapdecode.speculators_export import export_speculators
    from leapdecode.train.eagle import make_parallel, new_head
    from leapdecode.train.teacher import Teacher

    target_dir = str(tmp_path / "target4")  # vLLM's EAGLE-3 reads three distinct layers
    helpers.make_llama(target_dir, seed=5, tokenizer_dir=tok_dir, num_hidden_layers=4)
    head = new_head(Teacher(target_dir), torch.arange(0, helpers.VOCAB, 3))
    head = make_parallel(head, 4, np.arange(helpers.VOCAB - 1))  # the last id never occurs
    assert head.pard_token == helpers.VOCAB - 1
    with torch.no_grad():
        head.mask_hidden.normal_()
    head.save(str(tmp_path / "peagle"))
    config = export_speculators(str(tmp_path / "peagle"), target_dir, str(tmp_path / "out"),
                                dtype="float32")  # fmt: skip
    assert config["speculators_model_type"] == "peagle"
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["mask_token_id"] == head.pard_token
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(weights["mask_hidden"], head.mask_hidden.detach())
    assert (
        weights["fc.weight"].shape[1] == weights["mask_hidden"].shape[0] == 3 * head.target_hidden
    )


@pytest.mark.parametrize("k", [1, 3])
def test_rows_whose_pairs_were_fed_already_draft_from_the_kept_root(dec, prompts, reference,
                                                                     hf_target, monkeypatch, k):  # fmt: skip
    """With every step's features fed as they arrive (BACKLOG 0), a proposal has no new pair:
    draft 1 comes from the root kept at the last pair, the mask slots still run (k = 3), or
    nothing runs at all (k = 1)."""
    import leapdecode.proposers.eagle as eagle_module

    monkeypatch.setattr(eagle_module, "BACKLOG", -1)
    out = dec.generate_batch(prompts[:8], method="peagle", k=k, max_new_tokens=MAX_NEW)
    assert_lossless(prompts[:8], [r.token_ids for r in out], reference[:8], hf_target)
    assert sum(r.stats.accepted for r in out) > 0
