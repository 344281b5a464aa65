"""An OpenAI-compatible chat endpoint per episode, so agent code written for the ``openai`` SDK runs unchanged.

The rollout manager serves one :class:`EpisodeEndpoint` on loopback; each live episode has its own base URL
(``http://127.0.0.1:PORT/episodes/KEY/v1``, :attr:`Episode.base_url`), and ``POST .../chat/completions`` there is
:meth:`Episode.chat_turn`: recorded exactly as a call through the handle (the same stream, forks, routing and kept
sets).

What the run decides is not the client's to change: every token must be scored under the sampling that drew it, so
the run's temperature, top-p and top-k apply and a request's ``temperature``/``top_p``/``seed`` are ignored;
``max_tokens`` (or ``max_completion_tokens``) caps the turn. Streaming is refused (400, saying so): a streamed answer
could not carry what the episode records. A request naming an episode that has ended, or a body that is not a chat
request, is refused with an OpenAI-style error naming the field.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from moerl.episodes.episode import Episode, EpisodeDone

log = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant", "tool")


class BadRequest(Exception):
    """A request this endpoint refuses: answered 400 with the message."""


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty list of chat messages is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}]: a message is an object whose role is one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported")
            m = {**m, "content": "".join(p.get("text", "") for p in content)}
            messages[i] = m
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: a string, a list of text parts, or null")
    return messages


def _overrides(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("stream"):
        raise BadRequest("stream: streaming is not supported by an episode's endpoint; call without stream=true")
    if body.get("n", 1) != 1:
        raise BadRequest("n: an episode's endpoint answers one choice per call (n=1)")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools: a list of function tools")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        return {}
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise BadRequest("max_tokens: a positive integer")
    return {"max_new_tokens": limit}


class EpisodeEndpoint:
    """The loopback HTTP server every episode's base URL points into; :meth:`open` gives an episode its URL."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.episodes: dict[str, Episode] = {}
        # What failed a call to an episode's endpoint (the engines, the episode's stream): the episode has failed, and
        # its runner reads why; later calls to it are refused.
        self.failures: dict[str, Exception] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/episodes/{key}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{key}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, episode: Episode) -> str:
        """Serve ``episode`` until :meth:`close_episode`; its base URL (also set as ``episode.base_url``)."""
        key = uuid.uuid4().hex
        self.episodes[key] = episode
        episode.base_url = f"http://127.0.0.1:{self.port}/episodes/{key}/v1"
        return key

    def close_episode(self, key: str) -> None:
        """Stop serving the episode of ``key``; what failed a call to it stays in :attr:`failures` for its runner."""
        self.episodes.pop(key, None)

    async def _models(self, request: web.Request) -> web.Response:
        if request.match_info["key"] not in self.episodes:
            return _error(404, "no such episode (it has ended)", "not_found_error")
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "moerl"}]}
        )

    async def _chat(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        episode = self.episodes.get(key)
        if episode is None:
            return _error(404, "no such episode (it has ended)", "not_found_error")
        if key in self.failures:
            return _error(500, f"the episode has failed: {self.failures[key]}", "server_error")
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object (a chat completion request)")
            messages, overrides = _messages(body), _overrides(body)
        except json.JSONDecodeError as e:
            return _error(400, f"the body is not JSON: {e}")
        except BadRequest as e:
            return _error(400, str(e), param=str(e).split(":", 1)[0])
        try:
            turn = await episode.chat_turn(messages, tools=body.get("tools"), **overrides)
        except EpisodeDone:
            # The episode's token budget is spent: an answer that ends the agent's loop, as a model at its length would.
            return web.json_response(self._answer({"role": "assistant", "content": ""}, "length", 0, 0, 0))
        except Exception as e:  # noqa: BLE001 - the episode fails, not the server: its runner reads why
            self.failures[key] = e
            log.warning("episode endpoint call failed: %s: %s", type(e).__name__, e)
            return _error(500, f"the episode has failed: {type(e).__name__}: {e}", "server_error")
        assert turn.message is not None  # a chat turn's
        return web.json_response(
            self._answer(
                turn.message, turn.finish_reason, turn.prompt_tokens, turn.completion_tokens, turn.cached_tokens
            )
        )

    def _answer(
        self, message: dict[str, Any], finish_reason: str, prompt: int, completion: int, cached: int
    ) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
