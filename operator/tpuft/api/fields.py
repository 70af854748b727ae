"""One declaration per API field: a dataclass field plus what the API says about it.

A section of the spec or the status is a frozen dataclass whose fields are declared with
`declare(...)`: the JSON name, the description, the API server's default, the limits, the
enum, the pattern and whether the workload reads it. From those declarations come the CRD's
OpenAPI schema (`schema_of`), the parser's single-field checks with the API server's own
wording (`check`), the JSON a section reads from and writes to (`from_json`, `to_json`) and
the API reference. Pure: no I/O, no Kubernetes client.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Callable

API = "api"   # the key of a declared field's metadata


@dataclass(frozen=True)
class Api:
    """What the API says about one field."""
    description: str
    name: str = ""                      # the JSON name; "" is the attribute's name in camelCase
    default: Any = None                 # what the API server fills in when it is left out (None: nothing)
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    enum: tuple[Any, ...] = ()
    pattern: str | None = None          # RE2-compatible: the CRD uses it as is
    # (RE2 pattern, message): a CEL rule `self.matches(...)`, for a pattern whose failure is better
    # said in words; the server and the parser give the same message.
    matches: tuple[str, str] | None = None
    # (RE2 pattern, message) pairs the value must NOT match: each a CEL rule `!self.matches(...)`,
    # with the same message from the server and the parser.
    refuses: tuple[tuple[str, str], ...] = ()
    min_length: int | None = None
    max_length: int | None = None
    format: str | None = None           # e.g. date-time
    required: bool = False
    workload: bool = False              # the workload reads it: it is in the run's document
    flag: str = ""                      # the workload CLI's flag; "" is the JSON name in kebab-case
    # Where the type says too little (int-or-string, unions, preserved fields): the schema by hand.
    schema: Callable[[], dict] | None = None
    rules: tuple[Mapping[str, str], ...] = ()   # CEL on this property (x-kubernetes-validations)


def declare(description: str, *, default: Any = None, python_default: Any = MISSING,
            factory: Callable[[], Any] | None = None, **api: Any) -> Any:
    """A dataclass field with its API declaration. `default` is the API server's default and, unless
    `python_default` or `factory` says otherwise, the Python one (None: neither has one)."""
    meta = {API: Api(description, default=_plain(default), **api)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=_plain(default) if python_default is MISSING else python_default, metadata=meta)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


@dataclass(frozen=True)
class Declared:
    """One declared field of a section: its attribute, JSON name, type and declaration."""
    attribute: str
    name: str
    type: Any
    api: Api


_HINTS: dict[type, dict[str, Any]] = {}


def declared(cls: type) -> list[Declared]:
    """The declared fields of a section, in declaration order."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    hints = _HINTS[cls]
    return [Declared(f.name, f.metadata[API].name or camel(f.name), hints[f.name], f.metadata[API])
            for f in dataclasses.fields(cls) if API in f.metadata]


def field_of(cls: type, attribute: str) -> Declared:
    for d in declared(cls):
        if d.attribute == attribute:
            return d
    raise KeyError(f"{cls.__name__}.{attribute} is not declared")


def _unwrap(tp: Any) -> Any:
    """X | None -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _type_schema(tp: Any) -> dict:
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str or (isinstance(tp, type) and issubclass(tp, str)):
        return {"type": "string"}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return schema_of(tp)
    if origin in (tuple, list):
        return {"type": "array", "items": _type_schema(typing.get_args(tp)[0])}
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        args = typing.get_args(tp)
        return {"type": "object", "additionalProperties": _type_schema(args[1]) if args else {}}
    raise TypeError(f"no schema for {tp!r}: declare it with schema=")


def property_schema(d: Declared) -> dict:
    """A declared field's OpenAPI schema: its type's, then its declaration's description, limits and rules."""
    a = d.api
    out = dict(a.schema()) if a.schema is not None else _type_schema(d.type)
    if dataclasses.is_dataclass(_unwrap(d.type)) and a.schema is None:
        out = {k: v for k, v in out.items() if k != "description"}
    head = {"type": out.pop("type")} if "type" in out else {}
    out = {**head, "description": a.description, **out}
    if a.default is not None:
        out["default"] = a.default
    for key, value in (("format", a.format), ("minLength", a.min_length), ("maxLength", a.max_length),
                       ("pattern", a.pattern)):
        if value is not None:
            out[key] = value
    if a.minimum is not None:
        out["minimum"] = a.minimum
        if a.exclusive_minimum:
            out["exclusiveMinimum"] = True
    if a.maximum is not None:
        out["maximum"] = a.maximum
        if a.exclusive_maximum:
            out["exclusiveMaximum"] = True
    if a.enum:
        out["enum"] = list(a.enum)
    rules = [*([matches_rule(*a.matches)] if a.matches else []),
             *(refuses_rule(*refused) for refused in a.refuses),
             *(dict(r) for r in a.rules)]
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


def matches_rule(pattern: str, message: str) -> dict[str, str]:
    """A CEL rule that the string matches `pattern`, failing with `message`."""
    quote = "'" * (3 if "'" in pattern else 1)   # a raw string the pattern cannot end
    return {"rule": f"self.matches(r{quote}{pattern}{quote})", "message": message}


def refuses_rule(pattern: str, message: str) -> dict[str, str]:
    """A CEL rule that the string does not match `pattern`, failing with `message`."""
    rule = matches_rule(pattern, message)
    return {**rule, "rule": "!" + rule["rule"]}


def schema_of(cls: type, description: str | None = None, **extra: Any) -> dict:
    """The OpenAPI schema of a section: every declared field, in order, and the required ones."""
    fields = declared(cls)
    out: dict[str, Any] = {"type": "object"}
    if description is not None:
        out["description"] = description
    out["properties"] = {d.name: property_schema(d) for d in fields}
    required = [d.name for d in fields if d.api.required]
    if required:
        out["required"] = required
    out.update(extra)
    return out


def defaults(cls: type, prefix: str = "") -> dict[str, Any]:
    """{dotted JSON path: the API server's default} for a section and the sections inside it."""
    out: dict[str, Any] = {}
    for d in declared(cls):
        key = f"{prefix}{d.name}"
        if d.api.default is not None and not isinstance(d.api.default, Mapping):
            out[key] = d.api.default
        inner = _unwrap(d.type)
        # A section the server fills in: one with a default of its own ({}), or a required one.
        if dataclasses.is_dataclass(inner) and isinstance(inner, type) and (
                isinstance(d.api.default, Mapping) or d.api.required):
            out.update(defaults(inner, f"{key}."))
    return out


# --- the single-field checks, worded as the API server words them -----------------------------------

def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return "null" if value is None else type(value).__name__


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def re2_search(pattern: str, value: str) -> bool:
    """re.search as RE2 (the API server's) reads the pattern: a final $ is the end of the text, not a
    place before a trailing newline."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + "\\Z"
    return re.search(pattern, value) is not None


def check(d: Declared, value: Any, path: str) -> str | None:
    """The first single-field problem of a scalar value (type, enum, limits, length, pattern) as the
    API server's schema validation words it after the field path, or None. `path` is the full path."""
    a, kind = d.api, scalar_type(d)
    got = _type_name(value)
    if kind == "number" and got == "integer":
        got = "number"
    if got != kind:
        return f'Invalid value: "{got}": {path} in body must be of type {kind}: "{got}"'
    shown = json.dumps(value)
    if a.enum and value not in a.enum:
        return f"Unsupported value: {shown}: supported values: " + ", ".join(json.dumps(str(e)) for e in a.enum)
    if kind in ("integer", "number"):
        if a.minimum is not None and (value <= a.minimum if a.exclusive_minimum else value < a.minimum):
            word = "greater than" if a.exclusive_minimum else "greater than or equal to"
            return f"Invalid value: {shown}: {path} in body should be {word} {_number(a.minimum)}"
        if a.maximum is not None and (value >= a.maximum if a.exclusive_maximum else value > a.maximum):
            word = "less than" if a.exclusive_maximum else "less than or equal to"
            return f"Invalid value: {shown}: {path} in body should be {word} {_number(a.maximum)}"
    if kind == "string":
        if a.max_length is not None and len(value) > a.max_length:
            return f"Too long: may not be more than {a.max_length} bytes"
        if a.min_length is not None and len(value) < a.min_length:
            return f"Invalid value: {shown}: {path} in body should be at least {a.min_length} chars long"
        if a.pattern is not None and not re2_search(a.pattern, value):
            return f"Invalid value: {shown}: {path} in body should match '{a.pattern}'"
        for pattern, message in a.refuses:   # first: what a refusal names is the more precise
            if re2_search(pattern, value):
                return f"Invalid value: {shown}: {message}"
        if a.matches is not None and not re2_search(a.matches[0], value):
            return f"Invalid value: {shown}: {a.matches[1]}"
    return None


def scalar_type(d: Declared) -> str:
    tp = _unwrap(d.type)
    if d.api.schema is not None:
        return str(d.api.schema().get("type", "object"))
    return str(_type_schema(tp)["type"]) if tp in (bool, int, float) or tp is str or (
        isinstance(tp, type) and issubclass(tp, str)) else "object"


def is_scalar(d: Declared) -> bool:
    return scalar_type(d) in ("boolean", "integer", "number", "string")


# --- JSON in and out ---------------------------------------------------------------------------------

def to_json(value: Any) -> Any:
    """A section (or a value inside one) as JSON: declared names, None left out, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for d in declared(type(value)):
            item = getattr(value, d.attribute)
            if item is not None:
                out[d.name] = to_json(item)
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    return value


def from_json(cls: type, raw: Mapping[str, Any] | None) -> Any:
    """A section from JSON this module wrote (or the API server stored): no checks, what is missing
    takes the Python default, keys no field declares are dropped."""
    raw = raw or {}
    kwargs: dict[str, Any] = {}
    for d in declared(cls):
        if d.name in raw and raw[d.name] is not None:
            kwargs[d.attribute] = _value_from_json(d.type, raw[d.name])
    return cls(**kwargs)


def _value_from_json(tp: Any, value: Any) -> Any:
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type) and isinstance(value, Mapping):
        return from_json(tp, value)
    if origin is tuple and isinstance(value, list):
        return tuple(_value_from_json(typing.get_args(tp)[0], v) for v in value)
    if origin in (dict, Mapping) and isinstance(value, Mapping):
        inner = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        return {k: _value_from_json(inner, v) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    return value
