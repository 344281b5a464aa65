"""What every typed config section shares: enum fields as ``Literal`` types, which the type checker sees.

A field annotated ``Literal["a", "b"]`` takes one of those strings (omegaconf validates it when a config is loaded);
:func:`choice_problems` checks them for a section built directly (its own ``__post_init__``) or, with ``nested``, for a
whole tree of sections under full dotted keys, and tests enumerate every such field to prove each value can be typed.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from moerl.errors import ConfigError

__all__ = [
    "ConfigError",
    "check_choices",
    "choice_fields",
    "choice_problems",
    "choices",
    "literal_text",
]


def choices(annotation: Any) -> tuple[str, ...] | None:
    """The values a ``Literal`` annotation allows (None: not a Literal)."""
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None


def choice_fields(section_type: type, prefix: str = "") -> list[tuple[str, tuple[str, ...]]]:
    """``(dotted key, allowed values)`` of every Literal field of ``section_type`` and the sections inside it."""
    out = []
    hints = typing.get_type_hints(section_type)
    for f in dataclasses.fields(section_type):
        key = _key(prefix, f.name)
        if (options := choices(hints[f.name])) is not None:
            out.append((key, options))
        elif dataclasses.is_dataclass(hints[f.name]):
            out += choice_fields(hints[f.name], key)
    return out


def choice_problems(section_type: type, values: Any, prefix: str, nested: bool = False) -> list[str]:
    """``key='value': expected one of ...`` for each Literal field of ``values`` (a ``section_type`` instance) whose
    value is not allowed; with ``nested``, sections inside too."""
    problems = []
    hints = typing.get_type_hints(section_type)
    for f in dataclasses.fields(section_type):
        value = getattr(values, f.name)
        options = choices(hints[f.name])
        if options is not None and value not in options:
            problems.append(f"{_key(prefix, f.name)}={value!r}: expected one of {', '.join(options)}")
        elif nested and dataclasses.is_dataclass(hints[f.name]):
            problems += choice_problems(hints[f.name], value, _key(prefix, f.name), nested=True)
    return problems


def literal_text(section_type: type, raw: Any) -> Any:
    """``raw`` (a section's values as read from YAML) with a YAML boolean given back its spelling where a Literal field
    takes ``true``/``false`` as text (``run.resume``): YAML reads the unquoted word as a boolean."""
    if not isinstance(raw, dict):
        return raw
    hints = typing.get_type_hints(section_type)
    out = dict(raw)
    for f in dataclasses.fields(section_type):
        if f.name not in raw:
            continue
        value, options = raw[f.name], choices(hints[f.name])
        if options is not None and isinstance(value, bool) and str(value).lower() in options:
            out[f.name] = str(value).lower()
        elif dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = literal_text(hints[f.name], value)
    return out


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_choices(section: Any, prefix: str) -> None:
    """Raise :class:`ConfigError` for the first disallowed choice of ``section`` (its own fields)."""
    problems = choice_problems(type(section), section, prefix)
    if problems:
        raise ConfigError("; ".join(problems))
