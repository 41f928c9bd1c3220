"""MTPLX: exact speculative decoding on MLX behind an OpenAI-compatible server."""

__version__ = "0.1.0"
