"""Errors a user can act on.

Every command (the job, the converter, ``moerl serve``) reports a :class:`MoerlError` as one ``error:``
line (an HTTP 400 for an engine request), never as a traceback: its message names the problem and what
to change. Any other exception is a bug in moerl.
"""

from __future__ import annotations


class MoerlError(Exception):
    """Bad input or setup; the message names the problem and what to change."""

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.relayed = False  # raised on a trainer rank because global rank 0 hit the problem: rank 0 prints it
        self.said = False  # printed where it was raised already (the job says it before its teardown)


def relayed(error: MoerlError) -> MoerlError:
    """``error`` as the other trainer ranks raise it when global rank 0 hit the problem: only rank 0 prints it."""
    error.relayed = True
    return error


class ConfigError(MoerlError):
    """A config moerl cannot run with: a section of the job's, or a model's config.json."""


class EnginesDown(MoerlError):
    """No inference engine answered for ``engines.down_timeout_s``: the job writes a checkpoint and stops."""


class RolloutManagerLost(MoerlError):
    """The rollout manager process exited during the run: the job writes a checkpoint and stops."""


class LoRAError(MoerlError):
    """A LoRA setup or adapter that does not fit the model, the layout or its own description."""


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions ``error`` stands for: the leaves of the exception groups it nests (a task group's), or itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in leaves(e)]
    return [error]
