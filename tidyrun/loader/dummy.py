"""load_format="dummy": a model source whose weights are random, of the checkpoint's names and shapes.

verl builds its rollout engine with ``load_format="dummy"`` and pushes the
trainer's weights right after: reading the checkpoint's weights first would
only cost time. The config and tokenizer still come from the real source.
Values are drawn as vLLM's dummy loader draws them (uniform in [-1e-3,
1e-3]) from a fixed seed, so every tensor-parallel rank, and every re-read
(a level-2 wake, ``reload_weights``), produces the same tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import ModelConfig
from ..model.registry import checkpoint_shapes
from ..tokenizer import Tokenizer

DUMMY_SEED = 1234
DUMMY_RANGE = 1e-3


class DummyWeightsSource:
    """Another source's config and tokenizer, with random weights instead of its files' (see module docstring)."""

    def __init__(self, source) -> None:
        self._source = source
        self.path = source.path
        self.config: ModelConfig = source.config

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(DUMMY_SEED)
        for name, shape in checkpoint_shapes(self.config).items():
            yield name, torch.empty(shape).uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)

    def load_tokenizer(self) -> Tokenizer:
        return self._source.load_tokenizer()
