"""Options, validated once: how to sample (SamplingParams) and how to speculate (SpecConfig).

Names follow vLLM's where it has one (`num_speculative_tokens`, `prompt_lookup_min`,
`prompt_lookup_max`). Both are frozen: a request carries its own copy, and shared state
(a draft model, an n-gram index) is never reconfigured per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from .errors import LeapDecodeError
from .proposers import registry

# The methods a request may ask for are the registry's (proposers/registry.py): `auto` picks,
# per sequence and per step, the method and the number of draft tokens (0 included) that
# maximise the whole batch's goodput.
MAX_K = 64  # the most draft tokens a step may verify per sequence
DRAFT_CONTEXT = 256  # a draft model's window by default (proposers/draft_model.py)
# How a draft model's sampled chains are verified (verify.py): token by token (Leviathan et
# al.), or as a block (Sun et al. 2024); auto = block where it applies, tokens elsewhere
# (trees, greedy, deterministic drafts: where the two keep the same drafts).
VERIFY_RULES = ("auto", "token", "block")
MAX_TOP_K = 1_000_000


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's range


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise LeapDecodeError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}",
                field="temperature",
            )
        if not _is_int(self.top_k) or self.top_k < 0 or self.top_k > MAX_TOP_K:
            raise LeapDecodeError(
                f"top-k must be an integer >= 0 (0 = off), got {self.top_k!r}", field="top_k"
            )
        p = self.top_p
        if not isinstance(p, int | float) or isinstance(p, bool) or math.isnan(p) or not 0 < p <= 1:
            raise LeapDecodeError(f"top-p must be in (0, 1] (1 = off), got {p!r}", field="top_p")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise LeapDecodeError(
                f"seed must be an integer from {SEED_MIN} to {SEED_MAX} (what torch's "
                f"generators take), got {self.seed!r}",
                field="seed",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpecConfig:
    method: str = "none"  # none | ngram | suffix | draft | lookahead | medusa | eagle | auto
    num_speculative_tokens: int = 4  # k: draft tokens per step (auto: the most it may use)
    prompt_lookup_min: int = 2  # ngram: shortest n-gram to match
    prompt_lookup_max: int = 4  # ngram: longest n-gram to match
    draft_min_prob: float = 0.0  # draft: stop drafting below this draft confidence (0 = off)
    verify: str = "auto"  # auto | token | block (VERIFY_RULES)
    # ngram, suffix: verify several candidates as one tree of at most k nodes (tree.py)
    use_tree_spec: bool = False
    # suffix (vLLM's names): draft at most factor x match length tokens; stop a path below
    # this probability. Tree depth and the global cache size are the engine's, set once.
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # suffix (leapdecode's own): also match the text's last characters, so a draft finds the
    # source again right after an edit changed its tokens (proposers/char_lookup.py); chains
    suffix_decoding_char_match: bool = True
    # lookahead: window W, n-gram size N (>= 3), at most G candidates verified per step
    lookahead_window: int = 3
    lookahead_ngram_size: int = 3
    lookahead_max_candidates: int = 3
    # eagle's dynamic tree (EAGLE-2; SGLang's names): depth grown per step, and the nodes
    # kept per depth (each expands this many children); num_speculative_tokens is the
    # tree's size after reranking. medusa's tree is static (the heads' folder holds it).
    speculative_num_steps: int = 4
    speculative_eagle_topk: int = 4
    # A static batch-size -> k table (vLLM's num_speculative_tokens_per_batch_size, TRT-LLM's
    # draft_len_schedule): ((batch size, k), ...); a batch of B running sequences uses the k
    # of the largest batch size <= B. Empty: always num_speculative_tokens. Fixed methods only.
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int], ...] = ()
    # auto: the methods it chooses from each step (those loaded). The trained heads are
    # opt-in: a request that may use them needs the target's hidden states every step, and
    # EAGLE's head must run over its whole context before its first draft, costs paid whether
    # auto picks them or not (on the embedded pair: about 10% of auto's throughput at
    # concurrency 1 for Medusa, which it then never picked).
    auto_methods: tuple[str, ...] = field(default_factory=registry.auto_default)

    def may_use(self, method: str) -> bool:
        """Whether a request with this config may draft with `method` (its own, or one of
        auto's choices)."""
        return self.method == method or (self.method == "auto" and method in self.auto_methods)

    def __post_init__(self) -> None:
        self._check_method()
        self._check_ngram()
        self._check_suffix()
        self._check_lookahead()
        self._check_trees()
        self._normalise_table()
        self._normalise_auto()

    def _check_method(self) -> None:
        """The method and k."""
        if self.method not in registry.names():
            raise LeapDecodeError(
                f"unknown method {self.method!r}: use one of {', '.join(registry.names())}",
                field="method",
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 0 <= k <= MAX_K:
            raise LeapDecodeError(
                f"k must be an integer in 0..{MAX_K}, got {k!r}", field="num_speculative_tokens"
            )

    def _check_ngram(self) -> None:
        """N-gram sizes; the yes/no options."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi <= 32):
            raise LeapDecodeError(
                f"n-gram sizes must satisfy 1 <= min ({lo!r}) <= max ({hi!r}) <= 32",
                field="prompt_lookup_min"
                if not (_is_int(lo) and 1 <= lo <= 32)
                else "prompt_lookup_max",
            )
        if not isinstance(self.use_tree_spec, bool):
            raise LeapDecodeError(
                f"use_tree_spec must be true or false, got {self.use_tree_spec!r}",
                field="use_tree_spec",
            )
        if not isinstance(self.suffix_decoding_char_match, bool):
            raise LeapDecodeError(
                "suffix_decoding_char_match must be true or false, got "
                f"{self.suffix_decoding_char_match!r}",
                field="suffix_decoding_char_match",
            )

    def _check_suffix(self) -> None:
        """Suffix decoding's draft limits."""
        f = self.suffix_decoding_max_spec_factor
        if not isinstance(f, int | float) or isinstance(f, bool) or not 0 <= f <= MAX_K:
            raise LeapDecodeError(
                f"suffix_decoding_max_spec_factor must be in [0, {MAX_K}], got {f!r}",
                field="suffix_decoding_max_spec_factor",
            )
        p = self.suffix_decoding_min_token_prob
        if not isinstance(p, int | float) or isinstance(p, bool) or not 0 <= p <= 1:
            raise LeapDecodeError(
                f"suffix_decoding_min_token_prob must be in [0, 1], got {p!r}",
                field="suffix_decoding_min_token_prob",
            )

    def _check_lookahead(self) -> None:
        """Lookahead's window, n-gram size and candidates, and its tree's size."""
        w, n, g = self.lookahead_window, self.lookahead_ngram_size, self.lookahead_max_candidates
        if not (
            _is_int(w)
            and _is_int(n)
            and _is_int(g)
            and 1 <= w <= 32
            and 3 <= n <= 16
            and 0 <= g <= 32
        ):
            bad = next(
                name
                for name, x, a, b in (
                    ("lookahead_window", w, 1, 32),
                    ("lookahead_ngram_size", n, 3, 16),
                    ("lookahead_max_candidates", g, 0, 32),
                )
                if not (_is_int(x) and a <= x <= b)
            )
            raise LeapDecodeError(
                f"lookahead needs window 1..32, n-gram size 3..16 and candidates 0..32 "
                f"(got W={w!r}, N={n!r}, G={g!r})",
                field=bad,
            )
        if self.lookahead_nodes > MAX_K:
            raise LeapDecodeError(
                f"lookahead W={w}, N={n}, G={g} makes a tree of {self.lookahead_nodes} nodes "
                f"per step, more than {MAX_K}: lower W, N or G",
                field="lookahead_window",
            )

    def _check_trees(self) -> None:
        """Eagle's tree; the draft model's cut-off; the verification rule."""
        steps, topk = self.speculative_num_steps, self.speculative_eagle_topk
        if not (_is_int(steps) and _is_int(topk) and 1 <= steps <= 16 and 1 <= topk <= 16):
            raise LeapDecodeError(
                f"eagle's tree needs speculative_num_steps and speculative_eagle_topk in 1..16 "
                f"(got {steps!r}, {topk!r})",
                field="speculative_num_steps"
                if not (_is_int(steps) and 1 <= steps <= 16)
                else "speculative_eagle_topk",
            )
        m = self.draft_min_prob
        if not isinstance(m, int | float) or isinstance(m, bool) or not 0 <= m < 1:
            raise LeapDecodeError(
                f"draft_min_prob must be in [0, 1), got {m!r}", field="draft_min_prob"
            )
        if self.verify not in VERIFY_RULES:
            raise LeapDecodeError(
                f"verify must be one of {', '.join(VERIFY_RULES)}, got {self.verify!r}",
                field="verify",
            )

    def _normalise_table(self) -> None:
        """The batch-size table, sorted."""
        table = self.num_speculative_tokens_per_batch_size
        try:
            table = tuple(sorted((int(b), int(t)) for b, t in table))
        except (TypeError, ValueError):
            raise LeapDecodeError(
                "num_speculative_tokens_per_batch_size must be (batch size, k) pairs",
                field="num_speculative_tokens_per_batch_size",
            ) from None
        if any(b < 1 or not 0 <= t <= MAX_K for b, t in table):
            raise LeapDecodeError(
                f"num_speculative_tokens_per_batch_size: batch sizes >= 1 and k in 0..{MAX_K}",
                field="num_speculative_tokens_per_batch_size",
            )
        object.__setattr__(self, "num_speculative_tokens_per_batch_size", table)

    def _normalise_auto(self) -> None:
        """Auto's choices: a list or a comma-separated string, without repeats."""
        choices = self.auto_methods
        if isinstance(choices, str):
            choices = tuple(x.strip() for x in choices.split(",") if x.strip())
        allowed = registry.auto_choices()
        if not isinstance(choices, list | tuple) or any(c not in allowed for c in choices):
            got = (
                ", ".join(map(str, choices)) if isinstance(choices, list | tuple) else repr(choices)
            )
            raise LeapDecodeError(
                f"auto_methods must be a list of {', '.join(allowed)}, got {got}",
                field="auto_methods",
            )
        object.__setattr__(self, "auto_methods", tuple(dict.fromkeys(choices)))

    @property
    def lookahead_nodes(self) -> int:
        """Draft nodes of a lookahead step: the window's (W-1) + (N-2) W and G n-grams."""
        w, n, g = self.lookahead_window, self.lookahead_ngram_size, self.lookahead_max_candidates
        return (w - 1) + (n - 2) * w + g * (n - 1)

    @property
    def k(self) -> int:
        """Draft tokens per step; `none` always drafts 0; lookahead's tree has its own size."""
        if self.method == "lookahead":
            return self.lookahead_nodes
        return 0 if self.method == "none" else self.num_speculative_tokens

    def k_at(self, batch: int) -> int:
        """Draft tokens per step in a batch of `batch` running sequences."""
        if self.method in ("none", "lookahead"):
            return self.k
        k = self.num_speculative_tokens
        for size, table_k in self.num_speculative_tokens_per_batch_size:
            if size <= batch:
                k = table_k
        return k

    def with_overrides(
        self, method: str | None = None, k: int | None = None, k_table: tuple | None = None
    ) -> SpecConfig:
        """This config with a request's own method, k and/or batch-size table (validated)."""
        changes = {}
        if method is not None:
            changes["method"] = method
        if k is not None:
            changes["num_speculative_tokens"] = k
        if k_table is not None:
            changes["num_speculative_tokens_per_batch_size"] = k_table
        return replace(self, **changes) if changes else self


def spec_field_names() -> set[str]:
    """Every SpecConfig field name (options the API and the server pass through)."""
    return {f.name for f in fields(SpecConfig)}


def parse_k_table(text: str) -> tuple[tuple[int, int], ...]:
    """'1:4,4:2,8:0' -> ((1, 4), (4, 2), (8, 0))."""
    try:
        pairs = tuple((int(b), int(k)) for b, k in (p.split(":") for p in text.split(",") if p))
    except ValueError:
        raise LeapDecodeError(
            f"a batch-size -> k table looks like 1:4,4:2,8:0 (got {text!r})",
            field="num_speculative_tokens_per_batch_size",
        ) from None
    return SpecConfig(
        num_speculative_tokens_per_batch_size=pairs
    ).num_speculative_tokens_per_batch_size
