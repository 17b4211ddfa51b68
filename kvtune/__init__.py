"""kvtune: watch and tune the KV cache of LLM inference servers."""

__version__ = "0.1.0"
