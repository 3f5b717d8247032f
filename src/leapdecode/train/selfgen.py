"""Training data from the target's own behaviour: its greedy continuations of corpus prefixes.

A draft is judged by how often it agrees with what the target *generates*, which is not the
same text as the corpus (a small target repeats itself, closes blocks early, and so on).
`leapdecode train selfgen` runs the target (through leapdecode itself, so it is fast and
lossless) on random prefixes of the training split and writes a token stream

    <eos> prefix... continuation... <eos> prefix... continuation... ...

that `leapdecode train draft --tokens FILE` distils from, as Medusa-2 and EAGLE regenerate
their training data with the target. Shards are saved as they finish, so a killed run
resumes where it stopped.
"""

from __future__ import annotations

import glob
import os

import numpy as np
from tqdm import tqdm

from ..errors import LeapDecodeError


def generate_stream(
    target: str,
    corpus_tokens: np.ndarray,
    out: str,
    samples: int,
    prefix_tokens: int,
    new_tokens: int,
    batch: int,
    seed: int,
    eos: int,
    dtype: str = "auto",
) -> np.ndarray:
    from ..api import LeapDecoder

    if samples < 1 or prefix_tokens < 1 or new_tokens < 1 or batch < 1:
        raise LeapDecodeError("--samples, --prefix-tokens, --new-tokens and --batch must be >= 1")
    dec = LeapDecoder.from_pretrained(target, dtype=dtype)
    if prefix_tokens + new_tokens > dec.target.max_context:
        raise LeapDecodeError(
            f"--prefix-tokens + --new-tokens exceeds the target's context ({dec.target.max_context})"
        )
    shard_dir = out + ".shards"
    os.makedirs(shard_dir, exist_ok=True)
    n_batches = (samples + batch - 1) // batch
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus_tokens) - prefix_tokens, size=n_batches * batch)
    done = {int(os.path.basename(p)[:-4]) for p in glob.glob(os.path.join(shard_dir, "*.npy"))}
    for b in tqdm(range(n_batches), desc="target generations", unit="batch", initial=len(done)):
        if b in done:
            continue
        prompts = [
            [int(t) for t in corpus_tokens[s : s + prefix_tokens]]
            for s in starts[b * batch : (b + 1) * batch]
        ]
        # Prompt lookup is lossless and cuts the target's forwards on repetitive text.
        results = dec.generate_batch(prompts, method="ngram", k=8, max_new_tokens=new_tokens)
        rows = []
        for p, r in zip(prompts, results, strict=True):
            rows.extend([eos, *p, *r.token_ids])
        np.save(os.path.join(shard_dir, f"{b:06d}.npy"), np.asarray(rows, dtype=np.int32))
    shards = sorted(glob.glob(os.path.join(shard_dir, "*.npy")))
    stream = np.concatenate([np.load(p) for p in shards]).astype(corpus_tokens.dtype)
    np.save(out, stream)
    return stream
