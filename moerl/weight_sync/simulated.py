"""Weight sync of a simulation (:mod:`moerl.trainer.simulated`): the disk sync's whole sequence, no bytes.

The engines are chosen, paused, sent a checkpoint directory to load and resumed exactly as :class:`DiskSync` does it;
each shard of the directory is a safetensors file whose header is the real one (names, dtypes, shapes, offsets) over a
hole where the bytes would be. A simulated engine checks the header against its model and holds itself for the
checkpoint's bytes at its profile's weight-update rate, so a 60 GB model's sync takes its time there and no disk here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from moerl.weight_sync.base import SyncStats
from moerl.weight_sync.disk import DiskSync

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class SimulatedSync(DiskSync):
    def push_policy(self, trainer) -> SyncStats | None:
        """The simulated trainer's weights (Hub names, shapes, dtype: :meth:`SimulatedTrainer.hub_tensors`) under its
        version."""
        return self.push(trainer.hub_tensors(), str(trainer.version)) if self.link is not None else None

    def on_host(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return named  # meta tensors: nothing to move

    def save_shard(self, shard: list[tuple[str, torch.Tensor]], path: Path) -> None:
        write_hollow_safetensors(shard, path)


def write_hollow_safetensors(named: list[tuple[str, torch.Tensor]], path: Path) -> None:
    """A safetensors file of these tensors' names, dtypes and shapes whose data is a hole (a sparse file: no disk
    used)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
