"""The Python API: load a target (and optionally a draft), generate or stream."""

from __future__ import annotations

import os
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import torch

from .config import DRAFT_CONTEXT, MAX_K, SEED_MAX, SamplingParams
from .engine import Engine
from .errors import LeapDecodeError
from .frontend import Frontend, GenerationResult, TextStream, load_tokenizer
from .models import CausalLM, load_model
from .models.heads import beside, load_found, load_heads
from .proposers.draft_model import read_vocab_ranking
from .proposers.pard import mask_token
from .proposers.suffix import token_strings
from .resolve import resolve_model
from .sequence import Sequence
from .threads import set_threads

__all__ = ["GenerationResult", "LeapDecoder", "MAX_K"]


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
        pard: CausalLM | None = None,
        pard_vocab_ranking: dict | None = None,
        max_model_len: int | None = None,
        kv_cache_memory: int | str | None = None,
        draft_context: int | None = DRAFT_CONTEXT,
    ):
        self.target = target
        self.speculators = dict(speculators or {})  # {"medusa": heads, "eagle": head}
        self.draft = draft
        self.draft_vocab_ranking = draft_vocab_ranking  # see proposers/draft_model.py
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise LeapDecodeError(
                f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}", field="max_num_seqs"
            )
        self.max_num_seqs = max_num_seqs
        if draft is not None:
            _restrict_head(draft, draft_vocab_ranking, draft_vocab, target.vocab_size)
        if pard is not None:  # the folder's own recommendation
            _restrict_head(pard, pard_vocab_ranking, None, target.vocab_size)
        self._engine: Engine | None = None
        self._engine_options = dict(
            suffix_decoding_max_tree_depth=suffix_decoding_max_tree_depth,
            suffix_decoding_max_cached_requests=suffix_decoding_max_cached_requests,
            medusa=self.speculators.get("medusa"),
            eagle=self.speculators.get("eagle"),
            peagle=self.speculators.get("peagle"),
            pard=pard,
            max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory,
            draft_context=draft_context,
            # each token's characters, for matching the text on them (without a tokenizer:
            # tokens only)
            token_strings=None
            if tokenizer is None
            else token_strings(tokenizer, target.vocab_size),
        )
        self.engine  # noqa: B018 - build it now: its settings are checked here
        self.frontend = Frontend(
            tokenizer, self.eos_token_ids, target.vocab_size, target.max_context, self.engine.check
        )

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None = None,
        backend: str = "native",
        device: str | None = None,
        dtype: str = "auto",
        draft_dtype: str | None = None,
        quantize: str | None = None,
        draft_quantize: str | None = None,
        draft_vocab: int | None = None,
        max_num_seqs: int = 16,
        threads: int | None = None,
        suffix_decoding_max_tree_depth: int = 24,
        suffix_decoding_max_cached_requests: int = 10_000,
        speculators: str | list[str] | None = None,
        compile: bool = False,
        pard: str | None = None,
        max_model_len: int | None = None,
        kv_cache_memory: int | str | None = None,
        draft_context: int | None = DRAFT_CONTEXT,
    ) -> LeapDecoder:
        """device: cpu | cuda (default: $LEAPDECODE_DEVICE, else cpu: the whole test suite
        runs on a GPU with LEAPDECODE_DEVICE=cuda);
        dtype: float32 | bfloat16 | float16 | auto (the checkpoint's own);
        draft_dtype: the draft's, when it differs (default: the same as dtype);
        quantize / draft_quantize: "int8" or "int4", weight-only quantization of the target's /
        the draft's linear layers at load (native backend, bfloat16 or float16; lossless
        against the quantized model's own output; models/quant.py);
        draft_vocab: the draft proposes only its N most frequent tokens (default: the draft
        folder's recommendation; 0: all), set once for every request;
        draft_context: the most tokens of a sequence the draft model is fed at once (its
        first tokens and a recent window: a long prompt's draft prefill stays short; 0: all);
        max_num_seqs: KV slots, the most sequences decoded together;
        threads: CPU threads for torch (default: see leapdecode.threads);
        suffix_decoding_max_tree_depth / _max_cached_requests: the suffix method's tries
        (vLLM's names and defaults): longest substring counted, and how many finished
        requests' outputs the global trie keeps (FIFO; 0: none);
        speculators: folders of Medusa / EAGLE / P-EAGLE heads trained on this target
        (default: those beside it, `<target>-medusa`, `-eagle`, `-peagle`, when the backend
        can run them; []: none);
        pard: a parallel draft model (PARD: its config.json names its mask token), loaded
        beside the draft with its own cache for `method="pard"` (and auto);
        compile: run the target's decode and verify steps through torch.compile (native
        backend, full attention): compiled before this returns, about a minute a graph the
        first time and seconds once cached (docs/compiled_step.md has the figures);
        max_model_len: the longest sequence, prompt and output (vLLM's name; default: the
        longest whose KV caches, max_num_seqs slots in every model that keeps one, fit
        kv_cache_memory, a multiple of 256, at most the model's own context);
        kv_cache_memory: the KV caches' budget, bytes or a size such as "4GiB" or "512MiB"
        (default: half the memory free once the weights are loaded, 80% of the GPU's free
        memory on CUDA; leapdecode.memory)."""
        set_threads(threads)
        device = device or os.environ.get("LEAPDECODE_DEVICE") or "cpu"
        # the edge: a folder, a .gguf file, a catalogue name or a Hub id becomes a folder here
        target = resolve_model(target, "target")
        draft = None if draft is None else resolve_model(draft, "draft")
        pard = None if pard is None else resolve_model(pard, "pard")
        if speculators is not None:  # a head folder goes as it is: load_heads checks it
            speculators = [
                s if os.path.isdir(s) else resolve_model(s, "speculator")
                for s in ([speculators] if isinstance(speculators, str) else speculators)
            ]
        target_model = load_model(target, backend, device, dtype, "target", quantize)
        tokenizer = load_tokenizer(target)
        draft_model = None
        if draft is not None:
            draft_model = load_model(
                draft, backend, device, draft_dtype or dtype, "draft", draft_quantize
            )
            _check_same_vocab(target, tokenizer, draft)
        ranking = read_vocab_ranking(draft)
        pard_model = None
        if pard is not None:
            pard_model = load_model(pard, backend, device, draft_dtype or dtype, what="pard")
            _check_same_vocab(target, tokenizer, pard)
            if mask_token(pard_model.config) is None:
                raise LeapDecodeError(
                    f"--pard {pard!r} is not a parallel draft: its config.json names no mask "
                    "token (pard_token or mask_token_id); pass a folder `leapdecode train "
                    "pard` wrote, or pass it as --draft"
                )
        if isinstance(max_model_len, int) and max_model_len >= 2:  # the heads fit it, not more
            target_model.limit_context(max_model_len)
        heads = _speculators(speculators, target, target_model)
        dec = cls(
            target_model,
            tokenizer,
            _eos_ids(target, target_model.config),
            draft_model,
            ranking,
            draft_vocab,
            max_num_seqs,
            suffix_decoding_max_tree_depth,
            suffix_decoding_max_cached_requests,
            heads,
            pard_model,
            read_vocab_ranking(pard),
            max_model_len,
            kv_cache_memory,
            draft_context,
        )
        if compile:
            dec.engine.compile()
        return dec

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(
                self.target, self.draft, self.max_num_seqs, **self._engine_options
            )
        return self._engine

    # ----------------------------------------------------------------- helpers
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        return self.frontend.encode(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.frontend.decode(ids)

    def request(self, prompt: str | list[int], **options) -> Sequence:
        """A validated request for the engine; see `Frontend.request` for the options."""
        return self.frontend.request(prompt, **options)

    def result(self, s: Sequence) -> GenerationResult:
        return self.frontend.result(s)

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
        seqs = [
            self.request(p, seed=None if seed is None else seed + i, **options)
            for i, p in enumerate(prompts)
        ]
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
        text = TextStream(seq, self.decode, self.result)
        for _ in self._run([seq]):
            if seq.finished:
                break
            if piece := text.piece():
                yield piece
        if rest := text.rest():
            yield rest


def _restrict_head(model: CausalLM, ranking: dict | None, n: int | None, vocab: int) -> None:
    """Give a draft model the `n` most frequent tokens only (None: its folder's
    recommendation, if it has a ranking; 0: the whole vocabulary). Done once: the draft is
    shared by every request."""
    asked = n
    n = (ranking or {}).get("recommended", 0) if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise LeapDecodeError(
            f"draft_vocab must be an integer >= 0, got {n!r}", field="draft_vocab"
        )
    if n and ranking is None:
        raise LeapDecodeError(
            "draft_vocab needs a token ranking (draft_vocab.json) in the draft folder: "
            "`leapdecode train draft-vocab --draft FOLDER` writes one; or pass draft_vocab=0",
            field="draft_vocab",
        )
    if n == 0 or n >= vocab:
        model.restrict_head(None)
        return
    ids = torch.tensor(sorted(ranking["ranked_token_ids"][:n]), dtype=torch.long)
    try:
        model.restrict_head(ids)
    except LeapDecodeError:
        if asked is not None:  # asked for by the caller: say it cannot be had
            raise
        model.restrict_head(None)  # only the folder's suggestion: the whole vocabulary


def _speculators(speculators, target: str, model: CausalLM) -> dict:
    """The heads asked for (folders), or, by default, those found beside the target where its
    backend can run them."""
    if speculators is None:
        return load_found(beside(target) if model.name == "native" else [], model)
    paths = [speculators] if isinstance(speculators, str) else list(speculators)
    return load_heads(paths, model)


def _check_same_vocab(target: str, target_tok, draft: str) -> None:
    draft_tok = load_tokenizer(draft)
    if target_tok is None or draft_tok is None:
        return  # nothing to compare: token ids are shared by construction
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise LeapDecodeError(
            f"the draft {draft!r} uses a different tokenizer from the target {target!r}: "
            "speculative decoding needs the same vocabulary; pick a draft from the same family"
        )
