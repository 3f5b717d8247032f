"""The native backend computes the same logits as `transformers` on the same checkpoint."""

import logging

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from leapdecode.models import load_model
from leapdecode.models.llama import NativeLlama

BASE = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
    high_freq_factor=4.0, original_max_position_embeddings=32,
)  # fmt: skip

CASES = {
    "llama-gqa": (LlamaForCausalLM, LlamaConfig(**BASE)),
    "llama-mha-tied-bias": (
        LlamaForCausalLM,
        LlamaConfig(**{**BASE, "num_key_value_heads": 4}, tie_word_embeddings=True,
                    attention_bias=True, mlp_bias=True),
    ),
    "llama3-rope-scaling": (LlamaForCausalLM, LlamaConfig(**BASE, rope_parameters=LLAMA3_ROPE)),
    "mistral-sliding-window": (MistralForCausalLM, MistralConfig(**BASE, sliding_window=8)),
    "qwen2-qkv-bias": (Qwen2ForCausalLM, Qwen2Config(**BASE)),
    "qwen3-qk-norm": (Qwen3ForCausalLM, Qwen3Config(**BASE, head_dim=24)),
}  # fmt: skip


def _save(cls, config, path):
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
    cls, config = CASES[name]
    ref_model = _save(cls, config, tmp_path)
    native = load_model(str(tmp_path))
    assert isinstance(native, NativeLlama)

    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (3, 40))
    with torch.no_grad():
        ref = ref_model(ids).logits  # [3, 40, V]

    slots = torch.arange(3)
    native.allocate(3, 64)
    full = native.forward(ids, slots)
    assert (full - ref).abs().max().item() < 1e-4

    # Incremental: prefill, a multi-token verify chunk, then single tokens.
    native.allocate(3, 64)
    parts = [native.forward(ids[:, a:b], slots) for a, b in [(0, 25), (25, 33), (33, 34), (34, 40)]]
    assert (torch.cat(parts, dim=1) - ref).abs().max().item() < 1e-4

    # A batch of different lengths (right-padded) equals each sequence on its own.
    native.allocate(3, 64)
    lengths = torch.tensor([40, 17, 29])
    out = native.forward(ids, slots, logits_at=lengths - 1)  # [3, 1, V]
    native.truncate(slots, lengths)
    for b in range(3):
        with torch.no_grad():
            single = ref_model(ids[b : b + 1, : lengths[b]]).logits[0, -1]
        assert (out[b, 0] - single).abs().max().item() < 1e-4
    nxt = torch.randint(0, config.vocab_size, (3, 2))
    step = native.forward(nxt, slots)
    for b in range(3):
        seq = torch.cat([ids[b, : lengths[b]], nxt[b]])[None]
        with torch.no_grad():
            want = ref_model(seq).logits[0, -2:]
        assert (step[b] - want).abs().max().item() < 1e-4

    # Slots with holes between them, out of order (attention runs over the slot range as a
    # view, the holes as dummy rows): the same logits.
    native.allocate(6, 64)
    holey = torch.tensor([4, 1, 2])
    native.forward(ids, holey, logits_at=lengths - 1)
    native.truncate(holey, lengths)
    native.truncate(torch.tensor([3]), torch.tensor([0]))  # an empty slot inside the range
    assert (native.forward(nxt, holey) - step).abs().max().item() < 1e-5


def test_bfloat16_runs_close_to_float32(tmp_path):
    cls, config = CASES["llama-gqa"]
    _save(cls, config, tmp_path)
    ids = torch.randint(0, config.vocab_size, (1, 20))
    out = {}
    for dtype in ("float32", "bfloat16"):
        m = load_model(str(tmp_path), dtype=dtype)
        m.allocate(1, 32)
        out[dtype] = m.forward(ids, torch.tensor([0]))
    assert out["bfloat16"].dtype == torch.float32
    assert (out["bfloat16"] - out["float32"]).abs().max().item() < 0.1


def test_unsupported_architecture_falls_back_with_notice(tmp_path, caplog):
    cfg = GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    ref_model = GPT2LMHeadModel(cfg).eval()
    ref_model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="leapdecode"):
        model = load_model(str(tmp_path))
    assert model.name == "transformers"
    assert "falling back to transformers" in caplog.text
    ids = torch.randint(0, 50, (1, 10))
    model.allocate(1, 32)
    with torch.no_grad():
        ref = ref_model(ids).logits
    assert (model.forward(ids, torch.tensor([0])) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-sliding-window"])
def test_a_fresh_prompt_takes_the_causal_path_with_the_masks_logits(name, tmp_path):
    """A prompt prefilled from an empty cache runs SDPA's own causal path (faster than a
    boolean mask); its logits equal the boolean mask's, holes between slots included; a
    window shorter than the prompt, or a cached prefix, keeps the boolean mask."""
    from leapdecode.models import llama

    cls, config = CASES[name]
    _save(cls, config, tmp_path)
    native = load_model(str(tmp_path))
    ids = torch.randint(0, config.vocab_size, (2, 6))  # within the sliding window (8)
    start = torch.tensor([0, 0])
    masks = native._masks(start, 6, 6, None, torch.arange(6)[None].expand(2, -1), True)
    assert all(m is llama.CAUSAL for m in masks.values())
    cached = native._masks(torch.tensor([3, 3]), 6, 9, None, torch.arange(3, 9)[None], True)
    assert all(isinstance(m, torch.Tensor) for m in cached.values())

    def boolean_only(self, start, n_new, span, tree_mask, query_pos, same_start):
        key = torch.arange(span)
        limit = start[:, None] + torch.arange(n_new)
        return {w: (key[None, None, :] <= limit[:, :, None])[:, None] for w in self.windows}

    out = {}
    for label in ("causal", "mask"):
        if label == "mask":
            native._masks = boolean_only.__get__(native)
        native.allocate(5, 16)
        native.truncate(torch.arange(5), torch.zeros(5, dtype=torch.long))
        out[label] = (native.forward(ids, torch.arange(2)),
                      native.forward(ids, torch.tensor([4, 2])))  # fmt: skip
    for a, b in zip(out["causal"], out["mask"], strict=True):
        assert (a - b).abs().max().item() < 1e-5
