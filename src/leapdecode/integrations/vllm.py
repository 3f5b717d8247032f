"""leapdecode's draftless proposers inside vLLM (its `custom_class` speculative method).

    vllm serve MODEL --speculative-config \\
        '{"method": "custom_class", "model": "leapdecode.integrations.vllm.SuffixProposer",
          "num_speculative_tokens": 16}'

- `SuffixProposer`: suffix decoding with leapdecode's character matching (the text is also
  matched on its characters, which finds the source again right after an edit changed the
  tokens: proposers/char_lookup.py), beside the per-request and global suffix tries.
  Options from vLLM's own suffix fields: `suffix_decoding_max_tree_depth`,
  `suffix_decoding_max_cached_requests`, `suffix_decoding_max_spec_factor`,
  `suffix_decoding_min_token_prob`.
- `NgramProposer`: prompt lookup with leapdecode's incremental n-gram index (O(1) work per
  new token; vLLM's own searches the whole context each step). vLLM clears
  `prompt_lookup_min` / `prompt_lookup_max` for custom classes, so the n range comes from
  `LEAPDECODE_PROMPT_LOOKUP_MIN` / `_MAX` (default 2 and 4, as leapdecode's `ngram`).

vLLM builds the class with its `VllmConfig` and calls, after each step,
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)`:
row i of the batch has committed `token_ids_cpu[i, :num_tokens_no_spec[i]]` (the tokens
just sampled included) and drafts only if `sampled_token_ids[i]` is not empty. It gives no
request ids and no "finished" call, and rows move when requests finish, so `Rows` ties a row
to a request by its tokens: a row whose tokens still begin with what the request had is
that request; anything else is a new request (its prompt: the tokens before the ones just
sampled). A request no row has shown for a while is removed. A wrong guess costs draft
quality only: the target verifies every draft, so the output stays the target's own.

vLLM itself is never imported here: the classes read the config's attributes only.
"""

from __future__ import annotations

import itertools
import os

from ..config import MAX_K, SamplingParams, SpecConfig
from ..errors import LeapDecodeError
from ..proposers.ngram import NgramProposer as _Ngram
from ..proposers.suffix import SuffixProposer as _Suffix
from ..proposers.suffix import token_strings
from ..sequence import Sequence

HEAD = 32  # tokens at each end of a request's text checked to tie a row to it
GRACE = 64  # propose calls a request may go unseen (waiting, preempted) before it is dropped


class Rows:
    """Which leapdecode Sequence each row of vLLM's batch is, from the rows' tokens."""

    def __init__(self, spec: SpecConfig, max_model_len: int) -> None:
        self.spec, self.max_model_len = spec, max_model_len
        self.live: dict[int, Sequence] = {}  # id -> request
        self.at_row: dict[int, Sequence] = {}  # row -> the request it held last call
        self.last_seen: dict[int, int] = {}  # id -> the call that last showed it
        self.claimed: set[int] = set()  # ids matched to a row in this call
        self.ids = itertools.count()
        self.calls = 0

    def sync(self, row: int, ctx, n_new: int) -> tuple[Sequence, bool]:
        """The request in `row` whose committed tokens are ctx (numpy [n]), the last n_new of
        them just sampled: brought up to date, and whether it is new."""
        seq = self.at_row.get(row)
        if seq is None or not self._continues(seq, ctx):
            seq = next((s for s in self.live.values() if self._continues(s, ctx)), None)
        new = seq is None
        if new:
            n = len(ctx)
            seq = Sequence(
                id=next(self.ids),
                tokens=ctx.tolist(),
                prompt_len=max(1, n - n_new),
                params=SamplingParams(),
                max_new_tokens=self.max_model_len,
                max_context=self.max_model_len,
                stop_token_ids=frozenset(),
                spec=self.spec,
            )
            self.live[seq.id] = seq
        else:
            seq.tokens.extend(ctx[len(seq.tokens) :].tolist())
        self.at_row[row] = seq
        self.claimed.add(seq.id)
        self.last_seen[seq.id] = self.calls
        return seq, new

    def _continues(self, seq: Sequence, ctx) -> bool:
        """ctx begins with seq's tokens (their first and last HEAD checked: a request's
        tokens never change, they only grow), and no other row took seq in this call."""
        m = len(seq.tokens)
        if m > len(ctx) or seq.id in self.claimed:
            return False
        lo = max(0, m - HEAD)
        return (
            ctx[: min(m, HEAD)].tolist() == seq.tokens[:HEAD]
            and ctx[lo:m].tolist() == seq.tokens[lo:]
        )

    def end_call(self) -> list[Sequence]:
        """Close this call: the requests no row has shown for GRACE calls (finished or
        aborted) are forgotten and returned."""
        self.calls += 1
        self.claimed.clear()
        cut = self.calls - GRACE
        gone = [s for s in self.live.values() if self.last_seen[s.id] < cut]
        for s in gone:
            del self.live[s.id], self.last_seen[s.id]
        if gone:
            ids = {s.id for s in gone}
            self.at_row = {r: s for r, s in self.at_row.items() if s.id not in ids}
        return gone


class _Custom:
    """vLLM's custom proposer interface over one leapdecode proposer."""

    method = ""

    def __init__(self, vllm_config) -> None:
        spec_cfg = getattr(vllm_config, "speculative_config", None)
        model_cfg = getattr(vllm_config, "model_config", None)
        k = getattr(spec_cfg, "num_speculative_tokens", None)
        if spec_cfg is None or model_cfg is None or not isinstance(k, int) or k < 1:
            raise LeapDecodeError(
                f"leapdecode's {self.method} proposer needs vLLM's speculative_config with "
                '"method": "custom_class" and "num_speculative_tokens" >= 1'
            )
        if k > MAX_K:
            raise LeapDecodeError(f"num_speculative_tokens must be in 1..{MAX_K}, got {k}")
        self.k = k
        self.max_model_len = int(model_cfg.max_model_len)
        self.spec = SpecConfig(
            method=self.method, num_speculative_tokens=k, **self._options(spec_cfg)
        )
        self.rows = Rows(self.spec, self.max_model_len)
        self.proposer = self._build(spec_cfg, model_cfg)

    def _options(self, spec_cfg) -> dict:
        return {}

    def _build(self, spec_cfg, model_cfg):
        raise NotImplementedError

    def load_model(self, *args, **kwargs) -> None:
        """vLLM calls this with the target; there is no model to load."""

    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_
    ) -> list[list[int]]:
        """Drafts per row: [num rows][<= k] token ids (empty: no draft for that row)."""
        out: list[list[int]] = []
        seqs, ks, rows = [], [], []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            room = min(self.k, self.max_model_len - n)
            out.append([])
            if not sampled or room <= 0:
                continue
            seq, new = self.rows.sync(i, token_ids_cpu[i, :n], len(sampled))
            if new:
                self.proposer.add([seq])
            seqs.append(seq)
            ks.append(room)
            rows.append(i)
        if seqs:
            drafts = self.proposer.propose(seqs, ks)
            counts = drafts.counts.tolist()
            tokens = drafts.tokens.tolist()
            for j, i in enumerate(rows):
                out[i] = tokens[j][: counts[j]]
        gone = self.rows.end_call()
        if gone:
            self.proposer.remove(gone)
        return out


class SuffixProposer(_Custom):
    """Suffix decoding with character matching (see the module notes)."""

    method = "suffix"

    def _options(self, spec_cfg) -> dict:
        return dict(
            suffix_decoding_max_spec_factor=float(
                getattr(spec_cfg, "suffix_decoding_max_spec_factor", 1.0)
            ),
            suffix_decoding_min_token_prob=float(
                getattr(spec_cfg, "suffix_decoding_min_token_prob", 0.1)
            ),
        )

    def _build(self, spec_cfg, model_cfg):
        depth = int(getattr(spec_cfg, "suffix_decoding_max_tree_depth", 24))
        cached = int(getattr(spec_cfg, "suffix_decoding_max_cached_requests", 10_000))
        if depth < 1 or cached < 0:
            raise LeapDecodeError(
                "suffix_decoding_max_tree_depth must be >= 1 and "
                "suffix_decoding_max_cached_requests >= 0"
            )
        vocab = model_cfg.get_vocab_size() if hasattr(model_cfg, "get_vocab_size") else 0
        strings = load_token_strings(
            getattr(model_cfg, "tokenizer", None) or model_cfg.model, vocab
        )
        return _Suffix(max_depth=depth, max_cached_requests=cached, token_strings=strings)


class NgramProposer(_Custom):
    """Prompt lookup with leapdecode's incremental index (see the module notes)."""

    method = "ngram"

    def _options(self, spec_cfg) -> dict:
        def env(name: str, default: int) -> int:
            text = os.environ.get(name, str(default))
            try:
                return int(text)
            except ValueError:
                raise LeapDecodeError(f"{name} must be an integer, got {text!r}") from None

        return dict(
            prompt_lookup_min=env("LEAPDECODE_PROMPT_LOOKUP_MIN", 2),
            prompt_lookup_max=env("LEAPDECODE_PROMPT_LOOKUP_MAX", 4),
        )

    def _build(self, spec_cfg, model_cfg):
        return _Ngram()


def load_token_strings(tokenizer_path: str, vocab: int) -> list[str] | None:
    """Each token id's string, as LeapDecoder gives its suffix proposer; None (tokens only)
    when there is no tokenizer to read. Local files only: vLLM has the model's files on disk
    (a folder, or its hub cache) by the time it builds a proposer, and a name that is not
    there must not wait on the network (a minute of retries where the hub is unreachable)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - characters are an addition; tokens still match
        return None
    return token_strings(tok, vocab or len(tok))
