"""What ends a process of the job and what it waits for: a rank whose launcher is gone, a process group that has
ended, a teardown that a second signal must not cut short. Real processes, a second or less each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from moerl.env import ended
from tests import REPO

HEADER = f"import ctypes, os, signal, subprocess, sys, threading, time; sys.path.insert(0, {str(REPO)!r})\n"


def run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", HEADER + code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.e2e
def test_a_process_group_has_ended_once_each_member_has_reaped_or_not():
    """Judged by every member: the server alone having exited is not enough; a member ended but never reaped (a zombie:
    its memory is free) is; a zombie leader whose other thread still runs is not. A subreaper that never reaps keeps the
    zombies; run apart, so that pytest never becomes one."""
    seen = run("""
from moerl.env import group_left
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the orphans become this process's, unreaped
def state(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
# The server exits and leaves two members: a worker, and one whose main thread has exited while another runs on
# (listed as a zombie, yet holding what it holds).
threads = ("import ctypes, threading, time; threading.Thread(target=time.sleep, args=(300,)).start(); "
           "ctypes.CDLL(None).pthread_exit(None)")
server = subprocess.Popen(["sh", "-c", f"sleep 300 & echo $!; {sys.executable} -c '{threads}' & echo $!"],
                          stdout=subprocess.PIPE, text=True, start_new_session=True)
worker, leader = int(server.stdout.readline()), int(server.stdout.readline())
server.wait()
while state(leader) != "Z":
    time.sleep(0.05)
seen = [sorted(group_left(server.pid)) == sorted([worker, leader])]
os.kill(worker, signal.SIGKILL)
while state(worker) != "Z":  # a SIGKILL takes effect when the kernel next runs it
    time.sleep(0.05)
seen.append(group_left(server.pid) == [leader])
os.kill(leader, signal.SIGKILL)
while state(worker) != "Z" or len(os.listdir(f"/proc/{leader}/task")) > 1:
    time.sleep(0.05)
seen.append(group_left(server.pid) == [])  # both zombies now, neither reaped
os.waitpid(worker, 0)
os.waitpid(leader, 0)
seen.append(group_left(server.pid) == [])
print(*seen)
""")
    assert seen == ["True"] * 4


RANK = """
from moerl.env import end_with_launcher
mark, ignore = sys.argv[1], sys.argv[2] == "ignore"
def on_term(signum, frame):
    open(mark, "w").write("SIGTERM")
    if not ignore:
        sys.exit(0)  # a teardown that ends the rank
signal.signal(signal.SIGTERM, on_term)
end_with_launcher(grace_s=0.5, every_s=0.05)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""

LAUNCHER = """
# Like torchrun: the rank in a session of its own, its output read through pipes that end with this process.
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, start_new_session=True)
rank.stdout.readline()
print(rank.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("teardown", ["ends it", "ignore"])
def test_a_rank_whose_launcher_is_killed_is_signalled_then_ended(tmp_path, teardown):
    """SIGKILL of the launcher alone: its rank gets SIGTERM (its teardown runs) and, should that not end it, is ended
    ``grace_s`` later. Whatever read its stderr went with the launcher, so saying why fails; the signal comes first."""
    mark = tmp_path / "mark"
    launcher = subprocess.Popen(
        [sys.executable, "-c", HEADER + LAUNCHER, HEADER + RANK, str(mark), teardown], stdout=subprocess.PIPE, text=True
    )
    rank = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    try:
        while not ended(rank):
            assert time.monotonic() < deadline, "the rank outlived its launcher"
            time.sleep(0.05)
    finally:
        if not ended(rank):
            os.kill(rank, signal.SIGKILL)
    assert mark.read_text() == "SIGTERM"


@pytest.mark.e2e
def test_the_rank_watches_its_launcher_from_before_torch_is_imported(monkeypatch):
    """A launcher gone before the watch starts is never seen: the rank's command starts it before the slow imports."""
    seen = run("""
import moerl.env
moerl.env.end_with_launcher = lambda: print("torch" in sys.modules) or sys.exit(0)
os.environ["LOCAL_RANK"] = "0"
from moerl import cli
cli.main(["train"])
""")
    assert seen == ["False"]


def test_a_second_sigterm_leaves_the_teardown_running():
    """torchrun's SIGTERM, then the rank's own once torchrun is gone: the first starts the teardown, the second must
    not cut it short."""
    from moerl.cli.train import _exit_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with pytest.raises(SystemExit) as stop:
            signal.raise_signal(signal.SIGTERM)
        assert stop.value.code == 128 + signal.SIGTERM
        signal.raise_signal(signal.SIGTERM)  # ignored: no exception
    finally:
        signal.signal(signal.SIGTERM, before)


def test_importing_ahead_leaves_a_module_to_the_thread_python_found_it_deadlocked_with(monkeypatch):
    """The checkpoint writers' server imports torch's checkpointing ahead while a request may import it: where Python
    raises its deadlock error in the thread importing ahead, that thread goes on to the next module (no traceback), and
    any other error is raised."""
    import importlib
    from importlib._bootstrap import _DeadlockError  # type: ignore[attr-defined]

    from moerl.env import import_all

    asked = []

    def import_module(name):
        asked.append(name)
        if name == "first":
            raise _DeadlockError("deadlock detected by _ModuleLock('first')")
        if name == "broken":
            raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", import_module)
    import_all(("first", "second"))
    assert asked == ["first", "second"]
    with pytest.raises(ImportError):
        import_all(("broken",))
