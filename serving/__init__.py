"""Serving a PocketLM checkpoint: a continuous-batching engine (engine.py) behind an OpenAI-compatible API (api.py)."""
