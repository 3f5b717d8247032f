"""A proposer in one file, as a user would add one: its class and its registry entry. Nothing
else in leapdecode changes for it (tests/test_registry.py runs it through the engine, the
planner and `auto`)."""

from leapdecode.proposers.base import Drafts, Offer, Proposer
from leapdecode.proposers.registry import Method, register


class EchoProposer(Proposer):
    """Drafts what followed the previous occurrence of the last token (a 1-gram copy)."""

    name = "echo"
    prior = 0.9  # what auto expects of a draft token before it has seen any
    free = True  # a copy costs nothing to make

    def offer(self, seq, budget):
        chain = self._chain(seq.tokens, budget)
        return Offer(len(chain), chain=chain) if chain else None

    def propose(self, seqs, ks):
        return Drafts.from_lists([self._chain(s.tokens, k) for s, k in zip(seqs, ks, strict=True)])

    @staticmethod
    def _chain(tokens: list[int], k: int) -> list[int]:
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == tokens[-1]:
                return tokens[i + 1 : i + 1 + k]
        return []


METHOD = register(Method("echo", EchoProposer, auto=True))
