"""What every typed config section shares: enum fields declared once, with their choices.

A field made with :func:`choice` carries its allowed values; :func:`choice_problems` checks them for a
section (its own ``__post_init__``) or, with ``nested``, for a whole tree of sections under full dotted
keys (the job's config), and tests enumerate every such field to prove each value can be typed.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from moerl.errors import ConfigError

__all__ = ["ConfigError", "choice", "choice_problems", "check_choices", "unbool_choices"]


def choice(default: str, options: tuple[str, ...]) -> Any:
    """A string field that takes one of ``options``."""
    if default not in options:
        raise ValueError(f"default {default!r} is not among {options}")
    return dataclasses.field(default=default, metadata={"choices": tuple(options)})


def choice_problems(section_type: type, values: Any, prefix: str, nested: bool = False) -> list[str]:
    """``key='value': expected one of ...`` for each choice field of ``values`` (a ``section_type``
    instance or its omegaconf node) whose value is not allowed; with ``nested``, sections inside too."""
    problems = []
    types = typing.get_type_hints(section_type)
    for f in dataclasses.fields(section_type):
        value = getattr(values, f.name)
        options = f.metadata.get("choices")
        if options is not None and value not in options:
            problems.append(f"{_key(prefix, f.name)}={value!r}: expected one of {', '.join(options)}")
        elif nested and dataclasses.is_dataclass(types[f.name]):
            problems += choice_problems(types[f.name], value, _key(prefix, f.name), nested=True)
    return problems


def unbool_choices(section_type: type, node: Any) -> None:
    """A choice field whose options include ``true``/``false`` (``run.resume``) written as a YAML boolean reaches it as
    ``True``/``False``: give it back its option's spelling, in ``node`` (an omegaconf node of ``section_type``) and the
    sections inside."""
    types = typing.get_type_hints(section_type)
    for f in dataclasses.fields(section_type):
        value = getattr(node, f.name)
        options = f.metadata.get("choices")
        if options is not None and value in ("True", "False") and value.lower() in options:
            setattr(node, f.name, value.lower())
        elif options is None and dataclasses.is_dataclass(types[f.name]):
            unbool_choices(types[f.name], value)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_choices(section: Any, prefix: str) -> None:
    """Raise :class:`ConfigError` for the first disallowed choice of ``section`` (its own fields)."""
    problems = choice_problems(type(section), section, prefix)
    if problems:
        raise ConfigError("; ".join(problems))
