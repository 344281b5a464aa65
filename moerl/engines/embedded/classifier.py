"""A reward model served as SGLang 0.5.23 serves one: a transformers sequence-classification model behind ``/classify``.

SGLang takes such an architecture (``*ForSequenceClassification``, ``*ForRewardModel``) for a model that does not
generate and answers ``/classify`` as an embedding request: per input, ``embedding`` is the scores of its last token's
head (one score for a reward model). This engine does the same on the CPU or a GPU, one input at a time (no padding,
so no input's score depends on another's), and holds weights that never change: reward models take no updates.
Colocated with a trainer it pauses (requests wait), gives back its memory and takes it back, as SGLang's memory saver
does with ``--enable-weights-cpu-backup``; it holds no KV cache between requests.

A process reward model (transformers' ``*ForTokenClassification``, 1 or 2 labels) is served the same way by
:class:`ProcessRewardEngine` at moerl's own ``/step_scores``: SGLang 0.5.23 serves no per-token head. Each answer is the
score of every step of the input, in the Qwen2.5-Math-PRM convention: p(label 1) at each step separator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from aiohttp import web
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, PreTrainedModel

from moerl.engines import protocol
from moerl.engines.embedded.engine import MemoryOccupation, load_tokenizer
from moerl.engines.embedded.engine import server_info as server_info_of
from moerl.engines.embedded.runner import own_weights
from moerl.engines.embedded.server import _errors, _ok, _parse
from moerl.engines.embedded.streaming import json_response
from moerl.engines.protocol import ProtocolError
from moerl.errors import ConfigError

log = logging.getLogger("moerl.serve")


class ClassifierEngine:
    """A sequence classifier (a reward model): one score a sequence, at ``/classify``."""

    engine_name = "moerl-embedded"
    kind = "a sequence classifier (one score a sequence, at /classify)"  # what a refusal of the other route names
    auto_model: ClassVar[Any] = AutoModelForSequenceClassification  # a transformers Auto class

    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
        weights_cpu_backup: bool = False,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = self.auto_model.from_pretrained(str(model_dir), dtype=dtype)
        self.model: PreTrainedModel = model.to(self.device).eval()
        self.model_dir = str(model_dir)
        self.check_model()
        own_weights(self.model)
        self.tokenizer = load_tokenizer(model_dir)
        config = self.model.config
        self.vocab_size, self.max_tokens = config.vocab_size, config.max_position_embeddings
        self._forward = asyncio.Lock()  # one input at a time through the model
        self.memory = MemoryOccupation(self.model, weights_cpu_backup)
        self.serving = asyncio.Event()  # clear while paused: requests wait
        self.serving.set()

    def check_model(self) -> None:
        """Refuse a model this engine cannot serve (a sequence classifier: any)."""

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
        self.check_ids(batch)
        return batch

    def check_ids(self, batch: list[list[int]]) -> None:
        """Each input's ids lie in the model's vocabulary and fit its context."""
        for i, ids in enumerate(batch):
            if not all(0 <= t < self.vocab_size for t in ids):
                raise ProtocolError(f"input_ids[{i}]: ids must lie in [0, {self.vocab_size})")
            if len(ids) > self.max_tokens:
                raise ProtocolError(f"input {i}: {len(ids)} tokens, more than the model's {self.max_tokens}")

    @asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """The model, ours alone while serving: waits out a pause, and one that comes while it waits for the model."""
        while True:  # serving, and still so once the model is ours: a pause may come between the two
            await self.serving.wait()
            await self._forward.acquire()
            if self.serving.is_set():
                break
            self._forward.release()
        try:
            yield
        finally:
            self._forward.release()

    @torch.no_grad()
    def scores(self, ids: list[int]) -> list[float]:
        return self.model(torch.tensor([ids], device=self.device)).logits[0].float().tolist()

    async def classify(self, req: protocol.ClassifyReqInput) -> list[protocol.ClassifyResponse]:
        batch = self.token_ids(req)
        rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(batch)
        answers: list[protocol.ClassifyResponse] = []
        async with self._turn():
            for ids, rid in zip(batch, rids, strict=True):
                scores = await asyncio.to_thread(self.scores, ids)
                answers.append({"embedding": scores, "meta_info": {"id": rid, "prompt_tokens": len(ids)}})
        return answers

    async def step_scores(self, req: protocol.StepScoresReqInput) -> list[protocol.StepScoresResponse]:
        raise ProtocolError(
            f"/step_scores scores the steps of a response with a process reward model (*ForTokenClassification); "
            f"{self.model_dir} is {self.kind}"
        )


class ProcessRewardEngine(ClassifierEngine):
    """A process reward model: transformers' token classifier with 1 or 2 labels, scoring each step of an input at its
    separator, at ``/step_scores``. As the classifier, one input at a time, unpadded."""

    kind = "a process reward model (a score at each step separator, at /step_scores)"
    auto_model = AutoModelForTokenClassification

    def check_model(self) -> None:
        if self.model.config.num_labels not in (1, 2):
            raise ConfigError(
                f"{self.model_dir}: a process reward model's head has 1 label (a step's score: the sigmoid of its "
                f"logit) or 2 (p(label 1) of their softmax), not {self.model.config.num_labels}"
            )

    @torch.no_grad()
    def step_probs(self, ids: list[int], step_token_id: int) -> list[float]:
        """p(label 1) at each position of ``ids`` holding ``step_token_id``, in order: the softmax over 2 labels, the
        sigmoid of a 1-label head's logit."""
        tokens = torch.tensor([ids], device=self.device)
        positions = (tokens[0] == step_token_id).nonzero().flatten()
        if positions.numel() == 0:
            return []  # no step: no forward
        logits = self.model(tokens).logits[0].float()
        probs = torch.softmax(logits, -1)[:, 1] if logits.shape[-1] == 2 else torch.sigmoid(logits[:, 0])
        return probs[positions].tolist()

    async def classify(self, req: protocol.ClassifyReqInput) -> list[protocol.ClassifyResponse]:
        raise ProtocolError(
            f"/classify scores a sequence with a sequence classifier (*ForSequenceClassification); {self.model_dir} "
            f"is {self.kind}"
        )

    async def step_scores(self, req: protocol.StepScoresReqInput) -> list[protocol.StepScoresResponse]:
        self.check_ids(req.input_ids)
        if req.step_token_id >= self.vocab_size:
            raise ProtocolError(f"step_token_id={req.step_token_id} lies outside the vocabulary [0, {self.vocab_size})")
        answers: list[protocol.StepScoresResponse] = []
        async with self._turn():
            for ids in req.input_ids:
                answers.append({"scores": await asyncio.to_thread(self.step_probs, ids, req.step_token_id)})
        return answers


def build_classifier_app(engine: ClassifierEngine) -> web.Application:
    """``engine`` over HTTP: ``/classify`` (POST or PUT, as SGLang's) and ``/step_scores``, each refused (400, naming
    the model's kind) by the engine that does not score that way, ``/health``, ``/model_info``, ``/server_info``, and
    the colocation routes (pause, continue, release and resume memory)."""

    async def classify(request: web.Request) -> web.Response:
        req = await _parse(request, protocol.ClassifyReqInput)
        answers = await engine.classify(req)
        return json_response(answers if req.batched else answers[0])

    async def step_scores(request: web.Request) -> web.Response:
        req = await _parse(request, protocol.StepScoresReqInput)
        return json_response(await engine.step_scores(req))

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
        return json_response(info)

    async def server_info(request: web.Request) -> web.Response:
        return json_response(server_info_of(engine.engine_name, engine.model))

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
            web.post(protocol.STEP_SCORES.path, step_scores),
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
