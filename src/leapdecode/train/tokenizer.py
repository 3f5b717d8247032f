"""Byte-level BPE tokenizer trained with Hugging Face `tokenizers` on the training split."""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from . import corpus

EOS = "<|endoftext|>"


def train_tokenizer(
    root: str | None,
    out_dir: str,
    vocab_size: int = 8192,
    extensions=(".py",),
    val_percent: float = 2.0,
    sample_percent: float = 100.0,
) -> PreTrainedTokenizerFast:
    """sample_percent: learn the merges on this share of the training files (picked by path
    hash, so the same ones every time): a large corpus's merges settle on a sample."""
    root = root or corpus.stdlib_dir()
    files = corpus.scan(root, extensions, val_percent)
    train = [f for f in files if f.split == "train"]
    if sample_percent < 100:
        train = [f for f in train if corpus.is_validation("sample/" + f.path, sample_percent)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator((corpus.read(root, f) for f in train), trainer, length=len(train))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=None,
        pad_token=EOS,
        model_max_length=1 << 20,
    )
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    corpus.save_manifest(root, files, out_dir)
    return fast
