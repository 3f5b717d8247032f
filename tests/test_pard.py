"""PARD (proposers/pard.py): a parallel draft proposes k tokens in one forward over
[last token, mask, ..., mask]; greedy output equals transformers' `generate` at every k, a
draft without a mask token is refused with the fix, a k past what it was trained for is
drafted at that size with a warning. (The sampled distribution: test_sampling_e2e.py.)"""

import json
import logging
import shutil

import pytest

import helpers
from helpers import assert_lossless
from leapdecode import LeapDecoder
from leapdecode.errors import LeapDecodeError

MAX_NEW = 32


@pytest.fixture(scope="module")
def pard_dir(tmp_path_factory, draft_dir):
    """The test draft with a mask token (the tokenizer's last id) and a trained-for k of 8."""
    path = tmp_path_factory.mktemp("pard") / "draft"
    shutil.copytree(draft_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.update(pard_token=config["vocab_size"] - 1, pard_max_k=8)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def pard(target_dir, pard_dir):
    return LeapDecoder.from_pretrained(target_dir, draft=pard_dir, speculators=[])


@pytest.fixture(scope="module")
def prompts(pard):
    return helpers.random_prompts(pard.tokenizer, 24, 3, 61, seed=3)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 7, 8])
def test_pard_greedy_matches_transformers_generate(pard, prompts, hf_target, k):
    results = pard.generate_batch(prompts, method="pard", k=k, max_new_tokens=MAX_NEW)
    reference = helpers.greedy_reference(hf_target, prompts, MAX_NEW)
    assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)
    proposed = sum(r.stats.proposed for r in results)
    assert 0 < sum(r.stats.accepted for r in results) < proposed
    # one draft forward a step, plus one to catch up after accepted drafts: never k a step
    steps = sum(r.stats.decode_steps for r in results)
    assert sum(r.stats.draft_forwards for r in results) <= 2 * steps


def test_pard_drafts_the_whole_block_alone_and_in_a_batch(pard, prompts):
    alone = [pard.generate(p, method="pard", k=4, max_new_tokens=MAX_NEW).token_ids
             for p in prompts[:6]]  # fmt: skip
    batched = pard.generate_batch(prompts[:6], method="pard", k=4, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in batched] == alone


def test_a_k_past_the_trained_one_is_drafted_at_that_size_with_a_warning(pard, prompts, caplog):
    with caplog.at_level(logging.WARNING, logger="leapdecode"):
        out = pard.generate(prompts[0], method="pard", k=9, max_new_tokens=MAX_NEW)
    assert len(out.stats.proposed_by_position) == 8
    assert "trained for 8" in caplog.text


def test_a_draft_without_a_mask_token_is_refused_with_the_fix(target_dir, draft_dir):
    dec = LeapDecoder.from_pretrained(target_dir, draft=draft_dir, speculators=[])
    with pytest.raises(LeapDecodeError, match="pard_token or mask_token_id"):
        dec.generate("x = 1", method="pard", k=4, max_new_tokens=4)


def test_train_pard_writes_a_parallel_draft_that_runs(tmp_path, target_dir, draft_dir, hf_target):
    """A tiny `leapdecode train pard` run (random tokens): the folder it writes names its mask
    token and k, and `--method pard` runs on it losslessly."""
    import numpy as np

    from leapdecode.cli import main

    tokens = tmp_path / "tokens.npy"
    rng = np.random.default_rng(0)
    np.save(tokens, rng.integers(1, hf_target.config.vocab_size, 4000).astype(np.uint16))
    out = tmp_path / "pard"
    argv = ["train", "pard", "--draft", draft_dir, "--out", str(out), "--tokens", str(tokens),
            "--steps", "3", "--batch", "2", "--context", "24", "--k", "4",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["pard_max_k"] == 4 and 0 <= config["pard_token"] < config["vocab_size"]
    assert "draft 4" in (out / "README.md").read_text()
    dec = LeapDecoder.from_pretrained(target_dir, draft=str(out), speculators=[])
    prompts = helpers.random_prompts(dec.tokenizer, 4, 3, 30, seed=9)
    results = dec.generate_batch(prompts, method="pard", k=4, max_new_tokens=16)
    reference = helpers.greedy_reference(hf_target, prompts, 16)
    assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)


def test_train_pard_bad_input_is_one_line(capsys, tmp_path, draft_dir):
    from leapdecode.cli import main

    code = main(["train", "pard", "--draft", draft_dir, "--out", str(tmp_path), "--k", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--k must be in 2..32" in err and "Traceback" not in err
    code = main(["train", "pard", "--draft", str(tmp_path / "nope"), "--out", str(tmp_path)])
    assert code == 2 and "not a model folder" in capsys.readouterr().err


def test_a_parallel_draft_of_its_own_is_weighed_by_auto(target_dir, draft_dir, pard_dir, prompts,
                                                         hf_target):  # fmt: skip
    """--pard loads the parallel draft beside the chain draft, each with its own cache: auto
    plans it (and the chain draft) and stays lossless; given only as --draft, the two would
    share one cache, and auto leaves pard out."""
    both = LeapDecoder.from_pretrained(target_dir, draft=draft_dir, pard=pard_dir, speculators=[])
    assert both.engine.proposers["pard"].model is not both.engine.proposers["draft"].model
    # which of two drafts a step takes is the cost model's, measured on this machine (a CI run
    # once had the chain draft win every step): a confident start makes pard worth a try
    both.engine.proposers["pard"].prior = 0.9
    reference = helpers.greedy_reference(hf_target, prompts, MAX_NEW)
    with helpers.planned_methods(both.engine.planner) as used:
        out = both.generate_batch(prompts, method="auto", auto_methods=("draft", "pard"), k=4,
                                  max_new_tokens=MAX_NEW)  # fmt: skip
    assert_lossless(prompts, [r.token_ids for r in out], reference, hf_target)
    assert "pard" in used
    shared = LeapDecoder.from_pretrained(target_dir, draft=pard_dir, speculators=[])
    with helpers.planned_methods(shared.engine.planner) as used:
        out = shared.generate_batch(prompts[:6], method="auto", auto_methods=("draft", "pard"),
                                    k=4, max_new_tokens=MAX_NEW)  # fmt: skip
    assert_lossless(prompts[:6], [r.token_ids for r in out], reference[:6], hf_target)
    assert "pard" not in used


def test_pard_flag_refuses_a_draft_without_a_mask_token(target_dir, draft_dir):
    with pytest.raises(LeapDecodeError, match="is not a parallel draft.*train pard"):
        LeapDecoder.from_pretrained(target_dir, pard=draft_dir, speculators=[])


@pytest.mark.parametrize("argv,loads", [
    (["generate", "x"], False),  # plain decoding never drafts
    (["generate", "--method", "pard", "x"], True),
    (["generate", "--method", "auto", "x"], False),  # auto's default methods leave pard out
    (["generate", "--method", "auto", "--auto-methods", "ngram, pard", "x"], True),
    (["generate", "--method", "pard", "--draft", "D", "x"], False),  # D runs pard itself
    (["demo"], False),
    (["demo", "--methods", "none,pard"], True),
    (["serve"], True),  # requests may ask for it
])  # fmt: skip
def test_the_embedded_parallel_draft_loads_only_where_it_may_run(argv, loads):
    from leapdecode.cli import build_parser
    from leapdecode.cli_args import pard_option
    from leapdecode.paths import PARD_NAME, default_model

    embedded = default_model(PARD_NAME)
    if embedded is None:
        pytest.skip("the embedded parallel draft is not in models/")
    args = build_parser().parse_args(argv)
    assert pard_option(args) == (embedded if loads else None)
    assert pard_option(build_parser().parse_args([*argv[:1], "--pard", "P", *argv[1:]])) == "P"
