"""GroupLost: a tensor-parallel rank is gone (torch-free, so the engine loop can name it)."""

from __future__ import annotations


class GroupLost(RuntimeError):
    """A tensor-parallel rank is gone; the group cannot run another step."""
