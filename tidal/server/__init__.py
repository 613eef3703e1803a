"""The OpenAI-compatible HTTP server: protocol models, error bodies and SSE framing."""
