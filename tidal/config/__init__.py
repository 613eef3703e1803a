"""Configuration: frozen dataclasses per area; YAML, environment and CLI only produce their kwargs."""
