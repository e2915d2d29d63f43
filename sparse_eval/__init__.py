"""sparse_eval: evaluate sparse and approximate attention for LLM decoding."""

__version__ = "0.1.0"
