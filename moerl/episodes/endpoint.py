"""An OpenAI-compatible chat endpoint per episode, so agent code written for the ``openai`` SDK runs unchanged.

The rollout manager serves one :class:`EpisodeEndpoint` on loopback; each live episode has its own base URL
(``http://127.0.0.1:PORT/episodes/KEY/v1``, :attr:`Episode.base_url`), and ``POST .../chat/completions`` there is
:meth:`Episode.chat_turn`: recorded exactly as a call through the handle (the same stream, forks, routing and kept
sets).

What the run decides is not the client's to change: every token must be scored under the sampling that drew it, so
the run's temperature, top-p and top-k apply and a request's ``temperature``/``top_p``/``seed`` are ignored;
``max_tokens`` (or ``max_completion_tokens``) may lower the run's cap on a turn, never raise it. Every other field of
a Chat Completions request is honoured exactly (``stop`` cuts the turn, ``logprobs`` returns the behaviour
log-probs), ignored on purpose, or refused with a 400 that names it and says why (:data:`HONOURED`, :data:`IGNORED`,
:data:`ONLY`, :data:`REFUSED`; docs/episodes.md has the table). A request naming an episode that has ended, or a body
that is not a chat request, is refused with an OpenAI-style error naming the field.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from moerl.episodes.episode import Episode, EpisodeDone, Turn

log = logging.getLogger(__name__)
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's developer role is the system role of models that have no other: chat templates know only "system".
RENDERED_AS = {"developer": "system"}

_REPLAYED = (
    "the trainer scores every token under the sampling that drew it, the run's; a request cannot change it "
    "(constrained decoding or penalties would train tokens under a distribution the trainer does not replay)"
)
_NOT_HERE = "an episode's endpoint serves text chat completions only"


class BadRequest(Exception):
    """A request this endpoint refuses: answered 400 with the message, naming the field (``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages", "a non-empty list of chat messages is required")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}]", f"a message is an object whose role is one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p.get("text", "") for p in content)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content", "a string, a list of text parts, or null")
        messages.append({**m, "role": RENDERED_AS.get(m["role"], m["role"]), "content": content})
    return messages


# Every field of a Chat Completions request (openai 3.57's CompletionCreateParams) and what the endpoint does with it;
# docs/episodes.md has the same table. A field outside it is refused too: none is silently dropped.
HONOURED = frozenset({"messages", "tools", "stop", "max_completion_tokens", "max_tokens", "logprobs", "top_logprobs"})
MAX_TOP_LOGPROBS = 20  # OpenAI's
# The run decides (temperature, top_p, seed: the module's docstring), or OpenAI's service bookkeeping, with no effect
# on an answer; stream_options means something with stream only, which is refused.
IGNORED = frozenset(
    {
        "model",
        "temperature",
        "top_p",
        "seed",
        "stream_options",
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",  # the run keys its engines' prefix caches by group and policy
        "prompt_cache_retention",
        "prompt_cache_options",
    }
)
# Taken at the one value the endpoint honours (each field's default, or null); any other is refused with the reason.
ONLY: dict[str, tuple[Any, str]] = {
    "tool_choice": ("auto", f"the model chooses whether to call a tool: {_REPLAYED}"),
    "parallel_tool_calls": (True, "nothing holds the model to one call per turn; every call it writes is parsed"),
    "n": (1, "an episode is one stream: one choice per call"),
    "stream": (False, "a streamed answer could not carry what the episode records; call without stream=true"),
    "response_format": ({"type": "text"}, f"JSON output would need constrained decoding: {_REPLAYED}"),
    "modalities": (["text"], _NOT_HERE),
    "frequency_penalty": (0, _REPLAYED),
    "presence_penalty": (0, _REPLAYED),
    "logit_bias": ({}, _REPLAYED),
}
REFUSED: dict[str, str] = {
    "reasoning_effort": "the chat template's settings (chat_template_kwargs) decide whether the model reasons",
    "verbosity": "the model's length is its own, capped by max_tokens",
    "audio": _NOT_HERE,
    "prediction": "predicted outputs are not supported",
    "web_search_options": "no built-in tools: give the episode's tools in tools",
    "moderation": "no moderation runs here",
    "functions": "the legacy functions API is not rendered: give them as tools",
    "function_call": "the legacy functions API is not rendered: give tool_choice with tools",
}


def _turn_args(body: dict[str, Any]) -> dict[str, Any]:
    """What ``body`` asks of :meth:`Episode.chat_turn`, every field checked against :data:`FIELDS`."""
    for name, value in body.items():
        if value is None or name in HONOURED or name in IGNORED:
            continue
        if name in ONLY:
            taken, why = ONLY[name]
            if value != taken:
                raise BadRequest(name, f"only {json.dumps(taken)} is taken here: {why}")
        elif name in REFUSED:
            raise BadRequest(name, f"not supported: {REFUSED[name]}")
        else:
            raise BadRequest(name, "not a Chat Completions field this endpoint knows (docs/episodes.md lists them)")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools", "a list of function tools")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and not (isinstance(stops, list) and all(isinstance(x, str) and x for x in stops)):
        raise BadRequest("stop", "a non-empty string or a list of them")
    args: dict[str, Any] = {"messages": _messages(body.get("messages")), "tools": tools, "stop": stops or ()}
    for name in ("max_completion_tokens", "max_tokens"):
        limit = body.get(name)
        if limit is None:
            continue
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise BadRequest(name, "a positive integer")
        args["max_new_tokens"] = min(limit, args.get("max_new_tokens", limit))
    if body.get("logprobs") not in (None, True, False):
        raise BadRequest("logprobs", "true or false")
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest("top_logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top and not body.get("logprobs"):
            raise BadRequest("top_logprobs", "needs logprobs=true, as OpenAI's API does")
        args["top_logprobs"] = top
    return args


def _logprobs(turn: Turn, tokenizer: Any) -> dict[str, Any]:
    """``turn``'s tokens with their behaviour log-probs, in OpenAI's shape: every output token (tool-call markup and
    the end-of-turn token included), each as its text, with its most likely alternatives where the turn asked."""

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    tops = turn.top_logprobs or [[] for _ in turn.output_ids]
    content = [
        token(token_id, logprob) | {"top_logprobs": [token(i, lp) for i, lp in top]}
        for token_id, logprob, top in zip(turn.output_ids, turn.logprobs, tops, strict=True)
    ]
    return {"content": content, "refusal": None}


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
                raise BadRequest("body", "a JSON object (a chat completion request)")
            args = _turn_args(body)
        except json.JSONDecodeError as e:
            return _error(400, f"the body is not JSON: {e}")
        except BadRequest as e:
            return _error(400, str(e), param=e.param)
        try:
            turn = await episode.chat_turn(**args)
        except EpisodeDone:
            turn = Turn([], "", "length", 0, 0, 0, message={"role": "assistant", "content": ""})
        except Exception as e:  # noqa: BLE001 - the episode fails, not the server: its runner reads why
            self.failures[key] = e
            log.warning("episode endpoint call failed: %s: %s", type(e).__name__, e)
            return _error(500, f"the episode has failed: {type(e).__name__}: {e}", "server_error")
        return web.json_response(self._answer(turn, episode.tokenizer if body.get("logprobs") else None))

    def _answer(self, turn: Turn, tokenizer: Any | None) -> dict[str, Any]:
        """The completion answering ``turn``, with its log-probs where ``tokenizer`` is given. A call that found the
        episode's token budget spent generated nothing: it answers an empty message that ends the agent's loop, with
        finish_reason "stop" (frameworks refuse an empty "length" answer as a model error; the samples record the
        truncation, and ``episode.done`` says it)."""
        assert turn.message is not None  # a chat turn's
        finish_reason = "stop" if not turn.output_ids and turn.finish_reason == "length" else turn.finish_reason
        choice = {
            "index": 0,
            "message": turn.message,
            "finish_reason": finish_reason,
            "logprobs": None if tokenizer is None else _logprobs(turn, tokenizer),
        }
        prompt, completion = turn.prompt_tokens, turn.completion_tokens
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": turn.cached_tokens},
            },
        }
