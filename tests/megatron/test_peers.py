"""PeerWatch's verdicts, with a rank of its own in a subprocess, a TCPStore in another (stopped with SIGSTOP to stand
for a network cut: nothing answers, nothing closes), and this test beating as the other rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.e2e
SILENCE_S, INTERVAL_S = 3.0, 0.5
STORE = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""
RANK = f"""
import time
from moerl.megatron.peers import PeerWatch
PeerWatch(1, 2, silence_s={SILENCE_S}, interval_s={INTERVAL_S})
time.sleep(3600)
"""


@pytest.fixture
def store():
    proc = subprocess.Popen([sys.executable, "-c", STORE], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield proc, port
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def watched(port: int, beats_s: float, then=None) -> str:
    """Rank 1 watching, this test beating as rank 0 for ``beats_s``, then calling ``then``; rank 1's stderr once it
    stopped itself."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_RUN_ID", None)
    rank = subprocess.Popen([sys.executable, "-c", RANK], env=env, stderr=subprocess.PIPE, text=True)
    beats = dist.PrefixStore("moerl-peer-watch", dist.TCPStore("127.0.0.1", port, is_master=False))
    until = time.monotonic() + beats_s
    while time.monotonic() < until:
        beats.add("beat/0", 1)
        time.sleep(INTERVAL_S / 2)
    if then is not None:
        then()
    _, stderr = rank.communicate(timeout=60)
    assert rank.returncode == 1, stderr
    return stderr


def test_a_rank_silent_while_the_store_answers_is_named(store):
    _, port = store
    stderr = watched(port, beats_s=3.0)
    assert "error: rank 0 has not been heard from for" in stderr, stderr


def test_a_node_cut_off_from_the_store_says_so_not_that_the_others_went_quiet(store):
    """The others' beats stop reaching this rank before the store's answers do (the last poll that saw them move lags
    the last one answered): only the store's silence may be reported, or the node cut off blames the one left, and
    does not stop its launcher."""
    proc, port = store
    stderr = watched(port, beats_s=3.0, then=lambda: (time.sleep(SILENCE_S / 3), os.kill(proc.pid, signal.SIGSTOP)))
    assert "has not answered rank 1 for" in stderr, stderr
    assert "rank 0 has not been heard from" not in stderr, stderr
