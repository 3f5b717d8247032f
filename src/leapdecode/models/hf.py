"""Fallback backend: any `transformers.AutoModelForCausalLM`, one `DynamicCache` per slot.

Rows of a batch run one after another (each with its own cache), which keeps per-sequence
positions trivially right; rollback is `DynamicCache.crop`.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ..errors import LeapDecodeError
from .base import CausalLM


class TransformersLM(CausalLM):
    name = "transformers"

    def __init__(self, path: str, config, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.path = path
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        self.model_max_context = self.max_context
        params = inspect.signature(self.model.forward).parameters
        # transformers >= 5.2x names the argument `cache`; older releases `past_key_values`.
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.caches: list[DynamicCache] = []
        self.lens = torch.zeros(0, dtype=torch.long)

    def allocate(self, n_slots: int, max_len: int) -> None:
        self.caches = [DynamicCache(config=self.model.config) for _ in range(n_slots)]
        self.lens = torch.zeros(n_slots, dtype=torch.long)

    def lengths(self, slots: torch.Tensor) -> torch.Tensor:
        return self.lens[slots.cpu()]

    def truncate(self, slots: torch.Tensor, new_lengths: torch.Tensor) -> None:
        for slot, n in zip(slots.tolist(), new_lengths.tolist(), strict=True):
            if n == 0:  # a fresh request in this slot
                self.caches[slot] = DynamicCache(config=self.model.config)
                self.lens[slot] = 0
                continue
            extra = int(self.lens[slot]) - n
            if extra > 0:
                self.caches[slot].crop(-extra)  # a negative count removes that many tokens
            self.lens[slot] = n

    @torch.inference_mode()
    def forward(
        self, tokens, slots, tree_mask=None, position_offsets=None, logits_at=None, counts=None
    ):  # counts: the padding runs too (packs_rows is False)
        if tree_mask is not None or position_offsets is not None:
            raise LeapDecodeError(
                "the transformers backend does not support tree attention; use --backend native"
            )
        out = []
        tokens = tokens.to(self.device)
        for row, slot in enumerate(slots.tolist()):
            logits = self.model(
                input_ids=tokens[row : row + 1],
                use_cache=True,
                **{self.cache_arg: self.caches[slot]},
            ).logits  # [1, T, V]
            if logits_at is not None:
                logits = logits[:, int(logits_at[row])][:, None]  # [1, 1, V]
            out.append(logits)
            self.lens[slot] += tokens.shape[1]
        return torch.cat(out).float()
