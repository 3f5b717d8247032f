"""Per-request counters: what was proposed, what the target kept, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field


def mean_accepted_tokens(accepted: int, decode_steps: int) -> float:
    """Tokens per target decode forward, the target's own (bonus) token counted: plain
    decoding gives 1.0. The one definition, for per-request stats and the benchmark alike."""
    return (accepted + decode_steps) / decode_steps if decode_steps else 0.0


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
    queue_s: float = 0.0  # waiting for a free slot (engine service)
    first_token_s: float = 0.0  # perf_counter() when the first token came (internal)

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
        return mean_accepted_tokens(self.accepted, self.decode_steps)

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


class EngineMetrics:
    """Server-wide counters in Prometheus form (`leapdecode:` names, in vLLM's style).

    The engine reports each step (`on_step`); the server reports each finished request
    (`on_finish`) and each rejected one (`on_rejected`). `render()` gives the text format.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        ns = "leapdecode:"
        self.requests = Counter(
            ns + "requests", "Finished requests by status", ["status"], registry=r
        )
        self.running = Gauge(ns + "num_requests_running", "Sequences in KV slots", registry=r)
        self.waiting = Gauge(ns + "num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.prompt_tokens = Counter(ns + "prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter(ns + "generation_tokens", "Generated tokens", registry=r)
        self.draft_tokens = Counter(
            ns + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.accepted_tokens = Counter(
            ns + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            ns + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted by draft position",
            ["position"],
            registry=r,
        )
        self.proposed_per_pos = Counter(
            ns + "spec_decode_num_draft_tokens_per_pos",
            "Draft tokens proposed by draft position",
            ["position"],
            registry=r,
        )
        self.decode_forwards = Counter(
            ns + "spec_decode_num_target_forwards",
            "Target decode (verify) forwards, summed over sequences",
            registry=r,
        )
        self.acceptance_rate = Gauge(
            ns + "spec_decode_acceptance_rate",
            "Accepted / proposed draft tokens since start",
            registry=r,
        )
        self.mean_accepted = Gauge(
            ns + "spec_decode_mean_accepted_tokens",
            "Tokens per target decode forward (bonus token counted)",
            registry=r,
        )
        lat = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
        self.ttft = Histogram(
            ns + "time_to_first_token_seconds", "Arrival to first token", buckets=lat, registry=r
        )
        self.itl = Histogram(
            ns + "inter_token_latency_seconds",
            "Time per output token after the first",
            buckets=lat,
            registry=r,
        )
        self.step_time = Histogram(ns + "step_seconds", "One engine step", buckets=lat, registry=r)
        self.k_chosen = Histogram(
            ns + "spec_decode_k",
            "Draft tokens per sequence and step",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self._proposed = self._accepted = self._steps = 0

    def on_step(self, engine, step_s: float, out) -> None:
        self.step_time.observe(step_s)
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        for k in engine.last_step_ks:
            self.k_chosen.observe(k)
        for seq, toks in out:
            if not toks:
                continue
            self.generation_tokens.inc(len(toks))
            if seq.n_out == len(toks):  # its first token(s): the prefill step
                self.prompt_tokens.inc(seq.prompt_len)
                self.ttft.observe(seq.stats.first_token_s - seq.arrival_s)
            else:
                for _ in toks:
                    self.itl.observe(step_s / len(toks))

    def on_finish(self, seq, status: str) -> None:
        self.requests.labels(status=status).inc()
        s = seq.stats
        self.draft_tokens.inc(s.proposed)
        self.accepted_tokens.inc(s.accepted)
        self.decode_forwards.inc(s.decode_steps)
        for i, (p, a) in enumerate(
            zip(s.proposed_by_position, s.accepted_by_position, strict=True)
        ):
            self.proposed_per_pos.labels(position=str(i)).inc(p)
            self.accepted_per_pos.labels(position=str(i)).inc(a)
        self._proposed += s.proposed
        self._accepted += s.accepted
        self._steps += s.decode_steps
        if self._proposed:
            self.acceptance_rate.set(self._accepted / self._proposed)
        if self._steps:
            self.mean_accepted.set((self._accepted + self._steps) / self._steps)

    def on_rejected(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
