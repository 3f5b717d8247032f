"""Greedy output against transformers' own `generate` on the same folder: the lossless check
on real checkpoints (the CI tests and `bench/lossless_real.py` both run it).

A difference is forgiven only at a tie: the reference's top-2 logits, after the common
prefix, are the two tokens in question and closer than `TIE_FLOAT32` (two implementations of
one float32 model round differently), or in a 16-bit dtype than two units in the last place of
the top logit (lossless.tie_tolerance); the margins seen are written into the report.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from .lossless import first_difference, tie_tolerance

TIE_FLOAT32 = 2e-3  # logits; the summation order of two float32 implementations differs


@dataclass
class Mismatch:
    prompt: int  # index into the prompts
    position: int  # first differing new token
    margin: float  # the reference's top-2 logit margin there
    tie: bool


@dataclass
class MethodReport:
    method: str
    k: int | None
    prompts: int = 0
    identical: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    target_forwards: int = 0
    new_tokens: int = 0

    @property
    def non_ties(self) -> int:
        return sum(not m.tie for m in self.mismatches)

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "k": self.k,
            "prompts": self.prompts,
            "identical": self.identical,
            "ties": len(self.mismatches) - self.non_ties,
            "non_ties": self.non_ties,
            "mismatches": [m.__dict__ for m in self.mismatches],
            "tokens_per_target_forward": self.new_tokens / max(1, self.target_forwards),
        }


def real_prompts(n_per_category: int = 3, max_chars: int = 600) -> list[str]:
    """Short prompts from the bench sets (completion, revision, grounded, free): the shortest
    of each category, a long one cut to its last `max_chars` characters at a line start."""
    from ..paths import PROMPTS

    out = []
    for category in ("completion", "revision", "grounded", "free"):
        with open(os.path.join(PROMPTS, f"{category}.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line)["prompt"] for line in f if line.strip()]
        for text in sorted(rows, key=len)[:n_per_category]:
            if len(text) > max_chars:
                cut = text[-max_chars:]
                text = cut[cut.index("\n") + 1 :] if "\n" in cut else cut
            out.append(text)
    return out


def eos_ids(folder: str) -> list[int]:
    from transformers import GenerationConfig

    ids = GenerationConfig.from_pretrained(folder).eos_token_id
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


class Reference:
    """transformers' model of `folder` in `dtype`: its greedy continuations and its logits."""

    def __init__(self, folder: str, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        self.eos = eos_ids(folder)

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        from transformers import GenerationConfig

        config = GenerationConfig(  # plain greedy: none of the folder's sampling defaults
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos or None,
            pad_token_id=self.eos[0] if self.eos else 0,
        )
        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
        new = out[0, len(ids) :].tolist()
        # generate pads a finished row with pad_token_id; the eos itself is kept
        return new

    @torch.no_grad()
    def top2(self, ids: list[int]) -> tuple[list[int], float, float]:
        """The two likeliest next tokens, their logits' margin, and the top logit."""
        logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 2)
        return top.indices.tolist(), float(top.values[0] - top.values[1]), float(top.values[0])


def compare(
    reference: Reference,
    prompts: list[list[int]],
    wanted: list[list[int]],
    got: list[list[int]],
    report: MethodReport,
    dtype: torch.dtype = torch.float32,
) -> MethodReport:
    """Fill `report` with each prompt's first difference of `got` from `wanted`, judged."""
    for i, (ids, want, have) in enumerate(zip(prompts, wanted, got, strict=True)):
        report.prompts += 1
        pos = first_difference(have, want)
        if pos is None:
            report.identical += 1
            continue
        top, margin, top_logit = reference.top2(ids + want[:pos])
        tie = max(TIE_FLOAT32, tie_tolerance(top_logit, dtype))
        pair = {
            want[pos] if pos < len(want) else None,
            have[pos] if pos < len(have) else None,
        }
        report.mismatches.append(Mismatch(i, pos, margin, pair == set(top) and margin <= tie))
    return report
