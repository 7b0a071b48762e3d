"""Prefix Gateway: a prefix-aware load-balancing gateway for OpenAI-compatible inference."""

__version__ = "0.1.0"
