"""A parallel layout: tensor, pipeline, expert and expert-tensor parallel sizes and the rules they obey.

Plain data, below the model families (which check a layout against a model) and the process groups
(:mod:`moerl.megatron.parallel`, which turn it into megatron-core parallel state)."""

from __future__ import annotations

from dataclasses import dataclass

from moerl.errors import MoerlError


class LayoutError(MoerlError):
    """A parallel layout that does not fit the model or the world size."""


@dataclass(frozen=True, init=False)
class Layout:
    """Tensor, pipeline, expert and expert-tensor parallel sizes; data parallel is what is left.

    ``etp`` defaults to 1 under expert parallelism: experts are small matrices, and megatron's
    "parallel folding" lets EP span the TP ranks, so TP2+EP2 runs on two ranks. Without expert
    parallelism it defaults to ``tp`` and must equal it (see ``__init__``).
    """

    tp: int
    pp: int
    ep: int
    etp: int

    # Written out rather than generated: etp's default depends on tp and ep, so the field is resolved here and is an int
    # once the layout exists.
    def __init__(self, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> None:
        object.__setattr__(self, "tp", tp)
        object.__setattr__(self, "pp", pp)
        object.__setattr__(self, "ep", ep)
        object.__setattr__(self, "etp", (tp if ep == 1 else 1) if etp is None else etp)
        for name in ("tp", "pp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)}: parallel sizes must be >= 1")
        # With EP=1 megatron-core marks expert weights as dense parameters and reduces their
        # gradients over the dense data-parallel group only; if ETP != TP the expert replicas span
        # more ranks than that group and their gradients would silently miss contributions.
        if self.ep == 1 and self.etp != self.tp:
            raise LayoutError(
                f"etp={self.etp} with ep=1 needs etp == tp ({self.tp}): megatron-core reduces expert "
                "gradients over the dense data-parallel group when expert parallelism is off"
            )

    @property
    def sequence_parallel(self) -> bool:
        # megatron-core MoE with TP>1 requires sequence parallelism.
        return self.tp > 1

    def check_world(self, world_size: int) -> None:
        dense = self.tp * self.pp
        expert = self.etp * self.ep * self.pp
        if world_size % dense:
            raise LayoutError(f"world size {world_size} is not divisible by tp*pp = {dense}")
        if world_size % expert:
            raise LayoutError(f"world size {world_size} is not divisible by etp*ep*pp = {expert}")

    def __str__(self) -> str:
        return f"TP{self.tp} PP{self.pp} EP{self.ep} ETP{self.etp}"


# Every size 1: one rank holds the whole model (any others are data parallel). A layout is immutable: one serves as
# every default.
UNSHARDED = Layout()
