"""Paged attention: metadata describing one batch, and the attention backends."""

from .metadata import AttentionMetadata, ForwardContext
from .reference import paged_attention_reference, store_kv

__all__ = ("AttentionMetadata", "ForwardContext", "paged_attention_reference", "store_kv")
