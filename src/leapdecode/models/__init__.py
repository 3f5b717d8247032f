"""Model backends: native Llama family and the transformers fallback."""

from .base import CausalLM
from .loader import load_model

__all__ = ["CausalLM", "load_model"]
