"""What a ``StructuredOutputsParams`` asks for: its schema, its cache key, its errors."""

from __future__ import annotations

import copy
import json
from types import MappingProxyType

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams

# Grammar errors can quote the whole grammar; keep the part that names the problem.
_MAX_ERROR_CHARS = 600

KIND_NAMES = MappingProxyType({"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                               "json_object": "json_object"})


def invalid(kind: str, detail: str) -> InvalidRequestError:
    """The error a request gets for a constraint a backend refused (``kind`` as in KIND_NAMES)."""
    detail = detail.strip()
    if len(detail) > _MAX_ERROR_CHARS:
        detail = detail[:_MAX_ERROR_CHARS] + " ..."
    return InvalidRequestError(f"structured outputs: invalid {KIND_NAMES.get(kind, kind)}: {detail}")


def schema_of(spec: StructuredOutputsParams) -> dict:
    """The request's JSON schema as a dict (a copy: the caller's object is never changed); ``json_object``
    is the schema of any object."""
    if spec.kind == "json_object":
        return {"type": "object"}
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise invalid("json", f"not valid JSON ({exc})") from None
    if isinstance(schema, bool):  # JSON Schema allows true/false as whole schemas
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise invalid("json", f"must be a JSON object, got {type(schema).__name__}")
    schema = copy.deepcopy(schema)
    if spec.disable_additional_properties:
        _close_objects(schema)
    return schema


def _close_objects(node) -> None:
    """Set ``additionalProperties: false`` on every object schema that does not say otherwise (vLLM's option)."""
    if isinstance(node, dict):
        if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            _close_objects(value)
    elif isinstance(node, list):
        for value in node:
            _close_objects(value)


def cache_key(spec: StructuredOutputsParams) -> tuple:
    """What determines the compiled grammar; dict order is kept (it orders the JSON properties)."""
    kind = spec.kind
    if kind == "json":
        try:
            value = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        except (TypeError, ValueError) as exc:  # a dict holding sets, objects, cycles ...
            raise invalid("json", f"not serializable as JSON ({exc})") from None
        return (kind, value, spec.disable_any_whitespace, spec.whitespace_pattern, spec.disable_additional_properties)
    if kind == "json_object":
        return (kind, spec.disable_any_whitespace, spec.whitespace_pattern)
    if kind == "choice":
        return (kind, tuple(spec.choice))
    return (kind, getattr(spec, kind))
