"""Exceptions raised to users. Each message names the bad value and the fix."""

from __future__ import annotations


class InvalidParamError(ValueError):
    """A sampling / pooling parameter or engine option is out of range or of the wrong type."""


class InvalidPromptError(ValueError):
    """A prompt cannot be served (empty, too long, ids outside the vocabulary, wrong type)."""


class ModelNotFoundError(FileNotFoundError):
    """A `model=` value resolves to no local folder, GGUF file, cache entry or package."""


class UnsupportedModelError(ValueError):
    """The model's architecture or format is not one batchlm can run."""


class EngineDeadError(RuntimeError):
    """The engine cannot continue: a tensor-parallel worker died or failed, or the engine was
    shut down. The message says which rank and why; build a new `LLM`."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (`LLM.sleep`): its device memory or its scheduling is paused.
    The message says what `wake_up` call brings it back; nothing queued is lost."""


class ImageReadError(InvalidPromptError):
    """An image that cannot be read: a missing file, an unreachable URL, bytes that do not
    decode, an empty image. The message names the source and the problem."""
