"""Proposers: one file per method, one small interface (`base.Proposer`)."""

from .base import Drafts, NoProposer, Proposer
from .draft_model import DraftModelProposer
from .ngram import NgramProposer

__all__ = ["Drafts", "DraftModelProposer", "NgramProposer", "NoProposer", "Proposer"]
