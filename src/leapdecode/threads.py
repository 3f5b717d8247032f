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
# every core nobody else is using: the cores this process may run on, less those busy now
# (the machine's idle share over a fifth of a second, from /proc/stat), and at least one.
# The 1-minute load average, used before, still counted jobs that had just ended, and so
# halved a real model's speed for a minute after any other work.


def default_threads() -> int:
    cores = available_cores()
    busy = busy_cores()
    return max(1, cores - int(round(busy)))


def busy_cores(window_s: float = 0.2) -> float:
    """Cores busy on this machine now: its non-idle share of CPU time over `window_s`,
    times its cores (the 1-minute load average where /proc/stat cannot be read)."""
    import time

    def times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait

    try:
        total0, idle0 = times()
        time.sleep(window_s)
        total1, idle1 = times()
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):  # not available on this platform
            return 0.0
    total = max(1, total1 - total0)
    return (1 - (idle1 - idle0) / total) * (os.cpu_count() or 1)


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
