"""The Python API: results, streaming, stop conditions, and ValueError for bad input."""

import pytest
import torch

import helpers
from leapdecode import LeapDecodeError, LeapDecoder


def test_generate_returns_text_ids_reason_and_stats(decoder):
    out = decoder.generate("def add(a, b):", method="draft", k=4, max_new_tokens=20)
    assert out.token_ids and len(out.token_ids) <= 20
    assert out.text == decoder.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason in ("length", "stop")
    s = out.stats
    assert s.new_tokens == len(out.token_ids)
    assert s.target_forwards == s.decode_steps + 1  # + the prefill
    assert s.proposed >= s.accepted >= 0
    assert s.mean_accepted_tokens == pytest.approx((s.accepted + s.decode_steps) / s.decode_steps)
    assert len(s.as_dict()["acceptance_by_position"]) == 4


def test_token_id_prompt_equals_text_prompt(decoder):
    text = "class Stack:\n    def push(self, x):"
    ids = decoder.tokenizer.encode(text)
    a = decoder.generate(text, method="ngram", max_new_tokens=16)
    b = decoder.generate(ids, method="ngram", max_new_tokens=16)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_stream_concatenates_to_generate(decoder, method):
    prompt = "def fib(n):\n    if n < 2:\n        return n\n"
    pieces = list(decoder.stream(prompt, method=method, k=3, max_new_tokens=24))
    full = decoder.generate(prompt, method=method, k=3, max_new_tokens=24)
    assert "".join(pieces) == full.text
    assert len(pieces) >= 2


def test_stop_token_ids_and_eos(decoder):
    base = decoder.generate("import os\n", method="ngram", max_new_tokens=20)
    stop_at = base.token_ids[5]
    first = base.token_ids.index(stop_at)
    out = decoder.generate(
        "import os\n", method="draft", k=4, max_new_tokens=20, stop_token_ids=[stop_at]
    )
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: first + 1]


def test_stop_string_cuts_the_text(decoder):
    base = decoder.generate("def f(x):", method="none", max_new_tokens=30)
    stop = base.text[10:13]
    assert stop
    out = decoder.generate("def f(x):", method="ngram", max_new_tokens=30, stop=stop)
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert base.text.startswith(out.text)
    streamed = "".join(decoder.stream("def f(x):", method="ngram", max_new_tokens=30, stop=stop))
    assert streamed == out.text


def test_padded_draft_vocabulary_is_fine(tmp_path_factory, tok_dir, target_dir, hf_target):
    """A draft whose embedding is padded past the tokenizer still works, losslessly."""
    path = str(tmp_path_factory.mktemp("padded_draft"))
    helpers.make_llama(path, seed=11, tokenizer_dir=tok_dir, vocab_size=helpers.VOCAB + 64)
    dec = LeapDecoder.from_pretrained(target_dir, draft=path)
    ids = dec.tokenizer.encode("for i in range(3):")
    out = dec.generate(ids, method="draft", k=4, max_new_tokens=16)
    with torch.no_grad():
        ref = hf_target.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
    assert out.token_ids == ref[0, len(ids) :].tolist()


def test_generation_up_to_the_context_limit(decoder):
    ids = [5] * (decoder.target.max_context - 3)
    out = decoder.generate(ids, method="ngram", k=8, max_new_tokens=3)
    assert len(out.token_ids) <= 3
    assert out.finish_reason in ("length", "stop")
    # asking for more than fits is an error that says so, not a silent early stop
    with pytest.raises(LeapDecodeError, match="does not fit.*at most 3 new tokens"):
        decoder.generate(ids, method="ngram", k=8, max_new_tokens=50)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": []}, "empty"),
        ({"prompt": [10**6]}, "outside the vocabulary"),
        ({"prompt": "x", "k": -1}, "k must be"),
        ({"prompt": "x", "k": 65}, "k must be"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "top_p": 0.0}, "top-p"),
        ({"prompt": "x", "top_p": 2.0}, "top-p"),
        ({"prompt": "x", "top_k": -3}, "top-k"),
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "method": "magic"}, "unknown method"),
        ({"prompt": "x", "method": "ngram", "ngram_min": 3, "ngram_max": 2}, "n-gram"),
        ({"prompt": "x", "stop": [""]}, "stop strings"),
        ({"prompt": "x", "seed": 2**70, "temperature": 1.0}, "seed must be an integer from"),
        ({"prompt": "x", "seed": -(2**63) - 1}, "seed must be an integer from"),
        ({"prompt": "y " * 300}, "context"),
        ({"prompt": 123}, "text .str. or a list of token ids, got int"),
        ({"prompt": None}, "got NoneType"),
        ({"prompt": "x", "temperature": float("inf")}, "finite"),
    ],
)
def test_bad_input_raises_value_error(decoder, kwargs, needle):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt")
    with pytest.raises(ValueError, match=needle) as e:
        decoder.generate(prompt, **kwargs)
    assert isinstance(e.value, LeapDecodeError)


def test_bad_model_paths_raise_value_error(tmp_path, target_dir):
    with pytest.raises(LeapDecodeError, match="does not exist"):
        LeapDecoder.from_pretrained(str(tmp_path / "none"))
    with pytest.raises(LeapDecodeError, match="config.json"):
        LeapDecoder.from_pretrained(str(tmp_path))
    with pytest.raises(LeapDecodeError, match="backend"):
        LeapDecoder.from_pretrained(target_dir, backend="tensorrt")
    with pytest.raises(LeapDecodeError, match="dtype"):
        LeapDecoder.from_pretrained(target_dir, dtype="int3")


def test_draft_method_without_draft(target_dir):
    dec = LeapDecoder.from_pretrained(target_dir)
    with pytest.raises(LeapDecodeError, match="needs a draft"):
        dec.generate("x", method="draft")


def test_a_draft_folders_suggested_vocabulary_gives_way_on_the_transformers_backend(
        tmp_path_factory, tok_dir, target_dir, hf_target):  # fmt: skip
    """The folder's draft_vocab.json is only a suggestion: the transformers backend, which
    cannot cut the draft's head, runs the whole vocabulary instead of refusing; asked for
    explicitly, a reduced head is still a clear error there."""
    from leapdecode.proposers.draft_model import write_vocab_ranking

    path = str(tmp_path_factory.mktemp("ranked_draft"))
    helpers.make_noisy_copy(hf_target, path, noise=0.02, seed=1, tokenizer_dir=tok_dir)
    write_vocab_ranking(path, list(range(helpers.VOCAB)) * 2, helpers.VOCAB, 64, "test")
    dec = LeapDecoder.from_pretrained(target_dir, draft=path, backend="transformers")
    ids = dec.tokenizer.encode("for i in range(3):")
    out = dec.generate(ids, method="draft", k=3, max_new_tokens=12)
    assert out.token_ids == helpers.greedy_reference(hf_target, [ids], 12)[0]
    with pytest.raises(LeapDecodeError, match="needs the native backend"):
        LeapDecoder.from_pretrained(target_dir, draft=path, backend="transformers", draft_vocab=64)


def test_a_batch_seed_must_leave_room_for_every_row(decoder):
    with pytest.raises(LeapDecodeError, match="row i takes seed \\+ i"):
        decoder.generate_batch(["x", "y"], seed=2**64 - 1, temperature=1.0, max_new_tokens=2)
    with pytest.raises(LeapDecodeError, match="seed must be an integer"):
        decoder.generate_batch(["x"], seed="1", max_new_tokens=2)


def test_importing_the_package_leaves_torch_for_first_use():
    """`import leapdecode` is quick (the CLI starts, and takes Ctrl-C, before torch loads);
    the public names still import as before."""
    import subprocess
    import sys

    code = (
        "import sys, leapdecode\n"
        "assert 'torch' not in sys.modules, 'torch imported by the package itself'\n"
        "from leapdecode import LeapDecoder, GenerationResult, SpecConfig\n"
        "assert 'torch' in sys.modules and LeapDecoder.__module__ == 'leapdecode.api'\n"
        "try:\n    leapdecode.NoSuchName\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "has no attribute 'NoSuchName'" in out.stdout
