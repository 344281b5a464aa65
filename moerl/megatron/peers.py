"""Whether the other trainer ranks are still there: a heartbeat over the launcher's rendezvous store.

A collective waits for a rank that is gone until its timeout, and the trainer's must be hours (a sync step waits in one
while the engines generate). A rank whose process died closes its connections, and gloo or NCCL fail at once; a node
whose network went away closes nothing, and torchrun's agents do not end the workers of the nodes left. So every rank
beats on the rendezvous store (torchrun's, at ``MASTER_ADDR:MASTER_PORT``) from a thread of its own, and watches the
others' beats: counts, not clock times (the nodes' clocks differ). A rank not heard from for ``silence_s`` while the
store answered, or the store not answering this rank for as long, stops this process with one line saying which and
why; the launcher then ends the rest.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger("moerl.train")


class PeerWatch:
    """The heartbeat of this rank among ``world`` ranks (see the module's docstring); :meth:`stop` ends it. One thread
    talks to the store (a call to it can block for good once the network is gone); another judges what it last heard."""

    def __init__(self, rank: int, world: int, silence_s: float = 60.0, interval_s: float = 2.0):
        self.rank, self.world, self.silence_s, self.interval_s = rank, world, silence_s, interval_s
        now = time.monotonic()
        self._heard_at = [now] * world  # when each rank's beat last moved, as this rank saw it
        self._answered_at = now  # when the store last answered this rank
        self._done: set[int] = set()  # ranks that ended on their own
        self._last_error = ""
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, name="moerl-peer-beat", daemon=True),
            threading.Thread(target=self._judge, name="moerl-peer-watch", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _store(self, timeout_s: float) -> dist.Store:
        """A connection to the store, each call bounded by ``timeout_s`` (its connection too: tried until then)."""
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return dist.PrefixStore("moerl-peer-watch", store)

    def _beat(self) -> None:
        heard = [0] * self.world
        store: dist.Store | None = None
        while not self._stopped.wait(self.interval_s):
            try:
                if store is None:
                    store = self._store(self.interval_s * 5)
                store.add(f"beat/{self.rank}", 1)
                beats = [int(store.add(f"beat/{r}", 0)) for r in range(self.world)]
                silent = [r for r, beat in enumerate(beats) if beat == heard[r] and r != self.rank]
                done = {r for r in silent if store.check([f"done/{r}"])}
            except (RuntimeError, OSError) as e:  # the store did not answer: this node may be the one cut off
                store, self._last_error = None, str(e)
                continue
            now = time.monotonic()
            self._done |= done
            for r, beat in enumerate(beats):
                if beat != heard[r]:
                    heard[r], self._heard_at[r] = beat, now
            self._answered_at = now  # last: the judge never sees an answer without the beats it brought

    def _judge(self) -> None:
        while not self._stopped.wait(self.interval_s):
            now = time.monotonic()
            if now - self._answered_at > self.silence_s:
                where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                launcher = _torchrun_agent()
                self._stop(
                    f"the launcher's rendezvous store ({where}) has not answered rank {self.rank} for "
                    f"{now - self._answered_at:.0f} s{f' ({self._last_error})' if self._last_error else ''}: this "
                    "node lost the others (its network, or the first node, is gone)"
                    + (
                        "; torchrun on this node is stopped too: it would wait for its rendezvous for good"
                        if launcher
                        else ""
                    ),
                    launcher,
                )
            # Silence counts only while the store answers: a node cut off hears no rank, and must say so above.
            for r, at in enumerate(self._heard_at):
                if r != self.rank and r not in self._done and self._answered_at - at > self.silence_s:
                    self._stop(
                        f"rank {r} has not been heard from for {now - at:.0f} s: its node's network or its process is "
                        "gone"
                    )

    def _stop(self, why: str, launcher: int | None = None) -> None:
        """End this process now (its main thread may wait in a collective that never returns), and ``launcher``, the
        torchrun agent that started it, where that can no longer reach its rendezvous (it would wait on a connection
        nothing closes: torch's elastic agent does not bound those reads)."""
        print(f"error: {why}; the job stops (run.resume=true continues from the last checkpoint)", file=sys.stderr)
        sys.stderr.flush()
        if launcher is not None:
            os.kill(launcher, signal.SIGKILL)
        os._exit(1)

    def stop(self) -> None:
        """This rank is done (the job ended, or stops with its own error): the others stop watching it."""
        self._stopped.set()
        self._threads[1].join()
        try:  # a courtesy, not waited for: a rank whose launcher is gone finds no store, and its teardown goes on
            self._store(self.interval_s).set(f"done/{self.rank}", "1")
        except (RuntimeError, OSError):  # nobody left to tell
            pass


def _torchrun_agent() -> int | None:
    """The pid of the torchrun agent that started this process (torchrun's command, or ``moerl train --launch``), None
    if it was started otherwise."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent = os.getppid()
    try:
        command = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    torchrun = any(part.endswith((b"torchrun", b"torch.distributed.run")) for part in command)
    return parent if torchrun or b"--launch" in command else None  # moerl train --launch: torchrun in its process
