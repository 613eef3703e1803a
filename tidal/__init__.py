"""tidal: an LLM serving engine with continuous batching and a paged, prefix-reusing KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput"]

if TYPE_CHECKING:
    from tidal.engine.llm import LLM
    from tidal.engine.output import RequestOutput
    from tidal.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy: `import tidal` stays cheap (no torch) for the CLI's --help and config tools.
    if name == "LLM":
        from tidal.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tidal.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from tidal.engine.output import RequestOutput

        return RequestOutput
    raise AttributeError(name)
