"""Typed configs and options: mappings (YAML, JSON, keyword arguments) and drafter spec strings -> frozen dataclasses.

One converter serves every place that reads settings, so a boolean is a boolean everywhere:
- `from_dict(cls, mapping)`: recursive; unknown keys and wrong types are a one-line SelfspecError naming the valid keys.
  With `from_text=True` (options typed on a command line) string values are converted first: "false" -> False,
  "6" -> 6, "0.3" -> 0.3, "none" -> None.
- `parse_drafter_spec("layerskip:adaptive=false,max_draft=6")` -> ("layerskip", {"adaptive": "false", "max_draft":
"6"}).
- `split_drafter_specs("medusa,layerskip:threshold=0.3,max_draft=6")` -> ["medusa",
"layerskip:threshold=0.3,max_draft=6"]:
  a comma-separated item holding "=" but no ":" continues the spec before it (a drafter name never holds "=").
"""

from __future__ import annotations

import dataclasses
import types
import typing

from .errors import SelfspecError

_TRUE, _FALSE, _NONE = ("true", "yes", "on", "1"), ("false", "no", "off", "0"), ("none", "null", "")


def from_dict(cls, data, where: str = "config", from_text: bool = False):
    """Build dataclass `cls` from a mapping, recursively; unknown keys and wrong types are a SelfspecError."""
    if not isinstance(data, dict):
        raise SelfspecError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        valid = ", ".join(fields) or "none"
        raise SelfspecError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {valid}")
    hints = typing.get_type_hints(cls)
    values = {name: _coerce(hints[name], value, f"{where}.{name}", from_text) for name, value in data.items()}
    return cls(**values)


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def _coerce(hint, value, where: str, from_text: bool):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (from_text and isinstance(value, str) and value.lower() in _NONE)):
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _coerce(inner, value, where, from_text)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where, from_text)
    if origin is tuple:
        if from_text and isinstance(value, str):
            value = [item for item in value.split("+") if item]  # tuples on a command line: a+b+c
        if not isinstance(value, (list, tuple)):
            raise SelfspecError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(args[0], item, where, from_text) for item in value)
    if from_text and isinstance(value, str) and hint in (bool, int, float):
        return _from_text(hint, value, where)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is not hint:
        raise SelfspecError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def _from_text(hint, text: str, where: str):
    lowered = text.strip().lower()
    if hint is bool:
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise SelfspecError(f"{where}: expected true or false, got {text!r}")
    try:
        return hint(lowered)
    except ValueError:
        raise SelfspecError(f"{where}: expected {'an integer' if hint is int else 'a number'}, got {text!r}") from None


def format_option(value) -> str:
    """An option value as a spec writes it (the inverse of the text conversion): 1+3 for tuples, none for None."""
    if isinstance(value, tuple):
        return "+".join(format_option(item) for item in value)
    return "none" if value is None else str(value)


def parse_drafter_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'eagle:fixed_nodes=60,top_k=10' -> ('eagle', {'fixed_nodes': '60', 'top_k': '10'}). Options may also be
    separated by colons ('eagle:fixed_nodes=60:top_k=10'). Values stay text: the drafter's options class types them."""
    if not isinstance(spec, str) or not spec.strip():
        raise SelfspecError("a drafter spec is empty: pass a name such as 'ngram' or 'eagle:fixed_nodes=60'")
    name, _, rest = spec.strip().partition(":")
    options: dict[str, str] = {}
    for pair in (item.strip() for item in rest.replace(":", ",").split(",")):
        if not pair:
            continue
        key, separator, value = pair.partition("=")
        if not separator or not key.strip():
            raise SelfspecError(f"drafter option '{pair}' in '{spec}' is not KEY=VALUE")
        if key.strip() in options:
            raise SelfspecError(f"drafter option '{key.strip()}' is given twice in '{spec}'")
        options[key.strip()] = value.strip()
    return name.strip(), options


def split_drafter_specs(text: str) -> list[str]:
    """A comma-separated list of drafter specs, where a spec's own options are comma-separated too."""
    specs: list[str] = []
    for item in (piece.strip() for piece in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item:
            if not specs:
                raise SelfspecError(f"drafter option '{item}' comes before any drafter name")
            specs[-1] += ("," if ":" in specs[-1] else ":") + item
        else:
            specs.append(item)
    return specs
