"""``get_tokenizer``: a model's transformers tokenizer by name, as vLLM's ``vllm.transformers_utils.tokenizer``
gives it (lm-eval's vLLM backend builds its tokenizer this way).

The name is resolved as ``LLM(model=)`` resolves it: a local folder or GGUF file, or a Hugging Face id in the
local cache only (``revision``, ``download_dir``; tidyrun never downloads). A GGUF file's tokenizer is built
from its metadata; anything else is ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import os

from ..errors import InvalidRequestError, ModelLoadError
from ..loader.gguf import gguf_hf_tokenizer
from ..loader.hub import resolve_path


def _gguf_of(path: str) -> str | None:
    """The GGUF file that holds ``path``'s tokenizer: the file itself, or a folder's only .gguf when the folder
    has no tokenizer files of its own; else None."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    names = os.listdir(path)
    if any(n in names for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    ggufs = [n for n in names if n.endswith(".gguf")]
    return os.path.join(path, ggufs[0]) if len(ggufs) == 1 else None


def get_tokenizer(tokenizer_name, *args, tokenizer_mode: str = "auto", trust_remote_code: bool = False,
                  revision: str | None = None, download_dir: str | None = None, **kwargs):
    """The transformers tokenizer of ``tokenizer_name``; ``args`` / ``kwargs`` go to ``from_pretrained``
    (``add_bos_token=``, ...). ``tokenizer_mode`` "auto" (fast) or "slow" (``use_fast=False``, which
    transformers 5 may answer with a fast tokenizer all the same)."""
    from transformers import AutoTokenizer

    if tokenizer_mode not in ("auto", "hf", "slow"):
        raise InvalidRequestError(f"get_tokenizer: tokenizer_mode={tokenizer_mode!r} is not supported; use 'auto' "
                                  "or 'slow'")
    if not isinstance(tokenizer_name, (str, os.PathLike)):
        raise InvalidRequestError(f"get_tokenizer: tokenizer_name must be a path or a Hugging Face id, got "
                                  f"{type(tokenizer_name).__name__}")
    path = resolve_path(os.fspath(tokenizer_name), revision, download_dir, what="tokenizer")
    gguf = _gguf_of(path)
    if gguf is not None:
        return gguf_hf_tokenizer(gguf, *args, **kwargs)
    try:
        return AutoTokenizer.from_pretrained(path, *args, use_fast=tokenizer_mode != "slow",
                                             trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {tokenizer_name!r} ({path!r}): {exc}") from exc


__all__ = ("get_tokenizer",)
