"""Dynamic sampling (DAPO): which scored groups a step trains on (``rollout.filter_groups``).

A filter sees a group's samples once they are scored, before the group reaches the trainer, and says whether to train
on it. A group it turns away is dropped (``filtered``, in the accounting) and another prompt is issued in its place,
so a step still trains ``groups_per_step`` groups.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moerl.plugins import Registry, callable_problem
from moerl.sample import Sample

GroupFilter = Callable[[list[Sample]], bool]  # a group's samples -> whether to train on it
FILTERS: Registry[GroupFilter] = Registry("rollout.filter_groups", callable_problem)


@FILTERS.register("zero_variance")
def reward_varies(samples: list[Sample]) -> bool:
    """Whether the group's rewards differ: where they do not, every GRPO advantage is zero and it teaches nothing."""
    return bool(np.ptp([s.reward for s in samples]) > 0)


def load_filter(name: str) -> GroupFilter | None:
    """``none`` (None), a built-in filter, or ``package.module:function``; :class:`ConfigError` if not one."""
    return None if name == "none" else FILTERS.load(name)
