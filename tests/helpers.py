"""Tiny models and a tokenizer, built on the fly for the tests (no hub, no downloads)."""

from __future__ import annotations

import contextlib
import copy
import os
import sysconfig
import tempfile

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

VOCAB = 384
TIE = 1e-4  # top-2 logit margin below which a greedy divergence is a numerical tie
EOS = "<|endoftext|>"


def stdlib_text(n_files: int = 6) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    names = ["textwrap.py", "shlex.py", "bisect.py", "heapq.py", "fnmatch.py", "glob.py"]
    out = []
    for name in names[:n_files]:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            out.append(f.read())
    return out


def make_tokenizer(path: str, vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(stdlib_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)
    fast.save_pretrained(path)
    return fast


def make_llama(
    path: str, seed: int, tokenizer_dir: str | None = None, **overrides
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, eos_token_id=0, bos_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(path)
    if tokenizer_dir:
        PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(path)
    return model


def make_noisy_copy(
    model: LlamaForCausalLM, path: str, noise: float, seed: int, tokenizer_dir=None
):
    """A draft that agrees with `model` often but not always."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    draft.save_pretrained(path)
    if tokenizer_dir:
        PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(path)
    return draft


def top2_margin(hf_target, tokens: list[int]) -> float:
    with torch.no_grad():
        logits = hf_target(torch.tensor([tokens])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_lossless(prompts, outputs, reference, hf_target):
    ties = 0
    for p, got, want in zip(prompts, outputs, reference, strict=True):
        if got == want:
            continue
        i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if i is None:  # one stopped earlier than the other: a divergence in length
            raise AssertionError(f"length differs: {len(got)} vs {len(want)} for prompt {p[:8]}")
        margin = top2_margin(hf_target, p + want[:i])
        assert margin < TIE, f"non-tie divergence at {i} (top-2 margin {margin:.2e})"
        ties += 1
    assert ties <= 2, f"{ties} tie divergences: suspiciously many"


def random_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts of lo..hi-1 tokens cut at random from standard-library code."""
    ids = tokenizer.encode("\n".join(stdlib_text()))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi, (1,), generator=gen))
        start = int(torch.randint(0, len(ids) - k, (1,), generator=gen))
        out.append(ids[start : start + k])
    return out


def greedy_reference(hf_target, prompts, max_new: int) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt: the reference for losslessness."""
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf_target.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        refs.append(out[0, len(p) :].tolist())
    return refs


def train_heads(target_dir: str, root: str, steps: int = 60, tokens: str | None = None,
                lr: float | None = None) -> tuple[str, str]:  # fmt: skip
    """Medusa heads and an EAGLE head for `target_dir`, trained with the CLI users run
    (`leapdecode train medusa | eagle`) for a few steps on a few stdlib files (or on the
    token stream `tokens`, .npy)."""
    corpus = os.path.join(root, "corpus")
    os.makedirs(corpus, exist_ok=True)
    for i, text in enumerate(stdlib_text()):
        with open(os.path.join(corpus, f"f{i}.py"), "w", encoding="utf-8") as f:
            f.write(text)
    outs = []
    for kind, extra in (("medusa", ["--heads", "3"]),
                        ("eagle", ["--draft-vocab", "256", "--ttt-steps", "3"])):  # fmt: skip
        out = os.path.join(root, kind)
        argv = ["train", kind, "--target", target_dir, "--out", out, "--run-dir", out + "-run",
                "--data", corpus, "--val-percent", "20", "--steps", str(steps), "--batch", "4",
                "--context", "64", "--eval-prompts", "0", "--threads", "1", *extra]  # fmt: skip
        _train(argv, tokens, lr)
        outs.append(out)
    return outs[0], outs[1]


def train_peagle(target_dir: str, eagle: str, steps: int = 60, k: int = 6,
                 tokens: str | None = None, lr: float | None = None) -> str:  # fmt: skip
    """A parallel EAGLE head (`leapdecode train peagle --init EAGLE`) beside `eagle`, trained
    on the same data as `train_heads` gave it (its corpus folder, or the stream `tokens`)."""
    root = os.path.dirname(eagle)
    out = os.path.join(root, "peagle")
    argv = ["train", "peagle", "--target", target_dir, "--out", out, "--run-dir", out + "-run",
            "--data", os.path.join(root, "corpus"), "--val-percent", "20", "--steps", str(steps),
            "--batch", "4", "--context", "64", "--eval-prompts", "0", "--threads", "1",
            "--init", eagle, "--k", str(k)]  # fmt: skip
    _train(argv, tokens, lr)
    return out


def _train(argv: list[str], tokens: str | None, lr: float | None) -> None:
    """Run a `leapdecode train ...` command line (on the stream `tokens`, at `lr`, where given);
    torch's thread count is put back after it."""
    from leapdecode.cli import main

    argv = [*argv, *(["--tokens", tokens] if tokens else []), *(["--lr", str(lr)] if lr else [])]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def planned_methods(scheduler):
    """The methods `scheduler` plans to draft with (k > 0), step by step, while inside."""
    used: list[str] = []
    plan = scheduler.plan

    def spy(seqs):
        out = plan(seqs)
        used.extend(m for m, k in out if k)
        return out

    scheduler.plan = spy
    try:
        yield used
    finally:
        scheduler.plan = plan


def exact_pairs(hf_target, prompt, sampling: dict) -> dict:
    """The exact joint distribution of the first two tokens under `sampling`."""
    from leapdecode.sampling import SamplingParams, process_logits

    params = SamplingParams(**sampling)
    with torch.no_grad():
        p1 = process_logits(hf_target(torch.tensor([prompt])).logits[0, -1], params)
        joint = {}
        for t1 in torch.nonzero(p1)[:, 0].tolist():
            p2 = process_logits(hf_target(torch.tensor([prompt + [t1]])).logits[0, -1], params)
            for t2 in torch.nonzero(p2)[:, 0].tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def gof_pvalue(pairs, exact) -> float:
    outside = [p for p in pairs if p not in exact]
    assert not outside, f"sampled an impossible pair {outside[0]}"
    keys = sorted(exact, key=exact.get, reverse=True)
    observed = [sum(1 for p in pairs if p == key) for key in keys]
    expected = [exact[key] * len(pairs) for key in keys]
    # Pool the rare outcomes so every cell expects at least 5 draws.
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for o, e in zip(observed, expected, strict=True):
        if e >= 5:
            obs.append(o)
            exp.append(e)
        else:
            pool_o, pool_e = pool_o + o, pool_e + e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    scale = sum(obs) / sum(exp)
    from scipy.stats import chisquare

    return chisquare(obs, [e * scale for e in exp]).pvalue


# real models (tests/test_real_models.py, test_chat.py): pulled once into the tests' own folder
REAL_MODELS = os.environ.get(
    "LEAPDECODE_TEST_MODELS", os.path.join(tempfile.gettempdir(), "leapdecode-test-models")
)


def pulled(name: str) -> str:
    """The catalogue model's folder, pulled into the tests' own cache if not there yet."""
    from leapdecode.pull import pull

    saved = os.environ.get("LEAPDECODE_CACHE")
    os.environ["LEAPDECODE_CACHE"] = REAL_MODELS
    try:
        return pull(name, progress=False)
    finally:
        if saved is None:
            os.environ.pop("LEAPDECODE_CACHE", None)
        else:
            os.environ["LEAPDECODE_CACHE"] = saved
