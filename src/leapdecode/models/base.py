"""The interface every model backend offers to the engine and to drafters.

A backend owns one KV cache with a fixed number of *slots* (one per sequence of a batch).
`forward` appends new tokens after each slot's cached prefix and returns their logits;
`truncate` rolls a slot back in O(1). Positions are per sequence, so a batch can hold
sequences of different lengths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HiddenRequest:
    """Which hidden states a proposer needs from the target's forward (as transformers'
    `requires_model_outputs`): `layers` index the residual stream *entering* each layer
    (0 = the embeddings; vLLM's aux hidden state layer ids and transformers'
    `hidden_states[i]` for i < num_layers; num_layers = after the last layer, *before* the
    final norm, where transformers' last entry is after it);
    `final`: the last hidden state after the final norm (what the LM head sees)."""

    layers: tuple[int, ...] = ()
    final: bool = False

    def union(self, other: HiddenRequest) -> HiddenRequest:
        return HiddenRequest(
            tuple(sorted(set(self.layers) | set(other.layers))), self.final or other.final
        )

    def __bool__(self) -> bool:
        return bool(self.layers) or self.final


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, T, V] float32 ([B, 1, V] with logits_at)
    hidden: torch.Tensor | None = None  # [B, T, len(request.layers), H] at every new token
    final: torch.Tensor | None = None  # [B, T, H] after the final norm, at every new token


class CausalLM(ABC):
    """A causal LM with a per-slot KV cache."""

    name: str  # "native" or "transformers"
    vocab_size: int  # logits width (may exceed the tokenizer's size: padded embeddings)
    max_context: int  # longest sequence it runs: model_max_context, or less (limit_context)
    model_max_context: int  # the longest sequence the model itself supports (its config's)
    path: str | None = None  # the folder it was loaded from
    device: torch.device
    dtype: torch.dtype
    config: object  # the transformers config object
    head_ids: torch.Tensor | None = None  # [V_sub] token ids the logits cover (None: all)
    # every row of a step computes the bits a one-row step computes (the native backend's
    # bfloat16 / float16 on CPU): a target's verify rows must, or ties break otherwise. A
    # draft need not (its proposals are checked, never kept unchecked): the proposer turns it
    # off, before the cache is allocated
    exact_rows = False

    @property
    def packs_rows(self) -> int:
        """The most tokens a row may have for `forward(..., counts=...)` to skip the rows'
        padding (a step then costs its real tokens, the sum of the rows' counts, not rows x
        the longest); 0: never. `last_packed` says whether the last forward did."""
        return 0

    last_packed = False

    @property
    def reads_own_context(self) -> bool:
        """Whether a batched step reads each row's own cached context (the CPU attention
        kernel) rather than every row padded to the longest: what prices a step (the
        scheduler's cost model takes the batch's mean length, else its longest)."""
        return False

    def restrict_head(self, token_ids: torch.Tensor | None) -> None:
        """Compute logits only for `token_ids` (a draft's frequent-token head); None: all."""
        from ..errors import LeapDecodeError

        if token_ids is not None:
            raise LeapDecodeError(
                f"a reduced draft vocabulary needs the native backend, not {self.name}: "
                "pass draft_vocab=0 (CLI: --draft-vocab 0)"
            )

    def limit_context(self, n: int | None) -> None:
        """Run sequences of up to `n` tokens (the engine's max_model_len), at most the
        model's own maximum; None: the model's own. What reads `max_context` (requests'
        checks, proposers, the cost model) sees it; the engine sizes the caches to it."""
        own = getattr(self, "model_max_context", None) or self.max_context
        self.model_max_context = own
        self.max_context = own if n is None else min(int(n), own)

    def kv_bytes_per_token(self) -> int:
        """Bytes a cached token takes in this model's KV cache (keys and values of every
        layer; from its config, in the weights' dtype; 0 when the config does not say)."""
        c = self.config
        layers = getattr(c, "num_hidden_layers", None)
        heads = getattr(c, "num_attention_heads", None)
        if not layers or not heads:
            return 0
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return 2 * int(layers) * int(kv_heads) * int(head_dim) * self.dtype.itemsize

    @abstractmethod
    def allocate(self, n_slots: int, max_len: int) -> None:
        """(Re)allocate the cache for `n_slots` sequences of up to `max_len` tokens; empties it."""

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] new tokens, right-padded
        slots: torch.Tensor,  # [B] cache slot of each row
        tree_mask: torch.Tensor | None = None,  # [B, T, T] bool: new token t sees new token s
        position_offsets: torch.Tensor | None = None,  # [B, T] position of each new token
        logits_at: torch.Tensor | None = None,  # [B] compute logits only at this new index
        counts: torch.Tensor | None = None,  # [B] real new tokens per row; the rest padding
    ) -> torch.Tensor:
        """Run the new tokens after each slot's cached prefix and cache their keys/values.

        Returns float32 logits [B, T, V], or [B, 1, V] when `logits_at` is given (V becomes
        len(head_ids) after `restrict_head`).
        Every slot's length grows by T; the caller truncates padding and rejected drafts.
        With `counts` (chains only), a backend that `packs_rows` runs only each row's first
        counts[b] tokens (a slot grows by counts[b]; logits past them are undefined).
        """

    @abstractmethod
    def lengths(self, slots: torch.Tensor) -> torch.Tensor:
        """Cached tokens per slot, [B] (CPU long tensor)."""

    @abstractmethod
    def truncate(self, slots: torch.Tensor, new_lengths: torch.Tensor) -> None:
        """Keep only the first `new_lengths[b]` cached tokens of each slot (rollback)."""

    def forward_outputs(
        self,
        tokens,
        slots,
        hidden: HiddenRequest,
        tree_mask=None,
        position_offsets=None,
        logits_at=None,
        counts=None,
    ) -> ForwardOutput:
        """`forward`, also returning the hidden states `hidden` asks for (at every new token,
        whatever `logits_at` is). Backends that cannot refuse with a clear error."""
        from ..errors import LeapDecodeError

        raise LeapDecodeError(
            f"the {self.name} backend does not return hidden states (needed by medusa and "
            "eagle heads): use --backend native"
        )

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `ids` [...] -> [..., hidden] (native backend)."""
        raise NotImplementedError

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on normed hidden states [..., hidden] -> [..., V] (native backend)."""
        raise NotImplementedError

    def keep(
        self, slots: torch.Tensor, base: torch.Tensor, picked: torch.Tensor, n: torch.Tensor
    ) -> None:
        """After a tree step: slot b keeps the cached entries at base[b] + picked[b, :n[b]]
        (its root and accepted path), moved to base[b] + 0 .. n[b]-1; its length becomes
        base[b] + n[b]. Backends without tree attention refuse."""
        from ..errors import LeapDecodeError

        raise LeapDecodeError(
            f"the {self.name} backend does not support tree attention; use --backend native"
        )
