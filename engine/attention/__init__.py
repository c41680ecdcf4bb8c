"""Attention over the paged KV cache: one interface, a PyTorch reference and a Triton backend."""

from .backend import AttentionBackend, AttentionMetadata
from .selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
