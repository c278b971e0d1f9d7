"""Model sources: files on disk -> one frozen ModelConfig, HF-named weights, a tokenizer.

A source is cheap to keep: it remembers where the weights are and re-reads
them on demand (``iter_weights``), which is what sleep level 2 and
``update_weights`` build on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol

import torch

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..tokenizer import Tokenizer
from .default import default_model_path


class ModelSource(Protocol):
    path: str
    config: ModelConfig

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, CPU tensor) for every weight of the checkpoint."""

    def load_tokenizer(self) -> Tokenizer:
        """Build the tokenizer that ships with the checkpoint."""


def open_model_source(model: str | None) -> ModelSource:
    """Open a GGUF file, a folder holding one GGUF file, or a Hugging Face model folder.

    ``None`` means the bundled default model (SmolLM2-135M-Instruct).
    """
    from .gguf import GGUFSource
    from .hf import HFFolderSource

    path = default_model_path() if model is None else os.path.expanduser(str(model))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return GGUFSource(path)
        raise ModelLoadError(f"model file {path!r} is not a .gguf file; pass a GGUF file or a Hugging Face model folder")
    if os.path.isfile(os.path.join(path, "config.json")):
        return HFFolderSource(path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return GGUFSource(os.path.join(path, ggufs[0]))
    if len(ggufs) > 1:
        raise ModelLoadError(f"folder {path!r} holds several GGUF files ({', '.join(ggufs)}); pass one of them")
    raise ModelLoadError(f"folder {path!r} has neither config.json nor a .gguf file")


__all__ = ("ModelSource", "open_model_source", "default_model_path")
