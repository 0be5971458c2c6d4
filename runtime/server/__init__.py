"""OpenAI-compatible HTTP server (FastAPI + sse-starlette) over the AsyncEngine.

Names load on first use, so that importing a light module of this package (the body
parser, the error objects, the request schema; the gateway uses them) does not load the
engine and torch.
"""

__all__ = ["create_app", "ServerLimits", "model_context_length"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app
        return create_app
    if name in ("ServerLimits", "model_context_length"):
        from . import generation
        return getattr(generation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
