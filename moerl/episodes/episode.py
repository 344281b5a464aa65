"""One agent episode's exact token stream, and the samples it yields.

Token in, token out: what the engine generated is kept as its ids, never decoded and encoded again. An episode is a
stream of prompt tokens, then turns: context the caller appends (tool results, environment text, chat-template
tokens; ``loss_mask`` 0) and the model's output (actions; ``loss_mask`` 1). Each turn sends the whole stream to the
engine, which reuses its prefix cache for what earlier turns computed.

Forks. At message level (:meth:`Episode.chat`) the caller passes the whole history, rendered with the tokenizer's chat
template. Templates are not append-only (Qwen3's drops earlier reasoning, tool arguments are serialised again, a stop
token is rendered again as a delimiter): where the rendering does not extend the stream token for token, the current
sample is closed and a new one starts with the rendering as its prompt. A sample never holds tokens the model did not
see, and its actions are exactly what the engine sampled. A stream without actions yet is replaced, not forked.

Routing across turns (R3). The first turn of a sample asks for routing from position 0; each later turn only for the
rows it has not got (``routed_experts_start_len`` = rows so far = the stream before its new context, less one) and
appends them: rows are never overwritten, and a patch that does not start where the last ended is an error. Where the
engine computed part of the prefix again (``cached_tokens < routed_experts_start_len``: eviction, retract, flush, maybe
under newer weights), the rule is: the earlier rows are kept, since they are what the earlier tokens were sampled
under, and the positions ``cached_tokens..start_len`` are counted in ``stats.recomputed_positions``
(``routing/recomputed_positions``). Kept sets follow the stream the same way: one per output token, empty for context.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from moerl.engines.protocol import Completion, ProtocolError, SamplingParams
from moerl.episodes.parsing import ParsedTurn, parse_hermes
from moerl.episodes.tools import Tool, run_tool
from moerl.errors import MoerlError
from moerl.sample import Sample

# What the rollout manager supplies: one completion (n=1) of ``input_ids`` with routing rows from the given position
# and each output token's given number of most likely alternatives (0: none), and the map of the engine's
# weight-version strings to policy versions (None: int(version)). Retries, regeneration after aborts and prefix-cache
# keys are its business.
Generate = Callable[[list[int], SamplingParams, int, int], Awaitable[tuple[Completion, dict[str, int] | None]]]
END_OF_TURN = "<|im_end|>"  # Qwen's: a chat turn stops on it


class EpisodeError(MoerlError):
    """An episode misused, or an engine answer that does not fit its stream; the message says which."""


class EpisodeDone(EpisodeError):
    """A turn asked of an episode that has ended (its token budget spent, or a turn aborted)."""


_ROUTING_METRICS = {
    "recomputed_positions": "routing/recomputed_positions",
    "routing_rows": "routing/rows_received",
    "full_sequence_rows": "routing/rows_full_sequence",
}


@dataclass
class EpisodeStats:
    turns: int = 0  # engine requests
    tool_calls: int = 0  # parsed from chat turns
    malformed_tool_calls: int = 0  # tool-call blocks that were not calls (left in the content)
    tool_failures: int = 0  # tool runs that answered an error
    forks: int = 0  # samples closed because a rendering did not extend the stream
    context_tokens: int = 0  # appended by the caller between turns
    model_tokens: int = 0  # generated
    recomputed_positions: int = 0  # prefix positions the engine computed again (their earlier routing kept)
    routing_rows: int = 0  # routing rows the engine returned: each position once, across turns
    # the rows had every turn asked for its whole sequence's routing (verl's and SkyRL's multi-turn requests)
    full_sequence_rows: int = 0

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {f"episode/{f.name}": getattr(self, f.name) for f in fields(self)}
        for name, metric in _ROUTING_METRICS.items():
            out[metric] = out.pop(f"episode/{name}")
        return out


@dataclass
class Turn:
    """One generated turn: what an OpenAI-compatible endpoint answers with."""

    output_ids: list[int]
    text: str  # decoded, special tokens skipped
    finish_reason: str  # OpenAI's: "stop" | "length" | "tool_calls"; "abort" where the engine aborted it
    prompt_tokens: int  # the request's input
    completion_tokens: int
    cached_tokens: int  # of the input, reused from the engine's prefix cache
    logprobs: list[float] = field(default_factory=list)  # each output token's behaviour log-prob
    # each output token's most likely tokens with their log-probs (as ``logprobs``), where the turn asked for them
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    message: dict[str, Any] | None = None  # a chat turn's parsed assistant message


@dataclass
class _SampleDraft:
    """One linear token stream, the sample it becomes once it holds an action: per response token, the chunks of each
    array."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    selected: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    kept_lengths: list[np.ndarray] = field(default_factory=list)
    kept_ids: list[np.ndarray] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    routing_starts: list[int] = field(default_factory=list)  # where each answer's rows began
    rows: int = 0  # routing rows so far: positions [0, rows)
    actions: int = 0  # model tokens in the response
    finish_reason: str = ""  # the engine's, of its last turn
    step_ends: list[int] = field(default_factory=list)  # where each turn's output ends in the response: its steps
    step_scores: list[float] = field(default_factory=list)  # each step's score from the environment (0.0: none given)

    def stream(self) -> list[int]:
        return self.prompt + self.response


@dataclass(frozen=True)
class EpisodeSettings:
    """How an episode asks for its turns and reads them: the same for every episode of a run, but for the sampling
    seed.

    ``params``: each turn's sampling (n is 1; a set sampling_seed becomes seed + turn); ``routing`` / ``sampling_mask``:
    whether the episode's ``generate`` asks for routing / kept sets (checked on each completion); ``tools``: what
    :meth:`Episode.run_tools` runs; ``tool_parser``, ``chat_template_kwargs``: how a chat turn is parsed and a history
    rendered; ``end_of_turn``: the token a chat turn stops on (where the tokenizer has it); ``max_total_tokens``: the
    most tokens a stream may hold, prompt included (at most the engine's context length): a turn generates at most up
    to it, and the episode ends once it is reached."""

    tokenizer: Any
    params: SamplingParams
    routing: bool = True
    sampling_mask: bool = False
    tools: Sequence[Tool] = ()
    tool_parser: Callable[[str], ParsedTurn] = parse_hermes
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    end_of_turn: str | None = END_OF_TURN
    max_total_tokens: int | None = None


class Episode:
    """One agent episode: its token stream (and forks), its turns, its stats; :meth:`samples` at the end."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        record: Mapping[str, Any],
        generate: Generate,
        settings: EpisodeSettings,
        *,
        group_id: int = 0,
        index: int = 0,
    ):
        """Episode ``index`` of group ``group_id``: ``record``'s prompt, ``prompt_ids``, continued by ``generate``'s
        turns as ``settings`` say."""
        if not prompt_ids:
            raise EpisodeError("an episode needs at least one prompt token")
        self.record = record
        self.group_id, self.index = group_id, index
        self.settings, self.tokenizer = settings, settings.tokenizer
        self.params = settings.params.model_copy(update={"n": 1})
        self.tools = {tool.name: tool for tool in settings.tools}
        end = settings.end_of_turn
        turn_end = self.tokenizer.convert_tokens_to_ids(end) if end is not None else None
        self.end_of_turn_ids = (
            [turn_end] if isinstance(turn_end, int) and turn_end != self.tokenizer.unk_token_id else []
        )
        self.max_total_tokens = settings.max_total_tokens
        self.stats = EpisodeStats()
        self.turns: list[Turn] = []
        self.final_text = ""  # the last turn's answer (chat: its content), for the task's reward function
        self.finish_reason: str | None = None  # set when the episode ends: "length" (budget) or "abort"
        self.base_url: str | None = None  # the OpenAI-compatible endpoint serving this episode, where there is one
        self._generate = generate
        self._lock = asyncio.Lock()  # one turn at a time: each extends the stream the last one left
        self._draft = _SampleDraft(list(prompt_ids))
        self._closed: list[_SampleDraft] = []
        self._turn_scored = False  # score_turn was called: the samples carry step scores

    # ---- turns ----------------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_turn(self) -> Turn | None:
        return self.turns[-1] if self.turns else None

    def stream(self) -> list[int]:
        """The current sample's tokens: what the next turn feeds, before its new context."""
        return self._draft.stream()

    def score_turn(self, score: float) -> None:
        """The environment's score of the last turn that generated tokens (a tool call that failed, a sub-goal
        reached): that turn's step reward (process rewards, :mod:`moerl.rewards.process`). Turns never scored count
        0.0 once any turn of the episode is; a turn scored again takes the new score."""
        draft = next((d for d in (self._draft, *reversed(self._closed)) if d.step_ends), None)
        if draft is None:
            raise EpisodeError("score_turn before any turn generated a token: there is no turn to score")
        draft.step_scores[-1] = float(score)
        self._turn_scored = True

    async def generate(self, new_ids: Sequence[int] = (), **sampling_overrides: Any) -> list[int]:
        """Token level: append ``new_ids`` as context, generate one turn, append its output; the output ids."""
        params = self._params(sampling_overrides, [])
        async with self._lock:
            self._check_open()
            turn = await self._turn(self._draft, list(new_ids), params)
        self.final_text = turn.text
        return turn.output_ids

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **sampling_overrides: Any
    ) -> dict[str, Any]:
        """Message level, with OpenAI's semantics (``messages``: the whole history): the assistant message of the next
        turn, ``{"role", "content", "tool_calls"?, "reasoning_content"?}``."""
        message = (await self.chat_turn(messages, tools, **sampling_overrides)).message
        assert message is not None, "chat_turn parses every turn"
        return message

    async def chat_turn(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        stop: Sequence[str] = (),
        top_logprobs: int = 0,
        **sampling_overrides: Any,
    ) -> Turn:
        """As :meth:`chat`, the whole turn: its message, finish reason, token counts and log-probs (what an
        OpenAI-compatible endpoint answers). ``stop``: strings the turn ends at, as OpenAI's ``stop``: the output is cut
        after the token that completes the first one found (those tokens stay the sample's actions, nothing after
        them is), and the content ends before it; ``top_logprobs``: how many of each output token's most likely tokens
        to return with their log-probs. Calls made at once run one after the other (a history without an earlier reply
        forks)."""
        params = self._params(sampling_overrides, self.end_of_turn_ids)
        rendered = self._render(messages, tools)
        async with self._lock:
            self._check_open()
            stream = self._draft.stream()
            if rendered[: len(stream)] == stream:
                turn = await self._turn(self._draft, rendered[len(stream) :], params, stop, top_logprobs)
            else:
                turn = await self._turn(_SampleDraft(rendered), [], params, stop, top_logprobs)
        parsed = self.settings.tool_parser(turn.text)
        calls = [
            {"id": f"call_{self.stats.tool_calls + i}", "type": "function", "function": call}
            for i, call in enumerate(parsed.tool_calls)
        ]
        self.stats.tool_calls += len(calls)
        self.stats.malformed_tool_calls += parsed.malformed
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
            if turn.finish_reason == "stop":
                turn.finish_reason = "tool_calls"
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        turn.message = message
        self.final_text = parsed.content
        return turn

    async def run_tools(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tool messages answering ``calls`` (OpenAI tool calls), run at once, in their order; failures counted."""
        outputs = await asyncio.gather(*(run_tool(self.tools, call) for call in calls))
        self.stats.tool_failures += sum(out.failed for out in outputs)
        return [out.message for out in outputs]

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The episode's tools as OpenAI function schemas (None: it has none)."""
        return [tool.schema() for tool in self.tools.values()] or None

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **self.settings.chat_template_kwargs,
            )
        )

    def _check_open(self) -> None:
        if self.done:
            raise EpisodeDone(f"episode {self.index} of group {self.group_id} has ended ({self.finish_reason})")

    def _params(self, overrides: dict[str, Any], stop_ids: list[int]) -> SamplingParams:
        if overrides.get("n", 1) != 1:
            raise EpisodeError("an episode's turn is one completion: n must be 1")
        # One temperature for the whole sample: the behaviour log-probs are scaled by it and the trainer scores with it.
        if overrides.get("temperature", self.params.temperature) != self.params.temperature:
            raise EpisodeError(
                f"temperature {overrides['temperature']} differs from the episode's {self.params.temperature}: "
                "every token of a sample is sampled (and trained) at one temperature"
            )
        try:
            params = SamplingParams.parse({**self.params.model_dump(), **overrides})
        except ProtocolError as e:
            raise EpisodeError(f"sampling overrides: {e}") from None
        # A turn's cap may lower the run's (rollout.max_new_tokens), never raise it.
        params = params.model_copy(update={"max_new_tokens": min(params.max_new_tokens, self.params.max_new_tokens)})
        stops = list(dict.fromkeys([*(params.stop_token_ids or []), *stop_ids]))
        return params.model_copy(update={"stop_token_ids": stops or None})

    async def _turn(
        self, draft: _SampleDraft, context: list[int], params: SamplingParams, stop: Sequence[str] = (), top: int = 0
    ) -> Turn:
        """One engine request continuing ``draft`` (the current sample's, or a fork's new one) after ``context``, cut at
        the first of the ``stop`` strings, with ``top`` alternatives for each output token. Nothing changes until its
        answer has been checked: a request that fails or is refused leaves the episode as it was."""
        start = draft.rows
        input_ids = draft.stream() + context
        if self.max_total_tokens is not None:
            room = self.max_total_tokens - len(input_ids)
            if room <= 0:  # the context fills the budget: nothing is generated, the episode ends, truncated
                self.finish_reason = self._draft.finish_reason = "length"
                self.turns.append(turn := Turn([], "", "length", len(input_ids), 0, 0))
                return turn
            params = params.model_copy(update={"max_new_tokens": min(params.max_new_tokens, room)})
        if params.sampling_seed is not None:  # each turn draws its own, reproducibly
            params = params.model_copy(update={"sampling_seed": params.sampling_seed + self.stats.turns})
        completion, versions = await self._generate(input_ids, params, start, top)
        self.stats.turns += 1
        finish = completion.finish_reason.get("type", "")
        if finish == "abort" and not len(completion.output_ids):
            # Aborted before its first token (SGLang's waiting queue, a shutdown): it may carry nothing else either.
            self.finish_reason = "abort"
            self.turns.append(turn := Turn([], "", finish, len(input_ids), 0, completion.cached_tokens))
            return turn
        per_token = self._check(completion, versions, start, len(input_ids), top)
        text = self.tokenizer.decode(completion.output_ids.tolist(), skip_special_tokens=True)
        if stop and (cut := self._stop_cut(completion.output_ids.tolist(), text, stop)) is not None:
            kept, matched, text = cut
            completion, per_token = completion.head(kept, {"type": "stop", "matched": matched}), per_token[:kept]
        if draft is not self._draft:
            if self._draft.actions:
                self._closed.append(self._draft)
                self.stats.forks += 1
            self._draft = draft  # a stream without actions is replaced: not a fork
        self._append_context(context)
        self._append_output(completion, per_token, len(input_ids))
        finish = completion.finish_reason.get("type", "")
        draft.finish_reason = finish
        if finish == "abort":
            self.finish_reason = "abort"
        elif finish == "length" and self.max_total_tokens is not None and len(draft.stream()) >= self.max_total_tokens:
            # Cut by the budget. A turn that stopped on the budget's last token leaves the agent free to be done; a
            # call for more then ends the episode, truncated, without a request.
            self.finish_reason = "length"
        output = completion.output_ids.tolist()
        assert completion.logprobs is not None, "checked"
        turn = Turn(output, text, finish, len(input_ids), len(output), completion.cached_tokens)
        turn.logprobs = completion.logprobs.tolist()
        if top:
            assert completion.top_ids is not None and completion.top_logprobs is not None, "checked"
            pairs = zip(completion.top_ids.tolist(), completion.top_logprobs.tolist(), strict=True)
            turn.top_logprobs = [list(zip(ids, lps, strict=True)) for ids, lps in pairs]
        self.turns.append(turn)
        return turn

    def _stop_cut(self, output: list[int], text: str, stop: Sequence[str]) -> tuple[int, str, str] | None:
        """Where ``output`` (decoded: ``text``) meets the first of ``stop``: the tokens through the one that completes
        it, the string, and the text before it. None: it meets none."""
        found = [(text.find(s), s) for s in stop if s and s in text]
        if not found:
            return None
        at, matched = min(found)
        # The shortest prefix whose text holds the string: a longer prefix's text extends a shorter one's.
        lo, hi = 1, len(output)
        while lo < hi:
            mid = (lo + hi) // 2
            if matched in self.tokenizer.decode(output[:mid], skip_special_tokens=True):
                hi = mid
            else:
                lo = mid + 1
        return lo, matched, text[:at]

    def _check(
        self, c: Completion, versions: dict[str, int] | None, start: int, input_len: int, top: int = 0
    ) -> np.ndarray:
        """That ``c`` answers a request of ``input_len`` tokens with routing from ``start``, and has all the episode
        needs; its tokens' policy versions."""
        n = len(c.output_ids)
        if c.prompt_len != input_len:
            raise EpisodeError(f"the engine answered for a {c.prompt_len}-token prompt, not {input_len}")
        if c.logprobs is None:
            raise EpisodeError("the completion has no output log-probs: generate must ask for return_logprob")
        if top and (c.top_ids is None or c.top_logprobs is None):
            raise EpisodeError("the completion has no top log-probs: generate must ask for top_logprobs_num")
        if self.settings.sampling_mask and (
            c.mask_offsets is None or c.mask_ids is None or c.sampling_logprobs is None
        ):
            raise EpisodeError("the completion has no kept sets: generate must ask for return_sampling_mask")
        if self.settings.routing:
            if c.routing is None:
                raise EpisodeError("the completion has no routing: generate must ask for return_routed_experts")
            if c.routing_start != start:
                raise EpisodeError(
                    f"a routing patch starts at position {c.routing_start}, but the stream's rows end at {start}: "
                    "generate must pass routed_experts_start_len on"
                )
            rows = input_len + n - 1 - start  # SGLang: rows for positions [start, seqlen - 1)
            if len(c.routing) != rows:
                raise EpisodeError(f"the routing patch has {len(c.routing)} rows, not {rows} (from position {start})")
        per_token = np.full(n, -1, np.int64)
        for span in c.weight_versions:
            v = span["version"]
            per_token[span["start"] : span["end"]] = versions[v] if versions is not None else int(v)
        if n and per_token.min() < 0:
            raise EpisodeError(f"the completion's weight_versions {c.weight_versions} do not cover its {n} tokens")
        return per_token

    def _append_context(self, ids: list[int]) -> None:
        draft = self._draft
        self.stats.context_tokens += len(ids)
        if not draft.actions:  # before the first action everything is prompt
            draft.prompt.extend(ids)
            return
        n = len(ids)
        draft.response.extend(ids)
        draft.loss_mask.extend([0] * n)
        draft.logprobs.append(np.zeros(n, np.float32))
        draft.selected.append(np.zeros(n, np.float32))
        draft.versions.append(np.full(n, -1, np.int64))
        draft.kept_lengths.append(np.zeros(n, np.int64))

    def _append_output(self, c: Completion, versions: np.ndarray, input_len: int) -> None:
        """Append a checked completion's tokens (and their routing rows, from where the stream's end)."""
        draft, n = self._draft, len(c.output_ids)
        if self.settings.routing:
            assert c.routing is not None, "checked"
            if draft.rows:  # a later turn: what the engine did not reuse from its cache it computed again
                self.stats.recomputed_positions += max(0, draft.rows - c.cached_tokens)
            draft.routing.append(c.routing)
            draft.routing_starts.append(draft.rows)
            draft.rows = input_len + n - 1
            self.stats.routing_rows += len(c.routing)
            self.stats.full_sequence_rows += draft.rows
        if self.settings.sampling_mask:
            assert c.mask_offsets is not None and c.mask_ids is not None and c.sampling_logprobs is not None, "checked"
            draft.kept_lengths.append(np.diff(c.mask_offsets))
            draft.kept_ids.append(c.mask_ids)
            draft.selected.append(c.sampling_logprobs.astype(np.float32))
        assert c.logprobs is not None, "checked"
        draft.response.extend(c.output_ids.tolist())
        draft.loss_mask.extend([1] * n)
        draft.actions += n
        if n:
            draft.step_ends.append(len(draft.response))
            draft.step_scores.append(0.0)
        draft.logprobs.append(c.logprobs.astype(np.float32))
        draft.versions.append(versions)
        self.stats.model_tokens += n

    # ---- samples --------------------------------------------------------------------------------------------------
    def samples(self, reward: float, temperature: float) -> list[Sample]:
        """One validated sample per stream that holds an action (the original, then each fork), each with ``reward``,
        the group id and the episode index, its turns as its steps (and their scores, where the environment gave any).
        Context after a stream's last action is left out (nothing follows it to learn)."""
        return [self._sample(draft, reward, temperature) for draft in (*self._closed, self._draft) if draft.actions]

    def _sample(self, draft: _SampleDraft, reward: float, temperature: float) -> Sample:
        mask = np.asarray(draft.loss_mask, np.uint8)
        r = int(np.flatnonzero(mask)[-1]) + 1
        p = len(draft.prompt)
        offsets = kept_ids = selected = None
        if self.settings.sampling_mask:
            offsets = np.zeros(r + 1, np.int64)
            np.cumsum(np.concatenate(draft.kept_lengths)[:r], out=offsets[1:])
            kept_ids = np.concatenate(draft.kept_ids)[: offsets[-1]]
            selected = np.concatenate(draft.selected)[:r]
        routing = starts = None
        if self.settings.routing:
            routing = np.concatenate(draft.routing)[: p + r - 1]
            # the answers whose rows the sample keeps (context after its last action is left out)
            starts = np.asarray([x for x in draft.routing_starts if x < p + r - 1], np.int64)
        return Sample(
            prompt_ids=np.asarray(draft.prompt, np.int32),
            response_ids=np.asarray(draft.response[:r], np.int32),
            behaviour_logprobs=np.concatenate(draft.logprobs)[:r],
            versions=np.concatenate(draft.versions)[:r],
            loss_mask=mask[:r],
            temperature=temperature,
            selected_logprobs=selected,
            routing=routing,
            routing_starts=starts,
            mask_offsets=offsets,
            mask_ids=kept_ids,
            reward=float(reward),
            group_id=self.group_id,
            episode=self.index,
            finish_reason=draft.finish_reason,
            step_ends=np.asarray(draft.step_ends, np.int64),
            step_rewards=np.asarray(draft.step_scores, np.float32) if self._turn_scored else None,
        ).validate()
