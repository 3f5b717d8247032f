"""How much memory the KV caches may take, and the longest sequence that leaves room for.

Every model that keeps a KV cache (the target, a draft model, a parallel draft, an EAGLE
head) preallocates one row per slot for the engine's whole context, so the caches take

    max_num_seqs x (max_model_len + MAX_K + 1) x (bytes a token, summed over the models)

(MAX_K + 1: room for a step's drafts past the last token). A model's own maximum context
(32,768 positions for Qwen2.5) would take 15 GB for a 1.5B model's 16 slots, so the engine
sizes its context to a budget instead (`kv_cache_memory`), as vLLM does with
`--max-model-len` and its cache's memory share:

- max_model_len given: that (at most the model's own maximum), refused if it does not fit;
- else the longest that fits, rounded down to a multiple of ROUND, at most the model's
  maximum, and refused below MIN_DEFAULT_LEN (or the model's maximum, if shorter).

The default budget is a share of the memory free once the weights are loaded (`default_budget`).
It bounds the worst case, every slot at max_model_len: on the CPU a large cache takes its
memory as its positions are written (models/kv_cache.py), so a process holds what its
sequences reach, not the budget.
"""

from __future__ import annotations

import logging
import re

import torch

from .errors import LeapDecodeError

log = logging.getLogger("leapdecode")

CPU_SHARE = 0.5  # of MemAvailable: the rest for activations, the OS and other processes
CUDA_SHARE = 0.8  # of the GPU's free memory: the rest for activations
ROUND = 256  # a default max_model_len is a multiple of this
MIN_DEFAULT_LEN = 512  # the shortest default max_model_len worth running

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(size: int | float | str) -> int:
    """Bytes from a size: an integer of bytes, or text such as "4GiB", "512MiB", "6G", "1.5GB"
    (K/M/G/T: powers of 1000; KiB/MiB/GiB/TiB: of 1024; case ignored)."""
    if isinstance(size, bool):
        size = str(size)
    if isinstance(size, int | float):
        value = float(size)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(size))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise LeapDecodeError(
                f"kv_cache_memory {size!r} is not a size: give bytes or a number with a unit, "
                "such as 4GiB, 512MiB or 6G",
                field="kv_cache_memory",
            )
        value = float(m.group(1)) * _UNITS[unit]
    if not value >= 1:
        raise LeapDecodeError(
            f"kv_cache_memory must be a positive size, got {size!r}", field="kv_cache_memory"
        )
    return int(value)


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def available_bytes(device: torch.device) -> int:
    """Memory free for new allocations: the GPU's free memory (CUDA), else the system's
    MemAvailable (free memory plus what the kernel can reclaim, such as the page cache)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # what torch's allocator keeps reserved but unused is free to this process too
        spare = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + spare)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # neither: assume a small machine rather than none
        return 8 << 30


def default_budget(device: torch.device, held: int = 0) -> tuple[int, str]:
    """The KV caches' default budget: CPU_SHARE of MemAvailable (CUDA_SHARE of the GPU's free
    memory), counting as free the caches these models hold now (`held`: they are replaced);
    and a note that says so."""
    cuda = device.type == "cuda"
    share = CUDA_SHARE if cuda else CPU_SHARE
    free = available_bytes(device) + held
    where = "the GPU's free memory" if cuda else "the memory available"
    return int(share * free), f"the default: {share:.0%} of {where}, {format_size(free)}"


def cache_bytes(model) -> int:
    """What a model's KV cache holds now on a GPU (0 without one, and on the CPU, where a
    large cache takes its memory as it is written: models/kv_cache.py)."""
    cache = getattr(model, "cache", None)
    tensors = [getattr(cache, "k", None), getattr(cache, "v", None)]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.is_cuda)


def head_bytes_per_token(head) -> int:
    """An EAGLE head's cache, a token: keys and values of its one layer, in float32."""
    return 2 * int(head.kv_heads) * int(head.head_dim) * 4


def plan_length(
    model_max: int,
    per_token: dict[str, int],
    slots: int,
    extra: int,
    max_model_len: int | None,
    budget: int,
    budget_note: str = "",
) -> int:
    """The engine's max_model_len: `per_token` bytes a cached token of each model that keeps a
    cache ({"target": ..., "draft": ...}), `slots` rows each, every row max_model_len + `extra`
    positions long, within `budget` bytes (see the module's docstring); budget_note: where a
    default budget comes from, for the refusals."""
    if max_model_len is not None and (
        not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 2
    ):
        raise LeapDecodeError(
            f"max_model_len must be an integer >= 2, got {max_model_len!r}", field="max_model_len"
        )
    total = sum(per_token.values())
    row = slots * total  # bytes a position of every slot
    if total == 0:  # no preallocated cache: nothing to size
        return model_max if max_model_len is None else min(max_model_len, model_max)
    fits = budget // row - extra  # the longest context that fits
    what = " + ".join(f"{name} {n:,}" for name, n in per_token.items() if n)
    where = (
        f"{slots} slots x {what} bytes a token"
        + (f" = {format_size(row)} a position" if slots > 1 or len(per_token) > 1 else "")
        + f", within kv_cache_memory {format_size(budget)}"
        + (f" ({budget_note})" if budget_note else "")
    )
    if max_model_len is not None:
        if max_model_len > model_max:
            log.warning(
                "max_model_len %d is past the model's maximum context (%d): using %d",
                max_model_len, model_max, model_max,
            )  # fmt: skip
            max_model_len = model_max
        if max_model_len > fits:
            need = row * (max_model_len + extra)
            raise LeapDecodeError(
                f"max_model_len {max_model_len} does not fit the KV cache: it needs "
                f"{format_size(need)} ({where}); at most {max(fits, 0)} fits: lower "
                "max_model_len or max_num_seqs, or raise kv_cache_memory",
                field="max_model_len",
            )
        return max_model_len
    if fits >= model_max:
        return model_max
    length = fits // ROUND * ROUND
    least = min(MIN_DEFAULT_LEN, model_max)
    if length < least:
        raise LeapDecodeError(
            f"the KV cache does not fit even a context of {least} tokens ({where}; "
            f"{least} needs {format_size(row * (least + extra))}): lower max_num_seqs, raise "
            "kv_cache_memory, or pass a shorter max_model_len",
            field="kv_cache_memory",
        )
    return length
