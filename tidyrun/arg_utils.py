"""vLLM's ``EngineArgs`` and ``FlexibleArgumentParser``: ``LLM``'s keywords as a dataclass and as command-line options.

vLLM's offline examples build the engine from the command line
(``EngineArgs.add_cli_args(parser)``, then ``LLM(**vars(parser.parse_args()))``)
or from ``LLM(**asdict(EngineArgs(model=..., ...)))``. Here both are made from
``LLM.__init__``'s own signature, so every field is a keyword ``LLM`` takes,
with ``LLM``'s default, and a keyword added to ``LLM`` is an option at once.
Its values are checked where ``LLM`` checks them (``engine_args.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys

from .engine import LLM

_NOT_OPTIONS = ("self", "config", "process_group")  # Python objects, not settings


def _fields() -> list[tuple[str, str, object]]:
    """(name, annotation text, default) of each of ``LLM``'s keywords, in its signature's order."""
    params = inspect.signature(LLM.__init__).parameters.values()
    return [(p.name, p.annotation if isinstance(p.annotation, str) else "", p.default)
            for p in params if p.name not in _NOT_OPTIONS]


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({exc})") from None


def _option(annotation: str) -> dict:
    """``add_argument``'s keywords for a keyword of this annotation (vLLM's spellings: JSON for
    dicts, ``--flag/--no-flag`` for booleans, space-separated lists)."""
    kinds = {k.strip() for k in annotation.split("|")}
    if kinds & {"dict", "SpeculativeConfig"} or not annotation:
        return dict(type=_json)
    if "bool" in kinds and "str" not in kinds:
        return dict(action=argparse.BooleanOptionalAction)
    if "list[int]" in kinds:
        return dict(type=int, nargs="+")
    if "list" in kinds:
        return dict(type=_json)
    if "int" in kinds:
        return dict(type=int)
    if "float" in kinds:
        return dict(type=float)
    return dict(type=str)


def _add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every ``LLM`` keyword as ``--its-name`` (default: ``LLM``'s); returns the parser, as vLLM's does."""
    group = parser.add_argument_group("engine options (tidyrun.LLM's keywords)")
    for name, annotation, default in _fields():
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, default=default, **_option(annotation))
    return parser


def _from_cli_args(cls, args: argparse.Namespace):
    """The EngineArgs of parsed options (those ``add_cli_args`` added; others are left to the caller)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", [(name, annotation or "object", dataclasses.field(default=default)) for name, annotation, default
                   in _fields()],
    namespace={"add_cli_args": staticmethod(_add_cli_args), "from_cli_args": classmethod(_from_cli_args),
               "__doc__": "vLLM's EngineArgs: one field per ``LLM`` keyword, with its default; "
                          "``LLM(**dataclasses.asdict(engine_args))`` builds the engine."})
EngineArgs.__module__ = __name__  # (make_dataclass's module= is Python 3.12's)

# vLLM's AsyncEngineArgs: EngineArgs plus its request-logging switches (tidyrun logs no requests: no effect).
AsyncEngineArgs = dataclasses.make_dataclass(
    "AsyncEngineArgs", [("enable_log_requests", bool, dataclasses.field(default=False)),
                        ("disable_log_requests", bool, dataclasses.field(default=True))],
    bases=(EngineArgs,), namespace={"__doc__": "vLLM's AsyncEngineArgs: EngineArgs plus request-logging switches "
                                               "(no effect: tidyrun logs no requests)."})
AsyncEngineArgs.__module__ = __name__


def llm_from_engine_args(engine_args, stat_loggers, owner: str) -> LLM:
    """The ``LLM`` an ``(Async)EngineArgs`` describes (every field an ``LLM`` keyword), for ``owner``'s
    ``from_engine_args``. Custom ``stat_loggers`` are refused: there are no pluggable loggers to call
    (``LLM.get_metrics()`` and the server's /metrics read the engine's counters)."""
    from .errors import InvalidRequestError

    if stat_loggers:
        raise InvalidRequestError(f"{owner}.from_engine_args(stat_loggers=...) is not supported: tidyrun has no "
                                  "pluggable stat loggers; read get_metrics() or the server's /metrics")
    if not isinstance(engine_args, EngineArgs):
        raise InvalidRequestError(f"from_engine_args needs an EngineArgs, got {type(engine_args).__name__}")
    return LLM(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)})


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's parser: ``--max_model_len`` is read as ``--max-model-len`` (options with underscores or dashes)."""

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args([_dashed(a) for a in (sys.argv[1:] if args is None else args)], namespace)


def _dashed(arg: str) -> str:
    """``--some_option[=value]`` as ``--some-option[=value]``; anything else as it is."""
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg.partition("=")
    return key.replace("_", "-") + eq + value
