"""Training batches that teach copying: plain windows, spans shown twice, revision documents.

A small code model trained on plain files does not learn to carry text over from its
context, and prompt lookup only pays when the target copies. So a stated share of every
batch's rows (rows are equal length, so shares are token shares) comes from:

- **repeats**: a span of the corpus shown twice in one window, with other code before and
  between; the second showing is predictable only by copying (the induction pattern);
- **revisions**: documents of a training function followed by a revised version of it
  (`code_edits.revision_document`: renamed identifiers, added or removed lines, swapped
  parameters, a docstring added, or the same function unchanged), each row starting at a
  document boundary.

Everything is a pure function of (seed, step), so a resumed run sees the same batches.
Revision documents are built from training files only; the benchmark's revision prompts
come from the validation split.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from .. import code_edits
from . import corpus


@dataclass(frozen=True)
class Mix:
    repeat_share: float = 0.0  # rows with a span shown twice
    edit_share: float = 0.0  # rows from revision documents

    def __post_init__(self) -> None:
        if min(self.repeat_share, self.edit_share) < 0 or self.repeat_share + self.edit_share > 1:
            raise ValueError("mix shares must be >= 0 and add up to at most 1")


def revision_stream(tokenizer, root: str, files, seed: int, per_function: int = 2):
    """All training functions (6-30 lines), `per_function` revision documents each, shuffled.

    Returns (tokens, starts): the documents joined by <eos>, and each document's offset."""
    rng = random.Random(seed)
    texts = []
    train = [f for f in files if f.split == "train"]
    for f in tqdm(train, desc="revision documents", unit="file"):
        for _name, code in code_edits.all_functions(corpus.read(root, f)):
            for _ in range(per_function):
                doc = code_edits.revision_document(code, rng)
                if doc is not None:
                    texts.append(doc)
    rng.shuffle(texts)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    eos = tokenizer.eos_token_id
    starts, out = [], []
    for seq in ids:
        starts.append(len(out))
        out.append(eos)
        out.extend(seq)
    dtype = np.uint16 if len(tokenizer) < 65_536 else np.int32
    return np.asarray(out, dtype=dtype), np.asarray(starts, dtype=np.int64)


def load_or_build_revisions(tokenizer, root: str, files, seed: int, cache_dir: str):
    path = os.path.join(cache_dir, f"revisions_{seed}.npz")
    if os.path.isfile(path):
        z = np.load(path)
        return z["tokens"], z["starts"]
    tokens, starts = revision_stream(tokenizer, root, files, seed)
    os.makedirs(cache_dir, exist_ok=True)
    np.savez(path + ".tmp.npz", tokens=tokens, starts=starts)
    os.replace(path + ".tmp.npz", path)
    return tokens, starts


class Batches:
    """batch_at(step, batch, context) -> [batch, context + 1] int64 rows."""

    def __init__(
        self,
        plain: np.ndarray,
        mix: Mix = Mix(),
        seed: int = 0,
        revisions: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        if mix.edit_share > 0 and (revisions is None or len(revisions[1]) == 0):
            raise ValueError("a revision share needs revision documents")
        self.plain, self.mix, self.seed = plain, mix, seed
        self.revisions = revisions

    def _window(self, rng, n: int) -> np.ndarray:
        s = int(rng.integers(0, len(self.plain) - n))
        return self.plain[s : s + n]

    def _repeat(self, rng, n: int) -> np.ndarray:
        """[before] span [between] span [the span's own continuation], n tokens in all."""
        span = int(rng.integers(min(16, n // 4), max(min(16, n // 4) + 1, n // 2 - 8)))
        free = n - 2 * span
        before = int(rng.integers(0, free + 1))
        between = int(rng.integers(0, free - before + 1))
        tail = free - before - between
        s = int(rng.integers(0, len(self.plain) - span - tail))
        parts = [
            self._window(rng, before),
            self.plain[s : s + span],
            self._window(rng, between),
            self.plain[s : s + span + tail],
        ]
        return np.concatenate(parts)

    def _revision(self, rng, n: int) -> np.ndarray:
        tokens, starts = self.revisions
        ok = starts[starts <= len(tokens) - n]
        s = int(ok[rng.integers(0, len(ok))]) if len(ok) else 0
        row = tokens[s : s + n]
        return row if len(row) == n else np.resize(row, n)

    def batch_at(self, step: int, batch: int, context: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        n = context + 1
        rows = []
        for _ in range(batch):
            u = rng.random()
            if u < self.mix.repeat_share:
                rows.append(self._repeat(rng, n))
            elif u < self.mix.repeat_share + self.mix.edit_share:
                rows.append(self._revision(rng, n))
            else:
                rows.append(self._window(rng, n))
        return np.stack(rows).astype(np.int64)
