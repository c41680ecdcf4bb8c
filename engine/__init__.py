"""batchlm's engine: the vLLM-compatible `LLM` API and the engine core behind it."""

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .errors import (
    EngineDeadError,
    EngineSleepingError,
    ImageReadError,
    InvalidParamError,
    InvalidPromptError,
    ModelNotFoundError,
)
from .inputs import TextPrompt, TokensPrompt
from .llm import LLM
from .lora.request import LoRARequest
from .outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from .pooling_params import PoolingParams
from .sampling_params import SamplingParams
from .structured_outputs_params import StructuredOutputsParams

__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "TextPrompt",
    "TokensPrompt",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "Logprob",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "EngineDeadError",
    "EngineSleepingError",
    "ImageReadError",
    "InvalidParamError",
    "InvalidPromptError",
    "ModelNotFoundError",
]
