"""Tokenizer wrapper and incremental detokenizer.

Tokenization itself is the ``tokenizers``/transformers library's; this wrapper
only fixes the few calls the engine needs and turns their failures into
tidyrun errors.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidRequestError

# How many prompt tokens seed a detokenizer window: enough context that
# tokenizers which treat a leading space specially decode the first output
# token exactly as they would inside the full text.
_DETOKENIZE_CONTEXT = 6


class Tokenizer:
    """Encode/decode/chat-template for one model; stateless after construction."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int] = ()) -> None:
        self._tok = hf_tokenizer
        eos = set(int(e) for e in eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

    @property
    def hf_tokenizer(self):
        return self._tok

    def __len__(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the model's own chat template."""
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; use generate() with a plain prompt")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise InvalidRequestError("messages must be a list of {'role': str, 'content': str} dicts")
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Decodes a sliding window (``prefix``..end) and emits only the part past the
    previous window; a trailing U+FFFD means a multi-byte character is not
    complete yet, so the delta waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """The text of one or more new tokens (several at once cost one decode, not one each)."""
        self._ids.extend(int(t) for t in token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""
