"""The few tensor operations the native backend, its compiled forward and the speculator heads
share: a linear layer over either weight layout, and RMSNorm as transformers computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def transposed(w: torch.Tensor) -> bool:
    """Weight layout: float32 on CPU is kept transposed ([in, out]); all else [out, in].

    float32 on CPU: the one-row decode matmul with [in, out] weights streams the matrix and
    runs about twice as fast as `F.linear` (bench/backend_step.py measures it). bfloat16 and
    float16 on CPU go to oneDNN through `F.linear`, whose cost stays nearly flat from 1 to 16
    rows (the verify forward) and gives each row the same bits whatever the row count.
    CUDA: `F.linear` (cuBLAS) either way.
    """
    return w.dtype == torch.float32 and w.device.type == "cpu"


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times w (+ bias) -> [..., out], for either layout (see `transposed`)."""
    if transposed(w):
        y = torch.matmul(x, w)
        return y if bias is None else y + bias
    return F.linear(x, w, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, weight applied in the model dtype (as transformers does)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape[-1:], weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)
