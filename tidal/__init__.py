"""tidal: an LLM serving engine with continuous batching and a paged, prefix-reusing KV cache."""

from __future__ import annotations

__version__ = "0.1.0"
