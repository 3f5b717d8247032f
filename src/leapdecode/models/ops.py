"""The few tensor operations the native backend, its compiled forward and the speculator heads
share: a linear layer over any of its weight layouts, and RMSNorm as transformers computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def transposed(w: torch.Tensor) -> bool:
    """The plain layout of a weight that is not packed (see `Packed`): float32 on CPU is kept
    transposed ([in, out]); all else [out, in].

    float32 on CPU: the one-row decode matmul with [in, out] weights streams the matrix and
    runs about twice as fast as `F.linear` (bench/backend_step.py measures it). Where oneDNN
    packs (`Packed.available`) a weight is packed instead (`lay_out`). CUDA: `F.linear`
    (cuBLAS) either way.
    """
    return w.dtype == torch.float32 and w.device.type == "cpu"


class Packed:
    """A weight [out, in] reordered once into oneDNN's blocked layout (CPU: bfloat16, float16,
    and float32 where PACK_FLOAT32), for `linear`. Against `F.linear` on the same weight it
    reads memory closer to the machine's bandwidth, and a call of 5-17 rows costs little more
    than one of 1 (docs/bench/real/linear_kernels_1.5b.md has the figures).

    oneDNN computes a one-row call by another path (a matrix-vector kernel) than a call of
    two rows or more, with other rounding: every row of a call of m >= 2 rows holds the same
    bits whatever m, and a one-row call's differ. So `matmul` runs fewer than PAD_ROWS rows
    as PAD_ROWS (the first row repeated): a decode step's row holds the very bits that row
    holds in a verify step of k + 1 rows, and the call is faster too (on the 1.5B's shapes,
    two threads, 4 rows took 0.85x the time of 1 row and of 2)."""

    PAD_ROWS = 4

    def __init__(self, w: torch.Tensor) -> None:
        self.shape = w.shape  # [out, in]
        self.dtype, self.device = w.dtype, w.device
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self.PAD_ROWS)

    def dense(self) -> torch.Tensor:
        """The weight back as a tensor [out, in]."""
        return self.weight.to_dense()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] (+ bias [out], added before rounding, as F.linear does) -> [rows, out]."""
        rows = x.shape[0]
        if rows < self.PAD_ROWS:  # see the class
            x = torch.cat([x, x[:1].expand(self.PAD_ROWS - rows, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, bias, "none", [], "")
        return y[:rows]

    @staticmethod
    def available(w: torch.Tensor) -> bool:
        """Whether this weight packs here: bfloat16, float16 (and float32 where PACK_FLOAT32)
        on a CPU with oneDNN."""
        dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if PACK_FLOAT32 else ())
        return (
            w.device.type == "cpu"
            and w.dtype in dtypes
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )


# float32 on CPU packed too: a verify of 4-16 tokens through [in, out] matmuls cost about 3x
# a decode step on the 1.5B (docs/bench/real/step_profile_1.5b.md)
PACK_FLOAT32 = True


def plain(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] in its plain layout for `linear` (`transposed` says which)."""
    return w.t().contiguous() if transposed(w) else w


def lay_out(w: torch.Tensor) -> torch.Tensor | Packed:
    """w [out, in] in the layout `linear` runs fastest here: packed for oneDNN where
    `Packed.available`, else plain."""
    if not Packed.available(w):
        return plain(w)
    try:
        p = Packed(w)
        p.matmul(torch.zeros(1, w.shape[1], dtype=w.dtype))  # runs here, or falls back below
        return p
    except (RuntimeError, NotImplementedError):  # a oneDNN build without this kernel
        return plain(w)


def dense(w) -> torch.Tensor:
    """A weight in its plain layout for `linear`, whatever its kind (quantized: its
    dequantized values)."""
    return w if isinstance(w, torch.Tensor) else plain(w.dense())


def linear(x: torch.Tensor, w, bias: torch.Tensor | None, prompt: bool = False) -> torch.Tensor:
    """x [..., in] times w (+ bias) -> [..., out], for any layout: a plain tensor (see
    `transposed`) or a weight object with its own kernel (`Packed`, models/quant.py).
    `prompt`: the rows are a prompt's (many, and no decode step has to match their bits): a
    quantized weight then runs its prompt_matmul (dequantized for the call: its kernel is
    slow for many rows)."""
    if not isinstance(w, torch.Tensor):
        many = prompt and getattr(w, "for_prompts", False)
        matmul = w.prompt_matmul if many else w.matmul
        y = matmul(x.reshape(-1, x.shape[-1]), bias)  # [rows, out]
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if transposed(w):
        y = torch.matmul(x, w)
        return y if bias is None else y + bias
    return F.linear(x, w, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, weight applied in the model dtype (as transformers does)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape[-1:], weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)
