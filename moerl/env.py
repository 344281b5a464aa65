"""Process environments and ports of the children a trainer rank starts."""

from __future__ import annotations

import os
import socket

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's rank variables: a child (converter, engine, rollout
    manager) started from a trainer rank must not join, or wait for, the trainer's process group."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port free at the time of asking. Another process can take it before the caller's child
    binds it: launchers using it must handle that (SGLangPool restarts the replica on another)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
