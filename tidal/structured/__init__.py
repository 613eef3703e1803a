"""Constrained decoding: grammars from structured-output specs, and the per-request matchers."""
