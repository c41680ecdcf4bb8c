"""The choice of attention backend by name (its only place, so that `backend.py` stays the
interface both backends build on)."""

from __future__ import annotations

from .backend import AttentionBackend


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called `name` (`torch` or `triton`)."""
    if name == "torch":
        from .torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend={name!r} is unknown; use 'torch' or 'triton'")
