"""collective_rpc on one rank: the named calls RL frameworks make through vLLM's ``LLM.collective_rpc``.

vLLM runs ``collective_rpc(method, args, kwargs)`` on every worker: a
method name of its worker, or a function that receives the worker. tidyrun's
ranks are ModelRunners, whose methods are not vLLM's worker's, so only the
names that mean the same thing here are accepted, and they are mapped in
this one place, which the driver and the tensor-parallel workers share. A
function receives the rank's ModelRunner.
"""

from __future__ import annotations

from types import MappingProxyType

from ..errors import InvalidRequestError

# name -> what it does on one rank
RPC_METHODS = MappingProxyType({
    "reload_weights": "re-read the weights from the model source (the model files; random for load_format='dummy')",
    "load_weights": "load HF-named tensors in place (kwargs weights=iterable of (name, tensor), as update_weights)",
})


def check_rpc_method(method) -> None:
    """Refuse a method that is neither a callable nor one of ``RPC_METHODS``, listing those."""
    if callable(method) or (isinstance(method, str) and method in RPC_METHODS):
        return
    names = "; ".join(f"{name!r}: {what}" for name, what in RPC_METHODS.items())
    raise InvalidRequestError(f"collective_rpc: unsupported method {method!r}; tidyrun's ranks run {names}; "
                              "or pass a function, which receives each rank's ModelRunner")


def call_on_rank(runner, method, args: tuple, kwargs: dict):
    """Run ``method`` (checked by ``check_rpc_method``) on this rank's runner; returns its result."""
    if callable(method):
        return method(runner, *args, **kwargs)
    if method == "reload_weights":
        return runner.reload_weights(*args, **kwargs)
    return runner.update_weights(*args, **kwargs)
