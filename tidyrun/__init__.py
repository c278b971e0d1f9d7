"""tidyrun: an in-process LLM inference engine that gives back every byte it took."""

from .arg_utils import AsyncEngineArgs, EngineArgs
from .beam_search import BeamSearchOutput, BeamSearchSequence
from .engine import LLM
from .errors import (EngineShutdownError, EngineSleepingError, InvalidRequestError, ModelLoadError, OutOfResourcesError,
                     PromptTooLongError, ResourceLeakError, TidyrunError, UnsupportedModelError, WeightsNotLoadedError,
                     WorkerDiedError, WorkerError)
from .inputs import TextPrompt, TokensPrompt
from .outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                      RequestOutput, ScoringOutput, ScoringRequestOutput)
from .pooling_params import PoolingParams
from .sampling_params import (BeamSearchParams, GuidedDecodingParams, RequestOutputKind, SamplingParams,
                              StructuredOutputsParams)
from .v1.engine.async_llm import AsyncLLM, AsyncLLMEngine
from .v1.engine.llm_engine import LLMEngine

__all__ = (
    "LLM", "LLMEngine", "AsyncLLM", "AsyncLLMEngine", "EngineArgs", "AsyncEngineArgs", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutputKind",
    "RequestOutput", "CompletionOutput",
    "TextPrompt", "TokensPrompt", "PoolingParams", "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput",
    "ScoringRequestOutput", "PoolingOutput", "PoolingRequestOutput", "BeamSearchParams", "BeamSearchOutput",
    "BeamSearchSequence", "TidyrunError", "ModelLoadError",
    "UnsupportedModelError", "InvalidRequestError", "PromptTooLongError", "OutOfResourcesError",
    "EngineShutdownError", "EngineSleepingError", "WeightsNotLoadedError", "ResourceLeakError", "WorkerError",
    "WorkerDiedError")
__version__ = "0.1.0"
