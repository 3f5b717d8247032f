"""What every proposer offers the engine: guesses for the next tokens of each sequence."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..sequence import Sequence, pad_right


@dataclass
class Drafts:
    tokens: torch.Tensor  # [B, k] right-padded with 0
    counts: torch.Tensor  # [B] real drafts per row (<= k)
    probs: torch.Tensor | None = None  # [B, k, V] drafter's processed distribution; None = one-hot

    @staticmethod
    def empty(batch: int) -> Drafts:
        return Drafts(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))

    @staticmethod
    def from_lists(rows: list[list[int]]) -> Drafts:
        """Deterministic drafts (one-hot q) from per-sequence token lists."""
        return Drafts(*pad_right(rows))


class Proposer(ABC):
    name: str = "none"

    def start(self, seqs: list[Sequence], n_slots: int, max_len: int) -> None:
        """Called once after the target's prefill (each sequence holds its first token)."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        """Up to ks[i] draft tokens for seqs[i], continuing seqs[i].tokens."""

    def accepted(self, seqs: list[Sequence], n_accepted: list[int]) -> None:
        """After verification: seqs[i] kept n_accepted[i] drafts plus one target token."""

    def finish(self, seqs: list[Sequence]) -> None:
        """The sequences are done; free what is held for them."""


class NoProposer(Proposer):
    """Plain autoregressive decoding: k = 0 through the same loop."""

    name = "none"

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Drafts:
        return Drafts.empty(len(seqs))
