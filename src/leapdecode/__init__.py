"""leapdecode: lossless speculative decoding for Hugging Face-format causal LMs.

The public names load on first use (PEP 562): `import leapdecode` and the `leapdecode`
command start without importing torch, so `--help` is quick and Ctrl-C while the command
starts ends it cleanly (cli.main handles it) instead of interrupting an import.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from .config import SamplingParams, SpecConfig
from .errors import LeapDecodeError

if TYPE_CHECKING:
    from .api import GenerationResult, LeapDecoder

__version__ = "0.2.0"
__all__ = [
    "GenerationResult",
    "LeapDecodeError",
    "LeapDecoder",
    "SamplingParams",
    "SpecConfig",
    "__version__",
]

_LAZY = {"GenerationResult": ".api", "LeapDecoder": ".api"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'leapdecode' has no attribute {name!r}")
