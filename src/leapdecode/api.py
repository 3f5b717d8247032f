"""The Python API: load a target (and optionally a draft), generate or stream."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from .engine import Engine
from .errors import LeapDecodeError
from .metrics import RequestStats
from .models import CausalLM, load_model
from .proposers import DraftModelProposer, NgramProposer, NoProposer, Proposer
from .proposers.draft_model import read_vocab_ranking
from .sampling import SamplingParams
from .sequence import Sequence

METHODS = ("none", "draft", "ngram")
MAX_K = 64


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


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a model folder without tokenizer files
        return None


def _eos_ids(path: str, config) -> frozenset[int]:
    ids = getattr(config, "eos_token_id", None)
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        from transformers import GenerationConfig

        try:
            ids = GenerationConfig.from_pretrained(path).eos_token_id
        except Exception:  # noqa: BLE001 - fall back to config.json's value
            pass
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


class LeapDecoder:
    """A target model, an optional draft model, and their tokenizer.

    >>> dec = LeapDecoder.from_pretrained("models/leap-code-target", draft="models/leap-code-draft")
    >>> out = dec.generate("def fib(n):", method="draft", k=4, max_new_tokens=64)
    >>> out.text, out.stats.mean_accepted_tokens
    """

    def __init__(
        self,
        target: CausalLM,
        tokenizer,
        eos_token_ids,
        draft: CausalLM | None = None,
        draft_vocab_ranking: dict | None = None,
    ):
        self.target = target
        self.draft = draft
        self.draft_vocab_ranking = draft_vocab_ranking  # see proposers/draft_model.py
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None = None,
        backend: str = "native",
        device: str = "cpu",
        dtype: str = "auto",
        draft_dtype: str | None = None,
    ) -> LeapDecoder:
        """dtype: float32 | bfloat16 | float16 | auto (the checkpoint's own);
        draft_dtype: the draft's, when it differs (default: the same as dtype)."""
        target_model = load_model(target, backend, device, dtype, what="target")
        tokenizer = _load_tokenizer(target)
        draft_model = None
        if draft is not None:
            draft_model = load_model(draft, backend, device, draft_dtype or dtype, what="draft")
            _check_same_vocab(target, tokenizer, draft)
        ranking = read_vocab_ranking(draft)
        return cls(
            target_model, tokenizer, _eos_ids(target, target_model.config), draft_model, ranking
        )

    # ----------------------------------------------------------------- helpers
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LeapDecodeError(
                    "the target folder has no tokenizer files: pass token ids instead of text"
                )
            if not prompt:
                raise LeapDecodeError("the prompt is empty: give at least one character")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise LeapDecodeError("token ids must be integers")
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise LeapDecodeError(
                    f"token id {bad[0]} is outside the vocabulary (0..{self.target.vocab_size - 1})"
                )
        if not ids:
            raise LeapDecodeError("the prompt is empty: give at least one token")
        if len(ids) >= self.target.max_context:
            raise LeapDecodeError(
                f"the prompt has {len(ids)} tokens but the model's context is "
                f"{self.target.max_context}: shorten the prompt"
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def set_draft_vocab(self, draft_vocab: int | None) -> None:
        """Give the draft the `draft_vocab` most frequent tokens only (None: the draft
        folder's recommendation, if it has a ranking; 0: the whole vocabulary)."""
        ranking = self.draft_vocab_ranking
        n = (ranking or {}).get("recommended", 0) if draft_vocab is None else draft_vocab
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise LeapDecodeError(f"draft_vocab must be an integer >= 0, got {n!r}")
        if n and ranking is None:
            raise LeapDecodeError(
                "draft_vocab needs a token ranking (draft_vocab.json) in the draft folder: "
                "`leapdecode train draft` writes one; or pass draft_vocab=0"
            )
        if n == 0 or n >= self.target.vocab_size:
            if self.draft.head_ids is not None:
                self.draft.restrict_head(None)
            return
        head = self.draft.head_ids
        if head is None or len(head) != n:
            ids = torch.tensor(sorted(ranking["ranked_token_ids"][:n]), dtype=torch.long)
            self.draft.restrict_head(ids)

    def make_proposer(
        self,
        method: str,
        ngram_min: int = 2,
        ngram_max: int = 4,
        draft_min_prob: float = 0.0,
        draft_vocab: int | None = None,
    ) -> Proposer:
        if method == "none":
            return NoProposer()
        if method == "ngram":
            return NgramProposer(ngram_min, ngram_max)
        if method == "draft":
            if self.draft is None:
                raise LeapDecodeError("method 'draft' needs a draft model: pass --draft PATH")
            self.set_draft_vocab(draft_vocab)
            return DraftModelProposer(self.draft, self.target.vocab_size, draft_min_prob)
        raise LeapDecodeError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")

    def _sequences(self, prompts, max_new_tokens, params, stop, stop_token_ids) -> list[Sequence]:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise LeapDecodeError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise LeapDecodeError("stop strings must be non-empty strings")
        if stop_strings and self.tokenizer is None:
            raise LeapDecodeError("stop strings need a tokenizer in the target folder")
        stops = self.eos_token_ids | frozenset(stop_token_ids or ())
        seqs = []
        for i, prompt in enumerate(prompts):
            ids = self.encode(prompt)
            # Row i of a seeded batch uses seed + i, so that rows differ but runs repeat.
            seed = params.seed + i if params.seed is not None else random.randrange(2**62)
            seqs.append(
                Sequence(
                    id=i,
                    slot=i,
                    tokens=list(ids),
                    prompt_len=len(ids),
                    params=params,
                    max_new_tokens=max_new_tokens,
                    max_context=self.target.max_context,
                    stop_token_ids=stops,
                    stop_strings=stop_strings,
                    decode=self.decode,
                    generator=torch.Generator().manual_seed(seed),
                )
            )
        return seqs

    def _result(self, s: Sequence) -> GenerationResult:
        text = self.decode(s.output)
        if s.finish_reason == "stop" and s.stop_strings:
            cuts = [text.find(x) for x in s.stop_strings if x in text]
            if cuts:
                text = text[: min(cuts)]
        return GenerationResult(text, s.output, s.finish_reason or "length", s.stats)

    # --------------------------------------------------------------------- API
    def _start(
        self,
        prompts: list[str | list[int]],
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
        draft_vocab: int | None = None,
    ):
        """Validate the options, build the sequences and the step iterator.

        method: none | draft | ngram; k: draft tokens per step (0..64); temperature 0 is
        greedy; stop: strings that end generation (cut from the text); stop_token_ids: token
        ids that end it besides EOS. A seeded batch gives row i the seed `seed + i`.
        """
        if not prompts:
            raise LeapDecodeError("no prompts given")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K:
            raise LeapDecodeError(f"k must be an integer in 0..{MAX_K}, got {k!r}")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if not isinstance(draft_min_prob, int | float) or not 0 <= draft_min_prob < 1:
            raise LeapDecodeError(f"draft_min_prob must be in [0, 1), got {draft_min_prob!r}")
        proposer = self.make_proposer(method, ngram_min, ngram_max, draft_min_prob, draft_vocab)
        seqs = self._sequences(prompts, max_new_tokens, params, stop, stop_token_ids)
        steps = Engine(self.target, proposer).run(seqs, 0 if method == "none" else k)
        return seqs, steps

    def generate_batch(self, prompts: list[str | list[int]], **kwargs) -> list[GenerationResult]:
        """Generate for several prompts in one batch; one result per prompt, in order."""
        seqs, steps = self._start(prompts, **kwargs)
        for _ in steps:
            pass
        return [self._result(s) for s in seqs]

    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Generate for one prompt (text or token ids).

        Options: method (none | draft | ngram), k, max_new_tokens, temperature, top_p, top_k,
        seed, stop, stop_token_ids, ngram_min, ngram_max, draft_min_prob, draft_vocab;
        see the README.
        """
        return self.generate_batch([prompt], **kwargs)[0]

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; they join to `generate(...).text`."""
        [seq], steps = self._start([prompt], **kwargs)
        sent = ""
        # Hold back anything that may still become a stop string, and a partial character.
        hold = max((len(x) for x in seq.stop_strings), default=0)
        for _ in steps:
            if seq.finished:
                break
            text = self.decode(seq.output)
            ready = (text[: len(text) - hold] if hold else text).rstrip("\ufffd")
            if len(ready) > len(sent) and ready.startswith(sent):
                yield ready[len(sent) :]
                sent = ready
        final = self._result(seq).text
        if len(final) > len(sent) and final.startswith(sent):
            yield final[len(sent) :]


def _check_same_vocab(target: str, target_tok, draft: str) -> None:
    draft_tok = _load_tokenizer(draft)
    if target_tok is None or draft_tok is None:
        return  # nothing to compare: token ids are shared by construction
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise LeapDecodeError(
            f"the draft {draft!r} uses a different tokenizer from the target {target!r}: "
            "speculative decoding needs the same vocabulary; pick a draft from the same family"
        )
