"""Processes that carry /generate requests for an :class:`~moerl.engines.client.EngineClient`: each makes the HTTP
request itself, reads the answer and decodes it, and hands back only the decoded completions.

An answer's cost grows with its tokens: an 8K-token response of a 48-layer top-8 model is about 25 MB of JSON on the
wire, most of it routing in base64. Read and decoded in the caller (the rollout manager, one process for every
engine), that is 160 ms of its CPU; carried to a decode process as raw bytes it is still 34 ms (aiohttp assembling
the body, the copy into the pipe). Here the body never enters the caller: it gets the compact arrays (3 MB for that
response) through a pipe. Each worker runs its own event loop with many requests in flight, so a handful of
processes carry hundreds of long generations.

What the caller gets is what the worker's client's ``generate_on`` gave there: the same completions, or the same
exception (an engine's refusal with its status, a broken answer). A worker that dies loses the generations it
carried (their connections close, and the engines abort what nobody reads): each of those raises
:class:`WorkerLost`, and the next request starts a new worker in its place. Cancelling a generation cancels it in
the worker, which closes its connection. A worker that neither answers nor dies is killed once its client's own
deadline and a grace period have passed.

Messages (pickled, one per ``send_bytes``), caller to worker: ``("generate", job, url, request, routing_start)``,
``("cancel", job)``, ``("stop",)``. Worker to caller: ``(job, completions, None, None)`` or ``(job, None, exception,
its traceback as text)``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from moerl.engines import protocol as P
from moerl.env import exit_with

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """The worker process carrying a generation died (killed for memory, say): not the replica's fault; re-issue it."""


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: Any  # this side of its duplex pipe: read by its reader thread, written and closed by its writer thread
    jobs: dict[int, asyncio.Future] = field(default_factory=dict)  # in flight on it, by job number
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # messages for the writer thread; None ends it
    stopping: bool = False

    def send(self, *message) -> None:
        """Never blocks: a worker that stops reading fills its socket, and a write from the event loop would stop the
        loop (and every deadline with it)."""
        self.outbox.put(pickle.dumps(message))

    def fail_jobs(self, why: str) -> None:
        """Every generation still waiting on it raises :class:`WorkerLost` (event loop thread only)."""
        for future in list(self.jobs.values()):
            _settle(future, (None, WorkerLost(why)))


class GenerationWorkers:
    def __init__(self, count: int, make_client: Callable[[], Any], deadline_s: float):
        """``count`` processes, each with its own client from ``make_client`` (picklable; an async context manager with
        ``generate_on(url, request, routing_start)``); ``deadline_s``: that client's own deadline for a request."""
        if count < 1:
            raise ValueError(f"GenerationWorkers needs at least one process, got {count}")
        self.count, self.make_client = count, make_client
        self.deadline_s = deadline_s + DEADLINE_GRACE_S
        self.workers: list[_Worker | None] = [None] * count
        self._next_job = 0
        # forkserver: the caller runs threads (asyncio's, ZMQ's), which a forked child must not inherit.
        self._context = multiprocessing.get_context("forkserver")

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w is not None and w.process.pid is not None]

    async def generate(self, url: str, request: P.GenerateReqInput, routing_start: int) -> list[P.Completion]:
        worker = self._least_loaded()
        job, self._next_job = self._next_job, self._next_job + 1
        future = asyncio.get_running_loop().create_future()
        worker.jobs[job] = future
        try:
            worker.send("generate", job, url, request, routing_start)
            completions, error = await asyncio.wait_for(asyncio.shield(future), self.deadline_s)
        except asyncio.CancelledError:
            if not worker.stopping:
                worker.send("cancel", job)
            raise
        except TimeoutError:  # its client's own deadline passed long ago: the worker is stuck
            if not future.done():  # (the answer may have come in the deadline's own turn)
                self._lost(worker, f"no answer in {self.deadline_s:.0f} s; killed")
            completions, error = await future
        finally:
            worker.jobs.pop(job, None)
        if error is not None:
            raise error
        return completions

    def _least_loaded(self) -> _Worker:
        for i, w in enumerate(self.workers):
            if w is None:
                self.workers[i] = self._start()
        return min((w for w in self.workers if w is not None), key=lambda w: len(w.jobs))  # none is None now

    def _start(self) -> _Worker:
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_serve, args=(theirs, os.getpid(), self.make_client), daemon=True, name="moerl-generation-worker"
        )
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(worker, loop), daemon=True, name="moerl-generation-results").start()
        threading.Thread(target=_write, args=(worker,), daemon=True, name="moerl-generation-requests").start()
        return worker

    def _read(self, worker: _Worker, loop: asyncio.AbstractEventLoop) -> None:
        """This worker's answers, on a thread: the pipe is read (GIL released) and unpickled (a copy of arrays) off the
        event loop's turn. When it ends it ends the writer, which closes the connection: no thread closes it under
        another."""
        try:
            while True:
                try:
                    job, completions, error, trace = pickle.loads(worker.conn.recv_bytes())
                except (EOFError, OSError) as e:
                    why = "it exited" if isinstance(e, EOFError) else str(e)
                    break
                except BaseException as e:  # noqa: BLE001 - whatever unpickling raises
                    # An answer that does not unpickle: this worker cannot be trusted with more.
                    why = f"its answer did not unpickle: {type(e).__name__}: {e}"
                    worker.process.kill()
                    break
                if error is not None and trace:
                    error.add_note(f"in the generation worker:\n{trace}")
                outcome = (completions, error)
                if not _call_soon(loop, lambda job=job, outcome=outcome: _settle(worker.jobs.get(job), outcome)):
                    return
            if not worker.stopping:
                _call_soon(loop, self._lost, worker, why)
        finally:
            worker.outbox.put(None)

    def _lost(self, worker: _Worker, why: str) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=1.0)  # its exit code says why (-9: killed, for memory say)
        why = f"{why}, exit code {worker.process.exitcode}"
        if worker in self.workers:
            self.workers[self.workers.index(worker)] = None
            log.warning(
                "a generation worker died (%s): the %d generations it carried are lost and re-issued; a new "
                "one starts at the next request",
                why,
                len(worker.jobs),
            )
        worker.fail_jobs(f"the generation worker carrying it died ({why}); the engine aborts what nobody reads")

    def close(self) -> None:
        """Stop every worker; a generation still waiting on one raises :class:`WorkerLost`."""
        for worker in self.workers:
            if worker is not None:
                worker.stopping = True
                worker.send("stop")
        for worker in self.workers:
            if worker is not None:
                worker.process.join(timeout=5)
                if worker.process.is_alive():
                    worker.process.kill()
                worker.fail_jobs("the client closed while it was carried")
        self.workers = [None] * self.count


DEADLINE_GRACE_S = 60.0  # past its client's deadline, a generation's worker is taken for stuck


def _write(worker: _Worker) -> None:
    """Its requests, on a thread of their own; after the reader has ended, the connection is closed here."""
    broken = False
    while (message := worker.outbox.get()) is not None:
        if not broken:
            try:
                worker.conn.send_bytes(message)
            except OSError:  # it died: the reader sees it end, and settles what it carried
                broken = True
    worker.conn.close()


def _settle(future: asyncio.Future | None, outcome: tuple[list[P.Completion] | None, BaseException | None]) -> None:
    if future is not None and not future.done():
        future.set_result(outcome)


def _call_soon(loop: asyncio.AbstractEventLoop, *call) -> bool:
    """Whether ``call`` was handed to ``loop`` (not once it closed: nobody waits any more)."""
    try:
        loop.call_soon_threadsafe(*call)
        return True
    except RuntimeError:
        return False


# ---- the worker process ------------------------------------------------------------------------
def _serve(conn, owner_pid: int, make_client: Callable[[], Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the owner, which stops its workers
    exit_with(owner_pid)  # the forkserver outlives a killed owner, and would keep its workers
    asyncio.run(_serve_requests(conn, make_client))


async def _serve_requests(conn, make_client: Callable[[], Any]) -> None:
    messages: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_receive, args=(conn, asyncio.get_running_loop(), messages), daemon=True).start()
    async with make_client() as client:
        await _Carrier(conn, client).serve(messages)


def _receive(conn, loop: asyncio.AbstractEventLoop, messages: asyncio.Queue) -> None:
    """The owner's messages into ``messages``, on a thread, until a stop."""
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except BaseException:  # noqa: BLE001 - the owner closed its end, or sent what this cannot read: stop either way
            message = ("stop",)
        loop.call_soon_threadsafe(messages.put_nowait, message)
        if message[0] == "stop":
            return


class _Carrier:
    """The worker's generations: each carried by ``client`` in a task of its own and answered through ``conn``."""

    def __init__(self, conn: Connection, client: Any) -> None:
        self.conn, self.client = conn, client
        self.running: dict[int, asyncio.Task] = {}  # a job leaves it when it ends or when the owner gives up on it

    async def serve(self, messages: asyncio.Queue) -> None:
        """Do what the owner's messages say, until it says stop."""
        while True:
            message = await messages.get()
            if message[0] == "generate":
                _, job, url, request, routing_start = message
                self.running[job] = asyncio.create_task(self.carry(job, url, request, routing_start))
            elif message[0] == "cancel":
                task = self.running.pop(message[1], None)
                if task is not None:
                    task.cancel()
            else:
                await self.stop()
                return

    async def stop(self) -> None:
        """Cancel every generation still carried, and wait for them to end."""
        tasks = list(self.running.values())
        self.running.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def carry(self, job: int, url: str, request: P.GenerateReqInput, routing_start: int) -> None:
        """One generation, its outcome sent to the owner (none once the owner has given up on it)."""
        try:
            answer: tuple = (job, await self.client.generate_on(url, request, routing_start), None, None)
        except asyncio.CancelledError:
            if job not in self.running:
                return  # the owner gave up on it: nothing to answer
            answer = (job, None, WorkerLost("cancelled in the generation worker"), None)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the owner, which raises it there
            answer = (job, None, e, traceback.format_exc())
        self.running.pop(job, None)
        message = _pickled(answer)
        try:
            self.conn.send_bytes(message)
        except OSError:
            pass  # the owner is gone; so will this process be


def _pickled(answer: tuple) -> bytes:
    """``(job, completions, error, trace)`` as the owner can unpickle it."""
    job, _, error, trace = answer
    try:
        message = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        if error is not None:
            pickle.loads(message)  # an exception that pickles may still not unpickle (a constructor of other arguments)
    except Exception:  # noqa: BLE001 - whatever (un)pickling the error raises, its text still reaches the owner
        message = pickle.dumps(
            (job, None, RuntimeError(f"in a generation worker: {error!r}"), trace or traceback.format_exc())
        )
    return message
