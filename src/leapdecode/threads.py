"""How many CPU threads torch uses.

PyTorch's default pool takes every core and its OpenMP workers spin while they wait. With
other processes on the machine, that made identical runs more than 10x slower here (two
other jobs running: 5.7 tok/s with the default pool, 127 tok/s with one thread). Small
models gain little from more threads anyway: a decode step is mostly per-operator overhead.
So leapdecode sets the pool itself: `--threads N` on every command (`threads=` in the API),
or `LEAPDECODE_THREADS`, or the default below, never more than the cores this process may
run on.
"""

from __future__ import annotations

import os

import torch

from .errors import LeapDecodeError

# Chosen by measurement (docs/threads.md, `python bench/threads.py`): greedy decoding of the
# embedded target on the 2-core machine gave, idle, 69 tok/s with 1 thread and 100 with 2;
# with two busy processes beside it, 41 tok/s with 1 thread and 14 with 2. So the default is
# every core nobody else is using: the cores this process may run on, less the machine's
# recent load (1-minute load average, rounded), and at least one.


def default_threads() -> int:
    cores = available_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        load = 0.0
    return max(1, cores - int(round(load)))


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_threads(threads: int | None) -> int:
    if threads is None:
        env = os.environ.get("LEAPDECODE_THREADS")
        if env:
            try:
                threads = int(env)
            except ValueError:
                raise LeapDecodeError(
                    f"LEAPDECODE_THREADS must be an integer, got {env!r}"
                ) from None
        else:
            threads = default_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise LeapDecodeError(f"threads must be an integer >= 1, got {threads!r}")
    return min(threads, available_cores())


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op pool (never past the available cores); returns the count."""
    n = resolve_threads(threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
