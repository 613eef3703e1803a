"""Clients the server holds: the engine client that drives a supervised engine process."""
