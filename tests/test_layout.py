"""Parallel layouts: defaults, and refusals of layouts megatron-core would run wrongly or not at all."""

from __future__ import annotations

import pytest

from moerl.checkpoint.verify import world_size_for
from moerl.layout import Layout, LayoutError


def test_expert_tensor_parallel_defaults():
    assert Layout(tp=2).etp == 2  # experts replicate like dense weights when EP is off
    assert Layout(tp=2, ep=2).etp == 1  # parallel folding: EP spans the TP ranks
    assert Layout(tp=4, ep=2, etp=2).etp == 2


def test_etp_other_than_tp_without_ep_is_refused():
    with pytest.raises(LayoutError, match=r"etp=1 with ep=1 needs etp == tp \(2\)"):
        Layout(tp=2, etp=1)


@pytest.mark.parametrize("field", ["tp", "pp", "ep", "etp"])
def test_sizes_below_one_are_refused(field):
    with pytest.raises(LayoutError, match=f"{field}=0"):
        Layout(**{field: 0})


def test_world_size_must_divide():
    with pytest.raises(LayoutError, match="not divisible by tp\\*pp = 4"):
        Layout(tp=2, pp=2).check_world(6)
    with pytest.raises(LayoutError, match="not divisible by etp\\*ep\\*pp = 4"):
        Layout(ep=4).check_world(2)


@pytest.mark.parametrize(
    "layout, world",
    [(Layout(), 1), (Layout(tp=2), 2), (Layout(tp=2, ep=2), 2), (Layout(ep=4, pp=2), 8), (Layout(tp=2, pp=2), 4)],
)
def test_smallest_world_for_a_layout(layout, world):
    assert world_size_for(layout) == world
    layout.check_world(world)
