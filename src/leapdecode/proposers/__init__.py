"""Proposers: one file per method, one small interface (`base.Proposer`)."""

from .base import Drafts, NoProposer, Proposer
from .draft_model import DraftModelProposer
from .eagle import EagleProposer
from .lookahead import LookaheadProposer
from .medusa import MedusaProposer
from .ngram import NgramProposer
from .suffix import SuffixProposer

__all__ = [
    "Drafts",
    "DraftModelProposer",
    "EagleProposer",
    "LookaheadProposer",
    "MedusaProposer",
    "NgramProposer",
    "NoProposer",
    "Proposer",
    "SuffixProposer",
]
