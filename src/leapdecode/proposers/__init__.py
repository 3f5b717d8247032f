"""Proposers: one file per method, one small interface (`base.Proposer`)."""

from .base import Drafts, NoProposer, Proposer
from .draft_model import DraftModelProposer
from .lookahead import LookaheadProposer
from .ngram import NgramProposer
from .suffix import SuffixProposer

__all__ = [
    "Drafts",
    "DraftModelProposer",
    "LookaheadProposer",
    "NgramProposer",
    "NoProposer",
    "Proposer",
    "SuffixProposer",
]
