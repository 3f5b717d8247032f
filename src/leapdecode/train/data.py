"""Token streams for training: every file encoded once, files joined by <|endoftext|>."""

from __future__ import annotations

import os

import numpy as np

from . import corpus
from .tokenizer import EOS


def encode_split(
    tokenizer,
    root: str,
    files: list[corpus.SourceFile],
    split: str | None,
    batch: int = 256,
    label: str | None = None,
) -> np.ndarray:
    """The files of `split` (None: all of them), each after an <|endoftext|>, encoded `batch`
    files at a time (a large corpus's ids as Python lists at once would not fit in memory),
    with a progress bar."""
    from tqdm import tqdm

    picked = [f for f in files if split is None or f.split == split]
    eos = tokenizer.convert_tokens_to_ids(EOS)
    dtype = np.uint16 if len(tokenizer) < 65_536 else np.int32
    chunks = []
    for i in tqdm(range(0, len(picked), batch), desc=f"tokenising {label or split or 'files'}",
                  unit="batch", leave=False, disable=len(picked) <= batch):  # fmt: skip
        texts = [corpus.read(root, f) for f in picked[i : i + batch]]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            chunks.append(np.asarray([eos, *ids], dtype=dtype))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def load_or_encode(tokenizer, root: str, files, split: str, cache_dir: str) -> np.ndarray:
    """Encode a split once and keep it in the run folder (`{split}.npy`)."""
    path = os.path.join(cache_dir, f"{split}.npy")
    if os.path.isfile(path):
        return np.load(path, mmap_mode="r")  # memory-mapped: batches read what they need
    arr = encode_split(tokenizer, root, files, split)
    os.makedirs(cache_dir, exist_ok=True)
    np.save(path, arr)
    return arr


def batch_at(tokens: np.ndarray, step: int, batch: int, context: int, seed: int) -> np.ndarray:
    """Batch number `step`: [batch, context + 1] random windows, a pure function of (seed, step),
    so a resumed run sees exactly the batches it would have seen."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - context - 1, size=batch)
    return np.stack([tokens[s : s + context + 1] for s in starts]).astype(np.int64)
