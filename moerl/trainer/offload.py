"""The trainer's state off its device and back, for colocated engines that need the GPU meanwhile.

Storages are freed in place (``resize_(0)``, as megatron-core's own gradient-buffer offload does), so every view into
them (parameters inside DDP's contiguous buffers, ``main_grad``, the optimizer's references) stays valid and sees the
bytes again once they are reloaded into the same storage. What is kept goes to host memory first (pinned on CUDA);
what is not (gradients: each step zeroes them) is given back zeroed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class StorageOffload:
    def __init__(self, device: torch.device):
        """``device``: the trainer's; tensors elsewhere (an optimizer's state already in host memory) are left."""
        self.device = device
        self.kept: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # each storage and its host copy
        self.freed: list[tuple[torch.UntypedStorage, int]] = []  # each storage and its size in bytes

    @property
    def active(self) -> bool:
        return bool(self.kept or self.freed)

    @property
    def held_bytes(self) -> int:
        """The bytes off the device."""
        return sum(host.numel() for _, host in self.kept) + sum(size for _, size in self.freed)

    def _storages(self, tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
        """The distinct live storages of ``tensors`` on the device, each once however many views share it."""
        seen, out = set(), []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.device != self.device or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            out.append(storage)
        return out

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Move ``tensors``' storages to host memory, freeing them on the device."""
        moving = []
        for storage in self._storages(tensors):
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            host.copy_(_bytes(storage), non_blocking=True)
            moving.append((storage, host))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies have read the storages before they are freed
        for storage, _ in moving:
            storage.resize_(0)
        self.kept += moving

    def free(self, tensors: Iterable[torch.Tensor]) -> None:
        """Free ``tensors``' storages on the device without keeping their bytes."""
        for storage in self._storages(tensors):
            self.freed.append((storage, storage.nbytes()))
            storage.resize_(0)

    def reload(self) -> None:
        """Every storage back on the device: the kept ones with their bytes, the freed ones zeroed."""
        if not self.active:
            return
        for storage, host in self.kept:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=True)
        for storage, size in self.freed:
            storage.resize_(size)
            _bytes(storage).zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the host copies are dropped next
        self.kept, self.freed = [], []


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
