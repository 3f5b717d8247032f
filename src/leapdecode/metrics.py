"""Per-request counters: what was proposed, what the target kept, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    target_forwards: int = 0  # every target forward, the prefill included
    draft_forwards: int = 0  # forwards of a draft model (0 for draftless methods)
    decode_steps: int = 0  # target decode (verify) forwards
    proposed: int = 0  # draft tokens sent to the target
    accepted: int = 0  # draft tokens the target kept
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # Where the decode time went (a batch's steps are shared by its rows):
    propose_s: float = 0.0  # the proposer (draft model forwards, n-gram lookup)
    verify_s: float = 0.0  # the target's verify forwards
    accept_s: float = 0.0  # the acceptance rule, cache rollback, proposer bookkeeping

    def record_step(self, n_proposed: int, n_accepted: int) -> None:
        self.decode_steps += 1
        self.target_forwards += 1
        self.proposed += n_proposed
        self.accepted += n_accepted
        if len(self.proposed_by_position) < n_proposed:
            grow = n_proposed - len(self.proposed_by_position)
            self.proposed_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(n_proposed):
            self.proposed_by_position[i] += 1
        for i in range(n_accepted):
            self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per target decode forward, the target's own bonus token included."""
        if not self.decode_steps:
            return 0.0
        return (self.accepted + self.decode_steps) / self.decode_steps

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        wall = self.wall_s
        return {
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "wall_s": wall,
            "tokens_per_s": self.new_tokens / wall if wall > 0 else 0.0,
            "new_tokens": self.new_tokens,
            "decode_steps": self.decode_steps,
            "acceptance_by_position": [
                a / p if p else 0.0
                for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=True)
            ],
        }
