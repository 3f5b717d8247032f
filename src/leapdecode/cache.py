"""Where leapdecode keeps what it makes on this machine: pulled models, dequantized GGUF
files, compiled graphs, built extensions, training runs, step-cost profiles.

One root, `$LEAPDECODE_CACHE` (default `~/.cache/leapdecode`); each user of it takes a
sub-folder by name. The test suite points the root at a temporary folder.
"""

from __future__ import annotations

import os


def cache_root() -> str:
    root = os.environ.get("LEAPDECODE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "leapdecode"
    )
    return os.path.abspath(root)


def cache_dir(*parts: str) -> str:
    """A folder under the cache root (not created: the caller makes it when it writes)."""
    return os.path.join(cache_root(), *parts)
