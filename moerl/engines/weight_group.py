"""The process group a trainer and its engines share for weight broadcasts.

Built the way SGLang's ``init_custom_process_group`` builds it (a TCP rendezvous at
``master_address:master_port`` with the trainer as rank 0, keys under a ``group_name`` prefix), so a
trainer that joins with :func:`join_weight_group` talks to real SGLang servers and to the embedded
engine alike. Kept out of the default process group: both sides have their own. What a broadcast
carries is one ``flattened_bucket``: the tensors' bytes back to back, described by the HTTP request
that announces it.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

from moerl.dtypes import dtype_name
from moerl.engines.protocol import ProtocolError

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

# How long a weight group's rendezvous and each of its collectives may take. gloo cannot abort a collective: after a
# failed bucket its broadcast waits this long in its thread, and the process waits for that thread at its exit.
TIMEOUT_S = 600.0
# Groups of one run an engine may hold per sender: the first and three formed again (after failed pushes, engines gone
# and back). Each holds an NCCL communicator on the engine's GPUs, outside mem_fraction_static, until the engine exits:
# SGLang 0.5.23's /destroy_weights_update_group destroys, which NCCL makes a collective with peers that aborted their
# side.
MAX_GROUPS_PER_ENGINE = 4


def weight_store(master_address: str, master_port: int, world_size: int, rank: int) -> dist.TCPStore:
    """The group's rendezvous store, hosted by rank 0. On rank 0, ``master_port=0`` binds a free port
    (read it back as ``store.port``): a port chosen beforehand and bound later can be taken in between
    by any process on the machine (gloo's own listening sockets, for one).

    Made here rather than through rendezvous(): under torchrun, rendezvous() would join the elastic
    agent's store (TORCHELASTIC_USE_AGENT_STORE) instead of hosting this group's at master_port.
    """
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
        wait_for_workers=False,
    )


def join_weight_group(
    backend: str, store: dist.Store, world_size: int, rank: int, group_name: str
) -> dist.ProcessGroup:
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=cast("GroupName", group_name),  # torch's NewType of str, which only recent releases define
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    # Collectives on a group take global ranks; here the group is its own world.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


# Groups abandoned, held for the process's life: gloo cannot abort a collective, and freeing a group waits for the
# collectives its threads still hold (a refused bucket's broadcast, until TIMEOUT_S), which mid-run would stall the push
# made again for that long.
_ABANDONED: list[dist.ProcessGroup] = []


def abandon_weight_group(group: dist.ProcessGroup) -> None:
    """Abort ``group`` on this side and forget it. An abort is local and frees its communicator's buffers; NCCL's
    destroy is collective with the engines, which are not calling it, so a group still registered when the job destroys
    its process groups at exit would hang there."""
    dist.distributed_c10d._abort_process_group(group)
    _ABANDONED.append(group)


def in_daemon_thread(fn, *args) -> asyncio.Future:
    """``fn(*args)`` (a collective with the engines) in a daemon thread, as a future of this event loop.

    An engine that refuses its side of a collective leaves ours waiting until the group's timeout; a
    daemon thread lets the sync fail at once with the engine's answer and the process exit, where
    ``asyncio.to_thread``'s worker would be joined at exit for as long as the wait lasts."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome, failed: bool) -> None:
        if not future.done():
            future.set_exception(outcome) if failed else future.set_result(outcome)

    def work():
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - whatever it raises is handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, e, True)
        else:
            loop.call_soon_threadsafe(settle, result, False)

    threading.Thread(target=work, name="moerl-collective", daemon=True).start()
    return future


def bucket_layout(dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Byte ``(start, end)`` of each tensor in a ``flattened_bucket`` broadcast: the tensors' raw
    bytes back to back in request order, each starting at a multiple of its element size (SGLang
    refuses unaligned buckets; order tensors by element size, largest first, to keep them aligned)."""
    spans, offset = [], 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        itemsize = getattr(torch, dtype).itemsize
        if offset % itemsize:
            raise ProtocolError(f"tensor {i} ({dtype}) would start at byte {offset}, not a multiple of {itemsize}")
        size = itemsize * int(np.prod(shape, dtype=np.int64))
        spans.append((offset, offset + size))
        offset += size
    return spans


def flatten_bucket(named: list[tuple[str, Any]], into: torch.Tensor | None = None):
    """Sender side: ``(uint8 tensor, names, dtypes, shapes)`` for one flattened_bucket broadcast. A lone contiguous
    tensor is sent as it is (no copy); several are copied into the front of ``into`` where it is large enough (a
    buffer reused from bucket to bucket: a fresh one per bucket costs the page faults of its every byte)."""
    named = sorted(named, key=lambda nt: -nt[1].element_size())
    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named]
    total = sum(r.numel() for r in raw)
    if len(raw) == 1:
        flat = raw[0]
    elif into is not None and into.numel() >= total and into.device == raw[0].device:
        flat = torch.cat(raw, out=into[:total])
    else:
        flat = torch.cat(raw)
    return flat, [n for n, _ in named], [dtype_name(t.dtype) for _, t in named], [list(t.shape) for _, t in named]


def unflatten_bucket(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[tuple[str, torch.Tensor]]:
    # Strict: a request's names, dtypes and shapes are one list each of the same tensors (checked when it is parsed).
    return [
        (name, flat[start:end].view(getattr(torch, dtype)).reshape(shape))
        for name, dtype, shape, (start, end) in zip(names, dtypes, shapes, bucket_layout(dtypes, shapes), strict=True)
    ]
