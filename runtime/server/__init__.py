"""OpenAI-compatible HTTP server (FastAPI + sse-starlette) over the AsyncEngine."""

from .app import create_app
from .generation import ServerLimits, model_context_length

__all__ = ["create_app", "ServerLimits", "model_context_length"]
