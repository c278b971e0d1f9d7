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


def check_unicode(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as "\\ud800", which JSON can carry):
    tokenizers raise a bare TypeError on it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{what} is not valid Unicode: {exc.reason} at character {exc.start} "
                                  f"({text[exc.start:exc.end]!a})") from None


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
        check_unicode(text, "prompt")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None,
                            add_special_tokens: bool = False) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (``render_chat``'s text);
        ``add_special_tokens`` as vLLM's chat request field (off: the template writes the special tokens)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, continue_final_message=continue_final_message,
                                            chat_template=chat_template, tools=tools, template_kwargs=template_kwargs),
                           add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """A conversation rendered with the model's chat template (or ``chat_template``), as text.

        The other arguments are transformers' (and vLLM's ``chat()``'s):
        ``continue_final_message`` leaves the last (assistant) message open
        for the model to continue, ``tools`` are passed to the template, and
        ``template_kwargs`` are further variables the template reads (e.g.
        ``enable_thinking``). A template that fails to render is an
        InvalidRequestError, not a jinja2 exception.
        """
        if chat_template is None and not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; pass chat_template=... or use generate() "
                                      "with a plain prompt")
        if chat_template is not None and not isinstance(chat_template, str):
            raise InvalidRequestError(f"chat_template must be a jinja2 template string, got "
                                      f"{type(chat_template).__name__}")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
            for m in messages
        ):
            raise InvalidRequestError("messages must be a list of {'role': str, 'content': str (or a list of text "
                                      "parts)} dicts")
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & {"conversation", "tokenize", "return_dict", "return_tensors"})
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}: tidyrun tokenizes the "
                                      "rendered text itself")
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       chat_template=chat_template, tools=tools)
        options.update(extra)  # as in vLLM, chat_template_kwargs override the named arguments
        if options["continue_final_message"] and options["add_generation_prompt"]:  # also when set by the kwargs
            raise InvalidRequestError("continue_final_message=True needs add_generation_prompt=False "
                                      "(the reply continues the last message instead of starting a new one)")
        try:
            text = self._tok.apply_chat_template(messages, tokenize=False, **options)
        except Exception as exc:  # jinja2 TemplateError, or a template raising on its input
            raise InvalidRequestError(f"the chat template failed to render this conversation: "
                                      f"{type(exc).__name__}: {exc}") from exc
        return text


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
