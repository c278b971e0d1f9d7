"""Model ids ("org/name") -> a snapshot folder of the local Hugging Face cache, offline.

RL frameworks pass the id they trained from (TRL: ``model.name_or_path``).
tidyrun never downloads: an id resolves only if its snapshot is already in
the cache (fetched by ``hf download``, transformers or vLLM), so starting an
engine makes no network call and cannot hang on one. The cache is looked up
where huggingface_hub puts it, read from the environment at call time (not
at import), so a process that sets HF_HOME after importing tidyrun is
honoured.
"""

from __future__ import annotations

import os
import re

from ..errors import InvalidRequestError, ModelLoadError

# What huggingface_hub accepts as a repository id: "name" or "namespace/name".
_REPO_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?$")


def hub_cache_dir(download_dir: str | None = None) -> str:
    """The cache folder to look in: ``download_dir``, else HF_HUB_CACHE, else HF_HOME/hub, else the default."""
    if download_dir is not None:
        return os.path.expanduser(download_dir)
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return os.path.expanduser(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_path(name: str, revision: str | None, download_dir: str | None, what: str = "model",
                 revision_option: str = "revision") -> str:
    """A local path as it is, or the cached snapshot folder of a Hugging Face id.

    ``revision`` and ``download_dir`` only say where to find an id in the
    cache; given with a local path they would mean nothing, so they are
    refused there rather than ignored.
    """
    path = os.path.expanduser(name)
    if os.path.exists(path):
        for option, value in ((revision_option, revision), ("download_dir", download_dir)):
            if value is not None:
                raise InvalidRequestError(f"{option}={value!r} applies to Hugging Face ids, but {what} {name!r} is "
                                          f"a local path; leave {option} out")
        return path
    if not _REPO_ID.match(name):
        raise ModelLoadError(f"{what} path {path!r} does not exist")
    cache = hub_cache_dir(download_dir)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, revision=revision, cache_dir=cache, local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError, or a malformed cache entry
        at = f" at revision {revision!r}" if revision is not None else ""
        raise ModelLoadError(
            f"{what} {name!r} is not a local path, and not in the local Hugging Face cache at {cache!r}{at}; "
            f"tidyrun does not download: fetch it first (e.g. `hf download {name}`), or set HF_HOME / "
            "HF_HUB_CACHE / download_dir to the cache that holds it") from exc
