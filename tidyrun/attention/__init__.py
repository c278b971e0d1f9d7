"""Paged attention: metadata describing one batch, and the attention backends."""

from .metadata import AttentionMetadata, ForwardContext
from .reference import causal_attention_dense, paged_attention_reference, store_kv

__all__ = ("AttentionMetadata", "ForwardContext", "causal_attention_dense", "paged_attention_reference", "store_kv")
