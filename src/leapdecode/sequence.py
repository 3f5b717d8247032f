"""One sequence being generated: its tokens, its limits, its options and its stop conditions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .config import SamplingParams, SpecConfig
from .metrics import RequestStats


def pad_right(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> tokens [B, T] right-padded with 0, and each row's length [B]."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return tokens, torch.tensor([len(r) for r in rows], dtype=torch.long)


@dataclass(eq=False)  # compared by identity: the engine keeps them in lists
class Sequence:
    id: int
    tokens: list[int]  # prompt + output so far
    prompt_len: int
    params: SamplingParams
    max_new_tokens: int
    max_context: int
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    decode: object = None  # tokens -> str, needed for stop strings
    # The target's sampling stream: uniform t samples the output token at index t, whatever
    # the speculation (verify.py); the draft model and its acceptance tests draw from their own.
    generator: torch.Generator = field(default_factory=torch.Generator)
    draft_generator: torch.Generator = field(default_factory=torch.Generator)
    spec: SpecConfig = field(default_factory=SpecConfig)
    slot: int = -1  # row in every KV cache, given by the engine
    stats: RequestStats = field(default_factory=RequestStats)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival_s: float = field(default_factory=time.perf_counter)

    _uniforms: list[float] = field(default_factory=list, repr=False)

    def uniforms(self, start: int, n: int) -> torch.Tensor:
        """Uniforms start .. start+n-1 of the target's sampling stream [n] (drawn in blocks,
        kept: one float per output position)."""
        while len(self._uniforms) < start + n:
            self._uniforms.extend(torch.rand(64, generator=self.generator).tolist())
        return torch.tensor(self._uniforms[start : start + n])

    def to_wire(self) -> dict:
        """What another process needs to rebuild this request (`from_wire`): no callables,
        and the sampling streams as their seeds (a fresh request has drawn nothing yet)."""
        return dict(
            id=self.id,
            tokens=list(self.tokens),
            prompt_len=self.prompt_len,
            params=self.params,
            max_new_tokens=self.max_new_tokens,
            max_context=self.max_context,
            stop_token_ids=self.stop_token_ids,
            stop_strings=self.stop_strings,
            spec=self.spec,
            arrival_s=self.arrival_s,
            seed=self.generator.initial_seed(),
            draft_seed=self.draft_generator.initial_seed(),
        )

    @classmethod
    def from_wire(cls, wire: dict, decode) -> Sequence:
        """The request `to_wire` described; decode: tokens -> str, for stop strings."""
        wire = dict(wire)
        seed, draft_seed = wire.pop("seed"), wire.pop("draft_seed")
        return cls(
            **wire,
            decode=decode,
            generator=torch.Generator().manual_seed(seed),
            draft_generator=torch.Generator().manual_seed(draft_seed),
        )

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def n_out(self) -> int:
        return len(self.tokens) - self.prompt_len

    def room(self) -> int:
        """How many more tokens this sequence may still emit."""
        return max(0, min(self.max_new_tokens - self.n_out, self.max_context - len(self.tokens)))

    def append(self, new: list[int]) -> list[int]:
        """Append tokens up to the first stop condition; returns the tokens actually kept."""
        kept = []
        for tok in new:
            if self.finished:
                break
            self.tokens.append(tok)
            kept.append(tok)
            if tok in self.stop_token_ids or self._hit_stop_string():
                self.finished, self.finish_reason = True, "stop"
            elif self.room() == 0:
                self.finished, self.finish_reason = True, "length"
        self.stats.new_tokens = self.n_out
        return kept

    def _hit_stop_string(self) -> bool:
        if not self.stop_strings:
            return False
        longest = max(len(s) for s in self.stop_strings)
        tail = self.decode(self.output[-(longest + 8) :])
        return any(s in tail for s in self.stop_strings)
