"""Cheap signals of copying, tracked during training beside validation loss.

All three are teacher-forced, one forward pass per example, on held-out (validation) text:

- `second_showing`: a 100-token validation span shown twice; mean loss (nats/token) on the
  first and on the second showing. A model that has learned to copy (induction heads)
  scores the second showing far lower.
- `copy_score`: a validation function, the line "# The same function again, unchanged:",
  and its first line; the share of the function's remaining tokens reproduced before the
  first difference. Under greedy decoding the output equals the reference up to its first
  difference, so the first teacher-forced argmax miss is exactly where greedy output departs.
- `revision_exact`: revision prompts (code_edits format, from validation functions); the
  share whose expected rest is the argmax at every position, i.e. reproduced exactly.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F

from .. import code_edits
from . import corpus


class CopyProbe:
    def __init__(
        self,
        tokenizer,
        root: str,
        files,
        val_tokens: np.ndarray,
        n: int = 24,
        span: int = 100,
        max_rest: int = 192,
        seed: int = 0,
    ) -> None:
        rng = random.Random(seed)
        eos = tokenizer.eos_token_id
        self.spans = []
        nprng = np.random.default_rng(seed)
        for s in nprng.integers(0, len(val_tokens) - span, size=min(16, n)):
            piece = [int(t) for t in val_tokens[s : s + span]]
            self.spans.append([eos, *piece, *piece])
        self.span = span
        fns = []
        for f in files:
            if f.split == "validation":
                fns.extend(code_edits.all_functions(corpus.read(root, f)))
        rng.shuffle(fns)
        enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        self.copies, self.revisions = [], []
        for _name, code in fns:
            if len(self.copies) < n:
                prompt, rest = code_edits.copy_prompt(code)
                self.copies.append((enc(prompt), enc(rest)[:max_rest]))
        for path_code in fns:
            if len(self.revisions) >= n:
                break
            code = path_code[1]
            fn = code_edits._def_node(code)
            names = code_edits.renamable_args(fn, code) if fn is not None else []
            if names:
                prompt, rest, _ = code_edits.revision(code, names, rng)
                self.revisions.append((enc(prompt), enc(rest)[:max_rest]))

    @staticmethod
    def _logits(model, ids: list[int]) -> torch.Tensor:
        dev = next(model.parameters()).device
        return model(input_ids=torch.tensor([ids], device=dev)).logits[0].float().cpu()  # [T, V]

    def _first_miss(self, model, prompt: list[int], rest: list[int]) -> int:
        """Tokens of `rest` the model's argmax reproduces before its first difference."""
        logits = self._logits(model, prompt + rest)
        pred = logits[len(prompt) - 1 : len(prompt) + len(rest) - 1].argmax(-1)
        miss = (pred != torch.tensor(rest)).nonzero()
        return len(rest) if len(miss) == 0 else int(miss[0])

    @torch.no_grad()
    def measure(self, model) -> dict:
        was_training = model.training
        model.eval()
        first = second = 0.0
        for ids in self.spans:
            logits = self._logits(model, ids)
            nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="none")
            first += float(nll[: self.span].mean())
            second += float(nll[self.span :].mean())
        copy = [self._first_miss(model, p, r) / len(r) for p, r in self.copies]
        exact = [self._first_miss(model, p, r) == len(r) for p, r in self.revisions]
        model.train(was_training)
        return {
            "first_showing_loss": first / max(1, len(self.spans)),
            "second_showing_loss": second / max(1, len(self.spans)),
            "copy_score": float(np.mean(copy)) if copy else 0.0,
            "revision_exact": float(np.mean(exact)) if exact else 0.0,
        }
