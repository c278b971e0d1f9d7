"""The model runner: owns every device resource and turns scheduled batches into tokens."""

from .model_runner import ModelRunner

__all__ = ("ModelRunner",)
