"""Model sources: files on disk (or a Hugging Face id in the local cache) -> one frozen ModelConfig,
HF-named weights, a tokenizer.

A source is cheap to keep: it remembers where the weights are and re-reads
them on demand (``iter_weights``), which is what sleep level 2 and
``update_weights`` build on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol

import torch

from ..config import EngineConfig, ModelConfig
from ..errors import InvalidRequestError, ModelLoadError
from ..tokenizer import Tokenizer
from .default import default_model_path
from .hf import generation_defaults
from .hub import resolve_path


class ModelSource(Protocol):
    path: str
    config: ModelConfig

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, CPU tensor) for every weight of the checkpoint."""

    def load_tokenizer(self) -> Tokenizer:
        """Build the tokenizer that ships with the checkpoint."""


def open_model_source(model: str | None, *, revision: str | None = None, download_dir: str | None = None,
                      load_format: str = "auto") -> ModelSource:
    """Open a GGUF file, a folder holding one GGUF file, or a Hugging Face model folder.

    ``None`` means the bundled default model (SmolLM2-135M-Instruct). A
    name that is not a local path is a Hugging Face id, looked up in the
    local cache only (``revision``, ``download_dir``; see hub.py).
    ``load_format`` "safetensors" / "gguf" insist on that kind of model;
    "dummy" keeps its config and tokenizer and makes its weights random
    (dummy.py).
    """
    from .dummy import DummyWeightsSource
    from .gguf import GGUFSource
    from .hf import HFFolderSource

    if model is None:
        for option, value in (("revision", revision), ("download_dir", download_dir)):
            if value is not None:
                raise InvalidRequestError(f"{option}={value!r} applies to Hugging Face ids; the default model "
                                          f"(model=None) is a local file: leave {option} out")
        path = default_model_path()
    else:
        path = resolve_path(str(model), revision, download_dir)
    gguf = _gguf_file(path)
    if load_format == "gguf" and gguf is None:
        raise InvalidRequestError(f"load_format / quantization 'gguf' asks for a GGUF model, but {path!r} is not "
                                  "a .gguf file or a folder holding one")
    if load_format == "safetensors" and gguf is not None:
        raise InvalidRequestError(f"load_format='safetensors' asks for a Hugging Face folder, but {path!r} is GGUF")
    source = GGUFSource(gguf) if gguf is not None else HFFolderSource(path, read_weights=load_format != "dummy")
    return DummyWeightsSource(source) if load_format == "dummy" else source


def _gguf_file(path: str) -> str | None:
    """The GGUF file ``path`` is or holds; None for a Hugging Face folder (config.json). Anything else is refused."""
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        raise ModelLoadError(f"model file {path!r} is not a .gguf file; pass a GGUF file or a Hugging Face model folder")
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    if len(ggufs) > 1:
        raise ModelLoadError(f"folder {path!r} holds several GGUF files ({', '.join(ggufs)}); pass one of them")
    raise ModelLoadError(f"folder {path!r} has neither config.json nor a .gguf file")


def open_engine_source(config: EngineConfig) -> ModelSource:
    """The model source an engine's config names (the engine and every tensor-parallel worker open the same)."""
    return open_model_source(config.model, revision=config.revision, download_dir=config.download_dir,
                             load_format=config.load_format)


def open_engine_tokenizer(config: EngineConfig, source: ModelSource) -> Tokenizer:
    """The model's own tokenizer, or the Hugging Face tokenizer ``config.tokenizer`` names (with the model's
    EOS ids)."""
    if config.tokenizer is None:
        return source.load_tokenizer()
    from .hf import load_hf_tokenizer

    path = resolve_path(config.tokenizer, config.tokenizer_revision, config.download_dir, what="tokenizer",
                        revision_option="tokenizer_revision")
    if not os.path.isdir(path):
        raise ModelLoadError(f"tokenizer {config.tokenizer!r} must be a Hugging Face tokenizer folder (or id); "
                             f"{path!r} is a file")
    return load_hf_tokenizer(path, source.config.eos_token_ids)


__all__ = ("ModelSource", "open_model_source", "open_engine_source", "open_engine_tokenizer", "default_model_path",
           "generation_defaults")
