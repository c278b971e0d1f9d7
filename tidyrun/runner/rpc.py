"""collective_rpc on one rank: the named calls RL frameworks make through vLLM's ``LLM.collective_rpc``.

vLLM runs ``collective_rpc(method, args, kwargs)`` on every worker: a
method name of its worker (or of the ``worker_extension_cls`` mixed into it),
or a function that receives the worker. tidyrun's ranks are ModelRunners,
whose methods are not vLLM's worker's, so only the names that mean the same
thing here are accepted, and they are mapped in this one place, which the
driver and the tensor-parallel workers share. A function (and an extension's
method) receives the rank's ``RankWorker``: the part of vLLM's worker such
code reads (``self.model_runner.model.load_weights(...)``, ``self.rank``,
``self.device``) in front of the rank's runner.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

from ..errors import InvalidRequestError

# name -> what it does on one rank
RPC_METHODS = MappingProxyType({
    "reload_weights": "re-read the weights from the model source (the model files; random for load_format='dummy')",
    "load_weights": "load HF-named tensors in place (kwargs weights=iterable of (name, tensor), as update_weights)",
})


def check_rpc_method(method, extension: type | None = None):
    """The method to run: a callable, one of ``RPC_METHODS``, or (as a function taking the worker) the method of
    that name of ``extension`` (the engine's ``worker_extension_cls``); else InvalidRequestError listing them."""
    if callable(method) or (isinstance(method, str) and method in RPC_METHODS):
        return method
    if isinstance(method, str) and extension is not None and callable(getattr(extension, method, None)):
        return getattr(extension, method)
    names = "; ".join(f"{name!r}: {what}" for name, what in RPC_METHODS.items())
    ours = "" if extension is None else (f"; the methods of worker_extension_cls {extension.__qualname__}: "
                                         f"{', '.join(extension_methods(extension)) or 'none'}")
    raise InvalidRequestError(f"collective_rpc: unsupported method {method!r}; tidyrun's ranks run {names}{ours}; "
                              "or pass a function, which receives each rank's worker (self.model_runner, self.rank)")


def extension_methods(extension: type) -> list[str]:
    """The public methods of a ``worker_extension_cls``: the names ``collective_rpc`` takes for it."""
    return sorted(n for n in dir(extension) if not n.startswith("_") and callable(getattr(extension, n)))


def load_extension(spec) -> type | None:
    """``worker_extension_cls`` as vLLM takes it (a class, or its "package.module.Class" path; "" or None: none),
    imported now so that a wrong path fails at construction with InvalidRequestError."""
    if spec in ("", None):
        return None
    if isinstance(spec, type):
        return spec
    if not isinstance(spec, str) or "." not in spec:
        raise InvalidRequestError(f"worker_extension_cls must be a class or a 'package.module.Class' path, "
                                  f"got {spec!r}")
    module, _, name = spec.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise InvalidRequestError(f"worker_extension_cls={spec!r} cannot be imported: {type(exc).__name__}: {exc}") \
            from None
    if not isinstance(found, type):
        raise InvalidRequestError(f"worker_extension_cls={spec!r} is not a class but {type(found).__name__}")
    return found


class RankWorker:
    """What a ``collective_rpc`` function, or a ``worker_extension_cls`` method, gets as ``self``: the attributes
    of vLLM's worker that such code reads, in front of one rank's runner. ``model_runner`` is the runner (its
    ``model.load_weights(pairs)`` loads and counts weights, as vLLM's does), ``rank`` its tensor-parallel rank,
    ``local_rank`` its device's index, ``device`` its device; any other attribute is the runner's
    (``update_weights``, ``reload_weights``: tidyrun's own spelling). Attributes a call sets stay on it for
    later calls on this rank (an extension keeps its process group there), until the runner shuts down.
    Owns no device memory itself; what a caller's code stores on it is the caller's."""

    def __init__(self, runner) -> None:
        self.model_runner, self.rank, self.device = runner, runner.shard.rank, runner.device
        self.local_rank = self.device.index if self.device.index is not None else self.rank

    def __getattr__(self, name: str):
        return getattr(self.model_runner, name)

    def __repr__(self) -> str:
        return f"RankWorker(rank={self.rank}, device={self.device})"


class ApplyModel:
    """``LLM.apply_model(func)`` as a ``collective_rpc`` function: ``func`` called with the rank's model (a
    class, not a closure, so that it pickles to tensor-parallel workers whenever ``func`` does)."""

    def __init__(self, func) -> None:
        self.func = func

    def __call__(self, worker: RankWorker):
        return self.func(worker.model_runner.model)


def call_on_rank(runner, method, args: tuple, kwargs: dict):
    """Run ``method`` (from ``check_rpc_method``) on this rank's runner; returns its result. A function gets the
    rank's ``RankWorker`` (one per runner: what it keeps on it stays for the next call)."""
    if callable(method):
        worker = runner.rpc_worker
        if worker is None:
            worker = runner.rpc_worker = RankWorker(runner)
        return method(worker, *args, **kwargs)
    if method == "reload_weights":
        return runner.reload_weights(*args, **kwargs)
    return runner.update_weights(*args, **kwargs)
