"""The embedded engine's HTTP server: SGLang's RL routes over moerl's scheduler (``moerl serve``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import web

from moerl.engines import protocol
from moerl.engines.embedded import lora
from moerl.engines.embedded.runner import ModelRunner, hub_tensor_view
from moerl.engines.embedded.scheduler import Request, SamplingParams, Scheduler

log = logging.getLogger("moerl.serve")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class EmbeddedEngine:
    """Owns the model runner, the scheduler and the tokenizer; builds SGLang-shaped responses."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32, device: str | None = None,
                 max_running: int = 64, sampling_mask_max_tokens: int = protocol.DEFAULT_SAMPLING_MASK_MAX_TOKENS):
        self.model_dir = model_dir
        self.runner = ModelRunner(model_dir, dtype, device)
        self.tokenizer = self._load_tokenizer(model_dir)
        config = self.runner.model.config
        eos = getattr(getattr(self.runner.model, "generation_config", None), "eos_token_id", None) or config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.scheduler = Scheduler(self.runner, eos_ids, max_running)
        self.mask_max_tokens = sampling_mask_max_tokens
        self.weight_groups: dict[str, object] = {}

    @staticmethod
    def _load_tokenizer(model_dir: str):
        if not (Path(model_dir) / "tokenizer_config.json").is_file():
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    # ---- /generate --------------------------------------------------------------------------
    def generate(self, body: dict) -> list[dict]:
        """A /generate body served in-process, blocking, without HTTP (library use, tests): one
        SGLang-shaped response per completion. The scheduler must be running."""
        req = protocol.parse_generate(body, self.runner.vocab_size, self.mask_max_tokens)
        finished = threading.Semaphore(0)
        requests = self.make_requests(req, lambda r, done: finished.release() if done else None)
        for r in requests:
            self.scheduler.submit(r)
        for _ in requests:
            finished.acquire()
        return [self.response(r, req) for r in requests]

    def make_requests(self, req: protocol.GenerateRequest, on_update) -> list[Request]:
        if req.input_ids is None:
            if self.tokenizer is None:
                raise protocol.ProtocolError(f"{self.model_dir} has no tokenizer: send input_ids instead of text")
            input_ids = self.tokenizer(req.text)["input_ids"]
            if not input_ids:
                raise protocol.ProtocolError("text tokenizes to no tokens")
        else:
            input_ids = list(req.input_ids)
        if req.return_logprob and req.logprob_start_len >= len(input_ids):
            raise protocol.ProtocolError(f"logprob_start_len={req.logprob_start_len} must be < the prompt length {len(input_ids)}")
        if req.routed_experts_start_len > len(input_ids):
            raise protocol.ProtocolError(f"routed_experts_start_len={req.routed_experts_start_len} exceeds the prompt length {len(input_ids)}")
        if req.lora_path is not None and req.lora_path not in self.scheduler.adapters.adapters:
            raise protocol.ProtocolError(f"LoRA adapter {req.lora_path!r} is not loaded")
        s = req.sampling
        rid = req.rid or uuid.uuid4().hex
        requests = []
        for i in range(s["n"]):
            seed = None if s["sampling_seed"] is None else s["sampling_seed"] + i
            params = SamplingParams(
                temperature=float(s["temperature"]), top_p=float(s["top_p"]), top_k=s["top_k"], min_p=float(s["min_p"]),
                max_new_tokens=s["max_new_tokens"], stop_token_ids=list(s["stop_token_ids"]), ignore_eos=s["ignore_eos"],
                sampling_seed=seed,
            )
            requests.append(Request(
                rid=rid if s["n"] == 1 else f"{rid}-{i}", input_ids=input_ids, params=params,
                logprob_start_len=max(req.logprob_start_len, 0) if req.return_logprob else None,
                return_routed_experts=req.return_routed_experts, return_sampling_mask=req.return_sampling_mask,
                lora=req.lora_path, on_update=on_update,
            ))
        return requests

    def response(self, request: Request, req: protocol.GenerateRequest) -> dict[str, Any]:
        n_out = len(request.output_ids)
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": request.finish_reason,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": n_out,
            "weight_version": request.versions[-1] if request.versions else self.scheduler.weight_version,
            "weight_versions": protocol.version_spans(request.versions),
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[d.logprob, d.token, None] for d in request.draws]
            if request.prompt_logprobs is not None:
                start = max(req.logprob_start_len, 0)
                meta["input_token_logprobs"] = [
                    [None if np.isnan(lp) else float(lp), tok, None]
                    for lp, tok in zip(request.prompt_logprobs.tolist(), request.input_ids[start:])
                ]
        if req.return_routed_experts:
            rows = torch.cat(request.routing) if request.routing else torch.zeros(0, self.runner.num_layers, self.runner.topk, dtype=torch.int32)
            end = len(request.input_ids) + n_out - 1
            meta["routed_experts"] = protocol.encode_routed_experts(rows[req.routed_experts_start_len : max(end, 0)].numpy())
        if req.return_sampling_mask:
            meta["output_token_sampling_mask"] = [d.kept_ids.tolist() for d in request.draws]
            meta["output_token_sampling_mask_length"] = len(request.draws)
            if req.sampling_logprobs_mode == "selected":
                meta["output_token_sampling_logprobs"] = [d.selected_logprob for d in request.draws]
            else:
                meta["output_token_sampling_logprobs"] = [d.kept_logprobs.tolist() for d in request.draws]
        out = {"output_ids": list(request.output_ids), "meta_info": meta}
        out["text"] = self.tokenizer.decode(request.output_ids) if self.tokenizer is not None else ""
        return out

    # ---- info --------------------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir if self.tokenizer is not None else None,
            "is_generation": True,
            "weight_version": self.scheduler.weight_version,
            "num_hidden_layers": self.runner.num_layers,
            "moe_layers": self.runner.moe_layers,
            "num_experts_per_tok": self.runner.topk,
            "vocab_size": self.runner.vocab_size,
        }


def build_app(engine: EmbeddedEngine) -> web.Application:
    routes = web.RouteTableDef()
    sched = engine.scheduler

    async def body_of(request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            raise protocol.ProtocolError(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise protocol.ProtocolError("the request body must be a JSON object")
        return body

    async def on_engine(fn):
        return await asyncio.wrap_future(sched.call(fn))

    @routes.post("/generate")
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await body_of(request)
        req = protocol.parse_generate(body, engine.runner.vocab_size, engine.mask_max_tokens)
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def on_update(r: Request, finished: bool) -> None:
            if finished or req.stream:
                loop.call_soon_threadsafe(updates.put_nowait, (r.rid, finished, engine.response(r, req)))

        requests = engine.make_requests(req, on_update)
        # As SGLang does, chunks of an n > 1 stream say which completion they belong to.
        index_of = {r.rid: i for i, r in enumerate(requests)} if len(requests) > 1 else {}
        for r in requests:
            sched.submit(r)
        if req.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            remaining = len(requests)
            while remaining:
                rid, finished, payload = await updates.get()
                remaining -= finished
                if index_of:
                    payload["index"] = index_of[rid]
                await resp.write(f"data: {json.dumps(payload)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        results: dict[str, dict] = {}
        while len(results) < len(requests):
            rid, finished, payload = await updates.get()
            if finished:
                results[rid] = payload
        ordered = [results[r.rid] for r in requests]
        return web.json_response(ordered[0] if len(ordered) == 1 else ordered)

    @routes.get("/health")
    async def health(request):
        return web.Response(text="")

    @routes.get("/health_generate")
    async def health_generate(request):
        return web.Response(text="" if engine.scheduler._thread.is_alive() else "engine thread stopped", status=200 if engine.scheduler._thread.is_alive() else 503)

    @routes.get("/model_info")
    @routes.get("/get_model_info")
    async def model_info(request):
        return web.json_response(engine.model_info())

    @routes.post("/pause_generation")
    async def pause_generation(request):
        body = await body_of(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise protocol.ProtocolError(f"mode must be abort, retract or in_place, got {mode!r}")
        await on_engine(lambda: sched.pause(mode))
        return web.json_response({"success": True, "message": f"paused ({mode})"})

    @routes.post("/continue_generation")
    async def continue_generation(request):
        await on_engine(sched.resume)
        return web.json_response({"success": True, "message": "continued"})

    @routes.post("/abort_request")
    async def abort_request(request):
        body = await body_of(request)
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        if not abort_all and not rid:
            raise protocol.ProtocolError("give rid or abort_all=true")
        count = await on_engine(lambda: sched.abort(None if abort_all else rid))
        return web.json_response({"success": True, "aborted": count})

    @routes.route("*", "/flush_cache")
    async def flush_cache(request):
        ok = await on_engine(sched.flush_cache)
        return web.Response(text="Cache flushed." if ok else "Cache not flushed: requests are running.", status=200 if ok else 400)

    @routes.route("*", "/get_weights_by_name")
    async def get_weights_by_name(request):
        body = await body_of(request)
        name, truncate = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(truncate, int) or truncate < 1:
            raise protocol.ProtocolError("get_weights_by_name takes a name (string) and truncate_size (int >= 1)")

        def read():
            view = hub_tensor_view(dict(engine.runner.model.named_parameters()), name)
            return None if view is None else view.float().cpu().tolist()[:truncate]

        values = await on_engine(read)
        if values is None:
            raise protocol.ProtocolError(f"{name!r} is not a weight of the served model (give a Hub tensor name)")
        return web.json_response(values)

    @routes.post("/update_weight_version")
    async def update_weight_version(request):
        body = await body_of(request)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise protocol.ProtocolError("new_version must be a non-empty string")

        def apply():
            if body.get("abort_all_requests", True):
                sched.abort(message="weight version changed")
            sched.weight_version = version

        await on_engine(apply)
        return web.json_response({"success": True, "message": f"weight version {version}"})

    @routes.post("/update_weights_from_disk")
    async def update_weights_from_disk(request):
        body = await body_of(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not Path(path).is_dir():
            raise protocol.ProtocolError(f"model_path {path!r} is not a directory")
        from transformers import AutoModelForCausalLM

        new = await asyncio.to_thread(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=engine.runner.model.dtype))
        missing = set(engine.runner.model.state_dict()) ^ set(new.state_dict())
        if missing:
            raise protocol.ProtocolError(f"{path} does not match the served model: {sorted(missing)[:5]}")

        def apply():
            sched.adapters.activate(None)
            if body.get("abort_all_requests", False):
                sched.abort(message="weights updated")
            engine.runner.model.load_state_dict(new.state_dict())
            if body.get("weight_version") is not None:
                sched.weight_version = str(body["weight_version"])

        await on_engine(apply)
        return web.json_response({"success": True, "message": f"loaded {path}", "num_paused_requests": 0})

    @routes.post("/init_weights_update_group")
    async def init_weights_update_group(request):
        body = await body_of(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise protocol.ProtocolError(f"missing field(s): {', '.join(missing)}")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl" if engine.runner.device.type == "cuda" else "gloo")
        if backend == "nccl" and engine.runner.device.type != "cuda":
            raise protocol.ProtocolError("backend nccl needs a CUDA engine; this one runs on the CPU (use gloo)")
        from moerl.engines.weight_group import join_weight_group, weight_store

        world, rank = int(body["world_size"]), int(body["rank_offset"])
        engine.weight_groups[name] = await asyncio.to_thread(
            lambda: join_weight_group(backend, weight_store(body["master_address"], int(body["master_port"]), world, rank), world, rank, name)
        )
        return web.json_response({"success": True, "message": f"joined {name} as rank {body['rank_offset']}"})

    @routes.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request):
        body = await body_of(request)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not names:
            raise protocol.ProtocolError("names, dtypes and shapes must be non-empty lists")
        if not len(names) == len(dtypes) == len(shapes):
            raise protocol.ProtocolError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        name = body.get("group_name", "weight_update_group")
        if name not in engine.weight_groups:
            raise protocol.ProtocolError(f"group {name!r} is not initialised: call /init_weights_update_group first")
        group = engine.weight_groups[name]
        device = engine.runner.device
        import torch.distributed as dist

        if body.get("load_format") == "flattened_bucket":
            spans = protocol.bucket_layout(dtypes, shapes)
            flat = torch.empty(spans[-1][1], dtype=torch.uint8, device=device)
            await asyncio.to_thread(dist.broadcast, flat, 0, group)
            named = protocol.unflatten_bucket(flat, names, dtypes, shapes)
        elif body.get("load_format") is None:
            for i, d in enumerate(dtypes):
                if d not in protocol.TORCH_DTYPES:
                    raise protocol.ProtocolError(f"dtypes[{i}]={d!r} is not one of {protocol.TORCH_DTYPES}")
            named = [(n, torch.empty(s, dtype=getattr(torch, d), device=device)) for n, d, s in zip(names, dtypes, shapes)]

            def receive():
                for _, t in named:
                    dist.broadcast(t, 0, group)

            await asyncio.to_thread(receive)
        else:
            raise protocol.ProtocolError(f"load_format {body['load_format']!r}: expected null or 'flattened_bucket'")
        return web.json_response(await apply_weights(body, named))

    async def apply_weights(body: dict, named: list) -> dict:
        from moerl.engines.embedded.runner import hub_tensor_targets

        def apply():
            pairs = hub_tensor_targets(engine.runner.model, named)  # all checked before any write
            sched.adapters.activate(None)  # write base weights, not adapter-merged ones
            if body.get("abort_all_requests", False):
                sched.abort(message="weights updated")
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
            if body.get("weight_version") is not None:
                sched.weight_version = str(body["weight_version"])

        try:
            await on_engine(apply)
        except ValueError as e:
            raise protocol.ProtocolError(str(e)) from None
        return {"success": True, "message": f"updated {len(named)} tensors"}

    @routes.post("/load_lora_adapter")
    async def load_lora_adapter(request):
        body = await body_of(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str):
            raise protocol.ProtocolError("lora_name and lora_path must be strings")
        adapter = await asyncio.to_thread(lora.adapter_from_dir, name, path)
        await on_engine(lambda: sched.adapters.add(adapter))
        return web.json_response({"success": True, "loaded_adapters": sorted(sched.adapters.adapters)})

    @routes.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(request):
        body = await body_of(request)
        name, config, payloads = body.get("lora_name"), body.get("config_dict"), body.get("serialized_named_tensors")
        if not isinstance(name, str) or not name or not isinstance(config, dict):
            raise protocol.ProtocolError("lora_name must be a string and config_dict an object")
        if body.get("load_format") != "safetensors":
            raise protocol.ProtocolError(
                "the embedded engine takes serialized_named_tensors with load_format='safetensors' "
                "(base64 safetensors bytes; SGLang's default is a CUDA-IPC pickle that cannot cross machines)"
            )
        if not isinstance(payloads, list) or len(payloads) != 1:
            raise protocol.ProtocolError("serialized_named_tensors must hold one entry (the embedded engine has one rank)")
        import base64

        adapter = lora.adapter_from_bytes(name, config, base64.b64decode(payloads[0]))
        await on_engine(lambda: sched.adapters.add(adapter))
        return web.json_response({"success": True, "loaded_adapters": sorted(sched.adapters.adapters)})

    @routes.post("/unload_lora_adapter")
    async def unload_lora_adapter(request):
        body = await body_of(request)
        name = body.get("lora_name")
        await on_engine(lambda: sched.unload_adapter(name))
        return web.json_response({"success": True, "loaded_adapters": sorted(sched.adapters.adapters)})

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except (protocol.ProtocolError, lora.LoRAError) as e:
            return _error(400, str(e))
        except web.HTTPException:
            raise
        except Exception as e:  # the server keeps serving; the caller learns what failed
            log.exception("request %s failed", request.path)
            return _error(500, f"{type(e).__name__}: {e}")

    app = web.Application(middlewares=[errors], client_max_size=1 << 30)
    app.add_routes(routes)

    async def start_engine(app):
        sched.start()

    async def stop_engine(app):
        await asyncio.to_thread(sched.stop)

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moerl serve",
        description="Serve a HF MoE model with moerl's embedded engine over SGLang's HTTP API "
        "(routed experts, sampling masks, weight versions, pause/continue, weight updates).",
    )
    p.add_argument("--model", required=True, help="local HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--sampling-mask-max-tokens", type=int, default=protocol.DEFAULT_SAMPLING_MASK_MAX_TOKENS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not Path(args.model, "config.json").is_file():
        print(f"error: {args.model} is not a HF model directory (no config.json)", flush=True)
        return 2
    engine = EmbeddedEngine(args.model, DTYPES[args.dtype], args.device, args.max_running_requests, args.sampling_mask_max_tokens)
    web.run_app(build_app(engine), host=args.host, port=args.port, print=lambda *a: log.info("serving %s on http://%s:%d", args.model, args.host, args.port))
    return 0
