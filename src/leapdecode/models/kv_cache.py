"""A preallocated KV cache: one row (slot) per sequence, per-slot lengths, O(1) rollback.

Its size is the engine's max_model_len (memory.py sizes it to a budget); on the CPU its pages
are committed as they are written (`zeros`)."""

from __future__ import annotations

import math
import mmap

import torch

LAZY_BYTES = 1 << 20  # CPU caches from this size up take their memory as they are written


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor for a cache. On the CPU a large one is an anonymous mapping: its pages
    are the system's zero page until written, so the cache's memory grows with the positions
    its sequences reach (a slot's positions are contiguous in each layer and head), up to the
    size reserved for it, instead of all of it at once (torch.zeros writes every page)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVCache:
    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        room: int | None = None,
    ) -> None:
        # one tensor for every layer: self.k[layer] is that layer's [slots, H_kv, L, D] view, and
        # an operation over all layers (a tree step's compaction) is one call, not one a layer.
        # L = room (>= max_len): positions past max_len are read (masked), never written
        room = max(room or max_len, max_len)
        shape = (n_layers, n_slots, n_kv_heads, room, head_dim)  # [layers, slots, H_kv, L, D]
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)
        self.lens = torch.zeros(n_slots, dtype=torch.long)  # [slots], on the CPU
        self.n_slots = n_slots
        self.max_len = max_len

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # [B]
        write_pos: torch.Tensor,  # [B, T] absolute cache positions
        k: torch.Tensor,  # [B, T, H_kv, D]
        v: torch.Tensor,  # [B, T, H_kv, D]
        block: tuple[int, int] | None = None,
    ) -> None:
        """`block` = (first slot, first position) when the slots are consecutive and every row
        starts at the same position: the write is then a plain slice copy."""
        if block is not None:
            s, p = block
            n, t = k.shape[0], k.shape[1]
            self.k[layer][s : s + n, :, p : p + t] = k.transpose(1, 2)
            self.v[layer][s : s + n, :, p : p + t] = v.transpose(1, 2)
            return
        rows = slots[:, None]  # [B, 1]
        dtype = self.k[layer].dtype
        self.k[layer][rows, :, write_pos] = k.to(dtype)
        self.v[layer][rows, :, write_pos] = v.to(dtype)

    def compact(
        self, slots: torch.Tensor, base: torch.Tensor, picked: torch.Tensor, n: torch.Tensor
    ) -> None:
        """Row b keeps the entries at base[b] + picked[b, :n[b]], moved to base[b] + 0 .. n[b]-1,
        and its length becomes base[b] + n[b] (a tree step keeps its accepted path)."""
        width = picked.shape[1]
        j = torch.arange(width)[None, :]  # [1, L]
        dst = base[:, None] + j  # [B, L]
        src = torch.where(j < n[:, None], base[:, None] + picked, dst)  # padding copies onto itself
        moved = (src != dst).any(1)  # [B] rows whose path is not already in place
        if bool(moved.any()):
            rows = slots[moved][:, None].to(self.k.device)  # [B', 1]
            src, dst = src[moved].to(rows.device), dst[moved].to(rows.device)
            # every layer at once: [B', L, layers, H_kv, D] gathered, then scattered back
            self.k[:, rows, :, dst] = self.k[:, rows, :, src]
            self.v[:, rows, :, dst] = self.v[:, rows, :, src]
        self.lens[slots] = base + n

    def read(
        self,
        layer: int,
        slots: torch.Tensor | None,
        span: int,
        contiguous_from: int | None,
        n: int | None = None,
    ):
        """Keys and values of the first `span` positions: two [B, H_kv, span, D] tensors.

        `contiguous_from` is set when `slots` is range(s, s + B) (or, with `n`, to read the
        n slots from s on whatever the batch holds): then the result is a view.
        """
        k, v = self.k[layer], self.v[layer]
        if contiguous_from is not None:
            s = contiguous_from
            n = slots.shape[0] if n is None else n
            return k[s : s + n, :, :span], v[s : s + n, :, :span]
        return k[slots, :, :span], v[slots, :, :span]
