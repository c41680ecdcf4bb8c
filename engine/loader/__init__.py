"""Where weights come from: local folders, GGUF files, the HF cache and packaged models.

`resolve_model(model)` turns a user's `model=` into a local Hugging Face folder, never
touching the network; `convert_gguf(path)` turns a `.gguf` file into one (cached).
"""

from __future__ import annotations

from ..errors import ModelNotFoundError
from .gguf import convert_gguf
from .resolve import resolve_model

__all__ = ["ModelNotFoundError", "convert_gguf", "resolve_model"]
