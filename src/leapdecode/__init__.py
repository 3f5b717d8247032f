"""leapdecode: lossless speculative decoding for Hugging Face-format causal LMs."""

from .api import GenerationResult, LeapDecoder
from .config import SamplingParams, SpecConfig
from .errors import LeapDecodeError

__version__ = "0.2.0"
__all__ = [
    "GenerationResult",
    "LeapDecodeError",
    "LeapDecoder",
    "SamplingParams",
    "SpecConfig",
    "__version__",
]
