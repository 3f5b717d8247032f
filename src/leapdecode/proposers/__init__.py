"""Proposers: one file per method, one small interface (`base.Proposer`), and the registry of
methods by name (`registry`). The classes load on first use, so reading the registry (the
server's HTTP process, `SpecConfig`) imports no model code."""

import importlib

_CLASSES = {
    "Drafts": "base",
    "NoProposer": "base",
    "Offer": "base",
    "Parts": "base",
    "Proposer": "base",
    "DraftModelProposer": "draft_model",
    "EagleProposer": "eagle",
    "LookaheadProposer": "lookahead",
    "MedusaProposer": "medusa",
    "NgramProposer": "ngram",
    "SuffixProposer": "suffix",
}
__all__ = sorted(_CLASSES)


def __getattr__(name: str):
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_CLASSES[name]}", __name__), name)
