"""Rotary position tables, for every RoPE type `transformers` knows (Llama-3 scaling included)."""

from __future__ import annotations

import torch


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], attention_scaling) exactly as `transformers` computes them."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}  # transformers < 5
    rope_type = (
        params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    )
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"RoPE type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rope_tables(config, head_dim: int, max_positions: int, dtype: torch.dtype):
    """cos and signed sin tables, each [max_positions, head_dim].

    The signed sin lets the rotation be `x * cos + roll(x, D/2) * sin_signed`, which equals
    the usual `x * cos + rotate_half(x) * sin` term by term.
    """
    inv_freq, scaling = inverse_frequencies(config, head_dim)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    cos = emb.cos() * scaling
    sin = emb.sin() * scaling
    half = head_dim // 2
    sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos.to(dtype), sin_signed.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos, sin_signed [B, T, 1, D]."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed
