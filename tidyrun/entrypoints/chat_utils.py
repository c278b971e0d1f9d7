"""``resolve_hf_chat_template``, where vLLM's users import it from: the chat template a request uses."""

from __future__ import annotations


def resolve_hf_chat_template(tokenizer, chat_template: str | None, tools: list | None = None, *,
                             model_config=None, trust_remote_code: bool = False) -> str | None:
    """``chat_template`` when given, else the tokenizer's own (for ``tools`` when it has one per use), else None.
    ``model_config`` and ``trust_remote_code`` are vLLM's and change nothing here."""
    if chat_template is not None:
        return chat_template
    try:
        return tokenizer.get_chat_template(tools=tools)
    except (ValueError, AttributeError):  # no template, or not a transformers tokenizer
        return None


__all__ = ("resolve_hf_chat_template",)
