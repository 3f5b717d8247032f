"""The method registry: a proposer added in one file (tests/toy_proposer.py) runs through the
engine, the planner and `auto`, is checked like the built-in ones, and leaves no trace once
removed."""

import pytest

import helpers
from leapdecode import LeapDecoder
from leapdecode.config import SpecConfig
from leapdecode.engine import CostModel
from leapdecode.errors import LeapDecodeError
from leapdecode.proposers import registry

MAX_NEW = 24


@pytest.fixture(scope="module")
def echo():
    import toy_proposer

    yield toy_proposer.METHOD
    registry.unregister("echo")


@pytest.fixture(scope="module")
def echo_decoder(echo, target_dir):
    dec = LeapDecoder.from_pretrained(target_dir, max_num_seqs=8)
    # step costs under which drafting pays (verify rows nearly free), not measured: what auto
    # plans here must not follow the machine's load (a busy machine's profile made auto plan
    # no drafts); test_engine tests the costs' side
    dec.engine.planner.cost = CostModel(
        (1, 8), (1, 2), ((0.01, 0.0101), (0.02, 0.0208)), (0.0005, 0.0006)
    )
    return dec


@pytest.fixture(scope="module")
def prompts(echo_decoder):
    return helpers.random_prompts(echo_decoder.tokenizer, 8, 4, 40, seed=5)


@pytest.fixture(scope="module")
def reference(prompts, hf_target):
    return helpers.greedy_reference(hf_target, prompts, MAX_NEW)


def test_a_registered_method_is_a_method_like_the_others(echo, echo_decoder):
    assert "echo" in registry.names() and "echo" in registry.auto_choices()
    assert "echo" not in registry.auto_default()  # auto weighs it only when asked to
    assert SpecConfig(method="echo").method == "echo"
    assert SpecConfig(method="auto", auto_methods="ngram,echo").auto_methods == ("ngram", "echo")
    assert "echo" in echo_decoder.engine.proposers
    assert "echo" in echo_decoder.engine.planner.methods  # on auto's method axis
    registry.check(SpecConfig(method="echo"), **echo_decoder.engine.capabilities())
    with pytest.raises(LeapDecodeError, match="not loaded"):
        registry.check(SpecConfig(method="echo"), backend="native", loaded=["none", "ngram"])


def test_the_new_method_alone_and_under_auto_is_lossless(echo_decoder, prompts, reference,
                                                         hf_target):  # fmt: skip
    fixed = echo_decoder.generate_batch(prompts, method="echo", k=4, max_new_tokens=MAX_NEW)
    helpers.assert_lossless(prompts, [r.token_ids for r in fixed], reference, hf_target)
    assert sum(r.stats.proposed for r in fixed) > 0  # it drafted
    with helpers.planned_methods(echo_decoder.engine.planner) as used:
        auto = echo_decoder.generate_batch(
            prompts, method="auto", k=4, max_new_tokens=MAX_NEW, auto_methods=("echo",)
        )
    helpers.assert_lossless(prompts, [r.token_ids for r in auto], reference, hf_target)
    assert "echo" in used  # auto planned it from its offers
    # and learnt its acceptance like any method's
    assert any(key[0] == "echo" for key in echo_decoder.engine.planner.global_rate)


def test_an_unregistered_method_is_refused_with_the_list(echo):
    registry.unregister("echo")
    try:
        with pytest.raises(LeapDecodeError, match="use one of none, ngram"):
            SpecConfig(method="echo")
    finally:
        registry.register(echo)
