"""The embedded engine's HTTP server: SGLang's RL routes over :class:`~.engine.EmbeddedEngine` (``moerl serve``).

Every body is parsed with the route's type from :mod:`moerl.engines.protocol` before anything happens, so a bad request
is a JSON 400 naming the field and never reaches the model. :class:`EngineServer` gives each route a method over the
engine; /generate's answers are :mod:`.streaming`'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar, Unpack

import torch
from aiohttp import web

from moerl.engines import protocol
from moerl.engines.delta import LOAD_FORMAT, decode
from moerl.engines.embedded.engine import EmbeddedEngine, refused_path, server_info
from moerl.engines.embedded.scheduler import RequestT
from moerl.engines.embedded.streaming import Generation, json_response
from moerl.engines.protocol import ProtocolError
from moerl.engines.tensor_ipc import load_payload
from moerl.engines.weight_group import bucket_layout, in_daemon_thread
from moerl.errors import MoerlError

log = logging.getLogger("moerl.serve")
MAX_JOINING = 16  # weight-group joins waiting for their peers at once
T = TypeVar("T")
WireModelT = TypeVar("WireModelT", bound=protocol.WireModel)


def _error(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message, "code": status}}, status=status)


def build_app(engine: EmbeddedEngine[RequestT]) -> web.Application:
    """``engine`` served over HTTP: SGLang's routes; its scheduler runs while the app does."""
    return EngineServer(engine).app()


class EngineServer(Generic[RequestT]):
    """The routes over one engine: each a method named after its route (the route table is :meth:`app`'s)."""

    def __init__(self, engine: EmbeddedEngine[RequestT]):
        self.engine = engine
        self.sched = engine.scheduler

    def app(self) -> web.Application:
        P = protocol
        app = web.Application(middlewares=[_errors], client_max_size=1 << 30)
        app.add_routes(
            [
                web.post(P.GENERATE.path, self.generate),
                web.get(P.HEALTH.path, self.health),
                web.get("/health_generate", self.health),
                web.get(P.SERVER_INFO.path, self.server_info),
                web.get(P.MODEL_INFO.path, self.model_info),
                web.get("/get_model_info", self.model_info),
                web.post(P.PAUSE.path, self.pause_generation),
                web.post(P.CONTINUE.path, self.continue_generation),
                web.post(P.ABORT.path, self.abort_request),
                web.get(P.FLUSH_CACHE.path, self.flush_cache),
                web.post(P.FLUSH_CACHE.path, self.flush_cache),
                web.post(P.GET_WEIGHTS.path, self.get_weights_by_name),
                web.post(P.WEIGHTS_CHECKER.path, self.weights_checker),
                web.post(P.UPDATE_WEIGHT_VERSION.path, self.update_weight_version),
                web.post(P.RELEASE_MEMORY.path, self.release_memory_occupation),
                web.post(P.RESUME_MEMORY.path, self.resume_memory_occupation),
                web.post(P.UPDATE_FROM_DISK.path, self.update_weights_from_disk),
                web.post(P.INIT_GROUP.path, self.init_weights_update_group),
                web.post(P.BEGIN_UPDATE.path, self.begin_weight_update),
                web.post(P.END_UPDATE.path, self.end_weight_update),
                web.post(P.UPDATE_FROM_DISTRIBUTED.path, self.update_weights_from_distributed),
                web.post(P.UPDATE_FROM_TENSOR.path, self.update_weights_from_tensor),
                web.post(P.LOAD_LORA.path, self.load_lora_adapter),
                web.post(P.LOAD_LORA_TENSORS.path, self.load_lora_adapter_from_tensors),
                web.post(P.UNLOAD_LORA.path, self.unload_lora_adapter),
            ]
        )
        app.on_startup.append(self.start_engine)
        app.on_cleanup.append(self.stop_engine)
        return app

    async def start_engine(self, app: web.Application) -> None:
        self.sched.start()

    async def stop_engine(self, app: web.Application) -> None:
        await asyncio.to_thread(self.sched.stop)
        for pool in self.engine.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    async def on_engine(self, fn: Callable[[], T]) -> T:
        """What ``fn()`` returns, run on the engine thread between steps."""
        return await asyncio.wrap_future(self.sched.call(fn))

    async def in_pool(self, kind: str, fn: Callable[..., T], *args: Any) -> T:
        """What ``fn(*args)`` returns, run in the engine's pool for ``kind`` of slow load."""
        return await asyncio.get_running_loop().run_in_executor(self.engine.pools[kind], functools.partial(fn, *args))

    # ---- generation ---------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``n`` completions of one prompt: streamed as they decode, or answered whole once all have finished."""
        generation = Generation(self.engine, request, await _parse(request, protocol.GenerateReqInput))
        generation.submit()
        return await (generation.stream() if generation.req.stream else generation.whole())

    async def health(self, request: web.Request) -> web.Response:
        # As SGLang's: a one-token generation must come back, so a paused engine is not healthy (SGLang's waits for
        # the pause and answers 503 after 20 s; this answers at once).
        why = "engine thread stopped" if not self.sched.alive else "generation is paused" if self.sched.paused else ""
        return web.Response(text=why, status=503 if why else 200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.PauseGenerationReqInput)
        await self.on_engine(lambda: self.sched.pause(req.mode))
        return _ok(f"paused ({req.mode})")

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _parse(request, protocol.ContinueGenerationReqInput)

        def resume() -> None:
            if self.engine.released:
                raise ProtocolError(
                    f"memory is released ({', '.join(sorted(self.engine.released))}): resume it "
                    "(/resume_memory_occupation) before generation continues"
                )
            self.sched.resume()

        await self.on_engine(resume)
        return _ok("continued")

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.ReleaseMemoryOccupationReqInput)
        released = await self.on_engine(lambda: self.engine.release_memory(req.regions()))
        return _ok(f"released {', '.join(sorted(released)) or 'nothing more'}")

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.ResumeMemoryOccupationReqInput)
        resumed = await self.on_engine(lambda: self.engine.resume_memory(req.regions()))
        return _ok(f"resumed {', '.join(sorted(resumed)) or 'nothing released'}")

    async def abort_request(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.AbortReq)
        count = await self.on_engine(lambda: self.sched.abort(None if req.abort_all else req.rid))
        return _ok(f"aborted {count}", aborted=count)

    async def flush_cache(self, request: web.Request) -> web.Response:
        flushed = await self.on_engine(self.sched.flush_cache)
        text = "Cache flushed." if flushed else "Cache not flushed: requests are running."
        return web.Response(text=text, status=200 if flushed else 400)

    # ---- info ---------------------------------------------------------------------------------
    async def server_info(self, request: web.Request) -> web.Response:
        return json_response(server_info(self.engine.engine_name, self.engine.model))

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(self.engine.model_info())

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.GetWeightsByNameReqInput)
        values = await self.on_engine(lambda: self.engine.weight_values(req.name, req.truncate_size))
        if values is None:
            raise ProtocolError(f"{req.name!r} is not a weight of the served model (give a Hub tensor name)")
        return json_response(values)

    async def weights_checker(self, request: web.Request) -> web.Response:
        await _parse(request, protocol.CheckWeightsReqInput)
        return _ok("checksums computed", per_engine_checksum=await self.on_engine(self.engine.checksum))

    # ---- weights ------------------------------------------------------------------------------
    async def update_weight_version(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UpdateWeightVersionReqInput)

        def apply():
            if req.abort_all_requests:
                self.sched.abort(message="weight version changed")
            self.sched.weight_version = req.new_version

        await self.on_engine(apply)
        return _ok(f"weight version {req.new_version}")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UpdateWeightFromDiskReqInput)
        engine = self.engine
        engine.check_weights_held("weights not loaded")  # before reading the directory
        with refused_path("model_path", req.model_path):
            named = await self.in_pool("disk", engine.read_model_dir, req.model_path)
        await self.on_engine(
            lambda: engine.apply_weights(named, req.weight_version, req.abort_all_requests, req.flush_cache)
        )
        return _ok(f"loaded {req.model_path}", num_paused_requests=0)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.InitWeightsUpdateGroupReqInput)
        engine, name = self.engine, req.group_name
        if name in engine.weight_groups or name in engine.joining:
            raise ProtocolError(f"weight group {name!r} is already initialised (or being joined)")
        if len(engine.joining) >= MAX_JOINING:
            raise ProtocolError(f"{MAX_JOINING} weight-group joins are already waiting for their peers; retry later")
        if req.backend == "nccl" and engine.device.type != "cuda":
            raise ProtocolError("backend nccl needs a CUDA engine; this one runs on the CPU (use gloo)")
        engine.joining.add(name)
        try:
            engine.weight_groups[name] = await in_daemon_thread(engine.join_group, req)
        finally:
            engine.joining.discard(name)
        return _ok(f"joined {name} as rank {req.rank_offset}")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await _parse(request, protocol.BeginWeightUpdateReqInput)
        if self.engine.update_session:
            raise ProtocolError("a weight-update session is already open; call /end_weight_update first")
        self.engine.update_session = True
        return _ok("weight-update session open")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await _parse(request, protocol.EndWeightUpdateReqInput)
        if not self.engine.update_session:
            raise ProtocolError("no weight-update session is open; call /begin_weight_update first")
        self.engine.update_session = False
        return _ok("weight-update session closed")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UpdateWeightsFromDistributedReqInput)
        engine = self.engine
        engine.check_weights_held("weights not received")  # before a byte comes
        # Names, shapes and layout are checked before a byte is received: never allocate what a request claims.
        shapes = [
            (n, torch.empty(s, dtype=getattr(torch, d), device="meta"))
            for n, d, s in zip(req.names, req.dtypes, req.shapes, strict=True)
        ]
        engine.weight_targets(shapes)
        if req.load_format == "flattened_bucket":
            bucket_layout(req.dtypes, req.shapes)
        group = engine.weight_groups.get(req.group_name)
        if group is None:
            raise ProtocolError(f"group {req.group_name!r} is not initialised: call /init_weights_update_group first")
        if not engine.update_session:
            raise ProtocolError(
                "update_weights_from_distributed must run between /begin_weight_update and /end_weight_update"
            )
        engine.check_flush(req.flush_cache, req.abort_all_requests, "weights not received")  # before a byte comes
        # Logged: the order updates came in.
        log.info("receiving %d tensors from weight group %s", len(req.names), req.group_name)
        named = await in_daemon_thread(engine.receive, req, group)
        await self.on_engine(
            lambda: engine.apply_weights(named, req.weight_version, req.abort_all_requests, req.flush_cache)
        )
        return _ok(f"updated {len(named)} tensors")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UpdateWeightsFromTensorReqInput)
        engine = self.engine
        if not engine.update_session:
            raise ProtocolError(
                "update_weights_from_tensor must run between /begin_weight_update and /end_weight_update"
            )
        engine.check_weights_held("weights not updated")
        if len(req.serialized_named_tensors) != 1:
            raise ProtocolError(
                "serialized_named_tensors must hold one entry: the embedded engine is one rank "
                "(SGLang: one per TP rank)"
            )
        named = await self.in_pool("tensor", load_payload, req.serialized_named_tensors[0], req.load_format)
        if req.load_format == LOAD_FORMAT:  # moerl's delta pushes: tensors whole or their changed elements
            try:
                named = decode(named)
            except ValueError as e:
                raise ProtocolError(f"serialized_named_tensors[0]: {e}") from None
        await self.on_engine(
            lambda: engine.apply_weights(named, req.weight_version, req.abort_all_requests, req.flush_cache)
        )
        return _ok(f"updated {len(named)} tensors")

    # ---- LoRA adapters ------------------------------------------------------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.LoadLoRAAdapterReqInput)
        adapters = self.engine.adapters
        with refused_path("lora_path", req.lora_path):
            adapter = await self.in_pool("lora", adapters.from_dir, req.lora_name, req.lora_path)
        await self.on_engine(lambda: adapters.add(adapter))
        return _ok(f"loaded {req.lora_name}", loaded_adapters=sorted(adapters.adapters))

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.LoadLoRAAdapterFromTensorsReqInput)
        adapters = self.engine.adapters
        if req.load_format != "safetensors":
            raise ProtocolError(
                "the embedded engine takes serialized_named_tensors with load_format='safetensors' "
                "(base64 safetensors bytes; SGLang's default is a CUDA-IPC pickle that cannot cross "
                "machines)"
            )
        if len(req.serialized_named_tensors) != 1:
            raise ProtocolError("serialized_named_tensors must hold one entry (the embedded engine has one rank)")
        adapter = await self.in_pool(
            "lora", adapters.from_base64, req.lora_name, req.config_dict, req.serialized_named_tensors[0]
        )
        await self.on_engine(lambda: adapters.add(adapter))
        return _ok(f"loaded {req.lora_name}", loaded_adapters=sorted(adapters.adapters))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UnloadLoRAAdapterReqInput)
        await self.on_engine(lambda: self.sched.unload_adapter(req.lora_name))
        return _ok(f"unloaded {req.lora_name}", loaded_adapters=sorted(self.engine.adapters.adapters))


async def _parse(request: web.Request, kind: type[WireModelT]) -> WireModelT:
    charset = request.charset
    if charset is not None and charset.lower().replace("-", "").replace("_", "") != "utf8":
        raise ProtocolError(f"charset {charset!r}: JSON bodies are UTF-8")
    raw = await request.read()
    return kind.parse(raw if raw.strip() else b"{}")


def _ok(message: str, /, **extra: Unpack[protocol.ControlResponse]) -> web.Response:
    body: protocol.ControlResponse = {"success": True, "message": message, **extra}
    return json_response(body)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except MoerlError as e:
        return _error(400, str(e))
    except web.HTTPException as e:  # no such route, a wrong method, a body over the size limit
        if e.status < 400:
            raise
        return _error(e.status, f"{request.method} {request.path}: {e.reason}")
    except Exception as e:  # a bug: the server keeps serving and the caller learns what failed
        log.exception("request %s failed", request.path)
        return _error(500, f"{type(e).__name__}: {e}")
