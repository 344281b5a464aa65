"""Process environments, ports and lifetimes of the children a trainer rank starts."""

from __future__ import annotations

import ctypes
import os
import random
import resource
import signal
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's rank variables: a child (converter, engine, rollout
    manager) started from a trainer rank must not join, or wait for, the trainer's process group."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env.update(extra)
    return env


# Where free_ports draws from: below the kernel's ephemeral range, from which bind(0) and every outgoing connection
# take theirs (a gloo listener once took an SGLang server's port between its pick and its bind, and the server hung),
# and below the range SGLang draws its own ports from (22000-29999).
PORT_RANGE = (12000, 22000)


def raise_open_files_limit() -> None:
    """This process's soft limit of open files raised to its hard limit: an engine client holds a socket for each
    request in flight, thousands at production depth, past the 1024 many systems start a process with. Where the
    kernel refuses (an unlimited hard limit above its own cap), the soft limit stays."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def free_port() -> int:
    """A TCP port free at the time of asking. Another process can take it before the caller's child
    binds it: launchers using it must handle that (EnginePool restarts the replica on another)."""
    return free_ports(1)[0]


def free_ports(n: int, avoid: Iterable[int] = ()) -> list[int]:
    """``n`` distinct TCP ports free at the time of asking, none of ``avoid`` (ports handed out but not yet bound),
    drawn at random from :data:`PORT_RANGE` (from the kernel's, by bind(0), where its ephemeral range starts lower).
    Held open together while picked: a port asked for alone, closed and asked for again, can come back the same (48
    replicas once drew one port twice)."""
    avoid = set(avoid)
    low, high = PORT_RANGE
    candidates = iter(random.SystemRandom().sample(range(low, high), high - low)) if high <= _ephemeral_low() else None
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:  # each bound socket stays bound: at most n + len(avoid) of them, or the range's tries
            s = socket.socket()
            held.append(s)
            try:
                s.bind(("", next(candidates, 0) if candidates is not None else 0))
            except OSError:  # taken
                continue
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; elsewhere its default, 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp ...); None where unreadable (gone
    since, or no /proc: not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _ended(pid: int | str, fields: list[str]) -> bool:
    """Whether the process of these stat ``fields`` has ended though still listed: a zombie nobody has reaped yet (a
    container's init may never) all of whose threads have ended (a main thread that exits leaves its process a zombie
    while the others run on, holding what they hold)."""
    if fields[0] != "Z":
        return False
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:  # reaped since
        return True


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or ended and not yet reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    fields = _stat(pid)
    return fields is not None and _ended(pid, fields)  # unreadable: the next look tells


def group_left(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that have not ended (ended but not reaped counts as ended: its memory and
    its GPU's are free, whether or not anyone reaps it)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:  # a member of another user's: /proc names it
        pass
    if not os.path.isdir("/proc"):  # not Linux: a group that answers a signal is taken as not ended
        return [pgid]
    left = []
    for entry in os.scandir("/proc"):
        if (
            entry.name.isdigit()
            and (fields := _stat(entry.name)) is not None
            and int(fields[2]) == pgid
            and not _ended(entry.name, fields)
        ):
            left.append(int(entry.name))
    return left


def skip_the_last_collection() -> None:
    """Have this process leave out the garbage collection the interpreter makes as it exits: with torch (and
    megatron-core, transformers) loaded it walks millions of objects for a second or more, which whatever waits for
    the process to end (a job's teardown for its engines and rollout manager, torchrun for its ranks) waits through.
    Done at exit (atexit), once the process's own cleanup is over: its atexit handlers and finalizers run as before,
    memory goes back with the process, and what is freed by reference counting still is (files flushed, sockets
    closed)."""
    import atexit
    import gc

    atexit.register(gc.freeze)  # the objects alive then are left out of every later collection


def exit_with(pid: int, every_s: float = 1.0) -> None:
    """Initializer of helper processes that nothing ends with ``pid`` (a forkserver's children, a multiprocessing
    Manager's server): end this process once ``pid`` is gone, polled from a daemon thread, so a killed owner leaves no
    helper behind."""
    import threading
    import time

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if ended(pid):
                os._exit(0)

    threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True).start()


def exit_with_importing(pid: int, modules: tuple[str, ...]) -> None:
    """:func:`exit_with` ``pid``, importing ``modules`` meanwhile from a daemon thread: a Manager's server whose first
    request unpickles their types has them by then, instead of importing them (seconds, for torch's) while its client
    waits. Its start does not wait for them, nor its owner's exit for the last collection of what they hold
    (:func:`skip_the_last_collection`)."""
    import threading

    exit_with(pid)
    skip_the_last_collection()

    threading.Thread(target=import_all, args=(modules,), name="import-ahead", daemon=True).start()


def import_all(modules: tuple[str, ...]) -> None:
    """Import ``modules``, beside a thread that may import some of them at once: where Python finds the two waiting on
    each other's module locks it raises in one of them, and that one here leaves the module to the other."""
    import importlib
    from importlib._bootstrap import _DeadlockError  # type: ignore[attr-defined]

    for name in modules:
        try:
            importlib.import_module(name)
        except _DeadlockError:
            continue


def end_with_launcher(grace_s: float = 60.0, every_s: float = 1.0) -> None:
    """Of a trainer rank: once the launcher that started it is gone, SIGTERM this process (the job's teardown runs:
    engines and rollout manager stopped, accounting written), and end it outright ``grace_s`` later should that not
    (a teardown held up, or a rank blocked in a collective its peers left, which handles no signal). torchrun starts
    its ranks in sessions of their own, where no signal that ends torchrun reaches: a SIGKILLed torchrun (OOM killer, a
    scheduler's hard kill, a timeout's --kill-after) left every rank running, holding its GPU and loading its weights
    into the engines that the next job was given. Polled from a daemon thread: the parent changes once the launcher is
    gone. Call it first thing, before slow imports: a launcher gone before the call is not seen."""
    import threading
    import time

    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGTERM)
        try:  # after the signal: with the launcher, whatever read this rank's output may be gone too
            print(f"moerl: the launcher of this rank (pid {launcher}) is gone; stopping", file=sys.stderr, flush=True)
        except OSError:
            pass
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name=f"end-with-launcher-{launcher}", daemon=True).start()
