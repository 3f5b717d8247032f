"""`leapdecode train draft-vocab`: a draft model's vocabulary ranked by how often each token
occurs in a corpus, for FR-Spec (the draft's LM head cut to its N most frequent tokens).

On a CPU a draft step is the bytes it reads, and a small model's LM head is a large share of
them (the Qwen2.5-Coder-0.5B's, 151,936 x 896, is a fifth of its weights). With the head cut
to the tokens that carry almost all of the text, a draft step reads less and the draft can
still propose what the target writes (a token outside the cut is never proposed: its position
is rejected, never wrong; the output stays the target's).

The ranking is written to the draft folder as draft_vocab.json (proposers/draft_model.py):
every token of the corpus's training split counted, the tokenizer's added (special) tokens
ranked first (a chat's end-of-turn must stay proposable), and a recommended N: the fewest
tokens, a multiple of 1,024, that cover `--coverage` of the training split's tokens. Its
coverage of the held-out split is reported beside it. A draft loads with the recommended head
from then on unless `--draft-vocab N` says otherwise (0: the whole vocabulary).
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..errors import LeapDecodeError

STEP = 1024  # the recommended N is a multiple of this
MAX_FILE_BYTES = 2**20  # a larger file is counted from its first MiB only


def count(tokenizer, root: str, files, vocab_size: int) -> np.ndarray:
    """Occurrences of each token id in the files (paths relative to root) -> [vocab_size]."""
    from tqdm import tqdm

    counts = np.zeros(vocab_size, dtype=np.int64)
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            counts[:] += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)[
                :vocab_size
            ]
        batch.clear()

    for f in tqdm(files, desc="counting tokens", unit="file"):
        with open(os.path.join(root, f.path), "rb") as fh:
            batch.append(fh.read(MAX_FILE_BYTES).decode("utf-8", errors="ignore"))
        if len(batch) == 64:
            flush()
    if batch:
        flush()
    return counts


def rank(counts: np.ndarray, first: list[int]) -> np.ndarray:
    """Token ids, most frequent first, the ids in `first` ahead of all (in their order)."""
    order = np.argsort(-counts, kind="stable")
    first = [i for i in dict.fromkeys(first) if 0 <= i < len(counts)]
    rest = order[~np.isin(order, first)]
    return np.concatenate([np.asarray(first, dtype=np.int64), rest])


def recommend(counts: np.ndarray, ranked: np.ndarray, coverage: float) -> int:
    """The fewest ranked tokens, a multiple of STEP (or the whole vocabulary), whose
    occurrences are at least `coverage` of all."""
    total = max(1, int(counts.sum()))
    covered = np.cumsum(counts[ranked]) / total  # [V]
    n = int(np.searchsorted(covered, coverage) + 1)
    return min(len(ranked), -(-n // STEP) * STEP)


def share(counts: np.ndarray, ids: np.ndarray) -> float:
    """The share of all occurrences that `ids` carry."""
    return float(counts[ids].sum() / max(1, counts.sum()))


def cmd_draft_vocab(args) -> int:
    from .fit import extensions

    if not 0 < args.coverage <= 1:
        raise LeapDecodeError(f"--coverage must be in (0, 1], got {args.coverage}")
    if args.recommended < 0:
        raise LeapDecodeError(
            f"--recommended must be >= 0 (0: by --coverage), got {args.recommended}"
        )
    from ..resolve import resolve_model

    folder = resolve_model(args.draft, "draft")
    out = write_ranking(
        folder, args.data, extensions(args), args.val_percent, args.coverage, args.recommended
    )
    held = out["held_out_coverage_of_recommended"]
    held_txt = "" if held is None else f", {held:.2%} of the held-out files'"
    print(
        f"wrote {os.path.join(folder, 'draft_vocab.json')}: the draft's head keeps "
        f"{out['recommended']} of {len(out['ranked_token_ids'])} tokens, "
        f"{out['coverage_of_recommended']:.2%} of those counted{held_txt}. "
        f"The draft loads with it from now on; --draft-vocab 0 keeps the whole vocabulary."
    )
    return 0


def write_ranking(
    folder: str,
    data: str | None = None,
    exts: tuple[str, ...] = (".py",),
    val_percent: float = 2.0,
    coverage: float = 0.999,
    recommended: int = 0,
) -> dict:
    """Count the corpus (`data`, default the Python standard library) with the model folder's
    tokenizer and write its draft_vocab.json; returns what it wrote."""
    from ..proposers.draft_model import VOCAB_FILE
    from . import corpus
    from .fit import load_tokenizer

    tokenizer = load_tokenizer(folder)
    config = os.path.join(folder, "config.json")
    vocab_size = len(tokenizer)
    if os.path.isfile(config):  # the model's rows (Qwen pads its embedding past the tokenizer)
        with open(config) as f:
            vocab_size = int(json.load(f).get("vocab_size") or vocab_size)
    root = data or corpus.stdlib_dir()
    files = corpus.scan(root, exts, val_percent)
    train = [f for f in files if f.split == "train"]
    held_out = [f for f in files if f.split == "validation"]
    if not train:
        raise LeapDecodeError(
            f"no {', '.join(exts)} files to count in {root!r}: pass --data DIR "
            "(and --ext) with text like what the target will write"
        )
    counts = count(tokenizer, root, train, vocab_size)
    special = sorted(tokenizer.added_tokens_decoder)  # end-of-turn and the like, always kept
    ranked = rank(counts, special)
    n = min(recommended or recommend(counts, ranked, coverage), vocab_size)
    held = count(tokenizer, root, held_out, vocab_size) if held_out else None
    out = {
        "ranked_token_ids": ranked.tolist(),
        "recommended": n,
        "coverage_of_recommended": share(counts, ranked[:n]),
        "held_out_coverage_of_recommended": None if held is None else share(held, ranked[:n]),
        "source": f"leapdecode train draft-vocab: {len(train)} files of {root} "
        f"({int(counts.sum())} tokens)",
    }
    path = os.path.join(folder, VOCAB_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)
    return out


def rank_catalogue_draft(name: str, folder: str, progress: bool = True) -> None:
    """A freshly pulled model that some catalogue entry recommends as a draft: its vocabulary
    ranked on the Python standard library, so that it drafts with an FR-Spec head."""
    from ..resolve import catalogue

    if not any(e.get("recommended_draft") == name for e in catalogue().values()):
        return
    out = write_ranking(folder)
    if progress:
        print(
            f"{name} drafts with its {out['recommended']} most frequent tokens "
            "(draft_vocab.json; --draft-vocab 0: all)",
            flush=True,
        )
