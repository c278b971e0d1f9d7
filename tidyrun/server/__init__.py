"""OpenAI-compatible HTTP server around one engine (FastAPI + uvicorn)."""

from .app import create_app
from ..engine_loop import EngineLoop

__all__ = ("create_app", "EngineLoop")
