"""Dynamic sampling (DAPO): which scored groups a step trains on (``rollout.filter_groups``).

A filter sees a group's samples once they are scored, before the group reaches the trainer, and says whether to train
on it. A group it turns away is dropped (``filtered``, in the accounting) and another prompt is issued in its place,
so a step still trains ``groups_per_step`` groups.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moerl.config import import_object
from moerl.errors import ConfigError
from moerl.sample import Sample

GroupFilter = Callable[[list[Sample]], bool]  # a group's samples -> whether to train on it


def reward_varies(samples: list[Sample]) -> bool:
    """Whether the group's rewards differ: where they do not, every GRPO advantage is zero and it teaches nothing."""
    return bool(np.ptp([s.reward for s in samples]) > 0)


FILTERS: dict[str, GroupFilter] = {"zero_variance": reward_varies}


def load_filter(name: str) -> GroupFilter | None:
    """``none`` (None), a built-in filter, or ``package.module:function``; :class:`ConfigError` if not one."""
    if name == "none":
        return None
    keep = FILTERS.get(name) or import_object(name, "rollout.filter_groups")
    if not callable(keep):
        raise ConfigError(f"rollout.filter_groups={name!r} is {type(keep).__name__}, not a function of a group")
    return keep
