"""The Python API: load a target (and optionally a draft), generate or stream."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from .config import MAX_K, METHODS, SEED_MAX, SamplingParams, SpecConfig, spec_field_names
from .engine import Engine
from .errors import LeapDecodeError
from .metrics import RequestStats
from .models import CausalLM, load_model
from .models.heads import beside, load_found, load_heads
from .proposers.draft_model import read_vocab_ranking
from .sequence import Sequence
from .threads import set_threads

__all__ = ["GenerationResult", "LeapDecoder", "MAX_K", "METHODS"]


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
    """A target model, an optional draft model, their tokenizer, and the engine that runs them.

    >>> dec = LeapDecoder.from_pretrained("models/leap-code-target", draft="models/leap-code-draft")
    >>> out = dec.generate("def fib(n):", method="draft", k=4, max_new_tokens=64)
    >>> out.text, out.stats.mean_accepted_tokens

    Every call goes through one `Engine` (continuous batching over `max_num_seqs` KV
    slots), the same engine the server and the benchmark drive.
    """

    def __init__(
        self,
        target: CausalLM,
        tokenizer,
        eos_token_ids,
        draft: CausalLM | None = None,
        draft_vocab_ranking: dict | None = None,
        draft_vocab: int | None = None,
        max_num_seqs: int = 16,
        suffix_decoding_max_tree_depth: int = 24,
        suffix_decoding_max_cached_requests: int = 10_000,
        speculators: dict | None = None,
    ):
        self.target = target
        self.speculators = dict(speculators or {})  # {"medusa": heads, "eagle": head}
        self.draft = draft
        self.draft_vocab_ranking = draft_vocab_ranking  # see proposers/draft_model.py
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise LeapDecodeError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        self.max_num_seqs = max_num_seqs
        if draft is not None:
            self._configure_draft_head(draft_vocab)
        self._engine: Engine | None = None
        self._engine_options = dict(
            suffix_decoding_max_tree_depth=suffix_decoding_max_tree_depth,
            suffix_decoding_max_cached_requests=suffix_decoding_max_cached_requests,
            medusa=self.speculators.get("medusa"),
            eagle=self.speculators.get("eagle"),
        )
        self.engine  # noqa: B018 - build it now: its settings are checked here
        suffix = self.engine.proposers.get("suffix")
        if suffix is not None and tokenizer is not None:  # each token's characters, for
            # matching the text on them (without a tokenizer: tokens only)
            vocab = self.target.vocab_size
            names = tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(tokenizer)))))
            suffix.token_strings = [n or "" for n in names] + [""] * max(0, vocab - len(names))
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None = None,
        backend: str = "native",
        device: str | None = None,
        dtype: str = "auto",
        draft_dtype: str | None = None,
        draft_vocab: int | None = None,
        max_num_seqs: int = 16,
        threads: int | None = None,
        suffix_decoding_max_tree_depth: int = 24,
        suffix_decoding_max_cached_requests: int = 10_000,
        speculators: str | list[str] | None = None,
    ) -> LeapDecoder:
        """device: cpu | cuda (default: $LEAPDECODE_DEVICE, else cpu: the whole test suite
        runs on a GPU with LEAPDECODE_DEVICE=cuda);
        dtype: float32 | bfloat16 | float16 | auto (the checkpoint's own);
        draft_dtype: the draft's, when it differs (default: the same as dtype);
        draft_vocab: the draft proposes only its N most frequent tokens (default: the draft
        folder's recommendation; 0: all), set once for every request;
        max_num_seqs: KV slots, the most sequences decoded together;
        threads: CPU threads for torch (default: see leapdecode.threads);
        suffix_decoding_max_tree_depth / _max_cached_requests: the suffix method's tries
        (vLLM's names and defaults): longest substring counted, and how many finished
        requests' outputs the global trie keeps (FIFO; 0: none);
        speculators: folders of Medusa / EAGLE heads trained on this target (default: those
        beside it, `<target>-medusa` and `<target>-eagle`, when the backend can run them;
        []: none)."""
        set_threads(threads)
        device = device or os.environ.get("LEAPDECODE_DEVICE") or "cpu"
        target_model = load_model(target, backend, device, dtype, what="target")
        tokenizer = _load_tokenizer(target)
        draft_model = None
        if draft is not None:
            draft_model = load_model(draft, backend, device, draft_dtype or dtype, what="draft")
            _check_same_vocab(target, tokenizer, draft)
        ranking = read_vocab_ranking(draft)
        if speculators is None:  # found beside the target: used where they can run
            found = beside(target) if target_model.name == "native" else []
            heads = load_found(found, target_model)
        else:
            paths = [speculators] if isinstance(speculators, str) else list(speculators)
            heads = load_heads(paths, target_model)
        return cls(target_model, tokenizer, _eos_ids(target, target_model.config), draft_model,
                   ranking, draft_vocab, max_num_seqs, suffix_decoding_max_tree_depth,
                   suffix_decoding_max_cached_requests, heads)  # fmt: skip

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self.target, self.draft, self.max_num_seqs,
                                  **self._engine_options)  # fmt: skip
        return self._engine

    # ----------------------------------------------------------------- helpers
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LeapDecodeError(
                    "the target folder has no tokenizer files (tokenizer.json): copy them into the model "
                    "folder, or pass token ids instead of text (Python API)"
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

    def _configure_draft_head(self, draft_vocab: int | None) -> None:
        """Give the draft the `draft_vocab` most frequent tokens only (None: the draft
        folder's recommendation, if it has a ranking; 0: the whole vocabulary). Done once:
        the draft is shared by every request."""
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
            self.draft.restrict_head(None)
            return
        ids = torch.tensor(sorted(ranking["ranked_token_ids"][:n]), dtype=torch.long)
        try:
            self.draft.restrict_head(ids)
        except LeapDecodeError:
            if draft_vocab is not None:  # asked for by the caller: say it cannot be had
                raise
            self.draft.restrict_head(None)  # only the folder's suggestion: the whole vocabulary

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
            fields = spec_field_names()
            unknown = sorted(set(spec_options) - fields)
            if unknown:
                raise LeapDecodeError(
                    f"unknown option {unknown[0]!r}: generation options are method, k, "
                    "max_new_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, "
                    f"ngram_min, ngram_max, draft_min_prob, spec, or a SpecConfig field "
                    f"({', '.join(sorted(fields))})"
                )
            spec = SpecConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=ngram_min,
                              prompt_lookup_max=ngram_max, draft_min_prob=draft_min_prob,
                              **spec_options)  # fmt: skip
        elif spec_options:
            raise LeapDecodeError("pass either spec= or SpecConfig fields as options, not both")
        self.engine.check(spec)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or max_new_tokens < 1
        ):
            raise LeapDecodeError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stop_strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(x, str) or not x for x in stop_strings):
            raise LeapDecodeError("stop strings must be non-empty strings")
        if stop_strings and self.tokenizer is None:
            raise LeapDecodeError("stop strings need a tokenizer in the target folder")
        bad = [t for t in stop_token_ids or () if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise LeapDecodeError(f"stop_token_ids must be integers, got {bad[0]!r}")
        ids = self.encode(prompt)
        room = self.target.max_context - len(ids)
        if max_new_tokens > room:
            raise LeapDecodeError(
                f"max_new_tokens {max_new_tokens} does not fit: the prompt has {len(ids)} tokens "
                f"and the model's context is {self.target.max_context}, so at most {room} new "
                "tokens fit; lower max_new_tokens or shorten the prompt"
            )
        gen_seed = seed if seed is not None else random.randrange(2**62)
        return Sequence(
            id=next(self._ids),
            tokens=list(ids),
            prompt_len=len(ids),
            params=params,
            max_new_tokens=max_new_tokens,
            max_context=self.target.max_context,
            stop_token_ids=self.eos_token_ids | frozenset(stop_token_ids or ()),
            stop_strings=stop_strings,
            decode=self.decode,
            generator=torch.Generator().manual_seed(gen_seed),
            draft_generator=torch.Generator().manual_seed((gen_seed + 0x5EED) % 2**63),
            spec=spec,
        )

    def result(self, s: Sequence) -> GenerationResult:
        text = self.decode(s.output)
        if s.finish_reason == "stop" and s.stop_strings:
            cuts = [text.find(x) for x in s.stop_strings if x in text]
            if cuts:
                text = text[: min(cuts)]
        return GenerationResult(text, s.output, s.finish_reason or "length", s.stats)

    def _run(self, seqs: list[Sequence]) -> Iterator[None]:
        """Submit `seqs` and step the engine until they are all finished."""
        engine = self.engine
        try:
            for s in seqs:
                engine.add_request(s)
            while not all(s.finished for s in seqs):
                engine.step()
                yield
        finally:
            for s in seqs:  # an error or an abandoned stream: free their slots
                if not s.finished:
                    engine.abort(s.id)

    # --------------------------------------------------------------------- API
    def generate_batch(self, prompts: list[str | list[int]], **options) -> list[GenerationResult]:
        """Generate for several prompts together (submitted at once, stepped until done; rows
        beyond max_num_seqs wait for a free slot). Row i of a seeded batch uses seed + i, so
        it gives what a single generate() with seed + i gives. One result per prompt, in order."""
        if not prompts:
            raise LeapDecodeError("no prompts given")
        seed = options.pop("seed", None)
        if seed is not None:  # rows take seed .. seed + n - 1: the whole range must be valid
            SamplingParams(seed=seed)  # an integer in range, or a clear error
            if seed + len(prompts) - 1 > SEED_MAX:
                raise LeapDecodeError(
                    f"seed {seed} is too large for {len(prompts)} prompts: row i takes seed + i, "
                    f"which must stay <= {SEED_MAX}"
                )
        seqs = [self.request(p, seed=None if seed is None else seed + i, **options)
                for i, p in enumerate(prompts)]  # fmt: skip
        for _ in self._run(seqs):
            pass
        return [self.result(s) for s in seqs]

    def generate(self, prompt: str | list[int], **options) -> GenerationResult:
        """Generate for one prompt (text or token ids).

        Options: method (none | draft | ngram | auto), k, max_new_tokens, temperature, top_p,
        top_k, seed, stop, stop_token_ids, ngram_min, ngram_max, draft_min_prob, spec;
        see `request` and the README.
        """
        return self.generate_batch([prompt], **options)[0]

    def stream(self, prompt: str | list[int], **options) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; they join to `generate(...).text`."""
        seq = self.request(prompt, **options)
        sent = ""
        # Hold back anything that may still become a stop string, and a partial character.
        hold = max((len(x) for x in seq.stop_strings), default=0)
        for _ in self._run([seq]):
            if seq.finished:
                break
            text = self.decode(seq.output)
            ready = (text[: len(text) - hold] if hold else text).rstrip("\ufffd")
            if len(ready) > len(sent) and ready.startswith(sent):
                yield ready[len(sent) :]
                sent = ready
        final = self.result(seq).text
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
