"""The choice of attention backend by name (its only place, so that `backend.py` stays the
interface both backends build on)."""

from __future__ import annotations

from .backend import AttentionBackend


def get_attention_backend(name: str, batch_invariant: bool = False) -> AttentionBackend:
    """The backend called `name` (`torch` or `triton`); with `batch_invariant`, one whose
    every query token is computed the same way whatever else its step holds."""
    if name == "torch":
        from .torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(batch_invariant)
    if name == "triton":
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(batch_invariant)
    raise ValueError(f"attention_backend={name!r} is unknown; use 'torch' or 'triton'")
