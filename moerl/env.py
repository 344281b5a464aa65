"""Process environments, ports and lifetimes of the children a trainer rank starts."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from collections.abc import Iterable

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
    return free_ports(1)[0]


def free_ports(n: int, avoid: Iterable[int] = ()) -> list[int]:
    """``n`` distinct TCP ports free at the time of asking, none of ``avoid`` (ports handed out but not yet bound).
    Held open together while picked: a port asked for alone, closed and asked for again, can come back the same
    (48 replicas once drew one port twice)."""
    avoid, held, ports = set(avoid), [], []
    try:
        while len(ports) < n:  # each bound socket stays bound: at most n + len(avoid) of them
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # looked up here, in the parent: between fork and exec nothing should be loaded
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` of the engines and the rollout manager: the kernel SIGKILLs the child when the thread that started
    it ends, however the trainer rank ends (a SIGKILLed rank 0 leaves no engine holding GPUs, no manager waiting on
    a socket). So start them from a thread that lives as long as they should (the main thread). Linux only."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie nobody has reaped yet (a container's init may never)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):  # no /proc (not Linux), or gone since: the next look tells
        return False


def group_gone(pgid: int) -> bool:
    """Whether every process of process group ``pgid`` has ended (zombies included: an ended process has freed its
    memory and its GPU's, whether or not anyone reaps it)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a member of another user's
        return False
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                state, _, group = stat.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # gone since
            continue
        if int(group) == pgid and state != "Z":
            return False
    return os.path.isdir("/proc")  # without /proc (not Linux) a group that answers a signal is taken as alive


def exit_with(pid: int, every_s: float = 1.0) -> None:
    """Initializer of helper processes that nothing ends with ``pid`` (a forkserver's children, a multiprocessing
    Manager's server): end this process once ``pid`` is gone, polled from a daemon thread, so a killed owner leaves no
    helper behind."""
    import threading
    import time

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if _gone(pid):
                os._exit(0)

    threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True).start()


def end_with_launcher(grace_s: float = 60.0, every_s: float = 1.0) -> None:
    """Of a trainer rank: once the launcher that started it is gone, SIGTERM this process (the job's teardown runs:
    engines and rollout manager stopped, accounting written), and end it outright ``grace_s`` later should that not
    (a rank blocked in a collective its peers left handles no signal). torchrun starts its ranks in sessions of their
    own, where no signal that ends torchrun reaches: a SIGKILLed torchrun (OOM killer, a scheduler's hard kill, a
    timeout's --kill-after) left every rank running, holding its GPU and loading its weights into the engines that
    the next job was given. Polled from a daemon thread: the parent changes once the launcher is gone."""
    import threading
    import time

    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(every_s)
        print(f"moerl: the launcher of this rank (pid {launcher}) is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name=f"end-with-launcher-{launcher}", daemon=True).start()
