"""batchlm's engine: the vLLM-compatible `LLM` API and the engine core behind it."""

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .errors import InvalidParamError, InvalidPromptError, ModelNotFoundError
from .inputs import TextPrompt, TokensPrompt
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "InvalidParamError",
    "InvalidPromptError",
    "ModelNotFoundError",
]
