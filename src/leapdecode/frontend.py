"""The tokenizer side of a request: a user's prompt and options become a validated `Sequence`,
a finished one becomes a `GenerationResult`. It holds no weights, so the server's HTTP process
uses it while the engine (and the models) run in a process of their own."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from .config import SamplingParams, SpecConfig, spec_field_names
from .errors import LeapDecodeError
from .metrics import RequestStats
from .sequence import Sequence


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"
    stats: RequestStats

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
        }


def load_tokenizer(path: str):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a model folder without tokenizer files
        return None


def _spec_from(method, k, ngram_min, ngram_max, draft_min_prob, spec_options) -> SpecConfig:
    """A request's SpecConfig from its options (`Frontend.request`'s method, k, ngram_* and
    draft_min_prob, and any other SpecConfig field by name)."""
    fields = spec_field_names()
    unknown = sorted(set(spec_options) - fields)
    if unknown:
        raise LeapDecodeError(
            f"unknown option {unknown[0]!r}: generation options are method, k, "
            "max_new_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, "
            f"ngram_min, ngram_max, draft_min_prob, spec, or a SpecConfig field "
            f"({', '.join(sorted(fields))})"
        )
    return SpecConfig(
        method=method,
        num_speculative_tokens=k,
        prompt_lookup_min=ngram_min,
        prompt_lookup_max=ngram_max,
        draft_min_prob=draft_min_prob,
        **spec_options,
    )


class Frontend:
    """tokenizer: the target's (None: token ids only); eos_token_ids: ids that end
    generation; vocab_size, max_context: the target's; check: refuses a SpecConfig the engine
    cannot run (Engine.check, or registry.check with the engine's capabilities)."""

    def __init__(
        self,
        tokenizer,
        eos_token_ids,
        vocab_size: int,
        max_context: int,
        check: Callable[[SpecConfig], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.check = check
        self._ids = itertools.count()

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LeapDecodeError(
                    "the target folder has no tokenizer files (tokenizer.json): copy them into the model "
                    "folder, or pass token ids instead of text (Python API)",
                    field="prompt",
                )
            if not prompt:
                raise LeapDecodeError(
                    "the prompt is empty: give at least one character", field="prompt"
                )
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            if hasattr(prompt, "tolist"):  # a tensor or an array of ids
                prompt = prompt.tolist()
            if not isinstance(prompt, list | tuple | range):
                raise LeapDecodeError(
                    f"the prompt must be text (str) or a list of token ids, got {type(prompt).__name__}",
                    field="prompt",
                )
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise LeapDecodeError("token ids must be integers", field="prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise LeapDecodeError(
                    f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                    field="prompt",
                )
        if not ids:
            raise LeapDecodeError("the prompt is empty: give at least one token", field="prompt")
        if len(ids) >= self.max_context:
            raise LeapDecodeError(
                f"the prompt has {len(ids)} tokens but the context (max_model_len) is "
                f"{self.max_context}: shorten the prompt",
                field="prompt",
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def request(
        self,
        prompt: str | list[int],
        method: str = "none",
        k: int = 4,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ngram_min: int = 2,
        ngram_max: int = 4,
        draft_min_prob: float = 0.0,
        spec: SpecConfig | None = None,
        **spec_options,
    ) -> Sequence:
        """A validated request for the engine (generate, stream, the server and the bench
        all build theirs here). method: one of METHODS; k: draft tokens (tree nodes) per step
        (0..64; auto: the most it may use); temperature 0 is greedy; stop: strings that end
        generation (cut from the text); stop_token_ids: token ids that end it besides EOS;
        spec: a whole SpecConfig instead of method / k / ngram_* / draft_min_prob;
        spec_options: any other SpecConfig field (use_tree_spec, suffix_decoding_*,
        lookahead_*)."""
        if spec is None:
            spec = _spec_from(method, k, ngram_min, ngram_max, draft_min_prob, spec_options)
        elif spec_options:
            raise LeapDecodeError("pass either spec= or SpecConfig fields as options, not both")
        self.check(spec)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        stop_strings = self._stops(max_new_tokens, stop, stop_token_ids)
        ids = self.encode(prompt)
        room = self.max_context - len(ids)
        if max_new_tokens > room:
            raise LeapDecodeError(
                f"max_new_tokens {max_new_tokens} does not fit: the prompt has {len(ids)} tokens "
                f"and the context (max_model_len) is {self.max_context}, so at most {room} new "
                "tokens fit; lower max_new_tokens or shorten the prompt",
                field="max_new_tokens",
            )
        gen_seed = seed if seed is not None else random.randrange(2**62)
        return Sequence(
            id=next(self._ids),
            tokens=list(ids),
            prompt_len=len(ids),
            params=params,
            max_new_tokens=max_new_tokens,
            max_context=self.max_context,
            stop_token_ids=self.eos_token_ids | frozenset(stop_token_ids or ()),
            stop_strings=stop_strings,
            decode=self.decode,
            generator=torch.Generator().manual_seed(gen_seed),
            draft_generator=torch.Generator().manual_seed((gen_seed + 0x5EED) % 2**63),
            spec=spec,
        )

    def _stops(self, max_new_tokens, stop, stop_token_ids) -> tuple[str, ...]:
        """Check the length and stop options; returns the stop strings as a tuple."""
        if (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or max_new_tokens < 1
        ):
            raise LeapDecodeError(
                f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}",
                field="max_new_tokens",
            )
        stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(x, str) or not x for x in stop_strings):
            raise LeapDecodeError("stop strings must be non-empty strings", field="stop")
        if stop_strings and self.tokenizer is None:
            raise LeapDecodeError(
                "stop strings need a tokenizer in the target folder", field="stop"
            )
        bad = [t for t in stop_token_ids or () if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise LeapDecodeError(
                f"stop_token_ids must be integers, got {bad[0]!r}", field="stop_token_ids"
            )
        return stop_strings

    def result(self, s: Sequence) -> GenerationResult:
        text = self.decode(s.output)
        if s.finish_reason == "stop" and s.stop_strings:
            cuts = [text.find(x) for x in s.stop_strings if x in text]
            if cuts:
                text = text[: min(cuts)]
        return GenerationResult(text, s.output, s.finish_reason or "length", s.stats)


class TextStream:
    """A running sequence's text, piece by piece, as a stream sends it: `piece()` what is safe
    to send now (anything that may still become a stop string is held back, and so is a
    partial character), `rest()` what is left once the sequence finished. `decode` is what
    decodes its tokens and `result` its final GenerationResult (a Frontend's, a LeapDecoder's)."""

    def __init__(self, seq: Sequence, decode, result) -> None:
        self.seq, self.decode, self.result = seq, decode, result
        self.sent = ""
        self.hold = max((len(x) for x in seq.stop_strings), default=0)

    def piece(self) -> str:
        text = self.decode(self.seq.output)
        ready = (text[: len(text) - self.hold] if self.hold else text).rstrip("\ufffd")
        if len(ready) > len(self.sent) and ready.startswith(self.sent):
            out, self.sent = ready[len(self.sent) :], ready
            return out
        return ""

    def rest(self) -> str:
        final = self.result(self.seq).text
        return final[len(self.sent) :] if final.startswith(self.sent) else ""
