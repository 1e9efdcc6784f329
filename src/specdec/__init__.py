"""specdec: lossless speculative decoding for causal language models."""

__version__ = "0.1.0"
