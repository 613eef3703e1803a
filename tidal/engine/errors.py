"""Engine errors a caller of any engine client sees: a full waiting queue, or an engine that failed or stopped."""

from __future__ import annotations


class QueueFullError(Exception):
    """The engine's waiting queue is full (server.max_queue): the request was not queued."""


class EngineError(RuntimeError):
    """The engine failed while the request was in flight, or it is shut down."""
