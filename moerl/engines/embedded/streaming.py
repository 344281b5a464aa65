"""The answers of /generate: a call's completions streamed as server-sent events as they decode, or answered whole
once all have finished, large finished ones waiting on disk for the rest of their ``n`` and for their client to read
them."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from typing import Any, Generic

import orjson
from aiohttp import web

from moerl.engines import protocol
from moerl.engines.embedded.engine import EmbeddedEngine
from moerl.engines.embedded.scheduler import Request, RequestT

DISCONNECT_POLL_S = 1.0  # how often a waiting /generate checks that its client is still there (SGLang: 4 s)
# A finished completion larger than this waits in an unnamed temporary file, not in memory, for the rest of its n and
# for its client to read it: at true routing size each is tens of MB (a simulated 32K-token Qwen3-30B-A3B response:
# over 50 MB), and the simulated engines of a 96-GPU pool hold thousands of them on one machine, hundreds finishing at
# once where chunked requests are cut. Disk pages the kernel may write back and drop.
SPILL_BYTES = 4 << 20
# A spilled completion goes to the socket this much at a time, each once the socket has taken the last: what an answer
# its client is not reading yet holds in memory.
SEND_CHUNK_BYTES = 1 << 20
# SGLang's (utils/json_response.py): orjson takes a seventh of the standard library's time on a long answer's lists, and
# writes a NaN as null, which moerl's client refuses by name.
JSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def to_json(value: Any) -> bytes:
    return orjson.dumps(value, option=JSON_OPTIONS)


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=to_json(value), status=status, content_type="application/json")


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _Spilled:
    """A finished completion's serialized answer held in an unnamed temporary file (gone with the process) until its
    request's other completions finish and its client has read it."""

    def __init__(self, data: bytes):
        self.size = len(data)
        self.file = tempfile.TemporaryFile()
        self.file.write(data)

    def __len__(self) -> int:
        return self.size

    def chunks(self):
        """Its bytes, SEND_CHUNK_BYTES at a time; the file is closed after the last."""
        try:
            self.file.seek(0)
            while chunk := self.file.read(SEND_CHUNK_BYTES):
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        self.file.close()


class Generation(Generic[RequestT]):
    """One /generate call: its completions' requests on the scheduler, the queue their updates come back through, and
    the answer made of them: streamed as they decode, or whole once all have finished."""

    def __init__(self, engine: EmbeddedEngine[RequestT], request: web.Request, req: protocol.GenerateReqInput):
        self.engine, self.sched, self.request, self.req = engine, engine.scheduler, request, req
        self.loop = asyncio.get_running_loop()
        self.updates: asyncio.Queue = asyncio.Queue()  # (rid, finished, payload), put from the scheduler's thread
        self.unread = threading.Event()  # the requests were aborted for good: what they decoded is made for nobody
        self.requests = self.engine.make_requests(req, self.on_update)
        # As SGLang does, chunks of an n > 1 stream say which completion they belong to.
        self.index_of = {r.rid: i for i, r in enumerate(self.requests)} if len(self.requests) > 1 else {}

    def submit(self) -> None:
        for r in self.requests:
            self.sched.submit(r)

    def on_update(self, r: Request, finished: bool) -> None:
        """On the scheduler's thread: ``r`` has a new token, or has finished."""
        if self.unread.is_set():
            return
        if self.req.stream:
            update = (r.rid, finished, self.engine.response(r, self.req))
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        elif finished:
            # Serialized here, as it finishes: a long answer's lists take several times its JSON, and answers waiting
            # as objects for the event loop held a simulated engine's process at twice its memory. Spilled here too:
            # spilled by the handler, each answer's bytes also stayed in its frame until the next completion came (at
            # 32 trainer + 96 engine GPUs, 0.5 GB in each process of four simulated replicas).
            self.loop.call_soon_threadsafe(self.updates.put_nowait, (r.rid, finished, self._answer(r)))

    def _answer(self, r: Request) -> bytes | _Spilled:
        """``r``'s answer as JSON, on disk past SPILL_BYTES (the last to finish too: its client may not read it yet)."""
        answer = to_json(self.engine.response(r, self.req))
        return _Spilled(answer) if len(answer) > SPILL_BYTES else answer

    async def abandon(self, message: str) -> None:
        """Abort the requests, and make nothing more of what they decoded."""
        self.unread.set()
        await asyncio.wrap_future(self.sched.call(lambda: self.sched.abort_these(self.requests, message)))

    async def next_update(self) -> tuple | None:
        """The next update, or None once the client has gone away (its requests are then aborted)."""
        while True:
            try:
                return await asyncio.wait_for(self.updates.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if _gone(self.request):
                    await self.abandon("client disconnected")
                    return None

    async def stream(self) -> web.StreamResponse:
        """Each completion's answer so far, as server-sent events, until all have finished."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(self.request)
        remaining = len(self.requests)
        try:
            while remaining:
                update = await self.next_update()
                if update is None:
                    return resp
                rid, finished, payload = update
                remaining -= finished
                if self.index_of:
                    payload["index"] = self.index_of[rid]
                await resp.write(b"data: " + to_json(payload) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:  # the client left mid-stream: stop generating what nobody reads
            await self.abandon("client disconnected")
        return resp

    async def whole(self) -> web.StreamResponse:
        """Every completion's answer once all have finished: one JSON answer, a list of them when n > 1; 499 for a
        client gone before."""
        # Finished completions wait for the other n - 1, past SPILL_BYTES on disk (spilled by on_update).
        results: dict[str, bytes | _Spilled] = {}
        pieces: list[bytes | _Spilled] = []
        try:
            if not await self._collect(results):
                return web.Response(status=499, text="client disconnected")
            pieces = _json_list([results.pop(r.rid) for r in self.requests])
            return await self._send(pieces)
        finally:  # a client gone, or a failure: no file left open (one still on its way to the queue, put before
            # abandon stopped them, closes with its last reference)
            queued = [self.updates.get_nowait()[2] for _ in range(self.updates.qsize())]
            for held in [*results.values(), *pieces, *queued]:
                if isinstance(held, _Spilled):
                    held.close()

    async def _collect(self, results: dict[str, bytes | _Spilled]) -> bool:
        """Every completion's answer into ``results`` by rid; False if the client went away first."""
        while len(results) < len(self.requests):
            update = await self.next_update()
            if update is None:
                return False
            rid, _, answer = update
            results[rid] = answer
        return True

    async def _send(self, pieces: list[bytes | _Spilled]) -> web.StreamResponse:
        """One JSON body of ``pieces``, taken from the list as they are sent."""
        resp = web.StreamResponse()
        resp.content_type, resp.content_length = "application/json", sum(map(len, pieces))
        try:
            await resp.prepare(self.request)
            while pieces:
                piece = pieces.pop(0)  # each one freed once the socket has taken it
                for chunk in piece.chunks() if isinstance(piece, _Spilled) else (piece,):
                    await resp.write(chunk)
            await resp.write_eof()
        except ConnectionError:  # the client left while its answer was sent: nothing is running for it any more
            pass
        return resp


def _json_list(answers: list[bytes | _Spilled]) -> list[bytes | _Spilled]:
    """Several answers as the pieces of one JSON list, written piece by piece: never joined into a second copy of the
    whole answer. One answer stays itself."""
    if len(answers) <= 1:
        return answers
    separated = [x for answer in answers for x in (b", ", answer)]
    return [b"[", *separated[1:], b"]"]
