"""Serving tidal on Ray Serve: the same server and engine as deployments, routed by the same policy."""
