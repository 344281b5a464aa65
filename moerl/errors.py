"""Errors a user can act on.

Every command (the job, the converter, ``moerl serve``) reports a :class:`MoerlError` as one ``error:``
line (an HTTP 400 for an engine request), never as a traceback: its message names the problem and what
to change. Any other exception is a bug in moerl.
"""

from __future__ import annotations


class MoerlError(ValueError):
    """Bad input or setup; the message names the problem and what to change."""


class ConfigError(MoerlError):
    """A config moerl cannot run with: a section of the job's, or a model's config.json."""


class LoRAError(MoerlError):
    """A LoRA setup or adapter that does not fit the model, the layout or its own description."""
