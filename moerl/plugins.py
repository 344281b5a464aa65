"""One registry for everything a config names by string: agents, tools, group filters, rewards, verdicts,
combinations, and the objectives' policy losses, corrections and aggregations.

Each concept keeps its :class:`Registry` beside its code; built-ins register with the decorator, and a user's plugin is
named ``package.module:name`` in the config. Loading checks what was named against the registry's kind (a function of
the right shape, a :class:`~moerl.episodes.tools.Tool`), so a wrong name is one :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from moerl.errors import ConfigError

T = TypeVar("T")


def import_object(name: str, key: str) -> Any:
    """The object ``name`` (``package.module:attribute``) names, for the config key ``key``; one error naming the key
    where it cannot be loaded."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{key}={name!r}: expected 'package.module:attribute'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={name!r} cannot be loaded: {e}") from None


class Registry(Generic[T]):
    """Named built-ins of one kind, and the loader of a config's choice among them or of a plugin.

    ``key``: the config key that names one (in errors); ``problem``: what is wrong with an object offered as one of
    this kind (None: nothing), applied to built-ins as they register and to plugins as they load."""

    def __init__(self, key: str, problem: Callable[[Any], str | None]):
        self.key = key
        self.problem = problem
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers its object under ``name``."""

        def add(entry: T) -> T:
            if name in self._entries or ":" in name:
                raise ValueError(f"{self.key}: {name!r} is registered already or has a ':'")
            if (problem := self.problem(entry)) is not None:
                raise TypeError(f"{self.key}: the built-in {name!r} {problem}")
            self._entries[name] = entry
            return entry

        return add

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def load(self, name: str) -> T:
        """The built-in ``name``, or the plugin ``package.module:name``; :class:`ConfigError` naming the key if it is
        neither or not of this kind."""
        if name in self._entries:
            return self._entries[name]
        if ":" not in name:
            names = ", ".join(self._entries)
            raise ConfigError(f"{self.key}={name!r}: expected one of {names} or 'package.module:name'")
        entry = import_object(name, self.key)
        if (problem := self.problem(entry)) is not None:
            raise ConfigError(f"{self.key}={name!r} {problem}")
        return entry

    def check(self, name: str) -> None:
        """Raise :class:`ConfigError` where :meth:`load` would (a config section checks its choice early)."""
        self.load(name)


def callable_problem(entry: Any) -> str | None:
    return None if callable(entry) else f"is {type(entry).__name__}, not a function"
