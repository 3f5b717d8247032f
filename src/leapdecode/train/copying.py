"""Does the target copy, and does it loop? Measured with real greedy generation (leapdecode,
method none) on held-out material:

- `copy_score`: >= 20 validation functions, each followed by "# The same function again,
  unchanged:" and its first line; the share of the function's remaining tokens the greedy
  output reproduces before its first difference (token by token), averaged over functions.
- `revision_exact`: the benchmark's revision prompts (bench/prompts/revision.jsonl, from the
  validation split); the share whose greedy output reproduces the expected revised rest
  exactly (its first max_new_tokens tokens).
- `looping`: 128-token greedy continuations of validation file prefixes; the share in which
  some non-blank line occurs 3 or more times.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter

from tqdm import tqdm

from .. import code_edits


def _fits(dec, prompt: str, new: int) -> bool:
    return len(dec.tokenizer.encode(prompt, add_special_tokens=True)) + new < dec.target.max_context


def _validation_texts(files) -> list[str]:
    return [data.decode("utf-8") for _, data in files]


def copy_cases(files, n: int = 24, seed: int = 0) -> list[tuple[str, str]]:
    fns = [code for text in _validation_texts(files) for _, code in code_edits.all_functions(text)]
    random.Random(seed).shuffle(fns)
    return [code_edits.copy_prompt(code) for code in fns[:n]]


def copy_score(dec, cases, max_rest: int = 192) -> dict:
    scores = []
    for prompt, rest in tqdm(cases, desc="copy test", unit="function"):
        want = dec.tokenizer.encode(rest, add_special_tokens=False)[:max_rest]
        if not _fits(dec, prompt, len(want)):
            continue
        got = dec.generate(prompt, max_new_tokens=len(want)).token_ids
        same = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
            min(len(got), len(want)),
        )
        scores.append(same / len(want))
    return {
        "copy_score": sum(scores) / max(1, len(scores)),
        "copy_functions": len(scores),
        "copy_scores": scores,
    }


def revision_exact(dec, prompt_file: str) -> dict:
    rows = [json.loads(line) for line in open(prompt_file) if line.strip()]
    exact = []
    for row in tqdm(rows, desc="revision prompts", unit="prompt"):
        if not _fits(dec, row["prompt"], row["max_new_tokens"]):
            continue
        out = dec.generate(row["prompt"], max_new_tokens=row["max_new_tokens"])
        want = dec.tokenizer.encode(row["expected"], add_special_tokens=False)
        wanted_text = dec.tokenizer.decode(want[: row["max_new_tokens"]])
        exact.append(out.text.startswith(wanted_text))  # same text, whatever the segmentation
    return {"revision_exact": sum(exact) / max(1, len(exact)), "revision_prompts": len(exact)}


def looping(dec, files, n: int = 24, prompt_tokens: int = 192, new: int = 128) -> dict:
    from .validation import validation_prompts

    prompt_tokens = min(prompt_tokens, dec.target.max_context // 2)
    new = min(new, dec.target.max_context // 4)
    prompts = validation_prompts(dec.tokenizer, files, n, prompt_tokens)
    loops = 0
    for p in tqdm(prompts, desc="looping test", unit="prompt"):
        text = dec.generate(p, max_new_tokens=new).text
        counts = Counter(line.strip() for line in text.splitlines() if line.strip())
        loops += any(c >= 3 for c in counts.values())
    return {"looping_share": loops / max(1, len(prompts)), "looping_prompts": len(prompts)}


def measure(target: str, files, prompt_file: str | None) -> dict:
    from ..api import LeapDecoder

    dec = LeapDecoder.from_pretrained(target)
    out = copy_score(dec, copy_cases(files))
    if prompt_file and os.path.isfile(prompt_file):
        out |= revision_exact(dec, prompt_file)
    out |= looping(dec, files)
    return out
