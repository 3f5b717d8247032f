"""Model backends: native Llama family and the transformers fallback."""

from .base import CausalLM, ForwardOutput, HiddenRequest
from .loader import load_model

__all__ = ["CausalLM", "ForwardOutput", "HiddenRequest", "load_model"]
