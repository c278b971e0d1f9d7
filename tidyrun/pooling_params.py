"""vLLM's ``PoolingParams`` (``vllm.pooling_params``), for ``LLM.embed`` / ``LLM.score``."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequestError


@dataclass
class PoolingParams:
    """``normalize``: scale each embedding to unit length (None: the engine's default, True). ``dimensions``:
    vLLM's Matryoshka truncation, which tidyrun's models do not support (None only). Checked when
    submitted, as SamplingParams are."""

    normalize: bool | None = None
    dimensions: int | None = None

    def check(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"PoolingParams.normalize must be True, False or None, got {self.normalize!r}")
        if self.dimensions is not None:
            raise InvalidRequestError(f"PoolingParams(dimensions={self.dimensions!r}) is not supported: tidyrun's "
                                      "models have no Matryoshka embeddings; pass None")
