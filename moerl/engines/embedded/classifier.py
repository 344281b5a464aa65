"""A reward model served as SGLang 0.5.23 serves one: a transformers sequence-classification model behind ``/classify``.

SGLang takes such an architecture (``*ForSequenceClassification``, ``*ForRewardModel``) for a model that does not
generate and answers ``/classify`` as an embedding request: per input, ``embedding`` is the scores of its last token's
head (one score for a reward model). This engine does the same on the CPU or a GPU, one input at a time (no padding,
so no input's score depends on another's), and holds weights that never change: reward models take no updates.
Colocated with a trainer it pauses (requests wait), gives back its memory and takes it back, as SGLang's memory saver
does with ``--enable-weights-cpu-backup``; it holds no KV cache between requests.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch
from aiohttp import web
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from moerl.engines import protocol
from moerl.engines.embedded.engine import MemoryOccupation, load_tokenizer
from moerl.engines.embedded.engine import server_info as server_info_of
from moerl.engines.embedded.runner import own_weights
from moerl.engines.embedded.server import _errors, _ok, _parse
from moerl.engines.embedded.streaming import dumps
from moerl.engines.protocol import ProtocolError

log = logging.getLogger("moerl.serve")


class ClassifierEngine:
    engine_name = "moerl-embedded"

    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
        weights_cpu_backup: bool = False,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=dtype)
        self.model: PreTrainedModel = model.to(self.device).eval()
        own_weights(self.model)
        self.model_dir = str(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        config = self.model.config
        self.vocab_size, self.max_tokens = config.vocab_size, config.max_position_embeddings
        self._forward = asyncio.Lock()  # one input at a time through the model
        self.memory = MemoryOccupation(self.model, weights_cpu_backup)
        self.serving = asyncio.Event()  # clear while paused: requests wait
        self.serving.set()

    async def pause(self) -> None:
        """Requests wait from now on; the one running ends first."""
        self.serving.clear()
        async with self._forward:
            pass

    def resume(self) -> None:
        if self.memory.released:
            raise ProtocolError(
                f"memory is released ({', '.join(sorted(self.memory.released))}): resume it "
                "(/resume_memory_occupation) before requests continue"
            )
        self.serving.set()

    async def release_memory(self, tags: frozenset[str]) -> set[str]:
        """Give back the memory of ``tags`` while paused (as SGLang, only while nothing runs); the tags newly
        released."""
        if self.serving.is_set():
            raise ProtocolError("memory is released only while nothing runs: pause generation first")
        async with self._forward:
            return self.memory.release(tags)

    def token_ids(self, req: protocol.ClassifyReqInput) -> list[list[int]]:
        """Each input's token ids, checked against the model's vocabulary and context."""
        if req.text is not None:
            if self.tokenizer is None:
                raise ProtocolError(f"text: {self.model_dir} has no tokenizer; send input_ids")
            batch = [self.tokenizer(text, add_special_tokens=True)["input_ids"] for text in req.batch()]
        else:
            batch = req.batch()
        for i, ids in enumerate(batch):
            if not all(0 <= t < self.vocab_size for t in ids):
                raise ProtocolError(f"input_ids[{i}]: ids must lie in [0, {self.vocab_size})")
            if len(ids) > self.max_tokens:
                raise ProtocolError(f"input {i}: {len(ids)} tokens, more than the model's {self.max_tokens}")
        return batch

    @torch.no_grad()
    def scores(self, ids: list[int]) -> list[float]:
        return self.model(torch.tensor([ids], device=self.device)).logits[0].float().tolist()

    async def classify(self, req: protocol.ClassifyReqInput) -> list[protocol.ClassifyResponse]:
        batch = self.token_ids(req)
        rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(batch)
        answers: list[protocol.ClassifyResponse] = []
        while True:  # serving, and still so once the model is ours: a pause may come between the two
            await self.serving.wait()
            await self._forward.acquire()
            if self.serving.is_set():
                break
            self._forward.release()
        try:
            for ids, rid in zip(batch, rids, strict=True):
                scores = await asyncio.to_thread(self.scores, ids)
                answers.append({"embedding": scores, "meta_info": {"id": rid, "prompt_tokens": len(ids)}})
        finally:
            self._forward.release()
        return answers


def build_classifier_app(engine: ClassifierEngine) -> web.Application:
    """``engine`` over HTTP: ``/classify`` (POST or PUT, as SGLang's), ``/health``, ``/model_info``, ``/server_info``,
    and the colocation routes (pause, continue, release and resume memory)."""

    async def classify(request: web.Request) -> web.Response:
        req = await _parse(request, protocol.ClassifyReqInput)
        answers = await engine.classify(req)
        return web.json_response(answers if req.batched else answers[0], dumps=dumps)

    async def health(request: web.Request) -> web.Response:
        # As SGLang's, whose /health runs a request through the scheduler: not while paused.
        if not engine.serving.is_set():
            return web.Response(status=503, text="generation is paused")
        return web.Response(text="ok")

    async def model_info(request: web.Request) -> web.Response:
        info = {
            "model_path": engine.model_dir,
            "tokenizer_path": engine.model_dir if engine.tokenizer is not None else None,
            "is_generation": False,
        }
        return web.json_response(info, dumps=dumps)

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(server_info_of(engine.engine_name, engine.model), dumps=dumps)

    async def pause(request: web.Request) -> web.Response:
        req = await _parse(request, protocol.PauseGenerationReqInput)
        await engine.pause()
        return _ok(f"paused ({req.mode})")

    async def resume(request: web.Request) -> web.Response:
        await _parse(request, protocol.ContinueGenerationReqInput)
        engine.resume()
        return _ok("continued")

    async def release(request: web.Request) -> web.Response:
        req = await _parse(request, protocol.ReleaseMemoryOccupationReqInput)
        released = await engine.release_memory(req.regions())
        return _ok(f"released {', '.join(sorted(released)) or 'nothing more'}")

    async def take_back(request: web.Request) -> web.Response:
        req = await _parse(request, protocol.ResumeMemoryOccupationReqInput)
        resumed = engine.memory.resume(req.regions())
        return _ok(f"resumed {', '.join(sorted(resumed)) or 'nothing released'}")

    app = web.Application(middlewares=[_errors])
    app.add_routes(
        [
            web.post(protocol.CLASSIFY.path, classify),
            web.put(protocol.CLASSIFY.path, classify),
            web.get(protocol.HEALTH.path, health),
            web.get(protocol.MODEL_INFO.path, model_info),
            web.get(protocol.SERVER_INFO.path, server_info),
            web.post(protocol.PAUSE.path, pause),
            web.post(protocol.CONTINUE.path, resume),
            web.post(protocol.RELEASE_MEMORY.path, release),
            web.post(protocol.RESUME_MEMORY.path, take_back),
        ]
    )
    return app
