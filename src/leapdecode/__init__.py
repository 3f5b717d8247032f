"""leapdecode: lossless speculative decoding for Hugging Face-format causal LMs."""

from .api import GenerationResult, LeapDecoder
from .errors import LeapDecodeError
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["GenerationResult", "LeapDecodeError", "LeapDecoder", "SamplingParams", "__version__"]
