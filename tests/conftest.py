import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import helpers  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tokenizer"))
    helpers.make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory, tok_dir):
    path = str(tmp_path_factory.mktemp("target"))
    helpers.make_llama(path, seed=0, tokenizer_dir=tok_dir)
    return path


@pytest.fixture(scope="session")
def hf_target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir).eval()


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, hf_target, tok_dir):
    path = str(tmp_path_factory.mktemp("draft"))
    helpers.make_noisy_copy(hf_target, path, noise=0.02, seed=1, tokenizer_dir=tok_dir)
    return path


@pytest.fixture(scope="session")
def decoder(target_dir, draft_dir):
    from leapdecode import LeapDecoder

    return LeapDecoder.from_pretrained(target_dir, draft=draft_dir)
