"""Data parallel: which engine replica serves a request (session, cached prefix, load)."""
