"""Attention and KV-cache kernels. Imports nothing from the rest of the project."""

from pagedserve.kernels.backend import AttentionBackend, get_attention_backend
from pagedserve.kernels.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
