"""Logits processing matches Hugging Face's warpers; bad sampling parameters are refused."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from leapdecode import LeapDecodeError, SamplingParams
from leapdecode.sampling import process_logits, sample_from


def hf_probs(logits, temperature, top_k, top_p):
    scores = logits[None].clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 64),
    temperature=st.floats(0.1, 3.0),
    top_k=st.integers(0, 70),
    top_p=st.floats(0.05, 1.0),
)
def test_processing_matches_transformers(seed, vocab, temperature, top_k, top_p):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = process_logits(logits, params)
    theirs = hf_probs(logits, temperature, top_k, top_p)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0])
    assert process_logits(logits, SamplingParams()).tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -0.2},
        {"top_k": -1},
        {"seed": 1.5},
    ],
)
def test_bad_parameters_raise_a_value_error(kwargs):
    with pytest.raises(LeapDecodeError) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError)


def test_sample_from_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).repeat(1000, 1)
    u = torch.linspace(0, 1 - 1e-7, 1000)
    picks = sample_from(probs, u)
    assert set(picks.tolist()) == {1, 2}
