"""Weight-only quantization of the native backend's linear layers, as gpt-fast does it: int8
with a scale per output channel, int4 in groups along the input with a scale and a zero each.
Activations stay in the model's dtype; the matmuls run in PyTorch's own kernels
(`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu` on CPU, `_weight_int4pack_mm`
on CUDA), which give each row of an n-row call the bits a one-row call gives it: a verify row
computes what a decode step computes, so speculation stays lossless against the quantized
model's own greedy output. A prompt's many rows (ops.linear's `prompt`) run on CPU through a
copy of the dequantized weight instead, packed for oneDNN (ops.Packed) once at load: the
kernels' cost grows with every 4 rows (a 256-row step of the 0.5B in int4 took 2.1x its
bfloat16 step), dequantizing for each call cost about 0.56 s a step on the 0.5B, and a
prompt's bits are shared by every method. The copy costs the weight's bfloat16 bytes again:
on CPU int4 buys a faster one-row step, not memory.

    w [out, in] float  ->  Int8Weight(q [out, in] int8, scale [out])
                       ->  Int4Weight(packed, scale_zero [in / group, out, 2], group)
"""

from __future__ import annotations

import torch

from ..errors import LeapDecodeError
from .ops import lay_out, linear

SCHEMES = ("int8", "int4")
GROUP = 128  # int4: input channels per (scale, zero) pair


class Int8Weight:
    """w ~= q * scale[:, None]; q int8 [out, in], scale [out] in the activations' dtype."""

    def __init__(self, w: torch.Tensor, act_dtype: torch.dtype, prompt_copy: bool = True) -> None:
        w = w.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127  # [out]
        self.q = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)  # [out, in]
        self.scale = scale.to(act_dtype)
        self.shape, self.dtype, self.device = self.q.shape, act_dtype, w.device
        # ops.linear: a prompt's many rows through prompt_matmul (the CPU kernel is slow there)
        self.for_prompts = w.device.type == "cpu"
        self.prompt_weight = lay_out(self.dense()) if self.for_prompts and prompt_copy else None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] (+ bias [out]) -> [rows, out]."""
        if x.device.type == "cpu":
            y = torch._weight_int8pack_mm(x.contiguous(), self.q, self.scale)
        else:
            y = torch.nn.functional.linear(x, self.q.to(x.dtype)) * self.scale  # gpt-fast's
        return y if bias is None else y + bias

    def prompt_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] -> [rows, out] for a prompt's many rows: the dequantized copy, or
        without one the weight converted for the call, its scale applied to the output."""
        if self.prompt_weight is not None:
            return linear(x, self.prompt_weight, bias)
        y = torch.nn.functional.linear(x, self.q.to(x.dtype)) * self.scale
        return y if bias is None else y + bias

    def dense(self) -> torch.Tensor:
        return self.q.to(self.dtype) * self.scale[:, None]


class Int4Weight:
    """w ~= (q - 8) * scale + zero per group of GROUP input channels (gpt-fast's convention),
    q in 0..15; packed for the int4 kernel of the weight's device."""

    def __init__(
        self, w: torch.Tensor, act_dtype: torch.dtype, group: int = GROUP, prompt_copy: bool = True
    ) -> None:
        out_f, in_f = w.shape
        g = w.float().reshape(out_f, in_f // group, group)
        lo, hi = g.amin(-1), g.amax(-1)  # [out, groups]
        scale = (hi - lo).clamp(min=1e-6) / 15
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
        zero = lo + 8 * scale
        # [groups, out, 2]
        self.scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(act_dtype)
        q = q.reshape(out_f, in_f)
        self.layout = None  # how the CPU kernel's packing reads back (_nibbles_t), once known
        if w.device.type == "cpu":
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            self.layout = _find_layout(self.packed, q)
        else:  # tinygemm (CUDA, Ampere and later): q as uint8 pairs
            q8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            self.packed = torch._convert_weight_to_int4pack(q8, 8)
        self.group = group
        self.shape, self.dtype, self.device = torch.Size((out_f, in_f)), act_dtype, w.device
        self.for_prompts = self.layout is not None  # as Int8Weight's
        self.prompt_weight = lay_out(self.dense()) if self.for_prompts and prompt_copy else None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] (+ bias [out]) -> [rows, out]."""
        x = x.contiguous()
        if x.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_zero)
        else:
            y = torch._weight_int4pack_mm(x, self.packed, self.group, self.scale_zero)
        return y if bias is None else y + bias

    def dense(self) -> torch.Tensor:
        """The dequantized weight [out, in]."""
        if self.layout is None:  # the identity times this layer (slow)
            eye = torch.eye(self.shape[1], dtype=self.dtype, device=self.device)
            return self.matmul(eye).t().contiguous()
        return self._dequantized_t().t().contiguous()

    def _dequantized_t(self) -> torch.Tensor:
        """The dequantized weight transposed, [in, out], read back from the CPU packing."""
        out_f, in_f = self.shape
        q = _nibbles_t(self.packed, out_f, in_f, *self.layout)  # [in, out] 0..15
        q = q.view(in_f // self.group, self.group, out_f).to(self.dtype)
        scale, zero = self.scale_zero.unbind(-1)  # [groups, out] each
        shift = (zero.float() - 8 * scale.float()).to(self.dtype)  # q * scale + shift
        return torch.addcmul(shift[:, None], q, scale[:, None]).view(in_f, out_f)

    def prompt_matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] -> [rows, out] for a prompt's many rows: the dequantized copy, or
        without one the weight dequantized for the call (the int4 kernel reads and unpacks it
        again for every 4 rows)."""
        if self.prompt_weight is not None:
            return linear(x, self.prompt_weight, bias)
        y = torch.matmul(x, self._dequantized_t())
        return y if bias is None else y + bias


# The CPU int4 kernel's packing (torch._convert_weight_to_int4pack_for_cpu) by its vector
# width: output rows in blocks of 64 (AVX-512) or 32, each block [in, block / 2] bytes; in a
# full block, byte i holds rows i (low nibble) and i + block / 2 (high) ("halves"), or rows
# 2i and 2i + 1 ("pairs": the unvectorized build, and any last, partial block; blocks of 16
# on ARM). Tried when a weight is quantized; none matching, prompts run through the kernel.
LAYOUTS = ((64, "halves"), (32, "halves"), (32, "pairs"), (16, "pairs"))
_FOUND: list = []  # the layout this process's kernel packs with, once one matched


def _find_layout(packed: torch.Tensor, q: torch.Tensor):
    """The LAYOUTS entry that reads `packed` back as q [n, k], or None."""
    n, k = q.shape
    qt = q.t().to(torch.uint8)
    for c in _FOUND + [c for c in LAYOUTS if c not in _FOUND]:
        try:
            if torch.equal(_nibbles_t(packed, n, k, *c), qt):
                _FOUND[:] = [c]
                return c
        except RuntimeError:  # another packing's size: not this layout
            continue
    return None


def _nibbles_t(packed: torch.Tensor, n: int, k: int, block: int, order: str) -> torch.Tensor:
    """The nibbles of a CPU int4 packing of q [n, k] read back as q transposed, [k, n]."""
    flat = packed.reshape(-1).view(torch.uint8)
    full = n // block

    def columns(b: torch.Tensor, order: str) -> torch.Tensor:  # b [blocks, k, width / 2]
        b = b.transpose(0, 1)  # [k, blocks, width / 2]
        nib = torch.stack([b & 15, b >> 4], dim=2 if order == "halves" else 3)
        return nib.reshape(k, -1)  # [k, blocks * width]

    parts = []
    if full:
        parts.append(columns(flat[: full * k * block // 2].view(full, k, block // 2), order))
    if n > full * block:  # the last, partial block
        tail = n - full * block
        parts.append(columns(flat[full * k * block // 2 :].view(1, k, tail // 2), "pairs"))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def quantize(w: torch.Tensor, scheme: str, act_dtype: torch.dtype, prompt_copy: bool = True):
    """w [out, in] -> the quantized weight object of `scheme` (int8 or int4). int4 takes
    groups of 128 input channels, else the largest of 64 and 32 that divides the input; a
    layer whose input none divides keeps int8 (as a GGUF mixes block types per tensor).
    prompt_copy: keep the dequantized copy for a prompt's rows (CPU; see the module)."""
    if scheme == "int8":
        return Int8Weight(w, act_dtype, prompt_copy)
    if scheme == "int4":
        group = next((g for g in (GROUP, 64, 32) if w.shape[1] % g == 0), None)
        if group is None:
            return Int8Weight(w, act_dtype, prompt_copy)
        return Int4Weight(w, act_dtype, group, prompt_copy)
    raise LeapDecodeError(f"unknown quantization {scheme!r}: use one of {', '.join(SCHEMES)}")


def check_scheme(scheme: str | None, dtype: torch.dtype, device: torch.device) -> None:
    """A clear error before loading when this scheme cannot run as asked."""
    if scheme is None:
        return
    if scheme not in SCHEMES:
        raise LeapDecodeError(f"unknown quantization {scheme!r}: use one of {', '.join(SCHEMES)}")
    if dtype not in (torch.bfloat16, torch.float16) and not (
        scheme == "int8" and device.type == "cpu"
    ):
        raise LeapDecodeError(
            f"--quantize {scheme} runs bfloat16 or float16 activations here: add --dtype bfloat16"
        )
