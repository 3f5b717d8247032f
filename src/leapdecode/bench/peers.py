"""Hugging Face transformers' own decoding, on the same checkpoints: the peers we compare with.

- `hf-generate`:  `generate()` greedy, the baseline most users know;
- `hf-assisted`:  `generate(assistant_model=draft)`, assisted generation, k drafts a step
                  (constant schedule, and the same confidence cut-off as ours, none by
                  default, so k means the same);
- `hf-lookup`:    `generate(prompt_lookup_num_tokens=k)`, prompt lookup decoding.

Each run counts the target's forward passes (a forward hook), so tokens per target forward
is reported for the peers too.
"""

from __future__ import annotations

import torch

from ..models.loader import resolve_dtype


class HFPeers:
    def __init__(self, target: str, draft: str | None, dtype: str, draft_dtype: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        t_dtype = resolve_dtype(dtype, AutoConfig.from_pretrained(target))
        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=t_dtype).eval()
        self.draft = None
        if draft is not None:
            d_dtype = resolve_dtype(draft_dtype, AutoConfig.from_pretrained(draft))
            self.draft = AutoModelForCausalLM.from_pretrained(draft, dtype=d_dtype).eval()
        self.forwards = 0
        self.target.register_forward_hook(self._count)

    def _count(self, *_):
        self.forwards += 1

    @torch.inference_mode()
    def generate(
        self,
        ids: list[int],
        method: str,
        k: int,
        max_new_tokens: int,
        min_prob: float = 0.0,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> tuple[list[int], int]:
        """Tokens after the prompt (greedy, or sampled at `temperature` from `seed`), and the
        target forwards it took."""
        x = torch.tensor([ids])
        kwargs = dict(
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature or None,
            top_p=None,
            top_k=None,
        )
        if temperature > 0:
            torch.manual_seed(seed)  # transformers samples from torch's global generator
        if method == "hf-assisted":
            # transformers reads these from the *assistant's* generation config (defaults: 20
            # tokens and a 0.4 confidence cut-off), not from generate()'s arguments.
            gc = self.draft.generation_config
            gc.num_assistant_tokens = k
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = min_prob
            kwargs.update(assistant_model=self.draft)
        elif method == "hf-lookup":
            kwargs.update(prompt_lookup_num_tokens=k)
        self.forwards = 0
        out = self.target.generate(x, **kwargs)
        return out[0, len(ids) :].tolist(), self.forwards
