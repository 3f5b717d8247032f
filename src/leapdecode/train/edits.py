"""Revision documents from the training split, mixed with plain files, for a target fine-tune.

Code revision is leapdecode's home ground: the output mirrors the input, and prompt lookup
pays only when the target really copies. A small target trained on plain files rarely does;
a short fine-tune on revision documents (code_edits.revision, the same format the benchmark
uses, but built from *training* files only) teaches it to.
"""

from __future__ import annotations

import random

import numpy as np
from tqdm import tqdm

from .. import code_edits
from . import corpus


def build_stream(
    tokenizer, root: str, files, docs: int, plain_share: float, seed: int
) -> np.ndarray:
    """Token stream: `docs` revision documents and plain training files making up about
    `plain_share` of the tokens, shuffled, each preceded by <eos>."""
    rng = random.Random(seed)
    train = [f for f in files if f.split == "train"]
    rng.shuffle(train)
    eos = tokenizer.eos_token_id
    revision_docs, plain_docs = [], []
    for f in tqdm(train, desc="revision documents", unit="file"):
        if len(revision_docs) >= docs:
            break
        cands = code_edits.candidates(corpus.read(root, f))
        for _name, code, names in rng.sample(cands, min(2, len(cands))):
            prompt, rest, _ = code_edits.revision(code, names, rng)
            revision_docs.append(tokenizer.encode(prompt + rest, add_special_tokens=False))
    n_rev = sum(len(d) for d in revision_docs)
    want_plain = n_rev * plain_share / max(1e-9, 1 - plain_share)
    n_plain = 0
    for f in train:
        if n_plain >= want_plain:
            break
        ids = tokenizer.encode(corpus.read(root, f), add_special_tokens=False)
        plain_docs.append(ids)
        n_plain += len(ids)
    stream_docs = revision_docs + plain_docs
    rng.shuffle(stream_docs)
    out = []
    for d in stream_docs:
        out.append(eos)
        out.extend(d)
    return np.asarray(out, dtype=np.uint16 if len(tokenizer) < 65_536 else np.int32)
